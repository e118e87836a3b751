"""Static schedule of the fp8 producer warpgroup's register ring (``MLADecodePartialWGMMASeesaw(fp8_producer=True,
fp8p_ring=R)``, ``fp8p_producer_ring``).  Plain Python, no DSL: the kernel unrolls it, and
tests/test_seesaw_fp8p_ring_protocol.py checks the very same schedule (register hazards, part order, lookahead).

Why: the one-part producer (``fp8p_producer``) holds one part (4-5 64-column blocks, 40 registers) at a time and
issues part k+1's ld.global only after part k was converted and stored, so whenever part k+1's empty barrier is
already free (the math side released it while the producer was busy) the full global-load latency sits between
the release and the part's "full" arrive.  In the seesaw the math side waits on some parts right after releasing
them (WG1 releases buffer 1's columns 256..511 and its next S starts with exactly those columns), so that latency
is on the critical path once or twice per pair.

The ring splits the pair's 18 blocks x 2 row passes into 36 *chunks* (one 128-bit ld.global of 16 fp8 per thread,
4 registers: one (32-row pass, 64-column block) of a part) and keeps R register slots.  Step j of a pair first
issues the ld.global of chunk j + R - 1 (into the slot chunk j - 1 just vacated), then, if chunk j starts a part,
waits for the part's empty barrier, converts chunk j (cvt e4m3x2 -> f16x2, two 128-bit st.shared) and, if it ends
its part, fences (generic -> async proxy) and arrives on the part's full barrier.  So R - 1 chunks (6 with R = 7:
three quarters of a 4-block part) are in flight or landed whenever a chunk is converted, across part, tile and
pair boundaries (the last chunks of a pair issue the first chunks of the next pair's tile a + 2), and a load is
issued R - 1 chunk conversions (~64 F2FP cycles each, 16 conversions per clock and SM) before its data are needed,
or earlier: while the producer waits on an empty barrier its look-ahead loads land.  (ptxas schedules inside
each part freely and tends to batch the refills, but a slot's reload can only follow its conversion.)  The full / empty protocol is the one-part producer's: the same waits
and arrives in the same order (one wait before each part's first conversion, one arrive after its last store).

Slots: chunk c of a pair uses slot c % R.  The look-ahead issues of a pair's last R - 1 steps (the next pair's
first chunks) go into the slots their predecessors vacated, (36 + c) % R, and the end of a pair that has a successor
renames slot (36 + c) % R to c % R (``ring_schedule``'s rotation; the identity when R divides 36), so the unrolled
pair body is the same code every pair and the ring is carried across the dynamic pair loop (in SSA the renaming is
free or a few register moves at the back edge).  Chunks of a tile that does not exist (tile b of a last odd pair,
tile a + 2 past the item) are issued with a row limit of 0: no load, the slot zero-filled, never converted.  Rows >=
kv_len of an existing tile are not loaded either and their slot is zero-filled at issue (e4m3 zero -> f16 zero: what
the one-part producer's select gives; page tails may hold NaN), so the conversion needs no selects.

Balanced (``kernel_fp8p_balanced``): the ring is per item (the prologue at the item's start, nothing issued past
its last tile), so nothing is in flight across an item boundary; the producer still runs into the next item's
tiles as soon as their empty barriers allow.
"""

from __future__ import annotations

from dataclasses import dataclass

