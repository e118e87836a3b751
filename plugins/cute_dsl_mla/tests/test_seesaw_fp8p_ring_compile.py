"""CPU tests (no GPU) of the fp8 producer's register ring (``MLADecodePartialWGMMASeesaw(fp8_producer=True,
fp8p_ring=R)``, ``fp8p_producer_ring``; branch fp8p-inflight): the option is refused where it does not apply
(before any compile); the register splits fit the CTA's pool; the cache key carries "fp8pr<R>" only when set and
the builders / entries pass it on (the default calls' keywords unchanged); the PTX of the one-item and balanced
kernels (bf16 / fp16 q) has the producer kernel's structure with the ring's split and load count; standalone ptxas
assembles every ring size (and the default size with shared-memory staging, fp8p_stage) x (bf16 / fp16 q, eager /
lazy, one item / balanced, fp32 / 16-bit partials) without a spill and without serializing the WGMMAs (C7518); and the default producer kernels' PTX is unchanged by the option
(one-item pins: test_seesaw_fp8p_compile.py; the balanced producer's hashes pinned here).  The schedule and its
register hazards: test_seesaw_fp8p_ring_protocol.py; the GPU run: test_seesaw_fp8p_ring_gpu.py."""

from __future__ import annotations

import os
import re

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

cutlass = pytest.importorskip("cutlass")

from test_wgmma_compile import _nv_info_attrs  # noqa: E402  (same directory: pytest rootdir import)
from seesaw_entries import getter_keywords  # noqa: E402  (same directory)


def _kernel(q: str, ring: int, balanced: bool = False, lazy: bool = True, wide: bool = False, stage: int = 0,
            wg1of: bool = False):
    """(entry, fake arguments) of a producer kernel with ``fp8p_ring=ring`` (0: the one-part producer),
    ``fp8p_stage=stage`` and ``wg1_other_first=wg1of`` (test_seesaw_fp8p_ring_wg1of_compile.py)."""
    from mla_cute_dsl.kernels import api
    from mla_cute_dsl.kernels.sm90_wgmma_decode import MLADecodePartialWGMMASeesaw

    k = MLADecodePartialWGMMASeesaw(api._cutlass_dtype(q), cutlass.Float8E4M3FN, l2_prefetch=True, balanced=balanced,
                                    lazy_rescale=lazy, fp8_producer=True, wide_store=wide,
                                    **({"fp8p_ring": ring} if ring else {}), **({"fp8p_stage": stage} if stage else {}),
                                    **({"wg1_other_first": True} if wg1of else {}))
    partial = q if wide else "fp32"
    if balanced:
        return k.call_balanced, api._fake_args_partial_balanced(q, "fp8_e4m3", partial)
    return k, api._fake_args_partial(q, "fp8_e4m3", partial)


def _dump(tmp_path, *a, **kw):
    """Compile ``_kernel(*a, **kw)`` with --keep-ptx/--keep-cubin: (ptx text, registers at launch, stack frame)."""
    return compile_dump(tmp_path, *_kernel(*a, **kw))


def compile_dump(tmp_path, entry, args):
    """Compile (entry, fake arguments) with --keep-ptx/--keep-cubin into tmp_path: (ptx text, registers at launch,
    stack frame)."""
    import cutlass.cute as cute

    from mla_cute_dsl.kernels import api

    tmp_path.mkdir(parents=True, exist_ok=True)
    cute.compile(entry, *args, options=api.COMPILE_OPTIONS + f" --keep-ptx --keep-cubin --dump-dir={tmp_path}")
    ptx = "".join(p.read_text() for p in tmp_path.glob("*.ptx"))
    attrs = _nv_info_attrs(b"".join(p.read_bytes() for p in tmp_path.glob("*.cubin")))
    regs = max(v for a_, v in attrs if a_ == 0x2F)  # EIATTR_REGCOUNT
    frame = max((v for a_, v in attrs if a_ == 0x11), default=0)  # EIATTR_FRAME_SIZE
    return ptx, regs, frame


