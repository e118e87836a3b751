"""The `mla` command: list, explain, check (bench and tune live in their own modules).

Conventions every command follows:

* User mistakes (a bad policy, an unknown backend, a bad flag value) print
  one line starting with `mla: error:` that names the flag or key, and exit 2;
  no traceback.
* `--json` means JSON on stdout, and nothing else there; files are written
  with `-o/--output FILE`. JSON is standard: NaN and infinities are `null`.
* Tables follow the terminal width (`COLUMNS`), never break a name, and are
  plain text (no colour, ASCII rules) when stdout is not a terminal.
* A closed pipe (`mla backends list --json | head -1`) ends the command
  quietly with exit status 141, as a process killed by SIGPIPE.
* `mla --help`, `mla --version` and usage errors import neither torch nor
  rich, nor any plugin: this module imports the rest of mlacore lazily.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

EXIT_USAGE = 2
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, what a shell reports for `yes | head -1`

CLI_EXTRA = "pip install 'mlacore[cli]'"


class CLIError(Exception):
    """A user mistake: printed as one line, exit code 2."""


# -- output helpers ----------------------------------------------------------


def json_safe(value: Any) -> Any:
    """`value` with NaN and infinities turned into None, so that json.dumps writes standard JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def json_text(value: Any) -> str:
    return json.dumps(json_safe(value), indent=2, allow_nan=False)


def print_json(value: Any) -> None:
    sys.stdout.write(json_text(value) + "\n")


def write_json_file(path: str, value: Any) -> None:
    try:
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(json_text(value) + "\n")
    except OSError as err:
        raise CLIError(f"--output {path}: cannot write: {err.strerror or err}") from None


def _rich():
    try:
        import rich  # noqa: F401
    except ImportError:
        raise CLIError(f"tables need the 'rich' package: {CLI_EXTRA} (or use --json)") from None


def _width() -> Optional[int]:
    raw = os.environ.get("COLUMNS", "").strip()
    return int(raw) if raw.isdigit() and int(raw) > 0 else None


def _console():
    """Terminal: colour, the terminal's width (COLUMNS wins). Pipe: plain text, COLUMNS or 200 wide."""
    _rich()
    from rich.console import Console

    width = _width()
    console = Console(width=width, highlight=False, emoji=False)
    if not console.is_terminal:
        console = Console(width=width or 200, highlight=False, emoji=False, color_system=None,
                          force_terminal=False, force_jupyter=False)
    return console


class TableSpec:
    """A table built from plain strings: name columns never wrap, text columns wrap between words."""

    def __init__(self, title: Optional[str], columns: Sequence[Tuple[str, str]]) -> None:
        self.title = title
        self.columns = list(columns)  # (header, "name" | "text" | "short" (a text column of at most 24) | "num")
        self.rows: List[Tuple[List[str], Optional[str]]] = []

    def add(self, *cells: object, style: Optional[str] = None) -> None:
        self.rows.append(([str(c) for c in cells], style))

    def render(self, console=None, styles: Optional[Dict[int, Dict[str, str]]] = None) -> None:
        """Print; `styles[col][value]` colours that cell on a terminal."""
        from rich import box
        from rich.markup import escape
        from rich.table import Table
        from rich.text import Text

        console = console or _console()
        plain = console.color_system is None
        longest = [max([len(header)] + [len(line) for r, _ in self.rows for line in r[i].splitlines()])
                   for i, (header, _) in enumerate(self.columns)]
        # a text column is made wide enough for its longest word (up to 40 characters) when the terminal has the
        # room, so that a name or a version range ("flashinfer-python>=0.7.2,<0.7.3") wraps whole instead of being
        # folded in the middle; on a narrow terminal folding is what keeps the table inside it
        text_cols = [i for i, (_, kind) in enumerate(self.columns) if kind in ("text", "short")]
        word = {i: min(40, max([12] + [len(w) for r, _ in self.rows for w in r[i].split()])) for i in text_cols}
        fixed = sum(longest[i] for i in range(len(self.columns)) if i not in word) + 3 * len(self.columns) + 1
        fits = fixed + sum(word.values()) <= console.width
        table = Table(title=escape(self.title) if self.title else None, box=box.ASCII if plain else box.HEAVY_HEAD,
                      title_justify="left")
        for i, (header, kind) in enumerate(self.columns):
            if i in word:  # a "short" column (e.g. the accepted values) gives the rest to the text columns
                table.add_column(header, overflow="fold", ratio=1, min_width=word[i] if fits else 12,
                                 max_width=max(word[i] if fits else 12, 24) if kind == "short" else None)
            else:  # a name or a number: one piece, never folded or cut
                table.add_column(header, no_wrap=True, min_width=longest[i],
                                 justify="right" if kind == "num" else "left")
        styles = styles or {}
        for cells, _ in self.rows:
            row = []
            for i, cell in enumerate(cells):
                style = None if plain else styles.get(i, {}).get(cell)
                row.append(Text(cell, style=style or ""))
            table.add_row(*row)
        console.print(table)


def _say(text: str, style: Optional[str] = None) -> None:
    """A line of prose around a table; plain when piped."""
    console = _console()
    from rich.text import Text

    console.print(Text(text, style=(style or "") if console.color_system else ""))


# -- lazily imported pieces of mlacore ---------------------------------------


def _dispatcher(policy_path: Optional[str], simulate: Any = None):
    from ..dispatch import Dispatcher
    from ..policy import load_policy

    return Dispatcher(policy=load_policy(policy_path), simulate=simulate)


