"""Host tests (CPU) of the backend option wg1_other_first (unset: auto): warpgroup 1's QK waits warpgroup 0's part of
its tile first and the loader fills the parts in that order (kernel option wg1_other_first, cache-key flag "wg1of").
Auto is on with an fp8 cache wherever the producer's register ring runs (0.97-0.99x the time through mla bench on an
H200, twenty-sixth session) and with a 16-bit cache from WG1OF_AUTO_MIN_ROWS (256) packed rows (0.957-1.006x at H=128
s_q=2 there, 1.015-1.026x at s_q=1); True turns it on for 16-bit caches below that; the fp8 seesaw without the ring and
every other kernel ignore it. Monkeypatched; nothing compiles."""

from __future__ import annotations

import pytest
import torch

from test_backend_host import prob  # noqa: E402  (same directory)
from test_seesaw_balanced_backend import _plan  # noqa: E402

from mla_cute_dsl import backend as be
from mla_cute_dsl.backend import CuteDslOptions


def test_option_default_auto_and_validated():
    assert CuteDslOptions().wg1_other_first is None
    assert CuteDslOptions(wg1_other_first=True).wg1_other_first is True
    with pytest.raises(ValueError, match="wg1_other_first"):
        CuteDslOptions(wg1_other_first="first")
    desc = CuteDslOptions.model_fields["wg1_other_first"].description
    assert "fp8_loader=ring" in desc and "from 256 packed rows" in desc
    assert be.WG1OF_AUTO_MIN_ROWS == 256  # H=128 s_q=2: where it was measured faster with a 16-bit cache


@pytest.mark.parametrize("opts,heads,s_q,kv,want", [
    ({}, 128, 1, "fp8_e4m3", True), ({}, 128, 2, "fp8_e4m3", True), ({}, 64, 1, "fp8_e4m3", True),
    ({"fp8_loader": "ring_staged"}, 128, 1, "fp8_e4m3", True), ({"seesaw_split": "even"}, 128, 1, "fp8_e4m3", True),
    ({"wg1_other_first": False}, 128, 1, "fp8_e4m3", False), ({"fp8_loader": "producer"}, 128, 1, "fp8_e4m3", False),
    ({"fp8_loader": "inline", "wg1_other_first": True}, 128, 1, "fp8_e4m3", False),
    ({}, 16, 1, "fp8_e4m3", False), ({"mma": "wgmma"}, 128, 1, "fp8_e4m3", False),
    ({}, 128, 1, "bf16", False), ({}, 16, 8, "bf16", False), ({}, 128, 2, "bf16", True), ({}, 64, 4, "fp16", True),
    ({"wg1_other_first": False}, 128, 2, "bf16", False), ({"wg1_other_first": True}, 128, 1, "bf16", True),
    ({"seesaw_split": "even"}, 128, 4, "bf16", True),
    ({"wg1_other_first": True, "tma_producer": False}, 128, 1, "bf16", True),
    ({"wg1_other_first": True, "loads": "cp_async"}, 64, 1, "fp16", True),
    ({"wg1_other_first": True}, 16, 1, "bf16", False), ({"wg1_other_first": True, "mma": "wgmma"}, 128, 1, "bf16", False)])
def test_auto_rule_and_what_ignores_it(opts, heads, s_q, kv, want):
    o = CuteDslOptions(**opts)
    q_dt = "fp16" if kv == "fp16" else "bf16"
    shape = prob(num_heads=heads, seq_len_q=s_q, kv_dtype=kv, q_dtype=q_dt)
    assert be.seesaw_wg1_other_first(shape, o) is want
    summary = be.kernel_summary(shape, o)
    assert ("(wg1_other_first)" in summary) is want
    # asked for where the fp8 seesaw cannot take it: said so, not silently dropped
    asked_in_vain = o.wg1_other_first is True and not want and be.partial_kernel(shape, o) == "seesaw"
    assert ("wg1_other_first=true ignored" in summary) is asked_in_vain


def test_the_ignored_note_names_what_keeps_the_ring_off(monkeypatch):
    """wg1_other_first=true on an fp8 seesaw without the ring: the summary says which setting keeps the ring off (the
    loader option, or with fp8_loader=ring the module flag that keeps the balanced seesaw's producer off)."""
    fp8 = prob(num_heads=128, kv_dtype="fp8_e4m3")
    inline = be.kernel_summary(fp8, CuteDslOptions(wg1_other_first=True, fp8_loader="inline"))
    assert "wg1_other_first=true ignored" in inline and inline.endswith("fp8_loader=ring / ring_staged)")
    monkeypatch.setattr(be, "FP8_BALANCED_PRODUCER", False)
    ring = be.kernel_summary(fp8, CuteDslOptions(wg1_other_first=True))
    assert not be.seesaw_wg1_other_first(fp8, CuteDslOptions(wg1_other_first=True))
    assert "wg1_other_first=true ignored" in ring and "FP8_BALANCED_PRODUCER" in ring.split("wg1_other_first=true")[1]


@pytest.mark.parametrize("opts,kv,s_q,want", [({}, "fp8_e4m3", 1, True), ({"wg1_other_first": False}, "fp8_e4m3", 1, False),
                                              ({"fp8_loader": "producer"}, "fp8_e4m3", 1, False), ({}, "bf16", 1, False),
                                              ({}, "bf16", 2, True), ({"wg1_other_first": False}, "bf16", 2, False),
                                              ({"wg1_other_first": True}, "bf16", 1, True)])
def test_the_plan_asks_the_kernel_cache_for_the_wg1of_kernel(monkeypatch, opts, kv, s_q, want):
    from mla_cute_dsl.kernels import api, kernel_cache

    keys, launched = [], []
    monkeypatch.setattr(kernel_cache, "get_or_build", lambda kind, spec, build: keys.append((kind, spec)) or "k")
    monkeypatch.setattr(api, "launch_balanced", lambda partial, *a: launched.append("balanced"))
    monkeypatch.setattr(api, "launch", lambda partial, *a: launched.append("even"))
    _, planned = _plan(monkeypatch, CuteDslOptions(**opts), [3000, 17, 0, 4096], heads=128, s_q=s_q, kv=kv)
    assert planned.kernel == "seesaw" and planned.balanced
    assert getattr(planned.run_fn, "keywords", {}).get("wg1_other_first", False) is want
    cache = torch.zeros(4, 64, 576, dtype=torch.float8_e4m3fn if kv == "fp8_e4m3" else torch.bfloat16)
    planned.run(torch.zeros(4, s_q, 128, 576, dtype=torch.bfloat16), cache,
                torch.empty(4, s_q, 128, 512, dtype=torch.bfloat16), torch.empty(4, s_q, 128))
    kind, spec = keys[-1]
    assert kind == "partial_wgmma_seesaw_balanced" and ("wg1of" in spec) is want
    if kv == "fp8_e4m3" and opts.get("fp8_loader") != "producer":
        assert any(str(f).startswith("fp8pr") for f in spec)  # the ring it rides on
    assert launched == ["balanced"]
