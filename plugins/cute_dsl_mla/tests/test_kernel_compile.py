"""CPU tests (no GPU): compile every specialization for sm_90a with fake
tensors, and check the split-KV schedule against a brute-force cover."""

from __future__ import annotations

import os
import random

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from mla_cute_dsl.kernels import schedule as S  # noqa: E402  (pure python + torch)


def _has_cutlass():
    try:
        import cutlass  # noqa: F401
    except Exception:
        return False
    return True


needs_cutlass = pytest.mark.skipif(not _has_cutlass(), reason="nvidia-cutlass-dsl not installed")


def _specs():
    from mla_cute_dsl.kernels.api import specializations

    return specializations()


@needs_cutlass
@pytest.mark.parametrize("spec", _specs() if _has_cutlass() else [])
def test_compile_partial(spec):
    from mla_cute_dsl.kernels import api

    q, kv, bm = spec
    fn = api.get_partial_kernel(q, kv, bm)
    assert fn is not None
    assert api.get_partial_kernel(q, kv, bm) is fn  # in-process cache hit


@needs_cutlass
@pytest.mark.parametrize("wide", [False, True])
@pytest.mark.parametrize("q", ["bf16", "fp16"])
def test_compile_combine(q, wide):
    from mla_cute_dsl.kernels import api

    fn = api.get_combine_kernel(q, wide=wide)
    assert fn is not None and api.get_combine_kernel(q, wide=wide) is fn
    assert fn is not api.get_combine_kernel(q, wide=not wide)


def test_the_wide_combine_is_chosen_when_the_per_row_one_would_not_fill_the_gpu():
    import torch

    from mla_cute_dsl.kernels import api
    from mla_cute_dsl.kernels.schedule import make_schedule, wide_combine_for

    picked = []
    real = api.get_combine_kernel
    try:
        api.get_combine_kernel = lambda q, wide=False, pdl=False, partial="fp32", cols=512: (
            picked.append(wide))
        for lens, s_q, H in (([4096], 1, 16), ([4096] * 64, 1, 16), ([16384] * 4, 1, 16), ([0, 0, 70], 1, 16),
                             ([4096] * 4, 2, 128), ([4096], 2, 128), ([64], 1, 16)):
            sched = make_schedule(torch.tensor(lens, dtype=torch.int32), s_q, H, 132, device="cpu")
            api.combine_kernel_for("bf16", sched)
            assert picked[-1] == sched.wide_combine
    finally:
        api.get_combine_kernel = real
    # B=64 H=16: 256 per-row CTAs; B=4 H=128 s_q=2: 256 (measured slower with the wide kernel)
    assert picked == [True, False, True, True, False, True, True]
    # wide below num_sms // 2 row CTAs at every row count (combine_kind_for; chunked above)
    assert wide_combine_for(1, 16, 132) and wide_combine_for(16, 16, 132) and not wide_combine_for(17, 16, 132)
    assert wide_combine_for(1, 4 * 65, 132) and not wide_combine_for(1, 4 * 66, 132)
    # the choice follows batch and rows only: the same for every length of one batch size (graph replay)
    for lens in ([1], [64], [100000]):
        assert make_schedule(torch.tensor(lens, dtype=torch.int32), 1, 16, 132, device="cpu").wide_combine


@needs_cutlass
def test_smem_fits_sm90():
    import cutlass

    from mla_cute_dsl.kernels.sm90_decode import MLADecodePartial

    for qt in (cutlass.BFloat16, cutlass.Float16):
        for kt in (qt, cutlass.Float8E4M3FN):
            for bm in (16, 32, 64):
                k = MLADecodePartial(qt, kt, bm)
                assert k.smem_bytes() <= 232448, (qt, kt, bm, k.smem_bytes())


def brute_force_cover(lens, items, split, s_q, H):
    """Every kv position of every request covered exactly once; slots consistent."""
    cover = {b: [0] * n for b, n in enumerate(lens)}
    by_req = {}
    for b, start, end, slot in items:
        assert 0 <= b < len(lens)
        assert start % S.BLOCK_N == 0 and start < end <= lens[b]
        assert end == lens[b] or end % S.BLOCK_N == 0
        for t in range(start, end):
            cover[b][t] += 1
        by_req.setdefault(b, []).append((start, end, slot))
    for b, n in enumerate(lens):
        assert cover[b] == [1] * n, f"request {b} not covered exactly once"
        first, cnt = split[b]
        got = by_req.get(b, [])
        assert cnt == len(got)
        if cnt == 1:
            assert got[0][2] == -1
        elif cnt > 1:
            assert sorted(s for _, _, s in got) == list(range(first, first + cnt))


