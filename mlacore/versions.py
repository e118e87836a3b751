"""Versions with one source: the installed distribution's metadata (pyproject.toml).

mlacore and every plugin package answer ``__version__`` from it (PEP 562), so no
module keeps a copy of the number that could drift from what pip installed.
"""

from __future__ import annotations

from typing import Callable


def distribution_version(dist: str) -> str:
    """The installed version of distribution `dist`; "0+unknown" in a source tree that is not installed."""
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "0+unknown"


def version_getattr(module: str, dist: str) -> Callable[[str], str]:
    """A module ``__getattr__`` that answers ``__version__`` from `dist` and raises AttributeError otherwise."""

    def __getattr__(name: str) -> str:
        if name == "__version__":
            return distribution_version(dist)
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__
