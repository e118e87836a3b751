#!/usr/bin/env bash
# On the H200 (devpack set up, env.sh sourced): mla-cute-dsl's PDL combine launch (every partial kernel triggers
# its dependents at its start; the combine waits in griddepcontrol.wait) checked and timed.
#   1. GPU tests through the backend (test_backend_gpu.py includes TestCuteDslPdlConformance, pdl=true; in the
#      ninth session's run, 0.2.5 had PDL on by default): test_backend_gpu.py, test_split_kv_gpu.py,
#      tests/test_engine_interface_gpu.py, under timeout ${TT:-240} -> $OUT/pdl_gpu_tests.log
#      (TESTS=... to run fewer)
#   2. mla bench on benchmarks/grids/pdl_ab.toml (72 cells) with cute_dsl_mla:pdl=auto and cute_dsl_mla (pdl off, the default since 0.2.6),
#      budget ${BUDGET:-0.05}, under timeout ${BT:-150} -> $OUT/pdl_ab_bench.{txt,json}
#   3. the same on benchmarks/grids/pdl_ab_long.toml (12 cells: B1-4 S16384 at H=16), timeout ${LT:-90}
#      -> $OUT/pdl_ab_long_bench.{txt,json}
source "$(dirname "$0")/project_env.sh"
export PYTHONPATH=plugins/cute_dsl_mla:.:$PYTHONPATH PYTHONUNBUFFERED=1
export MLA_CUTE_DSL_TEST_CACHE_DIR=${KCACHE:-/tmp/mla_kcache} MLA_CUTE_DSL_CACHE_DIR=${KCACHE:-/tmp/mla_kcache}
T=plugins/cute_dsl_mla/tests
start=$(date +%s)
timeout ${TT:-240} python -m pytest -q -p no:cacheprovider -rfs ${TESTS:-$T/test_backend_gpu.py $T/test_split_kv_gpu.py \
  tests/test_engine_interface_gpu.py} > "$OUT/pdl_gpu_tests.log" 2>&1
echo "pdl GPU tests rc=$? in $(( $(date +%s) - start )) s"; tail -3 "$OUT/pdl_gpu_tests.log"
start=$(date +%s)
timeout ${BT:-150} python -m mlacore bench --device cuda --grid benchmarks/grids/pdl_ab.toml --backend cute_dsl_mla:pdl=auto \
  --backend cute_dsl_mla --budget ${BUDGET:-0.05} --no-progress -o "$OUT/pdl_ab_bench.json" \
  > "$OUT/pdl_ab_bench.txt" 2>&1
echo "pdl A/B bench rc=$? in $(( $(date +%s) - start )) s"
start=$(date +%s)
timeout ${LT:-90} python -m mlacore bench --device cuda --grid benchmarks/grids/pdl_ab_long.toml --backend cute_dsl_mla:pdl=auto \
  --backend cute_dsl_mla --budget ${BUDGET:-0.05} --no-progress -o "$OUT/pdl_ab_long_bench.json" \
  > "$OUT/pdl_ab_long_bench.txt" 2>&1
echo "pdl A/B long bench rc=$? in $(( $(date +%s) - start )) s"
