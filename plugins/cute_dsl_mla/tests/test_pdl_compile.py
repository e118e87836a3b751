"""Programmatic dependent launch of the combine kernel (CPU, CUTE_DSL_ARCH=sm_90a): the PDL combine kernels wait
for the partial grid (griddepcontrol.wait) before they read anything, the plain ones do not, and the cache keeps
them apart. The partial kernels' trigger is checked in each kernel's PTX-structure test."""

from __future__ import annotations

import os
import pathlib
import re
import sys

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
sys.path.insert(0, os.path.dirname(__file__))

from test_kernel_compile import _has_cutlass  # noqa: E402

needs_cutlass = pytest.mark.skipif(not _has_cutlass(), reason="nvidia-cutlass-dsl not installed")


def _combine_ptx(kind: str, pdl: bool, tmp_path, partial: str = "fp32") -> str:
    import cutlass.cute as cute

    from mla_cute_dsl.kernels import api
    from mla_cute_dsl.kernels.combine import MLACombine, MLACombineWide

    q = api._cutlass_dtype("bf16")
    kernel = {"wide": lambda: MLACombineWide(q, pdl=pdl), "row": lambda: MLACombine(q, pdl=pdl),
              "chunked": lambda: MLACombine(q, pdl=pdl, cols=128)}[kind]()
    cute.compile(kernel, *api._fake_args_combine("bf16", partial),
                 options=api.COMPILE_OPTIONS + f" --keep-ptx --dump-dir={tmp_path}")
    return "".join(p.read_text() for p in pathlib.Path(tmp_path).glob("*.ptx"))


@needs_cutlass
@pytest.mark.parametrize("kind, partial", [("row", "fp32"), ("wide", "fp32"), ("chunked", "fp32"),
                                           ("chunked", "bf16"), ("wide", "bf16")])
@pytest.mark.parametrize("pdl", [False, True])
def test_the_pdl_combine_waits_for_the_partial_grid_before_any_load(kind, partial, pdl, tmp_path):
    ptx = _combine_ptx(kind, pdl, tmp_path, partial)
    body = ptx[ptx.index(".entry"):]
    assert body.count("griddepcontrol.wait;") == (1 if pdl else 0)
    assert "griddepcontrol.launch_dependents" not in body  # nothing depends on the combine
    if pdl:  # the wait comes before the first global load
        assert body.index("griddepcontrol.wait;") < re.search(r"ld\.global", body).start()


def test_combine_kernel_for_follows_the_schedule_and_keeps_pdl_kinds_apart(monkeypatch):
    from mla_cute_dsl.kernels import api, kernel_cache
    from mla_cute_dsl.kernels.schedule import Schedule

    asked = []
    monkeypatch.setattr(kernel_cache, "get_or_build", lambda kind, key, build: asked.append((kind, key)) or kind)
    sched = Schedule(work_info=None, split_info=None, s_q=1, num_heads=16, block_m=16, capacity=1, num_slots=1)
    assert sched.pdl_combine is False  # the default, as the backend's option pdl
    assert api.combine_kernel_for("bf16", sched) == "combine"
    sched.pdl_combine = True
    assert api.combine_kernel_for("bf16", sched) == "combine_pdl"
    sched.wide_combine = True
    assert api.combine_kernel_for("bf16", sched) == "combine_wide_pdl"
    sched.pdl_combine = False
    assert api.combine_kernel_for("bf16", sched) == "combine_wide"
    sched.wide_combine = False
    assert api.combine_kernel_for("fp16", sched) == "combine"
    assert asked[-1] == ("combine", ("fp16",))
