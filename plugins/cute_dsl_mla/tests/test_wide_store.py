"""CPU tests (no GPU) of the wide (16-byte) epilogue stores (kernels/wide_store.py, option stores=wide).

1. The quad transpose, run on a SIMT model (numpy lanes, the same function the kernel traces): lane q ends
   with block q's words from lanes 0..3 in order.
2. The thread -> (row, column) map it rests on, from the DSL's own partitions of the mma.sync (16/32/64
   rows, default layouts) and WGMMA (64 x 256 per warpgroup) O accumulators: the 4 lanes of a quad share
   their rows, a pair is 2 adjacent columns, and the kernel's store address formula (own column of the
   stored pair - 2 * (lane % 4)) makes every lane write 8 contiguous, 8-aligned columns holding exactly
   those columns' values; over all threads every (row, column) of the tile is written once.
3. The compiled kernels: wide-store specializations compile for bf16 / fp16 partials at every row count,
   the wide epilogue's global stores are st.global.v4.b32 where the narrow one has st.global.b32 (output
   and partial).
Nothing here runs a kernel: the conformance classes of test_backend_gpu.py do, on an SM90 GPU (the default runs
wide stores since mla-cute-dsl 0.2.8).
"""

from __future__ import annotations

import collections
import os
import pathlib
import re

import numpy as np
import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from mla_cute_dsl.kernels import wide_store as ws  # noqa: E402  (no DSL import at module level)


def _simt_transpose(words_per_lane):
    """Run ws.quad_transpose on 4 numpy 'lanes' (words_per_lane[lane][slot]) in lockstep."""
    lanes = np.arange(ws.QUAD)
    cols = [np.array([words_per_lane[lane][s] for lane in lanes], dtype=np.int64) for s in range(ws.GROUP)]
    out = ws.quad_transpose(cols, lanes,
                            lambda v, off: v[lanes ^ off],
                            lambda c, a, b: np.where(c, a, b))
    return [[int(out[s][lane]) for s in range(ws.GROUP)] for lane in lanes]


def test_quad_transpose_model():
    words = [[100 * p + s for s in range(4)] for p in range(4)]  # lane p's word of block s
    got = _simt_transpose(words)
    for q in range(4):
        assert got[q] == [100 * p + q for p in range(4)]


