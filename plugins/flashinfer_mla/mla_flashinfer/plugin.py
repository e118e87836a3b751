"""The `flashinfer_mla` backend: hook implementations.

plan (once per step, host): convert the canonical table to FlashInfer's
metadata and call the FlashInfer wrapper's plan (its split-kv schedule).
run (per layer, device): reshape views, one FlashInfer call; no host work.

One FlashInfer wrapper per (decoder, variant) holds the current plan; a
newer plan of the same decoder replaces it, and running an older plan is an
error rather than a silent wrong answer. With `MLADecoder(cuda_graph=True)`
each batch size gets its own wrapper with fixed device buffers, so a graph
captured after one plan can be replayed after later plans of that batch size.
"""

from __future__ import annotations

import functools
import importlib.util
import threading
import weakref
from dataclasses import dataclass
from importlib import metadata as importlib_metadata
from typing import Any, Dict, List, Optional, Tuple

import torch

from mlacore import Availability, BackendInfo, hookimpl
from mlacore.hookspecs import StepInputs
from mlacore.problem import DecodeProblem, torch_dtype

from . import variants
from .metadata import csr_from_table, trtllm_gen_args

DIST = "flashinfer-python"


# -- availability -------------------------------------------------------------


@hookimpl
def mla_backend_info() -> BackendInfo:
    return BackendInfo(
        description="FlashInfer MLA decode: fa3 (sm_90, bf16/fp16, fp8 KV), fa2 (sm_80+), trtllm-gen (sm_100/103)",
        notes=("fa2/fa3 checked on an H200 (sm_90); trtllm-gen: not verified on hardware",),
    )


@hookimpl
def mla_availability() -> Availability:
    reasons = []
    details = {}
    if importlib.util.find_spec("flashinfer") is None:
        reasons.append(f"{DIST} is not installed (pip install {DIST})")
    else:
        try:
            details["flashinfer"] = importlib_metadata.version(DIST)
        except importlib_metadata.PackageNotFoundError:
            details["flashinfer"] = "?"
    if torch.version.cuda is None:
        reasons.append(f"torch {torch.__version__} has no CUDA support")
    elif not torch.cuda.is_available():
        reasons.append("no CUDA device visible (torch.cuda.is_available() is False)")
    else:
        cap = torch.cuda.get_device_capability()
        details["device"] = f"{torch.cuda.get_device_name()} sm_{cap[0]}{cap[1]}"
        details["cuda"] = str(torch.version.cuda)
        variant = variants.auto_variant(cap)
        if variant is None:
            reasons.append(f"sm_{cap[0]}{cap[1]}: FlashInfer MLA needs sm_80 or newer")
        else:
            details["variant"] = variant + (f" ({variants.UNVERIFIED[variant]})" if variant in variants.UNVERIFIED else "")
    return Availability.from_reasons(reasons, **details)


@functools.lru_cache(maxsize=None)
def _device_smem(index: int) -> Tuple[int, int]:
    props = torch.cuda.get_device_properties(index)
    per_sm = getattr(props, "shared_memory_per_multiprocessor", 0)
    per_block = getattr(props, "shared_memory_per_block_optin", 0)
    return per_sm, per_block


@hookimpl
def mla_option_errors(options: Dict[str, Any]) -> List[str]:
    return variants.option_errors(options)


@hookimpl
def mla_can_implement(problem: DecodeProblem, options: Dict[str, Any]) -> List[str]:
    smem = None
    if (problem.device.type == "cuda" and torch.cuda.is_available()
            and torch.cuda.get_device_capability() == problem.device.capability):
        smem = _device_smem(torch.cuda.current_device())
    return variants.reasons(problem, options, smem)


# -- per-decoder state ------------------------------------------------------------

_lock = threading.Lock()
_workspaces: Dict[Tuple[str, int], torch.Tensor] = {}
_slots: "weakref.WeakKeyDictionary[Any, Dict[tuple, _Slot]]" = weakref.WeakKeyDictionary()
_anonymous_owner_slots: Dict[tuple, "_Slot"] = {}


def _workspace(device: torch.device, mb: int, zeroed: bool) -> torch.Tensor:
    key = ("zero" if zeroed else "float", device.index or 0)
    buf = _workspaces.get(key)
    if buf is None or buf.numel() < mb * 1024 * 1024:
        alloc = torch.zeros if zeroed else torch.empty
        buf = alloc(mb * 1024 * 1024, dtype=torch.uint8, device=device)
        _workspaces[key] = buf
    return buf


class _Slot:
    """One FlashInfer wrapper and the generation of the plan it holds."""

    def __init__(self, wrapper: Any, capacity: Optional[int] = None) -> None:
        self.wrapper = wrapper
        self.generation = 0
        self.capacity = capacity  # kv_indices buffer length (CUDA-graph mode)


def _slot_table(owner: Any) -> Dict[tuple, _Slot]:
    if owner is None:
        return _anonymous_owner_slots
    table = _slots.get(owner)
    if table is None:
        table = {}
        _slots[owner] = table
    return table


# -- plan / run -------------------------------------------------------------------


@dataclass(frozen=True)
class FAPlan:
    slot: _Slot
    generation: int
    rows: int  # batch * seq_len_q
    num_heads: int
    scales: Dict[str, float]


@dataclass(frozen=True)
class TrtllmGenPlan:
    workspace: torch.Tensor
    kv_lens: torch.Tensor
    block_tables: torch.Tensor
    max_seq_len: int
    bmm1_scale: float
    bmm2_scale: float
    rows: int
    num_heads: int


