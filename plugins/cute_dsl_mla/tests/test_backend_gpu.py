"""cute_dsl_mla through mlacore on a GPU: the conformance suite (graph replay after a re-plan included)."""

import dataclasses
import random

import pytest
import torch

from mlacore import MLADecoder
from mlacore.problem import DecodeProblem, DeviceSpec, torch_dtype
from mlacore.testing.compare import compare, only_backend_dispatcher, reference_outputs
from mlacore.testing.conformance import BackendConformance
from mlacore.testing.inputs import make_inputs

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


class TestCuteDslPdlConformance(TestCuteDslConformance):
    """Option pdl=true: every shape's combine kernel launched with programmatic dependent launch (griddepcontrol
    .wait before its loads; the partial kernels trigger at their start), bf16 and fp8 caches, every kernel
    family auto picks over these heads. The ninth session ran the whole file with PDL on by default (138 passed)
    before the default went back to off."""

    options = {"pdl": True}


class TestCuteDslWgmmaTPdlConformance(TestCuteDslPdlConformance):
    """pdl=true with the transposed WGMMA kernel forced (auto runs it only on steps of >= 640 KV blocks, which the
    suite's steps do not reach), so the PDL combine also runs after wgmma_t's balanced and even entries."""

    options = {"pdl": True, "mma": "wgmma_t"}
    num_heads = (1, 3, 8, 16, 32)


class TestCuteDslQPartialsConformance(TestCuteDslConformance):
    """Option partials=q with stores=narrow (the default is partials=q with wide stores): split-KV partial outputs
    in q's dtype (bf16 here) stored 4 bytes at a time, bf16 and fp8 caches,
    every kernel family auto picks over these heads (mma.sync balanced, fp8reg, WGMMA, seesaw) and both combine
    kernels reading 16-bit partials."""

    options = {"partials": "q", "stores": "narrow"}


class TestCuteDslQPartialsFp16Conformance(TestCuteDslQPartialsConformance):
    q_dtype = "fp16"
    kv_dtypes = ("fp16", "fp8_e4m3")


class TestCuteDslChunkedCombineConformance(TestCuteDslConformance):
    """Option combine=chunked: the row combine with four warps per row (128 columns each) on every split step,
    bf16 and fp8 caches (fp8reg with its 16-bit partials), every kernel family auto picks."""

    options = {"combine": "chunked"}


class TestCuteDslWideCombineConformance(TestCuteDslConformance):
    """Option combine=wide: the wide combine on every split step (auto runs it for small batches only)."""

    options = {"combine": "wide"}
    num_heads = (1, 3, 16, 128)


class TestCuteDslWgmmaConformance(TestCuteDslConformance):
    """The WGMMA partial kernel forced through the backend option (auto ran it at 64-127 rows up to 0.2.16),
    bf16 and fp8 KV; shapes it refuses (s_q*H <= 32) are skipped with the backend's reason."""

    options = {"mma": "wgmma"}
    num_heads = (16, 63, 64, 126, 128)
    single_cell_heads = 128  # the suite's default H=16 gives 16 rows: refused by design


class TestCuteDslWgmmaFp16Conformance(TestCuteDslWgmmaConformance):
    q_dtype = "fp16"
    kv_dtypes = ("fp16", "fp8_e4m3")


class TestCuteDslSeesawConformance(TestCuteDslConformance):
    """The seesaw WGMMA schedule forced (auto takes it from 17 rows since 0.2.23), bf16 and fp16 q, a cache in q's
    dtype or fp8; since mla-cute-dsl 0.2.22 it takes 16 and 32 rows too (H=16 s_q=1/2: the 64-row tile padded)."""

    options = {"mma": "seesaw"}
    num_heads = (16, 63, 64, 126, 128)
    kv_dtypes = ("bf16", "fp8_e4m3")
    single_cell_heads = 128


