"""flashinfer_mla host-side logic on the CPU: availability, verdicts, metadata, trtllm-gen arguments."""

import sys

import pytest
import torch

from mla_flashinfer import variants
from mla_flashinfer.metadata import csr_from_table, trtllm_gen_args
from mla_flashinfer.plugin import FlashInferBackend, FlashInferOptions
from mlacore import BackendRegistry, Dispatcher, PolicyError, parse_policy
from mlacore.problem import DecodeProblem, DeviceSpec

H200 = DeviceSpec(type="cuda", capability=(9, 0))
B200 = DeviceSpec(type="cuda", capability=(10, 0))
A100 = DeviceSpec(type="cuda", capability=(8, 0))
H200_SMEM = (233472, 232448)


def opts(**kw):
    return FlashInferOptions(**kw)


def prob(**kw):
    base = dict(num_heads=16, seq_len_q=1, batch_size=8, max_kv_len=4096, min_kv_len=1, page_size=64,
                q_dtype="bf16", kv_dtype="bf16", device=H200)
    base.update(kw)
    return DecodeProblem(**base)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU answer")
def test_availability_without_gpu_names_the_reason():
    avail = FlashInferBackend().availability()
    assert not avail.available
    assert any("CUDA" in r for r in avail.reasons), avail.reasons


def test_listing_does_not_import_flashinfer():
    sys.modules.pop("flashinfer", None)
    reg = BackendRegistry(env={}).load()
    backend = reg.get("flashinfer_mla")
    assert backend.distribution == "mla-flashinfer"
    backend.availability()
    backend.can_implement(prob().shape, FlashInferOptions())
    backend.limits(prob().shape, FlashInferOptions())
    assert "flashinfer" not in sys.modules


@pytest.mark.parametrize("cap, variant", [((9, 0), "fa3"), ((8, 0), "fa2"), ((8, 9), "fa2"), ((12, 0), "fa2"),
                                          ((10, 0), "trtllm-gen"), ((10, 3), "trtllm-gen"), ((7, 5), None)])
def test_auto_variant_by_architecture(cap, variant):
    assert variants.auto_variant(cap) == variant


def test_fa3_takes_deepseek_shapes():
    for kv in ("bf16", "fp8_e4m3"):
        for s_q in (1, 2, 4):
            for h in (8, 16, 32, 64, 128):
                for page in (1, 16, 64):
                    assert variants.reasons(prob(kv_dtype=kv, seq_len_q=s_q, num_heads=h, page_size=page),
                                            {}, H200_SMEM) == []


def test_every_reason_is_listed_not_just_the_first():
    p = prob(q_dtype="fp32", kv_dtype="fp8_e4m3", device=A100)
    r = variants.reasons(p, opts(variant="fa3"), (167936, 166912))
    assert "variant fa3 needs sm_90, device is cuda:sm_80" in r
    assert "q_dtype=fp32 not in {bf16, fp16}" in r
    assert "kv_dtype=fp8_e4m3 needs sm_90 for fa3, device is cuda:sm_80" in r
    assert "kv_dtype=fp8_e4m3 needs q_dtype=bf16, got fp32" in r


def test_cpu_and_old_gpus_are_refused():
    assert variants.reasons(prob(device=DeviceSpec(type="cpu")), opts()) == [
        "device=cpu: FlashInfer runs on CUDA GPUs only"]
    assert "needs sm_80 or newer" in variants.reasons(prob(device=DeviceSpec(type="cuda", capability=(7, 5))), opts())[0]


def test_dtype_mixing_and_head_dims():
    assert "kv_dtype=fp16 must equal q_dtype=bf16 (or be fp8_e4m3)" in variants.reasons(prob(kv_dtype="fp16"), opts())
    r = variants.reasons(prob(kv_lora_rank=384), opts())
    assert "fa3 needs kv_lora_rank in {128, 256, 512}, got 384" in r


def test_causal_tiles_need_heads_dividing_64_or_128():
    assert variants.reasons(prob(num_heads=96, seq_len_q=2), opts()) != []
    assert variants.reasons(prob(num_heads=96, seq_len_q=1), opts()) == []
    assert variants.reasons(prob(num_heads=96, seq_len_q=2, causal=False), opts()) == []


