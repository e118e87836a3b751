"""GPU tests of the balanced seesaw's ``q_prefetch`` option (``MLADecodePartialWGMMASeesaw(balanced=True,
q_prefetch=True)``, branch q-prefetch, written compile-only): each work item of a CTA column issues the next row's Q
(a TMA load on a fifth mbarrier) and KV tiles 0 / 1 during its own last pairs. Against the fp64 reference of
test_kernel_gpu.py and against the same kernel without the option, which runs the very same arithmetic (the same
tiles in the same order, the same Q bytes: rows past s_q * H zero either way), so bit for bit.

* The smallest cases first (one 1-tile item; two 1-tile items in one column; one column of items of 0..6 tiles): a
  wrong mbarrier parity (KV buffers or Q) or a lost TMA byte count shows as a hang there: run this file under
  `timeout`.
* Fresh random inputs per case, shuffled page tables, NaN in unused pages and page tails (the KV tiles issued for the
  next item: cp.async zero-fills with that item's length, TMA leaves the tail to the next item's own zeroing),
  NaN-poisoned outputs and partial buffers; lengths uniform, variable with 0 and < s_q, skewed, log-skewed, short
  (every item one tile, the next tile 1 issued from the buffer-0 slot), tiny (0..s_q); s_q 1 / 2 / 3, H 16 (48 rows:
  one m-block shorter than the Q box), 64, 128 and 126 (a partial second m-block: the Q box's rows past R
  zero-filled by TMA); pages 64 and 256; bf16 and fp16; cp.async
  and TMA loads; eager and lazy rescale; both plan forms and the hybrid's choice; 1 / 2 / 5-SM schedules whose
  columns walk dozens of items (items of different requests, pieces of one request, several per column); an
  even-form column holding two items of one request (Q kept, tiles still prefetched).
* CUDA graphs: captured at one form, re-planned in place to the other (new lengths), replayed: equal to eager bit for
  bit and to the reference; and through MLADecoder with option q_prefetch=true, bit for bit equal to the default
  decoder (the backend's arm: 16-bit partials, wide stores, TMA, lazy).
Skipped without an sm_90 GPU.

    PYTHONPATH=plugins/cute_dsl_mla:plugins/cute_dsl_mla/tests:. timeout 300 python -m pytest -q -p no:cacheprovider \\
        -rfs plugins/cute_dsl_mla/tests/test_seesaw_qpf_gpu.py
"""

from __future__ import annotations

import random

import pytest
import torch

from graph_replay import graph_replay_equals_eager
from test_kernel_gpu import check
from test_wgmma_t_balanced_gpu import _lengths, _num_sms, _outs, make_case_lens, needs_sm90

pytestmark = pytest.mark.gpu

DT = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _schedule(case, form="auto", num_sms=None):
    from mla_cute_dsl.kernels import alloc_workspace, make_schedule

    B, s_q, H, _ = case["q"].shape
    sched = make_schedule(case["lens_cpu"], s_q, H, num_sms or _num_sms(), balanced=True, form=form, ctas_per_sm=1)
    ws = alloc_workspace(sched)
    for part in ws:  # a partial slot the kernel fails to write must not pass as old memory
        part.fill_(float("nan"))
    return sched, ws


def _run(case, tma, lazy, qpf, form="auto", num_sms=None):
    """One call of the balanced seesaw (q_prefetch on or off) on a fresh schedule and NaN-poisoned buffers."""
    from mla_cute_dsl.kernels.sm90_wgmma_decode import mla_decode_sm90_wgmma_seesaw_balanced

    sched, ws = _schedule(case, form, num_sms)
    out, lse = _outs(case)
    mla_decode_sm90_wgmma_seesaw_balanced(case["q"], case["kv"], case["page_table"], case["lens"], case["sm_scale"],
                                          case["kv_scale"], out, lse, sched, ws, tma=tma, lazy_rescale=lazy,
                                          q_prefetch=qpf)
    torch.cuda.synchronize()
    return out, lse, sched


def _check_both(case, tma, lazy, form="auto", num_sms=None, tol=1e-2):
    """q_prefetch on: against the reference; then off on the same schedule: bit for bit equal."""
    out, lse, sched = _run(case, tma, lazy, True, form, num_sms)
    check(case, out, lse, tol=tol)
    out0, lse0, _ = _run(case, tma, lazy, False, form, num_sms)
    assert torch.equal(out, out0) and torch.equal(lse, lse0), "q_prefetch changed the result"
    return sched


SMALL = [  # label, lengths, s_q, H, SMs for the schedule, form
    ("one 1-tile item", [64], 1, 64, None, "balanced"),
    ("two 1-tile items, 1 column", [64, 64], 1, 64, 1, "even"),
    ("0..6 tiles, 1 column", [0, 64, 128, 192, 256, 320, 384, 1, 65], 1, 64, 1, "even"),
]


