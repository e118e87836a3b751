"""Regression tests for issue 9 (hardening): one or more tests per numbered item.

1. a plugin's wrong-typed hook result broke every decode and the CLI;
2. another distribution could take over `reference` (or a first-party name);
3. `mla policy check` / `MLA_POLICY` raised UnicodeDecodeError, RecursionError;
4. policy validation was lax (strings, floats, booleans as ints; empty and non-positive sets);
5. `run` accepted another decoder's plan;
6. the custom op validated less than the decoder;
7. smaller silent or unclear cases, one test each.

Plugins are real distributions (tests/plugin_packages/mla_test_wrongtypes and the
others, installed by the `plugin_site` fixture). Every error is an `MLAError`
subclass whose message names the argument, file or plugin; a broken plugin is
listed `broken` (or `refused`) with a one-line reason and nothing else notices.
"""

import json
import subprocess
import sys
from importlib import metadata

import pytest
import torch

import mlacore.ops
from mlacore import (
    BackendRegistry,
    Dispatcher,
    MLADecoder,
    MLAError,
    MLAInputError,
    PolicyError,
    StalePlanError,
    load_policy,
    parse_policy,
    parse_policy_text,
)
from mlacore.errors import BackendStatus, Outcome
from mlacore.ops import mla_decode
from mlacore.policy import effective_order
from mlacore.problem import DecodeProblem
from mlacore.testing import compare, make_inputs, reference_outputs
from mlacore.validation import check_lengths_and_table
from mla_test_helpers import subprocess_env

WT = "mla-test-wrongtypes"
CORE_ONLY = {"MLA_DISABLE_PLUGIN_AUTOLOAD": "1"}


def problem(**kw):
    base = dict(num_heads=16, seq_len_q=1, batch_size=2, min_kv_len=1, max_kv_len=40, page_size=16)
    base.update(kw)
    return DecodeProblem(**base)


def one_line(text):
    return "\n" not in text and "\r" not in text


@pytest.fixture
def reg(with_plugins):
    """A fresh registry of every installed test distribution (the wrong-typed ones included)."""
    return BackendRegistry(env={}).load()


def dispatcher_for(reg, order, fallback="reference", env=None):
    policy = parse_policy({"mla": {"order": list(order), "fallback": fallback}})
    return Dispatcher(policy=policy, registry=reg, env=dict(env or {}))


def decode_matches_reference(disp, expect_backend="reference", seed=5):
    """One real plan+run through MLADecoder; its output equals the fp64 reference."""
    p = problem()
    inp = make_inputs(p, seed=seed)
    dec = MLADecoder(16, 16, dispatcher=disp, sm_scale=inp.sm_scale)
    plan = dec.plan(inp.kv_lens, inp.page_table)
    assert plan.backend == expect_backend
    out, lse = dec.run(inp.q, inp.kv_cache, plan)
    res = compare(p, out, lse, *reference_outputs(p, inp))
    assert res.passed, res.messages
    return plan


# -- 1. wrong-typed hook results --------------------------------------------------------------------

# (backend, what its reason must say): every reason names the hook and what came back
WRONG_TYPED = [
    ("wt_can_implement_false", "can_implement() returned bool False, expected a list of reason strings"),
    ("wt_can_implement_str", "can_implement() returned str 'needs a GPU', expected a list of reason strings"),
    ("wt_can_implement_mixed", "can_implement() returned list ['page_size too small', 3]"),
    ("wt_can_implement_none", "can_implement() returned NoneType None"),
    ("wt_availability_str", "availability() raised ValidationError: Availability.reasons: Input should be a "
                            "valid tuple, got 'no GPU here'"),
    ("wt_availability_none", "availability() raised ValidationError: Availability.reasons: Input should be a "
                             "valid tuple, got None"),
    ("wt_availability_false", "availability() returned bool False, expected Availability"),
    ("wt_availability_tampered", "availability() returned an invalid Availability: ValidationError: "
                                 "Availability.reasons"),
    ("wt_info_notes_none", "info() raised ValidationError: BackendInfo.notes: Input should be a valid tuple, "
                           "got None"),
    ("wt_info_str", "info() returned str 'a fast kernel', expected BackendInfo"),
    ("wt_limits_str", "limits() returned str '64', expected Limits"),
    ("wt_limits_bad", "limits() raised ValidationError: Limits.max_batch: Input should be a valid integer, "
                      "got '64'"),
    ("wt_options_str", "backend 'wt_options_str': Options is str 'variant', expected a subclass of "
                       "mlacore.BackendOptions"),
    ("wt_options_required", "Options() raised ValidationError: RequiredOptions.variant: Field required"),
    ("wt_options_unhashable", "Options instances are not hashable"),
]


