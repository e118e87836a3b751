"""The `flashinfer_mla` backend: FlashInfer's MLA decode kernels behind the mlacore contract.

fa2, fa3 and trtllm-gen stay *variants* of one backend (an option), not three
backends: they share one distribution, one availability answer (is
flashinfer importable, which GPU), one wrapper class and one workspace per
session, and `mla tune` already routes variants per shape through allow-rule
options. Three backends would triple those answers and make every policy
name FlashInfer three times.

plan (once per step, host): convert the canonical table to FlashInfer's CSR
metadata and call the wrapper's plan (its split-kv schedule).
run (per layer, device): views, one FlashInfer kernel launch; no host sync. With
launch="direct" (the default) the call goes to the planned fa2/fa3 launcher with
arguments fixed at plan, skipping wrapper.run's per-call re-validation (which the
decoder has done once per plan and tensor); launch="wrapper" keeps the public call.

All state (workspace, wrappers, CUDA-graph buffers) lives in the session the
decoder owns. In CUDA-graph mode every batch size gets its own wrapper whose
buffers are sized from the decoder's envelope, so a graph captured after one
plan replays correctly after later plans of that batch size.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Dict, List, Literal, NamedTuple, Optional, Tuple

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

from . import variants

DIST = "flashinfer-python"
# the FlashInfer releases this plugin's argument names, dtypes and checks were read from (and fa2/fa3 run with)
FLASHINFER_RANGE = ("0.7.2", "0.7.3")


class FlashInferOptions(BackendOptions):
    variant: Literal["auto", "fa2", "fa3", "trtllm-gen"] = Field(
        default="auto", description="kernel family; auto: fa3 on sm_90, trtllm-gen on sm_100/103/107, else fa2")
    workspace_mb: int = Field(default=128, ge=1, description="float workspace per session, MiB")
    launch: Literal["direct", "wrapper"] = Field(
        default="direct",
        description="fa2/fa3 per-layer call: direct: the wrapper's planned kernel launcher with arguments fixed at "
                    "plan (the decoder checked the tensors); wrapper: FlashInfer's public wrapper.run, which "
                    "re-validates every call (50-60 us of host time per call on the H200 host)")


@functools.lru_cache(maxsize=None)
def _device_smem(index: int) -> Tuple[int, int]:
    import torch

    props = torch.cuda.get_device_properties(index)
    per_sm = getattr(props, "shared_memory_per_multiprocessor", 0)
    per_block = getattr(props, "shared_memory_per_block_optin", 0)
    return per_sm, per_block


class FlashInferBackend(Backend):
    """FlashInfer MLA decode: fa3 (sm_90), fa2 (sm_80+), trtllm-gen (sm_100/103/107)."""

    name = "flashinfer_mla"
    Options = FlashInferOptions

    @hookimpl
    def info(self) -> BackendInfo:
        return BackendInfo(
            description="FlashInfer MLA decode: fa3 (sm_90, bf16/fp16, fp8 KV), fa2 (sm_80+), "
                        "trtllm-gen (sm_100/103/107, bf16 or fp8 q + fp8 KV)",
            notes=("fa2/fa3 checked on an H200 (sm_90); trtllm-gen: not verified on hardware",
                   f"checked against {DIST}>={FLASHINFER_RANGE[0]},<{FLASHINFER_RANGE[1]}"),
            q_layouts=("packed", "split"), kv_layouts=("packed", "split"), strided_q=True,
        )

    @staticmethod
    def _judge_capability(cap: Tuple[int, int], reasons: List[str], details: Dict[str, str]) -> None:
        variant = variants.auto_variant(cap)
        if variant is None:
            reasons.append(f"sm_{cap[0]}{cap[1]}: FlashInfer MLA needs sm_80 or newer")
        else:
            details["variant"] = variant + (
                f" ({variants.UNVERIFIED[variant]})" if variant in variants.UNVERIFIED else "")

    @hookimpl
    def availability(self) -> Availability:
        reasons, details, cap = library_and_cuda("flashinfer", DIST, f"pip install {DIST}", key="flashinfer")
        version = checked_range(DIST, details.get("flashinfer"), *FLASHINFER_RANGE)
        if version:
            reasons.append(version)
        if cap is not None:
            self._judge_capability(cap, reasons, details)
        return Availability.from_reasons(reasons, **details)

    @hookimpl
    def availability_for(self, device: DeviceSpec) -> Availability:
        reasons, details = library_installed("flashinfer", DIST, f"pip install {DIST}", key="flashinfer")
        version = checked_range(DIST, details.get("flashinfer"), *FLASHINFER_RANGE)
        if version:
            reasons.append(version)
        if device.type != "cuda" or device.capability is None:
            reasons.append(f"device={device}: FlashInfer runs on CUDA GPUs only")
        else:
            self._judge_capability(device.capability, reasons, details)
        details["simulated"] = f"{device} (installed packages only, no GPU probed)"
        return Availability.from_reasons(reasons, **details)

    @hookimpl
    def can_implement(self, shape: DecodeShape, options: FlashInferOptions) -> List[str]:
        import torch

        smem = None
        if (shape.device.type == "cuda" and torch.cuda.is_available()
                and torch.cuda.get_device_capability() == shape.device.capability):
            smem = _device_smem(torch.cuda.current_device())
        return variants.reasons(shape, options, smem)

    @hookimpl
    def limits(self, shape: DecodeShape, options: FlashInferOptions) -> Limits:
        if variants.variant_for(shape, options) in ("fa2", "fa3"):
            per_request = variants.fa_work_items_per_request(shape)
            return Limits(max_batch=variants.FA_MAX_WORK_ITEMS // per_request,
                          why=f"FlashInfer's scheduler takes at most {variants.FA_MAX_WORK_ITEMS} work items, "
                              f"{per_request} query tile(s) per request here")
        if variants.variant_for(shape, options) == "trtllm-gen":
            return Limits(min_kv_len=variants.trtllm_gen_min_kv_len(shape),
                          why="trtllm-gen: zero-length requests and requests shorter than seq_len_q have no "
                              "verified semantics (not verified on hardware)")
        return Limits()

    @hookimpl
    def open(self, config: SessionConfig, options: FlashInferOptions) -> "FlashInferSession":
        return FlashInferSession(config, options)


# -- session / plan / run ------------------------------------------------------


class _Slot:
    """One FlashInfer wrapper and the generation of the plan it holds."""

    __slots__ = ("wrapper", "generation", "capacity")

    def __init__(self, wrapper: Any, capacity: Optional[int] = None) -> None:
        self.wrapper = wrapper
        self.generation = 0
        self.capacity = capacity  # kv_indices buffer length (CUDA-graph mode)


class _ViewCache:
    """Views of long-lived tensors (the per-layer caches), made once per tensor object.

    Keyed by id with a weak reference whose callback drops the entry when the
    tensor dies, so the cached views never keep a freed cache's storage alive
    and a recycled id is never mistaken for the old tensor. Views are made
    from `t.detach()`: a view's `_base` would otherwise hold `t` itself alive.
    """

    __slots__ = ("_entries", "__weakref__")

    def __init__(self) -> None:
        self._entries: Dict[int, tuple] = {}

    def get(self, t: Any) -> Any:
        entry = self._entries.get(id(t))
        if entry is not None and entry[0]() is t:
            return entry[1]
        return None

    def put(self, t: Any, views: Any) -> Any:
        import weakref

        if len(self._entries) > 4096:  # engines have one cache per layer; never grow unbounded
            self._entries.clear()
        key = id(t)
        entries = self._entries

        def forget(_ref: Any, key: int = key) -> None:
            entries.pop(key, None)

        self._entries[key] = (weakref.ref(t, forget), views)
        return views


class DirectLaunch(NamedTuple):
    """The planned fa2/fa3 kernel launcher and its plan-time arguments (one tuple unpack per layer)."""

    run: Any
    float_workspace: Any
    int_workspace: Any
    plan_info: Any
    kv_indices: Any
    mask_mode: int
    page_size: int
    sm_scale: float


def direct_launcher(wrapper: Any) -> Optional[DirectLaunch]:
    """The planned fa2/fa3 backend's kernel launcher and its plan-time arguments, or None when this
    FlashInfer does not have the internals read from 0.7.2 (the caller then uses wrapper.run).

    FlashInfer's wrapper.run re-resolves the input layouts and re-validates shapes, dtypes and scales
    on every call; the decoder has already checked all of that once per plan and per tensor, so the
    per-layer call can go straight to the generated module's run with the same arguments."""
    planned = getattr(wrapper, "_planned_backend", None)
    names = ("_cached_module", "_float_workspace_buffer", "_int_workspace_buffer", "_plan_info", "_kv_indices_buf",
             "_causal", "_page_size", "_sm_scale", "_use_profiler", "_kv_data_type")
    if planned is None or type(planned).__name__ not in _DIRECT_CLASSES or not all(hasattr(planned, n) for n in names):
        return None
    if planned._use_profiler or not callable(getattr(planned._cached_module, "run", None)):
        return None
    from flashinfer.utils import MaskMode

    return DirectLaunch(planned._cached_module.run, planned._float_workspace_buffer, planned._int_workspace_buffer,
                        planned._plan_info, planned._kv_indices_buf,
                        MaskMode.CAUSAL.value if planned._causal else MaskMode.NON_CAUSAL.value,
                        planned._page_size, planned._sm_scale)


