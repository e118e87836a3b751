"""mla bench arithmetic and guards; mla tune rule building, routing, merging, determinism."""

import json
import math
import re
import subprocess
import sys

import pytest

from mlacore.tools.bench import (BackendSpec, BenchReport, BenchRow, Ceilings, CSV_COLUMNS, bench_cell, report_from_json,
                           report_json, run_bench, traffic, write_csv)
from mlacore.tools.grid import PRESETS, load_grid
from mlacore.policy import PolicyError, parse_policy_text
from mlacore.problem import DecodeProblem, DeviceSpec
from mlacore.tools.tune import GROUP_TIE, TIE, build_rules, routes, tune, winners, write_atomically
from mla_test_helpers import subprocess_env

CPU = DeviceSpec(type="cpu")
CEIL = Ceilings(copy_gbps=100.0, matmul_tflops=2.0, how="test")


def test_traffic_against_hand_calculation():
    p = DecodeProblem(num_heads=16, seq_len_q=2, batch_size=2, max_kv_len=100, min_kv_len=50, page_size=16,
                      kv_dtype="fp8_e4m3")
    n_bytes, flops = traffic(p, [100, 50])
    rows = 2 * 2 * 16
    assert n_bytes == 150 * 576 * 1 + rows * 576 * 2 + rows * 512 * 2
    assert flops == 2 * 2 * 16 * (576 + 512) * 150


def test_bench_row_arithmetic_and_wrong_answer_guard(with_plugins):
    from mlacore import BackendRegistry

    reg = BackendRegistry(env={}).load()
    p = DecodeProblem(num_heads=16, seq_len_q=1, batch_size=2, max_kv_len=40, min_kv_len=40, page_size=16,
                      device=CPU)
    rows = bench_cell(p, [BackendSpec("reference"), BackendSpec("drops_last_token"),
                          BackendSpec("chunked_reference", (("chunk_tokens", 32),))], "cpu", graph=False,
                      ceilings=CEIL, registry=reg, budget_s=0.02)
    by = {r.backend: r for r in rows}
    ref = by["reference"]
    assert ref.status == "ok" and ref.time_us > 0
    n_bytes, flops = traffic(p, [40, 40])
    assert ref.gbps == pytest.approx(n_bytes / ref.time_us / 1e3)
    assert ref.tflops == pytest.approx(flops / ref.time_us / 1e6)
    assert ref.pct_bw == pytest.approx(100 * ref.gbps / CEIL.copy_gbps)
    wrong = by["drops_last_token"]
    assert wrong.status == "wrong" and math.isnan(wrong.time_us)
    assert "relative error" in wrong.notes
    chunked = by["chunked_reference:chunk_tokens=32"]
    assert chunked.status == "ok"
    assert ref.speedup_vs_best_other == pytest.approx(chunked.time_us / ref.time_us)


def test_interleaved_timing_rotates_the_order_and_keeps_each_fns_time():
    """time_prepared_interleaved: every round times a block of each fn, the first fn of a round rotates, and each
    median is that fn's own time (a slow fn does not leak into a fast one's samples)."""
    import time as _time

    from mlacore.tools.bench import prepare_target, time_prepared_interleaved

    log = []

    def slow():
        log.append("s")
        _time.sleep(0.004)

    def fast():
        log.append("f")
        _time.sleep(0.0005)

    prepared = [prepare_target(fn, "cpu", False) for fn in (slow, fast)]
    (t_slow, how_slow), (t_fast, how_fast) = time_prepared_interleaved(prepared, 1, "cpu", budget_s=0.02,
                                                                       min_repeats=8, rounds=4)
    assert t_slow > 3000 and t_fast < 2000 and t_slow / t_fast > 3
    assert "interleaved in 4 rounds" in how_slow and "interleaved in 4 rounds" in how_fast
    assert "".join(log[:6]) == "ssffsf"  # 2 warm-up calls each, then 1 sizing call each
    timed = "".join(log[6:])
    k = timed.count("f") // 4  # fast's calls per round (from its measured time); slow's: ceil(8 / 4) = 2
    assert k >= 2 and timed.count("f") == 4 * k and timed.count("s") == 8
    # rounds s f | f s | s f | f s: round r starts with fn r % 2, each fn one block per round
    assert timed == "ss" + "f" * k + "f" * k + "ss" + "ss" + "f" * k + "f" * k + "ss"


def test_bench_cell_times_interleaved_unless_sequential(with_plugins):
    from mlacore import BackendRegistry

    reg = BackendRegistry(env={}).load()
    p = DecodeProblem(num_heads=16, seq_len_q=1, batch_size=1, max_kv_len=32, min_kv_len=32, page_size=16,
                      device=CPU)
    specs = [BackendSpec("reference"), BackendSpec("chunked_reference", (("chunk_tokens", 16),))]
    inter = bench_cell(p, specs, "cpu", False, CEIL, registry=reg, budget_s=0.01)
    seq = bench_cell(p, specs, "cpu", False, CEIL, registry=reg, budget_s=0.01, sequential=True)
    assert [r.status for r in inter] == ["ok", "ok"] and [r.status for r in seq] == ["ok", "ok"]
    assert all("interleaved" in r.timing for r in inter)
    assert not any("interleaved" in r.timing for r in seq)
    assert all(r.time_us > 0 and r.gbps > 0 for r in inter + seq)


def test_a_warm_up_failure_is_one_backends_error_and_every_decoder_closes(with_plugins, monkeypatch):
    """Interleaved timing prepares (warms up, captures) each backend where it is checked: a failure there marks that
    backend's row only, the others are still timed, and every decoder the cell opened is closed."""
    import mlacore.tools.bench as bench_mod
    from mlacore import BackendRegistry

    reg = BackendRegistry(env={}).load()
    p = DecodeProblem(num_heads=16, seq_len_q=1, batch_size=1, max_kv_len=32, min_kv_len=32, page_size=16,
                      device=CPU)
    real_prepare = bench_mod.prepare_target
    prepared = []

    def second_fails(fn, device, graph):
        prepared.append(fn)
        if len(prepared) == 2:
            raise RuntimeError("capture failed on purpose")
        return real_prepare(fn, device, graph)

    closed = []
    real_close = bench_mod.MLADecoder.close

    def counting_close(self):
        closed.append(self)
        return real_close(self)

    monkeypatch.setattr(bench_mod, "prepare_target", second_fails)
    monkeypatch.setattr(bench_mod.MLADecoder, "close", counting_close)
    specs = [BackendSpec("reference"), BackendSpec("chunked_reference", (("chunk_tokens", 16),)),
             BackendSpec("chunked_reference", (("chunk_tokens", 8),))]
    rows = bench_cell(p, specs, "cpu", False, CEIL, registry=reg, budget_s=0.01)
    assert [r.status for r in rows] == ["ok", "error", "ok"]
    assert "capture failed on purpose" in rows[1].notes and "interleaved" not in rows[1].notes
    assert rows[0].time_us > 0 and rows[2].time_us > 0
    assert len(closed) == 3 and len(set(map(id, closed))) == 3


def test_bench_skips_what_a_backend_cannot_take(with_plugins):
    from mlacore import BackendRegistry

    reg = BackendRegistry(env={}).load()
    p = DecodeProblem(num_heads=8, batch_size=1, max_kv_len=64, min_kv_len=64, page_size=16, device=CPU)
    rows = bench_cell(p, [BackendSpec("chunked_reference")], "cpu", False, CEIL, registry=reg, budget_s=0.01)
    assert rows[0].status == "skipped" and "num_heads=8 not in {16, 128}" in rows[0].notes


