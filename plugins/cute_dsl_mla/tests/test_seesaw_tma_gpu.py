"""GPU tests of the seesaw kernel's TMA KV loads (``mla_decode_sm90_wgmma_seesaw(..., tma=True)``, branch
seesaw-tma2) against the fp64 reference of test_kernel_gpu.py and, bitwise, against the default (cp.async)
seesaw kernel: the arithmetic is the same, only the loads differ, so out and lse must be equal bit for bit.

Inputs: make_case's shuffled page tables and NaN-poisoned unused pages, with one batch of the lengths
0, 1, 63, 64, 65, 700, 4096 (empty request, one row, partial / full / one-past-full last tiles, a long one):
every row a request does not read (page tails inside a page included) is NaN, which TMA copies as it is
(the kernel zeroes the V tail rows of a request's last tile); NaN-poisoned out, lse and partial buffers;
q of std 100; page sizes 64 and 256; s_q 1 and 2, H 64 and 128; the backend's schedule (splits) and a
1-SM schedule (one item per request: every tile count, the last tile in either buffer); CUDA-graph replay.
Skips cleanly without an SM90 GPU.

    PYTHONPATH=plugins/cute_dsl_mla:. python -m pytest -q -rfs plugins/cute_dsl_mla/tests/test_seesaw_tma_gpu.py
"""

from __future__ import annotations

import functools
import random

import pytest
import torch

from graph_replay import fresh_values, graph_replay_equals_eager
from test_kernel_gpu import check, make_case, run_kernel  # same directory (pytest rootdir import)

pytestmark = pytest.mark.gpu

LENS = (0, 1, 63, 64, 65, 700, 4096)


def _is_sm90():
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


needs_sm90 = pytest.mark.skipif(not _is_sm90(), reason="needs an SM90 GPU")


def _lens_case(s_q: int, H: int, dtype=torch.bfloat16, page: int = 64, q_std: float = 1.0, lens=LENS):
    """make_case with the given lengths: built for max(lens) tokens per request, then the lengths set and
    every row a request no longer reads NaN-poisoned again (pages are not shared between requests)."""
    B, S = len(lens), max(lens)
    case = make_case(B, s_q, H, S, dtype, varlen=False, q_std=q_std, page=page, seed=random.randrange(1 << 30))
    case["q"] = case["q"].to(dtype)  # make_case's q is bf16
    kv, pt = case["kv"], case["page_table"].long()
    for b, n in enumerate(lens):
        t = torch.arange(n, pt.shape[1] * page, device=kv.device)
        kv[pt[b, t // page], t % page] = float("nan")
    lens_t = torch.tensor(lens, dtype=torch.int32)
    case["lens_cpu"], case["lens"] = lens_t, lens_t.to(kv.device)
    return case


def _empty(case, dtype):
    B, s_q, H, _ = case["q"].shape
    out = torch.full((B, s_q, H, 512), float("nan"), dtype=dtype, device="cuda")
    lse = torch.full((B, s_q, H), float("nan"), dtype=torch.float32, device="cuda")
    return out, lse


def _tma_and_default(case, dtype, one_sm: bool = False):
    """The same inputs through the tma and the default seesaw kernel (each with its own NaN-poisoned out, lse
    and partial buffers, the same schedule); returns (out, lse) of both."""
    from mla_cute_dsl.kernels import alloc_workspace, make_schedule
    from mla_cute_dsl.kernels.sm90_wgmma_decode import mla_decode_sm90_wgmma_seesaw

    res = []
    for tma in (True, False):
        out, lse = _empty(case, dtype)
        sched = ws = None
        if one_sm:  # one work item per request: out written directly, every tile count
            _, s_q, H, _ = case["q"].shape
            sched = make_schedule(case["lens_cpu"], s_q, H, 1)
            ws = alloc_workspace(sched)
            for part in ws:
                part.fill_(float("nan"))
        run_kernel(case, out, lse, sched, ws, decode=functools.partial(mla_decode_sm90_wgmma_seesaw, tma=tma))
        res.append((out, lse))
    torch.cuda.synchronize()
    return res


@needs_sm90
def test_tma_smallest_case_first():
    """One request of one full tile, one item: the first launch (a hang or a fault shows here first)."""
    case = _lens_case(1, 64, lens=(64,))
    (o, l), (o_ref, l_ref) = _tma_and_default(case, torch.bfloat16, one_sm=True)
    check(case, o, l)
    assert torch.equal(o, o_ref) and torch.equal(l, l_ref)


@needs_sm90
@pytest.mark.parametrize("one_sm", [False, True], ids=["splits", "one_sm"])
@pytest.mark.parametrize("page", [64, 256])
@pytest.mark.parametrize("s_q,H", [(1, 64), (1, 128), (2, 64), (2, 128)])
def test_tma_against_fp64_reference_and_bitwise_default(s_q, H, page, one_sm):
    case = _lens_case(s_q, H, page=page)
    (o, l), (o_ref, l_ref) = _tma_and_default(case, torch.bfloat16, one_sm)
    check(case, o, l)
    assert torch.equal(o, o_ref), "tma and cp.async seesaw kernels differ"
    assert torch.equal(l, l_ref)  # check() found no NaN in l: a NaN in l_ref makes this unequal


@needs_sm90
@pytest.mark.parametrize("s_q,H,page", [(1, 128, 64), (2, 64, 256)])
def test_tma_fp16(s_q, H, page):
    case = _lens_case(s_q, H, torch.float16, page=page)
    (o, l), (o_ref, l_ref) = _tma_and_default(case, torch.float16, one_sm=True)
    check(case, o, l)
    assert torch.equal(o, o_ref) and torch.equal(l, l_ref)


@needs_sm90
@pytest.mark.parametrize("s_q,H,page", [(1, 128, 64), (2, 64, 256)])
def test_tma_large_magnitude_q(s_q, H, page):
    case = _lens_case(s_q, H, page=page, q_std=100.0)
    (o, l), (o_ref, l_ref) = _tma_and_default(case, torch.bfloat16)
    check(case, o, l, tol=2e-2)
    assert torch.equal(o, o_ref) and torch.equal(l, l_ref)


@needs_sm90
def test_tma_graph_replay_equals_eager():
    """Captured once (the tensor map is a kernel parameter, built at launch from the cache tensor), replayed on
    new q: correct and bitwise equal to an eager call (mbarrier phases start fresh in every CTA)."""
    from mla_cute_dsl.kernels import alloc_workspace, make_schedule
    from mla_cute_dsl.kernels.sm90_wgmma_decode import mla_decode_sm90_wgmma_seesaw

    case = _lens_case(2, 128, page=256)
    q = case["q"]
    out, lse = _empty(case, torch.bfloat16)
    n_sm = torch.cuda.get_device_properties(0).multi_processor_count
    sched = make_schedule(case["lens_cpu"], 2, 128, n_sm)
    ws = alloc_workspace(sched)

    def call():
        mla_decode_sm90_wgmma_seesaw(q, case["kv"], case["page_table"], case["lens"], case["sm_scale"],
                                     case["kv_scale"], out, lse, sched, ws, tma=True)

    call()  # compile outside capture
    graph_replay_equals_eager(call, out, lse, refresh=lambda: fresh_values(q), check=lambda o, l: check(case, o, l),
                              scratch=ws)