@pytest.mark.parametrize("name,needle", WRONG_TYPED, ids=[n for n, _ in WRONG_TYPED])
def test_1_a_wrong_typed_hook_result_breaks_that_backend_only(reg, name, needle):
    handle = reg.get(name)
    assert handle is not None and handle.distribution == WT
    # first in the order: the first dispatch already passes it over (limits() used to be
    # taken as "no limits" and the backend chosen), and decoding goes on on the reference
    disp = dispatcher_for(reg, [name, "reference"])
    first = disp.select(problem())
    assert first.backend == "reference"
    assert not first.verdict(name).accepts
    assert handle.status == BackendStatus.BROKEN == "broken"
    reasons = handle.reasons()
    assert any(needle in r for r in reasons), reasons
    assert all(one_line(r) and len(r) > 1 for r in reasons), reasons  # whole sentences, not characters
    # from then on it is unavailable, with the same reason, and decoding is right
    again = disp.explain(problem(batch_size=1))
    assert again.verdict(name).outcome == Outcome.UNAVAILABLE
    assert "broken" in again.verdict(name).reasons and any(needle in r for r in again.verdict(name).reasons)
    decode_matches_reference(disp)


def test_1_wrong_typed_backends_out_of_the_order_do_not_break_plan_explain_or_select(reg):
    """`explain` judges every installed backend; none of them may make plan or explain raise."""
    disp = dispatcher_for(reg, ["reference"])
    decision = disp.explain(problem())
    assert decision.backend == "reference"
    by_name = {v.backend: v for v in decision.verdicts}
    for name, needle in WRONG_TYPED:
        assert by_name[name].outcome == Outcome.NOT_IN_ORDER
        assert any(needle in r for r in by_name[name].reasons), (name, by_name[name].reasons)
    decode_matches_reference(disp)
    decode_matches_reference(Dispatcher(policy=load_policy(env={}), registry=reg, env={}))


def test_1_list_reasons_are_whole_sentences(reg):
    """`Availability(False, "no GPU here")` used to list its reasons one character at a time."""
    for name in ("wt_availability_str", "wt_availability_tampered"):
        reasons = reg.get(name).reasons()
        assert len(reasons) == 1 and "no GPU here" in reasons[0], reasons


def test_1_a_plugin_calling_sys_exit_in_a_hook_is_a_reason_not_the_end(reg):
    disp = dispatcher_for(reg, ["wt_exits", "reference"])
    decision = disp.select(problem())
    assert decision.backend == "reference"
    assert decision.verdict("wt_exits").reasons == ("can_implement raised SystemExit: 3",)


@pytest.mark.parametrize("name", ["wt_info_kv_len_cuts", "wt_info_batch_cuts"])
def test_1_backend_info_with_a_field_of_the_first_contract_is_broken(reg, name):
    handle = reg.get(name)
    assert handle.status == "broken"
    assert any("info() raised ValidationError" in r and "cuts" in r for r in handle.reasons())


def test_1_wrong_option_models_never_reach_a_dispatcher(reg):
    """A plugin's Options that is no model, needs a value or cannot be hashed used to crash every
    Dispatcher (so every MLADecoder and `mla policy check`): now only that backend is broken."""
    disp = Dispatcher(policy=load_policy(env={}), registry=reg, env={})
    for name in ("wt_options_str", "wt_options_required", "wt_options_unhashable"):
        assert name not in disp.options
        assert reg.get(name).status == "broken"
    # a policy keeping options for such a backend is not validated against the broken model
    text = '[mla]\norder = ["reference"]\n[backend.wt_options_str.options]\nvariant = "a"\n'
    Dispatcher(policy=parse_policy_text(text), registry=reg, env={})


