"""GPU tests of the balanced 16-bit seesaw with a TMA producer warpgroup (``MLADecodePartialWGMMASeesaw(tma=True,
balanced=True, tma_producer=True)``, ``kernel_tmap_balanced``; branch tma-producer, written compile-only): warpgroup 2
issues every KV part and Q by TMA on full / empty mbarriers, walking the column's items ahead of the math warpgroups.

Against the fp64 reference of test_kernel_gpu.py and against the balanced TMA kernel without the option on the same
schedule (the default kernel's arithmetic: the same tiles in the same order, the same Q bytes, the same epilogue, so
the results should agree bit for bit; asserted to 1e-3 relative closeness, and whether they are bitwise equal is
printed: run with -s to see it).

* The smallest cases first (one 1-tile item; two 1-tile items in one column; one column of items of 0..6 tiles): a
  wrong mbarrier parity (KV full / empty, Q full / empty) or a lost TMA byte count shows as a hang there: run this file
  under `timeout`, or benchmarks/seesaw_tmap_hang_probe.py first (per-case timeouts).
* Fresh random inputs per case, shuffled page tables, NaN in unused pages and page tails (TMA copies them as they are:
  zero_v_tail must clean the last tile's V rows before P V), NaN-poisoned outputs and partial buffers; lengths with 0
  and < s_q, uniform, skewed, log-skewed, short (every item one tile), tiny (0..s_q); s_q 1 / 2 / 3, H 16 (48 rows:
  the Q box taller than R), 64, 126 (a partial second m-block) and 128; pages 64 and 256; bf16 and fp16; eager and
  lazy rescale; large-magnitude q (std 100); both plan forms and the hybrid's choice; 1 / 2 / 5-SM schedules whose
  columns walk dozens of items (items of different requests, pieces of one request); an even-form column holding
  two items of one request (Q kept, no Q-empty phase between them).
* A CUDA graph captured at one plan form, re-planned in place to the other with new lengths, replayed: equal to eager
  bit for bit and to the reference.
* With wg1_other_first too (branch tmap-wg1of: warpgroup 1 waits tile b's part 2 first and the producer issues it
  first; these 11 passed on the H200 in the twenty-fifth session): the smallest cases, the bf16 lazy cases of the table and the few-column walks, against the
  reference and against the balanced TMA kernel with wg1_other_first alone (the same arithmetic: bitwise expected).
Skipped without an sm_90 GPU.  Kernels: fp32 partials, narrow stores, TMA, tma_producer, eager / lazy, bf16 / fp16
(benchmarks/device/prebuild_kernels.py labels "... tmap"), and bf16 lazy with wg1_other_first ("... tmap wg1of"; its
twin without the producer: "... tma lazy wg1of").

    PYTHONPATH=plugins/cute_dsl_mla:plugins/cute_dsl_mla/tests:. timeout 300 python -m pytest -q -p no:cacheprovider \\
        -rfs plugins/cute_dsl_mla/tests/test_seesaw_tmap_gpu.py
"""

from __future__ import annotations

import random

import pytest
import torch

from graph_replay import graph_replay_equals_eager
from test_kernel_gpu import check
from test_wgmma_t_balanced_gpu import _lengths, _num_sms, _outs, make_case_lens, needs_sm90

pytestmark = pytest.mark.gpu

DT = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _schedule(case, form="auto", num_sms=None):
    from mla_cute_dsl.kernels import alloc_workspace, make_schedule

    B, s_q, H, _ = case["q"].shape
    sched = make_schedule(case["lens_cpu"], s_q, H, num_sms or _num_sms(), balanced=True, form=form, ctas_per_sm=1)
    ws = alloc_workspace(sched)
    for part in ws:  # a partial slot the kernel fails to write must not pass as old memory
        part.fill_(float("nan"))
    return sched, ws


def _run(case, lazy, tmap, form="auto", num_sms=None, wg1of=False):
    """One call of the balanced TMA seesaw (tma_producer on or off; wg1of: wg1_other_first) on a fresh schedule and
    NaN-poisoned buffers."""
    from mla_cute_dsl.kernels.sm90_wgmma_decode import mla_decode_sm90_wgmma_seesaw_balanced

    sched, ws = _schedule(case, form, num_sms)
    out, lse = _outs(case)
    mla_decode_sm90_wgmma_seesaw_balanced(case["q"], case["kv"], case["page_table"], case["lens"], case["sm_scale"],
                                          case["kv_scale"], out, lse, sched, ws, tma=True, lazy_rescale=lazy,
                                          tma_producer=tmap, **({"wg1_other_first": True} if wg1of else {}))
    torch.cuda.synchronize()
    return out, lse, sched


