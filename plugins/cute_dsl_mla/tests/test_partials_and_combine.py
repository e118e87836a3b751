"""CPU tests (no GPU) of how split-KV partials are stored and merged (mla-cute-dsl 0.2.7).

16-bit partials (alloc_workspace(partial_dtype=...), backend option partials): the names and kernel-cache keys
(fp32 keeps every old key), the workspace, the backend session's buffers and prebuilt kernels, and, from the PTX
of every partial-kernel family and the combine, that a bf16 partial buffer is written and read at half the width
of an fp32 one. The combine kernels (option combine, schedule.combine_kind_for): which one a schedule asks for by
batch and rows, what a session prebuilds, the chunked row kernel's keys and PTX."""

from __future__ import annotations

import os
import pathlib
import re

import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from mla_cute_dsl.kernels import api  # noqa: E402
from mla_cute_dsl.kernels.schedule import alloc_workspace, make_schedule, workspace_bytes  # noqa: E402


def test_partial_names_and_kernel_cache_keys():
    assert api.partial_spec("fp32") == ()  # the keys (and symbols) every kernel had before 16-bit partials
    assert api.partial_spec("bf16") == ("partial_bf16",)
    assert api.partial_spec("fp16") == ("partial_fp16",)
    with pytest.raises(ValueError, match="partial dtype must be one of"):
        api.partial_spec("fp8_e4m3")
    assert api.partial_from_tags(()) == "fp32"
    assert api.partial_from_tags(("l2pf", "partial_fp16")) == "fp16"
    for name in ("fp32", "bf16", "fp16"):
        assert api.partial_from_tags(api.partial_spec(name)) == name


def test_workspace_dtype_bytes_and_name():
    sched = make_schedule([4096, 100, 0], 2, 16, 132, device="cpu")
    o32, l32 = alloc_workspace(sched, device="cpu")
    o16, l16 = alloc_workspace(sched, device="cpu", partial_dtype=torch.bfloat16)
    assert o32.dtype == torch.float32 and o16.dtype == torch.bfloat16 and o16.shape == o32.shape
    assert l32.dtype == l16.dtype == torch.float32 and l16.shape == l32.shape  # the LSE partials stay fp32
    assert api.partial_name((o32, l32)) == "fp32" and api.partial_name((o16, l16)) == "bf16"
    assert api.partial_name(alloc_workspace(sched, device="cpu", partial_dtype=torch.float16)) == "fp16"
    n = sched.num_slots * sched.rows
    assert workspace_bytes(sched) == n * 513 * 4
    assert workspace_bytes(sched, torch.bfloat16) == n * (512 * 2 + 4)
    with pytest.raises(ValueError, match="partial_dtype must be"):
        alloc_workspace(sched, device="cpu", partial_dtype=torch.float64)
    with pytest.raises(ValueError, match="o_partial must be float32, bfloat16 or float16"):
        api.partial_name((o32.double(), l32))


def _cpu_session(monkeypatch, options, kv_dtype="bf16", q_dtype="bf16", heads=16):
    """A CuteDslSession on the CPU (device properties patched, schedules and workspaces kept on the host); the
    kernel getters record what they are asked for instead of compiling."""
    import types

    from mlacore import SessionConfig
    from mlacore.problem import DeviceSpec

    from mla_cute_dsl.backend import CuteDslBackend
    from mla_cute_dsl.kernels import schedule, sm90_wgmma_t_decode

    built = []
    real_make, real_alloc = schedule.make_schedule, schedule.alloc_workspace
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda dev: types.SimpleNamespace(multi_processor_count=132))
    monkeypatch.setattr(schedule, "make_schedule", lambda *a, **k: real_make(*a, **{**k, "device": "cpu"}))
    monkeypatch.setattr(schedule, "alloc_workspace", lambda sched, device=None, partial_dtype=torch.float32:
                        real_alloc(sched, device="cpu", partial_dtype=partial_dtype))
    monkeypatch.setattr(api, "get_combine_kernel",
                        lambda q, wide=False, pdl=False, partial="fp32", cols=512:
                        built.append(("combine", wide, partial, cols)))
    monkeypatch.setattr(api, "get_partial_kernel", lambda *a, **k: built.append(("mma_sync", k.get("partial"))))
    monkeypatch.setattr(sm90_wgmma_t_decode, "get_partial_kernel_wgmma_t_balanced",
                        lambda *a, **k: built.append(("wgmma_t", k.get("partial"))))
    config = SessionConfig(num_heads=heads, page_size=64, q_dtype=q_dtype, kv_dtype=kv_dtype, out_dtype=q_dtype,
                           kv_lora_rank=512, qk_rope_head_dim=64, causal=True, return_lse=True, sm_scale=0.1,
                           kv_scale=1.0, q_scale=1.0, device=DeviceSpec(type="cuda", capability=(9, 0)))
    return CuteDslBackend().open(config, options), built


