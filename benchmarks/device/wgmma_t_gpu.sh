#!/usr/bin/env bash
# On the H200 (devpack set up, env.sh sourced), from a checkout with option mma=wgmma_t: its conformance class
# through the backend, then `mla bench` of the H=16 target cells with mma=wgmma_t beside the default and fa3.
# Writes 3 files under $OUT (+ gpu.txt). ~120 s.
source "$(dirname "$0")/project_env.sh"
export PYTHONPATH=plugins/cute_dsl_mla:.:$PYTHONPATH
export MLA_CUTE_DSL_TEST_CACHE_DIR=${KCACHE:-/tmp/mla_kcache} MLA_CUTE_DSL_CACHE_DIR=${KCACHE:-/tmp/mla_kcache}
start=$(date +%s)
timeout ${TT:-120} python -m pytest -q -p no:cacheprovider -rfs plugins/cute_dsl_mla/tests/test_backend_gpu.py \
  -k "WgmmaT or light_fingerprint" tests/test_cli_conventions.py \
  > "$OUT/wgmma_t_conformance.log" 2>&1
echo "wgmma_t conformance rc=$? in $(( $(date +%s) - start )) s"; grep -E "passed|failed|FAILED|ERROR" "$OUT/wgmma_t_conformance.log" | tail -6
for g in wgmma_t_h16_uniform wgmma_t_h16; do
  start=$(date +%s)
  timeout ${BENCH_TIMEOUT:-60} python -m mlacore bench --device cuda --grid benchmarks/grids/$g.toml \
    --backend cute_dsl_mla --backend cute_dsl_mla:mma=wgmma_t --backend flashinfer_mla:variant=fa3 \
    --budget 0.08 --no-progress > "$OUT/${g}_bench.txt" 2>&1
  echo "$g rc=$? in $(( $(date +%s) - start )) s"; grep -E "^\| (cute|flash)" "$OUT/${g}_bench.txt" | cut -c1-150
done