@hookimpl
def mla_plan(problem: DecodeProblem, options: Dict[str, Any], step: StepInputs):
    variant = variants.variant_for(problem, options)
    device = step.kv_lens.device
    mb = int(options.get("workspace_mb", 128))
    if variant == "trtllm-gen":
        args = trtllm_gen_args(step.page_table, problem.page_size, problem.max_kv_len, step.sm_scale, step.kv_scale)
        return TrtllmGenPlan(_workspace(device, mb, zeroed=True), step.kv_lens, args.block_tables,
                             args.max_seq_len, args.bmm1_scale, args.bmm2_scale,
                             problem.batch_size * problem.seq_len_q, problem.num_heads)
    return _plan_fa(variant, problem, step, device, mb)


def _plan_fa(variant: str, problem: DecodeProblem, step: StepInputs, device: torch.device, mb: int) -> FAPlan:
    from flashinfer.mla import BatchMLAPagedAttentionWrapper, MLAPlanMetadata

    csr = csr_from_table(step.kv_lens_host, step.page_table_host, problem.page_size, problem.seq_len_q)
    B = problem.batch_size
    key = (variant, problem.return_lse, problem.seq_len_q) + ((B,) if step.cuda_graph else ())
    with _lock:
        table = _slot_table(step.owner)
        slot = table.get(key)
        if slot is None:
            ws = _workspace(device, mb, zeroed=False)
            if step.cuda_graph:
                capacity = B * step.page_table_host.shape[1]
                wrapper = BatchMLAPagedAttentionWrapper(
                    ws, use_cuda_graph=True,
                    qo_indptr=torch.empty(B + 1, dtype=torch.int32, device=device),
                    kv_indptr=torch.empty(B + 1, dtype=torch.int32, device=device),
                    kv_indices=torch.empty(max(1, capacity), dtype=torch.int32, device=device),
                    kv_len_arr=torch.empty(B, dtype=torch.int32, device=device),
                    backend=variant,
                )
                slot = _Slot(wrapper, capacity)
            else:
                slot = _Slot(BatchMLAPagedAttentionWrapper(ws, backend=variant))
            table[key] = slot
        if slot.capacity is not None and csr.kv_indices.numel() > slot.capacity:
            raise ValueError(
                f"cuda_graph: this step uses {csr.kv_indices.numel()} pages but the buffers fixed for "
                f"batch {B} hold {slot.capacity} (batch x page_table width at the first plan); plan the "
                "widest page_table first, since captured graphs keep those buffers' addresses"
            )
        q_dtype = torch_dtype(problem.q_dtype)
        slot.wrapper.plan(
            metadata=MLAPlanMetadata.csr(csr.qo_indptr, csr.kv_indptr, csr.kv_indices, csr.kv_len_arr),
            num_heads=problem.num_heads, head_dim_ckv=problem.kv_lora_rank,
            head_dim_kpe=problem.qk_rope_head_dim, page_size=problem.page_size, causal=problem.causal,
            sm_scale=step.sm_scale, q_data_type=q_dtype, kv_data_type=torch_dtype(problem.kv_dtype),
            query_layout="packed", kv_cache_layout="packed",
            lse_mode="basee" if problem.return_lse else "none",
        )
        slot.generation += 1
    scales = {}
    if problem.kv_dtype == "fp8_e4m3":
        scales = {"ckv_scale": step.kv_scale, "kpe_scale": step.kv_scale}
    return FAPlan(slot, slot.generation, B * problem.seq_len_q, problem.num_heads, scales)


@hookimpl
def mla_run(plan: Any, q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor,
            lse: Optional[torch.Tensor]) -> None:
    if type(plan) is FAPlan:
        if plan.slot.generation != plan.generation:
            raise RuntimeError(
                "this plan was replaced by a later plan() of the same decoder (FlashInfer keeps one "
                "schedule per wrapper); run the newest plan"
            )
        rows, heads = plan.rows, plan.num_heads
        has_lse = lse is not None
        plan.slot.wrapper.run(
            query=q.view(rows, heads, q.shape[-1]), kv_cache=kv_cache,
            out=out.view(rows, heads, out.shape[-1]),
            lse=lse.view(rows, heads) if has_lse else None,
            return_lse=has_lse, return_lse_base_on_e=has_lse, **plan.scales,
        )
        return
    _run_trtllm_gen(plan, q, kv_cache, out, lse)


def _run_trtllm_gen(plan: TrtllmGenPlan, q, kv_cache, out, lse) -> None:  # not verified on hardware
    from flashinfer.mla import trtllm_batch_decode_with_kv_cache_mla

    has_lse = lse is not None
    trtllm_batch_decode_with_kv_cache_mla(
        query=q, kv_cache=kv_cache, workspace_buffer=plan.workspace, qk_nope_head_dim=128,
        kv_lora_rank=out.shape[-1], qk_rope_head_dim=q.shape[-1] - out.shape[-1],
        block_tables=plan.block_tables, seq_lens=plan.kv_lens, max_seq_len=plan.max_seq_len,
        out=out, bmm1_scale=plan.bmm1_scale, bmm2_scale=plan.bmm2_scale, backend="trtllm-gen",
        lse=lse.view(plan.rows, plan.num_heads) if has_lse else None, return_lse=has_lse,
        return_lse_base="basee" if has_lse else None,
    )
