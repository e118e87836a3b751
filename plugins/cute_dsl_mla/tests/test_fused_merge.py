"""CPU tests (no GPU) of combine=fused (kernels/fused_merge.py): the balanced mma.sync kernel merges each split
request in the last CTA to finish one of its items, so no combine kernel runs.

The fused specializations compile (bf16/fp16, 16/32 rows, fp32 and 16-bit partials) without spills, with one
device-scope atomic, acq_rel fences and L2-only (ld.global.cg) reads of the partials, none of which the default
kernel has; kernel-cache keys carry the "fused" tag only when on; the option reaches the schedule
(Schedule.fused_combine, auto's combine kind kept for the fallback) and the session (no combine kernel built
where every step merges in the partial kernel, auto's kernels where it may fall back); the workspace holds zeroed
arrival counters; the host entry launches the fused kernel with its arguments (compiled and from disk) and no
combine kernel, and falls back to the combine kernel where the fused kernel does not apply."""

from __future__ import annotations

import os
import pathlib
import re
import types

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

torch = pytest.importorskip("torch")
pytest.importorskip("cutlass")

from test_launch_arguments import _case, _compiled_then_from_disk, cpu_stream  # noqa: E402,F401

H200 = None


def _ptx(fn, args, tmp_path):
    import cutlass.cute as cute

    from mla_cute_dsl.kernels import api

    cute.compile(fn, *args, options=api.COMPILE_OPTIONS + f" --keep-ptx --dump-dir={tmp_path}")
    return "".join(p.read_text() for p in pathlib.Path(tmp_path).glob("*.ptx"))


def _sync_ops(ptx: str):
    atoms = re.findall(r"^\s*(?:@%p\d+\s+)?(atom\.[\w.]+|red\.global[\w.]*)", ptx, re.M)
    fences = re.findall(r"\b(fence\.[\w.]+|membar\.\w+)", ptx)
    return atoms, fences


@pytest.mark.parametrize("partial", ["fp32", "q"])
@pytest.mark.parametrize("bm", [16, 32])
@pytest.mark.parametrize("q", ["bf16", "fp16"])
def test_fused_kernel_compiles_with_its_atomic_fences_and_l2_reads(q, bm, partial, tmp_path):
    from mla_cute_dsl.kernels import api
    from mla_cute_dsl.kernels.sm90_decode import MLADecodePartial

    pname = q if partial == "q" else "fp32"
    k = MLADecodePartial(api._cutlass_dtype(q), api._cutlass_dtype(q), bm, balanced=True,
                         wide_store=partial == "q", fused=True)
    ptx = _ptx(k.call_balanced_fused, api._fake_args_partial_balanced_fused(q, q, pname), tmp_path)
    atoms, fences = _sync_ops(ptx)
    assert atoms == ["atom.global.acq_rel.add.u32"], atoms  # one arrival per split item, device scope (default)
    assert fences.count("fence.acq_rel.gpu") == 2  # the writers' release, the last CTA's acquire
    assert "kernel_balanced_fused" in ptx
    # other CTAs' LSEs and partials: through L2 only, partials 16 bytes at a time
    assert re.search(r"ld\.global\.cg\.b32", ptx) and re.search(r"ld\.global\.cg\.v4\.b32", ptx)
    assert "ld.local" not in ptx and "st.local" not in ptx
    # the default kernel's 6 barriers plus the arrival's 2
    assert len(re.findall(r"bar\.sync", ptx)) == 8


@pytest.mark.parametrize("bm", [16, 32])
def test_fused_even_entry_compiles_with_its_atomic_and_fences(bm, tmp_path):
    """The even entry (one CTA per work row, split_kv=even) with the fused merge: call_fused."""
    from mla_cute_dsl.kernels import api
    from mla_cute_dsl.kernels.sm90_decode import MLADecodePartial

    k = MLADecodePartial(api._cutlass_dtype("bf16"), api._cutlass_dtype("bf16"), bm, wide_store=True, fused=True)
    ptx = _ptx(k.call_fused, api._fake_args_partial_fused("bf16", "bf16", "bf16"), tmp_path)
    atoms, fences = _sync_ops(ptx)
    assert atoms == ["atom.global.acq_rel.add.u32"] and fences.count("fence.acq_rel.gpu") == 2
    assert "kernel_fused" in ptx and re.search(r"ld\.global\.cg\.v4\.b32", ptx)
    assert "ld.local" not in ptx and "st.local" not in ptx
    assert len(re.findall(r"bar\.sync", ptx)) == 7  # the default kernel's 5 plus the arrival's 2


