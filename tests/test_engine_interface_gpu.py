"""The engine interface on a GPU: FlashInfer fa3/fa2 with split inputs and per-layer fp8 scales against
the fp64 reference, and the op pair under torch.compile(mode="reduce-overhead") equal to eager."""

import pytest
import torch

from mlacore import Dispatcher, MLADecoder, parse_policy_text
from mlacore.problem import DecodeProblem, DeviceSpec
from mlacore.reference import mla_decode_reference
from mlacore.testing import compare, make_inputs

pytestmark = pytest.mark.gpu


def fi_dispatcher(variant):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if variant == "fa3" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("fa3 needs sm_90")
    text = f'[mla]\norder = ["flashinfer_mla"]\nfallback = "error"\n[backend.flashinfer_mla.options]\nvariant = "{variant}"\n'
    return Dispatcher(policy=parse_policy_text(text), env={})


@pytest.mark.parametrize("variant", ["fa3", "fa2"])
@pytest.mark.parametrize("kv", ["bf16", "fp8_e4m3"])
def test_flashinfer_split_inputs_and_per_layer_scales(variant, kv):
    d = fi_dispatcher(variant)
    p = DecodeProblem(num_heads=16, seq_len_q=2, batch_size=5, min_kv_len=2, max_kv_len=1500, page_size=64,
                      kv_dtype=kv, device=DeviceSpec.of("cuda"))
    inp = make_inputs(p, device="cuda", seed=31)
    fp8 = kv == "fp8_e4m3"
    dec = MLADecoder(16, 64, kv_dtype=inp.kv_cache.dtype, device="cuda", sm_scale=inp.sm_scale, dispatcher=d,
                     q_layout="split", kv_layout="split", scale_inputs="float" if fp8 else "static")
    plan = dec.plan(inp.kv_lens, inp.page_table, 2)
    heads_first = inp.q[..., :512].permute(2, 0, 1, 3).contiguous()
    q = (heads_first.permute(1, 2, 0, 3), inp.q[..., 512:].contiguous())  # q_nope strided, as from a bmm
    kv_pair = (inp.kv_cache[..., :512].contiguous(), inp.kv_cache[..., 512:].contiguous())
    for factor in ((1.0, 0.5) if fp8 else (1.0,)):
        scale = inp.kv_scale * factor
        out, lse = dec.run(q, kv_pair, plan, **({"kv_scale": scale} if fp8 else {}))
        want = mla_decode_reference(inp.q, inp.kv_cache, inp.page_table, inp.kv_lens, inp.sm_scale, scale)
        res = compare(p, out, lse, *want)
        assert res.passed, (variant, kv, factor, res.messages)


def test_op_pair_under_reduce_overhead_equals_eager():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    import mlacore.ops as ops

    p = DecodeProblem(num_heads=16, seq_len_q=1, batch_size=4, min_kv_len=1, max_kv_len=700, page_size=64,
                      device=DeviceSpec.of("cuda"))
    inp = make_inputs(p, device="cuda", seed=32, extra_pages=64)
    dec = MLADecoder(16, 64, device="cuda", sm_scale=inp.sm_scale, cuda_graph=True, max_batch=4, max_kv_len=1024)
    handle = ops.register_decoder(dec)

    def layer(token, q, kv):
        out, lse = torch.ops.mlacore.run(handle, token, q, kv)
        return out.float() * 2.0, lse

    compiled = torch.compile(layer, mode="reduce-overhead", fullgraph=True)
    gen = torch.Generator().manual_seed(3)
    for step in range(4):  # re-plan before every call, outside the compiled region
        # at most each request's original length: make_inputs poisons page tails past it with NaN
        lens = (torch.rand(4, generator=gen) * inp.kv_lens.cpu()).to(torch.int32).clamp(min=1)
        token = torch.ops.mlacore.plan(handle, lens.cuda(), inp.page_table, 1)
        got = compiled(token, inp.q, inp.kv_cache)
        got = (got[0].clone(), got[1].clone())
        eager_plan = dec.plan(lens.cuda(), inp.page_table, 1)
        want_out, want_lse = dec.run(inp.q, inp.kv_cache, eager_plan)
        torch.testing.assert_close(got[0], want_out.float() * 2.0, rtol=0, atol=0)
        torch.testing.assert_close(got[1], want_lse, rtol=0, atol=0)


@pytest.mark.parametrize("num_heads,s_q", [(3, 2), (9, 2), (63, 2), (126, 2), (5, 3)])
def test_builtin_policy_runs_head_counts_flashinfer_refuses_on_a_kernel(num_heads, s_q):
    """The built-in policy's allow rules leave these shapes outside ours and FlashInfer refuses them (causal s_q > 1
    with num_heads not dividing 64 or 128): mla.strict_allow = false sends them to cute_dsl_mla, not the
    reference, and the answer matches the fp64 reference (fresh random data, mixed lengths including 0 and < s_q)."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm_90 GPU (the CuTe DSL kernels)")
    from mlacore.policy import builtin_policy_text

    d = Dispatcher(policy=parse_policy_text(builtin_policy_text(), "builtin"), env={})
    p = DecodeProblem(num_heads=num_heads, seq_len_q=s_q, batch_size=5, min_kv_len=0, max_kv_len=1500,
                      page_size=64, device=DeviceSpec.of("cuda"))
    # an empty request, one shorter than s_q, a page tail, a whole page count, the longest
    inp = make_inputs(p, device="cuda", seed=40 + num_heads,
                      kv_lens=torch.tensor([0, 1, 700, 1500, 1280], dtype=torch.int32))
    lens = inp.kv_lens
    dec = MLADecoder(num_heads, 64, device="cuda", sm_scale=inp.sm_scale, dispatcher=d)
    plan = dec.plan(lens, inp.page_table, s_q)
    assert plan.backend == "cute_dsl_mla", plan.decision.format_trace()
    assert "outside its allow rules" in plan.decision.verdict("cute_dsl_mla").reasons[0]
    out, lse = dec.run(inp.q, inp.kv_cache, plan)
    want = mla_decode_reference(inp.q, inp.kv_cache, inp.page_table, lens, inp.sm_scale, inp.kv_scale)
    res = compare(p, out, lse, *want)
    assert res.passed, (num_heads, s_q, res.messages)
