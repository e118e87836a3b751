"""`mla tune`: from measurements to allow rules.

Two rule writers (RULE_MODES). "batch" (the default, build_batch_rules): per
(heads, s_q, dtypes, page size) group one arm, or two split at one batch, with
the smallest worst regret over the group's measured cells. "boxes"
(build_rules): rules built so that the real dispatcher, reading the written
policy, picks the fastest correct backend measured for every cell of the grid:

* the backend that wins most cells goes last among the winners and gets no
  allow rule (it is the default for head counts, s_q, dtypes and page sizes
  the grid did not cover);
* every other winner, ordered from fewest wins up, gets rectangles over
  (batch, kv length) per (heads, s_q, dtypes, page size) group, grown as far
  as they can without touching a cell that a later backend must keep
  (where this backend is slower, or wrong); then rules that differ in one
  set-valued field are merged;
* a rule holds where it was measured: between grid points its bounds sit
  at the geometric midpoint to the next point, where the winner changes
  hands; past the edge of the grid on an axis it reaches only where its arm
  wins every measured cell along the rule's own edge there; head counts,
  dtypes and page sizes not measured are left to the default arm;
* arms within `TIE` of a cell's fastest are tied there, and the tie goes to
  the arm that wins most of the cell's group; an arm within `GROUP_TIE` of
  the fastest at every cell of a group takes the whole group;
* what no rule claims within a group (heads, s_q, dtypes, page size: the
  unmeasured space between and past its points) goes to the arm that wins
  most of that group, not to the default of the whole grid.

`validate` times the written policy against every arm on a second grid
(`mla tune --validate GRID`): regret per cell, mean and worst.

The result is checked against the dispatcher's own rule matching before it
is written. Timing never enters decisions at run time: the file does.
"""

from __future__ import annotations

import math
import os
import stat
import tempfile
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .bench import OK, SKIPPED, BackendSpec, BenchReport
from ..policy import parse_policy, parse_policy_text
from ..problem import DecodeProblem

CAT_FIELDS = ("num_heads", "seq_len_q", "q_dtype", "kv_dtype", "page_size")


class TuneError(ValueError):
    pass


def _cell(p: DecodeProblem) -> tuple:
    return (p.num_heads, p.seq_len_q, p.q_dtype, p.kv_dtype, p.page_size, p.batch_size, p.max_kv_len)


# Arms within this fraction of a cell's fastest count as tied there (repeat runs on the H200 differ by 2-5%).
TIE = 0.03
# An arm within this fraction of the fastest at every measured cell of a group takes the whole group
# (the bound `mla tune --validate` is held to: no cell more than 5% slow).
GROUP_TIE = 0.05


def winners(report: BenchReport, tie: float = TIE, group_tie: float = GROUP_TIE) -> Dict[tuple, str]:
    """The arm each cell is routed to: the fastest correct one, except that among arms within `tie` of the
    fastest the one that wins most cells of the cell's group (heads, s_q, dtypes, page size) is taken, and
    that an arm within `group_tie` of the fastest at every cell of a group takes every cell of it.

    Why: a near-tie decided by noise would give an arm a rule in the middle of another arm's region, and
    that rule then reaches over unmeasured shapes where it loses by far more than the tie (seen on the H200:
    a 1.7% "win" of one arm at one cell routed its neighbours 28% slow; and at H=16 s_q=1 bf16, where
    our kernel was at most 3.6% slower than fa3 at every cell and fastest at 25 of 26, fa3's rule around
    its one 3.6% win (batch 20-50, S 3808-9914) routed an off-grid cell 30.7% slow). With several arms
    within `group_tie` everywhere, the one fastest at most of the group's cells is taken. Exact ties:
    the first label. `tie=0` and `group_tie=0` turn each off.
    """
    times = _times(report)
    strict = {c: min(ts, key=lambda lbl: (ts[lbl], lbl)) for c, ts in times.items()}
    group_wins: Dict[tuple, int] = defaultdict(int)
    for c, lbl in strict.items():
        group_wins[(c[:5], lbl)] += 1
    out: Dict[tuple, str] = dict(strict)
    if tie > 0:
        for c, ts in times.items():
            best = min(ts.values())
            tied = [lbl for lbl, t in ts.items() if t <= best * (1.0 + tie)]
            out[c] = min(tied, key=lambda lbl: (-group_wins[(c[:5], lbl)], ts[lbl], lbl))
    if group_tie > 0:
        for cat, members in _groups(times).items():
            wins = {lbl: n for (g, lbl), n in group_wins.items() if g == cat}
            arm = _group_arm(members, times, group_tie, wins)
            if arm is not None:
                out.update((c, arm) for c in members)
    return out


def _times(report: BenchReport) -> Dict[tuple, Dict[str, float]]:
    """Per cell, the time of every arm that ran correctly there."""
    times: Dict[tuple, Dict[str, float]] = defaultdict(dict)
    for r in report.rows:
        if r.status == OK:
            times[_cell(r.problem)][r.backend] = r.time_us
    return times


def _groups(cells) -> Dict[tuple, List[tuple]]:
    """Cells by group (heads, s_q, dtypes, page size), each group's cells sorted."""
    out: Dict[tuple, List[tuple]] = defaultdict(list)
    for c in sorted(cells):
        out[c[:5]].append(c)
    return out