def test_work_item_limit_is_data_not_a_verdict():
    backend = FlashInferBackend()
    p = prob(num_heads=128, seq_len_q=4, batch_size=5000)
    assert variants.reasons(p.shape, opts()) == []
    limits = backend.limits(p.shape, opts())
    assert limits.max_batch == 16384 // 4  # 512 rows = 4 tiles of 128
    assert any("work items" in r for r in limits.reasons(p))
    assert backend.limits(prob(num_heads=16).shape, opts()).max_batch == 16384
    assert backend.limits(prob(device=B200).shape, opts()).max_batch is None  # trtllm-gen: no FA scheduler


def test_fa2_shared_memory():
    assert variants.fa2_shared_bytes(512, 64, False, 233472) <= 232448
    r = variants.reasons(prob(device=A100), opts(variant="fa2"), (100000, 90000))
    assert any("shared-memory bytes per block" in x for x in r)
    r = variants.reasons(prob(device=A100), opts(variant="fa2"), (50000, 49000))
    assert any("92672" in x for x in r)


def test_trtllm_gen_rules():
    ok = prob(device=B200, page_size=32)
    assert variants.reasons(ok, opts()) == []
    r = variants.reasons(prob(device=B200, page_size=16, num_heads=96, kv_dtype="fp8_e4m3"), opts())
    assert "page_size=16 not in {32, 64} (trtllm-gen)" in r
    assert "num_heads=96: trtllm-gen takes 1..64 or 128 (FlashInfer refuses 64 < H < 128)" in r
    assert "kv_dtype=fp8_e4m3 needs an fp8 query for trtllm-gen (q_dtype=fp8_e4m3), got bf16" in r
    assert "variant trtllm-gen needs sm_100, sm_103 or sm_107, device is cuda:sm_90" in variants.reasons(
        prob(), opts(variant="trtllm-gen"))


SM103 = DeviceSpec(type="cuda", capability=(10, 3))
SM107 = DeviceSpec(type="cuda", capability=(10, 7))


def test_trtllm_gen_refuses_fp16_and_takes_fp8_query_with_fp8_cache():
    r = variants.reasons(prob(device=B200, q_dtype="fp16", kv_dtype="fp16"), opts())
    assert any(x.startswith("q_dtype=fp16: trtllm-gen takes bf16 q") for x in r), r
    assert variants.reasons(prob(device=B200, q_dtype="fp8_e4m3", kv_dtype="fp8_e4m3"), opts()) == []
    r = variants.reasons(prob(device=B200, q_dtype="fp8_e4m3", kv_dtype="bf16"), opts())
    assert "kv_dtype=bf16 must equal q_dtype=fp8_e4m3 (trtllm-gen)" in r
    assert "out_dtype=fp16: trtllm-gen writes bf16 only" in variants.reasons(
        prob(device=B200, q_dtype="fp8_e4m3", kv_dtype="fp8_e4m3", out_dtype="fp16"), opts())


def test_trtllm_gen_head_counts():
    for h in (1, 2, 4, 8, 16, 32, 64, 128):
        assert variants.reasons(prob(device=B200, num_heads=h), opts()) == [], h
    for h in (65, 96, 127, 129):
        assert any("1..64 or 128" in x for x in variants.reasons(prob(device=B200, num_heads=h), opts())), h
    for h in (3, 24, 48, 40):  # heads_per_cta (a power of two chosen per launch) may not divide them
        r = variants.reasons(prob(device=B200, num_heads=h), opts())
        assert len(r) == 1 and "heads per CTA" in r[0], (h, r)


@pytest.mark.parametrize("device", [B200, SM103, SM107])
def test_trtllm_gen_on_every_blackwell_capability(device):
    assert variants.auto_variant(device.capability) == "trtllm-gen"
    assert variants.reasons(prob(device=device), opts()) == []


def test_trtllm_gen_refuses_zero_and_short_lengths_as_limits():
    backend = FlashInferBackend()
    limits = backend.limits(prob(device=B200, seq_len_q=2).shape, opts())
    assert limits.min_kv_len == 2
    assert limits.reasons(prob(device=B200, seq_len_q=2, min_kv_len=2)) == []
    over = limits.reasons(prob(device=B200, seq_len_q=2, min_kv_len=1))
    assert len(over) == 1 and over[0].startswith("min_kv_len=1 < the backend's min_kv_len=2")
    assert backend.limits(prob(device=B200).shape, opts()).min_kv_len == 1
    assert backend.limits(prob().shape, opts()).min_kv_len == 0  # fa3 unchanged