def _simulated_device(problem: Any) -> Any:
    """The device to judge availability for when the problem names a GPU this machine does not have.

    `--capability 10.0` on a laptop (or on an H200) answers what a B200 would
    pick: availability comes from each backend's `availability_for` (installed
    packages and the capability, no GPU probe). A problem for the GPU that is
    here is judged as usual.
    """
    device = problem.device
    if device.type != "cuda":
        return None
    if _cuda():
        import torch

        if tuple(torch.cuda.get_device_capability()) == device.capability:
            return None
    return device


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _options_text(options: Optional[Dict[str, Any]]) -> str:
    return ", ".join(f"{k}={v}" for k, v in (options or {}).items())


# -- mla --version -------------------------------------------------------------


def _dist_version(name: str) -> Optional[str]:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def version_info() -> Dict[str, Any]:
    """mlacore's version and every plugin distribution's, from installed metadata; imports no plugin."""
    from importlib import metadata

    import mlacore

    plugins: Dict[str, Dict[str, Any]] = {}
    for ep in sorted(metadata.entry_points(group="mlacore.backends"), key=lambda e: e.name):
        dist = getattr(ep, "dist", None)
        name = dist.metadata["Name"] if dist is not None else "?"
        entry = plugins.setdefault(name, {"version": dist.version if dist is not None else "?", "entry_points": []})
        if f"{ep.name} = {ep.value}" not in entry["entry_points"]:
            entry["entry_points"].append(f"{ep.name} = {ep.value}")
    libs = {n: v for n in ("torch", "pydantic", "pluggy", "flashinfer-python") if (v := _dist_version(n))}
    return {
        "mlacore": _dist_version("mlacore") or "unknown (not installed)",
        "location": os.path.dirname(os.path.abspath(mlacore.__file__)),
        "python": sys.version.split()[0],
        "plugins": plugins,
        "libraries": libs,
    }


class _VersionAction(argparse.Action):
    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        info = version_info()
        lines = [f"mla (mlacore {info['mlacore']}) at {info['location']}, Python {info['python']}"]
        if info["plugins"]:
            lines.append("plugins (entry points in mlacore.backends):")
            for dist, entry in info["plugins"].items():
                lines.append(f"  {dist}-{entry['version']}: {'; '.join(entry['entry_points'])}")
        if info["libraries"]:
            lines.append("libraries: " + ", ".join(f"{n} {v}" for n, v in info["libraries"].items()))
        sys.stdout.write("\n".join(lines) + "\n")
        parser.exit(0)


# -- mla backends list -------------------------------------------------


def cmd_backends_list(args: argparse.Namespace) -> int:
    from ..errors import BackendStatus
    from ..policy import effective_order, load_policy
    from ..registry import RESERVED_NAMES, get_registry

    registry = get_registry()
    policy = load_policy(args.policy)
    policy.check_names(registry.names())
    order = effective_order(policy, registry.names())
    rows = []
    names = list(dict.fromkeys(list(order) + registry.names()))
    for name in names:
        backend = registry.get(name)
        position = order.index(name) + 1 if name in order else None
        if backend is None:
            provider = RESERVED_NAMES.get(name)
            reasons = [f"provided by the distribution {provider} (pip install {provider})"] if provider else []
            rows.append(dict(name=name, distribution=provider or "-", version="-", status="not installed",
                             reasons=reasons, notes=[], details={}, description="", position=position,
                             traceback=None))
            continue
        status = backend.status
        info = backend.info() if backend.loaded else None
        details = dict(backend.availability().details) if backend.loaded else {}
        rows.append(dict(
            name=name, distribution=backend.distribution, version=backend.version, status=str(status),
            reasons=list(backend.reasons()) if status != BackendStatus.AVAILABLE else [],
            notes=list(info.notes) if info else [], details=details,
            description=info.description if info else "", position=position,
            traceback=backend.load_traceback,
        ))
    if args.json:
        for r in rows:
            if not args.traceback:
                r.pop("traceback")
        print_json({"policy": policy.source, "order": order, "fallback": policy.mla.fallback, "backends": rows})
        return 0
    table = TableSpec(f"MLA backends (policy: {policy.source}, fallback: {policy.mla.fallback})",
                      [("#", "num"), ("backend", "name"), ("distribution", "name"), ("version", "name"),
                       ("status", "name"), ("details", "text"), ("reasons / notes", "text")])
    for r in rows:
        text = "; ".join(r["reasons"] + r["notes"]) or r["description"]
        table.add(r["position"] or "-", r["name"], r["distribution"], r["version"], r["status"],
                  ", ".join(f"{k} {v}" for k, v in r["details"].items()), text)
    colors = {"available": "green", "unavailable": "yellow", "broken": "red", "refused": "red",
              "disabled": "dim", "not installed": "dim"}
    console = _console()
    table.render(console, styles={4: colors})
    broken = [r for r in rows if r["traceback"]]
    if args.traceback:
        for r in broken:
            console.print(f"\n{r['name']} ({r['distribution']} {r['version']}): {r['status']}", markup=False)
            console.print(r["traceback"].rstrip(), markup=False, highlight=False)
    elif broken:
        console.print(f"{len(broken)} broken: `mla backends list --traceback` shows why", markup=False)
    return 0


# -- mla backends options ----------------------------------------------


def type_text(annotation: Any) -> str:
    """An option's accepted values as a user writes them in mla.toml: ``"auto" | 1 | 2``, ``bool or unset``."""
    import types
    import typing

    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return " | ".join(json_text(a) if isinstance(a, str) else str(a).lower() if isinstance(a, bool) else str(a)
                          for a in args)
    if origin is typing.Union or origin is getattr(types, "UnionType", None):
        parts = [a for a in args if a is not type(None)]
        text = " | ".join(type_text(a) for a in parts)
        return f"{text} or unset" if len(parts) < len(args) else text
    if origin is typing.Annotated:
        return type_text(args[0])
    return getattr(annotation, "__name__", str(annotation))


