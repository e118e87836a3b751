"""GPU tests of the balanced split-KV mma.sync kernel (mla_decode_sm90(..., balanced=True) with a
make_schedule(..., balanced=True) schedule) against the fp64 reference of test_kernel_gpu.py: NaN-poisoned
outputs, split buffers and unused pages, shuffled page tables, varlen with 0 and < s_q, s_q 1/2/4,
H 16/32/64/5, pages of 64 and 256, batch 1/64/200 (more requests than CTAs), large-magnitude q; equal
to the default kernel; CUDA-graph replay with another length set of the same batch equal to eager."""

from __future__ import annotations

import functools
import random

import pytest
import torch

from graph_replay import fresh_values, graph_replay_equals_eager
from test_kernel_gpu import check, make_case, needs_sm90, run_kernel

pytestmark = pytest.mark.gpu


def _decode_balanced():
    from mla_cute_dsl.kernels import mla_decode_sm90

    return functools.partial(mla_decode_sm90, balanced=True)


def _num_sms():
    return torch.cuda.get_device_properties(0).multi_processor_count


def _case(B, s_q, H, S, kv, varlen, page=64, q_std=1.0, seed=None):
    kv_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[kv]
    case = make_case(B, s_q, H, S, kv_dtype, varlen, q_std=q_std,
                     seed=random.randrange(1 << 30) if seed is None else seed, page=page)
    case["q"] = case["q"].to(kv_dtype)
    return case


def _outs(case):
    B, s_q, H, _ = case["q"].shape
    out = torch.full((B, s_q, H, 512), float("nan"), dtype=case["q"].dtype, device="cuda")
    lse = torch.full((B, s_q, H), float("nan"), dtype=torch.float32, device="cuda")
    return out, lse


def _balanced_schedule(case, max_batch=None):
    from mla_cute_dsl.kernels import alloc_workspace, make_schedule

    B, s_q, H, _ = case["q"].shape
    # form="balanced": these tests are about the balanced plan; the hybrid (form="auto") would run the even
    # plan at uniform lengths (test_split_kv_gpu.py tests the hybrid through the backend)
    sched = make_schedule(case["lens_cpu"], s_q, H, _num_sms(), balanced=True, max_batch=max_batch,
                          form="balanced")
    ws = alloc_workspace(sched)
    for part in ws:  # partial slots the kernel fails to write must not pass as old memory
        part.fill_(float("nan"))
    return sched, ws


def run_balanced(case, out, lse, sched=None, ws=None):
    if sched is None:
        sched, ws = _balanced_schedule(case)
    return run_kernel(case, out, lse, sched, ws, decode=_decode_balanced())


CASES = [  # B, s_q, H, S, kv, varlen, page
    (64, 1, 16, 8192, "bf16", False, 64),
    (1, 1, 16, 4096, "bf16", False, 64),
    (1, 4, 16, 4096, "fp16", False, 256),
    (64, 2, 16, 2048, "bf16", True, 64),
    (200, 1, 16, 1000, "bf16", True, 64),
    (200, 2, 5, 300, "fp16", True, 256),
    (7, 4, 5, 140, "bf16", True, 64),
    (6, 2, 32, 4096, "fp16", True, 64),
    (3, 1, 64, 4096, "bf16", False, 256),
    (5, 4, 64, 1500, "bf16", True, 64),  # 256 rows: 4 m-blocks, 33 columns on 132 SMs
    (64, 4, 5, 20, "bf16", True, 64),
    (2, 2, 16, 1, "bf16", False, 64),
]


@needs_sm90
@pytest.mark.parametrize("B,s_q,H,S,kv,varlen,page", CASES)
def test_balanced_against_fp64_reference(B, s_q, H, S, kv, varlen, page):
    case = _case(B, s_q, H, S, kv, varlen, page)
    out, lse = _outs(case)
    sched, _ = run_balanced(case, out, lse)
    torch.cuda.synchronize()
    assert sched.balanced and sched.num_cols >= 1
    check(case, out, lse)


