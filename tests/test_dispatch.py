"""Dispatcher: order, allow/deny, fallback, trace, cache key completeness, verify switch."""

import threading
from typing import Literal

import pytest

from mlacore import BackendOptions, BackendRegistry, Dispatcher, Limits, NoBackendError, hookimpl
from mlacore.policy import parse_policy_text
from mlacore.problem import DecodeProblem, DecodeShape, DeviceSpec
from support_backends import Picky


def make(backends, policy_text, env=None):
    """A dispatcher over mlacore's reference and the given backends (name -> Picky), nothing else."""
    reg = BackendRegistry(env={"MLA_DISABLE_PLUGIN_AUTOLOAD": "1"}).load()
    for name, backend in backends.items():
        backend.name = name
        reg.register(backend)
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
strict_allow = true
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


OUTSIDE = "outside its allow rules"


def test_outside_its_allow_rules_a_kernel_comes_before_the_reference():
    """mla.strict_allow = false (the default): allow rules are preferences, so a shape no backend takes within its
    rules goes to the first kernel in order that the allow rules alone kept off; deny rules, can_implement and the
    order (nothing after the reference) still hold."""
    text = """
[mla]
order = ["a", "b", "c", "reference"]
[[backend.a.allow]]
num_heads = [128]
[[backend.a.deny]]
max_batch = 8
[[backend.b.allow]]
num_heads = [128]
[[backend.c.allow]]
num_heads = [128]
"""
    d = make({"a": Picky(), "b": Picky(refuse=lambda shape: True), "c": Picky()}, text)
    dec = d.select(P)  # H=16 B=64: every allow rule misses; a is not denied at B=64, b cannot implement
    assert dec.backend == "a" and not dec.fallback_used
    assert dec.verdict("a").reasons[0].startswith(OUTSIDE)
    assert "num_heads=16 not in [128]" in dec.verdict("a").reasons[1]
    assert dec.verdict("reference").outcome == "accepted"
    assert dec.verdict("c").outcome == "policy"
    small = P.model_copy(update={"batch_size": 8})  # a denied, b cannot: c, the next one outside its rules
    dec = d.select(small)
    assert dec.backend == "c" and dec.verdict("a").outcome == "policy"
    assert dec.verdict("a").reasons[-1].startswith("policy deny[0] matches")
    assert dec.verdict("b").outcome == "cannot implement"
    assert d.select(P.model_copy(update={"num_heads": 128})).verdict("a").reasons == ()  # inside its rule


def test_outside_allow_rules_nothing_after_the_reference_and_strict_allow():
    text = '[mla]\norder = ["reference", "a"]\n[[backend.a.allow]]\nnum_heads = [128]\n'
    assert make({"a": Picky()}, text).select(P).backend == "reference"
    text = '[mla]\norder = ["a"]\nfallback = "error"\n[[backend.a.allow]]\nnum_heads = [128]\n'
    dec = make({"a": Picky()}, text).select(P)  # no reference in order: before the fallback too
    assert dec.backend == "a" and dec.verdict("a").reasons[0].startswith(OUTSIDE)
    strict = text.replace('fallback = "error"', 'fallback = "error"\nstrict_allow = true')
    with pytest.raises(NoBackendError, match="no policy allow rule matches|allow rule does not match"):
        make({"a": Picky()}, strict).select(P)
    with pytest.raises(Exception, match="strict_allow"):
        make({"a": Picky()}, '[mla]\norder = ["a"]\nstrict_allow = "yes"\n')


