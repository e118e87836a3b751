"""Conventions of the `mla` command: fast --help, --version, --json, quiet pipes, one-line errors, tables."""

import json
import os
import subprocess
import sys
import time

import pytest

from mla_test_helpers import subprocess_env
from mlacore.tools.cli import json_safe, json_text, main, problem_error_line


def run_cli(*args, plugin_site=None, **env):
    return subprocess.run([sys.executable, "-m", "mlacore", *args], capture_output=True, text=True,
                          env=subprocess_env(plugin_site, **env), timeout=300)


def _modules_after_cli(*argv: str) -> set:
    """Modules loaded after running the CLI with argv in a fresh interpreter (SystemExit caught)."""
    probe = ("import sys\nfrom mlacore.tools.cli import main\n"
             f"try:\n    main({list(argv)!r})\nexcept SystemExit:\n    pass\n"
             "sys.stderr.write('\\n'.join(sorted(sys.modules)))\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=subprocess_env(),
                          timeout=120)
    return set(done.stderr.split())


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["backends", "explain", "--help"],
                                  ["backends", "frobnicate"], ["bench", "--budget", "x"]])
def test_help_version_and_usage_errors_import_no_torch_rich_or_plugin(argv):
    loaded = _modules_after_cli(*argv)
    assert "argparse" in loaded
    leaked = sorted(m for m in ("torch", "rich", "pydantic", "mlacore.registry", "mla_flashinfer", "tomlkit")
                    if m in loaded)
    assert not leaked, f"`mla {' '.join(argv)}` imported {leaked}"


def test_help_is_fast():
    env = subprocess_env()
    best = min(_timed([sys.executable, "-m", "mlacore", "--help"], env) for _ in range(3))
    assert best < 0.5, f"`mla --help` took {best:.2f} s"


def _timed(cmd, env) -> float:
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    return time.perf_counter() - t0


def test_importtime_of_help_has_no_torch():
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "mlacore", "--help"], capture_output=True,
                          text=True, env=subprocess_env(), timeout=60)
    assert done.returncode == 0
    imported = {line.split("|")[-1].strip() for line in done.stderr.splitlines() if "|" in line}
    assert "torch" not in imported and "rich" not in imported


def test_policy_check_imports_no_torch():
    loaded = _modules_after_cli("policy", "check")
    assert "mlacore.policy" in loaded
    assert "torch" not in loaded


def test_policy_check_cli_module_itself_needs_no_torch(tmp_path):
    # everything up to loading the plugins: the policy file and the fingerprint warning path
    loaded = _modules_after_cli("policy", "check", str(tmp_path / "missing.toml"))
    assert "torch" not in loaded and "rich" not in loaded


def test_version_names_core_and_plugins(plugin_site):
    proc = run_cli("--version", plugin_site=plugin_site)
    assert proc.returncode == 0, proc.stderr
    from importlib.metadata import version

    first = proc.stdout.splitlines()[0]
    assert first.startswith(f"mla (mlacore {version('mlacore')})")
    assert "  mla-test-good-" in proc.stdout and "mla-test-badimport-" in proc.stdout
    assert "mlacore-" in proc.stdout and "reference = mlacore.reference:backend" in proc.stdout


def test_python_dash_m_is_the_command():
    proc = run_cli("--help")
    assert proc.returncode == 0 and proc.stdout.startswith("usage: mla ")


def test_json_is_standard():
    assert json_safe({"a": float("nan"), "b": [float("inf"), 1.5], "c": (1, None)}) == \
        {"a": None, "b": [None, 1.5], "c": [1, None]}
    assert "NaN" not in json_text({"x": float("nan")})


