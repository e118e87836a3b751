"""How low can the worst held-out cell go? Bounds and rule-writing strategies over the stored H200 runs (CPU only).

Leave-one-grid-out, like `benchmarks/tune_crossval.sh`: per held-out grid, the other grids are the training data.
Per fold, "mean/worst/n" is the mean regret and the worst regret in percent over the held-out cells and n the
number of held-out cells more than 5% slow than their fastest arm.

Rows:

* `committed tuner`: `mla tune --rules boxes` as committed (rules written, then routed by the dispatcher's own
  code); the batch rules, `mla tune`'s default since the fourteenth session, are the `batch split` row.
* bounds that look at the held-out times (no strategy can use them; they say what is reachable):
  - `single arm/group, hindsight`: per (heads, s_q, dtypes, page size) group the one arm with the smallest
    worst regret over the held-out cells of that group;
  - `best corner winner, hindsight`: per held-out cell, the best of the arms that win one of its *corners*, the
    measured training cells around it (the nearest measured batch at or below and at or above the cell's batch
    in its group, and on each of those batch lines the nearest measured lengths at or below and at or above).
    Any rule that routes the space between (or past) measured cells to the winner of one of the cells around
    it does no better than this;
  - `best corner arm <=3%, hindsight`: the same with every arm within the tuner's TIE (3%) of a corner's
    fastest counted as a winner there.
  The rule language (allow boxes over batch x kv length per group) itself bounds nothing: a box can be a single
  (batch, length) point, so any routing of a finite grid is expressible; what is missing is the knowledge.
* strategies that look only at the training data (what `mla tune` could write; each is expressible as boxes):
  - `single arm/group, minimax`: per group the arm with the smallest worst regret over the training cells;
  - `nearest corner winner`: the winner of the corner nearest in log(batch), log(length) (about what the
    committed tuner's geometric midpoints do, without its tie margins and edge rules);
  - `minimax over corners`: the arm whose worst ratio to the fastest over the corners is smallest (mean ratio,
    then the label, break ties);
  - `group arm <=5%, else minimax`: a group whose training cells all have one arm within 5% of the fastest
    gets that arm (as the tuner's GROUP_TIE), every other group `minimax over corners`;
  - `line arm <=5%, else minimax`: the same one level down: where one arm is within 5% of the fastest at every
    measured cell of the corners' batch lines (all their lengths), that arm, else `minimax over corners`.

    python benchmarks/tune_bounds.py            (from the repository root; WORST=3 lists each fold's worst cells;
                                                R=docs/results/gpu13_tune GRIDS="..." for another run set)
"""

from __future__ import annotations

import math
import os
import pathlib
import statistics
try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10, as mlacore.policy
    import tomli as tomllib
from collections import defaultdict
from typing import Callable, Dict, List, Set, Tuple

import mlacore.tools.tune as T
from mlacore.policy import parse_policy
from mlacore.tools import cli

R = os.environ.get("R", "docs/results").rstrip("/") + "/"
GRIDS = os.environ.get("GRIDS", "h200_tune9_bench h200_tune9_offgrid_bench h200_tune9_offgrid2_bench "
                       "h200_validate9_lengths8_bench").split()
SLOW = 0.05  # the target's bound on any one cell

Point = Tuple[int, int]  # (batch, max kv length)
Times = Dict[str, float]  # arm label -> time (us), the arms that ran correctly
Group = Dict[Point, Times]
# a strategy: (training cells of the group, batch, length) -> arm label
Strategy = Callable[[Group, int, int], str]


def by_group(times: Dict[tuple, Times]) -> Dict[tuple, Group]:
    out: Dict[tuple, Group] = defaultdict(dict)
    for cell, ts in times.items():
        out[cell[:5]][(cell[5], cell[6])] = ts
    return out


def ratio(ts: Times, arm: str) -> float:
    return ts[arm] / min(ts.values()) if arm in ts else math.inf


def winner(ts: Times) -> str:
    return min(ts, key=lambda a: (ts[a], a))


def _around(values: List[int], v: int) -> List[int]:
    """The nearest value at or below `v` and the nearest at or above (one when `v` is measured or past the edge)."""
    lo = max((x for x in values if x <= v), default=None)
    hi = min((x for x in values if x >= v), default=None)
    return sorted({x for x in (lo, hi) if x is not None})


def corners(train: Group, b: int, n: int) -> Set[Point]:
    """The measured cells around (b, n): nearest measured batches, on each batch line its nearest lengths."""
    out: Set[Point] = set()
    for bb in _around(sorted({x for x, _ in train}), b):
        for nn in _around(sorted(y for x, y in train if x == bb), n):
            out.add((bb, nn))
    return out


