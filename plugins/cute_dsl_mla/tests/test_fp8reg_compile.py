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


def _kernel(q="bf16", bm=16, s_accs=1):
    from mla_cute_dsl.kernels.sm90_decode_fp8 import MLADecodePartialFP8Reg

    dt = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16}[q]
    return MLADecodePartialFP8Reg(dt, cutlass.Float8E4M3FN, bm, s_accs=s_accs)


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


@pytest.mark.parametrize("q,s_accs", [("bf16", 1), ("fp16", 1), ("bf16", 2), ("bf16", 4)])
@pytest.mark.parametrize("bm", [16, 32])
def test_compiles_registers_and_ptx_counts(q, bm, s_accs, tmp_path):
    """Also with s_accs 2 / 4 independent S accumulators: the same MMAs, conversions and loads, no spills; the
    partial sums add up in s_accs - 1 extra fp32 adds per S value."""
    from mla_cute_dsl.kernels import api

    k = _kernel(q, bm, s_accs)
    cute.compile(k, *api._fake_args_partial(q, "fp8_e4m3"),
                 options=api.COMPILE_OPTIONS + f" --keep-ptx --keep-cubin --dump-dir={tmp_path}")
    ptx = "".join(p.read_text() for p in tmp_path.glob("*.ptx"))
    assert ptx.count("griddepcontrol.launch_dependents;") == 1  # the PDL trigger for the combine kernel
    cubin = b"".join(p.read_bytes() for p in tmp_path.glob("*.cubin"))
    attrs = _nv_info_attrs(cubin)
    regs = max(v for a, v in attrs if a == 0x2F)  # EIATTR_REGCOUNT
    frame = max((v for a, v in attrs if a == 0x11), default=0)  # EIATTR_FRAME_SIZE
    print(f"fp8reg q={q} BLOCK_M={bm} s_accs={s_accs}: {regs} registers, frame {frame} B")
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


def test_s_accs_keys_and_refusals():
    """s_accs 1 keeps the verified kernel's cache key (no tag); 2 / 4 add one tag the builder reads back; any other
    count is refused before compiling."""
    from mla_cute_dsl.kernels.sm90_decode_fp8 import s_accs_from_tags, s_accs_spec

    assert s_accs_spec(1) == () and s_accs_from_tags(()) == 1
    for n in (2, 4):
        assert s_accs_from_tags(("partial_bf16",) + s_accs_spec(n)) == n
    with pytest.raises(ValueError, match="s_accs"):
        _kernel("bf16", 16, 3)


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
