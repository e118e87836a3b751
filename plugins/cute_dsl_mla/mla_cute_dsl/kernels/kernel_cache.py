"""Where a kernel comes from: in-process dict, then the disk cache, then the compiler.

The in-process dict stays in front so a decode call never touches the disk
or hashes anything once its kernels are resolved. On a miss the disk cache
is tried (a few ms, no compiler); only then is the kernel compiled, the
compile time logged, and the result written to disk for the next process.
Counters record which path served each kernel, so tests and benchmarks can
tell a disk hit from a compile without parsing logs.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from typing import Any, Callable, Dict, Hashable, Optional

from . import disk_cache
from .cache_key import make_key

log = logging.getLogger("mla_cute_dsl")

_memory: Dict[Hashable, Any] = {}
_origin: Dict[Hashable, str] = {}
_lock = threading.Lock()
_stats = {"compiled": 0, "disk_hits": 0, "disk_writes": 0}


def symbol_for(kind: str, spec: tuple) -> str:
    """C identifier naming the exported function, e.g. ``mla_partial_bf16_fp8_e4m3_64``."""
    parts = ["mla", kind] + ["x".join(map(str, p)) if isinstance(p, tuple) else str(p)
                             for p in spec if p is not None]
    return re.sub(r"[^0-9A-Za-z_]", "_", "_".join(parts))


def get_or_build(kind: str, spec: tuple, build: Callable[..., Any]) -> Any:
    """The kernel for (kind, spec): memory, else disk, else ``build(*spec)`` (compile).

    ``build`` must return the ``cute.compile(..., options='--enable-tvm-ffi')``
    result; a disk hit returns the equivalent ``tvm_ffi.Function`` (same
    positional arguments).
    """
    mkey = (kind,) + spec
    fn = _memory.get(mkey)  # lock-free hit: a dict read is atomic, entries are only added
    if fn is not None:
        return fn
    with _lock:
        fn = _memory.get(mkey)
        if fn is not None:
            return fn
        fn = _resolve(kind, spec, build)
        _memory[mkey] = fn
        return fn


def _resolve(kind: str, spec: tuple, build: Callable[..., Any]) -> Any:
    key: Optional[dict] = None
    symbol = symbol_for(kind, spec)
    if disk_cache.cache_root() is not None:
        t0 = time.perf_counter()
        try:
            key = make_key(kind, spec)
        except Exception as e:  # e.g. an unreadable source file: compile, skip the disk
            log.warning("mla_cute_dsl disk cache: no key for %s %s (%s: %s)", kind, spec,
                        type(e).__name__, e)
        fn = disk_cache.load(key, symbol) if key is not None else None
        if fn is not None:
            _stats["disk_hits"] += 1
            _origin[(kind,) + spec] = "disk"
            log.info("loaded mla %s kernel %s from the disk cache in %.3f s (not compiled)",
                     kind, spec, time.perf_counter() - t0)
            return fn
    t0 = time.perf_counter()
    fn = build(*spec)
    dt = time.perf_counter() - t0
    _stats["compiled"] += 1
    _origin[(kind,) + spec] = "compiled"
    path = disk_cache.store(key, symbol, fn, dt) if key is not None else None
    if path is not None:
        _stats["disk_writes"] += 1
    log.info("compiled mla %s kernel %s in %.2f s (first compile; %s)", kind, spec, dt,
             f"saved to {path}" if path is not None else "not saved to disk")
    return fn


def stats() -> Dict[str, int]:
    """Counters since process start (or ``clear()``): compiled, disk_hits, disk_writes."""
    with _lock:
        return dict(_stats)


def origin(kind: str, spec: tuple) -> Optional[str]:
    """'compiled' or 'disk' for a kernel resolved in this process, else None."""
    with _lock:
        return _origin.get((kind,) + tuple(spec))


def clear() -> None:
    """Forget in-process kernels and counters (tests; the disk is left alone)."""
    with _lock:
        _memory.clear()
        _origin.clear()
        for k in _stats:
            _stats[k] = 0
