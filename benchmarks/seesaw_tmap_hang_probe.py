"""Hang probe of the balanced 16-bit seesaw with a TMA producer warpgroup (tma_producer=True, branch tma-producer,
written compile-only): runs the smallest cases first, each in its own child process under a timeout, so that a
deadlock (a wrong mbarrier parity, a lost Q-empty arrive, a TMA byte count that never completes) is reported with the
case that hung instead of hanging the session.  Each case: fresh random inputs (NaN page tails and spare pages),
NaN-poisoned outputs, one call, synchronize, checked against the fp64 reference (test_kernel_gpu.check) and against
the balanced TMA kernel without the option (max abs difference printed, bitwise equality reported).

    PYTHONPATH=plugins/cute_dsl_mla:plugins/cute_dsl_mla/tests:. python benchmarks/seesaw_tmap_hang_probe.py \\
        [--kernel tmap|fp8ring_wg1of] [--timeout 60] [--compile-timeout 600] [--only SUBSTRING]

``--kernel fp8ring_wg1of`` (branch fp8-wg1of): the same cases with an fp8 e4m3 cache (make_case_fp8: NaN page
tails and spare pages) on the fp8 ring producer kernel (fp8_producer, fp8p_ring=RING_DEFAULT) with
wg1_other_first=True, balanced (the case's schedule) and one item per CTA (the even entry on a plain schedule of
the case's SM count), each checked against the fp64 reference and compared with the same kernel without the option
(close expected, not bitwise: warpgroup 1's S sums its k-blocks in another order; the difference is printed).

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
    """(label, lengths, s_q, H, SMs for the schedule, form, q dtype, lazy), smallest first."""
    rng = random.Random(MANY_SEED)
    many = [rng.choice([0, 1, 63, 64, 65, 128, 129, 192, 200, 320, 384]) for _ in range(24)]
    return [
        ("1 tile, 1 CTA", [64], 1, 64, 1, "balanced", "bf16", True),
        ("partial tile (NaN tail), 1 CTA", [37], 1, 64, 1, "balanced", "bf16", True),
        ("2 requests of 1 tile, 1 column", [64, 64], 1, 64, 1, "even", "bf16", True),
        ("0..6 tiles, 1 column", [0, 64, 128, 192, 256, 320, 384, 1, 65], 1, 64, 1, "even", "bf16", True),
        ("one request split over 1 column (Q kept)", [1500], 1, 64, 1, "even", "bf16", True),
        ("many items, 1 SM, s_q 1", many, 1, 64, 1, "balanced", "bf16", True),
        ("many items, 2 SMs, eager", many, 1, 128, 2, "even", "bf16", False),
        ("many items, 5 SMs, s_q 2, H 126", many, 2, 126, 5, "even", "bf16", True),
        ("many items, 5 SMs, s_q 2, H 128, fp16", many, 2, 128, 5, "balanced", "fp16", True),
        ("many items, 48 rows (s_q 3, H 16), 2 SMs", many, 3, 16, 2, "balanced", "bf16", True),
        ("B128 H128 S1500, all SMs", [1500] * 128, 1, 128, n_sm, "auto", "bf16", True),
        ("B128 H128 S4096, all SMs", [4096] * 128, 1, 128, n_sm, "auto", "bf16", True),
    ]


def _n_sm():
    import torch

    return torch.cuda.get_device_properties(0).multi_processor_count


def compile_all(kernel="tmap"):
    """Build (or load) the kernels the cases use, outside any timeout that a hang would trip: tmap, the four
    balanced TMA kernels with and without the producer; fp8ring_wg1of, the ring producer kernels (one item and
    balanced) with and without wg1_other_first (fp32 partials, as the cases' workspaces)."""
    from mla_cute_dsl.kernels.sm90_wgmma_decode import (get_partial_kernel_wgmma_seesaw,
                                                        get_partial_kernel_wgmma_seesaw_balanced)

    for q in ("bf16", "fp16"):
        for lazy in (False, True):
            if kernel == "fp8ring_wg1of":
                from mla_cute_dsl.kernels.fp8p_ring import RING_DEFAULT

                for wg1of in (True, False):
                    kw = dict(partial="fp32", lazy_rescale=lazy, fp8_producer=True, fp8p_ring=RING_DEFAULT,
                              **({"wg1_other_first": True} if wg1of else {}))
                    get_partial_kernel_wgmma_seesaw_balanced(q, "fp8_e4m3", **kw)
                    get_partial_kernel_wgmma_seesaw(q, "fp8_e4m3", **kw)
                continue
            for tmap in (False, True):
                get_partial_kernel_wgmma_seesaw_balanced(q, q, partial="fp32", tma=True, lazy_rescale=lazy,
                                                         tma_producer=tmap)


def run_case_fp8(i: int) -> int:
    """``--kernel fp8ring_wg1of``: case i on the fp8 ring kernel with wg1_other_first (balanced on the case's
    schedule, then one item per CTA), each against the reference and the kernel without the option."""
    import torch

    from mla_cute_dsl.kernels import alloc_workspace, make_schedule
    from mla_cute_dsl.kernels.fp8p_ring import RING_DEFAULT
    from mla_cute_dsl.kernels.sm90_wgmma_decode import (mla_decode_sm90_wgmma_seesaw,
                                                        mla_decode_sm90_wgmma_seesaw_balanced)
    from test_kernel_gpu import check
    from test_seesaw_balanced_fp8_gpu import make_case_fp8

    label, lens, s_q, H, sms, form, q, lazy = cases(_n_sm())[i]
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[q]
    case = make_case_fp8(lens, s_q, H, dt, 64, seed=random.randrange(1 << 30))
    wrong = 0
    arms = [(mla_decode_sm90_wgmma_seesaw_balanced,
             make_schedule(case["lens_cpu"], s_q, H, sms, balanced=True, form=form, ctas_per_sm=1))]
    if s_q * H >= 64:  # the one-item entry on a plain schedule (its m-blocks of 64 rows: not below 64 rows here)
        arms.append((mla_decode_sm90_wgmma_seesaw, make_schedule(case["lens_cpu"], s_q, H, sms)))
    for entry, sched in arms:
        what = "balanced" if entry is mla_decode_sm90_wgmma_seesaw_balanced else "one item per CTA"
        got = []
        for wg1of in (True, False):
            ws = alloc_workspace(sched)
            for part in ws:
                part.fill_(float("nan"))
            out = torch.full((len(lens), s_q, H, 512), float("nan"), dtype=dt, device="cuda")
            lse = torch.full((len(lens), s_q, H), float("nan"), dtype=torch.float32, device="cuda")
            entry(case["q"], case["kv"], case["page_table"], case["lens"], case["sm_scale"], case["kv_scale"], out,
                  lse, sched, ws, lazy_rescale=lazy, fp8_producer=True, fp8p_ring=RING_DEFAULT,
                  **({"wg1_other_first": True} if wg1of else {}))
            torch.cuda.synchronize()
            got.append((out, lse))
            if wg1of:
                print(f"  {what}: wg1_other_first kernel finished", flush=True)
        (o1, l1), (o0, l0) = got
        try:
            check(case, o1, l1)
            ok = "correct"
        except AssertionError as exc:
            ok = f"WRONG: {exc}"
            wrong += 1
        d = (o1.float() - o0.float()).abs().nan_to_num(float("inf")).max().item()
        print(f"  {what}: {ok}; vs the ring without wg1_other_first: max |out diff| {d:.3g}, bitwise "
              f"{torch.equal(o1, o0) and torch.equal(l1.nan_to_num(), l0.nan_to_num())}", flush=True)
    return 1 if wrong else 0


def run_case(i: int) -> int:
    import torch

    from mla_cute_dsl.kernels import alloc_workspace, make_schedule
    from mla_cute_dsl.kernels.sm90_wgmma_decode import mla_decode_sm90_wgmma_seesaw_balanced
    from test_kernel_gpu import check
    from test_wgmma_t_balanced_gpu import make_case_lens

    label, lens, s_q, H, sms, form, q, lazy = cases(_n_sm())[i]
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[q]
    case = make_case_lens(lens, s_q, H, dt, 64, seed=random.randrange(1 << 30))
    sched = make_schedule(case["lens_cpu"], s_q, H, sms, balanced=True, form=form, ctas_per_sm=1)
    ranges = sched.cta_ranges.tolist()
    print(f"  {len(lens)} requests, {sched.num_cols} columns ({sched.form}), up to "
          f"{max(ranges[c + 1] - ranges[c] for c in range(sched.num_cols))} items per column", flush=True)
    got = []
    for tmap in (True, False):
        ws = alloc_workspace(sched)
        for part in ws:
            part.fill_(float("nan"))
        out = torch.full((len(lens), s_q, H, 512), float("nan"), dtype=dt, device="cuda")
        lse = torch.full((len(lens), s_q, H), float("nan"), dtype=torch.float32, device="cuda")
        mla_decode_sm90_wgmma_seesaw_balanced(case["q"], case["kv"], case["page_table"], case["lens"],
                                              case["sm_scale"], case["kv_scale"], out, lse, sched, ws, tma=True,
                                              lazy_rescale=lazy, tma_producer=tmap)
        torch.cuda.synchronize()
        got.append((out, lse))
        if tmap:
            print("  tma_producer kernel finished", flush=True)
    (o1, l1), (o0, l0) = got
    try:
        check(case, o1, l1)
        ok = "correct"
    except AssertionError as exc:
        ok = f"WRONG: {exc}"
    d = (o1.float() - o0.float()).abs().nan_to_num(float("inf")).max().item()
    print(f"  {ok}; vs the default kernel: max |out diff| {d:.3g}, bitwise "
          f"{torch.equal(o1, o0) and torch.equal(l1.nan_to_num(), l0.nan_to_num())}", flush=True)
    return 0 if ok == "correct" else 1


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds per case (after the compile step)")
    ap.add_argument("--compile-timeout", type=float, default=600.0)
    ap.add_argument("--only", default="", help="run only the cases whose label contains this")
    ap.add_argument("--kernel", default="tmap", choices=("tmap", "fp8ring_wg1of"),
                    help="tmap: tma_producer (16-bit cache); fp8ring_wg1of: the fp8 ring producer with "
                         "wg1_other_first (branch fp8-wg1of)")
    ap.add_argument("--case", type=int, default=None, help=argparse.SUPPRESS)  # the child's side
    ap.add_argument("--compile", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.compile:
        compile_all(a.kernel)
        return 0
    if a.case is not None:
        return run_case_fp8(a.case) if a.kernel == "fp8ring_wg1of" else run_case(a.case)
    start = time.time()
    kern = ["--kernel", a.kernel]
    try:
        rc = subprocess.run([sys.executable, __file__, "--compile"] + kern, timeout=a.compile_timeout).returncode
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
            rc = subprocess.run([sys.executable, __file__, "--case", str(i)] + kern, timeout=a.timeout).returncode
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