def _log_dist(p: Point, q: Point) -> float:
    return math.hypot(math.log(p[0] / q[0]), math.log(max(p[1], 1) / max(q[1], 1)))


def nearest_corner_winner(train: Group, b: int, n: int) -> str:
    return winner(train[min(corners(train, b, n), key=lambda p: (_log_dist(p, (b, n)), p))])


def _minimax(cells: List[Times], arms: List[str]) -> str:
    return min(arms, key=lambda a: (max(ratio(t, a) for t in cells), statistics.fmean(ratio(t, a) for t in cells), a))


def _arms(train: Group) -> List[str]:
    return sorted({a for ts in train.values() for a in ts})


def minimax_corners(train: Group, b: int, n: int) -> str:
    return _minimax([train[p] for p in corners(train, b, n)], _arms(train))


def single_arm_minimax(train: Group, b: int, n: int) -> str:
    return _minimax(list(train.values()), _arms(train))


def group_arm_else_minimax(train: Group, b: int, n: int) -> str:
    arm = single_arm_minimax(train, b, n)
    if max(ratio(t, arm) for t in train.values()) <= 1.0 + SLOW:
        return arm
    return minimax_corners(train, b, n)


def line_arm_else_minimax(train: Group, b: int, n: int) -> str:
    lines = {bb for bb, _ in corners(train, b, n)}
    cells = [ts for (bb, _), ts in train.items() if bb in lines]
    arm = _minimax(cells, _arms(train))
    if max(ratio(t, arm) for t in cells) <= 1.0 + SLOW:
        return arm
    return minimax_corners(train, b, n)


def batch_split_minimax(train: Group, b: int, n: int) -> str:
    """`mla tune --rules batch` (tune.batch_split, the second arm from the geometric midpoint tune.split_point)."""
    members = [(0, 0, "", "", 0, bb, nn) for bb, nn in train]
    t, lo, hi = T.batch_split(members, {(0, 0, "", "", 0, bb, nn): ts for (bb, nn), ts in train.items()})
    above = [bb for bb, _ in train if bb > t]
    return lo if not above or b <= T.split_point(t, min(above)) else hi


def _length_split(cells: List[Tuple[int, Times]], arms: List[str]):
    """((worst, mean, two arms), (t, arm for length <= t, arm above)) minimax over one batch side's cells."""
    lens = sorted({n for n, _ in cells})
    best = None
    for t in lens:
        for a in arms:
            for c in ([x for x in arms if x != a] if t < lens[-1] else [a]):
                rs = [ratio(ts, a if n <= t else c) for n, ts in cells]
                key = (max(rs), statistics.fmean(rs), a != c)
                if best is None or key < best[0]:
                    best = (key, (t, a, c))
    return best


def batch_length_split_minimax(train: Group, b: int, n: int) -> str:
    """The batch split with, on each side of it, one more split along kv length (up to four boxes per group)."""
    arms = _arms(train)
    best = None
    for t in sorted({x for x, _ in train}):
        lo = [(nn, ts) for (bb, nn), ts in train.items() if bb <= t]
        hi = [(nn, ts) for (bb, nn), ts in train.items() if bb > t]
        rl, rh = _length_split(lo, arms), (_length_split(hi, arms) if hi else None)
        key = (max(rl[0][0], rh[0][0] if rh else 0.0),
               (rl[0][1] * len(lo) + (rh[0][1] * len(hi) if rh else 0.0)) / len(train))
        if best is None or key < best[0]:
            best = (key, t, rl[1], rh[1] if rh else None, lo, hi)
    _, t, rl, rh, lo, hi = best
    above = [bb for bb, _ in train if bb > t]
    (lt, a, c), cells = (rl, lo) if not above or b <= T.split_point(t, min(above)) else (rh, hi)
    longer = [x for x, _ in cells if x > lt]
    return a if not longer or n <= T.split_point(lt, min(longer)) else c


Regrets = List[Tuple[float, tuple, Point]]  # (regret, group, point), worst first


def simulate(strategy: Strategy, train: Dict[tuple, Group], held: Dict[tuple, Group]) -> Regrets:
    """Regret per held-out cell of `strategy` (a measured training cell is routed to its winner)."""
    out: Regrets = []
    for cat, cells in held.items():
        for pt, ts in cells.items():
            arm = winner(train[cat][pt]) if pt in train[cat] else strategy(train[cat], *pt)
            out.append((ratio(ts, arm) - 1.0, cat, pt))
    return sorted(out, reverse=True)


def single_arm_hindsight(train: Dict[tuple, Group], held: Dict[tuple, Group]) -> Regrets:
    out: Regrets = []
    for cat, cells in held.items():
        arm = _minimax(list(cells.values()), _arms(cells))
        out += [(ratio(ts, arm) - 1.0, cat, pt) for pt, ts in cells.items()]
    return sorted(out, reverse=True)


