"""Read-only memory ceiling of this GPU, beside the copy ceiling `mla bench` reports.

Why: issue 11's bf16 H=16 targets (B64 S8192 <= 146 us, B128 s_q2 S4096 <= 145 us) read 604 MB of KV
cache: 4.14-4.17 TB/s, above the 4.25 TB/s copy ceiling's 97%. A decode kernel only reads; this times
reductions that only read the same bytes (CUDA graph replay, CUDA events, median) to say how close a
read-only stream gets on this machine, i.e. whether those targets are reachable at all.
On the H200 (ninth session, docs/results/gpu10_session/summary.txt) torch's reductions did not settle it: the
best, a bf16 sum over 604 MB, ran at 3.87 TB/s, below fa3's decode of the same bytes (3.97 TB/s), so they bound
nothing; a dedicated streaming-read kernel would be needed.
    python benchmarks/read_ceiling.py [--mb 604]
"""

from __future__ import annotations

import argparse
import statistics

import torch


def time_graph(fn, reps: int = 50) -> float:
    """Median microseconds of one replay of a CUDA graph that calls fn once."""
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=float, nargs="+", default=[604.0, 302.0])
    args = ap.parse_args()
    print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}")
    print(f"{'MB':>6} {'way':<28} {'us':>9} {'GB/s':>8}")
    for mb in args.mb:
        n = int(mb * 1e6) // 16 * 16
        x = torch.randn(n // 2, device="cuda", dtype=torch.bfloat16)
        dst = torch.empty_like(x)
        ways = {
            "copy (read+write bytes)": lambda: dst.copy_(x),
            "sum bf16 -> fp32": lambda: torch.sum(x, dtype=torch.float32),
            "amax bf16": lambda: torch.amax(x),
            "sum fp32 view": lambda: torch.sum(x.view(torch.float32)),
            "amax int32 view": lambda: torch.amax(x.view(torch.int32)),
        }
        for name, fn in ways.items():
            us = time_graph(fn)
            moved = n * (2 if name.startswith("copy") else 1)
            print(f"{mb:6.0f} {name:<28} {us:9.1f} {moved / us / 1e3:8.0f}" +
                  (f"  (read+write bytes; the copy ceiling is {n / us / 1e3:.0f} GB/s per direction)"
                   if name.startswith("copy") else ""))


if __name__ == "__main__":
    main()
