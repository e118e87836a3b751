"""GPU tests of the seesaw's ``wg1_other_first`` option (``MLADecodePartialWGMMASeesaw(wg1_other_first=True)``, branch
qk-order, written compile-only): warpgroup 1's QK of its own tile waits on warpgroup 0's part of the tile (mbar + 2)
first and issues its k-blocks (0..15, 32..35) first, then waits on its own part (mbar + 3) and issues 16..31. The same
tiles, waits and parities otherwise; S of WG1's tiles is summed in another k-order, so the result is not bit for bit
the option-off kernel's: each case runs the option on and off on the same fresh inputs and schedule, both against
the fp64 reference of test_kernel_gpu.py, and the two close to each other.

* The smallest cases first (one 1-tile item balanced, one 1-tile request even): a wrong mbarrier parity shows as a
  hang there: run this file under `timeout`.
* Kernels: the balanced TMA lazy seesaw with and without q_prefetch (fp32 partials, narrow stores: wgmma_speed.py's
  balanced_tma_lazy[_qpf]_wg1of ways; and the backend's arm, 16-bit partials with wide stores), the even cp.async
  seesaw (fp32 partials): the kernels benchmarks/device/prebuild_kernels.py builds with ONLY=wg1of (and the option-off
  ones it builds anyway).
* Fresh random inputs per case, shuffled page tables, NaN in unused pages and page tails, NaN-poisoned outputs and
  partial buffers; lengths with 0 and < s_q, tiny (0..s_q), short (1-tile items), skewed, log-skewed; s_q 1 / 2 / 3,
  H 16 (s_q = 3: 48 rows), 64, 126, 128; pages 64 and 256; 2 / 5-SM balanced schedules whose columns walk many items;
  q with std 100.
Skipped without an sm_90 GPU. 19 cases.

    PYTHONPATH=plugins/cute_dsl_mla:plugins/cute_dsl_mla/tests:. timeout 300 python -m pytest -q -p no:cacheprovider \\
        -rfs plugins/cute_dsl_mla/tests/test_seesaw_wg1of_gpu.py
"""

from __future__ import annotations

import random

import pytest
import torch

from test_kernel_gpu import check
from test_wgmma_t_balanced_gpu import _lengths, _num_sms, _outs, make_case_lens, needs_sm90

pytestmark = pytest.mark.gpu

# arm -> (balanced, tma, lazy_rescale, q_prefetch, 16-bit partials with wide stores)
ARMS = {
    "bal_tma_lazy_qpf": (True, True, True, True, False),
    "bal_tma_lazy": (True, True, True, False, False),
    "bal_tma_lazy_qpf_wide": (True, True, True, True, True),  # the backend's arm at H=128 s_q=1
    "bal_tma_lazy_wide": (True, True, True, False, True),  # ... s_q=2
    "even_cp": (False, False, False, False, False),
}


def _run(case, arm, wg1of, form="auto", num_sms=None):
    """One call of the arm's kernel (option on or off) on a fresh schedule and NaN-poisoned buffers."""
    from mla_cute_dsl.kernels import alloc_workspace, make_schedule
    from mla_cute_dsl.kernels.sm90_wgmma_decode import (mla_decode_sm90_wgmma_seesaw,
                                                        mla_decode_sm90_wgmma_seesaw_balanced)

    balanced, tma, lazy, qpf, wide = ARMS[arm]
    B, s_q, H, _ = case["q"].shape
    if balanced:
        sched = make_schedule(case["lens_cpu"], s_q, H, num_sms or _num_sms(), balanced=True, form=form,
                              ctas_per_sm=1)
    else:
        sched = make_schedule(case["lens_cpu"], s_q, H, num_sms or _num_sms())
    sched.wide_store = wide
    ws = alloc_workspace(sched, partial_dtype=case["q"].dtype if wide else torch.float32)
    for part in ws:  # a partial slot the kernel fails to write must not pass as old memory
        part.fill_(float("nan"))
    out, lse = _outs(case)
    args = (case["q"], case["kv"], case["page_table"], case["lens"], case["sm_scale"], case["kv_scale"], out, lse,
            sched, ws)
    if balanced:
        mla_decode_sm90_wgmma_seesaw_balanced(*args, tma=tma, lazy_rescale=lazy, q_prefetch=qpf,
                                              wg1_other_first=wg1of)
    else:
        mla_decode_sm90_wgmma_seesaw(*args, tma=tma, lazy_rescale=lazy, wg1_other_first=wg1of)
    torch.cuda.synchronize()
    return out, lse, sched


