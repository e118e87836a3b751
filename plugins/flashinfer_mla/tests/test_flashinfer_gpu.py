"""flashinfer_mla on a GPU against the fp64 reference (skipped without CUDA)."""

import pytest
import torch

from mlacore import MLADecoder, MLAInputError
from mlacore.problem import DecodeProblem, DeviceSpec
from mlacore.testing import check_backend, compare, make_inputs, only_backend_dispatcher, reference_outputs
from mlacore.testing.conformance import BackendConformance

pytestmark = pytest.mark.gpu


def _needs(variant):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if variant not in variants_here():
        pytest.skip(f"{variant} does not run on this GPU")


class TestFa3Conformance(BackendConformance):
    backend = "flashinfer_mla"
    options = {"variant": "fa3"}
    device = "cuda"
    num_heads = (8, 16, 64, 128)
    seq_lens_q = (1, 2, 4)
    page_sizes = (1, 16, 64)
    max_kv_len = 2000

    def _require_device(self):
        _needs("fa3")


class TestFa2Conformance(TestFa3Conformance):
    options = {"variant": "fa2"}

    def _require_device(self):
        _needs("fa2")


def dev():
    return DeviceSpec.of("cuda")


def variants_here():
    cap = torch.cuda.get_device_capability()
    return ["fa3", "fa2"] if cap == (9, 0) else ["fa2"]


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8_e4m3"])
@pytest.mark.parametrize("page", [1, 16, 64])
@pytest.mark.parametrize("s_q", [1, 2, 4])
@pytest.mark.parametrize("heads", [8, 16, 32, 64, 128])
def test_fa_matches_reference(heads, s_q, page, kv_dtype):
    max_len = 8192 if page > 1 else 1500
    problem = DecodeProblem(num_heads=heads, seq_len_q=s_q, batch_size=5, min_kv_len=s_q, max_kv_len=max_len,
                            page_size=page, kv_dtype=kv_dtype, device=dev())
    for i, variant in enumerate(variants_here()):
        res = check_backend("flashinfer_mla", problem, device="cuda", seed=heads * 100 + s_q * 10 + page + i,
                            options={"variant": variant})
        assert res.passed, (variant, res.messages)


@pytest.mark.parametrize("variant", ["fa3", "fa2"])
def test_zero_length_requests(variant):
    if variant not in variants_here():
        pytest.skip(f"{variant} does not run on this GPU")
    problem = DecodeProblem(num_heads=16, seq_len_q=1, batch_size=4, min_kv_len=0, max_kv_len=300, page_size=16,
                            device=dev())
    inputs = make_inputs(problem, device="cuda", seed=5, kv_lens=torch.tensor([0, 300, 0, 17]))
    res = check_backend("flashinfer_mla", problem, device="cuda", options={"variant": variant}, inputs=inputs)
    assert res.passed, res.messages


def test_plan_reused_across_layers_and_stale_plans_refused():
    problem = DecodeProblem(num_heads=16, batch_size=3, min_kv_len=1, max_kv_len=700, page_size=64, device=dev())
    inp = make_inputs(problem, device="cuda", seed=9)
    disp = only_backend_dispatcher("flashinfer_mla")
    dec = MLADecoder(16, 64, device="cuda", sm_scale=inp.sm_scale, dispatcher=disp)
    plan = dec.plan(inp.kv_lens, inp.page_table)
    ref = reference_outputs(problem, inp)
    for _ in range(3):  # one plan, several layers
        out, lse = dec.run(inp.q, inp.kv_cache, plan)
        assert compare(problem, out, lse, *ref).passed
    newer = dec.plan(inp.kv_lens, inp.page_table)
    with pytest.raises(MLAInputError, match="replaced by a later plan"):
        dec.run(inp.q, inp.kv_cache, plan)
    dec.run(inp.q, inp.kv_cache, newer)


