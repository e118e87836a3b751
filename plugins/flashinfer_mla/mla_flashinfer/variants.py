"""Which FlashInfer kernel family serves a problem, and every reason one cannot.

Pure host logic (no flashinfer import), mirrored from FlashInfer 0.7.2's own
plan-time checks so that the dispatcher learns "no" before planning rather
than from an exception in the middle of a step.
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

VARIANTS = ("fa2", "fa3", "trtllm-gen")
OPTION_VARIANTS = ("auto",) + VARIANTS
UNVERIFIED = {"trtllm-gen": "not verified on hardware (no SM100 GPU was available)"}
# FlashInfer 0.7.2's trtllm-gen MLA accepts SM100, SM103 and SM107 (its _validate_trtllm_gen_mla_device_capability)
TRTLLM_GEN_CAPS = ((10, 0), (10, 3), (10, 7))
TRTLLM_GEN_PAGE_SIZES = (32, 64)

# FlashInfer's FA scheduler: at most this many (request, query tile) work items.
FA_MAX_WORK_ITEMS = 16384


def auto_variant(capability: Optional[Tuple[int, int]]) -> Optional[str]:
    if capability is None:
        return None
    if capability in TRTLLM_GEN_CAPS:
        return "trtllm-gen"
    if capability == (9, 0):
        return "fa3"
    if capability[0] >= 8:
        return "fa2"
    return None


def variant_for(shape: Any, options: Any) -> Optional[str]:
    """The kernel family `options.variant` names, or the architecture's default for "auto"."""
    requested = getattr(options, "variant", "auto")
    if requested != "auto":
        return requested
    return auto_variant(shape.device.capability)


