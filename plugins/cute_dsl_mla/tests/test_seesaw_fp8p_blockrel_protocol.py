"""Pure-Python model of the fp8 ring producer with per-block release (``MLADecodePartialWGMMASeesaw(fp8_producer=True,
fp8p_ring=R, fp8p_block_release=True)``; branch fp8-block-release, compile-only): no DSL, no GPU.

The protocol.  Part 3 (tile b's columns 256..511: blocks 4..7 of buffer 1, which warpgroup 1 reads last in its
P_b V_R at the very end of a pair and first in its next S) gets one full and one empty mbarrier per 64-column block
(``fp8p_ring.BLOCK_RELEASE_FULL`` = (3, 8, 9, 10), ``BLOCK_RELEASE_EMPTY`` = (7, 11, 12, 13); count 128 each, as the
other eight): block 4 + j completes one phase of full[j'] / empty[j'] per tile of buffer 1, exactly as mbarriers 3 / 7
did for the whole part, so every wait keeps part 3's parity.

* Producer (``fp8p_producer_ring`` with ``fp8p_ring.ring_schedule(..., block_release=True)``): part 3's chunks
  block-major (pass 0 and pass 1 of block 4, then block 5, ...); each block's first chunk waits its empty barrier (not
  for a buffer's first tile), its last chunk fences and arrives on its full barrier.  Loads stay ring - 1 chunks
  ahead as before (``ring_events`` below is the ring model's, with the block barriers).
* Warpgroup 1, S of its tile b (``qk_blocks``): for j = 0..3: wait full[block j], issue block 4 + j's four k-blocks,
  commit; then wait full[2] (WG0's part), the other 20 k-blocks, wait all.
* Warpgroup 1, P_b V_R (``pv_blocks_release``): four commit groups of N = 64 (block 4 + j), then for j = 0..3:
  wait_group(3 - j), arrive on empty[block j] (one item: when tile b + 2 exists; balanced: always).
* Every other event is the fp8 producer kernel's (test_seesaw_fp8p_protocol.math_program, the balanced column of
  test_seesaw_fp8p_balanced_protocol), rewritten here from those very programs.

``run`` interleaves the three programs at random with vector clocks and the per-group WGMMA retirement
(``wait_group(n)`` retires all but the n newest committed groups): deadlock, parity, WAR (a producer store into a
block with an unretired WGMMA read, or not ordered after the retired ones), RAW (a read of a block whose fill was
not observed through its own full barrier), phase counts.  Mutations caught: a release moved before its
wait_group, wait_group one too lenient, the S waiting only block 4's barrier, the producer arriving on the wrong
block's full barrier, the producer skipping a block's empty wait, a release left out (deadlock), pass-major part 3
with per-block barriers (a block's full arrive before both of its passes are stored).
"""

from __future__ import annotations

import random

import pytest

from test_seesaw_fp8p_balanced_protocol import column  # noqa: E402  (same directory)
from test_seesaw_fp8p_protocol import math_program  # noqa: E402
from test_seesaw_fp8p_ring_protocol import check_registers  # noqa: E402
from test_seesaw_protocol import SmemModel, _hb  # noqa: E402

from mla_cute_dsl.kernels import fp8p_ring
from mla_cute_dsl.kernels.sm90_wgmma_decode import SEESAW_LOAD_BLOCKS, seesaw_item_phases

FULL = fp8p_ring.BLOCK_RELEASE_FULL
EMPTY = fp8p_ring.BLOCK_RELEASE_EMPTY
BLOCKS = fp8p_ring.BLOCK_RELEASE_BLOCKS
OWN = (4, 5, 6, 7)
N = 3


def _full_of(mb):
    """Empty mbarrier index (the kernel's array) of a part's full mbarrier index: 4 + i for the parts, the block
    barriers of part 3 through BLOCK_RELEASE_*."""
    return EMPTY[FULL.index(mb)] if mb in FULL else 4 + mb


