"""The torch.library custom op: eager result, and tracing through torch.compile via the fake."""

import torch

import mlacore.ops  # noqa: F401  (registers torch.ops.mlacore.mla_decode)
from mlacore.testing import compare, make_inputs, reference_outputs
from mlacore.problem import DecodeProblem

PROBLEM = DecodeProblem(num_heads=4, seq_len_q=2, batch_size=2, min_kv_len=3, max_kv_len=40, page_size=16)


def test_op_eager_matches_reference(monkeypatch):
    monkeypatch.setenv("MLA_BACKENDS", "reference")
    inp = make_inputs(PROBLEM, seed=21)
    out, lse = torch.ops.mlacore.mla_decode(inp.q, inp.kv_cache, inp.page_table, inp.kv_lens,
                                            inp.sm_scale, inp.kv_scale, True)
    res = compare(PROBLEM, out, lse, *reference_outputs(PROBLEM, inp))
    assert res.passed, res.messages


def test_op_fake_gives_shapes():
    inp = make_inputs(PROBLEM, seed=22)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fq, fc, ft, fl = (mode.from_tensor(t) for t in (inp.q, inp.kv_cache, inp.page_table, inp.kv_lens))
        out, lse = torch.ops.mlacore.mla_decode(fq, fc, ft, fl, 0.1, 1.0, True)
    assert out.shape == (2, 2, 4, 512) and out.dtype == torch.bfloat16
    assert lse.shape == (2, 2, 4) and lse.dtype == torch.float32


def test_torch_compile_traces_a_model_calling_the_op(monkeypatch):
    monkeypatch.setenv("MLA_BACKENDS", "reference")
    inp = make_inputs(PROBLEM, seed=23)
    proj = torch.nn.Linear(512, 8, dtype=torch.bfloat16)

    def layer(q, cache, table, lens):
        out, _ = torch.ops.mlacore.mla_decode(q, cache, table, lens, inp.sm_scale, 1.0, True)
        return proj(out * 2)

    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    got = compiled(inp.q, inp.kv_cache, inp.page_table, inp.kv_lens)
    want = layer(inp.q, inp.kv_cache, inp.page_table, inp.kv_lens)
    torch.testing.assert_close(got, want)


def test_opcheck():
    inp = make_inputs(PROBLEM, seed=24, poison=False)
    torch.library.opcheck(torch.ops.mlacore.mla_decode.default,
                          (inp.q, inp.kv_cache, inp.page_table, inp.kv_lens, 0.1, 1.0, True),
                          test_utils=("test_schema", "test_faketensor"))
