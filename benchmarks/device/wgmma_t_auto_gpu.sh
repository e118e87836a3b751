#!/usr/bin/env bash
# On the H200 (devpack set up, env.sh sourced), from the repository root (mla-cute-dsl 0.2.5 and later; run in the ninth session, docs/results/gpu10_auto/):
# mma=auto's per-step KV-block rule (the balanced wgmma_t kernel at 17-32 rows with a 16-bit cache when the
# step has >= 640 KV blocks, WGMMA_T_AUTO_MIN_BLOCKS; the mma.sync balanced kernel below). One device call of
# ~200 s (timeouts below, each overridable):
#   1. GPU tests, timeout ${TT:-100}: test_backend_gpu.py -k "auto or WgmmaT or EvenSplit" (the new tests:
#      eager at 639/640 blocks and batch-vs-blocks corners, CUDA graphs captured on one side of the threshold
#      and replayed after plans on the other, two batch sizes sharing the schedule buffers; plus the forced
#      wgmma_t and split_kv=even conformance classes); then test_split_kv_gpu.py, timeout ${ST:-45}
#   2. mla bench, budget ${BUDGET:-0.1}, on benchmarks/grids/wgmma_t_auto_threshold.toml (28 uniform cells,
#      timeout ${BT:-60}) and wgmma_t_auto_threshold_varlen.toml (8 spread cells, timeout ${VT:-40}):
#      cute_dsl_mla (the new auto), cute_dsl_mla:mma=mma_sync and flashinfer_mla:variant=fa3. Expect the
#      default to equal mma_sync below 640 blocks and wgmma_t's gpu10 times (docs/results/gpu10_session/)
#      from 768.
# One kernel cache for all (the tests compile, the bench loads from disk). Files under $OUT (5): gpu.txt,
# wgmma_t_auto_gpu_tests.log (both pytest runs), wgmma_t_auto_bench.json, wgmma_t_auto_varlen_bench.json,
# summary.txt (rc and times, test tails, both bench tables).
source "$(dirname "$0")/project_env.sh"
export PYTHONPATH=plugins/cute_dsl_mla:.:$PYTHONPATH PYTHONUNBUFFERED=1
export MLA_CUTE_DSL_TEST_CACHE_DIR=${KCACHE:-/tmp/mla_kcache} MLA_CUTE_DSL_CACHE_DIR=${KCACHE:-/tmp/mla_kcache}
T=plugins/cute_dsl_mla/tests
LOG="$OUT/wgmma_t_auto_gpu_tests.log"
{
  echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  python -c "import mla_cute_dsl.backend as b; print('backend from', b.__file__, 'WGMMA_T_AUTO_MIN_BLOCKS', b.WGMMA_T_AUTO_MIN_BLOCKS)"
  start=$(date +%s)
  echo "== test_backend_gpu.py -k 'auto or WgmmaT or EvenSplit'" > "$LOG"
  timeout ${TT:-100} python -m pytest -v -p no:cacheprovider -rfs $T/test_backend_gpu.py \
    -k "auto or WgmmaT or EvenSplit" >> "$LOG" 2>&1
  echo "test_backend_gpu (auto or WgmmaT or EvenSplit) rc=$? in $(( $(date +%s) - start )) s"
  grep -E "passed|failed|FAILED|ERROR|Timeout" "$LOG" | tail -12
  start=$(date +%s)
  echo "== test_split_kv_gpu.py" >> "$LOG"
  timeout ${ST:-45} python -m pytest -q -p no:cacheprovider -rfs $T/test_split_kv_gpu.py >> "$LOG" 2>&1
  echo "test_split_kv_gpu rc=$? in $(( $(date +%s) - start )) s"
  tail -3 "$LOG"
  for g in wgmma_t_auto_threshold:${BT:-60} wgmma_t_auto_threshold_varlen:${VT:-40}; do
    grid=${g%%:*}; limit=${g##*:}; start=$(date +%s)
    echo "== mla bench $grid"
    timeout $limit python -m mlacore bench --device cuda --grid benchmarks/grids/$grid.toml \
      --backend cute_dsl_mla --backend cute_dsl_mla:mma=mma_sync --backend flashinfer_mla:variant=fa3 \
      --budget ${BUDGET:-0.1} --no-progress -o "$OUT/${grid/_threshold/}_bench.json" 2>&1 | grep -v "^\s*$"
    echo "mla bench $grid rc=${PIPESTATUS[0]} in $(( $(date +%s) - start )) s"
  done
} 2>&1 | tee "$OUT/summary.txt"
