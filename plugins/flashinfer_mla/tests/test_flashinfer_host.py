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
    assert "num_heads=96: trtllm-gen takes 1..64 or 128" in r
    assert any("fp8" in x for x in r)
    assert "variant trtllm-gen needs sm_100 or sm_103, device is cuda:sm_90" in variants.reasons(
        prob(), opts(variant="trtllm-gen"))


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
    assert "backend.flashinfer_mla.options.varaint: unknown option (known: variant, workspace_mb)" in text
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


def test_trtllm_gen_argument_preparation():
    table = torch.arange(10, dtype=torch.int32).reshape(2, 5) + 1
    args = trtllm_gen_args(table, page_size=32, max_kv_len=150, sm_scale=0.1, kv_scale=2.0)
    assert args.block_tables.shape == (2, 8)  # padded to a multiple of 128/32 = 4
    assert args.block_tables[:, :5].tolist() == table.tolist()
    assert (args.block_tables[:, 5:] == 0).all()
    assert args.max_seq_len == 150
    assert args.bmm1_scale == pytest.approx(0.2) and args.bmm2_scale == 2.0
    same = trtllm_gen_args(table[:, :4], page_size=32, max_kv_len=0, sm_scale=0.1, kv_scale=1.0)
    assert same.block_tables.shape == (2, 4) and same.max_seq_len == 1
    with pytest.raises(ValueError, match="page size dividing 128"):
        trtllm_gen_args(table, page_size=48, max_kv_len=1, sm_scale=0.1, kv_scale=1.0)


def test_explain_for_an_h200_from_a_cpu_machine():
    reg = BackendRegistry(env={}).load()
    disp = Dispatcher(policy=parse_policy({"mla": {"order": ["flashinfer_mla", "reference"]}}), registry=reg, env={})
    dec = disp.explain(prob())
    if torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0):
        assert dec.backend == "flashinfer_mla"
    else:
        assert dec.verdict("flashinfer_mla").outcome in ("unavailable", "cannot implement")
        assert dec.backend == "reference"