def _check_wide_map(coords, tile_rows, tile_cols):
    """coords[tid][r][c] = (row, col) of the thread's accumulator value (r, c) in the tile (mn view). Simulate
    pack_transposed + store_group per warp and check every store and the tile's coverage."""
    written = collections.Counter()
    n_threads = len(coords)
    for warp in range(n_threads // 32):
        for quad in range(8):
            tids = [32 * warp + 4 * quad + q for q in range(4)]
            n_rows = len(coords[tids[0]])
            for r in range(n_rows):
                rows = {coords[t][r][c][0] for t in tids for c in range(len(coords[t][r]))}
                assert len(rows) == 1, "the 4 lanes of a quad must share each row"
                row = rows.pop()
                n_cols = len(coords[tids[0]][r])
                assert n_cols % 8 == 0
                for t in tids:  # a pair = 2 adjacent columns, low column first
                    for m in range(n_cols // 2):
                        assert coords[t][r][2 * m + 1][1] == coords[t][r][2 * m][1] + 1
                # words: the column pair's first column (its value, as far as a store can tell)
                for g in range(n_cols // 8):
                    got = _simt_transpose([[coords[t][r][2 * (4 * g + s)][1] for s in range(4)] for t in tids])
                    for q, t in enumerate(tids):
                        pair = ws.stored_pair(g, t % 32)
                        col = coords[t][r][2 * pair][1] - 2 * (t % 4)  # the kernel's address formula
                        assert col % 8 == 0
                        # the 4 words lane q stores: columns col, col + 2, col + 4, col + 6 (+1 each)
                        assert got[q] == [col + 2 * p for p in range(4)], (warp, quad, r, g, q)
                        for k in range(8):
                            written[(row, col + k)] += 1
    assert set(written.values()) == {1}
    assert sorted(written) == [(r, c) for r in range(tile_rows) for c in range(tile_cols)]


cutlass = pytest.importorskip("cutlass")
import cutlass.cute as cute  # noqa: E402

from mla_cute_dsl.kernels import api  # noqa: E402


@pytest.mark.parametrize("bm", [16, 32, 64])
def test_mma_sync_fragment_map_for_wide_stores(bm):
    from mla_cute_dsl.kernels.sm90_decode import D_V, MLADecodePartial, _acc_mn_view

    k = MLADecodePartial(api._cutlass_dtype("bf16"), api._cutlass_dtype("bf16"), bm, wide_store=True)
    coords = {}

    @cute.jit
    def probe():
        mma_o = k._setup()[-1]
        cO = cute.make_identity_tensor((bm, D_V))
        for tid in cutlass.range_constexpr(k.num_threads):
            v = _acc_mn_view(mma_o.get_slice(tid).partition_C(cO))
            nr, nc = cute.size(v.shape[0]), cute.size(v.shape[1])
            coords[tid] = [[tuple(int(x) for x in v[r, c]) for c in range(nc)] for r in range(nr)]

    cute.compile(probe)
    _check_wide_map([coords[t] for t in range(k.num_threads)], bm, D_V)


def test_wgmma_fragment_map_for_wide_stores():
    from mla_cute_dsl.kernels.sm90_wgmma_decode import (BLOCK_M, D_V_HALF, WG_THREADS, MLADecodePartialWGMMA,
                                                         _acc_mn_view)

    k = MLADecodePartialWGMMA(api._cutlass_dtype("bf16"), api._cutlass_dtype("bf16"), wide_store=True)
    coords = {}

    @cute.jit
    def probe():
        _, mma_o_rs, mma_o_ss = k._tiled_mmas()
        cO = cute.make_identity_tensor((BLOCK_M, D_V_HALF))
        for tid in cutlass.range_constexpr(WG_THREADS):
            for name, mma in (("rs", mma_o_rs), ("ss", mma_o_ss)):
                v = _acc_mn_view(mma.get_slice(tid).partition_C(cO))
                nr, nc = cute.size(v.shape[0]), cute.size(v.shape[1])
                coords[name, tid] = [[tuple(int(x) for x in v[r, c]) for c in range(nc)] for r in range(nr)]

    cute.compile(probe)
    for name in ("rs", "ss"):
        _check_wide_map([coords[name, t] for t in range(WG_THREADS)], BLOCK_M, D_V_HALF)
    # a group of 4 pairs = 4 consecutive 8-column blocks: a quad's one store writes 64 contiguous bytes
    for t in range(WG_THREADS):
        firsts = [coords["rs", t][0][2 * m][1] for m in range(4)]
        assert [f - firsts[0] for f in firsts] == [0, 8, 16, 24]


# ---- compiled kernels ----

def _ptx(fn, args, tmp_path) -> str:
    tmp_path.mkdir(parents=True, exist_ok=True)
    cute.compile(fn, *args, options=api.COMPILE_OPTIONS + f" --keep-ptx --dump-dir={tmp_path}")
    return "".join(p.read_text() for p in pathlib.Path(tmp_path).glob("*.ptx"))


def _stores(ptx: str) -> collections.Counter:
    return collections.Counter(m.group(1) for m in re.finditer(r"\b(st\.global(?:\.[a-z0-9]+)+)", ptx))


def _kernel(family, q, bm, wide):
    from mla_cute_dsl.kernels.sm90_decode import MLADecodePartial
    from mla_cute_dsl.kernels.sm90_wgmma_decode import MLADecodePartialWGMMA, MLADecodePartialWGMMASeesaw

    t = api._cutlass_dtype(q)
    if family == "mma_sync":
        return MLADecodePartial(t, t, bm, wide_store=wide)
    if family == "mma_sync balanced":
        return MLADecodePartial(t, t, bm, balanced=True, wide_store=wide)
    if family == "wgmma":
        return MLADecodePartialWGMMA(t, t, wide_store=wide)
    return MLADecodePartialWGMMASeesaw(t, t, wide_store=wide)


def _compile(family, q, bm, partial, wide, tmp_path):
    k = _kernel(family, q, bm, wide)
    if family.endswith("balanced"):
        return _ptx(k.call_balanced, api._fake_args_partial_balanced(q, q, partial), tmp_path)
    return _ptx(k, api._fake_args_partial(q, q, partial), tmp_path)


# rows per thread (its M atoms x 2 row halves): each stores 512/4 (mma.sync) or 256 (WGMMA) columns
_ROWS = {("mma_sync", 16): 2, ("mma_sync", 32): 4, ("mma_sync", 64): 4, ("mma_sync balanced", 32): 4,
         ("wgmma", 64): 2, ("seesaw", 64): 2}
_COLS = {"mma_sync": 32, "mma_sync balanced": 32, "wgmma": 64, "seesaw": 64}  # values per row and thread


@pytest.mark.parametrize("family,q,bm,partial", [
    ("mma_sync", "bf16", 16, "bf16"), ("mma_sync", "fp16", 32, "fp16"), ("mma_sync", "bf16", 64, "bf16"),
    ("mma_sync balanced", "bf16", 32, "bf16"),
    ("wgmma", "bf16", 64, "bf16"), ("wgmma", "fp16", 64, "fp16"),
    ("seesaw", "bf16", 64, "bf16"), ("seesaw", "fp16", 64, "fp16"),
])
def test_wide_store_kernels_store_16_bytes(family, q, bm, partial, tmp_path):
    """The wide specialization's O stores (output and partial) are st.global.v4.b32, one per 8 columns of a row,
    where the narrow one has one st.global.b32 per column pair; the lse stores stay."""
    narrow = _stores(_compile(family, q, bm, partial, False, tmp_path / "narrow"))
    wide = _stores(_compile(family, q, bm, partial, True, tmp_path / "wide"))
    rows, cols = _ROWS[family, bm], _COLS[family]
    assert set(narrow) == {"st.global.b32"}  # bf16x2 pairs and the lse
    assert set(wide) == {"st.global.v4.b32", "st.global.b32"}
    assert wide["st.global.v4.b32"] == 2 * rows * cols // 8  # output + partial: a 16-byte store per 8 values
    lse = wide["st.global.b32"]
    assert lse == 2 * rows  # one per row and path: the O pairs are gone
    assert narrow["st.global.b32"] == 2 * rows * cols // 2 + lse


def test_wide_store_with_fp32_partials_widens_only_the_output(tmp_path):
    """fp32 partials keep their 8-byte pair stores (st.global.v2.f32); the q-dtype output goes 16 bytes wide."""
    narrow = _stores(_compile("mma_sync", "bf16", 16, "fp32", False, tmp_path / "narrow"))
    wide = _stores(_compile("mma_sync", "bf16", 16, "fp32", True, tmp_path / "wide"))
    v2 = [k for k in narrow if ".v2." in k]
    assert v2 and all(wide[k] == narrow[k] for k in v2)
    assert wide["st.global.v4.b32"] == 2 * 32 // 8


def test_wide_store_keys_and_tags():
    from mla_cute_dsl.kernels import kernel_cache
    from mla_cute_dsl.kernels.sm90_wgmma_decode import seesaw_spec

    assert api.store_spec(False) == () and api.store_spec(True) == ("wide_store",)
    assert api.wide_from_tags(("partial_bf16", "wide_store")) and not api.wide_from_tags(("partial_bf16",))
    assert api.partial_from_tags(("partial_fp16", "wide_store")) == "fp16"
    assert seesaw_spec("bf16", "bf16") == ("bf16", "bf16", 64)  # the default key is unchanged
    assert seesaw_spec("bf16", "bf16", partial="bf16", wide_store=True) == ("bf16", "bf16", 64, "partial_bf16",
                                                                             "wide_store")
    assert kernel_cache.symbol_for("partial", ("bf16", "bf16", 32, None, "partial_bf16", "wide_store")).endswith(
        "partial_bf16_wide_store")