def test_outside_allow_passes_over_a_rule_that_matched_and_a_denied_reference():
    """Only a backend judged 'policy' for its allow rules alone is taken: X's rule matches but its options cannot
    take the shape (can_implement), so Y is chosen; a reference the policy denies does not end the search."""
    from mlacore import hookimpl

    class Opts(BackendOptions):
        variant: Literal["fa2", "fa3"] = "fa3"

    class ByVariant(Picky):
        @hookimpl
        def can_implement(self, shape, options):
            return ["fa2 refuses"] if options.variant == "fa2" else []

    text = """
[mla]
order = ["X", "Y", "reference"]
[backend.X.options]
variant = "fa3"
[[backend.X.allow]]
num_heads = [16]
options = { variant = "fa2" }
[[backend.Y.allow]]
num_heads = [128]
"""
    dec = make({"X": ByVariant(options_model=Opts), "Y": Picky()}, text).select(P)
    assert dec.backend == "Y" and dec.verdict("X").outcome == "cannot implement"
    later = text.replace('order = ["X", "Y", "reference"]', 'order = ["X", "reference", "Y"]\nfallback = "error"')
    assert make({"X": ByVariant(options_model=Opts), "Y": Picky()}, later).select(P).backend == "reference"
    denied = later + "[[backend.reference.deny]]\nnum_heads = [16]\n"
    dec = make({"X": ByVariant(options_model=Opts), "Y": Picky()}, denied).select(P)
    assert dec.backend == "Y" and dec.verdict("reference").outcome == "policy"


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
        assert d.select(P.model_copy(update={"max_kv_len": n, "batch_size": n - 4000})).backend == "a"
    assert picky.calls == 1 and picky.limit_calls == 1
    # what the plugin saw is the shape class alone: no batch size, no lengths
    assert all(type(s) is DecodeShape for s in picky.seen_shapes)


FIELD_VARIANTS = {
    "num_heads": 128, "seq_len_q": 2, "page_size": 16, "q_dtype": "fp16", "kv_dtype": "fp8_e4m3",
    "kv_lora_rank": 256, "qk_rope_head_dim": 32, "causal": False, "return_lse": False,
    "out_dtype": "fp32", "scale_inputs": "tensor",
    "device": DeviceSpec(type="cuda", capability=(10, 0)),
}


@pytest.mark.parametrize("field", sorted(FIELD_VARIANTS))
def test_cache_key_completeness_for_every_field(field):
    """Two problems differing only in a field a verdict reads never share a decision."""
    other = P.model_copy(update={field: FIELD_VARIANTS[field]})
    picky = Picky(refuse=lambda s: getattr(s, field) == FIELD_VARIANTS[field])
    d = make({"a": picky}, '[mla]\norder = ["a", "reference"]')
    assert d.select(P).backend == "a"
    assert d.select(other).backend == "reference"
    assert d.select(P).backend == "a"


def test_every_problem_field_is_covered_by_the_completeness_test():
    per_problem = {"batch_size", "max_kv_len", "min_kv_len"}  # evaluated by the core through Limits
    assert set(DecodeShape.model_fields) == set(FIELD_VARIANTS)
    assert set(DecodeProblem.model_fields) == set(FIELD_VARIANTS) | per_problem


@pytest.mark.parametrize("field, limits, inside, outside, needle", [
    ("batch_size", Limits(max_batch=31), 31, 32, "batch=32 > max_batch=31"),
    ("max_kv_len", Limits(max_kv_len=512), 512, 513, "max_kv_len=513 > the backend's max_kv_len=512"),
    ("min_kv_len", Limits(min_kv_len=1), 1, 0, "min_kv_len=0 < the backend's min_kv_len=1"),
])
def test_declared_limits_are_evaluated_on_every_problem(field, limits, inside, outside, needle):
    picky = Picky(limits=limits)
    d = make({"a": picky}, '[mla]\norder = ["a", "reference"]')
    base = P.model_copy(update={"min_kv_len": 1, "max_kv_len": 600, "batch_size": 16})
    ok = base.model_copy(update={field: inside})
    over = base.model_copy(update={field: outside})
    for _ in range(2):  # cached or not, the limits decide
        assert d.select(ok).backend == "a"
        dec = d.select(over)
        assert dec.backend == "reference"
        assert dec.verdict("a").outcome == "over a limit"
        assert needle in dec.verdict("a").reasons[0]
    assert picky.calls == 1 and picky.limit_calls == 1


