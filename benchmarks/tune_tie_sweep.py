"""Leave-one-grid-out regret of `mla tune` under other tie margins (CPU only, the stored H200 runs).

`benchmarks/tune_crossval.sh` checks the tuner as committed; this asks whether its two margins (TIE: a
cell's arms within it count as tied; GROUP_TIE: an arm within it at every cell of a group takes the
group) are what keeps the worst held-out cell above 5%. Per (TIE, GROUP_TIE) pair, one line of
"mean/worst" regret in percent, one per held-out grid (the order of GRIDS).

    python benchmarks/tune_tie_sweep.py        (from the repository root, the project installed)
"""

from __future__ import annotations

import pathlib
import tomllib

import mlacore.tools.tune as T
from mlacore.policy import parse_policy
from mlacore.tools import cli

R = "docs/results/"
GRIDS = ["h200_tune_bench", "h200_tune_offgrid_bench", "h200_tune_offgrid2_bench",
         "h200_validate_offgrid5s_bench", "h200_validate_offgrid6_bench", "h200_validate_offgrid7_bench"]
ALWAYS = ["h200_tune_refine6_bench"]
MARGINS = [(0.03, 0.05), (0.03, 0.10), (0.03, 0.20), (0.06, 0.05), (0.10, 0.10)]


def main() -> None:
    reports = {g: cli._read_report(R + g + ".json", "--from") for g in GRIDS + ALWAYS}
    base = pathlib.Path("mlacore/default_policy.toml").read_text()
    print("TIE GROUP_TIE  " + "  ".join(g.replace("_bench", "") for g in GRIDS))
    for tie, group_tie in MARGINS:
        T.winners.__defaults__ = (tie, group_tie)  # the margins build_rules uses through winners()
        cells = []
        for held in GRIDS:
            names = [g for g in GRIDS + ALWAYS if g != held]
            joined = T.join_reports([reports[g] for g in names], names)
            text, _ = T.tune(joined, pathlib.Path("policy.toml"), base)
            v = T.validate(parse_policy(tomllib.loads(text)), reports[held])
            cells.append(f"{100 * v.mean_regret:.2f}/{100 * v.worst_regret:.1f}")
        print(f"{tie:.2f} {group_tie:.2f}  " + "  ".join(cells))


if __name__ == "__main__":
    main()
