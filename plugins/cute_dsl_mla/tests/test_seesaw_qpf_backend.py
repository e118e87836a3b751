"""Host tests (CPU) of the backend option q_prefetch: unset (None, "auto") by default since the twenty-third session
(measured on an H200): on up to backend.QPF_AUTO_MAX_ROWS (128) packed rows (s_q * num_heads), off above; True / False
force it. Off gives the plan keywords, summary and kernels of before; on, the balanced seesaw with a bf16/fp16 cache
gets q_prefetch=True at its entry, which asks the balanced getter for the "qpf" kernel; the even seesaw
(seesaw_split=even), fp8 caches and the other kernels ignore it. Monkeypatched; nothing compiles."""

from __future__ import annotations

import pytest
import torch

from test_backend_host import prob  # noqa: E402  (same directory)
from test_seesaw_balanced_backend import _plan  # noqa: E402

from mla_cute_dsl import backend as be
from mla_cute_dsl.backend import CuteDslOptions


def _opts(**kw) -> CuteDslOptions:
    """The options under test with tma_producer=False: where the TMA producer runs (its default, the balanced seesaw
    with TMA loads) it fetches ahead itself and q_prefetch does not run (test_seesaw_tmap_backend.py); and
    wg1_other_first=False, whose own clause (auto: from 256 rows) test_seesaw_wg1of_backend.py checks."""
    return CuteDslOptions(**{"tma_producer": False, "wg1_other_first": False, **kw})


def test_option_default_auto_and_validated():
    assert CuteDslOptions().q_prefetch is None  # auto: on up to QPF_AUTO_MAX_ROWS packed rows
    assert be.QPF_AUTO_MAX_ROWS == 128
    assert _opts(q_prefetch=True).q_prefetch is True
    assert _opts(q_prefetch=False).q_prefetch is False  # `mla bench --backend cute_dsl_mla:q_prefetch=false`
    with pytest.raises(ValueError, match="q_prefetch"):
        _opts(q_prefetch="sometimes")
    assert be.seesaw_q_prefetch(prob(num_heads=128), _opts())  # 128 rows: on under auto
    assert "(q_prefetch)" in be.kernel_summary(prob(num_heads=128), _opts())
    assert not be.seesaw_q_prefetch(prob(num_heads=128, seq_len_q=2), _opts())  # 256 rows: off
    assert "(q_prefetch)" not in be.kernel_summary(prob(num_heads=128, seq_len_q=2), _opts())
    assert not be.seesaw_q_prefetch(prob(num_heads=128), _opts(q_prefetch=False))
    assert "(q_prefetch)" not in be.kernel_summary(prob(num_heads=128), _opts(q_prefetch=False))


@pytest.mark.parametrize("heads,kv,split,want", [
    (128, "bf16", "balanced", True), (64, "bf16", "balanced", True), (128, "fp16", "balanced", True),
    (128, "bf16", "even", False), (128, "fp8_e4m3", "balanced", False), (16, "bf16", "balanced", False)])
def test_on_reaches_only_the_balanced_16_bit_seesaw(monkeypatch, heads, kv, split, want):
    from mla_cute_dsl.kernels import api, kernel_cache, sm90_wgmma_decode

    opts = _opts(q_prefetch=True, seesaw_split=split)
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
    _, planned = _plan(monkeypatch, _opts(q_prefetch=False), [3000, 17, 0, 4096])
    assert planned.run_fn.keywords == {"tma": True, "lazy_rescale": True}


# the summary's tail for the balanced 16-bit seesaw under loads=auto, without and with q_prefetch
LOADS = "lazy softmax rescale (rescale=lazy), TMA KV loads (loads=auto: TMA from 17 rows)"
QPF = ", the next work item's Q and KV tiles 0/1 issued during the current one (q_prefetch)"


@pytest.mark.parametrize("q_prefetch,heads,s_q,want", [
    # auto (unset, the default): on up to 128 packed rows ...
    (None, 128, 1, True), (None, 64, 2, True), (None, 32, 4, True), (None, 16, 8, True), (None, 126, 1, True),
    (None, 16, 3, True),
    # (and at 17-32 rows, where auto gives the balanced seesaw since 0.2.23)
    (None, 16, 2, True), (None, 17, 1, True),
    # ... off from 129
    (None, 43, 3, False), (None, 128, 2, False), (None, 64, 3, False), (None, 64, 4, False), (None, 126, 2, False),
    # True / False force it either way
    (True, 128, 2, True), (True, 64, 4, True), (False, 64, 1, False), (False, 128, 1, False)])
def test_auto_rule_on_up_to_128_packed_rows_off_from_129(monkeypatch, q_prefetch, heads, s_q, want):
    """q_prefetch unset (the default): the balanced bf16 seesaw at s_q * num_heads <= 128 gets q_prefetch=True at
    its entry and the q_prefetch clause in its summary, from 129 rows neither; q_prefetch=True forces it on at 256
    rows, False off at 64 and 128."""
    opts = _opts() if q_prefetch is None else _opts(q_prefetch=q_prefetch)
    assert opts.q_prefetch is q_prefetch
    shape = prob(num_heads=heads, seq_len_q=s_q)
    if q_prefetch is None:  # the parametrization's rows sit on the side of 128 they claim
        assert (heads * s_q <= 128) is want
    assert be.seesaw_q_prefetch(shape, opts) is want
    assert be.kernel_summary(shape, opts) == (
        "seesaw kernel, balanced split-KV (seesaw_split=balanced: per step the balanced or the even plan, whichever "
        "is predicted >= 10% faster), " + LOADS + (QPF if want else ""))
    _, planned = _plan(monkeypatch, opts, [3000, 17, 0, 4096], heads=heads, s_q=s_q)
    assert planned.kernel == "seesaw" and planned.balanced is True
    assert planned.run_fn.__name__ == "mla_decode_sm90_wgmma_seesaw_balanced"
    assert planned.run_fn.keywords == ({"tma": True, "lazy_rescale": True, "q_prefetch": True} if want
                                       else {"tma": True, "lazy_rescale": True})
