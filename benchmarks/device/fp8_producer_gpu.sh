#!/usr/bin/env bash
# On the H200 (devpack set up, env.sh sourced): the fp8 seesaw with a producer warpgroup (MLADecodePartialWGMMASeesaw
# (fp8_producer=True), branch fp8-producer, written compile-only: 384 threads, WG2 ld.global's / converts /
# st.shared's every fp8 part on full / empty mbarriers, setmaxnreg 216 math / 72 producer) against the current fp8
# seesaw and fa3. Carry a .kcache prebuilt from this kernels/ folder (every kernel's cache key hashes the kernels'
# source, so main's prebuilt kernels do not match):
#   ONLY="fp8_e4m3 fp32|fp8p|combine" bash benchmarks/device/prebuild_kcache.sh
#   0. hang probe under timeout PT (default 150 s): the new kernel on a 1-SM schedule (one CTA per request, tile
#      counts 0..6, lengths 0 / 1 / partial tiles), then the 132-SM schedule of B16 H128 S4096, one case at a time,
#      each synchronized and printed, so a hang names its case; stops the script if it does not finish (rc 124: a
#      hung kernel; do not run the rest on a wedged GPU)
#   1. GPU tests under timeout TT (default 420 s): test_seesaw_fp8p_gpu.py (fp64 reference, NaN tails, every tile
#      count 0..10 in one CTA, H 64/128/126/40, s_q 1/2/3, bf16/fp16 q, large |q|, graphs, against the fp8 seesaw)
#   2. benchmarks/wgmma_speed.py --kv fp8: ways seesaw, seesaw_fp8p, seesaw_lazy, seesaw_fp8p_lazy, fa3 at
#      B128 H128 s_q1 S4096, B64 H128 s_q2 S4096, B16 H128 s_q1 S4096, B128 H64 s_q1 S4096
# Files under $OUT: gpu.txt, fp8p_probe.log, fp8p_gpu_tests.log, fp8p_speed.{txt,json}, summary.txt.
# Run (repository root): OUT=/tmp/out bash benchmarks/device/fp8_producer_gpu.sh
source "$(dirname "$0")/project_env.sh"
export PYTHONPATH=plugins/cute_dsl_mla:plugins/cute_dsl_mla/tests:.:$PYTHONPATH PYTHONUNBUFFERED=1
T=plugins/cute_dsl_mla/tests
{
  start=$(date +%s)
  timeout ${PT:-150} python - > "$OUT/fp8p_probe.log" 2>&1 <<'PROBE'
import time

import torch

from mla_cute_dsl.kernels import alloc_workspace, make_schedule
from mla_cute_dsl.kernels.sm90_wgmma_decode import mla_decode_sm90_wgmma_seesaw
from test_kernel_gpu import check, make_case

n_sm = torch.cuda.get_device_properties(0).multi_processor_count
cases = [  # (label, B, s_q, H, S, varlen, SMs for the schedule)
    ("1 tile, 1 CTA", 1, 1, 64, 64, False, 1),
    ("0..6 tiles, one CTA per request", 8, 1, 128, 400, True, 1),
    ("s_q 2, 0..6 tiles, one CTA per request", 8, 2, 64, 400, True, 1),
    ("B16 H128 S4096, all SMs", 16, 1, 128, 4096, False, n_sm),
]
for label, B, s_q, H, S, varlen, sms in cases:
    t = time.time()
    case = make_case(B, s_q, H, S, torch.float8_e4m3fn, varlen, seed=B + S)
    sched = make_schedule(case["lens_cpu"], s_q, H, sms)
    ws = alloc_workspace(sched)
    out = torch.full((B, s_q, H, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    lse = torch.full((B, s_q, H), float("nan"), dtype=torch.float32, device="cuda")
    print(f"{label}: lens {case['lens_cpu'].tolist()[:8]} ...", flush=True)
    mla_decode_sm90_wgmma_seesaw(case["q"], case["kv"], case["page_table"], case["lens"], case["sm_scale"],
                                 case["kv_scale"], out, lse, sched, ws, fp8_producer=True)
    torch.cuda.synchronize()
    try:
        check(case, out, lse)
        ok = "correct"
    except AssertionError as exc:
        ok = f"WRONG: {exc}"
    print(f"  done in {time.time() - t:.1f} s, {ok}", flush=True)
print("probe finished", flush=True)
PROBE
  rc=$?
  echo "hang probe rc=$rc in $(( $(date +%s) - start )) s"; cat "$OUT/fp8p_probe.log" | tail -12
  if [ $rc -ne 0 ]; then
    echo "probe failed (rc 124 = timeout: a hang); skipping the GPU tests and the speed runs"
    exit $rc
  fi
  start=$(date +%s)
  timeout ${TT:-420} python -m pytest -q -p no:cacheprovider -rfs $T/test_seesaw_fp8p_gpu.py \
    > "$OUT/fp8p_gpu_tests.log" 2>&1
  echo "GPU tests rc=$? in $(( $(date +%s) - start )) s"
  grep -E "passed|failed|FAILED|ERROR|Timeout" "$OUT/fp8p_gpu_tests.log" | tail -12
  start=$(date +%s)
  timeout ${SPEED_TIMEOUT:-240} python benchmarks/wgmma_speed.py --kv fp8 \
    --shapes 128x128x1x4096,64x128x2x4096,16x128x1x4096,128x64x1x4096 \
    --ways seesaw,seesaw_fp8p,seesaw_lazy,seesaw_fp8p_lazy,fa3 --reps ${REPS:-100} --json "$OUT/fp8p_speed.json" \
    > "$OUT/fp8p_speed.txt" 2>&1
  echo "fp8 speed rc=$? in $(( $(date +%s) - start )) s"; grep -A30 "^   B " "$OUT/fp8p_speed.txt" | head -34
} 2>&1 | tee "$OUT/summary.txt"
