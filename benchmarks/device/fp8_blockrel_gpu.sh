#!/usr/bin/env bash
# On the H200 (devpack set up, env.sh sourced): the fp8 ring producer with per-block release
# (MLADecodePartialWGMMASeesaw(fp8_producer=True, fp8p_ring=7, fp8p_block_release=True); branch fp8-block-release,
# written compile-only: warpgroup 1's end-of-pair part released, refilled and waited per 64-column block, every P V as
# N = 64 WGMMAs) against the ring kernel without it (the backend's fp8 default) and fa3. Carry a .kcache prebuilt from
# this kernels/ folder:
#   ONLY="fp8pbr|seesaw_fp8p_ring bf16 fp32 r7|seesaw_fp8p_ring_balanced bf16 fp32 r7|seesaw_fp8p_ring fp16 fp32 r7|seesaw_fp8p_ring_balanced fp16 fp32 r7|r7 lazy|combine" \
#     bash benchmarks/device/prebuild_kcache.sh
#   0. benchmarks/seesaw_fp8pbr_hang_probe.py (12 cases, smallest first, each in a child process under PT seconds,
#      default 60; rc 124: a hang, the rest skipped)
#   1. benchmarks/wgmma_speed.py --kv fp8 under timeout ST (default 220 s), median of REPS (default 50) graph replays:
#      ways (WAYS to override) seesaw_fp8p_ring_lazy, seesaw_fp8p_ring_blk_lazy, balanced_fp8p_ring_lazy,
#      balanced_fp8p_ring_blk_lazy, fa3 at 128x128x1x4096, 128x128x2x4096, 64x128x1x4096 (SHAPES to override)
#   2. GPU tests under timeout TT (default 600 s): test_seesaw_fp8p_blockrel_gpu.py (59 tests, -x)
# Files under $OUT: gpu.txt, blockrel_probe.log, blockrel_speed.{txt,json}, blockrel_gpu_tests.log, summary.txt.
# Run (repository root): OUT=/tmp/out bash benchmarks/device/fp8_blockrel_gpu.sh   (SKIP_TESTS=1: probe and speed only)
source "$(dirname "$0")/project_env.sh"
export PYTHONPATH=plugins/cute_dsl_mla:plugins/cute_dsl_mla/tests:.:$PYTHONPATH PYTHONUNBUFFERED=1
T=plugins/cute_dsl_mla/tests
{
  start=$(date +%s)
  python benchmarks/seesaw_fp8pbr_hang_probe.py --timeout ${PT:-60} > "$OUT/blockrel_probe.log" 2>&1
  rc=$?
  echo "hang probe rc=$rc in $(( $(date +%s) - start )) s"; tail -40 "$OUT/blockrel_probe.log"
  if [ $rc -eq 124 ] || [ $rc -eq 2 ]; then
    echo "probe hung or did not compile; skipping the speed runs and the GPU tests"
    exit $rc
  fi
  start=$(date +%s)
  timeout ${ST:-220} python benchmarks/wgmma_speed.py --kv fp8 \
    --shapes ${SHAPES:-128x128x1x4096,128x128x2x4096,64x128x1x4096} \
    --ways ${WAYS:-seesaw_fp8p_ring_lazy,seesaw_fp8p_ring_blk_lazy,balanced_fp8p_ring_lazy,balanced_fp8p_ring_blk_lazy,fa3} \
    --reps ${REPS:-50} --json "$OUT/blockrel_speed.json" > "$OUT/blockrel_speed.txt" 2>&1
  echo "fp8 speed rc=$? in $(( $(date +%s) - start )) s"; grep -A30 "^   B " "$OUT/blockrel_speed.txt" | head -30
  grep -E "MISMATCH|error" "$OUT/blockrel_speed.txt" | head -8
  if [ -z "${SKIP_TESTS:-}" ]; then
    start=$(date +%s)
    timeout ${TT:-600} python -m pytest -q -p no:cacheprovider -rfs -x $T/test_seesaw_fp8p_blockrel_gpu.py \
      > "$OUT/blockrel_gpu_tests.log" 2>&1
    echo "GPU tests rc=$? in $(( $(date +%s) - start )) s"
    grep -E "passed|failed|FAILED|ERROR|Timeout" "$OUT/blockrel_gpu_tests.log" | tail -12
  fi
} 2>&1 | tee "$OUT/summary.txt"
