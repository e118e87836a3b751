"""cute_dsl_mla's option seesaw_split on the CPU: balanced by default since 0.2.13 (even: the even entry on a
plan_items schedule, 0.2.12's routing), seesaw_split=balanced plans a make_schedule(..., balanced=True) schedule into the session's fixed buffers and runs
mla_decode_sm90_wgmma_seesaw_balanced, which launches through api.launch_balanced with the schedule's cta_ranges;
fp8 caches and the other kernels ignore it."""

import pytest
import torch

from test_backend_host import _cpu_session, prob  # noqa: E402  (same directory)

from mla_cute_dsl import backend as be
from mla_cute_dsl.backend import CuteDslBackend, CuteDslOptions
from mlacore import StepInputs

# the summary's last clause for the balanced seesaw with a 16-bit cache under option q_prefetch (by default unset:
# auto, on up to 128 packed rows)
TMAP = (", a producer warpgroup issues the KV tiles and each item's Q by TMA ahead of the math warpgroups "
        "(tma_producer)")
QPF = ", the next work item's Q and KV tiles 0/1 issued during the current one (q_prefetch)"
WG1OF = ", warpgroup 1's QK waits the other warpgroup's part of its tile first (wg1_other_first)"


def _plan(monkeypatch, options, lens_l, heads=128, s_q=1, kv="bf16", session=None, rec=None):
    B = len(lens_l)
    lens = torch.tensor(lens_l, dtype=torch.int32)
    table = torch.zeros(B, 128, dtype=torch.int32)
    session = session or _cpu_session(monkeypatch, options, heads=heads, kv_dtype=kv, rec=rec)
    planned = session.plan(prob(num_heads=heads, seq_len_q=s_q, batch_size=B, kv_dtype=kv, max_kv_len=8192),
                           StepInputs(lens, table, lens, table))
    return session, planned


def test_option_defaults_to_balanced_and_is_validated():
    assert CuteDslOptions().seesaw_split == "balanced"
    assert CuteDslOptions().split_kv == "balanced"  # unchanged default, which the seesaw keeps ignoring
    with pytest.raises(ValueError, match="seesaw_split"):
        CuteDslOptions(seesaw_split="balanced_seesaw")
    assert CuteDslOptions(seesaw_split="balanced").seesaw_split == "balanced"


@pytest.mark.parametrize("heads,s_q", [(128, 1), (128, 2), (64, 2), (126, 2)])
def test_seesaw_split_even_keeps_the_even_routing(monkeypatch, heads, s_q):
    """seesaw_split=even (split_kv at its default, balanced): the seesaw's even entry on a plan_items schedule (no
    cta_ranges), not balanced, exactly as 0.2.12 routed every seesaw shape."""
    import types

    rec = types.SimpleNamespace(made=[], filled=[], partials=[])
    even = CuteDslOptions(seesaw_split="even")
    _, planned = _plan(monkeypatch, even, [3000, 17, 0, 4096], heads=heads, s_q=s_q, rec=rec)
    assert planned.kernel == "seesaw" and planned.balanced is False
    assert planned.run_fn.__name__ == "mla_decode_sm90_wgmma_seesaw"
    assert planned.schedule.cta_ranges is None and not planned.schedule.balanced
    assert rec.made == [(1, False)]
    assert not be.balanced_split(prob(num_heads=heads, seq_len_q=s_q), even)
    assert not be.balanced_split(prob(num_heads=heads, seq_len_q=s_q), CuteDslOptions(split_kv="even",
                                                                                     seesaw_split="even"))
    # the default is the balanced seesaw, whatever split_kv says
    assert be.balanced_split(prob(num_heads=heads, seq_len_q=s_q), CuteDslOptions())
    assert be.balanced_split(prob(num_heads=heads, seq_len_q=s_q), CuteDslOptions(split_kv="even"))


@pytest.mark.parametrize("heads,s_q,loads,tma,qpf", [(128, 1, "auto", True, True), (128, 2, "auto", True, False),
                                                     (126, 2, "auto", True, False), (128, 1, "cp_async", False, True),
                                                     (64, 4, "auto", True, False)])
