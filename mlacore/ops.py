"""Custom ops so that torch.compile can trace through MLA decode.

Two ways in:

* The op pair, for engines: `mlacore::plan` (once per step) and
  `mlacore::run` (per layer). A decoder is named by `decoder.handle` (an int
  from `register_decoder`); `plan` returns a small device tensor, the step
  token, that every `run` of the step takes, so the compiler keeps plan before
  run and never drops it. `run` does no host work: under
  `torch.compile(mode="reduce-overhead")` its kernels are captured, and with
  a `cuda_graph=True` decoder they read buffers whose addresses never move, so
  replays after later plans are correct. Call `plan` outside the captured
  region (the engine's step loop, as vLLM and SGLang build attention
  metadata); `torch.compile(fullgraph=True)` traces both.
* `mlacore::mla_decode`, one op that plans and runs (it reads the lengths on
  the host every call): convenient, not for CUDA graphs.

Fake implementations give the compiler output shapes without running anything.
"""

from __future__ import annotations

import threading
import weakref
from typing import Dict, Optional, Tuple

import torch

from .decoder import MLADecoder
from .errors import MLAInputError
from .problem import HEAD_DIM_QK
from .validation import expect_rank, expect_tensor

_decoders: Dict[tuple, MLADecoder] = {}  # insertion-ordered: the first is the oldest
_MAX_ONE_CALL_DECODERS = 64
_call_locks: Dict[int, threading.Lock] = {}  # one per decoder of the one-call op: its plan and run go together
_handles: "weakref.WeakValueDictionary[int, MLADecoder]" = weakref.WeakValueDictionary()
_lock = threading.Lock()


def register_decoder(decoder: MLADecoder) -> int:
    """The handle that names `decoder` in `mlacore::plan` / `mlacore::run` (held weakly)."""
    with _lock:
        _handles[decoder.handle] = decoder
    return decoder.handle


def _decoder(handle: int) -> MLADecoder:
    decoder = _handles.get(int(handle))
    if decoder is None:
        raise MLAInputError(f"handle: no live MLADecoder registered as {handle} (call mlacore.ops.register_decoder)")
    return decoder


# -- the op pair ----------------------------------------------------------------


@torch.library.custom_op("mlacore::plan", mutates_args=())
def plan(handle: int, kv_lens: torch.Tensor, page_table: torch.Tensor, seq_len_q: int,
         kv_lens_host: Optional[torch.Tensor] = None,
         page_table_host: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Plan one step on the decoder named by `handle`; returns the step token (int32, 0-d, on its device)."""
    decoder = _decoder(handle)
    step = decoder.plan(kv_lens, page_table, seq_len_q, kv_lens_host=kv_lens_host,
                        page_table_host=page_table_host)
    return torch.full((), step.generation, dtype=torch.int32, device=decoder.device)


@plan.register_fake
def _plan_fake(handle, kv_lens, page_table, seq_len_q, kv_lens_host=None, page_table_host=None):
    return kv_lens.new_empty((), dtype=torch.int32)


@torch.library.custom_op("mlacore::run", mutates_args=())
def run(handle: int, step: torch.Tensor, q: torch.Tensor, kv_cache: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """One layer of the step `step` was planned for: (out [B, s_q, H, 512], lse [B, s_q, H]).

    No host work: the step token is only an ordering edge (its value is not read).
    """
    decoder = _decoder(handle)
    out, lse = decoder.run(q, kv_cache, decoder.current_plan())
    if lse is None:  # return_lse=False decoders still return a tensor here
        lse = out.new_empty(out.shape[:3], dtype=torch.float32)
    return out, lse


@run.register_fake
def _run_fake(handle, step, q, kv_cache):
    decoder = _handles.get(int(handle))
    out_dtype = decoder.out_dtype if decoder is not None else (
        torch.bfloat16 if q.dtype == torch.float8_e4m3fn else q.dtype)
    B, s_q, H, _ = q.shape
    latent = decoder.kv_lora_rank if decoder is not None else 512
    return q.new_empty(B, s_q, H, latent, dtype=out_dtype), q.new_empty(B, s_q, H, dtype=torch.float32)


# -- the one-call op ------------------------------------------------------------


def _decoder_for(q: torch.Tensor, kv_cache: torch.Tensor, sm_scale: float, kv_scale: float,
                 causal: bool) -> MLADecoder:
    key = (q.shape[2], kv_cache.shape[1], q.dtype, kv_cache.dtype, str(q.device), sm_scale,
           kv_scale, causal, q.shape[3], kv_cache.shape[2])
    decoder = _decoders.get(key)
    if decoder is None:
        with _lock:
            decoder = _decoders.get(key)
            if decoder is None:
                fp8 = kv_cache.dtype == torch.float8_e4m3fn
                decoder = MLADecoder(
                    int(q.shape[2]), int(kv_cache.shape[1]), q_dtype=q.dtype, kv_dtype=kv_cache.dtype,
                    device=q.device, sm_scale=sm_scale, kv_scale=kv_scale if fp8 else None, causal=causal,
                    kv_lora_rank=512, qk_rope_head_dim=int(q.shape[3]) - 512,
                )
                _call_locks[decoder.handle] = threading.Lock()
                if len(_decoders) >= _MAX_ONE_CALL_DECODERS:  # e.g. a new float kv_scale per call: stay bounded
                    old = _decoders.pop(next(iter(_decoders)))  # the oldest; freed with its sessions once unused
                    _call_locks.pop(old.handle, None)
                _decoders[key] = decoder
    return decoder


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


@torch.library.custom_op("mlacore::mla_decode", mutates_args=())
def mla_decode(q: torch.Tensor, kv_cache: torch.Tensor, page_table: torch.Tensor, kv_lens: torch.Tensor,
               sm_scale: float, kv_scale: float = 1.0, causal: bool = True) -> Tuple[torch.Tensor, torch.Tensor]:
    """MLA decode: q [B, s_q, H, 576] over cache [P, page, 576]; returns (out [B,s_q,H,512], lse [B,s_q,H])."""
    _check_layouts(q, kv_cache)
    decoder = _decoder_for(q, kv_cache, sm_scale, kv_scale, causal)
    with _call_locks[decoder.handle]:  # the decoder is shared process-wide: another thread must not plan
        step = decoder.plan(kv_lens, page_table, int(q.shape[1]))  # between this plan and its run
        out, lse = decoder.run(q, kv_cache, step)
    return out, lse


@mla_decode.register_fake
def _mla_decode_fake(q, kv_cache, page_table, kv_lens, sm_scale, kv_scale=1.0, causal=True):
    B, s_q, H, _ = q.shape
    return q.new_empty(B, s_q, H, 512), q.new_empty(B, s_q, H, dtype=torch.float32)
