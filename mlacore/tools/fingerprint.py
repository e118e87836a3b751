"""What a tuned policy was measured on, and whether this machine is the same.

A policy written by `mla tune` is only as good as the match between the
machine it was measured on and the one reading it; `mla policy check` warns
when GPU, driver, torch or a backend's version differ.

Two ways to read this machine: `current_fingerprint` (torch's own view, used
by `mla bench`, which has torch and CUDA up anyway) and `light_fingerprint`
(package metadata and NVML, used by `mla policy check`, which must stay fast
and import neither torch nor start CUDA). Both give the same strings on one
machine: NVML and the CUDA runtime report the same device name, compute
capability and driver version.
"""

from __future__ import annotations

import ast
import ctypes
import importlib.util
import os
from importlib import metadata
from typing import Dict, List, Optional, Tuple

from ..registry import get_registry


def current_fingerprint() -> Dict[str, object]:
    import torch

    gpu, capability, driver = "cpu", "-", ""
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        gpu = props.name
        capability = f"{props.major}.{props.minor}"
        driver = _driver_version()
    backends = {b.name: b.version for b in get_registry().backends() if b.loaded}
    return {"gpu": gpu, "capability": capability, "driver": driver, "torch": torch.__version__,
            "backends": backends}


def _driver_version() -> str:
    try:
        import ctypes

        lib = ctypes.CDLL("libcuda.so.1")
        version = ctypes.c_int()
        if lib.cuDriverGetVersion(ctypes.byref(version)) == 0:
            return f"{version.value // 1000}.{(version.value % 1000) // 10}"
    except OSError:
        pass
    return ""


def _nvml_device() -> Optional[Tuple[str, str, str]]:
    """(name, capability, driver) of the GPU CUDA would call device 0, through NVML (no CUDA context, no
    torch); None when there is no NVML library, no GPU, or CUDA_VISIBLE_DEVICES hides every GPU."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    first = None if visible is None else visible.split(",")[0].strip()
    if first is not None and (first == "" or first.startswith("-")):
        return None
    try:
        lib = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    if lib.nvmlInit_v2() != 0:
        return None
    try:
        handle = ctypes.c_void_p()
        if first is not None and not first.isdigit():  # a GPU UUID (or MIG UUID prefix)
            found = lib.nvmlDeviceGetHandleByUUID(first.encode(), ctypes.byref(handle))
        else:
            found = lib.nvmlDeviceGetHandleByIndex_v2(int(first or 0), ctypes.byref(handle))
        if found != 0:
            return None
        name = ctypes.create_string_buffer(96)
        major, minor, version = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
        if (lib.nvmlDeviceGetName(handle, name, 96) != 0
                or lib.nvmlDeviceGetCudaComputeCapability(handle, ctypes.byref(major), ctypes.byref(minor)) != 0):
            return None
        driver = ""
        if lib.nvmlSystemGetCudaDriverVersion_v2(ctypes.byref(version)) == 0:
            driver = f"{version.value // 1000}.{(version.value % 1000) // 10}"
        return name.value.decode(errors="replace"), f"{major.value}.{minor.value}", driver
    finally:
        lib.nvmlShutdown()


def _torch_version() -> str:
    """`torch.__version__` without importing torch: the `__version__` assignment in torch/version.py, which
    carries the local build tag (2.11.0+cu130) that the distribution's metadata may not (2.11.0 on the H200
    image); the metadata version when that file cannot be read."""
    try:
        spec = importlib.util.find_spec("torch")
        if spec is not None and spec.submodule_search_locations:
            path = os.path.join(list(spec.submodule_search_locations)[0], "version.py")
            with open(path, encoding="utf-8") as f:
                for node in ast.parse(f.read()).body:
                    if (isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__version__"
                                                             for t in node.targets)
                            and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)):
                        return node.value.value
    except (OSError, SyntaxError, ValueError, ImportError):
        pass
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return ""


def light_fingerprint() -> Dict[str, object]:
    """This machine as `current_fingerprint` would describe it, without importing torch or starting CUDA."""
    gpu, capability, driver = _nvml_device() or ("cpu", "-", "")
    torch_version = _torch_version()
    backends = {b.name: b.version for b in get_registry().backends() if b.loaded}
    return {"gpu": gpu, "capability": capability, "driver": driver, "torch": torch_version,
            "backends": backends}


def fingerprint_mismatches(tuned, now: Optional[Dict[str, object]] = None) -> List[str]:
    """Warnings for every way this machine (`light_fingerprint` unless given) differs from the tuned one."""
    now = light_fingerprint() if now is None else now
    out = []
    for key in ("gpu", "capability", "driver", "torch"):
        then = getattr(tuned, key)
        if then and then != now[key]:
            out.append(f"tuned on {key}={then!r}, this machine has {now[key]!r}: re-run `mla tune`")
    for name, version in tuned.backends.items():
        have = now["backends"].get(name)
        if have != version:
            out.append(f"tuned with {name} {version}, this machine has {have or 'none'}: re-run `mla tune`")
    return out
