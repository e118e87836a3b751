"""GPU tests of the balanced transposed-WGMMA kernel (sm90_wgmma_t_decode.mla_decode_sm90_wgmma_t_balanced:
MLADecodePartialWGMMAT(balanced=True), a fixed grid of CTA columns each walking its items of a
make_schedule(..., balanced=True) schedule) + the combine, against the fp64 reference of test_kernel_gpu.py.

* Fresh random inputs per case, shuffled page tables, NaN in unused pages and page tails, NaN-poisoned
  outputs and partial buffers; lengths uniform, variable with 0 and < s_q, skewed (1..8192); R = s_q * H in
  {1, 3, 8, 16, 32} (BLOCK_M 16 and 32, partial m-blocks); pages 64 and 256; bf16 and fp16 q / cache; both
  plan forms forced and the hybrid's own choice; more requests than columns; 1-tile items; columns with no
  item; one column walking every item (the ring's phases across many items of odd tile counts).
* Agreement with the verified balanced mma.sync kernel on the same schedule.
* CUDA graphs: kernel level (captured at one forced form, re-planned in place to the other, replayed) and
  through MLADecoder with mma=wgmma_t (captured at a uniform step, replayed at a skewed one and back), equal
  to eager bit for bit and to the reference.
Skipped without an sm_90 GPU.

    PYTHONPATH=plugins/cute_dsl_mla:. timeout 150 python -m pytest -q -p no:cacheprovider -rfs \\
        plugins/cute_dsl_mla/tests/test_wgmma_t_balanced_gpu.py
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from graph_replay import fresh_values, graph_replay_equals_eager
from test_kernel_gpu import check

pytestmark = pytest.mark.gpu

DT = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _is_sm90():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


needs_sm90 = pytest.mark.skipif(not _is_sm90(), reason="needs an sm_90 GPU")


def _num_sms():
    return torch.cuda.get_device_properties(0).multi_processor_count


def _lengths(kind, B, S, s_q, rng):
    """uniform: all S; varlen: 0..S with 0, 1, s_q - 1 and S mixed in; skewed: uniform in 1..S (the hybrid's
    balanced case); logskew: log-uniform in 1..S (a few long, most short); short: 1..64 (every item one tile);
    tiny: 0..s_q."""
    if kind == "uniform":
        return [S] * B
    if kind == "varlen":
        lens = [rng.randint(0, S) for _ in range(B)]
        for i, v in enumerate([0, 1, max(0, s_q - 1), S][:B]):
            lens[i] = v
        return lens
    if kind == "skewed":
        return [rng.randint(1, S) for _ in range(B)]
    if kind == "logskew":
        return [int(min(S, max(1, round(math.exp(rng.uniform(0.0, math.log(S))))))) for _ in range(B)]
    if kind == "short":
        return [rng.randint(1, 64) for _ in range(B)]
    if kind == "tiny":
        return [rng.randint(0, s_q) for _ in range(B)]
    raise ValueError(kind)


def make_case_lens(lens, s_q, H, dtype, page, seed, q_std=1.0):
    """test_kernel_gpu.make_case for given lengths, with a cache of just the pages they need plus 3 spare:
    shuffled pages, table entries past a request's pages pointing at a spare page, every row no request
    reads NaN (spare pages and page tails), q and the cache in `dtype`."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    B = len(lens)
    need = [-(-n // page) for n in lens]
    max_pages = max(need + [1]) + 1
    P = sum(need) + 3
    perm = torch.randperm(P, generator=g).to(torch.int32)
    page_table = torch.full((B, max_pages), int(perm[-1]), dtype=torch.int32)
    used = torch.zeros(P, page, dtype=torch.bool)
    first = 0
    for b, n in enumerate(lens):
        pages = perm[first:first + need[b]].long()
        first += need[b]
        page_table[b, : need[b]] = pages.to(torch.int32)
        used[pages] = True
        if n % page:
            used[pages[-1], n % page:] = False  # the page tail
    kv = torch.randn(P, page, 576, generator=g).to(dtype)
    kv[~used] = float("nan")
    q = (torch.randn(B, s_q, H, 576, generator=g) * q_std).to(dtype)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    return dict(q=q.cuda(), kv=kv.cuda(), page_table=page_table.cuda(), lens=lens_t.cuda(), lens_cpu=lens_t,
                kv_scale=1.0, sm_scale=1.0 / math.sqrt(192))


def _schedule(case, form="auto", num_sms=None):
    from mla_cute_dsl.kernels import alloc_workspace, make_schedule

    B, s_q, H, _ = case["q"].shape
    sched = make_schedule(case["lens_cpu"], s_q, H, num_sms or _num_sms(), balanced=True, form=form, ctas_per_sm=1)
    ws = alloc_workspace(sched)
    for part in ws:  # a partial slot the kernel fails to write must not pass as old memory
        part.fill_(float("nan"))
    return sched, ws


def _outs(case):
    B, s_q, H, _ = case["q"].shape
    out = torch.full((B, s_q, H, 512), float("nan"), dtype=case["q"].dtype, device="cuda")
    lse = torch.full((B, s_q, H), float("nan"), dtype=torch.float32, device="cuda")
    return out, lse


def run_bal(case, out, lse, sched, ws):
    from mla_cute_dsl.kernels.sm90_wgmma_t_decode import mla_decode_sm90_wgmma_t_balanced

    mla_decode_sm90_wgmma_t_balanced(case["q"], case["kv"], case["page_table"], case["lens"], case["sm_scale"],
                                     case["kv_scale"], out, lse, sched, ws)


CASES = [  # B, s_q, H, lengths, S, page, dtype, form
    (6, 1, 1, "varlen", 300, 64, "bf16", "balanced"),      # R = 1
    (7, 1, 3, "varlen", 1000, 256, "bf16", "balanced"),    # R = 3, page 256
    (9, 1, 8, "logskew", 2000, 64, "fp16", "even"),        # R = 8, fp16
    (100, 1, 16, "skewed", 8192, 64, "bf16", "auto"),      # R = 16, skewed 1..8192 (plans balanced)
    (100, 1, 16, "logskew", 8192, 64, "bf16", "auto"),     # R = 16, log-uniform 1..8192
    (128, 2, 16, "varlen", 4096, 64, "bf16", "auto"),      # R = 32, the varlen_h16 shape
    (64, 2, 16, "skewed", 8192, 256, "fp16", "balanced"),  # R = 32, page 256, fp16
    (20, 4, 8, "tiny", 8, 64, "bf16", "balanced"),         # R = 32, lengths 0..s_q (causal rows empty)
    (3, 1, 32, "uniform", 4096, 256, "bf16", "balanced"),  # R = 32: 3 requests over 132 columns (1-2 tile items)
    (1, 2, 8, "uniform", 4096, 64, "fp16", "even"),        # R = 16 from s_q 2, one request
    (200, 1, 16, "short", 64, 64, "bf16", "auto"),         # every item one tile, several per column
    (2, 1, 16, "uniform", 1, 64, "bf16", "auto"),          # 2 items, 130 empty columns
    (300, 2, 16, "varlen", 600, 64, "bf16", "even"),       # more requests than columns
]


@needs_sm90
@pytest.mark.parametrize("B,s_q,H,kind,S,page,dtype,form", CASES)
def test_wgmma_t_balanced_against_fp64_reference(B, s_q, H, kind, S, page, dtype, form):
    rng = random.Random()
    case = make_case_lens(_lengths(kind, B, S, s_q, rng), s_q, H, DT[dtype], page, seed=rng.randrange(1 << 30))
    sched, ws = _schedule(case, form)
    assert sched.block_m in (16, 32) and sched.num_cols == _num_sms()
    out, lse = _outs(case)
    run_bal(case, out, lse, sched, ws)
    torch.cuda.synchronize()
    check(case, out, lse)


@needs_sm90
@pytest.mark.parametrize("num_sms", [1, 2, 5])
@pytest.mark.parametrize("s_q", [1, 2])
def test_wgmma_t_balanced_few_columns_walk_many_items(num_sms, s_q):
    """A schedule for 1, 2 or 5 SMs: each column walks many items of 0-6 tiles (odd counts, 1-tile items), so
    the ring's stages and phases run across dozens of item boundaries (a hang here is the ring)."""
    rng = random.Random()
    lens = [rng.choice([0, 1, 63, 64, 65, 128, 129, 192, 200, 320, 384]) for _ in range(24)]
    case = make_case_lens(lens, s_q, 16, torch.bfloat16, 64, seed=rng.randrange(1 << 30))
    for form in ("even", "balanced"):
        sched, ws = _schedule(case, form, num_sms=num_sms)
        assert sched.num_cols == num_sms
        out, lse = _outs(case)
        run_bal(case, out, lse, sched, ws)
        torch.cuda.synchronize()
        check(case, out, lse)


@needs_sm90
def test_wgmma_t_balanced_two_items_of_one_request_in_a_column():
    """The even form on 4 columns puts two items of one request in one column (Q kept, row state reset, two
    partial slots meeting in the combine)."""
    lens = [64, 1500, 700, 0, 65]
    case = make_case_lens(lens, 2, 16, torch.bfloat16, 64, seed=random.randrange(1 << 30))
    sched, ws = _schedule(case, "even", num_sms=4)
    items, ranges = sched.work_info.tolist(), sched.cta_ranges.tolist()
    assert any(len({items[i][0] for i in range(ranges[c], ranges[c + 1])}) < ranges[c + 1] - ranges[c]
               for c in range(4))
    out, lse = _outs(case)
    run_bal(case, out, lse, sched, ws)
    torch.cuda.synchronize()
    check(case, out, lse)


@needs_sm90
@pytest.mark.parametrize("s_q", [1, 2])
def test_wgmma_t_balanced_matches_mma_sync_balanced_same_schedule(s_q):
    """Same inputs, same schedule through the verified balanced mma.sync kernel and this one: close (not
    bit-equal: another reduction order), which separates a kernel bug from a reference bug."""
    from mla_cute_dsl.kernels import mla_decode_sm90_balanced

    rng = random.Random()
    case = make_case_lens(_lengths("skewed", 64, 8192, s_q, rng), s_q, 16, torch.bfloat16, 64,
                          seed=rng.randrange(1 << 30))
    sched, ws = _schedule(case, "balanced")
    o1, l1 = _outs(case)
    mla_decode_sm90_balanced(case["q"], case["kv"], case["page_table"], case["lens"], case["sm_scale"], 1.0, o1, l1,
                             sched, ws)
    torch.cuda.synchronize()
    for part in ws:
        part.fill_(float("nan"))
    o2, l2 = _outs(case)
    run_bal(case, o2, l2, sched, ws)
    torch.cuda.synchronize()
    d = (o1.double() - o2.double()).norm() / o1.double().norm().clamp_min(1e-30)
    assert d < 1e-2, f"rel diff vs mma.sync balanced {d:.3e}"
    fin = torch.isfinite(l1)
    assert torch.equal(fin, torch.isfinite(l2)) and (l1[fin] - l2[fin]).abs().max() < 1e-2


@needs_sm90
def test_wgmma_t_balanced_large_magnitude_q():
    rng = random.Random()
    case = make_case_lens(_lengths("skewed", 32, 4096, 2, rng), 2, 16, torch.bfloat16, 64,
                          seed=rng.randrange(1 << 30), q_std=100.0)
    sched, ws = _schedule(case, "balanced")
    out, lse = _outs(case)
    run_bal(case, out, lse, sched, ws)
    torch.cuda.synchronize()
    check(case, out, lse, tol=2e-2)


@needs_sm90
@pytest.mark.parametrize("first,second", [("even", "balanced"), ("balanced", "even")])
def test_wgmma_t_balanced_graph_replays_the_other_form_equal_to_eager(first, second):
    """Kernel level: capture with the schedule in one (forced) form, re-plan the other form with new lengths
    into the same buffers, replay: equal to an eager call bit for bit and to the reference."""
    from mla_cute_dsl.kernels import make_schedule

    rng = random.Random()
    B, s_q, H, S = 64, 2, 16, 2048
    case = make_case_lens([S] * B, s_q, H, torch.bfloat16, 64, seed=rng.randrange(1 << 30))
    sched, ws = _schedule(case, first)
    out, lse = _outs(case)
    run_bal(case, out, lse, sched, ws)  # warm up (compile) outside the capture
    # new lengths (each at most the old: the rows read are not poisoned), new q, the other form in place
    new = _lengths("skewed", B, S, s_q, rng)
    new[1], new[2] = 0, 1

    def replan():
        case["lens_cpu"] = torch.tensor(new, dtype=torch.int32)
        case["lens"].copy_(case["lens_cpu"])
        make_schedule(case["lens_cpu"], s_q, H, _num_sms(), out=sched, balanced=True, form=second, ctas_per_sm=1)
        assert sched.form == second
        fresh_values(case["q"])

    graph_replay_equals_eager(lambda: run_bal(case, out, lse, sched, ws), out, lse, refresh=replan,
                              check=lambda o, l: check(case, o, l), scratch=ws)


# ---- through the backend: mla option mma=wgmma_t (split_kv=balanced, the default) ----


def _backend_problem(lens, s_q):
    from mlacore.problem import DecodeProblem, DeviceSpec

    return DecodeProblem(num_heads=16, seq_len_q=s_q, batch_size=len(lens), max_kv_len=max(lens),
                         min_kv_len=min(lens), page_size=64, q_dtype="bf16", kv_dtype="bf16",
                         device=DeviceSpec.of("cuda"))


def _decoder(inputs, **kw):
    from mlacore import MLADecoder
    from mlacore.testing.compare import only_backend_dispatcher

    return MLADecoder(16, 64, q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16, device="cuda",
                      sm_scale=inputs.sm_scale, kv_scale=inputs.kv_scale,
                      dispatcher=only_backend_dispatcher("cute_dsl_mla", options={"mma": "wgmma_t"}), **kw)


def _expected_form(lens, s_q):
    from mla_cute_dsl.kernels import make_schedule

    return make_schedule(lens, s_q, 16, _num_sms(), device="cpu", balanced=True).form


def _nan_like(q):
    return (torch.full((*q.shape[:3], 512), float("nan"), dtype=q.dtype, device="cuda"),
            torch.full(q.shape[:3], float("nan"), dtype=torch.float32, device="cuda"))


@needs_sm90
@pytest.mark.parametrize("s_q", [1, 2])
@pytest.mark.parametrize("first,second", [("uniform", "skewed"), ("skewed", "uniform")])
def test_backend_graph_captured_at_one_form_replays_the_other_equal_to_eager(first, second, s_q):
    """MLADecoder with mma=wgmma_t in graph mode: capture at a step of one form, plan a step of the other
    into the same buffers, replay: equal to an eager decoder on that step and to the fp64 reference."""
    from mlacore.testing.compare import compare, reference_outputs
    from mlacore.testing.inputs import make_inputs

    B, n = 64, 4096
    rng = random.Random(11 + s_q)
    skewed = [rng.randint(1, n) for _ in range(B)]
    skewed[0], skewed[1], skewed[2], skewed[3] = n, 0, 1, max(0, s_q - 1)
    steps = {"uniform": [n] * B, "skewed": skewed}
    pages = B * -(-n // 64) + 4
    made = {}
    for k, (key, lens) in enumerate(steps.items()):
        problem = _backend_problem(lens, s_q)
        used = sum(-(-x // 64) for x in lens)
        made[key] = (problem, make_inputs(problem, "cuda", seed=3000 + 10 * s_q + k,
                                          kv_lens=torch.tensor(lens, dtype=torch.int32), extra_pages=pages - used))
    forms = {key: _expected_form(lens, s_q) for key, lens in steps.items()}
    if forms["uniform"] == forms["skewed"]:
        pytest.skip(f"both steps plan the {forms['uniform']} form on this GPU: no switch to test")
    p1, in1 = made[first]
    p2, in2 = made[second]
    q, kv = in1.q.clone(), in1.kv_cache.clone()
    decoder = _decoder(in1, cuda_graph=True, max_batch=B, max_kv_len=n)
    plan = decoder.plan(in1.kv_lens, in1.page_table, s_q)
    assert plan.backend == "cute_dsl_mla", plan.decision.format_trace()
    assert plan.planned.run_fn.__name__ == "mla_decode_sm90_wgmma_t_balanced"
    assert plan.planned.schedule.form == forms[first]
    out, lse = _nan_like(q)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        decoder.run(q, kv, plan, out=out, lse=lse)  # warm-up (compiles) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decoder.run(q, kv, plan, out=out, lse=lse)
    q.copy_(in2.q)
    kv.copy_(in2.kv_cache)
    plan2 = decoder.plan(in2.kv_lens, in2.page_table, s_q)
    assert plan2.planned.schedule is plan.planned.schedule and plan2.planned.schedule.form == forms[second]
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
