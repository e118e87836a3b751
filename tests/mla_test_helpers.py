"""Helpers the tests in this folder import (not fixtures: those live in conftest.py).

A module of its own, with a name no other test folder uses: `from conftest import ...`
picks whichever folder's conftest.py pytest imported first when one run collects
several test folders (`pytest tests plugins/cute_dsl_mla/tests`), and fails there.
"""

from __future__ import annotations

import os
from pathlib import Path


def subprocess_env(plugin_site: Path | None = None, **extra: str) -> dict:
    """The environment for a child process: no MLA_* settings of the caller, the test plugins on
    PYTHONPATH when given, `extra` on top, and a wide terminal so tables never fold."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLA_")}
    if plugin_site is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(plugin_site), env.get("PYTHONPATH", "")])
    env.update(extra)
    env["COLUMNS"] = "200"
    return env
