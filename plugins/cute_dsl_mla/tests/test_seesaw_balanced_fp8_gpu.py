"""GPU tests of the balanced seesaw kernel with an fp8 e4m3 cache (branch fp8-balanced:
sm90_wgmma_decode.mla_decode_sm90_wgmma_seesaw_balanced with a float8_e4m3fn cache, MLADecodePartialWGMMASeesaw(
balanced=True) running the even fp8 seesaw's register-staged loads inside each item of its CTA column) + the
combine, against the fp64 reference of test_kernel_gpu.py.  Written on a CPU machine (compile-checked only): not
yet run on a GPU when written.

* The smallest case first (one 64-token request: a wrong mbarrier parity across items or a lost arrive shows as a
  hang there; run this file under `timeout`).
* Fresh random inputs per case, shuffled page tables, e4m3 NaN (0x7F) in unused pages and page tails, kv_scale
  0.37, NaN-poisoned outputs and partial buffers; lengths uniform, variable with 0 and < s_q, skewed, log-skewed,
  short (every item one tile), tiny (0..s_q); s_q 1 / 2, H 64 / 128 and 126 (odd rows, a partial m-block); pages
  64 and 256; bf16 and fp16 q; eager and lazy rescale; both plan forms forced and the hybrid's own choice; 1 / 2 /
  5-SM schedules whose columns walk dozens of items of 0-6 tiles (Q reconverted whenever the request changes);
  large-magnitude q (stddev 100; |q| stays below fp16's 65504).
* Against the even fp8 seesaw (same l2_prefetch default, one CTA per plan_items item): the even form runs the very
  same items, so equal (asserted within 1e-3 relative), the balanced form close (1e-2).
* CUDA graph: captured at one forced form, re-planned in place to the other, replayed: equal to eager bit for bit.
* Through the backend with backend.FP8_SEESAW_BALANCED monkeypatched on: the plan runs the balanced entry.
Skipped without an sm_90 GPU.

    PYTHONPATH=plugins/cute_dsl_mla:plugins/cute_dsl_mla/tests:. timeout 400 python -m pytest -q -p no:cacheprovider \\
        -rfs plugins/cute_dsl_mla/tests/test_seesaw_balanced_fp8_gpu.py
"""

from __future__ import annotations

import functools
import math
import random

import pytest
import torch

from test_kernel_gpu import check
from test_seesaw_balanced_gpu import (MANY_ITEM_LENGTHS, _graph_replays_the_other_form, _schedule,
                                      _two_items_of_one_request_in_a_column, _walk_many_items)
from test_wgmma_t_balanced_gpu import _lengths, _num_sms, _outs, needs_sm90

pytestmark = pytest.mark.gpu

QT = {"bf16": torch.bfloat16, "fp16": torch.float16}
KV_SCALE = 0.37


def make_case_fp8(lens, s_q, H, q_dtype, page, seed, q_std=1.0):
    """test_wgmma_t_balanced_gpu.make_case_lens with an fp8 e4m3 cache (test_kernel_gpu.make_case's values: 2 *
    randn clamped to +-400, kv_scale 0.37): shuffled pages, table entries past a request's pages pointing at a
    spare page, every row no request reads e4m3 NaN (spare pages and page tails)."""
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
    kv = (torch.randn(P, page, 576, generator=g) * 2.0).clamp(-400, 400).to(torch.float8_e4m3fn)
    kv.view(torch.uint8)[~used] = 0x7F  # e4m3 NaN
    q = (torch.randn(B, s_q, H, 576, generator=g) * q_std).to(q_dtype)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    return dict(q=q.cuda(), kv=kv.cuda(), page_table=page_table.cuda(), lens=lens_t.cuda(), lens_cpu=lens_t,
                kv_scale=KV_SCALE, sm_scale=1.0 / math.sqrt(192))


def run_bal(case, out, lse, sched, ws, lazy):
    from mla_cute_dsl.kernels.sm90_wgmma_decode import mla_decode_sm90_wgmma_seesaw_balanced

    assert case["kv"].dtype == torch.float8_e4m3fn
    mla_decode_sm90_wgmma_seesaw_balanced(case["q"], case["kv"], case["page_table"], case["lens"], case["sm_scale"],
                                          case["kv_scale"], out, lse, sched, ws, lazy_rescale=lazy)