def options_rows(handle: Any) -> List[Dict[str, Any]]:
    """Each option a backend takes: name, accepted values, default, description (its Options model's fields)."""
    model = handle.options_model
    defaults = model().model_dump(mode="json")  # default_factory fields too; the loader checked that Options() builds
    rows = []
    for name, field in model.model_fields.items():
        rows.append(dict(name=name, values=type_text(field.annotation), default=json_safe(defaults.get(name)),
                         description=" ".join((field.description or "").split())))
    return rows


def cmd_backends_options(args: argparse.Namespace) -> int:
    from ..registry import RESERVED_NAMES, get_registry

    registry = get_registry()
    if args.backend is not None and registry.get(args.backend) is None:
        provider = RESERVED_NAMES.get(args.backend)
        hint = (f"it is provided by the distribution {provider} (pip install {provider})" if provider
                else f"installed: {', '.join(registry.names())}")
        raise CLIError(f"backend: {args.backend!r} is not installed; {hint}")
    handles = [registry.get(args.backend)] if args.backend else registry.backends()
    out = []
    for h in handles:
        why = h.load_error or h.disabled_reason or h.refused_reason
        out.append(dict(name=h.name, distribution=h.distribution, version=h.version, loaded=h.loaded,
                        reason=None if h.loaded else why, options=options_rows(h) if h.loaded else []))
    if args.json:
        print_json({"backends": out})
        return 0
    table = TableSpec("Backend options (set them in mla.toml under [backend.NAME.options], or NAME:key=value in "
                      "`mla bench --backend`)",
                      [("backend", "name"), ("option", "name"), ("default", "name"), ("values", "short"),
                       ("description", "text")])
    for b in out:
        if not b["loaded"]:
            table.add(b["name"], "-", "-", "-", f"not loaded: {b['reason'] or 'see `mla backends list`'}")
        elif not b["options"]:
            table.add(b["name"], "-", "-", "-", "takes no options")
        for o in b["options"]:
            default = "unset" if o["default"] is None else json.dumps(o["default"]).strip('"')
            table.add(b["name"], o["name"], default, o["values"], o["description"])
    table.render(_console())
    return 0


# -- mla backends explain ----------------------------------------------

# DecodeProblem field -> the flag that sets it
FLAG_OF = {"num_heads": "--num-heads", "seq_len_q": "--seq-len-q", "batch_size": "--batch",
           "max_kv_len": "--kv-len", "min_kv_len": "--min-kv-len", "page_size": "--page-size",
           "q_dtype": "--q-dtype", "kv_dtype": "--kv-dtype", "device": "--device"}


def _check_problem_flags(args: argparse.Namespace) -> None:
    for flag, value, least in (("--num-heads", args.num_heads, 1), ("--seq-len-q", args.seq_len_q, 1),
                               ("--batch", args.batch, 1), ("--page-size", args.page_size, 1),
                               ("--kv-len", args.kv_len, 0)):
        if value < least:
            raise CLIError(f"{flag}: must be at least {least}, got {value}")
    if args.min_kv_len is not None:
        if args.min_kv_len < 0:
            raise CLIError(f"--min-kv-len: must be at least 0, got {args.min_kv_len}")
        if args.min_kv_len > args.kv_len:
            raise CLIError(f"--min-kv-len: {args.min_kv_len} is larger than --kv-len {args.kv_len}")


def problem_error_line(err: Exception) -> str:
    """A pydantic error about a DecodeProblem as one line naming the flag (the first error only)."""
    errors = err.errors() if hasattr(err, "errors") else []
    if not errors:
        return str(err).strip().splitlines()[0]
    e = errors[0]
    loc = [p for p in e.get("loc", ()) if isinstance(p, str)]
    msg = str(e.get("msg", "invalid value")).replace("Value error, ", "")
    if loc and loc[0] in FLAG_OF:
        got = e.get("input")
        suffix = f", got {got!r}" if isinstance(got, (int, str, float)) else ""
        return f"{FLAG_OF[loc[0]]}: {msg}{suffix}"
    for field_name, flag in FLAG_OF.items():  # a model-level error: name the flags in its message
        msg = msg.replace(f"{field_name}=", f"{flag} ")
    return msg


def _problem_from_args(args: argparse.Namespace):
    from ..problem import DecodeProblem, DeviceSpec

    _check_problem_flags(args)
    device_type = args.device or ("cuda" if args.capability is not None or _cuda() else "cpu")
    if device_type == "cuda":
        cap = args.capability
        if cap is None:
            if not _cuda():
                raise CLIError("--device cuda: no GPU here; pass --capability MAJOR.MINOR to explain for one")
            device = DeviceSpec.of("cuda")
        else:
            try:
                major, minor = (int(x) for x in cap.split("."))
            except ValueError:
                raise CLIError(f"--capability: expected MAJOR.MINOR such as 9.0, got {cap!r}") from None
            device = DeviceSpec(type="cuda", capability=(major, minor))
    else:
        device = DeviceSpec(type="cpu")
    try:
        return DecodeProblem(
            num_heads=args.num_heads, seq_len_q=args.seq_len_q, batch_size=args.batch,
            max_kv_len=args.kv_len, min_kv_len=args.kv_len if args.min_kv_len is None else args.min_kv_len,
            page_size=args.page_size, q_dtype=args.q_dtype, kv_dtype=args.kv_dtype,
            causal=not args.non_causal, return_lse=not args.no_lse, device=device,
        )
    except ValueError as err:  # pydantic's ValidationError is a ValueError
        raise CLIError(problem_error_line(err)) from None


