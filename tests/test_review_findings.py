"""Regression tests for defects found in review (CPU)."""

from __future__ import annotations

import threading

import pytest

import torch

import mlacore.ops  # noqa: F401  (registers torch.ops.mlacore.*)
from mlacore import BackendRegistry, Dispatcher, MLADecoder
from mlacore.decoder import MLADecoder as _Decoder
from mlacore.policy import parse_policy_text
from mlacore.problem import DecodeProblem
from mlacore.reference_math import mla_decode_reference


def _reference_only(policy_text: str) -> Dispatcher:
    reg = BackendRegistry(env={"MLA_DISABLE_PLUGIN_AUTOLOAD": "1"}).load()
    return Dispatcher(policy=parse_policy_text(policy_text), registry=reg, env={})


REF_DENIED = """
[mla]
order = ["reference"]
fallback = "reference"
[backend.reference.options]
chunk_tokens = 7
[[backend.reference.deny]]
num_heads = [16]
"""


def test_fallback_to_a_reference_listed_in_the_order_carries_its_options():
    """The policy rejects the reference in the order, the fallback takes it: the decision must carry the
    reference's options (not None from the rejected verdict), and say it was chosen."""
    d = _reference_only(REF_DENIED)
    problem = DecodeProblem(num_heads=16, batch_size=2, max_kv_len=6, min_kv_len=5, page_size=64)
    decision = d.select(problem)
    assert decision.backend == "reference" and decision.fallback_used
    assert decision.options is not None and decision.options.chunk_tokens == 7
    assert decision.verdict("reference").outcome == "chosen"

    dec = MLADecoder(16, 64, q_dtype=torch.float32, dispatcher=d)
    lens = torch.tensor([5, 6], dtype=torch.int32)
    table = torch.zeros(2, 1, dtype=torch.int32)
    plan = dec.plan(lens, table)  # raised BackendError: 'NoneType' object has no attribute 'chunk_tokens'
    q = torch.randn(2, 1, 16, 576)
    kv = torch.randn(1, 64, 576)
    out, _ = dec.run(q, kv, plan)
    ref, _ = mla_decode_reference(q, kv, table, lens, dec.sm_scale)
    torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-4)


def test_one_call_op_is_safe_when_two_threads_share_its_decoder(monkeypatch):
    """`mlacore::mla_decode` shares one decoder per shape across the process: another thread's plan between
    this thread's plan and run must not make this call fail (or run the other thread's plan)."""
    torch.manual_seed(0)
    kv = torch.randn(8, 16, 576)
    b_planned = threading.Event()
    original_run, original_plan = _Decoder.run, _Decoder.plan
    main = threading.get_ident()
    results: dict = {}

    def call(lens, table, q, key):
        results[key] = torch.ops.mlacore.mla_decode(q, kv, table, lens, 0.1, 1.0, True)

    lens_a, table_a = torch.tensor([20, 3], dtype=torch.int32), torch.tensor([[1, 2], [3, 0]], dtype=torch.int32)
    lens_b, table_b = torch.tensor([9, 31], dtype=torch.int32), torch.tensor([[4, 0], [5, 6]], dtype=torch.int32)
    q_a, q_b = torch.randn(2, 1, 4, 576), torch.randn(2, 1, 4, 576)
    other = threading.Thread(target=call, args=(lens_b, table_b, q_b, "b"))

    def plan(self, *args, **kwargs):
        step = original_plan(self, *args, **kwargs)
        if threading.get_ident() != main:
            b_planned.set()
        elif not other.is_alive() and "b" not in results:
            other.start()  # the other thread calls the op right after this thread's plan
        return step

    def run(self, *args, **kwargs):
        if threading.get_ident() == main:
            b_planned.wait(0.5)  # give the other thread's plan the chance to come in between
        return original_run(self, *args, **kwargs)

    monkeypatch.setattr(_Decoder, "plan", plan)
    monkeypatch.setattr(_Decoder, "run", run)
    call(lens_a, table_a, q_a, "a")
    other.join(10)
    for key, (lens, table, q) in {"a": (lens_a, table_a, q_a), "b": (lens_b, table_b, q_b)}.items():
        ref, _ = mla_decode_reference(q, kv, table, lens, 0.1)
        torch.testing.assert_close(results[key][0].double(), ref, atol=1e-4, rtol=1e-4)


