"""What a GPU backend's `availability` asks first: is its library installed, is there a CUDA device.

Shared by the backend packages so that every one words the same facts the
same way. Imports torch only when called (listing backends stays light).
"""

from __future__ import annotations

import importlib.util
from importlib import metadata
from typing import Dict, List, Optional, Tuple


def library_and_cuda(module: str, distribution: str, install_hint: str, key: Optional[str] = None
                     ) -> Tuple[List[str], Dict[str, str], Optional[Tuple[int, int]]]:
    """(reasons, details, capability): whether `module` (from `distribution`) imports and a CUDA GPU is visible.

    `capability` is the current device's (major, minor), or None without a GPU;
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
