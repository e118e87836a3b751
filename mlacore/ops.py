"""`torch.ops.mlacore.mla_decode`: the decoder as a custom op that torch.compile can trace.

The op plans and runs in one call (so it reads the lengths on the host each
time); engines that capture CUDA graphs use `MLADecoder` directly, planning
outside the graph. The fake implementation gives torch.compile the output
shapes without running anything.
"""

from __future__ import annotations

import threading
from typing import Dict, Tuple

import torch

from .decoder import MLADecoder
from .problem import HEAD_DIM_QK
from .validation import expect_rank, expect_tensor, MLAInputError

_decoders: Dict[tuple, MLADecoder] = {}
_lock = threading.Lock()


def _decoder_for(q: torch.Tensor, kv_cache: torch.Tensor, sm_scale: float, kv_scale: float,
                 causal: bool) -> MLADecoder:
    key = (q.shape[2], kv_cache.shape[1], q.dtype, kv_cache.dtype, str(q.device), sm_scale,
           kv_scale, causal, q.shape[3], kv_cache.shape[2])
    decoder = _decoders.get(key)
    if decoder is None:
        with _lock:
            decoder = _decoders.get(key)
            if decoder is None:
                decoder = MLADecoder(
                    int(q.shape[2]), int(kv_cache.shape[1]), q_dtype=q.dtype, kv_dtype=kv_cache.dtype,
                    device=q.device, sm_scale=sm_scale, kv_scale=kv_scale, causal=causal,
                    kv_lora_rank=512, qk_rope_head_dim=int(q.shape[3]) - 512,
                )
                _decoders[key] = decoder
    return decoder


@torch.library.custom_op("mlacore::mla_decode", mutates_args=())
def mla_decode(q: torch.Tensor, kv_cache: torch.Tensor, page_table: torch.Tensor, kv_lens: torch.Tensor,
               sm_scale: float, kv_scale: float = 1.0, causal: bool = True) -> Tuple[torch.Tensor, torch.Tensor]:
    """MLA decode: q [B, s_q, H, 576] over cache [P, page, 576]; returns (out [B,s_q,H,512], lse [B,s_q,H])."""
    _check_layouts(q, kv_cache)
    decoder = _decoder_for(q, kv_cache, sm_scale, kv_scale, causal)
    plan = decoder.plan(kv_lens, page_table, int(q.shape[1]))
    out, lse = decoder.run(q, kv_cache, plan)
    return out, lse


def _check_layouts(q: torch.Tensor, kv_cache: torch.Tensor) -> None:
    """What the op infers its decoder from: checked first, with the decoder's own messages."""
    expect_tensor("q", q)
    expect_tensor("kv_cache", kv_cache)
    expect_rank("q", q, 4, f"[batch, seq_len_q, num_heads, {HEAD_DIM_QK}]")
    expect_rank("kv_cache", kv_cache, 3, f"[num_pages, page_size, {HEAD_DIM_QK}]")
    if q.shape[-1] != HEAD_DIM_QK:
        raise MLAInputError(f"q: expected last dimension {HEAD_DIM_QK} (512 latent | 64 rope), got shape "
                            f"{tuple(q.shape)}")
    if kv_cache.shape[-1] != HEAD_DIM_QK:
        raise MLAInputError(f"kv_cache: expected last dimension {HEAD_DIM_QK} (512 latent | 64 rope), got shape "
                            f"{tuple(kv_cache.shape)}")


@mla_decode.register_fake
def _mla_decode_fake(q, kv_cache, page_table, kv_lens, sm_scale, kv_scale=1.0, causal=True):
    B, s_q, H, _ = q.shape
    return q.new_empty(B, s_q, H, 512), q.new_empty(B, s_q, H, dtype=torch.float32)
