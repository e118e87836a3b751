#!/usr/bin/env bash
# On the H200 (devpack set up, env.sh sourced): option combine checked and timed.
#   1. GPU tests: test_backend_gpu.py -k "ChunkedCombine or WideCombine" (the conformance suite with each combine
#      forced), under timeout ${TT:-240} -> $OUT/combine_gpu_tests.log
#   2. mla bench on benchmarks/grids/${GRID:-combine_ab}.toml (combine_ab: 72 cells at H=16; combine_ab_h128: 48 at
#      H=128) with cute_dsl_mla (auto: since 0.2.7 schedule.combine_kind_for; the tenth session's run of combine_ab
#      had the earlier rule there), :combine=chunked, :combine=row, :combine=wide and fa3, budget ${BUDGET:-0.05},
#      under timeout ${BT:-300} -> $OUT/${GRID:-combine_ab}.{txt,json}. TT=0 skips the tests.
source "$(dirname "$0")/project_env.sh"
export PYTHONPATH=plugins/cute_dsl_mla:.:$PYTHONPATH PYTHONUNBUFFERED=1
export MLA_CUTE_DSL_TEST_CACHE_DIR=${KCACHE:-/tmp/mla_kcache} MLA_CUTE_DSL_CACHE_DIR=${KCACHE:-/tmp/mla_kcache}
start=$(date +%s)
[ "${TT:-240}" = 0 ] || timeout ${TT:-240} python -m pytest -q -p no:cacheprovider -rfs plugins/cute_dsl_mla/tests/test_backend_gpu.py \
  -k "ChunkedCombine or WideCombine" > "$OUT/combine_gpu_tests.log" 2>&1
echo "combine GPU tests rc=$? in $(( $(date +%s) - start )) s"; tail -2 "$OUT/combine_gpu_tests.log"
start=$(date +%s)
G=${GRID:-combine_ab}
timeout ${BT:-300} python -m mlacore bench --device cuda --grid benchmarks/grids/$G.toml --backend cute_dsl_mla \
  --backend cute_dsl_mla:combine=chunked --backend cute_dsl_mla:combine=row --backend cute_dsl_mla:combine=wide \
  --backend flashinfer_mla:variant=fa3 --budget ${BUDGET:-0.05} --no-progress -o "$OUT/$G.json" > "$OUT/$G.txt" 2>&1
echo "combine A/B rc=$? in $(( $(date +%s) - start )) s"
