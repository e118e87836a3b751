#!/usr/bin/env bash
# On the H200 (devpack set up, env.sh sourced): a fresh `mla tune` over fa3, fa2 and cute_dsl_mla
# (mma=auto) in two calls that fit the device's 10-minute limit.
#   PART=measure: `mla bench` the three tuning grids (h200_tune, h200_offgrid, h200_offgrid2: 208 cells),
#                 kept in /tmp/retune for the next call (and copied to $OUT).
#   PART=tune:    `mla tune --from` those runs with midpoint refinement, the rules written into a copy of
#                 the default policy, validated on h200_offgrid5s (72 cells) in a separate pass after the
#                 rules are written, then the same rules validated on h200_offgrid6 (96 cells).
source "$(dirname "$0")/project_env.sh"
ARMS="--backend flashinfer_mla:variant=fa3 --backend flashinfer_mla:variant=fa2 --backend cute_dsl_mla"
mkdir -p /tmp/retune
if [ "${PART:-measure}" = measure ]; then
  for g in h200_tune h200_offgrid h200_offgrid2; do
    start=$(date +%s)
    timeout ${BENCH_TIMEOUT:-240} python -m mlacore bench --device cuda --grid benchmarks/grids/$g.toml $ARMS \
      --budget ${BUDGET:-0.08} --no-progress -o /tmp/retune/$g.json > "$OUT/bench_$g.txt" 2>&1
    echo "$g rc=$? in $(( $(date +%s) - start )) s"; cp /tmp/retune/$g.json "$OUT/" 2>/dev/null; tail -2 "$OUT/bench_$g.txt"
  done
else
  cp mlacore/default_policy.toml "$OUT/h200_tuned_mla.toml"
  start=$(date +%s)
  timeout ${TUNE_TIMEOUT:-330} python -m mlacore tune --device cuda $ARMS --budget ${BUDGET:-0.08} --no-progress \
    --from /tmp/retune/h200_tune.json --from /tmp/retune/h200_offgrid.json --from /tmp/retune/h200_offgrid2.json \
    --refine ${REFINE:-2} -o "$OUT/tune_joined.json" --csv "$OUT/tune_joined.csv" --write "$OUT/h200_tuned_mla.toml" \
    --validate benchmarks/grids/h200_offgrid5s.toml --validate-output "$OUT/validate_offgrid5s.json" --worst 10 \
    > "$OUT/tune.txt" 2>&1
  echo "tune rc=$? in $(( $(date +%s) - start )) s"; grep -E "^wrote|^validation|regret" "$OUT/tune.txt" | tail -4
  cp "$OUT/h200_tuned_mla.toml" "$OUT/h200_tuned_mla_v6.toml"
  start=$(date +%s)
  timeout ${VALIDATE_TIMEOUT:-200} python -m mlacore tune --device cuda $ARMS --budget ${BUDGET:-0.08} --no-progress \
    --from "$OUT/tune_joined.json" --write "$OUT/h200_tuned_mla_v6.toml" \
    --validate benchmarks/grids/h200_offgrid6.toml --validate-output "$OUT/validate_offgrid6.json" --worst 10 \
    > "$OUT/validate6.txt" 2>&1
  echo "validate6 rc=$? in $(( $(date +%s) - start )) s"; tail -14 "$OUT/validate6.txt"
fi
