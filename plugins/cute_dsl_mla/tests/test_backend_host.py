"""cute_dsl_mla's adapter on the CPU: verdicts per simulated device, registration, policy routing."""

import sys

import pytest
import torch

from mla_cute_dsl.backend import CuteDslBackend, CuteDslOptions, shape_reasons
from mlacore import BackendRegistry, Dispatcher, parse_policy
from mlacore.problem import DecodeProblem, DeviceSpec

H200 = DeviceSpec(type="cuda", capability=(9, 0))
B200 = DeviceSpec(type="cuda", capability=(10, 0))
A100 = DeviceSpec(type="cuda", capability=(8, 0))


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
    r = shape_reasons(prob(device=A100, q_dtype="fp32", kv_dtype="fp16", page_size=16, num_heads=129,
                           seq_len_q=9, kv_lora_rank=256).shape)
    assert "cuda:sm_80: these kernels are built for sm_90 (Hopper) only" in r
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
    assert any("sm_100" in n and "not verified on hardware" in n for n in info.notes)
    assert any("flashinfer-python>=0.7.2,<0.7.3" in n for n in info.notes)
    # `mla backends list` prints every note: a few lines, pointing at where the details are, not an essay
    assert sum(len(n) for n in info.notes) < 800, [len(n) for n in info.notes]
    assert any("mla backends options cute_dsl_mla" in n and "mla backends explain" in n for n in info.notes)


# -- the SM100 path (FlashInfer cute-dsl-monolithic): verdicts for injected capabilities --------------------

SM103 = DeviceSpec(type="cuda", capability=(10, 3))
SM107 = DeviceSpec(type="cuda", capability=(10, 7))


@pytest.mark.parametrize("device", [B200, SM103, SM107])
def test_sm100_takes_bf16_and_fp8_with_an_fp8_query(device):
    for h in (1, 16, 64, 100, 128):
        for page in (2, 16, 32, 64, 128):
            for s_q in (1, 2, 4):
                assert shape_reasons(prob(device=device, num_heads=h, page_size=page, seq_len_q=s_q).shape) == []
    assert shape_reasons(prob(device=device, q_dtype="fp8_e4m3", kv_dtype="fp8_e4m3").shape) == []


def test_sm100_refuses_with_every_reason():
    r = shape_reasons(prob(device=B200, q_dtype="fp16", kv_dtype="fp16").shape)
    assert r == ["q_dtype=fp16: kept out on SM100 until a test shows the FP16 path does not abort "
                 "(TensorRT-LLM's review found it crashing); use bf16",
                 "out_dtype=fp16: the sm_100 path writes bf16"]
    r = shape_reasons(prob(device=B200, kv_dtype="fp8_e4m3", num_heads=129, page_size=1, seq_len_q=2,
                           causal=False).shape)
    assert ("kv_dtype=fp8_e4m3 must equal q_dtype=bf16 on the sm_100 path (an fp8 cache needs an fp8 query here)"
            in r)
    assert "num_heads=129 > 128 (one 128-row M tile)" in r
    assert any(x.startswith("page_size=1: the sm_100 kernels take page sizes 2..128 dividing 128") for x in r)
    assert any(x.startswith("non-causal seq_len_q > 1") for x in r)
    for page in (48, 256, 1):
        assert any(x.startswith(f"page_size={page}") for x in shape_reasons(prob(device=B200, page_size=page).shape))
    assert "out_dtype=fp32: the sm_100 path writes bf16" in shape_reasons(prob(device=B200, out_dtype="fp32").shape)
    # SM90 rules unchanged on the H200: fp8 KV with a bf16 query stays ours
    assert shape_reasons(prob(kv_dtype="fp8_e4m3").shape) == []


def test_sm100_positive_lengths_only_as_limits():
    backend = CuteDslBackend()
    lim = backend.limits(prob(device=B200, seq_len_q=2).shape, CuteDslOptions())
    assert lim.min_kv_len == 2
    assert lim.reasons(prob(device=B200, seq_len_q=2, min_kv_len=0))[0].startswith(
        "min_kv_len=0 < the backend's min_kv_len=2")
    assert backend.limits(prob().shape, CuteDslOptions()).min_kv_len == 0  # sm_90: zero lengths are fine


def test_sm100_scales():
    from mla_cute_dsl.sm100 import aligned_width, bmm_scales

    assert bmm_scales(0.1, 2.0, 0.5, fp8=True) == pytest.approx((0.1, 2.0))
    assert bmm_scales(0.1, 2.0, 0.5, fp8=False) == (0.1, 1.0)
    assert aligned_width(5, 32) == 8 and aligned_width(1, 128) == 1 and aligned_width(0, 16) == 8


def test_availability_for_each_simulated_capability():
    backend = CuteDslBackend()
    for dev in (B200, SM103, SM107):
        avail = backend.availability_for(dev)
        assert avail.available, (dev, avail.reasons)
        assert "not verified on hardware" in avail.details["path"]
        assert avail.details["flashinfer"].startswith("0.7.2")
    assert backend.availability_for(H200).available and "path" not in backend.availability_for(H200).details
    r = backend.availability_for(A100).reasons
    assert r == ("sm_80: the CuTe DSL kernels run on sm_90 (ours) and sm_100/103/107 (FlashInfer's "
                 "cute-dsl-monolithic) only",)


def test_blackwell_example_policy_routes_the_trtllm_admission_set():
    """examples/policies/blackwell_mla.toml: cute_dsl_mla only for (H, s_q) in {(16,2), (16,4), (128,1)}."""
    from pathlib import Path

    from mlacore.policy import load_policy

    path = Path(__file__).resolve().parents[3] / "examples" / "policies" / "blackwell_mla.toml"
    reg = BackendRegistry(env={}).load()
    disp = Dispatcher(policy=load_policy(str(path)), registry=reg, env={}, simulate=B200)
    for h, s_q in ((16, 2), (16, 4), (128, 1)):
        dec = disp.explain(prob(device=B200, num_heads=h, seq_len_q=s_q, min_kv_len=s_q))
        assert dec.backend == "cute_dsl_mla", (h, s_q, dec.format_trace())
    for h, s_q in ((16, 1), (64, 1), (128, 2)):
        dec = disp.explain(prob(device=B200, num_heads=h, seq_len_q=s_q, min_kv_len=s_q, return_lse=False))
        assert dec.verdict("cute_dsl_mla").outcome == "policy", (h, s_q, dec.format_trace())
        assert dec.backend in ("cutlass_mla", "flashinfer_mla"), dec.format_trace()


def test_the_partial_kernel_is_chosen_per_shape_and_forced_values_are_refused_with_reasons():
    from mla_cute_dsl.backend import partial_kernel

    auto, forced, off = CuteDslOptions(), CuteDslOptions(mma="wgmma"), CuteDslOptions(mma="mma_sync")
    # auto: the seesaw right above the 32-row kernels (0.2.17), any cache dtype; mma=wgmma only when forced
    for kv in ("bf16", "fp8_e4m3"):
        for heads, s_q in ((128, 1), (64, 2), (127, 1), (16, 4), (64, 1), (33, 1), (16, 3), (63, 1)):
            assert partial_kernel(prob(num_heads=heads, seq_len_q=s_q, kv_dtype=kv), auto) == "seesaw", (heads, s_q, kv)
    # 17-32 rows: the balanced seesaw too since 0.2.23 (test_auto_gives_the_balanced_seesaw_at_17_to_32_rows_...);
    # with seesaw_split=even 0.2.22's kernels: fp8reg, mma.sync (wgmma_t on large steps)
    even = CuteDslOptions(seesaw_split="even")
    assert partial_kernel(prob(num_heads=32, kv_dtype="fp8_e4m3"), auto) == "seesaw"
    assert partial_kernel(prob(num_heads=32, kv_dtype="fp8_e4m3"), even) == "fp8reg"
    assert partial_kernel(prob(num_heads=32), even) == "mma_sync"
    assert partial_kernel(prob(num_heads=64, kv_dtype="fp8_e4m3"), forced) == "wgmma"
    assert partial_kernel(prob(q_dtype="fp16", kv_dtype="fp16", num_heads=64), auto) == "seesaw"
    assert partial_kernel(prob(q_dtype="fp16", kv_dtype="fp16", num_heads=33), auto) == "seesaw"
    # auto: an fp8 cache with at most 16 rows goes to the fp8-register kernel, at 17-32 with seesaw_split=even
    assert partial_kernel(prob(num_heads=16, kv_dtype="fp8_e4m3"), auto) == "fp8reg"
    assert partial_kernel(prob(num_heads=16, seq_len_q=2, kv_dtype="fp8_e4m3"), even) == "fp8reg"
    assert partial_kernel(prob(num_heads=1, kv_dtype="fp8_e4m3"), auto) == "fp8reg"
    assert partial_kernel(prob(num_heads=16), auto) == "mma_sync"
    assert partial_kernel(prob(num_heads=128), off) == "mma_sync"
    assert partial_kernel(prob(num_heads=33), forced) == "wgmma" and partial_kernel(prob(num_heads=33), auto) == "seesaw"
    assert partial_kernel(prob(num_heads=128), forced) == "wgmma"
    seesaw = CuteDslOptions(mma="seesaw")
    assert CuteDslBackend().can_implement(prob(num_heads=33).shape, seesaw) == []
    assert CuteDslBackend().can_implement(prob(num_heads=128, kv_dtype="fp8_e4m3").shape, seesaw) == []
    assert CuteDslBackend().can_implement(prob(q_dtype="fp16", kv_dtype="fp8_e4m3", num_heads=40).shape, seesaw) == []
    # forced, the seesaw takes 1-32 rows too (its 64-row tile padded inside); the one-S kernel does not
    for heads, s_q in ((32, 1), (16, 2), (1, 1), (3, 8)):
        assert CuteDslBackend().can_implement(prob(num_heads=heads, seq_len_q=s_q).shape, seesaw) == []
        assert CuteDslBackend().can_implement(prob(num_heads=heads, seq_len_q=s_q, kv_dtype="fp8_e4m3").shape,
                                              seesaw) == []
    assert CuteDslBackend().can_implement(prob(num_heads=32).shape, forced)[0].startswith(
        "mma=wgmma: s_q*num_heads=32 <= 32")
    # ... in its balanced split only (the mode run on a GPU there); from 33 rows the even split too
    for opts in (dict(seesaw_split="even"), dict(ctas_per_sm=2)):
        for kv in ("bf16", "fp8_e4m3"):
            got = CuteDslBackend().can_implement(prob(num_heads=16, seq_len_q=2, kv_dtype=kv).shape,
                                                 CuteDslOptions(mma="seesaw", **opts))
            assert len(got) == 1 and got[0].startswith("mma=seesaw: s_q*num_heads=32 <= 32 runs only the balanced "
                                                        "split"), (opts, kv, got)
            assert CuteDslBackend().can_implement(prob(num_heads=33, kv_dtype=kv).shape,
                                                  CuteDslOptions(mma="seesaw", **opts)) == []
    backend = CuteDslBackend()
    assert backend.can_implement(prob(num_heads=33).shape, forced) == []
    assert backend.can_implement(prob(num_heads=128, kv_dtype="fp8_e4m3").shape, forced) == []
    assert backend.can_implement(prob(num_heads=16, seq_len_q=2, kv_dtype="fp8_e4m3").shape, forced) == [
        "mma=wgmma: s_q*num_heads=32 <= 32 (its tile is 64 query rows, at least half of them padding here; "
        "the mma.sync kernels' 16/32-row tiles fit)"]
    assert backend.can_implement(prob(num_heads=16, kv_dtype="fp8_e4m3").shape, auto) == []
    with pytest.raises(Exception):
        CuteDslOptions(mma="tensor_cores")


