#!/usr/bin/env bash
# On the H200 (devpack set up, env.sh sourced): where mma=auto should switch from the mma.sync balanced kernel
# to mma=wgmma_t at 17-32 rows with a 16-bit cache. mla bench on benchmarks/grids/wgmma_t_auto_threshold.toml
# (uniform lengths) and wgmma_t_auto_threshold_varlen.toml (kv_spread 0.9) with cute_dsl_mla:mma=mma_sync,
# cute_dsl_mla:mma=wgmma_t and fa3 (~60-120 s with the kernels compiled). Files under $OUT:
# wgmma_t_threshold_bench.{txt,json}, wgmma_t_threshold_varlen_bench.{txt,json}.
source "$(dirname "$0")/project_env.sh"
export MLA_CUTE_DSL_CACHE_DIR=${KCACHE:-/tmp/mla_kcache}
for g in wgmma_t_auto_threshold wgmma_t_auto_threshold_varlen; do
  start=$(date +%s)
  timeout ${MLA_BENCH_TIMEOUT:-150} python -m mlacore bench --device cuda --grid benchmarks/grids/$g.toml \
    --backend cute_dsl_mla:mma=mma_sync --backend cute_dsl_mla:mma=wgmma_t --backend flashinfer_mla:variant=fa3 \
    --budget ${BUDGET:-0.1} --no-progress -o "$OUT/${g/auto_/}_bench.json" > "$OUT/${g/auto_/}_bench.txt" 2>&1
  echo "$g rc=$? in $(( $(date +%s) - start )) s"
done