def test_broken_pipe_is_quiet():
    proc = subprocess.Popen([sys.executable, "-m", "mlacore", "backends", "list", "--json"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=subprocess_env())
    proc.stdout.close()  # the reader is gone before the first write, as `| head -1` after one line
    err = proc.stderr.read().decode()
    code = proc.wait(timeout=120)
    proc.stderr.close()
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
    assert code == 141


def test_broken_pipe_through_head():
    done = subprocess.run(f"{sys.executable} -m mlacore backends list --json | head -1", shell=True,
                          capture_output=True, text=True, env=subprocess_env(), timeout=120)
    assert done.stdout == "{\n" and done.stderr == ""


@pytest.mark.parametrize("argv, flag", [
    (["--num-heads", "0"], "--num-heads"),
    (["--num-heads", "16", "--batch", "0"], "--batch"),
    (["--num-heads", "16", "--kv-len", "100", "--min-kv-len", "200"], "--min-kv-len"),
    (["--num-heads", "16", "--capability", "nine"], "--capability"),
])
def test_problem_errors_are_one_line_naming_the_flag(argv, flag, capsys):
    code = main(["backends", "explain", "--device", "cuda", *argv] if "--capability" in argv
                else ["backends", "explain", "--device", "cpu", *argv])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and err.startswith(f"mla: error: {flag}"), err


def test_pydantic_errors_map_to_flags():
    from pydantic import ValidationError

    from mlacore.problem import DecodeProblem

    with pytest.raises(ValidationError) as info:
        DecodeProblem(num_heads=16, batch_size=1, max_kv_len=10, min_kv_len=20, page_size=64)
    line = problem_error_line(info.value)
    assert "--min-kv-len" in line and "--kv-len" in line and "\n" not in line
    with pytest.raises(ValidationError) as info:
        DecodeProblem(num_heads=16, batch_size=1, max_kv_len=10, page_size=0)
    assert problem_error_line(info.value).startswith("--page-size: ")


def test_explain_shows_the_options_of_a_tuned_rule(tmp_path, capsys):
    pol = tmp_path / "p.toml"
    pol.write_text('[mla]\norder = ["reference"]\n[backend.reference.options]\nchunk_tokens = 4096\n'
                   '[[backend.reference.allow]]\nmax_batch = 8\noptions = { chunk_tokens = 128 }\n'
                   '[[backend.reference.allow]]\nmin_batch = 9\n')
    code = main(["backends", "explain", "--num-heads", "16", "--batch", "4", "--device", "cpu", "--policy",
                 str(pol), "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and data["chosen"] == "reference" and data["options"] == {"chunk_tokens": 128}
    code = main(["backends", "explain", "--num-heads", "16", "--batch", "64", "--device", "cpu", "--policy",
                 str(pol)])
    out = capsys.readouterr().out
    assert code == 0 and "options: chunk_tokens=4096" in out


def test_list_says_which_distribution_provides_a_missing_backend(capsys):
    assert main(["backends", "list", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)["backends"]}
    for name, dist in (("cutlass_mla", "mla-cutlass"), ("cute_dsl_mla", "mla-cute-dsl")):
        if rows[name]["status"] == "not installed":
            assert rows[name]["distribution"] == dist
            assert f"pip install {dist}" in rows[name]["reasons"][0]
    assert "details" in rows["reference"] and "traceback" not in rows["reference"]


def test_list_traceback_of_a_broken_plugin(plugin_site):
    proc = run_cli("backends", "list", "--traceback", plugin_site=plugin_site)
    assert proc.returncode == 0, proc.stderr
    assert "bad_import" in proc.stdout and "Traceback (most recent call last)" in proc.stdout
    assert "ModuleNotFoundError" in proc.stdout
    proc = run_cli("backends", "list", "--json", "--traceback", plugin_site=plugin_site)
    rows = {r["name"]: r for r in json.loads(proc.stdout)["backends"]}
    assert "Traceback" in rows["bad_import"]["traceback"]
    proc = run_cli("backends", "list", plugin_site=plugin_site)
    assert "Traceback" not in proc.stdout and "--traceback" in proc.stdout


def _run_with_columns(columns, *args):
    env = {**subprocess_env(), "COLUMNS": columns}
    return subprocess.run([sys.executable, "-m", "mlacore", *args], capture_output=True, text=True, env=env,
                          timeout=120)


def test_tables_follow_columns_keep_names_whole_and_stay_plain_when_piped():
    proc = _run_with_columns("90", "backends", "list")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert max(len(line.rstrip()) for line in lines) <= 90
    assert "\x1b[" not in proc.stdout  # no colour codes in a pipe
    # every backend name, distribution and status word stays whole (never folded across lines); taken from
    # --json so the test holds on a GPU machine too, where the statuses differ from the CPU's
    listed = json.loads(run_cli("backends", "list", "--json").stdout)["backends"]
    words = {w for b in listed for w in (b["name"], b.get("distribution"), b["status"]) if w}
    assert {"flashinfer_mla", "mla-flashinfer", "reference", "cutlass_mla"} <= words
    for name in sorted(words):
        assert name in proc.stdout, name
    wide = _run_with_columns("250", "backends", "list")
    assert max(len(line.rstrip()) for line in wide.stdout.splitlines()) > 90


def test_policy_check_json(tmp_path):
    good = tmp_path / "good.toml"
    good.write_text('[mla]\norder = ["reference"]\n')
    proc = run_cli("policy", "check", str(good), "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["ok"] is True and data["order"] == ["reference"] and data["warnings"] == []


def test_check_json_on_cpu():
    proc = run_cli("check", "--quick", "--device", "cpu", "--backend", "reference", "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["passed"] == 12 and data["failed"] == 0
    assert all(r["result"] == "pass" for r in data["results"])


def test_bench_json_on_stdout_and_output_file(tmp_path):
    grid = tmp_path / "g.toml"
    grid.write_text("[grid]\nnum_heads=[16]\nbatch=[1]\nkv_len=[64]\npage_size=[64]\n")
    out = tmp_path / "m.json"
    proc = run_cli("bench", "--grid", str(grid), "--backend", "reference", "--device", "cpu", "--budget", "0.01",
                   "--json", "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)  # nothing but JSON on stdout
    assert data["rows"][0]["status"] == "ok"
    assert data["rows"][0]["speedup_vs_best_other"] is None  # NaN is null
    assert json.loads(out.read_text()) ["rows"][0]["backend"] == "reference"
    assert "NaN" not in out.read_text()


def test_cli_source_has_no_torch_at_import_time():
    # the module the console script loads must stay cheap: no third-party import at top level
    import ast
    import mlacore.tools.cli as cli

    tree = ast.parse(open(cli.__file__).read())
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    names = {a.name for n in top for a in n.names} | {getattr(n, "module", None) or "" for n in top}
    assert not names & {"torch", "rich", "pydantic", "tomlkit"}, names
    assert os.path.basename(cli.__file__) == "cli.py"


def test_policy_check_of_a_tuned_file_compares_fingerprints_without_torch(tmp_path):
    """A tuned file makes `mla policy check` compare this machine with the tuned one: that comparison reads
    package metadata and NVML, so it still imports no torch (issue 13: under 0.5 s, no CUDA probe)."""
    p = tmp_path / "tuned.toml"
    p.write_text('[mla]\norder = ["reference"]\n[tuned]\ngpu = "TestGPU"\ncapability = "9.0"\ntorch = "2.x"\n')
    loaded = _modules_after_cli("policy", "check", str(p))
    assert "mlacore.tools.fingerprint" in loaded  # the comparison ran
    assert "torch" not in loaded and "rich" not in loaded


def test_light_fingerprint_equals_torchs_view_of_this_machine():
    """What `mla policy check` reads (metadata + NVML) must equal what `mla bench` records (torch, CUDA), or a
    file tuned on this very machine would warn. On a GPU box this compares NVML's device name, capability and
    driver with the CUDA runtime's."""
    from mlacore.tools.fingerprint import current_fingerprint, light_fingerprint

    assert light_fingerprint() == current_fingerprint()


def test_light_fingerprint_sees_no_gpu_when_cuda_visible_devices_hides_them(monkeypatch):
    from mlacore.tools.fingerprint import light_fingerprint

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    now = light_fingerprint()
    assert (now["gpu"], now["capability"], now["driver"]) == ("cpu", "-", "")
    import torch

    assert now["torch"] == torch.__version__  # the local tag too (2.11.0+cu130), which metadata may drop


class _FakeNvml:
    """A stand-in for libnvidia-ml (and libcuda's cuDriverGetVersion) so that the light fingerprint's NVML
    branches run on a CPU machine: `devices` is [(name, (major, minor), mig_on)]; `missing` names calls the
    fake driver lacks (AttributeError, as ctypes raises for an absent symbol); `fail` names calls that
    return an NVML error."""

    def __init__(self, devices, missing=(), fail=()):
        self.devices, self.missing, self.fail = devices, set(missing), set(fail)
        self.shutdowns = 0

    def __getattr__(self, name):
        if name in self.missing or not hasattr(type(self), "_" + name):
            raise AttributeError(name)
        method = getattr(type(self), "_" + name)

        def call(*args):
            return 999 if name in self.fail else method(self, *args)
        return call

    def _nvmlInit_v2(self):
        return 0

    def _nvmlShutdown(self):
        self.shutdowns += 1
        return 0

    def _nvmlDeviceGetCount_v2(self, count):
        count._obj.value = len(self.devices)
        return 0

    def _nvmlDeviceGetHandleByIndex_v2(self, index, handle):
        handle._obj.value = index.value + 1
        return 0

    def _nvmlDeviceGetName(self, handle, buf, size):
        buf.value = self.devices[handle.value - 1][0].encode()
        return 0

    def _nvmlDeviceGetCudaComputeCapability(self, handle, major, minor):
        major._obj.value, minor._obj.value = self.devices[handle.value - 1][1]
        return 0

    def _nvmlDeviceGetMigMode(self, handle, current, pending):
        current._obj.value = int(self.devices[handle.value - 1][2])
        return 0

    def _cuDriverGetVersion(self, version):
        version._obj.value = 13000
        return 0


def _with_fake_libs(monkeypatch, nvml=None, libcuda=True):
    import ctypes

    def cdll(name, *a, **k):
        if "nvidia-ml" in name and nvml is not None:
            return nvml
        if "libcuda" in name and libcuda:
            return nvml or _FakeNvml([])
        raise OSError(f"{name}: cannot open shared object file")
    monkeypatch.setattr(ctypes, "CDLL", cdll)


H200 = ("NVIDIA H200", (9, 0), False)


@pytest.mark.parametrize("visible,devices,env,expected", [
    (None, [H200], {}, ("NVIDIA H200", "9.0", "13.0")),
    ("1", [H200, H200], {}, ("NVIDIA H200", "9.0", "13.0")),
    ("0", [("NVIDIA H100 80GB HBM3", (9, 0), False), ("NVIDIA L4", (8, 9), False)], {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"},
     ("NVIDIA H100 80GB HBM3", "9.0", "13.0")),
    (None, [("NVIDIA H100 80GB HBM3", (9, 0), False), ("NVIDIA L4", (8, 9), False)], {}, None),  # CUDA's order unknown
    ("GPU-8932f937", [H200], {}, None),  # a UUID (prefix): NVML cannot resolve prefixes
    ("MIG-GPU-8932f937-aaaa/1/0", [H200], {}, None),
    (None, [("NVIDIA H200", (9, 0), True)], {}, None),  # MIG on: CUDA's device 0 is an instance
    ("7", [H200], {}, None),  # no such index
    ("", [H200], {}, ("cpu", "-", "")),
    ("-1", [H200], {}, ("cpu", "-", "")),
    (None, [], {}, ("cpu", "-", "")),
])
def test_light_fingerprint_nvml_branches(monkeypatch, visible, devices, env, expected):
    from mlacore.tools import fingerprint

    nvml = _FakeNvml(devices)
    _with_fake_libs(monkeypatch, nvml)
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert fingerprint._nvml_device() == expected
    now = fingerprint.light_fingerprint()
    assert (now["gpu"], now["capability"], now["driver"]) == (expected or (None, None, None))


@pytest.mark.parametrize("missing,fail", [(("nvmlDeviceGetCount_v2",), ()), (("nvmlInit_v2",), ()),
                                          ((), ("nvmlInit_v2",)), ((), ("nvmlDeviceGetCudaComputeCapability",))])
def test_light_fingerprint_is_unknown_not_cpu_when_nvml_cannot_answer(monkeypatch, missing, fail):
    """An old driver without a call, or an NVML error, on a GPU machine: the GPU fields are unknown (not
    compared), never "cpu" (which would tell the user to re-tune on the very GPU the file was tuned on)."""
    from mlacore.tools import fingerprint

    _with_fake_libs(monkeypatch, _FakeNvml([H200], missing=missing, fail=fail))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert fingerprint._nvml_device() is None
    tuned = type("T", (), {"gpu": "NVIDIA H200", "capability": "9.0", "driver": "13.0", "torch": "",
                           "backends": {}})()
    assert fingerprint.fingerprint_mismatches(tuned) == []


def test_light_fingerprint_without_nvml_but_with_a_driver_is_unknown_and_without_both_is_cpu(monkeypatch):
    from mlacore.tools import fingerprint

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    _with_fake_libs(monkeypatch, nvml=None, libcuda=True)  # a container without the NVML `utility` libraries
    assert fingerprint._nvml_device() is None
    _with_fake_libs(monkeypatch, nvml=None, libcuda=False)
    assert fingerprint._nvml_device() == ("cpu", "-", "")


def test_backends_options_lists_every_option_with_values_default_and_description():
    from typing import Literal, Optional, Union

    from mlacore.tools.cli import type_text

    assert type_text(Literal["auto", 1, 2]) == '"auto" | 1 | 2'
    assert type_text(Optional[bool]) == "bool or unset"
    assert type_text(Union[Literal["auto"], int]) == '"auto" | int'
    proc = run_cli("backends", "options", "--json")
    assert proc.returncode == 0, proc.stderr
    listed = {b["name"]: b for b in json.loads(proc.stdout)["backends"]}
    fi = {o["name"]: o for o in listed["flashinfer_mla"]["options"]}
    assert fi["variant"]["default"] == "auto" and '"fa3"' in fi["variant"]["values"]
    assert all(o["description"] for o in fi.values())
    from mla_flashinfer.plugin import FlashInferOptions

    assert set(fi) == set(FlashInferOptions.model_fields)
    assert [o["name"] for o in listed["reference"]["options"]] == ["chunk_tokens"] and listed["reference"]["loaded"]
    one = run_cli("backends", "options", "flashinfer_mla", "--json")
    assert [b["name"] for b in json.loads(one.stdout)["backends"]] == ["flashinfer_mla"]
    table = _run_with_columns("120", "backends", "options", "flashinfer_mla")
    assert table.returncode == 0, table.stderr
    assert "[backend.NAME.options]" in table.stdout and "trtllm-gen" in table.stdout
    assert max(len(line.rstrip()) for line in table.stdout.splitlines()) <= 120


def test_backends_options_names_an_unknown_backend_in_one_line():
    proc = run_cli("backends", "options", "nope")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "mla: error: backend: 'nope' is not installed; installed: " + ", ".join(
            sorted(b["name"] for b in json.loads(run_cli("backends", "list", "--json").stdout)["backends"]
                   if b["status"] != "not installed"))]


def test_a_version_range_in_the_notes_wraps_whole_when_the_terminal_has_room():
    proc = _run_with_columns("120", "backends", "list")
    assert proc.returncode == 0, proc.stderr
    assert "flashinfer-python>=0.7.2,<0.7.3" in proc.stdout  # not folded at the column edge
    assert max(len(line.rstrip()) for line in proc.stdout.splitlines()) <= 120
