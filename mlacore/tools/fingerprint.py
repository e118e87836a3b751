"""What a tuned policy was measured on, and whether this machine is the same.

A policy written by `mla tune` is only as good as the match between the
machine it was measured on and the one reading it; `mla policy check` warns
when GPU, driver, torch or a backend's version differ.
"""

from __future__ import annotations

from typing import Dict, List

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


def fingerprint_mismatches(tuned) -> List[str]:
    now = current_fingerprint()
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
