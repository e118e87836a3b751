"""Host API of the SM90 MLA decode kernels (CuTe DSL), compile cache.

    sched = make_schedule(kv_lens_cpu, s_q, H, num_sms)          # once per step
    ws = alloc_workspace(sched)                                   # once
    mla_decode_sm90(q, kv_cache, page_table, kv_lens, sm_scale, kv_scale,
                    out, lse, sched, ws)                          # per layer

``mla_decode_sm90`` does no host work beyond argument packing and is CUDA-graph
capturable (the schedule and workspace live in fixed device buffers).
Kernels are compiled once per specialization (q dtype, kv dtype, BLOCK_M),
kept in an in-process cache and in a cache on disk (``kernel_cache``,
``disk_cache``: a second process loads the object file instead of compiling);
shapes are dynamic so one compile serves every batch, length, page count,
page size and head count of that specialization.
"""

from __future__ import annotations

import torch

from . import kernel_cache
from .cache_key import COMPILE_OPTIONS
from .fused_merge import fused_from_tags, fused_spec
from .pair_merge import pair_from_tags, pair_spec
from .schedule import (  # noqa: F401  (re-exported)
    BLOCK_N,
    PAIR_FORM,
    Schedule,
    Workspace,
    alloc_workspace,
    block_m_for,
    make_schedule,
    workspace_bytes,
)

D_QK = 576
D_V = 512
LOG2_E = 1.4426950408889634

_TORCH_TO_NAME = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float8_e4m3fn: "fp8_e4m3",
}


def _cutlass_dtype(name):
    import cutlass

    return {
        "bf16": cutlass.BFloat16,
        "fp16": cutlass.Float16,
        "fp8_e4m3": cutlass.Float8E4M3FN,
        "fp32": cutlass.Float32,
    }[name]


# dtypes of the partial O buffer (workspace[0]); the LSE partials stay fp32
PARTIAL_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


_PARTIAL_NAMES = {dt: name for name, dt in PARTIAL_DTYPES.items()}


def partial_name(workspace) -> str:
    """Name of the workspace's partial-O dtype ("fp32", "bf16" or "fp16"): the compiled partial and combine
    kernels a launch needs are the ones built for it (alloc_workspace(..., partial_dtype=...)). One dict lookup:
    every launch asks."""
    name = _PARTIAL_NAMES.get(workspace[0].dtype)
    if name is None:
        raise ValueError(f"workspace: o_partial must be float32, bfloat16 or float16, got {workspace[0].dtype}")
    return name


def partial_spec(partial: str) -> tuple:
    """Kernel-cache key suffix for a partial-O dtype: () for fp32, so every kernel keeps the key (and symbol)
    it always had, else ("partial_<name>",)."""
    if partial not in PARTIAL_DTYPES:
        raise ValueError(f"partial dtype must be one of {sorted(PARTIAL_DTYPES)}, got {partial!r}")
    return () if partial == "fp32" else ("partial_" + partial,)


def partial_from_tags(tags) -> str:
    """The partial-O dtype named by a kernel-cache key's trailing tags (partial_spec), fp32 without one."""
    names = [t[len("partial_"):] for t in tags if isinstance(t, str) and t.startswith("partial_")]
    name = names[-1] if names else "fp32"
    if name not in PARTIAL_DTYPES:
        raise ValueError(f"kernel-cache tag partial_{name}: expected one of {sorted(PARTIAL_DTYPES)}")
    return name


WIDE_STORE_TAG = "wide_store"


def store_spec(wide_store: bool) -> tuple:
    """Kernel-cache key suffix for the epilogue store width: () for the default narrow stores (every kernel
    keeps its key and symbol), ("wide_store",) for the 16-byte stores of 16-bit rows (wide_store.py)."""
    return (WIDE_STORE_TAG,) if wide_store else ()


def wide_from_tags(tags) -> bool:
    """Whether a kernel-cache key's trailing tags ask for wide epilogue stores (store_spec)."""
    return WIDE_STORE_TAG in tags