@pytest.mark.parametrize("partials, q_dtype, kv_dtype, want", [
    ("auto", "bf16", "bf16", torch.bfloat16),
    ("auto", "fp16", "fp16", torch.float16),
    ("auto", "bf16", "fp8_e4m3", torch.bfloat16),  # 32 rows with an fp8 cache: the fp8reg kernel
    ("fp32", "bf16", "fp8_e4m3", torch.float32),
    ("fp32", "bf16", "bf16", torch.float32),
    ("q", "bf16", "bf16", torch.bfloat16),
    ("q", "fp16", "fp16", torch.float16),
    ("q", "bf16", "fp8_e4m3", torch.bfloat16),
])
def test_session_allocates_and_prebuilds_for_the_partials_option(monkeypatch, partials, q_dtype, kv_dtype, want):
    """At 32 rows with seesaw_split=even (0.2.22's kernels there: fp8reg, or mma.sync / wgmma_t by the step's KV
    blocks; the default balanced seesaw since 0.2.23 prebuilds no partial kernel) the workspace, the combines and
    both balanced partials the KV-block rule needs are built for the option's partial dtype."""
    from mlacore import StepInputs
    from mlacore.problem import DecodeProblem

    from mla_cute_dsl.backend import CuteDslOptions

    session, built = _cpu_session(monkeypatch, CuteDslOptions(partials=partials, seesaw_split="even"),
                                  kv_dtype=kv_dtype, q_dtype=q_dtype)
    lens = torch.tensor([4096, 700], dtype=torch.int32)
    table = torch.zeros(2, 64, dtype=torch.int32)
    problem = DecodeProblem(num_heads=16, seq_len_q=2, batch_size=2, max_kv_len=4096, min_kv_len=700, page_size=64,
                            q_dtype=q_dtype, kv_dtype=kv_dtype, device=session.config.device)
    planned = session.plan(problem, StepInputs(lens, table, lens, table))
    name = "fp32" if want == torch.float32 else q_dtype
    assert planned.workspace[0].dtype == want and planned.workspace[1].dtype == torch.float32
    assert api.partial_name(planned.workspace) == name
    prebuilt = {b for b in built if b[0] == "combine"}
    # 2 requests x 32 rows: every combine auto may pick at 32 rows, all built for this partial dtype
    assert prebuilt == {("combine", True, name, 512), ("combine", False, name, 512), ("combine", False, name, 128)}
    api.combine_kernel_for(q_dtype, planned.schedule, api.partial_name(planned.workspace))  # what a launch asks
    assert built[-1] in prebuilt and built[-1][2] == name
    if kv_dtype != "fp8_e4m3":  # 32 rows, 16-bit cache: both balanced partial kernels for auto's KV-block rule
        assert {("mma_sync", name), ("wgmma_t", name)} <= set(built)


def test_backend_option_partials_is_validated():
    from mla_cute_dsl.backend import CuteDslOptions

    assert CuteDslOptions().partials == "auto"
    assert CuteDslOptions(partials="q").partials == "q"
    with pytest.raises(ValueError, match="partials"):
        CuteDslOptions(partials="bf16")


