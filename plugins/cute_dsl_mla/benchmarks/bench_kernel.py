"""Benchmark the SM90 CuTe DSL MLA decode against FlashInfer fa3 in the same run.

CUDA-graph replay of a graph that runs the kernel over several rotating input
sets (together larger than L2), median over many replays, per-call time =
replay time / sets. Bytes = B*S*576*kv_bytes + q + out; FLOPs =
2*B*s_q*S*H*(576+512); % of a device-to-device copy ceiling measured here.
Also cross-checks our output against fa3's on the first set.

Usage: python bench_kernel.py [--json out.json] [--shapes issue|all] [--no-fa3]
       python bench_kernel.py --balanced [--json out.json]   # default vs balanced vs hybrid split-KV
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import torch

from mla_cute_dsl.kernels import alloc_workspace, make_schedule, mla_decode_sm90

SHAPES = [  # B, H, s_q, S, kv
    (1, 16, 1, 4096, "bf16"),
    (64, 16, 1, 8192, "bf16"),
    (128, 16, 2, 4096, "bf16"),
    (128, 128, 1, 4096, "bf16"),
    (128, 128, 2, 4096, "bf16"),
    (64, 16, 1, 8192, "fp8"),
    (128, 128, 1, 4096, "fp8"),
    (128, 16, 2, 4096, "fp8"),
]
PAGE = 64
# alternative (m_warps, m_atoms_per_warp, n_acc) layouts per BLOCK_M, timed with --variants
VARIANTS = {16: [(1, 1, 2), (1, 1, 4)], 32: [(1, 2, 1), (1, 2, 2), (2, 1, 4)], 64: [(2, 2, 1)]}
L2_BYTES = 60 << 20


def copy_ceiling_gbps(n_bytes=2 << 30):
    a = torch.empty(n_bytes // 4, dtype=torch.float32, device="cuda").uniform_()
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    ts = []
    for _ in range(10):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        b.copy_(a)
        e1.record()
        torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1) * 1e-3)
    del a, b
    return 2 * n_bytes / statistics.median(ts) / 1e9


def make_set(B, H, s_q, S, kv, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    pages = -(-S // PAGE)
    P = B * pages
    perm = torch.randperm(P, device="cuda", generator=g)
    pt = perm.view(B, pages).to(torch.int32)
    if kv == "fp8":
        cache = torch.randn(P, PAGE, 576, device="cuda", generator=g).to(torch.float8_e4m3fn)
        scale = 0.5
    else:
        cache = torch.randn(P, PAGE, 576, device="cuda", generator=g, dtype=torch.bfloat16)
        scale = 1.0
    q = torch.randn(B, s_q, H, 576, device="cuda", generator=g, dtype=torch.bfloat16)
    return dict(q=q, kv=cache, pt=pt, scale=scale)


def time_graph(fn_per_set, n_sets, reps=30):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(n_sets):
            fn_per_set(i)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        for i in range(n_sets):
            fn_per_set(i)
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        e1.record()
        torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1) * 1e3 / n_sets)
    return statistics.median(ts), min(ts), max(ts)


def fa3_runner(sets, B, H, s_q, S, kv):
    from flashinfer.mla import BatchMLAPagedAttentionWrapper, MLAPlanMetadata

    pages = -(-S // PAGE)
    dev = "cuda"
    ws = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    qo_indptr = torch.arange(B + 1, dtype=torch.int32, device=dev) * s_q
    kv_indptr = torch.arange(B + 1, dtype=torch.int32, device=dev) * pages
    kv_len = torch.full((B,), S, dtype=torch.int32, device=dev)
    w = BatchMLAPagedAttentionWrapper(
        ws, use_cuda_graph=True, qo_indptr=torch.empty_like(qo_indptr),
        kv_indptr=torch.empty_like(kv_indptr), kv_indices=torch.empty(B * pages, dtype=torch.int32, device=dev),
        kv_len_arr=torch.empty_like(kv_len), backend="fa3")
    w.plan(metadata=MLAPlanMetadata.csr(qo_indptr, kv_indptr, sets[0]["pt"].reshape(-1), kv_len),
           num_heads=H, head_dim_ckv=512, head_dim_kpe=64, page_size=PAGE, causal=s_q > 1,
           sm_scale=1.0 / math.sqrt(192), q_data_type=torch.bfloat16,
           kv_data_type=sets[0]["kv"].dtype, query_layout="packed", kv_cache_layout="packed",
           lse_mode="basee")
    outs = [torch.empty(B * s_q, H, 512, dtype=torch.bfloat16, device=dev) for _ in sets]
    lses = [torch.empty(B * s_q, H, dtype=torch.float32, device=dev) for _ in sets]
    scales = {"ckv_scale": sets[0]["scale"], "kpe_scale": sets[0]["scale"]} if kv == "fp8" else {}

    def run(i):
        st = sets[i]
        w.run(query=st["q"].view(B * s_q, H, 576), kv_cache=st["kv"], out=outs[i], lse=lses[i],
              return_lse=True, return_lse_base_on_e=True, **scales)

    return run, outs


# --balanced: B, H, s_q, S, kv, lo (None: every length S; else lengths uniform in lo..S, random.Random(1234))
BALANCED_SHAPES = [
    (64, 16, 1, 8192, "bf16", None),
    (128, 16, 2, 4096, "bf16", None),
    (1, 16, 1, 4096, "bf16", None),
    (32, 16, 1, 4096, "bf16", None),
    (100, 16, 1, 8192, "bf16", 1),
    (64, 16, 2, 8192, "bf16", 64),
    (128, 16, 1, 4096, "bf16", 1),
]
# --balanced ways: (name, balanced kernel, make_schedule form)
BALANCED_WAYS = [("default", False, "auto"), ("balanced", True, "balanced"), ("hybrid", True, "auto")]


def balanced_main(args):
    """The default mma.sync split-KV kernel vs the balanced one (mla_decode_sm90(..., balanced=True)) with the
    balanced plan forced and with the hybrid plan (make_schedule(balanced=True), what the backend's
    split_kv=balanced runs; the row says which form it picked), same process, same inputs, CUDA-graph
    replay."""
    import random

    n_sm = torch.cuda.get_device_properties(0).multi_processor_count
    ceil = copy_ceiling_gbps()
    print(f"copy ceiling {ceil:.0f} GB/s (read+write), {n_sm} SMs", flush=True)
    rows = []
    for B, H, s_q, S, kv, lo in BALANCED_SHAPES:
        varlen = lo is not None
        if varlen:
            rng = random.Random(1234)
            lens_l = [rng.randint(lo, S) for _ in range(B)]
        else:
            lens_l = [S] * B
        kvb = 1 if kv == "fp8" else 2
        nbytes = sum(lens_l) * 576 * kvb + B * s_q * H * (576 + 512) * 2
        n_sets = max(1, min(16, math.ceil(2 * L2_BYTES / nbytes)))
        sets = [make_set(B, H, s_q, S, kv, 100 + i) for i in range(n_sets)]
        lens = torch.tensor(lens_l, dtype=torch.int32, device="cuda")
        outs = [torch.empty(B, s_q, H, 512, dtype=torch.bfloat16, device="cuda") for _ in sets]
        lses = [torch.empty(B, s_q, H, dtype=torch.float32, device="cuda") for _ in sets]
        name = f"B{B} H{H} sq{s_q} S{S}{f' varlen {lo}..' if varlen else ''} {kv}"
        res = {"shape": name, "B": B, "H": H, "s_q": s_q, "S": S, "kv": kv, "varlen": varlen, "lo": lo,
               "bytes": nbytes, "sets": n_sets}
        ref = None
        for way, bal, form in BALANCED_WAYS:
            sched = make_schedule(lens_l, s_q, H, n_sm, balanced=bal, form=form)
            wsp = alloc_workspace(sched)

            def run(i, sched=sched, wsp=wsp, bal=bal):
                st = sets[i]
                mla_decode_sm90(st["q"], st["kv"], st["pt"], lens, 1.0 / math.sqrt(192), st["scale"],
                                outs[i], lses[i], sched, wsp, check=False, balanced=bal)

            try:
                t = time_graph(run, n_sets, args.reps)
            except Exception as e:  # report, keep going
                res[f"{way}_error"] = repr(e)[:300]
                continue
            res[f"{way}_us"], res[f"{way}_min_us"], res[f"{way}_max_us"] = t
            res[f"{way}_gbps"] = nbytes / t[0] / 1e3
            res[f"{way}_pct_copy"] = 100 * nbytes / t[0] / 1e3 / ceil
            res[f"{way}_items"] = sched.num_items
            res[f"{way}_max_blocks"] = sched.max_cta_blocks if bal else sched.blocks_per_split
            res[f"{way}_form"] = sched.form
            if bal:
                res[f"{way}_cost_even"], res[f"{way}_cost_balanced"] = sched.cost_even, sched.cost_balanced
            o = outs[0].float()
            if ref is None:
                ref = o.clone()
            else:
                res[f"{way}_rel_diff_vs_default"] = float((o - ref).norm() / ref.norm())
            del wsp
        rows.append(res)
        print(json.dumps(res), flush=True)
        sets = outs = lses = None  # free the inputs (not del: the timed closures name them)
        torch.cuda.empty_cache()
    print(f"\n{'shape':<36} {'default us':>10} {'balanced':>9} {'hybrid':>9} {'form':>8} {'hyb gain':>8} | "
          f"max blocks/CTA d/b/h | items d/b/h | predicted b/e | diff b, h")
    for r in rows:
        f = lambda k: f"{r.get(k, float('nan')):>9.1f}"
        gain = 100 * (1 - r.get("hybrid_us", float("nan")) / r.get("default_us", float("nan")))
        ratio = r.get("hybrid_cost_balanced", float("nan")) / (r.get("hybrid_cost_even") or float("nan"))
        err = r.get("hybrid_error") or r.get("balanced_error") or r.get("default_error") or ""
        print(f"{r['shape']:<36} {f('default_us'):>10} {f('balanced_us')} {f('hybrid_us')} "
              f"{r.get('hybrid_form', '?'):>8} {gain:>7.1f}% | "
              f"{r.get('default_max_blocks')}/{r.get('balanced_max_blocks')}/{r.get('hybrid_max_blocks')} | "
              f"{r.get('default_items')}/{r.get('balanced_items')}/{r.get('hybrid_items')} | {ratio:.3f} | "
              f"{r.get('balanced_rel_diff_vs_default', float('nan')):.1e} "
              f"{r.get('hybrid_rel_diff_vs_default', float('nan')):.1e} {err[:60]}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"copy_gbps": ceil, "rows": rows, "date": time.strftime("%Y-%m-%d %H:%M")}, fh, indent=1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--no-fa3", action="store_true")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--variants", action="store_true", help="also time alternative warp layouts")
    ap.add_argument("--balanced", action="store_true",
                    help="time the default split-KV kernel vs the balanced one, forced and hybrid (BALANCED_SHAPES) "
                         "instead")
    args = ap.parse_args()
    if args.balanced:
        return balanced_main(args)
    n_sm = torch.cuda.get_device_properties(0).multi_processor_count
    ceil = copy_ceiling_gbps()
    print(f"copy ceiling {ceil:.0f} GB/s (read+write), {n_sm} SMs", flush=True)
    rows = []
    for B, H, s_q, S, kv in SHAPES:
        kvb = 1 if kv == "fp8" else 2
        nbytes = B * S * 576 * kvb + B * s_q * H * (576 + 512) * 2
        flops = 2 * B * s_q * S * H * (576 + 512)
        n_sets = max(1, min(16, math.ceil(2 * L2_BYTES / nbytes)))
        sets = [make_set(B, H, s_q, S, kv, 100 + i) for i in range(n_sets)]
        sched = make_schedule([S] * B, s_q, H, n_sm)
        wsp = alloc_workspace(sched)
        lens = torch.full((B,), S, dtype=torch.int32, device="cuda")
        outs = [torch.empty(B, s_q, H, 512, dtype=torch.bfloat16, device="cuda") for _ in sets]
        lses = [torch.empty(B, s_q, H, dtype=torch.float32, device="cuda") for _ in sets]

        def ours(i):
            st = sets[i]
            mla_decode_sm90(st["q"], st["kv"], st["pt"], lens, 1.0 / math.sqrt(192), st["scale"],
                            outs[i], lses[i], sched, wsp, check=False)

        res = {"B": B, "H": H, "s_q": s_q, "S": S, "kv": kv, "bytes": nbytes, "flops": flops,
               "sets": n_sets, "items": sched.num_items, "bps": sched.blocks_per_split}
        t = time_graph(ours, n_sets, args.reps)
        res["ours_us"], res["ours_min_us"], res["ours_max_us"] = t
        if not args.no_fa3:
            try:
                fa3, fa3_outs = fa3_runner(sets, B, H, s_q, S, kv)
                t3 = time_graph(fa3, n_sets, args.reps)
                res["fa3_us"] = t3[0]
                a = outs[0].float().view(B * s_q, H, 512)
                bb = fa3_outs[0].float()
                res["rel_diff_vs_fa3"] = float((a - bb).norm() / bb.norm())
            except Exception as e:  # report, keep going
                res["fa3_error"] = repr(e)[:300]
        if args.variants:
            from mla_cute_dsl.kernels.schedule import block_m_for

            bm = block_m_for(s_q * H)
            for lay in VARIANTS.get(bm, []):
                def ours_v(i, lay=lay):
                    st = sets[i]
                    mla_decode_sm90(st["q"], st["kv"], st["pt"], lens, 1.0 / math.sqrt(192),
                                    st["scale"], outs[i], lses[i], sched, wsp, check=False, layout=lay)
                try:
                    tv = time_graph(ours_v, n_sets, args.reps)
                    vkey = "x".join(map(str, lay))
                    res[f"var_{vkey}_us"] = tv[0]
                    if "fa3_us" in res:
                        a = outs[0].float().view(B * s_q, H, 512)
                        res[f"var_{vkey}_diff"] = float((a - fa3_outs[0].float()).norm() / fa3_outs[0].float().norm())
                except Exception as e:
                    res[f"var_{'x'.join(map(str, lay))}_error"] = repr(e)[:200]
        for k in ("ours", "fa3"):
            if f"{k}_us" in res:
                us = res[f"{k}_us"]
                res[f"{k}_gbps"] = nbytes / us / 1e3
                res[f"{k}_tflops"] = flops / us / 1e6
                res[f"{k}_pct_copy"] = 100 * nbytes / us / 1e3 / ceil
        rows.append(res)
        print(json.dumps(res), flush=True)
        del sets, outs, lses, wsp
        torch.cuda.empty_cache()
    print(f"\n{'shape':<30} {'ours us':>8} {'GB/s':>6} {'TF/s':>6} {'%cp':>4} | {'fa3 us':>8} {'GB/s':>6} {'TF/s':>6} {'%cp':>4} | diff")
    for r in rows:
        name = f"B{r['B']} H{r['H']} sq{r['s_q']} S{r['S']} {r['kv']}"
        f = lambda k: f"{r.get(k, float('nan')):>8.1f}"
        print(f"{name:<30} {f('ours_us')} {r['ours_gbps']:>6.0f} {r['ours_tflops']:>6.0f} {r['ours_pct_copy']:>4.0f} | "
              f"{f('fa3_us')} {r.get('fa3_gbps', float('nan')):>6.0f} {r.get('fa3_tflops', float('nan')):>6.0f} "
              f"{r.get('fa3_pct_copy', float('nan')):>4.0f} | {r.get('rel_diff_vs_fa3', float('nan')):.2e} {r.get('fa3_error', '')[:60]}")
        var = {k[4:-3]: v for k, v in r.items() if k.startswith("var_") and k.endswith("_us")}
        if var:
            print("    layouts (m_warps x atoms x n_acc): " + ", ".join(
                f"{k}: {v:.1f} us (diff {r.get('var_' + k + '_diff', float('nan')):.1e})" for k, v in var.items()))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"copy_gbps": ceil, "rows": rows, "date": time.strftime("%Y-%m-%d %H:%M")}, fh, indent=1)


if __name__ == "__main__":
    main()
