"""cutlass_mla on the CPU: head lifting, scale folding, table padding, workspace sizing, verdicts per simulated GPU.

The kernel is never run here (no SM100 GPU); the capability is injected as an
input, the arithmetic is checked against hand-made cases.
"""

import math
import sys

import pytest
import torch

from mla_cutlass import host
from mla_cutlass.backend import CutlassBackend, CutlassOptions, shape_reasons
from mlacore import BackendRegistry, Dispatcher, parse_policy
from mlacore.problem import DecodeProblem, DeviceSpec

B200 = DeviceSpec(type="cuda", capability=(10, 0))
B300 = DeviceSpec(type="cuda", capability=(10, 3))
THOR = DeviceSpec(type="cuda", capability=(11, 0))
H200 = DeviceSpec(type="cuda", capability=(9, 0))


def prob(**kw):
    base = dict(num_heads=16, seq_len_q=1, batch_size=8, max_kv_len=4096, min_kv_len=1, page_size=64,
                q_dtype="bf16", kv_dtype="bf16", return_lse=False, device=B200)
    base.update(kw)
    return DecodeProblem(**base)


# -- scale folding ---------------------------------------------------------------


def test_kernel_scale_and_fold_factor():
    assert host.kernel_scale() == pytest.approx(1 / math.sqrt(192))
    assert host.scale_fold_factor(1 / math.sqrt(192)) == pytest.approx(1.0)
    # DeepSeek-V3 with YaRN: sm_scale ~ 0.135 -> q is multiplied by 0.135 * sqrt(192) ~ 1.8706
    assert host.scale_fold_factor(0.135) == pytest.approx(0.135 * math.sqrt(192))
    assert host.scale_fold_factor(0.135) == pytest.approx(1.87061, rel=1e-5)
    for bad in (0.0, -0.1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="finite positive softmax scale"):
            host.scale_fold_factor(bad)


def test_folded_scale_gives_the_same_logits():
    q = torch.randn(3, 576, dtype=torch.float64)
    k = torch.randn(5, 576, dtype=torch.float64)
    sm_scale = 0.135
    folded = (q * host.scale_fold_factor(sm_scale)) @ k.T * host.kernel_scale()
    assert torch.allclose(folded, sm_scale * q @ k.T)


# -- head lifting and slicing ------------------------------------------------------


def test_lift_query_pads_heads_with_zeros_and_scales():
    q = torch.arange(2 * 1 * 3 * 4, dtype=torch.float32).reshape(2, 1, 3, 4)
    buf = torch.zeros(4, 128, 4)
    got = host.lift_query(q, buf, 2.0)
    assert got.shape == (2, 128, 4) and got.is_contiguous()
    assert got.data_ptr() == buf.data_ptr()  # the session's buffer, not a copy
    assert torch.equal(got[:, :3], 2.0 * q[:, 0])
    assert (got[:, 3:] == 0).all()
    assert (buf[2:] == 0).all()  # rows of other batch entries untouched


def test_lift_query_takes_strided_views_and_keeps_zero_rows_after_reuse():
    big = torch.randn(2, 1, 8, 4)
    q = big[:, :, ::2]  # strided heads: the views engines hand over
    buf = torch.zeros(2, 128, 4)
    host.lift_query(q, buf, 1.0)
    assert torch.equal(buf[:, :4], q[:, 0])
    host.lift_query(torch.ones(2, 1, 4, 4), buf, 3.0)
    assert (buf[:, :4] == 3).all() and (buf[:, 4:] == 0).all()


def test_lift_query_refuses_what_does_not_fit():
    buf = torch.zeros(2, 128, 4)
    with pytest.raises(ValueError, match="one query token per request, got seq_len_q=2"):
        host.lift_query(torch.zeros(2, 2, 3, 4), buf, 1.0)
    with pytest.raises(ValueError, match=r"does not fit the session's query buffer \(2, 128, 4\)"):
        host.lift_query(torch.zeros(3, 1, 3, 4), buf, 1.0)


def test_slice_output_is_the_callers_view():
    out = torch.arange(3 * 128 * 2, dtype=torch.float32).reshape(3, 128, 2)
    view = host.slice_output(out, 2, 16)
    assert view.shape == (2, 16, 2)
    assert view.data_ptr() == out.data_ptr()
    assert torch.equal(view, out[:2, :16])


# -- page table ---------------------------------------------------------------------


