#!/usr/bin/env bash
# On the H200 (devpack set up, env.sh sourced): the balanced fp8 seesaw with the producer warpgroup
# (MLADecodePartialWGMMASeesaw(balanced=True, fp8_producer=True), kernel_fp8p_balanced; branch fp8-balanced-producer,
# written compile-only: 384 threads, the producer and the math warpgroups each walking the CTA column's items with the
# full / empty mbarrier phases continued across items, setmaxnreg 216 math / 72 producer) against the even fp8p
# seesaw, the inline balanced fp8 seesaw and fa3. Carry a .kcache prebuilt from this kernels/ folder (every kernel's
# cache key hashes the kernels' source, so main's prebuilt kernels do not match):
#   ONLY="seesaw_fp8p_balanced|seesaw_balanced_fp8|fp8p|combine" bash benchmarks/device/prebuild_kcache.sh
#   0. hang probe under timeout PT (default 150 s): the new kernel on 1-SM and 2-SM balanced schedules (columns of many
#      items of 0..6 tiles, lengths 0 / 1 / partial tiles, s_q 1 and 2), then the all-SM schedule of B16 H128 S4096,
#      one case at a time, each synchronized and printed, so a hang names its case; stops the script if it does not
#      finish (rc 124: a hung kernel; do not run the rest on a wedged GPU)
#   1. GPU tests under timeout TT (default 480 s): test_seesaw_fp8p_balanced_gpu.py (fp64 reference, NaN tails,
#      poisoned outputs, lengths 0 and < s_q, columns of many items on 1/2/5 SMs, H 64/126/128, s_q 1/2, bf16/fp16 q,
#      graphs, against the even fp8p seesaw and the inline balanced fp8 seesaw, the backend flag)
#   2. benchmarks/wgmma_speed.py --kv fp8: ways seesaw_fp8p_lazy, balanced_lazy, balanced_fp8p_lazy, fa3 at
#      B24 / B40 / B48 / B128 H128 s_q1 S4096, B48 H128 s_q2 S4096, B64 H64 s_q1 S4096
# Files under $OUT: gpu.txt, fp8bp_probe.log, fp8bp_gpu_tests.log, fp8bp_speed.{txt,json}, summary.txt.
# Run (repository root): OUT=/tmp/out bash benchmarks/device/fp8_balanced_producer_gpu.sh
source "$(dirname "$0")/project_env.sh"
export PYTHONPATH=plugins/cute_dsl_mla:plugins/cute_dsl_mla/tests:.:$PYTHONPATH PYTHONUNBUFFERED=1
T=plugins/cute_dsl_mla/tests
{
  start=$(date +%s)
  timeout ${PT:-150} python - > "$OUT/fp8bp_probe.log" 2>&1 <<'PROBE'
import random
import time

import torch

from mla_cute_dsl.kernels import alloc_workspace, make_schedule
from mla_cute_dsl.kernels.sm90_wgmma_decode import mla_decode_sm90_wgmma_seesaw_balanced
from test_kernel_gpu import check
from test_seesaw_balanced_fp8_gpu import make_case_fp8

n_sm = torch.cuda.get_device_properties(0).multi_processor_count
rng = random.Random(7)
many = [rng.choice([0, 1, 63, 64, 65, 128, 129, 192, 200, 320, 384]) for _ in range(24)]
cases = [  # (label, lengths, s_q, H, SMs for the schedule, form)
    ("1 tile, 1 CTA", [64], 1, 64, 1, "balanced"),
    ("2 items of 1 tile, 1 column", [64, 64], 1, 64, 1, "even"),
    ("0..6 tiles, 1 column", [0, 64, 128, 192, 256, 320, 384, 1, 65], 1, 64, 1, "even"),
    ("many items, 1 SM, s_q 1", many, 1, 64, 1, "balanced"),
    ("many items, 2 SMs, s_q 2", many, 2, 64, 2, "even"),
    ("many items, 5 SMs, s_q 2, H 128", many, 2, 128, 5, "balanced"),
    ("B16 H128 S4096, all SMs", [4096] * 16, 1, 128, n_sm, "auto"),
]
for label, lens, s_q, H, sms, form in cases:
    t = time.time()
    case = make_case_fp8(lens, s_q, H, torch.bfloat16, 64, seed=len(lens) + sum(lens))
    sched = make_schedule(case["lens_cpu"], s_q, H, sms, balanced=True, form=form, ctas_per_sm=1)
    ws = alloc_workspace(sched)
    B = len(lens)
    out = torch.full((B, s_q, H, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    lse = torch.full((B, s_q, H), float("nan"), dtype=torch.float32, device="cuda")
    print(f"{label}: lens {lens[:8]} ..., {sched.num_cols} columns ({sched.form})", flush=True)
    mla_decode_sm90_wgmma_seesaw_balanced(case["q"], case["kv"], case["page_table"], case["lens"], case["sm_scale"],
                                          case["kv_scale"], out, lse, sched, ws, lazy_rescale=True, fp8_producer=True)
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
  echo "hang probe rc=$rc in $(( $(date +%s) - start )) s"; cat "$OUT/fp8bp_probe.log" | tail -16
  if [ $rc -ne 0 ]; then
    echo "probe failed (rc 124 = timeout: a hang); skipping the GPU tests and the speed runs"
    exit $rc
  fi
  start=$(date +%s)
  timeout ${TT:-480} python -m pytest -q -p no:cacheprovider -rfs $T/test_seesaw_fp8p_balanced_gpu.py \
    > "$OUT/fp8bp_gpu_tests.log" 2>&1
  echo "GPU tests rc=$? in $(( $(date +%s) - start )) s"
  grep -E "passed|failed|FAILED|ERROR|Timeout" "$OUT/fp8bp_gpu_tests.log" | tail -12
  start=$(date +%s)
  timeout ${SPEED_TIMEOUT:-300} python benchmarks/wgmma_speed.py --kv fp8 \
    --shapes 24x128x1x4096,40x128x1x4096,48x128x1x4096,128x128x1x4096,48x128x2x4096,64x64x1x4096 \
    --ways seesaw_fp8p_lazy,balanced_lazy,balanced_fp8p_lazy,fa3 --reps ${REPS:-100} \
    --json "$OUT/fp8bp_speed.json" > "$OUT/fp8bp_speed.txt" 2>&1
  echo "fp8 speed rc=$? in $(( $(date +%s) - start )) s"; grep -A30 "^   B " "$OUT/fp8bp_speed.txt" | head -40
} 2>&1 | tee "$OUT/summary.txt"
