"""The `cutlass_mla` backend: FlashInfer's `cutlass` MLA decode (CUTLASS SM100) behind the mlacore contract.

Not verified on hardware: written from FlashInfer 0.7.2's code (its cutlass
backend's plan/run checks and `cutlass_mla.cuh`), host logic tested on a CPU.

The kernel is vLLM's CUTLASS_MLA kernel: 128 heads, one query token per
request, bf16/fp16 q and cache of the same dtype, no LSE output, a fixed
softmax scale. The session lifts what it can (heads, scale, table width,
workspace: see `host.py`) and `can_implement` refuses the rest with reasons.

plan (once per step, host): the lengths and the padded table into session
buffers (graph mode: fixed addresses sized from the envelope); one FlashInfer
plan per batch size, whose metadata the runs override with those buffers.
run (per layer): q lifted and scaled into the session's query buffer, the
kernel, out copied from the [:, :H] view; no host work.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

from pydantic import Field

if TYPE_CHECKING:  # torch is imported where it is used: listing backends and checking a policy stay light
    import torch

from mlacore import (
    Availability,
    Backend,
    BackendInfo,
    BackendOptions,
    Limits,
    Planned,
    Session,
    SessionConfig,
    StepInputs,
    hookimpl,
)
from mlacore.probe import checked_range, library_and_cuda, library_installed
from mlacore.problem import DecodeProblem, DecodeShape, DeviceSpec, torch_dtype

from . import host

DIST = "flashinfer-python"
FLASHINFER_RANGE = ("0.7.2", "0.7.3")
NEEDS = "CUTLASS MLA kernels need SM100"
UNVERIFIED = "not verified on hardware (no SM100 GPU was available; written from FlashInfer 0.7.2's code)"


def sm100(capability: Optional[Tuple[int, int]]) -> bool:
    """FlashInfer's cutlass MLA backend accepts compute capability major 10 or 11."""
    return capability is not None and capability[0] in (10, 11)


class CutlassOptions(BackendOptions):
    sm_count: int = Field(default=0, ge=0, description="SMs the workspace is sized for; 0: the device's")


def shape_reasons(shape: DecodeShape) -> List[str]:
    """Every reason the CUTLASS MLA kernel (with the plugin's head/scale/table lifting) cannot take a shape."""
    dev = shape.device
    if dev.type != "cuda":
        return [f"device={dev}: the CUTLASS MLA kernels run on CUDA GPUs only"]
    out: List[str] = []
    if not sm100(dev.capability):
        out.append(f"{dev}: {NEEDS} (compute capability 10.x or 11.x)")
    if shape.seq_len_q != 1:
        out.append(f"seq_len_q={shape.seq_len_q}: the CUTLASS MLA kernel takes one query token per request")
    if shape.return_lse:
        out.append("return_lse: the CUTLASS MLA kernel writes no LSE")
    if shape.kv_dtype == "fp8_e4m3":
        out.append("kv_dtype=fp8_e4m3: FlashInfer's cutlass MLA input is fp16/bf16 only (vLLM's fp8 CUTLASS MLA "
                   "lives in wheels pinned to other torch versions)")
    if shape.q_dtype not in ("bf16", "fp16"):
        out.append(f"q_dtype={shape.q_dtype} not in {{bf16, fp16}}")
    elif shape.kv_dtype != "fp8_e4m3" and shape.kv_dtype != shape.q_dtype:
        out.append(f"kv_dtype={shape.kv_dtype} must equal q_dtype={shape.q_dtype}")
    if shape.output_dtype != shape.q_dtype:
        out.append(f"out_dtype={shape.output_dtype}: the kernel writes out in q's dtype ({shape.q_dtype})")
    if shape.page_size > 128 or 128 % shape.page_size:
        out.append(f"page_size={shape.page_size}: the CUTLASS MLA kernel needs a page size dividing 128")
    if shape.num_heads > host.KERNEL_HEADS:
        out.append(f"num_heads={shape.num_heads} > 128 (heads below 128 are padded by the plugin)")
    if (shape.kv_lora_rank, shape.qk_rope_head_dim) != (512, 64):
        out.append(f"kv_lora_rank={shape.kv_lora_rank}, rope dim {shape.qk_rope_head_dim}: the kernel is built "
                   "for 512 + 64")
    if shape.scale_inputs != "static":
        out.append(f"scale_inputs={shape.scale_inputs}: the cutlass path has no fp8 scales")
    return out


