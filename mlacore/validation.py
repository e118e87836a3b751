"""Input checks that turn a bad tensor into a sentence naming the argument.

A kernel fed a wrong stride or an out-of-range page id does not fail: it
reads someone else's memory. Every check here runs on tensor metadata or on
host copies, so none of them synchronizes with the device.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch


from .errors import MLAInputError  # noqa: E402  (re-exported)


def expect_tensor(name: str, value: object) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise MLAInputError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
    return value


def expect_rank(name: str, t: torch.Tensor, rank: int, layout: str) -> None:
    if t.dim() != rank:
        raise MLAInputError(f"{name}: expected {rank} dims {layout}, got shape {tuple(t.shape)}")


def expect_shape(name: str, t: torch.Tensor, shape: Sequence[int], layout: str) -> None:
    if tuple(t.shape) != tuple(shape):
        raise MLAInputError(f"{name}: expected shape {tuple(shape)} {layout}, got {tuple(t.shape)}")


def expect_dtype(name: str, t: torch.Tensor, dtypes: Sequence[torch.dtype]) -> None:
    if t.dtype not in dtypes:
        wanted = " or ".join(str(d).replace("torch.", "") for d in dtypes)
        raise MLAInputError(f"{name}: expected dtype {wanted}, got {str(t.dtype).replace('torch.', '')}")


def expect_device(name: str, t: torch.Tensor, device: torch.device) -> None:
    if not _same_device(t.device, device):
        raise MLAInputError(f"{name}: expected a tensor on {device}, got one on {t.device}")


def expect_contiguous(name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise MLAInputError(
            f"{name}: expected a contiguous tensor, got strides {tuple(t.stride())} for shape "
            f"{tuple(t.shape)} (call .contiguous())"
        )


def _same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    if a.type == "cuda":
        return (a.index or 0) == (b.index or 0)
    return True


def check_lengths_and_table(kv_lens_host: torch.Tensor, table_host: torch.Tensor, page_size: int,
                            num_pages: Optional[int] = None) -> int:
    """Check lengths and the page ids they use; returns the largest page id used (-1 if none)."""
    if bool((kv_lens_host < 0).any()):
        bad = int(torch.nonzero(kv_lens_host < 0)[0, 0])
        raise MLAInputError(f"kv_lens: expected lengths >= 0, got kv_lens[{bad}] = {int(kv_lens_host[bad])}")
    kv_lens_host = kv_lens_host.to(torch.int64)  # no int32 wrap at max_pages * page_size >= 2**31
    capacity = table_host.shape[1] * page_size
    if bool((kv_lens_host > capacity).any()):
        bad = int(torch.nonzero(kv_lens_host > capacity)[0, 0])
        raise MLAInputError(
            f"kv_lens: kv_lens[{bad}] = {int(kv_lens_host[bad])} needs more pages than page_table holds "
            f"({table_host.shape[1]} pages x page_size {page_size} = {capacity} tokens)"
        )
    pages_used = (kv_lens_host + page_size - 1) // page_size  # [B]
    cols = torch.arange(table_host.shape[1])
    used = cols[None, :] < pages_used[:, None]
    if not bool(used.any()):
        return -1
    ids = table_host[used]
    if bool((ids < 0).any()):
        b, c = (int(x) for x in torch.nonzero(used & (table_host < 0))[0])
        raise MLAInputError(f"page_table: page_table[{b}, {c}] = {int(table_host[b, c])} is negative "
                            f"but request {b} uses that slot")
    max_id = int(ids.max())
    if num_pages is not None and max_id >= num_pages:
        b, c = (int(x) for x in torch.nonzero(used & (table_host >= num_pages))[0])
        raise MLAInputError(f"page_table: page_table[{b}, {c}] = {int(table_host[b, c])} is out of range "
                            f"for a cache of {num_pages} pages")
    return max_id