@pytest.mark.parametrize("heads, s_q, kv, mma, partials, want", [
    (16, 1, "fp8_e4m3", "auto", "auto", "bf16"),  # fp8reg
    (16, 2, "fp8_e4m3", "auto", "auto", "bf16"),  # 32 rows: the balanced seesaw (0.2.23; fp8reg before)
    (16, 2, "fp8_e4m3", "wgmma_t", "auto", "bf16"),  # forced away from fp8reg
    (128, 1, "fp8_e4m3", "auto", "auto", "bf16"),  # seesaw
    (64, 1, "fp8_e4m3", "auto", "auto", "bf16"),  # seesaw (wgmma up to 0.2.15)
    (16, 2, "bf16", "auto", "auto", "bf16"),  # the balanced seesaw (0.2.23; mma.sync / wgmma_t before)
    (16, 2, "bf16", "auto", "fp32", "fp32"),
    (16, 2, "bf16", "auto", "q", "bf16"),
    (128, 1, "fp8_e4m3", "auto", "q", "bf16"),
    (16, 1, "fp8_e4m3", "auto", "fp32", "fp32"),
])
def test_partial_dtype_follows_the_option_and_the_kernel(heads, s_q, kv, mma, partials, want):
    from mlacore.problem import DecodeShape, DeviceSpec

    from mla_cute_dsl.backend import CuteDslOptions, partial_dtype_name

    shape = DecodeShape(num_heads=heads, seq_len_q=s_q, page_size=64, q_dtype="bf16", kv_dtype=kv,
                        device=DeviceSpec(type="cuda", capability=(9, 0)))
    assert partial_dtype_name(shape, CuteDslOptions(mma=mma, partials=partials)) == want


# ---- PTX: what a bf16 partial buffer changes in each kernel family ----

cutlass = pytest.importorskip("cutlass")

_WIDTH = {"b8": 1, "b16": 2, "b32": 4, "b64": 8, "f32": 4, "s32": 4, "u32": 4, "u16": 2}


def _global_bytes(ptx: str, op: str) -> int:
    """Bytes one thread moves through `op` (st.global / ld.global) instructions, counted statically."""
    total = 0
    for m in re.finditer(rf"\b{op}((?:\.[a-z0-9]+)+)", ptx):
        parts = m.group(1).split(".")[1:]
        vec = next((int(p[1:]) for p in parts if re.fullmatch(r"v\d", p)), 1)
        total += vec * next(_WIDTH[p] for p in parts if p in _WIDTH)
    return total


def _ptx(fn, args, tmp_path) -> str:
    import cutlass.cute as cute

    tmp_path.mkdir(parents=True, exist_ok=True)
    cute.compile(fn, *args, options=api.COMPILE_OPTIONS + f" --keep-ptx --dump-dir={tmp_path}")
    return "".join(p.read_text() for p in pathlib.Path(tmp_path).glob("*.ptx"))


def _family(name):
    from mla_cute_dsl.kernels.sm90_decode import MLADecodePartial
    from mla_cute_dsl.kernels.sm90_decode_fp8 import MLADecodePartialFP8Reg
    from mla_cute_dsl.kernels.sm90_wgmma_decode import MLADecodePartialWGMMA, MLADecodePartialWGMMASeesaw
    from mla_cute_dsl.kernels.sm90_wgmma_t_decode import MLADecodePartialWGMMAT

    bf, f8 = api._cutlass_dtype("bf16"), api._cutlass_dtype("fp8_e4m3")
    return {  # (kernel, kv dtype, balanced entry)
        "mma_sync balanced 32": (MLADecodePartial(bf, bf, 32, balanced=True), "bf16", True),
        "fp8reg 16": (MLADecodePartialFP8Reg(bf, f8, 16), "fp8_e4m3", False),
        "wgmma": (MLADecodePartialWGMMA(bf, bf, 64), "bf16", False),
        "seesaw fp8": (MLADecodePartialWGMMASeesaw(bf, f8, 64), "fp8_e4m3", False),
        "wgmma_t balanced 32": (MLADecodePartialWGMMAT(bf, bf, 32, balanced=True), "bf16", True),
    }[name]


@pytest.mark.parametrize("family", ["mma_sync balanced 32", "fp8reg 16", "wgmma", "seesaw fp8", "wgmma_t balanced 32"])
def test_bf16_partials_are_stored_at_the_width_of_the_output(family, tmp_path):
    """Per thread, the epilogue stores out (bf16), partial O and lse (fp32). With S32 / S16 the store bytes of the
    fp32- / bf16-partial kernel: S32 = out + 2 * out + lse and S16 = out + out + lse, so out = S32 - S16 and
    lse = S16 - 2 * out must come out as a few fp32 stores."""
    def store_bytes(partial):
        kernel, kv, balanced = _family(family)
        d = tmp_path / partial
        if balanced:
            return _global_bytes(_ptx(kernel.call_balanced, api._fake_args_partial_balanced("bf16", kv, partial), d),
                                 "st.global")
        return _global_bytes(_ptx(kernel, api._fake_args_partial("bf16", kv, partial), d), "st.global")

    s32, s16 = store_bytes("fp32"), store_bytes("bf16")
    out = s32 - s16
    lse = s16 - 2 * out
    assert out >= 128, (s32, s16)
    assert 0 < lse <= 64 and lse % 4 == 0, (s32, s16)


