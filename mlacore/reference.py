"""The reference backend: plain torch, CPU or CUDA, and the oracle for every other backend.

It computes in fp32 (or fp64 when asked) one request at a time and walks the
kv length in chunks with an online softmax, so B=128, S=32768 never holds
more than one chunk of scores. Semantics it defines for all backends:

* causal with s_q > 1 is bottom-right aligned: query i of a request of kv
  length L sees kv positions < L - s_q + i + 1;
* a query row that sees no kv position (L == 0, or L < s_q for early rows)
  gets out = 0 and lse = -inf;
* lse is the natural log of the softmax denominator of the scaled scores;
* fp8 caches are dequantized as value * kv_scale (one per-tensor scale).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch

from .hookspecs import Availability, BackendInfo, StepInputs, hookimpl
from .problem import DecodeProblem

DEFAULT_CHUNK_TOKENS = 4096


def mla_decode_reference(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    page_table: torch.Tensor,
    kv_lens: Any,
    sm_scale: float,
    kv_scale: float = 1.0,
    causal: bool = True,
    out: Optional[torch.Tensor] = None,
    lse: Optional[torch.Tensor] = None,
    kv_lora_rank: int = 512,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    compute_dtype: torch.dtype = torch.float32,
):
    """MLA decode over a paged latent cache; returns (out, lse).

    q [B, s_q, H, D], kv_cache [P, page, D], page_table [B, max_pages],
    kv_lens [B] (a tensor or a list of ints; pass a list to avoid a device sync).
    """
    B, s_q, H, D = q.shape
    page = kv_cache.shape[1]
    lens: List[int] = kv_lens.tolist() if isinstance(kv_lens, torch.Tensor) else list(kv_lens)
    if out is None:
        out = torch.empty(B, s_q, H, kv_lora_rank, dtype=q.dtype, device=q.device)
    if lse is None:
        lse = torch.empty(B, s_q, H, dtype=torch.float32, device=q.device)
    flat_cache = kv_cache  # indexed per page below
    rows = s_q * H
    query_of_row = torch.arange(rows, device=q.device) // H  # row r = i * H + h
    for b in range(B):
        L = int(lens[b])
        qb = q[b].reshape(rows, D).to(compute_dtype)
        m = torch.full((rows,), -math.inf, dtype=compute_dtype, device=q.device)
        den = torch.zeros(rows, dtype=compute_dtype, device=q.device)
        acc = torch.zeros(rows, kv_lora_rank, dtype=compute_dtype, device=q.device)
        # last visible position (exclusive) for each row
        limit = (L - s_q + 1 + query_of_row) if causal else torch.full_like(query_of_row, L)
        for start in range(0, L, chunk_tokens):
            end = min(L, start + chunk_tokens)
            p0, p1 = start // page, (end + page - 1) // page
            pages = page_table[b, p0:p1].to(device=kv_cache.device, dtype=torch.long)
            if kv_cache.dtype == torch.float8_e4m3fn:  # gather the bytes; not every device gathers fp8
                kv = flat_cache.view(torch.uint8).index_select(0, pages).view(kv_cache.dtype).reshape(-1, D)
            else:
                kv = flat_cache.index_select(0, pages).reshape(-1, D)
            kv = kv[start - p0 * page: end - p0 * page].to(compute_dtype)
            if kv_scale != 1.0:
                kv = kv * kv_scale
            s = (qb @ kv.T) * sm_scale  # [rows, n]
            if causal and s_q > 1:
                pos = torch.arange(start, end, device=q.device)
                s = s.masked_fill(pos[None, :] >= limit[:, None], -math.inf)
            m_new = torch.maximum(m, s.max(dim=1).values)
            shift = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
            alpha = torch.exp(m - shift)
            p = torch.exp(s - shift[:, None])
            den = den * alpha + p.sum(dim=1)
            acc = acc * alpha[:, None] + p @ kv[:, :kv_lora_rank]
            m = m_new
        seen = den > 0
        o = torch.where(seen[:, None], acc / torch.where(seen, den, torch.ones_like(den))[:, None],
                        torch.zeros_like(acc))
        row_lse = torch.where(seen, m + torch.log(torch.where(seen, den, torch.ones_like(den))),
                              torch.full_like(m, -math.inf))
        out[b].copy_(o.reshape(s_q, H, kv_lora_rank))
        lse[b].copy_(row_lse.reshape(s_q, H))
    return out, lse


# -- the backend plugin -------------------------------------------------


@dataclass(frozen=True)
class ReferencePlan:
    page_table: torch.Tensor
    lens: List[int]
    sm_scale: float
    kv_scale: float
    causal: bool
    kv_lora_rank: int
    chunk_tokens: int


_OPTIONS = {"chunk_tokens"}


@hookimpl
def mla_backend_info() -> BackendInfo:
    return BackendInfo(
        description="pure torch, fp32 compute, any shape; CPU and CUDA; the correctness oracle",
        graph_capturable=False,
    )


@hookimpl
def mla_availability() -> Availability:
    return Availability(True, details={"torch": torch.__version__})


@hookimpl
def mla_option_errors(options: Dict[str, Any]) -> List[str]:
    errors = [f"unknown option '{k}' (known: chunk_tokens)" for k in options if k not in _OPTIONS]
    chunk = options.get("chunk_tokens", DEFAULT_CHUNK_TOKENS)
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1:
        errors.append(f"chunk_tokens={chunk!r}: expected a positive integer")
    return errors


@hookimpl
def mla_can_implement(problem: DecodeProblem, options: Dict[str, Any]) -> List[str]:
    reasons = []
    if problem.kv_lora_rank < 1 or problem.qk_rope_head_dim < 0:
        reasons.append("kv_lora_rank must be >= 1 and qk_rope_head_dim >= 0")
    return reasons


@hookimpl
def mla_plan(problem: DecodeProblem, options: Dict[str, Any], step: StepInputs) -> ReferencePlan:
    return ReferencePlan(
        page_table=step.page_table,
        lens=step.kv_lens_host.tolist(),
        sm_scale=step.sm_scale,
        kv_scale=step.kv_scale,
        causal=problem.causal,
        kv_lora_rank=problem.kv_lora_rank,
        chunk_tokens=int(options.get("chunk_tokens", DEFAULT_CHUNK_TOKENS)),
    )


@hookimpl
def mla_run(plan: ReferencePlan, q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor,
            lse: Optional[torch.Tensor]) -> None:
    mla_decode_reference(
        q, kv_cache, plan.page_table, plan.lens, plan.sm_scale, plan.kv_scale, plan.causal,
        out=out, lse=lse, kv_lora_rank=plan.kv_lora_rank, chunk_tokens=plan.chunk_tokens,
    )
