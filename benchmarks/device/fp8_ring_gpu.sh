#!/usr/bin/env bash
# On the H200 (devpack set up, env.sh sourced): the fp8 producer's register ring (MLADecodePartialWGMMASeesaw(
# fp8_producer=True, fp8p_ring=R), fp8p_producer_ring; branch fp8p-inflight, written compile-only: each 16-fp8 chunk's
# ld.global issued R - 1 chunks ahead of its conversion, setmaxnreg 208 math / 88 producer; and with fp8p_stage=4,
# every third chunk staged through 8 KB of shared memory by cp.async, 9 chunks ahead) against the one-part producer
# (one item and balanced) and fa3. Carry a .kcache prebuilt from this kernels/ folder (every kernel's cache
# key hashes the kernels' source, so main's prebuilt kernels do not match):
#   ONLY="fp8p|combine" bash benchmarks/device/prebuild_kcache.sh   (every producer kernel, ring and not, and combines)
#   0. hang probe under timeout PT (default 100 s): the ring kernels (both sizes, and staged) on 1-SM schedules (one CTA per
#      request: tile counts 0..6, lengths 0 / 1 / partial tiles, page 64 and 256), the balanced ring on 1-SM and
#      2-SM columns of many items, then B16 H128 S4096 on all SMs, one case at a time, each synchronized, checked
#      against the fp64 reference and against the one-part producer (bitwise), printed, so a hang names its case;
#      stops the script if it does not finish (rc 124: a hung kernel; do not run the rest on a wedged GPU)
#   1. benchmarks/wgmma_speed.py --kv fp8 under timeout ST (default 220 s), the kernels alone, interleaved, median of
#      REPS (default 50) graph replays: ways (WAYS to override) seesaw_fp8p_lazy (the one-part producer, even split),
#      seesaw_fp8p_ring_lazy (R = 7), seesaw_fp8p_ring_staged_lazy, balanced_fp8p_lazy, balanced_fp8p_ring_lazy,
#      balanced_fp8p_ring_staged_lazy, fa3 at H=128 B=128/64/16 s_q 1/2 and H=64 B=128 s_q 1, S=4096 (the ring-size
#      A/B: WAYS=seesaw_fp8p_lazy,seesaw_fp8p_ring_lazy,seesaw_fp8p_ring5_lazy,fa3)
#   2. GPU tests under timeout TT (default 240 s): test_seesaw_fp8p_ring_gpu.py (fp64 reference, NaN tails, bitwise
#      against the one-part producer, every tile count 0..10, pages 64/128/256, balanced columns on 1/5 SMs, graphs,
#      staged and not, the backend's fp8_loader=ring / ring_staged)
# Files under $OUT: gpu.txt, ring_probe.log, ring_speed.{txt,json}, ring_gpu_tests.log, summary.txt.
# Run (repository root): OUT=/tmp/out bash benchmarks/device/fp8_ring_gpu.sh   (SKIP_TESTS=1: probe and speed only)
source "$(dirname "$0")/project_env.sh"
export PYTHONPATH=plugins/cute_dsl_mla:plugins/cute_dsl_mla/tests:.:$PYTHONPATH PYTHONUNBUFFERED=1
T=plugins/cute_dsl_mla/tests
{
  start=$(date +%s)
  timeout ${PT:-100} python - > "$OUT/ring_probe.log" 2>&1 <<'PROBE'
import random
import time

import torch

from mla_cute_dsl.kernels import alloc_workspace, make_schedule
from mla_cute_dsl.kernels.fp8p_ring import RING_DEFAULT, RING_SIZES, STAGE_SLOTS
from mla_cute_dsl.kernels.sm90_wgmma_decode import (mla_decode_sm90_wgmma_seesaw,
                                                    mla_decode_sm90_wgmma_seesaw_balanced)
from test_kernel_gpu import check
from test_seesaw_balanced_fp8_gpu import make_case_fp8

n_sm = torch.cuda.get_device_properties(0).multi_processor_count
rng = random.Random(7)
many = [rng.choice([0, 1, 63, 64, 65, 128, 129, 192, 200, 320, 384]) for _ in range(24)]
cases = [  # (label, lengths, s_q, H, page, SMs for the schedule, balanced form or None for the one-item kernel)
    ("1 tile, 1 CTA", [64], 1, 64, 64, 1, None),
    ("0..6 tiles, one CTA each", [0, 64, 128, 192, 256, 320, 384, 1, 65], 1, 64, 64, 1, None),
    ("0..6 tiles, page 256, s_q 2", [0, 64, 128, 192, 256, 320, 384, 1, 65, 700], 2, 64, 256, 1, None),
    ("B16 H128 S4096, page 256, all SMs (items inside pages)", [4096] * 16, 1, 128, 256, n_sm, None),
    ("balanced: many items, 1 SM", many, 1, 64, 64, 1, "balanced"),
    ("balanced: many items, 2 SMs, s_q 2", many, 2, 64, 64, 2, "even"),
    ("balanced: B16 H128 S4096, all SMs", [4096] * 16, 1, 128, 64, n_sm, "auto"),
]


def run(case, sched, ws, form, ring, stage=0):
    B, s_q, H, _ = case["q"].shape
    out = torch.full((B, s_q, H, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    lse = torch.full((B, s_q, H), float("nan"), dtype=torch.float32, device="cuda")
    for part in ws:
        part.fill_(float("nan"))
    fn = mla_decode_sm90_wgmma_seesaw if form is None else mla_decode_sm90_wgmma_seesaw_balanced
    fn(case["q"], case["kv"], case["page_table"], case["lens"], case["sm_scale"], case["kv_scale"], out, lse, sched, ws,
       lazy_rescale=True, fp8_producer=True, **({"fp8p_ring": ring} if ring else {}),
       **({"fp8p_stage": stage} if stage else {}))
    torch.cuda.synchronize()
    return out, lse


for label, lens, s_q, H, page, sms, form in cases:
    case = make_case_fp8(lens, s_q, H, torch.bfloat16, page, seed=len(lens) + sum(lens))
    if form is None:
        sched = make_schedule(case["lens_cpu"], s_q, H, sms)
    else:
        sched = make_schedule(case["lens_cpu"], s_q, H, sms, balanced=True, form=form, ctas_per_sm=1)
    ws = alloc_workspace(sched)
    print(f"{label}: lens {lens[:8]} ..., {'one item per CTA' if form is None else sched.form}", flush=True)
    ref = run(case, sched, ws, form, 0)
    for ring, stage in [(r, 0) for r in RING_SIZES] + [(RING_DEFAULT, STAGE_SLOTS)]:
        t = time.time()
        out, lse = run(case, sched, ws, form, ring, stage)
        try:
            check(case, out, lse)
            ok = "correct"
        except AssertionError as exc:
            ok = f"WRONG: {exc}"
        same = torch.equal(out, ref[0]) and torch.equal(lse, ref[1])
        print(f"  ring {ring}{f' staged {stage}' if stage else ''}: done in {time.time() - t:.1f} s, {ok}, bitwise equal to the one-part producer: {same}",
              flush=True)
print("probe finished", flush=True)
PROBE
  rc=$?
  echo "hang probe rc=$rc in $(( $(date +%s) - start )) s"; tail -24 "$OUT/ring_probe.log"
  if [ $rc -ne 0 ]; then
    echo "probe failed (rc 124 = timeout: a hang); skipping the speed runs and the GPU tests"
    exit $rc
  fi
  start=$(date +%s)
  timeout ${ST:-220} python benchmarks/wgmma_speed.py --kv fp8 \
    --shapes 128x128x1x4096,128x128x2x4096,64x128x1x4096,64x128x2x4096,16x128x1x4096,16x128x2x4096,128x64x1x4096 \
    --ways ${WAYS:-seesaw_fp8p_lazy,seesaw_fp8p_ring_lazy,seesaw_fp8p_ring_staged_lazy,balanced_fp8p_lazy,balanced_fp8p_ring_lazy,balanced_fp8p_ring_staged_lazy,fa3} \
    --reps ${REPS:-50} --json "$OUT/ring_speed.json" > "$OUT/ring_speed.txt" 2>&1
  echo "fp8 speed rc=$? in $(( $(date +%s) - start )) s"; grep -A50 "^   B " "$OUT/ring_speed.txt" | head -50
  grep -E "MISMATCH|error" "$OUT/ring_speed.txt" | head -8
  if [ -z "${SKIP_TESTS:-}" ]; then
    start=$(date +%s)
    timeout ${TT:-240} python -m pytest -q -p no:cacheprovider -rfs $T/test_seesaw_fp8p_ring_gpu.py \
      > "$OUT/ring_gpu_tests.log" 2>&1
    echo "GPU tests rc=$? in $(( $(date +%s) - start )) s"
    grep -E "passed|failed|FAILED|ERROR|Timeout" "$OUT/ring_gpu_tests.log" | tail -12
  fi
} 2>&1 | tee "$OUT/summary.txt"
