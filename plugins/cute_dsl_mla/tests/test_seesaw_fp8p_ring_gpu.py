"""GPU tests of the fp8 producer's register ring (``MLADecodePartialWGMMASeesaw(fp8_producer=True, fp8p_ring=R)``,
``fp8p_producer_ring``; branch fp8p-inflight, written compile-only: not yet run on a GPU when written).  The ring
changes only when the producer issues its ld.global's (R - 1 chunks ahead) and how it zeroes rows past kv_len (at
issue, in registers, instead of a select after the conversion): the same conversions into the same shared memory,
the same mbarrier protocol, the same math.  So against the one-part producer it is expected BITWISE equal (asserted
separately from the fp64-reference check, so that a failure says which), one item per CTA and balanced.

* one item per CTA: test_seesaw_fp8p_gpu.py's cases (NaN page tails, lengths 0 / 1 / < s_q, H 64 / 126 / 128,
  s_q 1 / 2, bf16 / fp16 q, pages 64 / 128 / 256: items starting inside a page, the ring's (page column, block in
  page) walk), eager and lazy; every tile count 0..10 in one CTA (the ring's prologue, odd / even pair counts and
  its rotation at every pair boundary), graph replay equal to eager;
* balanced: test_seesaw_fp8p_balanced_gpu.py's 1 / 5-SM columns of many items of 0..6 tiles (the ring restarted
  per item while the producer runs into the next item) and the H=128 auto plans;
* both ring sizes the kernel takes (fp8p_ring.RING_SIZES) and the default size with shared-memory staging
  (fp8p_stage: every third chunk by cp.async through shared memory, read back by the same thread); the backend's
  fp8_loader=ring / ring_staged through MLADecoder.
Skipped without an sm_90 GPU.  A hang is a protocol bug: run it under ``timeout`` after
benchmarks/device/fp8_ring_gpu.sh's hang probe.

    PYTHONPATH=plugins/cute_dsl_mla:plugins/cute_dsl_mla/tests:. timeout 300 python -m pytest -q -p no:cacheprovider \\
        -rfs plugins/cute_dsl_mla/tests/test_seesaw_fp8p_ring_gpu.py
"""

from __future__ import annotations

import functools
import random

import pytest
import torch

from graph_replay import fresh_values, graph_replay_equals_eager
from test_kernel_gpu import check, make_case, run_kernel  # same directory (pytest rootdir import)
from test_seesaw_balanced_fp8_gpu import QT, _schedule, make_case_fp8
from test_wgmma_t_balanced_gpu import _lengths, _outs, needs_sm90

from mla_cute_dsl.kernels.fp8p_ring import RING_DEFAULT, RING_SIZES, STAGE_SLOTS

pytestmark = pytest.mark.gpu


def _decode(ring, lazy, stage=0):
    """The even seesaw entry with the producer warpgroup, with the ring (ring > 0; ``stage``: its shared-memory
    staging) or the one-part producer."""
    from mla_cute_dsl.kernels.sm90_wgmma_decode import mla_decode_sm90_wgmma_seesaw

    return functools.partial(mla_decode_sm90_wgmma_seesaw, fp8_producer=True, lazy_rescale=lazy,
                             **({"fp8p_ring": ring} if ring else {}), **({"fp8p_stage": stage} if stage else {}))


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
    return torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


CASES = [  # (B, s_q, S, H, varlen, page, q dtype)
    (1, 1, 64, 64, False, 64, "bf16"),      # one tile, one item: the smallest case, run first
    (1, 1, 4096, 128, False, 64, "bf16"),   # many splits: items of 1-2 tiles on every SM, then the combine
    (2, 1, 140, 128, True, 64, "bf16"),     # a tail tile (NaN page tail), varlen
    (6, 2, 140, 126, True, 64, "bf16"),     # R = 252, lengths 0 / 1 (< s_q)
    (2, 2, 4096, 128, False, 64, "bf16"),   # s_q = 2
    (3, 2, 1000, 128, True, 256, "bf16"),   # page 256: 4 blocks per page, NaN tails inside pages
    (1, 1, 4096, 128, False, 256, "bf16"),  # page 256, many splits: items starting inside a page
    (2, 1, 3000, 128, False, 128, "fp16"),  # page 128 (2 blocks per page), fp16 q, split items
    (16, 1, 4096, 128, False, 64, "bf16"),  # the H=128 bench shape, smaller batch
    (6, 2, 333, 64, True, 256, "fp16"),     # fp16 q, s_q 2, page 256, lengths 0 / 1
]


# (ring, staging, lazy): the default size eager and lazy, every other size lazy (the backend's rescale), the default
# size with shared-memory staging eager and lazy
RING_ARMS = ([(RING_DEFAULT, 0, False)] + [(r, 0, True) for r in RING_SIZES]
             + [(RING_DEFAULT, STAGE_SLOTS, False), (RING_DEFAULT, STAGE_SLOTS, True)])
