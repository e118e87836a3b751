"""CPU tests (no GPU): every host entry the backend runs passes the compiled kernels as many arguments
as they were compiled with.

A compiled kernel (tvm-ffi) checks the argument count before anything else, then each argument in
order. Called with CPU tensors, a kernel whose host entry packs the right number of arguments
therefore stops at argument #0 ("Mismatched Tensor": not on the GPU), and one that packs too many or
too few stops at the count (a TypeError: "Expects N parameters" from a kernel loaded from disk,
"takes N positional arguments" from one compiled in this process). Each entry is called twice: with
the kernel just compiled, then with the same kernel loaded from the disk cache, because only the
loaded one is strict about trailing parameters (a kernel compiled in-process accepts a call that
leaves out trailing parameters typed None; its disk-loaded copy refuses it, which is how the fault
showed on the GPU only once the backend ran from a warm cache). On the H200 that second error is what a branch's
changed kernel signature (fused-combine, sixth session) raised on every mma.sync call through the
backend, a path that branch's own tests never took; this catches it without a GPU.
"""

from __future__ import annotations

import os
import types

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

torch = pytest.importorskip("torch")
pytest.importorskip("cutlass")


@pytest.fixture
def cpu_stream(monkeypatch):
    """The host entries ask torch for the current CUDA stream; on a CPU build there is none. The
    stream is the last argument, never reached here (argument #0 fails first)."""
    from mla_cute_dsl.kernels import api

    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: types.SimpleNamespace(cuda_stream=0))
    monkeypatch.setattr(api, "_cu_stream", lambda handle: None)