def test_1_a_plugin_option_error_is_one_line_and_a_validator_bug_is_a_policy_error(reg):
    text = '[mla]\norder = ["reference"]\n[backend.wt_options_multiline.options]\nvariant = "zz"\n'
    with pytest.raises(PolicyError) as err:
        Dispatcher(policy=parse_policy_text(text, "p.toml"), registry=reg, env={})
    assert str(err.value) == "p.toml: backend.wt_options_multiline.options.variant: unknown variant " \
                             "known variants: a b"
    text = '[mla]\norder = ["reference"]\n[[backend.wt_options_multiline.allow]]\noptions = { variant = "boom" }\n'
    with pytest.raises(PolicyError) as err:
        Dispatcher(policy=parse_policy_text(text, "p.toml"), registry=reg, env={})
    msg = str(err.value)
    assert one_line(msg)
    assert msg.startswith("p.toml: backend.wt_options_multiline.allow[0].options: ")
    assert "ChattyOptions raised TypeError: the validator itself has a bug" in msg


# -- 1 and 3: the CLI with wrong-typed plugins installed -------------------------------------------


def run_cli(*args, plugin_site=None, **env):
    return subprocess.run([sys.executable, "-m", "mlacore", *args], capture_output=True, text=True,
                          env=subprocess_env(plugin_site, **env), timeout=300)


def no_traceback(proc):
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_cli_backends_list_with_wrong_typed_plugins(plugin_site):
    proc = run_cli("backends", "list", "--json", plugin_site=plugin_site)
    no_traceback(proc)
    assert proc.returncode == 0, proc.stderr
    rows = {r["name"]: r for r in json.loads(proc.stdout)["backends"]}
    # listing judges availability and info only: these are known broken without a dispatch
    listed_broken = {n: s for n, s in WRONG_TYPED
                     if not n.startswith(("wt_can_implement", "wt_limits"))}
    for name, needle in listed_broken.items():
        row = rows[name]
        assert row["status"] == "broken", row
        assert row["distribution"] == WT
        assert any(needle in r for r in row["reasons"]), row
        assert all(len(r) > 1 and one_line(r) for r in row["reasons"]), row
    assert rows["reference"]["status"] == "available" and rows["reference"]["distribution"] == "mlacore"
    assert rows[f"reference@{WT}"]["status"] == "refused"
    proc = run_cli("backends", "list", plugin_site=plugin_site)
    no_traceback(proc)
    assert proc.returncode == 0 and "wt_info_str" in proc.stdout and "broken" in proc.stdout


def test_cli_backends_explain_with_wrong_typed_plugins(plugin_site, tmp_path):
    proc = run_cli("backends", "explain", "--num-heads", "16", "--device", "cpu", "--json",
                   plugin_site=plugin_site)
    no_traceback(proc)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["chosen"] == "reference"
    verdicts = {v["backend"]: v for v in data["verdicts"]}
    for name, needle in WRONG_TYPED:
        assert any(needle in r for r in verdicts[name]["reasons"]), verdicts[name]
    proc = run_cli("backends", "explain", "--num-heads", "16", "--device", "cpu", plugin_site=plugin_site)
    no_traceback(proc)
    assert proc.returncode == 0 and "chosen: reference" in proc.stdout
    # only wrong-typed backends in the order and no fallback: exit 1 (no backend), not a traceback
    pol = tmp_path / "p.toml"
    pol.write_text('[mla]\norder = ["wt_can_implement_str", "wt_limits_str", "wt_availability_none"]\n'
                   'fallback = "error"\n')
    proc = run_cli("backends", "explain", "--num-heads", "16", "--device", "cpu", "--policy", str(pol),
                   plugin_site=plugin_site)
    no_traceback(proc)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "no backend takes this problem" in proc.stdout


