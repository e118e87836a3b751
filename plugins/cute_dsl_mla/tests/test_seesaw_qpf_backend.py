"""Host tests (CPU) of the backend option q_prefetch: on by default since the twenty-third session (measured on an
H200); off gives the plan keywords, summary and kernels of before; on, the balanced seesaw with a bf16/fp16 cache gets q_prefetch=True at its entry,
which asks the balanced getter for the "qpf" kernel; the even seesaw (seesaw_split=even), fp8 caches and the other
kernels ignore it. Monkeypatched; nothing compiles."""

from __future__ import annotations

import pytest
import torch

from test_backend_host import prob  # noqa: E402  (same directory)
from test_seesaw_balanced_backend import _plan  # noqa: E402

from mla_cute_dsl import backend as be
from mla_cute_dsl.backend import CuteDslOptions


def test_option_default_on_and_validated():
    assert CuteDslOptions().q_prefetch is True
    assert CuteDslOptions(q_prefetch=False).q_prefetch is False  # `mla bench --backend cute_dsl_mla:q_prefetch=false`
    with pytest.raises(ValueError, match="q_prefetch"):
        CuteDslOptions(q_prefetch="sometimes")
    assert be.seesaw_q_prefetch(prob(num_heads=128), CuteDslOptions())
    assert "(q_prefetch)" in be.kernel_summary(prob(num_heads=128), CuteDslOptions())
    assert not be.seesaw_q_prefetch(prob(num_heads=128), CuteDslOptions(q_prefetch=False))
    assert "(q_prefetch)" not in be.kernel_summary(prob(num_heads=128), CuteDslOptions(q_prefetch=False))


@pytest.mark.parametrize("heads,kv,split,want", [
    (128, "bf16", "balanced", True), (64, "bf16", "balanced", True), (128, "fp16", "balanced", True),
    (128, "bf16", "even", False), (128, "fp8_e4m3", "balanced", False), (16, "bf16", "balanced", False)])
def test_on_reaches_only_the_balanced_16_bit_seesaw(monkeypatch, heads, kv, split, want):
    from mla_cute_dsl.kernels import api, kernel_cache, sm90_wgmma_decode

    opts = CuteDslOptions(q_prefetch=True, seesaw_split=split)
    q_dt = "fp16" if kv == "fp16" else "bf16"
    shape = prob(num_heads=heads, kv_dtype=kv, q_dtype=q_dt)
    assert be.seesaw_q_prefetch(shape, opts) is want
    assert ("(q_prefetch)" in be.kernel_summary(shape, opts)) is want
    if heads == 16 or q_dt == "fp16":
        return  # routing only (the session helper plans bf16 q)
    keys, launched = [], []
    monkeypatch.setattr(kernel_cache, "get_or_build", lambda kind, spec, build: keys.append((kind, spec)) or "k")
    monkeypatch.setattr(api, "launch_balanced", lambda partial, *a: launched.append("balanced"))
    monkeypatch.setattr(api, "launch", lambda partial, *a: launched.append("even"))
    _, planned = _plan(monkeypatch, opts, [3000, 17, 0, 4096], heads=heads, kv=kv)
    kw = getattr(planned.run_fn, "keywords", {})
    assert kw.get("q_prefetch", False) is want
    q = torch.zeros(4, 1, heads, 576, dtype=torch.bfloat16)
    cache = torch.zeros(4, 64, 576, dtype=torch.bfloat16)
    cache = cache.to(torch.float8_e4m3fn) if kv == "fp8_e4m3" else cache
    planned.run(q, cache, torch.empty(4, 1, heads, 512, dtype=torch.bfloat16), torch.empty(4, 1, heads))
    kind, spec = keys[-1]
    assert ("qpf" in spec) is want
    assert kind == ("partial_wgmma_seesaw_balanced" if split == "balanced" else "partial_wgmma_seesaw")
    assert launched == ["balanced" if split == "balanced" else "even"]


def test_off_keeps_the_plan_keywords_of_before(monkeypatch):
    _, planned = _plan(monkeypatch, CuteDslOptions(q_prefetch=False), [3000, 17, 0, 4096])
    assert planned.run_fn.keywords == {"tma": True, "lazy_rescale": True}
