"""Timing backends side by side: `mla bench`.

For each cell of a grid and each backend that can take it: check the output
against the fp64 reference first (a wrong backend is reported, never timed),
then warm up and take the median of many timed calls. On a GPU the timing
uses CUDA events and, optionally, CUDA-graph replay; every timed call
rotates over several input sets whose caches together exceed the L2, so the
numbers are HBM numbers. Ceilings (a large device copy, a large matmul) are
measured in the same run and every row reports its share of them.

The backends of a cell are timed interleaved: in rounds, each round timing a
share of every backend's calls, the order rotating from round to round, so that
a drift of the device's speed during the cell (clock, temperature) falls on
every backend alike instead of on whichever a command line names last. On the
H200 the same compute-bound kernel (B=128 H=128 bf16) measured 299.5 and 326.2
us in two processes a minute apart; in four `mla bench` runs of heavy cells,
sequential and interleaved with the backends in either order
(docs/results/gpu15_session/order_*), the H=16 cells and the H=128 fp8 cell
moved by at most 2.2% and the H=128 bf16 cell by up to 10% (in each mode):
interleaving is a fairness measure, not a measured correction. ``sequential=True`` (``mla bench
--sequential``) keeps the old order.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

from ..testing.compare import compare, only_backend_dispatcher, reference_outputs
from ..decoder import MLADecoder
from ..testing.inputs import FP8_MAX, DecodeInputs, make_inputs
from ..problem import DecodeProblem, bytes_per_element, torch_dtype

OK, WRONG, ERROR, SKIPPED = "ok", "wrong", "error", "skipped"


@dataclass(frozen=True)
class BackendSpec:
    """A backend to time, with policy options (e.g. flashinfer_mla:variant=fa2)."""

    name: str
    options: Tuple[Tuple[str, object], ...] = ()

    @property
    def label(self) -> str:
        if not self.options:
            return self.name
        return self.name + ":" + ",".join(f"{k}={_option_text(v)}" for k, v in self.options)

    @classmethod
    def parse(cls, text: str) -> "BackendSpec":
        name, _, rest = text.partition(":")
        opts = []
        for item in filter(None, rest.split(",")):
            key, eq, value = item.partition("=")
            if not eq:
                raise ValueError(f"--backend {text!r}: expected NAME or NAME:key=value[,key=value]")
            opts.append((key.strip(), _option_value(value.strip())))
        return cls(name.strip(), tuple(opts))


def _option_value(text: str) -> Union[int, bool, str]:
    """A command-line option value typed as the policy file would type it: digits an int, true/false (any case)
    a bool, else the text (backend options are strict, so "false" must arrive as False)."""
    if text.isdigit():
        return int(text)
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    return text


def _option_text(value: Union[int, bool, str]) -> str:
    """The inverse of _option_value for labels (true/false, as typed on the command line and in TOML)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


@dataclass
class Ceilings:
    copy_gbps: float
    matmul_tflops: float
    how: str


@dataclass
class BenchRow:
    backend: str
    problem: DecodeProblem
    status: str
    time_us: float = math.nan
    gbps: float = math.nan
    tflops: float = math.nan
    pct_bw: float = math.nan
    pct_flops: float = math.nan
    speedup_vs_best_other: float = math.nan
    out_rel_err: float = math.nan
    timing: str = ""
    notes: str = ""

    def as_dict(self) -> Dict[str, object]:
        d = asdict(self)
        d["problem"] = self.problem.model_dump(mode="json")
        return d


@dataclass
class BenchReport:
    rows: List[BenchRow]
    ceilings: Ceilings
    grid: str
    fingerprint: Dict[str, object] = field(default_factory=dict)
    date: str = ""


# -- cost model ---------------------------------------------------------------------


def traffic(problem: DecodeProblem, kv_lens: Sequence[int]) -> Tuple[float, float]:
    """(bytes, flops) of one decode call: each cache token read once, q read, out written once."""
    total = float(sum(kv_lens))
    rows = problem.batch_size * problem.seq_len_q * problem.num_heads
    q_bytes = rows * problem.head_dim_qk * bytes_per_element(problem.q_dtype)
    out_bytes = rows * problem.kv_lora_rank * bytes_per_element(problem.q_dtype)
    kv_bytes = total * problem.head_dim_qk * bytes_per_element(problem.kv_dtype)
    flops = 2.0 * problem.seq_len_q * problem.num_heads * (problem.head_dim_qk + problem.kv_lora_rank) * total
    return kv_bytes + q_bytes + out_bytes, flops


