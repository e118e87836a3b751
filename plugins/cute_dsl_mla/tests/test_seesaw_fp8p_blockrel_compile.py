"""CPU tests (no GPU) of the fp8 ring producer with per-block release (``MLADecodePartialWGMMASeesaw(fp8_producer=True,
fp8p_ring=R, fp8p_block_release=True)``; branch fp8-block-release, compile-only): the option is refused where it
does not apply (before any compile); the cache key carries "fp8pbr" only when set and the builders / entries pass it
on; the option-off ring kernels' PTX is main's (pinned: the backend's fp8 arms, even and balanced); the option-on
kernels' PTX has the protocol's structure (14 mbarriers, 7 waits and 7 arrives on each side, every P V as N = 64
WGMMAs, wait_group 3 / 2 / 1 once each) and is pinned; standalone ptxas assembles every kind without a spill, a stack
frame or serialized WGMMAs (C7511 / C7518); with cuobjdump at hand the SASS has 136 HGMMA and 9 warpgroup waits.
The protocol: test_seesaw_fp8p_blockrel_protocol.py; the GPU run: test_seesaw_fp8p_blockrel_gpu.py."""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

cutlass = pytest.importorskip("cutlass")

from test_balanced_compile import ptx_sha256  # noqa: E402  (same directory: pytest rootdir import)
from test_wgmma_compile import _nv_info_attrs  # noqa: E402


def _kernel(q: str, balanced: bool, lazy: bool, wide: bool, blk: bool = True, ring: int = 7):
    """(entry, fake arguments) of the fp8 ring producer kernel (l2_prefetch on, as the getters' fp8 default)."""
    from mla_cute_dsl.kernels import api
    from mla_cute_dsl.kernels.sm90_wgmma_decode import MLADecodePartialWGMMASeesaw

    k = MLADecodePartialWGMMASeesaw(api._cutlass_dtype(q), cutlass.Float8E4M3FN, l2_prefetch=True, balanced=balanced,
                                    lazy_rescale=lazy, fp8_producer=True, wide_store=wide, fp8p_ring=ring,
                                    **({"fp8p_block_release": True} if blk else {}))
    partial = q if wide else "fp32"
    if balanced:
        return k.call_balanced, api._fake_args_partial_balanced(q, "fp8_e4m3", partial)
    return k, api._fake_args_partial(q, "fp8_e4m3", partial)


def _dump(tmp_path, *a, **kw):
    """Compile with --keep-ptx/--keep-cubin: (ptx text, registers at launch, stack frame)."""
    import cutlass.cute as cute

    from mla_cute_dsl.kernels import api

    entry, args = _kernel(*a, **kw)
    cute.compile(entry, *args, options=api.COMPILE_OPTIONS + f" --keep-ptx --keep-cubin --dump-dir={tmp_path}")
    ptx = "".join(p.read_text() for p in tmp_path.glob("*.ptx"))
    attrs = _nv_info_attrs(b"".join(p.read_bytes() for p in tmp_path.glob("*.cubin")))
    regs = max(v for a_, v in attrs if a_ == 0x2F)  # EIATTR_REGCOUNT
    frame = max((v for a_, v in attrs if a_ == 0x11), default=0)  # EIATTR_FRAME_SIZE
    return ptx, regs, frame


# (q, balanced, lazy, wide) -> ptx_sha256 (test_balanced_compile.ptx_sha256; nvidia-cutlass-dsl 4.8.1 with its cu13
# libraries, the project's dev environment in which the other PTX pins hold; sm_90a) of the
# fp8 ring producer kernel (fp8p_ring=7, l2_prefetch) WITHOUT the option on main 9d5071d: the backend's fp8 arms at
# 128+ packed rows (bf16 q, lazy, 16-bit wide partials; even and balanced), the fp32 narrow balanced arm and fp16
# eager fp32 even
RING_MAIN_PTX_SHA256 = {
    ("bf16", False, True, True): "0db4d2b01ef120deaebea8f8c47ae6e1bd5e84af24e3c640ff4b137da11ca30f",
    ("bf16", True, True, True): "aecbee324f78309909fa33d4e9960859c1b33b96dd47024256032f19757e3192",
    ("bf16", True, True, False): "f092bdb5b829d81fcd3b3a16c0f1c18bf4371c3241a12d12fe367ddb58b1f594",
    ("fp16", False, False, False): "5c5cfe9772d0d3459e52ecabe20e70449276e6f4ca100a9021ed936de925491f",
}
# the same kernels WITH fp8p_block_release (this branch)
BLOCKREL_PTX_SHA256 = {
    ("bf16", False, True, True): "753ac65e8c0354d73b62a71b7289c12259a04c8d9033dfb6e3bd6155d6b5ee25",
    ("bf16", True, True, True): "663591daaffc87d38c7e587fe265167253470114d7d758e017fe5a808c9b16cc",
    ("bf16", True, True, False): "8586059f90eee41d0433e6374c590fd859528ddf208f9f7744e8ad681f475ff3",
    ("fp16", False, False, False): "7c5666d084bb97b0a5001f42add44777f6f100eaf1c5ae4175c6461721e1db6b",
}


