"""The DeepSeek-V3 engine example against transformers (CPU, reference backend; GPU when present)."""

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the example compares against transformers' DeepSeek-V3")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import deepseek_decode  # noqa: E402


def test_cpu_matches_transformers_token_for_token(monkeypatch):
    monkeypatch.setenv("MLA_BACKENDS", "reference")
    report = deepseek_decode.run_checks("cpu", steps=32)
    assert report.backend == "reference"
    assert report.tokens_equal
    # fp32 throughout: logits agree to rounding (scale ~7)
    assert report.max_logit_diff < 1e-3, report.lines()
    assert report.tp_max_diff < 1e-5 and set(report.tp_backends) == {"reference"}
    assert report.spec_max_diff < 1e-3


def test_engine_cache_is_paged_with_shuffled_pages():
    model = deepseek_decode.build_model("cpu", num_layers=1)
    engine = deepseek_decode.MLAEngine(model, "cpu", torch.float32, num_pages=16, seed=3)
    engine.add_request(0)
    engine.forward([0], torch.tensor([[5, 6, 7] * 7]))  # 21 tokens: two pages
    pages = engine.requests[0].pages
    assert len(pages) == 2 and pages != [0, 1]  # ids come from a shuffled free list
    cache = engine.cache.layers[0]
    assert torch.isfinite(cache[pages[0]]).all()
    assert torch.isfinite(cache[pages[1], :5]).all() and torch.isnan(cache[pages[1], 5:]).all()


@pytest.mark.gpu
def test_gpu_matches_transformers():
    report = deepseek_decode.run_checks("cuda", steps=32)
    assert report.tokens_equal, report.lines()
    assert len(set(report.tp_backends)) == 1
    # bf16 attention inside an fp32 model: logits agree to ~1% of their spread
    assert report.max_logit_diff < 0.1 * report.logit_scale, report.lines()
    assert report.spec_max_diff < 0.1 * report.logit_scale, report.lines()
