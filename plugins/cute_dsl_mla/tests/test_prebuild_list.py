"""benchmarks/device/prebuild_kernels.py (kernels compiled on the CPU and carried to a fresh GPU machine): its list
asks the kernel cache for distinct kernels, and among them for the keys the backend's defaults use (a renamed
getter or a changed key would otherwise only show as compiles on the device). No compile: the cache is stubbed."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

pytest.importorskip("cutlass")  # the kernel modules the list's getters live in import it

SCRIPT = pathlib.Path(__file__).resolve().parents[3] / "benchmarks" / "device" / "prebuild_kernels.py"


def _module():
    spec = importlib.util.spec_from_file_location("prebuild_kernels", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _asked(monkeypatch):
    from mla_cute_dsl.kernels import kernel_cache

    mod = _module()
    asked = []
    monkeypatch.setattr(kernel_cache, "get_or_build", lambda kind, key, build: asked.append((kind, key)))
    items = mod.specs()
    for _, thunk in items:
        thunk()
    return items, asked


def test_the_prebuild_list_asks_for_distinct_kernels_including_the_defaults(monkeypatch):
    items, asked = _asked(monkeypatch)
    labels = [label for label, _ in items]
    assert len(labels) == len(set(labels)) == len(asked) == len(set(asked))
    for key in [  # the defaults: 16-bit partials in q's dtype, wide stores where a kernel has them
        # mma=auto at 17-32 rows with seesaw_split=even (since 0.2.23; the default there is the balanced seesaw's
        # TMA / producer-ring kernels below, the same keys as from 33 rows)
        ("partial_balanced", ("bf16", "bf16", 32, None, "partial_bf16", "wide_store")),
        ("partial_wgmma_t_balanced", ("bf16", "bf16", 32, "partial_bf16")),  # ... from 640 blocks
        ("partial_fp8reg", ("bf16", "fp8_e4m3", 16, None, 2, "partial_bf16", "s_accs4")),  # fp8 cache, 16 rows
        ("partial_fp8reg", ("bf16", "fp8_e4m3", 16, None, 2, "partial_bf16")),  # ... s_accs=1 (the A/B arm)
        ("partial_fp8reg", ("fp16", "fp8_e4m3", 32, None, 2, "partial_fp16")),
        ("partial_wgmma_seesaw", ("bf16", "fp8_e4m3", 64, "l2pf", "partial_bf16", "wide_store")),  # H=128 fp8
        ("partial_wgmma_seesaw", ("bf16", "bf16", 64, "partial_bf16", "wide_store")),
        ("partial_wgmma_seesaw", ("bf16", "bf16", 64, "partial_bf16", "wide_store", "tma")),  # loads=auto, s_q*H>=256
        ("partial_wgmma_seesaw", ("fp16", "fp16", 64, "partial_fp16", "wide_store", "tma")),
        # seesaw_split=balanced (the default): the balanced seesaw, TMA under loads=auto (cp.async: loads=cp_async)
        ("partial_wgmma_seesaw_balanced", ("bf16", "bf16", 64, "partial_bf16", "wide_store")),
        ("partial_wgmma_seesaw_balanced", ("bf16", "bf16", 64, "partial_bf16", "wide_store", "tma")),
        ("partial_wgmma_seesaw_balanced", ("fp16", "fp16", 64, "partial_fp16", "wide_store", "tma")),
        # tma_producer (unset: on, mla-cute-dsl 0.2.19): the default balanced TMA seesaw with the producer warpgroup
        ("partial_wgmma_seesaw_balanced", ("bf16", "bf16", 64, "partial_bf16", "wide_store", "tma", "lazy", "tmap")),
        ("partial_wgmma_seesaw_balanced", ("fp16", "fp16", 64, "partial_fp16", "wide_store", "tma", "lazy", "tmap")),
        ("partial_wgmma_seesaw_balanced", ("bf16", "bf16", 64, "tma")),  # test_seesaw_balanced_gpu.py's fp32
        # backend.FP8_SEESAW_BALANCED: the balanced seesaw with an fp8 cache (lazy: rescale=lazy; fp32: the GPU tests)
        ("partial_wgmma_seesaw_balanced", ("bf16", "fp8_e4m3", 64, "l2pf", "partial_bf16", "wide_store")),
        ("partial_wgmma_seesaw_balanced", ("bf16", "fp8_e4m3", 64, "l2pf", "partial_bf16", "wide_store", "lazy")),
        ("partial_wgmma_seesaw_balanced", ("fp16", "fp8_e4m3", 64, "l2pf", "partial_fp16", "wide_store")),
        ("partial_wgmma_seesaw_balanced", ("fp16", "fp8_e4m3", 64, "l2pf", "lazy")),
        ("partial_wgmma_seesaw_balanced", ("bf16", "fp8_e4m3", 64, "l2pf")),
        # backend.FP8_BALANCED_PRODUCER: the balanced fp8 seesaw with the producer warpgroup (lazy in the default
        # arm; fp32 narrow eager / lazy for the GPU tests and wgmma_speed.py's balanced_fp8p ways; fp16 q too)
        ("partial_wgmma_seesaw_balanced", ("bf16", "fp8_e4m3", 64, "l2pf", "partial_bf16", "wide_store", "lazy",
                                           "fp8p")),
        ("partial_wgmma_seesaw_balanced", ("bf16", "fp8_e4m3", 64, "l2pf", "fp8p")),
        ("partial_wgmma_seesaw_balanced", ("bf16", "fp8_e4m3", 64, "l2pf", "lazy", "fp8p")),
        ("partial_wgmma_seesaw_balanced", ("fp16", "fp8_e4m3", 64, "l2pf", "lazy", "fp8p")),
        # fp8_loader=ring (the default since the twenty-third session): the producer's 7-chunk register ring on the
        # balanced fp8 seesaw (the default arm: lazy, q partials, wide stores), bf16 and fp16 q
        ("partial_wgmma_seesaw_balanced", ("bf16", "fp8_e4m3", 64, "l2pf", "partial_bf16", "wide_store", "lazy",
                                           "fp8p", "fp8pr7")),
        ("partial_wgmma_seesaw_balanced", ("fp16", "fp8_e4m3", 64, "l2pf", "partial_fp16", "wide_store", "lazy",
                                           "fp8p", "fp8pr7")),
        # q_prefetch unset (the default, auto): the backend's default arms, on up to 128 packed rows ("qpf") and
        # off above; test_seesaw_qpf_gpu.py's arms
        ("partial_wgmma_seesaw_balanced", ("bf16", "bf16", 64, "partial_bf16", "wide_store", "tma", "lazy", "qpf")),
        ("partial_wgmma_seesaw_balanced", ("fp16", "fp16", 64, "partial_fp16", "wide_store", "tma", "lazy", "qpf")),
        ("partial_wgmma_seesaw_balanced", ("bf16", "bf16", 64, "partial_bf16", "wide_store", "tma", "lazy")),
        ("partial_wgmma_seesaw_balanced", ("fp16", "fp16", 64, "partial_fp16", "wide_store", "tma", "lazy")),
        ("partial_wgmma_seesaw_balanced", ("bf16", "bf16", 64, "qpf")),
        ("partial_wgmma_seesaw_balanced", ("bf16", "bf16", 64, "tma", "lazy", "qpf")),
        ("partial_wgmma_seesaw_balanced", ("fp16", "fp16", 64, "tma", "lazy", "qpf")),
        ("partial_wgmma_seesaw_balanced", ("bf16", "bf16", 64, "lazy")),
        ("partial_wgmma_seesaw_balanced", ("fp16", "fp16", 64, "tma", "lazy")),
        # wg1_other_first (branch qk-order, ONLY=wg1of): the backend's arm and wgmma_speed.py's fp32 narrow ways
        ("partial_wgmma_seesaw_balanced", ("bf16", "bf16", 64, "partial_bf16", "wide_store", "tma", "lazy", "qpf",
                                           "wg1of")),
        ("partial_wgmma_seesaw_balanced", ("bf16", "bf16", 64, "partial_bf16", "wide_store", "tma", "lazy", "wg1of")),
        ("partial_wgmma_seesaw_balanced", ("bf16", "bf16", 64, "tma", "lazy", "qpf", "wg1of")),
        ("partial_wgmma_seesaw_balanced", ("bf16", "bf16", 64, "tma", "lazy", "wg1of")),
        ("partial_wgmma_seesaw", ("bf16", "bf16", 64, "wg1of")),
        # tma_producer with wg1_other_first (branch tmap-wg1of, ONLY="tmap wg1of"): the backend-like arm,
        # wgmma_speed.py's balanced_tma_lazy_tmap_wg1of way and test_seesaw_tmap_gpu.py's wg1of cases (fp32 narrow)
        ("partial_wgmma_seesaw_balanced", ("bf16", "bf16", 64, "partial_bf16", "wide_store", "tma", "lazy", "wg1of",
                                           "tmap")),
        ("partial_wgmma_seesaw_balanced", ("bf16", "bf16", 64, "tma", "lazy", "wg1of", "tmap")),
        # wg1_other_first unset (auto, 0.2.21): on with the fp8 ring and from 256 packed rows with a 16-bit cache
        ("partial_wgmma_seesaw_balanced", ("fp16", "fp16", 64, "partial_fp16", "wide_store", "tma", "lazy", "wg1of",
                                           "tmap")),
        ("partial_wgmma_seesaw_balanced", ("bf16", "fp8_e4m3", 64, "l2pf", "partial_bf16", "wide_store", "lazy",
                                           "fp8p", "fp8pr7", "wg1of")),
        ("partial_wgmma_seesaw_balanced", ("fp16", "fp8_e4m3", 64, "l2pf", "partial_fp16", "wide_store", "lazy",
                                           "fp8p", "fp8pr7", "wg1of")),
        ("partial_wgmma", ("fp16", "fp16", 64, "partial_fp16", "wide_store")),
        ("partial", ("bf16", "fp8_e4m3", 64, None, "partial_bf16", "wide_store")),
        ("combine", ("bf16", "partial_bf16", "cols128")),  # combine=auto's chunked kernel
        ("combine_wide", ("bf16", "partial_bf16")),
        ("combine", ("fp16", "partial_fp16", "cols128")),
        # the A/B arms' partials=fp32 with narrow stores (0.2.7's default)
        ("partial_wgmma_seesaw", ("bf16", "bf16", 64)),
        ("partial_balanced", ("bf16", "bf16", 32, None)),
        ("combine_pdl", ("bf16",)),
        # combine_fused_ab_gpu.sh's combine=fused arm (the balanced mma.sync kernel merging its splits)
        ("partial_balanced", ("bf16", "bf16", 16, None, "partial_bf16", "wide_store", "fused")),
        ("partial_balanced", ("bf16", "bf16", 32, None, "partial_bf16", "wide_store", "fused")),
        ("partial_balanced", ("bf16", "bf16", 16, None, "fused")),
    ]:
        assert key in asked, key


def test_the_script_refuses_to_run_without_a_cache_directory(monkeypatch):
    spec = importlib.util.spec_from_file_location("prebuild_kernels", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.delenv("MLA_CUTE_DSL_CACHE_DIR", raising=False)
    monkeypatch.setattr("sys.argv", ["prebuild_kernels.py"])
    with pytest.raises(SystemExit, match="MLA_CUTE_DSL_CACHE_DIR"):
        mod.main()


def test_only_wg1of_builds_just_the_wg1_other_first_kernels(monkeypatch):
    """ONLY=wg1of (--only wg1of) selects exactly the kernels with wg1_other_first, and those only: the five of
    branch qk-order (flag last), the two with tma_producer too (branch tmap-wg1of: "wg1of" then "tmap"), the fp16
    default arm's (wg1_other_first auto from 256 rows, 0.2.21) and the twenty fp8 ring kernels of branch fp8-wg1of
    (flag last, after "fp8p", "fp8pr<R>"[, "fp8ps4"])."""
    items, asked = _asked(monkeypatch)
    picked = [key for (label, _), key in zip(items, asked) if "wg1of" in label]
    assert len(picked) == 28 and all("wg1of" in key[1] for key in picked), picked
    assert sum(key[1][-1] == "wg1of" for key in picked) == 25
    assert sum(key[1][1] == "fp8_e4m3" for key in picked) == 20
    assert all("wg1of" in label for (label, _), key in zip(items, asked) if "wg1of" in key[1])


def test_only_ring_wg1of_builds_just_the_fp8_ring_kernels_with_wg1_other_first(monkeypatch):
    """ONLY=ring_wg1of selects exactly the fp8 ring producer kernels with wg1_other_first (branch fp8-wg1of): ring 7
    in the backend-like arm (q partials, wide, lazy) and fp32 narrow eager / lazy, ring 5 and the staged ring 7 in
    fp32 narrow lazy, bf16 / fp16 q, one item and balanced; each has its option-off twin in the list."""
    items, asked = _asked(monkeypatch)
    picked = [key for (label, _), key in zip(items, asked) if "ring_wg1of" in label]
    assert len(picked) == 20 and len(set(picked)) == 20
    for kind, key in picked:
        assert key[1] == "fp8_e4m3" and key[-1] == "wg1of" and "fp8p" in key
        assert (kind, key[:-1]) in asked  # the option-off twin
    assert ("partial_wgmma_seesaw_balanced", ("bf16", "fp8_e4m3", 64, "l2pf", "partial_bf16", "wide_store", "lazy",
                                              "fp8p", "fp8pr7", "wg1of")) in picked
    assert ("partial_wgmma_seesaw", ("bf16", "fp8_e4m3", 64, "l2pf", "lazy", "fp8p", "fp8pr7", "wg1of")) in picked
    assert ("partial_wgmma_seesaw_balanced", ("fp16", "fp8_e4m3", 64, "l2pf", "lazy", "fp8p", "fp8pr7", "fp8ps4",
                                              "wg1of")) in picked
    assert all("ring_wg1of" in label for (label, _), key in zip(items, asked)
               if "wg1of" in key[1] and key[1][1] == "fp8_e4m3")


def test_only_tmap_wg1of_builds_just_the_producer_kernels_with_wg1_other_first(monkeypatch):
    """ONLY="tmap wg1of" selects exactly the tma_producer kernels with wg1_other_first (key flags "wg1of", "tmap"
    last), and every such kernel; ONLY=tmap still selects them with the other producer kernels."""
    items, asked = _asked(monkeypatch)
    picked = [key for (label, _), key in zip(items, asked) if "tmap wg1of" in label]
    assert sorted(picked) == sorted([
        ("partial_wgmma_seesaw_balanced", ("bf16", "bf16", 64, "partial_bf16", "wide_store", "tma", "lazy", "wg1of",
                                           "tmap")),
        ("partial_wgmma_seesaw_balanced", ("bf16", "bf16", 64, "tma", "lazy", "wg1of", "tmap")),
        # the fp16 default arm from 256 packed rows (wg1_other_first auto, 0.2.21)
        ("partial_wgmma_seesaw_balanced", ("fp16", "fp16", 64, "partial_fp16", "wide_store", "tma", "lazy", "wg1of",
                                           "tmap"))]), picked
    assert all("tmap wg1of" in label for (label, _), key in zip(items, asked) if key[1][-2:] == ("wg1of", "tmap"))
    assert all("tmap" in label for (label, _), key in zip(items, asked) if "tmap" in key[1])


def test_only_and_reverse_select_the_same_kernels_from_either_end(monkeypatch):
    """prebuild_kcache.sh runs two processes on one cache, one with --reverse: they must build the same set, in
    opposite orders, and ONLY ('a|b') must keep the labels containing any of its substrings."""
    items, _ = _asked(monkeypatch)
    mod = _module()
    labels = [label for label, _ in mod.selected(items)]
    assert labels == [label for label, _ in items]
    back = [label for label, _ in mod.selected(items, reverse=True)]
    assert back == labels[::-1] and back[0] != labels[0]
    only = [label for label, _ in mod.selected(items, "tmap|combine")]
    assert only and all("tmap" in label or "combine" in label for label in only)
    assert set(only) == {label for label in labels if "tmap" in label or "combine" in label}
    assert [label for label, _ in mod.selected(items, "tmap|combine", reverse=True)] == only[::-1]

