"""The engine interface (issue 10) on the CPU: split inputs, strides, per-layer scales, fp8 queries,
the custom op pair under torch.compile, warm-up, and the errors each misuse gets."""

import math

import pytest
import torch

from mlacore import (Backend, BackendInfo, BackendRegistry, Dispatcher, MLADecoder, MLAInputError, hookimpl,
                     parse_policy_text)
from mlacore.problem import DecodeProblem
from mlacore.reference import ReferenceBackend, mla_decode_reference
from mlacore.testing import compare, make_inputs, reference_outputs

REF_ONLY = '[mla]\norder = ["reference"]\nfallback = "error"\n'


def problem(**kw):
    base = dict(num_heads=8, seq_len_q=2, batch_size=3, min_kv_len=0, max_kv_len=90, page_size=16)
    base.update(kw)
    return DecodeProblem(**base)


def split_q(q):
    """(q_nope, q_pe) as an engine holds them: q_nope a strided view out of a per-head bmm."""
    B, s_q, H, _ = q.shape
    heads_first = q[..., :512].permute(2, 0, 1, 3).contiguous()  # [H, B, s_q, 512], like a bmm over heads
    q_nope = heads_first.permute(1, 2, 0, 3)  # back to [B, s_q, H, 512]: not contiguous
    assert not q_nope.is_contiguous() and q_nope.stride(-1) == 1
    return q_nope, q[..., 512:].contiguous()


def decoder(inp, p, **kw):
    d = Dispatcher(policy=parse_policy_text(REF_ONLY), env={})
    return MLADecoder(p.num_heads, p.page_size, kv_dtype=inp.kv_cache.dtype, sm_scale=inp.sm_scale,
                      dispatcher=d, **kw)


@pytest.mark.parametrize("q_layout, kv_layout", [("split", "packed"), ("packed", "split"), ("split", "split")])
def test_split_inputs_match_the_oracle(q_layout, kv_layout):
    p = problem()
    inp = make_inputs(p, seed=1)
    dec = decoder(inp, p, q_layout=q_layout, kv_layout=kv_layout)
    plan = dec.plan(inp.kv_lens, inp.page_table, p.seq_len_q)
    q = split_q(inp.q) if q_layout == "split" else inp.q
    kv = (inp.kv_cache[..., :512], inp.kv_cache[..., 512:]) if kv_layout == "split" else inp.kv_cache
    out, lse = dec.run(q, kv, plan)
    res = compare(p, out, lse, *reference_outputs(p, inp))
    assert res.passed, res.messages
    assert plan.conversions == ()  # the reference takes every layout and strides as they are


class PackedOnly(ReferenceBackend):
    """The reference's math behind a backend that takes packed, contiguous inputs only."""

    name = "packed_only"
    seen = []

    @hookimpl
    def info(self):
        return BackendInfo(description="packed only", q_layouts=("packed",), kv_layouts=("packed",), strided_q=False)

    @hookimpl
    def open(self, config, options):
        session = super().open(config, options)
        seen = self.seen

        class Spy:
            def plan(self, problem, step):
                planned = session.plan(problem, step)
                run = planned.run

                def checked_run(q, kv, out, lse, *scales):
                    seen.append((type(q), q.is_contiguous() if isinstance(q, torch.Tensor) else None, type(kv)))
                    run(q, kv, out, lse, *scales)

                planned.run = checked_run
                return planned

        from mlacore import Session

        return type("SpySession", (Session,), {"plan": lambda s, p, st: Spy().plan(p, st)})()


def test_the_decoder_converts_for_a_backend_that_takes_packed_inputs_only():
    reg = BackendRegistry(env={"MLA_DISABLE_PLUGIN_AUTOLOAD": "1"}).load()
    reg.register(PackedOnly())
    d = Dispatcher(policy=parse_policy_text('[mla]\norder = ["packed_only"]\nfallback = "error"'), registry=reg,
                   env={})
    p = problem()
    inp = make_inputs(p, seed=2)
    dec = MLADecoder(p.num_heads, p.page_size, sm_scale=inp.sm_scale, dispatcher=d, q_layout="split")
    plan = dec.plan(inp.kv_lens, inp.page_table, p.seq_len_q)
    assert any("q: split -> packed" in c for c in plan.conversions)
    assert "the decoder converts q: split -> packed" in dec.explain(3, 90, 0, 2)
    PackedOnly.seen.clear()
    out, lse = dec.run(split_q(inp.q), inp.kv_cache, plan)
    assert PackedOnly.seen == [(torch.Tensor, True, torch.Tensor)]
    assert compare(p, out, lse, *reference_outputs(p, inp)).passed
    strided = MLADecoder(p.num_heads, p.page_size, sm_scale=inp.sm_scale, dispatcher=d)
    plan = strided.plan(inp.kv_lens, inp.page_table, p.seq_len_q)
    view = inp.q.transpose(1, 2).contiguous().transpose(1, 2)
    PackedOnly.seen.clear()
    out, _ = strided.run(view, inp.kv_cache, plan)
    assert PackedOnly.seen == [(torch.Tensor, True, torch.Tensor)]  # a contiguous copy was handed over


