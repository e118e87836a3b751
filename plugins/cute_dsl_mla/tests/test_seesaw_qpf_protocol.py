"""Pure-Python model of the balanced seesaw's ``q_prefetch`` option (``MLADecodePartialWGMMASeesaw(balanced=True,
q_prefetch=True)``, 16-bit cache, cp.async or TMA KV loads): the next work item's Q and its KV tiles 0 / 1 are issued
during the current item's last pairs, so the next item starts without loading them.

What the kernel does (``seesaw_column_qpf`` and the ``qpf`` insertions of ``seesaw_item``), and what this model
replays event by event with the checker of ``test_seesaw_protocol.py`` (``run``: vector clocks, no deadlock, no
RAW / WAR hazard on K blocks, P, sQ, the rescale and row-sum slots, mbarrier waits on the right phase parity):

* Q is a TMA load (9 boxes of 64 rows x 64 columns, rows past s_q * H zero-filled by the TMA unit) on a fifth
  mbarrier (index 4, count 1, one ``arrive.expect_tx`` of 73,728 bytes), never cp.async: so no cp.async commit group
  crosses an item boundary (the prologue's commit / ``wait_group(1)`` and the epilogue's ``wait_group(0)`` are
  compiled out; every KV part is observed through its mbarrier as before) and one elected thread issues it.
* In the prologue (an item whose Q was not prefetched and whose request differs from the one in sQ) warp 0 issues
  Q; every thread then waits the Q mbarrier with parity (nq - 1) % 2, nq = Q loads the CTA issued so far (a second
  wait on an already completed phase returns at once: no phase is issued before every thread waited the previous
  one, see below), then the CTA barrier as before.  Tiles 0 / 1 are loaded there only when the previous item did
  not issue them.
* Prefetch point of Q: every S WGMMA of the item reads all of sQ.  Warpgroup 1's last S is waited in its ``qk``
  before its ``pv_remote`` of the last pair; warpgroup 0's last S (tile a of the last pair) is waited before it
  arrives on the P_a barrier, which warpgroup 1's ``pv_remote`` of the last pair syncs on.  So right after that
  ``pv_remote`` (the P_a V_R WGMMAs issued, which do not read sQ) warp 4 issues the next item's Q, when the next row
  exists (row it + 1 of the column, b >= 0) and names another request.
* KV tiles 0 / 1 of the next item: buffer 0 is free of the item once each warpgroup's last reads of it completed:
  the slot where the pair loop would load its part of tile a + 2 in the last pair (``ta + 2 >= T``); buffer 1 at
  the slot of tile b + 2 in the pair whose ``ta + 3 >= T`` (the last pair for an even T, the one before for an odd
  T), or, after a 1-tile item (no tile of the item in buffer 1), at the buffer-0 slot of its only pair.  Each
  warpgroup issues the same blocks to the same mbarrier as for an own tile, so every buffer still completes one
  phase per tile in column order and ``seesaw_item_phases`` / ``seesaw_pair_parities`` are unchanged (the phases
  counted by the item that owns the tile, not by the one that issues it).
* sL (row sums, written before the epilogue's CTA barrier, read after it by the other warpgroup): the next write
  comes after the next item's prologue barrier, which every item keeps (modelled: the "no_prologue_bar" mutation is
  caught after 1-tile items, where no named barrier of the next item orders the write after the other read).

Mutations each caught (``test_the_qpf_model_catches_broken_orders``): Q issued before warpgroup 1's P_a sync, Q
issued by warpgroup 0 right after its own last S, the next tile 0 loaded before warpgroup 0's P_a V wait, Q waited
with parity restarted at 0, the prologue not waiting Q when it was prefetched, the prefetched tiles loaded again in
the prologue, an odd item sending the next tile 0 to buffer 1's slot, Q kept when the request changes, the prologue
barrier dropped.
"""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest

from test_seesaw_protocol import LOAD, run, wg1_qk  # noqa: E402  (same directory)

from mla_cute_dsl.kernels.sm90_wgmma_decode import seesaw_item_phases, seesaw_pair_parities

KERNEL_SRC = Path(__file__).resolve().parents[1] / "mla_cute_dsl" / "kernels" / "sm90_wgmma_decode.py"
QMB = 4  # the Q mbarrier (TMA: one arrive.expect_tx, nine boxes)


