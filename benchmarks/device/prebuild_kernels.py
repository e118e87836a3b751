"""Compile the cute_dsl_mla kernels a device session runs, on this CPU, into the kernel disk cache
(MLA_CUTE_DSL_CACHE_DIR), so that a fresh GPU machine loads them instead of compiling (each device call of the
tenth session spent 50-150 s of its time compiling on a cold cache).

Run by benchmarks/device/prebuild_kcache.sh, which gives it the devpack's own Python packages at the device's
path: a cached kernel is reused only when its key matches (kernels/cache_key.py: the kernels' source, the DSL
release and fingerprint, its settings string, which names the runtime library's absolute path, the target
arch, tvm-ffi, the host platform); anything else compiles as before.

    python benchmarks/device/prebuild_kernels.py [--only SUBSTRING[|SUBSTRING...]]
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def specs():
    """(label, thunk) for every kernel the backend's defaults (16-bit partials in q's dtype, wide stores) and the
    device scripts' option arms (partials=fp32, stores=narrow, combine=fused) pick."""
    from mla_cute_dsl.kernels import api
    from mla_cute_dsl.kernels.fp8p_ring import RING_DEFAULT, RING_SIZES, STAGE_SLOTS
    from mla_cute_dsl.kernels.sm90_decode_fp8 import get_partial_kernel_fp8
    from mla_cute_dsl.kernels.sm90_wgmma_decode import (get_partial_kernel_wgmma, get_partial_kernel_wgmma_seesaw,
                                                        get_partial_kernel_wgmma_seesaw_balanced)
    from mla_cute_dsl.kernels.sm90_wgmma_t_decode import (get_partial_kernel_wgmma_t,
                                                          get_partial_kernel_wgmma_t_balanced)

    out = []
    for q in ("bf16", "fp16"):
        # (partial dtype, wide stores): the default, then partials=fp32 with narrow stores (the 0.2.7 default)
        for partial, wide in ((q, True), ("fp32", False)):
            tag = f"{partial}{' wide' if wide else ''}"
            for kv in (q, "fp8_e4m3"):
                for bm in (16, 32, 64):
                    out.append((f"partial {q} {kv} {bm} {tag}", lambda q=q, kv=kv, bm=bm, p=partial, w=wide:
                                api.get_partial_kernel(q, kv, bm, partial=p, wide_store=w)))
                out.append((f"wgmma {q} {kv} {tag}", lambda q=q, kv=kv, p=partial, w=wide:
                            get_partial_kernel_wgmma(q, kv, partial=p, wide_store=w)))
                out.append((f"seesaw {q} {kv} {tag}", lambda q=q, kv=kv, p=partial, w=wide:
                            get_partial_kernel_wgmma_seesaw(q, kv, partial=p, wide_store=w)))
                if kv == q:  # tma=True: seesaw_tma_gpu.sh (fp32, narrow), the backend's loads=tma/auto (default)
                    out.append((f"seesaw {q} {kv} {tag} tma", lambda q=q, p=partial, w=wide:
                                get_partial_kernel_wgmma_seesaw(q, q, partial=p, wide_store=w, tma=True)))
                if kv == q:  # the balanced seesaw (seesaw_split=balanced, the default since 0.2.13), both loads
                    for tma in (False, True):
                        out.append((f"seesaw_balanced {q} {tag}{' tma' if tma else ''}", lambda q=q, p=partial, w=wide,
                                    t=tma: get_partial_kernel_wgmma_seesaw_balanced(q, q, partial=p, wide_store=w,
                                                                                    tma=t)))
                if kv != q:  # the balanced seesaw with an fp8 cache (backend.FP8_SEESAW_BALANCED, branch
                    # fp8-balanced; L2 prefetch on as for the even fp8 seesaw): ONLY=seesaw_balanced_fp8, eager and
                    # lazy (the backend's rescale=lazy; test_seesaw_balanced_fp8_gpu.py runs both with bf16 and fp16
                    # q), fp8_balanced_gpu.sh / wgmma_speed.py --kv fp8 balanced / balanced_lazy
                    for lazy in (False, True):
                        out.append((f"seesaw_balanced_fp8 {q} {tag}{' lazy' if lazy else ''}",
                                    lambda q=q, p=partial, w=wide, z=lazy: get_partial_kernel_wgmma_seesaw_balanced(
                                        q, "fp8_e4m3", partial=p, wide_store=w, lazy_rescale=z)))
                if q == "bf16":  # lazy_rescale (the balanced TMA seesaw for bf16, the even seesaw for fp8):
                    # wgmma_speed.py's balanced_tma_lazy / seesaw_lazy ways, test_seesaw_lazy_gpu.py
                    if kv == q:
                        out.append((f"seesaw_balanced {q} {tag} tma lazy", lambda q=q, p=partial, w=wide:
                                    get_partial_kernel_wgmma_seesaw_balanced(q, q, partial=p, wide_store=w, tma=True,
                                                                             lazy_rescale=True)))
                    else:
                        out.append((f"seesaw {q} {kv} {tag} lazy", lambda q=q, kv=kv, p=partial, w=wide:
                                    get_partial_kernel_wgmma_seesaw(q, kv, partial=p, wide_store=w,
                                                                    lazy_rescale=True)))
                if kv == q:  # q_prefetch (branch q-prefetch; ONLY=qpf): the backend's arm (q partials, wide, TMA, lazy:
                    # wgmma_speed.py's ours_qpf) and test_seesaw_qpf_gpu.py's fp32 narrow arms (bf16: TMA / cp.async x
                    # eager / lazy; fp16: TMA lazy, cp.async eager; wgmma_speed.py's balanced_*_qpf ways) with the
                    # q_prefetch=False arms the list lacks otherwise (bf16 cp.async lazy, fp16 TMA lazy)
                    arms = (((True, True),) if partial == q else ((True, False), (False, False), (True, True),
                                                                   (False, True)) if q == "bf16" else
                            ((True, True), (False, False)))
                    for tma, lazy in arms:
                        out.append((f"seesaw_balanced {q} {tag}{' tma' if tma else ''}{' lazy' if lazy else ''} qpf",
                                    lambda q=q, p=partial, w=wide, t=tma, z=lazy:
                                    get_partial_kernel_wgmma_seesaw_balanced(q, q, partial=p, wide_store=w, tma=t,
                                                                             lazy_rescale=z, q_prefetch=True)))
                    if partial == q == "fp16":  # the backend's fp16 arm above 128 packed rows (q_prefetch unset:
                        # auto, off there; bf16's is the lazy_rescale arm above)
                        out.append((f"seesaw_balanced {q} {tag} tma lazy", lambda q=q:
                                    get_partial_kernel_wgmma_seesaw_balanced(q, q, partial=q, wide_store=True,
                                                                             tma=True, lazy_rescale=True)))
                    if partial == "fp32":
                        t, z = (False, True) if q == "bf16" else (True, True)
                        out.append((f"seesaw_balanced {q} {tag}{' tma' if t else ''} lazy (qpf off arm)",
                                    lambda q=q, t=t, z=z: get_partial_kernel_wgmma_seesaw_balanced(
                                        q, q, partial="fp32", tma=t, lazy_rescale=z)))
                if kv == q == "bf16":  # wg1_other_first (branch qk-order; ONLY=wg1of): the balanced TMA lazy seesaw
                    # with and without q_prefetch in the backend's arm (bf16 partials, wide stores: H=128 s_q=1 / 2)
                    # and fp32 narrow (wgmma_speed.py's balanced_tma_lazy[_qpf]_wg1of ways, test_seesaw_wg1of_gpu.py),
                    # and the even cp.async seesaw in fp32 narrow (test_seesaw_wg1of_gpu.py)
                    for qpf in (True, False):
                        out.append((f"seesaw_balanced {q} {tag} tma lazy{' qpf' if qpf else ''} wg1of",
                                    lambda q=q, p=partial, w=wide, f=qpf: get_partial_kernel_wgmma_seesaw_balanced(
                                        q, q, partial=p, wide_store=w, tma=True, lazy_rescale=True, q_prefetch=f,
                                        wg1_other_first=True)))
                    if partial == "fp32":
                        out.append((f"seesaw {q} {kv} {tag} wg1of", lambda q=q:
                                    get_partial_kernel_wgmma_seesaw(q, q, partial="fp32", wg1_other_first=True)))
                if kv == q and partial == "fp32":  # tma_producer (branch tma-producer; ONLY=tmap): test_seesaw_tmap_gpu.py's
                    # arms (fp32 partials, narrow stores, TMA, eager / lazy, bf16 / fp16) and wgmma_speed.py's
                    # balanced_tma_lazy_tmap way (bf16 lazy); their option-off twins are the "tma" / "tma lazy" entries
                    for lazy in (False, True):
                        out.append((f"seesaw_balanced {q} {tag} tma{' lazy' if lazy else ''} tmap",
                                    lambda q=q, z=lazy: get_partial_kernel_wgmma_seesaw_balanced(
                                        q, q, partial="fp32", tma=True, lazy_rescale=z, tma_producer=True)))
                if kv == q == "bf16":  # tma_producer with wg1_other_first (branch tmap-wg1of; ONLY="tmap wg1of"):
                    # lazy, in the backend's arm (bf16 partials, wide stores) and fp32 narrow (wgmma_speed.py's
                    # balanced_tma_lazy_tmap_wg1of way, test_seesaw_tmap_gpu.py's wg1of cases; their twins: "tma lazy
                    # tmap", "tma lazy wg1of")
                    out.append((f"seesaw_balanced {q} {tag} tma lazy tmap wg1of",
                                lambda q=q, p=partial, w=wide: get_partial_kernel_wgmma_seesaw_balanced(
                                    q, q, partial=p, wide_store=w, tma=True, lazy_rescale=True, wg1_other_first=True,
                                    tma_producer=True)))
                if kv == q and partial == q:  # the backend's default since mla-cute-dsl 0.2.19 (tma_producer auto):
                    # the balanced TMA lazy seesaw with the producer warpgroup, 16-bit partials and wide stores
                    out.append((f"seesaw_balanced {q} {tag} tma lazy tmap",
                                lambda q=q, p=partial, w=wide: get_partial_kernel_wgmma_seesaw_balanced(
                                    q, q, partial=p, wide_store=w, tma=True, lazy_rescale=True, tma_producer=True)))
                    if q == "fp16":  # wg1_other_first unset (auto, 0.2.21): the fp16 default from 256 packed rows
                        # (bf16's is the "tma lazy tmap wg1of" entry above, in every arm)
                        out.append((f"seesaw_balanced {q} {tag} tma lazy tmap wg1of",
                                    lambda q=q, p=partial, w=wide: get_partial_kernel_wgmma_seesaw_balanced(
                                        q, q, partial=p, wide_store=w, tma=True, lazy_rescale=True,
                                        wg1_other_first=True, tma_producer=True)))
                if kv == q == "bf16" and partial == "fp32":  # wgmma_speed.py's seesaw_tma_l2pf way
                    out.append((f"seesaw {q} {kv} {tag} tma l2pf", lambda q=q:
                                get_partial_kernel_wgmma_seesaw(q, q, partial="fp32", tma=True, l2_prefetch=True)))
                if q == "fp16" and kv == "fp8_e4m3" and partial == "fp32":  # test_seesaw_fp8p_gpu.py's fp16 lazy
                    out.append((f"seesaw {q} {kv} {tag} lazy", lambda q=q, kv=kv:
                                get_partial_kernel_wgmma_seesaw(q, kv, partial="fp32", lazy_rescale=True)))
                if kv == "fp8_e4m3":  # fp8_producer=True (branch fp8-producer): wgmma_speed.py's seesaw_fp8p /
                    # seesaw_fp8p_lazy ways (fp32, narrow), test_seesaw_fp8p_gpu.py, fp8_producer_gpu.sh
                    out.append((f"seesaw {q} {kv} {tag} fp8p", lambda q=q, kv=kv, p=partial, w=wide:
                                get_partial_kernel_wgmma_seesaw(q, kv, partial=p, wide_store=w, fp8_producer=True)))
                    if q == "bf16" and partial == "fp32":  # test_seesaw_fp8p_gpu.py's prefetch-off arm
                        out.append((f"seesaw {q} {kv} {tag} fp8p nopf", lambda q=q, kv=kv:
                                    get_partial_kernel_wgmma_seesaw(q, kv, partial="fp32", l2_prefetch=False,
                                                                    fp8_producer=True)))
                    if q == "bf16" or partial == "fp32":
                        out.append((f"seesaw {q} {kv} {tag} fp8p lazy", lambda q=q, kv=kv, p=partial, w=wide:
                                    get_partial_kernel_wgmma_seesaw(q, kv, partial=p, wide_store=w,
                                                                    lazy_rescale=True, fp8_producer=True)))
                if kv == "fp8_e4m3":  # the producer warpgroup on the balanced schedule (branch
                    # fp8-balanced-producer; backend.FP8_BALANCED_PRODUCER with FP8_SEESAW_BALANCED): lazy in both
                    # partial / store arms (the backend's default and fp32 narrow), eager in fp32 narrow
                    # (wgmma_speed.py --kv fp8 balanced_fp8p / balanced_fp8p_lazy; test_seesaw_fp8p_balanced_gpu.py,
                    # fp8_balanced_producer_gpu.sh): ONLY=seesaw_fp8p_balanced
                    for lazy in ((False, True) if partial == "fp32" else (True,)):
                        out.append((f"seesaw_fp8p_balanced {q} {tag}{' lazy' if lazy else ''}",
                                    lambda q=q, p=partial, w=wide, z=lazy: get_partial_kernel_wgmma_seesaw_balanced(
                                        q, "fp8_e4m3", partial=p, wide_store=w, lazy_rescale=z, fp8_producer=True)))
                if kv == "fp8_e4m3":  # the producer's register ring (fp8p_ring, branch fp8p-inflight): the default
                    # size (the backend's fp8_loader=ring: lazy in the default arm) one item and balanced, fp32 narrow
                    # eager / lazy (test_seesaw_fp8p_ring_gpu.py, wgmma_speed.py's *_fp8p_ring* ways, fp8_ring_gpu.sh);
                    # every ring size (RING_SIZES): ONLY=seesaw_fp8p_ring
                    # and the default size with its shared-memory staging (fp8p_stage, fp8_loader=ring_staged).
                    # With wg1_other_first (branch fp8-wg1of, the backend's default with the ring since 0.2.21;
                    # ONLY=ring_wg1of): the default size in every arm (wgmma_speed.py's *_fp8p_ring_wg1of_lazy ways,
                    # test_seesaw_fp8p_ring_wg1of_gpu.py, the hang probe), ring 5 and the staged ring in fp32 narrow
                    # lazy (the GPU tests' bitwise cross-checks against their option-off twins)
                    for ring, st in [(r, 0) for r in RING_SIZES] + [(RING_DEFAULT, STAGE_SLOTS)]:
                        for lazy in ((False, True) if partial == "fp32" else (True,)):
                            for wg1of in (False, True):
                                if wg1of and (ring, st) != (RING_DEFAULT, 0) and not (lazy and partial == "fp32"):
                                    continue
                                z = " lazy" if lazy else ""
                                rs = f"r{ring}{f's{st}' if st else ''}"
                                name = "seesaw_fp8p_ring_wg1of" if wg1of else "seesaw_fp8p_ring"
                                for balanced in (False, True):
                                    getter = (get_partial_kernel_wgmma_seesaw_balanced if balanced
                                              else get_partial_kernel_wgmma_seesaw)
                                    out.append((f"{name}{'_balanced' if balanced else ''} {q} {tag} {rs}{z}",
                                                lambda g=getter, q=q, p=partial, w=wide, z=lazy, r=ring, s=st, o=wg1of:
                                                g(q, "fp8_e4m3", partial=p, wide_store=w, lazy_rescale=z,
                                                  fp8_producer=True, fp8p_ring=r, fp8p_stage=s,
                                                  **({"wg1_other_first": True} if o else {}))))
                if q == "bf16" and partial == "fp32" and (kv == "fp8_e4m3" or kv == q):
                    # seesaw_nofence_gpu.sh's reader_fences=True arms (wgmma_speed.py seesaw_tma_fenced /
                    # seesaw_fenced --kv fp8)
                    out.append((f"seesaw {q} {kv} {tag}{' tma' if kv == q else ''} rfence", lambda q=q, kv=kv:
                                get_partial_kernel_wgmma_seesaw(q, kv, partial="fp32", tma=kv == q,
                                                                reader_fences=True)))
                for bm in (16, 32):  # wgmma_t has no wide epilogue
                    out.append((f"wgmma_t {q} {kv} {bm} {partial}", lambda q=q, kv=kv, bm=bm, p=partial:
                                get_partial_kernel_wgmma_t(q, kv, bm, partial=p)))
            for bm in (16, 32, 64):
                out.append((f"partial_balanced {q} {bm} {tag}", lambda q=q, bm=bm, p=partial, w=wide:
                            api.get_partial_kernel(q, q, bm, balanced=True, partial=p, wide_store=w)))
            for bm in (16, 32):
                out.append((f"wgmma_t_balanced {q} {bm} {partial}", lambda q=q, bm=bm, p=partial:
                            get_partial_kernel_wgmma_t_balanced(q, q, bm, partial=p)))
                out.append((f"fp8reg {q} {bm} {partial}",
                            lambda q=q, bm=bm, p=partial: get_partial_kernel_fp8(q, bm, partial=p)))
            # option s_accs=auto: 4 S accumulators at 16 rows (backend.fp8reg_s_accs)
            out.append((f"fp8reg {q} 16 {partial} s_accs=4",
                        lambda q=q, p=partial: get_partial_kernel_fp8(q, 16, partial=p, s_accs=4)))
        if q == "bf16":  # partials_ab_gpu.sh's other arms: partials=q with narrow stores, fp32 with wide ones
            for partial, wide in ((q, False), ("fp32", True)):
                for bm in (16, 32):
                    out.append((f"partial_balanced {q} {bm} {partial} wide={wide}",
                                lambda q=q, bm=bm, p=partial, w=wide:
                                api.get_partial_kernel(q, q, bm, balanced=True, partial=p, wide_store=w)))
                for kv in (q, "fp8_e4m3"):
                    out.append((f"seesaw {q} {kv} {partial} wide={wide}", lambda q=q, kv=kv, p=partial, w=wide:
                                get_partial_kernel_wgmma_seesaw(q, kv, partial=p, wide_store=w)))
        # combine=fused (fused_merge.py): the mma.sync kernel merging its own splits, balanced and even entries, with
        # the default partials (q's dtype, wide stores), q with narrow stores (the kernel-level GPU tests) and fp32
        for partial, wide in ((q, True), (q, False), ("fp32", False)):
            for bm in (16, 32):
                for balanced in (True, False):
                    out.append((f"partial{'_balanced' if balanced else ''} {q} {bm} {partial} wide={wide} fused",
                                lambda q=q, bm=bm, p=partial, w=wide, b=balanced:
                                api.get_partial_kernel(q, q, bm, balanced=b, partial=p, wide_store=w, fused=True)))
        # the cluster pair merge (pair_merge.py, experimental): partials in q's dtype with wide stores (the default)
        # and fp32 with narrow stores, as test_pair_merge_gpu.py and bench_pair.py run it
        for partial, wide in ((q, True), ("fp32", False)):
            for bm in (16, 32):
                out.append((f"partial_balanced {q} {bm} {partial} wide={wide} pair",
                            lambda q=q, bm=bm, p=partial, w=wide:
                            api.get_partial_kernel(q, q, bm, balanced=True, partial=p, wide_store=w, pair=True)))
        for partial in ("fp32", q):
            for pdl in (False, True):
                for wide, cols in ((False, 512), (False, 128), (True, 512)):
                    out.append((f"combine {q} wide={wide} cols={cols} pdl={pdl} {partial}",
                                lambda q=q, w=wide, c=cols, d=pdl, p=partial:
                                api.get_combine_kernel(q, wide=w, pdl=d, partial=p, cols=c)))
    return out