def test_cli_check_quick_with_wrong_typed_plugins(plugin_site):
    # drops_last_token (mla-test-good) is wrong on purpose; everything else must pass or be skipped
    proc = run_cli("check", "--quick", "--device", "cpu", plugin_site=plugin_site,
                   MLA_DISABLE_PLUGINS="drops_last_token")
    no_traceback(proc)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr
    assert " 0 failed" in proc.stdout
    assert "wt_limits_str" not in proc.stdout or "FAIL" not in proc.stdout


def test_cli_policy_check_with_wrong_typed_plugins(plugin_site, tmp_path):
    good = tmp_path / "good.toml"
    good.write_text('[mla]\norder = ["wt_can_implement_false", "reference"]\n')
    proc = run_cli("policy", "check", str(good), plugin_site=plugin_site)
    no_traceback(proc)
    assert proc.returncode == 0, proc.stderr
    bad = tmp_path / "bad.toml"
    bad.write_text('[mla]\norder = ["reference"]\n[backend.wt_options_multiline.options]\nvariant = "zz"\n')
    proc = run_cli("policy", "check", str(bad), plugin_site=plugin_site)
    no_traceback(proc)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        f"mla: error: {bad}: backend.wt_options_multiline.options.variant: unknown variant known variants: a b"]


# -- 2. reserved names ------------------------------------------------------------------------------


def test_2_an_entry_point_named_reference_earlier_on_sys_path_does_not_serve_reference(reg):
    # the situation of the issue: another distribution's `reference` entry point comes first
    refs = [ep.dist.metadata["Name"] for ep in metadata.entry_points(group="mlacore.backends")
            if ep.name == "reference"]
    assert refs.index(WT) < refs.index("mlacore"), refs
    ref = reg.get("reference")
    assert ref.distribution == "mlacore" and ref.status == "available"
    assert type(ref.obj).__module__ == "mlacore.reference"
    impostor = reg.get(f"reference@{WT}")
    assert impostor.status == BackendStatus.REFUSED == "refused"
    assert impostor.obj is None
    assert impostor.reasons() == (f"the name 'reference' is reserved for distribution 'mlacore'; "
                                  f"distribution '{WT}' may not register it",)
    # the impostor's run writes 42s: decoding on `reference` is the real oracle
    decode_matches_reference(dispatcher_for(reg, ["reference"]))


def test_2_first_party_names_are_reserved_to_their_distributions(with_plugins):
    from support_backends import registry_without

    reg = registry_without("mla-cutlass")
    impostor = reg.get(f"cutlass_mla@{WT}")
    assert impostor.status == "refused"
    assert "reserved for distribution 'mla-cutlass'" in impostor.reasons()[0]
    assert WT in impostor.reasons()[0]
    assert reg.get("cutlass_mla") is None  # the real one is not installed here, and nothing took its place
    disp = dispatcher_for(reg, ["cutlass_mla", "reference"])
    decision = disp.select(problem())
    assert decision.verdict("cutlass_mla").outcome == Outcome.NOT_INSTALLED
    decode_matches_reference(disp)


def test_2_the_in_process_register_refuses_reserved_names_with_an_mla_error():
    from support_backends import Picky

    reg = BackendRegistry(env=CORE_ONLY).load()
    for name, owner in (("reference", "mlacore"), ("flashinfer_mla", None), ("cute_dsl_mla", "mla-cute-dsl")):
        with pytest.raises(MLAInputError) as err:
            reg.register(Picky(name))
        assert f"'{name}'" in str(err.value)
        if owner:
            assert owner in str(err.value)
    assert reg.get("reference").distribution == "mlacore"


# -- 3. policy files that are not UTF-8, or nested too deeply ----------------------------------------

BODY = '[mla]\norder = ["reference"]\n'
NOT_UTF8 = {
    "xff-in-comment": b"# \xff\n" + BODY.encode(),
    "latin-1": ("# caf\u00e9\n" + BODY).encode("latin-1"),
    "utf-16": BODY.encode("utf-16"),
    "truncated-multibyte": BODY.encode() + "# \u00e9".encode()[:-1],
}