class CutlassBackend(Backend):
    """CUTLASS SM100 MLA decode through FlashInfer: one query token, bf16/fp16, any H <= 128 (padded)."""

    name = "cutlass_mla"
    Options = CutlassOptions

    @hookimpl
    def info(self) -> BackendInfo:
        return BackendInfo(
            description="CUTLASS SM100 MLA decode (FlashInfer backend='cutlass'): s_q=1, bf16/fp16, H<=128 "
                        "padded to 128, sm_scale folded into q",
            notes=(UNVERIFIED,
                   f"checked against {DIST}>={FLASHINFER_RANGE[0]},<{FLASHINFER_RANGE[1]}",
                   "q is rounded once more after the scale fold (one bf16/fp16 multiply)"),
            q_layouts=("packed",), kv_layouts=("packed",), strided_q=True,
        )

    @staticmethod
    def _judge(cap: Optional[Tuple[int, int]], reasons: List[str], details: Dict[str, str]) -> None:
        version = checked_range(DIST, details.get("flashinfer"), *FLASHINFER_RANGE)
        if version:
            reasons.append(version)
        if cap is not None and not sm100(cap):
            reasons.append(f"sm_{cap[0]}{cap[1]}: {NEEDS}")
        if cap is not None and sm100(cap):
            details["status"] = UNVERIFIED

    @hookimpl
    def availability(self) -> Availability:
        reasons, details, cap = library_and_cuda("flashinfer", DIST, f"pip install {DIST}", key="flashinfer")
        self._judge(cap, reasons, details)
        return Availability.from_reasons(reasons, **details)

    @hookimpl
    def availability_for(self, device: DeviceSpec) -> Availability:
        reasons, details = library_installed("flashinfer", DIST, f"pip install {DIST}", key="flashinfer")
        if device.type != "cuda" or device.capability is None:
            reasons.append(f"device={device}: {NEEDS}")
        self._judge(device.capability, reasons, details)
        details["simulated"] = f"{device} (installed packages only, no GPU probed)"
        return Availability.from_reasons(reasons, **details)

    @hookimpl
    def can_implement(self, shape: DecodeShape, options: CutlassOptions) -> List[str]:
        return shape_reasons(shape)

    @hookimpl
    def limits(self, shape: DecodeShape, options: CutlassOptions) -> Limits:
        return Limits(min_kv_len=1, why="cutlass_mla: zero-length requests are refused until verified on an "
                                        "SM100 GPU (the kernel's can_implement needs K > 0)")

    @hookimpl
    def open(self, config: SessionConfig, options: CutlassOptions) -> "CutlassSession":
        return CutlassSession(config, options)


class CutlassPlanned(Planned):
    """One step: runs the kernel per layer on the session's lifted q, padded table and bucket workspace."""

    __slots__ = ("wrapper", "qbuf", "obuf", "lens", "table", "factor", "batch", "num_heads", "direct")

    def __init__(self, wrapper: Any, qbuf: torch.Tensor, obuf: torch.Tensor, lens: torch.Tensor,
                 table: torch.Tensor, factor: float, batch: int, num_heads: int) -> None:
        self.wrapper, self.qbuf, self.obuf, self.lens, self.table = wrapper, qbuf, obuf, lens, table
        self.factor, self.batch, self.num_heads = factor, batch, num_heads

    def run(self, q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor, lse: Optional[torch.Tensor],
            kv_scale: Any = None, q_scale: Any = None) -> None:
        if lse is not None:
            raise ValueError("lse: the CUTLASS MLA kernel writes no LSE (its can_implement refuses return_lse)")
        B, H = self.batch, self.num_heads
        query = host.lift_query(q, self.qbuf, self.factor)
        kernel_out = self.obuf[:B]
        self.wrapper.run(query=query, kv_cache=kv_cache, out=kernel_out, kv_len=self.lens, page_table=self.table)
        out.view(B, H, out.shape[-1]).copy_(host.slice_output(self.obuf, B, H))


