"""cute_dsl_mla on SM100/SM103/SM107: FlashInfer's `cute-dsl-monolithic` MLA decode (not verified on hardware).

The CUTLASS CuTe DSL Blackwell MLA decode line (the kernel TensorRT-LLM
vendored as its `cute_dsl_mla` FMHA library), called through FlashInfer
0.7.2's `BatchMLAPagedAttentionWrapper(backend="cute-dsl-monolithic")`,
with the same plan/run contract as our Hopper kernels. Written from
FlashInfer's code (`_cute_dsl_common.py`, `cute_dsl_monolithic_backend.py`,
the kernels' `can_implement`); no SM100 GPU was available to run it.

Eager: one wrapper per seq_len_q, re-planned every step from host metadata.
Graph mode: one wrapper per (seq_len_q, batch), planned once on
session-owned device buffers (lengths, a table whose width is a multiple of
128 / page_size); later plans copy into them in place, as FlashInfer's graph
contract asks, and the kernel's split count comes from the fixed width.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

if TYPE_CHECKING:
    import torch

from mlacore import Limits, Planned, Session, SessionConfig, StepInputs
from mlacore.problem import DecodeProblem, DecodeShape

CAPS = ((10, 0), (10, 3), (10, 7))
UNVERIFIED = "sm_100/103/107 path (FlashInfer cute-dsl-monolithic): not verified on hardware"
FP16_REASON = ("q_dtype=fp16: kept out on SM100 until a test shows the FP16 path does not abort "
               "(TensorRT-LLM's review found it crashing); use bf16")


def is_sm100(capability: Optional[Tuple[int, int]]) -> bool:
    return capability in CAPS


def shape_reasons(shape: DecodeShape) -> List[str]:
    """Every reason the SM100 path cannot take a shape class (the kernels' can_implement, FlashInfer's plan checks)."""
    out: List[str] = []
    if shape.q_dtype == "fp16":
        out.append(FP16_REASON)
    elif shape.q_dtype not in ("bf16", "fp8_e4m3"):
        out.append(f"q_dtype={shape.q_dtype} not in {{bf16, fp8_e4m3}} (sm_100 path)")
    if shape.kv_dtype != shape.q_dtype:
        hint = " (an fp8 cache needs an fp8 query here)" if shape.kv_dtype == "fp8_e4m3" else ""
        out.append(f"kv_dtype={shape.kv_dtype} must equal q_dtype={shape.q_dtype} on the sm_100 path{hint}")
    if shape.output_dtype != "bf16":
        out.append(f"out_dtype={shape.output_dtype}: the sm_100 path writes bf16")
    if (shape.kv_lora_rank, shape.qk_rope_head_dim) != (512, 64):
        out.append(f"kv_lora_rank={shape.kv_lora_rank}, rope dim {shape.qk_rope_head_dim}: the kernels are built "
                   "for 512 + 64")
    if shape.num_heads > 128:
        out.append(f"num_heads={shape.num_heads} > 128 (one 128-row M tile)")
    if shape.page_size < 2 or shape.page_size > 128 or 128 % shape.page_size:
        out.append(f"page_size={shape.page_size}: the sm_100 kernels take page sizes 2..128 dividing 128 "
                   "(page 1 is not 128-byte aligned for TMA)")
    if shape.seq_len_q > 1 and not shape.causal:
        out.append("non-causal seq_len_q > 1: cute-dsl-monolithic masks multi-token queries causally only")
    if shape.scale_inputs == "tensor":
        out.append("scale_inputs=tensor: cute-dsl takes bmm scales as host floats only")
    return out


def limits(shape: DecodeShape) -> Limits:
    """Positive lengths only (FlashInfer refuses seq_lens <= 0), and each query token must see itself."""
    return Limits(min_kv_len=max(1, shape.seq_len_q),
                  why="cute-dsl-monolithic requires positive seq_lens; shorter than seq_len_q is unverified")


def bmm_scales(sm_scale: float, kv_scale: float, q_scale: float, fp8: bool) -> Tuple[float, float]:
    """(bmm1, bmm2) for the kernel: fp8 folds the q and cache dequant scales in, as FlashInfer's trtllm API does."""
    if not fp8:
        return float(sm_scale), 1.0
    return float(sm_scale * q_scale * kv_scale), float(kv_scale)


