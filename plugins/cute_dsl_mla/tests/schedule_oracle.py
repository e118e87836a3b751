# The split-KV planner as it was before the host planning was vectorized (mla_cute_dsl/kernels/schedule.py
# at commit 7d5eabd, verbatim below this comment except the unchanged bounds and helpers, now imported):
# the pure-Python implementation whose buffers the GPU kernels were verified with on an H200. Test and benchmark use only: test_schedule_equality.py checks that
# the vectorized planner produces exactly the same buffers, and benchmarks/plan_time.py times both.
"""Split-KV schedule for the SM90 MLA decode kernel: pure Python + torch.

Computed once per decode step on the host (shared by all layers), copied into
fixed-size device buffers so that the kernels' launch shapes never change
between steps (CUDA-graph capturable).

Work item i (row i of ``work_info``, int32 [capacity, 4]):
    (b, kv_start, kv_end, slot)
    b        request index, -1 for an unused row (the CTA exits)
    kv_start first kv token, a multiple of BLOCK_N (64)
    kv_end   one past the last kv token (a multiple of 64, or kv_len[b])
    slot     -1: the item covers the whole request and writes out/lse
             directly; >= 0: row of the partial buffers (o_partial,
             lse_partial) that the combine kernel merges.
``split_info`` (int32 [max_batch, 2]): (first slot, number of items) per
request; count 0 means kv_len 0 (combine writes out = 0, lse = -inf), count 1
means the item wrote out directly (combine skips it).

Every item of request b holds at most ``blocks_per_split`` 64-token blocks,
and the items of one request differ in size by at most one block.

Opt-in balanced schedule (``make_schedule(..., balanced=True)``, ``plan_balanced``): a fixed grid of
CTA columns each walks one contiguous range of the concatenated block stream of all requests, so the
same work_info/split_info rows are produced column by column, plus ``cta_ranges`` (int32
[num_cols + 1]: column c runs rows cta_ranges[c] .. cta_ranges[c + 1] - 1). Only
``MLADecodePartial(balanced=True)`` reads it (see the section above ``plan_balanced``). Such a schedule
is a hybrid (``plan_hybrid``): per step it holds either the balanced plan or the even plan_items plan in
the same format (``Schedule.form``), whichever ``choose_form`` predicts faster by a margin.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch

# the bounds and small helpers did not change in the vectorised planner: shared, not copied
from mla_cute_dsl.kernels.schedule import (  # noqa: E402
    BLOCK_N, D_V, block_m_for, capacity_for, slots_for, wide_combine_for)


@dataclass
class Schedule:
    """Device-side split-KV schedule plus the host numbers that made it."""

    work_info: torch.Tensor  # int32 [capacity, 4] (device)
    split_info: torch.Tensor  # int32 [max_batch, 2] (device)
    s_q: int
    num_heads: int
    block_m: int
    capacity: int
    num_slots: int
    num_items: int = 0
    blocks_per_split: int = 0
    wide_combine: bool = False  # run MLACombineWide for this step (wide_combine_for)
    # balanced split-KV (make_schedule(balanced=True)): int32 [num_cols + 1] item offsets per CTA
    # column (device, fixed size per decoder), else None
    cta_ranges: torch.Tensor | None = None
    item_cost: int = 0  # plan_balanced's per-item cost (balanced schedules)
    max_cta_blocks: int = 0  # most 64-token blocks one CTA walks this step (balanced schedules)
    # the plan this step runs: "even" (plan_items; in the balanced kernel's format for a balanced schedule)
    # or "balanced" (plan_balanced); a balanced schedule picks per step (plan_hybrid, choose_form)
    form: str = "even"
    # predicted_cost of each form this step (balanced schedules; nan for a form not planned)
    cost_even: float = float("nan")
    cost_balanced: float = float("nan")

    @property
    def balanced(self) -> bool:
        return self.cta_ranges is not None

    @property
    def num_cols(self) -> int:
        """CTA columns of the balanced grid (0 for a plan_items schedule)."""
        return 0 if self.cta_ranges is None else self.cta_ranges.shape[0] - 1

    @property
    def rows(self) -> int:
        return self.s_q * self.num_heads


def plan_items(kv_lens, s_q: int, num_heads: int, num_sms: int, ctas_per_sm: int = 1,
               min_blocks_per_split: int = 1):
    """Pure host logic: returns (items, split, blocks_per_split).

    items: list of (b, kv_start, kv_end, slot); split: list of (first_slot, count).
    """
    rows = s_q * num_heads
    m_blocks = -(-rows // block_m_for(rows))
    target = num_sms * ctas_per_sm
    nblocks = [(-(-int(n) // BLOCK_N)) if int(n) > 0 else 0 for n in kv_lens]
    total = sum(nblocks)
    if total == 0:
        return [], [(0, 0) for _ in nblocks], 0
    base = max(min_blocks_per_split, -(-(total * m_blocks) // target))
    # wave-aware choice: estimated makespan = waves * largest item (+ a small
    # cost per split item for the combine); never below `base`, which bounds
    # the buffer sizes (capacity_for / slots_for).
    best = None
    step = max(1, base // 32)
    for bps_c in range(base, 2 * base + 1, step):
        n_items = 0
        largest = 0
        for nb in nblocks:
            if nb:
                k = -(-nb // bps_c)
                n_items += k
                largest = max(largest, -(-nb // k))
        waves = -(-(n_items * m_blocks) // target)
        cost = waves * largest + 0.05 * n_items * m_blocks / target
        if best is None or cost < best[0] - 1e-9:
            best = (cost, bps_c)
    bps = best[1]
    items = []
    split = []
    next_slot = 0
    for b, (n, nb) in enumerate(zip(kv_lens, nblocks)):
        n = int(n)
        if nb == 0:
            split.append((0, 0))
            continue
        k = -(-nb // bps)
        base, extra = divmod(nb, k)
        if k == 1:
            items.append((b, 0, n, -1))
            split.append((0, 1))
            continue
        split.append((next_slot, k))
        start = 0
        for j in range(k):
            size = base + (1 if j < extra else 0)
            end = start + size
            items.append((b, start * BLOCK_N, min(end * BLOCK_N, n), next_slot + j))
            start = end
        next_slot += k
    return items, split, bps


# ---------------------------------------------------------------------------
# Balanced split-KV (opt-in; MLADecodePartial(balanced=True), make_schedule(balanced=True))
# ---------------------------------------------------------------------------
#
# A fixed grid of m_blocks x num_cols CTAs (num_cols = target // m_blocks, target = num_sms *
# ctas_per_sm) walks the concatenation of every request's 64-token KV blocks (request 0's blocks,
# then request 1's, ...). CTA column c takes one contiguous range of that stream, so it may finish
# one request's tail and start the next request's head; each (column, request) intersection is one
# work item (its own partial slot, or slot -1 when it covers the whole request). Items are stored
# column by column in stream order, so column c runs work_info[cta_ranges[c]:cta_ranges[c + 1]] and
# the items of one request are adjacent: their slots are consecutive (split_info holds the first
# and the count, as for plan_items).
#
# Cost model: a column costs its blocks plus ``item_cost`` block-equivalents per item (the per-item
# Q load, pipeline fill and epilogue). The planner finds the least per-column budget L for which a
# greedy walk fits in num_cols columns (greedy is optimal for contiguous pieces with a fixed cost
# per piece: being further along the stream never costs more), then re-walks with per-column
# budgets spread over the columns left (so the tail columns are not left empty), falling back to
# the plain greedy walk if the spread walk would not fit.
#
# Bounds (T = total blocks, N = requests with kv_len > 0, C = num_cols, k = item_cost):
#   * items <= N + C - 1: an item is a (column, request) pair and a column boundary adds at most
#     one pair -> items <= capacity_for(max_batch, num_sms, ctas_per_sm) = max_batch + target.
#   * slots (items of requests with > 1 item) <= 2 (C - 1): a split request holds at least one
#     of the C - 1 column boundaries, and its count is 1 + its boundaries
#     -> <= slots_for(rows, num_sms, ctas_per_sm) = 2 * target // m_blocks + 2.
#   * blocks per column: k = 0 -> <= ceil(T / C) (the spread walk gives every column
#     ceil(rest / columns left)). k > 0 -> <= floor((T + k (N + C - 1)) / C) + 1: a greedy column
#     closes only once it has spent more than L - k - 1, so if C columns did not suffice,
#     C (L - k) <= T + k (items) <= T + k (N + C - 1); hence L = floor((T + k (N + C - 1)) / C)
#     + k + 1 always fits, and a column's blocks are <= L - k.

#: default per-item cost in 64-token-block equivalents (see plan_balanced)
BALANCED_ITEM_COST = 1


def balanced_cols(rows: int, num_sms: int, ctas_per_sm: int = 1) -> int:
    """CTA columns of the balanced grid (fixed per decoder: rows, GPU)."""
    m_blocks = -(-rows // block_m_for(rows))
    return max(1, (num_sms * ctas_per_sm) // m_blocks)


def _walk(nblocks, cols: int, k: int, budget):
    """Greedy walk of the block stream. budget(c, rest_blocks, rest_reqs) -> cost cap of column c.
    Returns the per-column list of pieces [(b, first_block, n_blocks)], or None if > cols columns."""
    out = []
    pieces = []
    c = 0
    rest = sum(nblocks)
    rest_reqs = sum(1 for nb in nblocks if nb)
    rem = budget(0, rest, rest_reqs)
    for b, nb in enumerate(nblocks):
        pos = 0
        while pos < nb:
            if rem < k + 1:
                out.append(pieces)
                pieces = []
                c += 1
                if c >= cols:
                    return None
                rem = budget(c, rest, rest_reqs)
                continue
            t = min(nb - pos, rem - k)
            pieces.append((b, pos, t))
            rem -= k + t
            pos += t
            rest -= t
        if nb:
            rest_reqs -= 1
    out.append(pieces)
    out.extend([] for _ in range(cols - len(out)))
    return out


def balanced_budget_bound(total: int, n_reqs: int, cols: int, item_cost: int) -> int:
    """A per-column cost budget that always fits (see the bounds above)."""
    k = item_cost
    if k == 0:
        return max(1, -(-total // cols))
    return (total + k * (n_reqs + cols - 1)) // cols + k + 1


def plan_balanced(kv_lens, s_q: int, num_heads: int, num_sms: int, ctas_per_sm: int = 1,
                  item_cost: int = BALANCED_ITEM_COST):
    """Pure host logic of the balanced schedule: (items, split, cta_ranges, stats).

    items: (b, kv_start, kv_end, slot) column by column; split: (first_slot, count) per request;
    cta_ranges: num_cols + 1 item offsets (column c runs items[cta_ranges[c]:cta_ranges[c+1]]);
    stats: dict(num_cols, m_blocks, budget, max_blocks, max_items).
    """
    k = int(item_cost)
    if k < 0:
        raise ValueError("item_cost must be >= 0")
    rows = s_q * num_heads
    m_blocks = -(-rows // block_m_for(rows))
    cols = balanced_cols(rows, num_sms, ctas_per_sm)
    lens = [int(n) for n in kv_lens]
    nblocks = [(-(-n // BLOCK_N)) if n > 0 else 0 for n in lens]
    total = sum(nblocks)
    n_reqs = sum(1 for nb in nblocks if nb)
    stats = dict(num_cols=cols, m_blocks=m_blocks, budget=0, max_blocks=0, max_items=0)
    if total == 0:
        return [], [(0, 0) for _ in lens], [0] * (cols + 1), stats
    # least budget for which the greedy walk fits (binary search; hi always fits)
    lo = max(k + 1, -(-(total + k * n_reqs) // cols))
    hi = max(lo, balanced_budget_bound(total, n_reqs, cols, k))
    while lo < hi:
        mid = (lo + hi) // 2
        if _walk(nblocks, cols, k, lambda c, rb, rr: mid) is not None:
            hi = mid
        else:
            lo = mid + 1
    L = lo

    def spread(c, rest_blocks, rest_reqs):
        left = cols - c
        return min(L, max(k + 1, -(-(rest_blocks + k * rest_reqs) // left) + k))

    plan = _walk(nblocks, cols, k, spread)
    if plan is None:
        plan = _walk(nblocks, cols, k, lambda c, rb, rr: L)
    # items, slots (consecutive per request: its pieces are adjacent in column order)
    pieces_of = [0] * len(lens)
    for col in plan:
        for b, _, _ in col:
            pieces_of[b] += 1
    split = []
    first_slot = {}
    next_slot = 0
    for b, cnt in enumerate(pieces_of):
        if cnt > 1:
            first_slot[b] = next_slot
            split.append((next_slot, cnt))
            next_slot += cnt
        else:
            split.append((0, cnt))
    seen = [0] * len(lens)
    items = []
    ranges = [0]
    for col in plan:
        for b, pos, t in col:
            end = min((pos + t) * BLOCK_N, lens[b])
            slot = first_slot[b] + seen[b] if pieces_of[b] > 1 else -1
            seen[b] += 1
            items.append((b, pos * BLOCK_N, end, slot))
        ranges.append(len(items))
    stats.update(budget=L,
                 max_blocks=max(sum(t for _, _, t in col) for col in plan),
                 max_items=max(len(col) for col in plan))
    return items, split, ranges, stats


# ---------------------------------------------------------------------------
# Hybrid (make_schedule(balanced=True)): per step, the balanced plan or the even plan in its format
# ---------------------------------------------------------------------------
#
# The balanced kernel runs any list of work items split into num_cols column ranges, so the even plan
# (plan_items) runs on it too: each even item whole in one column, a column carrying several items when
# there are more items than columns. make_schedule(balanced=True) plans both and keeps the even form
# unless the balanced one is predicted clearly faster (choose_form). Both forms fill the same buffers
# within the same bounds (items <= capacity_for, slots <= slots_for, num_cols + 1 ranges), so a CUDA
# graph captured at a step of one form replays correctly at a step of the other: the kernel, its grid
# and the buffer shapes never depend on the form.

#: choose_form picks the balanced plan only when its predicted cost is below (1 - HYBRID_MARGIN) times
#: the even form's (see choose_form for the measurements behind 10%)
HYBRID_MARGIN = 0.10
#: hybrid forms, as recorded on Schedule.form
FORMS = ("even", "balanced")
# bytes of one 64-token block of a 16-bit cache: the cost model's unit (the balanced kernel is 16-bit only)
_BLOCK_BYTES = BLOCK_N * 576 * 2


def slot_cost(rows: int, m_blocks: int, cols: int) -> float:
    """Cost of one partial slot in 64-token-block reads per CTA: the fp32 partial (rows x (512 + 1) x 4
    bytes) is written by the partial kernel and read back by the combine, traffic the whole GPU shares
    (spread over cols x m_blocks CTAs). 0.89 blocks per slot at 16 rows on 132 CTAs, 1.78 at 32 rows."""
    return 2.0 * rows * (D_V + 1) * 4 / (_BLOCK_BYTES * max(1, cols * m_blocks))


def _item_blocks(item) -> int:
    _, s, e, _ = item
    return -(-(e - s) // BLOCK_N)


def even_columns(items, cols: int, item_cost: int = BALANCED_ITEM_COST):
    """The even plan's items (plan_items) in the balanced kernel's format: (items column by column,
    cta_ranges, blocks per column, items per column).

    Each item stays whole in one column. Longest-first to the least-loaded column (LPT, load = blocks +
    item_cost per item), unless dealing the longest-first order round-robin has a lower maximum: the
    round-robin column c holds items c, c + cols, ..., so no column exceeds waves x largest (waves =
    ceil(items / cols)), the makespan of the default kernel's one-CTA-per-item grid; the minimum of the two
    keeps that bound. Rows, slots and split_info are plan_items' own (slots are per request, not per
    position), so only the order of work rows changes."""
    k = int(item_cost)
    cols = max(1, int(cols))
    order = sorted(range(len(items)), key=lambda i: (-_item_blocks(items[i]), i))

    def cost(assign):
        load = [0] * cols
        for i, c in zip(order, assign):
            load[c] += _item_blocks(items[i]) + k
        return max(load) if items else 0

    lpt = []
    load = [(0, c) for c in range(cols)]  # (cost, column): a heap
    for i in order:
        cost_c, c = heapq.heappop(load)
        lpt.append(c)
        heapq.heappush(load, (cost_c + _item_blocks(items[i]) + k, c))
    rr = [j % cols for j in range(len(order))]
    assign = lpt if cost(lpt) <= cost(rr) else rr
    per_col = [[] for _ in range(cols)]
    for i, c in zip(order, assign):
        per_col[c].append(i)
    out, ranges, col_blocks, col_items = [], [0], [], []
    for col in per_col:
        col.sort()  # plan_items order inside a column (request, kv order)
        out.extend(items[i] for i in col)
        ranges.append(len(out))
        col_blocks.append(sum(_item_blocks(items[i]) for i in col))
        col_items.append(len(col))
    return out, ranges, col_blocks, col_items


def predicted_cost(col_blocks, col_items, n_slots: int, item_cost: int, rows: int, m_blocks: int) -> float:
    """Predicted makespan of a plan on the balanced kernel, in 64-token-block reads: the slowest column's
    blocks + item_cost per item, plus the partial slots' write + read traffic (slot_cost) shared by all
    CTAs."""
    cols = len(col_blocks)
    worst = max((b + item_cost * n for b, n in zip(col_blocks, col_items)), default=0)
    return worst + n_slots * slot_cost(rows, m_blocks, cols)


def choose_form(cost_even: float, cost_balanced: float, margin: float = HYBRID_MARGIN) -> str:
    """'balanced' only when its predicted cost is below (1 - margin) x the even form's, else 'even'.

    Why a margin of 10%. Measured on an H200 (bench_kernel.py --balanced, median of 50 graph replays,
    bf16, 132 SMs, item_cost 1; "default" = the default kernel on plan_items) against predicted_cost:

    ======================  ==========  ===========  ==============  ===============
    shape                   default us  balanced us  measured ratio  predicted ratio
    ======================  ==========  ===========  ==============  ===============
    B64 H16 sq1 S8192       152.9       156.6        1.024           65.3 / 65.9 = 0.992
    B128 H16 sq2 S4096      176.0       183.2        1.041           67.4 / 65.0 = 1.038
    B1 H16 sq1 S4096        11.3        11.4         1.009           same plan   = 1.0
    B32 H16 sq1 S4096       53.5        55.2         1.032           17.9 / 17.9 = 1.005
    B100 H16 sq1 S8192 var  180.8       124.9        0.691           49.4 / 87.4 = 0.565
    ======================  ==========  ===========  ==============  ===============

    A least-squares line through the five: measured = 0.265 + 0.754 x predicted (residuals <= 1.1
    points). The 0.265 is what the cost model leaves out: time that does not shrink with the blocks per
    CTA (launch, combine, the last wave's tail) plus the balanced kernel's own overhead (its item loop
    and extra items cost 1-3% even with the same plan, B1). So the balanced form breaks even at a
    predicted ratio of 0.974, and uniform lengths (predicted 0.99-1.04) must stay even. Choosing it
    below 0.90 expects a measured ratio <= 0.944 (>= 5% faster) and keeps 7 points of predicted ratio
    between the threshold and break-even, over six times the worst residual; B100 varlen (0.565)
    passes with a wide gap. The even form here runs on the balanced kernel (one launch shape per
    decoder), which is what B1 (same plan on both kernels: 1% apart) measures.
    """
    return "balanced" if cost_balanced < (1.0 - margin) * cost_even else "even"


def plan_hybrid(kv_lens, s_q: int, num_heads: int, num_sms: int, ctas_per_sm: int = 1,
                item_cost: int = BALANCED_ITEM_COST, form: str = "auto"):
    """Pure host logic of make_schedule(balanced=True): (form, items, split, cta_ranges, stats).

    form: 'auto' (choose_form over both plans), 'balanced' (plan_balanced) or 'even' (plan_items in the
    balanced kernel's format, even_columns). stats: num_cols, m_blocks, max_blocks, max_items,
    blocks_per_split, cost_even, cost_balanced (the latter two only for the forms that were planned; nan
    otherwise), and the chosen form's items are what the kernel runs."""
    if form not in ("auto",) + FORMS:
        raise ValueError(f"form must be one of auto, even, balanced; got {form!r}")
    k = int(item_cost)
    rows = s_q * num_heads
    m_blocks = -(-rows // block_m_for(rows))
    cols = balanced_cols(rows, num_sms, ctas_per_sm)
    stats = dict(num_cols=cols, m_blocks=m_blocks, cost_even=float("nan"), cost_balanced=float("nan"))
    plans = {}
    if form in ("auto", "even"):
        e_items, e_split, bps = plan_items(kv_lens, s_q, num_heads, num_sms, ctas_per_sm)
        e_rows, e_ranges, e_blocks, e_counts = even_columns(e_items, cols, k)
        e_slots = sum(c for _, c in e_split if c > 1)
        stats["cost_even"] = predicted_cost(e_blocks, e_counts, e_slots, k, rows, m_blocks)
        plans["even"] = (e_rows, e_split, e_ranges, max(e_blocks), max(e_counts), bps)
    if form in ("auto", "balanced"):
        b_items, b_split, b_ranges, st = plan_balanced(kv_lens, s_q, num_heads, num_sms, ctas_per_sm, k)
        b_blocks = [sum(_item_blocks(it) for it in b_items[b_ranges[c]:b_ranges[c + 1]]) for c in range(cols)]
        b_counts = [b_ranges[c + 1] - b_ranges[c] for c in range(cols)]
        b_slots = sum(c for _, c in b_split if c > 1)
        stats["cost_balanced"] = predicted_cost(b_blocks, b_counts, b_slots, k, rows, m_blocks)
        plans["balanced"] = (b_items, b_split, b_ranges, st["max_blocks"], st["max_items"], st["max_blocks"])
    chosen = form if form != "auto" else choose_form(stats["cost_even"], stats["cost_balanced"])
    items, split, ranges, max_blocks, max_items, bps = plans[chosen]
    stats.update(max_blocks=max_blocks, max_items=max_items, blocks_per_split=bps)
    return chosen, items, split, ranges, stats


def make_schedule(kv_lens_cpu, s_q: int, num_heads: int, num_sms: int, *,
                  max_batch: int | None = None, ctas_per_sm: int = 1,
                  device="cuda", out: Schedule | None = None, balanced: bool = False,
                  item_cost: int = BALANCED_ITEM_COST, form: str = "auto") -> Schedule:
    """Compute the split-KV schedule for one decode step.

    kv_lens_cpu: host sequence/tensor of per-request kv lengths (incl. new tokens).
    With ``out`` (a Schedule made earlier for the same s_q, num_heads and
    buffers), the device buffers are overwritten in place (graph replay keeps
    pointing at them).
    ``balanced=True``: a schedule for MLADecodePartial(balanced=True), i.e. ``mla_decode_sm90(...,
    balanced=True)``: work items column by column plus the per-column item ranges ``cta_ranges`` (int32
    [num_cols + 1]). ``form`` picks its plan: "auto" (the hybrid: per step the plan_balanced plan or the
    even plan_items plan in that format, whichever choose_form predicts; recorded in ``Schedule.form``),
    "balanced" or "even" (forced). Every form fits the same buffers, so a graph captured at one step
    replays at the next whatever each chose. ``item_cost`` is the per-item cost in blocks (plan_balanced
    and the prediction).
    """
    lens = [int(x) for x in (kv_lens_cpu.tolist() if hasattr(kv_lens_cpu, "tolist") else kv_lens_cpu)]
    if any(n < 0 for n in lens):
        raise ValueError("kv_lens must be >= 0")
    if not 1 <= s_q <= 8:
        raise ValueError(f"s_q must be in 1..8, got {s_q}")
    if not 1 <= num_heads <= 128:
        raise ValueError(f"num_heads must be in 1..128, got {num_heads}")
    rows = s_q * num_heads
    batch = len(lens)
    if out is None:
        max_batch = max(batch, max_batch or 0)
        cap = capacity_for(max_batch, num_sms, ctas_per_sm)
        slots = slots_for(rows, num_sms, ctas_per_sm)
    else:
        if out.s_q != s_q or out.num_heads != num_heads:
            raise ValueError("out schedule was made for another s_q/num_heads")
        max_batch = out.split_info.shape[0]
        cap, slots = out.capacity, out.num_slots
        if batch > max_batch:
            raise ValueError(f"batch {batch} exceeds the schedule's max_batch {max_batch}")
        if out.balanced != balanced:
            raise ValueError("out schedule was made with another balanced setting")
        if balanced and out.num_cols != balanced_cols(rows, num_sms, ctas_per_sm):
            raise ValueError("out schedule was made for another GPU size (balanced grid)")
    ranges = None
    max_cta_blocks = 0
    chosen, costs = "even", (float("nan"), float("nan"))
    if balanced:
        chosen, items, split, ranges, st = plan_hybrid(lens, s_q, num_heads, num_sms, ctas_per_sm, item_cost,
                                                       form)
        bps = st["blocks_per_split"]
        max_cta_blocks = st["max_blocks"]
        costs = (st["cost_even"], st["cost_balanced"])
    else:
        if form not in ("auto", "even"):
            raise ValueError(f"form={form!r} needs balanced=True (the default kernel runs the even plan)")
        items, split, bps = plan_items(lens, s_q, num_heads, num_sms, ctas_per_sm)
    n_slots_used = sum(c for _, c in split if c > 1)
    if len(items) > cap or n_slots_used > slots:
        raise AssertionError(f"schedule overflow: {len(items)}>{cap} or {n_slots_used}>{slots}")
    work = torch.full((cap, 4), -1, dtype=torch.int32)
    if items:
        work[: len(items)] = torch.tensor(items, dtype=torch.int32)
    spl = torch.zeros((max_batch, 2), dtype=torch.int32)
    if split:
        spl[:batch] = torch.tensor(split, dtype=torch.int32)
    rng = torch.tensor(ranges, dtype=torch.int32) if balanced else None
    if out is None:
        out = Schedule(work.to(device), spl.to(device), s_q, num_heads, block_m_for(rows),
                       cap, slots, cta_ranges=None if rng is None else rng.to(device))
    else:
        out.work_info.copy_(work, non_blocking=False)
        out.split_info.copy_(spl, non_blocking=False)
        if rng is not None:
            out.cta_ranges.copy_(rng, non_blocking=False)
    out.item_cost = int(item_cost) if balanced else 0
    out.max_cta_blocks = max_cta_blocks
    out.form = chosen
    out.cost_even, out.cost_balanced = costs
    out.num_items = len(items)
    out.blocks_per_split = bps
    out.wide_combine = wide_combine_for(batch, rows, num_sms)
    return out


def workspace_bytes(schedule: Schedule) -> int:
    """Bytes of the fp32 partial buffers (o_partial + lse_partial)."""
    return schedule.num_slots * schedule.rows * (D_V + 1) * 4


def alloc_workspace(schedule: Schedule, device="cuda"):
    """(o_partial [slots, rows, 512] fp32, lse_partial [slots, rows] fp32)."""
    return (
        torch.empty((schedule.num_slots, schedule.rows, D_V), dtype=torch.float32, device=device),
        torch.empty((schedule.num_slots, schedule.rows), dtype=torch.float32, device=device),
    )