def _group_arm(members: List[tuple], times: Dict[tuple, Dict[str, float]], group_tie: float,
               wins: Dict[str, int]) -> Optional[str]:
    """The arm within `group_tie` of the fastest at every cell of a group (timed at all of them), else None.
    Between several: the one fastest at most cells (`wins`), then the smallest mean and worst ratio, then
    the label (an arm a little slower everywhere must not displace one that wins nearly every cell)."""
    arms = set.intersection(*(set(times[c]) for c in members))
    ratio = {a: [times[c][a] / min(times[c].values()) for c in members] for a in arms}
    good = [a for a, rs in ratio.items() if max(rs) <= 1.0 + group_tie]
    return min(good, key=lambda a: (-wins.get(a, 0), statistics.fmean(ratio[a]), max(ratio[a]), a)) if good else None


def join_reports(reports: List[BenchReport], names: Sequence[str]) -> BenchReport:
    """One report from several runs on one machine and software stack (`mla tune --from A --from B`,
    and each `--refine` round joined to the grid).

    Runs that differ in GPU, capability, driver, torch or a backend's version
    are refused (TuneError): their times are not comparable, and the tuned file
    records one fingerprint. A cell and arm measured twice keeps the later
    run's row (cells keyed as the rules see them).
    """
    if len(reports) == 1:
        return reports[0]
    first = reports[0].fingerprint
    for name, rep in zip(names[1:], reports[1:]):
        fp = rep.fingerprint
        for key in ("gpu", "capability", "driver", "torch"):
            if str(fp.get(key)) != str(first.get(key)):
                raise TuneError(f"{name} was measured with {key}={fp.get(key)}, {names[0]} with "
                                f"{key}={first.get(key)}: runs to join must come from one machine and stack")
        mine, theirs = first.get("backends") or {}, fp.get("backends") or {}
        for backend in sorted(set(mine) & set(theirs)):
            if mine[backend] != theirs[backend]:
                raise TuneError(f"{name} was measured with {backend} {theirs[backend]}, {names[0]} with "
                                f"{mine[backend]}: runs to join must come from one machine and stack")
    rows: Dict[tuple, object] = {}
    backends: Dict[str, object] = {}
    for rep in reports:
        backends.update(rep.fingerprint.get("backends") or {})
        for row in rep.rows:
            rows[(_cell(row.problem), row.backend)] = row
    fingerprint = dict(first, backends=backends) if backends else dict(first)
    return BenchReport(list(rows.values()), reports[0].ceilings, " + ".join(r.grid for r in reports),
                       fingerprint, max(r.date for r in reports))


def refine_problems(report: BenchReport, min_ratio: float = 1.5,
                    max_cells: Optional[int] = None) -> List[DecodeProblem]:
    """The cells to measure next so that a switch of winner is placed where it happens.

    Between two measured points of a group that are neighbours on one axis
    (batch, or kv length at a fixed batch) and have different winners, the
    geometric midpoint is proposed, unless the two points are within
    `min_ratio` of each other already. The midpoint is measured along the
    whole line across the other axis (every length of the group for a new
    batch, every batch for a new length), so that the group stays a full grid
    and no switch on another line is moved by a point measured only here.
    Why: the rules place a switch at the midpoint, which is only right where
    time grows in proportion to batch and length; at small batches it does
    not (on the H200 fa2's batch-1 time at long contexts barely grows up to
    batch 4 while ours drops per request: a rule from points 1 and 16 was
    122% slow at batch 4).

    `max_cells` keeps whole lines, those with most at stake first: the lines of the switches where
    taking one neighbour's winner at the other costs most (a switch to an arm that cannot run at the
    other neighbour first). A line that does not fit is passed over for smaller ones; when not even
    one fits, the first line is cut to `max_cells` cells. Why: a joined run on the H200 proposed 177
    cells in one round, past the device's 10-minute limit with three arms.
    """
    win = winners(report)
    times = _times(report)

    def cost(cell: tuple, arm: str) -> float:
        ts = times.get(cell, {})
        return ts[arm] / min(ts.values()) - 1.0 if arm in ts else math.inf
    template: Dict[tuple, DecodeProblem] = {}
    for r in report.rows:
        template.setdefault(_cell(r.problem), r.problem)
    groups: Dict[tuple, Dict[Tuple[int, int], str]] = defaultdict(dict)
    for c, label in win.items():
        groups[c[:5]][(c[5], c[6])] = label
    wanted: Dict[tuple, DecodeProblem] = {}
    line_of: Dict[tuple, tuple] = {}  # proposed cell -> the line (group, axis, midpoint) that proposed it
    stake: Dict[tuple, float] = defaultdict(float)  # line -> the most one of its switches costs
    for cat, at in groups.items():
        b_all = sorted({b for b, _ in at})
        l_all = sorted({n for _, n in at})
        for axis in (0, 1):
            lines: Dict[int, List[int]] = defaultdict(list)
            for pt in at:
                lines[pt[1 - axis]].append(pt[axis])
            for fixed, values in lines.items():
                values.sort()
                for lo, hi in zip(values, values[1:]):
                    pt_lo = (lo, fixed) if axis == 0 else (fixed, lo)
                    pt_hi = (hi, fixed) if axis == 0 else (fixed, hi)
                    if at[pt_lo] == at[pt_hi] or hi < lo * min_ratio:
                        continue
                    mid = split_point(lo, hi)
                    if mid in (lo, hi):
                        continue
                    line = (cat, axis, mid)
                    stake[line] = max(stake[line], cost(cat + pt_lo, at[pt_hi]), cost(cat + pt_hi, at[pt_lo]))
                    for other in (l_all if axis == 0 else b_all):  # the whole line: the grid stays full
                        pt = (mid, other) if axis == 0 else (other, mid)
                        key = cat + pt
                        if pt in at or key in template or key in wanted:
                            continue
                        near = min(((pt2, template[cat + pt2]) for pt2 in at if pt2[1 - axis] == other),
                                   key=lambda item: abs(item[0][axis] - mid), default=(None, None))[1]
                        if near is None:
                            continue
                        if axis == 0:
                            update = {"batch_size": mid}
                        else:
                            spread = near.min_kv_len / near.max_kv_len if near.max_kv_len else 1.0
                            update = {"max_kv_len": mid,
                                      "min_kv_len": min(mid, max(near.seq_len_q if near.batch_size > 1 else mid,
                                                                 int(round(mid * spread))))}
                        wanted[key] = near.model_copy(update=update)
                        line_of[key] = line
    keys = sorted(wanted, key=str)
    if max_cells is not None and len(keys) > max_cells:
        cells_of: Dict[tuple, List[tuple]] = defaultdict(list)
        for k in keys:
            cells_of[line_of[k]].append(k)
        ranked = sorted(cells_of, key=lambda ln: (-stake[ln], str(ln)))
        chosen: List[tuple] = []
        for ln in ranked:
            if len(chosen) + len(cells_of[ln]) <= max_cells:
                chosen += cells_of[ln]
        keys = sorted(chosen or cells_of[ranked[0]][:max_cells], key=str)
    return [wanted[k] for k in keys]