class CutlassSession(Session):
    """One decoder's CUTLASS state: query/output buffers, lengths and padded table, a workspace per batch bucket.

    Graph mode: every buffer is sized from the envelope once and never
    moves; the table width is the envelope's, padded, so the kernel's split
    count (from width x page size) is the one captured.
    """

    def __init__(self, config: SessionConfig, options: CutlassOptions) -> None:
        import torch

        self.config, self.options = config, options
        self.device = torch.device("cuda", config.device_index)
        self.sm_count = options.sm_count or torch.cuda.get_device_properties(self.device).multi_processor_count
        self.factor = host.scale_fold_factor(config.sm_scale, config.qk_rope_head_dim)
        self.dtype = torch_dtype(config.q_dtype)
        env = config.envelope
        self._width = host.padded_table_width(env.max_pages(config.page_size), config.page_size) if env else None
        self._qbuf: Optional[torch.Tensor] = None
        self._obuf: Optional[torch.Tensor] = None
        self._lens: Optional[torch.Tensor] = None
        self._table: Optional[torch.Tensor] = None  # flat int32
        self._workspaces: Dict[int, torch.Tensor] = {}  # batch bucket -> workspace
        self._wrappers: Dict[int, Any] = {}  # batch size -> planned FlashInfer wrapper
        if env is not None:
            self._grow(env.max_batch, env.max_batch * self._width)

    def _grow(self, batch: int, table_entries: int) -> None:
        """Buffers for `batch` rows; zero-initialised so padded heads stay zero (never in graph mode after open)."""
        import torch

        if self._qbuf is None or self._qbuf.shape[0] < batch:
            if self.config.envelope is not None and self._qbuf is not None:
                raise ValueError(f"cuda_graph: batch {batch} is over the envelope's {self._qbuf.shape[0]}")
            d = self.config.kv_lora_rank + self.config.qk_rope_head_dim
            self._qbuf = torch.zeros(batch, host.KERNEL_HEADS, d, dtype=self.dtype, device=self.device)
            self._obuf = torch.empty(batch, host.KERNEL_HEADS, self.config.kv_lora_rank, dtype=self.dtype,
                                     device=self.device)
            self._lens = torch.zeros(batch, dtype=torch.int32, device=self.device)
        if self._table is None or self._table.numel() < table_entries:
            if self.config.envelope is not None and self._table is not None:
                raise ValueError("cuda_graph: the page table outgrew the envelope")
            self._table = torch.zeros(table_entries, dtype=torch.int32, device=self.device)

    def _workspace(self, batch: int) -> torch.Tensor:
        import torch

        env = self.config.envelope
        bucket = env.max_batch if env is not None else host.batch_bucket(batch)
        ws = self._workspaces.get(bucket)
        if ws is None:
            ws = torch.empty(host.bucket_workspace_bytes(bucket, self.sm_count, self.config.kv_lora_rank),
                             dtype=torch.uint8, device=self.device)
            self._workspaces[bucket] = ws
        return ws

    def _wrapper(self, problem: DecodeProblem, step: StepInputs, width: int) -> Any:
        """One FlashInfer cutlass wrapper per batch size, planned once (runs pass the session's metadata)."""
        import torch

        B = problem.batch_size
        found = self._wrappers.get(B)
        if found is not None:
            return found
        from flashinfer.mla import BatchMLAPagedAttentionWrapper, MLAPlanMetadata

        wrapper = BatchMLAPagedAttentionWrapper(self._workspace(B), backend="cutlass")
        table = torch.zeros(B, width, dtype=torch.int32)
        table[:, : step.page_table_host.shape[1]] = step.page_table_host[:, :width]
        wrapper.plan(
            metadata=MLAPlanMetadata.dense(torch.arange(B + 1, dtype=torch.int32), table,
                                           step.kv_lens_host.to(torch.int32).clamp(min=1)),
            num_heads=host.KERNEL_HEADS, head_dim_ckv=problem.kv_lora_rank, head_dim_kpe=problem.qk_rope_head_dim,
            page_size=problem.page_size, causal=problem.causal, sm_scale=host.kernel_scale(problem.qk_rope_head_dim),
            q_data_type=self.dtype, kv_data_type=self.dtype, query_layout="packed", kv_cache_layout="packed",
            lse_mode="none",
        )
        self._wrappers[B] = wrapper
        return wrapper

    def plan(self, problem: DecodeProblem, step: StepInputs) -> CutlassPlanned:
        B = problem.batch_size
        width = self._width or host.padded_table_width(step.page_table.shape[1], problem.page_size)
        self._grow(B, B * width)
        lens = self._lens[:B]
        lens.copy_(step.kv_lens, non_blocking=True)
        table = host.pad_page_table(step.page_table, problem.page_size, self._table, width)
        wrapper = self._wrapper(problem, step, width)
        return CutlassPlanned(wrapper, self._qbuf, self._obuf, lens, table, self.factor, B, problem.num_heads)

    def close(self) -> None:
        self._wrappers.clear()
        self._workspaces.clear()
        self._qbuf = self._obuf = self._lens = self._table = None


backend = CutlassBackend()