def test_trtllm_gen_run_takes_the_split_layouts_the_backend_info_promises(monkeypatch):
    """flashinfer_mla's info() lists split q and kv layouts, so a split decoder hands (q_nope, q_pe) and
    (ckv, kpe) to whatever variant runs; FlashInfer's trtllm-gen call takes one packed tensor of each."""
    import flashinfer.mla

    from mla_flashinfer.plugin import FlashInferBackend, TrtllmGenPlanned

    info = FlashInferBackend().info()
    assert "split" in info.q_layouts and "split" in info.kv_layouts
    seen = {}

    def fake(**kwargs):
        seen.update(kwargs)

    monkeypatch.setattr(flashinfer.mla, "trtllm_batch_decode_with_kv_cache_mla", fake)
    B, H = 2, 16
    planned = TrtllmGenPlanned(torch.zeros(8, dtype=torch.uint8), torch.ones(B, dtype=torch.int32),
                               torch.zeros(B, 1, dtype=torch.int32), 64, 0.1, 1.0, 1.0, B, H)
    q = torch.randn(B, 1, H, 576, dtype=torch.bfloat16)
    kv = torch.randn(3, 64, 576, dtype=torch.bfloat16)
    out = torch.empty(B, 1, H, 512, dtype=torch.bfloat16)
    lse = torch.empty(B, 1, H)
    planned.run((q[..., :512].contiguous(), q[..., 512:].contiguous()), (kv[..., :512], kv[..., 512:]), out, lse)
    assert isinstance(seen["query"], torch.Tensor) and torch.equal(seen["query"], q)
    assert isinstance(seen["kv_cache"], torch.Tensor) and torch.equal(seen["kv_cache"], kv)


def test_a_strided_packed_cache_and_strided_lengths_are_handled():
    """Kernels read the packed cache as compact rows: a strided one is refused by name; lengths are made compact."""
    import torch

    from mlacore import MLADecoder, MLAInputError, Dispatcher, parse_policy_text
    from mlacore.problem import DecodeProblem
    from mlacore.testing import compare, make_inputs, reference_outputs

    p = DecodeProblem(num_heads=4, seq_len_q=1, batch_size=3, min_kv_len=1, max_kv_len=40, page_size=16)
    inp = make_inputs(p, seed=41)
    d = Dispatcher(policy=parse_policy_text('[mla]\norder = ["reference"]\nfallback = "error"'), env={})
    dec = MLADecoder(4, 16, sm_scale=inp.sm_scale, dispatcher=d)
    strided_lens = torch.stack([inp.kv_lens, inp.kv_lens], dim=1)[:, 0]
    assert not strided_lens.is_contiguous()
    plan = dec.plan(strided_lens, inp.page_table)
    out, lse = dec.run(inp.q, inp.kv_cache, plan)
    assert compare(p, out, lse, *reference_outputs(p, inp)).passed
    wide = torch.zeros(inp.kv_cache.shape[0], 16, 600, dtype=inp.kv_cache.dtype)
    wide[..., :576] = inp.kv_cache
    with pytest.raises(MLAInputError, match="kv_cache: expected a contiguous tensor"):
        dec.run(inp.q, wide[..., :576], plan)


def test_the_one_call_op_keeps_a_bounded_number_of_decoders():
    import torch

    import mlacore.ops as ops
    from mlacore.problem import DecodeProblem
    from mlacore.testing import make_inputs

    p = DecodeProblem(num_heads=2, batch_size=1, min_kv_len=3, max_kv_len=3, page_size=16, kv_dtype="fp8_e4m3")
    inp = make_inputs(p, seed=42)
    for i in range(ops._MAX_ONE_CALL_DECODERS + 5):  # a new float kv_scale every call
        torch.ops.mlacore.mla_decode(inp.q, inp.kv_cache, inp.page_table, inp.kv_lens, 0.1, 0.01 + i * 1e-4)
    assert len(ops._decoders) <= ops._MAX_ONE_CALL_DECODERS
    assert len(ops._call_locks) == len(ops._decoders)
