"""CPU tests (no GPU) of the fp8 H=16 variant (sm90_decode_fp8.MLADecodePartialFP8Reg).

1. The index permutations are bijections and the layouts composed onto shared
   memory implement them (evaluated layout by layout, no kernel trusted).
2. The mma.sync B-fragment order the design rests on: for every thread, the
   16 B values of one chunk are 16 consecutive bytes of one token (QK), and the
   4 n-blocks of a PV group read 4 consecutive bytes of one token; with the
   staging swizzle the 128-bit K loads and the 32-bit V loads are bank-conflict
   free.  (Coordinates from the DSL's own partitions; addresses from the PTX ISA
   fragment formulas in Python.)
3. The whole kernel compiles for sm_90a (bf16 / fp16 q, BLOCK_M 16 / 32), with
   <= 255 registers and no stack frame (cubin .nv.info), and its PTX has the
   predicted instruction counts per tile.
Nothing here runs the kernel: tests/test_fp8reg_gpu.py does, on an SM90 GPU.
"""

from __future__ import annotations

import os
import re

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")


def _has_cutlass():
    try:
        import cutlass
    except Exception:
        return False
    return cutlass is not None


pytestmark = pytest.mark.skipif(not _has_cutlass(), reason="nvidia-cutlass-dsl not installed")

if _has_cutlass():
    import cutlass
    import cutlass.cute as cute


def _kernel(q="bf16", bm=16):
    from mla_cute_dsl.kernels.sm90_decode_fp8 import MLADecodePartialFP8Reg

    dt = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16}[q]
    return MLADecodePartialFP8Reg(dt, cutlass.Float8E4M3FN, bm)


