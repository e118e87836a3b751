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


def median_us(fn, n: int, sync) -> float:
    for _ in range(50):
        fn()
    sync()
    times = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - t0)
    sync()
    return statistics.median(times) / 1e3


def measure(backend: str, device: str, registry: BackendRegistry, n: int) -> tuple[float, float]:
    spec = DeviceSpec.of(device)
    problem = DecodeProblem(num_heads=16, batch_size=1, min_kv_len=64, max_kv_len=64, page_size=64,
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
    direct = median_us(lambda: run(inp.q, inp.kv_cache, out, lse), n, sync)
    through = median_us(lambda: dec.run(inp.q, inp.kv_cache, plan, out=out, lse=lse), n, sync)
    return direct, through


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
