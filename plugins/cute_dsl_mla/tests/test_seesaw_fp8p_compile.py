"""CPU tests (no GPU) of the fp8 seesaw with a producer warpgroup (``MLADecodePartialWGMMASeesaw(fp8_producer=True)``,
branch fp8-producer): the option is refused where it does not apply (naming it, before any compile); the register
split fits the CTA's pool (a split that does not HANGS the GPU in setmaxnreg.inc); the kernel compiles for bf16 and
fp16 q with a 384-thread launch (.reqntid 384, .minnctapersm 1, 168 registers at launch), one setmaxnreg.inc of the
math warpgroups and one setmaxnreg.dec of the producer, 8 mbarriers of count 128, the math warpgroups' own named
barrier of 256 threads, 88 WGMMAs, every fp8 conversion in the producer, no stack frame; its cache key carries
"fp8p" only when set and the builder / entry point pass it on. The default kernels' PTX pins
(test_seesaw_tma_compile.py, test_seesaw_balanced_compile.py) and the standalone-ptxas check for serialized WGMMAs
and spills (test_wgmma_serialization.py, which includes this kernel) cover the rest. Nothing here runs a kernel:
tests/test_seesaw_fp8p_gpu.py does, on an SM90 GPU."""

from __future__ import annotations

import os
import re

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

cutlass = pytest.importorskip("cutlass")

from test_wgmma_compile import _nv_info_attrs  # noqa: E402  (same directory: pytest rootdir import)
from seesaw_entries import getter_keywords  # noqa: E402  (same directory)


def _dump(q: str, tmp_path, lazy: bool = False, l2_prefetch: bool = True):
    """Compile the fp8_producer kernel with --keep-ptx/--keep-cubin: (ptx, registers at launch, stack frame)."""
    import cutlass.cute as cute

    from mla_cute_dsl.kernels import api
    from mla_cute_dsl.kernels.sm90_wgmma_decode import MLADecodePartialWGMMASeesaw

    k = MLADecodePartialWGMMASeesaw(api._cutlass_dtype(q), cutlass.Float8E4M3FN, l2_prefetch=l2_prefetch,
                                    lazy_rescale=lazy, fp8_producer=True)
    cute.compile(k, *api._fake_args_partial(q, "fp8_e4m3"),
                 options=api.COMPILE_OPTIONS + f" --keep-ptx --keep-cubin --dump-dir={tmp_path}")
    ptx = "".join(p.read_text() for p in tmp_path.glob("*.ptx"))
    attrs = _nv_info_attrs(b"".join(p.read_bytes() for p in tmp_path.glob("*.cubin")))
    regs = max(v for a, v in attrs if a == 0x2F)  # EIATTR_REGCOUNT
    frame = max((v for a, v in attrs if a == 0x11), default=0)  # EIATTR_FRAME_SIZE
    return ptx, regs, frame


def test_fp8p_register_split_fits_the_pool():
    """setmaxnreg.inc blocks until the CTA's pool (registers at launch x 384 = 64,512, not 65,536) can pay: the
    two math warpgroups' increase must be covered by what the producer's decrease releases."""
    from mla_cute_dsl.kernels import sm90_wgmma_decode as W

    assert W.FP8P_THREADS == 384 and W.FP8P_REGS_AT_LAUNCH == 168
    assert W.fp8p_register_split_fits()
    assert 2 * W.WG_THREADS * W.FP8P_MATH_REGS + W.WG_THREADS * W.FP8P_PRODUCER_REGS <= 168 * 384
    assert W.fp8p_register_split_fits(224, 56) and W.fp8p_register_split_fits(240, 24)
    # splits that would hang (over the pool) or that setmaxnreg cannot take
    assert not W.fp8p_register_split_fits(224, 72)
    assert not W.fp8p_register_split_fits(232, 48)
    assert not W.fp8p_register_split_fits(216, 20)  # below setmaxnreg's minimum 24
    assert not W.fp8p_register_split_fits(220, 64)  # not a multiple of 8