CASES = [  # B, s_q, H, lengths, S, page, q dtype, form, lazy
    (1, 1, 64, "uniform", 64, 64, "bf16", "balanced", False),     # smallest: one 1-tile item (a hang shows here)
    (1, 1, 64, "uniform", 64, 64, "bf16", "balanced", True),
    (1, 1, 128, "uniform", 200, 64, "bf16", "balanced", False),   # 4 tiles, a partial last one
    (6, 1, 64, "varlen", 1000, 64, "bf16", "balanced", False),    # 0, 1, s_q - 1, S mixed in
    (7, 1, 128, "varlen", 2000, 256, "bf16", "balanced", True),   # page 256
    (9, 2, 128, "logskew", 4096, 64, "fp16", "even", False),      # fp16 q, even form
    (9, 2, 128, "logskew", 4096, 64, "fp16", "balanced", True),
    (24, 1, 128, "uniform", 4096, 64, "bf16", "auto", True),      # plans balanced (wave quantization)
    (40, 1, 128, "uniform", 4096, 64, "bf16", "auto", False),
    (48, 2, 128, "uniform", 4096, 64, "bf16", "auto", True),      # plans balanced
    (20, 2, 64, "tiny", 8, 64, "bf16", "balanced", False),        # lengths 0..s_q (causal rows empty)
    (3, 1, 128, "uniform", 4096, 256, "fp16", "balanced", True),  # 3 requests over 66 columns
    (100, 2, 64, "short", 64, 64, "bf16", "auto", False),         # every item one tile, several per column
    (2, 1, 128, "uniform", 1, 64, "bf16", "auto", True),          # 2 one-token items, empty columns
    (200, 1, 128, "varlen", 600, 64, "bf16", "even", True),       # more requests than columns
    (16, 1, 126, "varlen", 1500, 64, "bf16", "balanced", False),  # 126 rows: a partial second m-block
    (16, 2, 126, "skewed", 1500, 256, "fp16", "balanced", True),
]


@needs_sm90
@pytest.mark.parametrize("B,s_q,H,kind,S,page,qd,form,lazy", CASES)
def test_fp8_balanced_against_fp64_reference(B, s_q, H, kind, S, page, qd, form, lazy):
    rng = random.Random()
    case = make_case_fp8(_lengths(kind, B, S, s_q, rng), s_q, H, QT[qd], page, seed=rng.randrange(1 << 30))
    sched, ws = _schedule(case, form)
    assert sched.block_m == 64
    out, lse = _outs(case)
    run_bal(case, out, lse, sched, ws, lazy)
    torch.cuda.synchronize()
    check(case, out, lse)


@needs_sm90
@pytest.mark.parametrize("lazy", [False, True])
@pytest.mark.parametrize("num_sms", [1, 2, 5])
@pytest.mark.parametrize("s_q", [1, 2])
def test_fp8_balanced_few_columns_walk_many_items(num_sms, s_q, lazy):
    """Schedules for 1, 2 or 5 SMs at H=64: each column walks many items of 0-6 tiles (odd counts, 1-tile items,
    several requests: Q reconverted at each request change), so the mbarrier phases and the fp8 staging run across
    dozens of item boundaries (a hang here is a parity or a lost arrive)."""
    rng = random.Random()
    lens = [rng.choice(MANY_ITEM_LENGTHS) for _ in range(24)]
    case = make_case_fp8(lens, s_q, 64, torch.bfloat16, 64, seed=rng.randrange(1 << 30))
    _walk_many_items(case, num_sms, functools.partial(run_bal, lazy=lazy))


@needs_sm90
def test_fp8_balanced_two_items_of_one_request_in_a_column():
    """The even form on 4 columns puts two items of one request in one column (Q kept, not reconverted; row state
    reset, two partial slots meeting in the combine)."""
    _two_items_of_one_request_in_a_column(make_case_fp8, functools.partial(run_bal, lazy=False))


@needs_sm90
@pytest.mark.parametrize("lazy", [False, True])
@pytest.mark.parametrize("s_q,H,kind,qd", [(1, 128, "uniform", "bf16"), (2, 128, "skewed", "bf16"),
                                           (1, 64, "varlen", "fp16"), (2, 126, "varlen", "bf16")])