#: 32-row passes per 64-row tile of the producer's copies (128 threads, 4 per 64-column block, 16 fp8 per copy)
PASSES = 2
#: chunks per pair: (4 + 5 + 4 + 5) blocks x PASSES
PAIR_CHUNKS = 36
#: ring sizes the kernel takes, each with its setmaxnreg split (math warpgroups, producer): 2 x 128 x math + 128 x
#: producer <= 168 x 384 (the CTA's launch pool, fp8p_register_split_fits).  Only sizes whose code ptxas (13.0,
#: -O3) assembles without a spill for every fp8p kernel (bf16 / fp16 q, eager / lazy, one item / balanced, fp32 and
#: 16-bit partials) are listed (tests/test_seesaw_fp8p_ring_compile.py).  Both need 88 producer registers, which
#: leaves the math warpgroups 208: no spills there and the same instruction mix as at 216 (SASS: 3,473 against
#: 3,484 instructions before the producer's setmaxnreg.dec); at 200 the math warpgroups spill and ptxas serializes
#: the WGMMAs (C7518), so 88 is the producer's maximum.  Measured on the CPU with ptxas 13.0 at 88: 4 to 7 slots
#: clean, 8 to 12 spill 2-7 values (ptxas hoists the conversions of several chunks ahead of their stores and holds
#: their outputs); at the one-part producer's 72, 4 slots spill one value in the balanced kernel, 5 and more several
RING_REGS = {5: (208, 88), 7: (208, 88)}
RING_SIZES = tuple(sorted(RING_REGS))
#: the ring size of fp8_loader=ring and of the benchmark's ring ways: 6 chunks ahead, so a 4-block part (8 chunks;
#: WG1's next S waits on one right after releasing its buffer) is three quarters in registers when its empty
#: barrier opens
RING_DEFAULT = 7
#: shared-memory staging (``fp8p_stage``, optional, with a ring): every STAGE_EVERY-th chunk of the pair stream
#: (c % 3 == 2: 12 of 36) goes global -> shared (cp.async, 16 B per thread, in the 9.5 KB the fp8p kernel leaves free
#: below the 227 KB limit) instead of into a register slot, and is read back (ld.shared) by the same thread right
#: before its conversion (cp.async.wait_group: per thread, no barrier).  STAGE_SLOTS slots of 2 KB (16 B x 128
#: threads); 12 staged chunks per pair, so a staged chunk's slot is the same every pair.  With 7 register slots the
#: look-ahead grows from 6 chunks to 9 (``lookahead``) at no register cost
STAGE_EVERY = 3
STAGE_SLOTS = 4
STAGE_SLOT_BYTES = 16 * 128


@dataclass(frozen=True)
class Chunk:
    """One chunk: tile ``off`` of the pair (0: tile a = 2p in K buffer 0, 1: tile b = 2p + 1 in buffer 1), full /
    empty mbarrier index ``mbar`` of its part (2 x buffer + part), K buffer ``stage``, 32-row pass ``m``, 64-column
    block ``blk``; ``first`` / ``last``: the part's first / last chunk (wait empty before / arrive full after)."""

    off: int
    mbar: int
    stage: int
    m: int
    blk: int
    first: bool
    last: bool


@dataclass(frozen=True)
class Issue:
    """An ld.global into ring slot ``slot`` (or, ``smem``, a cp.async into staging slot ``slot``) of pass ``m``,
    block ``blk`` of tile ``off`` relative to the current pair's tile a (0: a, 1: b = a + 1, 2: a + 2, the next
    pair's tile a)."""

    off: int
    m: int
    blk: int
    slot: int
    smem: bool = False


@dataclass(frozen=True)
class Step:
    """Step j of a pair: the look-ahead ``issue`` (chunk j + lookahead), then the conversion of ``chunk`` (chunk j)
    from ring slot ``slot`` (or, ``smem``, from staging slot ``slot`` after cp.async.wait_group(``wait``): the
    staged chunks issued after it may stay in flight)."""

    issue: Issue
    chunk: Chunk
    slot: int
    smem: bool = False
    wait: int = 0


def pair_parts(load_blocks, wg1_other_first: bool = False) -> tuple[tuple[int, int, int, tuple[int, ...]], ...]:
    """The pair's parts in the math side's wait order, (tile offset, mbarrier index, K buffer, blocks): tile a's
    full[0] (WG0's S waits it first: the columns WG0 loads in the 16-bit kernel, ``load_blocks[0][0]``) then
    full[1] (``load_blocks[1][1]``), tile b's full[3] (WG1's S waits it first, ``load_blocks[1][0]``) then full[2]
    (``load_blocks[0][1]``): ``fp8p_producer``'s order.  ``wg1_other_first`` (branch fp8-wg1of, GPU-verified):
    WG1's S of tile b waits full[2] first (``qk_wait_order``), so tile b's parts go full[2] then full[3]: part 2
    (WG0's columns + RoPE, released by WG0 after its pv_remote) is no longer queued behind part 3 (released by WG1
    only after its P_b V_R, the end of the pair).  Tile a's half is the same 18 chunks either way (parts 0, 1), so
    the pair still splits into tile a's chunks 0..17 and tile b's 18..35; each part keeps its own barriers."""
    tile_b = ((1, 3, 1, tuple(load_blocks[1][0])), (1, 2, 1, tuple(load_blocks[0][1])))
    if wg1_other_first:
        tile_b = tile_b[::-1]
    return ((0, 0, 0, tuple(load_blocks[0][0])), (0, 1, 0, tuple(load_blocks[1][1]))) + tile_b