def corner_winner_hindsight(train: Dict[tuple, Group], held: Dict[tuple, Group], tie: float = 0.0) -> Regrets:
    """Per held-out cell, the best arm among those within `tie` of the fastest at one of its corners."""
    out: Regrets = []
    for cat, cells in held.items():
        for pt, ts in cells.items():
            arms = {a for p in corners(train[cat], *pt) for a in train[cat][p] if ratio(train[cat][p], a) <= 1.0 + tie}
            out.append((min(ratio(ts, a) for a in arms) - 1.0, cat, pt))
    return sorted(out, reverse=True)


def committed_tuner(reports: dict, held_name: str) -> Regrets:
    names = [g for g in GRIDS if g != held_name]
    joined = T.join_reports([reports[g] for g in names], names)
    base = pathlib.Path("mlacore/default_policy.toml").read_text()
    text, _ = T.tune(joined, pathlib.Path("policy.toml"), base, "boxes")
    v = T.validate(parse_policy(tomllib.loads(text)), reports[held_name])
    return sorted(((c.regret if c.regret is not None else math.inf, T._cell(c.problem)[:5],
                    (c.problem.batch_size, c.problem.max_kv_len)) for c in v.cells), reverse=True)


def builtin_default(reports: dict, held_name: str) -> Regrets:
    """The built-in policy (mlacore/default_policy.toml) as shipped: no training, its hand-written rules. Its
    FlashInfer rules carry no variant (auto), which on sm_90 runs fa3: the runs' fa3 arm stands for it."""
    base = pathlib.Path("mlacore/default_policy.toml").read_text()
    base = base.replace("[mla]", '[backend.flashinfer_mla.options]\nvariant = "fa3"\n\n[mla]', 1)
    v = T.validate(parse_policy(tomllib.loads(base)), reports[held_name])
    return sorted(((c.regret if c.regret is not None else math.inf, T._cell(c.problem)[:5],
                    (c.problem.batch_size, c.problem.max_kv_len)) for c in v.cells), reverse=True)


def _fmt(rs: Regrets) -> str:
    vals = [r for r, _, _ in rs]
    return f"{100 * statistics.fmean(vals):.2f}/{100 * vals[0]:.1f}/{sum(v > SLOW for v in vals)}"


def main() -> None:
    reports = {g: cli._read_report(R + g + ".json", "--from") for g in GRIDS}
    times = {g: T._times(r) for g, r in reports.items()}
    show = int(os.environ.get("WORST", "0"))
    rows: List[Tuple[str, Callable[[str, Dict[tuple, Group], Dict[tuple, Group]], Regrets]]] = [
        ("committed tuner", lambda g, tr, hd: committed_tuner(reports, g)),
        ("built-in default policy", lambda g, tr, hd: builtin_default(reports, g)),
        ("single arm/group, hindsight", lambda g, tr, hd: single_arm_hindsight(tr, hd)),
        ("best corner winner, hindsight", lambda g, tr, hd: corner_winner_hindsight(tr, hd)),
        ("best corner arm <=3%, hindsight", lambda g, tr, hd: corner_winner_hindsight(tr, hd, T.TIE)),
    ] + [(name, (lambda s: lambda g, tr, hd: simulate(s, tr, hd))(s)) for name, s in (
        ("single arm/group, minimax", single_arm_minimax),
        ("nearest corner winner", nearest_corner_winner),
        ("minimax over corners", minimax_corners),
        ("group arm <=5%, else minimax", group_arm_else_minimax),
        ("line arm <=5%, else minimax", line_arm_else_minimax),
        ("batch split, minimax (--rules batch)", batch_split_minimax),
        ("batch x length split, minimax", batch_length_split_minimax),
    )]
    print(f"{'mean%/worst%/cells>5%':33}" + "  ".join(f"{g.replace('_bench', ''):>16}" for g in GRIDS))
    for name, fn in rows:
        results: List[Regrets] = []
        for held in GRIDS:
            train_times: Dict[tuple, Times] = {}
            for g in GRIDS:
                if g != held:
                    train_times.update(times[g])
            results.append(fn(held, by_group(train_times), by_group(times[held])))
        print(f"{name:33}" + "  ".join(f"{_fmt(rs):>16}" for rs in results))
        for held, rs in zip(GRIDS, results) if show else ():
            cells = ", ".join(f"H={c[0]} s_q={c[1]} {c[3]} B={p[0]} S={p[1]} {100 * r:.1f}" for r, c, p in rs[:show])
            print(f"    {held}: {cells}")


if __name__ == "__main__":
    main()
