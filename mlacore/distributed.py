"""Tensor-parallel ranks must make the same backend choice: fingerprint it, exchange it, stop if it differs.

Each tensor-parallel rank builds its own `MLADecoder` in its own process,
from its own copy of the policy, environment and installed plugins. The
decision is a pure function of those, so ranks agree when their inputs
agree; but a plugin that failed to import on one node, a policy file read
from another working directory or a stray `MLA_BACKENDS` makes one rank run
another backend (or the same backend with other options), and the step
still runs, a little differently per rank. Nothing downstream notices.

    from mlacore.distributed import check_same_choice
    decoder = MLADecoder(num_heads=H // tp, ...)
    check_same_choice(decoder)          # once, before the first step; every rank calls it

`choice_fingerprint` is the local half: per shape class, the backend and
options this decoder would use, plus what the choice depends on (installed
backends with versions and status, the effective policy and order, the
`MLA_*` environment, the decoder's static facts). `check_same_choice`
exchanges fingerprints with `torch.distributed.all_gather_object` when a
process group is initialised (and returns the local fingerprint when not),
then raises `RankMismatchError` on *every* rank if any differ, naming the
ranks, the shape classes, the fields and each rank's value.

Never a hang: every rank takes part in the same two collectives whatever
happens locally (an exception while fingerprinting is exchanged as data and
reported, not raised before the exchange), and every rank compares the same
gathered data, so all raise or none does. A rank that dies before the
exchange is the launcher's to reap (torchrun and `mp.spawn` both stop the
others); pass a finite `timeout` to `init_process_group` as well.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

from . import __version__
from .errors import MLAError, NoBackendError
from .problem import DecodeProblem

if TYPE_CHECKING:  # pragma: no cover
    from .decoder import MLADecoder

FINGERPRINT_VERSION = 1

# MLA_* variables that are read but cannot change a decision: kept out of the comparison.
# MLA_POLICY is a path (ranks may legitimately read the same file from different places);
# the policy's *content* is compared instead.
_ENV_NOT_COMPARED = frozenset({"MLA_POLICY", "MLA_DISPATCH_VERIFY"})

MAX_LISTED_DIFFERENCES = 12


class RankMismatchError(MLAError, RuntimeError):
    """Tensor-parallel ranks would choose differently (or one could not say); raised on every rank.

    `differences` holds one `Difference` per differing field; `rank` is the
    rank that raised it and `odd_ranks` those whose values differ from the
    baseline (the largest group of ranks that agree, rank 0's on a tie).
    """

    def __init__(self, message: str, rank: int, world_size: int, differences: Sequence["Difference"],
                 odd_ranks: Sequence[int]) -> None:
        super().__init__(message)
        self.rank = rank
        self.world_size = world_size
        self.differences = tuple(differences)
        self.odd_ranks = tuple(odd_ranks)


@dataclass(frozen=True, order=True)
class ShapeClass:
    """What a step is decided on beyond the decoder's static facts: batch size, s_q, kv lengths."""

    batch_size: int
    seq_len_q: int = 1
    max_kv_len: int = 4096
    min_kv_len: int = 1

    def __post_init__(self) -> None:
        for name in ("batch_size", "seq_len_q"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"ShapeClass.{name}: expected an int >= 1, got {value!r}")
        for name in ("max_kv_len", "min_kv_len"):
            value = getattr(self, name)
            if type(value) is not int or value < 0:
                raise ValueError(f"ShapeClass.{name}: expected an int >= 0, got {value!r}")
        if self.min_kv_len > self.max_kv_len:
            raise ValueError(f"ShapeClass: min_kv_len={self.min_kv_len} is larger than "
                             f"max_kv_len={self.max_kv_len}")

    @property
    def label(self) -> str:
        return f"B={self.batch_size} s_q={self.seq_len_q} kv={self.min_kv_len}..{self.max_kv_len}"


ShapeClassLike = Union[ShapeClass, Tuple[int, ...], Sequence[int]]

DEFAULT_BATCH_SIZES = (1, 8, 64)
DEFAULT_SEQ_LENS_Q = (1, 2)
DEFAULT_KV_LENS = (1, 4096)


def as_shape_class(value: ShapeClassLike) -> ShapeClass:
    """A ShapeClass from itself or a tuple (batch_size, seq_len_q, max_kv_len[, min_kv_len])."""
    if isinstance(value, ShapeClass):
        return value
    if isinstance(value, (tuple, list)) and 1 <= len(value) <= 4:
        return ShapeClass(*value)
    raise ValueError(f"shape class: expected a ShapeClass or a tuple (batch_size, seq_len_q, max_kv_len"
                     f"[, min_kv_len]), got {value!r}")


def default_shape_classes(decoder: "MLADecoder") -> List[ShapeClass]:
    """Batch sizes 1, 8, 64 x s_q 1, 2 x kv 1..1 and 1..4096, plus every boundary the policy draws.

    A policy rule `min_batch = 32` or `max_kv_len = 512` splits the shapes
    into regions that may choose differently; one class on each side of
    every cut is added, so a difference confined to one region is seen. In
    CUDA-graph mode classes stay inside the capture envelope (a plan outside
    it is refused anyway) and the envelope's corner is added.
    """
    batch_cuts, kv_cuts = decoder.dispatcher.policy.shape_cuts()
    batches = set(DEFAULT_BATCH_SIZES)
    kvs = set(DEFAULT_KV_LENS)
    for cut in batch_cuts:
        batches.update(v for v in (cut - 1, cut) if v >= 1)
    for cut in kv_cuts:
        kvs.update(v for v in (cut - 1, cut) if v >= 1)
    env = decoder.envelope
    if env is not None:
        batches = {b for b in batches if b <= env.max_batch} | {env.max_batch}
        kvs = {k for k in kvs if k <= env.max_kv_len} | {env.max_kv_len}
    return sorted(ShapeClass(b, s, kv, min(1, kv)) for b in batches for s in DEFAULT_SEQ_LENS_Q for kv in kvs)


# -- the local fingerprint -----------------------------------------------------------


def _problem(decoder: "MLADecoder", sc: ShapeClass) -> DecodeProblem:
    import torch

    base = decoder.problem_for(torch.tensor([sc.min_kv_len, sc.max_kv_len], dtype=torch.int32), sc.seq_len_q)
    return DecodeProblem(**{**base.model_dump(exclude={"batch_size"}), "batch_size": sc.batch_size})


def _choice(decoder: "MLADecoder", sc: ShapeClass) -> Dict[str, Any]:
    try:
        decision, _fixed = decoder.decide(_problem(decoder, sc))
    except NoBackendError as err:
        # outcomes only: their reasons name the problem, and one cause should read as one line over all classes
        verdicts = ", ".join(f"{v.backend} {v.outcome}" for v in err.decision.verdicts)
        return {"backend": None, "options": None, "fallback_used": False,
                "error": f"NoBackendError (fallback = 'error'): {verdicts}"}
    except Exception as err:  # a broken plugin or an invalid class: a value to compare, never a hang
        return {"backend": None, "options": None, "fallback_used": False,
                "error": f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"}
    return {"backend": decision.backend, "options": decision.options_dict(),
            "fallback_used": decision.fallback_used}


def _digest(data: Any) -> str:
    text = json.dumps(data, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def choice_fingerprint(decoder: "MLADecoder",
                       shape_classes: Optional[Iterable[ShapeClassLike]] = None) -> Dict[str, Any]:
    """What this process would run for each shape class, and everything that choice depends on.

    A JSON-able dict: `choices` (per shape class label: backend, options,
    fallback_used, or the error), `backends` (every installed backend's
    distribution, version and status), `policy` (effective order, fallback,
    the policy's content and its digest), `env` (the `MLA_*` variables that
    can change a choice), `decoder` (static facts), and `info` (rank-local
    facts such as the policy's path and host: reported, never compared).
    `digest` summarises everything compared, for logs.
    """
    classes = default_shape_classes(decoder) if shape_classes is None else [as_shape_class(s) for s in shape_classes]
    dispatcher = decoder.dispatcher
    policy = dispatcher.policy
    # defaults left out (a file that spells out a default means the same as one that does not),
    # except in [mla], whose two keys read better in a difference as values than as <absent>
    content = policy.model_dump(mode="json", exclude_defaults=True)
    content["mla"] = policy.mla.model_dump(mode="json")
    backends: Dict[str, Any] = {}
    reasons: Dict[str, List[str]] = {}
    for handle in dispatcher.registry.backends():
        backends[handle.name] = {"distribution": handle.distribution, "version": handle.version,
                                 "status": str(handle.status)}
        why = list(handle.reasons())
        if why:
            reasons[handle.name] = why
    env = {k: v for k, v in sorted(dispatcher.env.items()) if k.startswith("MLA_") and k not in _ENV_NOT_COMPARED}
    cfg = decoder.session_config()
    compared = {
        "version": FINGERPRINT_VERSION,
        "mlacore": __version__,
        "decoder": {
            "num_heads": cfg.num_heads, "page_size": cfg.page_size, "q_dtype": cfg.q_dtype,
            "kv_dtype": cfg.kv_dtype, "kv_lora_rank": cfg.kv_lora_rank, "qk_rope_head_dim": cfg.qk_rope_head_dim,
            "causal": cfg.causal, "return_lse": cfg.return_lse, "sm_scale": cfg.sm_scale, "kv_scale": cfg.kv_scale,
            "device": str(cfg.device),
            "cuda_graph": None if cfg.envelope is None else cfg.envelope.model_dump(mode="json"),
        },
        "policy": {"order": list(dispatcher.order), "content": content},  # order: after enabled and MLA_BACKENDS
        "env": env,
        "backends": backends,
        "choices": {sc.label: _choice(decoder, sc) for sc in classes},
    }
    compared["policy"]["digest"] = _digest(content)
    fingerprint = dict(compared)
    fingerprint["digest"] = _digest(compared)
    fingerprint["info"] = {
        "policy_source": policy.source,
        "MLA_POLICY": dispatcher.env.get("MLA_POLICY"),
        "device_index": cfg.device_index,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "backend_reasons": reasons,
    }
    return fingerprint


# -- comparing fingerprints ----------------------------------------------------------------


class _Absent:
    def __repr__(self) -> str:
        return "<absent>"


ABSENT = _Absent()
_NOT_COMPARED = ("digest", "info")
_DERIVED = (("policy", "digest"),)  # summaries of fields compared one by one


@dataclass(frozen=True)
class Difference:
    """One field that differs between ranks: its path and each rank's value (ABSENT: the rank lacks it)."""

    path: Tuple[str, ...]
    values: Tuple[Any, ...]  # indexed by rank

    def groups(self) -> List[Tuple[List[int], Any]]:
        """Ranks grouped by value, largest group first (rank order on ties)."""
        out: List[Tuple[List[int], Any]] = []
        for rank, value in enumerate(self.values):
            for ranks, v in out:
                if _same(v, value):
                    ranks.append(rank)
                    break
            else:
                out.append(([rank], value))
        return sorted(out, key=lambda g: (-len(g[0]), g[0][0]))


def _same(a: Any, b: Any) -> bool:
    if a is ABSENT or b is ABSENT:
        return a is b
    return a == b


def _flatten(data: Any, prefix: Tuple[str, ...], out: Dict[Tuple[str, ...], Any]) -> None:
    if isinstance(data, Mapping) and data:
        for key, value in data.items():
            _flatten(value, prefix + (str(key),), out)
    else:
        out[prefix] = data


def compare_fingerprints(fingerprints: Sequence[Mapping[str, Any]]) -> List[Difference]:
    """Every compared field whose value is not the same on all ranks (fingerprints indexed by rank)."""
    flat: List[Dict[Tuple[str, ...], Any]] = []
    for fp in fingerprints:
        d: Dict[Tuple[str, ...], Any] = {}
        _flatten({k: v for k, v in fp.items() if k not in _NOT_COMPARED}, (), d)
        for path in _DERIVED:
            d.pop(path, None)
        flat.append(d)
    paths: List[Tuple[str, ...]] = []
    for d in flat:
        paths += [p for p in d if p not in paths]
    diffs = []
    for index, path in enumerate(paths):
        values = tuple(d.get(path, ABSENT) for d in flat)
        if any(not _same(values[0], v) for v in values[1:]):
            diffs.append((index, Difference(path, values)))
    # what runs first, then what it depends on; shape classes keep their (sorted) order
    order = {"choices": 0, "backends": 1, "env": 2, "policy": 3, "decoder": 4}
    return [d for _, d in sorted(diffs, key=lambda item: (order.get(item[1].path[0], 5), item[0]))]


class _Raw(str):
    """Text shown as it is (a rank's whole choice), not as a JSON value."""


def _show(value: Any, width: int = 100) -> str:
    if isinstance(value, _Raw):
        return value if len(value) <= 2 * width else value[:2 * width - 3] + "..."
    text = repr(value) if value is ABSENT else json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= width else text[:width - 3] + "..."


def _rank_list(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(str(r) for r in ranks)


def _values_text(diff: Difference) -> str:
    return " | ".join(f"{_rank_list(ranks)}: {_show(value)}" for ranks, value in diff.groups())


def odd_ranks(differences: Sequence[Difference]) -> List[int]:
    """Ranks outside the baseline group of at least one difference."""
    odd = set()
    for diff in differences:
        for ranks, _ in diff.groups()[1:]:
            odd.update(ranks)
    return sorted(odd)


def _choice_text(choice: Any) -> Any:
    if not isinstance(choice, Mapping):
        return choice
    if choice.get("backend") is None:
        return _Raw(f"no backend: {choice.get('error', '?')}")
    text = f"{choice['backend']} {json.dumps(choice.get('options') or {}, sort_keys=True)}"
    return _Raw(text + (" (policy fallback)" if choice.get("fallback_used") else ""))


def format_differences(differences: Sequence[Difference], fingerprints: Sequence[Mapping[str, Any]],
                       limit: int = MAX_LISTED_DIFFERENCES) -> List[str]:
    """One line per differing field; a field that differs the same way in many shape classes is one line."""
    lines: List[str] = []
    merged: Dict[Tuple[str, str], List[str]] = {}
    seen_whole: set = set()
    total_classes = max((len(fp.get("choices", {})) for fp in fingerprints), default=0)
    # a class whose backend differs (or fails on some rank) is one line with each rank's whole choice;
    # otherwise one line per differing field (options.chunk_tokens ...)
    whole = {d.path[1] for d in differences if d.path[0] == "choices" and len(d.path) > 2
             and d.path[2] in ("backend", "error")}
    effective_order_differs = any(d.path == ("policy", "order") for d in differences)
    for diff in differences:
        if diff.path[0] == "choices" and len(diff.path) >= 2:
            label = diff.path[1]
            if label in whole:
                if (label, "whole") in seen_whole:
                    continue
                seen_whole.add((label, "whole"))
                values = tuple(_choice_text(fp.get("choices", {}).get(label, ABSENT)) for fp in fingerprints)
                merged.setdefault(("backend", _values_text(Difference(diff.path[:2], values))), []).append(label)
            else:
                field = ".".join(diff.path[2:]) or "choice"
                merged.setdefault((field, _values_text(diff)), []).append(label)
        elif diff.path == ("policy", "content", "mla", "order") and effective_order_differs:
            continue  # the effective order's line says it
        else:
            lines.append(f"{'.'.join(diff.path)}: {_values_text(diff)}")
    choice_lines = []
    for (field, values), labels in merged.items():
        shown = ", ".join(labels[:3]) + (f" and {len(labels) - 3} more" if len(labels) > 3 else "")
        choice_lines.append(f"choice {field} in {len(labels)} of {total_classes} shape classes ({shown}): {values}")
    lines = choice_lines + lines
    # say why a backend's status or the policy differs: rank-local facts the comparison skips
    for diff in differences:
        if diff.path[0] == "backends" and diff.path[-1] == "status":
            name = diff.path[1]
            for rank, fp in enumerate(fingerprints):
                why = fp.get("info", {}).get("backend_reasons", {}).get(name)
                if why:
                    lines.append(f"  rank {rank}: {name} is {_show(diff.values[rank])}: {'; '.join(why)}")
    if any(d.path[0] == "policy" for d in differences):
        sources = [f"rank {r}: {fp.get('info', {}).get('policy_source')}" for r, fp in enumerate(fingerprints)]
        lines.append("policy read from: " + " | ".join(sources))
    if len(lines) > limit:
        lines = lines[:limit] + [f"... and {len(lines) - limit} more differences"]
    return lines


def mismatch_error(fingerprints: Sequence[Mapping[str, Any]], rank: int) -> Optional[RankMismatchError]:
    """The error every rank raises for these gathered fingerprints, or None when they agree."""
    world = len(fingerprints)
    failed = [(r, fp["error"]) for r, fp in enumerate(fingerprints) if "error" in fp]
    if failed:
        lines = [f"rank {r} could not fingerprint its MLA backend choice: {err}" for r, err in failed]
        message = (f"[rank {rank} of {world}] MLA backend choice check failed on "
                   f"{_rank_list([r for r, _ in failed])}:\n  " + "\n  ".join(lines))
        return RankMismatchError(message, rank, world, (), [r for r, _ in failed])
    diffs = compare_fingerprints(fingerprints)
    if not diffs:
        return None
    odd = odd_ranks(diffs)
    base = [r for r in range(world) if r not in odd]
    head = (f"[rank {rank} of {world}] tensor-parallel ranks disagree on the MLA backend choice: "
            f"{_rank_list(odd)} differ{'s' if len(odd) == 1 else ''} from {_rank_list(base)}")
    body = format_differences(diffs, fingerprints)
    hint = ("every rank must run the same backend with the same options: give all ranks the same policy "
            "(MLA_POLICY / mla.toml), the same MLA_* environment and the same plugin versions")
    return RankMismatchError(head + ":\n  " + "\n  ".join(body) + "\n" + hint, rank, world, diffs, odd)


# -- the exchange -------------------------------------------------------------------------


def _dist(group: Any) -> Optional[Any]:
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch built without distributed
        return None
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist


def _gather(dist: Any, obj: Any, group: Any) -> List[Any]:
    out: List[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def check_same_choice(decoder: "MLADecoder", shape_classes: Optional[Iterable[ShapeClassLike]] = None,
                      group: Any = None) -> Dict[str, Any]:
    """Check that every rank of `group` would choose the same; returns this rank's fingerprint.

    Call on every rank of the group, before the first step (a collective).
    Without an initialised torch.distributed it checks nothing and returns
    the local fingerprint. Shape classes are the union over ranks of what
    each passes (default: `default_shape_classes`), so a class only one
    rank thought of is still compared. With NCCL, set the rank's CUDA device
    first (all_gather_object moves its bytes through it).

    Raises RankMismatchError on every rank when any rank differs, or when any
    rank failed to compute its fingerprint.
    """
    dist = _dist(group)
    if dist is None:
        return choice_fingerprint(decoder, shape_classes)
    rank = dist.get_rank(group)
    # phase 1: agree on the shape classes (local errors travel as data: no rank may skip a collective)
    try:
        mine: Any = [as_shape_class(s) for s in (default_shape_classes(decoder) if shape_classes is None
                                                  else shape_classes)]
        mine = [(s.batch_size, s.seq_len_q, s.max_kv_len, s.min_kv_len) for s in mine]
    except Exception as err:
        mine = {"error": f"{type(err).__name__}: {err}"}
    lists = _gather(dist, mine, group)
    union = sorted({ShapeClass(*t) for got in lists if isinstance(got, list) for t in got})
    # phase 2: fingerprints over the same classes everywhere
    try:
        if isinstance(mine, dict):
            raise MLAError(f"shape classes: {mine['error']}")
        fp: Dict[str, Any] = choice_fingerprint(decoder, union)
    except Exception as err:
        fp = {"error": f"{type(err).__name__}: {err}"}
    fingerprints = _gather(dist, fp, group)
    error = mismatch_error(fingerprints, rank)
    if error is not None:
        raise error
    return fp


__all__ = [
    "ABSENT", "DEFAULT_BATCH_SIZES", "DEFAULT_KV_LENS", "DEFAULT_SEQ_LENS_Q", "Difference", "RankMismatchError",
    "ShapeClass", "as_shape_class", "check_same_choice", "choice_fingerprint", "compare_fingerprints",
    "default_shape_classes", "format_differences", "mismatch_error", "odd_ranks",
]