@pytest.mark.parametrize("kind", list(NOT_UTF8))
def test_3_a_policy_file_that_is_not_utf8_is_a_policy_error_naming_the_file(tmp_path, kind, monkeypatch):
    path = tmp_path / f"{kind}.toml"
    path.write_bytes(NOT_UTF8[kind])
    with pytest.raises(PolicyError) as err:
        load_policy(path)
    msg = str(err.value)
    assert msg.startswith(f"{path}: not UTF-8") and one_line(msg), msg
    # the same file through MLA_POLICY, as an engine meets it
    monkeypatch.setenv("MLA_POLICY", str(path))
    with pytest.raises(PolicyError, match="not UTF-8") as err:
        MLADecoder(16, 16)
    assert str(path) in str(err.value)


@pytest.mark.parametrize("nested", ["x = " + "[" * 5000 + "]" * 5000,
                                    "x = " + "{a = " * 5000 + "1" + "}" * 5000])
def test_3_toml_nested_5000_deep_is_a_policy_error_naming_the_file(tmp_path, nested):
    path = tmp_path / "deep.toml"
    path.write_text(BODY + "[backend.reference.options]\n" + nested + "\n")
    with pytest.raises(PolicyError) as err:
        Dispatcher(policy=load_policy(path), registry=BackendRegistry(env=CORE_ONLY).load(), env={})
    assert str(path) in str(err.value) and "nested too deeply" in str(err.value)
    assert one_line(str(err.value))


def test_3_a_utf8_bom_is_accepted(tmp_path):
    path = tmp_path / "bom.toml"
    path.write_bytes(b"\xef\xbb\xbf" + BODY.encode())
    assert load_policy(path).mla.order == ("reference",)


def test_3_cli_policy_check_on_bad_files_is_one_line_exit_2(tmp_path):
    cases = {"latin.toml": NOT_UTF8["latin-1"], "u16.toml": NOT_UTF8["utf-16"],
             "deep.toml": (BODY + "x = " + "[" * 5000 + "]" * 5000 + "\n").encode()}
    for fname, data in cases.items():
        path = tmp_path / fname
        path.write_bytes(data)
        proc = run_cli("policy", "check", str(path))
        no_traceback(proc)
        assert proc.returncode == 2, proc.stderr
        lines = proc.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"mla: error: {path}: "), lines
    bom = tmp_path / "bom.toml"
    bom.write_bytes(b"\xef\xbb\xbf" + BODY.encode())
    proc = run_cli("policy", "check", str(bom))
    assert proc.returncode == 0, proc.stderr


# -- 4. strict policy types -------------------------------------------------------------------------

LAX = [
    ("min_batch", '"32"', "allow[0].min_batch", "got '32'"),
    ("max_kv_len", "true", "allow[0].max_kv_len", "valid integer"),
    ("min_batch", "32.0", "allow[0].min_batch", "valid integer"),
    ("num_heads", '["16"]', "allow[0].num_heads[0]", "got '16'"),
    ("num_heads", "[true]", "allow[0].num_heads[0]", "valid integer"),
    ("num_heads", "[]", "allow[0].num_heads", "non-empty list"),
    ("seq_len_q", "[]", "allow[0].seq_len_q", "non-empty list"),
    ("kv_dtype", "[]", "allow[0].kv_dtype", "non-empty list"),
    ("page_size", "[0]", "allow[0].page_size[0]", "greater than or equal to 1"),
    ("num_heads", "[-16]", "allow[0].num_heads[0]", "greater than or equal to 1"),
    ("min_batch", "0", "allow[0].min_batch", "greater than or equal to 1"),
    ("max_kv_len", "-1", "allow[0].max_kv_len", "greater than or equal to 0"),
]


@pytest.mark.parametrize("key,value,path,needle", LAX, ids=[f"{k}={v}" for k, v, _, _ in LAX])
def test_4_lax_values_in_rules_are_policy_errors_naming_the_key_path(key, value, path, needle):
    text = BODY + f"[[backend.reference.allow]]\n{key} = {value}\n"
    with pytest.raises(PolicyError) as err:
        parse_policy_text(text, "p.toml")
    msg = str(err.value)
    assert msg.startswith(f"p.toml: backend.reference.{path}: ") and needle in msg, msg
    assert one_line(msg)


