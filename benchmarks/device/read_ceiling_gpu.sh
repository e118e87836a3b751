#!/usr/bin/env bash
# On the H200 (devpack set up, env.sh sourced): the GPU's read-only HBM bandwidth ceiling (benchmarks/read_ceiling.py:
# ldg / cp.async / TMA bulk kernels over the 604 MB B64 S8192 bf16 cache, swept over threads / unroll / stages /
# CTAs per SM, beside torch copy and bf16 sum in the same process). Is >= 4150 GB/s of reads reachable?
#   1. the sweep, per-launch CUDA events, L2 flushed before each       -> $OUT/read_ceiling.{txt,json}
#   2. the same sweep, CUDA graphs of 20 back-to-back launches          -> $OUT/read_ceiling_graph.{txt,json}
# Each under timeout ${RT:-120} s (compiles ~10 s, runs well under a minute), so the call stays < 5 minutes.
source "$(dirname "$0")/project_env.sh"
export PYTHONUNBUFFERED=1
start=$(date +%s)
timeout ${RT:-120} python benchmarks/read_ceiling.py --sweep --reps ${REPS:-50} --json "$OUT/read_ceiling.json" \
  > "$OUT/read_ceiling.txt" 2>&1
echo "read_ceiling (events) rc=$? in $(( $(date +%s) - start )) s"; grep -vE "Warning|^  " "$OUT/read_ceiling.txt" | tail -45
start=$(date +%s)
timeout ${RT:-120} python benchmarks/read_ceiling.py --sweep --reps ${REPS:-50} --graph 20 \
  --json "$OUT/read_ceiling_graph.json" > "$OUT/read_ceiling_graph.txt" 2>&1
echo "read_ceiling (graphs of 20) rc=$? in $(( $(date +%s) - start )) s"; tail -4 "$OUT/read_ceiling_graph.txt"
