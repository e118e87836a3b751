"""Choosing a backend for a problem, with the reasons for every verdict.

The decision is a pure function of (policy, problem, environment), so every
tensor-parallel rank reaches the same one. Decisions are cached on a key that
holds every problem field a verdict reads; batch and kv length enter the key
only as the interval they fall in between the cut points that the policy's
rules and the backends' declared limits define, so a decode loop whose length
grows by one each step keeps hitting the cache without ever sharing a
decision across a boundary.

MLA_DISPATCH_VERIFY=1 re-selects without the cache on every call and reports
any difference (TensorRT-LLM's sanity mode, as a switch).
"""

from __future__ import annotations

import bisect
import os
import threading
import warnings
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from .plugins import AVAILABLE, Backend, BackendRegistry, get_registry
from .policy import Policy, effective_order, load_policy
from .problem import DecodeProblem

ENV_VERIFY = "MLA_DISPATCH_VERIFY"

# Verdict stages, in the order the dispatcher applies them.
CHOSEN = "chosen"
ACCEPTED = "accepted"  # would take the problem, but an earlier backend was chosen
NOT_INSTALLED = "not installed"
UNAVAILABLE = "unavailable"
CANNOT = "cannot implement"
POLICY = "policy"
NOT_IN_ORDER = "not in order"


class NoBackendError(RuntimeError):
    """No backend may take the problem and the policy's fallback is 'error'."""

    def __init__(self, decision: "Decision") -> None:
        self.decision = decision
        super().__init__(
            f"no MLA backend for {decision.problem.describe()}:\n" + decision.format_trace()
        )


@dataclass(frozen=True)
class Verdict:
    backend: str
    outcome: str
    reasons: Tuple[str, ...] = ()
    options: Tuple[Tuple[str, object], ...] = ()  # the options the backend accepted the problem with

    @property
    def accepts(self) -> bool:
        return self.outcome in (CHOSEN, ACCEPTED)


@dataclass(frozen=True)
class Decision:
    problem: DecodeProblem
    backend: Optional[str]
    verdicts: Tuple[Verdict, ...]
    fallback_used: bool = False

    @property
    def options(self) -> Dict[str, object]:
        """Options the chosen backend plans with (backend options, overridden by the matching rule)."""
        if self.backend is None:
            return {}
        return dict(self.verdict(self.backend).options)

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


def _bucket(value: int, cuts: Sequence[int]) -> int:
    return bisect.bisect_right(cuts, value)


class Dispatcher:
    """Select backends for problems under one policy; thread-safe."""

    def __init__(self, policy: Optional[Policy] = None, registry: Optional[BackendRegistry] = None,
                 env: Optional[Mapping[str, str]] = None) -> None:
        self.env: Mapping[str, str] = dict(os.environ if env is None else env)
        self.registry = registry if registry is not None else get_registry()
        self.policy = policy if policy is not None else load_policy(env=self.env)
        known = self.registry.names()
        self.policy.check_names(known)
        self.order: List[str] = effective_order(self.policy, known, self.env)
        self.verify = self.env.get(ENV_VERIFY, "").strip().lower() in ("1", "true", "yes", "on")
        self._cache: Dict[object, Decision] = {}
        self._lock = threading.Lock()
        self.mismatches: List[Tuple[DecodeProblem, str, str]] = []
        self._batch_cuts, self._kv_cuts = self._collect_cuts()

    def _collect_cuts(self) -> Tuple[List[int], List[int]]:
        batch, kv = self.policy.shape_cuts()
        kv = kv + [1]  # zero-length requests are a shape of their own
        for backend in self.registry.backends():
            if backend.loaded:
                info = backend.info()
                batch += list(info.batch_cuts)
                kv += list(info.kv_len_cuts)
        return sorted(set(batch)), sorted(set(kv))

    def cache_key(self, problem: DecodeProblem) -> object:
        """Every field a verdict reads, with batch and lengths reduced to their interval."""
        return problem.model_copy(update={
            "batch_size": _bucket(problem.batch_size, self._batch_cuts),
            "max_kv_len": _bucket(problem.max_kv_len, self._kv_cuts),
            "min_kv_len": _bucket(problem.min_kv_len, self._kv_cuts),
        })

    def select(self, problem: DecodeProblem) -> Decision:
        """The decision for `problem`: cached, and raising NoBackendError when none applies."""
        key = self.cache_key(problem)
        cached = self._cache.get(key)
        if cached is not None and not self.verify:
            return cached
        decision = self.explain(problem)
        if cached is not None and cached.backend != decision.backend:
            self.mismatches.append((problem, cached.backend or "", decision.backend or ""))
            warnings.warn(
                f"mlacore dispatch cache disagrees for {problem.describe()}: cached "
                f"{cached.backend!r}, fresh {decision.backend!r} (a backend reads a shape "
                "field it did not declare a cut for)",
                RuntimeWarning,
                stacklevel=2,
            )
        if cached is None:
            with self._lock:
                self._cache.setdefault(key, decision)
        if decision.backend is None:
            raise NoBackendError(decision)
        return decision

    def explain(self, problem: DecodeProblem) -> Decision:
        """Evaluate every backend afresh, without the cache; never raises for 'no backend'."""
        verdicts: List[Verdict] = []
        chosen: Optional[str] = None
        for name in self.order:
            verdict = self._judge(name, problem)
            if verdict.accepts and chosen is None:
                chosen = name
                verdict = Verdict(name, CHOSEN, options=verdict.options)
            verdicts.append(verdict)
        fallback_used = False
        if chosen is None and self.policy.mla.fallback == "reference":
            ref = self._judge("reference", problem, apply_policy=False)
            if ref.accepts:
                chosen, fallback_used = "reference", True
        for backend in self.registry.backends():
            if backend.name not in self.order:
                if backend.name == chosen:
                    verdicts.append(Verdict(backend.name, CHOSEN, ("policy fallback",), ref.options))
                else:
                    verdicts.append(Verdict(backend.name, NOT_IN_ORDER,
                                            self._judge(backend.name, problem).reasons))
        return Decision(problem, chosen, tuple(verdicts), fallback_used)

    def _judge(self, name: str, problem: DecodeProblem, apply_policy: bool = True) -> Verdict:
        backend: Optional[Backend] = self.registry.get(name)
        if backend is None:
            return Verdict(name, NOT_INSTALLED, (f"no installed distribution provides '{name}'",))
        if backend.status != AVAILABLE:
            return Verdict(name, UNAVAILABLE, (f"{backend.status}",) + backend.reasons())
        bpol = self.policy.backend_policy(name)
        rejected = bpol.rejections(problem) if apply_policy else []
        option_sets = bpol.option_sets(problem) if apply_policy else [dict(bpol.options)]
        first_reasons: Tuple[str, ...] = ()
        for options in option_sets:
            reasons = backend.can_implement(problem, options)
            if not reasons:
                break
            first_reasons = first_reasons or reasons
        else:
            return Verdict(name, CANNOT, first_reasons)
        if rejected:
            return Verdict(name, POLICY, tuple(rejected))
        return Verdict(name, ACCEPTED, options=tuple(sorted(options.items())))

    def backend(self, name: str) -> Backend:
        backend = self.registry.get(name)
        if backend is None:
            raise KeyError(f"backend '{name}' is not installed")
        return backend


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
