"""Pure-Python model of the fp8 seesaw with a producer warpgroup (``MLADecodePartialWGMMASeesaw(fp8_producer=True)``,
``kernel_fp8p``): three programs, no DSL, no GPU.

* Math warpgroups 0 and 1 (``seesaw_item`` under fp8_producer): the 16-bit (cp.async) seesaw's program of
  test_seesaw_protocol.py (``wg_program``) with every in-loop ("load", tile, buffer, blocks, mbarrier i) replaced
  by ("release", i): an arrive on empty[i] at the same place under the same condition (after the warpgroup's
  WGMMAs on those columns were waited; ``refill_part``), the prologue loads dropped (the producer loads tiles 0
  and 1) and the CTA barriers among the two math warpgroups only (BAR_MATH, 256 threads; the producer never joins
  one after the setup).
* The producer (``fp8p_producer``): per pair p, tile a = 2p parts full[0] then full[1], tile b = 2p + 1 (if it
  exists) parts full[3] then full[2], each a ("load", ...) (convert + st.shared + fence + arrive on full[i]) after
  ("ewait", i, (p - 1) % 2) for p >= 1 (its buffer's tile - 2 released).  The ld.global into registers touches no
  shared memory and is not modelled.

``run`` interleaves the three programs at random with vector clocks and reports: deadlock (a waiter whose phase
never comes: the hang the GPU would show), a wait with the wrong parity, a write into a block while any WGMMA read
of it may be in flight or is not ordered before it (WAR), a WGMMA read of a block that does not hold the expected
tile or whose landing was not observed (RAW), P / rescale-slot hazards, empty-barrier arrives left over or missing.
Mutations check that the model catches a producer that skips its empty wait, waits with the wrong parity or for a
buffer's first tile, a release before the WGMMA wait, and a release by the wrong warpgroup.
"""

from __future__ import annotations

import random

import pytest

from test_seesaw_protocol import LOAD, SmemModel, _hb, wg_program  # same directory (pytest rootdir import)

N = 3  # programs: math WG0, math WG1, producer WG2


def math_program(w, T, mutate=None, wg1of=False):
    """``seesaw_item`` (fp8_producer) of warpgroup w: ``wg_program(w, T)`` (16-bit cp.async) with its in-loop loads
    as releases; ``wg1of`` (``wg1_other_first`` with the ring producer, branch fp8-wg1of): WG1's QK of its tile
    waits full[2] first (``wg_program``'s ``wg1of``)."""
    evs = list(wg_program(w, T, wg1of=wg1of))
    first_bar = evs.index(("ctabar",))
    out = []
    for e in evs[first_bar:]:
        if e[0] == "load":
            mb = e[4]
            if mutate == "release_wrong_wg" and mb == 1:
                continue  # WG1 forgets empty[1] ...
            if mutate == "release_before_wait" and out and out[-1] == ("wait_reads",):
                out.insert(len(out) - 1, ("release", mb))  # ... arrives before its WGMMA reads completed
                continue
            out.append(("release", mb))
        else:
            out.append(e)
    if mutate == "release_wrong_wg" and w == 0:
        # ... and WG0 releases empty[1] after its own S reads of those columns (the WG1 P_a V_R reads still to come)
        res = []
        for e in out:
            res.append(e)
            if e == ("release", 0):
                res.append(("release", 1))
        out = res
    return out


