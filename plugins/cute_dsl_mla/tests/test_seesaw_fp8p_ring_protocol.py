"""Pure-Python model of the fp8 producer's register ring (``MLADecodePartialWGMMASeesaw(fp8_producer=True,
fp8p_ring=R)``, ``fp8p_producer_ring``; branch fp8p-inflight): no DSL, no GPU.

``ring_events`` mirrors ``fp8p_producer_ring``'s control flow on the very schedule the kernel unrolls
(``fp8p_ring.ring_schedule``): the prologue's issues when T > 0, per pair the 18 steps of tile a, then, when tile b
exists, its 18 steps and the slot rotation; each step an ld.global issue into a ring slot (a tile past the item
issued with row limit 0: no load, zeros), the part's empty wait before its first conversion, the conversion
(cvt + st.shared) and after a part's last chunk the fence + full arrive.  Checked, for every ring size the kernel
takes and T = 0..13 (one item) and columns of items (balanced, with the phases ``ph0`` / ``ph1``):

* registers: a conversion reads the slot holding exactly its (tile, pass, block), loaded (not zero-filled); no issue
  overwrites a slot whose chunk was not converted yet; no real load of a tile past the item; nothing in flight at
  an item's end (so nothing crosses an item boundary in the balanced kernel); every chunk of every tile converted
  exactly once; every chunk but an item's first R - 1 (the prologue's) issued exactly R - 1 conversions before its
  own (the look-ahead);
* smem and barriers: projected onto parts (empty wait, then the part's stores, then its full arrive), the events are
  exactly the one-part producer's program (``test_seesaw_fp8p_protocol.producer_program``, balanced
  ``test_seesaw_fp8p_balanced_protocol.producer_item``), whose interleavings with the math warpgroups those models
  check (deadlock, parity, WAR / RAW on every K block); and no part's store precedes its empty wait.

Mutations caught: the rotation left out, issues one chunk further ahead (a slot overwritten before its conversion),
the empty wait after a part's first store, tiles past the item loaded for real.
"""

from __future__ import annotations

import pytest

from test_seesaw_fp8p_balanced_protocol import column, producer_item  # noqa: E402  (same directory)
from test_seesaw_fp8p_protocol import math_program, producer_program, run  # noqa: E402
from test_seesaw_protocol import LOAD  # noqa: E402

from mla_cute_dsl.kernels import fp8p_ring
from mla_cute_dsl.kernels.sm90_wgmma_decode import SEESAW_LOAD_BLOCKS, seesaw_item_phases


