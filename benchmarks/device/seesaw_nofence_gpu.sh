#!/usr/bin/env bash
# On the H200 (devpack set up, env.sh sourced), branch seesaw-tma-nofence (merged as mla-cute-dsl 0.2.15 after
# this script's run in the nineteenth session): the TMA and fp8 seesaw kernels without
# the three reader-side proxy fences per warpgroup and pair (MLADecodePartialWGMMASeesaw.reader_fences), against the
# same kernels with them (reader_fences=True: 0.2.14's code, PTX pinned in tests/test_seesaw_*_compile.py) and fa3.
# Carry a .kcache prebuilt from this branch's kernels/ folder (benchmarks/device/prebuild_kcache.sh).
#   1. GPU tests under timeout TT (default 240 s): test_seesaw_tma_gpu.py (fp64 reference, NaN tails, bitwise equal
#      to the cp.async loads, graphs), test_seesaw_balanced_gpu.py (both plan forms, TMA and cp.async),
#      test_wgmma_gpu.py (the seesaw's fp8 cases among them) and the backend's seesaw classes (test_backend_gpu.py
#      -k Seesaw: the default since 0.2.14 is the TMA kernel at 128+ rows, the fp8 seesaw at H=128 fp8)
#   2. benchmarks/wgmma_speed.py, ways seesaw_tma (no reader fences), seesaw_tma_fenced and fa3 timed interleaved,
#      H=128 bf16: B=128 s_q=1 and 2, B=64 s_q=1 and 2, B=16 s_q=1 S=4096, B=12 s_q=1 S=10000; twice (two processes)
#   3. the same with an fp8 cache: ways seesaw (no reader fences) and seesaw_fenced, fa3, B=128 s_q=1, B=64 s_q=2,
#      B=16 s_q=1, S=4096; twice
# Files under $OUT: gpu.txt, nofence_gpu_tests.log, nofence_speed_run{1,2}.{txt,json},
# nofence_fp8_speed_run{1,2}.{txt,json}, summary.txt (tar them: at most 8 files come back per device call).
# Run (repository root): OUT=/tmp/out bash benchmarks/device/seesaw_nofence_gpu.sh
source "$(dirname "$0")/project_env.sh"
export PYTHONPATH=plugins/cute_dsl_mla:plugins/cute_dsl_mla/tests:.:$PYTHONPATH PYTHONUNBUFFERED=1
T=plugins/cute_dsl_mla/tests
{
  echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  start=$(date +%s)
  timeout ${TT:-240} python -m pytest -q -p no:cacheprovider -rfs $T/test_seesaw_tma_gpu.py $T/test_seesaw_balanced_gpu.py \
    $T/test_wgmma_gpu.py "$T/test_backend_gpu.py" -k "not TestCuteDsl or Seesaw" > "$OUT/nofence_gpu_tests.log" 2>&1
  echo "GPU tests rc=$? in $(( $(date +%s) - start )) s"
  grep -E "passed|failed|FAILED|ERROR|Timeout" "$OUT/nofence_gpu_tests.log" | tail -8
  for run in 1 2; do
    start=$(date +%s)
    timeout ${SPEED_TIMEOUT:-120} python benchmarks/wgmma_speed.py \
      --shapes 128x128x1x4096,128x128x2x4096,64x128x1x4096,64x128x2x4096,16x128x1x4096,12x128x1x10000 \
      --ways seesaw_tma,seesaw_tma_fenced,fa3 --reps 100 --json "$OUT/nofence_speed_run$run.json" \
      > "$OUT/nofence_speed_run$run.txt" 2>&1
    echo "speed run $run rc=$? in $(( $(date +%s) - start )) s"; tail -12 "$OUT/nofence_speed_run$run.txt"
  done
  for run in 1 2; do
    start=$(date +%s)
    timeout ${SPEED_TIMEOUT:-120} python benchmarks/wgmma_speed.py --kv fp8 \
      --shapes 128x128x1x4096,64x128x2x4096,16x128x1x4096 \
      --ways seesaw,seesaw_fenced,fa3 --reps 100 --json "$OUT/nofence_fp8_speed_run$run.json" \
      > "$OUT/nofence_fp8_speed_run$run.txt" 2>&1
    echo "fp8 speed run $run rc=$? in $(( $(date +%s) - start )) s"; tail -8 "$OUT/nofence_fp8_speed_run$run.txt"
  done
} 2>&1 | tee "$OUT/summary.txt"
