#!/usr/bin/env bash
# On the H200 (devpack set up, env.sh sourced): the balanced seesaw's q_prefetch option (branch q-prefetch, written
# compile-only: MLADecodePartialWGMMASeesaw(balanced=True, q_prefetch=True), each work item issues the next item's Q
# by TMA on a fifth mbarrier and its KV tiles 0 / 1 during its own last pairs; backend option q_prefetch, off by
# default). Carry a .kcache prebuilt from this kernels/ folder (every kernel's cache key hashes the kernels' source,
# so main's prebuilt kernels do not match):
#   ONLY="seesaw_balanced bf16|seesaw_balanced fp16|combine" bash benchmarks/device/prebuild_kcache.sh
#   0. hang probe under timeout PT (default 90 s): the q_prefetch kernel (TMA and cp.async loads) on one 1-tile item,
#      then 1-SM and 5-SM balanced schedules (columns of many items of 0..6 tiles, lengths 0 / 1 / partial tiles,
#      s_q 1 to 3, H 16 / 64 / 126 / 128), then the all-SM plan of B128 H128 S1500, one case at a time, each
#      synchronized, checked against the fp64 reference and printed, so a hang names its case; stops the script if
#      it does not finish (rc 124: a hung kernel; do not run the rest on a wedged GPU)
#   1. GPU tests under timeout TT (default 180 s): test_seesaw_qpf_gpu.py (42 tests: fp64 reference, NaN tails and
#      poisoned outputs, lengths 0 and < s_q, 1-tile items, columns of many items on 1/2/5 SMs, the same request
#      twice in a column, H 64/126/128, s_q 1/2, bf16/fp16, TMA/cp.async, eager/lazy, bit-for-bit equal to the option
#      off, graphs across plan forms, the backend option through MLADecoder)
#   2. benchmarks/wgmma_speed.py, the kernels alone (partial + combine, fp32 partials, TMA loads, lazy rescale), ways
#      WAYS (default balanced_tma_lazy = option off, balanced_tma_lazy_qpf = on, fa3; add ours,ours_qpf for the
#      backend's arm through MLADecoder), interleaved, median of REPS (default 50) graph replays: H=128 s_q 1 and 2 at
#      B 64 / 128 / 180 x S 800 / 1500 / 4096, and H=64 s_q=1 B=128 S=1024, under timeout SPEED_TIMEOUT (200 s)
# Files under $OUT: gpu.txt, qpf_probe.log, qpf_gpu_tests.log, qpf_speed.{txt,json}, summary.txt.
# Run (repository root): OUT=/tmp/out bash benchmarks/device/seesaw_qpf_gpu.sh
source "$(dirname "$0")/project_env.sh"
export PYTHONPATH=plugins/cute_dsl_mla:plugins/cute_dsl_mla/tests:.:$PYTHONPATH PYTHONUNBUFFERED=1
T=plugins/cute_dsl_mla/tests
{
  echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  start=$(date +%s)
  timeout ${PT:-90} python - > "$OUT/qpf_probe.log" 2>&1 <<'PROBE'
import random
import time

import torch

from mla_cute_dsl.kernels import alloc_workspace, make_schedule
from mla_cute_dsl.kernels.sm90_wgmma_decode import mla_decode_sm90_wgmma_seesaw_balanced
from test_kernel_gpu import check
from test_wgmma_t_balanced_gpu import make_case_lens

n_sm = torch.cuda.get_device_properties(0).multi_processor_count
rng = random.Random(7)
many = [rng.choice([0, 1, 63, 64, 65, 128, 129, 192, 200, 320, 384]) for _ in range(24)]
cases = [  # (label, lengths, s_q, H, SMs for the schedule, form)
    ("1 tile, 1 CTA", [64], 1, 64, 1, "balanced"),
    ("2 items of 1 tile, 1 column", [64, 64], 1, 64, 1, "even"),
    ("0..6 tiles, 1 column", [0, 64, 128, 192, 256, 320, 384, 1, 65], 1, 64, 1, "even"),
    ("many items, 1 SM, s_q 1", many, 1, 64, 1, "balanced"),
    ("many items, 5 SMs, s_q 2, H 126", many, 2, 126, 5, "even"),
    ("many items, 5 SMs, s_q 2, H 128", many, 2, 128, 5, "balanced"),
    ("many items, 48 rows (s_q 3, H 16), 2 SMs", many, 3, 16, 2, "balanced"),
    ("B128 H128 S1500, all SMs", [1500] * 128, 1, 128, n_sm, "auto"),
]
for tma in (True, False):
    for label, lens, s_q, H, sms, form in cases:
        t = time.time()
        case = make_case_lens(lens, s_q, H, torch.bfloat16, 64, seed=len(lens) + sum(lens))
        sched = make_schedule(case["lens_cpu"], s_q, H, sms, balanced=True, form=form, ctas_per_sm=1)
        ws = alloc_workspace(sched)
        B = len(lens)
        out = torch.full((B, s_q, H, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
        lse = torch.full((B, s_q, H), float("nan"), dtype=torch.float32, device="cuda")
        print(f"{'tma' if tma else 'cp.async'} {label}: lens {lens[:8]} ..., {sched.num_cols} columns "
              f"({sched.form})", flush=True)
        mla_decode_sm90_wgmma_seesaw_balanced(case["q"], case["kv"], case["page_table"], case["lens"],
                                              case["sm_scale"], case["kv_scale"], out, lse, sched, ws, tma=tma,
                                              lazy_rescale=True, q_prefetch=True)
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
  echo "hang probe rc=$rc in $(( $(date +%s) - start )) s"; tail -30 "$OUT/qpf_probe.log"
  if [ $rc -ne 0 ]; then
    echo "probe failed (rc 124 = timeout: a hang); skipping the GPU tests and the speed runs"
    exit $rc
  fi
  start=$(date +%s)
  timeout ${TT:-180} python -m pytest -q -p no:cacheprovider -rfs $T/test_seesaw_qpf_gpu.py \
    > "$OUT/qpf_gpu_tests.log" 2>&1
  echo "GPU tests rc=$? in $(( $(date +%s) - start )) s"
  grep -E "passed|failed|FAILED|ERROR|Timeout" "$OUT/qpf_gpu_tests.log" | tail -12
  start=$(date +%s)
  shapes=""
  for s_q in 1 2; do for B in 64 128 180; do for S in 800 1500 4096; do
    shapes="$shapes,${B}x128x${s_q}x${S}"
  done; done; done
  timeout ${SPEED_TIMEOUT:-200} python benchmarks/wgmma_speed.py --shapes "${shapes#,},128x64x1x1024" \
    --ways ${WAYS:-balanced_tma_lazy,balanced_tma_lazy_qpf,fa3} --reps ${REPS:-50} \
    --json "$OUT/qpf_speed.json" > "$OUT/qpf_speed.txt" 2>&1
  echo "speed rc=$? in $(( $(date +%s) - start )) s"; grep -A100 "^   B " "$OUT/qpf_speed.txt" | head -102
  grep -E "MISMATCH|error" "$OUT/qpf_speed.txt" | head -10
} 2>&1 | tee "$OUT/summary.txt"
