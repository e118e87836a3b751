"""Host planning time of the split-KV schedule: the pure-Python planner the kernels were verified with
(tests/schedule_oracle.py) vs the vectorized one (mla_cute_dsl.kernels.schedule), per batch, kind of
lengths and plan (even: make_schedule(...); hybrid: make_schedule(..., balanced=True)), re-planning into
existing CPU buffers (out=) as the engine does every step. Checks that both give the same buffers.

    PYTHONPATH=plugins/cute_dsl_mla:. python plugins/cute_dsl_mla/benchmarks/plan_time.py [--reps 7]

Each number is the best of --reps rounds of the mean over a round (~50 ms of calls): other load on the
machine only ever adds time.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

import schedule_oracle as old  # noqa: E402
from mla_cute_dsl.kernels import schedule as new  # noqa: E402


def lengths(kind: str, B: int) -> list:
    rng = random.Random(1234)
    if kind == "uniform4096":
        return [4096] * B
    if kind == "varlen1-8192":
        return [rng.randint(1, 8192) for _ in range(B)]
    if kind == "skewed":  # short requests and a few long ones
        lens = [rng.randint(1, 512) for _ in range(B)]
        for i in range(0, B, 16):
            lens[i] = 16384
        return lens
    raise ValueError(kind)


def per_call_ms(fn, reps: int) -> float:
    fn()
    t = time.perf_counter()
    n = 0
    while time.perf_counter() - t < 0.02:
        fn()
        n += 1
    n = max(5, int(n * 2.5))
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t) / n)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128, 512])
    ap.add_argument("--kinds", nargs="+", default=["uniform4096", "varlen1-8192", "skewed"])
    ap.add_argument("--s-q", type=int, default=1)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; s_q {args.s_q}, H {args.heads}, "
          f"{args.sms} SMs; make_schedule(..., device='cpu', out=s) per call, best of {args.reps} rounds")
    print(f"{'B':>4} {'lengths':<13} {'plan':<7} {'form':<9} {'old ms':>8} {'new ms':>8} {'speed-up':>9}")
    for B in args.batches:
        for kind in args.kinds:
            lens = lengths(kind, B)
            for balanced in (False, True):
                times, scheds = [], []
                for mod in (old, new):
                    s = mod.make_schedule(lens, args.s_q, args.heads, args.sms, device="cpu", balanced=balanced)
                    times.append(per_call_ms(lambda: mod.make_schedule(lens, args.s_q, args.heads, args.sms,
                                                                       device="cpu", out=s, balanced=balanced),
                                             args.reps))
                    scheds.append(s)
                a, b = scheds
                assert torch.equal(a.work_info, b.work_info) and torch.equal(a.split_info, b.split_info)
                assert a.form == b.form and a.num_items == b.num_items
                print(f"{B:>4} {kind:<13} {'hybrid' if balanced else 'even':<7} {b.form:<9} {times[0]:>8.3f} "
                      f"{times[1]:>8.3f} {times[0] / times[1]:>8.1f}x")


if __name__ == "__main__":
    main()
