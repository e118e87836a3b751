"""GPU tests of combine=fused (kernels/fused_merge.py): the balanced mma.sync kernel merges each split request in
the last CTA to finish one of its items, with no combine kernel. Against the fp64 reference (NaN-poisoned
outputs and partial slots, varlen with zero lengths, many splits per request, 16/32 rows, bf16/fp16, fp32 and
16-bit partials); the same step run eagerly twice and through CUDA-graph replay three times gives bitwise equal
outputs (the merge sums the splits in slot order whichever CTA is last) and leaves every arrival counter at
zero; equal to the unfused step (combine kernel) within rounding."""

from __future__ import annotations

import functools

import pytest
import torch

from test_balanced_gpu import _case, _num_sms, _outs
from test_kernel_gpu import check, needs_sm90, run_kernel

pytestmark = pytest.mark.gpu


def _fused_schedule(case, partial_dtype, form="balanced", combine="fused", balanced=True):
    from mla_cute_dsl.kernels import alloc_workspace, make_schedule

    B, s_q, H, _ = case["q"].shape
    sched = make_schedule(case["lens_cpu"], s_q, H, _num_sms(), balanced=balanced, form=form if balanced else "auto",
                          combine=combine)
    sched.wide_store = partial_dtype != torch.float32  # the backend default: wide stores with 16-bit partials
    ws = alloc_workspace(sched, partial_dtype=partial_dtype)
    for part in ws:  # o_partial, lse_partial (not the counters): unwritten slots must not pass as old memory
        part.fill_(float("nan"))
    return sched, ws


def _run(case, out, lse, sched, ws):
    from mla_cute_dsl.kernels import mla_decode_sm90

    return run_kernel(case, out, lse, sched, ws, decode=functools.partial(mla_decode_sm90, balanced=sched.balanced))


CASES = [  # B, s_q, H, S, kv, varlen
    (64, 1, 16, 8192, "bf16", False),  # the target shape
    (1, 1, 16, 16384, "bf16", False),  # one request split ~130 ways
    (64, 2, 16, 2048, "fp16", True),  # 32 rows, zero lengths
    (200, 1, 16, 1000, "bf16", True),  # more requests than CTAs
    (7, 2, 5, 140, "bf16", True),
    (3, 1, 1, 4096, "fp16", False),
    (2, 2, 16, 1, "bf16", False),  # nothing split
]


@needs_sm90
@pytest.mark.parametrize("partial_dtype", ["q", torch.float32])
@pytest.mark.parametrize("B,s_q,H,S,kv,varlen", CASES)
def test_fused_against_fp64_reference(B, s_q, H, S, kv, varlen, partial_dtype):
    case = _case(B, s_q, H, S, kv, varlen)
    pdt = case["q"].dtype if partial_dtype == "q" else partial_dtype
    out, lse = _outs(case)
    sched, ws = _fused_schedule(case, pdt)
    _run(case, out, lse, sched, ws)
    torch.cuda.synchronize()
    check(case, out, lse)
    assert not ws.arrivals.any()


@needs_sm90
@pytest.mark.parametrize("B,s_q,H,S,kv,varlen", [(64, 1, 16, 8192, "bf16", True), (16, 2, 16, 4096, "fp16", True),
                                                 (1, 1, 16, 16384, "bf16", False)])  # one request: no draw of 0
def test_fused_eager_and_graph_replays_are_equal_and_leave_counters_at_zero(B, s_q, H, S, kv, varlen):
    case = _case(B, s_q, H, S, kv, varlen=varlen)
    sched, ws = _fused_schedule(case, case["q"].dtype)
    assert sched.fused_combine and int(sched.split_info[:, 1].max()) > 1  # some request is split
    ref = None
    for _ in range(2):  # eager, twice
        out, lse = _outs(case)
        _run(case, out, lse, sched, ws)
        torch.cuda.synchronize()
        assert not ws.arrivals.any()
        if ref is None:
            ref = (out.clone(), lse.clone())
            check(case, out, lse)
        assert torch.equal(out, ref[0]) and torch.equal(lse, ref[1])
    out, lse = _outs(case)
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        with torch.cuda.graph(g):
            _run(case, out, lse, sched, ws)
    torch.cuda.current_stream().wait_stream(s)
    for _ in range(3):
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert not ws.arrivals.any()
        assert torch.equal(out, ref[0]) and torch.equal(lse, ref[1])


@needs_sm90
@pytest.mark.parametrize("B,s_q,H,S,kv", [(64, 1, 16, 8192, "bf16"), (32, 2, 16, 2048, "bf16"),
                                          (4, 1, 16, 4096, "fp16")])
def test_fused_equals_the_combine_kernel(B, s_q, H, S, kv):
    case = _case(B, s_q, H, S, kv, varlen=True)
    o_c, l_c = _outs(case)
    sched, ws = _fused_schedule(case, case["q"].dtype, combine="auto")
    _run(case, o_c, l_c, sched, ws)
    o_f, l_f = _outs(case)
    sched, ws = _fused_schedule(case, case["q"].dtype)
    _run(case, o_f, l_f, sched, ws)
    torch.cuda.synchronize()
    a, b = o_c.to(torch.float64), o_f.to(torch.float64)
    assert (a - b).norm() / a.norm().clamp_min(1e-30) < 2e-3
    fin = torch.isfinite(l_c)
    assert torch.equal(fin, torch.isfinite(l_f))
    assert torch.allclose(l_c[fin], l_f[fin], rtol=1e-5, atol=1e-5)


@needs_sm90
@pytest.mark.parametrize("B,s_q,H,S,kv,varlen", [(64, 1, 16, 4096, "bf16", False), (1, 2, 16, 16384, "fp16", False),
                                                 (100, 1, 16, 2000, "bf16", True), (7, 2, 5, 140, "bf16", True)])
def test_fused_even_entry_against_fp64_reference(B, s_q, H, S, kv, varlen):
    """split_kv=even's entry (one CTA per work row, call_fused), 16-bit partials."""
    case = _case(B, s_q, H, S, kv, varlen)
    out, lse = _outs(case)
    sched, ws = _fused_schedule(case, case["q"].dtype, balanced=False)
    _run(case, out, lse, sched, ws)
    torch.cuda.synchronize()
    check(case, out, lse)
    assert not ws.arrivals.any()
