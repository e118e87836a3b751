"""SM90 MLA decode, split-KV partial kernel for an fp8-e4m3 KV cache and few rows
(H=16 at TP8: s_q * H = 16 or 32), in CuTe DSL.  Verified on an H200 (fourth session) and
the backend's ``mma=auto`` choice for an fp8 cache up to 32 rows (``mma=fp8reg``).

Same host interface as ``sm90_decode.MLADecodePartial`` (same arguments, work
items, partial buffers, combine kernel).  Helpers: ``get_partial_kernel_fp8``
(kernel cache kind ``partial_fp8reg``) and ``mla_decode_sm90_fp8``.

What differs from the verified kernel (see NOTES.md, "fp8 H=16 variant"):

* No fp16 K tile in shared memory.  The fp8 tile stays as cp.async'ed (one
  staging buffer per stage, 36 KB) and every warp builds its m16n8k16
  B-fragments straight from it: shared loads of fp8 bytes, ``cvt.rn.f16x2.e4m3x2``
  in registers.  Saves the 72 KB fp16 write, the 72 KB K and 64 KB V ldmatrix
  reads and the conversion barrier per tile, and 72 KB of shared memory, so two
  CTAs fit on an SM (2 stages: 93 KB at BLOCK_M 16, 113 KB at 32).
* QK: the 576-long reduction is permuted so that a thread's B values are 16
  consecutive fp8 bytes of one token (one 128-bit load = 4 MMAs' B operands, no
  byte shuffles): logical k = 64c + 16i + 8hi + 2q + lo  <->  physical dim
  64c + 16q + 4i + 2hi + lo (q = lane % 4).  Q gets the same permutation when it
  is written to shared memory (once per CTA), so S is unchanged.
* PV: B needs pairs of consecutive *tokens* per output column.  Output columns are
  permuted so that a thread's 4 n-blocks of a group read 4 consecutive dims of a
  token (one 32-bit load per token); two tokens' words are byte-shuffled into
  (t, t') pairs and converted.  logical column n = g + 8j + 32r + 128a  <->
  physical dim 128j + 32a + 4g + r (g = lane / 4, j = warp along N); warp j thus
  owns dims [128j, 128j + 128).  The epilogue writes through the same map.
* Staging layout: 9 column blocks of (64 tokens x 64 B), XOR swizzle of byte
  address bits 5,6 with bits 7,8 (Swizzle<2,5,2>): the 128-bit K loads and the
  32-bit V loads are both bank-conflict free (NOTES.md has the derivation).
* Rows of a tile past kv_len are zero-filled at load time (predicated cp.async),
  so NaN in page tails never reaches P V; masked scores are -inf as before.
* Everything else (warp grid (M/16) x 4, row-max exchange through sRed, P through
  sP + ldmatrix, online softmax, epilogue, empty-row contract) is the verified
  kernel's.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync, warp

D_QK = 576
D_V = 512
BLOCK_N = 64
NW_N = 4  # warps along N
STAGE_BYTES = BLOCK_N * D_QK  # one fp8 staging tile
N_CHUNK = D_QK // 64  # 64-dim column blocks of the staging tile


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


# ---- the two index permutations (pure Python, also used by the CPU tests) ----


def qk_phys_dim(k: int) -> int:
    """Physical K dim read for logical reduction index k of S = Q K^T."""
    c, r = divmod(k, 64)
    i, r = divmod(r, 16)
    hi, r = divmod(r, 8)
    q, lo = divmod(r, 2)
    return 64 * c + 16 * q + 4 * i + 2 * hi + lo


def o_phys_dim(n: int) -> int:
    """Physical output / V dim of logical output column n of O = P V."""
    g, r = n % 8, n // 8
    j, r = r % 4, r // 4
    rr, a = r % 4, r // 4
    return 128 * j + 32 * a + 4 * g + rr


def _pv_index(v: int, r: int) -> int:
    """Position of B value v (token 2q + v%2 + 8(v//2)) of n-block r of a PV group
    in the shuffled byte vector: (v % 2, r % 2, v // 2, r // 2), first fastest."""
    return (v % 2) + 2 * (r % 2) + 4 * (v // 2) + 8 * (r // 2)


class MLADecodePartialFP8Reg:
    """fp8-KV split-KV partial kernel, fragments converted in registers.

    One specialization per (q dtype, BLOCK_M in {16, 32}); KV is fp8-e4m3.
    layout: (warps along M, 16-row MMA atoms per warp); default (1, 1) for 16
    rows and (1, 2) for 32 rows (v4's fastest 32-row layout: every K/V fragment
    serves 32 rows).  stages: fp8 staging buffers (2 lets two CTAs share an SM).
    """

    DEFAULT_LAYOUT = {16: (1, 1), 32: (1, 2)}

    def __init__(self, q_dtype, kv_dtype, block_m: int, layout=None, stages: int = 2, s_accs: int = 1):
        if kv_dtype is not cutlass.Float8E4M3FN:
            raise NotImplementedError("MLADecodePartialFP8Reg needs an fp8-e4m3 KV cache")
        if block_m not in (16, 32):
            raise ValueError(f"BLOCK_M must be 16 or 32, got {block_m}")
        self.q_dtype = q_dtype
        self.kv_dtype = kv_dtype
        self.mma_dtype = cutlass.Float16  # e4m3 is exact in fp16; q converted on load
        self.block_m = block_m
        self.m_warps, self.m_per_warp = layout or self.DEFAULT_LAYOUT[block_m]
        assert self.m_warps * self.m_per_warp * 16 == block_m
        self.num_warps = self.m_warps * NW_N
        self.num_threads = self.num_warps * 32
        assert stages >= 2
        self.stages = stages
        # s_accs: independent S accumulators per warp (the QK k-steps round-robin over them), so the 36-long
        # chain of dependent MMAs per n-block becomes 36 / s_accs; 1 (default) is the GPU-verified kernel
        if s_accs not in (1, 2, 4):
            raise ValueError(f"s_accs must be 1, 2 or 4, got {s_accs}")
        self.s_accs = s_accs

    def smem_bytes(self) -> int:
        parts = [
            (self.block_m * D_QK * 2, 1024),  # sQ (fp16, logical k order)
            (self.stages * STAGE_BYTES, 1024),  # fp8 staging ring
            (self.block_m * BLOCK_N * 2, 1024),  # sP
            (self.block_m * NW_N * 4, 16),  # sRed
        ]
        off = 0
        for size, align in parts:
            off = -(-off // align) * align + size
        return off

    # ---- layouts (also probed by the CPU tests) ----

    def _layouts(self):
        bm = self.block_m
        atom = cute.make_composed_layout(
            cute.make_swizzle(3, 3, 3), 0, cute.make_layout((8, 64), stride=(64, 1))
        )
        sQ_layout = cute.tile_to_shape(atom, (bm, D_QK), (0, 1))
        sP_layout = cute.tile_to_shape(atom, (bm, BLOCK_N), (0, 1))
        # fp8 staging: (token, dim, stage) -> byte; 9 blocks of (64 tokens x 64 B),
        # byte bits 5,6 ^= bits 7,8
        sR_layout = cute.make_composed_layout(
            cute.make_swizzle(2, 5, 2),
            0,
            cute.make_layout(
                (BLOCK_N, (64, N_CHUNK), self.stages),
                stride=(64, (1, 64 * BLOCK_N), STAGE_BYTES),
            ),
        )
        return sQ_layout, sP_layout, sR_layout

    @staticmethod
    def _perm_layouts(bm, stages):
        """Index maps composed onto the smem tensors (domains are col-major coordinates).

        lq: (row, physical dim) -> (row, logical k) of sQ            (write Q permuted)
        lk: (token, logical k, stage) -> (token, physical dim, stage)  (K B-operand)
        lv: (logical n, token, stage) -> (token, physical dim, stage)  (V B-operand)
        lo: (row, logical n) -> (row, physical dim)                    (epilogue)
        """
        lq = cute.make_layout((bm, (2, 2, 4, 4, N_CHUNK)),
                              stride=(1, (bm, 8 * bm, 16 * bm, 2 * bm, 64 * bm)))
        T = BLOCK_N
        lk = cute.make_layout((T, (2, 4, 2, 4, N_CHUNK), stages),
                              stride=(1, (T, 16 * T, 2 * T, 4 * T, 64 * T), T * D_QK))
        lv = cute.make_layout(((8, 4, 4, 4), T, stages),
                              stride=((4 * T, 128 * T, T, 32 * T), 1, T * D_QK))
        lo = cute.make_layout((bm, (8, 4, 4, 4)), stride=(1, (4 * bm, 128 * bm, bm, 32 * bm)))
        return lq, lk, lv, lo

    def _tiled_mma(self):
        mma_atom = warp.MmaF16BF16Op(self.mma_dtype, cutlass.Float32, (16, 8, 16))
        return cute.make_tiled_mma(
            mma_atom, (self.m_warps, NW_N, 1), permutation_mnk=(self.block_m, 16 * NW_N, 16)
        )

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (B, R, 576) q dtype, R = s_q * H
        mKV: cute.Tensor,  # (P, page, 576) fp8
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
        sQ_layout, sP_layout, sR_layout = self._layouts()
        sRed_layout = cute.make_layout((self.block_m, NW_N), stride=(NW_N, 1))

        @cute.struct
        class SharedStorage:
            sQ: cute.struct.Align[cute.struct.MemRange[mt, cute.cosize(sQ_layout)], 1024]
            sR: cute.struct.Align[cute.struct.MemRange[self.kv_dtype, self.stages * STAGE_BYTES], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[mt, cute.cosize(sP_layout)], 1024]
            sRed: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, self.block_m * NW_N], 16]

        nt = self.num_threads
        g2s_raw = cute.make_tiled_copy_tv(
            cute.make_copy_atom(
                cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL),
                self.kv_dtype,
                num_bits_per_copy=128,
            ),
            cute.make_layout((nt // 4, 4), stride=(4, 1)),
            cute.make_layout((1, 16)),
        )
        g2r_q = cute.make_tiled_copy_tv(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.q_dtype, num_bits_per_copy=128),
            cute.make_layout((nt // 8, 8), stride=(8, 1)),
            cute.make_layout((1, 8)),
        )
        # registers -> sQ through the permuted view: pairs of dims stay adjacent (32-bit)
        r2s_q = cute.make_tiled_copy_tv(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), mt, num_bits_per_copy=32),
            cute.make_layout((nt // 8, 8), stride=(8, 1)),
            cute.make_layout((1, 8)),
        )
        mma = self._tiled_mma()

        grid = (
            cute.ceil_div(cute.size(mQ.shape[1]), self.block_m),
            cute.size(mWork.shape[0]),
            1,
        )
        self.kernel(
            mQ, mKV, mPT, mLens, mO, mLSE, mWork, mOp, mLSEp,
            scale_log2, scale_ln, v_scale, s_q, num_heads,
            sQ_layout, sP_layout, sR_layout, sRed_layout,
            g2s_raw, g2r_q, r2s_q, mma, SharedStorage,
        ).launch(grid=grid, block=[nt, 1, 1], stream=stream)

    @cute.jit
    def load_tile(
        self, g2s_raw: cute.TiledCopy, mKV: cute.Tensor, mPT: cute.Tensor, b: cutlass.Int32,
        n: cutlass.Int32, stage: cutlass.Int32, blocks_per_page: cutlass.Int32,
        kv_len: cutlass.Int32, tRcR: cute.Tensor, tRsR: cute.Tensor, thr_g2s_raw,
    ):
        """cp.async one 64-token fp8 tile (block n of request b) into staging `stage`;
        rows >= kv_len are zero-filled instead (page tails may hold NaN)."""
        page = mPT[b, n // blocks_per_page]
        gK = cute.local_tile(mKV[page, None, None], (BLOCK_N, D_QK), (n % blocks_per_page, 0))
        tRgK = thr_g2s_raw.partition_S(gK)
        valid = kv_len - n * BLOCK_N
        for m in cutlass.range_constexpr(cute.size(tRsR.shape[1])):
            if tRcR[0, m, 0][0] < valid:
                cute.copy(g2s_raw, tRgK[None, m, None], tRsR[None, m, None, stage])
            else:
                tRsR[None, m, None, stage].fill(0)

    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor, mKV: cute.Tensor, mPT: cute.Tensor, mLens: cute.Tensor,
        mO: cute.Tensor, mLSE: cute.Tensor, mWork: cute.Tensor, mOp: cute.Tensor,
        mLSEp: cute.Tensor,
        scale_log2: cutlass.Float32, scale_ln: cutlass.Float32, v_scale: cutlass.Float32,
        s_q: cutlass.Int32, num_heads: cutlass.Int32,
        sQ_layout: cute.ComposedLayout, sP_layout: cute.ComposedLayout,
        sR_layout: cute.ComposedLayout, sRed_layout: cute.Layout,
        g2s_raw: cute.TiledCopy, g2r_q: cute.TiledCopy, r2s_q: cute.TiledCopy,
        mma: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
    ):
        mt = self.mma_dtype
        bm = self.block_m
        cute.arch.griddepcontrol_launch_dependents()  # PDL trigger for the combine (combine.MLACombine)
        tidx, _, _ = cute.arch.thread_idx()
        m_block, wi, _ = cute.arch.block_idx()
        lane = tidx % 32
        warp_n = (tidx // 32) // self.m_warps  # atom layout (m_warps, NW_N, 1), column-major
        lq, lk, lv, lo = self._perm_layouts(bm, self.stages)

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
            sQ = storage.sQ.get_tensor(sQ_layout)
            sR = storage.sR.get_tensor(sR_layout)
            sP = storage.sP.get_tensor(sP_layout)
            sRed = storage.sRed.get_tensor(sRed_layout)
            sQ_phys = cute.composition(sQ, lq)  # (row, physical dim) view of sQ
            sK_log = cute.composition(sR, lk)  # (token, logical k, stage)
            sV_log = cute.composition(sR, lv)  # (logical n, token, stage)

            # ---------------- prologue: first KV tiles ----------------
            cKV = cute.make_identity_tensor((BLOCK_N, D_QK))
            thr_g2s_raw = g2s_raw.get_slice(tidx)
            tRcR = thr_g2s_raw.partition_S(cKV)
            tRsR = thr_g2s_raw.partition_D(sR)  # (CPY, N, K, stages)
            for p in cutlass.range_constexpr(self.stages - 1):
                if n_start + p < n_end:
                    self.load_tile(g2s_raw, mKV, mPT, b, n_start + p, p, blocks_per_page,
                                   kv_len, tRcR, tRsR, thr_g2s_raw)
                cute.arch.cp_async_commit_group()

            # ---------------- Q: gmem -> fp16 -> sQ (logical k order; rows >= R zero) -------
            gQ = cute.local_tile(mQ[b, None, None], (bm, D_QK), (m_block, 0))
            cQ = cute.local_tile(cute.make_identity_tensor((mQ.shape[1], D_QK)), (bm, D_QK), (m_block, 0))
            thr_q = g2r_q.get_slice(tidx)
            tQgQ = thr_q.partition_S(gQ)
            tQcQ = thr_q.partition_S(cQ)
            tQsQ = r2s_q.get_slice(tidx).partition_D(sQ_phys)
            rQ = cute.make_rmem_tensor_like(tQgQ)
            rQ.fill(0)
            for m in cutlass.range_constexpr(cute.size(tQgQ.shape[1])):
                if tQcQ[0, m, 0][0] < R:
                    cute.copy(g2r_q, tQgQ[None, m, None], rQ[None, m, None])
            rQm = cute.make_rmem_tensor_like(tQsQ, mt)
            rQm.store(rQ.load().to(mt))
            cute.copy(r2s_q, rQm, tQsQ)

            # ---------------- MMA partitions ----------------
            thr = mma.get_slice(tidx)
            tSrQ = thr.make_fragment_A(thr.partition_A(sQ))
            tOrP = thr.make_fragment_A(thr.partition_A(sP))
            # B operands straight from the fp8 staging tile
            tSsK = thr.partition_B(sK_log)  # ((2,2), NB, KB=36, stages) fp8
            tSsK = cute.logical_divide(tSsK, (None, None, 4, None))  # KB -> (4 k-blocks, 9 chunks)
            tSrK = thr.make_fragment_B(thr.partition_B(sK_log[None, None, 0]))  # fp16 ((2,2), NB, 36)
            tSrK = cute.logical_divide(tSrK, (None, None, 4))
            tOsV = thr.partition_B(sV_log)  # ((2,2), NBo=16, KBo=4, stages) fp8
            tOsV = cute.logical_divide(tOsV, (None, 4, None, None))  # NBo -> (4 r, 4 a)
            tOrV = thr.make_fragment_B(thr.partition_B(sV_log[None, None, 0]))  # fp16
            tOrV = cute.logical_divide(tOrV, (None, 4, None))
            acc_O = cute.make_rmem_tensor(thr.partition_shape_C((bm, D_V)), cutlass.Float32)
            acc_O.fill(0.0)

            ldsm = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), mt)
            s2r_Q = cute.make_tiled_copy_A(ldsm, mma).get_slice(tidx)
            s2r_P = cute.make_tiled_copy_A(ldsm, mma).get_slice(tidx)
            tSsQ = s2r_Q.partition_S(sQ)
            tSrQ_v = s2r_Q.retile(tSrQ)
            tOsP = s2r_P.partition_S(sP)
            tOrP_v = s2r_P.retile(tOrP)
            ld128 = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.kv_dtype, num_bits_per_copy=128)
            ld32 = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.kv_dtype, num_bits_per_copy=32)
            r2s_P = cute.make_tiled_copy_C(cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), mt), mma)
            thr_r2s_P = r2s_P.get_slice(tidx)
            tPsP = thr_r2s_P.partition_D(sP)

            cS = cute.make_identity_tensor((bm, BLOCK_N))
            tScS = _acc_mn_view(thr.partition_C(cS))
            n_rows = cute.size(tScS.shape[0])
            row_lim = cute.make_rmem_tensor((n_rows,), cutlass.Int32)
            for r in cutlass.range_constexpr(n_rows):
                grow = m_block * bm + tScS[r, 0][0]
                row_lim[r] = kv_len - s_q + grow // num_heads + 1
            row_max = cute.make_rmem_tensor((n_rows,), cutlass.Float32)
            row_sum = cute.make_rmem_tensor((n_rows,), cutlass.Float32)
            row_max.fill(-cutlass.Float32.inf)
            row_sum.fill(0.0)

            acc_O_mn = _acc_mn_view(acc_O)
            is_quad_leader = lane % 4 == 0
            n_nb = cute.size(tSrK.shape[1])  # 8-token n-blocks of S per warp (2)
            s_shape = thr.partition_shape_C((bm, BLOCK_N))

            for n in cutlass.range(n_start, n_end, 1):
                it = n - n_start
                st = it % self.stages
                cute.arch.cp_async_wait_group(self.stages - 2)
                cute.arch.barrier()
                if n + self.stages - 1 < n_end:
                    self.load_tile(g2s_raw, mKV, mPT, b, n + self.stages - 1,
                                   (it + self.stages - 1) % self.stages, blocks_per_page,
                                   kv_len, tRcR, tRsR, thr_g2s_raw)
                cute.arch.cp_async_commit_group()

                # ---------------- S = Q K^T (this warp's 16 kv columns) ----------------
                accs = []
                for a in cutlass.range_constexpr(self.s_accs):
                    acc_a = cute.make_rmem_tensor(s_shape, cutlass.Float32)
                    acc_a.fill(0.0)
                    accs.append(acc_a)
                rK8 = cute.make_rmem_tensor(cute.make_layout(((2, 2), 4)), self.kv_dtype)
                for c in cutlass.range_constexpr(N_CHUNK):
                    for nb in cutlass.range_constexpr(n_nb):
                        # 16 consecutive fp8 bytes of one token = B of 4 k-blocks
                        cute.copy(ld128, cute.group_modes(tSsK[None, nb, (None, c), st], 0, 2),
                                  cute.group_modes(rK8, 0, 2))
                        tSrK[None, nb, (None, c)].store(rK8.load().to(mt))
                    for i in cutlass.range_constexpr(4):
                        k = 4 * c + i
                        cute.copy(s2r_Q, tSsQ[None, None, k], tSrQ_v[None, None, k])
                        acc_k = accs[k % self.s_accs]
                        cute.gemm(mma, acc_k, tSrQ[None, None, k], tSrK[None, None, (i, c)], acc_k)
                acc_S = accs[0]
                if cutlass.const_expr(self.s_accs == 4):
                    acc_S.store((accs[0].load() + accs[1].load()) + (accs[2].load() + accs[3].load()))
                if cutlass.const_expr(self.s_accs == 2):
                    acc_S.store(accs[0].load() + accs[1].load())

                # ---------------- mask, local row max -> sRed ----------------
                acc_S_mn = _acc_mn_view(acc_S)
                for r in cutlass.range_constexpr(n_rows):
                    lim = row_lim[r] - n * BLOCK_N
                    for cc in cutlass.range_constexpr(cute.size(acc_S_mn.shape[1])):
                        if tScS[0, cc][1] >= lim:
                            acc_S_mn[r, cc] = -cutlass.Float32.inf
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

                # ---------------- O += P V (this warp's 128 columns) ----------------
                # per (k-block, group a of 4 n-blocks): 4 tokens x one 32-bit load of 4
                # consecutive dims, bytes regrouped into (token, token') pairs, converted
                rV8 = cute.make_rmem_tensor(cute.make_layout((4, 4)), self.kv_dtype)  # (r, v)
                # bytes in (token e of pair, dim r % 2, token pair, dim r // 2) order: each
                # 32-bit word = one 2-source byte shuffle, each half = one B register
                rB8 = cute.make_rmem_tensor(cute.make_layout(16), self.kv_dtype)
                nkv = cute.size(tOsP.shape[2])
                for kb in cutlass.range_constexpr(nkv):
                    cute.copy(s2r_P, tOsP[None, None, kb], tOrP_v[None, None, kb])
                    for a in cutlass.range_constexpr(4):
                        for v in cutlass.range_constexpr(4):
                            cute.copy(ld32, tOsV[v, (None, a), kb, st], rV8[None, v])
                        for v in cutlass.range_constexpr(4):
                            for r4 in cutlass.range_constexpr(4):
                                rB8[_pv_index(v, r4)] = rV8[r4, v]
                        rB16 = cute.make_rmem_tensor(cute.make_layout(16), mt)
                        rB16.store(rB8.load().to(mt))
                        for v in cutlass.range_constexpr(4):
                            for r4 in cutlass.range_constexpr(4):
                                tOrV[v, (r4, a), kb] = rB16[_pv_index(v, r4)]
                    cute.gemm(mma, acc_O, tOrP[None, None, kb], tOrV[None, None, kb], acc_O)

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
            cO = cute.make_identity_tensor((bm, D_V))
            tOcO = _acc_mn_view(thr.partition_C(cO))
            if slot < 0:
                self.store_rows(mO, mLSE, b, acc_O_mn, row_scale, row_lse, tOcO, thr, lo, m_block, R, lse_writer)
            else:
                self.store_rows(mOp, mLSEp, slot, acc_O_mn, row_scale, row_lse, tOcO, thr, lo, m_block, R,
                                lse_writer)

    @cute.jit
    def store_rows(
        self, mRows: cute.Tensor, mL: cute.Tensor, i: cutlass.Int32, acc_O_mn: cute.Tensor, row_scale: cute.Tensor,
        row_lse: cute.Tensor, tOcO: cute.Tensor, thr, lo: cute.Layout, m_block: cutlass.Int32, R: cutlass.Int32,
        lse_writer,
    ):
        """The epilogue's rows into mRows[i] (R, 512): out[b] in q's dtype (i = b, slot -1) or partial slot i in the
        partial buffer's dtype, through the permuted output columns `lo`, and their lse into mL[i]."""
        bm = self.block_m
        gO = cute.local_tile(mRows[i, None, None], (bm, D_V), (m_block, 0))
        tOgO = _acc_mn_view(thr.partition_C(cute.composition(gO, lo)))
        for r in cutlass.range_constexpr(cute.size(acc_O_mn.shape[0])):
            grow = m_block * bm + tOcO[r, 0][0]
            if grow < R:
                tOgO[r, None].store((acc_O_mn[r, None].load() * row_scale[r]).to(mRows.element_type))
                if lse_writer:
                    mL[i, grow] = row_lse[r]


