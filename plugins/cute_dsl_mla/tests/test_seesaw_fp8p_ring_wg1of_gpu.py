"""GPU tests of the fp8 ring producer with WG1's QK part order (``MLADecodePartialWGMMASeesaw(fp8_producer=True,
fp8p_ring=R, wg1_other_first=True)``; branch fp8-wg1of, written compile-only: NOT run on a GPU when written).
Warpgroup 1's QK of its tile b waits full[2] (warpgroup 0's columns 0..255 + RoPE) first and issues those 20
k-blocks first, and the ring converts tile b's part 2 before part 3 (NOTES.md "fp8 ring producer with WG1's QK part
order").

What to expect against what:
* the fp64 reference (test_kernel_gpu.check), every case;
* the ring kernel WITHOUT the option: close (relative 1e-3), NOT asserted bitwise: WG1's S of its tiles sums its 36
  k-blocks in another order (0..15, 32..35, then 16..31), so its fp32 rounding differs (the 16-bit wg1_other_first
  kernels measured the same: close, not bitwise); whether it happened to be bitwise equal is printed;
* the other producer schedules WITH the option (ring 5, ring 7 staged through shared memory, against ring 7):
  BITWISE equal (the same conversions into the same shared memory, the same math in the same order; only when the
  loads are issued differs), asserted separately so that a failure of only that check points at the producer.

The smallest cases first (one tile in one CTA, a partial tile with a NaN page tail, every tile count 0..10 in one
CTA, few-column balanced walks): a protocol slip shows as a hang: run this file under ``timeout`` after
``benchmarks/seesaw_tmap_hang_probe.py --kernel fp8ring_wg1of``.  Fresh random inputs per case (shuffled page tables,
NaN in unused pages and page tails: test_kernel_gpu.make_case / test_seesaw_balanced_fp8_gpu.make_case_fp8),
NaN-poisoned outputs and partial buffers; lengths 0, 1 and < s_q; s_q 1 / 2; H 64 / 126 / 128; pages 64 / 128 /
256; bf16 / fp16 q; eager and lazy; large-magnitude q (std 100); one item per CTA and balanced (1 / 5-SM columns of
many items, the H=128 auto plans).  Skipped without an sm_90 GPU.  Kernels: prebuild labels
"seesaw_fp8p_ring_wg1of[_balanced] ..." (ONLY=ring_wg1of) and their twins "seesaw_fp8p_ring[_balanced] ...".

    PYTHONPATH=plugins/cute_dsl_mla:plugins/cute_dsl_mla/tests:. timeout 400 python -m pytest -q -p no:cacheprovider \\
        -rfs -x plugins/cute_dsl_mla/tests/test_seesaw_fp8p_ring_wg1of_gpu.py
"""

from __future__ import annotations

import functools
import random

import pytest
import torch

from test_kernel_gpu import check, make_case, run_kernel  # same directory (pytest rootdir import)
from test_seesaw_balanced_fp8_gpu import QT, _schedule, make_case_fp8
from test_wgmma_t_balanced_gpu import _lengths, _outs, needs_sm90

from mla_cute_dsl.kernels.fp8p_ring import RING_DEFAULT, STAGE_SLOTS

pytestmark = pytest.mark.gpu


def _decode(wg1of, lazy, ring=RING_DEFAULT, stage=0):
    """The even seesaw entry with the producer warpgroup's register ring, with or without wg1_other_first."""
    from mla_cute_dsl.kernels.sm90_wgmma_decode import mla_decode_sm90_wgmma_seesaw

    return functools.partial(mla_decode_sm90_wgmma_seesaw, fp8_producer=True, lazy_rescale=lazy, fp8p_ring=ring,
                             **({"fp8p_stage": stage} if stage else {}),
                             **({"wg1_other_first": True} if wg1of else {}))


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


def _bitwise(a, b):
    return torch.equal(a[0], b[0]) and torch.equal(a[1].nan_to_num(), b[1].nan_to_num())