def test_default_balanced_kernel_has_no_atomic_or_fence(tmp_path):
    from mla_cute_dsl.kernels import api
    from mla_cute_dsl.kernels.sm90_decode import MLADecodePartial

    k = MLADecodePartial(api._cutlass_dtype("bf16"), api._cutlass_dtype("bf16"), 16, balanced=True, wide_store=True)
    ptx = _ptx(k.call_balanced, api._fake_args_partial_balanced("bf16", "bf16", "bf16"), tmp_path)
    assert _sync_ops(ptx) == ([], [])
    assert "ld.global.cg" not in ptx


def test_fused_is_refused_where_it_is_not_built():
    import cutlass

    from mla_cute_dsl.kernels import api
    from mla_cute_dsl.kernels.sm90_decode import MLADecodePartial

    for kv, bm, kw in ((cutlass.BFloat16, 64, dict(balanced=True)), (cutlass.BFloat16, 64, {}),
                       (cutlass.Float8E4M3FN, 16, {})):
        with pytest.raises(ValueError, match="fused"):
            MLADecodePartial(cutlass.BFloat16, kv, bm, fused=True, **kw)
    for args, kw in ((("bf16", "bf16", 64), dict(balanced=True)), (("bf16", "bf16", 64), {}),
                     (("bf16", "fp8_e4m3", 16), {})):
        with pytest.raises(ValueError):
            api.get_partial_kernel(*args, fused=True, **kw)


def test_kernel_cache_keys_carry_the_fused_tag_only_when_on(monkeypatch):
    from mla_cute_dsl.kernels import api, fused_merge, kernel_cache

    asked = []
    monkeypatch.setattr(kernel_cache, "get_or_build", lambda kind, key, build: asked.append((kind, key)))
    api.get_partial_kernel("bf16", "bf16", 16, balanced=True, partial="bf16", wide_store=True)
    api.get_partial_kernel("bf16", "bf16", 16, balanced=True, partial="bf16", wide_store=True, fused=True)
    api.get_partial_kernel("fp16", "fp16", 32, balanced=True, fused=True)
    api.get_partial_kernel("bf16", "bf16", 32, partial="bf16", fused=True)
    api.get_partial_kernel("bf16", "bf16", 32, partial="bf16")
    assert asked[3:] == [("partial", ("bf16", "bf16", 32, None, "partial_bf16", "fused")),
                         ("partial", ("bf16", "bf16", 32, None, "partial_bf16"))]
    assert asked[:3] == [
        ("partial_balanced", ("bf16", "bf16", 16, None, "partial_bf16", "wide_store")),
        ("partial_balanced", ("bf16", "bf16", 16, None, "partial_bf16", "wide_store", "fused")),
        ("partial_balanced", ("fp16", "fp16", 32, None, "fused")),
    ]
    assert fused_merge.fused_spec(False) == () and fused_merge.fused_from_tags(("partial_bf16", "fused"))
    assert kernel_cache.symbol_for("partial_balanced", ("bf16", "bf16", 16, None)) == \
        "mla_partial_balanced_bf16_bf16_16"


# ---- schedule and workspace ----


