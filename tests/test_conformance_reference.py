"""The conformance suite that every backend package runs, run here for `reference` on the CPU."""

from mlacore.testing.conformance import BackendConformance


class TestReferenceConformance(BackendConformance):
    backend = "reference"
    device = "cpu"
    num_heads = (1, 16, 128)
    seq_lens_q = (1, 2, 4)
    page_sizes = (1, 16, 64)


class TestReferenceConformanceFp32(BackendConformance):
    backend = "reference"
    device = "cpu"
    q_dtype = "fp32"
    num_heads = (3,)
    seq_lens_q = (1, 8)
    page_sizes = (16,)
    kv_dtypes = ("fp32",)
