#!/usr/bin/env bash
# On the H200 (devpack set up, env.sh sourced; Firecracker runtime): Nsight Compute counters of one
# launch of each named partial kernel (default: seesaw fp8reg), clocks left alone. Text reports in $OUT.
#   PART=src: per kernel, the SASS lines where warps stall (source-level sampling), for what bounds a
#   kernel that occupancy and issue-slot counters do not explain (fp8reg: NOTES "Seventh session")
source "$(dirname "$0")/project_env.sh"
export PYTHONPATH=plugins/cute_dsl_mla:.:$PYTHONPATH
if [ "${PART:-}" = src ]; then
  for k in ${KERNELS:-fp8reg mma_sync}; do
    timeout ${NCU_TIMEOUT:-120} ncu --clock-control none -k 'regex:(?i)partial' --launch-skip 1 --launch-count 1 \
      --section WarpStateStats --section SourceCounters --import-source yes --page source --print-source sass --csv \
      python benchmarks/ncu_one_decode.py --kernel "$k" > "$OUT/ncu_src_$k.csv" 2>&1
    echo "$k source page rc=$?"
    timeout ${NCU_TIMEOUT:-120} ncu --clock-control none -k 'regex:(?i)partial' --launch-skip 1 --launch-count 1 \
      --section WarpStateStats --section SourceCounters python benchmarks/ncu_one_decode.py --kernel "$k" \
      > "$OUT/ncu_stalls_$k.txt" 2>&1
    echo "$k stalls rc=$?"; grep -iE "stall|Duration" "$OUT/ncu_stalls_$k.txt" | head -12
  done
  exit
fi
for k in ${KERNELS:-seesaw fp8reg}; do
  timeout ${NCU_TIMEOUT:-120} ncu --clock-control none -k 'regex:(?i)partial' --launch-skip 1 --launch-count 1 \
    --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
    --section Occupancy --section SchedulerStats --section WarpStateStats --section LaunchStats \
    python benchmarks/ncu_one_decode.py --kernel "$k" > "$OUT/ncu_$k.txt" 2>&1
  echo "$k rc=$?"; grep -E "Duration|Compute \(SM\) Throughput|Memory Throughput|Stall|Issue Slots|Registers|Achieved Occupancy|Bank" "$OUT/ncu_$k.txt" | head -30
done
