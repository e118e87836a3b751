"""GPU tests of the fp8 ring producer with per-block release (``MLADecodePartialWGMMASeesaw(fp8_producer=True,
fp8p_ring=R, fp8p_block_release=True)``; branch fp8-block-release, written compile-only: not yet run on a GPU when
written).  Warpgroup 1's end-of-pair part (tile b's columns 256..511) is released, refilled and waited per 64-column
block on mbarriers of its own, and every P V is issued as N = 64 WGMMAs (NOTES.md "fp8 ring producer with per-block
release").  The same conversions into the same shared memory and the same k-order of every sum, so against the ring
kernel without the option the result is expected bitwise equal; it is asserted close (1e-3 relative) in every case
and bitwise in ``test_bitwise_equal_to_the_ring`` only, so that a failure of that test alone points at the N = 64
WGMMAs' rounding, not at the protocol.

* The smallest cases first (one tile in one CTA, a partial tile with a NaN page tail, every tile count 0..10 in one
  CTA, few-column balanced walks): a wrong block barrier or parity shows as a hang there: run this file under
  ``timeout``, or benchmarks/seesaw_fp8pbr_hang_probe.py first (each case in a child process under a timeout).
* Fresh random inputs per case (test_kernel_gpu.make_case / test_seesaw_balanced_fp8_gpu.make_case_fp8: shuffled
  page tables, NaN in unused pages and page tails), NaN-poisoned outputs and partial buffers; lengths with 0, 1 and
  < s_q; s_q 1 / 2; H 64 / 126 / 128; pages 64 / 128 / 256; bf16 / fp16 q; eager and lazy; large-magnitude q (std
  100); one item per CTA and balanced (1 / 5-SM columns of many items, the H=128 auto plans); ring 7 and 5.
Skipped without an sm_90 GPU.  Kernels: prebuild labels "... fp8pbr" (ONLY=fp8pbr), their twins "... r7[ lazy]".

    PYTHONPATH=plugins/cute_dsl_mla:plugins/cute_dsl_mla/tests:. timeout 600 python -m pytest -q -p no:cacheprovider \\
        -rfs -x plugins/cute_dsl_mla/tests/test_seesaw_fp8p_blockrel_gpu.py
"""

from __future__ import annotations

import functools
import random

import pytest
import torch

from test_kernel_gpu import check, make_case, run_kernel  # same directory (pytest rootdir import)
from test_seesaw_balanced_fp8_gpu import QT, _schedule, make_case_fp8
from test_wgmma_t_balanced_gpu import _lengths, _outs, needs_sm90

from mla_cute_dsl.kernels.fp8p_ring import RING_DEFAULT

pytestmark = pytest.mark.gpu


def _decode(blk, lazy, ring=RING_DEFAULT):
    """The even seesaw entry with the producer warpgroup and its register ring, with or without block release."""
    from mla_cute_dsl.kernels.sm90_wgmma_decode import mla_decode_sm90_wgmma_seesaw

    return functools.partial(mla_decode_sm90_wgmma_seesaw, fp8_producer=True, lazy_rescale=lazy, fp8p_ring=ring,
                             **({"fp8p_block_release": True} if blk else {}))


def _case(B, s_q, H, S, varlen, page=64, q_dtype="bf16", q_std=1.0):
    case = make_case(B, s_q, H, S, torch.float8_e4m3fn, varlen, q_std=q_std, page=page,
                     seed=random.randrange(1 << 30))
    case["q"] = case["q"].to(QT[q_dtype])
    return case


def _run(case, decode, sched=None, ws=None):
    out, lse = _outs(case)
    if sched is not None:
        for part in ws:
            part.fill_(float("nan"))
    run_kernel(case, out, lse, sched=sched, ws=ws, decode=decode)
    torch.cuda.synchronize()
    return out, lse


def _close(got, ref, what):
    d = (got[0].double() - ref[0].double()).norm() / ref[0].double().norm().clamp_min(1e-30)
    assert d < 1e-3, f"{what}: rel diff {d:.3e} against the ring kernel without fp8p_block_release"
    lse_ok = torch.allclose(got[1].nan_to_num(), ref[1].nan_to_num(), rtol=1e-4, atol=1e-4)
    assert lse_ok, f"{what}: lse differs from the ring kernel without fp8p_block_release"