def specializations():
    """Every (q dtype, kv dtype, block_m) the kernels are built for."""
    out = []
    for q in ("bf16", "fp16"):
        for kv in (q, "fp8_e4m3"):
            for bm in (16, 32, 64):
                out.append((q, kv, bm))
    return out


def _fake_args_partial(q_name, kv_name, partial: str = "fp32"):
    """Fake arguments of a partial kernel; `partial`: the dtype of the partial O buffer (mOp)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    qt, kt = _cutlass_dtype(q_name), _cutlass_dtype(kv_name)
    B, R, P, PS, MP, CAP, SL = (cute.sym_int() for _ in range(7))
    return (
        make_fake_compact_tensor(qt, (B, R, D_QK), stride_order=(2, 1, 0), assumed_align=16),
        make_fake_compact_tensor(kt, (P, PS, D_QK), stride_order=(2, 1, 0), assumed_align=16),
        make_fake_compact_tensor(cutlass.Int32, (B, MP), stride_order=(1, 0), assumed_align=4),
        make_fake_compact_tensor(cutlass.Int32, (B,), assumed_align=4),
        make_fake_compact_tensor(qt, (B, R, D_V), stride_order=(2, 1, 0), assumed_align=16),
        make_fake_compact_tensor(cutlass.Float32, (B, R), stride_order=(1, 0), assumed_align=4),
        make_fake_compact_tensor(cutlass.Int32, (CAP, 4), stride_order=(1, 0), assumed_align=16),
        make_fake_compact_tensor(_cutlass_dtype(partial), (SL, R, D_V), stride_order=(2, 1, 0), assumed_align=16),
        make_fake_compact_tensor(cutlass.Float32, (SL, R), stride_order=(1, 0), assumed_align=4),
        1.0, 1.0, 1.0, 1, 1,
        make_fake_stream(),
    )


def _fake_args_partial_balanced(q_name, kv_name, partial: str = "fp32"):
    """MLADecodePartial.call_balanced's arguments: the partial kernel's plus the per-column item ranges
    (int32 [num_cols + 1]) after the work rows."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor

    args = _fake_args_partial(q_name, kv_name, partial)
    ranges = make_fake_compact_tensor(cutlass.Int32, (cute.sym_int(),), assumed_align=4)
    return args[:7] + (ranges,) + args[7:]


def _fake_args_partial_fused(q_name, kv_name, partial: str = "fp32"):
    """MLADecodePartial.call_fused's arguments: the partial kernel's plus split_info (int32 [max_batch, 2]) and the
    arrival counters (int32 [max_batch]) after the partial buffers."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor

    args = _fake_args_partial(q_name, kv_name, partial)
    MB = cute.sym_int()
    split = make_fake_compact_tensor(cutlass.Int32, (MB, 2), stride_order=(1, 0), assumed_align=8)
    cnt = make_fake_compact_tensor(cutlass.Int32, (MB,), assumed_align=4)
    return args[:9] + (split, cnt) + args[9:]


def _fake_args_partial_balanced_fused(q_name, kv_name, partial: str = "fp32"):
    """MLADecodePartial.call_balanced_fused's arguments: call_balanced's plus split_info (int32 [max_batch, 2]) and
    the arrival counters (int32 [max_batch]) after the partial buffers."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor

    args = _fake_args_partial_balanced(q_name, kv_name, partial)
    MB = cute.sym_int()
    split = make_fake_compact_tensor(cutlass.Int32, (MB, 2), stride_order=(1, 0), assumed_align=8)
    cnt = make_fake_compact_tensor(cutlass.Int32, (MB,), assumed_align=4)
    return args[:10] + (split, cnt) + args[10:]


