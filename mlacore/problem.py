"""The decode problem: every fact a backend or the policy may decide on.

A `DecodeProblem` is a pure, hashable value built from the tensors an engine
passes (never from guesses), so that the backend choice is a function of the
problem, the policy and the environment alone: every tensor-parallel rank that
sees the same shapes reaches the same decision.
"""

from __future__ import annotations

from typing import Literal, Optional, Tuple

from pydantic import BaseModel, ConfigDict, Field, model_validator

DType = Literal["bf16", "fp16", "fp32", "fp8_e4m3"]
QDType = Literal["bf16", "fp16", "fp32", "fp8_e4m3"]
OutDType = Literal["bf16", "fp16", "fp32"]
# where fp8 scales come from: fixed by the decoder, per run call as floats, or
# per run call as 0-d device tensors (a captured graph stays valid when their value changes)
ScaleInputs = Literal["static", "float", "tensor"]

KV_LORA_RANK = 512
QK_ROPE_HEAD_DIM = 64
HEAD_DIM_QK = KV_LORA_RANK + QK_ROPE_HEAD_DIM

# torch dtype name -> canonical short name; kept as strings so this module
# does not need torch to describe a problem.
_TORCH_TO_SHORT = {
    "torch.bfloat16": "bf16",
    "torch.float16": "fp16",
    "torch.float32": "fp32",
    "torch.float8_e4m3fn": "fp8_e4m3",
}


def dtype_name(dtype: object) -> str:
    """Canonical short name of a torch dtype (or an already-short name)."""
    if isinstance(dtype, str) and dtype in ("bf16", "fp16", "fp32", "fp8_e4m3"):
        return dtype
    name = _TORCH_TO_SHORT.get(str(dtype))
    if name is None:
        raise ValueError(
            f"dtype {dtype} is not supported; expected one of bf16, fp16, fp32, fp8_e4m3"
        )
    return name


def torch_dtype(name: str):
    """torch dtype of a canonical short name."""
    import torch

    return {
        "bf16": torch.bfloat16,
        "fp16": torch.float16,
        "fp32": torch.float32,
        "fp8_e4m3": torch.float8_e4m3fn,
    }[name]


def bytes_per_element(name: str) -> int:
    return {"bf16": 2, "fp16": 2, "fp32": 4, "fp8_e4m3": 1}[name]


class DeviceSpec(BaseModel):
    """Where the problem runs: the device type and, for CUDA, its compute capability."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    type: Literal["cpu", "cuda"] = "cpu"
    capability: Optional[Tuple[int, int]] = None

    @classmethod
    def of(cls, device: object) -> "DeviceSpec":
        import torch

        dev = torch.device(device)
        if dev.type == "cuda":
            return cls(type="cuda", capability=tuple(torch.cuda.get_device_capability(dev)))
        if dev.type != "cpu":
            raise ValueError(f"device {dev} is not supported; expected cpu or cuda")
        return cls(type="cpu")

    def __str__(self) -> str:
        if self.capability is None:
            return self.type
        return f"{self.type}:sm_{self.capability[0]}{self.capability[1]}"


class DecodeShape(BaseModel):
    """The shape class of a decode call: every fact except batch size and kv lengths.

    This is all a backend's `can_implement` sees, and what the dispatcher
    caches verdicts on, so the cache is exact by construction: batch and
    length limits are declared as data (`mlacore.backend.Limits`) that the
    core evaluates on every problem.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    num_heads: int = Field(ge=1)
    seq_len_q: int = Field(default=1, ge=1)
    page_size: int = Field(ge=1)
    q_dtype: QDType = "bf16"
    kv_dtype: DType = "bf16"
    out_dtype: Optional[OutDType] = None  # None: q's dtype (bf16 for an fp8 query)
    kv_lora_rank: int = KV_LORA_RANK
    qk_rope_head_dim: int = QK_ROPE_HEAD_DIM
    causal: bool = True
    return_lse: bool = True
    scale_inputs: ScaleInputs = "static"
    device: DeviceSpec = DeviceSpec()

    @property
    def output_dtype(self) -> str:
        """The dtype out is written in."""
        if self.out_dtype is not None:
            return self.out_dtype
        return "bf16" if self.q_dtype == "fp8_e4m3" else self.q_dtype

    @property
    def head_dim_qk(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    def describe(self) -> str:
        return (
            f"H={self.num_heads} s_q={self.seq_len_q} page={self.page_size} "
            f"q={self.q_dtype} kv={self.kv_dtype}{self._extras()} {self.device}"
        )

    def _extras(self) -> str:
        extra = ""
        if self.output_dtype != self.q_dtype:
            extra += f" out={self.output_dtype}"
        if self.scale_inputs != "static":
            extra += f" scales={self.scale_inputs}"
        return extra


class DecodeProblem(DecodeShape):
    """One MLA decode call, as the dispatcher and the backends see it.

    Shapes follow the canonical tensors: q [B, s_q, H, 576], cache
    [P, page, 576], table [B, max_pages], lens [B], out [B, s_q, H, 512].
    `max_kv_len`/`min_kv_len` are the largest and smallest entries of lens
    (min 0 means some request has no context at all).
    """

    batch_size: int = Field(ge=1)
    max_kv_len: int = Field(ge=0)
    min_kv_len: int = Field(default=0, ge=0)

    @model_validator(mode="after")
    def _lengths_ordered(self) -> "DecodeProblem":
        if self.min_kv_len > self.max_kv_len:
            raise ValueError(
                f"min_kv_len={self.min_kv_len} is larger than max_kv_len={self.max_kv_len}"
            )
        return self

    @property
    def shape(self) -> DecodeShape:
        """The shape class (what verdicts are cached on)."""
        return DecodeShape(**{k: getattr(self, k) for k in DecodeShape.model_fields})

    def describe(self) -> str:
        return (
            f"H={self.num_heads} s_q={self.seq_len_q} B={self.batch_size} "
            f"kv_len={self.min_kv_len}..{self.max_kv_len} page={self.page_size} "
            f"q={self.q_dtype} kv={self.kv_dtype}{self._extras()} {self.device}"
        )