# -- mma=auto at 17-32 rows since 0.2.23: the balanced seesaw with every cache (seesaw_few_rows_auto) ---------

# (heads, s_q) at 17, 20, 24 and 32 packed rows; and at 16 rows, where auto keeps fp8reg / mma.sync
FEW_ROWS = ((17, 1), (20, 1), (24, 1), (8, 3), (3, 8), (16, 2), (32, 1))
SIXTEEN_ROWS = ((16, 1), (8, 2), (2, 8))
BALANCED_SEESAW = ("seesaw kernel, balanced split-KV (seesaw_split=balanced: per step the balanced or the even plan, "
                   "whichever is predicted >= 10% faster)")


def _q(kv):
    return "fp16" if kv == "fp16" else "bf16"


@pytest.mark.parametrize("kv", ["bf16", "fp16", "fp8_e4m3"])
def test_auto_gives_the_balanced_seesaw_at_17_to_32_rows_with_every_cache(kv):
    """0.2.23: mma=auto with the default options (seesaw_split=balanced, ctas_per_sm auto) runs the balanced seesaw
    at 17-32 packed rows whatever the cache and whatever the step's KV blocks (one kernel per shape class: no
    per-step rule, the lengths are not read), loading as it was measured there: TMA loads and the TMA producer
    for a 16-bit cache, the producer warpgroup's register ring for fp8. The forced-seesaw refusal at <= 32 rows
    (wgmma_reasons) is not applied to auto: the backend accepts these shapes."""
    from mla_cute_dsl import backend as be

    auto = CuteDslOptions()
    disp = Dispatcher(policy=parse_policy({"mla": {"order": ["cute_dsl_mla", "reference"]}}),
                      registry=BackendRegistry(env={}).load(), env={}, simulate=H200)
    for heads, s_q in FEW_ROWS:
        assert 17 <= heads * s_q <= 32
        p = prob(num_heads=heads, seq_len_q=s_q, q_dtype=_q(kv), kv_dtype=kv)
        assert be.seesaw_few_rows_auto(p, auto), (heads, s_q)
        for blocks in (None, 1, 639, 640, 8192):
            assert be.partial_kernel(p, auto, blocks) == "seesaw", (heads, s_q, blocks)
        assert be.rule_kv_blocks(p, auto, [4096] * 8) is None  # no KV-block rule
        assert be.partial_kernel_for(p, auto, [4096] * 128) == "seesaw"
        assert be.balanced_split(p, auto) and be.ctas_per_sm("seesaw", auto) == 1
        summary = be.kernel_summary(p, auto)
        if kv == "fp8_e4m3":
            assert be.seesaw_fp8_producer(p, auto) and be.seesaw_fp8p_ring(p, auto) == 7
            assert summary == (
                BALANCED_SEESAW + " with an fp8 cache (FP8_SEESAW_BALANCED; the plan's cost model was measured with "
                "16-bit caches), lazy softmax rescale (rescale=lazy), a producer warpgroup with a 7-chunk register "
                "ring converts the fp8 cache (fp8_loader=ring), warpgroup 1's QK waits the other warpgroup's part "
                "of its tile first (wg1_other_first)")
        else:
            assert be.seesaw_tma(p, auto) and be.seesaw_tma_producer(p, auto)
            assert not be.seesaw_q_prefetch(p, auto)  # the TMA producer fetches ahead itself
            assert summary == (
                BALANCED_SEESAW + ", lazy softmax rescale (rescale=lazy), TMA KV loads (loads=auto: TMA from 17 "
                "rows), a producer warpgroup issues the KV tiles and each item's Q by TMA ahead of the math "
                "warpgroups (tma_producer)")
        assert CuteDslBackend().can_implement(p.shape, auto) == []
        dec = disp.explain(p)
        assert dec.backend == "cute_dsl_mla", dec.format_trace()
        assert dec.options.mma == "auto" and be.partial_kernel(p, dec.options) == "seesaw"
    # the rule's bounds: 17 rows and 32 rows are in, 16 and 33 are not (33 is the seesaw at every setting)
    assert be.SEESAW_FEW_ROWS_MIN == 17 and be.SEESAW_MIN_ROWS == 33
    assert not be.seesaw_few_rows_auto(prob(num_heads=16, kv_dtype=kv, q_dtype=_q(kv)), auto)
    assert not be.seesaw_few_rows_auto(prob(num_heads=33, kv_dtype=kv, q_dtype=_q(kv)), auto)
    assert be.partial_kernel(prob(num_heads=33, kv_dtype=kv, q_dtype=_q(kv)), auto) == "seesaw"


@pytest.mark.parametrize("kv", ["bf16", "fp16", "fp8_e4m3"])
def test_auto_keeps_fp8reg_and_mma_sync_at_16_rows(kv):
    """At <= 16 packed rows nothing changed in 0.2.23 (the seesaw measured 1.22-1.35x fp8reg's time with fp8 and
    0.99-1.05x mma.sync's with bf16 at H=16 s_q=1): fp8reg for an fp8 cache, mma.sync for a 16-bit one, at every
    step."""
    from mla_cute_dsl import backend as be

    want = "fp8reg" if kv == "fp8_e4m3" else "mma_sync"
    for heads, s_q in SIXTEEN_ROWS:
        p = prob(num_heads=heads, seq_len_q=s_q, q_dtype=_q(kv), kv_dtype=kv)
        assert not be.seesaw_few_rows_auto(p, CuteDslOptions())
        for blocks in (None, 639, 640, 8192):
            assert be.partial_kernel(p, CuteDslOptions(), blocks) == want, (heads, s_q, blocks)
        assert be.kernel_summary(p, CuteDslOptions()).startswith(f"{want} kernel, ")
        assert CuteDslBackend().can_implement(p.shape, CuteDslOptions()) == []


@pytest.mark.parametrize("kv", ["bf16", "fp16", "fp8_e4m3"])
def test_seesaw_split_even_or_two_ctas_per_sm_keep_the_old_kernels_at_17_to_32_rows(kv):
    """Where the balanced seesaw cannot run (seesaw_split=even; ctas_per_sm=2: one seesaw CTA fills an SM) auto keeps
    0.2.22's kernels at 17-32 rows: fp8reg for an fp8 cache; for a 16-bit one mma.sync below 640 KV blocks and
    wgmma_t from 640 with seesaw_split=even, mma.sync at every step with ctas_per_sm=2 (wgmma_t holds one CTA per
    SM). split_kv=even and ctas_per_sm=1 set by hand leave the seesaw (they do not reach its split)."""
    from mla_cute_dsl import backend as be

    fp8 = kv == "fp8_e4m3"
    for heads, s_q in ((16, 2), (32, 1), (17, 1)):
        p = prob(num_heads=heads, seq_len_q=s_q, q_dtype=_q(kv), kv_dtype=kv)
        for opts in (dict(seesaw_split="even"), dict(ctas_per_sm=2), dict(seesaw_split="even", ctas_per_sm=2)):
            options = CuteDslOptions(**opts)
            assert not be.seesaw_few_rows_auto(p, options)
            by_blocks = opts == dict(seesaw_split="even") and not fp8  # the KV-block rule
            assert be.partial_kernel(p, options) == ("fp8reg" if fp8 else "mma_sync"), opts
            assert be.partial_kernel(p, options, 639) == ("fp8reg" if fp8 else "mma_sync"), opts
            assert be.partial_kernel(p, options, 640) == ("fp8reg" if fp8 else
                                                           "wgmma_t" if by_blocks else "mma_sync"), opts
            assert be.partial_kernel(p, options, 8192) == be.partial_kernel(p, options, 640)
            assert CuteDslBackend().can_implement(p.shape, options) == []
        for opts in (dict(split_kv="even"), dict(ctas_per_sm=1)):
            for blocks in (None, 640):
                assert be.partial_kernel(p, CuteDslOptions(**opts), blocks) == "seesaw", (opts, blocks)


