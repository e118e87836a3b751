"""CPU tests (no GPU) of the seesaw kernel's opt-in TMA KV loads (``MLADecodePartialWGMMASeesaw(tma=True)``,
branch seesaw-tma2): the default seesaw kernels' PTX is byte-identical to before the option existed (sha256 of
the PTX without comments, pinned from commit 2e50b17, nvidia-cutlass-dsl 4.8.1, sm_90a); the TMA box is exactly
one 64-column block of sK; the tma kernel compiles for bf16 and fp16 and its PTX has the TMA loads, arms and
waits the design says and no cp.async KV load; fp8 caches are refused; the cache key carries "tma" only when set.
Nothing here runs a kernel: tests/test_seesaw_tma_gpu.py does, on an SM90 GPU."""

from __future__ import annotations

import os
import re

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

cutlass = pytest.importorskip("cutlass")

from test_balanced_compile import ptx_sha256  # noqa: E402  (same directory: pytest rootdir import)
from test_wgmma_compile import _nv_info_attrs, _sw128_descriptors  # noqa: E402
from seesaw_entries import getter_keywords  # noqa: E402  (same directory)

# sha256 (ptx_sha256: comments stripped, blank lines dropped) of seesaw kernels without tma, computed at 2e50b17
# before the option was added: (q, kv, l2 prefetch, partial dtype, wide stores); the getter's per-dtype prefetch
# default (fp8 on), fp32 partials with narrow stores, and the backend's bf16 default (bf16 partials, wide stores)
DEFAULT_SEESAW_PTX_SHA256 = {
    ("bf16", "bf16", False, "fp32", False): "09d853d21a60d6e252f0993af0fbf442800ee3c5adf9ccb269a2284b548da301",
    ("fp16", "fp16", False, "fp32", False): "f6a3e93663476e481a8de95a8d212c3f38a533a2697cf06a40e93cbbbf4dd856",
    # the fp8 pin moved in mla-cute-dsl 0.2.16: warpgroup 1's P_b V_R issue, tile a+2's conversion and the wait in
    # one branch (ptxas had serialized every WGMMA of the old form: tests/test_wgmma_serialization.py); GPU-verified
    # on an H200 in the twenty-first session
    ("bf16", "fp8_e4m3", True, "fp32", False): "22dcd479e68f44d81ddb17ceaaaa0cfd08e1d149801925e7eb10ef46f4a02bbb",
    ("bf16", "bf16", False, "bf16", True): "3f113ee08fc9ab49462f4e3b6124510d8181705ba6f4c3ab508da40e12aa4685",
}


def _seesaw(q: str, kv: str | None = None, l2_prefetch: bool = False, tma: bool = False, wide_store: bool = False,
            reader_fences: bool = False):
    from mla_cute_dsl.kernels import api
    from mla_cute_dsl.kernels.sm90_wgmma_decode import MLADecodePartialWGMMASeesaw

    return MLADecodePartialWGMMASeesaw(api._cutlass_dtype(q), api._cutlass_dtype(kv or q),
                                       l2_prefetch=l2_prefetch, tma=tma, wide_store=wide_store,
                                       reader_fences=reader_fences)


def _dump(k, q: str, kv: str, tmp_path, partial: str = "fp32"):
    """Compile kernel object k with --keep-ptx/--keep-cubin: (ptx, registers per thread, stack frame bytes)."""
    import cutlass.cute as cute

    from mla_cute_dsl.kernels import api

    cute.compile(k, *api._fake_args_partial(q, kv, partial),
                 options=api.COMPILE_OPTIONS + f" --keep-ptx --keep-cubin --dump-dir={tmp_path}")
    ptx = "".join(p.read_text() for p in tmp_path.glob("*.ptx"))
    attrs = _nv_info_attrs(b"".join(p.read_bytes() for p in tmp_path.glob("*.cubin")))
    regs = max(v for a, v in attrs if a == 0x2F)  # EIATTR_REGCOUNT
    frame = max((v for a, v in attrs if a == 0x11), default=0)  # EIATTR_FRAME_SIZE
    return ptx, regs, frame


