"""Hang probe of the fp8 ring producer with per-block release (fp8_producer=True, fp8p_ring=7,
fp8p_block_release=True; branch fp8-block-release, written compile-only): runs the smallest cases first, each in its
own child process under a timeout, so that a deadlock (a block barrier waited with the wrong parity, a release or a
full arrive on the wrong block's mbarrier) is reported with the case that hung instead of hanging the session.  Each
case: fresh random inputs (fp8 cache, NaN page tails and spare pages), NaN-poisoned outputs, one call of the kernel
with the option, synchronize, checked against the fp64 reference (test_kernel_gpu.check) and against the same ring
kernel without the option (max abs difference printed, bitwise equality reported).  One item per CTA ("even": the
plain seesaw entry) and balanced ("bal": the balanced entry's plan forms).

    PYTHONPATH=plugins/cute_dsl_mla:plugins/cute_dsl_mla/tests:. python benchmarks/seesaw_fp8pbr_hang_probe.py \\
        [--timeout 60] [--compile-timeout 600] [--only SUBSTRING]

Exit status: 0 all cases finished (wrong results are printed as WRONG and counted, rc 1), 124 a case timed out (the
remaining cases are not run: the GPU may be wedged), 2 the compile step failed.
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import time

MANY_SEED = 7


def cases(n_sm: int):
    """(label, lengths, s_q, H, SMs for the schedule, kind: "even" or a balanced plan form, q dtype, lazy),
    smallest first."""
    rng = random.Random(MANY_SEED)
    many = [rng.choice([0, 1, 63, 64, 65, 128, 129, 192, 200, 320, 384]) for _ in range(24)]
    return [
        ("even: 1 tile, 1 CTA", [64], 1, 64, 1, "even", "bf16", True),
        ("even: 1 pair (part 3 filled, not released), 1 CTA", [128], 1, 64, 1, "even", "bf16", True),
        ("even: 5 tiles (part 3 refilled per block once), 1 CTA", [320], 1, 64, 1, "even", "bf16", True),
        ("even: partial tile (NaN tail), 1 CTA", [37], 1, 64, 1, "even", "bf16", True),
        ("even: 0..10 tiles, one item each, 1 SM", [64 * t for t in range(11)] + [1, 65], 1, 64, 1, "even", "bf16",
         True),
        ("bal: 1 tile, 1 CTA", [64], 1, 64, 1, "balanced", "bf16", True),
        ("bal: 0..6 tiles, 1 column", [0, 64, 128, 192, 256, 320, 384, 1, 65], 1, 64, 1, "even_form", "bf16", True),
        ("bal: many items, 1 SM, s_q 1", many, 1, 64, 1, "balanced", "bf16", True),
        ("bal: many items, 2 SMs, eager", many, 1, 128, 2, "even_form", "bf16", False),
        ("bal: many items, 5 SMs, s_q 2, H 126, fp16", many, 2, 126, 5, "balanced", "fp16", True),
        ("even: B128 H128 S1500, all SMs", [1500] * 128, 1, 128, n_sm, "even", "bf16", True),
        ("bal: B128 H128 S4096, all SMs", [4096] * 128, 1, 128, n_sm, "auto", "bf16", True),
    ]


def _n_sm():
    import torch

    return torch.cuda.get_device_properties(0).multi_processor_count


def compile_all():
    """Build (or load) the kernels the cases use (fp32 partials, narrow stores: the probe's workspace), outside any
    timeout that a hang would trip."""
    from mla_cute_dsl.kernels.sm90_wgmma_decode import (get_partial_kernel_wgmma_seesaw,
                                                        get_partial_kernel_wgmma_seesaw_balanced)

    for q in ("bf16", "fp16"):
        for lazy in (False, True):
            for blk in (False, True):
                for get in (get_partial_kernel_wgmma_seesaw, get_partial_kernel_wgmma_seesaw_balanced):
                    get(q, "fp8_e4m3", partial="fp32", lazy_rescale=lazy, fp8_producer=True, fp8p_ring=7,
                        **({"fp8p_block_release": True} if blk else {}))


def run_case(i: int) -> int:
    import torch

    from mla_cute_dsl.kernels import alloc_workspace, make_schedule
    from mla_cute_dsl.kernels.sm90_wgmma_decode import (mla_decode_sm90_wgmma_seesaw,
                                                        mla_decode_sm90_wgmma_seesaw_balanced)
    from test_kernel_gpu import check
    from test_seesaw_balanced_fp8_gpu import make_case_fp8

    label, lens, s_q, H, sms, kind, q, lazy = cases(_n_sm())[i]
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[q]
    case = make_case_fp8(lens, s_q, H, dt, 64, seed=random.randrange(1 << 30))
    if kind == "even":
        sched = make_schedule(case["lens_cpu"], s_q, H, sms)
        entry = mla_decode_sm90_wgmma_seesaw
        print(f"  {len(lens)} requests, {sched.num_items} items (one per CTA)", flush=True)
    else:
        form = "even" if kind == "even_form" else kind
        sched = make_schedule(case["lens_cpu"], s_q, H, sms, balanced=True, form=form, ctas_per_sm=1)
        entry = mla_decode_sm90_wgmma_seesaw_balanced
        ranges = sched.cta_ranges.tolist()
        print(f"  {len(lens)} requests, {sched.num_cols} columns ({sched.form}), up to "
              f"{max(ranges[c + 1] - ranges[c] for c in range(sched.num_cols))} items per column", flush=True)
    got = []
    for blk in (True, False):
        ws = alloc_workspace(sched)  # fp32 partials, narrow stores (make_schedule's default): compile_all's kernels
        for part in ws:
            part.fill_(float("nan"))
        out = torch.full((len(lens), s_q, H, 512), float("nan"), dtype=dt, device="cuda")
        lse = torch.full((len(lens), s_q, H), float("nan"), dtype=torch.float32, device="cuda")
        entry(case["q"], case["kv"], case["page_table"], case["lens"], case["sm_scale"], case["kv_scale"], out, lse,
              sched, ws, lazy_rescale=lazy, fp8_producer=True, fp8p_ring=7,
              **({"fp8p_block_release": True} if blk else {}))
        torch.cuda.synchronize()
        got.append((out, lse))
        if blk:
            print("  fp8p_block_release kernel finished", flush=True)
    (o1, l1), (o0, l0) = got
    try:
        check(case, o1, l1)
        ok = "correct"
    except AssertionError as exc:
        ok = f"WRONG: {exc}"
    d = (o1.float() - o0.float()).abs().nan_to_num(float("inf")).max().item()
    print(f"  {ok}; vs the ring kernel without the option: max |out diff| {d:.3g}, bitwise "
          f"{torch.equal(o1, o0) and torch.equal(l1.nan_to_num(), l0.nan_to_num())}", flush=True)
    return 0 if ok == "correct" else 1


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds per case (after the compile step)")
    ap.add_argument("--compile-timeout", type=float, default=600.0)
    ap.add_argument("--only", default="", help="run only the cases whose label contains this")
    ap.add_argument("--case", type=int, default=None, help=argparse.SUPPRESS)  # the child's side
    ap.add_argument("--compile", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.compile:
        compile_all()
        return 0
    if a.case is not None:
        return run_case(a.case)
    start = time.time()
    try:
        rc = subprocess.run([sys.executable, __file__, "--compile"], timeout=a.compile_timeout).returncode
    except subprocess.TimeoutExpired:
        rc = 124
    print(f"compile step rc={rc} in {time.time() - start:.0f} s", flush=True)
    if rc != 0:
        return 2
    labels = [c[0] for c in cases(132)]  # the labels only (the SM count is the child's)
    wrong = 0
    for i, label in enumerate(labels):
        if a.only not in label:
            continue
        print(f"[{i}] {label}", flush=True)
        t = time.time()
        try:
            rc = subprocess.run([sys.executable, __file__, "--case", str(i)], timeout=a.timeout).returncode
        except subprocess.TimeoutExpired:
            print(f"HANG: case [{i}] {label} did not finish in {a.timeout:.0f} s; stopping (the GPU may be wedged)",
                  flush=True)
            return 124
        print(f"  rc={rc} in {time.time() - t:.1f} s", flush=True)
        wrong += rc != 0
    print(f"probe finished: {wrong} case(s) wrong or failed", flush=True)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
