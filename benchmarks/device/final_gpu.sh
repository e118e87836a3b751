#!/usr/bin/env bash
# On the H200 (devpack set up, env.sh sourced): the cute_dsl_mla GPU tests (kernel, conformance, disk cache)
# and the engine-interface GPU tests; then the tuned policy (re-tuned from docs/results/h200_tune_bench.json,
# no measuring) validated against every arm on the second off-grid grid.
source "$(dirname "$0")/project_env.sh"
start=$(date +%s)
timeout ${TEST_TIMEOUT:-260} python -m pytest -q -p no:cacheprovider -m gpu -rfs plugins/cute_dsl_mla/tests tests/test_engine_interface_gpu.py 2>&1 \
  | tee "$OUT/gpu_tests.log" | grep -E "passed|failed|FAILED|ERROR" | tail -30
echo "tests in $(( $(date +%s) - start )) s"
cp mlacore/default_policy.toml "$OUT/h200_tuned_mla.toml"
start=$(date +%s)
timeout ${TUNE_TIMEOUT:-230} python -m mlacore tune --from docs/results/h200_tune_bench.json --device cuda \
  --write "$OUT/h200_tuned_mla.toml" --validate benchmarks/grids/h200_offgrid2.toml \
  --backend flashinfer_mla:variant=fa3 --backend flashinfer_mla:variant=fa2 --backend cute_dsl_mla \
  --budget ${BUDGET:-0.1} --no-progress --validate-output "$OUT/validate2_bench.json" --worst 10 > "$OUT/validate2.txt" 2>&1
echo "validate rc=$? in $(( $(date +%s) - start )) s"
tail -18 "$OUT/validate2.txt"
