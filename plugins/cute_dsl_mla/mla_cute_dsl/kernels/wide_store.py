"""Wide (16-byte) epilogue stores of 16-bit O rows from mma.sync / WGMMA accumulators.

Why: in an mma.sync m16n8k16 or a WGMMA m64nNk16 fp32 accumulator, a thread holds for each of its
rows, per 8-column block, 2 adjacent columns (8 * block + 2 * (lane % 4) + {0, 1}); the 4 lanes of a
quad hold the same rows. Storing that pair directly is an 8-byte store with fp32 partials but only a
4-byte one (bf16x2) with 16-bit partials or for the q-dtype output: 2x the store instructions per byte of
the fp32 pairs and 4x those of 16-byte stores (with narrow stores the H200 measured the WGMMA / seesaw
kernels up to 32% slower with 16-bit partials than with fp32 ones, NOTES.md).

What: per row, 4 blocks at a time, the quad transposes its 32-bit column pairs (two xor-shuffle
stages, `quad_transpose`), after which lane q owns block q's 8 contiguous columns (16 bytes) and
stores them with one st.global.v4.b32. The shuffles run for every row (also rows past R): a
shfl.sync with a full mask must not sit under a per-quad branch; only the store is predicated.

`quad_transpose` is plain Python over (value, lane-in-quad) so that the same code is traced into the
kernel and simulated on the CPU (tests/test_wide_store.py, with numpy lanes).
"""

from __future__ import annotations

QUAD = 4  # lanes sharing a row fragment (lane % 4 picks the column pair of each 8-column block)
GROUP = 4  # 8-column blocks per exchange: after it each lane owns 8 columns = 16 bytes of 16-bit data


def quad_transpose(words, q, shfl_xor, select):
    """Transpose a 4 x 4 matrix of 32-bit words across the 4 lanes of a quad.

    words[s]: this lane's word of block s (its 2 columns of the block); q: lane % 4. Returns the 4
    words lane q holds afterwards: word p = lane p's word of block q, so block q's 8 columns in order.
    Each stage b (2, then 1) swaps bit b of (lane, slot) for the words where they differ: a lane with
    the bit set sends slot s0 (bit clear) and receives into it, its partner sends s1 = s0 | b; 2
    shuffles + 6 selects per stage and 4 words. shfl_xor(v, off) / select(cond, a, b) are the kernel's
    shuffle and select, or the CPU model's lane arrays."""
    w = list(words)
    assert len(w) == GROUP
    for bit in (2, 1):
        hi = (q & bit) != 0
        for s0 in range(GROUP):
            if s0 & bit:
                continue
            s1 = s0 | bit
            recv = shfl_xor(select(hi, w[s0], w[s1]), bit)
            w[s0], w[s1] = select(hi, recv, w[s0]), select(hi, w[s1], recv)
    return w


def _dsl_shfl_xor(v, off):
    import cutlass.cute as cute

    return cute.arch.shuffle_sync_bfly(v, offset=off, mask=-1, mask_and_clamp=31)


def _dsl_select(cond, a, b):
    import cutlass

    return cutlass.Int32(cutlass.select_(cond, a, b))


def pack_transposed(vals, out_dtype, lane):
    """One accumulator row of a thread, converted and exchanged for 16-byte stores (traced in a kernel).

    vals: the thread's row values, fp32 TensorSSA already scaled, in accumulator order (column index
    c = 2 * pair + k, pair = its 8-column blocks in order); out_dtype: a 16-bit type. Returns a register
    tensor h of the same size where h[8g .. 8g + 8) are block (4g + lane % 4)'s 8 columns in order
    (store them with `store_group`). No branches: every lane of the warp must run it (full-mask
    shuffles), also for rows past the end."""
    import cutlass
    import cutlass.cute as cute

    n = cute.size(vals.shape)
    assert n % (2 * GROUP) == 0, f"{n} values per row: not a multiple of {2 * GROUP}"
    q = lane % QUAD
    h = cute.make_rmem_tensor((n,), out_dtype)
    h.store(vals.to(out_dtype))
    w = cute.recast_tensor(h, cutlass.Int32)  # word p = pair p (low half = the lower column)
    for g in range(n // (2 * GROUP)):
        t = quad_transpose([w[g * GROUP + s] for s in range(GROUP)], q, _dsl_shfl_xor, _dsl_select)
        for s in range(GROUP):
            w[g * GROUP + s] = t[s]
    return h


def groups(h) -> int:
    """Number of 16-byte groups in a pack_transposed row."""
    import cutlass.cute as cute

    return cute.size(h.shape) // (2 * GROUP)


def stored_pair(g: int, lane):
    """The 8-column block (pair index of the accumulator row) this lane stores for group g."""
    return g * GROUP + lane % QUAD


def store_group(h, g: int, row_tensor, col):
    """Store group g of a pack_transposed row: 8 16-bit values at row_tensor[col .. col + 8); col is the
    block's first column, a multiple of 8 (this lane's own column there minus 2 * (lane % 4)), so the
    row's 16-byte alignment carries over and the store is one st.global.v4.b32."""
    import cutlass.cute as cute

    span = 2 * GROUP
    dst = cute.local_tile(row_tensor, (span,), (col // span,))
    dst.store(cute.local_tile(h, (span,), (g,)).load())
