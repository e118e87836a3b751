#!/usr/bin/env bash
# On the H200 (devpack set up, env.sh sourced): the balanced split-KV mma.sync kernel (the backend's
# split_kv=balanced runs it) -- its GPU tests (fp64 reference, vs the default kernel, graph replay with new
# lengths), then the default vs balanced speed at B64 H16 S8192, B128 H16 s_q2 S4096, B1/B32 H16 S4096 and B100
# H16 varlen (bf16, same process, graph replay).
source "$(dirname "$0")/project_env.sh"
export PYTHONPATH=plugins/cute_dsl_mla:.:$PYTHONPATH
timeout ${TEST_TIMEOUT:-150} python -m pytest -q -p no:cacheprovider -rfs \
  plugins/cute_dsl_mla/tests/test_balanced_gpu.py 2>&1 \
  | tee "$OUT/balanced_gpu_tests.log" | grep -E "passed|failed|FAILED|ERROR" | tail -20
timeout ${BENCH_TIMEOUT:-150} python plugins/cute_dsl_mla/benchmarks/bench_kernel.py --balanced --reps 50 \
  --json "$OUT/balanced_speed.json" > "$OUT/balanced_speed.txt" 2>&1; echo "bench rc=$?"
tail -8 "$OUT/balanced_speed.txt"