def cmd_backends_explain(args: argparse.Namespace) -> int:
    problem = _problem_from_args(args)
    simulate = _simulated_device(problem)
    dispatcher = _dispatcher(args.policy, simulate)
    decision = dispatcher.explain(problem)
    simulated_note = (f"simulated {simulate}: no such GPU here; availability judged for it from the installed "
                      "packages (each backend's availability_for), nothing was run" if simulate else None)
    options = decision.options_dict() if decision.backend else None

    # the chosen backend's notes: where it says what was verified on which GPU ("not verified on hardware")
    notes = list(dispatcher.backend(decision.backend).info().notes) if decision.backend else []

    def verdict_options(v) -> Optional[Dict[str, Any]]:
        return None if v.options is None else v.options.model_dump(mode="json")

    if args.json:
        print_json({
            "problem": problem.model_dump(mode="json"), "policy": dispatcher.policy.source,
            "order": list(dispatcher.order), "chosen": decision.backend, "options": options,
            "fallback_used": decision.fallback_used, "simulated": simulated_note, "notes": notes,
            "verdicts": [{"backend": v.backend, "outcome": str(v.outcome), "reasons": list(v.reasons),
                          "options": verdict_options(v)} for v in decision.verdicts],
        })
        return 0 if decision.backend else 1
    console = _console()
    console.print(f"problem: {problem.describe()}", markup=False)
    console.print(f"policy:  {dispatcher.policy.source}; order {list(dispatcher.order)}", markup=False)
    if simulated_note:
        console.print(f"device:  {simulated_note}", markup=False)
    table = TableSpec(None, [("backend", "name"), ("verdict", "name"), ("options", "text"), ("reasons", "text")])
    for v in decision.verdicts:
        table.add(v.backend, str(v.outcome), _options_text(verdict_options(v)) if v.accepts else "",
                  "\n".join(v.reasons))
    table.render(console, styles={1: {"chosen": "bold green", "accepted": "green"}})
    if decision.backend is None:
        console.print("no backend takes this problem (policy fallback is 'error' or the reference cannot "
                      "take it)", markup=False)
        return 1
    via = " (policy fallback)" if decision.fallback_used else ""
    console.print(f"chosen: {decision.backend}{via}", markup=False)
    console.print(f"options: {_options_text(options) or '(none)'}", markup=False)
    for note in notes:
        console.print(f"note:    {note}", markup=False)
    return 0


# -- mla policy check ----------------------------------------------------


def cmd_policy_check(args: argparse.Namespace) -> int:
    from ..dispatch import Dispatcher
    from ..policy import load_policy

    policy = load_policy(args.path)
    dispatcher = Dispatcher(policy=policy)  # validates names, options (typed, per rule) and the fallback
    order = list(dispatcher.order)
    warnings = _fingerprint_warnings(policy)
    effective = policy.model_dump(mode="json", exclude_defaults=True)
    if args.json:
        print_json({"ok": True, "policy": policy.source, "order": order,
                    "MLA_BACKENDS": os.environ.get("MLA_BACKENDS") or None, "warnings": warnings,
                    "effective": effective})
        return 0
    lines = [f"ok: {policy.source}",
             f"effective order: {order}" + (f"  (MLA_BACKENDS={os.environ['MLA_BACKENDS']!r})"
                                            if os.environ.get("MLA_BACKENDS") else "")]
    lines += [f"warning: {w}" for w in warnings]
    lines.append(json_text(effective))
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


def cmd_policy_regret(args: argparse.Namespace) -> int:
    """What a policy would cost on stored measurements: per cell, the arm it routes to against the fastest.

    The same routing and regret as `mla tune --validate-from`, for any policy (the built-in one, an edited
    mla.toml) and without writing anything: to check a hand-made rule, or an old tuned file against new runs."""
    from ..errors import PolicyError
    from ..policy import load_policy
    from .tune import TuneError, validate

    policy = load_policy(args.path)
    report = _join_reports([_read_report(f, "--from") for f in args.from_json], args.from_json)
    labels = sorted({r.backend for r in report.rows})
    aliases: Dict[str, str] = {}
    for text in args.arm or ():
        name, sep, label = text.partition("=")
        if not sep or not name or label not in labels or label.split(":", 1)[0] != name:
            raise CLIError(f"--arm {text!r}: expected BACKEND=LABEL with LABEL one of the measured arms of BACKEND "
                           f"({', '.join(labels)})")
        aliases[name] = label
    try:
        result = validate(policy, report, aliases=aliases)
    except (TuneError, PolicyError) as err:
        raise CLIError(str(err)) from None
    if result.unmatched:
        missing = "; ".join(f"{name} with options {dict(opts) or '{}'}" for name, opts in result.unmatched)
        raise CLIError(f"{policy.source} runs {missing}, and no measured arm has exactly those options "
                       f"(measured: {', '.join(labels)}): say which arm it runs, e.g. --arm "
                       f"{result.unmatched[0][0]}=LABEL (flashinfer_mla's variant=auto runs fa3 on sm_90)")
    if not result.cells:
        raise CLIError("--from: no cell of these measurements has a correct, timed arm")
    if args.json:
        print_json({"policy": policy.source, **result.summary(args.worst), "cell_count": len(result.cells), "cells": [
            {"cell": c.problem.describe(), "fastest": c.fastest, "fastest_us": c.fastest_us, "routed": c.routed,
             "routed_us": None if c.routed_us != c.routed_us else c.routed_us, "regret": c.regret, "note": c.note}
            for c in result.cells]})
        return 0
    _print_regret(result, args.worst, f"mla policy regret: {policy.source} on {result.grid}")
    line = (f"{policy.source}: on {len(result.cells)} cells mean regret {100 * (result.mean_regret or 0):.2f}%, "
            f"worst {100 * (result.worst_regret or 0):.1f}%")
    if result.failures:
        line += f", {len(result.failures)} cells routed to no correct, timed arm"
    _say(line)
    return 0


def _fingerprint_warnings(policy) -> List[str]:
    if policy.tuned is None:
        return []
    from .fingerprint import fingerprint_mismatches

    return fingerprint_mismatches(policy.tuned)