ARM_IDS = [f"r{r}{f's{st}' if st else ''}-{'lazy' if z else 'eager'}" for r, st, z in RING_ARMS]
# (ring, staging) for the tests that run one rescale mode
RINGS = [(r, 0) for r in RING_SIZES] + [(RING_DEFAULT, STAGE_SLOTS)]
RING_IDS = [f"r{r}{f's{st}' if st else ''}" for r, st in RINGS]


@needs_sm90
@pytest.mark.parametrize("ring,stage,lazy", RING_ARMS, ids=ARM_IDS)
@pytest.mark.parametrize("B,s_q,S,H,varlen,page,q_dtype", CASES)
def test_ring_against_fp64_reference_and_the_one_part_producer(B, s_q, S, H, varlen, page, q_dtype, lazy, ring,
                                                               stage):
    case = _case(B, s_q, H, S, varlen, page, q_dtype)
    got = _run(case, _decode(ring, lazy, stage))
    check(case, *got)
    ref = _run(case, _decode(0, lazy))
    d = (got[0].double() - ref[0].double()).norm() / ref[0].double().norm().clamp_min(1e-30)
    assert d < 1e-3, f"ring {ring} against the one-part producer: rel diff {d:.3e}"
    assert _bitwise(got, ref), f"ring {ring}: close to the one-part producer (rel {d:.1e}) but not bitwise equal"


@needs_sm90
@pytest.mark.parametrize("ring,stage", RINGS, ids=RING_IDS)
@pytest.mark.parametrize("s_q,H,q_dtype,page", [(1, 128, "bf16", 64), (2, 64, "fp16", 64), (2, 126, "bf16", 256),
                                                (1, 128, "fp16", 128)])
def test_ring_whole_requests_every_tile_count(s_q, H, q_dtype, page, ring, stage):
    """One item per request (a 1-SM schedule): items of 0..10 tiles in one CTA, odd and even (the last pair
    without a buffer-1 tile), the ring's rotation at every pair boundary, partial last tiles with NaN tails."""
    from mla_cute_dsl.kernels import alloc_workspace, make_schedule

    case = _case(14, s_q, H, 640, True, page, q_dtype)
    sched = make_schedule(case["lens_cpu"], s_q, H, 1)
    ws = alloc_workspace(sched)
    got = _run(case, _decode(ring, True, stage), sched, ws)
    check(case, *got)
    assert _bitwise(got, _run(case, _decode(0, True), sched, ws))


@needs_sm90
@pytest.mark.parametrize("q_dtype", ["bf16", "fp16"])
def test_ring_large_magnitude_q(q_dtype):
    case = _case(4, 1, 128, 2000, varlen=False, q_dtype=q_dtype, q_std=100.0)
    for lazy in (False, True):
        for stage in (0, STAGE_SLOTS):
            check(case, *_run(case, _decode(RING_DEFAULT, lazy, stage)), tol=2e-2)


@needs_sm90
@pytest.mark.parametrize("stage", [0, STAGE_SLOTS])
@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_ring_graph_replay_equals_eager(lazy, stage):
    from mla_cute_dsl.kernels import alloc_workspace, make_schedule

    case = _case(6, 2, 64, 1000, varlen=True)
    q = case["q"]
    out, lse = _outs(case)
    n_sm = torch.cuda.get_device_properties(0).multi_processor_count
    sched = make_schedule(case["lens_cpu"], 2, 64, n_sm)
    ws = alloc_workspace(sched)
    decode = _decode(RING_DEFAULT, lazy, stage)

    def call():
        decode(q, case["kv"], case["page_table"], case["lens"], case["sm_scale"], case["kv_scale"], out, lse, sched,
               ws)

    call()  # compile / load outside the capture
    graph_replay_equals_eager(call, out, lse, refresh=lambda: fresh_values(q), check=lambda o, l: check(case, o, l),
                              scratch=ws)


# ---- balanced (kernel_fp8p_balanced with the ring) -----------------------------------------------------------


def _run_bal(case, sched, ws, lazy, ring, stage=0):
    from mla_cute_dsl.kernels.sm90_wgmma_decode import mla_decode_sm90_wgmma_seesaw_balanced

    for part in ws:
        part.fill_(float("nan"))
    out, lse = _outs(case)
    mla_decode_sm90_wgmma_seesaw_balanced(case["q"], case["kv"], case["page_table"], case["lens"], case["sm_scale"],
                                          case["kv_scale"], out, lse, sched, ws, lazy_rescale=lazy,
                                          fp8_producer=True, **({"fp8p_ring": ring} if ring else {}),
                                          **({"fp8p_stage": stage} if stage else {}))
    torch.cuda.synchronize()
    return out, lse