def _fake_args_partial_balanced_pair(q_name, kv_name, partial: str = "fp32"):
    """MLADecodePartial.call_balanced_pair's arguments: call_balanced's plus split_info (int32 [max_batch, 2]) after
    the partial buffers."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor

    args = _fake_args_partial_balanced(q_name, kv_name, partial)
    split = make_fake_compact_tensor(cutlass.Int32, (cute.sym_int(), 2), stride_order=(1, 0), assumed_align=8)
    return args[:10] + (split,) + args[10:]


def _fake_args_combine(q_name, partial: str = "fp32"):
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    qt = _cutlass_dtype(q_name)
    B, R, MB, SL = (cute.sym_int() for _ in range(4))
    return (
        make_fake_compact_tensor(qt, (B, R, D_V), stride_order=(2, 1, 0), assumed_align=16),
        make_fake_compact_tensor(cutlass.Float32, (B, R), stride_order=(1, 0), assumed_align=4),
        make_fake_compact_tensor(cutlass.Int32, (MB, 2), stride_order=(1, 0), assumed_align=8),
        make_fake_compact_tensor(_cutlass_dtype(partial), (SL, R, D_V), stride_order=(2, 1, 0), assumed_align=16),
        make_fake_compact_tensor(cutlass.Float32, (SL, R), stride_order=(1, 0), assumed_align=4),
        make_fake_stream(),
    )


def compile_partial(entry, q_name: str, kv_name: str, tags: tuple = (), balanced: bool = False):
    """cute.compile a partial kernel's entry (the kernel object, or its call_balanced with balanced=True) with the
    fake arguments of (q, kv) and the partial-O dtype its kernel-cache tags name (partial_spec): what every
    partial-kernel builder does."""
    import cutlass.cute as cute

    if pair_from_tags(tags):
        fake = _fake_args_partial_balanced_pair
    elif fused_from_tags(tags):
        fake = _fake_args_partial_balanced_fused if balanced else _fake_args_partial_fused
    else:
        fake = _fake_args_partial_balanced if balanced else _fake_args_partial
    return cute.compile(entry, *fake(q_name, kv_name, partial_from_tags(tags)), options=COMPILE_OPTIONS)


def _build_partial(q_name: str, kv_name: str, block_m: int, layout, *tags: str):
    from .sm90_decode import MLADecodePartial

    fused = fused_from_tags(tags)
    k = MLADecodePartial(_cutlass_dtype(q_name), _cutlass_dtype(kv_name), block_m, layout,
                         wide_store=wide_from_tags(tags), fused=fused)
    return compile_partial(k.call_fused if fused else k, q_name, kv_name, tags)


def _build_partial_balanced(q_name: str, kv_name: str, block_m: int, layout, *tags: str):
    from .sm90_decode import MLADecodePartial

    fused = fused_from_tags(tags)
    if pair_from_tags(tags):
        k = MLADecodePartial(_cutlass_dtype(q_name), _cutlass_dtype(kv_name), block_m, layout, balanced=True,
                             wide_store=wide_from_tags(tags), pair=True)
        return compile_partial(k.call_balanced_pair, q_name, kv_name, tags, balanced=True)
    k = MLADecodePartial(_cutlass_dtype(q_name), _cutlass_dtype(kv_name), block_m, layout, balanced=True,
                         wide_store=wide_from_tags(tags), fused=fused)
    return compile_partial(k.call_balanced_fused if fused else k.call_balanced, q_name, kv_name, tags, balanced=True)


def _build_combine(q_name: str, *tags: str, pdl: bool = False):
    import cutlass.cute as cute

    from .combine import MLACombine

    cols = next((int(t[4:]) for t in tags if t.startswith("cols")), 512)
    return cute.compile(MLACombine(_cutlass_dtype(q_name), pdl=pdl, cols=cols),
                        *_fake_args_combine(q_name, partial_from_tags(tags)), options=COMPILE_OPTIONS)


def _build_combine_wide(q_name: str, *tags: str, pdl: bool = False):
    import cutlass.cute as cute

    from .combine import MLACombineWide

    return cute.compile(MLACombineWide(_cutlass_dtype(q_name), pdl=pdl),
                        *_fake_args_combine(q_name, partial_from_tags(tags)), options=COMPILE_OPTIONS)


def _build_combine_pdl(q_name: str, *tags: str):
    return _build_combine(q_name, *tags, pdl=True)


def _build_combine_wide_pdl(q_name: str, *tags: str):
    return _build_combine_wide(q_name, *tags, pdl=True)


def get_partial_kernel(q_name: str, kv_name: str, block_m: int, layout=None, balanced: bool = False,
                       partial: str = "fp32", wide_store: bool = False, fused: bool = False, pair: bool = False):
    """Compiled partial kernel for one specialization (memory, disk, else compile).

    layout: optional (m_warps, m_atoms_per_warp, n_acc) override, for tuning.
    balanced: MLADecodePartial(balanced=True).call_balanced (16-bit KV only; its own cache kind, so the
    default kernels' cache keys and symbols are unchanged).
    partial: dtype of the partial O buffer it writes (partial_name of the workspace; fp32 keeps the old keys).
    wide_store: 16-byte stores of its 16-bit epilogue rows (Schedule.wide_store, backend option stores; the
    default keeps the old keys).
    fused: combine=fused, the kernel merges the splits itself (call_fused / call_balanced_fused; bf16/fp16 KV,
    16/32 rows only, fused_supported; key tag "fused" only when on).
    pair: experimental cluster pair merge (pair_merge.py; balanced only, bf16/fp16 KV, 16/32 rows, not with fused;
    key tag "pair" only when on): the balanced kernel launched with (1, 2, 1) clusters that merges schedule form
    "pair"'s two halves of a request through DSMEM (launch_pair).
    """
    if layout is not None:
        layout = tuple(layout)
    tags = partial_spec(partial) + store_spec(wide_store) + fused_spec(fused) + pair_spec(pair)
    if pair and not (balanced and block_m <= 32 and kv_name != "fp8_e4m3" and not fused):
        raise ValueError("the cluster pair merge is built for the balanced mma.sync kernel with a bf16/fp16 cache at "
                         "16/32 rows only, not with fused")
    if fused and not (block_m <= 32 and kv_name != "fp8_e4m3"):
        raise ValueError("the fused merge is built for the mma.sync kernel with a bf16/fp16 cache at 16/32 rows "
                         "only")
    if balanced:
        if kv_name == "fp8_e4m3":
            raise ValueError("balanced split-KV is built for bf16/fp16 KV caches only")
        return kernel_cache.get_or_build("partial_balanced", (q_name, kv_name, block_m, layout) + tags,
                                         _build_partial_balanced)
    return kernel_cache.get_or_build("partial", (q_name, kv_name, block_m, layout) + tags, _build_partial)


def get_combine_kernel(q_name: str, wide: bool = False, pdl: bool = False, partial: str = "fp32", cols: int = 512):
    """Compiled combine kernel for one q dtype (memory, disk, else compile); wide: MLACombineWide.
    pdl: launched with programmatic dependent launch (waits for the partial grid in the kernel; every
    partial kernel triggers its dependents at its start), so its launch overlaps the partial kernel's run;
    its own cache kinds, so the plain kernels' keys are unchanged. partial: the partial O buffer's dtype
    (fp32 keeps the old keys). cols: MLACombine's columns per warp (512: a row per warp, the old key; 128:
    four warps per row, key tag "cols128"); ignored with wide."""
    spec = (q_name,) + partial_spec(partial)
    if cols not in (128, 512):
        raise ValueError(f"cols must be 128 or 512, got {cols}")
    if not wide and cols != 512:
        spec += (f"cols{cols}",)
    if wide:
        if pdl:
            return kernel_cache.get_or_build("combine_wide_pdl", spec, _build_combine_wide_pdl)
        return kernel_cache.get_or_build("combine_wide", spec, _build_combine_wide)
    if pdl:
        return kernel_cache.get_or_build("combine_pdl", spec, _build_combine_pdl)
    return kernel_cache.get_or_build("combine", spec, _build_combine)


def combine_kernel_for(q_name: str, schedule: Schedule, partial: str = "fp32"):
    """The combine kernel this step's schedule asks for (``Schedule.wide_combine``, ``Schedule.pdl_combine``,
    ``Schedule.combine_cols``), reading partials of dtype `partial` (partial_name of the workspace)."""
    return get_combine_kernel(q_name, wide=schedule.wide_combine, pdl=schedule.pdl_combine, partial=partial,
                              cols=schedule.combine_cols)


def _cu_stream(handle: int):
    import cuda.bindings.driver as cuda

    return cuda.CUstream(handle)


def check_inputs(q, kv_cache, page_table, kv_lens, out, lse):
    """Shape/dtype checks (cheap, host-only metadata)."""
    if q.dim() != 4 or q.shape[-1] != D_QK:
        raise ValueError(f"q must be [B, s_q, H, 576], got {tuple(q.shape)}")
    B, s_q, H, _ = q.shape
    if q.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"q dtype must be bf16 or fp16, got {q.dtype}")
    if kv_cache.dtype not in (q.dtype, torch.float8_e4m3fn):
        raise ValueError(f"kv_cache dtype must be {q.dtype} or float8_e4m3fn, got {kv_cache.dtype}")
    if kv_cache.dim() != 3 or kv_cache.shape[-1] != D_QK:
        raise ValueError(f"kv_cache must be [P, page, 576], got {tuple(kv_cache.shape)}")
    if kv_cache.shape[1] % BLOCK_N != 0:
        raise ValueError(f"page size must be a multiple of {BLOCK_N}, got {kv_cache.shape[1]}")
    if not 1 <= s_q <= 8 or not 1 <= H <= 128:
        raise ValueError(f"s_q must be 1..8 and H 1..128, got s_q={s_q} H={H}")
    if page_table.dtype != torch.int32 or kv_lens.dtype != torch.int32:
        raise ValueError("page_table and kv_lens must be int32")
    if tuple(out.shape) != (B, s_q, H, D_V) or out.dtype != q.dtype:
        raise ValueError(f"out must be [B, s_q, H, 512] {q.dtype}, got {tuple(out.shape)} {out.dtype}")
    if tuple(lse.shape) != (B, s_q, H) or lse.dtype != torch.float32:
        raise ValueError(f"lse must be [B, s_q, H] float32, got {tuple(lse.shape)} {lse.dtype}")
    for name, t in (("q", q), ("kv_cache", kv_cache), ("out", out), ("lse", lse),
                    ("page_table", page_table), ("kv_lens", kv_lens)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")


def check_call(q, kv_cache, page_table, kv_lens, out, lse, schedule: Schedule) -> None:
    """check_inputs plus: the schedule was made for q's s_q and head count."""
    check_inputs(q, kv_cache, page_table, kv_lens, out, lse)
    if schedule.s_q != q.shape[1] or schedule.num_heads != q.shape[2]:
        raise ValueError("schedule was made for another s_q / num_heads")


