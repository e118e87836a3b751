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


def test_the_kept_alive_check_catches_a_backend_that_remembers_its_output(monkeypatch):
    """The conformance check must fail a backend that keeps any alias of run's output: here a view of a
    detached alias (weak references to the tensors themselves would miss it: the alias holds only the
    storage), which is what held a CUDA-graph pool buffer alive in the FlashInfer plugin."""
    import pytest

    from mlacore.reference_math import ReferencePlanned

    memo = {}
    original = ReferencePlanned.run

    def remembering_run(self, q, kv_cache, out, lse, *args):
        memo["last"] = out.detach().view(-1)
        return original(self, q, kv_cache, out, lse, *args)

    monkeypatch.setattr(ReferencePlanned, "run", remembering_run)
    with pytest.raises(AssertionError, match="outlives the caller's last reference"):
        TestReferenceConformance().test_outputs_the_decoder_allocates_are_not_kept_alive()
    monkeypatch.undo()
    memo.clear()
    TestReferenceConformance().test_outputs_the_decoder_allocates_are_not_kept_alive()  # and passes without