# -- mla check -----------------------------------------------------------


def _available_backend(name: str):
    """The installed, available backend `name`, or a CLIError saying why not."""
    from ..errors import BackendStatus
    from ..registry import get_registry

    registry = get_registry()
    b = registry.get(name)
    if b is None:
        raise CLIError(f"--backend: '{name}' is not installed (installed: {', '.join(registry.names())})")
    if b.status != BackendStatus.AVAILABLE:
        raise CLIError(f"--backend: '{name}' is {b.status}: {'; '.join(b.reasons())}")
    return b


def cmd_check(args: argparse.Namespace) -> int:
    from ..errors import BackendStatus
    from ..problem import DeviceSpec
    from ..registry import get_registry
    from ..testing.compare import check_grid, run_checks

    registry = get_registry()
    device = args.device or ("cuda" if _cuda() else "cpu")
    if args.backend:
        names = [_available_backend(name).name for name in args.backend]
    else:
        names = [b.name for b in registry.backends() if b.status == BackendStatus.AVAILABLE]
    spec = DeviceSpec.of(device)
    results = run_checks(names, check_grid(args.quick, spec), device=device, registry=registry)
    failed = sum(1 for r in results if not r.skipped and not r.passed)
    ran = sum(1 for r in results if not r.skipped)
    code = 1 if failed or ran == 0 else 0
    if args.json:
        print_json({"device": str(spec), "grid": "quick" if args.quick else "full",
                    "passed": ran - failed, "failed": failed, "skipped": len(results) - ran,
                    "results": [{"backend": r.backend, "problem": r.problem.model_dump(mode="json"),
                                 "result": "skip" if r.skipped else ("pass" if r.passed else "fail"),
                                 "out_rel_err": None if r.skipped else r.out_rel_err,
                                 "lse_max_err": None if r.skipped else r.lse_max_err,
                                 "messages": list(r.messages)} for r in results]})
        return code
    table = TableSpec(f"mla check on {spec} ({'quick' if args.quick else 'full'} grid)",
                      [("backend", "name"), ("problem", "text"), ("result", "name"), ("out rel err", "num"),
                       ("lse max err", "num"), ("notes", "text")])
    for r in results:
        result = "skip" if r.skipped else ("pass" if r.passed else "FAIL")
        table.add(r.backend, r.problem.describe(), result,
                  "" if r.skipped else f"{r.out_rel_err:.1e}", "" if r.skipped else f"{r.lse_max_err:.1e}",
                  "; ".join(r.messages))
    console = _console()
    table.render(console, styles={2: {"skip": "dim", "pass": "green", "FAIL": "bold red"}})
    console.print(f"{ran - failed} passed, {failed} failed, {len(results) - ran} skipped", markup=False)
    return code


# -- mla bench / mla tune --------------------------------------------------------


def _bench_specs(args: argparse.Namespace):
    from ..errors import BackendStatus
    from ..registry import get_registry
    from .bench import BackendSpec

    registry = get_registry()
    if args.backend:
        try:
            specs = [BackendSpec.parse(b) for b in args.backend]
        except ValueError as err:
            raise CLIError(str(err)) from None
        for spec in specs:
            b = _available_backend(spec.name)
            try:
                b.parse_options(dict(spec.options))
            except ValueError as err:  # pydantic's ValidationError
                lines = [f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors()]
                raise CLIError(f"--backend {spec.label}: " + "; ".join(lines)) from None
        return specs
    return [BackendSpec(b.name) for b in registry.backends() if b.status == BackendStatus.AVAILABLE]


def _run_bench(args: argparse.Namespace, grid_spec: str, specs=None, save_partial: bool = False):
    from ..problem import DeviceSpec
    from .bench import run_bench
    from .grid import load_grid

    device = args.device or ("cuda" if _cuda() else "cpu")
    grid = load_grid(grid_spec)
    problems = grid.problems(DeviceSpec.of(device))
    specs = _bench_specs(args) if specs is None else specs
    graph = device == "cuda" and not args.no_graph
    progress = not args.no_progress and not args.json and _has_rich() and sys.stderr.isatty()
    save = _partial_saver(args.output) if save_partial and getattr(args, "output", None) else None
    return run_bench(problems, specs, device, graph, grid.describe(), progress=progress, budget_s=args.budget,
                     on_cell=save, sequential=args.sequential)


def _partial_saver(path: str):
    """run_bench's on_cell for -o FILE: the report so far (grid marked partial) replaces FILE after each cell, via
    a temporary file and a rename, so a run killed by a time limit leaves a whole JSON file of what it measured."""
    from .bench import report_json

    def save(report) -> None:
        tmp = f"{path}.partial.tmp"
        write_json_file(tmp, report_json(report))
        os.replace(tmp, path)
    return save


def _has_rich() -> bool:
    import importlib.util

    return importlib.util.find_spec("rich") is not None


def _fmt(v: float, f: str) -> str:
    return "" if v is None or v != v else format(v, f)  # NaN -> blank


def _print_bench(report) -> None:
    title = (f"mla bench: {report.grid}\nceilings: {report.ceilings.copy_gbps:.0f} GB/s copy, "
             f"{report.ceilings.matmul_tflops:.0f} TFLOP/s matmul ({report.ceilings.how})")
    table = TableSpec(title, [("backend", "name"), ("problem", "text"), ("status", "name"), ("us", "num"),
                              ("GB/s", "num"), ("TFLOP/s", "num"), ("% bw", "num"), ("% flops", "num"),
                              ("speed-up", "num"), ("notes", "text")])
    for r in report.rows:
        table.add(r.backend, r.problem.describe(), r.status, _fmt(r.time_us, ".1f"), _fmt(r.gbps, ".0f"),
                  _fmt(r.tflops, ".1f"), _fmt(r.pct_bw, ".0f"), _fmt(r.pct_flops, ".0f"),
                  _fmt(r.speedup_vs_best_other, ".2f"), r.notes[:120])
    table.render(styles={2: {"ok": "green", "wrong": "bold red", "error": "red", "skipped": "dim"}})