# -- timers --------------------------------------------------------------------------


def _samples_us(fn: Callable[[], None], repeats: int, device: str) -> List[float]:
    """Microseconds of each of `repeats` calls of fn: CUDA events on a GPU (one sync at the end), perf_counter on
    the CPU."""
    if device.startswith("cuda"):
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
        for s, e in zip(starts, ends):
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize()
        return [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)]
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return times


class GraphReplay:
    """A captured CUDA graph as a call, holding the function it was captured from. A graph reads and writes the
    addresses its kernels saw at capture: the output buffers, plan and decoder fn closes over must outlive every
    replay, or the caching allocator hands their memory to the next backend's buffers and the replays write into
    them (mlacore 0.2.2's interleaved `mla bench` dropped fn after capture: with three backends in a cell the
    replays ended in illegal-address errors on an H200)."""

    __slots__ = ("graph", "fn")

    def __init__(self, graph: Any, fn: Callable[[], None]) -> None:
        self.graph, self.fn = graph, fn

    def __call__(self) -> None:
        self.graph.replay()


def prepare_target(fn: Callable[[], None], device: str, graph: bool) -> Tuple[Callable[[], None], str]:
    """Warm fn up (compilation, allocator, plan caches) and, on a GPU with graph, capture it: (what to time, how).
    The returned target keeps fn, and with it everything the captured calls touch, alive (GraphReplay)."""
    cuda = device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    fn()
    fn()
    sync()
    if cuda and graph:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        g.replay()
        sync()
        return GraphReplay(g, fn), "cuda graph replay, cuda events"
    return fn, ("eager, cuda events" if cuda else "perf_counter")


def time_prepared_interleaved(prepared: Sequence[Tuple[Callable[[], None], str]], calls_per_fn: int, device: str,
                              budget_s: float = 0.3, min_repeats: int = 5, max_repeats: int = 200,
                              rounds: int = 8) -> List[Tuple[float, str]]:
    """Median microseconds of one call of each target (prepare_target's (what to time, how); each makes
    `calls_per_fn` calls), timed in `rounds` rounds: each round times ceil(repeats / rounds) calls of every target,
    the order rotated by one per round, so that a drift of the device's speed over the run (clocks, temperature)
    falls on every target alike. repeats per target as time_calls picks them (budget_s, min_repeats, max_repeats).
    Callers prepare each target themselves, so that a warm-up or capture failure is that target's alone."""
    per_round = [max(1, math.ceil(_repeats(target, device, budget_s, min_repeats, max_repeats) / rounds))
                 for target, _ in prepared]
    samples: List[List[float]] = [[] for _ in prepared]
    n = len(prepared)
    for r in range(rounds):
        for i in [(r + k) % n for k in range(n)]:
            samples[i].extend(_samples_us(prepared[i][0], per_round[i], device))
    return [(statistics.median(t) / calls_per_fn,
             f"{how}, median of {len(t)} x {calls_per_fn} rotating input sets, interleaved in {rounds} rounds")
            for t, (_, how) in zip(samples, prepared)]


def _repeats(target: Callable[[], None], device: str, budget_s: float, min_repeats: int, max_repeats: int) -> int:
    """How many timed calls of target fit the budget (one untimed call measures it), within the bounds."""
    t0 = time.perf_counter()
    target()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    one = max(time.perf_counter() - t0, 1e-6)
    return int(min(max_repeats, max(min_repeats, budget_s / one)))


def time_calls(fn: Callable[[], None], calls_per_fn: int, device: str, graph: bool,
               budget_s: float = 0.3, min_repeats: int = 5, max_repeats: int = 200) -> Tuple[float, str]:
    """Median microseconds of one call; fn makes `calls_per_fn` calls (one per input set)."""
    target, how = prepare_target(fn, device, graph)
    repeats = _repeats(target, device, budget_s, min_repeats, max_repeats)
    median = statistics.median(_samples_us(target, repeats, device))
    return median / calls_per_fn, f"{how}, median of {repeats} x {calls_per_fn} rotating input sets"


