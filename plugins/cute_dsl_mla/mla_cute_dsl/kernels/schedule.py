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

Host cost. The planner runs on the engine's critical path once per step (a torch op costs 2-5 us on
the host, a Python step ~0.05-0.3 us), so: the blocks-per-split search is one candidates x requests
float64 matrix (a plain loop for a handful of requests); the even items are ``repeat_interleave``/
``cumsum`` ops (a Python loop up to batch 256, one fast path when no request is split); the balanced
walk runs in cost coordinates with one ``bisect`` per column (not per request), its rows come from the
column cuts as one flat list; the hybrid predicts both forms' costs from column loads alone and builds
only the chosen form's rows; the even form's LPT heap handles only the items beyond the first wave, as
integer keys. Lists become tensors through ``array`` (``torch.tensor(list)`` is slower per element).
Results go into CPU staging tensors kept on the Schedule, then one copy per device buffer. The outputs
are exactly those of the earlier pure-Python planner (kept verbatim in tests/schedule_oracle.py;
tests/test_schedule_equality.py compares the two on random inputs, benchmarks/plan_time.py times them).
"""

from __future__ import annotations

import heapq
from array import array
from bisect import bisect_right
from itertools import accumulate, chain, repeat
from operator import add, sub
from dataclasses import dataclass, field

import torch

BLOCK_N = 64
D_V = 512


def block_m_for(rows: int) -> int:
    """MMA M tile (packed query rows per CTA) for s_q * H rows."""
    if rows <= 16:
        return 16
    return 32 if rows <= 32 else 64


def capacity_for(max_batch: int, num_sms: int, ctas_per_sm: int = 1) -> int:
    """Rows of work_info: fixed per decoder (max batch, GPU)."""
    return max_batch + num_sms * ctas_per_sm


def slots_for(rows: int, num_sms: int, ctas_per_sm: int = 1) -> int:
    """Partial-buffer rows needed at most (see make_schedule's bound)."""
    m_blocks = -(-rows // block_m_for(rows))
    return 2 * (num_sms * ctas_per_sm) // m_blocks + 2


# MLACombine gives a query row one warp, 4 rows per CTA, walking all of its request's splits
COMBINE_ROWS_PER_CTA = 4


def combine_kind_for(batch: int, rows: int, num_sms: int) -> str:
    """Which kernel merges a step's split-KV partials: "wide" (MLACombineWide: one CTA per row and 128-column
    chunk, warps share out the splits), "chunked" (MLACombine with 128 columns per warp: four warps per row) or
    "row" (MLACombine, one warp per row). By the row kernel's CTA count, batch * ceil(rows / 4): wide below
    num_sms // 2, chunked below 4 * num_sms, row from there.

    Measured on an H200 with the combine forced each way, bf16 and fp8 caches, lengths 512-4096 (fp32
    partials). Up to 32 rows (docs/results/gpu11_combine/, H=16 s_q=1/2, batches 1-64): the chunked kernel
    was 7.5-85% slower than wide below 64 row CTAs, where rows split many ways need the warps of a CTA to
    share the splits, -5.5..+3.4% at 64, and 3.4-16% faster than the kernel the earlier rule picked at B=16
    s_q=2 and B=32 (B=16 s_q=2 S=512 16.8 -> 14.4 us), -9.5..+3% at B=64. At 128 and 256 rows
    (docs/results/gpu12_tune/combine_ab_h128.*, H=128 s_q=1/2, batches 1-32): chunked 7-13% faster than the
    earlier rule's wide or row kernel from 128 to 512 row CTAs (s_q=1 B=4-16, s_q=2 B=2-8; s_q=1 B=8 S=1024
    22.2 -> 19.2 us, s_q=2 B=4 S=4096 33.8 -> 30.9), wide best or tied at 32-64 (B=1-2), row at 1024 and up
    (B=32 s_q=1, B=16-32 s_q=2). Batch and rows only, never the lengths: a CUDA graph captured at one step
    replays the same combine at every later step of its batch size."""
    row_ctas = batch * -(-rows // COMBINE_ROWS_PER_CTA)
    if row_ctas < num_sms // 2:
        return "wide"
    return "chunked" if row_ctas < 4 * num_sms else "row"


def combine_params(kind: str) -> tuple:
    """(Schedule.wide_combine, Schedule.combine_cols) of a combine kind: wide, chunked or row."""
    if kind not in ("wide", "chunked", "row"):
        raise ValueError(f"combine kind must be wide, chunked or row, got {kind!r}")
    return kind == "wide", 128 if kind == "chunked" else 512


def wide_combine_for(batch: int, rows: int, num_sms: int) -> bool:
    """Whether MLACombineWide merges a step (combine_kind_for)."""
    return combine_kind_for(batch, rows, num_sms) == "wide"


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
    # launch the combine kernel with programmatic dependent launch (its CTAs scheduled while the partial
    # kernel runs, waiting in griddepcontrol.wait): a session setting (backend option pdl), kept per schedule
    pdl_combine: bool = False
    # 16-byte epilogue stores of 16-bit rows in the mma.sync / WGMMA / seesaw partial kernels (kernels/wide_store.py):
    # a session setting (backend option stores), kept per schedule like pdl_combine; the host entries pick the
    # kernel built for it
    wide_store: bool = False
    # MLACombine's columns per warp when wide_combine is false: 512 (one warp per query row) or 128 (four warps
    # per row). make_schedule sets both at every call (in-place re-plans too): its combine argument, or
    # combine_kind_for
    combine_cols: int = 512
    # combine=fused (make_schedule's combine argument): the partial kernel merges each split request in the last
    # CTA to finish one of its items (fused_merge.py) where it can (api.fused_supported: the balanced mma.sync
    # kernel at <= 32 rows, bf16/fp16 cache); elsewhere the combine kernel above (auto's kind) still runs
    fused_combine: bool = False
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
    # host staging tensors that make_schedule fills before copying into the device buffers (private)
    _staging: "_Staging | None" = field(default=None, repr=False, compare=False)

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


_I64 = torch.int64
_F64 = torch.float64


def _int_tensor(values: list) -> torch.Tensor:
    """A 1-D int64 tensor from a list of Python ints (through array: torch.tensor(list) is several times
    slower per element)."""
    return torch.frombuffer(array("q", values), dtype=_I64) if values else torch.zeros(0, dtype=_I64)


def _lens_tensor(kv_lens) -> torch.Tensor:
    """Per-request kv lengths as a 1-D int64 CPU tensor (values as int() of each element)."""
    if isinstance(kv_lens, torch.Tensor):
        return kv_lens.detach().to(device="cpu", dtype=_I64).reshape(-1)
    seq = kv_lens.tolist() if hasattr(kv_lens, "tolist") else kv_lens
    try:
        return _int_tensor(seq if isinstance(seq, list) else list(seq))
    except (TypeError, ValueError, OverflowError):
        return _int_tensor([int(n) for n in seq])


def _nblocks(lens: torch.Tensor) -> torch.Tensor:
    """64-token blocks per request (0 for kv_len <= 0)."""
    return ((lens + (BLOCK_N - 1)) // BLOCK_N).clamp_(min=0)


def _tuples(t: torch.Tensor) -> list:
    return [tuple(r) for r in t.tolist()]


#: _even_bps loops in Python up to this many (candidate, request) pairs, else builds the float64 matrix
_PY_BPS_MAX_PAIRS = 192


def _even_bps(nb: torch.Tensor, m_blocks: int, target: int, min_blocks_per_split: int = 1) -> int:
    """plan_items' blocks per split (0 when there is no kv block at all).

    Wave-aware choice among the candidates base, base + step, ..., 2 base (base = the least blocks per
    split that keeps the items within one wave's worth, which bounds the buffer sizes capacity_for /
    slots_for): estimated makespan = waves * largest item + a small cost per split item for the combine,
    cost = waves * largest + 0.05 * items * m_blocks / target; the first candidate whose cost is lower by
    more than 1e-9 than the best so far wins.

    A candidates x requests float64 matrix gives every candidate's item count and largest item at once.
    float64 is exact here: for integers a, b with a + b < 2**53 the rounded quotient lies strictly
    between the same two integers as a / b (or is a / b), so ceil(a / b) is exact; the cost is the same
    sequence of IEEE double operations as Python's evaluation of the formula."""
    total = int(nb.sum())
    if total == 0:
        return 0
    base = max(min_blocks_per_split, -(-(total * m_blocks) // target))
    step = max(1, base // 32)
    n_cand = base // step + 1
    if n_cand * nb.shape[0] <= _PY_BPS_MAX_PAIRS:  # few requests: the plain loop is cheaper than the ops
        nz = [x for x in nb.tolist() if x]
        best_cost, best = None, 0
        for i in range(n_cand):
            c = base + i * step
            n_items = largest = 0
            for x in nz:
                k = -(-x // c)
                n_items += k
                largest = max(largest, -(-x // k))
            waves = -(-(n_items * m_blocks) // target)
            cost = waves * largest + 0.05 * n_items * m_blocks / target
            if best_cost is None or cost < best_cost - 1e-9:
                best_cost, best = cost, i
        return base + best * step
    nbf = nb.to(_F64)
    cand = torch.arange(base, 2 * base + 1, step, dtype=_F64).unsqueeze(1)
    k = torch.ceil(nbf / cand)  # [candidates, requests]: items per request (0 for kv_len 0)
    n_items = k.sum(1)
    largest = torch.ceil(nbf / k.clamp_(min=1)).amax(1)
    waves = torch.ceil(n_items * m_blocks / target)
    costs = (waves * largest + 0.05 * n_items * m_blocks / target).tolist()
    best_cost, best = costs[0], 0
    for i, cost in enumerate(costs):
        if cost < best_cost - 1e-9:
            best_cost, best = cost, i
    return base + best * step


#: up to this batch, _even_items builds split requests' items in a Python loop (fewer, cheaper steps than
#: the ~25 torch ops of the vectorized construction at these sizes); larger batches use the torch ops
_PY_ITEMS_MAX_BATCH = 256


def _even_items_py(lens: torch.Tensor, nb: torch.Tensor, bps: int):
    """_even_items as a Python loop over the requests (same result)."""
    nbl, ln = nb.tolist(), lens.tolist()
    out, sizes = [], []
    ext, put = out.extend, sizes.append
    split = [0] * (2 * len(nbl))
    slot = 0
    for b, x in enumerate(nbl):
        if not x:
            continue
        if x <= bps:
            ext((b, 0, ln[b], -1))
            put(x)
            split[2 * b + 1] = 1
            continue
        k = -(-x // bps)
        q, extra = divmod(x, k)
        split[2 * b], split[2 * b + 1] = slot, k
        a = 0
        for t in range(k):
            z = a + q + 1 if t < extra else a + q
            ext((b, a * BLOCK_N, min(z * BLOCK_N, ln[b]), slot))
            slot += 1
            put(z - a)
            a = z
    return _int_tensor(out).view(-1, 4), _int_tensor(sizes), _int_tensor(split).view(-1, 2), slot


def _even_items(lens: torch.Tensor, nb: torch.Tensor, bps: int):
    """plan_items' items for a blocks per split: (rows int64 [n, 4], blocks int64 [n], split int64 [B, 2],
    slots used). Request b gets k = ceil(nb / bps) items, the first nb % k of them one block longer; a
    whole request (k = 1) writes out directly (slot -1), a split one takes k consecutive slots."""
    B = nb.shape[0]
    if bps == 0:
        z = torch.zeros(0, dtype=_I64)
        return z.reshape(0, 4), z, torch.zeros((B, 2), dtype=_I64), 0
    if int(nb.max()) <= bps:  # no request is split: one item per nonzero request
        nz = nb > 0
        b = torch.nonzero(nz).reshape(-1)
        rows = torch.zeros((b.shape[0], 4), dtype=_I64)
        rows[:, 0] = b
        rows[:, 2] = lens[b]
        rows[:, 3] = -1
        split = torch.zeros((B, 2), dtype=_I64)
        split[:, 1] = nz
        return rows, nb[b], split, 0
    if B <= _PY_ITEMS_MAX_BATCH:
        return _even_items_py(lens, nb, bps)
    k = (nb + (bps - 1)) // bps
    multi = k > 1
    kslot = k * multi
    cum = torch.cumsum(kslot, 0)
    first = cum - kslot  # first slot of a split request
    n_slots = int(cum[-1])
    split = torch.stack((first * multi, k), 1)
    kc = k.clamp(min=1)
    q = nb // kc
    # per-request values gathered once per item: blocks per item, longer items, length, first slot or -1
    # (+ the item's index minus its position in the request, so that position = arange - that)
    item_end = torch.cumsum(k, 0)
    n = int(item_end[-1])
    per_req = torch.stack((q, nb - q * kc, lens, torch.where(multi, first, -1), item_end - k,
                           torch.arange(B, dtype=_I64)), 1)
    g = per_req[torch.repeat_interleave(k, output_size=n)]
    j = torch.arange(n, dtype=_I64) - g[:, 4]
    qb, eb = g[:, 0], g[:, 1]
    sblk = j * qb + torch.minimum(j, eb)
    size = qb + (j < eb)
    rows = torch.empty((n, 4), dtype=_I64)
    rows[:, 0] = g[:, 5]
    torch.mul(sblk, BLOCK_N, out=rows[:, 1])
    torch.minimum((sblk + size) * BLOCK_N, g[:, 2], out=rows[:, 2])
    slot = g[:, 3]
    torch.where(slot >= 0, slot + j, slot, out=rows[:, 3])
    return rows, size, split, n_slots


def plan_items(kv_lens, s_q: int, num_heads: int, num_sms: int, ctas_per_sm: int = 1,
               min_blocks_per_split: int = 1):
    """Pure host logic: returns (items, split, blocks_per_split).

    items: list of (b, kv_start, kv_end, slot); split: list of (first_slot, count).
    Every item of request b holds at most blocks_per_split blocks and its items differ by at most one
    block (see _even_bps for the choice of blocks_per_split; make_schedule uses the same tensor code).
    """
    rows = s_q * num_heads
    m_blocks = -(-rows // block_m_for(rows))
    lens = _lens_tensor(kv_lens)
    nb = _nblocks(lens)
    bps = _even_bps(nb, m_blocks, num_sms * ctas_per_sm, min_blocks_per_split)
    items, _, split, _ = _even_items(lens, nb, bps)
    return _tuples(items), _tuples(split), bps


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
# The item cost and the hybrid's 10% margin were measured with 16-bit caches (bf16 / fp16); the balanced seesaw
# with an fp8 cache (backend.FP8_SEESAW_BALANCED, on since 0.2.17) uses them unchanged, not re-measured: an
# fp8 tile's load (ld.global + convert + st.shared by the math warpgroups) costs a different share of an item.
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
#
# The walk in cost coordinates (how _walk runs it: one bisect per column, not a loop over requests).
# Lay the nonzero requests out as a cost stream, request i taking [P[i], P[i + 1]) with P[i + 1] - P[i]
# = k + nb_i (its item cost, then its blocks). Let e be the stream point a column starts from, counting
# the extra item cost k of a column that starts inside a request as if it were that request's own: e =
# P[i] for a column starting at request i's first block, e = P[i] + pos for one starting at block pos > 0
# of request i. A column with budget L then covers [e, y = e + L]: every request ending by y whole; if y
# is past the end, the walk is done; else y falls in request j (P[j] <= y < P[j + 1]) and the column
# either takes y - P[j] - k >= 1 blocks of j (next e = y - k) or, when y - P[j] <= k (no block fits
# after the item cost), closes there (next e = P[j]). The spread budget of a column only needs the rest
# of the stream: rest_blocks + k * rest_reqs = P[N] - e. A column starting at e begins at block
# e - k * i of the block stream (i: the request holding e), and the items are the non-empty
# intersections of the column ranges and the request ranges of the block stream.

#: default per-item cost in 64-token-block equivalents (see plan_balanced)
BALANCED_ITEM_COST = 1


def balanced_cols(rows: int, num_sms: int, ctas_per_sm: int = 1) -> int:
    """CTA columns of the balanced grid (fixed per decoder: rows, GPU)."""
    m_blocks = -(-rows // block_m_for(rows))
    return max(1, (num_sms * ctas_per_sm) // m_blocks)


def _fits(P: list, cols: int, k: int, L: int) -> bool:
    """Whether the greedy walk of the cost stream P (see the section comment) with budget L per column
    fits in cols columns. A run of columns inside one request moves on by L - k each, counted at once."""
    end = P[-1]
    d = L - k  # >= 1 (L >= k + 1)
    e = c = 0
    while True:
        y = e + L
        if y >= end:
            return True
        j = bisect_right(P, y) - 1
        p = P[j]
        if y - p <= k:  # no block of request j fits after its item cost: the next column starts at j
            e = p
            c += 1
        else:  # y - p - k blocks of j; the next m columns start inside j as well (y + i d < P[j + 1])
            m = (P[j + 1] - y - 1) // d
            e = y - k + m * d
            c += m + 1
        if c >= cols:
            return False


def _walk(P: list, cols: int, k: int, L: int, spread: bool):
    """The greedy walk of the cost stream P (see the section comment), column by column, with budget L
    per column or (spread) min(L, max(k + 1, ceil(rest / columns left) + k)), rest = P[-1] - e.
    Returns None if it needs more than cols columns, else (starts, firsts, counts, inner, slots): for
    the columns used, start point e, first (nonzero) request and items; the column starts inside a
    request as (request, block offset in it), in stream order; the slots of the whole plan (each start
    inside a request adds a piece to it: slots = such starts + the requests that hold one)."""
    end = P[-1]
    n_req = len(P) - 1
    starts, firsts, counts, inner = [0], [0], [], []
    e = c = first = split_reqs = 0
    prev = -1
    while True:
        if spread:
            b = -(-(end - e) // (cols - c)) + k
            y = e + (L if b > L else (k + 1 if b < k + 1 else b))
        else:
            y = e + L
        if y >= end:
            counts.append(n_req - first)
            return starts, firsts, counts, inner, len(inner) + split_reqs
        j = bisect_right(P, y) - 1
        p = P[j]
        if y - p <= k:
            e = p
            counts.append(j - first)
        else:
            e = y - k
            counts.append(j - first + 1)
            inner.append((j, e - p))
            if j != prev:
                split_reqs += 1
                prev = j
        first = j
        c += 1
        if c >= cols:
            return None
        starts.append(e)
        firsts.append(j)


def balanced_budget_bound(total: int, n_reqs: int, cols: int, item_cost: int) -> int:
    """A per-column cost budget that always fits (see the bounds above)."""
    k = item_cost
    if k == 0:
        return max(1, -(-total // cols))
    return (total + k * (n_reqs + cols - 1)) // cols + k + 1


class _BalancedWalk:
    """plan_balanced's walk: per column (block start, first nonzero request, items), the budget, the slots
    and the numbers predicted_cost and the stats need (computed without building the items)."""

    def __init__(self, nb: torch.Tensor, cols: int, k: int):
        self.cols, self.k = cols, k
        nzn = nb[nb > 0]
        self.n_req = N = nzn.shape[0]
        P = [0]
        P += torch.cumsum(nzn + k, 0).tolist()
        self.total = total = P[-1] - k * N
        self.budget = 0
        self.worst = self.max_blocks = self.max_items = self.slots = 0
        if total == 0:
            self.counts, self.inner = [0] * cols, []
            return
        # least budget for which the greedy walk fits (binary search; hi always fits)
        lo = max(k + 1, -(-(total + k * N) // cols))
        hi = max(lo, balanced_budget_bound(total, N, cols, k))
        while lo < hi:
            mid = (lo + hi) // 2
            if _fits(P, cols, k, mid):
                hi = mid
            else:
                lo = mid + 1
        self.budget = L = lo
        walk = _walk(P, cols, k, L, True)
        if walk is None:
            walk = _walk(P, cols, k, L, False)
        starts, firsts, counts, self.inner, self.slots = walk
        pad = cols - len(counts)
        # block stream start of each column (a start point e inside request i is block e - k * i)
        S = list(map(sub, starts, firsts if k == 1 else [k * f for f in firsts]))
        S += [total] * (pad + 1)
        blocks = list(map(sub, S[1:], S[:-1]))
        self.counts = counts + [0] * pad
        self.worst = max(map(add, blocks, self.counts if k == 1 else [k * n for n in self.counts]))
        self.max_blocks, self.max_items = max(blocks), max(counts)

    def rows(self, lens: torch.Tensor, nb: torch.Tensor):
        """(rows int64 [n, 4] column by column, split int64 [B, 2], ranges int64 [cols + 1]).

        Stream order is request order, so the rows are the nonzero requests in order, whole (slot -1)
        except where column starts fall inside them (self.inner): those are cut there and take
        consecutive slots. Built as one flat Python list (runs of whole requests through zip/chain)."""
        B = nb.shape[0]
        ranges = [0]
        ranges += accumulate(self.counts)
        split = torch.zeros((B, 2), dtype=_I64)
        if ranges[-1] == 0:
            return torch.zeros((0, 4), dtype=_I64), split, _int_tensor(ranges)
        nzi = torch.nonzero(nb).reshape(-1)
        split[nzi, 1] = 1
        nz, ln = nzi.tolist(), lens[nzi].tolist()
        out = []
        ext = out.extend
        cut_reqs, cut_split = [], []
        r = slot = 0
        inner = self.inner
        n_inner = len(inner)
        t = 0
        while t < n_inner:
            j = inner[t][0]
            if j > r:  # whole requests r .. j - 1
                ext(chain.from_iterable(zip(nz[r:j], repeat(0), ln[r:j], repeat(-1))))
            b = nz[j]
            first = slot
            a = 0
            while t < n_inner and inner[t][0] == j:
                z = inner[t][1]
                ext((b, a * BLOCK_N, z * BLOCK_N, slot))
                slot += 1
                a = z
                t += 1
            ext((b, a * BLOCK_N, ln[j], slot))
            slot += 1
            cut_reqs.append(b)
            cut_split += (first, slot - first)
            r = j + 1
        if r < len(nz):
            ext(chain.from_iterable(zip(nz[r:], repeat(0), ln[r:], repeat(-1))))
        if cut_reqs:
            split[_int_tensor(cut_reqs)] = _int_tensor(cut_split).view(-1, 2)
        return _int_tensor(out).view(-1, 4), split, _int_tensor(ranges)


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
    lens = _lens_tensor(kv_lens)
    nb = _nblocks(lens)
    walk = _BalancedWalk(nb, cols, k)
    items, split, ranges = walk.rows(lens, nb)
    stats = dict(num_cols=cols, m_blocks=m_blocks, budget=walk.budget, max_blocks=walk.max_blocks,
                 max_items=walk.max_items)
    return _tuples(items), _tuples(split), ranges.tolist(), stats


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
#: make_schedule(balanced=True, form="pair"): every request split in two halves merged through DSMEM by a 2-CTA cluster
#: (MLADecodePartial(balanced=True, pair=True)); opt-in only, never chosen by form="auto"
PAIR_FORM = "pair"
#: work-row slot codes of the pair form's halves (distinct from -1 = whole request written directly, >= 0 = a
#: partial slot): the kernel built with pair=True merges the two halves in its cluster instead of writing partials
PAIR_LO, PAIR_HI = -2, -3


def _pair_rows(lens: torch.Tensor, nb: torch.Tensor, cols: int):
    """The pair form (make_schedule(balanced=True, form="pair")): (rows int64 [n, 4] column by column, split int64
    [B, 2], ranges int64 [cols + 1], blocks per column as a list).

    Request r takes CTA columns 2r and 2r + 1 (one 2-CTA cluster of the pair kernel's (1, 2, 1) cluster grid):
    with nb >= 2 blocks, blocks [0, mid) in column 2r (slot PAIR_LO) and [mid, nb) in column 2r + 1 (slot
    PAIR_HI), mid = ceil(nb / 2); with one block a whole item in column 2r (slot -1, written directly) and
    nothing in 2r + 1; length 0: no item. Every other column is empty, so no column holds more than one item and
    a PAIR_LO item always has its PAIR_HI peer in the other CTA of its cluster (the kernel's cluster barriers
    cannot deadlock). split_info is (0, 1) for every request with KV (the combine kernel skips it: count 1) and
    (0, 0) for length 0 (the combine writes out = 0, lse = -inf as for the other forms). No partial slot is used.
    Needs 2 B <= cols (ValueError otherwise)."""
    B = nb.shape[0]
    if 2 * B > cols:
        raise ValueError(f"form='pair' needs 2 * batch <= num_cols: batch {B}, num_cols {cols}")
    nbl, ln = nb.tolist(), lens.tolist()
    out, counts, col_blocks = [], [0] * cols, [0] * cols
    ext = out.extend
    for r, x in enumerate(nbl):
        if x == 0:
            continue
        c = 2 * r
        if x == 1:
            ext((r, 0, ln[r], -1))
            counts[c], col_blocks[c] = 1, 1
            continue
        mid = -(-x // 2)
        ext((r, 0, mid * BLOCK_N, PAIR_LO))
        ext((r, mid * BLOCK_N, ln[r], PAIR_HI))
        counts[c] = counts[c + 1] = 1
        col_blocks[c], col_blocks[c + 1] = mid, x - mid
    split = torch.zeros((B, 2), dtype=_I64)
    split[:, 1] = nb > 0
    ranges = [0]
    ranges += accumulate(counts)
    return _int_tensor(out).view(-1, 4), split, _int_tensor(ranges), col_blocks
# bytes of one 64-token block of a 16-bit cache: the cost model's unit (the balanced kernel is 16-bit only)
_BLOCK_BYTES = BLOCK_N * 576 * 2


def slot_cost(rows: int, m_blocks: int, cols: int) -> float:
    """Cost of one partial slot in 64-token-block reads per CTA: the fp32 partial (rows x (512 + 1) x 4
    bytes) is written by the partial kernel and read back by the combine, traffic the whole GPU shares
    (spread over cols x m_blocks CTAs). 0.89 blocks per slot at 16 rows on 132 CTAs, 1.78 at 32 rows.
    With 16-bit partials (alloc_workspace partial_dtype; the backend's option partials=q) a slot costs about
    half that; the hybrid plan does not model it (the schedule does not know the workspace's dtype, and the
    backend's default runs 16-bit partials only with fp8reg, which has no balanced plan)."""
    return 2.0 * rows * (D_V + 1) * 4 / (_BLOCK_BYTES * max(1, cols * m_blocks))


def _lpt(costs: list, cols: int):
    """Longest-first to the least-loaded column, costs in that order: (column of each item as a tensor,
    the largest column load). Ties go to the lower column (a heap of (load, column)).

    With every cost > 0 the first cols items take columns 0 .. cols - 1 in order (each empty column is
    popped before any loaded one), so only the items after the first wave go through the heap, whose
    entries are then the single integers load * cols + column (the same order as the pairs)."""
    n = len(costs)
    if n >= cols and costs[-1] > 0:  # costs are sorted descending: all > 0
        heap = [x * cols + c for c, x in enumerate(costs[:cols])]
        heapq.heapify(heap)
        popped = []
        put = popped.append
        push = heapq.heapreplace
        for x in costs[cols:]:
            top = heap[0]
            push(heap, top + x * cols)
            put(top)
        assign = torch.cat((torch.arange(cols, dtype=_I64), _int_tensor(popped) % cols))
        return assign, max(heap) // cols
    assign = []
    load = [(0, c) for c in range(cols)]
    for x in costs:
        cost_c, c = heapq.heappop(load)
        assign.append(c)
        heapq.heappush(load, (cost_c + x, c))
    return _int_tensor(assign), max(load)[0]


class _EvenColumns:
    """even_columns on tensors, from each item's blocks (plan_items order): the column of each item in
    longest-first order (None: round-robin) and the largest column cost (blocks + k per item), which is
    all predicted_cost needs; layout() then gives the rows' order column by column and the ranges."""

    def __init__(self, blocks: torch.Tensor, cols: int, k: int):
        self.blocks, self.cols = blocks, cols
        self.n = n = blocks.shape[0]
        self.order = self.assign = None
        self.worst = 0
        if n == 0:
            return
        self.order = order = torch.argsort(blocks, descending=True, stable=True)  # ties by index
        costs = blocks[order] + k
        cl = costs.tolist()
        if cl[-1] > 0 and (n <= cols or cl[0] == cl[-1]):
            # LPT deals these round-robin too: one item per column, or equal costs (each round pops the
            # columns in order, all at the same load)
            self.worst = cl[0] * -(-n // cols)
            return
        rr = torch.arange(n, dtype=_I64) % cols
        rr_worst = int(torch.zeros(cols, dtype=_I64).index_add_(0, rr, costs).max())
        lpt, lpt_worst = _lpt(cl, cols)
        if lpt_worst <= rr_worst:
            self.assign, self.worst = lpt, lpt_worst
        else:
            self.worst = rr_worst

    def layout(self):
        """(row order column by column, ranges int64 [cols + 1], blocks per column, items per column)."""
        n, cols = self.n, self.cols
        ranges = torch.zeros(cols + 1, dtype=_I64)
        if n == 0:
            z = torch.zeros(cols, dtype=_I64)
            return torch.zeros(0, dtype=_I64), ranges, z, z
        assign = self.assign
        if assign is None:
            assign = torch.arange(n, dtype=_I64)
            if n > cols:
                assign %= cols
        col = torch.empty(n, dtype=_I64)
        col[self.order] = assign
        perm = torch.argsort(col, stable=True)  # plan_items order inside a column
        counts = torch.bincount(col, minlength=cols)
        torch.cumsum(counts, 0, out=ranges[1:])
        col_blocks = torch.zeros(cols, dtype=_I64).index_add_(0, col, self.blocks)
        return perm, ranges, col_blocks, counts


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
    items = list(items)
    blocks = torch.tensor([-(-(e - s) // BLOCK_N) for _, s, e, _ in items], dtype=_I64)
    perm, ranges, col_blocks, col_items = _EvenColumns(blocks, cols, k).layout()
    return [items[i] for i in perm.tolist()], ranges.tolist(), col_blocks.tolist(), col_items.tolist()


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


def _plan_hybrid(lens: torch.Tensor, s_q: int, num_heads: int, num_sms: int, ctas_per_sm: int, k: int,
                 form: str):
    """plan_hybrid on tensors: (form, rows int64 [n, 4], split int64 [B, 2], ranges int64 [cols + 1],
    slots used, stats). Both forms' predicted costs come from the column loads alone (_EvenColumns,
    _BalancedWalk); only the chosen form's rows are built."""
    if form not in ("auto", PAIR_FORM) + FORMS:
        raise ValueError(f"form must be one of auto, even, balanced; got {form!r}")  # (or the opt-in "pair")
    rows = s_q * num_heads
    m_blocks = -(-rows // block_m_for(rows))
    cols = balanced_cols(rows, num_sms, ctas_per_sm)
    stats = dict(num_cols=cols, m_blocks=m_blocks, cost_even=float("nan"), cost_balanced=float("nan"))
    nb = _nblocks(lens)
    if form == PAIR_FORM:
        items, split, ranges, col_blocks = _pair_rows(lens, nb, cols)
        stats.update(max_blocks=max(col_blocks, default=0), max_items=1 if items.shape[0] else 0,
                     blocks_per_split=max(col_blocks, default=0))
        return PAIR_FORM, items, split, ranges, 0, stats
    per_slot = slot_cost(rows, m_blocks, cols)
    if form in ("auto", "even"):
        bps = _even_bps(nb, m_blocks, num_sms * ctas_per_sm)
        e_items, e_blocks, e_split, e_slots = _even_items(lens, nb, bps)
        even = _EvenColumns(e_blocks, cols, k)
        stats["cost_even"] = even.worst + e_slots * per_slot
    if form in ("auto", "balanced"):
        if k < 0:
            raise ValueError("item_cost must be >= 0")
        bal = _BalancedWalk(nb, cols, k)
        stats["cost_balanced"] = bal.worst + bal.slots * per_slot
    chosen = form if form != "auto" else choose_form(stats["cost_even"], stats["cost_balanced"])
    if chosen == "even":
        perm, ranges, col_blocks, col_items = even.layout()
        items, split, n_slots = e_items[perm], e_split, e_slots
        stats.update(max_blocks=int(col_blocks.max()), max_items=int(col_items.max()), blocks_per_split=bps)
    else:
        items, split, ranges = bal.rows(lens, nb)
        n_slots = bal.slots
        stats.update(max_blocks=bal.max_blocks, max_items=bal.max_items, blocks_per_split=bal.max_blocks)
    return chosen, items, split, ranges, n_slots, stats


def plan_hybrid(kv_lens, s_q: int, num_heads: int, num_sms: int, ctas_per_sm: int = 1,
                item_cost: int = BALANCED_ITEM_COST, form: str = "auto"):
    """Pure host logic of make_schedule(balanced=True): (form, items, split, cta_ranges, stats).

    form: 'auto' (choose_form over both plans), 'balanced' (plan_balanced) or 'even' (plan_items in the
    balanced kernel's format, even_columns). stats: num_cols, m_blocks, max_blocks, max_items,
    blocks_per_split, cost_even, cost_balanced (the latter two only for the forms that were planned; nan
    otherwise), and the chosen form's items are what the kernel runs."""
    if form not in ("auto", PAIR_FORM) + FORMS:
        raise ValueError(f"form must be one of auto, even, balanced; got {form!r}")  # (or the opt-in "pair")
    chosen, items, split, ranges, _, stats = _plan_hybrid(_lens_tensor(kv_lens), s_q, num_heads, num_sms,
                                                          ctas_per_sm, int(item_cost), form)
    return chosen, _tuples(items), _tuples(split), ranges.tolist(), stats


class _Staging:
    """Host tensors a schedule's buffers are filled from (one copy each into the device buffers)."""

    def __init__(self, cap: int, max_batch: int, n_ranges: int):
        self.work = torch.empty((cap, 4), dtype=torch.int32)
        self.split = torch.empty((max_batch, 2), dtype=torch.int32)
        self.ranges = torch.empty(n_ranges, dtype=torch.int32) if n_ranges else None

    def fits(self, cap: int, max_batch: int, n_ranges: int) -> bool:
        return (self.work.shape[0] == cap and self.split.shape[0] == max_batch
                and (self.ranges.shape[0] if self.ranges is not None else 0) == n_ranges)


def make_schedule(kv_lens_cpu, s_q: int, num_heads: int, num_sms: int, *,
                  max_batch: int | None = None, ctas_per_sm: int = 1,
                  device="cuda", out: Schedule | None = None, balanced: bool = False,
                  item_cost: int = BALANCED_ITEM_COST, form: str = "auto", combine: str = "auto") -> Schedule:
    """Compute the split-KV schedule for one decode step.

    kv_lens_cpu: host sequence/tensor of per-request kv lengths (incl. new tokens).
    With ``out`` (a Schedule made earlier for the same s_q, num_heads and
    buffers), the device buffers are overwritten in place (graph replay keeps
    pointing at them).
    ``balanced=True``: a schedule for MLADecodePartial(balanced=True), i.e. ``mla_decode_sm90(...,
    balanced=True)``: work items column by column plus the per-column item ranges ``cta_ranges`` (int32
    [num_cols + 1]). ``form`` picks its plan: "auto" (the hybrid: per step the plan_balanced plan or the
    even plan_items plan in that format, whichever choose_form predicts; recorded in ``Schedule.form``),
    "balanced" or "even" (forced), or "pair" (opt-in, never chosen by auto: request r split into two halves in
    columns 2r and 2r + 1, merged in the kernel through DSMEM, _pair_rows; for MLADecodePartial(balanced=True,
    pair=True) only, api.launch_pair; ValueError when 2 * batch > num_cols). Every form fits the same buffers, so
    a graph captured at one step replays at the next whatever each chose (except a pair step launched without the
    combine kernel, api.launch_pair's default: its graph must replay pair steps only). ``item_cost`` is the per-item cost in blocks (plan_balanced
    and the prediction). ``combine``: the kernel that merges the partials, "auto" (combine_kind_for, by batch and
    rows) or a forced "wide", "chunked" or "row" (Schedule.wide_combine / combine_cols), at every call; "fused":
    Schedule.fused_combine, the partial kernel merges the splits where it can (api.fused_supported), auto's kind
    where it cannot.
    """
    lens = _lens_tensor(kv_lens_cpu)
    if lens.shape[0] and int(lens.min()) < 0:
        raise ValueError("kv_lens must be >= 0")
    if not 1 <= s_q <= 8:
        raise ValueError(f"s_q must be in 1..8, got {s_q}")
    if combine not in ("auto", "fused"):
        combine_params(combine)  # a ValueError naming the kinds, before any work
    if not 1 <= num_heads <= 128:
        raise ValueError(f"num_heads must be in 1..128, got {num_heads}")
    rows = s_q * num_heads
    batch = lens.shape[0]
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
        chosen, items, split, ranges, n_slots_used, st = _plan_hybrid(lens, s_q, num_heads, num_sms,
                                                                      ctas_per_sm, int(item_cost), form)
        bps = st["blocks_per_split"]
        max_cta_blocks = st["max_blocks"]
        costs = (st["cost_even"], st["cost_balanced"])
    else:
        if form not in ("auto", "even"):
            raise ValueError(f"form={form!r} needs balanced=True (the default kernel runs the even plan)")
        m_blocks = -(-rows // block_m_for(rows))
        nb = _nblocks(lens)
        bps = _even_bps(nb, m_blocks, num_sms * ctas_per_sm)
        items, _, split, n_slots_used = _even_items(lens, nb, bps)
    n_items = items.shape[0]
    if n_items > cap or n_slots_used > slots:
        raise AssertionError(f"schedule overflow: {n_items}>{cap} or {n_slots_used}>{slots}")
    # fill the host staging tensors (kept on the Schedule between steps), then one copy per device buffer
    n_ranges = 0 if ranges is None else ranges.shape[0]
    stage = None if out is None else out._staging
    if stage is None or not stage.fits(cap, max_batch, n_ranges):
        stage = _Staging(cap, max_batch, n_ranges)
    stage.work[:n_items] = items
    stage.work[n_items:] = -1
    stage.split[:batch] = split
    stage.split[batch:] = 0
    if ranges is not None:
        stage.ranges.copy_(ranges)
    if out is None:
        dev = torch.device(device)
        out = Schedule(stage.work.to(dev, copy=True), stage.split.to(dev, copy=True), s_q, num_heads,
                       block_m_for(rows), cap, slots,
                       cta_ranges=None if ranges is None else stage.ranges.to(dev, copy=True))
    else:
        out.work_info.copy_(stage.work, non_blocking=False)
        out.split_info.copy_(stage.split, non_blocking=False)
        if ranges is not None:
            out.cta_ranges.copy_(stage.ranges, non_blocking=False)
    out._staging = stage
    out.item_cost = int(item_cost) if balanced else 0
    out.max_cta_blocks = max_cta_blocks
    out.form = chosen
    out.cost_even, out.cost_balanced = costs
    out.num_items = n_items
    out.blocks_per_split = bps
    kind = combine_kind_for(batch, rows, num_sms) if combine in ("auto", "fused") else combine
    out.wide_combine, out.combine_cols = combine_params(kind)
    out.fused_combine = combine == "fused"
    return out


def workspace_bytes(schedule: Schedule, partial_dtype: torch.dtype = torch.float32) -> int:
    """Bytes of the partial buffers (o_partial in partial_dtype + lse_partial in fp32)."""
    o_bytes = torch.empty((), dtype=partial_dtype).element_size()
    return schedule.num_slots * schedule.rows * (D_V * o_bytes + 4)


class Workspace(tuple):
    """alloc_workspace's result: the pair (o_partial, lse_partial) -- unpacks as before -- plus `arrivals`, the
    fused merge's per-request arrival counters (int32 [max_batch], zeroed here once; each launch of a fused
    kernel leaves them at zero again, fused_merge.py)."""

    arrivals: torch.Tensor

    def __new__(cls, o_partial: torch.Tensor, lse_partial: torch.Tensor, arrivals: torch.Tensor):
        self = super().__new__(cls, (o_partial, lse_partial))
        self.arrivals = arrivals
        return self


def alloc_workspace(schedule: Schedule, device="cuda", partial_dtype: torch.dtype = torch.float32):
    """(o_partial [slots, rows, 512] partial_dtype, lse_partial [slots, rows] fp32).

    partial_dtype: float32 (default), bfloat16 or float16. Each split's O is written normalised (divided by its
    own softmax sum), so its values lie within the range of V, as the output's do; a 16-bit buffer halves the
    traffic a split step adds (every slot written by the partial kernel and read back by the combine) for
    one more rounding of each split's O (the combine still sums in fp32). The launch entries pick the partial
    and combine kernels built for this buffer's dtype (api.partial_name)."""
    if partial_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"partial_dtype must be torch.float32, torch.bfloat16 or torch.float16, got {partial_dtype}")
    return Workspace(
        torch.empty((schedule.num_slots, schedule.rows, D_V), dtype=partial_dtype, device=device),
        torch.empty((schedule.num_slots, schedule.rows), dtype=torch.float32, device=device),
        torch.zeros(schedule.split_info.shape[0], dtype=torch.int32, device=device),
    )
