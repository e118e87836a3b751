"""From mlacore's canonical page table to what FlashInfer's kernels read.

FA2/FA3 read CSR metadata (qo_indptr, kv_indptr, kv_indices, kv_len_arr),
built here on the host once per step; trtllm-gen reads the caller's dense
block table as it is (no copy, no padding).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CSRMetadata:
    qo_indptr: torch.Tensor  # [B+1] int32
    kv_indptr: torch.Tensor  # [B+1] int32, in pages
    kv_indices: torch.Tensor  # [num used pages] int32, request-major
    kv_len_arr: torch.Tensor  # [B] int32, in tokens


def csr_from_table(kv_lens: torch.Tensor, page_table: torch.Tensor, page_size: int,
                   seq_len_q: int) -> CSRMetadata:
    """CSR view of the pages each request uses; unused table slots are never read."""
    lens = kv_lens.to(torch.int64)
    batch = lens.shape[0]
    pages = (lens + page_size - 1) // page_size
    kv_indptr = torch.zeros(batch + 1, dtype=torch.int64)
    kv_indptr[1:] = torch.cumsum(pages, 0)
    used = torch.arange(page_table.shape[1])[None, :] < pages[:, None]
    return CSRMetadata(
        qo_indptr=(torch.arange(batch + 1, dtype=torch.int32) * seq_len_q),
        kv_indptr=kv_indptr.to(torch.int32),
        kv_indices=page_table[used].to(torch.int32).contiguous(),
        kv_len_arr=kv_lens.to(torch.int32).contiguous(),
    )


@dataclass(frozen=True)
class TrtllmGenArgs:
    block_tables: torch.Tensor
    max_seq_len: int
    bmm1_scale: float
    bmm2_scale: float


def trtllm_gen_scales(sm_scale: float, kv_scale: float, q_scale: float = 1.0) -> tuple:
    """(bmm1, bmm2): FlashInfer's fused trtllm-gen scales.

    bmm1 = q_scale * k_scale * sm_scale (the softmax scale times the fp8
    dequant scales of q and the cache), bmm2 = v_scale (the cache's: V is
    the latent part of the same cache). For bf16 inputs both dequant scales are 1.
    """
    return float(sm_scale * q_scale * kv_scale), float(kv_scale)


def trtllm_gen_args(page_table: torch.Tensor, page_size: int, max_kv_len: int, sm_scale: float,
                    kv_scale: float, q_scale: float = 1.0, graph: bool = False) -> TrtllmGenArgs:
    """The caller's block table as it is, the scheduling length and the fused scales.

    No padding: FlashInfer 0.7.2 asks for a table width aligned to
    128 / page_size only on its other backends (`require_aligned_block_table=
    backend != "trtllm-gen"`), and a new tensor per plan would break a
    captured CUDA graph, which reads the table at the captured address.
    `max_seq_len` is the step's longest request eagerly; in graph mode it is
    the table's capacity (width x page size), as FlashInfer's planned backend
    uses, because the captured launch keeps the value it was captured with.
    """
    if page_table.dim() != 2:
        raise ValueError(f"page_table: expected [batch, max_pages], got shape {tuple(page_table.shape)}")
    capacity = int(page_table.shape[1]) * page_size
    max_seq_len = capacity if graph else int(max_kv_len)
    if max_seq_len > capacity:
        raise ValueError(f"max_kv_len={max_kv_len} does not fit the page table: {page_table.shape[1]} pages of "
                         f"{page_size} hold {capacity} tokens")
    bmm1, bmm2 = trtllm_gen_scales(sm_scale, kv_scale, q_scale)
    return TrtllmGenArgs(block_tables=page_table, max_seq_len=max(1, max_seq_len), bmm1_scale=bmm1,
                         bmm2_scale=bmm2)
