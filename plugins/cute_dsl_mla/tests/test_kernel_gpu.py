"""GPU tests of the SM90 MLA decode kernels against an fp64 reference.

Fresh random inputs each case (never zeros), shuffled page tables, NaN in
unused pages and page tails, NaN-poisoned outputs before each call,
large-magnitude q, variable lengths including 0 and < s_q, graph replay equal
to eager. The cross product of B, s_q, S, H, kv dtype is sampled (fixed seed)
to keep the run short.
"""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch
from graph_replay import fresh_values, graph_replay_equals_eager

pytestmark = pytest.mark.gpu

PAGE = 64


def _is_sm90():
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


needs_sm90 = pytest.mark.skipif(not _is_sm90(), reason="needs an SM90 GPU")


def make_case(B, s_q, H, S, kv_dtype, varlen, q_std=1.0, seed=0, page=PAGE):
    g = torch.Generator(device="cpu").manual_seed(seed)
    dev = "cuda"
    if varlen:
        lens = torch.randint(0, S + 1, (B,), generator=g)
        choices = [0, 1, max(0, s_q - 1), S]
        for i in range(B):
            if i < len(choices):
                lens[i] = min(S, choices[(i + seed) % len(choices)])
    else:
        lens = torch.full((B,), S)
    max_pages = max(1, -(-S // page)) + 1
    P = B * max_pages + 3
    perm = torch.randperm(P, generator=g)
    page_table = perm[: B * max_pages].view(B, max_pages).to(torch.int32)
    scale = 1.0
    if kv_dtype == torch.float8_e4m3fn:
        base = torch.randn(P, page, 576, generator=g) * 2.0
        kv = base.clamp(-400, 400).to(torch.float8_e4m3fn)
        scale = 0.37
    else:
        kv = (torch.randn(P, page, 576, generator=g)).to(kv_dtype)
    # NaN-poison every row no request reads: unused pages and page tails
    used = torch.zeros(P, page, dtype=torch.bool)
    for b in range(B):
        n = int(lens[b])
        for t in range(n):
            used[page_table[b, t // page], t % page] = True
    kv_f = kv.view(torch.uint8) if kv.dtype == torch.float8_e4m3fn else None
    if kv_f is not None:
        kv_f[~used] = 0x7F  # e4m3 NaN
    else:
        kv[~used] = float("nan")
    q = (torch.randn(B, s_q, H, 576, generator=g) * q_std).to(torch.bfloat16)
    return dict(q=q.to(dev), kv=kv.to(dev), page_table=page_table.to(dev),
                lens=lens.to(torch.int32).to(dev), lens_cpu=lens.to(torch.int32),
                kv_scale=scale, sm_scale=1.0 / math.sqrt(192))


def reference(q, kv, page_table, lens, sm_scale, kv_scale):
    """fp64 softmax attention over the gathered pages, bottom-right causal."""
    B, s_q, H, _ = q.shape
    page = kv.shape[1]
    out = torch.zeros(B, s_q, H, 512, dtype=torch.float64, device=q.device)
    lse = torch.full((B, s_q, H), -math.inf, dtype=torch.float64, device=q.device)
    for b in range(B):
        L = int(lens[b])
        if L == 0:
            continue
        npg = -(-L // page)
        rows = kv[page_table[b, :npg].long()].reshape(-1, 576)[:L].to(torch.float64) * kv_scale
        s = torch.einsum("shd,td->sht", q[b].to(torch.float64), rows) * sm_scale
        lim = L - s_q + torch.arange(s_q, device=q.device) + 1  # [s_q]
        mask = torch.arange(L, device=q.device)[None, :] >= lim[:, None]  # [s_q, L]
        s = s.masked_fill(mask[:, None, :], -math.inf)
        m = torch.logsumexp(s, dim=-1)  # [s_q, H]
        p = torch.exp(s - m[..., None])
        p = torch.nan_to_num(p, nan=0.0)
        out[b] = torch.einsum("sht,td->shd", p, rows[:, :512])
        lse[b] = m
    return out, lse


def run_kernel(case, out, lse, sched=None, ws=None, decode=None, partial_dtype=torch.float32):
    """One decode of `case` with `decode` (default: mla_decode_sm90; the WGMMA tests pass theirs); a workspace of
    `partial_dtype` partials when none is given."""
    from mla_cute_dsl.kernels import alloc_workspace, make_schedule, mla_decode_sm90

    decode = decode or mla_decode_sm90
    q = case["q"]
    B, s_q, H, _ = q.shape
    if sched is None:
        n_sm = torch.cuda.get_device_properties(0).multi_processor_count
        sched = make_schedule(case["lens_cpu"], s_q, H, n_sm)
        ws = alloc_workspace(sched, partial_dtype=partial_dtype)
        for part in ws:  # split partials the kernel fails to write must not pass as old memory
            part.fill_(float("nan"))
    decode(q, case["kv"], case["page_table"], case["lens"], case["sm_scale"], case["kv_scale"], out, lse, sched, ws)
    return sched, ws


def check(case, out, lse, tol=1e-2):
    ref_o, ref_l = reference(case["q"], case["kv"], case["page_table"], case["lens"],
                             case["sm_scale"], case["kv_scale"])
    assert not torch.isnan(out).any(), "NaN in out"
    assert not torch.isnan(lse).any(), "NaN in lse"
    o = out.to(torch.float64)
    err = (o - ref_o).norm() / ref_o.norm().clamp_min(1e-30)
    assert err < tol, f"rel err {err:.3e}"
    empty = torch.isinf(ref_l)
    assert torch.equal(torch.isinf(lse) & (lse < 0), empty), "lse -inf pattern differs"
    assert (o[empty] == 0).all(), "rows that see nothing must be 0"
    fin = ~empty
    if fin.any():
        dl = (lse.to(torch.float64)[fin] - ref_l[fin]).abs()
        assert (dl <= 2e-3 * ref_l[fin].abs() + 2e-2).all(), f"lse err max {dl.max():.3e}"
    return float(err)


_rng = random.Random(1234)
_ALL = list(itertools.product([1, 2, 6, 64], [1, 2, 4, 8], [1, 20, 140, 4096],
                              [1, 3, 8, 16, 63, 64, 126, 128],
                              ["bf16", "fp8"], [False, True]))
_SAMPLE = _rng.sample(_ALL, 40)
# keep big cells bounded: B=64 with S=4096 and many rows makes the fp64 reference slow
_SAMPLE = [c for c in _SAMPLE if not (c[0] == 64 and c[2] == 4096 and c[1] * c[3] > 64)]
_FIXED = [
    (1, 1, 4096, 16, "bf16", False), (1, 1, 4096, 16, "fp8", False),
    (64, 1, 4096, 16, "fp8", True), (2, 2, 140, 126, "bf16", True),
    (2, 8, 140, 128, "fp8", True), (6, 4, 20, 63, "bf16", True),
    (2, 2, 4096, 128, "bf16", False), (6, 1, 1, 1, "fp8", False),
]
CASES = _FIXED + _SAMPLE


@needs_sm90
@pytest.mark.parametrize("B,s_q,S,H,kv,varlen", CASES)
def test_against_fp64_reference(B, s_q, S, H, kv, varlen):
    kv_dtype = torch.float8_e4m3fn if kv == "fp8" else torch.bfloat16
    seed = random.randrange(1 << 30)
    case = make_case(B, s_q, H, S, kv_dtype, varlen, seed=seed)
    out = torch.full((B, s_q, H, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    lse = torch.full((B, s_q, H), float("nan"), dtype=torch.float32, device="cuda")
    run_kernel(case, out, lse)
    torch.cuda.synchronize()
    check(case, out, lse)


@needs_sm90
@pytest.mark.parametrize("kv", ["bf16", "fp8"])
@pytest.mark.parametrize("B,s_q,H,S", [(1, 1, 16, 4096), (2, 2, 64, 4096), (6, 4, 3, 140)])
def test_large_magnitude_q(B, s_q, H, S, kv):
    kv_dtype = torch.float8_e4m3fn if kv == "fp8" else torch.bfloat16
    case = make_case(B, s_q, H, S, kv_dtype, varlen=False, q_std=100.0, seed=random.randrange(1 << 30))
    out = torch.full((B, s_q, H, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    lse = torch.full((B, s_q, H), float("nan"), dtype=torch.float32, device="cuda")
    run_kernel(case, out, lse)
    torch.cuda.synchronize()
    check(case, out, lse, tol=2e-2)


@needs_sm90
@pytest.mark.parametrize("kv", ["bf16", "fp8"])
def test_graph_replay_equals_eager(kv):
    kv_dtype = torch.float8_e4m3fn if kv == "fp8" else torch.bfloat16
    B, s_q, H, S = 6, 2, 16, 1000
    case = make_case(B, s_q, H, S, kv_dtype, varlen=True, seed=random.randrange(1 << 30))
    out = torch.full((B, s_q, H, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    lse = torch.full((B, s_q, H), float("nan"), dtype=torch.float32, device="cuda")
    sched, ws = run_kernel(case, out, lse)  # warm up (compile) outside capture
    graph_replay_equals_eager(lambda: run_kernel(case, out, lse, sched, ws), out, lse,
                              refresh=lambda: fresh_values(case["q"]), check=lambda o, l: check(case, o, l),
                              scratch=ws)


@needs_sm90
@pytest.mark.parametrize("partial", ["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["row", "wide", "chunked"])
@pytest.mark.parametrize("B,s_q,S,H,kv,varlen,q_std", [
    (1, 1, 16384, 16, "fp8", False, 1.0), (1, 2, 4096, 128, "bf16", False, 1.0),
    (2, 4, 4096, 3, "bf16", True, 1.0), (6, 1, 140, 63, "fp8", True, 1.0),
    (1, 1, 4096, 16, "bf16", False, 100.0), (64, 1, 4096, 16, "fp8", True, 1.0),
])
def test_each_combine_kernel_against_fp64_reference(monkeypatch, partial, kind, B, s_q, S, H, kv, varlen, q_std):
    """Every combine kernel on the same kinds of input, whatever the schedule would pick: the wide one (warps
    share out the splits), the per-row one and the chunked per-row one (four warps per row), with lengths 0 and
    < s_q, NaN-poisoned split buffers; fp32 and bf16 partials (alloc_workspace partial_dtype)."""
    from mla_cute_dsl.kernels import api, schedule

    monkeypatch.setattr(schedule, "combine_kind_for", lambda *args: kind)
    picked = []
    real = api.get_combine_kernel
    monkeypatch.setattr(api, "get_combine_kernel",
                        lambda q, wide=False, pdl=False, partial="fp32", cols=512:
                        picked.append((wide, cols)) or real(q, wide, pdl, partial, cols))
    kv_dtype = torch.float8_e4m3fn if kv == "fp8" else torch.bfloat16
    case = make_case(B, s_q, H, S, kv_dtype, varlen, q_std=q_std, seed=random.randrange(1 << 30))
    out = torch.full((B, s_q, H, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    lse = torch.full((B, s_q, H), float("nan"), dtype=torch.float32, device="cuda")
    run_kernel(case, out, lse, partial_dtype=api.PARTIAL_DTYPES[partial])
    torch.cuda.synchronize()
    assert picked == [{"row": (False, 512), "wide": (True, 512), "chunked": (False, 128)}[kind]]
    check(case, out, lse, tol=2e-2 if q_std > 1 else 1e-2)
