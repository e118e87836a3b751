"""cute_dsl_mla's adapter on the CPU: verdicts per simulated device, registration, policy routing."""

import sys

import pytest
import torch

from mla_cute_dsl.backend import CuteDslBackend, CuteDslOptions, shape_reasons
from mlacore import BackendRegistry, Dispatcher, parse_policy
from mlacore.problem import DecodeProblem, DeviceSpec

H200 = DeviceSpec(type="cuda", capability=(9, 0))
B200 = DeviceSpec(type="cuda", capability=(10, 0))


def prob(**kw):
    base = dict(num_heads=16, seq_len_q=1, batch_size=8, max_kv_len=4096, min_kv_len=0, page_size=64,
                q_dtype="bf16", kv_dtype="bf16", device=H200)
    base.update(kw)
    return DecodeProblem(**base)


def test_takes_every_head_count_and_s_q_up_to_8_with_fp8_kv():
    for h in (1, 3, 9, 63, 64, 126, 128):
        for s_q in (1, 2, 5, 8):
            for kv in ("bf16", "fp8_e4m3"):
                assert shape_reasons(prob(num_heads=h, seq_len_q=s_q, kv_dtype=kv).shape) == []
    assert shape_reasons(prob(q_dtype="fp16", kv_dtype="fp16", page_size=128).shape) == []


def test_every_reason_is_listed():
    r = shape_reasons(prob(device=B200, q_dtype="fp32", kv_dtype="fp16", page_size=16, num_heads=129,
                           seq_len_q=9, kv_lora_rank=256).shape)
    assert "cuda:sm_100: these kernels are built for sm_90 (Hopper) only" in r
    assert "q_dtype=fp32 not in {bf16, fp16}" in r
    assert any(x.startswith("page_size=16") for x in r)
    assert "num_heads=129 > 128" in r and "seq_len_q=9 > 8" in r
    assert any("512 + 64" in x for x in r)
    assert shape_reasons(prob(device=DeviceSpec(type="cpu")).shape) == [
        "device=cpu: the CuTe DSL kernels run on CUDA GPUs only"]
    assert any("non-causal" in x for x in shape_reasons(prob(seq_len_q=2, causal=False).shape))
    assert any("scale_inputs=tensor" in x for x in shape_reasons(prob(scale_inputs="tensor").shape))
    assert any("out_dtype=fp32" in x for x in shape_reasons(prob(out_dtype="fp32").shape))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU answer")
def test_unavailable_without_a_gpu_and_listing_imports_no_cutlass():
    sys.modules.pop("cutlass", None)
    reg = BackendRegistry(env={}).load()
    handle = reg.get("cute_dsl_mla")
    assert handle.distribution == "mla-cute-dsl"
    assert handle.status == "unavailable"
    assert any("CUDA" in r for r in handle.reasons())
    handle.can_implement(prob().shape, CuteDslOptions())
    assert "cutlass" not in sys.modules


def test_policy_options_are_typed():
    reg = BackendRegistry(env={}).load()
    ok = {"mla": {"order": ["cute_dsl_mla", "reference"]}, "backend": {"cute_dsl_mla": {"options": {"ctas_per_sm": 2}}}}
    Dispatcher(policy=parse_policy(ok), registry=reg, env={})
    bad = {"mla": {"order": ["cute_dsl_mla"]}, "backend": {"cute_dsl_mla": {"options": {"ctas_per_sm": 3}}}}
    with pytest.raises(Exception, match="backend.cute_dsl_mla.options.ctas_per_sm"):
        Dispatcher(policy=parse_policy(bad), registry=reg, env={})


def test_backend_object_says_what_it_takes():
    info = CuteDslBackend().info()
    assert info.q_layouts == ("packed",) and info.graph_capturable
    assert any("65504" in n for n in info.notes)
