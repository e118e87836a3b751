"""Shared fixtures: the test plugin packages, installed for real."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
PLUGIN_PACKAGES = HERE / "plugin_packages"


@pytest.fixture(scope="session")
def plugin_site(tmp_path_factory) -> Path:
    """The test plugin distributions, pip-installed into a folder of their own.

    They are real distributions (dist-info, entry points), installed without
    touching mlacore or the test environment's site-packages; tests put the
    folder on sys.path (in-process) or PYTHONPATH (subprocesses).
    """
    target = tmp_path_factory.mktemp("plugin_site")
    pkgs = sorted(str(p) for p in PLUGIN_PACKAGES.iterdir() if (p / "pyproject.toml").exists())
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
         "--no-index", "--target", str(target), *pkgs],
        check=True,
    )
    return target


@pytest.fixture
def with_plugins(plugin_site, monkeypatch):
    """sys.path holds the test plugins for this test only."""
    monkeypatch.syspath_prepend(str(plugin_site))
    return plugin_site

