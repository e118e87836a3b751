"""GPU tests of the seesaw kernels' ``lazy_rescale`` option (MLADecodePartialWGMMASeesaw(lazy_rescale=True)): a row
keeps its reference max until a tile's max exceeds it by more than 2^8 in exp2 units, so O and the row sum are
rescaled only then. Against the fp64 reference of test_kernel_gpu.py, and against the same kernel without the option.

What must hold: the result equals the reference within the kernels' usual bounds whether or not rows rescale. The
rescale branch runs only where a tile raises a row's max by that much, which random inputs of unit scale do almost
only at a row's first tile; so the cases here also scale the cache up along the sequence (``ramp``: tile t's rows
times 1 + t, scores jump at every tile) and use large-magnitude q (stddev 100), and mix rows that rescale with rows
that do not in one warp. Fresh random inputs per case, shuffled pages, NaN page tails and unused pages, NaN-poisoned
outputs and partial slots, lengths 0 and < s_q, s_q 1/2/4, H 64/126/128, bf16 and fp16 caches through the balanced
TMA seesaw (the backend's 16-bit kernel at 64+ rows), fp8 caches through the even seesaw, a CUDA graph replay equal
to the eager call. Skipped without an sm_90 GPU.

    PYTHONPATH=plugins/cute_dsl_mla:plugins/cute_dsl_mla/tests:. timeout 300 python -m pytest -q -p no:cacheprovider \\
        plugins/cute_dsl_mla/tests/test_seesaw_lazy_gpu.py
"""

from __future__ import annotations

import functools
import random

import pytest
import torch

from graph_replay import graph_replay_equals_eager
from test_kernel_gpu import check, make_case
from test_wgmma_t_balanced_gpu import _lengths, _num_sms, _outs, make_case_lens, needs_sm90

pytestmark = pytest.mark.gpu

