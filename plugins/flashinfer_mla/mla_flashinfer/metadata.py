"""From mlacore's canonical page table to what FlashInfer's kernels read.

FA2/FA3 read CSR metadata (qo_indptr, kv_indptr, kv_indices, kv_len_arr);
trtllm-gen reads a dense block table whose width is a multiple of
128 / page_size. Both are built here on the host, once per step.
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


def trtllm_gen_args(page_table: torch.Tensor, page_size: int, max_kv_len: int, sm_scale: float,
                    kv_scale: float) -> TrtllmGenArgs:
    """Block table padded to a multiple of 128 / page_size columns, and the fused scales.

    Padding columns hold page 0: a valid id the kernel never reads for the
    given lengths, so an over-eager prefetch cannot fault. bmm1 carries the
    softmax scale times the K dequant scale; bmm2 the V dequant scale.
    """
    if 128 % page_size:
        raise ValueError(f"page_size={page_size}: trtllm-gen needs a page size dividing 128")
    multiple = 128 // page_size
    width = page_table.shape[1]
    padded = -(-width // multiple) * multiple
    table = page_table
    if padded != width:
        table = torch.nn.functional.pad(page_table, (0, padded - width), value=0)
    return TrtllmGenArgs(block_tables=table.contiguous(), max_seq_len=max(1, int(max_kv_len)),
                         bmm1_scale=float(sm_scale * kv_scale), bmm2_scale=float(kv_scale))