def test_seesaw_split_balanced_plans_the_hybrid_into_fixed_buffers(monkeypatch, heads, s_q, loads, tma, qpf):
    """seesaw_split=balanced: the balanced seesaw entry (tma as option loads decides: auto takes TMA at every row
    count mma=auto gives the balanced seesaw, since 0.2.14; from 17 rows since 0.2.23), a balanced schedule for
    one CTA per SM with num_cols = 132 // m-blocks, its form following the lengths (uniform 4096: balanced at B=40,
    where the even plan's second wave is 1.5x the balanced columns; even at B=32, one wave), re-planned in place
    (the buffers a captured graph reads stay), equal to make_schedule's own answer. Option q_prefetch (unset by
    default: auto) reaches the entry as q_prefetch=True up to 128 packed rows (H=128 s_q=1), not above."""
    import types

    from mla_cute_dsl.kernels import schedule as S

    rec = types.SimpleNamespace(made=[], filled=[], partials=[])
    opts = CuteDslOptions(seesaw_split="balanced", loads=loads)
    steps = [[4096] * 40, [4096] * 32, [4096] * 40]
    real_make = S.make_schedule  # (the session patches the module's: it records its calls)
    session, forms, ptrs = None, [], set()
    for lens_l in steps:
        B = len(lens_l)
        session, planned = _plan(monkeypatch, opts, lens_l, heads=heads, s_q=s_q, session=session, rec=rec)
        assert planned.kernel == "seesaw" and planned.balanced is True
        assert planned.run_fn.__name__ == "mla_decode_sm90_wgmma_seesaw_balanced"
        # option tma_producer (default auto: on wherever the balanced seesaw loads by TMA; q_prefetch then off)
        assert getattr(planned.run_fn, "keywords", {}) == (({"tma": True} if tma else {}) | {"lazy_rescale": True}
                                                           | ({"q_prefetch": True} if qpf and not tma else {})
                                                           | ({"tma_producer": True} if tma else {})
                                                           # wg1_other_first (auto: from 256 rows, 16-bit cache)
                                                           | ({"wg1_other_first": True} if heads * s_q >= 256 else {}))
        sched = planned.schedule
        m_blocks = -(-heads * s_q // 64)
        assert sched.balanced and sched.block_m == 64 and sched.num_cols == 132 // m_blocks
        want = real_make(lens_l, s_q, heads, 132, device="cpu", balanced=True, ctas_per_sm=1)
        assert sched.form == want.form
        n = want.num_items
        assert torch.equal(sched.work_info[:n], want.work_info[:n])
        assert torch.equal(sched.cta_ranges, want.cta_ranges)
        assert torch.equal(sched.split_info[:B], want.split_info[:B])
        forms.append(sched.form)
        ptrs.add((sched.work_info.data_ptr(), sched.cta_ranges.data_ptr(), sched.split_info.data_ptr()))
    assert forms == ["balanced", "even", "balanced"], forms
    assert len(ptrs) == 1  # planned in place
    assert rec.made == [(1, True)] and rec.filled == [(1, True), (1, True)]


def test_seesaw_split_balanced_run_launches_through_launch_balanced(monkeypatch):
    """Planned.run reaches mla_decode_sm90_wgmma_seesaw_balanced with check=False, which asks the balanced getter
    for the session's partial dtype / wide stores / loads / q_prefetch (unset by default: auto, on at s_q=1's 128
    packed rows, off at s_q=2's 256) and launches through api.launch_balanced with the plan's schedule (its
    cta_ranges go to the kernel there)."""
    from mla_cute_dsl.kernels import api, sm90_wgmma_decode

    asked, launched = [], []
    monkeypatch.setattr(sm90_wgmma_decode, "get_partial_kernel_wgmma_seesaw_balanced",
                        lambda q, kv, **k: asked.append((q, kv, k)) or "balanced-kernel")
    monkeypatch.setattr(sm90_wgmma_decode, "get_partial_kernel_wgmma_seesaw",
                        lambda *a, **k: pytest.fail("the even seesaw kernel was asked for"))
    monkeypatch.setattr(api, "launch_balanced", lambda partial, *a: launched.append((partial, a)))
    monkeypatch.setattr(api, "launch", lambda *a: pytest.fail("the even launch ran"))
    sessions = {}
    for s_q, loads, tma, qpf in ((2, "auto", True, False), (1, "auto", True, True), (1, "cp_async", False, True)):
        opts = CuteDslOptions(seesaw_split="balanced", loads=loads)
        sessions[loads], planned = _plan(monkeypatch, opts, [3000, 17, 0, 4096], s_q=s_q,
                                         session=sessions.get(loads))
        q = torch.zeros(4, s_q, 128, 576, dtype=torch.bfloat16)
        kv = torch.zeros(4, 64, 576, dtype=torch.bfloat16)
        out = torch.empty(4, s_q, 128, 512, dtype=torch.bfloat16)
        planned.run(q, kv, out, torch.empty(4, s_q, 128))
        assert asked[-1] == ("bf16", "bf16", {"l2_prefetch": None, "partial": "bf16", "wide_store": True, "tma": tma,
                                              "lazy_rescale": True} | ({"q_prefetch": True} if qpf and not tma else {})
                             | ({"tma_producer": True} if tma else {})  # tma_producer (auto) where TMA loads run
                             | ({"wg1_other_first": True} if s_q == 2 else {}))  # wg1_other_first (auto): 256 rows
        partial, args = launched[-1]
        assert partial == "balanced-kernel" and args[-2] is planned.schedule and args[-1] is planned.workspace


@pytest.mark.parametrize("opts,heads,kv,want_kernel", [
    ({"seesaw_split": "even"}, 128, "fp8_e4m3", "seesaw"),  # fp8 (balanced by default since 0.2.17): even asked
    ({"seesaw_split": "balanced", "mma": "wgmma"}, 128, "bf16", "wgmma"),
    ({"seesaw_split": "balanced", "mma": "wgmma"}, 64, "fp16", "wgmma"),  # the plain WGMMA kernel: even
    ({"seesaw_split": "balanced", "split_kv": "even"}, 16, "bf16", "mma_sync"),  # does not reach mma.sync
])
def test_seesaw_split_leaves_other_kernels_and_fp8_caches_alone(monkeypatch, opts, heads, kv, want_kernel):
    _, planned = _plan(monkeypatch, CuteDslOptions(**opts), [3000, 17], heads=heads, kv=kv)
    assert planned.kernel == want_kernel and planned.balanced is False
    assert planned.schedule.cta_ranges is None
    assert not planned.run_fn.__name__.endswith("_balanced")


def test_seesaw_split_does_not_change_split_kv_for_the_mma_sync_kernel(monkeypatch):
    """seesaw_split=even with split_kv=balanced at 16 rows: the mma.sync balanced entry as before; seesaw_split
    changes nothing there either way."""
    for split in ("even", "balanced"):
        _, planned = _plan(monkeypatch, CuteDslOptions(seesaw_split=split), [3000, 17], heads=16)
        assert planned.kernel == "mma_sync" and planned.balanced is True
        assert planned.run_fn.__name__ == "mla_decode_sm90_balanced"


def test_kernel_summary_run_function_and_notes():
    bal = CuteDslOptions(seesaw_split="balanced")
    assert be.kernel_summary(prob(num_heads=128), bal).startswith(
        "seesaw kernel, balanced split-KV (seesaw_split=balanced: per step the balanced or the even plan")
    # tma_producer unset (auto): on wherever the balanced seesaw loads by TMA (from 17 rows under loads=auto since
    # 0.2.23, every row count mma=auto gives it), and q_prefetch then does not run, whatever it says; with
    # tma_producer=False q_prefetch's own rule (auto: on up to 128 packed rows) applies again
    # (wg1_other_first unset: auto, on from 256 packed rows with a 16-bit cache: H=128 s_q=2 here)
    tma = "TMA KV loads (loads=auto: TMA from 17 rows)"
    for shape in (prob(num_heads=128, seq_len_q=2), prob(num_heads=128), prob(num_heads=16, seq_len_q=3),
                  prob(num_heads=16, seq_len_q=2), prob(num_heads=17)):
        w = WG1OF if shape.seq_len_q * shape.num_heads >= 256 else ""
        assert be.kernel_summary(shape, bal).endswith(tma + TMAP + w)
        assert be.kernel_summary(shape, CuteDslOptions(q_prefetch=True)).endswith(
            tma + TMAP + " (q_prefetch=true ignored: the producer fetches ahead itself; tma_producer=false runs it)"
            + w)
    assert be.kernel_summary(prob(num_heads=128), CuteDslOptions(tma_producer=False)).endswith(tma + QPF)
    assert be.kernel_summary(prob(num_heads=128, seq_len_q=2), CuteDslOptions(tma_producer=False)).endswith(
        tma + WG1OF)
    assert be.kernel_summary(prob(num_heads=128, seq_len_q=2),
                             CuteDslOptions(tma_producer=False, q_prefetch=True)).endswith(tma + QPF + WG1OF)
    assert be.kernel_summary(prob(num_heads=128), CuteDslOptions(loads="cp_async")).endswith(
        "cp.async KV loads (loads=cp_async)" + QPF)
    # the even one (ctas_per_sm=2) loads by TMA from 256 rows, with neither
    assert be.kernel_summary(prob(num_heads=128), CuteDslOptions(ctas_per_sm=2)).endswith(
        "cp.async KV loads (loads=auto: TMA from 256 rows)")
    fp8 = be.kernel_summary(prob(num_heads=128, kv_dtype="fp8_e4m3"), bal)
    assert fp8.startswith("seesaw kernel, balanced split-KV") and "ignored" not in fp8  # since 0.2.17
    # the default is the balanced text; seesaw_split=even gives 0.2.12's (test_backend_host pins it too)
    assert be.kernel_summary(prob(num_heads=128), CuteDslOptions()) == be.kernel_summary(prob(num_heads=128), bal)
    even = CuteDslOptions(seesaw_split="even")
    assert be.kernel_summary(prob(num_heads=128), even).startswith("seesaw kernel, even split-KV "
                                                                  "(split_kv=balanced ignored")
    assert "seesaw_split" not in be.kernel_summary(prob(num_heads=128), even)
    assert be.run_function("seesaw", balanced=True).__name__ == "mla_decode_sm90_wgmma_seesaw_balanced"
    assert be.run_function("seesaw").__name__ == "mla_decode_sm90_wgmma_seesaw"
    with pytest.raises(ValueError, match="not wgmma"):
        be.run_function("wgmma", balanced=True)
    desc = CuteDslOptions.model_fields["seesaw_split"].description
    assert "balanced (default since 0.2.13)" in desc and "0.2.12's kernel" in desc


def test_policy_accepts_the_option():
    """`mla bench --backend cute_dsl_mla:seesaw_split=balanced` builds its dispatcher this way."""
    from mlacore import BackendRegistry
    from mlacore.testing.compare import only_backend_dispatcher
    from mlacore.tools.bench import BackendSpec

    reg = BackendRegistry(env={}).load()
    spec = BackendSpec.parse("cute_dsl_mla:seesaw_split=balanced")
    d = only_backend_dispatcher(spec.name, reg, dict(spec.options))
    assert d.options["cute_dsl_mla"].base.seesaw_split == "balanced"


def test_ctas_per_sm_2_keeps_the_even_seesaw(monkeypatch):
    """One seesaw CTA fits an SM: with ctas_per_sm=2 the balanced grid's columns would run in two waves, which the
    hybrid's cost model does not assume, so the seesaw keeps its even kernel there and says why."""
    opts = CuteDslOptions(ctas_per_sm=2)
    assert not be.balanced_split(prob(num_heads=128), opts)
    assert be.balanced_split(prob(num_heads=128), CuteDslOptions(ctas_per_sm=1))
    _, planned = _plan(monkeypatch, opts, [3000, 17], heads=128)
    assert planned.kernel == "seesaw" and planned.balanced is False
    assert planned.run_fn.__name__ == "mla_decode_sm90_wgmma_seesaw"
    assert "seesaw_split=balanced ignored: the balanced seesaw runs one CTA per SM" in be.kernel_summary(
        prob(num_heads=128), opts)


# ---- branch fp8-balanced: backend.FP8_SEESAW_BALANCED (off by default) lets an fp8 cache run the balanced seesaw ----


def test_fp8_seesaw_balanced_is_on_by_default():
    assert be.FP8_SEESAW_BALANCED is True  # since 0.2.17
    assert be.balanced_split(prob(num_heads=128, kv_dtype="fp8_e4m3"), CuteDslOptions())


@pytest.mark.parametrize("flag", [False, True])
def test_fp8_seesaw_balanced_flag_routes_plan_summary_and_run(monkeypatch, flag):
    """FP8_SEESAW_BALANCED off: an fp8 cache at 64+ rows runs the even fp8 seesaw and the summary says
    seesaw_split=balanced is ignored (0.2.17's routing); on: the balanced seesaw entry on a balanced schedule in
    the session's fixed buffers (the hybrid plan: its cost model measured with 16-bit caches), fp8 loads (never
    TMA), lazy rescale, 16-bit partials and wide stores as for the even fp8 seesaw. The other kernels (fp8reg,
    mma=wgmma / mma_sync / wgmma_t) never run balanced with an fp8 cache, and seesaw_split=even / ctas_per_sm=2
    keep the even seesaw, whatever the flag."""
    from mla_cute_dsl.kernels import api, sm90_wgmma_decode

    monkeypatch.setattr(be, "FP8_SEESAW_BALANCED", flag)
    monkeypatch.setattr(be, "FP8_BALANCED_PRODUCER", False)  # this test: the inline balanced fp8 seesaw
    fp8 = prob(num_heads=128, kv_dtype="fp8_e4m3")
    assert be.balanced_split(fp8, CuteDslOptions()) is flag
    assert be.balanced_split(prob(num_heads=64, seq_len_q=2, kv_dtype="fp8_e4m3"), CuteDslOptions()) is flag
    assert not be.balanced_split(fp8, CuteDslOptions(seesaw_split="even"))
    assert not be.balanced_split(fp8, CuteDslOptions(ctas_per_sm=2))
    assert not be.balanced_split(fp8, CuteDslOptions(mma="wgmma"))
    for opts in (CuteDslOptions(), CuteDslOptions(mma="mma_sync"), CuteDslOptions(mma="wgmma_t"),
                 CuteDslOptions(mma="fp8reg")):
        assert not be.balanced_split(prob(num_heads=16, kv_dtype="fp8_e4m3"), opts)
    assert be.balanced_split(prob(num_heads=128), CuteDslOptions())  # 16-bit caches: unchanged
    # 17-32 rows (0.2.23): auto gives an fp8 cache the seesaw only where it runs balanced, else fp8reg as before
    fp8_32 = prob(num_heads=16, seq_len_q=2, kv_dtype="fp8_e4m3")
    assert be.partial_kernel(fp8_32, CuteDslOptions()) == ("seesaw" if flag else "fp8reg")
    assert be.balanced_split(fp8_32, CuteDslOptions()) is flag
    assert be.partial_kernel(prob(num_heads=16, seq_len_q=2), CuteDslOptions()) == "seesaw"
    assert not be.seesaw_tma(fp8, CuteDslOptions()) and not be.seesaw_tma(fp8, CuteDslOptions(loads="tma"))
    summary = be.kernel_summary(fp8, CuteDslOptions())
    if flag:
        assert summary.startswith("seesaw kernel, balanced split-KV (seesaw_split=balanced")
        assert "with an fp8 cache (FP8_SEESAW_BALANCED; the plan's cost model was measured with 16-bit caches)" in \
            summary and "seesaw_split=balanced ignored" not in summary and "KV loads" not in summary
    else:
        assert summary.startswith("seesaw kernel, even split-KV")
        assert ("seesaw_split=balanced ignored: the balanced seesaw takes an fp8 cache only with "
                "backend.FP8_SEESAW_BALANCED") in summary
    assert "lazy softmax rescale" in summary

    asked, launched = [], []
    monkeypatch.setattr(sm90_wgmma_decode, "get_partial_kernel_wgmma_seesaw_balanced",
                        lambda q, kv, **k: asked.append(("balanced", q, kv, k)) or "balanced-kernel")
    monkeypatch.setattr(sm90_wgmma_decode, "get_partial_kernel_wgmma_seesaw",
                        lambda q, kv, **k: asked.append(("even", q, kv, k)) or "even-kernel")
    monkeypatch.setattr(api, "launch_balanced", lambda partial, *a: launched.append(("balanced", partial, a)))
    monkeypatch.setattr(api, "launch", lambda partial, *a: launched.append(("even", partial, a)))
    _, planned = _plan(monkeypatch, CuteDslOptions(), [3000, 17, 0, 4096], kv="fp8_e4m3")
    assert planned.kernel == "seesaw" and planned.balanced is flag
    assert planned.run_fn.__name__ == ("mla_decode_sm90_wgmma_seesaw_balanced" if flag
                                       else "mla_decode_sm90_wgmma_seesaw")
    # the producer warpgroup with its 7-chunk register ring (fp8_loader=ring, the default since the twenty-third
    # session) runs on the even seesaw only (FP8_BALANCED_PRODUCER off here)
    assert getattr(planned.run_fn, "keywords", {}) == {"lazy_rescale": True} | (
        {} if flag else {"fp8_producer": True, "fp8p_ring": 7, "wg1_other_first": True})  # with the ring (auto)
    assert be.seesaw_fp8_producer(fp8, CuteDslOptions()) is not flag
    assert be.seesaw_fp8p_ring(fp8, CuteDslOptions()) == (0 if flag else 7)
    if flag:
        assert summary.endswith(", lazy softmax rescale (rescale=lazy), the math warpgroups convert the fp8 cache "
                                "(fp8_loader=ring ignored: the balanced seesaw takes the producer warpgroup only with "
                                "backend.FP8_BALANCED_PRODUCER, set off here)")
    else:
        assert summary.endswith(", lazy softmax rescale (rescale=lazy), a producer warpgroup with a 7-chunk register "
                                "ring converts the fp8 cache (fp8_loader=ring), warpgroup 1's QK waits the other "
                                "warpgroup's part of its tile first (wg1_other_first)")
    assert planned.schedule.balanced is flag and (planned.schedule.cta_ranges is not None) is flag
    q = torch.zeros(4, 1, 128, 576, dtype=torch.bfloat16)
    kv = torch.zeros(4, 64, 576, dtype=torch.bfloat16).to(torch.float8_e4m3fn)
    planned.run(q, kv, torch.empty(4, 1, 128, 512, dtype=torch.bfloat16), torch.empty(4, 1, 128))
    kind, q_name, kv_name, kw = asked[-1]
    assert (kind, q_name, kv_name) == ("balanced" if flag else "even", "bf16", "fp8_e4m3")
    assert kw["partial"] == "bf16" and kw["wide_store"] is True and kw["tma"] is False and kw["lazy_rescale"] is True
    assert kw["l2_prefetch"] is None  # the getters' default: seesaw_l2_prefetch_default, on for fp8
    way, partial, args = launched[-1]
    assert way == ("balanced" if flag else "even") and partial == f"{way}-kernel"
    assert args[1] is kv and args[-2] is planned.schedule
