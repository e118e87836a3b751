"""The conformance suite for `reference` on a CUDA GPU (graph replay after a re-plan included)."""

import pytest

from mlacore.testing.conformance import BackendConformance

pytestmark = pytest.mark.gpu


class TestReferenceConformanceCuda(BackendConformance):
    backend = "reference"
    device = "cuda"
    num_heads = (1, 16, 128)
    seq_lens_q = (1, 4)
    page_sizes = (1, 64)
