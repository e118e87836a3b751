"""`mla bench`'s graph targets on a GPU: a prepared target keeps what its captured calls write alive."""

import gc

import pytest
import torch

from mlacore.tools.bench import GraphReplay, prepare_target

pytestmark = pytest.mark.gpu


def test_a_prepared_graph_keeps_the_buffer_its_replays_write_alive():
    """mlacore 0.2.2 kept only graph.replay: the function (and the output buffer it closed over) was freed after
    capture, the next allocation got the buffer's memory and every replay wrote into it (three backends in an
    interleaved `mla bench` cell ended in illegal-address errors on an H200)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")

    def make():
        out = torch.zeros(1 << 20, device="cuda")

        def fn():
            out.add_(1.0)

        return fn

    target, how = prepare_target(make(), "cuda", True)
    assert isinstance(target, GraphReplay) and how.startswith("cuda graph replay")
    torch.cuda.synchronize()
    gc.collect()
    other = torch.zeros(1 << 20, device="cuda")  # the freed buffer's block, were the function dropped
    for _ in range(3):
        target()
    torch.cuda.synchronize()
    assert int(other.count_nonzero()) == 0
