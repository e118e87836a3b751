"""CPU tests (no GPU) of the balanced seesaw's ``q_prefetch`` option (``MLADecodePartialWGMMASeesaw(balanced=True,
q_prefetch=True)``, branch q-prefetch, compile-only): the next work item's Q (a TMA load on a fifth mbarrier) and KV
tiles 0 / 1 issued during the current item's last pairs (``seesaw_column_qpf``; the protocol is modelled in
test_seesaw_qpf_protocol.py, the GPU run is test_seesaw_qpf_gpu.py).

1. q_prefetch=False leaves every kernel as it was: the balanced seesaw's PTX of the backend's default arms (lazy
   rescale, 16-bit partials, wide stores; TMA and cp.async) and of the fp32 arms is pinned below from main e323790
   (before the option), on top of the existing pins (test_seesaw_balanced_compile.py, test_seesaw_tma_compile.py).
2. q_prefetch=True compiles for bf16 / fp16 q, TMA / cp.async KV loads, eager / lazy rescale: no local memory, no
   spills, no WGMMA serialized by ptxas (warning C7518, standalone ptxas as in test_wgmma_serialization.py), and its
   PTX is the balanced kernel's plus exactly the instructions the design adds (per kernel: the Q loads become nine TMA
   boxes twice, prologue and prefetch; six more KV parts, the next item's tiles 0 / 1 from both warpgroups' slots; one
   mbarrier more, its init and wait; no cp.async commit group or group wait left; the same 88 WGMMAs and barriers).
3. Refusals (fp8 cache, the one-item kernel), the cache key flag "qpf", the builder and the host entry.
"""

from __future__ import annotations

import os
import re

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from test_kernel_compile import _has_cutlass  # noqa: E402  (same directory)

needs_cutlass = pytest.mark.skipif(not _has_cutlass(), reason="nvidia-cutlass-dsl not installed")

# ptx_sha256 (test_balanced_compile.ptx_sha256) of the balanced seesaw on main e323790, before q_prefetch existed
# (nvidia-cutlass-dsl 4.8.1, sm_90a): (q, partial dtype, wide stores, tma, lazy_rescale)
MAIN_BALANCED_PTX_SHA256 = {
    ("bf16", "bf16", True, True, True): "d70e4c6bc1293a430a2cc40c29f4237fb06fb0874a66f128c67104bcd21a57b5",
    ("bf16", "fp32", False, True, False): "04765dfdad3faa2d154e3eaae596aaa226bdd1a758ca3b1f84e425fab0279d60",
    ("bf16", "fp32", False, False, False): "858b85e0aeeade4b6f6bdc86e4153b0dd610f4357d77cd3681319b7f57b2a566",
    ("fp16", "fp32", False, False, True): "222f5bdff29e04b959dd8c1c391158d0f92972f31eb40781c9a6c58bb9c45902",
}

# ptx_sha256 of the q_prefetch kernel as written on branch q-prefetch (compile-only, NOT GPU-verified when pinned): (q,
# partial dtype, wide stores, tma, lazy_rescale). A change to the kernel's code (a merge included) shows here: rerun
# test_seesaw_qpf_gpu.py (benchmarks/device/seesaw_qpf_gpu.sh) before moving the pin
QPF_PTX_SHA256 = {
    ("bf16", "bf16", True, True, True): "a675ef687c209166598794e0699fa3150b49547c4697168a6c788f7d015b446e",
    ("bf16", "fp32", False, False, False): "52f93e792cc9120959ced50fcf0ecd292bb3ab1dd98df8d30f90eddeb225e232",
}

_COUNTED = ("wgmma.mma_async.sync.aligned.m64n64k16", "wgmma.mma_async.sync.aligned.m64n256k16",
            "cp.async.cg.shared.global", "cp.async.bulk.tensor", "mbarrier.arrive.expect_tx",
            "cp.async.mbarrier.arrive", "mbarrier.init.shared.b64", "mbarrier.try_wait", "bar.sync", "bar.arrive", "fence.proxy.async.shared::cta",
            "griddepcontrol.launch_dependents", "prefetch.tensormap", "cp.async.wait_group", "cp.async.commit_group",
            "elect.sync", "wgmma.wait_group")

