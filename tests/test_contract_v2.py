"""Regression tests for issue 8 (plugin contract v2): one or more tests per defect.

1. the decision cache served stale verdicts (batch limits hidden in can_implement);
2. backend options were untyped and silently ignored;
3. per-decoder state lived in module globals;
4. CUDA graphs replayed stale results (buffers and backend choice not fixed);
5. silent fallback to the reference (no logging);
6. the oracle could be disabled while it is the fallback;
7. pluggy used against its grain (one backend per entry point, hooks dug out by hand).

Plus stale plans and the MLAError family.
"""

import inspect
import logging
import weakref
from typing import Literal

import pytest
import torch

import mlacore
import mlacore.errors
import mlacore.policy
import mlacore.reference
import mlacore.validation
from mlacore import (
    Backend,
    BackendError,
    BackendOptions,
    BackendRegistry,
    Dispatcher,
    Limits,
    MLADecoder,
    MLAError,
    MLAInputError,
    NoBackendError,
    Outcome,
    Planned,
    PolicyError,
    Session,
    StalePlanError,
    hookimpl,
    parse_policy,
    parse_policy_text,
)
from mlacore.backend import NO_LIMITS
from mlacore.problem import DecodeProblem, DecodeShape, DeviceSpec
from mlacore.testing import compare, make_inputs, reference_outputs
from support_backends import Picky

CORE_ONLY = {"MLA_DISABLE_PLUGIN_AUTOLOAD": "1"}


def registry(*backends, env=None):
    """mlacore's own backends (reference) plus the given in-process ones."""
    reg = BackendRegistry(env=dict(CORE_ONLY if env is None else env)).load()
    for b in backends:
        reg.register(b)
    return reg


def dispatcher(policy_text, *backends, env=None):
    reg = registry(*backends, env=env)
    return Dispatcher(policy=parse_policy_text(policy_text), registry=reg, env=dict(env or {}))


REF_ONLY = '[mla]\norder = ["reference"]'


def small_problem(**kw):
    base = dict(num_heads=16, seq_len_q=2, batch_size=3, min_kv_len=0, max_kv_len=60, page_size=16)
    base.update(kw)
    return DecodeProblem(**base)


def decoder(disp, inp, **kw):
    return MLADecoder(16, 16, dispatcher=disp, sm_scale=inp.sm_scale, **kw)


# -- 1. an exact decision cache --------------------------------------------------------------


def big_batch_limits(shape):
    if shape.num_heads == 128 and shape.seq_len_q == 2:
        return Limits(max_batch=8192, why="16384 work items, 2 query tiles per request")
    return NO_LIMITS


def test_1_batch_limit_is_not_served_from_the_cache_for_another_batch_size():
    limited = Picky("limited", limits=big_batch_limits)
    d = dispatcher('[mla]\norder = ["limited", "reference"]', limited)
    p = DecodeProblem(num_heads=128, seq_len_q=2, batch_size=64, max_kv_len=4096, page_size=64,
                      device=DeviceSpec(type="cuda", capability=(9, 0)))
    assert d.select(p).backend == "limited"
    big = p.model_copy(update={"batch_size": 9000})
    dec = d.select(big)
    assert dec.backend != "limited" and dec.backend == "reference"
    verdict = dec.verdict("limited")
    assert verdict.outcome == Outcome.LIMIT == "over a limit"
    assert "batch=9000 > max_batch=8192" in verdict.reasons[0]
    assert "16384 work items" in verdict.reasons[0]  # the backend's `why` reaches the trace
    # explain agrees with select, and the small batch is still taken after the big one
    assert d.explain(big).verdict("limited").outcome == "over a limit"
    assert d.select(p).backend == "limited"
    # the plugin was asked once: the limit is data the core evaluates on every problem
    assert limited.calls == 1 and limited.limit_calls == 1
    # and another shape class (H=16) is not limited
    assert d.select(p.model_copy(update={"num_heads": 16, "batch_size": 9000})).backend == "limited"


def test_1_can_implement_never_sees_batch_or_lengths():
    seen = Picky("seen")
    d = dispatcher('[mla]\norder = ["seen", "reference"]', seen)
    d.select(small_problem())
    assert len(seen.seen_shapes) == 1
    shape = seen.seen_shapes[0]
    assert type(shape) is DecodeShape
    for field in ("batch_size", "max_kv_len", "min_kv_len"):
        assert not hasattr(shape, field)


# -- 2. typed options, validated when the dispatcher is built -------------------------------------


def test_2_unknown_option_is_a_policy_error_at_dispatcher_build():
    policy = parse_policy_text('[mla]\norder = ["reference"]\n[backend.reference.options]\nchunk_tokns = 64',
                               "typo.toml")
    with pytest.raises(PolicyError) as err:
        Dispatcher(policy=policy, registry=registry(), env={})
    msg = str(err.value)
    assert "chunk_tokns" in msg
    assert "typo.toml: backend.reference.options.chunk_tokns: unknown option" in msg
    assert "chunk_tokens" in msg  # the known options are listed