def _bitwise(a, b):
    return torch.equal(a[0], b[0]) and torch.equal(a[1].nan_to_num(), b[1].nan_to_num())


SMALL = [  # (B, s_q, S, H, varlen, page, q dtype): the hang-prone shapes first
    (1, 1, 64, 64, False, 64, "bf16"),      # one tile, one item (no tile b: part 3 never used)
    (1, 1, 128, 64, False, 64, "bf16"),     # one pair: part 3 filled once, released never (one item)
    (1, 1, 37, 64, False, 64, "bf16"),      # a partial tile (NaN page tail)
    (1, 1, 320, 64, False, 64, "bf16"),     # 5 tiles: part 3 refilled once per block, last pair odd
    (1, 1, 512, 128, False, 64, "bf16"),    # 8 tiles, H 128
]
CASES = [
    (1, 1, 4096, 128, False, 64, "bf16"),   # many splits: items of 1-2 tiles on every SM, then the combine
    (2, 1, 140, 128, True, 64, "bf16"),     # a tail tile, varlen
    (6, 2, 140, 126, True, 64, "bf16"),     # R = 252, lengths 0 / 1 (< s_q)
    (2, 2, 4096, 128, False, 64, "bf16"),   # s_q = 2
    (3, 2, 1000, 128, True, 256, "bf16"),   # page 256: 4 blocks per page, NaN tails inside pages
    (2, 1, 3000, 128, False, 128, "fp16"),  # page 128, fp16 q, split items
    (16, 1, 4096, 128, False, 64, "bf16"),  # the H=128 bench shape, smaller batch
    (6, 2, 333, 64, True, 256, "fp16"),     # fp16 q, s_q 2, page 256, lengths 0 / 1
]


@needs_sm90
@pytest.mark.parametrize("lazy", [True, False], ids=["lazy", "eager"])
@pytest.mark.parametrize("B,s_q,S,H,varlen,page,q_dtype", SMALL + CASES)
def test_block_release_against_fp64_reference_and_the_ring(B, s_q, S, H, varlen, page, q_dtype, lazy):
    case = _case(B, s_q, H, S, varlen, page, q_dtype)
    got = _run(case, _decode(True, lazy))
    check(case, *got)
    _close(got, _run(case, _decode(False, lazy)), "one item per CTA")


@needs_sm90
@pytest.mark.parametrize("B,s_q,S,H,varlen,page,q_dtype", SMALL[:4])
def test_bitwise_equal_to_the_ring(B, s_q, S, H, varlen, page, q_dtype):
    """Expected: the same bytes in shared memory, the same k-order of every S and P V sum; N = 64 instead of N = 256
    P V WGMMAs are not expected to round differently (each output element's sum is the same per k-step)."""
    case = _case(B, s_q, H, S, varlen, page, q_dtype)
    for lazy in (True, False):
        got, ref = _run(case, _decode(True, lazy)), _run(case, _decode(False, lazy))
        assert _bitwise(got, ref), f"lazy={lazy}: close but not bitwise equal to the ring kernel"


@needs_sm90
@pytest.mark.parametrize("ring", [RING_DEFAULT, 5])
@pytest.mark.parametrize("s_q,H,q_dtype,page", [(1, 128, "bf16", 64), (2, 64, "fp16", 64), (2, 126, "bf16", 256),
                                                (1, 128, "fp16", 128)])
def test_block_release_whole_requests_every_tile_count(s_q, H, q_dtype, page, ring):
    """One item per request on a 1-SM schedule: items of 0..10 tiles in one CTA (no tile b, one pair, part 3 refilled
    per block at every pair boundary, the release skipped where tile b + 2 does not exist), partial last tiles."""
    from mla_cute_dsl.kernels import alloc_workspace, make_schedule

    case = _case(14, s_q, H, 640, True, page, q_dtype)
    sched = make_schedule(case["lens_cpu"], s_q, H, 1)
    ws = alloc_workspace(sched)
    got = _run(case, _decode(True, True, ring), sched, ws)
    check(case, *got)
    _close(got, _run(case, _decode(False, True, ring), sched, ws), f"ring {ring}, 1 SM")


