"""Time the fp8 H=16 variant of the CuTe DSL MLA decode kernel on one SM90 GPU.

    fp8reg   mla_cute_dsl's fp8 H=16 variant (sm90_decode_fp8, fragments converted in
             registers, no fp16 K tile), schedule for 2 CTAs per SM (--ctas to change)
    fp8reg_a2, fp8reg_a4
             the same kernel with 2 / 4 independent S accumulators per warp (s_accs)
    mma      mla_cute_dsl's verified mma.sync kernel (api.mla_decode_sm90), 1 CTA per SM
    fa3      FlashInfer fa3 through mlacore.MLADecoder (dispatcher forced to
             flashinfer_mla, variant fa3)

KV fp8-e4m3 (kv_scale 0.5), q bf16, page 64, every request of length S; partial O in q's dtype
(the backend's default, partials=auto) unless --partials fp32.  Same
method as wgmma_speed.py: first call timed alone (compile or disk load), outputs
compared with fa3's, then each way captured in one CUDA graph over several input
sets (together >= 4x L2) and the replays timed with CUDA events, median.
GB/s counts B*S*576 + q + out bytes (the NOTES.md convention).

From the repository root, with the project and the plugins installed:
    python benchmarks/fp8_h16_speed.py [--shapes 0,1|64x16x1x8192] [--ctas 1,2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from wgmma_speed import diff, print_table, time_rows, versions  # noqa: E402

PAGE = 64
SM_SCALE = 1.0 / math.sqrt(128 + 64)
KV_SCALE = 0.5
SHAPES = [  # (B, H, s_q, S): the fp8 H=16 targets (<= 85 us each), then smaller
    (64, 16, 1, 8192),
    (128, 16, 2, 4096),
    (128, 16, 1, 8192),
    (64, 16, 2, 4096),
    (1, 16, 1, 4096),
]
MAX_SETS = 8


def make_sets(torch, B, H, s_q, S, l2_bytes, n_sets, seed=0):
    pages = -(-S // PAGE)
    P = B * pages
    set_kv_bytes = P * PAGE * 576
    if n_sets is None:
        n_sets = max(1, min(MAX_SETS, math.ceil(4 * l2_bytes / set_kv_bytes)))
    g = torch.Generator(device="cuda").manual_seed(seed)
    table = torch.randperm(P, device="cuda", generator=g).view(B, pages).to(torch.int32)
    lens = torch.full((B,), S, dtype=torch.int32, device="cuda")
    sets = []
    for _ in range(n_sets):
        q = torch.randn(B, s_q, H, 576, device="cuda", generator=g, dtype=torch.bfloat16)
        kv = (torch.randn(P, PAGE, 576, device="cuda", generator=g) * 2).to(torch.float8_e4m3fn)
        sets.append({"q": q, "kv": kv})
    return sets, table, lens


def way_cute(torch, name, sets, table, lens, lens_cpu, s_q, H, ctas, partial_dtype):
    import functools

    from mla_cute_dsl.kernels import alloc_workspace, make_schedule

    if name.startswith("fp8reg"):
        from mla_cute_dsl.kernels.sm90_decode_fp8 import mla_decode_sm90_fp8

        fn = functools.partial(mla_decode_sm90_fp8, s_accs=int(name[len("fp8reg_a"):]) if "_a" in name else 1)
    else:
        from mla_cute_dsl.kernels import mla_decode_sm90 as fn
        ctas = 1
    n_sm = torch.cuda.get_device_properties(0).multi_processor_count
    sched = make_schedule(lens_cpu, s_q, H, n_sm, ctas_per_sm=ctas)
    ws = alloc_workspace(sched, partial_dtype=partial_dtype)

    def run(i, out, lse):
        st = sets[i]
        fn(st["q"], st["kv"], table, lens, SM_SCALE, KV_SCALE, out, lse, sched, ws)

    return run, {"items": sched.num_items, "blocks_per_split": sched.blocks_per_split,
                 "block_m": sched.block_m, "ctas_per_sm": ctas}


def way_fa3(torch, sets, table, lens, lens_cpu, s_q, H, B, S):
    from mlacore import Dispatcher, MLADecoder, parse_policy

    policy = parse_policy({"mla": {"order": ["flashinfer_mla"], "fallback": "error"},
                           "backend": {"flashinfer_mla": {"options": {"variant": "fa3", "launch": "direct"}}}})
    dec = MLADecoder(H, PAGE, kv_dtype=torch.float8_e4m3fn, device="cuda", sm_scale=SM_SCALE,
                     kv_scale=KV_SCALE, dispatcher=Dispatcher(policy=policy, env={}), cuda_graph=True,
                     max_batch=B, max_kv_len=S)
    plan = dec.plan(lens, table, s_q, kv_lens_host=lens_cpu, page_table_host=table.cpu())
    variant = getattr(plan.options, "variant", None)
    if plan.backend != "flashinfer_mla" or variant != "fa3":
        raise RuntimeError(f"planned {plan.backend} variant {variant}, wanted flashinfer_mla fa3")

    def run(i, out, lse):
        st = sets[i]
        dec.run(st["q"], st["kv"], plan, out=out, lse=lse)

    return run, {}, dec


def bench_shape(torch, shape, ways, reps, n_sets, l2_bytes, ctas_list, partial_dtype):
    B, H, s_q, S = shape
    sets, table, lens = make_sets(torch, B, H, s_q, S, l2_bytes, n_sets)
    lens_cpu = lens.cpu()
    n = len(sets)
    nbytes = B * S * 576 + B * s_q * H * (576 + 512) * 2
    flops = 2 * B * s_q * H * S * (576 + 512)
    rows, runners, first, closers = {}, {}, {}, []
    todo = []
    for w in ways:
        if w.startswith("fp8reg"):
            todo += [(f"{w}/{c}", w, c) for c in ctas_list]
        else:
            todo.append((w, w, 1))
    for label, w, c in todo:
        row = rows[label] = {"B": B, "H": H, "s_q": s_q, "S": S, "way": label, "status": "ok", "sets": n,
                             "bytes": nbytes, "flops": flops}
        outs = [torch.full((B, s_q, H, 512), float("nan"), dtype=torch.bfloat16, device="cuda") for _ in range(n)]
        lses = [torch.full((B, s_q, H), float("nan"), dtype=torch.float32, device="cuda") for _ in range(n)]
        try:
            if w == "fa3":
                run, info, dec = way_fa3(torch, sets, table, lens, lens_cpu, s_q, H, B, S)
                closers.append(dec)
            else:
                run, info = way_cute(torch, w, sets, table, lens, lens_cpu, s_q, H, c, partial_dtype)
            row.update(info)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            run(0, outs[0], lses[0])
            torch.cuda.synchronize()
            row["first_call_s"] = round(time.perf_counter() - t0, 3)
            first[label] = (outs[0].clone(), lses[0].clone())
            runners[label] = (run, outs, lses)
        except Exception as exc:
            row["status"] = "error"
            row["error"] = f"{type(exc).__name__}: {exc}"[:400]
    ref = "fa3" if "fa3" in first else ("mma" if "mma" in first else next(iter(first), None))
    for label in first:
        if label != ref:
            d = diff(torch, *first[label], *first[ref])
            rows[label].update(d, ref=ref)
            bad = d["nan"] or d["lse_inf_differs"] or d["out_rel"] > 1e-2 or d["lse_max_abs"] > 1e-2
            if bad:
                rows[label]["status"] = "mismatch"
            print(f"  check {label} vs {ref}: out rel {d['out_rel']:.2e}, lse max abs {d['lse_max_abs']:.2e}"
                  f"{'  MISMATCH' if bad else ''}", flush=True)
    return time_rows(runners, rows, reps, nbytes, flops, closers)


def main(argv=None):
    ap = argparse.ArgumentParser(description="Time the fp8 H=16 CuTe DSL variant beside the verified "
                                             "kernel and FlashInfer fa3 (through mlacore), CUDA graphs.")
    ap.add_argument("--shapes", default="0,1", help="indices or BxHxSQxS, comma-separated (default 0,1)")
    ap.add_argument("--ways", default="fp8reg,mma,fa3")
    ap.add_argument("--ctas", default="2,1", help="schedules (CTAs per SM) for fp8reg (default 2,1)")
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--sets", type=int)
    ap.add_argument("--partials", choices=("q", "fp32"), default="q",
                    help="partial-O dtype of the cute ways (default q's: the backend's partials=auto)")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    shapes = []
    for tok in args.shapes.split(","):
        tok = tok.strip()
        shapes.append(SHAPES[int(tok)] if tok.isdigit() else tuple(int(x) for x in tok.lower().split("x")))
    ways = [w.strip() for w in args.ways.split(",") if w.strip()]
    ctas_list = [int(c) for c in args.ctas.split(",")]

    import torch

    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        print("fp8_h16_speed: needs an SM90 GPU (H100/H200)", file=sys.stderr)
        return 2
    props = torch.cuda.get_device_properties(0)
    l2 = int(getattr(props, "L2_cache_size", 0) or (50 << 20))
    print(f"{props.name}, {props.multi_processor_count} SMs, L2 {l2 >> 20} MiB; {args.reps} replays", flush=True)
    rows = []
    for shape in shapes:
        print(f"B={shape[0]} H={shape[1]} s_q={shape[2]} S={shape[3]} ...", flush=True)
        pdt = torch.bfloat16 if args.partials == "q" else torch.float32
        rows += bench_shape(torch, shape, ways, args.reps, args.sets, l2, ctas_list, pdt)
        torch.cuda.empty_cache()
    print_table(rows)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"date": time.strftime("%Y-%m-%d %H:%M:%S"), "device": props.name,
                       "kv_dtype": "fp8_e4m3", "kv_scale": KV_SCALE, "page_size": PAGE,
                       "versions": versions(), "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