@pytest.mark.parametrize("kv", ["bf16", "fp8_e4m3"])
def test_a_session_at_32_rows_runs_the_balanced_seesaw_at_100_and_1500_kv_blocks(monkeypatch, kv):
    """H=16 s_q=2 with the default options, plans of 100 and 1500 KV blocks (the two sides of the old wgmma_t
    threshold, 640): both the balanced seesaw's entry with the same keywords on the one schedule (made once for one
    CTA per SM, then filled in place), and no mma.sync / wgmma_t partial prebuilt (no per-step switch)."""
    import types

    from mla_cute_dsl.backend import step_kv_blocks
    from mlacore import StepInputs

    rec = types.SimpleNamespace(made=[], filled=[], partials=[])
    session = _cpu_session(monkeypatch, CuteDslOptions(), heads=16, kv_dtype=kv, rec=rec)
    table = torch.zeros(50, 64, dtype=torch.int32)
    problem = prob(num_heads=16, seq_len_q=2, batch_size=50, kv_dtype=kv)
    want = ({"fp8_producer": True, "fp8p_ring": 7, "wg1_other_first": True} if kv == "fp8_e4m3"
            else {"tma": True, "tma_producer": True}) | {"lazy_rescale": True}
    schedules = set()
    for lens, blocks in ((_lens([2] * 50), 100), (_lens([30] * 50), 1500)):
        assert step_kv_blocks(lens) == blocks
        planned = session.plan(problem, StepInputs(lens, table, lens, table))
        assert planned.kernel == "seesaw" and planned.balanced, blocks
        assert planned.run_fn.__name__ == "mla_decode_sm90_wgmma_seesaw_balanced"
        assert planned.run_fn.keywords == want
        assert planned.schedule.balanced
        schedules.add(id(planned.schedule))
    assert len(schedules) == 1
    assert rec.made == [(1, True)] and rec.filled == [(1, True)]
    assert rec.partials == []


def test_fp8reg_takes_fp8_caches_up_to_32_rows_and_refuses_the_rest_with_reasons():
    from mla_cute_dsl.backend import ctas_per_sm, partial_kernel

    fp8reg = CuteDslOptions(mma="fp8reg")
    backend = CuteDslBackend()
    assert backend.can_implement(prob(num_heads=32, kv_dtype="fp8_e4m3").shape, fp8reg) == []
    assert partial_kernel(prob(num_heads=32, kv_dtype="fp8_e4m3"), fp8reg) == "fp8reg"
    r = backend.can_implement(prob(num_heads=16).shape, fp8reg)
    assert r == ["mma=fp8reg: kv_dtype=bf16: this kernel reads an fp8_e4m3 cache only"]
    r = backend.can_implement(prob(num_heads=16, seq_len_q=4, kv_dtype="fp16", q_dtype="fp16").shape, fp8reg)
    assert len(r) == 2 and "s_q*num_heads=64 > 32" in r[1]
    # CTAs per SM: auto gives the fp8-register kernel two, the others one; a set value wins
    assert ctas_per_sm("fp8reg", CuteDslOptions()) == 2
    assert ctas_per_sm("wgmma", CuteDslOptions()) == 1 and ctas_per_sm("mma_sync", CuteDslOptions()) == 1
    assert ctas_per_sm("fp8reg", CuteDslOptions(ctas_per_sm=1)) == 1
    assert ctas_per_sm("mma_sync", CuteDslOptions(ctas_per_sm=2)) == 2


def test_wgmma_t_takes_up_to_32_rows_of_any_cache_and_refuses_more():
    from mla_cute_dsl.backend import balanced_split, ctas_per_sm, kernel_summary, partial_kernel, run_function

    wt = CuteDslOptions(mma="wgmma_t")
    wt_even = CuteDslOptions(mma="wgmma_t", split_kv="even")
    backend = CuteDslBackend()
    for kv, heads, s_q in (("bf16", 16, 2), ("fp8_e4m3", 16, 2), ("bf16", 1, 1), ("bf16", 3, 8),
                           ("fp16", 16, 1)):
        p = prob(num_heads=heads, seq_len_q=s_q, kv_dtype=kv, q_dtype="fp16" if kv == "fp16" else "bf16")
        assert backend.can_implement(p.shape, wt) == []
        assert partial_kernel(p, wt) == "wgmma_t"
        assert partial_kernel(p, CuteDslOptions()) != "wgmma_t"  # auto without the step's blocks: never
        assert not balanced_split(p, wt_even) and kernel_summary(p, wt_even) == "wgmma_t kernel, even split-KV"
        if kv == "fp8_e4m3":  # no balanced mode for an fp8 cache: split_kv=balanced is ignored, and says so
            assert not balanced_split(p, wt)
            assert kernel_summary(p, wt) == (
                "wgmma_t kernel, even split-KV (split_kv=balanced ignored: it applies to the mma.sync and wgmma_t "
                "kernels with a bf16/fp16 cache, this shape has an fp8 cache)")
        else:  # a 16-bit cache follows split_kv (balanced, the default): the balanced wgmma_t kernel
            assert balanced_split(p, wt)
            assert kernel_summary(p, wt).startswith("wgmma_t kernel, balanced split-KV (split_kv=balanced")
    r = backend.can_implement(prob(num_heads=16, seq_len_q=4).shape, wt)
    assert r == ["mma=wgmma_t: s_q*num_heads=64 > 32 (query rows are its WGMMA N: 16 or 32)"]
    assert ctas_per_sm("wgmma_t", CuteDslOptions()) == 1
    assert run_function("wgmma_t").__name__ == "mla_decode_sm90_wgmma_t"
    assert run_function("wgmma_t", balanced=True).__name__ == "mla_decode_sm90_wgmma_t_balanced"


@pytest.mark.parametrize("kv_dtype,heads,s_q,kernel,ctas", [
    ("fp8_e4m3", 16, 1, "fp8reg", 2), ("fp8_e4m3", 64, 1, "seesaw", 1), ("bf16", 16, 1, "mma_sync", 1),
    ("bf16", 128, 1, "seesaw", 1), ("fp8_e4m3", 128, 1, "seesaw", 1),
    # 32 rows: the balanced seesaw under auto since 0.2.23, one CTA per SM with either cache
    ("fp8_e4m3", 16, 2, "seesaw", 1), ("bf16", 16, 2, "seesaw", 1),
])
def test_the_session_plans_each_kernel_with_its_ctas_per_sm_and_builds_both_combines(
        monkeypatch, kv_dtype, heads, s_q, kernel, ctas):
    """CuteDslSession.plan on the CPU (device properties patched, schedule tensors kept on the CPU): the
    schedule is made for the kernel's CTAs per SM, the Planned runs that kernel's function, and both combine
    kernels are built at the first plan (so warmup builds them and no step compiles)."""
    import types

    from mla_cute_dsl import backend as be
    from mla_cute_dsl.kernels import api, schedule
    from mlacore import SessionConfig, StepInputs

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev: types.SimpleNamespace(
        multi_processor_count=132))
    made, built = [], []
    real_make, real_alloc = schedule.make_schedule, schedule.alloc_workspace
    monkeypatch.setattr(schedule, "make_schedule", lambda *a, **k: made.append(k["ctas_per_sm"]) or real_make(
        *a, **{**k, "device": "cpu"}))
    monkeypatch.setattr(schedule, "alloc_workspace", lambda sched, device=None, partial_dtype=torch.float32:
                        real_alloc(sched, device="cpu", partial_dtype=partial_dtype))
    monkeypatch.setattr(api, "get_combine_kernel",
                        lambda q, wide=False, pdl=True, partial="fp32", cols=512: built.append((q, wide, pdl, cols)))
    config = SessionConfig(num_heads=heads, page_size=64, q_dtype="bf16", kv_dtype=kv_dtype, out_dtype="bf16",
                           kv_lora_rank=512, qk_rope_head_dim=64, causal=True, return_lse=True, sm_scale=0.1,
                           kv_scale=1.0, q_scale=1.0, device=H200)
    session = CuteDslBackend().open(config, CuteDslOptions())
    lens = torch.tensor([4096, 100], dtype=torch.int32)
    table = torch.zeros(2, 64, dtype=torch.int32)
    problem = prob(num_heads=heads, seq_len_q=s_q, batch_size=2, kv_dtype=kv_dtype)
    planned = session.plan(problem, StepInputs(lens, table, lens, table))
    assert made == [ctas]
    # every combine a step may pick by its batch (combine_kind_for): wide, row and chunked
    want = {("bf16", True, False, 512), ("bf16", False, False, 512), ("bf16", False, False, 128)}
    assert set(built) == want and len(built) == len(want)  # option pdl: false by default
    runs = {"fp8reg": "mla_decode_sm90_fp8", "wgmma": "mla_decode_sm90_wgmma",
            # seesaw_split=balanced (the default since 0.2.13) takes the seesaw with a 16-bit cache to its balanced
            # entry, split_kv=balanced (the default) the mma.sync kernel
            "seesaw": "mla_decode_sm90_wgmma_seesaw_balanced",  # fp8 too since 0.2.17 (FP8_SEESAW_BALANCED)
            "mma_sync": "mla_decode_sm90" if kv_dtype == "fp8_e4m3" else "mla_decode_sm90_balanced"}
    assert planned.run_fn.__name__ == runs[kernel]
    session.plan(problem, StepInputs(lens, table, lens, table))
    assert len(built) == len(want) and made == [ctas, ctas]  # once per session
    assert be.partial_kernel(problem, CuteDslOptions()) == kernel


# -- mma=auto's KV-block rule: wgmma_t for a 16-bit cache at 17-32 rows from 640 KV blocks per step ---------
# (since 0.2.23 auto gives the balanced seesaw at 17-32 rows, so the rule applies with seesaw_split=even only:
# EVEN_SEESAW below; ctas_per_sm=2 keeps 0.2.22's kernels too, with the rule off as before)

EVEN_SEESAW = CuteDslOptions(seesaw_split="even")

# packed rows -> (heads, s_q) pairs; several s_q per row count
ROWS = {16: ((16, 1), (8, 2)), 17: ((17, 1),), 24: ((3, 8), (24, 1), (12, 2)), 32: ((16, 2), (32, 1), (8, 4)),
        33: ((33, 1),)}


def _lens(blocks_each, last=None):
    """Host lengths: one request per entry of blocks_each, each ending mid-block (64 * n - 31 tokens: n blocks),
    the last one `last` tokens when given."""
    lens = [64 * n - 31 for n in blocks_each]
    if last is not None:
        lens[-1] = last
    return torch.tensor(lens, dtype=torch.int32)


