#!/usr/bin/env bash
# On the H200 (devpack set up, env.sh sourced): install the core and both GPU
# plugins; run the GPU tests of cute_dsl_mla (kernel tests + conformance) and
# of the engine interface; time cute_dsl_mla beside FlashInfer fa3 and fa2
# with `mla bench`; measure the decoder's run overhead.
source "$(dirname "$0")/project_env.sh"
timeout ${TEST_TIMEOUT:-240} python -m pytest -q -p no:cacheprovider -m gpu -rfs plugins/cute_dsl_mla/tests tests/test_engine_interface_gpu.py 2>&1 \
  | tee "$OUT/gpu_tests.log" | grep -E "passed|failed|FAILED|ERROR" | tail -30
[ "${BENCH_TIMEOUT:-200}" = 0 ] || timeout ${BENCH_TIMEOUT:-200} python -m mlacore bench --device cuda --grid benchmarks/grids/kernel_targets.toml \
  --backend cute_dsl_mla --backend flashinfer_mla:variant=fa3 --budget 0.15 --no-progress \
  -o "$OUT/bench.json" --csv "$OUT/bench.csv" > "$OUT/bench.txt" 2>&1; echo "bench rc=$?"
[ -f "$OUT/bench.txt" ] && tail -40 "$OUT/bench.txt"
[ "${OVERHEAD:-1}" = 0 ] || python benchmarks/decoder_overhead.py --device cuda --backend flashinfer_mla -n 3000 2>&1 | tee "$OUT/overhead.log"
