#!/usr/bin/env bash
# On the H200 (devpack set up, env.sh sourced; prebuilt kernel cache: benchmarks/device/prebuild_kcache.sh, whose
# list has the combine=fused kernels): option combine=fused (kernels/fused_merge.py) checked and timed.
#   PART=tests: tests/test_fused_merge_gpu.py (fp64 reference, eager x2 + graph replay x3 bitwise equal with the
#               arrival counters back at zero, equal to the combine kernel) and the conformance classes
#               test_backend_gpu.py -k "${TK:-FusedCombine}", under timeout ${TT:-280} -> $OUT/fused_gpu_tests.log
#   PART=bench: mla bench on GRIDS (default benchmarks/grids/fused_ab_target.toml, the B=64 H=16 s_q=1 S=8192
#               target cell, and fused_ab.toml, 42 cells at H=16 s_q 1-2, B=1-64, S=1024-4096) with cute_dsl_mla
#               (default: combine=auto), cute_dsl_mla:combine=fused and FlashInfer fa3, budget ${BUDGET:-0.05},
#               under timeout ${BT:-240} each -> $OUT/fused_ab_target.{txt,json}, $OUT/fused_ab.{txt,json}
# At most 5 files under $OUT; each PART stays under 5 minutes with a prebuilt cache.
source "$(dirname "$0")/project_env.sh"
export PYTHONPATH=plugins/cute_dsl_mla:.:$PYTHONPATH PYTHONUNBUFFERED=1
export MLA_CUTE_DSL_TEST_CACHE_DIR=${KCACHE:-/tmp/mla_kcache} MLA_CUTE_DSL_CACHE_DIR=${KCACHE:-/tmp/mla_kcache}
T=plugins/cute_dsl_mla/tests
if [ "${PART:-tests}" = tests ]; then
  start=$(date +%s)
  timeout ${TT:-280} python -m pytest -q -p no:cacheprovider -rfs $T/test_fused_merge_gpu.py $T/test_backend_gpu.py \
    -k "${TK:-FusedCombine or fused}" > "$OUT/fused_gpu_tests.log" 2>&1
  echo "fused GPU tests rc=$? in $(( $(date +%s) - start )) s"; tail -3 "$OUT/fused_gpu_tests.log"
else
  for g in ${GRIDS:-fused_ab_target fused_ab}; do
    start=$(date +%s)
    timeout ${BT:-240} python -m mlacore bench --device cuda --grid benchmarks/grids/$g.toml --backend cute_dsl_mla \
      --backend cute_dsl_mla:combine=fused --backend flashinfer_mla:variant=fa3 --budget ${BUDGET:-0.05} \
      --no-progress -o "$OUT/$g.json" > "$OUT/$g.txt" 2>&1
    echo "$g rc=$? in $(( $(date +%s) - start )) s"; tail -5 "$OUT/$g.txt"
  done
fi
