"""Combine kernel: merge split-KV partial outputs (fp32) and their LSEs."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute


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
        """One warp per query row: lanes reduce the split LSEs in parallel, then
        every lane accumulates 16 of the 512 columns over the splits."""
        tidx, _, _ = cute.arch.thread_idx()
        b, rb, _ = cute.arch.block_idx()
        lane = tidx % 32
        row = rb * self.ROWS_PER_CTA + tidx // 32
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
            acc = cute.make_rmem_tensor((16,), cutlass.Float32)
            acc.fill(0.0)
            if ssum > 0.0:
                for i in cutlass.range(0, cnt, 1, unroll=4):
                    w = cute.math.exp(mLSEp[first + i, row] - m_use, fastmath=False)
                    for j in cutlass.range_constexpr(16):
                        acc[j] = acc[j] + w * mOp[first + i, row, j * 32 + lane]
            inv = 1.0 / ssum if ssum > 0.0 else 0.0
            for j in cutlass.range_constexpr(16):
                mO[b, row, j * 32 + lane] = (acc[j] * inv).to(self.q_dtype)
            if lane == 0:
                mLSE[b, row] = (
                    m_use + cute.math.log(ssum, fastmath=False)
                    if ssum > 0.0
                    else -cutlass.Float32.inf
                )
