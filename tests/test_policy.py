"""mla.toml: valid files, every invalid kind, env overrides, lookup precedence."""

from pathlib import Path

import pytest

from mlacore.policy import (
    BUILTIN_SOURCE,
    PolicyError,
    effective_order,
    load_policy,
    parse_policy_text,
)
from mlacore.problem import DecodeProblem

KNOWN = ["reference", "flashinfer_mla", "cute_dsl_mla", "cutlass_mla"]
ROOT = Path(__file__).resolve().parents[1]


def test_builtin_default_is_the_repo_file():
    assert (ROOT / "mla.toml").read_text() == (ROOT / "mlacore" / "default_policy.toml").read_text()
    pol = load_policy(env={}, cwd=ROOT / "tests")
    assert pol.source == BUILTIN_SOURCE
    assert pol.mla.order == ("cute_dsl_mla", "flashinfer_mla", "cutlass_mla", "reference")
    assert pol.mla.fallback == "reference"


def test_full_valid_file():
    pol = parse_policy_text("""
[mla]
order = ["cute_dsl_mla", "flashinfer_mla", "reference"]
fallback = "error"

[backend.cute_dsl_mla]
enabled = true
[[backend.cute_dsl_mla.allow]]
num_heads = [16, 128]
seq_len_q = [1, 2]
kv_dtype = ["fp8_e4m3"]
min_batch = 32
[[backend.cute_dsl_mla.deny]]
max_kv_len = 512

[backend.flashinfer_mla.options]
variant = "fa3"
""")
    assert pol.mla.fallback == "error"
    rule = pol.backend["cute_dsl_mla"].allow[0]
    assert rule.num_heads == (16, 128) and rule.min_batch == 32
    assert pol.backend["flashinfer_mla"].options == {"variant": "fa3"}
    p = DecodeProblem(num_heads=16, seq_len_q=1, batch_size=64, max_kv_len=4096, page_size=64,
                      kv_dtype="fp8_e4m3")
    assert pol.backend["cute_dsl_mla"].rejections(p) == []
    small = p.model_copy(update={"batch_size": 8, "num_heads": 32})
    reasons = pol.backend["cute_dsl_mla"].rejections(small)
    assert "num_heads=32 not in [16, 128]" in reasons[0] and "batch=8 < min_batch=32" in reasons[0]
    short = p.model_copy(update={"max_kv_len": 100})
    assert pol.backend["cute_dsl_mla"].rejections(short) == [
        "policy deny[0] matches {max_kv_len=512}"]


@pytest.mark.parametrize("text, message", [
    ('[mla]\norder=["reference"]\nfalback="error"', "mla.falback: unknown key"),
    ('[mla]\norder=["reference"]\n[backend.reference]\nenabeld=false', "backend.reference.enabeld: unknown key"),
    ('[mla]\norder=["reference"]\n[[backend.reference.allow]]\nnum_head=[16]',
     "backend.reference.allow[0].num_head: unknown key"),
    ('[mla]\norder="reference"', "mla.order: Input should be a valid tuple"),
    ('[mla]\norder=["reference"]\nfallback="flashinfer_mla"', "mla.fallback: Input should be 'reference' or 'error'"),
    ('[mla]\norder=["reference"]\n[[backend.reference.allow]]\nnum_heads=["x"]',
     "backend.reference.allow[0].num_heads[0]: Input should be a valid integer"),
    ('[mla]\norder=["reference"]\n[[backend.reference.allow]]\nkv_dtype=["fp4"]',
     "backend.reference.allow[0].kv_dtype[0]: Input should be"),
    ('[mla]\norder=["reference"]\n[[backend.reference.allow]]\nmin_batch=8\nmax_batch=4',
     "min_batch=8 is larger than max_batch=4"),
    ('[mla]\norder=["reference"]\n[[backend.reference.allow]]\ncapability=["9"]',
     'backend.reference.allow[0].capability: expected CUDA compute capabilities written like "9.0" or "10.0"'),
    ('[mla]\norder=["reference"]\n[[backend.reference.allow]]\ncapability=[9.0]',
     "backend.reference.allow[0].capability[0]: Input should be a valid string"),
    ('[mla]\norder=["reference"]\n[[backend.reference.allow]]\ncapability=[]',
     "backend.reference.allow[0].capability: expected a non-empty list"),
    ('[mla]\norder=["reference", "reference"]', "backend 'reference' appears twice"),
    ('[mla]\nfallback="error"', "mla.order: required key is missing"),
    ('[policy]\norder=[]', "policy: unknown key"),
    ('[mla\norder=[]', "not valid TOML"),
])
def test_invalid_files_name_the_key(text, message):
    with pytest.raises(PolicyError) as err:
        parse_policy_text(text, "my.toml")
    assert message in str(err.value)
    assert str(err.value).startswith("my.toml: ")


def test_unknown_backend_names_are_errors():
    pol = parse_policy_text('[mla]\norder=["reference", "flashinfer_ml"]', "x.toml")
    with pytest.raises(PolicyError, match=r"x.toml: mla.order\[1\]: unknown backend 'flashinfer_ml'"):
        pol.check_names(["reference"])
    pol = parse_policy_text('[mla]\norder=["reference"]\n[backend.mystery]\nenabled=false', "x.toml")
    with pytest.raises(PolicyError, match="backend.mystery: unknown backend 'mystery'"):
        pol.check_names(["reference"])
    # first-party names are fine even where the plugin is not installed
    parse_policy_text('[mla]\norder=["cutlass_mla", "reference"]').check_names(["reference"])
    # an installed third-party name is fine
    parse_policy_text('[mla]\norder=["mine", "reference"]').check_names(["reference", "mine"])


