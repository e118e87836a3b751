"""CPU tests (no GPU) of the balanced transposed-WGMMA kernel (MLADecodePartialWGMMAT(balanced=True)).

1. The even kernel's PTX is byte-identical to before the balanced mode existed (sha256 of the PTX
   without comments, all 8 specializations, pinned from f57a29f).
2. The balanced kernel compiles for bf16 / fp16 at BLOCK_M 16 / 32 with the even kernel's resources
   (168 registers at entry, setmaxnreg 240 / 128, no stack frame, no local memory) and the predicted
   structure (one copy of the tile body, one more consumer barrier per item).
3. A float64 emulation of the column walk (the producer's ring running two tiles ahead across item
   boundaries, Q reloaded when the request changes, per-item row state and epilogue, the kernel's own
   ring_slot / item_tiles) + the combine, on random hybrid schedules (both forms), against softmax
   attention; a mutation (Q never reloaded) must fail it.
4. The host entry and the cache refuse what the kernel cannot run.
The protocol model of the multi-item ring is in test_wgmma_t_compile.py; the GPU run is
test_wgmma_t_balanced_gpu.py.
"""

from __future__ import annotations

import math
import os
import random
import re

import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from test_balanced_schedule import _reference, emulate_combine  # noqa: E402  (same directory)
from test_kernel_compile import _has_cutlass  # noqa: E402

from mla_cute_dsl.kernels import schedule as S  # noqa: E402

needs_cutlass = pytest.mark.skipif(not _has_cutlass(), reason="nvidia-cutlass-dsl not installed")

# sha256 of MLADecodePartialWGMMAT's PTX (comment-stripped, blank lines dropped) at f57a29f, before the
# balanced mode (nvidia-cutlass-dsl 4.8.1, sm_90a)
EVEN_PTX_SHA256 = {
    ("bf16", "fp8_e4m3", 16): "295b779873182b8ddb269fe835c53559698097360cb13f3a4ddcc72f147265e6",
    ("bf16", "fp8_e4m3", 32): "4bc0f09bb4d1a60da8b60ebe5479aea1dceb711f500d2fb93e0f1a5c6b133bc7",
    ("bf16", "bf16", 16): "88d0ee8c49cad74f86776900ab0ec61238564c557e97577ad6125be343a50463",
    ("bf16", "bf16", 32): "73c9057d1d1e9d151ff78bc7d12182405c541599a1628f183fafb00c6f17652c",
    ("fp16", "fp8_e4m3", 16): "63b4c17c84561dca9c464eb224f121b5417d1f9c1c752de9f60c8ddd50c10da1",
    ("fp16", "fp8_e4m3", 32): "2c58af15ac8a4d957bdbb069972f5949078415806061f7eb646c51b130292e73",
    ("fp16", "fp16", 16): "8144064b5568f57d739a32e01355034cc6d7619402c52e339af2b44e57796947",
    ("fp16", "fp16", 32): "7fc96cdb06e80c472eb8de62be9684b14b6d03c28d6143ab1845b8630b733b18",
}


def _kernel(q, kv, bm, balanced=False):
    from mla_cute_dsl.kernels import api
    from mla_cute_dsl.kernels.sm90_wgmma_t_decode import MLADecodePartialWGMMAT

    return MLADecodePartialWGMMAT(api._cutlass_dtype(q), api._cutlass_dtype(kv), bm, balanced=balanced)


@needs_cutlass
@pytest.mark.parametrize("spec", sorted(EVEN_PTX_SHA256))
def test_even_kernel_ptx_is_unchanged(spec, tmp_path):
    from test_balanced_compile import _dump, ptx_sha256_before_pdl

    from mla_cute_dsl.kernels import api

    q, kv, bm = spec
    ptx, _, _ = _dump(_kernel(q, kv, bm), api._fake_args_partial(q, kv), tmp_path)
    assert ptx_sha256_before_pdl(ptx) == EVEN_PTX_SHA256[spec]


