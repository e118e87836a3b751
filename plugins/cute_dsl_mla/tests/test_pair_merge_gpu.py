"""GPU tests of the experimental cluster pair merge (kernels/pair_merge.py; written compile-only, not yet run):
make_schedule(..., balanced=True, form="pair") on MLADecodePartial(balanced=True, pair=True) launched with
(1, 2, 1) clusters, each request's two halves merged through DSMEM. Against the fp64 reference with NaN-poisoned
outputs and partial buffers (lengths 0, 1, odd, long; rows masked in one half; B up to num_cols / 2; 16 and 32
rows; bf16/fp16; fp32 and 16-bit partials, wide stores on/off; empty requests written by the pair kernel itself,
no combine kernel); eager runs twice and CUDA-graph replays bitwise equal; launch_pair(combine=True) under a graph
replaying other forms; equal to the balanced step with the combine kernel within rounding."""

from __future__ import annotations

import functools

import pytest
import torch

from test_balanced_gpu import _case, _num_sms, _outs
from test_kernel_gpu import check, needs_sm90, run_kernel

pytestmark = pytest.mark.gpu


def _pair_schedule(case, partial_dtype, form="pair"):
    from mla_cute_dsl.kernels import alloc_workspace, make_schedule

    B, s_q, H, _ = case["q"].shape
    sched = make_schedule(case["lens_cpu"], s_q, H, _num_sms(), balanced=True, form=form)
    sched.wide_store = partial_dtype != torch.float32  # the backend default: wide stores with 16-bit partials
    ws = alloc_workspace(sched, partial_dtype=partial_dtype)
    for part in ws:  # the pair form writes no partial slot; poisoned anyway
        part.fill_(float("nan"))
    return sched, ws


def _run(case, out, lse, sched, ws):
    from mla_cute_dsl.kernels import mla_decode_sm90

    return run_kernel(case, out, lse, sched, ws, decode=functools.partial(mla_decode_sm90, balanced=True))


def _max_batch():
    from mla_cute_dsl.kernels.schedule import balanced_cols

    return balanced_cols(16, _num_sms()) // 2


CASES = [  # B (None: num_cols / 2), s_q, H, S, kv, varlen
    (64, 1, 16, 8192, "bf16", False),  # the target shape
    (None, 1, 16, 4096, "bf16", False),  # every cluster of the grid busy
    (64, 2, 16, 2048, "fp16", True),  # 32 rows, lengths 0, 1, s_q - 1, S and random
    (16, 1, 16, 16384, "bf16", False),  # long halves
    (7, 2, 5, 140, "bf16", True),  # 10 rows (past-R rows of the m-block), odd lengths
    (3, 1, 1, 4096, "fp16", False),
    (2, 2, 16, 1, "bf16", False),  # one block: direct items only, no cluster barrier
    (5, 2, 16, 65, "bf16", False),  # upper half = 1 token: query 0's row fully masked there (l_hi = 0)
]


@needs_sm90
@pytest.mark.parametrize("partial_dtype", ["q", torch.float32])
@pytest.mark.parametrize("B,s_q,H,S,kv,varlen", CASES)
def test_pair_against_fp64_reference(B, s_q, H, S, kv, varlen, partial_dtype):
    B = B or _max_batch()
    case = _case(B, s_q, H, S, kv, varlen)
    pdt = case["q"].dtype if partial_dtype == "q" else partial_dtype
    out, lse = _outs(case)
    sched, ws = _pair_schedule(case, pdt)
    assert sched.form == "pair"
    _run(case, out, lse, sched, ws)
    torch.cuda.synchronize()
    check(case, out, lse)


@needs_sm90
def test_pair_odd_lengths_and_empty_rows():
    """Explicit lengths: 0 (combine writes 0 / -inf), 1, 63, 64, 65, 127, 129 and long odd ones, s_q = 2 (the first
    query of a 1-token request sees nothing: out 0, lse -inf, never NaN)."""
    lens = [0, 1, 63, 64, 65, 127, 129, 4097, 8191, 2, 0, 3333]
    case = _case(len(lens), 2, 16, max(lens), "bf16", False)
    case["lens_cpu"] = torch.tensor(lens)
    case["lens"] = case["lens_cpu"].to(device="cuda", dtype=torch.int32)
    out, lse = _outs(case)
    sched, ws = _pair_schedule(case, torch.bfloat16)
    _run(case, out, lse, sched, ws)
    torch.cuda.synchronize()
    check(case, out, lse)


@needs_sm90
@pytest.mark.parametrize("B,s_q,H,S,kv,varlen", [(64, 1, 16, 8192, "bf16", True), (16, 2, 16, 4096, "fp16", True)])
def test_pair_eager_and_graph_replays_are_equal(B, s_q, H, S, kv, varlen):
    case = _case(B, s_q, H, S, kv, varlen=varlen)
    sched, ws = _pair_schedule(case, case["q"].dtype)
    ref = None
    for _ in range(2):
        out, lse = _outs(case)
        _run(case, out, lse, sched, ws)
        torch.cuda.synchronize()
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
        assert torch.equal(out, ref[0]) and torch.equal(lse, ref[1])


@needs_sm90
def test_pair_with_the_combine_kernel_replays_other_forms_in_the_same_buffers():
    """api.launch_pair(combine=True): a graph captured on a pair step replays later steps re-planned in place to any
    form (same buffers): their split items write partial slots the combine kernel then merges, pair items merge in
    the cluster and the combine skips them."""
    from mla_cute_dsl.kernels import api, make_schedule

    case = _case(32, 1, 16, 4096, "bf16", varlen=True)
    sched, ws = _pair_schedule(case, torch.bfloat16)
    out, lse = _outs(case)
    partial = api.get_partial_kernel("bf16", "bf16", sched.block_m, balanced=True, partial="bf16",
                                     wide_store=sched.wide_store, pair=True)

    def step():
        api.launch_pair(partial, case["q"], case["kv"], case["page_table"], case["lens"], case["sm_scale"],
                        case["kv_scale"], out, lse, sched, ws, combine=True)

    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
        with torch.cuda.graph(g):
            step()
    torch.cuda.current_stream().wait_stream(s)
    for form in ("pair", "balanced", "even", "pair"):
        make_schedule(case["lens_cpu"], 1, 16, _num_sms(), balanced=True, form=form, out=sched)
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        check(case, out, lse)


@needs_sm90
@pytest.mark.parametrize("B,s_q,H,S,kv", [(64, 1, 16, 8192, "bf16"), (32, 2, 16, 2048, "bf16"),
                                          (4, 1, 16, 4096, "fp16")])
def test_pair_equals_the_combine_kernel(B, s_q, H, S, kv):
    case = _case(B, s_q, H, S, kv, varlen=True)
    o_c, l_c = _outs(case)
    sched, ws = _pair_schedule(case, torch.float32, form="balanced")
    _run(case, o_c, l_c, sched, ws)
    o_p, l_p = _outs(case)
    sched, ws = _pair_schedule(case, torch.float32)
    _run(case, o_p, l_p, sched, ws)
    torch.cuda.synchronize()
    a, b = o_c.to(torch.float64), o_p.to(torch.float64)
    assert (a - b).norm() / a.norm().clamp_min(1e-30) < 2e-3
    fin = torch.isfinite(l_c)
    assert torch.equal(fin, torch.isfinite(l_p))
    assert torch.allclose(l_c[fin], l_p[fin], rtol=1e-5, atol=1e-5)

