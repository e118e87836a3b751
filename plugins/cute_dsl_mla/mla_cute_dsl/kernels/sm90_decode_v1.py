"""SM90 MLA decode, split-KV partial kernel and combine kernel, in CuTe DSL.

Design (v1, correctness first):

* One CTA handles one (work item, m-block).  A work item is a contiguous
  range of 64-token KV blocks of one request (the split-KV schedule, see
  ``schedule.py``); an m-block is ``BLOCK_M`` of the request's ``s_q * H``
  packed query rows (row r = query index ``r // H``, head ``r % H``).
* Warp-level ``mma.sync`` m16n8k16 (``warp.MmaF16BF16Op``), ldmatrix from
  swizzled shared memory, cp.async loads, double-buffered KV tiles.
* The CTA has ``2 * BLOCK_M / 16`` warps: warp group g (0/1) owns output
  columns of one half of the 512-wide V (interleaved by 8 columns through
  the tiled MMA); both groups compute the full S = Q K^T (redundant QK, the
  price of keeping the 64x512 fp32 accumulator in registers).
* V is read from the K tile's shared memory (first 512 columns).
* fp8 KV: the tile is cp.async'ed as fp8 into a staging buffer, converted to
  the MMA dtype in shared memory (rows past the request's length zeroed),
  the scale folded into the softmax scale and into the output.
* A 64-token KV block never crosses a page (page_size % 64 == 0), so a tile
  is one contiguous [64, 576] slab of the cache: the paged gather is one
  page-table read per tile.
* Rows of the last tile past kv_len are zero-filled in shared memory, so
  NaN in page tails never reaches P @ V; masked scores are selected to
  -inf, never added.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync, warp

D_QK = 576
D_V = 512
BLOCK_N = 64
LOG2_E = 1.4426950408889634


def _acc_mn_view(acc: cute.Tensor) -> cute.Tensor:
    """View an mma.sync C-partitioned tensor ((2,2), M, N) as ((2,M), (2,N))."""
    lc = cute.make_layout(acc.layout.shape)
    mn = cute.make_layout(
        ((lc.shape[0][1], lc.shape[1]), (lc.shape[0][0], lc.shape[2])),
        stride=((lc.stride[0][1], lc.stride[1]), (lc.stride[0][0], lc.stride[2])),
    )
    return cute.make_tensor(acc.iterator, cute.composition(acc.layout, mn))


def _quad_max(v):
    v = cute.arch.fmax(v, cute.arch.shuffle_sync_bfly(v, offset=2, mask=-1, mask_and_clamp=31))
    v = cute.arch.fmax(v, cute.arch.shuffle_sync_bfly(v, offset=1, mask=-1, mask_and_clamp=31))
    return v


def _quad_sum(v):
    v = v + cute.arch.shuffle_sync_bfly(v, offset=2, mask=-1, mask_and_clamp=31)
    v = v + cute.arch.shuffle_sync_bfly(v, offset=1, mask=-1, mask_and_clamp=31)
    return v


class MLADecodePartial:
    """Split-KV partial kernel: one specialization per (q dtype, kv dtype, BLOCK_M)."""

    def __init__(self, q_dtype, kv_dtype, block_m: int):
        assert block_m in (16, 32, 64)
        self.q_dtype = q_dtype
        self.kv_dtype = kv_dtype
        self.is_fp8 = kv_dtype is not q_dtype
        if self.is_fp8:
            assert kv_dtype is cutlass.Float8E4M3FN
        self.block_m = block_m
        self.m_warps = block_m // 16
        self.num_threads = self.m_warps * 2 * 32
        self.kv_stages = 1 if self.is_fp8 else 2

    def smem_bytes(self) -> int:
        b = self.block_m * D_QK * 2 + self.kv_stages * BLOCK_N * D_QK * 2
        if self.is_fp8:
            b += 2 * BLOCK_N * D_QK
        return b + 3 * 1024

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (B, R, 576) q dtype, R = s_q * H
        mKV: cute.Tensor,  # (P, page, 576) kv dtype
        mPT: cute.Tensor,  # (B, max_pages) int32
        mLens: cute.Tensor,  # (B,) int32
        mO: cute.Tensor,  # (B, R, 512) q dtype
        mLSE: cute.Tensor,  # (B, R) fp32
        mWork: cute.Tensor,  # (capacity, 4) int32: b, kv_start, kv_end, slot
        mOp: cute.Tensor,  # (slots, R, 512) fp32
        mLSEp: cute.Tensor,  # (slots, R) fp32
        scale_log2: cutlass.Float32,  # sm_scale * kv_scale * log2(e)
        scale_ln: cutlass.Float32,  # sm_scale * kv_scale
        v_scale: cutlass.Float32,  # kv_scale
        s_q: cutlass.Int32,
        num_heads: cutlass.Int32,
        stream,
    ):
        qt = self.q_dtype
        # ---- shared memory layouts (64-element rows, 128B swizzle) ----
        atom = cute.make_composed_layout(
            cute.make_swizzle(3, 3, 3), 0, cute.make_layout((8, 64), stride=(64, 1))
        )
        sQ_layout = cute.tile_to_shape(atom, (self.block_m, D_QK), (0, 1))
        sK_layout = cute.tile_to_shape(atom, (BLOCK_N, D_QK, self.kv_stages), (0, 1, 2))
        sKraw_layout = cute.make_layout(
            (BLOCK_N, D_QK, 2), stride=(D_QK, 1, BLOCK_N * D_QK)
        )
        raw_elems = cute.cosize(sKraw_layout) if self.is_fp8 else 8

        @cute.struct
        class SharedStorage:
            sQ: cute.struct.Align[cute.struct.MemRange[qt, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[qt, cute.cosize(sK_layout)], 1024]
            sKraw: cute.struct.Align[cute.struct.MemRange[self.kv_dtype, raw_elems], 1024]

        nt = self.num_threads
        # ---- gmem -> smem copies (cp.async, 16B) ----
        cp16 = cute.make_copy_atom(
            cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), qt, num_bits_per_copy=128
        )
        g2s = cute.make_tiled_copy_tv(
            cp16, cute.make_layout((nt // 8, 8), stride=(8, 1)), cute.make_layout((1, 8))
        )
        cp16_raw = cute.make_copy_atom(
            cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL),
            self.kv_dtype,
            num_bits_per_copy=128,
        )
        g2s_raw = cute.make_tiled_copy_tv(
            cp16_raw, cute.make_layout((nt // 4, 4), stride=(4, 1)), cute.make_layout((1, 16))
        )
        # fp8 staging -> registers (8 x fp8 = 64 bits) and registers -> sK (8 x bf16)
        s2r_raw = cute.make_tiled_copy_tv(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.kv_dtype, num_bits_per_copy=64),
            cute.make_layout((nt // 8, 8), stride=(8, 1)),
            cute.make_layout((1, 8)),
        )
        r2s_cvt = cute.make_tiled_copy_tv(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), qt, num_bits_per_copy=128),
            cute.make_layout((nt // 8, 8), stride=(8, 1)),
            cute.make_layout((1, 8)),
        )

        # ---- MMAs ----
        mma_atom = warp.MmaF16BF16Op(qt, cutlass.Float32, (16, 8, 16))
        mma_s = cute.make_tiled_mma(
            mma_atom, (self.m_warps, 1, 1), permutation_mnk=(self.block_m, 16, 16)
        )
        mma_o = cute.make_tiled_mma(
            mma_atom, (self.m_warps, 2, 1), permutation_mnk=(self.block_m, 32, 16)
        )

        grid = (
            cute.size(mWork.shape[0]),
            cute.ceil_div(cute.size(mQ.shape[1]), self.block_m),
            1,
        )
        self.kernel(
            mQ, mKV, mPT, mLens, mO, mLSE, mWork, mOp, mLSEp,
            scale_log2, scale_ln, v_scale, s_q, num_heads,
            sQ_layout, sK_layout, sKraw_layout,
            g2s, g2s_raw, s2r_raw, r2s_cvt, mma_s, mma_o, SharedStorage,
        ).launch(grid=grid, block=[nt, 1, 1], stream=stream)

    @cute.jit
    def load_tile(
        self, g2s: cute.TiledCopy, g2s_raw: cute.TiledCopy, thr_g2s, thr_g2s_raw,
        mKV: cute.Tensor, mPT: cute.Tensor, b: cutlass.Int32, n: cutlass.Int32,
        stage: cutlass.Int32, blocks_per_page: cutlass.Int32, kv_len: cutlass.Int32,
        tKcK: cute.Tensor, tKsK: cute.Tensor, tRsR: cute.Tensor,
    ):
        """cp.async one 64-token KV tile (block n of request b) into stage."""
        page = mPT[b, n // blocks_per_page]
        gK = cute.local_tile(mKV[page, None, None], (BLOCK_N, D_QK), (n % blocks_per_page, 0))
        if cutlass.const_expr(self.is_fp8):
            tRgR = thr_g2s_raw.partition_S(gK)
            cute.copy(g2s_raw, tRgR, tRsR[None, None, None, stage])
        else:
            tKgK = thr_g2s.partition_S(gK)
            valid = kv_len - n * BLOCK_N
            for m in cutlass.range_constexpr(cute.size(tKsK.shape[1])):
                if tKcK[0, m, 0][0] < valid:
                    cute.copy(g2s, tKgK[None, m, None], tKsK[None, m, None, stage])
                else:
                    tKsK[None, m, None, stage].fill(0)

    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor, mKV: cute.Tensor, mPT: cute.Tensor, mLens: cute.Tensor,
        mO: cute.Tensor, mLSE: cute.Tensor, mWork: cute.Tensor, mOp: cute.Tensor,
        mLSEp: cute.Tensor,
        scale_log2: cutlass.Float32, scale_ln: cutlass.Float32, v_scale: cutlass.Float32,
        s_q: cutlass.Int32, num_heads: cutlass.Int32,
        sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout,
        sKraw_layout: cute.Layout,
        g2s: cute.TiledCopy, g2s_raw: cute.TiledCopy, s2r_raw: cute.TiledCopy,
        r2s_cvt: cute.TiledCopy,
        mma_s: cute.TiledMma, mma_o: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
    ):
        qt = self.q_dtype
        tidx, _, _ = cute.arch.thread_idx()
        wi, m_block, _ = cute.arch.block_idx()
        gthreads = self.m_warps * 32
        tg = tidx % gthreads  # thread index inside its warp group (S mma)

        b = mWork[wi, 0]
        if b >= 0:
            kv_start = mWork[wi, 1]
            kv_end = mWork[wi, 2]
            slot = mWork[wi, 3]
            kv_len = mLens[b]
            R = mQ.shape[1]
            page_size = mKV.shape[1]
            blocks_per_page = page_size // BLOCK_N
            n_start = kv_start // BLOCK_N
            n_end = (kv_end + BLOCK_N - 1) // BLOCK_N

            smem = cutlass.utils.SmemAllocator()
            storage = smem.allocate(SharedStorage)
            sQ = storage.sQ.get_tensor(sQ_layout)
            sK = storage.sK.get_tensor(sK_layout)
            sKraw = storage.sKraw.get_tensor(sKraw_layout)
            # V^T view: (512, 64, stages) -> element (n, d, s) of sK
            sVt = cute.composition(
                sK,
                cute.make_layout(
                    (D_V, BLOCK_N, self.kv_stages), stride=(BLOCK_N, 1, BLOCK_N * D_QK)
                ),
            )

            # ---------------- Q: gmem -> smem (rows >= R zero) ----------------
            thr_g2s = g2s.get_slice(tidx)
            gQ = cute.local_tile(mQ[b, None, None], (self.block_m, D_QK), (m_block, 0))
            cQ = cute.local_tile(
                cute.make_identity_tensor((mQ.shape[1], D_QK)), (self.block_m, D_QK), (m_block, 0)
            )
            tQgQ = thr_g2s.partition_S(gQ)
            tQsQ = thr_g2s.partition_D(sQ)
            tQcQ = thr_g2s.partition_S(cQ)
            for m in cutlass.range_constexpr(cute.size(tQsQ.shape[1])):
                if cute.elem_less(tQcQ[0, m, 0][0], R):
                    cute.copy(g2s, tQgQ[None, m, None], tQsQ[None, m, None])
                else:
                    tQsQ[None, m, None].fill(0)

            # identity of one KV tile, for row predicates
            cKV = cute.make_identity_tensor((BLOCK_N, D_QK))
            tKcK = thr_g2s.partition_S(cKV)
            tKsK = thr_g2s.partition_D(sK)  # (CPY, N, K, stages)
            thr_g2s_raw = g2s_raw.get_slice(tidx)
            tRsR = thr_g2s_raw.partition_D(sKraw)

            if n_start < n_end:
                self.load_tile(g2s, g2s_raw, thr_g2s, thr_g2s_raw, mKV, mPT, b, n_start, 0, blocks_per_page, kv_len, tKcK, tKsK, tRsR)
            cute.arch.cp_async_commit_group()

            # ---------------- MMA partitions ----------------
            thr_s = mma_s.get_slice(tg)
            thr_o = mma_o.get_slice(tidx)
            tSrQ = thr_s.make_fragment_A(thr_s.partition_A(sQ))
            tSrK = thr_s.make_fragment_B(thr_s.partition_B(sK[None, None, 0]))
            tOrV = thr_o.make_fragment_B(thr_o.partition_B(sVt[None, None, 0]))
            acc_O = cute.make_rmem_tensor(
                thr_o.partition_shape_C((self.block_m, D_V)), cutlass.Float32
            )
            acc_O.fill(0.0)

            ldsm = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), qt)
            ldsm_t = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4), qt)
            s2r_Q = cute.make_tiled_copy_A(ldsm, mma_s).get_slice(tg)
            s2r_K = cute.make_tiled_copy_B(ldsm, mma_s).get_slice(tg)
            s2r_V = cute.make_tiled_copy_B(ldsm_t, mma_o).get_slice(tidx)
            tSsQ = s2r_Q.partition_S(sQ)
            tSrQ_v = s2r_Q.retile(tSrQ)
            tSsK = s2r_K.partition_S(sK)  # (CPY, N, K, stages)
            tSrK_v = s2r_K.retile(tSrK)
            tOsV = s2r_V.partition_S(sVt)  # (CPY, N, K, stages)
            tOrV_v = s2r_V.retile(tOrV)

            # per-thread row bookkeeping (rows of this thread in the S tile)
            cS = cute.make_identity_tensor((self.block_m, BLOCK_N))
            tScS = _acc_mn_view(thr_s.partition_C(cS))
            n_rows = cute.size(tScS.shape[0])
            row_lim = cute.make_rmem_tensor((n_rows,), cutlass.Int32)
            for r in cutlass.range_constexpr(n_rows):
                grow = m_block * self.block_m + tScS[r, 0][0]
                row_lim[r] = kv_len - s_q + grow // num_heads + 1
            row_max = cute.make_rmem_tensor((n_rows,), cutlass.Float32)
            row_sum = cute.make_rmem_tensor((n_rows,), cutlass.Float32)
            row_max.fill(-cutlass.Float32.inf)
            row_sum.fill(0.0)

            # fp8 conversion partitions
            thr_s2r_raw = s2r_raw.get_slice(tidx)
            thr_r2s = r2s_cvt.get_slice(tidx)
            tCsR = thr_s2r_raw.partition_S(sKraw)
            tCsK = thr_r2s.partition_D(sK)
            tCcK = thr_r2s.partition_D(cKV)

            acc_O_mn = _acc_mn_view(acc_O)

            for n in cutlass.range(n_start, n_end, 1):
                it = n - n_start
                stage = it % 2
                kst = 0 if cutlass.const_expr(self.is_fp8) else stage
                cute.arch.cp_async_wait_group(0)
                cute.arch.barrier()
                if n + 1 < n_end:
                    self.load_tile(g2s, g2s_raw, thr_g2s, thr_g2s_raw, mKV, mPT, b, n + 1, 1 - stage, blocks_per_page, kv_len, tKcK, tKsK, tRsR)
                cute.arch.cp_async_commit_group()

                if cutlass.const_expr(self.is_fp8):
                    # staging[stage] (fp8) -> sK (q dtype), rows past kv_len zeroed
                    valid = kv_len - n * BLOCK_N
                    rF8 = cute.make_rmem_tensor_like(tCsR[None, None, None, 0])
                    cute.copy(s2r_raw, tCsR[None, None, None, stage], rF8)
                    rQT = cute.make_rmem_tensor_like(tCsK[None, None, None, 0], qt)
                    rQT.store(rF8.load().to(qt))
                    for m in cutlass.range_constexpr(cute.size(rQT.shape[1])):
                        if tCcK[0, m, 0][0] >= valid:
                            rQT[None, m, None].fill(0)
                    cute.copy(r2s_cvt, rQT, tCsK[None, None, None, 0])
                    cute.arch.barrier()

                # ---------------- S = Q K^T ----------------
                acc_S = cute.make_rmem_tensor(
                    thr_s.partition_shape_C((self.block_m, BLOCK_N)), cutlass.Float32
                )
                acc_S.fill(0.0)
                nk = cute.size(tSsQ.shape[2])
                cute.copy(s2r_Q, tSsQ[None, None, 0], tSrQ_v[None, None, 0])
                cute.copy(s2r_K, tSsK[None, None, 0, kst], tSrK_v[None, None, 0])
                for k in cutlass.range_constexpr(nk):
                    if cutlass.const_expr(k + 1 < nk):
                        cute.copy(s2r_Q, tSsQ[None, None, k + 1], tSrQ_v[None, None, k + 1])
                        cute.copy(s2r_K, tSsK[None, None, k + 1, kst], tSrK_v[None, None, k + 1])
                    cute.gemm(mma_s, acc_S, tSrQ[None, None, k], tSrK[None, None, k], acc_S)

                # ---------------- mask + online softmax ----------------
                acc_S_mn = _acc_mn_view(acc_S)
                for r in cutlass.range_constexpr(n_rows):
                    lim = row_lim[r] - n * BLOCK_N
                    for c in cutlass.range_constexpr(cute.size(acc_S_mn.shape[1])):
                        if tScS[0, c][1] >= lim:
                            acc_S_mn[r, c] = -cutlass.Float32.inf
                    s_row = acc_S_mn[r, None].load()
                    m_cur = s_row.reduce(cute.ReductionOp.MAX, -cutlass.Float32.inf, 0)
                    m_cur = _quad_max(m_cur)
                    m_prev = row_max[r]
                    m_new = cute.arch.fmax(m_prev, m_cur)
                    m_use = 0.0 if m_new == -cutlass.Float32.inf else m_new
                    p_row = cute.math.exp2(
                        s_row * scale_log2 - m_use * scale_log2, fastmath=True
                    )
                    corr = cute.math.exp2(m_prev * scale_log2 - m_use * scale_log2, fastmath=True)
                    row_sum[r] = row_sum[r] * corr + p_row.reduce(
                        cute.ReductionOp.ADD, cutlass.Float32.zero, 0
                    )
                    row_max[r] = m_new
                    acc_S_mn[r, None] = p_row
                    acc_O_mn[r, None] = acc_O_mn[r, None].load() * corr

                # ---------------- O += P V ----------------
                rP = cute.make_fragment_like(acc_S, qt)
                rP.store(acc_S.load().to(qt))
                lP = cute.logical_divide(rP.layout, (None, None, 2))
                tOrP = cute.make_tensor(
                    rP.iterator,
                    cute.make_layout(
                        ((lP.shape[0], lP.shape[2][0]), lP.shape[1], lP.shape[2][1]),
                        stride=((lP.stride[0], lP.stride[2][0]), lP.stride[1], lP.stride[2][1]),
                    ),
                )
                nkv = cute.size(tOrP.shape[2])
                cute.copy(s2r_V, tOsV[None, None, 0, kst], tOrV_v[None, None, 0])
                for k in cutlass.range_constexpr(nkv):
                    if cutlass.const_expr(k + 1 < nkv):
                        cute.copy(s2r_V, tOsV[None, None, k + 1, kst], tOrV_v[None, None, k + 1])
                    cute.gemm(mma_o, acc_O, tOrP[None, None, k], tOrV[None, None, k], acc_O)

            cute.arch.cp_async_wait_group(0)

            # ---------------- epilogue ----------------
            cO = cute.make_identity_tensor((self.block_m, D_V))
            tOcO = _acc_mn_view(thr_o.partition_C(cO))
            lse_writer = tidx < gthreads
            if tidx % 4 != 0:
                lse_writer = False
            row_scale = cute.make_rmem_tensor((n_rows,), cutlass.Float32)
            row_lse = cute.make_rmem_tensor((n_rows,), cutlass.Float32)
            for r in cutlass.range_constexpr(n_rows):
                s = _quad_sum(row_sum[r])
                ok = s > 0.0
                row_scale[r] = v_scale / s if ok else 0.0
                row_lse[r] = (
                    row_max[r] * scale_ln + cute.math.log(s, fastmath=False)
                    if ok
                    else -cutlass.Float32.inf
                )
            if slot < 0:
                gO = cute.local_tile(mO[b, None, None], (self.block_m, D_V), (m_block, 0))
                tOgO = _acc_mn_view(thr_o.partition_C(gO))
                for r in cutlass.range_constexpr(n_rows):
                    grow = m_block * self.block_m + tOcO[r, 0][0]
                    if grow < R:
                        tOgO[r, None].store((acc_O_mn[r, None].load() * row_scale[r]).to(qt))
                        if lse_writer:
                            mLSE[b, grow] = row_lse[r]
            else:
                gO = cute.local_tile(mOp[slot, None, None], (self.block_m, D_V), (m_block, 0))
                tOgO = _acc_mn_view(thr_o.partition_C(gO))
                for r in cutlass.range_constexpr(n_rows):
                    grow = m_block * self.block_m + tOcO[r, 0][0]
                    if grow < R:
                        tOgO[r, None].store(acc_O_mn[r, None].load() * row_scale[r])
                        if lse_writer:
                            mLSEp[slot, grow] = row_lse[r]


class MLACombine:
    """Merge split-KV partials: out = sum_i w_i o_i, lse = log sum_i exp(lse_i)."""

    ROWS_PER_CTA = 4

    def __init__(self, q_dtype):
        self.q_dtype = q_dtype

    @cute.jit
    def __call__(
        self,
        mO: cute.Tensor,  # (B, R, 512) q dtype
        mLSE: cute.Tensor,  # (B, R) fp32
        mSplit: cute.Tensor,  # (max_batch, 2) int32: first slot, count
        mOp: cute.Tensor,  # (slots, R, 512) fp32
        mLSEp: cute.Tensor,  # (slots, R) fp32
        stream,
    ):
        grid = (
            cute.size(mO.shape[0]),
            cute.ceil_div(cute.size(mO.shape[1]), self.ROWS_PER_CTA),
            1,
        )
        self.kernel(mO, mLSE, mSplit, mOp, mLSEp).launch(
            grid=grid, block=[32 * self.ROWS_PER_CTA, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(
        self,
        mO: cute.Tensor, mLSE: cute.Tensor, mSplit: cute.Tensor,
        mOp: cute.Tensor, mLSEp: cute.Tensor,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        b, rb, _ = cute.arch.block_idx()
        lane = tidx % 32
        row = rb * self.ROWS_PER_CTA + tidx // 32
        first = mSplit[b, 0]
        cnt = mSplit[b, 1]
        R = mO.shape[1]
        if cnt != 1 and row < R:
            m = -cutlass.Float32.inf
            for i in cutlass.range(0, cnt, 1):
                m = cute.arch.fmax(m, mLSEp[first + i, row])
            acc = cute.make_rmem_tensor((16,), cutlass.Float32)
            acc.fill(0.0)
            ssum = cutlass.Float32(0.0)
            if m != -cutlass.Float32.inf:
                for i in cutlass.range(0, cnt, 1):
                    w = cute.math.exp(mLSEp[first + i, row] - m, fastmath=False)
                    ssum = ssum + w
                    for j in cutlass.range_constexpr(4):
                        for e in cutlass.range_constexpr(4):
                            acc[j * 4 + e] = acc[j * 4 + e] + w * mOp[
                                first + i, row, j * 128 + lane * 4 + e
                            ]
            inv = 1.0 / ssum if ssum > 0.0 else 0.0
            for j in cutlass.range_constexpr(4):
                for e in cutlass.range_constexpr(4):
                    mO[b, row, j * 128 + lane * 4 + e] = (acc[j * 4 + e] * inv).to(self.q_dtype)
            if lane == 0:
                mLSE[b, row] = (
                    m + cute.math.log(ssum, fastmath=False) if ssum > 0.0 else -cutlass.Float32.inf
                )