def fa_work_items_per_request(shape: Any) -> int:
    """FlashInfer's FA scheduler splits each request into query tiles of 64 or 128 rows."""
    tile = 128 if shape.seq_len_q * shape.num_heads > 64 else 64
    return -(-shape.seq_len_q * shape.num_heads // tile)


def fa2_shared_bytes(ckv: int, kpe: int, fp8_kv: bool, smem_per_sm: int) -> Optional[int]:
    """Shared memory one FA2 MLA block needs (FlashInfer's SharedStorageQKVO); None: too little per SM."""
    align16 = lambda n: (n + 15) // 16 * 16  # noqa: E731
    if smem_per_sm >= 221696:
        stages, tile_kv = 2, 64
    elif smem_per_sm >= 147968:
        stages, tile_kv = 2, 32
    elif smem_per_sm >= 92672:
        stages, tile_kv = 1, 16
    else:
        return None
    if fp8_kv:
        tile_kv = 32
    q_bytes = 64 * (ckv + kpe) * 2
    kv_bytes = stages * tile_kv * (ckv + max(kpe, 64)) * (1 if fp8_kv else 2)
    repack = (align16(stages * tile_kv * ckv * 2) + align16(stages * tile_kv * max(kpe, 1) * 2)) if fp8_kv else 32
    return max(q_bytes + kv_bytes + repack + 2 * 64 * 4, 64 * ckv * 2)


def reasons(problem: Any, options: Any,
            smem: Optional[Tuple[int, int]] = None) -> List[str]:
    """Every reason FlashInfer cannot take this shape class (empty: it can).

    `smem` is (shared memory per SM, per block opt-in) of the device, when
    known. Batch limits are not reasons here: they are `Limits` (plugin.py).
    """
    out: List[str] = []
    dev = problem.device
    if dev.type != "cuda":
        return [f"device={dev}: FlashInfer runs on CUDA GPUs only"]
    cap = dev.capability
    variant = variant_for(problem, options)
    if variant is None:
        return [f"{dev}: no FlashInfer MLA kernel for this architecture (needs sm_80 or newer)"]
    if variant == "trtllm-gen":
        return trtllm_gen_reasons(problem)
    if problem.q_dtype not in ("bf16", "fp16"):
        out.append(f"q_dtype={problem.q_dtype} not in {{bf16, fp16}}")
    out_dtype = getattr(problem, "output_dtype", problem.q_dtype)
    if out_dtype != problem.q_dtype and problem.q_dtype in ("bf16", "fp16"):
        out.append(f"out_dtype={out_dtype}: FlashInfer writes out in q's dtype ({problem.q_dtype})")
    scale_inputs = getattr(problem, "scale_inputs", "static")
    if scale_inputs == "tensor" and problem.kv_dtype == "fp8_e4m3":
        out.append("scale_inputs=tensor: FlashInfer's fp8 path takes the rope scale (kpe_scale) as a host float; "
                   "a device tensor would need a host sync per layer")
    ckv, kpe = problem.kv_lora_rank, problem.qk_rope_head_dim
    fp8 = problem.kv_dtype == "fp8_e4m3"

    if variant in ("fa2", "fa3"):
        if variant == "fa3" and cap != (9, 0):
            out.append(f"variant fa3 needs sm_90, device is {dev}")
        if variant == "fa2" and cap[0] < 8:
            out.append(f"variant fa2 needs sm_80 or newer, device is {dev}")
        if fp8:
            if cap[0] != 9:
                out.append(f"kv_dtype=fp8_e4m3 needs sm_90 for {variant}, device is {dev}")
            if problem.q_dtype != "bf16":
                out.append(f"kv_dtype=fp8_e4m3 needs q_dtype=bf16, got {problem.q_dtype}")
            if (ckv, kpe) != (512, 64):
                out.append(f"kv_dtype=fp8_e4m3 needs kv_lora_rank=512, rope dim 64; got {ckv}, {kpe}")
        elif problem.kv_dtype != problem.q_dtype:
            out.append(f"kv_dtype={problem.kv_dtype} must equal q_dtype={problem.q_dtype} (or be fp8_e4m3)")
        if ckv % 128 or kpe % 64:
            out.append(f"kv_lora_rank={ckv} must be a multiple of 128 and rope dim {kpe} of 64")
        if variant == "fa3" and ckv not in (128, 256, 512):
            out.append(f"fa3 needs kv_lora_rank in {{128, 256, 512}}, got {ckv}")
        if variant == "fa2" and smem is not None:
            need = fa2_shared_bytes(ckv, kpe, fp8, smem[0])
            if need is None:
                out.append(f"fa2 needs at least 92672 shared-memory bytes per SM, device has {smem[0]}")
            elif need > smem[1]:
                out.append(f"fa2 needs {need} shared-memory bytes per block, device allows {smem[1]}")
        if problem.causal and problem.seq_len_q > 1 and 64 % problem.num_heads and 128 % problem.num_heads:
            out.append(f"num_heads={problem.num_heads} with causal seq_len_q>1: FlashInfer's causal query "
                       "tiles (64 or 128 rows) must hold whole tokens (num_heads dividing 64 or 128)")
    return out


def trtllm_gen_reasons(problem: Any) -> List[str]:
    """Every reason trtllm-gen cannot take this shape class, read from FlashInfer 0.7.2 (not verified on hardware).

    Sources: `_validate_trtllm_gen_mla_native_capability` (bf16 q with bf16 KV,
    or fp8 q with fp8 KV; bf16 out), `_trtllm_gen_mla_incompatibility_reason`
    (64 < H < 128, page 32/64), the planned backend's head-divisibility check
    (`num_heads % heads_per_cta`, where heads_per_cta = min(H, the selected
    kernel's power-of-two query step) is chosen by the kernel selector from
    batch and lengths at launch, so only power-of-two head counts are safe for
    every step), and its causal-only multi-token masking.
    """
    out: List[str] = []
    dev = problem.device
    cap = dev.capability
    ckv, kpe = problem.kv_lora_rank, problem.qk_rope_head_dim
    h = problem.num_heads
    if cap not in TRTLLM_GEN_CAPS:
        out.append(f"variant trtllm-gen needs sm_100, sm_103 or sm_107, device is {dev}")
    if problem.q_dtype == "fp16":
        out.append("q_dtype=fp16: trtllm-gen takes bf16 q (or fp8 q with an fp8 cache) and writes bf16; "
                   "pass bf16")
    elif problem.q_dtype not in ("bf16", "fp8_e4m3"):
        out.append(f"q_dtype={problem.q_dtype} not in {{bf16, fp8_e4m3}} (trtllm-gen)")
    if problem.kv_dtype == "fp8_e4m3" and problem.q_dtype != "fp8_e4m3":
        out.append(f"kv_dtype=fp8_e4m3 needs an fp8 query for trtllm-gen (q_dtype=fp8_e4m3), got {problem.q_dtype}")
    elif problem.kv_dtype != "fp8_e4m3" and problem.kv_dtype != problem.q_dtype:
        out.append(f"kv_dtype={problem.kv_dtype} must equal q_dtype={problem.q_dtype} (trtllm-gen)")
    out_dtype = getattr(problem, "output_dtype", problem.q_dtype)
    if out_dtype != "bf16":
        out.append(f"out_dtype={out_dtype}: trtllm-gen writes bf16 only")
    if getattr(problem, "scale_inputs", "static") == "tensor":
        out.append("scale_inputs=tensor: device-tensor scales through trtllm-gen (log2-form bmm1 tensor) are not "
                   "wired here; use static or float scales")
    if problem.page_size not in TRTLLM_GEN_PAGE_SIZES:
        out.append(f"page_size={problem.page_size} not in {{32, 64}} (trtllm-gen)")
    if h > 128 or 64 < h < 128:
        out.append(f"num_heads={h}: trtllm-gen takes 1..64 or 128 (FlashInfer refuses 64 < H < 128)")
    elif h & (h - 1):
        out.append(f"num_heads={h}: trtllm-gen needs num_heads divisible by the kernel's heads per CTA "
                   "(a power of two the kernel selector picks per launch); only power-of-two head counts "
                   "divide every choice")
    if (ckv, kpe) != (512, 64):
        out.append(f"trtllm-gen needs kv_lora_rank=512 and rope dim 64, got {ckv}, {kpe}")
    if problem.seq_len_q > 1 and not problem.causal:
        out.append("non-causal seq_len_q > 1: trtllm-gen masks multi-token queries causally (bottom-right) only")
    return out


def trtllm_gen_min_kv_len(shape: Any) -> int:
    """Shortest request trtllm-gen is given: every query token must see at least itself (len >= s_q >= 1).

    Zero-length requests and requests shorter than s_q have no verified
    semantics in trtllm-gen (FlashInfer documents none), so they are refused.
    """
    return max(1, shape.seq_len_q)