@needs_sm90
@pytest.mark.parametrize("q_dtype", ["bf16", "fp16"])
def test_block_release_large_magnitude_q(q_dtype):
    case = _case(4, 1, 128, 2000, varlen=False, q_dtype=q_dtype, q_std=100.0)
    for lazy in (False, True):
        check(case, *_run(case, _decode(True, lazy)), tol=2e-2)


# ---- balanced (kernel_fp8p_balanced with the ring and block release) -------------------------------------------


def _run_bal(case, sched, ws, lazy, blk, ring=RING_DEFAULT):
    from mla_cute_dsl.kernels.sm90_wgmma_decode import mla_decode_sm90_wgmma_seesaw_balanced

    for part in ws:
        part.fill_(float("nan"))
    out, lse = _outs(case)
    mla_decode_sm90_wgmma_seesaw_balanced(case["q"], case["kv"], case["page_table"], case["lens"], case["sm_scale"],
                                          case["kv_scale"], out, lse, sched, ws, lazy_rescale=lazy,
                                          fp8_producer=True, fp8p_ring=ring,
                                          **({"fp8p_block_release": True} if blk else {}))
    torch.cuda.synchronize()
    return out, lse


@needs_sm90
@pytest.mark.parametrize("qd,page", [("bf16", 64), ("fp16", 256)])
@pytest.mark.parametrize("num_sms", [1, 5])
@pytest.mark.parametrize("s_q", [1, 2])
def test_block_release_balanced_few_columns_walk_many_items(num_sms, s_q, qd, page):
    """Columns of many items of 0..6 tiles: the block barriers' phases continue across items (every tile released,
    the producer running into the next item's tile 1 block by block)."""
    rng = random.Random()
    lens = [rng.choice([0, 1, 63, 64, 65, 128, 129, 192, 200, 320, 384]) for _ in range(24)]
    case = make_case_fp8(lens, s_q, 64, QT[qd], page, seed=rng.randrange(1 << 30))
    for form in ("even", "balanced"):
        sched, ws = _schedule(case, form, num_sms=num_sms)
        got = _run_bal(case, sched, ws, True, True)
        check(case, *got)
        _close(got, _run_bal(case, sched, ws, True, False), f"balanced {form}, {num_sms} SMs")


@needs_sm90
@pytest.mark.parametrize("lazy", [True, False], ids=["lazy", "eager"])
@pytest.mark.parametrize("B,s_q,H,kind,S,page,qd,form", [
    (24, 1, 128, "uniform", 4096, 64, "bf16", "auto"),
    (40, 1, 128, "uniform", 4096, 64, "bf16", "auto"),
    (9, 2, 128, "logskew", 4096, 64, "fp16", "balanced"),
    (16, 2, 126, "skewed", 1500, 256, "fp16", "balanced"),
    (100, 2, 64, "short", 64, 64, "bf16", "auto"),
])
def test_block_release_balanced_against_fp64_reference(B, s_q, H, kind, S, page, qd, form, lazy):
    rng = random.Random()
    case = make_case_fp8(_lengths(kind, B, S, s_q, rng), s_q, H, QT[qd], page, seed=rng.randrange(1 << 30))
    sched, ws = _schedule(case, form)
    got = _run_bal(case, sched, ws, lazy, True)
    check(case, *got)
    _close(got, _run_bal(case, sched, ws, lazy, False), f"balanced {kind} {form}")


@needs_sm90
def test_block_release_balanced_bench_shape():
    """B=128 H=128 s_q=1 S=4096 (the shape the option is for) on all SMs, balanced: correct, close to the ring."""
    rng = random.Random()
    case = make_case_fp8([4096] * 128, 1, 128, QT["bf16"], 64, seed=rng.randrange(1 << 30))
    sched, ws = _schedule(case, "auto")
    got = _run_bal(case, sched, ws, True, True)
    check(case, *got)
    _close(got, _run_bal(case, sched, ws, True, False), "B128 H128 S4096")