@pytest.mark.parametrize("mode", ["float", "tensor"])
def test_per_layer_fp8_scales(mode):
    p = problem(kv_dtype="fp8_e4m3")
    inp = make_inputs(p, seed=3)
    dec = decoder(inp, p, scale_inputs=mode)
    plan = dec.plan(inp.kv_lens, inp.page_table, p.seq_len_q)
    for factor in (1.0, 0.5):  # two "layers" with different scales over the same bytes
        scale = inp.kv_scale * factor
        arg = scale if mode == "float" else torch.tensor(scale, dtype=torch.float32)
        out, lse = dec.run(inp.q, inp.kv_cache, plan, kv_scale=arg)
        want = mla_decode_reference(inp.q, inp.kv_cache, inp.page_table, inp.kv_lens, inp.sm_scale, scale)
        res = compare(p, out, lse, *want)
        assert res.passed, (factor, res.messages)


def test_fp8_queries_with_q_scale_write_bf16():
    p = problem(q_dtype="fp8_e4m3", kv_dtype="bf16")
    inp = make_inputs(problem(), seed=4)
    q_scale = float(inp.q.float().abs().max()) / 448.0
    q8 = (inp.q.float() / q_scale).to(torch.float8_e4m3fn)
    d = Dispatcher(policy=parse_policy_text(REF_ONLY), env={})
    dec = MLADecoder(p.num_heads, p.page_size, q_dtype=torch.float8_e4m3fn, kv_dtype=torch.bfloat16,
                     q_scale=q_scale, sm_scale=inp.sm_scale, dispatcher=d)
    assert dec.out_dtype == torch.bfloat16
    plan = dec.plan(inp.kv_lens, inp.page_table, p.seq_len_q)
    out, lse = dec.run(q8, inp.kv_cache, plan)
    assert out.dtype == torch.bfloat16
    want = mla_decode_reference(q8, inp.kv_cache, inp.page_table, inp.kv_lens, inp.sm_scale, q_scale=q_scale)
    res = compare(problem(), out, lse, *want)
    assert res.passed, res.messages
    assert plan.problem.q_dtype == "fp8_e4m3" and plan.problem.output_dtype == "bf16"


def bad(fn, *needles):
    with pytest.raises(MLAInputError) as err:
        fn()
    for n in needles:
        assert n in str(err.value), str(err.value)


