"""CPU tests (no GPU) of the opt-in balanced split-KV mma.sync kernel (MLADecodePartial(balanced=True)):
the default kernels' PTX is byte-identical to before the option existed (sha256 of the PTX without
comments, pinned from commit 5312e05), the balanced kernel compiles for bf16/fp16 at every BLOCK_M
with its registers/stack frame read from the cubin, and the host API refuses what it cannot run."""

from __future__ import annotations

import hashlib
import os
import pathlib
import re

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

cutlass = pytest.importorskip("cutlass")

from test_wgmma_compile import _nv_info_attrs  # noqa: E402

# sha256 of the default MLADecodePartial PTX (comment-stripped, blank lines dropped), computed on main
# 5312e05 before the balanced option was added (nvidia-cutlass-dsl 4.8.1, sm_90a).
DEFAULT_PTX_SHA256 = {
    ("bf16", "bf16", 16): "4fe6d324d761a038396c4c63e5e614a7ddae78490424f63583e7086318366fa9",
    ("bf16", "bf16", 32): "4e0fd1b564d172eb4cc85af5a886a672100495d6e97a513d0f1c33a5234d44e8",
    ("bf16", "bf16", 64): "d913633705006ac67fc9f28d5f41a2b68d7eff45ec678d2ac30fa9662fe79d57",
    ("fp16", "fp16", 16): "01b9f420b70c600772a3ef30da09fa8880dbd99ba289e4a26f7a2cf7b9d2cc72",
    ("fp16", "fp16", 32): "29c02133c6ec068dd9989513262f25d1a3c8d39cb1a85dac04fe8fc540502b85",
    ("fp16", "fp16", 64): "f2fefe1f5beb801bd055270c2b8a8600be8e1bf43c58169cac768b805b7fa7a7",
    ("bf16", "fp8_e4m3", 16): "1f94693d8095c48492a22ec68db3b5b9500e180ed6485698e9162a56076c4d64",
    ("bf16", "fp8_e4m3", 32): "29709ddfa8b298b48003271a28b2774ba8e5e4b1f621d2bfa0d5330ac7d23daf",
    ("bf16", "fp8_e4m3", 64): "6ea6a5c5a545061ea517b8c58393940fd8f021e6ae64f97dbef63cb453cadd4c",
}

# stack frame (bytes) of the default kernels on 4.8.1 (ptxas already spills a little at 255 registers
# for BLOCK_M 32/64): the balanced kernel may not be worse by more than one 16-byte slot
DEFAULT_FRAME = {16: 0, 32: 16, 64: 40}


PDL_TRIGGER = "griddepcontrol.launch_dependents;"


def ptx_sha256(ptx: str) -> str:
    lines = [re.sub(r"//.*$", "", line).rstrip() for line in ptx.splitlines()]
    return hashlib.sha256("\n".join(line for line in lines if line).encode()).hexdigest()


def ptx_sha256_before_pdl(ptx: str) -> str:
    """ptx_sha256 of a partial kernel's PTX without its one programmatic-dependent-launch trigger (added to
    every partial kernel at its start in mla-cute-dsl 0.2.5, so that the combine kernel launched with PDL is
    scheduled early): the pinned hashes predate it, so an equal hash means the trigger is the only change."""
    assert ptx.count(PDL_TRIGGER) == 1, "each partial kernel triggers its dependents exactly once"
    return ptx_sha256("\n".join(line for line in ptx.splitlines() if line.strip() != PDL_TRIGGER))


def _dump(fn, args, tmp_path):
    import cutlass.cute as cute

    from mla_cute_dsl.kernels import api

    cute.compile(fn, *args, options=api.COMPILE_OPTIONS + f" --keep-ptx --keep-cubin --dump-dir={tmp_path}")
    ptx = "".join(p.read_text() for p in pathlib.Path(tmp_path).glob("*.ptx"))
    cubin = b"".join(p.read_bytes() for p in pathlib.Path(tmp_path).glob("*.cubin"))
    attrs = _nv_info_attrs(cubin)
    regs = max(v for a, v in attrs if a == 0x2F)  # EIATTR_REGCOUNT
    frame = max((v for a, v in attrs if a == 0x11), default=0)  # EIATTR_FRAME_SIZE
    return ptx, regs, frame


@pytest.mark.parametrize("spec", sorted(DEFAULT_PTX_SHA256))
def test_default_ptx_is_unchanged(spec, tmp_path):
    from mla_cute_dsl.kernels import api
    from mla_cute_dsl.kernels.sm90_decode import MLADecodePartial

    q, kv, bm = spec
    k = MLADecodePartial(api._cutlass_dtype(q), api._cutlass_dtype(kv), bm)
    ptx, _, _ = _dump(k, api._fake_args_partial(q, kv), tmp_path)
    assert ptx_sha256_before_pdl(ptx) == DEFAULT_PTX_SHA256[spec]