def test_make_schedule_combine_fused_keeps_autos_kind_for_the_fallback():
    from mla_cute_dsl.kernels.schedule import combine_kind_for, combine_params, make_schedule

    for batch in (2, 40, 200):
        lens = [4096] * batch
        auto = make_schedule(lens, 1, 16, 132, device="cpu", balanced=True)
        fused = make_schedule(lens, 1, 16, 132, device="cpu", balanced=True, combine="fused")
        assert not auto.fused_combine and fused.fused_combine
        assert (fused.wide_combine, fused.combine_cols) == combine_params(combine_kind_for(batch, 16, 132))
        assert torch.equal(fused.work_info, auto.work_info) and torch.equal(fused.split_info, auto.split_info)
        again = make_schedule(lens, 1, 16, 132, device="cpu", balanced=True, out=fused)  # default combine: off
        assert again is fused and not again.fused_combine
        make_schedule(lens, 1, 16, 132, device="cpu", balanced=True, out=fused, combine="fused")
        assert fused.fused_combine
    with pytest.raises(ValueError, match="combine kind"):
        make_schedule([64], 1, 16, 132, device="cpu", combine="merged")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_workspace_has_zeroed_arrival_counters_per_request(dtype):
    from mla_cute_dsl.kernels import api
    from mla_cute_dsl.kernels.schedule import Workspace, alloc_workspace, make_schedule

    sched = make_schedule([4096, 0, 77], 2, 16, 132, device="cpu", balanced=True, max_batch=8)
    ws = alloc_workspace(sched, device="cpu", partial_dtype=dtype)
    assert isinstance(ws, Workspace) and isinstance(ws, tuple) and len(ws) == 2
    o_part, lse_part = ws  # unpacks as the pair it always was
    assert o_part.dtype == dtype and lse_part.shape == (sched.num_slots, 32)
    assert ws.arrivals.dtype == torch.int32 and ws.arrivals.shape == (8,) and not ws.arrivals.any()
    assert api.arrivals_of(ws) is ws.arrivals
    with pytest.raises(ValueError, match="alloc_workspace"):
        api.arrivals_of((o_part, lse_part))


# ---- host entry ----


def _fused_case(H=16, s_q=1, lens_l=(200, 7), combine="fused", balanced=True):
    from mla_cute_dsl.kernels import alloc_workspace, make_schedule

    q, kv, table, lens, out, lse, _, _ = _case(H, s_q, torch.bfloat16)
    form = "balanced" if balanced else "auto"
    sched = make_schedule(list(lens_l), s_q, H, 132, device="cpu", balanced=balanced, form=form, combine=combine)
    return q, kv, table, lens, out, lse, sched, alloc_workspace(sched, device="cpu")


@pytest.mark.parametrize("s_q", [1, 2])
def test_fused_entry_passes_the_compiled_argument_count(s_q, cpu_stream, cache_dir, monkeypatch):
    """The backend's balanced entry with a combine=fused schedule: the fused kernel, called with the arguments
    it was compiled with (compiled, then loaded from disk), and no combine kernel."""
    from mla_cute_dsl.kernels import api

    monkeypatch.setattr(api, "get_combine_kernel", lambda *a, **k: pytest.fail("fused step asked for a combine"))
    q, kv, table, lens, out, lse, sched, ws = _fused_case(s_q=s_q)
    _compiled_then_from_disk(
        lambda: api.mla_decode_sm90_balanced(q, kv, table, lens, 0.1, 1.0, out, lse, sched, ws, check=False))
    q, kv, table, lens, out, lse, sched, ws = _fused_case(s_q=s_q, balanced=False)  # split_kv=even's entry
    _compiled_then_from_disk(
        lambda: api.mla_decode_sm90(q, kv, table, lens, 0.1, 1.0, out, lse, sched, ws, check=False))


