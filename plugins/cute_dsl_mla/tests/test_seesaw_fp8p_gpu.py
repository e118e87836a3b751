"""GPU tests of the fp8 seesaw with a producer warpgroup (``MLADecodePartialWGMMASeesaw(fp8_producer=True)``, branch
fp8-producer, written compile-only): 384 threads, warpgroup 2 ld.global's / converts / st.shared's every fp8 part on
full / empty mbarriers, the math warpgroups run the 16-bit kernel's instruction stream.

Against the fp64 reference of test_kernel_gpu.py on random data (NaN-poisoned page tails and unused pages, e4m3 NaN
0x7F), NaN-poisoned outputs and partial slots; every tile count 0..10 in one CTA (a 1-SM schedule: one item per
request, out written directly), lengths 0 / 1 / < s_q, H 64 / 128 / 126 / 40, s_q 1 / 2 / 3, bf16 and fp16 q, page
64 and 256, large-magnitude q, eager and lazy rescale, a CUDA graph replay equal to the eager call, and against the
current fp8 seesaw (the same conversions and the same MMAs in the same order: expected bitwise equal; the close
comparison is asserted separately from the bitwise one so that a failure says which). Skipped without an sm_90 GPU.
A hang here is a protocol bug (full / empty mbarrier phases or the setmaxnreg split): run it under ``timeout``
(benchmarks/device/fp8_producer_gpu.sh runs a short probe first).

    PYTHONPATH=plugins/cute_dsl_mla:plugins/cute_dsl_mla/tests:. timeout 300 python -m pytest -q -p no:cacheprovider \\
        plugins/cute_dsl_mla/tests/test_seesaw_fp8p_gpu.py
"""

from __future__ import annotations

import functools
import random

import pytest
import torch

from graph_replay import fresh_values, graph_replay_equals_eager
from test_kernel_gpu import check, make_case, run_kernel  # same directory (pytest rootdir import)

pytestmark = pytest.mark.gpu


def _is_sm90():
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


needs_sm90 = pytest.mark.skipif(not _is_sm90(), reason="needs an SM90 GPU")

DT = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _decode(fp8_producer=True, lazy=False):
    from mla_cute_dsl.kernels.sm90_wgmma_decode import mla_decode_sm90_wgmma_seesaw

    return functools.partial(mla_decode_sm90_wgmma_seesaw, fp8_producer=fp8_producer, lazy_rescale=lazy)


def _fp8_case(B, s_q, H, S, varlen, page=64, q_dtype="bf16", q_std=1.0):
    case = make_case(B, s_q, H, S, torch.float8_e4m3fn, varlen, q_std=q_std, page=page,
                     seed=random.randrange(1 << 30))
    dt = DT[q_dtype]
    case["q"] = case["q"].to(dt)
    return case


def _outs(case):
    B, s_q, H, _ = case["q"].shape
    out = torch.full((B, s_q, H, 512), float("nan"), dtype=case["q"].dtype, device="cuda")
    lse = torch.full((B, s_q, H), float("nan"), dtype=torch.float32, device="cuda")
    return out, lse


def _run(case, decode, sched=None, ws=None):
    out, lse = _outs(case)
    if sched is not None:
        for part in ws:
            part.fill_(float("nan"))
    run_kernel(case, out, lse, sched=sched, ws=ws, decode=decode)
    torch.cuda.synchronize()
    return out, lse


# (B, s_q, S, H, varlen, page, q dtype): test_wgmma_gpu.py's fp8 cases
CASES = [
    (1, 1, 64, 64, False, 64, "bf16"),      # one tile, one item: the smallest case, run first
    (1, 1, 4096, 128, False, 64, "bf16"),   # many splits -> partial buffers + combine
    (2, 1, 140, 128, True, 64, "bf16"),     # tail tile (NaN page tail), varlen
    (6, 1, 20, 64, True, 64, "bf16"),       # lengths 0 / 1 / 20
    (6, 2, 140, 126, True, 64, "bf16"),     # R = 252: partial 4th m-block, lengths 0 / 1 (< s_q)
    (2, 2, 4096, 128, False, 64, "bf16"),   # s_q=2 causal rows
    (3, 2, 1000, 128, True, 256, "bf16"),   # page 256: in-page block offset, NaN tails inside pages
    (4, 1, 333, 126, True, 256, "bf16"),    # page 256, H=126
    (16, 1, 4096, 128, False, 64, "bf16"),  # the H=128 bench shape, smaller batch
    (2, 1, 140, 128, True, 64, "fp16"),     # fp16 q: cp.async Q path, fp16 output
    (6, 2, 333, 64, True, 256, "fp16"),     # fp16 q, s_q=2, page 256, lengths 0 / 1
]