# the FlashInfer 0.7.2 classes whose _run_generated_fa the direct launch repeats (checked by name: no private import)
_DIRECT_CLASSES = ("_BatchMLAPagedAttentionFa2Backend", "_BatchMLAPagedAttentionFa3Backend")


class FAPlanned(Planned):
    """One step of fa2/fa3. `launch="direct"`: the kernel launcher with the plan's arguments and views of
    the caller's tensors (caches viewed once per cache, q/out/lse per run); `launch="wrapper"`: wrapper.run."""

    __slots__ = ("slot", "generation", "rows", "num_heads", "scales", "direct", "latent", "views")

    def __init__(self, slot: _Slot, generation: int, rows: int, num_heads: int, scales: Dict[str, float],
                 direct: Optional[DirectLaunch] = None, latent: int = 512, views: Optional[_ViewCache] = None
                 ) -> None:
        self.slot, self.generation, self.rows, self.num_heads, self.scales = slot, generation, rows, num_heads, scales
        self.direct, self.latent, self.views = direct, latent, views
        # out/lse are viewed on every run, never remembered: a remembered view keeps its buffer's memory
        # alive, and under torch.compile's CUDA graphs (mode="reduce-overhead") an output the decoder
        # allocated inside the graph pool must be freed with its last user (found on the H200)

    def run(self, q: Any, kv_cache: Any, out: torch.Tensor, lse: Optional[torch.Tensor],
            kv_scale: Any = None, q_scale: Any = None) -> None:
        if self.slot.generation != self.generation:
            raise RuntimeError("this plan was replaced by a later plan() of the same session (FlashInfer keeps "
                               "one schedule per wrapper); run the newest plan")
        if self.direct is not None:
            return self._run_direct(q, kv_cache, out, lse, kv_scale)
        rows, heads = self.rows, self.num_heads
        has_lse = lse is not None
        if isinstance(q, tuple):  # split layout: (q_nope, q_pe); FlashInfer's wrapper path wants them contiguous
            query: Any = (q[0].reshape(rows, heads, q[0].shape[-1]).contiguous(),
                          q[1].reshape(rows, heads, q[1].shape[-1]).contiguous())
        else:
            query = q.reshape(rows, heads, q.shape[-1]).contiguous()
        scales = self.scales
        if kv_scale is not None:  # scale_inputs="float": this layer's fp8 cache scale
            scales = {"ckv_scale": kv_scale, "kpe_scale": kv_scale}
        self.slot.wrapper.run(
            query=query, kv_cache=kv_cache,
            out=out.view(rows, heads, out.shape[-1]),
            lse=lse.view(rows, heads) if has_lse else None,
            return_lse=has_lse, return_lse_base_on_e=has_lse, **scales,
        )

    def _run_direct(self, q: Any, kv_cache: Any, out: Any, lse: Any, kv_scale: Any) -> None:
        views, rows, heads, latent = self.views, self.rows, self.num_heads, self.latent
        if type(q) is tuple:
            try:
                qn, qp = q[0].view(rows, heads, latent), q[1].view(rows, heads, q[1].shape[-1])
            except RuntimeError:  # strides that cannot merge batch and s_q into one dimension: copy
                qn, qp = q[0].reshape(rows, heads, latent), q[1].reshape(rows, heads, q[1].shape[-1])
        else:
            # two strided views straight from q (view + split costs ~3x as much host time)
            s0, s1, s2, _ = q.stride()
            if q.shape[1] == 1 or s0 == s1 * q.shape[1]:
                off = q.storage_offset()
                row = s0 if q.shape[1] == 1 else s1
                qn = q.as_strided((rows, heads, latent), (row, s2, 1), off)
                qp = q.as_strided((rows, heads, q.shape[-1] - latent), (row, s2, 1), off + latent)
            else:  # batch and s_q do not merge: copy
                qn, qp = q.reshape(rows, heads, q.shape[-1]).split(latent, -1)
        if type(kv_cache) is tuple:  # split cache: (ckv, kpe) as FlashInfer's launcher takes them
            kv = kv_cache
        else:
            kv = views.get(kv_cache)
            if kv is None:
                kv = views.put(kv_cache, kv_cache.detach().split(latent, -1))
        o = out.view(rows, heads, latent)
        lv = None if lse is None else lse.view(rows, heads)
        scale = 1.0
        if kv_scale is not None:
            scale = float(kv_scale)
        elif self.scales:
            scale = self.scales["ckv_scale"]
        run, fws, iws, plan_info, kv_indices, mask_mode, page_size, sm_scale = self.direct
        run(fws, iws, plan_info, qn, qp, kv[0], kv[1], kv_indices, o, lv, mask_mode, heads, page_size, sm_scale,
            lv is not None, scale, scale, None)


