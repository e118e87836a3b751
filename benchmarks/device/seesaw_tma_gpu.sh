#!/usr/bin/env bash
# On the H200 (devpack set up, env.sh sourced): the seesaw kernel's TMA KV loads (option tma=True, branch
# seesaw-tma2, written compile-only). First the GPU tests (the smallest case runs first: a wrong expect_tx byte
# count or mbarrier parity shows as a hang there, hence the timeout), then the speed of the default seesaw
# kernel against tma=True beside fa3, same process, CUDA-graph replay, at the H=128 shapes (B128 s_q1/s_q2 S4096,
# B16 s_q1), twice with the two seesaw ways in either order (each run times its ways interleaved).
source "$(dirname "$0")/project_env.sh"
export PYTHONPATH=plugins/cute_dsl_mla:.:$PYTHONPATH
timeout ${TEST_TIMEOUT:-300} python -m pytest -q -x -p no:cacheprovider -rfs plugins/cute_dsl_mla/tests/test_seesaw_tma_gpu.py 2>&1 \
  | tee "$OUT/seesaw_tma_gpu_tests.log" | grep -E "passed|failed|FAILED|ERROR" | tail -12
timeout ${TEST_TIMEOUT:-300} python -m pytest -q -p no:cacheprovider plugins/cute_dsl_mla/tests/test_seesaw_tma_compile.py \
  plugins/cute_dsl_mla/tests/test_seesaw_protocol.py 2>&1 | tee "$OUT/seesaw_tma_cpu_tests.log" | tail -2
for ways in seesaw,seesaw_tma,fa3 seesaw_tma,seesaw,fa3; do
  tag=${ways%%,fa3}; tag=${tag//,/_}
  timeout 150 python benchmarks/wgmma_speed.py --shapes 0,1,3 --ways $ways --reps 200 \
    --json "$OUT/seesaw_tma_speed_$tag.json" > "$OUT/seesaw_tma_speed_$tag.txt" 2>&1; echo "speed $ways rc=$?"
  grep -E "seesaw|fa3" "$OUT/seesaw_tma_speed_$tag.txt" | grep -v "^ *#" | tail -9
done