def test_lookup_precedence(tmp_path):
    explicit = tmp_path / "explicit.toml"
    explicit.write_text('[mla]\norder=["reference"]\nfallback="error"')
    from_env = tmp_path / "env.toml"
    from_env.write_text('[mla]\norder=["flashinfer_mla", "reference"]')
    cwd = tmp_path / "work"
    cwd.mkdir()
    (cwd / "mla.toml").write_text('[mla]\norder=["cutlass_mla", "reference"]')
    env = {"MLA_POLICY": str(from_env)}
    assert load_policy(explicit, env=env, cwd=cwd).source == str(explicit)
    assert load_policy(None, env=env, cwd=cwd).source == str(from_env)
    assert load_policy(None, env={}, cwd=cwd).mla.order == ("cutlass_mla", "reference")
    assert load_policy(None, env={}, cwd=tmp_path).source == BUILTIN_SOURCE


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(PolicyError, match="cannot read policy file"):
        load_policy(tmp_path / "nope.toml", env={})


POL = parse_policy_text("""
[mla]
order = ["cute_dsl_mla", "flashinfer_mla", "cutlass_mla", "reference"]
[backend.cutlass_mla]
enabled = false
""")


def test_order_respects_enabled():
    assert effective_order(POL, KNOWN, env={}) == ["cute_dsl_mla", "flashinfer_mla", "reference"]


def test_env_exact_list():
    env = {"MLA_BACKENDS": "reference, flashinfer_mla"}
    assert effective_order(POL, KNOWN, env) == ["reference", "flashinfer_mla"]
    # an exact list may name a backend the policy disabled: the user asked for it
    assert effective_order(POL, KNOWN, {"MLA_BACKENDS": "cutlass_mla"}) == ["cutlass_mla"]


def test_env_deltas_keep_policy_order():
    assert effective_order(POL, KNOWN, {"MLA_BACKENDS": "-cute_dsl_mla"}) == ["flashinfer_mla", "reference"]
    # re-enabling goes back to its place in the policy's order
    assert effective_order(POL, KNOWN, {"MLA_BACKENDS": "+cutlass_mla,-flashinfer_mla"}) == [
        "cute_dsl_mla", "cutlass_mla", "reference"]
    # a backend absent from the order is appended
    assert effective_order(POL, KNOWN + ["mine"], {"MLA_BACKENDS": "+mine"})[-1] == "mine"


def test_env_mixed_and_unknown_are_errors():
    with pytest.raises(PolicyError, match="mixes an exact list with"):
        effective_order(POL, KNOWN, {"MLA_BACKENDS": "reference,-flashinfer_mla"})
    with pytest.raises(PolicyError, match="unknown backend 'flashinfr'"):
        effective_order(POL, KNOWN, {"MLA_BACKENDS": "+flashinfr"})
    with pytest.raises(PolicyError, match="named twice"):
        effective_order(POL, KNOWN, {"MLA_BACKENDS": "reference,reference"})


def test_rule_options_only_on_allow():
    pol = parse_policy_text('[mla]\norder=["reference"]\n[[backend.reference.allow]]\nseq_len_q=[2]\n'
                            'options={chunk_tokens=64}')
    assert pol.backend["reference"].allow[0].options == {"chunk_tokens": 64}
    with pytest.raises(PolicyError, match="a deny rule takes no options"):
        parse_policy_text('[mla]\norder=["reference"]\n[[backend.reference.deny]]\nseq_len_q=[2]\n'
                          'options={chunk_tokens=64}')


def test_capability_rules_match_the_problems_gpu_only():
    """A rule with `capability` takes problems on a CUDA device of that compute capability and nothing else (other
    GPUs, the CPU), each refusal with its reason; one file can so route an H200 and a B200 differently."""
    from mlacore.problem import DeviceSpec

    pol = parse_policy_text("""
[mla]
order = ["cute_dsl_mla", "reference"]
[[backend.cute_dsl_mla.allow]]
num_heads = [128]
capability = ["9.0", "10.3"]
""")
    rules = pol.backend["cute_dsl_mla"]
    base = dict(num_heads=128, seq_len_q=1, batch_size=4, max_kv_len=100, min_kv_len=100, page_size=64,
                q_dtype="bf16", kv_dtype="bf16")
    on = {cap: DecodeProblem(**base, device=DeviceSpec(type="cuda", capability=cap)) for cap in ((9, 0), (10, 3),
                                                                                                 (10, 0))}
    assert rules.rejections(on[(9, 0)]) == [] and rules.rejections(on[(10, 3)]) == []
    assert "capability=10.0 not in ['9.0', '10.3']" in rules.rejections(on[(10, 0)])[0]
    cpu = DecodeProblem(**base, device=DeviceSpec(type="cpu"))
    assert "capability=cpu not in ['9.0', '10.3']" in rules.rejections(cpu)[0]