# ---- host helpers (api.mla_decode_sm90 keeps using sm90_decode) ----


S_ACCS_TAG = "s_accs"


def s_accs_spec(s_accs: int) -> tuple:
    """Kernel-cache key suffix for MLADecodePartialFP8Reg's s_accs: () for the default 1 (keys and symbols
    unchanged), ("s_accs<n>",) otherwise."""
    return () if s_accs == 1 else (f"{S_ACCS_TAG}{s_accs}",)


def s_accs_from_tags(tags) -> int:
    """The s_accs a kernel-cache key's trailing tags name (s_accs_spec), 1 without one."""
    found = [int(t[len(S_ACCS_TAG):]) for t in tags if isinstance(t, str) and t.startswith(S_ACCS_TAG)]
    return found[-1] if found else 1


def _build_partial_fp8(q_name: str, kv_name: str, block_m: int, layout, stages: int, *tags: str):
    from . import api

    k = MLADecodePartialFP8Reg(api._cutlass_dtype(q_name), api._cutlass_dtype(kv_name), block_m,
                               layout, stages, s_accs=s_accs_from_tags(tags))
    return api.compile_partial(k, q_name, kv_name, tags)


def get_partial_kernel_fp8(q_name: str, block_m: int, layout=None, stages: int = 2, partial: str = "fp32",
                           s_accs: int = 1):
    """Compiled fp8-register partial kernel for (q dtype, BLOCK_M); KV fp8-e4m3.

    Same kernel cache as api.get_partial_kernel (memory, disk, else compile),
    under its own kind ``partial_fp8reg``.
    """
    from . import api, kernel_cache

    if layout is not None:
        layout = tuple(layout)
    return kernel_cache.get_or_build("partial_fp8reg", (q_name, "fp8_e4m3", block_m, layout, stages)
                                     + api.partial_spec(partial) + s_accs_spec(s_accs), _build_partial_fp8)


