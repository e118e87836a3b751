"""Backend discovery: entry points in, a registry of backends out.

Loading is guarded so that a plugin which fails to import, fails pluggy's
signature validation or raises in a hook is recorded as *broken* with its
error, and every other backend keeps working. Loading happens once per
registry (engines load in several processes and threads; a second load is a
no-op).

Environment:
  MLA_DISABLE_PLUGIN_AUTOLOAD=1  load only backends shipped by mlacore itself
  MLA_DISABLE_PLUGINS=a,b        never import these backends (like pytest's -p no:a)
"""

from __future__ import annotations

import os
import threading
import traceback
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Tuple

import pluggy

from .hookspecs import (
    ENTRY_POINT_GROUP,
    OPTIONAL_HOOKS,
    PROJECT,
    REQUIRED_HOOKS,
    Availability,
    BackendInfo,
    MLABackendSpec,
)

CORE_DISTRIBUTION = "mlacore"
ENV_DISABLE_AUTOLOAD = "MLA_DISABLE_PLUGIN_AUTOLOAD"
ENV_DISABLE_PLUGINS = "MLA_DISABLE_PLUGINS"

# Status values, as `mla backends list` shows them.
AVAILABLE = "available"
UNAVAILABLE = "unavailable"
BROKEN = "broken"
DISABLED = "disabled"


def _error_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _truthy(value: Optional[str]) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


@dataclass
class Backend:
    """One backend as the registry knows it, with its hook functions resolved."""

    name: str
    distribution: str = "?"
    version: str = "?"
    plugin: Any = None
    hooks: Dict[str, Callable[..., Any]] = field(default_factory=dict)
    load_error: Optional[str] = None
    load_traceback: Optional[str] = None
    disabled_reason: Optional[str] = None
    _availability: Optional[Availability] = None
    _info: Optional[BackendInfo] = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def loaded(self) -> bool:
        return self.load_error is None and self.disabled_reason is None

    def info(self) -> BackendInfo:
        if self._info is None:
            info = BackendInfo()
            fn = self.hooks.get("mla_backend_info")
            if fn is not None:
                try:
                    got = fn()
                    if isinstance(got, BackendInfo):
                        info = got
                    else:
                        self._mark_broken(f"mla_backend_info returned {type(got).__name__}, expected BackendInfo")
                except Exception as exc:  # a plugin's bug must not escape
                    self._mark_broken(f"mla_backend_info raised {_error_line(exc)}", exc)
            self._info = info
        return self._info

    def availability(self) -> Availability:
        """Asked once per process; the answer is kept (hardware does not change under us)."""
        if self._availability is not None:
            return self._availability
        with self._lock:
            if self._availability is None:
                self._availability = self._compute_availability()
        return self._availability

    def _compute_availability(self) -> Availability:
        if self.disabled_reason is not None:
            return Availability(False, (self.disabled_reason,))
        if self.load_error is not None:
            return Availability(False, (self.load_error,))
        try:
            got = self.hooks["mla_availability"]()
        except Exception as exc:
            self._mark_broken(f"mla_availability raised {_error_line(exc)}", exc)
            return Availability(False, (self.load_error or "",))
        if not isinstance(got, Availability):
            self._mark_broken(f"mla_availability returned {type(got).__name__}, expected Availability")
            return Availability(False, (self.load_error or "",))
        return got

    def _mark_broken(self, message: str, exc: Optional[BaseException] = None) -> None:
        if self.load_error is None:
            self.load_error = message
            if exc is not None:
                self.load_traceback = "".join(traceback.format_exception(exc))

    @property
    def status(self) -> str:
        if self.disabled_reason is not None:
            return DISABLED
        avail = self.availability()  # may mark the backend broken
        if self.load_error is not None:
            return BROKEN
        return AVAILABLE if avail.available else UNAVAILABLE

    def reasons(self) -> Tuple[str, ...]:
        return self.availability().reasons

    def can_implement(self, problem: Any, options: Mapping[str, Any]) -> Tuple[str, ...]:
        """Every reason the backend cannot take `problem`; a raising hook becomes a reason."""
        try:
            got = self.hooks["mla_can_implement"](problem=problem, options=dict(options))
        except Exception as exc:
            return (f"can_implement raised {_error_line(exc)}",)
        if got is None:
            return ()
        if isinstance(got, str):
            return (got,)
        return tuple(str(r) for r in got)

    def option_errors(self, options: Mapping[str, Any]) -> List[str]:
        fn = self.hooks.get("mla_option_errors")
        if fn is None:
            return [f"unknown option '{k}' (backend takes no options)" for k in options]
        try:
            return [str(e) for e in (fn(options=dict(options)) or [])]
        except Exception as exc:
            return [f"mla_option_errors raised {_error_line(exc)}"]