def test_fused_step_launches_no_combine_and_passes_split_info_and_counters(monkeypatch, cpu_stream):
    from mla_cute_dsl.kernels import api

    calls, kernels = [], []
    monkeypatch.setattr(api, "get_partial_kernel",
                        lambda *a, **k: kernels.append((a, k)) or (lambda *args: calls.append(args)))
    monkeypatch.setattr(api, "get_combine_kernel", lambda *a, **k: pytest.fail("fused step built a combine kernel"))
    for lens_l in ((200, 7), (4096, 0, 100), (64,)):  # splits, a zero-length request, nothing split
        q, kv, table, lens, out, lse, sched, ws = _fused_case(lens_l=lens_l)
        calls.clear()
        api.mla_decode_sm90_balanced(q, kv, table, lens, 0.1, 1.0, out, lse, sched, ws, check=False)
        assert len(calls) == 1 and len(calls[0]) == 18
        args = calls[0]
        assert args[6] is sched.work_info and args[7] is sched.cta_ranges
        assert args[10] is sched.split_info and args[11] is ws.arrivals
    assert all(k["fused"] is True and k["balanced"] is True for _, k in kernels)
    kernels.clear()
    for lens_l in ((200, 7), (4096, 0, 100)):  # the even entry (split_kv=even)
        q, kv, table, lens, out, lse, sched, ws = _fused_case(lens_l=lens_l, balanced=False)
        calls.clear()
        api.mla_decode_sm90(q, kv, table, lens, 0.1, 1.0, out, lse, sched, ws, check=False)
        assert len(calls) == 1 and len(calls[0]) == 17
        assert calls[0][6] is sched.work_info and calls[0][9] is sched.split_info and calls[0][10] is ws.arrivals
    assert all(k["fused"] is True and "balanced" not in k for _, k in kernels)


def test_fused_falls_back_to_the_combine_kernel_where_it_is_not_built(monkeypatch, cpu_stream):
    """combine=fused with a shape the fused kernel does not take (64 rows: BLOCK_M 64; an fp8 cache) or through
    another kernel's entry (wgmma_t's balanced entry: api.launch_balanced): the schedule's combine kernel."""
    from mla_cute_dsl.kernels import api

    combines, partials = [], []
    monkeypatch.setattr(api, "get_partial_kernel", lambda *a, **k: partials.append(k) or (lambda *args: None))
    monkeypatch.setattr(api, "get_combine_kernel",
                        lambda *a, **k: combines.append(k) or (lambda *args: combines.append(len(args))))
    q, kv, table, lens, out, lse, sched, ws = _fused_case(H=32, s_q=2)
    assert sched.fused_combine and sched.block_m == 64 and not api.fused_supported(sched, "bf16")
    api.mla_decode_sm90_balanced(q, kv, table, lens, 0.1, 1.0, out, lse, sched, ws, check=False)
    assert "fused" not in partials[-1] and combines[-1] == 6
    q, kv, table, lens, out, lse, sched, ws = _fused_case(balanced=False)
    api.mla_decode_sm90(q, kv.to(torch.float8_e4m3fn), table, lens, 0.1, 1.0, out, lse, sched, ws, check=False)
    assert "fused" not in partials[-1] and combines[-1] == 6
    q, kv, table, lens, out, lse, sched, ws = _fused_case()
    api.launch_balanced(lambda *a: None, q, kv, table, lens, 0.1, 1.0, out, lse, sched, ws)  # wgmma_t's path
    assert combines[-1] == 6


# ---- backend ----


def _problem(heads=16, s_q=1, batch=2, kv="bf16"):
    from mlacore.problem import DecodeProblem, DeviceSpec

    return DecodeProblem(num_heads=heads, seq_len_q=s_q, batch_size=batch, max_kv_len=4096, min_kv_len=4096,
                         page_size=64, q_dtype="bf16", kv_dtype=kv, device=DeviceSpec(type="cuda", capability=(9, 0)))


def test_backend_option_combine_fused_shape_rules():
    from mla_cute_dsl.backend import CuteDslOptions, combine_variants, fused_merges

    fused = CuteDslOptions(combine="fused")
    assert CuteDslOptions().combine == "auto"
    # H=16 s_q=1 (the B=64 S=8192 target): every step merges in the balanced mma.sync kernel
    assert fused_merges(_problem(), fused) and combine_variants(_problem(), fused) == []
    auto3 = combine_variants(_problem(), CuteDslOptions())
    # 17-32 rows with mma=auto and seesaw_split=even (0.2.22's kernels there): steps of >= 640 KV blocks run
    # wgmma_t, which falls back to auto's combines
    fused_even = CuteDslOptions(combine="fused", seesaw_split="even")
    assert not fused_merges(_problem(s_q=2), fused_even) and combine_variants(_problem(s_q=2), fused_even) == auto3
    # ... and with the defaults the balanced seesaw (0.2.23), which does too
    assert not fused_merges(_problem(s_q=2), fused) and combine_variants(_problem(s_q=2), fused) == auto3
    forced = CuteDslOptions(combine="fused", mma="mma_sync")
    assert fused_merges(_problem(s_q=2), forced) and combine_variants(_problem(s_q=2), forced) == []
    for p, o in ((_problem(kv="fp8_e4m3"), fused), (_problem(heads=64), fused),
                 (_problem(kv="fp8_e4m3"), CuteDslOptions(combine="fused", mma="mma_sync"))):
        assert not fused_merges(p, o) and combine_variants(p, o) == auto3
    # the even entry merges too, at 17-32 rows as well (where auto runs it: seesaw_split=even)
    even = CuteDslOptions(combine="fused", split_kv="even", seesaw_split="even")
    assert fused_merges(_problem(), even) and fused_merges(_problem(s_q=2), even)
    assert not fused_merges(_problem(s_q=2), CuteDslOptions(combine="fused", split_kv="even"))  # the seesaw
    with pytest.raises(ValueError):
        CuteDslOptions(combine="merge")


