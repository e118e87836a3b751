"""Pure-Python model of the seesaw WGMMA kernel's synchronization (no DSL, no GPU).

``MLADecodePartialWGMMASeesaw.kernel_seesaw`` runs two warpgroup programs that hand K tiles,
P and the softmax rescales to each other through 4 mbarriers (cp.async completion, per buffer
and loading warpgroup), 2 named barriers ("P of WG w's tile ready") and a CTA barrier before and
after the pair loop.  ``wg_program`` below replays that control flow (same conditions on the
local tile count T, same mbarrier indices and parities, same order of loads, waits, reads and
writes) as a sequence of events; ``run`` interleaves the two programs at random and tracks
happens-before with vector clocks.  Checked for T = 0..11 and many interleavings:

* no deadlock, every named-barrier arrive matched by one sync before the next arrive;
* every WGMMA read of a K block sees the tile it expects, loaded by a cp.async whose landing
  was observed (mbarrier wait) by a thread ordered before the reader;
* no cp.async into a block while any warpgroup's WGMMA may still read it, and only after every
  earlier read of that block is ordered before it (WAR);
* P (written over the RoPE block) and the rescale slots are read only after their write and
  never overwritten before the other warpgroup read them.

The model mirrors the kernel by hand: keep it in step with ``kernel_seesaw`` (the mutation test
checks that it would catch a misplaced load, a missing wait or a swapped barrier).

fp8 KV (``fp8=True``, branch wgmma-fp8-seesaw): a part is ld.global'ed into registers ("ldg",
no shared-memory effect, one staging register set per warpgroup) and later converted and
st.shared'ed ("load": the smem write, complete when the part's mbarrier phase completes: the
stores precede the arrive).  Same events as the cp.async kernel except for two moved stores: WG1
issues its P_b V WGMMAs (reads of buffer 1) *before* converting tile a+2's part into buffer 0
and waits for them afterwards; WG0 stages its part of tile b+2 at the end of pair p and stores
it in pair p + 1 after issuing S_{a+2} (reads of buffer 0), before waiting for them.  Checked in addition: every "load" converts exactly the part the
warpgroup's last "ldg" fetched, and no "ldg" overwrites staged registers not yet stored.

TMA loads (``tma=True``, branch seesaw-tma2): the same events (a TMA part completes its mbarrier phase as a
cp.async part does), but TMA copies page tails as they are (NaN), so when the item's last tile is a request's
partial last tile (``tail=True``) each warpgroup "zero"es its V half of that tile (a second wait on its own
part's mbarrier phase, then st.shared) before its P V, whose reads are "V" reads here.  Checked in addition:
no P V read of the partial tile sees unzeroed rows; the zeroing writes only a landed K tile, after every read
of those blocks (S included) is complete and ordered before it, and waits on a phase that is still the latest.

``wg1of=True`` (the 16-bit kernels' ``wg1_other_first`` option, branch qk-order): warpgroup 1's QK of its own tile b
waits on warpgroup 0's part (mbarrier 2) first and reads its blocks (0..3 and the RoPE block 8), then waits on its own
part (mbarrier 3) and reads blocks 4..7 (``wg1_qk``); every other event is the same.  Both waits take the same
parity as before, and the "zero" of tile b (tma) still finds mbarrier 3 at the phase WG1 waited (its next phase is
armed by WG1 itself, after its P_b V).
"""

from __future__ import annotations

import random

import pytest

# blocks of a K tile (64 columns each) that WG w loads: [w][0] when it owns the tile, [w][1] else
LOAD = {0: ((0, 1, 2, 3), (0, 1, 2, 3, 8)), 1: ((4, 5, 6, 7), (4, 5, 6, 7, 8))}


def wg1_qk(ta, par, wg1of=False, mutate=None, extra=None):
    """Warpgroup 1's QK of its own tile b = ta + 1 (``qk`` on buffer 1): its own part (mbarrier 3, blocks 4..7) and
    then WG0's (mbarrier 2, blocks 0..3 and RoPE block 8), or with ``wg1of`` (``wg1_other_first``) WG0's part first;
    each "read" followed by ``extra(blocks)``'s events when given (the qpf model's sQ reads).  Mutation "skip_wait":
    no wait on mbarrier 3 (WG1's own part)."""
    parts = [(3, (4, 5, 6, 7)), (2, (0, 1, 2, 3, 8))]
    if wg1of:
        parts.reverse()
    for mb, blocks in parts:
        if not (mutate == "skip_wait" and mb == 3):
            yield ("mwait", mb, par)
        yield ("read", 1, ta + 1, blocks, "K")
        if extra is not None:
            yield from extra(blocks)
    yield ("wait_reads",)


