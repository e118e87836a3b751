"""The policy file `mla.toml`: priority order, fallback, per-shape allow/deny rules.

Correctness limits live in the plugins (can_implement); performance
preferences live here. The file is validated strictly: unknown keys, unknown
backend names and wrong types are errors that name the key path, because a
silently ignored setting is the failure this library exists to end.

Lookup: explicit path, then $MLA_POLICY, then ./mla.toml, then the built-in
default shipped with mlacore. $MLA_BACKENDS then overrides the order, either
as an exact list (`a,b`) or as deltas (`+a,-b`) applied to the policy's order.
"""

from __future__ import annotations

import json
import os
import re
import sys
from importlib import resources
from pathlib import Path
from typing import Any, Dict, Iterable, List, Literal, Mapping, Optional, Sequence, Tuple, Union

from pydantic import (BaseModel, ConfigDict, Field, PrivateAttr, StrictBool, StrictInt, StrictStr,
                      ValidationError, field_validator, model_validator)
from typing_extensions import Annotated

from .problem import DType, DecodeProblem, QDType

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

ENV_POLICY = "MLA_POLICY"
ENV_BACKENDS = "MLA_BACKENDS"
BUILTIN_SOURCE = "<built-in default>"

# Backends this project ships or documents; a policy may name them whether
# or not they are installed here (a shared policy file travels to machines
# with different plugins). Any other name must be installed.
FIRST_PARTY_BACKENDS = ("cute_dsl_mla", "flashinfer_mla", "cutlass_mla", "reference")


from .errors import PolicyError  # noqa: E402  (re-exported: policy errors are raised here)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# strict scalars: TOML gives exact types, so "32", 32.0 and true are mistakes, not numbers
PositiveInt = Annotated[StrictInt, Field(ge=1)]
NonNegativeInt = Annotated[StrictInt, Field(ge=0)]
_CAPABILITY = re.compile(r"^[1-9][0-9]*\.[0-9]$")


def _int_set() -> Any:
    return None


