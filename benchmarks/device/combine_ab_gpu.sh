#!/usr/bin/env bash
# On the H200 (devpack set up, env.sh sourced): option combine checked and timed.
#   1. GPU tests: test_backend_gpu.py -k "ChunkedCombine or WideCombine" (the conformance suite with each combine
#      forced), under timeout ${TT:-240} -> $OUT/combine_gpu_tests.log
#   2. mla bench on benchmarks/grids/combine_ab.toml (72 cells) with cute_dsl_mla (auto), :combine=chunked,
#      :combine=row and fa3, budget ${BUDGET:-0.05}, under timeout ${BT:-300} -> $OUT/combine_ab.{txt,json}
source "$(dirname "$0")/project_env.sh"
export PYTHONPATH=plugins/cute_dsl_mla:.:$PYTHONPATH PYTHONUNBUFFERED=1
export MLA_CUTE_DSL_TEST_CACHE_DIR=${KCACHE:-/tmp/mla_kcache} MLA_CUTE_DSL_CACHE_DIR=${KCACHE:-/tmp/mla_kcache}
start=$(date +%s)
timeout ${TT:-240} python -m pytest -q -p no:cacheprovider -rfs plugins/cute_dsl_mla/tests/test_backend_gpu.py \
  -k "ChunkedCombine or WideCombine" > "$OUT/combine_gpu_tests.log" 2>&1
echo "combine GPU tests rc=$? in $(( $(date +%s) - start )) s"; tail -2 "$OUT/combine_gpu_tests.log"
start=$(date +%s)
timeout ${BT:-300} python -m mlacore bench --device cuda --grid benchmarks/grids/combine_ab.toml --backend cute_dsl_mla \
  --backend cute_dsl_mla:combine=chunked --backend cute_dsl_mla:combine=row --backend flashinfer_mla:variant=fa3 \
  --budget ${BUDGET:-0.05} --no-progress -o "$OUT/combine_ab.json" > "$OUT/combine_ab.txt" 2>&1
echo "combine A/B rc=$? in $(( $(date +%s) - start )) s"
