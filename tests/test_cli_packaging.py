"""Packaging: license metadata, dependencies that match what the runtime imports, plugin pins, one version."""

import ast
import sys
from importlib import metadata
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
CORE = tomllib.loads((ROOT / "pyproject.toml").read_text())
PLUGIN_DIRS = sorted(p.parent for p in (ROOT / "plugins").glob("*/pyproject.toml"))

# import name -> distribution name, for the third-party modules the runtime may import
DIST_OF = {"torch": "torch", "pluggy": "pluggy", "pydantic": "pydantic", "typing_extensions": "typing_extensions",
           "tomli": "tomli"}
STDLIB = set(sys.stdlib_module_names)


def _requirement_names(reqs):
    import re

    return {re.split(r"[\s\[<>=!~;]", r, maxsplit=1)[0].lower().replace("_", "-") for r in reqs}


@pytest.mark.parametrize("path", [ROOT] + PLUGIN_DIRS, ids=lambda p: p.name)
def test_every_distribution_has_license_classifiers_and_readme(path):
    project = tomllib.loads((path / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"
    assert project["license-files"] == ["LICENSE"]
    assert "Apache License" in (path / "LICENSE").read_text() and "Version 2.0" in (path / "LICENSE").read_text()
    assert any(c.startswith("Programming Language :: Python :: 3") for c in project["classifiers"])
    assert (path / project["readme"]).is_file()


def test_runtime_dependencies_are_what_the_runtime_imports():
    deps = _requirement_names(CORE["project"]["dependencies"])
    assert not deps & {"rich", "tomlkit", "numpy", "matplotlib"}, deps
    assert _requirement_names(CORE["project"]["optional-dependencies"]["cli"]) >= {"rich", "tomlkit"}
    imported = set()
    for py in (ROOT / "mlacore").rglob("*.py"):
        rel = py.relative_to(ROOT / "mlacore").parts
        if rel[0] in ("tools", "testing"):
            continue  # the CLI (extra `cli`) and the conformance suite (run under pytest)
        for node in ast.walk(ast.parse(py.read_text())):
            if isinstance(node, ast.Import):
                imported |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported.add(node.module.split(".")[0])
    third_party = imported - STDLIB - {"mlacore"}
    undeclared = {m for m in third_party if DIST_OF.get(m, m).lower().replace("_", "-") not in deps}
    assert not undeclared, f"the runtime imports {sorted(undeclared)} without declaring them"


def test_plugins_pin_the_core_minor_series_and_their_kernel_library():
    core = CORE["project"]["version"]
    major, minor = (int(x) for x in core.split(".")[:2])
    for path in PLUGIN_DIRS:
        deps = tomllib.loads((path / "pyproject.toml").read_text())["project"]["dependencies"]
        assert f"mlacore>={major}.{minor},<{major}.{minor + 1}" in deps, (path.name, deps)
    fi = tomllib.loads((ROOT / "plugins/flashinfer_mla/pyproject.toml").read_text())["project"]["dependencies"]
    assert "flashinfer-python>=0.7.2,<0.7.3" in fi


def test_the_version_has_one_source():
    assert metadata.version("mlacore") == CORE["project"]["version"]
    import mlacore

    assert mlacore.__version__ == metadata.version("mlacore")
    # the plugins too: each package's __version__ is its distribution's (pyproject.toml), not a copy
    for folder, package, dist in (("cute_dsl_mla", "mla_cute_dsl", "mla-cute-dsl"),
                                  ("cutlass_mla", "mla_cutlass", "mla-cutlass"),
                                  ("flashinfer_mla", "mla_flashinfer", "mla-flashinfer")):
        declared = tomllib.loads((ROOT / "plugins" / folder / "pyproject.toml").read_text())["project"]["version"]
        assert metadata.version(dist) == declared, f"{dist}: reinstall the plugin (pip install -e)"
        init = (ROOT / "plugins" / folder / package / "__init__.py").read_text()
        assert "__version__ = " not in init, f"{package} keeps its own copy of the version"
        assert __import__(package).__version__ == declared


def test_the_makefile_demo_installs_only_the_cli():
    text = (ROOT / "Makefile").read_text()
    demo = text.split("$(VENV)/.demo:")[1].split("\n\n")[0]
    assert "flashinfer" not in demo and "[test]" not in demo and "$(TORCH_PIN)" in demo
    test = text.split("$(VENV)/.test:")[1].split("\n\n")[0]
    assert "plugins/flashinfer_mla" in test and "$(FLASHINFER_PIN)" in test
    assert "make test" in (ROOT / ".ci/run").read_text()


def test_versions_come_from_metadata_with_a_marked_fallback():
    from mlacore.versions import distribution_version, version_getattr

    assert distribution_version("mlacore") == metadata.version("mlacore")
    assert distribution_version("no-such-distribution-mla") == "0+unknown"
    getattr_ = version_getattr("pkg", "mlacore")
    assert getattr_("__version__") == metadata.version("mlacore")
    with pytest.raises(AttributeError, match="module 'pkg' has no attribute 'other'"):
        getattr_("other")