def test_misuse_is_named():
    p = problem()
    inp = make_inputs(p, seed=5)
    split = decoder(inp, p, q_layout="split")
    plan = split.plan(inp.kv_lens, inp.page_table, p.seq_len_q)
    qn, qp = split_q(inp.q)
    bad(lambda: split.run(inp.q, inp.kv_cache, plan), "q: this decoder has q_layout='split'")
    bad(lambda: split.run((qn[:2], qp), inp.kv_cache, plan), "q_nope: expected shape (3, 2, 8, 512)")
    bad(lambda: split.run((qn, qp[:, :, :4]), inp.kv_cache, plan), "q_pe: expected shape (3, 2, 8, 64)")
    bad(lambda: split.run((qn, qp.float()), inp.kv_cache, plan), "q_pe: expected dtype bfloat16")
    last = torch.empty(*qp.shape, 2, dtype=qp.dtype)[..., 0]
    bad(lambda: split.run((qn, last), inp.kv_cache, plan), "q_pe: expected a contiguous last dimension")
    packed = decoder(inp, p)
    plan = packed.plan(inp.kv_lens, inp.page_table, p.seq_len_q)
    bad(lambda: packed.run((qn, qp), inp.kv_cache, plan), "q: this decoder has q_layout='packed'")
    bad(lambda: packed.run(inp.q, (inp.kv_cache[..., :512], inp.kv_cache[..., 512:]), plan),
        "kv_cache: this decoder has kv_layout='packed'")
    ks = decoder(inp, p, kv_layout="split")
    plan = ks.plan(inp.kv_lens, inp.page_table, p.seq_len_q)
    bad(lambda: ks.run(inp.q, (inp.kv_cache[..., :512], inp.kv_cache[:5, :, 512:]), plan),
        f"kpe: expected {inp.kv_cache.shape[0]} pages like ckv, got 5")
    bad(lambda: packed.run(inp.q, inp.kv_cache, plan), "plan: this plan was made by another MLADecoder")
    plan = packed.plan(inp.kv_lens, inp.page_table, p.seq_len_q)
    bad(lambda: packed.run(inp.q, inp.kv_cache, plan, kv_scale=2.0), "kv_scale: only an fp8 cache is scaled")
    p8 = problem(kv_dtype="fp8_e4m3")
    inp8 = make_inputs(p8, seed=6)
    static = decoder(inp8, p8, kv_scale=inp8.kv_scale)
    plan = static.plan(inp8.kv_lens, inp8.page_table, 2)
    bad(lambda: static.run(inp8.q, inp8.kv_cache, plan, kv_scale=1.0), "scale_inputs='static'")
    per_call = decoder(inp8, p8, scale_inputs="float")
    plan = per_call.plan(inp8.kv_lens, inp8.page_table, 2)
    bad(lambda: per_call.run(inp8.q, inp8.kv_cache, plan), "kv_scale: this decoder has scale_inputs='float'")
    for value in (float("nan"), -1.0, 0.0, "1"):
        bad(lambda: per_call.run(inp8.q, inp8.kv_cache, plan, kv_scale=value), "kv_scale: expected a positive")
    tensor = decoder(inp8, p8, scale_inputs="tensor")
    plan = tensor.plan(inp8.kv_lens, inp8.page_table, 2)
    bad(lambda: tensor.run(inp8.q, inp8.kv_cache, plan, kv_scale=torch.ones(1)), "kv_scale: expected a 0-d")
    bad(lambda: tensor.run(inp8.q, inp8.kv_cache, plan, kv_scale=torch.tensor(1.0, dtype=torch.float64)),
        "kv_scale: expected a 0-d float32 tensor")
    bad(lambda: tensor.run(inp8.q, inp8.kv_cache, plan, kv_scale=torch.tensor(1.0, device="meta")),
        "kv_scale: expected a tensor on cpu")
    bad(lambda: tensor.run(inp8.q, inp8.kv_cache, plan, kv_scale=1.0), "kv_scale: expected a 0-d float32 tensor")
    bad(lambda: MLADecoder(8, 16, q_dtype=torch.float8_e4m3fn), "q_scale: an fp8 query needs its dequantization")
    bad(lambda: MLADecoder(8, 16, q_layout="interleaved"), "q_layout: expected one of 'packed', 'split'")
    bad(lambda: MLADecoder(8, 16, scale_inputs="dynamic"), "scale_inputs: expected one of")
    bad(lambda: MLADecoder(8, 16, out_dtype=torch.int8), "out_dtype: expected bfloat16, float16 or float32")
    bad(lambda: MLADecoder(8, 16, kv_scale=2.0), "kv_scale: only an fp8 cache is scaled")


def test_a_buffer_checked_for_one_plan_is_checked_again_for_the_next():
    p = problem()
    inp = make_inputs(p, seed=7)
    dec = decoder(inp, p)
    plan = dec.plan(inp.kv_lens, inp.page_table, 2)
    out = torch.empty(3, 2, 8, 512, dtype=torch.bfloat16)
    dec.run(inp.q, inp.kv_cache, plan, out=out)
    dec.run(inp.q, inp.kv_cache, plan, out=out)  # recognised
    plan = dec.plan(inp.kv_lens[:2], inp.page_table[:2], 2)
    bad(lambda: dec.run(inp.q[:2], inp.kv_cache, plan, out=out), "out: expected shape (2, 2, 8, 512)")
    few_pages = inp.kv_cache[:1]
    bad(lambda: dec.run(inp.q[:2], few_pages, plan), "out of range for kv_cache with 1 pages")


def test_op_pair_compiles_fullgraph_and_equals_eager():
    import mlacore.ops as ops

    p = problem()
    inp = make_inputs(p, seed=8)
    dec = decoder(inp, p)
    handle = ops.register_decoder(dec)

    def step(q, kv, lens, table):
        token = torch.ops.mlacore.plan(handle, lens, table, 2)
        return torch.ops.mlacore.run(handle, token, q, kv)

    compiled = torch.compile(step, fullgraph=True, backend="eager")
    for lens in (inp.kv_lens, torch.clamp(inp.kv_lens - 7, min=0).to(torch.int32)):
        eager = step(inp.q, inp.kv_cache, lens, inp.page_table)
        got = compiled(inp.q, inp.kv_cache, lens, inp.page_table)
        assert torch.equal(got[0], eager[0])
        assert torch.equal(torch.nan_to_num(got[1], neginf=0), torch.nan_to_num(eager[1], neginf=0))
    with pytest.raises(MLAInputError, match="no live MLADecoder"):
        torch.ops.mlacore.run(10 ** 9, torch.zeros((), dtype=torch.int32), inp.q, inp.kv_cache)


