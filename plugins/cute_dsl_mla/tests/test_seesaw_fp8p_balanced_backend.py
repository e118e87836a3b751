"""Host tests (CPU) of backend.FP8_BALANCED_PRODUCER (branch fp8-balanced-producer): off by default (the balanced fp8
seesaw converts inline, the even fp8 seesaw keeps its producer: 0.2.17's routing); on (with FP8_SEESAW_BALANCED),
fp8_loader=producer sends fp8_producer=True to the balanced seesaw entry, which asks the balanced getter for the
producer kernel ("fp8p" in its cache key) and launches through api.launch_balanced; fp8_loader=inline, a bf16 cache
and FP8_SEESAW_BALANCED off ignore it. Monkeypatched both ways; nothing compiles."""

from __future__ import annotations

import pytest
import torch

from test_backend_host import prob  # noqa: E402  (same directory)
from test_seesaw_balanced_backend import _plan  # noqa: E402
from seesaw_entries import getter_keywords  # noqa: E402  (same directory)

from mla_cute_dsl import backend as be
from mla_cute_dsl.backend import CuteDslOptions


def test_flags_are_on_by_default():
    """Both on since 0.2.17 (GPU-verified and timed in the twenty-second session, backend.py's comment)."""
    assert be.FP8_BALANCED_PRODUCER is True and be.FP8_SEESAW_BALANCED is True
    assert be.seesaw_fp8_producer(prob(num_heads=128, kv_dtype="fp8_e4m3"), CuteDslOptions())


@pytest.mark.parametrize("balanced_flag", [False, True])
@pytest.mark.parametrize("producer_flag", [False, True])
@pytest.mark.parametrize("loader", ["inline", "producer"])
def test_balanced_producer_flag_routes_plan_summary_and_run(monkeypatch, balanced_flag, producer_flag, loader):
    from mla_cute_dsl.kernels import api, sm90_wgmma_decode

    monkeypatch.setattr(be, "FP8_SEESAW_BALANCED", balanced_flag)
    monkeypatch.setattr(be, "FP8_BALANCED_PRODUCER", producer_flag)
    opts = CuteDslOptions(fp8_loader=loader)
    shape = prob(num_heads=128, kv_dtype="fp8_e4m3")
    want = loader == "producer" and (producer_flag or not balanced_flag)
    assert be.balanced_split(shape, opts) is balanced_flag
    assert be.seesaw_fp8_producer(shape, opts) is want
    # a bf16 cache never takes it (and keeps its balanced TMA / cp.async seesaw)
    assert not be.seesaw_fp8_producer(prob(num_heads=128), opts)
    summary = be.kernel_summary(shape, opts)
    assert ("a producer warpgroup converts the fp8 cache (fp8_loader=producer)" in summary) is want
    assert ("fp8_loader=producer ignored" in summary) is (loader == "producer" and not want)
    if loader == "producer" and not want:
        assert "only with backend.FP8_BALANCED_PRODUCER" in summary

    asked, launched = [], []
    real_getter = sm90_wgmma_decode.get_partial_kernel_wgmma_seesaw_balanced
    from mla_cute_dsl.kernels import kernel_cache

    keys = []
    monkeypatch.setattr(kernel_cache, "get_or_build", lambda kind, spec, build: keys.append((kind, spec)) or "k")
    monkeypatch.setattr(sm90_wgmma_decode, "get_partial_kernel_wgmma_seesaw_balanced",
                        lambda q, kv, **k: asked.append(("balanced", k)) or real_getter(q, kv, **k))
    monkeypatch.setattr(sm90_wgmma_decode, "get_partial_kernel_wgmma_seesaw",
                        lambda q, kv, **k: asked.append(("even", k)) or "even-kernel")
    monkeypatch.setattr(api, "launch_balanced", lambda partial, *a: launched.append(("balanced", partial)))
    monkeypatch.setattr(api, "launch", lambda partial, *a: launched.append(("even", partial)))
    _, planned = _plan(monkeypatch, opts, [3000, 17, 0, 4096], kv="fp8_e4m3")
    assert planned.balanced is balanced_flag
    kw = getattr(planned.run_fn, "keywords", {})
    assert kw == {"lazy_rescale": True} | ({"fp8_producer": True} if want else {})
    q = torch.zeros(4, 1, 128, 576, dtype=torch.bfloat16)
    kv = torch.zeros(4, 64, 576, dtype=torch.bfloat16).to(torch.float8_e4m3fn)
    planned.run(q, kv, torch.empty(4, 1, 128, 512, dtype=torch.bfloat16), torch.empty(4, 1, 128))
    kind, getter_kw = asked[-1]
    assert kind == ("balanced" if balanced_flag else "even")
    assert getter_kw.get("fp8_producer", False) is want
    assert launched[-1][0] == kind
    if balanced_flag:
        (cache_kind, spec), = keys
        assert cache_kind == "partial_wgmma_seesaw_balanced"
        assert spec == ("bf16", "fp8_e4m3", 64, "l2pf", "partial_bf16", "wide_store", "lazy") + (
            ("fp8p",) if want else ())


def test_balanced_getter_and_builder_pass_fp8p(monkeypatch):
    from mla_cute_dsl.kernels import api, kernel_cache
    from mla_cute_dsl.kernels import sm90_wgmma_decode as W

    keys = []
    monkeypatch.setattr(kernel_cache, "get_or_build", lambda kind, spec, build: keys.append((kind, spec)))
    W.get_partial_kernel_wgmma_seesaw_balanced("bf16", "fp8_e4m3", lazy_rescale=True)
    W.get_partial_kernel_wgmma_seesaw_balanced("bf16", "fp8_e4m3", lazy_rescale=True, fp8_producer=True)
    W.get_partial_kernel_wgmma_seesaw_balanced("fp16", "fp8_e4m3", fp8_producer=True)
    assert keys == [("partial_wgmma_seesaw_balanced", ("bf16", "fp8_e4m3", 64, "l2pf", "lazy")),
                    ("partial_wgmma_seesaw_balanced", ("bf16", "fp8_e4m3", 64, "l2pf", "lazy", "fp8p")),
                    ("partial_wgmma_seesaw_balanced", ("fp16", "fp8_e4m3", 64, "l2pf", "fp8p"))]
    for q in ("bf16", "fp16"):
        with pytest.raises(ValueError, match="fp8_producer"):
            W.get_partial_kernel_wgmma_seesaw_balanced(q, q, fp8_producer=True)

    built = []
    monkeypatch.setattr(api, "compile_partial", lambda k, *a, **kw: built.append((k, kw)))
    W._build_partial_wgmma_seesaw_balanced("bf16", "fp8_e4m3", 64, "l2pf", "lazy", "fp8p")
    W._build_partial_wgmma_seesaw_balanced("bf16", "fp8_e4m3", 64, "l2pf", "lazy")
    assert [k.__self__.fp8_producer for k, _ in built] == [True, False]
    assert all(k.__self__.balanced and kw == {"balanced": True} for k, kw in built)

    asked = getter_keywords(monkeypatch, [(True, torch.float8_e4m3fn, {"fp8_producer": fp8p}) for fp8p in (False, True)],
                            wide_store=True, partial_dtype=torch.bfloat16)
    assert "fp8_producer" not in asked[0] and asked[1]["fp8_producer"] is True  # default call's keywords unchanged