class TestCuteDslSeesawFewRowsConformance(TestCuteDslConformance):
    """mma=seesaw forced at 1-32 packed rows (0.2.22: the 64-row tile padded inside, one m-block per request; auto
    gives it from 17 rows since 0.2.23), bf16 and fp8 caches, with the loads auto gives (cp.async for a bf16
    cache below 17 rows, the TMA producer from 17, the fp8 producer ring) and, in the TMA class below, the TMA
    producer at every row count."""

    options = {"mma": "seesaw"}
    num_heads = (1, 3, 8, 32)
    seq_lens_q = (1, 2, 4)
    kv_dtypes = ("bf16", "fp8_e4m3")


class TestCuteDslSeesawFewRowsTmaConformance(TestCuteDslSeesawFewRowsConformance):
    options = {"mma": "seesaw", "loads": "tma"}
    kv_dtypes = ("bf16",)


class TestCuteDslSeesawFp16Conformance(TestCuteDslSeesawConformance):
    q_dtype = "fp16"
    kv_dtypes = ("fp16", "fp8_e4m3")


class TestCuteDslSeesawTmaConformance(TestCuteDslSeesawConformance):
    """loads=tma with the seesaw kernel forced: TMA KV loads at every row count it takes (auto uses them from 128
    rows with the balanced seesaw, from 256 with the even one), page 64 and 256; fp8 caches ignore the option
    (their loads convert in registers)."""

    options = {"mma": "seesaw", "loads": "tma"}
    page_sizes = (64, 256)


class TestCuteDslSeesawTmaFp16Conformance(TestCuteDslSeesawTmaConformance):
    q_dtype = "fp16"
    kv_dtypes = ("fp16",)


class TestCuteDslSeesawEvenConformance(TestCuteDslSeesawConformance):
    """seesaw_split=even: 0.2.12's one-CTA-per-item seesaw kernel through the backend (the default since 0.2.13 is the
    balanced one, which every other seesaw class here runs), cp.async and TMA loads as loads=auto picks them.
    Added in the seventeenth session after its device time was spent; first run on the H200 in the eighteenth
    (7 passed, docs/results/gpu18_session/backend_seesaw_even_gpu_tests.log)."""

    options = {"mma": "seesaw", "seesaw_split": "even"}
    kv_dtypes = ("bf16",)
    page_sizes = (64, 256)


class TestCuteDslSeesawCpAsyncConformance(TestCuteDslConformance):
    """loads=cp_async: the seesaw kernel's cp.async loads where auto takes TMA (the balanced seesaw, the default:
    from 128 rows; H=64 s_q=2 and 4, H=128 s_q=1, 2 and 4), so both load paths stay covered through the backend."""

    options = {"loads": "cp_async"}
    num_heads = (64, 128)
    seq_lens_q = (1, 2, 4)
    single_cell_heads = 128


class TestCuteDslSeesawWg1ofConformance(TestCuteDslConformance):
    """wg1_other_first=true: warpgroup 1's other part first with a bf16 cache (TMA producer from 33 rows, the default
    loads; below 256 rows it is off by default) and the fp8 ring (its default anyway), then wg1_other_first=false
    below: 0.2.20's kernels (every other class runs the option's default: on with the fp8 ring, on with 16-bit caches
    from 256 packed rows)."""

    options = {"wg1_other_first": True}
    num_heads = (64, 126, 128)
    seq_lens_q = (1, 2)
    single_cell_heads = 128


class TestCuteDslSeesawNoWg1ofConformance(TestCuteDslSeesawWg1ofConformance):
    options = {"wg1_other_first": False}


class TestCuteDslFp8RegConformance(TestCuteDslConformance):
    """The fp8-register kernel forced (auto takes it for fp8 caches up to 32 rows), two CTAs per SM;
    shapes it refuses (bf16 KV, s_q*H > 32) are skipped with the backend's reason."""

    options = {"mma": "fp8reg"}
    num_heads = (1, 3, 8, 16, 32)
    kv_dtypes = ("fp8_e4m3",)


class TestCuteDslFp8RegOneAccConformance(TestCuteDslFp8RegConformance):
    """fp8reg with one S accumulator per warp at every row count (s_accs=1: 0.2.8's kernel; auto takes 4 up to 16
    rows)."""

    options = {"mma": "fp8reg", "s_accs": 1}


