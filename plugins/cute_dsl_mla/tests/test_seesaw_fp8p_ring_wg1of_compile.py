"""CPU tests (no GPU) of the fp8 ring producer with WG1's QK part order (``MLADecodePartialWGMMASeesaw(fp8_producer=True,
fp8p_ring=R, wg1_other_first=True)``; branch fp8-wg1of, compile-only, NOT run on a GPU yet).

1. Refusals: with an fp8 cache, wg1_other_first needs fp8_producer and fp8p_ring (the inline fp8 kernel and the
   one-part producer keep refusing it), in the constructor and both getters (before any compile).
2. Key: "wg1of" after "fp8p", "fp8pr<R>" (seesaw_spec's order, only when set: every existing key unchanged); the
   builders make the kernel from the key; the host entries pass the keyword only when asked.
3. Option off: the ring kernel's PTX is main's (a6122ab; the same hashes as main 9d5071d, whose kernels/ is the
   same): pinned for the backend's fp8 arms (bf16 q, lazy, 16-bit wide partials; even and balanced), the fp32
   narrow balanced arm and fp16 eager fp32 even.
4. Option on, the same four kernels: the ring kernel's structure (384 threads, 168 registers at launch, no stack,
   setmaxnreg 208 / 88, 8 mbarriers, 88 WGMMAs, 8 waits / 8 arrives, 288 cvt and 42 ld.global.v4 in the producer),
   the same opcodes as without the option, and the producer's parts resolved from the PTX's mbarrier offsets:
   (empty 4 -> full 0), (5 -> 1), (6 -> 2), (7 -> 3) (without: ..., (7 -> 3), (6 -> 2)), and the math side's waits
   full 0, 1 (WG0), 2, 3 (WG1; without: 3, 2) with the same releases (empty 4, 6, 5, 7), with each part's chunk
   conversions (8 cvt per chunk: 8, 10, 10, 8 chunks) between its wait and its arrive; PTX pinned; with a
   cuobjdump at hand ($CUOBJDUMP, PATH, CUDA, triton's), the DSL's cubins of both: 88 HGMMA, 6 WARPGROUP.DEPBAR, no
   LDL / STL.
5. Standalone ptxas (-O3, sm_90a) on every kind the option can build with R = 7 (bf16 / fp16 q, eager / lazy, even /
   balanced, fp32 and 16-bit wide partials), R = 5 and R = 7 staged (fp8p_stage=4): no C7511 / C7518 (serialized
   WGMMAs), 0 spill bytes, no stack frame, <= 168 registers.
The protocol: test_seesaw_fp8p_ring_protocol.py (wg1of); the GPU run: test_seesaw_fp8p_ring_wg1of_gpu.py.
"""

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
from seesaw_entries import getter_keywords  # noqa: E402  (same directory)
from test_seesaw_fp8p_ring_compile import _kernel as _ring_kernel, compile_dump  # noqa: E402

# (q, balanced, lazy, wide) -> ptx_sha256 (test_balanced_compile.ptx_sha256; nvidia-cutlass-dsl 4.8.1 with its cu13
# libraries: the project's .venv, where the other PTX pins hold; sm_90a) of the ring producer kernel (fp8p_ring=7,
# l2_prefetch) WITHOUT wg1_other_first on main a6122ab (GPU-verified: the backend's fp8 default since 0.2.18)
RING_MAIN_PTX_SHA256 = {
    ("bf16", False, True, True): "0db4d2b01ef120deaebea8f8c47ae6e1bd5e84af24e3c640ff4b137da11ca30f",
    ("bf16", True, True, True): "aecbee324f78309909fa33d4e9960859c1b33b96dd47024256032f19757e3192",
    ("bf16", True, True, False): "f092bdb5b829d81fcd3b3a16c0f1c18bf4371c3241a12d12fe367ddb58b1f594",
    ("fp16", False, False, False): "5c5cfe9772d0d3459e52ecabe20e70449276e6f4ca100a9021ed936de925491f",
}
# the same kernels WITH wg1_other_first (branch fp8-wg1of; GPU-verified on an H200 in the twenty-sixth session with
# these pins: rerun test_seesaw_fp8p_ring_wg1of_gpu.py before moving a pin)
RING_WG1OF_PTX_SHA256 = {
    ("bf16", False, True, True): "0e20f8badf14d9a65a0ed60636614fbbd1a0adfab2f1be320ec4656be0129731",
    ("bf16", True, True, True): "c88c6feac64d87189cd23635f3e61258960ad195d5d143396db37da16a1e9db0",
    ("bf16", True, True, False): "538145b928eace3a4147e00bd4613030eccfed8ddea953af9d2c4850f9e681d7",
    ("fp16", False, False, False): "9d8003f74f107e38e8dccabe897841ebb293c8a0c3ea96581a9902a5270bcb97",
}