@needs_sm90
@pytest.mark.parametrize("tma", [False, True], ids=["cp_async", "tma"])
@pytest.mark.parametrize("label,lens,s_q,H,sms,form", SMALL, ids=[c[0] for c in SMALL])
def test_qpf_smallest_cases_first(label, lens, s_q, H, sms, form, tma):
    case = make_case_lens(lens, s_q, H, torch.bfloat16, 64, seed=random.randrange(1 << 30))
    _check_both(case, tma, True, form, sms)


CASES = [  # B, s_q, H, lengths, S, page, dtype, form, tma, lazy
    (6, 1, 64, "varlen", 1000, 64, "bf16", "balanced", False, False),    # 0, 1, s_q - 1, S mixed in
    (7, 1, 128, "varlen", 2000, 256, "bf16", "balanced", True, True),    # page 256
    (9, 2, 128, "logskew", 4096, 64, "fp16", "even", False, False),      # fp16, even form
    (9, 2, 128, "logskew", 4096, 64, "fp16", "balanced", True, True),
    (24, 1, 128, "uniform", 4096, 64, "bf16", "auto", True, True),       # plans balanced
    (40, 2, 128, "uniform", 2048, 64, "bf16", "auto", False, True),
    (20, 2, 64, "tiny", 8, 64, "bf16", "balanced", True, False),         # lengths 0..s_q (causal rows empty)
    (100, 2, 64, "short", 64, 64, "bf16", "auto", True, True),           # every item one tile, several per column
    (100, 1, 64, "short", 64, 64, "bf16", "auto", False, False),
    (200, 1, 128, "varlen", 600, 64, "bf16", "even", True, True),        # more requests than columns
    (180, 1, 128, "uniform", 800, 64, "bf16", "auto", True, True),       # three items per column
    (16, 1, 126, "varlen", 1500, 64, "bf16", "balanced", True, True),    # 126 rows: a partial second m-block
    (16, 2, 126, "skewed", 1500, 64, "fp16", "balanced", False, False),
    (12, 2, 128, "skewed", 4096, 64, "bf16", "balanced", True, True),    # with q std 100 below
    (8, 3, 16, "varlen", 2000, 64, "bf16", "balanced", True, True),      # 48 rows: the Q box taller than R
    (8, 3, 16, "skewed", 1000, 64, "bf16", "auto", False, False),
]


@needs_sm90
@pytest.mark.parametrize("B,s_q,H,kind,S,page,dtype,form,tma,lazy", CASES)
def test_qpf_against_fp64_reference_and_equal_to_the_option_off(B, s_q, H, kind, S, page, dtype, form, tma, lazy):
    rng = random.Random()
    q_std = 100.0 if (B, kind) == (12, "skewed") else 1.0
    case = make_case_lens(_lengths(kind, B, S, s_q, rng), s_q, H, DT[dtype], page, seed=rng.randrange(1 << 30),
                          q_std=q_std)
    _check_both(case, tma, lazy, form, tol=2e-2 if q_std > 1 else 1e-2)


@needs_sm90
@pytest.mark.parametrize("tma", [False, True], ids=["cp_async", "tma"])
@pytest.mark.parametrize("num_sms", [1, 2, 5])
@pytest.mark.parametrize("s_q,H", [(1, 64), (2, 128)])
def test_qpf_few_columns_walk_many_items(num_sms, s_q, H, tma):
    """Schedules for 1, 2 or 5 SMs: each column walks many items of 0-6 tiles (odd counts, 1-tile items, pieces of
    one request and of several), so Q and the tiles are prefetched across dozens of boundaries of every kind."""
    rng = random.Random()
    lens = [rng.choice([0, 1, 63, 64, 65, 128, 129, 192, 200, 320, 384]) for _ in range(24)]
    case = make_case_lens(lens, s_q, H, torch.bfloat16, 64, seed=rng.randrange(1 << 30))
    for form in ("even", "balanced"):
        sched = _check_both(case, tma, True, form, num_sms)
        ranges = sched.cta_ranges.tolist()
        assert max(ranges[c + 1] - ranges[c] for c in range(sched.num_cols)) > 3


@needs_sm90
@pytest.mark.parametrize("tma", [False, True], ids=["cp_async", "tma"])
def test_qpf_two_items_of_one_request_in_a_column(tma):
    """The even form on 4 columns puts two items of one request in one column: Q is kept (not reloaded, not
    prefetched), its next item's tiles still are."""
    lens = [64, 1500, 700, 0, 65]
    case = make_case_lens(lens, 1, 64, torch.bfloat16, 64, seed=random.randrange(1 << 30))
    sched = _check_both(case, tma, False, "even", 4)
    items, ranges = sched.work_info.tolist(), sched.cta_ranges.tolist()
    assert any(len({items[i][0] for i in range(ranges[c], ranges[c + 1])}) < ranges[c + 1] - ranges[c]
               for c in range(4))


