"""CPU tests (no GPU) of the transposed WGMMA partial kernel (sm90_wgmma_t_decode).

1. Layout facts the design rests on, evaluated from the DSL's own layouts and partitions:
   V^T view = K tile bytes; S^T's C fragment puts tokens on M and query rows on N (2 tokens,
   bm / 4 rows per thread); O^T's C fragment lists the same rows per thread; lanes 0..3 of
   a warp hold every row once; the (token, row) view of sP is sP transposed.
2. The producer / consumer copies: every element of a tile / of Q stored exactly once, in
   16-byte swizzle units, from the element it was loaded from.
3. The mbarrier protocol (pure Python model of the kernel's loops): no deadlock, no hazard.
4. The whole kernel compiles for sm_90a for every specialization (bf16 / fp16 q, fp8 / q-dtype
   KV, BLOCK_M 16 / 32), and its PTX / cubin have the predicted structure.
Nothing here runs the kernel: tests/test_wgmma_t_gpu.py does, on an SM90 GPU.
"""

from __future__ import annotations

import os
import random
import re

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from test_kernel_compile import _has_cutlass  # noqa: E402  (same directory: pytest rootdir import)
from test_wgmma_compile import _nv_info_attrs  # noqa: E402

pytestmark = pytest.mark.skipif(not _has_cutlass(), reason="nvidia-cutlass-dsl not installed")

if _has_cutlass():
    import cutlass
    import cutlass.cute as cute

SPECS = [(q, kv, bm) for q in ("bf16", "fp16") for kv in ("fp8_e4m3", None) for bm in (16, 32)]


def _kernel(q="bf16", kv=None, bm=16):
    from mla_cute_dsl.kernels.sm90_wgmma_t_decode import MLADecodePartialWGMMAT

    dt = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16, "fp8_e4m3": cutlass.Float8E4M3FN}
    return MLADecodePartialWGMMAT(dt[q], dt[kv or q], bm)


def test_smem_budget_and_refusals():
    from mla_cute_dsl.kernels import sm90_wgmma_t_decode as T

    # ring 2 x 73,728 + sQ + sP + sRed + 4 mbarriers (aligned as in SharedStorage)
    assert T.smem_bytes_for(16) == 147456 + 18432 + 2048 + 256 + 32 == 168224
    assert T.smem_bytes_for(32) == 147456 + 36864 + 4096 + 512 + 32 == 188960
    for bm in (16, 32):
        assert T.smem_bytes_for(bm) <= T.SMEM_LIMIT
        # a third fp16 stage would not fit; two CTAs per SM would not either
        assert T.smem_bytes_for(bm) + 73728 > T.SMEM_LIMIT
        assert 2 * (T.smem_bytes_for(bm) + 1024) > 233472
    # registers: setmaxnreg draws from the CTA's pool = registers at launch x 384 = 64,512, not
    # the SM's 65,536 (240 / 136 = 65,536 made setmaxnreg.inc wait forever on the H200)
    assert T.REGS_AT_LAUNCH == 168
    assert T.CONSUMER_REGS * T.WG_THREADS + T.PRODUCER_REGS * T.PROD_THREADS <= T.REGS_AT_LAUNCH * T.NUM_THREADS
    assert T.CONSUMER_REGS % 8 == 0 and T.PRODUCER_REGS % 8 == 0
    assert 24 <= T.PRODUCER_REGS <= T.REGS_AT_LAUNCH <= T.CONSUMER_REGS <= 256
    assert T.register_split_fits()
    assert not T.register_split_fits(240, 136)  # the split that hung
    assert T.register_split_fits(240, 128) and T.register_split_fits(248, 128) and T.register_split_fits(232, 136)
    assert not T.register_split_fits(248, 136)
    with pytest.raises(ValueError):
        _kernel("bf16", None, 64)
    with pytest.raises(NotImplementedError):
        _kernel("bf16", "fp16", 16)
    with pytest.raises(TypeError):
        _kernel("fp8_e4m3", "fp8_e4m3", 16)


