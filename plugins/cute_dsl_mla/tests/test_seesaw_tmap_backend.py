"""Host tests (CPU) of the backend option tma_producer (unset: auto, on by default since the twenty-fourth session,
measured on an H200): the balanced seesaw with TMA loads and a bf16/fp16 cache runs its TMA producer warpgroup
(kernel option tma_producer, cache-key flag "tmap"), and q_prefetch then does not run; False gives 0.2.18's kernels;
the even seesaw, cp.async loads, fp8 caches and the other kernels ignore it. Monkeypatched; nothing compiles."""

from __future__ import annotations

import pytest
import torch

from test_backend_host import prob  # noqa: E402  (same directory)
from test_seesaw_balanced_backend import _plan  # noqa: E402

from mla_cute_dsl import backend as be
from mla_cute_dsl.backend import CuteDslOptions


def test_option_default_auto_and_validated():
    assert CuteDslOptions().tma_producer is None
    assert CuteDslOptions(tma_producer=False).tma_producer is False
    with pytest.raises(ValueError, match="tma_producer"):
        CuteDslOptions(tma_producer="sometimes")
    desc = CuteDslOptions.model_fields["tma_producer"].description
    assert "producer warpgroup" in desc and "q_prefetch is then ignored" in desc


@pytest.mark.parametrize("opts,heads,s_q,kv,want", [
    ({}, 128, 1, "bf16", True), ({}, 128, 2, "bf16", True), ({}, 16, 3, "bf16", True), ({}, 64, 1, "fp16", True),
    ({"q_prefetch": True}, 128, 1, "bf16", True), ({"tma_producer": False}, 128, 1, "bf16", False),
    ({"loads": "cp_async"}, 128, 1, "bf16", False), ({"seesaw_split": "even"}, 128, 2, "bf16", False),
    ({"ctas_per_sm": 2}, 128, 2, "bf16", False), ({}, 128, 1, "fp8_e4m3", False), ({}, 16, 1, "bf16", False),
    ({"mma": "wgmma"}, 128, 1, "bf16", False)])
def test_auto_rule_and_what_ignores_it(opts, heads, s_q, kv, want):
    o = CuteDslOptions(**opts)
    q_dt = "fp16" if kv == "fp16" else "bf16"
    shape = prob(num_heads=heads, seq_len_q=s_q, kv_dtype=kv, q_dtype=q_dt)
    assert be.seesaw_tma_producer(shape, o) is want
    assert ("(tma_producer)" in be.kernel_summary(shape, o)) is want
    if want:  # the producer fetches ahead itself: no q_prefetch beside it, whatever the option says
        assert not be.seesaw_q_prefetch(shape, o)


@pytest.mark.parametrize("opts,want", [({}, True), ({"tma_producer": False}, False), ({"loads": "cp_async"}, False)])
def test_the_plan_asks_the_kernel_cache_for_the_tmap_kernel(monkeypatch, opts, want):
    from mla_cute_dsl.kernels import api, kernel_cache

    keys, launched = [], []
    monkeypatch.setattr(kernel_cache, "get_or_build", lambda kind, spec, build: keys.append((kind, spec)) or "k")
    monkeypatch.setattr(api, "launch_balanced", lambda partial, *a: launched.append("balanced"))
    monkeypatch.setattr(api, "launch", lambda partial, *a: launched.append("even"))
    _, planned = _plan(monkeypatch, CuteDslOptions(**opts), [3000, 17, 0, 4096], heads=128)
    kw = getattr(planned.run_fn, "keywords", {})
    assert kw.get("tma_producer", False) is want
    assert kw.get("q_prefetch", False) is (not want)  # 128 rows: q_prefetch's auto rule where the producer is off
    planned.run(torch.zeros(4, 1, 128, 576, dtype=torch.bfloat16), torch.zeros(4, 64, 576, dtype=torch.bfloat16),
                torch.empty(4, 1, 128, 512, dtype=torch.bfloat16), torch.empty(4, 1, 128))
    kind, spec = keys[-1]
    assert kind == "partial_wgmma_seesaw_balanced" and ("tmap" in spec) is want and ("qpf" in spec) is (not want)
    assert launched == ["balanced"]
