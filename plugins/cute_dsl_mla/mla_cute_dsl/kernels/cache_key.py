"""What identifies a compiled kernel binary, for the on-disk kernel cache.

A cached object file may be reused only when everything that shaped its
bytes is the same: the specialization, the kernels' own source, the CuTe DSL
release and its compile-affecting settings (target arch, lineinfo, debug,
compiler options, runtime library), the TVM-FFI release the host entry was
built against, the compile options and the host platform. All of that goes
into one JSON-able dict; its SHA-256 names the file and the dict itself is
stored in the entry and compared on load (no trust in a hash prefix alone).

The DSL's own fingerprint (a hash of its Python sources and compiler
library) and its compile-affecting settings string are read through
``CuTeDSL._get_dsl()``, the object the DSL uses for its own JIT cache key.
They are private in 4.8.1, so each read falls back to public information
(package versions, ``CUTE_DSL_ARCH``) if it fails.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any, Dict, Optional

#: Bump when the entry format or the key fields change.
KEY_FORMAT = 1

#: Options passed to ``cute.compile`` for every kernel of this package.
COMPILE_OPTIONS = "--enable-tvm-ffi"

_KERNELS_DIR = Path(__file__).resolve().parent


@functools.lru_cache(maxsize=1)
def source_hash() -> str:
    """SHA-256 over the kernels package's ``*.py`` files (names and bytes).

    Any edit to a kernel, to the fake compile arguments in ``api.py`` or to a
    constant they import changes the binary, so all files of the package
    count (a change to a file that does not matter only costs a recompile).
    """
    h = hashlib.sha256()
    for path in sorted(_KERNELS_DIR.glob("*.py")):
        h.update(path.name.encode())
        h.update(b"\0")
        h.update(path.read_bytes())
        h.update(b"\0")
    return h.hexdigest()


def _package_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not-installed"


def _dsl() -> Optional[Any]:
    try:
        from cutlass.cutlass_dsl import CuTeDSL

        return CuTeDSL._get_dsl()
    except Exception:  # private API: absent or changed in another release
        return None


def dsl_version() -> str:
    """Release of nvidia-cutlass-dsl (the cutlass module's own version first)."""
    try:
        import cutlass

        return str(cutlass.__version__)
    except Exception:
        return _package_version("nvidia-cutlass-dsl")


def dsl_fingerprint() -> str:
    """The DSL's own version hash (its sources and compiler library); '' if unreadable."""
    dsl = _dsl()
    try:
        return str(dsl.get_version().hexdigest()) if dsl is not None else ""
    except Exception:
        return ""


def target_arch() -> str:
    """GPU arch the DSL compiles for: ``CUTE_DSL_ARCH`` or the detected device."""
    dsl = _dsl()
    try:
        if dsl is not None:
            return str(dsl.envar.arch)
    except Exception:
        pass
    return os.environ.get("CUTE_DSL_ARCH", "unknown")


def dsl_settings() -> str:
    """The DSL's compile-affecting settings (its own JIT cache key string)."""
    dsl = _dsl()
    try:
        if dsl is not None:
            return str(dsl.envar.cache_key_str())
    except Exception:
        pass
    return ""


def make_key(kind: str, spec: tuple, *, source: Optional[str] = None,
             version: Optional[str] = None, fingerprint: Optional[str] = None,
             arch: Optional[str] = None, settings: Optional[str] = None) -> Dict[str, Any]:
    """Key of one compiled kernel; the keyword arguments override detection (tests).

    The result is canonical JSON data (tuples become lists), so a key read
    back from an entry compares equal to a freshly made one.
    """
    key = {
        "format": KEY_FORMAT,
        "kind": kind,
        "spec": list(spec),
        "source_sha256": source if source is not None else source_hash(),
        "dsl_version": version if version is not None else dsl_version(),
        "dsl_fingerprint": fingerprint if fingerprint is not None else dsl_fingerprint(),
        "tvm_ffi_version": _package_version("apache-tvm-ffi"),
        "arch": arch if arch is not None else target_arch(),
        "dsl_settings": settings if settings is not None else dsl_settings(),
        "compile_options": COMPILE_OPTIONS,
        "host": f"{sys.platform}-{platform.machine()}",
    }
    return json.loads(json.dumps(key, sort_keys=True))


def key_digest(key: Dict[str, Any]) -> str:
    """SHA-256 hex digest of a key (names its cache file)."""
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
