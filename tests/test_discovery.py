"""Discovery through real installed distributions, and isolation of broken plugins."""

import json
import subprocess
import sys

import pytest
import torch

from mlacore import Backend, BackendRegistry, Dispatcher, MLADecoder, parse_policy
from mlacore.problem import DecodeProblem
from mla_test_helpers import subprocess_env

SHAPE = DecodeProblem(num_heads=16, batch_size=1, max_kv_len=8, page_size=16).shape


def test_good_plugin_registers_without_touching_mlacore(with_plugins):
    reg = BackendRegistry(env={}).load()
    good = reg.get("chunked_reference")
    assert good is not None
    assert good.distribution == "mla-test-good"
    assert good.version == "1.2.3"
    assert good.status == "available"
    assert isinstance(good.obj, Backend)
    assert reg.get("reference").distribution == "mlacore"


def test_one_entry_point_registers_two_backends(with_plugins):
    reg = BackendRegistry(env={}).load()
    chunked, wrong = reg.get("chunked_reference"), reg.get("drops_last_token")
    assert chunked.distribution == wrong.distribution == "mla-test-good"
    assert chunked.status == wrong.status == "available"
    assert type(chunked.obj).__name__ == "ChunkedReference" and type(wrong.obj).__name__ == "DropsLastToken"
    # the entry point's own name is not a backend: the plugin module registered two
    assert reg.get("mla_test_good") is None
    # typed options: chunked_reference declares a model, drops_last_token none
    assert chunked.options_model.__name__ == "ChunkedOptions"
    assert chunked.parse_options({"chunk_tokens": 32}).chunk_tokens == 32


def test_import_error_is_reported_as_broken(with_plugins):
    reg = BackendRegistry(env={}).load()
    bad = reg.get("bad_import")
    assert bad.status == "broken"
    assert "Error importing plugin 'bad_import'" in bad.reasons()[0]
    assert "ModuleNotFoundError" in bad.reasons()[0]
    assert bad.load_traceback is not None


def test_raising_hooks_are_isolated(with_plugins):
    reg = BackendRegistry(env={}).load()
    avail = reg.get("raises_in_availability")
    assert avail.status == "broken"
    assert "availability() raised RuntimeError: driver query exploded" in avail.reasons()[0]
    assert avail.load_traceback is not None and "driver query exploded" in avail.load_traceback
    missing = reg.get("missing_open")
    assert missing.status == "broken"
    assert "does not implement open" in missing.reasons()[0]
    can = reg.get("raises_in_can_implement")
    assert can.status == "available"
    assert can.can_implement(SHAPE, can.options_model()) == (
        "can_implement raised ZeroDivisionError: bad shape math",)
    assert can.status == "available"  # a raising can_implement is a reason, not a broken backend


def test_availability_built_wrongly_is_broken(with_plugins):
    reg = BackendRegistry(env={}).load()
    bad = reg.get("bad_availability")
    assert bad.distribution == "mla-test-badhook"  # registered from a Backend class, not an object
    assert bad.status == "broken"
    assert "availability() raised ValidationError" in bad.reasons()[0]
    assert "valid tuple" in bad.reasons()[0]


def test_can_implement_returning_false_marks_the_backend_broken(with_plugins):
    reg = BackendRegistry(env={}).load()
    bad = reg.get("can_implement_false")
    reasons = bad.can_implement(SHAPE, bad.options_model())
    assert "can_implement() returned bool False" in reasons[0]
    assert "expected a list of reason strings" in reasons[0]
    assert bad.status == "broken"
    # the dispatcher never chooses it, and says why
    disp = Dispatcher(policy=parse_policy({"mla": {"order": ["can_implement_false", "reference"]}}),
                      registry=reg, env={})
    dec = disp.select(DecodeProblem(num_heads=16, batch_size=1, max_kv_len=8, page_size=16))
    assert dec.backend == "reference"
    assert dec.verdict("can_implement_false").outcome == "unavailable"
    assert "broken" in dec.verdict("can_implement_false").reasons


def test_can_implement_false_is_caught_at_the_first_dispatch(with_plugins):
    reg = BackendRegistry(env={}).load()
    disp = Dispatcher(policy=parse_policy({"mla": {"order": ["can_implement_false", "reference"]}}),
                      registry=reg, env={})
    dec = disp.select(DecodeProblem(num_heads=16, batch_size=1, max_kv_len=8, page_size=16))
    assert dec.backend == "reference"
    assert dec.verdict("can_implement_false").outcome in ("cannot implement", "unavailable")
    assert reg.get("can_implement_false").status == "broken"


def test_reserved_name_from_another_distribution_is_refused(with_plugins):
    reg = BackendRegistry(env={}).load()
    impostor = reg.get("reference@mla-test-impostor")
    assert impostor is not None
    assert impostor.status == "refused"
    assert impostor.distribution == "mla-test-impostor"
    assert "reserved for distribution 'mlacore'" in impostor.reasons()[0]
    assert impostor.obj is None
    ref = reg.get("reference")
    assert ref.distribution == "mlacore" and ref.status == "available"
    # and the impostor is never what runs `reference`
    assert type(ref.obj).__name__ == "ReferenceBackend"
    assert all(type(p).__name__ != "FakeReference" for p in reg.pm.get_plugins())


