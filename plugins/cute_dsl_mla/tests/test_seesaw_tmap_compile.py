"""CPU tests (no GPU) of the balanced 16-bit seesaw with a TMA producer warpgroup (``MLADecodePartialWGMMASeesaw(tma=True,
balanced=True, tma_producer=True)``, ``kernel_tmap_balanced``; branch tma-producer, compile-only: NOT run on a GPU yet;
the protocol is test_seesaw_tmap_protocol.py, the GPU run test_seesaw_tmap_gpu.py).

1. The kernel compiles for bf16 / fp16 q, lazy / eager rescale, fp32 and 16-bit (wide) partials: a 384-thread launch
   (.reqntid 384, .minnctapersm 1, 168 registers at launch, no stack frame), one setmaxnreg.inc (TMAP_MATH_REGS) and
   one setmaxnreg.dec (TMAP_PRODUCER_REGS) after the setup's only CTA barrier, 10 mbarriers initialised once, one copy
   of the item body (88 WGMMAs), every TMA (18 KV boxes + 9 Q boxes, 5 arrive.expect_tx) and 5 mbarrier waits (4 empty,
   Q empty) in the producer's code after the setmaxnreg.dec, 9 waits in the math code (4 full in the two qk, 4 full
   in zero_v_tail, Q full), 7 plain arrives (4 empty releases, 3 Q-empty sites), no cp.async at all.
2. ptxas (standalone, as test_wgmma_serialization.py): no spill in either setmaxnreg region, no C7518 (no WGMMA
   serialized), <= 168 registers at launch.
3. Refusals (constructor and getters), the cache-key flag "tmap" (last, only when set), the builders, the host entry.
The PTX of every existing kernel with the option off is pinned elsewhere (test_seesaw_qpf_compile.py,
test_seesaw_balanced_compile.py, test_seesaw_tma_compile.py, test_seesaw_fp8p_ring_compile.py): unchanged on this
branch.
"""

from __future__ import annotations

import os
import re

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from test_kernel_compile import _has_cutlass  # noqa: E402  (same directory)

needs_cutlass = pytest.mark.skipif(not _has_cutlass(), reason="nvidia-cutlass-dsl not installed")

# (q, partial dtype, wide stores, lazy rescale): the backend-like arm (16-bit partials in q's dtype, wide stores) and
# the fp32 narrow arm, each in both q dtypes and rescale modes between them
SPECS = [("bf16", "bf16", True, True), ("bf16", "fp32", False, False), ("fp16", "fp32", False, True),
         ("fp16", "fp16", True, False)]


def _kernel(q, lazy=False, wide=False, tma_producer=True):
    from mla_cute_dsl.kernels import api
    from mla_cute_dsl.kernels.sm90_wgmma_decode import MLADecodePartialWGMMASeesaw

    return MLADecodePartialWGMMASeesaw(api._cutlass_dtype(q), api._cutlass_dtype(q), tma=True, balanced=True,
                                       lazy_rescale=lazy, wide_store=wide, tma_producer=tma_producer)