def test_csv_and_json_round_trip(tmp_path):
    p = DecodeProblem(num_heads=16, batch_size=1, max_kv_len=64, page_size=16, device=CPU)
    report = BenchReport([BenchRow("reference", p, "ok", time_us=10.0, gbps=1.0)], CEIL, "g",
                         {"gpu": "cpu"}, "2026-11-29")
    write_csv(report, tmp_path / "r.csv")
    header = (tmp_path / "r.csv").read_text().splitlines()[0].split(",")
    assert tuple(header) == CSV_COLUMNS
    again = report_from_json(json.loads(json.dumps(report_json(report))))
    assert again.rows[0].problem == p and again.rows[0].time_us == 10.0


def test_grid_files_and_presets(tmp_path):
    assert set(PRESETS) == {"quick", "tp8", "tp1", "mtp", "fp8"}
    f = tmp_path / "g.toml"
    f.write_text("[grid]\nnum_heads=[16,128]\nbatch=[1,8]\nkv_len=[100]\nkv_spread=0.5\n")
    g = load_grid(str(f))
    cells = g.problems(CPU)
    assert len(cells) == 4
    assert {(c.min_kv_len, c.max_kv_len) for c in cells if c.batch_size == 8} == {(50, 100)}
    f.write_text("[grid]\nnum_head=[16]\n")
    with pytest.raises(PolicyError, match="grid.num_head: unknown key"):
        load_grid(str(f))
    with pytest.raises(PolicyError, match="neither a preset"):
        load_grid("nope")


def synthetic_report():
    """A wins small batches, B wins large ones, C wins one odd cell, D is wrong where it is fast."""
    rows = []
    for h in (16, 128):
        for b in (1, 8, 32, 128):
            for n in (1024, 4096, 16384):
                p = DecodeProblem(num_heads=h, batch_size=b, max_kv_len=n, min_kv_len=n, page_size=64, device=CPU)
                ta = 10.0 + b * 0.5
                tb = 20.0 + b * 0.1
                tc = 5.0 if (h, b, n) == (128, 8, 4096) else 100.0
                rows.append(BenchRow("A", p, "ok", time_us=ta))
                rows.append(BenchRow("B", p, "ok", time_us=tb))
                rows.append(BenchRow("C", p, "ok" if h == 128 else "skipped", time_us=tc if h == 128 else math.nan))
                rows.append(BenchRow("D", p, "wrong"))
    return BenchReport(rows, CEIL, "synthetic", {"gpu": "TestGPU", "capability": "9.0", "driver": "1.0",
                                                 "torch": "2.x", "backends": {"A": "1", "B": "2", "C": "3"}},
                       "2026-11-29")


def test_tune_routes_every_cell_to_its_winner():
    report = synthetic_report()
    order, rules, default = build_rules(report)
    win = winners(report)
    picks = routes(order, rules, report)
    assert all(picks[c] == w for c, w in win.items())
    assert default == "B" or default == "A"
    assert "D" not in order  # never fastest-and-correct
    # readable: a handful of rules, not one per cell
    assert sum(len(r) for r in rules.values()) <= 4, rules


def test_tune_writes_merges_and_is_deterministic(tmp_path):
    base = """# my policy
[mla]
order = ["flashinfer_mla", "reference"]
fallback = "error"   # keep this

[backend.flashinfer_mla.options]
variant = "fa3"
"""
    report = synthetic_report()
    text1, cells = tune(report, tmp_path / "mla.toml", base, "boxes")
    text2, _ = tune(report, tmp_path / "mla.toml", base, "boxes")
    assert text1 == text2
    assert "# my policy" in text1 and "# keep this" in text1 and 'variant = "fa3"' in text1
    pol = parse_policy_text(text1)
    assert pol.mla.fallback == "error"
    assert pol.mla.order[-2:] == ("flashinfer_mla", "reference")
    assert pol.tuned.gpu == "TestGPU" and pol.tuned.backends == {"A": "1", "B": "2", "C": "3"}
    assert all(w == r for w, r in cells.values())
    # and the real dispatcher, reading the file, agrees cell by cell
    from mlacore import BackendRegistry, Dispatcher
    from support_backends import register_named_backends

    reg = register_named_backends(BackendRegistry(env={"MLA_DISABLE_PLUGIN_AUTOLOAD": "1"}).load(),
                                  {"A": None, "B": None, "C": lambda p: p.num_heads != 128, "D": None})
    text_no_fi = text1.replace('"flashinfer_mla", ', "")
    disp = Dispatcher(policy=parse_policy_text(text_no_fi), registry=reg, env={})
    for r in report.rows:
        if r.backend == "A":
            assert disp.select(r.problem).backend == win_for(report, r.problem)


def win_for(report, problem):
    return winners(report)[(problem.num_heads, problem.seq_len_q, problem.q_dtype, problem.kv_dtype,
                            problem.page_size, problem.batch_size, problem.max_kv_len)]


def test_atomic_write(tmp_path):
    path = tmp_path / "mla.toml"
    path.write_text("old")
    write_atomically(path, "new")
    assert path.read_text() == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["mla.toml"]