def test_fp8p_is_refused_where_it_does_not_apply(monkeypatch):
    from mla_cute_dsl.kernels import kernel_cache
    from mla_cute_dsl.kernels import sm90_wgmma_decode as W

    for kv in (cutlass.BFloat16, cutlass.Float16):
        with pytest.raises(ValueError, match="fp8_producer"):
            W.MLADecodePartialWGMMASeesaw(kv, kv, fp8_producer=True)
    for kv in (cutlass.BFloat16, cutlass.Float16):  # balanced too (branch fp8-balanced-producer): fp8 caches only
        with pytest.raises(ValueError, match="fp8_producer"):
            W.MLADecodePartialWGMMASeesaw(kv, kv, balanced=True, fp8_producer=True)
    assert W.MLADecodePartialWGMMASeesaw(cutlass.BFloat16, cutlass.Float8E4M3FN, balanced=True,
                                         fp8_producer=True).fp8_producer
    monkeypatch.setattr(kernel_cache, "get_or_build", lambda *a: pytest.fail("compiled"))
    for q in ("bf16", "fp16"):
        with pytest.raises(ValueError, match="fp8_producer"):
            W.get_partial_kernel_wgmma_seesaw(q, q, fp8_producer=True)
    k = W.MLADecodePartialWGMMASeesaw(cutlass.BFloat16, cutlass.Float8E4M3FN)
    assert not k.fp8_producer and k._num_mbars() == 4
    k = W.MLADecodePartialWGMMASeesaw(cutlass.BFloat16, cutlass.Float8E4M3FN, fp8_producer=True)
    assert k._num_mbars() == 8 and k.smem_bytes() == 222_752 + 32 <= W.SMEM_LIMIT


def test_fp8p_cache_key_builder_and_entry(monkeypatch):
    import cutlass.cute as cute
    import torch

    from mla_cute_dsl.kernels import kernel_cache
    from mla_cute_dsl.kernels import sm90_wgmma_decode as W

    assert "fp8p" in W.SEESAW_FLAGS
    assert W.seesaw_spec("bf16", "fp8_e4m3", True) == ("bf16", "fp8_e4m3", 64, "l2pf")  # unchanged
    assert W.seesaw_spec("bf16", "fp8_e4m3", True, fp8_producer=True) == ("bf16", "fp8_e4m3", 64, "l2pf", "fp8p")
    assert W.seesaw_spec("bf16", "fp8_e4m3", True, "bf16", True, lazy_rescale=True, fp8_producer=True) == (
        "bf16", "fp8_e4m3", 64, "l2pf", "partial_bf16", "wide_store", "lazy", "fp8p")
    keys = []
    monkeypatch.setattr(kernel_cache, "get_or_build", lambda kind, spec, build: keys.append((kind, spec)))
    W.get_partial_kernel_wgmma_seesaw("bf16", "fp8_e4m3")
    W.get_partial_kernel_wgmma_seesaw("fp16", "fp8_e4m3", fp8_producer=True)
    W.get_partial_kernel_wgmma_seesaw("bf16", "fp8_e4m3", lazy_rescale=True, fp8_producer=True)
    assert keys == [("partial_wgmma_seesaw", ("bf16", "fp8_e4m3", 64, "l2pf")),
                    ("partial_wgmma_seesaw", ("fp16", "fp8_e4m3", 64, "l2pf", "fp8p")),
                    ("partial_wgmma_seesaw", ("bf16", "fp8_e4m3", 64, "l2pf", "lazy", "fp8p"))]

    built = []
    monkeypatch.setattr(cute, "compile", lambda k, *a, **kw: built.append(k))
    W._build_partial_wgmma_seesaw("bf16", "fp8_e4m3", 64, "l2pf")
    W._build_partial_wgmma_seesaw("bf16", "fp8_e4m3", 64, "l2pf", "fp8p")
    W._build_partial_wgmma_seesaw("fp16", "fp8_e4m3", 64, "lazy", "fp8p")
    assert [k.fp8_producer for k in built] == [False, True, True]
    assert [k.lazy_rescale for k in built] == [False, False, True] and not built[2].l2_prefetch

    asked = [kw.get("fp8_producer") for kw in getter_keywords(
        monkeypatch, [(False, torch.float8_e4m3fn, {"fp8_producer": fp8p}) for fp8p in (False, True)])]
    assert asked == [None, True]  # the default call's keywords are unchanged (test_backend_host.py pins them)


