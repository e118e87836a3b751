"""CPU tests (no GPU) of the WGMMA partial kernel prototype (sm90_wgmma_decode).

Level 1: smem layouts and WGMMA tiled MMAs are built, and the two facts the
         design rests on hold (V^T view = K tile bytes; S's C fragment lists a
         thread's values in the RS A-fragment order).
Level 2+3: the whole kernel (mainloop + epilogue writing partial O / lse)
         compiles for sm_90a with fake tensors, through the kernel cache.
fp8 e4m3 KV (raw fp8 ring, converted into the fp16 sK tile): the same checks
plus the conversion's element mapping and its PTX (cvt, fences, registers).
Nothing here runs the kernel: tests/test_wgmma_gpu.py does, on an SM90 GPU.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from test_kernel_compile import _has_cutlass  # noqa: E402  (same directory: pytest rootdir import)


pytestmark = pytest.mark.skipif(not _has_cutlass(), reason="nvidia-cutlass-dsl not installed")

if _has_cutlass():
    # module-level names: the probe kernel below has string annotations
    # (``from __future__ import annotations``) that the DSL resolves here
    import cutlass
    import cutlass.cute as cute


def _kernel(q="bf16", kv=None):
    import cutlass

    from mla_cute_dsl.kernels.sm90_wgmma_decode import MLADecodePartialWGMMA

    dt = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16, "fp8_e4m3": cutlass.Float8E4M3FN}
    return MLADecodePartialWGMMA(dt[q], dt[kv or q])


@pytest.mark.parametrize("kv", [None, "fp8_e4m3"])
def test_level1_layouts_and_tiled_mmas(kv):
    """Layouts + tiled MMAs trace; the V view and the P re-typing are exact
    (fp8 KV: fp16 MMAs, one sK buffer)."""
    import cutlass
    import cutlass.cute as cute

    from mla_cute_dsl.kernels import sm90_wgmma_decode as W

    k = _kernel("bf16", kv)
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
            for d in range(0, W.D_V, 5) for t in range(W.BLOCK_N) for st in range(k.k_bufs)
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
    assert k.k_bufs == (1 if kv else 2)
    assert facts["cosize"] == (64 * 576, k.k_bufs * 64 * 576, 64 * 64)
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
        # fp8 KV: sQ fp16 + one fp16 sK + 2 raw fp8 tiles (= one 16-bit tile) + sP + sScale
        k8 = _kernel(q, "fp8_e4m3")
        assert (k8.k_bufs, k8.raw_stages) == (1, 2)
        n8 = k8.smem_bytes()
        assert n8 == 73728 + 73728 + 2 * 36864 + 8192 + 256 == n
        assert n8 <= W.SMEM_LIMIT
        # a third raw stage (or a second fp16 sK) would not fit
        assert n8 + 36864 > W.SMEM_LIMIT


def test_unsupported_specializations_are_refused():
    import cutlass

    from mla_cute_dsl.kernels.sm90_wgmma_decode import MLADecodePartialWGMMA, get_partial_kernel_wgmma

    with pytest.raises(NotImplementedError):
        MLADecodePartialWGMMA(cutlass.BFloat16, cutlass.Float16)
    with pytest.raises(NotImplementedError):
        MLADecodePartialWGMMA(cutlass.BFloat16, cutlass.Float8E5M2)
    with pytest.raises(ValueError):
        MLADecodePartialWGMMA(cutlass.BFloat16, cutlass.BFloat16, 32)
    with pytest.raises(ValueError):
        get_partial_kernel_wgmma("bf16", "fp16")  # refused before any compile
    k = MLADecodePartialWGMMA(cutlass.BFloat16, cutlass.Float8E4M3FN)
    assert (k.is_fp8, k.q_cvt, k.mma_dtype) == (True, True, cutlass.Float16)
    k = MLADecodePartialWGMMA(cutlass.Float16, cutlass.Float8E4M3FN)
    assert (k.is_fp8, k.q_cvt, k.mma_dtype) == (True, False, cutlass.Float16)


@pytest.mark.parametrize("q", ["bf16", "fp16"])
def test_level3_full_kernel_compiles(q):
    """Mainloop (SS QK, softmax, RS / SS PV, cp.async double buffer) and the
    epilogue (partial O / lse and direct out / lse) compile for sm_90a."""
    from mla_cute_dsl.kernels import api
    from mla_cute_dsl.kernels.sm90_wgmma_decode import get_partial_kernel_wgmma

    fn = get_partial_kernel_wgmma(q)
    assert fn is not None
    assert get_partial_kernel_wgmma(q) is fn  # in-process cache hit
    assert get_partial_kernel_wgmma(q, q) is fn  # same key as the single-argument form
    # the default path is untouched: api still builds the mma.sync kernel
    assert api.get_partial_kernel(q, q, 64) is not fn


@pytest.mark.parametrize("q", ["bf16", "fp16"])
def test_level3_fp8_kv_kernel_compiles(q):
    """fp8 e4m3 KV: raw ring + conversion into the fp16 sK, fp16 WGMMAs, q
    converted on load (bf16) or cp.async'ed (fp16), compile for sm_90a."""
    from mla_cute_dsl.kernels import kernel_cache
    from mla_cute_dsl.kernels.sm90_wgmma_decode import get_partial_kernel_wgmma

    fn = get_partial_kernel_wgmma(q, "fp8_e4m3")
    assert fn is not None
    assert get_partial_kernel_wgmma(q, "fp8_e4m3") is fn
    assert kernel_cache.origin("partial_wgmma", (q, "fp8_e4m3", 64)) in ("compiled", "disk")


# ----------------------------------------------------------------------------
# Review checks (no GPU): what the hardware will read vs what the kernel writes
# ----------------------------------------------------------------------------


def _sw128(byte_off: int) -> int:
    """Hardware SW128 on a byte address (smem base 1024-aligned): bits [4,7) ^= bits [7,10)."""
    return byte_off ^ (((byte_off >> 7) & 7) << 4)


