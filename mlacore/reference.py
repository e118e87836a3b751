"""The reference backend: plain torch, CPU or CUDA, and the oracle for every other backend.

Semantics it defines for all backends:

* causal with s_q > 1 is bottom-right aligned: query i of a request of kv
  length L sees kv positions < L - s_q + i + 1;
* a query row that sees no kv position (L == 0, or L < s_q for early rows)
  gets out = 0 and lse = -inf;
* lse is the natural log of the softmax denominator of the scaled scores;
* fp8 caches are dequantized as value * kv_scale (one per-tensor scale).

Two implementations of the same math live here:

* `mla_decode_reference` walks one request at a time with host lengths. It
  is the plainest statement of the semantics and, in fp64, the oracle that
  `mlacore.testing` compares every backend (this one included) against.
* `mla_decode_paged` is what the `reference` backend runs: the whole batch
  at once, lengths read from a device tensor, a fixed number of pages walked
  in chunks with an online softmax. It does no host work per call, so a
  CUDA graph captured around it replays correctly after any re-plan.
"""

from __future__ import annotations

from importlib import metadata as importlib_metadata
from typing import Any, List

from pydantic import Field

from .backend import Availability, Backend, BackendInfo, BackendOptions, Session, SessionConfig, hookimpl
from .problem import DecodeShape

DEFAULT_CHUNK_TOKENS = 65536
# the math lives in reference_math (torch); these names are re-exported lazily
_MATH = ("mla_decode_reference", "mla_decode_paged", "ReferencePlanned", "ReferenceSession")


def __getattr__(name: str) -> Any:
    if name in _MATH:
        from . import reference_math

        return getattr(reference_math, name)
    raise AttributeError(f"module 'mlacore.reference' has no attribute {name!r}")


# -- the backend ----------------------------------------------------------


class ReferenceOptions(BackendOptions):
    chunk_tokens: int = Field(default=DEFAULT_CHUNK_TOKENS, ge=1,
                              description="tokens gathered per chunk over the whole batch (memory bound)")


class ReferenceBackend(Backend):
    """pure torch, fp32 compute, any shape; CPU and CUDA; the correctness oracle"""

    name = "reference"
    Options = ReferenceOptions

    @hookimpl
    def availability(self) -> Availability:
        try:
            version = importlib_metadata.version("torch")
        except importlib_metadata.PackageNotFoundError:
            version = "?"
        return Availability(True, details={"torch": version})

    @hookimpl
    def availability_for(self, device: Any) -> Availability:
        """Pure torch runs on any device torch runs on: the same answer for a simulated one."""
        return self.availability()

    @hookimpl
    def info(self) -> BackendInfo:
        return BackendInfo(description="pure torch, fp32 compute, any shape; CPU and CUDA; the oracle",
                           notes=("slow by design: the fallback when no kernel takes a shape",),
                           q_layouts=("packed", "split"), kv_layouts=("packed", "split"), strided_q=True)

    @hookimpl
    def can_implement(self, shape: DecodeShape, options: ReferenceOptions) -> List[str]:
        if shape.kv_lora_rank < 1 or shape.qk_rope_head_dim < 0:
            return ["kv_lora_rank must be >= 1 and qk_rope_head_dim >= 0"]
        return []

    @hookimpl
    def open(self, config: SessionConfig, options: ReferenceOptions) -> Session:
        from .reference_math import ReferenceSession

        return ReferenceSession(config, options)


backend = ReferenceBackend()