def test_step_kv_blocks_is_the_sum_of_ceil_len_over_64_as_the_schedule_counts():
    from mla_cute_dsl.backend import WGMMA_T_AUTO_MIN_BLOCKS, step_kv_blocks
    from mla_cute_dsl.kernels import schedule as S

    assert WGMMA_T_AUTO_MIN_BLOCKS == 640
    assert step_kv_blocks([0, 1, 63, 64, 65, 128, 129]) == 0 + 1 + 1 + 1 + 2 + 2 + 3
    assert step_kv_blocks(torch.tensor([4032] * 9 + [4033], dtype=torch.int32)) == 9 * 63 + 64
    assert step_kv_blocks([]) == 0 and step_kv_blocks(torch.zeros(0, dtype=torch.int32)) == 0
    gen = torch.Generator().manual_seed(5)
    for _ in range(20):
        lens = torch.randint(0, 9000, (int(torch.randint(1, 200, (1,), generator=gen)),), generator=gen)
        assert step_kv_blocks(lens) == int(S._nblocks(lens.to(torch.int64)).sum())


@pytest.mark.parametrize("kv", ["bf16", "fp16", "fp8_e4m3"])
def test_auto_picks_wgmma_t_for_a_16_bit_cache_at_17_to_32_rows_from_640_kv_blocks(kv):
    """The KV-block rule where it still applies (seesaw_split=even: the default balanced seesaw takes 17-32 rows
    since 0.2.23): by the step's blocks, not its batch; forced kernels, split_kv=even and ctas_per_sm=2 keep one
    kernel."""
    from mla_cute_dsl.backend import balanced_split, ctas_per_sm, partial_kernel, partial_kernel_for

    q = "fp16" if kv == "fp16" else "bf16"
    auto = EVEN_SEESAW
    steps = {  # host lengths -> their KV blocks (uniform, spread, one block short, mid-block boundaries)
        "639 uniform-ish": (_lens([64] * 10, last=4032), 639), "640 uniform": (_lens([64] * 10), 640),
        "640 at a block edge": (_lens([64] * 10, last=4033), 640), "639 spread": (_lens([1, 638]), 639),
        "640 spread": (_lens([1, 2, 3, 634]), 640), "small": (_lens([4] * 8), 32),
        "big batch, few blocks": (_lens([1] * 128), 128), "many": (_lens([64] * 128), 8192),
    }
    for rows, pairs in ROWS.items():
        for heads, s_q in pairs:
            p = prob(num_heads=heads, seq_len_q=s_q, batch_size=8, q_dtype=q, kv_dtype=kv)
            for name, (lens, blocks) in steps.items():
                if kv == "fp8_e4m3":  # never: fp8reg up to 32 rows, the seesaw above (0.2.16)
                    want = "fp8reg" if rows <= 32 else "seesaw"
                else:
                    want = ("seesaw" if rows > 32 else  # from 33 rows at any step (0.2.17)
                            "wgmma_t" if 17 <= rows <= 32 and blocks >= 640 else "mma_sync")
                assert partial_kernel_for(p, auto, lens) == want, (kv, rows, name)
                assert partial_kernel(p, auto, blocks) == want
                # the batch plays no part: the same blocks in one request or many
                assert partial_kernel(prob(num_heads=heads, seq_len_q=s_q, batch_size=1, q_dtype=q, kv_dtype=kv),
                                      auto, blocks) == want
                # what differs between the two kernels is nothing the session's buffers are keyed by
                # (the seesaw from 33 rows runs its even split here: seesaw_split=even)
                assert balanced_split(p, auto) == (kv != "fp8_e4m3" and rows <= 32)
                assert ctas_per_sm(want, auto) == (2 if want == "fp8reg" else 1)
                # forced kernels stay forced at every step
                assert partial_kernel_for(p, CuteDslOptions(mma="mma_sync"), lens) == "mma_sync"
                if rows <= 32:
                    assert partial_kernel_for(p, CuteDslOptions(mma="wgmma_t"), lens) == "wgmma_t"
                    assert partial_kernel_for(p, CuteDslOptions(mma="wgmma_t", split_kv="even"), lens) == "wgmma_t"
                # split_kv=even: auto keeps the mma.sync even kernel (the rule is for the balanced modes)
                off = ("fp8reg" if kv == "fp8_e4m3" else "mma_sync") if rows <= 32 else "seesaw"
                assert partial_kernel_for(p, CuteDslOptions(split_kv="even", seesaw_split="even"), lens) == off
                # two CTAs per SM set by hand: wgmma_t holds one, auto keeps mma.sync (whatever seesaw_split says:
                # the balanced seesaw holds one too); one set by hand: as auto
                assert partial_kernel_for(p, CuteDslOptions(ctas_per_sm=2), lens) == off
                assert partial_kernel_for(p, CuteDslOptions(ctas_per_sm=2, seesaw_split="even"), lens) == off
                assert partial_kernel_for(p, CuteDslOptions(ctas_per_sm=1, seesaw_split="even"), lens) == want
            # without lengths (a shape class, a problem): the answer below the threshold
            assert partial_kernel(p, auto) == (("fp8reg" if kv == "fp8_e4m3" else "mma_sync") if rows <= 32
                                               else "seesaw")


def test_kernel_summary_and_explain_name_the_kv_block_rule():
    """The summary names the KV-block rule (seesaw_split=even since 0.2.23) with its threshold and side, and
    nowhere it does not apply; the notes and the option descriptions say where it runs."""
    from mla_cute_dsl.backend import kernel_summary

    auto = EVEN_SEESAW
    p = prob(num_heads=16, seq_len_q=2, batch_size=10)
    assert kernel_summary(p, auto, 640) == (
        "wgmma_t kernel, balanced split-KV (split_kv=balanced: per step the balanced or the even plan, whichever "
        "is predicted >= 10% faster); mma=auto: 640 KV blocks >= 640 at 32 rows with a 16-bit cache (wgmma_t "
        "measured -0.6..+14% against mma.sync from 768 blocks on an H200)")
    assert kernel_summary(p, auto, 639) == (
        "mma_sync kernel, balanced split-KV (split_kv=balanced: per step the balanced or the even plan, whichever "
        "is predicted >= 10% faster); mma=auto: 639 KV blocks < 640 at 32 rows with a 16-bit cache (wgmma_t "
        "measured mostly 4-7% slower than mma.sync at <= 384 blocks, 0-2% at 512 on an H200; it runs from 640 "
        "blocks)")
    for shape_or_problem in (p, p.shape):  # without the step's blocks: both sides of the threshold
        assert kernel_summary(shape_or_problem, auto).endswith(
            "; mma=auto at 32 rows with a 16-bit cache, per step: this kernel below 640 KV blocks (sum of "
            "ceil(kv_len/64) over the step's requests), the wgmma_t kernel from 640 (the same schedule buffers: "
            "graph-safe)")
        assert kernel_summary(shape_or_problem, auto).startswith("mma_sync kernel, balanced split-KV")
    # no rule where it does not apply: forced kernels, split_kv=even, ctas_per_sm=2, fp8, 16 and 33 rows, and the
    # default seesaw_split=balanced (the balanced seesaw at 17-32 rows at every step since 0.2.23)
    assert kernel_summary(p, CuteDslOptions(mma="mma_sync"), 5000).startswith("mma_sync kernel, balanced")
    assert "mma=auto" not in kernel_summary(p, CuteDslOptions(mma="mma_sync"), 5000)
    assert kernel_summary(p, CuteDslOptions(mma="wgmma_t"), 5).startswith("wgmma_t kernel, balanced")
    assert kernel_summary(p, CuteDslOptions(split_kv="even", seesaw_split="even"), 5000) == (
        "mma_sync kernel, even split-KV")
    for blocks in (None, 639, 5000):
        default = kernel_summary(p, CuteDslOptions(), blocks)
        assert default.startswith("seesaw kernel, balanced split-KV") and "mma=auto" not in default
    assert "mma=auto" not in kernel_summary(p, CuteDslOptions(ctas_per_sm=2), 5000)
    assert "mma=auto" not in kernel_summary(prob(num_heads=16), auto, 5000)
    assert "mma=auto" not in kernel_summary(prob(num_heads=33), auto, 5000)
    assert kernel_summary(prob(num_heads=16, seq_len_q=2, kv_dtype="fp8_e4m3"), auto, 5000) == (
        "fp8reg kernel, even split-KV (split_kv=balanced ignored: it applies to the mma.sync and wgmma_t kernels "
        "with a bf16/fp16 cache, this shape runs the fp8reg kernel)")
    # `mla backends list` prints the notes: the graph caveat; the rule with its threshold is in the option's
    # description (`mla backends options`)
    notes = CuteDslBackend().info().notes
    assert any("seesaw_split=even" in n and "17-32 rows" in n and "CUDA graph" in n and "representative lengths" in n
               for n in notes)
    assert not any("batch size is >=" in n for n in notes)
    desc = CuteDslOptions.model_fields["mma"].description
    assert "wgmma_t for a bf16/fp16 cache at 17-32 rows when the step has >= 640 KV blocks" in desc
    assert "with seesaw_split=even or ctas_per_sm=2 at 17-32 rows 0.2.22's rules" in desc
    assert "ceil(kv_len/64)" in desc and "CUDA graph" in desc
    assert "KV-block rule" in CuteDslOptions.model_fields["split_kv"].description


def _rule_session(monkeypatch, options=None, heads=16):
    """_cpu_session with lse off (its scratch on the CPU) and the recorder returned: make_schedule's calls (new /
    in place) and the partial kernels built (none compiled)."""
    import types

    from mla_cute_dsl.kernels import schedule

    rec = types.SimpleNamespace(made=[], filled=[], partials=[], make_schedule=schedule.make_schedule)
    session = _cpu_session(monkeypatch, options or CuteDslOptions(), heads=heads, return_lse=False, rec=rec)
    session.device = torch.device("cpu")  # the lse scratch (return_lse=False) on the CPU
    return session, rec


