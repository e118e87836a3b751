"""`mla tune`: from measurements to allow rules that route each cell to its winner.

Rules are built so that the real dispatcher, reading the written policy,
picks the fastest correct backend measured for every cell of the grid:

* the backend that wins most cells goes last among the winners and gets no
  allow rule (it is the default for shapes the grid did not cover);
* every other winner, ordered from fewest wins up, gets rectangles over
  (batch, kv length) per (heads, s_q, dtypes, page size) group, grown as far
  as they can without touching a cell that a later backend must keep
  (where this backend is slower, or wrong); then rules that differ in one
  set-valued field are merged.

The result is checked against the dispatcher's own rule matching before it
is written. Timing never enters decisions at run time: the file does.
"""

from __future__ import annotations

import os
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from .bench import OK, SKIPPED, BackendSpec, BenchReport
from ..policy import parse_policy, parse_policy_text
from ..problem import DecodeProblem

CAT_FIELDS = ("num_heads", "seq_len_q", "q_dtype", "kv_dtype", "page_size")


class TuneError(ValueError):
    pass


def _cell(p: DecodeProblem) -> tuple:
    return (p.num_heads, p.seq_len_q, p.q_dtype, p.kv_dtype, p.page_size, p.batch_size, p.max_kv_len)


def winners(report: BenchReport) -> Dict[tuple, str]:
    """Fastest correct arm (backend label, options included) per cell; ties: the first label in sort order."""
    best: Dict[tuple, Tuple[float, str]] = {}
    for r in report.rows:
        if r.status != OK:
            continue
        key = _cell(r.problem)
        cand = (r.time_us, r.backend)
        if key not in best or cand < best[key]:
            best[key] = cand
    return {k: v[1] for k, v in best.items()}


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


def _bounds(lo_i: int, hi_i: int, vals: List[int]) -> Tuple[Optional[int], Optional[int]]:
    lo = vals[lo_i] if lo_i > 0 else None
    hi = vals[hi_i + 1] - 1 if hi_i + 1 < len(vals) else None
    return lo, hi


def arm_order(report: BenchReport) -> Tuple[List[str], List[str]]:
    """(backend order, arm order): arms of one backend stay together, as the policy must write them.

    Backends go from fewest cells won to most; the backend that wins most is
    last, and its best arm last of all, so that it can take every cell that
    no earlier rule claims.
    """
    win = winners(report)
    arm_wins: Dict[str, int] = defaultdict(int)
    for label in win.values():
        arm_wins[label] += 1
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
    groups: Dict[tuple, List[tuple]] = defaultdict(list)
    for c in sorted(win):
        groups[c[:5]].append(c)
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
            for bi0, bi1, li0, li1 in _rectangles(mine, keep_off, b_vals, l_vals):
                rule = dict(zip(CAT_FIELDS, ([v] for v in cat)))
                lo, hi = _bounds(bi0, bi1, b_vals)
                rule.update(min_batch=lo, max_batch=hi)
                lo, hi = _bounds(li0, li1, l_vals)
                rule.update(min_kv_len=lo, max_kv_len=hi)
                rule = {k: v for k, v in rule.items() if v is not None}
                if options:
                    rule["options"] = options
                out.append(rule)
        rules.setdefault(name, []).extend(_merge(out, report))
    return backends, rules, default


def _merge(rules: List[dict], report: BenchReport) -> List[dict]:
    """Union rules that differ in one set-valued field; drop sets that name every grid value."""
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
    every = {k: {getattr(r.problem, k) for r in report.rows} for k in CAT_FIELDS}
    for r in rules:
        for k in CAT_FIELDS:
            if k in r and set(r[k]) == every[k]:
                del r[k]
    return rules


def routes(order: Sequence[str], rules: Dict[str, List[dict]], report: BenchReport,
           base_policy_text: Optional[str] = None) -> Dict[tuple, Optional[str]]:
    """The arm the written policy picks per cell, using the dispatcher's own rule code.

    A backend is passed over where its measured arm could not take the cell
    (can_implement said no), exactly as the dispatcher would.
    """
    data = {"mla": {"order": list(order)},
            "backend": {n: {"allow": rs} for n, rs in rules.items()}}
    policy = parse_policy(data, "<tune>")
    deny: Dict[str, tuple] = {}
    if base_policy_text is not None:
        deny = {n: bp.deny for n, bp in parse_policy_text(base_policy_text).backend.items()}
    stat = statuses(report)
    labels = {(spec.name, tuple(sorted(spec.options))): lbl
              for lbl in {r.backend for r in report.rows} for spec in [BackendSpec.parse(lbl)]}
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
            chosen = None
            for options in bp.option_sets(r.problem) if bp.allow else [{}]:
                if bp.allow and bp.rejections(r.problem):
                    break
                label = labels.get((name, tuple(sorted(options.items()))))
                if label is not None and stat.get((cell, label)) not in (SKIPPED, None):
                    chosen = label
                    break
            if chosen is not None:
                picks[cell] = chosen
                break
    return picks


def tune(report: BenchReport, policy_path: Path, base_text: str) -> Tuple[str, Dict[tuple, Tuple[str, str]]]:
    """New policy text and, per cell, (winner, routed) for the report."""
    import tomlkit

    order, rules, default = build_rules(report)
    win = winners(report)
    picks = routes(order, rules, report, base_text)
    bad = {c: (w, picks.get(c)) for c, w in win.items() if picks.get(c) != w}
    if bad:
        cell, (w, got) = sorted(bad.items())[0]
        raise TuneError(f"the written rules would route cell {cell} to {got!r}, not its winner {w!r} "
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
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=str(path.parent or "."))
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
