"""The reference backend against an independent, dense float64 computation."""

import math

import pytest
import torch

from mlacore.inputs import make_inputs
from mlacore.problem import DecodeProblem
from mlacore.reference import mla_decode_reference


def dense_fp64(q, cache, table, lens, sm_scale, kv_scale, causal=True):
    """Token-by-token gather, full score matrix, torch.softmax: no chunks, no online softmax."""
    B, s_q, H, D = q.shape
    page = cache.shape[1]
    out = torch.zeros(B, s_q, H, 512, dtype=torch.float64)
    lse = torch.full((B, s_q, H), -math.inf, dtype=torch.float64)
    for b in range(B):
        L = int(lens[b])
        if L == 0:
            continue
        rows = [cache[int(table[b, t // page]), t % page] for t in range(L)]
        kv = torch.stack(rows).double() * kv_scale
        for i in range(s_q):
            visible = L - s_q + i + 1 if causal else L
            if visible <= 0:
                continue
            s = q[b, i].double() @ kv[:visible].T * sm_scale  # [H, visible]
            out[b, i] = torch.softmax(s, dim=-1) @ kv[:visible, :512]
            lse[b, i] = torch.logsumexp(s, dim=-1)
    return out, lse


@pytest.mark.parametrize("heads", [1, 16, 128])
@pytest.mark.parametrize("s_q", [1, 2, 4])
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8_e4m3"])
def test_reference_matches_dense_fp64(heads, s_q, kv_dtype):
    problem = DecodeProblem(num_heads=heads, seq_len_q=s_q, batch_size=4, min_kv_len=0, max_kv_len=75,
                            page_size=16, kv_dtype=kv_dtype)
    inp = make_inputs(problem, seed=heads * 10 + s_q)
    lens = inp.kv_lens.tolist()
    assert 0 in lens and any(n % 16 for n in lens)  # zero and non-multiple lengths are exercised
    out, lse = mla_decode_reference(inp.q, inp.kv_cache, inp.page_table, inp.kv_lens, inp.sm_scale,
                                    inp.kv_scale, chunk_tokens=32)  # several chunks per request
    ref_out, ref_lse = dense_fp64(inp.q, inp.kv_cache, inp.page_table, lens, inp.sm_scale, inp.kv_scale)
    assert torch.isfinite(out).all()  # NaN-poisoned pages were never read
    err = (out.double() - ref_out).norm() / ref_out.norm()
    assert err < 5e-3  # bf16 output rounding
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert (lse[finite].double() - ref_lse[finite]).abs().max() < 1e-4


def test_zero_length_gives_zero_output_and_minus_inf_lse():
    problem = DecodeProblem(num_heads=2, batch_size=2, min_kv_len=0, max_kv_len=5, page_size=4)
    inp = make_inputs(problem, seed=3, kv_lens=torch.tensor([0, 5]))
    out, lse = mla_decode_reference(inp.q, inp.kv_cache, inp.page_table, inp.kv_lens, 0.1)
    assert torch.all(out[0] == 0)
    assert torch.all(lse[0] == -math.inf)
    assert torch.all(torch.isfinite(lse[1]))


def test_causal_rows_shorter_than_s_q():
    # L=2 with s_q=4: query 0 sees nothing, query 1 nothing, query 2 one token, query 3 two
    problem = DecodeProblem(num_heads=3, seq_len_q=4, batch_size=1, min_kv_len=2, max_kv_len=2, page_size=4)
    inp = make_inputs(problem, seed=5)
    out, lse = mla_decode_reference(inp.q, inp.kv_cache, inp.page_table, inp.kv_lens, 0.1)
    assert torch.all(lse[0, :2] == -math.inf) and torch.all(out[0, :2] == 0)
    first_token_v = inp.kv_cache[int(inp.page_table[0, 0]), 0, :512]
    torch.testing.assert_close(out[0, 2].float(), first_token_v.float().expand(3, 512), rtol=1e-2, atol=1e-2)


def test_non_causal_sees_everything():
    problem = DecodeProblem(num_heads=2, seq_len_q=2, batch_size=2, min_kv_len=9, max_kv_len=30,
                            page_size=8, causal=False)
    inp = make_inputs(problem, seed=9)
    out, lse = mla_decode_reference(inp.q, inp.kv_cache, inp.page_table, inp.kv_lens, 0.1, causal=False)
    ref_out, ref_lse = dense_fp64(inp.q, inp.kv_cache, inp.page_table, inp.kv_lens.tolist(), 0.1, 1.0,
                                  causal=False)
    assert (out.double() - ref_out).norm() / ref_out.norm() < 5e-3


def test_chunking_does_not_change_the_answer():
    problem = DecodeProblem(num_heads=8, seq_len_q=2, batch_size=2, min_kv_len=300, max_kv_len=1000,
                            page_size=64, q_dtype="fp32", kv_dtype="fp32")
    inp = make_inputs(problem, seed=11)
    a = mla_decode_reference(inp.q, inp.kv_cache, inp.page_table, inp.kv_lens, 0.1, chunk_tokens=4096)
    b = mla_decode_reference(inp.q, inp.kv_cache, inp.page_table, inp.kv_lens, 0.1, chunk_tokens=77)
    torch.testing.assert_close(a[0], b[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(a[1], b[1], rtol=1e-5, atol=1e-5)


def test_any_page_size_including_one():
    problem = DecodeProblem(num_heads=4, seq_len_q=1, batch_size=3, min_kv_len=1, max_kv_len=20, page_size=1)
    inp = make_inputs(problem, seed=2)
    out, _ = mla_decode_reference(inp.q, inp.kv_cache, inp.page_table, inp.kv_lens, 0.1)
    ref_out, _ = dense_fp64(inp.q, inp.kv_cache, inp.page_table, inp.kv_lens.tolist(), 0.1, 1.0)
    assert (out.double() - ref_out).norm() / ref_out.norm() < 5e-3


def test_long_sequence_memory_is_bounded():
    """B=128, S=32768 would need 2 GB of fp32 scores at once for H=128; chunks keep it small.

    Check the mechanism on one request: with chunk_tokens=4096 the largest
    score block is [H, 4096], independent of S.
    """

    shapes = []
    orig = torch.Tensor.__matmul__

    def spy(a, b):
        r = orig(a, b)
        shapes.append(tuple(r.shape))
        return r

    problem = DecodeProblem(num_heads=128, batch_size=1, min_kv_len=20000, max_kv_len=20000, page_size=64,
                            q_dtype="fp32", kv_dtype="fp32")
    inp = make_inputs(problem, seed=1, poison=False)
    torch.Tensor.__matmul__ = spy
    try:
        mla_decode_reference(inp.q, inp.kv_cache, inp.page_table, inp.kv_lens, 0.1, chunk_tokens=4096)
    finally:
        torch.Tensor.__matmul__ = orig
    assert max(s[1] for s in shapes if s[0] == 128 and s[1] != 512) == 4096
