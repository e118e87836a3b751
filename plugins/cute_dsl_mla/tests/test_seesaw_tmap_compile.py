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
4. With ``wg1_other_first`` (branch tmap-wg1of; GPU-verified in the twenty-fifth session): bf16 lazy, 16-bit wide
   and fp32 narrow partials, the checks of 1 and 2, the same instructions opcode for opcode as without it, tile b's parts issued 2 then 3 by the
   producer (each armed on its own full barrier after a wait on its own empty barrier), and the tmap kernel without it
   pinned to main's PTX (592f979) and with it to the branch's.
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


# wg1_other_first with the producer (branch tmap-wg1of): (q, partial dtype, wide stores, lazy rescale) -> ptx_sha256
# (test_balanced_compile.ptx_sha256; nvidia-cutlass-dsl 4.8.1, sm_90a) of the tmap kernel without the option on main
# 592f979 (before the combination existed: the option off must stay main's) and with it as written on branch
# tmap-wg1of (pinned compile-only; these kernels then passed test_seesaw_tmap_gpu.py on the H200, twenty-fifth
# session: rerun it before moving a pin)
TMAP_MAIN_PTX_SHA256 = {
    ("bf16", "bf16", True, True): "6c56a7d13f3b44cf8d679dcefb248422483e14b76f8b616402bf51d8383eefee",
    ("bf16", "fp32", False, True): "f98004ad842f0d7562fed54fcbeab0c29bd652a2a847a5d99b84d8fe11029086",
}
TMAP_WG1OF_PTX_SHA256 = {
    ("bf16", "bf16", True, True): "54b65565600dc78f7cc469d05f0e024a7f1845310878d315050863ded6486ca4",
    ("bf16", "fp32", False, True): "8590c70d4f1e4f59759791bd241a6fd0d592350f876b47c543c3e09716b33f1d",
}


def _kernel(q, lazy=False, wide=False, tma_producer=True, wg1_other_first=False):
    from mla_cute_dsl.kernels import api
    from mla_cute_dsl.kernels.sm90_wgmma_decode import MLADecodePartialWGMMASeesaw

    return MLADecodePartialWGMMASeesaw(api._cutlass_dtype(q), api._cutlass_dtype(q), tma=True, balanced=True,
                                       lazy_rescale=lazy, wide_store=wide, tma_producer=tma_producer,
                                       **({"wg1_other_first": True} if wg1_other_first else {}))


