"""The reference math, in torch: the fp64 oracle, the batched graph-safe decode, the session.

Kept apart from `mlacore.reference` (the backend object and its options) so
that discovering backends and validating a policy never import torch.
"""

from __future__ import annotations

import math
from typing import Any, List, Optional

import torch

from .backend import Planned, Session, SessionConfig, StepInputs
from .problem import DecodeProblem

DEFAULT_CHUNK_TOKENS = 65536


def _gather_pages(kv_cache: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """kv_cache[ids], also for fp8 caches (not every device gathers fp8 directly)."""
    if kv_cache.dtype == torch.float8_e4m3fn:
        return kv_cache.view(torch.uint8)[ids].view(kv_cache.dtype)
    return kv_cache[ids]


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
    compute_dtype: torch.dtype = torch.float64,
    q_scale: float = 1.0,
):
    """The oracle: one request at a time, exact softmax, host lengths. Returns (out, lse).

    q [B, s_q, H, D], kv_cache [P, page, D], page_table [B, max_pages],
    kv_lens [B] (a tensor or a list of ints).
    """
    B, s_q, H, D = q.shape
    page = kv_cache.shape[1]
    lens: List[int] = kv_lens.tolist() if isinstance(kv_lens, torch.Tensor) else list(kv_lens)
    if out is None:
        out = torch.empty(B, s_q, H, kv_lora_rank, dtype=compute_dtype, device=q.device)
    if lse is None:
        lse = torch.empty(B, s_q, H, dtype=compute_dtype, device=q.device)
    rows = s_q * H
    query_of_row = torch.arange(rows, device=q.device) // H  # row r = i * H + h
    for b in range(B):
        L = int(lens[b])
        limit = (L - s_q + 1 + query_of_row) if causal else torch.full_like(query_of_row, L)
        qb = q[b].reshape(rows, D).to(compute_dtype) * q_scale
        n_pages = (L + page - 1) // page
        ids = page_table[b, :n_pages].to(device=kv_cache.device, dtype=torch.long)
        kv = _gather_pages(kv_cache, ids).reshape(-1, D)[:L].to(compute_dtype) * kv_scale
        s = (qb @ kv.T) * sm_scale  # [rows, L]
        s = s.masked_fill(torch.arange(L, device=q.device)[None, :] >= limit[:, None], -math.inf)
        seen = limit > 0
        m = torch.where(seen, s.max(dim=1).values if L else torch.zeros(rows, dtype=compute_dtype,
                                                                            device=q.device), 0.0)
        p = torch.exp(s - m[:, None])
        den = p.sum(dim=1)
        o = torch.where(seen[:, None], (p @ kv[:, :kv_lora_rank]) / torch.where(seen, den, 1.0)[:, None], 0.0)
        row_lse = torch.where(seen, m + torch.log(torch.where(seen, den, 1.0)), -math.inf)
        out[b].copy_(o.reshape(s_q, H, kv_lora_rank))
        lse[b].copy_(row_lse.reshape(s_q, H))
    return out, lse


def _scaled(t: torch.Tensor, scale: Any) -> torch.Tensor:
    """t * scale for a float (skipped when 1.0) or a 0-d tensor (always applied: never read on the host)."""
    if isinstance(scale, torch.Tensor):
        return t * scale.to(device=t.device, dtype=t.dtype)
    return t if scale == 1.0 else t * scale


