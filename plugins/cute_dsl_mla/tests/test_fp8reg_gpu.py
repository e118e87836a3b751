"""GPU tests of the fp8 H=16 variant (sm90_decode_fp8.mla_decode_sm90_fp8) + the
combine kernel against the fp64 reference of test_kernel_gpu.py.

Same inputs as the verified kernel's tests (shuffled pages, NaN in unused pages
and page tails, NaN-poisoned outputs, lengths incl. 0 and < s_q, large-magnitude
q), fp8-e4m3 KV only, s_q * H <= 32 (BLOCK_M 16 / 32), page sizes 64 and 128,
schedules for 1 and 2 CTAs per SM, agreement with the verified kernel, graph
replay equal to eager.  Skips cleanly without an SM90 GPU.

    PYTHONPATH=plugins/cute_dsl_mla:. timeout 420 python -m pytest -x -q -p no:cacheprovider -rfs \\
        plugins/cute_dsl_mla/tests/test_fp8reg_gpu.py
"""

from __future__ import annotations

import random

import pytest
import torch

from graph_replay import fresh_values, graph_replay_equals_eager
from test_kernel_gpu import check, make_case, run_kernel  # same directory (pytest rootdir import)

pytestmark = pytest.mark.gpu

FP8 = torch.float8_e4m3fn


def _is_sm90():
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


needs_sm90 = pytest.mark.skipif(not _is_sm90(), reason="needs an SM90 GPU")


def run_fp8(case, out, lse, sched=None, ws=None, ctas_per_sm=2, s_accs=1):
    from mla_cute_dsl.kernels import alloc_workspace, make_schedule
    from mla_cute_dsl.kernels.sm90_decode_fp8 import mla_decode_sm90_fp8

    q = case["q"]
    B, s_q, H, _ = q.shape
    if sched is None:
        n_sm = torch.cuda.get_device_properties(0).multi_processor_count
        sched = make_schedule(case["lens_cpu"], s_q, H, n_sm, ctas_per_sm=ctas_per_sm)
        ws = alloc_workspace(sched)
        ws[0].fill_(float("nan"))  # a partial row the kernel fails to write must not pass as old memory
        ws[1].fill_(float("nan"))
    mla_decode_sm90_fp8(q, case["kv"], case["page_table"], case["lens"], case["sm_scale"],
                        case["kv_scale"], out, lse, sched, ws, s_accs=s_accs)
    return sched, ws


def _bufs(B, s_q, H, dtype=torch.bfloat16):
    out = torch.full((B, s_q, H, 512), float("nan"), dtype=dtype, device="cuda")
    lse = torch.full((B, s_q, H), float("nan"), dtype=torch.float32, device="cuda")
    return out, lse


# (B, s_q, S, H, varlen, page): BLOCK_M 16 (R <= 16) and 32 (16 < R <= 32),
# one item (writes out directly) and many splits (partials + combine), partial
# m-blocks (R = 3, 12, 21, 24: the last two leave BLOCK_M 32's second M-atom half empty),
# lengths 0 / 1 / < s_q, tail tiles, page 128
CASES = [
    (1, 1, 64, 16, False, 64),      # one tile, one item
    (1, 1, 4096, 16, False, 64),    # B=1: many splits
    (1, 2, 4096, 16, False, 64),    # R = 32, BLOCK_M 32
    (64, 1, 1024, 16, True, 64),    # the H=16 s_q=1 shape, shorter
    (16, 2, 1000, 16, True, 64),    # the H=16 s_q=2 shape, varlen, tail tiles
    (6, 1, 20, 1, True, 64),        # H = 1: 15 zero rows in the m-block
    (6, 4, 140, 3, True, 64),       # R = 12, s_q = 4 causal rows
    (3, 2, 333, 3, True, 128),      # page 128: in-page block offset
    (4, 1, 4096, 32, False, 128),   # R = 32 from H = 32, page 128
    (5, 4, 257, 8, True, 64),       # R = 32 from s_q 4 x H 8
    (2, 1, 1, 16, False, 64),       # length 1 everywhere
    (8, 2, 777, 16, True, 128),     # page 128, varlen, odd lengths
    (4, 2, 300, 12, True, 64),      # R = 24, BLOCK_M 32 with a partial second atom
    (3, 3, 150, 7, True, 128),      # R = 21, page 128
]


