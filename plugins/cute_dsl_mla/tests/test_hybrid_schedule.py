"""CPU tests of the hybrid split-KV plan (make_schedule(balanced=True), schedule.plan_hybrid): which form a
step picks (uniform lengths: the even plan; skewed lengths: the balanced plan), the buffer bounds of both
forms over random lengths (zeros included) read back from the Schedule's tensors, in-place re-planning that
switches form (what a CUDA graph replays), and the float64 emulation of the balanced kernel's item loop +
combine for the even plan in the balanced format."""

from __future__ import annotations

import random

import pytest
import torch

from mla_cute_dsl.kernels import schedule as S
from test_balanced_schedule import _emulate, _reference

BN = S.BLOCK_N


def _nb(n: int) -> int:
    return -(-n // BN) if n > 0 else 0


def _bench_varlen(B: int, lo: int, hi: int) -> list:
    """The lengths bench_kernel.py --balanced times for a varlen shape (random.Random(1234))."""
    rng = random.Random(1234)
    return [rng.randint(lo, hi) for _ in range(B)]


def check_schedule(sched: S.Schedule, lens: list, n_sm: int, cps: int = 1) -> tuple:
    """What the balanced kernel and the combine read, checked on the Schedule's own tensors: every kv token
    once, column ranges partitioning the used rows, consecutive slots per split request, the fixed buffer
    bounds. Returns (items, split, ranges, per-column blocks)."""
    rows = sched.rows
    C = S.balanced_cols(rows, n_sm, cps)
    assert sched.balanced and sched.num_cols == C and sched.form in S.FORMS
    work = sched.work_info.tolist()
    ranges = sched.cta_ranges.tolist()
    n = sched.num_items
    items = [tuple(r) for r in work[:n]]
    assert all(r == [-1, -1, -1, -1] for r in work[n:])  # unused rows: the kernel skips b < 0
    assert len(ranges) == C + 1 and ranges[0] == 0 and ranges[-1] == n
    assert all(a <= b for a, b in zip(ranges, ranges[1:]))
    cover = [[0] * L for L in lens]
    for b, s, e, _ in items:
        assert 0 <= b < len(lens) and s % BN == 0 and s < e <= lens[b] and (e == lens[b] or e % BN == 0)
        for t in range(s, e):
            cover[b][t] += 1
    assert all(c == [1] * L for c, L in zip(cover, lens)), "a kv token is not covered exactly once"
    split = [tuple(r) for r in sched.split_info.tolist()[: len(lens)]]
    per_req: dict = {}
    for b, s, e, slot in items:
        per_req.setdefault(b, []).append((s, slot))
    used = []
    for b, L in enumerate(lens):
        first, cnt = split[b]
        got = sorted(per_req.get(b, []))
        assert cnt == len(got) and (cnt == 0) == (L == 0)
        if cnt == 1:
            assert got[0][1] == -1
        elif cnt > 1:
            assert [sl for _, sl in got] == list(range(first, first + cnt))
            used += list(range(first, first + cnt))
    assert sorted(used) == list(range(len(used)))
    assert n <= sched.capacity and len(used) <= sched.num_slots
    col_blocks = [sum(_nb(e - s) for _, s, e, _ in items[ranges[c]:ranges[c + 1]]) for c in range(C)]
    assert max(col_blocks, default=0) == sched.max_cta_blocks
    return items, split, ranges, col_blocks


# -- which form a step picks ---------------------------------------------------------------------------


@pytest.mark.parametrize("lens,s_q", [
    ([8192] * 64, 1), ([4096] * 128, 2), ([4096], 1), ([4096] * 32, 1),  # the measured uniform shapes
    ([4096] * 128, 1), ([2048] * 7, 2), ([100] * 500, 1), ([1] * 3, 2),
])
def test_uniform_lengths_keep_the_even_plan(lens, s_q):
    sched = S.make_schedule(lens, s_q, 16, 132, device="cpu", balanced=True)
    assert sched.form == "even", (sched.cost_even, sched.cost_balanced)
    items, split, _ = S.plan_items(lens, s_q, 16, 132)
    assert sorted(map(tuple, sched.work_info[: sched.num_items].tolist())) == sorted(items)
    assert sched.split_info[: len(lens)].tolist() == [list(t) for t in split]
    check_schedule(sched, lens, 132)


@pytest.mark.parametrize("B,s_q,lo,hi", [(100, 1, 1, 8192), (64, 2, 64, 8192), (128, 1, 1, 4096)])
def test_skewed_lengths_pick_the_balanced_plan(B, s_q, lo, hi):
    """The measured varlen shape (B100: 180.8 -> 124.9 us) and the two the benchmark adds."""
    lens = _bench_varlen(B, lo, hi)
    sched = S.make_schedule(lens, s_q, 16, 132, device="cpu", balanced=True)
    assert sched.form == "balanced"
    assert sched.cost_balanced < (1 - S.HYBRID_MARGIN) * sched.cost_even
    items, split, ranges, _ = S.plan_balanced(lens, s_q, 16, 132)
    assert sched.cta_ranges.tolist() == ranges
    assert sched.work_info[: len(items)].tolist() == [list(t) for t in items]
    _, _, _, col_blocks = check_schedule(sched, lens, 132)
    even = S.make_schedule(lens, s_q, 16, 132, device="cpu", balanced=True, form="even")
    assert max(col_blocks) < even.max_cta_blocks


def test_b100_varlen_numbers_behind_the_margin():
    """The prediction choose_form's docstring cites: 49.4 vs 87.4 block-equivalents, 47 vs 86 blocks."""
    sched = S.make_schedule(_bench_varlen(100, 1, 8192), 1, 16, 132, device="cpu", balanced=True)
    assert round(sched.cost_balanced, 1) == 49.4 and round(sched.cost_even, 1) == 87.4
    assert sched.max_cta_blocks == 47 and sched.num_items == 229
    even = S.make_schedule(_bench_varlen(100, 1, 8192), 1, 16, 132, device="cpu", balanced=True, form="even")
    assert even.max_cta_blocks == 86 and even.num_items == 132


def test_uniform_lengths_with_a_wave_quantization_loss_pick_the_balanced_plan():
    """Uniform is not always even: B100 S8192 on 132 SMs is 200 items of 64 blocks in two waves (or 100 of
    128 in one), 128 blocks per SM either way; the balanced plan walks at most 98 (12800 / 132 = 97.0 plus the item costs)."""
    sched = S.make_schedule([8192] * 100, 1, 16, 132, device="cpu", balanced=True)
    assert sched.form == "balanced" and sched.max_cta_blocks == 98
    assert S.make_schedule([8192] * 100, 1, 16, 132, device="cpu", balanced=True, form="even").max_cta_blocks == 128


def test_choose_form_needs_the_margin():
    assert S.choose_form(100.0, 90.0) == "even"  # exactly 10% less: not clearly lower
    assert S.choose_form(100.0, 89.9) == "balanced"
    assert S.choose_form(100.0, 99.0) == "even" and S.choose_form(0.0, 0.0) == "even"
    assert S.choose_form(100.0, 95.0, margin=0.0) == "balanced"


def test_forced_forms_and_refusals():
    lens = _bench_varlen(100, 1, 8192)
    assert S.make_schedule(lens, 1, 16, 132, device="cpu", balanced=True, form="even").form == "even"
    uni = S.make_schedule([8192] * 64, 1, 16, 132, device="cpu", balanced=True, form="balanced")
    assert uni.form == "balanced" and uni.max_cta_blocks == 63
    with pytest.raises(ValueError, match="form must be one of"):
        S.make_schedule(lens, 1, 16, 132, device="cpu", balanced=True, form="greedy")
    with pytest.raises(ValueError, match="needs balanced=True"):
        S.make_schedule(lens, 1, 16, 132, device="cpu", form="balanced")
    assert S.make_schedule(lens, 1, 16, 132, device="cpu").form == "even"  # the default kernel's plan


# -- the even plan in the balanced format ---------------------------------------------------------------


@pytest.mark.parametrize("seed", range(30))
def test_even_columns_keep_items_whole_and_within_waves_times_largest(seed):
    rng = random.Random(seed)
    B = rng.choice([1, 5, 64, 133, 300])
    lens = [rng.choice([0, rng.randint(1, 9000), 8192]) for _ in range(B)]
    s_q, H, n_sm = rng.choice([1, 2]), rng.choice([16, 64, 128]), rng.choice([132, 16, 3])
    items, _, _ = S.plan_items(lens, s_q, H, n_sm)
    cols = S.balanced_cols(s_q * H, n_sm)
    k = rng.choice([0, 1, 3])
    rows_out, ranges, col_blocks, col_items = S.even_columns(items, cols, k)
    assert sorted(rows_out) == sorted(items) and len(ranges) == cols + 1 and ranges[-1] == len(items)
    assert col_items == [ranges[c + 1] - ranges[c] for c in range(cols)]
    if items:
        waves = -(-len(items) // cols)
        largest = max(_nb(e - s) for _, s, e, _ in items)
        costs = [b + k * n for b, n in zip(col_blocks, col_items)]
        assert max(costs) <= waves * (largest + k)
        # every item's blocks are counted in exactly one column
        assert sum(col_blocks) == sum(_nb(e - s) for _, s, e, _ in items)


# -- bounds of both forms over random lengths, and in-place re-planning ----------------------------------


@pytest.mark.parametrize("seed", range(40))
def test_both_forms_fit_the_same_buffers_over_random_lengths(seed):
    """One decoder's buffers (made once, at max_batch) re-planned in place with random length sets of any
    batch up to it, zeros included, in every form: the kernel reads valid rows and ranges whatever each
    step chose."""
    rng = random.Random(seed)
    s_q, H = rng.choice([1, 2, 4]), rng.choice([1, 5, 16, 32, 64, 128])
    n_sm, cps = rng.choice([132, 114, 16, 3]), rng.choice([1, 1, 2])
    max_batch = rng.choice([1, 8, 64, 200])
    maxlen = rng.choice([1, 64, 300, 4096, 16384])
    sched = S.make_schedule([0] * max_batch, s_q, H, n_sm, ctas_per_sm=cps, device="cpu", balanced=True)
    ptrs = (sched.work_info.data_ptr(), sched.split_info.data_ptr(), sched.cta_ranges.data_ptr())
    shapes = (sched.work_info.shape, sched.split_info.shape, sched.cta_ranges.shape, sched.num_slots)
    for step in range(6):
        B = rng.randint(1, max_batch)
        skew = rng.random() < 0.5
        lens = [rng.choice([0, rng.randint(0, maxlen), maxlen, rng.randint(0, s_q)]) if skew else maxlen
                for _ in range(B)]
        for form in ("auto", "even", "balanced"):
            S.make_schedule(lens, s_q, H, n_sm, ctas_per_sm=cps, device="cpu", out=sched, balanced=True,
                            form=form)
            assert (sched.work_info.data_ptr(), sched.split_info.data_ptr(), sched.cta_ranges.data_ptr()) == ptrs
            assert (sched.work_info.shape, sched.split_info.shape, sched.cta_ranges.shape,
                    sched.num_slots) == shapes
            check_schedule(sched, lens, n_sm, cps)
            if form != "auto":
                assert sched.form == form


def test_in_place_replanning_switches_form_and_equals_a_fresh_plan():
    """What a CUDA graph sees: captured at a uniform step (even form), replayed at a skewed one (balanced) and
    back; the buffers stay, their contents equal a fresh schedule of each step."""
    uniform, skewed = [8192] * 64, _bench_varlen(64, 1, 8192)
    sched = S.make_schedule(uniform, 1, 16, 132, device="cpu", balanced=True)
    assert sched.form == "even"
    ptrs = (sched.work_info.data_ptr(), sched.split_info.data_ptr(), sched.cta_ranges.data_ptr())
    seen = []
    for lens in (skewed, uniform, skewed):
        S.make_schedule(lens, 1, 16, 132, device="cpu", out=sched, balanced=True)
        fresh = S.make_schedule(lens, 1, 16, 132, max_batch=64, device="cpu", balanced=True)
        assert (sched.work_info.data_ptr(), sched.split_info.data_ptr(), sched.cta_ranges.data_ptr()) == ptrs
        for a, b in ((sched.work_info, fresh.work_info), (sched.split_info, fresh.split_info),
                     (sched.cta_ranges, fresh.cta_ranges)):
            assert torch.equal(a, b)
        assert sched.num_items == fresh.num_items and sched.form == fresh.form
        seen.append(sched.form)
    assert seen == ["balanced", "even", "balanced"]


# -- float64 emulation of the balanced kernel running the even plan -------------------------------------


@pytest.mark.parametrize("seed", range(8))
def test_emulated_item_loop_and_combine_of_the_even_form_match_softmax_attention(seed):
    """The balanced kernel's item loop over the even form's column ranges (several whole items per column when
    items outnumber columns, a request's items possibly in one column), then the combine: equal to softmax
    attention in float64."""
    rng = random.Random(100 + seed)
    g = torch.Generator().manual_seed(seed)
    s_q = rng.choice([1, 2, 4])
    H = rng.choice([1, 3, 5, 16]) if seed % 2 else rng.choice([40, 64])  # m_blocks 1 or > 1
    B = rng.choice([1, 3, 9, 40])
    n_sm = rng.choice([3, 7, 16])
    lens = [rng.choice([0, 1, max(0, s_q - 1), rng.randint(1, 400), 64, 128, 65]) for _ in range(B)]
    rows = s_q * H
    bm = S.block_m_for(rows)
    mb = -(-rows // bm)
    sched = S.make_schedule(lens, s_q, H, n_sm, device="cpu", balanced=True, form="even")
    items, split, ranges, _ = check_schedule(sched, lens, n_sm)
    if seed == 0:
        assert max(ranges[c + 1] - ranges[c] for c in range(len(ranges) - 1)) >= 1
    maxlen = max(lens + [1])
    q = torch.randn(B, rows, 576, generator=g, dtype=torch.float64) * (10.0 if seed == 3 else 1.0)
    kv = torch.randn(B, maxlen, 576, generator=g, dtype=torch.float64)
    sm_scale = 1.0 / 192 ** 0.5
    o, lse = _emulate(q, kv, lens, s_q, H, items, split, ranges, sched.num_slots, sm_scale, mb, bm)
    ro, rl = _reference(q, kv, lens, s_q, H, sm_scale)
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()  # every row written once
    assert torch.allclose(o, ro, rtol=1e-9, atol=1e-9)
    assert torch.equal(torch.isinf(lse), torch.isinf(rl))
    fin = ~torch.isinf(rl)
    assert torch.allclose(lse[fin], rl[fin], rtol=1e-9, atol=1e-9)


def test_the_even_form_puts_several_items_in_a_column_when_items_outnumber_columns():
    """The case the emulation must cover: 500 whole requests on 132 columns (plan_items: one item each)."""
    sched = S.make_schedule([100] * 500, 1, 16, 132, device="cpu", balanced=True)
    assert sched.form == "even"
    _, _, ranges, col_blocks = check_schedule(sched, [100] * 500, 132)
    counts = [ranges[c + 1] - ranges[c] for c in range(132)]
    assert max(counts) == 4 and min(counts) == 3 and max(col_blocks) == 8  # ceil(500/132) x 2 blocks