def wg_program_qpf(w, T, req, *, tma, tail, pf, q_load, q_wait, nxt, mutate=None, wg1of=False):
    """Events of warpgroup w for one item of T tiles of request ``req`` (local tile numbers; the next item's tiles 0
    / 1 are T and T + 1), as ``seesaw_item`` runs them with ``qpf``.  ``pf``: the previous item issued this item's
    tiles; ``q_load``: the prologue loads Q; ``q_wait``: the Q parity to wait in the prologue, None when no new Q
    phase belongs to this item (the kernel's wait is then a second wait on the completed phase: no event);
    ``nxt``: None (no next row: nothing prefetched) or (tiles of the next item to prefetch, min(T', 2); the request
    whose Q to prefetch or None).  ``wg1of``: warpgroup 1's own-tile QK waits WG0's part first (``wg1_qk``)."""
    own = LOAD[w][0]
    nt, q_next = nxt if nxt is not None else (0, None)

    def zero(buf, t, p):
        if tma and tail and t == T - 1:
            yield ("zero", buf, t, own, 2 * buf + w, p)

    def s_reads(buf, t, blocks):  # an S WGMMA group reads its K blocks and sQ
        yield ("read", buf, t, blocks, "K")
        yield ("read", "Q", req, (0,), "K")

    def nxt_load(buf):  # this warpgroup's part of the next item's tile buf (same blocks / mbarrier as an own tile)
        if nt > buf:
            yield ("load", T + buf, buf, LOAD[w][0 if buf == w else 1], 2 * buf + w)

    v = "V" if tma else "K"
    # ---- prologue
    if q_load and w == 0:
        yield ("load", req, "Q", (0,), QMB)
    if not pf or mutate == "reload":
        for t in range(2):
            if T > t:
                yield ("load", t, t, LOAD[w][0 if t == w else 1], 2 * t + w)
    if q_wait is not None and not (mutate == "no_q_wait" and pf):
        yield ("mwait", QMB, 0 if mutate == "q_parity" else q_wait)
    if not (mutate == "no_prologue_bar" and pf):
        yield ("ctabar",)
    # ---- pairs
    for p in range((T + 1) // 2):
        ta, par = 2 * p, p % 2
        last = ta + 2 >= T
        if w == 0:
            yield ("mwait", 0, par)
            yield from s_reads(0, ta, (0, 1, 2, 3))
            yield ("mwait", 1, par)
            yield from s_reads(0, ta, (4, 5, 6, 7, 8))
            yield ("wait_reads",)
            if mutate == "q_wg0_early" and last and q_next is not None:
                yield ("load", q_next, "Q", (0,), QMB)
            yield ("write_p", 0, ta)
            yield ("write_scale", 0, ta)
            yield ("arrive", 1)
            yield from zero(0, ta, p)
            if mutate == "kv_early" and last:
                yield from nxt_load(0)
            yield ("read", 0, ta, (0, 1, 2, 3), v)  # pv_rs, waited
            yield ("wait_reads",)
            if ta + 2 < T:
                yield ("load", ta + 2, 0, LOAD[0][0], 0)
            if last:
                if mutate != "kv_early":
                    yield from nxt_load(0)
                if T == 1:
                    yield from nxt_load(1)
                if mutate == "odd_to_buffer1" and T % 2 == 1 and nt > 0:
                    yield ("load", T, 1, LOAD[0][1], 2)
            if ta + 1 < T:
                yield ("sync", 2)
                yield from zero(1, ta + 1, p)
                yield ("read_scale", 1, ta + 1)
                yield ("read", 1, ta + 1, (0, 1, 2, 3), v)
                yield ("read", 1, ta + 1, (8,), "P")
                yield ("wait_reads",)
                if ta + 3 < T:
                    yield ("load", ta + 3, 1, LOAD[0][1], 2)
                if ta + 3 >= T:
                    yield from nxt_load(1)
        else:
            if ta + 1 < T:  # each K read of the S WGMMA group with its sQ read
                yield from wg1_qk(ta, par, wg1of, extra=lambda blocks: [("read", "Q", req, (0,), "K")])
            if mutate == "q_early" and last and q_next is not None:
                yield ("load", q_next, "Q", (0,), QMB)
            yield ("sync", 1)  # pv_remote(a): barrier, zero if last, rescale, WGMMA, not waited
            yield from zero(0, ta, p)
            yield ("read_scale", 0, ta)
            yield ("read", 0, ta, (4, 5, 6, 7), v)
            yield ("read", 0, ta, (8,), "P")
            if last and q_next is not None and mutate not in ("q_early", "q_wg0_early"):
                yield ("load", q_next, "Q", (0,), QMB)  # warp 4: the next item's Q
            if ta + 1 < T:
                yield ("write_p", 1, ta + 1)
                yield ("write_scale", 1, ta + 1)
                yield ("arrive", 2)
            yield ("wait_reads",)
            if ta + 2 < T:
                yield ("load", ta + 2, 0, LOAD[1][1], 1)
            if last:
                yield from nxt_load(0)
                if T == 1:
                    yield from nxt_load(1)
                if mutate == "odd_to_buffer1" and T % 2 == 1 and nt > 0:
                    yield ("load", T, 1, LOAD[1][0], 3)
            if ta + 1 < T:
                yield from zero(1, ta + 1, p)
                yield ("read", 1, ta + 1, (4, 5, 6, 7), v)  # pv_rs(b), waited
                yield ("wait_reads",)
                if ta + 3 < T:
                    yield ("load", ta + 3, 1, LOAD[1][0], 3)
                if ta + 3 >= T:
                    yield from nxt_load(1)
    # ---- epilogue: this warpgroup's row sums -> sL[:, w], CTA barrier, the other's -> registers
    yield ("write_scale", ("L", w), req)
    yield ("ctabar",)
    yield ("read_scale", ("L", 1 - w), req)


def column_programs_qpf(items, tma=False, mutate=None, wg1of=False):
    """Both warpgroups' events for a column of rows [(T, tail, request), ...] (None: a row with b < 0, skipped) as
    ``seesaw_column_qpf`` walks it, with the column's tile numbering, the kernel's mbarrier parities and its Q
    bookkeeping (q_of: the request whose Q sQ holds or will hold; nq: Q loads issued; pf: the previous item issued
    this one's Q and tiles 0 / 1), and the set of tail tiles."""
    progs = [[], []]
    tails = set()
    g = 0
    ph = [0, 0]
    q_of, nq, pf, newq = None, 0, False, False
    for k, row in enumerate(items):
        if row is None:
            continue  # the kernel skips it (b < 0); the previous row saw no next item (nb < 0): pf stays False
        T, tail, req = row
        nrow = items[k + 1] if k + 1 < len(items) else None
        q_load = req != q_of and not (mutate == "q_kept" and q_of is not None)
        if q_load:
            nq += 1
            newq = True
        q_wait = (nq - 1) % 2 if newq else None  # the kernel waits (nq - 1) % 2 in every item
        nxt = None
        if T > 0 and nrow is not None:
            nt = min(nrow[0], 2)
            nxt = (nt, nrow[2] if nrow[2] != req else None)
        if tail and T > 0:
            tails.add(g + T - 1)
        for w in (0, 1):
            for ev in wg_program_qpf(w, T, req, tma=tma, tail=tail, pf=pf, q_load=q_load, q_wait=q_wait, nxt=nxt,
                                     mutate=mutate, wg1of=wg1of):
                kind = ev[0]
                if kind == "load" and ev[2] != "Q":
                    ev = ("load", g + ev[1]) + ev[2:]
                elif kind == "mwait" and ev[1] != QMB:
                    _, mb, par = ev
                    ev = ("mwait", mb, seesaw_pair_parities(ph[0], ph[1], par)[mb // 2])
                elif kind == "zero":
                    _, buf, t, blocks, mb, p = ev
                    ev = ("zero", buf, g + t, blocks, mb, ph[buf] + p)
                elif kind == "read" and ev[1] != "Q":
                    ev = ("read", ev[1], g + ev[2]) + ev[3:]
                elif kind in ("write_p", "write_scale", "read_scale") and not isinstance(ev[1], tuple):
                    ev = (kind, ev[1], g + ev[2])
                progs[w].append(ev)
        # the kernel's state after the item (seesaw_column_qpf)
        newq = False
        q_of = req
        pf = nxt is not None
        if pf:
            q_of = nrow[2]
            if nxt[1] is not None:
                nq += 1
                newq = True
        d0, d1 = seesaw_item_phases(T)
        ph = [ph[0] + d0, ph[1] + d1]
        g += T
    return progs, tails


def _check(items, tma, mutate=None, seeds=40, wg1of=False):
    progs, tails = column_programs_qpf(items, tma, mutate, wg1of)
    return {s: e for s in range(seeds) if (e := run(0, s, tma=tma, programs=progs, tail_tiles=tails))}


FIXED_COLUMNS = [
    [],
    [(1, True, 0)],  # one 1-tile item: Q and tiles in the prologue, nothing to prefetch
    [(1, False, 0), (1, True, 1), (1, False, 2)],  # 1-tile items: the next tile 1 from the buffer-0 slot
    [(1, False, 0), (2, True, 1), (3, False, 1)],  # after a 1-tile item a 2-tile one; the same request (Q kept)
    [(3, True, 0), (2, False, 1)],  # odd: the next tile 1 one pair before the next tile 0
    [(2, True, 0), (3, True, 0), (1, False, 0)],  # one request throughout: tiles prefetched, Q never reloaded
    [(5, False, 0), (4, True, 1), (3, True, 2)],
    [(2, True, 0), (7, True, 1), (1, False, 2), (6, False, 3)],
    [(0, False, 0), (3, False, 1)],  # a 0-tile item: nothing prefetched from it
    [(3, False, 0), (0, False, 1), (2, True, 2)],  # a 0-tile next item: only its Q prefetched
    [(2, False, 0), None, (3, True, 1)],  # a skipped row (b < 0): no prefetch across it
    [(4, True, 0), (1, True, 1), (4, True, 2)],
]


def _random_columns(n, seed=13):
    rng = random.Random(seed)
    cols = []
    for _ in range(n):
        req, col = 0, []
        for _ in range(rng.randint(1, 6)):
            if rng.random() < 0.08:
                col.append(None)
                continue
            req += rng.random() < 0.7  # a new request, or another item of the same one
            col.append((rng.randint(0, 7), rng.random() < 0.5, req))
        cols.append(col)
    return cols


@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("items", FIXED_COLUMNS + _random_columns(30), ids=repr)
def test_qpf_column_has_no_deadlock_or_hazard(items, tma):
    bad = _check(items, tma)
    assert not bad, next(iter(bad.items()))


@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("items", FIXED_COLUMNS + _random_columns(12, seed=29), ids=repr)
def test_qpf_column_with_wg1of_has_no_deadlock_or_hazard(items, tma):
    """wg1_other_first (branch qk-order) on the q_prefetch kernel: WG1's own-tile QK waits WG0's part first."""
    bad = _check(items, tma, wg1of=True)
    assert not bad, next(iter(bad.items()))


def test_the_qpf_wg1of_programs_differ_only_in_wg1s_wait_order():
    """Same events per warpgroup (multisets), WG0's in the same order, WG1's mbarrier waits 2 before 3."""
    for items in FIXED_COLUMNS:
        for tma in (False, True):
            (a0, a1), _ = column_programs_qpf(items, tma)
            (b0, b1), _ = column_programs_qpf(items, tma, wg1of=True)
            assert a0 == b0 and sorted(map(repr, a1)) == sorted(map(repr, b1)), items
            w = [e[1] for e in b1 if e[0] == "mwait" and e[1] in (2, 3)]
            assert w == [2, 3] * (len(w) // 2), (items, w)


@pytest.mark.parametrize("mutate,items", [
    ("q_early", [(3, False, 0), (2, False, 1)]),  # WG0's last S_a may still read sQ
    ("q_early", [(2, False, 0), (2, False, 1)]),
    ("q_wg0_early", [(2, False, 0), (2, False, 1)]),  # WG1's last S_b may still read sQ
    ("kv_early", [(2, False, 0), (2, False, 1)]),  # the next tile 0 over V_L still read by P_a V_L
    ("q_parity", [(1, False, 0), (1, False, 1), (1, False, 2)]),
    ("no_q_wait", [(2, False, 0), (2, False, 1)]),
    ("reload", [(2, False, 0), (2, False, 1)]),
    ("odd_to_buffer1", [(3, False, 0), (2, False, 1)]),
    ("q_kept", [(2, False, 0), None, (2, False, 1)]),
    ("no_prologue_bar", [(2, False, 0), (1, False, 1)]),  # sL: the 1-tile item's write before the other's read
])
@pytest.mark.parametrize("tma", [False, True])
def test_the_qpf_model_catches_broken_orders(mutate, items, tma):
    assert _check(items, tma, mutate, seeds=30), mutate
    assert not _check(items, tma, seeds=30)


def test_every_tile_and_q_is_loaded_once_in_column_order():
    """Per buffer, the loads (issued by either the item itself or the one before it) come in column tile order and
    each tile's two parts exactly once (so the phase arithmetic of seesaw_item_phases holds); Q is loaded once per
    change of request along the column and never for a row that keeps it."""
    for items in FIXED_COLUMNS + _random_columns(60, seed=5):
        progs, _ = column_programs_qpf(items)
        for w in (0, 1):
            loads = [e for e in progs[w] if e[0] == "load" and e[2] != "Q"]
            for buf in (0, 1):
                tiles = [e[1] for e in loads if e[2] == buf]
                assert tiles == sorted(tiles) and len(tiles) == len(set(tiles)), (items, w, buf, tiles)
                assert all(t % 2 == buf for t in _local_tiles(items, tiles)), (items, buf)
        rows = [r for r in items if r is not None]
        assert sum(sum(e[0] == "load" and e[2] == "Q" for e in p) for p in progs) == \
            sum(1 for i, r in enumerate(rows) if i == 0 or r[2] != rows[i - 1][2])


def _local_tiles(items, tiles):
    """Column tile numbers -> local tile numbers within their item (buffer = local % 2)."""
    starts, g = [], 0
    for row in items:
        if row is not None:
            starts.append((g, row[0]))
            g += row[0]
    out = []
    for t in tiles:
        out.append(next(t - s for s, n in starts if s <= t < s + n))
    return out


def test_the_kernel_runs_what_the_model_checks():
    """Source check of the kernel: the column loop's bookkeeping is the model's (q_of, nq, pf as in
    column_programs_qpf), and in seesaw_item's 16-bit pair loop the qpf insertions sit where the model puts them:
    warpgroup 1's Q issue right after its pv_remote of tile a and before its softmax of tile b; each next-tile load
    right after the refill slot (refill_part) of the own tile a+2 / b+2 of the same warpgroup, on the same mbarrier."""
    src = KERNEL_SRC.read_text()
    col = src[src.index("    def seesaw_column_qpf("):]
    col = col[:col.index("\n    @cute.jit", 10)]
    for line in ("q_load = b != q_of", "nq = nq + 1", "qpar = (nq + 1) % 2", "pf = cutlass.Int32(0)",
                 "ph0 = ph0 + (T + 1) // 2", "ph1 = ph1 + T // 2", "if it + 1 < end:"):
        assert line in col, line
    item = src[src.index("    def seesaw_item("):]
    sixteen = item[item.index("            else:\n                if wg == 0:\n                    # S_a"):
                   item.index("cute.arch.cp_async_wait_group(0)")]
    wg0, wg1 = sixteen.split("                else:\n", 1)
    order0 = [m.group(0) for m in re.finditer(r"self\.(pv_rs|pv_remote|refill_part|qpf_load_next|qpf_issue_q|"
                                              r"softmax_publish|qk)\b", wg0)]
    assert order0 == ["self.qk", "self.softmax_publish", "self.pv_rs", "self.refill_part", "self.qpf_load_next",
                      "self.pv_remote", "self.refill_part", "self.qpf_load_next"], order0
    order1 = [m.group(0) for m in re.finditer(r"self\.(pv_rs|pv_remote|refill_part|qpf_load_next|qpf_issue_q|"
                                              r"softmax_publish|qk)\b", wg1)]
    assert order1 == ["self.qk", "self.pv_remote", "self.qpf_issue_q", "self.softmax_publish", "self.refill_part",
                      "self.qpf_load_next", "self.pv_rs", "self.refill_part", "self.qpf_load_next"], order1
    assert "warpgroup.wait_group(0)" in wg1[wg1.index("self.softmax_publish"):wg1.index("self.qpf_load_next")]
    # the next-tile loads: buffer-0 slot (and buffer 1 after a 1-tile item) under ta + 2 >= T, buffer-1 slot under
    # ta + 3 >= T, per warpgroup
    for part, wgi in ((wg0, 0), (wg1, 1)):
        calls = re.findall(r"if (ta \+ [23] >= T):\n\s+self\.qpf_load_(next|slot)\(qpf, kv_src, (\d), (\d)", part)
        assert calls == [("ta + 2 >= T", "next", str(wgi), "0"), ("ta + 3 >= T", "next", str(wgi), "1")], calls
