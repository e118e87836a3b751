#!/usr/bin/env bash
# On the H200 (after the devpack is set up and env.sh sourced): install the
# project, run every GPU-marked test of the core and the FlashInfer plugin
# (conformance suite for reference, fa3 and fa2), then the decoder overhead.
PLUGINS=${PLUGINS:-plugins/flashinfer_mla}
source "$(dirname "$0")/project_env.sh"
python -c "import torch, flashinfer, mlacore; print('torch', torch.__version__, 'flashinfer', flashinfer.__version__, 'mlacore', mlacore.__version__)" | tee -a "$OUT/gpu.txt"
timeout ${TEST_TIMEOUT:-400} python -m pytest -q -p no:cacheprovider -m gpu -rfs ${TESTS:-tests plugins/flashinfer_mla/tests} 2>&1 \
  | tee "$OUT/gpu_tests.log" | grep -E "passed|failed|FAILED|ERROR|Error" | tail -40
python benchmarks/decoder_overhead.py --device cuda --backend flashinfer_mla -n 3000 2>&1 | tee "$OUT/overhead.log"
