"""GPU tests of the balanced seesaw kernel (sm90_wgmma_decode.mla_decode_sm90_wgmma_seesaw_balanced:
MLADecodePartialWGMMASeesaw(balanced=True), a fixed grid of (m-blocks, 132 / m-blocks) CTA columns each walking its
items of a make_schedule(..., balanced=True) schedule) + the combine, against the fp64 reference of
test_kernel_gpu.py.  Written on a CPU machine (branch seesaw-balanced); 45 passed on an H200 in the seventeenth session.

* The smallest case first (one 64-token request: a wrong mbarrier parity across items or a lost arrive shows as a
  hang there; run this file under `timeout`).
* Fresh random inputs per case, shuffled page tables, NaN in unused pages and page tails, NaN-poisoned outputs and
  partial buffers; lengths uniform, variable with 0 and < s_q, skewed, log-skewed, short (every item one tile),
  tiny (0..s_q); s_q 1 / 2 / 4, H 64 / 128 and 126 (odd rows, a partial m-block); pages 64 and 256; bf16 and fp16;
  cp.async and TMA loads; both plan forms forced and the hybrid's own choice; columns spanning several requests,
  empty columns, more requests than columns; 1 / 2 / 5-SM schedules whose columns walk dozens of items of odd tile
  counts; an even-form column holding two items of one request.
* Equality with the even seesaw kernel: the even form runs exactly plan_items' items (same items, slots and
  arithmetic per item), so bit for bit; the balanced form splits differently, so close.
* CUDA graphs: kernel level (captured at one forced form, re-planned in place to the other, replayed: equal to
  eager bit for bit and to the reference) and through MLADecoder with seesaw_split=balanced.
Skipped without an sm_90 GPU.

    PYTHONPATH=plugins/cute_dsl_mla:. timeout 240 python -m pytest -q -p no:cacheprovider -rfs \\
        plugins/cute_dsl_mla/tests/test_seesaw_balanced_gpu.py
"""

from __future__ import annotations

import functools
import random

import pytest
import torch

from graph_replay import fresh_values, graph_replay_equals_eager
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


def run_bal(case, out, lse, sched, ws, tma):
    from mla_cute_dsl.kernels.sm90_wgmma_decode import mla_decode_sm90_wgmma_seesaw_balanced

    mla_decode_sm90_wgmma_seesaw_balanced(case["q"], case["kv"], case["page_table"], case["lens"], case["sm_scale"],
                                          case["kv_scale"], out, lse, sched, ws, tma=tma)