@pytest.mark.parametrize("bm", [16, 32])
def test_layout_and_fragment_facts(bm):
    from mla_cute_dsl.kernels import sm90_wgmma_t_decode as T

    k = _kernel("bf16", "fp8_e4m3", bm)
    facts = {}

    @cute.jit
    def probe():
        sK, sQ, sP, sV = k._smem_layouts()
        mma_s, mma_o = k._tiled_mmas()
        facts["cosize"] = (cute.cosize(sK), cute.cosize(sQ), cute.cosize(sP))
        facts["v_is_k"] = all(
            sK.outer((t, d, st)) == sV.outer((d, t, st))
            for d in range(0, T.D_V, 3) for t in range(T.BLOCK_N) for st in range(T.STAGES)
        )
        sPt = cute.select(sP.outer, mode=[1, 0])
        facts["pt"] = all(sPt((t, r)) == sP.outer((r, t)) for t in range(T.BLOCK_N) for r in range(bm))
        cS = cute.make_identity_tensor((T.BLOCK_N, bm))
        cO = cute.make_identity_tensor((T.D_V, bm))
        for tid in cutlass.range_constexpr(T.WG_THREADS):  # static thread ids
            s_mn = T._acc_mn_view(mma_s.get_slice(tid).partition_C(cS))
            o_mn = T._acc_mn_view(mma_o.get_slice(tid).partition_C(cO))
            ns = (cute.size(s_mn.shape[0]), cute.size(s_mn.shape[1]))
            no = (cute.size(o_mn.shape[0]), cute.size(o_mn.shape[1]))
            facts[("shape", tid)] = (ns, no)
            facts[("tok", tid)] = [[s_mn[t, c][0] for c in range(ns[1])] for t in range(ns[0])]
            facts[("col", tid)] = [[s_mn[t, c][1] for t in range(ns[0])] for c in range(ns[1])]
            facts[("ocol", tid)] = [[o_mn[r, c][1] for r in range(no[0])] for c in range(no[1])]
            facts[("odim", tid)] = sorted(o_mn[r, 0][0] for r in range(no[0]))

    cute.compile(probe)
    assert facts["cosize"] == (2 * 64 * 576, bm * 576, bm * 64)
    assert facts["v_is_k"] is True
    assert facts["pt"] is True
    seen_dims = {}
    for tid in range(T.WG_THREADS):
        warp, lane = tid // 32, tid % 32
        assert facts[("shape", tid)] == ((2, bm // 4), (16, bm // 4))
        t0 = warp * 16 + lane // 4
        # tokens: r and r + 8 of the warp's 16, the same for every column
        assert all(row == [t0] * (bm // 4) for row, t0 in zip(facts[("tok", tid)], (t0, t0 + 8)))
        cols = [c[0] for c in facts[("col", tid)]]
        assert all(len(set(c)) == 1 for c in facts[("col", tid)])
        assert sorted(cols) == sorted(8 * j + 2 * (lane % 4) + e for j in range(bm // 8) for e in (0, 1))
        # O^T's columns per thread are S^T's, in the same order (the rescale pairs them up)
        assert [c[0] for c in facts[("ocol", tid)]] == cols
        assert all(len(set(c)) == 1 for c in facts[("ocol", tid)])
        # O^T dims: 2 per M-block of 64, r and r + 8 of the warp's 16
        assert facts[("odim", tid)] == sorted(64 * mb + warp * 16 + lane // 4 + h for mb in range(8) for h in (0, 8))
        for d in facts[("odim", tid)]:
            seen_dims.setdefault(d, set()).update(cols)
    assert sorted(seen_dims) == list(range(512))
    assert all(v == set(range(bm)) for v in seen_dims.values())
    # lanes 0..3 of a warp (the sRed writers) hold every column once
    for warp in range(4):
        cov = sorted(c[0] for tid in range(32 * warp, 32 * warp + 4) for c in facts[("col", tid)])
        assert cov == list(range(bm))
    # the butterfly offsets 4, 8, 16 connect exactly the 8 lanes sharing lane % 4
    for lane in range(32):
        group = {lane}
        for off in (4, 8, 16):
            group |= {x ^ off for x in group}
        assert group == {x for x in range(32) if x % 4 == lane % 4}


@pytest.mark.parametrize("bm", [16, 32])
def test_copies_store_each_element_once(bm):
    """Producer: fp8 ld.global (g2r), fp16 st.shared (r2s) and the cp.async copy (16-bit KV)
    list the same (row, col) per position for all 256 threads; each chunk is one row and 8
    consecutive columns at a multiple of 8; through sK's swizzle every chunk is 8
    consecutive 16-byte-aligned elements in both stages; every element written once.
    Consumer: the q load and the sQ store agree the same way over (bm, 576)."""
    from mla_cute_dsl.kernels import sm90_wgmma_t_decode as T

    k = _kernel("bf16", "fp8_e4m3", bm)
    res = {}

    @cute.jit
    def probe():
        sK, sQ, _, _ = k._smem_layouts()
        g2r, r2s, g2s, g2r_q, r2s_q = k._copies()
        c = cute.make_identity_tensor((T.BLOCK_N, T.D_QK))
        cq = cute.make_identity_tensor((bm, T.D_QK))
        for t in cutlass.range_constexpr(T.PROD_THREADS):
            a = g2r.get_slice(t).partition_S(c)
            b = r2s.get_slice(t).partition_D(c)
            m = g2s.get_slice(t).partition_S(c)
            shp = (cute.size(a.shape[0]), cute.size(a.shape[1]), cute.size(a.shape[2]))
            res[("shape", t)] = (shp, (cute.size(b.shape[0]), cute.size(b.shape[1]), cute.size(b.shape[2])))
            res[("same", t)] = all(a[v, mm, blk] == b[v, mm, blk] and b[v, mm, blk] == m[v, mm, blk]
                                   for v in range(shp[0]) for mm in range(shp[1]) for blk in range(shp[2]))
            res[("elems", t)] = [tuple(b[v, mm, blk]) for mm in range(shp[1]) for blk in range(shp[2])
                                 for v in range(shp[0])]
        for t in cutlass.range_constexpr(T.WG_THREADS):
            a = g2r_q.get_slice(t).partition_S(cq)
            b = r2s_q.get_slice(t).partition_D(cq)
            shp = (cute.size(a.shape[0]), cute.size(a.shape[1]), cute.size(a.shape[2]))
            res[("qshape", t)] = shp
            res[("qsame", t)] = all(a[v, mm, blk] == b[v, mm, blk]
                                    for v in range(shp[0]) for mm in range(shp[1]) for blk in range(shp[2]))
            res[("qelems", t)] = [tuple(b[v, mm, blk]) for mm in range(shp[1]) for blk in range(shp[2])
                                  for v in range(shp[0])]
        res["units_ok"] = all(
            [sK((r, c0 + i, j)) for i in range(8)] == list(range(sK((r, c0, j)), sK((r, c0, j)) + 8))
            and sK((r, c0, j)) % 8 == 0
            for r in range(T.BLOCK_N) for c0 in range(0, T.D_QK, 8) for j in range(T.STAGES)
        )
        res["q_units_ok"] = all(
            [sQ((r, c0 + i)) for i in range(8)] == list(range(sQ((r, c0)), sQ((r, c0)) + 8))
            and sQ((r, c0)) % 8 == 0
            for r in range(bm) for c0 in range(0, T.D_QK, 8)
        )

    cute.compile(probe)
    assert res["units_ok"] is True and res["q_units_ok"] is True
    cover = []
    for t in range(T.PROD_THREADS):
        assert res[("shape", t)] == ((8, 2, 9), (8, 2, 9))
        assert res[("same", t)] is True, t
        el = res[("elems", t)]
        for i in range(0, len(el), 8):
            chunk = el[i:i + 8]
            assert len({r for r, _ in chunk}) == 1
            cols = [col for _, col in chunk]
            assert cols == list(range(cols[0], cols[0] + 8)) and cols[0] % 8 == 0
            assert chunk[0][0] == t // 8 + 32 * ((i // 8) // 9)
        cover += el
    assert len(cover) == len(set(cover)) == T.BLOCK_N * T.D_QK
    qcover = []
    for t in range(T.WG_THREADS):
        assert res[("qshape", t)] == (8, bm // 16, 9)
        assert res[("qsame", t)] is True
        qcover += res[("qelems", t)]
    assert len(qcover) == len(set(qcover)) == bm * T.D_QK


# ---------------------------------------------------------------- protocol model


def _simulate(T_tiles, rng, stages=2):
    """Run the producer and consumer programs (sm90_wgmma_t_decode.producer_schedule /
    consumer_schedule) under random interleavings with mbarrier phase semantics.  Checks: no
    deadlock; the consumer reads tile i from stage i % 2 only after its store and before the
    next store into that stage; a store into a stage only after the consumer released the
    tile before it there; a register set is re-loaded only after its tile was stored."""
    import mla_cute_dsl.kernels.sm90_wgmma_t_decode as M

    prod = M.producer_schedule(T_tiles, stages)
    cons = M.consumer_schedule(T_tiles, stages)
    # setmaxnreg: the CTA's pool starts empty (every register was handed out at launch: 168 per
    # thread); .dec puts (168 - P) x 256 in, .inc takes (C - 168) x 128 out or blocks.  Registers
    # of exited warps are not counted on (the H200 hung even with one tile, producers gone).
    pool = 0
    full = [0] * stages  # completed phases
    empty = [0] * stages
    content = [None] * stages  # tile stored in a stage
    reg = [None, None]  # tile held in register set 0 / 1
    ip = ic = 0
    consumed = []
    cur = None
    while ip < len(prod) or ic < len(cons):
        # mbarrier try_wait.parity P passes once the phase of parity P completed: completions % 2 != P
        can_p = ip < len(prod) and (prod[ip][0] != "wait_empty" or empty[prod[ip][1]] % 2 != prod[ip][2])
        can_c = ic < len(cons) and (cons[ic][0] != "wait_full" or full[cons[ic][1]] % 2 != cons[ic][2])
        if can_c and cons[ic][0] == "setmaxnreg_inc":
            can_c = pool >= (cons[ic][1] - M.REGS_AT_LAUNCH) * M.WG_THREADS
        assert can_p or can_c, (f"deadlock at T={T_tiles}: prod {prod[ip:ip+1]} cons {cons[ic:ic+1]} "
                                f"(register pool {pool})")
        if can_p and (not can_c or rng.random() < 0.5):
            ev = prod[ip]
            ip += 1
            if ev[0] == "setmaxnreg_dec":
                assert ip == 1 and ev[1] <= M.REGS_AT_LAUNCH
                pool += (M.REGS_AT_LAUNCH - ev[1]) * M.PROD_THREADS
            elif ev[0] == "ldg":
                assert reg[ev[1] % 2] is None, "register set reloaded before its store"
                reg[ev[1] % 2] = ev[1]
            elif ev[0] == "store":
                i, s = ev[1], ev[2]
                assert s == i % stages and reg[i % 2] == i
                # the stage must be free: its previous tile consumed (released)
                assert content[s] is None, f"store of tile {i} over unreleased tile {content[s]}"
                assert empty[s] == i // stages  # the wait matched the release of tile i - 2, no ABA
                content[s] = i
                reg[i % 2] = None
            elif ev[0] == "arrive_full":
                full[ev[1]] += 1
        else:
            ev = cons[ic]
            ic += 1
            if ev[0] == "setmaxnreg_inc":
                assert ic == 1 and ev[1] >= M.REGS_AT_LAUNCH
                pool -= (ev[1] - M.REGS_AT_LAUNCH) * M.WG_THREADS
            elif ev[0] == "wait_full":
                s = ev[1]
                cur = content[s]
                assert cur == len(consumed), (cur, consumed)
                assert full[s] == cur // stages + 1  # the phase waited for is this tile's
                assert cur % stages == s
            else:
                s = ev[1]
                assert content[s] == cur
                consumed.append(cur)
                content[s] = None
                empty[s] += 1
    assert consumed == list(range(T_tiles))


def test_protocol_model_no_deadlock_no_hazard():
    rng = random.Random(1234)
    for T_tiles in range(0, 12):
        for _ in range(200):
            _simulate(T_tiles, rng)


def test_protocol_model_catches_a_missing_wait():
    """Mutation: the producer's empty waits dropped -> the model reports a hazard."""
    import mla_cute_dsl.kernels.sm90_wgmma_t_decode as T

    orig = T.producer_schedule
    try:
        T.producer_schedule = lambda n, s=2: [e for e in orig(n, s) if e[0] != "wait_empty"]
        with pytest.raises(AssertionError):
            rng = random.Random(7)
            for _ in range(200):
                _simulate(6, rng)
    finally:
        T.producer_schedule = orig


@pytest.mark.parametrize("split", [(240, 136), (248, 136), (256, 128)])
def test_protocol_model_catches_a_register_split_over_the_pool(monkeypatch, split):
    """Mutation: a setmaxnreg split over the CTA's 64,512 registers (240 / 136 is the one that
    hung on the H200) -> the consumer's setmaxnreg.inc never returns: the model reports a
    deadlock for every tile count, even 0 and 1."""
    import mla_cute_dsl.kernels.sm90_wgmma_t_decode as T

    monkeypatch.setattr(T, "CONSUMER_REGS", split[0])
    monkeypatch.setattr(T, "PRODUCER_REGS", split[1])
    assert not T.register_split_fits(*split)
    for n in (0, 1, 2, 5):
        with pytest.raises(AssertionError, match="deadlock.*setmaxnreg_inc"):
            _simulate(n, random.Random(n))



# ------------------------------------------- protocol model, balanced mode (multi-item columns)


def _simulate_column(item_tiles, rng, prod=None, cons=None, stages=2):
    """One CTA column of the balanced kernel: the producer and consumer programs
    (producer_schedule_balanced / consumer_schedule_balanced, or the given event lists) under a random
    interleaving with mbarrier phase semantics.  Checks: no deadlock (register pool included); a store
    only into a stage whose last tile was released, and only after as many releases of that stage as
    stores into it (no ABA: a wait that passed on an older phase of the same parity shows here); the
    consumer's wait_full returns exactly the next tile of the column, filled by the phase it waited for;
    each item's epilogue after all its tiles and before the next item's first; every tile consumed once."""
    import mla_cute_dsl.kernels.sm90_wgmma_t_decode as M

    prod = M.producer_schedule_balanced(item_tiles) if prod is None else prod
    cons = M.consumer_schedule_balanced(item_tiles) if cons is None else cons
    total = sum(item_tiles)
    ends = [sum(item_tiles[:k + 1]) for k in range(len(item_tiles))]
    pool = 0
    full = [0] * stages  # completed phases
    empty = [0] * stages
    stores = [0] * stages  # tiles stored into a stage so far
    taken = [0] * stages  # tiles the consumer took from a stage so far
    content = [None] * stages
    loaded = None  # the cp.async in flight (16-bit KV: ldg and store are one copy)
    ip = ic = 0
    consumed, epilogues = [], []
    cur = item = None
    while ip < len(prod) or ic < len(cons):
        can_p = ip < len(prod) and (prod[ip][0] != "wait_empty" or empty[prod[ip][1]] % 2 != prod[ip][2])
        can_c = ic < len(cons) and (cons[ic][0] != "wait_full" or full[cons[ic][1]] % 2 != cons[ic][2])
        if can_c and cons[ic][0] == "setmaxnreg_inc":
            can_c = pool >= (cons[ic][1] - M.REGS_AT_LAUNCH) * M.WG_THREADS
        assert can_p or can_c, f"deadlock in column {item_tiles}: prod {prod[ip:ip+1]} cons {cons[ic:ic+1]}"
        if can_p and (not can_c or rng.random() < 0.5):
            ev = prod[ip]
            ip += 1
            if ev[0] == "setmaxnreg_dec":
                pool += (M.REGS_AT_LAUNCH - ev[1]) * M.PROD_THREADS
            elif ev[0] == "ldg":
                assert loaded is None
                loaded = ev[1]
            elif ev[0] == "store":
                gi, s = ev[1], ev[2]
                assert loaded == gi
                assert content[s] is None, f"store of tile {gi} over unreleased tile {content[s]}"
                assert empty[s] == stores[s], "store before the stage's last release (ABA)"
                content[s], loaded = gi, None
                stores[s] += 1
            elif ev[0] == "arrive_full":
                full[ev[1]] += 1
        else:
            ev = cons[ic]
            ic += 1
            if ev[0] == "setmaxnreg_inc":
                pool -= (ev[1] - M.REGS_AT_LAUNCH) * M.WG_THREADS
            elif ev[0] == "item_start":
                item = ev[1]
                assert epilogues == list(range(item)), "item started before the previous epilogue"
            elif ev[0] == "wait_full":
                s = ev[1]
                cur = content[s]
                assert cur == len(consumed), f"consumer got tile {cur}, expected {len(consumed)}"
                assert full[s] == taken[s] + 1, "full phase waited for is not this tile's"
                assert cur < ends[item] and (item == 0 or cur >= ends[item - 1])
            elif ev[0] == "arrive_empty":
                s = ev[1]
                assert content[s] == cur
                consumed.append(cur)
                content[s] = None
                taken[s] += 1
                empty[s] += 1
            elif ev[0] == "epilogue":
                assert ev[1] == item and len(consumed) == ends[item], "epilogue before its item's last tile"
                epilogues.append(item)
    assert consumed == list(range(total)) and epilogues == list(range(len(item_tiles)))


def _random_column(rng):
    """0..7 items of 0..9 tiles, 1-tile items common (the balanced plan's column tails and heads)."""
    return [rng.choice([0, 1, 1, 1, 2, 3, 4, 5, 9]) for _ in range(rng.choice([0, 1, 1, 2, 3, 4, 5, 7]))]


def test_balanced_protocol_model_no_deadlock_no_aba_over_random_columns():
    rng = random.Random(4321)
    cols = [[], [0], [1], [1, 1], [1, 1, 1], [1, 2], [2, 1], [3, 1, 3], [0, 1, 0, 2], [5]]
    cols += [_random_column(rng) for _ in range(60)]
    for col in cols:
        for _ in range(200):
            _simulate_column(col, rng)


def test_balanced_ring_index_runs_across_items():
    """The schedules put tile g + i of the column on stage (g + i) % 2: after an item of one tile the next
    item starts on stage 1, and its first empty wait is the one for the column's third tile."""
    import mla_cute_dsl.kernels.sm90_wgmma_t_decode as M

    assert [M.ring_slot(g) for g in range(5)] == [(0, 0, None), (1, 0, None), (0, 1, 0), (1, 1, 0), (0, 0, 1)]
    assert M.item_tiles(0, 1) == (0, 1) and M.item_tiles(128, 200) == (2, 2) and M.item_tiles(64, 64) == (1, 0)
    cons = M.consumer_schedule_balanced([1, 2])
    assert cons == [("setmaxnreg_inc", M.CONSUMER_REGS), ("item_start", 0), ("wait_full", 0, 0),
                    ("arrive_empty", 0), ("epilogue", 0), ("item_start", 1), ("wait_full", 1, 0),
                    ("arrive_empty", 1), ("wait_full", 0, 1), ("arrive_empty", 0), ("epilogue", 1)]
    prod = M.producer_schedule_balanced([1, 2])
    assert [e for e in prod if e[0] == "wait_empty"] == [("wait_empty", 0, 0)]


def _restarting_schedules(item_tiles):
    """Mutation: both sides restart the ring (stage and phase) at every item, as a per-item kernel body
    wrapped in a loop would."""
    import mla_cute_dsl.kernels.sm90_wgmma_t_decode as M

    prod, cons, g = [("setmaxnreg_dec", M.PRODUCER_REGS)], [("setmaxnreg_inc", M.CONSUMER_REGS)], 0
    for k, n in enumerate(item_tiles):
        cons.append(("item_start", k))
        for i in range(n):
            st, pf, pe = M.ring_slot(i)
            if pe is not None:
                prod.append(("wait_empty", st, pe))
            prod += [("ldg", g + i), ("store", g + i, st), ("arrive_full", st)]
            cons += [("wait_full", st, pf), ("arrive_empty", st)]
        cons.append(("epilogue", k))
        g += n
    return prod, cons


@pytest.mark.parametrize("col", [[1, 1], [3, 2], [1, 4, 1]])
def test_balanced_protocol_model_catches_a_ring_restarted_per_item(col):
    rng = random.Random(11)
    prod, cons = _restarting_schedules(col)
    with pytest.raises(AssertionError):
        for _ in range(200):
            _simulate_column(col, rng, prod, cons)


def test_balanced_protocol_model_catches_a_missing_wait():
    import mla_cute_dsl.kernels.sm90_wgmma_t_decode as M

    col = [2, 1, 3]
    prod = [e for e in M.producer_schedule_balanced(col) if e[0] != "wait_empty"]
    rng = random.Random(5)
    with pytest.raises(AssertionError):
        for _ in range(200):
            _simulate_column(col, rng, prod=prod)


# ---------------------------------------------------------------- whole kernel


def _compile_dump(q, kv, bm, tmp_path):
    from mla_cute_dsl.kernels import api

    k = _kernel(q, kv, bm)
    cute.compile(k, *api._fake_args_partial(q, kv or q),
                 options=api.COMPILE_OPTIONS + f" --keep-ptx --keep-cubin --dump-dir={tmp_path}")
    ptx = "".join(p.read_text() for p in tmp_path.glob("*.ptx"))
    cubin = b"".join(p.read_bytes() for p in tmp_path.glob("*.cubin"))
    attrs = _nv_info_attrs(cubin)
    regs = max(v for a, v in attrs if a == 0x2F)  # EIATTR_REGCOUNT
    frame = max((v for a, v in attrs if a == 0x11), default=0)  # EIATTR_FRAME_SIZE
    return ptx, regs, frame


# the DSL's ptxas (4.8.1) reports a 24-byte frame for fp8 KV at BLOCK_M 32 (standalone ptxas
# 13.0: 48 B spill stores); every other specialization: none.  Pinned so a change shows.
KNOWN_FRAME = {("bf16", "fp8_e4m3", 32): 24, ("fp16", "fp8_e4m3", 32): 24}


# Whole-kernel compiles cost ~25 s each on a 2-core CI machine: every bf16-q specialization, and fp16 q with an
# fp16 cache (its MMAs differ); fp16 q with an fp8 cache runs bf16 q's fp16 MMAs after a different q load, which
# the layout tests above and the GPU tests cover.
PTX_SPECS = [spec for spec in SPECS if spec[0] == "bf16"] + [("fp16", None, 32)]


@pytest.mark.parametrize("q,kv,bm", PTX_SPECS)
def test_ptx_structure_registers(q, kv, bm, tmp_path):
    """384 threads (.reqntid, .minnctapersm 1 so ptxas honours setmaxnreg), 168 registers at
    entry, setmaxnreg 240 / 128 paid from the CTA's pool (entry registers x 384), 68 WGMMA m64n{bm}k16 (36 S^T + 32 O^T) all from smem
    descriptors, 4 mbarriers, no local memory in the PTX; fp8: 4 x 72 cvt.rn.f16x2.e4m3x2
    (two stages x plain / masked store), no cp.async for KV; 16-bit KV: cp.async + noinc arrive."""
    ptx, regs, frame = _compile_dump(q, kv, bm, tmp_path)
    assert ptx.count("griddepcontrol.launch_dependents;") == 1  # the PDL trigger for the combine kernel
    assert regs == 168, regs
    assert frame == KNOWN_FRAME.get((q, kv, bm), 0), frame
    assert ".reqntid 384, 1, 1" in ptx and ".minnctapersm 1" in ptx
    # setmaxnreg as compiled: one .inc (the consumer warpgroup, 128 threads), one .dec (both
    # producer warpgroups, 256 threads); the CTA's pool is what the cubin's register count gave
    # it at launch, and .inc blocks until the pool can pay (a split over it hangs the kernel)
    inc = [int(v) for v in re.findall(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+(\d+);", ptx)]
    dec = [int(v) for v in re.findall(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+(\d+);", ptx)]
    assert len(inc) == 1 and len(dec) == 1, (inc, dec)
    assert dec[0] <= regs <= inc[0]
    assert (inc[0] - regs) * 128 <= (regs - dec[0]) * 256, f"setmaxnreg.inc {inc[0]} would wait forever"
    assert inc[0] * 128 + dec[0] * 256 <= regs * 384
    assert (inc[0], dec[0]) == (240, 128)
    mt = "f16" if (kv or q) in ("fp8_e4m3", "fp16") else "bf16"
    wg = re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)\.f32\.(\w+)\.(\w+)", ptx)
    assert len(wg) == 68 and set(wg) == {(f"m64n{bm}k16", mt, mt)}, set(wg)
    assert len(re.findall(r"mbarrier\.init\.shared\.b64", ptx)) == 4
    assert "ld.local" not in ptx and "st.local" not in ptx
    n_cvt = len(re.findall(r"cvt\.rn\.f16x2\.e4m3x2", ptx))
    n_cpa = len(re.findall(r"cp\.async\.cg\.shared\.global", ptx))
    if kv == "fp8_e4m3":
        assert n_cvt == 4 * 72, n_cvt
        assert n_cpa == 0
        assert "cp.async.mbarrier.arrive.noinc" not in ptx
    else:
        assert n_cvt == 0
        assert n_cpa == 18, n_cpa
        assert "cp.async.mbarrier.arrive.noinc" in ptx
    # bf16 q with fp8 KV is converted to fp16 on load (as the other fp8 kernels)
    if q == "bf16" and kv == "fp8_e4m3":
        assert re.search(r"cvt\.rn\.f16x2\.f32|cvt\.f32\.bf16|cvt\.rn\.f16\.f32", ptx)


def test_kernel_cache_and_host_entry_refusal():
    import torch

    from mla_cute_dsl.kernels import kernel_cache, make_schedule
    from mla_cute_dsl.kernels.sm90_wgmma_t_decode import get_partial_kernel_wgmma_t, mla_decode_sm90_wgmma_t

    fn = get_partial_kernel_wgmma_t("bf16", "fp8_e4m3", 16)
    assert fn is not None
    assert kernel_cache.origin("partial_wgmma_t", ("bf16", "fp8_e4m3", 16)) in ("compiled", "disk")
    assert get_partial_kernel_wgmma_t("bf16", "fp8_e4m3", 16) is fn
    # 64 rows: refused before anything runs (CPU tensors: the check is host-only)
    B, s_q, H = 2, 1, 64
    sched = make_schedule([128, 64], s_q, H, 4, device="cpu")
    q = torch.zeros(B, s_q, H, 576, dtype=torch.bfloat16)
    kv = torch.zeros(4, 64, 576, dtype=torch.float8_e4m3fn)
    pt = torch.zeros(B, 2, dtype=torch.int32)
    lens = torch.tensor([128, 64], dtype=torch.int32)
    out = torch.zeros(B, s_q, H, 512, dtype=torch.bfloat16)
    lse = torch.zeros(B, s_q, H, dtype=torch.float32)
    with pytest.raises(ValueError, match="<= 32"):
        mla_decode_sm90_wgmma_t(q, kv, pt, lens, 0.1, 1.0, out, lse, sched, None)