@needs_sm90
@pytest.mark.parametrize("kv", ["bf16", "fp16"])
@pytest.mark.parametrize("B,s_q,H,S", [(1, 1, 16, 4096), (64, 2, 16, 1024), (6, 4, 5, 140)])
def test_balanced_large_magnitude_q(B, s_q, H, S, kv):
    case = _case(B, s_q, H, S, kv, varlen=True, q_std=100.0)
    out, lse = _outs(case)
    run_balanced(case, out, lse)
    torch.cuda.synchronize()
    check(case, out, lse, tol=2e-2)


@needs_sm90
@pytest.mark.parametrize("B,s_q,H,S,kv,varlen", [
    (64, 1, 16, 8192, "bf16", False), (128, 2, 16, 4096, "bf16", False), (100, 1, 16, 4096, "bf16", True),
    (200, 1, 16, 2000, "fp16", True), (4, 2, 64, 4096, "bf16", True),
])
def test_balanced_equals_default_kernel(B, s_q, H, S, kv, varlen):
    case = _case(B, s_q, H, S, kv, varlen)
    o_def, l_def = _outs(case)
    run_kernel(case, o_def, l_def)
    o_bal, l_bal = _outs(case)
    run_balanced(case, o_bal, l_bal)
    torch.cuda.synchronize()
    a, b = o_def.to(torch.float64), o_bal.to(torch.float64)
    assert (a - b).norm() / a.norm().clamp_min(1e-30) < 5e-3
    fin = torch.isfinite(l_def)
    assert torch.equal(fin, torch.isfinite(l_bal))
    assert torch.allclose(l_def[fin], l_bal[fin], rtol=1e-4, atol=1e-4)


@needs_sm90
@pytest.mark.parametrize("B,s_q,H,S,kv", [(64, 1, 16, 2048, "bf16"), (200, 2, 16, 600, "fp16"),
                                          (3, 4, 64, 3000, "bf16")])
def test_balanced_graph_replay_with_new_lengths_equals_eager(B, s_q, H, S, kv):
    """Capture with one length set, re-plan another of the same batch into the same buffers (in place), replay:
    the fixed grid (m-blocks, columns) runs the new items; equal to an eager call and to the reference."""
    from mla_cute_dsl.kernels import make_schedule

    case = _case(B, s_q, H, S, kv, varlen=True)
    out, lse = _outs(case)
    sched, ws = run_balanced(case, out, lse)  # warm up (compile) outside capture
    rng = random.Random(B * 7 + S)
    old = case["lens_cpu"].tolist()
    # a new length set (each at most the old one: the rows it reads are not NaN-poisoned)
    new = [rng.choice([0, n, rng.randint(0, n), min(n, 1)]) for n in old]
    new[0] = old[0]
    items_before = sched.num_items

    def replan():
        case["lens_cpu"] = torch.tensor(new, dtype=torch.int32)
        case["lens"].copy_(case["lens_cpu"])
        make_schedule(case["lens_cpu"], s_q, H, _num_sms(), out=sched, balanced=True, form="balanced")
        assert sched.num_items != items_before or new != old
        fresh_values(case["q"])

    graph_replay_equals_eager(lambda: run_balanced(case, out, lse, sched, ws), out, lse, refresh=replan,
                              check=lambda o, l: check(case, o, l), scratch=ws)


@needs_sm90
def test_balanced_requires_a_balanced_schedule_on_gpu():
    from mla_cute_dsl.kernels import alloc_workspace, make_schedule, mla_decode_sm90

    case = _case(2, 1, 16, 128, "bf16", varlen=False)
    out, lse = _outs(case)
    sched = make_schedule(case["lens_cpu"], 1, 16, _num_sms())
    ws = alloc_workspace(sched)
    with pytest.raises(ValueError, match="balanced=True"):
        mla_decode_sm90(case["q"], case["kv"], case["page_table"], case["lens"], case["sm_scale"], 1.0, out, lse,
                        sched, ws, balanced=True)
    # the default kernel runs a balanced schedule too (one CTA per work row, the same items)
    bsched, bws = _balanced_schedule(case)
    run_kernel(case, out, lse, bsched, bws)
    torch.cuda.synchronize()
    check(case, out, lse)