def _write_outputs(report, args: argparse.Namespace) -> None:
    from .bench import plot, report_json, write_csv

    if args.csv:
        write_csv(report, args.csv)
    if args.output:
        write_json_file(args.output, report_json(report))
    if getattr(args, "plot", None):
        try:
            plot(report, args.plot)
        except RuntimeError as err:
            raise CLIError(str(err)) from None


def cmd_bench(args: argparse.Namespace) -> int:
    from .bench import report_json

    report = _run_bench(args, args.grid, save_partial=True)
    _write_outputs(report, args)
    if args.json:
        print_json(report_json(report))
    else:
        _print_bench(report)
    wrong = [r for r in report.rows if r.status in ("wrong", "error")]
    return 1 if wrong else 0


def _read_report(path: str, flag: str):
    from .bench import report_from_json

    try:
        with open(path, encoding="utf-8") as fh:
            return report_from_json(json.load(fh))
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CLIError(f"{flag} {path}: cannot read measurements: {err}") from None


def _refine(args: argparse.Namespace, report):
    """`--refine N`: up to N rounds of measuring the midpoints where neighbouring cells' winners differ."""
    from .bench import BackendSpec, run_bench
    from .tune import refine_problems

    specs = _bench_specs(args) if args.backend else [BackendSpec.parse(lbl) for lbl in
                                                     sorted({r.backend for r in report.rows})]
    device = args.device or ("cuda" if _cuda() else "cpu")
    graph = device == "cuda" and not args.no_graph
    for round_no in range(1, args.refine + 1):
        problems = refine_problems(report, max_cells=args.refine_cells)
        if not problems:
            _say(f"--refine: round {round_no}: every switch of winner is placed within 1.5x; done")
            break
        _say(f"--refine: round {round_no}: measuring {len(problems)} midpoint cells")
        extra = run_bench(problems, specs, device, graph, f"refine {round_no}", progress=False,
                          budget_s=args.budget, sequential=args.sequential)
        report = _join_reports([report, extra], ["<grid>", f"<refine {round_no}>"])
    return report


def _join_reports(reports: list, paths: List[str]):
    from .tune import TuneError, join_reports

    try:
        return join_reports(reports, paths)
    except TuneError as err:
        raise CLIError(f"--from: {err}") from None


def cmd_tune(args: argparse.Namespace) -> int:
    from pathlib import Path

    try:
        import tomlkit  # noqa: F401
    except ImportError:
        raise CLIError(f"mla tune writes policies with 'tomlkit': {CLI_EXTRA}") from None
    from ..errors import PolicyError
    from ..policy import builtin_policy_text, parse_policy_text
    from .bench import BackendSpec
    from .tune import TuneError, _cell, record_validation, tune, validate, write_atomically

    if args.refine_cells is not None and not args.refine:
        raise CLIError("--refine-cells limits --refine rounds: give --refine ROUNDS too")
    for flag, out in (("-o/--output", args.output), ("--csv", args.csv)):
        if out and args.from_json and any(_same_file(out, f) for f in args.from_json):
            raise CLIError(f"{flag} {out}: is one of the --from files; the joined measurements would replace it")
    if args.from_json:
        report = _join_reports([_read_report(f, "--from") for f in args.from_json], args.from_json)
    else:
        report = _run_bench(args, args.grid)
    if args.refine:
        report = _refine(args, report)
    _write_outputs(report, args)  # with --from: the joined (and refined) measurements, as asked
    path = Path(args.write)
    try:
        base = path.read_text(encoding="utf-8") if path.is_file() else builtin_policy_text()
    except OSError as err:
        raise CLIError(f"--write {path}: cannot read: {err.strerror or err}") from None
    try:
        text, cells = tune(report, path, base, args.rules)
    except TuneError as err:
        raise CLIError(str(err)) from None

    by_cell: Dict[tuple, Dict[str, Any]] = {}
    for r in report.rows:
        by_cell.setdefault(_cell(r.problem), {})[r.backend] = r
    tuned_rows = []
    for key, rows in sorted(by_cell.items(), key=lambda kv: str(kv[0])):
        desc = next(iter(rows.values())).problem.describe()
        ok = {n: r.time_us for n, r in rows.items() if r.status == "ok"}
        if not ok:
            tuned_rows.append({"cell": desc, "fastest": None, "fastest_us": None, "routed": None, "regret": None})
            continue
        fastest = min(ok, key=lambda n: (ok[n], n))
        routed = cells[key][1]
        # --rules batch may route a cell to an arm that failed or was wrong there (its one split holds the group's
        # other cells); such a cell has no regret, only the arm's status
        missed = routed not in ok
        tuned_rows.append({"cell": desc, "fastest": fastest, "fastest_us": ok[fastest], "routed": routed,
                           "regret": None if missed else ok[routed] / ok[fastest] - 1.0,
                           "routed_status": (rows[routed].status if routed in rows else "not measured")
                           if missed else "ok"})
    worst = max([r["regret"] for r in tuned_rows if r["regret"] is not None], default=0.0)
    missed_cells = sum(1 for r in tuned_rows if r["fastest"] is not None and r["regret"] is None)
    try:
        write_atomically(path, text)
    except OSError as err:
        raise CLIError(f"--write {path}: cannot write: {err.strerror or err}") from None
    summary: Dict[str, Any] = {"policy": str(path), "cells": tuned_rows, "worst_regret": worst}
    if not args.json:
        table = TableSpec(f"mla tune -> {path}", [("cell", "text"), ("fastest", "name"), ("policy picks", "name"),
                                                 ("within", "num")])
        for r in tuned_rows:
            if r["fastest"] is None:
                table.add(r["cell"], "-", "-", "no correct backend")
            elif r["regret"] is None:
                table.add(r["cell"], f"{r['fastest']} {r['fastest_us']:.1f} us", r["routed"] or "-",
                          f"routed arm {r['routed_status']}")
            else:
                table.add(r["cell"], f"{r['fastest']} {r['fastest_us']:.1f} us", r["routed"],
                          f"{100 * r['regret']:.1f}%")
        table.render()
        if missed_cells:
            _say(f"wrote {path}: {len(cells)} cells, {missed_cells} routed to an arm with no correct time there "
                 f"(table), the others within {100 * worst:.1f}% of the fastest")
        else:
            _say(f"wrote {path}: {len(cells)} cells, every one routed within {100 * worst:.1f}% of the fastest")

    if args.validate or args.validate_from:
        # a separate pass, after the rules are written: the policy as written, on a second grid
        if args.validate_from:
            vreport = _read_report(args.validate_from, "--validate-from")
        else:
            specs = None if args.backend else [BackendSpec.parse(lbl) for lbl in sorted({r.backend for r in report.rows})]
            vreport = _run_bench(args, args.validate, specs)
            if args.validate_output:
                from .bench import report_json

                write_json_file(args.validate_output, report_json(vreport))
        try:
            policy = parse_policy_text(text, str(path))
            result = validate(policy, vreport)
            if not result.cells:
                raise CLIError("--validate: no cell of the validation grid has a correct, timed arm")
            record = result.summary(args.worst)
            write_atomically(path, record_validation(text, record, str(path)))
        except (TuneError, PolicyError) as err:
            raise CLIError(str(err)) from None
        summary["validation"] = {**record, "cells": [
            {"cell": c.problem.describe(), "fastest": c.fastest, "fastest_us": c.fastest_us, "routed": c.routed,
             "routed_us": c.routed_us, "regret": c.regret, "note": c.note} for c in result.cells],
            "cell_count": len(result.cells)}
        if not args.json:
            _print_validation(result, args.worst, path)
    if args.json:
        print_json(summary)
    return 0