@pytest.mark.parametrize("bm", [16, 32, 64])
@pytest.mark.parametrize("q", ["bf16", "fp16"])
def test_balanced_kernel_compiles_without_extra_spills(q, bm, tmp_path):
    from mla_cute_dsl.kernels import api
    from mla_cute_dsl.kernels.sm90_decode import MLADecodePartial

    k = MLADecodePartial(api._cutlass_dtype(q), api._cutlass_dtype(q), bm, balanced=True)
    ptx, regs, frame = _dump(k.call_balanced, api._fake_args_partial_balanced(q, q), tmp_path)
    assert ptx.count("griddepcontrol.launch_dependents;") == 1  # the PDL trigger for the combine kernel
    print(f"balanced {q} block_m {bm}: {regs} registers, stack frame {frame} B")
    assert "kernel_balanced" in ptx and "ld.local" not in ptx and "st.local" not in ptx
    assert regs <= 255
    assert frame <= DEFAULT_FRAME[bm] + 16, f"stack frame {frame} B"
    if bm == 16:
        assert frame == 0
    t = {"bf16": "bf16", "fp16": "f16"}[q]
    # one copy of the item body (as the default kernel): 36 QK k-steps x 2 n8 atoms + 4 PV k-steps x 16 n8
    # atoms per 16-row M atom of a warp
    assert len(re.findall(rf"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.{t}\.{t}\.f32", ptx)) == 136 * k.m_per_warp
    assert "cp.async.cg.shared.global" in ptx and re.search(r"cp\.async\.wait_group\s+0;", ptx)
    # the default kernel's 5 barriers plus the one at each item start
    assert len(re.findall(r"bar\.sync", ptx)) == 6


def test_balanced_option_refuses_fp8_and_default_call():
    import cutlass

    from mla_cute_dsl.kernels import api
    from mla_cute_dsl.kernels.sm90_decode import MLADecodePartial

    with pytest.raises(ValueError, match="bf16/fp16"):
        MLADecodePartial(cutlass.BFloat16, cutlass.Float8E4M3FN, 16, balanced=True)
    with pytest.raises(ValueError, match="bf16/fp16"):
        api.get_partial_kernel("bf16", "fp8_e4m3", 16, balanced=True)
    assert not MLADecodePartial(cutlass.BFloat16, cutlass.BFloat16, 16).balanced


def test_cached_balanced_kernel_is_its_own_cache_entry():
    from mla_cute_dsl.kernels import api, kernel_cache

    fn = api.get_partial_kernel("bf16", "bf16", 16, balanced=True)
    assert fn is api.get_partial_kernel("bf16", "bf16", 16, balanced=True)
    assert kernel_cache.symbol_for("partial_balanced", ("bf16", "bf16", 16, None)) == "mla_partial_balanced_bf16_bf16_16"
    assert kernel_cache.origin("partial_balanced", ("bf16", "bf16", 16, None)) in ("compiled", "disk")


def test_mla_decode_sm90_balanced_needs_a_balanced_schedule():
    import torch

    from mla_cute_dsl.kernels import alloc_workspace, make_schedule, mla_decode_sm90

    q = torch.zeros(2, 1, 16, 576, dtype=torch.bfloat16)
    kv = torch.zeros(4, 64, 576, dtype=torch.bfloat16)
    pt = torch.zeros(2, 2, dtype=torch.int32)
    lens = torch.ones(2, dtype=torch.int32)
    out = torch.zeros(2, 1, 16, 512, dtype=torch.bfloat16)
    lse = torch.zeros(2, 1, 16)
    sched = make_schedule([1, 1], 1, 16, 132, device="cpu")
    ws = alloc_workspace(sched, device="cpu")
    for check in (True, False):
        with pytest.raises(ValueError, match="balanced=True"):
            mla_decode_sm90(q, kv, pt, lens, 0.1, 1.0, out, lse, sched, ws, balanced=True, check=check)
    bsched = make_schedule([1, 1], 1, 16, 132, device="cpu", balanced=True)
    with pytest.raises(ValueError, match="bf16/fp16"):
        mla_decode_sm90(q, kv.to(torch.float8_e4m3fn), pt, lens, 0.1, 1.0, out, lse, bsched, ws, balanced=True)


def test_backend_runs_the_balanced_kernel_through_split_kv():
    """The default (split_kv=balanced since 0.2.3) runs the balanced entry; split_kv=even keeps 0.2.2's entry
    (the session tests in test_backend_host.py run both)."""
    from mla_cute_dsl.backend import CuteDslOptions, run_function
    from mla_cute_dsl.kernels.api import mla_decode_sm90, mla_decode_sm90_balanced

    assert CuteDslOptions().split_kv == "balanced"
    assert run_function("mma_sync") is mla_decode_sm90
    assert run_function("mma_sync", balanced=True) is mla_decode_sm90_balanced
