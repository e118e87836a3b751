"""cute_dsl_mla through mlacore on a GPU: the conformance suite (graph replay after a re-plan included)."""

import pytest
import torch

from mlacore.testing.conformance import BackendConformance

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
