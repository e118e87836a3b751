#!/usr/bin/env bash
# On the H200 (devpack set up, env.sh sourced): the fp8 ring producer with WG1's QK part order
# (MLADecodePartialWGMMASeesaw(fp8_producer=True, fp8p_ring=7, wg1_other_first=True); branch fp8-wg1of, written
# compile-only: warpgroup 1's QK of its tile b waits full[2] (WG0's columns + RoPE) first, and the ring converts tile
# b's part 2 before part 3) against the ring kernel without it (the backend's fp8 default) and fa3. Carry a .kcache
# prebuilt from this kernels/ folder (every cache key hashes the kernels' source):
#   ONLY="ring_wg1of|seesaw_fp8p_ring bf16 fp32 r7|seesaw_fp8p_ring_balanced bf16 fp32 r7|seesaw_fp8p_ring fp16 fp32 r7|seesaw_fp8p_ring_balanced fp16 fp32 r7|r7 lazy|combine" \
#     bash benchmarks/device/prebuild_kcache.sh
#   0. benchmarks/seesaw_tmap_hang_probe.py --kernel fp8ring_wg1of (12 cases, smallest first, each in a child
#      process under PT seconds, default 60; balanced and one item per CTA, each against the fp64 reference and the
#      ring without the option; rc 124: a hang, the rest skipped)
#   1. benchmarks/wgmma_speed.py --kv fp8 under timeout ST (default 240 s), median of REPS (default 50) graph replays:
#      ways (WAYS to override) seesaw_fp8p_ring_lazy, seesaw_fp8p_ring_wg1of_lazy, balanced_fp8p_ring_lazy,
#      balanced_fp8p_ring_wg1of_lazy, fa3 at 128x128x1x4096, 128x128x2x4096, 64x128x1x4096 (SHAPES to override)
#   2. GPU tests under timeout TT (default 600 s): test_seesaw_fp8p_ring_wg1of_gpu.py (45 tests, -x)
# Files under $OUT: gpu.txt, wg1of_probe.log, wg1of_speed.{txt,json}, wg1of_gpu_tests.log, summary.txt.
# Run (repository root): OUT=/tmp/out bash benchmarks/device/fp8_ring_wg1of_gpu.sh   (SKIP_TESTS=1: probe and speed)
source "$(dirname "$0")/project_env.sh"
export PYTHONPATH=plugins/cute_dsl_mla:plugins/cute_dsl_mla/tests:.:$PYTHONPATH PYTHONUNBUFFERED=1
T=plugins/cute_dsl_mla/tests
{
  start=$(date +%s)
  python benchmarks/seesaw_tmap_hang_probe.py --kernel fp8ring_wg1of --timeout ${PT:-60} > "$OUT/wg1of_probe.log" 2>&1
  rc=$?
  echo "hang probe rc=$rc in $(( $(date +%s) - start )) s"; tail -48 "$OUT/wg1of_probe.log"
  if [ $rc -eq 124 ] || [ $rc -eq 2 ]; then
    echo "probe hung or did not compile; skipping the speed runs and the GPU tests"
    exit $rc
  fi
  start=$(date +%s)
  timeout ${ST:-240} python benchmarks/wgmma_speed.py --kv fp8 \
    --shapes ${SHAPES:-128x128x1x4096,128x128x2x4096,64x128x1x4096} \
    --ways ${WAYS:-seesaw_fp8p_ring_lazy,seesaw_fp8p_ring_wg1of_lazy,balanced_fp8p_ring_lazy,balanced_fp8p_ring_wg1of_lazy,fa3} \
    --reps ${REPS:-50} --json "$OUT/wg1of_speed.json" > "$OUT/wg1of_speed.txt" 2>&1
  echo "fp8 speed rc=$? in $(( $(date +%s) - start )) s"; grep -A30 "^   B " "$OUT/wg1of_speed.txt" | head -30
  grep -E "MISMATCH|error" "$OUT/wg1of_speed.txt" | head -8
  if [ -z "${SKIP_TESTS:-}" ]; then
    start=$(date +%s)
    timeout ${TT:-600} python -m pytest -q -p no:cacheprovider -rfs -x -s $T/test_seesaw_fp8p_ring_wg1of_gpu.py \
      > "$OUT/wg1of_gpu_tests.log" 2>&1
    echo "GPU tests rc=$? in $(( $(date +%s) - start )) s"
    grep -E "passed|failed|FAILED|ERROR|Timeout" "$OUT/wg1of_gpu_tests.log" | tail -12
    grep -E "bitwise (True|False)" "$OUT/wg1of_gpu_tests.log" | awk '{print $NF}' | sort | uniq -c
  fi
} 2>&1 | tee "$OUT/summary.txt"