# q_prefetch's PTX less the balanced kernel's, per counted instruction (tma, cp.async): Q: 18 cp.async (one commit
# group, waited) -> 2 x 9 TMA boxes after an expect_tx each (prologue, prefetch) on mbarrier 4 (init, one wait);
# next item's tiles 0 / 1: WG0 4 + 5 + 5 blocks and WG1 5 + 4 + 4 (tile 0 at the a+2 slot, tile 1 there after a
# 1-tile item, tile 1 at the b+2 slot), one arm (TMA) or one noinc arrive + zero-fill fence (cp.async) per part;
# the prologue's fence after the Q group wait goes; the KV descriptor prefetch gains the Q one
QPF_DELTA = {
    True: {"cp.async.cg.shared.global": -18, "cp.async.bulk.tensor": 18 + 27, "mbarrier.arrive.expect_tx": 2 + 6,
           "mbarrier.init.shared.b64": 1, "mbarrier.try_wait": 1, "fence.proxy.async.shared::cta": -1,
           "prefetch.tensormap": 1, "cp.async.wait_group": -2, "cp.async.commit_group": -2, "elect.sync": 20 + 33},
    False: {"cp.async.cg.shared.global": -18 + 108, "cp.async.bulk.tensor": 18, "mbarrier.arrive.expect_tx": 2,
            "cp.async.mbarrier.arrive": 6, "mbarrier.init.shared.b64": 1, "mbarrier.try_wait": 1,
            "fence.proxy.async.shared::cta": -1 + 6, "prefetch.tensormap": 1, "cp.async.wait_group": -2,
            "cp.async.commit_group": -2, "elect.sync": 20},
}


def _kernel(q, tma, lazy=False, wide=False, q_prefetch=False):
    from mla_cute_dsl.kernels import api
    from mla_cute_dsl.kernels.sm90_wgmma_decode import MLADecodePartialWGMMASeesaw

    return MLADecodePartialWGMMASeesaw(api._cutlass_dtype(q), api._cutlass_dtype(q), tma=tma, balanced=True,
                                       lazy_rescale=lazy, wide_store=wide, q_prefetch=q_prefetch)


@needs_cutlass
@pytest.mark.parametrize("spec", sorted(MAIN_BALANCED_PTX_SHA256))
def test_without_the_option_the_balanced_ptx_is_mains(spec, tmp_path):
    from test_balanced_compile import _dump, ptx_sha256

    from mla_cute_dsl.kernels import api

    q, partial, wide, tma, lazy = spec
    ptx, _, _ = _dump(_kernel(q, tma, lazy, wide).call_balanced, api._fake_args_partial_balanced(q, q, partial),
                      tmp_path)
    assert ptx_sha256(ptx) == MAIN_BALANCED_PTX_SHA256[spec]


@needs_cutlass
@pytest.mark.parametrize("spec", sorted(QPF_PTX_SHA256))
def test_q_prefetch_ptx_is_the_pinned_one(spec, tmp_path):
    from test_balanced_compile import _dump, ptx_sha256

    from mla_cute_dsl.kernels import api

    q, partial, wide, tma, lazy = spec
    ptx, _, _ = _dump(_kernel(q, tma, lazy, wide, True).call_balanced, api._fake_args_partial_balanced(q, q, partial),
                      tmp_path)
    assert ptx_sha256(ptx) == QPF_PTX_SHA256[spec]


