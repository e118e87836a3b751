#!/usr/bin/env bash
# On the H200 (devpack set up, env.sh sourced): the balanced seesaw kernel (MLADecodePartialWGMMASeesaw(balanced=True);
# cute_dsl_mla option seesaw_split=balanced, the default since 0.2.13), against 0.2.12's even seesaw and fa3. Its
# kernels are in benchmarks/device/prebuild_kernels.py's list (carry a .kcache prebuilt for this kernels/ folder).
# The seventeenth session ran these same steps from its own device script (logs in docs/results/gpu17_session/),
# not this file as it stands.
#   1. GPU tests: test_seesaw_balanced_gpu.py (fp64 reference, NaN tails and outputs, both plan forms, columns of
#      many items, bitwise equal to the even seesaw on the even form, graphs across forms, the backend option) under
#      timeout 240: the smallest case runs first, so a hang in the mbarrier phases across items shows as rc=124
#      with the last test named in the log
#   2. mla bench, interleaved, three arms: cute_dsl_mla:seesaw_split=even (0.2.12's kernel), cute_dsl_mla (the
#      balanced seesaw, default) and flashinfer_mla:variant=fa3, on benchmarks/grids/seesaw_balanced_h128.toml
#      (H=128 s_q 1/2, B 16-48 and 128, S=4096: 12 cells) and seesaw_balanced_h128_varlen.toml (2 cells, lengths
#      410..4096), budget 0.05, each under timeout 90
# Files under $OUT: gpu.txt, seesaw_balanced_gpu_tests.log, seesaw_balanced_h128_bench.{txt,json},
# seesaw_balanced_h128_varlen_bench.{txt,json}, summary.txt.
# Run (repository root): OUT=/tmp/out bash benchmarks/device/seesaw_balanced_gpu.sh
source "$(dirname "$0")/project_env.sh"
export PYTHONPATH=plugins/cute_dsl_mla:.:$PYTHONPATH PYTHONUNBUFFERED=1
T=plugins/cute_dsl_mla/tests
{
  echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  start=$(date +%s)
  timeout ${TT:-240} python -m pytest -v -p no:cacheprovider -rfs $T/test_seesaw_balanced_gpu.py \
    > "$OUT/seesaw_balanced_gpu_tests.log" 2>&1
  echo "test_seesaw_balanced_gpu rc=$? in $(( $(date +%s) - start )) s"
  grep -E "passed|failed|FAILED|ERROR|Timeout" "$OUT/seesaw_balanced_gpu_tests.log" | tail -12
  for grid in seesaw_balanced_h128 seesaw_balanced_h128_varlen; do
    start=$(date +%s)
    timeout ${MLA_BENCH_TIMEOUT:-90} python -m mlacore bench --device cuda --grid benchmarks/grids/$grid.toml \
      --backend cute_dsl_mla:seesaw_split=even --backend cute_dsl_mla --backend flashinfer_mla:variant=fa3 \
      --budget ${BUDGET:-0.05} --no-progress -o "$OUT/${grid}_bench.json" > "$OUT/${grid}_bench.txt" 2>&1
    echo "mla bench $grid rc=$? in $(( $(date +%s) - start )) s"
    tail -24 "$OUT/${grid}_bench.txt"
  done
} 2>&1 | tee "$OUT/summary.txt"
