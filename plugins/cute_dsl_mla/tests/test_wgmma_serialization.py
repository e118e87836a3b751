"""CPU test: ptxas does not serialize the WGMMA kernels' WGMMAs (warning C7518).

Why: every fp8 seesaw kernel up to mla-cute-dsl 0.2.15 was built with its 88 WGMMAs serialized (one
WARPGROUP.DEPBAR after each HGMMA) by the toolchain that builds the H200's kernels, while the toolchain of the
CPU venv built the same PTX without: the compile tests passed and the kernel ran its WGMMAs one at a time
(ptxas: "wgmma.mma_async instructions are serialized due to program dependence on compiler-inserted WG.DP in
divergent path": warpgroup 1 issued P_b V_R in one branch and waited for it in another, with the conversion of
the next tile in a third branch between them). A standalone ptxas (CUDA 12.8 and 13.0 both) reports it from
the PTX, so this test compiles each kernel's PTX with the DSL and assembles it with the first ptxas found
($PTXAS, PATH, /usr/local/cuda*/bin); skipped when there is none. benchmarks/device/sass_check.py checks the
device toolchain's own cubins (prebuild_kcache.sh runs it). The opt-in fp8 seesaw with a producer warpgroup
(fp8_producer=True, branch fp8-producer; bf16 and fp16 q, eager and lazy) is checked the same way, plus its
register count at launch (168 for 384 threads; the math warpgroups' 216 come from setmaxnreg, and ptxas reports
spills in those regions too). The producer kernel on the balanced schedule (fp8p_balanced*, branch
fp8-balanced-producer) likewise, and both with the producer's register ring (*_ring<R>*, branch fp8p-inflight:
its split, e.g. 208 math / 88 producer, leaves the math warpgroups fewer registers).
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from test_kernel_compile import _has_cutlass  # noqa: E402  (same directory: pytest rootdir import)

pytestmark = pytest.mark.skipif(not _has_cutlass(), reason="nvidia-cutlass-dsl not installed")


def _ptxas():
    for cand in (os.environ.get("PTXAS"), shutil.which("ptxas"), *sorted(glob.glob("/usr/local/cuda*/bin/ptxas"))):
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return None


def _ptx(kernel, fake_args, tmp_path):
    import cutlass.cute as cute

    from mla_cute_dsl.kernels import api

    cute.compile(kernel, *fake_args, options=api.COMPILE_OPTIONS + f" --keep-ptx --dump-dir={tmp_path}")
    paths = list(tmp_path.glob("*.ptx"))
    assert len(paths) == 1, paths
    return paths[0]


def _assemble(ptxas, ptx, tmp_path):
    """ptxas -v on ptx; when this ptxas is older than the DSL's PTX ISA (the CPU venv's DSL writes 9.4, CUDA 13.0's
    ptxas takes 9.0, the device's DSL writes 8.8), the file is rewritten to state the version ptxas takes (the kernels
    use nothing newer than 8.x) and assembled again. Every ptxas test here and in the seesaw compile tests goes
    through it."""
    def run():
        return subprocess.run([ptxas, "-arch=sm_90a", "-v", "-O3", str(ptx), "-o", str(tmp_path / "k.cubin")],
                              capture_output=True, text=True)

    result = run()
    older = re.search(r"Unsupported \.version [\d.]+; current version is '([\d.]+)'", result.stderr)
    if result.returncode != 0 and older:
        ptx.write_text(re.sub(r"^\.version [\d.]+", f".version {older.group(1)}", ptx.read_text(), count=1,
                              flags=re.M))
        result = run()
    return result


def _seesaw(kind: str):
    """(kernel entry, fake arguments) of one seesaw specialization."""
    import cutlass

    from mla_cute_dsl.kernels import api
    from mla_cute_dsl.kernels.sm90_wgmma_decode import MLADecodePartialWGMMASeesaw

    lazy = kind.endswith("_lazy")
    ring = re.search(r"_ring(\d+)(?:s(\d+))?", kind)  # the producer's register ring (fp8p_ring, branch fp8p-inflight)
    ring = ({"fp8p_ring": int(ring.group(1))} | ({"fp8p_stage": int(ring.group(2))} if ring.group(2) else {})
            if ring else {})
    if kind.startswith("fp8p_balanced"):  # producer warpgroup on the balanced schedule (branch fp8-balanced-producer)
        q = "fp16" if "_fp16" in kind else "bf16"
        wide = "_wide" in kind  # the backend's default arm: 16-bit partials in q's dtype, wide stores
        k = MLADecodePartialWGMMASeesaw(api._cutlass_dtype(q), cutlass.Float8E4M3FN, l2_prefetch=True, balanced=True,
                                        lazy_rescale=lazy, fp8_producer=True, wide_store=wide, **ring)
        return k.call_balanced, api._fake_args_partial_balanced(q, "fp8_e4m3", q if wide else "fp32")
    if kind.startswith("fp8_balanced"):  # the balanced fp8 seesaw (branch fp8-balanced, backend.FP8_SEESAW_BALANCED)
        k = MLADecodePartialWGMMASeesaw(cutlass.BFloat16, cutlass.Float8E4M3FN, l2_prefetch=True, balanced=True,
                                        lazy_rescale=lazy)
        return k.call_balanced, api._fake_args_partial_balanced("bf16", "fp8_e4m3")
    if kind.startswith("fp8p"):  # the opt-in fp8 seesaw with a producer warpgroup (fp8_producer=True, 384 threads)
        q = "fp16" if "_fp16" in kind else "bf16"
        k = MLADecodePartialWGMMASeesaw(api._cutlass_dtype(q), cutlass.Float8E4M3FN, l2_prefetch=True,
                                        lazy_rescale=lazy, fp8_producer=True, **ring)
        return k, api._fake_args_partial(q, "fp8_e4m3")
    if kind.startswith("fp8"):  # the even fp8 seesaw (the backend's kernel for an fp8 cache at 64+ rows)
        k = MLADecodePartialWGMMASeesaw(cutlass.BFloat16, cutlass.Float8E4M3FN, l2_prefetch=True,
                                        lazy_rescale=lazy)
        return k, api._fake_args_partial("bf16", "fp8_e4m3")
    # the balanced TMA seesaw (the backend's kernel for a 16-bit cache at 64+ rows)
    k = MLADecodePartialWGMMASeesaw(cutlass.BFloat16, cutlass.BFloat16, tma=True, balanced=True, lazy_rescale=lazy)
    return k.call_balanced, api._fake_args_partial_balanced("bf16", "bf16")


@pytest.mark.parametrize("kind", ["fp8", "fp8_lazy", "bf16_balanced_tma", "bf16_balanced_tma_lazy", "fp8p", "fp8p_lazy",
                                  "fp8p_fp16", "fp8p_fp16_lazy", "fp8_balanced", "fp8_balanced_lazy",
                                  "fp8p_balanced", "fp8p_balanced_lazy", "fp8p_balanced_fp16_lazy",
                                  "fp8p_balanced_wide_lazy",
                                  # the producer's register ring (fp8p_ring; the full matrix of ring sizes and
                                  # kernels: test_seesaw_fp8p_ring_compile.py)
                                  "fp8p_ring7_lazy", "fp8p_ring5_fp16", "fp8p_balanced_ring7_wide_lazy",
                                  "fp8p_balanced_ring5_lazy", "fp8p_ring7s4_lazy", "fp8p_balanced_ring7s4_fp16_lazy"])
def test_ptxas_keeps_the_seesaw_wgmmas_asynchronous(kind, tmp_path):
    ptxas = _ptxas()
    if ptxas is None:
        pytest.skip("no ptxas ($PTXAS, PATH, /usr/local/cuda*/bin)")
    ptx = _ptx(*_seesaw(kind), tmp_path)
    text = ptx.read_text()
    assert len(re.findall(r"wgmma\.mma_async", text)) == 88
    run = _assemble(ptxas, ptx, tmp_path)
    assert run.returncode == 0, run.stderr
    log = run.stdout + run.stderr
    assert "C7518" not in log and "serialized" not in log, log
    used = re.search(r"Used (\d+) registers", log)
    assert used and int(used.group(1)) <= 255
    if kind.startswith("fp8p"):  # 384 threads: 168 at launch, the rest through setmaxnreg (no spill below either)
        assert int(used.group(1)) <= 168, log
    assert re.search(r"0 bytes spill stores, 0 bytes spill loads", log), log