@pytest.mark.parametrize("width, page, want", [(5, 32, 8), (4, 32, 4), (1, 128, 1), (3, 64, 4), (0, 16, 8),
                                               (17, 16, 24), (1, 1, 128)])
def test_padded_table_width(width, page, want):
    assert host.padded_table_width(width, page) == want


def test_page_sizes_must_divide_128():
    for page in (48, 256, 0, 96):
        with pytest.raises(ValueError, match="page size dividing 128"):
            host.table_multiple(page)


def test_pad_page_table_into_a_fixed_flat_buffer():
    flat = torch.full((40,), -7, dtype=torch.int32)
    table = torch.tensor([[3, 9, 4, 1, 2], [8, 6, 0, 5, 7]], dtype=torch.int32)
    got = host.pad_page_table(table, 32, flat)  # 128/32 = 4 -> width 8
    assert got.shape == (2, 8) and got.is_contiguous() and got.data_ptr() == flat.data_ptr()
    assert got.tolist() == [[3, 9, 4, 1, 2, 0, 0, 0], [8, 6, 0, 5, 7, 0, 0, 0]]
    assert (flat[16:] == -7).all()
    # graph mode: the envelope's width, a narrower step's table, the same address
    again = host.pad_page_table(table[:, :2], 32, flat, width=12)
    assert again.data_ptr() == flat.data_ptr() and again.shape == (2, 12)
    assert again.tolist() == [[3, 9] + [0] * 10, [8, 6] + [0] * 10]
    with pytest.raises(ValueError, match="session's table holds 4"):
        host.pad_page_table(table, 32, flat, width=4)
    with pytest.raises(ValueError, match=r"\[2, 8\] needs 16"):
        host.pad_page_table(table, 32, torch.zeros(10, dtype=torch.int32))
    with pytest.raises(ValueError, match="not a multiple of 128 / page_size = 4"):
        host.pad_page_table(table, 32, flat, width=6)


# -- workspace -----------------------------------------------------------------------


def test_split_kv_follows_the_cutlass_rule():
    # B200: 148 SMs, 2-CTA clusters -> 74 cluster slots
    assert host.split_kv(1, 128, 148) == 1  # one K tile
    assert host.split_kv(1, 8192, 148) == 64  # 64 tiles, 74 slots
    assert host.split_kv(1, 128 * 100, 148) == 50  # 100 tiles in 2 waves of 74 -> 50 per wave
    assert host.split_kv(64, 8192, 148) == 1  # 148 // 128 = 1
    assert host.split_kv(8, 8192, 148) == 8  # 148 // 16 = 9 -> 64 tiles in 8 waves of 9 -> 8
    with pytest.raises(ValueError, match="must be positive"):
        host.split_kv(0, 128, 148)


def test_workspace_bytes_hand_made():
    row = 4 * 512 + 4  # fp32 O row and LSE per head
    assert host.workspace_bytes(1, 8192, 148) == row * 128 * 64 * 1
    assert host.workspace_bytes(8, 8192, 148) == row * 128 * 8 * 8


def test_bucket_workspace_covers_every_batch_and_length_in_it():
    for bucket in (1, 2, 8, 64, 256):
        need = host.bucket_workspace_bytes(bucket, 148)
        for b in range(1, bucket + 1):
            for seq in (1, 128, 1000, 8192, 131072):
                assert host.workspace_bytes(b, seq, 148) <= need, (bucket, b, seq)
    row = 4 * 512 + 4
    assert host.bucket_workspace_bytes(1, 148) == row * 128 * 74
    assert host.bucket_workspace_bytes(256, 148) == row * 128 * 256


@pytest.mark.parametrize("batch, bucket", [(1, 1), (2, 2), (3, 4), (64, 64), (65, 128)])
def test_batch_buckets(batch, bucket):
    assert host.batch_bucket(batch) == bucket


# -- verdicts ------------------------------------------------------------------------


@pytest.mark.parametrize("device", [B200, B300, THOR])
def test_takes_deepseek_decode_on_sm100_for_every_head_count(device):
    for h in (1, 8, 16, 32, 64, 100, 128):
        for page in (1, 16, 32, 64, 128):
            assert shape_reasons(prob(num_heads=h, page_size=page, device=device).shape) == []
    assert shape_reasons(prob(q_dtype="fp16", kv_dtype="fp16", device=device).shape) == []


