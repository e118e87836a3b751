#!/usr/bin/env bash
# One device call: smoke, GPU tests, bench. Logs under $OUT.
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD:$PYTHONPATH PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
STAGE=${STAGE:-all}
if [[ $STAGE == *smoke* || $STAGE == all ]]; then
  mkdir -p /tmp/cubins
  CUTE_DSL_KEEP=cubin CUTE_DSL_DUMP_DIR=/tmp/cubins timeout 200 python3 benchmarks/smoke.py 2>&1 | tee $OUT/smoke.txt
  for f in /tmp/cubins/*.cubin; do cuobjdump -res-usage "$f" 2>&1 | grep -E "Function|REG" | sed 's/^ *//' | cut -c1-160; done | tee $OUT/resusage.txt
fi
if [[ $STAGE == *test* || $STAGE == all ]]; then
  timeout ${TEST_T:-240} python3 -m pytest -q -p no:cacheprovider -rf tests/test_kernel_gpu.py 2>&1 | tail -60 | tee $OUT/tests.txt
fi
if [[ $STAGE == *bench* || $STAGE == all ]]; then
  timeout ${BENCH_T:-200} python3 benchmarks/bench_kernel.py --variants --json $OUT/bench.json 2>&1 | tee $OUT/bench.txt
fi