def _staging_byte(t, d, st, stages=2):
    """Staging byte address: 9 blocks of (64 tokens x 64 B), bits 5,6 ^= bits 7,8."""
    off = st * 64 * 576 + (d // 64) * 4096 + t * 64 + d % 64
    return off ^ (((off >> 7) & 3) << 5)


def test_permutations_are_bijections():
    from mla_cute_dsl.kernels.sm90_decode_fp8 import o_phys_dim, qk_phys_dim

    assert sorted(qk_phys_dim(k) for k in range(576)) == list(range(576))
    assert sorted(o_phys_dim(n) for n in range(512)) == list(range(512))
    # the staging swizzle is a bijection inside each stage
    assert sorted(_staging_byte(t, d, 0) for t in range(64) for d in range(576)) == list(range(64 * 576))


def test_smem_budget_two_ctas_per_sm():
    for bm in (16, 32):
        n = _kernel("bf16", bm).smem_bytes()
        # two CTAs (+1 KB reserved each) in the 228 KB of an H100/H200 SM
        assert 2 * (n + 1024) <= 233472, (bm, n)


def test_unsupported_specializations_are_refused():
    from mla_cute_dsl.kernels.sm90_decode_fp8 import MLADecodePartialFP8Reg

    with pytest.raises(NotImplementedError):
        MLADecodePartialFP8Reg(cutlass.BFloat16, cutlass.BFloat16, 16)
    with pytest.raises(ValueError):
        MLADecodePartialFP8Reg(cutlass.BFloat16, cutlass.Float8E4M3FN, 64)


@pytest.mark.parametrize("bm", [16, 32])
def test_layouts_implement_the_permutations(bm):
    from mla_cute_dsl.kernels import sm90_decode_fp8 as F

    k = _kernel("bf16", bm)
    bad = {}

    @cute.jit
    def probe():
        sQ, sP, sR = k._layouts()
        lq, lk, lv, lo = k._perm_layouts(bm, k.stages)
        # lq: (row, phys d) -> col-major index of (row, logical k)
        bad["q"] = sum(lq((r, F.qk_phys_dim(kk))) != r + bm * kk
                       for r in range(bm) for kk in range(0, 576, 1))
        bad["k"] = sum(lk((t, kk, st)) != t + 64 * F.qk_phys_dim(kk) + 64 * 576 * st
                       for t in range(0, 64, 7) for kk in range(576) for st in range(k.stages))
        bad["v"] = sum(lv((n, t, st)) != t + 64 * F.o_phys_dim(n) + 64 * 576 * st
                       for n in range(512) for t in range(0, 64, 5) for st in range(k.stages))
        bad["o"] = sum(lo((r, n)) != r + bm * F.o_phys_dim(n) for r in range(bm) for n in range(512))
        bad["r"] = sum(sR.outer((t, d, st)) != st * 64 * 576 + (d // 64) * 4096 + t * 64 + d % 64
                       for t in range(64) for d in range(0, 576, 3) for st in range(k.stages))

    cute.compile(probe)
    assert bad == {"q": 0, "k": 0, "v": 0, "o": 0, "r": 0}


@pytest.mark.parametrize("bm", [16, 32])
def test_fragment_order_contiguity_and_banks(bm):
    """Per thread: QK B values of chunk c = 16 consecutive staging bytes of one
    token; PV B values of group a = 4 consecutive bytes per token.  Per warp:
    no bank conflicts for either load (128-bit: per 8-lane phase 8 distinct
    16-B bank groups; 32-bit: 32 distinct banks)."""
    from mla_cute_dsl.kernels import sm90_decode_fp8 as F

    k = _kernel("bf16", bm)
    res = {}

    @cute.jit
    def probe():
        mma = k._tiled_mma()
        cK = cute.make_identity_tensor((64, 576))
        cV = cute.make_identity_tensor((512, 64))
        for tid in cutlass.range_constexpr(k.num_threads):  # static thread ids
            tk = mma.get_slice(tid).partition_B(cK)
            tv = mma.get_slice(tid).partition_B(cV)
            res[("k", tid)] = [[[tk[v, nb, kb] for v in range(4)] for kb in range(36)]
                               for nb in range(cute.size(tk.shape[1]))]
            res[("v", tid)] = [[[tv[v, s, kb] for v in range(4)] for kb in range(4)]
                               for s in range(cute.size(tv.shape[1]))]

    cute.compile(probe)
    contiguous_k = contiguous_v = True
    k_conf = v_conf = 0
    nw = k.num_threads // 32
    for w in range(nw):
        # QK: addresses of each lane's 16-byte loads, per (nb, chunk)
        n_nb = len(res[("k", w * 32)])
        for nb in range(n_nb):
            for c in range(9):
                starts = []
                for lane in range(32):
                    co = res[("k", w * 32 + lane)][nb]
                    vals = [co[4 * c + i][v] for i in range(4) for v in range(4)]
                    t = vals[0][0]
                    addr = [_staging_byte(co_t, F.qk_phys_dim(co_k), 0) for co_t, co_k in vals]
                    contiguous_k &= all(x[0] == t for x in vals)
                    contiguous_k &= addr == list(range(addr[0], addr[0] + 16)) and addr[0] % 16 == 0
                    starts.append(addr[0])
                for ph in range(4):
                    k_conf += 8 - len({(a // 16) % 8 for a in starts[8 * ph: 8 * ph + 8]})
        # PV: per (kb, group a, value v) the lanes' 32-bit words
        for kb in range(4):
            for a in range(4):
                for v in range(4):
                    words = []
                    for lane in range(32):
                        co = res[("v", w * 32 + lane)]
                        vals = [co[4 * a + r][kb][v] for r in range(4)]  # (n, token) for r = 0..3
                        addr = [_staging_byte(tok, F.o_phys_dim(n), 0) for n, tok in vals]
                        contiguous_v &= all(x[1] == vals[0][1] for x in vals)
                        contiguous_v &= addr == list(range(addr[0], addr[0] + 4)) and addr[0] % 4 == 0
                        words.append(addr[0] // 4)
                    v_conf += 32 - len({x % 32 for x in words})
    assert (contiguous_k, contiguous_v) == (True, True)
    assert (k_conf, v_conf) == (0, 0)


def _nv_info_attrs(cubin: bytes):
    from test_wgmma_compile import _nv_info_attrs as f  # same directory

    return f(cubin)


@pytest.mark.parametrize("q", ["bf16", "fp16"])
@pytest.mark.parametrize("bm", [16, 32])
def test_compiles_registers_and_ptx_counts(q, bm, tmp_path):
    from mla_cute_dsl.kernels import api

    k = _kernel(q, bm)
    cute.compile(k, *api._fake_args_partial(q, "fp8_e4m3"),
                 options=api.COMPILE_OPTIONS + f" --keep-ptx --keep-cubin --dump-dir={tmp_path}")
    ptx = "".join(p.read_text() for p in tmp_path.glob("*.ptx"))
    cubin = b"".join(p.read_bytes() for p in tmp_path.glob("*.cubin"))
    attrs = _nv_info_attrs(cubin)
    regs = max(v for a, v in attrs if a == 0x2F)  # EIATTR_REGCOUNT
    frame = max((v for a, v in attrs if a == 0x11), default=0)  # EIATTR_FRAME_SIZE
    print(f"fp8reg q={q} BLOCK_M={bm}: {regs} registers, frame {frame} B")
    assert regs <= 255 and frame == 0, (regs, frame)
    assert ".reqntid 128, 1, 1" in ptx or ".maxntid 128, 1, 1" in ptx or "128, 1, 1" in ptx
    assert "ld.local" not in ptx and "st.local" not in ptx
    m_atoms = bm // 16
    # per tile and warp: 72 QK + 64 PV MMAs per 16-row atom
    assert len(re.findall(r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.f16\.f16\.f32", ptx)) == 136 * m_atoms
    # conversions do not depend on the rows: 144 (K) + 128 (V) per thread per tile
    assert len(re.findall(r"cvt\.rn\.f16x2\.e4m3x2", ptx)) == 272
    # B operands: 18 x 128-bit K loads + 64 x 32-bit V loads (+ sRed reads in v4 form)
    assert len(re.findall(r"ld\.shared\.b32", ptx)) == 64
    assert len(re.findall(r"ld\.shared\.v4\.b32", ptx)) >= 18
    # no fp16 K tile: ldmatrix only for Q (36 per atom) and P (4 per atom)
    assert len(re.findall(r"ldmatrix", ptx)) == 40 * m_atoms
    assert "cp.async.cg.shared.global" in ptx


@pytest.mark.parametrize("q", ["bf16", "fp16"])
@pytest.mark.parametrize("bm", [16, 32])
def test_kernel_cache_helper(q, bm):
    from mla_cute_dsl.kernels import api, kernel_cache
    from mla_cute_dsl.kernels.sm90_decode_fp8 import get_partial_kernel_fp8

    fn = get_partial_kernel_fp8(q, bm)
    assert fn is not None and get_partial_kernel_fp8(q, bm) is fn
    assert kernel_cache.origin("partial_fp8reg", (q, "fp8_e4m3", bm, None, 2)) in ("compiled", "disk")
    assert api.get_partial_kernel(q, "fp8_e4m3", bm) is not fn  # the verified kernel is separate


def test_fp8reg_host_checks_refuse_other_inputs():
    """CPU: the helper refuses a bf16 cache and more than 32 rows before any launch."""
    import torch

    from mla_cute_dsl.kernels import make_schedule
    from mla_cute_dsl.kernels.sm90_decode_fp8 import mla_decode_sm90_fp8

    q = torch.zeros(1, 1, 16, 576, dtype=torch.bfloat16)
    pt = torch.zeros(1, 2, dtype=torch.int32)
    lens = torch.ones(1, dtype=torch.int32)
    out = torch.zeros(1, 1, 16, 512, dtype=torch.bfloat16)
    lse = torch.zeros(1, 1, 16)
    sched = make_schedule([1], 1, 16, 132, device="cpu")
    with pytest.raises(ValueError, match="float8"):
        mla_decode_sm90_fp8(q, torch.zeros(2, 64, 576, dtype=torch.bfloat16), pt, lens, 0.1, 1.0,
                            out, lse, sched, None)
    q64 = torch.zeros(1, 1, 64, 576, dtype=torch.bfloat16)
    sched64 = make_schedule([1], 1, 64, 132, device="cpu")
    with pytest.raises(ValueError, match="<= 32"):
        mla_decode_sm90_fp8(q64, torch.zeros(2, 64, 576, dtype=torch.float8_e4m3fn), pt, lens, 0.1, 1.0,
                            torch.zeros(1, 1, 64, 512, dtype=torch.bfloat16), torch.zeros(1, 1, 64),
                            sched64, None)


# ---------------- the integer-pipe ("alu") e4m3 conversions (branch fp8reg-speed) ----------------

CVTS = ["f2fp", "pv_alu", "pv_alu2", "qk_alu", "alu"]


def _e4m3_value(b):
    """Reference e4m3fn value of byte b (torch's decoder); None for NaN."""
    import torch

    v = torch.tensor([b], dtype=torch.uint8).view(torch.float8_e4m3fn).float().item()
    return None if v != v else v


def _run_ptx(lines, args):
    """Interpret the kernel's conversion PTX (shl/shr/and/or/prmt on b32), return $0."""
    regs = {f"${i + 1}": a & 0xFFFFFFFF for i, a in enumerate(args)}

    def val(x):
        x = x.strip()
        return int(x, 16) if x.startswith("0x") else (int(x) if x.isdigit() else regs[x])

    for line in lines:
        op, rest = line.rstrip(";").split(None, 1)
        ops = [o.strip() for o in rest.split(",")]
        d, src = ops[0], [val(o) for o in ops[1:]]
        if op == "shl.b32":
            r = src[0] << src[1]
        elif op == "shr.b32":
            r = src[0] >> src[1]
        elif op == "and.b32":
            r = src[0] & src[1]
        elif op == "or.b32":
            r = src[0] | src[1]
        elif op == "prmt.b32":
            a, b, c = src
            pool = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
            r = 0
            for i in range(4):
                s = (c >> (4 * i)) & 0xF
                assert s < 8, "sign-replicate mode not expected"
                r |= pool[s] << (8 * i)
        else:
            raise AssertionError(f"unexpected PTX op {op}")
        regs[d] = r & 0xFFFFFFFF
    return regs["$0"]


def _f16_lanes(w):
    import struct

    return [struct.unpack("<e", struct.pack("<H", (w >> (16 * i)) & 0xFFFF))[0] for i in range(2)]


def test_alu_conversion_is_exact_for_every_byte():
    """The bit pattern [s 0 e4 m3 0000000] reads as value(b) * 2^-8 for every non-NaN e4m3
    byte (normals, subnormals, +-0); the model is the one the kernel's PTX implements."""
    from mla_cute_dsl.kernels.sm90_decode_fp8 import E4M3_ALU_SCALE, e4m3_alu_ref

    assert E4M3_ALU_SCALE == 256.0
    bad = [b for b in range(256) if _e4m3_value(b) is not None and e4m3_alu_ref(b) != _e4m3_value(b)]
    assert bad == []
    # NaN bytes become +-480 (documented; page tails are zero-filled before they get here)
    assert e4m3_alu_ref(0x7F) == 480.0 and e4m3_alu_ref(0xFF) == -480.0


def test_alu_conversion_ptx_over_all_words():
    """The inline PTX bodies, interpreted: ASM_LO -> (byte 0, byte 2), ASM_HI -> (byte 1,
    byte 3), asm_pair(sel r) -> (byte r of word a, byte r of word b), each * 2^-8, exact."""
    import random

    from mla_cute_dsl.kernels.sm90_decode_fp8 import ASM_HI, ASM_LO, _pv_prmt_sel, asm_pair

    rng = random.Random(0)
    finite = [b for b in range(256) if _e4m3_value(b) is not None]
    words = [sum(rng.choice(finite) << (8 * i) for i in range(4)) for _ in range(400)]
    # every byte value in every position at least once
    words += [sum(((b + 37 * i) % 256 if _e4m3_value((b + 37 * i) % 256) is not None else 0) << (8 * i)
                  for i in range(4)) for b in range(256)]
    for w in words:
        by = [(w >> (8 * i)) & 0xFF for i in range(4)]
        ref = [_e4m3_value(x) for x in by]
        lo = [x * 256.0 for x in _f16_lanes(_run_ptx(ASM_LO, [w]))]
        hi = [x * 256.0 for x in _f16_lanes(_run_ptx(ASM_HI, [w]))]
        assert lo == [ref[0], ref[2]], (hex(w), lo, ref)
        assert hi == [ref[1], ref[3]], (hex(w), hi, ref)
    for _ in range(300):
        wa, wb = rng.choice(words), rng.choice(words)
        for r in range(4):
            got = [x * 256.0 for x in _f16_lanes(_run_ptx(asm_pair(_pv_prmt_sel(r)), [wa, wb]))]
            assert got == [_e4m3_value((wa >> (8 * r)) & 0xFF), _e4m3_value((wb >> (8 * r)) & 0xFF)]


def test_cvt_modes_and_q_regs_validation():
    from mla_cute_dsl.kernels.sm90_decode_fp8 import CVT_MODES, MLADecodePartialFP8Reg

    assert sorted(CVT_MODES) == sorted(CVTS)
    assert CVT_MODES["f2fp"] == (False, 0)
    with pytest.raises(ValueError):
        MLADecodePartialFP8Reg(cutlass.BFloat16, cutlass.Float8E4M3FN, 16, cvt="nope")
    with pytest.raises(ValueError):
        MLADecodePartialFP8Reg(cutlass.BFloat16, cutlass.Float8E4M3FN, 16, q_regs=10)
    k = MLADecodePartialFP8Reg(cutlass.BFloat16, cutlass.Float8E4M3FN, 32, cvt="pv_alu", q_regs=4)
    assert (k.qk_alu, k.pv_alu_groups, k.q_regs) == (False, 4, 0)  # q_regs: BLOCK_M 16 only
    k = MLADecodePartialFP8Reg(cutlass.BFloat16, cutlass.Float8E4M3FN, 16, cvt="alu", q_regs=4)
    assert (k.qk_alu, k.pv_alu_groups, k.q_regs) == (True, 4, 4)
    assert k.smem_bytes() == _kernel("bf16", 16).smem_bytes()  # no extra shared memory


@pytest.mark.parametrize("bm", [16, 32])
def test_qk_alu_layouts_implement_the_permutation(bm):
    """ALU K order: lq / lk implement qk_phys_dim(k, alu=True), a bijection whose two fp16
    of each B register are bytes (0, 2) and (1, 3) of one 32-bit word."""
    from mla_cute_dsl.kernels import sm90_decode_fp8 as F

    assert sorted(F.qk_phys_dim(k, alu=True) for k in range(576)) == list(range(576))
    for k in range(0, 576, 2):  # (lo = 0, 1) of one register: bytes 2 apart in one word
        a, b = F.qk_phys_dim(k, alu=True), F.qk_phys_dim(k + 1, alu=True)
        assert b == a + 2 and a // 4 == b // 4 and a % 4 in (0, 1)
    k = _kernel("bf16", bm)
    bad = {}

    @cute.jit
    def probe():
        lq, lk, lv, lo = k._perm_layouts(bm, k.stages, True)
        bad["q"] = sum(lq((r, F.qk_phys_dim(kk, alu=True))) != r + bm * kk
                       for r in range(0, bm, 3) for kk in range(576))
        bad["k"] = sum(lk((t, kk, st)) != t + 64 * F.qk_phys_dim(kk, alu=True) + 64 * 576 * st
                       for t in range(0, 64, 7) for kk in range(576) for st in range(k.stages))

    cute.compile(probe)
    assert bad == {"q": 0, "k": 0}


@pytest.mark.parametrize("bm", [16, 32])
def test_qk_alu_fragment_words(bm):
    """ALU K path: per thread and chunk, the B value (v = lo + 2hi, k-block i) sits at staging
    byte base + hi + 2lo + 4i (the order the kernel's phys_order view loads into registers,
    one 16-byte vector), so word i = (v0, v2, v1, v3) and ASM_LO / ASM_HI give the B
    registers (v0, v1) / (v2, v3); the 16-byte loads stay bank-conflict free."""
    from mla_cute_dsl.kernels import sm90_decode_fp8 as F

    k = _kernel("bf16", bm)
    res = {}

    @cute.jit
    def probe():
        mma = k._tiled_mma()
        cK = cute.make_identity_tensor((64, 576))
        for tid in cutlass.range_constexpr(k.num_threads):
            tk = mma.get_slice(tid).partition_B(cK)
            res[tid] = [[[tk[v, nb, kb] for v in range(4)] for kb in range(36)]
                        for nb in range(cute.size(tk.shape[1]))]
        po = cute.make_layout((2, 2, 4), stride=(2, 1, 4))
        res["po"] = [po(x) for x in range(16)]

    cute.compile(probe)
    # phys_order: register byte x <- fragment value index (v + 4i) = po(x)
    po = res["po"]
    ok = True
    conf = 0
    for w in range(k.num_threads // 32):
        for nb in range(len(res[w * 32])):
            for c in range(9):
                starts = []
                for lane in range(32):
                    co = res[w * 32 + lane][nb]
                    vals = [co[4 * c + i][v] for i in range(4) for v in range(4)]  # index v + 4i
                    addr = [_staging_byte(t, F.qk_phys_dim(kk, alu=True), 0) for t, kk in vals]
                    ok &= all(t == vals[0][0] for t, _ in vals)
                    ok &= [addr[po[x]] for x in range(16)] == list(range(addr[0], addr[0] + 16))
                    ok &= addr[0] % 16 == 0
                    starts.append(addr[0])
                for ph in range(4):
                    conf += 8 - len({(a // 16) % 8 for a in starts[8 * ph: 8 * ph + 8]})
    assert ok and conf == 0
    # word i of the register vector holds values (v0, v2, v1, v3) of k-block i
    assert [po[x] % 4 for x in range(4)] == [0, 2, 1, 3] and [po[x] // 4 for x in range(0, 16, 4)] == [0, 1, 2, 3]


def _compile_ptx(tmp_path, q, bm, **kw):
    from mla_cute_dsl.kernels import api
    from mla_cute_dsl.kernels.sm90_decode_fp8 import MLADecodePartialFP8Reg

    dt = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16}[q]
    k = MLADecodePartialFP8Reg(dt, cutlass.Float8E4M3FN, bm, **kw)
    cute.compile(k, *api._fake_args_partial(q, "fp8_e4m3"),
                 options=api.COMPILE_OPTIONS + f" --keep-ptx --keep-cubin --dump-dir={tmp_path}")
    ptx = "".join(p.read_text() for p in tmp_path.glob("*.ptx"))
    cubin = b"".join(p.read_bytes() for p in tmp_path.glob("*.cubin"))
    attrs = _nv_info_attrs(cubin)
    regs = max(v for a, v in attrs if a == 0x2F)
    frame = max((v for a, v in attrs if a == 0x11), default=0)
    return k, ptx, regs, frame


@pytest.mark.parametrize("q", ["bf16", "fp16"])
@pytest.mark.parametrize("bm", [16, 32])
@pytest.mark.parametrize("cvt", CVTS[1:])
def test_cvt_variants_compile(cvt, bm, q, tmp_path):
    """Each conversion variant compiles for sm_90a without spills; per warp and tile the PTX
    has the same MMAs and loads and the predicted split of the 272 e4m3 pairs between
    cvt.rn.f16x2.e4m3x2 and the integer sequences (K: 144 pairs = 72 words x (ASM_LO +
    ASM_HI); V: 32 pairs per column group, each one prmt + shr/and/and/or)."""
    from mla_cute_dsl.kernels.sm90_decode_fp8 import CVT_MODES, MAG_MASK

    k, ptx, regs, frame = _compile_ptx(tmp_path, q, bm, cvt=cvt)
    print(f"fp8reg cvt={cvt} q={q} BLOCK_M={bm}: {regs} registers, frame {frame} B, smem {k.smem_bytes()}")
    assert regs <= 255 and frame == 0, (regs, frame)
    assert "ld.local" not in ptx and "st.local" not in ptx
    m_atoms = bm // 16
    qk_alu, groups = CVT_MODES[cvt]
    n = lambda pat: len(re.findall(pat, ptx))  # noqa: E731
    assert n(r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.f16\.f16\.f32") == 136 * m_atoms
    assert n(r"cvt\.rn\.f16x2\.e4m3x2") == (0 if qk_alu else 144) + 32 * (4 - groups)
    assert n(MAG_MASK) == (144 if qk_alu else 0) + 32 * groups
    # V pairs: one 2-source prmt each (ALU groups); cvt groups keep their byte shuffles
    assert n(r"prmt\.b32 d, ") == 32 * groups
    assert n(r"ld\.shared\.b32") == 64 and n(r"ld\.shared\.v4\.b32") >= 18
    assert n("ldmatrix") == 40 * m_atoms
    # 2^8 folded: scale_log2 and scale_ln (K), 4 x 16 accumulators per ALU group (V)
    # (LLVM may sink some of the accumulator multiplies into both epilogue branches)
    n256 = n(r"0f43800000") - (2 if qk_alu else 0)
    assert 16 * groups * m_atoms <= n256 <= 32 * groups * m_atoms, n256
    if qk_alu:  # Q written in the ALU order with 16-bit stores (dims 2 apart are k 8 apart)
        assert n(r"st\.shared\.b16") >= 72 * m_atoms // 2


@pytest.mark.parametrize("cvt", ["f2fp", "pv_alu", "alu"])
@pytest.mark.parametrize("q_regs", [2, 4])
def test_q_regs_compile(cvt, q_regs, tmp_path):
    """BLOCK_M 16 with q_regs chunks of Q loaded once before the tile loop: 16 ldmatrix per
    chunk before the loop's first cp.async.wait_group, the rest inside; no spills."""
    k, ptx, regs, frame = _compile_ptx(tmp_path, "bf16", 16, cvt=cvt, q_regs=q_regs)
    print(f"fp8reg cvt={cvt} q_regs={q_regs}: {regs} registers, frame {frame} B")
    assert regs <= 255 and frame == 0, (regs, frame)
    assert "ld.local" not in ptx and "st.local" not in ptx
    head = ptx.split("cp.async.wait_group")[0]
    assert head.count("ldmatrix") == 4 * q_regs
    assert ptx.count("ldmatrix") == 40
    assert len(re.findall(r"bar\.sync|barrier\.sync", ptx)) == 6  # one more, before the loads


def test_q_regs_zero_keeps_ldmatrix_in_the_loop(tmp_path):
    k, ptx, regs, frame = _compile_ptx(tmp_path, "bf16", 16)
    assert ptx.split("cp.async.wait_group")[0].count("ldmatrix") == 0


@pytest.mark.parametrize("cvt,q_regs", [("pv_alu", 0), ("alu", 4)])
def test_kernel_cache_helper_variants(cvt, q_regs):
    from mla_cute_dsl.kernels import kernel_cache
    from mla_cute_dsl.kernels.sm90_decode_fp8 import get_partial_kernel_fp8

    fn = get_partial_kernel_fp8("bf16", 16, cvt=cvt, q_regs=q_regs)
    assert get_partial_kernel_fp8("bf16", 16, cvt=cvt, q_regs=q_regs) is fn
    assert kernel_cache.origin("partial_fp8reg", ("bf16", "fp8_e4m3", 16, None, 2, cvt, q_regs)) in (
        "compiled", "disk")
    assert get_partial_kernel_fp8("bf16", 16) is not fn
    with pytest.raises(ValueError):
        get_partial_kernel_fp8("bf16", 16, cvt="bogus")


# ---------------- softmax="local": 2 CTA barriers per tile ----------------


def test_local_softmax_owner_map():
    """softmax 'local' rescales the P A-fragment value (v0, v1, v2) of k-block kb by the
    factor of the warp that wrote those tokens: warp (2 kb + v2) % 4, because warp j's S
    columns are tokens 8j..8j+7 and 32+8j..32+8j+7 (mma partition, checked here), and A
    value v2 selects tokens 16 kb + 8 v2 + (0..7).  Rows: S row index r = v1 + 2 m."""
    from mla_cute_dsl.kernels.sm90_decode_fp8 import _acc_mn_view

    for bm in (16, 32):
        k = _kernel("bf16", bm)
        res = {}

        @cute.jit
        def probe():
            mma = k._tiled_mma()
            cS = cute.make_identity_tensor((bm, 64))
            for tid in cutlass.range_constexpr(0, k.num_threads, 1):
                thr = mma.get_slice(tid)
                t = _acc_mn_view(thr.partition_C(cS))
                res[("S", tid)] = ([t[r, 0][0] for r in range(cute.size(t.shape[0]))],
                                   [t[0, c][1] for c in range(cute.size(t.shape[1]))])
                a = thr.partition_A(cS)
                res[("A", tid)] = [[[a[v, m, kb] for kb in range(4)] for m in range(cute.size(a.shape[1]))]
                                   for v in range(8)]

        cute.compile(probe)
        owner = {}
        for tid in range(k.num_threads):
            w = tid // 32  # m_warps = 1: warp index = warp along N
            for col in res[("S", tid)][1]:
                owner.setdefault(col, set()).add(w)
        assert all(len(v) == 1 for v in owner.values()) and len(owner) == 64
        owner = {c: next(iter(v)) for c, v in owner.items()}
        assert all(owner[c] == (c // 8) % 4 for c in range(64))
        for tid in range(k.num_threads):
            rows = res[("S", tid)][0]
            for v in range(8):
                v1, v2 = (v >> 1) & 1, v >> 2
                for m, per_kb in enumerate(res[("A", tid)][v]):
                    for kb, (row, col) in enumerate(per_kb):
                        assert owner[col] == (2 * kb + v2) % 4
                        assert row == rows[v1 + 2 * m]


@pytest.mark.parametrize("cvt,bm", [("f2fp", 16), ("pv_alu", 16), ("alu", 16), ("f2fp", 32)])
def test_local_softmax_compiles(cvt, bm, tmp_path):
    """'local' drops one CTA barrier per tile (loop: 2; epilogue: 2), rescales P with 32 fp16
    multiplies per 16-row atom and tile, and fits without spills where it is recommended
    (BLOCK_M 16 with every cvt; BLOCK_M 32 only with f2fp -- the ALU variants spill there)."""
    k, ptx, regs, frame = _compile_ptx(tmp_path, "bf16", bm, cvt=cvt, softmax="local")
    print(f"fp8reg cvt={cvt} softmax=local BLOCK_M={bm}: {regs} registers, frame {frame} B")
    assert regs <= 255 and frame == 0, (regs, frame)
    assert "ld.local" not in ptx and "st.local" not in ptx
    assert len(re.findall(r"bar\.sync|barrier\.sync", ptx)) == 4
    assert len(re.findall(r"mul(\.rn)?\.f16 ", ptx)) + 2 * len(re.findall(r"mul(\.rn)?\.f16x2", ptx)) == 32 * (bm // 16)
    assert len(re.findall(r"mma\.sync", ptx)) == 136 * (bm // 16)


def test_local_softmax_validation():
    from mla_cute_dsl.kernels.sm90_decode_fp8 import MLADecodePartialFP8Reg, get_partial_kernel_fp8

    with pytest.raises(ValueError):
        MLADecodePartialFP8Reg(cutlass.BFloat16, cutlass.Float8E4M3FN, 16, softmax="global")
    with pytest.raises(ValueError):
        get_partial_kernel_fp8("bf16", 16, softmax="global")
