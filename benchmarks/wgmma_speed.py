"""Time ways to compute the same MLA decode, side by side, on one SM90 GPU.

    wgmma  mla_cute_dsl's WGMMA partial kernel + combine (sm90_wgmma_decode)
    seesaw the same module's seesaw-schedule WGMMA kernel (MLADecodePartialWGMMASeesaw; KV in q's
           dtype, or fp8 e4m3 with --kv fp8: converted in registers), as the backend runs it (the L2
           prefetch of the next pair's tiles as seesaw_l2_prefetch_default says: off for a 16-bit
           cache, on for fp8)
    seesaw_l2pf / seesaw_nopf  the seesaw kernel with / without that L2 prefetch
    seesaw_tma  the seesaw kernel with TMA KV loads (option tma=True, 16-bit KV only; branch seesaw-tma2)
    seesaw_fenced / seesaw_tma_fenced  the seesaw kernel (cp.async / TMA loads) keeping the reader-side proxy
                fences (reader_fences=True: the kernels before branch seesaw-tma-nofence dropped them for TMA
                loads and fp8 caches; with a 16-bit cache and cp.async, seesaw_fenced is seesaw)
    seesaw_tma_l2pf  the same with the L2 prefetch of the next pair's tiles
    seesaw_fp8p / seesaw_fp8p_lazy  the fp8 seesaw (--kv fp8 only) with a producer warpgroup (fp8_producer=True,
                384 threads: the third warpgroup ld.global's, converts and st.shared's every fp8 part; branch
                fp8-producer), eager / lazy rescale; compare with seesaw / seesaw_lazy
    balanced_tma  the balanced seesaw (the backend's default kernel at 64+ rows), TMA loads, fp32 partials
    balanced / balanced_lazy  the balanced seesaw with cp.async loads (16-bit KV) or, with --kv fp8, the fp8
                loads (branch fp8-balanced: backend.FP8_SEESAW_BALANCED; L2 prefetch as seesaw's default: on for
                fp8), eager / lazy rescale, fp32 partials: compare with seesaw / seesaw_lazy (the even kernels)
    balanced_fp8p / balanced_fp8p_lazy  the balanced fp8 seesaw (--kv fp8 only) with the producer warpgroup
                (fp8_producer=True, branch fp8-balanced-producer: backend.FP8_BALANCED_PRODUCER), eager / lazy
                rescale, fp32 partials: compare with balanced / balanced_lazy and seesaw_fp8p / seesaw_fp8p_lazy
    balanced_tma_qpf / balanced_tma_lazy_qpf / balanced_qpf / balanced_lazy_qpf  the balanced seesaw (TMA or cp.async
                loads, eager / lazy rescale, fp32 partials) with q_prefetch=True (branch q-prefetch: each item issues
                the next item's Q and KV tiles 0/1 during its last pairs; 16-bit KV only): compare with
                balanced_tma / balanced_tma_lazy / balanced / balanced_lazy
    balanced_tma_lazy_qpf_wg1of / balanced_tma_lazy_wg1of  balanced_tma_lazy_qpf / balanced_tma_lazy with
                wg1_other_first=True (branch qk-order: warpgroup 1's QK of its own tile waits warpgroup 0's part of
                the tile first; 16-bit KV only; fp32 partials, narrow stores): compare with those two
    balanced_tma_lazy_tmap  the balanced TMA seesaw (lazy rescale, fp32 partials, as balanced_tma_lazy_qpf) with
                tma_producer=True (branch tma-producer: a producer warpgroup issues every KV part and Q by TMA across
                the column's items; 16-bit KV only): compare with balanced_tma_lazy and balanced_tma_lazy_qpf
    balanced_tma_lazy_tmap_wg1of  balanced_tma_lazy_tmap with wg1_other_first=True too (branch tmap-wg1of: warpgroup
                1 waits tile b's part 2 first and the producer issues it first): compare with balanced_tma_lazy_tmap
    seesaw_fp8p_ring / seesaw_fp8p_ring_lazy / balanced_fp8p_ring / balanced_fp8p_ring_lazy  the producer kernels
                above (--kv fp8 only) with the producer's register ring (fp8p_ring, branch fp8p-inflight: every
                chunk's ld.global issued R - 1 chunks ahead of its conversion; setmaxnreg 208 / 88); R = --fp8p-ring
                (default fp8p_ring.RING_DEFAULT), or per way with the size in the name: seesaw_fp8p_ring5_lazy;
                _staged (seesaw_fp8p_ring_staged_lazy, balanced_fp8p_ring7_staged_lazy, ...): with the ring's
                shared-memory staging (fp8p_stage = fp8p_ring.STAGE_SLOTS: every third chunk by cp.async)
    seesaw_fp8p_ring_wg1of_lazy / balanced_fp8p_ring_wg1of_lazy  the ring ways with wg1_other_first=True (branch
                fp8-wg1of: warpgroup 1's QK of its tile waits full[2] first and the ring converts tile b's part 2
                before part 3); _wg1of before _staged / _lazy's end (seesaw_fp8p_ring5_staged_wg1of_lazy): compare
                with seesaw_fp8p_ring_lazy / balanced_fp8p_ring_lazy
    mma    mla_cute_dsl's mma.sync partial kernel + combine (api.mla_decode_sm90)
    wgmma_t  the transposed WGMMA kernel (sm90_wgmma_t_decode: tokens = M, query rows = N; s_q*H <= 32,
           one CTA per SM)
    ours   cute_dsl_mla through mlacore.MLADecoder with its default options (what an engine runs)
    ours_qpf  the same with its option q_prefetch=true (the balanced 16-bit seesaw's q_prefetch kernel)
    fa3    FlashInfer fa3 through mlacore.MLADecoder (dispatcher forced to flashinfer_mla, variant fa3)

Shapes with H * s_q >= 64, KV bf16 (or fp8 e4m3 with --kv fp8, kv_scale 1: wgmma, seesaw
and mma all take it), page 64,
every request of length S.
Per shape: the first call of each way is timed on its own (it compiles or loads
kernels); the outputs of all ways are compared with fa3's (max abs diff of out
and lse); then each way's calls are captured in one CUDA graph and the graph's
replays are timed with CUDA events (median over --reps replays).  The graph
runs the way once per input set; sets have their own q and KV cache (together
>= 4x L2, same shuffled page table), so reads do not hit a warm L2; shapes
whose cache is already much larger than L2 use one set.
GB/s counts B*S*576*kv_bytes + q + out bytes; TFLOP/s counts 2*B*s_q*H*S*(576+512).
"x fa3" = fa3 time / this way's time (> 1: faster than fa3).

From the repository root, with the project and the plugins installed:
    python benchmarks/wgmma_speed.py [--quick] [--shapes 0,3|128x128x1x4096] [--kv fp8] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time

PAGE = 64
SM_SCALE = 1.0 / math.sqrt(128 + 64)
SHAPES = [  # (B, H, s_q, S)
    (128, 128, 1, 4096),
    (128, 128, 2, 4096),
    (64, 128, 1, 8192),
    (16, 128, 1, 4096),
    (32, 64, 1, 4096),
    (128, 16, 4, 4096),
    (4, 128, 1, 16384),
]
QUICK_SHAPES = [0, 3]
WAYS = ("wgmma", "seesaw", "seesaw_l2pf", "seesaw_nopf", "seesaw_tma", "seesaw_tma_l2pf", "seesaw_fenced",
        "seesaw_tma_fenced", "balanced_tma", "balanced_tma_lazy", "balanced_tma_pdl", "balanced_tma_nocomb",
        "seesaw_lazy", "seesaw_fp8p", "seesaw_fp8p_lazy", "balanced", "balanced_lazy", "balanced_fp8p",
        "balanced_fp8p_lazy", "balanced_tma_qpf", "balanced_tma_lazy_qpf", "balanced_qpf", "balanced_lazy_qpf",
        "balanced_tma_lazy_qpf_wg1of", "balanced_tma_lazy_wg1of",
        "balanced_tma_lazy_tmap", "balanced_tma_lazy_tmap_wg1of",
        "seesaw_fp8p_ring", "seesaw_fp8p_ring_lazy", "balanced_fp8p_ring", "balanced_fp8p_ring_lazy",
        "seesaw_fp8p_ring_staged_lazy", "balanced_fp8p_ring_staged_lazy",
        "seesaw_fp8p_ring_wg1of_lazy", "balanced_fp8p_ring_wg1of_lazy", "mma", "wgmma_t", "ours", "ours_qpf",
        "fa3")
DEFAULT_WAYS = ("wgmma", "seesaw", "mma", "fa3")
MAX_SETS = 8
KV = {"kv": "bf16"}  # set by --kv: "bf16" or "fp8"
FP8P_RING = {"ring": None}  # set by --fp8p-ring: the ring ways' size (None: fp8p_ring.RING_DEFAULT)
RING_WAY = re.compile(r"^(seesaw|balanced)_fp8p_ring(\d*)(_staged)?(_wg1of)?(_lazy)?$")


def ring_of(name):
    """The fp8p_ring size of a ring way (its name's digits, else --fp8p-ring, else the default); 0 otherwise."""
    m = RING_WAY.match(name)
    if not m:
        return 0
    if m.group(2):
        return int(m.group(2))
    if FP8P_RING["ring"]:
        return FP8P_RING["ring"]
    from mla_cute_dsl.kernels.fp8p_ring import RING_DEFAULT

    return RING_DEFAULT


def stage_of(name):
    """The fp8p_stage of a ring way: fp8p_ring.STAGE_SLOTS for a *_staged* way, else 0."""
    m = RING_WAY.match(name)
    if not m or not m.group(3):
        return 0
    from mla_cute_dsl.kernels.fp8p_ring import STAGE_SLOTS

    return STAGE_SLOTS


def wg1of_of(name):
    """Whether a ring way asks for wg1_other_first (its name has _wg1of before _lazy; branch fp8-wg1of)."""
    m = RING_WAY.match(name)
    return bool(m and m.group(4))


def known_way(name):
    return name in WAYS or RING_WAY.match(name) is not None


def kv_torch_dtype(torch):
    return torch.float8_e4m3fn if KV["kv"] == "fp8" else torch.bfloat16


def kv_elem_bytes():
    return 1 if KV["kv"] == "fp8" else 2


def parse_shapes(text):
    out = []
    for tok in text.split(","):
        tok = tok.strip()
        if tok.isdigit():
            out.append(SHAPES[int(tok)])
        else:
            b, h, s_q, s = (int(x) for x in tok.lower().split("x"))
            out.append((b, h, s_q, s))
    return out


# -- inputs ------------------------------------------------------------------------------


def make_sets(torch, B, H, s_q, S, l2_bytes, n_sets, seed=0):
    """n_sets input sets, each with its own q and kv cache; one shared (shuffled) page table."""
    pages = -(-S // PAGE)
    P = B * pages
    set_kv_bytes = P * PAGE * 576 * kv_elem_bytes()
    if n_sets is None:
        n_sets = max(1, min(MAX_SETS, math.ceil(4 * l2_bytes / set_kv_bytes)))
    g = torch.Generator(device="cuda").manual_seed(seed)
    table = torch.randperm(P, device="cuda", generator=g).view(B, pages).to(torch.int32)
    lens = torch.full((B,), S, dtype=torch.int32, device="cuda")
    sets = []
    for _ in range(n_sets):
        q = torch.randn(B, s_q, H, 576, device="cuda", generator=g, dtype=torch.bfloat16)
        kv = torch.randn(P, PAGE, 576, device="cuda", generator=g, dtype=torch.bfloat16).to(kv_torch_dtype(torch))
        sets.append({"q": q, "kv": kv})
    return sets, table, lens


# -- the ways: each returns run(i, out, lse) for input set i -------------------------


def _partial_only_balanced_tma(q, kv_cache, page_table, kv_lens, sm_scale, kv_scale, out, lse, schedule, workspace):
    """The balanced TMA seesaw's partial kernel alone, as api.launch_balanced launches it, without the combine
    kernel that follows it there: what that combine costs when the plan splits no request (it then merges
    nothing, but its grid of one CTA per 4 query rows still runs). way_cute refuses a plan that splits a request."""
    import torch

    from mla_cute_dsl.kernels import api
    from mla_cute_dsl.kernels.sm90_wgmma_decode import get_partial_kernel_wgmma_seesaw_balanced

    partial = get_partial_kernel_wgmma_seesaw_balanced(
        api._TORCH_TO_NAME[q.dtype], api._TORCH_TO_NAME[kv_cache.dtype], partial=api.partial_name(workspace),
        wide_store=schedule.wide_store, tma=True)
    B, s_q, H, _ = q.shape
    R = s_q * H
    o_part, lse_part = workspace
    s = float(sm_scale) * float(kv_scale)
    stream = api._cu_stream(torch.cuda.current_stream().cuda_stream)
    partial(q.view(B, R, api.D_QK), kv_cache, page_table, kv_lens, out.view(B, R, api.D_V), lse.view(B, R),
            schedule.work_info, schedule.cta_ranges, o_part, lse_part, s * api.LOG2_E, s, float(kv_scale), s_q, H,
            stream)
    return out, lse


def way_cute(torch, name, sets, table, lens, lens_cpu, s_q, H):
    from mla_cute_dsl.kernels import alloc_workspace, make_schedule

    if name == "wgmma":
        from mla_cute_dsl.kernels.sm90_wgmma_decode import mla_decode_sm90_wgmma as fn
    elif name in ("seesaw", "seesaw_l2pf", "seesaw_nopf", "seesaw_tma", "seesaw_tma_l2pf", "seesaw_fenced",
                  "seesaw_tma_fenced", "seesaw_lazy", "seesaw_fp8p", "seesaw_fp8p_lazy") or (
                      name.startswith("seesaw_fp8p_ring") and RING_WAY.match(name)):
        import functools

        from mla_cute_dsl.kernels.sm90_wgmma_decode import mla_decode_sm90_wgmma_seesaw

        if ring_of(name) and KV["kv"] != "fp8":
            raise ValueError(f"{name}: needs --kv fp8 (the producer warpgroup converts an fp8 cache)")
        prefetch = {"seesaw_l2pf": True, "seesaw_nopf": False, "seesaw_tma_l2pf": True}.get(name)  # None: default
        fn = functools.partial(mla_decode_sm90_wgmma_seesaw, l2_prefetch=prefetch, tma=name.startswith("seesaw_tma"),
                               reader_fences=name.endswith("_fenced"), lazy_rescale=name.endswith("_lazy"),
                               fp8_producer=name.startswith("seesaw_fp8p"),
                               **({"fp8p_ring": ring_of(name)} if ring_of(name) else {}),
                               **({"fp8p_stage": stage_of(name)} if stage_of(name) else {}),
                               **({"wg1_other_first": True} if wg1of_of(name) else {}))
    elif name in ("balanced_tma", "balanced_tma_lazy", "balanced_tma_pdl"):
        # the balanced TMA seesaw; _lazy: with lazy_rescale; _pdl: its combine launched with programmatic dependent
        # launch (the schedule's pdl_combine, set below)
        import functools

        from mla_cute_dsl.kernels.sm90_wgmma_decode import mla_decode_sm90_wgmma_seesaw_balanced

        fn = functools.partial(mla_decode_sm90_wgmma_seesaw_balanced, tma=True, lazy_rescale=name.endswith("_lazy"))
    elif name in ("balanced", "balanced_lazy", "balanced_fp8p", "balanced_fp8p_lazy") or (
            name.startswith("balanced_fp8p_ring") and RING_WAY.match(name)):
        # the balanced seesaw without TMA: cp.async with a 16-bit cache, the fp8 loads with --kv fp8 (inline, or
        # _fp8p: the producer warpgroup, fp8 only)
        import functools

        from mla_cute_dsl.kernels.sm90_wgmma_decode import mla_decode_sm90_wgmma_seesaw_balanced

        if name.startswith("balanced_fp8p") and KV["kv"] != "fp8":
            raise ValueError(f"{name}: needs --kv fp8 (the producer warpgroup converts an fp8 cache)")
        fn = functools.partial(mla_decode_sm90_wgmma_seesaw_balanced, lazy_rescale=name.endswith("_lazy"),
                               **({"fp8_producer": True} if name.startswith("balanced_fp8p") else {}),
                               **({"fp8p_ring": ring_of(name)} if ring_of(name) else {}),
                               **({"fp8p_stage": stage_of(name)} if stage_of(name) else {}),
                               **({"wg1_other_first": True} if wg1of_of(name) else {}))
    elif name in ("balanced_tma_qpf", "balanced_tma_lazy_qpf", "balanced_qpf", "balanced_lazy_qpf"):
        # the balanced seesaw with q_prefetch (16-bit KV): TMA or cp.async loads, eager or lazy rescale
        import functools

        from mla_cute_dsl.kernels.sm90_wgmma_decode import mla_decode_sm90_wgmma_seesaw_balanced

        if KV["kv"] == "fp8":
            raise ValueError(f"{name}: q_prefetch needs a 16-bit KV cache (no --kv fp8)")
        fn = functools.partial(mla_decode_sm90_wgmma_seesaw_balanced, tma=name.startswith("balanced_tma"),
                               lazy_rescale="_lazy" in name, q_prefetch=True)
    elif name in ("balanced_tma_lazy_qpf_wg1of", "balanced_tma_lazy_wg1of"):
        # balanced_tma_lazy_qpf / balanced_tma_lazy with wg1_other_first (branch qk-order; 16-bit KV)
        import functools

        from mla_cute_dsl.kernels.sm90_wgmma_decode import mla_decode_sm90_wgmma_seesaw_balanced

        if KV["kv"] == "fp8":
            raise ValueError(f"{name}: wg1_other_first needs a 16-bit KV cache (no --kv fp8)")
        fn = functools.partial(mla_decode_sm90_wgmma_seesaw_balanced, tma=True, lazy_rescale=True,
                               **({"q_prefetch": True} if "_qpf" in name else {}), wg1_other_first=True)
    elif name in ("balanced_tma_lazy_tmap", "balanced_tma_lazy_tmap_wg1of"):
        # the balanced TMA seesaw with the TMA producer warpgroup (16-bit KV), lazy rescale; _wg1of: with
        # wg1_other_first (branch tmap-wg1of)
        import functools

        from mla_cute_dsl.kernels.sm90_wgmma_decode import mla_decode_sm90_wgmma_seesaw_balanced

        if KV["kv"] == "fp8":
            raise ValueError(f"{name}: tma_producer needs a 16-bit KV cache (no --kv fp8)")
        fn = functools.partial(mla_decode_sm90_wgmma_seesaw_balanced, tma=True, lazy_rescale=True, tma_producer=True,
                               **({"wg1_other_first": True} if name.endswith("_wg1of") else {}))
    elif name == "balanced_tma_nocomb":
        fn = _partial_only_balanced_tma  # the same kernel without its combine launch (unsplit plans only)
    elif name == "wgmma_t":
        from mla_cute_dsl.kernels.sm90_wgmma_t_decode import mla_decode_sm90_wgmma_t as fn
    else:
        from mla_cute_dsl.kernels import mla_decode_sm90 as fn
    n_sm = torch.cuda.get_device_properties(0).multi_processor_count
    # ctas_per_sm=1: what wgmma_t needs; the balanced seesaw's own schedule kind
    sched = make_schedule(lens_cpu, s_q, H, n_sm, balanced=name.startswith("balanced"))
    sched.pdl_combine = name.endswith("_pdl")
    if name.endswith("_nocomb") and int((sched.split_info[:, 1] > 1).sum()) > 0:
        raise ValueError(f"{name}: this plan splits a request; its partials need the combine")
    ws = alloc_workspace(sched)

    def run(i, out, lse):
        st = sets[i]
        fn(st["q"], st["kv"], table, lens, SM_SCALE, 1.0, out, lse, sched, ws)

    info = {"items": sched.num_items, "blocks_per_split": sched.blocks_per_split, "block_m": sched.block_m}
    return run, info, None


def way_decoder(torch, sets, table, lens, lens_cpu, s_q, H, B, S, backend="flashinfer_mla", cute_options=None):
    """A way through mlacore.MLADecoder with the dispatcher forced to `backend`: FlashInfer fa3 ("fa3"),
    or cute_dsl_mla with its default options ("ours") or these `cute_options` ("ours_qpf")."""
    from mlacore import Dispatcher, MLADecoder, parse_policy

    options = {"flashinfer_mla": {"options": {"variant": "fa3", "launch": "direct"}}} if backend == "flashinfer_mla" else {}
    if cute_options:
        options = {"cute_dsl_mla": {"options": dict(cute_options)}}
    policy = parse_policy({"mla": {"order": [backend], "fallback": "error"}, "backend": options})
    dec = MLADecoder(H, PAGE, kv_dtype=kv_torch_dtype(torch), device="cuda", sm_scale=SM_SCALE, kv_scale=1.0,
                     dispatcher=Dispatcher(policy=policy, env={}), cuda_graph=True, max_batch=B, max_kv_len=S)
    t0 = time.perf_counter()
    plan = dec.plan(lens, table, s_q, kv_lens_host=lens_cpu, page_table_host=table.cpu())
    plan_s = time.perf_counter() - t0
    variant = getattr(plan.options, "variant", None)
    if plan.backend != backend or (backend == "flashinfer_mla" and variant != "fa3"):
        raise RuntimeError(f"planned {plan.backend} variant {variant}, wanted {backend}")

    def run(i, out, lse):
        st = sets[i]
        dec.run(st["q"], st["kv"], plan, out=out, lse=lse)

    info = {"plan_s": round(plan_s, 3), "direct_launch": getattr(plan.planned, "direct", None) is not None}
    return run, info, dec


# -- timing --------------------------------------------------------------------------------


def time_graph(run, outs, lses, reps):
    """Median µs per call of one runner and how it was timed: `mla bench`'s single-backend timer
    (mlacore.tools.bench.time_calls), a CUDA graph of one call per input set, its replays timed with CUDA events.
    Several runners side by side: time_rows (interleaved)."""
    from mlacore.tools.bench import time_calls

    return time_calls(_all_sets(run, outs, lses), len(outs), "cuda", True, min_repeats=reps, max_repeats=reps)


def _all_sets(run, outs, lses):
    """One call per input set: what a timed replay runs."""
    def calls():
        for i in range(len(outs)):
            run(i, outs[i], lses[i])
    return calls


def diff(torch, out, lse, ref_out, ref_lse):
    o, r = out.float(), ref_out.float()
    fin = torch.isfinite(ref_lse) & torch.isfinite(lse)
    return {
        "out_max_abs": float((o - r).abs().max()),
        "out_rel": float((o - r).norm() / r.norm().clamp_min(1e-30)),
        "lse_max_abs": float((lse[fin] - ref_lse[fin]).abs().max()) if bool(fin.any()) else 0.0,
        "nan": bool(torch.isnan(out).any() or torch.isnan(lse).any()),
        "lse_inf_differs": bool((torch.isfinite(lse) != torch.isfinite(ref_lse)).any()),
    }


# -- one shape -----------------------------------------------------------------------------


def bench_shape(torch, shape, ways, reps, n_sets, l2_bytes):
    B, H, s_q, S = shape
    sets, table, lens = make_sets(torch, B, H, s_q, S, l2_bytes, n_sets)
    lens_cpu = lens.cpu()
    n = len(sets)
    nbytes = B * S * 576 * kv_elem_bytes() + B * s_q * H * (576 + 512) * 2
    flops = 2 * B * s_q * H * S * (576 + 512)
    rows = {}
    runners = {}
    first = {}
    closers = []
    for name in ways:
        row = rows[name] = {"B": B, "H": H, "s_q": s_q, "S": S, "kv": KV["kv"], "way": name, "status": "ok", "sets": n,
                            "bytes": nbytes, "flops": flops}
        outs = [torch.full((B, s_q, H, 512), float("nan"), dtype=torch.bfloat16, device="cuda") for _ in range(n)]
        lses = [torch.full((B, s_q, H), float("nan"), dtype=torch.float32, device="cuda") for _ in range(n)]
        try:
            if name in ("fa3", "ours", "ours_qpf"):
                run, info, dec = way_decoder(torch, sets, table, lens, lens_cpu, s_q, H, B, S,
                                         backend="flashinfer_mla" if name == "fa3" else "cute_dsl_mla",
                                         cute_options={"q_prefetch": True} if name == "ours_qpf" else None)
                closers.append(dec)
            else:
                run, info, _ = way_cute(torch, name, sets, table, lens, lens_cpu, s_q, H)
            row.update(info)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            run(0, outs[0], lses[0])
            torch.cuda.synchronize()
            row["first_call_s"] = round(time.perf_counter() - t0, 3)
            first[name] = (outs[0].clone(), lses[0].clone())
            runners[name] = (run, outs, lses)
        except Exception as exc:  # report, keep going with the other ways
            row["status"] = "error"
            row["error"] = f"{type(exc).__name__}: {exc}"[:400]
    ref = "fa3" if "fa3" in first else next(iter(first), None)
    for name in first:
        if name != ref:
            d = diff(torch, *first[name], *first[ref])
            rows[name].update(d, ref=ref)
            bad = d["nan"] or d["lse_inf_differs"] or d["out_rel"] > 1e-2 or d["lse_max_abs"] > 1e-2
            if bad:
                rows[name]["status"] = "mismatch"
            print(f"  check {name} vs {ref}: out max abs {d['out_max_abs']:.2e} rel {d['out_rel']:.2e}, "
                  f"lse max abs {d['lse_max_abs']:.2e}{', NaN' if d['nan'] else ''}"
                  f"{', -inf rows differ' if d['lse_inf_differs'] else ''}{'  MISMATCH' if bad else ''}",
                  flush=True)
    return time_rows(runners, rows, reps, nbytes, flops, closers)


def time_rows(runners, rows, reps, nbytes, flops, closers):
    """Time every runner together (`mla bench`'s timer, mlacore.tools.bench.time_prepared_interleaved: CUDA graphs of
    one call per input set, replays timed with CUDA events in rounds whose order rotates, so that a drift of the
    GPU's clock falls on every way alike), fill each row (us, GB/s, TFLOP/s, x fa3), close the decoders."""
    from mlacore.tools.bench import prepare_target, time_prepared_interleaved

    prepared = {}
    for name, (run, outs, lses) in runners.items():
        try:  # warm-up and capture per way: a failure is that way's alone
            prepared[name] = prepare_target(_all_sets(run, outs, lses), "cuda", True)
        except Exception as exc:
            rows[name]["status"] = "error"
            rows[name]["error"] = f"timing: {type(exc).__name__}: {exc}"[:400]
    names = list(prepared)
    try:
        timed = time_prepared_interleaved([prepared[n] for n in names], len(runners[names[0]][1]) if names else 1,
                                          "cuda", min_repeats=reps, max_repeats=reps)
    except Exception as exc:  # a replay failing inside the rounds: report every way timed with it
        timed = []
        for n in names:
            rows[n]["status"] = "error"
            rows[n]["error"] = f"timing: {type(exc).__name__}: {exc}"[:400]
    for name, (med, how) in zip(names, timed):
        rows[name].update(us=round(med, 2), timing=how, gbps=round(nbytes / med / 1e3, 1),
                          tflops=round(flops / med / 1e6, 1))
    fa3_us = rows.get("fa3", {}).get("us")
    for row in rows.values():
        if fa3_us and row.get("us"):
            row["x_fa3"] = round(fa3_us / row["us"], 3)
    for dec in closers:
        dec.close()
    return list(rows.values())


def print_table(rows):
    head = (f"{'B':>4} {'H':>4} {'s_q':>3} {'S':>6}  {'way':<6} {'status':<8} {'1st s':>7} {'med us':>9} "
            f"{'GB/s':>6} {'TFLOP/s':>7} {'x fa3':>6} {'|dout|':>8} {'|dlse|':>8} {'sets':>4}")
    print("\n" + head)
    print("-" * len(head))
    for r in rows:
        def num(k, fmt):
            return format(r[k], fmt) if r.get(k) is not None else "-"
        print(f"{r['B']:>4} {r['H']:>4} {r['s_q']:>3} {r['S']:>6}  {r['way']:<6} {r['status']:<8} "
              f"{num('first_call_s', '7.2f'):>7} {num('us', '9.1f'):>9} "
              f"{num('gbps', '6.0f'):>6} {num('tflops', '7.1f'):>7} {num('x_fa3', '6.2f'):>6} "
              f"{num('out_max_abs', '8.1e'):>8} {num('lse_max_abs', '8.1e'):>8} {r['sets']:>4}"
              + (f"  {r['error'][:100]}" if r.get("error") else ""))


def versions():
    from importlib import metadata

    out = {}
    for dist in ("torch", "flashinfer-python", "nvidia-cutlass-dsl", "mlacore", "mla-cute-dsl", "mla-flashinfer"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(
        description="Time the WGMMA and mma.sync CuTe DSL MLA decode kernels beside FlashInfer fa3 "
                    "(through mlacore) on one SM90 GPU, in CUDA graphs.",
        epilog="shapes (index: B x H x s_q x S): "
               + ", ".join(f"{i}: {'x'.join(map(str, s))}" for i, s in enumerate(SHAPES)))
    ap.add_argument("--shapes", help="comma-separated shape indices or BxHxSQxS (default: all)")
    ap.add_argument("--quick", action="store_true",
                    help=f"shapes {','.join(map(str, QUICK_SHAPES))} only (unless --shapes), 100 replays")
    ap.add_argument("--ways", default=",".join(DEFAULT_WAYS),
                    help=f"subset of {','.join(WAYS)} (default: {','.join(DEFAULT_WAYS)})")
    ap.add_argument("--reps", type=int, help="graph replays per way and shape (default 200, --quick 100)")
    ap.add_argument("--sets", type=int, help=f"input sets (default: enough for 4x L2, at most {MAX_SETS})")
    ap.add_argument("--kv", choices=("bf16", "fp8"), default="bf16", help="KV cache dtype (q is bf16)")
    ap.add_argument("--fp8p-ring", type=int, metavar="R",
                    help="ring size of the *_fp8p_ring* ways without a size in their name (default: "
                         "mla_cute_dsl.kernels.fp8p_ring.RING_DEFAULT)")
    ap.add_argument("--json", metavar="PATH", help="also write the rows as JSON here")
    args = ap.parse_args(argv)
    KV["kv"] = args.kv
    FP8P_RING["ring"] = args.fp8p_ring
    shapes = parse_shapes(args.shapes) if args.shapes else (
        [SHAPES[i] for i in QUICK_SHAPES] if args.quick else list(SHAPES))
    ways = [w.strip() for w in args.ways.split(",") if w.strip()]
    if not ways or any(not known_way(w) for w in ways):
        ap.error(f"--ways: choose from {','.join(WAYS)} (ring ways may name their size: seesaw_fp8p_ring5_lazy)")
    reps = args.reps or (100 if args.quick else 200)

    import torch

    if not torch.cuda.is_available():
        print("wgmma_speed: no CUDA device (this benchmark needs an SM90 GPU such as the H200)", file=sys.stderr)
        return 2
    cap = torch.cuda.get_device_capability()
    if cap[0] != 9:
        print(f"wgmma_speed: needs an SM90 GPU, this one is sm_{cap[0]}{cap[1]}", file=sys.stderr)
        return 2
    props = torch.cuda.get_device_properties(0)
    l2 = int(getattr(props, "L2_cache_size", 0) or (50 << 20))
    print(f"{props.name}, {props.multi_processor_count} SMs, L2 {l2 >> 20} MiB; {reps} replays; "
          f"ways {','.join(ways)}; kv {args.kv}", flush=True)
    t_start = time.perf_counter()
    rows = []
    for shape in shapes:
        B, H, s_q, S = shape
        print(f"B={B} H={H} s_q={s_q} S={S} ...", flush=True)
        t0 = time.perf_counter()
        try:
            got = bench_shape(torch, shape, ways, reps, args.sets, l2)
        except Exception as exc:  # e.g. out of memory building the inputs
            got = [{"B": B, "H": H, "s_q": s_q, "S": S, "way": w, "status": "error", "sets": 0,
                    "error": f"{type(exc).__name__}: {exc}"[:400]} for w in ways]
        rows += got
        for r in got:
            extra = f"{r['us']:.1f} us, first call {r.get('first_call_s')} s" if r.get("us") else r.get("error", "")
            print(f"  {r['way']:<6} {r['status']:<8} {extra}", flush=True)
        print(f"  ({time.perf_counter() - t0:.1f} s)", flush=True)
        torch.cuda.empty_cache()
    print_table(rows)
    print(f"\ntotal {time.perf_counter() - t_start:.0f} s")
    if args.json:
        data = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "device": props.name, "sms": props.multi_processor_count,
                "l2_bytes": l2, "reps": reps, "sm_scale": SM_SCALE, "page_size": PAGE, "kv_dtype": args.kv,
                "versions": versions(), "rows": rows}
        with open(args.json, "w") as fh:
            json.dump(data, fh, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
