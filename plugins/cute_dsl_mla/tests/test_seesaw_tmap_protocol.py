"""Pure-Python model of the balanced 16-bit seesaw with a TMA producer warpgroup (``MLADecodePartialWGMMASeesaw(
tma=True, balanced=True, tma_producer=True)``, ``kernel_tmap_balanced``; branch tma-producer, compile-only).

Three programs per CTA column, interleaved at random with vector clocks (the shared-memory checks of
``test_seesaw_protocol.SmemModel``: K blocks, P, the rescale slots, the P named barriers), and every mbarrier with the
hardware's parity semantics (a wait with parity P passes iff the barrier's completed-phase count n has n % 2 != P, and
observes phase n - 1): so a wrong parity shows as a deadlock or as a stale read, never assumed away.

* Math warpgroups 0 / 1 (``seesaw_column_tmap`` + ``seesaw_item`` with ``tmq``): per row with b >= 0, wait Q full
  with parity (nq - 1) % 2 (nq: Q loads of the column so far, this item's included), BAR_MATH ("ctabar"), the pairs of
  the 16-bit TMA program with the loads turned into releases of every tile's parts (empty arrives, count one
  warpgroup), the full waits at (ph + p) % 2, ``zero_v_tail`` on a partial last tile (a second wait on the part's full
  barrier, then zeros over the warpgroup's own V half before its P V), every S also reading sQ; when the next row
  exists and names another request (or b < 0), one arrive on Q empty by each warpgroup once its own last S is waited
  (WG0 after its qk of the last pair, WG1 in the last pair after its qk of tile b if any; T = 0: after the pairs);
  the epilogue's BAR_MATH.  A row with b < 0 resets q_of (both sides).
* The producer warp (``tmap_producer``): per row with b >= 0, Q when b != q_of (the nq-th load waits Q empty phase
  nq - 1 first, nq >= 1; then the TMA on Q full), then the item's parts in the math side's wait order (tile a: parts
  0, 1; tile b: parts 3, 2), the g-th tile of a buffer in the column waiting empty phase g - 1 of the part first.
  A TMA load is modelled as landing at its issue (its WAR checks are then conservative; every reader waits its full
  phase).

Checked: no deadlock; every S / P V read sees the expected tile (or Q of the expected request), written before and
observed through the mbarrier; no TMA write (KV part or Q) or zeroing under an in-flight or unordered read; a P V
read of a partial last tile sees its zeroed rows; the phase counts at the end.  Mutations caught: the producer not
waiting empty, waiting the wrong parity, waiting phase 0 for a buffer's first tile (a parity-1 wait there would
pass at once on the hardware, as in this model: the kernel skips it); Q issued without the Q-empty wait or
with the wrong parity; the Q-empty arrive before the last S (WG1 before its qk); no Q-empty arrive after a row
followed by b < 0; the math side's Q-full parity restarted per item; Q kept after b < 0 by the producer only; releases
only for tiles < T - 2; zero_v_tail dropped.

With ``wg1of`` (``wg1_other_first``, branch tmap-wg1of): WG1's S of tile b waits full[2] before full[3]
(``qk_wait_order``) and the producer issues tile b's part 2 before part 3, each after the wait on its own empty
barrier at the same phase: the same checks pass, every mutation above is still caught, and so are two of this order's
own (WG1's k-blocks swapped without its waits; the producer's parts swapped without their empty waits); per barrier,
every program's waits, loads and releases are the default order's sequences.
"""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest

from test_seesaw_protocol import LOAD, SmemModel, _hb  # noqa: E402  (same directory)

from mla_cute_dsl.kernels.sm90_wgmma_decode import seesaw_item_phases, tmap_tile_b_parts

KERNEL_SRC = Path(__file__).resolve().parents[1] / "mla_cute_dsl" / "kernels" / "sm90_wgmma_decode.py"
N = 3  # programs: math WG0, math WG1, producer
QF, QE = "QF", "QE"  # Q full (count 1: the producer's TMA), Q empty (count 2 here: one arrive per math warpgroup)
FULL = {i: ("F", i) for i in range(4)}
EMPTY = {i: ("E", i) for i in range(4)}