@needs_cutlass
@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
@pytest.mark.parametrize("tma", [False, True], ids=["cp_async", "tma"])
@pytest.mark.parametrize("q", ["bf16", "fp16"])
def test_q_prefetch_compiles_without_spills_or_serialized_wgmmas(q, tma, lazy, tmp_path):
    """The backend's partial arm (16-bit partials in q's dtype, wide stores) with the option: registers <= 255, no
    stack frame or local memory, the balanced kernel's instruction mix plus QPF_DELTA, and (when a standalone ptxas
    is found) no C7518 and no spill."""
    from test_balanced_compile import _dump
    from test_wgmma_serialization import _assemble, _ptxas

    from mla_cute_dsl.kernels import api

    (tmp_path / "qpf").mkdir()
    (tmp_path / "base").mkdir()
    args = api._fake_args_partial_balanced(q, q, q)
    ptx, regs, frame = _dump(_kernel(q, tma, lazy, True, True).call_balanced, args, tmp_path / "qpf")
    base, base_regs, _ = _dump(_kernel(q, tma, lazy, True).call_balanced, args, tmp_path / "base")
    print(f"q_prefetch {q} tma={tma} lazy={lazy}: {regs} registers (without: {base_regs}), stack frame {frame} B")
    assert regs <= 255 and frame == 0
    assert "ld.local" not in ptx and "st.local" not in ptx
    delta = {p: ptx.count(p) - base.count(p) for p in _COUNTED}
    assert delta == {p: QPF_DELTA[tma].get(p, 0) for p in _COUNTED}, delta
    assert ptx.count("wgmma.mma_async") == 88 and "cp.async.wait_group" not in ptx
    assert ptx.count("mbarrier.arrive.expect_tx") - base.count("mbarrier.arrive.expect_tx") >= 2
    assert len(re.findall(r"mov\.b32\s+%r\d+, 73728;", ptx)) >= 1  # Q's 9 boxes x 8 KB on its mbarrier
    ptxas = _ptxas()
    if ptxas is None:
        pytest.skip("no ptxas ($PTXAS, PATH, /usr/local/cuda*/bin): the PTX checks above passed")
    path = tmp_path / "k.ptx"
    path.write_text(ptx)
    run = _assemble(ptxas, path, tmp_path)
    older = re.search(r"Unsupported \.version [\d.]+; current version is '([\d.]+)'", run.stderr)
    if run.returncode != 0 and older:  # as test_wgmma_serialization.py: state the PTX ISA this ptxas takes
        path.write_text(re.sub(r"^\.version [\d.]+", f".version {older.group(1)}", ptx, count=1, flags=re.M))
        run = _assemble(ptxas, path, tmp_path)
    assert run.returncode == 0, run.stderr
    log = run.stdout + run.stderr
    assert "C7518" not in log and "serialized" not in log, log
    used = re.search(r"Used (\d+) registers", log)
    assert used and int(used.group(1)) <= 255, log
    assert re.search(r"0 bytes spill stores, 0 bytes spill loads", log), log