def statuses(report: BenchReport) -> Dict[Tuple[tuple, str], str]:
    return {(_cell(r.problem), r.backend): r.status for r in report.rows}


def _arm(label: str) -> Tuple[str, Dict[str, object]]:
    spec = BackendSpec.parse(label)
    return spec.name, dict(spec.options)


def _rectangles(win: set, keep_off: set, b_vals: List[int], l_vals: List[int]) -> List[Tuple[int, int, int, int]]:
    """Cover `win` grid points with index rectangles that avoid `keep_off` points."""
    rects = []
    covered: set = set()
    for bi, b in enumerate(b_vals):
        for li, n in enumerate(l_vals):
            if (b, n) not in win or (b, n) in covered:
                continue
            li1 = li
            while li1 + 1 < len(l_vals) and (b, l_vals[li1 + 1]) not in keep_off:
                li1 += 1
            bi1 = bi
            while bi1 + 1 < len(b_vals) and all((b_vals[bi1 + 1], l_vals[k]) not in keep_off
                                                 for k in range(li, li1 + 1)):
                bi1 += 1
            rects.append((bi, bi1, li, li1))
            for x in range(bi, bi1 + 1):
                for y in range(li, li1 + 1):
                    covered.add((b_vals[x], l_vals[y]))
    return rects


def split_point(lo: int, hi: int) -> int:
    """The largest value that still belongs with `lo` when `hi` is the next grid point: their geometric midpoint.

    Decode time grows about linearly in batch and kv length, so a winner
    changes hands halfway on a log scale, not at the last point measured.
    """
    return max(lo, math.isqrt(lo * hi))


def _axis_bounds(vals: List[int], lo_v: int, hi_v: int, open_lo: bool,
                 open_hi: bool) -> Tuple[Optional[int], Optional[int]]:
    """Bounds on one axis of a rule covering lo_v..hi_v, given the values measured on that axis.

    Next to a measured value outside the rule the bound sits at the geometric
    midpoint, where the winner changes hands. With nothing measured beyond, the
    rule stops at its last point unless `open_lo`/`open_hi` says that its arm
    wins that whole edge of the rule, so reaching past it is a measured trend.
    """
    below = [v for v in vals if v < lo_v]
    above = [v for v in vals if v > hi_v]
    lo = split_point(below[-1], lo_v) + 1 if below else (None if open_lo else lo_v)
    hi = split_point(hi_v, above[0]) if above else (None if open_hi else hi_v)
    return lo, hi


def _rule_box(label: str, at: Dict[Tuple[int, int], str], spans_b: List[int], spans_l: List[int],
              keep_off: set, b_vals: List[int], l_vals: List[int]
              ) -> Tuple[Optional[int], Optional[int], Optional[int], Optional[int]]:
    """(min_batch, max_batch, min_kv_len, max_kv_len) of a rule over the grid points spans_b x spans_l.

    Neighbours come first from the points measured on the rule's own lines (joined or refined runs leave
    holes: a batch measured only at other lengths says nothing about where the switch lies at these
    lengths); if that box would take in a cell that must stay off this arm, from the group's grid values
    `b_vals`/`l_vals`, which cannot (a midpoint never passes the next grid value).
    """
    b_lo, b_hi, l_lo, l_hi = spans_b[0], spans_b[-1], spans_l[0], spans_l[-1]
    edges = (_edge_is(label, at, ((b_lo, n) for n in spans_l)), _edge_is(label, at, ((b_hi, n) for n in spans_l)),
             _edge_is(label, at, ((b, l_lo) for b in spans_b)), _edge_is(label, at, ((b, l_hi) for b in spans_b)))

    def box(bs: List[int], ls: List[int]) -> tuple:
        return _axis_bounds(bs, b_lo, b_hi, edges[0], edges[1]) + _axis_bounds(ls, l_lo, l_hi, edges[2], edges[3])

    on_lines = box(sorted({b for (b, n) in at if l_lo <= n <= l_hi}), sorted({n for (b, n) in at if b_lo <= b <= b_hi}))
    inside = lambda v, lo, hi: (lo is None or v >= lo) and (hi is None or v <= hi)  # noqa: E731
    if any(inside(b, *on_lines[:2]) and inside(n, *on_lines[2:]) for (b, n) in keep_off):
        return box(b_vals, l_vals)
    return on_lines