def test_broken_plugins_do_not_break_decoding(with_plugins):
    reg = BackendRegistry(env={}).load()
    order = ["bad_import", "raises_in_availability", "raises_in_can_implement", "missing_open",
             "can_implement_false", "bad_availability", "chunked_reference", "reference"]
    policy = parse_policy({"mla": {"order": order}})
    disp = Dispatcher(policy=policy, registry=reg, env={})
    dec = MLADecoder(16, 16, dispatcher=disp)
    lens = torch.tensor([5, 40], dtype=torch.int32)
    table = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
    plan = dec.plan(lens, table)
    assert plan.backend == "chunked_reference"
    out, lse = dec.run(torch.randn(2, 1, 16, 576, dtype=torch.bfloat16),
                       torch.randn(6, 16, 576, dtype=torch.bfloat16), plan)
    assert torch.isfinite(out).all()
    outcomes = {v.backend: v.outcome for v in plan.decision.verdicts}
    assert outcomes["bad_import"] == "unavailable"
    assert outcomes["raises_in_availability"] == "unavailable"
    assert outcomes["missing_open"] == "unavailable"
    assert outcomes["bad_availability"] == "unavailable"
    assert outcomes["raises_in_can_implement"] == "cannot implement"
    assert outcomes["can_implement_false"] in ("cannot implement", "unavailable")
    assert outcomes["chunked_reference"] == "chosen"


def test_loading_twice_is_harmless(with_plugins):
    reg = BackendRegistry(env={})
    reg.load()
    first = reg.get("chunked_reference")
    plugins = len(reg.pm.get_plugins())
    reg.load()
    assert reg.get("chunked_reference") is first
    assert reg.names().count("chunked_reference") == 1
    assert len(reg.pm.get_plugins()) == plugins


def test_autoload_switch_keeps_only_builtin(with_plugins):
    reg = BackendRegistry(env={"MLA_DISABLE_PLUGIN_AUTOLOAD": "1"}).load()
    assert reg.get("reference").status == "available"
    good = reg.get("mla_test_good")  # the entry point, never imported: its backends are unknown
    assert good.status == "disabled"
    assert good.obj is None
    assert "MLA_DISABLE_PLUGIN_AUTOLOAD" in good.reasons()[0]
    assert reg.get("chunked_reference") is None
    assert all(type(p).__module__ != "mla_test_good" and getattr(p, "__name__", "") != "mla_test_good"
               for p in reg.pm.get_plugins())
    assert reg.get("impostor").status == "disabled"


def test_disable_by_name(with_plugins):
    reg = BackendRegistry(env={"MLA_DISABLE_PLUGINS": "chunked_reference, bad_import"}).load()
    assert reg.get("chunked_reference").status == "disabled"
    assert "MLA_DISABLE_PLUGINS" in reg.get("chunked_reference").reasons()[0]
    assert reg.get("drops_last_token").status == "available"  # same entry point, not named
    assert reg.get("bad_import").status == "disabled"
    assert reg.get("raises_in_can_implement").status == "available"


def _fake_distribution(root, dist, entry_points):
    info = root / f"{dist.replace('-', '_')}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[mlacore.backends]\n" + "".join(f"{k} = {v}\n" for k, v in entry_points.items()))


def test_entry_point_named_reference_from_another_distribution_is_refused(with_plugins, tmp_path, monkeypatch):
    _fake_distribution(tmp_path, "mla-test-evil", {"reference": "mla_test_impostor:backend"})
    monkeypatch.syspath_prepend(str(tmp_path))
    reg = BackendRegistry(env={}).load()
    assert reg.get("reference").distribution == "mlacore"
    assert reg.get("reference").status == "available"
    assert reg.get("reference@mla-test-evil").status == "refused"


def test_autoload_off_keeps_reference_when_another_entry_point_is_named_reference(with_plugins, tmp_path,
                                                                                   monkeypatch):
    _fake_distribution(tmp_path, "mla-test-evil", {"reference": "mla_test_impostor:backend"})
    monkeypatch.syspath_prepend(str(tmp_path))
    reg = BackendRegistry(env={"MLA_DISABLE_PLUGIN_AUTOLOAD": "1"}).load()
    assert reg.get("reference").distribution == "mlacore"
    assert reg.get("reference").status == "available"


def test_cli_lists_plugins_from_installed_distributions(plugin_site):
    proc = subprocess.run([sys.executable, "-m", "mlacore", "backends", "list", "--json"],
                          capture_output=True, text=True, env=subprocess_env(plugin_site), timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = {r["name"]: r for r in json.loads(proc.stdout)["backends"]}
    assert rows["chunked_reference"]["status"] == "available"
    assert rows["chunked_reference"]["distribution"] == "mla-test-good"
    assert rows["drops_last_token"]["distribution"] == "mla-test-good"
    assert rows["bad_import"]["status"] == "broken"
    assert rows["raises_in_availability"]["status"] == "broken"
    assert rows["bad_availability"]["status"] == "broken"
    assert rows["reference@mla-test-impostor"]["status"] == "refused"
    assert rows["reference"]["distribution"] == "mlacore"
    assert rows["reference"]["position"] == 4
    # a first-party name: its own distribution's row (installed or not), never the impostor's
    assert rows["cutlass_mla"]["distribution"] == "mla-cutlass"
    assert rows["cutlass_mla"]["status"] in ("not installed", "unavailable", "available")


def test_cli_table_survives_broken_plugins(plugin_site):
    proc = subprocess.run([sys.executable, "-m", "mlacore", "backends", "list"],
                          capture_output=True, text=True, env=subprocess_env(plugin_site), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "broken" in proc.stdout and "bad_import" in proc.stdout
    assert "refused" in proc.stdout
    assert "Traceback" not in proc.stdout + proc.stderr


def test_listing_imports_no_gpu_library():
    code = ("import sys, mlacore.tools.cli as c; c.main(['backends', 'list', '--json']); "
            "heavy = [m for m in ('flashinfer', 'cutlass', 'triton') if m in sys.modules]; "
            "sys.stderr.write('HEAVY=' + ','.join(heavy))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=subprocess_env(), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip().endswith("HEAVY=")