def test_a_session_picks_the_kernel_per_plan_by_kv_blocks_on_the_same_buffers(monkeypatch):
    """With seesaw_split=even (where the rule applies since 0.2.23), plans of one batch size (64, H16 s_q2: 32
    rows, bf16) at 639 and 640 blocks (uniform, at a block edge,
    spread: the hybrid's even and balanced forms) run mma.sync or wgmma_t by blocks (the Planned's kernel and
    run_fn), every plan on the one schedule, workspace and lse scratch of s_q=2 (made once for one CTA per SM,
    then filled in place), each schedule equal to make_schedule's own for those lengths (so it does not depend
    on the kernel): a graph captured after any of these plans replays its kernel on any later one's buffers.
    Both partial kernels are built at the first plan, whichever side it is on."""
    from mlacore import StepInputs

    session, rec = _rule_session(monkeypatch, EVEN_SEESAW)
    table = torch.zeros(64, 64, dtype=torch.int32)
    problem = prob(num_heads=16, seq_len_q=2, batch_size=64, return_lse=False)
    steps = [(_lens([10] * 64, last=576), "mma_sync"), (_lens([10] * 64), "wgmma_t"),
             (_lens([1] * 63 + [576]), "mma_sync"), (_lens([1] * 63 + [577]), "wgmma_t"),
             (_lens([10] * 64, last=577), "wgmma_t"), (_lens([1] * 64), "mma_sync")]
    seen, combos = set(), set()
    for lens, want in steps:
        planned = session.plan(problem, StepInputs(lens, table, lens, table))
        assert planned.kernel == want and planned.balanced
        assert planned.run_fn.__name__ == {"wgmma_t": "mla_decode_sm90_wgmma_t_balanced",
                                           "mma_sync": "mla_decode_sm90_balanced"}[want]
        sched = planned.schedule
        assert sched.block_m == 32 and sched.num_cols == 132 and sched.balanced
        fresh = rec.make_schedule(lens, 2, 16, 132, device="cpu", balanced=True, ctas_per_sm=1)
        assert torch.equal(sched.work_info, fresh.work_info) and torch.equal(sched.split_info, fresh.split_info)
        assert torch.equal(sched.cta_ranges, fresh.cta_ranges) and sched.wide_combine == fresh.wide_combine
        seen.add((id(sched), id(planned.workspace), id(planned.lse_scratch)))
        combos.add((want, sched.form))
    assert combos == {(k, f) for k in ("mma_sync", "wgmma_t") for f in ("even", "balanced")}
    assert len(seen) == 1  # one schedule, one workspace, one lse scratch for both kernels
    assert rec.made == [(1, True)] and rec.filled == [(1, True)] * (len(steps) - 1)
    assert rec.partials == [("mma_sync", ("bf16", "bf16", 32, None), {"balanced": True, "partial": "bf16",
                                                                        "wide_store": True}),
                            ("wgmma_t", ("bf16", "bf16", 32), {"partial": "bf16"})]  # once per session, first plan
    # where the rule does not apply (16 rows here) the session builds nothing extra at plan
    big = _lens([64] * 64)
    planned = session.plan(prob(num_heads=16, seq_len_q=1, batch_size=64), StepInputs(big, table, big, table))
    assert planned.kernel == "mma_sync" and len(rec.partials) == 2


@pytest.mark.parametrize("options,heads,s_q,kernel", [
    ({"mma": "mma_sync"}, 16, 2, "mma_sync"), ({"mma": "wgmma_t"}, 16, 2, "wgmma_t"),
    ({"split_kv": "even", "seesaw_split": "even"}, 16, 2, "mma_sync"), ({"ctas_per_sm": 2}, 16, 2, "mma_sync"),
    ({}, 16, 1, "mma_sync"), ({}, 33, 1, "seesaw"), ({}, 16, 2, "seesaw"), ({}, 3, 8, "seesaw"),
    ({"ctas_per_sm": 1, "seesaw_split": "even"}, 3, 8, None),
])
def test_options_and_shapes_that_disable_the_rule_keep_one_kernel_and_build_nothing_extra(
        monkeypatch, options, heads, s_q, kernel):
    """Forced kernels, split_kv=even, two CTAs per SM, 16 and 33 rows, and the defaults at 17-32 rows (the
    balanced seesaw since 0.2.23): the same kernel at 639 and 640 blocks and no second partial built at plan;
    ctas_per_sm=1 set by hand with seesaw_split=even keeps the rule (kernel None: by blocks)."""
    from mlacore import StepInputs

    session, rec = _rule_session(monkeypatch, CuteDslOptions(**options), heads=heads)
    table = torch.zeros(10, 64, dtype=torch.int32)
    problem = prob(num_heads=heads, seq_len_q=s_q, batch_size=10)
    got = [session.plan(problem, StepInputs(lens, table, lens, table)).kernel
           for lens in (_lens([64] * 10, last=4032), _lens([64] * 10))]
    assert got == ([kernel] * 2 if kernel else ["mma_sync", "wgmma_t"])
    assert len(rec.partials) == (0 if kernel else 2)
    assert rec.made[0][0] == (2 if options.get("ctas_per_sm") == 2 else 1)


def test_an_fp8_cache_never_runs_wgmma_t_under_auto(monkeypatch):
    """An fp8 cache on a step of 8192 KV blocks (far above the rule's 640): fp8reg up to 32 rows with
    seesaw_split=even (where the KV-block rule runs for a 16-bit cache), the balanced seesaw at 17-32 rows with the
    defaults (0.2.23), fp8reg at 16; never wgmma_t."""
    from mla_cute_dsl.backend import partial_kernel_for
    from mlacore import StepInputs

    table = torch.zeros(128, 64, dtype=torch.int32)
    lens = _lens([64] * 128)
    for heads, s_q in ((16, 2), (3, 8), (17, 1), (16, 1)):
        problem = prob(num_heads=heads, seq_len_q=s_q, batch_size=128, kv_dtype="fp8_e4m3")
        session = _cpu_session(monkeypatch, EVEN_SEESAW, heads=heads, kv_dtype="fp8_e4m3")
        planned = session.plan(problem, StepInputs(lens, table, lens, table))
        assert planned.kernel == "fp8reg" and not planned.balanced
        assert planned.run_fn.__name__ == "mla_decode_sm90_fp8"
        assert partial_kernel_for(problem, EVEN_SEESAW, lens) == "fp8reg"
        default = _cpu_session(monkeypatch, CuteDslOptions(), heads=heads, kv_dtype="fp8_e4m3").plan(
            problem, StepInputs(lens, table, lens, table))
        assert default.kernel == ("fp8reg" if heads * s_q <= 16 else "seesaw")
        assert partial_kernel_for(problem, CuteDslOptions(), lens) == default.kernel


# -- option split_kv: the balanced split-KV kernel with the hybrid plan --------------------------------------


def test_split_kv_is_validated_and_names_its_values():
    from mlacore.errors import PolicyError
    from mlacore.tools.bench import BackendSpec
    from mlacore.testing.compare import only_backend_dispatcher

    assert CuteDslOptions().split_kv == "balanced"
    assert CuteDslOptions(split_kv="even").split_kv == "even"
    with pytest.raises(Exception, match=r"split_kv\s+Input should be 'even' or 'balanced'"):
        CuteDslOptions(split_kv="greedy")
    reg = BackendRegistry(env={}).load()
    bad = {"mla": {"order": ["cute_dsl_mla"]}, "backend": {"cute_dsl_mla": {"options": {"split_kv": "fair"}}}}
    with pytest.raises(PolicyError, match=r"backend.cute_dsl_mla.options.split_kv: Input should be 'even' or "
                                          r"'balanced'"):
        Dispatcher(policy=parse_policy(bad), registry=reg, env={})
    # `mla bench --backend cute_dsl_mla:split_kv=balanced` builds its dispatcher this way
    spec = BackendSpec.parse("cute_dsl_mla:split_kv=balanced")
    d = only_backend_dispatcher(spec.name, reg, dict(spec.options))
    assert d.options["cute_dsl_mla"].base.split_kv == "balanced"


def test_split_kv_applies_only_to_the_mma_sync_and_wgmma_t_kernels_with_a_16_bit_cache():
    from mla_cute_dsl.backend import balanced_split, kernel_summary

    bal = CuteDslOptions(split_kv="balanced")
    assert balanced_split(prob(num_heads=16), bal) and balanced_split(prob(num_heads=16, seq_len_q=2), bal)
    assert balanced_split(prob(q_dtype="fp16", kv_dtype="fp16", num_heads=5, seq_len_q=4), bal)
    assert balanced_split(prob(num_heads=16), CuteDslOptions())  # the default since 0.2.3: balanced
    assert not balanced_split(prob(num_heads=16), CuteDslOptions(split_kv="even"))
    assert not balanced_split(prob(num_heads=16, kv_dtype="fp8_e4m3"), bal)  # fp8reg
    assert not balanced_split(prob(num_heads=16, kv_dtype="fp8_e4m3"), CuteDslOptions(split_kv="balanced",
                                                                                       mma="mma_sync"))
    assert not balanced_split(prob(num_heads=64), CuteDslOptions(split_kv="balanced", mma="wgmma"))
    assert balanced_split(prob(num_heads=64), bal)  # the balanced seesaw from 33 rows (seesaw_split)
    # the seesaw follows its own option seesaw_split (default balanced since 0.2.13), never split_kv
    assert balanced_split(prob(num_heads=128), bal)
    assert not balanced_split(prob(num_heads=128), CuteDslOptions(split_kv="balanced", seesaw_split="even"))
    assert balanced_split(prob(num_heads=128), CuteDslOptions(split_kv="balanced", mma="mma_sync"))
    assert balanced_split(prob(num_heads=16, seq_len_q=2), CuteDslOptions(split_kv="balanced", mma="wgmma_t"))
    assert not balanced_split(prob(num_heads=16, kv_dtype="fp8_e4m3"), CuteDslOptions(mma="wgmma_t"))
    assert not balanced_split(prob(num_heads=64), CuteDslOptions(mma="wgmma"))
    # which kernel runs, and why the option is ignored where it is
    assert kernel_summary(prob(num_heads=16), bal).startswith("mma_sync kernel, balanced split-KV")
    assert kernel_summary(prob(num_heads=16), CuteDslOptions(split_kv="even")) == "mma_sync kernel, even split-KV"
    assert kernel_summary(prob(num_heads=128), CuteDslOptions(split_kv="balanced", seesaw_split="even")) == (
        "seesaw kernel, even split-KV (split_kv=balanced ignored: it applies to the mma.sync and wgmma_t kernels "
        "with a bf16/fp16 cache, this shape runs the seesaw kernel), lazy softmax rescale (rescale=lazy), cp.async KV "
        "loads (loads=auto: TMA from 256 rows)")
    assert ", eager softmax rescale (rescale=eager), TMA KV loads" in kernel_summary(
        prob(num_heads=128), CuteDslOptions(rescale="eager"))
    assert kernel_summary(prob(num_heads=128, kv_dtype="fp8_e4m3"), CuteDslOptions()).endswith(
        ", lazy softmax rescale (rescale=lazy), a producer warpgroup with a 7-chunk register ring converts the fp8 "
        "cache (fp8_loader=ring), warpgroup 1's QK waits the other warpgroup's part of its tile first "
        "(wg1_other_first)")
    assert "rescale" not in kernel_summary(prob(num_heads=16), CuteDslOptions(rescale="eager"))
    assert kernel_summary(prob(num_heads=16, kv_dtype="fp8_e4m3"), CuteDslOptions(split_kv="balanced",
                                                                                   mma="mma_sync")).endswith(
        "this shape has an fp8 cache)")
    # the option never refuses a shape: ignored, not a reason
    backend = CuteDslBackend()
    for h, kv in ((16, "bf16"), (16, "fp8_e4m3"), (128, "bf16")):
        assert backend.can_implement(prob(num_heads=h, kv_dtype=kv).shape, bal) == []
    assert "mma.sync" in CuteDslOptions.model_fields["split_kv"].description