def test_ring_sizes_and_splits():
    from mla_cute_dsl.kernels import fp8p_ring
    from mla_cute_dsl.kernels import sm90_wgmma_decode as W

    assert fp8p_ring.RING_DEFAULT in fp8p_ring.RING_SIZES
    for ring, (math, prod) in fp8p_ring.RING_REGS.items():
        assert W.fp8p_register_split_fits(math, prod)
        assert 4 * ring <= prod - 40  # the ring's registers leave the producer its other ~40 (ptxas: no spills)
    k = W.MLADecodePartialWGMMASeesaw(cutlass.BFloat16, cutlass.Float8E4M3FN, fp8_producer=True, fp8p_ring=7)
    assert k.fp8p_regs == (208, 88) and k._num_mbars() == 8
    k = W.MLADecodePartialWGMMASeesaw(cutlass.BFloat16, cutlass.Float8E4M3FN, fp8_producer=True)
    assert k.fp8p_ring == 0 and k.fp8p_regs == (W.FP8P_MATH_REGS, W.FP8P_PRODUCER_REGS)
    assert k.smem_bytes() == 222_784 and k._mbar_words() == 8
    # staging: 4 x 2 KB after the 8 mbarriers, within the 227 KB
    k = W.MLADecodePartialWGMMASeesaw(cutlass.BFloat16, cutlass.Float8E4M3FN, fp8_producer=True, fp8p_ring=7,
                                      fp8p_stage=fp8p_ring.STAGE_SLOTS)
    assert k.smem_bytes() == 222_784 + fp8p_ring.STAGE_SLOTS * fp8p_ring.STAGE_SLOT_BYTES <= W.SMEM_LIMIT
    assert k._mbar_words() == 8 + 1024 and k.fp8p_regs == (208, 88)


def test_ring_is_refused_where_it_does_not_apply(monkeypatch):
    from mla_cute_dsl.kernels import kernel_cache
    from mla_cute_dsl.kernels import sm90_wgmma_decode as W

    with pytest.raises(ValueError, match="fp8p_ring"):
        W.MLADecodePartialWGMMASeesaw(cutlass.BFloat16, cutlass.Float8E4M3FN, fp8p_ring=7)  # no producer
    with pytest.raises(ValueError, match="fp8p_ring"):
        W.MLADecodePartialWGMMASeesaw(cutlass.BFloat16, cutlass.Float8E4M3FN, fp8_producer=True, fp8p_ring=12)
    with pytest.raises(ValueError, match="fp8_producer"):  # 16-bit caches have no producer at all
        W.MLADecodePartialWGMMASeesaw(cutlass.BFloat16, cutlass.BFloat16, fp8_producer=True, fp8p_ring=7)
    with pytest.raises(ValueError, match="fp8p_stage"):  # staging needs the ring
        W.MLADecodePartialWGMMASeesaw(cutlass.BFloat16, cutlass.Float8E4M3FN, fp8_producer=True, fp8p_stage=4)
    with pytest.raises(ValueError, match="fp8p_stage"):
        W.MLADecodePartialWGMMASeesaw(cutlass.BFloat16, cutlass.Float8E4M3FN, fp8_producer=True, fp8p_ring=7,
                                      fp8p_stage=3)
    monkeypatch.setattr(kernel_cache, "get_or_build", lambda *a: pytest.fail("compiled"))
    for getter in (W.get_partial_kernel_wgmma_seesaw, W.get_partial_kernel_wgmma_seesaw_balanced):
        with pytest.raises(ValueError, match="fp8p_ring"):
            getter("bf16", "fp8_e4m3", fp8p_ring=7)
        with pytest.raises(ValueError, match="fp8p_ring"):
            getter("bf16", "fp8_e4m3", fp8_producer=True, fp8p_ring=3)
        with pytest.raises(ValueError, match="fp8p_stage"):
            getter("bf16", "fp8_e4m3", fp8_producer=True, fp8p_stage=4)
    with pytest.raises(ValueError, match="unknown flags"):
        W._build_partial_wgmma_seesaw("bf16", "fp8_e4m3", 64, "fp8p", "fp8prx")