DT = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _ramp(case, page):
    """Scale every cache row by 1 + (its token index) // 64 (finite rows only: NaN tails stay NaN), so each tile's
    scores outgrow the previous tiles' max by far more than the lazy threshold: the rescale branch runs per tile."""
    kv, table, lens = case["kv"], case["page_table"].cpu(), case["lens_cpu"]
    for b in range(len(lens)):
        for t0 in range(0, int(lens[b]), 64):
            pg, off = int(table[b, t0 // page]), t0 % page
            rows = kv[pg, off:off + min(64, int(lens[b]) - t0)]
            rows.mul_(1 + t0 // 64)


def _balanced(case, lazy, form="auto"):
    from mla_cute_dsl.kernels import alloc_workspace, make_schedule
    from mla_cute_dsl.kernels.sm90_wgmma_decode import mla_decode_sm90_wgmma_seesaw_balanced

    B, s_q, H, _ = case["q"].shape
    sched = make_schedule(case["lens_cpu"], s_q, H, _num_sms(), balanced=True, form=form, ctas_per_sm=1)
    ws = alloc_workspace(sched)
    for part in ws:
        part.fill_(float("nan"))
    out, lse = _outs(case)

    def call():
        mla_decode_sm90_wgmma_seesaw_balanced(case["q"], case["kv"], case["page_table"], case["lens"],
                                              case["sm_scale"], case["kv_scale"], out, lse, sched, ws, tma=True,
                                              lazy_rescale=lazy)
    return call, out, lse, ws


CASES = [  # B, s_q, H, lengths, S, page, dtype, form, ramp, q_std
    (1, 1, 64, "uniform", 64, 64, "bf16", "balanced", False, 1.0),     # one 1-tile item
    (16, 1, 128, "uniform", 4096, 64, "bf16", "auto", False, 1.0),     # the steady state: rows keep their max
    (16, 1, 128, "uniform", 2048, 64, "bf16", "auto", True, 1.0),      # every tile rescales
    (40, 2, 128, "varlen", 3000, 64, "bf16", "auto", True, 1.0),       # lengths 0 and < s_q, balanced plan
    (9, 2, 126, "skewed", 1500, 256, "fp16", "balanced", False, 1.0),  # a partial m-block, page 256, fp16
    (20, 4, 64, "tiny", 8, 64, "bf16", "balanced", False, 1.0),        # lengths 0..s_q
    (12, 2, 128, "skewed", 4096, 64, "bf16", "balanced", False, 100.0),  # large-magnitude q
    (130, 1, 128, "varlen", 700, 64, "bf16", "even", True, 1.0),       # two items per column
]


@needs_sm90
@pytest.mark.parametrize("B,s_q,H,kind,S,page,dtype,form,ramp,q_std", CASES)
def test_lazy_balanced_seesaw_against_fp64_reference(B, s_q, H, kind, S, page, dtype, form, ramp, q_std):
    rng = random.Random()
    case = make_case_lens(_lengths(kind, B, S, s_q, rng), s_q, H, DT[dtype], page, seed=rng.randrange(1 << 30),
                          q_std=q_std)
    if ramp:
        _ramp(case, page)
    tol = 2e-2 if q_std > 1 else 1e-2
    call, out, lse, _ = _balanced(case, True, form)
    call()
    torch.cuda.synchronize()
    check(case, out, lse, tol=tol)
    # the same inputs without the option: close (the two round P against different maxima)
    call0, out0, lse0, _ = _balanced(case, False, form)
    call0()
    torch.cuda.synchronize()
    d = (out.double() - out0.double()).norm() / out0.double().norm().clamp_min(1e-30)
    assert d < tol, f"lazy against eager rescale: rel diff {d:.3e}"
    fin = torch.isfinite(lse0)
    assert torch.equal(fin, torch.isfinite(lse)) and (lse[fin] - lse0[fin]).abs().max() < 1e-2


@needs_sm90
def test_lazy_balanced_seesaw_graph_replay_equals_eager():
    rng = random.Random()
    case = make_case_lens(_lengths("varlen", 24, 2500, 2, rng), 2, 128, torch.bfloat16, 64,
                          seed=rng.randrange(1 << 30))
    _ramp(case, 64)
    call, out, lse, ws = _balanced(case, True)
    call()

    def refresh():
        case["q"].copy_(torch.randn_like(case["q"], dtype=torch.float32).to(case["q"].dtype))

    graph_replay_equals_eager(call, out, lse, refresh=refresh, check=lambda o, l: check(case, o, l), scratch=ws)


FP8_CASES = [  # B, s_q, H, S, varlen, ramp, q_std
    (3, 1, 128, 4096, False, False, 1.0),
    (6, 2, 64, 1000, True, True, 1.0),
    (5, 1, 128, 2000, True, True, 1.0),
    (4, 2, 128, 3000, True, False, 100.0),
]


@needs_sm90
@pytest.mark.parametrize("B,s_q,H,S,varlen,ramp,q_std", FP8_CASES)
def test_lazy_fp8_seesaw_against_fp64_reference(B, s_q, H, S, varlen, ramp, q_std):
    """The fp8 seesaw (even plan, its own kernel) shares softmax_publish / pv_remote with the 16-bit one."""
    from mla_cute_dsl.kernels import alloc_workspace, make_schedule
    from mla_cute_dsl.kernels.sm90_wgmma_decode import mla_decode_sm90_wgmma_seesaw

    case = make_case(B, s_q, H, S, torch.float8_e4m3fn, varlen, q_std=q_std, seed=random.randrange(1 << 30))
    if ramp:  # the fp8 cache holds |x| <= 400: scale by a factor that keeps it in range, then back to fp8
        kv = case["kv"].float()
        _ramp(dict(case, kv=kv), 64)
        case["kv"] = kv.clamp(-448, 448).to(torch.float8_e4m3fn)
    tol = 2e-2 if q_std > 1 else 1e-2
    outs = []
    for lazy in (True, False):
        sched = make_schedule(case["lens_cpu"], s_q, H, _num_sms())
        ws = alloc_workspace(sched)
        for part in ws:
            part.fill_(float("nan"))
        out = torch.full((B, s_q, H, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
        lse = torch.full((B, s_q, H), float("nan"), dtype=torch.float32, device="cuda")
        functools.partial(mla_decode_sm90_wgmma_seesaw, lazy_rescale=lazy)(
            case["q"], case["kv"], case["page_table"], case["lens"], case["sm_scale"], case["kv_scale"], out, lse,
            sched, ws)
        torch.cuda.synchronize()
        check(case, out, lse, tol=tol)
        outs.append(out)
    d = (outs[0].double() - outs[1].double()).norm() / outs[1].double().norm().clamp_min(1e-30)
    assert d < tol, f"lazy against eager rescale: rel diff {d:.3e}"
