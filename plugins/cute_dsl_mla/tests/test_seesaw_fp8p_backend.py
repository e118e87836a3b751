"""Host tests (CPU) of the backend option fp8_loader (branch fp8-producer; default producer in 0.2.17, ring since the
twenty-third session: test_seesaw_fp8p_ring_backend.py): inline (the fp8 seesaw as in 0.2.16: no new keyword reaches
the entry); producer sends fp8_producer=True to the seesaw entry for an fp8 cache only; a bf16 cache (the balanced seesaw) and other kernels ignore it; the plan's log
line names producer for the fp8 seesaw (inline: the line as before)."""

from __future__ import annotations

import pytest
import torch

from test_backend_host import _cpu_session, prob  # noqa: E402  (same directory)

from mla_cute_dsl import backend as be
from mla_cute_dsl.backend import CuteDslOptions
from mlacore import StepInputs


def test_option_fp8_loader_default_and_validation():
    assert CuteDslOptions().fp8_loader == "ring"  # the default since the twenty-third session (producer: 0.2.17's)
    assert CuteDslOptions(fp8_loader="producer").fp8_loader == "producer"
    with pytest.raises(ValueError, match="fp8_loader"):
        CuteDslOptions(fp8_loader="warp")
    desc = CuteDslOptions.model_fields["fp8_loader"].description
    assert "ring (default since the twenty-third session)" in desc and "producer (0.2.17's default)" in desc


@pytest.mark.parametrize("loader", ["inline", "producer"])
@pytest.mark.parametrize("kv", ["fp8_e4m3", "bf16"])
def test_option_fp8_loader_reaches_the_seesaw_entry(monkeypatch, loader, kv):
    table = torch.zeros(4, 64, dtype=torch.int32)
    lens = torch.tensor([3000, 17, 0, 4096], dtype=torch.int32)
    opts = CuteDslOptions(fp8_loader=loader)
    problem = prob(num_heads=128, seq_len_q=1, batch_size=4, kv_dtype=kv)
    planned = _cpu_session(monkeypatch, opts, heads=128, kv_dtype=kv).plan(
        problem, StepInputs(lens, table, lens, table))
    assert planned.kernel == "seesaw"
    keywords = getattr(planned.run_fn, "keywords", {})
    assert keywords.get("fp8_producer", False) is (kv == "fp8_e4m3" and loader == "producer")
    if kv == "fp8_e4m3":
        assert planned.run_fn.__name__ == "mla_decode_sm90_wgmma_seesaw_balanced"  # since 0.2.17
        assert keywords == {"lazy_rescale": True} | ({"fp8_producer": True} if loader == "producer" else {})
        assert ("(fp8_loader=producer)" in be.kernel_summary(problem, opts)) is (loader == "producer")
        assert ("(fp8_loader=inline)" in be.kernel_summary(problem, opts)) is (loader == "inline")
    else:
        assert "fp8_loader" not in be.kernel_summary(problem, opts)
    small = prob(num_heads=16, seq_len_q=1, batch_size=4, kv_dtype=kv)
    other = _cpu_session(monkeypatch, opts, heads=16, kv_dtype=kv).plan(small, StepInputs(lens, table, lens, table))
    assert other.kernel != "seesaw" and "fp8_producer" not in getattr(other.run_fn, "keywords", {})