def launch(partial, q, kv_cache, page_table, kv_lens, sm_scale: float, kv_scale: float, out, lse,
           schedule: Schedule, workspace):
    """One compiled partial kernel (mma.sync or WGMMA: same arguments and work items) and the combine
    kernel on the current stream; no checks, no host work beyond argument packing."""
    B, s_q, H, _ = q.shape
    R = s_q * H
    combine = combine_kernel_for(_TORCH_TO_NAME[q.dtype], schedule, partial_name(workspace))
    o_part, lse_part = workspace
    o3 = out.view(B, R, D_V)
    l2 = lse.view(B, R)
    s = float(sm_scale) * float(kv_scale)
    stream = _cu_stream(torch.cuda.current_stream().cuda_stream)
    partial(q.view(B, R, D_QK), kv_cache, page_table, kv_lens, o3, l2, schedule.work_info, o_part, lse_part,
            s * LOG2_E, s, float(kv_scale), s_q, H, stream)
    combine(o3, l2, schedule.split_info, o_part, lse_part, stream)
    return out, lse


def launch_balanced(partial, q, kv_cache, page_table, kv_lens, sm_scale: float, kv_scale: float, out, lse,
                    schedule: Schedule, workspace):
    """launch() for a balanced partial kernel (get_partial_kernel(..., balanced=True)) and a schedule made
    with make_schedule(..., balanced=True): the same arguments plus the schedule's per-column item ranges;
    grid (m-blocks, num_cols), fixed per decoder. No checks. Shared by the mma.sync and the wgmma_t balanced
    entries: the backend's mma=auto swaps them per step (by KV blocks) under CUDA graphs, which is correct
    because both launch from here with the same arguments and combine."""
    B, s_q, H, _ = q.shape
    R = s_q * H
    combine = combine_kernel_for(_TORCH_TO_NAME[q.dtype], schedule, partial_name(workspace))
    o_part, lse_part = workspace
    o3 = out.view(B, R, D_V)
    l2 = lse.view(B, R)
    s = float(sm_scale) * float(kv_scale)
    stream = _cu_stream(torch.cuda.current_stream().cuda_stream)
    partial(q.view(B, R, D_QK), kv_cache, page_table, kv_lens, o3, l2, schedule.work_info, schedule.cta_ranges,
            o_part, lse_part, s * LOG2_E, s, float(kv_scale), s_q, H, stream)
    combine(o3, l2, schedule.split_info, o_part, lse_part, stream)
    return out, lse


