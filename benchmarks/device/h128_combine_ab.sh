#!/usr/bin/env bash
# On the H200 (devpack set up, env.sh sourced): what the combine costs at H=128 bf16, small batches, long lengths
# (benchmarks/grids/h128_combine_ab.toml, 30 cells). One interleaved `mla bench` run, six arms: cute_dsl_mla (the
# default: a stream-ordered combine of combine_kind_for's kind), cute_dsl_mla:pdl=true (the combine launched with
# programmatic dependent launch: its CTAs wait on the GPU while the balanced seesaw's persistent grid runs; the
# ninth session measured PDL 1.4-2.2 us slower at H=128 B=16 S=1024-4096 with the even kernel's several waves),
# cute_dsl_mla:combine=wide and combine=row (the other kinds), cute_dsl_mla:loads=cp_async (0.2.13's loads at 128
# rows: 0.2.14's TMA default was timed only from B=12 at s_q=1) and flashinfer_mla:variant=fa3 (merges inside its
# cooperative kernel); then eager steps (--no-graph) of the default against loads=cp_async on
# benchmarks/grids/h128_tma_eager.toml (the tensor map TMA encodes on the host at each eager launch). Kernels not in
# the carried .kcache (the PDL combines of 16-bit partials) compile there.
# Files under $OUT: h128_combine_ab.{txt,json}, h128_tma_eager.{txt,json}.
# Run (repository root): OUT=/tmp/out bash benchmarks/device/h128_combine_ab.sh
source "$(dirname "$0")/project_env.sh"
export PYTHONPATH=plugins/cute_dsl_mla:.:$PYTHONPATH PYTHONUNBUFFERED=1
start=$(date +%s)
timeout ${MLA_BENCH_TIMEOUT:-200} python -m mlacore bench --device cuda --grid benchmarks/grids/h128_combine_ab.toml \
  --backend cute_dsl_mla --backend cute_dsl_mla:pdl=true --backend cute_dsl_mla:combine=wide \
  --backend cute_dsl_mla:combine=row --backend cute_dsl_mla:loads=cp_async --backend flashinfer_mla:variant=fa3 \
  --budget ${BUDGET:-0.05} --no-progress -o "$OUT/h128_combine_ab.json" > "$OUT/h128_combine_ab.txt" 2>&1
echo "mla bench h128_combine_ab rc=$? in $(( $(date +%s) - start )) s"
tail -4 "$OUT/h128_combine_ab.txt"
start=$(date +%s)
timeout ${MLA_EAGER_TIMEOUT:-90} python -m mlacore bench --device cuda --no-graph \
  --grid benchmarks/grids/h128_tma_eager.toml --backend cute_dsl_mla --backend cute_dsl_mla:loads=cp_async \
  --budget ${BUDGET:-0.05} --no-progress \
  -o "$OUT/h128_tma_eager.json" > "$OUT/h128_tma_eager.txt" 2>&1
echo "mla bench h128_tma_eager rc=$? in $(( $(date +%s) - start )) s"
tail -4 "$OUT/h128_tma_eager.txt"