def arm_order(report: BenchReport) -> Tuple[List[str], List[str]]:
    """(backend order, arm order): arms of one backend stay together, as the policy must write them.

    Backends go from fewest cells won to most; the backend that wins most is
    last, and its best arm last of all, so that it can take every cell that
    no earlier rule claims.
    """
    arm_wins: Dict[str, int] = defaultdict(int)
    for label in winners(report).values():
        arm_wins[label] += 1
    return _order_by_cells(arm_wins)


def _order_by_cells(arm_wins: Dict[str, int]) -> Tuple[List[str], List[str]]:
    """arm_order's (backend order, arm order) from the cells each arm is routed to."""
    backend_wins: Dict[str, int] = defaultdict(int)
    for label, n in arm_wins.items():
        backend_wins[_arm(label)[0]] += n
    backends = sorted(backend_wins, key=lambda n: (backend_wins[n], n))
    if backends:
        top = backends.pop(-1 if len(backends) == 1 else
                           max(range(len(backends)), key=lambda i: (backend_wins[backends[i]], -i)))
        backends.append(top)
    arms = []
    for name in backends:
        mine = sorted((a for a in arm_wins if _arm(a)[0] == name), key=lambda a: (arm_wins[a], a))
        arms += mine
    return backends, arms


def build_rules(report: BenchReport) -> Tuple[List[str], Dict[str, List[dict]], str]:
    """(backend order, allow rules per backend, default backend)."""
    win = winners(report)
    if not win:
        raise TuneError("no backend produced a correct, timed result on any cell")
    stat = statuses(report)
    backends, arms = arm_order(report)
    default = backends[-1]
    groups = _groups(win)
    rules: Dict[str, List[dict]] = {}
    for i, label in enumerate(arms):
        name, options = _arm(label)
        last = i == len(arms) - 1
        if last:
            # the default arm: takes whatever no earlier rule claimed
            if rules.get(name) or options:
                rules.setdefault(name, []).append({"options": options} if options else {})
            continue
        later = set(arms[i + 1:])
        out: List[dict] = []
        for cat, members in sorted(groups.items()):
            mine = {(c[5], c[6]) for c in members if win[c] == label}
            if not mine:
                continue
            # keep off every cell a later arm must get, and every cell where this arm is wrong
            keep_off = {(c[5], c[6]) for c in members
                        if win[c] in later or stat.get((c, label)) not in (OK, SKIPPED, None)}
            keep_off -= mine
            b_vals = sorted({c[5] for c in members})
            l_vals = sorted({c[6] for c in members})
            at = {(c[5], c[6]): win[c] for c in members}
            out += [_rule(cat, box, options) for box in _arm_boxes(label, mine, keep_off, at, b_vals, l_vals)]
        rules.setdefault(name, []).extend(_merge(out, report))
    for name, broad in _group_defaults(groups, win, stat, backends, arms).items():
        mine = rules.setdefault(name, [])
        mine.extend(r for r in _merge(broad, report) if r not in mine)  # after the specific rules: tried last
    return backends, rules, default


# the rule shapes `mla tune --rules` writes: "boxes" (every measured cell to its winner, boxes between) or "batch"
# (per group at most two arms, split at one batch)
RULE_MODES = ("boxes", "batch")


def batch_split(members: List[tuple], times: Dict[tuple, Dict[str, float]]) -> Tuple[int, str, str]:
    """(t, arm for batch <= t, arm for batch > t) for one group: the rule with the smallest worst ratio to the
    fastest over the group's measured cells (then the fewest cells routed to an arm without a correct time
    there, then the smallest mean over the others, then one arm rather than two, then the labels), over every
    one-arm rule and every two-arm split between two measured batches. An arm that failed or was skipped at a
    cell counts as infinitely slow there, so a rule avoids it where any rule can: one flaky cell neither aborts
    the tune nor takes the arm off the other side of a split. One arm: t is the group's largest batch.

    Why: decode times step along batch and length where no neighbouring measurement says so, and rules that
    send every measured cell to its winner carry a winner's margin at one cell into the unmeasured space
    around it. On the H200 runs (docs/results/h200_tune.md, thirteenth session), leaving one of six grids out,
    this rule's worst regret on the grid left out was lower than the boxes' in 9 of 12 folds (two run sets,
    mla-cute-dsl 0.2.9 and 0.2.7), equal in 2, higher in 1; mean of the folds' worst 9.6% against 23.3% (0.2.9)
    and 17.3% against 28.3% (0.2.7)."""
    arms = sorted(set.union(*(set(times[c]) for c in members)))
    batches = sorted({c[5] for c in members})
    ratio = {a: {c: times[c][a] / min(times[c].values()) if a in times[c] else math.inf for c in members}
             for a in arms}
    best = None
    for t in batches:
        for lo in arms:
            for hi in ([a for a in arms if a != lo] if t < batches[-1] else [lo]):
                rs = [ratio[lo if c[5] <= t else hi][c] for c in members]
                finite = [r for r in rs if r != math.inf]
                key = (max(rs), len(rs) - len(finite), statistics.fmean(finite) if finite else math.inf,
                       lo != hi, lo, hi)
                if best is None or key < best[0]:
                    best = (key, (t, lo, hi))
    return best[1]