def test_fp8_balanced_equals_the_even_fp8_seesaw(s_q, H, kind, qd, lazy):
    """Same inputs through the even fp8 seesaw (one CTA per plan_items item) and the balanced one: the even form
    runs the very same items with the same per-item arithmetic (equal; asserted within 1e-3), the balanced form
    other splits (close)."""
    from mla_cute_dsl.kernels import alloc_workspace, make_schedule
    from mla_cute_dsl.kernels.sm90_wgmma_decode import mla_decode_sm90_wgmma_seesaw

    rng = random.Random()
    case = make_case_fp8(_lengths(kind, 24, 4096, s_q, rng), s_q, H, QT[qd], 64, seed=rng.randrange(1 << 30))
    even_sched = make_schedule(case["lens_cpu"], s_q, H, _num_sms(), ctas_per_sm=1)
    even_ws = alloc_workspace(even_sched)
    o_even, l_even = _outs(case)
    mla_decode_sm90_wgmma_seesaw(case["q"], case["kv"], case["page_table"], case["lens"], case["sm_scale"],
                                 case["kv_scale"], o_even, l_even, even_sched, even_ws, lazy_rescale=lazy)
    torch.cuda.synchronize()
    check(case, o_even, l_even)
    fin = torch.isfinite(l_even)
    for form, tol in (("even", 1e-3), ("balanced", 1e-2)):
        sched, ws = _schedule(case, form)
        o, l = _outs(case)
        run_bal(case, o, l, sched, ws, lazy)
        torch.cuda.synchronize()
        check(case, o, l)
        d = (o.double() - o_even.double()).norm() / o_even.double().norm().clamp_min(1e-30)
        print(f"{form} form vs the even fp8 seesaw: rel diff {d:.3e}, bitwise equal {torch.equal(o, o_even)}")
        assert d < tol, f"{form} form: rel diff vs the even fp8 seesaw {d:.3e}"
        assert torch.equal(fin, torch.isfinite(l)) and (l[fin] - l_even[fin]).abs().max() < tol


@needs_sm90
@pytest.mark.parametrize("qd", ["bf16", "fp16"])
def test_fp8_balanced_large_magnitude_q(qd):
    rng = random.Random()
    case = make_case_fp8(_lengths("skewed", 16, 4096, 2, rng), 2, 128, QT[qd], 64, seed=rng.randrange(1 << 30),
                         q_std=100.0)
    sched, ws = _schedule(case, "balanced")
    out, lse = _outs(case)
    run_bal(case, out, lse, sched, ws, True)
    torch.cuda.synchronize()
    check(case, out, lse, tol=2e-2)


@needs_sm90
@pytest.mark.parametrize("lazy", [False, True])
@pytest.mark.parametrize("first,second", [("even", "balanced"), ("balanced", "even")])
def test_fp8_balanced_graph_replays_the_other_form_equal_to_eager(first, second, lazy):
    """Capture with the schedule in one (forced) form, re-plan the other form with new lengths into the same
    buffers, replay: equal to an eager call bit for bit and to the reference."""
    rng = random.Random()
    case = make_case_fp8([2048] * 24, 2, 128, torch.bfloat16, 64, seed=rng.randrange(1 << 30))
    _graph_replays_the_other_form(case, first, second, functools.partial(run_bal, lazy=lazy), rng)


@needs_sm90
@pytest.mark.parametrize("flag", [False, True])
def test_backend_fp8_runs_the_balanced_seesaw_only_with_the_flag(flag, monkeypatch):
    """MLADecoder (cute_dsl_mla only, seesaw_split=balanced, the default) with an fp8 cache at H=128: the balanced
    entry with backend.FP8_SEESAW_BALANCED on, the even one off; both equal to the fp64 reference."""
    from mla_cute_dsl import backend as be
    from mlacore import MLADecoder
    from mlacore.problem import DecodeProblem, DeviceSpec
    from mlacore.testing.compare import compare, only_backend_dispatcher, reference_outputs
    from mlacore.testing.inputs import make_inputs

    monkeypatch.setattr(be, "FP8_SEESAW_BALANCED", flag)
    lens = [4096] * 24 + [1, 0, 700]
    problem = DecodeProblem(num_heads=128, seq_len_q=1, batch_size=len(lens), max_kv_len=max(lens),
                            min_kv_len=min(lens), page_size=64, q_dtype="bf16", kv_dtype="fp8_e4m3",
                            device=DeviceSpec.of("cuda"))
    inputs = make_inputs(problem, "cuda", seed=random.randrange(1 << 20), kv_lens=torch.tensor(lens, dtype=torch.int32))
    with MLADecoder(128, 64, q_dtype=torch.bfloat16, kv_dtype=torch.float8_e4m3fn, device="cuda",
                    sm_scale=inputs.sm_scale, kv_scale=inputs.kv_scale,
                    dispatcher=only_backend_dispatcher("cute_dsl_mla", options={"seesaw_split": "balanced"})) as dec:
        plan = dec.plan(inputs.kv_lens, inputs.page_table, 1)
        want = "mla_decode_sm90_wgmma_seesaw_balanced" if flag else "mla_decode_sm90_wgmma_seesaw"
        assert plan.planned.run_fn.__name__ == want and plan.planned.schedule.balanced == flag
        out = torch.full((len(lens), 1, 128, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
        lse = torch.full((len(lens), 1, 128), float("nan"), dtype=torch.float32, device="cuda")
        dec.run(inputs.q, inputs.kv_cache, plan, out=out, lse=lse)
        torch.cuda.synchronize()
    res = compare(problem, out, lse, *reference_outputs(problem, inputs))
    assert res.passed, res.messages