# -- ceilings --------------------------------------------------------------------------


def measure_ceilings(device: str) -> Ceilings:
    """Copy bandwidth (bytes read + written) and dense matmul rate on this device, now."""
    cuda = device.startswith("cuda")
    n_bytes = (1 << 30) if cuda else (64 << 20)
    src = torch.empty(n_bytes, dtype=torch.uint8, device=device)
    src.random_(0, 255)
    dst = torch.empty_like(src)
    t_copy, _ = time_calls(lambda: dst.copy_(src), 1, device, graph=False, budget_s=0.5, min_repeats=10)
    n = 8192 if cuda else 1024
    dt = torch.bfloat16 if cuda else torch.float32
    a = torch.randn(n, n, device=device, dtype=dt)
    b = torch.randn(n, n, device=device, dtype=dt)
    t_mm, _ = time_calls(lambda: a @ b, 1, device, graph=False, budget_s=0.5, min_repeats=10)
    return Ceilings(copy_gbps=2 * n_bytes / t_copy / 1e3, matmul_tflops=2 * n ** 3 / t_mm / 1e6,
                    how=f"copy of {n_bytes >> 20} MiB (read+write); {n}^3 {str(dt).replace('torch.', '')} matmul")


# -- input sets --------------------------------------------------------------------------


def _l2_bytes(device: str) -> int:
    if device.startswith("cuda"):
        return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 64 << 20))
    return 32 << 20


