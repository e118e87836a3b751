"""GPU tests of the backend option split_kv="balanced" (the balanced mma.sync kernel with the hybrid plan),
through mlacore's MLADecoder, the path an engine takes.

* fp64 reference (mlacore.testing: fresh random inputs, shuffled page tables, NaN-poisoned unused pages and
  page tails, NaN-poisoned outputs) at H16 s_q 1 and 2, bf16: uniform lengths (the plan keeps the even
  form), skewed lengths with zeros and lengths < s_q (the balanced form), a small batch.
* CUDA graphs: captured at a uniform step, replayed at a skewed one (the plan switches form in the same
  buffers) and the other way round: equal to an eager decoder on the same step, bit for bit, and to the
  reference.
Skipped without an sm_90 GPU."""

from __future__ import annotations

import random

import pytest
import torch

from mlacore import MLADecoder
from mlacore.problem import DecodeProblem, DeviceSpec
from mlacore.testing.compare import compare, only_backend_dispatcher, reference_outputs
from mlacore.testing.inputs import make_inputs

pytestmark = pytest.mark.gpu

H = 16
PAGE = 64
# the mma.sync balanced kernel, forced: at 32 rows (s_q=2) mma=auto runs the balanced seesaw since 0.2.23 (and with
# seesaw_split=even wgmma_t from 640 KV blocks per step; test_backend_gpu.py covers both); this file pins the
# mma.sync kernel and its hybrid plan
OPTIONS = {"split_kv": "balanced", "mma": "mma_sync"}


@pytest.fixture(autouse=True)
def _sm90():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the CuTe DSL kernels are sm_90 only")


def _uniform(B: int, n: int) -> list:
    return [n] * B


def _skewed(B: int, n: int, s_q: int, seed: int) -> list:
    """Lengths uniform in 1..n with zeros, ones and lengths < s_q mixed in (and one full-length request)."""
    rng = random.Random(seed)
    lens = [rng.randint(1, n) for _ in range(B)]
    lens[0], lens[1], lens[2], lens[3] = n, 0, 1, max(0, s_q - 1)
    return lens


def _problem(lens: list, s_q: int) -> DecodeProblem:
    return DecodeProblem(num_heads=H, seq_len_q=s_q, batch_size=len(lens), max_kv_len=max(lens),
                         min_kv_len=min(lens), page_size=PAGE, q_dtype="bf16", kv_dtype="bf16",
                         device=DeviceSpec.of("cuda"))


def _decoder(inputs, **kw) -> MLADecoder:
    return MLADecoder(H, PAGE, q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16, device="cuda",
                      sm_scale=inputs.sm_scale, kv_scale=inputs.kv_scale,
                      dispatcher=only_backend_dispatcher("cute_dsl_mla", options=OPTIONS), **kw)


def _expected_form(lens: list, s_q: int) -> str:
    """The form make_schedule picks for these lengths on this GPU (the CPU tests pin the rule itself)."""
    from mla_cute_dsl.kernels import make_schedule

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return make_schedule(lens, s_q, H, sms, device="cpu", balanced=True).form


def _nan_outputs(q: torch.Tensor):
    out = torch.full((*q.shape[:3], 512), float("nan"), dtype=q.dtype, device="cuda")
    lse = torch.full(q.shape[:3], float("nan"), dtype=torch.float32, device="cuda")
    return out, lse


CASES = [  # name, lengths(s_q), form on a 132-SM H200 (None: either)
    ("uniform", lambda s_q: _uniform(64, 4096), "even"),
    ("skewed", lambda s_q: _skewed(100, 4096, s_q, seed=7), "balanced"),
    ("small", lambda s_q: [0, 90, 1, 3, 0], None),
]