def producer_program(T, mutate=None, wg1of=False):
    """``fp8p_producer``: (ewait, load) per part in the math side's wait order (``wg1of``: tile b's parts 2, 3)."""
    out = []
    for p in range((T + 1) // 2):
        ta = 2 * p
        parts = [(ta, 0, LOAD[0][0], 0), (ta, 0, LOAD[1][1], 1)]
        if ta + 1 < T:
            tile_b = [(ta + 1, 1, LOAD[1][0], 3), (ta + 1, 1, LOAD[0][1], 2)]
            parts += tile_b[::-1] if wg1of else tile_b
        for t, buf, blocks, mb in parts:
            if mutate == "producer_waits_first" or (p > 0 and mutate != "no_empty_wait"):
                par = p % 2 if mutate in ("wrong_parity", "producer_waits_first") else (p - 1) % 2
                out.append(("ewait", mb, par))
            out.append(("load", t, buf, blocks, mb))
    return out


def run(T, seed, mutate=None, programs=None, counts=None):
    """Interleave WG0, WG1 (math) and WG2 (producer) at random; return the list of violations (empty: fine).
    ``programs`` (balanced columns, test_seesaw_fp8p_balanced_protocol.py): the three programs instead of one
    item's, with ``counts`` = (full phases, empty arrives, producer empty waits) expected per mbarrier at the end;
    they may also write sQ ("write_q", request: math warpgroup w's half of the rows, before the item's BAR_MATH)."""
    rng = random.Random(seed)
    if programs is None:
        progs = [iter(math_program(0, T, mutate)), iter(math_program(1, T, mutate)),
                 iter(producer_program(T, mutate))]
    else:
        progs = [iter(p) for p in programs]
    sm = SmemModel(N)
    vc, mem, inflight, errors = sm.vc, sm.mem, sm.inflight, sm.errors
    nxt = [next(p, None) for p in progs]
    full_done, empty_done = [0] * 4, [0] * 4  # completed phases per mbarrier
    full_vc, empty_vc = {}, {}  # (mbar, phase) -> clock of the arrive that completed it
    landed = {}  # (mbar, phase) of full -> clock of a thread that observed it
    waited = [[0] * 4 for _ in range(N)]  # full phases each program waited
    ewaited = [0] * 4  # empty phases the producer waited

    for _ in range(200000):
        if all(e is None for e in nxt):
            break
        ready = []
        for w in range(N):
            ev = nxt[w]
            if ev is None:
                continue
            kind = ev[0]
            if kind == "mwait" and full_done[ev[1]] <= waited[w][ev[1]]:
                continue
            if kind == "ewait" and empty_done[ev[1]] <= ewaited[ev[1]]:
                continue
            if kind == "sync" and not sm.arrives[ev[1]]:
                continue
            if kind == "ctabar" and (nxt[1 - w] is None or nxt[1 - w][0] != "ctabar"):  # math-only barrier
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
        if kind == "load":
            _, t, buf, blocks, mb = ev
            sm.store(w, t, buf, blocks, (mb, full_done[mb]), "store")
            full_vc[(mb, full_done[mb])] = list(vc[w])
            full_done[mb] += 1
        elif kind == "mwait":
            _, mb, par = ev
            ph = waited[w][mb]
            if ph % 2 != par:
                errors.append(f"WG{w} waits full[{mb}] phase {ph} with parity {par}")
            sm.merge(w, full_vc[(mb, ph)])
            landed[(mb, ph)] = list(vc[w])
            waited[w][mb] += 1
        elif kind == "release":
            mb = ev[1]
            empty_vc[(mb, empty_done[mb])] = list(vc[w])
            empty_done[mb] += 1
        elif kind == "ewait":
            _, mb, par = ev
            ph = ewaited[mb]
            if ph % 2 != par:
                errors.append(f"producer waits empty[{mb}] phase {ph} with parity {par}")
            sm.merge(w, empty_vc[(mb, ph)])
            ewaited[mb] += 1
        elif kind == "read":
            _, buf, t, blocks, what = ev
            sm.read(w, buf, t, blocks, what, landed)
        elif kind == "write_q":  # sQ rows of math warpgroup w (load_q), for request ev[1]
            cell = mem.setdefault(("Q", w), {"tag": None, "vc": [0] * N, "phase": None, "reads": []})
            if any(("Q", w) in inflight[o] for o in range(N)):
                errors.append(f"WAR: Q of request {ev[1]} written under an in-flight S WGMMA")
            if not all(_hb(r, vc[w]) for r in cell["reads"]) or not _hb(cell["vc"], vc[w]):
                errors.append(f"WAR/WAW: Q of request {ev[1]} written before the last S read of sQ")
            mem[("Q", w)] = {"tag": ("Q", ev[1]), "vc": list(vc[w]), "phase": None, "reads": []}
        else:
            sm.step(w, ev)
        nxt[w] = next(progs[w], None)
    else:
        return ["no progress"]
    sm.end_checks()
    if counts is not None:
        if (full_done, empty_done, ewaited) != tuple(list(c) for c in counts):
            errors.append(f"phases full {full_done} / empty {empty_done} / empty waits {ewaited}, expected {counts}")
        return errors
    if empty_done != ewaited:
        errors.append(f"empty arrives {empty_done} != producer waits {ewaited}")
    if full_done != [sum(1 for t in range(T) if t % 2 == mb // 2) for mb in range(4)]:
        errors.append(f"full phases {full_done} for T={T}")
    return errors


@pytest.mark.parametrize("T", range(12))
def test_fp8p_protocol_has_no_deadlock_or_hazard(T):
    bad = {seed: e for seed in range(200) if (e := run(T, seed))}
    assert not bad, next(iter(bad.items()))


def test_fp8p_phase_counts_match_the_kernel():
    """Per mbarrier and item of T tiles: full[i] completes one phase per tile of buffer i // 2 (ceil(T / 2) /
    floor(T / 2), as ``seesaw_item_phases``); the math side arrives on empty[i] once per producer wait (tiles >= 2 of
    that buffer), so no phase is left over or missing for T = 0 (no events at all), 1, odd and even."""
    from mla_cute_dsl.kernels.sm90_wgmma_decode import seesaw_item_phases

    for T in range(12):
        rel = [sum(1 for w in (0, 1) for e in math_program(w, T) if e == ("release", i)) for i in range(4)]
        waits = [sum(1 for e in producer_program(T) if e[:2] == ("ewait", i)) for i in range(4)]
        loads = [sum(1 for e in producer_program(T) if e[0] == "load" and e[4] == i) for i in range(4)]
        assert rel == waits, (T, rel, waits)
        ph0, ph1 = seesaw_item_phases(T)
        assert loads == [ph0, ph0, ph1, ph1], (T, loads)
        assert waits == [max(ph0 - 1, 0), max(ph0 - 1, 0), max(ph1 - 1, 0), max(ph1 - 1, 0)], (T, waits)
        # empty[i] is released only by the warpgroup the 16-bit kernel loads part i with (its last reader)
        for w in (0, 1):
            assert all(e[1] % 2 == w for e in math_program(w, T) if e[0] == "release"), (T, w)
    assert producer_program(0) == [] and all(e[0] != "mwait" for w in (0, 1) for e in math_program(w, 0))


def test_fp8p_math_program_is_the_16bit_program_without_loads():
    """The math warpgroups' events are the cp.async program's, in order, with loads turned into releases."""
    for T in range(12):
        for w in (0, 1):
            base = [e for e in wg_program(w, T) if e[0] != "load"]
            mine = [e for e in math_program(w, T) if e[0] != "release"]
            assert base == mine, (T, w)


@pytest.mark.parametrize("mutate", ["no_empty_wait", "wrong_parity", "producer_waits_first", "release_before_wait",
                                    "release_wrong_wg"])
def test_the_model_catches_broken_fp8p_orders(mutate):
    """A producer that writes a buffer part before its last reader released it (no empty wait; the release moved
    before the WGMMA wait; empty[1] released by WG0, whose reads end before WG1's P_a V_R), one that waits with the
    wrong parity, one that waits for a buffer's first tile too (the hang: nobody arrives): each is reported."""
    assert any(run(T, seed, mutate) for T in range(1, 8) for seed in range(30))