class ShapeRule(_Strict):
    """A set of shapes: every listed field must match (an absent field matches all).

    Sets are non-empty (an empty set would silently match nothing) and hold
    positive integers; bounds are integers, never strings, floats or booleans.
    """

    num_heads: Optional[Tuple[PositiveInt, ...]] = _int_set()
    seq_len_q: Optional[Tuple[PositiveInt, ...]] = _int_set()
    kv_dtype: Optional[Tuple[DType, ...]] = _int_set()
    q_dtype: Optional[Tuple[QDType, ...]] = _int_set()
    page_size: Optional[Tuple[PositiveInt, ...]] = _int_set()
    # CUDA compute capabilities ("9.0", "10.0") the rule is for: one policy file can route an H200 and a B200
    # differently where only one of them was measured (a CPU problem has no capability and matches no such rule)
    capability: Optional[Tuple[StrictStr, ...]] = _int_set()
    min_batch: Optional[PositiveInt] = None
    max_batch: Optional[PositiveInt] = None
    min_kv_len: Optional[NonNegativeInt] = None
    max_kv_len: Optional[NonNegativeInt] = None
    # backend options for the shapes this (allow) rule matches, over [backend.X.options];
    # how `mla tune` routes e.g. FlashInfer's fa2 and fa3 to different shapes
    options: Dict[str, Any] = Field(default_factory=dict)

    @field_validator("num_heads", "seq_len_q", "kv_dtype", "q_dtype", "page_size", "capability")
    @classmethod
    def _non_empty(cls, value: Optional[Tuple[Any, ...]]) -> Optional[Tuple[Any, ...]]:
        if value is not None and not value:
            raise ValueError("expected a non-empty list (an empty one matches no shape and silently "
                             "disables the rule); leave the key out to match every value")
        return value

    @field_validator("capability")
    @classmethod
    def _capabilities(cls, value: Optional[Tuple[str, ...]]) -> Optional[Tuple[str, ...]]:
        bad = [v for v in value or () if not _CAPABILITY.match(v)]
        if bad:
            raise ValueError(f"expected CUDA compute capabilities written like \"9.0\" or \"10.0\", got {bad}")
        return value

    @model_validator(mode="after")
    def _ranges_ordered(self) -> "ShapeRule":
        for lo, hi in (("min_batch", "max_batch"), ("min_kv_len", "max_kv_len")):
            a, b = getattr(self, lo), getattr(self, hi)
            if a is not None and b is not None and a > b:
                raise ValueError(f"{lo}={a} is larger than {hi}={b}")
        return self

    def mismatches(self, problem: DecodeProblem) -> List[str]:
        """Why `problem` falls outside this rule (empty: it matches)."""
        out: List[str] = []
        for name in ("num_heads", "seq_len_q", "kv_dtype", "q_dtype", "page_size"):
            allowed = getattr(self, name)
            value = getattr(problem, name)
            if allowed is not None and value not in allowed:
                out.append(f"{name}={value} not in {list(allowed)}")
        if self.capability is not None:
            cap = problem.device.capability
            have = f"{cap[0]}.{cap[1]}" if problem.device.type == "cuda" and cap is not None else None
            if have not in self.capability:
                out.append(f"capability={have or problem.device.type} not in {list(self.capability)}")
        if self.min_batch is not None and problem.batch_size < self.min_batch:
            out.append(f"batch={problem.batch_size} < min_batch={self.min_batch}")
        if self.max_batch is not None and problem.batch_size > self.max_batch:
            out.append(f"batch={problem.batch_size} > max_batch={self.max_batch}")
        if self.min_kv_len is not None and problem.max_kv_len < self.min_kv_len:
            out.append(f"max_kv_len={problem.max_kv_len} < min_kv_len={self.min_kv_len}")
        if self.max_kv_len is not None and problem.max_kv_len > self.max_kv_len:
            out.append(f"max_kv_len={problem.max_kv_len} > max_kv_len={self.max_kv_len}")
        return out

    def batch_cuts(self) -> List[int]:
        return [v for v in (self.min_batch, None if self.max_batch is None else self.max_batch + 1) if v]

    def kv_len_cuts(self) -> List[int]:
        cuts = []
        if self.min_kv_len is not None:
            cuts.append(self.min_kv_len)
        if self.max_kv_len is not None:
            cuts.append(self.max_kv_len + 1)
        return cuts

    def describe(self) -> str:
        parts = []
        for name, value in self.model_dump(exclude_none=True, exclude_defaults=True).items():
            parts.append(f"{name}={list(value) if isinstance(value, tuple) else value}")
        return "{" + ", ".join(parts) + "}"


class BackendPolicy(_Strict):
    enabled: StrictBool = True
    allow: Tuple[ShapeRule, ...] = ()
    deny: Tuple[ShapeRule, ...] = ()
    options: Dict[str, Any] = Field(default_factory=dict)

    @field_validator("deny")
    @classmethod
    def _deny_has_no_options(cls, deny: Tuple[ShapeRule, ...]) -> Tuple[ShapeRule, ...]:
        for rule in deny:
            if rule.options:
                raise ValueError("options belong to allow rules; a deny rule takes no options")
        return deny

    def option_sets(self, problem: DecodeProblem) -> List[Dict[str, Any]]:
        """The options to try for `problem`: one per matching allow rule, else the backend's own."""
        if not self.allow:
            return [dict(self.options)]
        sets: List[Dict[str, Any]] = []
        for rule in self.allow:
            if not rule.mismatches(problem):
                merged = {**self.options, **rule.options}
                if merged not in sets:
                    sets.append(merged)
        return sets or [dict(self.options)]

    def rejections(self, problem: DecodeProblem) -> List[str]:
        """Why the policy keeps this backend off `problem` (empty: allowed): allow_misses, then denials."""
        return self.allow_misses(problem) + self.denials(problem)

    def allow_misses(self, problem: DecodeProblem) -> List[str]:
        """Why no allow rule admits `problem` (empty: one does, or the backend has none)."""
        reasons: List[str] = []
        if self.allow:
            per_rule = [r.mismatches(problem) for r in self.allow]
            if all(per_rule):
                if len(self.allow) == 1:
                    reasons.append("policy allow rule does not match: " + "; ".join(per_rule[0]))
                else:
                    reasons.append(
                        f"no policy allow rule matches ({len(self.allow)} rules): "
                        + " | ".join("; ".join(m) for m in per_rule)
                    )
        return reasons

    def denials(self, problem: DecodeProblem) -> List[str]:
        """The deny rules that match `problem`, described (empty: none)."""
        reasons: List[str] = []
        for i, rule in enumerate(self.deny):
            if not rule.mismatches(problem):
                reasons.append(f"policy deny[{i}] matches {rule.describe()}")
        return reasons


