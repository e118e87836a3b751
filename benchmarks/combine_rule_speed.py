"""Time two combine kernels (the per-row MLACombine with one warp per row, MLACombineWide) behind the partial
kernel `mma=auto` picks, per shape, on one SM90 GPU: which is faster, and what `schedule.wide_combine_for` picks.
(The chunked per-row kernel of 0.2.7, four warps per row, is timed by `mla bench --backend
cute_dsl_mla:combine=chunked`: benchmarks/device/combine_ab_gpu.sh.)

Why: the rule (wide below one per-row CTA per SM) was chosen from a run that used an older rule; this
re-times it at batch 4-32 and at the cells where the per-row kernel has about as many CTAs as SMs.

    PYTHONPATH=plugins/cute_dsl_mla:. python benchmarks/combine_rule_speed.py [--shapes BxHxSQxS,...]
        [--kv bf16|fp8] [--reps N] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys

# batch 4-32 at TP8/TP1 head counts, and cells near 132 per-row CTAs (batch * ceil(rows / 4))
DEFAULT_SHAPES = ("4x16x1x4096,8x16x1x4096,16x16x1x4096,32x16x1x4096,4x128x1x4096,8x128x1x4096,"
                  "16x16x2x4096,32x16x2x1024,32x16x2x16384,33x16x1x4096,8x64x1x4096,4x128x2x4096")


def parse(text: str):
    out = []
    for part in text.split(","):
        try:
            B, H, s_q, S = (int(x) for x in part.lower().split("x"))
        except ValueError:
            raise SystemExit(f"--shapes: expected BxHxSQxS items, got {part!r}") from None
        out.append((B, H, s_q, S))
    return out


def run_shape(torch, B, H, s_q, S, kv: str, reps: int):
    from mla_cute_dsl.backend import CuteDslOptions, ctas_per_sm, partial_kernel, run_function
    from mla_cute_dsl.kernels.schedule import alloc_workspace, make_schedule, wide_combine_for
    from mlacore.problem import DecodeProblem, DeviceSpec

    sys.path.insert(0, "benchmarks")
    import wgmma_speed as ws

    ws.KV["kv"] = kv  # read by wgmma_speed.kv_torch_dtype / kv_elem_bytes
    kv_name = "fp8_e4m3" if kv == "fp8" else "bf16"
    problem = DecodeProblem(num_heads=H, seq_len_q=s_q, batch_size=B, max_kv_len=S, min_kv_len=S, page_size=64,
                            kv_dtype=kv_name, device=DeviceSpec(type="cuda", capability=(9, 0)))
    options = CuteDslOptions()
    kernel = partial_kernel(problem, options)
    fn = run_function(kernel)
    n_sm = torch.cuda.get_device_properties(0).multi_processor_count
    sets, table, lens = ws.make_sets(torch, B, H, s_q, S, 50 * 2**20, None)
    lens_cpu = lens.cpu()
    sched = make_schedule(lens_cpu, s_q, H, n_sm, ctas_per_sm=ctas_per_sm(kernel, options))
    work = alloc_workspace(sched)
    rule = wide_combine_for(B, s_q * H, n_sm)
    row = {"B": B, "H": H, "s_q": s_q, "S": S, "kv": kv, "kernel": kernel, "items": sched.num_items,
           "rule_wide": rule}
    outs = {}
    for wide in (False, True):
        sched.wide_combine, sched.combine_cols = wide, 512  # one warp per row (not chunked) or wide
        o = [torch.empty(B, s_q, H, 512, device="cuda", dtype=torch.bfloat16) for _ in sets]
        l_ = [torch.empty(B, s_q, H, device="cuda", dtype=torch.float32) for _ in sets]

        def run(i, out, lse, wide=wide):
            sched.wide_combine, sched.combine_cols = wide, 512
            fn(sets[i]["q"], sets[i]["kv"], table, lens, ws.SM_SCALE, 1.0, out, lse, sched, work)

        med, _ = ws.time_graph(run, o, l_, reps)
        run(0, o[0], l_[0])
        torch.cuda.synchronize()
        outs[wide] = (o[0].clone(), l_[0].clone())
        row["wide_us" if wide else "per_row_us"] = round(med, 2)
    d = ws.diff(torch, outs[True][0], outs[True][1], outs[False][0], outs[False][1])
    row["out_rel_wide_vs_per_row"] = d["out_rel"]
    row["faster"] = "wide" if row["wide_us"] < row["per_row_us"] else "per_row"
    row["rule_right"] = (row["faster"] == "wide") == rule
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help="BxHxSQxS items, comma-separated")
    ap.add_argument("--kv", choices=("bf16", "fp8"), default="bf16")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    shapes = parse(args.shapes)
    import torch

    if not torch.cuda.is_available():
        print("combine_rule_speed: needs a CUDA GPU (SM90)", file=sys.stderr)
        return 2
    rows = []
    print(f"{'B':>4} {'H':>4} {'s_q':>3} {'S':>6} {'kernel':>8} {'items':>6} {'per_row':>8} {'wide':>8} "
          f"{'faster':>8} {'rule':>8} {'rel':>8}")
    for B, H, s_q, S in shapes:
        r = run_shape(torch, B, H, s_q, S, args.kv, args.reps)
        rows.append(r)
        print(f"{B:>4} {H:>4} {s_q:>3} {S:>6} {r['kernel']:>8} {r['items']:>6} {r['per_row_us']:>8} "
              f"{r['wide_us']:>8} {r['faster']:>8} {('wide' if r['rule_wide'] else 'per_row'):>8} "
              f"{r['out_rel_wide_vs_per_row']:>8.1e}{'' if r['rule_right'] else '  <- rule picks the slower'}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
