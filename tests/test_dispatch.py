"""Dispatcher: order, allow/deny, fallback, trace, cache key completeness, verify switch."""

import threading

import pytest

from mlacore import BackendInfo, BackendRegistry, Dispatcher, NoBackendError, hookimpl
from mlacore.policy import parse_policy_text
from mlacore.problem import DecodeProblem, DeviceSpec
from support_backends import Picky


def make(backends, policy_text, env=None):
    reg = BackendRegistry(env={"MLA_DISABLE_PLUGIN_AUTOLOAD": "1"}).load()
    for name, plugin in backends.items():
        reg.register(plugin, name)
    return Dispatcher(policy=parse_policy_text(policy_text), registry=reg, env=env or {})


P = DecodeProblem(num_heads=16, seq_len_q=1, batch_size=64, max_kv_len=4096, min_kv_len=100,
                  page_size=64, kv_dtype="bf16", device=DeviceSpec(type="cuda", capability=(9, 0)))


def test_first_in_order_wins_and_trace_lists_everyone():
    d = make({"a": Picky(), "b": Picky(), "c": Picky(available=False)},
             '[mla]\norder = ["c", "b", "a", "reference"]')
    dec = d.select(P)
    assert dec.backend == "b"
    out = {v.backend: v.outcome for v in dec.verdicts}
    assert [v.backend for v in dec.verdicts[:4]] == ["c", "b", "a", "reference"]
    assert {k: out[k] for k in "cba"} == {"c": "unavailable", "b": "chosen", "a": "accepted"}
    assert out["reference"] == "accepted"
    assert "no GPU here" in dec.verdict("c").reasons


def test_can_implement_reasons_reach_the_trace():
    d = make({"a": Picky(refuse=lambda p: True)}, '[mla]\norder = ["a", "reference"]')
    dec = d.select(P)
    assert dec.backend == "reference"
    assert dec.verdict("a").outcome == "cannot implement"
    assert dec.verdict("a").reasons == ("refused by predicate",)
    assert "refused by predicate" in dec.format_trace()


def test_allow_and_deny_rules():
    text = """
[mla]
order = ["a", "b", "reference"]
[[backend.a.allow]]
num_heads = [128]
[[backend.a.allow]]
seq_len_q = [1]
min_batch = 32
[[backend.b.deny]]
kv_dtype = ["bf16"]
"""
    d = make({"a": Picky(), "b": Picky()}, text)
    assert d.select(P).backend == "a"  # second allow rule matches
    small = P.model_copy(update={"batch_size": 8})
    dec = d.select(small)
    assert dec.verdict("a").outcome == "policy"
    assert "no policy allow rule matches (2 rules)" in dec.verdict("a").reasons[0]
    assert dec.verdict("b").outcome == "policy"  # bf16 denied
    assert dec.backend == "reference"
    fp8 = small.model_copy(update={"kv_dtype": "fp8_e4m3"})
    assert d.select(fp8).backend == "b"


def test_fallback_reference_and_error():
    refuse = Picky(refuse=lambda p: True)
    d = make({"a": refuse}, '[mla]\norder = ["a"]\nfallback = "reference"')
    dec = d.select(P)
    assert dec.backend == "reference" and dec.fallback_used
    d = make({"a": Picky(refuse=lambda p: True)}, '[mla]\norder = ["a"]\nfallback = "error"')
    with pytest.raises(NoBackendError) as err:
        d.select(P)
    assert "refused by predicate" in str(err.value)
    assert err.value.decision.backend is None


def test_env_override_applies():
    d = make({"a": Picky(), "b": Picky()}, '[mla]\norder = ["a", "b", "reference"]',
             env={"MLA_BACKENDS": "-a"})
    assert d.select(P).backend == "b"


def test_decisions_are_cached_and_reused_across_growing_lengths():
    picky = Picky()
    d = make({"a": picky}, '[mla]\norder = ["a", "reference"]')
    for n in range(4096, 4200):
        assert d.select(P.model_copy(update={"max_kv_len": n})).backend == "a"
    assert picky.calls == 1


FIELD_VARIANTS = {
    "num_heads": 128, "seq_len_q": 2, "page_size": 16, "q_dtype": "fp16", "kv_dtype": "fp8_e4m3",
    "kv_lora_rank": 256, "qk_rope_head_dim": 32, "causal": False, "return_lse": False,
    "device": DeviceSpec(type="cuda", capability=(10, 0)),
}


@pytest.mark.parametrize("field", sorted(FIELD_VARIANTS))
def test_cache_key_completeness_for_every_field(field):
    """Two problems differing only in a field a verdict reads never share a decision."""
    other = P.model_copy(update={field: FIELD_VARIANTS[field]})
    picky = Picky(refuse=lambda p: getattr(p, field) == FIELD_VARIANTS[field])
    d = make({"a": picky}, '[mla]\norder = ["a", "reference"]')
    assert d.select(P).backend == "a"
    assert d.select(other).backend == "reference"
    assert d.select(P).backend == "a"


