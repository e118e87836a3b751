"""Backend discovery: entry points in, a registry of checked backend objects out.

An entry point in the group ``mlacore.backends`` names either a `Backend`
object (or class), or a plugin module/object implementing the historic hook
`mla_register_backends(register)`, which may register several backends.
Every backend object is registered with pluggy under its name; the registry
calls one backend's hooks through pluggy's subset callers (never a broadcast)
and checks every value that comes back.

Loading is guarded: a plugin that fails to import, fails pluggy's signature
validation, raises in a hook or returns a value of the wrong type is recorded
as *broken* with the reason, and every other backend keeps working. Names of
mlacore's own backends are reserved to their distributions: another
distribution registering `reference` is *refused*, with both named.

Environment:
  MLA_DISABLE_PLUGIN_AUTOLOAD=1  load only backends shipped by mlacore itself
  MLA_DISABLE_PLUGINS=a,b        never import these plugins / never use these backends
"""

from __future__ import annotations

import contextvars
import dataclasses
import logging
import os
import re
import threading
import traceback
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Tuple

import pluggy
from pydantic import ValidationError

from .backend import (
    ENTRY_POINT_GROUP,
    PROJECT,
    Availability,
    Backend,
    BackendInfo,
    BackendOptions,
    BackendSpec,
    HOOK_NAMES,
    Limits,
    Session,
    SessionConfig,
)
from .errors import BackendError, BackendStatus, MLAInputError
from .problem import DecodeShape

log = logging.getLogger("mlacore")

CORE_DISTRIBUTION = "mlacore"
ENV_DISABLE_AUTOLOAD = "MLA_DISABLE_PLUGIN_AUTOLOAD"
ENV_DISABLE_PLUGINS = "MLA_DISABLE_PLUGINS"

# Backend names reserved to the distribution that provides them: the oracle
# and first-party backends cannot be taken over by a package earlier on sys.path.
RESERVED_NAMES: Dict[str, str] = {
    "reference": "mlacore",
    "flashinfer_mla": "mla-flashinfer",
    "cutlass_mla": "mla-cutlass",
    "cute_dsl_mla": "mla-cute-dsl",
}

HOOKS = HOOK_NAMES
REQUIRED = ("can_implement", "open")


# What a plugin's code may raise and the registry turns into a reason. SystemExit too: a
# plugin calling sys.exit() in a hook must not end the engine or the CLI (Ctrl-C still does).
PLUGIN_ERRORS = (Exception, SystemExit)

# The values a backend hands back; positional arguments of these map to their field names.
_CHECKED_TYPES = {cls.__name__: cls for cls in (Availability, BackendInfo, Limits)}


def one_line(text: str, limit: int = 300) -> str:
    """`text` on one line (whitespace runs, newlines included, become one space), at most `limit` chars."""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _validation_line(err: ValidationError) -> str:
    cls = _CHECKED_TYPES.get(err.title)
    fields = [f.name for f in dataclasses.fields(cls)] if cls is not None else []
    parts = []
    for e in err.errors():
        loc = list(e["loc"])
        if loc and isinstance(loc[0], int) and loc[0] < len(fields):
            loc[0] = fields[loc[0]]  # Availability(False, "x"): loc (1,) is `reasons`
        where = ".".join(str(p) for p in loc)
        got = f", got {e['input']!r:.60}" if "input" in e and e["type"] != "missing" else ""
        parts.append(f"{err.title}{'.' + where if where else ''}: {e['msg']}{got}")
    return "; ".join(parts)


def _error_line(exc: BaseException) -> str:
    """`Type: message` on one line (a pydantic error becomes `Class.field: msg, got value`)."""
    text = _validation_line(exc) if isinstance(exc, ValidationError) else str(exc)
    return one_line(f"{type(exc).__name__}: {text}")


def _recheck(cls: type, got: Any) -> Any:
    """A fresh, validated `cls` with got's fields: catches values written behind pydantic's back."""
    return cls(**{f.name: getattr(got, f.name) for f in dataclasses.fields(cls)})