@needs_cutlass
def test_q_prefetch_refusals_key_builder_and_entry(monkeypatch):
    """An fp8 cache and the one-item kernel are refused (kernel object, getter: nothing compiled); the key gains
    "qpf" last and only when set; the builder makes the kernel from the flag; the host entry asks for it with
    q_prefetch=True only when asked (the default call's keywords are unchanged)."""
    import cutlass
    import torch

    from mla_cute_dsl.kernels import alloc_workspace, api, kernel_cache, make_schedule
    from mla_cute_dsl.kernels import sm90_wgmma_decode as W

    K = W.MLADecodePartialWGMMASeesaw
    with pytest.raises(ValueError, match="q_prefetch=True needs balanced=True"):
        K(cutlass.BFloat16, cutlass.BFloat16, q_prefetch=True)
    with pytest.raises(ValueError, match="q_prefetch=True needs balanced=True"):
        K(cutlass.BFloat16, cutlass.Float8E4M3FN, balanced=True, q_prefetch=True)
    k = K(cutlass.BFloat16, cutlass.BFloat16, balanced=True, tma=True, q_prefetch=True)
    assert k.q_prefetch and k._num_mbars() == 5 and k.smem_bytes() == K(cutlass.BFloat16, cutlass.BFloat16,
                                                                            balanced=True).smem_bytes() + 8
    assert k.smem_bytes() <= W.SMEM_LIMIT and not K(cutlass.BFloat16, cutlass.BFloat16, balanced=True).q_prefetch

    built = []
    monkeypatch.setattr(kernel_cache, "get_or_build", lambda kind, spec, build: built.append((kind, spec, build)))
    with pytest.raises(ValueError, match="q_prefetch=True needs a 16-bit KV cache"):
        W.get_partial_kernel_wgmma_seesaw_balanced("bf16", "fp8_e4m3", q_prefetch=True)
    assert built == []
    W.get_partial_kernel_wgmma_seesaw_balanced("bf16", partial="bf16", wide_store=True, tma=True, lazy_rescale=True,
                                               q_prefetch=True)
    W.get_partial_kernel_wgmma_seesaw_balanced("fp16", q_prefetch=True)
    W.get_partial_kernel_wgmma_seesaw_balanced("bf16", partial="bf16", wide_store=True, tma=True, lazy_rescale=True)
    assert [(kind, s) for kind, s, _ in built] == [
        ("partial_wgmma_seesaw_balanced", ("bf16", "bf16", 64, "partial_bf16", "wide_store", "tma", "lazy", "qpf")),
        ("partial_wgmma_seesaw_balanced", ("fp16", "fp16", 64, "qpf")),
        ("partial_wgmma_seesaw_balanced", ("bf16", "bf16", 64, "partial_bf16", "wide_store", "tma", "lazy"))]
    assert "qpf" in W.SEESAW_FLAGS

    import cutlass.cute as cute

    compiled = []
    monkeypatch.setattr(cute, "compile", lambda fn, *a, **kw: compiled.append((fn, len(a))))
    W._build_partial_wgmma_seesaw_balanced("bf16", "bf16", 64, "partial_bf16", "wide_store", "tma", "lazy", "qpf")
    W._build_partial_wgmma_seesaw_balanced("bf16", "bf16", 64, "tma")
    (fn, n_args), (fn0, _) = compiled
    assert fn.__name__ == "call_balanced" and fn.__self__.q_prefetch and fn.__self__.tma and fn.__self__.lazy_rescale
    assert not fn0.__self__.q_prefetch
    assert n_args == len(api._fake_args_partial_balanced("bf16", "bf16"))
    with pytest.raises(ValueError, match="q_prefetch=True needs balanced=True"):  # an even key with the flag
        W._build_partial_wgmma_seesaw("bf16", "bf16", 64, "qpf")

    B, s_q, H = 3, 1, 128
    q = torch.zeros(B, s_q, H, 576, dtype=torch.bfloat16)
    kv = torch.zeros(8, 64, 576, dtype=torch.bfloat16)
    pt = torch.zeros(B, 4, dtype=torch.int32)
    lens = torch.tensor([100, 0, 64], dtype=torch.int32)
    out = torch.zeros(B, s_q, H, 512, dtype=torch.bfloat16)
    lse = torch.zeros(B, s_q, H)
    asked, launched = [], []
    monkeypatch.setattr(W, "get_partial_kernel_wgmma_seesaw_balanced",
                        lambda q_name, kv_name, **kw: asked.append(kw) or "kernel")
    monkeypatch.setattr(api, "launch_balanced", lambda partial, *a: launched.append(partial))
    bal = make_schedule([100, 0, 64], s_q, H, 132, device="cpu", balanced=True)
    ws = alloc_workspace(bal, device="cpu", partial_dtype=torch.float32)
    W.mla_decode_sm90_wgmma_seesaw_balanced(q, kv, pt, lens, 0.1, 1.0, out, lse, bal, ws, tma=True, q_prefetch=True)
    W.mla_decode_sm90_wgmma_seesaw_balanced(q, kv, pt, lens, 0.1, 1.0, out, lse, bal, ws, tma=True)
    assert asked == [dict(l2_prefetch=None, partial="fp32", wide_store=False, tma=True, lazy_rescale=False,
                          q_prefetch=True),
                     dict(l2_prefetch=None, partial="fp32", wide_store=False, tma=True, lazy_rescale=False)]
    assert launched == ["kernel", "kernel"]