def test_block_release_mbarriers_and_smem():
    from mla_cute_dsl.kernels import fp8p_ring
    from mla_cute_dsl.kernels import sm90_wgmma_decode as W

    k = W.MLADecodePartialWGMMASeesaw(cutlass.BFloat16, cutlass.Float8E4M3FN, fp8_producer=True, fp8p_ring=7,
                                      fp8p_block_release=True)
    assert k._num_mbars() == fp8p_ring.BLOCK_RELEASE_MBARS == 14 and k.fp8p_regs == (208, 88)
    assert k.smem_bytes() == 222_784 + 6 * 8 <= W.SMEM_LIMIT
    off = W.MLADecodePartialWGMMASeesaw(cutlass.BFloat16, cutlass.Float8E4M3FN, fp8_producer=True, fp8p_ring=7)
    assert off._num_mbars() == 8 and off.smem_bytes() == 222_784 and not off.fp8p_block_release


def test_block_release_is_refused_where_it_does_not_apply(monkeypatch):
    from mla_cute_dsl.kernels import kernel_cache
    from mla_cute_dsl.kernels import sm90_wgmma_decode as W

    bad = [dict(), dict(fp8_producer=True), dict(fp8_producer=True, fp8p_ring=7, fp8p_stage=4)]
    for kw in bad:
        with pytest.raises(ValueError, match="fp8p_block_release"):
            W.MLADecodePartialWGMMASeesaw(cutlass.BFloat16, cutlass.Float8E4M3FN, fp8p_block_release=True, **kw)
    with pytest.raises(ValueError, match="fp8p_block_release"):  # a 16-bit cache has no producer ring
        W.MLADecodePartialWGMMASeesaw(cutlass.BFloat16, cutlass.BFloat16, fp8p_block_release=True)
    with pytest.raises(ValueError, match="fp8p_block_release"):  # nor does the TMA producer (16-bit)
        W.MLADecodePartialWGMMASeesaw(cutlass.BFloat16, cutlass.BFloat16, tma=True, balanced=True,
                                      tma_producer=True, fp8p_block_release=True)
    monkeypatch.setattr(kernel_cache, "get_or_build", lambda *a: pytest.fail("compiled"))
    for getter in (W.get_partial_kernel_wgmma_seesaw, W.get_partial_kernel_wgmma_seesaw_balanced):
        for kw in bad:
            with pytest.raises(ValueError, match="fp8p_block_release"):
                getter("bf16", "fp8_e4m3", fp8p_block_release=True, **kw)