def launch_pair(partial, q, kv_cache, page_table, kv_lens, sm_scale: float, kv_scale: float, out, lse,
                schedule: Schedule, workspace, combine: bool = False):
    """The cluster pair kernel (get_partial_kernel(..., balanced=True, pair=True), call_balanced_pair) over a schedule
    (make_schedule(..., balanced=True, form="pair")): the balanced grid launched with (1, 2, 1) clusters (num_cols
    must be even), each request's two halves merged in the kernel through DSMEM (pair_merge.py) and the requests with
    no KV written there (out = 0, lse = -inf); no combine kernel. No checks beyond the form and column count.

    combine=True also launches the schedule's combine kernel after it (it skips every request of a pair schedule,
    split count 1, and rewrites the empty ones with the same values): only to A/B the combine's launch cost, or for
    a CUDA graph captured here that later replays schedules re-planned in place to another form (their split items
    write partial slots that only the combine merges). With combine=False every replayed step must be of form
    "pair"."""
    if schedule.form != PAIR_FORM:
        raise ValueError(f"launch_pair needs a schedule of form 'pair', got {schedule.form!r}")
    if schedule.num_cols % 2:
        raise ValueError(f"the pair kernel's (1, 2, 1) clusters need an even number of CTA columns, got "
                         f"{schedule.num_cols}")
    B, s_q, H, _ = q.shape
    R = s_q * H
    o_part, lse_part = workspace[0], workspace[1]
    o3 = out.view(B, R, D_V)
    l2 = lse.view(B, R)
    s = float(sm_scale) * float(kv_scale)
    stream = _cu_stream(torch.cuda.current_stream().cuda_stream)
    partial(q.view(B, R, D_QK), kv_cache, page_table, kv_lens, o3, l2, schedule.work_info, schedule.cta_ranges,
            o_part, lse_part, schedule.split_info, s * LOG2_E, s, float(kv_scale), s_q, H, stream)
    if combine:
        combine_kernel_for(_TORCH_TO_NAME[q.dtype], schedule, partial_name(workspace))(
            o3, l2, schedule.split_info, o_part, lse_part, stream)
    return out, lse