@needs_sm90
@pytest.mark.parametrize("s_accs", [1, 4])  # 4 independent S accumulators: the backend's default at 16 rows
@pytest.mark.parametrize("B,s_q,S,H,varlen,page", CASES)
def test_fp8reg_against_fp64_reference(B, s_q, S, H, varlen, page, s_accs):
    case = make_case(B, s_q, H, S, FP8, varlen, seed=random.randrange(1 << 30), page=page)
    out, lse = _bufs(B, s_q, H)
    run_fp8(case, out, lse, s_accs=s_accs)
    torch.cuda.synchronize()
    check(case, out, lse)


@needs_sm90
@pytest.mark.parametrize("ctas_per_sm", [1, 2])
def test_fp8reg_schedule_ctas_per_sm(ctas_per_sm):
    case = make_case(12, 2, 16, 2000, FP8, True, seed=random.randrange(1 << 30))
    out, lse = _bufs(12, 2, 16)
    run_fp8(case, out, lse, ctas_per_sm=ctas_per_sm)
    torch.cuda.synchronize()
    check(case, out, lse)


@needs_sm90
def test_fp8reg_fp16_q():
    case = make_case(6, 2, 16, 1000, FP8, True, seed=random.randrange(1 << 30))
    case["q"] = case["q"].to(torch.float16)
    out, lse = _bufs(6, 2, 16, torch.float16)
    run_fp8(case, out, lse)
    torch.cuda.synchronize()
    check(case, out, lse)


@needs_sm90
@pytest.mark.parametrize("s_accs", [1, 4])
@pytest.mark.parametrize("B,s_q,H,S", [(1, 1, 16, 4096), (2, 2, 16, 1000), (6, 4, 3, 140)])
def test_fp8reg_large_magnitude_q(B, s_q, H, S, s_accs):
    case = make_case(B, s_q, H, S, FP8, varlen=False, q_std=100.0, seed=random.randrange(1 << 30))
    out, lse = _bufs(B, s_q, H)
    run_fp8(case, out, lse, s_accs=s_accs)
    torch.cuda.synchronize()
    check(case, out, lse, tol=2e-2)


@needs_sm90
@pytest.mark.parametrize("s_q", [1, 2])
def test_fp8reg_matches_verified_kernel(s_q):
    """Same inputs through both partial kernels: close (not bit-equal: different
    reduction order over the 576 dims), which separates a variant bug from a
    reference bug."""
    case = make_case(8, s_q, 16, 3000, FP8, varlen=True, seed=random.randrange(1 << 30))
    o1, l1 = _bufs(8, s_q, 16)
    o2, l2 = _bufs(8, s_q, 16)
    run_kernel(case, o1, l1)
    run_fp8(case, o2, l2)
    torch.cuda.synchronize()
    d = (o1.float() - o2.float()).norm() / o1.float().norm().clamp_min(1e-30)
    assert d < 1e-2, f"rel diff vs the verified kernel {d:.3e}"
    fin = torch.isfinite(l1)
    assert torch.equal(fin, torch.isfinite(l2))
    assert (l1[fin] - l2[fin]).abs().max() < 1e-2


@needs_sm90
def test_fp8reg_graph_replay_equals_eager():
    B, s_q, H, S = 6, 2, 16, 1000
    case = make_case(B, s_q, H, S, FP8, varlen=True, seed=random.randrange(1 << 30))
    out, lse = _bufs(B, s_q, H)
    sched, ws = run_fp8(case, out, lse)  # warm up (compile) outside capture
    graph_replay_equals_eager(lambda: run_fp8(case, out, lse, sched, ws), out, lse,
                              refresh=lambda: fresh_values(case["q"]), check=lambda o, l: check(case, o, l),
                              scratch=ws)

