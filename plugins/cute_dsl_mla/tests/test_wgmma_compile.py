"""CPU tests (no GPU) of the WGMMA partial kernel prototype (sm90_wgmma_decode).

Level 1: smem layouts and WGMMA tiled MMAs are built, and the two facts the
         design rests on hold (V^T view = K tile bytes; S's C fragment lists a
         thread's values in the RS A-fragment order).
Level 2+3: the whole kernel (mainloop + epilogue writing partial O / lse)
         compiles for sm_90a with fake tensors, through the kernel cache.
Nothing here runs the kernel: tests/test_wgmma_gpu.py does, on an SM90 GPU.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")


def _has_cutlass():
    try:
        import cutlass  # noqa: F401
    except Exception:
        return False
    return True


pytestmark = pytest.mark.skipif(not _has_cutlass(), reason="nvidia-cutlass-dsl not installed")


def _kernel(q="bf16"):
    import cutlass

    from mla_cute_dsl.kernels.sm90_wgmma_decode import MLADecodePartialWGMMA

    dt = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16}[q]
    return MLADecodePartialWGMMA(dt, dt)


def test_level1_layouts_and_tiled_mmas():
    """Layouts + tiled MMAs trace; the V view and the P re-typing are exact."""
    import cutlass
    import cutlass.cute as cute

    from mla_cute_dsl.kernels import sm90_wgmma_decode as W

    k = _kernel()
    facts = {}

    @cute.jit
    def probe():
        sQ, sK, sP, sV = k._smem_layouts()
        mma_s, mma_rs, mma_ss = k._tiled_mmas()
        facts["cosize"] = (cute.cosize(sQ), cute.cosize(sK), cute.cosize(sP))
        # every (token, dim < 512, stage) of the K tile has the same offset as
        # (dim, token, stage) of the V^T view (both share the same swizzle)
        facts["v_is_k"] = all(
            sK.outer((t, d, st)) == sV.outer((d, t, st))
            for d in range(0, W.D_V, 5) for t in range(W.BLOCK_N) for st in range(W.STAGES)
        )
        cS = cute.make_identity_tensor((W.BLOCK_M, W.BLOCK_N))
        cO = cute.make_identity_tensor((W.BLOCK_M, W.D_V_HALF))
        same_order, rows_ok, ss_eq_rs = True, True, True
        for tid in cutlass.range_constexpr(0, W.WG_THREADS, 3):  # static thread ids
            tc = mma_s.get_slice(tid).partition_C(cS)
            ta = mma_rs.get_slice(tid).partition_A(cS)
            same_order &= all(ta[i] == tc[i] for i in range(cute.size(tc)))
            mn = W._acc_mn_view(tc)
            # 2 rows per thread: r and r + 8 of its warp's 16, one quad per row
            r0 = (tid // 32) * 16 + (tid % 32) // 4
            rows_ok &= [mn[r, 0][0] for r in range(2)] == [r0, r0 + 8]
            rows_ok &= all(mn[r, c][0] == mn[r, 0][0] for r in range(2) for c in range(16))
            oc_rs = mma_rs.get_slice(tid).partition_C(cO)
            oc_ss = mma_ss.get_slice(tid).partition_C(cO)
            ss_eq_rs &= all(oc_rs[i] == oc_ss[i] for i in range(cute.size(oc_rs)))
        facts["same_order"], facts["rows_ok"], facts["ss_eq_rs"] = same_order, rows_ok, ss_eq_rs

    cute.compile(probe)
    assert facts["cosize"] == (64 * 576, 2 * 64 * 576, 64 * 64)
    assert facts["v_is_k"] is True
    assert facts["same_order"] is True
    assert facts["rows_ok"] is True
    assert facts["ss_eq_rs"] is True


def test_smem_budget():
    from mla_cute_dsl.kernels import sm90_wgmma_decode as W

    for q in ("bf16", "fp16"):
        n = _kernel(q).smem_bytes()
        assert n == 73728 + 147456 + 8192 + 256
        assert n <= W.SMEM_LIMIT


def test_unsupported_specializations_are_refused():
    import cutlass

    from mla_cute_dsl.kernels.sm90_wgmma_decode import MLADecodePartialWGMMA

    with pytest.raises(NotImplementedError):
        MLADecodePartialWGMMA(cutlass.BFloat16, cutlass.Float8E4M3FN)
    with pytest.raises(ValueError):
        MLADecodePartialWGMMA(cutlass.BFloat16, cutlass.BFloat16, 32)


@pytest.mark.parametrize("q", ["bf16", "fp16"])
def test_level3_full_kernel_compiles(q):
    """Mainloop (SS QK, softmax, RS / SS PV, cp.async double buffer) and the
    epilogue (partial O / lse and direct out / lse) compile for sm_90a."""
    from mla_cute_dsl.kernels import api
    from mla_cute_dsl.kernels.sm90_wgmma_decode import get_partial_kernel_wgmma

    fn = get_partial_kernel_wgmma(q)
    assert fn is not None
    assert get_partial_kernel_wgmma(q) is fn  # in-process cache hit
    # the default path is untouched: api still builds the mma.sync kernel
    assert api.get_partial_kernel(q, q, 64) is not fn