# ptx_sha256 (test_seesaw_tma_compile.ptx_sha256) of the one-item fp8_producer kernel as GPU-verified on an H200 at
# b583c07 (43 tests; l2_prefetch on, fp32 partials, narrow stores): (q, lazy). Branch fp8-balanced-producer added the
# balanced mode's phase offsets and unconditional releases to the math side / fp8p_producer under const_expr switches
# (the math side is seesaw_item's 16-bit stream under fp8_producer since branch fold-fp8p):
# the one-item kernel's PTX must stay this
FP8P_PTX_SHA256 = {
    ("bf16", False): "437ea80eb4e9530b568a44f2b31ba06b8315d82bbc0193c36f74f4d5faed316b",
    ("bf16", True): "78d6f8d618770e304b592323f3308cc7deba326d7724381a8a1ce3011a56b094",
    ("fp16", True): "44a55df05a537f938a09c54bbb1e675ec7295ae090ed1f11078d4921d5aa6c54",
}


@pytest.mark.parametrize("spec", sorted(FP8P_PTX_SHA256))
def test_fp8p_one_item_ptx_is_the_gpu_verified_one(spec, tmp_path):
    from test_seesaw_tma_compile import ptx_sha256

    q, lazy = spec
    ptx, _, _ = _dump(q, tmp_path, lazy=lazy)
    assert ptx_sha256(ptx) == FP8P_PTX_SHA256[spec]


@pytest.mark.parametrize("q", ["bf16", "fp16"])
def test_fp8p_kernel_ptx(q, tmp_path):
    from mla_cute_dsl.kernels import sm90_wgmma_decode as W

    ptx, regs, frame = _dump(q, tmp_path)
    flat = re.sub(r"\s+", " ", ptx)
    assert ".reqntid 384, 1, 1" in flat and ".minnctapersm 1" in flat
    assert regs == W.FP8P_REGS_AT_LAUNCH and frame == 0
    assert re.findall(r"setmaxnreg\.inc\.sync\.aligned\.u32 (\d+);", flat) == [str(W.FP8P_MATH_REGS)]
    assert re.findall(r"setmaxnreg\.dec\.sync\.aligned\.u32 (\d+);", flat) == [str(W.FP8P_PRODUCER_REGS)]
    assert flat.find("setmaxnreg") > flat.find("bar.sync 0;")  # after the mbarrier init's CTA barrier
    assert len(re.findall(r"wgmma\.mma_async", flat)) == 88
    # 8 mbarriers, all count 128 (full: the producer's 128 threads; empty: the releasing math warpgroup's)
    inits = re.findall(r"mov\.b32 (%r\d+), (\d+); (?:mbarrier\.init\.shared\.b64 \[[^\]]*\], (%r\d+); ){8}", flat)
    assert flat.count("mbarrier.init.shared.b64") == 8 and len(inits) == 1 and inits[0][1] == "128"
    # waits: 4 full (qk of each math warpgroup) + 4 empty (producer); arrives: 4 full (producer) + 4 empty (math)
    assert flat.count("mbarrier.try_wait.parity.shared.b64") == 8
    assert flat.count("mbarrier.arrive.shared.b64") == 8
    # the CTA barrier only at the setup; the math warpgroups' Q and epilogue barriers are bar 5 of 256 threads;
    # the P barriers as in the other seesaw kernels
    assert flat.count("bar.sync 0;") == 1 and flat.count("bar.sync 5, 256;") == 2
    for bar in (1, 2):
        assert flat.count(f"bar.arrive {bar}, 256;") == 1 and flat.count(f"bar.sync {bar}, 256;") == 1
    # every e4m3 conversion is the producer's: 4 parts (4, 5, 4, 5 blocks) x 4 row passes x 4 cvt per 8 elements,
    # full-tile and tail-tile paths, after setmaxnreg.dec; none before (the math warpgroups convert nothing)
    cvt = [m.start() for m in re.finditer(r"cvt\.rn\.f16x2\.e4m3x2", flat)]
    assert len(cvt) == 2 * 18 * 4 * 4
    dec = flat.find("setmaxnreg.dec")
    assert min(cvt) > dec and flat.find("wgmma.mma_async") < dec  # the math code comes first in the PTX
    assert set(re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+);", flat)) == {"0"}
    assert "cp.async.bulk.prefetch.L2" in flat  # the producer's L2 prefetch (l2_prefetch, the fp8 default)


