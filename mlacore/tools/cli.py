"""The `mla` command: list, explain, check (bench and tune live in their own modules).

User mistakes (a bad policy, an unknown backend, a bad flag) print one line
starting with `mla: error:` and exit 2; no traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import List, Optional, Sequence

from rich.console import Console
from rich.table import Table

from ..dispatch import Dispatcher
from ..errors import BackendStatus, MLAError
from ..policy import effective_order, load_policy
from ..problem import DecodeProblem, DeviceSpec
from ..registry import get_registry

AVAILABLE = BackendStatus.AVAILABLE

EXIT_USAGE = 2


class CLIError(Exception):
    """A user mistake: printed as one line, exit code 2."""


def _console() -> Console:
    console = Console(soft_wrap=True)
    if not console.is_terminal:  # pipes and logs: wide rows beat wrapped cells
        console = Console(width=max(160, int(os.environ.get("COLUMNS", "0") or 0)), soft_wrap=True)
    return console


def _dispatcher(policy_path: Optional[str]) -> Dispatcher:
    return Dispatcher(policy=load_policy(policy_path))


# -- mla backends list -------------------------------------------------


def cmd_backends_list(args: argparse.Namespace) -> int:
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
            rows.append(dict(name=name, distribution="-", version="-", status="not installed",
                             reasons=[], notes=[], description="", position=position))
            continue
        status = backend.status
        info = backend.info() if backend.loaded else None
        rows.append(dict(
            name=name, distribution=backend.distribution, version=backend.version, status=backend.status,
            reasons=list(backend.reasons()) if status != AVAILABLE else [],
            notes=list(info.notes) if info else [], description=info.description if info else "",
            position=position,
        ))
    if args.json:
        print(json.dumps({"policy": policy.source, "order": order, "fallback": policy.mla.fallback,
                          "backends": rows}, indent=2))
        return 0
    table = Table(title=f"MLA backends (policy: {policy.source}, fallback: {policy.mla.fallback})")
    for col in ("#", "backend", "distribution", "version", "status", "reasons / notes"):
        table.add_column(col, overflow="fold")
    style = {"available": "green", "unavailable": "yellow", "broken": "red", "disabled": "dim"}
    for r in rows:
        text = "; ".join(r["reasons"] + r["notes"]) or r["description"]
        table.add_row(str(r["position"] or "-"), r["name"], r["distribution"], r["version"],
                      f"[{style.get(r['status'], 'dim')}]{r['status']}[/]", text)
    _console().print(table)
    return 0


# -- mla backends explain ----------------------------------------------


def _problem_from_args(args: argparse.Namespace) -> DecodeProblem:
    if args.device == "cuda":
        cap = args.capability
        if cap is None:
            import torch

            if not torch.cuda.is_available():
                raise CLIError("--device cuda needs a GPU here, or --capability MAJOR.MINOR to explain for one")
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
    except ValueError as err:
        raise CLIError(str(err).strip()) from None


def cmd_backends_explain(args: argparse.Namespace) -> int:
    dispatcher = _dispatcher(args.policy)
    problem = _problem_from_args(args)
    decision = dispatcher.explain(problem)
    if args.json:
        print(json.dumps({
            "problem": problem.model_dump(mode="json"), "chosen": decision.backend,
            "fallback_used": decision.fallback_used,
            "verdicts": [{"backend": v.backend, "outcome": v.outcome, "reasons": list(v.reasons)}
                         for v in decision.verdicts],
        }, indent=2))
        return 0 if decision.backend else 1
    console = _console()
    console.print(f"problem: {problem.describe()}")
    console.print(f"policy:  {dispatcher.policy.source}; order {dispatcher.order}")
    table = Table()
    for col in ("backend", "verdict", "reasons"):
        table.add_column(col, overflow="fold")
    for v in decision.verdicts:
        color = "green" if v.accepts else "yellow"
        table.add_row(v.backend, f"[{color}]{v.outcome}[/]", "\n".join(v.reasons))
    console.print(table)
    if decision.backend is None:
        console.print("[red]no backend takes this problem[/] (policy fallback is 'error' or the "
                      "reference cannot take it)")
        return 1
    via = " (policy fallback)" if decision.fallback_used else ""
    console.print(f"chosen: [bold]{decision.backend}[/]{via}")
    return 0


# -- mla policy check ----------------------------------------------------


def cmd_policy_check(args: argparse.Namespace) -> int:
    policy = load_policy(args.path)
    dispatcher = Dispatcher(policy=policy)  # validates names, options (typed, per rule) and the fallback
    order = dispatcher.order
    console = _console()
    console.print(f"[green]ok[/]: {policy.source}")
    console.print(f"effective order: {order}" + (
        f"  (MLA_BACKENDS={os.environ['MLA_BACKENDS']!r})" if os.environ.get("MLA_BACKENDS") else ""))
    for warning in _fingerprint_warnings(policy):
        console.print(f"[yellow]warning[/]: {warning}")
    console.print(json.dumps(policy.model_dump(mode="json", exclude_defaults=True), indent=2))
    return 0


def _fingerprint_warnings(policy) -> List[str]:
    if policy.tuned is None:
        return []
    from .fingerprint import fingerprint_mismatches

    return fingerprint_mismatches(policy.tuned)


# -- mla check -----------------------------------------------------------


def _available_backend(name: str):
    """The installed, available backend `name`, or a CLIError saying why not."""
    registry = get_registry()
    b = registry.get(name)
    if b is None:
        raise CLIError(f"--backend: '{name}' is not installed (installed: {', '.join(registry.names())})")
    if b.status != AVAILABLE:
        raise CLIError(f"--backend: '{name}' is {b.status}: {'; '.join(b.reasons())}")
    return b


def cmd_check(args: argparse.Namespace) -> int:
    from ..testing.compare import check_grid, run_checks

    registry = get_registry()
    device = args.device or ("cuda" if _cuda() else "cpu")
    if args.backend:
        names = [_available_backend(name).name for name in args.backend]
    else:
        names = [b.name for b in registry.backends() if b.status == AVAILABLE]
    spec = DeviceSpec.of(device)
    results = run_checks(names, check_grid(args.quick, spec), device=device, registry=registry)
    table = Table(title=f"mla check on {spec} ({'quick' if args.quick else 'full'} grid)")
    for col in ("backend", "problem", "result", "out rel err", "lse max err", "notes"):
        table.add_column(col, overflow="fold")
    failed = 0
    for r in results:
        if r.skipped:
            result = "[dim]skip[/]"
        elif r.passed:
            result = "[green]pass[/]"
        else:
            result = "[red]FAIL[/]"
            failed += 1
        table.add_row(r.backend, r.problem.describe(), result,
                      "" if r.skipped else f"{r.out_rel_err:.1e}", "" if r.skipped else f"{r.lse_max_err:.1e}",
                      "; ".join(r.messages))
    console = _console()
    console.print(table)
    ran = sum(1 for r in results if not r.skipped)
    console.print(f"{ran - failed} passed, {failed} failed, {len(results) - ran} skipped")
    return 1 if failed or ran == 0 else 0


# -- mla bench / mla tune --------------------------------------------------------


def _bench_specs(args: argparse.Namespace):
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
    return [BackendSpec(b.name) for b in registry.backends() if b.status == AVAILABLE]


def _run_bench_from_args(args: argparse.Namespace):
    from .bench import run_bench
    from .grid import load_grid

    device = args.device or ("cuda" if _cuda() else "cpu")
    grid = load_grid(args.grid)
    problems = grid.problems(DeviceSpec.of(device))
    specs = _bench_specs(args)
    graph = device == "cuda" and not args.no_graph
    return run_bench(problems, specs, device, graph, grid.describe(), progress=not args.no_progress,
                     budget_s=args.budget)


def _print_bench(report) -> None:
    table = Table(title=f"mla bench: {report.grid}\nceilings: {report.ceilings.copy_gbps:.0f} GB/s copy, "
                        f"{report.ceilings.matmul_tflops:.0f} TFLOP/s matmul ({report.ceilings.how})")
    for col in ("backend", "problem", "status", "us", "GB/s", "TFLOP/s", "% bw", "% flops", "speed-up", "notes"):
        table.add_column(col, overflow="fold")
    fmt = lambda v, f: "" if v != v else format(v, f)  # noqa: E731  (NaN -> blank)
    for r in report.rows:
        table.add_row(r.backend, r.problem.describe(), r.status, fmt(r.time_us, ".1f"), fmt(r.gbps, ".0f"),
                      fmt(r.tflops, ".1f"), fmt(r.pct_bw, ".0f"), fmt(r.pct_flops, ".0f"),
                      fmt(r.speedup_vs_best_other, ".2f"), r.notes[:120])
    _console().print(table)


def _write_outputs(report, args: argparse.Namespace) -> None:
    from .bench import plot, report_json, write_csv

    if args.csv:
        write_csv(report, args.csv)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report_json(report), fh, indent=1)
    if getattr(args, "plot", None):
        try:
            plot(report, args.plot)
        except RuntimeError as err:
            raise CLIError(str(err)) from None


def cmd_bench(args: argparse.Namespace) -> int:
    report = _run_bench_from_args(args)
    _print_bench(report)
    _write_outputs(report, args)
    wrong = [r for r in report.rows if r.status in ("wrong", "error")]
    return 1 if wrong else 0


def cmd_tune(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .bench import report_from_json
    from ..policy import builtin_policy_text
    from .tune import TuneError, tune, write_atomically

    if args.from_json:
        try:
            with open(args.from_json) as fh:
                report = report_from_json(json.load(fh))
        except (OSError, ValueError, KeyError) as err:
            raise CLIError(f"--from {args.from_json}: cannot read measurements: {err}") from None
    else:
        report = _run_bench_from_args(args)
        _write_outputs(report, args)
    path = Path(args.write)
    base = path.read_text() if path.is_file() else builtin_policy_text()
    try:
        text, cells = tune(report, path, base)
    except TuneError as err:
        raise CLIError(str(err)) from None
    best = {}
    for r in report.rows:
        if r.status == "ok":
            key = (r.problem.describe(), r.backend)
            best[key] = r.time_us
    table = Table(title=f"mla tune -> {path}")
    for col in ("cell", "fastest", "policy picks", "within"):
        table.add_column(col)
    worst = 0.0
    by_cell = {}
    for r in report.rows:
        by_cell.setdefault(r.problem.describe(), {})[r.backend] = r
    for desc, rows in sorted(by_cell.items()):
        ok = {n: r.time_us for n, r in rows.items() if r.status == "ok"}
        if not ok:
            table.add_row(desc, "-", "-", "no correct backend")
            continue
        fastest = min(ok, key=lambda n: (ok[n], n))
        cell = next(iter(rows.values())).problem
        from .tune import _cell

        routed = cells[_cell(cell)][1]
        gap = ok[routed] / ok[fastest] - 1.0
        worst = max(worst, gap)
        table.add_row(desc, f"{fastest} {ok[fastest]:.1f} us", routed, f"{100 * gap:.1f}%")
    _console().print(table)
    write_atomically(path, text)
    _console().print(f"wrote {path}: {len(cells)} cells, every one routed within {100 * worst:.1f}% of the fastest")
    return 0


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


# -- wiring ----------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mla", description="Choose, explain and check MLA decode backends.")
    sub = parser.add_subparsers(dest="command", required=True)

    backends = sub.add_parser("backends", help="list installed backends, explain a choice")
    bsub = backends.add_subparsers(dest="backends_command", required=True)
    p = bsub.add_parser("list", help="every backend with its status and reasons")
    p.add_argument("--json", action="store_true")
    p.add_argument("--policy", help="policy file (default: $MLA_POLICY, ./mla.toml, built-in)")
    p.set_defaults(func=cmd_backends_list)

    p = bsub.add_parser("explain", help="every backend's verdict for one problem, and the choice")
    p.add_argument("--num-heads", type=int, required=True)
    p.add_argument("--seq-len-q", type=int, default=1)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--kv-len", type=int, default=4096, help="largest kv length in the batch")
    p.add_argument("--min-kv-len", type=int, default=None, help="smallest kv length (default: --kv-len)")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--q-dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--kv-dtype", default="bf16", choices=["bf16", "fp16", "fp32", "fp8_e4m3"])
    p.add_argument("--device", default="cuda" if _cuda_quiet() else "cpu", choices=["cpu", "cuda"])
    p.add_argument("--capability", help="compute capability to explain for, e.g. 9.0 (default: this GPU)")
    p.add_argument("--non-causal", action="store_true")
    p.add_argument("--no-lse", action="store_true")
    p.add_argument("--json", action="store_true")
    p.add_argument("--policy")
    p.set_defaults(func=cmd_backends_explain)

    pol = sub.add_parser("policy", help="validate a policy file")
    psub = pol.add_subparsers(dest="policy_command", required=True)
    p = psub.add_parser("check", help="validate and print the effective policy")
    p.add_argument("path", nargs="?", default=None)
    p.set_defaults(func=cmd_policy_check)

    p = sub.add_parser("check", help="correctness of each available backend against the fp64 reference")
    p.add_argument("--backend", action="append", help="check only this backend (repeatable)")
    p.add_argument("--quick", action="store_true", help="a smaller grid")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None)
    p.set_defaults(func=cmd_check)

    def bench_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--backend", action="append", help="NAME or NAME:key=value (repeatable; default: all available)")
        p.add_argument("--grid", default="quick", help="preset (quick, tp8, tp1, mtp, fp8) or a TOML grid file")
        p.add_argument("--device", choices=["cpu", "cuda"], default=None)
        p.add_argument("--no-graph", action="store_true", help="time eager launches instead of CUDA-graph replay")
        p.add_argument("--budget", type=float, default=0.3, help="seconds of timing per backend and cell")
        p.add_argument("--csv", help="write every row to this CSV file")
        p.add_argument("--json", help="write the full report (input of `mla tune --from`) to this file")
        p.add_argument("--plot", help="draw time against kv length to this PNG (needs matplotlib)")
        p.add_argument("--no-progress", action="store_true")

    p = sub.add_parser("bench", help="time every backend side by side over a grid")
    bench_args(p)
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("tune", help="measure a grid and write allow rules that route each cell to its winner")
    bench_args(p)
    p.add_argument("--write", required=True, help="policy file to write or merge into (atomically)")
    p.add_argument("--from", dest="from_json", help="use measurements from `mla bench --json` instead of measuring")
    p.set_defaults(func=cmd_tune)
    return parser


def _cuda_quiet() -> bool:
    # explain's default device; importing torch is already paid by the core
    try:
        return _cuda()
    except Exception:
        return False


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (CLIError, MLAError) as err:
        for line in str(err).splitlines() or [""]:
            print(f"mla: error: {line}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
