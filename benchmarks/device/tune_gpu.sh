#!/usr/bin/env bash
# On the H200 (devpack set up, env.sh sourced): `mla tune` over fa3, fa2 and
# cute_dsl_mla on benchmarks/grids/h200_tune.toml, the written policy then
# validated against every arm on the off-grid benchmarks/grids/h200_offgrid.toml.
source "$(dirname "$0")/project_env.sh"
cp mlacore/default_policy.toml "$OUT/h200_tuned_mla.toml"
start=$(date +%s)
timeout ${TUNE_TIMEOUT:-560} python -m mlacore tune --device cuda --grid benchmarks/grids/h200_tune.toml \
  --backend flashinfer_mla:variant=fa3 --backend flashinfer_mla:variant=fa2 --backend cute_dsl_mla \
  --budget ${BUDGET:-0.1} --refine ${REFINE:-2} --refine-cells ${REFINE_CELLS:-60} --no-progress -o "$OUT/tune_bench.json" --csv "$OUT/tune_bench.csv" \
  --write "$OUT/h200_tuned_mla.toml" --validate benchmarks/grids/h200_offgrid.toml \
  --validate-output "$OUT/validate_bench.json" --worst 10 > "$OUT/tune.txt" 2>&1
echo "tune rc=$? in $(( $(date +%s) - start )) s"
tail -60 "$OUT/tune.txt"
