"""cute_dsl_mla through mlacore on a GPU: the conformance suite (graph replay after a re-plan included)."""

import pytest
import torch

from mlacore import MLADecoder
from mlacore.problem import DecodeProblem, DeviceSpec, torch_dtype
from mlacore.testing.compare import compare, only_backend_dispatcher, reference_outputs
from mlacore.testing.conformance import BackendConformance
from mlacore.testing.inputs import DecodeInputs, make_inputs

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


class TestCuteDslWgmmaConformance(TestCuteDslConformance):
    """The WGMMA partial kernel forced through the backend option (auto takes it from s_q*H >= 64),
    bf16 and fp8 KV; shapes it refuses (s_q*H <= 32) are skipped with the backend's reason."""

    options = {"mma": "wgmma"}
    num_heads = (16, 63, 64, 126, 128)
    single_cell_heads = 128  # the suite's default H=16 gives 16 rows: refused by design


class TestCuteDslWgmmaFp16Conformance(TestCuteDslWgmmaConformance):
    q_dtype = "fp16"
    kv_dtypes = ("fp16", "fp8_e4m3")


class TestCuteDslSeesawConformance(TestCuteDslConformance):
    """The seesaw WGMMA schedule forced (auto takes it from 128 rows), bf16 and fp16 q, a cache in q's dtype
    or fp8; shapes it refuses (s_q*H <= 32) are skipped with the backend's reason."""

    options = {"mma": "seesaw"}
    num_heads = (16, 63, 64, 126, 128)
    kv_dtypes = ("bf16", "fp8_e4m3")
    single_cell_heads = 128


class TestCuteDslSeesawFp16Conformance(TestCuteDslSeesawConformance):
    q_dtype = "fp16"
    kv_dtypes = ("fp16", "fp8_e4m3")


class TestCuteDslFp8RegConformance(TestCuteDslConformance):
    """The fp8-register kernel forced (auto takes it for fp8 caches up to 32 rows), two CTAs per SM;
    shapes it refuses (bf16 KV, s_q*H > 32) are skipped with the backend's reason."""

    options = {"mma": "fp8reg"}
    num_heads = (1, 3, 8, 16, 32)
    kv_dtypes = ("fp8_e4m3",)


class TestCuteDslWgmmaTConformance(TestCuteDslConformance):
    """The transposed WGMMA kernel forced (never auto's choice), bf16 and fp8 caches up to 32 rows; shapes it
    refuses (s_q*H > 32) are skipped with the backend's reason. With the bf16 cache this is its balanced mode
    (split_kv=balanced, the default), with fp8 its even split."""

    options = {"mma": "wgmma_t"}
    num_heads = (1, 3, 8, 16, 32)
    kv_dtypes = ("bf16", "fp8_e4m3")


class TestCuteDslWgmmaTEvenConformance(TestCuteDslConformance):
    """mma=wgmma_t with split_kv=even: its even entry with a bf16 cache (the class above runs its balanced mode
    there, split_kv=balanced being the default; an fp8 cache always splits evenly)."""

    options = {"mma": "wgmma_t", "split_kv": "even"}
    num_heads = (3, 16, 32)
    kv_dtypes = ("bf16",)


class TestCuteDslMmaSyncConformance(TestCuteDslConformance):
    """The mma.sync kernel forced at every shape (auto now routes most shapes elsewhere)."""

    options = {"mma": "mma_sync"}
    num_heads = (1, 16, 64, 128)
    seq_lens_q = (1, 2, 8)


class TestCuteDslFewerSmsConformance(TestCuteDslConformance):
    """Option num_sms below the GPU's count (schedules for 100 SMs: other kernels holding SMs), every kernel
    auto picks (mma.sync balanced, fp8reg, WGMMA, seesaw)."""

    options = {"num_sms": 100}
    num_heads = (3, 16, 128)
    kv_dtypes = ("bf16", "fp8_e4m3")


class TestCuteDslEvenSplitConformance(TestCuteDslConformance):
    """split_kv=even: the mma.sync kernel's even split (the default before 0.2.3, which made the balanced
    kernel with the hybrid plan the default), at the head counts where auto runs the mma.sync kernel."""

    options = {"split_kv": "even"}
    num_heads = (1, 3, 8, 16, 32)
    kv_dtypes = ("bf16",)


# -- mma=auto's batch rule (wgmma_t for a 16-bit cache at 17-32 rows from batch 32) --------------------------
# The conformance suite plans batches 2-5 only (no class attribute sets them), below the rule's threshold, so
# these tests exercise it directly: eager plans against the oracle and CUDA graphs captured at both sides.

WGMMA_T_RUN, MMA_SYNC_RUN = "mla_decode_sm90_wgmma_t_balanced", "mla_decode_sm90_balanced"


def _auto_problem(heads, s_q, batch, dtype="bf16", max_kv_len=600):
    return DecodeProblem(num_heads=heads, seq_len_q=s_q, batch_size=batch, min_kv_len=1, max_kv_len=max_kv_len,
                         page_size=64, q_dtype=dtype, kv_dtype=dtype, device=DeviceSpec.of("cuda"))


