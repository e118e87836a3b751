"""Host tests (CPU) of the backend option fp8_loader=ring (the default since the twenty-third session) / ring_staged
(branch fp8p-inflight): wherever the producer
warpgroup runs (an fp8 cache on the seesaw, even or balanced with FP8_BALANCED_PRODUCER) the plan's entry gets
fp8_producer=True and fp8p_ring=fp8p_ring.RING_DEFAULT (ring_staged also fp8p_stage=fp8p_ring.STAGE_SLOTS); producer / inline plans are unchanged (no fp8p_ring keyword); a bf16 cache and
other kernels ignore it; the plan's log line names the ring; with FP8_BALANCED_PRODUCER off the balanced seesaw
converts inline and says that fp8_loader=ring is ignored."""

from __future__ import annotations

import pytest
import torch

from test_backend_host import _cpu_session, prob  # noqa: E402  (same directory)

from mla_cute_dsl import backend as be
from mla_cute_dsl.backend import CuteDslOptions
from mla_cute_dsl.kernels.fp8p_ring import RING_DEFAULT, STAGE_SLOTS
from mlacore import StepInputs


def test_option_fp8_loader_ring_is_valid_and_is_the_default():
    assert CuteDslOptions().fp8_loader == "ring"
    assert CuteDslOptions(fp8_loader="ring").fp8_loader == "ring"
    assert CuteDslOptions(fp8_loader="ring_staged").fp8_loader == "ring_staged"
    assert "ring (default since the twenty-third session)" in CuteDslOptions.model_fields["fp8_loader"].description
    assert RING_DEFAULT == 7
    fp8 = prob(num_heads=128, kv_dtype="fp8_e4m3")
    assert be.seesaw_fp8p_ring(fp8, CuteDslOptions()) == 7 and be.seesaw_fp8p_stage(fp8, CuteDslOptions()) == 0
    assert be.kernel_summary(fp8, CuteDslOptions()) == (
        "seesaw kernel, balanced split-KV (seesaw_split=balanced: per step the balanced or the even plan, whichever "
        "is predicted >= 10% faster) with an fp8 cache (FP8_SEESAW_BALANCED; the plan's cost model was measured with "
        "16-bit caches), lazy softmax rescale (rescale=lazy), a producer warpgroup with a 7-chunk register ring "
        "converts the fp8 cache (fp8_loader=ring), warpgroup 1's QK waits the other warpgroup's part of its tile "
        "first (wg1_other_first)")


def test_the_default_plan_runs_the_ring(monkeypatch):
    """The default options (fp8_loader=ring, FP8_BALANCED_PRODUCER on) plan an fp8 cache at H=128 s_q=1 onto the
    balanced seesaw entry with the producer warpgroup and its 7-chunk ring."""
    table = torch.zeros(4, 64, dtype=torch.int32)
    lens = torch.tensor([3000, 17, 0, 4096], dtype=torch.int32)
    problem = prob(num_heads=128, seq_len_q=1, batch_size=4, kv_dtype="fp8_e4m3")
    planned = _cpu_session(monkeypatch, CuteDslOptions(), heads=128, kv_dtype="fp8_e4m3").plan(
        problem, StepInputs(lens, table, lens, table))
    assert planned.kernel == "seesaw" and planned.balanced is True
    assert planned.run_fn.__name__ == "mla_decode_sm90_wgmma_seesaw_balanced"
    # and wg1_other_first (auto: on wherever the ring runs, since 0.2.21)
    assert planned.run_fn.keywords == {"lazy_rescale": True, "fp8_producer": True, "fp8p_ring": 7,
                                       "wg1_other_first": True}