def block_release_math(evs, mutate=None):
    """Warpgroup 1's events with part 3 per block (the module docstring), from the fp8 producer kernel's program:
    ("mwait", 3, par) + its read of blocks 4..7 -> per block (wait, read, commit); the P_b V_R read of blocks 4..7 +
    its wait + ("release", 3) -> four (read, commit), then per block (wait_group, release).  Full / empty mbarriers
    are named by their index in the kernel's array (empty i = 4 + i for the parts)."""
    out, i = [], 0
    while i < len(evs):
        e = evs[i]
        if e[0] == "mwait" and e[1] == 3:
            par, rd = e[2], evs[i + 1]
            assert rd[0] == "read" and rd[1] == 1 and rd[3] == OWN, rd
            for j, blk in enumerate(BLOCKS):
                if j == 0 or mutate != "qk_one_wait":
                    out.append(("mwait", FULL[j], par))
                out += [("read", 1, rd[2], (blk,), "K"), ("commit",)]
            i += 2
            continue
        if e[0] == "read" and e[1] == 1 and e[3] == OWN:
            assert evs[i + 1] == ("wait_reads",), evs[i + 1]
            rel = i + 2 < len(evs) and evs[i + 2] == ("release", 3)
            for blk in BLOCKS:
                out += [("read", 1, e[2], (blk,), "K"), ("commit",)]
            for j in range(len(BLOCKS)):
                n = len(BLOCKS) - 1 - j
                if mutate == "wait_lenient":
                    n += 1
                if rel and mutate == "release_before_wait":
                    out.append(("release", EMPTY[j]))
                if mutate != "release_before_wait" or j == len(BLOCKS) - 1:
                    out.append(("wait_group", n))
                if rel and mutate != "release_before_wait" and not (mutate == "drop_release" and j == 2):
                    out.append(("release", EMPTY[j]))
            if mutate == "release_before_wait":
                out.append(("wait_group", 0))
            i += 3 if rel else 2
            continue
        if e[0] == "release":
            out.append(("release", 4 + e[1]))
        else:
            out.append(e)
        i += 1
    return out


