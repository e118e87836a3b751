"""cutlass_mla through mlacore on an SM100 GPU: the conformance suite. Skips without one.

Never run yet (no SM100 GPU was available): until it passes on a B200, the
backend says "not verified on hardware". The suite's large-magnitude-q test
matters here: a known CUTLASS MLA split-KV bug gives wrong O there.
"""

import pytest
import torch

from mlacore.testing.conformance import BackendConformance

pytestmark = pytest.mark.gpu


def _sm100():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if torch.cuda.get_device_capability()[0] not in (10, 11):
        pytest.skip("the CUTLASS MLA kernels need SM100 (compute capability 10.x or 11.x)")


class TestCutlassConformance(BackendConformance):
    backend = "cutlass_mla"
    device = "cuda"
    return_lse = False  # the kernel writes none
    num_heads = (1, 16, 64, 128)
    seq_lens_q = (1,)
    page_sizes = (16, 32, 64, 128)
    kv_dtypes = ("bf16",)
    max_kv_len = 2000

    def _require_device(self):
        _sm100()


@pytest.mark.parametrize("sm_scale", [1 / 192 ** 0.5, 0.135])
def test_folded_scale_and_padded_heads_match_the_reference(sm_scale):
    """sm_scale != 1/sqrt(192) (DeepSeek-V3 with YaRN) and H < 128: the plugin's folding and lifting."""
    _sm100()
    from mlacore import MLADecoder
    from mlacore.problem import DecodeProblem, DeviceSpec
    from mlacore.testing.compare import compare, only_backend_dispatcher, reference_outputs
    from mlacore.testing.inputs import make_inputs

    problem = DecodeProblem(num_heads=16, batch_size=4, min_kv_len=1, max_kv_len=1500, page_size=64,
                            return_lse=False, device=DeviceSpec.of("cuda"))
    inputs = make_inputs(problem, "cuda", seed=3, sm_scale=sm_scale)
    dispatcher = only_backend_dispatcher("cutlass_mla")
    with MLADecoder(16, 64, q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16, device="cuda", sm_scale=sm_scale,
                    return_lse=False, dispatcher=dispatcher) as decoder:
        plan = decoder.plan(inputs.kv_lens, inputs.page_table, 1)
        assert plan.backend == "cutlass_mla"
        out = torch.full((4, 1, 16, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
        decoder.run(inputs.q, inputs.kv_cache, plan, out=out)
    res = compare(problem, out, None, *reference_outputs(problem, inputs))
    assert res.passed, res.messages
