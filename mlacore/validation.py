"""Input checks that turn a bad tensor into a sentence naming the argument.

A kernel fed a wrong stride or an out-of-range page id does not fail: it
reads someone else's memory. Every check here runs on tensor metadata or on
host copies, so none of them synchronizes with the device.
"""

from __future__ import annotations

import math
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


# -- run-time inputs: only reached when the fast combined check failed ----------------


def _expect_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    if t.dim() and t.stride(-1) != 1:
        raise MLAInputError(f"{name}: expected a contiguous last dimension (stride 1), got strides "
                            f"{tuple(t.stride())} for shape {tuple(t.shape)}")


ALIGN_BYTES = 16  # GPU kernels load 16-byte vectors: a row that starts elsewhere faults (misaligned address)


def misaligned(t: torch.Tensor) -> bool:
    """True when the data pointer, or the stride of any dimension but the last that has more than one
    element, is not a multiple of 16 bytes. Kernels read rows as 16-byte vectors; a view such as
    `wide[..., :576]` of a 700-wide bf16 buffer is contiguous in its last dimension yet faults."""
    if t.data_ptr() % ALIGN_BYTES:
        return True
    if t.is_contiguous():
        return False
    size = t.element_size()
    return any(n > 1 and (st * size) % ALIGN_BYTES for n, st in zip(t.shape[:-1], t.stride()[:-1]))


def aligned_copy(t: torch.Tensor) -> torch.Tensor:
    """A fresh (aligned, contiguous) copy: `.contiguous()` returns a contiguous but misaligned view as it is."""
    return torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)


def _expect_aligned(name: str, t: torch.Tensor) -> None:
    if misaligned(t):
        raise MLAInputError(f"{name}: expected a {ALIGN_BYTES}-byte aligned tensor (data pointer and every stride "
                            f"but the last a multiple of {ALIGN_BYTES} bytes), got data pointer offset "
                            f"{t.data_ptr() % ALIGN_BYTES} and strides {tuple(t.stride())} of "
                            f"{t.element_size()}-byte elements")


def explain_q(q: object, shape: Sequence[int], layout: str, dtype: torch.dtype, device: torch.device,
              rope_dim: int) -> None:
    """Raise the MLAInputError that says what is wrong with q (packed tensor or (q_nope, q_pe))."""
    B, s_q, H, D = shape
    latent = D - rope_dim
    if layout == "split":
        if not (isinstance(q, tuple) and len(q) == 2):
            raise MLAInputError(f"q: this decoder has q_layout='split': expected a pair (q_nope [B, s_q, H, "
                                f"{latent}], q_pe [B, s_q, H, {rope_dim}]), got {type(q).__name__}")
        parts = (("q_nope", q[0], (B, s_q, H, latent)), ("q_pe", q[1], (B, s_q, H, rope_dim)))
    else:
        if isinstance(q, tuple):
            raise MLAInputError(f"q: this decoder has q_layout='packed': expected one tensor [B, s_q, H, {D}], "
                                "got a pair (build the decoder with q_layout='split' to pass (q_nope, q_pe))")
        parts = (("q", q, (B, s_q, H, D)),)
    for name, t, want in parts:
        t = expect_tensor(name, t)
        expect_rank(name, t, 4, f"[batch, seq_len_q, num_heads, {want[3]}]")
        if tuple(t.shape) != tuple(want):
            if t.shape[1] != s_q:
                raise MLAInputError(f"{name}: seq_len_q={t.shape[1]} does not match the plan's seq_len_q={s_q}")
            raise MLAInputError(f"{name}: expected shape {tuple(want)} [batch, seq_len_q, num_heads, {want[3]}], "
                                f"got {tuple(t.shape)}")
        expect_dtype(name, t, (dtype,))
        expect_device(name, t, device)
        _expect_last_dim_contiguous(name, t)


def explain_cache(kv: object, layout: str, page_size: int, head_dim: int, rope_dim: int, dtype: torch.dtype,
                  device: torch.device) -> None:
    """Raise the MLAInputError that says what is wrong with kv_cache (packed or (ckv, kpe))."""
    latent = head_dim - rope_dim
    if layout == "split":
        if not (isinstance(kv, tuple) and len(kv) == 2):
            raise MLAInputError(f"kv_cache: this decoder has kv_layout='split': expected a pair (ckv [P, "
                                f"{page_size}, {latent}], kpe [P, {page_size}, {rope_dim}]), got {type(kv).__name__}")
        parts = (("ckv", kv[0], latent), ("kpe", kv[1], rope_dim))
    else:
        if isinstance(kv, tuple):
            raise MLAInputError("kv_cache: this decoder has kv_layout='packed': expected one tensor, got a pair "
                                "(build the decoder with kv_layout='split' to pass (ckv, kpe))")
        parts = (("kv_cache", kv, head_dim),)
    pages = None
    for name, t, width in parts:
        t = expect_tensor(name, t)
        if t.dim() != 3 or t.shape[1] != page_size or t.shape[2] != width:
            raise MLAInputError(f"{name}: expected shape (num_pages, {page_size}, {width}) [num_pages, page_size, "
                                f"{width}], got {tuple(t.shape)}")
        expect_dtype(name, t, (dtype,))
        expect_device(name, t, device)
        if layout == "packed":  # kernels read [P, page, 576] as compact rows
            expect_contiguous(name, t)
        else:  # (ckv, kpe) may be views of one packed cache: page-strided, last dimension contiguous
            _expect_last_dim_contiguous(name, t)
        _expect_aligned(name, t)  # a cache is never copied per call: it must be readable as it is
        if pages is not None and t.shape[0] != pages:
            raise MLAInputError(f"{name}: expected {pages} pages like ckv, got {t.shape[0]}")
        pages = t.shape[0]


def check_output(name: str, t: object, shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> None:
    t = expect_tensor(name, t)
    expect_shape(name, t, shape, "")
    expect_dtype(name, t, (dtype,))
    expect_device(name, t, device)
    expect_contiguous(name, t)
    _expect_aligned(name, t)


def check_run_scale(name: str, value: object, mode: str, device: torch.device) -> None:
    """A per-call scale: a positive finite float ("float"), or a 0-d float32 tensor on the device ("tensor").

    A tensor's value is never read on the host (that would synchronize, and a
    captured graph must see its later values), so only its metadata is checked.
    """
    if mode == "float":
        if type(value) not in (int, float) or not (value > 0 and math.isfinite(value)):
            raise MLAInputError(f"{name}: expected a positive finite float (scale_inputs='float'), got {value!r}")
    elif mode == "tensor":
        if not isinstance(value, torch.Tensor):
            raise MLAInputError(f"{name}: expected a 0-d float32 tensor on {device} (scale_inputs='tensor'), "
                                f"got {type(value).__name__}")
        if value.dim() != 0 or value.dtype != torch.float32:
            raise MLAInputError(f"{name}: expected a 0-d float32 tensor, got shape {tuple(value.shape)} "
                                f"dtype {str(value.dtype).replace('torch.', '')}")
        expect_device(name, value, device)
    else:
        raise MLAInputError(f"{name}: this decoder has scale_inputs='static' (scales fixed at construction); "
                            "build it with scale_inputs='float' or 'tensor' to pass one per run")