@pytest.mark.parametrize("wide", [False, True])
def test_combine_reads_bf16_partials_at_half_width(wide, tmp_path):
    from mla_cute_dsl.kernels.combine import MLACombine, MLACombineWide

    cls = MLACombineWide if wide else MLACombine
    ptx32 = _ptx(cls(api._cutlass_dtype("bf16")), api._fake_args_combine("bf16", "fp32"), tmp_path / "a")
    ptx16 = _ptx(cls(api._cutlass_dtype("bf16")), api._fake_args_combine("bf16", "bf16"), tmp_path / "b")
    assert "ld.global.b16" not in ptx32
    n16 = len(re.findall(r"\bld\.global\.b16\b", ptx16))
    assert n16 >= 16  # every partial O value: one 16-bit load (the LSE partials stay 32-bit)
    assert _global_bytes(ptx32, "ld.global") - _global_bytes(ptx16, "ld.global") == 2 * n16
    assert _global_bytes(ptx32, "st.global") == _global_bytes(ptx16, "st.global")  # same output stores


# ---- option combine: which merge kernel a session's schedules ask for ----


@pytest.mark.parametrize("combine, batch, want_wide, want_cols", [
    ("auto", 2, True, 512),  # 32 rows: 2 x 8 row CTAs < 132 // 2: wide
    ("auto", 8, True, 512),  # 64 row CTAs
    ("auto", 9, False, 128),  # 72 row CTAs: chunked
    ("auto", 65, False, 128),  # 520 < 4 x 132
    ("auto", 66, False, 512),  # 528: row
    ("row", 2, False, 512),
    ("chunked", 2, False, 128),
    ("chunked", 66, False, 128),
    ("wide", 66, True, 512),
])
def test_option_combine_sets_the_schedule_and_the_prebuilt_kernels(monkeypatch, combine, batch, want_wide, want_cols):
    from mlacore import StepInputs
    from mlacore.problem import DecodeProblem

    from mla_cute_dsl.backend import CuteDslOptions

    session, built = _cpu_session(monkeypatch, CuteDslOptions(combine=combine))
    lens = torch.full((batch,), 2048, dtype=torch.int32)
    table = torch.zeros(batch, 32, dtype=torch.int32)
    problem = DecodeProblem(num_heads=16, seq_len_q=2, batch_size=batch, max_kv_len=2048, min_kv_len=2048,
                            page_size=64, q_dtype="bf16", kv_dtype="bf16", device=session.config.device)
    prebuilt = None
    for _ in range(2):  # the first plan makes the schedule, the second re-plans in place
        planned = session.plan(problem, StepInputs(lens, table, lens, table))
        if prebuilt is None:  # what the first plan built, before anything below asks for a kernel
            prebuilt = {b for b in built if b[0] == "combine"}
        assert planned.schedule.wide_combine is want_wide and planned.schedule.combine_cols == want_cols
        n = len(built)
        api.combine_kernel_for("bf16", planned.schedule, "bf16")  # what a launch of this step asks for (partials=auto: q)
        assert built[n:] == [("combine", want_wide, "bf16", want_cols)]
        assert built[n] in prebuilt  # warmup (the first plan) built the kernel this step launches
    want = {"auto": {("combine", True, "bf16", 512), ("combine", False, "bf16", 512), ("combine", False, "bf16", 128)},
            "row": {("combine", False, "bf16", 512)}, "chunked": {("combine", False, "bf16", 128)},
            "wide": {("combine", True, "bf16", 512)}}[combine]
    assert prebuilt == want