def test_fp8p_producer_copies_store_each_element_once_into_16_byte_swizzle_units():
    """The producer's copies (FP8P_ELEMS_PER_COPY = 16: one 128-bit ld.global of fp8, two 128-bit st.shared of
    fp16): for all 128 producer threads the fp8 ld.global partition (g2r, whose identity partition the row masks
    read) and the fp16 st.shared partition (r2s) list the same (row, col) at every position (CPY, m, block); chunk
    (m, block) of thread t is row t // 4 + 32 m, 16 consecutive columns starting at a multiple of 16 inside the
    block; the staging tensor holds 16 x 2 x 5 fp8 = 40 registers; through the sK layout with its swizzle each half
    (8 fp16) of a chunk is 8 consecutive elements starting 16-byte aligned in both K buffers (the SW128 swizzle
    permutes whole 16-byte units); every element of a tile is written exactly once."""
    import cutlass.cute as cute

    from mla_cute_dsl.kernels import sm90_wgmma_decode as W

    assert W.FP8P_ELEMS_PER_COPY == 16
    k = W.MLADecodePartialWGMMASeesaw(cutlass.BFloat16, cutlass.Float8E4M3FN, fp8_producer=True)
    res = {}

    @cute.jit
    def probe():
        _, sK, _, _ = k._smem_layouts()
        g2r, r2s = k._fp8p_copies()
        c = cute.make_identity_tensor((W.BLOCK_N, W.D_QK))
        for t in cutlass.range_constexpr(W.WG_THREADS):  # static thread ids
            a = g2r.get_slice(t).partition_S(c)
            b = r2s.get_slice(t).partition_D(c)
            shp = (cute.size(a.shape[0]), cute.size(a.shape[1]), cute.size(a.shape[2]))
            res[("shape", t)] = (shp, (cute.size(b.shape[0]), cute.size(b.shape[1]), cute.size(b.shape[2])))
            res[("same", t)] = all(a[v, mm, blk] == b[v, mm, blk]
                                   for v in range(shp[0]) for mm in range(shp[1]) for blk in range(shp[2]))
            res[("elems", t)] = [[[tuple(b[v, mm, blk]) for v in range(shp[0])] for blk in range(shp[2])]
                                 for mm in range(shp[1])]
        res["units_ok"] = all(
            [sK((r, c0 + i, j)) for i in range(8)] == list(range(sK((r, c0, j)), sK((r, c0, j)) + 8))
            and sK((r, c0, j)) % 8 == 0
            for r in range(W.BLOCK_N) for c0 in range(0, W.D_QK, 8) for j in range(2)
        )

    cute.compile(probe)
    assert res["units_ok"] is True
    cover = []
    for t in range(W.WG_THREADS):
        assert res[("shape", t)] == ((16, 2, 9), (16, 2, 9))
        assert res[("same", t)] is True, t
        for mm, per_m in enumerate(res[("elems", t)]):
            for blk, vals in enumerate(per_m):
                assert all(r == t // 4 + 32 * mm for r, _ in vals)
                cols = [col for _, col in vals]
                assert cols == list(range(cols[0], cols[0] + 16)) and cols[0] % 16 == 0
                assert 64 * blk <= cols[0] < 64 * blk + 64
                cover += vals
    assert len(cover) == len(set(cover)) == W.BLOCK_N * W.D_QK


@pytest.mark.parametrize("q", ["bf16"])
def test_fp8p_producer_loads_are_128_bit(q, tmp_path):
    """After setmaxnreg.dec (the producer's code): one 128-bit ld.global per 64-column block and 32-row pass (4 + 5
    + 4 + 5 blocks x 2 passes = 36), the fp8 page-table reads aside; 128-bit st.shared of the converted fp16."""
    ptx, _, _ = _dump(q, tmp_path)
    flat = re.sub(r"\s+", " ", ptx)
    prod = flat[flat.find("setmaxnreg.dec"):]
    assert len(re.findall(r"ld\.global\.v4\.b32", prod)) == 36
    assert not re.findall(r"ld\.global\.v2\.b32", prod)
    assert re.findall(r"st\.shared\.v4\.b32", prod) and not re.findall(r"st\.shared\.v2", prod)
