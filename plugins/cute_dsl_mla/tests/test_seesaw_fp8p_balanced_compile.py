"""CPU tests (no GPU) of the balanced fp8 seesaw with the producer warpgroup (``MLADecodePartialWGMMASeesaw(
balanced=True, fp8_producer=True)``, ``kernel_fp8p_balanced``; branch fp8-balanced-producer): the kernel compiles
for bf16 and fp16 q (eager and lazy) through ``call_balanced`` with a 384-thread launch (.reqntid 384,
.minnctapersm 1, 168 registers at launch, no stack frame), one setmaxnreg.inc (216) of the math warpgroups and one
setmaxnreg.dec (72) of the producer after the setup's only CTA barrier, 8 mbarriers of count 128 initialised once, one
copy of the one-item kernel's body (88 WGMMAs; 4 full waits in the math code, 4 empty waits in the producer; 4 full
arrives, 4 empty arrives; the math warpgroups' BAR_MATH twice per item: Q landed, epilogue), every fp8 conversion and
every 128-bit KV ld.global in the producer's code, two item loops (one per side).  ptxas (C7518, spills) is
test_wgmma_serialization.py's fp8p_balanced kinds; the protocol is test_seesaw_fp8p_balanced_protocol.py; the
GPU run is test_seesaw_fp8p_balanced_gpu.py."""

from __future__ import annotations

import os
import re

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

cutlass = pytest.importorskip("cutlass")

from test_wgmma_compile import _nv_info_attrs  # noqa: E402  (same directory: pytest rootdir import)


def _dump(q: str, tmp_path, lazy: bool = False):
    import cutlass.cute as cute

    from mla_cute_dsl.kernels import api
    from mla_cute_dsl.kernels.sm90_wgmma_decode import MLADecodePartialWGMMASeesaw

    k = MLADecodePartialWGMMASeesaw(api._cutlass_dtype(q), cutlass.Float8E4M3FN, l2_prefetch=True, balanced=True,
                                    lazy_rescale=lazy, fp8_producer=True)
    cute.compile(k.call_balanced, *api._fake_args_partial_balanced(q, "fp8_e4m3"),
                 options=api.COMPILE_OPTIONS + f" --keep-ptx --keep-cubin --dump-dir={tmp_path}")
    ptx = "".join(p.read_text() for p in tmp_path.glob("*.ptx"))
    attrs = _nv_info_attrs(b"".join(p.read_bytes() for p in tmp_path.glob("*.cubin")))
    regs = max(v for a, v in attrs if a == 0x2F)  # EIATTR_REGCOUNT
    frame = max((v for a, v in attrs if a == 0x11), default=0)  # EIATTR_FRAME_SIZE
    return ptx, regs, frame


@pytest.mark.parametrize("q,lazy", [("bf16", True), ("fp16", False)])
def test_fp8p_balanced_kernel_ptx(q, lazy, tmp_path):
    from mla_cute_dsl.kernels import sm90_wgmma_decode as W

    ptx, regs, frame = _dump(q, tmp_path, lazy)
    flat = re.sub(r"\s+", " ", ptx)
    assert ".reqntid 384, 1, 1" in flat and ".minnctapersm 1" in flat
    assert regs == W.FP8P_REGS_AT_LAUNCH and frame == 0
    assert re.findall(r"setmaxnreg\.inc\.sync\.aligned\.u32 (\d+);", flat) == [str(W.FP8P_MATH_REGS)]
    assert re.findall(r"setmaxnreg\.dec\.sync\.aligned\.u32 (\d+);", flat) == [str(W.FP8P_PRODUCER_REGS)]
    assert flat.find("setmaxnreg") > flat.find("bar.sync 0;")
    assert len(re.findall(r"wgmma\.mma_async", flat)) == 88
    inits = re.findall(r"mov\.b32 (%r\d+), (\d+); (?:mbarrier\.init\.shared\.b64 \[[^\]]*\], (%r\d+); ){8}", flat)
    assert flat.count("mbarrier.init.shared.b64") == 8 and len(inits) == 1 and inits[0][1] == "128"
    assert flat.count("mbarrier.try_wait.parity.shared.b64") == 8
    assert flat.count("mbarrier.arrive.shared.b64") == 8
    assert flat.count("bar.sync 0;") == 1 and flat.count("bar.sync 5, 256;") == 2
    for bar in (1, 2):
        assert flat.count(f"bar.arrive {bar}, 256;") == 1 and flat.count(f"bar.sync {bar}, 256;") == 1
    dec = flat.find("setmaxnreg.dec")
    cvt = [m.start() for m in re.finditer(r"cvt\.rn\.f16x2\.e4m3x2", flat)]
    assert len(cvt) == 2 * 18 * 4 * 4 and min(cvt) > dec and flat.find("wgmma.mma_async") < dec
    prod = flat[dec:]
    assert len(re.findall(r"ld\.global\.v4\.b32", prod)) == 36 and not re.findall(r"ld\.global\.v2\.b32", prod)
    # the producer's empty waits and full arrives, the math side's full waits and empty arrives
    assert prod.count("mbarrier.try_wait.parity.shared.b64") == 4 and prod.count("mbarrier.arrive.shared.b64") == 4
    assert set(re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+);", flat)) == {"0"}
    assert "cp.async.bulk.prefetch.L2" in prod