def wg_program(w, T, mutate=None, fp8=False, tma=False, tail=False, wg1of=False):
    """Events of warpgroup w for an item of T tiles (tile a = 2p in buffer 0, b = 2p + 1 in buffer 1);
    ``tma``, ``tail``: ``wg_program_tma``; ``wg1of``: ``wg1_qk`` (16-bit kernels only)."""
    if fp8:
        assert not wg1of, "wg1_other_first: 16-bit KV only"
        yield from wg_program_fp8(w, T, mutate)
        return
    if tma:
        yield from wg_program_tma(w, T, mutate, tail, wg1of)
        return
    for t in range(2):  # prologue: tiles 0 and 1, mbarrier 2 * buffer + loading warpgroup
        if T > t:
            yield ("load", t, t, LOAD[w][0 if t == w else 1], 2 * t + w)
    yield ("ctabar",)
    for p in range((T + 1) // 2):
        ta, par = 2 * p, p % 2
        if w == 0:
            yield ("mwait", 0, par)  # qk: own part, its 16 k-steps, then the other part
            yield ("read", 0, ta, (0, 1, 2, 3), "K")
            yield ("mwait", 1, par)
            yield ("read", 0, ta, (4, 5, 6, 7, 8), "K")
            yield ("wait_reads",)
            yield ("write_p", 0, ta)  # softmax_publish: P over block 8, rescale slot 0, arrive 1
            yield ("write_scale", 0, ta)
            yield ("arrive", 1)
            yield ("read", 0, ta, (0, 1, 2, 3), "K")  # pv_rs, waited
            yield ("wait_reads",)
            if ta + 2 < T:
                yield ("load", ta + 2, 0, LOAD[0][0], 0)
            if ta + 1 < T:
                yield ("sync", 2)  # pv_remote(b), waited
                yield ("read_scale", 1, ta + 1)
                yield ("read", 1, ta + 1, (0, 1, 2, 3), "K")
                yield ("read", 1, ta + 1, (8,), "P")
                if mutate == "early_load":
                    yield ("load", ta + 3, 1, LOAD[0][1], 2) if ta + 3 < T else ("nop",)
                yield ("wait_reads",)
                if ta + 3 < T and mutate != "early_load":
                    yield ("load", ta + 3, 1, LOAD[0][1], 2)
        else:
            if ta + 1 < T:
                yield from wg1_qk(ta, par, wg1of, mutate)
            if mutate == "scale_before_sync":
                yield ("read_scale", 0, ta)
            yield ("sync", 1)  # pv_remote(a), not waited
            if mutate != "scale_before_sync":
                yield ("read_scale", 0, ta)
            yield ("read", 0, ta, (4, 5, 6, 7), "K")
            yield ("read", 0, ta, (8,), "P")
            if ta + 1 < T:  # softmax_publish(b) under the P_a V WGMMAs
                yield ("write_p", 1, ta + 1)
                yield ("write_scale", 1, ta + 1)
                yield ("arrive", 2)
            yield ("wait_reads",)
            if ta + 2 < T:
                yield ("load", ta + 2, 0, LOAD[1][1], 1)
            if ta + 1 < T:
                yield ("read", 1, ta + 1, (4, 5, 6, 7), "K")  # pv_rs(b), waited
                yield ("wait_reads",)
                if ta + 3 < T:
                    yield ("load", ta + 3, 1, LOAD[1][0], 3)
    yield ("ctabar",)


def wg_program_tma(w, T, mutate=None, tail=False, wg1of=False):
    """``kernel_seesaw`` with ``tma``: the cp.async program with its P V reads tagged "V" and, when local tile
    T - 1 is a request's partial last tile (``tail``), ("zero", buffer, tile, blocks, mbarrier, pair) where the
    kernel calls ``zero_v_tail``: WG0 before P_a V_L and after the P_b barrier, WG1 after the P_a barrier and
    before P_b V_R.  Mutations: "no_zero"; "zero_before_sync" (the non-owner zeroes before the owner's P
    barrier, while the owner's S may still read those rows)."""
    own = LOAD[w][0]  # this warpgroup's V half (blocks 4w .. 4w + 3): what it reads in P V

    def zero(buf, t, p):
        if tail and t == T - 1 and mutate != "no_zero":
            yield ("zero", buf, t, own, 2 * buf + w, p)

    for t in range(2):
        if T > t:
            yield ("load", t, t, LOAD[w][0 if t == w else 1], 2 * t + w)
    yield ("ctabar",)
    for p in range((T + 1) // 2):
        ta, par = 2 * p, p % 2
        if w == 0:
            yield ("mwait", 0, par)
            yield ("read", 0, ta, (0, 1, 2, 3), "K")
            yield ("mwait", 1, par)
            yield ("read", 0, ta, (4, 5, 6, 7, 8), "K")
            yield ("wait_reads",)
            yield ("write_p", 0, ta)
            yield ("write_scale", 0, ta)
            yield ("arrive", 1)
            yield from zero(0, ta, p)
            yield ("read", 0, ta, (0, 1, 2, 3), "V")  # pv_rs, waited
            yield ("wait_reads",)
            if ta + 2 < T:
                yield ("load", ta + 2, 0, LOAD[0][0], 0)
            if ta + 1 < T:
                if mutate == "zero_before_sync":
                    yield from zero(1, ta + 1, p)
                yield ("sync", 2)  # pv_remote(b): barrier, zero if last, rescale, WGMMA, waited
                if mutate != "zero_before_sync":
                    yield from zero(1, ta + 1, p)
                yield ("read_scale", 1, ta + 1)
                yield ("read", 1, ta + 1, (0, 1, 2, 3), "V")
                yield ("read", 1, ta + 1, (8,), "P")
                yield ("wait_reads",)
                if ta + 3 < T:
                    yield ("load", ta + 3, 1, LOAD[0][1], 2)
        else:
            if ta + 1 < T:
                yield from wg1_qk(ta, par, wg1of)
            if mutate == "zero_before_sync":
                yield from zero(0, ta, p)
            yield ("sync", 1)  # pv_remote(a): barrier, zero if last, rescale, WGMMA, not waited
            if mutate != "zero_before_sync":
                yield from zero(0, ta, p)
            yield ("read_scale", 0, ta)
            yield ("read", 0, ta, (4, 5, 6, 7), "V")
            yield ("read", 0, ta, (8,), "P")
            if ta + 1 < T:
                yield ("write_p", 1, ta + 1)
                yield ("write_scale", 1, ta + 1)
                yield ("arrive", 2)
            yield ("wait_reads",)
            if ta + 2 < T:
                yield ("load", ta + 2, 0, LOAD[1][1], 1)
            if ta + 1 < T:
                yield from zero(1, ta + 1, p)
                yield ("read", 1, ta + 1, (4, 5, 6, 7), "V")  # pv_rs(b), waited
                yield ("wait_reads",)
                if ta + 3 < T:
                    yield ("load", ta + 3, 1, LOAD[1][0], 3)
    yield ("ctabar",)


def wg_program_fp8(w, T, mutate=None):
    """fp8 KV (``kernel_seesaw`` with ``is_fp8``): "ldg" = ld.global of a part into the staging
    registers, "load" = its conversion + st.shared + fence + mbarrier arrive."""
    for t in range(2):  # prologue: ldg then store at once
        if T > t:
            blocks = LOAD[w][0 if t == w else 1]
            yield ("ldg", t, blocks)
            yield ("load", t, t, blocks, 2 * t + w)
    yield ("ctabar",)
    for p in range((T + 1) // 2):
        ta, par = 2 * p, p % 2
        if w == 0:
            yield ("mwait", 0, par)  # S_a issued, not waited
            yield ("read", 0, ta, (0, 1, 2, 3), "K")
            yield ("mwait", 1, par)
            yield ("read", 0, ta, (4, 5, 6, 7, 8), "K")
            if p > 0 and ta + 1 < T and mutate != "fp8_store_before_wait":
                yield ("load", ta + 1, 1, LOAD[0][1], 2)  # tile b's part (staged last pair), under S_a
            yield ("wait_reads",)
            yield ("write_p", 0, ta)
            yield ("write_scale", 0, ta)
            yield ("arrive", 1)
            if ta + 2 < T:
                yield ("ldg", ta + 2, LOAD[0][0])  # in flight during P_a V_L
            yield ("read", 0, ta, (0, 1, 2, 3), "K")  # pv_rs, waited
            yield ("wait_reads",)
            if ta + 2 < T:
                yield ("load", ta + 2, 0, LOAD[0][0], 0)
            if ta + 1 < T:
                if ta + 3 < T:
                    yield ("ldg", ta + 3, LOAD[0][1])  # staged; stored in the next pair
                yield ("sync", 2)
                yield ("read_scale", 1, ta + 1)
                yield ("read", 1, ta + 1, (0, 1, 2, 3), "K")
                yield ("read", 1, ta + 1, (8,), "P")
                if mutate == "fp8_store_before_wait" and ta + 3 < T:
                    yield ("load", ta + 3, 1, LOAD[0][1], 2)
                yield ("wait_reads",)
        else:
            if ta + 1 < T:
                yield ("mwait", 3, par)
                yield ("read", 1, ta + 1, (4, 5, 6, 7), "K")
                yield ("mwait", 2, par)
                yield ("read", 1, ta + 1, (0, 1, 2, 3, 8), "K")
                yield ("wait_reads",)
            yield ("sync", 1)  # pv_remote(a), not waited
            yield ("read_scale", 0, ta)
            yield ("read", 0, ta, (4, 5, 6, 7), "K")
            yield ("read", 0, ta, (8,), "P")
            if ta + 1 < T:
                yield ("write_p", 1, ta + 1)
                yield ("write_scale", 1, ta + 1)
                yield ("arrive", 2)
            if ta + 2 < T:
                yield ("ldg", ta + 2, LOAD[1][1])  # in flight under P_a V_R
            if mutate == "fp8_double_ldg" and ta + 3 < T:
                yield ("ldg", ta + 3, LOAD[1][0])
            yield ("wait_reads",)  # P_a V_R done: buffer 0 columns 256..575 free
            if ta + 1 < T:
                yield ("read", 1, ta + 1, (4, 5, 6, 7), "K")  # P_b V_R issued, not waited
            if ta + 2 < T:
                yield ("load", ta + 2, 0, LOAD[1][1], 1)  # converted under P_b V_R
            if ta + 1 < T:
                if ta + 3 < T and mutate != "fp8_double_ldg":
                    yield ("ldg", ta + 3, LOAD[1][0])
                if mutate == "fp8_store_before_wait" and ta + 3 < T:
                    yield ("load", ta + 3, 1, LOAD[1][0], 3)
                yield ("wait_reads",)
                if ta + 3 < T and mutate != "fp8_store_before_wait":
                    yield ("load", ta + 3, 1, LOAD[1][0], 3)
    yield ("ctabar",)


def _hb(a, b):
    return all(x <= y for x, y in zip(a, b))


def _observers(landed: dict, phase) -> list:
    """The clocks that observed an mbarrier phase: ``landed`` maps (mbar, phase) to one clock (one observer kept)
    or to a list of clocks (every observer, as run_seesaw keeps them)."""
    obs = landed.get(phase)
    if not obs:
        return []
    return obs if isinstance(obs[0], list) else [obs]


class SmemModel:
    """What every protocol model here checks on shared memory, for ``n`` programs with vector clocks ``vc``: the
    K / P blocks of the two buffers (``store``, ``read``, ``wait_reads``: WAR / WAW / RAW), the owner's P and the
    rescale slots (``write_p``, ``write_scale``, ``read_scale``) and the P named barriers (``arrive``, ``sync``).
    Violations go to ``errors``.  This file's two-warpgroup ``run`` and test_seesaw_fp8p_protocol.py's
    three-program ``run`` share it; each handles its own mbarriers, barriers and extra events around it."""

    def __init__(self, n):
        self.vc = [[0] * n for _ in range(n)]
        self.mem = {}  # (buffer, block) -> {"tag", "vc", "phase", "reads"}
        self.inflight = [[] for _ in range(n)]  # per program: blocks its issued WGMMAs may still read
        self.slots = {}  # rescale slot -> {"t", "vc", "reads"}
        self.arrives = {1: [], 2: []}  # named barrier -> clocks of arrives not yet synced
        self.errors = []

    def merge(self, w, v):
        self.vc[w] = [max(a, b) for a, b in zip(self.vc[w], v)]

    def store(self, w, t, buf, blocks, phase, verb):
        """Program w writes tile t's ``blocks`` of buffer ``buf`` (landing on mbarrier phase ``phase``)."""
        vc = self.vc
        for blk in blocks:
            cell = self.mem.setdefault((buf, blk), {"tag": None, "vc": [0] * len(vc), "phase": None, "reads": []})
            if any((buf, blk) in reads for reads in self.inflight):
                self.errors.append(f"WAR: tile {t} {verb} into buf {buf} block {blk} under an in-flight read")
            if not all(_hb(r, vc[w]) for r in cell["reads"]) or not _hb(cell["vc"], vc[w]):
                self.errors.append(f"WAR/WAW: tile {t} {verb} into buf {buf} block {blk} not ordered")
            self.mem[(buf, blk)] = {"tag": ("K", t), "vc": list(vc[w]), "phase": phase, "reads": []}

    def read(self, w, buf, t, blocks, what, landed):
        """A WGMMA of program w reads ``what`` of tile t ("K" / "P") from ``blocks`` of buffer ``buf``: written
        before, and for K its mbarrier phase observed (``landed``: (mbar, phase) -> the observers, ``_observers``)."""
        vc = self.vc
        for blk in blocks:
            cell = self.mem.get((buf, blk))
            if cell is None or cell["tag"] != (what, t) or not _hb(cell["vc"], vc[w]):
                self.errors.append(f"RAW: WG{w} reads {(what, t)} from buf {buf} block {blk}: "
                                   f"{None if cell is None else cell['tag']}")
            elif what == "K" and not any(_hb(x, vc[w]) for x in _observers(landed, cell["phase"])):
                self.errors.append(f"RAW: WG{w} reads tile {t} buf {buf} block {blk}: landing not observed")
            self.inflight[w].append((buf, blk))

    def step(self, w, ev):
        """The events every model has the same way; False for any other (the caller's)."""
        kind, vc, errors = ev[0], self.vc, self.errors
        if kind == "wait_reads":
            for key in self.inflight[w]:
                self.mem[key]["reads"].append(list(vc[w]))
            self.inflight[w] = []
        elif kind == "write_p":
            _, buf, t = ev
            cell = self.mem[(buf, 8)]
            if cell["tag"] != ("K", t) or not _hb(cell["vc"], vc[w]) or not all(_hb(r, vc[w]) for r in cell["reads"]):
                errors.append(f"P of tile {t}: block 8 not free ({cell['tag']})")
            self.mem[(buf, 8)] = {"tag": ("P", t), "vc": list(vc[w]), "phase": None, "reads": []}
        elif kind == "write_scale":
            _, s, t = ev
            old = self.slots.get(s)
            if old is not None and not all(_hb(r, vc[w]) for r in old["reads"]):
                errors.append(f"rescale slot {s} of tile {t} overwritten before it was read")
            self.slots[s] = {"t": t, "vc": list(vc[w]), "reads": []}
        elif kind == "read_scale":
            _, s, t = ev
            cur = self.slots.get(s)
            if cur is None or cur["t"] != t or not _hb(cur["vc"], vc[w]):
                errors.append(f"rescale slot {s}: tile {t} read before it was written")
            else:
                cur["reads"].append(list(vc[w]))
        elif kind == "arrive":
            if self.arrives[ev[1]]:
                errors.append(f"named barrier {ev[1]}: a second arrive before the sync")
            self.arrives[ev[1]].append(list(vc[w]))
        elif kind == "sync":
            self.merge(w, self.arrives[ev[1]].pop(0))
        else:
            return False
        return True

    def end_checks(self):
        if any(self.arrives.values()):
            self.errors.append("named-barrier arrive left unmatched")
        if any(self.inflight):
            self.errors.append("WGMMA reads in flight at the end")


def run(T, seed, mutate=None, fp8=False, tma=False, tail=False, programs=None, tail_tiles=None, wg1of=False):
    """Interleave the two programs at random; return the list of violations (empty: fine).  ``programs`` (the
    two warpgroups' event lists) and ``tail_tiles`` (tiles whose V rows must be zeroed before P V) replace the
    one-item programs of T tiles: test_seesaw_balanced_protocol.py runs a balanced column's items that way.
    ``wg1of``: the one-item programs with ``wg1_other_first`` (``wg1_qk``)."""
    rng = random.Random(seed)
    progs = [wg_program(0, T, mutate, fp8, tma, tail, wg1of), wg_program(1, T, mutate, fp8, tma, tail, wg1of)]
    if programs is not None:
        progs = [iter(programs[0]), iter(programs[1])]
    tails = set(tail_tiles) if tail_tiles is not None else ({T - 1} if tail else set())
    staged = [None, None]  # fp8: (tile, blocks) in each warpgroup's staging registers
    sm = SmemModel(2)
    vc, mem, inflight, errors = sm.vc, sm.mem, sm.inflight, sm.errors
    nxt = [next(progs[0], None), next(progs[1], None)]
    phase_done = [0] * 5  # completed phases per mbarrier (4: the Q mbarrier of test_seesaw_qpf_protocol.py)
    phase_vc = {}  # (mbar, phase) -> clock of the load that completes it
    landed = {}  # (mbar, phase) -> clocks of the threads that observed it (after their waits)
    waited = [[0] * 5, [0] * 5]  # phases each warpgroup has waited per mbarrier

    for _ in range(200000):
        if nxt[0] is None and nxt[1] is None:
            break
        ready = []
        for w in (0, 1):
            ev = nxt[w]
            if ev is None:
                continue
            kind = ev[0]
            if kind == "mwait" and phase_done[ev[1]] <= waited[w][ev[1]]:
                continue
            if kind == "zero" and phase_done[ev[4]] <= ev[5]:  # its part's phase of this pair not landed
                continue
            if kind == "sync" and not sm.arrives[ev[1]]:
                continue
            if kind == "ctabar" and (nxt[1 - w] is None or nxt[1 - w][0] != "ctabar"):
                continue
            ready.append(w)
        if not ready:
            return [f"deadlock: {nxt}"]
        w = rng.choice(ready)
        ev = nxt[w]
        kind = ev[0]
        vc[w][w] += 1
        if kind == "ctabar":
            merged = [max(vc[0][i], vc[1][i]) for i in range(2)]
            vc[0], vc[1] = list(merged), list(merged)
            nxt = [next(progs[0], None), next(progs[1], None)]
            continue
        if kind == "ldg":
            if staged[w] is not None:
                errors.append(f"WG{w}: ldg of tile {ev[1]} over staged tile {staged[w][0]} not yet stored")
            staged[w] = (ev[1], tuple(ev[2]))
        if kind == "load" and fp8:
            if staged[w] != (ev[1], tuple(ev[3])):
                errors.append(f"WG{w}: stores tile {ev[1]} blocks {ev[3]} but staged {staged[w]}")
            staged[w] = None
        if kind == "load":
            _, t, buf, blocks, mb = ev
            sm.store(w, t, buf, blocks, (mb, phase_done[mb]), "load")
            phase_vc[(mb, phase_done[mb])] = list(vc[w])
            phase_done[mb] += 1
        elif kind == "mwait":
            _, mb, par = ev
            ph = waited[w][mb]
            if ph % 2 != par:
                errors.append(f"WG{w} waits mbarrier {mb} phase {ph} with parity {par}")
            if phase_done[mb] > ph + 1:  # a parity wait sees only the latest phase: two ahead reads as not complete
                errors.append(f"WG{w} waits mbarrier {mb} phase {ph} when {phase_done[mb]} phases completed (ABA)")
            sm.merge(w, phase_vc[(mb, ph)])
            landed.setdefault((mb, ph), []).append(list(vc[w]))
            waited[w][mb] += 1
        elif kind == "zero":  # zero_v_tail: second wait on the part's phase, st.shared of zeros
            _, buf, t, blocks, mb, ph = ev
            if phase_done[mb] != ph + 1:
                errors.append(f"WG{w} zeroes tile {t}: mbarrier {mb} is past phase {ph} (parity wait ABA)")
            sm.merge(w, phase_vc[(mb, ph)])
            for blk in blocks:
                cell = mem.get((buf, blk))
                if cell is None or cell["tag"] != ("K", t) or not _hb(cell["vc"], vc[w]):
                    tag = None if cell is None else cell["tag"]
                    errors.append(f"zero of tile {t} buf {buf} block {blk} over {tag}")
                    continue
                if any((buf, blk) in inflight[o] for o in (0, 1)) or not all(_hb(r, vc[w]) for r in cell["reads"]):
                    errors.append(f"WAR: zero of tile {t} buf {buf} block {blk} while a read may be in flight")
                mem[(buf, blk)] = {"tag": ("Z", t), "vc": list(vc[w]), "phase": cell["phase"], "reads": []}
        elif kind == "read":
            _, buf, t, blocks, what = ev
            if what == "V":  # P V reads: the K tile as loaded, or zeroed (it must be, if it is the partial tile)
                for blk in blocks:
                    cell = mem.get((buf, blk))
                    want = ("Z", t) if t in tails else ("K", t)
                    if cell is None or cell["tag"] != want or not _hb(cell["vc"], vc[w]):
                        errors.append(f"RAW: WG{w} P V reads tile {t} buf {buf} block {blk}: "
                                      f"{None if cell is None else cell['tag']}, wants {want}")
                    elif not (any(_hb(x, vc[w]) for x in landed.get(cell["phase"], ()))):
                        errors.append(f"RAW: WG{w} P V reads tile {t} buf {buf} block {blk}: landing not observed")
                    inflight[w].append((buf, blk))
                nxt[w] = next(progs[w], None)
                continue
            sm.read(w, buf, t, blocks, what, landed)
        elif kind == "write_q":  # balanced fp8 (test_seesaw_balanced_protocol.py): WG w converts its Q rows into sQ
            _, r = ev
            cell = mem.get(("Q", w))
            if cell is not None and (any(("Q", w) in inflight[o] for o in (0, 1))
                                     or not all(_hb(x, vc[w]) for x in cell["reads"])):
                errors.append(f"WAR: WG{w} writes Q of request {r} while an S WGMMA may still read sQ")
            mem[("Q", w)] = {"tag": ("Q", r), "vc": list(vc[w]), "phase": None, "reads": []}
        else:
            sm.step(w, ev)
        nxt[w] = next(progs[w], None)
    else:
        return ["no progress"]
    sm.end_checks()
    return errors

@pytest.mark.parametrize("T", range(12))
def test_seesaw_protocol_has_no_deadlock_or_hazard(T):
    bad = {seed: e for seed in range(150) if (e := run(T, seed))}
    assert not bad, next(iter(bad.items()))


@pytest.mark.parametrize("mutate", ["early_load", "skip_wait", "scale_before_sync"])
def test_the_model_catches_broken_orders(mutate):
    """A load issued before the warpgroup's own P V wait, a skipped wait on the warpgroup's own
    cp.async part, a rescale read before the barrier: each is reported for some T."""
    assert any(run(T, seed, mutate) for T in range(1, 8) for seed in range(20))


@pytest.mark.parametrize("T", range(12))
def test_seesaw_fp8_protocol_has_no_deadlock_or_hazard(T):
    bad = {seed: e for seed in range(150) if (e := run(T, seed, fp8=True))}
    assert not bad, next(iter(bad.items()))


def test_seesaw_fp8_program_is_the_cp_async_program_plus_ldg_and_one_moved_store():
    """Without the "ldg" events, the fp8 programs are the cp.async programs with two stores
    moved (WG1's tile a+2 after the issue of its P_b V reads, WG0's tile b+2 into the next
    pair after the issue of S_{a+2}): the same events, each exactly once, one ldg per store."""
    for T in range(12):
        for w in (0, 1):
            base = list(wg_program(w, T))
            f8 = [e for e in wg_program(w, T, fp8=True) if e[0] != "ldg"]
            assert sorted(map(repr, base)) == sorted(map(repr, f8)), (T, w)
            # every non-load event keeps its order
            assert [e for e in base if e[0] != "load"] == [e for e in f8 if e[0] != "load"], (T, w)
            n_ldg = sum(e[0] == "ldg" for e in wg_program(w, T, fp8=True))
            assert n_ldg == sum(e[0] == "load" for e in base), (T, w)


@pytest.mark.parametrize("tail", [False, True])
@pytest.mark.parametrize("T", range(12))
def test_seesaw_tma_protocol_has_no_deadlock_or_hazard(T, tail):
    bad = {seed: e for seed in range(150) if (e := run(T, seed, tma=True, tail=tail))}
    assert not bad, next(iter(bad.items()))


def test_seesaw_tma_program_is_the_cp_async_program_plus_zeroing():
    """Without its "zero" events and with "V" read as "K", the tma program is the cp.async program event for
    event; on a partial last tile each warpgroup zeroes its own V half of that tile once."""
    relabel = (lambda e: e[:4] + ("K",) if e[0] == "read" and e[4] == "V" else e)
    for T in range(12):
        for w in (0, 1):
            for tail in (False, True):
                evs = list(wg_program(w, T, tma=True, tail=tail))
                assert [relabel(e) for e in evs if e[0] != "zero"] == list(wg_program(w, T)), (T, w, tail)
                zeros = [e for e in evs if e[0] == "zero"]
                assert zeros == ([("zero", (T - 1) % 2, T - 1, LOAD[w][0], 2 * ((T - 1) % 2) + w, (T - 1) // 2)]
                                 if tail and T > 0 else []), (T, w, tail)


@pytest.mark.parametrize("mutate", ["no_zero", "zero_before_sync"])
def test_the_model_catches_broken_tma_orders(mutate):
    """A partial tile whose V tail is not zeroed, a non-owner that zeroes before the owner's P barrier (its S
    may still read the rows): each is reported for some T."""
    assert any(run(T, seed, mutate, tma=True, tail=True) for T in range(1, 8) for seed in range(20))


@pytest.mark.parametrize("mutate", ["fp8_store_before_wait", "fp8_double_ldg"])
def test_the_model_catches_broken_fp8_orders(mutate):
    """A conversion stored before the warpgroup's own P V wait (WAR on the buffer), an ldg
    that overwrites staged registers before they were stored: each is reported for some T."""
    assert any(run(T, seed, mutate, fp8=True) for T in range(1, 8) for seed in range(20))


# ---------------------------------------------------------------- wg1_other_first (branch qk-order)
@pytest.mark.parametrize("tma,tail", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("T", range(12))
def test_seesaw_wg1of_protocol_has_no_deadlock_or_hazard(T, tma, tail):
    """WG1 waiting WG0's part of its own tile first (cp.async, TMA, TMA with a partial last tile): no deadlock, no
    hazard, every wait on the right parity, the tail zeroing still on the latest phase of mbarrier 3."""
    bad = {seed: e for seed in range(150) if (e := run(T, seed, tma=tma, tail=tail, wg1of=True))}
    assert not bad, next(iter(bad.items()))


def test_the_wg1of_program_is_the_default_program_with_wg1s_two_qk_parts_swapped():
    """WG0's events are the same; WG1's are the same but for each own-tile QK, whose (wait, read) pairs come in the
    other order: mbarrier 2 (blocks 0..3, 8) first, then mbarrier 3 (blocks 4..7), with the same parity."""
    for T in range(12):
        for tma, tail in ((False, False), (True, False), (True, True)):
            assert list(wg_program(0, T, tma=tma, tail=tail, wg1of=True)) == list(wg_program(0, T, tma=tma, tail=tail))
            base = list(wg_program(1, T, tma=tma, tail=tail))
            swapped = list(wg_program(1, T, tma=tma, tail=tail, wg1of=True))
            assert len(base) == len(swapped)
            fixed = list(base)
            for i, e in enumerate(base):
                if e[0] == "mwait" and e[1] == 3:  # own part first in the default: (wait 3, read), (wait 2, read)
                    assert base[i + 2][:2] == ("mwait", 2) and base[i + 2][2] == e[2]
                    fixed[i:i + 4] = [base[i + 2], base[i + 3], base[i], base[i + 1]]
            assert fixed == swapped, (T, tma, tail)
            waits = [e for e in swapped if e[0] == "mwait"]
            assert [e[1] for e in waits] == [2, 3] * ((T // 2)), (T, waits)


@pytest.mark.parametrize("tma", [False, True])
def test_the_model_catches_a_skipped_second_wait_with_wg1of(tma):
    """With WG0's part first, WG1's own part (mbarrier 3) is waited second: dropping that wait is still caught."""
    def progs(T):
        return [list(wg_program(0, T, tma=tma, wg1of=True)),
                [e for e in wg_program(1, T, tma=tma, wg1of=True) if e[:2] != ("mwait", 3)]]
    assert any(run(0, seed, tma=tma, programs=progs(T), tail_tiles=set()) for T in range(2, 8) for seed in range(20))


def test_the_model_catches_a_parity_wait_two_phases_behind():
    """A parity wait that starts after its mbarrier completed the next phase too would hang on the GPU (it sees the
    latest phase only): the model reports it (each mbarrier here is armed by one warpgroup's loads)."""
    progs = [[("load", 0, 0, (0,), 0), ("load", 2, 0, (0,), 0)], [("mwait", 0, 0)]]
    assert any(run(0, seed, programs=progs, tail_tiles=set()) for seed in range(20))
