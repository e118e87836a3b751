"""CPU tests (no GPU) of the seesaw's ``wg1_other_first`` option (``MLADecodePartialWGMMASeesaw(wg1_other_first=True)``,
branch qk-order, compile-only): warpgroup 1's QK of its own tile b waits on warpgroup 0's part (mbar + 2: columns
0..255 and the RoPE block) first and issues those 20 k-blocks, then waits on its own part (mbar + 3) and issues the
other 16 (``qk_wait_order``); 16-bit caches only (cp.async or TMA, one item per CTA or balanced, with or without
q_prefetch).  The protocol with that order is modelled in test_seesaw_protocol.py (``wg1of``), and for the balanced
and q_prefetch columns in test_seesaw_balanced_protocol.py / test_seesaw_qpf_protocol.py; the GPU run is
test_seesaw_wg1of_gpu.py.

1. Option off: the PTX is main's (d2f6a2d), pinned here for the three kernels below (the balanced ones are also pinned
   by test_seesaw_qpf_compile.py / test_seesaw_balanced_compile.py).
2. Option on: compiles for the bf16 balanced TMA lazy kernel with and without q_prefetch (the backend's arm at H=128:
   16-bit partials, wide stores) and the even cp.async kernel (fp32 partials); the same instructions as without the
   option, opcode for opcode (only the order of WG1's two QK halves and the first mbarrier it waits change), 88
   WGMMAs, no local memory, no stack frame; and (when a standalone ptxas is found) no C7518 serialization and no spill.
3. The cache key flag "wg1of" (last, only when set), refusals with an fp8 cache (kernel object and getters, before any
   compile), the builders and the host entries (the option's keyword passed only when set).
"""

from __future__ import annotations

import collections
import os
import re

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from test_kernel_compile import _has_cutlass  # noqa: E402  (same directory)

needs_cutlass = pytest.mark.skipif(not _has_cutlass(), reason="nvidia-cutlass-dsl not installed")

# ptx_sha256 (test_balanced_compile.ptx_sha256) on main d2f6a2d, before the option existed (nvidia-cutlass-dsl 4.8.1,
# sm_90a); the option off must give the same PTX. Spec: (kind, partial dtype, wide stores, tma, lazy, q_prefetch)
MAIN_PTX_SHA256 = {
    ("balanced", "bf16", True, True, True, True): "a675ef687c209166598794e0699fa3150b49547c4697168a6c788f7d015b446e",
    ("balanced", "bf16", True, True, True, False): "d70e4c6bc1293a430a2cc40c29f4237fb06fb0874a66f128c67104bcd21a57b5",
    ("even", "fp32", False, False, False, False): "09d853d21a60d6e252f0993af0fbf442800ee3c5adf9ccb269a2284b548da301",
}

# ptx_sha256 with wg1_other_first=True as written on branch qk-order (compile-only, NOT GPU-verified when pinned): a
# change to the kernel's code shows here; rerun test_seesaw_wg1of_gpu.py before moving a pin
WG1OF_PTX_SHA256 = {
    ("balanced", "bf16", True, True, True, True): "1db5ca7cd89eb904cd6534f4f813bca665cdad6904c426ba4cf4dab188a2eaac",
    ("balanced", "bf16", True, True, True, False): "81c72d538b2c0fb1c072e9e3ab91c7e3ae15abd7e239ff2544bd2d110d6fb49d",
    ("even", "fp32", False, False, False, False): "3e9b8db6e4e068d5fc48f728b188103309edd711d3ff34d872ef2f07b124ce53",
}


def _kernel(spec, wg1of):
    from mla_cute_dsl.kernels import api
    from mla_cute_dsl.kernels.sm90_wgmma_decode import MLADecodePartialWGMMASeesaw

    kind, partial, wide, tma, lazy, qpf = spec
    bf = api._cutlass_dtype("bf16")
    extra = {"wg1_other_first": True} if wg1of else {}
    if kind == "balanced":
        k = MLADecodePartialWGMMASeesaw(bf, bf, tma=tma, balanced=True, lazy_rescale=lazy, wide_store=wide,
                                        q_prefetch=qpf, **extra)
        return k.call_balanced, api._fake_args_partial_balanced("bf16", "bf16", partial)
    k = MLADecodePartialWGMMASeesaw(bf, bf, tma=tma, lazy_rescale=lazy, wide_store=wide, **extra)
    return k, api._fake_args_partial("bf16", "bf16", partial)