def _cpu_session(monkeypatch, options, heads=16, kv_dtype="bf16", return_lse=True, rec=None):
    """A CuteDslSession on the CPU: 132 SMs, schedules and workspaces on the CPU, no kernel compiled (the combine
    getter and both balanced partial getters stubbed: a bf16 session at 17-32 rows builds both partials at its
    first plan). `rec` (optional) records make_schedule's calls as (ctas_per_sm, balanced) in rec.made (new) or
    rec.filled (in place) and the partial builds in rec.partials."""
    import types

    from mla_cute_dsl.kernels import api, schedule, sm90_wgmma_t_decode
    from mlacore import SessionConfig

    rec = rec if rec is not None else types.SimpleNamespace(made=[], filled=[], partials=[])
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev: types.SimpleNamespace(
        multi_processor_count=132))
    real_make, real_alloc = schedule.make_schedule, schedule.alloc_workspace

    def make(*a, **k):
        (rec.filled if k.get("out") is not None else rec.made).append((k.get("ctas_per_sm"), k.get("balanced", False)))
        return real_make(*a, **{**k, "device": "cpu"})

    monkeypatch.setattr(schedule, "make_schedule", make)
    monkeypatch.setattr(schedule, "alloc_workspace", lambda sched, device=None, partial_dtype=torch.float32:
                        real_alloc(sched, device="cpu", partial_dtype=partial_dtype))
    monkeypatch.setattr(api, "get_combine_kernel", 
                        lambda q, wide=False, pdl=False, partial="fp32", cols=512: None)
    monkeypatch.setattr(api, "get_partial_kernel", lambda *a, **k: rec.partials.append(("mma_sync", a, k)))
    monkeypatch.setattr(sm90_wgmma_t_decode, "get_partial_kernel_wgmma_t_balanced",
                        lambda *a, **k: rec.partials.append(("wgmma_t", a, k)))
    config = SessionConfig(num_heads=heads, page_size=64, q_dtype="bf16", kv_dtype=kv_dtype, out_dtype="bf16",
                           kv_lora_rank=512, qk_rope_head_dim=64, causal=True, return_lse=return_lse, sm_scale=0.1,
                           kv_scale=1.0, q_scale=1.0, device=H200)
    return CuteDslBackend().open(config, options)


def test_the_session_plans_the_hybrid_schedule_into_fixed_buffers_for_split_kv_balanced(monkeypatch):
    """split_kv=balanced through CuteDslSession.plan: the balanced entry runs, the schedule is a balanced one
    whose form follows the lengths (uniform: even, skewed: balanced), re-planned in place (the buffers a
    captured graph reads stay), and equal to make_schedule's own answer for those lengths."""
    import random

    from mla_cute_dsl.kernels import schedule as S
    from mlacore import StepInputs

    session = _cpu_session(monkeypatch, CuteDslOptions(split_kv="balanced"))
    B = 64
    rng = random.Random(1234)
    steps = [[8192] * B, [rng.randint(1, 8192) for _ in range(B)], [8192] * B]
    table = torch.zeros(B, 128, dtype=torch.int32)
    problem = prob(batch_size=B, max_kv_len=8192)
    forms, ptrs = [], set()
    for lens_l in steps:
        lens = torch.tensor(lens_l, dtype=torch.int32)
        planned = session.plan(problem, StepInputs(lens, table, lens, table))
        sched = planned.schedule
        assert planned.run_fn.__name__ == "mla_decode_sm90_balanced" and sched.balanced
        ptrs.add((sched.work_info.data_ptr(), sched.split_info.data_ptr(), sched.cta_ranges.data_ptr(),
                  planned.workspace[0].data_ptr()))
        fresh = S.make_schedule(lens_l, 1, 16, 132, device="cpu", balanced=True)
        assert torch.equal(sched.work_info, fresh.work_info) and torch.equal(sched.cta_ranges, fresh.cta_ranges)
        forms.append(sched.form)
    assert forms == ["even", "balanced", "even"] and len(ptrs) == 1
    # split_kv=even, and shapes the option does not apply to: the even entries, no ranges
    even = _cpu_session(monkeypatch, CuteDslOptions(split_kv="even")).plan(problem, StepInputs(lens, table, lens, table))
    assert even.run_fn.__name__ == "mla_decode_sm90" and not even.schedule.balanced
    fp8 = _cpu_session(monkeypatch, CuteDslOptions(split_kv="balanced"), kv_dtype="fp8_e4m3").plan(
        prob(batch_size=B, kv_dtype="fp8_e4m3"), StepInputs(lens, table, lens, table))
    assert fp8.run_fn.__name__ == "mla_decode_sm90_fp8" and not fp8.schedule.balanced


def test_split_kv_balanced_run_does_no_host_work_beyond_the_launch(monkeypatch):
    """Planned.run for split_kv=balanced calls the balanced entry with the plan's own buffers and check=False
    (run stays free of host work: no schedule, no checks)."""
    from mla_cute_dsl import backend as be
    from mlacore import StepInputs

    session = _cpu_session(monkeypatch, CuteDslOptions(split_kv="balanced"))
    lens = torch.tensor([100, 4000], dtype=torch.int32)
    table = torch.zeros(2, 64, dtype=torch.int32)
    planned = session.plan(prob(batch_size=2), StepInputs(lens, table, lens, table))
    calls = []
    planned.run_fn = lambda *a, **k: calls.append((a, k))
    q, kv, out = object(), object(), object()
    planned.run(q, kv, out, None)
    (args, kw), = calls
    assert kw == {"check": False} and args[0] is q and args[8] is planned.schedule and args[9] is planned.workspace
    with pytest.raises(ValueError, match="mma_sync and wgmma_t kernels only"):
        be.run_function("wgmma", balanced=True)
    with pytest.raises(ValueError, match="mma_sync and wgmma_t kernels only"):
        be.run_function("fp8reg", balanced=True)


def test_the_session_plans_the_hybrid_schedule_for_mma_wgmma_t(monkeypatch):
    """mma=wgmma_t with split_kv=balanced (the default) through CuteDslSession.plan: the balanced wgmma_t entry
    over a balanced schedule for one CTA per SM, its form following the lengths in the same buffers (so a graph
    captured at one step replays at the next), equal to make_schedule's own answer; Planned.run passes the
    plan's buffers with check=False; split_kv=even and an fp8 cache keep the even wgmma_t entry."""
    import random

    from mla_cute_dsl.kernels import schedule as S
    from mlacore import StepInputs

    session = _cpu_session(monkeypatch, CuteDslOptions(mma="wgmma_t"))
    B = 64
    rng = random.Random(99)
    steps = [[4096] * B, [rng.randint(1, 8192) for _ in range(B)], [4096] * B]
    table = torch.zeros(B, 128, dtype=torch.int32)
    problem = prob(batch_size=B, seq_len_q=2, max_kv_len=8192)
    forms, ptrs = [], set()
    for lens_l in steps:
        lens = torch.tensor(lens_l, dtype=torch.int32)
        planned = session.plan(problem, StepInputs(lens, table, lens, table))
        sched = planned.schedule
        assert planned.run_fn.__name__ == "mla_decode_sm90_wgmma_t_balanced" and sched.balanced
        assert sched.block_m == 32 and sched.num_cols == 132  # 32 rows: one m-block, a column per SM
        ptrs.add((sched.work_info.data_ptr(), sched.split_info.data_ptr(), sched.cta_ranges.data_ptr(),
                  planned.workspace[0].data_ptr()))
        fresh = S.make_schedule(lens_l, 2, 16, 132, device="cpu", balanced=True, ctas_per_sm=1)
        assert torch.equal(sched.work_info, fresh.work_info) and torch.equal(sched.cta_ranges, fresh.cta_ranges)
        forms.append(sched.form)
    assert forms == ["even", "balanced", "even"] and len(ptrs) == 1
    calls = []
    planned.run_fn = lambda *a, **k: calls.append((a, k))
    planned.run(object(), object(), object(), None)
    (args, kw), = calls
    assert kw == {"check": False} and args[8] is planned.schedule and args[9] is planned.workspace
    even = _cpu_session(monkeypatch, CuteDslOptions(mma="wgmma_t", split_kv="even")).plan(
        problem, StepInputs(lens, table, lens, table))
    assert even.run_fn.__name__ == "mla_decode_sm90_wgmma_t" and not even.schedule.balanced
    fp8 = _cpu_session(monkeypatch, CuteDslOptions(mma="wgmma_t"), kv_dtype="fp8_e4m3").plan(
        prob(batch_size=B, seq_len_q=2, kv_dtype="fp8_e4m3"), StepInputs(lens, table, lens, table))
    assert fp8.run_fn.__name__ == "mla_decode_sm90_wgmma_t" and not fp8.schedule.balanced