@pytest.mark.parametrize("kv", [None, "fp8_e4m3"])
def test_layouts_are_the_canonical_gmma_sw128_layouts(kv):
    """The bytes cp.async / st.shared write (sQ, sK, sP outer layouts, 2 B per
    element; the swizzle sits in the pointer) are where a WGMMA descriptor with
    SW128, SBO = 1024 B (K-major) resp. LBO = 8192 B, SBO = 1024 B (MN-major)
    reads them -- the canonical formulas of the PTX ISA, so no DSL code is
    trusted here.  test_ptx_structure checks the descriptors carry those values."""
    import cutlass.cute as cute

    from mla_cute_dsl.kernels import sm90_wgmma_decode as W

    k = _kernel("bf16", kv)
    bad = {}

    @cute.jit
    def probe():
        sQ, sK, sP, sV = k._smem_layouts()

        def kmajor(r, c):  # K-major SW128: 8-row core groups SBO apart, 64-col blocks 8 KB apart
            return (r // 8) * 1024 + (r % 8) * 128 + (c // 64) * (8 * 1024 * (W.BLOCK_N // 64)) + (c % 64) * 2

        bad["q"] = sum(
            sQ.outer((r, c)) * 2 != (r // 8) * 1024 + (r % 8) * 128 + (c // 64) * W.BLOCK_M * 128 + (c % 64) * 2
            for r in range(W.BLOCK_M) for c in range(0, W.D_QK, 3)
        )
        bad["k"] = sum(
            sK.outer((t, d, st)) * 2 != st * W.BLOCK_N * W.D_QK * 2 + kmajor(t, d)
            for t in range(W.BLOCK_N) for d in range(0, W.D_QK, 3) for st in range(k.k_bufs)
        )
        bad["p"] = sum(
            sP.outer((r, c)) * 2 != (r // 8) * 1024 + (r % 8) * 128 + c * 2
            for r in range(W.BLOCK_M) for c in range(W.BLOCK_N)
        )
        # MN-major SW128 B operand (n = V dim, k = token): 64-element column
        # blocks LBO = 8192 B apart, 8-token core groups SBO = 1024 B apart
        bad["v"] = sum(
            sV.outer((d, t, st)) * 2
            != st * W.BLOCK_N * W.D_QK * 2 + (d // 64) * 8192 + (t // 8) * 1024 + (t % 8) * 128 + (d % 64) * 2
            for d in range(0, W.D_V, 3) for t in range(W.BLOCK_N) for st in range(k.k_bufs)
        )
        # 1024 B alignment of every stage / V half / k-block start a descriptor points at
        bad["align"] = sum(
            (sK.outer((0, 64 * j, st)) * 2) % 1024 != 0 or (sV.outer((256 * w, 0, st)) * 2) % 1024 != 0
            for j in range(W.D_QK // 64) for st in range(k.k_bufs) for w in range(2)
        )

    cute.compile(probe)
    assert bad == {"q": 0, "k": 0, "p": 0, "v": 0, "align": 0}


def test_sP_store_is_32bit_and_bank_conflict_free():
    """WG0 writes P (C fragment of S) to sP: per store instruction (one 32-bit
    word = 2 adjacent bf16 per thread) the 32 lanes of a warp hit 32 distinct
    banks after the SW128 swizzle."""
    import cutlass
    import cutlass.cute as cute

    from mla_cute_dsl.kernels import sm90_wgmma_decode as W

    k = _kernel()
    res = {}

    @cute.jit
    def probe():
        _, _, sP, _ = k._smem_layouts()
        mma_s, _, _ = k._tiled_mmas()
        cS = cute.make_identity_tensor((W.BLOCK_M, W.BLOCK_N))
        for warp in cutlass.range_constexpr(4):  # static thread ids
            for lane in cutlass.range_constexpr(32):
                tc = mma_s.get_slice(warp * 32 + lane).partition_C(cS)
                res[(warp, lane)] = [int(sP.outer(tc[i])) * 2 for i in range(cute.size(tc))]

    cute.compile(probe)
    pairs_ok, conflicts = True, 0
    for warp in range(4):
        words = []  # per lane: byte address of each 32-bit word, in value order
        for lane in range(32):
            a = [_sw128(x) for x in res[(warp, lane)]]
            pairs_ok &= all(a[i + 1] == a[i] + 2 and a[i] % 4 == 0 for i in range(0, len(a), 2))
            words.append(a[0::2])
        for w in range(len(words[0])):
            conflicts += 32 - len({(words[lane][w] // 4) % 32 for lane in range(32)})
    assert (pairs_ok, conflicts) == (True, 0)


def test_pointer_swizzle_is_byte_level_sw128(tmp_path):
    """The DSL applies the pointer swizzle S<3,4,3> to *byte* addresses (= the
    hardware's SW128), not to element offsets: a store to sQ[1, 0] (row 1 =
    byte 128) lands at byte 144.  Element-level S<3,4,3> would give 128 and
    every cp.async write would disagree with what WGMMA reads."""
    import re

    from cutlass.cute.nvgpu import warpgroup
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    mt = cutlass.BFloat16

    class Probe:
        @cute.jit
        def __call__(self, g: cute.Tensor, stream):
            atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, mt)
            lay = cute.tile_to_shape(atom, (64, 576), (0, 1))

            @cute.struct
            class SS:
                sQ: cute.struct.Align[cute.struct.MemRange[mt, cute.cosize(lay)], 1024]

            self.kernel(g, lay, SS).launch(grid=[1, 1, 1], block=[32, 1, 1], stream=stream)

        @cute.kernel
        def kernel(self, g: cute.Tensor, lay: cute.ComposedLayout, SS: cutlass.Constexpr):
            st = cutlass.utils.SmemAllocator().allocate(SS)
            sQ = st.sQ.get_tensor(lay.outer, swizzle=lay.inner)
            t, _, _ = cute.arch.thread_idx()
            sQ[1, 0] = g[t]

    g = make_fake_compact_tensor(mt, (cute.sym_int(),), assumed_align=16)
    cute.compile(Probe(), g, make_fake_stream(),
                 options=f"--enable-tvm-ffi --keep-ptx --dump-dir={tmp_path}")
    ptx = "".join(p.read_text() for p in tmp_path.glob("*.ptx"))
    # base + 128, then xor 16 (row 1 -> 16 B chunk 1)
    assert re.search(r"add\.s32\s+(%r\d+), %r\d+, 128;\s+xor\.b32\s+%r\d+, \1, 16;", ptx), ptx[-800:]


def _nv_info_attrs(cubin: bytes):
    """(attr, value) of the u32-pair attributes in the cubin's .nv.info sections."""
    import struct

    shoff = struct.unpack_from("<Q", cubin, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    secs = [struct.unpack_from("<IIQQQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    stro = secs[shstrndx][4]
    out = []
    for name, _typ, _fl, _addr, off, size in secs:
        nm = cubin[stro + name: cubin.index(b"\0", stro + name)].decode()
        if nm != ".nv.info":
            continue
        d, i = cubin[off: off + size], 0
        while i + 2 <= len(d):
            fmt, attr = d[i], d[i + 1]
            i += 2
            if fmt == 4:  # EIFMT_SVAL: u16 size + payload
                sz = struct.unpack_from("<H", d, i)[0]
                val = d[i + 2: i + 2 + sz]
                i += 2 + sz
                if sz == 8:
                    out.append((attr, struct.unpack_from("<I", val, 4)[0]))
            elif fmt == 3:
                i += 2
            elif fmt == 2:
                i += 1
    return out


def _sw128_descriptors(ptx):
    """(LBO, SBO, base offset) in bytes of every SW128 WGMMA shared-memory descriptor the PTX builds
    from a constant (the `or.b64` of the layout bits into the address)."""
    import re

    descs = set()
    for c in re.findall(r"or\.b64\s+%rd\d+, %rd\d+, (\d+);", ptx):
        v = int(c)
        if v >> 62 == 1:  # SW128
            descs.add((((v >> 16) & 0x3FFF) * 16, ((v >> 32) & 0x3FFF) * 16, (v >> 49) & 7))
    return descs


def _compile_dump(q, kv, tmp_path):
    """Compile one specialization with --keep-ptx/--keep-cubin; (ptx, regs, stack frame bytes)."""
    import cutlass.cute as cute

    from mla_cute_dsl.kernels import api

    k = _kernel(q, kv)
    cute.compile(k, *api._fake_args_partial(q, kv or q),
                 options=api.COMPILE_OPTIONS + f" --keep-ptx --keep-cubin --dump-dir={tmp_path}")
    ptx = "".join(p.read_text() for p in tmp_path.glob("*.ptx"))
    cubin = b"".join(p.read_bytes() for p in tmp_path.glob("*.cubin"))
    attrs = _nv_info_attrs(cubin)
    regs = max(v for a, v in attrs if a == 0x2F)  # EIATTR_REGCOUNT
    frame = max((v for a, v in attrs if a == 0x11), default=0)  # EIATTR_FRAME_SIZE
    return ptx, regs, frame


@pytest.mark.parametrize("q,kv", [("bf16", None), ("fp16", None), ("bf16", "fp8_e4m3"),
                                  ("fp16", "fp8_e4m3")])
def test_ptx_structure_registers_and_descriptors(q, kv, tmp_path):
    """What the compiled kernel does, read from its PTX and cubin:
    registers <= 255 with no stack frame (no spills), 256 threads, 36 QK + 8 PV
    WGMMAs, SW128 descriptors with the canonical strides, and the fence /
    barrier sequence of the mainloop.  fp8 KV: fp16 WGMMAs, the conversion
    (cvt.rn.f16x2.e4m3x2, one per 2 elements) and its fence before the barrier
    that releases the WGMMAs."""
    import re

    ptx, regs, frame = _compile_dump(q, kv, tmp_path)
    assert ptx.count("griddepcontrol.launch_dependents;") == 1  # the PDL trigger for the combine kernel
    assert regs <= 255 and frame == 0, (regs, frame)
    assert ".reqntid 256, 1, 1" in ptx

    t = "f16" if (kv or q) != "bf16" else "bf16"
    assert len(re.findall(rf"wgmma\.mma_async\.sync\.aligned\.m64n64k16\.f32\.{t}\.{t}", ptx)) == 36
    assert len(re.findall(rf"wgmma\.mma_async\.sync\.aligned\.m64n256k16\.f32\.{t}\.{t}", ptx)) == 8
    # QK: scale-d is a predicate from a constant: exactly one 0 (first k-step)
    # -> checked through the operand lists: RS form has a register A operand
    assert len(re.findall(r"m64n256k16[^\n]*\}, \{%r\d+, %r\d+, %r\d+, %r\d+\}, %rd\d+, p, 1,  1, 1;", ptx)) == 4
    assert len(re.findall(r"m64n256k16[^\n]*\}, %rd\d+, %rd\d+, p, 1,  1, 0, 1;", ptx)) == 4
    assert len(re.findall(r"m64n64k16[^\n]*\}, %rd\d+, %rd\d+, p, 1,  1, 0, 0;", ptx)) == 36

    descs = _sw128_descriptors(ptx)
    # (LBO, SBO, base offset): K-major Q / K / P (LBO unused), MN-major V
    assert descs == {(16, 1024, 0), (8192, 1024, 0)}, descs

    flat = re.sub(r"\s+", " ", ptx)
    if kv is None:
        # mainloop top: cp.async writes landed -> async-proxy fence -> CTA barrier
        assert re.search(r"cp\.async\.wait_group 0; fence\.proxy\.async\.shared::cta; bar\.sync 0;", flat)
        assert "cvt.rn.f16x2.e4m3x2" not in flat
    else:
        # raw tile landed -> barrier (no fence: the raw ring is read by ld.shared, generic proxy)
        assert "cp.async.wait_group 0; bar.sync 0;" in flat
        # conversion: 144 elements per thread and tile = 18 x (64-bit ld.shared of 8 fp8,
        # 4 cvt.rn.f16x2.e4m3x2, 128-bit st.shared); no other path (e.g. via f32)
        assert flat.count("cvt.rn.f16x2.e4m3x2") == 72
        assert flat.count("ld.shared.v2.b32") == 18
        assert not re.search(r"cvt\.[a-z.]*e4m3 |cvt\.f32\.e4m3", flat)
        # raw ring: 9 cp.async of 16 B per thread per tile (prologue + loop), and Q: cp.async
        # for fp16 q (18), else 18 x (128-bit ld.global, cvt bf16 -> f32 -> f16, st.shared)
        n_q_cp = 18 if q == "fp16" else 0
        assert flat.count("cp.async.cg.shared.global") == 2 * 9 + n_q_cp
        # 128-bit st.shared: 18 converted K chunks + 18 Q chunks (bf16 q: converted q;
        # fp16 q: the zero fill of rows >= R, the cp.async path's else branch)
        assert flat.count("st.shared.v4.b32") == 18 + 18
        if q == "bf16":
            assert flat.count("ld.global.v4") == 18 and flat.count("cvt.f32.bf16") == 144
        # rows past kv_len: the converted values are selected to 0 (not multiplied: NaN tails)
        assert flat.count("selp.b32") >= 72
        # last converted st.shared -> async-proxy fence -> barrier -> WGMMAs
        m = re.search(r"st\.shared\.v4\.b32 \[[^\]]*\], \{[^}]*\}; fence\.proxy\.async\.shared::cta; "
                      r"bar\.sync 0;", flat)
        assert m, "conversion: st.shared -> fence -> barrier"
        # ... and the next thing WG0 does is its QK WGMMAs (no smem write or barrier between)
        gap = flat[m.end(): flat.index("wgmma.fence", m.end())]
        assert "st.shared" not in gap and "bar." not in gap, gap
    assert flat.count("fence.proxy.async") == 2
    # P handoff: st.shared of P -> fence -> arrive; WG1 syncs on the same barrier
    assert re.search(r"st\.shared\.b32 \[%r\d+\], %r\d+; fence\.proxy\.async\.shared::cta; "
                     r"(// [^;]*?)?bar\.arrive 1, 256;", flat), "P fence/arrive"
    assert "bar.sync 1, 256;" in flat
    assert flat.count("bar.arrive") == 1 and flat.count("bar.sync 1,") == 1


def test_fp8_conversion_copies_map_each_element_once():
    """The fp8 path's copies agree on a 64 x 576 tile: the cp.async of the raw
    ring covers each element exactly once (all 256 threads), and for a sample
    of threads from every warp the ld.shared (fp8), st.shared (fp16) and the
    converting Q load (ld.global q) partitions list the same (row, col) at
    every position, so the conversion is element-wise, and each 8-element
    chunk m lies in the one row the tail mask tests."""
    import cutlass
    import cutlass.cute as cute

    from mla_cute_dsl.kernels import sm90_wgmma_decode as W

    k = _kernel("bf16", "fp8_e4m3")
    res = {}

    @cute.jit
    def probe():
        g2s_raw, s2r_raw, r2s, g2r_q = k._fp8_copies()
        c = cute.make_identity_tensor((W.BLOCK_N, W.D_QK))
        # (comprehensions only: a plain `for` over range() would be traced as a device loop)
        cps, same, n_pos, rows_ok = [], True, set(), True
        for t in cutlass.range_constexpr(W.NUM_THREADS):  # static thread ids
            # cp.async: first element of each 16-element vector (contiguous: value layout (1, 16))
            a = g2s_raw.get_slice(t).partition_D(c)
            res["vec"] = cute.size(a.shape[0])
            cps += [tuple(a[0, m, k]) for m in range(cute.size(a.shape[1])) for k in range(cute.size(a.shape[2]))]
        for t in cutlass.range_constexpr(0, W.NUM_THREADS, 9):  # 29 threads: every warp, varied lanes
            src = s2r_raw.get_slice(t).partition_S(c)
            dst = r2s.get_slice(t).partition_D(c)
            qs = g2r_q.get_slice(t).partition_S(c)
            n_pos |= {(cute.size(src), cute.size(dst), cute.size(qs))}
            same &= all(src[i] == dst[i] and dst[i] == qs[i] for i in range(cute.size(dst)))
            # the row mask uses one row per chunk m (tCcK[0, m, 0]): every value of chunk m
            # of this thread is in row t // 8 + 32 m
            rows_ok &= all(dst[v, m, k][0] == t // 8 + 32 * m for v in range(cute.size(dst.shape[0]))
                           for m in range(cute.size(dst.shape[1])) for k in range(cute.size(dst.shape[2])))
        res["cps"], res["same"], res["n_pos"], res["rows_ok"] = cps, same, n_pos, rows_ok

    cute.compile(probe)
    cps = res["cps"]
    assert res["vec"] == 16 and all(col % 16 == 0 for _, col in cps)
    assert len(cps) == len(set(cps)) == W.BLOCK_N * W.D_QK // 16  # each element once
    assert res["same"] is True
    assert res["n_pos"] == {(144, 144, 144)}  # 64 * 576 / 256 elements per thread
    assert res["rows_ok"] is True


# ----------------------------------------------------------------------------
# Seesaw schedule (MLADecodePartialWGMMASeesaw, branch wgmma-overlap): both
# warpgroups compute S for alternate KV tiles and exchange P through the dead
# RoPE columns of their K tiles; per-warpgroup cp.async loads complete on mbarriers.
# ----------------------------------------------------------------------------


def _seesaw(q="bf16", kv=None, l2_prefetch=None):
    """The seesaw kernel object; ``l2_prefetch`` None: the getter's default for the cache dtype."""
    import cutlass

    from mla_cute_dsl.kernels.sm90_wgmma_decode import MLADecodePartialWGMMASeesaw, seesaw_l2_prefetch_default

    dt = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16, "fp8_e4m3": cutlass.Float8E4M3FN}
    if l2_prefetch is None:
        l2_prefetch = seesaw_l2_prefetch_default(kv or q)
    return MLADecodePartialWGMMASeesaw(dt[q], dt[kv or q], l2_prefetch=l2_prefetch)


def test_seesaw_schedule_tables_are_consistent():
    """Who loads what and in which order the owner issues QK: for either owner the two
    warpgroups' blocks tile the 9 64-column blocks of a K tile exactly once; WG w's V half
    (blocks 4w..4w+3, the only columns it reads in P V) is always loaded by WG w; the
    RoPE block (where the owner writes P and the non-owner reads it) is loaded by the
    non-owner; the owner's QK issues its own blocks' 16 k-steps first, then the rest."""
    from mla_cute_dsl.kernels import sm90_wgmma_decode as W

    for owner in (0, 1):
        own = W.SEESAW_LOAD_BLOCKS[owner][0]
        other = W.SEESAW_LOAD_BLOCKS[1 - owner][1]
        assert sorted(own + other) == list(range(9))
        assert 8 in other and 8 not in own
        first, rest = W.SEESAW_QK_ORDER[owner]
        assert sorted(first + rest) == list(range(36))
        assert sorted(first) == [4 * c + i for c in own for i in range(4)]
        assert sorted(rest) == [4 * c + i for c in other for i in range(4)]
    for w in (0, 1):
        for role in (0, 1):
            assert set(range(4 * w, 4 * w + 4)) <= set(W.SEESAW_LOAD_BLOCKS[w][role])
            assert not set(range(4 * (1 - w), 4 * (1 - w) + 4)) & set(W.SEESAW_LOAD_BLOCKS[w][role])
    assert W.BAR_P_OF == (1, 2)


def test_seesaw_smem_budget_and_refusals():
    import cutlass

    from mla_cute_dsl.kernels import sm90_wgmma_decode as W

    for q in ("bf16", "fp16"):
        k = _seesaw(q)
        assert k.k_bufs == 2
        # sQ + 2 sK (P lives over each K tile's RoPE columns) + sScale/sMax/sL + 4 mbarriers
        assert k.smem_bytes() == 73728 + 2 * 73728 + 3 * 2 * 64 * 4 + 4 * 8 == 222752
        assert k.smem_bytes() <= W.SMEM_LIMIT
        # fp8 KV (branch wgmma-fp8-seesaw): the same two fp16 K tiles, no raw fp8 ring in smem
        k8 = _seesaw(q, "fp8_e4m3")
        assert (k8.is_fp8, k8.mma_dtype, k8.k_bufs, k8.raw_stages) == (True, cutlass.Float16, 2, 0)
        assert k8.q_cvt == (q == "bf16")
        assert k8.smem_bytes() == 222752
    with pytest.raises(NotImplementedError):
        W.MLADecodePartialWGMMASeesaw(cutlass.BFloat16, cutlass.Float16)
    with pytest.raises(NotImplementedError):
        W.MLADecodePartialWGMMASeesaw(cutlass.BFloat16, cutlass.Float8E5M2)
    with pytest.raises(ValueError):
        W.get_partial_kernel_wgmma_seesaw("bf16", "fp16")  # refused before any compile
    # the one-S fp8 kernel keeps its raw ring (unchanged, still selectable)
    k1 = W.MLADecodePartialWGMMA(cutlass.BFloat16, cutlass.Float8E4M3FN)
    assert (k1.k_bufs, k1.raw_stages, k1.smem_bytes()) == (1, 2, 229632)


def test_seesaw_p_over_rope_columns_and_wg_loads():
    """(1) sP of buffer j (the kernel's pointer offset j * 64 * 576 + 8 * 64 * 64 elements
    with the sP layout) addresses exactly the bytes of sK[r, 512 + c, j]: P (row r, token c)
    replaces K's RoPE element (token r, dim 512 + c), a 1024-aligned 8 KB block, so the
    pointer swizzle phase is the same.  (2) The per-warpgroup cp.async partition
    (128 threads) gives thread t, row pass m, block c the row t // 8 + 16 m and 8
    contiguous columns inside [64 c, 64 c + 64), and covers every element of a block
    exactly once."""
    import cutlass
    import cutlass.cute as cute

    from mla_cute_dsl.kernels import sm90_wgmma_decode as W

    k = _seesaw()
    res = {}

    @cute.jit
    def probe():
        _, sK, sP, _ = k._smem_layouts()
        p_off = (W.D_QK // 64 - 1) * W.BLOCK_N * 64
        res["p_bad"] = sum(
            sK.outer((r, 512 + c, j)) != j * W.BLOCK_N * W.D_QK + p_off + sP.outer((r, c))
            for r in range(W.BLOCK_M) for c in range(W.BLOCK_N) for j in range(2)
        )
        res["p_align"] = [(j * W.BLOCK_N * W.D_QK + p_off) * 2 % 1024 for j in range(2)]
        cp = k._wg_copy()
        c = cute.make_identity_tensor((W.BLOCK_N, W.D_QK))
        # (comprehensions only: a plain `for` over range() would be traced as a device loop)
        for t in cutlass.range_constexpr(W.WG_THREADS):  # static thread ids
            a = cp.get_slice(t).partition_S(c)
            n_v, n_m, n_b = cute.size(a.shape[0]), cute.size(a.shape[1]), cute.size(a.shape[2])
            res[("shape", t)] = (n_v, n_m, n_b)
            res[("elems", t)] = [[[tuple(a[v, m, blk]) for v in range(n_v)] for blk in range(n_b)]
                                 for m in range(n_m)]

    cute.compile(probe)
    assert res["p_bad"] == 0
    assert res["p_align"] == [0, 0]
    cover, rows_ok, cols_ok = [], True, True
    for t in range(W.WG_THREADS):
        assert res[("shape", t)] == (8, 4, 9)
        for m, per_m in enumerate(res[("elems", t)]):
            for blk, vals in enumerate(per_m):
                rows_ok &= all(r == t // 8 + 16 * m for r, _ in vals)
                cols = [col for _, col in vals]
                cols_ok &= cols == list(range(cols[0], cols[0] + 8)) and 64 * blk <= cols[0] < 64 * blk + 57
                cover += vals
    assert (rows_ok, cols_ok) == (True, True)
    assert len(cover) == len(set(cover)) == W.BLOCK_N * W.D_QK


@pytest.mark.parametrize("q", ["bf16", "fp16"])
def test_seesaw_kernel_compiles(q):
    from mla_cute_dsl.kernels import kernel_cache
    from mla_cute_dsl.kernels.sm90_wgmma_decode import get_partial_kernel_wgmma, get_partial_kernel_wgmma_seesaw

    fn = get_partial_kernel_wgmma_seesaw(q)
    assert fn is not None
    assert get_partial_kernel_wgmma_seesaw(q, q) is fn  # in-process cache hit, same key
    assert kernel_cache.origin("partial_wgmma_seesaw", (q, q, 64)) in ("compiled", "disk")
    assert get_partial_kernel_wgmma(q) is not fn  # the one-S kernel stays selectable


@pytest.mark.parametrize("kv", [None, "fp8_e4m3"])
def test_seesaw_l2_prefetch_option(kv, tmp_path):
    """The non-default value of ``l2_prefetch`` for each cache dtype (on for bf16, off for fp8; the
    structure tests cover the defaults): on adds exactly thread 0's two bulk prefetches of the next
    pair's tiles, one whole 64-token tile each (73,728 B bf16, 36,864 B fp8); off has none (the
    cache keys of both values: test_seesaw_l2_prefetch_default_per_cache_dtype)."""
    import re

    from mla_cute_dsl.kernels.sm90_wgmma_decode import seesaw_l2_prefetch_default

    on = not seesaw_l2_prefetch_default(kv or "bf16")
    ptx, regs, frame = _compile_dump_seesaw("bf16", tmp_path, kv, l2_prefetch=on)
    assert regs <= 255 and frame == 0, (regs, frame)
    flat = re.sub(r"\s+", " ", ptx)
    pf = re.findall(r"cp\.async\.bulk\.prefetch\.L2\.global \[%rd\d+\], (%r\d+);", flat)
    if on:
        size = 36864 if kv else 73728
        assert len(pf) == 2 and all(f"mov.b32 {r}, {size};" in flat for r in pf), pf
    else:
        assert "cp.async.bulk.prefetch" not in flat


@pytest.mark.parametrize("flags,expected", [((), False), (("l2pf",), True)])
def test_seesaw_builder_turns_the_key_into_the_kernel(flags, expected, monkeypatch):
    """The kernel cache builds from the key alone: its "l2pf" flag must reach the kernel object (a
    builder that dropped it would compile the same kernel under both keys, and the GPU bitwise test
    would not notice); unknown flags are refused."""
    import cutlass.cute as cute

    from mla_cute_dsl.kernels import sm90_wgmma_decode as W

    built = []  # the kernel objects handed to the compiler (not compiled: their settings are checked)
    monkeypatch.setattr(cute, "compile", lambda k, *a, **kw: built.append(k))
    W._build_partial_wgmma_seesaw("bf16", "fp8_e4m3", 64, *flags)
    assert len(built) == 1 and built[0].l2_prefetch is expected and built[0].is_fp8
    with pytest.raises(ValueError, match="unknown flags"):
        W._build_partial_wgmma_seesaw("bf16", "bf16", 64, "nopf")


def test_seesaw_l2_prefetch_default_per_cache_dtype(monkeypatch):
    """The getter's default: prefetch with an fp8 cache (a little faster on the H200), none with a
    16-bit cache (up to 18% faster without at B128 H128); an explicit value wins."""
    from mla_cute_dsl.kernels import kernel_cache
    from mla_cute_dsl.kernels.sm90_wgmma_decode import get_partial_kernel_wgmma_seesaw, seesaw_l2_prefetch_default

    assert seesaw_l2_prefetch_default("fp8_e4m3") is True
    assert seesaw_l2_prefetch_default("bf16") is False and seesaw_l2_prefetch_default("fp16") is False
    built = []  # the kernel cache keys asked for (no compile: the keys are what is checked)
    monkeypatch.setattr(kernel_cache, "get_or_build", lambda kind, spec, build: built.append((kind, spec)))
    get_partial_kernel_wgmma_seesaw("bf16")
    get_partial_kernel_wgmma_seesaw("bf16", "fp8_e4m3")
    get_partial_kernel_wgmma_seesaw("bf16", "fp8_e4m3", l2_prefetch=False)
    get_partial_kernel_wgmma_seesaw("fp16", l2_prefetch=True)
    assert built == [("partial_wgmma_seesaw", ("bf16", "bf16", 64)),
                     ("partial_wgmma_seesaw", ("bf16", "fp8_e4m3", 64, "l2pf")),
                     ("partial_wgmma_seesaw", ("bf16", "fp8_e4m3", 64)),
                     ("partial_wgmma_seesaw", ("fp16", "fp16", 64, "l2pf"))]


def _compile_dump_seesaw(q, tmp_path, kv=None, l2_prefetch=None):
    import cutlass.cute as cute

    from mla_cute_dsl.kernels import api

    k = _seesaw(q, kv, l2_prefetch)
    cute.compile(k, *api._fake_args_partial(q, kv or q),
                 options=api.COMPILE_OPTIONS + f" --keep-ptx --keep-cubin --dump-dir={tmp_path}")
    ptx = "".join(p.read_text() for p in tmp_path.glob("*.ptx"))
    cubin = b"".join(p.read_bytes() for p in tmp_path.glob("*.cubin"))
    attrs = _nv_info_attrs(cubin)
    regs = max(v for a, v in attrs if a == 0x2F)  # EIATTR_REGCOUNT
    frame = max((v for a, v in attrs if a == 0x11), default=0)  # EIATTR_FRAME_SIZE
    return ptx, regs, frame


@pytest.mark.parametrize("q", ["bf16", "fp16"])
def test_seesaw_ptx_structure(q, tmp_path):
    """The seesaw kernel's PTX/cubin: no spills, one QK site per warpgroup (2 x 36
    m64n64k16), per warpgroup 4 RS + 4 SS m64n256k16, the canonical SW128 descriptors,
    P handed over through the RoPE block of buffer 0 / 1 (st.shared -> fence ->
    bar.arrive 1 / 2; SS descriptors based at sK + 64 KB and sK + 136 KB), the cp.async
    loads completing on 4 mbarriers (noinc + release arrive, count 256), and every
    mbarrier wait followed by an async-proxy fence before the WGMMAs."""
    import re

    ptx, regs, frame = _compile_dump_seesaw(q, tmp_path)
    assert ptx.count("griddepcontrol.launch_dependents;") == 1  # the PDL trigger for the combine kernel
    assert regs <= 255 and frame == 0, (regs, frame)
    assert ".reqntid 256, 1, 1" in ptx
    t = "f16" if q == "fp16" else "bf16"
    assert len(re.findall(rf"wgmma\.mma_async\.sync\.aligned\.m64n64k16\.f32\.{t}\.{t}", ptx)) == 72
    assert len(re.findall(rf"wgmma\.mma_async\.sync\.aligned\.m64n256k16\.f32\.{t}\.{t}", ptx)) == 16
    assert len(re.findall(r"m64n256k16[^\n]*\}, \{%r\d+, %r\d+, %r\d+, %r\d+\}, %rd\d+, p, 1,  1, 1;", ptx)) == 8
    assert len(re.findall(r"m64n256k16[^\n]*\}, %rd\d+, %rd\d+, p, 1,  1, 0, 1;", ptx)) == 8
    assert len(re.findall(r"m64n64k16[^\n]*\}, %rd\d+, %rd\d+, p, 1,  1, 0, 0;", ptx)) == 72
    descs = _sw128_descriptors(ptx)
    assert descs == {(16, 1024, 0), (8192, 1024, 0)}, descs

    flat = re.sub(r"\s+", " ", ptx)
    # sK starts at 72 KB: P of buffer 0 at 72 + 64 KB = 139264 B, of buffer 1 at 212992 B
    assert "139264" in flat and "212992" in flat
    # Q: 18 cp.async per thread; KV: per tile 16 (own V half) + 20 (other V half + RoPE),
    # 4 call sites each (tiles 0 / 1 in the prologue, a+2 / b+2 in the loop)
    assert flat.count("cp.async.cg.shared.global") == 18 + 4 * (16 + 20)
    assert flat.count("cp.async.mbarrier.arrive.noinc.shared.b64") == 8
    assert len(re.findall(r"(?<!cp\.async\.)mbarrier\.arrive\.shared\.b64", flat)) == 8
    inits = re.findall(r"mbarrier\.init\.shared\.b64 \[[^\]]*\], (%r\d+|\d+);", flat)
    assert len(inits) == 4
    # each load_part: zero-fill stores -> fence -> noinc arrive -> release arrive
    assert len(re.findall(r"fence\.proxy\.async\.shared::cta; cp\.async\.mbarrier\.arrive\.noinc", flat)) == 8
    # every mbarrier wait (retry loop) -> async-proxy fence -> wgmma.fence
    waits = re.findall(r"mbarrier\.try_wait\.parity\.shared\.b64 P1, \[[^\]]*\], %r\d+, \d+; @P1 bra\.uni DONE; "
                       r"bra\.uni LAB_WAIT; DONE: \} // end inline asm fence\.proxy\.async\.shared::cta; "
                       r"wgmma\.fence\.sync\.aligned;", flat)
    assert len(waits) == flat.count("mbarrier.try_wait") == 4
    # P handoff: 16 st.shared of P -> fence -> bar.arrive (WG0 on 1, WG1 on 2); the other syncs
    for bar in (1, 2):
        assert re.search(r"st\.shared\.b32 \[%r\d+\], %r\d+; fence\.proxy\.async\.shared::cta; "
                         rf"(// [^;]*?)?bar\.arrive {bar}, 256;", flat), bar
        assert flat.count(f"bar.arrive {bar}, 256;") == 1 and flat.count(f"bar.sync {bar}, 256;") == 1
        # the non-owner: barrier -> async-proxy fence before anything else
        assert re.search(rf"bar\.sync {bar}, 256; fence\.proxy\.async\.shared::cta;", flat), bar
    # no L2 bulk prefetch by default (option l2_prefetch: test_seesaw_l2_prefetch_option)
    assert "cp.async.bulk.prefetch" not in flat
    # all wgmma groups waited with 0 (nothing in flight across the pair loop's back edge)
    assert set(re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+);", flat)) == {"0"}
    assert "cvt.rn.f16x2.e4m3x2" not in flat


# ----------------------------------------------------------------------------
# Seesaw with fp8 e4m3 KV (branch wgmma-fp8-seesaw): no raw fp8 ring in smem; each
# warpgroup ld.global's its fp8 part of the next tile into registers before the WGMMA wait
# that frees the columns, then converts (cvt.rn.f16x2.e4m3x2) and st.shared's it into the
# fp16 K tile, fences (generic -> async proxy) and arrives on the part's mbarrier (count 128).
# ----------------------------------------------------------------------------


def test_seesaw_fp8_copies_store_each_element_once_into_16_byte_swizzle_units():
    """Coordinate by coordinate, for all 128 threads of a warpgroup: the fp8 ld.global
    partition (g2r), the fp16 st.shared partition (r2s) and the partition whose coordinates
    the kernel's row masks read (``_wg_copy``, tKcK) list the same (row, col) at every
    position (CPY, m, block), so each converted value goes to the element it was loaded
    from; chunk (m, block) of thread t is row t // 8 + 16 m, 8 consecutive columns starting
    at a multiple of 8 inside the 64-column block; the register staging tensor (CPY, 4, 5)
    holds the largest part (5 blocks); and through the sK layout *with its swizzle* the 8
    fp16 of a chunk are 8 consecutive elements starting 16-byte aligned in both K buffers
    (one 128-bit st.shared each: the SW128 swizzle permutes whole 16-byte units, so it
    never splits a chunk).  Every element of a tile is written exactly once."""
    import cutlass
    import cutlass.cute as cute

    from mla_cute_dsl.kernels import sm90_wgmma_decode as W

    k = _seesaw("bf16", "fp8_e4m3")
    res = {}

    @cute.jit
    def probe():
        _, sK, _, _ = k._smem_layouts()
        g2r, r2s = k._wg_fp8_copies()
        cp = k._wg_copy()
        c = cute.make_identity_tensor((W.BLOCK_N, W.D_QK))
        # (comprehensions only: a plain `for` over range() would be traced as a device loop)
        for t in cutlass.range_constexpr(W.WG_THREADS):  # static thread ids
            a = g2r.get_slice(t).partition_S(c)
            b = r2s.get_slice(t).partition_D(c)
            m = cp.get_slice(t).partition_S(c)
            shp = (cute.size(a.shape[0]), cute.size(a.shape[1]), cute.size(a.shape[2]))
            res[("shape", t)] = (shp, (cute.size(b.shape[0]), cute.size(b.shape[1]), cute.size(b.shape[2])))
            res[("same", t)] = all(a[v, mm, blk] == b[v, mm, blk] and b[v, mm, blk] == m[v, mm, blk]
                                   for v in range(shp[0]) for mm in range(shp[1]) for blk in range(shp[2]))
            res[("elems", t)] = [[[tuple(b[v, mm, blk]) for v in range(shp[0])] for blk in range(shp[2])]
                                 for mm in range(shp[1])]
        # swizzled element offsets of every 8-column chunk, both K buffers
        res["units_ok"] = all(
            [sK((r, c0 + i, j)) for i in range(8)] == list(range(sK((r, c0, j)), sK((r, c0, j)) + 8))
            and sK((r, c0, j)) % 8 == 0
            for r in range(W.BLOCK_N) for c0 in range(0, W.D_QK, 8) for j in range(2)
        )

    cute.compile(probe)
    assert res["units_ok"] is True
    cover = []
    for t in range(W.WG_THREADS):
        assert res[("shape", t)] == ((8, 4, 9), (8, 4, 9))
        assert res[("same", t)] is True, t
        for mm, per_m in enumerate(res[("elems", t)]):
            for blk, vals in enumerate(per_m):
                assert all(r == t // 8 + 16 * mm for r, _ in vals)
                cols = [col for _, col in vals]
                assert cols == list(range(cols[0], cols[0] + 8)) and cols[0] % 8 == 0
                assert 64 * blk <= cols[0] < 64 * blk + 64
                cover += vals
    assert len(cover) == len(set(cover)) == W.BLOCK_N * W.D_QK
    # the staging registers: (CPY 8, 4 row passes, 5 blocks) fp8 = 40 32-bit registers
    assert max(len(b) for w in W.SEESAW_LOAD_BLOCKS for b in w) == 5


@pytest.mark.parametrize("q", ["bf16", "fp16"])
def test_seesaw_fp8_kernel_compiles(q):
    from mla_cute_dsl.kernels import kernel_cache
    from mla_cute_dsl.kernels.sm90_wgmma_decode import get_partial_kernel_wgmma, get_partial_kernel_wgmma_seesaw

    fn = get_partial_kernel_wgmma_seesaw(q, "fp8_e4m3")
    assert fn is not None
    assert get_partial_kernel_wgmma_seesaw(q, "fp8_e4m3") is fn
    assert kernel_cache.origin("partial_wgmma_seesaw", (q, "fp8_e4m3", 64, "l2pf")) in ("compiled", "disk")
    assert get_partial_kernel_wgmma(q, "fp8_e4m3") is not fn  # the one-S fp8 kernel stays selectable


@pytest.mark.parametrize("q", ["bf16", "fp16"])
def test_seesaw_fp8_ptx_structure(q, tmp_path):
    """The fp8 seesaw kernel's PTX/cubin: no spills (<= 255 registers, no stack frame),
    fp16 WGMMAs (2 x 36 m64n64k16, 8 RS + 8 SS m64n256k16) with the canonical SW128
    descriptors; KV only through 64-bit ld.global (no cp.async for KV: 8 load sites x 4 row
    passes, parts of 4 + 5 blocks: 144 per thread, + 1 for the work item) and
    cvt.rn.f16x2.e4m3x2 (576 per copy of the conversion, two copies: tiles without and with
    rows past kv_len), nothing via f32; 4 mbarriers of count 128 with plain arrives only;
    every part: st.shared -> fence.proxy.async -> mbarrier.arrive; every mbarrier wait ->
    wgmma.fence with no fence between (branch seesaw-tma-nofence: each part's writers fenced before their
    arrive; the reader_fences=True arm keeps the fences, its PTX pinned in test_seesaw_tma_compile.py); L2
    prefetch of 36,864 B per tile (the fp8 default); and the pair loop's order of
    loads, conversions, WGMMA issues, waits and barriers, event by event (each part's
    ld.global's issued before the wgmma wait that frees its columns; WG0 converts tile b's
    part under its S_a WGMMAs and WG1 tile a+2's under its P_b V_R WGMMAs)."""
    import re

    ptx, regs, frame = _compile_dump_seesaw(q, tmp_path, "fp8_e4m3")
    assert regs <= 255 and frame == 0, (regs, frame)
    assert ".reqntid 256, 1, 1" in ptx
    assert len(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n64k16\.f32\.f16\.f16", ptx)) == 72
    assert len(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n256k16\.f32\.f16\.f16", ptx)) == 16
    assert "bf16.bf16" not in ptx
    assert len(re.findall(r"m64n256k16[^\n]*\}, \{%r\d+, %r\d+, %r\d+, %r\d+\}, %rd\d+, p, 1,  1, 1;", ptx)) == 8
    assert len(re.findall(r"m64n256k16[^\n]*\}, %rd\d+, %rd\d+, p, 1,  1, 0, 1;", ptx)) == 8
    descs = _sw128_descriptors(ptx)
    assert descs == {(16, 1024, 0), (8192, 1024, 0)}, descs

    flat = re.sub(r"\s+", " ", ptx)
    assert "139264" in flat and "212992" in flat  # P over the RoPE block of buffer 0 / 1
    # KV: 64-bit ld.global only; Q: 18 cp.async (fp16 q) or 18 x (ld.global.v4 bf16, cvt, st.shared)
    assert flat.count("ld.global.v2.b32") == 144 + 1
    assert flat.count("cp.async.cg.shared.global") == (18 if q == "fp16" else 0)
    if q == "bf16":
        assert flat.count("ld.global.v4") == 18 and flat.count("cvt.f32.bf16") == 144
    assert flat.count("cvt.rn.f16x2.e4m3x2") == 2 * 576
    assert not re.search(r"cvt\.[a-z.]*e4m3 |cvt\.f32\.e4m3", flat)
    # mbarriers: 4, count 128, plain arrives only (8 sites), no cp.async arrive
    inits = re.findall(r"mbarrier\.init\.shared\.b64 \[[^\]]*\], (%r\d+|\d+);", flat)
    assert len(inits) == 4 and len(set(inits)) == 1
    assert inits[0] == "128" or f"mov.b32 {inits[0]}, 128;" in flat
    assert "cp.async.mbarrier.arrive" not in flat
    assert len(re.findall(r"(?<!cp\.async\.)mbarrier\.arrive\.shared\.b64", flat)) == 8
    # (the label: the masked and unmasked copies of the conversion join before the fence)
    assert len(re.findall(r"st\.shared\.v4\.b32 \[[^\]]*\], \{[^}]*\}; (\$L__BB\d+_\d+: )?"
                          r"fence\.proxy\.async\.shared::cta; mov\.b32 %r\d+, 1; "
                          r"mbarrier\.arrive\.shared\.b64", flat)) == 8
    waits = re.findall(r"mbarrier\.try_wait\.parity\.shared\.b64 P1, \[[^\]]*\], %r\d+, \d+; @P1 bra\.uni DONE; "
                       r"bra\.uni LAB_WAIT; DONE: \} // end inline asm wgmma\.fence\.sync\.aligned;", flat)
    assert len(waits) == flat.count("mbarrier.try_wait") == 4
    for bar in (1, 2):
        assert flat.count(f"bar.arrive {bar}, 256;") == 1 and flat.count(f"bar.sync {bar}, 256;") == 1
        assert not re.search(rf"bar\.sync {bar}, 256; fence\.proxy\.async\.shared::cta;", flat), bar
    # the default fp8 kernel prefetches the next pair's two tiles into L2 (seesaw_l2_prefetch_default)
    pf = re.findall(r"cp\.async\.bulk\.prefetch\.L2\.global \[%rd\d+\], (%r\d+);", flat)
    assert len(pf) == 2 and all(f"mov.b32 {r}, 36864;" in flat for r in pf), pf
    assert set(re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+);", flat)) == {"0"}

    # the pair loop in PTX order (between the prologue's and the epilogue's CTA barrier),
    # runs of equal events collapsed; a part's conversion = 4 cvt per 8 elements, two copies
    # (tiles without / with rows past kv_len): CVTx160 for 5 blocks, CVTx128 for 4
    toks = re.findall(r"ld\.global\.v2\.b32|cvt\.rn\.f16x2\.e4m3x2|wgmma\.wait_group\.sync\.aligned 0|"
                      r"wgmma\.commit_group|mbarrier\.arrive\.shared\.b64|mbarrier\.try_wait|bar\.sync \d|"
                      r"bar\.arrive \d|wgmma\.mma_async\.sync\.aligned\.m64n\d+k16", flat)
    names = {"ld.global.v2.b32": "ldg", "cvt.rn.f16x2.e4m3x2": "CVT", "wgmma.wait_group.sync.aligned 0": "wait",
             "wgmma.commit_group": "commit", "mbarrier.arrive.shared.b64": "arrive", "mbarrier.try_wait": "mwait",
             "wgmma.mma_async.sync.aligned.m64n64k16": "QK", "wgmma.mma_async.sync.aligned.m64n256k16": "PV"}
    run = []
    for x in toks[[i for i, x in enumerate(toks) if x == "bar.sync 0"][1]:]:
        x = names.get(x, x)
        if run and run[-1][0] == x:
            run[-1][1] += 1
        else:
            run.append([x, 1])
    got = " ".join(f"{n}{'x%d' % c if c > 1 else ''}" for n, c in run)
    want = " ".join([
        "bar.sync 0",
        # WG0: S_a issued (own part, then the other), tile b's staged part converted under it
        "mwait QKx16 commit mwait QKx20 commit CVTx160 arrive wait",
        # publish P_a; tile a+2's part loaded during P_a V_L, converted after its wait
        "bar.arrive 1 ldgx16 PVx4 commit wait CVTx128 arrive",
        # tile b+2's part loaded during the P_b wait and P_b V_L (converted next pair)
        "ldgx20 bar.sync 2 PVx4 commit wait",
        # WG1: S_b; P_a V_R issued; publish P_b; tile a+2's part loaded under P_a V_R ...
        "mwait QKx16 commit mwait QKx20 commit wait bar.sync 1 PVx4 commit bar.arrive 2 ldgx20 wait",
        # ... and converted under its own P_b V_R; tile b+2's part loaded under the rest of it
        "PVx4 commit CVTx160 arrive ldgx16 wait CVTx128 arrive",
        "bar.sync 0",
    ])
    assert got == want, got
