#!/usr/bin/env bash
# On the H200 (devpack set up, env.sh sourced): option partials (split-KV partial outputs in q's dtype instead of
# fp32) checked and timed.
#   PART=tests: the GPU conformance classes off the default's partials/stores (test_backend_gpu.py
#               -k "${TK:-QPartials or WideStores or Fp32}": bf16 and fp16 q, every kernel family auto picks, and mma.sync,
#               WGMMA, seesaw, wgmma_t forced), under timeout ${TT:-300} -> $OUT/partials_gpu_tests.log
#   PART=bench: mla bench on GRIDS (default benchmarks/grids/partials_ab_h16.toml, 72 cells, and partials_ab_h128.toml,
#               12 cells; stores_ab_h128.toml: 12 cells without splits at B >= 64)
#               with cute_dsl_mla:partials=fp32, cute_dsl_mla:partials=fp32,stores=wide (only the out stores widen), cute_dsl_mla:partials=q,stores=narrow (the 4-byte bf16x2 epilogue
#               stores of the tenth session's run), cute_dsl_mla:partials=q,stores=wide (16-byte stores after a
#               quad transpose, kernels/wide_store.py) and FlashInfer fa3, budget ${BUDGET:-0.05}, under timeout
#               ${BT:-270} each -> $OUT/partials_ab_{h16,h128}.{txt,json} (4 files; 2 x 270 s keeps the call under
#               10 minutes with a prebuilt kernel cache: benchmarks/device/prebuild_kcache.sh)
source "$(dirname "$0")/project_env.sh"
export PYTHONPATH=plugins/cute_dsl_mla:.:$PYTHONPATH PYTHONUNBUFFERED=1
export MLA_CUTE_DSL_TEST_CACHE_DIR=${KCACHE:-/tmp/mla_kcache} MLA_CUTE_DSL_CACHE_DIR=${KCACHE:-/tmp/mla_kcache}
T=plugins/cute_dsl_mla/tests
if [ "${PART:-tests}" = tests ]; then
  start=$(date +%s)
  timeout ${TT:-300} python -m pytest -q -p no:cacheprovider -rfs $T/test_backend_gpu.py -k "${TK:-QPartials or WideStores or Fp32}" \
    > "$OUT/partials_gpu_tests.log" 2>&1
  echo "partials GPU tests rc=$? in $(( $(date +%s) - start )) s"; tail -3 "$OUT/partials_gpu_tests.log"
else
  for g in ${GRIDS:-partials_ab_h16 partials_ab_h128}; do
    start=$(date +%s)
    timeout ${BT:-270} python -m mlacore bench --device cuda --grid benchmarks/grids/$g.toml --backend cute_dsl_mla:partials=fp32 \
      --backend cute_dsl_mla:partials=fp32,stores=wide --backend cute_dsl_mla:partials=q,stores=narrow \
      --backend cute_dsl_mla:partials=q,stores=wide \
      --backend flashinfer_mla:variant=fa3 --budget ${BUDGET:-0.05} --no-progress \
      -o "$OUT/$g.json" > "$OUT/$g.txt" 2>&1
    echo "$g rc=$? in $(( $(date +%s) - start )) s"
  done
fi