def test_cuda_graph_capture_and_replay_after_replan():
    problem = DecodeProblem(num_heads=16, seq_len_q=2, batch_size=4, min_kv_len=2, max_kv_len=2000, page_size=64,
                            device=dev())
    inp = make_inputs(problem, device="cuda", seed=11)
    disp = only_backend_dispatcher("flashinfer_mla")
    dec = MLADecoder(16, 64, device="cuda", sm_scale=inp.sm_scale, dispatcher=disp, cuda_graph=True,
                     max_batch=8, max_kv_len=4096)
    out = torch.empty(4, 2, 16, 512, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(4, 2, 16, dtype=torch.float32, device="cuda")
    q = inp.q.clone()
    plan = dec.plan(inp.kv_lens, inp.page_table, seq_len_q=2)
    dec.run(q, inp.kv_cache, plan, out=out, lse=lse)  # warm up outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dec.run(q, inp.kv_cache, plan, out=out, lse=lse)
    eager_out, eager_lse = dec.run(q, inp.kv_cache, plan)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager_out) and torch.equal(lse, eager_lse)
    # next step: new lengths, same batch size; re-plan, then replay the same graph
    new_lens = torch.clamp(inp.kv_lens.cpu() - 5, min=2).to(torch.int32)
    problem2 = problem.model_copy(update={"max_kv_len": int(new_lens.max()), "min_kv_len": int(new_lens.min())})
    dec.plan(new_lens.cuda(), inp.page_table, seq_len_q=2)
    q.copy_(torch.randn_like(q, dtype=torch.float32).to(q.dtype))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    inp2 = type(inp)(q=q, kv_cache=inp.kv_cache, page_table=inp.page_table, kv_lens=new_lens.cuda(),
                     kv_scale=inp.kv_scale, sm_scale=inp.sm_scale)
    res = compare(problem2, out, lse, *reference_outputs(problem2, inp2))
    assert res.passed, res.messages


def test_cuda_graph_buffers_are_enforced():
    problem = DecodeProblem(num_heads=16, batch_size=2, min_kv_len=10, max_kv_len=100, page_size=16, device=dev())
    inp = make_inputs(problem, device="cuda", seed=12)
    dec = MLADecoder(16, 16, device="cuda", dispatcher=only_backend_dispatcher("flashinfer_mla"), cuda_graph=True,
                     max_batch=4, max_kv_len=256)
    dec.plan(inp.kv_lens, inp.page_table)
    wider = torch.arange(2 * 40, dtype=torch.int32, device="cuda").reshape(2, 40) % inp.kv_cache.shape[0]
    with pytest.raises(MLAInputError, match="envelope max_kv_len=256"):
        dec.plan(torch.tensor([600, 600], dtype=torch.int32, device="cuda"), wider)
    with pytest.raises(MLAInputError, match="envelope max_batch=4"):
        dec.plan(torch.full((5,), 10, dtype=torch.int32, device="cuda"),
                 torch.zeros(5, 2, dtype=torch.int32, device="cuda"))
    # a wide table whose extra columns are beyond every length still plans (buffers come from the envelope)
    dec.plan(torch.tensor([200, 256], dtype=torch.int32, device="cuda"), wider)


def test_mla_check_cli_passes():
    from mlacore.tools.cli import main

    assert main(["check", "--backend", "flashinfer_mla", "--quick", "--device", "cuda"]) == 0


@pytest.mark.parametrize("variant", ["fa3", "fa2"])
@pytest.mark.parametrize("s_q", [2, 4])
def test_requests_shorter_than_the_query(variant, s_q):
    """Rows that see no kv position (len 0, or len < s_q for the first queries) must give 0 and -inf."""
    if variant not in variants_here():
        pytest.skip(f"{variant} does not run on this GPU")
    problem = DecodeProblem(num_heads=16, seq_len_q=s_q, batch_size=4, min_kv_len=0, max_kv_len=200, page_size=16,
                            device=dev())
    inputs = make_inputs(problem, device="cuda", seed=6, kv_lens=torch.tensor([0, 1, 200, s_q - 1]))
    res = check_backend("flashinfer_mla", problem, device="cuda", options={"variant": variant}, inputs=inputs)
    assert res.passed, res.messages


@pytest.mark.parametrize("heads", [1, 2, 4])
def test_few_heads(heads):
    problem = DecodeProblem(num_heads=heads, seq_len_q=2, batch_size=3, min_kv_len=2, max_kv_len=900, page_size=64,
                            device=dev())
    for variant in variants_here():
        res = check_backend("flashinfer_mla", problem, device="cuda", seed=heads, options={"variant": variant})
        assert res.passed, (variant, res.messages)


def test_mla_check_full_grid_passes():
    from mlacore.tools.cli import main

    assert main(["check", "--backend", "flashinfer_mla", "--device", "cuda"]) == 0