def build_batch_rules(report: BenchReport) -> Tuple[List[str], Dict[str, List[dict]], str, Dict[tuple, str]]:
    """(backend order, allow rules per backend, default backend, the arm each measured cell is routed to) for
    `--rules batch`: per group (heads, s_q, dtypes, page size) batch_split's one or two arms, the second from
    the geometric midpoint between the split's two measured batches (split_point). The backend routed the most
    cells comes last in the order with a catch-all rule for its most-routed arm (groups nobody measured)."""
    times = _times(report)
    if not times:
        raise TuneError("no backend produced a correct, timed result on any cell")
    picks: Dict[tuple, str] = {}
    boxes: List[Tuple[tuple, str, tuple]] = []
    for cat, members in sorted(_groups(times).items()):
        t, lo, hi = batch_split(members, times)
        if lo == hi:
            boxes.append((cat, lo, (1, None, 0, None)))
        else:
            cut = split_point(t, min(c[5] for c in members if c[5] > t))
            boxes += [(cat, lo, (1, cut, 0, None)), (cat, hi, (cut + 1, None, 0, None))]
        picks.update((c, lo if c[5] <= t else hi) for c in members)
    arm_cells: Dict[str, int] = defaultdict(int)
    for label in picks.values():
        arm_cells[label] += 1
    order, arms = _order_by_cells(arm_cells)
    default, default_arm = order[-1], arms[-1]
    rules: Dict[str, List[dict]] = defaultdict(list)
    for cat, label, box in boxes:
        if label != default_arm:  # the default arm takes what no rule claims
            name, options = _arm(label)
            rules[name].append(_rule(cat, box, options))
    name, options = _arm(default_arm)
    if rules.get(name) or options:
        rules[name].append({"options": options} if options else {})
    return order, dict(rules), default, picks


def _group_defaults(groups: Dict[tuple, List[tuple]], win: Dict[tuple, str], stat: Dict[tuple, str],
                    backends: List[str], arms: List[str]) -> Dict[str, List[dict]]:
    """Rules that give each group's unmeasured space to the arm that wins most of that group.

    Without them, whatever no rule claims goes to the default backend, the one that wins most cells
    over the whole grid. That is the best guess across groups, not within one: on the H200 an fp8
    cache makes our kernel win nearly everywhere while FlashInfer fa3 wins nearly every bf16 cell, so
    a bf16 shape between or past the measured points would default to the fp8 winner.

    The rules cover the group's (batch, kv length) plane minus holes: for each arm of a later backend
    that wins cells here, boxes grown from its cells only through cells it won, with the same
    midpoint bounds and edge reach as rules (`_rule_box`). Those holes are never larger than that
    arm's own rules, which may also span cells it did not win; unmeasured space inside its rules
    but outside its holes goes to the majority arm. No measured cell changes hands: holes contain
    every cell a later arm won, and earlier rules of the majority's backend come first.
    """
    out: Dict[str, List[dict]] = defaultdict(list)
    position = {name: i for i, name in enumerate(backends)}
    for cat, members in sorted(groups.items()):
        counts: Dict[str, int] = defaultdict(int)
        for c in members:
            counts[win[c]] += 1
        ranked = sorted(counts.items(), key=lambda kv: (-kv[1], arms.index(kv[0])))
        top, n = ranked[0]
        if len(ranked) > 1 and ranked[1][1] == n:
            continue  # no majority: leave the group to the default backend
        name, options = _arm(top)
        if position[name] == len(backends) - 1:
            continue  # the default backend already takes the rest
        at = {(c[5], c[6]): win[c] for c in members}
        b_vals, l_vals = sorted({b for b, _ in at}), sorted({n for _, n in at})
        holes: List[tuple] = []
        for label in {w for w in at.values() if position[_arm(w)[0]] > position[name]}:
            mine = {pt for pt, w in at.items() if w == label}
            keep_off = {(c[5], c[6]) for c in members
                        if win[c] != label or stat.get((c, label)) not in (OK, SKIPPED, None)}
            keep_off -= mine
            holes += _arm_boxes(label, mine, keep_off, at, b_vals, l_vals)
        out[name] += [_rule(cat, box, options) for box in _complement(holes)]
    return dict(out)


def _arm_boxes(label: str, mine: set, keep_off: set, at: Dict[Tuple[int, int], str], b_vals: List[int],
               l_vals: List[int]) -> List[tuple]:
    """(min_batch, max_batch, min_kv_len, max_kv_len) boxes over an arm's cells `mine` that avoid `keep_off`.

    A box reaches past the grid on an axis only where the arm wins every measured cell of its own edge there
    (its span on the other axis): the nearest evidence for the cells beyond, where the default arm would
    otherwise be a guess; between grid points it ends at the midpoints (`_rule_box`)."""
    return [_rule_box(label, at, b_vals[bi0:bi1 + 1], l_vals[li0:li1 + 1], keep_off, b_vals, l_vals)
            for bi0, bi1, li0, li1 in _rectangles(mine, keep_off, b_vals, l_vals)]