def test_block_release_cache_key_builder_and_entries(monkeypatch):
    import cutlass.cute as cute
    import torch

    from mla_cute_dsl.kernels import api, kernel_cache
    from mla_cute_dsl.kernels import sm90_wgmma_decode as W

    assert W.seesaw_spec("bf16", "fp8_e4m3", True, "bf16", True, lazy_rescale=True, fp8_producer=True, fp8p_ring=7,
                         fp8p_block_release=True) == ("bf16", "fp8_e4m3", 64, "l2pf", "partial_bf16", "wide_store",
                                                      "lazy", "fp8p", "fp8pr7", "fp8pbr")
    assert W.seesaw_spec("bf16", "fp8_e4m3", True, fp8_producer=True, fp8p_ring=7) == (
        "bf16", "fp8_e4m3", 64, "l2pf", "fp8p", "fp8pr7")
    keys = []
    monkeypatch.setattr(kernel_cache, "get_or_build", lambda kind, spec, build: keys.append((kind, spec)))
    W.get_partial_kernel_wgmma_seesaw("bf16", "fp8_e4m3", fp8_producer=True, fp8p_ring=7)
    W.get_partial_kernel_wgmma_seesaw("bf16", "fp8_e4m3", fp8_producer=True, fp8p_ring=7, fp8p_block_release=True)
    W.get_partial_kernel_wgmma_seesaw_balanced("fp16", "fp8_e4m3", lazy_rescale=True, fp8_producer=True, fp8p_ring=5,
                                               fp8p_block_release=True)
    assert keys == [("partial_wgmma_seesaw", ("bf16", "fp8_e4m3", 64, "l2pf", "fp8p", "fp8pr7")),
                    ("partial_wgmma_seesaw", ("bf16", "fp8_e4m3", 64, "l2pf", "fp8p", "fp8pr7", "fp8pbr")),
                    ("partial_wgmma_seesaw_balanced",
                     ("fp16", "fp8_e4m3", 64, "l2pf", "lazy", "fp8p", "fp8pr5", "fp8pbr"))]

    built = []
    monkeypatch.setattr(cute, "compile", lambda k, *a, **kw: built.append(k))
    W._build_partial_wgmma_seesaw("bf16", "fp8_e4m3", 64, "l2pf", "fp8p", "fp8pr7")
    W._build_partial_wgmma_seesaw("bf16", "fp8_e4m3", 64, "l2pf", "fp8p", "fp8pr7", "fp8pbr")
    W._build_partial_wgmma_seesaw_balanced("bf16", "fp8_e4m3", 64, "l2pf", "lazy", "fp8p", "fp8pr7", "fp8pbr")
    objs = [k if hasattr(k, "fp8p_ring") else k.__self__ for k in built]  # balanced: call_balanced
    assert [(k.fp8p_ring, k.fp8p_block_release, k.balanced) for k in objs] == [(7, False, False), (7, True, False),
                                                                              (7, True, True)]

    asked = []

    def getter(*a, **kw):
        asked.append(kw.get("fp8p_block_release", "absent"))

    monkeypatch.setattr(W, "get_partial_kernel_wgmma_seesaw", getter)
    monkeypatch.setattr(W, "get_partial_kernel_wgmma_seesaw_balanced", getter)
    monkeypatch.setattr(api, "launch", lambda *a, **kw: None)
    monkeypatch.setattr(api, "launch_balanced", lambda *a, **kw: None)
    monkeypatch.setattr(api, "check_balanced", lambda *a, **kw: None)

    class Sched:
        wide_store = False
        block_m = 64

    q = torch.zeros(1, 1, 64, 576, dtype=torch.bfloat16)
    kv = q.to(torch.float8_e4m3fn)
    ws = [torch.zeros(1, dtype=torch.float32)]
    for blk in (False, True):
        W.mla_decode_sm90_wgmma_seesaw(q, kv, None, None, 1.0, 1.0, None, None, Sched(), ws, check=False,
                                       fp8_producer=True, fp8p_ring=7, fp8p_block_release=blk)
        W.mla_decode_sm90_wgmma_seesaw_balanced(q, kv, None, None, 1.0, 1.0, None, None, Sched(), ws, check=False,
                                                fp8_producer=True, fp8p_ring=7, fp8p_block_release=blk)
    assert asked == ["absent", "absent", True, True]  # the default calls' keywords are unchanged


@pytest.mark.parametrize("spec", sorted(RING_MAIN_PTX_SHA256), ids=lambda s: "-".join(map(str, s)))
def test_option_off_ring_kernels_are_mains(spec, tmp_path):
    q, balanced, lazy, wide = spec
    ptx, _, _ = _dump(tmp_path, q, balanced, lazy, wide, blk=False)
    assert ptx_sha256(ptx) == RING_MAIN_PTX_SHA256[spec], "the fp8 ring kernel without fp8p_block_release changed"


