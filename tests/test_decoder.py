"""MLADecoder: the engine API end to end on the reference, and a named error for every bad input."""

import pytest
import torch

from mlacore import MLADecoder, MLAInputError, parse_policy
from mlacore.testing import compare, make_inputs, reference_outputs
from mlacore.dispatch import Dispatcher
from mlacore.problem import DecodeProblem


def reference_decoder(**kw):
    disp = Dispatcher(policy=parse_policy({"mla": {"order": ["reference"]}}), env={})
    return MLADecoder(kw.pop("num_heads", 16), kw.pop("page_size", 16), dispatcher=disp, **kw)


PROBLEM = DecodeProblem(num_heads=16, seq_len_q=2, batch_size=3, min_kv_len=0, max_kv_len=50, page_size=16)


@pytest.fixture
def setup():
    inp = make_inputs(PROBLEM, seed=7)
    dec = reference_decoder(sm_scale=inp.sm_scale)
    plan = dec.plan(inp.kv_lens, inp.page_table, seq_len_q=2)
    return dec, inp, plan


def test_plan_run_matches_reference_and_writes_into_given_buffers(setup):
    dec, inp, plan = setup
    assert plan.backend == "reference"
    assert plan.problem.max_kv_len == 50 and plan.problem.min_kv_len == 0 and plan.problem.batch_size == 3
    out = torch.full((3, 2, 16, 512), float("nan"), dtype=torch.bfloat16)
    lse = torch.full((3, 2, 16), float("nan"))
    got_out, got_lse = dec.run(inp.q, inp.kv_cache, plan, out=out, lse=lse)
    assert got_out is out and got_lse is lse
    res = compare(PROBLEM, out, lse, *reference_outputs(PROBLEM, inp))
    assert res.passed, res.messages


def test_plan_is_reused_across_layers(setup):
    dec, inp, plan = setup
    other_layer_cache = torch.randn_like(inp.kv_cache.float()).to(torch.bfloat16)
    a, _ = dec.run(inp.q, inp.kv_cache, plan)
    b, _ = dec.run(inp.q, other_layer_cache, plan)
    assert not torch.equal(a, b)


def test_no_lse_when_not_asked():
    inp = make_inputs(PROBLEM, seed=1)
    dec = reference_decoder(return_lse=False)
    out, lse = dec.run(inp.q, inp.kv_cache, dec.plan(inp.kv_lens, inp.page_table, 2))
    assert lse is None and out.shape == (3, 2, 16, 512)


def bad(fn, *needles):
    with pytest.raises(MLAInputError) as err:
        fn()
    for n in needles:
        assert n in str(err.value), str(err.value)


def test_bad_run_inputs_name_the_argument(setup):
    dec, inp, plan = setup
    q, cache = inp.q, inp.kv_cache
    bad(lambda: dec.run(q.float(), cache, plan), "q: expected dtype bfloat16, got float32")
    bad(lambda: dec.run(q[:, :1], cache, plan), "q: seq_len_q=1 does not match the plan's seq_len_q=2")
    bad(lambda: dec.run(q[:2], cache, plan), "q: expected shape (3, 2, 16, 576)")
    bad(lambda: dec.run(q[..., :512], cache, plan), "q: expected shape")
    bad(lambda: dec.run(q[0], cache, plan), "q: expected 4 dims")
    strided = q.transpose(1, 2).contiguous().transpose(1, 2)  # engines' views: any strides, last dim contiguous
    assert torch.equal(dec.run(strided, cache, plan)[0], dec.run(q, cache, plan)[0])
    last_dim_strided = torch.empty(*q.shape, 2, dtype=q.dtype)[..., 0]
    last_dim_strided.copy_(q)
    bad(lambda: dec.run(last_dim_strided, cache, plan), "q: expected a contiguous last dimension")
    bad(lambda: dec.run("q", cache, plan), "q: expected a torch.Tensor, got str")
    bad(lambda: dec.run(q, cache.float(), plan), "kv_cache: expected dtype bfloat16, got float32")
    bad(lambda: dec.run(q, cache[:, :8], plan), "kv_cache: expected shape (num_pages, 16, 576)")
    bad(lambda: dec.run(q, cache[None], plan), "kv_cache: expected shape")
    bad(lambda: dec.run(q, cache[:2], plan), "page_table: page id", "out of range for kv_cache with 2 pages")
    bad(lambda: dec.run(q, cache, "plan"), "plan: expected a DecodePlan")
    bad(lambda: dec.run(q, cache, plan, out=torch.empty(3, 2, 16, 512)), "out: expected dtype bfloat16")
    bad(lambda: dec.run(q, cache, plan, out=torch.empty(3, 2, 16, 576, dtype=torch.bfloat16)),
        "out: expected shape (3, 2, 16, 512)")
    bad(lambda: dec.run(q, cache, plan, lse=torch.empty(3, 2, 16, dtype=torch.bfloat16)),
        "lse: expected dtype float32")
    bad(lambda: dec.run(q, cache, plan, lse=torch.empty(3, 16, 2).transpose(1, 2)),
        "lse: expected a contiguous tensor")