@pytest.mark.parametrize("value", ["0", "1", '"true"'])
def test_4_enabled_must_be_a_boolean(value):
    with pytest.raises(PolicyError, match=r"^p\.toml: backend\.reference\.enabled: Input should be a valid "
                                          r"boolean"):
        parse_policy_text(BODY + f"[backend.reference]\nenabled = {value}\n", "p.toml")


def test_4_an_empty_allow_set_cannot_silently_disable_a_backend():
    with pytest.raises(PolicyError, match="non-empty list"):
        parse_policy_text(BODY + "[[backend.reference.allow]]\nnum_heads = []\n", "p.toml")
    # while the strict types still take what TOML gives for a valid rule
    ok = parse_policy_text(BODY + "[[backend.reference.allow]]\nnum_heads = [16]\nmin_batch = 32\n"
                                  "max_kv_len = 0\n", "p.toml")
    assert ok.backend["reference"].allow[0].num_heads == (16,)


def test_4_a_key_with_a_newline_stays_on_one_line():
    with pytest.raises(PolicyError) as err:
        parse_policy_text(BODY + '"mi\\nn_batch" = 1\n', "p.toml")
    assert str(err.value) == 'p.toml: mla."mi\\nn_batch": unknown key'
    with pytest.raises(PolicyError) as err:
        parse_policy_text('[mla]\norder = ["refer\\nence"]\n', "p.toml").check_names(["reference"])
    assert one_line(str(err.value)) and "mla.order[0]: unknown backend 'refer\\nence'" in str(err.value)


# -- 5. a plan knows its decoder --------------------------------------------------------------------


def test_5_run_refuses_another_decoders_plan():
    disp = Dispatcher(policy=parse_policy_text(BODY), registry=BackendRegistry(env=CORE_ONLY).load(), env={})
    p = problem()
    inp = make_inputs(p, seed=3)
    a = MLADecoder(16, 16, dispatcher=disp, sm_scale=inp.sm_scale)
    b = MLADecoder(16, 16, dispatcher=disp, sm_scale=2 * inp.sm_scale)
    plan_b = b.plan(inp.kv_lens, inp.page_table)
    with pytest.raises(StalePlanError) as err:
        a.run(inp.q, inp.kv_cache, plan_b)
    assert isinstance(err.value, MLAInputError)
    assert str(err.value).startswith("plan: ") and "another MLADecoder" in str(err.value)
    # a page-8 decoder never reads table slots a page-16 plan validated
    a8 = MLADecoder(16, 8, dispatcher=disp, sm_scale=inp.sm_scale)
    cache8 = inp.kv_cache.reshape(-1, 8, 576)
    with pytest.raises(StalePlanError, match="^plan: .*another MLADecoder"):
        a8.run(inp.q, cache8, plan_b)
    # the decoder's own plan still runs, with its own scale
    out, lse = a.run(inp.q, inp.kv_cache, a.plan(inp.kv_lens, inp.page_table))
    assert compare(p, out, lse, *reference_outputs(p, inp)).passed


# -- 6. the custom op checks what the decoder checks --------------------------------------------------

Q = dict(dtype=torch.bfloat16)
LENS = torch.tensor([20], dtype=torch.int32)
TABLE = torch.tensor([[0, 1]], dtype=torch.int32)
OP_CASES = {
    "q rank 3": (torch.randn(1, 16, 576, **Q), torch.randn(4, 16, 576, **Q), "q: expected 4 dims"),
    "q rank 5": (torch.randn(1, 1, 1, 16, 576, **Q), torch.randn(4, 16, 576, **Q), "q: expected 4 dims"),
    "cache rank 2": (torch.randn(1, 1, 16, 576, **Q), torch.randn(16, 576, **Q), "kv_cache: expected 3 dims"),
    "cache rank 4": (torch.randn(1, 1, 16, 576, **Q), torch.randn(1, 4, 16, 576, **Q),
                     "kv_cache: expected 3 dims"),
    "both 512 wide": (torch.randn(1, 1, 16, 512, **Q), torch.randn(4, 16, 512, **Q),
                      "q: expected last dimension 576"),
    "both 640 wide": (torch.randn(1, 1, 16, 640, **Q), torch.randn(4, 16, 640, **Q),
                      "q: expected last dimension 576"),
    "both 500 wide": (torch.randn(1, 1, 16, 500, **Q), torch.randn(4, 16, 500, **Q),
                      "q: expected last dimension 576"),
    "cache 512 wide": (torch.randn(1, 1, 16, 576, **Q), torch.randn(4, 16, 512, **Q),
                       "kv_cache: expected last dimension 576"),
}


