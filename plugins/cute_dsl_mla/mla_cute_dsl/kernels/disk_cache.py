"""Persistent on-disk cache of compiled kernels (one file per specialization).

Why this exists: ``cute.compile`` takes 1-3 s per specialization and the
CuTe DSL 4.8.1 does not keep its result across processes: ``cute.compile``
always passes ``no_cache=True`` (``base_dsl/compiler.py``), so
``CUTE_DSL_CACHE_DIR`` / the DSL file cache only serve implicit ``@cute.jit``
calls, and even there the IR is traced again and the host code JIT-built.

The DSL's documented route to reuse a TVM-FFI kernel elsewhere is AOT
export: ``compiled.export_to_c(path.o, function_name=sym)`` writes an ELF
object holding the host launch code and the cubin, and
``cute.runtime.load_module(path, enable_tvm_ffi=True)`` links it in memory
(LLVM JITLink) and returns ``mod.<sym>``, a ``tvm_ffi.Function`` taking the
same positional arguments as the compiled function. Loading costs
milliseconds and never calls the compiler.

Entry file: a magic line, one JSON header line (the full cache key, the
symbol, payload size and SHA-256) and the object file bytes. The header is
checked before the bytes reach the linker, so a truncated or foreign file is
reported and recompiled instead of being handed to JITLink. Writes go to a
temporary file in the same directory and are renamed into place (atomic on
POSIX), so concurrent processes never see a partial entry.

Environment:
  ``MLA_CUTE_DSL_CACHE_DIR``  cache root (default ``$XDG_CACHE_HOME/mla-cute-dsl``
                              or ``~/.cache/mla-cute-dsl``)
  ``MLA_CUTE_DSL_DISK_CACHE`` ``0``/``off``/``false``/``no`` disables the disk cache
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple

from .cache_key import key_digest

log = logging.getLogger("mla_cute_dsl")

ENV_DIR = "MLA_CUTE_DSL_CACHE_DIR"
ENV_ENABLE = "MLA_CUTE_DSL_DISK_CACHE"
MAGIC = b"MLA-CUTE-DSL-KERNEL 1\n"
_OFF = ("0", "off", "false", "no")


class CorruptEntry(Exception):
    """A cache file that cannot be trusted (bad magic, header, size or hash)."""


def enabled() -> bool:
    """False when ``MLA_CUTE_DSL_DISK_CACHE`` is 0/off/false/no."""
    return os.environ.get(ENV_ENABLE, "1").strip().lower() not in _OFF


def cache_root() -> Optional[Path]:
    """The cache directory, or None when the disk cache is disabled."""
    if not enabled():
        return None
    explicit = os.environ.get(ENV_DIR, "").strip()
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "mla-cute-dsl"


def entry_path(root: Path, key: Dict[str, Any], symbol: str) -> Path:
    """``<root>/cutedsl-<version>-<arch>/<symbol>-<digest>.kernel``.

    The per-release/arch folder only makes stale entries easy to delete by
    hand; the digest alone decides a match.
    """
    folder = f"cutedsl-{key['dsl_version']}-{key['arch']}"
    return root / folder / f"{symbol}-{key_digest(key)[:32]}.kernel"


def encode_entry(key: Dict[str, Any], symbol: str, payload: bytes, compile_s: float) -> bytes:
    """Bytes of one entry: magic, JSON header line, object file."""
    header = {
        "key": key,
        "symbol": symbol,
        "size": len(payload),
        "sha256": hashlib.sha256(payload).hexdigest(),
        "compile_s": round(compile_s, 3),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    return MAGIC + json.dumps(header, sort_keys=True).encode() + b"\n" + payload


def decode_entry(data: bytes, key: Dict[str, Any]) -> Tuple[str, bytes]:
    """(symbol, object bytes) of an entry made for ``key``; CorruptEntry otherwise."""
    if not data.startswith(MAGIC):
        raise CorruptEntry("bad magic")
    end = data.find(b"\n", len(MAGIC))
    if end < 0:
        raise CorruptEntry("no header line")
    try:
        header = json.loads(data[len(MAGIC):end])
        symbol, size, digest = header["symbol"], int(header["size"]), header["sha256"]
        stored_key = header["key"]
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptEntry(f"bad header: {e}") from None
    if stored_key != key:
        raise CorruptEntry("entry was made for another key")
    payload = data[end + 1:]
    if len(payload) != size:
        raise CorruptEntry(f"payload is {len(payload)} bytes, header says {size}")
    if hashlib.sha256(payload).hexdigest() != digest:
        raise CorruptEntry("payload SHA-256 mismatch")
    if not isinstance(symbol, str) or not symbol.isidentifier():
        raise CorruptEntry(f"bad symbol {symbol!r}")
    return symbol, payload


def write_atomic(path: Path, data: bytes) -> None:
    """Write via a temporary file in the same folder and rename it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def export_object(compiled: Any, symbol: str) -> bytes:
    """Object file of a ``cute.compile(..., options='--enable-tvm-ffi')`` result."""
    with tempfile.TemporaryDirectory(prefix="mla-cute-dsl-") as d:
        path = os.path.join(d, f"{symbol}.o")
        compiled.export_to_c(path, function_name=symbol)
        with open(path, "rb") as f:
            return f.read()


def load_object(payload: bytes, symbol: str) -> Callable[..., Any]:
    """Link an exported object in memory and return its TVM-FFI function.

    ``load_module`` reads the file into memory before linking, so the
    temporary file can go right after.
    """
    import cutlass.cute as cute

    with tempfile.TemporaryDirectory(prefix="mla-cute-dsl-") as d:
        path = os.path.join(d, f"{symbol}.o")
        with open(path, "wb") as f:
            f.write(payload)
        module = cute.runtime.load_module(path, enable_tvm_ffi=True)
        return getattr(module, symbol)


def load(key: Dict[str, Any], symbol: str) -> Optional[Callable[..., Any]]:
    """The cached kernel for ``key``, or None (disabled, missing, or unusable).

    An unreadable or corrupt entry, or one the DSL refuses to link, is
    logged as a warning and treated as a miss: the caller recompiles and
    overwrites it.
    """
    root = cache_root()
    if root is None:
        return None
    path = entry_path(root, key, symbol)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        log.warning("mla_cute_dsl disk cache: cannot read %s (%s); recompiling", path, e)
        return None
    try:
        stored_symbol, payload = decode_entry(data, key)
        return load_object(payload, stored_symbol)
    except Exception as e:  # CorruptEntry, or the DSL failing to link the object
        log.warning("mla_cute_dsl disk cache: ignoring corrupt entry %s (%s: %s); recompiling",
                    path, type(e).__name__, e)
        return None


def store(key: Dict[str, Any], symbol: str, compiled: Any, compile_s: float) -> Optional[Path]:
    """Export ``compiled`` and write its entry; the path, or None if not written.

    Failing to write (read-only home, full disk, export error) never fails
    the caller: the kernel is already compiled and cached in memory.
    """
    root = cache_root()
    if root is None:
        return None
    path = entry_path(root, key, symbol)
    try:
        payload = export_object(compiled, symbol)
        write_atomic(path, encode_entry(key, symbol, payload, compile_s))
    except Exception as e:
        log.warning("mla_cute_dsl disk cache: cannot write %s (%s: %s)", path, type(e).__name__, e)
        return None
    return path