def _close_to_off(got, off, what):
    """Close to the kernel without the option (relative Frobenius difference of out < 1e-3; lse within 1e-3);
    bitwise equality printed, not asserted (WG1's S runs its k-blocks in another order)."""
    d = (got[0].double() - off[0].double()).norm() / off[0].double().norm().clamp_min(1e-30)
    dl = (got[1].double() - off[1].double()).nan_to_num(0.0).abs().max().item() if got[1].numel() else 0.0
    print(f"{what}: against the ring without wg1_other_first: rel diff {d:.2e}, lse max diff {dl:.2e}, "
          f"bitwise {_bitwise(got, off)}")
    assert d < 1e-3 and dl < 1e-3, f"{what}: rel diff {d:.3e}, lse {dl:.3e} against the kernel without the option"


CASES = [  # (B, s_q, S, H, varlen, page, q dtype): smallest first
    (1, 1, 64, 64, False, 64, "bf16"),      # one tile, one item
    (1, 1, 37, 64, False, 64, "bf16"),      # one partial tile (NaN page tail)
    (2, 1, 140, 128, True, 64, "bf16"),     # a tail tile, varlen
    (6, 2, 140, 126, True, 64, "bf16"),     # R = 252, lengths 0 / 1 (< s_q)
    (1, 1, 4096, 128, False, 64, "bf16"),   # many splits: items of 1-2 tiles on every SM
    (2, 2, 4096, 128, False, 64, "bf16"),   # s_q = 2
    (3, 2, 1000, 128, True, 256, "bf16"),   # page 256: items starting inside a page, NaN tails inside pages
    (2, 1, 3000, 128, False, 128, "fp16"),  # page 128, fp16 q
    (16, 1, 4096, 128, False, 64, "bf16"),  # the H=128 bench shape, smaller batch
    (6, 2, 333, 64, True, 256, "fp16"),     # fp16 q, s_q 2, page 256, lengths 0 / 1
]


@needs_sm90
@pytest.mark.parametrize("lazy", [True, False], ids=["lazy", "eager"])
@pytest.mark.parametrize("B,s_q,S,H,varlen,page,q_dtype", CASES)
def test_wg1of_ring_against_fp64_reference_and_the_ring_without_it(B, s_q, S, H, varlen, page, q_dtype, lazy):
    case = _case(B, s_q, H, S, varlen, page, q_dtype)
    got = _run(case, _decode(True, lazy))
    check(case, *got)
    _close_to_off(got, _run(case, _decode(False, lazy)), f"B{B} s_q{s_q} S{S} H{H} {q_dtype}")


@needs_sm90
@pytest.mark.parametrize("s_q,H,q_dtype,page", [(1, 128, "bf16", 64), (2, 64, "fp16", 64), (2, 126, "bf16", 256)])
def test_wg1of_ring_whole_requests_every_tile_count(s_q, H, q_dtype, page):
    """One item per request (a 1-SM schedule): items of 0..10 tiles in one CTA, odd and even (the last pair without
    a buffer-1 tile), partial last tiles with NaN tails; ring 5 and the staged ring 7 bitwise equal to ring 7."""
    from mla_cute_dsl.kernels import alloc_workspace, make_schedule

    case = _case(14, s_q, H, 640, True, page, q_dtype)
    sched = make_schedule(case["lens_cpu"], s_q, H, 1)
    ws = alloc_workspace(sched)
    got = _run(case, _decode(True, True), sched, ws)
    check(case, *got)
    _close_to_off(got, _run(case, _decode(False, True), sched, ws), f"tile counts s_q{s_q} H{H}")
    for ring, stage in ((5, 0), (RING_DEFAULT, STAGE_SLOTS)):
        other = _run(case, _decode(True, True, ring, stage), sched, ws)
        assert _bitwise(other, got), f"wg1of ring {ring} stage {stage}: not bitwise equal to ring {RING_DEFAULT}"


@needs_sm90
@pytest.mark.parametrize("B,s_q,S,H,page,q_dtype", [(2, 1, 4096, 128, 64, "bf16"), (6, 2, 140, 126, 256, "fp16")])
def test_wg1of_ring_sizes_and_staging_are_bitwise_equal(B, s_q, S, H, page, q_dtype):
    case = _case(B, s_q, H, S, True, page, q_dtype)
    ref = _run(case, _decode(True, True))
    check(case, *ref)
    for ring, stage in ((5, 0), (RING_DEFAULT, STAGE_SLOTS)):
        assert _bitwise(_run(case, _decode(True, True, ring, stage)), ref), (ring, stage)


