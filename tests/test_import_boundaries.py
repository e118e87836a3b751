"""The runtime an engine imports stays small: no CLI, no rich, no tomlkit, no plotting.

Each check runs in a fresh interpreter, so what another test imported cannot hide a leak.
"""

import subprocess
import sys

import pytest

from mla_test_helpers import subprocess_env

CLI_ONLY = ("rich", "tomlkit", "matplotlib", "mlacore.tools", "mlacore.tools.cli", "mlacore.tools.bench",
            "mlacore.testing", "pytest")


def _modules_after(code: str) -> set:
    probe = code + "\nimport sys\nprint('\\n'.join(sorted(sys.modules)))\n"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=subprocess_env(),
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return set(done.stdout.split())


def test_a_decode_step_imports_no_cli_module():
    loaded = _modules_after(
        "import torch\n"
        "from mlacore import MLADecoder\n"
        "d = MLADecoder(4, 16)\n"
        "p = d.plan(torch.tensor([5, 20], dtype=torch.int32), torch.tensor([[0, 1], [2, 3]], dtype=torch.int32))\n"
        "d.run(torch.randn(2, 1, 4, 576).bfloat16(), torch.randn(4, 16, 576).bfloat16(), p)\n")
    assert "mlacore.decoder" in loaded and "mlacore.reference" in loaded
    leaked = sorted(m for m in CLI_ONLY if m in loaded)
    assert not leaked, f"the runtime imported {leaked}"


@pytest.mark.parametrize("module", ["mlacore.backend", "mlacore.errors", "mlacore.problem"])
def test_the_plugin_sdk_imports_without_torch_or_the_decoder(module):
    loaded = _modules_after(f"import {module}")
    assert "torch" not in loaded
    assert "mlacore.decoder" not in loaded and "mlacore.dispatch" not in loaded


def test_a_policy_check_needs_no_torch():
    loaded = _modules_after("from mlacore.policy import load_policy\nload_policy()")
    assert "torch" not in loaded