# -- option num_sms: schedules for fewer SMs than the GPU has ------------------------------------------------


def test_num_sms_is_validated_and_names_the_option():
    from mlacore.errors import PolicyError

    assert CuteDslOptions().num_sms == "auto" and CuteDslOptions(num_sms=100).num_sms == 100
    for bad in (0, -4, "all", 1.5):
        with pytest.raises(Exception, match="num_sms"):
            CuteDslOptions(num_sms=bad)
    reg = BackendRegistry(env={}).load()
    bad = {"mla": {"order": ["cute_dsl_mla"]}, "backend": {"cute_dsl_mla": {"options": {"num_sms": 0}}}}
    with pytest.raises(PolicyError, match=r"backend.cute_dsl_mla.options.num_sms"):
        Dispatcher(policy=parse_policy(bad), registry=reg, env={})


def test_the_session_plans_for_num_sms_and_refuses_more_than_the_gpu_has(monkeypatch):
    """Sessions make their schedules for the option's SM count (the even and the balanced form: columns and
    capacity follow it), and a count above the GPU's is an error naming the option and both numbers."""
    from mla_cute_dsl.backend import session_sms
    from mla_cute_dsl.kernels import schedule as S
    from mlacore import StepInputs

    assert session_sms(132, CuteDslOptions()) == 132 and session_sms(132, CuteDslOptions(num_sms=100)) == 100
    with pytest.raises(ValueError, match=r"num_sms=200: expected at most this GPU's 132 SMs"):
        session_sms(132, CuteDslOptions(num_sms=200))
    B = 64
    lens = torch.tensor([4096] * B, dtype=torch.int32)
    table = torch.zeros(B, 64, dtype=torch.int32)
    problem = prob(batch_size=B, max_kv_len=4096)
    for split in ("even", "balanced"):
        session = _cpu_session(monkeypatch, CuteDslOptions(num_sms=100, split_kv=split))
        assert session.num_sms == 100
        sched = session.plan(problem, StepInputs(lens, table, lens, table)).schedule
        fresh = S.make_schedule(lens.tolist(), 1, 16, 100, device="cpu", balanced=split == "balanced")
        assert torch.equal(sched.work_info, fresh.work_info) and sched.capacity == fresh.capacity
        assert sched.capacity != S.make_schedule(lens.tolist(), 1, 16, 132, device="cpu",
                                                 balanced=split == "balanced").capacity
    with pytest.raises(ValueError, match="num_sms=200"):
        _cpu_session(monkeypatch, CuteDslOptions(num_sms=200))


@pytest.mark.parametrize("pdl,heads,s_q,kv,want", [
    ("auto", 16, 1, "bf16", True), ("auto", 16, 2, "fp8_e4m3", True), ("auto", 32, 1, "bf16", True),
    ("auto", 16, 4, "bf16", False), ("auto", 128, 1, "bf16", False), (True, 128, 1, "bf16", True),
    (False, 16, 1, "bf16", False),
])
def test_option_pdl_sets_how_the_schedule_launches_its_combine(monkeypatch, pdl, heads, s_q, kv, want):
    """Option pdl (auto: on up to PDL_AUTO_MAX_ROWS = 32 packed rows) reaches the schedule plan returns
    (Schedule.pdl_combine, read by api.combine_kernel_for) on the first plan and on a re-plan into the same
    buffers, and the combine kernels built at the first plan are the ones the steps launch (so warmup builds
    them); a second s_q on the other side of the rule builds its own pair."""
    from mla_cute_dsl import backend as be
    from mla_cute_dsl.kernels import api
    from mlacore import StepInputs

    session = _cpu_session(monkeypatch, CuteDslOptions(pdl=pdl), heads=heads, kv_dtype=kv)
    built = []
    monkeypatch.setattr(api, "get_combine_kernel",
                        lambda q, wide=False, pdl=True, partial="fp32", cols=512: built.append((wide, pdl, cols)))
    lens = torch.tensor([4096, 100], dtype=torch.int32)
    table = torch.zeros(2, 64, dtype=torch.int32)
    problem = prob(num_heads=heads, seq_len_q=s_q, batch_size=2, kv_dtype=kv)
    first = session.plan(problem, StepInputs(lens, table, lens, table)).schedule
    again = session.plan(problem, StepInputs(lens, table, lens, table)).schedule
    assert first is again and again.pdl_combine is want
    assert built == [(True, want, 512), (False, want, 512), (False, want, 128)]  # combine_kind_for's three
    assert be.pdl_combine(problem, CuteDslOptions(pdl=pdl)) is want
    assert CuteDslOptions().pdl is False and be.PDL_AUTO_MAX_ROWS == 32
    if pdl == "auto" and heads == 16 and s_q == 1:  # s_q=4 (64 rows) in the same session: plain combines
        other = prob(num_heads=16, seq_len_q=4, batch_size=2)
        assert session.plan(other, StepInputs(lens, table, lens, table)).schedule.pdl_combine is False
        assert built[3:] == [(True, False, 512), (False, False, 512), (False, False, 128)]


def test_option_pdl_takes_auto_or_a_bool_with_one_message():
    assert CuteDslOptions(pdl=True).pdl is True
    with pytest.raises(ValueError, match="expected auto, true or false, got 'yes'"):
        CuteDslOptions(pdl="yes")


@pytest.mark.parametrize("s_accs,heads,s_q,want", [("auto", 16, 1, 4), ("auto", 8, 2, 4), ("auto", 16, 2, 1),
                                                   ("auto", 3, 8, 1), (2, 16, 2, 2), (1, 16, 1, 1), (4, 5, 1, 4)])
def test_option_s_accs_reaches_the_fp8reg_entry(monkeypatch, s_accs, heads, s_q, want):
    """Option s_accs (auto: 4 up to 16 packed rows, 1 above) reaches the fp8reg host entry the plan runs as a
    keyword (none for 1, the entry's default: 0.2.8's kernel and cache key); shapes on other kernels ignore it.
    seesaw_split=even keeps fp8reg at 17-32 rows (the default gives the balanced seesaw there since 0.2.23)."""
    from mla_cute_dsl import backend as be
    from mlacore import StepInputs

    table = torch.zeros(4, 64, dtype=torch.int32)
    lens = torch.tensor([3000, 17, 0, 4096], dtype=torch.int32)
    opts = CuteDslOptions(s_accs=s_accs, seesaw_split="even")
    problem = prob(num_heads=heads, seq_len_q=s_q, batch_size=4, kv_dtype="fp8_e4m3")
    planned = _cpu_session(monkeypatch, opts, heads=heads, kv_dtype="fp8_e4m3").plan(
        problem, StepInputs(lens, table, lens, table))
    assert planned.kernel == "fp8reg" and be.fp8reg_s_accs(problem, opts) == want
    assert planned.run_fn.__name__ == "mla_decode_sm90_fp8"
    assert getattr(planned.run_fn, "keywords", {}) == ({} if want == 1 else {"s_accs": want})
    bf16 = _cpu_session(monkeypatch, opts, heads=heads).plan(prob(num_heads=heads, seq_len_q=s_q, batch_size=4),
                                                             StepInputs(lens, table, lens, table))
    assert not hasattr(bf16.run_fn, "keywords")


def test_option_s_accs_is_validated():
    with pytest.raises(ValueError, match="s_accs"):
        CuteDslOptions(s_accs=3)
    assert CuteDslOptions().s_accs == "auto"


@pytest.mark.parametrize("loads,heads,s_q,kv,want,qpf", [
    ("auto", 128, 2, "bf16", True, False), ("auto", 64, 4, "bf16", True, False), ("auto", 128, 1, "bf16", True, True),
    ("auto", 64, 3, "bf16", True, False), ("auto", 64, 2, "bf16", True, True), ("tma", 128, 1, "bf16", True, True),
    ("cp_async", 128, 2, "bf16", False, False), ("cp_async", 128, 1, "bf16", False, True),
    ("auto", 128, 2, "fp8_e4m3", False, False), ("tma", 128, 2, "fp8_e4m3", False, False)])
