"""What MLADecoder.run adds over calling the plan's Planned.run directly.

Two measurements, median of many calls with a cached decision:
  * a no-op backend registered in-process (pure validation overhead),
  * the chosen real backend on a small shape (the overhead in context); for FlashInfer
    fa2/fa3 also FlashInfer's own wrapper.run, called as an engine would call it.
Host time only: the device is drained (untimed) before each round, so a full launch queue
never blocks one side.
Usage: python benchmarks/decoder_overhead.py [--device cuda] [--backend NAME] [-n CALLS]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch

from mlacore import Backend, BackendRegistry, Dispatcher, MLADecoder, Planned, Session, hookimpl, parse_policy
from mlacore.problem import DecodeProblem, DeviceSpec, torch_dtype
from mlacore.testing import make_inputs


class NoOpPlanned(Planned):
    def run(self, q, kv_cache, out, lse):
        return None


class NoOpSession(Session):
    def plan(self, problem, step):
        return NoOpPlanned()


class NoOp(Backend):
    """does nothing: measures what the decoder adds"""

    name = "noop"

    @hookimpl
    def can_implement(self, shape, options):
        return []

    @hookimpl
    def open(self, config, options):
        return NoOpSession()


def timed_rounds(fns: dict, n: int, sync) -> dict:
    """Per-call host time of each function, timed in rotating order (A B C, B C A, C A B, ...)
    with the device drained (untimed) before every round, so that neither a full launch queue
    nor drift in clocks or caches favours one side. Returns {name: [us per round]}."""
    names = list(fns)
    calls = [fns[k] for k in names]
    for _ in range(50):
        for f in calls:
            f()
    sync()
    times = {k: [] for k in names}
    clock = time.perf_counter_ns
    gc.disable()
    try:
        for i in range(n):
            k = i % len(names)
            order = names[k:] + names[:k]
            sync()
            for name in order:
                f = fns[name]
                t0 = clock()
                f()
                times[name].append(clock() - t0)
        sync()
    finally:
        gc.enable()
    return {name: [t / 1e3 for t in ts] for name, ts in times.items()}


def measure(backend: str, device: str, registry: BackendRegistry, n: int) -> dict:
    spec = DeviceSpec.of(device)
    # the shape on a GPU (B=1 H=16 S=4096); a short one on the CPU (the reference is slow there)
    kv_len = 4096 if device == "cuda" else 64
    problem = DecodeProblem(num_heads=16, batch_size=1, min_kv_len=kv_len, max_kv_len=kv_len, page_size=64,
                            device=spec)
    inp = make_inputs(problem, device=device, seed=0)
    disp = Dispatcher(policy=parse_policy({"mla": {"order": [backend], "fallback": "error"}}),
                      registry=registry, env={})
    dec = MLADecoder(16, 64, q_dtype=torch_dtype("bf16"), device=device, sm_scale=inp.sm_scale,
                     dispatcher=disp)
    plan = dec.plan(inp.kv_lens, inp.page_table)
    out = torch.empty(1, 1, 16, 512, dtype=torch.bfloat16, device=device)
    lse = torch.empty(1, 1, 16, dtype=torch.float32, device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    assert plan.backend == backend, plan.decision.format_trace()
    planned = plan.planned
    run = planned.run
    fns = {}
    wrapper = getattr(getattr(planned, "slot", None), "wrapper", None)
    if wrapper is not None:  # FlashInfer fa2/fa3: its own wrapper.run, as an engine would call it
        q3, o3, l2 = inp.q.view(1, 16, 576), out.view(1, 16, 512), lse.view(1, 16)
        kw = dict(return_lse=True, return_lse_base_on_e=True, **planned.scales)
        fns["flashinfer wrapper.run"] = lambda: wrapper.run(query=q3, kv_cache=inp.kv_cache, out=o3, lse=l2, **kw)
    fns["Planned.run"] = lambda: run(inp.q, inp.kv_cache, out, lse)
    fns["MLADecoder.run"] = lambda: dec.run(inp.q, inp.kv_cache, plan, out=out, lse=lse)
    # engines that pass a fresh slice of one preallocated buffer per layer (views made before timing)
    big_out = torch.empty(2, 1, 16, 512, dtype=torch.bfloat16, device=device)
    big_lse = torch.empty(2, 1, 16, dtype=torch.float32, device=device)
    # both sides get fresh slice objects (made before timing): a backend that views out/lse pays for it on
    # both sides, so the difference is what the decoder adds for buffers it has not seen
    slices_p = iter([(big_out[i % 2:i % 2 + 1], big_lse[i % 2:i % 2 + 1]) for i in range(n + 60)])
    slices_d = iter([(big_out[i % 2:i % 2 + 1], big_lse[i % 2:i % 2 + 1]) for i in range(n + 60)])

    def fresh_planned() -> None:
        o, l_ = next(slices_p)
        run(inp.q, inp.kv_cache, o, l_)

    def fresh() -> None:
        o, l_ = next(slices_d)
        dec.run(inp.q, inp.kv_cache, plan, out=o, lse=l_)

    times = timed_rounds(fns, n, sync)
    # a separate pass: alternating with the fixed buffers would defeat the decoder's identity test for both
    fresh_times = timed_rounds({"Planned.run, fresh out/lse": fresh_planned, "MLADecoder.run, fresh out/lse": fresh},
                               n, sync)
    times.update(fresh_times)
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--backend", default="reference")
    ap.add_argument("-n", type=int, default=20000)
    args = ap.parse_args()
    reg = BackendRegistry().load()
    reg.register(NoOp())
    for name in ("noop", args.backend):
        times = measure(name, args.device, reg, args.n)
        for what, ts in times.items():
            print(f"{name:<16} {args.device}: {what:<24} {statistics.median(ts):8.2f} us")
        pairs = [("MLADecoder.run", w) for w in times if not w.startswith("MLADecoder.run") and "fresh" not in w]
        pairs.append(("MLADecoder.run, fresh out/lse", "Planned.run, fresh out/lse"))
        for mine_name, what in pairs:
            delta = statistics.median(b - a for a, b in zip(times[what], times[mine_name]))
            print(f"{name:<16} {args.device}: {mine_name} - {what} {delta:+8.2f} us (median of per-round "
                  "differences)")
        print(f"{name:<16} {args.device}: {args.n} rounds, device drained before each round")

if __name__ == "__main__":
    main()