@pytest.mark.parametrize("seed", range(30))
def test_schedule_matches_brute_force(seed):
    rng = random.Random(seed)
    B = rng.choice([1, 2, 3, 6, 17, 64, 128])
    s_q = rng.choice([1, 2, 4, 8])
    H = rng.choice([1, 3, 8, 16, 63, 64, 126, 128])
    n_sm = rng.choice([132, 78, 16])
    maxlen = rng.choice([1, 20, 140, 4096, 16384])
    lens = [rng.choice([0, rng.randint(0, maxlen), maxlen, rng.randint(0, s_q)]) for _ in range(B)]
    items, split, bps = S.plan_items(lens, s_q, H, n_sm)
    brute_force_cover(lens, items, split, s_q, H)
    # bounds that fix the buffer sizes
    assert len(items) <= S.capacity_for(B, n_sm)
    assert sum(c for _, c in split if c > 1) <= S.slots_for(s_q * H, n_sm)
    # balance: every item holds at most bps blocks; a request's items differ by <= 1 block
    per_req = {}
    for b, start, end, _ in items:
        nblk = -(-(end - start) // S.BLOCK_N)
        assert 1 <= nblk <= bps
        per_req.setdefault(b, []).append(nblk)
    for sizes in per_req.values():
        assert max(sizes) - min(sizes) <= 1
    # enough CTAs to fill the GPU when there is enough work
    rows = s_q * H
    m_blocks = -(-rows // S.block_m_for(rows))
    total_blocks = sum(-(-n // S.BLOCK_N) for n in lens)
    if total_blocks * m_blocks >= n_sm:
        assert len(items) * m_blocks >= n_sm // 2


def test_make_schedule_buffers_and_in_place_update():
    import torch

    sched = S.make_schedule([4096, 0, 17], 2, 16, 132, max_batch=8, device="cpu")
    assert sched.work_info.shape == (S.capacity_for(8, 132), 4)
    assert sched.split_info.shape == (8, 2)
    wi = sched.work_info
    n = sched.num_items
    assert (wi[n:, 0] == -1).all() and (wi[:n, 0] >= 0).all()
    ptr = wi.data_ptr()
    S.make_schedule(torch.tensor([5, 6], dtype=torch.int32), 2, 16, 132, device="cpu", out=sched)
    assert sched.work_info.data_ptr() == ptr
    assert sched.num_items == 2
    assert sched.work_info[0].tolist() == [0, 0, 5, -1]
    assert sched.split_info[:3].tolist() == [[0, 1], [0, 1], [0, 0]]
    with pytest.raises(ValueError):
        S.make_schedule([1] * 9, 2, 16, 132, device="cpu", out=sched)
    with pytest.raises(ValueError):
        S.make_schedule([1], 9, 16, 132, device="cpu")


def test_block_m_choice():
    assert S.block_m_for(1) == 16 and S.block_m_for(16) == 16
    assert S.block_m_for(17) == 32 and S.block_m_for(32) == 32
    assert S.block_m_for(33) == 64 and S.block_m_for(1024) == 64


def test_input_checks_reject_bad_page_size():
    import torch

    from mla_cute_dsl.kernels.api import check_inputs

    q = torch.zeros(1, 1, 16, 576, dtype=torch.bfloat16)
    kv = torch.zeros(4, 32, 576, dtype=torch.bfloat16)
    pt = torch.zeros(1, 4, dtype=torch.int32)
    lens = torch.ones(1, dtype=torch.int32)
    out = torch.zeros(1, 1, 16, 512, dtype=torch.bfloat16)
    lse = torch.zeros(1, 1, 16)
    with pytest.raises(ValueError, match="page size"):
        check_inputs(q, kv, pt, lens, out, lse)
    check_inputs(q, torch.zeros(4, 64, 576, dtype=torch.bfloat16), pt, lens, out, lse)


@needs_cutlass
@pytest.mark.parametrize("kv", ["bf16", "fp8_e4m3"])
@pytest.mark.parametrize("block_m,layout", [(16, (1, 1, 2)), (16, (1, 1, 4)), (32, (1, 2, 1)),
                                            (32, (1, 2, 2)), (32, (2, 1, 4)), (64, (2, 2, 1))])
def test_compile_layout_variants(kv, block_m, layout):
    """The tuning layouts bench_kernel.py --variants times also compile."""
    from mla_cute_dsl.kernels import api

    assert api.get_partial_kernel("bf16", kv, block_m, layout) is not None


def test_layout_override_is_checked():
    cutlass = pytest.importorskip("cutlass")
    from mla_cute_dsl.kernels.sm90_decode import MLADecodePartial

    with pytest.raises(AssertionError):
        MLADecodePartial(cutlass.BFloat16, cutlass.BFloat16, 32, (1, 1, 1))  # 16 rows != 32
    k = MLADecodePartial(cutlass.BFloat16, cutlass.BFloat16, 64)
    assert (k.m_warps, k.m_per_warp, k.n_acc, k.num_threads) == (2, 2, 2, 256)