def _fi_decoder(variant, launch, inp, kv_dtype, **kw):
    from mlacore import Dispatcher, parse_policy

    d = Dispatcher(policy=parse_policy({"mla": {"order": ["flashinfer_mla"], "fallback": "error"},
                                        "backend": {"flashinfer_mla": {"options": {"variant": variant,
                                                                                    "launch": launch}}}}), env={})
    return MLADecoder(inp.q.shape[2], inp.kv_cache.shape[1], kv_dtype=inp.kv_cache.dtype, device="cuda",
                      sm_scale=inp.sm_scale, kv_scale=inp.kv_scale if kv_dtype == "fp8_e4m3" else 1.0,
                      dispatcher=d, **kw)


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8_e4m3"])
@pytest.mark.parametrize("s_q", [1, 2])
@pytest.mark.parametrize("variant", ["fa3", "fa2"])
def test_direct_launch_equals_wrapper_run(variant, s_q, kv_dtype):
    """launch="direct" calls the planned launcher with arguments fixed at plan; it must give exactly what
    FlashInfer's wrapper.run gives, for packed, split and strided inputs, and match the fp64 reference."""
    _needs(variant)
    p = DecodeProblem(num_heads=16, seq_len_q=s_q, batch_size=6, min_kv_len=0, max_kv_len=3000, page_size=64,
                      kv_dtype=kv_dtype, device=dev())
    inp = make_inputs(p, device="cuda", seed=71 + s_q, kv_lens=torch.tensor([0, 3000, 1, 700, s_q, 129]))
    ref = reference_outputs(p, inp)
    results = {}
    for launch in ("wrapper", "direct"):
        dec = _fi_decoder(variant, launch, inp, kv_dtype)
        plan = dec.plan(inp.kv_lens, inp.page_table, s_q)
        assert (plan.planned.direct is not None) == (launch == "direct"), "the direct launcher was not found"
        out = torch.full((6, s_q, 16, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
        lse = torch.full((6, s_q, 16), float("nan"), device="cuda")
        dec.run(inp.q, inp.kv_cache, plan, out=out, lse=lse)
        strided = []
        for width in (704, 700):  # q as a slice of a wider buffer: 16-byte aligned rows, and not (copied)
            wide = torch.randn(6, s_q, 16, width, dtype=inp.q.dtype, device="cuda")
            wide[..., :576] = inp.q
            strided += dec.run(wide[..., :576], inp.kv_cache, plan)
        results[launch] = (out.clone(), lse.clone(), *strided)
        res = compare(p, out, lse, *ref)
        assert res.passed, (launch, res.messages)
        dec.close()
    for a, b in zip(results["wrapper"], results["direct"]):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    for i in (2, 4):
        torch.testing.assert_close(results["direct"][0], results["direct"][i], rtol=0, atol=0)


def test_direct_launch_split_inputs_strided_and_graph_replay():
    """Split q with a strided q_nope (as after the W_UK bmm) and split cache through the direct launcher,
    captured in a CUDA graph: replay equals eager and the fp64 reference after the data changes."""
    _needs("fa3" if "fa3" in variants_here() else "fa2")
    p = DecodeProblem(num_heads=16, seq_len_q=1, batch_size=4, min_kv_len=1, max_kv_len=900, page_size=64,
                      device=dev())
    inp = make_inputs(p, device="cuda", seed=77)
    dec = _fi_decoder(variants_here()[0], "direct", inp, "bf16", q_layout="split", kv_layout="split",
                      cuda_graph=True, max_batch=4, max_kv_len=1024)
    plan = dec.plan(inp.kv_lens, inp.page_table, 1)
    heads_first = torch.empty(16, 4, 1, 512, dtype=inp.q.dtype, device="cuda")
    q_nope = heads_first.permute(1, 2, 0, 3)  # strided, last dimension contiguous
    q_pe = torch.empty(4, 1, 16, 64, dtype=inp.q.dtype, device="cuda")
    ckv, kpe = inp.kv_cache[..., :512].contiguous(), inp.kv_cache[..., 512:].contiguous()
    q_nope.copy_(inp.q[..., :512])
    q_pe.copy_(inp.q[..., 512:])
    out = torch.empty(4, 1, 16, 512, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(4, 1, 16, device="cuda")
    dec.run((q_nope, q_pe), (ckv, kpe), plan, out=out, lse=lse)  # warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dec.run((q_nope, q_pe), (ckv, kpe), plan, out=out, lse=lse)
    new_q = torch.randn_like(inp.q) * 3
    q_nope.copy_(new_q[..., :512])
    q_pe.copy_(new_q[..., 512:])
    graph.replay()
    torch.cuda.synchronize()
    eager_out, eager_lse = dec.run((q_nope, q_pe), (ckv, kpe), plan)
    torch.testing.assert_close(out, eager_out, rtol=0, atol=0)
    torch.testing.assert_close(lse, eager_lse, rtol=0, atol=0)
    from mlacore.reference import mla_decode_reference

    want = mla_decode_reference(new_q, inp.kv_cache, inp.page_table, inp.kv_lens, inp.sm_scale, 1.0)
    res = compare(p, out, lse, *want)
    assert res.passed, res.messages
