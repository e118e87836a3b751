#!/usr/bin/env bash
# On the H200 (devpack set up, env.sh sourced): the seesaw kernel with and without its L2 prefetch (from
# mla-cute-dsl 0.2.2 off by default for 16-bit caches, on for fp8) -- the WGMMA GPU tests (incl. the
# option's bitwise test), both settings beside fa3 (bf16 and fp8), and `mla bench` at the issue-11 H=128
# target shapes (the backend's defaults). The sixth session's run predates the per-dtype default: its fp8
# rows ran without the prefetch.
source "$(dirname "$0")/project_env.sh"
export PYTHONPATH=plugins/cute_dsl_mla:.:$PYTHONPATH
timeout ${TEST_TIMEOUT:-200} python -m pytest -q -p no:cacheprovider -rfs plugins/cute_dsl_mla/tests/test_wgmma_gpu.py 2>&1 \
  | tee "$OUT/wgmma_gpu_tests.log" | grep -E "passed|failed|FAILED|ERROR" | tail -12
for kv in bf16 fp8; do
  timeout 120 python benchmarks/wgmma_speed.py --shapes 0,1,3 --ways seesaw_nopf,seesaw_l2pf,fa3 --kv $kv \
    --json "$OUT/seesaw_nopf_speed_$kv.json" > "$OUT/seesaw_nopf_speed_$kv.txt" 2>&1; echo "speed $kv rc=$?"
  grep -E "seesaw|fa3" "$OUT/seesaw_nopf_speed_$kv.txt" | grep -v "^ *#" | tail -9
done
timeout ${BENCH_TIMEOUT:-150} python -m mlacore bench --device cuda --grid benchmarks/grids/kernel_targets_h128.toml \
  --backend cute_dsl_mla --backend flashinfer_mla:variant=fa3 --budget 0.15 --no-progress \
  -o "$OUT/bench_h128.json" --csv "$OUT/bench_h128.csv" > "$OUT/bench_h128.txt" 2>&1; echo "bench rc=$?"
tail -22 "$OUT/bench_h128.txt"
