"""What MLADecoder.run adds over calling the plan's Planned.run directly.

Two measurements, median of many calls with a cached decision:
  * a no-op backend registered in-process (pure validation overhead),
  * the chosen real backend on a small shape (the overhead in context).
Usage: python benchmarks/decoder_overhead.py [--device cuda] [--backend NAME] [-n CALLS]
"""

from __future__ import annotations

import argparse
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


def paired_medians(direct_fn, through_fn, n: int, sync) -> tuple:
    """Medians of the two calls, timed alternately (A, B, A, B, ...) so that drift in clocks,
    allocator state or the backend's own host work hits both sides alike."""
    for _ in range(50):
        direct_fn()
        through_fn()
    sync()
    direct, through = [], []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        direct_fn()
        t1 = time.perf_counter_ns()
        through_fn()
        t2 = time.perf_counter_ns()
        direct.append(t1 - t0)
        through.append(t2 - t1)
    sync()
    return statistics.median(direct) / 1e3, statistics.median(through) / 1e3


def measure(backend: str, device: str, registry: BackendRegistry, n: int) -> tuple[float, float]:
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
    run = plan.planned.run
    return paired_medians(lambda: run(inp.q, inp.kv_cache, out, lse),
                          lambda: dec.run(inp.q, inp.kv_cache, plan, out=out, lse=lse), n, sync)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--backend", default="reference")
    ap.add_argument("-n", type=int, default=20000)
    args = ap.parse_args()
    reg = BackendRegistry().load()
    reg.register(NoOp())
    for name, n in (("noop", args.n), (args.backend, max(200, args.n // 20))):
        direct, through = measure(name, args.device, reg, n)
        print(f"{name:<16} {args.device}: direct {direct:8.2f} us  via MLADecoder.run {through:8.2f} us  "
              f"overhead {through - direct:6.2f} us  (median of {n})")


if __name__ == "__main__":
    main()
