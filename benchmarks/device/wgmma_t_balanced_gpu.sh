#!/usr/bin/env bash
# On the H200 (devpack set up, env.sh sourced), from a checkout of branch wgmma-t-balanced: the balanced mode of
# the transposed WGMMA kernel (cute_dsl_mla option mma=wgmma_t with split_kv=balanced, the default). One device
# call of ~300 s at most:
#   1. GPU tests: test_wgmma_t_balanced_gpu.py (fp64 reference, both plan forms, graphs across forms) under
#      timeout 150 (a hang in the ring across item boundaries shows as rc=124 with the last test named in the log)
#   2. the backend conformance classes of mma=wgmma_t (bf16: the balanced mode; fp8 and split_kv=even: the even
#      entry), timeout 90
#   3. mla bench on benchmarks/grids/varlen_h16.toml (4 cells): cute_dsl_mla (default: mma.sync, balanced hybrid),
#      cute_dsl_mla:mma=wgmma_t (the balanced wgmma_t kernel, hybrid plan) and fa3, under timeout 60
# One kernel cache for all three (the tests compile, the bench loads from disk). Files under $OUT (6 of the 8 a call
# returns): gpu.txt, wgmma_t_balanced_gpu_tests.log, wgmma_t_conformance.log, varlen_h16_bench.txt,
# varlen_h16_bench.json, summary.txt.
source "$(dirname "$0")/project_env.sh"
export PYTHONPATH=plugins/cute_dsl_mla:.:$PYTHONPATH PYTHONUNBUFFERED=1
export MLA_CUTE_DSL_TEST_CACHE_DIR=${KCACHE:-/tmp/mla_kcache} MLA_CUTE_DSL_CACHE_DIR=${KCACHE:-/tmp/mla_kcache}
T=plugins/cute_dsl_mla/tests
{
  echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  start=$(date +%s)
  timeout ${TT:-150} python -m pytest -v -p no:cacheprovider -rfs $T/test_wgmma_t_balanced_gpu.py \
    > "$OUT/wgmma_t_balanced_gpu_tests.log" 2>&1
  echo "test_wgmma_t_balanced_gpu rc=$? in $(( $(date +%s) - start )) s"
  grep -E "passed|failed|FAILED|ERROR|Timeout" "$OUT/wgmma_t_balanced_gpu_tests.log" | tail -12
  start=$(date +%s)
  timeout ${CT:-90} python -m pytest -q -p no:cacheprovider -rfs $T/test_backend_gpu.py -k WgmmaT \
    > "$OUT/wgmma_t_conformance.log" 2>&1
  echo "wgmma_t conformance rc=$? in $(( $(date +%s) - start )) s"
  grep -E "passed|failed|FAILED|ERROR" "$OUT/wgmma_t_conformance.log" | tail -6
  start=$(date +%s)
  timeout ${MLA_BENCH_TIMEOUT:-60} python -m mlacore bench --device cuda --grid benchmarks/grids/varlen_h16.toml \
    --backend cute_dsl_mla --backend cute_dsl_mla:mma=wgmma_t --backend flashinfer_mla:variant=fa3 \
    --budget ${BUDGET:-0.05} --no-progress -o "$OUT/varlen_h16_bench.json" > "$OUT/varlen_h16_bench.txt" 2>&1
  echo "mla bench rc=$? in $(( $(date +%s) - start )) s"
  tail -30 "$OUT/varlen_h16_bench.txt"
} 2>&1 | tee "$OUT/summary.txt"