@pytest.mark.parametrize("spec", sorted(DEFAULT_SEESAW_PTX_SHA256))
def test_default_seesaw_ptx_is_unchanged(spec, tmp_path):
    q, kv, l2pf, partial, wide = spec
    # the fp8 kernel's pin is its reader_fences=True arm since branch seesaw-tma-nofence (the GPU-verified code;
    # test_seesaw_balanced_compile.py pins the difference); the 16-bit cp.async kernel runs them anyway
    ptx, _, _ = _dump(_seesaw(q, kv, l2pf, wide_store=wide, reader_fences=kv == "fp8_e4m3"), q, kv, tmp_path,
                      partial)
    assert ptx_sha256(ptx) == DEFAULT_SEESAW_PTX_SHA256[spec]


def test_tma_box_is_one_64_column_block_of_sK():
    """The TMA box's smem layout (sP's: (64, 64) SW128 K-major) addresses exactly the elements of block c of
    sK[:, :, s] at offset s * 64 * 576 + c * 64 * 64 elements, every such offset 1024-byte aligned (the SW128
    swizzle phase of the block is the box's): a box written there is what the WGMMAs read as K and V."""
    import cutlass.cute as cute

    from mla_cute_dsl.kernels import sm90_wgmma_decode as W

    k = _seesaw("bf16", tma=True)
    res = {}

    @cute.jit
    def probe():
        _, sK, sP, _ = k._smem_layouts()
        res["bad"] = sum(
            sK.outer((r, W.KV_BOX * c + j, s)) != s * W.BLOCK_N * W.D_QK + c * W.BLOCK_N * W.KV_BOX + sP.outer((r, j))
            for r in range(W.BLOCK_N) for j in range(W.KV_BOX) for c in range(W.D_QK // W.KV_BOX) for s in range(2)
        )
        res["swizzle_same"] = str(sK.inner) == str(sP.inner)

    cute.compile(probe)
    assert res == {"bad": 0, "swizzle_same": True}
    assert all((s * W.BLOCK_N * W.D_QK + c * W.BLOCK_N * W.KV_BOX) * 2 % 1024 == 0
               for c in range(9) for s in range(2))


@pytest.mark.parametrize("q", ["bf16", "fp16"])
def test_tma_kernel_ptx(q, tmp_path):
    """tma=True: no spills; the same WGMMAs, descriptors and P handoff as the default; KV only by TMA: 36 boxes
    (prologue and loop: per pair 4 + 5 per warpgroup), 3-D tile mode completing on an mbarrier; 8 arms
    (mbarrier.arrive.expect_tx) of 32,768 or 40,960 bytes, each followed by its boxes on the same mbarrier; the
    4 mbarriers initialised with count 1; the only cp.async are Q's 18 per thread, all before the first box
    (the default kernel has 18 + 144, test_seesaw_ptx_structure); the last-tile V zeroing: 4 more mbarrier
    waits, st.shared -> async-proxy fence -> bar.sync 3 / 4 of 128 threads, each named barrier at two sites."""
    ptx, regs, frame = _dump(_seesaw(q, tma=True), q, q, tmp_path)
    print(f"seesaw tma {q}: {regs} registers, stack frame {frame} B")
    assert regs <= 255 and frame == 0, (regs, frame)
    assert "ld.local" not in ptx and "st.local" not in ptx
    assert ptx.count("griddepcontrol.launch_dependents;") == 1
    t = "f16" if q == "fp16" else "bf16"
    assert len(re.findall(rf"wgmma\.mma_async\.sync\.aligned\.m64n64k16\.f32\.{t}\.{t}", ptx)) == 72
    assert len(re.findall(rf"wgmma\.mma_async\.sync\.aligned\.m64n256k16\.f32\.{t}\.{t}", ptx)) == 16
    assert _sw128_descriptors(ptx) == {(16, 1024, 0), (8192, 1024, 0)}
    flat = re.sub(r"\s+", " ", ptx)

    boxes = re.findall(r"cp\.async\.bulk\.tensor\.3d\.shared::cta\.global\.tile\.mbarrier::complete_tx::bytes"
                       r"[^\[]*\[[^\]]*\], \[%rd\d+, \{%r\d+, %r\d+, %r\d+\}\], \[([^\]]*)\]", flat)
    assert len(boxes) == flat.count("cp.async.bulk.tensor") == 4 * (4 + 5)
    assert flat.count("prefetch.tensormap") == 1
    arms = re.findall(r"mov\.b32 %r\d+, (\d+); mbarrier\.arrive\.expect_tx\.shared\.b64 %rd\d+, \[([^\]]*)\], %r\d+;",
                      flat)
    assert len(arms) == flat.count("mbarrier.arrive.expect_tx") == 8
    assert sorted(int(b) for b, _ in arms) == [32768] * 4 + [40960] * 4
    # each arm is followed by the boxes of its part, on the same mbarrier, before the next arm
    pieces = flat.split("mbarrier.arrive.expect_tx.shared.b64")[1:]
    for (nbytes, bar), piece in zip(arms, pieces):
        part = re.findall(r"cp\.async\.bulk\.tensor[^;]*\], \[([^\]]*)\], %rd\d+;", piece)
        assert len(part) == int(nbytes) // 8192 and set(part) == {bar}, (nbytes, bar, part)
    inits = re.findall(r"mov\.b32 (%r\d+), 1; mbarrier\.init\.shared\.b64 \[[^\]]*\], (%r\d+);", flat)
    assert len(inits) == 1 and inits[0][0] == inits[0][1] and flat.count("mbarrier.init.shared.b64") == 4
    # no cp.async KV load: Q's cp.asyncs only, all before the first TMA box
    assert flat.count("cp.async.cg.shared.global") == 18
    assert flat.rfind("cp.async.cg.shared.global") < flat.find("cp.async.bulk.tensor")
    assert "cp.async.mbarrier.arrive" not in flat
    # waits: 4 in QK (own part, other part) + 4 before the last-tile zeroing; each QK wait -> WGMMA with no
    # proxy fence between (TMA boxes land in the async proxy; branch seesaw-tma-nofence)
    assert flat.count("mbarrier.try_wait") == 8
    assert not re.search(r"DONE: \} // end inline asm fence\.proxy\.async\.shared::cta; wgmma\.fence", flat)
    for bar in (3, 4):
        assert flat.count(f"bar.sync {bar}, 128;") == 2, bar
        assert len(re.findall(rf"st\.shared\.v4\.b32 \[%r\d+(\+\d+)?\], \{{0, 0, 0, 0\}}; (\$L__BB\d+_\d+: )?"
                              rf"fence\.proxy\.async\.shared::cta; bar\.sync {bar}, 128;", flat)) == 2, bar
    # P handoff as in the default kernel
    for bar in (1, 2):
        assert flat.count(f"bar.arrive {bar}, 256;") == 1 and flat.count(f"bar.sync {bar}, 256;") == 1
    assert set(re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+);", flat)) == {"0"}


def test_tma_is_refused_for_fp8_cache(monkeypatch):
    """fp8 KV keeps its own loads (ld.global -> cvt -> st.shared): tma=True is a ValueError naming the option,
    in the kernel object and in the getter, before anything is compiled."""
    from mla_cute_dsl.kernels import kernel_cache
    from mla_cute_dsl.kernels import sm90_wgmma_decode as W

    with pytest.raises(ValueError, match="tma=True"):
        W.MLADecodePartialWGMMASeesaw(cutlass.BFloat16, cutlass.Float8E4M3FN, tma=True)
    monkeypatch.setattr(kernel_cache, "get_or_build", lambda *a: pytest.fail("compiled"))
    for q in ("bf16", "fp16"):
        with pytest.raises(ValueError, match="tma=True"):
            W.get_partial_kernel_wgmma_seesaw(q, "fp8_e4m3", tma=True)
    assert not W.MLADecodePartialWGMMASeesaw(cutlass.BFloat16, cutlass.Float8E4M3FN).tma


def test_tma_cache_key_and_builder(monkeypatch):
    """"tma" joins the seesaw kernel-cache key only when set (every existing key unchanged), the builder turns it
    into the kernel's option (a builder that dropped it would compile the default kernel under the tma key), and
    mla_decode_sm90_wgmma_seesaw passes its ``tma`` argument to the getter."""
    import cutlass.cute as cute
    import torch

    from mla_cute_dsl.kernels import kernel_cache
    from mla_cute_dsl.kernels import sm90_wgmma_decode as W

    assert "tma" in W.SEESAW_FLAGS and "rfence" in W.SEESAW_FLAGS
    assert W.seesaw_spec("bf16", "bf16") == ("bf16", "bf16", 64)
    assert W.seesaw_spec("bf16", "bf16", tma=True) == ("bf16", "bf16", 64, "tma")
    assert W.seesaw_spec("bf16", "bf16", tma=True, reader_fences=True) == ("bf16", "bf16", 64, "tma", "rfence")
    assert W.seesaw_spec("bf16", "fp8_e4m3", True, reader_fences=True) == ("bf16", "fp8_e4m3", 64, "l2pf", "rfence")
    # the 16-bit cp.async kernel runs its reader fences anyway: one kernel, one key
    assert W.seesaw_spec("bf16", "bf16", reader_fences=True) == ("bf16", "bf16", 64)
    assert W.seesaw_spec("fp16", "fp16", True, "bf16", True, True) == ("fp16", "fp16", 64, "l2pf", "partial_bf16",
                                                                       "wide_store", "tma")
    keys = []
    monkeypatch.setattr(kernel_cache, "get_or_build", lambda kind, spec, build: keys.append((kind, spec)))
    W.get_partial_kernel_wgmma_seesaw("bf16")
    W.get_partial_kernel_wgmma_seesaw("bf16", tma=True)
    W.get_partial_kernel_wgmma_seesaw("fp16", "fp16", partial="fp16", tma=True)
    assert keys == [("partial_wgmma_seesaw", ("bf16", "bf16", 64)),
                    ("partial_wgmma_seesaw", ("bf16", "bf16", 64, "tma")),
                    ("partial_wgmma_seesaw", ("fp16", "fp16", 64, "partial_fp16", "tma"))]

    built = []
    monkeypatch.setattr(cute, "compile", lambda k, *a, **kw: built.append(k))
    W._build_partial_wgmma_seesaw("bf16", "bf16", 64)
    W._build_partial_wgmma_seesaw("bf16", "bf16", 64, "tma", "partial_bf16")
    W._build_partial_wgmma_seesaw("bf16", "bf16", 64, "tma", "rfence")
    W._build_partial_wgmma_seesaw("bf16", "fp8_e4m3", 64, "l2pf")
    W._build_partial_wgmma_seesaw("bf16", "fp8_e4m3", 64, "l2pf", "rfence")
    assert [k.tma for k in built] == [False, True, True, False, False] and built[1].mma_dtype is cutlass.BFloat16
    assert [k.reader_fences for k in built] == [True, False, True, False, True]

    asked = [(kw.get("tma"), kw.get("reader_fences")) for kw in getter_keywords(monkeypatch, [
        (False, torch.bfloat16, {"tma": False}), (False, torch.bfloat16, {"tma": True}),
        (False, torch.bfloat16, {"tma": True, "reader_fences": True})])]
    assert asked == [(False, False), (True, False), (True, True)]