def test_2_unknown_option_is_rejected_by_the_decoder_given_a_policy_path(tmp_path):
    path = tmp_path / "mla.toml"
    path.write_text('[mla]\norder = ["reference"]\n[backend.reference.options]\nchunk_tokns = 64\n')
    with pytest.raises(PolicyError) as err:
        MLADecoder(16, 16, policy=str(path))
    assert f"{path}: backend.reference.options.chunk_tokns: unknown option" in str(err.value)
    with pytest.raises(PolicyError, match="chunk_tokns"):
        MLADecoder(16, 16, policy=parse_policy_text(path.read_text()))


@pytest.mark.parametrize("options, needle", [
    ('chunk_tokens = "64"', "backend.reference.options.chunk_tokens: Input should be a valid integer"),
    ("chunk_tokens = 0", "backend.reference.options.chunk_tokens: Input should be greater than or equal to 1"),
    ("chunk_tokens = 1.5", "backend.reference.options.chunk_tokens: Input should be a valid integer"),
])
def test_2_mistyped_option_names_the_key(options, needle):
    policy = parse_policy_text(f'[mla]\norder = ["reference"]\n[backend.reference.options]\n{options}')
    with pytest.raises(PolicyError, match="chunk_tokens") as err:
        Dispatcher(policy=policy, registry=registry(), env={})
    assert needle in str(err.value)


def test_2_allow_rule_options_are_validated_with_their_index():
    text = """
[mla]
order = ["reference"]
[[backend.reference.allow]]
seq_len_q = [1]
[[backend.reference.allow]]
seq_len_q = [2]
options = { chunk_tokens = "big" }
[[backend.reference.allow]]
seq_len_q = [4]
options = { chunk_tokns = 8 }
"""
    with pytest.raises(PolicyError) as err:
        Dispatcher(policy=parse_policy_text(text, "rules.toml"), registry=registry(), env={})
    msg = str(err.value)
    assert "rules.toml: backend.reference.allow[1].options.chunk_tokens: Input should be a valid integer" in msg
    assert "rules.toml: backend.reference.allow[2].options.chunk_tokns: unknown option" in msg
    assert "allow[0]" not in msg


def test_2_a_mistyped_option_in_the_first_allow_rule_names_allow_0():
    text = '[mla]\norder = ["reference"]\n[[backend.reference.allow]]\noptions = { chunk_tokens = -1 }'
    with pytest.raises(PolicyError, match=r"backend\.reference\.allow\[0\]\.options\.chunk_tokens"):
        Dispatcher(policy=parse_policy_text(text), registry=registry(), env={})


def test_2_options_of_a_backend_not_installed_here_are_kept_for_where_it_is():
    text = """
[mla]
order = ["cutlass_mla", "reference"]
[backend.cutlass_mla.options]
whatever_cutlass_takes = 3
[[backend.cutlass_mla.allow]]
options = { tile = "64x128" }
"""
    from support_backends import registry_without

    d = Dispatcher(policy=parse_policy_text(text), registry=registry_without("mla-cutlass", CORE_ONLY), env={})
    dec = d.select(small_problem())
    assert dec.backend == "reference"
    assert dec.verdict("cutlass_mla").outcome == "not installed"


def test_2_options_of_a_disabled_plugin_are_not_validated_here():
    # flashinfer_mla is an installed distribution; with autoload off it is never imported,
    # so its Options model is unknown here and its options are kept, not rejected
    text = '[mla]\norder = ["flashinfer_mla", "reference"]\n[backend.flashinfer_mla.options]\nvaraint = "fa2"'
    d = Dispatcher(policy=parse_policy_text(text), registry=registry(), env={})
    assert d.select(small_problem()).backend == "reference"


def test_2_options_reach_the_session_and_the_run():
    inp = make_inputs(small_problem(), seed=3)
    text = '[mla]\norder = ["reference"]\n[backend.reference.options]\nchunk_tokens = 64'
    d = Dispatcher(policy=parse_policy_text(text), registry=registry(), env={})
    dec = decoder(d, inp)
    plan = dec.plan(inp.kv_lens, inp.page_table, 2)
    assert plan.options == mlacore.reference.ReferenceOptions(chunk_tokens=64)
    assert plan.planned.chunk_tokens == 64  # not silently dropped on the way to run
    out, lse = dec.run(inp.q, inp.kv_cache, plan)
    assert compare(small_problem(), out, lse, *reference_outputs(small_problem(), inp)).passed


def test_2_options_are_frozen_and_hashable():
    opts = mlacore.reference.ReferenceOptions(chunk_tokens=64)
    assert hash(opts) == hash(mlacore.reference.ReferenceOptions(chunk_tokens=64))
    with pytest.raises(Exception):
        opts.chunk_tokens = 5  # type: ignore[misc]


