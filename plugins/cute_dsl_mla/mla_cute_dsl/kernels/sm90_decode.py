"""SM90 MLA decode, split-KV partial kernel (v2), in CuTe DSL.

Design:

* One CTA handles one (m-block, work item).  A work item is a contiguous
  range of 64-token KV blocks of one request (the split-KV schedule, see
  ``schedule.py``); an m-block is ``BLOCK_M`` (16 or 32) of the request's
  ``s_q * H`` packed query rows (row r = query index ``r // H``, head
  ``r % H``).  Rows past ``s_q * H`` are zero-filled in shared memory and
  never written.
* Warp-level ``mma.sync`` m16n8k16, ldmatrix from 128B-swizzled shared
  memory, cp.async loads into a multi-stage ring.
* Warps form an (M/16) x 4 grid.  For S = Q K^T warp (i, j) computes rows
  16i.. against a quarter of the 64 KV columns; row maxima are exchanged
  through shared memory, P goes to shared memory, and for O += P V warp
  (i, j) owns a quarter of the 512 output columns.  No MMA is done twice.
* V is read from the K tile's shared memory (first 512 columns).
* fp8 KV: tiles are cp.async'ed as fp8 into a ring of staging buffers
  (3 deep), converted with ``cvt.rn.f16x2.e4m3x2`` into an fp16 tile (rows
  past kv_len zeroed), and the MMAs run in fp16 (q is converted to fp16 on
  load; e4m3 values are exact in fp16).  The scale is folded into the
  softmax scale and into the output.
* A 64-token block never crosses a page (page_size % 64 == 0), so a tile is
  one contiguous [64, 576] slab: one page-table read per tile.
* Rows of the last tile past kv_len are zero-filled in shared memory, so
  NaN in page tails never reaches P @ V; masked scores are selected to -inf.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync, warp

from . import fused_merge as fm
from . import pair_merge as pm
from . import wide_store as ws

D_QK = 576
D_V = 512
BLOCK_N = 64
NW_N = 4  # warps along N (kv columns for S, output columns for O)
N_ACC = 4  # independent S accumulators per warp


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

    # default (warps along M, 16-row MMA atoms per warp, S accumulators) per BLOCK_M
    # 32 rows: one warp row with 2 M-atoms (K/V fragments reused for 32 rows), 13% faster than (2, 1, 1) for
    # bf16 B128 H16 s_q2 on an H200 (NOTES.md, v4)
    DEFAULT_LAYOUT = {16: (1, 1, 1), 32: (1, 2, 1), 64: (2, 2, 2)}

    def __init__(self, q_dtype, kv_dtype, block_m: int, layout=None, balanced: bool = False,
                 wide_store: bool = False, fused: bool = False, pair: bool = False):
        self.q_dtype = q_dtype
        # pair (experimental): the balanced kernel launched with 2-CTA clusters along the columns; a request split in
        # two halves by schedule form "pair" (slots -2 / -3) is merged through DSMEM (pair_merge.py)
        self.pair = bool(pair)
        if self.pair and not (balanced and block_m <= 32 and kv_dtype is q_dtype and not fused):
            raise ValueError("the cluster pair merge is built for the balanced kernel with bf16/fp16 KV at 16/32 rows "
                             "only (not with fused)")
        # fused: combine=fused, the last CTA to finish a request's split items merges them (fused_merge.py);
        # launched through call_fused / call_balanced_fused (bf16/fp16 KV, blocks of up to 32 rows)
        self.fused = bool(fused)
        if self.fused and not (block_m <= 32 and kv_dtype is q_dtype):
            raise ValueError("the fused merge is built for bf16/fp16 KV at 16/32 rows only")
        # wide_store: 16-bit epilogue rows (the q-dtype output, 16-bit partials) exchanged in the quad and
        # stored 16 bytes per instruction (wide_store.py); fp32 partials keep their 8-byte stores
        self.wide_store = bool(wide_store)
        self.kv_dtype = kv_dtype
        self.is_fp8 = kv_dtype is not q_dtype
        if self.is_fp8:
            assert kv_dtype is cutlass.Float8E4M3FN
        # balanced split-KV (schedule.plan_balanced): launched through call_balanced, a fixed grid
        # of (m-blocks, CTA columns), each CTA looping over its column's work items. 16-bit KV only.
        self.balanced = bool(balanced)
        if self.balanced and self.is_fp8:
            raise ValueError("balanced split-KV is built for bf16/fp16 KV only")
        # MMA operand type: q dtype, or fp16 for fp8 KV (exact e4m3 -> f16 cvt)
        self.mma_dtype = cutlass.Float16 if self.is_fp8 else q_dtype
        self.block_m = block_m
        # a warp with 2 M-atoms reuses every K/V fragment it loads for 32 rows;
        # n_acc independent S accumulators shorten the 36-long QK MMA chain
        self.m_warps, self.m_per_warp, self.n_acc = layout or self.DEFAULT_LAYOUT[block_m]
        assert self.m_warps * self.m_per_warp * 16 == block_m
        assert self.n_acc in (1, 2, 4)
        self.num_warps = self.m_warps * NW_N
        self.num_threads = self.num_warps * 32
        # bf16/fp16 KV: ring of `stages` tiles in sK. fp8: ring of raw stages, one sK.
        self.stages = 2
        self.raw_stages = (3 if block_m <= 32 else 2) if self.is_fp8 else 0
        self.k_bufs = 1 if self.is_fp8 else self.stages
        self.ring = self.raw_stages if self.is_fp8 else self.stages

    def smem_bytes(self) -> int:
        parts = [
            (self.block_m * D_QK * 2, 1024),  # sQ
            (self.k_bufs * BLOCK_N * D_QK * 2, 1024),  # sK
            (self.raw_stages * BLOCK_N * D_QK if self.is_fp8 else 16, 1024),  # sKraw
            (self.block_m * BLOCK_N * 2, 1024),  # sP
            (self.block_m * NW_N * 4, 16),  # sRed
        ]
        off = 0
        for size, align in parts:
            off = -(-off // align) * align + size
        return off

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
        mOp: cute.Tensor,  # (slots, R, 512) fp32, bf16 or fp16 (alloc_workspace partial_dtype)
        mLSEp: cute.Tensor,  # (slots, R) fp32
        scale_log2: cutlass.Float32,  # sm_scale * kv_scale * log2(e)
        scale_ln: cutlass.Float32,  # sm_scale * kv_scale
        v_scale: cutlass.Float32,  # kv_scale
        s_q: cutlass.Int32,
        num_heads: cutlass.Int32,
        stream,
    ):
        assert not self.balanced, "MLADecodePartial(balanced=True) is launched with call_balanced"
        self._launch(self.kernel, mQ, cute.size(mWork.shape[0]), (
            mQ, mKV, mPT, mLens, mO, mLSE, mWork, mOp, mLSEp,
            scale_log2, scale_ln, v_scale, s_q, num_heads,
        ), stream)

    @cute.jit
    def call_fused(
        self,
        mQ: cute.Tensor, mKV: cute.Tensor, mPT: cute.Tensor, mLens: cute.Tensor,
        mO: cute.Tensor, mLSE: cute.Tensor, mWork: cute.Tensor, mOp: cute.Tensor, mLSEp: cute.Tensor,
        mSplit: cute.Tensor,  # (max_batch, 2) int32: first slot, split count (schedule.split_info)
        mCnt: cute.Tensor,  # (max_batch,) int32 arrival counters, zero between launches (Workspace.arrivals)
        scale_log2: cutlass.Float32, scale_ln: cutlass.Float32, v_scale: cutlass.Float32,
        s_q: cutlass.Int32, num_heads: cutlass.Int32,
        stream,
    ):
        """__call__ with combine=fused (MLADecodePartial(fused=True)): one CTA per (m-block, work row) as before,
        plus the merge of each split request by the last CTA to finish one of its items (fused_merge.py) and
        out = 0 / lse = -inf for requests with no KV; no combine kernel follows."""
        assert self.fused and not self.balanced, "call_fused needs MLADecodePartial(fused=True), not balanced"
        self._launch(self.kernel_fused, mQ, cute.size(mWork.shape[0]), (
            mQ, mKV, mPT, mLens, mO, mLSE, mWork, mOp, mLSEp, mSplit, mCnt,
            scale_log2, scale_ln, v_scale, s_q, num_heads,
        ), stream)

    @cute.kernel
    def kernel_fused(
        self,
        mQ: cute.Tensor, mKV: cute.Tensor, mPT: cute.Tensor, mLens: cute.Tensor,
        mO: cute.Tensor, mLSE: cute.Tensor, mWork: cute.Tensor, mOp: cute.Tensor,
        mLSEp: cute.Tensor, mSplit: cute.Tensor, mCnt: cute.Tensor,
        scale_log2: cutlass.Float32, scale_ln: cutlass.Float32, v_scale: cutlass.Float32,
        s_q: cutlass.Int32, num_heads: cutlass.Int32,
        sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout,
        sP_layout: cute.ComposedLayout, sKraw_layout: cute.Layout, sRed_layout: cute.Layout,
        g2s: cute.TiledCopy, g2s_raw: cute.TiledCopy, g2r_q: cute.TiledCopy,
        s2r_raw: cute.TiledCopy, r2s: cute.TiledCopy,
        mma_s: cute.TiledMma, mma_o: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
    ):
        """kernel with the fused merge: the empty requests of this work row's share (b = wi, wi + capacity, ...:
        every request is covered since capacity >= max_batch), then the row's item (run_item: the arrival and,
        in the request's last CTA, the merge)."""
        tidx, _, _ = cute.arch.thread_idx()
        m_block, wi, _ = cute.arch.block_idx()
        lane = tidx % 32
        warp_n = (tidx // 32) // self.m_warps  # atom layout (m_warps, NW_N, 1), column-major

        fm.fill_empty_requests(mO, mLSE, mSplit, wi, cute.size(mWork.shape[0]), m_block, self.block_m,
                               tidx, self.num_threads, self.q_dtype)
        b = mWork[wi, 0]
        if b >= 0:
            self.run_item(
                mQ, mKV, mPT, mLens, mO, mLSE, mWork, mOp, mLSEp,
                scale_log2, scale_ln, v_scale, s_q, num_heads,
                sQ_layout, sK_layout, sP_layout, sKraw_layout, sRed_layout,
                g2s, g2s_raw, g2r_q, s2r_raw, r2s, mma_s, mma_o, SharedStorage,
                m_block, wi, b, tidx, lane, warp_n, mSplit, mCnt,
            )

    def _launch(self, kernel, mQ: cute.Tensor, cols, data: tuple, stream) -> None:
        """Launch one of the kernels (plain, balanced, fused) over (m-blocks, cols) CTAs: its data arguments, then
        the shared layouts, copies, MMAs and shared-memory struct every entry builds the same way."""
        (sQ_layout, sK_layout, sP_layout, sKraw_layout, sRed_layout, raw_elems, g2s, g2s_raw, g2r_q, s2r_raw,
         r2s, mma_s, mma_o) = self._setup()
        SharedStorage = self._shared_storage(sQ_layout, sK_layout, sP_layout, raw_elems)
        grid = (cute.ceil_div(cute.size(mQ.shape[1]), self.block_m), cols, 1)
        launched = kernel(
            *data,
            sQ_layout, sK_layout, sP_layout, sKraw_layout, sRed_layout,
            g2s, g2s_raw, g2r_q, s2r_raw, r2s, mma_s, mma_o, SharedStorage,
        )
        if cutlass.const_expr(self.pair):
            # columns 2c and 2c + 1 of one m-block form a cluster (num_cols even: api.launch_pair checks it)
            launched.launch(grid=grid, block=[self.num_threads, 1, 1], cluster=list(pm.CLUSTER), stream=stream)
        else:
            launched.launch(grid=grid, block=[self.num_threads, 1, 1], stream=stream)

    def _shared_storage(self, sQ_layout, sK_layout, sP_layout, raw_elems):
        """The CTA's shared-memory struct (every entry: even, balanced, fused): Q, the K ring, the raw fp8 staging
        (empty for a 16-bit cache), P and the row-reduction scratch."""
        mt, S = self.mma_dtype, cute.struct
        fields = {  # real objects, not the string annotations this module's `from __future__` would make
            "sQ": S.Align[S.MemRange[mt, cute.cosize(sQ_layout)], 1024],
            "sK": S.Align[S.MemRange[mt, cute.cosize(sK_layout)], 1024],
            "sKraw": S.Align[S.MemRange[self.kv_dtype, raw_elems], 1024],
            "sP": S.Align[S.MemRange[mt, cute.cosize(sP_layout)], 1024],
            "sRed": S.Align[S.MemRange[cutlass.Float32, self.block_m * NW_N], 16],
        }
        return cute.struct(type("SharedStorage", (), {"__annotations__": fields}))

    def _setup(self):
        """Shared-memory layouts, copy atoms and tiled MMAs (traced inside __call__ / call_balanced; the
        SharedStorage struct is declared in each of those, where the DSL resolves its annotations)."""
        mt = self.mma_dtype
        atom = cute.make_composed_layout(
            cute.make_swizzle(3, 3, 3), 0, cute.make_layout((8, 64), stride=(64, 1))
        )
        sQ_layout = cute.tile_to_shape(atom, (self.block_m, D_QK), (0, 1))
        sK_layout = cute.tile_to_shape(atom, (BLOCK_N, D_QK, self.k_bufs), (0, 1, 2))
        sP_layout = cute.tile_to_shape(atom, (self.block_m, BLOCK_N), (0, 1))
        n_raw = self.raw_stages if self.is_fp8 else 1
        sKraw_layout = cute.make_layout(
            (BLOCK_N, D_QK, n_raw), stride=(D_QK, 1, BLOCK_N * D_QK)
        )
        raw_elems = cute.cosize(sKraw_layout) if self.is_fp8 else 16
        sRed_layout = cute.make_layout((self.block_m, NW_N), stride=(NW_N, 1))

        nt = self.num_threads
        g2s = cute.make_tiled_copy_tv(
            cute.make_copy_atom(
                cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), mt, num_bits_per_copy=128
            ),
            cute.make_layout((nt // 8, 8), stride=(8, 1)),
            cute.make_layout((1, 8)),
        )
        g2s_raw = cute.make_tiled_copy_tv(
            cute.make_copy_atom(
                cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL),
                self.kv_dtype,
                num_bits_per_copy=128,
            ),
            cute.make_layout((nt // 4, 4), stride=(4, 1)),
            cute.make_layout((1, 16)),
        )
        # q (gmem, q dtype) -> registers, for the converting Q load of the fp8 path
        g2r_q = cute.make_tiled_copy_tv(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.q_dtype, num_bits_per_copy=128),
            cute.make_layout((nt // 8, 8), stride=(8, 1)),
            cute.make_layout((1, 8)),
        )
        # fp8 staging -> registers (8 x fp8) and registers -> smem (8 x 16-bit)
        s2r_raw = cute.make_tiled_copy_tv(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.kv_dtype, num_bits_per_copy=64),
            cute.make_layout((nt // 8, 8), stride=(8, 1)),
            cute.make_layout((1, 8)),
        )
        r2s = cute.make_tiled_copy_tv(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), mt, num_bits_per_copy=128),
            cute.make_layout((nt // 8, 8), stride=(8, 1)),
            cute.make_layout((1, 8)),
        )

        mma_atom = warp.MmaF16BF16Op(mt, cutlass.Float32, (16, 8, 16))
        mma_s = cute.make_tiled_mma(
            mma_atom, (self.m_warps, NW_N, 1), permutation_mnk=(self.block_m, 16 * NW_N, 16)
        )
        mma_o = cute.make_tiled_mma(
            mma_atom, (self.m_warps, NW_N, 1), permutation_mnk=(self.block_m, 16 * NW_N, 16)
        )

        return (sQ_layout, sK_layout, sP_layout, sKraw_layout, sRed_layout, raw_elems, g2s, g2s_raw, g2r_q,
                s2r_raw, r2s, mma_s, mma_o)

    @cute.jit
    def call_balanced(
        self,
        mQ: cute.Tensor,  # (B, R, 576) q dtype, R = s_q * H
        mKV: cute.Tensor,  # (P, page, 576) kv dtype
        mPT: cute.Tensor,  # (B, max_pages) int32
        mLens: cute.Tensor,  # (B,) int32
        mO: cute.Tensor,  # (B, R, 512) q dtype
        mLSE: cute.Tensor,  # (B, R) fp32
        mWork: cute.Tensor,  # (capacity, 4) int32: b, kv_start, kv_end, slot (column by column)
        mRanges: cute.Tensor,  # (num_cols + 1,) int32: column c runs work rows [mRanges[c], mRanges[c+1])
        mOp: cute.Tensor,  # (slots, R, 512) fp32, bf16 or fp16 (alloc_workspace partial_dtype)
        mLSEp: cute.Tensor,  # (slots, R) fp32
        scale_log2: cutlass.Float32,
        scale_ln: cutlass.Float32,
        v_scale: cutlass.Float32,
        s_q: cutlass.Int32,
        num_heads: cutlass.Int32,
        stream,
    ):
        """Balanced launch: grid (m-blocks, num_cols) -- fixed for a decoder (the ranges' length), so
        CUDA graphs replay it with any later schedule of the same buffers."""
        assert self.balanced, "call_balanced needs MLADecodePartial(balanced=True)"
        self._launch(self.kernel_balanced, mQ, cute.size(mRanges.shape[0]) - 1, (
            mQ, mKV, mPT, mLens, mO, mLSE, mWork, mRanges, mOp, mLSEp,
            scale_log2, scale_ln, v_scale, s_q, num_heads,
        ), stream)

    @cute.jit
    def call_balanced_fused(
        self,
        mQ: cute.Tensor,  # (B, R, 576) q dtype, R = s_q * H
        mKV: cute.Tensor,  # (P, page, 576) kv dtype
        mPT: cute.Tensor,  # (B, max_pages) int32
        mLens: cute.Tensor,  # (B,) int32
        mO: cute.Tensor,  # (B, R, 512) q dtype
        mLSE: cute.Tensor,  # (B, R) fp32
        mWork: cute.Tensor,  # (capacity, 4) int32: b, kv_start, kv_end, slot (column by column)
        mRanges: cute.Tensor,  # (num_cols + 1,) int32
        mOp: cute.Tensor,  # (slots, R, 512) fp32, bf16 or fp16
        mLSEp: cute.Tensor,  # (slots, R) fp32
        mSplit: cute.Tensor,  # (max_batch, 2) int32: first slot, split count (schedule.split_info)
        mCnt: cute.Tensor,  # (max_batch,) int32 arrival counters, zero between launches (Workspace.arrivals)
        scale_log2: cutlass.Float32,
        scale_ln: cutlass.Float32,
        v_scale: cutlass.Float32,
        s_q: cutlass.Int32,
        num_heads: cutlass.Int32,
        stream,
    ):
        """call_balanced with combine=fused (MLADecodePartial(balanced=True, fused=True)): the same grid and work,
        plus the merge of each split request by the last CTA to finish one of its items (fused_merge.py), and
        out = 0 / lse = -inf for requests with no KV; no combine kernel follows."""
        assert self.balanced and self.fused, "call_balanced_fused needs MLADecodePartial(balanced=True, fused=True)"
        self._launch(self.kernel_balanced_fused, mQ, cute.size(mRanges.shape[0]) - 1, (
            mQ, mKV, mPT, mLens, mO, mLSE, mWork, mRanges, mOp, mLSEp, mSplit, mCnt,
            scale_log2, scale_ln, v_scale, s_q, num_heads,
        ), stream)

    @cute.jit
    def call_balanced_pair(
        self,
        mQ: cute.Tensor,  # (B, R, 576) q dtype, R = s_q * H
        mKV: cute.Tensor,  # (P, page, 576) kv dtype
        mPT: cute.Tensor,  # (B, max_pages) int32
        mLens: cute.Tensor,  # (B,) int32
        mO: cute.Tensor,  # (B, R, 512) q dtype
        mLSE: cute.Tensor,  # (B, R) fp32
        mWork: cute.Tensor,  # (capacity, 4) int32: b, kv_start, kv_end, slot (column by column)
        mRanges: cute.Tensor,  # (num_cols + 1,) int32, num_cols even
        mOp: cute.Tensor,  # (slots, R, 512) fp32, bf16 or fp16 (written only by items with a slot >= 0)
        mLSEp: cute.Tensor,  # (slots, R) fp32
        mSplit: cute.Tensor,  # (max_batch, 2) int32: first slot, split count (schedule.split_info)
        scale_log2: cutlass.Float32,
        scale_ln: cutlass.Float32,
        v_scale: cutlass.Float32,
        s_q: cutlass.Int32,
        num_heads: cutlass.Int32,
        stream,
    ):
        """The cluster pair kernel (MLADecodePartial(balanced=True, pair=True), pair_merge.py): call_balanced's grid
        launched with (1, 2, 1) clusters; a pair item (slots -2 / -3 of schedule form "pair") is merged with its
        cluster peer through DSMEM, and out = 0 / lse = -inf is written for the requests with no KV (split count 0),
        so that a schedule of form "pair" needs no combine kernel (api.launch_pair)."""
        assert self.balanced and self.pair, "call_balanced_pair needs MLADecodePartial(balanced=True, pair=True)"
        # kernel_balanced_fused's body is the pair kernel's too (empty requests first, then the column's items; no
        # PDL trigger): without fused, run_item never reads the arrival counters, so split_info stands in for them
        self._launch(self.kernel_balanced_fused, mQ, cute.size(mRanges.shape[0]) - 1, (
            mQ, mKV, mPT, mLens, mO, mLSE, mWork, mRanges, mOp, mLSEp, mSplit, mSplit,
            scale_log2, scale_ln, v_scale, s_q, num_heads,
        ), stream)

    @cute.jit
    def load_tile(
        self, g2s: cute.TiledCopy, g2s_raw: cute.TiledCopy, thr_g2s, thr_g2s_raw,
        mKV: cute.Tensor, mPT: cute.Tensor, b: cutlass.Int32, n: cutlass.Int32,
        stage: cutlass.Int32, blocks_per_page: cutlass.Int32, kv_len: cutlass.Int32,
        tKcK: cute.Tensor, tKsK: cute.Tensor, tRsR: cute.Tensor,
    ):
        """cp.async one 64-token KV tile (block n of request b) into ring slot `stage`."""
        page = mPT[b, n // blocks_per_page]
        gK = cute.local_tile(mKV[page, None, None], (BLOCK_N, D_QK), (n % blocks_per_page, 0))
        if cutlass.const_expr(self.is_fp8):
            # whole tile (rows past kv_len stay inside the page; zeroed at conversion)
            cute.copy(g2s_raw, thr_g2s_raw.partition_S(gK), tRsR[None, None, None, stage])
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
        sP_layout: cute.ComposedLayout, sKraw_layout: cute.Layout, sRed_layout: cute.Layout,
        g2s: cute.TiledCopy, g2s_raw: cute.TiledCopy, g2r_q: cute.TiledCopy,
        s2r_raw: cute.TiledCopy, r2s: cute.TiledCopy,
        mma_s: cute.TiledMma, mma_o: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
    ):
        cute.arch.griddepcontrol_launch_dependents()  # PDL trigger for the combine (combine.MLACombine)
        tidx, _, _ = cute.arch.thread_idx()
        m_block, wi, _ = cute.arch.block_idx()
        lane = tidx % 32
        warp_n = (tidx // 32) // self.m_warps  # atom layout (m_warps, NW_N, 1), column-major

        b = mWork[wi, 0]
        if b >= 0:
            self.run_item(
                mQ, mKV, mPT, mLens, mO, mLSE, mWork, mOp, mLSEp,
                scale_log2, scale_ln, v_scale, s_q, num_heads,
                sQ_layout, sK_layout, sP_layout, sKraw_layout, sRed_layout,
                g2s, g2s_raw, g2r_q, s2r_raw, r2s, mma_s, mma_o, SharedStorage,
                m_block, wi, b, tidx, lane, warp_n, mWork, mWork,
            )

    @cute.kernel
    def kernel_balanced(
        self,
        mQ: cute.Tensor, mKV: cute.Tensor, mPT: cute.Tensor, mLens: cute.Tensor,
        mO: cute.Tensor, mLSE: cute.Tensor, mWork: cute.Tensor, mRanges: cute.Tensor,
        mOp: cute.Tensor, mLSEp: cute.Tensor,
        scale_log2: cutlass.Float32, scale_ln: cutlass.Float32, v_scale: cutlass.Float32,
        s_q: cutlass.Int32, num_heads: cutlass.Int32,
        sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout,
        sP_layout: cute.ComposedLayout, sKraw_layout: cute.Layout, sRed_layout: cute.Layout,
        g2s: cute.TiledCopy, g2s_raw: cute.TiledCopy, g2r_q: cute.TiledCopy,
        s2r_raw: cute.TiledCopy, r2s: cute.TiledCopy,
        mma_s: cute.TiledMma, mma_o: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
    ):
        """Balanced split-KV: CTA (m_block, column) runs the work rows mRanges[column] ..
        mRanges[column + 1] - 1 one after the other (each: today's per-item body, Q load to
        epilogue). Consecutive items reuse sQ/sK/sP/sRed: every item ends with all its cp.async
        groups drained (wait_group 0) and its last shared-memory reads behind the epilogue's
        barriers; the barrier at each item start orders them once more before the next item's
        Q/K cp.asyncs are issued."""
        cute.arch.griddepcontrol_launch_dependents()  # PDL trigger for the combine (combine.MLACombine)
        tidx, _, _ = cute.arch.thread_idx()
        m_block, col, _ = cute.arch.block_idx()
        lane = tidx % 32
        warp_n = (tidx // 32) // self.m_warps  # atom layout (m_warps, NW_N, 1), column-major

        i_end = mRanges[col + 1]
        for wi in cutlass.range(mRanges[col], i_end, 1):
            b = mWork[wi, 0]
            if b >= 0:
                cute.arch.barrier()
                self.run_item(
                    mQ, mKV, mPT, mLens, mO, mLSE, mWork, mOp, mLSEp,
                    scale_log2, scale_ln, v_scale, s_q, num_heads,
                    sQ_layout, sK_layout, sP_layout, sKraw_layout, sRed_layout,
                    g2s, g2s_raw, g2r_q, s2r_raw, r2s, mma_s, mma_o, SharedStorage,
                    m_block, wi, b, tidx, lane, warp_n, mWork, mWork,
                )

    @cute.kernel
    def kernel_balanced_fused(
        self,
        mQ: cute.Tensor, mKV: cute.Tensor, mPT: cute.Tensor, mLens: cute.Tensor,
        mO: cute.Tensor, mLSE: cute.Tensor, mWork: cute.Tensor, mRanges: cute.Tensor,
        mOp: cute.Tensor, mLSEp: cute.Tensor, mSplit: cute.Tensor, mCnt: cute.Tensor,
        scale_log2: cutlass.Float32, scale_ln: cutlass.Float32, v_scale: cutlass.Float32,
        s_q: cutlass.Int32, num_heads: cutlass.Int32,
        sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout,
        sP_layout: cute.ComposedLayout, sKraw_layout: cute.Layout, sRed_layout: cute.Layout,
        g2s: cute.TiledCopy, g2s_raw: cute.TiledCopy, g2r_q: cute.TiledCopy,
        s2r_raw: cute.TiledCopy, r2s: cute.TiledCopy,
        mma_s: cute.TiledMma, mma_o: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
    ):
        """kernel_balanced with the fused merge (fused_merge.py): first out = 0 / lse = -inf for the requests with
        no KV that fall to this CTA column (they have no work item), then the column's items, each split item
        ending with its arrival and, in the request's last CTA, the merge (run_item). Also the cluster pair kernel's
        body (call_balanced_pair: a pair item ends in the DSMEM merge instead, pair_merge.py)."""
        tidx, _, _ = cute.arch.thread_idx()
        m_block, col, _ = cute.arch.block_idx()
        lane = tidx % 32
        warp_n = (tidx // 32) // self.m_warps  # atom layout (m_warps, NW_N, 1), column-major

        fm.fill_empty_requests(mO, mLSE, mSplit, col, cute.size(mRanges.shape[0]) - 1, m_block, self.block_m,
                               tidx, self.num_threads, self.q_dtype)
        i_end = mRanges[col + 1]
        for wi in cutlass.range(mRanges[col], i_end, 1):
            b = mWork[wi, 0]
            if b >= 0:
                cute.arch.barrier()
                self.run_item(
                    mQ, mKV, mPT, mLens, mO, mLSE, mWork, mOp, mLSEp,
                    scale_log2, scale_ln, v_scale, s_q, num_heads,
                    sQ_layout, sK_layout, sP_layout, sKraw_layout, sRed_layout,
                    g2s, g2s_raw, g2r_q, s2r_raw, r2s, mma_s, mma_o, SharedStorage,
                    m_block, wi, b, tidx, lane, warp_n, mSplit, mCnt,
                )

    @cute.jit
    def run_item(
        self,
        mQ: cute.Tensor, mKV: cute.Tensor, mPT: cute.Tensor, mLens: cute.Tensor,
        mO: cute.Tensor, mLSE: cute.Tensor, mWork: cute.Tensor, mOp: cute.Tensor,
        mLSEp: cute.Tensor,
        scale_log2: cutlass.Float32, scale_ln: cutlass.Float32, v_scale: cutlass.Float32,
        s_q: cutlass.Int32, num_heads: cutlass.Int32,
        sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout,
        sP_layout: cute.ComposedLayout, sKraw_layout: cute.Layout, sRed_layout: cute.Layout,
        g2s: cute.TiledCopy, g2s_raw: cute.TiledCopy, g2r_q: cute.TiledCopy,
        s2r_raw: cute.TiledCopy, r2s: cute.TiledCopy,
        mma_s: cute.TiledMma, mma_o: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
        m_block: cutlass.Int32, wi: cutlass.Int32, b: cutlass.Int32,
        tidx: cutlass.Int32, lane: cutlass.Int32, warp_n: cutlass.Int32,
        mSplit: cute.Tensor, mCnt: cute.Tensor,
    ):
        """One work item (row wi of mWork, request b >= 0) for one m-block: Q load, the KV
        tiles' online softmax, epilogue to out/lse (slot -1) or to the partial slot. With fused, after a
        partial slot's epilogue: the arrival on mCnt[b] and, in the last CTA of request b, the merge of its
        splits (split_info mSplit; fused_merge.py). Without fused mSplit / mCnt are unused placeholders."""
        mt = self.mma_dtype
        kv_start = mWork[wi, 1]
        kv_end = mWork[wi, 2]
        slot = mWork[wi, 3]
        kv_len = mLens[b]
        R = mQ.shape[1]
        blocks_per_page = mKV.shape[1] // BLOCK_N
        n_start = kv_start // BLOCK_N
        n_end = (kv_end + BLOCK_N - 1) // BLOCK_N

        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        sQ = storage.sQ.get_tensor(sQ_layout)
        sK = storage.sK.get_tensor(sK_layout)
        sKraw = storage.sKraw.get_tensor(sKraw_layout)
        sP = storage.sP.get_tensor(sP_layout)
        sRed = storage.sRed.get_tensor(sRed_layout)
        # V^T view: (512, 64, bufs) -> element (n, d, s) of sK
        sVt = cute.composition(
            sK,
            cute.make_layout((D_V, BLOCK_N, self.k_bufs), stride=(BLOCK_N, 1, BLOCK_N * D_QK)),
        )

        # ---------------- Q: gmem -> smem (rows >= R zero) ----------------
        thr_g2s = g2s.get_slice(tidx)
        gQ = cute.local_tile(mQ[b, None, None], (self.block_m, D_QK), (m_block, 0))
        cQ = cute.local_tile(
            cute.make_identity_tensor((mQ.shape[1], D_QK)), (self.block_m, D_QK), (m_block, 0)
        )
        if cutlass.const_expr(self.is_fp8):
            thr_q = g2r_q.get_slice(tidx)
            tQgQ = thr_q.partition_S(gQ)
            tQcQ = thr_q.partition_S(cQ)
            thr_r2s = r2s.get_slice(tidx)
            tQsQ = thr_r2s.partition_D(sQ)
            rQ = cute.make_rmem_tensor_like(tQgQ)
            rQ.fill(0)
            for m in cutlass.range_constexpr(cute.size(tQgQ.shape[1])):
                if tQcQ[0, m, 0][0] < R:
                    cute.copy(g2r_q, tQgQ[None, m, None], rQ[None, m, None])
            rQm = cute.make_rmem_tensor_like(tQsQ, mt)
            rQm.store(rQ.load().to(mt))
            cute.copy(r2s, rQm, tQsQ)
        else:
            tQgQ = thr_g2s.partition_S(gQ)
            tQsQ = thr_g2s.partition_D(sQ)
            tQcQ = thr_g2s.partition_S(cQ)
            for m in cutlass.range_constexpr(cute.size(tQsQ.shape[1])):
                if tQcQ[0, m, 0][0] < R:
                    cute.copy(g2s, tQgQ[None, m, None], tQsQ[None, m, None])
                else:
                    tQsQ[None, m, None].fill(0)

        cKV = cute.make_identity_tensor((BLOCK_N, D_QK))
        tKcK = thr_g2s.partition_S(cKV)
        tKsK = thr_g2s.partition_D(sK)  # (CPY, N, K, bufs)
        thr_g2s_raw = g2s_raw.get_slice(tidx)
        tRsR = thr_g2s_raw.partition_D(sKraw)  # (CPY, N, K, raw stages)

        # prologue: tiles n_start .. n_start + ring - 2, one commit group each
        for p in cutlass.range_constexpr(self.ring - 1):
            if n_start + p < n_end:
                self.load_tile(g2s, g2s_raw, thr_g2s, thr_g2s_raw, mKV, mPT, b, n_start + p, p,
                               blocks_per_page, kv_len, tKcK, tKsK, tRsR)
            cute.arch.cp_async_commit_group()

        # ---------------- MMA partitions ----------------
        thr_s = mma_s.get_slice(tidx)
        thr_o = mma_o.get_slice(tidx)
        tSrQ = thr_s.make_fragment_A(thr_s.partition_A(sQ))
        tSrK = thr_s.make_fragment_B(thr_s.partition_B(sK[None, None, 0]))
        tOrP = thr_o.make_fragment_A(thr_o.partition_A(sP))
        tOrV = thr_o.make_fragment_B(thr_o.partition_B(sVt[None, None, 0]))
        acc_O = cute.make_rmem_tensor(thr_o.partition_shape_C((self.block_m, D_V)), cutlass.Float32)
        acc_O.fill(0.0)

        ldsm = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), mt)
        ldsm_t = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4), mt)
        s2r_Q = cute.make_tiled_copy_A(ldsm, mma_s).get_slice(tidx)
        s2r_K = cute.make_tiled_copy_B(ldsm, mma_s).get_slice(tidx)
        s2r_P = cute.make_tiled_copy_A(ldsm, mma_o).get_slice(tidx)
        s2r_V = cute.make_tiled_copy_B(ldsm_t, mma_o).get_slice(tidx)
        tSsQ = s2r_Q.partition_S(sQ)
        tSrQ_v = s2r_Q.retile(tSrQ)
        tSsK = s2r_K.partition_S(sK)  # (CPY, N, K, bufs)
        tSrK_v = s2r_K.retile(tSrK)
        tOsP = s2r_P.partition_S(sP)
        tOrP_v = s2r_P.retile(tOrP)
        tOsV = s2r_V.partition_S(sVt)  # (CPY, N, K, bufs)
        tOrV_v = s2r_V.retile(tOrV)
        # P registers -> sP
        r2s_P = cute.make_tiled_copy_C(cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), mt), mma_s)
        thr_r2s_P = r2s_P.get_slice(tidx)
        tPsP = thr_r2s_P.partition_D(sP)

        # rows of this thread (same rows in the S and O partitions)
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
        thr_r2s = r2s.get_slice(tidx)
        tCsR = thr_s2r_raw.partition_S(sKraw)
        tCsK = thr_r2s.partition_D(sK)
        tCcK = thr_r2s.partition_D(cKV)

        acc_O_mn = _acc_mn_view(acc_O)
        is_quad_leader = lane % 4 == 0

        for n in cutlass.range(n_start, n_end, 1):
            it = n - n_start
            slot_r = it % self.ring
            kst = 0 if cutlass.const_expr(self.is_fp8) else slot_r
            cute.arch.cp_async_wait_group(self.ring - 2)
            cute.arch.barrier()
            if n + self.ring - 1 < n_end:
                self.load_tile(g2s, g2s_raw, thr_g2s, thr_g2s_raw, mKV, mPT, b,
                               n + self.ring - 1, (it + self.ring - 1) % self.ring,
                               blocks_per_page, kv_len, tKcK, tKsK, tRsR)
            cute.arch.cp_async_commit_group()

            if cutlass.const_expr(self.is_fp8):
                # raw[slot] (fp8) -> sK (fp16), rows past kv_len zeroed
                valid = kv_len - n * BLOCK_N
                rF8 = cute.make_rmem_tensor_like(tCsR[None, None, None, 0])
                cute.copy(s2r_raw, tCsR[None, None, None, slot_r], rF8)
                rH = cute.make_rmem_tensor_like(tCsK[None, None, None, 0], mt)
                rH.store(rF8.load().to(mt))
                for m in cutlass.range_constexpr(cute.size(rH.shape[1])):
                    if tCcK[0, m, 0][0] >= valid:
                        rH[None, m, None].fill(0)
                cute.copy(r2s, rH, tCsK[None, None, None, 0])
                cute.arch.barrier()

            # ---------------- S = Q K^T (this warp's 16 kv columns) ----------------
            # N_ACC independent accumulators break the 36-long MMA dependency chain
            s_shape = thr_s.partition_shape_C((self.block_m, BLOCK_N))
            accs = []
            for a in cutlass.range_constexpr(self.n_acc):
                acc_a = cute.make_rmem_tensor(s_shape, cutlass.Float32)
                acc_a.fill(0.0)
                accs.append(acc_a)
            nk = cute.size(tSsQ.shape[2])
            cute.copy(s2r_Q, tSsQ[None, None, 0], tSrQ_v[None, None, 0])
            cute.copy(s2r_K, tSsK[None, None, 0, kst], tSrK_v[None, None, 0])
            for k in cutlass.range_constexpr(nk):
                if cutlass.const_expr(k + 1 < nk):
                    cute.copy(s2r_Q, tSsQ[None, None, k + 1], tSrQ_v[None, None, k + 1])
                    cute.copy(s2r_K, tSsK[None, None, k + 1, kst], tSrK_v[None, None, k + 1])
                acc_k = accs[k % self.n_acc]
                cute.gemm(mma_s, acc_k, tSrQ[None, None, k], tSrK[None, None, k], acc_k)
            acc_S = accs[0]
            if cutlass.const_expr(self.n_acc == 4):
                acc_S.store((accs[0].load() + accs[1].load()) + (accs[2].load() + accs[3].load()))
            if cutlass.const_expr(self.n_acc == 2):
                acc_S.store(accs[0].load() + accs[1].load())

            # ---------------- mask, local row max -> sRed ----------------
            acc_S_mn = _acc_mn_view(acc_S)
            for r in cutlass.range_constexpr(n_rows):
                lim = row_lim[r] - n * BLOCK_N
                for c in cutlass.range_constexpr(cute.size(acc_S_mn.shape[1])):
                    if tScS[0, c][1] >= lim:
                        acc_S_mn[r, c] = -cutlass.Float32.inf
                m_loc = _quad_max(
                    acc_S_mn[r, None].load().reduce(cute.ReductionOp.MAX, -cutlass.Float32.inf, 0)
                )
                if is_quad_leader:
                    sRed[tScS[r, 0][0], warp_n] = m_loc
            cute.arch.barrier()

            # ---------------- online softmax, P -> sP ----------------
            for r in cutlass.range_constexpr(n_rows):
                row = tScS[r, 0][0]
                m_cur = cute.arch.fmax(
                    cute.arch.fmax(sRed[row, 0], sRed[row, 1]),
                    cute.arch.fmax(sRed[row, 2], sRed[row, 3]),
                )
                m_prev = row_max[r]
                m_new = cute.arch.fmax(m_prev, m_cur)
                m_use = 0.0 if m_new == -cutlass.Float32.inf else m_new
                p_row = cute.math.exp2(
                    acc_S_mn[r, None].load() * scale_log2 - m_use * scale_log2, fastmath=True
                )
                corr = cute.math.exp2(m_prev * scale_log2 - m_use * scale_log2, fastmath=True)
                row_sum[r] = row_sum[r] * corr + p_row.reduce(
                    cute.ReductionOp.ADD, cutlass.Float32.zero, 0
                )
                row_max[r] = m_new
                acc_S_mn[r, None] = p_row
                acc_O_mn[r, None] = acc_O_mn[r, None].load() * corr
            rP = cute.make_fragment_like(acc_S, mt)
            rP.store(acc_S.load().to(mt))
            cute.copy(r2s_P, thr_r2s_P.retile(rP), tPsP)
            cute.arch.barrier()

            # ---------------- O += P V (this warp's quarter of the 512 columns) --------
            nkv = cute.size(tOsP.shape[2])
            cute.copy(s2r_P, tOsP[None, None, 0], tOrP_v[None, None, 0])
            cute.copy(s2r_V, tOsV[None, None, 0, kst], tOrV_v[None, None, 0])
            for k in cutlass.range_constexpr(nkv):
                if cutlass.const_expr(k + 1 < nkv):
                    cute.copy(s2r_P, tOsP[None, None, k + 1], tOrP_v[None, None, k + 1])
                    cute.copy(s2r_V, tOsV[None, None, k + 1, kst], tOrV_v[None, None, k + 1])
                cute.gemm(mma_o, acc_O, tOrP[None, None, k], tOrV[None, None, k], acc_O)

        cute.arch.cp_async_wait_group(0)

        # ---------------- epilogue: row sums across the NW_N warps ----------------
        cute.arch.barrier()
        for r in cutlass.range_constexpr(n_rows):
            s_loc = _quad_sum(row_sum[r])
            if is_quad_leader:
                sRed[tScS[r, 0][0], warp_n] = s_loc
        cute.arch.barrier()
        row_scale = cute.make_rmem_tensor((n_rows,), cutlass.Float32)
        row_lse = cute.make_rmem_tensor((n_rows,), cutlass.Float32)
        for r in cutlass.range_constexpr(n_rows):
            row = tScS[r, 0][0]
            s = (sRed[row, 0] + sRed[row, 1]) + (sRed[row, 2] + sRed[row, 3])
            ok = s > 0.0
            row_scale[r] = v_scale / s if ok else 0.0
            row_lse[r] = (
                row_max[r] * scale_ln + cute.math.log(s, fastmath=False)
                if ok
                else -cutlass.Float32.inf
            )
        lse_writer = warp_n == 0
        if lane % 4 != 0:
            lse_writer = False
        cO = cute.make_identity_tensor((self.block_m, D_V))
        tOcO = _acc_mn_view(thr_o.partition_C(cO))
        if slot < 0:
            if cutlass.const_expr(self.pair):
                if slot < -1:
                    # pair item (schedule form "pair"): merge with the cluster peer through DSMEM (pair_merge.py)
                    sX = storage.sK.get_tensor(
                        cute.make_layout((self.block_m, pm.XSTRIDE), stride=(pm.XSTRIDE, 1)), dtype=cutlass.Float32
                    )
                    for r in cutlass.range_constexpr(n_rows):
                        row = tOcO[r, 0][0]
                        for c in cutlass.range_constexpr(cute.size(acc_O_mn.shape[1])):
                            sX[row, tOcO[r, c][1]] = acc_O_mn[r, c] * row_scale[r]
                        if lse_writer:
                            sX[row, pm.LSE_COL] = row_lse[r]
                    pm.merge_pair(sX, mO, mLSE, b, m_block, R, tidx, self.block_m, self.num_threads, self.q_dtype)
                else:
                    self.store_rows(mO, mLSE, b, acc_O_mn, row_scale, row_lse, tOcO, thr_o, m_block, R, lane,
                                    lse_writer, self.wide_store)
            else:
                self.store_rows(mO, mLSE, b, acc_O_mn, row_scale, row_lse, tOcO, thr_o, m_block, R, lane, lse_writer,
                                self.wide_store)
        else:
            self.store_rows(mOp, mLSEp, slot, acc_O_mn, row_scale, row_lse, tOcO, thr_o, m_block, R, lane,
                            lse_writer, self.wide_store and mOp.element_type.width == 16)
            if cutlass.const_expr(self.fused):
                # combine=fused: arrive; the last of the request's target arrivals merges it (fused_merge.py)
                target = mSplit[b, 1] * cute.arch.grid_dim()[0]
                last = fm.arrive(mCnt, b, target, sRed, tidx)
                if last:
                    cute.arch.fence_acq_rel_gpu()
                    fm.merge_request(mO, mLSE, mOp, mLSEp, b, mSplit[b, 0], mSplit[b, 1], tidx, self.num_threads,
                                     self.q_dtype)
                    fm.release_counter(mCnt, b, tidx)

    @cute.jit
    def store_rows(
        self, mRows: cute.Tensor, mL: cute.Tensor, i: cutlass.Int32, acc_O_mn: cute.Tensor, row_scale: cute.Tensor,
        row_lse: cute.Tensor, tOcO: cute.Tensor, thr_o, m_block: cutlass.Int32, R: cutlass.Int32,
        lane: cutlass.Int32, lse_writer, wide: cutlass.Constexpr,
    ):
        """The epilogue's rows of mRows[i] (R, 512): out[b] in q's dtype (i = b, slot -1) or partial slot i in the
        partial buffer's dtype, and their lse into mL[i]: 16 bytes per store (store_rows_wide) when `wide`, else
        each thread's accumulator column pairs directly."""
        if cutlass.const_expr(wide):
            self.store_rows_wide(mRows[i, None, None], mL[i, None], acc_O_mn, row_scale, row_lse, tOcO, m_block, R,
                                 lane, lse_writer)
        else:
            gO = cute.local_tile(mRows[i, None, None], (self.block_m, D_V), (m_block, 0))
            tOgO = _acc_mn_view(thr_o.partition_C(gO))
            for r in cutlass.range_constexpr(cute.size(acc_O_mn.shape[0])):
                grow = m_block * self.block_m + tOcO[r, 0][0]
                if grow < R:
                    tOgO[r, None].store((acc_O_mn[r, None].load() * row_scale[r]).to(mRows.element_type))
                    if lse_writer:
                        mL[i, grow] = row_lse[r]

    @cute.jit
    def store_rows_wide(
        self, mRows: cute.Tensor, mL: cute.Tensor, acc_O_mn: cute.Tensor, row_scale: cute.Tensor,
        row_lse: cute.Tensor, tOcO: cute.Tensor, m_block: cutlass.Int32, R: cutlass.Int32,
        lane: cutlass.Int32, lse_writer,
    ):
        """Epilogue rows with 16-byte stores (wide_store): mRows (R, 512) 16-bit, out (q dtype) or a 16-bit
        partial slot (fp32 partials keep the direct 8-byte pair stores). Per row the quad exchanges its column pairs
        (wide_store.pack_transposed, all lanes, also past R), then each lane stores one 8-column block per
        group (its own column there minus 2 * (lane % 4)), and the lse as before."""
        n_rows = cute.size(acc_O_mn.shape[0])
        for r in cutlass.range_constexpr(n_rows):
            grow = m_block * self.block_m + tOcO[r, 0][0]
            h = ws.pack_transposed(acc_O_mn[r, None].load() * row_scale[r], mRows.element_type, lane)
            if grow < R:
                for g in cutlass.range_constexpr(ws.groups(h)):
                    col = tOcO[r, 2 * ws.stored_pair(g, lane)][1] - 2 * (lane % ws.QUAD)
                    ws.store_group(h, g, mRows[grow, None], col)
                if lse_writer:
                    mL[grow] = row_lse[r]