def test_trtllm_gen_non_causal_multi_token_is_refused():
    r = variants.reasons(prob(device=B200, seq_len_q=2, causal=False), opts())
    assert any("non-causal" in x for x in r)


def test_typed_options_in_a_policy():
    reg = BackendRegistry(env={}).load()
    good = {"mla": {"order": ["flashinfer_mla"]},
            "backend": {"flashinfer_mla": {"options": {"variant": "fa3", "workspace_mb": 64}}}}
    Dispatcher(policy=parse_policy(good), registry=reg, env={})
    bad = {"mla": {"order": ["flashinfer_mla"]},
           "backend": {"flashinfer_mla": {"options": {"varaint": "fa2", "workspace_mb": 0},
                                          "allow": [{"num_heads": [16]}, {"num_heads": [128],
                                                                           "options": {"variant": "fa4"}}]}}}
    with pytest.raises(PolicyError) as err:
        Dispatcher(policy=parse_policy(bad), registry=reg, env={})
    text = str(err.value)
    assert "backend.flashinfer_mla.options.varaint: unknown option (known: launch, variant, workspace_mb)" in text
    assert "backend.flashinfer_mla.options.workspace_mb" in text
    assert "backend.flashinfer_mla.allow[1].options.variant" in text


def test_csr_from_hand_made_table():
    table = torch.tensor([[7, 3, 9, -1], [5, 0, 0, 0], [2, 8, 1, 4]], dtype=torch.int32)
    lens = torch.tensor([33, 0, 64], dtype=torch.int32)  # page 16: 3 pages, 0 pages, 4 pages
    csr = csr_from_table(lens, table, page_size=16, seq_len_q=2)
    assert csr.qo_indptr.tolist() == [0, 2, 4, 6]
    assert csr.kv_indptr.tolist() == [0, 3, 3, 7]
    assert csr.kv_indices.tolist() == [7, 3, 9, 2, 8, 1, 4]
    assert csr.kv_len_arr.tolist() == [33, 0, 64]
    assert all(t.dtype == torch.int32 for t in (csr.qo_indptr, csr.kv_indptr, csr.kv_indices, csr.kv_len_arr))


def test_csr_page_size_one():
    table = torch.tensor([[4, 2, 6], [1, 0, 5]], dtype=torch.int32)
    csr = csr_from_table(torch.tensor([2, 3], dtype=torch.int32), table, page_size=1, seq_len_q=1)
    assert csr.kv_indptr.tolist() == [0, 2, 5]
    assert csr.kv_indices.tolist() == [4, 2, 1, 0, 5]


def test_trtllm_gen_arguments_pass_the_callers_table():
    table = torch.arange(10, dtype=torch.int32).reshape(2, 5) + 1
    args = trtllm_gen_args(table, page_size=32, max_kv_len=150, sm_scale=0.1, kv_scale=2.0)
    assert args.block_tables is table  # no copy, no padding: a captured graph reads this address
    assert args.max_seq_len == 150
    assert args.bmm1_scale == pytest.approx(0.2) and args.bmm2_scale == 2.0
    fp8 = trtllm_gen_args(table, page_size=32, max_kv_len=150, sm_scale=0.1, kv_scale=2.0, q_scale=0.5)
    assert fp8.bmm1_scale == pytest.approx(0.1) and fp8.bmm2_scale == 2.0  # q and k dequant in bmm1
    assert trtllm_gen_args(table, page_size=32, max_kv_len=0, sm_scale=0.1, kv_scale=1.0).max_seq_len == 1
    with pytest.raises(ValueError, match="does not fit the page table: 5 pages of 32 hold 160 tokens"):
        trtllm_gen_args(table, page_size=32, max_kv_len=161, sm_scale=0.1, kv_scale=1.0)


def test_trtllm_gen_graph_mode_schedules_for_the_table_capacity():
    table = torch.zeros(4, 7, dtype=torch.int32)
    args = trtllm_gen_args(table, page_size=64, max_kv_len=100, sm_scale=0.1, kv_scale=1.0, graph=True)
    assert args.max_seq_len == 7 * 64  # the captured launch keeps it: the step's 100 would cap later steps
    assert args.block_tables is table