def _rule(cat: tuple, box: tuple, options: Dict[str, object]) -> Dict[str, object]:
    """An allow rule for group `cat` over `box`; min_batch = 1 and min_kv_len = 0 say nothing: left out."""
    rule: Dict[str, object] = dict(zip(CAT_FIELDS, ([v] for v in cat)))
    rule.update(min_batch=box[0], max_batch=box[1], min_kv_len=box[2], max_kv_len=box[3])
    rule = {k: v for k, v in rule.items() if v is not None and (k, v) not in (("min_batch", 1), ("min_kv_len", 0))}
    if options:
        rule["options"] = options
    return rule


def _complement(boxes: List[tuple]) -> List[tuple]:
    """Boxes (min_batch, max_batch, min_kv_len, max_kv_len; None: unbounded) covering every (batch >= 1,
    kv_len >= 0) point outside `boxes`: the plane cut at every box edge, free pieces joined greedily."""
    b_cuts = sorted({1} | {b[0] for b in boxes if b[0] is not None} | {b[1] + 1 for b in boxes if b[1] is not None})
    l_cuts = sorted({0} | {b[2] for b in boxes if b[2] is not None} | {b[3] + 1 for b in boxes if b[3] is not None})

    def inside(v: int, lo: Optional[int], hi: Optional[int]) -> bool:
        return (lo is None or v >= lo) and (hi is None or v <= hi)

    taken = {(i, j) for i, b in enumerate(b_cuts) for j, n in enumerate(l_cuts)
             if any(inside(b, x[0], x[1]) and inside(n, x[2], x[3]) for x in boxes)}
    free = {(i, j) for i in range(len(b_cuts)) for j in range(len(l_cuts))} - taken
    pieces = _rectangles(free, taken, list(range(len(b_cuts))), list(range(len(l_cuts))))
    end = lambda cuts, k: None if k + 1 == len(cuts) else cuts[k + 1] - 1  # noqa: E731
    return [(b_cuts[i0], end(b_cuts, i1), l_cuts[j0], end(l_cuts, j1)) for i0, i1, j0, j1 in pieces]


def _edge_is(label: str, at: Dict[tuple, str], points) -> bool:
    """Whether `label` wins every measured cell among `points` (at least one): a joined, non-rectangular
    set of runs leaves holes, which say nothing either way."""
    measured = [at[pt] for pt in points if pt in at]
    return bool(measured) and all(w == label for w in measured)


def _merge(rules: List[dict], report: BenchReport) -> List[dict]:
    """Union rules that differ in one set-valued field.

    Sets stay even where they name every value of the grid: a rule says
    nothing about head counts, dtypes or page sizes that were not measured.
    """
    changed = True
    rules = [dict(r) for r in rules]
    while changed:
        changed = False
        for i in range(len(rules)):
            for j in range(i + 1, len(rules)):
                a, b = rules[i], rules[j]
                diff = [k for k in set(a) | set(b) if a.get(k) != b.get(k)]
                if len(diff) == 1 and diff[0] in CAT_FIELDS and diff[0] in a and diff[0] in b:
                    k = diff[0]
                    a[k] = sorted(set(a[k]) | set(b[k]), key=str)
                    del rules[j]
                    changed = True
                    break
            if changed:
                break
    return rules


def _arm_options(report: BenchReport) -> Dict[str, Tuple[str, Dict[str, object]]]:
    return {lbl: _arm(lbl) for lbl in sorted({r.backend for r in report.rows})}


def _label_for(name: str, options: Dict[str, object], arms: Dict[str, Tuple[str, Dict[str, object]]]) -> Optional[str]:
    """The measured arm that runs backend `name` with `options`: the exact one, else the closest subset."""
    best: Optional[Tuple[int, str]] = None
    for label, (arm_name, arm_opts) in arms.items():
        if arm_name != name:
            continue
        if arm_opts == options:
            return label
        if all(options.get(k, _MISSING) == v for k, v in arm_opts.items()):
            cand = (len(arm_opts), label)
            if best is None or cand[0] > best[0]:
                best = cand
    return None if best is None else best[1]


_MISSING = object()


def route_cells(order: Sequence[str], policy, report: BenchReport,
                deny: Optional[Dict[str, tuple]] = None, aliases: Optional[Dict[str, str]] = None,
                unmatched: Optional[set] = None) -> Dict[tuple, Optional[str]]:
    """The measured arm `policy` picks per cell of `report`, using the dispatcher's own rule code.

    Walks `order` as the dispatcher does: a backend is passed over where a
    deny rule matches, where no allow rule matches, or where its arm could
    not take the cell (the bench skipped it: can_implement said no); then,
    unless mla.strict_allow, the first one before the reference kept off only
    by its allow rules, with its base options (Dispatcher._outside_allow).

    A backend the policy runs with options that no measured arm of it matches (the built-in policy's
    flashinfer_mla with variant=auto, measured as variant=fa3 and variant=fa2) counts as the arm
    `aliases[name]` names; without one it is passed over as if it had refused the cell, and (name, options)
    goes into `unmatched` so that a caller can say so instead of reporting a route the policy would not take.
    """
    stat = statuses(report)
    arms = _arm_options(report)
    measured = {arm_name for arm_name, _ in arms.values()}

    def label_for(name: str, options: Dict[str, object]) -> Optional[str]:
        label = _label_for(name, options, arms)
        if label is None and name in measured:
            alias = (aliases or {}).get(name)
            if alias in arms:
                return alias
            if unmatched is not None:
                unmatched.add((name, tuple(sorted((k, str(v)) for k, v in options.items()))))
        return label

    deny = {n: bp.deny for n, bp in policy.backend.items()} if deny is None else deny
    picks: Dict[tuple, Optional[str]] = {}
    for r in report.rows:
        cell = _cell(r.problem)
        if cell in picks:
            continue
        picks[cell] = None
        for name in order:
            bp = policy.backend_policy(name)
            if any(not rule.mismatches(r.problem) for rule in deny.get(name, ())):
                continue
            if bp.allow and bp.rejections(r.problem):
                continue
            chosen = None
            for options in bp.option_sets(r.problem):
                label = label_for(name, options)
                if label is not None and stat.get((cell, label)) not in (SKIPPED, None):
                    chosen = label
                    break
            if chosen is not None:
                picks[cell] = chosen
                break
        picked = picks[cell]
        if not policy.mla.strict_allow and (picked is None or arms[picked][0] == "reference"):
            # as Dispatcher._outside_allow: the first backend before the reference (unless the reference is denied
            # here) that only its allow rules kept off, with its base options
            for name in order:
                denied = any(not rule.mismatches(r.problem) for rule in deny.get(name, ()))
                if name == "reference":
                    if denied:
                        continue
                    break
                bp = policy.backend_policy(name)
                if denied or not (bp.allow and bp.allow_misses(r.problem)):
                    continue
                label = label_for(name, dict(bp.options))
                if label is not None and stat.get((cell, label)) not in (SKIPPED, None):
                    picks[cell] = label
                    break
    return picks


