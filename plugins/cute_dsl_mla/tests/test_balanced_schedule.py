"""CPU tests of the balanced split-KV planner (schedule.plan_balanced, make_schedule(balanced=True)):
exhaustive invariants on random and edge length sets, the proven bounds, and a float64 emulation
of the balanced kernel's item loop + the combine against plain softmax attention."""

from __future__ import annotations

import math
import random

import pytest
import torch

from mla_cute_dsl.kernels import schedule as S

BN = S.BLOCK_N


def _nb(n):
    return -(-n // BN) if n > 0 else 0


def check_plan(lens, s_q, H, n_sm, cps=1, k=S.BALANCED_ITEM_COST, max_batch=None):
    """Every invariant the kernel and the combine rely on; returns (items, split, ranges, stats)."""
    items, split, ranges, st = S.plan_balanced(lens, s_q, H, n_sm, cps, k)
    rows = s_q * H
    m_blocks = -(-rows // S.block_m_for(rows))
    target = n_sm * cps
    C = S.balanced_cols(rows, n_sm, cps)
    assert C == st["num_cols"] == max(1, target // m_blocks)
    assert C * m_blocks <= max(target, m_blocks)  # never a second wave (one column at least)
    # ranges: C + 1 monotone offsets covering every item once, in order
    assert len(ranges) == C + 1 and ranges[0] == 0 and ranges[-1] == len(items)
    assert all(a <= b for a, b in zip(ranges, ranges[1:]))
    # every kv token of every request covered exactly once; items on block boundaries
    cover = [[0] * n for n in lens]
    for b, s, e, _ in items:
        assert 0 <= b < len(lens) and s % BN == 0 and s < e <= lens[b]
        assert e == lens[b] or e % BN == 0
        for t in range(s, e):
            cover[b][t] += 1
    for b, n in enumerate(lens):
        assert cover[b] == [1] * n, f"request {b} not covered exactly once"
    # a column's items: contiguous in the block stream, increasing requests
    stream_pos = {}
    acc = 0
    for b, n in enumerate(lens):
        stream_pos[b] = acc
        acc += _nb(n)
    total = acc
    col_blocks = []
    prev_end = 0
    for c in range(C):
        nblk = 0
        for i in range(ranges[c], ranges[c + 1]):
            b, s, e, _ = items[i]
            pos = stream_pos[b] + s // BN
            assert pos == prev_end, "column ranges are not one contiguous walk of the stream"
            prev_end = pos + _nb(e - s)
            nblk += _nb(e - s)
            if i > ranges[c]:
                assert items[i - 1][0] < b  # one item per (column, request)
        col_blocks.append(nblk)
    assert prev_end == total
    # split info: count per request, consecutive slots, count 1 -> slot -1 (writes out directly)
    per_req = {}
    for b, s, e, slot in items:
        per_req.setdefault(b, []).append((s, slot))
    used_slots = []
    for b, n in enumerate(lens):
        first, cnt = split[b]
        got = sorted(per_req.get(b, []))
        assert cnt == len(got) and (cnt == 0) == (n == 0)
        if cnt == 1:
            assert got[0][1] == -1
        elif cnt > 1:
            assert [sl for _, sl in got] == list(range(first, first + cnt))  # in kv order too
            used_slots += list(range(first, first + cnt))
    assert sorted(used_slots) == list(range(len(used_slots)))
    # buffer bounds (capacity_for / slots_for) and the counting bounds behind them
    n_reqs = sum(1 for n in lens if n > 0)
    assert len(items) <= n_reqs + C - 1 or (n_reqs == 0 and not items)
    assert len(items) <= S.capacity_for(max_batch or len(lens), n_sm, cps)
    assert len(used_slots) <= 2 * (C - 1)
    assert len(used_slots) <= S.slots_for(rows, n_sm, cps)
    # per-column blocks: the proven bound, and the cost budget it came from
    mx = max(col_blocks)
    assert mx == st["max_blocks"]
    if total:
        if k == 0:
            assert mx <= -(-total // C)
        else:
            assert mx <= (total + k * (n_reqs + C - 1)) // C + 1
        for c in range(C):
            cost = col_blocks[c] + k * (ranges[c + 1] - ranges[c])
            assert cost <= st["budget"]
        assert st["budget"] <= S.balanced_budget_bound(total, n_reqs, C, k)
        # when m_blocks divides the CTA count, k = 0 meets ceil(total * m_blocks / target) exactly
        if k == 0 and target % m_blocks == 0 and target >= m_blocks:
            assert mx <= -(-(total * m_blocks) // target)
    return items, split, ranges, st


EDGE = [
    [], [0], [0, 0, 0], [1], [63], [64], [65], [8192] * 64, [4096] * 128, [4096], [1] * 300,
    [0, 1, 0, 2, 64, 0], [8192] + [1] * 200, [1] * 131 + [100000], [64] * 132, [64] * 133,
    [128] * 132, [4096] * 32, [100000], [0] * 50 + [5],
]


@pytest.mark.parametrize("k", [0, 1, 2, 5])
@pytest.mark.parametrize("lens", EDGE)
def test_edge_length_sets(lens, k):
    for s_q, H in ((1, 16), (2, 16), (1, 128), (4, 128), (8, 128), (1, 5), (3, 63)):
        for n_sm in (132, 16, 1):
            check_plan(lens, s_q, H, n_sm, 1, k)


@pytest.mark.parametrize("seed", range(60))
def test_random_length_sets(seed):
    rng = random.Random(seed)
    B = rng.choice([1, 2, 3, 7, 33, 64, 131, 132, 133, 200, 500])
    s_q = rng.choice([1, 2, 4, 8])
    H = rng.choice([1, 5, 16, 32, 64, 128])
    n_sm = rng.choice([132, 114, 78, 16, 3])
    cps = rng.choice([1, 1, 2])
    maxlen = rng.choice([1, 20, 64, 140, 4096, 16384])
    lens = [rng.choice([0, rng.randint(0, maxlen), maxlen, rng.randint(0, s_q)]) for _ in range(B)]
    for k in (0, 1, 3):
        check_plan(lens, s_q, H, n_sm, cps, k)


def test_more_requests_than_ctas_puts_several_whole_requests_in_one_cta():
    lens = [100] * 500  # 2 blocks each, 1000 blocks over 132 columns
    items, split, ranges, st = check_plan(lens, 1, 16, 132)
    assert st["max_items"] >= 3
    whole = sum(1 for c in split if c[1] == 1)
    assert whole >= 500 - 131  # at most C - 1 requests are split


def test_m_blocks_partition_columns():
    # H=128 s_q=2: 256 rows, 4 m-blocks of 64 -> 33 columns x 4 = 132 CTAs
    _, _, ranges, st = check_plan([4096] * 16, 2, 128, 132)
    assert st["m_blocks"] == 4 and st["num_cols"] == 33 and len(ranges) == 34
    # 1024 rows: 16 m-blocks -> 8 columns (128 of 132 CTAs)
    assert check_plan([4096] * 16, 8, 128, 132)[3]["num_cols"] == 8
    # more m-blocks than SMs: still one column (one wave is impossible anyway)
    assert check_plan([4096] * 2, 8, 128, 8)[3]["num_cols"] == 1


def test_cost_model_numbers_for_the_notes():
    """Per-CTA blocks, balanced vs plan_items (the NOTES.md cost model section)."""
    items, _, _ = S.plan_items([8192] * 64, 1, 16, 132)
    assert len(items) == 128 and max(-(-(e - s) // BN) for _, s, e, _ in items) == 64
    for k in (0, 1):
        _, _, ranges, st = check_plan([8192] * 64, 1, 16, 132, 1, k)
        assert st["max_blocks"] == 63 and st["max_items"] == 2  # 8192 / 132 = 62.06
    _, _, _, st = check_plan([4096] * 128, 2, 16, 132)
    assert st["max_blocks"] == 63
    _, _, _, st = check_plan([4096], 1, 16, 132)
    assert st["max_blocks"] == 1


def test_make_schedule_balanced_buffers_and_in_place_update():
    sched = S.make_schedule([4096, 0, 17], 2, 16, 132, max_batch=8, device="cpu", balanced=True)
    assert sched.balanced and sched.num_cols == 132
    assert sched.cta_ranges.shape == (133,) and sched.cta_ranges.dtype == torch.int32
    assert sched.work_info.shape == (S.capacity_for(8, 132), 4)
    n = sched.num_items
    assert int(sched.cta_ranges[-1]) == n and (sched.work_info[n:, 0] == -1).all()
    assert sched.max_cta_blocks == 1 and sched.item_cost == S.BALANCED_ITEM_COST
    ptrs = (sched.work_info.data_ptr(), sched.split_info.data_ptr(), sched.cta_ranges.data_ptr())
    S.make_schedule(torch.tensor([8192] * 8, dtype=torch.int32), 2, 16, 132, device="cpu", out=sched,
                    balanced=True, form="balanced")  # forced: the hybrid keeps these uniform lengths even
    assert sched.form == "balanced"
    assert (sched.work_info.data_ptr(), sched.split_info.data_ptr(), sched.cta_ranges.data_ptr()) == ptrs
    items, split, ranges, _ = S.plan_balanced([8192] * 8, 2, 16, 132)
    assert sched.cta_ranges.tolist() == ranges
    assert sched.work_info[: len(items)].tolist() == [list(t) for t in items]
    assert sched.split_info.tolist() == [list(t) for t in split]
    with pytest.raises(ValueError, match="balanced"):
        S.make_schedule([1], 2, 16, 132, device="cpu", out=sched)  # default plan into a balanced one
    with pytest.raises(ValueError, match="balanced"):
        S.make_schedule([1], 2, 16, 132, device="cpu", balanced=True,
                        out=S.make_schedule([1], 2, 16, 132, device="cpu"))
    with pytest.raises(ValueError, match="GPU size"):
        S.make_schedule([1], 2, 16, 114, device="cpu", out=sched, balanced=True)
    # zero work: empty ranges, nothing to run; the default schedule has no ranges
    z = S.make_schedule([0, 0], 1, 16, 132, device="cpu", balanced=True)
    assert z.num_items == 0 and z.cta_ranges.tolist() == [0] * 133
    assert S.make_schedule([5], 1, 16, 132, device="cpu").cta_ranges is None


# ------------------------- float64 emulation: item loop + combine -------------------------


def _emulate(q, kv, lens, s_q, H, sched_items, split, ranges, num_slots, sm_scale, m_blocks, block_m):
    """What MLADecodePartial(balanced=True) and MLACombine compute, in float64: CTA (m, c) runs
    items[ranges[c]:ranges[c+1]] for rows m*block_m.., each item's online softmax over its kv
    range, then writes out/lse (slot -1) or its partial slot; the combine merges count != 1."""
    B = len(lens)
    R = s_q * H
    out = torch.full((B, R, 512), float("nan"), dtype=torch.float64)
    lse = torch.full((B, R), float("nan"), dtype=torch.float64)
    o_p = torch.full((num_slots, R, 512), float("nan"), dtype=torch.float64)
    l_p = torch.full((num_slots, R), float("nan"), dtype=torch.float64)
    for m in range(m_blocks):
        for c in range(len(ranges) - 1):
            for i in range(ranges[c], ranges[c + 1]):
                b, s, e, slot = sched_items[i]
                L = lens[b]
                for r in range(m * block_m, min(R, (m + 1) * block_m)):
                    lim = L - s_q + r // H + 1
                    mx, ssum = -math.inf, 0.0
                    acc = torch.zeros(512, dtype=torch.float64)
                    for n0 in range(s, e, BN):  # tile by tile, online softmax
                        t = torch.arange(n0, min(n0 + BN, e))
                        sc = kv[b, t] @ q[b, r] * sm_scale
                        sc = torch.where(t < lim, sc, torch.tensor(-math.inf, dtype=torch.float64))
                        m_new = max(mx, float(sc.max()))
                        m_use = 0.0 if m_new == -math.inf else m_new
                        p = torch.exp(sc - m_use)
                        corr = math.exp(mx - m_use) if mx != -math.inf else 0.0
                        ssum = ssum * corr + float(p.sum())
                        acc = acc * corr + p @ kv[b, t, :512]
                        mx = m_new
                    o_r = acc / ssum if ssum > 0 else torch.zeros(512, dtype=torch.float64)
                    l_r = mx + math.log(ssum) if ssum > 0 else -math.inf
                    if slot < 0:
                        out[b, r], lse[b, r] = o_r, l_r
                    else:
                        o_p[slot, r], l_p[slot, r] = o_r, l_r
    return emulate_combine(out, lse, o_p, l_p, split)


def emulate_combine(out, lse, o_p, l_p, split):
    """combine.py in float64, in place: every request b whose split count != 1 gets the LSE-weighted sum of its
    partials o_p / l_p [first:first + count] (split[b] = (first, count)); count 0 gives out 0 and lse -inf."""
    for b in range(out.shape[0]):
        first, cnt = split[b]
        if cnt == 1:
            continue
        for r in range(out.shape[1]):
            ls = l_p[first:first + cnt, r]
            mx = float(ls.max()) if cnt else -math.inf
            m_use = 0.0 if mx == -math.inf else mx
            w = torch.exp(ls - m_use)
            ssum = float(w.sum())
            out[b, r] = (w[:, None] * o_p[first:first + cnt, r]).sum(0) / ssum if ssum > 0 else 0.0
            lse[b, r] = m_use + math.log(ssum) if ssum > 0 else -math.inf
    return out, lse


def _reference(q, kv, lens, s_q, H, sm_scale):
    B = len(lens)
    R = s_q * H
    out = torch.zeros(B, R, 512, dtype=torch.float64)
    lse = torch.full((B, R), -math.inf, dtype=torch.float64)
    for b in range(B):
        L = lens[b]
        for r in range(R):
            lim = min(L, L - s_q + r // H + 1)
            if lim <= 0:
                continue
            sc = kv[b, :lim] @ q[b, r] * sm_scale
            lse[b, r] = torch.logsumexp(sc, 0)
            out[b, r] = torch.softmax(sc, 0) @ kv[b, :lim, :512]
    return out, lse


@pytest.mark.parametrize("seed", range(8))
def test_emulated_item_loop_and_combine_match_softmax_attention(seed):
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    s_q = rng.choice([1, 2, 4])
    H = rng.choice([1, 3, 5, 16]) if seed % 2 else rng.choice([40, 64])  # m_blocks 1 or > 1
    B = rng.choice([1, 3, 9, 40])
    n_sm = rng.choice([3, 7, 16])
    lens = [rng.choice([0, 1, max(0, s_q - 1), rng.randint(1, 300), 64, 128, 65]) for _ in range(B)]
    maxlen = max(lens + [1])
    q = torch.randn(B, s_q * H, 576, generator=g, dtype=torch.float64) * (10.0 if seed == 3 else 1.0)
    kv = torch.randn(B, maxlen, 576, generator=g, dtype=torch.float64)
    sm_scale = 1.0 / math.sqrt(192)
    rows = s_q * H
    bm = S.block_m_for(rows)
    mb = -(-rows // bm)
    items, split, ranges, st = check_plan(lens, s_q, H, n_sm, 1, rng.choice([0, 1, 2]))
    o, l = _emulate(q, kv, lens, s_q, H, items, split, ranges, S.slots_for(rows, n_sm), sm_scale, mb, bm)
    ro, rl = _reference(q, kv, lens, s_q, H, sm_scale)
    assert not torch.isnan(o).any() and not torch.isnan(l).any()  # every row written once
    assert torch.allclose(o, ro, rtol=1e-9, atol=1e-9)
    assert torch.equal(torch.isinf(l), torch.isinf(rl))
    fin = ~torch.isinf(rl)
    assert torch.allclose(l[fin], rl[fin], rtol=1e-9, atol=1e-9)