def _print_regret(result, worst_n: int, title: str) -> None:
    """The worst cells of a Validation as a table (mla tune --validate, mla policy regret)."""
    table = TableSpec(f"{title}\nthe {min(worst_n, len(result.cells))} worst of {len(result.cells)} cells",
                      [("cell", "text"), ("fastest", "name"), ("policy picks", "name"), ("regret", "num"),
                       ("note", "text")])
    for c in result.worst(worst_n):
        table.add(c.problem.describe(), f"{c.fastest} {c.fastest_us:.1f} us",
                  (c.routed or "-") + ("" if c.routed_us != c.routed_us else f" {c.routed_us:.1f} us"),
                  "-" if c.regret is None else f"{100 * c.regret:.1f}%", c.note)
    table.render()


def _print_validation(result, worst_n: int, path) -> None:
    _print_regret(result, worst_n, f"mla tune --validate: {result.grid}")
    mean, worst = result.mean_regret, result.worst_regret
    line = (f"validation on {len(result.cells)} cells: mean regret {100 * (mean or 0):.2f}%, "
            f"worst {100 * (worst or 0):.1f}%")
    if result.failures:
        line += f", {len(result.failures)} cells routed to no correct, timed arm"
    _say(line + f"; recorded in {path} [tuned.validation]")
    for name, opts in result.unmatched:
        _say(f"warning: {path} runs {name} with options {dict(opts) or '{}'} where no arm of the validation run has "
             "them; those cells were routed past it (mla policy regret --arm maps such a backend to an arm)")


# -- wiring ----------------------------------------------------------------


