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
"""

from __future__ import annotations

from dataclasses import dataclass

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


def wide_combine_for(batch: int, rows: int, num_sms: int) -> bool:
    """Whether MLACombineWide (one CTA per row and 128-column chunk, warps share out the splits) merges a
    step: when MLACombine would have fewer CTAs than the GPU has SMs. Small batches are split many ways
    (the schedule fills every SM), so each of those few warps walks a long list. On an H200 the wide kernel
    took B=1 H=16 S=4096 from 35.5 to 11.8 us; with 256 per-row CTAs it was slower (H=128 s_q=2 B=4:
    19.4 -> 24.4 us) and with 128 mixed (S=512: 4-6% slower, S=4096-16384: 2-4% faster). Batch and
    rows only, never the lengths: a CUDA graph captured at one step replays the same combine at every
    later step of its batch size."""
    return batch * -(-rows // COMBINE_ROWS_PER_CTA) < num_sms


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


def make_schedule(kv_lens_cpu, s_q: int, num_heads: int, num_sms: int, *,
                  max_batch: int | None = None, ctas_per_sm: int = 1,
                  device="cuda", out: Schedule | None = None) -> Schedule:
    """Compute the split-KV schedule for one decode step.

    kv_lens_cpu: host sequence/tensor of per-request kv lengths (incl. new tokens).
    With ``out`` (a Schedule made earlier for the same s_q, num_heads and
    buffers), the device buffers are overwritten in place (graph replay keeps
    pointing at them).
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
    if out is None:
        out = Schedule(work.to(device), spl.to(device), s_q, num_heads, block_m_for(rows),
                       cap, slots)
    else:
        out.work_info.copy_(work, non_blocking=False)
        out.split_info.copy_(spl, non_blocking=False)
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