# -- 3. per-decoder state lives in sessions the decoder owns --------------------------------------


def test_3_each_decoder_opens_its_own_session_and_close_frees_it():
    picky = Picky("p")
    d = dispatcher('[mla]\norder = ["p"]', picky)
    inp = make_inputs(small_problem(), seed=4)
    one, two = decoder(d, inp), decoder(d, inp)
    plan1 = one.plan(inp.kv_lens, inp.page_table, 2)
    plan2 = two.plan(inp.kv_lens, inp.page_table, 2)
    one.plan(inp.kv_lens, inp.page_table, 2)  # a second step reuses the decoder's session
    assert len(picky.sessions) == 2 and picky.sessions[0] is not picky.sessions[1]
    assert picky.sessions[0].plans == 2 and picky.sessions[1].plans == 1
    config, options = picky.opened_with[0]
    assert config.num_heads == 16 and config.sm_scale == inp.sm_scale and config.envelope is None
    one.close()
    assert picky.sessions[0].closed and not picky.sessions[1].closed
    assert picky.closed_sessions == 1
    one.close()  # closing twice closes nothing twice
    assert picky.closed_sessions == 1
    with pytest.raises(MLAInputError, match="closed"):
        one.plan(inp.kv_lens, inp.page_table, 2)
    with pytest.raises(StalePlanError, match="closed"):
        one.run(inp.q, inp.kv_cache, plan1)
    out, _ = two.run(inp.q, inp.kv_cache, plan2)  # the other decoder is untouched
    assert torch.isfinite(out).all()
    with two:
        pass
    assert picky.sessions[1].closed  # `with` closes too


def test_3_a_session_whose_close_raises_does_not_stop_the_others(caplog):
    class BadClose(Picky):
        @hookimpl
        def open(self, config, options):
            session = Picky.open(self, config, options)

            def close():
                raise RuntimeError("double free")
            session.close = close
            return session

    bad, good = BadClose("bad"), Picky("good")
    text = """
[mla]
order = ["bad", "good"]
[[backend.bad.allow]]
max_kv_len = 30
"""
    d = dispatcher(text, bad, good)
    inp = make_inputs(small_problem(), seed=5)
    dec = decoder(d, inp)
    assert dec.plan(inp.kv_lens.clamp(max=30), inp.page_table, 2).backend == "bad"
    assert dec.plan(inp.kv_lens, inp.page_table, 2).backend == "good"
    with caplog.at_level(logging.WARNING, logger="mlacore"):
        dec.close()
    assert good.sessions[0].closed
    assert any("double free" in r.getMessage() for r in caplog.records)


def test_3_the_reference_backend_module_holds_no_state():
    mutable = (dict, list, set, weakref.WeakKeyDictionary, weakref.WeakValueDictionary, torch.Tensor)
    module_state = {k: type(v).__name__ for k, v in vars(mlacore.reference).items()
                    if not k.startswith("__") and isinstance(v, mutable)}
    assert module_state == {}
    backend = mlacore.reference.backend
    before = dict(vars(backend))
    d = Dispatcher(policy=parse_policy_text(REF_ONLY), registry=registry(), env={})
    inp = make_inputs(small_problem(), seed=6)
    decs = [decoder(d, inp, cuda_graph=True, max_batch=4, max_kv_len=64) for _ in range(2)]
    plans = [dec.plan(inp.kv_lens, inp.page_table, 2) for dec in decs]
    assert vars(backend) == before  # nothing kept on the (process-wide) backend object
    # each decoder's graph buffers are its own
    assert plans[0].planned.kv_lens.data_ptr() != plans[1].planned.kv_lens.data_ptr()
    assert plans[0].planned.page_table.data_ptr() != plans[1].planned.page_table.data_ptr()


# -- 4. CUDA-graph mode that cannot go stale ------------------------------------------------------


def two_steps(seed=7):
    """Step 1 and a step 2 of the same batch size over the same cache, with other lengths and table rows."""
    problem = small_problem()
    inp = make_inputs(problem, seed=seed)
    lens2 = (inp.kv_lens.flip(0) - 1).clamp(min=0).to(torch.int32)  # shorter: never reads a poisoned tail
    table2 = inp.page_table.flip(0).contiguous()
    assert not torch.equal(lens2, inp.kv_lens)
    return problem, inp, lens2, table2


