"""GPU tests of the balanced fp8 seesaw with the producer warpgroup (branch fp8-balanced-producer:
sm90_wgmma_decode.mla_decode_sm90_wgmma_seesaw_balanced(..., fp8_producer=True), MLADecodePartialWGMMASeesaw(
balanced=True, fp8_producer=True), ``kernel_fp8p_balanced``: 384 threads, the producer warpgroup and the math
warpgroups each walking the CTA column's items with the full / empty mbarrier phases continued across items) + the
combine, against the fp64 reference of test_kernel_gpu.py.  Written on a CPU machine (compile-checked only): not yet
run on a GPU when written.

* The smallest case first (one 64-token request; a wrong parity across items or a lost release shows as a HANG:
  run this file under `timeout`, after benchmarks/device/fp8_balanced_producer_gpu.sh's hang probe).
* test_seesaw_balanced_fp8_gpu.py's inputs (fresh per case, shuffled pages, e4m3 NaN page tails and spare pages,
  kv_scale 0.37, NaN-poisoned outputs and partial buffers): lengths 0 and < s_q, uniform, varlen, skewed, short,
  tiny; s_q 1 / 2; H 64 / 128 / 126; pages 64 / 256; bf16 and fp16 q; eager and lazy rescale; both plan forms and
  the hybrid's choice; 1 / 2 / 5-SM schedules whose columns walk many items of 0-6 tiles (Q reloaded at each request
  change, the producer running into the next item).
* Against the even fp8 seesaw with the producer (one CTA per plan_items item): the even form runs the same items
  with the same arithmetic (asserted within 1e-3), the balanced form close (1e-2); and against the inline balanced
  fp8 seesaw on the same schedule (1e-3).
* CUDA graph: captured at one forced form, re-planned in place to the other, replayed: equal to eager bit for bit.
* Through the backend with FP8_SEESAW_BALANCED on and FP8_BALANCED_PRODUCER monkeypatched both ways.
Skipped without an sm_90 GPU.

    PYTHONPATH=plugins/cute_dsl_mla:plugins/cute_dsl_mla/tests:. timeout 420 python -m pytest -q -p no:cacheprovider \\
        -rfs plugins/cute_dsl_mla/tests/test_seesaw_fp8p_balanced_gpu.py
"""

from __future__ import annotations

import functools
import random

import pytest
import torch

from test_kernel_gpu import check
from test_seesaw_balanced_fp8_gpu import QT, make_case_fp8
from test_seesaw_balanced_gpu import (MANY_ITEM_LENGTHS, _graph_replays_the_other_form, _schedule,
                                      _two_items_of_one_request_in_a_column, _walk_many_items)
from test_wgmma_t_balanced_gpu import _lengths, _num_sms, _outs, needs_sm90

pytestmark = pytest.mark.gpu


def run_bal_p(case, out, lse, sched, ws, lazy, producer=True):
    from mla_cute_dsl.kernels.sm90_wgmma_decode import mla_decode_sm90_wgmma_seesaw_balanced

    assert case["kv"].dtype == torch.float8_e4m3fn
    mla_decode_sm90_wgmma_seesaw_balanced(case["q"], case["kv"], case["page_table"], case["lens"], case["sm_scale"],
                                          case["kv_scale"], out, lse, sched, ws, lazy_rescale=lazy,
                                          fp8_producer=producer)


