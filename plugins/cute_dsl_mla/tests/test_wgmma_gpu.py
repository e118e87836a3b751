"""GPU tests of the WGMMA partial kernel prototype (sm90_wgmma_decode) + the
combine kernel against the fp64 reference of test_kernel_gpu.py.

Same inputs as the mma.sync tests (shuffled pages, NaN in unused pages and
page tails, NaN-poisoned outputs, variable lengths incl. 0 and < s_q), KV in
bf16, and fp8 e4m3 (the ``*_fp8`` tests, branch wgmma-fp8: e4m3 NaN 0x7F in
page tails, kv_scale 0.37, bf16 and fp16 q; same tolerances as the mma.sync
fp8 tests), s_q * H >= 40 (the shapes this kernel is for; 64-row m-blocks,
partial last m-block included).  The 16-bit tests run both schedules of the
module (``variant``: ``wgmma`` = MLADecodePartialWGMMA, ``seesaw`` =
MLADecodePartialWGMMASeesaw, branch wgmma-overlap; with fp8 KV branch
wgmma-fp8-seesaw, the fp8 tests take ``variant`` too), plus seesaw-only tests
(every tile count per item, fp16 and fp8 KV, graph replay).  Skips cleanly without an SM90 GPU.

    PYTHONPATH=plugins/cute_dsl_mla:. python -m pytest -q -rfs plugins/cute_dsl_mla/tests/test_wgmma_gpu.py
"""

from __future__ import annotations

import random

import pytest
import torch

from graph_replay import fresh_values, graph_replay_equals_eager
from test_kernel_gpu import check, make_case, run_kernel  # same directory (pytest rootdir import)

pytestmark = pytest.mark.gpu


def _is_sm90():
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


needs_sm90 = pytest.mark.skipif(not _is_sm90(), reason="needs an SM90 GPU")


def run_wgmma(case, out, lse, variant="wgmma", sched=None, ws=None):
    """One decode with the WGMMA kernel: ``wgmma`` (one warpgroup computes S) or ``seesaw``
    (MLADecodePartialWGMMASeesaw: both warpgroups compute S for alternate tiles)."""
    from mla_cute_dsl.kernels.sm90_wgmma_decode import mla_decode_sm90_wgmma, mla_decode_sm90_wgmma_seesaw

    decode = {"wgmma": mla_decode_sm90_wgmma, "seesaw": mla_decode_sm90_wgmma_seesaw}[variant]
    return run_kernel(case, out, lse, sched=sched, ws=ws, decode=decode)[0]


# both schedules, for 16-bit and fp8 KV (seesaw + fp8: branch wgmma-fp8-seesaw)
VARIANTS = ["wgmma", "seesaw"]


# (B, s_q, S, H, varlen): one split and many splits, one and several m-blocks,
# a partial last m-block (R = 126, 40, 189), lengths 0 / 1 / < s_q
CASES = [
    (1, 1, 64, 64, False),      # one tile, one item (writes out directly)
    (1, 1, 4096, 128, False),   # B=1: many splits -> partial buffers + combine
    (2, 1, 140, 128, True),     # tail tile, varlen
    (2, 2, 4096, 128, False),   # s_q=2 causal rows, 4 m-blocks
    (6, 1, 20, 64, True),       # tiny lengths incl. 0 and 1
    (6, 2, 140, 63, True),      # R = 126: partial second m-block
    (2, 4, 1000, 16, True),     # R = 64 with 4 queries per m-block
    (3, 8, 140, 5, True),       # R = 40: 24 zero rows in the m-block
    (16, 1, 4096, 128, False),  # the H=128 bench shape, smaller batch
    (3, 3, 333, 63, True),      # R = 189, odd lengths
]


