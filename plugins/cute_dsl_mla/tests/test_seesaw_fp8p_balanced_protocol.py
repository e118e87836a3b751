"""Pure-Python model of the fp8 seesaw with a producer warpgroup on the balanced schedule
(``MLADecodePartialWGMMASeesaw(fp8_producer=True, balanced=True)``, ``kernel_fp8p_balanced``; branch
fp8-balanced-producer): a CTA column runs several work items with the same 8 mbarriers, so their phases continue
across items on both sides.

* Math warpgroups (``seesaw_item`` under fp8_producer, with q_load / ph0 / ph1): per item, Q written into sQ when
  the request changes ("write_q", each math warpgroup its half of the rows), the BAR_MATH barrier ("ctabar"), the
  pairs of the one-item program (``test_seesaw_fp8p_protocol.math_program``) with the full waits at parity
  (ph + p) % 2 and every tile's parts released (empty arrives also for a buffer's last tile of the item: the next
  item's tiles 0 / 1 reuse it), every S WGMMA also reading sQ, then the epilogue's BAR_MATH ("ctabar").
* The producer (``fp8p_producer`` with ph0 / ph1): per item the one-item order of parts, the g-th tile of a buffer in
  the column (g = ph + p) waiting on empty phase g - 1 first (none for g = 0); no barrier with the math side after the
  setup, so it runs into the next item as far as the empty barriers let it.

``test_seesaw_fp8p_protocol.run`` interleaves the three programs at random (vector clocks): deadlock, wrong parity,
WAR / RAW on K blocks, P, rescale slots and sQ, and the phase counts at the end (full = empty arrives = the column's
tiles per buffer, producer empty waits one fewer where the buffer was used).  Columns: 1-7 items of 0-6 tiles,
requests repeating or not.  Mutations caught: phases restarted per item (both sides), the producer skipping its wait
for an item's first tiles (writing the next item's tiles 0 / 1 before the previous item's last readers released
them), the math side releasing only tiles < T - 2 (the one-item condition: the producer hangs), sQ written right
after the previous item's last S issue (before its wait), Q not reloaded when the request changes.
"""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest

from test_seesaw_fp8p_protocol import run  # noqa: E402  (same directory)
from test_seesaw_protocol import LOAD  # noqa: E402

from mla_cute_dsl.kernels.sm90_wgmma_decode import seesaw_item_phases

KERNEL_SRC = Path(__file__).resolve().parents[1] / "mla_cute_dsl" / "kernels" / "sm90_wgmma_decode.py"