@pytest.mark.parametrize("s_q", [1, 2])
@pytest.mark.parametrize("name,make_lens,form", CASES, ids=[c[0] for c in CASES])
def test_split_kv_balanced_matches_the_fp64_reference(name, make_lens, form, s_q):
    lens = make_lens(s_q)
    problem = _problem(lens, s_q)
    inputs = make_inputs(problem, "cuda", seed=1000 + 10 * s_q + len(lens),
                         kv_lens=torch.tensor(lens, dtype=torch.int32))
    with _decoder(inputs) as decoder:
        plan = decoder.plan(inputs.kv_lens, inputs.page_table, s_q)
        assert plan.backend == "cute_dsl_mla", plan.decision.format_trace()
        sched = plan.planned.schedule
        assert sched.balanced and plan.planned.run_fn.__name__ == "mla_decode_sm90_balanced"
        assert sched.form == _expected_form(lens, s_q)
        if form is not None and sched.num_cols == 132:
            assert sched.form == form
        out, lse = _nan_outputs(inputs.q)
        decoder.run(inputs.q, inputs.kv_cache, plan, out=out, lse=lse)
        torch.cuda.synchronize()
    res = compare(problem, out, lse, *reference_outputs(problem, inputs))
    assert res.passed, (sched.form, res.messages)


@pytest.mark.parametrize("s_q", [1, 2])
@pytest.mark.parametrize("first,second", [("uniform", "skewed"), ("skewed", "uniform")])
def test_graph_captured_at_one_form_replays_the_other_equal_to_eager(first, second, s_q):
    """Capture at a step of one form, plan a step of the other into the same buffers, replay: equal to an
    eager decoder on that step (bit for bit: same plan, same kernel) and to the fp64 reference."""
    B, n = 64, 4096  # on 132 SMs: uniform plans even, skewed balanced (100 uniform would plan balanced too)
    steps = {"uniform": _uniform(B, n), "skewed": _skewed(B, n, s_q, seed=11)}
    pages = B * -(-n // PAGE) + 4  # one cache size for both steps (the graph holds its pointer)
    step_inputs = {}
    for k, (key, lens) in enumerate(steps.items()):
        problem = _problem(lens, s_q)
        used = sum(-(-x // PAGE) for x in lens)
        step_inputs[key] = (problem, make_inputs(problem, "cuda", seed=2000 + 10 * s_q + k,
                                                 kv_lens=torch.tensor(lens, dtype=torch.int32),
                                                 extra_pages=pages - used))
    forms = {key: _expected_form(lens, s_q) for key, lens in steps.items()}
    if forms["uniform"] == forms["skewed"]:
        pytest.skip(f"on this GPU both steps plan the {forms['uniform']} form: no switch to test")
    p1, in1 = step_inputs[first]
    p2, in2 = step_inputs[second]
    q, kv = in1.q.clone(), in1.kv_cache.clone()  # the captured tensors: step 2's values are copied in
    decoder = _decoder(in1, cuda_graph=True, max_batch=B, max_kv_len=n)
    plan = decoder.plan(in1.kv_lens, in1.page_table, s_q)
    assert plan.planned.schedule.form == forms[first]
    out, lse = _nan_outputs(q)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        decoder.run(q, kv, plan, out=out, lse=lse)  # warm-up (compiles) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decoder.run(q, kv, plan, out=out, lse=lse)
    # step 2: its lengths, table, cache and q into the captured tensors and the decoder's buffers
    q.copy_(in2.q)
    kv.copy_(in2.kv_cache)
    plan2 = decoder.plan(in2.kv_lens, in2.page_table, s_q)
    sched = plan2.planned.schedule
    assert sched is plan.planned.schedule and sched.form == forms[second]
    out.fill_(float("nan"))
    lse.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    with _decoder(in2) as eager:
        e_plan = eager.plan(in2.kv_lens, in2.page_table, s_q)
        assert e_plan.planned.schedule.form == forms[second]
        e_out, e_lse = _nan_outputs(in2.q)
        eager.run(in2.q, in2.kv_cache, e_plan, out=e_out, lse=e_lse)
        torch.cuda.synchronize()
    assert torch.equal(out, e_out) and torch.equal(lse, e_lse)
    res = compare(p2, out, lse, *reference_outputs(p2, in2))
    assert res.passed, (forms, res.messages)
    decoder.close()
