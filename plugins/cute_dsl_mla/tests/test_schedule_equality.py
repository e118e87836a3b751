"""The vectorized split-KV planner (mla_cute_dsl.kernels.schedule) against the pure-Python planner the GPU
kernels were verified with (schedule_oracle.py, kept verbatim): on random inputs, every buffer and number
make_schedule produces (work_info, split_info, cta_ranges, num_items, blocks_per_split, form, cost_even,
cost_balanced, max_cta_blocks, wide_combine, ...) and every list the pure host functions return must be
exactly equal, errors included (same type and message). Inputs: batch 0..600 (lengths 0..20000: all zero,
one long request, uniform, skewed, random, block-edge values, list or int32 tensor), s_q 1..8, H in
{1, 3, 5, 16, 32, 64, 128}, num_sms in {1, 8, 78, 132}, ctas_per_sm 1..3, balanced False/True, form
auto/even/balanced, item_cost 0..3 (and -1), fresh schedules and in-place re-planning (twice) into an out
schedule of a larger max_batch."""

from __future__ import annotations

import math
import random

import pytest
import torch

import schedule_oracle as O
from mla_cute_dsl.kernels import schedule as S

SEEDS = 12
CASES_PER_SEED = 110
HEADS = (1, 3, 5, 16, 32, 64, 128)
SMS = (1, 8, 78, 132)
FIELDS = ("s_q", "num_heads", "block_m", "capacity", "num_slots", "num_items", "blocks_per_split",
          "wide_combine", "item_cost", "max_cta_blocks", "form", "balanced", "num_cols")


def random_lens(rng: random.Random) -> list:
    B = rng.choice((1, 2, 3, 7, 16, 32, 64, 100, 128, 200, 333, 512, 600, rng.randint(1, 600)))
    kind = rng.choice(("zero", "single", "uniform", "skewed", "random", "edges", "sparse"))
    if kind == "zero":
        return [0] * B
    if kind == "single":
        lens = [0] * B
        lens[rng.randrange(B)] = rng.randint(1, 20000)
        return lens
    if kind == "uniform":
        return [rng.choice((1, 64, 512, 4096, 8192, rng.randint(1, 20000)))] * B
    if kind == "skewed":
        lens = [rng.randint(1, 300) for _ in range(B)]
        for _ in range(rng.randint(1, 3)):
            lens[rng.randrange(B)] = rng.randint(8000, 20000)
        return lens
    if kind == "edges":
        return [rng.choice((0, 1, 63, 64, 65, 127, 128, 129, 4095, 4096, 4097)) for _ in range(B)]
    if kind == "sparse":
        return [rng.randint(1, 20000) if rng.random() < 0.2 else 0 for _ in range(B)]
    return [rng.randint(0, 20000) for _ in range(B)]


def outcome(fn):
    try:
        return fn()
    except (ValueError, AssertionError) as e:
        return ("raised", type(e).__name__, str(e))


def assert_same_schedule(old, new, ctx):
    if isinstance(old, tuple) or isinstance(new, tuple):
        assert old == new, ctx
        return
    for f in FIELDS:
        assert getattr(old, f) == getattr(new, f), (f, ctx)
    for f in ("cost_even", "cost_balanced"):
        a, b = getattr(old, f), getattr(new, f)
        assert (math.isnan(a) and math.isnan(b)) or a == b, (f, a, b, ctx)
    for f in ("work_info", "split_info", "cta_ranges"):
        a, b = getattr(old, f), getattr(new, f)
        assert (a is None) == (b is None), (f, ctx)
        if a is not None:
            assert a.dtype == b.dtype == torch.int32 and a.shape == b.shape and torch.equal(a, b), (f, ctx)


def _case(rng: random.Random):
    lens = random_lens(rng)
    s_q, H = rng.randint(1, 8), rng.choice(HEADS)
    n_sm, cps = rng.choice(SMS), rng.randint(1, 3)
    balanced = rng.random() < 0.6
    form = rng.choice(("auto", "auto", "even", "balanced") if balanced else ("auto", "auto", "even", "balanced"))
    k = rng.choice((0, 1, 1, 1, 2, 3, -1 if form == "even" else 1))
    kw = dict(ctas_per_sm=cps, device="cpu", balanced=balanced, item_cost=k, form=form)
    return lens, s_q, H, n_sm, kw


@pytest.mark.parametrize("seed", range(SEEDS))
def test_make_schedule_equals_the_oracle(seed):
    """Fresh schedules (lengths as a list or an int32 tensor, with and without a larger max_batch)."""
    rng = random.Random(1000 + seed)
    for _ in range(CASES_PER_SEED):
        lens, s_q, H, n_sm, kw = _case(rng)
        mb = rng.choice((None, len(lens), len(lens) + rng.randint(1, 64)))
        arg = torch.tensor(lens, dtype=torch.int32) if rng.random() < 0.5 else lens
        ctx = (lens[:16], len(lens), s_q, H, n_sm, kw, mb)
        old = outcome(lambda: O.make_schedule(list(lens), s_q, H, n_sm, max_batch=mb, **kw))
        new = outcome(lambda: S.make_schedule(arg, s_q, H, n_sm, max_batch=mb, **kw))
        assert_same_schedule(old, new, ctx)


