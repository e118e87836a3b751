"""Pure-Python model of the balanced seesaw kernel's column walk (``MLADecodePartialWGMMASeesaw(balanced=True)``):
a CTA column runs several work items back to back with the same 4 mbarriers, so their phases continue across
items.  Each item is the one-item program of ``test_seesaw_protocol.py`` (its prologue loads, CTA barrier, pairs,
epilogue barrier: the KV pipeline drains at every item boundary), with tiles renumbered along the column and the
mbarrier wait parities the kernel computes (``seesaw_item_phases`` / ``seesaw_pair_parities``).  The same checker
(``run``: no deadlock, no WAR/RAW hazard on K blocks, P or the rescale slots, parity waits on the right phase,
TMA page tails zeroed before P V) runs on columns of 0-6 items of 0-9 tiles (odd, 1, partial last tiles), and a
mutation (parities restarted per item, as the one-item kernel computes them) must be caught."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest

from test_seesaw_protocol import run, wg_program  # noqa: E402  (same directory)

from mla_cute_dsl.kernels.sm90_wgmma_decode import seesaw_item_phases, seesaw_pair_parities

KERNEL_SRC = Path(__file__).resolve().parents[1] / "mla_cute_dsl" / "kernels" / "sm90_wgmma_decode.py"


def column_programs(items, tma=False, restart=False):
    """The two warpgroups' events for a column of items [(T, tail), ...] and the set of tail tiles (column tile
    numbers).  ``restart``: the mutation that waits with the one-item kernel's p % 2 in every item."""
    progs = [[], []]
    tails = set()
    g = 0
    ph = [0, 0]
    for T, tail in items:
        if tail and T > 0:
            tails.add(g + T - 1)
        for w in (0, 1):
            for ev in wg_program(w, T, None, False, tma, tail):
                k = ev[0]
                if k == "load":
                    ev = ("load", g + ev[1]) + ev[2:]
                elif k == "mwait":
                    _, mb, par = ev  # par = p % 2 of the item's pair p: the kernel's (ph + p) % 2 is the same mod 2
                    if not restart:
                        par = seesaw_pair_parities(ph[0], ph[1], par)[mb // 2]
                    ev = ("mwait", mb, par)
                elif k == "zero":
                    _, buf, t, blocks, mb, p = ev
                    ev = ("zero", buf, g + t, blocks, mb, ph[buf] + p)
                elif k == "read":
                    ev = ("read", ev[1], g + ev[2]) + ev[3:]
                elif k in ("write_p", "write_scale", "read_scale"):
                    ev = (k, ev[1], g + ev[2])
                progs[w].append(ev)
        d0, d1 = seesaw_item_phases(T)
        ph = [ph[0] + d0, ph[1] + d1]
        g += T
    return progs, tails


FIXED_COLUMNS = [
    [],  # a column with no item
    [(1, True)],
    [(1, False), (1, True), (1, False)],  # 1-tile items in a row: buffer 0 only
    [(3, True), (2, False)],  # odd then even: buffer 1 one phase behind buffer 0
    [(5, False), (4, True), (3, True)],
    [(2, True), (7, True), (1, False), (6, False)],
    [(0, False), (3, False)],  # a 0-tile item (never planned; the kernel runs it as the one-item kernel does)
]


def _random_columns(n, seed=7):
    rng = random.Random(seed)
    return [[(rng.randint(0, 9), rng.random() < 0.5) for _ in range(rng.randint(1, 6))] for _ in range(n)]


@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("items", FIXED_COLUMNS + _random_columns(24), ids=repr)
def test_balanced_column_has_no_deadlock_or_hazard(items, tma):
    progs, tails = column_programs(items, tma=tma)
    bad = {seed: e for seed in range(40) if (e := run(0, seed, tma=tma, programs=progs, tail_tiles=tails))}
    assert not bad, next(iter(bad.items()))


@pytest.mark.parametrize("tma", [False, True])
def test_the_model_catches_parities_restarted_per_item(tma):
    """Waiting with p % 2 in every item (the one-item kernel's parities) is wrong once an earlier item completed
    an odd number of phases on a buffer: after T = 3 (buffer 0 two phases, buffer 1 one) and after T = 2 (one
    each)."""
    for first in (3, 2, 1):
        progs, tails = column_programs([(first, False), (2, False)], tma=tma, restart=True)
        assert any(run(0, s, tma=tma, programs=progs, tail_tiles=tails) for s in range(10)), first
    # and it is silent where the restart happens to be right (an even number of phases on both buffers)
    progs, tails = column_programs([(4, False), (4, False)], tma=tma, restart=True)
    assert not any(run(0, s, tma=tma, programs=progs, tail_tiles=tails) for s in range(10))


def test_the_model_catches_an_unzeroed_tail_in_a_later_item():
    """A tail tile of the second item whose zeroing is dropped is reported (the tail set is per column tile)."""
    progs, tails = column_programs([(3, False), (3, True)], tma=True)
    progs = [[e for e in p if e[0] != "zero"] for p in progs]
    assert any(run(0, s, tma=True, programs=progs, tail_tiles=tails) for s in range(10))


def test_phase_helpers():
    assert [seesaw_item_phases(T) for T in range(6)] == [(0, 0), (1, 0), (1, 1), (2, 1), (2, 2), (3, 2)]
    assert seesaw_pair_parities(0, 0, 3) == (1, 1) and seesaw_pair_parities(3, 2, 0) == (1, 0)
    # each tile is one phase on both mbarriers of its buffer: the loads of an item, counted by buffer
    for T in range(12):
        loads = [e for e in wg_program(0, T) if e[0] == "load"]
        assert (sum(e[2] == 0 for e in loads), sum(e[2] == 1 for e in loads)) == seesaw_item_phases(T)


def test_the_kernel_computes_what_the_model_checks():
    """Source check: the balanced kernel's running phase counts and per-pair parities are the helpers' formulas,
    the one-item kernel's waits keep p % 2, and every 16-bit wait passes the parity of its buffer."""
    src = KERNEL_SRC.read_text()
    for line in ("ph0 = ph0 + (T + 1) // 2", "ph1 = ph1 + T // 2", "par0 = (ph0 + p) % 2", "par1 = (ph1 + p) % 2",
                 "parity = p % 2", "par0 = parity", "par1 = parity", "if cutlass.const_expr(ph0 is not None):"):
        assert line in src, line
    # 16-bit path: buffer-0 waits (mbar + 0 / + 1) with par0, buffer-1 waits (mbar + 2 / + 3) with par1
    item = src[src.index("    def seesaw_item("):src.index("# ---------------------------------------------------------------------- host helpers")]
    sixteen = item[item.index("            else:\n                if wg == 0:\n                    # S_a"):]
    waits = re.findall(r"mbar \+ (\d)(?:, mbar \+ (\d))?,\s*(par\d|parity)\)", sixteen)
    assert waits, "no waits found"
    for a, b, par in waits:
        bufs = {int(a) // 2} | ({int(b) // 2} if b else set())
        assert len(bufs) == 1 and par == f"par{bufs.pop()}", (a, b, par)
    assert len(waits) == 6