@needs_cutlass
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: "-".join(map(str, s)))
def test_tmap_kernel_ptx_and_ptxas(spec, tmp_path):
    from test_balanced_compile import _dump
    from test_wgmma_serialization import _assemble, _ptxas

    from mla_cute_dsl.kernels import api
    from mla_cute_dsl.kernels import sm90_wgmma_decode as W

    q, partial, wide, lazy = spec
    ptx, regs, frame = _dump(_kernel(q, lazy, wide).call_balanced, api._fake_args_partial_balanced(q, q, partial),
                             tmp_path)
    flat = re.sub(r"\s+", " ", ptx)
    assert ".reqntid 384, 1, 1" in flat and ".minnctapersm 1" in flat
    assert regs == W.FP8P_REGS_AT_LAUNCH and frame == 0
    assert "ld.local" not in ptx and "st.local" not in ptx
    assert re.findall(r"setmaxnreg\.inc\.sync\.aligned\.u32 (\d+);", flat) == [str(W.TMAP_MATH_REGS)]
    assert re.findall(r"setmaxnreg\.dec\.sync\.aligned\.u32 (\d+);", flat) == [str(W.TMAP_PRODUCER_REGS)]
    assert flat.count("bar.sync 0;") == 1 and flat.find("setmaxnreg") > flat.find("bar.sync 0;")
    assert flat.count("mbarrier.init.shared.b64") == 10
    assert flat.count("wgmma.mma_async") == 88
    for absent in ("cp.async.cg", "cp.async.wait_group", "cp.async.commit_group", "cp.async.mbarrier.arrive"):
        assert absent not in flat, absent
    dec = flat.find("setmaxnreg.dec")
    math, prod = flat[:dec], flat[dec:]
    assert "wgmma.mma_async" not in prod and "cp.async.bulk.tensor" not in math
    assert prod.count("cp.async.bulk.tensor") == 18 + 9  # tiles a (4 + 5 boxes) and b (4 + 5), Q (9)
    assert prod.count("mbarrier.arrive.expect_tx") == 5 and "mbarrier.arrive.expect_tx" not in math
    assert prod.count("mbarrier.try_wait") == 5 and math.count("mbarrier.try_wait") == 9
    assert math.count("mbarrier.arrive.shared.b64") == 7 and "mbarrier.arrive.shared.b64" not in prod
    e = 2  # bytes per element of the 16-bit cache and q
    for nbytes in (64 * 576 * e, 4 * 64 * 64 * e, 5 * 64 * 64 * e):  # Q, the 4- and 5-box parts
        assert re.search(rf"mov\.b32 %r\d+, {nbytes};", flat), nbytes
    # the math warpgroups' barriers: BAR_MATH twice per item, the P barriers, the zero_v_tail barriers
    assert flat.count("bar.sync 5, 256;") == 2
    for bar in (1, 2):
        assert flat.count(f"bar.arrive {bar}, 256;") == 1 and flat.count(f"bar.sync {bar}, 256;") == 1
    assert flat.count("bar.sync 3, 128;") == 2 and flat.count("bar.sync 4, 128;") == 2
    assert set(re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+);", flat)) == {"0"}

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
    print(log[-400:])
    assert "C7518" not in log and "serialized" not in log, log
    used = re.search(r"Used (\d+) registers", log)
    assert used and int(used.group(1)) <= W.FP8P_REGS_AT_LAUNCH, log
    assert re.search(r"0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads", log), log


def test_tmap_register_split_and_smem():
    """The split fits the launch pool (240 / 24 would be the largest, but the producer spills at 24: 232 / 40, the
    largest math share with a producer above 24); 6 more mbarriers than the balanced TMA kernel's 4, within the 227
    KB."""
    import cutlass

    from mla_cute_dsl.kernels import sm90_wgmma_decode as W

    assert W.fp8p_register_split_fits(W.TMAP_MATH_REGS, W.TMAP_PRODUCER_REGS)
    assert not W.fp8p_register_split_fits(W.TMAP_MATH_REGS + 8, W.TMAP_PRODUCER_REGS)
    assert not W.fp8p_register_split_fits(W.TMAP_MATH_REGS + 8, 32) and W.fp8p_register_split_fits(240, 24)
    assert (W.TMAP_MATH_REGS, W.TMAP_PRODUCER_REGS) == (232, 40)
    K = W.MLADecodePartialWGMMASeesaw
    k = K(cutlass.BFloat16, cutlass.BFloat16, tma=True, balanced=True, tma_producer=True)
    base = K(cutlass.BFloat16, cutlass.BFloat16, tma=True, balanced=True)
    assert k._num_mbars() == 10 and base._num_mbars() == 4 and not base.tma_producer
    assert k.smem_bytes() == base.smem_bytes() + 6 * 8 <= W.SMEM_LIMIT
    assert (W.TMAP_Q_FULL, W.TMAP_Q_EMPTY) == (8, 9)