class MLASection(_Strict):
    order: Tuple[str, ...]
    fallback: Literal["reference", "error"] = "reference"
    # Allow rules say where a backend is preferred (mla tune writes them from timings). A shape that no backend
    # in `order` takes once allow rules count goes, before the fallback, to the first backend in order that can
    # take it and was passed over only because none of its allow rules matched (deny rules, enabled = false and
    # can_implement still hold): a real kernel instead of the slow reference. true: allow rules are strict.
    strict_allow: StrictBool = False

    @field_validator("order")
    @classmethod
    def _no_repeats(cls, order: Tuple[str, ...]) -> Tuple[str, ...]:
        seen = set()
        for name in order:
            if name in seen:
                raise ValueError(f"backend {name!r} appears twice")
            seen.add(name)
        return order


class TunedSection(_Strict):
    """Fingerprint of the machine `mla tune` measured on (see mlacore.tools.tune)."""

    gpu: StrictStr
    capability: StrictStr
    driver: StrictStr = ""
    torch: StrictStr = ""
    backends: Dict[str, StrictStr] = Field(default_factory=dict)
    date: StrictStr = ""
    grid: StrictStr = ""
    validation: Dict[str, Any] = Field(default_factory=dict)


class Policy(_Strict):
    mla: MLASection
    backend: Dict[str, BackendPolicy] = Field(default_factory=dict)
    tuned: Optional[TunedSection] = None
    _source: str = PrivateAttr(default=BUILTIN_SOURCE)

    @property
    def source(self) -> str:
        """Where the policy came from, for error messages and `mla policy check`."""
        return self._source

    def backend_policy(self, name: str) -> BackendPolicy:
        return self.backend.get(name) or _EMPTY_BACKEND_POLICY

    def named_backends(self) -> List[str]:
        return list(dict.fromkeys(list(self.mla.order) + list(self.backend)))

    def check_names(self, known: Iterable[str]) -> None:
        """Raise PolicyError for a backend name that is neither installed nor first-party."""
        allowed = set(known) | set(FIRST_PARTY_BACKENDS)
        for i, name in enumerate(self.mla.order):
            if name not in allowed:
                raise PolicyError(
                    f"{self.source}: mla.order[{i}]: unknown backend {name!r} "
                    f"(known: {', '.join(sorted(allowed))})"
                )
        for name in self.backend:
            if name not in allowed:
                raise PolicyError(
                    f"{self.source}: backend.{toml_key(name)}: unknown backend {name!r} "
                    f"(known: {', '.join(sorted(allowed))})"
                )

    def shape_cuts(self) -> Tuple[List[int], List[int]]:
        batch: List[int] = []
        kv: List[int] = []
        for bp in self.backend.values():
            for rule in bp.allow + bp.deny:
                batch += rule.batch_cuts()
                kv += rule.kv_len_cuts()
        return batch, kv


_EMPTY_BACKEND_POLICY = BackendPolicy()


_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def toml_key(key: Any) -> str:
    """A key as TOML writes it: bare when it can be, else quoted (a newline in a key stays on one line)."""
    key = str(key)
    return key if _BARE_KEY.match(key) else json.dumps(key)


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _format_loc(loc: Sequence[Any]) -> str:
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += ("." if text else "") + toml_key(part)
    return text or "<top level>"


