"""Pure-Python model of the balanced seesaw kernel's column walk (``MLADecodePartialWGMMASeesaw(balanced=True)``):
a CTA column runs several work items back to back with the same 4 mbarriers, so their phases continue across
items.  Each item is the one-item program of ``test_seesaw_protocol.py`` (its prologue loads, CTA barrier, pairs,
epilogue barrier: the KV pipeline drains at every item boundary), with tiles renumbered along the column and the
mbarrier wait parities the kernel computes (``seesaw_item_phases`` / ``seesaw_pair_parities``).  The same checker
(``run``: no deadlock, no WAR/RAW hazard on K blocks, P or the rescale slots, parity waits on the right phase,
TMA page tails zeroed before P V) runs on columns of 0-6 items of 0-9 tiles (odd, 1, partial last tiles), and a
mutation (parities restarted per item, as the one-item kernel computes them) must be caught.

fp8 cache (branch fp8-balanced): each item is the one-item fp8 program (``wg_program_fp8``: parts ld.global'ed into
registers, "ldg", and converted + stored later, "load"), and the column adds the state the fp8 item loop has: Q is
converted into sQ by st.shared ("write_q", each warpgroup its rows) at the start of every item whose request differs
from the previous item's, and every S WGMMA reads all of sQ ("read" of ("Q", 0/1) right after each KV mbarrier
wait's K read, in flight until the warpgroup's next WGMMA wait).  Checked in addition: sQ is never written while an
S WGMMA of the previous item may still read it, every S reads the Q of its own request, the staging registers are
empty at every item boundary (an "ldg" never crosses into the next item), plus the run's fp8 checks (each store
converts what the warpgroup's last ldg fetched, no ldg over unstored registers).  Mutations caught: parities
restarted per item, Q not reconverted when the request changes, Q converted while the previous item's last S WGMMA
may still read sQ, a part staged past the end of an item."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest

from test_seesaw_protocol import LOAD, run, wg_program  # noqa: E402  (same directory)

from mla_cute_dsl.kernels.sm90_wgmma_decode import seesaw_item_phases, seesaw_pair_parities

KERNEL_SRC = Path(__file__).resolve().parents[1] / "mla_cute_dsl" / "kernels" / "sm90_wgmma_decode.py"


def column_programs(items, tma=False, restart=False, wg1of=False):
    """The two warpgroups' events for a column of items [(T, tail), ...] and the set of tail tiles (column tile
    numbers).  ``restart``: the mutation that waits with the one-item kernel's p % 2 in every item.  ``wg1of``:
    wg1_other_first (test_seesaw_protocol.wg1_qk)."""
    progs = [[], []]
    tails = set()
    g = 0
    ph = [0, 0]
    for T, tail in items:
        if tail and T > 0:
            tails.add(g + T - 1)
        for w in (0, 1):
            for ev in wg_program(w, T, None, False, tma, tail, wg1of):
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


def column_programs_fp8(items, mutate=None):
    """fp8 cache: the two warpgroups' events for a column of items [(T, request), ...] (the kernel reconverts Q
    when an item's request differs from the previous item's: ``b != q_of``).  Mutations: "restart" (parities p % 2
    in every item), "q_kept" (Q never reconverted after the column's first item), "q_early" (the next item's Q
    written right after the warpgroup issued its last S of the previous item, before waiting for it: sQ overwritten
    under an S WGMMA), "stage_past_item" (WG0 ld.global's a part of the tile after an item's last one at the end of
    the item's last pair, to store it in the next item).  Note (the model's finding): a write_q anywhere after each
    warpgroup's last S wait is already ordered after the other warpgroup's last S too (each S is waited before its
    owner's P barrier arrive, which the other warpgroup syncs on in the same pair), so the epilogue's CTA barrier is
    a second guard for sQ, not the only one."""
    progs = [[], []]
    g = 0
    ph = [0, 0]
    q_of = None
    for idx, (T, req) in enumerate(items):
        q_load = req != q_of and not (mutate == "q_kept" and q_of is not None)
        for w in (0, 1):
            evs = []
            if q_load:
                evs.append(("write_q", req))  # load_q with q_cvt: ld.global -> cvt -> st.shared (+ fence)
            prev = None
            for ev in wg_program(w, T, None, True):
                k = ev[0]
                if k == "ldg":
                    ev = ("ldg", g + ev[1], ev[2])
                elif k == "load":
                    ev = ("load", g + ev[1]) + ev[2:]
                elif k == "mwait":
                    _, mb, par = ev
                    if mutate != "restart":
                        par = seesaw_pair_parities(ph[0], ph[1], par)[mb // 2]
                    ev = ("mwait", mb, par)
                elif k == "read":
                    ev = ("read", ev[1], g + ev[2]) + ev[3:]
                elif k in ("write_p", "write_scale", "read_scale"):
                    ev = (k, ev[1], g + ev[2])
                evs.append(ev)
                if k == "read" and prev == "mwait":  # an S WGMMA group: reads sQ too, in flight with the K reads
                    evs.append(("read", "Q", req, (0, 1), "Q"))
                prev = k
            assert evs[-1] == ("ctabar",)
            if mutate == "stage_past_item" and w == 0 and T > 0 and idx + 1 < len(items):
                evs.insert(len(evs) - 1, ("ldg", g + T, LOAD[0][1]))
            if mutate == "q_early" and q_load and any(e[:2] == ("read", "Q") for e in progs[w]):
                # write_q right after the warpgroup's last S issue of the previous item, before that S is waited
                last = max(i for i, e in enumerate(progs[w]) if e[:2] == ("read", "Q"))
                progs[w].insert(last + 1, evs.pop(0))
            progs[w].extend(evs)
        q_of = req
        d0, d1 = seesaw_item_phases(T)
        ph = [ph[0] + d0, ph[1] + d1]
        g += T
    return progs


def staging_crosses_an_item(progs):
    """The fp8 staging registers at item boundaries: the first ("ldg" tile) not stored ("load" of that tile by the
    same warpgroup) before the warpgroup's next CTA barrier (every item ends with one), else None."""
    for w, prog in enumerate(progs):
        staged = None
        for ev in prog:
            if ev[0] == "ldg":
                staged = ev[1]
            elif ev[0] == "load" and ev[1] == staged:
                staged = None
            elif ev[0] == "ctabar" and staged is not None:
                return (w, staged)
    return None


def _fp8_random_columns(n, seed=11):
    rng = random.Random(seed)
    cols = []
    for _ in range(n):
        req, col = 0, []
        for _ in range(rng.randint(1, 6)):
            req += rng.random() < 0.6  # a new request, or another item of the same one (Q kept)
            col.append((rng.randint(0, 6), req))
        cols.append(col)
    return cols


FP8_COLUMNS = [
    [],
    [(1, 0)],
    [(1, 0), (1, 1), (1, 2)],  # 1-tile items of three requests: Q reconverted at each
    [(2, 0), (3, 0), (1, 1)],  # two items of one request (Q kept), then a new one
    [(3, 0), (2, 1), (0, 2), (4, 3)],  # odd then even, a 0-tile item in between
    [(5, 0), (6, 1), (3, 1), (1, 2)],
    [(0, 0), (0, 1), (2, 2)],
]


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
@pytest.mark.parametrize("items", FIXED_COLUMNS + _random_columns(12, seed=17), ids=repr)
def test_balanced_column_with_wg1of_has_no_deadlock_or_hazard(items, tma):
    """wg1_other_first (branch qk-order): WG1's own-tile QK waits WG0's part (mbarrier 2) first, across items."""
    progs, tails = column_programs(items, tma=tma, wg1of=True)
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


@pytest.mark.parametrize("items", FP8_COLUMNS + _fp8_random_columns(24), ids=repr)
def test_fp8_balanced_column_has_no_deadlock_or_hazard(items):
    progs = column_programs_fp8(items)
    assert staging_crosses_an_item(progs) is None
    bad = {seed: e for seed in range(40) if (e := run(0, seed, fp8=True, programs=progs, tail_tiles=set()))}
    assert not bad, next(iter(bad.items()))


@pytest.mark.parametrize("mutate,items", [
    ("restart", [(3, 0), (2, 1)]),
    ("restart", [(1, 0), (2, 1)]),
    ("q_kept", [(2, 0), (2, 1)]),
    ("q_early", [(3, 0), (2, 1)]),
    ("q_early", [(2, 0), (1, 1)]),
    ("stage_past_item", [(3, 0), (2, 1)]),
    ("stage_past_item", [(2, 0), (2, 0)]),
])
def test_the_fp8_model_catches_broken_item_boundaries(mutate, items):
    """Each mutation of the fp8 column is reported by the checker (or, for a part staged past an item, also by the
    boundary scan); the unmutated column is clean."""
    progs = column_programs_fp8(items, mutate)
    found = any(run(0, s, fp8=True, programs=progs, tail_tiles=set()) for s in range(20))
    if mutate == "stage_past_item":
        assert staging_crosses_an_item(progs) is not None
    assert found, mutate
    clean = column_programs_fp8(items)
    assert staging_crosses_an_item(clean) is None
    assert not any(run(0, s, fp8=True, programs=clean, tail_tiles=set()) for s in range(20))


def test_fp8_one_item_staging_never_outlives_its_item():
    """The one-item fp8 program itself (every T): each warpgroup's last ldg is stored before its final barrier, so
    the column loop starts every item with empty staging registers."""
    for T in range(14):
        progs = [list(wg_program(w, T, None, True)) for w in (0, 1)]
        assert staging_crosses_an_item(progs) is None, T


def test_the_fp8_kernel_path_waits_with_the_per_buffer_parities():
    """Source check of seesaw_item's fp8 branch: its two KV mbarrier wait sites (WG0's S_a on buffer 0, mbarriers
    0 / 1; WG1's S_b on buffer 1, mbarriers 3 / 2) pass par0 / par1 (the one-item kernel's p % 2 when ph0 is None,
    the same Python value: its PTX is unchanged), and the fp8 stores and prefetches stay inside the item (tiles < T)."""
    src = KERNEL_SRC.read_text()
    item = src[src.index("    def seesaw_item("):src.index("# ---------------------------------------------------------------------- host helpers")]
    fp8 = item[item.index("            if cutlass.const_expr(self.is_fp8 and not self.fp8_producer):\n"
                          "                # fp8 KV: the same schedule"):
               item.index("            else:\n                if wg == 0:\n                    # S_a")]
    waits = re.findall(r"mbar \+ (\d), mbar \+ (\d), (par\d|parity)", fp8)
    assert sorted(waits) == [("0", "1", "par0"), ("3", "2", "par1")], waits
    assert "parity" not in re.sub(r"#.*", "", fp8)
    # every staged ldg / store of a later tile is guarded by that tile's existence in this item
    for call in re.finditer(r"self\.(ldg_part_fp8|store_part_fp8)\(\w+, (?:\w+, \w+, )?(?:pg\d, )?n_start \+ ta \+ (\d)", fp8):
        guard = fp8[:call.start()].rsplit("if ", 1)[1]
        assert f"ta + {call.group(2)} < T" in guard, (call.group(0), guard[:40])
