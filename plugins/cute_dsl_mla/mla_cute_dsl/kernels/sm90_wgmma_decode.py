"""SM90 MLA decode, split-KV partial kernel with WGMMA (H*s_q >= 64).

Status: bf16 / fp16 and fp8 e4m3 KV verified on an H200 (``tests/test_wgmma_gpu.py``)
and picked by the backend (``backend.py``, option ``mma``).

Same host interface as ``sm90_decode.MLADecodePartial`` (same arguments, same
work items, same partial buffers, same combine kernel).  Only BLOCK_M = 64;
KV cache in the q dtype (bf16 / fp16) or fp8 e4m3.

Why: with H = 128 the decode is compute-bound (FLOPs/byte ~ 2 * s_q * H) and
the mma.sync kernel stops at ~260 TFLOP/s: every 16x8x16 MMA re-loads its
operands through ldmatrix into registers, so shared-memory -> register traffic
and issue slots, not the tensor cores, set the pace.  WGMMA reads Q, K and V
straight from shared memory through descriptors (64 x N x 16 per instruction,
issued by a whole warpgroup), which is how FlashMLA and FlashInfer fa3 reach
~600 TFLOP/s.

Schedule (FlashMLA's first SM90 kernel, not yet the "seesaw" one):

* CTA = 2 warpgroups (256 threads), one 64-row Q tile (``s_q * H`` rows packed,
  row r = query ``r // H``, head ``r % H``), one work item (a range of 64-token
  KV blocks of one request, ``schedule.py``).  The output tile 64 x 512 fp32 is
  32768 registers: too many for one warpgroup, so warpgroup 0 owns O[:, :256]
  and warpgroup 1 owns O[:, 256:] (128 fp32 accumulators per thread each).
* Per KV tile n (64 tokens, 576 columns, in smem buffer n % 2):
    all: wait for tile n (cp.async), barrier, start cp.async of tile n+1
    WG0: S = Q K^T           WGMMA SS 64x64x576 (Q and K K-major in smem)
         mask, online softmax in registers; P (bf16) -> sP, rescale -> sScale
         arrive on the "P ready" named barrier
         O_L = O_L * scale + P V[:, :256]     WGMMA RS (P stays in registers)
    WG1: wait on "P ready"
         O_R = O_R * sScale + sP V[:, 256:]   WGMMA SS (P from smem)
  V is the first 512 columns of the K tile, read MN-major from the same smem
  (a K-major SW128 K tile *is* an MN-major SW128 V^T tile: same bytes, see
  ``_smem_layouts``), so nothing is copied or transposed.
* S is computed once (no redundant QK): QK is 53% of the FLOPs
  (576 / (576 + 512)) and doing it in both warpgroups would cost 1.5x.
  The price is an imbalance: WG0 issues QK + half of PV, WG1 half of PV.
  FlashMLA's later "seesaw" schedule (two KV tiles in flight, each warpgroup
  computes S for one of them and exchanges P) removes that; it needs a third
  72 KB tile or P stored over the dead RoPE columns of K, see NOTES.md.
* KV loads: cp.async, 16 B per thread-copy, 256 threads, one page-table read
  per tile (a 64-token block never crosses a page, page_size % 64 == 0).
  Rows past kv_len are zero-filled in smem: page tails may hold NaN and
  0 * NaN = NaN in P V.  (Why not TMA yet: see NOTES.md.)  cp.async writes go
  through the generic proxy while WGMMA reads through the async proxy, hence
  ``fence_view_async_shared`` after each wait and before the barrier.
* fp8 e4m3 KV (as ``sm90_decode``): MMAs in fp16 (e4m3 -> f16 is exact; q
  converted bf16 -> fp16 when loaded, |q| < 65504), kv_scale folded into the
  softmax scale and the output.  Smem: one 16-bit sK tile and a ring of two
  raw fp8 tiles (2 x 36 KB = one 72 KB tile, so the total is unchanged).  Per
  tile: wait for raw tile n, barrier, cp.async raw tile n+1 into the other
  slot, all 256 threads convert raw tile n into sK (SW128, rows past kv_len
  zeroed: ld.shared 64 bit, 4 x ``cvt.rn.f16x2.e4m3x2``, st.shared 128 bit per
  8 elements), ``fence_view_async_shared`` (generic st.shared -> WGMMA's async
  proxy), barrier, then the same WG0 / WG1 math with sK buffer 0.  The
  conversion does not overlap the WGMMAs (one sK buffer; see NOTES.md).
* ``MLADecodePartialWGMMASeesaw`` (below): both warpgroups compute S for alternate
  tiles; with fp8 KV it converts per warpgroup from registers into two fp16 K tiles,
  overlapped with the WGMMAs (branch wgmma-fp8-seesaw, NOTES.md).
* Rows past ``s_q * H`` are zero in sQ and never written.  Masked scores are
  -inf; fully masked rows give out = 0 and lse = -inf (same contract as the
  mma.sync kernel).
"""

from __future__ import annotations

import collections

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync, warpgroup

from . import fp8p_ring as _ring
from . import wide_store as ws

try:  # cp.async.bulk.prefetch.L2 (seesaw kernel only; without it the kernel skips the prefetch)
    import cutlass.experimental.primitives.nvvm_wrapper as _nvw
except ImportError:  # pragma: no cover - other DSL versions
    _nvw = None

D_QK = 576
D_V = 512
BLOCK_M = 64
BLOCK_N = 64
D_V_HALF = D_V // 2  # output columns per math warpgroup
WG_THREADS = 128
NUM_THREADS = 2 * WG_THREADS
STAGES = 2  # K/V tiles in smem (double buffering), 16-bit KV
RAW_STAGES = 2  # fp8 KV: raw fp8 tiles in smem (the ring cp.async fills); one 16-bit sK
BAR_P_READY = 1  # named barrier: WG0 arrives after writing sP/sScale, WG1 syncs
SMEM_LIMIT = 232448  # bytes of dynamic smem per CTA on SM90 (227 KB)


def _quad_max(v):
    v = cute.arch.fmax(v, cute.arch.shuffle_sync_bfly(v, offset=2, mask=-1, mask_and_clamp=31))
    v = cute.arch.fmax(v, cute.arch.shuffle_sync_bfly(v, offset=1, mask=-1, mask_and_clamp=31))
    return v


def _quad_sum(v):
    v = v + cute.arch.shuffle_sync_bfly(v, offset=2, mask=-1, mask_and_clamp=31)
    v = v + cute.arch.shuffle_sync_bfly(v, offset=1, mask=-1, mask_and_clamp=31)
    return v


def _acc_mn_view(acc: cute.Tensor) -> cute.Tensor:
    """View a WGMMA C fragment ((2, 2, N/8), MMA_M, MMA_N) as (rows, cols).

    Per thread of a warpgroup, a 64 x N accumulator holds 2 rows (r, r + 8 of
    its warp's 16) and, per 8-column block, 2 adjacent columns: value mode
    (col pair, row half, col block).  Rows are spread over the 4 lanes of a
    quad, as with mma.sync, so row reductions are two butterfly shuffles.
    """
    lc = cute.make_layout(acc.layout.shape)
    s, d = lc.shape, lc.stride
    mn = cute.make_layout(
        ((s[0][1], s[1]), (s[0][0], s[0][2], s[2])),
        stride=((d[0][1], d[1]), (d[0][0], d[0][2], d[2])),
    )
    return cute.make_tensor(acc.iterator, cute.composition(acc.layout, mn))