def test_warmup_reports_what_it_built():
    dec = MLADecoder(8, 16, dispatcher=Dispatcher(policy=parse_policy_text(REF_ONLY), env={}))
    built = dec.warmup(batch_sizes=[1, 4], kv_lens=[0, 300], seq_lens_q=[1, 2])
    assert {(e.backend, e.seq_len_q) for e in built} == {("reference", 1), ("reference", 2)}
    assert all(e.seconds >= 0 and e.options == {"chunk_tokens": 65536} for e in built)
    with pytest.raises(MLAInputError, match="no current plan"):
        dec.current_plan()  # warm-up plans are not left for the engine to run by mistake
    assert not math.isnan(built[0].seconds)


def test_buffers_recognised_by_identity_are_checked_again_after_a_new_plan():
    """run remembers the last (out, lse) pair it checked; a new plan with another shape must check them
    again (and refuse them), and a returned lse is never skipped when the caller passed None."""
    from mlacore import MLADecoder, MLAInputError
    from mlacore.problem import DecodeProblem, DeviceSpec
    from mlacore.testing import make_inputs

    p = DecodeProblem(num_heads=4, batch_size=2, min_kv_len=5, max_kv_len=40, page_size=16,
                      device=DeviceSpec.of("cpu"))
    inp = make_inputs(p, seed=3)
    dec = MLADecoder(4, 16, sm_scale=inp.sm_scale)
    plan = dec.plan(inp.kv_lens, inp.page_table)
    out = torch.empty(2, 1, 4, 512, dtype=torch.bfloat16)
    lse = torch.empty(2, 1, 4)
    dec.run(inp.q, inp.kv_cache, plan, out=out, lse=lse)
    o2, l2 = dec.run(inp.q, inp.kv_cache, plan, out=out, lse=lse)
    assert o2 is out and l2 is lse
    _, fresh = dec.run(inp.q, inp.kv_cache, plan, out=out)  # lse=None: a new one is made, not skipped
    assert fresh is not None and fresh is not lse
    torch.testing.assert_close(fresh, lse)
    plan1 = dec.plan(inp.kv_lens[:1], inp.page_table[:1])  # batch 1: the old buffers no longer fit
    with pytest.raises(MLAInputError, match="out"):
        dec.run(inp.q[:1], inp.kv_cache, plan1, out=out, lse=lse)


class Recording(ReferenceBackend):
    """The reference's math; records the alignment of every q it is handed (strided q allowed)."""

    name = "recording"
    seen = []

    @hookimpl
    def open(self, config, options):
        session = super().open(config, options)
        seen = self.seen
        from mlacore import Session
        from mlacore.validation import misaligned

        class Recorder(Session):
            def plan(self, problem, step):
                planned = session.plan(problem, step)
                run = planned.run

                def recorded(q, kv, out, lse, *scales):
                    parts = q if isinstance(q, tuple) else (q,)
                    seen.append(tuple((t.data_ptr(), misaligned(t)) for t in parts))
                    run(q, kv, out, lse, *scales)

                planned.run = recorded
                return planned

        return Recorder()


def recording_decoder(p, inp, **kw):
    reg = BackendRegistry(env={"MLA_DISABLE_PLUGIN_AUTOLOAD": "1"}).load()
    reg.register(Recording())
    d = Dispatcher(policy=parse_policy_text('[mla]\norder = ["recording"]\nfallback = "error"'), registry=reg,
                   env={})
    return MLADecoder(p.num_heads, p.page_size, sm_scale=inp.sm_scale, dispatcher=d, **kw)


def test_a_misaligned_q_is_copied_and_an_aligned_strided_q_is_not():
    """Kernels load 16-byte vectors: a q view at an odd offset or with odd strides (a slice of a 700-wide
    bf16 buffer) would fault on a GPU. The decoder hands over an aligned copy; aligned views pass as they are."""
    p = problem()
    inp = make_inputs(p, seed=4)
    want = reference_outputs(p, inp)
    for layout in ("packed", "split"):
        dec = recording_decoder(p, inp, q_layout=layout)
        plan = dec.plan(inp.kv_lens, inp.page_table, p.seq_len_q)
        for width, offset, copied in ((700, 0, True), (704, 0, False), (704, 1, True), (576, 0, False)):
            wide = torch.randn(*inp.q.shape[:3], width + offset, dtype=inp.q.dtype)
            view = wide[..., offset:offset + 576]
            view.copy_(inp.q)
            q = (view[..., :512], view[..., 512:]) if layout == "split" else view
            Recording.seen.clear()
            out, lse = dec.run(q, inp.kv_cache, plan)
            assert compare(p, out, lse, *want).passed, (layout, width, offset)
            (got,) = Recording.seen
            assert not any(bad for _, bad in got), (layout, width, offset, got)
            handed_same = got[0][0] == view.data_ptr()
            assert handed_same != copied, (layout, width, offset)


