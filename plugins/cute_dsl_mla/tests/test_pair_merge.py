"""CPU tests (no GPU) of the experimental cluster pair merge (kernels/pair_merge.py): the schedule form "pair"
(make_schedule(..., balanced=True, form="pair")), the host API's refusals and cache keys, and compile-only checks
of MLADecodePartial(balanced=True, pair=True) for sm_90a: cluster barriers and shared::cluster loads in the PTX,
no local memory, registers <= 255, no stack frame; the default balanced kernel's key is unchanged."""

from __future__ import annotations

import os
import re

import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from mla_cute_dsl.kernels.schedule import (  # noqa: E402
    BLOCK_N,
    PAIR_HI,
    PAIR_LO,
    alloc_workspace,
    balanced_cols,
    capacity_for,
    make_schedule,
    plan_hybrid,
    slots_for,
)

NUM_SMS = 132


def _rows(s):
    return [tuple(r) for r in s.work_info[: s.num_items].tolist()]


def _columns(s):
    """{column: [rows]} of a balanced schedule."""
    rng = s.cta_ranges.tolist()
    work = s.work_info.tolist()
    return {c: [tuple(work[i]) for i in range(rng[c], rng[c + 1])] for c in range(len(rng) - 1)}


def _expected(lens):
    """Column -> row of the pair form, straight from the definition."""
    want = {}
    for r, n in enumerate(lens):
        nb = -(-n // BLOCK_N)
        if nb == 0:
            continue
        if nb == 1:
            want[2 * r] = [(r, 0, n, -1)]
            continue
        mid = -(-nb // 2)
        want[2 * r] = [(r, 0, mid * BLOCK_N, PAIR_LO)]
        want[2 * r + 1] = [(r, mid * BLOCK_N, n, PAIR_HI)]
    return want


@pytest.mark.parametrize("lens", [
    [8192] * 64,  # the target shape: 64 requests, 128 of 132 columns
    [0, 1, 63, 64, 65, 128, 129, 191, 4097, 8192, 0],
    [1] * 66,  # every column pair with one direct item
    [0] * 5,
    [100000, 0, 3],
])
@pytest.mark.parametrize("s_q,H", [(1, 16), (2, 16)])
def test_pair_plan_items_columns_slots_and_split_info(lens, s_q, H):
    s = make_schedule(lens, s_q, H, NUM_SMS, device="cpu", balanced=True, form="pair")
    cols = balanced_cols(s_q * H, NUM_SMS)
    assert s.form == "pair" and s.num_cols == cols and cols % 2 == 0
    want = _expected(lens)
    got = _columns(s)
    for c in range(cols):
        assert got[c] == want.get(c, []), c
    assert s.num_items == sum(len(v) for v in want.values())
    assert all(len(v) <= 1 for v in got.values())
    split = s.split_info.tolist()
    for r, n in enumerate(lens):
        assert split[r] == [0, 1 if n > 0 else 0]
    assert not s.split_info[len(lens):].any()
    assert (s.work_info[s.num_items:] == -1).all()
    # pair halves: the lower in an even column, its upper in the next one, together covering the request
    for c, items in got.items():
        for b, st, en, slot in items:
            assert st % BLOCK_N == 0 and st < en <= lens[b]
            if slot == PAIR_LO:
                assert c % 2 == 0 and got[c + 1][0][:1] == (b,) and got[c + 1][0][3] == PAIR_HI
                assert got[c + 1][0][1] == en and got[c + 1][0][2] == lens[b]
            elif slot == PAIR_HI:
                assert c % 2 == 1 and got[c - 1][0][3] == PAIR_LO
            else:
                assert slot == -1 and c % 2 == 0 and st == 0 and en == lens[b]
    nb = [-(-n // BLOCK_N) for n in lens]
    assert s.max_cta_blocks == max([-(-x // 2) for x in nb if x > 1] + [1 if 1 in nb else 0])


def test_pair_halves_split_blocks_ceil_half():
    s = make_schedule([64 * 7 + 5], 1, 16, NUM_SMS, device="cpu", balanced=True, form="pair")
    assert _rows(s) == [(0, 0, 4 * 64, PAIR_LO), (0, 4 * 64, 64 * 7 + 5, PAIR_HI)]  # 8 blocks: 4 + 4
    s = make_schedule([64 * 7], 1, 16, NUM_SMS, device="cpu", balanced=True, form="pair")
    assert _rows(s) == [(0, 0, 4 * 64, PAIR_LO), (0, 4 * 64, 64 * 7, PAIR_HI)]  # 7 blocks: 4 + 3


def test_pair_needs_two_columns_per_request():
    cols = balanced_cols(16, NUM_SMS)
    make_schedule([1] * (cols // 2), 1, 16, NUM_SMS, device="cpu", balanced=True, form="pair")
    with pytest.raises(ValueError, match=rf"batch {cols // 2 + 1}, num_cols {cols}"):
        make_schedule([1] * (cols // 2 + 1), 1, 16, NUM_SMS, device="cpu", balanced=True, form="pair")
    with pytest.raises(ValueError, match="balanced=True"):
        make_schedule([1], 1, 16, NUM_SMS, device="cpu", form="pair")
    with pytest.raises(ValueError, match="form must be one of"):
        make_schedule([1], 1, 16, NUM_SMS, device="cpu", balanced=True, form="nope")


def test_pair_never_chosen_by_auto():
    for lens in ([8192] * 64, [4096] * 8, [100, 5000, 0]):
        assert make_schedule(lens, 1, 16, NUM_SMS, device="cpu", balanced=True).form in ("even", "balanced")
        assert plan_hybrid(lens, 1, 16, NUM_SMS)[0] in ("even", "balanced")
    form, items, split, ranges, stats = plan_hybrid([130, 1], 1, 16, NUM_SMS, form="pair")
    assert form == "pair" and items == [(0, 0, 128, PAIR_LO), (0, 128, 130, PAIR_HI), (1, 0, 1, -1)]
    assert split == [(0, 1), (0, 1)] and ranges[:5] == [0, 1, 2, 3, 3] and ranges[-1] == 3


@pytest.mark.parametrize("s_q,H", [(1, 16), (2, 16), (1, 128)])
def test_pair_fits_the_same_buffers_and_replans_in_place(s_q, H):
    """max_batch = num_cols / 2 requests: capacity_for / slots_for / the ranges hold every form, and in-place
    re-plans between forms keep the device buffers."""
    rows = s_q * H
    cols = balanced_cols(rows, NUM_SMS)
    mb = cols // 2
    s = make_schedule([8192] * mb, s_q, H, NUM_SMS, device="cpu", balanced=True, form="pair")
    assert s.capacity == capacity_for(mb, NUM_SMS) and s.num_slots == slots_for(rows, NUM_SMS)
    assert s.num_items == 2 * mb <= s.capacity
    bufs = (s.work_info, s.split_info, s.cta_ranges)
    ptrs = [t.data_ptr() for t in bufs]
    ws = alloc_workspace(s, device="cpu")
    for lens, form in (([100] * mb, "balanced"), ([0, 1, 65, 8192], "pair"), ([5000] * 3, "even"),
                       ([64 * 9 + 1] * mb, "pair"), ([], "pair")):
        t = make_schedule(lens, s_q, H, NUM_SMS, device="cpu", balanced=True, form=form, out=s)
        assert t is s and [x.data_ptr() for x in bufs] == ptrs and s.form == form
        fresh = make_schedule(lens, s_q, H, NUM_SMS, device="cpu", balanced=True, form=form, max_batch=mb)
        assert torch.equal(s.work_info, fresh.work_info) and torch.equal(s.split_info, fresh.split_info)
        assert torch.equal(s.cta_ranges, fresh.cta_ranges) and s.num_items == fresh.num_items
    assert ws[0].shape[0] == s.num_slots


def test_pair_kernel_refusals_and_cache_key():
    import cutlass

    from mla_cute_dsl.kernels import api, kernel_cache
    from mla_cute_dsl.kernels.pair_merge import pair_spec
    from mla_cute_dsl.kernels.sm90_decode import MLADecodePartial

    bf = cutlass.BFloat16
    for kw in (dict(block_m=16), dict(block_m=64, balanced=True), dict(block_m=16, balanced=True, fused=True)):
        bm = kw.pop("block_m")
        with pytest.raises(ValueError, match="pair"):
            MLADecodePartial(bf, bf, bm, pair=True, **kw)
    with pytest.raises(ValueError, match="pair"):
        MLADecodePartial(bf, cutlass.Float8E4M3FN, 16, pair=True)
    assert not MLADecodePartial(bf, bf, 16, balanced=True).pair
    for kw in (dict(), dict(balanced=True, fused=True)):
        with pytest.raises(ValueError, match="pair"):
            api.get_partial_kernel("bf16", "bf16", 16, pair=True, **kw)
    with pytest.raises(ValueError, match="pair"):
        api.get_partial_kernel("bf16", "bf16", 64, balanced=True, pair=True)
    # the default keys have no tag; the pair kernel's own symbol
    assert pair_spec(False) == () and pair_spec(True) == ("pair",)
    sym = kernel_cache.symbol_for
    assert sym("partial_balanced", ("bf16", "bf16", 16, None)) == "mla_partial_balanced_bf16_bf16_16"
    assert (sym("partial_balanced", ("bf16", "bf16", 16, None, "partial_bf16", "wide_store", "pair"))
            == "mla_partial_balanced_bf16_bf16_16_partial_bf16_wide_store_pair")


def test_pair_schedule_runs_only_on_the_pair_kernel():
    from mla_cute_dsl.kernels import api, mla_decode_sm90

    q = torch.zeros(2, 1, 16, 576, dtype=torch.bfloat16)
    kv = torch.zeros(4, 64, 576, dtype=torch.bfloat16)
    pt = torch.zeros(2, 2, dtype=torch.int32)
    lens = torch.full((2,), 100, dtype=torch.int32)
    out = torch.zeros(2, 1, 16, 512, dtype=torch.bfloat16)
    lse = torch.zeros(2, 1, 16)
    sched = make_schedule([100, 100], 1, 16, NUM_SMS, device="cpu", balanced=True, form="pair")
    ws = alloc_workspace(sched, device="cpu")
    for check in (True, False):
        with pytest.raises(ValueError, match="pair"):
            mla_decode_sm90(q, kv, pt, lens, 0.1, 1.0, out, lse, sched, ws, check=check)
    with pytest.raises(ValueError, match="pair"):
        api.check_balanced(sched, kv)  # the wgmma_t balanced entry's check
    api.check_balanced(sched, kv, pair_ok=True)
    odd = make_schedule([100], 1, 16, 131, device="cpu", balanced=True, form="pair")
    assert odd.num_cols == 131
    with pytest.raises(ValueError, match="even number of CTA columns"):
        api.launch_pair(None, q[:1], kv, pt[:1], lens[:1], 0.1, 1.0, out[:1], lse[:1], odd, ws)


# ---------------------------------------------------------------------------------------------------------------
# compile-only (sm_90a)
# ---------------------------------------------------------------------------------------------------------------

COMPILE_CASES = [  # q dtype, BLOCK_M, wide stores, partial dtype
    ("bf16", 16, True, "bf16"),  # the backend default's specialization (wide stores, 16-bit partials)
    ("bf16", 16, False, "fp32"),
    ("fp16", 16, True, "fp16"),
    ("bf16", 32, True, "bf16"),
    ("fp16", 32, False, "fp32"),
]


@pytest.mark.parametrize("q,bm,wide,part", COMPILE_CASES)
def test_pair_kernel_compiles(q, bm, wide, part, tmp_path):
    pytest.importorskip("cutlass")
    from test_balanced_compile import DEFAULT_FRAME, _dump

    from mla_cute_dsl.kernels import api
    from mla_cute_dsl.kernels.sm90_decode import MLADecodePartial

    k = MLADecodePartial(api._cutlass_dtype(q), api._cutlass_dtype(q), bm, balanced=True, wide_store=wide, pair=True)
    ptx, regs, frame = _dump(k.call_balanced_pair, api._fake_args_partial_balanced_pair(q, q, part), tmp_path)
    print(f"pair {q} block_m {bm} wide {wide} partial {part}: {regs} registers, stack frame {frame} B")
    assert "kernel_balanced_fused" in ptx  # the pair entry launches the fused entry's body
    assert "griddepcontrol" not in ptx  # no combine kernel depends on it
    assert "ld.local" not in ptx and "st.local" not in ptx
    assert regs <= 255
    # no stack frame at 16 rows; at 32 rows the default kernel already has 16 B (255 registers), the balanced
    # kernels' rule (test_balanced_compile) allows one more 16-byte slot: measured 16 B (bf16, wide stores) and
    # 16 B (fp16, fp32 partials), the balanced kernel 8 and 24 B
    assert frame == 0 if bm == 16 else frame <= DEFAULT_FRAME[bm] + 16, f"stack frame {frame} B"
    # two cluster barriers (arrive with release semantics: no .relaxed), the peer mapping and the DSMEM loads
    assert len(re.findall(r"barrier\.cluster\.arrive;", ptx)) == 2
    assert len(re.findall(r"barrier\.cluster\.wait;", ptx)) == 2
    assert "mapa.shared::cluster" in ptx
    # per 8-column chunk: the peer's lse and 2 x 16 bytes of its O; 16 rows: the 4 chunks of a thread unrolled,
    # 32 rows: a loop (pair_merge.merge_pair)
    chunks = bm * 32 // k.num_threads if bm == 16 else 1
    assert len(re.findall(r"ld\.shared::cluster\.v4\.f32", ptx)) == 2 * chunks
    assert len(re.findall(r"ld\.shared::cluster\.f32", ptx)) == chunks
    # the merged rows leave as 16-byte stores
    assert len(re.findall(r"st\.global\.v4\.b32", ptx)) >= chunks
    # one copy of the item body, as the balanced kernel
    t = {"bf16": "bf16", "fp16": "f16"}[q]
    assert len(re.findall(rf"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.{t}\.{t}\.f32", ptx)) == 136 * k.m_per_warp


# sha256 of the balanced MLADecodePartial PTX without the pair option (comment-stripped, blank lines dropped, as
# test_balanced_compile.ptx_sha256), computed on main d1cde33 before the option existed (nvidia-cutlass-dsl 4.8.1,
# sm_90a); all 16 (q, BLOCK_M 16/32, wide on/off, fp32/16-bit partials) were compared once, these four are pinned
BALANCED_PTX_SHA256 = {
    ("bf16", 16, True, "bf16"): "e4d4ef8a5fa6feb7c9162724b4cc9365b057f6191ecff4c2ab4dafa7aefba468",
    ("bf16", 16, False, "fp32"): "5ca3599fade2f717efecfdd6c54f42de3d9b02310b02f56679625c1e66a5d7b2",
    ("bf16", 32, True, "bf16"): "3dc68e5f2fafccf3c13618d754c498baaf411f6f6ed154770a74a2df4e7d9c68",
    ("fp16", 32, False, "fp32"): "638335c4afb87de305b76cba99d7c27f5d251a1b76ea574ea14676419e9df5e2",
}


@pytest.mark.parametrize("spec", sorted(BALANCED_PTX_SHA256))
def test_balanced_kernel_ptx_is_unchanged(spec, tmp_path):
    pytest.importorskip("cutlass")
    import pathlib

    import cutlass.cute as cute
    from test_balanced_compile import ptx_sha256

    from mla_cute_dsl.kernels import api
    from mla_cute_dsl.kernels.sm90_decode import MLADecodePartial

    q, bm, wide, part = spec
    k = MLADecodePartial(api._cutlass_dtype(q), api._cutlass_dtype(q), bm, balanced=True, wide_store=wide)
    cute.compile(k.call_balanced, *api._fake_args_partial_balanced(q, q, part),
                 options=api.COMPILE_OPTIONS + f" --keep-ptx --dump-dir={tmp_path}")
    ptx = "".join(p.read_text() for p in pathlib.Path(tmp_path).glob("*.ptx"))
    assert "barrier.cluster" not in ptx and "shared::cluster" not in ptx
    assert ptx_sha256(ptx) == BALANCED_PTX_SHA256[spec]


def test_cached_pair_kernel_is_its_own_cache_entry():
    """get_partial_kernel(pair=True) builds call_balanced_pair through compile_partial (its fake arguments: the
    balanced ones plus split_info) and caches it under the "pair" tag, apart from the balanced kernel."""
    pytest.importorskip("cutlass")
    from mla_cute_dsl.kernels import api, kernel_cache

    fn = api.get_partial_kernel("bf16", "bf16", 16, balanced=True, partial="bf16", wide_store=True, pair=True)
    assert fn is api.get_partial_kernel("bf16", "bf16", 16, balanced=True, partial="bf16", wide_store=True, pair=True)
    key = ("bf16", "bf16", 16, None, "partial_bf16", "wide_store", "pair")
    assert kernel_cache.origin("partial_balanced", key) in ("compiled", "disk")
    assert kernel_cache.symbol_for("partial_balanced", key) != kernel_cache.symbol_for("partial_balanced", key[:-1])