def _check_on_and_off(case, arm, form="auto", num_sms=None, tol=1e-2):
    """Option on, then off, on the same inputs and schedule: both against the reference, and close to each other."""
    out, lse, sched = _run(case, arm, True, form, num_sms)
    check(case, out, lse, tol=tol)
    out0, lse0, _ = _run(case, arm, False, form, num_sms)
    check(case, out0, lse0, tol=tol)
    o, o0 = out.double(), out0.double()
    assert (o - o0).norm() <= tol * o0.norm().clamp_min(1e-30), "wg1_other_first moved the result"
    assert torch.equal(torch.isinf(lse), torch.isinf(lse0))
    fin = torch.isfinite(lse0)
    assert ((lse - lse0)[fin].abs() <= 2e-3 * lse0[fin].abs() + 2e-2).all()
    return sched


SMALL = [  # label, arm, lengths, s_q, H, SMs, form
    ("balanced one 1-tile item", "bal_tma_lazy_qpf", [64], 1, 64, None, "balanced"),
    ("even one 1-tile request", "even_cp", [64], 1, 64, 1, "auto"),
]


@needs_sm90
@pytest.mark.parametrize("label,arm,lens,s_q,H,sms,form", SMALL, ids=[c[0] for c in SMALL])
def test_wg1of_smallest_cases_first(label, arm, lens, s_q, H, sms, form):
    case = make_case_lens(lens, s_q, H, torch.bfloat16, 64, seed=random.randrange(1 << 30))
    _check_on_and_off(case, arm, form, sms)


CASES = [  # arm, B, s_q, H, lengths, S, page, form, q std
    ("bal_tma_lazy_qpf", 6, 1, 64, "varlen", 1000, 64, "balanced", 1.0),     # 0, 1, s_q - 1, S mixed in
    ("bal_tma_lazy_qpf", 7, 1, 128, "varlen", 2000, 256, "balanced", 1.0),   # page 256
    ("bal_tma_lazy", 9, 2, 128, "logskew", 4096, 64, "even", 1.0),
    ("bal_tma_lazy", 20, 2, 64, "tiny", 8, 64, "balanced", 1.0),             # lengths 0..s_q (causal rows empty)
    ("bal_tma_lazy_qpf", 100, 2, 64, "short", 64, 64, "auto", 1.0),          # every item one tile
    ("bal_tma_lazy_qpf", 16, 1, 126, "varlen", 1500, 64, "balanced", 1.0),   # 126 rows: a partial second m-block
    ("bal_tma_lazy", 16, 2, 126, "skewed", 1500, 64, "balanced", 1.0),
    ("bal_tma_lazy_qpf", 8, 3, 16, "varlen", 2000, 64, "balanced", 1.0),     # 48 rows
    ("bal_tma_lazy", 8, 3, 16, "skewed", 1000, 64, "auto", 1.0),
    ("bal_tma_lazy_qpf", 12, 2, 128, "skewed", 4096, 64, "balanced", 100.0),  # large-magnitude q
    ("even_cp", 12, 1, 128, "varlen", 3000, 64, "auto", 1.0),
    ("even_cp", 9, 2, 64, "varlen", 2000, 256, "auto", 1.0),
    ("even_cp", 8, 2, 128, "skewed", 2000, 64, "auto", 100.0),
    ("bal_tma_lazy_qpf_wide", 40, 1, 128, "skewed", 1500, 64, "auto", 1.0),  # the backend's arms
    ("bal_tma_lazy_wide", 24, 2, 128, "varlen", 2048, 64, "auto", 1.0),
]


@needs_sm90
@pytest.mark.parametrize("arm,B,s_q,H,kind,S,page,form,q_std", CASES)
def test_wg1of_against_fp64_reference_on_and_off(arm, B, s_q, H, kind, S, page, form, q_std):
    rng = random.Random()
    case = make_case_lens(_lengths(kind, B, S, s_q, rng), s_q, H, torch.bfloat16, page, seed=rng.randrange(1 << 30),
                          q_std=q_std)
    _check_on_and_off(case, arm, form, tol=2e-2 if q_std > 1 else 1e-2)


@needs_sm90
@pytest.mark.parametrize("arm,num_sms,s_q,H", [("bal_tma_lazy_qpf", 2, 1, 64), ("bal_tma_lazy", 5, 2, 128)])
def test_wg1of_few_columns_walk_many_items(arm, num_sms, s_q, H):
    """2- or 5-SM balanced schedules: each column walks many items of 0-6 tiles (odd counts, 1-tile items), so the
    mbarrier phases continue across dozens of item boundaries with WG1's new wait order."""
    rng = random.Random()
    lens = [rng.choice([0, 1, 63, 64, 65, 128, 129, 192, 200, 320, 384]) for _ in range(24)]
    case = make_case_lens(lens, s_q, H, torch.bfloat16, 64, seed=rng.randrange(1 << 30))
    sched = _check_on_and_off(case, arm, "even" if num_sms == 2 else "balanced", num_sms)
    ranges = sched.cta_ranges.tolist()
    assert max(ranges[c + 1] - ranges[c] for c in range(sched.num_cols)) > 3
