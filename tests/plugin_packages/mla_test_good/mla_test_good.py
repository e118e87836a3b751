"""A second real backend for mlacore's tests: the reference math in small chunks.

It restricts num_heads and page_size so verdict reasons can be tested, takes
at most 65536 tokens (declared as a cut), and is measurably slower than the
reference on long sequences because of its small chunks.
"""

from typing import Any, Dict, List

from mlacore import Availability, BackendInfo, hookimpl
from mlacore.reference import ReferencePlan, mla_decode_reference

MAX_TOKENS = 65536


@hookimpl
def mla_backend_info():
    return BackendInfo(description="test backend: reference math, 64-token chunks",
                       kv_len_cuts=(MAX_TOKENS + 1,))


@hookimpl
def mla_availability():
    return Availability(True)


@hookimpl
def mla_option_errors(options: Dict[str, Any]) -> List[str]:
    return [f"unknown option '{k}' (known: chunk_tokens)" for k in options if k != "chunk_tokens"]


@hookimpl
def mla_can_implement(problem, options) -> List[str]:
    reasons = []
    if problem.num_heads not in (16, 128):
        reasons.append(f"num_heads={problem.num_heads} not in {{16, 128}}")
    if problem.page_size not in (16, 64):
        reasons.append(f"page_size={problem.page_size} not in {{16, 64}}")
    if problem.max_kv_len > MAX_TOKENS:
        reasons.append(f"max_kv_len={problem.max_kv_len} > {MAX_TOKENS}")
    return reasons


@hookimpl
def mla_plan(problem, options, step):
    return ReferencePlan(page_table=step.page_table, lens=step.kv_lens_host.tolist(),
                         sm_scale=step.sm_scale, kv_scale=step.kv_scale, causal=problem.causal,
                         kv_lora_rank=problem.kv_lora_rank,
                         chunk_tokens=int(options.get("chunk_tokens", 64)))


@hookimpl
def mla_run(plan, q, kv_cache, out, lse):
    mla_decode_reference(q, kv_cache, plan.page_table, plan.lens, plan.sm_scale, plan.kv_scale,
                         plan.causal, out=out, lse=lse, kv_lora_rank=plan.kv_lora_rank,
                         chunk_tokens=plan.chunk_tokens)


class DropsLastToken:
    """A wrong backend: it forgets each request's last kv token (an off-by-one kernel)."""

    @hookimpl
    def mla_availability(self):
        return Availability(True)

    @hookimpl
    def mla_can_implement(self, problem, options):
        return []

    @hookimpl
    def mla_plan(self, problem, options, step):
        plan = mla_plan(problem=problem, options=options, step=step)
        return ReferencePlan(**{**plan.__dict__, "lens": [max(0, n - 1) for n in plan.lens]})

    @hookimpl
    def mla_run(self, plan, q, kv_cache, out, lse):
        mla_run(plan=plan, q=q, kv_cache=kv_cache, out=out, lse=lse)


drops_last_token = DropsLastToken()