def _kernel(q: str, balanced: bool, lazy: bool, wide: bool, wg1of: bool = True, ring: int = 7, stage: int = 0):
    """(entry, fake arguments) of the fp8 ring producer kernel (l2_prefetch on, the getters' fp8 default), with
    wg1_other_first unless told otherwise: test_seesaw_fp8p_ring_compile's builder in this file's argument order."""
    return _ring_kernel(q, ring, balanced=balanced, lazy=lazy, wide=wide, stage=stage, wg1of=wg1of)


def _dump(tmp_path, *a, **kw):
    """Compile with --keep-ptx/--keep-cubin: (ptx text, registers at launch, stack frame)."""
    return compile_dump(tmp_path, *_kernel(*a, **kw))


def _mbar_index(ptx):
    """mbarrier index (relative to mbar + 0, the first one inited) of a shared address operand of the PTX."""
    offs = {m.group(1): int(m.group(2)) for m in re.finditer(r"add\.s32\s+(%r\d+), %r1, (\d+);", ptx)}

    def addr(a):
        m = re.fullmatch(r"%r1\+(\d+)", a)
        return int(m.group(1)) if m else offs[a]

    base = addr(re.search(r"mbarrier\.init\.shared\.b64\s+\[([^\]]+)\]", ptx).group(1))
    return lambda a: (addr(a) - base) // 8


def math_barriers(ptx):
    """The math warpgroups' mbarrier waits and arrives in program order (before the producer's setmaxnreg.dec):
    (full indices waited, empty indices arrived on)."""
    idx = _mbar_index(ptx)
    math = ptx[:ptx.find("setmaxnreg.dec")]
    return ([idx(m.group(1)) for m in re.finditer(r"mbarrier\.try_wait\.parity\.shared\.b64 \w+, \[([^\]]+)\]", math)],
            [idx(m.group(1)) for m in re.finditer(r"mbarrier\.arrive\.shared\.b64 %rd\d+, \[([^\]]+)\]", math)])