@pytest.mark.parametrize("s_q, mma, want_combines, want_fused", [
    (1, "auto", set(), True), (2, "mma_sync", set(), True),
    (2, "auto", {(True, "bf16", 512), (False, "bf16", 512), (False, "bf16", 128)}, True),
])
def test_session_with_combine_fused(monkeypatch, s_q, mma, want_combines, want_fused):
    """The option reaches the schedule plan writes (first plan and re-plan in place); the session builds no combine
    kernel where every step merges in the partial kernel, auto's three where mma=auto may pick wgmma_t (at 17-32
    rows with seesaw_split=even, where auto keeps 0.2.22's kernels since 0.2.23); the balanced mma.sync partial
    prebuilt for the KV-block rule is the fused one."""
    import types as _t

    from mla_cute_dsl.backend import CuteDslBackend, CuteDslOptions
    from mla_cute_dsl.kernels import api, schedule, sm90_wgmma_t_decode
    from mlacore import SessionConfig, StepInputs
    from mlacore.problem import DeviceSpec

    built, partials = [], []
    real_make, real_alloc = schedule.make_schedule, schedule.alloc_workspace
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev: _t.SimpleNamespace(multi_processor_count=132))
    monkeypatch.setattr(schedule, "make_schedule", lambda *a, **k: real_make(*a, **{**k, "device": "cpu"}))
    monkeypatch.setattr(schedule, "alloc_workspace", lambda sched, device=None, partial_dtype=torch.float32:
                        real_alloc(sched, device="cpu", partial_dtype=partial_dtype))
    monkeypatch.setattr(api, "get_combine_kernel", lambda q, wide=False, pdl=False, partial="fp32", cols=512:
                        built.append((wide, partial, cols)))
    monkeypatch.setattr(api, "get_partial_kernel", lambda *a, **k: partials.append(k))
    monkeypatch.setattr(sm90_wgmma_t_decode, "get_partial_kernel_wgmma_t_balanced", lambda *a, **k: None)
    config = SessionConfig(num_heads=16, page_size=64, q_dtype="bf16", kv_dtype="bf16", out_dtype="bf16",
                           kv_lora_rank=512, qk_rope_head_dim=64, causal=True, return_lse=True, sm_scale=0.1,
                           kv_scale=1.0, q_scale=1.0, device=DeviceSpec(type="cuda", capability=(9, 0)))
    session = CuteDslBackend().open(config, CuteDslOptions(combine="fused", mma=mma, seesaw_split="even"))
    lens = torch.tensor([4096, 100], dtype=torch.int32)
    table = torch.zeros(2, 64, dtype=torch.int32)
    first = session.plan(_problem(s_q=s_q), StepInputs(lens, table, lens, table))
    again = session.plan(_problem(s_q=s_q), StepInputs(lens, table, lens, table))
    assert first.schedule is again.schedule and again.schedule.fused_combine is want_fused
    assert first.run_fn.__name__ == "mla_decode_sm90_balanced"
    assert set(built) == want_combines
    assert not again.workspace.arrivals.any()
    if mma == "auto" and s_q == 2:
        assert [k.get("fused") for k in partials] == [True]
