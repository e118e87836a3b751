"""combine=fused: the last CTA to finish a request's split items merges them (no combine kernel).

Why: on an H200 at B=64 H=16 s_q=1 S=8192 bf16 the balanced partial kernel took 143.9 us and the separate
combine kernel 5.3 us plus a launch gap (step 148.9 us; a pure-read kernel reads the step's bytes in 140-142 us).
Merging inside the partial kernel removes the second launch and its tail.

Protocol (per split item, i.e. a work row with slot >= 0, after the CTA's epilogue has stored its rows of the
normalised partial O to mOp[slot] and their LSE to mLSEp[slot]):

1. every thread: ``fence.acq_rel.gpu`` (its own partial/LSE stores are ordered before anything it does next,
   at GPU scope);
2. ``bar.sync`` (all threads of the CTA have stored and fenced);
3. thread 0: ``atom.add.acq_rel.gpu`` of 1 on ``arrivals[b]``, old value ``old``; the CTA is the last to
   arrive for request b iff ``old == target - 1`` with ``target = split count (split_info[b, 1]) x m-blocks
   (gridDim.x)``: every m-block of every split item of b arrives exactly once. Thread 0 publishes the answer
   through shared memory (the epilogue's row-sum scratch, free after step 2), ``bar.sync``;
4. the last CTA only: every thread ``fence.acq_rel.gpu`` (acquire side), then it merges all R rows of request
   b from split_info's slots (first, count) -- reading the other CTAs' partials and LSEs with
   ``ld.global.cg`` (L2, never a possibly stale L1 line) -- writes out[b] (q dtype) and lse[b], and thread 0
   stores ``arrivals[b] = 0``. Then the CTA goes on with its next work item.

Memory ordering. For a writer CTA W and the last CTA L of request b: W's threads' partial stores precede, in
program order, their fence.acq_rel.gpu; W's bar.sync orders those fences before W's thread 0's atomic (bar.sync
synchronises the CTA's threads; this is the pattern of the CUDA threadFenceReduction sample), which is a
release at GPU scope. All atomics on arrivals[b] form one total order; L's atomic reads the value written
by the atomics of all other arrivals (it returns target - 1, so every other arrival precedes it), and it is
acq_rel, so it synchronises with each of them: W's stores happen before L's thread 0's atomic. L's bar.sync
and every L thread's fence.acq_rel.gpu carry that to all of L's threads before their loads, which go to L2
(.cg), where W's stores are (L1 is write-through for global stores). So every partial and LSE the merge
reads is the final one of this launch.

Counter lifetime: arrivals (int32 [max_batch], alloc_workspace's Workspace.arrivals) are zeroed once at
allocation; within a launch only split requests' counters move, each from 0 to target, and the last CTA
resets it to 0 after its merge (no other CTA touches it again in this launch: all target arrivals have
happened). The next launch (the next layer, a CUDA-graph replay) is stream-ordered after this one's
completion, so it starts from zeros. No CTA waits for another: deadlock-free whatever the residency, and
correct also with several CTAs per SM or a grid larger than one wave. Launches sharing a workspace must be
stream-ordered (as its partial buffers already require); an aborted launch can leave counters non-zero.

The merge mirrors combine.MLACombine (cnt != 1 path): per row m = max_k lse_k (-inf for none), m_use = 0 if
m == -inf else m, w_k = exp(lse_k - m_use), s = sum w_k (natural exp/log, not fast-math), out = sum_k w_k O_k
/ s (0 when s == 0), lse = m_use + log(s) (-inf when s == 0); 16-bit partials are widened to fp32 before the
sum. Requests with no KV (split count 0) have no work item at all: the fused kernel writes their out = 0 and
lse = -inf itself (CTA column c takes requests c, c + columns, ...), as the combine kernel does for them.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

D_V = 512
FUSED_TAG = "fused"


def fused_spec(fused: bool) -> tuple:
    """Kernel-cache key suffix: () for the default (keys and symbols unchanged), ("fused",) when the partial
    kernel merges the splits itself (combine=fused)."""
    return (FUSED_TAG,) if fused else ()


def fused_from_tags(tags) -> bool:
    """Whether a kernel-cache key's trailing tags ask for the fused merge (fused_spec)."""
    return FUSED_TAG in tags


