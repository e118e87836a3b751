"""The conformance suite every backend package runs against itself.

Subclass `BackendConformance` in a test module of the backend's package and
set what to test; pytest collects the inherited tests::

    from mlacore.testing.conformance import BackendConformance

    class TestFlashInferFa3(BackendConformance):
        backend = "flashinfer_mla"
        options = {"variant": "fa3"}
        device = "cuda"

Each test runs the backend through `MLADecoder` (the path an engine takes),
on fresh random inputs with NaN-poisoned unused pages and page tails and
NaN-poisoned outputs, and compares with the fp64 oracle. Shapes the backend
refuses (its own can_implement or limits) are skipped cell by cell; a test
fails if the backend takes none of its cells. CUDA-only tests skip on CPU.
"""

from __future__ import annotations

from typing import Any, ClassVar, Dict, List, Optional, Sequence, Tuple

import pytest
import torch

from ..decoder import MLADecoder
from ..dispatch import Dispatcher
from ..errors import PolicyError, StalePlanError
from ..policy import parse_policy
from ..problem import DecodeProblem, DeviceSpec, torch_dtype
from .compare import CheckResult, compare, only_backend_dispatcher, reference_outputs
from .inputs import DecodeInputs, make_inputs


class BackendConformance:
    """The plan/run contract, checked cell by cell against the fp64 oracle."""

    backend: ClassVar[str] = ""
    options: ClassVar[Dict[str, Any]] = {}
    device: ClassVar[str] = "cpu"
    # axes of the correctness grid (kept small: the suite runs in CI for CPU backends)
    num_heads: ClassVar[Sequence[int]] = (1, 16, 128)
    seq_lens_q: ClassVar[Sequence[int]] = (1, 2, 4)
    page_sizes: ClassVar[Sequence[int]] = (1, 16, 64)
    kv_dtypes: ClassVar[Sequence[str]] = ("bf16", "fp8_e4m3")
    q_dtype: ClassVar[str] = "bf16"
    max_kv_len: ClassVar[int] = 300
    # False for kernels that write no LSE (CUTLASS MLA): problems and decoders ask for none, runs pass lse=None
    return_lse: ClassVar[bool] = True
    # heads of the suite's single-cell tests (large q, graph replay, plan reuse, ...): a backend path that
    # takes only many query rows (a 64-row MMA tile) sets it higher so those tests do not all skip
    single_cell_heads: ClassVar[int] = 16

    # -- helpers -----------------------------------------------------------
    def _require_device(self) -> None:
        if self.device == "cuda" and not torch.cuda.is_available():
            pytest.skip("needs a CUDA GPU")

    def dispatcher(self) -> Dispatcher:
        return only_backend_dispatcher(self.backend, options=self.options or None)

    def problem(self, **kw: Any) -> DecodeProblem:
        # page 16 and the first cache dtype of the class: the suite's single-cell tests must not all skip for a
        # backend that takes only larger pages or other cache dtypes
        page = 16 if 16 in self.page_sizes else self.page_sizes[-1]
        base = dict(num_heads=self.single_cell_heads, seq_len_q=1, batch_size=3, min_kv_len=0,
                    max_kv_len=self.max_kv_len,
                    page_size=page, q_dtype=self.q_dtype, kv_dtype=self.kv_dtypes[0],
                    device=DeviceSpec.of(self.device), return_lse=self.return_lse)
        base.update(kw)
        return DecodeProblem(**base)

    def takes(self, dispatcher: Dispatcher, problem: DecodeProblem) -> bool:
        return dispatcher.explain(problem).backend == self.backend

    def decoder(self, problem: DecodeProblem, inputs: DecodeInputs, dispatcher: Dispatcher,
                **kw: Any) -> MLADecoder:
        return MLADecoder(problem.num_heads, problem.page_size, q_dtype=torch_dtype(problem.q_dtype),
                          kv_dtype=torch_dtype(problem.kv_dtype), device=self.device, sm_scale=inputs.sm_scale,
                          kv_scale=inputs.kv_scale, causal=problem.causal, return_lse=problem.return_lse,
                          dispatcher=dispatcher, **kw)

    def run_poisoned(self, decoder: MLADecoder, plan: Any, inputs: DecodeInputs,
                     problem: DecodeProblem) -> Tuple[torch.Tensor, torch.Tensor]:
        out = torch.full((*inputs.q.shape[:3], problem.kv_lora_rank), float("nan"), dtype=inputs.q.dtype,
                         device=inputs.q.device)
        lse = None
        if problem.return_lse:
            lse = torch.full(inputs.q.shape[:3], float("nan"), dtype=torch.float32, device=inputs.q.device)
        decoder.run(inputs.q, inputs.kv_cache, plan, out=out, lse=lse)
        return out, lse

    def check_once(self, problem: DecodeProblem, inputs: DecodeInputs,
                   dispatcher: Optional[Dispatcher] = None) -> CheckResult:
        dispatcher = dispatcher or self.dispatcher()
        with self.decoder(problem, inputs, dispatcher) as decoder:
            plan = decoder.plan(inputs.kv_lens, inputs.page_table, problem.seq_len_q)
            assert plan.backend == self.backend, plan.decision.format_trace()
            out, lse = self.run_poisoned(decoder, plan, inputs, problem)
        return compare(problem, out, lse, *reference_outputs(problem, inputs))

    def grid(self) -> List[DecodeProblem]:
        cells = []
        for h in self.num_heads:
            for s_q in self.seq_lens_q:
                for page in self.page_sizes:
                    for kv in self.kv_dtypes:
                        cells.append(self.problem(num_heads=h, seq_len_q=s_q, page_size=page, kv_dtype=kv,
                                                  min_kv_len=0 if page != 64 else 1))
        return cells

    # -- the suite -----------------------------------------------------------
    def test_matches_fp64_reference_over_the_grid(self) -> None:
        """Every cell the backend takes: every output element written, close to the oracle."""
        self._require_device()
        dispatcher = self.dispatcher()
        ran, failures = 0, []
        for i, problem in enumerate(self.grid()):
            if not self.takes(dispatcher, problem):
                continue
            res = self.check_once(problem, make_inputs(problem, self.device, seed=100 + i), dispatcher)
            ran += 1
            if not res.passed:
                failures.append(f"{problem.describe()}: {'; '.join(res.messages)}")
        assert ran, f"{self.backend} took none of the {len(self.grid())} grid cells"
        assert not failures, "\n".join(failures)

    def test_zero_lengths_and_lengths_shorter_than_s_q(self) -> None:
        self._require_device()
        dispatcher = self.dispatcher()
        for s_q in (1, 4):
            problem = self.problem(seq_len_q=s_q, batch_size=5, min_kv_len=0, max_kv_len=90)
            if not self.takes(dispatcher, problem):
                continue
            lens = torch.tensor([0, 90, 1, 3, 0], dtype=torch.int32)
            inputs = make_inputs(problem, self.device, seed=7 + s_q, kv_lens=lens)
            res = self.check_once(problem, inputs, dispatcher)
            assert res.passed, (s_q, res.messages)

    def test_large_magnitude_queries(self) -> None:
        """q with std 100 (a known split-KV failure mode: wrong O and LSE)."""
        self._require_device()
        dispatcher = self.dispatcher()
        problem = self.problem(num_heads=self.single_cell_heads, batch_size=2, min_kv_len=200,
                               max_kv_len=self.max_kv_len)
        if not self.takes(dispatcher, problem):
            pytest.skip(f"{self.backend} does not take {problem.describe()}")
        inputs = make_inputs(problem, self.device, seed=11)
        inputs.q = (inputs.q.float() * 100).to(inputs.q.dtype)
        res = self.check_once(problem, inputs, dispatcher)
        assert res.passed, res.messages

    def test_plan_is_reused_by_every_layer_and_stale_plans_are_refused(self) -> None:
        self._require_device()
        dispatcher = self.dispatcher()
        problem = self.problem(batch_size=3, min_kv_len=1)
        if not self.takes(dispatcher, problem):
            pytest.skip(f"{self.backend} does not take {problem.describe()}")
        inputs = make_inputs(problem, self.device, seed=3)
        ref = reference_outputs(problem, inputs)
        other = self.decoder(problem, inputs, dispatcher)
        with self.decoder(problem, inputs, dispatcher) as decoder:
            plan = decoder.plan(inputs.kv_lens, inputs.page_table, problem.seq_len_q)
            for _ in range(3):  # one plan, several layers
                assert compare(problem, *self.run_poisoned(decoder, plan, inputs, problem), *ref).passed
            decoder.plan(inputs.kv_lens, inputs.page_table, problem.seq_len_q)
            with pytest.raises(StalePlanError, match="replaced by a later plan"):
                decoder.run(inputs.q, inputs.kv_cache, plan)
            foreign = other.plan(inputs.kv_lens, inputs.page_table, problem.seq_len_q)
            with pytest.raises(StalePlanError, match="another MLADecoder"):
                decoder.run(inputs.q, inputs.kv_cache, foreign)
        other.close()
        with pytest.raises(StalePlanError):
            decoder.run(inputs.q, inputs.kv_cache, plan)

    def test_outputs_the_decoder_allocates_are_not_kept_alive(self) -> None:
        """out/lse that run allocates belong to the caller: once the caller drops them, nothing the backend
        remembered (a view of them, their storage, a view of a detached alias) may keep their memory.
        torch.compile's CUDA graphs (mode="reduce-overhead") refuse a run op whose outputs stay alive in
        their pool; what they check is the storage, and so does this test."""
        import gc

        from torch.multiprocessing.reductions import StorageWeakRef

        self._require_device()
        dispatcher = self.dispatcher()
        problem = self.problem(batch_size=3, min_kv_len=1)
        if not self.takes(dispatcher, problem):
            pytest.skip(f"{self.backend} does not take {problem.describe()}")
        inputs = make_inputs(problem, self.device, seed=5)
        with self.decoder(problem, inputs, dispatcher) as decoder:
            plan = decoder.plan(inputs.kv_lens, inputs.page_table, problem.seq_len_q)
            for layer in range(3):  # several layers, each with outputs the decoder allocates
                out, lse = decoder.run(inputs.q, inputs.kv_cache, plan)
                if self.device == "cuda":
                    torch.cuda.synchronize()
                storages = [StorageWeakRef(t.untyped_storage()) for t in (out, lse) if t is not None]
                del out, lse
                gc.collect()
                alive = [i for i, ref in enumerate(storages) if not ref.expired()]
                assert not alive, (f"{self.backend}: the memory of run's output(s) {alive} (0: out, 1: lse) "
                                   f"outlives the caller's last reference (layer {layer})")

    def test_unknown_option_is_a_policy_error(self) -> None:
        data = {"mla": {"order": [self.backend], "fallback": "error"},
                "backend": {self.backend: {"options": {**self.options, "no_such_option_xyz": 1}}}}
        with pytest.raises(PolicyError, match=f"backend.{self.backend}.options.no_such_option_xyz"):
            Dispatcher(policy=parse_policy(data, "<conformance>"), env={})

    def test_graph_mode_replay_after_replan_equals_eager(self) -> None:
        """Capture run once, re-plan with new lengths (same batch), replay: equals eager and the oracle."""
        if self.device != "cuda" or not torch.cuda.is_available():
            pytest.skip("CUDA graphs need a CUDA GPU")
        self._require_device()  # a class for another GPU generation must not run (and pass) here
        dispatcher = self.dispatcher()
        page = self.page_sizes[-1]
        problem = self.problem(num_heads=self.single_cell_heads, seq_len_q=2, batch_size=4, min_kv_len=1,
                               max_kv_len=400, page_size=page)
        if not self.takes(dispatcher, problem):
            pytest.skip(f"{self.backend} does not take {problem.describe()}")
        first = make_inputs(problem, self.device, seed=21, extra_pages=4 * -(-512 // page) + 8)
        decoder = self.decoder(problem, first, dispatcher, cuda_graph=True, max_batch=8, max_kv_len=512)
        plan = decoder.plan(first.kv_lens, first.page_table, problem.seq_len_q)
        out = torch.full((*first.q.shape[:3], problem.kv_lora_rank), float("nan"), dtype=first.q.dtype,
                         device="cuda")
        lse = (torch.full(first.q.shape[:3], float("nan"), dtype=torch.float32, device="cuda")
               if problem.return_lse else None)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            decoder.run(first.q, first.kv_cache, plan, out=out, lse=lse)  # warm-up outside capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            decoder.run(first.q, first.kv_cache, plan, out=out, lse=lse)
        # a new step: same batch, new lengths and a reshuffled table over the same cache
        gen = torch.Generator().manual_seed(5)
        lens2 = torch.randint(1, 500, (4,), generator=gen, dtype=torch.int32)
        pages = first.kv_cache.shape[0]
        width = -(-512 // page)
        table2 = torch.randperm(pages, generator=gen)[: 4 * width].reshape(4, width).to(torch.int32)
        cache2 = torch.randn(first.kv_cache.shape, generator=gen).to(first.kv_cache.dtype).to("cuda")
        first.kv_cache.copy_(cache2)
        decoder.plan(lens2.cuda(), table2.cuda(), problem.seq_len_q)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        second = DecodeInputs(q=first.q, kv_cache=first.kv_cache, page_table=table2.cuda(), kv_lens=lens2.cuda(),
                              kv_scale=first.kv_scale, sm_scale=first.sm_scale)
        p2 = problem.model_copy(update={"min_kv_len": int(lens2.min()), "max_kv_len": int(lens2.max())})
        res = compare(p2, out, lse, *reference_outputs(p2, second))
        assert res.passed, res.messages
        eager = self.check_once(p2, second, dispatcher)
        assert eager.passed, eager.messages
        decoder.close()


__all__ = ["BackendConformance"]