def fused_supported(schedule: Schedule, kv_name: str) -> bool:
    """Whether the mma.sync entries (mla_decode_sm90, even or balanced) merge this step's splits in the partial
    kernel (combine=fused, Schedule.fused_combine): up to 32 rows (BLOCK_M 16/32) and a bf16/fp16 cache. Every
    other kernel and shape falls back to the schedule's combine kernel (combine_kernel_for)."""
    return schedule.fused_combine and schedule.block_m <= 32 and kv_name != "fp8_e4m3"


def arrivals_of(workspace):
    """The fused merge's per-request arrival counters (Workspace.arrivals, from alloc_workspace)."""
    cnt = getattr(workspace, "arrivals", None)
    if cnt is None:
        raise ValueError("combine=fused needs a workspace from alloc_workspace (its arrival counters)")
    return cnt


def launch_fused(partial, q, kv_cache, page_table, kv_lens, sm_scale: float, kv_scale: float, out, lse,
                 schedule: Schedule, workspace):
    """launch() / launch_balanced() for the fused kernel (get_partial_kernel(..., fused=True), balanced as the
    schedule is): one launch, the split requests merged by their last CTA (fused_merge.py) and empty requests
    written by the kernel; no combine kernel is built or launched. No checks."""
    B, s_q, H, _ = q.shape
    R = s_q * H
    o_part, lse_part = workspace
    cnt = arrivals_of(workspace)
    s = float(sm_scale) * float(kv_scale)
    stream = _cu_stream(torch.cuda.current_stream().cuda_stream)
    items = (schedule.work_info, schedule.cta_ranges) if schedule.balanced else (schedule.work_info,)
    partial(q.view(B, R, D_QK), kv_cache, page_table, kv_lens, out.view(B, R, D_V), lse.view(B, R), *items,
            o_part, lse_part, schedule.split_info, cnt, s * LOG2_E, s, float(kv_scale), s_q, H, stream)
    return out, lse