def test_bad_plan_inputs_name_the_argument(setup):
    dec, inp, _ = setup
    lens, table = inp.kv_lens, inp.page_table
    bad(lambda: dec.plan(lens.long(), table), "kv_lens: expected dtype int32, got int64")
    bad(lambda: dec.plan(lens, table.long()), "page_table: expected dtype int32, got int64")
    bad(lambda: dec.plan(lens[None], table), "kv_lens: expected 1 dims")
    bad(lambda: dec.plan(lens, table[0]), "page_table: expected 2 dims")
    bad(lambda: dec.plan(lens, table[:2]), "page_table: expected 3 rows")
    bad(lambda: dec.plan(lens[:0], table[:0]), "kv_lens: expected at least one request")
    bad(lambda: dec.plan(torch.tensor([5, -1, 3], dtype=torch.int32), table),
        "kv_lens: expected lengths >= 0, got kv_lens[1] = -1")
    too_long = torch.tensor([5, table.shape[1] * 16 + 1, 3], dtype=torch.int32)
    bad(lambda: dec.plan(too_long, table), "kv_lens: kv_lens[1]", "needs more pages than page_table holds")
    neg = table.clone()
    neg[0, 0] = -1
    bad(lambda: dec.plan(torch.tensor([50, 0, 0], dtype=torch.int32), neg),
        "page_table: page_table[0, 0] = -1 is negative but request 0 uses that slot")
    big = table.clone()
    big[0, 0] = 10_000
    bad(lambda: dec.plan(torch.tensor([50, 0, 0], dtype=torch.int32), big, num_pages=20),
        "page_table: page_table[0, 0] = 10000 is out of range for a cache of 20 pages")
    bad(lambda: dec.plan(lens, table, seq_len_q=0), "seq_len_q: expected an int >= 1")
    bad(lambda: dec.plan(lens, table, kv_lens_host=lens[:1]), "kv_lens_host: expected shape (3,)")


def test_unused_table_slots_may_hold_anything(setup):
    dec, inp, _ = setup
    table = inp.page_table.clone()
    lens = torch.tensor([16, 0, 1], dtype=torch.int32)
    table[0, 1:] = -7  # request 0 uses one page only
    table[1, :] = 123456  # request 1 uses none
    plan = dec.plan(lens, table, seq_len_q=2)
    assert plan.max_page_id == max(int(table[0, 0]), int(table[2, 0]))


def test_bad_constructor_arguments():
    bad(lambda: reference_decoder(num_heads=0), "num_heads: expected an int >= 1, got 0")
    bad(lambda: reference_decoder(page_size=-4), "page_size: expected an int >= 1, got -4")
    bad(lambda: reference_decoder(num_heads=16.0), "num_heads: expected an int >= 1, got 16.0")
    bad(lambda: reference_decoder(q_dtype=torch.int8), "q_dtype: expected bfloat16, float16, float32 or float8_e4m3fn, got torch.int8")
    bad(lambda: reference_decoder(kv_dtype=torch.int8), "kv_dtype: expected")
    bad(lambda: reference_decoder(sm_scale=float("nan")), "sm_scale: expected a positive finite float")
    bad(lambda: reference_decoder(kv_scale=0.0), "kv_scale: expected a positive finite float")
    bad(lambda: reference_decoder(causal=1), "causal: expected True or False, got 1")
    bad(lambda: reference_decoder(kv_dtype=torch.float8_e4m3fn), "kv_scale: an fp8 cache needs its "
        "dequantization scale")
    bad(lambda: reference_decoder(device="tpu"), "device: expected 'cpu', 'cuda' or 'cuda:N'")


def test_cuda_graph_envelope_arguments():
    bad(lambda: reference_decoder(cuda_graph=True), "cuda_graph=True needs the capture envelope",
        "max_batch and max_kv_len")
    bad(lambda: reference_decoder(cuda_graph=True, max_batch=4), "cuda_graph=True needs the capture envelope")
    bad(lambda: reference_decoder(cuda_graph=True, max_batch=0, max_kv_len=64), "max_batch: expected an int >= 1")
    bad(lambda: reference_decoder(cuda_graph=True, max_batch=4, max_kv_len=0), "max_kv_len: expected an int >= 1")
    bad(lambda: reference_decoder(max_batch=4, max_kv_len=64), "the capture envelope is for cuda_graph=True only")
    dec = reference_decoder(cuda_graph=True, max_batch=3, max_kv_len=50)
    assert dec.envelope.max_batch == 3 and dec.envelope.max_kv_len == 50
    table = torch.zeros(4, 4, dtype=torch.int32)
    bad(lambda: dec.plan(torch.tensor([1, 2, 3, 4], dtype=torch.int32), table),
        "kv_lens: batch 4 is larger than the decoder's cuda_graph envelope max_batch=3")
    bad(lambda: dec.plan(torch.tensor([1, 51, 3], dtype=torch.int32), table[:3]),
        "kv_lens: kv_lens[1] = 51 is larger than the decoder's cuda_graph envelope max_kv_len=50")
    assert dec.plan(torch.tensor([1, 50, 3], dtype=torch.int32), table[:3]).graph_fixed


def test_device_mismatch_is_named(setup):
    dec, inp, plan = setup
    meta_q = torch.empty(inp.q.shape, dtype=inp.q.dtype, device="meta")
    bad(lambda: dec.run(meta_q, inp.kv_cache, plan), "q: expected a tensor on cpu, got one on meta")


def test_fp8_cache_through_the_decoder():
    problem = PROBLEM.model_copy(update={"kv_dtype": "fp8_e4m3"})
    inp = make_inputs(problem, seed=4)
    dec = reference_decoder(kv_dtype=torch.float8_e4m3fn, kv_scale=inp.kv_scale, sm_scale=inp.sm_scale)
    out, lse = dec.run(inp.q, inp.kv_cache, dec.plan(inp.kv_lens, inp.page_table, 2))
    res = compare(problem, out, lse, *reference_outputs(problem, inp))
    assert res.passed, res.messages
