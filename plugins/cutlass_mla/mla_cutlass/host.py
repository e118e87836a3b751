"""Host-side arithmetic that lifts the CUTLASS SM100 MLA kernel's fixed limits, as pure functions.

The kernel (FlashInfer 0.7.2 `cutlass_mla.cuh`, from CUTLASS example 77)
takes exactly 128 query heads, a softmax scale fixed at 1/sqrt(128 + 64),
a page table whose width is a multiple of 128 / page_size, and a workspace
for its split-KV partials. The plugin meets each limit itself instead of
pushing it onto the engine (as vLLM did when it dropped `num_heads == 128`):

* heads: q is copied into a fixed [B, 128, 576] buffer (rows beyond H stay
  zero) and out is read back as the [:, :H] view;
* scale: the real sm_scale / (1/sqrt(192)) is folded into that same copy;
* table: padded into a session-owned buffer whose address never moves;
* workspace: sized once per batch bucket from the kernel's own split rule.

Every function here is small and testable on a CPU against hand-made cases.
Nothing here has run on an SM100 GPU (not verified on hardware).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    import torch

KERNEL_HEADS = 128  # TileShapeH of MlaSm100
KERNEL_TILE_KV = 128  # tokens per K tile; the table width unit is 128 / page_size pages
KERNEL_NON_LATENT_DIM = 128  # the kernel's fixed scale assumes 128 + rope dims
CLUSTER_CTAS = 2  # the 2-SM kernel: each split occupies a 2-CTA cluster
ACC_BYTES = 4  # fp32 partial O and LSE


def kernel_scale(rope_dim: int = 64) -> float:
    """The softmax scale the kernel applies, fixed: 1/sqrt(128 + rope_dim) (DeepSeek: 1/sqrt(192))."""
    return 1.0 / math.sqrt(KERNEL_NON_LATENT_DIM + rope_dim)


def scale_fold_factor(sm_scale: float, rope_dim: int = 64) -> float:
    """The factor q is multiplied by so the kernel's fixed scale yields `sm_scale`.

    softmax(kernel_scale * (f q) . k) = softmax(sm_scale * q . k) for f = sm_scale / kernel_scale.
    DeepSeek-V3 with YaRN uses sm_scale ~ 0.135 rather than 0.072, so f ~ 1.87.
    """
    if not (sm_scale > 0 and math.isfinite(sm_scale)):
        raise ValueError(f"sm_scale={sm_scale!r}: expected a finite positive softmax scale")
    return sm_scale / kernel_scale(rope_dim)


def table_multiple(page_size: int) -> int:
    """Pages per 128-token K tile: the table width must be a multiple of this."""
    if page_size < 1 or page_size > KERNEL_TILE_KV or KERNEL_TILE_KV % page_size:
        raise ValueError(f"page_size={page_size}: the CUTLASS MLA kernel needs a page size dividing 128")
    return KERNEL_TILE_KV // page_size


def padded_table_width(width: int, page_size: int) -> int:
    """The smallest multiple of 128 / page_size that holds `width` pages (at least one tile)."""
    multiple = table_multiple(page_size)
    return max(multiple, -(-width // multiple) * multiple)


def pad_page_table(table: "torch.Tensor", page_size: int, flat: "torch.Tensor",
                   width: Optional[int] = None) -> "torch.Tensor":
    """`table` [B, w] copied into `flat` (a session-owned 1-D int32 buffer) as a contiguous [B, W] view.

    W = `width` (graph mode: the envelope's fixed width) or the padded width of
    `table`. Columns beyond w hold page 0: a valid page id the kernel never
    reads for lengths within the caller's table. The kernel reads the table
    with row stride W, so the view must be compact; a view into the start of a
    flat buffer is, and its address stays the buffer's.
    """
    B, w = table.shape
    W = padded_table_width(w, page_size) if width is None else width
    if W % table_multiple(page_size):
        raise ValueError(f"width={W} is not a multiple of 128 / page_size = {table_multiple(page_size)}")
    if w > W:
        raise ValueError(f"page_table has {w} columns, the session's table holds {W}")
    if flat.numel() < B * W:
        raise ValueError(f"table buffer holds {flat.numel()} entries, [{B}, {W}] needs {B * W}")
    out = flat[: B * W].view(B, W)
    out[:, :w].copy_(table, non_blocking=True)
    if W > w:
        out[:, w:].zero_()
    return out


def lift_query(q: "torch.Tensor", buf: "torch.Tensor", factor: float) -> "torch.Tensor":
    """q [B, (1,) H, D] scaled by `factor` into buf[:B, :H] of a [B_max, 128, D] zero-initialised buffer.

    Rows H..127 are never written, so they stay zero: the padded heads attend
    uniformly and their outputs are ignored (`slice_output`). Returns
    buf[:B], the contiguous [B, 128, D] tensor the kernel takes.
    """
    B = q.shape[0]
    H, D = q.shape[-2], q.shape[-1]
    if q.dim() == 4 and q.shape[1] != 1:
        raise ValueError(f"q: the CUTLASS MLA kernel takes one query token per request, got seq_len_q={q.shape[1]}")
    if H > buf.shape[1] or D != buf.shape[2] or B > buf.shape[0]:
        raise ValueError(f"q {tuple(q.shape)} does not fit the session's query buffer {tuple(buf.shape)}")
    dst = buf[:B, :H]
    src = q.select(1, 0) if q.dim() == 4 else q  # a view whatever q's strides: no copy before the scaled one
    if factor == 1.0:
        dst.copy_(src)
    else:
        import torch

        torch.mul(src, factor, out=dst)
    return buf[:B]


def slice_output(out_buf: "torch.Tensor", batch: int, num_heads: int) -> "torch.Tensor":
    """The [B, H, 512] view of the kernel's [B_max, 128, 512] output that belongs to the caller."""
    return out_buf[:batch, :num_heads]


def split_kv(batch: int, max_seq_len: int, sm_count: int) -> int:
    """The kernel's split count (CUTLASS `MLA::set_split_kv`, split_kv = -1): partials per request.

    max_seq_len is the table capacity (width x page size), which the kernel
    uses as K; each split occupies a 2-CTA cluster.
    """
    if batch < 1 or max_seq_len < 1 or sm_count < 1:
        raise ValueError(f"batch={batch}, max_seq_len={max_seq_len}, sm_count={sm_count}: all must be positive")
    max_splits = -(-max_seq_len // KERNEL_TILE_KV)
    sms_per_batch = max(1, sm_count // max(1, batch * CLUSTER_CTAS))
    heur = min(max_splits, sms_per_batch)
    waves = -(-max_splits // heur)
    return -(-max_splits // waves)


def workspace_bytes(batch: int, max_seq_len: int, sm_count: int, kv_lora_rank: int = 512) -> int:
    """Bytes of split-KV partials one launch needs: (fp32 O row + fp32 LSE) x 128 heads x splits x batch."""
    return (ACC_BYTES * kv_lora_rank + ACC_BYTES) * KERNEL_HEADS * split_kv(batch, max_seq_len, sm_count) * batch


def bucket_workspace_bytes(max_batch: int, sm_count: int, kv_lora_rank: int = 512) -> int:
    """Workspace that serves every batch size up to `max_batch` and every length: sized once per bucket.

    The split count never exceeds max(1, sm_count // (2 B)) whatever the
    length, so splits x B is bounded per B; the bucket takes the largest bound.
    """
    if max_batch < 1 or sm_count < 1:
        raise ValueError(f"max_batch={max_batch}, sm_count={sm_count}: both must be positive")
    worst = max(b * max(1, sm_count // (b * CLUSTER_CTAS)) for b in range(1, max_batch + 1))
    return (ACC_BYTES * kv_lora_rank + ACC_BYTES) * KERNEL_HEADS * worst


def batch_bucket(batch: int) -> int:
    """The bucket a batch size belongs to in eager mode: the next power of two (1, 2, 4, ...)."""
    if batch < 1:
        raise ValueError(f"batch={batch}: must be positive")
    return 1 << (batch - 1).bit_length()