def _options_problem(obj: Backend) -> Optional[str]:
    """What is wrong with a backend's `Options` declaration (None: nothing)."""
    model = getattr(obj, "Options", None)
    if not (isinstance(model, type) and issubclass(model, BackendOptions)):
        return (f"Options is {type(model).__name__} {one_line(repr(model), 60)}, expected a subclass of "
                "mlacore.BackendOptions")
    try:
        default = model()
    except PLUGIN_ERRORS as exc:
        return (f"Options() raised {_error_line(exc)} (every option needs a default: a policy may "
                "leave them all out)")
    try:
        hash(default)
    except PLUGIN_ERRORS as exc:
        return (f"Options instances are not hashable ({_error_line(exc)}); keep BackendOptions' "
                "frozen=True, verdicts are cached per options")
    return None


def _truthy(value: Optional[str]) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def canonical_dist(name: str) -> str:
    """PEP 503 normalized distribution name (mla_flashinfer == mla-flashinfer)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _is_str_tuple(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value)


def _describe(value: Any) -> str:
    """`type repr` of a value a plugin handed back, on one line, short."""
    return f"{type(value).__name__} {one_line(repr(value), 60)}"


class _RefuseAll(Limits):
    """The limits of a backend that broke while answering `limits()`: no problem is within them."""

    def reasons(self, problem: Any) -> List[str]:
        return [self.why]


@dataclass
class BackendHandle:
    """One backend as the registry knows it: its object, its origin and its checked answers."""

    name: str
    distribution: str = "?"
    version: str = "?"
    obj: Optional[Backend] = None
    load_error: Optional[str] = None
    load_traceback: Optional[str] = None
    disabled_reason: Optional[str] = None
    refused_reason: Optional[str] = None
    callers: Dict[str, Any] = field(default_factory=dict, repr=False)
    _availability: Optional[Availability] = None
    _simulated: Dict[Any, Availability] = field(default_factory=dict, repr=False)
    _info: Optional[BackendInfo] = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    # -- state ---------------------------------------------------------
    @property
    def loaded(self) -> bool:
        return (self.load_error is None and self.disabled_reason is None
                and self.refused_reason is None and self.obj is not None)

    @property
    def options_model(self) -> type:
        return getattr(self.obj, "Options", BackendOptions) if self.obj is not None else BackendOptions

    def mark_broken(self, message: str, exc: Optional[BaseException] = None) -> None:
        if self.load_error is None:
            self.load_error = message
            if exc is not None:
                self.load_traceback = "".join(traceback.format_exception(exc))
            log.warning("mlacore: backend '%s' (%s) is broken: %s", self.name, self.distribution, message)

    @property
    def status(self) -> BackendStatus:
        if self.refused_reason is not None:
            return BackendStatus.REFUSED
        if self.disabled_reason is not None:
            return BackendStatus.DISABLED
        avail = self.availability()  # may mark the backend broken
        if self.load_error is None and self.loaded:
            self.info()  # so may info(): a listing must never show a broken backend as available
        if self.load_error is not None:
            return BackendStatus.BROKEN
        return BackendStatus.AVAILABLE if avail.available else BackendStatus.UNAVAILABLE

    def status_for(self, device: Any) -> BackendStatus:
        """The status this backend would have on `device` (a simulated DeviceSpec); no GPU is probed."""
        if self.refused_reason is not None:
            return BackendStatus.REFUSED
        if self.disabled_reason is not None:
            return BackendStatus.DISABLED
        avail = self.availability_for(device)
        if self.load_error is not None:
            return BackendStatus.BROKEN
        return BackendStatus.AVAILABLE if avail.available else BackendStatus.UNAVAILABLE

    def reasons(self) -> Tuple[str, ...]:
        reasons = self.availability().reasons
        if self.load_error is not None and self.load_error not in reasons:
            reasons = (self.load_error,) + reasons  # broken after availability (e.g. by info())
        return reasons

    # -- checked hook calls --------------------------------------------
    def _call(self, hook: str, **kwargs: Any) -> Any:
        return self.callers[hook](**kwargs)

    def availability(self) -> Availability:
        """Asked once per process; the answer is kept (hardware does not change under us)."""
        if self._availability is None:
            with self._lock:
                if self._availability is None:
                    self._availability = self._compute_availability()
        return self._availability

    def _compute_availability(self) -> Availability:
        for reason in (self.refused_reason, self.disabled_reason, self.load_error):
            if reason is not None:
                return Availability(False, (reason,))
        try:
            got = self._call("availability")
        except PLUGIN_ERRORS as exc:
            self.mark_broken(f"availability() raised {_error_line(exc)}", exc)
            return Availability(False, (self.load_error or "",))
        if not isinstance(got, Availability):
            self.mark_broken(f"availability() returned {_describe(got)}, expected Availability")
            return Availability(False, (self.load_error or "",))
        try:
            return _recheck(Availability, got)
        except ValidationError as exc:
            self.mark_broken(f"availability() returned an invalid Availability: {_error_line(exc)}", exc)
            return Availability(False, (self.load_error or "",))

    def availability_for(self, device: Any) -> Availability:
        """`availability_for(device)` of the backend, checked like `availability()` and kept per device."""
        found = self._simulated.get(device)
        if found is not None:
            return found
        for reason in (self.refused_reason, self.disabled_reason, self.load_error):
            if reason is not None:
                return Availability(False, (reason,))
        try:
            got = self._call("availability_for", device=device)
        except PLUGIN_ERRORS as exc:
            self.mark_broken(f"availability_for() raised {_error_line(exc)}", exc)
            return Availability(False, (self.load_error or "",))
        if not isinstance(got, Availability):
            self.mark_broken(f"availability_for() returned {_describe(got)}, expected Availability")
            return Availability(False, (self.load_error or "",))
        try:
            got = _recheck(Availability, got)
        except ValidationError as exc:
            self.mark_broken(f"availability_for() returned an invalid Availability: {_error_line(exc)}", exc)
            return Availability(False, (self.load_error or "",))
        with self._lock:
            self._simulated.setdefault(device, got)
        return got

    def info(self) -> BackendInfo:
        if self._info is None:
            info = BackendInfo()
            if self.loaded:
                try:
                    got = self._call("info")
                except PLUGIN_ERRORS as exc:  # a plugin's bug must not escape
                    got = exc
                    self.mark_broken(f"info() raised {_error_line(exc)}", exc)
                if isinstance(got, BackendInfo):
                    try:
                        info = _recheck(BackendInfo, got)
                    except ValidationError as exc:
                        self.mark_broken(f"info() returned an invalid BackendInfo: {_error_line(exc)}", exc)
                elif not isinstance(got, BaseException):
                    self.mark_broken(f"info() returned {_describe(got)}, expected BackendInfo")
            self._info = info
        return self._info

    def can_implement(self, shape: DecodeShape, options: BackendOptions) -> Tuple[str, ...]:
        """Every reason the backend cannot take `shape`; a raising hook becomes a reason."""
        try:
            got = self._call("can_implement", shape=shape, options=options)
        except PLUGIN_ERRORS as exc:
            return (f"can_implement raised {_error_line(exc)}",)
        if not _is_str_tuple(got):
            self.mark_broken(f"can_implement() returned {_describe(got)}, expected a list of reason strings")
            return (self.load_error or "",)
        return tuple(got)

    def limits(self, shape: DecodeShape, options: BackendOptions) -> Limits:
        """The backend's limits for a shape class; a bad answer breaks the backend and refuses every problem."""
        try:
            got = self._call("limits", shape=shape, options=options)
        except PLUGIN_ERRORS as exc:
            got = exc
            self.mark_broken(f"limits() raised {_error_line(exc)}", exc)
        if isinstance(got, Limits):
            try:
                return _recheck(Limits, got)
            except ValidationError as exc:
                self.mark_broken(f"limits() returned an invalid Limits: {_error_line(exc)}", exc)
        elif not isinstance(got, BaseException):
            self.mark_broken(f"limits() returned {_describe(got)}, expected Limits")
        # never NO_LIMITS: the dispatcher asked because can_implement said yes, and must not
        # choose a backend that just broke
        return _RefuseAll(why=f"backend '{self.name}' is broken: {self.load_error}")

    def open(self, config: SessionConfig, options: BackendOptions) -> Session:
        try:
            got = self._call("open", config=config, options=options)
        except PLUGIN_ERRORS as exc:
            raise BackendError(f"backend '{self.name}' failed to open a session: {_error_line(exc)}") from exc
        if not isinstance(got, Session):
            raise BackendError(f"backend '{self.name}': open() returned {type(got).__name__}, expected a "
                               "mlacore.backend.Session")
        return got

    def parse_options(self, data: Mapping[str, Any]) -> BackendOptions:
        """The backend's typed options from a policy mapping (raises pydantic.ValidationError)."""
        return self.options_model.model_validate(dict(data))