def mla_decode_sm90_fp8(q, kv_cache, page_table, kv_lens, sm_scale: float, kv_scale: float,
                        out, lse, schedule, workspace, *, check: bool = True, layout=None,
                        stages: int = 2, s_accs: int = 1):
    """``api.mla_decode_sm90`` with this partial kernel (same arguments and contract).

    Needs an fp8-e4m3 KV cache and s_q * H <= 32 (BLOCK_M 16 / 32).  Meant to run
    two CTAs per SM: build the schedule with ``make_schedule(..., ctas_per_sm=2)``
    (any schedule is correct; that one fills the GPU).
    """
    import torch

    from . import api

    if check:
        api.check_call(q, kv_cache, page_table, kv_lens, out, lse, schedule)
        if kv_cache.dtype != torch.float8_e4m3fn:
            raise ValueError("fp8 variant: kv_cache must be float8_e4m3fn")
        if schedule.block_m not in (16, 32):
            raise ValueError(f"fp8 variant: s_q * H must be <= 32, got {schedule.rows}")
    partial = get_partial_kernel_fp8(api._TORCH_TO_NAME[q.dtype], schedule.block_m, layout, stages,
                                     partial=api.partial_name(workspace), s_accs=s_accs)
    return api.launch(partial, q, kv_cache, page_table, kv_lens, sm_scale, kv_scale, out, lse, schedule,
                      workspace)