def pair_chunks(load_blocks, wg1_other_first: bool = False) -> tuple[Chunk, ...]:
    """The 36 chunks of a pair in conversion order: parts in ``pair_parts`` order, inside a part pass-major (pass
    0's blocks, then pass 1's: the one-part producer's store order)."""
    out = []
    for off, mbar, stage, blocks in pair_parts(load_blocks, wg1_other_first):
        seq = [(m, blk) for m in range(PASSES) for blk in blocks]
        for k, (m, blk) in enumerate(seq):
            out.append(Chunk(off, mbar, stage, m, blk, k == 0, k == len(seq) - 1))
    assert len(out) == PAIR_CHUNKS
    return tuple(out)


def staged(c: int, stage: int) -> bool:
    """Whether chunk c (index in the periodic pair stream) goes through shared-memory staging."""
    return bool(stage) and c % STAGE_EVERY == STAGE_EVERY - 1


def lookahead(ring: int, stage: int = 0) -> int:
    """Chunks issued ahead of the one converted: the largest D such that every window of D + 1 consecutive chunks
    (the converted one and the D issued after it) holds at most ``ring`` register chunks and ``stage`` staged ones,
    so the slot each issue fills (round robin per kind) was vacated by a conversion.  ring - 1 without staging."""
    best = 0
    for d in range(1, PAIR_CHUNKS):
        ok = all(sum(not staged(c, stage) for c in range(j, j + d + 1)) <= ring
                 and sum(staged(c, stage) for c in range(j, j + d + 1)) <= stage
                 for j in range(2 * PAIR_CHUNKS))
        if not ok:
            break
        best = d
    return best


def _slot(c: int, ring: int, stage: int) -> int:
    """Slot of chunk c of the stream (c may exceed 35: the next pair's, numbered on): staged chunks round robin
    over the staging slots, the others round robin over the ring, each in stream order."""
    if staged(c, stage):
        return (c // STAGE_EVERY) % stage
    return (c - (c // STAGE_EVERY if stage else 0)) % ring


def ring_schedule(ring: int, load_blocks, stage: int = 0, wg1_other_first: bool = False
                  ) -> tuple[tuple[Issue, ...], tuple[Step, ...], tuple[int, ...]]:
    """(prologue, steps, rotation) of a ring of ``ring`` register slots (and ``stage`` shared-memory staging slots):
    the prologue issues chunks 0 .. D - 1 of the item's first pair (tile 0) before the pair loop (D = ``lookahead``);
    step j (0..35) of every pair issues chunk j + D (of this pair, or of the next pair's tile a when past 35) into
    the slot of its kind that a conversion vacated, then converts chunk j.  ``rotation[s]``: the register slot whose
    content slot s takes at the end of a pair that has a successor, so that chunk c of every pair sits in the same
    slot (register moves at the loop's back edge when the pair's register chunks, 36 or 24, are not a multiple of
    the ring; staged chunks: 12 per pair, a multiple of the staging slots, no renaming).  ``wg1_other_first``: the
    pair's chunks in ``pair_parts``'s other tile-b order (parts 2, 3); the issue stream follows the conversion
    stream, so the look-ahead issues cross the same part / tile / pair boundaries in the new order."""
    if ring not in RING_REGS:
        raise ValueError(f"fp8p_ring must be one of {tuple(sorted(RING_REGS))}, got {ring}")
    if stage not in (0, STAGE_SLOTS):
        raise ValueError(f"fp8p_stage must be 0 or {STAGE_SLOTS}, got {stage}")
    chunks = pair_chunks(load_blocks, wg1_other_first)
    ahead = lookahead(ring, stage)

    def issue(c):
        nxt = chunks[c % PAIR_CHUNKS]
        off = nxt.off + (2 if c >= PAIR_CHUNKS else 0)
        return Issue(off, nxt.m, nxt.blk, _slot(c, ring, stage), staged(c, stage))

    prologue = tuple(issue(c) for c in range(ahead))
    steps = []
    for j in range(PAIR_CHUNKS):
        # staged chunks issued after chunk j and before its conversion: their cp.async groups may stay pending
        wait = sum(staged(c, stage) for c in range(j + 1, j + ahead + 1)) if staged(j, stage) else 0
        steps.append(Step(issue(j + ahead), chunks[j], _slot(j, ring, stage), staged(j, stage), wait))
    per_pair = sum(not staged(c, stage) for c in range(PAIR_CHUNKS))
    # next-pair register chunk k (k-th of its pair) was issued into slot (per_pair + k) % ring; read from k % ring
    rotation = tuple((s + per_pair) % ring for s in range(ring))
    return prologue, tuple(steps), rotation