def producer_parts(ptx):
    """The producer's loads in program order (after its setmaxnreg.dec): (mbarrier index it waited last before the
    arm, -1 for none; mbarrier index it arms with expect_tx; TMA boxes under that arm), the indices resolved from the
    shared-memory offsets (``add.s32 %rX, %r1, N`` or ``[%r1+N]``) relative to full[0], the first KV part's."""
    prod = ptx[ptx.find("setmaxnreg.dec"):]
    offs = {m.group(1): int(m.group(2)) for m in re.finditer(r"add\.s32\s+(%r\d+), %r1, (\d+);", ptx)}

    def addr(a):
        m = re.fullmatch(r"%r1\+(\d+)", a)
        return int(m.group(1)) if m else offs[a]

    seq, wait = [], None
    for m in re.finditer(r"mbarrier\.try_wait\.parity\.shared\.b64 \w+, \[([^\]]+)\]"
                         r"|mbarrier\.arrive\.expect_tx\.shared\.b64 %rd\d+, \[([^\]]+)\]"
                         r"|cp\.async\.bulk\.tensor", prod):
        if m.group(1):
            wait = addr(m.group(1))
        elif m.group(2):
            seq.append([wait, addr(m.group(2)), 0])
            wait = None
        else:
            seq[-1][2] += 1
    base = seq[1][1]  # full[0]: the first KV part's (after Q's)
    return [(-1 if w is None else (w - base) // 8, (f - base) // 8, n) for w, f, n in seq]


@needs_cutlass
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: "-".join(map(str, s)))
def test_tmap_kernel_ptx_and_ptxas(spec, tmp_path):
    from test_balanced_compile import _dump

    from mla_cute_dsl.kernels import api

    q, partial, wide, lazy = spec
    ptx, regs, frame = _dump(_kernel(q, lazy, wide).call_balanced, api._fake_args_partial_balanced(q, q, partial),
                             tmp_path)
    _check_tmap_ptx(ptx, regs, frame)
    _check_ptxas(ptx, tmp_path)


def _check_tmap_ptx(ptx, regs, frame):
    """The PTX checks of a tma_producer kernel (docstring, 1)."""
    from mla_cute_dsl.kernels import sm90_wgmma_decode as W

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


def _check_ptxas(ptx, tmp_path):
    """Standalone ptxas (as test_wgmma_serialization.py): no C7518, no spill, <= 168 registers (docstring, 2)."""
    from test_wgmma_serialization import _assemble, _ptxas

    from mla_cute_dsl.kernels import sm90_wgmma_decode as W

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


@needs_cutlass
@pytest.mark.parametrize("spec", sorted(TMAP_WG1OF_PTX_SHA256), ids=lambda s: "-".join(map(str, s)))
def test_tmap_with_wg1_other_first_compiles_and_the_option_off_is_mains(spec, tmp_path):
    """tma_producer + wg1_other_first: the tmap kernel's checks (PTX and ptxas: no spill, no C7518), the same opcodes
    as without the option (only the producer's two tile-b parts and WG1's two QK halves swap), the producer's parts
    in the math side's wait order (Q, tile a: 0, 1; tile b: 2, 3, each waiting its own empty barrier: index 4 + i);
    the option off is main's PTX."""
    from test_balanced_compile import _dump, ptx_sha256
    from test_seesaw_wg1of_compile import _opcodes

    from mla_cute_dsl.kernels import api
    from mla_cute_dsl.kernels import sm90_wgmma_decode as W

    q, partial, wide, lazy = spec
    (tmp_path / "off").mkdir()
    (tmp_path / "on").mkdir()
    args = api._fake_args_partial_balanced(q, q, partial)
    off, _, _ = _dump(_kernel(q, lazy, wide).call_balanced, args, tmp_path / "off")
    assert ptx_sha256(off) == TMAP_MAIN_PTX_SHA256[spec], "the tmap kernel without wg1_other_first changed"
    k = _kernel(q, lazy, wide, wg1_other_first=True)
    assert k.tma_producer and k.wg1_other_first
    ptx, regs, frame = _dump(k.call_balanced, args, tmp_path / "on")
    print(f"tmap wg1of {spec}: {regs} registers, stack frame {frame} B, ptx_sha256 {ptx_sha256(ptx)}")
    assert ptx_sha256(ptx) == TMAP_WG1OF_PTX_SHA256[spec]
    _check_tmap_ptx(ptx, regs, frame)
    assert ptx != off and _opcodes(ptx) == _opcodes(off)
    q_part = (W.TMAP_Q_EMPTY, W.TMAP_Q_FULL, 9)
    assert producer_parts(off) == [q_part, (4, 0, 4), (5, 1, 5), (7, 3, 4), (6, 2, 5)]
    assert producer_parts(ptx) == [q_part, (4, 0, 4), (5, 1, 5), (6, 2, 5), (7, 3, 4)]
    _check_ptxas(ptx, tmp_path)


def test_tmap_with_wg1_other_first_key_builder_and_entry(monkeypatch):
    """The combination is built (no ValueError any more): key flags "wg1of" then "tmap" (both last, only when set),
    the builder makes the kernel with both options from the key, the host entry passes both keywords only when
    asked; an fp8 cache is still refused (by the wg1_other_first check first)."""
    import cutlass
    import cutlass.cute as cute

    from mla_cute_dsl.kernels import kernel_cache
    from mla_cute_dsl.kernels import sm90_wgmma_decode as W

    bf = cutlass.BFloat16
    k = W.MLADecodePartialWGMMASeesaw(bf, bf, tma=True, balanced=True, tma_producer=True, wg1_other_first=True)
    assert k.tma_producer and k.wg1_other_first and k._num_mbars() == 10
    with pytest.raises(ValueError, match="wg1_other_first=True needs a 16-bit KV cache"):
        W.MLADecodePartialWGMMASeesaw(bf, cutlass.Float8E4M3FN, tma=True, balanced=True, tma_producer=True,
                                      wg1_other_first=True)
    built = []
    monkeypatch.setattr(kernel_cache, "get_or_build", lambda kind, spec, build: built.append((kind, spec)))
    G = W.get_partial_kernel_wgmma_seesaw_balanced
    G("bf16", partial="bf16", wide_store=True, tma=True, lazy_rescale=True, wg1_other_first=True, tma_producer=True)
    G("bf16", tma=True, lazy_rescale=True, wg1_other_first=True, tma_producer=True)
    assert built == [
        ("partial_wgmma_seesaw_balanced", ("bf16", "bf16", 64, "partial_bf16", "wide_store", "tma", "lazy", "wg1of",
                                           "tmap")),
        ("partial_wgmma_seesaw_balanced", ("bf16", "bf16", 64, "tma", "lazy", "wg1of", "tmap"))]
    compiled = []
    monkeypatch.setattr(cute, "compile", lambda fn, *a, **kw: compiled.append(fn))
    W._build_partial_wgmma_seesaw_balanced("bf16", "bf16", 64, "tma", "lazy", "wg1of", "tmap")
    (fn,) = compiled
    assert fn.__self__.tma_producer and fn.__self__.wg1_other_first and fn.__self__.lazy_rescale

    import torch

    from mla_cute_dsl.kernels import alloc_workspace, api, make_schedule

    B, s_q, H = 3, 1, 128
    args = (torch.zeros(B, s_q, H, 576, dtype=torch.bfloat16), torch.zeros(8, 64, 576, dtype=torch.bfloat16),
            torch.zeros(B, 4, dtype=torch.int32), torch.tensor([100, 0, 64], dtype=torch.int32), 0.1, 1.0,
            torch.zeros(B, s_q, H, 512, dtype=torch.bfloat16), torch.zeros(B, s_q, H))
    asked = []
    monkeypatch.setattr(W, "get_partial_kernel_wgmma_seesaw_balanced",
                        lambda q_name, kv_name, **kw: asked.append(kw) or "kernel")
    monkeypatch.setattr(api, "launch_balanced", lambda partial, *a: None)
    bal = make_schedule([100, 0, 64], s_q, H, 132, device="cpu", balanced=True)
    ws = alloc_workspace(bal, device="cpu", partial_dtype=torch.float32)
    W.mla_decode_sm90_wgmma_seesaw_balanced(*args, bal, ws, tma=True, lazy_rescale=True, wg1_other_first=True,
                                            tma_producer=True)
    assert asked == [dict(l2_prefetch=None, partial="fp32", wide_store=False, tma=True, lazy_rescale=True,
                          wg1_other_first=True, tma_producer=True)]