CASES = [  # B, s_q, H, lengths, S, page, q dtype, form, lazy
    (1, 1, 64, "uniform", 64, 64, "bf16", "balanced", True),      # smallest: one 1-tile item (a hang shows here)
    (1, 1, 64, "uniform", 64, 64, "bf16", "balanced", False),
    (1, 1, 128, "uniform", 200, 64, "bf16", "balanced", True),    # 4 tiles, a partial last one
    (6, 1, 64, "varlen", 1000, 64, "bf16", "balanced", True),     # 0, 1, s_q - 1, S mixed in
    (7, 1, 128, "varlen", 2000, 256, "bf16", "balanced", False),  # page 256
    (9, 2, 128, "logskew", 4096, 64, "fp16", "even", True),       # fp16 q, even form
    (9, 2, 128, "logskew", 4096, 64, "fp16", "balanced", False),
    (24, 1, 128, "uniform", 4096, 64, "bf16", "auto", True),      # plans balanced (wave quantization)
    (40, 1, 128, "uniform", 4096, 64, "bf16", "auto", True),
    (48, 2, 128, "uniform", 4096, 64, "bf16", "auto", True),
    (20, 2, 64, "tiny", 8, 64, "bf16", "balanced", True),         # lengths 0..s_q (causal rows empty)
    (3, 1, 128, "uniform", 4096, 256, "fp16", "balanced", True),  # 3 requests over many columns
    (100, 2, 64, "short", 64, 64, "bf16", "auto", True),          # every item one tile, several per column
    (2, 1, 128, "uniform", 1, 64, "bf16", "auto", False),         # 2 one-token items, empty columns
    (200, 1, 128, "varlen", 600, 64, "bf16", "even", True),       # more requests than columns
    (16, 1, 126, "varlen", 1500, 64, "bf16", "balanced", True),   # 126 rows: a partial second m-block
    (16, 2, 126, "skewed", 1500, 256, "fp16", "balanced", False),
]


@needs_sm90
@pytest.mark.parametrize("B,s_q,H,kind,S,page,qd,form,lazy", CASES)
def test_fp8p_balanced_against_fp64_reference(B, s_q, H, kind, S, page, qd, form, lazy):
    rng = random.Random()
    case = make_case_fp8(_lengths(kind, B, S, s_q, rng), s_q, H, QT[qd], page, seed=rng.randrange(1 << 30))
    sched, ws = _schedule(case, form)
    assert sched.block_m == 64
    out, lse = _outs(case)
    run_bal_p(case, out, lse, sched, ws, lazy)
    torch.cuda.synchronize()
    check(case, out, lse)


@needs_sm90
@pytest.mark.parametrize("qd", ["bf16", "fp16"])
@pytest.mark.parametrize("num_sms", [1, 2, 5])
@pytest.mark.parametrize("s_q", [1, 2])
def test_fp8p_balanced_few_columns_walk_many_items(num_sms, s_q, qd):
    """Schedules for 1, 2 or 5 SMs at H=64: each column walks many items of 0-6 tiles (odd counts, 1-tile items,
    several requests: Q reloaded at each request change), so the full / empty phases run across dozens of item
    boundaries with the producer running ahead into the next item (a hang here is a parity or a lost release)."""
    rng = random.Random()
    lens = [rng.choice(MANY_ITEM_LENGTHS) for _ in range(24)]
    case = make_case_fp8(lens, s_q, 64, QT[qd], 64, seed=rng.randrange(1 << 30))
    _walk_many_items(case, num_sms, functools.partial(run_bal_p, lazy=True))


@needs_sm90
def test_fp8p_balanced_two_items_of_one_request_in_a_column():
    """Two items of one request in one column (Q kept, not reloaded; row state reset, two partial slots)."""
    _two_items_of_one_request_in_a_column(make_case_fp8, functools.partial(run_bal_p, lazy=False))


@needs_sm90
@pytest.mark.parametrize("lazy", [False, True])
@pytest.mark.parametrize("s_q,H,kind,qd", [(1, 128, "uniform", "bf16"), (2, 128, "skewed", "bf16"),
                                           (1, 64, "varlen", "fp16"), (2, 126, "varlen", "bf16")])
