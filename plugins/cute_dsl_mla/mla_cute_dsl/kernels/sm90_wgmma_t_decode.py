"""SM90 MLA decode, split-KV partial kernel, *transposed* WGMMA, few query rows
(s_q * H <= 32), fp8 e4m3 or q-dtype KV.  GPU-verified on an H200 (branch wgmma-t, even split).

Same host interface as ``sm90_decode.MLADecodePartial`` (same arguments, work items,
partial buffers, combine kernel); helpers ``get_partial_kernel_wgmma_t`` (kernel cache
kind ``partial_wgmma_t``) and ``mla_decode_sm90_wgmma_t``; ``backend.py`` runs it for
option mma=wgmma_t, and its balanced mode for mma=auto on steps of >= 640 KV blocks at
17-32 rows with a 16-bit cache (WGMMA_T_AUTO_MIN_BLOCKS; the mma.sync balanced kernel on
smaller steps). That per-step swap is CUDA-graph safe only while the two balanced entries
take identical arguments (``api.launch_balanced``), grid and combine over the same
schedule, workspace and buffers: keep them so.

Balanced mode (``MLADecodePartialWGMMAT(balanced=True).call_balanced``, bf16/fp16 KV only;
``mla_decode_sm90_wgmma_t_balanced``, cache kind ``partial_wgmma_t_balanced``; GPU-verified on an
H200, eighth session, docs/results/gpu9_wgmma_t_balanced/): the grid is (m-blocks, schedule.num_cols), fixed per decoder, and CTA column c walks
work rows cta_ranges[c] .. cta_ranges[c + 1] - 1 of a ``make_schedule(..., balanced=True)``
schedule (either form of the hybrid plan; the same buffers, slots and combine as the
mma.sync balanced kernel).  The mbarriers are set up once per CTA; the producers and the
consumer walk the same rows and count the tiles they passed, so the ring's stage and phase
of the column's gi-th tile are ``ring_slot(gi)`` across item boundaries (items of one tile,
columns with no item).  Per item the consumer passes a barrier, reloads Q when the request
changes, resets its row state, runs the tiles and writes its epilogue (out + lse for slot -1,
else the partial slot) while the producers already fill the ring with the next item's tiles.

Formulation (tokens are WGMMA's M, the 16 / 32 packed query rows its N):

    S^T[64 tok x R]  = K[64 x 576] . Q^T     A = sK tile (K-major SW128), B = sQ (K-major)
    O^T[512 x R]    += V^T[512 x 64] . P^T   A = the same sK bytes read MN-major (its first
                                             512 columns), B = sP [R x 64] (K-major)

so no MMA is padded to 64 rows.  R = ``block_m`` (16 or 32; rows >= s_q * H are zero in
sQ and never written).

CTA = 3 warpgroups (384 threads):

* WG0, the consumer (``setmaxnreg`` 240): Q (gmem -> MMA dtype -> sQ, once), then per
  tile: wait full[stage]; 36 WGMMA m64nRk16 (S^T); mask (-inf) + column max (2 values,
  butterfly over lanes xor 4/8/16, one value per (warp, column) through sRed, named barrier);
  online softmax down the columns (the running max is identical in every thread, so the row
  sum is a per-thread partial reduced once in the epilogue); O^T *= rescale; P^T (MMA dtype)
  -> sP through a (token, row) view of sP; async-proxy fence, named barrier; 32 WGMMA
  m64nRk16 (8 M-blocks x 4 k-steps) for O^T; wait; arrive empty[stage].
* WG1 + WG2, the producers (``setmaxnreg`` 128, 256 threads): fill the 2-stage fp16 ring.
  fp8 KV: ld.global 8 e4m3 per thread-copy into registers (18 per thread per tile), two
  tiles in registers ahead of the ring; per tile wait empty[stage], 4
  ``cvt.rn.f16x2.e4m3x2`` + one 128-bit st.shared per 8 elements (rows >= kv_len selected
  to 0: page tails may hold NaN), async-proxy fence, arrive full[stage] (count 256).
  16-bit KV: cp.async 16 B per copy (rows >= kv_len zero-filled), then
  ``cp.async.mbarrier.arrive.noinc`` + a plain arrive (count 512).
* fp8 KV: MMAs in fp16 (e4m3 -> f16 exact; q converted on load, |q| < 65504) and kv_scale
  folded into scale_log2 / scale_ln and the epilogue's v_scale, as in the other fp8 kernels.
* Fully masked rows (length 0, or < s_q for the causal rows): out = 0, lse = -inf.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync, warpgroup

D_QK = 576
D_V = 512
BLOCK_N = 64
WG_THREADS = 128
NUM_THREADS = 3 * WG_THREADS  # consumer WG0 + producers WG1, WG2
PROD_THREADS = 2 * WG_THREADS
STAGES = 2  # fp16 K tiles in smem
# setmaxnreg draws from a per-CTA pool that holds only what the CTA got at launch: the cubin's
# register count (168 for 384 threads, .minnctapersm 1: 65,536 / 384 rounded down to 8) times
# 384 = 64,512, not the SM's 65,536.  setmaxnreg.inc blocks until the pool can pay, so a split
# over 64,512 waits forever (240 / 136 = 65,536 hung on the H200).  Here 240 * 128 + 128 * 256
# = 63,488 (1,024 spare): the producers release (168 - 128) * 256 = 10,240, the consumer takes
# (240 - 168) * 128 = 9,216.
REGS_AT_LAUNCH = (65536 // NUM_THREADS) // 8 * 8  # 168; pinned against the cubin by the tests
CONSUMER_REGS = 240
PRODUCER_REGS = 128


def register_split_fits(consumer_regs: int = CONSUMER_REGS, producer_regs: int = PRODUCER_REGS,
                        regs_at_launch: int = REGS_AT_LAUNCH) -> bool:
    """True when the consumer warpgroup's setmaxnreg.inc can be paid from what the producer
    warpgroups' setmaxnreg.dec releases (the CTA's pool; exited warps are not counted on)."""
    released = (regs_at_launch - producer_regs) * PROD_THREADS
    needed = (consumer_regs - regs_at_launch) * WG_THREADS
    return producer_regs <= regs_at_launch <= consumer_regs and needed <= released


assert register_split_fits(), "setmaxnreg split exceeds the CTA's register pool (would hang)"

# Diagnostics only (benchmarks/wgmma_t_hang_probe.py --no-setmaxnreg): False compiles without
# setmaxnreg (every warp keeps its launch registers; the consumer then spills).
USE_SETMAXNREG = True
BAR_CONSUMER = 1  # named barrier among the 128 consumer threads
SMEM_LIMIT = 232448  # bytes of dynamic smem per CTA on SM90 (227 KB)


def _acc_mn_view(acc: cute.Tensor) -> cute.Tensor:
    """View a WGMMA C fragment ((2, 2, N/8), MMA_M, MMA_N) as (M coords, N coords).

    Per thread: M (here: tokens, or output dims) = 2 rows (r, r + 8 of its warp's 16) per
    M-block; N (here: query rows) = per 8-column block 2 adjacent columns."""
    lc = cute.make_layout(acc.layout.shape)
    s, d = lc.shape, lc.stride
    mn = cute.make_layout(
        ((s[0][1], s[1]), (s[0][0], s[0][2], s[2])),
        stride=((d[0][1], d[1]), (d[0][0], d[0][2], d[2])),
    )
    return cute.make_tensor(acc.iterator, cute.composition(acc.layout, mn))


def _col_max(v):
    """Max over the 8 lanes of a warp that share lane % 4 (the 8 token rows of a column)."""
    for off in (4, 8, 16):
        v = cute.arch.fmax(v, cute.arch.shuffle_sync_bfly(v, offset=off, mask=-1, mask_and_clamp=31))
    return v


def _col_sum(v):
    for off in (4, 8, 16):
        v = v + cute.arch.shuffle_sync_bfly(v, offset=off, mask=-1, mask_and_clamp=31)
    return v


def smem_plan(block_m: int):
    """[(name, bytes, align)] of the shared storage (MMA dtype 16 bit), in order."""
    return [
        ("sK", STAGES * BLOCK_N * D_QK * 2, 1024),
        ("sQ", block_m * D_QK * 2, 1024),
        ("sP", block_m * BLOCK_N * 2, 1024),
        ("sRed", 4 * block_m * 4, 16),
        ("mbar", 2 * STAGES * 8, 8),
    ]


def smem_bytes_for(block_m: int) -> int:
    off = 0
    for _, size, align in smem_plan(block_m):
        off = -(-off // align) * align + size
    return off


def producer_schedule(T: int, stages: int = STAGES):
    """The producers' event order for T tiles (pure Python, checked by the CPU tests):
    ("setmaxnreg_dec", regs) both producer warpgroups give registers back to the CTA pool;
    ("ldg", i) issue the fp8 loads of tile i into register set i % 2; ("wait_empty", s, parity);
    ("store", i, s) convert + st.shared + fence; ("arrive_full", s).  Mirrors the kernel's
    loop over tile pairs (stage of tile i = i % 2, use = i // 2)."""
    assert stages == 2
    ev = [("setmaxnreg_dec", PRODUCER_REGS)]
    for i in range(min(T, 2)):
        ev.append(("ldg", i))
    for p in range((T + 1) // 2):
        for j in range(2):
            i = 2 * p + j
            if i < T:
                if p >= 1:
                    ev.append(("wait_empty", j, (p - 1) & 1))
                ev.append(("store", i, j))
                ev.append(("arrive_full", j))
                if i + 2 < T:
                    ev.append(("ldg", i + 2))
    return ev


def consumer_schedule(T: int, stages: int = STAGES):
    """The consumer's events: ("setmaxnreg_inc", regs) (blocks until the CTA pool can pay), then
    per tile ("wait_full", s, parity), ("arrive_empty", s)."""
    ev = [("setmaxnreg_inc", CONSUMER_REGS)]
    for i in range(T):
        s, u = i % stages, i // stages
        ev.append(("wait_full", s, u & 1))
        ev.append(("arrive_empty", s))
    return ev



# ---- balanced mode (a fixed grid of CTA columns, each walking its range of work items) ----


def ring_slot(gi: int):
    """(stage, full-barrier parity, empty-barrier parity or None) of the gi-th tile a CTA's ring
    carries.  The kernels compute exactly these expressions: with one item per CTA gi is the
    item's own tile index; in the balanced kernel it is the column's running tile count, so the
    stages and the mbarrier phases continue across item boundaries (restarting them per item would
    wait on a phase that already completed after an item with an odd tile count)."""
    st = gi % STAGES
    use = gi // STAGES
    return st, use % 2, ((use - 1) % 2 if gi >= STAGES else None)


def item_tiles(kv_start: int, kv_end: int):
    """(first 64-token block, tile count) of a work item, as the kernels compute n_start and T."""
    n_start = kv_start // BLOCK_N
    return n_start, (kv_end + BLOCK_N - 1) // BLOCK_N - n_start


def producer_schedule_balanced(item_tile_counts):
    """The balanced kernel's producer events (16-bit KV: cp.async, no register sets) for one
    column whose items hold the given tile counts (0 allowed): per tile ("wait_empty", s,
    parity) from the ring's third tile on, ("ldg", gi) + ("store", gi, s) (the cp.async),
    ("arrive_full", s)."""
    ev = [("setmaxnreg_dec", PRODUCER_REGS)]
    g = 0
    for n_tiles in item_tile_counts:
        for i in range(n_tiles):
            st, _, pe = ring_slot(g + i)
            if pe is not None:
                ev.append(("wait_empty", st, pe))
            ev += [("ldg", g + i), ("store", g + i, st), ("arrive_full", st)]
        g += n_tiles
    return ev


def consumer_schedule_balanced(item_tile_counts):
    """The balanced kernel's consumer events: per item ("item_start", k) (consumer barrier, Q
    reload when the request changes), its tiles' ("wait_full", s, parity) / ("arrive_empty", s),
    then ("epilogue", k) (its out / partial write, between items)."""
    ev = [("setmaxnreg_inc", CONSUMER_REGS)]
    g = 0
    for k, n_tiles in enumerate(item_tile_counts):
        ev.append(("item_start", k))
        for i in range(n_tiles):
            st, pf, _ = ring_slot(g + i)
            ev += [("wait_full", st, pf), ("arrive_empty", st)]
        ev.append(("epilogue", k))
        g += n_tiles
    return ev


class MLADecodePartialWGMMAT:
    """Split-KV partial kernel, transposed WGMMA (tokens = M, query rows = N), R <= 32."""

    def __init__(self, q_dtype, kv_dtype, block_m: int, balanced: bool = False):
        if q_dtype not in (cutlass.BFloat16, cutlass.Float16):
            raise TypeError(f"q dtype must be bf16 or fp16, got {q_dtype}")
        if kv_dtype is not q_dtype and kv_dtype is not cutlass.Float8E4M3FN:
            raise NotImplementedError(
                f"WGMMA-T kernel: KV cache must have the q dtype or be fp8 e4m3, got {kv_dtype}")
        if block_m not in (16, 32):
            raise ValueError(f"WGMMA-T: block_m must be 16 or 32, got {block_m}")
        self.q_dtype = q_dtype
        self.kv_dtype = kv_dtype
        self.is_fp8 = kv_dtype is cutlass.Float8E4M3FN
        self.mma_dtype = cutlass.Float16 if self.is_fp8 else q_dtype
        self.block_m = block_m
        self.num_threads = NUM_THREADS
        # balanced split-KV (schedule.make_schedule(..., balanced=True)): launched through call_balanced,
        # a fixed grid of (m-blocks, CTA columns), each CTA walking its column's work items with one
        # ring.  16-bit KV only, as the mma.sync balanced kernel: the hybrid plan's cost model
        # (item_cost 1, 10% margin) was measured with a 16-bit cache, and the fp8 producer's two-tile
        # register prefetch pairs register sets with stages (constexpr), which a running ring index
        # breaks; an fp8 cache runs the fp8reg kernel by default anyway.
        self.balanced = bool(balanced)
        if self.balanced and self.is_fp8:
            raise ValueError("balanced wgmma_t is built for bf16/fp16 KV only")

    # ------------------------------------------------------------------ host side
    def smem_bytes(self) -> int:
        return smem_bytes_for(self.block_m)

    def _smem_layouts(self):
        """SW128 layouts in elements (swizzle goes into the pointer in the kernel).

        sK (64 tok, 576, stage): K-major atoms (8 rows x 64 elements), tokens first; the A
        operand of S^T.  sV (512, 64 tok, stage): MN-major atoms over the same bytes (element
        (d, t) at the offset of sK's (t, d)); the A operand of O^T (MN-major, 16-bit).
        sQ (R, 576) and sP (R, 64): K-major; the B operands.
        """
        mt = self.mma_dtype
        bm = self.block_m
        k_atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, mt)
        mn_atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.MN_SW128, mt)
        sK = cute.tile_to_shape(k_atom, (BLOCK_N, D_QK, STAGES), (0, 1, 2))
        sQ = cute.tile_to_shape(k_atom, (bm, D_QK), (0, 1))
        sP = cute.tile_to_shape(k_atom, (bm, BLOCK_N), (0, 1))
        v_one = cute.tile_to_shape(mn_atom, (D_V, BLOCK_N), (1, 0))
        v_outer = cute.make_layout(
            (v_one.outer.shape[0], v_one.outer.shape[1], STAGES),
            stride=(v_one.outer.stride[0], v_one.outer.stride[1], BLOCK_N * D_QK),
        )
        sV = cute.make_composed_layout(v_one.inner, 0, v_outer)
        return sK, sQ, sP, sV

    def _tiled_mmas(self):
        """mma_s: S^T (64 x R per k-step), A = sK K-major, B = sQ K-major.
        mma_o: O^T (64 x R per M-block and k-step), A = sV MN-major, B = sP K-major."""
        mt = self.mma_dtype
        K = cute.nvgpu.OperandMajorMode.K
        MN = cute.nvgpu.OperandMajorMode.MN
        f32 = cutlass.Float32
        src = warpgroup.OperandSource.SMEM
        mma_s = cute.make_tiled_mma(warpgroup.MmaF16BF16Op(mt, f32, (64, self.block_m, 16), src, K, K))
        mma_o = cute.make_tiled_mma(warpgroup.MmaF16BF16Op(mt, f32, (64, self.block_m, 16), src, MN, K))
        return mma_s, mma_o

    def _copies(self):
        """Thread-value layouts (all: 8 threads per 64-column block, 8 elements per copy).

        g2r_kv8: producers (256 threads), gmem fp8 -> registers, 64 bit: a (64, 576) tile is
                 (CPY, 2, 9) per thread.
        r2s_kv:  producers, registers -> sK (MMA dtype), 128 bit (one 16-byte SW128 unit).
        g2s_kv:  producers, 16-bit KV, cp.async 128 bit: (CPY, 2, 9).
        g2r_q:   consumer (128 threads), gmem q -> registers, 128 bit: (R, 576) is (CPY, R/16, 9).
        r2s_q:   consumer, registers -> sQ (MMA dtype), 128 bit.
        """
        thr_p = cute.make_layout((PROD_THREADS // 8, 8), stride=(8, 1))
        thr_c = cute.make_layout((WG_THREADS // 8, 8), stride=(8, 1))
        v8 = cute.make_layout((1, 8))
        g2r_kv8 = cute.make_tiled_copy_tv(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), cutlass.Float8E4M3FN, num_bits_per_copy=64),
            thr_p, v8)
        r2s_kv = cute.make_tiled_copy_tv(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.mma_dtype, num_bits_per_copy=128),
            thr_p, v8)
        g2s_kv = cute.make_tiled_copy_tv(
            cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL),
                                self.mma_dtype, num_bits_per_copy=128),
            thr_p, v8)
        g2r_q = cute.make_tiled_copy_tv(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.q_dtype, num_bits_per_copy=128),
            thr_c, v8)
        r2s_q = cute.make_tiled_copy_tv(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.mma_dtype, num_bits_per_copy=128),
            thr_c, v8)
        return g2r_kv8, r2s_kv, g2s_kv, g2r_q, r2s_q

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
        assert not self.balanced, "MLADecodePartialWGMMAT(balanced=True) is launched with call_balanced"
        mt = self.mma_dtype
        bm = self.block_m
        sK_layout, sQ_layout, sP_layout, sV_layout = self._smem_layouts()
        mma_s, mma_o = self._tiled_mmas()
        mma_s_first, _ = self._tiled_mmas()

        @cute.struct
        class SharedStorage:
            sK: cute.struct.Align[cute.struct.MemRange[mt, cute.cosize(sK_layout)], 1024]
            sQ: cute.struct.Align[cute.struct.MemRange[mt, cute.cosize(sQ_layout)], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[mt, cute.cosize(sP_layout)], 1024]
            sRed: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, 4 * bm], 16]
            mbar: cute.struct.Align[cute.struct.MemRange[cutlass.Int64, 2 * STAGES], 8]

        g2r_kv8, r2s_kv, g2s_kv, g2r_q, r2s_q = self._copies()
        # S^T accumulator (C layout of mma_s) -> sP through a (token, row) view, element-wise
        r2s_P = cute.make_tiled_copy_C(cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), mt), mma_s)

        grid = (
            cute.ceil_div(cute.size(mQ.shape[1]), bm),
            cute.size(mWork.shape[0]),
            1,
        )
        self.kernel(
            mQ, mKV, mPT, mLens, mO, mLSE, mWork, mOp, mLSEp,
            scale_log2, scale_ln, v_scale, s_q, num_heads,
            sK_layout, sQ_layout, sP_layout, sV_layout,
            g2r_kv8, r2s_kv, g2s_kv, g2r_q, r2s_q, r2s_P,
            mma_s, mma_s_first, mma_o, SharedStorage,
        ).launch(grid=grid, block=[NUM_THREADS, 1, 1], stream=stream, min_blocks_per_mp=1)

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
        scale_log2: cutlass.Float32,
        scale_ln: cutlass.Float32,
        v_scale: cutlass.Float32,
        s_q: cutlass.Int32,
        num_heads: cutlass.Int32,
        stream,
    ):
        """Balanced launch: grid (m-blocks, num_cols), fixed for a decoder (the ranges' length), so a
        CUDA graph replays it with any later schedule in the same buffers, whichever form it holds."""
        assert self.balanced, "call_balanced needs MLADecodePartialWGMMAT(balanced=True)"
        mt = self.mma_dtype
        bm = self.block_m
        sK_layout, sQ_layout, sP_layout, sV_layout = self._smem_layouts()
        mma_s, mma_o = self._tiled_mmas()
        mma_s_first, _ = self._tiled_mmas()

        @cute.struct
        class SharedStorage:
            sK: cute.struct.Align[cute.struct.MemRange[mt, cute.cosize(sK_layout)], 1024]
            sQ: cute.struct.Align[cute.struct.MemRange[mt, cute.cosize(sQ_layout)], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[mt, cute.cosize(sP_layout)], 1024]
            sRed: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, 4 * bm], 16]
            mbar: cute.struct.Align[cute.struct.MemRange[cutlass.Int64, 2 * STAGES], 8]

        _, _, g2s_kv, g2r_q, r2s_q = self._copies()
        r2s_P = cute.make_tiled_copy_C(cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), mt), mma_s)

        grid = (
            cute.ceil_div(cute.size(mQ.shape[1]), bm),
            cute.size(mRanges.shape[0]) - 1,
            1,
        )
        self.kernel_balanced(
            mQ, mKV, mPT, mLens, mO, mLSE, mWork, mRanges, mOp, mLSEp,
            scale_log2, scale_ln, v_scale, s_q, num_heads,
            sK_layout, sQ_layout, sP_layout, sV_layout,
            g2s_kv, g2r_q, r2s_q, r2s_P,
            mma_s, mma_s_first, mma_o, SharedStorage,
        ).launch(grid=grid, block=[NUM_THREADS, 1, 1], stream=stream, min_blocks_per_mp=1)

    # ---------------------------------------------------------------- device side
    @cute.jit
    def ldg_tile_fp8(
        self, thr_g2r, g2r: cute.TiledCopy, mKV: cute.Tensor, mPT: cute.Tensor, b: cutlass.Int32,
        n: cutlass.Int32, blocks_per_page: cutlass.Int32, kv_len: cutlass.Int32,
        tPcK: cute.Tensor, rRaw: cute.Tensor,
    ):
        """fp8 KV block n of request b -> registers rRaw (CPY, 2, 9) (ld.global, 64 bit).
        Rows >= kv_len are not loaded (don't-care registers; the store selects 0)."""
        page = mPT[b, n // blocks_per_page]
        gK = cute.local_tile(mKV[page, None, None], (BLOCK_N, D_QK), (n % blocks_per_page, 0))
        tPgK = thr_g2r.partition_S(gK)  # (CPY, 2, 9)
        valid = kv_len - n * BLOCK_N
        for m in cutlass.range_constexpr(cute.size(tPgK.shape[1])):
            if tPcK[0, m, 0][0] < valid:
                cute.copy(g2r, tPgK[None, m, None], rRaw[None, m, None])

    @cute.jit
    def store_tile_fp8(
        self, r2s: cute.TiledCopy, n: cutlass.Int32, stage: cutlass.Constexpr, kv_len: cutlass.Int32,
        tPcK: cute.Tensor, tPsK: cute.Tensor, rRaw: cute.Tensor, mbar_full,
    ):
        """registers (fp8) -> fp16 -> sK[:, :, stage] (rows >= kv_len selected to 0), this
        thread's async-proxy fence, one arrive on full[stage] (count 256)."""
        mt = self.mma_dtype
        valid = kv_len - n * BLOCK_N
        if valid >= BLOCK_N:  # CTA-uniform: only a request's last tile has rows to zero
            for m in cutlass.range_constexpr(cute.size(tPsK.shape[1])):
                for c in cutlass.range_constexpr(cute.size(tPsK.shape[2])):
                    rH = cute.make_rmem_tensor_like(tPsK[None, m, c, stage], mt)
                    rH.store(rRaw[None, m, c].load().to(mt))
                    cute.copy(r2s, rH, tPsK[None, m, c, stage])
        else:
            for m in cutlass.range_constexpr(cute.size(tPsK.shape[1])):
                for c in cutlass.range_constexpr(cute.size(tPsK.shape[2])):
                    rH = cute.make_rmem_tensor_like(tPsK[None, m, c, stage], mt)
                    rH.store(rRaw[None, m, c].load().to(mt))
                    if tPcK[0, m, 0][0] >= valid:
                        rH.fill(0)
                    cute.copy(r2s, rH, tPsK[None, m, c, stage])
        cute.arch.fence_view_async_shared()
        cute.arch.mbarrier_arrive(mbar_full)

    @cute.jit
    def load_tile_16(
        self, thr_g2s, g2s: cute.TiledCopy, mKV: cute.Tensor, mPT: cute.Tensor, b: cutlass.Int32,
        n: cutlass.Int32, stage: cutlass.Int32, blocks_per_page: cutlass.Int32, kv_len: cutlass.Int32,
        tPcK: cute.Tensor, tPsK: cute.Tensor, mbar_full,
    ):
        """16-bit KV block n -> sK[:, :, stage] by cp.async (rows >= kv_len zero-filled), then
        arrive on full[stage] once when the copies land (noinc) and once now (count 512)."""
        page = mPT[b, n // blocks_per_page]
        gK = cute.local_tile(mKV[page, None, None], (BLOCK_N, D_QK), (n % blocks_per_page, 0))
        tPgK = thr_g2s.partition_S(gK)
        valid = kv_len - n * BLOCK_N
        for m in cutlass.range_constexpr(cute.size(tPsK.shape[1])):
            if tPcK[0, m, 0][0] < valid:
                cute.copy(g2s, tPgK[None, m, None], tPsK[None, m, None, stage])
            else:
                tPsK[None, m, None, stage].fill(0)
        cute.arch.fence_view_async_shared()
        cute.arch.cp_async_mbarrier_arrive_noinc(mbar_full)
        cute.arch.mbarrier_arrive(mbar_full)

    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor, mKV: cute.Tensor, mPT: cute.Tensor, mLens: cute.Tensor,
        mO: cute.Tensor, mLSE: cute.Tensor, mWork: cute.Tensor, mOp: cute.Tensor,
        mLSEp: cute.Tensor,
        scale_log2: cutlass.Float32, scale_ln: cutlass.Float32, v_scale: cutlass.Float32,
        s_q: cutlass.Int32, num_heads: cutlass.Int32,
        sK_layout: cute.ComposedLayout, sQ_layout: cute.ComposedLayout,
        sP_layout: cute.ComposedLayout, sV_layout: cute.ComposedLayout,
        g2r_kv8: cute.TiledCopy, r2s_kv: cute.TiledCopy, g2s_kv: cute.TiledCopy,
        g2r_q: cute.TiledCopy, r2s_q: cute.TiledCopy, r2s_P: cute.TiledCopy,
        mma_s: cute.TiledMma, mma_s_first: cute.TiledMma, mma_o: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
    ):
        bm = self.block_m
        cute.arch.griddepcontrol_launch_dependents()  # PDL trigger for the combine (combine.MLACombine)
        tidx, _, _ = cute.arch.thread_idx()
        m_block, wi, _ = cute.arch.block_idx()
        wg = cute.arch.make_warp_uniform(tidx // WG_THREADS)

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
            T = n_end - n_start  # tiles of this item (>= 0)

            smem = cutlass.utils.SmemAllocator()
            storage = smem.allocate(SharedStorage)
            sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
            sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
            sP = storage.sP.get_tensor(sP_layout.outer, swizzle=sP_layout.inner)
            sV = cute.make_tensor(cute.recast_ptr(sK.iterator, sV_layout.inner), sV_layout.outer)
            sRed = storage.sRed.get_tensor(cute.make_layout((4, bm), stride=(bm, 1)))
            mbar = storage.mbar.data_ptr()  # full[s] = mbar + s, empty[s] = mbar + STAGES + s

            if tidx == 0:
                for s in cutlass.range_constexpr(STAGES):
                    # fp8: 256 plain arrives; 16-bit: 256 noinc (cp.async) + 256 plain
                    cute.arch.mbarrier_init(mbar + s, PROD_THREADS if self.is_fp8 else 2 * PROD_THREADS)
                    cute.arch.mbarrier_init(mbar + STAGES + s, WG_THREADS)
            cute.arch.mbarrier_init_fence()
            cute.arch.barrier()

            if wg == 0:
                if cutlass.const_expr(USE_SETMAXNREG):
                    cute.arch.setmaxregister_increase(CONSUMER_REGS)
                self.consumer(
                    mQ, mO, mLSE, mOp, mLSEp, b, m_block, slot, kv_len, R, n_start, T,
                    scale_log2, scale_ln, v_scale, s_q, num_heads,
                    sK, sQ, sP, sV, sRed, mbar, g2r_q, r2s_q, r2s_P, mma_s, mma_s_first, mma_o,
                )
            else:
                if cutlass.const_expr(USE_SETMAXNREG):
                    cute.arch.setmaxregister_decrease(PRODUCER_REGS)
                ptid = tidx - WG_THREADS
                cKV = cute.make_identity_tensor((BLOCK_N, D_QK))
                if cutlass.const_expr(self.is_fp8):
                    thr_g2r = g2r_kv8.get_slice(ptid)
                    tPcK = thr_g2r.partition_S(cKV)  # (CPY, 2, 9) coordinates
                    tPsK = r2s_kv.get_slice(ptid).partition_D(sK)  # (CPY, 2, 9, STAGES)
                    shape_r = (cute.size(tPcK.shape[0]), cute.size(tPcK.shape[1]), cute.size(tPcK.shape[2]))
                    rA = cute.make_rmem_tensor(shape_r, cutlass.Float8E4M3FN)
                    rB = cute.make_rmem_tensor(shape_r, cutlass.Float8E4M3FN)
                    if T > 0:
                        self.ldg_tile_fp8(thr_g2r, g2r_kv8, mKV, mPT, b, n_start, blocks_per_page,
                                          kv_len, tPcK, rA)
                    if T > 1:
                        self.ldg_tile_fp8(thr_g2r, g2r_kv8, mKV, mPT, b, n_start + 1, blocks_per_page,
                                          kv_len, tPcK, rB)
                    # tile pairs (i, i + 1) = stages (0, 1); use p of each stage
                    for p in cutlass.range(0, (T + 1) // 2, 1):
                        i = 2 * p
                        if p >= 1:
                            cute.arch.mbarrier_wait(mbar + STAGES + 0, (p - 1) % 2)
                        self.store_tile_fp8(r2s_kv, n_start + i, 0, kv_len, tPcK, tPsK, rA, mbar + 0)
                        if i + 2 < T:
                            self.ldg_tile_fp8(thr_g2r, g2r_kv8, mKV, mPT, b, n_start + i + 2,
                                              blocks_per_page, kv_len, tPcK, rA)
                        if i + 1 < T:
                            if p >= 1:
                                cute.arch.mbarrier_wait(mbar + STAGES + 1, (p - 1) % 2)
                            self.store_tile_fp8(r2s_kv, n_start + i + 1, 1, kv_len, tPcK, tPsK, rB,
                                                mbar + 1)
                            if i + 3 < T:
                                self.ldg_tile_fp8(thr_g2r, g2r_kv8, mKV, mPT, b, n_start + i + 3,
                                                  blocks_per_page, kv_len, tPcK, rB)
                else:
                    thr_g2s = g2s_kv.get_slice(ptid)
                    tPcK = thr_g2s.partition_S(cKV)
                    tPsK = thr_g2s.partition_D(sK)  # (CPY, 2, 9, STAGES)
                    for i in cutlass.range(0, T, 1):
                        st = i % STAGES
                        if i >= STAGES:
                            cute.arch.mbarrier_wait(mbar + STAGES + st, (i // STAGES - 1) % 2)
                        self.load_tile_16(thr_g2s, g2s_kv, mKV, mPT, b, n_start + i, st, blocks_per_page,
                                          kv_len, tPcK, tPsK, mbar + st)

    @cute.kernel
    def kernel_balanced(
        self,
        mQ: cute.Tensor, mKV: cute.Tensor, mPT: cute.Tensor, mLens: cute.Tensor,
        mO: cute.Tensor, mLSE: cute.Tensor, mWork: cute.Tensor, mRanges: cute.Tensor,
        mOp: cute.Tensor, mLSEp: cute.Tensor,
        scale_log2: cutlass.Float32, scale_ln: cutlass.Float32, v_scale: cutlass.Float32,
        s_q: cutlass.Int32, num_heads: cutlass.Int32,
        sK_layout: cute.ComposedLayout, sQ_layout: cute.ComposedLayout,
        sP_layout: cute.ComposedLayout, sV_layout: cute.ComposedLayout,
        g2s_kv: cute.TiledCopy, g2r_q: cute.TiledCopy, r2s_q: cute.TiledCopy, r2s_P: cute.TiledCopy,
        mma_s: cute.TiledMma, mma_s_first: cute.TiledMma, mma_o: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
    ):
        """Balanced split-KV: CTA (m_block, column) runs the work rows mRanges[column] ..
        mRanges[column + 1] - 1 (rows with b < 0 skipped).  The mbarriers are set up once; the
        producers and the consumer walk the same rows (read independently from mWork) and count
        the tiles they have passed (g), so the ring's stages and phases continue across items,
        also past items of one tile and columns with no item (both loops then do nothing)."""
        cute.arch.griddepcontrol_launch_dependents()  # PDL trigger for the combine (combine.MLACombine)
        tidx, _, _ = cute.arch.thread_idx()
        m_block, col, _ = cute.arch.block_idx()
        wg = cute.arch.make_warp_uniform(tidx // WG_THREADS)
        i_begin = mRanges[col]
        i_end = mRanges[col + 1]
        R = mQ.shape[1]
        blocks_per_page = mKV.shape[1] // BLOCK_N

        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sP = storage.sP.get_tensor(sP_layout.outer, swizzle=sP_layout.inner)
        sV = cute.make_tensor(cute.recast_ptr(sK.iterator, sV_layout.inner), sV_layout.outer)
        sRed = storage.sRed.get_tensor(cute.make_layout((4, self.block_m), stride=(self.block_m, 1)))
        mbar = storage.mbar.data_ptr()  # full[s] = mbar + s, empty[s] = mbar + STAGES + s

        if tidx == 0:
            for s in cutlass.range_constexpr(STAGES):
                # 256 noinc (cp.async) + 256 plain arrives per fill; 128 consumer arrives per release
                cute.arch.mbarrier_init(mbar + s, 2 * PROD_THREADS)
                cute.arch.mbarrier_init(mbar + STAGES + s, WG_THREADS)
        cute.arch.mbarrier_init_fence()
        cute.arch.barrier()

        if wg == 0:
            if cutlass.const_expr(USE_SETMAXNREG):
                cute.arch.setmaxregister_increase(CONSUMER_REGS)
            self.consumer_column(
                mQ, mLens, mO, mLSE, mWork, mOp, mLSEp, i_begin, i_end, m_block, R,
                scale_log2, scale_ln, v_scale, s_q, num_heads,
                sK, sQ, sP, sV, sRed, mbar, g2r_q, r2s_q, r2s_P, mma_s, mma_s_first, mma_o,
            )
        else:
            if cutlass.const_expr(USE_SETMAXNREG):
                cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            self.producer_column_16(mKV, mPT, mLens, mWork, i_begin, i_end, blocks_per_page, sK, mbar, g2s_kv)

    @cute.jit
    def producer_column_16(
        self, mKV: cute.Tensor, mPT: cute.Tensor, mLens: cute.Tensor, mWork: cute.Tensor,
        i_begin: cutlass.Int32, i_end: cutlass.Int32, blocks_per_page: cutlass.Int32,
        sK: cute.Tensor, mbar, g2s_kv: cute.TiledCopy,
    ):
        """Warpgroups 1 + 2 of the balanced kernel: every tile of every item of the column into the
        ring (cp.async, 16-bit KV), the ring position gi = g + i running across items (ring_slot)."""
        tidx, _, _ = cute.arch.thread_idx()
        ptid = tidx - WG_THREADS
        cKV = cute.make_identity_tensor((BLOCK_N, D_QK))
        thr_g2s = g2s_kv.get_slice(ptid)
        tPcK = thr_g2s.partition_S(cKV)
        tPsK = thr_g2s.partition_D(sK)  # (CPY, 2, 9, STAGES)
        g = cutlass.Int32(0)
        for wi in cutlass.range(i_begin, i_end, 1):
            b = mWork[wi, 0]
            if b >= 0:
                kv_len = mLens[b]
                n_start = mWork[wi, 1] // BLOCK_N
                T = (mWork[wi, 2] + BLOCK_N - 1) // BLOCK_N - n_start
                for i in cutlass.range(0, T, 1):
                    gi = g + i
                    st = gi % STAGES
                    if gi >= STAGES:
                        cute.arch.mbarrier_wait(mbar + STAGES + st, (gi // STAGES - 1) % 2)
                    self.load_tile_16(thr_g2s, g2s_kv, mKV, mPT, b, n_start + i, st, blocks_per_page,
                                      kv_len, tPcK, tPsK, mbar + st)
                g = g + T

    @cute.jit
    def consumer_column(
        self, mQ: cute.Tensor, mLens: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor, mWork: cute.Tensor,
        mOp: cute.Tensor, mLSEp: cute.Tensor, i_begin: cutlass.Int32, i_end: cutlass.Int32,
        m_block: cutlass.Int32, R: cutlass.Int32,
        scale_log2: cutlass.Float32, scale_ln: cutlass.Float32, v_scale: cutlass.Float32,
        s_q: cutlass.Int32, num_heads: cutlass.Int32,
        sK: cute.Tensor, sQ: cute.Tensor, sP: cute.Tensor, sV: cute.Tensor, sRed: cute.Tensor, mbar,
        g2r_q: cute.TiledCopy, r2s_q: cute.TiledCopy, r2s_P: cute.TiledCopy,
        mma_s: cute.TiledMma, mma_s_first: cute.TiledMma, mma_o: cute.TiledMma,
    ):
        """Warpgroup 0 of the balanced kernel: per item of the column a consumer barrier (the
        previous epilogue's sRed reads before this item's first column max), Q when the request
        changes (sQ is read only by S^T WGMMAs, all waited by then), fresh row state, the tiles at
        ring positions g + i, the epilogue (out + lse for slot -1, else the partial slot)."""
        tidx, _, _ = cute.arch.thread_idx()
        lane = tidx % 32
        warp = tidx // 32
        (tSrK, tSrQ, s_shape, tScS, n_tok, n_col, thr_o, tOrV, tOrP, acc_O, acc_O_mn, r2s_P_thr,
         tPsP) = self.consumer_partitions(sK, sQ, sP, sV, r2s_P, mma_s, mma_s_first, mma_o)
        col_lim = cute.make_rmem_tensor((n_col,), cutlass.Int32)
        col_max = cute.make_rmem_tensor((n_col,), cutlass.Float32)
        col_sum = cute.make_rmem_tensor((n_col,), cutlass.Float32)
        red_writer = lane < 4
        g = cutlass.Int32(0)
        q_of = cutlass.Int32(-1)  # request whose Q rows sQ holds
        for wi in cutlass.range(i_begin, i_end, 1):
            b = mWork[wi, 0]
            if b >= 0:
                slot = mWork[wi, 3]
                kv_len = mLens[b]
                n_start = mWork[wi, 1] // BLOCK_N
                T = (mWork[wi, 2] + BLOCK_N - 1) // BLOCK_N - n_start
                cute.arch.barrier(barrier_id=BAR_CONSUMER, number_of_threads=WG_THREADS)
                if b != q_of:
                    self.load_q(mQ, b, m_block, R, sQ, g2r_q, r2s_q)
                q_of = b
                acc_O.fill(0.0)
                self.reset_row_state(tScS, n_col, col_lim, col_max, col_sum, m_block, kv_len, s_q, num_heads)
                for i in cutlass.range(0, T, 1):
                    self.consume_tile(
                        n_start, i, g + i, scale_log2, sRed, sP, mbar, tSrK, tSrQ, s_shape, tScS, n_tok,
                        n_col, tOrV, tOrP, acc_O, acc_O_mn, r2s_P, r2s_P_thr, tPsP, col_lim, col_max,
                        col_sum, warp, red_writer, mma_s, mma_s_first, mma_o,
                    )
                self.consumer_epilogue(
                    mO, mLSE, mOp, mLSEp, b, m_block, slot, R, scale_ln, v_scale, sRed, tScS, n_col,
                    thr_o, acc_O_mn, col_max, col_sum, warp, red_writer,
                )
                g = g + T

    @cute.jit
    def consumer(
        self,
        mQ: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor, mOp: cute.Tensor, mLSEp: cute.Tensor,
        b: cutlass.Int32, m_block: cutlass.Int32, slot: cutlass.Int32, kv_len: cutlass.Int32,
        R: cutlass.Int32, n_start: cutlass.Int32, T: cutlass.Int32,
        scale_log2: cutlass.Float32, scale_ln: cutlass.Float32, v_scale: cutlass.Float32,
        s_q: cutlass.Int32, num_heads: cutlass.Int32,
        sK: cute.Tensor, sQ: cute.Tensor, sP: cute.Tensor, sV: cute.Tensor, sRed: cute.Tensor, mbar,
        g2r_q: cute.TiledCopy, r2s_q: cute.TiledCopy, r2s_P: cute.TiledCopy,
        mma_s: cute.TiledMma, mma_s_first: cute.TiledMma, mma_o: cute.TiledMma,
    ):
        """Warpgroup 0 (threads 0..127), one work item per CTA: Q, the tile loop, the epilogue.
        (The balanced kernel composes the same helpers in its column loop.)"""
        tidx, _, _ = cute.arch.thread_idx()
        lane = tidx % 32
        warp = tidx // 32

        self.load_q(mQ, b, m_block, R, sQ, g2r_q, r2s_q)
        (tSrK, tSrQ, s_shape, tScS, n_tok, n_col, thr_o, tOrV, tOrP, acc_O, acc_O_mn, r2s_P_thr,
         tPsP) = self.consumer_partitions(sK, sQ, sP, sV, r2s_P, mma_s, mma_s_first, mma_o)
        col_lim = cute.make_rmem_tensor((n_col,), cutlass.Int32)
        col_max = cute.make_rmem_tensor((n_col,), cutlass.Float32)
        col_sum = cute.make_rmem_tensor((n_col,), cutlass.Float32)  # this thread's partial sums
        self.reset_row_state(tScS, n_col, col_lim, col_max, col_sum, m_block, kv_len, s_q, num_heads)
        red_writer = lane < 4  # lanes 0..3 hold every column of the warp once

        for i in cutlass.range(0, T, 1):
            self.consume_tile(
                n_start, i, i, scale_log2, sRed, sP, mbar, tSrK, tSrQ, s_shape, tScS, n_tok, n_col,
                tOrV, tOrP, acc_O, acc_O_mn, r2s_P, r2s_P_thr, tPsP, col_lim, col_max, col_sum,
                warp, red_writer, mma_s, mma_s_first, mma_o,
            )
        self.consumer_epilogue(
            mO, mLSE, mOp, mLSEp, b, m_block, slot, R, scale_ln, v_scale, sRed, tScS, n_col,
            thr_o, acc_O_mn, col_max, col_sum, warp, red_writer,
        )

    @cute.jit
    def load_q(
        self, mQ: cute.Tensor, b: cutlass.Int32, m_block: cutlass.Int32, R: cutlass.Int32,
        sQ: cute.Tensor, g2r_q: cute.TiledCopy, r2s_q: cute.TiledCopy,
    ):
        """Q rows of request b, m-block m_block: gmem (q dtype) -> MMA dtype -> sQ (rows >= R zero),
        then the async-proxy fence and the consumer barrier the S^T WGMMAs (which read sQ) need.
        Callers make sure no S^T WGMMA of an earlier item still reads sQ (all waited)."""
        mt = self.mma_dtype
        bm = self.block_m
        tidx, _, _ = cute.arch.thread_idx()
        gQ = cute.local_tile(mQ[b, None, None], (bm, D_QK), (m_block, 0))
        cQ = cute.local_tile(cute.make_identity_tensor((mQ.shape[1], D_QK)), (bm, D_QK), (m_block, 0))
        thr_q = g2r_q.get_slice(tidx)
        tQgQ = thr_q.partition_S(gQ)  # (CPY, bm / 16, 9)
        tQcQ = thr_q.partition_S(cQ)
        tQsQ = r2s_q.get_slice(tidx).partition_D(sQ)
        for m in cutlass.range_constexpr(cute.size(tQgQ.shape[1])):
            rQ = cute.make_rmem_tensor_like(tQgQ[None, m, None])
            rQ.fill(0)
            if tQcQ[0, m, 0][0] < R:
                cute.copy(g2r_q, tQgQ[None, m, None], rQ)
            rQm = cute.make_rmem_tensor_like(tQsQ[None, m, None], mt)
            rQm.store(rQ.load().to(mt))
            cute.copy(r2s_q, rQm, tQsQ[None, m, None])
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=BAR_CONSUMER, number_of_threads=WG_THREADS)

    @cute.jit
    def consumer_partitions(
        self, sK: cute.Tensor, sQ: cute.Tensor, sP: cute.Tensor, sV: cute.Tensor,
        r2s_P: cute.TiledCopy, mma_s: cute.TiledMma, mma_s_first: cute.TiledMma, mma_o: cute.TiledMma,
    ):
        """The consumer's MMA fragments and views (item independent) and the O^T accumulator
        (zeroed): (tSrK, tSrQ, s_shape, tScS, n_tok, n_col, thr_o, tOrV, tOrP, acc_O, acc_O_mn,
        thr_r2s_P, tPsP)."""
        bm = self.block_m
        tidx, _, _ = cute.arch.thread_idx()
        mma_s.set(warpgroup.Field.ACCUMULATE, True)
        mma_s_first.set(warpgroup.Field.ACCUMULATE, False)
        mma_o.set(warpgroup.Field.ACCUMULATE, True)
        thr_s = mma_s.get_slice(tidx)
        tSrK = thr_s.make_fragment_A(thr_s.partition_A(sK))  # (MMA, 1, 36, STAGES)
        tSrQ = thr_s.make_fragment_B(thr_s.partition_B(sQ))  # (MMA, 1, 36)
        s_shape = thr_s.partition_shape_C((BLOCK_N, bm))
        cS = cute.make_identity_tensor((BLOCK_N, bm))
        tScS = _acc_mn_view(thr_s.partition_C(cS))  # (tokens (2, 1), rows (2, bm / 8, 1))
        n_tok = cute.size(tScS.shape[0])  # 2
        n_col = cute.size(tScS.shape[1])  # bm / 4

        thr_o = mma_o.get_slice(tidx)
        tOrV = thr_o.make_fragment_A(thr_o.partition_A(sV))  # (MMA, 8, 4, STAGES)
        tOrP = thr_o.make_fragment_B(thr_o.partition_B(sP))  # (MMA, 1, 4)
        acc_O = cute.make_rmem_tensor(thr_o.partition_shape_C((D_V, bm)), cutlass.Float32)
        acc_O.fill(0.0)
        acc_O_mn = _acc_mn_view(acc_O)  # (dims (2, 8), rows (2, bm / 8, 1)): same rows as tScS

        # P^T: (token, row) view of sP, written from the S^T C fragment
        sPt = cute.make_tensor(sP.iterator, cute.select(sP.layout, mode=[1, 0]))
        thr_r2s_P = r2s_P.get_slice(tidx)
        tPsP = thr_r2s_P.partition_D(sPt)
        return (tSrK, tSrQ, s_shape, tScS, n_tok, n_col, thr_o, tOrV, tOrP, acc_O, acc_O_mn, thr_r2s_P,
                tPsP)

    @cute.jit
    def reset_row_state(
        self, tScS: cute.Tensor, n_col: cutlass.Constexpr, col_lim: cute.Tensor, col_max: cute.Tensor,
        col_sum: cute.Tensor, m_block: cutlass.Int32, kv_len: cutlass.Int32, s_q: cutlass.Int32,
        num_heads: cutlass.Int32,
    ):
        """Per item: each of this thread's columns (query rows) sees tokens < col_lim (causal,
        bottom-right); running max -inf, partial sum 0."""
        bm = self.block_m
        for c in cutlass.range_constexpr(n_col):
            grow = m_block * bm + tScS[0, c][1]
            col_lim[c] = kv_len - s_q + grow // num_heads + 1
        col_max.fill(-cutlass.Float32.inf)
        col_sum.fill(0.0)

    @cute.jit
    def consume_tile(
        self, n_start: cutlass.Int32, i: cutlass.Int32, gi: cutlass.Int32, scale_log2: cutlass.Float32,
        sRed: cute.Tensor, sP: cute.Tensor, mbar, tSrK: cute.Tensor, tSrQ: cute.Tensor, s_shape,
        tScS: cute.Tensor, n_tok: cutlass.Constexpr, n_col: cutlass.Constexpr, tOrV: cute.Tensor,
        tOrP: cute.Tensor, acc_O: cute.Tensor, acc_O_mn: cute.Tensor, r2s_P: cute.TiledCopy, thr_r2s_P,
        tPsP: cute.Tensor, col_lim: cute.Tensor, col_max: cute.Tensor, col_sum: cute.Tensor,
        warp: cutlass.Int32, red_writer, mma_s: cute.TiledMma, mma_s_first: cute.TiledMma,
        mma_o: cute.TiledMma,
    ):
        """Tile i of the current item (KV block n_start + i), the gi-th tile this CTA's ring
        carries (gi = i for one item per CTA; the column's running count in the balanced kernel,
        so the ring's stages and mbarrier phases continue across items): wait full, S^T, mask,
        column max, online softmax, P^T -> sP, O^T += V^T P^T, release the stage."""
        mt = self.mma_dtype
        n = n_start + i
        st = gi % STAGES
        cute.arch.mbarrier_wait(mbar + st, (gi // STAGES) % 2)
        cute.arch.fence_view_async_shared()

        # ---- S^T = K Q^T: 36 WGMMA 64 x bm x 16 ----
        acc_S = cute.make_rmem_tensor(s_shape, cutlass.Float32)
        warpgroup.fence()
        for k in cutlass.range_constexpr(cute.size(tSrQ.shape[2])):
            mma = mma_s_first if k == 0 else mma_s
            cute.gemm(mma, acc_S, tSrK[None, None, k, st], tSrQ[None, None, k], acc_S)
        warpgroup.commit_group()
        warpgroup.wait_group(0)

        # ---- mask, column max over the warpgroup ----
        acc_S_mn = _acc_mn_view(acc_S)
        for c in cutlass.range_constexpr(n_col):
            lim = col_lim[c] - n * BLOCK_N
            if lim < BLOCK_N:  # only a row's last tiles have masked tokens
                for t in cutlass.range_constexpr(n_tok):
                    if tScS[t, 0][0] >= lim:
                        acc_S_mn[t, c] = -cutlass.Float32.inf
            m_loc = _col_max(cute.arch.fmax(acc_S_mn[0, c], acc_S_mn[1, c]))
            if red_writer:
                sRed[warp, tScS[0, c][1]] = m_loc
        cute.arch.barrier(barrier_id=BAR_CONSUMER, number_of_threads=WG_THREADS)

        # ---- online softmax down the columns; O^T *= rescale ----
        for c in cutlass.range_constexpr(n_col):
            col = tScS[0, c][1]
            m_cur = cute.arch.fmax(cute.arch.fmax(sRed[0, col], sRed[1, col]),
                                   cute.arch.fmax(sRed[2, col], sRed[3, col]))
            m_prev = col_max[c]
            m_new = cute.arch.fmax(m_prev, m_cur)
            m_use = 0.0 if m_new == -cutlass.Float32.inf else m_new
            ms = m_use * scale_log2
            p0 = cute.math.exp2(acc_S_mn[0, c] * scale_log2 - ms, fastmath=True)
            p1 = cute.math.exp2(acc_S_mn[1, c] * scale_log2 - ms, fastmath=True)
            corr = cute.math.exp2(m_prev * scale_log2 - ms, fastmath=True)
            col_sum[c] = col_sum[c] * corr + (p0 + p1)
            col_max[c] = m_new
            acc_S_mn[0, c] = p0
            acc_S_mn[1, c] = p1
            acc_O_mn[None, c] = acc_O_mn[None, c].load() * corr

        # ---- P^T -> sP (MMA dtype), visible to the async proxy and the warpgroup ----
        rP = cute.make_rmem_tensor_like(acc_S, mt)
        rP.store(acc_S.load().to(mt))
        cute.copy(r2s_P, thr_r2s_P.retile(rP), tPsP)
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=BAR_CONSUMER, number_of_threads=WG_THREADS)

        # ---- O^T += V^T P^T: 8 M-blocks x 4 k-steps ----
        warpgroup.fence()
        for k in cutlass.range_constexpr(cute.size(tOrP.shape[2])):
            cute.gemm(mma_o, acc_O, tOrV[None, None, k, st], tOrP[None, None, k], acc_O)
        warpgroup.commit_group()
        warpgroup.wait_group(0)
        cute.arch.mbarrier_arrive(mbar + STAGES + st)

    @cute.jit
    def consumer_epilogue(
        self, mO: cute.Tensor, mLSE: cute.Tensor, mOp: cute.Tensor, mLSEp: cute.Tensor,
        b: cutlass.Int32, m_block: cutlass.Int32, slot: cutlass.Int32, R: cutlass.Int32,
        scale_ln: cutlass.Float32, v_scale: cutlass.Float32, sRed: cute.Tensor, tScS: cute.Tensor,
        n_col: cutlass.Constexpr, thr_o, acc_O_mn: cute.Tensor, col_max: cute.Tensor, col_sum: cute.Tensor,
        warp: cutlass.Int32, red_writer,
    ):
        """Column sums over the warpgroup, then out (slot -1, q dtype) + lse, or the partial slot
        (fp32) + its lse.  sRed: its last readers passed the last tile's P barrier before anyone
        gets here; the balanced kernel's barrier at each item start orders the reads below before
        the next item's first column max."""
        bm = self.block_m
        tidx, _, _ = cute.arch.thread_idx()
        for c in cutlass.range_constexpr(n_col):
            s_loc = _col_sum(col_sum[c])
            if red_writer:
                sRed[warp, tScS[0, c][1]] = s_loc
        cute.arch.barrier(barrier_id=BAR_CONSUMER, number_of_threads=WG_THREADS)
        col_scale = cute.make_rmem_tensor((n_col,), cutlass.Float32)
        col_lse = cute.make_rmem_tensor((n_col,), cutlass.Float32)
        for c in cutlass.range_constexpr(n_col):
            col = tScS[0, c][1]
            s = (sRed[0, col] + sRed[1, col]) + (sRed[2, col] + sRed[3, col])
            ok = s > 0.0
            col_scale[c] = v_scale / s if ok else 0.0
            col_lse[c] = (
                col_max[c] * scale_ln + cute.math.log(s, fastmath=False) if ok else -cutlass.Float32.inf
            )
        # lse: thread 0..3 of warp 0 own distinct columns (lane % 4 picks the column pair)
        lse_writer = tidx < 4
        cO = cute.make_identity_tensor((D_V, bm))
        tOcO = _acc_mn_view(thr_o.partition_C(cO))
        if slot < 0:
            gO = cute.local_tile(mO[b, None, None], (bm, D_V), (m_block, 0))
            gOt = cute.make_tensor(gO.iterator, cute.select(gO.layout, mode=[1, 0]))  # (512, bm)
            tOgO = _acc_mn_view(thr_o.partition_C(gOt))
            for c in cutlass.range_constexpr(n_col):
                grow = m_block * bm + tOcO[0, c][1]
                if grow < R:
                    tOgO[None, c].store((acc_O_mn[None, c].load() * col_scale[c]).to(self.q_dtype))
                    if lse_writer:
                        mLSE[b, grow] = col_lse[c]
        else:
            gO = cute.local_tile(mOp[slot, None, None], (bm, D_V), (m_block, 0))
            gOt = cute.make_tensor(gO.iterator, cute.select(gO.layout, mode=[1, 0]))
            tOgO = _acc_mn_view(thr_o.partition_C(gOt))
            for c in cutlass.range_constexpr(n_col):
                grow = m_block * bm + tOcO[0, c][1]
                if grow < R:
                    tOgO[None, c].store((acc_O_mn[None, c].load() * col_scale[c]).to(mOp.element_type))
                    if lse_writer:
                        mLSEp[slot, grow] = col_lse[c]


# ---- host helpers (backend.py runs these for mma=wgmma_t) ----


def _build_partial_wgmma_t(q_name: str, kv_name: str, block_m: int, *tags: str):
    from . import api

    k = MLADecodePartialWGMMAT(api._cutlass_dtype(q_name), api._cutlass_dtype(kv_name), block_m)
    return api.compile_partial(k, q_name, kv_name, tags)


def get_partial_kernel_wgmma_t(q_name: str, kv_name: str | None = None, block_m: int = 16, partial: str = "fp32"):
    """Compiled transposed-WGMMA partial kernel for (q dtype, kv dtype, BLOCK_M 16 / 32).

    Same kernel cache as api.get_partial_kernel (memory, disk, else compile), kind
    ``partial_wgmma_t``."""
    from . import api, kernel_cache

    kv_name = kv_name or q_name
    return kernel_cache.get_or_build("partial_wgmma_t", (q_name, kv_name, block_m) + api.partial_spec(partial),
                                     _build_partial_wgmma_t)


def mla_decode_sm90_wgmma_t(q, kv_cache, page_table, kv_lens, sm_scale: float, kv_scale: float,
                            out, lse, schedule, workspace, *, check: bool = True):
    """``api.mla_decode_sm90`` with the transposed-WGMMA partial kernel (same arguments and
    contract).  Needs s_q * H <= 32 (schedule.block_m 16 / 32); KV fp8 e4m3 or q's dtype.
    One CTA per SM: ``make_schedule(..., ctas_per_sm=1)``."""
    from . import api

    if check:
        api.check_call(q, kv_cache, page_table, kv_lens, out, lse, schedule)
        if schedule.block_m not in (16, 32):
            raise ValueError(f"wgmma_t: s_q * H must be <= 32, got {schedule.rows}")
    partial = get_partial_kernel_wgmma_t(api._TORCH_TO_NAME[q.dtype], api._TORCH_TO_NAME[kv_cache.dtype],
                                         schedule.block_m, partial=api.partial_name(workspace))
    return api.launch(partial, q, kv_cache, page_table, kv_lens, sm_scale, kv_scale, out, lse, schedule,
                      workspace)


def _build_partial_wgmma_t_balanced(q_name: str, kv_name: str, block_m: int, *tags: str):
    from . import api

    k = MLADecodePartialWGMMAT(api._cutlass_dtype(q_name), api._cutlass_dtype(kv_name), block_m, balanced=True)
    return api.compile_partial(k.call_balanced, q_name, kv_name, tags, balanced=True)


def get_partial_kernel_wgmma_t_balanced(q_name: str, kv_name: str | None = None, block_m: int = 16,
                                        partial: str = "fp32"):
    """Compiled balanced transposed-WGMMA partial kernel (``MLADecodePartialWGMMAT(balanced=True)
    .call_balanced``) for (q dtype, 16-bit kv dtype, BLOCK_M 16 / 32); kernel cache kind
    ``partial_wgmma_t_balanced`` (the even kernel's keys and symbols stay as they were)."""
    from . import api, kernel_cache

    kv_name = kv_name or q_name
    if kv_name == "fp8_e4m3":
        raise ValueError("balanced wgmma_t is built for bf16/fp16 KV caches only")
    return kernel_cache.get_or_build("partial_wgmma_t_balanced", (q_name, kv_name, block_m) + api.partial_spec(partial),
                                     _build_partial_wgmma_t_balanced)


def mla_decode_sm90_wgmma_t_balanced(q, kv_cache, page_table, kv_lens, sm_scale: float, kv_scale: float,
                                     out, lse, schedule, workspace, *, check: bool = True):
    """``api.mla_decode_sm90_balanced`` with the balanced transposed-WGMMA partial kernel: a fixed grid
    of (m-blocks, schedule.num_cols) CTAs, each walking its column of a ``make_schedule(...,
    balanced=True, ctas_per_sm=1)`` schedule (either form of the hybrid plan), then the combine.
    Needs s_q * H <= 32 and a bf16/fp16 cache (ValueError otherwise, also with check=False)."""
    from . import api

    api.check_balanced(schedule, kv_cache)
    if schedule.block_m not in (16, 32):
        raise ValueError(f"wgmma_t: s_q * H must be <= 32, got {schedule.rows}")
    if check:
        api.check_call(q, kv_cache, page_table, kv_lens, out, lse, schedule)
    partial = get_partial_kernel_wgmma_t_balanced(api._TORCH_TO_NAME[q.dtype], api._TORCH_TO_NAME[kv_cache.dtype],
                                                  schedule.block_m, partial=api.partial_name(workspace))
    return api.launch_balanced(partial, q, kv_cache, page_table, kv_lens, sm_scale, kv_scale, out, lse, schedule,
                               workspace)