def mla_decode_paged(
    q: Any,
    kv_cache: Any,
    page_table: torch.Tensor,
    kv_lens: torch.Tensor,
    pages_to_walk: int,
    sm_scale: float,
    kv_scale: Any,
    causal: bool,
    out: torch.Tensor,
    lse: Optional[torch.Tensor],
    kv_lora_rank: int = 512,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    compute_dtype: torch.dtype = torch.float32,
    q_scale: Any = 1.0,
) -> None:
    """Batched decode with device lengths; writes out (and lse). No host work, no sync.

    q is a tensor [B, s_q, H, D] or a pair (q_nope, q_pe) with any strides;
    kv_cache a tensor [P, page, D] or a pair (ckv, kpe). Scales are floats or
    0-d device tensors. Walks `pages_to_walk` table columns (a host constant:
    the step's longest request, or a CUDA-graph envelope). Slots past a
    request's length are clamped to a valid page and zeroed before use, so
    NaN-poisoned or garbage entries never reach the result.
    """
    if isinstance(q, tuple):
        q = torch.cat([q[0].to(compute_dtype), q[1].to(compute_dtype)], dim=-1)
    split_kv = isinstance(kv_cache, tuple)
    first = kv_cache[0] if split_kv else kv_cache
    B, s_q, H, D = q.shape
    P, page = first.shape[0], first.shape[1]
    rows = s_q * H
    dev = q.device
    lens = kv_lens.to(device=dev, dtype=torch.long)
    qf = _scaled(q.reshape(B, rows, D).to(compute_dtype), q_scale)
    row_query = torch.arange(rows, device=dev) // H
    limit = (lens[:, None] - s_q + 1 + row_query[None, :]) if causal else lens[:, None].expand(B, rows)
    m = torch.full((B, rows), -math.inf, dtype=compute_dtype, device=dev)
    den = torch.zeros(B, rows, dtype=compute_dtype, device=dev)
    acc = torch.zeros(B, rows, kv_lora_rank, dtype=compute_dtype, device=dev)
    chunk_pages = max(1, chunk_tokens // (B * page * max(1, rows // 64)))
    for p0 in range(0, pages_to_walk, chunk_pages):
        p1 = min(pages_to_walk, p0 + chunk_pages)
        ids = page_table[:, p0:p1].to(device=first.device, dtype=torch.long).clamp(0, P - 1)
        if split_kv:
            kv = torch.cat([_gather_pages(kv_cache[0], ids).to(compute_dtype),
                            _gather_pages(kv_cache[1], ids).to(compute_dtype)], dim=-1)
        else:
            kv = _gather_pages(kv_cache, ids).to(compute_dtype)
        kv = kv.to(device=dev).reshape(B, (p1 - p0) * page, D)
        pos = torch.arange(p0 * page, p1 * page, device=dev)
        kv = _scaled(torch.where((pos[None, :] < lens[:, None])[..., None], kv, 0.0), kv_scale)
        s = torch.bmm(qf, kv.transpose(1, 2)) * sm_scale  # [B, rows, T]
        s = s.masked_fill(pos[None, None, :] >= limit[:, :, None], -math.inf)
        m_new = torch.maximum(m, s.amax(dim=2))
        shift = torch.where(torch.isinf(m_new), 0.0, m_new)
        alpha = torch.exp(m - shift)
        p = torch.exp(s - shift[..., None])
        den = den * alpha + p.sum(dim=2)
        acc = acc * alpha[..., None] + torch.bmm(p, kv[..., :kv_lora_rank])
        m = m_new
    seen = den > 0
    safe = torch.where(seen, den, 1.0)
    out.copy_(torch.where(seen[..., None], acc / safe[..., None], 0.0).reshape(out.shape))
    if lse is not None:
        lse.copy_(torch.where(seen, m + torch.log(safe), -math.inf).reshape(lse.shape))


class ReferencePlanned(Planned):
    __slots__ = ("kv_lens", "page_table", "pages", "config", "chunk_tokens")

    def __init__(self, kv_lens: torch.Tensor, page_table: torch.Tensor, pages: int,
                 config: SessionConfig, chunk_tokens: int) -> None:
        self.kv_lens, self.page_table, self.pages = kv_lens, page_table, pages
        self.config, self.chunk_tokens = config, chunk_tokens

    def run(self, q: Any, kv_cache: Any, out: torch.Tensor, lse: Optional[torch.Tensor],
            kv_scale: Any = None, q_scale: Any = None) -> None:
        c = self.config
        mla_decode_paged(q, kv_cache, self.page_table, self.kv_lens, self.pages, c.sm_scale,
                         c.kv_scale if kv_scale is None else kv_scale, c.causal, out, lse, c.kv_lora_rank,
                         self.chunk_tokens, q_scale=c.q_scale if q_scale is None else q_scale)


class ReferenceSession(Session):
    """Eager: reads the engine's tensors. Graph mode: copies them into buffers sized from the envelope."""

    def __init__(self, config: SessionConfig, options: Any) -> None:
        self.config, self.options = config, options
        self._lens_buf: Optional[torch.Tensor] = None
        self._table_buf: Optional[torch.Tensor] = None
        env = config.envelope
        if env is not None:
            dev = torch.device(config.device.type, config.device_index) if config.device.type == "cuda" else "cpu"
            self._lens_buf = torch.zeros(env.max_batch, dtype=torch.int32, device=dev)
            self._table_buf = torch.zeros(env.max_batch, env.max_pages(config.page_size), dtype=torch.int32,
                                          device=dev)

    def plan(self, problem: DecodeProblem, step: StepInputs) -> ReferencePlanned:
        B, page = problem.batch_size, problem.page_size
        if self._lens_buf is None:
            pages = -(-problem.max_kv_len // page)
            return ReferencePlanned(step.kv_lens, step.page_table, pages, self.config, self.options.chunk_tokens)
        width = min(step.page_table.shape[1], self._table_buf.shape[1])
        self._lens_buf[:B].copy_(step.kv_lens, non_blocking=True)
        self._table_buf[:B, :width].copy_(step.page_table[:, :width], non_blocking=True)
        return ReferencePlanned(self._lens_buf[:B], self._table_buf[:B], self._table_buf.shape[1],
                                self.config, self.options.chunk_tokens)

    def close(self) -> None:
        self._lens_buf = self._table_buf = None