class Sm100Planned(Planned):
    """One step of the SM100 path: the planned FlashInfer wrapper runs per layer."""

    __slots__ = ("generation", "slot", "rows", "num_heads", "scales", "sm_scale", "fp8", "kv_scale", "q_scale")

    def __init__(self, slot: "_Slot", rows: int, num_heads: int, sm_scale: float, kv_scale: float,
                 q_scale: float, fp8: bool) -> None:
        self.slot, self.generation = slot, slot.generation
        self.rows, self.num_heads = rows, num_heads
        self.sm_scale, self.kv_scale, self.q_scale, self.fp8 = sm_scale, kv_scale, q_scale, fp8
        self.scales = bmm_scales(sm_scale, kv_scale, q_scale, fp8)

    def run(self, q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor, lse: Optional[torch.Tensor],
            kv_scale: Any = None, q_scale: Any = None) -> None:
        if self.slot.generation != self.generation:
            raise RuntimeError("this plan was replaced by a later plan() of the same session; run the newest plan")
        bmm1, bmm2 = self.scales
        if kv_scale is not None or q_scale is not None:  # scale_inputs="float"
            bmm1, bmm2 = bmm_scales(self.sm_scale, self.kv_scale if kv_scale is None else kv_scale,
                                    self.q_scale if q_scale is None else q_scale, self.fp8)
        rows, heads = self.rows, self.num_heads
        has_lse = lse is not None
        self.slot.wrapper.run(
            query=q.view(rows, heads, q.shape[-1]), kv_cache=kv_cache, out=out.view(rows, heads, out.shape[-1]),
            lse=lse.view(rows, heads) if has_lse else None, return_lse=has_lse, return_lse_base_on_e=has_lse,
            bmm1_scale=bmm1, bmm2_scale=bmm2,
        )


class _Slot:
    __slots__ = ("wrapper", "generation", "lens", "table", "cum_q")

    def __init__(self, wrapper: Any, lens: Any = None, table: Any = None, cum_q: Any = None) -> None:
        self.wrapper, self.generation = wrapper, 0
        self.lens, self.table, self.cum_q = lens, table, cum_q


def aligned_width(pages: int, page_size: int) -> int:
    multiple = 128 // page_size
    return max(multiple, -(-pages // multiple) * multiple)


class Sm100Session(Session):
    """One decoder's SM100 state: a workspace, wrappers per seq_len_q (and batch, in graph mode), graph buffers."""

    def __init__(self, config: SessionConfig, workspace_mb: int) -> None:
        import torch

        self.config = config
        self.device = torch.device("cuda", config.device_index)
        self.fp8 = config.q_dtype == "fp8_e4m3"
        self._workspace = torch.zeros(workspace_mb * 1024 * 1024, dtype=torch.uint8, device=self.device)
        self._slots: Dict[tuple, _Slot] = {}

    def _plan_kwargs(self, problem: DecodeProblem) -> Dict[str, Any]:
        import torch

        from mlacore.problem import torch_dtype

        return dict(num_heads=problem.num_heads, head_dim_ckv=problem.kv_lora_rank,
                    head_dim_kpe=problem.qk_rope_head_dim, page_size=problem.page_size, causal=problem.causal,
                    sm_scale=float(self.config.sm_scale), q_data_type=torch_dtype(problem.q_dtype),
                    kv_data_type=torch_dtype(problem.kv_dtype), output_dtype=torch.bfloat16,
                    query_layout="packed", kv_cache_layout="packed",
                    lse_mode="basee" if problem.return_lse else "none", scale_mode="bmm-scalar")

    def plan(self, problem: DecodeProblem, step: StepInputs) -> Sm100Planned:
        import torch

        from flashinfer.mla import BatchMLAPagedAttentionWrapper, MLAPlanMetadata

        B, s_q = problem.batch_size, problem.seq_len_q
        env = self.config.envelope
        if env is None:
            slot = self._slots.get((s_q,))
            if slot is None:
                slot = self._slots[(s_q,)] = _Slot(BatchMLAPagedAttentionWrapper(
                    self._workspace, backend="cute-dsl-monolithic"))
            cum_q = torch.arange(B + 1, dtype=torch.int32) * s_q
            slot.wrapper.plan(metadata=MLAPlanMetadata.dense(cum_q, step.page_table_host.to(torch.int32),
                                                             step.kv_lens_host.to(torch.int32), max_q_len=s_q),
                              **self._plan_kwargs(problem))
        else:
            slot = self._slots.get((s_q, B))
            width = aligned_width(env.max_pages(problem.page_size), problem.page_size)
            if slot is None:
                slot = _Slot(BatchMLAPagedAttentionWrapper(self._workspace, use_cuda_graph=True,
                                                           backend="cute-dsl-monolithic"),
                             torch.zeros(B, dtype=torch.int32, device=self.device),
                             torch.zeros(B, width, dtype=torch.int32, device=self.device),
                             (torch.arange(B + 1, dtype=torch.int32) * s_q).to(self.device))
            w = min(step.page_table.shape[1], width)
            slot.lens.copy_(step.kv_lens, non_blocking=True)
            slot.table[:, :w].copy_(step.page_table[:, :w], non_blocking=True)
            if w < width:
                slot.table[:, w:].zero_()
            if (s_q, B) not in self._slots:  # FlashInfer allows one graph plan per wrapper: plan on the buffers once
                slot.wrapper.plan(metadata=MLAPlanMetadata.dense(slot.cum_q, slot.table, slot.lens, max_q_len=s_q),
                                  **self._plan_kwargs(problem))
                self._slots[(s_q, B)] = slot
        slot.generation += 1
        return Sm100Planned(slot, B * s_q, problem.num_heads, self.config.sm_scale, self.config.kv_scale,
                            self.config.q_scale, self.fp8)

    def close(self) -> None:
        self._slots.clear()
        self._workspace = None