def test_ring_cache_key_builder_and_entries(monkeypatch):
    import cutlass.cute as cute
    import torch

    from mla_cute_dsl.kernels import kernel_cache
    from mla_cute_dsl.kernels import sm90_wgmma_decode as W

    assert W.seesaw_spec("bf16", "fp8_e4m3", True, fp8_producer=True) == ("bf16", "fp8_e4m3", 64, "l2pf", "fp8p")
    assert W.seesaw_spec("bf16", "fp8_e4m3", True, "bf16", True, lazy_rescale=True, fp8_producer=True,
                         fp8p_ring=7) == ("bf16", "fp8_e4m3", 64, "l2pf", "partial_bf16", "wide_store", "lazy",
                                          "fp8p", "fp8pr7")
    assert W.seesaw_flag_ring(("l2pf", "fp8p", "fp8pr5")) == 5 and W.seesaw_flag_ring(("l2pf", "fp8p")) == 0
    assert W.seesaw_flag_stage(("fp8p", "fp8pr7", "fp8ps4")) == 4 and W.seesaw_flag_stage(("fp8p", "fp8pr7")) == 0
    assert W.seesaw_spec("bf16", "fp8_e4m3", True, fp8_producer=True, fp8p_ring=7, fp8p_stage=4) == (
        "bf16", "fp8_e4m3", 64, "l2pf", "fp8p", "fp8pr7", "fp8ps4")
    keys = []
    monkeypatch.setattr(kernel_cache, "get_or_build", lambda kind, spec, build: keys.append((kind, spec)))
    W.get_partial_kernel_wgmma_seesaw("bf16", "fp8_e4m3", fp8_producer=True)
    W.get_partial_kernel_wgmma_seesaw("bf16", "fp8_e4m3", fp8_producer=True, fp8p_ring=7)
    W.get_partial_kernel_wgmma_seesaw_balanced("fp16", "fp8_e4m3", lazy_rescale=True, fp8_producer=True, fp8p_ring=5)
    W.get_partial_kernel_wgmma_seesaw_balanced("bf16", "fp8_e4m3", fp8_producer=True, fp8p_ring=7, fp8p_stage=4)
    assert keys == [("partial_wgmma_seesaw", ("bf16", "fp8_e4m3", 64, "l2pf", "fp8p")),
                    ("partial_wgmma_seesaw", ("bf16", "fp8_e4m3", 64, "l2pf", "fp8p", "fp8pr7")),
                    ("partial_wgmma_seesaw_balanced", ("fp16", "fp8_e4m3", 64, "l2pf", "lazy", "fp8p", "fp8pr5")),
                    ("partial_wgmma_seesaw_balanced", ("bf16", "fp8_e4m3", 64, "l2pf", "fp8p", "fp8pr7", "fp8ps4"))]

    built = []
    monkeypatch.setattr(cute, "compile", lambda k, *a, **kw: built.append(k))
    W._build_partial_wgmma_seesaw("bf16", "fp8_e4m3", 64, "l2pf", "fp8p")
    W._build_partial_wgmma_seesaw("bf16", "fp8_e4m3", 64, "l2pf", "fp8p", "fp8pr7")
    W._build_partial_wgmma_seesaw_balanced("bf16", "fp8_e4m3", 64, "l2pf", "lazy", "fp8p", "fp8pr5")
    W._build_partial_wgmma_seesaw("bf16", "fp8_e4m3", 64, "l2pf", "fp8p", "fp8pr7", "fp8ps4")
    objs = [k if hasattr(k, "fp8p_ring") else k.__self__ for k in built]  # balanced: call_balanced
    assert [(k.fp8p_ring, k.fp8p_stage) for k in objs] == [(0, 0), (7, 0), (5, 0), (7, 4)]

    f8 = torch.float8_e4m3fn
    asked = getter_keywords(monkeypatch, [
        (False, f8, {"fp8_producer": True}), (False, f8, {"fp8_producer": True, "fp8p_ring": 7}),
        (True, f8, {"fp8_producer": True}), (True, f8, {"fp8_producer": True, "fp8p_ring": 5})])
    assert [kw.get("fp8p_ring", "absent") for kw in asked] == ["absent", 7, "absent", 5]  # defaults unchanged

    staged = [kw.get("fp8p_stage") for kw in getter_keywords(monkeypatch, [
        (False, f8, {"fp8_producer": True, "fp8p_ring": 7}),
        (True, f8, {"fp8_producer": True, "fp8p_ring": 7, "fp8p_stage": 4})])]
    assert staged == [None, 4]