@needs_sm90
@pytest.mark.parametrize("tma", [False, True], ids=["cp_async", "tma"])
@pytest.mark.parametrize("first,second", [("even", "balanced"), ("balanced", "even")])
def test_qpf_graph_replays_the_other_form_equal_to_eager(first, second, tma):
    """Capture with the schedule in one form, re-plan the other form with new lengths into the same buffers (0 and 1
    among them), new q, replay: equal to an eager call bit for bit and to the reference."""
    from mla_cute_dsl.kernels import make_schedule
    from mla_cute_dsl.kernels.sm90_wgmma_decode import mla_decode_sm90_wgmma_seesaw_balanced

    rng = random.Random()
    B, s_q, H, S = 24, 2, 128, 2048
    case = make_case_lens([S] * B, s_q, H, torch.bfloat16, 64, seed=rng.randrange(1 << 30))
    sched, ws = _schedule(case, first)
    out, lse = _outs(case)

    def call():
        mla_decode_sm90_wgmma_seesaw_balanced(case["q"], case["kv"], case["page_table"], case["lens"],
                                              case["sm_scale"], case["kv_scale"], out, lse, sched, ws, tma=tma,
                                              lazy_rescale=True, q_prefetch=True)

    call()  # compiles (or loads) outside the capture

    def refresh():
        new = _lengths("skewed", B, S, s_q, rng)
        new[1], new[2] = 0, 1
        case["lens_cpu"] = torch.tensor(new, dtype=torch.int32)
        case["lens"].copy_(case["lens_cpu"])
        make_schedule(case["lens_cpu"], s_q, H, _num_sms(), out=sched, balanced=True, form=second, ctas_per_sm=1)
        assert sched.form == second
        case["q"].copy_(torch.randn_like(case["q"], dtype=torch.float32).to(case["q"].dtype))

    graph_replay_equals_eager(call, out, lse, refresh=refresh, check=lambda o, l: check(case, o, l), scratch=ws)


@needs_sm90
@pytest.mark.parametrize("s_q,H,B,S", [(1, 128, 40, 1500), (2, 64, 24, 800)])
def test_backend_option_equals_the_default_decoder(s_q, H, B, S):
    """MLADecoder with cute_dsl_mla's q_prefetch=true (the backend's arm of the kernel: 16-bit partials, wide stores,
    TMA, lazy) against the default decoder on the same step: bit for bit equal, and to the fp64 reference."""
    from mlacore import MLADecoder
    from mlacore.problem import DecodeProblem, DeviceSpec
    from mlacore.testing.compare import compare, only_backend_dispatcher, reference_outputs
    from mlacore.testing.inputs import make_inputs

    lens = _lengths("skewed", B, S, s_q, random.Random())
    lens[0] = 0
    problem = DecodeProblem(num_heads=H, seq_len_q=s_q, batch_size=B, max_kv_len=max(lens), min_kv_len=min(lens),
                            page_size=64, q_dtype="bf16", kv_dtype="bf16", device=DeviceSpec.of("cuda"))
    inputs = make_inputs(problem, "cuda", seed=random.randrange(1 << 30), kv_lens=torch.tensor(lens, dtype=torch.int32))
    got = []
    for options in ({"q_prefetch": True}, {}):
        dec = MLADecoder(H, 64, q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16, device="cuda",
                         sm_scale=inputs.sm_scale, kv_scale=inputs.kv_scale,
                         dispatcher=only_backend_dispatcher("cute_dsl_mla", options=options))
        plan = dec.plan(inputs.kv_lens, inputs.page_table, s_q)
        assert plan.backend == "cute_dsl_mla"
        assert plan.planned.run_fn.__name__ == "mla_decode_sm90_wgmma_seesaw_balanced"
        assert getattr(plan.planned.run_fn, "keywords", {}).get("q_prefetch", False) is bool(options)
        out = torch.full((B, s_q, H, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
        lse = torch.full((B, s_q, H), float("nan"), dtype=torch.float32, device="cuda")
        dec.run(inputs.q, inputs.kv_cache, plan, out=out, lse=lse)
        torch.cuda.synchronize()
        got.append((out, lse))
        dec.close()
    (o1, l1), (o0, l0) = got
    res = compare(problem, o1, l1, *reference_outputs(problem, inputs))
    assert res.passed, res.messages
    assert torch.equal(o1, o0) and torch.equal(l1, l0)
