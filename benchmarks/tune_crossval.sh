#!/usr/bin/env bash
# Leave-one-grid-out check of `mla tune` on the stored H200 runs (CPU only, ~3 s per fold): for each
# measured grid, rules are written from all the other runs (plus the refine cells) and validated on
# the grid left out, as `mla tune --validate` would on a fresh run.
#   bash benchmarks/tune_crossval.sh            (from the repository root, the project installed; the
#                                                mla-cute-dsl 0.2.1 runs)
#   GRIDS="h200_tune7_bench h200_tune7_offgrid_bench h200_tune7_offgrid2_bench h200_validate7_offgrid7_bench" \
#   ALWAYS=h200_tune7_refine_bench bash benchmarks/tune_crossval.sh    (the 0.2.2 runs)
#   R=docs/results/gpu12_tune GRIDS="h200_tune_bench h200_offgrid_bench h200_offgrid2_bench h200_lengths8_bench \
#   h200_offgrid7_bench" ALWAYS=" " bash benchmarks/tune_crossval.sh   (the 0.2.7 runs of the twelfth session)
#   RULES=boxes ...: the rules of `mla tune --rules boxes` (default batch, as mla tune)
set -euo pipefail
R=${R:-docs/results}
PY=${PY:-python}
GRIDS=${GRIDS:-"h200_tune_bench h200_tune_offgrid_bench h200_tune_offgrid2_bench h200_validate_offgrid5s_bench
h200_validate_offgrid6_bench h200_validate_offgrid7_bench"}
ALWAYS=${ALWAYS:-h200_tune_refine6_bench}
ARMS="--backend flashinfer_mla:variant=fa3 --backend flashinfer_mla:variant=fa2 --backend cute_dsl_mla"
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
status=0
for held in $GRIDS; do
  from=""
  for g in $GRIDS $ALWAYS; do [ "$g" = "$held" ] || from="$from --from $R/$g.json"; done
  cp mlacore/default_policy.toml "$tmp/policy.toml"
  rc=0
  $PY -m mlacore tune --rules "${RULES:-batch}" $from --write "$tmp/policy.toml" --validate-from "$R/$held.json" $ARMS \
    > "$tmp/out.txt" 2>&1 || rc=$?
  line=$(grep "^validation" "$tmp/out.txt" | sed 's/; recorded.*//' || true)
  if [ "$rc" != 0 ] || [ -z "$line" ]; then
    printf '%-32s FAILED (rc=%s):\n' "$held" "$rc"; tail -5 "$tmp/out.txt"; status=1; continue
  fi
  printf '%-32s %s\n' "$held" "$line"
done
exit $status