def test_4_graph_mode_buffers_keep_their_addresses_and_a_stale_planned_run_sees_the_new_step():
    problem, inp, lens2, table2 = two_steps()
    d = Dispatcher(policy=parse_policy_text(REF_ONLY), registry=registry(), env={})
    graph = decoder(d, inp, cuda_graph=True, max_batch=4, max_kv_len=64)
    eager = decoder(d, inp)

    plan1 = graph.plan(inp.kv_lens, inp.page_table, 2)
    out1, lse1 = graph.run(inp.q, inp.kv_cache, plan1)
    e1, el1 = eager.run(inp.q, inp.kv_cache, eager.plan(inp.kv_lens, inp.page_table, 2))
    torch.testing.assert_close(out1, e1)
    torch.testing.assert_close(lse1, el1)
    assert compare(problem, out1, lse1, *reference_outputs(problem, inp)).passed

    captured = plan1.planned  # what a CUDA graph captured around run() keeps reading
    ptrs = (captured.kv_lens.data_ptr(), captured.page_table.data_ptr())
    plan2 = graph.plan(lens2, table2, 2)
    assert (plan2.planned.kv_lens.data_ptr(), plan2.planned.page_table.data_ptr()) == ptrs
    assert plan2.planned.pages == captured.pages == 4  # walked columns come from the envelope
    assert plan1.graph_fixed and plan2.graph_fixed

    e2, el2 = eager.run(inp.q, inp.kv_cache, eager.plan(lens2, table2, 2))
    assert not torch.allclose(e1.float(), e2.float())
    # a "replay": the planned object of step 1 run after step 2 was planned
    replay_out = torch.full_like(e2, float("nan"))
    replay_lse = torch.full_like(el2, float("nan"))
    captured.run(inp.q, inp.kv_cache, replay_out, replay_lse)
    torch.testing.assert_close(replay_out, e2)
    torch.testing.assert_close(replay_lse, el2)
    out2, lse2 = graph.run(inp.q, inp.kv_cache, plan2)
    torch.testing.assert_close(out2, e2)
    torch.testing.assert_close(lse2, el2)


def test_4_graph_mode_smaller_batch_after_larger_reads_its_own_rows():
    problem, inp, _, _ = two_steps(seed=8)
    d = Dispatcher(policy=parse_policy_text(REF_ONLY), registry=registry(), env={})
    graph = decoder(d, inp, cuda_graph=True, max_batch=4, max_kv_len=64)
    eager = decoder(d, inp)
    graph.plan(inp.kv_lens, inp.page_table, 2)
    lens, table, q = inp.kv_lens[1:], inp.page_table[1:].contiguous(), inp.q[1:].contiguous()
    plan = graph.plan(lens, table, 2)
    assert plan.problem.batch_size == 2
    got, got_lse = graph.run(q, inp.kv_cache, plan)
    want, want_lse = eager.run(q, inp.kv_cache, eager.plan(lens, table, 2))
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_lse, want_lse)


SHORT_LONG = """
[mla]
order = ["short", "long", "reference"]
[[backend.short.allow]]
max_kv_len = 100
[[backend.long.allow]]
min_kv_len = 101
"""


