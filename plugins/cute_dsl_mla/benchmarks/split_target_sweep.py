"""Small decode steps: does splitting KV over fewer CTAs help? Our even split-KV kernels with the schedule's CTA
target lowered (fewer, longer work items: fewer partial slots to write and combine, fewer Q loads and pipeline
fills) against FlashInfer fa3, same process, same inputs, CUDA-graph replay (bench_kernel.time_graph).

Why: at H=16 s_q=2 (32 rows) with 300-600 KV blocks per step, fa3 leads by 16-19% (ninth session, B16 S2048 25.1
vs 21.1 us); the schedule spreads such a step over all 132 SMs, ~4 blocks per CTA, so per-CTA fixed costs and the
fp32 partial traffic (32 rows x 513 x 4 B per slot, written and read back) weigh against ~4 x 74 KB of KV.

Usage: python split_target_sweep.py [--targets 132,99,66,44] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math

import torch

from bench_kernel import L2_BYTES, copy_ceiling_gbps, fa3_runner, make_set, time_graph
from mla_cute_dsl.kernels import alloc_workspace, make_schedule, mla_decode_sm90
from mla_cute_dsl.kernels.sm90_wgmma_t_decode import mla_decode_sm90_wgmma_t

SHAPES = [  # B, H, s_q, S
    (16, 16, 2, 2048),
    (16, 16, 2, 4096),
    (8, 16, 2, 2048),
    (32, 16, 2, 1024),
    (64, 16, 2, 512),
    (16, 16, 1, 2048),
]
KERNELS = {"mma_sync": mla_decode_sm90, "wgmma_t": mla_decode_sm90_wgmma_t}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--targets", default="132,99,66,44")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--json")
    a = ap.parse_args()
    targets = [int(t) for t in a.targets.split(",")]
    ceil = copy_ceiling_gbps()
    print(f"copy ceiling {ceil:.0f} GB/s", flush=True)
    rows = []
    for B, H, s_q, S in SHAPES:
        nbytes = B * S * 576 * 2 + B * s_q * H * (576 + 512) * 2
        n_sets = max(1, min(16, math.ceil(2 * L2_BYTES / nbytes)))
        sets = [make_set(B, H, s_q, S, "bf16", 100 + i) for i in range(n_sets)]
        lens = torch.full((B,), S, dtype=torch.int32, device="cuda")
        outs = [torch.empty(B, s_q, H, 512, dtype=torch.bfloat16, device="cuda") for _ in sets]
        lses = [torch.empty(B, s_q, H, dtype=torch.float32, device="cuda") for _ in sets]
        res = {"shape": f"B{B} H{H} sq{s_q} S{S}", "blocks": B * -(-S // 64)}
        fa3, fa3_outs = fa3_runner(sets, B, H, s_q, S, "bf16")
        res["fa3_us"] = time_graph(fa3, n_sets, a.reps)[0]
        ref = fa3_outs[0].float().view(B, s_q, H, 512)
        for kname, fn in KERNELS.items():
            for t in targets:
                sched = make_schedule([S] * B, s_q, H, t)
                ws = alloc_workspace(sched)

                def run(i, sched=sched, ws=ws, fn=fn):
                    st = sets[i]
                    fn(st["q"], st["kv"], st["pt"], lens, 1.0 / math.sqrt(192), st["scale"], outs[i], lses[i],
                       sched, ws, check=False)

                try:
                    us = time_graph(run, n_sets, a.reps)[0]
                except Exception as exc:  # report, keep going
                    res[f"{kname}_{t}_error"] = repr(exc)[:200]
                    continue
                diff = float((outs[0].float() - ref).norm() / ref.norm())
                res[f"{kname}_{t}"] = dict(us=us, items=sched.num_items, bps=sched.blocks_per_split,
                                           rel_diff_vs_fa3=diff)
                del ws
        rows.append(res)
        line = " ".join(f"{k}={v['us']:.1f}({v['items']}it,{v['bps']}b)" for k, v in res.items()
                        if isinstance(v, dict))
        print(f"{res['shape']:<20} blocks={res['blocks']:<5} fa3={res['fa3_us']:.1f}  {line}", flush=True)
        sets = outs = lses = None
        torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"copy_gbps": ceil, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
