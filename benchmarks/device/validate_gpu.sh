#!/usr/bin/env bash
# On the H200 (devpack set up, env.sh sourced): the policy tuned from the five stored runs (no measuring)
# validated against every arm on a grid measured now, in a separate pass after the rules are written.
source "$(dirname "$0")/project_env.sh"
cp mlacore/default_policy.toml "$OUT/h200_tuned_mla.toml"
# cute_dsl_mla as the stored runs measured it: the mma.sync kernel (they predate the WGMMA kernel's wiring)
printf '\n[backend.cute_dsl_mla]\noptions = {mma = "mma_sync"}\n' >> "$OUT/h200_tuned_mla.toml"
start=$(date +%s)
timeout ${TUNE_TIMEOUT:-280} python -m mlacore tune --from docs/results/h200_tune_bench.json \
  --from docs/results/h200_validate_offgrid_bench.json --from docs/results/h200_validate_offgrid2_bench.json \
  --from docs/results/h200_validate_offgrid3_bench.json --from docs/results/h200_validate_offgrid4_bench.json \
  --device cuda --write "$OUT/h200_tuned_mla.toml" --validate ${GRID:-benchmarks/grids/h200_offgrid5.toml} \
  --backend flashinfer_mla:variant=fa3 --backend flashinfer_mla:variant=fa2 --backend cute_dsl_mla:mma=mma_sync \
  --budget ${BUDGET:-0.08} --no-progress --validate-output "$OUT/validate5_bench.json" --worst 10 > "$OUT/validate5.txt" 2>&1
echo "validate rc=$? in $(( $(date +%s) - start )) s"
tail -18 "$OUT/validate5.txt"