@pytest.mark.parametrize("case", list(OP_CASES))
def test_6_the_op_rejects_bad_layouts_naming_the_argument(case, monkeypatch):
    monkeypatch.setenv("MLA_DISABLE_PLUGIN_AUTOLOAD", "1")
    q, cache, needle = OP_CASES[case]
    decoders = len(mlacore.ops._decoders)
    with pytest.raises(MLAInputError) as err:
        mla_decode(q, cache, TABLE, LENS, 0.1)
    msg = str(err.value)
    assert msg.startswith(needle) and str(tuple((q if msg.startswith("q") else cache).shape)) in msg, msg
    assert len(mlacore.ops._decoders) == decoders  # rejected before a decoder is made from the bad shape


def test_6_the_op_and_run_say_the_same_about_a_rank_3_q(monkeypatch):
    monkeypatch.setenv("MLA_DISABLE_PLUGIN_AUTOLOAD", "1")
    q3 = torch.randn(1, 16, 576, **Q)
    cache = torch.randn(4, 16, 576, **Q)
    with pytest.raises(MLAInputError) as op_err:
        mla_decode(q3, cache, TABLE, LENS, 0.1)
    dec = MLADecoder(16, 16, dispatcher=Dispatcher(policy=parse_policy_text(BODY),
                                                   registry=BackendRegistry(env=CORE_ONLY).load(), env={}))
    with pytest.raises(MLAInputError) as run_err:
        dec.run(q3, cache, dec.plan(LENS, TABLE))
    assert str(op_err.value) == str(run_err.value)
    # and a good call still computes
    out, lse = mla_decode(torch.randn(1, 1, 16, 576, **Q), cache, TABLE, LENS, 0.1)
    assert out.shape == (1, 1, 16, 512) and bool(torch.isfinite(out).all())


# -- 7. smaller cases, one each -----------------------------------------------------------------------


@pytest.fixture
def ref_decoder():
    disp = Dispatcher(policy=parse_policy_text(BODY), registry=BackendRegistry(env=CORE_ONLY).load(), env={})
    return MLADecoder(16, 16, dispatcher=disp)


def test_7_host_copies_are_dtype_checked(ref_decoder):
    with pytest.raises(MLAInputError, match=r"^kv_lens_host: expected dtype int32, got float32$"):
        ref_decoder.plan(torch.tensor([40], dtype=torch.int32), TABLE, kv_lens_host=torch.tensor([39.9]))
    with pytest.raises(MLAInputError, match=r"^page_table_host: expected dtype int32, got int64$"):
        ref_decoder.plan(LENS, TABLE, page_table_host=TABLE.long())


def test_7_capacity_check_does_not_wrap_at_2_31():
    page, pages = 2 ** 20, 2048  # max_pages * page_size == 2**31
    lens = torch.tensor([2 ** 31 - 1], dtype=torch.int32)
    table = torch.arange(pages, dtype=torch.int32)[None]
    assert check_lengths_and_table(lens, table, page, pages) == pages - 1
    with pytest.raises(MLAInputError) as err:
        check_lengths_and_table(lens, table[:, :-1], page, pages)
    assert str(err.value) == ("kv_lens: kv_lens[0] = 2147483647 needs more pages than page_table holds "
                              "(2047 pages x page_size 1048576 = 2146435072 tokens)")
    disp = Dispatcher(policy=parse_policy_text(BODY), registry=BackendRegistry(env=CORE_ONLY).load(), env={})
    plan = MLADecoder(16, page, dispatcher=disp).plan(lens, table, num_pages=pages)
    assert plan.problem.max_kv_len == 2 ** 31 - 1 and plan.max_page_id == pages - 1