def test_tmap_refusals_key_builder_and_entry(monkeypatch):
    """Refused (kernel object and getters, nothing compiled): an fp8 cache, tma=False, the one-item kernel, with
    q_prefetch or an fp8 producer option; the key gains "tmap" last and only when set; the builder makes the kernel from
    the flag (the even builder refuses it); the host entry asks for it only when asked."""
    import cutlass
    import torch

    from mla_cute_dsl.kernels import alloc_workspace, api, kernel_cache, make_schedule
    from mla_cute_dsl.kernels import sm90_wgmma_decode as W

    K = W.MLADecodePartialWGMMASeesaw
    bf, e4 = cutlass.BFloat16, cutlass.Float8E4M3FN
    for kw in (dict(tma=True), dict(balanced=True), dict(tma=True, balanced=True, kv=e4)):
        kv = kw.pop("kv", bf)
        with pytest.raises(ValueError, match="tma_producer=True needs a 16-bit KV cache"):
            K(bf, kv, tma_producer=True, **kw)
    for kw in (dict(q_prefetch=True),):
        with pytest.raises(ValueError, match="tma_producer=True excludes q_prefetch"):
            K(bf, bf, tma=True, balanced=True, tma_producer=True, **kw)

    built = []
    monkeypatch.setattr(kernel_cache, "get_or_build", lambda kind, spec, build: built.append((kind, spec, build)))
    G = W.get_partial_kernel_wgmma_seesaw_balanced
    with pytest.raises(ValueError, match="needs a 16-bit KV cache"):
        G("bf16", "fp8_e4m3", tma=True, tma_producer=True)  # the tma check refuses it first
    with pytest.raises(ValueError, match="tma_producer=True needs a 16-bit KV cache"):
        G("bf16", tma_producer=True)  # tma=False
    with pytest.raises(ValueError, match="tma_producer=True excludes q_prefetch"):
        G("bf16", tma=True, q_prefetch=True, tma_producer=True)
    assert built == []
    G("bf16", partial="bf16", wide_store=True, tma=True, lazy_rescale=True, tma_producer=True)
    G("fp16", tma=True, tma_producer=True)
    G("bf16", partial="bf16", wide_store=True, tma=True, lazy_rescale=True)
    assert [(kind, s) for kind, s, _ in built] == [
        ("partial_wgmma_seesaw_balanced", ("bf16", "bf16", 64, "partial_bf16", "wide_store", "tma", "lazy", "tmap")),
        ("partial_wgmma_seesaw_balanced", ("fp16", "fp16", 64, "tma", "tmap")),
        ("partial_wgmma_seesaw_balanced", ("bf16", "bf16", 64, "partial_bf16", "wide_store", "tma", "lazy"))]
    assert "tmap" in W.SEESAW_FLAGS and W.SEESAW_FLAGS[:7] == ("l2pf", "wide_store", "tma", "rfence", "lazy", "fp8p",
                                                                "qpf")

    import cutlass.cute as cute

    compiled = []
    monkeypatch.setattr(cute, "compile", lambda fn, *a, **kw: compiled.append((fn, len(a))))
    W._build_partial_wgmma_seesaw_balanced("bf16", "bf16", 64, "partial_bf16", "wide_store", "tma", "lazy", "tmap")
    W._build_partial_wgmma_seesaw_balanced("bf16", "bf16", 64, "tma")
    (fn, n_args), (fn0, _) = compiled
    assert fn.__name__ == "call_balanced" and fn.__self__.tma_producer and fn.__self__.tma and fn.__self__.lazy_rescale
    assert not fn0.__self__.tma_producer
    assert n_args == len(api._fake_args_partial_balanced("bf16", "bf16"))
    with pytest.raises(ValueError, match="tma_producer=True needs"):  # an even key with the flag
        W._build_partial_wgmma_seesaw("bf16", "bf16", 64, "tma", "tmap")

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
    W.mla_decode_sm90_wgmma_seesaw_balanced(q, kv, pt, lens, 0.1, 1.0, out, lse, bal, ws, tma=True, tma_producer=True)
    W.mla_decode_sm90_wgmma_seesaw_balanced(q, kv, pt, lens, 0.1, 1.0, out, lse, bal, ws, tma=True)
    assert asked == [dict(l2_prefetch=None, partial="fp32", wide_store=False, tma=True, lazy_rescale=False,
                          tma_producer=True),
                     dict(l2_prefetch=None, partial="fp32", wide_store=False, tma=True, lazy_rescale=False)]
    assert launched == ["kernel", "kernel"]
