"""Correctness of a backend against the reference, on fresh random inputs.

Used by `mla check`, by `mla bench` (a backend that disagrees is reported as
wrong and never timed), and by the test suites of the plugins.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, List, Optional, Sequence

import torch

from ..decoder import MLADecoder
from ..dispatch import Dispatcher
from .inputs import DecodeInputs, make_inputs
from ..policy import parse_policy
from ..problem import DecodeProblem, DeviceSpec, torch_dtype
from ..reference import mla_decode_reference

# ||out - ref|| / ||ref|| bounds: output rounded to 16 bits plus the kernel's
# own bf16/fp16 P@V rounding stays well below these; a wrong mask, page or
# scale lands far above. lse is an absolute bound on scores of size ~2:
# FlashInfer fa2 rounds the pre-scaled query to bf16 (seen: 1.1e-3 on an
# H200), its fp8 paths fold the scale into bf16 K and lose more (seen: up to
# 2.2e-2 over a grid); one token dropped from a
# 40-token request moves lse by ~2.5e-2.
REL_TOL = {"fp32": 1e-4, "bf16": 1e-2, "fp16": 5e-3}
LSE_ABS_TOL = {"fp32": 1e-5, "bf16": 4e-3, "fp16": 4e-3}
LSE_ABS_TOL_FP8_KV = 5e-2


@dataclass
class CheckResult:
    backend: str
    problem: DecodeProblem
    passed: bool
    skipped: bool = False
    out_rel_err: float = math.nan
    lse_max_err: float = math.nan
    messages: List[str] = field(default_factory=list)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a64, b64 = a.double(), b.double()
    denom = float(torch.linalg.vector_norm(b64))
    return float(torch.linalg.vector_norm(a64 - b64)) / max(denom, 1e-30)


def reference_outputs(problem: DecodeProblem, inputs: DecodeInputs):
    """fp64 reference on the inputs' device (fp64 on a GPU is exact enough and much faster)."""
    dev = inputs.q.device
    return mla_decode_reference(
        inputs.q, inputs.kv_cache, inputs.page_table, inputs.kv_lens.cpu().tolist(),
        inputs.sm_scale, inputs.kv_scale, problem.causal,
        out=torch.empty(*inputs.q.shape[:3], problem.kv_lora_rank, dtype=torch.float64, device=dev),
        lse=torch.empty(*inputs.q.shape[:3], dtype=torch.float64, device=dev),
        kv_lora_rank=problem.kv_lora_rank, compute_dtype=torch.float64,
    )


def compare(problem: DecodeProblem, out: torch.Tensor, lse: Optional[torch.Tensor],
            ref_out: torch.Tensor, ref_lse: torch.Tensor) -> CheckResult:
    """Compare a backend's outputs with the fp64 reference; every element must be written."""
    res = CheckResult(backend="", problem=problem, passed=True)
    out = out.detach().cpu()
    if not bool(torch.isfinite(out).all()):
        res.passed = False
        res.messages.append(f"out has {int((~torch.isfinite(out)).sum())} non-finite elements "
                            "(unwritten or read a poisoned page)")
    ref_out, ref_lse = ref_out.cpu(), ref_lse.cpu()
    res.out_rel_err = rel_err(torch.nan_to_num(out.double(), nan=1e6), ref_out)
    if res.out_rel_err > REL_TOL[problem.q_dtype]:
        res.passed = False
        res.messages.append(f"out relative error {res.out_rel_err:.2e} > {REL_TOL[problem.q_dtype]:.0e}")
    if lse is not None:
        lse = lse.detach().cpu().double()
        empty = torch.isinf(ref_lse)
        if not bool((lse[empty] == -math.inf).all()):
            res.passed = False
            res.messages.append("lse is not -inf for query rows that see no kv position")
        full = ~empty
        if bool(full.any()):
            # absolute near 0, relative for large scores (q with std 100 gives lse ~ 1e2)
            diff = (lse[full] - ref_lse[full]).abs() / ref_lse[full].abs().clamp(min=1.0)
            res.lse_max_err = float(torch.nan_to_num(diff, nan=math.inf).max())
            tol = LSE_ABS_TOL_FP8_KV if problem.kv_dtype == "fp8_e4m3" else LSE_ABS_TOL[problem.q_dtype]
            if res.lse_max_err > tol:
                res.passed = False
                res.messages.append(f"lse max error {res.lse_max_err:.2e} > {tol:.1e}")
        else:
            res.lse_max_err = 0.0
    return res