def test_fp8p_balanced_close_to_the_even_fp8p_seesaw_and_the_inline_balanced_one(s_q, H, kind, qd, lazy):
    from mla_cute_dsl.kernels import alloc_workspace, make_schedule
    from mla_cute_dsl.kernels.sm90_wgmma_decode import mla_decode_sm90_wgmma_seesaw

    rng = random.Random()
    case = make_case_fp8(_lengths(kind, 24, 4096, s_q, rng), s_q, H, QT[qd], 64, seed=rng.randrange(1 << 30))
    even_sched = make_schedule(case["lens_cpu"], s_q, H, _num_sms(), ctas_per_sm=1)
    even_ws = alloc_workspace(even_sched)
    o_even, l_even = _outs(case)
    mla_decode_sm90_wgmma_seesaw(case["q"], case["kv"], case["page_table"], case["lens"], case["sm_scale"],
                                 case["kv_scale"], o_even, l_even, even_sched, even_ws, lazy_rescale=lazy,
                                 fp8_producer=True)
    torch.cuda.synchronize()
    check(case, o_even, l_even)
    fin = torch.isfinite(l_even)
    for form, tol in (("even", 1e-3), ("balanced", 1e-2)):
        sched, ws = _schedule(case, form)
        o, l = _outs(case)
        run_bal_p(case, o, l, sched, ws, lazy)
        torch.cuda.synchronize()
        check(case, o, l)
        d = (o.double() - o_even.double()).norm() / o_even.double().norm().clamp_min(1e-30)
        print(f"{form} form vs the even fp8p seesaw: rel diff {d:.3e}, bitwise equal {torch.equal(o, o_even)}")
        assert d < tol, f"{form} form: rel diff vs the even fp8p seesaw {d:.3e}"
        assert torch.equal(fin, torch.isfinite(l)) and (l[fin] - l_even[fin]).abs().max() < tol
        o_in, l_in = _outs(case)
        sched_in, ws_in = _schedule(case, form)
        run_bal_p(case, o_in, l_in, sched_in, ws_in, lazy, producer=False)  # the inline balanced fp8 seesaw
        torch.cuda.synchronize()
        d = (o.double() - o_in.double()).norm() / o_in.double().norm().clamp_min(1e-30)
        assert d < 1e-3, f"{form} form: rel diff vs the inline balanced fp8 seesaw {d:.3e}"


@needs_sm90
@pytest.mark.parametrize("lazy", [False, True])
@pytest.mark.parametrize("first,second", [("even", "balanced"), ("balanced", "even")])
def test_fp8p_balanced_graph_replays_the_other_form_equal_to_eager(first, second, lazy):
    rng = random.Random()
    case = make_case_fp8([2048] * 24, 2, 128, torch.bfloat16, 64, seed=rng.randrange(1 << 30))
    _graph_replays_the_other_form(case, first, second, functools.partial(run_bal_p, lazy=lazy), rng)


@needs_sm90
@pytest.mark.parametrize("producer_flag", [False, True])
def test_backend_balanced_fp8_takes_the_producer_only_with_the_flag(producer_flag, monkeypatch):
    """MLADecoder (cute_dsl_mla only, seesaw_split=balanced) with an fp8 cache at H=128 and FP8_SEESAW_BALANCED on:
    fp8_producer=True reaches the balanced entry only with FP8_BALANCED_PRODUCER; both equal to the reference."""
    from mla_cute_dsl import backend as be
    from mlacore import MLADecoder
    from mlacore.problem import DecodeProblem, DeviceSpec
    from mlacore.testing.compare import compare, only_backend_dispatcher, reference_outputs
    from mlacore.testing.inputs import make_inputs

    monkeypatch.setattr(be, "FP8_SEESAW_BALANCED", True)
    monkeypatch.setattr(be, "FP8_BALANCED_PRODUCER", producer_flag)
    lens = [4096] * 24 + [1, 0, 700]
    problem = DecodeProblem(num_heads=128, seq_len_q=1, batch_size=len(lens), max_kv_len=max(lens),
                            min_kv_len=min(lens), page_size=64, q_dtype="bf16", kv_dtype="fp8_e4m3",
                            device=DeviceSpec.of("cuda"))
    inputs = make_inputs(problem, "cuda", seed=random.randrange(1 << 20), kv_lens=torch.tensor(lens, dtype=torch.int32))
    with MLADecoder(128, 64, q_dtype=torch.bfloat16, kv_dtype=torch.float8_e4m3fn, device="cuda",
                    sm_scale=inputs.sm_scale, kv_scale=inputs.kv_scale,
                    dispatcher=only_backend_dispatcher("cute_dsl_mla", options={"seesaw_split": "balanced"})) as dec:
        plan = dec.plan(inputs.kv_lens, inputs.page_table, 1)
        assert plan.planned.run_fn.__name__ == "mla_decode_sm90_wgmma_seesaw_balanced"
        assert plan.planned.run_fn.keywords.get("fp8_producer", False) is producer_flag
        out = torch.full((len(lens), 1, 128, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
        lse = torch.full((len(lens), 1, 128), float("nan"), dtype=torch.float32, device="cuda")
        dec.run(inputs.q, inputs.kv_cache, plan, out=out, lse=lse)
        torch.cuda.synchronize()
    res = compare(problem, out, lse, *reference_outputs(problem, inputs))
    assert res.passed, res.messages
