"""The kernel GPU tests' one CUDA-graph check: a captured step replayed on new inputs is correct and bitwise equal
to the same step run eagerly.

Why one helper: every kernel keeps state that a replay must not inherit (mbarrier phases, named barriers, the
tensor map of a TMA load, partial slots, the schedule buffers a re-plan rewrites in place), and each kernel's test
file used to spell the same capture, poison, replay, compare sequence out again. Here it is written once, with
the stricter of the variants that were in use: outputs and scratch buffers are NaN-poisoned before the replay
*and* before the eager call, so a slot that neither writes cannot pass by holding the other's result.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch


def fresh_values(t: torch.Tensor) -> None:
    """New random values in ``t``'s storage (in place: a captured graph keeps reading this buffer)."""
    t.copy_(torch.randn_like(t, dtype=torch.float32).to(t.dtype))


def poison(*tensors: torch.Tensor) -> None:
    """Fill every tensor with NaN, so a value the kernel should have written and did not shows up."""
    for t in tensors:
        t.fill_(float("nan"))


def graph_replay_equals_eager(call: Callable[[], object], out: torch.Tensor, lse: torch.Tensor, *,
                              refresh: Callable[[], object], check: Callable[[torch.Tensor, torch.Tensor], object],
                              scratch: Iterable[torch.Tensor] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """Capture ``call`` (already run once by the caller, so it compiles outside the capture) in a CUDA graph on a
    side stream; ``refresh()`` (new q values, new lengths, a re-plan into the same schedule buffers: whatever the
    replay must pick up); NaN-poison out, lse and ``scratch`` (e.g. the partial buffers); replay and pass the
    replay's outputs to ``check(out, lse)`` (the fp64 reference); poison again, run ``call`` eagerly and assert
    that both are bitwise equal. Returns the replay's (out, lse)."""
    scratch = tuple(scratch)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        with torch.cuda.graph(graph):
            call()
    torch.cuda.current_stream().wait_stream(side)
    refresh()
    poison(out, lse, *scratch)
    graph.replay()
    torch.cuda.synchronize()
    o_graph, l_graph = out.clone(), lse.clone()
    check(o_graph, l_graph)
    poison(out, lse, *scratch)
    call()
    torch.cuda.synchronize()
    assert torch.equal(o_graph, out), "graph replay and eager call differ in out"
    assert torch.equal(l_graph, lse), "graph replay and eager call differ in lse"
    return o_graph, l_graph
