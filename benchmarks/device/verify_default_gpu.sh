#!/usr/bin/env bash
# On the H200 (devpack set up, env.sh sourced): the released default of mla-cute-dsl on the GPU,
# in one device call of ~8 minutes at most:
#   1. GPU tests through the backend: test_backend_gpu.py (every conformance class, split_kv=even and
#      num_sms included), test_split_kv_gpu.py, and the engine interface's GPU tests
#   2. mla bench: varlen_h16.toml (split_kv even vs balanced vs fa3), then kernel_targets.toml and
#      kernel_targets_8192.toml (ours vs fa3)
# One kernel cache for all (the tests compile, the benchmarks load from disk). Logs under $OUT.
source "$(dirname "$0")/project_env.sh"
export PYTHONPATH=plugins/cute_dsl_mla:.:$PYTHONPATH
export MLA_CUTE_DSL_TEST_CACHE_DIR=${KCACHE:-/tmp/mla_kcache} MLA_CUTE_DSL_CACHE_DIR=${KCACHE:-/tmp/mla_kcache}
T=plugins/cute_dsl_mla/tests
start=$(date +%s)
timeout ${TT:-270} python -m pytest -q -p no:cacheprovider -m gpu -rfs $T/test_backend_gpu.py $T/test_split_kv_gpu.py \
  tests/test_engine_interface_gpu.py > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests rc=$? in $(( $(date +%s) - start )) s"; grep -E "passed|failed|FAILED|ERROR" "$OUT/gpu_tests.log" | tail -12
bench() {  # name grid budget backends...
  local name=$1 grid=$2 budget=$3; shift 3; local s=$(date +%s)
  timeout ${BENCH_TIMEOUT:-120} python -m mlacore bench --device cuda --grid benchmarks/grids/$grid.toml "$@" \
    --budget $budget --no-progress -o "$OUT/${name}_bench.json" > "$OUT/${name}_bench.txt" 2>&1
  echo "$name rc=$? in $(( $(date +%s) - s )) s"; grep -E "^\| (cute|flash)" "$OUT/${name}_bench.txt" | cut -c1-140
}
bench varlen_h16 varlen_h16 0.05 --backend cute_dsl_mla:split_kv=even --backend cute_dsl_mla --backend flashinfer_mla:variant=fa3
bench kernel_targets kernel_targets 0.1 --backend cute_dsl_mla --backend flashinfer_mla:variant=fa3
bench kernel_targets_8192 kernel_targets_8192 0.1 --backend cute_dsl_mla --backend flashinfer_mla:variant=fa3
