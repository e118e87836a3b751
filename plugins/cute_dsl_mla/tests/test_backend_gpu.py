"""cute_dsl_mla through mlacore on a GPU: the conformance suite (graph replay after a re-plan included)."""

import pytest
import torch

from mlacore.testing.conformance import BackendConformance

pytestmark = pytest.mark.gpu


def _sm90():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the CuTe DSL kernels are sm_90 only")


class TestCuteDslConformance(BackendConformance):
    backend = "cute_dsl_mla"
    device = "cuda"
    num_heads = (1, 3, 16, 64, 126, 128)
    seq_lens_q = (1, 2, 4, 8)
    page_sizes = (64,)
    max_kv_len = 2000

    def _require_device(self):
        _sm90()