def _callable_like_spec(impl: Any, spec_args: Tuple[str, ...]) -> Callable[..., Any]:
    """The hook function, callable with the spec's arguments by position or keyword.

    pluggy lets an implementation take a subset of the spec's arguments; the
    hot path calls positionally, so a subset gets a small forwarding adapter.
    """
    fn = impl.function
    if tuple(impl.argnames) == tuple(spec_args):
        return fn
    wanted = tuple(impl.argnames)

    def adapter(*args: Any, **kwargs: Any) -> Any:
        kwargs.update(zip(spec_args, args))
        return fn(**{k: kwargs[k] for k in wanted})

    return adapter


class BackendRegistry:
    """All backends of this process, discovered from entry points once."""

    def __init__(self, env: Optional[Mapping[str, str]] = None) -> None:
        self._env = os.environ if env is None else env
        self.pm = pluggy.PluginManager(PROJECT)
        self.pm.add_hookspecs(MLABackendSpec)
        self._backends: Dict[str, Backend] = {}
        self._loaded = False
        self._lock = threading.RLock()

    # -- loading -------------------------------------------------------
    def load(self, entry_points: Optional[Iterable[metadata.EntryPoint]] = None) -> "BackendRegistry":
        """Discover and import the installed backends; calling it again does nothing."""
        with self._lock:
            if self._loaded:
                return self
            if entry_points is None:
                entry_points = metadata.entry_points(group=ENTRY_POINT_GROUP)
            autoload = not _truthy(self._env.get(ENV_DISABLE_AUTOLOAD))
            blocked = {
                n.strip() for n in self._env.get(ENV_DISABLE_PLUGINS, "").split(",") if n.strip()
            }
            for ep in sorted(entry_points, key=lambda e: e.name):
                self._load_entry_point(ep, autoload, blocked)
            self._loaded = True
        return self

    def _load_entry_point(self, ep: metadata.EntryPoint, autoload: bool, blocked: set) -> None:
        dist = getattr(ep, "dist", None)
        dist_name = dist.metadata["Name"] if dist is not None else "?"
        version = dist.version if dist is not None else "?"
        if ep.name in self._backends:
            first = self._backends[ep.name]
            if first.distribution == dist_name:
                return  # same distribution seen twice on sys.path
            self._backends[f"{ep.name}@{dist_name}"] = Backend(
                name=f"{ep.name}@{dist_name}", distribution=dist_name, version=version,
                load_error=(
                    f"backend name '{ep.name}' is already registered by distribution "
                    f"'{first.distribution}'"
                ),
            )
            return
        backend = Backend(name=ep.name, distribution=dist_name, version=version)
        self._backends[ep.name] = backend
        if ep.name in blocked:
            backend.disabled_reason = f"disabled by {ENV_DISABLE_PLUGINS}"
            return
        if not autoload and dist_name.lower() != CORE_DISTRIBUTION:
            backend.disabled_reason = f"external plugins disabled by {ENV_DISABLE_AUTOLOAD}"
            return
        try:
            plugin = ep.load()
        except BaseException as exc:  # SystemExit/KeyboardInterrupt from an import are bugs too
            if isinstance(exc, KeyboardInterrupt):
                raise
            backend._mark_broken(f"Error importing plugin '{ep.name}': {_error_line(exc)}", exc)
            return
        self._attach(backend, plugin)

    def register(self, plugin: Any, name: str, distribution: str = "<in-process>",
                 version: str = "?") -> Backend:
        """Add a backend object directly (engines that ship a private backend, tests)."""
        with self._lock:
            if name in self._backends:
                raise ValueError(f"backend name '{name}' is already registered")
            backend = Backend(name=name, distribution=distribution, version=version)
            self._backends[name] = backend
            self._attach(backend, plugin)
            return backend

    def _attach(self, backend: Backend, plugin: Any) -> None:
        try:
            self.pm.register(plugin, name=backend.name)
        except Exception as exc:  # pluggy's validation names the bad hook
            backend._mark_broken(f"plugin '{backend.name}' failed validation: {_error_line(exc)}", exc)
            return
        backend.plugin = plugin
        for hook_name in REQUIRED_HOOKS + OPTIONAL_HOOKS:
            caller = getattr(self.pm.hook, hook_name)
            for impl in caller.get_hookimpls():
                if impl.plugin is plugin:
                    backend.hooks[hook_name] = _callable_like_spec(impl, caller.spec.argnames)
        missing = [h for h in REQUIRED_HOOKS if h not in backend.hooks]
        if missing:
            backend._mark_broken(f"plugin '{backend.name}' does not implement {', '.join(missing)}")

    # -- queries -------------------------------------------------------
    def names(self) -> List[str]:
        self.load()
        return list(self._backends)

    def get(self, name: str) -> Optional[Backend]:
        self.load()
        return self._backends.get(name)

    def backends(self) -> List[Backend]:
        self.load()
        return list(self._backends.values())


_default_registry: Optional[BackendRegistry] = None
_default_lock = threading.Lock()


def get_registry() -> BackendRegistry:
    """The process-wide registry, loaded on first use."""
    global _default_registry
    if _default_registry is None:
        with _default_lock:
            if _default_registry is None:
                _default_registry = BackendRegistry().load()
    return _default_registry
