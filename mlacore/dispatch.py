"""Choosing a backend for a problem, with the reasons for every verdict.

The decision is a pure function of (policy, problem, environment), so every
tensor-parallel rank reaches the same one. What plugins say is cached on
what they see: a backend's `can_implement` and `limits` get the problem's
shape class (`DecodeShape`: no batch size, no lengths) and its typed options,
and their answers are cached on exactly that. Batch and length limits come
back as data that the core evaluates on every problem, as it does the
policy's rules; so the cache cannot serve a verdict made for another batch
size or length, by construction.

Policy options are validated with each backend's Options model when the
dispatcher is built: an unknown or mistyped option is a PolicyError naming
the key path, here and in `mla policy check` alike.

A dispatcher built with `simulate=DeviceSpec(...)` judges availability for
that device instead of the one here (each backend's `availability_for`:
installed libraries and the device's capability, no GPU probe), so that
`mla backends explain --capability 10.0` answers "what would a B200 pick,
and why" on a laptop. Only availability is simulated: can_implement, limits
and the policy see the problem exactly as they would on that GPU, and the
kernels are never run.

MLA_DISPATCH_VERIFY=1 asks the plugins again on every call and reports any
answer that differs from the cached one (a plugin whose verdict is not a
function of what it is shown).
"""

from __future__ import annotations

import logging
import os
import threading
import warnings
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Tuple

from .backend import BackendOptions, Limits
from .errors import NoBackendError, Outcome, PolicyError
from .policy import Policy, ValidatedOptions, effective_order, load_policy, validate_backend_options
from .problem import DecodeProblem, DecodeShape, DeviceSpec
from .registry import ENV_DISABLE_PLUGINS, BackendHandle, BackendRegistry, BackendStatus, get_registry

log = logging.getLogger("mlacore")

ENV_VERIFY = "MLA_DISPATCH_VERIFY"
REFERENCE = "reference"

# Outcome names kept as module constants for callers of the first contract.
CHOSEN, ACCEPTED, NOT_INSTALLED = Outcome.CHOSEN, Outcome.ACCEPTED, Outcome.NOT_INSTALLED
UNAVAILABLE, CANNOT, LIMIT = Outcome.UNAVAILABLE, Outcome.CANNOT, Outcome.LIMIT
POLICY, NOT_IN_ORDER = Outcome.POLICY, Outcome.NOT_IN_ORDER


@dataclass(frozen=True)
class Verdict:
    backend: str
    outcome: Outcome
    reasons: Tuple[str, ...] = ()
    options: Optional[BackendOptions] = None  # the options the backend accepted the problem with

    @property
    def accepts(self) -> bool:
        return self.outcome in (Outcome.CHOSEN, Outcome.ACCEPTED)


@dataclass(frozen=True)
class Decision:
    problem: DecodeProblem
    backend: Optional[str]
    verdicts: Tuple[Verdict, ...]
    fallback_used: bool = False

    @property
    def options(self) -> Optional[BackendOptions]:
        """Typed options the chosen backend runs with (its policy options, overridden by the matching rule)."""
        if self.backend is None:
            return None
        return self.verdict(self.backend).options

    def options_dict(self) -> Dict[str, Any]:
        opts = self.options
        return {} if opts is None else opts.model_dump(mode="json")

    def verdict(self, name: str) -> Verdict:
        for v in self.verdicts:
            if v.backend == name:
                return v
        raise KeyError(name)

    def format_trace(self) -> str:
        lines = []
        for v in self.verdicts:
            why = "; ".join(v.reasons)
            lines.append(f"  {v.backend:<16} {v.outcome}" + (f": {why}" if why else ""))
        return "\n".join(lines)