class TrtllmGenPlanned(Planned):
    """One step of trtllm-gen (not verified on hardware): FlashInfer's direct trtllm-gen MLA call per layer."""

    def __init__(self, workspace: torch.Tensor, kv_lens: torch.Tensor, block_tables: torch.Tensor,
                 max_seq_len: int, sm_scale: float, kv_scale: float, q_scale: float, rows: int,
                 num_heads: int) -> None:
        from .metadata import trtllm_gen_scales

        self.workspace, self.kv_lens, self.block_tables = workspace, kv_lens, block_tables
        self.max_seq_len, self.sm_scale, self.kv_scale, self.q_scale = max_seq_len, sm_scale, kv_scale, q_scale
        self.bmm1_scale, self.bmm2_scale = trtllm_gen_scales(sm_scale, kv_scale, q_scale)
        self.rows, self.num_heads = rows, num_heads

    def run(self, q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor, lse: Optional[torch.Tensor],
            kv_scale: Any = None, q_scale: Any = None) -> None:
        import torch
        from flashinfer.mla import trtllm_batch_decode_with_kv_cache_mla

        from .metadata import trtllm_gen_scales

        # info() lists split layouts for the whole backend (fa2/fa3 take them); trtllm-gen takes packed tensors only
        if isinstance(q, tuple):
            q = torch.cat(q, dim=-1)
        elif not q.is_contiguous():  # info() says strided q is fine (fa2/fa3); trtllm-gen gets a packed copy
            q = q.contiguous()
        if isinstance(kv_cache, tuple):
            kv_cache = torch.cat(kv_cache, dim=-1)
        bmm1, bmm2 = self.bmm1_scale, self.bmm2_scale
        if kv_scale is not None or q_scale is not None:  # scale_inputs="float": this layer's scales
            bmm1, bmm2 = trtllm_gen_scales(self.sm_scale, self.kv_scale if kv_scale is None else kv_scale,
                                           self.q_scale if q_scale is None else q_scale)
        has_lse = lse is not None
        trtllm_batch_decode_with_kv_cache_mla(
            query=q, kv_cache=kv_cache, workspace_buffer=self.workspace, qk_nope_head_dim=128,
            kv_lora_rank=out.shape[-1], qk_rope_head_dim=q.shape[-1] - out.shape[-1],
            block_tables=self.block_tables, seq_lens=self.kv_lens, max_seq_len=self.max_seq_len,
            out=out, bmm1_scale=bmm1, bmm2_scale=bmm2, backend="trtllm-gen",
            lse=lse.view(self.rows, self.num_heads) if has_lse else None, return_lse=has_lse,
            return_lse_base="basee" if has_lse else None,
        )


