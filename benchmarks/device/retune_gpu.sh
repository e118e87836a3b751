#!/usr/bin/env bash
# On the H200 (devpack set up, env.sh sourced): `mla tune` over fa3, fa2 and cute_dsl_mla (mma=auto),
# in calls that fit the device's 10-minute limit.
#   PART=measure: `mla bench` GRIDS (default: the five grids the tuned file is written from, 400 cells: h200_tune,
#                 h200_offgrid, h200_offgrid2, h200_lengths8, h200_offgrid7; 150/146/171/99/83 s in the twelfth
#                 session with the kernels prebuilt on the CPU and carried, benchmarks/device/prebuild_kcache.sh)
#                 into /tmp/retune (and $OUT), each under timeout BENCH_TIMEOUT (default 250 s; two grids per
#                 call). mla bench -o rewrites its JSON after every cell, so a grid cut by the timeout keeps its
#                 cells (grid marked partial).
#   PART=tune:    `mla tune --from` FROM (default: the twelfth session's five runs in docs/results/gpu12_tune/)
#                 with REFINE rounds of at most REFINE_CELLS midpoint cells (default 0: none), the rules written
#                 into a copy of the default policy (RULES: batch, the default, or boxes), then validated on VALIDATE
#                 (default h200_offgrid8_bf16, 48 cells none of those runs nor the last validation measured) in a
#                 separate pass after the rules are written; or VALIDATE_FROM=FILE
#                 (a stored `mla bench -o` run of the same stack) instead of measuring. mla tune refuses to join runs
#                 whose backend versions differ: after a cute_dsl_mla release, re-measure every grid.
source "$(dirname "$0")/project_env.sh"
ARMS="--backend flashinfer_mla:variant=fa3 --backend flashinfer_mla:variant=fa2 --backend cute_dsl_mla"
mkdir -p /tmp/retune
if [ "${PART:-tune}" = measure ]; then
  for g in ${GRIDS:-h200_tune h200_offgrid h200_offgrid2 h200_lengths8 h200_offgrid7}; do
    start=$(date +%s)
    timeout ${BENCH_TIMEOUT:-250} python -m mlacore bench --device cuda --grid benchmarks/grids/$g.toml $ARMS \
      --budget ${BUDGET:-0.08} --no-progress -o /tmp/retune/$g.json > "$OUT/bench_$g.txt" 2>&1
    echo "$g rc=$? in $(( $(date +%s) - start )) s"; cp /tmp/retune/$g.json "$OUT/" 2>/dev/null; tail -2 "$OUT/bench_$g.txt"
  done
else
  R=docs/results/gpu12_tune
  FROM=${FROM:-"$R/h200_tune_bench.json $R/h200_offgrid_bench.json $R/h200_offgrid2_bench.json $R/h200_lengths8_bench.json $R/h200_offgrid7_bench.json"}
  cp mlacore/default_policy.toml "$OUT/h200_tuned_mla.toml"
  start=$(date +%s)
  timeout ${TUNE_TIMEOUT:-540} python -m mlacore tune --device cuda $ARMS --budget ${BUDGET:-0.08} --no-progress \
    $(for f in $FROM; do echo --from $f; done) \
    $([ "${REFINE:-0}" = 0 ] || echo --refine ${REFINE} --refine-cells ${REFINE_CELLS:-60}) --rules ${RULES:-batch} \
    -o "$OUT/tune_joined.json" --write "$OUT/h200_tuned_mla.toml" \
    $(if [ -n "$VALIDATE_FROM" ]; then echo --validate-from $VALIDATE_FROM; else
      echo --validate benchmarks/grids/${VALIDATE:-h200_offgrid8_bf16}.toml --validate-output "$OUT/validate_bench.json"; fi) \
    --worst 10 > "$OUT/tune.txt" 2>&1
  echo "tune rc=$? in $(( $(date +%s) - start )) s"; grep -E "^--refine|^wrote|^validation" "$OUT/tune.txt" | tail -5
fi