class TestCuteDslWgmmaTConformance(TestCuteDslConformance):
    """The transposed WGMMA kernel forced (auto runs it only on steps of >= 640 KV blocks at 17-32 rows with a
    16-bit cache), bf16 and fp8 caches up to 32 rows; shapes it refuses (s_q*H > 32) are skipped with the
    backend's reason. With the bf16 cache this is its balanced mode (split_kv=balanced, the default), with fp8
    its even split."""

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


class TestCuteDslFp32NarrowConformance(TestCuteDslConformance):
    """partials=fp32 with stores=narrow, 0.2.7's default (the default class above now runs 16-bit partials with
    wide stores): fp32 partials, 4-byte bf16x2 output stores, bf16 and fp8 caches, every kernel family auto
    picks over these heads."""

    options = {"partials": "fp32", "stores": "narrow"}


class TestCuteDslFp32NarrowFp16Conformance(TestCuteDslFp32NarrowConformance):
    q_dtype = "fp16"
    kv_dtypes = ("fp16", "fp8_e4m3")


class TestCuteDslWideStoresFp32PartialsConformance(TestCuteDslConformance):
    """stores=wide with fp32 partials: only the q-dtype output of unsplit requests goes 16 bytes wide."""

    options = {"partials": "fp32", "stores": "wide"}
    num_heads = (1, 16, 128)


class TestCuteDslMmaSyncFp32NarrowConformance(TestCuteDslConformance):
    """partials=fp32, stores=narrow (0.2.7's default) with the mma.sync kernel forced: 16, 32 and 64 rows per CTA
    (BLOCK_M 64 from 33 rows), its even and balanced entries, its fp8 path (the MmaSync class runs the default,
    16-bit partials with wide stores)."""

    options = {"mma": "mma_sync", "partials": "fp32", "stores": "narrow"}
    num_heads = (1, 16, 64, 128)
    seq_lens_q = (1, 2, 8)


class TestCuteDslWgmmaFp32NarrowConformance(TestCuteDslWgmmaConformance):
    """partials=fp32, stores=narrow with the WGMMA kernel forced (64+ rows)."""

    options = {"mma": "wgmma", "partials": "fp32", "stores": "narrow"}


class TestCuteDslSeesawFp32NarrowConformance(TestCuteDslSeesawConformance):
    """partials=fp32, stores=narrow with the seesaw kernel forced (64+ rows, bf16 and fp8 caches)."""

    options = {"mma": "seesaw", "partials": "fp32", "stores": "narrow"}


class TestCuteDslWgmmaTFp32PartialsConformance(TestCuteDslConformance):
    """partials=fp32 with wgmma_t forced (its balanced entry with a 16-bit cache, its even entry with fp8): the
    WgmmaT class runs the default 16-bit partials (wgmma_t has no wide stores, so option stores does not matter)."""

    options = {"partials": "fp32", "mma": "wgmma_t"}
    num_heads = (1, 3, 8, 16, 32)


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


# -- mma=auto's KV-block rule (wgmma_t for a 16-bit cache at 17-32 rows from 640 KV blocks per step) ---------
# Since 0.2.23 the rule applies with seesaw_split=even only (the default, balanced, gives the seesaw at 17-32 rows:
# the tests after these), so these decoders set it (RULE_OPTIONS).
# The conformance suite plans short steps only (batches 2-5, lengths up to 2000: below the rule's threshold), so
# these tests exercise it directly: eager plans on both sides against the fp64 oracle, and CUDA graphs captured
# on one side and replayed after plans on the other (the graph keeps its capture-time kernel; both kernels read
# the same schedule buffers, so every replay must match the oracle).

WGMMA_T_RUN, MMA_SYNC_RUN = "mla_decode_sm90_wgmma_t_balanced", "mla_decode_sm90_balanced"
MIN_BLOCKS = 640  # mla_cute_dsl.backend.WGMMA_T_AUTO_MIN_BLOCKS (asserted below)
RULE_OPTIONS = {"seesaw_split": "even"}  # where mma=auto keeps 0.2.22's 17-32-row kernels
SEESAW_RUN = "mla_decode_sm90_wgmma_seesaw_balanced"