def _cols(sched):
    return -(-sched.rows // 64), _num_sms() // -(-sched.rows // 64)


# ---- scaffolding shared with the fp8 balanced seesaw's GPU tests (test_seesaw_balanced_fp8_gpu.py,
# test_seesaw_fp8p_balanced_gpu.py): ``run(case, out, lse, sched, ws)`` runs the kernel under test

MANY_ITEM_LENGTHS = (0, 1, 63, 64, 65, 128, 129, 192, 200, 320, 384)  # items of 0-6 tiles: odd counts, 1-tile ones


def _walk_many_items(case, num_sms, run, num_cols=None):
    """Both plan forms on a ``num_sms``-SM schedule whose busiest column walks more than 3 items: equal to the
    reference.  ``num_cols``: the column count the schedule must have (None: not checked)."""
    for form in ("even", "balanced"):
        sched, ws = _schedule(case, form, num_sms=num_sms)
        if num_cols is not None:
            assert sched.num_cols == num_cols
        ranges = sched.cta_ranges.tolist()
        assert max(ranges[c + 1] - ranges[c] for c in range(sched.num_cols)) > 3
        out, lse = _outs(case)
        run(case, out, lse, sched, ws)
        torch.cuda.synchronize()
        check(case, out, lse)


def _two_items_of_one_request_in_a_column(make_case, run):
    """The even form on 4 columns puts two items of one request in one column (``make_case``: the file's case
    maker, bf16 q): equal to the reference."""
    lens = [64, 1500, 700, 0, 65]
    case = make_case(lens, 1, 64, torch.bfloat16, 64, seed=random.randrange(1 << 30))
    sched, ws = _schedule(case, "even", num_sms=4)
    items, ranges = sched.work_info.tolist(), sched.cta_ranges.tolist()
    assert any(len({items[i][0] for i in range(ranges[c], ranges[c + 1])}) < ranges[c + 1] - ranges[c]
               for c in range(4))
    out, lse = _outs(case)
    run(case, out, lse, sched, ws)
    torch.cuda.synchronize()
    check(case, out, lse)


def _graph_replays_the_other_form(case, first, second, run, rng):
    """Kernel level: capture ``run`` with the schedule in one (forced) form, re-plan the other form with new
    lengths into the same buffers (skewed, each at most the old, so the rows read are not poisoned; one request
    empty, one of one token), new q, replay: equal to an eager call bit for bit and to the reference
    (graph_replay_equals_eager).  ``case``: every request of the same length."""
    from mla_cute_dsl.kernels import make_schedule

    B, s_q, H, _ = case["q"].shape
    S = int(case["lens_cpu"].max())
    sched, ws = _schedule(case, first)
    out, lse = _outs(case)
    run(case, out, lse, sched, ws)  # warm up (compile) outside the capture

    def replan():
        new = _lengths("skewed", B, S, s_q, rng)
        new[1], new[2] = 0, 1
        case["lens_cpu"] = torch.tensor(new, dtype=torch.int32)
        case["lens"].copy_(case["lens_cpu"])
        make_schedule(case["lens_cpu"], s_q, H, _num_sms(), out=sched, balanced=True, form=second, ctas_per_sm=1)
        assert sched.form == second
        fresh_values(case["q"])

    graph_replay_equals_eager(lambda: run(case, out, lse, sched, ws), out, lse, refresh=replan,
                              check=lambda o, l: check(case, o, l), scratch=ws)


CASES = [  # B, s_q, H, lengths, S, page, dtype, form, tma
    (1, 1, 64, "uniform", 64, 64, "bf16", "balanced", False),     # smallest: one 1-tile item (a hang shows here)
    (1, 1, 64, "uniform", 64, 64, "bf16", "balanced", True),
    (6, 1, 64, "varlen", 1000, 64, "bf16", "balanced", False),    # 0, 1, s_q - 1, S mixed in
    (7, 1, 128, "varlen", 2000, 256, "bf16", "balanced", True),   # page 256
    (9, 2, 128, "logskew", 4096, 64, "fp16", "even", False),      # fp16, even form
    (9, 2, 128, "logskew", 4096, 64, "fp16", "balanced", True),
    (24, 1, 128, "uniform", 4096, 64, "bf16", "auto", False),     # plans balanced (wave quantization)
    (40, 2, 128, "uniform", 4096, 64, "bf16", "auto", True),      # plans balanced
    (32, 4, 128, "skewed", 2048, 64, "bf16", "balanced", True),   # s_q 4: 8 m-blocks, 16 columns
    (20, 4, 64, "tiny", 8, 64, "bf16", "balanced", False),        # lengths 0..s_q (causal rows empty)
    (3, 1, 128, "uniform", 4096, 256, "fp16", "balanced", True),  # 3 requests over 66 columns
    (100, 2, 64, "short", 64, 64, "bf16", "auto", False),         # every item one tile, several per column
    (2, 1, 128, "uniform", 1, 64, "bf16", "auto", True),          # 2 one-token items, empty columns
    (200, 1, 128, "varlen", 600, 64, "bf16", "even", True),       # more requests than columns
    (16, 1, 126, "varlen", 1500, 64, "bf16", "balanced", False),  # 126 rows: a partial second m-block
    (16, 2, 126, "skewed", 1500, 64, "bf16", "balanced", True),
]


@needs_sm90
@pytest.mark.parametrize("B,s_q,H,kind,S,page,dtype,form,tma", CASES)
def test_seesaw_balanced_against_fp64_reference(B, s_q, H, kind, S, page, dtype, form, tma):
    rng = random.Random()
    case = make_case_lens(_lengths(kind, B, S, s_q, rng), s_q, H, DT[dtype], page, seed=rng.randrange(1 << 30))
    sched, ws = _schedule(case, form)
    m_blocks, cols = _cols(sched)
    assert sched.block_m == 64 and sched.num_cols == cols
    out, lse = _outs(case)
    run_bal(case, out, lse, sched, ws, tma)
    torch.cuda.synchronize()
    check(case, out, lse)


@needs_sm90
@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("num_sms", [1, 2, 5])
@pytest.mark.parametrize("s_q", [1, 2])
def test_seesaw_balanced_few_columns_walk_many_items(num_sms, s_q, tma):
    """Schedules for 1, 2 or 5 SMs at H=64: each column walks many items of 0-6 tiles (odd counts, 1-tile items,
    several requests), so the mbarrier phases run across dozens of item boundaries (a hang here is a parity)."""
    rng = random.Random()
    lens = [rng.choice(MANY_ITEM_LENGTHS) for _ in range(24)]
    case = make_case_lens(lens, s_q, 64, torch.bfloat16, 64, seed=rng.randrange(1 << 30))
    _walk_many_items(case, num_sms, functools.partial(run_bal, tma=tma), num_cols=max(1, num_sms // s_q))


@needs_sm90
@pytest.mark.parametrize("tma", [False, True])
def test_seesaw_balanced_two_items_of_one_request_in_a_column(tma):
    """The even form on 4 columns puts two items of one request in one column (Q kept, row state reset, two
    partial slots meeting in the combine)."""
    _two_items_of_one_request_in_a_column(make_case_lens, functools.partial(run_bal, tma=tma))


@needs_sm90
@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("s_q,H,kind", [(1, 128, "uniform"), (2, 128, "skewed"), (1, 64, "varlen"),
                                        (2, 126, "varlen")])
def test_seesaw_balanced_equals_the_even_seesaw(s_q, H, kind, tma):
    """Same inputs through the even seesaw kernel (one CTA per plan_items item) and the balanced one: the even
    form runs the very same items (bit for bit equal), the balanced form other splits (close)."""
    from mla_cute_dsl.kernels import alloc_workspace, make_schedule
    from mla_cute_dsl.kernels.sm90_wgmma_decode import mla_decode_sm90_wgmma_seesaw

    rng = random.Random()
    lens = _lengths(kind, 24, 4096, s_q, rng)
    case = make_case_lens(lens, s_q, H, torch.bfloat16, 64, seed=rng.randrange(1 << 30))
    even_sched = make_schedule(case["lens_cpu"], s_q, H, _num_sms(), ctas_per_sm=1)
    even_ws = alloc_workspace(even_sched)
    o_even, l_even = _outs(case)
    mla_decode_sm90_wgmma_seesaw(case["q"], case["kv"], case["page_table"], case["lens"], case["sm_scale"], 1.0,
                                 o_even, l_even, even_sched, even_ws, tma=tma)
    torch.cuda.synchronize()
    check(case, o_even, l_even)
    sched, ws = _schedule(case, "even")
    o, l = _outs(case)
    run_bal(case, o, l, sched, ws, tma)
    torch.cuda.synchronize()
    assert torch.equal(o, o_even) and torch.equal(l, l_even), "even form differs from the even seesaw"
    sched, ws = _schedule(case, "balanced")
    o, l = _outs(case)
    run_bal(case, o, l, sched, ws, tma)
    torch.cuda.synchronize()
    check(case, o, l)
    d = (o.double() - o_even.double()).norm() / o_even.double().norm().clamp_min(1e-30)
    assert d < 1e-2, f"rel diff vs the even seesaw {d:.3e}"
    fin = torch.isfinite(l_even)
    assert torch.equal(fin, torch.isfinite(l)) and (l[fin] - l_even[fin]).abs().max() < 1e-2


@needs_sm90
def test_seesaw_balanced_large_magnitude_q():
    rng = random.Random()
    case = make_case_lens(_lengths("skewed", 16, 4096, 2, rng), 2, 128, torch.bfloat16, 64,
                          seed=rng.randrange(1 << 30), q_std=100.0)
    sched, ws = _schedule(case, "balanced")
    out, lse = _outs(case)
    run_bal(case, out, lse, sched, ws, True)
    torch.cuda.synchronize()
    check(case, out, lse, tol=2e-2)


@needs_sm90
@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("first,second", [("even", "balanced"), ("balanced", "even")])
def test_seesaw_balanced_graph_replays_the_other_form_equal_to_eager(first, second, tma):
    """Kernel level: capture with the schedule in one (forced) form, re-plan the other form with new lengths
    into the same buffers, replay: equal to an eager call bit for bit and to the reference."""
    rng = random.Random()
    case = make_case_lens([2048] * 24, 2, 128, torch.bfloat16, 64, seed=rng.randrange(1 << 30))
    _graph_replays_the_other_form(case, first, second, functools.partial(run_bal, tma=tma), rng)


# ---- through the backend: option seesaw_split=balanced (the default since 0.2.13) ----


def _backend_problem(lens, s_q, H=128):
    from mlacore.problem import DecodeProblem, DeviceSpec

    return DecodeProblem(num_heads=H, seq_len_q=s_q, batch_size=len(lens), max_kv_len=max(lens),
                         min_kv_len=min(lens), page_size=64, q_dtype="bf16", kv_dtype="bf16",
                         device=DeviceSpec.of("cuda"))


def _decoder(inputs, H=128, **kw):
    from mlacore import MLADecoder
    from mlacore.testing.compare import only_backend_dispatcher

    return MLADecoder(H, 64, q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16, device="cuda",
                      sm_scale=inputs.sm_scale, kv_scale=inputs.kv_scale,
                      dispatcher=only_backend_dispatcher("cute_dsl_mla", options={"seesaw_split": "balanced"}), **kw)


def _nan_like(q):
    return (torch.full((*q.shape[:3], 512), float("nan"), dtype=q.dtype, device="cuda"),
            torch.full(q.shape[:3], float("nan"), dtype=torch.float32, device="cuda"))


@needs_sm90
@pytest.mark.parametrize("s_q", [1, 2])
def test_backend_graph_captured_at_one_form_replays_the_other_equal_to_eager(s_q):
    """MLADecoder with seesaw_split=balanced in graph mode (H=128: cp.async loads at s_q=1, TMA at s_q=2 under
    loads=auto): capture at a step of one form, plan a step of the other into the same buffers, replay: equal to
    an eager decoder on that step and to the fp64 reference."""
    from mla_cute_dsl.kernels import make_schedule
    from mlacore.testing.compare import compare, reference_outputs
    from mlacore.testing.inputs import make_inputs

    B, n = 40, 4096
    steps = {"a": [n] * B, "b": ([1024] * B if s_q == 1 else [n] * 33 + [1] * 7)}
    steps["b"][0] = 0
    pages = B * -(-n // 64) + 4
    made = {}
    for k, (key, lens) in enumerate(steps.items()):
        problem = _backend_problem(lens, s_q)
        used = sum(-(-x // 64) for x in lens)
        made[key] = (problem, make_inputs(problem, "cuda", seed=5000 + 10 * s_q + k,
                                          kv_lens=torch.tensor(lens, dtype=torch.int32), extra_pages=pages - used))
    forms = {key: make_schedule(lens, s_q, 128, _num_sms(), device="cpu", balanced=True).form
             for key, lens in steps.items()}
    if forms["a"] == forms["b"]:
        pytest.skip(f"both steps plan the {forms['a']} form on this GPU: no switch to test")
    p1, in1 = made["a"]
    p2, in2 = made["b"]
    q, kv = in1.q.clone(), in1.kv_cache.clone()
    decoder = _decoder(in1, cuda_graph=True, max_batch=B, max_kv_len=n)
    plan = decoder.plan(in1.kv_lens, in1.page_table, s_q)
    assert plan.backend == "cute_dsl_mla", plan.decision.format_trace()
    assert plan.planned.run_fn.__name__ == "mla_decode_sm90_wgmma_seesaw_balanced"
    assert plan.planned.schedule.form == forms["a"]
    out, lse = _nan_like(q)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        decoder.run(q, kv, plan, out=out, lse=lse)  # warm-up (compiles) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    res = compare(p1, out, lse, *reference_outputs(p1, in1))
    assert res.passed, (forms, res.messages)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decoder.run(q, kv, plan, out=out, lse=lse)
    q.copy_(in2.q)
    kv.copy_(in2.kv_cache)
    plan2 = decoder.plan(in2.kv_lens, in2.page_table, s_q)
    assert plan2.planned.schedule is plan.planned.schedule and plan2.planned.schedule.form == forms["b"]
    out.fill_(float("nan"))
    lse.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    with _decoder(in2) as eager:
        e_plan = eager.plan(in2.kv_lens, in2.page_table, s_q)
        e_out, e_lse = _nan_like(in2.q)
        eager.run(in2.q, in2.kv_cache, e_plan, out=e_out, lse=e_lse)
        torch.cuda.synchronize()
    assert torch.equal(out, e_out) and torch.equal(lse, e_lse)
    res = compare(p2, out, lse, *reference_outputs(p2, in2))
    assert res.passed, (forms, res.messages)
    decoder.close()
