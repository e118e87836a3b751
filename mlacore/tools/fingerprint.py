"""What a tuned policy was measured on, and whether this machine is the same.

A policy written by `mla tune` is only as good as the match between the
machine it was measured on and the one reading it; `mla policy check` warns
when GPU, driver, torch or a backend's version differ.

Two ways to read this machine: `current_fingerprint` (torch's own view, used
by `mla bench`, which has torch and CUDA up anyway) and `light_fingerprint`
(package metadata, torch/version.py, NVML and libcuda's driver version, used
by `mla policy check`, which must stay fast and import neither torch nor start
CUDA). Both give the same strings on one machine (checked on an H200), except
that the light one leaves the GPU fields unknown where NVML cannot tell which
GPU CUDA would call device 0 (MIG, UUIDs, mixed GPUs; see `_nvml_device`).
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
        lib = ctypes.CDLL("libcuda.so.1")
        version = ctypes.c_int()
        if lib.cuDriverGetVersion(ctypes.byref(version)) == 0:
            return f"{version.value // 1000}.{(version.value % 1000) // 10}"
    except (OSError, AttributeError):  # no libcuda, or one without the call
        pass
    return ""


NO_GPU = ("cpu", "-", "")


def _nvml_device() -> Optional[Tuple[str, str, str]]:
    """(name, capability, driver) of the GPU CUDA calls device 0, read through NVML (no CUDA context, no
    torch); `NO_GPU` when this machine has no NVIDIA driver or CUDA_VISIBLE_DEVICES hides every GPU; None
    when it has a GPU but NVML cannot say which one CUDA would use, so that the caller compares nothing
    rather than warn about a GPU that is there: no NVML library beside libcuda (containers without the
    `utility` capability), GPUs named by UUID or MIG instance in CUDA_VISIBLE_DEVICES, MIG mode on (CUDA's
    device 0 is then an instance), GPUs of different kinds whose NVML order (PCI bus) may differ from CUDA's
    default order, a driver without one of these calls, or any NVML error."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    first = None if visible is None else visible.split(",")[0].strip()
    if first is not None and (first == "" or first.startswith("-")):
        return NO_GPU
    try:
        lib = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        try:
            ctypes.CDLL("libcuda.so.1")
        except OSError:
            return NO_GPU
        return None
    if first is not None and not first.isdigit():
        return None
    try:
        if lib.nvmlInit_v2() != 0:
            return None
    except AttributeError:
        return None
    try:
        count = ctypes.c_uint()
        if lib.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
            return None
        if count.value == 0:
            return NO_GPU
        names = set()
        for index in range(count.value):
            handle = ctypes.c_void_p()
            name = ctypes.create_string_buffer(96)
            if (lib.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(index), ctypes.byref(handle)) != 0
                    or lib.nvmlDeviceGetName(handle, name, ctypes.c_uint(96)) != 0):
                return None
            names.add(name.value)
        if len(names) > 1 and os.environ.get("CUDA_DEVICE_ORDER") != "PCI_BUS_ID":
            return None
        index = int(first or 0)
        if index >= count.value:
            return None
        handle = ctypes.c_void_p()
        name = ctypes.create_string_buffer(96)
        major, minor = ctypes.c_int(), ctypes.c_int()
        mig, pending = ctypes.c_uint(), ctypes.c_uint()
        if (lib.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(index), ctypes.byref(handle)) != 0
                or lib.nvmlDeviceGetName(handle, name, ctypes.c_uint(96)) != 0
                or lib.nvmlDeviceGetCudaComputeCapability(handle, ctypes.byref(major), ctypes.byref(minor)) != 0):
            return None
        # NOT_SUPPORTED (no MIG on this GPU) leaves mig at 0; MIG enabled: CUDA's device 0 is an instance
        lib.nvmlDeviceGetMigMode(handle, ctypes.byref(mig), ctypes.byref(pending))
        if mig.value == 1:
            return None
        return name.value.decode(errors="replace"), f"{major.value}.{minor.value}", _driver_version()
    except (AttributeError, ctypes.ArgumentError, ValueError):
        return None
    finally:
        try:
            lib.nvmlShutdown()
        except AttributeError:
            pass


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
    """This machine as `current_fingerprint` would describe it, without importing torch or starting CUDA;
    gpu, capability and driver are None where NVML cannot tell which GPU CUDA would use (not compared)."""
    gpu, capability, driver = _nvml_device() or (None, None, None)
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
        if then and now[key] is not None and then != now[key]:
            out.append(f"tuned on {key}={then!r}, this machine has {now[key]!r}: re-run `mla tune`")
    for name, version in tuned.backends.items():
        have = now["backends"].get(name)
        if have != version:
            out.append(f"tuned with {name} {version}, this machine has {have or 'none'}: re-run `mla tune`")
    return out
