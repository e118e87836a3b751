"""GPU tests of the transposed WGMMA kernel (sm90_wgmma_t_decode.mla_decode_sm90_wgmma_t) + the
combine kernel against the fp64 reference of test_kernel_gpu.py.

Same inputs as the verified kernels' tests (shuffled pages, NaN in unused pages and page tails,
NaN-poisoned outputs and split buffers, lengths incl. 0 and < s_q, large-magnitude q), fp8-e4m3
and q-dtype KV, s_q * H <= 32 (BLOCK_M 16 / 32), pages 64 and 128, agreement with the fp8reg
kernel on the same schedule, graph replay equal to eager.  Skips cleanly without an SM90 GPU.

    PYTHONPATH=plugins/cute_dsl_mla:. timeout 230 python -m pytest -x -q -p no:cacheprovider -rfs \\
        plugins/cute_dsl_mla/tests/test_wgmma_t_gpu.py
"""

from __future__ import annotations

import random

import pytest
import torch

from graph_replay import fresh_values, graph_replay_equals_eager
from test_kernel_gpu import check, make_case  # same directory (pytest rootdir import)

pytestmark = pytest.mark.gpu

FP8 = torch.float8_e4m3fn


def _is_sm90():
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


needs_sm90 = pytest.mark.skipif(not _is_sm90(), reason="needs an SM90 GPU")


def _schedule(case, ctas_per_sm=1):
    from mla_cute_dsl.kernels import alloc_workspace, make_schedule

    B, s_q, H, _ = case["q"].shape
    n_sm = torch.cuda.get_device_properties(0).multi_processor_count
    sched = make_schedule(case["lens_cpu"], s_q, H, n_sm, ctas_per_sm=ctas_per_sm)
    ws = alloc_workspace(sched)
    ws[0].fill_(float("nan"))  # a partial row the kernel fails to write must not pass as old memory
    ws[1].fill_(float("nan"))
    return sched, ws


def run_t(case, out, lse, sched=None, ws=None, ctas_per_sm=1):
    from mla_cute_dsl.kernels.sm90_wgmma_t_decode import mla_decode_sm90_wgmma_t

    if sched is None:
        sched, ws = _schedule(case, ctas_per_sm)
    mla_decode_sm90_wgmma_t(case["q"], case["kv"], case["page_table"], case["lens"], case["sm_scale"],
                            case["kv_scale"], out, lse, sched, ws)
    return sched, ws


def _bufs(B, s_q, H, dtype=torch.bfloat16):
    out = torch.full((B, s_q, H, 512), float("nan"), dtype=dtype, device="cuda")
    lse = torch.full((B, s_q, H), float("nan"), dtype=torch.float32, device="cuda")
    return out, lse


# (B, s_q, S, H, varlen, page): BLOCK_M 16 (R <= 16) and 32 (16 < R <= 32), one tile / one
# item, many splits, odd and even tile counts per item (the producer's pair loop), partial
# m-blocks (R = 3, 12, 21, 24), lengths 0 / 1 / < s_q, tail tiles, page 128
CASES = [
    (1, 1, 64, 16, False, 64),      # one tile, one item
    (1, 1, 128, 16, False, 64),     # two tiles (one item per tile on a 132-SM schedule)
    (1, 1, 320, 16, False, 64),     # five tiles (five 1-tile items: test_wgmma_t_tiles_per_cta runs T per CTA)
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
    (4, 2, 300, 12, True, 64),      # R = 24, BLOCK_M 32 with a partial second half
    (3, 3, 150, 7, True, 128),      # R = 21, page 128
    (4, 2, 500, 8, True, 64),       # H = 8, s_q 2
]


@needs_sm90
@pytest.mark.parametrize("B,s_q,S,H,varlen,page", CASES)
def test_wgmma_t_fp8_against_fp64_reference(B, s_q, S, H, varlen, page):
    case = make_case(B, s_q, H, S, FP8, varlen, seed=random.randrange(1 << 30), page=page)
    out, lse = _bufs(B, s_q, H)
    run_t(case, out, lse)
    torch.cuda.synchronize()
    check(case, out, lse)


@needs_sm90
@pytest.mark.parametrize("B,s_q,S,H,varlen,page", [c for i, c in enumerate(CASES) if i % 2 == 0])
def test_wgmma_t_bf16_kv_against_fp64_reference(B, s_q, S, H, varlen, page):
    case = make_case(B, s_q, H, S, torch.bfloat16, varlen, seed=random.randrange(1 << 30), page=page)
    out, lse = _bufs(B, s_q, H)
    run_t(case, out, lse)
    torch.cuda.synchronize()
    check(case, out, lse)