def routes(order: Sequence[str], rules: Dict[str, List[dict]], report: BenchReport,
           base_policy_text: Optional[str] = None) -> Dict[tuple, Optional[str]]:
    """The arm the rules `build_rules` made pick per cell (with the deny rules of the base policy)."""
    data: Dict[str, Any] = {"mla": {"order": list(order)},
                            "backend": {n: {"allow": rs} for n, rs in rules.items()}}
    deny: Dict[str, tuple] = {}
    if base_policy_text is not None:
        # what the written file keeps from its base: deny rules, strict_allow and each backend's own options
        base = parse_policy_text(base_policy_text)
        deny = {n: bp.deny for n, bp in base.backend.items()}
        data["mla"]["strict_allow"] = base.mla.strict_allow
        for n, bp in base.backend.items():
            if bp.options:
                data["backend"].setdefault(n, {})["options"] = dict(bp.options)
    policy = parse_policy(data, "<tune>")
    return route_cells(order, policy, report, deny)


# -- validation ----------------------------------------------------------------------


@dataclass
class CellRegret:
    problem: DecodeProblem
    fastest: str
    fastest_us: float
    routed: Optional[str]
    routed_us: float = math.nan
    regret: Optional[float] = None  # routed / fastest - 1; None: the routed arm has no correct time here
    note: str = ""


@dataclass
class Validation:
    """How the written policy does on a second grid: regret of its pick against the fastest arm per cell."""

    grid: str
    date: str
    gpu: str
    cells: List[CellRegret] = field(default_factory=list)
    # (backend, options) the policy runs where no measured arm of that backend has those options (route_cells)
    unmatched: List[tuple] = field(default_factory=list)

    @property
    def failures(self) -> List[CellRegret]:
        return [c for c in self.cells if c.regret is None]

    @property
    def mean_regret(self) -> Optional[float]:
        vals = [c.regret for c in self.cells if c.regret is not None]
        return statistics.fmean(vals) if vals else None

    @property
    def worst_regret(self) -> Optional[float]:
        vals = [c.regret for c in self.cells if c.regret is not None]
        return max(vals) if vals else None

    def worst(self, n: int = 5) -> List[CellRegret]:
        """Cells without a correct routed time first, then by regret, largest first."""
        key = lambda c: (c.regret is not None, -(c.regret or 0.0), c.problem.describe())  # noqa: E731
        return sorted(self.cells, key=key)[:n]

    def summary(self, n: int = 5) -> Dict[str, object]:
        """What the tuned file records in [tuned.validation] (TOML: no nulls, regrets as fractions)."""
        out: Dict[str, object] = {"grid": self.grid, "date": self.date, "gpu": self.gpu, "cells": len(self.cells)}
        if self.mean_regret is not None:
            out["mean_regret"] = round(self.mean_regret, 4)
            out["worst_regret"] = round(self.worst_regret, 4)
        out["failed_cells"] = len(self.failures)
        worst = []
        for c in self.worst(n):
            entry: Dict[str, object] = {"cell": c.problem.describe(), "routed": c.routed or "-",
                                        "fastest": c.fastest}
            if c.regret is not None:
                entry["regret"] = round(c.regret, 4)
            if c.note:
                entry["note"] = c.note
            worst.append(entry)
        out["worst"] = worst
        return out


def validate(policy, report: BenchReport, order: Optional[Sequence[str]] = None,
             aliases: Optional[Dict[str, str]] = None) -> Validation:
    """Regret of `policy`'s pick per cell of `report` (measurements on a second grid, every arm timed);
    `aliases` as in route_cells, whose unmatched (backend, options) the result lists."""
    if order is None:
        order = [n for n in policy.mla.order if policy.backend_policy(n).enabled]
    unmatched: set = set()
    picks = route_cells(order, policy, report, aliases=aliases, unmatched=unmatched)
    rows: Dict[tuple, Dict[str, object]] = defaultdict(dict)
    problems: Dict[tuple, DecodeProblem] = {}
    for r in report.rows:
        rows[_cell(r.problem)][r.backend] = r
        problems.setdefault(_cell(r.problem), r.problem)
    fp = report.fingerprint or {}
    out = Validation(grid=report.grid, date=report.date, gpu=str(fp.get("gpu", "")), unmatched=sorted(unmatched))
    for cell in sorted(rows, key=str):
        ok = {lbl: r.time_us for lbl, r in rows[cell].items() if r.status == OK}
        if not ok:
            continue
        fastest = min(ok, key=lambda lbl: (ok[lbl], lbl))
        routed = picks.get(cell)
        entry = CellRegret(problems[cell], fastest, ok[fastest], routed)
        if routed is None:
            entry.note = "the policy routes this cell to no measured arm"
        elif routed in ok:
            entry.routed_us = ok[routed]
            entry.regret = max(0.0, ok[routed] / ok[fastest] - 1.0)
        else:
            entry.note = f"the routed arm is {rows[cell][routed].status} here"
        out.cells.append(entry)
    return out


