#!/usr/bin/env bash
# On the H200 (devpack set up, env.sh sourced), from a checkout of main: cute_dsl_mla's option
# split_kv=balanced (the balanced mma.sync kernel with the hybrid plan). In one device call of ~200 s at most:
#   1. GPU tests: test_split_kv_gpu.py (through the backend: fp64 reference, graph captured at one plan form and
#      replayed at the other), then test_balanced_gpu.py (the balanced kernel, form forced), each under timeout
#   2. bench_kernel.py --balanced: default vs balanced (forced) vs hybrid, and the form the hybrid picked
#   3. mla bench on benchmarks/grids/varlen_h16.toml (4 cells): cute_dsl_mla split_kv=even and =balanced, fa3
# One kernel cache for all three (the tests compile, the benchmarks load from disk). Logs and JSON under $OUT.
source "$(dirname "$0")/project_env.sh"
export PYTHONPATH=plugins/cute_dsl_mla:.:$PYTHONPATH
export MLA_CUTE_DSL_TEST_CACHE_DIR=${KCACHE:-/tmp/mla_kcache} MLA_CUTE_DSL_CACHE_DIR=${KCACHE:-/tmp/mla_kcache}
T=plugins/cute_dsl_mla/tests
for t in test_split_kv_gpu test_balanced_gpu; do
  start=$(date +%s)
  timeout ${TT:-55} python -m pytest -q -p no:cacheprovider -rfs $T/$t.py > "$OUT/$t.log" 2>&1
  echo "$t rc=$? in $(( $(date +%s) - start )) s"; grep -E "passed|failed|FAILED|ERROR" "$OUT/$t.log" | tail -8
done
start=$(date +%s)
timeout ${BENCH_TIMEOUT:-45} python plugins/cute_dsl_mla/benchmarks/bench_kernel.py --balanced --reps 50 \
  --json "$OUT/split_kv_speed.json" > "$OUT/split_kv_speed.txt" 2>&1
echo "bench_kernel rc=$? in $(( $(date +%s) - start )) s"; tail -9 "$OUT/split_kv_speed.txt"
start=$(date +%s)
timeout ${MLA_BENCH_TIMEOUT:-50} python -m mlacore bench --device cuda --grid benchmarks/grids/varlen_h16.toml \
  --backend cute_dsl_mla:split_kv=even --backend cute_dsl_mla:split_kv=balanced --backend flashinfer_mla:variant=fa3 \
  --budget ${BUDGET:-0.05} --no-progress -o "$OUT/varlen_h16_bench.json" > "$OUT/varlen_h16_bench.txt" 2>&1
echo "mla bench rc=$? in $(( $(date +%s) - start )) s"; tail -30 "$OUT/varlen_h16_bench.txt"
