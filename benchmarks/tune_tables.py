"""Markdown tables of `mla bench -o` runs: per (cache dtype, heads, s_q), FlashInfer's best time over
cute_dsl_mla's per (batch, kv length) cell, with the fastest arm's initial; the input of
docs/results/h200_tune.md.

    python benchmarks/tune_tables.py docs/results/h200_tune_bench.json docs/results/h200_tune_offgrid_bench.json ...
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from typing import Dict, List, Tuple

from mlacore.tools.bench import OK, report_from_json

OURS = "cute_dsl_mla"
INITIAL = {"cute_dsl_mla": "c", "flashinfer_mla:variant=fa3": "3", "flashinfer_mla:variant=fa2": "2"}


def tables(paths: List[str]) -> str:
    import json

    times: Dict[Tuple, Dict[str, float]] = defaultdict(dict)
    wrong: Dict[Tuple, List[str]] = defaultdict(list)
    for path in paths:
        with open(path, encoding="utf-8") as fh:
            report = report_from_json(json.load(fh))
        for r in report.rows:
            p = r.problem
            key = (p.kv_dtype, p.num_heads, p.seq_len_q, p.batch_size, p.max_kv_len)
            if r.status == OK:
                times[key][r.backend] = r.time_us
            elif r.status != "skipped":
                wrong[key].append(f"{r.backend} {r.status}")
    out = []
    for cat in sorted({k[:3] for k in times}, key=lambda c: (c[0] != "fp8_e4m3", c[1], c[2])):
        cells = {k[3:]: v for k, v in times.items() if k[:3] == cat}
        bs = sorted({b for b, _ in cells})
        ls = sorted({n for _, n in cells})
        out.append(f"**{cat[0]} cache, H={cat[1]}, s_q={cat[2]}**: FlashInfer's best (fa3, fa2) time / "
                   f"{OURS} time (>1: ours faster); the fastest arm: c ours, 3 fa3, 2 fa2\n")
        out.append("| B \\ S | " + " | ".join(str(n) for n in ls) + " |")
        out.append("|---|" + "---|" * len(ls))
        for b in bs:
            row = []
            for n in ls:
                ts = cells.get((b, n))
                fi = [t for a, t in (ts or {}).items() if a != OURS]
                if not ts or OURS not in ts or not fi:
                    row.append("")
                    continue
                fastest = min(ts, key=ts.get)
                row.append(f"{min(fi) / ts[OURS]:.2f} {INITIAL.get(fastest, '?')}")
            out.append(f"| {b} | " + " | ".join(row) + " |")
        out.append("")
    for key, notes in sorted(wrong.items()):
        out.append(f"- not timed (failed the reference check or errored): {key}: {', '.join(notes)}")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("reports", nargs="+", help="`mla bench -o` / `mla tune -o` JSON files of one machine")
    print(tables(ap.parse_args().reports))


if __name__ == "__main__":
    main()