def record_validation(text: str, summary: Dict[str, object], source: str = "<tune>") -> str:
    """`text` (a tuned policy) with [tuned.validation] set to `summary`, comments and all kept."""
    import tomlkit

    doc = tomlkit.parse(text)
    if "tuned" not in doc:
        raise TuneError(f"{source}: has no [tuned] section to record the validation in")
    table = tomlkit.table()
    for k, v in summary.items():
        if k == "worst":
            aot = tomlkit.aot()
            for entry in v:
                t = tomlkit.table()
                t.update(entry)
                aot.append(t)
            table[k] = aot
        else:
            table[k] = v
    doc["tuned"]["validation"] = table
    new = tomlkit.dumps(doc)
    parse_policy_text(new, source)  # what we write must load
    return new


def tune(report: BenchReport, policy_path: Path, base_text: str,
         rules_mode: str = "batch") -> Tuple[str, Dict[tuple, Tuple[str, str]]]:
    """New policy text and, per cell, (winner, routed) for the report. rules_mode (RULE_MODES): "boxes" routes
    every measured cell to its winner (build_rules), "batch" each group by one batch split (build_batch_rules)."""
    import tomlkit

    if rules_mode not in RULE_MODES:
        raise TuneError(f"rules: expected one of {', '.join(RULE_MODES)}, got {rules_mode!r}")
    win = winners(report)
    if rules_mode == "batch":
        order, rules, default, want = build_batch_rules(report)
        # where the rule's arm has no correct time the dispatcher may pass over it (skipped there): not checked
        stat = statuses(report)
        want = {c: a for c, a in want.items() if stat.get((c, a)) == OK}
        what = "its batch rule's arm"
    else:
        order, rules, default = build_rules(report)
        want, what = win, "its winner"
    picks = routes(order, rules, report, base_text)
    bad = {c: (w, picks.get(c)) for c, w in want.items() if picks.get(c) != w}
    if bad:
        cell, (w, got) = sorted(bad.items())[0]
        raise TuneError(f"the written rules would route cell {cell} to {got!r}, not {what} {w!r} "
                        "(a hand-written deny rule or option in the policy conflicts?)")
    doc = tomlkit.parse(base_text)
    mla = doc.setdefault("mla", tomlkit.table())
    old = [n for n in mla.get("order", []) if n not in order]
    mla["order"] = order + old
    if "backend" not in doc:
        doc["backend"] = tomlkit.table(is_super_table=True)
    backends = doc["backend"]
    for name in order:
        table = backends.setdefault(name, tomlkit.table())
        if "allow" in table:
            del table["allow"]
        if rules.get(name):
            aot = tomlkit.aot()
            for rule in rules[name]:
                t = tomlkit.table()
                for k, v in rule.items():
                    if k == "options":
                        inline = tomlkit.inline_table()
                        inline.update(v)
                        v = inline
                    t[k] = v
                aot.append(t)
            table["allow"] = aot
    fp = report.fingerprint
    tuned = tomlkit.table()
    tuned["gpu"] = str(fp.get("gpu", ""))
    tuned["capability"] = str(fp.get("capability", ""))
    tuned["driver"] = str(fp.get("driver", ""))
    tuned["torch"] = str(fp.get("torch", ""))
    measured = sorted({_arm(r.backend)[0] for r in report.rows})
    tuned["backends"] = {n: str(v) for n, v in sorted(dict(fp.get("backends", {})).items()) if n in measured}
    tuned["date"] = report.date
    tuned["grid"] = report.grid
    doc["tuned"] = tuned
    text = tomlkit.dumps(doc)
    parse_policy_text(text, str(policy_path))  # what we write must load
    return text, {c: (w, picks[c]) for c, w in win.items()}


def write_atomically(path: Path, text: str) -> None:
    """Replace `path` with `text` so that a reader sees the old file or the new one, never half of one.

    A symlink is written through (its target is replaced, the link stays);
    the file keeps its permission bits (new files get the umask's); the data
    is fsynced before the rename and the directory after it.
    """
    target = Path(os.path.realpath(path))
    try:
        mode: Optional[int] = stat.S_IMODE(os.stat(target).st_mode)
    except FileNotFoundError:
        mode = None
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=str(target.parent))
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            if mode is None:
                umask = os.umask(0)
                os.umask(umask)
                mode = 0o666 & ~umask
            os.fchmod(fh.fileno(), mode)
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    try:
        dir_fd = os.open(str(target.parent), os.O_RDONLY)
    except OSError:  # some platforms cannot open a directory; the rename is done either way
        return
    try:
        os.fsync(dir_fd)
    except OSError:
        pass
    finally:
        os.close(dir_fd)