def only_backend_dispatcher(backend: str, registry=None, options: Optional[dict] = None) -> Dispatcher:
    """A dispatcher that may choose `backend` and nothing else (no fallback)."""
    data: dict = {"mla": {"order": [backend], "fallback": "error"}}
    if options:
        data["backend"] = {backend: {"options": dict(options)}}
    policy = parse_policy(data, f"<check {backend}>")
    return Dispatcher(policy=policy, registry=registry, env={})


def check_backend(backend: str, problem: DecodeProblem, device: str = "cpu", seed: int = 0,
                  dispatcher: Optional[Dispatcher] = None, options: Optional[dict] = None,
                  inputs: Optional[DecodeInputs] = None) -> CheckResult:
    """Run `backend` once through MLADecoder on fresh inputs and compare with the fp64 reference."""
    dispatcher = dispatcher or only_backend_dispatcher(backend, options=options)
    inputs = inputs or make_inputs(problem, device=device, seed=seed)
    decoder = MLADecoder(
        problem.num_heads, problem.page_size, q_dtype=torch_dtype(problem.q_dtype),
        kv_dtype=torch_dtype(problem.kv_dtype), device=device, sm_scale=inputs.sm_scale,
        kv_scale=inputs.kv_scale, causal=problem.causal, return_lse=True, dispatcher=dispatcher,
    )
    plan = decoder.plan(inputs.kv_lens, inputs.page_table, problem.seq_len_q)
    out = torch.full((*inputs.q.shape[:3], problem.kv_lora_rank), float("nan"),
                     dtype=inputs.q.dtype, device=inputs.q.device)
    lse = torch.full(inputs.q.shape[:3], float("nan"), dtype=torch.float32, device=inputs.q.device)
    decoder.run(inputs.q, inputs.kv_cache, plan, out=out, lse=lse)
    ref_out, ref_lse = reference_outputs(problem, inputs)
    res = compare(problem, out, lse, ref_out, ref_lse)
    res.backend = plan.backend
    return res


def check_grid(quick: bool, device: DeviceSpec) -> List[DecodeProblem]:
    """Shapes `mla check` runs: every kernel-relevant axis, small enough for a CPU."""
    heads = (1, 16, 128) if not quick else (16, 128)
    shapes = []
    for h in heads:
        for s_q in (1, 2, 4):
            for kv in ("bf16", "fp8_e4m3"):
                for page, lo, hi, batch in ((1, 0, 37, 3), (16, 5, 200, 4), (64, 1, 333, 3)):
                    if quick and (page, s_q) not in ((16, 1), (64, 2), (1, 4)):
                        continue
                    shapes.append(DecodeProblem(
                        num_heads=h, seq_len_q=s_q, batch_size=batch, min_kv_len=lo, max_kv_len=hi,
                        page_size=page, q_dtype="bf16", kv_dtype=kv, device=device))
    return shapes


def run_checks(backends: Sequence[str], problems: Iterable[DecodeProblem], device: str,
               registry=None) -> List[CheckResult]:
    results: List[CheckResult] = []
    for name in backends:
        dispatcher = only_backend_dispatcher(name, registry)
        for i, problem in enumerate(problems):
            decision = dispatcher.explain(problem)
            if decision.backend != name:
                why = "; ".join(decision.verdict(name).reasons) or decision.verdict(name).outcome
                results.append(CheckResult(name, problem, passed=True, skipped=True, messages=[why]))
                continue
            try:
                res = check_backend(name, problem, device=device, seed=1000 + i, dispatcher=dispatcher)
            except Exception as exc:  # report, keep checking the rest
                res = CheckResult(name, problem, passed=False,
                                  messages=[f"raised {type(exc).__name__}: {exc}"])
            results.append(res)
    return results