def test_policy_rule_bounds_split_the_cache():
    d = make({"a": Picky()}, """
[mla]
order = ["a", "reference"]
strict_allow = true
[[backend.a.allow]]
min_batch = 33
max_kv_len = 8192
""")
    assert d.select(P.model_copy(update={"batch_size": 32})).backend == "reference"
    assert d.select(P.model_copy(update={"batch_size": 33})).backend == "a"
    assert d.select(P.model_copy(update={"batch_size": 33, "max_kv_len": 8192})).backend == "a"
    assert d.select(P.model_copy(update={"batch_size": 33, "max_kv_len": 8193})).backend == "reference"


def flip_after(n):
    """A refuse predicate that is not a function of the shape: it changes its mind after n calls."""
    seen = []

    def refuse(shape):
        seen.append(shape)
        return len(seen) > n
    return refuse


def test_verify_switch_reports_a_plugin_that_is_not_a_function_of_the_shape():
    d = make({"a": Picky(refuse=flip_after(1))}, '[mla]\norder = ["a", "reference"]',
             env={"MLA_DISPATCH_VERIFY": "1"})
    assert d.select(P).backend == "a"
    with pytest.warns(RuntimeWarning, match="answered differently for the same shape"):
        assert d.select(P.model_copy(update={"batch_size": 128})).backend == "reference"
    assert len(d.mismatches) == 1 and d.mismatches[0][0] == "a"
    # without the switch the cached answer is what a cache gives: that is why the switch exists
    d2 = make({"a": Picky(refuse=flip_after(1))}, '[mla]\norder = ["a", "reference"]')
    d2.select(P)
    assert d2.select(P.model_copy(update={"batch_size": 128})).backend == "a"
    assert d2.mismatches == []


def test_select_is_thread_safe_and_consistent():
    d = make({"a": Picky(refuse=lambda s: s.num_heads == 128)}, '[mla]\norder = ["a", "reference"]')
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


class VariantOptions(BackendOptions):
    variant: Literal["a", "b"] = "a"
    workspace: int = 0


class VariantPicky(Picky):
    """Can take s_q=2 with variant b only."""

    Options = VariantOptions

    @hookimpl
    def can_implement(self, shape, options):
        self.seen_options.append(options)
        return [] if shape.seq_len_q == 1 or options.variant == "b" else ["s_q=2 needs variant b"]


def test_allow_rule_options_reach_can_implement_and_the_decision():
    # the backend can only take s_q=2 with variant b; rules pick the variant per shape
    x = VariantPicky()
    d = make({"x": x}, """
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
    assert one.backend == "x" and one.options == VariantOptions(variant="a", workspace=1)
    assert one.options_dict() == {"variant": "a", "workspace": 1}
    two = d.select(P.model_copy(update={"seq_len_q": 2}))
    assert two.backend == "x" and two.options == VariantOptions(variant="b", workspace=1)
    assert two.options_dict() == {"variant": "b", "workspace": 1}
    assert {type(o) for o in x.seen_options} == {VariantOptions}
    # options are part of the cache key: one answer per (shape, options)
    assert len(x.seen_options) == 2


def test_allow_rules_try_options_in_order_until_one_is_accepted():
    # two rules match s_q=2: variant a is tried first and refused, variant b is taken
    d = make({"x": VariantPicky()}, """
[mla]
order = ["x", "reference"]
[[backend.x.allow]]
seq_len_q = [2]
[[backend.x.allow]]
seq_len_q = [2]
options = { variant = "b" }
""")
    dec = d.select(P.model_copy(update={"seq_len_q": 2}))
    assert dec.backend == "x" and dec.options.variant == "b"


def test_decision_for_an_unavailable_backend_says_why_and_asks_nothing():
    c = Picky(available=False)
    d = make({"c": c}, '[mla]\norder = ["c", "reference"]')
    dec = d.select(P)
    assert dec.backend == "reference"
    assert dec.verdict("c").reasons == ("unavailable", "no GPU here")
    assert c.calls == 0 and c.limit_calls == 0