def test_every_problem_field_is_covered_by_the_completeness_test():
    bucketed = {"batch_size", "max_kv_len", "min_kv_len"}
    assert set(DecodeProblem.model_fields) == set(FIELD_VARIANTS) | bucketed


@pytest.mark.parametrize("field, cut, below, above", [
    ("batch_size", 32, 31, 32), ("max_kv_len", 513, 512, 513), ("min_kv_len", 1, 0, 1),
])
def test_bucketed_fields_split_at_declared_cuts(field, cut, below, above):
    info = BackendInfo(batch_cuts=(cut,)) if field == "batch_size" else BackendInfo(kv_len_cuts=(cut,))
    picky = Picky(refuse=lambda p: getattr(p, field) >= cut, info=info)
    d = make({"a": picky}, '[mla]\norder = ["a", "reference"]')
    lo = P.model_copy(update={field: below, "min_kv_len": 0} if field != "min_kv_len" else {field: below})
    hi = lo.model_copy(update={field: above})
    assert d.select(lo).backend == "a"
    assert d.select(hi).backend == "reference"


def test_policy_rule_bounds_split_the_cache():
    d = make({"a": Picky()}, """
[mla]
order = ["a", "reference"]
[[backend.a.allow]]
min_batch = 33
max_kv_len = 8192
""")
    assert d.select(P.model_copy(update={"batch_size": 32})).backend == "reference"
    assert d.select(P.model_copy(update={"batch_size": 33})).backend == "a"
    assert d.select(P.model_copy(update={"batch_size": 33, "max_kv_len": 8192})).backend == "a"
    assert d.select(P.model_copy(update={"batch_size": 33, "max_kv_len": 8193})).backend == "reference"


def test_verify_switch_reports_an_undeclared_cut():
    # reads batch_size without declaring a cut: the cache would serve a stale decision
    picky = Picky(refuse=lambda p: p.batch_size > 100)
    d = make({"a": picky}, '[mla]\norder = ["a", "reference"]', env={"MLA_DISPATCH_VERIFY": "1"})
    assert d.select(P).backend == "a"
    with pytest.warns(RuntimeWarning, match="dispatch cache disagrees"):
        assert d.select(P.model_copy(update={"batch_size": 128})).backend == "reference"
    assert len(d.mismatches) == 1
    # without the switch the stale answer is what a cache gives: that is why the switch exists
    d2 = make({"a": Picky(refuse=lambda p: p.batch_size > 100)}, '[mla]\norder = ["a", "reference"]')
    d2.select(P)
    assert d2.select(P.model_copy(update={"batch_size": 128})).backend == "a"


def test_select_is_thread_safe_and_consistent():
    d = make({"a": Picky(refuse=lambda p: p.num_heads == 128)}, '[mla]\norder = ["a", "reference"]')
    problems = [P.model_copy(update={"num_heads": h, "max_kv_len": 1000 + i})
                for i in range(200) for h in (16, 128)]
    results = {}

    def work(tid):
        results[tid] = [d.select(p).backend for p in problems]

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    expected = ["a" if p.num_heads == 16 else "reference" for p in problems]
    assert all(r == expected for r in results.values())


def test_same_inputs_same_decision_in_fresh_dispatchers():
    """The decision is a pure function: fresh dispatchers (other ranks) agree."""
    text = '[mla]\norder = ["a", "b", "reference"]\n[[backend.a.allow]]\nnum_heads=[128]'
    picks = {make({"a": Picky(), "b": Picky()}, text).select(P).backend for _ in range(5)}
    assert picks == {"b"}


def test_allow_rule_options_reach_can_implement_and_the_decision():
    # the backend can only take s_q=2 with variant b; rules pick the variant per shape
    class VariantPicky(Picky):
        @hookimpl
        def mla_can_implement(self, problem, options):
            return [] if problem.seq_len_q == 1 or options.get("variant") == "b" else ["s_q=2 needs variant b"]

    d = make({"x": VariantPicky()}, """
[mla]
order = ["x", "reference"]
[backend.x.options]
variant = "a"
workspace = 1
[[backend.x.allow]]
seq_len_q = [2]
options = { variant = "b" }
[[backend.x.allow]]
seq_len_q = [1]
""")
    one = d.select(P)
    assert one.backend == "x" and one.options == {"variant": "a", "workspace": 1}
    two = d.select(P.model_copy(update={"seq_len_q": 2}))
    assert two.backend == "x" and two.options == {"variant": "b", "workspace": 1}