def test_combine_kind_follows_batch_and_rows():
    from mla_cute_dsl.kernels.schedule import combine_kind_for, wide_combine_for

    assert [combine_kind_for(b, 16, 132) for b in (1, 16, 17, 131, 132)] == ["wide", "wide", "chunked", "chunked",
                                                                           "row"]
    assert [combine_kind_for(b, 32, 132) for b in (8, 9, 65, 66)] == ["wide", "chunked", "chunked", "row"]
    # the same rule at 128 rows (0.2.7 kept wide up to num_sms row CTAs, then row, from 33 rows)
    assert [combine_kind_for(b, 128, 132) for b in (1, 2, 3, 16, 17)] == ["wide", "wide", "chunked", "chunked",
                                                                          "row"]
    assert [combine_kind_for(1, r, 132) for r in (4 * 65, 4 * 66, 4 * 527, 4 * 528)] == ["wide", "chunked",
                                                                                          "chunked", "row"]
    assert wide_combine_for(8, 32, 132) and not wide_combine_for(9, 32, 132)
    # the choice follows batch and rows only: the same for every length of one batch size (graph replay)
    kinds = {(s.wide_combine, s.combine_cols) for s in (
        make_schedule(torch.tensor([n] * 20, dtype=torch.int32), 1, 16, 132, device="cpu") for n in (0, 1, 64, 100000))}
    assert kinds == {(False, 128)}


def test_combine_kernel_keys_name_the_chunk_width(monkeypatch):
    from mla_cute_dsl.kernels import kernel_cache

    asked = []
    monkeypatch.setattr(kernel_cache, "get_or_build", lambda kind, key, build: asked.append((kind, key)))
    api.get_combine_kernel("bf16")
    api.get_combine_kernel("bf16", cols=128, partial="bf16")
    api.get_combine_kernel("bf16", wide=True, cols=128)  # wide ignores cols
    api.get_combine_kernel("bf16", pdl=True, cols=128)
    assert asked == [("combine", ("bf16",)), ("combine", ("bf16", "partial_bf16", "cols128")),
                     ("combine_wide", ("bf16",)), ("combine_pdl", ("bf16", "cols128"))]
    with pytest.raises(ValueError, match="cols must be"):
        api.get_combine_kernel("bf16", cols=64)


@pytest.mark.parametrize("cols", [128, 512])
def test_the_row_combine_splits_columns_over_the_grid(cols, tmp_path):
    """MLACombine(cols): per lane cols / 32 partial loads and output stores per split, the chunk from blockIdx.z."""
    from mla_cute_dsl.kernels.combine import MLACombine

    ptx = _ptx(MLACombine(api._cutlass_dtype("bf16"), cols=cols), api._fake_args_combine("bf16", "bf16"), tmp_path)
    assert len(re.findall(r"\bst\.global\.b16\b", ptx)) == cols // 32  # the chunk's outputs, one per lane each
    if cols == 128:
        assert "%ctaid.z" in ptx  # the column chunk


def test_combine_params_and_refusals():
    from mla_cute_dsl.kernels.schedule import combine_params

    assert [combine_params(k) for k in ("wide", "chunked", "row")] == [(True, 512), (False, 128), (False, 512)]
    with pytest.raises(ValueError, match="combine kind must be"):
        combine_params("auto")
    with pytest.raises(ValueError, match="cols must be 128 or 512"):
        api.get_combine_kernel("bf16", cols=256)
    with pytest.raises(ValueError, match="kernel-cache tag partial_fp8"):
        api.partial_from_tags(("partial_fp8",))


def test_make_schedule_forces_the_combine_kind_at_every_call():
    lens = torch.full((64,), 2048, dtype=torch.int32)  # 64 x 8 row CTAs at 32 rows: auto picks chunked
    sched = make_schedule(lens, 2, 16, 132, device="cpu")
    assert (sched.wide_combine, sched.combine_cols) == (False, 128)
    for kind, want in (("wide", (True, 512)), ("row", (False, 512)), ("chunked", (False, 128)),
                       ("auto", (False, 128))):
        make_schedule(lens, 2, 16, 132, device="cpu", out=sched, combine=kind)  # in place, as a re-plan
        assert (sched.wide_combine, sched.combine_cols) == want, kind
    with pytest.raises(ValueError, match="combine kind must be"):
        make_schedule(lens, 2, 16, 132, device="cpu", combine="fast")