def _cg_atom(dtype, bits: int):
    """gmem -> register copy that caches in L2 only (ld.global.cg): other CTAs' partials."""
    return cute.make_copy_atom(
        cute.nvgpu.CopyG2ROp(), dtype, num_bits_per_copy=bits,
        load_cache_mode=cute.nvgpu.LoadCacheMode.GLOBAL,
    )


@cute.jit
def _ld_lse(mLSEp: cute.Tensor, slot, row):
    """mLSEp[slot, row] through ld.global.cg."""
    r = cute.make_rmem_tensor((1,), cutlass.Float32)
    cute.copy(_cg_atom(cutlass.Float32, 32), cute.local_tile(mLSEp[slot, None], (1,), (row,)), r)
    return r[0]


@cute.jit
def arrive(mCnt: cute.Tensor, b, target, sFlag: cute.Tensor, tidx):
    """Steps 1-3 of the protocol (module docstring): returns, in every thread, whether this CTA was the last
    of the `target` arrivals for request b. sFlag: one fp32 of shared memory no thread reads or writes between
    the call's first barrier and its return (the caller's scratch)."""
    cute.arch.fence_acq_rel_gpu()
    cute.arch.barrier()
    if tidx == 0:
        old = cute.arch.atomic_add((mCnt.iterator + b), cutlass.Int32(1), sem="acq_rel", scope="gpu")
        sFlag[0] = cutlass.Float32(1.0) if old == target - 1 else cutlass.Float32(0.0)
    cute.arch.barrier()
    return sFlag[0] > cutlass.Float32(0.5)


@cute.jit
def release_counter(mCnt: cute.Tensor, b, tidx):
    """Step 4's reset: arrivals[b] = 0 (thread 0), after the merge."""
    if tidx == 0:
        cute.arch.store((mCnt.iterator + b), cutlass.Int32(0), sem="relaxed", scope="gpu")


# (row, 8-column group) units one thread merges per pass, by partial width: 16-bit partials take 8 (R = 16 rows
# is one pass of 128 threads), fp32 ones 4 (the same register bytes in flight; more would spill)
UNITS = {16: 8, 32: 4}