def _auto_problem(heads, s_q, batch, dtype="bf16", max_kv_len=600, min_kv_len=1, kv_dtype=None):
    return DecodeProblem(num_heads=heads, seq_len_q=s_q, batch_size=batch, min_kv_len=min_kv_len,
                         max_kv_len=max_kv_len, page_size=64, q_dtype=dtype, kv_dtype=kv_dtype or dtype,
                         device=DeviceSpec.of("cuda"))


def _auto_decoder(problem, inputs, options=RULE_OPTIONS, **kw):
    return MLADecoder(problem.num_heads, problem.page_size, q_dtype=torch_dtype(problem.q_dtype),
                      kv_dtype=torch_dtype(problem.kv_dtype), device="cuda", sm_scale=inputs.sm_scale,
                      kv_scale=inputs.kv_scale,
                      dispatcher=only_backend_dispatcher("cute_dsl_mla", options=options), **kw)


def _lens_with_blocks(batch, blocks, seed, max_blocks=64):
    """Host lengths of `batch` requests holding exactly `blocks` KV blocks of 64 tokens in all (sum of
    ceil(len/64), what the rule counts): 1..max_blocks blocks per request spread at random, each request ending
    at a random token of its last block."""
    assert batch <= blocks <= batch * max_blocks
    rng = random.Random(seed)
    nb = [1] * batch
    for _ in range(blocks - batch):
        i = rng.randrange(batch)
        while nb[i] >= max_blocks:
            i = (i + 1) % batch
        nb[i] += 1
    return torch.tensor([64 * (n - 1) + rng.randint(1, 64) for n in nb], dtype=torch.int32)


def _want(heads, s_q, blocks):
    return WGMMA_T_RUN if 16 < heads * s_q <= 32 and blocks >= MIN_BLOCKS else MMA_SYNC_RUN


