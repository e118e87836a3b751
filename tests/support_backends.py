"""In-process test backends: the reference math behind a configurable verdict."""

from typing import Callable, List, Optional

from mlacore import (
    Availability,
    Backend,
    BackendInfo,
    Limits,
    NoOptions,
    Planned,
    Session,
    hookimpl,
)
from mlacore.backend import NO_LIMITS
from mlacore.reference import ReferenceOptions
from mlacore.reference import backend as reference_backend


class PickySession(Session):
    """The reference backend's session, with the calls counted (plans, closes)."""

    def __init__(self, owner: "Picky", inner: Session) -> None:
        self.owner, self.inner = owner, inner
        self.plans = 0
        self.closed = False

    def plan(self, problem, step) -> Planned:
        if self.closed:
            raise RuntimeError(f"{self.owner.name}: plan() on a closed session")
        self.plans += 1
        return self.inner.plan(problem, step)

    def close(self) -> None:
        self.closed = True
        self.owner.closed_sessions += 1
        self.inner.close()


class Picky(Backend):
    """An in-process backend named per instance that refuses shapes for which `refuse(shape)` is true.

    `limits` is a `Limits` or a function of the shape (and options) giving one;
    `open` hands out a session of the reference backend, so a chosen Picky
    computes the right answer.
    """

    def __init__(self, name: str = "picky", refuse: Callable = lambda shape: False, available: bool = True,
                 info: Optional[BackendInfo] = None, limits=None, options_model=None) -> None:
        self.name = name
        self.refuse = refuse
        self.available = available
        self._info = info or BackendInfo(description=f"test backend {name}")
        self._limits = limits
        if options_model is not None:
            self.Options = options_model
        self.calls = 0  # can_implement calls
        self.limit_calls = 0
        self.seen_options: List[object] = []
        self.seen_shapes: List[object] = []
        self.sessions: List[PickySession] = []
        self.opened_with: List[object] = []  # (config, options) per open()
        self.closed_sessions = 0

    @hookimpl
    def info(self) -> BackendInfo:
        return self._info

    @hookimpl
    def availability(self) -> Availability:
        return Availability.from_reasons([] if self.available else ["no GPU here"])

    @hookimpl
    def can_implement(self, shape, options) -> List[str]:
        self.calls += 1
        self.seen_options.append(options)
        self.seen_shapes.append(shape)
        return ["refused by predicate"] if self.refuse(shape) else []

    @hookimpl
    def limits(self, shape, options) -> Limits:
        self.limit_calls += 1
        if self._limits is None:
            return NO_LIMITS
        return self._limits(shape) if callable(self._limits) else self._limits

    @hookimpl
    def open(self, config, options) -> Session:
        self.opened_with.append((config, options))
        session = PickySession(self, reference_backend.open(config, ReferenceOptions()))
        self.sessions.append(session)
        return session


def register_named_backends(registry, refusals, options_model=None):
    """Register one Picky per name; `refusals[name]` is its refuse predicate (None: takes everything)."""
    for name, refuse in refusals.items():
        registry.register(Picky(name, refuse=refuse or (lambda shape: False), options_model=options_model))
    return registry


__all__ = ["NoOptions", "Picky", "PickySession", "register_named_backends"]


def registry_without(distribution, env=None):
    """A registry of every installed backend except `distribution`'s: "that first-party plugin is not installed".

    The dev environment installs every first-party plugin (mla-cutlass too);
    tests about a reserved name with nothing installed under it leave one out.
    """
    from importlib import metadata

    from mlacore import BackendRegistry
    from mlacore.backend import ENTRY_POINT_GROUP

    eps = [ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)
           if getattr(ep, "dist", None) is None or ep.dist.metadata["Name"] != distribution]
    return BackendRegistry(env=dict(env or {})).load(entry_points=eps)