class FlashInferSession(Session):
    """One decoder's FlashInfer state: its own workspace (FlashInfer asks for one per
    concurrently running stream or graph) and wrappers, eager or per batch size."""

    def __init__(self, config: SessionConfig, options: FlashInferOptions) -> None:
        import torch

        self.config = config
        self.options = options
        self.variant = variants.variant_for(config, options)
        self.device = torch.device("cuda", config.device_index)
        self._workspace: Optional[torch.Tensor] = None
        self._slots: Dict[tuple, _Slot] = {}
        self._graph_bufs: Optional[Tuple[torch.Tensor, torch.Tensor]] = None  # trtllm-gen in graph mode
        self._views = _ViewCache()  # fa2/fa3 direct launch: (ckv, kpe) views of each packed cache, once

    def _ws(self) -> torch.Tensor:
        import torch

        if self._workspace is None:
            alloc = torch.zeros if self.variant == "trtllm-gen" else torch.empty  # trtllm-gen wants it zeroed
            self._workspace = alloc(self.options.workspace_mb * 1024 * 1024, dtype=torch.uint8, device=self.device)
        return self._workspace

    def plan(self, problem: DecodeProblem, step: StepInputs) -> Planned:
        if self.variant == "trtllm-gen":
            return self._plan_trtllm_gen(problem, step)
        return self._plan_fa(problem, step)

    def _plan_trtllm_gen(self, problem: DecodeProblem, step: StepInputs) -> TrtllmGenPlanned:
        """Eager: the caller's lengths and table as they are. Graph mode: copied into this session's
        buffers (sized from the envelope, never moved), whose capacity is the captured max_seq_len."""
        import torch

        from .metadata import trtllm_gen_args

        B = problem.batch_size
        lens, table = step.kv_lens, step.page_table
        env = self.config.envelope
        if env is not None:
            if self._graph_bufs is None:
                self._graph_bufs = (torch.zeros(env.max_batch, dtype=torch.int32, device=self.device),
                                    torch.zeros(env.max_batch, env.max_pages(self.config.page_size),
                                                dtype=torch.int32, device=self.device))
            lens_buf, table_buf = self._graph_bufs
            width = min(table.shape[1], table_buf.shape[1])
            lens_buf[:B].copy_(lens, non_blocking=True)
            table_buf[:B, :width].copy_(table[:, :width], non_blocking=True)
            lens, table = lens_buf[:B], table_buf[:B]
        args = trtllm_gen_args(table, problem.page_size, problem.max_kv_len, self.config.sm_scale,
                               self.config.kv_scale, self.config.q_scale, graph=env is not None)
        return TrtllmGenPlanned(self._ws(), lens, args.block_tables, args.max_seq_len, self.config.sm_scale,
                                self.config.kv_scale, self.config.q_scale,
                                problem.batch_size * problem.seq_len_q, problem.num_heads)

    def _new_slot(self, B: int) -> _Slot:
        import torch

        from flashinfer.mla import BatchMLAPagedAttentionWrapper

        env = self.config.envelope
        if env is None:
            return _Slot(BatchMLAPagedAttentionWrapper(self._ws(), backend=self.variant))
        capacity = B * env.max_pages(self.config.page_size)
        dev = self.device
        wrapper = BatchMLAPagedAttentionWrapper(
            self._ws(), use_cuda_graph=True,
            qo_indptr=torch.empty(B + 1, dtype=torch.int32, device=dev),
            kv_indptr=torch.empty(B + 1, dtype=torch.int32, device=dev),
            kv_indices=torch.empty(max(1, capacity), dtype=torch.int32, device=dev),
            kv_len_arr=torch.empty(B, dtype=torch.int32, device=dev),
            backend=self.variant,
        )
        return _Slot(wrapper, capacity)

    def _plan_fa(self, problem: DecodeProblem, step: StepInputs) -> FAPlanned:
        from flashinfer.mla import MLAPlanMetadata

        from .metadata import csr_from_table

        csr = csr_from_table(step.kv_lens_host, step.page_table_host, problem.page_size, problem.seq_len_q)
        B = problem.batch_size
        key = (problem.seq_len_q,) + ((B,) if self.config.envelope is not None else ())
        slot = self._slots.get(key)
        if slot is None:
            slot = self._slots[key] = self._new_slot(B)
        if slot.capacity is not None and csr.kv_indices.numel() > slot.capacity:  # the decoder's envelope check
            raise ValueError(f"cuda_graph: this step uses {csr.kv_indices.numel()} pages, the envelope holds "
                             f"{slot.capacity} for batch {B}")
        slot.wrapper.plan(
            metadata=MLAPlanMetadata.csr(csr.qo_indptr, csr.kv_indptr, csr.kv_indices, csr.kv_len_arr),
            num_heads=problem.num_heads, head_dim_ckv=problem.kv_lora_rank,
            head_dim_kpe=problem.qk_rope_head_dim, page_size=problem.page_size, causal=problem.causal,
            sm_scale=self.config.sm_scale, q_data_type=torch_dtype(problem.q_dtype),
            kv_data_type=torch_dtype(problem.kv_dtype),
            query_layout=self.config.q_layout, kv_cache_layout=self.config.kv_layout,
            lse_mode="basee" if problem.return_lse else "none",
        )
        slot.generation += 1
        scales: Dict[str, float] = {}
        if problem.kv_dtype == "fp8_e4m3":
            scales = {"ckv_scale": self.config.kv_scale, "kpe_scale": self.config.kv_scale}
        direct = direct_launcher(slot.wrapper) if self.options.launch == "direct" else None
        return FAPlanned(slot, slot.generation, B * problem.seq_len_q, problem.num_heads, scales, direct,
                         problem.kv_lora_rank, self._views)

    def close(self) -> None:
        self._slots.clear()
        self._views = _ViewCache()
        self._workspace = None
        self._graph_bufs = None


backend = FlashInferBackend()