def ring_events(T, ring, ph=None, g=0, mutate=None, stage=0, wg1of=False):
    """``fp8p_producer_ring``'s events for one item of T tiles (column tiles g .. g + T - 1; ``ph`` = [ph0, ph1]
    for balanced, None for one item per CTA; ``stage``: shared-memory staging slots; ``wg1of``: the schedule of
    ``wg1_other_first``, tile b's parts 2 then 3): ("issue", tile, m, blk, slot, real, smem), ("ewait", mbar,
    parity), ("cvt", tile, m, blk, slot, stage, mbar, smem, wait), ("arrive", mbar), ("rotate", rotation),
    ("end",).  Mutation "waits_swapped" (wg1of): tile b's parts converted 2, 3 but their empty waits left in the
    default order (empty[3] before part 2's first chunk, empty[2] before part 3's)."""
    prologue, steps, rotation = fp8p_ring.ring_schedule(ring, SEESAW_LOAD_BLOCKS, stage, wg1_other_first=wg1of)
    if mutate == "ahead_plus_one":  # every register issue one slot further: into a chunk not yet converted
        steps = tuple(type(st)(type(st.issue)(st.issue.off, st.issue.m, st.issue.blk,
                                              st.issue.slot if st.issue.smem else (st.issue.slot + 1) % ring,
                                              st.issue.smem),
                               st.chunk, st.slot, st.smem, st.wait) for st in steps)
    if mutate == "wait_short":  # a staged chunk read while the cp.async that filled it may still be in flight
        steps = tuple(type(st)(st.issue, st.chunk, st.slot, st.smem, st.wait + 1 if st.smem else 0) for st in steps)
    ev = []

    def issue(t, iss):
        real = t < T or mutate == "load_past_item"
        ev.append(("issue", g + t, iss.m, iss.blk, iss.slot, real, iss.smem))

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

        def step(st):
            issue(ta + st.issue.off, st.issue)
            c = st.chunk
            if c.first and waits[c.stage] and mutate != "wait_late":
                ev.append(("ewait", {2: 3, 3: 2}.get(c.mbar, c.mbar) if mutate == "waits_swapped" else c.mbar,
                           pars[c.stage]))
            ev.append(("cvt", g + ta + c.off, c.m, c.blk, st.slot, c.stage, c.mbar, st.smem, st.wait))
            if c.first and waits[c.stage] and mutate == "wait_late":
                ev.append(("ewait", c.mbar, pars[c.stage]))
            if c.last:
                ev.append(("arrive", c.mbar))

        for j in range(fp8p_ring.PAIR_CHUNKS // 2):
            step(steps[j])
        if ta + 1 < T:
            for j in range(fp8p_ring.PAIR_CHUNKS // 2, fp8p_ring.PAIR_CHUNKS):
                step(steps[j])
            if any(r != s for s, r in enumerate(rotation)) and mutate != "no_rotation":
                ev.append(("rotate", rotation))
    ev.append(("end",))
    return ev


def check_registers(ev, ring, items, stage=0, wg1of=False):
    """Register- and staging-level violations of a producer event list (one or more items): ``items`` = [(g, T),
    ...].  Staged chunks: each issue commits one cp.async group (an empty one when nothing is loaded); a conversion
    after cp.async.wait_group(w) may read a staged chunk only if at least w groups were committed after its own."""
    errors = []
    slots = {False: [None] * ring, True: [None] * max(stage, 1)}  # smem? -> slot -> (tile, m, blk, real, group)
    live = {False: [False] * ring, True: [False] * max(stage, 1)}
    groups = 0  # cp.async groups committed so far
    issued_at = {}  # (tile, m, blk) -> conversions done when it was issued
    converted = []
    dist = {}
    for e in ev:
        kind = e[0]
        if kind == "issue":
            _, t, m, blk, s, real, sm = e
            if live[sm][s]:
                errors.append(f"issue of {(t, m, blk)} overwrites {'staging' if sm else 'ring'} slot {s} holding "
                              f"unconverted {slots[sm][s][:3]}")
            if real and not any(g0 <= t < g0 + T for g0, T in items):
                errors.append(f"real load of tile {t}, past its item")
            if sm:
                groups += 1
            slots[sm][s] = (t, m, blk, real, groups)
            live[sm][s] = real
            issued_at[(t, m, blk)] = len(converted)
        elif kind == "cvt":
            _, t, m, blk, s, stage_, mb, sm, wait = e
            cur = slots[sm][s]
            if cur is None or cur[:3] != (t, m, blk) or not cur[3]:
                errors.append(f"cvt of {(t, m, blk)} reads {'staging' if sm else 'ring'} slot {s} holding {cur}")
            elif sm and groups - cur[4] < wait:
                errors.append(f"cvt of staged {(t, m, blk)}: wait_group({wait}) with {groups - cur[4]} groups "
                              "after its own: its cp.async may be in flight")
            live[sm][s] = False
            dist[(t, m, blk)] = len(converted) - issued_at.get((t, m, blk), -10**9)
            converted.append((t, m, blk))
        elif kind == "rotate":
            rot = e[1]
            slots[False] = [slots[False][r] for r in rot]
            live[False] = [live[False][r] for r in rot]
        elif kind == "end":
            left = [slots[sm][s] for sm in (False, True) for s in range(len(live[sm])) if live[sm][s]]
            if left:
                errors.append(f"loads in flight at an item's end: {left}")
    want = [(g0 + t, m, blk) for g0, T in items for t in range(T) for m in range(fp8p_ring.PASSES)
            for blk in range(9)]
    if sorted(converted) != sorted(want):
        errors.append("chunks not converted exactly once")
    # the look-ahead: every chunk but an item's prologue chunks is issued exactly D conversions before its own
    ahead = fp8p_ring.lookahead(ring, stage)
    first = set()
    for g0, T in items:
        if T > 0:
            chunks = fp8p_ring.pair_chunks(SEESAW_LOAD_BLOCKS, wg1of)
            first |= {(g0 + c.off, c.m, c.blk) for c in chunks[:ahead]}
    bad = {k: d for k, d in dist.items() if k not in first and d != ahead}
    if bad:
        errors.append(f"look-ahead distance != {ahead}: {sorted(bad.items())[:3]}")
    return errors


def project(ev):
    """Part-level program of a producer event list: ("ewait", mbar, parity) and ("load", tile, buffer, blocks,
    mbar) at each full arrive, after checking that each part's stores are its 2 x blocks chunks of one tile and
    that no empty wait falls inside a part (after its first store)."""
    out, errors = [], []
    open_parts = {}  # mbar -> [(tile, m, blk, stage)]
    for e in ev:
        if e[0] == "ewait":
            if open_parts.get(e[1]):
                errors.append(f"empty[{e[1]}] waited after the part's first store")
            out.append(e)
        elif e[0] == "cvt":
            _, t, m, blk, s, stage, mb = e[:7]
            open_parts.setdefault(mb, []).append((t, m, blk, stage))
        elif e[0] == "arrive":
            mb = e[1]
            part = open_parts.pop(mb, [])
            tiles = {x[0] for x in part}
            stages = {x[3] for x in part}
            blocks = tuple(dict.fromkeys(x[2] for x in part))
            if len(tiles) != 1 or len(stages) != 1 or sorted((x[1], x[2]) for x in part) != sorted(
                    (m, b) for m in range(fp8p_ring.PASSES) for b in blocks):
                errors.append(f"full[{mb}] arrives on an incomplete or mixed part {part}")
                continue
            out.append(("load", tiles.pop(), stages.pop(), blocks, mb))
    if open_parts:
        errors.append(f"parts stored but never arrived: {open_parts}")
    return out, errors


STAGES = (0, fp8p_ring.STAGE_SLOTS)


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("ring", fp8p_ring.RING_SIZES)
@pytest.mark.parametrize("T", range(14))
def test_ring_producer_is_the_one_part_producer_with_loads_ahead(ring, T, stage):
    ev = ring_events(T, ring, stage=stage)
    assert check_registers(ev, ring, [(0, T)], stage) == []
    parts, errors = project(ev)
    assert errors == []
    assert parts == producer_program(T)
    assert (T == 0) == (ev == [("end",)])


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("ring", fp8p_ring.RING_SIZES)
def test_ring_producer_runs_with_the_math_warpgroups(ring, stage):
    """The projected ring producer interleaved with the math warpgroups (the fp8p protocol model): no deadlock or
    hazard."""
    for T in (1, 2, 3, 6, 7):
        parts, _ = project(ring_events(T, ring, stage=stage))
        for seed in range(40):
            assert run(T, seed, programs=[math_program(0, T), math_program(1, T), parts]) == [], (T, seed)


COLUMNS = [[(3, 0), (2, 1)], [(1, 0), (1, 0), (4, 1)], [(0, 0), (5, 1), (0, 1), (2, 2)], [(6, 0)],
           [(2, 0), (3, 0), (1, 1), (4, 2), (5, 3)], [(7, 0), (1, 1)]]


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("ring", fp8p_ring.RING_SIZES)
@pytest.mark.parametrize("items", COLUMNS)
def test_ring_producer_on_balanced_columns(ring, items, stage):
    """``kernel_fp8p_balanced`` with the ring: per item the ring's events with the column's phases; registers as
    above (nothing in flight at an item boundary), the projection equal to the balanced producer's program, and the
    whole column interleaved with the balanced math programs."""
    ev, spans, parts_ref = [], [], []
    g, ph = 0, [0, 0]
    for T, _ in items:
        ev += ring_events(T, ring, ph=list(ph), g=g, stage=stage)
        parts_ref += producer_item(T, g, ph)
        spans.append((g, T))
        d0, d1 = seesaw_item_phases(T)
        ph = [ph[0] + d0, ph[1] + d1]
        g += T
    assert check_registers(ev, ring, spans, stage) == []
    parts, errors = project(ev)
    assert errors == [] and parts == parts_ref
    progs, counts = column(items)
    for seed in range(30):
        assert run(0, seed, programs=[progs[0], progs[1], parts], counts=counts) == [], seed


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("mutate", ["no_rotation", "ahead_plus_one", "wait_late", "load_past_item", "wait_short"])
def test_the_model_catches_broken_rings(mutate, stage):
    """Each broken variant of the ring is reported by the register check or the projection, for every ring size
    (a size without a rotation to leave out excepted); a staged chunk read before its cp.async group is waited
    (wait_group one too high), with staging."""
    if mutate == "wait_short" and not stage:
        pytest.skip("no staged chunks")
    for ring in fp8p_ring.RING_SIZES:
        _, _, rotation = fp8p_ring.ring_schedule(ring, SEESAW_LOAD_BLOCKS, stage)
        if mutate == "no_rotation" and rotation == tuple(range(ring)):
            continue  # no rotation to leave out
        hits = 0
        for T in range(1, 8):
            ev = ring_events(T, ring, mutate=mutate, stage=stage)
            parts, errors = project(ev)
            if check_registers(ev, ring, [(0, T)], stage) or errors or parts != producer_program(T):
                hits += 1
        assert hits > 0, (ring, mutate)


def test_schedule_shape():
    """36 chunks per pair in the one-part producer's part order (full[0], full[1], full[3], full[2]; pass-major
    within a part), one issue per step into the slot the previous conversion vacated, the prologue R - 1 issues of
    tile 0, and the ring sizes' register splits within the CTA's pool."""
    from mla_cute_dsl.kernels import sm90_wgmma_decode as W

    chunks = fp8p_ring.pair_chunks(SEESAW_LOAD_BLOCKS)
    assert [c.mbar for c in chunks if c.first] == [0, 1, 3, 2]
    assert [(c.off, c.mbar, tuple(sorted({d.blk for d in chunks if d.mbar == c.mbar}))) for c in chunks if c.first] \
        == [(0, 0, LOAD[0][0]), (0, 1, LOAD[1][1]), (1, 3, LOAD[1][0]), (1, 2, tuple(sorted(LOAD[0][1])))]
    for ring in fp8p_ring.RING_SIZES:
        prologue, steps, rotation = fp8p_ring.ring_schedule(ring, SEESAW_LOAD_BLOCKS)
        assert len(prologue) == ring - 1 and all(i.off == 0 for i in prologue)
        assert [st.issue.slot for st in steps] == [(j - 1) % ring for j in range(36)]
        assert [st.slot for st in steps] == [j % ring for j in range(36)]
        assert sorted(rotation) == list(range(ring))
        assert W.fp8p_register_split_fits(*fp8p_ring.RING_REGS[ring])
        # staging: 12 of 36 chunks through shared memory, at least 2 more chunks of look-ahead
        prologue, steps, rotation = fp8p_ring.ring_schedule(ring, SEESAW_LOAD_BLOCKS, fp8p_ring.STAGE_SLOTS)
        assert sum(st.smem for st in steps) == 12 and fp8p_ring.lookahead(ring, 4) >= ring + 1
        assert len(prologue) == fp8p_ring.lookahead(ring, 4) and sorted(rotation) == list(range(ring))
        assert all(st.wait <= fp8p_ring.STAGE_SLOTS - 1 for st in steps)
    with pytest.raises(ValueError, match="fp8p_ring"):
        fp8p_ring.ring_schedule(36, SEESAW_LOAD_BLOCKS)


# ---------------------------------------------------------------- wg1_other_first with the ring (branch fp8-wg1of)
# WG1's QK of its tile b waits full[2] (WG0's columns + RoPE) first, and the ring converts tile b's parts 2 then 3
# (fp8p_ring.pair_parts(..., wg1_other_first=True)); every part keeps its own empty / full barrier and parity.


def _per_barrier(events, kinds):
    """Per mbarrier index, the sequence of its events of the given kinds (kind, then what it carries but the
    index): what must not change between the two orders."""
    out = {}
    for e in events:
        if e[0] in kinds:
            mb = e[1] if e[0] in ("ewait", "mwait", "release") else e[4]
            out.setdefault((e[0], mb), []).append(e[2:] if e[0] != "load" else e[1:4])
    return out


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("ring", fp8p_ring.RING_SIZES)
@pytest.mark.parametrize("T", range(14))
def test_wg1of_ring_is_the_one_part_producer_in_the_new_order(ring, T, stage):
    """The ring with wg1of: registers as in the default order (loaded chunk per conversion, no slot overwritten
    before its conversion, look-ahead D, nothing in flight at the end), projected on parts it is the one-part
    producer's program with tile b's parts 2, 3, and per barrier the same waits (parities) and loads (tiles) as the
    default ring: only the interleaving of the two tile-b parts changes."""
    ev = ring_events(T, ring, stage=stage, wg1of=True)
    assert check_registers(ev, ring, [(0, T)], stage, wg1of=True) == []
    parts, errors = project(ev)
    assert errors == []
    assert parts == producer_program(T, wg1of=True)
    ref, _ = project(ring_events(T, ring, stage=stage))
    assert _per_barrier(parts, ("ewait", "load")) == _per_barrier(ref, ("ewait", "load"))
    if T >= 2:
        assert parts != ref
        order = [e[4] for e in parts if e[0] == "load"]
        assert order[:4] == [0, 1, 2, 3]
    assert (T == 0) == (ev == [("end",)])


def test_wg1of_math_programs_keep_every_barriers_sequence():
    """The math side with wg1of (``wg_program``'s ``wg1of``, as ``qk_wait_order`` does for the fp8 producer path):
    WG1 waits full[2] before full[3] in its QK; per barrier the waits (parities) and releases are the default's."""
    for T in range(12):
        for w in (0, 1):
            on, off = math_program(w, T, wg1of=True), math_program(w, T)
            kinds = ("mwait", "release")
            assert _per_barrier(on, kinds) == _per_barrier(off, kinds)
            if w == 1 and T >= 2:
                waits = [e[1] for e in on if e[0] == "mwait"]
                assert waits[:2] == [2, 3] and on != off


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("ring", fp8p_ring.RING_SIZES)
def test_wg1of_ring_runs_with_the_math_warpgroups(ring, stage):
    """Both orders (producer and WG1's waits together) interleaved with vector clocks: no deadlock, no hazard, every
    phase count; also the mixed pairs (new producer order with WG1's default waits and the converse: slower, never
    wrong)."""
    for T in (1, 2, 3, 4, 6, 7):
        for prod_wg1of, math_wg1of in ((True, True), (False, False), (True, False), (False, True)):
            parts, _ = project(ring_events(T, ring, stage=stage, wg1of=prod_wg1of))
            for seed in range(25):
                progs = [math_program(0, T, wg1of=math_wg1of), math_program(1, T, wg1of=math_wg1of), parts]
                assert run(T, seed, programs=progs) == [], (T, seed, prod_wg1of, math_wg1of)


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("ring", fp8p_ring.RING_SIZES)
@pytest.mark.parametrize("items", COLUMNS)
def test_wg1of_ring_on_balanced_columns(ring, items, stage):
    """``kernel_fp8p_balanced`` with the ring and wg1of: per item the new order's events with the column's phases,
    registers clean, the projection equal to the balanced producer's program in the new order (and per barrier to
    the default's), the column interleaved with the balanced math programs whose WG1 waits full[2] first."""
    ev, spans, parts_ref, parts_off = [], [], [], []
    g, ph = 0, [0, 0]
    for T, _ in items:
        ev += ring_events(T, ring, ph=list(ph), g=g, stage=stage, wg1of=True)
        parts_ref += producer_item(T, g, ph, wg1of=True)
        parts_off += producer_item(T, g, ph)
        spans.append((g, T))
        d0, d1 = seesaw_item_phases(T)
        ph = [ph[0] + d0, ph[1] + d1]
        g += T
    assert check_registers(ev, ring, spans, stage, wg1of=True) == []
    parts, errors = project(ev)
    assert errors == [] and parts == parts_ref
    assert _per_barrier(parts, ("ewait", "load")) == _per_barrier(parts_off, ("ewait", "load"))
    progs, counts = column(items, wg1of=True)
    for seed in range(25):
        assert run(0, seed, programs=[progs[0], progs[1], parts], counts=counts) == [], seed


def _wg1_reads_swapped(evs):
    """Mutation: WG1 waits full[2] then full[3] but issues its k-blocks in the default order (its own columns under
    the wait on WG0's part only)."""
    out = list(evs)
    for i in range(len(out) - 3):
        a, r1, b, r2 = out[i:i + 4]
        if a[:2] == ("mwait", 2) and b[:2] == ("mwait", 3) and r1[0] == r2[0] == "read":
            out[i + 1], out[i + 3] = r2, r1
    return out


def test_the_model_catches_broken_wg1of_orders():
    """Mutations of the new order, each caught on some tile count and interleaving: the producer's tile-b parts
    swapped without their empty waits (part 2 written after waiting only empty[3]: WAR against WG0's pv_remote
    reads), WG1's k-blocks swapped without its waits (RAW: part 3's columns read after waiting only full[2])."""
    hits = {"waits_swapped": 0, "reads_swapped": 0}
    for T in (2, 3, 4, 5, 6):
        for seed in range(40):
            parts, _ = project(ring_events(T, 7, mutate="waits_swapped", wg1of=True))
            progs = [math_program(0, T, wg1of=True), math_program(1, T, wg1of=True), parts]
            hits["waits_swapped"] += bool(run(T, seed, programs=progs))
            parts, _ = project(ring_events(T, 7, wg1of=True))
            progs = [math_program(0, T, wg1of=True), _wg1_reads_swapped(math_program(1, T, wg1of=True)), parts]
            hits["reads_swapped"] += bool(run(T, seed, programs=progs))
    assert all(hits.values()), hits


def test_wg1of_schedule_shape():
    """The new schedule: parts 0, 1, 2, 3 (tile a's 18 chunks first, as before, so the kernel's two 18-step halves
    and their issue sources hold), the same slots, prologue and rotation as the default (only which chunk a step
    converts and issues changes in tile b's half and in the look-ahead issues that reach into it)."""
    for ring in fp8p_ring.RING_SIZES:
        for stage in STAGES:
            on = fp8p_ring.ring_schedule(ring, SEESAW_LOAD_BLOCKS, stage, wg1_other_first=True)
            off = fp8p_ring.ring_schedule(ring, SEESAW_LOAD_BLOCKS, stage)
            assert on[0] == off[0] and on[2] == off[2]  # prologue (tile 0's first chunks), rotation
            assert [st.slot for st in on[1]] == [st.slot for st in off[1]]
            assert [st.issue.slot for st in on[1]] == [st.issue.slot for st in off[1]]
            assert on[1][:18 - fp8p_ring.lookahead(ring, stage)] == off[1][:18 - fp8p_ring.lookahead(ring, stage)]
            assert [st.chunk.mbar for st in on[1] if st.chunk.first] == [0, 1, 2, 3]
            assert all(st.chunk.off == (j >= 18) for j, st in enumerate(on[1]))
            assert all(st.issue.off in ((0, 1) if j < 18 else (1, 2)) for j, st in enumerate(on[1]))
    assert fp8p_ring.ring_schedule(7, SEESAW_LOAD_BLOCKS) == fp8p_ring.ring_schedule(7, SEESAW_LOAD_BLOCKS, 0, False)


def test_the_kernel_passes_wg1of_to_the_ring_schedule():
    """Source check: ``fp8p_producer_ring`` builds its schedule with the kernel's wg1_other_first (the model's
    ``wg1of``), and WG1's qk on buffer 1 goes through ``qk_wait_order`` (the model's math side)."""
    from pathlib import Path

    src = (Path(__file__).resolve().parents[1] / "mla_cute_dsl" / "kernels" / "sm90_wgmma_decode.py").read_text()
    ring = src[src.index("    def fp8p_producer_ring("):src.index("    def fp8p_ring_step(")]
    assert "wg1_other_first=self.wg1_other_first)" in ring
    qk = src[src.index("    def qk("):src.index("    def softmax_publish(")]
    assert "self.qk_wait_order(stage, order, mbar_own, mbar_other)" in qk
