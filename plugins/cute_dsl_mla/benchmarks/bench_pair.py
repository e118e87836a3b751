"""A/B of the experimental cluster pair merge (kernels/pair_merge.py) against the balanced entry's default plans.

Times, in one process on the same inputs (CUDA-graph replay over rotating input sets larger than L2, median per
call; bench_kernel.make_set / time_graph), mla_decode_sm90(..., balanced=True) with
  * hybrid:   make_schedule(balanced=True) (form auto: what the backend's split_kv=balanced runs) + combine kernel
  * balanced: form="balanced" forced + combine kernel
  * fused:    form="balanced", combine="fused" (last-arriving CTA merges through global memory)
  * pair:     form="pair" (2-CTA clusters merge each request's two halves through DSMEM; empty requests written
              by the same kernel): one launch, no combine kernel
  * pair+comb: the same plus the combine kernel, which has nothing to merge (api.launch_pair(combine=True)): what
              the combine's launch alone costs
each with the backend's default epilogue (wide stores, partials in q's dtype) unless --fp32-partials, and prints
the relative difference of every output to the hybrid's.

Usage (H200, next session):
    CUDA_VISIBLE_DEVICES=0 python plugins/cute_dsl_mla/benchmarks/bench_pair.py            # B=64 H=16 s_q=1 S=8192
    python plugins/cute_dsl_mla/benchmarks/bench_pair.py --shapes all --json pair_ab.json
Target (the issue): pair <= 146 us at B=64 H=16 s_q=1 S=8192 bf16 (balanced 143.9 us partial + combine, step 148.9).
"""

from __future__ import annotations

import argparse
import json
import math

import torch

from bench_kernel import L2_BYTES, make_set, time_graph
from mla_cute_dsl.kernels import alloc_workspace, api, make_schedule, mla_decode_sm90

SHAPES = {  # B, H, s_q, S (uniform lengths; B <= num_cols / 2 for the pair form)
    "issue": [(64, 16, 1, 8192)],
    "all": [(64, 16, 1, 8192), (64, 16, 2, 8192), (32, 16, 1, 8192), (64, 16, 1, 4096), (66, 16, 1, 8192)],
}
WAYS = [("hybrid", "auto", "auto"), ("balanced", "balanced", "auto"), ("fused", "balanced", "fused"),
        ("pair", "pair", "auto"), ("pair+comb", "pair", "auto")]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="issue", choices=sorted(SHAPES))
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--fp32-partials", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    n_sm = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for B, H, s_q, S in SHAPES[args.shapes]:
        nbytes = B * S * 576 * 2 + B * s_q * H * (576 + 512) * 2
        n_sets = max(1, min(16, math.ceil(2 * L2_BYTES / nbytes)))
        sets = [make_set(B, H, s_q, S, "bf16", 100 + i) for i in range(n_sets)]
        lens = torch.full((B,), S, dtype=torch.int32, device="cuda")
        outs = [torch.empty(B, s_q, H, 512, dtype=torch.bfloat16, device="cuda") for _ in sets]
        lses = [torch.empty(B, s_q, H, dtype=torch.float32, device="cuda") for _ in sets]
        res = {"shape": f"B{B} H{H} sq{s_q} S{S} bf16", "sets": n_sets}
        ref = None
        for way, form, combine in WAYS:
            try:
                sched = make_schedule([S] * B, s_q, H, n_sm, balanced=True, form=form, combine=combine)
                sched.wide_store = not args.fp32_partials
                wsp = alloc_workspace(sched, partial_dtype=torch.float32 if args.fp32_partials else torch.bfloat16)

                pk = None
                if way == "pair+comb":
                    pk = api.get_partial_kernel("bf16", "bf16", sched.block_m, balanced=True,
                                                partial=api.partial_name(wsp), wide_store=sched.wide_store, pair=True)

                def run(i, sched=sched, wsp=wsp, pk=pk):
                    st = sets[i]
                    if pk is not None:
                        api.launch_pair(pk, st["q"], st["kv"], st["pt"], lens, 1.0 / math.sqrt(192), st["scale"],
                                        outs[i], lses[i], sched, wsp, combine=True)
                        return
                    mla_decode_sm90(st["q"], st["kv"], st["pt"], lens, 1.0 / math.sqrt(192), st["scale"], outs[i],
                                    lses[i], sched, wsp, check=False, balanced=True)

                t = time_graph(run, n_sets, args.reps)
            except Exception as e:  # report, keep going
                res[f"{way}_error"] = repr(e)[:300]
                print(f"{res['shape']:28s} {way:9s} error {res[f'{way}_error']}", flush=True)
                continue
            res[f"{way}_us"] = t[0]
            res[f"{way}_form"] = sched.form
            o = outs[0].float()
            if ref is None:
                ref = o.clone()
            else:
                res[f"{way}_rel_diff"] = float((o - ref).norm() / ref.norm())
            print(f"{res['shape']:28s} {way:9s} {t[0]:8.1f} us (min {t[1]:.1f}, max {t[2]:.1f}) form {sched.form} "
                  f"rel diff {res.get(f'{way}_rel_diff', 0.0):.2e}", flush=True)
        rows.append(res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
