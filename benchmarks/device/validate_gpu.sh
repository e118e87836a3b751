#!/usr/bin/env bash
# On the H200 (devpack set up, env.sh sourced): the policy tuned from the five stored runs (no measuring)
# validated against every arm on a grid measured now, in a separate pass after the rules are written.
# GRID: a validation grid none of the --from runs measured, <= 120 cells (a fresh machine compiles every
# kernel first; 160 cells with batch 250 and kv_len 28000 ran past 470 s). Add the last validation's
# measurements to the --from list before choosing the next grid. h200_validate_offgrid5s_bench.json names
# its cute arm `cute_dsl_mla:mma=mma_sync` (the kernel the earlier runs call `cute_dsl_mla`): joined as
# is, tune would take them for two arms. The next tuning should measure `mma=auto` afresh anyway.
: "${GRID:?set GRID to a fresh validation grid (benchmarks/grids/*.toml)}"
source "$(dirname "$0")/project_env.sh"
cp mlacore/default_policy.toml "$OUT/h200_tuned_mla.toml"
# cute_dsl_mla as the stored runs measured it: the mma.sync kernel (they predate the WGMMA kernel's wiring)
printf '\n[backend.cute_dsl_mla]\noptions = {mma = "mma_sync"}\n' >> "$OUT/h200_tuned_mla.toml"
start=$(date +%s)
timeout ${TUNE_TIMEOUT:-470} python -m mlacore tune --from docs/results/h200_tune_bench.json \
  --from docs/results/h200_validate_offgrid_bench.json --from docs/results/h200_validate_offgrid2_bench.json \
  --from docs/results/h200_validate_offgrid3_bench.json --from docs/results/h200_validate_offgrid4_bench.json \
  --device cuda --write "$OUT/h200_tuned_mla.toml" --validate $GRID \
  --backend flashinfer_mla:variant=fa3 --backend flashinfer_mla:variant=fa2 --backend cute_dsl_mla:mma=mma_sync \
  --budget ${BUDGET:-0.08} --no-progress --validate-output "$OUT/validate_bench.json" --worst 10 > "$OUT/validate.txt" 2>&1
echo "validate rc=$? in $(( $(date +%s) - start )) s"
tail -18 "$OUT/validate.txt"