def _auto_decoder(problem, inputs, **kw):
    return MLADecoder(problem.num_heads, problem.page_size, q_dtype=torch_dtype(problem.q_dtype),
                      kv_dtype=torch_dtype(problem.kv_dtype), device="cuda", sm_scale=inputs.sm_scale,
                      kv_scale=inputs.kv_scale, dispatcher=only_backend_dispatcher("cute_dsl_mla"), **kw)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("heads,s_q", [(16, 2), (3, 8), (17, 1), (24, 1), (16, 1)])
@pytest.mark.parametrize("batch", [8, 31, 32, 64])
def test_auto_runs_wgmma_t_from_batch_32_at_17_to_32_rows_and_matches_the_oracle(dtype, heads, s_q, batch):
    _sm90()
    problem = _auto_problem(heads, s_q, batch, dtype)
    inputs = make_inputs(problem, "cuda", seed=batch * 100 + heads)
    want = WGMMA_T_RUN if 16 < heads * s_q <= 32 and batch >= 32 else MMA_SYNC_RUN
    with _auto_decoder(problem, inputs) as decoder:
        plan = decoder.plan(inputs.kv_lens, inputs.page_table, s_q)
        assert plan.planned.run_fn.__name__ == want
        out = torch.full((*inputs.q.shape[:3], 512), float("nan"), dtype=inputs.q.dtype, device="cuda")
        lse = torch.full(inputs.q.shape[:3], float("nan"), dtype=torch.float32, device="cuda")
        decoder.run(inputs.q, inputs.kv_cache, plan, out=out, lse=lse)
    res = compare(problem, out, lse, *reference_outputs(problem, inputs))
    assert res.passed, res.messages


def test_auto_graphs_captured_at_batch_64_and_8_replay_their_kernels_after_replans():
    """One graph decoder (envelope batch 64): a graph captured at B=64 (wgmma_t) and one at B=8 (mma.sync),
    H16 s_q2 bf16, share the session's schedule buffers of s_q=2; plans with new lengths at 64, 8, 64, each
    followed by its batch's replay, match the oracle."""
    _sm90()
    s_q, width, gen = 2, 8, torch.Generator().manual_seed(7)
    base = _auto_problem(16, s_q, 64, max_kv_len=512)
    shared = make_inputs(base, "cuda", seed=3, extra_pages=64 * width + 8)
    pages = shared.kv_cache.shape[0]
    decoder = _auto_decoder(base, shared, cuda_graph=True, max_batch=64, max_kv_len=512)
    graphs = {}
    for batch, want in ((64, WGMMA_T_RUN), (8, MMA_SYNC_RUN)):
        q = shared.q[:batch].contiguous()
        lens, table = shared.kv_lens[:batch], shared.page_table[:batch]
        plan = decoder.plan(lens, table, s_q)
        assert plan.planned.run_fn.__name__ == want
        out = torch.full((*q.shape[:3], 512), float("nan"), dtype=q.dtype, device="cuda")
        lse = torch.full(q.shape[:3], float("nan"), dtype=torch.float32, device="cuda")
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            decoder.run(q, shared.kv_cache, plan, out=out, lse=lse)  # warm-up outside capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            decoder.run(q, shared.kv_cache, plan, out=out, lse=lse)
        graphs[batch] = (graph, q, out, lse)
    for batch, want in ((64, WGMMA_T_RUN), (8, MMA_SYNC_RUN), (64, WGMMA_T_RUN)):
        graph, q, out, lse = graphs[batch]
        lens = torch.randint(1, 500, (batch,), generator=gen, dtype=torch.int32)
        table = torch.randperm(pages, generator=gen)[: batch * width].reshape(batch, width).to(torch.int32)
        plan = decoder.plan(lens.cuda(), table.cuda(), s_q)
        assert plan.planned.run_fn.__name__ == want
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        step = DecodeInputs(q=q, kv_cache=shared.kv_cache, page_table=table.cuda(), kv_lens=lens.cuda(),
                            kv_scale=shared.kv_scale, sm_scale=shared.sm_scale)
        problem = _auto_problem(16, s_q, batch, max_kv_len=int(lens.max())).model_copy(
            update={"min_kv_len": int(lens.min())})
        res = compare(problem, out, lse, *reference_outputs(problem, step))
        assert res.passed, (batch, res.messages)
    decoder.close()


def _sm100():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if torch.cuda.get_device_capability() not in ((10, 0), (10, 3), (10, 7)):
        pytest.skip("the sm_100 path (FlashInfer cute-dsl-monolithic) needs SM100/SM103/SM107")


class TestCuteDslSm100Conformance(BackendConformance):
    """The SM100 path; never run yet (no SM100 GPU was available): not verified on hardware."""

    backend = "cute_dsl_mla"
    device = "cuda"
    num_heads = (1, 16, 64, 128)
    seq_lens_q = (1, 2, 4)
    page_sizes = (16, 32, 64)
    kv_dtypes = ("bf16",)
    max_kv_len = 2000

    def _require_device(self):
        _sm100()


class TestCuteDslSm100Fp8Conformance(TestCuteDslSm100Conformance):
    q_dtype = "fp8_e4m3"
    kv_dtypes = ("fp8_e4m3",)