def ring_events(T, ring, ph=None, g=0, mutate=None):
    """``fp8p_producer_ring``'s events with block release for one item (test_seesaw_fp8p_ring_protocol.ring_events
    with each chunk's own full / empty mbarrier indices): ("issue", ...), ("ewait", empty index, parity), ("cvt",
    tile, m, blk, slot, stage, full index, smem, wait), ("arrive", full index), ("rotate", rot), ("end",)."""
    prologue, steps, rotation = fp8p_ring.ring_schedule(ring, SEESAW_LOAD_BLOCKS, 0, True)
    if mutate == "pass_major":  # per-block barriers on the pass-major order: a block's arrive after its pass 0 only
        pm = fp8p_ring.pair_chunks(SEESAW_LOAD_BLOCKS)
        bm = {(c.off, c.m, c.blk): c for c in fp8p_ring.pair_chunks(SEESAW_LOAD_BLOCKS, True)}
        fixed = []
        for st, c in zip(steps, pm):
            b = bm[(c.off, c.m, c.blk)]
            fixed.append(type(st)(st.issue, type(c)(c.off, c.mbar, c.stage, c.m, c.blk, c.first if c.mbar != 3
                                                   else c.m == 0, c.last if c.mbar != 3 else c.m == 0, b.fbar,
                                                   b.ebar), st.slot))
        steps = tuple(fixed)
    ev = []

    def issue(t, iss):
        ev.append(("issue", g + t, iss.m, iss.blk, iss.slot, t < T, iss.smem))

    if T > 0:
        for iss in prologue:
            issue(iss.off, iss)
    for p in range((T + 1) // 2):
        ta = 2 * p
        if ph is None:
            waits, pars = (p > 0, p > 0), ((p + 1) % 2, (p + 1) % 2)
        else:
            waits = (ph[0] + p > 0, ph[1] + p > 0)
            pars = ((ph[0] + p + 1) % 2, (ph[1] + p + 1) % 2)
        for j in range(fp8p_ring.PAIR_CHUNKS if ta + 1 < T else fp8p_ring.PAIR_CHUNKS // 2):
            st = steps[j]
            issue(ta + st.issue.off, st.issue)
            c = st.chunk
            if c.first and waits[c.stage] and not (mutate == "skip_block_wait" and c.blk == 5):
                ev.append(("ewait", c.empty_bar, pars[c.stage]))
            ev.append(("cvt", g + ta + c.off, c.m, c.blk, st.slot, c.stage, c.full_bar, st.smem, st.wait))
            if c.last:
                fb = c.full_bar
                if mutate == "wrong_full" and c.blk == 6:
                    fb = FULL[3]
                ev.append(("arrive", fb))
        if ta + 1 < T and any(r != s for s, r in enumerate(rotation)):
            ev.append(("rotate", rotation))
    ev.append(("end",))
    return ev


def project(ev):
    """The producer's barrier-level program: ("ewait", empty index, parity) and at each full arrive ("load", tile,
    buffer, blocks, full index) of the chunks stored since that barrier's previous arrive."""
    out, open_ = [], {}
    for e in ev:
        if e[0] == "ewait":
            out.append(e)
        elif e[0] == "cvt":
            _, t, m, blk, s, stage, fb = e[:7]
            open_.setdefault(fb, []).append((t, m, blk, stage))
        elif e[0] == "arrive":
            chunks = open_.pop(e[1], [])
            for t in sorted({c[0] for c in chunks}):
                blocks = tuple(dict.fromkeys(c[2] for c in chunks if c[0] == t))
                out.append(("store", t, chunks[0][3], blocks, tuple(c[1] for c in chunks if c[0] == t)))
            out.append(("fill", e[1]))
    return out


def run(seed, programs, full_expected=None):
    """Interleave math WG0, WG1 and the producer at random; return the violations (empty: fine).  mbarriers by
    their index in the kernel's array: "mwait" / "fill" on the full ones, "release" / "ewait" on the empty ones."""
    rng = random.Random(seed)
    progs = [iter(p) for p in programs]
    sm = SmemModel(N)
    vc, mem, errors = sm.vc, sm.mem, sm.errors
    grp = [[] for _ in range(N)]  # commit group of each entry of sm.inflight[w]
    commits = [0] * N
    nxt = [next(p, None) for p in progs]
    done, bvc = {}, {}  # mbarrier -> completed phases; (mbar, phase) -> clock of its completing arrive
    waited = [{} for _ in range(N)]
    landed = {}
    pending = []  # the producer's stores since its last fill: (tile, buffer, blocks, passes)

    for _ in range(400000):
        if all(e is None for e in nxt):
            break
        ready = []
        for w in range(N):
            ev = nxt[w]
            if ev is None:
                continue
            kind = ev[0]
            if kind in ("mwait", "ewait") and done.get(ev[1], 0) <= waited[w].get(ev[1], 0):
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
            merged = [max(a, b) for a, b in zip(vc[0], vc[1])]
            vc[0], vc[1] = list(merged), list(merged)
            nxt[0], nxt[1] = next(progs[0], None), next(progs[1], None)
            continue
        if kind in ("wait_group", "wait_reads"):
            for key in sm.inflight[w]:  # a read of a block never written (reported by sm.read) retires as well
                mem.setdefault(key, {"tag": None, "vc": [0] * N, "phase": None, "reads": []})
        if kind == "store":
            _, t, buf, blocks, passes = ev
            pending.append((t, buf, blocks, passes))
            for blk in blocks:  # WAR: checked at the st.shared itself
                cell = mem.get((buf, blk))
                if any((buf, blk) in r for r in sm.inflight):
                    errors.append(f"WAR: tile {t} stored into buf {buf} block {blk} under an in-flight read")
                elif cell is not None and (not all(_hb(r, vc[w]) for r in cell["reads"]) or not _hb(cell["vc"], vc[w])):
                    errors.append(f"WAR/WAW: tile {t} stored into buf {buf} block {blk} not ordered")
        elif kind == "fill":
            mb = ev[1]
            ph = done.get(mb, 0)
            for t, buf, blocks, passes in pending:
                if sorted(passes) != [m for m in range(fp8p_ring.PASSES) for _ in blocks]:
                    # a block is complete only with both 32-row passes stored before the arrive
                    errors.append(f"full[{mb}] arrives on tile {t} blocks {blocks} with passes {passes}")
                    continue
                for blk in blocks:
                    mem[(buf, blk)] = {"tag": ("K", t), "vc": list(vc[w]), "phase": (mb, ph), "reads": []}
            pending = []
            bvc[(mb, ph)] = list(vc[w])
            done[mb] = ph + 1
        elif kind in ("mwait", "ewait"):
            _, mb, par = ev
            ph = waited[w].get(mb, 0)
            if ph % 2 != par:
                errors.append(f"program {w} waits mbarrier {mb} phase {ph} with parity {par}")
            sm.merge(w, bvc[(mb, ph)])
            if kind == "mwait":
                landed.setdefault((mb, ph), []).append(list(vc[w]))
            waited[w][mb] = ph + 1
        elif kind == "release":
            mb = ev[1]
            ph = done.get(mb, 0)
            bvc[(mb, ph)] = list(vc[w])
            done[mb] = ph + 1
        elif kind == "read":
            _, buf, t, blocks, what = ev
            before = len(sm.inflight[w])
            sm.read(w, buf, t, blocks, what, landed)
            grp[w] += [commits[w]] * (len(sm.inflight[w]) - before)
        elif kind == "commit":
            commits[w] += 1
        elif kind == "wait_group":
            keep = commits[w] - ev[1]
            still, sg = [], []
            for key, g_ in zip(sm.inflight[w], grp[w]):
                if g_ < keep:
                    mem[key]["reads"].append(list(vc[w]))
                else:
                    still.append(key)
                    sg.append(g_)
            sm.inflight[w][:] = still
            grp[w] = sg
        elif kind == "wait_reads":
            sm.step(w, ev)
            grp[w] = []
        elif kind == "write_q":
            mem[("Q", w)] = {"tag": ("Q", ev[1]), "vc": list(vc[w]), "phase": None, "reads": []}
        elif kind == "nop":
            pass
        else:
            assert sm.step(w, ev), ev
        nxt[w] = next(progs[w], None)
    else:
        return ["no progress"]
    sm.end_checks()
    if pending:
        errors.append(f"stores never arrived: {pending}")
    if full_expected is not None:
        got = {mb: done.get(mb, 0) for mb in full_expected}
        if got != full_expected:
            errors.append(f"full phases {got}, expected {full_expected}")
    for w in range(N):
        for mb, n in waited[w].items():
            if n > done.get(mb, 0):
                errors.append(f"program {w} waited {n} phases of mbarrier {mb}, {done.get(mb, 0)} completed")
    # every release of an empty barrier is waited by the producer (none left over, none missing)
    for mb in EMPTY + (4, 5, 6):
        if done.get(mb, 0) < waited[2].get(mb, 0):
            errors.append(f"empty {mb}: {waited[2].get(mb, 0)} waits, {done.get(mb, 0)} releases")
    return errors


def item_programs(T, ring=fp8p_ring.RING_DEFAULT, mutate=None):
    m0 = [("release", 4 + e[1]) if e[0] == "release" else e for e in math_program(0, T)]
    m1 = block_release_math(math_program(1, T), mutate)
    return [m0, m1, project(ring_events(T, ring, mutate=mutate))]


def _full_counts(T):
    d0, d1 = seesaw_item_phases(T)
    return {0: d0, 1: d0, 2: d1, **{mb: d1 for mb in FULL}}


@pytest.mark.parametrize("ring", fp8p_ring.RING_SIZES)
@pytest.mark.parametrize("T", range(12))
def test_block_release_item_has_no_deadlock_or_hazard(T, ring):
    ev = ring_events(T, ring)
    assert check_registers(ev, ring, [(0, T)]) == []  # the ring's register hazards and look-ahead, as before
    progs = item_programs(T, ring)
    bad = {seed: e for seed in range(60) if (e := run(seed, progs, _full_counts(T)))}
    assert not bad, next(iter(bad.items()))


COLUMNS = [[(3, 0), (2, 1)], [(1, 0), (1, 0), (4, 1)], [(0, 0), (5, 1), (0, 1), (2, 2)], [(6, 0)],
           [(2, 0), (3, 0), (1, 1), (4, 2), (5, 3)], [(7, 0), (1, 1)], [(1, 0), (2, 1), (3, 2), (4, 3)]]


def column_programs(items, ring=fp8p_ring.RING_DEFAULT, mutate=None):
    """A balanced column (kernel_fp8p_balanced): the math programs of test_seesaw_fp8p_balanced_protocol.column
    (every tile released) rewritten for block release, the ring producer per item with the column's phases."""
    progs, _ = column(items)
    m0 = [("release", 4 + e[1]) if e[0] == "release" else e for e in progs[0]]
    m1 = block_release_math(progs[1], mutate)
    ev, spans, g, ph = [], [], 0, [0, 0]
    for T, _ in items:
        ev += ring_events(T, ring, ph=list(ph), g=g, mutate=mutate)
        spans.append((g, T))
        d0, d1 = seesaw_item_phases(T)
        ph = [ph[0] + d0, ph[1] + d1]
        g += T
    assert mutate is not None or check_registers(ev, ring, spans) == []
    return [m0, m1, project(ev)], {0: ph[0], 1: ph[0], 2: ph[1], **{mb: ph[1] for mb in FULL}}


@pytest.mark.parametrize("items", COLUMNS)
def test_block_release_balanced_column_has_no_deadlock_or_hazard(items):
    progs, full = column_programs(items)
    bad = {seed: e for seed in range(40) if (e := run(seed, progs, full))}
    assert not bad, (items, next(iter(bad.items())))


def test_block_barriers_keep_part_3s_phase_sequence():
    """Per item: each block barrier of part 3 is waited (WG1's S), filled (producer) and released (WG1's P V) exactly
    as often and with the same parities as mbarriers 3 / 7 without the option; the producer's empty waits equal
    the releases; every block's full arrive follows both of its passes (block-major)."""
    for T in range(12):
        base1 = math_program(1, T)
        progs = item_programs(T)
        w3 = [e[2] for e in base1 if e[:2] == ("mwait", 3)]
        r3 = sum(e == ("release", 3) for e in base1)
        for j in range(4):
            assert [e[2] for e in progs[1] if e[:2] == ("mwait", FULL[j])] == w3
            assert sum(e == ("release", EMPTY[j]) for e in progs[1]) == r3
            assert sum(e == ("fill", FULL[j]) for e in progs[2]) == seesaw_item_phases(T)[1]
            assert sum(e[:2] == ("ewait", EMPTY[j]) for e in progs[2]) == r3
        assert not any(e[:2] in (("mwait", 3), ("release", 7)) for e in progs[1][:0])
    chunks = fp8p_ring.pair_chunks(SEESAW_LOAD_BLOCKS, True)
    part3 = [c for c in chunks if c.mbar == 3]
    assert [(c.blk, c.m) for c in part3] == [(b, m) for b in BLOCKS for m in range(fp8p_ring.PASSES)]
    assert [(c.first, c.last, c.full_bar, c.empty_bar) for c in part3] == [
        (m == 0, m == 1, FULL[j], EMPTY[j]) for j in range(4) for m in range(2)]
    # the other parts and every slot / issue of the schedule are the default ring's
    base = fp8p_ring.pair_chunks(SEESAW_LOAD_BLOCKS)
    assert [c for c in chunks if c.mbar != 3] == [c for c in base if c.mbar != 3]
    assert [(c.full_bar, c.empty_bar) for c in base] == [(c.mbar, 4 + c.mbar) for c in base]
    for ring in fp8p_ring.RING_SIZES:
        a = fp8p_ring.ring_schedule(ring, SEESAW_LOAD_BLOCKS)
        b = fp8p_ring.ring_schedule(ring, SEESAW_LOAD_BLOCKS, 0, True)
        assert [st.slot for st in a[1]] == [st.slot for st in b[1]] and a[2] == b[2] and len(a[0]) == len(b[0])
    with pytest.raises(ValueError, match="fp8p_stage"):
        fp8p_ring.ring_schedule(7, SEESAW_LOAD_BLOCKS, fp8p_ring.STAGE_SLOTS, True)
    assert len(set(FULL + EMPTY + (0, 1, 2, 4, 5, 6))) == fp8p_ring.BLOCK_RELEASE_MBARS


@pytest.mark.parametrize("mutate", ["release_before_wait", "wait_lenient", "qk_one_wait", "wrong_full",
                                    "skip_block_wait", "drop_release", "pass_major"])
def test_the_model_catches_broken_block_release(mutate):
    """Each broken variant is reported (deadlock, hazard or phase count) for some tile count or column."""
    hits = 0
    for T in (3, 4, 5, 6, 7):
        progs = item_programs(T, mutate=mutate)
        if any(run(seed, progs, _full_counts(T)) for seed in range(40)):
            hits += 1
    for items in COLUMNS[:4]:
        progs, full = column_programs(items, mutate=mutate)
        if any(run(seed, progs, full) for seed in range(30)):
            hits += 1
    assert hits > 0, mutate