def test_flashinfer_availability_for_simulated_devices():
    backend = FlashInferBackend()
    for cap, variant in (((10, 0), "trtllm-gen"), ((10, 7), "trtllm-gen"), ((9, 0), "fa3"), ((8, 0), "fa2")):
        avail = backend.availability_for(DeviceSpec(type="cuda", capability=cap))
        assert avail.available, (cap, avail.reasons)
        assert avail.details["variant"].startswith(variant)
        assert avail.details["flashinfer"].startswith("0.7.2")
        assert "no GPU probed" in avail.details["simulated"]
    assert "not verified on hardware" in backend.availability_for(B200).details["variant"]
    old = backend.availability_for(DeviceSpec(type="cuda", capability=(7, 5)))
    assert not old.available and old.reasons == ("sm_75: FlashInfer MLA needs sm_80 or newer",)
    assert not backend.availability_for(DeviceSpec(type="cpu")).available


def test_checked_flashinfer_range_is_declared_and_enforced():
    from mla_flashinfer.plugin import FLASHINFER_RANGE
    from mlacore.probe import checked_range

    assert FLASHINFER_RANGE == ("0.7.2", "0.7.3")
    assert checked_range("flashinfer-python", "0.7.2.post1", *FLASHINFER_RANGE) is None
    why = checked_range("flashinfer-python", "0.8.0", *FLASHINFER_RANGE)
    assert why == ("flashinfer-python 0.8.0 is installed; this plugin was checked against "
                   "flashinfer-python>=0.7.2,<0.7.3 (install that range, or update the plugin)")
    assert checked_range("flashinfer-python", "0.7.1", *FLASHINFER_RANGE) is not None
    assert any("flashinfer-python>=0.7.2,<0.7.3" in n for n in FlashInferBackend().info().notes)


def test_policy_routes_blackwell_problems_to_trtllm_gen_under_simulation():
    reg = BackendRegistry(env={}).load()
    pol = parse_policy({"mla": {"order": ["flashinfer_mla", "reference"]}})
    disp = Dispatcher(policy=pol, registry=reg, env={}, simulate=B200)
    dec = disp.explain(prob(device=B200))
    assert dec.backend == "flashinfer_mla", dec.format_trace()
    assert disp.explain(prob(device=B200, num_heads=96)).verdict("flashinfer_mla").outcome == "cannot implement"
    zero = disp.explain(prob(device=B200, min_kv_len=0))
    assert zero.verdict("flashinfer_mla").outcome == "over a limit" and zero.backend == "reference"


def test_explain_for_an_h200_from_a_cpu_machine():
    reg = BackendRegistry(env={}).load()
    disp = Dispatcher(policy=parse_policy({"mla": {"order": ["flashinfer_mla", "reference"]}}), registry=reg, env={})
    dec = disp.explain(prob())
    if torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0):
        assert dec.backend == "flashinfer_mla"
    else:
        assert dec.verdict("flashinfer_mla").outcome in ("unavailable", "cannot implement")
        assert dec.backend == "reference"


def test_view_cache_forgets_a_dead_tensor_and_a_recycled_id():
    """The direct launch caches views of caches and buffers per tensor object; a dead tensor's entry goes
    (its views must not keep the storage alive) and a new tensor is never served the old views."""
    import gc

    from mla_flashinfer.plugin import _ViewCache

    cache = _ViewCache()
    t = torch.zeros(4, 6)
    views = cache.put(t, t.detach().split(4, -1))  # as the plugin makes them
    assert cache.get(t) is views
    other = torch.zeros(4, 6)
    assert cache.get(other) is None
    del t, views
    gc.collect()
    assert len(cache._entries) == 0
    assert cache.get(other) is None


def test_direct_launcher_absent_without_the_internals():
    """A wrapper without the FlashInfer 0.7.2 internals gets no direct launcher (the plan uses wrapper.run)."""
    from mla_flashinfer.plugin import direct_launcher

    class Wrapper:
        _planned_backend = object()

    assert direct_launcher(Wrapper()) is None
    assert direct_launcher(object()) is None