@needs_sm90
@pytest.mark.parametrize("q_dtype", ["bf16", "fp16"])
def test_wg1of_ring_large_magnitude_q(q_dtype):
    case = _case(4, 1, 128, 2000, varlen=False, q_dtype=q_dtype, q_std=100.0)
    for lazy in (False, True):
        check(case, *_run(case, _decode(True, lazy)), tol=2e-2)


# ---- balanced (kernel_fp8p_balanced with the ring and wg1_other_first) --------------------------------------------


def _run_bal(case, sched, ws, lazy, wg1of, ring=RING_DEFAULT, stage=0):
    from mla_cute_dsl.kernels.sm90_wgmma_decode import mla_decode_sm90_wgmma_seesaw_balanced

    for part in ws:
        part.fill_(float("nan"))
    out, lse = _outs(case)
    mla_decode_sm90_wgmma_seesaw_balanced(case["q"], case["kv"], case["page_table"], case["lens"], case["sm_scale"],
                                          case["kv_scale"], out, lse, sched, ws, lazy_rescale=lazy,
                                          fp8_producer=True, fp8p_ring=ring,
                                          **({"fp8p_stage": stage} if stage else {}),
                                          **({"wg1_other_first": True} if wg1of else {}))
    torch.cuda.synchronize()
    return out, lse


@needs_sm90
@pytest.mark.parametrize("qd,page", [("bf16", 64), ("fp16", 256)])
@pytest.mark.parametrize("num_sms", [1, 5])
@pytest.mark.parametrize("s_q", [1, 2])
def test_wg1of_ring_balanced_few_columns_walk_many_items(num_sms, s_q, qd, page):
    """Columns of many items of 0..6 tiles (the producer runs into the next item's tiles 0 / 1 while the phases
    continue): against the reference and the balanced ring without the option; ring 5 and staging bitwise."""
    rng = random.Random()
    lens = [rng.choice([0, 1, 63, 64, 65, 128, 129, 192, 200, 320, 384]) for _ in range(24)]
    case = make_case_fp8(lens, s_q, 64, QT[qd], page, seed=rng.randrange(1 << 30))
    for form in ("even", "balanced"):
        sched, ws = _schedule(case, form, num_sms=num_sms)
        got = _run_bal(case, sched, ws, True, True)
        check(case, *got)
        _close_to_off(got, _run_bal(case, sched, ws, True, False), f"{form} on {num_sms} SMs, s_q {s_q}")
        for ring, stage in ((5, 0), (RING_DEFAULT, STAGE_SLOTS)):
            assert _bitwise(_run_bal(case, sched, ws, True, True, ring, stage), got), (form, ring, stage)


@needs_sm90
@pytest.mark.parametrize("lazy", [True, False], ids=["lazy", "eager"])
@pytest.mark.parametrize("B,s_q,H,kind,S,page,qd,form", [
    (24, 1, 128, "uniform", 4096, 64, "bf16", "auto"),
    (9, 2, 128, "logskew", 4096, 64, "fp16", "balanced"),
    (16, 2, 126, "skewed", 1500, 256, "fp16", "balanced"),
    (100, 2, 64, "short", 64, 64, "bf16", "auto"),
    (40, 1, 128, "varlen", 3000, 64, "bf16", "auto"),
])
def test_wg1of_ring_balanced_against_fp64_reference(B, s_q, H, kind, S, page, qd, form, lazy):
    rng = random.Random()
    case = make_case_fp8(_lengths(kind, B, S, s_q, rng), s_q, H, QT[qd], page, seed=rng.randrange(1 << 30))
    sched, ws = _schedule(case, form)
    got = _run_bal(case, sched, ws, lazy, True)
    check(case, *got)
    _close_to_off(got, _run_bal(case, sched, ws, lazy, False), f"balanced B{B} s_q{s_q} H{H} {kind}")
