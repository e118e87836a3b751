"""Issue 3's measurements on one GPU, in one run: FlashInfer fa3 and fa2, bf16 and fp8 KV, through mlacore.

Graph-replay time (rotating input sets larger than L2), GB/s, TFLOP/s and %
of the ceilings measured in the same run; then the host overhead that
MLADecoder.run adds over calling the FlashInfer wrapper directly (eager, B=1).
Usage: python benchmarks/flashinfer_shapes.py [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from mlacore import MLADecoder
from mlacore.tools.bench import BackendSpec, bench_cell, measure_ceilings, report_json, BenchReport
from mlacore.testing import only_backend_dispatcher
from mlacore.testing import make_inputs
from mlacore.problem import DecodeProblem, DeviceSpec

SHAPES = [  # (B, H, s_q, S)
    (1, 16, 1, 4096),
    (64, 16, 1, 8192),
    (128, 128, 1, 4096),
    (128, 16, 2, 4096),
]


def overhead(variant: str, n: int = 3000) -> dict:
    dev = DeviceSpec.of("cuda")
    p = DecodeProblem(num_heads=16, batch_size=1, max_kv_len=4096, min_kv_len=4096, page_size=64, device=dev)
    inp = make_inputs(p, device="cuda", seed=0)
    dec = MLADecoder(16, 64, device="cuda", sm_scale=inp.sm_scale,
                     dispatcher=only_backend_dispatcher("flashinfer_mla", options={"variant": variant}))
    plan = dec.plan(inp.kv_lens, inp.page_table)
    out = torch.empty(1, 1, 16, 512, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(1, 1, 16, dtype=torch.float32, device="cuda")
    wrapper = plan.planned.slot.wrapper
    q3, o3, l3 = inp.q.view(1, 16, 576), out.view(1, 16, 512), lse.view(1, 16)

    def direct():
        wrapper.run(query=q3, kv_cache=inp.kv_cache, out=o3, lse=l3, return_lse=True, return_lse_base_on_e=True)

    def direct_with_views():  # what a caller holding mlacore's 4D tensors must do anyway
        wrapper.run(query=inp.q.view(1, 16, 576), kv_cache=inp.kv_cache, out=out.view(1, 16, 512),
                    lse=lse.view(1, 16), return_lse=True, return_lse_base_on_e=True)

    def through():
        dec.run(inp.q, inp.kv_cache, plan, out=out, lse=lse)

    res = {}
    for name, fn in (("direct", direct), ("views", direct_with_views), ("mlacore", through), ("direct2", direct),
                     ("views2", direct_with_views), ("mlacore2", through)):
        for _ in range(200):
            fn()
        torch.cuda.synchronize()
        per = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            torch.cuda.synchronize()
            per.append((time.perf_counter() - t0) / n * 1e6)
        res[name] = statistics.median(per)
    return {"variant": variant, "direct_us": min(res["direct"], res["direct2"]),
            "direct_with_views_us": min(res["views"], res["views2"]),
            "mlacore_us": min(res["mlacore"], res["mlacore2"]),
            "overhead_us": min(res["mlacore"], res["mlacore2"]) - min(res["direct"], res["direct2"])}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--budget", type=float, default=0.3)
    args = ap.parse_args()
    dev = DeviceSpec.of("cuda")
    ceilings = measure_ceilings("cuda")
    print(f"ceilings: {ceilings.copy_gbps:.0f} GB/s copy, {ceilings.matmul_tflops:.0f} TFLOP/s bf16 ({ceilings.how})")
    specs = [BackendSpec("flashinfer_mla", (("variant", "fa3"),)), BackendSpec("flashinfer_mla", (("variant", "fa2"),))]
    rows = []
    for kv in ("bf16", "fp8_e4m3"):
        for i, (b, h, s_q, s) in enumerate(SHAPES):
            p = DecodeProblem(num_heads=h, seq_len_q=s_q, batch_size=b, max_kv_len=s, min_kv_len=s, page_size=64,
                              kv_dtype=kv, device=dev)
            rows += bench_cell(p, specs, "cuda", graph=True, ceilings=ceilings, seed=i, budget_s=args.budget)
    print(f"{'variant':<28} {'kv':<9} {'B':>4} {'H':>4} {'s_q':>3} {'S':>6} {'status':<7} {'us':>9} "
          f"{'GB/s':>7} {'TFLOP/s':>8} {'%bw':>5} {'%mm':>5}  timing")
    for r in rows:
        p = r.problem
        print(f"{r.backend:<28} {p.kv_dtype:<9} {p.batch_size:>4} {p.num_heads:>4} {p.seq_len_q:>3} {p.max_kv_len:>6} "
              f"{r.status:<7} {r.time_us:>9.1f} {r.gbps:>7.0f} {r.tflops:>8.1f} {r.pct_bw:>5.0f} {r.pct_flops:>5.0f}  "
              f"{r.timing or r.notes[:80]}")
    ov = [overhead("fa3"), overhead("fa2")]
    for o in ov:
        print(f"overhead {o['variant']}: direct wrapper.run {o['direct_us']:.2f} us/call "
              f"({o['direct_with_views_us']:.2f} with the 3D views made per call), via MLADecoder.run "
              f"{o['mlacore_us']:.2f} us/call, added {o['overhead_us']:.2f} us (eager, B=1 H=16 S=4096, host-bound loop)")
    if args.json:
        from mlacore.fingerprint import current_fingerprint

        data = report_json(BenchReport(rows, ceilings, "issue3 shapes", current_fingerprint(), time.strftime("%Y-%m-%d")))
        data["overhead"] = ov
        with open(args.json, "w") as fh:
            json.dump(data, fh, indent=1)


if __name__ == "__main__":
    main()