class MLADecodePartialWGMMA:
    """Split-KV partial kernel, WGMMA, BLOCK_M = 64, KV in the q dtype."""

    def __init__(self, q_dtype, kv_dtype, block_m: int = BLOCK_M, wide_store: bool = False):
        if q_dtype not in (cutlass.BFloat16, cutlass.Float16):
            raise TypeError(f"q dtype must be bf16 or fp16, got {q_dtype}")
        if kv_dtype is not q_dtype and kv_dtype is not cutlass.Float8E4M3FN:
            raise NotImplementedError(
                f"WGMMA kernel: KV cache must have the q dtype or be fp8 e4m3, got {kv_dtype}")
        if block_m != BLOCK_M:
            raise ValueError(f"WGMMA prototype: block_m must be {BLOCK_M}, got {block_m}")
        self.q_dtype = q_dtype
        self.kv_dtype = kv_dtype
        # wide_store: 16-bit epilogue rows (the q-dtype output, 16-bit partials) exchanged in the quad and
        # stored 16 bytes per instruction (wide_store.py); fp32 partials keep their 8-byte stores
        self.wide_store = bool(wide_store)
        self.is_fp8 = kv_dtype is cutlass.Float8E4M3FN
        # fp8 KV: MMAs in fp16 (e4m3 -> f16 is exact), q converted to fp16 on load
        self.mma_dtype = cutlass.Float16 if self.is_fp8 else q_dtype
        self.q_cvt = self.q_dtype is not self.mma_dtype  # bf16 q with fp8 KV
        # 16-bit K/V tiles in sK: 2 (double buffer) for 16-bit KV; 1 for fp8 KV,
        # whose double buffer is the raw fp8 ring (RAW_STAGES tiles, 36 KB each)
        self.k_bufs = 1 if self.is_fp8 else STAGES
        self.raw_stages = RAW_STAGES if self.is_fp8 else 0
        self.block_m = block_m
        self.num_threads = NUM_THREADS

    # ------------------------------------------------------------------ host side
    def smem_bytes(self) -> int:
        """Dynamic smem per CTA.

        16-bit KV: sQ 72 KB + 2 x sK 72 KB + sP 8 KB + sScale 256 B = 229,632 B.
        fp8 KV:    sQ 72 KB + 1 x sK 72 KB + 2 x raw fp8 36 KB + sP 8 KB + sScale
                   256 B = 229,632 B (the same: two raw fp8 tiles = one 16-bit tile).
        """
        e = self.mma_dtype.width // 8
        parts = [
            (BLOCK_M * D_QK * e, 1024),  # sQ
            (self.k_bufs * BLOCK_N * D_QK * e, 1024),  # sK (V = its first 512 columns)
        ]
        if self.is_fp8:
            parts.append((self.raw_stages * BLOCK_N * D_QK, 1024))  # sKraw (fp8 ring)
        parts += [
            (BLOCK_M * BLOCK_N * e, 1024),  # sP
            (BLOCK_M * 4, 16),  # sScale (per-row rescale, then v_scale / row sum)
        ]
        off = 0
        for size, align in parts:
            off = -(-off // align) * align + size
        return off

    def _smem_layouts(self):
        """128B-swizzled (SW128) layouts, in elements, as WGMMA descriptors want them.

        K-major SW128 atom: 8 rows x 64 elements (128 B), Swizzle<3,4,3>.
        sK is that atom tiled over (64 tokens, 576 dims, stage), tokens first,
        so element (t, d) sits in atom (t // 8, d // 64) at atom index
        t // 8 + 8 * (d // 64).  The MN-major SW128 atom is 64 elements along
        N x 8 along K with the same swizzle: tiling it over (512 dims, 64
        tokens) K (tokens) first gives element (d, t) the very same offset.
        That view is the B operand of O += P V, read from the K tile's bytes.
        """
        mt = self.mma_dtype
        k_atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, mt)
        mn_atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.MN_SW128, mt)
        sQ = cute.tile_to_shape(k_atom, (BLOCK_M, D_QK), (0, 1))
        sK = cute.tile_to_shape(k_atom, (BLOCK_N, D_QK, self.k_bufs), (0, 1, 2))
        sP = cute.tile_to_shape(k_atom, (BLOCK_M, BLOCK_N), (0, 1))
        v_one = cute.tile_to_shape(mn_atom, (D_V, BLOCK_N), (1, 0))
        # stage mode with sK's stage stride (64 * 576 elements), not 64 * 512
        v_outer = cute.make_layout(
            (v_one.outer.shape[0], v_one.outer.shape[1], self.k_bufs),
            stride=(v_one.outer.stride[0], v_one.outer.stride[1], BLOCK_N * D_QK),
        )
        sV = cute.make_composed_layout(v_one.inner, 0, v_outer)
        return sQ, sK, sP, sV

    def _tiled_mmas(self):
        """One warpgroup (atom layout 1x1x1) per tiled MMA.

        mma_s : S = Q K^T, 64 x 64 per instruction group, A and B from smem, K-major.
        mma_o_rs : WG0's O_L += P V_L, A = P in registers (K-major by
                   definition), B = V MN-major from smem, N = 256.
        mma_o_ss : WG1's O_R += sP V_R, A = P from smem (K-major), B as above.
        """
        mt = self.mma_dtype
        K = cute.nvgpu.OperandMajorMode.K
        MN = cute.nvgpu.OperandMajorMode.MN
        f32 = cutlass.Float32
        mma_s = cute.make_tiled_mma(
            warpgroup.MmaF16BF16Op(mt, f32, (BLOCK_M, BLOCK_N, 16), warpgroup.OperandSource.SMEM, K, K)
        )
        mma_o_rs = cute.make_tiled_mma(
            warpgroup.MmaF16BF16Op(mt, f32, (BLOCK_M, D_V_HALF, 16), warpgroup.OperandSource.RMEM, K, MN)
        )
        mma_o_ss = cute.make_tiled_mma(
            warpgroup.MmaF16BF16Op(mt, f32, (BLOCK_M, D_V_HALF, 16), warpgroup.OperandSource.SMEM, K, MN)
        )
        return mma_s, mma_o_rs, mma_o_ss

    def _fp8_copies(self):
        """Tiled copies of the fp8 path (256 threads; built for every kernel, used by fp8 KV only).

        g2s_raw: gmem fp8 -> raw ring, 16 B (16 elements) per cp.async, 4 threads
                 per 64-element row chunk: 9 per thread per 64 x 576 tile.
        s2r_raw: raw ring -> registers, 8 fp8 (64 bit) per ld.shared.
        r2s:     registers -> sK / sQ, 8 x 16 bit (128 bit) per st.shared.
        g2r_q:   q (gmem, q dtype) -> registers, 8 elements (128 bit) per ld.global.
        s2r_raw, r2s and g2r_q share one thread-value layout (that of g2s), so
        element (v, m, k) of a thread's partitions is the same (row, col) of the
        tile in all three (checked in the CPU test).
        """
        f8 = cutlass.Float8E4M3FN
        thr8 = cute.make_layout((NUM_THREADS // 8, 8), stride=(8, 1))
        g2s_raw = cute.make_tiled_copy_tv(
            cute.make_copy_atom(
                cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), f8, num_bits_per_copy=128
            ),
            cute.make_layout((NUM_THREADS // 4, 4), stride=(4, 1)),
            cute.make_layout((1, 16)),
        )
        s2r_raw = cute.make_tiled_copy_tv(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), f8, num_bits_per_copy=64),
            thr8, cute.make_layout((1, 8)),
        )
        r2s = cute.make_tiled_copy_tv(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.mma_dtype, num_bits_per_copy=128),
            thr8, cute.make_layout((1, 8)),
        )
        g2r_q = cute.make_tiled_copy_tv(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.q_dtype, num_bits_per_copy=128),
            thr8, cute.make_layout((1, 8)),
        )
        return g2s_raw, s2r_raw, r2s, g2r_q

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
        mt = self.mma_dtype
        sQ_layout, sK_layout, sP_layout, sV_layout = self._smem_layouts()
        mma_s, mma_o_rs, mma_o_ss = self._tiled_mmas()
        mma_s_first, _, _ = self._tiled_mmas()

        f8 = cutlass.Float8E4M3FN
        # raw fp8 ring (fp8 KV only): row-major (64, 576) tiles, RAW_STAGES of them
        sKraw_layout = cute.make_layout(
            (BLOCK_N, D_QK, RAW_STAGES), stride=(D_QK, 1, BLOCK_N * D_QK)
        )

        if cutlass.const_expr(self.is_fp8):

            @cute.struct
            class SharedStorage:
                sQ: cute.struct.Align[cute.struct.MemRange[mt, cute.cosize(sQ_layout)], 1024]
                sK: cute.struct.Align[cute.struct.MemRange[mt, cute.cosize(sK_layout)], 1024]
                sKraw: cute.struct.Align[cute.struct.MemRange[f8, cute.cosize(sKraw_layout)], 1024]
                sP: cute.struct.Align[cute.struct.MemRange[mt, cute.cosize(sP_layout)], 1024]
                sScale: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, BLOCK_M], 16]

        else:

            @cute.struct
            class SharedStorage:
                sQ: cute.struct.Align[cute.struct.MemRange[mt, cute.cosize(sQ_layout)], 1024]
                sK: cute.struct.Align[cute.struct.MemRange[mt, cute.cosize(sK_layout)], 1024]
                sP: cute.struct.Align[cute.struct.MemRange[mt, cute.cosize(sP_layout)], 1024]
                sScale: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, BLOCK_M], 16]

        # gmem -> smem, 16 B per copy, 8 threads per 64-element row chunk
        g2s = cute.make_tiled_copy_tv(
            cute.make_copy_atom(
                cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), mt, num_bits_per_copy=128
            ),
            cute.make_layout((NUM_THREADS // 8, 8), stride=(8, 1)),
            cute.make_layout((1, 8)),
        )
        # fp8 KV only (built always, unused otherwise)
        g2s_raw, s2r_raw, r2s, g2r_q = self._fp8_copies()
        # S accumulator (C layout of mma_s) -> sP, element-wise
        r2s_P = cute.make_tiled_copy_C(cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), mt), mma_s)

        grid = (
            cute.ceil_div(cute.size(mQ.shape[1]), BLOCK_M),
            cute.size(mWork.shape[0]),
            1,
        )
        self.kernel(
            mQ, mKV, mPT, mLens, mO, mLSE, mWork, mOp, mLSEp,
            scale_log2, scale_ln, v_scale, s_q, num_heads,
            sQ_layout, sK_layout, sP_layout, sV_layout, sKraw_layout,
            g2s, r2s_P, g2s_raw, s2r_raw, r2s, g2r_q,
            mma_s, mma_s_first, mma_o_rs, mma_o_ss, SharedStorage,
        ).launch(grid=grid, block=[NUM_THREADS, 1, 1], stream=stream)

    # ---------------------------------------------------------------- device side
    @cute.jit
    def load_q(
        self, mQ: cute.Tensor, sQ: cute.Tensor, g2s: cute.TiledCopy, thr_g2s, r2s_q: cute.TiledCopy,
        g2r_q: cute.TiledCopy, tidx: cutlass.Int32, b: cutlass.Int32, m_block: cutlass.Int32,
        R: cutlass.Int32,
    ):
        """Q rows of m-block `m_block` of request b into sQ, rows >= R zeroed.  16-bit KV: cp.async
        (the caller commits the group).  bf16 q with fp8 KV: ld.global (q dtype) -> cvt to the MMA
        dtype -> st.shared, one 32-row chunk at a time; generic-proxy stores, covered by the fence
        the caller issues before the first WGMMA reads sQ."""
        mt = self.mma_dtype
        gQ = cute.local_tile(mQ[b, None, None], (BLOCK_M, D_QK), (m_block, 0))
        cQ = cute.local_tile(
            cute.make_identity_tensor((mQ.shape[1], D_QK)), (BLOCK_M, D_QK), (m_block, 0)
        )
        if cutlass.const_expr(self.q_cvt):
            thr_q = g2r_q.get_slice(tidx)
            thr_r2s_q = r2s_q.get_slice(tidx)
            tQgQ = thr_q.partition_S(gQ)
            tQcQ = thr_q.partition_S(cQ)
            tQsQ = thr_r2s_q.partition_D(sQ)
            for m in cutlass.range_constexpr(cute.size(tQgQ.shape[1])):
                rQ = cute.make_rmem_tensor_like(tQgQ[None, m, None])
                rQ.fill(0)
                if tQcQ[0, m, 0][0] < R:
                    cute.copy(g2r_q, tQgQ[None, m, None], rQ)
                rQm = cute.make_rmem_tensor_like(tQsQ[None, m, None], mt)
                rQm.store(rQ.load().to(mt))
                cute.copy(r2s_q, rQm, tQsQ[None, m, None])
        else:
            tQgQ = thr_g2s.partition_S(gQ)
            tQsQ = thr_g2s.partition_D(sQ)
            tQcQ = thr_g2s.partition_S(cQ)
            for m in cutlass.range_constexpr(cute.size(tQsQ.shape[1])):
                if tQcQ[0, m, 0][0] < R:
                    cute.copy(g2s, tQgQ[None, m, None], tQsQ[None, m, None])
                else:
                    tQsQ[None, m, None].fill(0)

    @cute.jit
    def load_tile(
        self, g2s: cute.TiledCopy, thr_g2s, mKV: cute.Tensor, mPT: cute.Tensor,
        b: cutlass.Int32, n: cutlass.Int32, stage: cutlass.Int32,
        blocks_per_page: cutlass.Int32, kv_len: cutlass.Int32,
        tKcK: cute.Tensor, tKsK: cute.Tensor,
    ):
        """cp.async KV block n of request b (64 x 576) into sK[:, :, stage]; rows >= kv_len zeroed."""
        page = mPT[b, n // blocks_per_page]
        gK = cute.local_tile(mKV[page, None, None], (BLOCK_N, D_QK), (n % blocks_per_page, 0))
        tKgK = thr_g2s.partition_S(gK)
        valid = kv_len - n * BLOCK_N
        for m in cutlass.range_constexpr(cute.size(tKsK.shape[1])):
            if tKcK[0, m, 0][0] < valid:
                cute.copy(g2s, tKgK[None, m, None], tKsK[None, m, None, stage])
            else:
                tKsK[None, m, None, stage].fill(0)

    @cute.jit
    def load_tile_raw(
        self, g2s_raw: cute.TiledCopy, thr_g2s_raw, mKV: cute.Tensor, mPT: cute.Tensor,
        b: cutlass.Int32, n: cutlass.Int32, rstage: cutlass.Int32,
        blocks_per_page: cutlass.Int32, tRsR: cute.Tensor,
    ):
        """fp8 KV: cp.async KV block n of request b (64 x 576 fp8) into raw ring slot rstage.

        The whole tile: rows past kv_len stay inside the page (a 64-token block
        never crosses a page) and are zeroed by the conversion, not here.
        """
        page = mPT[b, n // blocks_per_page]
        gK = cute.local_tile(mKV[page, None, None], (BLOCK_N, D_QK), (n % blocks_per_page, 0))
        cute.copy(g2s_raw, thr_g2s_raw.partition_S(gK), tRsR[None, None, None, rstage])

    @cute.jit
    def convert_tile(
        self, s2r_raw: cute.TiledCopy, r2s: cute.TiledCopy, tCsR: cute.Tensor, tCsK: cute.Tensor,
        tCcK: cute.Tensor, rstage: cutlass.Int32, valid: cutlass.Int32,
    ):
        """fp8 KV: raw ring slot rstage (fp8) -> sK (fp16, SW128), rows >= valid zeroed.

        All 256 threads, 144 elements each: per 64-element row chunk one 64-bit
        ld.shared, 4 cvt.rn.f16x2.e4m3x2, one 128-bit st.shared.  Done one
        chunk row (m) at a time so that at most 72 converted values are live
        (the O accumulators hold 128 registers across the whole loop).
        """
        mt = self.mma_dtype
        for m in cutlass.range_constexpr(cute.size(tCsK.shape[1])):
            rF8 = cute.make_rmem_tensor_like(tCsR[None, m, None, 0])
            cute.copy(s2r_raw, tCsR[None, m, None, rstage], rF8)
            rH = cute.make_rmem_tensor_like(tCsK[None, m, None, 0], mt)
            rH.store(rF8.load().to(mt))
            if tCcK[0, m, 0][0] >= valid:
                rH.fill(0)
            cute.copy(r2s, rH, tCsK[None, m, None, 0])

    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor, mKV: cute.Tensor, mPT: cute.Tensor, mLens: cute.Tensor,
        mO: cute.Tensor, mLSE: cute.Tensor, mWork: cute.Tensor, mOp: cute.Tensor,
        mLSEp: cute.Tensor,
        scale_log2: cutlass.Float32, scale_ln: cutlass.Float32, v_scale: cutlass.Float32,
        s_q: cutlass.Int32, num_heads: cutlass.Int32,
        sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout,
        sP_layout: cute.ComposedLayout, sV_layout: cute.ComposedLayout, sKraw_layout: cute.Layout,
        g2s: cute.TiledCopy, r2s_P: cute.TiledCopy,
        g2s_raw: cute.TiledCopy, s2r_raw: cute.TiledCopy, r2s: cute.TiledCopy, g2r_q: cute.TiledCopy,
        mma_s: cute.TiledMma, mma_s_first: cute.TiledMma,
        mma_o_rs: cute.TiledMma, mma_o_ss: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
    ):
        cute.arch.griddepcontrol_launch_dependents()  # PDL trigger for the combine (combine.MLACombine)
        tidx, _, _ = cute.arch.thread_idx()
        m_block, wi, _ = cute.arch.block_idx()
        wg = cute.arch.make_warp_uniform(tidx // WG_THREADS)
        wg_tidx = tidx % WG_THREADS
        lane = tidx % 32

        b = mWork[wi, 0]
        if b >= 0:
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
            # swizzle moved into the pointer: WGMMA partitions want affine layouts
            sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
            sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
            sP = storage.sP.get_tensor(sP_layout.outer, swizzle=sP_layout.inner)
            sV = cute.make_tensor(cute.recast_ptr(sK.iterator, sV_layout.inner), sV_layout.outer)
            sScale = storage.sScale.get_tensor(cute.make_layout(BLOCK_M))

            # ---------------- Q: gmem -> smem (rows >= R zero), one commit group -------------
            thr_g2s = g2s.get_slice(tidx)
            self.load_q(mQ, sQ, g2s, thr_g2s, r2s, g2r_q, tidx, b, m_block, R)

            cKV = cute.make_identity_tensor((BLOCK_N, D_QK))
            tKcK = thr_g2s.partition_S(cKV)
            tKsK = thr_g2s.partition_D(sK)  # (CPY, N, K, k_bufs)
            # fp8 KV: raw ring and the conversion partitions (raw -> sK[:, :, 0])
            thr_g2s_raw = g2s_raw.get_slice(tidx)
            thr_s2r_raw = s2r_raw.get_slice(tidx)
            thr_r2s = r2s.get_slice(tidx)
            tCcK = thr_r2s.partition_D(cKV)  # (CPY, N, K) coordinates
            tCsK = thr_r2s.partition_D(sK)  # (CPY, N, K, 1)
            if cutlass.const_expr(self.is_fp8):
                sKraw = storage.sKraw.get_tensor(sKraw_layout)
                tRsR = thr_g2s_raw.partition_D(sKraw)  # (CPY, N, K, RAW_STAGES), cp.async
                tCsR = thr_s2r_raw.partition_S(sKraw)  # (CPY, N, K, RAW_STAGES), ld.shared
            # the first KV tile joins Q's commit group.  Guarded: an item with no
            # tile (kv_len 0; the schedule makes none today, but the kernel must
            # not depend on it) would read a page-table entry that may not exist
            # (max_pages can be 0) and load from a garbage page.  With no tile the
            # loop below is skipped and the epilogue writes out 0 / lse -inf.
            if n_start < n_end:
                if cutlass.const_expr(self.is_fp8):
                    self.load_tile_raw(g2s_raw, thr_g2s_raw, mKV, mPT, b, n_start, 0,
                                       blocks_per_page, tRsR)
                else:
                    self.load_tile(g2s, thr_g2s, mKV, mPT, b, n_start, 0, blocks_per_page, kv_len,
                                   tKcK, tKsK)
            cute.arch.cp_async_commit_group()

            # ---------------- per-warpgroup MMA partitions ----------------
            # O is zeroed once and only ever accumulated into; S starts from zero:
            # its first k-step uses mma_s_first (overwrite).  Set here, before the
            # tile loop and the per-warpgroup branches: an atom field set inside a
            # loop or branch is a value that must not be used after it (the DSL
            # rejects the IR), and the epilogue partitions with mma_o_rs again.
            mma_o_rs.set(warpgroup.Field.ACCUMULATE, True)
            mma_o_ss.set(warpgroup.Field.ACCUMULATE, True)
            mma_s.set(warpgroup.Field.ACCUMULATE, True)
            mma_s_first.set(warpgroup.Field.ACCUMULATE, False)
            thr_s = mma_s.get_slice(wg_tidx)
            tSrQ = thr_s.make_fragment_A(thr_s.partition_A(sQ))  # (MMA, 1, 36) descriptors
            tSrK = thr_s.make_fragment_B(thr_s.partition_B(sK))  # (MMA, 1, 36, STAGES)
            s_shape = thr_s.partition_shape_C((BLOCK_M, BLOCK_N))
            cS = cute.make_identity_tensor((BLOCK_M, BLOCK_N))
            tScS = _acc_mn_view(thr_s.partition_C(cS))
            n_rows = cute.size(tScS.shape[0])  # 2 rows per thread

            # this warpgroup's 256 output columns of V: (256, 64, STAGES)
            sV_half = cute.local_tile(sV, (D_V_HALF, BLOCK_N, self.k_bufs), (wg, 0, 0))
            thr_o = mma_o_rs.get_slice(wg_tidx)  # same C/B partitioning for RS and SS
            acc_O = cute.make_rmem_tensor(thr_o.partition_shape_C((BLOCK_M, D_V_HALF)), cutlass.Float32)
            acc_O.fill(0.0)
            acc_O_mn = _acc_mn_view(acc_O)
            is_quad_leader = lane % 4 == 0

            row_lim = cute.make_rmem_tensor((n_rows,), cutlass.Int32)
            for r in cutlass.range_constexpr(n_rows):
                grow = m_block * BLOCK_M + tScS[r, 0][0]
                row_lim[r] = kv_len - s_q + grow // num_heads + 1
            row_max = cute.make_rmem_tensor((n_rows,), cutlass.Float32)
            row_sum = cute.make_rmem_tensor((n_rows,), cutlass.Float32)
            row_max.fill(-cutlass.Float32.inf)
            row_sum.fill(0.0)

            for n in cutlass.range(n_start, n_end, 1):
                stage = (n - n_start) % STAGES
                kst = stage  # sK buffer the WGMMAs of tile n read
                if cutlass.const_expr(self.is_fp8):
                    kst = 0
                    # raw tile n (and Q) landed, visible to every thread.  The
                    # barrier also means both warpgroups are done with tile n-1
                    # (sK, sP, sScale; their WGMMAs waited) and every thread is
                    # done converting raw slot (stage + 1) % 2 (tile n-1).
                    cute.arch.cp_async_wait_group(0)
                    cute.arch.barrier()
                    if n + 1 < n_end:
                        self.load_tile_raw(g2s_raw, thr_g2s_raw, mKV, mPT, b, n + 1,
                                           (stage + 1) % RAW_STAGES, blocks_per_page, tRsR)
                    cute.arch.cp_async_commit_group()
                    # raw -> sK (fp16); the generic-proxy st.shared writes (and Q's, on
                    # the first tile) -> visible to WGMMA's async proxy, then to all
                    self.convert_tile(s2r_raw, r2s, tCsR, tCsK, tCcK, stage, kv_len - n * BLOCK_N)
                    cute.arch.fence_view_async_shared()
                    cute.arch.barrier()
                else:
                    # tile n (and Q) landed; make the generic-proxy cp.async writes
                    # visible to WGMMA's async proxy, then to every thread.  The
                    # barrier also means both warpgroups are done with tile n-1 and
                    # with sP / sScale of iteration n-1.
                    cute.arch.cp_async_wait_group(0)
                    cute.arch.fence_view_async_shared()
                    cute.arch.barrier()
                    if n + 1 < n_end:
                        self.load_tile(g2s, thr_g2s, mKV, mPT, b, n + 1, (stage + 1) % STAGES,
                                       blocks_per_page, kv_len, tKcK, tKsK)
                    cute.arch.cp_async_commit_group()

                if wg == 0:
                    self.wg0_tile(mma_s_first, mma_s, mma_o_rs, r2s_P, tSrQ, tSrK, s_shape,
                                  tScS, sP, sScale, sV_half, acc_O, acc_O_mn, row_lim, row_max, row_sum,
                                  n, kst, scale_log2, wg_tidx, is_quad_leader)
                else:
                    self.wg1_tile(mma_o_ss, sP, sScale, sV_half, acc_O, acc_O_mn, tScS, kst,
                                  wg_tidx)

            cute.arch.cp_async_wait_group(0)

            # ---------------- epilogue ----------------
            # WG0 owns the softmax statistics: publish 1/sum (times v_scale) per row
            cute.arch.barrier()
            row_scale = cute.make_rmem_tensor((n_rows,), cutlass.Float32)
            row_lse = cute.make_rmem_tensor((n_rows,), cutlass.Float32)
            if wg == 0:
                for r in cutlass.range_constexpr(n_rows):
                    s = _quad_sum(row_sum[r])
                    ok = s > 0.0
                    row_scale[r] = v_scale / s if ok else 0.0
                    row_lse[r] = (
                        row_max[r] * scale_ln + cute.math.log(s, fastmath=False)
                        if ok
                        else -cutlass.Float32.inf
                    )
                    if is_quad_leader:
                        sScale[tScS[r, 0][0]] = row_scale[r]
            cute.arch.barrier()
            if wg == 1:
                for r in cutlass.range_constexpr(n_rows):
                    row_scale[r] = sScale[tScS[r, 0][0]]

            cO = cute.make_identity_tensor((BLOCK_M, D_V_HALF))
            tOcO = _acc_mn_view(thr_o.partition_C(cO))
            lse_writer = is_quad_leader
            if wg != 0:
                lse_writer = False
            self.store_epilogue(mO, mLSE, mOp, mLSEp, b, slot, acc_O_mn, row_scale, row_lse, tOcO, thr_o, m_block,
                                wg, R, lane, lse_writer)

    @cute.jit
    def store_epilogue(
        self, mO: cute.Tensor, mLSE: cute.Tensor, mOp: cute.Tensor, mLSEp: cute.Tensor, b: cutlass.Int32,
        slot: cutlass.Int32, acc_O_mn: cute.Tensor, row_scale: cute.Tensor, row_lse: cute.Tensor,
        tOcO: cute.Tensor, thr_o, m_block: cutlass.Int32, wg: cutlass.Int32, R: cutlass.Int32,
        lane: cutlass.Int32, lse_writer,
    ):
        """A warpgroup's epilogue rows (both the WGMMA and the seesaw kernel): its 256 columns of out[b] in q's dtype
        and the lse (slot -1: the item covers the whole request), else of partial slot `slot` in the partial
        buffer's dtype; 16-bit rows 16 bytes per store with wide_store (store_rows_wide), else each thread's
        column pairs directly."""
        if slot < 0:
            self.store_rows(mO, mLSE, b, acc_O_mn, row_scale, row_lse, tOcO, thr_o, m_block, wg, R, lane,
                            lse_writer, self.wide_store)
        else:
            self.store_rows(mOp, mLSEp, slot, acc_O_mn, row_scale, row_lse, tOcO, thr_o, m_block, wg, R, lane,
                            lse_writer, self.wide_store and mOp.element_type.width == 16)

    @cute.jit
    def store_rows(
        self, mRows: cute.Tensor, mL: cute.Tensor, i: cutlass.Int32, acc_O_mn: cute.Tensor, row_scale: cute.Tensor,
        row_lse: cute.Tensor, tOcO: cute.Tensor, thr_o, m_block: cutlass.Int32, wg: cutlass.Int32,
        R: cutlass.Int32, lane: cutlass.Int32, lse_writer, wide: cutlass.Constexpr,
    ):
        """store_epilogue's rows into mRows[i] (R, 512; this warpgroup's 256 columns) in mRows' dtype and their
        lse into mL[i]: store_rows_wide when `wide`, else each thread's column pairs directly."""
        if cutlass.const_expr(wide):
            self.store_rows_wide(mRows[i, None, None], mL[i, None], acc_O_mn, row_scale, row_lse, tOcO, m_block, wg,
                                 R, lane, lse_writer)
        else:
            gO = cute.local_tile(mRows[i, None, None], (BLOCK_M, D_V_HALF), (m_block, wg))
            tOgO = _acc_mn_view(thr_o.partition_C(gO))
            for r in cutlass.range_constexpr(cute.size(acc_O_mn.shape[0])):
                grow = m_block * BLOCK_M + tOcO[r, 0][0]
                if grow < R:
                    tOgO[r, None].store((acc_O_mn[r, None].load() * row_scale[r]).to(mRows.element_type))
                    if lse_writer:
                        mL[i, grow] = row_lse[r]

    @cute.jit
    def store_rows_wide(
        self, mRows: cute.Tensor, mL: cute.Tensor, acc_O_mn: cute.Tensor, row_scale: cute.Tensor,
        row_lse: cute.Tensor, tOcO: cute.Tensor, m_block: cutlass.Int32, wg: cutlass.Int32, R: cutlass.Int32,
        lane: cutlass.Int32, lse_writer,
    ):
        """Epilogue rows with 16-byte stores (wide_store), both the WGMMA and the seesaw kernel: mRows (R, 512)
        16-bit, out (q dtype) or a 16-bit partial slot; this warpgroup's 256 columns start at wg * 256
        (tOcO: coordinates in its (64, 256) tile). Per row the quad exchanges its column pairs (all lanes,
        also past R: full-mask shuffles), then each lane stores one 8-column block per group of 4 blocks
        (32 contiguous columns, so a quad writes 64 contiguous bytes), and the lse as before."""
        n_rows = cute.size(acc_O_mn.shape[0])
        for r in cutlass.range_constexpr(n_rows):
            grow = m_block * BLOCK_M + tOcO[r, 0][0]
            h = ws.pack_transposed(acc_O_mn[r, None].load() * row_scale[r], mRows.element_type, lane)
            if grow < R:
                for g in cutlass.range_constexpr(ws.groups(h)):
                    col = wg * D_V_HALF + tOcO[r, 2 * ws.stored_pair(g, lane)][1] - 2 * (lane % ws.QUAD)
                    ws.store_group(h, g, mRows[grow, None], col)
                if lse_writer:
                    mL[grow] = row_lse[r]

    @cute.jit
    def wg0_tile(
        self, mma_s_first: cute.TiledMma, mma_s: cute.TiledMma, mma_o_rs: cute.TiledMma,
        r2s_P: cute.TiledCopy,
        tSrQ: cute.Tensor, tSrK: cute.Tensor, s_shape: cutlass.Constexpr, tScS: cute.Tensor,
        sP: cute.Tensor, sScale: cute.Tensor, sV_half: cute.Tensor,
        acc_O: cute.Tensor, acc_O_mn: cute.Tensor,
        row_lim: cute.Tensor, row_max: cute.Tensor, row_sum: cute.Tensor,
        n: cutlass.Int32, stage: cutlass.Int32, scale_log2: cutlass.Float32,
        wg_tidx: cutlass.Int32, is_quad_leader,
    ):
        """Warpgroup 0, one KV tile: S = Q K^T, softmax, P -> sP, O_L += P V_L (RS)."""
        mt = self.mma_dtype
        # ---- S = Q K^T: 36 WGMMAs 64x64x16, one commit group ----
        acc_S = cute.make_rmem_tensor(s_shape, cutlass.Float32)
        warpgroup.fence()
        for k in cutlass.range_constexpr(cute.size(tSrQ.shape[2])):
            mma = mma_s_first if k == 0 else mma_s
            cute.gemm(mma, acc_S, tSrQ[None, None, k], tSrK[None, None, k, stage], acc_S)
        warpgroup.commit_group()
        warpgroup.wait_group(0)

        # ---- mask, online softmax (rows live in quads) ----
        acc_S_mn = _acc_mn_view(acc_S)
        n_rows = cute.size(acc_S_mn.shape[0])
        for r in cutlass.range_constexpr(n_rows):
            lim = row_lim[r] - n * BLOCK_N
            for c in cutlass.range_constexpr(cute.size(acc_S_mn.shape[1])):
                if tScS[0, c][1] >= lim:
                    acc_S_mn[r, c] = -cutlass.Float32.inf
            m_cur = _quad_max(
                acc_S_mn[r, None].load().reduce(cute.ReductionOp.MAX, -cutlass.Float32.inf, 0)
            )
            m_prev = row_max[r]
            m_new = cute.arch.fmax(m_prev, m_cur)
            m_use = 0.0 if m_new == -cutlass.Float32.inf else m_new
            p_row = cute.math.exp2(
                acc_S_mn[r, None].load() * scale_log2 - m_use * scale_log2, fastmath=True
            )
            corr = cute.math.exp2(m_prev * scale_log2 - m_use * scale_log2, fastmath=True)
            row_sum[r] = row_sum[r] * corr + p_row.reduce(cute.ReductionOp.ADD, cutlass.Float32.zero, 0)
            row_max[r] = m_new
            acc_S_mn[r, None] = p_row
            acc_O_mn[r, None] = acc_O_mn[r, None].load() * corr
            if is_quad_leader:
                sScale[tScS[r, 0][0]] = corr

        # ---- P: registers (A operand of the RS WGMMA) and sP (for WG1) ----
        # For 16-bit types the C fragment of a 64xN WGMMA and the A fragment of
        # a 64xK RS WGMMA list a thread's values in the same order (k-block j
        # of A = 8-column blocks 2j, 2j+1 of C), so P is a re-typed copy of S.
        thr_o = mma_o_rs.get_slice(wg_tidx)
        tOrP = cute.make_rmem_tensor(thr_o.partition_shape_A((BLOCK_M, BLOCK_N)), mt)
        tOrP_as_acc = cute.make_tensor(tOrP.iterator, acc_S.layout)
        tOrP_as_acc.store(acc_S.load().to(mt))
        thr_r2s = r2s_P.get_slice(wg_tidx)
        cute.copy(r2s_P, thr_r2s.retile(tOrP_as_acc), thr_r2s.partition_D(sP))
        # generic-proxy smem writes -> visible to WG1's WGMMA (async proxy), then signal
        cute.arch.fence_view_async_shared()
        cute.arch.barrier_arrive(barrier_id=BAR_P_READY, number_of_threads=NUM_THREADS)

        # ---- O_L += P V_L: 4 WGMMAs 64x256x16, A from registers ----
        tOrV = thr_o.make_fragment_B(thr_o.partition_B(sV_half))  # (MMA, 1, 4, STAGES)
        warpgroup.fence()
        for k in cutlass.range_constexpr(cute.size(tOrP.shape[2])):
            cute.gemm(mma_o_rs, acc_O, tOrP[None, None, k], tOrV[None, None, k, stage], acc_O)
        warpgroup.commit_group()
        warpgroup.wait_group(0)

    @cute.jit
    def wg1_tile(
        self, mma_o_ss: cute.TiledMma, sP: cute.Tensor, sScale: cute.Tensor,
        sV_half: cute.Tensor, acc_O: cute.Tensor, acc_O_mn: cute.Tensor, tScS: cute.Tensor,
        stage: cutlass.Int32, wg_tidx: cutlass.Int32,
    ):
        """Warpgroup 1, one KV tile: wait for P, O_R = O_R * scale + sP V_R (SS)."""
        cute.arch.barrier(barrier_id=BAR_P_READY, number_of_threads=NUM_THREADS)
        for r in cutlass.range_constexpr(cute.size(acc_O_mn.shape[0])):
            acc_O_mn[r, None] = acc_O_mn[r, None].load() * sScale[tScS[r, 0][0]]
        thr_o = mma_o_ss.get_slice(wg_tidx)
        tOrP = thr_o.make_fragment_A(thr_o.partition_A(sP))  # (MMA, 1, 4)
        tOrV = thr_o.make_fragment_B(thr_o.partition_B(sV_half))  # (MMA, 1, 4, STAGES)
        warpgroup.fence()
        for k in cutlass.range_constexpr(cute.size(tOrP.shape[2])):
            cute.gemm(mma_o_ss, acc_O, tOrP[None, None, k], tOrV[None, None, k, stage], acc_O)
        warpgroup.commit_group()
        warpgroup.wait_group(0)



# ---------------------------------------------------------------------- seesaw schedule
BAR_P_OF = (1, 2)  # seesaw: named barrier "P of WG w's tile ready" (WG w arrives, the other WG syncs)
SEESAW_QK_ORDER = (  # k-blocks (16 columns each) of QK in issue order, per owner warpgroup:
    (tuple(range(0, 16)), tuple(range(16, 36))),  # WG0: its own V half (cols 0..255) first
    (tuple(range(16, 32)), tuple(range(0, 16)) + tuple(range(32, 36))),  # WG1: cols 256..511 first
)
SEESAW_LOAD_BLOCKS = (  # 64-column blocks of a K tile that WG w loads: [owner, non-owner]
    ((0, 1, 2, 3), (0, 1, 2, 3, 8)),
    ((4, 5, 6, 7), (4, 5, 6, 7, 8)),
)
# wg1_other_first=True (16-bit KV; branch qk-order, GPU-verified): WG1's QK of its own tile b waits WG0's part
# (mbar + 2: columns 0..255 + RoPE) first and issues these k-blocks first, then its own part (mbar + 3, 256..511)
SEESAW_QK_ORDER_WG1_OTHER_FIRST = (SEESAW_QK_ORDER[1][1], SEESAW_QK_ORDER[1][0])
BAR_TAIL_OF = (3, 4)  # seesaw tma=True: named barrier of WG w's 128 threads after zeroing V tail rows
KV_BOX = 64  # tma=True: columns per TMA box (64 x 64 x 2 B = 8 KB: one SW128 K-major 64-column block of sK)
# q_prefetch=True (balanced, 16-bit KV): what seesaw_item needs of the column loop (seesaw_column_qpf): the q TMA atom,
# its (TMA, m-blocks, 9, B) / (TMA, 1, 9) partitions and mbarrier (index 4), the issuing warp, the parity of Q's latest
# phase, whether the previous item issued this one's tiles 0 / 1 (pf, 0 / 1), and of the next row: the request whose
# Q to issue (-1: none, or the same request), its first KV block, tiles 0 / 1 to issue (min(T', 2); 0: no next row),
# its length (cp.async zero-fill) and the cache pages of its tiles 0 / 1
QPrefetch = collections.namedtuple("QPrefetch", "atom tQgQ tQsQ mbar warp qpar pf q_next n0 nt nlen pg0 pg1")

# fp8_producer=True (fp8 KV only; the backend's default since 0.2.17): 384 threads, WG0 / WG1 the math warpgroups, WG2 the producer that
# ld.global's, converts and st.shared's every fp8 part. setmaxnreg draws from a per-CTA pool that holds only what
# the CTA got at launch (the cubin's register count: 65,536 / 384 rounded down to 8 = 168, times 384 = 64,512);
# setmaxnreg.inc blocks forever when the pool cannot pay (sm90_wgmma_t_decode's comment: a split that does not fit
# HANGS the GPU). 2 * 128 * 216 + 128 * 72 = 64,512: the producer releases (168 - 72) * 128 = 12,288, the math
# warpgroups take 2 * (216 - 168) * 128 = 12,288.
FP8P_THREADS = 3 * WG_THREADS
FP8P_REGS_AT_LAUNCH = (65536 // FP8P_THREADS) // 8 * 8  # 168
FP8P_MATH_REGS = 216
FP8P_PRODUCER_REGS = 72
BAR_MATH = 5  # fp8_producer: named barrier of the 256 math threads (Q landed; epilogue row sums)
# fp8_producer: fp8 elements per producer thread-copy: 16 (one 128-bit ld.global, two 128-bit st.shared of fp16;
# 4 threads per 64-column block, 32 rows per pass) or 8 (the inline kernel's 64-bit layout). A part stays 40
# registers either way (up to 5 blocks x 64 rows x 64 B / 128 threads); diagnostics only: not in the cache key
FP8P_ELEMS_PER_COPY = 16


def fp8p_register_split_fits(math_regs: int = FP8P_MATH_REGS, producer_regs: int = FP8P_PRODUCER_REGS,
                             regs_at_launch: int = FP8P_REGS_AT_LAUNCH) -> bool:
    """True when the two math warpgroups' setmaxnreg.inc can be paid from what the producer warpgroup's
    setmaxnreg.dec releases (the CTA's pool; exited warps are not counted on), with setmaxnreg's own rules
    (24..256, multiples of 8)."""
    released = (regs_at_launch - producer_regs) * WG_THREADS
    needed = (math_regs - regs_at_launch) * 2 * WG_THREADS
    legal = all(24 <= r <= 256 and r % 8 == 0 for r in (math_regs, producer_regs))
    return legal and producer_regs <= regs_at_launch <= math_regs and needed <= released


assert fp8p_register_split_fits(), "fp8_producer setmaxnreg split exceeds the CTA's register pool (would hang)"

# tma_producer=True (16-bit KV, tma=True, balanced=True; branch tma-producer, GPU-verified): 384 threads as fp8_producer,
# warpgroup 2 the TMA producer (one warp walks the column's items and issues every KV part and every Q load). The
# pool (168 x 384) pays at most 240 / 24: (168 - 24) * 128 = 18,432 released, (240 - 168) * 2 * 128 = 18,432 taken.
# But at 24 the producer spills (standalone ptxas 13.0: 4-28 bytes, in the fp32-partial arms too, with its pages
# read per pair: it holds the loop state, tensor-map and table addresses), and the math side needs no more than
# 216 (ptxas: no spill at 216 / 72 in any arm, spills from 208 or 200 down), so 232 / 40: (168 - 40) * 128 =
# 16,384 released, (232 - 168) * 2 * 128 = 16,384 taken, no spill on either side (test_seesaw_tmap_compile.py)
TMAP_MATH_REGS = 232
TMAP_PRODUCER_REGS = 40
assert fp8p_register_split_fits(TMAP_MATH_REGS, TMAP_PRODUCER_REGS), "tma_producer setmaxnreg split (would hang)"
# tma_producer: mbarrier indices after full[0..3] (count 1, expect_tx) and empty[4..7] (count 128): Q full (count 1,
# the producer's arrive.expect_tx of the 73,728 bytes of nine 64 x 64 boxes) and Q empty (count 256: every math
# thread once its last S WGMMA of the last item of a request is waited)
TMAP_Q_FULL = 8
TMAP_Q_EMPTY = 9
# what seesaw_item needs of the tma_producer column walk (seesaw_column_tmap): the Q full / empty mbarriers, the parity
# of Q's latest full phase (this item's Q: loaded for it or for an earlier item of the same request) and whether this
# item releases sQ (arrives on Q empty once its last S is waited: the next row names another request or none)
TmapQ = collections.namedtuple("TmapQ", "full empty qpar release")


def tmap_tile_b_parts(wg1_other_first: bool) -> tuple:
    """tma_producer: tile b's two parts as (load blocks, mbarrier index) in the order the producer issues them, which
    is warpgroup 1's wait order: part 3 (blocks 4-7) then part 2 (blocks 0-3 + RoPE), or with ``wg1_other_first``
    part 2 first (WG0 frees it after its pv_remote, before WG1 frees part 3).  Each part keeps its own empty
    barrier and phase, so only the order of the two waits changes (tests/test_seesaw_tmap_protocol.py, wg1of)."""
    parts = ((SEESAW_LOAD_BLOCKS[1][0], 3), (SEESAW_LOAD_BLOCKS[0][1], 2))
    return parts[::-1] if wg1_other_first else parts


class MLADecodePartialWGMMASeesaw(MLADecodePartialWGMMA):
    """Split-KV partial kernel, WGMMA, "seesaw" schedule (both warpgroups compute S).

    Same host interface, work items, partial buffers and combine kernel as
    ``MLADecodePartialWGMMA``; KV in the q dtype (bf16 / fp16) or fp8 e4m3 (below).

    * Tiles of a work item go in pairs (a = 2p, b = 2p + 1 in local order):
      warpgroup 0 owns a (K buffer 0), warpgroup 1 owns b (K buffer 1).  The
      owner computes S = Q K^T for its tile (36 WGMMA 64x64x16), the masked
      online softmax (with the running max the other warpgroup published for
      the previous tile), writes P (16 bit) over the dead RoPE columns
      512..575 of its own K tile and the rescale / new max to sScale / sMax,
      arrives on its named barrier, and adds P V for its 256 output columns
      (RS, P in registers).  The other warpgroup syncs on that barrier,
      rescales its O half and adds sP V for its columns (SS).  So warpgroup 1
      computes QK_b while warpgroup 0 does softmax_a, and warpgroup 1's
      softmax_b runs under the P_a V WGMMAs of both warpgroups.
    * Each output half sees the tiles in order a, b, a+2, ... with
      ``O *= scale_t; O += P_t V_t``: every P is relative to the running max
      after its own tile, as in the one-warpgroup online softmax.  Row sums:
      each warpgroup keeps the sum of its own P's rescaled by every tile's
      scale; the epilogue adds the two.
    * KV loads: cp.async by the warpgroup that frees the columns: WG w loads
      columns [256 w, 256 w + 256) of every tile (only it reads them in P V),
      the non-owner also the RoPE block (it read P there).  Each warpgroup
      loads as soon as its own WGMMAs on that buffer have completed; arrival
      through ``cp.async.mbarrier.arrive.noinc`` (+ a plain arrive after the
      zero-fill stores of rows past kv_len) on one mbarrier per (buffer,
      loading warpgroup).  The owner waits on its own part, issues the 16
      WGMMAs on its V half, then waits on the other part (FlashMLA's
      fine-grained idea at two granules).
    * Smem: sQ 72 KB + 2 x sK 72 KB + sScale / sMax / sL (2 x 64 fp32 each) +
      4 mbarriers = 222,752 B (no separate sP).
    * fp8 e4m3 KV (verified on an H200 in the fifth session: 18 GPU tests; 405 us at B128 H128 S4096):
      the same schedule, tiles, parts and mbarriers, fp16 MMAs (q converted as in
      ``MLADecodePartialWGMMA``), the same 222,752 B: no raw fp8 ring in smem.  A
      warpgroup ld.global's its fp8 part of a tile (4 or 5 64-column blocks, 8 fp8 per
      thread-copy, up to 40 registers) *before* the WGMMA wait that frees those columns,
      then converts it (cvt.rn.f16x2.e4m3x2; rows past kv_len selected to 0 on a
      request's last tile) and st.shared's it into the fp16 K tile, fences (generic ->
      async proxy) and arrives on the part's mbarrier (count 128, plain arrives).  Two
      conversions run under the converting warpgroup's own WGMMAs: WG0 stages its part of
      tile b+2 at the end of a pair and stores it in the next pair after issuing S_{a+2};
      WG1 stores its part of tile a+2 after issuing its P_b V_R.  The other two run in
      the other warpgroup's WGMMA time (seesaw).  See NOTES.md.
    * ``tma=True`` (16-bit KV only; GPU-verified on an H200 in the fifteenth session: 22 GPU tests, bitwise
      equal to the cp.async loads; the backend's loads=auto takes it from 256 packed rows since
      mla-cute-dsl 0.2.12, 0.86-0.89x the cp.async time there, about equal below; with ``balanced=True``
      from 128 rows since 0.2.14, 0.95-1.01x there): the same parts,
      schedule, mbarriers and waits, but each part is 4 or 5 TMA boxes (64 tokens x 64 columns,
      ``cp.async.bulk.tensor`` over one tensor map of the whole cache) issued by one elected
      thread of the loading warpgroup after its ``mbarrier.arrive.expect_tx`` (mbarrier count 1),
      instead of 16-20 cp.async per thread: why: issuing a cp.async part took 750-880 cycles on
      the critical path (H200 clock stamps), a TMA part a few instructions.  TMA does not
      zero-fill page tails, so on a request's last tile each warpgroup zeroes the tail rows of
      its own V half itself before its P V (``zero_v_tail``; the order is in its docstring).  The
      WGMMAs read TMA-written (and fp8-converted) tiles without the generic -> async proxy fence that
      cp.async loads need after each mbarrier wait (mla-cute-dsl 0.2.15, GPU-verified in the nineteenth
      session: 230 GPU tests; 1-3% faster at H=128: the static SASS showed each such fence as
      ``MEMBAR.ALL.CTA``; 3 of the 4 per pair per warpgroup dropped, ``reader_fences``;
      ``reader_fences=True`` keeps them for an A/B).
    * ``balanced=True`` (16-bit KV, cp.async or TMA loads; GPU-verified on an H200 in the seventeenth session:
      45 GPU tests; the backend's default since mla-cute-dsl 0.2.13, seesaw_split): launched with ``call_balanced`` (``api.launch_balanced``'s arguments: the work rows, then
      ``cta_ranges``), grid (m-blocks, schedule.num_cols) fixed per decoder; CTA column c walks work rows
      cta_ranges[c] .. cta_ranges[c + 1] - 1 of a ``make_schedule(..., balanced=True)`` schedule (either form
      of the hybrid plan; slot -1 rows write out / lse, the others their partial slot for the combine).  Shared
      memory and the 4 mbarriers are set up once per CTA; each item runs ``seesaw_item`` (the one-item kernel's
      body: Q, only when the request changes; the prologue loads of its tiles 0 and 1; its pairs, tiles paired
      within the item as always; its epilogue).  The KV pipeline drains at every item boundary: the next item's
      first two tiles are issued only after the previous epilogue's CTA barrier, so each boundary costs one
      unoverlapped tile load (~1 tile time, the prologue of the one-item kernel) plus the epilogue, per item.
      The mbarrier phases continue across items: the CTA counts the phases completed per buffer
      (``seesaw_item_phases``: ceil(T / 2) on buffer 0, floor(T / 2) on buffer 1) and pair p waits with parity
      (ph0 + p) % 2 / (ph1 + p) % 2 (``seesaw_pair_parities``; p % 2 for one item per CTA, generated code
      unchanged).  Host side: ``get_partial_kernel_wgmma_seesaw_balanced`` (cache kind
      ``partial_wgmma_seesaw_balanced``), ``mla_decode_sm90_wgmma_seesaw_balanced``; the backend runs it for
      option seesaw_split=balanced (the default).  fp8 KV (branch fp8-balanced; no spills, no ptxas C7518;
      GPU-verified on an H200 in the twenty-second session, 46 tests; ``backend.FP8_SEESAW_BALANCED``): the
      fp8 seesaw's register-staged loads inside each item.  Nothing crosses an item boundary: a part
      ld.global'ed in pair p is stored in pair p (WG1; WG0's tile a+2) or p + 1 (WG0's tile b+2, only when tile
      b+2 < T, and pair p + 1 then exists), so no register holds fp8 bytes at an item's end; every WGMMA is
      waited before the epilogue's CTA barrier, after which the next item's Q conversion (q_load) and prologue
      stores may write sQ / sK; the L2 prefetch and the page-table reads stay inside the item (tiles < T,
      indices clamped to T - 1); each tile still completes one phase on both mbarriers of its buffer (128
      plain arrives each), so ``seesaw_item_phases`` holds and the fp8 waits take par0 / par1.
    * ``fp8_producer=True`` (fp8 KV only; branch fp8-producer, GPU-verified on an H200 in the twenty-second session:
      43 tests, 0.88-0.90x the inline kernel's time; the backend's fp8_loader=producer, the default): 384 threads, a third warpgroup does every fp8 part's ld.global (128-bit, 16 fp8 per thread-copy)
      -> cvt -> st.shared -> fence -> arrive on the part's "full" mbarrier, after waiting on its "empty" mbarrier,
      which the math warpgroup that reads those columns last arrives on where the 16-bit kernel issues its load of
      tile +2; the math warpgroups run the 16-bit kernel's instruction stream (``kernel_fp8p``; setmaxnreg 216 math
      / 72 producer, the CTA's whole pool; NOTES.md "fp8 seesaw with a producer warpgroup").  With ``balanced=True``
      (branch fp8-balanced-producer, GPU-verified, 44 tests; backend.FP8_BALANCED_PRODUCER, on): ``kernel_fp8p_balanced``,
      both sides walking the column's items with the full / empty phases continued across items (the math side
      releases every tile's parts, the producer's g-th tile of a buffer waits empty phase g - 1), Q reloaded by the
      math warpgroups on a request change after the previous epilogue's BAR_MATH; NOTES.md "Balanced fp8 seesaw
      with the producer warpgroup".
    * ``q_prefetch=True`` (balanced, 16-bit KV, cp.async or TMA KV loads; branch q-prefetch; on the H200 since the
      twenty-third session): each item issues the next row's Q and KV tiles 0 / 1 during its own last pairs, so the next item does
      not start by waiting for them (``seesaw_column_qpf``; Q by TMA on a fifth mbarrier, issued by warp 4 right after
      warpgroup 1's pv_remote of the last pair, when both warpgroups' last S are known to be done; the tiles at the
      slots of tiles a+2 / b+2 that the item does not have; tests/test_seesaw_qpf_protocol.py models it).
    * ``wg1_other_first=True`` (16-bit KV, cp.async or TMA loads, one item per CTA or balanced, with or without
      q_prefetch; branch qk-order; GPU-verified on an H200 in the twenty-fourth session, 19 tests; the backend's
      option wg1_other_first, on by default from 256 packed rows since 0.2.21): warpgroup 1's QK of its own tile b waits on
      warpgroup 0's part (mbar + 2: columns 0..255 and the RoPE block) first and issues those 20 k-blocks, then waits
      on its own part (mbar + 3: columns 256..511) and issues the other 16 (``qk_wait_order``; everything else the
      same).  Why: an ncu profile of the balanced TMA seesaw (H=128 B=128 S=4096) had WG1's wait for its own part of
      tile b+2 at the head of each pair as the largest single stall (11.8% of the samples): WG1 issues that part only
      after its P_b V_R WGMMAs complete at the very end of the pair, while WG0 issues its part of tile b+2 after its
      pv_remote (P_b V_L), earlier.  Both waits still precede every later use of the tile (same parities; WG1's
      ``zero_v_tail`` wait on mbar + 3 stays a second wait on a completed phase); tests/test_seesaw_protocol.py
      models the order (``wg1of``).  fp8 caches refuse it (inline, or the one-part producer) except with the ring
      producer (``fp8_producer`` and ``fp8p_ring``; branch fp8-wg1of; H200, twenty-sixth session: 45 GPU tests, a
      hang probe, 0.986-0.998x the ring's time; the backend's default with the ring since 0.2.21): the math
      side is the same (``seesaw_item``'s WG1 qk goes through ``qk_wait_order``) and the ring's schedule converts
      tile b's part 2 (full[2]) before part 3 (full[3]) (``fp8p_ring.pair_parts``), each part on its own empty /
      full barriers and parities (tests/test_seesaw_fp8p_ring_protocol.py, wg1of).
    * ``fp8p_ring=R`` (with fp8_producer, one item or balanced; branch fp8p-inflight, compile-only): the producer
      keeps a ring of R register slots of one 16-fp8 chunk (one 32-row pass of one 64-column block) and issues each
      chunk's ld.global R - 1 chunks ahead of its conversion, across part, tile and pair boundaries, instead of
      loading one part, waiting for it and converting it (``fp8p_producer_ring``, schedule ``fp8p_ring.py``); the
      full / empty protocol is unchanged.  setmaxnreg split per size ``fp8p_ring.RING_REGS`` (208 / 88).
      ``fp8p_stage=4`` (with a ring): every third chunk goes global -> shared memory by cp.async (4 x 2 KB staging
      after the mbarriers, within the 227 KB) and is read back by the same thread before its conversion, so 9 chunks
      are in flight instead of 6 at no register cost (smem 230,976 B).
    * ``tma_producer=True`` (16-bit KV with tma=True and balanced=True, not with q_prefetch or the fp8 options; branch
      tma-producer; GPU-verified on an H200 in the twenty-fourth session, 19 tests and a hang probe; the backend's
      default since mla-cute-dsl 0.2.19): ``kernel_tmap_balanced``, 384 threads.  The math warpgroups run
      fp8_producer's balanced stream (``seesaw_column_tmap``: no KV load, page-table read or L2 prefetch of their own,
      every tile's parts released on the empty mbarriers, ``zero_v_tail`` kept), and instead of loading Q they wait a Q
      "full" mbarrier; each math thread arrives on a Q "empty" mbarrier (count 256) once its own last S of the last item
      of a request is waited.  One warp of warpgroup 2 (``tmap_producer``) walks the column's items ahead of them and
      issues every KV part (full / empty phases continued across items as fp8p) and every Q (after the Q-empty phase)
      by TMA, so the next item's Q and tiles 0 / 1 are in flight while the current item finishes (the balanced TMA
      kernel issues them after the epilogue's barrier).  setmaxnreg 232 / 40; smem 222,800 B (10 mbarriers);
      tests/test_seesaw_tmap_protocol.py models it; NOTES.md "Balanced 16-bit seesaw with a TMA producer warpgroup".
      With ``wg1_other_first`` (branch tmap-wg1of; H200, twenty-fifth session: 11 GPU tests, 0.965x at H=128 s_q=2,
      1.01-1.03x at s_q=1; the backend's default from 256 packed rows since 0.2.21): warpgroup 1 waits full[2] before full[3] for its tile
      (``qk_wait_order``) and the producer issues tile b's part 2 before part 3 (``tmap_tile_b_parts``).
    """

    def __init__(self, q_dtype, kv_dtype, block_m: int = BLOCK_M, l2_prefetch: bool = False,
                 wide_store: bool = False, tma: bool = False, balanced: bool = False,
                 reader_fences: bool = False, lazy_rescale: bool = False, fp8_producer: bool = False,
                 q_prefetch: bool = False, fp8p_ring: int = 0, fp8p_stage: int = 0, wg1_other_first: bool = False,
                 tma_producer: bool = False):
        super().__init__(q_dtype, kv_dtype, block_m, wide_store=wide_store)
        # wg1_other_first (16-bit KV; branch qk-order, GPU-verified): WG1's QK of its own tile waits WG0's part first
        # (qk_wait_order); the fp8 kernels convert their parts in another order: refused, except the ring producer
        # (branch fp8-wg1of, GPU-verified), whose schedule then converts tile b's part 2 before part 3
        # (fp8p_ring.pair_parts); the inline fp8 kernel and the one-part producer keep refusing it
        self.wg1_other_first = bool(wg1_other_first)
        if self.wg1_other_first and self.is_fp8 and not (fp8_producer and fp8p_ring):
            raise ValueError("seesaw kernel: wg1_other_first=True needs a 16-bit KV cache (bf16 / fp16) or, with "
                             f"fp8 e4m3, fp8_producer=True and fp8p_ring; got {kv_dtype}, fp8_producer={fp8_producer}, "
                             f"fp8p_ring={fp8p_ring}")
        # tma_producer (16-bit KV, tma=True, balanced=True; branch tma-producer, GPU-verified): warpgroup 2 issues every
        # KV part and Q by TMA on full / empty mbarriers, walking the column's items ahead of the math warpgroups
        # (kernel_tmap_balanced); the math warpgroups run fp8_producer's balanced instruction stream
        self.tma_producer = bool(tma_producer)
        if self.tma_producer:
            if self.is_fp8 or not (tma and balanced):
                raise ValueError("seesaw kernel: tma_producer=True needs a 16-bit KV cache (bf16 / fp16), tma=True and "
                                 f"balanced=True, got kv {kv_dtype}, tma={tma}, balanced={balanced}")
            if q_prefetch or fp8_producer or fp8p_ring or fp8p_stage:
                raise ValueError("seesaw kernel: tma_producer=True excludes q_prefetch and the fp8 producer options "
                                 "(fp8_producer, fp8p_ring, fp8p_stage)")
            # with wg1_other_first: WG1 waits full[2] before full[3] for its tile (qk_wait_order) and the producer
            # issues tile b's part 2 before part 3 (tmap_tile_b_parts); every empty barrier keeps its own phase
            # sequence (tests/test_seesaw_tmap_protocol.py, wg1of)
        # q_prefetch (balanced, 16-bit KV; branch q-prefetch, compile-only): the next work item's Q (TMA, a fifth
        # mbarrier) and its KV tiles 0 / 1 are issued during the current item's last pairs (seesaw_column_qpf)
        self.q_prefetch = bool(q_prefetch)
        if self.q_prefetch and not (balanced and not self.is_fp8):
            raise ValueError("seesaw kernel: q_prefetch=True needs balanced=True and a 16-bit KV cache (bf16 / fp16)")
        # fp8_producer (fp8 KV only; the backend's default): a third warpgroup does every fp8 part's ld.global -> cvt -> st.shared
        # on full / empty mbarriers (kernel_fp8p); the math warpgroups run the 16-bit kernel's instruction stream
        self.fp8_producer = bool(fp8_producer)
        if self.fp8_producer and not self.is_fp8:
            raise ValueError(f"seesaw kernel: fp8_producer=True needs an fp8 e4m3 KV cache, got {kv_dtype}")
        # fp8p_ring (fp8_producer only; 0: the one-part producer): the producer keeps fp8p_ring register slots of one
        # 16-fp8 chunk each and issues every chunk's ld.global fp8p_ring - 1 chunks before converting it, across part,
        # tile and pair boundaries (fp8p_producer_ring, schedule in fp8p_ring.py); the setmaxnreg split per ring size
        # is fp8p_ring.RING_REGS (208 / 88)
        self.fp8p_ring = int(fp8p_ring)
        if self.fp8p_ring and not self.fp8_producer:
            raise ValueError(f"seesaw kernel: fp8p_ring={fp8p_ring} needs fp8_producer=True")
        if self.fp8p_ring and self.fp8p_ring not in _ring.RING_REGS:
            raise ValueError(f"seesaw kernel: fp8p_ring must be one of {tuple(sorted(_ring.RING_REGS))}, got {fp8p_ring}")
        self.fp8p_regs = _ring.RING_REGS[self.fp8p_ring] if self.fp8p_ring else (FP8P_MATH_REGS, FP8P_PRODUCER_REGS)
        # fp8p_stage (with fp8p_ring; 0 or fp8p_ring.STAGE_SLOTS): every third chunk goes global -> shared memory
        # (cp.async into 4 x 2 KB of staging after the mbarriers: the 9.5 KB the kernel leaves free) instead of into a
        # register slot, so more chunks are in flight at no register cost (fp8p_ring.lookahead: 9 instead of 6)
        self.fp8p_stage = int(fp8p_stage)
        if self.fp8p_stage and not self.fp8p_ring:
            raise ValueError(f"seesaw kernel: fp8p_stage={fp8p_stage} needs fp8p_ring")
        if self.fp8p_stage not in (0, _ring.STAGE_SLOTS):
            raise ValueError(f"seesaw kernel: fp8p_stage must be 0 or {_ring.STAGE_SLOTS}, got {fp8p_stage}")
        assert fp8p_register_split_fits(*self.fp8p_regs), self.fp8p_regs
        # fp8_producer with balanced=True (branch fp8-balanced-producer, GPU-verified in the twenty-second
        # session): both sides walk the column's items; the full and empty mbarriers count one phase per tile of their
        # buffer across items (the math side releases every tile's parts, not only tiles < T - 2), so the producer
        # runs into the next item's tiles 0 / 1 as soon as the previous item's last readers released them
        # lazy_rescale: a row keeps its reference max until a tile's max exceeds it by more than LAZY_RESCALE_LOG2
        # (exp2 units); only then are O and the row sum rescaled (corr != 1). Both warpgroups skip the 128
        # multiplies per thread of their O half for a tile whose rows all kept their reference, which sit on the
        # seesaw's critical path (the owner's before it publishes P at buffer 0, the other warpgroup's between
        # the P barrier and its P V issue). P stays <= 2^LAZY_RESCALE_LOG2 (exact range in bf16 and fp16), the
        # row sum and lse use the same reference: the same result up to rounding
        self.lazy_rescale = bool(lazy_rescale)
        if tma and self.is_fp8:
            raise ValueError("seesaw kernel: tma=True needs a 16-bit KV cache (bf16 / fp16); the fp8 "
                             "cache keeps its ld.global -> cvt -> st.shared loads")
        # balanced with an fp8 cache (branch fp8-balanced, GPU-verified in the twenty-second session): the
        # register-staged fp8 parts never cross an item boundary (a part ld.global'ed in pair p is stored in pair
        # p or p + 1 of the same item: only for a tile < T), see the class docstring and
        # tests/test_seesaw_balanced_protocol.py (the fp8 model)
        # balanced split-KV (schedule.make_schedule(..., balanced=True)): launched through call_balanced, grid
        # (m-blocks, num_cols), each CTA walking its column's work items (kernel_seesaw, seesaw_item)
        self.balanced = bool(balanced)
        # tma: KV parts by TMA boxes from one elected thread per warpgroup (16-bit KV; see above)
        self.tma = bool(tma)
        # the generic -> async proxy fence (fence.proxy.async.shared::cta, SASS MEMBAR.ALL.CTA + FENCE.VIEW.ASYNC.S)
        # after each KV mbarrier wait (qk) and after the P barrier (pv_remote), on the reading side: needed only
        # after cp.async KV loads with a 16-bit cache (generic-proxy writes that land with no thread left to fence
        # them). TMA boxes land in the async proxy; the fp8 loads (st.shared) and the owner's P each fence on the
        # writing side before their arrive. So only the 16-bit cp.async kernel runs them (the MEMBAR also waits for
        # the loads in flight: the page-table loads of each pair, and with fp8 the next tiles' ld.global into
        # registers). reader_fences=True keeps them everywhere (0.2.14's kernels, the A/B arm)
        self.reader_fences = bool(reader_fences) or not (self.tma or self.is_fp8)
        # l2_prefetch: thread 0 issues one cp.async.bulk.prefetch.L2 per tile of the next pair
        # before this pair's loads (the getter's default: seesaw_l2_prefetch_default)
        self.l2_prefetch = bool(l2_prefetch)
        # fp8 e4m3 KV (branch wgmma-fp8-seesaw): two fp16 K tiles as for 16-bit KV, no raw
        # fp8 ring in smem: each warpgroup ld.global's its fp8 part of a tile into registers,
        # converts it and st.shared's it into the fp16 K tile (see the class docstring)
        self.k_bufs = STAGES
        self.raw_stages = 0

    def smem_bytes(self) -> int:
        """sQ + 2 sK (P lives in each K tile's RoPE columns) + sScale, sMax, sL (2 x 64 fp32) + 4 mbarriers."""
        e = self.mma_dtype.width // 8
        parts = [
            (BLOCK_M * D_QK * e, 1024),  # sQ
            (STAGES * BLOCK_N * D_QK * e, 1024),  # sK (V = first 512 columns, P = last 64)
            (2 * BLOCK_M * 4, 16),  # sScale (row, buffer)
            (2 * BLOCK_M * 4, 16),  # sMax (row, buffer)
            (2 * BLOCK_M * 4, 16),  # sL (row, warpgroup): row sums for the epilogue
            # mbarriers (buffer, loading warpgroup); fp8_producer: + 4 "empty"; fp8p_stage: + the staging slots
            (self._mbar_words() * 8, 16 if self._stage_words() else 8),
        ]
        off = 0
        for size, align in parts:
            off = -(-off // align) * align + size
        return off

    def _num_mbars(self) -> int:
        """4 mbarriers (buffer, part): "full"; fp8_producer adds 4 "empty" ones (the same parts, freed by the
        math warpgroup that reads them last); tma_producer those 8 and Q's full / empty pair."""
        if getattr(self, "tma_producer", False):
            return 10
        if getattr(self, "q_prefetch", False):
            return 5  # q_prefetch: + the Q mbarrier (TMA, index 4)
        return 8 if getattr(self, "fp8_producer", False) else 4

    def _stage_words(self) -> int:
        """fp8p_stage: the producer's shared-memory staging slots, in 8-byte words appended to the mbarrier array
        (the struct's last field: its start is 16-byte aligned with them, as cp.async's 16-byte copies need)."""
        return getattr(self, "fp8p_stage", 0) * _ring.STAGE_SLOT_BYTES // 8

    def _mbar_words(self) -> int:
        """Length of the struct's mbarrier field in 8-byte words: the mbarriers, then any staging slots."""
        return self._num_mbars() + self._stage_words()

    def _mbar_count(self) -> int:
        """Arrivals that complete one phase of a part's mbarrier: the cp.async path (16-bit KV)
        128 noinc + 128 plain arrives, fp8 KV 128 plain arrives, TMA one arrive.expect_tx (the
        bytes complete the phase)."""
        if self.tma:
            return 1
        return WG_THREADS if self.is_fp8 else 2 * WG_THREADS

    def _kv_tma(self, mKV: cute.Tensor, box_layout: cute.ComposedLayout):
        """tma=True: the TMA atom and coordinate tensor of the KV cache (host side, at launch).

        mKV (pages, page_size, 576) is viewed as (page_size, 576, pages) with its own strides (no
        assumption on the page stride), and tiled by (64 tokens, 64 columns) boxes whose smem
        layout ``box_layout`` is one 64-column block of sK (SW128 K-major, 8 KB, 1024-aligned in
        sK): the swizzle the WGMMAs read.  A box never crosses a page (page_size % 64 == 0), so
        no box reads past the tensor."""
        kv = cute.make_tensor(mKV.iterator, cute.select(mKV.layout, mode=[1, 2, 0]))
        return cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), kv, box_layout,
                                           (BLOCK_N, KV_BOX))

    def _q_tma(self, mQ: cute.Tensor, box_layout: cute.ComposedLayout):
        """q_prefetch: the TMA atom and coordinate tensor of q (host side, at launch), as ``_kv_tma``: mQ (B, R, 576)
        viewed as (R, 576, B), boxes of 64 rows x 64 columns whose smem layout is one 64-column block of sQ (sQ is
        one sK stage's layout).  Rows past R (the last m-block of a request when R % 64 != 0) are outside the tensor:
        the TMA unit writes them as zeros, which is what ``load_q`` does for them, and still counts their bytes."""
        q = cute.make_tensor(mQ.iterator, cute.select(mQ.layout, mode=[1, 2, 0]))
        return cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), q, box_layout, (BLOCK_M, KV_BOX))

    def _wg_copy(self):
        """gmem -> smem cp.async for one warpgroup: 16 B per copy, 8 threads per 64-column block,
        16 rows per pass: a (64, 576) tile partitions as (CPY, 4, 9), mode 2 = 64-column block."""
        return cute.make_tiled_copy_tv(
            cute.make_copy_atom(
                cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), self.mma_dtype,
                num_bits_per_copy=128,
            ),
            cute.make_layout((WG_THREADS // 8, 8), stride=(8, 1)),
            cute.make_layout((1, 8)),
        )

    def _wg_fp8_copies(self):
        """fp8 KV, one warpgroup (128 threads), the thread-value layout of ``_wg_copy``:
        8 threads per 64-column block, 16 rows per pass, 8 elements per thread-copy, so a
        (64, 576) tile partitions as (CPY, 4, 9) with the same (row, col) per position in
        both copies (checked in the CPU test).

        g2r: gmem fp8 -> registers, 8 fp8 (64 bit) per ld.global.
        r2s: registers -> sK (fp16, SW128 through the pointer swizzle), 8 x 16 bit (128 bit)
             per st.shared: one 16-byte swizzle unit, never split by the swizzle.
        """
        thr = cute.make_layout((WG_THREADS // 8, 8), stride=(8, 1))
        g2r = cute.make_tiled_copy_tv(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), cutlass.Float8E4M3FN, num_bits_per_copy=64),
            thr, cute.make_layout((1, 8)),
        )
        r2s = cute.make_tiled_copy_tv(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.mma_dtype, num_bits_per_copy=128),
            thr, cute.make_layout((1, 8)),
        )
        return g2r, r2s

    def _fp8p_copies(self):
        """fp8_producer: the producer's (g2r, r2s) with FP8P_ELEMS_PER_COPY elements per thread-copy (16: one
        128-bit ld.global of fp8 and two 128-bit st.shared of fp16, each one 16-byte swizzle unit; 8:
        ``_wg_fp8_copies``).  Both share one thread-value layout, so element (v, m, k) of a thread's partitions is
        the same (row, col) in both (and in the identity tensor partitioned by g2r)."""
        e = FP8P_ELEMS_PER_COPY
        if e == 8:
            return self._wg_fp8_copies()
        thr = cute.make_layout((WG_THREADS // (64 // e), 64 // e), stride=(64 // e, 1))
        g2r = cute.make_tiled_copy_tv(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), cutlass.Float8E4M3FN, num_bits_per_copy=8 * e),
            thr, cute.make_layout((1, e)),
        )
        r2s = cute.make_tiled_copy_tv(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.mma_dtype, num_bits_per_copy=128),
            thr, cute.make_layout((1, e)),
        )
        return g2r, r2s

    @cute.jit
    def ldg_part_fp8(
        self, g2r: cute.TiledCopy, thr_g2r, mKV: cute.Tensor, page: cutlass.Int32,
        n: cutlass.Int32, blocks: cutlass.Constexpr, blocks_per_page: cutlass.Int32,
        kv_len: cutlass.Int32, tKcK: cute.Tensor, rRaw: cute.Tensor,
    ):
        """fp8 KV: this warpgroup's 64-column blocks ``blocks`` of KV block n (cache page
        ``page``) -> registers rRaw[:, m, i] (ld.global, 8 fp8 per thread-copy).  Rows >=
        kv_len are not loaded (their registers are don't-care: ``store_part_fp8`` selects 0
        for them).  Touches no shared memory: may run while WGMMAs still read the buffer."""
        gK = cute.local_tile(mKV[page, None, None], (BLOCK_N, D_QK), (n % blocks_per_page, 0))
        tKgK = thr_g2r.partition_S(gK)  # (CPY, 4, 9)
        valid = kv_len - n * BLOCK_N
        for m in cutlass.range_constexpr(cute.size(tKgK.shape[1])):
            if tKcK[0, m, 0][0] < valid:
                for i in cutlass.range_constexpr(len(blocks)):
                    cute.copy(g2r, tKgK[None, m, blocks[i]], rRaw[None, m, i])

    @cute.jit
    def store_part_fp8(
        self, r2s: cute.TiledCopy, n: cutlass.Int32, stage: cutlass.Constexpr,
        blocks: cutlass.Constexpr, kv_len: cutlass.Int32, tKcK: cute.Tensor,
        tKsK: cute.Tensor, rRaw: cute.Tensor, mbar_ptr,
    ):
        """fp8 KV: registers rRaw (from ``ldg_part_fp8``) -> fp16 -> sK[:, :, stage] blocks
        ``blocks`` (4 x cvt.rn.f16x2.e4m3x2 and one 128-bit st.shared per 8 elements; rows >=
        kv_len selected to 0, not multiplied: page tails may hold e4m3 NaN), then this
        thread's async-proxy fence (generic st.shared -> WGMMA) and one arrive on mbar_ptr
        (count 128: the part is complete once every thread of the warpgroup arrived)."""
        mt = self.mma_dtype
        valid = kv_len - n * BLOCK_N
        if valid >= BLOCK_N:  # CTA-uniform: only a request's last tile has rows to zero
            for m in cutlass.range_constexpr(cute.size(tKsK.shape[1])):
                for i in cutlass.range_constexpr(len(blocks)):
                    rH = cute.make_rmem_tensor_like(tKsK[None, m, blocks[i], stage], mt)
                    rH.store(rRaw[None, m, i].load().to(mt))
                    cute.copy(r2s, rH, tKsK[None, m, blocks[i], stage])
        else:
            for m in cutlass.range_constexpr(cute.size(tKsK.shape[1])):
                for i in cutlass.range_constexpr(len(blocks)):
                    rH = cute.make_rmem_tensor_like(tKsK[None, m, blocks[i], stage], mt)
                    rH.store(rRaw[None, m, i].load().to(mt))
                    if tKcK[0, m, 0][0] >= valid:
                        rH.fill(0)
                    cute.copy(r2s, rH, tKsK[None, m, blocks[i], stage])
        cute.arch.fence_view_async_shared()
        cute.arch.mbarrier_arrive(mbar_ptr)

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor, mKV: cute.Tensor, mPT: cute.Tensor, mLens: cute.Tensor,
        mO: cute.Tensor, mLSE: cute.Tensor, mWork: cute.Tensor, mOp: cute.Tensor,
        mLSEp: cute.Tensor,
        scale_log2: cutlass.Float32, scale_ln: cutlass.Float32, v_scale: cutlass.Float32,
        s_q: cutlass.Int32, num_heads: cutlass.Int32,
        stream,
    ):
        assert not self.balanced, "MLADecodePartialWGMMASeesaw(balanced=True) is launched with call_balanced"
        # one work item per CTA: grid (m-blocks, work rows)
        self._launch(mQ, mKV, mPT, mLens, mO, mLSE, mWork, mOp, mLSEp, scale_log2, scale_ln, v_scale, s_q,
                     num_heads, None, cute.size(mWork.shape[0]), stream)

    @cute.jit
    def call_balanced(
        self,
        mQ: cute.Tensor,  # (B, R, 576) q dtype, R = s_q * H
        mKV: cute.Tensor,  # (P, page, 576) kv dtype (16 bit)
        mPT: cute.Tensor,  # (B, max_pages) int32
        mLens: cute.Tensor,  # (B,) int32
        mO: cute.Tensor,  # (B, R, 512) q dtype
        mLSE: cute.Tensor,  # (B, R) fp32
        mWork: cute.Tensor,  # (capacity, 4) int32: b, kv_start, kv_end, slot (column by column)
        mRanges: cute.Tensor,  # (num_cols + 1,) int32: column c runs work rows [mRanges[c], mRanges[c+1])
        mOp: cute.Tensor,  # (slots, R, 512) fp32, bf16 or fp16 (alloc_workspace partial_dtype)
        mLSEp: cute.Tensor,  # (slots, R) fp32
        scale_log2: cutlass.Float32, scale_ln: cutlass.Float32, v_scale: cutlass.Float32,
        s_q: cutlass.Int32, num_heads: cutlass.Int32,
        stream,
    ):
        """Balanced launch (api.launch_balanced's arguments, as the mma.sync and wgmma_t balanced kernels): grid
        (m-blocks, num_cols), fixed for a decoder (the ranges' length), so a CUDA graph replays it with any later
        schedule in the same buffers, whichever form the hybrid plan chose."""
        assert self.balanced, "call_balanced needs MLADecodePartialWGMMASeesaw(balanced=True)"
        self._launch(mQ, mKV, mPT, mLens, mO, mLSE, mWork, mOp, mLSEp, scale_log2, scale_ln, v_scale, s_q,
                     num_heads, mRanges, cute.size(mRanges.shape[0]) - 1, stream)

    def _launch(self, mQ, mKV, mPT, mLens, mO, mLSE, mWork, mOp, mLSEp, scale_log2, scale_ln, v_scale, s_q,
                num_heads, mRanges, cols, stream):
        """Both launches' host side (plain Python, traced inline from ``__call__`` / ``call_balanced``): the smem
        layouts and struct, the tiled MMAs and copies, the TMA atom with tma=True, then ``kernel_seesaw`` on grid
        (m-blocks, cols): one work row per CTA column (``mRanges`` None: no kernel parameter, so the one-item
        kernel's PTX is unchanged), or a column's rows ``mRanges[c] .. mRanges[c + 1] - 1`` (balanced)."""
        mt = self.mma_dtype
        sQ_layout, sK_layout, sP_layout, sV_layout = self._smem_layouts()
        mma_s, mma_o_rs, mma_o_ss = self._tiled_mmas()
        mma_s_first, _, _ = self._tiled_mmas()

        # the struct's fields as objects: this module's annotations are strings (PEP 563), which only the jit
        # functions' own tracing resolves
        Align, MemRange = cute.struct.Align, cute.struct.MemRange
        SharedStorage = cute.struct(type("SharedStorage", (), {"__annotations__": {
            "sQ": Align[MemRange[mt, cute.cosize(sQ_layout)], 1024],
            "sK": Align[MemRange[mt, cute.cosize(sK_layout)], 1024],
            "sScale": Align[MemRange[cutlass.Float32, 2 * BLOCK_M], 16],
            "sMax": Align[MemRange[cutlass.Float32, 2 * BLOCK_M], 16],
            "sL": Align[MemRange[cutlass.Float32, 2 * BLOCK_M], 16],
            "mbar": Align[MemRange[cutlass.Int64, self._mbar_words()], 16 if self._stage_words() else 8],
        }}))

        g2s = cute.make_tiled_copy_tv(
            cute.make_copy_atom(
                cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), mt, num_bits_per_copy=128
            ),
            cute.make_layout((NUM_THREADS // 8, 8), stride=(8, 1)),
            cute.make_layout((1, 8)),
        )
        g2s_wg = self._wg_copy()
        r2s_P = cute.make_tiled_copy_C(cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), mt), mma_s)
        # tma=True: the KV tensor map, built here from the runtime tensor (a kernel parameter);
        # None otherwise (no kernel parameter: the default kernel's PTX is unchanged).  The box's
        # smem layout is sP's: (64, 64) SW128 K-major, exactly one 64-column block of sK
        tma_atom, mKV_tma = None, None
        if cutlass.const_expr(self.tma):
            tma_atom, mKV_tma = self._kv_tma(mKV, sP_layout)
        # q_prefetch: the tensor map of q for its TMA loads (None otherwise: no parameter)
        q_tma_atom, mQ_tma = None, None
        if cutlass.const_expr(self.q_prefetch or self.tma_producer):
            q_tma_atom, mQ_tma = self._q_tma(mQ, sP_layout)
        grid = (cute.ceil_div(cute.size(mQ.shape[1]), BLOCK_M), cols, 1)
        self.kernel_seesaw(
            mQ, mKV, mPT, mLens, mO, mLSE, mWork, mOp, mLSEp,
            scale_log2, scale_ln, v_scale, s_q, num_heads,
            sQ_layout, sK_layout, sP_layout, sV_layout,
            g2s, g2s_wg, r2s_P,
            mma_s, mma_s_first, mma_o_rs, mma_o_ss, SharedStorage, tma_atom, mKV_tma, mRanges, q_tma_atom, mQ_tma,
        ).launch(grid=grid, block=[FP8P_THREADS if self.fp8_producer or self.tma_producer else NUM_THREADS, 1, 1],
                  stream=stream, **({"min_blocks_per_mp": 1} if self.fp8_producer or self.tma_producer else {}))

    # ---------------------------------------------------------------- device side
    @cute.jit
    def load_part(
        self, g2s_wg: cute.TiledCopy, thr_g2s_wg, mKV: cute.Tensor, page: cutlass.Int32,
        n: cutlass.Int32, stage: cutlass.Constexpr, blocks: cutlass.Constexpr,
        blocks_per_page: cutlass.Int32, kv_len: cutlass.Int32,
        tKcK: cute.Tensor, tKsK: cute.Tensor, mbar_ptr,
    ):
        """This warpgroup's 64-column blocks ``blocks`` of KV block n (in cache page ``page``, read
        from the page table ahead of time) -> sK[:, :, stage] (cp.async, rows >= kv_len
        zero-filled), then arrive on ``mbar_ptr``: once when the cp.asyncs land (noinc) and once
        now (release: orders the zero-fill stores)."""
        gK = cute.local_tile(mKV[page, None, None], (BLOCK_N, D_QK), (n % blocks_per_page, 0))
        tKgK = thr_g2s_wg.partition_S(gK)  # (CPY, 4, 9)
        valid = kv_len - n * BLOCK_N
        for m in cutlass.range_constexpr(cute.size(tKsK.shape[1])):
            if tKcK[0, m, 0][0] < valid:
                for c in cutlass.range_constexpr(len(blocks)):
                    cute.copy(g2s_wg, tKgK[None, m, blocks[c]], tKsK[None, m, blocks[c], stage])
            else:
                for c in cutlass.range_constexpr(len(blocks)):
                    tKsK[None, m, blocks[c], stage].fill(0)
        cute.arch.fence_view_async_shared()
        cute.arch.cp_async_mbarrier_arrive_noinc(mbar_ptr)
        cute.arch.mbarrier_arrive(mbar_ptr)

    @cute.jit
    def load_part_tma(
        self, tma_atom: cute.CopyAtom, tKgT: cute.Tensor, tKsT: cute.Tensor, page: cutlass.Int32,
        n: cutlass.Int32, stage: cutlass.Constexpr, blocks: cutlass.Constexpr,
        blocks_per_page: cutlass.Int32, mbar_ptr, tma_warp,
    ):
        """tma=True: ``load_part``'s blocks by TMA, issued by the loading warpgroup's first warp
        (``tma_warp``; the TMA copy elects its one issuing lane): one lane arms ``mbar_ptr``
        (count 1) with the part's bytes, then one 64 x 64 box per block (KV block n of request
        b = rows (n % blocks_per_page) * 64 .. + 64 of cache page ``page``).  Every row is
        loaded: a request's last tile is cleaned by ``zero_v_tail``, not here."""
        if tma_warp:
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive_and_expect_tx(
                    mbar_ptr, len(blocks) * BLOCK_N * KV_BOX * (self.mma_dtype.width // 8))
            for c in cutlass.range_constexpr(len(blocks)):
                cute.copy(tma_atom, tKgT[None, n % blocks_per_page, blocks[c], page],
                          tKsT[None, 0, blocks[c], stage], tma_bar_ptr=mbar_ptr)

    def load_kv_part(self, src: tuple, page, n, stage: int, blocks: tuple, blocks_per_page, kv_len,
                     mbar_ptr):
        """One part of a 16-bit K tile (a plain Python dispatcher, traced inline): ``src`` is
        (g2s_wg, thr_g2s_wg, mKV, tKcK, tKsK) for cp.async (``load_part``) or (tma_atom, tKgT,
        tKsT, tma_warp) with tma=True (``load_part_tma``), so the six call sites read the same."""
        if self.tma:
            tma_atom, tKgT, tKsT, tma_warp = src
            self.load_part_tma(tma_atom, tKgT, tKsT, page, n, stage, blocks, blocks_per_page, mbar_ptr,
                               tma_warp)
        else:
            g2s_wg, thr_g2s_wg, mKV, tKcK, tKsK = src
            self.load_part(g2s_wg, thr_g2s_wg, mKV, page, n, stage, blocks, blocks_per_page, kv_len,
                           tKcK, tKsK, mbar_ptr)

    @cute.jit
    def refill_part(
        self, src, page, n_start: cutlass.Int32, ta: cutlass.Int32, ahead: cutlass.Constexpr, T: cutlass.Int32,
        stage: cutlass.Constexpr, blocks: cutlass.Constexpr, blocks_per_page, kv_len, bars, part: cutlass.Constexpr,
        every_tile: cutlass.Constexpr,
    ):
        """Part ``part`` (2 * buffer ``stage`` + its loading warpgroup) is free: this warpgroup, its last reader,
        has waited for its WGMMAs on those columns.  Hand it to local tile ta + ``ahead``, the buffer's next tile.
        16-bit KV (``seesaw_item``'s loads): ``load_kv_part`` of that tile from ``src`` / ``page`` on the part's
        mbarrier ``bars + part``, if the tile exists.  fp8_producer: ``bars`` are the empty mbarriers: arrive on
        the part's (the producer converts the tile in), under the same condition so that the one-item kernel's
        code stays the 16-bit stream with loads turned into arrives, or for every tile with ``every_tile``
        (balanced: the empty barriers then count one phase per tile, like the full ones, and the producer may
        write the next item's tiles 0 / 1 once their last readers in this item arrived)."""
        if cutlass.const_expr(self.fp8_producer or self.tma_producer):
            if cutlass.const_expr(every_tile):
                cute.arch.mbarrier_arrive(bars + part)
            else:
                if ta + ahead < T:
                    cute.arch.mbarrier_arrive(bars + part)
        else:
            if ta + ahead < T:
                self.load_kv_part(src, page, n_start + ta + ahead, stage, blocks, blocks_per_page, kv_len,
                                  bars + part)

    @cute.jit
    def item_barrier(self):
        """The barrier of every thread that runs ``seesaw_item``: the CTA's (bar 0), or with fp8_producer the 256
        math threads' own (BAR_MATH): the producer warpgroup runs its own loop and never joins it (tma_producer
        likewise)."""
        if cutlass.const_expr(self.fp8_producer or self.tma_producer):
            cute.arch.barrier(barrier_id=BAR_MATH, number_of_threads=NUM_THREADS)
        else:
            cute.arch.barrier()

    @cute.jit
    def zero_v_tail(
        self, tKcK: cute.Tensor, tKsK: cute.Tensor, n: cutlass.Int32, stage: cutlass.Constexpr,
        wg: cutlass.Constexpr, kv_len: cutlass.Int32, mbar_ptr, parity: cutlass.Int32,
    ):
        """tma=True: on a request's last tile (KV block n, ``kv_len - 64 n < 64``; CTA-uniform, so
        no other tile pays anything but the compare), zero rows >= kv_len of warpgroup ``wg``'s V
        half (columns 256 wg .. +256, the only ones it reads in P V) in sK[:, :, stage].  Why:
        TMA copies page tails as they are, they may hold NaN, and 0 * NaN = NaN in P V.

        Order, per warpgroup and tile (the caller places it so):
        1. the part holding these columns has landed: wait on its mbarrier (``mbar_ptr``, the
           loading warpgroup is ``wg`` itself: SEESAW_LOAD_BLOCKS; a second waiter of the same
           phase: the next phase is armed by this warpgroup only after its P V on this buffer);
        2. S of this tile is complete (owner: its own QK waited; non-owner: called after the
           owner's "P ready" barrier, which the owner arrives on after its QK wait), so no QK
           WGMMA reads these rows while they change.  K rows past kv_len only ever feed S
           columns that the softmax sets to -inf by assignment, so their garbage is harmless;
        3. st.shared zeros (generic proxy) -> ``fence_view_async_shared`` -> named barrier
           BAR_TAIL_OF[wg] of the warpgroup's 128 threads -> its P V WGMMA (RS or SS) reads them.
        P, which the owner writes over the RoPE columns 512..575 after its S, is never touched
        (only columns < 512 are zeroed), and K rows past kv_len in the RoPE columns are not
        zeroed at all (S only).  No load follows into a last tile's buffer (in the item: tma_producer's producer does
        load the next item's tiles into it, but only after this warpgroup's empty arrive on the part, which comes after
        its P V on these rows, so after the zeros; the fence above orders the zeros (generic proxy) before that TMA
        write (async proxy) through the arrive / wait chain, and the second full wait here cannot observe a later
        phase, which needs that same arrive)."""
        valid = kv_len - n * BLOCK_N
        if valid < BLOCK_N:
            cute.arch.mbarrier_wait(mbar_ptr, parity)
            blocks = SEESAW_LOAD_BLOCKS[wg][0]  # blocks 4 wg .. 4 wg + 3: this warpgroup's V half
            for m in cutlass.range_constexpr(cute.size(tKsK.shape[1])):
                if tKcK[0, m, 0][0] >= valid:
                    for c in cutlass.range_constexpr(len(blocks)):
                        tKsK[None, m, blocks[c], stage].fill(0)
            cute.arch.fence_view_async_shared()
            cute.arch.barrier(barrier_id=BAR_TAIL_OF[wg], number_of_threads=WG_THREADS)

    @cute.jit
    def prefetch_tile_l2(self, mKV: cute.Tensor, page: cutlass.Int32, n: cutlass.Int32,
                         blocks_per_page: cutlass.Int32):
        """KV block n (64 tokens x 576, contiguous inside its page) -> L2, one
        ``cp.async.bulk.prefetch.L2.global`` (best effort, no completion to wait for)."""
        if cutlass.const_expr(_nvw is not None):
            gK = cute.local_tile(mKV[page, None, None], (BLOCK_N, D_QK), (n % blocks_per_page, 0))
            _nvw.cp_async_bulk_prefetch(gK.iterator, BLOCK_N * D_QK * (self.kv_dtype.width // 8))

    @cute.jit
    def prefetch_pair_l2(self, mKV: cute.Tensor, thread: cutlass.Int32, pg2: cutlass.Int32, pg3: cutlass.Int32,
                         n_start: cutlass.Int32, ta: cutlass.Int32, T: cutlass.Int32,
                         blocks_per_page: cutlass.Int32):
        """With l2_prefetch, by the loading threads' thread 0 (``thread``: this one's index among them): the next
        pair's tiles a+2, b+2 that exist (pages pg2 / pg3, read one pair ahead) -> L2, one bulk prefetch each (a
        64-token block of a page is contiguous), so that their loads later in this pair hit L2."""
        if cutlass.const_expr(self.l2_prefetch):
            if thread == 0:
                if ta + 2 < T:
                    self.prefetch_tile_l2(mKV, pg2, n_start + ta + 2, blocks_per_page)
                if ta + 3 < T:
                    self.prefetch_tile_l2(mKV, pg3, n_start + ta + 3, blocks_per_page)

    def qk_wait_order(self, stage: int, order: tuple, mbar_own, mbar_other):
        """(k-block order, first mbarrier, second mbarrier) of ``qk`` (plain Python, at trace time): the
        caller's order (own part first) unless ``wg1_other_first`` and the tile is warpgroup 1's own (buffer 1,
        the 16-bit kernels' only stage-1 QK): then WG0's part first (SEESAW_QK_ORDER_WG1_OTHER_FIRST, mbar + 2),
        its own (mbar + 3) second.  Both waits keep the caller's parity (the same phase of each mbarrier)."""
        if getattr(self, "wg1_other_first", False) and stage == 1:
            return (order[1], order[0]), mbar_other, mbar_own
        return order, mbar_own, mbar_other

    @cute.jit
    def qk(
        self, mma_s_first: cute.TiledMma, mma_s: cute.TiledMma, acc_S: cute.Tensor,
        tSrQ: cute.Tensor, tSrK: cute.Tensor, stage: cutlass.Constexpr, order: cutlass.Constexpr,
        mbar_own, mbar_other, parity: cutlass.Int32, wait: cutlass.Constexpr = True,
    ):
        """S = Q K^T for the tile in sK[:, :, stage]: wait for this warpgroup's part of the tile,
        issue its k-blocks, wait for the other part, issue the rest, wait for all (unless
        ``wait`` is False: the caller waits, fp8 KV converts a part in between).  With
        ``wg1_other_first``, warpgroup 1's own tile (stage 1) takes the other part first
        (``qk_wait_order``)."""
        order, mbar_first, mbar_second = self.qk_wait_order(stage, order, mbar_own, mbar_other)
        cute.arch.mbarrier_wait(mbar_first, parity)
        if cutlass.const_expr(self.reader_fences):
            cute.arch.fence_view_async_shared()
        warpgroup.fence()
        for i in cutlass.range_constexpr(len(order[0])):
            mma = mma_s_first if i == 0 else mma_s
            k = order[0][i]
            cute.gemm(mma, acc_S, tSrQ[None, None, k], tSrK[None, None, k, stage], acc_S)
        warpgroup.commit_group()
        cute.arch.mbarrier_wait(mbar_second, parity)
        if cutlass.const_expr(self.reader_fences):
            cute.arch.fence_view_async_shared()
        warpgroup.fence()
        for i in cutlass.range_constexpr(len(order[1])):
            k = order[1][i]
            cute.gemm(mma_s, acc_S, tSrQ[None, None, k], tSrK[None, None, k, stage], acc_S)
        warpgroup.commit_group()
        if cutlass.const_expr(wait):
            warpgroup.wait_group(0)

    @cute.jit
    def softmax_publish(
        self, mma_o_rs: cute.TiledMma, r2s_P: cute.TiledCopy, acc_S: cute.Tensor, tOrP: cute.Tensor,
        tScS: cute.Tensor, sP: cute.Tensor, sScale: cute.Tensor, sMax: cute.Tensor,
        acc_O_mn: cute.Tensor, row_lim: cute.Tensor, row_max: cute.Tensor, row_sum: cute.Tensor,
        n: cutlass.Int32, buf: cutlass.Constexpr, scale_log2: cutlass.Float32,
        wg_tidx: cutlass.Int32, is_quad_leader, bar_id: cutlass.Constexpr,
        row_corr: cute.Tensor, rescale_o: cutlass.Constexpr,
    ):
        """Owner: mask, online softmax of S (rows in quads), P -> tOrP (registers) and sP,
        scale / new max -> sScale / sMax[:, buf] and row_corr, then arrive on bar_id.  O *= scale
        here when ``rescale_o`` (else the caller does it once its P V WGMMAs on O are done)."""
        mt = self.mma_dtype
        acc_S_mn = _acc_mn_view(acc_S)
        n_rows = cute.size(acc_S_mn.shape[0])
        for r in cutlass.range_constexpr(n_rows):
            lim = row_lim[r] - n * BLOCK_N
            if lim < BLOCK_N:  # only the last tiles of a row have masked columns
                for c in cutlass.range_constexpr(cute.size(acc_S_mn.shape[1])):
                    if tScS[0, c][1] >= lim:
                        acc_S_mn[r, c] = -cutlass.Float32.inf
            m_cur = _quad_max(
                acc_S_mn[r, None].load().reduce(cute.ReductionOp.MAX, -cutlass.Float32.inf, 0)
            )
            m_prev = row_max[r]
            m_new = cute.arch.fmax(m_prev, m_cur)
            if cutlass.const_expr(self.lazy_rescale):
                # the same in the four lanes of the row's quad (m_cur is quad-reduced). -inf - -inf = NaN
                # compares false (nothing seen yet: nothing to rescale); a first finite max grows by +inf
                grow = (m_new - m_prev) * scale_log2 > LAZY_RESCALE_LOG2
                m_ref = m_new if grow else m_prev
                m_use = 0.0 if m_ref == -cutlass.Float32.inf else m_ref
                p_row = cute.math.exp2(
                    acc_S_mn[r, None].load() * scale_log2 - m_use * scale_log2, fastmath=True
                )
                corr = cutlass.Float32(1.0)
                if grow:
                    corr = cute.math.exp2(m_prev * scale_log2 - m_use * scale_log2, fastmath=True)
                    row_sum[r] = row_sum[r] * corr
                    if cutlass.const_expr(rescale_o):
                        acc_O_mn[r, None] = acc_O_mn[r, None].load() * corr
                row_sum[r] = row_sum[r] + p_row.reduce(cute.ReductionOp.ADD, cutlass.Float32.zero, 0)
                row_max[r] = m_ref
                m_new = m_ref
                acc_S_mn[r, None] = p_row
                row_corr[r] = corr
            else:
                m_use = 0.0 if m_new == -cutlass.Float32.inf else m_new
                p_row = cute.math.exp2(
                    acc_S_mn[r, None].load() * scale_log2 - m_use * scale_log2, fastmath=True
                )
                corr = cute.math.exp2(m_prev * scale_log2 - m_use * scale_log2, fastmath=True)
                row_sum[r] = row_sum[r] * corr + p_row.reduce(cute.ReductionOp.ADD, cutlass.Float32.zero, 0)
                row_max[r] = m_new
                acc_S_mn[r, None] = p_row
                row_corr[r] = corr
                if cutlass.const_expr(rescale_o):
                    acc_O_mn[r, None] = acc_O_mn[r, None].load() * corr
            if is_quad_leader:
                sScale[tScS[r, 0][0], buf] = corr
                sMax[tScS[r, 0][0], buf] = m_new
        # P: registers (the RS A operand: C order = A order for 16-bit types) and sP
        tOrP_as_acc = cute.make_tensor(tOrP.iterator, acc_S.layout)
        tOrP_as_acc.store(acc_S.load().to(mt))
        thr_r2s = r2s_P.get_slice(wg_tidx)
        cute.copy(r2s_P, thr_r2s.retile(tOrP_as_acc), thr_r2s.partition_D(sP))
        cute.arch.fence_view_async_shared()
        cute.arch.barrier_arrive(barrier_id=bar_id, number_of_threads=NUM_THREADS)

    @cute.jit
    def rescale_rows(self, acc_O_mn: cute.Tensor, row_corr: cute.Tensor, n_rows: cutlass.Constexpr):
        """O *= row_corr per row (warpgroup 1's own tile, after its P V WGMMAs on O are done); with
        ``lazy_rescale`` only the rows whose reference max moved (corr != 1)."""
        for r in cutlass.range_constexpr(n_rows):
            if cutlass.const_expr(self.lazy_rescale):
                if row_corr[r] != 1.0:
                    acc_O_mn[r, None] = acc_O_mn[r, None].load() * row_corr[r]
            else:
                acc_O_mn[r, None] = acc_O_mn[r, None].load() * row_corr[r]

    @cute.jit
    def pv_rs(self, mma_o_rs: cute.TiledMma, acc_O: cute.Tensor, tOrP: cute.Tensor, tOrV: cute.Tensor,
              stage: cutlass.Constexpr):
        """O += P V (P in registers), wait."""
        warpgroup.fence()
        for k in cutlass.range_constexpr(cute.size(tOrP.shape[2])):
            cute.gemm(mma_o_rs, acc_O, tOrP[None, None, k], tOrV[None, None, k, stage], acc_O)
        warpgroup.commit_group()
        warpgroup.wait_group(0)

    @cute.jit
    def pv_remote(
        self, mma_o_ss: cute.TiledMma, acc_O: cute.Tensor, acc_O_mn: cute.Tensor, tScS: cute.Tensor,
        sP: cute.Tensor, sScale: cute.Tensor, sMax: cute.Tensor, tOrV: cute.Tensor,
        row_max: cute.Tensor, row_sum: cute.Tensor, buf: cutlass.Constexpr, wg_tidx: cutlass.Int32,
        bar_id: cutlass.Constexpr, wait: cutlass.Constexpr, tail=None,
    ):
        """Non-owner: wait for the owner's P, take its scale and max, O *= scale, O += sP V (SS).

        The V columns read here were cp.async'ed by this warpgroup but their landing was
        observed (mbarrier) by the owner before it published P; the async-proxy fence after
        the barrier mirrors the one after each mbarrier wait (consumer side).  ``tail``
        (tma=True): ``zero_v_tail``'s arguments, run after the barrier (the owner's S is done)
        and before the WGMMA."""
        cute.arch.barrier(barrier_id=bar_id, number_of_threads=NUM_THREADS)
        if cutlass.const_expr(self.reader_fences):
            cute.arch.fence_view_async_shared()
        if cutlass.const_expr(tail is not None):
            self.zero_v_tail(*tail)
        for r in cutlass.range_constexpr(cute.size(acc_O_mn.shape[0])):
            row = tScS[r, 0][0]
            corr = sScale[row, buf]
            row_max[r] = sMax[row, buf]
            if cutlass.const_expr(self.lazy_rescale):
                if corr != 1.0:  # the owner kept this row's reference max: nothing to rescale
                    row_sum[r] = row_sum[r] * corr
                    acc_O_mn[r, None] = acc_O_mn[r, None].load() * corr
            else:
                row_sum[r] = row_sum[r] * corr
                acc_O_mn[r, None] = acc_O_mn[r, None].load() * corr
        thr_o = mma_o_ss.get_slice(wg_tidx)
        tOrPs = thr_o.make_fragment_A(thr_o.partition_A(sP))  # (MMA, 1, 4)
        warpgroup.fence()
        for k in cutlass.range_constexpr(cute.size(tOrPs.shape[2])):
            cute.gemm(mma_o_ss, acc_O, tOrPs[None, None, k], tOrV[None, None, k, buf], acc_O)
        warpgroup.commit_group()
        if cutlass.const_expr(wait):
            warpgroup.wait_group(0)

    # ---------------------------------------------------------------- q_prefetch=True (balanced, 16-bit KV)
    @cute.jit
    def qpf_load_q(self, qpf, b: cutlass.Int32, m_block: cutlass.Int32, warp: cutlass.Constexpr):
        """q_prefetch: the Q rows of m-block ``m_block`` of request b -> sQ by TMA from warp ``warp`` (one lane arms
        the Q mbarrier with the 73,728 bytes of its nine 64 x 64 boxes, then one box per 64-column block; rows past R
        are zero-filled by the TMA unit).  The caller makes sure no S WGMMA still reads sQ (the prologue: after the
        previous epilogue's CTA barrier; ``qpf_issue_q``: after both warpgroups' last S of the item)."""
        if qpf.warp == warp:
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive_and_expect_tx(qpf.mbar, BLOCK_M * D_QK * (self.mma_dtype.width // 8))
            for k in cutlass.range_constexpr(D_QK // KV_BOX):
                cute.copy(qpf.atom, qpf.tQgQ[None, m_block, k, b], qpf.tQsQ[None, 0, k], tma_bar_ptr=qpf.mbar)

    @cute.jit
    def qpf_issue_q(self, qpf, m_block: cutlass.Int32):
        """q_prefetch, warpgroup 1 in the item's last pair right after its pv_remote of tile a: the next item's Q
        when the next row names another request (qpf.q_next >= 0).  Why here: every S WGMMA of the item reads all of
        sQ; WG1's last S was waited in its qk (this pair's or, for an odd T, the previous pair's), WG0's last S (tile
        a of this pair) before its arrive on the P_a barrier that pv_remote synced on, and what WG1 issued since
        (P_a V_R) reads sP0 and V only.  The earliest point at which both are known to be done."""
        if qpf.q_next >= 0:
            self.qpf_load_q(qpf, qpf.q_next, m_block, 4)

    @cute.jit
    def qpf_load_next(self, qpf, kv_src: tuple, wg: cutlass.Constexpr, buf: cutlass.Constexpr, T: cutlass.Int32,
                      blocks_per_page: cutlass.Int32, mbar):
        """q_prefetch: warpgroup ``wg``'s part of the next item's tile ``buf`` (0 / 1, when it has one) into buffer
        ``buf``, at the slot where the pair loop would load its part of tile a+2 (buf 0, the item's last pair) or
        b+2 (buf 1, the pair with ta + 3 >= T): the same blocks and mbarrier as for an own tile, so each buffer still
        completes one phase per tile in column order (seesaw_item_phases).  After a 1-tile item (no tile of it in
        buffer 1, which the previous item's reads left before its epilogue barrier) the buffer-0 slot also issues the
        next tile 1.  Page-table entries and length were read at the item's start (seesaw_column_qpf)."""
        if qpf.nt > buf:
            self.load_kv_part(kv_src, (qpf.pg0, qpf.pg1)[buf], qpf.n0 + buf, buf,
                              SEESAW_LOAD_BLOCKS[wg][int(buf != wg)], blocks_per_page, qpf.nlen, mbar + 2 * buf + wg)
        if cutlass.const_expr(buf == 0):
            if T == 1:
                if qpf.nt > 1:
                    self.load_kv_part(kv_src, qpf.pg1, qpf.n0 + 1, 1, SEESAW_LOAD_BLOCKS[wg][int(wg != 1)],
                                      blocks_per_page, qpf.nlen, mbar + 2 + wg)

    @cute.jit
    def seesaw_column_qpf(
        self,
        mQ: cute.Tensor, mKV: cute.Tensor, mPT: cute.Tensor, mLens: cute.Tensor,
        mO: cute.Tensor, mLSE: cute.Tensor, mWork: cute.Tensor, mOp: cute.Tensor, mLSEp: cute.Tensor,
        scale_log2: cutlass.Float32, scale_ln: cutlass.Float32, v_scale: cutlass.Float32,
        s_q: cutlass.Int32, num_heads: cutlass.Int32,
        sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout,
        sP_layout: cute.ComposedLayout, sV_layout: cute.ComposedLayout,
        g2s: cute.TiledCopy, g2s_wg: cute.TiledCopy, r2s_P: cute.TiledCopy,
        mma_s: cute.TiledMma, mma_s_first: cute.TiledMma, mma_o_rs: cute.TiledMma, mma_o_ss: cute.TiledMma,
        SharedStorage: cutlass.Constexpr, tma_atom: cute.CopyAtom, mKV_tma: cute.Tensor, mRanges: cute.Tensor,
        q_tma_atom: cute.CopyAtom, mQ_tma: cute.Tensor,
        tidx: cutlass.Int32, m_block: cutlass.Int32, wi: cutlass.Int32, wg: cutlass.Int32, wg_tidx: cutlass.Int32,
        lane: cutlass.Int32,
    ):
        """The balanced column walk with q_prefetch (kernel_seesaw's balanced branch otherwise): the same items,
        ``seesaw_item`` per row with b >= 0, plus the next row's Q and KV tiles 0 / 1 issued during the item's last
        pairs (``QPrefetch``), so that the next item does not start by waiting for them.  Why: at full batches with
        short and medium lengths the balanced seesaw's time per work item (~12 us fitted on the H200 against fa3's
        ~6.6, NOTES.md "Where H=128's fixed cost goes") is largely Q (72 KB), tiles 0 / 1 and the epilogue in
        sequence; the twentieth session's tile-only prefetch gained nothing because Q still loaded after the epilogue.

        Per row: the next row (it + 1, if in the column; b < 0 counts as none: that row is skipped and the one after
        loads its own) is read at the start (work entry, length, pages of its tiles 0 / 1), so the last pair's loads
        do not wait on global reads.  Q: one TMA per load on mbarrier 4; nq counts the loads the CTA issued, so every
        item waits parity (nq - 1) % 2 (its own load, the one issued for it by the previous item, or, when sQ already
        holds its request, a completed phase: returns at once; the next Q phase is only issued after every thread
        waited this one and passed the prologue barrier).  q_of: the request sQ holds or will hold.  pf: the previous
        item issued this one's tiles 0 / 1 (and its Q if needed): whenever that item had a pair (T >= 1) and this
        row was its next.  ph0 / ph1: as the balanced branch (a prefetched tile is counted by its own item)."""
        R = mQ.shape[1]
        blocks_per_page = mKV.shape[1] // BLOCK_N
        smem = self.seesaw_smem(SharedStorage, sQ_layout, sK_layout, sP_layout, sV_layout)
        mbar = smem[8]
        if tidx == 0:
            for i in cutlass.range_constexpr(4):
                cute.arch.mbarrier_init(mbar + i, self._mbar_count())
            cute.arch.mbarrier_init(mbar + 4, 1)  # Q: one arrive.expect_tx; its boxes' bytes complete the phase
            cpasync.prefetch_descriptor(q_tma_atom)
        cute.arch.mbarrier_init_fence()
        cute.arch.barrier()
        # q boxes: the smem side is sQ's 64-column blocks (TMA, 1, 9), the gmem side (TMA, m-blocks, 9, B)
        tQsQ, tQgQ = cpasync.tma_partition(
            q_tma_atom, 0, cute.make_layout(1),
            cute.group_modes(cute.flat_divide(smem[0], (BLOCK_M, KV_BOX)), 0, 2),
            cute.group_modes(cute.flat_divide(mQ_tma, (BLOCK_M, KV_BOX)), 0, 2))
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        ph0 = cutlass.Int32(0)
        ph1 = cutlass.Int32(0)
        q_of = cutlass.Int32(-1)
        nq = cutlass.Int32(0)
        pf = cutlass.Int32(0)
        end = mRanges[wi + 1]
        for it in cutlass.range(mRanges[wi], end, 1):
            b = mWork[it, 0]
            if b >= 0:
                slot = mWork[it, 3]
                kv_len = mLens[b]
                n_start = mWork[it, 1] // BLOCK_N
                T = (mWork[it, 2] + BLOCK_N - 1) // BLOCK_N - n_start
                nb = cutlass.Int32(-1)
                if it + 1 < end:
                    nb = mWork[it + 1, 0]
                n0 = cutlass.Int32(0)
                nt = cutlass.Int32(0)
                nlen = cutlass.Int32(0)
                npg0 = cutlass.Int32(0)
                npg1 = cutlass.Int32(0)
                if nb >= 0:
                    n0 = mWork[it + 1, 1] // BLOCK_N
                    nt = (mWork[it + 1, 2] + BLOCK_N - 1) // BLOCK_N - n0
                    nlen = mLens[nb]
                    if nt > 0:
                        npg0 = mPT[nb, n0 // blocks_per_page]
                    if nt > 1:
                        npg1 = mPT[nb, (n0 + 1) // blocks_per_page]
                        nt = cutlass.Int32(2)
                q_next = nb if nb != b else -1
                q_load = b != q_of
                if q_load:
                    nq = nq + 1
                qpar = (nq + 1) % 2
                self.seesaw_item(
                    mQ, mKV, mPT, mO, mLSE, mOp, mLSEp, scale_log2, scale_ln, v_scale, s_q, num_heads,
                    g2s, g2s_wg, r2s_P, mma_s, mma_s_first, mma_o_rs, mma_o_ss, tma_atom, mKV_tma, smem,
                    tidx, m_block, wg, wg_tidx, lane, b, slot, kv_len, R, blocks_per_page, n_start, T,
                    q_load, ph0, ph1,
                    qpf=QPrefetch(q_tma_atom, tQgQ, tQsQ, mbar + 4, warp, qpar, pf, q_next, n0, nt, nlen, npg0,
                                  npg1),
                )
                # what the item issued for the next row: its tiles 0 / 1 and, for another request, its Q (only an
                # item with a pair has the slots: T >= 1)
                q_of = b
                pf = cutlass.Int32(0)
                if T > 0:
                    if nb >= 0:
                        pf = cutlass.Int32(1)
                        q_of = nb
                        if q_next >= 0:
                            nq = nq + 1
                # seesaw_item_phases: buffer 0 holds local tiles 0, 2, ..., buffer 1 tiles 1, 3, ...
                ph0 = ph0 + (T + 1) // 2
                ph1 = ph1 + T // 2

    def seesaw_smem(self, SharedStorage, sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout,
                    sP_layout: cute.ComposedLayout, sV_layout: cute.ComposedLayout):
        """The CTA's shared memory (plain Python, traced inline where the kernel calls it): (sQ, sK, sV, sP0,
        sP1, sScale, sMax, sL, mbar)."""
        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = cute.make_tensor(cute.recast_ptr(sK.iterator, sV_layout.inner), sV_layout.outer)
        # P of the tile in buffer j: K-major SW128 (64, 64) over the RoPE columns 512..575
        # of sK[:, :, j] (byte offset j * 73,728 + 65,536: 1024-aligned, same swizzle phase)
        p_off = (D_QK // 64 - 1) * BLOCK_N * 64
        sP0 = cute.make_tensor(
            cute.recast_ptr(storage.sK.data_ptr() + p_off, sP_layout.inner), sP_layout.outer)
        sP1 = cute.make_tensor(
            cute.recast_ptr(storage.sK.data_ptr() + (BLOCK_N * D_QK + p_off), sP_layout.inner),
            sP_layout.outer)
        sScale = storage.sScale.get_tensor(cute.make_layout((BLOCK_M, 2)))
        sMax = storage.sMax.get_tensor(cute.make_layout((BLOCK_M, 2)))
        sL = storage.sL.get_tensor(cute.make_layout((BLOCK_M, 2)))
        mbar = storage.mbar.data_ptr()  # index 2 * buffer + loading warpgroup
        return sQ, sK, sV, sP0, sP1, sScale, sMax, sL, mbar

    @cute.kernel
    def kernel_seesaw(
        self,
        mQ: cute.Tensor, mKV: cute.Tensor, mPT: cute.Tensor, mLens: cute.Tensor,
        mO: cute.Tensor, mLSE: cute.Tensor, mWork: cute.Tensor, mOp: cute.Tensor,
        mLSEp: cute.Tensor,
        scale_log2: cutlass.Float32, scale_ln: cutlass.Float32, v_scale: cutlass.Float32,
        s_q: cutlass.Int32, num_heads: cutlass.Int32,
        sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout,
        sP_layout: cute.ComposedLayout, sV_layout: cute.ComposedLayout,
        g2s: cute.TiledCopy, g2s_wg: cute.TiledCopy, r2s_P: cute.TiledCopy,
        mma_s: cute.TiledMma, mma_s_first: cute.TiledMma,
        mma_o_rs: cute.TiledMma, mma_o_ss: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
        tma_atom: cute.CopyAtom, mKV_tma: cute.Tensor,  # tma=True only (else None: no parameter)
        mRanges: cute.Tensor,  # balanced=True only (else None: no parameter): column c's work rows
        q_tma_atom: cute.CopyAtom, mQ_tma: cute.Tensor,  # q_prefetch=True only (else None: no parameter)
    ):
        """One work item per CTA (grid (m-blocks, work rows)), or with ``balanced`` CTA (m_block, column c) walks
        work rows mRanges[c] .. mRanges[c + 1] - 1 (rows with b < 0 skipped): the shared memory and mbarriers
        are set up once, each item runs ``seesaw_item`` (Q only when the request changes, its own prologue,
        pairs and epilogue: the KV pipeline drains at every item boundary) with the mbarrier phases the
        column's earlier items completed (``seesaw_item_phases``)."""
        cute.arch.griddepcontrol_launch_dependents()  # PDL trigger for the combine (combine.MLACombine)
        tidx, _, _ = cute.arch.thread_idx()
        m_block, wi, _ = cute.arch.block_idx()
        wg = cute.arch.make_warp_uniform(tidx // WG_THREADS)
        wg_tidx = tidx % WG_THREADS
        lane = tidx % 32

        if cutlass.const_expr(self.balanced and self.fp8_producer):
            self.kernel_fp8p_balanced(
                mQ, mKV, mPT, mLens, mO, mLSE, mWork, mOp, mLSEp, scale_log2, scale_ln, v_scale, s_q, num_heads,
                sQ_layout, sK_layout, sP_layout, sV_layout, g2s, g2s_wg, r2s_P,
                mma_s, mma_s_first, mma_o_rs, mma_o_ss, SharedStorage, mRanges, tidx, m_block, wi, wg, wg_tidx, lane,
            )
        elif cutlass.const_expr(self.balanced and self.tma_producer):
            self.kernel_tmap_balanced(
                mQ, mKV, mPT, mLens, mO, mLSE, mWork, mOp, mLSEp, scale_log2, scale_ln, v_scale, s_q, num_heads,
                sQ_layout, sK_layout, sP_layout, sV_layout, g2s, g2s_wg, r2s_P,
                mma_s, mma_s_first, mma_o_rs, mma_o_ss, SharedStorage, tma_atom, mKV_tma, mRanges, q_tma_atom, mQ_tma,
                tidx, m_block, wi, wg, wg_tidx, lane,
            )
        elif cutlass.const_expr(self.balanced and self.q_prefetch):
            self.seesaw_column_qpf(
                mQ, mKV, mPT, mLens, mO, mLSE, mWork, mOp, mLSEp, scale_log2, scale_ln, v_scale, s_q, num_heads,
                sQ_layout, sK_layout, sP_layout, sV_layout, g2s, g2s_wg, r2s_P,
                mma_s, mma_s_first, mma_o_rs, mma_o_ss, SharedStorage, tma_atom, mKV_tma, mRanges, q_tma_atom, mQ_tma,
                tidx, m_block, wi, wg, wg_tidx, lane,
            )
        elif cutlass.const_expr(self.balanced):
            R = mQ.shape[1]
            blocks_per_page = mKV.shape[1] // BLOCK_N
            smem = self.seesaw_smem(SharedStorage, sQ_layout, sK_layout, sP_layout, sV_layout)
            mbar = smem[8]
            if tidx == 0:
                for i in cutlass.range_constexpr(4):
                    cute.arch.mbarrier_init(mbar + i, self._mbar_count())
            cute.arch.mbarrier_init_fence()
            cute.arch.barrier()
            ph0 = cutlass.Int32(0)  # phases completed so far on buffer 0's two mbarriers (tiles 0, 2, ...)
            ph1 = cutlass.Int32(0)  # ... on buffer 1's (tiles 1, 3, ...)
            self.seesaw_column(
                mQ, mKV, mPT, mLens, mO, mLSE, mWork, mOp, mLSEp, scale_log2, scale_ln, v_scale, s_q, num_heads,
                g2s, g2s_wg, r2s_P, mma_s, mma_s_first, mma_o_rs, mma_o_ss, tma_atom, mKV_tma, smem, mRanges,
                tidx, m_block, wi, wg, wg_tidx, lane, R, blocks_per_page, ph0, ph1,
            )
        elif cutlass.const_expr(self.fp8_producer):
            b = mWork[wi, 0]
            if b >= 0:
                self.kernel_fp8p(
                    mQ, mKV, mPT, mLens, mO, mLSE, mWork, mOp, mLSEp, scale_log2, scale_ln, v_scale, s_q, num_heads,
                    sQ_layout, sK_layout, sP_layout, sV_layout, g2s, g2s_wg, r2s_P,
                    mma_s, mma_s_first, mma_o_rs, mma_o_ss, SharedStorage, tidx, m_block, wi, wg, wg_tidx, lane, b,
                )
        else:
            b = mWork[wi, 0]
            if b >= 0:
                kv_start = mWork[wi, 1]
                kv_end = mWork[wi, 2]
                slot = mWork[wi, 3]
                kv_len = mLens[b]
                R = mQ.shape[1]
                blocks_per_page = mKV.shape[1] // BLOCK_N
                n_start = kv_start // BLOCK_N
                n_end = (kv_end + BLOCK_N - 1) // BLOCK_N
                T = n_end - n_start  # tiles of this item (>= 0); local tile i is KV block n_start + i

                smem = self.seesaw_smem(SharedStorage, sQ_layout, sK_layout, sP_layout, sV_layout)
                mbar = smem[8]
                if tidx == 0:
                    for i in cutlass.range_constexpr(4):
                        # cp.async (16-bit KV): 128 noinc + 128 plain arrives; fp8 KV: 128 plain; TMA: 1
                        cute.arch.mbarrier_init(mbar + i, self._mbar_count())
                cute.arch.mbarrier_init_fence()
                cute.arch.barrier()
                self.seesaw_item(
                    mQ, mKV, mPT, mO, mLSE, mOp, mLSEp, scale_log2, scale_ln, v_scale, s_q, num_heads,
                    g2s, g2s_wg, r2s_P, mma_s, mma_s_first, mma_o_rs, mma_o_ss, tma_atom, mKV_tma, smem,
                    tidx, m_block, wg, wg_tidx, lane, b, slot, kv_len, R, blocks_per_page, n_start, T,
                    None, None, None,
                )

    @cute.jit
    def seesaw_column(
        self,
        mQ: cute.Tensor, mKV: cute.Tensor, mPT: cute.Tensor, mLens: cute.Tensor,
        mO: cute.Tensor, mLSE: cute.Tensor, mWork: cute.Tensor, mOp: cute.Tensor, mLSEp: cute.Tensor,
        scale_log2: cutlass.Float32, scale_ln: cutlass.Float32, v_scale: cutlass.Float32,
        s_q: cutlass.Int32, num_heads: cutlass.Int32,
        g2s: cute.TiledCopy, g2s_wg: cute.TiledCopy, r2s_P: cute.TiledCopy,
        mma_s: cute.TiledMma, mma_s_first: cute.TiledMma,
        mma_o_rs: cute.TiledMma, mma_o_ss: cute.TiledMma,
        tma_atom: cute.CopyAtom, mKV_tma: cute.Tensor, smem, mRanges: cute.Tensor,
        tidx: cutlass.Int32, m_block: cutlass.Int32, wi: cutlass.Int32, wg: cutlass.Int32,
        wg_tidx: cutlass.Int32, lane: cutlass.Int32, R: cutlass.Int32, blocks_per_page: cutlass.Int32,
        ph0: cutlass.Int32, ph1: cutlass.Int32,
    ):
        """balanced: ``seesaw_item`` for each of column wi's work rows mRanges[wi] .. mRanges[wi + 1] - 1 (rows with
        b < 0 skipped), Q loaded only when the request changes, each item after the phases the column's earlier
        items completed per buffer (``ph0`` / ``ph1``: 0 at the column's start, then ``seesaw_item_phases`` added
        per item: buffer 0 holds local tiles 0, 2, ..., buffer 1 tiles 1, 3, ...).  The CTA's own threads
        (kernel_seesaw) or its two math warpgroups (kernel_fp8p_balanced, whose producer walks the same rows)."""
        q_of = cutlass.Int32(-1)  # request whose Q rows sQ holds
        for it in cutlass.range(mRanges[wi], mRanges[wi + 1], 1):
            b = mWork[it, 0]
            if b >= 0:
                slot = mWork[it, 3]
                kv_len = mLens[b]
                n_start = mWork[it, 1] // BLOCK_N
                T = (mWork[it, 2] + BLOCK_N - 1) // BLOCK_N - n_start
                self.seesaw_item(
                    mQ, mKV, mPT, mO, mLSE, mOp, mLSEp, scale_log2, scale_ln, v_scale, s_q, num_heads,
                    g2s, g2s_wg, r2s_P, mma_s, mma_s_first, mma_o_rs, mma_o_ss, tma_atom, mKV_tma, smem,
                    tidx, m_block, wg, wg_tidx, lane, b, slot, kv_len, R, blocks_per_page, n_start, T,
                    b != q_of, ph0, ph1,
                )
                q_of = b
                ph0 = ph0 + (T + 1) // 2
                ph1 = ph1 + T // 2

    @cute.jit
    def seesaw_item(
        self,
        mQ: cute.Tensor, mKV: cute.Tensor, mPT: cute.Tensor,
        mO: cute.Tensor, mLSE: cute.Tensor, mOp: cute.Tensor, mLSEp: cute.Tensor,
        scale_log2: cutlass.Float32, scale_ln: cutlass.Float32, v_scale: cutlass.Float32,
        s_q: cutlass.Int32, num_heads: cutlass.Int32,
        g2s: cute.TiledCopy, g2s_wg: cute.TiledCopy, r2s_P: cute.TiledCopy,
        mma_s: cute.TiledMma, mma_s_first: cute.TiledMma,
        mma_o_rs: cute.TiledMma, mma_o_ss: cute.TiledMma,
        tma_atom: cute.CopyAtom, mKV_tma: cute.Tensor, smem,
        tidx: cutlass.Int32, m_block: cutlass.Int32, wg: cutlass.Int32, wg_tidx: cutlass.Int32,
        lane: cutlass.Int32, b: cutlass.Int32, slot: cutlass.Int32, kv_len: cutlass.Int32, R: cutlass.Int32,
        blocks_per_page: cutlass.Int32, n_start: cutlass.Int32, T: cutlass.Int32,
        q_load, ph0, ph1, qpf=None, tmq=None,
    ):
        """One work item (request b, local tiles 0 .. T - 1 = KV blocks n_start .., partial slot or -1): Q,
        the prologue loads of tiles 0 and 1, the pairs, the epilogue.  The shared memory and initialised
        mbarriers come from the caller (``smem``: seesaw_smem's tuple).  ``q_load``, ``ph0``, ``ph1``: None
        for one item per CTA (Q always loaded, parities p % 2); balanced: whether to load Q (the request
        changed) and the phases the column's earlier items completed on buffer 0's / buffer 1's mbarriers.

        fp8_producer: what math warpgroups 0 and 1 (tidx 0..255) run (``kernel_fp8p``, ``kernel_fp8p_balanced``):
        the 16-bit (cp.async) instruction stream with no KV load of its own (no prologue, no page table, no L2
        prefetch: the producer warpgroup's), each load of tile +2 turned into an arrive on that part's empty
        mbarrier (``refill_part``: same place, same condition; balanced: every tile), the full mbarriers waited as
        the 16-bit ones, and the CTA barriers by BAR_MATH over the 256 math threads (``item_barrier``).  Q as in
        the other kernels (bf16 q: ld.global -> cvt -> st.shared; fp16 q: cp.async), complete and fenced before
        the BAR_MATH that precedes the first S.  In balanced, sQ is rewritten (``q_load``) only after the
        previous item's epilogue BAR_MATH, by which every S WGMMA of both math warpgroups was waited.

        ``qpf`` (q_prefetch only, ``QPrefetch``; None: nothing of it is compiled): Q by TMA on its own mbarrier, no
        cp.async commit groups, the prologue's tiles 0 / 1 skipped when the previous item issued them, and this
        item issuing the next one's Q and tiles 0 / 1 in its last pairs (``seesaw_column_qpf``).

        ``tmq`` (tma_producer only, ``TmapQ``; None: nothing of it is compiled): the math side of
        ``kernel_tmap_balanced``: fp8_producer's balanced stream (no KV load, page-table read or L2 prefetch of its
        own, every tile's parts released on the empty mbarriers, BAR_MATH), ``zero_v_tail`` kept as with tma=True
        (the producer's TMA does not zero page tails), no Q load: Q full waited with parity ``tmq.qpar`` before the
        item's first BAR_MATH, and with ``tmq.release`` each math thread arrives on Q empty once its own last S of
        the item is waited (WG0: after its qk of the last pair's tile a; WG1: in the last pair after its qk of tile b
        if any, else right there, its last S waited a pair before; T = 0: after the pair loop), so the producer's
        next Q load waits for both warpgroups' last S and nothing else."""
        mt = self.mma_dtype
        sQ, sK, sV, sP0, sP1, sScale, sMax, sL, mbar = smem
        producer = self.fp8_producer or self.tma_producer  # a producer warpgroup loads KV (and with TMA, Q)
        if cutlass.const_expr(producer):
            refill_bars = mbar + 4  # the parts' empty mbarriers (the full ones are mbar + 0 .. 3)
        else:
            refill_bars = mbar  # the mbarriers the refill loads complete

        # ---------------- Q: gmem -> smem (rows >= R zero), its own commit group ----------
        thr_g2s = g2s.get_slice(tidx)
        _, _, r2s_q, g2r_q = self._fp8_copies()
        if cutlass.const_expr(tmq is not None):
            pass  # tma_producer: the producer warpgroup loads Q (waited on tmq.full below)
        elif cutlass.const_expr(q_load is None):
            self.load_q(mQ, sQ, g2s, thr_g2s, r2s_q, g2r_q, tidx, b, m_block, R)
        elif cutlass.const_expr(qpf is not None):
            # q_prefetch: Q by TMA from warp 0 (q_load is False when the previous item issued it or sQ holds it)
            if q_load:
                self.qpf_load_q(qpf, b, m_block, 0)
        else:
            if q_load:  # balanced: sQ still holds this request's rows when the column's previous item had them
                self.load_q(mQ, sQ, g2s, thr_g2s, r2s_q, g2r_q, tidx, b, m_block, R)
        if cutlass.const_expr(qpf is None and tmq is None):
            cute.arch.cp_async_commit_group()

        # ---------------- KV tiles 0 and 1: each warpgroup loads its parts ----------------
        if cutlass.const_expr(self.fp8_producer):
            kv_src = None  # no KV load here: the producer warpgroup's (refill_part arrives instead)
            in_flight = 0  # Q is the math warpgroups' only cp.async group
        elif cutlass.const_expr(self.tma_producer):
            kv_src = None  # tma_producer: no KV load here either; zero_v_tail's partitions of sK only
            thr_g2s_wg = g2s_wg.get_slice(wg_tidx)
            tKcK = thr_g2s_wg.partition_S(cute.make_identity_tensor((BLOCK_N, D_QK)))  # (CPY, 4, 9)
            tKsK = thr_g2s_wg.partition_D(sK)  # (CPY, 4, 9, STAGES)
        else:
            thr_g2s_wg = g2s_wg.get_slice(wg_tidx)
            cKV = cute.make_identity_tensor((BLOCK_N, D_QK))
            tKcK = thr_g2s_wg.partition_S(cKV)  # (CPY, 4, 9)
            tKsK = thr_g2s_wg.partition_D(sK)  # (CPY, 4, 9, STAGES)
            kv_src = (g2s_wg, thr_g2s_wg, mKV, tKcK, tKsK)  # load_kv_part: cp.async
            if cutlass.const_expr(self.tma):
                # TMA: boxes (64 tokens, 64 columns); the smem side is sK's 64-column blocks
                # (TMA, 1, 9, STAGES), the gmem side (TMA, page_size / 64, 9, pages)
                tKsT, tKgT = cpasync.tma_partition(
                    tma_atom, 0, cute.make_layout(1),
                    cute.group_modes(cute.flat_divide(sK, (BLOCK_N, KV_BOX)), 0, 2),
                    cute.group_modes(cute.flat_divide(mKV_tma, (BLOCK_N, KV_BOX)), 0, 2))
                tma_warp = cute.arch.make_warp_uniform(cute.arch.warp_idx()) % 4 == 0
                kv_src = (tma_atom, tKgT, tKsT, tma_warp)
                if tidx == 0:
                    cpasync.prefetch_descriptor(tma_atom)
            if cutlass.const_expr(self.is_fp8):
                # fp8 KV: ld.global -> registers (one part: up to 5 blocks x 4 passes x 8
                # fp8 = 40 registers), later cvt + st.shared into the fp16 sK; same (row, col)
                # per position as tKsK (the TV layout of g2s_wg)
                g2r_wg, r2s_wg = self._wg_fp8_copies()
                thr_g2r_wg = g2r_wg.get_slice(wg_tidx)
                tKsK = r2s_wg.get_slice(wg_tidx).partition_D(sK)  # (CPY, 4, 9, STAGES)
                rRaw = cute.make_rmem_tensor(
                    (cute.size(tKcK.shape[0]), cute.size(tKcK.shape[1]), 5), cutlass.Float8E4M3FN)
            # WG w loads blocks SEESAW_LOAD_BLOCKS[w][0] of the tile it owns (w) and
            # SEESAW_LOAD_BLOCKS[w][1] of the other one; mbarrier 2 * buffer + w
            T_pro = T  # tiles the prologue loads; q_prefetch: none when the previous item issued them (qpf.pf)
            if cutlass.const_expr(qpf is not None):
                T_pro = T * (1 - qpf.pf)
            for t in cutlass.range_constexpr(2):
                if T_pro > t:
                    pg = mPT[b, (n_start + t) // blocks_per_page]
                    if cutlass.const_expr(self.is_fp8):
                        if wg == 0:
                            self.ldg_part_fp8(g2r_wg, thr_g2r_wg, mKV, pg, n_start + t,
                                              SEESAW_LOAD_BLOCKS[0][t], blocks_per_page, kv_len, tKcK,
                                              rRaw)
                            self.store_part_fp8(r2s_wg, n_start + t, t, SEESAW_LOAD_BLOCKS[0][t],
                                                kv_len, tKcK, tKsK, rRaw, mbar + 2 * t)
                        else:
                            self.ldg_part_fp8(g2r_wg, thr_g2r_wg, mKV, pg, n_start + t,
                                              SEESAW_LOAD_BLOCKS[1][1 - t], blocks_per_page, kv_len,
                                              tKcK, rRaw)
                            self.store_part_fp8(r2s_wg, n_start + t, t, SEESAW_LOAD_BLOCKS[1][1 - t],
                                                kv_len, tKcK, tKsK, rRaw, mbar + 2 * t + 1)
                    else:
                        if wg == 0:
                            self.load_kv_part(kv_src, pg, n_start + t, t, SEESAW_LOAD_BLOCKS[0][t],
                                              blocks_per_page, kv_len, mbar + 2 * t)
                        else:
                            self.load_kv_part(kv_src, pg, n_start + t, t, SEESAW_LOAD_BLOCKS[1][1 - t],
                                              blocks_per_page, kv_len, mbar + 2 * t + 1)
            if cutlass.const_expr(qpf is None):
                cute.arch.cp_async_commit_group()
            in_flight = 1  # the KV group
        if cutlass.const_expr(tmq is not None):
            # tma_producer: Q's latest phase (this request's load: a completed phase returns at once when an earlier
            # item of the request waited it) has landed; TMA writes, visible to the WGMMAs after the wait
            cute.arch.mbarrier_wait(tmq.full, tmq.qpar)
        elif cutlass.const_expr(qpf is None):
            # Q landed (the KV group may still fly), visible to the async proxy and to all threads
            cute.arch.cp_async_wait_group(in_flight)
            cute.arch.fence_view_async_shared()
        else:
            # q_prefetch: Q's latest phase (loaded above or by the previous item; a second wait on a completed
            # phase returns at once) has landed: TMA writes, visible to the WGMMAs after the wait
            cute.arch.mbarrier_wait(qpf.mbar, qpf.qpar)
        self.item_barrier()

        # ---------------- per-warpgroup MMA partitions ----------------
        mma_o_rs.set(warpgroup.Field.ACCUMULATE, True)
        mma_o_ss.set(warpgroup.Field.ACCUMULATE, True)
        mma_s.set(warpgroup.Field.ACCUMULATE, True)
        mma_s_first.set(warpgroup.Field.ACCUMULATE, False)
        thr_s = mma_s.get_slice(wg_tidx)
        tSrQ = thr_s.make_fragment_A(thr_s.partition_A(sQ))  # (MMA, 1, 36)
        tSrK = thr_s.make_fragment_B(thr_s.partition_B(sK))  # (MMA, 1, 36, STAGES)
        s_shape = thr_s.partition_shape_C((BLOCK_M, BLOCK_N))
        cS = cute.make_identity_tensor((BLOCK_M, BLOCK_N))
        tScS = _acc_mn_view(thr_s.partition_C(cS))
        n_rows = cute.size(tScS.shape[0])

        sV_half = cute.local_tile(sV, (D_V_HALF, BLOCK_N, STAGES), (wg, 0, 0))
        thr_o = mma_o_rs.get_slice(wg_tidx)
        tOrV = thr_o.make_fragment_B(thr_o.partition_B(sV_half))  # (MMA, 1, 4, STAGES)
        acc_O = cute.make_rmem_tensor(thr_o.partition_shape_C((BLOCK_M, D_V_HALF)), cutlass.Float32)
        acc_O.fill(0.0)
        acc_O_mn = _acc_mn_view(acc_O)
        acc_S = cute.make_rmem_tensor(s_shape, cutlass.Float32)
        # P of the own tile (16 bit): the RS A operand (its values in S's C order)
        tOrP = cute.make_rmem_tensor(thr_o.partition_shape_A((BLOCK_M, BLOCK_N)), mt)
        is_quad_leader = lane % 4 == 0

        row_lim = cute.make_rmem_tensor((n_rows,), cutlass.Int32)
        for r in cutlass.range_constexpr(n_rows):
            grow = m_block * BLOCK_M + tScS[r, 0][0]
            row_lim[r] = kv_len - s_q + grow // num_heads + 1
        row_max = cute.make_rmem_tensor((n_rows,), cutlass.Float32)
        row_sum = cute.make_rmem_tensor((n_rows,), cutlass.Float32)
        row_corr = cute.make_rmem_tensor((n_rows,), cutlass.Float32)
        row_max.fill(-cutlass.Float32.inf)
        row_sum.fill(0.0)

        if cutlass.const_expr(not producer):  # fp8_producer / tma_producer: the producer reads the page table
            pg_next2 = cutlass.Int32(0)
            pg_next3 = cutlass.Int32(0)
            if T > 2:
                pg_next2 = mPT[b, (n_start + 2) // blocks_per_page]
            if T > 3:
                pg_next3 = mPT[b, (n_start + 3) // blocks_per_page]
        every_tile = self.fp8_producer and ph0 is not None  # balanced fp8_producer: release every tile's parts
        if cutlass.const_expr(self.tma_producer):
            every_tile = ph0 is not None  # tma_producer (balanced only): likewise
        for p in cutlass.range(0, (T + 1) // 2, 1):
            ta = 2 * p  # local tile of WG0 (buffer 0); tb = ta + 1 of WG1 (buffer 1)
            parity = p % 2
            # mbarrier parities of this pair's waits on buffer 0 (tile a) and buffer 1 (tile b): p % 2 for
            # one item per CTA; balanced: the phases the column's earlier items completed on that buffer
            # come first (seesaw_item_phases), so an item after one with an odd tile count waits right
            par0 = parity
            par1 = parity
            if cutlass.const_expr(ph0 is not None):
                par0 = (ph0 + p) % 2
                par1 = (ph1 + p) % 2
            if cutlass.const_expr(producer):
                pg2 = pg3 = None  # the producer warpgroup reads the page table and prefetches into L2
            else:
                # cache pages of the next pair's tiles (tiles a+2, b+2), read one pair ahead so
                # that neither the L2 prefetch below nor the cp.asyncs after this pair's P V
                # WGMMAs wait for the page table (clamped: always a valid entry of this
                # request; unused when the tile does not exist)
                pg2 = pg_next2
                pg3 = pg_next3
                # tiles a+2, b+2 -> L2 now, so that their cp.asyncs later in this pair hit L2
                self.prefetch_pair_l2(mKV, tidx, pg2, pg3, n_start, ta, T, blocks_per_page)
                pg_next2 = mPT[b, (n_start + (ta + 4 if ta + 4 < T else T - 1)) // blocks_per_page]
                pg_next3 = mPT[b, (n_start + (ta + 5 if ta + 5 < T else T - 1)) // blocks_per_page]
            if cutlass.const_expr(self.is_fp8 and not self.fp8_producer):
                # fp8 KV: the same schedule, parts, mbarriers and named barriers as the
                # cp.async version; each part is ld.global'ed into registers *before* the
                # wait that frees its columns, then converted and stored.  Two stores move
                # under the converting warpgroup's own WGMMAs (WG0: tile b under S_a; WG1:
                # tile a+2 under P_b V_R); tests/test_seesaw_protocol.py models this order
                if wg == 0:
                    # issue S_a, then convert this pair's tile b part (columns 0..255 + RoPE,
                    # ld.global'ed during the previous pair) under those WGMMAs, then wait
                    self.qk(mma_s_first, mma_s, acc_S, tSrQ, tSrK, 0, SEESAW_QK_ORDER[0],
                            mbar + 0, mbar + 1, par0, False)
                    if p > 0 and ta + 1 < T:
                        self.store_part_fp8(r2s_wg, n_start + ta + 1, 1, SEESAW_LOAD_BLOCKS[0][1],
                                            kv_len, tKcK, tKsK, rRaw, mbar + 2)
                    warpgroup.wait_group(0)
                    self.softmax_publish(mma_o_rs, r2s_P, acc_S, tOrP, tScS, sP0, sScale, sMax,
                                         acc_O_mn, row_lim, row_max, row_sum, n_start + ta, 0,
                                         scale_log2, wg_tidx, is_quad_leader, BAR_P_OF[0], row_corr,
                                         True)
                    if ta + 2 < T:  # tile a+2, columns 0..255: in flight during P_a V_L
                        self.ldg_part_fp8(g2r_wg, thr_g2r_wg, mKV, pg2, n_start + ta + 2,
                                          SEESAW_LOAD_BLOCKS[0][0], blocks_per_page, kv_len, tKcK,
                                          rRaw)
                    self.pv_rs(mma_o_rs, acc_O, tOrP, tOrV, 0)
                    if ta + 2 < T:  # columns 0..255 of buffer 0 are free
                        self.store_part_fp8(r2s_wg, n_start + ta + 2, 0, SEESAW_LOAD_BLOCKS[0][0],
                                            kv_len, tKcK, tKsK, rRaw, mbar + 0)
                    if ta + 1 < T:
                        if ta + 3 < T:  # tile b+2, columns 0..255 + RoPE: staged in registers
                            # here, stored under the next pair's S_{a+2} WGMMAs (above)
                            self.ldg_part_fp8(g2r_wg, thr_g2r_wg, mKV, pg3, n_start + ta + 3,
                                              SEESAW_LOAD_BLOCKS[0][1], blocks_per_page, kv_len,
                                              tKcK, rRaw)
                        self.pv_remote(mma_o_ss, acc_O, acc_O_mn, tScS, sP1, sScale, sMax, tOrV,
                                       row_max, row_sum, 1, wg_tidx, BAR_P_OF[1], True)
                else:
                    if ta + 1 < T:
                        self.qk(mma_s_first, mma_s, acc_S, tSrQ, tSrK, 1, SEESAW_QK_ORDER[1],
                                mbar + 3, mbar + 2, par1)
                    self.pv_remote(mma_o_ss, acc_O, acc_O_mn, tScS, sP0, sScale, sMax, tOrV,
                                   row_max, row_sum, 0, wg_tidx, BAR_P_OF[0], False)
                    if ta + 1 < T:
                        self.softmax_publish(mma_o_rs, r2s_P, acc_S, tOrP, tScS, sP1, sScale, sMax,
                                             acc_O_mn, row_lim, row_max, row_sum, n_start + ta + 1, 1,
                                             scale_log2, wg_tidx, is_quad_leader, BAR_P_OF[1],
                                             row_corr, False)
                    if ta + 2 < T:  # tile a+2, columns 256..575: in flight under P_a V_R
                        self.ldg_part_fp8(g2r_wg, thr_g2r_wg, mKV, pg2, n_start + ta + 2,
                                          SEESAW_LOAD_BLOCKS[1][1], blocks_per_page, kv_len, tKcK,
                                          rRaw)
                    warpgroup.wait_group(0)  # P_a V_R done: columns 256..575 of buffer 0 free
                    if ta + 1 < T:
                        # O_R *= scale_b, issue P_b V_R (RS) and convert tile a+2's part under it. The issue and
                        # its wait stay in this one branch (ta + 2 < T implies ta + 1 < T): with the conversion
                        # in a branch of its own between them, ptxas saw a path that issued the WGMMAs and
                        # skipped the wait, put a warpgroup wait (WG.DP) in a divergent path for it and then
                        # serialized every WGMMA of the kernel (ptxas C7518: 88 WARPGROUP.DEPBAR, one per HGMMA,
                        # in every fp8 seesaw kernel up to mla-cute-dsl 0.2.15)
                        self.rescale_rows(acc_O_mn, row_corr, n_rows)
                        warpgroup.fence()
                        for k in cutlass.range_constexpr(cute.size(tOrP.shape[2])):
                            cute.gemm(mma_o_rs, acc_O, tOrP[None, None, k], tOrV[None, None, k, 1],
                                      acc_O)
                        warpgroup.commit_group()
                        if ta + 2 < T:
                            self.store_part_fp8(r2s_wg, n_start + ta + 2, 0, SEESAW_LOAD_BLOCKS[1][1],
                                                kv_len, tKcK, tKsK, rRaw, mbar + 1)
                        if ta + 3 < T:  # tile b+2, columns 256..511: in flight under P_b V_R
                            self.ldg_part_fp8(g2r_wg, thr_g2r_wg, mKV, pg3, n_start + ta + 3,
                                              SEESAW_LOAD_BLOCKS[1][0], blocks_per_page, kv_len,
                                              tKcK, rRaw)
                        warpgroup.wait_group(0)  # P_b V_R done: columns 256..511 of buffer 1 free
                        if ta + 3 < T:
                            self.store_part_fp8(r2s_wg, n_start + ta + 3, 1,
                                                SEESAW_LOAD_BLOCKS[1][0], kv_len, tKcK, tKsK, rRaw,
                                                mbar + 3)
            else:
                if wg == 0:
                    # S_a, softmax, publish P_a; O_L += P_a V_aL (RS)
                    self.qk(mma_s_first, mma_s, acc_S, tSrQ, tSrK, 0, SEESAW_QK_ORDER[0],
                            mbar + 0, mbar + 1, par0)
                    if cutlass.const_expr(tmq is not None):
                        # tma_producer, the item's last pair: WG0's last S (tile a) is waited: release sQ
                        if ta + 2 >= T:
                            if tmq.release:
                                cute.arch.mbarrier_arrive(tmq.empty)
                    self.softmax_publish(mma_o_rs, r2s_P, acc_S, tOrP, tScS, sP0, sScale, sMax,
                                         acc_O_mn, row_lim, row_max, row_sum, n_start + ta, 0,
                                         scale_log2, wg_tidx, is_quad_leader, BAR_P_OF[0], row_corr,
                                         True)
                    # tma=True, request's last tile: zero its V_L tail rows (zero_v_tail)
                    if cutlass.const_expr(self.tma):
                        self.zero_v_tail(tKcK, tKsK, n_start + ta, 0, 0, kv_len, mbar + 0, par0)
                    self.pv_rs(mma_o_rs, acc_O, tOrP, tOrV, 0)
                    # columns 0..255 of buffer 0 are free (only WG0 reads them): load tile a+2's
                    self.refill_part(kv_src, pg2, n_start, ta, 2, T, 0, SEESAW_LOAD_BLOCKS[0][0], blocks_per_page,
                                     kv_len, refill_bars, 0, every_tile)
                    if cutlass.const_expr(qpf is not None):
                        # q_prefetch, the item's last pair: the next item's tile 0 there instead
                        if ta + 2 >= T:
                            self.qpf_load_next(qpf, kv_src, 0, 0, T, blocks_per_page, mbar)
                    if ta + 1 < T:
                        # P_b from WG1: O_L = O_L * scale_b + sP_b V_bL (SS); tma=True: its V_L
                        # tail rows zeroed after the P_b barrier (S_b is done) if it is the last
                        self.pv_remote(mma_o_ss, acc_O, acc_O_mn, tScS, sP1, sScale, sMax, tOrV,
                                       row_max, row_sum, 1, wg_tidx, BAR_P_OF[1], True,
                                       (tKcK, tKsK, n_start + ta + 1, 1, 0, kv_len, mbar + 2, par1)
                                       if self.tma else None)
                        # columns 0..255 and P's block of buffer 1 are free: tile b+2's
                        self.refill_part(kv_src, pg3, n_start, ta, 3, T, 1, SEESAW_LOAD_BLOCKS[0][1],
                                         blocks_per_page, kv_len, refill_bars, 2, every_tile)
                        if cutlass.const_expr(qpf is not None):
                            # q_prefetch: the item's last tile of buffer 1: the next item's tile 1 there instead
                            if ta + 3 >= T:
                                self.qpf_load_next(qpf, kv_src, 0, 1, T, blocks_per_page, mbar)
                else:
                    if ta + 1 < T:
                        # S_b (runs while WG0 does softmax_a); wg1_other_first: mbar + 2 waited first (qk_wait_order)
                        self.qk(mma_s_first, mma_s, acc_S, tSrQ, tSrK, 1, SEESAW_QK_ORDER[1],
                                mbar + 3, mbar + 2, par1)
                    if cutlass.const_expr(tmq is not None):
                        # tma_producer, the item's last pair: WG1's last S (tile b, waited in its qk just above, or
                        # for an odd T the previous pair's) is done: release sQ
                        if ta + 2 >= T:
                            if tmq.release:
                                cute.arch.mbarrier_arrive(tmq.empty)
                    # P_a from WG0: O_R = O_R * scale_a + sP_a V_aR (SS), not waited yet;
                    # tma=True: V_R tail rows of tile a zeroed after the P_a barrier if last
                    self.pv_remote(mma_o_ss, acc_O, acc_O_mn, tScS, sP0, sScale, sMax, tOrV,
                                   row_max, row_sum, 0, wg_tidx, BAR_P_OF[0], False,
                                   (tKcK, tKsK, n_start + ta, 0, 1, kv_len, mbar + 1, par0)
                                   if self.tma else None)
                    if cutlass.const_expr(qpf is not None):
                        # q_prefetch, the item's last pair: WG0's last S (tile a) was waited before its P_a arrive
                        # (synced on in pv_remote), WG1's own last S in its qk: sQ is free, the next item's Q
                        if ta + 2 >= T:
                            self.qpf_issue_q(qpf, m_block)
                    if ta + 1 < T:
                        # softmax_b under the P_a V WGMMAs; O_R *= scale_b needs them done
                        self.softmax_publish(mma_o_rs, r2s_P, acc_S, tOrP, tScS, sP1, sScale, sMax,
                                             acc_O_mn, row_lim, row_max, row_sum, n_start + ta + 1, 1,
                                             scale_log2, wg_tidx, is_quad_leader, BAR_P_OF[1], row_corr,
                                             False)
                    warpgroup.wait_group(0)
                    # columns 256..575 of buffer 0 are free: tile a+2's
                    self.refill_part(kv_src, pg2, n_start, ta, 2, T, 0, SEESAW_LOAD_BLOCKS[1][1], blocks_per_page,
                                     kv_len, refill_bars, 1, every_tile)
                    if cutlass.const_expr(qpf is not None):
                        # q_prefetch, the item's last pair: the next item's tile 0 there instead
                        if ta + 2 >= T:
                            self.qpf_load_next(qpf, kv_src, 1, 0, T, blocks_per_page, mbar)
                    if ta + 1 < T:
                        # tma=True, request's last tile: zero its V_R tail rows (S_b is done)
                        if cutlass.const_expr(self.tma):
                            self.zero_v_tail(tKcK, tKsK, n_start + ta + 1, 1, 1, kv_len, mbar + 3,
                                             par1)
                        self.rescale_rows(acc_O_mn, row_corr, n_rows)
                        self.pv_rs(mma_o_rs, acc_O, tOrP, tOrV, 1)
                        # columns 256..511 of buffer 1 are free: tile b+2's
                        self.refill_part(kv_src, pg3, n_start, ta, 3, T, 1, SEESAW_LOAD_BLOCKS[1][0],
                                         blocks_per_page, kv_len, refill_bars, 3, every_tile)

                        if cutlass.const_expr(qpf is not None):
                            # q_prefetch: the item's last tile of buffer 1: the next item's tile 1 there instead
                            if ta + 3 >= T:
                                self.qpf_load_next(qpf, kv_src, 1, 1, T, blocks_per_page, mbar)

        # fp8_producer: Q, the only group, was waited; q_prefetch: no commit group (KV parts observed by mbarriers)
        if cutlass.const_expr(not producer and qpf is None):
            cute.arch.cp_async_wait_group(0)
        if cutlass.const_expr(tmq is not None):
            # tma_producer, an item without tiles: no S read sQ; release it for the next request's Q all the same
            if T == 0:
                if tmq.release:
                    cute.arch.mbarrier_arrive(tmq.empty)

        # ---------------- epilogue ----------------
        # both warpgroups hold the final running max; the row sum is the sum of the two
        for r in cutlass.range_constexpr(n_rows):
            s_own = _quad_sum(row_sum[r])
            row_sum[r] = s_own
            if is_quad_leader:
                sL[tScS[r, 0][0], wg] = s_own
        self.item_barrier()
        row_scale = cute.make_rmem_tensor((n_rows,), cutlass.Float32)
        row_lse = cute.make_rmem_tensor((n_rows,), cutlass.Float32)
        for r in cutlass.range_constexpr(n_rows):
            s = row_sum[r] + sL[tScS[r, 0][0], 1 - wg]
            ok = s > 0.0
            row_scale[r] = v_scale / s if ok else 0.0
            row_lse[r] = (
                row_max[r] * scale_ln + cute.math.log(s, fastmath=False)
                if ok
                else -cutlass.Float32.inf
            )

        cO = cute.make_identity_tensor((BLOCK_M, D_V_HALF))
        tOcO = _acc_mn_view(thr_o.partition_C(cO))
        lse_writer = is_quad_leader
        if wg != 0:
            lse_writer = False
        self.store_epilogue(mO, mLSE, mOp, mLSEp, b, slot, acc_O_mn, row_scale, row_lse, tOcO, thr_o, m_block,
                            wg, R, lane, lse_writer)

    # ---------------------------------------------------------------- fp8_producer=True (fp8 KV)
    @cute.jit
    def kernel_fp8p(
        self,
        mQ: cute.Tensor, mKV: cute.Tensor, mPT: cute.Tensor, mLens: cute.Tensor,
        mO: cute.Tensor, mLSE: cute.Tensor, mWork: cute.Tensor, mOp: cute.Tensor, mLSEp: cute.Tensor,
        scale_log2: cutlass.Float32, scale_ln: cutlass.Float32, v_scale: cutlass.Float32,
        s_q: cutlass.Int32, num_heads: cutlass.Int32,
        sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout,
        sP_layout: cute.ComposedLayout, sV_layout: cute.ComposedLayout,
        g2s: cute.TiledCopy, g2s_wg: cute.TiledCopy, r2s_P: cute.TiledCopy,
        mma_s: cute.TiledMma, mma_s_first: cute.TiledMma,
        mma_o_rs: cute.TiledMma, mma_o_ss: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
        tidx: cutlass.Int32, m_block: cutlass.Int32, wi: cutlass.Int32, wg: cutlass.Int32,
        wg_tidx: cutlass.Int32, lane: cutlass.Int32, b: cutlass.Int32,
    ):
        """fp8_producer=True, one work item (request b >= 0): 384 threads.  8 mbarriers, count 128 each:
        full[i] = mbar + i (i = 2 * buffer + part, the parts of ``SEESAW_LOAD_BLOCKS``: part w = the columns
        warpgroup w loads in the other kernels), arrived by the producer's 128 threads after their st.shared
        and async-proxy fence; empty[i] = mbar + 4 + i, arrived by math warpgroup w = i % 2 (the last reader of
        those columns: the other kernels' loader of the part) once its WGMMAs on them completed.  Per buffer
        both count one phase per tile of that buffer: the producer waits empty[i] with parity (p - 1) % 2
        before writing pair p >= 1's tile, the math warpgroups wait full[i] with parity p % 2 as in the other
        kernels and arrive empty[i] exactly where those issue the load of tile +2 (same conditions), so every
        producer wait has its arrive and every math wait its fill, for any tile count T >= 0."""
        kv_start = mWork[wi, 1]
        kv_end = mWork[wi, 2]
        slot = mWork[wi, 3]
        kv_len = mLens[b]
        R = mQ.shape[1]
        blocks_per_page = mKV.shape[1] // BLOCK_N
        n_start = kv_start // BLOCK_N
        n_end = (kv_end + BLOCK_N - 1) // BLOCK_N
        T = n_end - n_start  # tiles of this item (>= 0); local tile i is KV block n_start + i

        smem = self.seesaw_smem(SharedStorage, sQ_layout, sK_layout, sP_layout, sV_layout)
        mbar = smem[8]
        if tidx == 0:
            for i in cutlass.range_constexpr(8):
                cute.arch.mbarrier_init(mbar + i, WG_THREADS)
        cute.arch.mbarrier_init_fence()
        cute.arch.barrier()
        if wg < 2:
            cute.arch.setmaxregister_increase(self.fp8p_regs[0])
            self.seesaw_item(
                mQ, mKV, mPT, mO, mLSE, mOp, mLSEp, scale_log2, scale_ln, v_scale, s_q, num_heads,
                g2s, g2s_wg, r2s_P, mma_s, mma_s_first, mma_o_rs, mma_o_ss, None, None, smem,
                tidx, m_block, wg, wg_tidx, lane, b, slot, kv_len, R, blocks_per_page, n_start, T,
                None, None, None,
            )
        else:
            cute.arch.setmaxregister_decrease(self.fp8p_regs[1])
            self.fp8p_produce_item(mKV, mPT, g2s_wg, smem[1], mbar, tidx - 2 * WG_THREADS, b, kv_len,
                                   blocks_per_page, n_start, T)

    @cute.jit
    def kernel_fp8p_balanced(
        self,
        mQ: cute.Tensor, mKV: cute.Tensor, mPT: cute.Tensor, mLens: cute.Tensor,
        mO: cute.Tensor, mLSE: cute.Tensor, mWork: cute.Tensor, mOp: cute.Tensor, mLSEp: cute.Tensor,
        scale_log2: cutlass.Float32, scale_ln: cutlass.Float32, v_scale: cutlass.Float32,
        s_q: cutlass.Int32, num_heads: cutlass.Int32,
        sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout,
        sP_layout: cute.ComposedLayout, sV_layout: cute.ComposedLayout,
        g2s: cute.TiledCopy, g2s_wg: cute.TiledCopy, r2s_P: cute.TiledCopy,
        mma_s: cute.TiledMma, mma_s_first: cute.TiledMma,
        mma_o_rs: cute.TiledMma, mma_o_ss: cute.TiledMma,
        SharedStorage: cutlass.Constexpr, mRanges: cute.Tensor,
        tidx: cutlass.Int32, m_block: cutlass.Int32, wi: cutlass.Int32, wg: cutlass.Int32,
        wg_tidx: cutlass.Int32, lane: cutlass.Int32,
    ):
        """fp8_producer=True with balanced=True (branch fp8-balanced-producer; GPU-verified): CTA
        (m_block, column wi), 384 threads, the 8 mbarriers of ``kernel_fp8p`` set up once.  The math warpgroups
        (``seesaw_column``) and the producer each walk work rows mRanges[wi] .. mRanges[wi + 1] - 1 (rows with b < 0 skipped by
        both), computing the same T per item from mWork, and each keeps its own copy of the per-buffer phase
        counts ph0 / ph1 (``seesaw_item_phases``: ceil(T / 2) / floor(T / 2) per item; T = 0 adds nothing and
        neither side waits).  Every tile of buffer j completes one phase on full[2j], full[2j+1] (the producer's
        128 arrives each) and one on empty[2j], empty[2j+1] (the math side releases every tile's parts in
        balanced), so both counts agree by construction; the producer's g-th tile of a buffer in the column waits
        on empty phase g - 1 (none for g = 0).  So the producer runs into the next item's tiles 0 / 1 as soon as
        the previous item's last readers released those parts (its epilogue reads no shared K memory).  Q: the
        math warpgroups reload / reconvert sQ when the request changes (``seesaw_item``'s q_load), after the
        previous item's epilogue BAR_MATH (all their S WGMMAs waited), and BAR_MATH before the first S."""
        R = mQ.shape[1]
        blocks_per_page = mKV.shape[1] // BLOCK_N
        smem = self.seesaw_smem(SharedStorage, sQ_layout, sK_layout, sP_layout, sV_layout)
        mbar = smem[8]
        if tidx == 0:
            for i in cutlass.range_constexpr(8):
                cute.arch.mbarrier_init(mbar + i, WG_THREADS)
        cute.arch.mbarrier_init_fence()
        cute.arch.barrier()
        ph0 = cutlass.Int32(0)  # phases completed so far on buffer 0's full / empty mbarriers (tiles 0, 2, ...)
        ph1 = cutlass.Int32(0)  # ... on buffer 1's (tiles 1, 3, ...)
        if wg < 2:
            cute.arch.setmaxregister_increase(self.fp8p_regs[0])
            self.seesaw_column(
                mQ, mKV, mPT, mLens, mO, mLSE, mWork, mOp, mLSEp, scale_log2, scale_ln, v_scale, s_q, num_heads,
                g2s, g2s_wg, r2s_P, mma_s, mma_s_first, mma_o_rs, mma_o_ss, None, None, smem, mRanges,
                tidx, m_block, wi, wg, wg_tidx, lane, R, blocks_per_page, ph0, ph1,
            )
        else:
            cute.arch.setmaxregister_decrease(self.fp8p_regs[1])
            for it in cutlass.range(mRanges[wi], mRanges[wi + 1], 1):
                b = mWork[it, 0]
                if b >= 0:
                    kv_len = mLens[b]
                    n_start = mWork[it, 1] // BLOCK_N
                    T = (mWork[it, 2] + BLOCK_N - 1) // BLOCK_N - n_start
                    self.fp8p_produce_item(mKV, mPT, g2s_wg, smem[1], mbar, tidx - 2 * WG_THREADS, b, kv_len,
                                           blocks_per_page, n_start, T, ph0, ph1)
                    ph0 = ph0 + (T + 1) // 2
                    ph1 = ph1 + T // 2

    @cute.jit
    def fp8p_produce_part(
        self, g2r: cute.TiledCopy, thr_g2r, r2s: cute.TiledCopy, mKV: cute.Tensor, page: cutlass.Int32,
        n: cutlass.Int32, stage: cutlass.Constexpr, blocks: cutlass.Constexpr, blocks_per_page: cutlass.Int32,
        kv_len: cutlass.Int32, tKcK: cute.Tensor, tKsK: cute.Tensor, rRaw: cute.Tensor, empty_ptr, full_ptr,
        wait_empty, parity: cutlass.Int32,
    ):
        """The producer's one part: ld.global the fp8 bytes (touches no smem, so issued before the wait), wait
        for the part's columns to be free (``wait_empty``: not for a buffer's first tile), then cvt (rows >=
        kv_len selected to 0) -> st.shared -> fence.proxy.async -> arrive on the part's full mbarrier
        (``store_part_fp8``)."""
        self.ldg_part_fp8(g2r, thr_g2r, mKV, page, n, blocks, blocks_per_page, kv_len, tKcK, rRaw)
        if wait_empty:
            cute.arch.mbarrier_wait(empty_ptr, parity)
        self.store_part_fp8(r2s, n, stage, blocks, kv_len, tKcK, tKsK, rRaw, full_ptr)

    def fp8p_produce_item(self, mKV, mPT, g2s_wg, sK, mbar, ptid, b, kv_len, blocks_per_page, n_start, T,
                          ph0=None, ph1=None):
        """The producer's side of one work item (a plain Python dispatcher, traced inline from ``kernel_fp8p`` /
        ``kernel_fp8p_balanced``): the register ring (``fp8p_producer_ring``) when ``fp8p_ring`` is set, else the
        one-part producer (``fp8p_producer``, whose generated code is unchanged by this dispatcher)."""
        if self.fp8p_ring:
            self.fp8p_producer_ring(mKV, mPT, sK, mbar, ptid, b, kv_len, blocks_per_page, n_start, T, ph0, ph1)
        else:
            self.fp8p_producer(mKV, mPT, g2s_wg, sK, mbar, ptid, b, kv_len, blocks_per_page, n_start, T, ph0, ph1)

    def fp8p_ring_src(self, tKgK0: cute.Tensor, mKV: cute.Tensor, page, blk):
        """The producer thread's gmem partition (CPY, passes, 9) of the 64-token block ``blk`` of cache page ``page``
        (plain Python, traced inline): ``tKgK0`` (the thread's partition of page 0's first block, built once per
        item) moved by the block's element offset, so the per-thread part of the address is not recomputed per
        tile (it kept a register busy at every pair's start, where the ring is fullest)."""
        off = cute.crd2idx((page, blk * BLOCK_N, 0), mKV.layout)
        return cute.make_tensor(tKgK0.iterator + off, tKgK0.layout)

    @cute.jit
    def fp8p_ring_prefetch(self, mKV: cute.Tensor, page: cutlass.Int32, blk: cutlass.Int32):
        """``prefetch_tile_l2`` of the 64-token block ``blk`` of cache page ``page`` (no division by the blocks per
        page: the ring producer tracks (page-table column, block in page) per tile)."""
        if cutlass.const_expr(_nvw is not None):
            gK = cute.local_tile(mKV[page, None, None], (BLOCK_N, D_QK), (blk, 0))
            _nvw.cp_async_bulk_prefetch(gK.iterator, BLOCK_N * D_QK * (self.kv_dtype.width // 8))

    @cute.jit
    def fp8p_ring_issue(
        self, g2r: cute.TiledCopy, tKgK: cute.Tensor, tKcK: cute.Tensor, valid: cutlass.Int32,
        iss: cutlass.Constexpr, rRing: cute.Tensor, sStage, cpa,
    ):
        """One chunk (``fp8p_ring.Issue``): its ld.global (16 fp8, 128 bit) into ring slot ``iss.slot``, or, for a
        row >= ``valid`` (past kv_len, or any row of a tile that does not exist: valid 0), zeros in the slot (e4m3
        +0: the conversion then needs no select; page tails may hold NaN).  Touches no shared memory: runs ahead of
        the empty waits.  A staged chunk (``iss.smem``, fp8p_stage): a 16-byte cp.async into this thread's staging
        slot ``iss.slot`` of ``sStage`` instead (zeros by st.shared for rows >= valid), then one commit group per
        staged issue (empty when nothing was copied), which ``fp8p_ring_convert`` counts on."""
        m = iss.m
        # row of pass m = row of pass 0 + 32 m: one per-thread row register, the limit uniform
        row_ok = tKcK[0, 0, 0][0] < valid - (tKcK[0, m, 0][0] - tKcK[0, 0, 0][0])
        if cutlass.const_expr(iss.smem):
            if row_ok:
                # the partition's (16, 1) value mode as the 16 contiguous bytes it is (the cp.async atom's shape)
                src = tKgK[None, m, iss.blk]
                cute.copy(cpa, cute.make_tensor(src.iterator, cute.make_layout(cute.size(src))),
                          sStage[None, iss.slot])
            else:
                sStage[None, iss.slot].fill(0)
            cute.arch.cp_async_commit_group()
        else:
            if row_ok:
                cute.copy(g2r, tKgK[None, m, iss.blk], rRing[None, iss.slot])
            else:
                rRing[None, iss.slot].fill(0)

    @cute.jit
    def fp8p_ring_convert(
        self, r2s: cute.TiledCopy, tKsK: cute.Tensor, rRing: cute.Tensor, sStage, st: cutlass.Constexpr,
    ):
        """The chunk of step ``st`` (``fp8p_ring.Step``): ring slot ``st.slot`` (or, staged, this thread's staging
        slot after cp.async.wait_group(``st.wait``): the staged chunks issued after it may stay in flight; the
        thread reads back only bytes it copied itself, so no barrier) -> fp16 (8 x cvt.rn.f16x2.e4m3x2) ->
        sK[:, :, stage] pass m, block blk (two 128-bit st.shared, each one 16-byte swizzle unit)."""
        c = st.chunk
        rH = cute.make_rmem_tensor_like(tKsK[None, c.m, c.blk, c.stage], self.mma_dtype)
        if cutlass.const_expr(st.smem):
            cute.arch.cp_async_wait_group(st.wait)
            rRaw = cute.make_rmem_tensor_like(sStage[None, st.slot])
            rRaw.store(sStage[None, st.slot].load())
            rH.store(rRaw.load().to(self.mma_dtype))
        else:
            rH.store(rRing[None, st.slot].load().to(self.mma_dtype))
        cute.copy(r2s, rH, tKsK[None, c.m, c.blk, c.stage])

    @cute.jit
    def fp8p_producer_ring(
        self, mKV: cute.Tensor, mPT: cute.Tensor, sK: cute.Tensor, mbar, ptid: cutlass.Int32, b: cutlass.Int32,
        kv_len: cutlass.Int32, blocks_per_page: cutlass.Int32, n_start: cutlass.Int32, T: cutlass.Int32,
        ph0=None, ph1=None,
    ):
        """``fp8p_producer`` with a register ring of ``fp8p_ring`` chunk slots (fp8p_ring.py): the same parts in
        the same order, the same empty waits (parities, ``ph0`` / ``ph1`` for balanced) and full arrives, the same
        page-table reads one pair ahead and L2 prefetch; but every chunk's ld.global is issued ``fp8p_ring - 1``
        chunks ahead of its conversion (the prologue issues the item's first ones, the last steps of a pair the
        next pair's tile a + 2), so the loads stay in flight across the empty waits and the conversions.  Row
        limits fold tile existence in (valid 0: nothing loaded, slot zeroed, never converted), so the look-ahead
        issues need no branches."""
        g2r, r2s = self._fp8p_copies()
        thr_g2r = g2r.get_slice(ptid)
        tKcK = thr_g2r.partition_S(cute.make_identity_tensor((BLOCK_N, D_QK)))  # (CPY, passes, 9): (row, col)
        tKgK0 = thr_g2r.partition_S(cute.local_tile(mKV[0, None, None], (BLOCK_N, D_QK), (0, 0)))
        tKsK = r2s.get_slice(ptid).partition_D(sK)  # (CPY, passes, 9, STAGES)
        rRing = cute.make_rmem_tensor((cute.size(tKcK.shape[0]), self.fp8p_ring), cutlass.Float8E4M3FN)
        # wg1_other_first (a Python bool, read at trace time): WG1's qk waits full[2] first (qk_wait_order), so tile
        # b's parts are converted 2 then 3 (fp8p_ring.pair_parts); False gives the default schedule, the same objects
        prologue, steps, rotation = _ring.ring_schedule(self.fp8p_ring, SEESAW_LOAD_BLOCKS, self.fp8p_stage,
                                                        wg1_other_first=self.wg1_other_first)
        full = mbar
        empty = mbar + 4
        sStage = None  # fp8p_stage: this thread's 16 bytes of each staging slot (after the 8 mbarriers)
        cpa = None
        if cutlass.const_expr(self.fp8p_stage):
            e = FP8P_ELEMS_PER_COPY
            base = cute.recast_ptr(mbar + self._num_mbars(), dtype=cutlass.Float8E4M3FN)
            # (16 bytes, thread, slot), sliced at this thread: its offset ptid * 16 keeps the field's 16-byte
            # alignment, which cp.async's 128-bit copies need
            sAll = cute.make_tensor(base, cute.make_layout((e, WG_THREADS, self.fp8p_stage),
                                                           stride=(1, e, _ring.STAGE_SLOT_BYTES)))
            sStage = sAll[None, ptid, None]
            cpa = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL),
                                      cutlass.Float8E4M3FN, num_bits_per_copy=8 * e)
        # the L2 prefetch: one elected lane of the producer's first warp (a warp-uniform test: the thread-index test
        # of fp8p_producer kept a vector register busy at each pair's start, where the ring is fullest)
        pf_warp = cute.arch.make_warp_uniform(ptid // 32) == 0
        # tiles by (page-table column q, 64-token block r in its page), advanced one tile at a time without a
        # division (one divmod per item); pages read one pair ahead, only for tiles of the item
        bpp = blocks_per_page
        q_a = n_start // bpp
        r_a = n_start % bpp
        q_b = q_a + 1 if r_a + 1 == bpp else q_a
        r_b = 0 if r_a + 1 == bpp else r_a + 1
        pg_a = cutlass.Int32(0)
        pg_b = cutlass.Int32(0)
        if T > 0:
            pg_a = mPT[b, q_a]
            src0 = self.fp8p_ring_src(tKgK0, mKV, pg_a, r_a)
            valid0 = kv_len - n_start * BLOCK_N
            for c in cutlass.range_constexpr(len(prologue)):  # chunks 0 .. R - 2 of tile 0 (issue offset 0)
                self.fp8p_ring_issue(g2r, src0, tKcK, valid0, prologue[c], rRing, sStage, cpa)
        if T > 1:
            pg_b = mPT[b, q_b]
        for p in cutlass.range(0, (T + 1) // 2, 1):
            ta = 2 * p
            par0 = (p + 1) % 2  # phase p - 1 of the empty barriers: tile ta - 2 / tb - 2 released
            par1 = par0
            wait0 = p > 0
            wait1 = p > 0
            if cutlass.const_expr(ph0 is not None):
                # balanced: the buffer's (ph + p)-th tile of the column waits on empty phase ph + p - 1
                par0 = (ph0 + p + 1) % 2
                par1 = (ph1 + p + 1) % 2
                wait0 = ph0 + p > 0
                wait1 = ph1 + p > 0
            # the next pair's tiles a + 2, a + 3 (pages stay those of a / b past the item: never loaded from)
            q2 = q_b + 1 if r_b + 1 == bpp else q_b
            r2 = 0 if r_b + 1 == bpp else r_b + 1
            q3 = q2 + 1 if r2 + 1 == bpp else q2
            r3 = 0 if r2 + 1 == bpp else r2 + 1
            pn2 = pg_a
            pn3 = pg_b
            if ta + 2 < T:
                pn2 = mPT[b, q2]
            if ta + 3 < T:
                pn3 = mPT[b, q3]
            if cutlass.const_expr(self.l2_prefetch):
                if pf_warp:
                    with cute.arch.elect_one():
                        if ta + 2 < T:
                            self.fp8p_ring_prefetch(mKV, pn2, r2)
                        if ta + 3 < T:
                            self.fp8p_ring_prefetch(mKV, pn3, r3)
            # issue sources by tile offset (0: a, 1: b, 2: a + 2) and their row limits (0 for a missing tile); each
            # half of the pair issues into two tiles only (a / b, then b / a + 2), so only two are built at a time
            src_b = self.fp8p_ring_src(tKgK0, mKV, pg_b, r_b)
            valid_b = kv_len - (n_start + ta + 1) * BLOCK_N if ta + 1 < T else 0
            waits = (wait0, wait1)
            pars = (par0, par1)
            # tile a's 18 chunks (their look-ahead issues reach into tile b)
            srcs = {0: self.fp8p_ring_src(tKgK0, mKV, pg_a, r_a), 1: src_b}
            valids = {0: kv_len - (n_start + ta) * BLOCK_N, 1: valid_b}
            for j in cutlass.range_constexpr(_ring.PAIR_CHUNKS // 2):
                st = steps[j]
                self.fp8p_ring_step(g2r, r2s, srcs[st.issue.off], valids[st.issue.off], tKcK, tKsK, rRing, sStage,
                                    cpa, st, waits[st.chunk.stage], pars[st.chunk.stage], empty, full)
            if ta + 1 < T:
                # tile b's 18 chunks (their look-ahead issues reach into the next pair's tile a + 2)
                srcs_b = {1: src_b, 2: self.fp8p_ring_src(tKgK0, mKV, pn2, r2)}
                valids_b = {1: valid_b, 2: kv_len - (n_start + ta + 2) * BLOCK_N if ta + 2 < T else 0}
                for j in cutlass.range_constexpr(_ring.PAIR_CHUNKS // 2, _ring.PAIR_CHUNKS):
                    st = steps[j]
                    self.fp8p_ring_step(g2r, r2s, srcs_b[st.issue.off], valids_b[st.issue.off], tKcK, tKsK, rRing,
                                        sStage, cpa, st, waits[st.chunk.stage], pars[st.chunk.stage], empty, full)
                if cutlass.const_expr(any(r != s for s, r in enumerate(rotation))):
                    # the next pair's chunk c sits in slot (36 + c) % R: rename to c % R (fp8p_ring.ring_schedule)
                    held = [rRing[None, r].load() for r in rotation]
                    for s in cutlass.range_constexpr(len(rotation)):
                        rRing[None, s].store(held[s])
            pg_a = pn2
            pg_b = pn3
            r_a = r2
            q_b = q3
            r_b = r3

    @cute.jit
    def fp8p_ring_step(
        self, g2r: cute.TiledCopy, r2s: cute.TiledCopy, src: cute.Tensor, valid: cutlass.Int32, tKcK: cute.Tensor,
        tKsK: cute.Tensor, rRing: cute.Tensor, sStage, cpa, st: cutlass.Constexpr, wait_empty, parity, empty, full,
    ):
        """One step of the ring (``fp8p_ring.Step``): issue the look-ahead chunk, then, for a part's first chunk,
        wait for the part's empty barrier (``wait_empty``: not for a buffer's first tile), convert + store the
        chunk, and after a part's last chunk fence.proxy.async + arrive on its full barrier (count 128)."""
        self.fp8p_ring_issue(g2r, src, tKcK, valid, st.issue, rRing, sStage, cpa)
        if cutlass.const_expr(st.chunk.first):
            if wait_empty:
                cute.arch.mbarrier_wait(empty + st.chunk.mbar, parity)
        self.fp8p_ring_convert(r2s, tKsK, rRing, sStage, st)
        if cutlass.const_expr(st.chunk.last):
            cute.arch.fence_view_async_shared()
            cute.arch.mbarrier_arrive(full + st.chunk.mbar)

    @cute.jit
    def fp8p_producer(
        self, mKV: cute.Tensor, mPT: cute.Tensor, g2s_wg: cute.TiledCopy, sK: cute.Tensor, mbar,
        ptid: cutlass.Int32, b: cutlass.Int32, kv_len: cutlass.Int32, blocks_per_page: cutlass.Int32,
        n_start: cutlass.Int32, T: cutlass.Int32, ph0=None, ph1=None,
    ):
        """Warpgroup 2 (``ptid`` 0..127): every part of local tiles 0 .. T - 1 in the math side's wait order,
        tile a = 2p: full[0] (blocks 0-3) then full[1] (blocks 4-8); tile b = 2p + 1: full[3] (blocks 4-7) then
        full[2] (blocks 0-3 + RoPE).  Pair p >= 1 first waits on the matching empty barrier (parity (p - 1) % 2:
        its tile - 2 released).  The page table is read one pair ahead; with l2_prefetch ptid 0 prefetches the
        next pair's tiles into L2 before this pair's loads.  ``ph0``, ``ph1`` (balanced only; None: one item per
        CTA): the phases the column's earlier items completed on buffer 0's / buffer 1's full and empty mbarriers
        (``seesaw_item_phases``); the g-th tile of a buffer in the column (g = ph + p) waits on empty phase
        g - 1 (parity (g - 1) % 2) unless g = 0 (the buffer's first use in the column: nobody released it)."""
        g2r_wg, r2s_wg = self._fp8p_copies()
        thr_g2r_wg = g2r_wg.get_slice(ptid)
        cKV = cute.make_identity_tensor((BLOCK_N, D_QK))
        tKcK = thr_g2r_wg.partition_S(cKV)  # (CPY, passes, 9): the (row, col) of g2r's / r2s's elements
        tKsK = r2s_wg.get_slice(ptid).partition_D(sK)  # (CPY, passes, 9, STAGES)
        rRaw = cute.make_rmem_tensor((cute.size(tKcK.shape[0]), cute.size(tKcK.shape[1]), 5), cutlass.Float8E4M3FN)
        full = mbar
        empty = mbar + 4
        pg_a = cutlass.Int32(0)
        pg_b = cutlass.Int32(0)
        if T > 0:
            pg_a = mPT[b, n_start // blocks_per_page]
        if T > 1:
            pg_b = mPT[b, (n_start + 1) // blocks_per_page]
        for p in cutlass.range(0, (T + 1) // 2, 1):
            ta = 2 * p
            par = (p + 1) % 2  # phase p - 1 of the empty barriers: tile ta - 2 / tb - 2 released
            par0 = par
            par1 = par
            wait0 = p > 0
            wait1 = p > 0
            if cutlass.const_expr(ph0 is not None):
                # balanced: the buffer's (ph + p)-th tile of the column waits on empty phase ph + p - 1
                par0 = (ph0 + p + 1) % 2
                par1 = (ph1 + p + 1) % 2
                wait0 = ph0 + p > 0
                wait1 = ph1 + p > 0
            # the next pair's pages (clamped to a valid entry of this request; unused past T)
            pn2 = mPT[b, (n_start + (ta + 2 if ta + 2 < T else T - 1)) // blocks_per_page]
            pn3 = mPT[b, (n_start + (ta + 3 if ta + 3 < T else T - 1)) // blocks_per_page]
            self.prefetch_pair_l2(mKV, ptid, pn2, pn3, n_start, ta, T, blocks_per_page)
            # tile a (buffer 0): WG0's S waits full[0] then full[1]
            self.fp8p_produce_part(g2r_wg, thr_g2r_wg, r2s_wg, mKV, pg_a, n_start + ta, 0, SEESAW_LOAD_BLOCKS[0][0],
                                   blocks_per_page, kv_len, tKcK, tKsK, rRaw, empty + 0, full + 0, wait0, par0)
            self.fp8p_produce_part(g2r_wg, thr_g2r_wg, r2s_wg, mKV, pg_a, n_start + ta, 0, SEESAW_LOAD_BLOCKS[1][1],
                                   blocks_per_page, kv_len, tKcK, tKsK, rRaw, empty + 1, full + 1, wait0, par0)
            if ta + 1 < T:
                # tile b (buffer 1): WG1's S waits full[3] then full[2]
                self.fp8p_produce_part(g2r_wg, thr_g2r_wg, r2s_wg, mKV, pg_b, n_start + ta + 1, 1,
                                       SEESAW_LOAD_BLOCKS[1][0], blocks_per_page, kv_len, tKcK, tKsK, rRaw,
                                       empty + 3, full + 3, wait1, par1)
                self.fp8p_produce_part(g2r_wg, thr_g2r_wg, r2s_wg, mKV, pg_b, n_start + ta + 1, 1,
                                       SEESAW_LOAD_BLOCKS[0][1], blocks_per_page, kv_len, tKcK, tKsK, rRaw,
                                       empty + 2, full + 2, wait1, par1)
            pg_a = pn2
            pg_b = pn3


    # ---------------------------------------------------------------- tma_producer=True (16-bit KV, TMA, balanced)
    @cute.jit
    def kernel_tmap_balanced(
        self,
        mQ: cute.Tensor, mKV: cute.Tensor, mPT: cute.Tensor, mLens: cute.Tensor,
        mO: cute.Tensor, mLSE: cute.Tensor, mWork: cute.Tensor, mOp: cute.Tensor, mLSEp: cute.Tensor,
        scale_log2: cutlass.Float32, scale_ln: cutlass.Float32, v_scale: cutlass.Float32,
        s_q: cutlass.Int32, num_heads: cutlass.Int32,
        sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout,
        sP_layout: cute.ComposedLayout, sV_layout: cute.ComposedLayout,
        g2s: cute.TiledCopy, g2s_wg: cute.TiledCopy, r2s_P: cute.TiledCopy,
        mma_s: cute.TiledMma, mma_s_first: cute.TiledMma,
        mma_o_rs: cute.TiledMma, mma_o_ss: cute.TiledMma,
        SharedStorage: cutlass.Constexpr, tma_atom: cute.CopyAtom, mKV_tma: cute.Tensor, mRanges: cute.Tensor,
        q_tma_atom: cute.CopyAtom, mQ_tma: cute.Tensor,
        tidx: cutlass.Int32, m_block: cutlass.Int32, wi: cutlass.Int32, wg: cutlass.Int32,
        wg_tidx: cutlass.Int32, lane: cutlass.Int32,
    ):
        """tma_producer=True (16-bit KV, tma=True, balanced=True; branch tma-producer, GPU-verified): CTA (m_block,
        column wi), 384 threads, 10 mbarriers set up once: full[i] = mbar + i (count 1: the producer's
        arrive.expect_tx, the part's TMA bytes complete the phase; i = 2 * buffer + part as ``SEESAW_LOAD_BLOCKS``),
        empty[i] = mbar + 4 + i (count 128: math warpgroup i % 2, the part's last reader, in ``refill_part``), Q full
        (TMAP_Q_FULL, count 1) and Q empty (TMAP_Q_EMPTY, count 256).  Math warpgroups 0 / 1: ``seesaw_column_tmap``
        (fp8_producer's balanced stream, Q waited instead of loaded).  Warpgroup 2: setmaxnreg.dec, then its first warp
        runs ``tmap_producer`` and the other three exit.  Why: the balanced TMA kernel drains its KV pipeline at every
        item boundary (next tiles 0 / 1 and Q issued only after the epilogue's CTA barrier: ~5 us per boundary fitted
        on the H200), the producer issues them as soon as the previous item's last readers released the buffers and
        sQ."""
        R = mQ.shape[1]
        blocks_per_page = mKV.shape[1] // BLOCK_N
        smem = self.seesaw_smem(SharedStorage, sQ_layout, sK_layout, sP_layout, sV_layout)
        mbar = smem[8]
        if tidx == 0:
            for i in cutlass.range_constexpr(4):
                cute.arch.mbarrier_init(mbar + i, self._mbar_count())  # full: one arrive.expect_tx
            for i in cutlass.range_constexpr(4):
                cute.arch.mbarrier_init(mbar + 4 + i, WG_THREADS)  # empty: the releasing math warpgroup
            cute.arch.mbarrier_init(mbar + TMAP_Q_FULL, 1)
            cute.arch.mbarrier_init(mbar + TMAP_Q_EMPTY, NUM_THREADS)
        cute.arch.mbarrier_init_fence()
        cute.arch.barrier()
        if wg < 2:
            cute.arch.setmaxregister_increase(TMAP_MATH_REGS)
            self.seesaw_column_tmap(
                mQ, mKV, mPT, mLens, mO, mLSE, mWork, mOp, mLSEp, scale_log2, scale_ln, v_scale, s_q, num_heads,
                g2s, g2s_wg, r2s_P, mma_s, mma_s_first, mma_o_rs, mma_o_ss, smem, mRanges,
                tidx, m_block, wi, wg, wg_tidx, lane, R, blocks_per_page,
            )
        else:
            cute.arch.setmaxregister_decrease(TMAP_PRODUCER_REGS)
            if cute.arch.make_warp_uniform(cute.arch.warp_idx()) == 2 * (WG_THREADS // 32):
                self.tmap_producer(mKV, mPT, mWork, mRanges, smem, tma_atom, mKV_tma, q_tma_atom, mQ_tma, m_block,
                                   wi, lane, blocks_per_page)

    @cute.jit
    def seesaw_column_tmap(
        self,
        mQ: cute.Tensor, mKV: cute.Tensor, mPT: cute.Tensor, mLens: cute.Tensor,
        mO: cute.Tensor, mLSE: cute.Tensor, mWork: cute.Tensor, mOp: cute.Tensor, mLSEp: cute.Tensor,
        scale_log2: cutlass.Float32, scale_ln: cutlass.Float32, v_scale: cutlass.Float32,
        s_q: cutlass.Int32, num_heads: cutlass.Int32,
        g2s: cute.TiledCopy, g2s_wg: cute.TiledCopy, r2s_P: cute.TiledCopy,
        mma_s: cute.TiledMma, mma_s_first: cute.TiledMma,
        mma_o_rs: cute.TiledMma, mma_o_ss: cute.TiledMma, smem, mRanges: cute.Tensor,
        tidx: cutlass.Int32, m_block: cutlass.Int32, wi: cutlass.Int32, wg: cutlass.Int32,
        wg_tidx: cutlass.Int32, lane: cutlass.Int32, R: cutlass.Int32, blocks_per_page: cutlass.Int32,
    ):
        """tma_producer, math warpgroups: ``seesaw_item`` per row of column wi with b >= 0, with the producer's
        bookkeeping (``tmap_producer``): the KV phase counts ph0 / ph1 (``seesaw_item_phases``), and Q: q_of = the
        request sQ holds (reset to -1 by a row with b < 0: the producer then reloads Q, so that every Q load but the
        column's first has exactly one Q-empty phase before it), nq = Q loads so far including this item's, the item
        waiting Q full parity (nq - 1) % 2; ``release``: the next row exists and names another request (or b < 0), so
        this item is the last reader of sQ before the producer's next Q load and arrives on Q empty (one phase per Q
        load after the first; a last row before b < 0 rows at the column's end completes a phase nobody waits)."""
        mbar = smem[8]
        q_of = cutlass.Int32(-1)
        nq = cutlass.Int32(0)
        ph0 = cutlass.Int32(0)
        ph1 = cutlass.Int32(0)
        end = mRanges[wi + 1]
        for it in cutlass.range(mRanges[wi], end, 1):
            b = mWork[it, 0]
            if b >= 0:
                slot = mWork[it, 3]
                kv_len = mLens[b]
                n_start = mWork[it, 1] // BLOCK_N
                T = (mWork[it, 2] + BLOCK_N - 1) // BLOCK_N - n_start
                q_load = b != q_of
                if q_load:
                    nq = nq + 1
                nb = b
                if it + 1 < end:
                    nb = mWork[it + 1, 0]
                self.seesaw_item(
                    mQ, mKV, mPT, mO, mLSE, mOp, mLSEp, scale_log2, scale_ln, v_scale, s_q, num_heads,
                    g2s, g2s_wg, r2s_P, mma_s, mma_s_first, mma_o_rs, mma_o_ss, None, None, smem,
                    tidx, m_block, wg, wg_tidx, lane, b, slot, kv_len, R, blocks_per_page, n_start, T,
                    q_load, ph0, ph1,
                    tmq=TmapQ(mbar + TMAP_Q_FULL, mbar + TMAP_Q_EMPTY, (nq + 1) % 2, nb != b),
                )
                q_of = b
                ph0 = ph0 + (T + 1) // 2
                ph1 = ph1 + T // 2
            else:
                q_of = cutlass.Int32(-1)

    @cute.jit
    def tmap_issue_part(self, tma_atom: cute.CopyAtom, tKgT: cute.Tensor, tKsT: cute.Tensor, page: cutlass.Int32,
                        n: cutlass.Int32, stage: cutlass.Constexpr, blocks: cutlass.Constexpr,
                        blocks_per_page: cutlass.Int32, full_ptr, empty_ptr, wait_empty, parity: cutlass.Int32):
        """tma_producer, the producer warp: one part of KV block n (cache page ``page``) into sK[:, :, stage]: wait
        for the part's columns to be free (``wait_empty``: not for a buffer's first tile of the column), then one lane
        arms ``full_ptr`` with the part's bytes and the warp issues one 64 x 64 box per block (``load_part_tma``'s
        copies; rows past kv_len as they are: ``zero_v_tail``)."""
        if wait_empty:
            cute.arch.mbarrier_wait(empty_ptr, parity)
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive_and_expect_tx(full_ptr, len(blocks) * BLOCK_N * KV_BOX * (self.mma_dtype.width // 8))
        for c in cutlass.range_constexpr(len(blocks)):
            cute.copy(tma_atom, tKgT[None, n % blocks_per_page, blocks[c], page], tKsT[None, 0, blocks[c], stage],
                      tma_bar_ptr=full_ptr)

    @cute.jit
    def tmap_producer(
        self, mKV: cute.Tensor, mPT: cute.Tensor, mWork: cute.Tensor, mRanges: cute.Tensor, smem,
        tma_atom: cute.CopyAtom, mKV_tma: cute.Tensor, q_tma_atom: cute.CopyAtom, mQ_tma: cute.Tensor,
        m_block: cutlass.Int32, wi: cutlass.Int32, lane: cutlass.Int32, blocks_per_page: cutlass.Int32,
    ):
        """tma_producer, the producer warp (warp 8): walks column wi's rows as the math side does (b < 0 skipped and
        resetting q_of).  Per item: Q when the request changes (the nq-th load, nq >= 1, first waits Q empty phase
        nq - 1: the previous request's last item's 256 arrives after its last S; then one arrive.expect_tx of 73,728
        bytes (16 bit) on Q full and nine 64 x 64 boxes, rows past R zero-filled by the TMA unit), then its tiles in
        the math side's wait order, tile a = 2p: parts 0 (blocks 0-3) and 1 (blocks 4-8); tile b = 2p + 1: parts 3
        (blocks 4-7) and 2 (blocks 0-3 + RoPE), or with ``wg1_other_first`` (WG1 waits part 2 first) parts 2 and 3
        (each on its own empty barrier and phase: only the order of the two waits changes); the g-th tile of a
        buffer in the column (g = ph + p) waits empty phase g - 1 of the part first (none for g = 0), as
        ``fp8p_producer``.  The pair's pages are read at its
        start, before its empty waits; with l2_prefetch lane 0 prefetches the next pair's tiles into L2."""
        sQ, sK = smem[0], smem[1]
        mbar = smem[8]
        full = mbar
        empty = mbar + 4
        q_full = mbar + TMAP_Q_FULL
        q_empty = mbar + TMAP_Q_EMPTY
        # KV boxes (TMA, 1, 9, STAGES) / (TMA, page_size / 64, 9, pages) as seesaw_item's; Q boxes as seesaw_column_qpf's
        tKsT, tKgT = cpasync.tma_partition(
            tma_atom, 0, cute.make_layout(1),
            cute.group_modes(cute.flat_divide(sK, (BLOCK_N, KV_BOX)), 0, 2),
            cute.group_modes(cute.flat_divide(mKV_tma, (BLOCK_N, KV_BOX)), 0, 2))
        tQsQ, tQgQ = cpasync.tma_partition(
            q_tma_atom, 0, cute.make_layout(1),
            cute.group_modes(cute.flat_divide(sQ, (BLOCK_M, KV_BOX)), 0, 2),
            cute.group_modes(cute.flat_divide(mQ_tma, (BLOCK_M, KV_BOX)), 0, 2))
        if lane == 0:
            cpasync.prefetch_descriptor(tma_atom)
            cpasync.prefetch_descriptor(q_tma_atom)
        q_of = cutlass.Int32(-1)
        nq = cutlass.Int32(0)
        g0 = cutlass.Int32(0)  # tiles of buffer 0 / 1 the column's earlier items loaded (seesaw_item_phases)
        g1 = cutlass.Int32(0)
        for it in cutlass.range(mRanges[wi], mRanges[wi + 1], 1):
            b = mWork[it, 0]
            if b >= 0:
                n_start = mWork[it, 1] // BLOCK_N
                T = (mWork[it, 2] + BLOCK_N - 1) // BLOCK_N - n_start
                if b != q_of:
                    if nq > 0:
                        cute.arch.mbarrier_wait(q_empty, (nq + 1) % 2)  # Q empty phase nq - 1
                    with cute.arch.elect_one():
                        cute.arch.mbarrier_arrive_and_expect_tx(q_full, BLOCK_M * D_QK * (self.mma_dtype.width // 8))
                    for k in cutlass.range_constexpr(D_QK // KV_BOX):
                        cute.copy(q_tma_atom, tQgQ[None, m_block, k, b], tQsQ[None, 0, k], tma_bar_ptr=q_full)
                    nq = nq + 1
                q_of = b
                for p in cutlass.range(0, (T + 1) // 2, 1):
                    ta = 2 * p
                    # the buffer's (g + p)-th tile of the column waits on empty phase g + p - 1
                    e0 = (g0 + p + 1) % 2
                    e1 = (g1 + p + 1) % 2
                    # this pair's pages, read before its empty waits (the producer is ahead: those waits hide the
                    # latency; fewer registers than fp8p_producer's pages kept one pair ahead)
                    pg_a = mPT[b, (n_start + ta) // blocks_per_page]
                    pg_b = mPT[b, (n_start + (ta + 1 if ta + 1 < T else ta)) // blocks_per_page]
                    if cutlass.const_expr(self.l2_prefetch):  # the next pair's tiles -> L2 (off by default)
                        pn2 = mPT[b, (n_start + (ta + 2 if ta + 2 < T else T - 1)) // blocks_per_page]
                        pn3 = mPT[b, (n_start + (ta + 3 if ta + 3 < T else T - 1)) // blocks_per_page]
                        self.prefetch_pair_l2(mKV, lane, pn2, pn3, n_start, ta, T, blocks_per_page)
                    self.tmap_issue_part(tma_atom, tKgT, tKsT, pg_a, n_start + ta, 0, SEESAW_LOAD_BLOCKS[0][0],
                                         blocks_per_page, full + 0, empty + 0, g0 + p > 0, e0)
                    self.tmap_issue_part(tma_atom, tKgT, tKsT, pg_a, n_start + ta, 0, SEESAW_LOAD_BLOCKS[1][1],
                                         blocks_per_page, full + 1, empty + 1, g0 + p > 0, e0)
                    if ta + 1 < T:
                        tile_b = tmap_tile_b_parts(self.wg1_other_first)
                        for k in cutlass.range_constexpr(2):
                            self.tmap_issue_part(tma_atom, tKgT, tKsT, pg_b, n_start + ta + 1, 1, tile_b[k][0],
                                                 blocks_per_page, full + tile_b[k][1], empty + tile_b[k][1],
                                                 g1 + p > 0, e1)
                g0 = g0 + (T + 1) // 2
                g1 = g1 + T // 2
            else:
                q_of = cutlass.Int32(-1)

# ---------------------------------------------------------------------- host helpers
# api.mla_decode_sm90 keeps using sm90_decode; the backend (mla_cute_dsl.backend, option mma) picks
# this kernel per shape through the helpers below (also used by the tests).


def _build_partial_wgmma(q_name: str, kv_name: str, block_m: int, *tags: str):
    from . import api

    k = MLADecodePartialWGMMA(api._cutlass_dtype(q_name), api._cutlass_dtype(kv_name), block_m,
                              wide_store=api.wide_from_tags(tags))
    return api.compile_partial(k, q_name, kv_name, tags)


def get_partial_kernel_wgmma(q_name: str, kv_name: str | None = None, *, partial: str = "fp32",
                             wide_store: bool = False):
    """Compiled WGMMA partial kernel for q dtype ``q_name`` and KV dtype ``kv_name``
    (``q_name`` or ``"fp8_e4m3"``; default: ``q_name``, the single-argument form).

    Same kernel cache as api.get_partial_kernel (memory, disk, else compile),
    under its own kind so it never collides with the mma.sync kernels; the key
    (q, kv, 64) of the 16-bit kernels is the one they always had. ``wide_store``: 16-byte epilogue
    stores of 16-bit rows (api.store_spec: tag "wide_store").
    """
    from . import api, kernel_cache

    kv_name = q_name if kv_name is None else kv_name
    if kv_name not in (q_name, "fp8_e4m3"):
        raise ValueError(f"WGMMA kernel: kv dtype must be {q_name} or fp8_e4m3, got {kv_name}")
    return kernel_cache.get_or_build("partial_wgmma", (q_name, kv_name, BLOCK_M) + api.partial_spec(partial)
                                     + api.store_spec(wide_store), _build_partial_wgmma)


def mla_decode_sm90_wgmma(q, kv_cache, page_table, kv_lens, sm_scale: float, kv_scale: float,
                          out, lse, schedule, workspace, *, check: bool = True):
    """``api.mla_decode_sm90`` with the WGMMA partial kernel (same arguments and contract).

    KV cache in the q dtype or float8_e4m3fn (k = kv * kv_scale; the MMAs then
    run in fp16, q converted on load: |q| must stay below 65504); any s_q * H
    works (the grid is ceil(R / 64) m-blocks) but the kernel is meant for
    s_q * H >= 64.
    """
    from . import api

    if check:
        api.check_call(q, kv_cache, page_table, kv_lens, out, lse, schedule)
    partial = get_partial_kernel_wgmma(api._TORCH_TO_NAME[q.dtype], api._TORCH_TO_NAME[kv_cache.dtype],
                                       partial=api.partial_name(workspace), wide_store=schedule.wide_store)
    return api.launch(partial, q, kv_cache, page_table, kv_lens, sm_scale, kv_scale, out, lse, schedule,
                      workspace)


# kernel-cache key flags after (q, kv, block_m): see seesaw_spec (plus "fp8pr<R>": fp8p_ring = R, seesaw_flag_ring)
SEESAW_FLAGS = ("l2pf", "wide_store", "tma", "rfence", "lazy", "fp8p", "qpf", "wg1of", "tmap")
#: key flag prefix of the fp8 producer's register ring (``fp8p_ring``): "fp8pr7" for 7 slots
SEESAW_RING_FLAG = "fp8pr"
#: key flag prefix of the ring's shared-memory staging (``fp8p_stage``): "fp8ps4" for 4 slots
SEESAW_STAGE_FLAG = "fp8ps"


def _numbered_flag(flags, prefix: str) -> int:
    vals = [int(f[len(prefix):]) for f in flags if f.startswith(prefix) and f[len(prefix):].isdigit()]
    return vals[0] if vals else 0


def seesaw_flag_ring(flags) -> int:
    """The ``fp8p_ring`` a seesaw kernel key's flags ask for (0: none), from its "fp8pr<R>" flag."""
    return _numbered_flag(flags, SEESAW_RING_FLAG)


def seesaw_flag_stage(flags) -> int:
    """The ``fp8p_stage`` a seesaw kernel key's flags ask for (0: none), from its "fp8ps<S>" flag."""
    return _numbered_flag(flags, SEESAW_STAGE_FLAG)


def _seesaw_unknown_flags(flags) -> list:
    return [f for f in flags if f not in SEESAW_FLAGS and not f.startswith("partial_")
            and not any(f.startswith(p) and f[len(p):].isdigit() for p in (SEESAW_RING_FLAG, SEESAW_STAGE_FLAG))]
#: MLADecodePartialWGMMASeesaw(lazy_rescale=True): a row's reference max moves only when a tile's max exceeds it by
#: more than this (exp2 units), so P <= 2^8
LAZY_RESCALE_LOG2 = 8.0


def _build_partial_wgmma_seesaw(q_name: str, kv_name: str, block_m: int, *flags: str):
    from . import api

    unknown = _seesaw_unknown_flags(flags)
    if unknown:
        raise ValueError(f"seesaw kernel key: unknown flags {unknown}, expected a subset of {SEESAW_FLAGS} "
                         f"and a partial_<dtype> tag (and {SEESAW_RING_FLAG}<slots>)")
    k = MLADecodePartialWGMMASeesaw(api._cutlass_dtype(q_name), api._cutlass_dtype(kv_name), block_m,
                                    l2_prefetch="l2pf" in flags, wide_store=api.wide_from_tags(flags),
                                    tma="tma" in flags, reader_fences="rfence" in flags,
                                    lazy_rescale="lazy" in flags, fp8_producer="fp8p" in flags,
                                    fp8p_ring=seesaw_flag_ring(flags), fp8p_stage=seesaw_flag_stage(flags),
                                    q_prefetch="qpf" in flags,  # balanced only: the constructor refuses it
                                    wg1_other_first="wg1of" in flags,
                                    tma_producer="tmap" in flags)  # wg1of: 16-bit KV only; tmap: balanced only
    return api.compile_partial(k, q_name, kv_name, flags)


def _check_fp8p_ring(fp8p_ring: int, fp8_producer: bool, fp8p_stage: int = 0) -> None:
    """Getter-side refusal (before any compile) of a register ring without the producer or of a size the kernel
    does not take (fp8p_ring.RING_SIZES: those ptxas assembles without spills), and of staging without a ring or
    with another slot count than fp8p_ring.STAGE_SLOTS."""
    if fp8p_ring and not fp8_producer:
        raise ValueError(f"seesaw WGMMA kernel: fp8p_ring={fp8p_ring} needs fp8_producer=True")
    if fp8p_ring and fp8p_ring not in _ring.RING_REGS:
        raise ValueError(f"seesaw WGMMA kernel: fp8p_ring must be one of {tuple(sorted(_ring.RING_REGS))}, got {fp8p_ring}")
    if fp8p_stage and not fp8p_ring:
        raise ValueError(f"seesaw WGMMA kernel: fp8p_stage={fp8p_stage} needs fp8p_ring")
    if fp8p_stage not in (0, _ring.STAGE_SLOTS):
        raise ValueError(f"seesaw WGMMA kernel: fp8p_stage must be 0 or {_ring.STAGE_SLOTS}, got {fp8p_stage}")


def seesaw_l2_prefetch_default(kv_name: str) -> bool:
    """Whether the seesaw kernel prefetches the next pair's tiles into L2, per cache dtype.

    Measured on the H200 (sixth session, NOTES.md "Seesaw without the L2 prefetch"), same
    process, CUDA-graph replay, times without vs with the prefetch: with a 16-bit cache the
    prefetch costs time at large batch (B128 H128 S4096: 282.1 vs 345.2 us at s_q=1, 587.2 vs
    665.9 us at s_q=2) and saves a little at B16 (52.9 vs 51.2 us), so it is off; with an fp8
    cache it saves a little (B128 s_q=1 414.0 vs 403.9 us, B16 67.6 vs 65.4, s_q=2 equal), so it
    stays on.
    """
    return kv_name == "fp8_e4m3"


def seesaw_spec(q_name: str, kv_name: str, l2_prefetch: bool = False, partial: str = "fp32",
                wide_store: bool = False, tma: bool = False, reader_fences: bool = False,
                lazy_rescale: bool = False, fp8_producer: bool = False, fp8p_ring: int = 0,
                fp8p_stage: int = 0, q_prefetch: bool = False,
                wg1_other_first: bool = False, tma_producer: bool = False) -> tuple[str | int, ...]:
    """Kernel cache key of a seesaw kernel: (q, kv, 64), then "l2pf" when ``l2_prefetch`` is set, then the
    partial-O dtype's tag unless fp32 (api.partial_spec; the default kernel keeps the three-part key), then
    "wide_store" for 16-byte epilogue stores (api.store_spec), then "tma" for TMA KV loads (only when set:
    every existing key is unchanged), then "rfence" for a TMA or fp8 kernel that keeps the reader-side fences
    (the A/B arm; see MLADecodePartialWGMMASeesaw.reader_fences; never for the 16-bit cp.async kernel, which
    runs them anyway), then "lazy" for ``lazy_rescale`` (only when set), then "fp8p" for ``fp8_producer`` (fp8 KV
    with a producer warpgroup; only when set), then "fp8pr<R>" for the producer's register ring ``fp8p_ring`` = R
    and "fp8ps<S>" for its shared-memory staging ``fp8p_stage`` = S (only when set), then "qpf" for
    ``q_prefetch`` (the balanced kernel's next-item Q and tiles 0 / 1 issued in the current item; only when set;
    every existing key is unchanged), then "wg1of" for ``wg1_other_first`` (WG1's QK of its own tile waits WG0's
    part first; 16-bit KV; only when set: every existing key is unchanged), then "tmap" for ``tma_producer`` (the
    balanced 16-bit TMA kernel with a producer warpgroup; only when set)."""
    from . import api

    return ((q_name, kv_name, BLOCK_M) + (("l2pf",) if l2_prefetch else ()) + api.partial_spec(partial)
            + api.store_spec(wide_store) + (("tma",) if tma else ())
            + (("rfence",) if reader_fences and (tma or kv_name == "fp8_e4m3") else ())
            + (("lazy",) if lazy_rescale else ()) + (("fp8p",) if fp8_producer else ())
            + ((f"{SEESAW_RING_FLAG}{int(fp8p_ring)}",) if fp8p_ring else ())
            + ((f"{SEESAW_STAGE_FLAG}{int(fp8p_stage)}",) if fp8p_stage else ())
            + (("qpf",) if q_prefetch else ()) + (("wg1of",) if wg1_other_first else ())
            + (("tmap",) if tma_producer else ()))


def get_partial_kernel_wgmma_seesaw(q_name: str, kv_name: str | None = None, *,
                                    l2_prefetch: bool | None = None, partial: str = "fp32",
                                    wide_store: bool = False, tma: bool = False, reader_fences: bool = False,
                                    lazy_rescale: bool = False, fp8_producer: bool = False, fp8p_ring: int = 0,
                                    fp8p_stage: int = 0, wg1_other_first: bool = False):
    """Compiled seesaw WGMMA partial kernel, KV in the q dtype (default) or ``"fp8_e4m3"``
    (per-warpgroup ld.global -> fp16 conversion, branch wgmma-fp8-seesaw); kernel cache kind
    ``partial_wgmma_seesaw``, key ``seesaw_spec``.  ``l2_prefetch``: the L2 bulk prefetch of the
    next pair's tiles (None: ``seesaw_l2_prefetch_default`` of the cache dtype).  ``tma``: KV parts by
    TMA boxes instead of cp.async (16-bit cache only; the backend's loads=auto from 256 rows, from 128 for the
    balanced kernel; measured in the class docstring).  ``reader_fences``: keep the reader-side proxy fences
    with TMA loads or an fp8 cache (the A/B arm; the 16-bit cp.async kernel runs them anyway).  ``lazy_rescale``:
    see the class's constructor.  ``fp8_producer``: fp8 cache only (ValueError otherwise), the opt-in kernel with a
    producer warpgroup (384 threads) that does all fp8 loading and conversion (``kernel_fp8p``).  ``fp8p_ring``
    (with fp8_producer only; one of ``fp8p_ring.RING_SIZES``, 0: the one-part producer): the producer's register
    ring of that many 16-fp8 chunks, loads issued ring - 1 chunks ahead (``fp8p_producer_ring``; key flag
    "fp8pr<R>"); ``fp8p_stage`` (with a ring; 0 or fp8p_ring.STAGE_SLOTS): every third chunk staged through
    shared memory by cp.async, loads issued ``fp8p_ring.lookahead`` chunks ahead (key flag "fp8ps<S>").
    ``wg1_other_first`` (16-bit cache, or fp8_e4m3 with fp8_producer and fp8p_ring (branch fp8-wg1of, GPU-verified:
    the ring converts tile b's part 2 before part 3), ValueError otherwise; branch qk-order, GPU-verified): warpgroup 1's
    QK of its own tile waits warpgroup 0's part first (``MLADecodePartialWGMMASeesaw.qk_wait_order``), key flag
    "wg1of"; the backend's option wg1_other_first (default: on with the fp8 ring, and with a 16-bit cache from 256
    packed rows)."""
    from . import kernel_cache

    kv_name = q_name if kv_name is None else kv_name
    if kv_name not in (q_name, "fp8_e4m3"):
        raise ValueError(f"seesaw WGMMA kernel: kv dtype must be {q_name} or fp8_e4m3, got {kv_name}")
    if tma and kv_name == "fp8_e4m3":
        raise ValueError("seesaw WGMMA kernel: tma=True needs a 16-bit KV cache (bf16 / fp16), got fp8_e4m3")
    if fp8_producer and kv_name != "fp8_e4m3":
        raise ValueError(f"seesaw WGMMA kernel: fp8_producer=True needs an fp8_e4m3 KV cache, got {kv_name}")
    _check_fp8p_ring(fp8p_ring, fp8_producer, fp8p_stage)
    if wg1_other_first and kv_name == "fp8_e4m3" and not (fp8_producer and fp8p_ring):
        raise ValueError("seesaw WGMMA kernel: wg1_other_first=True needs a 16-bit KV cache (bf16 / fp16) or, with "
                         "fp8_e4m3, fp8_producer=True and fp8p_ring")
    if l2_prefetch is None:
        l2_prefetch = seesaw_l2_prefetch_default(kv_name)
    return kernel_cache.get_or_build("partial_wgmma_seesaw",
                                     seesaw_spec(q_name, kv_name, l2_prefetch, partial, wide_store, tma,
                                                 reader_fences, lazy_rescale, fp8_producer, fp8p_ring, fp8p_stage,
                                                 wg1_other_first=wg1_other_first),
                                     _build_partial_wgmma_seesaw)


def mla_decode_sm90_wgmma_seesaw(q, kv_cache, page_table, kv_lens, sm_scale: float, kv_scale: float,
                                 out, lse, schedule, workspace, *, check: bool = True,
                                 l2_prefetch: bool | None = None, tma: bool = False, reader_fences: bool = False,
                                 lazy_rescale: bool = False, fp8_producer: bool = False, fp8p_ring: int = 0,
                                 fp8p_stage: int = 0, wg1_other_first: bool = False):
    """``mla_decode_sm90_wgmma`` with the seesaw partial kernel (same arguments and contract;
    KV cache in the q dtype or float8_e4m3fn, k = kv * kv_scale, MMAs in fp16, |q| < 65504).
    ``l2_prefetch``, ``tma``, ``reader_fences``, ``lazy_rescale``, ``fp8_producer`` (fp8 cache only), ``fp8p_ring``
    (with fp8_producer), ``fp8p_stage`` (with a ring), ``wg1_other_first`` (16-bit cache or the fp8 ring;
    GPU-verified): see ``get_partial_kernel_wgmma_seesaw``."""
    from . import api

    if check:
        api.check_call(q, kv_cache, page_table, kv_lens, out, lse, schedule)
    partial = get_partial_kernel_wgmma_seesaw(api._TORCH_TO_NAME[q.dtype], api._TORCH_TO_NAME[kv_cache.dtype],
                                              l2_prefetch=l2_prefetch, partial=api.partial_name(workspace),
                                              wide_store=schedule.wide_store, tma=tma, reader_fences=reader_fences,
                                              lazy_rescale=lazy_rescale,
                                              **({"fp8_producer": True} if fp8_producer else {}),  # opt-in only
                                              **({"fp8p_ring": fp8p_ring} if fp8p_ring else {}),
                                              **({"fp8p_stage": fp8p_stage} if fp8p_stage else {}),
                                              **({"wg1_other_first": True} if wg1_other_first else {}))
    return api.launch(partial, q, kv_cache, page_table, kv_lens, sm_scale, kv_scale, out, lse, schedule,
                      workspace)


# ---------------------------------------------------------------------- balanced seesaw (branch seesaw-balanced)


def seesaw_item_phases(T: int) -> tuple[int, int]:
    """Phases one seesaw work item of T tiles completes on the mbarriers of buffer 0 (local tiles 0, 2, ...:
    ceil(T / 2)) and of buffer 1 (tiles 1, 3, ...: floor(T / 2)); each tile completes one phase on both
    mbarriers of its buffer (one part per loading warpgroup).  The balanced kernel adds these to its running
    counts (ph0, ph1) after every item, and pair p of the next item waits with parity (ph0 + p) % 2 on buffer 0
    and (ph1 + p) % 2 on buffer 1 (``seesaw_pair_parities``); the one-item kernel's p % 2 is the case ph0 = ph1
    = 0.  Restarting at p % 2 in every item would wait with the wrong parity (for a phase that already
    completed) once an earlier item completed an odd number of phases on a buffer, e.g. after T = 1, 2 or 3
    (tests/test_seesaw_balanced_protocol.py catches it)."""
    return (T + 1) // 2, T // 2


def seesaw_pair_parities(ph0: int, ph1: int, p: int) -> tuple[int, int]:
    """(buffer 0, buffer 1) mbarrier wait parities of pair p of an item after earlier phases ph0, ph1."""
    return (ph0 + p) % 2, (ph1 + p) % 2


def _build_partial_wgmma_seesaw_balanced(q_name: str, kv_name: str, block_m: int, *flags: str):
    from . import api

    unknown = _seesaw_unknown_flags(flags)
    if unknown:
        raise ValueError(f"seesaw kernel key: unknown flags {unknown}, expected a subset of {SEESAW_FLAGS} "
                         f"and a partial_<dtype> tag (and {SEESAW_RING_FLAG}<slots>)")
    k = MLADecodePartialWGMMASeesaw(api._cutlass_dtype(q_name), api._cutlass_dtype(kv_name), block_m,
                                    l2_prefetch="l2pf" in flags, wide_store=api.wide_from_tags(flags),
                                    tma="tma" in flags, balanced=True, lazy_rescale="lazy" in flags,
                                    fp8_producer="fp8p" in flags, fp8p_ring=seesaw_flag_ring(flags),
                                    fp8p_stage=seesaw_flag_stage(flags), q_prefetch="qpf" in flags,
                                    wg1_other_first="wg1of" in flags,
                                    tma_producer="tmap" in flags)
    return api.compile_partial(k.call_balanced, q_name, kv_name, flags, balanced=True)


def get_partial_kernel_wgmma_seesaw_balanced(q_name: str, kv_name: str | None = None, *,
                                             l2_prefetch: bool | None = None, partial: str = "fp32",
                                             wide_store: bool = False, tma: bool = False,
                                             lazy_rescale: bool = False, fp8_producer: bool = False,
                                             fp8p_ring: int = 0, fp8p_stage: int = 0, q_prefetch: bool = False,
                                             wg1_other_first: bool = False, tma_producer: bool = False):
    """Compiled balanced seesaw partial kernel (``MLADecodePartialWGMMASeesaw(balanced=True).call_balanced``),
    KV in the q dtype (default) or ``"fp8_e4m3"`` (branch fp8-balanced: the even fp8 seesaw's loads under the
    item loop; GPU-verified in the twenty-second session); kernel cache kind ``partial_wgmma_seesaw_balanced`` with
    the even kernel's key (``seesaw_spec``), so the even seesaw kernels' keys and symbols are unchanged and the two
    never collide.  ``l2_prefetch`` (None: ``seesaw_l2_prefetch_default``, off for 16-bit caches, on for fp8),
    ``partial``, ``wide_store``, ``tma`` (16-bit caches only), ``lazy_rescale``: as
    ``get_partial_kernel_wgmma_seesaw``.  ``fp8_producer`` (fp8 cache only, ValueError otherwise; branch
    fp8-balanced-producer, GPU-verified in the twenty-second session): the producer-warpgroup kernel on the balanced
    schedule (``kernel_fp8p_balanced``), key flag "fp8p" as the even getter's.  ``fp8p_ring``, ``fp8p_stage``: the
    producer's register ring and its shared-memory staging, as the even getter's (key flags "fp8pr<R>",
    "fp8ps<S>").  ``q_prefetch`` (16-bit cache only, ValueError otherwise; branch q-prefetch, compile-only): each
    item issues the next item's Q (a TMA load) and KV tiles 0 / 1 during its last pairs (``seesaw_column_qpf``),
    key flag "qpf".  ``wg1_other_first`` (16-bit cache, or fp8 with fp8_producer and fp8p_ring (branch fp8-wg1of,
    GPU-verified), ValueError otherwise; branch qk-order, GPU-verified):
    warpgroup 1's QK of its own tile waits warpgroup 0's part first, key flag "wg1of" (as the even getter's).

    ``tma_producer`` (16-bit cache with tma=True only, not with q_prefetch or the fp8 options;
    ValueError otherwise; branch tma-producer, GPU-verified): a producer warpgroup issues every KV part and Q by TMA
    on full / empty mbarriers across the column's items (``kernel_tmap_balanced``), key flag "tmap"; with
    ``wg1_other_first`` too (branch tmap-wg1of, GPU-verified) the key ends "wg1of", "tmap"."""
    from . import kernel_cache

    kv_name = q_name if kv_name is None else kv_name
    if kv_name not in (q_name, "fp8_e4m3"):
        raise ValueError(f"balanced seesaw kernel: kv dtype must be {q_name} or fp8_e4m3, got {kv_name}")
    if tma and kv_name == "fp8_e4m3":
        raise ValueError("balanced seesaw kernel: tma=True needs a 16-bit KV cache (bf16 / fp16), got fp8_e4m3")
    if fp8_producer and kv_name != "fp8_e4m3":
        raise ValueError(f"balanced seesaw kernel: fp8_producer=True needs an fp8_e4m3 KV cache, got {kv_name}")
    _check_fp8p_ring(fp8p_ring, fp8_producer, fp8p_stage)
    if q_prefetch and kv_name == "fp8_e4m3":
        raise ValueError("balanced seesaw kernel: q_prefetch=True needs a 16-bit KV cache (bf16 / fp16), got fp8_e4m3")
    if wg1_other_first and kv_name == "fp8_e4m3" and not (fp8_producer and fp8p_ring):
        raise ValueError("balanced seesaw kernel: wg1_other_first=True needs a 16-bit KV cache (bf16 / fp16) or, "
                         "with fp8_e4m3, fp8_producer=True and fp8p_ring")
    if tma_producer:
        if kv_name == "fp8_e4m3" or not tma:
            raise ValueError("balanced seesaw kernel: tma_producer=True needs a 16-bit KV cache (bf16 / fp16) and "
                             f"tma=True, got kv {kv_name}, tma={tma}")
        if q_prefetch or fp8_producer or fp8p_ring or fp8p_stage:
            raise ValueError("balanced seesaw kernel: tma_producer=True excludes q_prefetch and the fp8 producer "
                             "options (fp8_producer, fp8p_ring, fp8p_stage)")
    if l2_prefetch is None:
        l2_prefetch = seesaw_l2_prefetch_default(kv_name)
    return kernel_cache.get_or_build("partial_wgmma_seesaw_balanced",
                                     seesaw_spec(q_name, kv_name, l2_prefetch, partial, wide_store, tma,
                                                 lazy_rescale=lazy_rescale, fp8_producer=fp8_producer,
                                                 fp8p_ring=fp8p_ring, fp8p_stage=fp8p_stage, q_prefetch=q_prefetch,
                                                 wg1_other_first=wg1_other_first, tma_producer=tma_producer),
                                     _build_partial_wgmma_seesaw_balanced)


def mla_decode_sm90_wgmma_seesaw_balanced(q, kv_cache, page_table, kv_lens, sm_scale: float, kv_scale: float,
                                          out, lse, schedule, workspace, *, check: bool = True,
                                          l2_prefetch: bool | None = None, tma: bool = False,
                                          lazy_rescale: bool = False, fp8_producer: bool = False,
                                          fp8p_ring: int = 0, fp8p_stage: int = 0,
                                          q_prefetch: bool = False, wg1_other_first: bool = False,
                                          tma_producer: bool = False):
    """``mla_decode_sm90_wgmma_seesaw`` on a balanced schedule: the balanced seesaw kernel, a fixed grid of
    (m-blocks, schedule.num_cols) CTAs each walking its column of a ``make_schedule(..., balanced=True)``
    schedule (either form of the hybrid plan), then the combine, through ``api.launch_balanced`` (the mma.sync
    and wgmma_t balanced entries' launch).  Needs a schedule with the 64-row tile's m-blocks (block_m 64, or
    any block_m at s_q * H <= 32, where every block_m gives one m-block: the tile is padded) and a
    bf16/fp16 or fp8 e4m3 cache (ValueError otherwise, also with check=False; fp8: k = kv * kv_scale as in the
    even entry; GPU-verified in the twenty-second session).  ``l2_prefetch``, ``tma``: see
    ``get_partial_kernel_wgmma_seesaw``; ``fp8_producer`` (fp8 cache only; GPU-verified), ``fp8p_ring``,
    ``fp8p_stage``, ``q_prefetch``, ``wg1_other_first`` (16-bit cache or the fp8 ring; GPU-verified), ``tma_producer``
    (16-bit cache with tma=True; GPU-verified): see ``get_partial_kernel_wgmma_seesaw_balanced``."""
    from . import api

    api.check_balanced(schedule, kv_cache, fp8_ok=True)
    if -(-schedule.rows // schedule.block_m) != -(-schedule.rows // BLOCK_M):
        # a schedule of 16/32-row m-blocks has one m-block at <= 32 rows, as the 64-row tile has: the same grid
        raise ValueError(f"balanced seesaw: the schedule's m-blocks of {schedule.block_m} rows do not cover "
                         f"s_q * H = {schedule.rows} as the kernel's 64-row tiles do")
    if check:
        api.check_call(q, kv_cache, page_table, kv_lens, out, lse, schedule)
    partial = get_partial_kernel_wgmma_seesaw_balanced(
        api._TORCH_TO_NAME[q.dtype], api._TORCH_TO_NAME[kv_cache.dtype], l2_prefetch=l2_prefetch,
        partial=api.partial_name(workspace), wide_store=schedule.wide_store, tma=tma, lazy_rescale=lazy_rescale,
        **({"fp8_producer": True} if fp8_producer else {}),  # opt-in only
        **({"fp8p_ring": fp8p_ring} if fp8p_ring else {}),
        **({"fp8p_stage": fp8p_stage} if fp8p_stage else {}),
        **({"q_prefetch": True} if q_prefetch else {}),
        **({"wg1_other_first": True} if wg1_other_first else {}),
        **({"tma_producer": True} if tma_producer else {}))
    return api.launch_balanced(partial, q, kv_cache, page_table, kv_lens, sm_scale, kv_scale, out, lse, schedule,
                               workspace)