@needs_cutlass
@pytest.mark.parametrize("bm", [16, 32])
@pytest.mark.parametrize("q", ["bf16", "fp16"])
def test_balanced_kernel_compiles_with_the_even_kernels_resources(q, bm, tmp_path):
    from test_balanced_compile import _dump

    from mla_cute_dsl.kernels import api

    k = _kernel(q, q, bm, balanced=True)
    ptx, regs, frame = _dump(k.call_balanced, api._fake_args_partial_balanced(q, q), tmp_path)
    assert ptx.count("griddepcontrol.launch_dependents;") == 1  # the PDL trigger for the combine kernel
    print(f"wgmma_t balanced {q} block_m {bm}: {regs} registers, stack frame {frame} B, smem {k.smem_bytes()} B")
    assert "kernel_balanced" in ptx
    assert regs == 168 and frame == 0
    assert "ld.local" not in ptx and "st.local" not in ptx
    assert ".reqntid 384, 1, 1" in ptx and ".minnctapersm 1" in ptx
    inc = [int(v) for v in re.findall(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+(\d+);", ptx)]
    dec = [int(v) for v in re.findall(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+(\d+);", ptx)]
    assert (inc, dec) == ([240], [128])
    t = {"bf16": "bf16", "fp16": "f16"}[q]
    # one copy of the tile body: 36 S^T + 32 O^T WGMMAs
    wg = re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)\.f32\.(\w+)\.(\w+)", ptx)
    assert len(wg) == 68 and set(wg) == {(f"m64n{bm}k16", t, t)}
    assert len(re.findall(r"mbarrier\.init\.shared\.b64", ptx)) == 4  # set up once per CTA, not per item
    assert len(re.findall(r"cp\.async\.cg\.shared\.global", ptx)) == 18
    assert "cp.async.mbarrier.arrive.noinc" in ptx and "cvt.rn.f16x2.e4m3x2" not in ptx
    # the even kernel's 5 barriers (CTA start, Q, column max, P, column sums) plus the one at each item start
    assert len(re.findall(r"bar\.sync", ptx)) == 6
    assert k.smem_bytes() == {16: 168224, 32: 188960}[bm]


@needs_cutlass
def test_balanced_refusals_and_cache_kind(cache_dir):
    import cutlass

    from mla_cute_dsl.kernels import alloc_workspace, kernel_cache, make_schedule
    from mla_cute_dsl.kernels.sm90_wgmma_t_decode import (
        MLADecodePartialWGMMAT,
        get_partial_kernel_wgmma_t_balanced,
        mla_decode_sm90_wgmma_t_balanced,
    )

    with pytest.raises(ValueError, match="bf16/fp16"):
        MLADecodePartialWGMMAT(cutlass.BFloat16, cutlass.Float8E4M3FN, 16, balanced=True)
    with pytest.raises(ValueError, match="bf16/fp16"):
        get_partial_kernel_wgmma_t_balanced("bf16", "fp8_e4m3", 16)
    assert not MLADecodePartialWGMMAT(cutlass.BFloat16, cutlass.BFloat16, 16).balanced
    assert kernel_cache.symbol_for("partial_wgmma_t_balanced", ("bf16", "bf16", 32)) == \
        "mla_partial_wgmma_t_balanced_bf16_bf16_32"
    assert kernel_cache.symbol_for("partial_wgmma_t", ("bf16", "bf16", 32)) == "mla_partial_wgmma_t_bf16_bf16_32"
    # host checks before any kernel is built (CPU tensors)
    B, s_q, H = 2, 2, 16
    q = torch.zeros(B, s_q, H, 576, dtype=torch.bfloat16)
    kv = torch.zeros(4, 64, 576, dtype=torch.bfloat16)
    pt = torch.zeros(B, 2, dtype=torch.int32)
    lens = torch.ones(B, dtype=torch.int32)
    out = torch.zeros(B, s_q, H, 512, dtype=torch.bfloat16)
    lse = torch.zeros(B, s_q, H)
    even = make_schedule([1, 1], s_q, H, 132, device="cpu")
    ws = alloc_workspace(even, device="cpu")
    for check in (True, False):
        with pytest.raises(ValueError, match="balanced=True"):
            mla_decode_sm90_wgmma_t_balanced(q, kv, pt, lens, 0.1, 1.0, out, lse, even, ws, check=check)
    bal = make_schedule([1, 1], s_q, H, 132, device="cpu", balanced=True)
    with pytest.raises(ValueError, match="bf16/fp16"):
        mla_decode_sm90_wgmma_t_balanced(q, kv.to(torch.float8_e4m3fn), pt, lens, 0.1, 1.0, out, lse, bal, ws)
    wide = make_schedule([1, 1], 1, 64, 132, device="cpu", balanced=True)
    with pytest.raises(ValueError, match="<= 32"):
        mla_decode_sm90_wgmma_t_balanced(q, kv, pt, lens, 0.1, 1.0, out, lse, wide, ws, check=False)
    assert kernel_cache.stats()["compiled"] == 0


# ------------------------- float64 emulation: the column walk + combine -------------------------


def _emulate_columns(q, kv, lens, s_q, H, sched, sm_scale, reload_q=True):
    """What MLADecodePartialWGMMAT(balanced=True).call_balanced and the combine compute, in float64, read
    from the Schedule's own tensors.  Per column (one m-block: rows <= 32): the producer's tile stream is
    the column's items' tiles in order (item_tiles); its ring holds the tiles at positions gi and gi + 1
    (ring_slot), so a stage/phase count that did not run across items would hand the consumer another
    tile; tokens >= kv_len are zero-filled (the page tails hold NaN here).  The consumer per item: Q from
    sQ, reloaded only when the request changes (reload_q=False: never after the first, the mutation);
    fresh row state; each tile: scores, causal mask (-inf), column max, online softmax; epilogue to
    out/lse (slot -1) or the partial slot.  Then the combine over split_info (count != 1)."""
    from mla_cute_dsl.kernels.sm90_wgmma_t_decode import BLOCK_N, STAGES, item_tiles, ring_slot

    items = sched.work_info.tolist()
    ranges = sched.cta_ranges.tolist()
    split = sched.split_info.tolist()
    B, R = len(lens), s_q * H
    rows = torch.arange(R)
    out = torch.full((B, R, 512), float("nan"), dtype=torch.float64)
    lse = torch.full((B, R), float("nan"), dtype=torch.float64)
    o_p = torch.full((sched.num_slots, R, 512), float("nan"), dtype=torch.float64)
    l_p = torch.full((sched.num_slots, R), float("nan"), dtype=torch.float64)
    for c in range(len(ranges) - 1):
        col_items = [items[i] for i in range(ranges[c], ranges[c + 1]) if items[i][0] >= 0]
        stream = []  # the producer's view: (request, block) per ring position
        for b, s, e, _ in col_items:
            n0, n_t = item_tiles(s, e)
            stream += [(b, n0 + i) for i in range(n_t)]

        def fill(gi):
            b, n = stream[gi]
            t = torch.arange(n * BLOCK_N, (n + 1) * BLOCK_N)
            tile = kv[b, t.clamp(max=kv.shape[1] - 1)].clone()
            tile[t >= lens[b]] = 0.0  # rows past kv_len zero-filled (cp.async zfill / fill(0))
            return tile

        ring = [None] * STAGES
        for gi in range(min(STAGES, len(stream))):  # the producer runs up to two tiles ahead
            ring[ring_slot(gi)[0]] = (gi, fill(gi))
        g, q_of, sQ = 0, -1, None
        for b, s, e, slot in col_items:
            if b != q_of and (reload_q or sQ is None):
                sQ = q[b].clone()
            q_of = b
            L = lens[b]
            lim = L - s_q + rows // H + 1  # per query row (column of S^T)
            mx = torch.full((R,), -math.inf, dtype=torch.float64)
            ssum = torch.zeros(R, dtype=torch.float64)
            acc = torch.zeros(R, 512, dtype=torch.float64)
            n0, n_t = item_tiles(s, e)
            for i in range(n_t):
                gi = g + i
                st = ring_slot(gi)[0]
                held, tile = ring[st]
                assert held == gi, f"column {c}: the consumer's stage {st} holds tile {held}, not {gi}"
                tok = torch.arange((n0 + i) * BLOCK_N, (n0 + i + 1) * BLOCK_N)
                sc = (tile @ sQ.T) * sm_scale  # S^T: tokens x rows
                sc = torch.where(tok[:, None] < lim[None, :], sc, torch.tensor(-math.inf, dtype=torch.float64))
                m_new = torch.maximum(mx, sc.max(0).values)
                m_use = torch.where(m_new == -math.inf, torch.zeros_like(m_new), m_new)
                p = torch.exp(sc - m_use[None, :])
                corr = torch.exp(mx - m_use)
                ssum = ssum * corr + p.sum(0)
                acc = acc * corr[:, None] + p.T @ tile[:, :512]
                mx = m_new
                ring[st] = (gi + STAGES, fill(gi + STAGES)) if gi + STAGES < len(stream) else None  # release
            ok = ssum > 0
            o_r = torch.where(ok[:, None], acc / torch.where(ok, ssum, 1.0)[:, None], 0.0)
            l_r = torch.where(ok, mx + torch.log(torch.where(ok, ssum, 1.0)), -math.inf)
            if slot < 0:
                out[b], lse[b] = o_r, l_r
            else:
                o_p[slot], l_p[slot] = o_r, l_r
            g += n_t
    return emulate_combine(out, lse, o_p, l_p, split)


def _random_case(seed):
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    s_q, H = rng.choice([(1, 16), (2, 16), (1, 32), (4, 8), (2, 5), (1, 1), (8, 3), (3, 7)])
    B = rng.choice([1, 3, 9, 24])
    n_sm = rng.choice([2, 3, 7, 16])
    kind = seed % 3  # small / skewed / mixed lengths
    if kind == 0:
        lens = [rng.choice([0, 1, max(0, s_q - 1), 64, 65, 128, rng.randint(1, 300)]) for _ in range(B)]
    elif kind == 1:
        lens = [rng.randint(1, 40) for _ in range(B - 1)] + [rng.randint(600, 1500)]
    else:
        lens = [rng.choice([0, rng.randint(1, 64), rng.randint(64, 900)]) for _ in range(B)]
    form = ("auto", "even", "balanced")[seed % 3 if seed % 4 else 0]
    sched = S.make_schedule(lens, s_q, H, n_sm, device="cpu", balanced=True, form=form, ctas_per_sm=1)
    maxlen = -(-max(lens + [1]) // 64) * 64
    R = s_q * H
    q = torch.randn(B, R, 576, generator=g, dtype=torch.float64) * (10.0 if seed == 5 else 1.0)
    kv = torch.randn(B, maxlen, 576, generator=g, dtype=torch.float64)
    for b, L in enumerate(lens):
        kv[b, L:] = float("nan")  # page tails / unused rows poisoned
    return q, kv, lens, s_q, H, sched


@pytest.mark.parametrize("seed", range(12))
def test_emulated_column_walk_and_combine_match_softmax_attention(seed):
    q, kv, lens, s_q, H, sched = _random_case(seed)
    assert sched.block_m in (16, 32) and sched.num_cols >= 1
    sm_scale = 1.0 / math.sqrt(192)
    o, l = _emulate_columns(q, kv, lens, s_q, H, sched, sm_scale)
    ro, rl = _reference(q, torch.nan_to_num(kv, nan=0.0), lens, s_q, H, sm_scale)
    assert not torch.isnan(o).any() and not torch.isnan(l).any()  # every row written, no poison read
    assert torch.allclose(o, ro, rtol=1e-9, atol=1e-9)
    assert torch.equal(torch.isinf(l), torch.isinf(rl))
    fin = ~torch.isinf(rl)
    assert torch.allclose(l[fin], rl[fin], rtol=1e-9, atol=1e-9)


def test_emulation_covers_multi_item_columns_one_tile_items_and_empty_columns():
    """The cases the kernel's column walk must survive appear in the seeds above (both forms)."""
    seen = dict(multi=0, one_tile=0, empty=0, same_request=0, forms=set())
    for seed in range(12):
        *_, sched = _random_case(seed)
        items, ranges = sched.work_info.tolist(), sched.cta_ranges.tolist()
        seen["forms"].add(sched.form)
        for c in range(len(ranges) - 1):
            col = [items[i] for i in range(ranges[c], ranges[c + 1])]
            seen["multi"] += len(col) > 1
            seen["empty"] += not col
            seen["one_tile"] += sum(-(-(e - s) // 64) == 1 for _, s, e, _ in col)
            seen["same_request"] += len({it[0] for it in col}) < len(col)
    assert seen["multi"] and seen["one_tile"] and seen["empty"] and seen["forms"] == {"even", "balanced"}, seen


def test_emulation_catches_q_not_reloaded():
    """Mutation: sQ kept from the column's first request -> wrong rows (a column with two requests)."""
    q, kv, lens, s_q, H, sched = _random_case(4)
    assert sched.form == "balanced"
    items, ranges = sched.work_info.tolist(), sched.cta_ranges.tolist()
    assert any(len({items[i][0] for i in range(ranges[c], ranges[c + 1])}) > 1 for c in range(len(ranges) - 1))
    sm_scale = 1.0 / math.sqrt(192)
    o, _ = _emulate_columns(q, kv, lens, s_q, H, sched, sm_scale, reload_q=False)
    ro, _ = _reference(q, torch.nan_to_num(kv, nan=0.0), lens, s_q, H, sm_scale)
    assert not torch.allclose(o, ro, rtol=1e-6, atol=1e-6)


def test_the_kernel_computes_the_ring_positions_the_models_use():
    """The protocol model and the emulation run ring_slot / item_tiles; the kernel spells the same arithmetic
    inline (DSL code): stage gi % STAGES, full parity (gi // STAGES) % 2, empty wait from gi >= STAGES with
    parity (gi // STAGES - 1) % 2, gi = g + i with g advanced by each item's T after its tiles, T from the
    item's rows as item_tiles computes it. A change on one side only fails here."""
    import inspect

    from mla_cute_dsl.kernels.sm90_wgmma_t_decode import MLADecodePartialWGMMAT as K

    def flat(fn):
        return " ".join(inspect.getsource(fn).split())

    prod, cons, tile = flat(K.producer_column_16), flat(K.consumer_column), flat(K.consume_tile)
    t_expr = "T = (mWork[wi, 2] + BLOCK_N - 1) // BLOCK_N - n_start"
    for src in (prod, cons):
        assert "n_start = mWork[wi, 1] // BLOCK_N" in src and t_expr in src
        assert "for wi in cutlass.range(i_begin, i_end, 1):" in src and "if b >= 0:" in src
        assert src.index("for i in cutlass.range(0, T, 1):") < src.index("g = g + T")
    assert "gi = g + i st = gi % STAGES if gi >= STAGES: cute.arch.mbarrier_wait(mbar + STAGES + st, " \
           "(gi // STAGES - 1) % 2)" in prod
    assert "n_start, i, g + i," in cons
    assert "st = gi % STAGES cute.arch.mbarrier_wait(mbar + st, (gi // STAGES) % 2)" in tile
    assert "cute.arch.mbarrier_arrive(mbar + STAGES + st)" in tile


def _same_request_columns(sched):
    items, ranges = sched.work_info.tolist(), sched.cta_ranges.tolist()
    return [c for c in range(len(ranges) - 1)
            if len({items[i][0] for i in range(ranges[c], ranges[c + 1])}) < ranges[c + 1] - ranges[c]]


def test_emulated_column_with_two_items_of_one_request():
    """The even form on few columns can give one column two items of one request (different slots): Q is not
    reloaded between them (same rows), the row state is, and both partials meet in the combine."""
    lens, s_q, H = [64, 1500, 700, 0, 65], 2, 16
    sched = S.make_schedule(lens, s_q, H, 4, device="cpu", balanced=True, form="even")
    assert _same_request_columns(sched)
    g = torch.Generator().manual_seed(135)
    q = torch.randn(len(lens), s_q * H, 576, generator=g, dtype=torch.float64)
    kv = torch.randn(len(lens), 1536, 576, generator=g, dtype=torch.float64)
    for b, L in enumerate(lens):
        kv[b, L:] = float("nan")
    sm_scale = 1.0 / math.sqrt(192)
    o, l = _emulate_columns(q, kv, lens, s_q, H, sched, sm_scale)
    ro, rl = _reference(q, torch.nan_to_num(kv, nan=0.0), lens, s_q, H, sm_scale)
    assert not torch.isnan(o).any() and torch.allclose(o, ro, rtol=1e-9, atol=1e-9)
    fin = ~torch.isinf(rl)
    assert torch.equal(torch.isinf(l), torch.isinf(rl)) and torch.allclose(l[fin], rl[fin], rtol=1e-9, atol=1e-9)