def _format_validation_error(source: str, err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = [p for p in e["loc"] if not (isinstance(p, str) and p.startswith("function-"))]
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        elif e["type"] == "missing":
            msg = "required key is missing"
        elif isinstance(e.get("input"), (str, int, float, bool)) and not msg.startswith("Value error"):
            msg = f"{msg}, got {e['input']!r}"
        msg = _one_line(msg.replace("Value error, ", ""))
        lines.append(f"{source}: {_format_loc(loc)}: {msg}")
    return "\n".join(lines)


def parse_policy(data: Mapping[str, Any], source: str = "<dict>") -> Policy:
    try:
        policy = Policy.model_validate(dict(data))
    except ValidationError as err:
        raise PolicyError(_format_validation_error(source, err)) from None
    policy._source = source
    return policy


def parse_policy_text(text: str, source: str = "<string>") -> Policy:
    if text.startswith("\ufeff"):  # a UTF-8 byte-order mark (Windows editors): not TOML, but harmless
        text = text[1:]
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise PolicyError(f"{source}: not valid TOML: {err}") from None
    except RecursionError:
        raise PolicyError(f"{source}: not valid TOML: nested too deeply") from None
    try:
        return parse_policy(data, source)
    except RecursionError:
        raise PolicyError(f"{source}: nested too deeply to be a policy") from None


def builtin_policy_text() -> str:
    return resources.files("mlacore").joinpath("default_policy.toml").read_text()


def find_policy_path(explicit: Union[str, os.PathLike, None] = None,
                     env: Optional[Mapping[str, str]] = None,
                     cwd: Union[str, os.PathLike, None] = None) -> Optional[Path]:
    """The file the lookup order lands on (None: the built-in default)."""
    env = os.environ if env is None else env
    if explicit is not None:
        return Path(explicit)
    if env.get(ENV_POLICY):
        return Path(env[ENV_POLICY])
    local = Path(cwd or os.getcwd()) / "mla.toml"
    return local if local.is_file() else None


def load_policy(explicit: Union[str, os.PathLike, None] = None,
                env: Optional[Mapping[str, str]] = None,
                cwd: Union[str, os.PathLike, None] = None) -> Policy:
    path = find_policy_path(explicit, env, cwd)
    if path is None:
        return parse_policy_text(builtin_policy_text(), BUILTIN_SOURCE)
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise PolicyError(f"{path}: cannot read policy file: {err.strerror or err}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw[:err.start].count(b"\n") + 1
        raise PolicyError(f"{path}: not UTF-8 text (TOML must be UTF-8): byte 0x{raw[err.start]:02x} "
                          f"at line {line} cannot be decoded") from None
    return parse_policy_text(text, str(path))


def effective_order(policy: Policy, known: Iterable[str],
                    env: Optional[Mapping[str, str]] = None) -> List[str]:
    """The priority order after `enabled` flags and $MLA_BACKENDS."""
    env = os.environ if env is None else env
    base = [n for n in policy.mla.order if policy.backend_policy(n).enabled]
    raw = env.get(ENV_BACKENDS, "").strip()
    if not raw:
        return base
    items = [s.strip() for s in raw.split(",") if s.strip()]
    if not items or any(s in ("+", "-") for s in items):
        raise PolicyError(f"{ENV_BACKENDS}={raw!r}: expected backend names 'a,b' or deltas '+a,-b'")
    allowed = set(known) | set(FIRST_PARTY_BACKENDS)
    deltas = [s[0] in "+-" for s in items]
    if any(deltas) and not all(deltas):
        raise PolicyError(
            f"{ENV_BACKENDS}={raw!r}: mixes an exact list with +/- deltas; "
            "use either 'a,b' or '+a,-b'"
        )
    names = [s[1:] if s[0] in "+-" else s for s in items]
    for name in names:
        if name not in allowed:
            raise PolicyError(
                f"{ENV_BACKENDS}={raw!r}: unknown backend '{name}' (known: {', '.join(sorted(allowed))})"
            )
    if not any(deltas):
        if len(set(names)) != len(names):
            raise PolicyError(f"{ENV_BACKENDS}={raw!r}: a backend is named twice")
        return names
    order = list(base)
    for item, name in zip(items, names):
        if item[0] == "-":
            order = [n for n in order if n != name]
        elif name not in order:
            # re-enabling a backend keeps its place in the policy's order
            full = list(policy.mla.order)
            if name in full:
                later = [n for n in full[full.index(name) + 1:] if n in order]
                pos = order.index(later[0]) if later else len(order)
                order.insert(pos, name)
            else:
                order.append(name)
    return order


# -- backend options -------------------------------------------------------


def _option_error_lines(prefix: str, errors: Sequence[Mapping[str, Any]], model: type) -> List[str]:
    known = ", ".join(sorted(model.model_fields)) or "none"
    lines = []
    for e in errors:
        key = _format_loc(e["loc"]) if e["loc"] else ""
        where = f"{prefix}.{key}" if key else prefix
        if e["type"] == "extra_forbidden":
            lines.append(f"{where}: unknown option (known: {known})")
        else:  # a plugin's validator may write several lines: one error, one line
            lines.append(f"{where}: {_one_line(e['msg'].replace('Value error, ', ''))}")
    return lines


def _validate_options_model(model: type, data: Mapping[str, Any], where: str) -> Any:
    """model.model_validate(data); anything but a ValidationError is the plugin's bug, named as such."""
    try:
        return model.model_validate(dict(data))
    except ValidationError:
        raise
    except Exception as exc:  # a validator raising TypeError, KeyError...: pydantic lets these through
        raise PolicyError(f"{where}: the backend's options model {getattr(model, '__name__', model)} raised "
                          f"{type(exc).__name__}: {_one_line(exc)} (a bug in the plugin; these options "
                          "cannot be checked)") from None


class ValidatedOptions:
    """One backend's policy options, parsed into its typed Options model.

    `base` is `[backend.X].options`; `per_rule[i]` is the options of allow
    rule i merged over them. Built once, when a dispatcher is made.
    """

    def __init__(self, base: Any, per_rule: Tuple[Any, ...]) -> None:
        self.base = base
        self.per_rule = per_rule

    def option_sets(self, bpol: BackendPolicy, problem: DecodeProblem) -> List[Any]:
        """The options to try for `problem`: one per matching allow rule, else the base options."""
        if not bpol.allow:
            return [self.base]
        sets: List[Any] = []
        for rule, opts in zip(bpol.allow, self.per_rule):
            if not rule.mismatches(problem) and opts not in sets:
                sets.append(opts)
        return sets or [self.base]


def validate_backend_options(policy: Policy, name: str, model: type) -> ValidatedOptions:
    """Parse a backend's options (and every allow rule's) with its Options model.

    Raises PolicyError naming every bad key path at once, e.g.
    `backend.flashinfer_mla.allow[2].options.varaint: unknown option`.
    """
    bpol = policy.backend_policy(name)
    errors: List[str] = []
    base = None
    prefix = f"{policy.source}: backend.{toml_key(name)}"
    try:
        base = _validate_options_model(model, bpol.options, f"{prefix}.options")
    except ValidationError as err:
        errors += _option_error_lines(f"{prefix}.options", err.errors(), model)
    except PolicyError as err:
        errors.append(str(err))
    per_rule = []
    for i, rule in enumerate(bpol.allow):
        try:
            per_rule.append(_validate_options_model(model, {**bpol.options, **rule.options},
                                                    f"{prefix}.allow[{i}].options"))
        except ValidationError as err:
            if rule.options:  # errors of the base options are reported once, above
                own = [e for e in err.errors() if e["loc"] and e["loc"][0] in rule.options]
                errors += _option_error_lines(f"{prefix}.allow[{i}].options", own, model)
        except PolicyError as err:
            if rule.options and str(err) not in errors:
                errors.append(str(err))
    if errors:
        raise PolicyError("\n".join(errors))
    return ValidatedOptions(base, tuple(per_rule))
