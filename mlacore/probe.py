"""What a GPU backend's `availability` asks first: is its library installed, is there a CUDA device.

Shared by the backend packages so that every one words the same facts the
same way. Imports torch only when called (listing backends stays light).

`library_installed` and `checked_range` never touch a GPU: they are what a
backend's `availability_for(device)` (a simulated device) may ask.
"""

from __future__ import annotations

import importlib.util
import re
from importlib import metadata
from typing import Dict, List, Optional, Tuple


def library_installed(module: str, distribution: str, install_hint: str, key: Optional[str] = None
                      ) -> Tuple[List[str], Dict[str, str]]:
    """(reasons, details): whether `module` (from `distribution`) can be imported; imports nothing.

    `key` names the library's version in `details` (default: the distribution).
    """
    key = key or distribution
    reasons: List[str] = []
    details: Dict[str, str] = {}
    if importlib.util.find_spec(module) is None:
        reasons.append(f"{distribution} is not installed ({install_hint})")
    else:
        try:
            details[key] = metadata.version(distribution)
        except metadata.PackageNotFoundError:
            details[key] = "?"
    return reasons, details


def _release(version: str) -> Tuple[int, ...]:
    """The numeric release part of a version string ("0.7.2.post1" -> (0, 7, 2))."""
    parts = []
    for piece in version.split("."):
        m = re.match(r"\d+", piece)
        if m is None:
            break
        parts.append(int(m.group()))
        if m.end() != len(piece):
            break
    return tuple(parts)


def checked_range(distribution: str, version: Optional[str], low: str, high: str) -> Optional[str]:
    """Why `version` of `distribution` is outside the range a plugin was checked against, [low, high); None: inside.

    Why refuse rather than warn: the plugin mirrors the library's argument
    names, dtypes and checks of one release; another release may change them
    silently (opentelemetry-python-contrib's instrumentations refuse the same way).
    """
    if version is None or version == "?":
        return None
    if not (_release(low) <= _release(version) < _release(high)):
        return (f"{distribution} {version} is installed; this plugin was checked against "
                f"{distribution}>={low},<{high} (install that range, or update the plugin)")
    return None


def library_and_cuda(module: str, distribution: str, install_hint: str, key: Optional[str] = None
                     ) -> Tuple[List[str], Dict[str, str], Optional[Tuple[int, int]]]:
    """(reasons, details, capability): whether `module` (from `distribution`) imports and a CUDA GPU is visible.

    `capability` is the current device's (major, minor), or None without a GPU;
    `key` names the library's version in `details` (default: the distribution).
    """
    reasons, details = library_installed(module, distribution, install_hint, key)
    import torch

    capability = None
    if torch.version.cuda is None:
        reasons.append(f"torch {torch.__version__} has no CUDA support")
    elif not torch.cuda.is_available():
        reasons.append("no CUDA device visible (torch.cuda.is_available() is False)")
    else:
        capability = tuple(torch.cuda.get_device_capability())
        details["device"] = f"{torch.cuda.get_device_name()} sm_{capability[0]}{capability[1]}"
        details["cuda"] = str(torch.version.cuda)
    return reasons, details, capability
