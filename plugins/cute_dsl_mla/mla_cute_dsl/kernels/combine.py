"""Combine kernel: merge split-KV partial outputs (fp32, or bf16/fp16: summed in fp32) and their LSEs."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute


class MLACombine:
    """Merge split-KV partials: out = sum_i w_i o_i, lse = log sum_i exp(lse_i).

    One warp per query row and `cols`-column chunk: its lanes reduce the split LSEs in parallel, then every lane
    accumulates cols / 32 columns over the splits. cols=512: one warp takes the whole row; cols=128 (kernel-cache
    key tag "cols128", schedule.combine_kind_for's "chunked"): four warps share a row, 4 columns per lane, so a
    step with few requests has 4x the warps in flight (an H200 ncu trace of B=16 H=16 s_q=2 S=4096 had the wide
    combine at 8.8 us beside a 27.8 us partial kernel, latency-bound).

    pdl: launched with programmatic dependent launch, so that its CTAs are scheduled while the partial
    kernel still runs (every partial kernel triggers its dependents at its start) and wait in
    griddepcontrol.wait until the partial grid has finished and its writes are visible: the combine's
    launch latency is hidden behind the partial kernel instead of following it."""

    ROWS_PER_CTA = 4

    def __init__(self, q_dtype, pdl: bool = False, cols: int = 512):
        if cols not in (128, 512):
            raise ValueError(f"cols must be 128 or 512, got {cols}")
        self.q_dtype = q_dtype
        self.pdl = pdl
        self.cols = cols

    @cute.jit
    def __call__(
        self,
        mO: cute.Tensor,  # (B, R, 512) q dtype
        mLSE: cute.Tensor,  # (B, R) fp32
        mSplit: cute.Tensor,  # (max_batch, 2) int32: first slot, count
        mOp: cute.Tensor,  # (slots, R, 512) fp32, bf16 or fp16 (alloc_workspace partial_dtype)
        mLSEp: cute.Tensor,  # (slots, R) fp32
        stream,
    ):
        grid = (
            cute.size(mO.shape[0]),
            cute.ceil_div(cute.size(mO.shape[1]), self.ROWS_PER_CTA),
            512 // self.cols,
        )
        self.kernel(mO, mLSE, mSplit, mOp, mLSEp).launch(
            grid=grid, block=[32 * self.ROWS_PER_CTA, 1, 1], stream=stream, use_pdl=self.pdl
        )

    @cute.kernel
    def kernel(
        self,
        mO: cute.Tensor, mLSE: cute.Tensor, mSplit: cute.Tensor,
        mOp: cute.Tensor, mLSEp: cute.Tensor,
    ):
        """One warp per query row and column chunk: lanes reduce the split LSEs in parallel, then
        every lane accumulates cols / 32 of the chunk's columns over the splits."""
        if cutlass.const_expr(self.pdl):
            cute.arch.griddepcontrol_wait()  # the partial grid's writes (mOp, mLSEp, mO) are visible after this
        tidx, _, _ = cute.arch.thread_idx()
        b, rb, chunk = cute.arch.block_idx()
        lane = tidx % 32
        row = rb * self.ROWS_PER_CTA + tidx // 32
        col0 = chunk * self.cols
        per_lane = self.cols // 32
        first = mSplit[b, 0]
        cnt = mSplit[b, 1]
        R = mO.shape[1]
        if cnt != 1 and row < R:
            m = -cutlass.Float32.inf
            for i in cutlass.range(lane, cnt, 32):
                m = cute.arch.fmax(m, mLSEp[first + i, row])
            for off in cutlass.range_constexpr(5):
                m = cute.arch.fmax(
                    m, cute.arch.shuffle_sync_bfly(m, offset=16 >> off, mask=-1, mask_and_clamp=31)
                )
            m_use = 0.0 if m == -cutlass.Float32.inf else m
            ssum = cutlass.Float32(0.0)
            for i in cutlass.range(lane, cnt, 32):
                ssum = ssum + cute.math.exp(mLSEp[first + i, row] - m_use, fastmath=False)
            for off in cutlass.range_constexpr(5):
                ssum = ssum + cute.arch.shuffle_sync_bfly(
                    ssum, offset=16 >> off, mask=-1, mask_and_clamp=31
                )
            acc = cute.make_rmem_tensor((per_lane,), cutlass.Float32)
            acc.fill(0.0)
            if ssum > 0.0:
                for i in cutlass.range(0, cnt, 1, unroll=4):
                    w = cute.math.exp(mLSEp[first + i, row] - m_use, fastmath=False)
                    for j in cutlass.range_constexpr(per_lane):
                        acc[j] = acc[j] + w * mOp[first + i, row, col0 + j * 32 + lane].to(cutlass.Float32)
            inv = 1.0 / ssum if ssum > 0.0 else 0.0
            for j in cutlass.range_constexpr(per_lane):
                mO[b, row, col0 + j * 32 + lane] = (acc[j] * inv).to(self.q_dtype)
            if lane == 0 and chunk == 0:
                mLSE[b, row] = (
                    m_use + cute.math.log(ssum, fastmath=False)
                    if ssum > 0.0
                    else -cutlass.Float32.inf
                )


class MLACombineWide:
    """The same merge for requests split into many items (small batches, long contexts).

    MLACombine gives each query row one warp that walks every split in turn: at
    B=1 that is B*R/4 CTAs (4 for H=16) walking up to 256 splits each, so the
    combine, not the partial kernel, set the time (36 us at B=1 H=16 S=4096,
    120 us at S=16384 with fp8 KV on an H200). Here one CTA takes one (request,
    row, 128-column chunk); its WARPS warps share out the splits (warp w takes
    splits w, w + WARPS, ...), each lane accumulates 4 columns, and the warps'
    sums meet in shared memory. Every warp reduces the split LSEs itself (the
    same values in the same order, so the same max and sum in every warp).
    """

    WARPS = 8
    COLS = 128  # columns per CTA (4 per lane)

    def __init__(self, q_dtype, pdl: bool = False):
        self.q_dtype = q_dtype
        self.pdl = pdl  # as MLACombine's

    @cute.jit
    def __call__(
        self,
        mO: cute.Tensor,  # (B, R, 512) q dtype
        mLSE: cute.Tensor,  # (B, R) fp32
        mSplit: cute.Tensor,  # (max_batch, 2) int32: first slot, count
        mOp: cute.Tensor,  # (slots, R, 512) fp32, bf16 or fp16
        mLSEp: cute.Tensor,  # (slots, R) fp32
        stream,
    ):
        @cute.struct
        class SharedStorage:
            sAcc: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, self.WARPS * self.COLS], 16]

        grid = (cute.size(mO.shape[0]), cute.size(mO.shape[1]), 512 // self.COLS)
        self.kernel(mO, mLSE, mSplit, mOp, mLSEp, SharedStorage).launch(
            grid=grid, block=[32 * self.WARPS, 1, 1], stream=stream, use_pdl=self.pdl
        )

    @cute.kernel
    def kernel(
        self,
        mO: cute.Tensor, mLSE: cute.Tensor, mSplit: cute.Tensor,
        mOp: cute.Tensor, mLSEp: cute.Tensor, SharedStorage: cutlass.Constexpr,
    ):
        if cutlass.const_expr(self.pdl):
            cute.arch.griddepcontrol_wait()  # the partial grid's writes are visible after this
        tidx, _, _ = cute.arch.thread_idx()
        b, row, chunk = cute.arch.block_idx()
        lane = tidx % 32
        warp = tidx // 32
        col0 = chunk * self.COLS
        first = mSplit[b, 0]
        cnt = mSplit[b, 1]
        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        sAcc = storage.sAcc.get_tensor(cute.make_layout((self.WARPS, self.COLS), stride=(self.COLS, 1)))
        per_lane = self.COLS // 32
        acc = cute.make_rmem_tensor((per_lane,), cutlass.Float32)
        acc.fill(0.0)
        m_use = cutlass.Float32(0.0)
        ssum = cutlass.Float32(0.0)
        if cnt != 1:  # the same for every thread of the CTA
            m = -cutlass.Float32.inf
            for i in cutlass.range(lane, cnt, 32):
                m = cute.arch.fmax(m, mLSEp[first + i, row])
            for off in cutlass.range_constexpr(5):
                m = cute.arch.fmax(
                    m, cute.arch.shuffle_sync_bfly(m, offset=16 >> off, mask=-1, mask_and_clamp=31)
                )
            m_use = 0.0 if m == -cutlass.Float32.inf else m
            for i in cutlass.range(lane, cnt, 32):
                ssum = ssum + cute.math.exp(mLSEp[first + i, row] - m_use, fastmath=False)
            for off in cutlass.range_constexpr(5):
                ssum = ssum + cute.arch.shuffle_sync_bfly(ssum, offset=16 >> off, mask=-1, mask_and_clamp=31)
            if ssum > 0.0:
                for i in cutlass.range(warp, cnt, self.WARPS, unroll=4):
                    w = cute.math.exp(mLSEp[first + i, row] - m_use, fastmath=False)
                    for j in cutlass.range_constexpr(per_lane):
                        acc[j] = acc[j] + w * mOp[first + i, row, col0 + j * 32 + lane].to(cutlass.Float32)
        for j in cutlass.range_constexpr(per_lane):
            sAcc[warp, j * 32 + lane] = acc[j]
        cute.arch.barrier()
        if cnt != 1 and warp == 0:
            inv = 1.0 / ssum if ssum > 0.0 else 0.0
            for j in cutlass.range_constexpr(per_lane):
                total = cutlass.Float32(0.0)
                for w in cutlass.range_constexpr(self.WARPS):
                    total = total + sAcc[w, j * 32 + lane]
                mO[b, row, col0 + j * 32 + lane] = (total * inv).to(self.q_dtype)
            if lane == 0 and chunk == 0:
                mLSE[b, row] = m_use + cute.math.log(ssum, fastmath=False) if ssum > 0.0 else -cutlass.Float32.inf
