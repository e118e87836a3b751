"""Fresh random decode inputs for a problem, built to expose wrong kernels.

Unused cache pages and the unused tail of each request's last page are
poisoned with NaN (a kernel that reads past a length shows it), page ids are
shuffled (a kernel that assumes contiguous pages shows it), and lengths vary
within [min_kv_len, max_kv_len] with the extremes always present.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from ..problem import DecodeProblem, torch_dtype

FP8_MAX = 448.0


@dataclass
class DecodeInputs:
    q: torch.Tensor  # [B, s_q, H, 576]
    kv_cache: torch.Tensor  # [P, page, 576]
    page_table: torch.Tensor  # [B, max_pages] int32
    kv_lens: torch.Tensor  # [B] int32
    kv_scale: float
    sm_scale: float


def make_lengths(problem: DecodeProblem, generator: torch.Generator, varlen: bool = True) -> torch.Tensor:
    B, lo, hi = problem.batch_size, problem.min_kv_len, problem.max_kv_len
    if not varlen or lo == hi:
        lens = torch.full((B,), hi, dtype=torch.int32)
        lens[0] = lo
        return lens
    lens = torch.randint(lo, hi + 1, (B,), generator=generator, dtype=torch.int32)
    lens[0] = hi
    if B > 1:
        lens[-1] = lo
    return lens


def make_inputs(problem: DecodeProblem, device: torch.device | str = "cpu", seed: int = 0,
                varlen: bool = True, poison: bool = True, extra_pages: int = 3,
                sm_scale: Optional[float] = None,
                kv_lens: Optional[torch.Tensor] = None) -> DecodeInputs:
    """Random q/cache/table/lens for `problem` on `device` (generated on the CPU, then moved)."""
    g = torch.Generator().manual_seed(seed)
    lens = make_lengths(problem, g, varlen) if kv_lens is None else kv_lens.to(torch.int32).cpu()
    page = problem.page_size
    pages_per_req = [(int(n) + page - 1) // page for n in lens]
    max_pages = max(1, max(pages_per_req))
    num_pages = sum(pages_per_req) + extra_pages
    perm = torch.randperm(num_pages, generator=g).to(torch.int32)
    used = sum(pages_per_req)
    # padding slots point at a NaN-poisoned spare page: a kernel that reads
    # them shows it in its output instead of faulting
    pad = int(perm[used]) if extra_pages > 0 else -1
    table = torch.full((problem.batch_size, max_pages), pad, dtype=torch.int32)
    used = 0
    for b, n in enumerate(pages_per_req):
        table[b, :n] = perm[used:used + n]
        used += n
    D = problem.head_dim_qk
    cache = torch.randn(num_pages, page, D, generator=g)
    kv_scale = 1.0
    if problem.kv_dtype == "fp8_e4m3":
        # quantize per tensor, the way engines store an fp8 latent cache
        kv_scale = float(cache.abs().max()) / FP8_MAX
        cache = (cache / kv_scale).clamp(-FP8_MAX, FP8_MAX)
    if poison:
        flat = cache.view(num_pages, page, D)
        flat[perm[used:].long()] = float("nan")
        for b, n in enumerate(lens.tolist()):
            if n % page and pages_per_req[b]:
                flat[int(table[b, pages_per_req[b] - 1]), n % page:] = float("nan")
    q = torch.randn(problem.batch_size, problem.seq_len_q, problem.num_heads, D, generator=g)
    qd, kvd = torch_dtype(problem.q_dtype), torch_dtype(problem.kv_dtype)
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(128 + 64)
    return DecodeInputs(
        q=q.to(qd).to(device),
        kv_cache=cache.to(kvd).to(device),
        page_table=table.to(device),
        kv_lens=lens.to(device),
        kv_scale=kv_scale,
        sm_scale=sm_scale,
    )