# ptx_sha256 (test_seesaw_tma_compile.ptx_sha256) of the balanced producer kernel (call_balanced, l2_prefetch on)
# at main e323790 (GPU-verified in the twenty-second session), which this branch must not change: (q, lazy, wide)
FP8P_BALANCED_PTX_SHA256 = {
    ("bf16", True, False): "35c4440fdc5e4c3d3c682a1559d2ca40c86a3a92aba242cd4b63d77f75b0fd00",
    ("fp16", False, False): "10c6cdb9f4c9f439d1275716a72fc5a572114a3d2365e93cf09754124d565352",
    ("bf16", True, True): "6fa423c3dd32c4f5f70f7d518ee98e010eae2d07b429ba0b68b2f3ae8c2ff9fb",
}


@pytest.mark.parametrize("spec", sorted(FP8P_BALANCED_PTX_SHA256))
def test_balanced_producer_ptx_is_unchanged(spec, tmp_path):
    from test_seesaw_tma_compile import ptx_sha256

    q, lazy, wide = spec
    ptx, _, _ = _dump(tmp_path, q, 0, balanced=True, lazy=lazy, wide=wide)
    assert ptx_sha256(ptx) == FP8P_BALANCED_PTX_SHA256[spec]


@pytest.mark.parametrize("q,ring,balanced,stage", [("bf16", 7, False, 0), ("fp16", 5, False, 0), ("bf16", 7, True, 0),
                                                   ("fp16", 7, True, 0), ("bf16", 7, False, 4), ("fp16", 7, True, 4)])
