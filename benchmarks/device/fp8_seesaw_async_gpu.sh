#!/usr/bin/env bash
# On the H200 (devpack set up, env.sh sourced), twenty-first session: the fp8 seesaw built without serialized WGMMAs
# (its WG1 P_b V_R issue and wait in one branch; ptxas C7518 before, 88 WARPGROUP.DEPBAR, one per HGMMA, in every
# fp8 seesaw kernel up to 0.2.15), and the seesaw's option lazy_rescale. Carry a .kcache prebuilt from this kernels/
# folder (benchmarks/device/prebuild_kcache.sh).
#   1. GPU tests under timeout TT (default 300 s): test_wgmma_gpu.py (the fp8 seesaw's cases: fp64 reference, NaN
#      tails, every tile count, graphs), test_seesaw_lazy_gpu.py, the backend's fp8 seesaw class
#   2. benchmarks/wgmma_speed.py --kv fp8: ways seesaw, seesaw_lazy, fa3 (interleaved per shape)
#   3. bf16: balanced_tma (the backend's kernel at 64+ rows), balanced_tma_lazy, fa3
# Files under $OUT: gpu.txt, fp8async_gpu_tests.log, fp8async_speed.{txt,json}, lazy_bf16_speed.{txt,json},
# summary.txt. Run (repository root): OUT=/tmp/out bash benchmarks/device/fp8_seesaw_async_gpu.sh
source "$(dirname "$0")/project_env.sh"
export PYTHONPATH=plugins/cute_dsl_mla:plugins/cute_dsl_mla/tests:.:$PYTHONPATH PYTHONUNBUFFERED=1
T=plugins/cute_dsl_mla/tests
{
  start=$(date +%s)
  timeout ${TT:-300} python -m pytest -q -p no:cacheprovider -rfs $T/test_wgmma_gpu.py $T/test_seesaw_lazy_gpu.py \
    "$T/test_backend_gpu.py::TestCuteDslSeesawConformance" > "$OUT/fp8async_gpu_tests.log" 2>&1
  echo "GPU tests rc=$? in $(( $(date +%s) - start )) s"
  grep -E "passed|failed|FAILED|ERROR|Timeout" "$OUT/fp8async_gpu_tests.log" | tail -8
  start=$(date +%s)
  timeout ${SPEED_TIMEOUT:-150} python benchmarks/wgmma_speed.py --kv fp8 \
    --shapes 128x128x1x4096,128x128x1x8192,64x128x2x4096,16x128x1x4096,128x64x2x4096 \
    --ways seesaw,seesaw_lazy,fa3 --reps 50 --json "$OUT/fp8async_speed.json" > "$OUT/fp8async_speed.txt" 2>&1
  echo "fp8 speed rc=$? in $(( $(date +%s) - start )) s"; grep -A20 "^   B " "$OUT/fp8async_speed.txt" | head -24
  start=$(date +%s)
  timeout ${SPEED_TIMEOUT:-150} python benchmarks/wgmma_speed.py \
    --shapes 128x128x1x4096,128x128x2x4096,64x128x1x4096,16x128x1x4096,128x128x1x800 \
    --ways balanced_tma,balanced_tma_lazy,fa3 --reps 50 --json "$OUT/lazy_bf16_speed.json" \
    > "$OUT/lazy_bf16_speed.txt" 2>&1
  echo "bf16 lazy speed rc=$? in $(( $(date +%s) - start )) s"; grep -A20 "^   B " "$OUT/lazy_bf16_speed.txt" | head -24
} 2>&1 | tee "$OUT/summary.txt"