def _opcodes(ptx: str) -> collections.Counter:
    c = collections.Counter()
    for line in ptx.splitlines():
        line = line.split("//")[0].strip()
        if not line or line.startswith(".") or line.endswith(":") or line in ("{", "}"):
            continue
        m = re.match(r"(?:@!?%\w+\s+)?([a-z_][\w.:]*)", line)
        if m:
            c[m.group(1)] += 1
    return c


@needs_cutlass
@pytest.mark.parametrize("spec", sorted(MAIN_PTX_SHA256), ids=lambda s: "_".join(map(str, s)))
def test_wg1of_compiles_and_the_option_off_is_mains(spec, tmp_path):
    from test_balanced_compile import _dump, ptx_sha256
    from test_wgmma_serialization import _assemble, _ptxas

    (tmp_path / "off").mkdir()
    (tmp_path / "on").mkdir()
    off, _, _ = _dump(*_kernel(spec, False), tmp_path / "off")
    assert ptx_sha256(off) == MAIN_PTX_SHA256[spec], "wg1_other_first=False changed the kernel"
    ptx, regs, frame = _dump(*_kernel(spec, True), tmp_path / "on")
    print(f"wg1of {spec}: {regs} registers, stack frame {frame} B, ptx_sha256 {ptx_sha256(ptx)}")
    assert ptx_sha256(ptx) == WG1OF_PTX_SHA256[spec]
    assert ptx != off
    assert regs <= 255 and frame == 0
    assert "ld.local" not in ptx and "st.local" not in ptx
    assert len(re.findall(r"wgmma\.mma_async", ptx)) == 88
    # the same instructions: only WG1's order of its two QK halves (and which mbarrier it waits first) moved
    assert _opcodes(ptx) == _opcodes(off)
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
def test_qk_wait_order_swaps_only_wg1s_own_tile():
    """qk_wait_order: stage 0 (WG0's tile) never changes; stage 1 (WG1's tile) takes WG0's part (mbar + 2, k-blocks
    0..15 and 32..35 = 64-column blocks 0..3 and 8, what WG0 loads of tile b) first only with the option; the k-blocks
    are the same 36 either way, and the blocks of each half are the protocol model's (test_seesaw_protocol.wg1_qk)."""
    import cutlass

    from test_seesaw_protocol import LOAD, wg1_qk

    from mla_cute_dsl.kernels import sm90_wgmma_decode as W

    bf = cutlass.BFloat16
    on = W.MLADecodePartialWGMMASeesaw(bf, bf, wg1_other_first=True)
    off = W.MLADecodePartialWGMMASeesaw(bf, bf)
    assert on.wg1_other_first and not off.wg1_other_first
    o0, o1 = W.SEESAW_QK_ORDER
    assert on.qk_wait_order(0, o0, "m0", "m1") == (o0, "m0", "m1") == off.qk_wait_order(0, o0, "m0", "m1")
    assert off.qk_wait_order(1, o1, "m3", "m2") == (o1, "m3", "m2")
    order, first, second = on.qk_wait_order(1, o1, "m3", "m2")
    assert (order, first, second) == (W.SEESAW_QK_ORDER_WG1_OTHER_FIRST, "m2", "m3")
    assert sorted(order[0] + order[1]) == list(range(36))
    assert {k // 4 for k in order[0]} == set(LOAD[0][1]) == set(W.SEESAW_LOAD_BLOCKS[0][1])
    assert {k // 4 for k in order[1]} == set(LOAD[1][0]) == set(W.SEESAW_LOAD_BLOCKS[1][0])
    model = [e for e in wg1_qk(0, 0, wg1of=True) if e[0] != "wait_reads"]
    assert model == [("mwait", 2, 0), ("read", 1, 1, tuple(sorted({k // 4 for k in order[0]})), "K"),
                     ("mwait", 3, 0), ("read", 1, 1, tuple(sorted({k // 4 for k in order[1]})), "K")]
    # the kernel's one 16-bit stage-1 QK passes (mbar + 3, mbar + 2): the swap gives mbar + 2 first
    src = W.__file__ and open(W.__file__).read()
    assert src.count("self.qk(mma_s_first, mma_s, acc_S, tSrQ, tSrK, 1, SEESAW_QK_ORDER[1],\n"
                     "                                mbar + 3, mbar + 2, par1)") == 2  # fp8 inline + 16-bit
    assert "order, mbar_first, mbar_second = self.qk_wait_order(stage, order, mbar_own, mbar_other)" in src


@needs_cutlass
def test_wg1of_key_refusals_builders_and_entries(monkeypatch):
    """The key gains "wg1of" last and only when set (every existing key unchanged); an fp8 cache is refused by the
    kernel object (inline and producer) and by both getters before any compile; the builders make the kernel from the
    flag; the host entries ask for it only when asked (the default call's keywords are unchanged)."""
    import cutlass
    import torch

    from mla_cute_dsl.kernels import alloc_workspace, api, kernel_cache, make_schedule
    from mla_cute_dsl.kernels import sm90_wgmma_decode as W

    K = W.MLADecodePartialWGMMASeesaw
    for kw in ({}, {"balanced": True}, {"fp8_producer": True}, {"balanced": True, "fp8_producer": True}):
        with pytest.raises(ValueError, match="wg1_other_first=True needs a 16-bit KV cache"):
            K(cutlass.BFloat16, cutlass.Float8E4M3FN, wg1_other_first=True, **kw)
    assert "wg1of" in W.SEESAW_FLAGS and W.SEESAW_FLAGS[-2:] == ("wg1of", "tmap")  # tmap: branch tma-producer
    assert W.seesaw_spec("bf16", "bf16") == ("bf16", "bf16", 64)
    assert W.seesaw_spec("bf16", "bf16", wg1_other_first=True) == ("bf16", "bf16", 64, "wg1of")
    assert W.seesaw_spec("bf16", "bf16", False, "bf16", True, True, lazy_rescale=True, q_prefetch=True,
                         wg1_other_first=True) == ("bf16", "bf16", 64, "partial_bf16", "wide_store", "tma", "lazy",
                                                   "qpf", "wg1of")

    built = []
    monkeypatch.setattr(kernel_cache, "get_or_build", lambda kind, spec, build: built.append((kind, spec, build)))
    with pytest.raises(ValueError, match="wg1_other_first=True needs a 16-bit KV cache"):
        W.get_partial_kernel_wgmma_seesaw_balanced("bf16", "fp8_e4m3", wg1_other_first=True)
    with pytest.raises(ValueError, match="wg1_other_first=True needs a 16-bit KV cache"):
        W.get_partial_kernel_wgmma_seesaw_balanced("bf16", "fp8_e4m3", fp8_producer=True, wg1_other_first=True)
    with pytest.raises(ValueError, match="wg1_other_first=True needs a 16-bit KV cache"):
        W.get_partial_kernel_wgmma_seesaw("bf16", "fp8_e4m3", wg1_other_first=True)
    with pytest.raises(ValueError, match="wg1_other_first=True needs a 16-bit KV cache"):
        W.get_partial_kernel_wgmma_seesaw("bf16", "fp8_e4m3", fp8_producer=True, wg1_other_first=True)
    assert built == []
    W.get_partial_kernel_wgmma_seesaw_balanced("bf16", partial="bf16", wide_store=True, tma=True, lazy_rescale=True,
                                               q_prefetch=True, wg1_other_first=True)
    W.get_partial_kernel_wgmma_seesaw_balanced("bf16", partial="bf16", wide_store=True, tma=True, lazy_rescale=True,
                                               q_prefetch=True)
    W.get_partial_kernel_wgmma_seesaw_balanced("bf16", tma=True, lazy_rescale=True, wg1_other_first=True)
    W.get_partial_kernel_wgmma_seesaw("bf16", wg1_other_first=True)
    W.get_partial_kernel_wgmma_seesaw("fp16", tma=True, wg1_other_first=True)
    W.get_partial_kernel_wgmma_seesaw("bf16")
    assert [(kind, s) for kind, s, _ in built] == [
        ("partial_wgmma_seesaw_balanced", ("bf16", "bf16", 64, "partial_bf16", "wide_store", "tma", "lazy", "qpf",
                                           "wg1of")),
        ("partial_wgmma_seesaw_balanced", ("bf16", "bf16", 64, "partial_bf16", "wide_store", "tma", "lazy", "qpf")),
        ("partial_wgmma_seesaw_balanced", ("bf16", "bf16", 64, "tma", "lazy", "wg1of")),
        ("partial_wgmma_seesaw", ("bf16", "bf16", 64, "wg1of")),
        ("partial_wgmma_seesaw", ("fp16", "fp16", 64, "tma", "wg1of")),
        ("partial_wgmma_seesaw", ("bf16", "bf16", 64))]

    import cutlass.cute as cute

    compiled = []
    monkeypatch.setattr(cute, "compile", lambda fn, *a, **kw: compiled.append((fn, len(a))))
    W._build_partial_wgmma_seesaw_balanced("bf16", "bf16", 64, "partial_bf16", "wide_store", "tma", "lazy", "qpf",
                                           "wg1of")
    W._build_partial_wgmma_seesaw_balanced("bf16", "bf16", 64, "tma", "lazy")
    W._build_partial_wgmma_seesaw("bf16", "bf16", 64, "wg1of")
    W._build_partial_wgmma_seesaw("bf16", "bf16", 64)
    (fb, nb), (fb0, _), (fe, ne), (fe0, _) = compiled
    assert fb.__name__ == "call_balanced" and fb.__self__.wg1_other_first and fb.__self__.q_prefetch
    assert not fb0.__self__.wg1_other_first and fe.wg1_other_first and not fe0.wg1_other_first
    assert nb == len(api._fake_args_partial_balanced("bf16", "bf16")) and ne == len(api._fake_args_partial("bf16",
                                                                                                          "bf16"))
    with pytest.raises(ValueError, match="wg1_other_first=True needs a 16-bit KV cache"):  # an fp8 key with the flag
        W._build_partial_wgmma_seesaw("bf16", "fp8_e4m3", 64, "l2pf", "wg1of")

    B, s_q, H = 3, 1, 128
    q = torch.zeros(B, s_q, H, 576, dtype=torch.bfloat16)
    kv = torch.zeros(8, 64, 576, dtype=torch.bfloat16)
    pt = torch.zeros(B, 4, dtype=torch.int32)
    lens = torch.tensor([100, 0, 64], dtype=torch.int32)
    out = torch.zeros(B, s_q, H, 512, dtype=torch.bfloat16)
    lse = torch.zeros(B, s_q, H)
    asked, launched = [], []
    monkeypatch.setattr(W, "get_partial_kernel_wgmma_seesaw_balanced",
                        lambda q_name, kv_name, **kw: asked.append(("balanced", kw)) or "kernel")
    monkeypatch.setattr(W, "get_partial_kernel_wgmma_seesaw",
                        lambda q_name, kv_name, **kw: asked.append(("even", kw)) or "kernel")
    monkeypatch.setattr(api, "launch_balanced", lambda partial, *a: launched.append(partial))
    monkeypatch.setattr(api, "launch", lambda partial, *a: launched.append(partial))
    bal = make_schedule([100, 0, 64], s_q, H, 132, device="cpu", balanced=True)
    ws = alloc_workspace(bal, device="cpu", partial_dtype=torch.float32)
    W.mla_decode_sm90_wgmma_seesaw_balanced(q, kv, pt, lens, 0.1, 1.0, out, lse, bal, ws, tma=True, q_prefetch=True,
                                            wg1_other_first=True)
    W.mla_decode_sm90_wgmma_seesaw_balanced(q, kv, pt, lens, 0.1, 1.0, out, lse, bal, ws, tma=True)
    even = make_schedule([100, 0, 64], s_q, H, 132, device="cpu")
    ws_e = alloc_workspace(even, device="cpu", partial_dtype=torch.float32)
    W.mla_decode_sm90_wgmma_seesaw(q, kv, pt, lens, 0.1, 1.0, out, lse, even, ws_e, wg1_other_first=True)
    W.mla_decode_sm90_wgmma_seesaw(q, kv, pt, lens, 0.1, 1.0, out, lse, even, ws_e)
    assert asked[0] == ("balanced", dict(l2_prefetch=None, partial="fp32", wide_store=False, tma=True,
                                         lazy_rescale=False, q_prefetch=True, wg1_other_first=True))
    assert asked[1] == ("balanced", dict(l2_prefetch=None, partial="fp32", wide_store=False, tma=True,
                                         lazy_rescale=False))
    assert asked[2][0] == asked[3][0] == "even"
    assert asked[2][1].pop("wg1_other_first") is True and asked[2][1] == asked[3][1]
    assert "wg1_other_first" not in asked[3][1]
    assert launched == ["kernel"] * 4