def lens_table(lens):
    lens = torch.tensor(lens, dtype=torch.int32)
    pages = -(-int(lens.max()) // 16)
    table = torch.arange(len(lens) * pages, dtype=torch.int32).reshape(len(lens), pages)
    return lens, table


def test_4_graph_mode_fixes_the_backend_per_batch_size_for_the_decoder_life(caplog):
    short, long_ = Picky("short"), Picky("long")
    d = dispatcher(SHORT_LONG, short, long_)
    eager = MLADecoder(16, 16, dispatcher=d)
    # eagerly the lengths pick the backend
    assert eager.plan(*lens_table([50, 20, 3]), 2).backend == "short"
    assert eager.plan(*lens_table([150, 20, 3]), 2).backend == "long"

    with caplog.at_level(logging.INFO, logger="mlacore"):
        graph = MLADecoder(16, 16, dispatcher=d, cuda_graph=True, max_batch=8, max_kv_len=200)
        first = graph.plan(*lens_table([150, 20, 3]), 2)
        later = graph.plan(*lens_table([50, 20, 3]), 2)  # eagerly this would run on `short`
    assert first.backend == later.backend == "long"
    assert first.graph_fixed and later.graph_fixed
    assert later.planned is not first.planned
    assert len(long_.sessions) == 2  # eager's and graph's
    assert [cfg.envelope is not None for cfg, _ in long_.opened_with] == [False, True]
    assert not any(cfg.envelope is not None for cfg, _ in short.opened_with)
    fixes = [r for r in caplog.records if "fixes" in r.getMessage()]
    assert len(fixes) == 1 and fixes[0].levelno == logging.INFO
    assert "batch 3" in fixes[0].getMessage() and "kv_len 0..200" in fixes[0].getMessage()
    text = graph.explain(3, 50, seq_len_q=2)
    assert "-> long" in text and "fixed for batch 3, seq_len_q 2" in text
    # another batch size and another seq_len_q are decided (once) on their own
    assert graph.plan(*lens_table([50, 20]), 2).graph_fixed
    assert graph.plan(*lens_table([50, 20, 3]), 1).backend == "long"


def test_4_graph_mode_does_not_fix_a_backend_that_says_it_is_not_capturable():
    from mlacore import BackendInfo

    host = Picky("host", info=BackendInfo(description="does host work per run", graph_capturable=False))
    d = dispatcher('[mla]\norder = ["host", "reference"]', host)
    assert MLADecoder(16, 16, dispatcher=d).plan(*lens_table([10, 20]), 1).backend == "host"  # eager: fine
    graph = MLADecoder(16, 16, dispatcher=d, cuda_graph=True, max_batch=4, max_kv_len=64)
    try:
        chosen = graph.plan(*lens_table([10, 20]), 1).backend
    except MLAError:
        chosen = None  # refused loudly: also fine
    assert chosen != "host"


@pytest.mark.gpu
def test_4_cuda_graph_replay_after_a_replan_equals_eager():
    problem, inp_cpu, lens2, table2 = two_steps(seed=9)
    dev = "cuda"
    q, cache = inp_cpu.q.to(dev), inp_cpu.kv_cache.to(dev)
    d = Dispatcher(policy=parse_policy_text(REF_ONLY), registry=registry(), env={})
    graph = MLADecoder(16, 16, dispatcher=d, device=dev, sm_scale=inp_cpu.sm_scale, cuda_graph=True,
                       max_batch=4, max_kv_len=64)
    eager = MLADecoder(16, 16, dispatcher=d, device=dev, sm_scale=inp_cpu.sm_scale)
    out = torch.empty(3, 2, 16, 512, dtype=torch.bfloat16, device=dev)
    lse = torch.empty(3, 2, 16, dtype=torch.float32, device=dev)
    plan1 = graph.plan(inp_cpu.kv_lens.to(dev), inp_cpu.page_table.to(dev), 2,
                       kv_lens_host=inp_cpu.kv_lens, page_table_host=inp_cpu.page_table)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm up outside the capture
            graph.run(q, cache, plan1, out=out, lse=lse)
    torch.cuda.current_stream().wait_stream(stream)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        graph.run(q, cache, plan1, out=out, lse=lse)
    g.replay()
    torch.cuda.synchronize()
    e1, el1 = eager.run(q, cache, eager.plan(inp_cpu.kv_lens.to(dev), inp_cpu.page_table.to(dev), 2))
    torch.testing.assert_close(out, e1)
    torch.testing.assert_close(lse, el1)
    graph.plan(lens2.to(dev), table2.to(dev), 2, kv_lens_host=lens2, page_table_host=table2)
    g.replay()
    torch.cuda.synchronize()
    e2, el2 = eager.run(q, cache, eager.plan(lens2.to(dev), table2.to(dev), 2))
    assert not torch.allclose(e1.float(), e2.float())
    torch.testing.assert_close(out, e2)
    torch.testing.assert_close(lse, el2)


# -- 5. logging -------------------------------------------------------------------------------


def mlacore_records(caplog, level):
    return [r for r in caplog.records if r.name == "mlacore" and r.levelno == level]


def test_5_cpu_fallback_to_reference_logs_no_warning(caplog):
    d = dispatcher('[mla]\norder = ["never"]\nfallback = "reference"', Picky("never", refuse=lambda s: True))
    dec = MLADecoder(16, 16, dispatcher=d)
    with caplog.at_level(logging.DEBUG, logger="mlacore"):
        plan = dec.plan(*lens_table([10, 20]), 1)
    assert plan.backend == "reference" and plan.decision.fallback_used
    assert mlacore_records(caplog, logging.WARNING) == []


def test_5_cuda_fallback_warns_once_per_decoder_and_shape_class(caplog, monkeypatch):
    d = dispatcher('[mla]\norder = ["never"]\nfallback = "reference"', Picky("never", refuse=lambda s: True))
    cuda = DeviceSpec(type="cuda", capability=(9, 0))
    p16 = DecodeProblem(num_heads=16, batch_size=4, max_kv_len=100, page_size=64, device=cuda)
    p128 = p16.model_copy(update={"num_heads": 128})
    dec1, dec2 = MLADecoder(16, 64, dispatcher=d), MLADecoder(16, 64, dispatcher=d)
    for dec in (dec1, dec2):  # a decoder on a CUDA device (none here: only its device is faked)
        monkeypatch.setattr(dec, "device", torch.device("cuda", 0))
        monkeypatch.setattr(dec, "device_spec", cuda)
    with caplog.at_level(logging.INFO, logger="mlacore"):
        for n in (100, 200, 300):  # other lengths, same shape class
            dec1._note_choice(p16.model_copy(update={"max_kv_len": n}), d.select(p16))
        warnings = mlacore_records(caplog, logging.WARNING)
        assert len(warnings) == 1
        msg = warnings[0].getMessage()
        assert "falls back to the pure-torch reference backend" in msg
        assert "never" in msg and "refused by predicate" in msg  # the trace says why
        dec1._note_choice(p128, d.select(p128))  # another shape class: warned once more
        assert len(mlacore_records(caplog, logging.WARNING)) == 2
        dec2._note_choice(p16, d.select(p16))  # another decoder: its own warning
        assert len(mlacore_records(caplog, logging.WARNING)) == 3


@pytest.mark.gpu
def test_5_a_real_cuda_decoder_warns_once_when_it_falls_back_to_reference(caplog):
    d = dispatcher('[mla]\norder = ["never"]\nfallback = "reference"', Picky("never", refuse=lambda s: True))
    dec = MLADecoder(16, 16, dispatcher=d, device="cuda")
    lens, table = lens_table([10, 20])
    with caplog.at_level(logging.WARNING, logger="mlacore"):
        for extra in (0, 1, 2):  # other lengths, same shape class
            plan = dec.plan(lens.cuda() + extra, table.cuda(), 1)
            assert plan.backend == "reference"
    warnings = mlacore_records(caplog, logging.WARNING)
    assert len(warnings) == 1 and "falls back to the pure-torch reference backend" in warnings[0].getMessage()


def test_5_info_when_the_choice_for_a_shape_class_changes(caplog):
    d = dispatcher(SHORT_LONG, Picky("short"), Picky("long"))
    dec = MLADecoder(16, 16, dispatcher=d)
    with caplog.at_level(logging.INFO, logger="mlacore"):
        assert dec.plan(*lens_table([50, 20]), 1).backend == "short"
        assert dec.plan(*lens_table([60, 20]), 1).backend == "short"
        assert mlacore_records(caplog, logging.INFO) == []  # the first choice is no change
        assert dec.plan(*lens_table([150, 20]), 1).backend == "long"
        assert dec.plan(*lens_table([160, 20]), 1).backend == "long"
        infos = mlacore_records(caplog, logging.INFO)
        assert len(infos) == 1
        assert "now runs on long" in infos[0].getMessage() and "was short" in infos[0].getMessage()
        dec.plan(*lens_table([50, 20]), 2)  # another shape class (s_q=2): a first choice, no INFO
        assert len(mlacore_records(caplog, logging.INFO)) == 1
        dec.plan(*lens_table([50, 20]), 1)
        assert len(mlacore_records(caplog, logging.INFO)) == 2


def test_5_debug_trace_on_select_and_nothing_on_the_run_hot_path(caplog):
    d = dispatcher('[mla]\norder = ["never", "reference"]', Picky("never", refuse=lambda s: True))
    inp = make_inputs(small_problem(), seed=10)
    dec = decoder(d, inp)
    with caplog.at_level(logging.DEBUG, logger="mlacore"):
        plan = dec.plan(inp.kv_lens, inp.page_table, 2)
        debug = mlacore_records(caplog, logging.DEBUG)
        assert any("-> reference" in r.getMessage() and "refused by predicate" in r.getMessage()
                   for r in debug)
        caplog.clear()
        for _ in range(3):
            dec.run(inp.q, inp.kv_cache, plan)
        assert [r for r in caplog.records if r.name == "mlacore"] == []


# -- 6. the oracle is essential while it is the fallback --------------------------------------------


def test_6_disabling_reference_with_fallback_reference_fails_at_dispatcher_build():
    env = {"MLA_DISABLE_PLUGINS": "reference", **CORE_ONLY}
    reg = BackendRegistry(env=env).load()
    assert reg.get("reference").status == "disabled"
    policy = parse_policy_text('[mla]\norder = ["reference"]\nfallback = "reference"', "p.toml")
    with pytest.raises(PolicyError) as err:
        Dispatcher(policy=policy, registry=reg, env=env)
    msg = str(err.value)
    assert "MLA_DISABLE_PLUGINS" in msg and "fallback" in msg
    assert msg.startswith("p.toml: ")


def test_6_disabling_reference_with_fallback_error_is_allowed():
    env = {"MLA_DISABLE_PLUGINS": "reference", **CORE_ONLY}
    reg = BackendRegistry(env=env).load()
    policy = parse_policy_text('[mla]\norder = ["reference"]\nfallback = "error"')
    d = Dispatcher(policy=policy, registry=reg, env=env)
    with pytest.raises(NoBackendError) as err:
        d.select(small_problem())
    assert err.value.decision.verdict("reference").outcome == "unavailable"


def test_6_the_default_policy_with_reference_disabled_fails_at_build_too():
    env = {"MLA_DISABLE_PLUGINS": "reference", **CORE_ONLY}
    reg = BackendRegistry(env=env).load()
    with pytest.raises(PolicyError, match="MLA_DISABLE_PLUGINS"):
        Dispatcher(registry=reg, env=env)


# -- 7. pluggy with the grain ------------------------------------------------------------------


def test_7_backend_objects_are_pluggy_plugins_called_through_their_own_hooks():
    a, b = Picky("a"), Picky("b")
    reg = registry(a, b)
    plugins = reg.pm.get_plugins()
    assert a in plugins and b in plugins and reg.get("reference").obj in plugins
    assert reg.pm.get_name(a) == "backend:a"
    impls = [impl.plugin for impl in reg.pm.hook.can_implement.get_hookimpls()]
    assert a in impls and b in impls
    shape = small_problem().shape
    assert reg.get("a").can_implement(shape, a.Options()) == ()
    assert (a.calls, b.calls) == (1, 0)  # a subset caller: a's hook only, never a broadcast
    reg.get("b").limits(shape, b.Options())
    assert (a.limit_calls, b.limit_calls) == (0, 1)


def test_7_one_entry_point_registers_several_backends(with_plugins):
    reg = BackendRegistry(env={}).load()
    objs = [reg.get(n).obj for n in ("chunked_reference", "drops_last_token")]
    assert all(isinstance(o, Backend) for o in objs)
    assert all(o in reg.pm.get_plugins() for o in objs)
    # the plugin module is registered with pluggy as well, for its mla_register_backends hook
    assert reg.pm.get_plugin("plugin:mla_test_good") is not None


class ModeOptions(BackendOptions):
    mode: Literal["fast", "exact"] = "exact"
    depth: int = 1


def test_7_typed_options_reach_can_implement_limits_and_open_as_the_model():
    m = Picky("m", options_model=ModeOptions)
    text = '[mla]\norder = ["m"]\n[backend.m.options]\nmode = "fast"\ndepth = 3'
    d = dispatcher(text, m)
    inp = make_inputs(small_problem(), seed=11)
    dec = decoder(d, inp)
    plan = dec.plan(inp.kv_lens, inp.page_table, 2)
    want = ModeOptions(mode="fast", depth=3)
    assert m.seen_options == [want] and type(m.seen_options[0]) is ModeOptions
    assert plan.options == want and plan.decision.options_dict() == {"mode": "fast", "depth": 3}
    assert m.opened_with[0][1] == want


def test_7_a_real_plugin_gets_its_typed_options(with_plugins):
    reg = BackendRegistry(env={}).load()
    text = '[mla]\norder = ["chunked_reference"]\n[backend.chunked_reference.options]\nchunk_tokens = 32'
    d = Dispatcher(policy=parse_policy_text(text), registry=reg, env={})
    inp = make_inputs(small_problem(), seed=12)
    dec = decoder(d, inp)
    plan = dec.plan(inp.kv_lens, inp.page_table, 2)
    assert plan.backend == "chunked_reference"
    assert type(plan.options).__name__ == "ChunkedOptions" and plan.options.chunk_tokens == 32
    assert plan.planned.chunk_tokens == 32
    out, lse = dec.run(inp.q, inp.kv_cache, plan)
    assert compare(small_problem(), out, lse, *reference_outputs(small_problem(), inp)).passed
    bad = parse_policy_text('[mla]\norder = ["chunked_reference"]\n[backend.chunked_reference.options]\n'
                            'chunk_tokens = "many"')
    with pytest.raises(PolicyError, match=r"backend\.chunked_reference\.options\.chunk_tokens"):
        Dispatcher(policy=bad, registry=reg, env={})


def test_7_the_in_process_register_guards_names():
    from support_backends import registry_without

    reg = registry_without("mla-cutlass", CORE_ONLY)
    reg.register(Picky("x"))
    with pytest.raises(ValueError, match="already registered"):
        reg.register(Picky("x"))
    with pytest.raises(ValueError, match="already registered"):
        reg.register(Picky("reference"))
    with pytest.raises(ValueError, match="reserved for distribution 'mla-cutlass'"):
        reg.register(Picky("cutlass_mla"))
    with pytest.raises(TypeError, match="expected a mlacore.Backend instance"):
        reg.register(object())


def test_7_an_override_without_hookimpl_is_not_silently_treated_as_can_implement_everything():
    class Unmarked(Backend):
        name = "unmarked"

        def can_implement(self, shape, options):  # no @hookimpl
            return ["cannot do anything"]

        @hookimpl
        def open(self, config, options):
            return Picky.open(Picky("inner"), config, options)

    d = dispatcher('[mla]\norder = ["unmarked", "reference"]', Unmarked())
    assert d.select(small_problem()).backend == "reference"


# -- stale plans, errors from backends, the error family ------------------------------------------


def test_stale_plans_are_refused():
    d = Dispatcher(policy=parse_policy_text(REF_ONLY), registry=registry(), env={})
    inp = make_inputs(small_problem(), seed=13)
    dec, other = decoder(d, inp), decoder(d, inp)
    old = dec.plan(inp.kv_lens, inp.page_table, 2)
    new = dec.plan(inp.kv_lens, inp.page_table, 2)
    assert new.generation > old.generation and new.decoder_id == old.decoder_id
    with pytest.raises(StalePlanError, match=r"replaced by a later plan\(\)"):
        dec.run(inp.q, inp.kv_cache, old)
    dec.run(inp.q, inp.kv_cache, new)
    dec.run(inp.q, inp.kv_cache, new)  # the newest plan serves every layer
    foreign = other.plan(inp.kv_lens, inp.page_table, 2)
    with pytest.raises(StalePlanError, match="another MLADecoder"):
        dec.run(inp.q, inp.kv_cache, foreign)
    with pytest.raises(MLAInputError):  # a StalePlanError is an input error
        other.run(inp.q, inp.kv_cache, new)


class Failing(Picky):
    """A backend that fails at one stage: 'open', 'plan', 'plan_type' or 'run'."""

    def __init__(self, name, stage):
        super().__init__(name)
        self.stage = stage

    @hookimpl
    def open(self, config, options):
        if self.stage == "open":
            raise RuntimeError("no workspace")
        if self.stage == "open_type":
            return "a session"
        stage = self.stage

        class S(Session):
            def plan(self, problem, step):
                if stage == "plan":
                    raise ValueError("bad metadata")
                if stage == "plan_type":
                    return None

                class R(Planned):
                    def run(self, q, kv_cache, out, lse):
                        raise RuntimeError("illegal memory access")
                return R()
        return S()


@pytest.mark.parametrize("stage, needle", [
    ("open", "backend 'f' failed to open a session: RuntimeError: no workspace"),
    ("open_type", "backend 'f': open() returned str, expected a mlacore.backend.Session"),
    ("plan", "backend 'f' failed to plan"),
    ("plan_type", "backend 'f': plan() returned NoneType"),
    ("run", "backend 'f' failed to run"),
])
def test_backend_failures_are_backend_errors_naming_the_backend(stage, needle):
    d = dispatcher('[mla]\norder = ["f"]', Failing("f", stage))
    inp = make_inputs(small_problem(), seed=14)
    dec = decoder(d, inp)
    with pytest.raises(BackendError) as err:
        plan = dec.plan(inp.kv_lens, inp.page_table, 2)
        dec.run(inp.q, inp.kv_cache, plan)
    assert needle in str(err.value)
    assert isinstance(err.value, MLAError)


def test_every_error_class_is_an_mla_error():
    classes = [c for _, c in inspect.getmembers(mlacore.errors, inspect.isclass)
               if issubclass(c, BaseException)]
    assert {c.__name__ for c in classes} >= {"MLAError", "MLAInputError", "PolicyError", "NoBackendError",
                                            "BackendError", "StalePlanError"}
    assert all(issubclass(c, MLAError) for c in classes)
    public = [getattr(mlacore, n) for n in mlacore.__all__]
    assert all(issubclass(c, MLAError) for c in public if isinstance(c, type) and issubclass(c, BaseException))
    # the policy and validation modules raise the same classes, not look-alikes
    assert mlacore.policy.PolicyError is PolicyError and mlacore.validation.MLAInputError is MLAInputError
    # and the built-in families still catch them
    assert issubclass(MLAInputError, ValueError) and issubclass(PolicyError, ValueError)
    assert issubclass(NoBackendError, RuntimeError) and issubclass(BackendError, RuntimeError)


def test_statuses_and_outcomes_are_string_enums():
    assert mlacore.BackendStatus.REFUSED == "refused" and str(mlacore.BackendStatus.NOT_INSTALLED) == "not installed"
    assert Outcome.LIMIT == "over a limit" and str(Outcome.CANNOT) == "cannot implement"


def test_4_graph_envelope_min_kv_len_lets_backends_that_refuse_empty_requests_take_part():
    """Engines that never pad with empty requests say so; the fixed choice then honours min_kv_len >= 1."""
    no_empty = Picky("no_empty", limits=Limits(min_kv_len=1, why="zero lengths not verified"))
    d = dispatcher('[mla]\norder = ["no_empty", "reference"]', no_empty)
    padded = MLADecoder(16, 16, dispatcher=d, cuda_graph=True, max_batch=4, max_kv_len=64)
    assert padded.plan(*lens_table([10, 20]), 1).backend == "reference"  # lengths 0.. possible: passed over
    unpadded = MLADecoder(16, 16, dispatcher=d, cuda_graph=True, max_batch=4, max_kv_len=64, min_kv_len=1)
    assert unpadded.plan(*lens_table([10, 20]), 1).backend == "no_empty"
    assert "kv_len 1..64" in unpadded.explain(2, 20, 10, 1)
    with pytest.raises(MLAInputError, match="shorter than the decoder's cuda_graph envelope min_kv_len=1"):
        unpadded.plan(*lens_table([0, 20]), 1)
    with pytest.raises(MLAInputError, match="min_kv_len: 65 is larger than max_kv_len=64"):
        MLADecoder(16, 16, dispatcher=d, cuda_graph=True, max_batch=4, max_kv_len=64, min_kv_len=65)