@needs_sm90
@pytest.mark.parametrize("ring,stage", RINGS, ids=RING_IDS)
@pytest.mark.parametrize("qd,page", [("bf16", 64), ("fp16", 256)])
@pytest.mark.parametrize("num_sms", [1, 5])
@pytest.mark.parametrize("s_q", [1, 2])
def test_ring_balanced_few_columns_walk_many_items(num_sms, s_q, qd, page, ring, stage):
    """Columns of many items of 0..6 tiles: the ring restarts per item while the phases continue; bitwise equal to
    the balanced one-part producer on the same schedule."""
    rng = random.Random()
    lens = [rng.choice([0, 1, 63, 64, 65, 128, 129, 192, 200, 320, 384]) for _ in range(24)]
    case = make_case_fp8(lens, s_q, 64, QT[qd], page, seed=rng.randrange(1 << 30))
    for form in ("even", "balanced"):
        sched, ws = _schedule(case, form, num_sms=num_sms)
        got = _run_bal(case, sched, ws, True, ring, stage)
        check(case, *got)
        assert _bitwise(got, _run_bal(case, sched, ws, True, 0)), f"{form}: not bitwise equal to the producer"


@needs_sm90
@pytest.mark.parametrize("stage", [0, STAGE_SLOTS])
@pytest.mark.parametrize("lazy", [False, True])
@pytest.mark.parametrize("B,s_q,H,kind,S,page,qd,form", [
    (24, 1, 128, "uniform", 4096, 64, "bf16", "auto"),
    (40, 1, 128, "uniform", 4096, 64, "bf16", "auto"),
    (9, 2, 128, "logskew", 4096, 64, "fp16", "balanced"),
    (16, 2, 126, "skewed", 1500, 256, "fp16", "balanced"),
    (100, 2, 64, "short", 64, 64, "bf16", "auto"),
])
def test_ring_balanced_against_fp64_reference(B, s_q, H, kind, S, page, qd, form, lazy, stage):
    rng = random.Random()
    case = make_case_fp8(_lengths(kind, B, S, s_q, rng), s_q, H, QT[qd], page, seed=rng.randrange(1 << 30))
    sched, ws = _schedule(case, form)
    got = _run_bal(case, sched, ws, lazy, RING_DEFAULT, stage)
    check(case, *got)
    assert _bitwise(got, _run_bal(case, sched, ws, lazy, 0))


@needs_sm90
@pytest.mark.parametrize("loader", ["ring", "ring_staged"])
def test_backend_fp8_loader_ring(monkeypatch, loader):
    """MLADecoder (cute_dsl_mla only) with fp8_loader=ring / ring_staged at H=128 fp8: the plan's entry gets
    fp8p_ring (and fp8p_stage); the result matches the reference."""
    from mla_cute_dsl import backend as be
    from mlacore import MLADecoder
    from mlacore.problem import DecodeProblem, DeviceSpec
    from mlacore.testing.compare import compare, only_backend_dispatcher, reference_outputs
    from mlacore.testing.inputs import make_inputs

    monkeypatch.setattr(be, "FP8_SEESAW_BALANCED", True)
    monkeypatch.setattr(be, "FP8_BALANCED_PRODUCER", True)
    lens = [4096] * 24 + [1, 0, 700]
    problem = DecodeProblem(num_heads=128, seq_len_q=1, batch_size=len(lens), max_kv_len=max(lens),
                            min_kv_len=min(lens), page_size=64, q_dtype="bf16", kv_dtype="fp8_e4m3",
                            device=DeviceSpec.of("cuda"))
    inputs = make_inputs(problem, "cuda", seed=random.randrange(1 << 20), kv_lens=torch.tensor(lens, dtype=torch.int32))
    with MLADecoder(128, 64, q_dtype=torch.bfloat16, kv_dtype=torch.float8_e4m3fn, device="cuda",
                    sm_scale=inputs.sm_scale, kv_scale=inputs.kv_scale,
                    dispatcher=only_backend_dispatcher("cute_dsl_mla", options={"fp8_loader": loader})) as dec:
        plan = dec.plan(inputs.kv_lens, inputs.page_table, 1)
        assert plan.planned.run_fn.keywords.get("fp8p_ring") == RING_DEFAULT
        assert plan.planned.run_fn.keywords.get("fp8p_stage", 0) == (STAGE_SLOTS if loader == "ring_staged" else 0)
        out = torch.full((len(lens), 1, 128, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
        lse = torch.full((len(lens), 1, 128), float("nan"), dtype=torch.float32, device="cuda")
        dec.run(inputs.q, inputs.kv_cache, plan, out=out, lse=lse)
        torch.cuda.synchronize()
    res = compare(problem, out, lse, *reference_outputs(problem, inputs))
    assert res.passed, res.messages