def _close(a, b, rtol=1e-3):
    """Equal NaN / inf pattern and |a - b| <= rtol * max(1, |b|) elementwise (fp32)."""
    a, b = a.float(), b.float()
    fin = torch.isfinite(b)
    if not torch.equal(torch.isfinite(a), fin) or not torch.equal(a[~fin].nan_to_num(), b[~fin].nan_to_num()):
        return False, float("inf")
    d = (a[fin] - b[fin]).abs()
    return bool((d <= rtol * b[fin].abs().clamp_min(1.0)).all()), float(d.max()) if d.numel() else 0.0


def _check_both(case, lazy, form="auto", num_sms=None, tol=1e-2, wg1of=False):
    """tma_producer on: against the reference; then off (the default balanced TMA kernel) on the same schedule:
    close (and reported whether bitwise equal).  ``wg1of``: wg1_other_first in both calls."""
    out, lse, sched = _run(case, lazy, True, form, num_sms, wg1of)
    check(case, out, lse, tol=tol)
    out0, lse0, _ = _run(case, lazy, False, form, num_sms, wg1of)
    ok_o, d_o = _close(out, out0)
    ok_l, d_l = _close(lse, lse0)
    print(f"tmap{' wg1of' if wg1of else ''} vs default: out max diff {d_o:.3g}, lse {d_l:.3g}, bitwise "
          f"{torch.equal(out, out0) and torch.equal(lse, lse0)}")
    assert ok_o and ok_l, (d_o, d_l)
    return sched


SMALL = [  # label, lengths, s_q, H, SMs for the schedule, form
    ("one 1-tile item", [64], 1, 64, None, "balanced"),
    ("two 1-tile items, 1 column", [64, 64], 1, 64, 1, "even"),
    ("0..6 tiles, 1 column", [0, 64, 128, 192, 256, 320, 384, 1, 65], 1, 64, 1, "even"),
]


@needs_sm90
@pytest.mark.parametrize("label,lens,s_q,H,sms,form", SMALL, ids=[c[0] for c in SMALL])
def test_tmap_smallest_cases_first(label, lens, s_q, H, sms, form):
    case = make_case_lens(lens, s_q, H, torch.bfloat16, 64, seed=random.randrange(1 << 30))
    _check_both(case, True, form, sms)


CASES = [  # B, s_q, H, lengths, S, page, dtype, form, lazy
    (6, 1, 64, "varlen", 1000, 64, "bf16", "balanced", False),    # 0, 1, s_q - 1, S mixed in
    (7, 1, 128, "varlen", 2000, 256, "bf16", "balanced", True),    # page 256
    (9, 2, 128, "logskew", 4096, 64, "fp16", "even", False),       # fp16, even form
    (24, 1, 128, "uniform", 4096, 64, "bf16", "auto", True),       # plans balanced
    (20, 2, 64, "tiny", 8, 64, "bf16", "balanced", False),         # lengths 0..s_q (causal rows empty)
    (100, 2, 64, "short", 64, 64, "bf16", "auto", True),           # every item one tile, several per column
    (200, 1, 128, "varlen", 600, 64, "bf16", "even", True),        # more requests than columns
    (180, 1, 128, "uniform", 800, 64, "fp16", "auto", True),       # three items per column
    (16, 2, 126, "skewed", 1500, 64, "fp16", "balanced", False),   # 126 rows: a partial second m-block
    (12, 2, 128, "skewed", 4096, 64, "bf16", "balanced", True),    # with q std 100 below
    (8, 3, 16, "varlen", 2000, 64, "bf16", "balanced", True),      # 48 rows: the Q box taller than R
]


@needs_sm90
@pytest.mark.parametrize("B,s_q,H,kind,S,page,dtype,form,lazy", CASES)
def test_tmap_against_fp64_reference_and_the_default_kernel(B, s_q, H, kind, S, page, dtype, form, lazy):
    rng = random.Random()
    q_std = 100.0 if (B, kind) == (12, "skewed") else 1.0
    case = make_case_lens(_lengths(kind, B, S, s_q, rng), s_q, H, DT[dtype], page, seed=rng.randrange(1 << 30),
                          q_std=q_std)
    _check_both(case, lazy, form, tol=2e-2 if q_std > 1 else 1e-2)


@needs_sm90
@pytest.mark.parametrize("num_sms,s_q,H", [(1, 1, 64), (2, 2, 128), (5, 1, 128)])
def test_tmap_few_columns_walk_many_items(num_sms, s_q, H):
    """Schedules for 1, 2 or 5 SMs: each column walks many items of 0-6 tiles (odd counts, 1-tile items, pieces of
    one request and of several), so the producer runs across dozens of item boundaries of every kind."""
    rng = random.Random()
    lens = [rng.choice([0, 1, 63, 64, 65, 128, 129, 192, 200, 320, 384]) for _ in range(24)]
    case = make_case_lens(lens, s_q, H, torch.bfloat16, 64, seed=rng.randrange(1 << 30))
    for form in ("even", "balanced"):
        sched = _check_both(case, True, form, num_sms)
        ranges = sched.cta_ranges.tolist()
        assert max(ranges[c + 1] - ranges[c] for c in range(sched.num_cols)) > 3