@needs_sm90
@pytest.mark.parametrize("kv", ["fp8", "bf16"])
@pytest.mark.parametrize("s_q", [1, 2])
@pytest.mark.parametrize("tiles", [1, 2, 3, 5, 8])
def test_wgmma_t_tiles_per_cta(tiles, s_q, kv):
    """One request scheduled for one SM: a single work item with every tile, so one CTA runs
    T tiles through the 2-stage ring (first use, reuse, odd counts).  A hang here is the ring
    protocol or setmaxnreg (benchmarks/wgmma_t_hang_probe.py tells them apart)."""
    from mla_cute_dsl.kernels import alloc_workspace, make_schedule

    case = make_case(1, s_q, 16, 64 * tiles, FP8 if kv == "fp8" else torch.bfloat16, False,
                     seed=random.randrange(1 << 30))
    sched = make_schedule(case["lens_cpu"], s_q, 16, 1, ctas_per_sm=1)
    assert sched.work_info[0].tolist() == [0, 0, 64 * tiles, -1]
    ws = alloc_workspace(sched)
    out, lse = _bufs(1, s_q, 16)
    run_t(case, out, lse, sched, ws)
    torch.cuda.synchronize()
    check(case, out, lse)


@needs_sm90
@pytest.mark.parametrize("kv", ["fp8", "fp16"])
def test_wgmma_t_fp16_q(kv):
    case = make_case(6, 2, 16, 1000, FP8 if kv == "fp8" else torch.float16, True,
                     seed=random.randrange(1 << 30))
    case["q"] = case["q"].to(torch.float16)
    out, lse = _bufs(6, 2, 16, torch.float16)
    run_t(case, out, lse)
    torch.cuda.synchronize()
    check(case, out, lse)


@needs_sm90
@pytest.mark.parametrize("ctas_per_sm", [1, 2])
def test_wgmma_t_any_schedule(ctas_per_sm):
    case = make_case(12, 2, 16, 2000, FP8, True, seed=random.randrange(1 << 30))
    out, lse = _bufs(12, 2, 16)
    run_t(case, out, lse, ctas_per_sm=ctas_per_sm)
    torch.cuda.synchronize()
    check(case, out, lse)


@needs_sm90
@pytest.mark.parametrize("B,s_q,H,S", [(1, 1, 16, 4096), (2, 2, 16, 1000), (6, 4, 3, 140)])
def test_wgmma_t_large_magnitude_q(B, s_q, H, S):
    case = make_case(B, s_q, H, S, FP8, varlen=False, q_std=100.0, seed=random.randrange(1 << 30))
    out, lse = _bufs(B, s_q, H)
    run_t(case, out, lse)
    torch.cuda.synchronize()
    check(case, out, lse, tol=2e-2)


@needs_sm90
@pytest.mark.parametrize("s_q", [1, 2])
def test_wgmma_t_matches_fp8reg_same_schedule(s_q):
    """Same inputs and the same schedule (1 CTA per SM) through the fp8reg kernel and this one:
    close (not bit-equal: different reduction order), which separates a kernel bug from a
    reference bug."""
    from mla_cute_dsl.kernels.sm90_decode_fp8 import mla_decode_sm90_fp8

    case = make_case(8, s_q, 16, 3000, FP8, varlen=True, seed=random.randrange(1 << 30))
    o1, l1 = _bufs(8, s_q, 16)
    o2, l2 = _bufs(8, s_q, 16)
    sched, ws = _schedule(case, 1)
    mla_decode_sm90_fp8(case["q"], case["kv"], case["page_table"], case["lens"], case["sm_scale"],
                        case["kv_scale"], o1, l1, sched, ws)
    torch.cuda.synchronize()
    run_t(case, o2, l2, sched, ws)
    torch.cuda.synchronize()
    d = (o1.float() - o2.float()).norm() / o1.float().norm().clamp_min(1e-30)
    assert d < 1e-2, f"rel diff vs fp8reg {d:.3e}"
    fin = torch.isfinite(l1)
    assert torch.equal(fin, torch.isfinite(l2))
    assert (l1[fin] - l2[fin]).abs().max() < 1e-2


@needs_sm90
@pytest.mark.parametrize("kv", ["fp8", "bf16"])
def test_wgmma_t_graph_replay_equals_eager(kv):
    B, s_q, H, S = 6, 2, 16, 1000
    case = make_case(B, s_q, H, S, FP8 if kv == "fp8" else torch.bfloat16, varlen=True,
                     seed=random.randrange(1 << 30))
    out, lse = _bufs(B, s_q, H)
    sched, ws = run_t(case, out, lse)  # warm up (compile) outside capture
    graph_replay_equals_eager(lambda: run_t(case, out, lse, sched, ws), out, lse,
                              refresh=lambda: fresh_values(case["q"]), check=lambda o, l: check(case, o, l),
                              scratch=ws)