@pytest.mark.parametrize("seed", range(SEEDS))
def test_replanning_into_a_larger_out_equals_the_oracle(seed):
    """Re-planning twice into an out schedule of a larger max_batch (what a captured graph replays): the
    buffers hold exactly what the oracle writes into its own out, stale rows of the earlier steps included."""
    rng = random.Random(2000 + seed)
    for _ in range(CASES_PER_SEED // 2):
        lens, s_q, H, n_sm, kw = _case(rng)
        mb = len(lens) + rng.randint(0, 300)
        first = [rng.randint(0, 20000) for _ in range(mb)]
        outs = [outcome(lambda: M.make_schedule(first, s_q, H, n_sm, **kw)) for M in (O, S)]
        assert_same_schedule(outs[0], outs[1], ("first", len(first), s_q, H, n_sm, kw))
        if isinstance(outs[0], tuple):
            continue
        for step in range(2):
            step_lens = lens if step == 0 else random_lens(rng)[: mb]
            for t in (0, 1):
                res = [outcome(lambda: M.make_schedule(step_lens, s_q, H, n_sm, out=o, **kw))
                       for M, o in zip((O, S), outs)]
                assert (res[0] is outs[0]) == (res[1] is outs[1])
                assert_same_schedule(res[0], res[1], ("step", step, step_lens[:16], len(step_lens), s_q, H,
                                                      n_sm, kw))
                assert_same_schedule(outs[0], outs[1], ("buffers", step, len(step_lens), s_q, H, n_sm, kw))


@pytest.mark.parametrize("seed", range(SEEDS))
def test_host_functions_equal_the_oracle(seed):
    """plan_items, plan_balanced, plan_hybrid and even_columns return the same lists and stats."""
    rng = random.Random(3000 + seed)
    for _ in range(CASES_PER_SEED // 2):
        lens, s_q, H, n_sm, kw = _case(rng)
        cps, k = kw["ctas_per_sm"], kw["item_cost"]
        mbs = rng.choice((1, 1, 2, 5))
        assert (O.plan_items(lens, s_q, H, n_sm, cps, mbs) == S.plan_items(lens, s_q, H, n_sm, cps, mbs))
        assert (outcome(lambda: O.plan_balanced(lens, s_q, H, n_sm, cps, k))
                == outcome(lambda: S.plan_balanced(lens, s_q, H, n_sm, cps, k)))
        old = outcome(lambda: O.plan_hybrid(lens, s_q, H, n_sm, cps, k, kw["form"]))
        new = outcome(lambda: S.plan_hybrid(lens, s_q, H, n_sm, cps, k, kw["form"]))
        assert repr(old) == repr(new)  # repr: nan costs compare equal
        items, _, _ = O.plan_items(lens, s_q, H, n_sm, cps)
        cols = rng.choice((1, 7, 64, 132, 396))
        assert O.even_columns(items, cols, k) == S.even_columns(items, cols, k)


def test_errors_equal_the_oracle():
    bad = [
        (([5, -1, 3], 1, 16, 132), {}),
        (([5], 0, 16, 132), {}),
        (([5], 9, 16, 132), {}),
        (([5], 1, 0, 132), {}),
        (([5], 1, 129, 132), {}),
        (([5], 1, 16, 132), dict(form="balanced")),
        (([5], 1, 16, 132), dict(form="wide", balanced=True)),
        (([5], 1, 16, 132), dict(balanced=True, item_cost=-1)),
    ]
    for args, kw in bad:
        old = outcome(lambda: O.make_schedule(*args, device="cpu", **kw))
        new = outcome(lambda: S.make_schedule(*args, device="cpu", **kw))
        assert isinstance(old, tuple) and old == new, (args, kw, old, new)
    for balanced in (False, True):
        outs = [M.make_schedule([100] * 4, 1, 16, 132, device="cpu", balanced=balanced) for M in (O, S)]
        for args, kw in [(([1] * 5, 1, 16, 132), {}), (([1], 2, 16, 132), {}), (([1], 1, 16, 132),
                         dict(balanced=not balanced)), (([1], 1, 16, 64), {})]:
            kw = {"balanced": balanced, **kw}
            res = [outcome(lambda: M.make_schedule(*args, device="cpu", out=o, **kw)) for M, o in zip((O, S), outs)]
            if isinstance(res[0], tuple):
                assert res[0] == res[1], (args, kw)
            else:
                assert_same_schedule(*res, (args, kw))