def _plan(monkeypatch, loader, kv, heads=128, balanced_producer=True):
    monkeypatch.setattr(be, "FP8_BALANCED_PRODUCER", balanced_producer)
    table = torch.zeros(4, 64, dtype=torch.int32)
    lens = torch.tensor([3000, 17, 0, 4096], dtype=torch.int32)
    opts = CuteDslOptions(fp8_loader=loader)
    problem = prob(num_heads=heads, seq_len_q=1, batch_size=4, kv_dtype=kv)
    planned = _cpu_session(monkeypatch, opts, heads=heads, kv_dtype=kv).plan(problem, StepInputs(lens, table, lens,
                                                                                                  table))
    return planned, problem, opts


@pytest.mark.parametrize("loader", ["inline", "producer", "ring", "ring_staged"])
def test_fp8_loader_ring_reaches_the_balanced_seesaw_entry(monkeypatch, loader):
    planned, problem, opts = _plan(monkeypatch, loader, "fp8_e4m3")
    assert planned.kernel == "seesaw"
    assert planned.run_fn.__name__ == "mla_decode_sm90_wgmma_seesaw_balanced"
    want = {"lazy_rescale": True}
    if loader != "inline":
        want["fp8_producer"] = True
    if loader.startswith("ring"):
        want["fp8p_ring"] = RING_DEFAULT
    if loader == "ring_staged":
        want["fp8p_stage"] = STAGE_SLOTS
    if loader.startswith("ring"):  # wg1_other_first (auto): on wherever the ring runs
        want["wg1_other_first"] = True
    assert planned.run_fn.keywords == want
    assert be.seesaw_fp8p_ring(problem, opts) == (RING_DEFAULT if loader.startswith("ring") else 0)
    assert be.seesaw_fp8p_stage(problem, opts) == (STAGE_SLOTS if loader == "ring_staged" else 0)
    summary = be.kernel_summary(problem, opts)
    assert (f"{RING_DEFAULT}-chunk register ring" in summary
            and f"(fp8_loader={loader})" in summary) is loader.startswith("ring")
    assert ("shared-memory staging" in summary) is (loader == "ring_staged")
    assert ("(fp8_loader=producer)" in summary) is (loader == "producer")


def test_fp8_loader_ring_reaches_the_even_seesaw_entry(monkeypatch):
    """seesaw_split=even: the even fp8 seesaw with the ring."""
    monkeypatch.setattr(be, "FP8_BALANCED_PRODUCER", True)
    table = torch.zeros(4, 64, dtype=torch.int32)
    lens = torch.tensor([3000, 17, 0, 4096], dtype=torch.int32)
    opts = CuteDslOptions(fp8_loader="ring", seesaw_split="even")
    problem = prob(num_heads=128, seq_len_q=1, batch_size=4, kv_dtype="fp8_e4m3")
    planned = _cpu_session(monkeypatch, opts, heads=128, kv_dtype="fp8_e4m3").plan(
        problem, StepInputs(lens, table, lens, table))
    assert planned.run_fn.__name__ == "mla_decode_sm90_wgmma_seesaw"
    assert planned.run_fn.keywords == {"lazy_rescale": True, "fp8_producer": True, "fp8p_ring": RING_DEFAULT,
                                       "wg1_other_first": True}


@pytest.mark.parametrize("loader", ["ring", "ring_staged"])
def test_fp8_loader_ring_ignored_without_the_producer_or_an_fp8_cache(monkeypatch, loader):
    planned, problem, opts = _plan(monkeypatch, loader, "fp8_e4m3", balanced_producer=False)
    assert not {"fp8p_ring", "fp8p_stage", "fp8_producer"} & set(planned.run_fn.keywords)
    assert f"fp8_loader={loader} ignored" in be.kernel_summary(problem, opts)
    planned, problem, opts = _plan(monkeypatch, loader, "bf16")
    assert "fp8p_ring" not in getattr(planned.run_fn, "keywords", {})
    assert "fp8_loader" not in be.kernel_summary(problem, opts)
    planned, problem, opts = _plan(monkeypatch, loader, "fp8_e4m3", heads=16)
    assert planned.kernel != "seesaw" and "fp8p_ring" not in getattr(planned.run_fn, "keywords", {})