def _step(heads, s_q, lens, dtype, seed, pages, kv_dtype=None):
    """Fresh random q / cache / table for these lengths (make_inputs: NaN-poisoned spare pages and tails), the
    cache exactly `pages` pages, and the problem the oracle compares with."""
    problem = _auto_problem(heads, s_q, lens.shape[0], dtype, max_kv_len=int(lens.max()), min_kv_len=int(lens.min()),
                            kv_dtype=kv_dtype)
    used = sum((int(n) + 63) // 64 for n in lens)
    return problem, make_inputs(problem, "cuda", seed=seed, kv_lens=lens, extra_pages=pages - used)


def _poisoned(q):
    return (torch.full((*q.shape[:3], 512), float("nan"), dtype=q.dtype, device="cuda"),
            torch.full(q.shape[:3], float("nan"), dtype=torch.float32, device="cuda"))


def test_auto_threshold_constant_is_the_one_these_tests_use():
    from mla_cute_dsl.backend import WGMMA_T_AUTO_MIN_BLOCKS, step_kv_blocks

    assert WGMMA_T_AUTO_MIN_BLOCKS == MIN_BLOCKS
    for batch, blocks in ((16, 639), (16, 640), (8, 1500), (64, 100)):
        assert step_kv_blocks(_lens_with_blocks(batch, blocks, seed=blocks, max_blocks=256)) == blocks


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("heads,s_q", [(16, 2), (3, 8), (17, 1), (24, 1), (16, 1)])
@pytest.mark.parametrize("batch,blocks", [(16, 639), (16, 640), (64, 100), (8, 1500)])
def test_auto_runs_wgmma_t_from_640_kv_blocks_at_17_to_32_rows_and_matches_the_oracle(dtype, heads, s_q, batch,
                                                                                        blocks):
    """Eager: both sides of the threshold (639 / 640 blocks), a large batch of short requests (64 x ~1.6
    blocks: mma.sync) and a small batch of long ones (8 x ~190 blocks: wgmma_t), against the fp64 oracle."""
    _sm90()
    lens = _lens_with_blocks(batch, blocks, seed=blocks * 7 + heads, max_blocks=256)
    problem, inputs = _step(heads, s_q, lens, dtype, seed=batch * 100 + heads, pages=blocks + 8)
    want = _want(heads, s_q, blocks)
    with _auto_decoder(problem, inputs) as decoder:
        plan = decoder.plan(inputs.kv_lens, inputs.page_table, s_q)
        assert plan.planned.run_fn.__name__ == want
        assert plan.planned.kernel == ("wgmma_t" if want == WGMMA_T_RUN else "mma_sync")
        out, lse = _poisoned(inputs.q)
        decoder.run(inputs.q, inputs.kv_cache, plan, out=out, lse=lse)
    res = compare(problem, out, lse, *reference_outputs(problem, inputs))
    assert res.passed, res.messages


def _capture(decoder, q, kv_cache, plan, out, lse):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        decoder.run(q, kv_cache, plan, out=out, lse=lse)  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decoder.run(q, kv_cache, plan, out=out, lse=lse)
    torch.cuda.synchronize()
    return graph


@pytest.mark.parametrize("capture_blocks,replay_blocks", [
    (639, (640, 1024, 639, 100, 900)),  # captured below (mma.sync), replayed after plans above and below
    (640, (639, 16, 1000, 300, 640)),  # captured above (wgmma_t), replayed after plans below and above
])
def test_auto_graph_captured_on_one_side_of_the_block_threshold_replays_after_plans_on_the_other(
        capture_blocks, replay_blocks):
    """One graph decoder (H16 s_q2 bf16, 32 rows, batch 16, lengths up to 4096): a graph captured after a plan on
    one side of 640 blocks bakes that plan's kernel; later plans of the same batch size on either side (their
    Planned names the other kernel where they cross) write the same schedule buffers, and every replay, on fresh
    random q / cache / lengths / table copied into the captured buffers with NaN-poisoned outputs, matches the
    fp64 oracle."""
    _sm90()
    heads, s_q, batch, dtype = 16, 2, 16, "bf16"
    pages = 16 * 64 + 8
    lens = _lens_with_blocks(batch, capture_blocks, seed=capture_blocks)
    problem, inputs = _step(heads, s_q, lens, dtype, seed=1, pages=pages)
    q, kv_cache = inputs.q, inputs.kv_cache  # the captured buffers, refilled per step
    out, lse = _poisoned(q)
    decoder = _auto_decoder(problem, inputs, cuda_graph=True, max_batch=batch, max_kv_len=4096)
    try:
        plan = decoder.plan(inputs.kv_lens, inputs.page_table, s_q)
        assert plan.planned.run_fn.__name__ == _want(heads, s_q, capture_blocks)
        graph = _capture(decoder, q, kv_cache, plan, out, lse)
        res = compare(problem, out, lse, *reference_outputs(problem, inputs))
        assert res.passed, ("capture", res.messages)
        for i, blocks in enumerate(replay_blocks):
            lens = _lens_with_blocks(batch, blocks, seed=1000 * i + blocks)
            problem, step = _step(heads, s_q, lens, dtype, seed=100 + i, pages=pages)
            q.copy_(step.q)
            kv_cache.copy_(step.kv_cache)
            plan = decoder.plan(step.kv_lens, step.page_table, s_q)
            assert plan.planned.run_fn.__name__ == _want(heads, s_q, blocks)  # the plan's choice, not the graph's
            out.fill_(float("nan"))
            lse.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            res = compare(problem, out, lse, *reference_outputs(problem, step))
            assert res.passed, (capture_blocks, blocks, res.messages)
    finally:
        decoder.close()


def test_auto_graphs_of_two_batch_sizes_share_the_schedule_buffers_across_the_block_threshold():
    """One graph decoder (envelope batch 64, lengths up to 8192), H16 s_q2 bf16: a graph captured at B=64 with
    1500 blocks (wgmma_t) and one at B=8 with 100 blocks (mma.sync) share the session's schedule buffers of
    s_q=2; plans with fresh data crossing the threshold both ways (B=64 at 300 blocks: the plan says mma.sync,
    the graph runs wgmma_t; B=8 at 700: the reverse), each followed by its batch's replay, match the oracle."""
    _sm90()
    heads, s_q, dtype, pages = 16, 2, "bf16", 1500 + 8
    decoder = None
    graphs = {}
    try:
        for batch, blocks in ((64, 1500), (8, 100)):
            lens = _lens_with_blocks(batch, blocks, seed=blocks, max_blocks=128)
            problem, inputs = _step(heads, s_q, lens, dtype, seed=batch, pages=pages)
            if decoder is None:
                decoder = _auto_decoder(problem, inputs, cuda_graph=True, max_batch=64, max_kv_len=8192)
            q, kv_cache = inputs.q, inputs.kv_cache  # this graph's buffers, refilled per step
            plan = decoder.plan(inputs.kv_lens, inputs.page_table, s_q)
            assert plan.planned.run_fn.__name__ == _want(heads, s_q, blocks)
            out, lse = _poisoned(q)
            graphs[batch] = (_capture(decoder, q, kv_cache, plan, out, lse), kv_cache, q, out, lse)
            res = compare(problem, out, lse, *reference_outputs(problem, inputs))  # the warm-up run's output
            assert res.passed, ("capture", batch, res.messages)
        for i, (batch, blocks) in enumerate(((64, 300), (8, 700), (64, 1500), (8, 100), (64, 640), (8, 639))):
            graph, kv_cache, q, out, lse = graphs[batch]
            lens = _lens_with_blocks(batch, blocks, seed=7 * i + blocks, max_blocks=128)
            problem, step = _step(heads, s_q, lens, dtype, seed=200 + i, pages=pages)
            q.copy_(step.q)
            kv_cache.copy_(step.kv_cache)
            plan = decoder.plan(step.kv_lens, step.page_table, s_q)
            assert plan.planned.run_fn.__name__ == _want(heads, s_q, blocks)
            out.fill_(float("nan"))
            lse.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            res = compare(problem, out, lse, *reference_outputs(problem, step))
            assert res.passed, (batch, blocks, res.messages)
    finally:
        if decoder is not None:
            decoder.close()


# -- mma=auto at 17-32 rows since 0.2.23: the balanced seesaw, one kernel per shape class --------------------------

FP8REG_RUN = "mla_decode_sm90_fp8"


def _auto_few_rows_want(heads, s_q, kv_dtype):
    return SEESAW_RUN if heads * s_q >= 17 else (FP8REG_RUN if kv_dtype == "fp8_e4m3" else MMA_SYNC_RUN)


@pytest.mark.parametrize("dtype,kv_dtype", [("bf16", "bf16"), ("fp16", "fp16"), ("bf16", "fp8_e4m3")])
@pytest.mark.parametrize("heads,s_q", [(17, 1), (24, 1), (8, 3), (16, 2), (32, 1), (16, 1)])
@pytest.mark.parametrize("batch,blocks", [(16, 639), (8, 1500)])
def test_auto_runs_the_balanced_seesaw_at_17_to_32_rows_and_matches_the_oracle(dtype, kv_dtype, heads, s_q, batch,
                                                                                blocks):
    """Eager, default options: the balanced seesaw (TMA producer with a 16-bit cache, the fp8 producer ring) at
    17-32 packed rows on both sides of the old KV-block threshold, fp8reg / mma.sync at 16 rows, against the fp64
    oracle with fresh random data, variable lengths and NaN-poisoned spare pages, tails and outputs."""
    _sm90()
    lens = _lens_with_blocks(batch, blocks, seed=blocks * 11 + heads * s_q, max_blocks=256)
    problem, inputs = _step(heads, s_q, lens, dtype, seed=batch * 100 + heads + s_q, pages=blocks + 8,
                            kv_dtype=kv_dtype)
    with _auto_decoder(problem, inputs, options=None) as decoder:
        plan = decoder.plan(inputs.kv_lens, inputs.page_table, s_q)
        assert plan.planned.run_fn.__name__ == _auto_few_rows_want(heads, s_q, kv_dtype)
        out, lse = _poisoned(inputs.q)
        decoder.run(inputs.q, inputs.kv_cache, plan, out=out, lse=lse)
    res = compare(problem, out, lse, *reference_outputs(problem, inputs))
    assert res.passed, res.messages


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8_e4m3"])
def test_auto_seesaw_graph_at_32_rows_replays_after_plans_of_any_size(kv_dtype):
    """One graph decoder (H16 s_q2, 32 rows, batch 16, lengths up to 4096, default options): captured after a plan
    of 100 KV blocks, replayed after plans of 1024, 639, 16 and 300 blocks with fresh random q / cache / lengths /
    table and NaN-poisoned outputs; every plan names the seesaw (no per-step switch) and every replay matches the
    fp64 oracle."""
    _sm90()
    heads, s_q, batch, dtype = 16, 2, 16, "bf16"
    pages = 16 * 64 + 8
    lens = _lens_with_blocks(batch, 100, seed=100)
    problem, inputs = _step(heads, s_q, lens, dtype, seed=1, pages=pages, kv_dtype=kv_dtype)
    q, kv_cache = inputs.q, inputs.kv_cache
    out, lse = _poisoned(q)
    decoder = _auto_decoder(problem, inputs, options=None, cuda_graph=True, max_batch=batch, max_kv_len=4096)
    try:
        plan = decoder.plan(inputs.kv_lens, inputs.page_table, s_q)
        assert plan.planned.run_fn.__name__ == SEESAW_RUN
        graph = _capture(decoder, q, kv_cache, plan, out, lse)
        res = compare(problem, out, lse, *reference_outputs(problem, inputs))
        assert res.passed, ("capture", res.messages)
        for i, blocks in enumerate((1024, 639, 16, 300)):
            lens = _lens_with_blocks(batch, blocks, seed=1000 * i + blocks)
            problem, step = _step(heads, s_q, lens, dtype, seed=100 + i, pages=pages, kv_dtype=kv_dtype)
            # the decoder's kv_scale is the first step's: the oracle reads this step's fp8 bytes with it too
            step = dataclasses.replace(step, kv_scale=inputs.kv_scale)
            q.copy_(step.q)
            kv_cache.copy_(step.kv_cache)
            plan = decoder.plan(step.kv_lens, step.page_table, s_q)
            assert plan.planned.run_fn.__name__ == SEESAW_RUN
            out.fill_(float("nan"))
            lse.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            res = compare(problem, out, lse, *reference_outputs(problem, step))
            assert res.passed, (blocks, res.messages)
    finally:
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


class TestCuteDslFusedCombineConformance(TestCuteDslConformance):
    """combine=fused: the balanced mma.sync kernel merges each split request in the last CTA to finish one of its
    items (kernels/fused_merge.py), no combine kernel, at the head counts where it runs (s_q*H <= 32; 16-bit
    partials with wide stores, the defaults); fp8 caches fall back to fp8reg + the combine kernel."""

    options = {"combine": "fused"}
    num_heads = (1, 3, 8, 16, 32)
    seq_lens_q = (1, 2)


class TestCuteDslFusedCombineFp16Conformance(TestCuteDslFusedCombineConformance):
    q_dtype = "fp16"
    kv_dtypes = ("fp16",)


class TestCuteDslFusedCombineFp32Conformance(TestCuteDslFusedCombineConformance):
    """combine=fused with fp32 partials (8-byte partial stores, 16-byte fp32 reads in the merge), mma.sync forced
    so that 17-32 rows merge in the partial kernel at every step (mma=auto may pick wgmma_t there)."""

    options = {"combine": "fused", "partials": "fp32", "mma": "mma_sync"}
    kv_dtypes = ("bf16",)


class TestCuteDslFusedCombineEvenConformance(TestCuteDslFusedCombineConformance):
    """combine=fused with split_kv=even: the even mma.sync entry (one CTA per work row, kernel_fused) merges."""

    options = {"combine": "fused", "split_kv": "even"}
    kv_dtypes = ("bf16",)