def check_balanced(schedule: Schedule, kv_cache, pair_ok: bool = False, fp8_ok: bool = False) -> None:
    """What every balanced entry needs, checked even with check=False (a wrong schedule or cache would make
    the column loop read another kernel's buffers): a make_schedule(..., balanced=True) schedule and a
    bf16/fp16 cache (the mma.sync and wgmma_t balanced kernels have no fp8 path), or also an fp8 e4m3 cache on
    the entry whose kernel has one (fp8_ok: the balanced seesaw, mla_decode_sm90_wgmma_seesaw_balanced; the
    hybrid plan's cost model, schedule.item_cost, was measured with 16-bit caches and is used unchanged). A
    schedule of form "pair" only on an entry that runs the pair kernel (pair_ok: mla_decode_sm90(balanced=True)):
    any other kernel would write both halves directly."""
    if not schedule.balanced:
        raise ValueError("balanced=True needs a schedule made with make_schedule(..., balanced=True)")
    if schedule.form == PAIR_FORM and not pair_ok:
        raise ValueError("a schedule of form 'pair' runs only on the mma.sync balanced kernel "
                         "(mla_decode_sm90(..., balanced=True))")
    if kv_cache.dtype == torch.float8_e4m3fn and not fp8_ok:
        raise ValueError("balanced split-KV is built for bf16/fp16 KV caches only (an fp8 cache: the balanced "
                         "seesaw, mla_decode_sm90_wgmma_seesaw_balanced)")