def math_item(w, T, g, ph, req, nq, tail, release, mutate=None, wg1of=False):
    """Math warpgroup w, one item of T tiles (column tiles g ..), after phases ph = [ph0, ph1]; Q is the nq-th load.
    ``wg1of`` (wg1_other_first): WG1's S of tile b waits full[2] (WG0's part: blocks 0-3 + RoPE) first, then full[3]."""
    own = LOAD[w][0]  # the V half warpgroup w reads in P V (its zero_v_tail blocks)
    qpar = (nq % 2) if mutate == "q_full_parity" else (nq + 1) % 2
    out = [("mwait", QF, qpar), ("ctabar",)]
    rel_all = mutate != "release_in_item_only"

    def zero(buf, t, par):
        if tail and t == T - 1 and mutate != "no_zero":
            return [("zero", buf, g + t, own, FULL[2 * buf + w], par)]
        return []

    def s_reads(buf, t, blocks):
        return [("read", buf, g + t, blocks, "K"), ("read", "Q", req, ("q",), "Q")]

    for p in range((T + 1) // 2):
        ta = 2 * p
        last = ta + 2 >= T
        par0, par1 = (ph[0] + p) % 2, (ph[1] + p) % 2
        if w == 0:
            out += [("mwait", FULL[0], par0)] + s_reads(0, ta, (0, 1, 2, 3))
            out += [("mwait", FULL[1], par0)] + s_reads(0, ta, (4, 5, 6, 7, 8)) + [("wait_reads",)]
            if last and release:
                out.append(("arrive_q",))
            out += [("write_p", 0, g + ta), ("write_scale", 0, g + ta), ("arrive", 1)]
            out += zero(0, ta, par0) + [("vread", 0, g + ta, (0, 1, 2, 3)), ("wait_reads",)]
            if rel_all or ta + 2 < T:
                out.append(("release", EMPTY[0]))
            if ta + 1 < T:
                out += [("sync", 2)] + zero(1, ta + 1, par1)
                out += [("read_scale", 1, g + ta + 1), ("vread", 1, g + ta + 1, (0, 1, 2, 3)),
                        ("read", 1, g + ta + 1, (8,), "P"), ("wait_reads",)]
                if rel_all or ta + 3 < T:
                    out.append(("release", EMPTY[2]))
        else:
            if last and release and mutate == "q_release_early":
                out.append(("arrive_q",))
            if ta + 1 < T:
                halves = [(3, (4, 5, 6, 7)), (2, (0, 1, 2, 3, 8))]
                if wg1of:  # qk_wait_order: WG0's part first
                    halves.reverse()
                    if mutate == "wg1of_waits_unswapped":  # the k-blocks swapped, the two waits not
                        halves = [(3, halves[0][1]), (2, halves[1][1])]
                for i, blocks in halves:
                    out += [("mwait", FULL[i], par1)] + s_reads(1, ta + 1, blocks)
                out.append(("wait_reads",))
            if last and release and mutate != "q_release_early":
                out.append(("arrive_q",))
            out += [("sync", 1)] + zero(0, ta, par0)
            out += [("read_scale", 0, g + ta), ("vread", 0, g + ta, (4, 5, 6, 7)), ("read", 0, g + ta, (8,), "P")]
            if ta + 1 < T:
                out += [("write_p", 1, g + ta + 1), ("write_scale", 1, g + ta + 1), ("arrive", 2)]
            out.append(("wait_reads",))
            if rel_all or ta + 2 < T:
                out.append(("release", EMPTY[1]))
            if ta + 1 < T:
                out += zero(1, ta + 1, par1) + [("vread", 1, g + ta + 1, (4, 5, 6, 7)), ("wait_reads",)]
                if rel_all or ta + 3 < T:
                    out.append(("release", EMPTY[3]))
    if T == 0 and release:
        out.append(("arrive_q",))
    out.append(("ctabar",))
    return out


def producer_item(T, g, ph, req, q_load, nq, mutate=None, wg1of=False):
    """The producer's events for one item: Q (when q_load: the nq-th load, after waiting Q empty phase nq - 1 when nq
    >= 1), then every part; ``nq`` counts the loads before this one.  Tile b's parts in the kernel's own order
    (``tmap_tile_b_parts``, the math side's wait order): 3, 2, or with ``wg1of`` 2, 3 (each after a wait on its own
    empty barrier, at the same phase either way)."""
    out = []
    if q_load:
        if nq > 0 and mutate != "q_no_wait":
            out.append(("pwait", QE, (nq % 2) if mutate == "q_empty_parity" else (nq + 1) % 2))
        out.append(("qload", req))
    for p in range((T + 1) // 2):
        ta = 2 * p
        parts = [(ta, 0, LOAD[0][0], 0), (ta, 0, LOAD[1][1], 1)]
        if ta + 1 < T:
            parts += [(ta + 1, 1, blocks, i) for blocks, i in tmap_tile_b_parts(wg1of)]
        for t, buf, blocks, i in parts:
            e = i
            if wg1of and mutate == "wg1of_empty_swapped" and i in (2, 3):  # parts 2 / 3 issued after the other's
                e = 5 - i
            gb = ph[buf] + p
            if mutate == "first_tiles_waited" and gb == 0:  # phase 0 of empty: released only after this tile
                out.append(("pwait", EMPTY[e], 0))
            if gb > 0 and mutate != "no_empty_wait":
                out.append(("pwait", EMPTY[e], (gb % 2) if mutate == "empty_parity" else (gb + 1) % 2))
            out.append(("load", g + t, buf, blocks, FULL[i]))
    return out


def column(rows, mutate=None, wg1of=False):
    """The three programs of a column of rows [(T, request, tail), ...] (request < 0: a row with b < 0, skipped by
    both sides) and the expected completed phases per mbarrier at the end; ``wg1of``: wg1_other_first's order."""
    progs = [[], [], []]
    g, ph = 0, [0, 0]
    q_of = [-1, -1]  # math side, producer
    nq = [0, 0]
    for i, (T, req, tail) in enumerate(rows):
        if req < 0:
            q_of[0] = -1
            if mutate != "producer_keeps_q":
                q_of[1] = -1
            continue
        nxt = rows[i + 1][1] if i + 1 < len(rows) else req
        release = nxt != req and not (mutate == "no_release_before_invalid" and nxt < 0)
        if req != q_of[0]:
            nq[0] += 1
        for w in (0, 1):
            progs[w].extend(math_item(w, T, g, ph, req, nq[0], tail, release, mutate, wg1of))
        q_load = req != q_of[1]
        progs[2].extend(producer_item(T, g, ph, req, q_load, nq[1], mutate, wg1of))
        nq[1] += q_load
        q_of = [req, req]
        d0, d1 = seesaw_item_phases(T)
        ph = [ph[0] + d0, ph[1] + d1]
        g += T
    return progs, {FULL[0]: ph[0], FULL[1]: ph[0], FULL[2]: ph[1], FULL[3]: ph[1], QF: nq[1]}


class Mbar:
    def __init__(self, count):
        self.count, self.done, self.pending, self.clock = count, 0, [], {}

    def arrive(self, vc):
        self.pending.append(list(vc))
        if len(self.pending) == self.count:
            self.clock[self.done] = [max(x) for x in zip(*self.pending)]
            self.done += 1
            self.pending = []

    def ready(self, parity):
        return self.done % 2 != parity


def run(rows, seed, mutate=None, wg1of=False):
    """Interleave the three programs at random; return the violations (empty: fine)."""
    progs_l, expect = column(rows, mutate, wg1of)
    progs = [iter(p) for p in progs_l]
    rng = random.Random(seed)
    sm = SmemModel(N)
    vc, mem, inflight, errors = sm.vc, sm.mem, sm.inflight, sm.errors
    mb = {k: Mbar(1) for k in FULL.values()} | {k: Mbar(1) for k in EMPTY.values()}
    mb[QF], mb[QE] = Mbar(1), Mbar(2)
    landed = {}  # (full mbarrier, phase) -> clocks that observed it (SmemModel.read's RAW check)
    tails = {g for g, t in _tail_tiles(rows)}
    nxt = [next(p, None) for p in progs]
    for _ in range(400000):
        if all(e is None for e in nxt):
            break
        ready = []
        for w in range(N):
            ev = nxt[w]
            if ev is None:
                continue
            if ev[0] in ("mwait", "pwait") and not mb[ev[1]].ready(ev[2]):
                continue
            if ev[0] == "zero" and not mb[ev[4]].ready(ev[5]):
                continue
            if ev[0] == "sync" and not sm.arrives[ev[1]]:
                continue
            if ev[0] == "ctabar" and (nxt[1 - w] is None or nxt[1 - w][0] != "ctabar"):
                continue
            ready.append(w)
        if not ready:
            return [f"deadlock: {nxt}"]
        w = rng.choice(ready)
        ev = nxt[w]
        kind = ev[0]
        vc[w][w] += 1
        if kind == "ctabar":
            merged = [max(a, b) for a, b in zip(vc[0], vc[1])]
            vc[0], vc[1] = list(merged), list(merged)
            nxt[0], nxt[1] = next(progs[0], None), next(progs[1], None)
            continue
        if kind in ("mwait", "pwait", "zero"):
            m = mb[ev[4] if kind == "zero" else ev[1]]
            ph = m.done - 1  # the phase a passing parity wait observes
            if ph >= 0:
                sm.merge(w, m.clock[ph])
                landed.setdefault(((ev[4] if kind == "zero" else ev[1]), ph), []).append(list(vc[w]))
            if kind == "zero":
                _, buf, t, blocks, _, _ = ev
                for blk in blocks:
                    cell = mem.get((buf, blk))
                    if cell is None or cell["tag"] != ("K", t) or not _hb(cell["vc"], vc[w]):
                        errors.append(f"zero of tile {t} buf {buf} block {blk} over {None if cell is None else cell['tag']}")
                        continue
                    if any((buf, blk) in r for r in inflight) or not all(_hb(r, vc[w]) for r in cell["reads"]):
                        errors.append(f"WAR: zero of tile {t} buf {buf} block {blk} under a read")
                    mem[(buf, blk)] = {"tag": ("Z", t), "vc": list(vc[w]), "phase": cell["phase"], "reads": []}
        elif kind == "load":  # TMA part: lands and completes the part's full phase
            _, t, buf, blocks, f = ev
            sm.store(w, t, buf, blocks, (f, mb[f].done), "TMA")
            mb[f].arrive(vc[w])
        elif kind == "qload":
            cell = mem.get(("Q", "q"))
            if cell is not None and (any(("Q", "q") in r for r in inflight)
                                     or not all(_hb(r, vc[w]) for r in cell["reads"])):
                errors.append(f"WAR: Q of request {ev[1]} loaded while an S WGMMA may still read sQ")
            mem[("Q", "q")] = {"tag": ("Q", ev[1]), "vc": list(vc[w]), "phase": (QF, mb[QF].done), "reads": []}
            mb[QF].arrive(vc[w])
        elif kind == "release":
            mb[ev[1]].arrive(vc[w])
        elif kind == "arrive_q":
            if inflight[w]:
                errors.append(f"WG{w} releases sQ with WGMMA reads in flight")
            mb[QE].arrive(vc[w])
        elif kind == "read":
            _, buf, t, blocks, what = ev
            if what == "Q":
                cell = mem.get(("Q", "q"))
                if cell is None or cell["tag"] != ("Q", t) or not _hb(cell["vc"], vc[w]):
                    errors.append(f"RAW: WG{w} S reads sQ for request {t}: {None if cell is None else cell['tag']}")
                inflight[w].append(("Q", "q"))
            else:
                sm.read(w, buf, t, blocks, what, landed)
        elif kind == "vread":  # P V: the tile as loaded, or zeroed if it is a partial last tile
            _, buf, t, blocks = ev
            want = ("Z", t) if t in tails else ("K", t)
            for blk in blocks:
                cell = mem.get((buf, blk))
                if cell is None or cell["tag"] != want or not _hb(cell["vc"], vc[w]):
                    errors.append(f"RAW: WG{w} P V reads tile {t} buf {buf} block {blk}: "
                                  f"{None if cell is None else cell['tag']}, wants {want}")
                elif not any(_hb(x, vc[w]) for x in landed.get(cell["phase"], ())):
                    errors.append(f"RAW: WG{w} P V reads tile {t} buf {buf} block {blk}: landing not observed")
                inflight[w].append((buf, blk))
        else:
            sm.step(w, ev)
        nxt[w] = next(progs[w], None)
    else:
        return ["no progress"]
    sm.end_checks()
    done = {k: mb[k].done for k in expect}
    if done != expect:
        errors.append(f"phases {done}, expected {expect}")
    for i in range(4):  # every tile's parts released: empty completes as many phases as full
        if mb[EMPTY[i]].done != mb[FULL[i]].done:
            errors.append(f"empty[{i}] {mb[EMPTY[i]].done} phases, full {mb[FULL[i]].done}")
    return errors


def _tail_tiles(rows):
    """(column tile, row) of every partial last tile (rows with tail=True and T >= 1)."""
    g, out = 0, []
    for i, (T, req, tail) in enumerate(rows):
        if req >= 0:
            if tail and T:
                out.append((g + T - 1, i))
            g += T
    return out


COLUMNS = [
    [(0, 0, False)], [(1, 0, True)], [(2, 0, False), (1, 1, True)], [(1, 0, False), (1, 0, True), (1, 1, False)],
    [(0, 0, False), (3, 1, True), (0, 2, False), (2, 2, True)], [(5, 0, False), (5, 0, True), (5, 1, True)],
    [(1, 0, True), (2, 1, True), (3, 2, True), (4, 3, True), (5, 4, False), (6, 5, True), (7, 6, True)],
    [(2, 0, False), (3, -1, False), (2, 0, True)], [(3, 0, True), (0, -1, False), (0, -1, False), (4, 1, False)],
    [(4, 0, False), (1, -1, False)], [(0, -1, False), (2, 0, True), (2, 0, False), (7, 0, True)],
    [(6, 0, False), (6, 0, False), (1, 0, True), (0, 1, False), (0, 1, False), (3, 2, True)],
]


def _columns(n, seed=7):
    rng = random.Random(seed)
    cols = list(COLUMNS)
    while len(cols) < n:
        reqs = sorted(rng.randrange(5) for _ in range(rng.randrange(1, 9)))
        rows = [(rng.randrange(8), r, rng.random() < 0.5) for r in reqs]
        for _ in range(rng.randrange(3)):  # rows with b < 0 anywhere
            rows.insert(rng.randrange(len(rows) + 1), (0, -1, False))
        cols.append(rows)
    return cols


@pytest.mark.parametrize("wg1of", [False, True], ids=["default", "wg1of"])
@pytest.mark.parametrize("rows", _columns(30), ids=repr)
def test_tmap_column_has_no_deadlock_or_hazard(rows, wg1of):
    bad = {seed: e for seed in range(40) if (e := run(rows, seed, wg1of=wg1of))}
    assert not bad, (rows, next(iter(bad.items())))


MUTATIONS = ["no_empty_wait", "empty_parity", "first_tiles_waited", "q_no_wait", "q_empty_parity", "q_release_early",
             "no_release_before_invalid", "q_full_parity", "producer_keeps_q", "release_in_item_only", "no_zero"]


@pytest.mark.parametrize("mutate,wg1of", [(m, False) for m in MUTATIONS] + [(m, True) for m in MUTATIONS]
                         + [("wg1of_waits_unswapped", True), ("wg1of_empty_swapped", True)])
def test_the_model_catches_broken_tmap_columns(mutate, wg1of):
    """Every mutation is caught in the default order and with wg1_other_first's; and two of the new order's own:
    WG1 reading part 2's blocks under the full[3] wait (k-blocks swapped, waits not), the producer issuing part 2
    after empty[3]'s wait and part 3 after empty[2]'s (issue order swapped, empty waits not)."""
    found = []
    for rows in _columns(30):
        for seed in range(12):
            e = run(rows, seed, mutate, wg1of)
            if e:
                found.append((rows, e[0]))
                break
        if found:
            break
    assert found, mutate


def test_every_q_load_but_the_first_has_one_q_empty_phase_before_it():
    """Per column: the math side's Q-empty arrives (per warpgroup) number the producer's Q loads less one, plus one
    per column ending in b < 0 rows after a valid row (a phase nobody waits); the producer's nq-th wait is on phase
    nq - 1 and the math side's Q-full parities follow the loads."""
    for rows in _columns(60):
        progs, expect = column(rows)
        loads = sum(1 for e in progs[2] if e[0] == "qload")
        waits = [e for e in progs[2] if e[:2] == ("pwait", QE)]
        assert [e[2] for e in waits] == [k % 2 for k in range(len(waits))]
        assert len(waits) == max(loads - 1, 0) and expect[QF] == loads
        valid = [i for i, r in enumerate(rows) if r[1] >= 0]
        dangling = bool(valid) and valid[-1] + 1 < len(rows)
        for w in (0, 1):
            arrives = sum(1 for e in progs[w] if e[0] == "arrive_q")
            assert arrives == len(waits) + dangling, (rows, w, arrives, len(waits))


def test_wg1of_keeps_every_barriers_phase_sequence():
    """wg1_other_first only reorders tile b's two parts, which sit on different barriers: per mbarrier, the producer's
    waits (parities) and loads and each math warpgroup's waits and releases are the same sequences in either order;
    only WG1's full[2] / full[3] waits and the producer's empty[2] / empty[3] waits interleave the other way."""
    def per_barrier(prog):
        seq = {}
        for e in prog:
            if e[0] in ("mwait", "pwait", "release"):
                seq.setdefault(e[1], []).append(e[0:3:2] if e[0] != "release" else ("release",))
            elif e[0] == "load":
                seq.setdefault(e[4], []).append(("load", e[1], e[3]))
        return seq

    swapped = 0
    for rows in _columns(60):
        default, expect = column(rows)
        wg1of, expect1 = column(rows, wg1of=True)
        assert expect == expect1
        for w in range(N):
            assert per_barrier(default[w]) == per_barrier(wg1of[w]), (rows, w)
        assert default[0] == wg1of[0]  # WG0 unchanged
        swapped += default[2] != wg1of[2]
        order = [e[1] for e in wg1of[1] if e[0] == "mwait" and e[1] in (FULL[2], FULL[3])]
        assert order == [FULL[2], FULL[3]] * (len(order) // 2)
        loads = [e[4] for e in wg1of[2] if e[0] == "load" and e[4] in (FULL[2], FULL[3])]
        assert loads == [FULL[2], FULL[3]] * (len(loads) // 2)
    assert swapped > 40


def test_the_kernel_runs_what_the_model_checks():
    """Source check: the column walks (math and producer) keep the model's bookkeeping; seesaw_item's Q-empty arrives
    sit where the model puts them (WG0 right after its qk, before softmax_publish; WG1 after its qk and before its
    pv_remote; T = 0 after the pairs), the Q-full wait replaces the Q load, and the producer's waits use the model's
    parities."""
    src = KERNEL_SRC.read_text()
    col = src[src.index("    def seesaw_column_tmap("):src.index("    def tmap_issue_part(")]
    for line in ("q_load = b != q_of", "nq = nq + 1", "(nq + 1) % 2, nb != b)", "nb = mWork[it + 1, 0]",
                 "if it + 1 < end:", "ph0 = ph0 + (T + 1) // 2", "ph1 = ph1 + T // 2", "q_of = cutlass.Int32(-1)"):
        assert line in col, line
    prod = src[src.index("    def tmap_producer("):src.index("# ---------------------------------------------------------------------- host helpers")]
    for line in ("if b != q_of:", "if nq > 0:", "cute.arch.mbarrier_wait(q_empty, (nq + 1) % 2)", "nq = nq + 1",
                 "e0 = (g0 + p + 1) % 2", "e1 = (g1 + p + 1) % 2", "g0 = g0 + (T + 1) // 2", "g1 = g1 + T // 2",
                 "q_of = cutlass.Int32(-1)"):
        assert line in prod, line
    parts = re.findall(r"full \+ (\d), empty \+ (\d),\s+(g\d) \+ p > 0, (e\d)\)", prod)
    assert parts == [("0", "0", "g0", "e0"), ("1", "1", "g0", "e0")]  # tile a
    # tile b: the two parts of tmap_tile_b_parts (which producer_item above models), in its order, on the part's own
    # full / empty barrier, at tile b's phase
    tile_b = prod[prod.index("if ta + 1 < T:"):]
    assert re.match(r"if ta \+ 1 < T:\s+tile_b = tmap_tile_b_parts\(self\.wg1_other_first\)\s+"
                    r"for k in cutlass\.range_constexpr\(2\):", tile_b)
    assert re.search(r"tile_b\[k\]\[0\],\s+blocks_per_page, full \+ tile_b\[k\]\[1\], empty \+ tile_b\[k\]\[1\],"
                     r"\s+g1 \+ p > 0, e1\)", tile_b)
    assert tmap_tile_b_parts(False) == ((LOAD[1][0], 3), (LOAD[0][1], 2))  # WG1's default wait order: its own first
    assert tmap_tile_b_parts(True) == ((LOAD[0][1], 2), (LOAD[1][0], 3))
    issue = src[src.index("    def tmap_issue_part("):src.index("    def tmap_producer(")]
    assert issue.index("mbarrier_wait(empty_ptr") < issue.index("mbarrier_arrive_and_expect_tx(full_ptr")
    item = src[src.index("    def seesaw_item("):src.index("    def kernel_fp8p(")]
    sixteen = item[item.index("            else:\n                if wg == 0:\n                    # S_a"):]
    wg0, wg1 = sixteen.split("                else:\n", 1)
    seq0 = re.findall(r"self\.qk\(|tmq\.empty|self\.softmax_publish\(", wg0)
    assert seq0[:3] == ["self.qk(", "tmq.empty", "self.softmax_publish("], seq0
    seq1 = re.findall(r"self\.qk\(|tmq\.empty|self\.pv_remote\(", wg1)
    assert seq1[:3] == ["self.qk(", "tmq.empty", "self.pv_remote("], seq1
    for part in (wg0, wg1):
        arrive = part[part.index("tmq is not None"):part.index("tmq.empty")]
        assert "if ta + 2 >= T:" in arrive and "if tmq.release:" in arrive
    tail = item[item.index("cute.arch.cp_async_wait_group(0)"):]
    assert re.search(r"if T == 0:\s+if tmq\.release:\s+cute\.arch\.mbarrier_arrive\(tmq\.empty\)", tail)
    assert "cute.arch.mbarrier_wait(tmq.full, tmq.qpar)" in item
    assert item.index("cute.arch.mbarrier_wait(tmq.full, tmq.qpar)") < item.index("self.item_barrier()")