def test_refuses_with_every_reason():
    r = shape_reasons(prob(device=H200, seq_len_q=2, return_lse=True, kv_dtype="fp8_e4m3", page_size=48,
                           num_heads=129).shape)
    assert "cuda:sm_90: CUTLASS MLA kernels need SM100 (compute capability 10.x or 11.x)" in r
    assert "seq_len_q=2: the CUTLASS MLA kernel takes one query token per request" in r
    assert "return_lse: the CUTLASS MLA kernel writes no LSE" in r
    assert any(x.startswith("kv_dtype=fp8_e4m3: FlashInfer's cutlass MLA input is fp16/bf16 only") for x in r)
    assert "page_size=48: the CUTLASS MLA kernel needs a page size dividing 128" in r
    assert "num_heads=129 > 128 (heads below 128 are padded by the plugin)" in r
    assert shape_reasons(prob(device=DeviceSpec(type="cpu")).shape) == [
        "device=cpu: the CUTLASS MLA kernels run on CUDA GPUs only"]
    assert "kv_dtype=fp16 must equal q_dtype=bf16" in shape_reasons(prob(kv_dtype="fp16").shape)


def test_zero_lengths_are_a_limit():
    limits = CutlassBackend().limits(prob().shape, CutlassOptions())
    assert limits.min_kv_len == 1
    assert limits.reasons(prob(min_kv_len=0))[0].startswith("min_kv_len=0 < the backend's min_kv_len=1")
    assert limits.reasons(prob(min_kv_len=1)) == []


def test_availability_for_each_simulated_capability():
    backend = CutlassBackend()
    for dev in (B200, B300, THOR):
        avail = backend.availability_for(dev)
        assert avail.available, (dev, avail.reasons)
        assert "not verified on hardware" in avail.details["status"]
        assert avail.details["flashinfer"].startswith("0.7.2")
    for cap in ((9, 0), (8, 0), (12, 0)):
        avail = backend.availability_for(DeviceSpec(type="cuda", capability=cap))
        assert avail.reasons == (f"sm_{cap[0]}{cap[1]}: CUTLASS MLA kernels need SM100",)
    assert not backend.availability_for(DeviceSpec(type="cpu")).available


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU answer")
def test_unavailable_here_and_listing_imports_neither_flashinfer_nor_the_session():
    sys.modules.pop("flashinfer", None)
    reg = BackendRegistry(env={}).load()
    handle = reg.get("cutlass_mla")
    assert handle.distribution == "mla-cutlass"
    assert handle.status == "unavailable"
    assert any("CUDA" in r for r in handle.reasons())
    handle.can_implement(prob().shape, CutlassOptions())
    assert "flashinfer" not in sys.modules


def test_info_says_not_verified_on_hardware():
    info = CutlassBackend().info()
    assert any("not verified on hardware" in n for n in info.notes)
    assert any("flashinfer-python>=0.7.2,<0.7.3" in n for n in info.notes)


def test_policy_routes_to_cutlass_when_the_capability_says_sm100():
    reg = BackendRegistry(env={}).load()
    pol = parse_policy({"mla": {"order": ["cutlass_mla", "flashinfer_mla", "reference"]}})
    disp = Dispatcher(policy=pol, registry=reg, env={}, simulate=B200)
    assert disp.explain(prob()).backend == "cutlass_mla"
    # what cutlass cannot do goes on down the order
    assert disp.explain(prob(seq_len_q=2, min_kv_len=2)).backend == "flashinfer_mla"
    assert disp.explain(prob(return_lse=True)).backend == "flashinfer_mla"
    hopper = Dispatcher(policy=pol, registry=reg, env={}, simulate=H200)
    dec = hopper.explain(prob(device=H200))
    assert dec.verdict("cutlass_mla").outcome == "unavailable"
    assert "sm_90: CUTLASS MLA kernels need SM100" in dec.verdict("cutlass_mla").reasons
    assert dec.backend == "flashinfer_mla"


def test_options_are_typed():
    reg = BackendRegistry(env={}).load()
    bad = {"mla": {"order": ["cutlass_mla"]}, "backend": {"cutlass_mla": {"options": {"sm_count": -1}}}}
    with pytest.raises(Exception, match="backend.cutlass_mla.options.sm_count"):
        Dispatcher(policy=parse_policy(bad), registry=reg, env={})