class Dispatcher:
    """Select backends for problems under one policy; thread-safe."""

    def __init__(self, policy: Optional[Policy] = None, registry: Optional[BackendRegistry] = None,
                 env: Optional[Mapping[str, str]] = None, simulate: Optional[DeviceSpec] = None) -> None:
        if simulate is not None and not isinstance(simulate, DeviceSpec):
            raise TypeError(f"simulate: expected a mlacore.DeviceSpec, got {type(simulate).__name__}")
        self.simulate = simulate
        self.env: Mapping[str, str] = dict(os.environ if env is None else env)
        self.registry = registry if registry is not None else get_registry()
        self.policy = policy if policy is not None else load_policy(env=self.env)
        known = self.registry.names()
        self.policy.check_names(known)
        self.order: List[str] = effective_order(self.policy, known, self.env)
        self._check_essential_reference()
        self.options: Dict[str, ValidatedOptions] = self._validate_options()
        self.verify = self.env.get(ENV_VERIFY, "").strip().lower() in ("1", "true", "yes", "on")
        self._support: Dict[tuple, Tuple[Tuple[str, ...], Limits]] = {}
        self._lock = threading.Lock()
        self.mismatches: List[Tuple[str, DecodeShape, str]] = []

    # -- construction checks ---------------------------------------------
    def _check_essential_reference(self) -> None:
        """With fallback = "reference" the oracle is essential: disabling it is a policy error now."""
        if self.policy.mla.fallback != REFERENCE:
            return
        ref = self.registry.get(REFERENCE)
        if ref is None or ref.status in (BackendStatus.DISABLED, BackendStatus.BROKEN):
            why = ref.disabled_reason or ref.load_error if ref is not None else "not installed"
            setting = (f"{ENV_DISABLE_PLUGINS}={self.env.get(ENV_DISABLE_PLUGINS, '')!r}"
                       if ref is not None and ref.disabled_reason else f"the reference backend ({why})")
            raise PolicyError(
                f"{self.policy.source}: mla.fallback = 'reference' needs the reference backend, but "
                f"{setting} takes it away; re-enable it or set mla.fallback = 'error'")

    def _validate_options(self) -> Dict[str, ValidatedOptions]:
        errors: List[str] = []
        out: Dict[str, ValidatedOptions] = {}
        for handle in self.registry.backends():
            if not handle.loaded:
                continue  # a policy may keep options for backends not usable here
            try:
                out[handle.name] = validate_backend_options(self.policy, handle.name, handle.options_model)
            except PolicyError as err:
                errors.append(str(err))
        if errors:
            raise PolicyError("\n".join(errors))
        return out

    # -- plugin answers, cached on what the plugin sees ---------------------
    def support(self, handle: BackendHandle, shape: DecodeShape,
                options: BackendOptions) -> Tuple[Tuple[str, ...], Limits]:
        """(can_implement reasons, limits) of one backend for a shape class and options."""
        key = (handle.name, shape, options)
        cached = self._support.get(key)
        if cached is not None and not self.verify:
            return cached
        reasons = handle.can_implement(shape, options)
        limits = handle.limits(shape, options) if not reasons else Limits()
        fresh = (reasons, limits)
        if cached is None:
            with self._lock:
                self._support.setdefault(key, fresh)
        elif cached != fresh:
            self.mismatches.append((handle.name, shape, f"cached {cached}, fresh {fresh}"))
            warnings.warn(f"mlacore: backend '{handle.name}' answered differently for the same shape "
                          f"{shape.describe()}: cached {cached}, fresh {fresh}", RuntimeWarning, stacklevel=3)
        return fresh

    # -- decisions ---------------------------------------------------------
    def select(self, problem: DecodeProblem, cuda_graph: bool = False) -> Decision:
        """The decision for `problem`, raising NoBackendError when none applies.

        With `cuda_graph`, backends whose info says they cannot be captured are passed over.
        """
        decision = self.explain(problem, cuda_graph)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("mlacore: %s -> %s\n%s", problem.describe(), decision.backend, decision.format_trace())
        if decision.backend is None:
            raise NoBackendError(decision)
        return decision

    def explain(self, problem: DecodeProblem, cuda_graph: bool = False) -> Decision:
        """Every backend's verdict on `problem`, and the choice; never raises for 'no backend'."""
        verdicts: List[Verdict] = []
        chosen: Optional[str] = None
        for name in self.order:
            verdict = self._judge(name, problem, cuda_graph=cuda_graph)
            if verdict.accepts and chosen is None:
                chosen = name
                verdict = Verdict(name, Outcome.CHOSEN, options=verdict.options)
            verdicts.append(verdict)
        if chosen in (None, REFERENCE) and not self.policy.mla.strict_allow:
            # no kernel took it (the reference, in order or as the fallback, would): one outside its allow rules
            kernel, verdicts = self._outside_allow(problem, verdicts, cuda_graph)
            if kernel is not None:
                verdicts = [Verdict(v.backend, Outcome.ACCEPTED, v.reasons, v.options) if v.backend == REFERENCE
                            and v.outcome is Outcome.CHOSEN else v for v in verdicts]
                chosen = kernel
        fallback_used = False
        ref: Optional[Verdict] = None
        if chosen is None and self.policy.mla.fallback == REFERENCE:
            ref = self._judge(REFERENCE, problem, apply_policy=False, cuda_graph=cuda_graph)
            if ref.accepts:
                chosen, fallback_used = REFERENCE, True
                # the reference may be in the order, rejected there by the policy: its verdict becomes
                # the fallback's (with the options it runs with), so Decision.options finds them
                verdicts = [Verdict(REFERENCE, Outcome.CHOSEN, ("policy fallback",) + v.reasons, ref.options)
                            if v.backend == REFERENCE else v for v in verdicts]
        for handle in self.registry.backends():
            if handle.name in self.order:
                continue
            if handle.name == chosen and ref is not None:
                verdicts.append(Verdict(handle.name, Outcome.CHOSEN, ("policy fallback",), ref.options))
            else:
                verdicts.append(Verdict(handle.name, Outcome.NOT_IN_ORDER,
                                        self._judge(handle.name, problem).reasons))
        return Decision(problem, chosen, tuple(verdicts), fallback_used)

    def _outside_allow(self, problem: DecodeProblem, verdicts: List[Verdict],
                       cuda_graph: bool) -> Tuple[Optional[str], List[Verdict]]:
        """mla.strict_allow = false, when no kernel backend in order took `problem` (none did, or the reference
        did): the first backend in order before the reference that the policy kept off only because none of its
        allow rules matched, if it can take the shape with its base options; its verdict becomes the choice, with
        the reason. Allow rules record where a backend is preferred; without this a shape outside every rule (a
        head count no measured grid had, which FlashInfer refuses) would run on the slow reference."""
        for i, verdict in enumerate(verdicts):
            if verdict.backend == REFERENCE:
                if verdict.accepts:
                    break  # backends after the reference in order never run while it can
                continue
            if verdict.outcome is not Outcome.POLICY:
                continue
            bpol = self.policy.backend_policy(verdict.backend)
            if bpol.denials(problem):
                continue
            fresh = self._judge(verdict.backend, problem, apply_policy=False, cuda_graph=cuda_graph)
            if not fresh.accepts:
                continue
            note = ("outside its allow rules: no backend in order takes this shape within its own, and a kernel comes "
                    "before the reference (mla.strict_allow = false)")
            verdicts = list(verdicts)
            verdicts[i] = Verdict(verdict.backend, Outcome.CHOSEN, (note,) + verdict.reasons, fresh.options)
            return verdict.backend, verdicts
        return None, verdicts

    def _judge(self, name: str, problem: DecodeProblem, apply_policy: bool = True,
               cuda_graph: bool = False) -> Verdict:
        handle = self.registry.get(name)
        if handle is None:
            return Verdict(name, Outcome.NOT_INSTALLED, (f"no installed distribution provides '{name}'",))
        if self.simulate is not None:
            status = handle.status_for(self.simulate)
            if status != BackendStatus.AVAILABLE:
                sim = handle.availability_for(self.simulate).reasons
                extra = (handle.load_error,) if handle.load_error and handle.load_error not in sim else ()
                return Verdict(name, Outcome.UNAVAILABLE, (f"{status} on {self.simulate} (simulated)",) + extra + sim)
        else:
            status = handle.status
            if status != BackendStatus.AVAILABLE:
                return Verdict(name, Outcome.UNAVAILABLE, (str(status),) + handle.reasons())
        if cuda_graph and not handle.info().graph_capturable:
            return Verdict(name, Outcome.CANNOT, ("cannot be captured in a CUDA graph (its info() says "
                                                  "graph_capturable=False) and this decoder has cuda_graph=True",))
        validated = self.options.get(name)
        if validated is None:  # loaded after this dispatcher was built
            validated = validate_backend_options(self.policy, name, handle.options_model)
            self.options[name] = validated
        bpol = self.policy.backend_policy(name)
        option_sets = validated.option_sets(bpol, problem) if apply_policy else [validated.base]
        shape = problem.shape
        first: Optional[Tuple[Outcome, Tuple[str, ...]]] = None
        accepted: Optional[BackendOptions] = None
        for options in option_sets:
            reasons, limits = self.support(handle, shape, options)
            if reasons:
                first = first or (Outcome.CANNOT, reasons)
                continue
            over = limits.reasons(problem)
            if over:
                first = first or (Outcome.LIMIT, tuple(over))
                continue
            accepted = options
            break
        if accepted is None:
            assert first is not None
            return Verdict(name, first[0], first[1])
        if apply_policy:
            rejected = bpol.rejections(problem)
            if rejected:
                return Verdict(name, Outcome.POLICY, tuple(rejected))
        return Verdict(name, Outcome.ACCEPTED, options=accepted)

    def backend(self, name: str) -> BackendHandle:
        handle = self.registry.get(name)
        if handle is None:
            raise KeyError(f"backend '{name}' is not installed")
        return handle


_dispatchers: Dict[object, Dispatcher] = {}
_dispatchers_lock = threading.Lock()


def default_dispatcher() -> Dispatcher:
    """One dispatcher per (policy lookup, environment) in this process."""
    env_key = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("MLA_")))
    key = (env_key, os.getcwd())
    found = _dispatchers.get(key)
    if found is None:
        with _dispatchers_lock:
            found = _dispatchers.get(key)
            if found is None:
                found = Dispatcher()
                _dispatchers[key] = found
    return found