def math_item(w, T, g, ph, req, mutate=None, wg1of=False):
    """``seesaw_item`` (fp8_producer) events of math warpgroup w for one item of T tiles, column tiles g .. g + T - 1,
    after the column's earlier phases ph = [ph0, ph1] (full waits (ph + p) % 2), its S WGMMAs reading sQ (request
    req)."""
    rel_all = mutate != "release_in_item_only"
    out = []
    for p in range((T + 1) // 2):
        ta = 2 * p
        par0, par1 = ((p % 2, p % 2) if mutate == "restart" else ((ph[0] + p) % 2, (ph[1] + p) % 2))
        if w == 0:
            out += [("mwait", 0, par0), ("read", 0, g + ta, (0, 1, 2, 3), "K"),
                    ("mwait", 1, par0), ("read", 0, g + ta, (4, 5, 6, 7, 8), "K"), ("read", "Q", req, (0, 1), "Q"),
                    ("wait_reads",),
                    ("write_p", 0, g + ta), ("write_scale", 0, g + ta), ("arrive", 1),
                    ("read", 0, g + ta, (0, 1, 2, 3), "K"), ("wait_reads",)]
            if rel_all or ta + 2 < T:
                out.append(("release", 0))
            if ta + 1 < T:
                out += [("sync", 2), ("read_scale", 1, g + ta + 1), ("read", 1, g + ta + 1, (0, 1, 2, 3), "K"),
                        ("read", 1, g + ta + 1, (8,), "P"), ("wait_reads",)]
                if rel_all or ta + 3 < T:
                    out.append(("release", 2))
        else:
            if ta + 1 < T:
                # WG1's QK of tile b: own part (full[3]) first, or with wg1of (wg1_other_first) WG0's (full[2])
                qk = [[("mwait", 3, par1), ("read", 1, g + ta + 1, (4, 5, 6, 7), "K")],
                      [("mwait", 2, par1), ("read", 1, g + ta + 1, (0, 1, 2, 3, 8), "K")]]
                if wg1of:
                    qk.reverse()
                out += qk[0] + qk[1] + [("read", "Q", req, (0, 1), "Q"), ("wait_reads",)]
            out += [("sync", 1), ("read_scale", 0, g + ta), ("read", 0, g + ta, (4, 5, 6, 7), "K"),
                    ("read", 0, g + ta, (8,), "P")]
            if ta + 1 < T:
                out += [("write_p", 1, g + ta + 1), ("write_scale", 1, g + ta + 1), ("arrive", 2)]
            out.append(("wait_reads",))
            if rel_all or ta + 2 < T:
                out.append(("release", 1))
            if ta + 1 < T:
                out += [("read", 1, g + ta + 1, (4, 5, 6, 7), "K"), ("wait_reads",)]
                if rel_all or ta + 3 < T:
                    out.append(("release", 3))
    return out


def producer_item(T, g, ph, mutate=None, wg1of=False):
    """``fp8p_producer`` events for one item: per part an empty wait on phase (ph + p) - 1 unless that is the
    buffer's first tile in the column, then the load (convert, st.shared, fence, arrive on full); ``wg1of``: tile
    b's parts in the order 2, 3."""
    out = []
    for p in range((T + 1) // 2):
        ta = 2 * p
        parts = [(ta, 0, LOAD[0][0], 0), (ta, 0, LOAD[1][1], 1)]
        if ta + 1 < T:
            tile_b = [(ta + 1, 1, LOAD[1][0], 3), (ta + 1, 1, LOAD[0][1], 2)]
            parts += tile_b[::-1] if wg1of else tile_b
        for t, buf, blocks, mb in parts:
            gb = (p if mutate == "restart" else ph[buf] + p)
            wait = gb > 0 and not (mutate == "first_tiles_unwaited" and p == 0)
            if wait:
                out.append(("ewait", mb, (gb - 1) % 2))
            out.append(("load", g + t, buf, blocks, mb))
    return out


def column(items, mutate=None, wg1of=False):
    """The three programs for a column of items [(T, request), ...] and the expected (full, empty arrives, empty
    waits) per mbarrier at the end."""
    progs = [[], [], []]
    g = 0
    ph = [0, 0]
    q_of = None
    for T, req in items:
        q_load = req != q_of and not (mutate == "q_kept" and q_of is not None)
        for w in (0, 1):
            evs = [("write_q", req)] if q_load else []
            evs += [("ctabar",)] + math_item(w, T, g, ph, req, mutate, wg1of) + [("ctabar",)]
            if mutate == "q_early" and q_load and any(e[:2] == ("read", "Q") for e in progs[w]):
                last = max(i for i, e in enumerate(progs[w]) if e[:2] == ("read", "Q"))
                progs[w].insert(last + 1, evs.pop(0))
            progs[w].extend(evs)
        progs[2].extend(producer_item(T, g, ph, mutate, wg1of))
        q_of = req
        d0, d1 = seesaw_item_phases(T)
        ph = [ph[0] + d0, ph[1] + d1]
        g += T
    full = [ph[0], ph[0], ph[1], ph[1]]
    return progs, (full, full, [max(f - 1, 0) for f in full])


def _columns(n, seed=5):
    rng = random.Random(seed)
    cols = [[(0, 0)], [(1, 0)], [(2, 0), (1, 1)], [(1, 0), (1, 0), (1, 1)], [(0, 0), (3, 1), (0, 2), (2, 2)],
            [(5, 0), (5, 0), (5, 1)], [(1, 0), (2, 1), (3, 2), (4, 3), (5, 4), (6, 5)]]
    while len(cols) < n:
        reqs = sorted(rng.randrange(4) for _ in range(rng.randrange(1, 8)))
        cols.append([(rng.randrange(7), r) for r in reqs])
    return cols


@pytest.mark.parametrize("items", _columns(24))
def test_fp8p_balanced_column_has_no_deadlock_or_hazard(items):
    progs, counts = column(items)
    bad = {seed: e for seed in range(60) if (e := run(None, seed, programs=progs, counts=counts))}
    assert not bad, (items, next(iter(bad.items())))


@pytest.mark.parametrize("mutate", ["restart", "first_tiles_unwaited", "release_in_item_only", "q_early", "q_kept"])
def test_the_model_catches_broken_fp8p_balanced_columns(mutate):
    """Phase counts restarted per item; the producer writing an item's tiles 0 / 1 before the previous item's last
    readers released them; releases only for tiles < T - 2 (the producer then waits forever); sQ rewritten while
    the previous item's last S may still read it; Q not reloaded for a new request: each is reported."""
    found = []
    for items in _columns(24):
        progs, counts = column(items, mutate)
        for seed in range(20):
            e = run(None, seed, programs=progs, counts=counts)
            if e:
                found.append((items, e[0]))
                break
    assert found, mutate


def test_phase_counts_per_item_agree_between_producer_and_math():
    """Per item of T tiles (0..6) after any earlier phases: the producer's full arrives (loads) per buffer are
    seesaw_item_phases(T) for both parts, the math side's full waits and empty releases the same, so the counts both
    sides add after the item are equal; T = 0 gives no event at all on either side."""
    for ph in ([0, 0], [1, 0], [2, 3], [5, 5]):
        for T in range(7):
            d = seesaw_item_phases(T)
            prod = producer_item(T, 0, ph)
            loads = [sum(1 for e in prod if e[0] == "load" and e[4] == i) for i in range(4)]
            assert loads == [d[0], d[0], d[1], d[1]]
            waits = [sum(1 for w in (0, 1) for e in math_item(w, T, 0, ph, 0) if e[:2] == ("mwait", i))
                     for i in range(4)]
            rel = [sum(1 for w in (0, 1) for e in math_item(w, T, 0, ph, 0) if e == ("release", i)) for i in range(4)]
            assert waits == loads == rel, (ph, T, waits, rel)
            if T == 0:
                assert prod == [] and all(math_item(w, 0, 0, ph, 0) == [] for w in (0, 1))


def test_the_kernel_computes_what_the_model_checks():
    """The kernel's source has the model's rules: both sides walk the column and add seesaw_item_phases; the
    producer's parities and wait conditions from the running counts; the math side's full parities and its
    unconditional releases in balanced; Q loaded on a request change; the one-item kernel keeps its own."""
    src = KERNEL_SRC.read_text()
    bal = src[src.index("    def kernel_fp8p_balanced("):src.index("    def fp8p_produce_part(")]
    # both sides walk the column from the same phase counts: the math warpgroups in seesaw_column, the producer here
    col = src[src.index("    def seesaw_column("):src.index("    def seesaw_item(")]
    assert "ph0 = cutlass.Int32(0)" in bal and "ph1 = cutlass.Int32(0)" in bal
    assert bal.index("ph0 = cutlass.Int32(0)") < bal.index("if wg < 2:")
    assert "lane, R, blocks_per_page, ph0, ph1," in " ".join(bal.split())
    for walk in (bal, col):
        assert walk.count("ph0 = ph0 + (T + 1) // 2") == 1 and walk.count("ph1 = ph1 + T // 2") == 1
        assert walk.count("for it in cutlass.range(mRanges[wi], mRanges[wi + 1], 1):") == 1
        assert walk.count("T = (mWork[it, 2] + BLOCK_N - 1) // BLOCK_N - n_start") == 1
    assert "kv_len, R, blocks_per_page, n_start, T, b != q_of, ph0, ph1," in " ".join(col.split())
    assert "blocks_per_page, n_start, T, ph0, ph1)" in bal
    host = src.index("# ---------------------------------------------------------------------- host helpers")
    prod = src[src.index("    def fp8p_producer("):host]
    for s in ("par0 = (ph0 + p + 1) % 2", "par1 = (ph1 + p + 1) % 2", "wait0 = ph0 + p > 0", "wait1 = ph1 + p > 0"):
        assert s in prod, s
    assert prod.count("wait0, par0)") == 2 and prod.count("wait1, par1)") == 2
    # the math side: seesaw_item's 16-bit stream (fp8_producer), its releases through refill_part
    math = src[src.index("    def seesaw_item("):src.index("    def kernel_fp8p(")]
    assert "par0 = (ph0 + p) % 2" in math and "par1 = (ph1 + p) % 2" in math
    sixteen = math[math.index("            else:\n                if wg == 0:\n                    # S_a"):]
    assert "mbar + 0, mbar + 1, par0)" in sixteen and "mbar + 3, mbar + 2, par1)" in sixteen
    assert "refill_bars = mbar + 4" in math
    assert "every_tile = self.fp8_producer and ph0 is not None" in math
    releases = re.findall(r"self\.refill_part\([^)]*refill_bars, (\d), every_tile\)", sixteen)
    assert sorted(releases) == ["0", "1", "2", "3"]
    refill = src[src.index("    def refill_part("):src.index("    def item_barrier(")]
    assert re.search(r"if cutlass\.const_expr\(every_tile\):\s+cute\.arch\.mbarrier_arrive\(bars \+ part\)", refill)
    assert "if q_load:" in math