@needs_sm90
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("B,s_q,S,H,varlen", CASES)
def test_wgmma_against_fp64_reference(B, s_q, S, H, varlen, variant):
    case = make_case(B, s_q, H, S, torch.bfloat16, varlen, seed=random.randrange(1 << 30))
    out = torch.full((B, s_q, H, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    lse = torch.full((B, s_q, H), float("nan"), dtype=torch.float32, device="cuda")
    run_wgmma(case, out, lse, variant)
    torch.cuda.synchronize()
    check(case, out, lse)


@needs_sm90
@pytest.mark.parametrize("variant", VARIANTS)
def test_wgmma_page_size_256(variant):
    """Pages of 4 KV blocks: the in-page block offset (n % blocks_per_page) and
    NaN page tails inside a page; no other GPU test uses page_size > 64."""
    case = make_case(3, 2, 128, 1000, torch.bfloat16, varlen=True, page=256,
                     seed=random.randrange(1 << 30))
    out = torch.full((3, 2, 128, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    lse = torch.full((3, 2, 128), float("nan"), dtype=torch.float32, device="cuda")
    run_wgmma(case, out, lse, variant)
    torch.cuda.synchronize()
    check(case, out, lse)


@needs_sm90
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("B,s_q,H,S", [(2, 1, 128, 4096), (2, 2, 64, 1000)])
def test_wgmma_large_magnitude_q(B, s_q, H, S, variant):
    case = make_case(B, s_q, H, S, torch.bfloat16, varlen=False, q_std=100.0,
                     seed=random.randrange(1 << 30))
    out = torch.full((B, s_q, H, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    lse = torch.full((B, s_q, H), float("nan"), dtype=torch.float32, device="cuda")
    run_wgmma(case, out, lse, variant)
    torch.cuda.synchronize()
    check(case, out, lse, tol=2e-2)


@needs_sm90
@pytest.mark.parametrize("variant", VARIANTS)
def test_wgmma_matches_mma_sync_kernel(variant):
    """Same inputs through both partial kernels: close (not bit-equal: different
    summation order), which separates a WGMMA bug from a reference bug."""
    case = make_case(4, 2, 128, 2000, torch.bfloat16, varlen=True, seed=random.randrange(1 << 30))
    o1 = torch.full((4, 2, 128, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    l1 = torch.full((4, 2, 128), float("nan"), dtype=torch.float32, device="cuda")
    o2, l2 = o1.clone(), l1.clone()
    run_kernel(case, o1, l1)
    run_wgmma(case, o2, l2, variant)
    torch.cuda.synchronize()
    d = (o1.float() - o2.float()).norm() / o1.float().norm().clamp_min(1e-30)
    assert d < 1e-2, f"rel diff vs mma.sync kernel {d:.3e}"
    fin = torch.isfinite(l1)
    assert torch.equal(fin, torch.isfinite(l2))
    assert (l1[fin] - l2[fin]).abs().max() < 1e-2


# ---------------------------------------------------------------------------- seesaw only


@needs_sm90
@pytest.mark.parametrize("s_q,H,dtype,kv_dtype", [
    pytest.param(1, 128, torch.bfloat16, None, id="sq1-H128-bf16"),
    pytest.param(2, 64, torch.bfloat16, None, id="sq2-H64-bf16"),
    pytest.param(1, 128, torch.float16, None, id="sq1-H128-fp16"),
    pytest.param(3, 40, torch.float16, None, id="sq3-H40-fp16"),
    # fp8 e4m3 KV (register-staged conversion, branch wgmma-fp8-seesaw): bf16 and fp16 q
    pytest.param(1, 128, torch.bfloat16, torch.float8_e4m3fn, id="sq1-H128-bf16-fp8"),
    pytest.param(2, 64, torch.bfloat16, torch.float8_e4m3fn, id="sq2-H64-bf16-fp8"),
    pytest.param(3, 40, torch.float16, torch.float8_e4m3fn, id="sq3-H40-fp16-fp8"),
])
def test_seesaw_whole_requests_every_tile_count(s_q, H, dtype, kv_dtype):
    """One work item per request (a schedule made for 1 SM: no splits, out written
    directly), random lengths 0..640 plus 0 / 1 / s_q - 1 / 640: items of 0..10 tiles,
    odd and even (the last pair without a WG1 tile), partial last tiles with NaN
    page tails, causal rows for s_q > 1; fp16 included; fp8 KV (e4m3 NaN page tails)."""
    from mla_cute_dsl.kernels import alloc_workspace, make_schedule

    B = 14
    case = make_case(B, s_q, H, 640, kv_dtype or dtype, varlen=True, seed=random.randrange(1 << 30))
    case["q"] = case["q"].to(dtype)  # make_case's q is bf16
    sched = make_schedule(case["lens_cpu"], s_q, H, 1)
    ws = alloc_workspace(sched)
    for part in ws:
        part.fill_(float("nan"))
    out = torch.full((B, s_q, H, 512), float("nan"), dtype=dtype, device="cuda")
    lse = torch.full((B, s_q, H), float("nan"), dtype=torch.float32, device="cuda")
    run_wgmma(case, out, lse, "seesaw", sched, ws)
    torch.cuda.synchronize()
    check(case, out, lse)


@needs_sm90
def test_seesaw_matches_wgmma_and_graph_replay_equals_eager():
    """The seesaw kernel against the verified one-S WGMMA kernel on the same inputs
    (close; different order of rescales), then captured once in a CUDA graph and
    replayed on new q: bitwise equal to an eager call (no state left between launches:
    mbarrier phases and named barriers start fresh per CTA)."""
    from mla_cute_dsl.kernels import alloc_workspace, make_schedule
    from mla_cute_dsl.kernels.sm90_wgmma_decode import mla_decode_sm90_wgmma_seesaw

    case = make_case(8, 1, 128, 3000, torch.bfloat16, varlen=True, seed=random.randrange(1 << 30))
    q = case["q"]
    o1 = torch.full((8, 1, 128, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    l1 = torch.full((8, 1, 128), float("nan"), dtype=torch.float32, device="cuda")
    out, lse = o1.clone(), l1.clone()
    run_wgmma(case, o1, l1, "wgmma")
    n_sm = torch.cuda.get_device_properties(0).multi_processor_count
    sched = make_schedule(case["lens_cpu"], 1, 128, n_sm)
    ws = alloc_workspace(sched)

    def call():
        mla_decode_sm90_wgmma_seesaw(q, case["kv"], case["page_table"], case["lens"], case["sm_scale"],
                                     case["kv_scale"], out, lse, sched, ws)

    call()  # compile outside capture
    torch.cuda.synchronize()
    d = (o1.float() - out.float()).norm() / o1.float().norm().clamp_min(1e-30)
    assert d < 1e-2, f"rel diff vs the one-S WGMMA kernel {d:.3e}"
    fin = torch.isfinite(l1)
    assert torch.equal(fin, torch.isfinite(lse))
    assert (l1[fin] - lse[fin]).abs().max() < 1e-2
    graph_replay_equals_eager(call, out, lse, refresh=lambda: fresh_values(q), check=lambda o, l: check(case, o, l),
                              scratch=ws)


# ---------------------------------------------------------------------------- fp8 e4m3 KV
# (B, s_q, S, H, varlen, page, q dtype): H 64 / 128 / 126, s_q 1 / 2, one and many splits,
# lengths 0 / 1 / < s_q (varlen), partial last m-block (R = 126, 252), page 64 and 256


FP8_CASES = [
    (1, 1, 64, 64, False, 64, "bf16"),      # one tile, one item: the smallest case, run first
    (1, 1, 4096, 128, False, 64, "bf16"),   # many splits -> partial buffers + combine
    (2, 1, 140, 128, True, 64, "bf16"),     # tail tile (NaN page tail), varlen
    (6, 1, 20, 64, True, 64, "bf16"),       # lengths 0 / 1 / 20
    (6, 2, 140, 126, True, 64, "bf16"),     # R = 252: partial 4th m-block, lengths 0 / 1 (< s_q)
    (2, 2, 4096, 128, False, 64, "bf16"),   # s_q=2 causal rows
    (3, 2, 1000, 128, True, 256, "bf16"),   # page 256: in-page block offset, NaN tails inside pages
    (4, 1, 333, 126, True, 256, "bf16"),    # page 256, H=126 (R = 126: partial 2nd m-block)
    (16, 1, 4096, 128, False, 64, "bf16"),  # the H=128 bench shape, smaller batch
    (2, 1, 140, 128, True, 64, "fp16"),     # fp16 q: cp.async Q path, fp16 output
    (6, 2, 333, 64, True, 256, "fp16"),     # fp16 q, s_q=2, page 256, lengths 0 / 1
]


def _fp8_case(B, s_q, H, S, varlen, page=64, q_dtype="bf16", q_std=1.0):
    case = make_case(B, s_q, H, S, torch.float8_e4m3fn, varlen, q_std=q_std, page=page,
                     seed=random.randrange(1 << 30))
    dt = torch.float16 if q_dtype == "fp16" else torch.bfloat16
    case["q"] = case["q"].to(dt)
    out = torch.full((B, s_q, H, 512), float("nan"), dtype=dt, device="cuda")
    lse = torch.full((B, s_q, H), float("nan"), dtype=torch.float32, device="cuda")
    return case, out, lse


@needs_sm90
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("B,s_q,S,H,varlen,page,q_dtype", FP8_CASES)
def test_wgmma_fp8_against_fp64_reference(B, s_q, S, H, varlen, page, q_dtype, variant):
    case, out, lse = _fp8_case(B, s_q, H, S, varlen, page, q_dtype)
    run_wgmma(case, out, lse, variant)
    torch.cuda.synchronize()
    check(case, out, lse)


@needs_sm90
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("B,s_q,H,S", [(2, 1, 128, 4096), (2, 2, 64, 1000)])
def test_wgmma_fp8_large_magnitude_q(B, s_q, H, S, variant):
    """|q| ~ 100 (bf16 q converted to fp16 for the fp16 MMAs: exact range, 11-bit mantissa)."""
    case, out, lse = _fp8_case(B, s_q, H, S, varlen=False, q_std=100.0)
    run_wgmma(case, out, lse, variant)
    torch.cuda.synchronize()
    check(case, out, lse, tol=2e-2)


@needs_sm90
@pytest.mark.parametrize("variant", VARIANTS)
def test_wgmma_fp8_matches_mma_sync_kernel(variant):
    """fp8 KV through both partial kernels (both fp16 MMAs on the same converted
    values): close, which separates a WGMMA/conversion bug from a reference bug."""
    from test_kernel_gpu import run_kernel

    case, o1, l1 = _fp8_case(4, 2, 128, 2000, varlen=True)
    o2, l2 = o1.clone(), l1.clone()
    run_kernel(case, o1, l1)
    run_wgmma(case, o2, l2, variant)
    torch.cuda.synchronize()
    d = (o1.float() - o2.float()).norm() / o1.float().norm().clamp_min(1e-30)
    assert d < 1e-2, f"rel diff vs mma.sync kernel {d:.3e}"
    fin = torch.isfinite(l1)
    assert torch.equal(fin, torch.isfinite(l2))
    assert (l1[fin] - l2[fin]).abs().max() < 1e-2


@needs_sm90
@pytest.mark.parametrize("variant", VARIANTS)
def test_wgmma_fp8_graph_replay_equals_eager(variant):
    """Captured once, replayed on new q: equal to an eager call (bitwise)."""
    from mla_cute_dsl.kernels import alloc_workspace, make_schedule
    from mla_cute_dsl.kernels.sm90_wgmma_decode import mla_decode_sm90_wgmma, mla_decode_sm90_wgmma_seesaw

    decode = {"wgmma": mla_decode_sm90_wgmma, "seesaw": mla_decode_sm90_wgmma_seesaw}[variant]

    case, out, lse = _fp8_case(6, 2, 64, 1000, varlen=True)
    q = case["q"]
    n_sm = torch.cuda.get_device_properties(0).multi_processor_count
    sched = make_schedule(case["lens_cpu"], 2, 64, n_sm)
    ws = alloc_workspace(sched)

    def call():
        decode(q, case["kv"], case["page_table"], case["lens"], case["sm_scale"],
               case["kv_scale"], out, lse, sched, ws)

    call()  # compile outside capture
    graph_replay_equals_eager(call, out, lse, refresh=lambda: fresh_values(q), check=lambda o, l: check(case, o, l),
                              scratch=ws)


@needs_sm90
@pytest.mark.parametrize("kv", ["bf16", "fp8"])
@pytest.mark.parametrize("B,s_q,H,S,varlen", [(3, 2, 128, 1000, True), (2, 1, 128, 4096, False)])
def test_seesaw_l2_prefetch_option_is_bitwise_equal(kv, B, s_q, H, S, varlen):
    """The L2 prefetch (option ``l2_prefetch``; since 0.2.2 on by default only for fp8 caches) only
    warms L2: the kernel with it writes the same bits as without, and both match the fp64 reference."""
    import functools

    from mla_cute_dsl.kernels.sm90_wgmma_decode import mla_decode_sm90_wgmma_seesaw

    if kv == "fp8":
        case, o1, l1 = _fp8_case(B, s_q, H, S, varlen)
    else:
        case = make_case(B, s_q, H, S, torch.bfloat16, varlen, seed=random.randrange(1 << 30))
        o1 = torch.full((B, s_q, H, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
        l1 = torch.full((B, s_q, H), float("nan"), dtype=torch.float32, device="cuda")
    o2, l2 = o1.clone(), l1.clone()
    run_kernel(case, o1, l1, decode=functools.partial(mla_decode_sm90_wgmma_seesaw, l2_prefetch=False))
    run_kernel(case, o2, l2, decode=functools.partial(mla_decode_sm90_wgmma_seesaw, l2_prefetch=True))
    torch.cuda.synchronize()
    check(case, o1, l1)
    assert torch.equal(o1, o2)
    assert torch.equal(l1, l2)  # check() found no NaN in l1: a NaN in l2 makes this unequal