def mla_decode_sm90(q, kv_cache, page_table, kv_lens, sm_scale: float, kv_scale: float,
                    out, lse, schedule: Schedule, workspace, *, check: bool = True,
                    layout=None, balanced: bool = False):
    """Run the split-KV partial kernel and the combine kernel on the current stream.

    q [B, s_q, H, 576] bf16/fp16; kv_cache [P, page, 576] q dtype or float8_e4m3fn
    (k = kv * kv_scale); page_table [B, max_pages] int32; kv_lens [B] int32 (device);
    out [B, s_q, H, 512] q dtype; lse [B, s_q, H] fp32 (natural log).
    schedule from make_schedule(kv_lens_cpu, s_q, H, num_sms) for this step;
    workspace = alloc_workspace(schedule) (partial O in fp32; partial_dtype=torch.bfloat16/float16 for a 16-bit
    buffer: the kernels built for its dtype run).
    balanced=True (the backend's split_kv="balanced"): the balanced split-KV kernel, a fixed grid of CTA
    columns each walking its range of the schedule's items; needs a schedule from
    make_schedule(..., balanced=True) and a bf16/fp16 cache (ValueError otherwise, also with check=False).
    The default kernel accepts a balanced schedule too (one CTA per work row, the same items), except one of form
    "pair" (make_schedule(..., form="pair"), experimental): that runs only with balanced=True, on the cluster pair
    kernel (get_partial_kernel(..., pair=True), launch_pair), whatever the schedule's combine setting.
    """
    if balanced:
        check_balanced(schedule, kv_cache, pair_ok=True)
        if check:
            check_call(q, kv_cache, page_table, kv_lens, out, lse, schedule)
        kv_name = _TORCH_TO_NAME[kv_cache.dtype]
        if schedule.form == PAIR_FORM:  # experimental cluster pair merge (pair_merge.py); fused does not apply
            partial = get_partial_kernel(_TORCH_TO_NAME[q.dtype], kv_name, schedule.block_m, layout, balanced=True,
                                         partial=partial_name(workspace), wide_store=schedule.wide_store, pair=True)
            return launch_pair(partial, q, kv_cache, page_table, kv_lens, sm_scale, kv_scale, out, lse, schedule,
                               workspace)
        fused = fused_supported(schedule, kv_name)
        partial = get_partial_kernel(_TORCH_TO_NAME[q.dtype], kv_name, schedule.block_m,
                                     layout, balanced=True, partial=partial_name(workspace),
                                     wide_store=schedule.wide_store, **({"fused": True} if fused else {}))
        if fused:
            return launch_fused(partial, q, kv_cache, page_table, kv_lens, sm_scale, kv_scale, out, lse, schedule,
                                workspace)
        return launch_balanced(partial, q, kv_cache, page_table, kv_lens, sm_scale, kv_scale, out, lse,
                               schedule, workspace)
    if schedule.cta_ranges is not None and schedule.form == PAIR_FORM:
        raise ValueError("a schedule of form 'pair' needs balanced=True (the pair kernel)")
    if check:
        check_call(q, kv_cache, page_table, kv_lens, out, lse, schedule)
    kv_name = _TORCH_TO_NAME[kv_cache.dtype]
    if fused_supported(schedule, kv_name):
        partial = get_partial_kernel(_TORCH_TO_NAME[q.dtype], kv_name, schedule.block_m, layout,
                                     partial=partial_name(workspace), wide_store=schedule.wide_store, fused=True)
        return launch_fused(partial, q, kv_cache, page_table, kv_lens, sm_scale, kv_scale, out, lse, schedule,
                            workspace)
    partial = get_partial_kernel(_TORCH_TO_NAME[q.dtype], kv_name, schedule.block_m, layout,
                                 partial=partial_name(workspace), wide_store=schedule.wide_store)
    return launch(partial, q, kv_cache, page_table, kv_lens, sm_scale, kv_scale, out, lse, schedule, workspace)


def mla_decode_sm90_balanced(q, kv_cache, page_table, kv_lens, sm_scale: float, kv_scale: float,
                             out, lse, schedule: Schedule, workspace, *, check: bool = True, layout=None):
    """mla_decode_sm90(..., balanced=True) under its own name: the host entry the backend runs for
    split_kv="balanced" (the balanced kernel over a make_schedule(..., balanced=True) schedule, whichever
    form its plan chose this step). A named function, not a partial, so that the backend's Planned and its
    tests can say which entry runs."""
    return mla_decode_sm90(q, kv_cache, page_table, kv_lens, sm_scale, kv_scale, out, lse, schedule, workspace,
                           check=check, layout=layout, balanced=True)
