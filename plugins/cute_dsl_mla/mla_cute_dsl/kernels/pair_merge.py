"""Cluster pair merge (experimental, opt-in): a request split into exactly two halves is merged by the 2-CTA
thread-block cluster that ran them, through distributed shared memory (DSMEM), instead of partials in global
memory and the separate combine kernel (combine.MLACombine).

Plan: schedule's form "pair" (make_schedule(..., balanced=True, form="pair"), _pair_rows): request r runs in
CTA columns 2r (blocks [0, mid), slot PAIR_LO = -2) and 2r + 1 (blocks [mid, nb), slot PAIR_HI = -3); requests of
one block are one direct item (slot -1) in column 2r; every other column is empty. The kernel
(MLADecodePartial(balanced=True, pair=True), kernel_balanced) is launched over the same (m-blocks, num_cols) grid
with cluster dims (1, 2, 1), so columns 2r and 2r + 1 of one m-block form one cluster: CTA rank 0 runs the lower
half, rank 1 the upper half.

Epilogue of a pair item (run_item, slot < -1), per CTA, after the usual row-sum reduction (sRed):

1. its rows' normalised O (acc_O * v_scale / l, fp32, the value a partial slot would hold) go to its own shared
   memory, reusing the K ring (free after the tile loop: the epilogue's barriers follow the last ldmatrix and
   cp.async.wait_group 0), as a (block_m, XSTRIDE) fp32 tile; column 512 of each row holds the row's lse
   (m * scale_ln + ln l, -inf when l == 0). XSTRIDE = 520 (not 512) so the 8 rows a warp's C fragment covers
   fall on different bank groups (2 wavefronts per 32-lane store instead of 8);
2. barrier.cluster.arrive (release) + barrier.cluster.wait (acquire): both CTAs' tiles are visible cluster-wide;
3. each CTA merges half of the columns (rank 0: 0..255, rank 1: 256..511) of every row, reading its own half
   from its shared memory and the peer's from the peer's (mapa + ld.shared::cluster.v4.f32, 16 bytes a load),
   with the combine kernel's math: m = max(lse_lo, lse_hi), m_use = 0 if m == -inf else m,
   w_k = exp(lse_k - m_use) (natural, not fast-math), s = w_lo + w_hi, out = (w_lo O_lo + w_hi O_hi) / s
   (0 when s == 0: both halves had no valid key, their O tiles are zeros and the weights exp(-inf) = 0, no
   NaN), lse = m_use + ln s (-inf when s == 0); out rows in q's dtype, 16-byte stores; rank 0 writes lse;
4. barrier.cluster.arrive (release) + wait again: no CTA exits or reuses its shared memory while the peer may
   still read it.

Entry: MLADecodePartial.call_balanced_pair (call_balanced's arguments plus split_info; kernel_balanced_fused's body):
before its column's items each CTA writes out = 0 / lse = -inf for the requests with no KV that fall to its column
(fused_merge.fill_empty_requests), so a pair step runs no combine kernel (api.launch_pair; combine=True adds the
combine kernel back, which then has nothing to merge, for A/B and for graphs replaying other forms). Items of other
forms (slot -1 or >= 0) run as in kernel_balanced (direct rows, partial slots) and execute no cluster barrier.

Deadlock freedom: a cluster barrier is executed only inside a pair item, by every thread of the CTA (no branch
inside depends on the thread), and the plan puts a PAIR_LO item in column 2r exactly when it puts the PAIR_HI item
of the same request in column 2r + 1 (the same m-blocks run both), each column holding that one item only; every
other CTA (empty column, a direct item, another form's schedule) executes no cluster barrier.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

D_V = 512
PAIR_TAG = "pair"
XSTRIDE = 520  # fp32 row stride of the exchange tile (512 columns, lse at 512, padding)
LSE_COL = 512
CLUSTER = (1, 2, 1)


def pair_spec(pair: bool) -> tuple:
    """Kernel-cache key suffix: () by default (keys and symbols unchanged), ("pair",) for the cluster pair kernel."""
    return (PAIR_TAG,) if pair else ()


def pair_from_tags(tags) -> bool:
    return PAIR_TAG in tags


def exchange_bytes(block_m: int) -> int:
    """Shared memory the exchange tile needs (inside the K ring)."""
    return block_m * XSTRIDE * 4


@dsl_user_op
def ld_dsmem_v4_f32(addr, *, loc=None, ip=None):
    """4 fp32 from a shared::cluster address (a 32-bit mapa result, 16-byte aligned)."""
    st = llvm.inline_asm(
        llvm.StructType.get_literal([T.f32()] * 4),
        [cutlass.Int32(addr).ir_value(loc=loc, ip=ip)],
        "ld.shared::cluster.v4.f32 {$0, $1, $2, $3}, [$4];",
        "=f,=f,=f,=f,r",
        has_side_effects=True,  # never hoisted above the cluster barrier
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc,
        ip=ip,
    )
    return [cutlass.Float32(llvm.extractvalue(T.f32(), st, [i], loc=loc, ip=ip)) for i in range(4)]


@dsl_user_op
def ld_dsmem_f32(addr, *, loc=None, ip=None):
    """One fp32 from a shared::cluster address."""
    return cutlass.Float32(
        llvm.inline_asm(
            T.f32(),
            [cutlass.Int32(addr).ir_value(loc=loc, ip=ip)],
            "ld.shared::cluster.f32 $0, [$1];",
            "=f,r",
            has_side_effects=True,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
            loc=loc,
            ip=ip,
        )
    )


@cute.jit
def merge_pair(
    sX: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor, b: cutlass.Int32, m_block: cutlass.Int32,
    R: cutlass.Int32, tidx: cutlass.Int32, block_m: cutlass.Constexpr, num_threads: cutlass.Constexpr,
    q_dtype: cutlass.Constexpr,
):
    """Steps 2-4 of the module docstring (step 1, the exchange tile sX, is written by the caller): cluster barrier,
    merge this CTA's half of the columns of every row from its own tile and the peer's (DSMEM), cluster barrier.
    Every thread runs every step (only the global stores are predicated). Thread t takes the 8-column chunks
    t, t + num_threads, ... of the half (32 chunks a row: a warp covers one row's half, 1 KB contiguous). At 16 rows
    the 4 chunks a thread merges are unrolled (their DSMEM loads overlap; 218 registers with wide stores, no
    stack frame); at 32 rows a plain loop (the kernel is at 255 registers there: fully unrolled 8 chunks gave a
    32-byte stack frame, the loop 16 bytes, the balanced kernel has 8)."""
    cute.arch.cluster_arrive()
    cute.arch.cluster_wait()
    rank = cute.arch.block_idx_in_cluster()
    peer_base = cute.arch.map_dsmem_ptr(sX.iterator, 1 - rank).toint()
    n_chunks = block_m * CHUNKS_PER_ROW // num_threads
    if cutlass.const_expr(block_m <= 16):
        for i in cutlass.range_constexpr(n_chunks):
            _merge_chunk(sX, peer_base, mO, mLSE, b, m_block, R, i * num_threads + tidx, rank, block_m, q_dtype)
    else:
        for i in cutlass.range(n_chunks, unroll=1):
            _merge_chunk(sX, peer_base, mO, mLSE, b, m_block, R, i * num_threads + tidx, rank, block_m, q_dtype)
    cute.arch.cluster_arrive()
    cute.arch.cluster_wait()


CHUNKS_PER_ROW = (D_V // 2) // 8  # 8-column chunks of a half row


@cute.jit
def _merge_chunk(
    sX: cute.Tensor, peer_base: cutlass.Int32, mO: cute.Tensor, mLSE: cute.Tensor, b: cutlass.Int32,
    m_block: cutlass.Int32, R: cutlass.Int32, ch: cutlass.Int32, rank: cutlass.Int32, block_m: cutlass.Constexpr,
    q_dtype: cutlass.Constexpr,
):
    """Merge one 8-column chunk ch of this CTA's half (row ch // 32): the combine's math for two splits (module
    docstring, step 3); out in q's dtype with one 16-byte store; rank 0's first chunk of a row writes its lse."""
    row = ch // CHUNKS_PER_ROW
    col = rank * (D_V // 2) + (ch % CHUNKS_PER_ROW) * 8
    l_own = sX[row, LSE_COL]
    l_peer = ld_dsmem_f32(peer_base + (row * XSTRIDE + LSE_COL) * 4)
    l_lo = l_own if rank == 0 else l_peer
    l_hi = l_peer if rank == 0 else l_own
    m = cute.arch.fmax(l_lo, l_hi)
    m_use = 0.0 if m == -cutlass.Float32.inf else m
    w_lo = cute.math.exp(l_lo - m_use, fastmath=False)
    w_hi = cute.math.exp(l_hi - m_use, fastmath=False)
    s = w_lo + w_hi
    inv = 1.0 / s if s > 0.0 else 0.0
    a_own = (w_lo if rank == 0 else w_hi) * inv
    a_peer = (w_hi if rank == 0 else w_lo) * inv
    own = cute.local_tile(sX[row, None], (8,), (col // 8,)).load()
    addr = peer_base + (row * XSTRIDE + col) * 4
    p0 = ld_dsmem_v4_f32(addr)
    p1 = ld_dsmem_v4_f32(addr + 16)
    acc = cute.make_rmem_tensor((8,), cutlass.Float32)
    acc.store(own)
    for j in cutlass.range_constexpr(4):
        acc[j] = acc[j] * a_own + p0[j] * a_peer
        acc[4 + j] = acc[4 + j] * a_own + p1[j] * a_peer
    grow = m_block * block_m + row
    if grow < R:
        dst = cute.local_tile(mO[b, grow, None], (8,), (col // 8,))
        dst.store(acc.load().to(q_dtype))
        if rank == 0 and col == 0:
            mLSE[b, grow] = m_use + cute.math.log(s, fastmath=False) if s > 0.0 else -cutlass.Float32.inf