def test_a_misaligned_cache_or_output_is_refused_naming_it():
    p = problem()
    inp = make_inputs(p, seed=5)
    dec = decoder(inp, p)
    plan = dec.plan(inp.kv_lens, inp.page_table, p.seq_len_q)
    flat = torch.empty(inp.kv_cache.numel() + 8, dtype=inp.kv_cache.dtype)
    shifted = flat[1:1 + inp.kv_cache.numel()].view(inp.kv_cache.shape)  # contiguous, 2 bytes off
    shifted.copy_(inp.kv_cache)
    with pytest.raises(MLAInputError, match=r"kv_cache: expected a 16-byte aligned tensor.*offset 2"):
        dec.run(inp.q, shifted, plan)
    out_flat = torch.empty(3 * 2 * 8 * 512 + 8, dtype=torch.bfloat16)
    with pytest.raises(MLAInputError, match=r"out: expected a 16-byte aligned tensor"):
        dec.run(inp.q, inp.kv_cache, plan, out=out_flat[3:3 + 3 * 2 * 8 * 512].view(3, 2, 8, 512))


def test_an_aligned_stride_pattern_is_judged_again_after_a_new_plan():
    """A stride of a size-1 dimension does not matter (batch 1), so a pattern found aligned there can be
    misaligned at batch 2: the remembered pattern must not outlive its plan (review finding)."""
    p = problem(batch_size=2, seq_len_q=1)
    inp = make_inputs(p, seed=6)
    dec = recording_decoder(p, inp)
    H = p.num_heads
    buf = torch.randn(2 * H * 640 + 64, dtype=inp.q.dtype)
    odd = (H * 640 + 3, H * 640, 640, 1)  # batch stride not a multiple of 8 elements
    plan1 = dec.plan(inp.kv_lens[:1], inp.page_table[:1], 1)
    q1 = buf.as_strided((1, 1, H, 576), odd)
    q1.copy_(inp.q[:1])
    Recording.seen.clear()
    dec.run(q1, inp.kv_cache, plan1)
    assert Recording.seen[0][0][0] == q1.data_ptr()  # batch 1: the odd stride is irrelevant, no copy
    plan2 = dec.plan(inp.kv_lens, inp.page_table, 1)
    q2 = buf.as_strided((2, 1, H, 576), odd)
    q2.copy_(inp.q)
    Recording.seen.clear()
    out, lse = dec.run(q2, inp.kv_cache, plan2)
    (got,) = Recording.seen
    assert got[0][0] != q2.data_ptr() and not got[0][1]  # copied, aligned
    assert compare(p, out, lse, *reference_outputs(p, inp)).passed


def test_fresh_output_slices_each_layer_are_checked_and_used():
    """Engines often pass a fresh slice of one preallocated buffer per layer: each is checked (a wrong one
    refused naming it) and written."""
    p = problem()
    inp = make_inputs(p, seed=7)
    dec = decoder(inp, p)
    plan = dec.plan(inp.kv_lens, inp.page_table, p.seq_len_q)
    big_out = torch.zeros(8, 2, 8, 512, dtype=torch.bfloat16)
    big_lse = torch.zeros(8, 2, 8)
    want = reference_outputs(p, inp)
    for start in (0, 3, 5):
        out, lse = big_out[start:start + 3], big_lse[start:start + 3]
        got_out, got_lse = dec.run(inp.q, inp.kv_cache, plan, out=out, lse=lse)
        assert got_out is out and got_lse is lse
        assert compare(p, big_out[start:start + 3], big_lse[start:start + 3], *want).passed
    with pytest.raises(MLAInputError, match="out: expected shape"):
        dec.run(inp.q, inp.kv_cache, plan, out=big_out[:2], lse=big_lse[:3])
    with pytest.raises(MLAInputError, match="lse: expected a contiguous"):
        dec.run(inp.q, inp.kv_cache, plan, out=big_out[:3], lse=torch.zeros(3, 2, 16)[..., :8])