def test_option_loads_reaches_the_seesaw_entry(monkeypatch, loads, heads, s_q, kv, want, qpf):
    """Option loads (auto with the balanced seesaw, the default: TMA from 17 packed rows, every row count
    mma=auto gives it since 0.2.23; fp8 caches always load through registers)
    reaches the seesaw host entry the plan runs as tma=True (no keyword for cp.async: the entry's default kernel),
    the plan's log line names it, and a shape on another kernel ignores it. (Option q_prefetch, unset by default:
    auto, adds q_prefetch=True with a 16-bit cache up to 128 packed rows, whatever loads says; an fp8 cache ignores
    it and gets fp8_loader=ring's fp8_producer=True, fp8p_ring=7.)"""
    from mla_cute_dsl import backend as be
    from mlacore import StepInputs

    table = torch.zeros(4, 64, dtype=torch.int32)
    lens = torch.tensor([3000, 17, 0, 4096], dtype=torch.int32)
    opts = CuteDslOptions(loads=loads)
    problem = prob(num_heads=heads, seq_len_q=s_q, batch_size=4, kv_dtype=kv)
    planned = _cpu_session(monkeypatch, opts, heads=heads, kv_dtype=kv).plan(
        problem, StepInputs(lens, table, lens, table))
    assert planned.kernel == "seesaw" and be.seesaw_tma(problem, opts) is want
    # seesaw_split=balanced (the default) runs a 16-bit cache on the balanced entry; an fp8 cache on the even one
    assert planned.run_fn.__name__ == "mla_decode_sm90_wgmma_seesaw_balanced"  # fp8 too since 0.2.17
    # and option rescale (default lazy) as lazy_rescale=True, with either cache
    # (and option fp8_loader, default ring since the twenty-third session, as fp8_producer=True, fp8p_ring=7 with
    # an fp8 cache; option q_prefetch, default auto, as q_prefetch=True with a 16-bit cache up to 128 packed rows)
    # (and option tma_producer, default auto: on wherever the balanced seesaw loads by TMA, where q_prefetch then
    # does not run)
    tmap = want and kv != "fp8_e4m3"
    qpf = qpf and not tmap
    # (and option wg1_other_first, default auto since 0.2.21: on with the fp8 ring and from 256 packed rows with a
    # 16-bit cache)
    wg1of = kv == "fp8_e4m3" or s_q * heads >= 256
    assert getattr(planned.run_fn, "keywords", {}) == (({"tma": True} if want else {}) | {"lazy_rescale": True}
                                                       | ({"fp8_producer": True, "fp8p_ring": 7}
                                                          if kv == "fp8_e4m3" else {})
                                                       | ({"q_prefetch": True} if qpf else {})
                                                       | ({"tma_producer": True} if tmap else {})
                                                       | ({"wg1_other_first": True} if wg1of else {}))
    assert be.seesaw_q_prefetch(problem, opts) is qpf and be.seesaw_tma_producer(problem, opts) is tmap
    summary = be.kernel_summary(problem, opts)
    head = ("seesaw kernel, balanced split-KV (seesaw_split=balanced: per step the balanced or the even plan, "
            "whichever is predicted >= 10% faster)")
    wg1of_text = ", warpgroup 1's QK waits the other warpgroup's part of its tile first (wg1_other_first)"
    if kv == "bf16":
        loads_text = {"auto": "TMA KV loads (loads=auto: TMA from 17 rows)", "tma": "TMA KV loads (loads=tma)",
                      "cp_async": "cp.async KV loads (loads=cp_async)"}[loads]
        assert summary == (head + ", lazy softmax rescale (rescale=lazy), " + loads_text
                           + (", a producer warpgroup issues the KV tiles and each item's Q by TMA ahead of the math "
                              "warpgroups (tma_producer)" if tmap else "")
                           + (", the next work item's Q and KV tiles 0/1 issued during the current one (q_prefetch)"
                              if qpf else "") + (wg1of_text if wg1of else ""))
    else:
        assert summary == (head + " with an fp8 cache (FP8_SEESAW_BALANCED; the plan's cost model was measured with "
                           "16-bit caches), lazy softmax rescale (rescale=lazy), a producer warpgroup with a 7-chunk "
                           "register ring converts the fp8 cache (fp8_loader=ring)" + wg1of_text)
    small = prob(num_heads=16, seq_len_q=1, batch_size=4)
    other = _cpu_session(monkeypatch, opts, heads=16).plan(small, StepInputs(lens, table, lens, table))
    assert other.kernel != "seesaw" and "tma" not in getattr(other.run_fn, "keywords", {})


@pytest.mark.parametrize("opts,kv", [({"loads": "tma", "mma": "wgmma"}, "bf16"), ({"loads": "tma"}, "fp8_e4m3"),
                                     ({"loads": "auto", "mma": "wgmma"}, "bf16")])
def test_option_loads_leaves_other_kernels_and_fp8_caches_alone(monkeypatch, opts, kv):
    """At 256 rows (H=128 s_q=2), where auto takes TMA for the seesaw kernel: the plain WGMMA kernel (mma=wgmma) and
    an fp8 cache's seesaw (loads convert in registers) get no tma keyword, whatever loads says."""
    from mlacore import StepInputs

    table = torch.zeros(2, 64, dtype=torch.int32)
    lens = torch.tensor([3000, 17], dtype=torch.int32)
    options = CuteDslOptions(**opts)
    planned = _cpu_session(monkeypatch, options, heads=128, kv_dtype=kv).plan(
        prob(num_heads=128, seq_len_q=2, batch_size=2, kv_dtype=kv), StepInputs(lens, table, lens, table))
    assert planned.kernel == ("wgmma" if opts.get("mma") == "wgmma" else "seesaw")
    assert "tma" not in getattr(planned.run_fn, "keywords", {})


@pytest.mark.parametrize("split,getter,launch", [
    ("balanced", "get_partial_kernel_wgmma_seesaw_balanced", "launch_balanced"),  # the default since 0.2.13
    ("even", "get_partial_kernel_wgmma_seesaw", "launch")])
def test_a_tma_plan_asks_the_kernel_cache_for_the_tma_seesaw_kernel(monkeypatch, split, getter, launch):
    """loads=auto at H=128 s_q=2: running the plan reaches the seesaw kernel getter (balanced or even, as
    seesaw_split says) with tma=True (and the partial dtype and wide stores of the defaults), and launches what it
    returned; at s_q=1 (128 rows) the balanced session asks for the TMA kernel too (from 128 rows since 0.2.14),
    the even one for the cp.async kernel (from 256). The balanced getter also gets q_prefetch=True at s_q=1 (option
    q_prefetch, unset by default: auto, on up to 128 packed rows; off at s_q=2's 256); the even one takes no such
    keyword."""
    from mla_cute_dsl.kernels import api, sm90_wgmma_decode
    from mlacore import StepInputs

    asked, launched = [], []
    monkeypatch.setattr(sm90_wgmma_decode, getter,
                        lambda q, kv, **k: asked.append((q, kv, k)) or ("kernel", k["tma"]))
    monkeypatch.setattr(api, launch, lambda partial, *a: launched.append(partial))
    table = torch.zeros(2, 64, dtype=torch.int32)
    lens = torch.tensor([3000, 17], dtype=torch.int32)
    session = _cpu_session(monkeypatch, CuteDslOptions(seesaw_split=split), heads=128)
    for s_q, tma in ((2, True), (1, split == "balanced")):
        planned = session.plan(prob(num_heads=128, seq_len_q=s_q, batch_size=2), StepInputs(lens, table, lens, table))
        q = torch.zeros(2, s_q, 128, 576, dtype=torch.bfloat16)
        kv = torch.zeros(4, 64, 576, dtype=torch.bfloat16)
        out = torch.empty(2, s_q, 128, 512, dtype=torch.bfloat16)
        planned.run(q, kv, out, torch.empty(2, s_q, 128))
        want = {"l2_prefetch": None, "partial": "bf16", "wide_store": True, "tma": tma, "lazy_rescale": True}
        if split == "even":  # the even entry's A/B knob (branch seesaw-tma-nofence), off under the backend
            want["reader_fences"] = False
        else:  # option tma_producer (default auto: the balanced TMA seesaw's producer warpgroup; q_prefetch off)
            want["tma_producer"] = True
        if s_q * 128 >= 256:  # option wg1_other_first (default auto: on from 256 packed rows with a 16-bit cache)
            want["wg1_other_first"] = True
        assert asked[-1] == ("bf16", "bf16", want)
        assert launched[-1] == ("kernel", tma)


def test_option_loads_is_validated():
    from mla_cute_dsl import backend as be

    with pytest.raises(ValueError, match="loads"):
        CuteDslOptions(loads="bulk")
    assert CuteDslOptions().loads == "auto" and be.SEESAW_TMA_MIN_ROWS == 256
    # 0.2.23: every row count auto gives the balanced seesaw (from 17), the even split's floor unchanged
    assert be.SEESAW_BALANCED_TMA_MIN_ROWS == be.SEESAW_FEW_ROWS_MIN == 17 and be.SEESAW_MIN_ROWS == 33
    # the balanced seesaw loads by TMA under auto from 17 rows (auto's seesaw rows), cp.async when asked for;
    # mma=seesaw forced at 16 rows keeps cp.async
    for heads, s_q in ((64, 1), (16, 3), (33, 1), (64, 2), (32, 1), (16, 2), (17, 1)):
        shape = prob(num_heads=heads, seq_len_q=s_q)
        assert be.balanced_split(shape, CuteDslOptions()) and be.seesaw_tma(shape, CuteDslOptions())
        assert not be.seesaw_tma(shape, CuteDslOptions(loads="cp_async"))
    shape = prob(num_heads=16, seq_len_q=1)
    assert be.balanced_split(shape, CuteDslOptions(mma="seesaw"))
    assert not be.seesaw_tma(shape, CuteDslOptions(mma="seesaw"))
    assert be.seesaw_tma(shape, CuteDslOptions(mma="seesaw", loads="tma"))


@pytest.mark.parametrize("stores,want", [("auto", True), ("narrow", False), ("wide", True)])
def test_option_stores_reaches_the_schedule_and_the_prebuilt_partials(monkeypatch, stores, want):
    """Option stores (auto: wide) reaches the schedule plan returns (Schedule.wide_store, read by the
    host entries' kernel getters) on the first plan and on a re-plan into the same buffers, and the balanced
    mma.sync partial a bf16 session prebuilds at 17-32 rows for the KV-block rule (seesaw_split=even since
    0.2.23) is the one built for it."""
    import types

    from mla_cute_dsl import backend as be
    from mlacore import StepInputs

    rec = types.SimpleNamespace(made=[], filled=[], partials=[])
    options = CuteDslOptions(stores=stores, seesaw_split="even")
    session = _cpu_session(monkeypatch, options, rec=rec)
    lens = torch.tensor([4096, 100], dtype=torch.int32)
    table = torch.zeros(2, 64, dtype=torch.int32)
    problem = prob(num_heads=16, seq_len_q=2, batch_size=2)
    first = session.plan(problem, StepInputs(lens, table, lens, table)).schedule
    again = session.plan(problem, StepInputs(lens, table, lens, table)).schedule
    assert first is again and again.wide_store is want
    assert be.wide_stores(problem, options) is want
    assert [k.get("wide_store") for name, _, k in rec.partials if name == "mma_sync"] == [want]
    assert CuteDslOptions().stores == "auto"


def test_option_stores_is_validated():
    with pytest.raises(ValueError, match="stores"):
        CuteDslOptions(stores="16B")
    from mla_cute_dsl.kernels.schedule import make_schedule

    assert make_schedule([4096], 1, 16, 132, device="cpu").wide_store is False  # the kernels' default