def _same_file(a: str, b: str) -> bool:
    """Whether two paths name one file (through links; a path that does not exist yet is none of them)."""
    import os

    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (argparse names the flag in its error)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The argument parser; building it imports nothing beyond the standard library."""
    parser = argparse.ArgumentParser(prog="mla", description="Choose, explain and check MLA decode backends.")
    parser.add_argument("-V", "--version", action=_VersionAction,
                        help="mlacore's version and every installed plugin's, then exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    backends = sub.add_parser("backends", help="list installed backends, explain a choice")
    bsub = backends.add_subparsers(dest="backends_command", required=True, metavar="COMMAND")
    p = bsub.add_parser("list", help="every backend with its status, details and reasons")
    p.add_argument("--json", action="store_true", help="JSON on stdout")
    p.add_argument("--traceback", action="store_true", help="show the import traceback of a broken plugin")
    p.add_argument("--policy", help="policy file (default: $MLA_POLICY, ./mla.toml, built-in)")
    p.set_defaults(func=cmd_backends_list)

    p = bsub.add_parser("options", help="the options each backend takes: values, default and what they do")
    p.add_argument("backend", nargs="?", metavar="NAME", help="one backend (default: every installed one)")
    p.add_argument("--json", action="store_true", help="JSON on stdout")
    p.set_defaults(func=cmd_backends_options)

    p = bsub.add_parser("explain", help="every backend's verdict for one problem, the choice and its options")
    p.add_argument("--num-heads", type=int, required=True)
    p.add_argument("--seq-len-q", type=int, default=1)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--kv-len", type=int, default=4096, help="largest kv length in the batch")
    p.add_argument("--min-kv-len", type=int, default=None, help="smallest kv length (default: --kv-len)")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--q-dtype", default="bf16", choices=["bf16", "fp16", "fp32", "fp8_e4m3"])
    p.add_argument("--kv-dtype", default="bf16", choices=["bf16", "fp16", "fp32", "fp8_e4m3"])
    p.add_argument("--device", default=None, choices=["cpu", "cuda"],
                   help="default: cuda with --capability or a visible GPU, else cpu")
    p.add_argument("--capability", help="compute capability to explain for, e.g. 9.0 (default: this GPU)")
    p.add_argument("--non-causal", action="store_true")
    p.add_argument("--no-lse", action="store_true")
    p.add_argument("--json", action="store_true", help="JSON on stdout")
    p.add_argument("--policy")
    p.set_defaults(func=cmd_backends_explain)

    pol = sub.add_parser("policy", help="validate a policy file")
    psub = pol.add_subparsers(dest="policy_command", required=True, metavar="COMMAND")
    p = psub.add_parser("check", help="validate and print the effective policy")
    p.add_argument("path", nargs="?", default=None)
    p.add_argument("--json", action="store_true", help="JSON on stdout")
    p.set_defaults(func=cmd_policy_check)
    p = psub.add_parser("regret", help="what a policy costs on stored `mla bench -o` measurements")
    p.add_argument("path", nargs="?", default=None,
                   help="policy file (default: $MLA_POLICY, ./mla.toml, built-in)")
    p.add_argument("--from", dest="from_json", action="append", required=True, metavar="FILE",
                   help="measurements from `mla bench -o FILE` with every arm timed (repeat to join runs of one "
                        "machine)")
    p.add_argument("--arm", action="append", metavar="BACKEND=LABEL",
                   help="count the policy's BACKEND, where it runs with options no measured arm has (e.g. "
                        "flashinfer_mla with variant=auto), as the measured arm LABEL (repeatable)")
    p.add_argument("--worst", type=_positive_int, default=10, help="how many of the worst cells to show")
    p.add_argument("--json", action="store_true", help="JSON on stdout")
    p.set_defaults(func=cmd_policy_regret)

    p = sub.add_parser("check", help="correctness of each available backend against the fp64 reference")
    p.add_argument("--backend", action="append", help="check only this backend (repeatable)")
    p.add_argument("--quick", action="store_true", help="a smaller grid")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None)
    p.add_argument("--json", action="store_true", help="JSON on stdout")
    p.set_defaults(func=cmd_check)

    def bench_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--backend", action="append", help="NAME or NAME:key=value (repeatable; default: all available)")
        p.add_argument("--grid", default="quick", help="preset (quick, tp8, tp1, mtp, fp8) or a TOML grid file")
        p.add_argument("--device", choices=["cpu", "cuda"], default=None)
        p.add_argument("--no-graph", action="store_true", help="time eager launches instead of CUDA-graph replay")
        p.add_argument("--budget", type=float, default=0.3, help="seconds of timing per backend and cell")
        p.add_argument("--sequential", action="store_true",
                       help="time each cell's backends one after the other (as before mlacore 0.2.2) instead of "
                            "interleaved in rounds")
        p.add_argument("--json", action="store_true", help="JSON on stdout instead of the table")
        p.add_argument("-o", "--output", metavar="FILE",
                       help="write the measurements as JSON (the input of `mla tune --from`; with --from: "
                            "the joined runs and any --refine cells)")
        p.add_argument("--csv", metavar="FILE", help="write every row to this CSV file")
        p.add_argument("--plot", metavar="FILE", help="draw time against kv length to this PNG (needs matplotlib)")
        p.add_argument("--no-progress", action="store_true")

    p = sub.add_parser("bench", help="time every backend side by side over a grid")
    bench_args(p)
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("tune", help="measure a grid and write allow rules that route its cells to the faster arms")
    bench_args(p)
    p.add_argument("--write", required=True, metavar="FILE",
                   help="policy file to write or merge into (atomically; keeps its mode and symlink)")
    p.add_argument("--rules", choices=("boxes", "batch"), default="batch",  # tune.RULE_MODES (lazy import here)
                   help="batch (default): per group (heads, s_q, dtypes, page size) one arm, or two split at one "
                        "batch, with the smallest worst regret over the group's cells (coarser; on two H200 run "
                        "sets a lower worst regret on 9 of 12 grids left out, among them new lengths at the "
                        "measured batches: docs/results/h200_tune.md); boxes: every measured cell to its fastest "
                        "arm, boxes over batch and kv length between (exact on the measured cells)")
    p.add_argument("--from", dest="from_json", metavar="FILE", action="append",
                   help="use measurements from `mla bench -o FILE` instead of measuring (repeat to join several "
                        "runs of one machine: a denser grid)")
    p.add_argument("--refine", type=int, default=0, metavar="ROUNDS",
                   help="before writing, measure up to ROUNDS rounds of midpoint cells between neighbouring "
                        "cells whose winners differ (where the rules place a switch)")
    p.add_argument("--refine-cells", type=_positive_int, default=None, metavar="N",
                   help="measure at most N midpoint cells per --refine round, whole lines, those where taking "
                        "a neighbour's winner costs most first (default: all)")
    p.add_argument("--validate", metavar="GRID",
                   help="after writing, time the written policy against every arm on this second grid "
                        "and record mean and worst regret in [tuned.validation]")
    p.add_argument("--validate-from", metavar="FILE",
                   help="validate on measurements from `mla bench -o FILE` instead of measuring")
    p.add_argument("--validate-output", metavar="FILE", help="write the validation measurements as JSON")
    p.add_argument("--worst", type=int, default=5, help="how many of the worst validation cells to show and record")
    p.set_defaults(func=cmd_tune)
    return parser


def _quiet_broken_pipe() -> int:
    # the reader went away (`| head`): stop writing, and keep the interpreter's final flush quiet
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass
    return EXIT_BROKEN_PIPE


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except BrokenPipeError:
        return _quiet_broken_pipe()
    from ..errors import MLAError

    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        return _quiet_broken_pipe()
    except (CLIError, MLAError) as err:
        for line in str(err).splitlines() or [""]:
            print(f"mla: error: {line}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