@needs_sm90
def test_tmap_two_items_of_one_request_in_a_column():
    """The even form on 4 columns puts two items of one request in one column: Q is kept (no Q-empty phase, no
    reload), the KV phases continue."""
    lens = [64, 1500, 700, 0, 65]
    case = make_case_lens(lens, 1, 64, torch.bfloat16, 64, seed=random.randrange(1 << 30))
    sched = _check_both(case, False, "even", 4)
    items, ranges = sched.work_info.tolist(), sched.cta_ranges.tolist()
    assert any(len({items[i][0] for i in range(ranges[c], ranges[c + 1])}) < ranges[c + 1] - ranges[c]
               for c in range(4))


@needs_sm90
@pytest.mark.parametrize("first,second", [("even", "balanced")])
def test_tmap_graph_replays_the_other_form_equal_to_eager(first, second):
    """Capture with the schedule in one form, re-plan the other form with new lengths into the same buffers (0 and 1
    among them), new q, replay: equal to an eager call bit for bit and to the reference."""
    from mla_cute_dsl.kernels import make_schedule
    from mla_cute_dsl.kernels.sm90_wgmma_decode import mla_decode_sm90_wgmma_seesaw_balanced

    rng = random.Random()
    B, s_q, H, S = 24, 2, 128, 2048
    case = make_case_lens([S] * B, s_q, H, torch.bfloat16, 64, seed=rng.randrange(1 << 30))
    sched, ws = _schedule(case, first)
    out, lse = _outs(case)

    def call():
        mla_decode_sm90_wgmma_seesaw_balanced(case["q"], case["kv"], case["page_table"], case["lens"],
                                              case["sm_scale"], case["kv_scale"], out, lse, sched, ws, tma=True,
                                              lazy_rescale=True, tma_producer=True)

    call()  # compiles (or loads) outside the capture

    def refresh():
        new = _lengths("skewed", B, S, s_q, rng)
        new[1], new[2] = 0, 1
        case["lens_cpu"] = torch.tensor(new, dtype=torch.int32)
        case["lens"].copy_(case["lens_cpu"])
        make_schedule(case["lens_cpu"], s_q, H, _num_sms(), out=sched, balanced=True, form=second, ctas_per_sm=1)
        assert sched.form == second
        case["q"].copy_(torch.randn_like(case["q"], dtype=torch.float32).to(case["q"].dtype))

    graph_replay_equals_eager(call, out, lse, refresh=refresh, check=lambda o, l: check(case, o, l), scratch=ws)


# wg1_other_first with the producer (branch tmap-wg1of): bf16, lazy (the kernels prebuilt as "... tmap wg1of")
WG1OF_CASES = [c for c in CASES if c[6] == "bf16" and c[8]]


@needs_sm90
@pytest.mark.parametrize("label,lens,s_q,H,sms,form", SMALL, ids=[c[0] for c in SMALL])
def test_tmap_wg1of_smallest_cases_first(label, lens, s_q, H, sms, form):
    case = make_case_lens(lens, s_q, H, torch.bfloat16, 64, seed=random.randrange(1 << 30))
    _check_both(case, True, form, sms, wg1of=True)


@needs_sm90
@pytest.mark.parametrize("B,s_q,H,kind,S,page,dtype,form,lazy", WG1OF_CASES)
def test_tmap_wg1of_against_fp64_reference_and_wg1of_alone(B, s_q, H, kind, S, page, dtype, form, lazy):
    rng = random.Random()
    q_std = 100.0 if (B, kind) == (12, "skewed") else 1.0
    case = make_case_lens(_lengths(kind, B, S, s_q, rng), s_q, H, DT[dtype], page, seed=rng.randrange(1 << 30),
                          q_std=q_std)
    _check_both(case, lazy, form, tol=2e-2 if q_std > 1 else 1e-2, wg1of=True)


@needs_sm90
@pytest.mark.parametrize("num_sms,s_q,H", [(1, 1, 64), (5, 1, 128)])
def test_tmap_wg1of_few_columns_walk_many_items(num_sms, s_q, H):
    """As test_tmap_few_columns_walk_many_items with wg1_other_first: odd and even tile counts across dozens of item
    boundaries, so tile b's parts 2 / 3 are issued in the new order on every buffer phase parity."""
    rng = random.Random()
    lens = [rng.choice([0, 1, 63, 64, 65, 128, 129, 192, 200, 320, 384]) for _ in range(24)]
    case = make_case_lens(lens, s_q, H, torch.bfloat16, 64, seed=rng.randrange(1 << 30))
    for form in ("even", "balanced"):
        _check_both(case, True, form, num_sms, wg1of=True)