def input_sets(problem: DecodeProblem, device: str, seed: int, max_sets: int = 16) -> List[DecodeInputs]:
    """Set 0 is fully poisoned for the correctness check; the rest share its table and lengths."""
    first = make_inputs(problem, device=device, seed=seed)
    set_bytes = first.kv_cache.numel() * first.kv_cache.element_size()
    count = max(1, min(max_sets, math.ceil(3 * _l2_bytes(device) / max(set_bytes, 1))))
    if device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info()
        count = max(1, min(count, int(0.5 * free // max(set_bytes, 1))))
    sets = [first]
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    for _ in range(count - 1):
        cache = torch.randn(first.kv_cache.shape, generator=gen, device=device)
        if problem.kv_dtype == "fp8_e4m3":
            cache = (cache / first.kv_scale).clamp(-FP8_MAX, FP8_MAX)
        q = torch.randn(first.q.shape, generator=gen, device=device)
        sets.append(DecodeInputs(q=q.to(first.q.dtype), kv_cache=cache.to(first.kv_cache.dtype),
                                 page_table=first.page_table, kv_lens=first.kv_lens,
                                 kv_scale=first.kv_scale, sm_scale=first.sm_scale))
    return sets


# -- the bench ----------------------------------------------------------------------------


def bench_cell(problem: DecodeProblem, specs: Sequence[BackendSpec], device: str, graph: bool,
               ceilings: Ceilings, seed: int = 0, registry=None, budget_s: float = 0.3,
               sequential: bool = False) -> List[BenchRow]:
    """One cell: each backend checked against the fp64 reference, then the correct ones timed together,
    interleaved (time_prepared_interleaved), or one after the other with ``sequential``."""
    sets = input_sets(problem, device, seed)
    first = sets[0]
    lens = first.kv_lens.cpu().tolist()
    n_bytes, n_flops = traffic(problem, lens)
    ref_out, ref_lse = reference_outputs(problem, first)
    rows: List[BenchRow] = []
    # prepared for the interleaved rounds: (row, its open decoder, what to time, how); closed in the finally
    timed: List[Tuple[BenchRow, MLADecoder, Callable[[], None], str]] = []
    try:
        for spec in specs:
            row = BenchRow(spec.label, problem, SKIPPED)
            rows.append(row)
            dispatcher = only_backend_dispatcher(spec.name, registry, dict(spec.options))
            decision = dispatcher.explain(problem)
            if decision.backend != spec.name:
                row.notes = "; ".join(decision.verdict(spec.name).reasons) or decision.verdict(spec.name).outcome
                continue
            decoder = None
            try:
                capturable = dispatcher.backend(spec.name).info().graph_capturable
                use_graph = graph and capturable
                envelope = (dict(max_batch=problem.batch_size, max_kv_len=max(1, problem.max_kv_len))
                            if use_graph else {})
                decoder = MLADecoder(problem.num_heads, problem.page_size, q_dtype=torch_dtype(problem.q_dtype),
                                     kv_dtype=torch_dtype(problem.kv_dtype), device=device,
                                     sm_scale=first.sm_scale, kv_scale=first.kv_scale, causal=problem.causal,
                                     dispatcher=dispatcher, cuda_graph=use_graph, **envelope)
                plan = decoder.plan(first.kv_lens, first.page_table, problem.seq_len_q)
                out = torch.full((*first.q.shape[:3], problem.kv_lora_rank), float("nan"), dtype=first.q.dtype,
                                 device=device)
                lse = torch.full(first.q.shape[:3], float("nan"), dtype=torch.float32, device=device)
                decoder.run(first.q, first.kv_cache, plan, out=out, lse=lse)
                verdict = compare(problem, out, lse, ref_out, ref_lse)
                row.out_rel_err = verdict.out_rel_err
                if not verdict.passed:
                    row.status, row.notes = WRONG, "; ".join(verdict.messages)
                    continue

                def calls(decoder=decoder, plan=plan, out=out, lse=lse) -> None:
                    for s in sets:
                        decoder.run(s.q, s.kv_cache, plan, out=out, lse=lse)

                if sequential:
                    row.time_us, row.timing = time_calls(calls, len(sets), device, use_graph, budget_s)
                    _mark_ok(row, n_bytes, n_flops, ceilings)
                else:
                    # warm-up and capture here, so that a failure is this backend's alone
                    target, how = prepare_target(calls, device, use_graph)
                    timed.append((row, decoder, target, how))
                    decoder = None  # closed with `timed`
            except Exception as exc:  # report the backend's failure, keep benchmarking the rest
                row.status, row.notes = ERROR, f"{type(exc).__name__}: {exc}"
            finally:
                if decoder is not None:
                    decoder.close()
        if timed:
            try:
                results = time_prepared_interleaved([(t, h) for _, _, t, h in timed], len(sets), device,
                                                    budget_s=budget_s)
                for (row, _, _, _), (t, how) in zip(timed, results):
                    row.time_us, row.timing = t, how
                    _mark_ok(row, n_bytes, n_flops, ceilings)
            except Exception as exc:  # a replay failing inside the rounds: no backend's time is trustworthy
                for row, _, _, _ in timed:
                    row.status, row.notes = ERROR, f"{type(exc).__name__} while timing interleaved: {exc}"
    finally:
        for _, decoder, _, _ in timed:
            decoder.close()
    ok = [r for r in rows if r.status == OK]
    for r in ok:
        others = [o.time_us for o in ok if o is not r]
        if others:
            r.speedup_vs_best_other = min(others) / r.time_us
    return rows


def _mark_ok(row: BenchRow, n_bytes: float, n_flops: float, ceilings: Ceilings) -> None:
    """A timed row: status ok, its GB/s and TFLOP/s and their shares of the run's ceilings."""
    row.status = OK
    row.gbps = n_bytes / row.time_us / 1e3
    row.tflops = n_flops / row.time_us / 1e6
    row.pct_bw = 100.0 * row.gbps / ceilings.copy_gbps
    row.pct_flops = 100.0 * row.tflops / ceilings.matmul_tflops


def run_bench(problems: Sequence[DecodeProblem], specs: Sequence[BackendSpec], device: str, graph: bool,
              grid_name: str, registry=None, progress: bool = True, budget_s: float = 0.3,
              on_cell: Optional[Callable[[BenchReport], None]] = None, sequential: bool = False) -> BenchReport:
    """Every cell of `problems` with every backend of `specs`. on_cell: called after each cell but the last with
    the report so far, its grid named "... (partial: k of n cells)", so that a caller can save it (`mla bench -o`
    does): a run cut by a time limit then keeps what it measured, marked as incomplete."""
    from .fingerprint import current_fingerprint

    ceilings = measure_ceilings(device)
    fingerprint = current_fingerprint()
    rows: List[BenchRow] = []

    def cell(i: int, p: DecodeProblem) -> None:
        rows.extend(bench_cell(p, specs, device, graph, ceilings, seed=i, registry=registry, budget_s=budget_s,
                               sequential=sequential))
        if on_cell is not None and i + 1 < len(problems):
            on_cell(BenchReport(list(rows), ceilings, f"{grid_name} (partial: {i + 1} of {len(problems)} cells)",
                                fingerprint, time.strftime("%Y-%m-%d")))

    if progress:
        from rich.progress import Progress

        with Progress(transient=True) as bar:
            task = bar.add_task("mla bench", total=len(problems))
            for i, p in enumerate(problems):
                cell(i, p)
                bar.advance(task)
    else:
        for i, p in enumerate(problems):
            cell(i, p)
    return BenchReport(rows, ceilings, grid_name, fingerprint, time.strftime("%Y-%m-%d"))


# -- output ------------------------------------------------------------------------------

CSV_COLUMNS = ("backend", "num_heads", "seq_len_q", "batch_size", "min_kv_len", "max_kv_len", "page_size",
               "q_dtype", "kv_dtype", "status", "time_us", "gbps", "tflops", "pct_bw", "pct_flops",
               "speedup_vs_best_other", "out_rel_err", "timing", "notes")


def flat_row(row: BenchRow) -> Dict[str, object]:
    p = row.problem
    d = {k: getattr(p, k) for k in ("num_heads", "seq_len_q", "batch_size", "min_kv_len", "max_kv_len",
                                    "page_size", "q_dtype", "kv_dtype")}
    d.update({k: getattr(row, k) for k in ("backend", "status", "time_us", "gbps", "tflops", "pct_bw",
                                            "pct_flops", "speedup_vs_best_other", "out_rel_err", "timing",
                                            "notes")})
    return {k: d[k] for k in CSV_COLUMNS}


def write_csv(report: BenchReport, path: str) -> None:
    import csv

    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=CSV_COLUMNS)
        w.writeheader()
        for r in report.rows:
            w.writerow(flat_row(r))


def report_json(report: BenchReport) -> Dict[str, object]:
    return {"grid": report.grid, "date": report.date, "fingerprint": report.fingerprint,
            "ceilings": asdict(report.ceilings), "rows": [r.as_dict() for r in report.rows]}


def report_from_json(data: Dict[str, object]) -> BenchReport:
    rows = []
    floats = {f.name for f in fields(BenchRow) if f.type in (float, "float")}
    for r in data["rows"]:
        r = dict(r)
        r["problem"] = DecodeProblem.model_validate(r["problem"])
        for k in floats & set(r):
            if r[k] is None:  # standard JSON writes NaN as null
                r[k] = math.nan
        rows.append(BenchRow(**r))
    return BenchReport(rows, Ceilings(**data["ceilings"]), data["grid"], dict(data.get("fingerprint", {})),
                       str(data.get("date", "")))


def plot(report: BenchReport, path: str) -> None:
    """Time against kv length (one panel per heads/batch/s_q/dtype group), one line per backend."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("--plot needs matplotlib (pip install 'mlacore[plot]')") from None
    groups: Dict[tuple, Dict[str, List[Tuple[int, float]]]] = {}
    for r in report.rows:
        if r.status != OK:
            continue
        p = r.problem
        key = (p.num_heads, p.seq_len_q, p.batch_size, p.kv_dtype, p.page_size)
        groups.setdefault(key, {}).setdefault(r.backend, []).append((p.max_kv_len, r.time_us))
    n = max(1, len(groups))
    cols = min(4, n)
    rows_n = math.ceil(n / cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(4.2 * cols, 3.2 * rows_n), squeeze=False)
    for ax, (key, lines) in zip(axes.flat, sorted(groups.items())):
        for backend, pts in sorted(lines.items()):
            pts.sort()
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=backend)
        h, s_q, b, kvd, page = key
        ax.set_title(f"H={h} s_q={s_q} B={b} kv={kvd} page={page}", fontsize=8)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("kv length")
        ax.set_ylabel("us")
        ax.legend(fontsize=6)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.suptitle(f"mla bench ({report.grid.split(':')[0]}, {report.fingerprint.get('gpu', '')}); ceilings "
                 f"{report.ceilings.copy_gbps:.0f} GB/s, {report.ceilings.matmul_tflops:.0f} TFLOP/s", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    fig.savefig(path, dpi=110)
    plt.close(fig)