def selected(items: list, only: str = "", reverse: bool = False) -> list:
    """The (label, thunk) pairs to build: those whose label contains any '|'-separated substring of ``only`` (all
    for ""), in the list's order or, for the second of two processes filling one cache, from its end."""
    todo = [(label, fn) for label, fn in items if any(s in label for s in only.split("|"))]
    return todo[::-1] if reverse else todo


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="", help="build only the kernels whose label contains this (several "
                                                 "substrings separated by '|': any of them)")
    ap.add_argument("--reverse", action="store_true",
                    help="build the list from its end: a second process on a 2-core machine fills the same cache "
                         "from the other side (a kernel the other one stored is loaded, not built again)")
    a = ap.parse_args()
    if not os.environ.get("MLA_CUTE_DSL_CACHE_DIR"):
        sys.exit("set MLA_CUTE_DSL_CACHE_DIR to the cache directory to fill")
    from mla_cute_dsl.kernels import kernel_cache

    todo = selected(specs(), a.only, a.reverse)
    start = time.time()
    for i, (label, fn) in enumerate(todo, 1):
        t = time.time()
        fn()
        print(f"[{i}/{len(todo)}] {label}: {time.time() - t:.1f} s", flush=True)
    print(f"{len(todo)} kernels in {time.time() - start:.0f} s; {kernel_cache.stats()}")


if __name__ == "__main__":
    main()