_loading: contextvars.ContextVar[Optional[Tuple[str, str, str]]] = contextvars.ContextVar(
    "mlacore_loading", default=None)


class BackendRegistry:
    """All backends of this process, discovered from entry points once."""

    def __init__(self, env: Optional[Mapping[str, str]] = None) -> None:
        self._env = os.environ if env is None else env
        self.pm = pluggy.PluginManager(PROJECT)
        self.pm.add_hookspecs(BackendSpec)
        self._backends: Dict[str, BackendHandle] = {}
        self._loaded = False
        self._lock = threading.RLock()
        self._blocked = {n.strip() for n in self._env.get(ENV_DISABLE_PLUGINS, "").split(",") if n.strip()}
        self._registered_now: List[str] = []
        self.pm.hook.mla_register_backends.call_historic(kwargs=dict(register=self._register_from_plugin))

    # -- loading -------------------------------------------------------
    def load(self, entry_points: Optional[Iterable[metadata.EntryPoint]] = None) -> "BackendRegistry":
        """Discover and import the installed backends; calling it again does nothing."""
        with self._lock:
            if self._loaded:
                return self
            if entry_points is None:
                entry_points = metadata.entry_points(group=ENTRY_POINT_GROUP)
            autoload = not _truthy(self._env.get(ENV_DISABLE_AUTOLOAD))
            seen = set()
            for ep in sorted(entry_points, key=lambda e: e.name):
                dist = getattr(ep, "dist", None)
                key = (ep.name, ep.value, dist.metadata["Name"] if dist is not None else "?")
                if key in seen:
                    continue  # the same distribution found twice on sys.path
                seen.add(key)
                self._load_entry_point(ep, autoload)
            self._loaded = True
        return self

    def _load_entry_point(self, ep: metadata.EntryPoint, autoload: bool) -> None:
        dist = getattr(ep, "dist", None)
        dist_name = dist.metadata["Name"] if dist is not None else "?"
        version = dist.version if dist is not None else "?"
        if ep.name in self._blocked:
            self._add(BackendHandle(name=ep.name, distribution=dist_name, version=version,
                                    disabled_reason=f"disabled by {ENV_DISABLE_PLUGINS}"))
            return
        if not autoload and canonical_dist(dist_name) != CORE_DISTRIBUTION:
            self._add(BackendHandle(name=ep.name, distribution=dist_name, version=version,
                                    disabled_reason=f"external plugins disabled by {ENV_DISABLE_AUTOLOAD}"))
            return
        try:
            target = ep.load()
        except BaseException as exc:  # SystemExit from an import is a bug too
            if isinstance(exc, KeyboardInterrupt):
                raise
            handle = BackendHandle(name=ep.name, distribution=dist_name, version=version)
            self._add(handle)
            handle.mark_broken(f"Error importing plugin '{ep.name}': {_error_line(exc)}", exc)
            return
        self._attach_target(target, ep.name, dist_name, version)

    def _attach_target(self, target: Any, plugin_name: str, dist_name: str, version: str) -> None:
        if isinstance(target, type) and issubclass(target, Backend):
            try:
                target = target()
            except PLUGIN_ERRORS as exc:
                handle = BackendHandle(name=plugin_name, distribution=dist_name, version=version)
                self._add(handle)
                handle.mark_broken(f"constructing {target.__name__}() raised {_error_line(exc)}", exc)
                return
        if isinstance(target, Backend):
            self._register_backend(target, dist_name, version, fallback_name=plugin_name)
            return
        token = _loading.set((plugin_name, dist_name, version))
        self._registered_now = []
        try:
            self.pm.register(target, name=f"plugin:{plugin_name}")
        except PLUGIN_ERRORS as exc:  # validation, or the plugin's register hook raised
            handle = self._backends.get(plugin_name) or BackendHandle(
                name=plugin_name, distribution=dist_name, version=version)
            self._add(handle)
            handle.mark_broken(f"plugin '{plugin_name}' failed to register: {_error_line(exc)}", exc)
            return
        finally:
            _loading.reset(token)
        if not self._registered_now:
            handle = BackendHandle(name=plugin_name, distribution=dist_name, version=version)
            self._add(handle)
            handle.mark_broken(f"plugin '{plugin_name}' registered no backend (it must implement "
                               "mla_register_backends or be a mlacore.Backend)")

    def _register_from_plugin(self, backend: Any) -> None:
        ctx = _loading.get()
        if ctx is None:  # historic replay outside a load: nothing to attribute it to
            raise RuntimeError("register() called outside plugin loading")
        plugin_name, dist_name, version = ctx
        if not isinstance(backend, Backend):
            raise TypeError(f"register() expects a mlacore.Backend instance, got {type(backend).__name__}")
        self._register_backend(backend, dist_name, version, fallback_name=plugin_name)

    def _register_backend(self, obj: Backend, dist_name: str, version: str, fallback_name: str) -> BackendHandle:
        name = obj.name if isinstance(obj.name, str) and obj.name else fallback_name
        self._registered_now.append(name)
        owner = RESERVED_NAMES.get(name)
        if owner is not None and canonical_dist(dist_name) != canonical_dist(owner):
            handle = BackendHandle(
                name=f"{name}@{dist_name}", distribution=dist_name, version=version,
                refused_reason=(f"the name '{name}' is reserved for distribution '{owner}'; "
                                f"distribution '{dist_name}' may not register it"))
            self._add(handle)
            log.warning("mlacore: refused backend '%s' from distribution '%s' (name reserved for '%s')",
                        name, dist_name, owner)
            return handle
        if name in self._backends:
            first = self._backends[name]
            handle = BackendHandle(name=f"{name}@{dist_name}", distribution=dist_name, version=version)
            self._add(handle)
            handle.mark_broken(f"backend name '{name}' is already registered by distribution "
                               f"'{first.distribution}'")
            return handle
        handle = BackendHandle(name=name, distribution=dist_name, version=version)
        self._add(handle)
        if name in self._blocked:
            handle.disabled_reason = f"disabled by {ENV_DISABLE_PLUGINS}"
            return handle
        missing = [h for h in REQUIRED if getattr(type(obj), h, None) is getattr(Backend, h)]
        if missing:
            handle.mark_broken(f"backend '{name}' does not implement {', '.join(missing)}")
            return handle
        bad_options = _options_problem(obj)
        if bad_options is not None:  # every dispatcher validates policy options with this model
            handle.mark_broken(f"backend '{name}': {bad_options}")
            return handle
        try:
            self.pm.register(obj, name=f"backend:{name}")
        except PLUGIN_ERRORS as exc:  # pluggy's validation names the bad hook
            handle.mark_broken(f"backend '{name}' failed validation: {_error_line(exc)}", exc)
            return handle
        handle.obj = obj
        self._refresh_callers()
        return handle

    def _refresh_callers(self) -> None:
        """Give every backend pluggy callers that reach its own implementations only.

        A subset caller removes the plugins known when it is made, so each
        registration rebuilds them all (a handful of objects, at load time).
        """
        plugins = self.pm.get_plugins()
        for handle in self._backends.values():
            if handle.obj is None:
                continue
            others = [p for p in plugins if p is not handle.obj]
            for hook in HOOKS:
                handle.callers[hook] = self.pm.subset_hook_caller(hook, remove_plugins=others)

    def _add(self, handle: BackendHandle) -> None:
        owner = RESERVED_NAMES.get(handle.name)
        if owner is not None and canonical_dist(handle.distribution) != canonical_dist(owner):
            # a disabled or broken entry point of another distribution never takes a reserved name
            handle.name = f"{handle.name}@{handle.distribution}"
        if handle.name not in self._backends:
            self._backends[handle.name] = handle

    def register(self, backend: Backend, distribution: str = "<in-process>", version: str = "?") -> BackendHandle:
        """Add a backend object directly (engines that ship a private backend, tests)."""
        with self._lock:
            self.load()
            if not isinstance(backend, Backend):
                raise TypeError(f"backend: expected a mlacore.Backend instance, got {type(backend).__name__}")
            if backend.name in self._backends:
                raise MLAInputError(f"backend: the name '{backend.name}' is already registered "
                                    f"(by distribution '{self._backends[backend.name].distribution}')")
            if backend.name in RESERVED_NAMES:
                raise MLAInputError(f"backend: the name '{backend.name}' is reserved for distribution "
                                    f"'{RESERVED_NAMES[backend.name]}'")
            return self._register_backend(backend, distribution, version, fallback_name=backend.name)

    # -- queries -------------------------------------------------------
    def names(self) -> List[str]:
        self.load()
        return list(self._backends)

    def get(self, name: str) -> Optional[BackendHandle]:
        self.load()
        return self._backends.get(name)

    def backends(self) -> List[BackendHandle]:
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


__all__ = ["BackendHandle", "BackendRegistry", "RESERVED_NAMES", "get_registry", "Callable"]