@needs_sm90
@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
@pytest.mark.parametrize("B,s_q,S,H,varlen,page,q_dtype", CASES)
def test_fp8p_against_fp64_reference_and_fp8_seesaw(B, s_q, S, H, varlen, page, q_dtype, lazy):
    case = _fp8_case(B, s_q, H, S, varlen, page, q_dtype)
    out, lse = _run(case, _decode(True, lazy))
    check(case, out, lse)
    ref_out, ref_lse = _run(case, _decode(False, lazy))
    d = (out.double() - ref_out.double()).norm() / ref_out.double().norm().clamp_min(1e-30)
    assert d < 1e-3, f"fp8_producer against the fp8 seesaw: rel diff {d:.3e}"
    fin = torch.isfinite(ref_lse)
    assert torch.equal(fin, torch.isfinite(lse))
    assert not fin.any() or (lse[fin] - ref_lse[fin]).abs().max() < 1e-3


@needs_sm90
@pytest.mark.parametrize("B,s_q,S,H,varlen,page,q_dtype", [CASES[2], CASES[5], CASES[6], CASES[9]])
def test_fp8p_bitwise_equal_to_fp8_seesaw(B, s_q, S, H, varlen, page, q_dtype):
    """Expected bitwise: the same conversion (cvt.rn.f16x2.e4m3x2, tail rows selected to 0) into the same smem
    layout, the same WGMMAs and softmax in the same order; only who loads differs."""
    case = _fp8_case(B, s_q, H, S, varlen, page, q_dtype)
    out, lse = _run(case, _decode(True))
    ref_out, ref_lse = _run(case, _decode(False))
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)


@needs_sm90
@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
@pytest.mark.parametrize("s_q,H,q_dtype", [(1, 128, "bf16"), (2, 64, "bf16"), (3, 40, "fp16"), (2, 126, "fp16"),
                                           (1, 128, "fp16")])
def test_fp8p_whole_requests_every_tile_count(s_q, H, q_dtype, lazy):
    """One work item per request (a schedule made for 1 SM: no splits), random lengths 0..640 plus 0 / 1 / s_q - 1
    / 640: items of 0..10 tiles in one CTA, odd and even (the last pair without a buffer-1 tile: the producer's
    T = 0, 1, odd, even paths), partial last tiles with e4m3 NaN page tails, causal rows for s_q > 1."""
    from mla_cute_dsl.kernels import alloc_workspace, make_schedule

    B = 14
    case = _fp8_case(B, s_q, H, 640, True, 64, q_dtype)
    sched = make_schedule(case["lens_cpu"], s_q, H, 1)
    ws = alloc_workspace(sched)
    out, lse = _run(case, _decode(True, lazy), sched, ws)
    check(case, out, lse)


@needs_sm90
@pytest.mark.parametrize("q_dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("B,s_q,H,S", [(4, 1, 128, 2000), (3, 2, 64, 1500)])
def test_fp8p_large_magnitude_q(B, s_q, H, S, q_dtype):
    case = _fp8_case(B, s_q, H, S, varlen=False, q_dtype=q_dtype, q_std=100.0)
    for lazy in (False, True):
        out, lse = _run(case, _decode(True, lazy))
        check(case, out, lse, tol=2e-2)


@needs_sm90
@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_fp8p_graph_replay_equals_eager(lazy):
    """Captured once, replayed on new q: bitwise equal to an eager call (mbarrier phases start fresh per CTA)."""
    from mla_cute_dsl.kernels import alloc_workspace, make_schedule

    case = _fp8_case(6, 2, 64, 1000, varlen=True)
    q = case["q"]
    out, lse = _outs(case)
    n_sm = torch.cuda.get_device_properties(0).multi_processor_count
    sched = make_schedule(case["lens_cpu"], 2, 64, n_sm)
    ws = alloc_workspace(sched)
    decode = _decode(True, lazy)

    def call():
        decode(q, case["kv"], case["page_table"], case["lens"], case["sm_scale"], case["kv_scale"], out, lse, sched,
               ws)

    call()  # compile / load outside the capture
    graph_replay_equals_eager(call, out, lse, refresh=lambda: fresh_values(q), check=lambda o, l: check(case, o, l),
                              scratch=ws)


@needs_sm90
def test_fp8p_l2_prefetch_option_is_bitwise_equal():
    """The producer issues the L2 prefetch (on by default for fp8): with and without it, the same bits."""
    from mla_cute_dsl.kernels.sm90_wgmma_decode import mla_decode_sm90_wgmma_seesaw

    case = _fp8_case(3, 2, 128, 1000, varlen=True)
    outs = [_run(case, functools.partial(mla_decode_sm90_wgmma_seesaw, fp8_producer=True, l2_prefetch=pf))
            for pf in (False, True)]
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