@cute.jit
def _load_units(mOp: cute.Tensor, mLSEp: cute.Tensor, slot, base, tidx, num_threads: cutlass.Constexpr, R,
                l: cute.Tensor, v: cute.Tensor):
    """merge_request's loads of one split slot for this thread's units (UNITS by partial width): l[k] = its row's
    LSE, v[8k .. 8k + 7] = its 8 partial columns (ld.global.cg, 16 bytes at a time); units past R * 64 read row
    R - 1."""
    pdt = mOp.element_type
    vec = 128 // pdt.width  # partial elements per 16-byte load: 8 (16-bit) or 4 (fp32)
    groups = D_V // 8
    atom = _cg_atom(pdt, 128)
    for k in cutlass.range_constexpr(UNITS[pdt.width]):
        u = base + tidx + k * num_threads
        row = cutlass.min(u // groups, R - 1)
        l[k] = _ld_lse(mLSEp, slot, row)
        for t in cutlass.range_constexpr(8 // vec):
            cute.copy(atom, cute.local_tile(mOp[slot, row, None], (vec,), ((u % groups) * (8 // vec) + t,)),
                      cute.local_tile(v, (vec,), (k * (8 // vec) + t,)))


@cute.jit
def merge_request(
    mO: cute.Tensor, mLSE: cute.Tensor, mOp: cute.Tensor, mLSEp: cute.Tensor,
    b, first, cnt, tidx, num_threads: cutlass.Constexpr, q_dtype: cutlass.Constexpr,
):
    """Merge request b's cnt split slots first .. first + cnt - 1 into out[b] / lse[b] (all R rows). Call after
    the acquire fence.

    Why this shape: the merge sits on the critical path of the CTA that finishes a request last (at the end of
    the kernel when the splits are even), so it has to cost about one L2 round trip, not one per row and split.
    Every thread takes UNITS (row, 8-column group) units at once (8 with 16-bit partials, 4 with fp32; unit
    u = pass base + tidx + k * num_threads: row u // 64, columns 8 * (u % 64) ..) and walks the splits with an
    online max, loading split i + 1's LSEs and 16-byte partial chunks (ld.global.cg) before split i's math, so
    two splits' loads are in flight. Units past R * 64 load row R - 1 (valid memory, unconditional loads) and
    store nothing. The math is combine.MLACombine's in online form (per
    split: m' = max(m, lse_k), m_use = 0 if m' == -inf else m', a = exp(m - m_use), w = exp(lse_k - m_use),
    s = s a + w, acc = acc a + w O_k; then out = acc / s, lse = m_use + log s; 0 / -inf when s == 0): equal
    to it within rounding (natural exp/log, not fast-math); 16-bit partials are widened to fp32."""
    R = mO.shape[1]
    pdt = mOp.element_type
    units = UNITS[pdt.width]
    groups = D_V // 8  # 8-column groups per row
    total = R * groups
    for base in cutlass.range(0, total, num_threads * units):
        m = cute.make_rmem_tensor((units,), cutlass.Float32)
        s = cute.make_rmem_tensor((units,), cutlass.Float32)
        acc = cute.make_rmem_tensor((8 * units,), cutlass.Float32)
        m.fill(-cutlass.Float32.inf)
        s.fill(0.0)
        acc.fill(0.0)
        # split i's loads are issued one turn ahead of its math (split 0 before the loop; the last turn
        # re-loads the last split, whose values are never used): two splits' loads in flight
        lc = cute.make_rmem_tensor((units,), cutlass.Float32)
        vc = cute.make_rmem_tensor((8 * units,), pdt)
        ln = cute.make_rmem_tensor((units,), cutlass.Float32)
        vn = cute.make_rmem_tensor((8 * units,), pdt)
        _load_units(mOp, mLSEp, first, base, tidx, num_threads, R, lc, vc)
        for i in cutlass.range(0, cnt, 1, unroll=1):
            _load_units(mOp, mLSEp, first + cutlass.min(i + 1, cnt - 1), base, tidx, num_threads, R, ln, vn)
            for k in cutlass.range_constexpr(units):
                l = lc[k]
                m_new = cute.arch.fmax(m[k], l)
                m_use = 0.0 if m_new == -cutlass.Float32.inf else m_new
                a = cute.math.exp(m[k] - m_use, fastmath=False)
                w = cute.math.exp(l - m_use, fastmath=False)
                s[k] = s[k] * a + w
                a8 = cute.local_tile(acc, (8,), (k,))
                a8.store(a8.load() * a + w * cute.local_tile(vc, (8,), (k,)).load().to(cutlass.Float32))
                m[k] = m_new
            lc.store(ln.load())
            vc.store(vn.load())
        for k in cutlass.range_constexpr(units):
            u = base + tidx + k * num_threads
            if u < total:
                row = u // groups
                ok = s[k] > 0.0
                inv = 1.0 / s[k] if ok else 0.0
                o = cute.make_rmem_tensor((8,), q_dtype)
                o.store((cute.local_tile(acc, (8,), (k,)).load() * inv).to(q_dtype))
                cute.local_tile(mO[b, row, None], (8,), (u % groups,)).store(o.load())
                if u % groups == 0:
                    m_use = 0.0 if m[k] == -cutlass.Float32.inf else m[k]
                    mLSE[b, row] = m_use + cute.math.log(s[k], fastmath=False) if ok else -cutlass.Float32.inf


@cute.jit
def fill_empty_requests(
    mO: cute.Tensor, mLSE: cute.Tensor, mSplit: cute.Tensor, col, num_cols, m_block,
    block_m: cutlass.Constexpr, tidx, num_threads: cutlass.Constexpr, q_dtype: cutlass.Constexpr,
):
    """Requests with no KV (split count 0, no work item): out = 0 and lse = -inf for this m-block's rows,
    requests col, col + num_cols, ... (what the combine kernel writes for them)."""
    B = mO.shape[0]
    R = mO.shape[1]
    z = cute.make_rmem_tensor((8,), q_dtype)
    z.fill(0.0)
    for b in cutlass.range(col, B, num_cols):
        if mSplit[b, 1] == 0:
            for idx in cutlass.range(tidx, block_m * (D_V // 8), num_threads):
                grow = m_block * block_m + idx // (D_V // 8)
                if grow < R:
                    cute.local_tile(mO[b, grow, None], (8,), (idx % (D_V // 8),)).store(z.load())
                    if idx % (D_V // 8) == 0:
                        mLSE[b, grow] = -cutlass.Float32.inf
