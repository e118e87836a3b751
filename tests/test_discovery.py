"""Discovery through real installed distributions, and isolation of broken plugins."""

import json
import subprocess
import sys

import torch

from mlacore import BackendRegistry, Dispatcher, MLADecoder, parse_policy
from mlacore.problem import DecodeProblem
from conftest import subprocess_env


def test_good_plugin_registers_without_touching_mlacore(with_plugins):
    reg = BackendRegistry(env={}).load()
    good = reg.get("chunked_reference")
    assert good is not None
    assert good.distribution == "mla-test-good"
    assert good.version == "1.2.3"
    assert good.status == "available"
    assert reg.get("reference").distribution == "mlacore"


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
    assert "mla_availability raised RuntimeError: driver query exploded" in avail.reasons()[0]
    missing = reg.get("missing_run")
    assert missing.status == "broken"
    assert "does not implement mla_run" in missing.reasons()[0]
    can = reg.get("raises_in_can_implement")
    assert can.status == "available"
    problem = DecodeProblem(num_heads=16, batch_size=1, max_kv_len=8, page_size=16)
    assert can.can_implement(problem, {}) == ("can_implement raised ZeroDivisionError: bad shape math",)


def test_broken_plugins_do_not_break_decoding(with_plugins):
    reg = BackendRegistry(env={}).load()
    order = ["bad_import", "raises_in_availability", "raises_in_can_implement", "missing_run",
             "chunked_reference", "reference"]
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
    assert outcomes["raises_in_can_implement"] == "cannot implement"


def test_loading_twice_is_harmless(with_plugins):
    reg = BackendRegistry(env={})
    reg.load()
    first = reg.get("chunked_reference")
    reg.load()
    assert reg.get("chunked_reference") is first
    assert reg.names().count("chunked_reference") == 1


def test_autoload_switch_keeps_only_builtin(with_plugins):
    reg = BackendRegistry(env={"MLA_DISABLE_PLUGIN_AUTOLOAD": "1"}).load()
    assert reg.get("reference").status == "available"
    good = reg.get("chunked_reference")
    assert good.status == "disabled"
    assert good.plugin is None  # never imported
    assert "MLA_DISABLE_PLUGIN_AUTOLOAD" in good.reasons()[0]


def test_disable_by_name(with_plugins):
    reg = BackendRegistry(env={"MLA_DISABLE_PLUGINS": "chunked_reference, bad_import"}).load()
    assert reg.get("chunked_reference").status == "disabled"
    assert reg.get("bad_import").status == "disabled"
    assert reg.get("raises_in_can_implement").status == "available"


def test_cli_lists_plugins_from_installed_distributions(plugin_site):
    proc = subprocess.run([sys.executable, "-m", "mlacore.cli", "backends", "list", "--json"],
                          capture_output=True, text=True, env=subprocess_env(plugin_site), timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = {r["name"]: r for r in json.loads(proc.stdout)["backends"]}
    assert rows["chunked_reference"]["status"] == "available"
    assert rows["chunked_reference"]["distribution"] == "mla-test-good"
    assert rows["bad_import"]["status"] == "broken"
    assert rows["raises_in_availability"]["status"] == "broken"
    assert rows["reference"]["position"] == 4
    assert rows["cutlass_mla"]["status"] == "not installed"


def test_cli_table_survives_broken_plugins(plugin_site):
    proc = subprocess.run([sys.executable, "-m", "mlacore.cli", "backends", "list"],
                          capture_output=True, text=True, env=subprocess_env(plugin_site), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "broken" in proc.stdout and "bad_import" in proc.stdout
    assert "Traceback" not in proc.stdout + proc.stderr


def test_listing_imports_no_gpu_library():
    code = ("import sys, mlacore.cli as c; c.main(['backends', 'list', '--json']); "
            "heavy = [m for m in ('flashinfer', 'cutlass', 'triton') if m in sys.modules]; "
            "sys.stderr.write('HEAVY=' + ','.join(heavy))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=subprocess_env(), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip().endswith("HEAVY=")