def producer_parts(ptx):
    """The producer's parts in program order (after its setmaxnreg.dec): (empty mbarrier index it waited, full index
    it arrived on, cvt.rn.f16x2.e4m3x2 between the wait and the arrive), the indices resolved from the shared-memory
    offsets (``add.s32 %rX, %r1, N`` or ``[%r1+N]``) relative to full[0] (mbar + 0, the first mbarrier inited)."""
    offs = {m.group(1): int(m.group(2)) for m in re.finditer(r"add\.s32\s+(%r\d+), %r1, (\d+);", ptx)}

    def addr(a):
        m = re.fullmatch(r"%r1\+(\d+)", a)
        return int(m.group(1)) if m else offs[a]

    init = re.search(r"mbarrier\.init\.shared\.b64\s+\[([^\]]+)\]", ptx)
    base = addr(init.group(1))
    prod = ptx[ptx.find("setmaxnreg.dec"):]
    seq, wait, cvt = [], None, 0
    for m in re.finditer(r"mbarrier\.try_wait\.parity\.shared\.b64 \w+, \[([^\]]+)\]"
                         r"|mbarrier\.arrive\.shared\.b64 %rd\d+, \[([^\]]+)\]"
                         r"|cvt\.rn\.f16x2\.e4m3x2", prod):
        if m.group(1):
            wait, cvt = (addr(m.group(1)) - base) // 8, 0
        elif m.group(2):
            seq.append((wait, (addr(m.group(2)) - base) // 8, cvt))
            wait, cvt = None, 0
        else:
            cvt += 1
    return seq


def test_wg1of_with_fp8_needs_the_ring_producer(monkeypatch):
    from mla_cute_dsl.kernels import kernel_cache
    from mla_cute_dsl.kernels import sm90_wgmma_decode as W

    f8 = cutlass.Float8E4M3FN
    k = W.MLADecodePartialWGMMASeesaw(cutlass.BFloat16, f8, fp8_producer=True, fp8p_ring=7, wg1_other_first=True)
    assert k.wg1_other_first and k.fp8p_ring == 7 and k._num_mbars() == 8 and k.fp8p_regs == (208, 88)
    for kw in ({}, {"fp8_producer": True}, {"balanced": True}, {"balanced": True, "fp8_producer": True}):
        with pytest.raises(ValueError, match="wg1_other_first=True needs"):
            W.MLADecodePartialWGMMASeesaw(cutlass.BFloat16, f8, wg1_other_first=True, **kw)
    monkeypatch.setattr(kernel_cache, "get_or_build", lambda *a: pytest.fail("compiled"))
    for getter in (W.get_partial_kernel_wgmma_seesaw, W.get_partial_kernel_wgmma_seesaw_balanced):
        for kw in ({}, {"fp8_producer": True}):
            with pytest.raises(ValueError, match="wg1_other_first=True needs"):
                getter("bf16", "fp8_e4m3", wg1_other_first=True, **kw)


def test_wg1of_ring_key_builder_and_entries(monkeypatch):
    import cutlass.cute as cute
    import torch

    from mla_cute_dsl.kernels import kernel_cache
    from mla_cute_dsl.kernels import sm90_wgmma_decode as W

    assert W.seesaw_spec("bf16", "fp8_e4m3", True, "bf16", True, lazy_rescale=True, fp8_producer=True, fp8p_ring=7,
                         wg1_other_first=True) == ("bf16", "fp8_e4m3", 64, "l2pf", "partial_bf16", "wide_store",
                                                   "lazy", "fp8p", "fp8pr7", "wg1of")
    keys = []
    monkeypatch.setattr(kernel_cache, "get_or_build", lambda kind, spec, build: keys.append((kind, spec)))
    W.get_partial_kernel_wgmma_seesaw("bf16", "fp8_e4m3", lazy_rescale=True, fp8_producer=True, fp8p_ring=7,
                                      wg1_other_first=True)
    W.get_partial_kernel_wgmma_seesaw_balanced("bf16", "fp8_e4m3", lazy_rescale=True, fp8_producer=True, fp8p_ring=7,
                                               wg1_other_first=True)
    W.get_partial_kernel_wgmma_seesaw_balanced("bf16", "fp8_e4m3", lazy_rescale=True, fp8_producer=True, fp8p_ring=7)
    assert keys == [
        ("partial_wgmma_seesaw", ("bf16", "fp8_e4m3", 64, "l2pf", "lazy", "fp8p", "fp8pr7", "wg1of")),
        ("partial_wgmma_seesaw_balanced", ("bf16", "fp8_e4m3", 64, "l2pf", "lazy", "fp8p", "fp8pr7", "wg1of")),
        ("partial_wgmma_seesaw_balanced", ("bf16", "fp8_e4m3", 64, "l2pf", "lazy", "fp8p", "fp8pr7"))]

    built = []
    monkeypatch.setattr(cute, "compile", lambda k, *a, **kw: built.append(k))
    W._build_partial_wgmma_seesaw("bf16", "fp8_e4m3", 64, "l2pf", "lazy", "fp8p", "fp8pr7", "wg1of")
    W._build_partial_wgmma_seesaw_balanced("bf16", "fp8_e4m3", 64, "l2pf", "lazy", "fp8p", "fp8pr7", "wg1of")
    W._build_partial_wgmma_seesaw_balanced("bf16", "fp8_e4m3", 64, "l2pf", "lazy", "fp8p", "fp8pr7")
    objs = [k if hasattr(k, "fp8p_ring") else k.__self__ for k in built]
    assert [(k.fp8p_ring, k.wg1_other_first, k.balanced) for k in objs] == [(7, True, False), (7, True, True),
                                                                            (7, False, True)]

    ring = {"fp8_producer": True, "fp8p_ring": 7}
    asked = getter_keywords(monkeypatch, [(balanced, torch.float8_e4m3fn, kw) for balanced in (False, True)
                                          for kw in (ring, ring | {"wg1_other_first": True})])
    assert [kw.get("wg1_other_first", "absent") for kw in asked] == ["absent", True, "absent", True]


def _check_ring_ptx(ptx, regs, frame):
    flat = re.sub(r"\s+", " ", ptx)
    assert ".reqntid 384, 1, 1" in flat and ".minnctapersm 1" in flat
    assert regs == 168 and frame == 0
    assert re.findall(r"setmaxnreg\.inc\.sync\.aligned\.u32 (\d+);", flat) == ["208"]
    assert re.findall(r"setmaxnreg\.dec\.sync\.aligned\.u32 (\d+);", flat) == ["88"]
    assert flat.find("setmaxnreg") > flat.find("bar.sync 0;")
    assert len(re.findall(r"wgmma\.mma_async", flat)) == 88
    assert flat.count("mbarrier.init.shared.b64") == 8
    dec = flat.find("setmaxnreg.dec")
    math_ptx, prod_ptx = flat[:dec], flat[dec:]
    assert math_ptx.count("mbarrier.try_wait.parity.shared.b64") == 4 and math_ptx.count("mbarrier.arrive.shared") == 4
    assert prod_ptx.count("mbarrier.try_wait.parity.shared.b64") == 4 and prod_ptx.count("mbarrier.arrive.shared") == 4
    assert flat.count("bar.sync 0;") == 1 and flat.count("bar.sync 5, 256;") == 2
    cvt = [m.start() for m in re.finditer(r"cvt\.rn\.f16x2\.e4m3x2", flat)]
    assert len(cvt) == 36 * 8 and min(cvt) > dec
    assert len(re.findall(r"ld\.global\.v4\.b32", prod_ptx)) == 36 + 6
    assert len(re.findall(r"st\.shared\.v4\.b32", prod_ptx)) == 72
    assert set(re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+);", flat)) == {"0"}


@pytest.mark.parametrize("spec", sorted(RING_WG1OF_PTX_SHA256), ids=lambda s: "-".join(map(str, s)))
def test_wg1of_ring_ptx_and_the_option_off_is_mains(spec, tmp_path):
    """Option off: main's PTX.  Option on: the ring kernel's structure, the same opcodes (only the producer's two
    tile-b parts and WG1's two QK halves swap), the producer's parts 0, 1, 2, 3 each after its own empty wait, and
    the pin."""
    from test_seesaw_wg1of_compile import _opcodes

    off, regs, frame = _dump(tmp_path / "off", *spec, wg1of=False)
    assert ptx_sha256(off) == RING_MAIN_PTX_SHA256[spec], "the ring kernel without wg1_other_first changed"
    _check_ring_ptx(off, regs, frame)
    ptx, regs, frame = _dump(tmp_path / "on", *spec)
    print(f"fp8 ring wg1of {spec}: {regs} registers at launch, stack frame {frame} B, ptx_sha256 {ptx_sha256(ptx)}")
    _check_ring_ptx(ptx, regs, frame)
    assert ptx != off and _opcodes(ptx) == _opcodes(off)
    # (empty index waited, full index arrived, conversions in between): 8 cvt per chunk, 2 passes x blocks
    assert producer_parts(off) == [(4, 0, 64), (5, 1, 80), (7, 3, 64), (6, 2, 80)]
    assert producer_parts(ptx) == [(4, 0, 64), (5, 1, 80), (6, 2, 80), (7, 3, 64)]
    # the math side: WG0's qk waits full 0, 1; WG1's qk full 3, 2 (off) / 2, 3 (on: qk_wait_order); the releases
    # (WG0: empty 0 after P_a V_L, 2 after P_b V_L; WG1: empty 1, 3) unchanged
    assert math_barriers(off) == ([0, 1, 3, 2], [4, 6, 5, 7])
    assert math_barriers(ptx) == ([0, 1, 2, 3], [4, 6, 5, 7])
    assert ptx_sha256(ptx) == RING_WG1OF_PTX_SHA256[spec]
    cuobjdump = _cuobjdump()
    if cuobjdump is not None:  # the DSL's own cubins (its ptxas): not serialized, no local memory, as without it
        for d in ("off", "on"):
            (cubin,) = (tmp_path / d).glob("*.cubin")
            sass = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True).stdout
            assert sass.count("HGMMA") == 88 and len(re.findall(r"WARPGROUP\.DEPBAR", sass)) == 6, d
            assert not re.search(r"\b(LDL|STL)\b", sass), d


def _cuobjdump():
    """$CUOBJDUMP, PATH, /usr/local/cuda*/bin, or the one a triton install ships (None: the SASS check skipped)."""
    cands = [os.environ.get("CUOBJDUMP"), shutil.which("cuobjdump"), *sorted(glob.glob("/usr/local/cuda*/bin/cuobjdump"))]
    try:
        import triton

        cands.append(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump"))
    except Exception:  # noqa: BLE001 - optional
        pass
    return next((c for c in cands if c and os.path.isfile(c) and os.access(c, os.X_OK)), None)


def _kinds():
    out = [(q, b, lazy, False, 7, 0) for q in ("bf16", "fp16") for b in (False, True) for lazy in (False, True)]
    out += [(q, b, True, True, 7, 0) for q in ("bf16", "fp16") for b in (False, True)]
    out += [("bf16", b, True, True, 5, 0) for b in (False, True)]  # the other ring size
    out += [("bf16", b, True, True, 7, 4) for b in (False, True)]  # shared-memory staging
    return out


@pytest.mark.parametrize("q,balanced,lazy,wide,ring,stage", _kinds(), ids=lambda v: str(v))
def test_ptxas_assembles_the_wg1of_ring_kernels(q, balanced, lazy, wide, ring, stage, tmp_path):
    """Standalone ptxas (-O3, sm_90a): no C7511 / C7518 (serialized WGMMAs), 0 spill bytes (the setmaxnreg regions
    included: math 208, producer 88), no stack frame, <= 168 registers at launch."""
    from test_wgmma_serialization import _assemble, _ptx, _ptxas

    ptxas = _ptxas()
    if ptxas is None:
        pytest.skip("no ptxas ($PTXAS, PATH, /usr/local/cuda*/bin)")
    ptx = _ptx(*_kernel(q, balanced, lazy, wide, ring=ring, stage=stage), tmp_path)
    run = _assemble(ptxas, ptx, tmp_path)
    assert run.returncode == 0, run.stderr
    log = run.stdout + run.stderr
    print(f"ptxas {ptxas}: {' '.join(log.split()[-40:])}")
    assert "C7518" not in log and "C7511" not in log and "serialized" not in log, log
    used = re.search(r"Used (\d+) registers", log)
    assert used and int(used.group(1)) <= 168, log
    assert re.search(r"0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads", log), log