def test_policy_check_warns_on_fingerprint_mismatch(tmp_path):
    clean = '[mla]\norder = ["reference"]\n[tuned]\ngpu = "TestGPU"\ncapability = "9.0"\ntorch = "2.x"\n'
    p = tmp_path / "t.toml"
    p.write_text(clean)
    proc = subprocess.run([sys.executable, "-m", "mlacore", "policy", "check", str(p)], capture_output=True,
                          text=True, env=subprocess_env(), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "warning" in proc.stdout and "tuned on gpu='TestGPU'" in proc.stdout


def test_cli_tune_end_to_end_on_cpu(plugin_site, tmp_path):
    """Measure reference vs chunked_reference on CPU, write the policy, then explain picks the winners."""
    grid = tmp_path / "g.toml"
    grid.write_text("[grid]\nnum_heads=[16]\nbatch=[1]\nkv_len=[64, 4096]\npage_size=[64]\n")
    pol = tmp_path / "mla.toml"
    pol.write_text('[mla]\norder = ["reference"]\n[backend.reference.options]\nchunk_tokens = 4096\n')
    out_json = tmp_path / "m.json"
    env = subprocess_env(plugin_site)
    proc = subprocess.run([sys.executable, "-m", "mlacore", "tune", "--grid", str(grid), "--backend", "reference",
                           "--backend", "chunked_reference", "--write", str(pol), "-o", str(out_json),
                           "--budget", "0.05", "--no-progress", "--device", "cpu", "--rules", "boxes"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    within = re.search(r"routed within ([0-9.]+)% of the fastest", proc.stdout)
    assert within and float(within.group(1)) <= 100 * GROUP_TIE, proc.stdout  # a group's near-tie: one arm
    text = pol.read_text()
    assert "chunk_tokens = 4096" in text and "[tuned]" in text
    # same measurements in, same file out
    pol2 = tmp_path / "again.toml"
    pol2.write_text('[mla]\norder = ["reference"]\n[backend.reference.options]\nchunk_tokens = 4096\n')
    proc = subprocess.run([sys.executable, "-m", "mlacore", "tune", "--from", str(out_json), "--write", str(pol2),
                           "--rules", "boxes"], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert pol2.read_text() == text


def test_tune_routes_variants_of_one_backend_with_rule_options(tmp_path):
    """X:variant=a wins small batches, X:variant=b large ones, Y one cell: options ride on the rules."""
    rows = []
    for b in (1, 8, 64):
        for n in (1024, 8192):
            p = DecodeProblem(num_heads=16, batch_size=b, max_kv_len=n, min_kv_len=n, page_size=64, device=CPU)
            rows.append(BenchRow("X:variant=a", p, "ok", time_us=1.0 + b))
            rows.append(BenchRow("X:variant=b", p, "ok", time_us=9.0 + b / 10))
            rows.append(BenchRow("Y", p, "ok", time_us=0.5 if (b, n) == (8, 8192) else 99.0))
    report = BenchReport(rows, CEIL, "variants", {"gpu": "G"}, "2026-11-29")
    order, rules, default = build_rules(report)
    assert order == ["Y", "X"]
    picks = routes(order, rules, report)
    assert picks == winners(report)
    assert any(r.get("options") == {"variant": "a"} for r in rules["X"])
    text, _ = tune(report, tmp_path / "p.toml", '[mla]\norder = ["reference"]\n', "boxes")
    pol = parse_policy_text(text)
    from typing import Literal

    from mlacore import BackendOptions, BackendRegistry, Dispatcher
    from support_backends import register_named_backends

    class VariantOptions(BackendOptions):
        variant: Literal["a", "b"] = "b"

    reg = register_named_backends(BackendRegistry(env={"MLA_DISABLE_PLUGIN_AUTOLOAD": "1"}).load(),
                                  {"X": None, "Y": None}, options_model=VariantOptions)
    disp = Dispatcher(policy=pol, registry=reg, env={})
    for r in rows[::3]:
        decision = disp.select(r.problem)
        want = winners(report)[(16, 1, "bf16", "bf16", 64, r.problem.batch_size, r.problem.max_kv_len)]
        name, _, opt = want.partition(":")
        assert decision.backend == name
        if opt:
            assert decision.options_dict() == {"variant": opt.split("=")[1]}


# -- rules hold where they were measured ------------------------------------------------


def _grid_report(times, heads=(16,), batches=(1, 16, 128), lens=(1024, 16384), name="g"):
    """times(arm, h, b, n) -> microseconds (None: the arm cannot take the cell)."""
    rows = []
    for h in heads:
        for b in batches:
            for n in lens:
                p = DecodeProblem(num_heads=h, batch_size=b, max_kv_len=n, min_kv_len=n, page_size=64, device=CPU)
                for arm in ("fa2", "fa3"):
                    t = times(arm, h, b, n)
                    label = f"X:variant={arm}"
                    rows.append(BenchRow(label, p, "skipped") if t is None else BenchRow(label, p, "ok", time_us=t))
    return BenchReport(rows, CEIL, name, {"gpu": "G"}, "2026-12-01")


def _problem(b, n, h=16):
    return DecodeProblem(num_heads=h, batch_size=b, max_kv_len=n, min_kv_len=n, page_size=64, device=CPU)


def _route(text, problem):
    from mlacore.tools.tune import route_cells

    pol = parse_policy_text(text)
    report = BenchReport([BenchRow(f"X:variant={a}", problem, "ok", time_us=1.0) for a in ("fa2", "fa3")],
                         CEIL, "probe", {}, "")
    order = [n for n in pol.mla.order]
    return next(iter(route_cells(order, pol, report).values()))


def test_boundaries_sit_at_geometric_midpoints():
    from mlacore.tools.tune import split_point

    assert split_point(1, 16) == 4 and split_point(16, 128) == 45 and split_point(1, 2) == 1
    assert split_point(1024, 16384) == 4096
    # fa2 wins batch 1 only (every length), fa3 from 16 up: B=8 lies past the midpoint (4), so fa3
    report = _grid_report(lambda arm, h, b, n: (1.0 if arm == "fa2" else 2.0) if b == 1 else
                          (2.0 if arm == "fa2" else 1.0))
    text, _ = tune(report, "p.toml", '[mla]\norder = ["reference"]\n', "boxes")
    rules = parse_policy_text(text).backend["X"].allow
    fa2 = [r for r in rules if r.options == {"variant": "fa2"}]
    assert len(fa2) == 1 and fa2[0].max_batch == 4 and fa2[0].min_batch is None
    assert _route(text, _problem(4, 4096)) == "X:variant=fa2"
    assert _route(text, _problem(8, 4096)) == "X:variant=fa3"
    assert _route(text, _problem(5, 4096)) == "X:variant=fa3"


def test_rules_reach_past_the_grid_only_along_their_own_measured_edge():
    # fa2 wins the middle batch only at the short length: between grid points its batch bounds sit at the
    # midpoints; past the short-length edge of the grid it reaches (its own edge cell is fa2's), past the
    # batch edges it cannot (16 is not an edge)
    report = _grid_report(lambda arm, h, b, n: (1.0 if arm == "fa2" else 2.0) if (b == 16 and n == 1024) else
                          (2.0 if arm == "fa2" else 1.0))
    text, _ = tune(report, "p.toml", '[mla]\norder = ["reference"]\n', "boxes")
    fa2 = [r for r in parse_policy_text(text).backend["X"].allow if r.options == {"variant": "fa2"}]
    assert len(fa2) == 1
    rule = fa2[0]
    assert rule.min_batch == 5 and rule.max_batch == 45  # midpoints of 1|16 and 16|128
    assert rule.min_kv_len is None and rule.max_kv_len == 4096  # below 1024: its edge; above: the midpoint
    assert _route(text, _problem(16, 512)) == "X:variant=fa2"  # beyond the grid, next to its measured edge cell
    assert _route(text, _problem(16, 1024)) == "X:variant=fa2"
    assert _route(text, _problem(512, 1024)) == "X:variant=fa3"  # beyond the batch edge: not fa2's evidence
    assert _route(text, _problem(16, 65536)) == "X:variant=fa3"
    # fa2 wins the largest batch at every length: the rule reaches past batch 128 (a measured trend)
    report = _grid_report(lambda arm, h, b, n: (1.0 if arm == "fa2" else 2.0) if b == 128 else
                          (2.0 if arm == "fa2" else 1.0))
    text, _ = tune(report, "p.toml", '[mla]\norder = ["reference"]\n', "boxes")
    fa2 = [r for r in parse_policy_text(text).backend["X"].allow if r.options == {"variant": "fa2"}]
    assert fa2[0].max_batch is None and fa2[0].min_batch == 46
    assert _route(text, _problem(512, 1024)) == "X:variant=fa2"
    # fa2 wins only the largest batch at the short length: past batch 128 it reaches at short lengths only
    report = _grid_report(lambda arm, h, b, n: (1.0 if arm == "fa2" else 2.0) if (b == 128 and n == 1024) else
                          (2.0 if arm == "fa2" else 1.0))
    text, _ = tune(report, "p.toml", '[mla]\norder = ["reference"]\n', "boxes")
    assert _route(text, _problem(512, 1024)) == "X:variant=fa2"
    assert _route(text, _problem(512, 16384)) == "X:variant=fa3"


def test_rules_keep_the_head_counts_they_were_measured_on():
    report = _grid_report(lambda arm, h, b, n: (1.0 if arm == "fa2" else 2.0) if b == 1 else
                          (2.0 if arm == "fa2" else 1.0), heads=(16, 128))
    text, _ = tune(report, "p.toml", '[mla]\norder = ["reference"]\n', "boxes")
    fa2 = [r for r in parse_policy_text(text).backend["X"].allow if r.options == {"variant": "fa2"}]
    assert len(fa2) == 1 and set(fa2[0].num_heads) == {16, 128}
    assert _route(text, _problem(1, 4096, h=64)) == "X:variant=fa3"  # H=64 was not measured: the default


# -- validation ------------------------------------------------------------------------


def _fa_times(arm, h, b, n):
    """fa2 wins small batches (below ~8), fa3 larger ones: a crossover between grid points 1 and 16."""
    fa2 = 10.0 + 1.0 * b
    fa3 = 14.0 + 0.5 * b
    return fa2 if arm == "fa2" else fa3


def test_validate_reports_mean_and_worst_regret_on_a_second_grid():
    from mlacore.tools.tune import record_validation, validate

    tune_report = _grid_report(_fa_times)
    text, _ = tune(tune_report, "p.toml", '[mla]\norder = ["reference"]\n', "boxes")
    val = _grid_report(_fa_times, batches=(2, 4, 8, 32, 256), lens=(2048, 4096, 8192), name="off-grid")
    result = validate(parse_policy_text(text), val)
    assert len(result.cells) == 15 and not result.failures
    by_b = {}
    for c in result.cells:
        by_b.setdefault(c.problem.batch_size, set()).add(round(c.regret, 6))
    # B=2,4 go to fa2 (right: 12 < 15, 14 < 16); B=8 to fa3 (18 vs 18: a tie); beyond the grid: fa3
    assert by_b[2] == {0.0} and by_b[4] == {0.0} and by_b[8] == {0.0} and by_b[256] == {0.0}
    assert result.worst_regret == 0.0 and result.mean_regret == 0.0
    # a policy that sends everything to fa2 has regret where fa3 wins, and the worst cell shows it
    bad = '[mla]\norder = ["X"]\n[backend.X.options]\nvariant = "fa2"\n'
    result = validate(parse_policy_text(bad), val)
    worst = result.worst(3)
    assert worst[0].problem.batch_size == 256 and worst[0].routed == "X:variant=fa2"
    assert worst[0].regret == pytest.approx((10 + 256) / (14 + 128) - 1)
    assert result.mean_regret == pytest.approx(statistics_mean(result))
    summary = result.summary(3)
    assert summary["cells"] == 15 and summary["failed_cells"] == 0 and len(summary["worst"]) == 3
    assert summary["worst_regret"] == round(worst[0].regret, 4)
    # recorded next to the fingerprint, and the file still loads
    new = record_validation(text, summary)
    pol = parse_policy_text(new)
    assert pol.tuned.gpu == "G" and pol.tuned.validation["grid"] == "off-grid"
    assert pol.tuned.validation["worst"][0]["routed"] == "X:variant=fa2"
    assert new.startswith(text.split("[tuned]")[0])  # rules untouched


def statistics_mean(result):
    vals = [c.regret for c in result.cells]
    return sum(vals) / len(vals)


def test_validate_flags_cells_routed_to_a_wrong_or_missing_arm():
    from mlacore.tools.tune import validate

    p = _problem(8, 4096)
    rows = [BenchRow("X:variant=fa2", p, "wrong"), BenchRow("X:variant=fa3", p, "ok", time_us=5.0)]
    report = BenchReport(rows, CEIL, "v", {}, "")
    pol = parse_policy_text('[mla]\norder = ["X"]\n[backend.X.options]\nvariant = "fa2"\n')
    result = validate(pol, report)
    assert result.failures and result.failures[0].note == "the routed arm is wrong here"
    assert result.summary()["failed_cells"] == 1 and "regret" not in result.summary()["worst"][0]


def test_cli_tune_validate_from_measurements(tmp_path):
    from mlacore.tools.bench import report_json

    tune_json, val_json = tmp_path / "t.json", tmp_path / "v.json"
    tune_json.write_text(json.dumps(report_json(_grid_report(_fa_times))))
    val_json.write_text(json.dumps(report_json(_grid_report(_fa_times, batches=(2, 8, 256), lens=(4096,),
                                                            name="off-grid"))))
    pol = tmp_path / "mla.toml"
    pol.write_text('[mla]\norder = ["reference"]\n')
    proc = subprocess.run([sys.executable, "-m", "mlacore", "tune", "--from", str(tune_json), "--write", str(pol),
                           "--validate-from", str(val_json)], capture_output=True, text=True,
                          env=subprocess_env(), timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "validation on 3 cells: mean regret 0.00%, worst 0.0%" in proc.stdout
    assert "[tuned.validation]" in pol.read_text()
    v = parse_policy_text(pol.read_text()).tuned.validation
    assert v["cells"] == 3 and v["worst_regret"] == 0.0
    # --json: JSON only on stdout, with the validation
    pol.write_text('[mla]\norder = ["reference"]\n')
    proc = subprocess.run([sys.executable, "-m", "mlacore", "tune", "--from", str(tune_json), "--write", str(pol),
                           "--validate-from", str(val_json), "--json"], capture_output=True, text=True,
                          env=subprocess_env(), timeout=120)
    data = json.loads(proc.stdout)
    assert data["validation"]["cell_count"] == 3 and len(data["validation"]["cells"]) == 3


def test_cli_tune_validate_end_to_end_on_cpu(plugin_site, tmp_path):
    """Measure, write, then time the written policy on a second grid: reference backends on CPU."""
    grid = tmp_path / "g.toml"
    grid.write_text("[grid]\nnum_heads=[16]\nbatch=[1]\nkv_len=[64, 1024]\npage_size=[64]\n")
    vgrid = tmp_path / "v.toml"
    vgrid.write_text("[grid]\nnum_heads=[16]\nbatch=[2]\nkv_len=[256]\npage_size=[64]\n")
    pol = tmp_path / "mla.toml"
    pol.write_text('[mla]\norder = ["reference"]\n')
    proc = subprocess.run([sys.executable, "-m", "mlacore", "tune", "--grid", str(grid), "--backend", "reference",
                           "--backend", "chunked_reference", "--write", str(pol), "--validate", str(vgrid),
                           "--validate-output", str(tmp_path / "vm.json"), "--budget", "0.02", "--no-progress",
                           "--device", "cpu"], capture_output=True, text=True, env=subprocess_env(plugin_site),
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "validation on 1 cells" in proc.stdout
    v = parse_policy_text(pol.read_text()).tuned.validation
    assert v["cells"] == 1 and v["failed_cells"] == 0 and "mean_regret" in v
    vm = json.loads((tmp_path / "vm.json").read_text())
    assert {r["backend"] for r in vm["rows"]} == {"reference", "chunked_reference"}


# -- the tuned file is written safely ----------------------------------------------------


def test_atomic_write_keeps_mode_follows_symlinks_and_fsyncs(tmp_path, monkeypatch):
    import os

    real = tmp_path / "real.toml"
    real.write_text("old")
    os.chmod(real, 0o640)
    link = tmp_path / "mla.toml"
    link.symlink_to(real)
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd))[1])
    write_atomically(link, "new")
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert real.read_text() == "new" and (real.stat().st_mode & 0o777) == 0o640
    assert len(synced) >= 1  # the data before the rename (and the directory after it)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mla.toml", "real.toml"]
    fresh = tmp_path / "fresh.toml"
    write_atomically(fresh, "x")
    umask = os.umask(0)
    os.umask(umask)
    assert (fresh.stat().st_mode & 0o777) == 0o666 & ~umask


# -- refine --------------------------------------------------------------------------


def test_refine_proposes_the_midpoints_where_the_winner_changes():
    from mlacore.tools.tune import refine_problems

    # fa2 wins batch 1, fa3 batches 16 and 128, at both lengths: the switch lies between 1 and 16
    report = _grid_report(lambda arm, h, b, n: (1.0 if arm == "fa2" else 2.0) if b == 1 else
                          (2.0 if arm == "fa2" else 1.0))
    cells = refine_problems(report)
    assert sorted((p.batch_size, p.max_kv_len) for p in cells) == [(4, 1024), (4, 16384)]
    assert all(p.num_heads == 16 and p.min_kv_len == p.max_kv_len for p in cells)
    # measured there (fa3 wins at 4): the next round looks between 1 and 4, then stops within 1.5x
    rows = list(report.rows)
    for p in cells:
        rows += [BenchRow("X:variant=fa2", p, "ok", time_us=2.0), BenchRow("X:variant=fa3", p, "ok", time_us=1.0)]
    report2 = BenchReport(rows, CEIL, "g", {"gpu": "G"}, "2026-12-01")
    assert sorted((p.batch_size, p.max_kv_len) for p in refine_problems(report2)) == [(2, 1024), (2, 16384)]
    assert refine_problems(report2, min_ratio=5.0) == []


def test_refine_follows_the_length_axis_and_skips_measured_or_tied_cells():
    from mlacore.tools.tune import refine_problems

    # fa2 wins the long length at every batch: switches lie between 1024 and 16384 (midpoint 4096)
    report = _grid_report(lambda arm, h, b, n: (1.0 if arm == "fa2" else 2.0) if n == 16384 else
                          (2.0 if arm == "fa2" else 1.0))
    cells = refine_problems(report)
    assert sorted((p.batch_size, p.max_kv_len) for p in cells) == [(1, 4096), (16, 4096), (128, 4096)]
    # within the 3% tie the group's majority arm wins everywhere: nothing to refine
    tied = _grid_report(lambda arm, h, b, n: 1.0 if arm == "fa3" else 1.01)
    assert refine_problems(tied) == []


def test_tune_refine_on_the_cpu_with_one_arm_stops_at_once(tmp_path):
    from mlacore.tools.cli import main

    out = tmp_path / "p.toml"
    rc = main(["tune", "--grid", "quick", "--device", "cpu", "--backend", "reference", "--budget", "0.01",
               "--no-progress", "--refine", "3", "--write", str(out), "-o", str(tmp_path / "m.json")])
    assert rc == 0
    assert out.is_file() and (tmp_path / "m.json").is_file()


def test_joining_runs_refuses_another_machine_or_stack_and_keeps_the_later_row():
    from mlacore.tools.tune import TuneError, join_reports as _join_reports

    a = _grid_report(lambda arm, h, b, n: 1.0 if arm == "fa2" else 2.0)
    b = _grid_report(lambda arm, h, b, n: 2.0 if arm == "fa2" else 1.0)
    a.fingerprint = {"gpu": "G", "torch": "2.11", "backends": {"X": "0.1"}}
    b.fingerprint = {"gpu": "G", "torch": "2.11", "backends": {"X": "0.2"}}
    with pytest.raises(TuneError, match="measured with X 0.2"):
        _join_reports([a, b], ["a.json", "b.json"])
    b.fingerprint = {"gpu": "G", "torch": "2.12", "backends": {"X": "0.1"}}
    with pytest.raises(TuneError, match="torch=2.12"):
        _join_reports([a, b], ["a.json", "b.json"])
    b.fingerprint = dict(a.fingerprint)
    joined = _join_reports([a, b], ["a.json", "b.json"])
    assert len(joined.rows) == len(a.rows)
    assert set(winners(joined).values()) == {"X:variant=fa3"}  # the later run's times


def test_rules_route_every_cell_to_its_winner_on_random_reports_with_holes_ties_and_failures():
    """Property: on reports with holes (joined runs), near-ties, wrong and skipped arms, tune() writes rules
    that the dispatcher's own matching routes to each measured cell's winner (tune() checks it and would
    raise TuneError otherwise)."""
    import random

    arms = ["A", "B", "X:variant=fa2", "X:variant=fa3"]
    for seed in range(40):
        rng = random.Random(seed)
        rows = []
        bs = sorted(rng.sample([1, 2, 4, 8, 16, 32, 64, 128], rng.randint(2, 5)))
        ls = sorted(rng.sample([256, 1024, 4096, 16384, 65536], rng.randint(2, 4)))
        for h in rng.sample([16, 64, 128], rng.randint(1, 2)):
            for b in bs:
                for n in ls:
                    if rng.random() < 0.2:
                        continue
                    p = DecodeProblem(num_heads=h, batch_size=b, min_kv_len=n, max_kv_len=n, page_size=64,
                                      device=CPU)
                    base = rng.uniform(10, 20)
                    for a in arms:
                        r = rng.random()
                        if r < 0.05:
                            rows.append(BenchRow(a, p, "wrong"))
                        elif r < 0.1:
                            rows.append(BenchRow(a, p, "skipped"))
                        else:
                            rows.append(BenchRow(a, p, "ok", time_us=base * (1 + rng.choice([0, 0.01, 0.029, 0.2]))))
        report = BenchReport(rows, CEIL, "rand", {"gpu": "T"}, "2026-01-01")
        if not winners(report):
            continue
        text, cells = tune(report, "p.toml", '[mla]\norder = ["reference"]\n', "boxes")
        assert all(w == routed for w, routed in cells.values()), seed


def test_refining_places_a_nonlinear_switch_where_it_is_measured():
    """A model of what the H200 showed: fa2's time barely grows at small batches (split-KV already fills
    the GPU), fa3's grows with batch, so they cross near batch 2.3, below the geometric midpoint of the
    grid points 1 and 16. Without refining the switch lands at 4 and batches 3-4 pay; after refine rounds
    (cells "measured" from the same model) every batch 1..32 is within 5%."""
    from mlacore.tools.tune import parse_policy_text as parse, refine_problems, validate

    def model(arm, h, b, n):
        per = n / 1024.0
        return (20.0 + 1.5 * b * per) if arm == "fa2" else (6.0 + 6.0 * b * per)  # cross at b ~ 2.3

    def report_of(cells):
        rows = []
        for p in cells:
            for arm in ("fa2", "fa3"):
                rows.append(BenchRow(f"X:variant={arm}", p, "ok", time_us=model(arm, p.num_heads, p.batch_size,
                                                                                 p.max_kv_len)))
        return rows

    grid = [_problem(b, 1024) for b in (1, 16, 32)]
    dense = BenchReport(report_of([_problem(b, 1024) for b in range(1, 33)]), CEIL, "dense", {"gpu": "G"}, "d")

    def worst_after(rounds):
        rows = report_of(grid)
        for _ in range(rounds):
            rep = BenchReport(rows, CEIL, "g", {"gpu": "G"}, "d")
            rows = rows + report_of(refine_problems(rep))
        text, _ = tune(BenchReport(rows, CEIL, "g", {"gpu": "G"}, "d"), "p.toml", '[mla]\norder = ["reference"]\n',
                       "boxes")
        return validate(parse(text), dense).worst_regret

    assert worst_after(0) > 0.12  # the midpoint rule alone misplaces the switch (15% here)
    assert worst_after(3) < 0.05  # refined (batches 4, then 2 measured): 2% here


def test_a_groups_unmeasured_space_goes_to_the_arm_that_wins_that_group():
    """As on the H200: one backend (A) wins a whole group (H=128 here; an fp8 cache there) and so most cells
    overall, while fa3 wins most of the other group. Joined runs leave holes: here H=16 batch 1 was measured
    at the long length only, so no rule reaches batch 1 at short lengths. That space goes to fa3 (the
    group's majority), not to A (the whole grid's); A keeps its own H=16 cell and the box around it."""
    from mlacore.tools.tune import route_cells

    rows = []
    for h in (16, 128):
        for b in (1, 16, 128):
            for n in (1024, 16384):
                if (h, b, n) == (16, 1, 1024):
                    continue  # the hole
                p = _problem(b, n, h)
                a_wins = h == 128 or (b, n) == (128, 16384)
                rows.append(BenchRow("A", p, "ok", time_us=1.0 if a_wins else 2.0))
                rows.append(BenchRow("X:variant=fa3", p, "ok", time_us=2.0 if a_wins else 1.0))
    report = BenchReport(rows, CEIL, "g", {"gpu": "G"}, "2026-12-01")
    text, cells = tune(report, "p.toml", '[mla]\norder = ["reference"]\n', "boxes")
    assert all(w == routed for w, routed in cells.values())
    pol = parse_policy_text(text)
    assert pol.mla.order[:2] == ("X", "A")  # A wins most cells: the default, last

    def route(b, n, h=16):
        probe = BenchReport([BenchRow(a, _problem(b, n, h), "ok", time_us=1.0) for a in ("A", "X:variant=fa3")],
                            CEIL, "probe", {}, "")
        return next(iter(route_cells(list(pol.mla.order), pol, probe).values()))

    assert route(1, 1024) == "X:variant=fa3" and route(2, 300) == "X:variant=fa3"  # the hole: fa3's group
    assert route(128, 16384) == "A" and route(46, 4097) == "A" and route(512, 65536) == "A"  # A's cell, its box
    assert route(45, 20000) == "X:variant=fa3" and route(512, 4096) == "X:variant=fa3"  # past its midpoints
    assert route(1, 1024, h=128) == "A" and route(512, 300, h=128) == "A"  # A's own group
    assert route(3, 3000, h=64) == "A"  # a head count nobody measured: the default


# -- a group's near-tie goes to one arm; refining within a cell budget -----------------------------


def test_an_arm_within_the_group_tie_everywhere_takes_the_whole_group():
    """What the H200 showed at H=16 s_q=1 bf16: our kernel was never more than 3.6% slower than fa3, fastest at
    25 of 26 tuning cells, and fa3's rule around its one 3.6% win routed an off-grid cell 30.7% slow.
    An arm within GROUP_TIE of the fastest at every cell of a group takes all of it; a group where no arm
    is takes per-cell winners as before; other head counts are not affected."""
    slow = 1.0 + (TIE + GROUP_TIE) / 2  # beyond the cell tie, within the group tie

    def times(arm, h, b, n):
        if h == 16:  # fa2 wins (1, 1024) by `slow`, fa3 every other cell by 2x
            if (b, n) == (1, 1024):
                return 1.0 if arm == "fa2" else slow
            return 1.0 if arm == "fa3" else 2.0
        # H=128: fa2 wins (1, 1024) by 2x, fa3 the rest by 2x: no arm is within the group tie everywhere
        if (b, n) == (1, 1024):
            return 1.0 if arm == "fa2" else 2.0
        return 1.0 if arm == "fa3" else 2.0

    report = _grid_report(times, heads=(16, 128))
    strict = winners(report, group_tie=0.0)
    grouped = winners(report)
    assert strict[(16, 1, "bf16", "bf16", 64, 1, 1024)] == "X:variant=fa2"
    assert {w for c, w in grouped.items() if c[0] == 16} == {"X:variant=fa3"}
    assert grouped[(128, 1, "bf16", "bf16", 64, 1, 1024)] == "X:variant=fa2"  # 2x: not a near-tie
    text, cells = tune(report, "p.toml", '[mla]\norder = ["reference"]\n', "boxes")
    assert _route(text, _problem(1, 1024)) == "X:variant=fa3"
    assert _route(text, _problem(1, 1024, h=128)) == "X:variant=fa2"
    # the arm must be timed at every cell of the group: one it cannot take (skipped) disqualifies it
    holed = _grid_report(lambda arm, h, b, n: None if (arm, b, n) == ("fa3", 128, 16384) else times(arm, h, b, n))
    assert winners(holed)[(16, 1, "bf16", "bf16", 64, 1, 1024)] == "X:variant=fa2"


def test_refine_keeps_whole_lines_with_most_at_stake_within_its_budget():
    from mlacore.tools.tune import refine_problems

    # two switches along batch, sharing no cell: 1|16 costs 9x to get wrong, 128|1024 costs 1.2x;
    # the cheap one's midpoint (362) sorts first as a string, so only the stake can put batch 4 first
    def times(arm, h, b, n):
        if b == 1:
            return 1.0 if arm == "fa2" else 10.0
        if b == 16:
            return 1.0 if arm == "fa3" else 10.0
        if b == 128:
            return 1.0 if arm == "fa3" else 1.2
        return 1.0 if arm == "fa2" else 1.2

    report = _grid_report(times, batches=(1, 16, 128, 1024))
    cells = lambda **kw: sorted((p.batch_size, p.max_kv_len) for p in refine_problems(report, **kw))  # noqa: E731
    assert cells() == [(4, 1024), (4, 16384), (362, 1024), (362, 16384)]
    assert cells(max_cells=2) == [(4, 1024), (4, 16384)]
    assert cells(max_cells=3) == [(4, 1024), (4, 16384)]  # whole lines only: the next one does not fit
    assert cells(max_cells=1) == [(4, 1024)]  # not even one line fits: the first one, cut
    assert cells(max_cells=4) == cells()


def test_several_arms_within_the_group_tie_go_to_the_one_fastest_at_most_cells():
    # fa3 fastest at 5 of 6 cells, 3.9% slower at the sixth; fa2 3.5% slower at those 5: both are within
    # the group tie everywhere, fa3 wins far more cells and takes the group (fa2 has the smaller worst case)
    def times(arm, h, b, n):
        if (b, n) == (1, 1024):
            return 1.0 if arm == "fa2" else 1.039
        return 1.0 if arm == "fa3" else 1.035

    report = _grid_report(times)
    assert set(winners(report).values()) == {"X:variant=fa3"}
    assert winners(report, group_tie=0.0)[(16, 1, "bf16", "bf16", 64, 1, 1024)] == "X:variant=fa2"


def test_cli_refine_cells_must_be_a_positive_integer(tmp_path):
    from mlacore.tools.cli import main

    for bad in ("0", "-3", "x"):
        with pytest.raises(SystemExit) as exc:
            main(["tune", "--write", str(tmp_path / "p.toml"), "--refine", "1", "--refine-cells", bad])
        assert exc.value.code == 2


def test_cli_tune_from_refuses_to_overwrite_an_input_and_writes_the_joined_runs(tmp_path):
    from mlacore.tools.bench import report_json
    from mlacore.tools.cli import main

    a = _grid_report(lambda arm, h, b, n: 1.0 if arm == "fa3" else 2.0, name="a")
    b = _grid_report(lambda arm, h, b, n: 1.0 if arm == "fa3" else 2.0, batches=(4,), name="b")
    fa, fb = tmp_path / "a.json", tmp_path / "b.json"
    fa.write_text(json.dumps(report_json(a)))
    fb.write_text(json.dumps(report_json(b)))
    before = fa.read_text()
    pol = tmp_path / "p.toml"
    for flag in ("-o", "--csv"):
        assert main(["tune", "--from", str(fa), "--from", str(fb), "--write", str(pol), flag, str(fa)]) == 2
        assert fa.read_text() == before and not pol.exists()
    assert main(["tune", "--from", str(fa), "--write", str(pol), "--refine-cells", "5"]) == 2
    joined = tmp_path / "joined.json"
    assert main(["tune", "--from", str(fa), "--from", str(fb), "--write", str(pol), "-o", str(joined)]) == 0
    rows = json.loads(joined.read_text())["rows"]
    assert sorted({r["problem"]["batch_size"] for r in rows}) == [1, 4, 16, 128]


def test_backend_spec_types_option_values_as_toml_does_and_labels_round_trip():
    spec = BackendSpec.parse("cute_dsl_mla:pdl=false,num_sms=100,mma=wgmma_t,x=True")
    assert spec.options == (("pdl", False), ("num_sms", 100), ("mma", "wgmma_t"), ("x", True))
    assert spec.label == "cute_dsl_mla:pdl=false,num_sms=100,mma=wgmma_t,x=true"
    assert BackendSpec.parse(spec.label) == spec
    with pytest.raises(ValueError, match="key=value"):
        BackendSpec.parse("cute_dsl_mla:pdl")


def test_run_bench_hands_each_cell_but_the_last_to_on_cell_marked_partial():
    grid = load_grid("quick")
    problems = grid.problems(DeviceSpec.of("cpu"))[:3]
    seen = []
    report = run_bench(problems, [BackendSpec("reference")], "cpu", False, "g", progress=False, budget_s=0.001,
                       on_cell=lambda rep: seen.append((rep.grid, len(rep.rows))))
    assert seen == [("g (partial: 1 of 3 cells)", 1), ("g (partial: 2 of 3 cells)", 2)]
    assert report.grid == "g" and len(report.rows) == 3


def test_bench_output_file_holds_the_cells_so_far_while_it_runs(tmp_path, monkeypatch):
    """mla bench -o FILE rewrites FILE (whole, by rename) after each cell: a run killed by a time limit keeps
    what it measured, its grid marked partial; the finished run's file is the whole report."""
    from mlacore.tools import bench as bench_mod, cli

    out = tmp_path / "m.json"
    snapshots = []
    real = bench_mod.bench_cell

    def cell_then_look(*a, **k):
        if out.exists():
            snapshots.append(json.loads(out.read_text()))
        return real(*a, **k)

    monkeypatch.setattr(bench_mod, "bench_cell", cell_then_look)
    grid = tmp_path / "g.toml"
    grid.write_text("[grid]\nnum_heads=[16]\nbatch=[1, 2]\nkv_len=[64, 128]\npage_size=[64]\n")
    assert cli.main(["bench", "--grid", str(grid), "--backend", "reference", "--device", "cpu", "--budget", "0.001",
                     "--no-progress", "-o", str(out), "--json"]) == 0
    assert [len(s["rows"]) for s in snapshots] == [1, 2, 3]
    assert all("(partial: " in s["grid"] for s in snapshots)
    final = json.loads(out.read_text())
    assert len(final["rows"]) == 4 and "partial" not in final["grid"]
    assert not list(tmp_path.glob("*.tmp"))


# -- mla tune --rules batch: per group one arm, or two split at one batch --------------------------------------------
def test_batch_split_minimises_the_worst_ratio_over_the_groups_cells():
    from mlacore.tools.tune import batch_split

    cells = [(16, 1, "bf16", "bf16", 64, b, n) for b in (1, 16, 128) for n in (1024, 16384)]
    # a: fastest at batch 1; b: fastest from 16 up, except one 4% win of a at (128, 1024) that must not
    # buy a a third region: the split at 1 | 16 has worst ratio 1.04 and beats any one-arm rule
    times = {c: ({"a": 1.0, "b": 2.0} if c[5] == 1 else {"a": 1.5, "b": 1.0}) for c in cells}
    times[cells[-2]] = {"a": 1.0, "b": 1.04}
    assert batch_split(cells, times) == (1, "a", "b")
    # one arm within 3% everywhere: no split (a single arm is preferred at equal worst and mean)
    flat = {c: {"a": 1.0, "b": 1.03} for c in cells}
    assert batch_split(cells, flat) == (128, "a", "a")
    # an arm missing at one cell is avoided there only: b at batch 1, a above
    flat[cells[0]] = {"b": 1.03}
    assert batch_split(cells, flat) == (1, "b", "a")
    # each arm missing at one cell, at opposite ends of the group: the split avoids both
    gone = {c: {"a": 1.0, "b": 1.01} for c in cells}
    gone[cells[0]], gone[cells[-1]] = {"b": 1.0}, {"a": 1.0}  # no a at batch 1 (1024), no b at 128 (16384)
    assert batch_split(cells, gone) == (1, "b", "a")


def test_tune_rules_batch_routes_by_one_batch_split_and_keeps_a_catch_all():
    from mlacore.tools.tune import batch_split

    # fa2 wins batch 1 (every length) and batch 16 at 16384 only by 2%; fa3 the rest
    def times(arm, h, b, n):
        if b == 1:
            return 1.0 if arm == "fa2" else 2.0
        if b == 16 and n == 16384:
            return 1.0 if arm == "fa2" else 1.02
        return 2.0 if arm == "fa2" else 1.0

    report = _grid_report(times, heads=(16, 128))
    text, cells = tune(report, "p.toml", '[mla]\norder = ["reference"]\n', "batch")
    pol = parse_policy_text(text)
    rules = pol.backend["X"].allow
    # per head count: fa2 up to the midpoint of 1 and 16 (4), then the default arm fa3 by its catch-all rule
    fa2 = [r for r in rules if r.options == {"variant": "fa2"}]
    assert sorted(r.num_heads for r in fa2) == [(16,), (128,)] and all(r.max_batch == 4 for r in fa2)
    assert rules[-1].options == {"variant": "fa3"} and rules[-1].num_heads is None
    assert _route(text, _problem(4, 4096)) == "X:variant=fa2"
    assert _route(text, _problem(16, 16384)) == "X:variant=fa3"  # its 2% fa2 win gets no rule of its own
    assert _route(text, _problem(8, 1024, h=64)) == "X:variant=fa3"  # a head count nobody measured
    assert cells[(16, 1, "bf16", "bf16", 64, 16, 16384)] == ("X:variant=fa2", "X:variant=fa3")
    # the boxes route that cell to its winner instead; the default is the batch rules
    text_boxes, _ = tune(report, "p.toml", '[mla]\norder = ["reference"]\n', "boxes")
    assert _route(text_boxes, _problem(16, 16384)) == "X:variant=fa2"
    assert tune(report, "p.toml", '[mla]\norder = ["reference"]\n')[0] == text
    with pytest.raises(Exception, match="rules: expected one of boxes, batch"):
        tune(report, "p.toml", '[mla]\norder = ["reference"]\n', "corners")
    assert batch_split([(16, 1, "bf16", "bf16", 64, b, n) for b in (1, 16, 128) for n in (1024, 16384)],
                       {(16, 1, "bf16", "bf16", 64, b, n): {"X:variant=fa2": times("fa2", 16, b, n),
                                                            "X:variant=fa3": times("fa3", 16, b, n)}
                        for b in (1, 16, 128) for n in (1024, 16384)}) == (1, "X:variant=fa2", "X:variant=fa3")


def test_cli_tune_rules_batch_from_measurements(tmp_path):
    from mlacore.tools.bench import report_json

    tune_json = tmp_path / "t.json"
    tune_json.write_text(json.dumps(report_json(_grid_report(_fa_times))))
    pol = tmp_path / "mla.toml"
    pol.write_text('[mla]\norder = ["reference"]\n')
    proc = subprocess.run([sys.executable, "-m", "mlacore", "tune", "--from", str(tune_json), "--write", str(pol),
                           "--rules", "batch"], capture_output=True, text=True, env=subprocess_env(), timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _route(pol.read_text(), _problem(2, 4096)) == "X:variant=fa2"
    assert _route(pol.read_text(), _problem(256, 4096)) == "X:variant=fa3"
    proc = subprocess.run([sys.executable, "-m", "mlacore", "tune", "--from", str(tune_json), "--write", str(pol),
                           "--rules", "cells"], capture_output=True, text=True, env=subprocess_env(), timeout=120)
    assert proc.returncode != 0 and "--rules" in proc.stderr and "batch" in proc.stderr


def test_rules_batch_survives_an_arm_failing_at_one_cell_of_each_side_and_the_cli_offers_every_mode():
    """Each arm misses a different cell of one group (skipped or wrong there): --rules batch still writes rules,
    routes every cell where its arm ran to that arm, avoids an arm where it failed when another rule can, and
    keeps an arm that failed at one cell on the other side of the split."""
    from mlacore.tools import cli
    from mlacore.tools.tune import RULE_MODES, batch_split

    def times(arm, h, b, n):
        if arm == "fa2" and (b, n) == (1, 1024):
            return None  # fa2 skipped at one small-batch cell
        if arm == "fa3" and (b, n) == (128, 16384):
            return None  # fa3 skipped at one large-batch cell
        return (1.0 if arm == "fa2" else 1.5) if b >= 16 else (1.5 if arm == "fa2" else 1.0)

    report = _grid_report(times)
    text, cells = tune(report, "p.toml", '[mla]\norder = ["reference"]\n', "batch")
    assert _route(text, _problem(1, 4096)) == "X:variant=fa3" and _route(text, _problem(128, 1024)) == "X:variant=fa2"
    members = sorted({k for k in cells})
    t, lo, hi = batch_split(members, {c: {a: v for a, v in ((f"X:variant={x}", times(x, 16, c[5], c[6]))
                                                             for x in ("fa2", "fa3")) if v is not None}
                                      for c in members})
    assert (t, lo, hi) == (1, "X:variant=fa3", "X:variant=fa2")
    choices = next(a.choices for a in cli.build_parser()._subparsers._group_actions[0].choices["tune"]._actions
                   if a.dest == "rules")
    assert tuple(choices) == RULE_MODES


def test_routing_outside_every_allow_rule_follows_strict_allow():
    """route_cells routes as the dispatcher does: a cell no allow rule admits goes to the first backend in order
    (before the reference) kept off only by its allow rules, with its base options, unless mla.strict_allow;
    deny rules still hold."""
    text = ('[mla]\norder = ["X", "reference"]\n[backend.X.options]\nvariant = "fa3"\n'
            '[[backend.X.allow]]\nnum_heads = [128]\noptions = { variant = "fa2" }\n')
    assert _route(text, _problem(4, 4096, h=128)) == "X:variant=fa2"  # inside its rule: the rule's options
    assert _route(text, _problem(4, 4096)) == "X:variant=fa3"  # outside: the base options
    strict = text.replace('"reference"]\n', '"reference"]\nstrict_allow = true\n', 1)
    assert _route(strict, _problem(4, 4096)) is None
    denied = text + "[[backend.X.deny]]\nmax_batch = 8\n"
    assert _route(denied, _problem(4, 4096)) is None and _route(denied, _problem(16, 4096)) == "X:variant=fa3"


def test_cli_tune_default_rules_with_an_arm_wrong_at_a_cell(tmp_path):
    """The default (--rules batch) may route a cell to an arm that was wrong there (one arm per group): mla tune
    reports that cell with the arm's status instead of failing, and says so in its summary line."""
    from mlacore.tools.bench import report_json

    rows = []
    for n in (1024, 16384):
        p = _problem(1, n)
        for arm in ("fa2", "fa3"):
            wrong = (arm == "fa2" and n == 1024) or (arm == "fa3" and n == 16384)
            rows.append(BenchRow(f"X:variant={arm}", p, "wrong") if wrong else
                        BenchRow(f"X:variant={arm}", p, "ok", time_us=1.0 if arm == "fa3" else 1.2))
    src = tmp_path / "t.json"
    src.write_text(json.dumps(report_json(BenchReport(rows, CEIL, "g", {"gpu": "G"}, "2026-12-01"))))
    pol = tmp_path / "mla.toml"
    pol.write_text('[mla]\norder = ["reference"]\n')
    proc = subprocess.run([sys.executable, "-m", "mlacore", "tune", "--from", str(src), "--write", str(pol)],
                          capture_output=True, text=True, env=subprocess_env(), timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "routed arm wrong" in proc.stdout and "1 routed to an arm with no correct time" in proc.stdout
    proc = subprocess.run([sys.executable, "-m", "mlacore", "tune", "--from", str(src), "--write", str(pol), "--json"],
                          capture_output=True, text=True, env=subprocess_env(), timeout=120)
    assert proc.returncode == 0, proc.stderr
    cells = json.loads(proc.stdout)["cells"]
    assert sorted((c["regret"] is None, c["routed_status"]) for c in cells) == [(False, "ok"), (True, "wrong")]


def test_routing_outside_allow_passes_over_a_backend_whose_allow_rule_matched():
    """X's allow rule matches the cell but its rule options (fa2) cannot take it: the dispatcher judges X 'cannot
    implement', not 'policy', so the outside-allow step takes Y (whose rules missed), and so must route_cells."""
    from mlacore.tools.tune import route_cells

    text = ('[mla]\norder = ["X", "Y", "reference"]\n[backend.X.options]\nvariant = "fa3"\n'
            '[[backend.X.allow]]\nnum_heads = [16]\noptions = { variant = "fa2" }\n'
            '[[backend.Y.allow]]\nnum_heads = [128]\n')
    p = _problem(4, 4096)
    rows = [BenchRow("X:variant=fa2", p, "skipped"), BenchRow("X:variant=fa3", p, "ok", time_us=1.0),
            BenchRow("Y", p, "ok", time_us=2.0)]
    pol = parse_policy_text(text)
    assert list(route_cells(list(pol.mla.order), pol, BenchReport(rows, CEIL, "g", {}, "")).values()) == ["Y"]
    # a reference denied here does not stop the search; one that can run does
    later = text.replace('order = ["X", "Y", "reference"]', 'order = ["X", "reference", "Y"]')
    pol = parse_policy_text(later)
    assert list(route_cells(list(pol.mla.order), pol, BenchReport(rows, CEIL, "g", {}, "")).values()) == [None]
    pol = parse_policy_text(later + "[[backend.reference.deny]]\nnum_heads = [16]\n")
    assert list(route_cells(list(pol.mla.order), pol, BenchReport(rows, CEIL, "g", {}, "")).values()) == ["Y"]


def _regret_run(*args):
    return subprocess.run([sys.executable, "-m", "mlacore", "policy", "regret", *args], capture_output=True,
                          text=True, env=subprocess_env(), timeout=120)


def test_cli_policy_regret_routes_a_hand_written_policy_over_stored_runs(tmp_path):
    """`mla policy regret` prices any policy on stored measurements: here fa2 up to batch 8, fa3 above, against
    _fa_times (fa2 = 10 + b, fa3 = 14 + 0.5 b: fa2 faster below batch 8); no file is written."""
    from mlacore.tools.bench import report_json

    runs = tmp_path / "v.json"
    runs.write_text(json.dumps(report_json(_grid_report(_fa_times, batches=(2, 6, 10, 64), lens=(4096,),
                                                        name="held-out"))))
    pol = tmp_path / "mla.toml"
    text = ('[mla]\norder = ["X"]\n[[backend.X.allow]]\nmax_batch = 8\noptions = {variant = "fa2"}\n'
            '[[backend.X.allow]]\nmin_batch = 9\noptions = {variant = "fa3"}\n')
    pol.write_text(text)
    proc = _regret_run(str(pol), "--from", str(runs), "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(proc.stdout)
    routed = {c["cell"].split(" B=")[1].split()[0]: c["routed"] for c in data["cells"]}
    assert routed == {"2": "X:variant=fa2", "6": "X:variant=fa2", "10": "X:variant=fa3", "64": "X:variant=fa3"}
    # the policy picks the faster arm in every cell (B=6: fa2 16 us, fa3 17; B=10: fa2 20, fa3 19)
    assert data["worst_regret"] == 0.0 and data["mean_regret"] == 0.0 and data["cell_count"] == 4
    assert pol.read_text() == text  # nothing written
    # a cut at 32 instead sends B=10 to fa2 (20.0 us against fa3's 19.0): 5.26% regret, named in the table
    pol.write_text(text.replace("max_batch = 8", "max_batch = 32").replace("min_batch = 9", "min_batch = 33"))
    proc = _regret_run(str(pol), "--from", str(runs), "--worst", "1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "B=10" in proc.stdout and "5.3%" in proc.stdout
    assert "on 4 cells mean regret 1.32%, worst 5.3%" in proc.stdout


def test_cli_policy_regret_needs_an_arm_for_options_nothing_measured(tmp_path):
    """A policy running X with options no measured arm has (X's own default, e.g. flashinfer_mla's variant=auto
    measured as variant=fa2 and variant=fa3) is not silently routed elsewhere: a one-line error names the backend
    and the measured arms, and --arm says which arm it runs."""
    from mlacore.tools.bench import report_json

    runs = tmp_path / "v.json"
    runs.write_text(json.dumps(report_json(_grid_report(_fa_times, batches=(2, 64), lens=(4096,)))))
    pol = tmp_path / "mla.toml"
    pol.write_text('[mla]\norder = ["X"]\n')
    proc = _regret_run(str(pol), "--from", str(runs))
    assert proc.returncode == 2
    assert "runs X with options {}" in proc.stderr and "X:variant=fa2, X:variant=fa3" in proc.stderr
    assert "--arm X=LABEL" in proc.stderr and "Traceback" not in proc.stderr
    proc = _regret_run(str(pol), "--from", str(runs), "--arm", "X=X:variant=fa3", "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(proc.stdout)
    assert {c["routed"] for c in data["cells"]} == {"X:variant=fa3"}
    # B=2: fa2 12.0, fa3 15.0 -> 25% regret
    assert data["worst_regret"] == 0.25
    proc = _regret_run(str(pol), "--from", str(runs), "--arm", "X=X:variant=fa9")
    assert proc.returncode == 2 and "--arm 'X=X:variant=fa9': expected BACKEND=LABEL" in proc.stderr