@pytest.mark.parametrize("spec", sorted(BLOCKREL_PTX_SHA256), ids=lambda s: "-".join(map(str, s)))
def test_block_release_kernel_ptx(spec, tmp_path):
    """The ring producer kernel's structure (test_seesaw_fp8p_ring_compile.test_ring_kernel_ptx) with the per-block
    protocol: 14 mbarriers; the producer 7 empty waits and 7 full arrives (4 parts, part 3 as 4 blocks), the math
    warpgroups 7 full waits (WG0 2, WG1 4 blocks + WG0's part) and 7 empty arrives (WG1's P_b V_R releases 4 blocks);
    every WGMMA 64 x 64 x 16 (72 of S, 4 P V x 16); wait_group 3, 2, 1 once each (the per-block release), 0 as
    before; the producer's conversions and loads as the ring's (288 cvt, 36 + 6 ld.global.v4, 72 st.shared.v4)."""
    q, balanced, lazy, wide = spec
    ptx, regs, frame = _dump(tmp_path, q, balanced, lazy, wide)
    flat = re.sub(r"\s+", " ", ptx)
    assert ".reqntid 384, 1, 1" in flat and ".minnctapersm 1" in flat
    assert regs == 168 and frame == 0
    assert re.findall(r"setmaxnreg\.inc\.sync\.aligned\.u32 (\d+);", flat) == ["208"]
    assert re.findall(r"setmaxnreg\.dec\.sync\.aligned\.u32 (\d+);", flat) == ["88"]
    assert len(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n64k16", flat)) == 136
    assert "m64n256k16" not in flat
    assert flat.count("mbarrier.init.shared.b64") == 14
    dec = flat.find("setmaxnreg.dec")
    math_ptx, prod_ptx = flat[:dec], flat[dec:]
    assert math_ptx.count("mbarrier.try_wait.parity.shared.b64") == 7
    assert math_ptx.count("mbarrier.arrive.shared.b64") == 7
    assert prod_ptx.count("mbarrier.try_wait.parity.shared.b64") == 7 and prod_ptx.count("mbarrier.arrive.shared") == 7
    waits = re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+);", flat)
    assert sorted(w for w in waits if w != "0") == ["1", "2", "3"] and waits.count("0") == 6
    assert flat.count("bar.sync 0;") == 1 and flat.count("bar.sync 5, 256;") == 2
    cvt = [m.start() for m in re.finditer(r"cvt\.rn\.f16x2\.e4m3x2", flat)]
    assert len(cvt) == 36 * 8 and min(cvt) > dec
    assert len(re.findall(r"ld\.global\.v4\.b32", prod_ptx)) == 36 + 6
    assert len(re.findall(r"st\.shared\.v4\.b32", prod_ptx)) == 72
    print(f"fp8pbr {spec}: ptx_sha256 {ptx_sha256(ptx)}")
    assert ptx_sha256(ptx) == BLOCKREL_PTX_SHA256[spec]


def _kinds():
    out = [("bf16", b, lazy, False, 7) for b in (False, True) for lazy in (False, True)]
    out += [("fp16", b, lazy, False, 7) for b in (False, True) for lazy in (False, True)]
    out += [("bf16", b, True, True, 7) for b in (False, True)] + [("fp16", b, True, True, 7) for b in (False, True)]
    out += [("bf16", b, True, True, 5) for b in (False, True)]  # the other ring size the kernel takes
    return out


def _cuobjdump():
    cands = [os.environ.get("CUOBJDUMP"), shutil.which("cuobjdump"), *sorted(glob.glob("/usr/local/cuda*/bin/cuobjdump"))]
    try:
        import triton

        cands.append(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump"))
    except Exception:  # noqa: BLE001 - optional
        pass
    return next((c for c in cands if c and os.path.isfile(c) and os.access(c, os.X_OK)), None)


@pytest.mark.parametrize("q,balanced,lazy,wide,ring", _kinds(), ids=lambda v: str(v))
def test_ptxas_assembles_the_block_release_kernels(q, balanced, lazy, wide, ring, tmp_path):
    """Standalone ptxas (-O3, sm_90a): no C7511 / C7518 (serialized WGMMAs), 0 spill bytes (the setmaxnreg regions
    included: math 208, producer 88), no stack frame, 168 registers at launch.  With cuobjdump: 136 HGMMA, 9
    WARPGROUP.DEPBAR (the 6 of the ring kernel and the release's three), no local memory."""
    from test_wgmma_serialization import _assemble, _ptx, _ptxas

    ptxas = _ptxas()
    if ptxas is None:
        pytest.skip("no ptxas ($PTXAS, PATH, /usr/local/cuda*/bin)")
    ptx = _ptx(*_kernel(q, balanced, lazy, wide, ring=ring), tmp_path)
    text = ptx.read_text()
    run = _assemble(ptxas, ptx, tmp_path)
    older = re.search(r"Unsupported \.version [\d.]+; current version is '([\d.]+)'", run.stderr)
    if run.returncode != 0 and older:
        ptx.write_text(re.sub(r"^\.version [\d.]+", f".version {older.group(1)}", text, count=1, flags=re.M))
        run = _assemble(ptxas, ptx, tmp_path)
    assert run.returncode == 0, run.stderr
    log = run.stdout + run.stderr
    assert "C7518" not in log and "C7511" not in log and "serialized" not in log, log
    used = re.search(r"Used (\d+) registers", log)
    assert used and int(used.group(1)) <= 168, log
    assert re.search(r"0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads", log), log
    cuobjdump = _cuobjdump()
    if cuobjdump is None:
        return
    sass = subprocess.run([cuobjdump, "-sass", str(tmp_path / "k.cubin")], capture_output=True, text=True).stdout
    assert sass.count("HGMMA") == 136, sass.count("HGMMA")
    assert len(re.findall(r"WARPGROUP\.DEPBAR", sass)) == 9
    assert not re.search(r"\b(LDL|STL)\b", sass)