def test_ring_kernel_ptx(q, ring, balanced, stage, tmp_path):
    """The producer kernel's structure (test_seesaw_fp8p_compile.test_fp8p_kernel_ptx) with the ring's split, every
    conversion and 128-bit KV load in the producer: 36 chunk conversions of 8 cvt per pair body (no tail copy: rows
    past kv_len are zero-filled at issue), one ld.global.v4 per register chunk issued (the pair's 36 and the
    prologue's lookahead, staged ones excepted: those are 16-byte cp.async with a commit group each, and one
    wait_group per staged conversion), 72 st.shared.v4 (+ the staged zero fills), no ld.global.v2 (one-item and
    balanced alike: one copy of the producer's body)."""
    from mla_cute_dsl.kernels import fp8p_ring
    from mla_cute_dsl.kernels import sm90_wgmma_decode as W

    ptx, regs, frame = _dump(tmp_path, q, ring, balanced=balanced, stage=stage)
    flat = re.sub(r"\s+", " ", ptx)
    math, prod = fp8p_ring.RING_REGS[ring]
    assert ".reqntid 384, 1, 1" in flat and ".minnctapersm 1" in flat
    assert regs == W.FP8P_REGS_AT_LAUNCH and frame == 0
    assert re.findall(r"setmaxnreg\.inc\.sync\.aligned\.u32 (\d+);", flat) == [str(math)]
    assert re.findall(r"setmaxnreg\.dec\.sync\.aligned\.u32 (\d+);", flat) == [str(prod)]
    assert flat.find("setmaxnreg") > flat.find("bar.sync 0;")
    assert len(re.findall(r"wgmma\.mma_async", flat)) == 88
    assert flat.count("mbarrier.init.shared.b64") == 8
    assert flat.count("mbarrier.try_wait.parity.shared.b64") == 8 and flat.count("mbarrier.arrive.shared.b64") == 8
    assert flat.count("bar.sync 0;") == 1 and flat.count("bar.sync 5, 256;") == 2
    dec = flat.find("setmaxnreg.dec")
    cvt = [m.start() for m in re.finditer(r"cvt\.rn\.f16x2\.e4m3x2", flat)]
    assert len(cvt) == 36 * 8 and min(cvt) > dec and flat.find("wgmma.mma_async") < dec
    prod_ptx = flat[dec:]
    ahead = fp8p_ring.lookahead(ring, stage)
    n_staged = sum(fp8p_ring.staged(c, stage) for c in range(36 + ahead))  # the pair's and the prologue's
    assert len(re.findall(r"ld\.global\.v4\.b32", prod_ptx)) == 36 + ahead - n_staged
    # staged chunks: one cp.async (16 bytes, .cg) and one commit group per issue, one wait_group per conversion;
    # the math warpgroups' Q load keeps its own (before setmaxnreg.dec)
    assert len(re.findall(r"cp\.async\.cg\.shared\.global", prod_ptx)) == n_staged
    assert prod_ptx.count("cp.async.commit_group") == n_staged
    assert prod_ptx.count("cp.async.wait_group") == (12 if stage else 0)
    assert not re.findall(r"ld\.global\.v2\.b32", prod_ptx)
    # 72 converted stores per pair body, plus the zero fill (rows past kv_len) of each staged issue
    assert len(re.findall(r"st\.shared\.v4\.b32", prod_ptx)) == 72 + n_staged
    assert prod_ptx.count("mbarrier.try_wait.parity.shared.b64") == 4 and prod_ptx.count("mbarrier.arrive.shared") == 4
    assert "cp.async.bulk.prefetch.L2" in prod_ptx
    assert set(re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+);", flat)) == {"0"}


def _ring_kinds():
    from mla_cute_dsl.kernels import fp8p_ring

    out = []
    for ring, stage in [(r, 0) for r in fp8p_ring.RING_SIZES] + [(fp8p_ring.RING_DEFAULT, fp8p_ring.STAGE_SLOTS)]:
        for q in ("bf16", "fp16"):
            for lazy in (False, True):
                for balanced in (False, True):
                    out.append((ring, stage, q, lazy, balanced, False))
        # 16-bit partials, wide stores (the backend's default arm)
        out += [(ring, stage, "bf16", True, False, True), (ring, stage, "bf16", True, True, True)]
    return out


@pytest.mark.parametrize("ring,stage,q,lazy,balanced,wide", _ring_kinds())
def test_ptxas_assembles_the_ring_kernels_without_spills_or_serialized_wgmmas(ring, stage, q, lazy, balanced, wide,
                                                                            tmp_path):
    """Every ring size the kernel takes, every kernel the backend may build with it: standalone ptxas (-O3) reports
    no C7518 (serialized WGMMAs), 0 spill bytes (the setmaxnreg regions included: the math warpgroups' 208 and the
    producer's 88) and 168 registers at launch."""
    from test_wgmma_serialization import _assemble, _ptx, _ptxas

    ptxas = _ptxas()
    if ptxas is None:
        pytest.skip("no ptxas ($PTXAS, PATH, /usr/local/cuda*/bin)")
    ptx = _ptx(*_kernel(q, ring, balanced=balanced, lazy=lazy, wide=wide, stage=stage), tmp_path)
    run = _assemble(ptxas, ptx, tmp_path)
    assert run.returncode == 0, run.stderr
    log = run.stdout + run.stderr
    assert "C7518" not in log and "serialized" not in log, log
    used = re.search(r"Used (\d+) registers", log)
    assert used and int(used.group(1)) <= 168, log
    assert re.search(r"0 bytes spill stores, 0 bytes spill loads", log), log