def _case(H, s_q, kv_dtype, B=2, S=200, page=64):
    from mla_cute_dsl.kernels import alloc_workspace, make_schedule

    pages = -(-S // page)
    q = torch.randn(B, s_q, H, 576, dtype=torch.bfloat16)
    kv = torch.randn(B * pages, page, 576).to(kv_dtype)
    table = torch.arange(B * pages, dtype=torch.int32).view(B, pages)
    lens = torch.full((B,), S, dtype=torch.int32)
    out = torch.empty(B, s_q, H, 512, dtype=torch.bfloat16)
    lse = torch.empty(B, s_q, H, dtype=torch.float32)
    sched = make_schedule(lens.tolist(), s_q, H, 132, device="cpu")
    return q, kv, table, lens, out, lse, sched, alloc_workspace(sched, device="cpu")


# (kernel as backend.run_function names it, heads, s_q, cache dtype): each kernel family mma=auto picks
CASES = [
    ("mma_sync", 16, 1, torch.bfloat16),
    ("mma_sync", 16, 1, torch.float8_e4m3fn),
    ("fp8reg", 16, 2, torch.float8_e4m3fn),
    ("wgmma", 64, 1, torch.bfloat16),
    ("seesaw", 128, 1, torch.bfloat16),
    ("seesaw", 128, 1, torch.float8_e4m3fn),
    ("wgmma_t", 16, 2, torch.bfloat16),  # mma=wgmma_t, split_kv=even
]


def _compiled_then_from_disk(call):
    """Run ``call`` with its kernels compiled, then again with them loaded from the disk cache."""
    from mla_cute_dsl.kernels import kernel_cache

    for attempt in range(2):
        with pytest.raises(ValueError, match=r"Mismatched Tensor on argument #0") as err:
            call()
        assert "Expects" not in str(err.value) and "positional" not in str(err.value)
        stats = kernel_cache.stats()
        if attempt == 0:
            assert stats["compiled"] >= 1 and stats["disk_writes"] == stats["compiled"], stats
            kernel_cache.clear()  # forget them in-process: the second call loads them from disk
        else:
            assert stats["compiled"] == 0 and stats["disk_hits"] >= 1, stats


@pytest.mark.parametrize("kernel,H,s_q,kv_dtype", CASES, ids=lambda v: str(v).replace("torch.", ""))
def test_backend_entry_passes_the_compiled_argument_count(kernel, H, s_q, kv_dtype, cpu_stream, cache_dir):
    from mla_cute_dsl.backend import run_function

    q, kv, table, lens, out, lse, sched, ws = _case(H, s_q, kv_dtype)
    _compiled_then_from_disk(
        lambda: run_function(kernel)(q, kv, table, lens, 0.1, 1.0, out, lse, sched, ws, check=False))


@pytest.mark.parametrize("wide", [False, True])
def test_launch_passes_the_combine_kernel_its_arguments(wide, cpu_stream, cache_dir):
    """api.launch's own call of the combine kernel (narrow and wide): the partial kernel is a stand-in
    that returns at once, so that launch goes on to the real combine kernel it picks."""
    from mla_cute_dsl.kernels import api

    q, kv, table, lens, out, lse, sched, ws = _case(16, 1, torch.bfloat16)
    sched.wide_combine = wide
    partial_calls = []
    _compiled_then_from_disk(lambda: api.launch(lambda *a: partial_calls.append(len(a)), q, kv, table, lens,
                                                0.1, 1.0, out, lse, sched, ws))
    assert partial_calls == [15, 15]  # and the partial kernels take 15 (the backend-entry tests)


def test_a_wrong_argument_count_is_what_this_catches(cpu_stream, cache_dir):
    """The check itself: one argument too many or too few stops at the count, before any tensor, for
    the kernel loaded from disk (the compiled one only for too many)."""
    from mla_cute_dsl.kernels import kernel_cache
    from mla_cute_dsl.kernels.api import get_partial_kernel

    q, kv, table, lens, out, lse, sched, (o_part, lse_part) = _case(16, 1, torch.bfloat16)
    args = (q.view(2, 16, 576), kv, table, lens, out.view(2, 16, 512), lse.view(2, 16), sched.work_info,
            o_part, lse_part, 0.1, 0.1, 1.0, 1, 16, None)
    partial = get_partial_kernel("bf16", "bf16", sched.block_m)
    with pytest.raises(TypeError, match=r"takes 15 positional arguments"):
        partial(*args, None)
    kernel_cache.clear()
    loaded = get_partial_kernel("bf16", "bf16", sched.block_m)
    assert kernel_cache.stats()["disk_hits"] == 1
    with pytest.raises(ValueError, match=r"argument #0"):
        loaded(*args)
    for wrong in (args + (None,), args[:-1]):
        with pytest.raises(TypeError, match=r"Expects 15 parameters"):
            loaded(*wrong)


def _hybrid_schedule(lens, form):
    from mla_cute_dsl.kernels import alloc_workspace, make_schedule

    sched = make_schedule(lens, 1, 16, 132, device="cpu", balanced=True, form=form)
    return sched, alloc_workspace(sched, device="cpu")


def test_split_kv_balanced_entry_passes_the_compiled_argument_count(cpu_stream, cache_dir):
    """The backend's split_kv=balanced path (the entry balanced_split picks for bf16 H16 s_q1), with the hybrid
    schedule in its balanced form, compiled then from disk; then the same kernel with the even form's schedule
    (the same arguments: the form changes the buffers' contents only)."""
    from mla_cute_dsl.backend import CuteDslOptions, balanced_split, partial_kernel, run_function
    from mlacore.problem import DecodeProblem, DeviceSpec

    problem = DecodeProblem(num_heads=16, seq_len_q=1, batch_size=2, max_kv_len=200, min_kv_len=0, page_size=64,
                            q_dtype="bf16", kv_dtype="bf16", device=DeviceSpec(type="cuda", capability=(9, 0)))
    options = CuteDslOptions(split_kv="balanced")
    run_fn = run_function(partial_kernel(problem, options), balanced_split(problem, options))
    assert run_fn.__name__ == "mla_decode_sm90_balanced"
    q, kv, table, lens, out, lse, _, _ = _case(16, 1, torch.bfloat16)
    sched, ws = _hybrid_schedule([200, 7], "balanced")
    _compiled_then_from_disk(lambda: run_fn(q, kv, table, lens, 0.1, 1.0, out, lse, sched, ws, check=False))
    sched, ws = _hybrid_schedule([200, 200], "auto")
    assert sched.form == "even"
    with pytest.raises(ValueError, match=r"Mismatched Tensor on argument #0"):
        run_fn(q, kv, table, lens, 0.1, 1.0, out, lse, sched, ws, check=False)


@pytest.mark.parametrize("s_q", [1, 2])
def test_wgmma_t_balanced_entry_passes_the_compiled_argument_count(s_q, cpu_stream, cache_dir):
    """mma=wgmma_t with split_kv=balanced (the entry balanced_split picks for bf16 H16, BLOCK_M 16 and 32) over
    the hybrid schedule in its balanced form, compiled then from disk; then the even form's schedule."""
    from mla_cute_dsl.backend import CuteDslOptions, balanced_split, partial_kernel, run_function
    from mla_cute_dsl.kernels import alloc_workspace, make_schedule
    from mlacore.problem import DecodeProblem, DeviceSpec

    problem = DecodeProblem(num_heads=16, seq_len_q=s_q, batch_size=2, max_kv_len=200, min_kv_len=0,
                            page_size=64, q_dtype="bf16", kv_dtype="bf16",
                            device=DeviceSpec(type="cuda", capability=(9, 0)))
    options = CuteDslOptions(mma="wgmma_t")
    run_fn = run_function(partial_kernel(problem, options), balanced_split(problem, options))
    assert run_fn.__name__ == "mla_decode_sm90_wgmma_t_balanced"
    q, kv, table, lens, out, lse, _, _ = _case(16, s_q, torch.bfloat16)
    for lens_l, form in (([200, 7], "balanced"), ([200, 200], "auto")):
        sched = make_schedule(lens_l, s_q, 16, 132, device="cpu", balanced=True, form=form)
        ws = alloc_workspace(sched, device="cpu")
        if form == "balanced":
            _compiled_then_from_disk(lambda: run_fn(q, kv, table, lens, 0.1, 1.0, out, lse, sched, ws, check=False))
        else:
            assert sched.form == "even"
            with pytest.raises(ValueError, match=r"Mismatched Tensor on argument #0"):
                run_fn(q, kv, table, lens, 0.1, 1.0, out, lse, sched, ws, check=False)
