"""The reference backend on CUDA (skipped without a GPU)."""

import pytest

from mlacore.testing import check_backend
from mlacore.problem import DecodeProblem, DeviceSpec

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8_e4m3"])
@pytest.mark.parametrize("s_q", [1, 2, 4])
def test_reference_on_cuda_matches_fp64(kv_dtype, s_q):
    problem = DecodeProblem(num_heads=16, seq_len_q=s_q, batch_size=5, min_kv_len=0, max_kv_len=700,
                            page_size=64, kv_dtype=kv_dtype, device=DeviceSpec.of("cuda"))
    res = check_backend("reference", problem, device="cuda", seed=s_q)
    assert res.passed, res.messages