@pytest.mark.parametrize("which", ["kv_lens", "page_table"])
def test_7_a_foreign_device_is_named(ref_decoder, which):
    lens, table = LENS, TABLE
    if which == "kv_lens":
        lens = torch.empty(1, dtype=torch.int32, device="meta")
    else:
        table = torch.empty(1, 2, dtype=torch.int32, device="meta")
    with pytest.raises(MLAInputError, match=rf"^{which}: expected a tensor on .* got one on meta$"):
        ref_decoder.plan(lens, table)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch that sees no CUDA device")
def test_7_a_cuda_decoder_without_cuda_is_an_input_error():
    with pytest.raises(MLAInputError, match=r"^device: 'cuda' was asked for, but torch .* sees no CUDA device"):
        MLADecoder(16, 16, device="cuda")


@pytest.mark.parametrize("num_pages", ["6", -1, 0, True, 6.0])
def test_7_num_pages_is_checked_and_named(ref_decoder, num_pages):
    with pytest.raises(MLAInputError) as err:
        ref_decoder.plan(LENS, TABLE, num_pages=num_pages)
    assert str(err.value).startswith("num_pages: ") and repr(num_pages) in str(err.value)


def test_7_booleans_are_not_ints(ref_decoder):
    with pytest.raises(MLAInputError, match=r"^num_heads: expected an int >= 1, got True$"):
        MLADecoder(True, 16)
    with pytest.raises(MLAInputError, match=r"^page_size: expected an int >= 1, got True$"):
        MLADecoder(16, True)
    with pytest.raises(MLAInputError, match=r"^seq_len_q: expected an int >= 1, got True$"):
        ref_decoder.plan(LENS, TABLE, seq_len_q=True)
    with pytest.raises(MLAInputError, match=r"^max_batch: "):
        MLADecoder(16, 16, cuda_graph=True, max_batch=True, max_kv_len=64)


@pytest.mark.parametrize("raw", [",,,", " , ", ",", "+", "-", "+a,b"])
def test_7_mla_backends_that_names_nothing_is_a_policy_error(raw):
    policy = parse_policy_text(BODY)
    with pytest.raises(PolicyError) as err:
        effective_order(policy, ["reference"], {"MLA_BACKENDS": raw})
    assert str(err.value).startswith(f"MLA_BACKENDS={raw.strip()!r}: ") and one_line(str(err.value))
    with pytest.raises(PolicyError, match="MLA_BACKENDS"):
        Dispatcher(policy=policy, registry=BackendRegistry(env=CORE_ONLY).load(), env={"MLA_BACKENDS": raw})


def test_7_a_plugin_broken_by_info_is_listed_broken_with_its_reason(reg):
    """Listing asks for the status first: info() must count, or the row says available / no reason."""
    for name in ("wt_info_str", "wt_info_notes_none"):
        handle = reg.get(name)
        assert handle.status == "broken"  # before anything called info() on it
        assert handle.reasons() and handle.reasons()[0].startswith("info() "), handle.reasons()


def test_7_plugin_option_errors_are_one_line_each(with_plugins):
    reg = BackendRegistry(env={}).load()
    text = ('[mla]\norder = ["reference"]\n[backend.chunked_reference.options]\nchunk_tokens = "64"\n'
            "[backend.wt_options_multiline.options]\nvariant = \"zz\"\n")
    with pytest.raises(PolicyError) as err:
        Dispatcher(policy=parse_policy_text(text, "p.toml"), registry=reg, env={})
    lines = str(err.value).splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith("p.toml: backend.chunked_reference.options.chunk_tokens: ")
    assert lines[1].startswith("p.toml: backend.wt_options_multiline.options.variant: unknown variant")


def test_7_an_fp8_decoder_needs_its_kv_scale():
    with pytest.raises(MLAInputError, match=r"^kv_scale: "):
        MLADecoder(16, 16, kv_dtype=torch.float8_e4m3fn)
    assert MLADecoder(16, 16, kv_dtype=torch.float8_e4m3fn, kv_scale=1.0).kv_scale == 1.0

