"""Tensor-parallel ranks: the same backend choice everywhere, or a clear error on every rank (issue 14).

Unit tests build fingerprints in this process (no torch.distributed); the
process tests run `examples/tp_decode.py` and a small `check_same_choice`
script with gloo on the CPU, each in a subprocess with a timeout, so a hang
is a failure rather than a stuck CI job.
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from mla_test_helpers import subprocess_env
from mlacore import Dispatcher, MLADecoder, MLAError
from mlacore.distributed import (ABSENT, RankMismatchError, ShapeClass, as_shape_class, check_same_choice,
                                 choice_fingerprint, compare_fingerprints, default_shape_classes, mismatch_error)
from mlacore.policy import load_policy, parse_policy_text

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "tp_decode.py"
TIMEOUT = 120

DEFAULT = """
[mla]
order = ["cute_dsl_mla", "flashinfer_mla", "cutlass_mla", "reference"]
fallback = "reference"
"""
SMALL_CHUNKS = DEFAULT + """
[backend.reference.options]
chunk_tokens = 1024
"""
ONLY_FLASHINFER = """
[mla]
order = ["flashinfer_mla"]
fallback = "error"
"""


def decoder(policy_text: str = DEFAULT, env=None, **kw) -> MLADecoder:
    policy = parse_policy_text(policy_text, "<test>")
    return MLADecoder(4, 16, q_dtype=torch.float32, dispatcher=Dispatcher(policy=policy, env=env or {}), **kw)


# -- the fingerprint, in one process ------------------------------------------------------------


def test_fingerprint_names_backend_options_versions_and_policy_per_shape_class():
    fp = choice_fingerprint(decoder())
    json.dumps(fp)  # travels through all_gather_object and logs
    labels = set(fp["choices"])
    for b in (1, 8, 64):
        for s_q in (1, 2):
            assert f"B={b} s_q={s_q} kv=1..4096" in labels
    assert all(c == {"backend": "reference", "options": {"chunk_tokens": 65536}, "fallback_used": False}
               for c in fp["choices"].values())
    ref = fp["backends"]["reference"]
    assert ref["distribution"] == "mlacore" and ref["status"] == "available" and ref["version"] != "?"
    assert fp["policy"]["order"] == ["cute_dsl_mla", "flashinfer_mla", "cutlass_mla", "reference"]
    assert fp["decoder"]["num_heads"] == 4 and fp["decoder"]["q_dtype"] == "fp32"
    assert re.fullmatch(r"[0-9a-f]{16}", fp["digest"]) and re.fullmatch(r"[0-9a-f]{16}", fp["policy"]["digest"])


def test_without_torch_distributed_check_same_choice_returns_the_local_fingerprint():
    import torch.distributed as dist

    assert not (dist.is_available() and dist.is_initialized())
    d = decoder()
    classes = [(2, 1, 100), ShapeClass(3, 2, 50, 7)]
    fp = check_same_choice(d, classes)
    assert list(fp["choices"]) == ["B=2 s_q=1 kv=1..100", "B=3 s_q=2 kv=7..50"]
    assert fp["digest"] == choice_fingerprint(d, classes)["digest"]


def test_same_policy_content_from_different_places_is_the_same_choice(tmp_path):
    """Ranks may read the policy from different paths (working directories); only its content counts."""
    a, b = tmp_path / "a.toml", tmp_path / "b.toml"
    a.write_text(SMALL_CHUNKS)
    b.write_text("# another copy, spelling out a default\n" + SMALL_CHUNKS.replace(
        "[backend.reference.options]", "[backend.reference]\nenabled = true\n[backend.reference.options]"))
    fps = [choice_fingerprint(MLADecoder(4, 16, policy=str(p)), [(1, 1, 10)]) for p in (a, b)]
    assert fps[0]["info"]["policy_source"] != fps[1]["info"]["policy_source"]
    assert compare_fingerprints(fps) == []
    assert mismatch_error(fps, 0) is None
    assert fps[0]["digest"] == fps[1]["digest"]


def test_other_backend_options_are_named_with_each_ranks_value():
    fps = [choice_fingerprint(decoder(DEFAULT)), choice_fingerprint(decoder(SMALL_CHUNKS))]
    assert fps[0]["digest"] != fps[1]["digest"]
    diffs = compare_fingerprints(fps)
    chunk = [d for d in diffs if d.path[0] == "choices"]
    assert len(chunk) == len(fps[0]["choices"])  # every class, field options.chunk_tokens
    assert all(d.path[2:] == ("options", "chunk_tokens") and d.values == (65536, 1024) for d in chunk)
    err = mismatch_error(fps, 1)
    assert isinstance(err, RankMismatchError) and isinstance(err, MLAError)
    text = str(err)
    assert text.startswith("[rank 1 of 2] ")
    assert "rank 1 differs from rank 0" in text
    n = len(fps[0]["choices"])
    assert f"choice options.chunk_tokens in {n} of {n} shape classes" in text
    assert "rank 0: 65536 | rank 1: 1024" in text
    assert "policy.content.backend.reference.options.chunk_tokens: rank 0: <absent> | rank 1: 1024" in text
    assert err.odd_ranks == (1,) and err.rank == 1 and err.world_size == 2


def test_a_rank_with_no_backend_shows_its_whole_choice_and_the_policy_difference():
    fps = [choice_fingerprint(decoder(DEFAULT), [(8, 1, 4096)]),
           choice_fingerprint(decoder(ONLY_FLASHINFER), [(8, 1, 4096)])]
    c = fps[1]["choices"]["B=8 s_q=1 kv=1..4096"]
    assert c["backend"] is None and "flashinfer_mla unavailable" in c["error"]
    text = str(mismatch_error(fps, 0))
    assert ('choice backend in 1 of 1 shape classes (B=8 s_q=1 kv=1..4096): rank 0: reference '
            '{"chunk_tokens": 65536} | rank 1: no backend: NoBackendError') in text
    assert 'policy.content.mla.fallback: rank 0: "reference" | rank 1: "error"' in text
    assert 'policy.order: rank 0: ["cute_dsl_mla", "flashinfer_mla", "cutlass_mla", "reference"] | ' \
           'rank 1: ["flashinfer_mla"]' in text
    assert "policy read from: rank 0: <test> | rank 1: <test>" in text


def test_mla_environment_that_changes_the_order_is_compared_but_the_policy_path_is_not():
    fps = [choice_fingerprint(decoder(env={"MLA_POLICY": "/a/mla.toml"}), [(1, 1, 10)]),
           choice_fingerprint(decoder(env={"MLA_POLICY": "/b/mla.toml"}), [(1, 1, 10)])]
    assert compare_fingerprints(fps) == []
    fps[1] = choice_fingerprint(decoder(env={"MLA_BACKENDS": "-flashinfer_mla"}), [(1, 1, 10)])
    paths = {d.path: d.values for d in compare_fingerprints(fps)}
    assert paths[("env", "MLA_BACKENDS")] == (ABSENT, "-flashinfer_mla")
    assert ("policy", "order") in paths
    assert "env.MLA_BACKENDS: rank 0: <absent> | rank 1: \"-flashinfer_mla\"" in str(mismatch_error(fps, 0))


def test_the_odd_rank_is_named_against_the_majority_and_a_status_difference_says_why():
    base = choice_fingerprint(decoder(), [(1, 1, 10)])
    odd = copy.deepcopy(base)
    odd["backends"]["reference"]["version"] = "0.0.1"
    odd["backends"]["flashinfer_mla"] = {"distribution": "mla-flashinfer", "version": "0.1.0", "status": "broken"}
    odd["info"]["backend_reasons"]["flashinfer_mla"] = ["Error importing plugin 'flashinfer_mla': ImportError: boom"]
    if "flashinfer_mla" in base["backends"]:
        base["backends"]["flashinfer_mla"]["status"] = "available"
    else:
        base["backends"]["flashinfer_mla"] = {"distribution": "mla-flashinfer", "version": "0.1.0",
                                              "status": "available"}
    err = mismatch_error([base, odd, copy.deepcopy(base)], 2)
    text = str(err)
    assert err.odd_ranks == (1,)
    assert "rank 1 differs from ranks 0,2" in text
    assert 'backends.reference.version: ranks 0,2: "' in text and 'rank 1: "0.0.1"' in text
    assert 'backends.flashinfer_mla.status: ranks 0,2: "available" | rank 1: "broken"' in text
    assert "rank 1: flashinfer_mla is \"broken\": Error importing plugin 'flashinfer_mla': ImportError: boom" in text


def test_a_rank_that_could_not_fingerprint_is_reported_by_every_rank():
    base = choice_fingerprint(decoder(), [(1, 1, 10)])
    for rank in range(3):
        err = mismatch_error([base, {"error": "PolicyError: bad.toml: mla.order[0]: unknown backend 'x'"}, base], rank)
        assert isinstance(err, RankMismatchError) and err.odd_ranks == (1,)
        assert str(err).startswith(f"[rank {rank} of 3] MLA backend choice check failed on rank 1")
        assert "unknown backend 'x'" in str(err)


def test_default_shape_classes_cover_both_sides_of_every_policy_cut_and_stay_in_the_graph_envelope():
    cut = DEFAULT + """
[[backend.reference.allow]]
min_batch = 32
max_kv_len = 512
"""
    classes = default_shape_classes(decoder(cut))
    batches = {c.batch_size for c in classes}
    kvs = {c.max_kv_len for c in classes}
    assert {1, 8, 64, 31, 32} <= batches and {1, 4096, 512, 513} <= kvs
    fp = choice_fingerprint(decoder(cut))
    # the rule only lets reference take B>=32, kv<=512; elsewhere it is the policy fallback
    assert fp["choices"]["B=32 s_q=1 kv=1..512"]["fallback_used"] is False
    assert fp["choices"]["B=31 s_q=1 kv=1..512"]["fallback_used"] is True
    assert fp["choices"]["B=32 s_q=1 kv=1..513"]["fallback_used"] is True

    # graph mode needs CUDA; the envelope logic is host-side, so fake the decoder's envelope only
    d = decoder()
    from mlacore.backend import GraphEnvelope

    d.envelope = GraphEnvelope(max_batch=16, max_kv_len=2048)
    graph_classes = default_shape_classes(d)
    assert max(c.batch_size for c in graph_classes) == 16 and max(c.max_kv_len for c in graph_classes) == 2048
    assert {1, 8, 16} == {c.batch_size for c in graph_classes}


def test_shape_classes_are_checked_and_named():
    assert as_shape_class((8, 2, 100)) == ShapeClass(8, 2, 100, 1)
    assert ShapeClass(8, 2, 100, 3).label == "B=8 s_q=2 kv=3..100"
    with pytest.raises(ValueError, match="min_kv_len=200 is larger than max_kv_len=100"):
        as_shape_class((8, 2, 100, 200))
    with pytest.raises(ValueError, match="batch_size: expected an int >= 1, got 0"):
        ShapeClass(0)
    with pytest.raises(ValueError, match="expected a ShapeClass or a tuple"):
        as_shape_class("B=8")


# -- real processes: gloo on the CPU --------------------------------------------------------------


def run_example(*args: str, timeout: int = TIMEOUT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(EXAMPLE), *args], cwd=ROOT, env=subprocess_env(),
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_ranks_equal_one_big_run(world, tmp_path):
    log = tmp_path / "tp.log"
    done = run_example("--world-size", str(world), "--heads", "16", "--log", str(log))
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    for r in range(world):
        assert re.search(rf"\[rank {r}/{world}\] heads \[{r * 16 // world}, {(r + 1) * 16 // world}\) on cpu "
                         rf"\(gloo\).*agreed by all {world} ranks.*runs on reference", out), out
    digests = set(re.findall(r"choice fingerprint ([0-9a-f]{16})", out))
    assert len(digests) == 1, out
    m = re.search(r"attention out max abs diff ([0-9.e+-]+) \(max \|out\| ([0-9.]+)\); "
                  r"final hidden max abs diff ([0-9.e+-]+)", out)
    assert m, out
    attn_diff, scale, h_diff = (float(g) for g in m.groups())
    assert scale > 0.5  # a real signal, not zeros compared with zeros
    assert attn_diff < 1e-5 and h_diff < 1e-5, out
    assert "[launcher] OK" in out
    assert log.read_text().count("\n") >= world + 2 and "attention out max abs diff" in log.read_text()


def _assert_every_rank_stopped(done: subprocess.CompletedProcess, world: int, odd: int, expect: str) -> str:
    out = done.stdout + done.stderr
    assert done.returncode != 0, out
    for r in range(world):
        head = (f"[rank {r}/{world}] ERROR: [rank {r} of {world}] tensor-parallel ranks disagree on the MLA "
                f"backend choice: rank {odd} differs from")
        assert head in out, out
        assert re.search(rf"\[rank {r}/{world}\] .*{re.escape(expect)}", out), out
    assert "max abs diff" not in out  # no step ran
    assert "FAILED" in out and out.count(": mismatch") == world
    return out


def test_one_rank_with_other_backend_options_stops_every_rank(tmp_path):
    policy = tmp_path / "chunks.toml"
    policy.write_text(SMALL_CHUNKS)
    done = run_example("--world-size", "4", "--policy-for-rank", f"2={policy}")
    out = _assert_every_rank_stopped(done, 4, 2, "ranks 0,1,3: 65536 | rank 2: 1024")
    assert f"rank 2: {policy}" in out  # where the odd policy came from


def test_one_rank_with_a_policy_that_picks_differently_stops_every_rank(tmp_path):
    policy = tmp_path / "only_flashinfer.toml"
    policy.write_text(ONLY_FLASHINFER)
    done = run_example("--world-size", "2", "--policy-for-rank", f"1={policy}")
    _assert_every_rank_stopped(done, 2, 1, "rank 1: no backend: NoBackendError (fallback = 'error'): "
                                           "flashinfer_mla unavailable")


SCRIPT = """
import sys, torch.distributed as dist, torch.multiprocessing as mp
from mlacore import MLADecoder
from mlacore.distributed import check_same_choice, RankMismatchError

def worker(rank, port):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=3)
    classes = [(1, 1, 10)] + ([("not", "a", "class")] if rank == 1 else [])
    try:
        fp = check_same_choice(MLADecoder(4, 16), classes)
        print(f"RANK {rank} AGREED {fp['digest']}", flush=True)
    except RankMismatchError as err:
        print(f"RANK {rank} RAISED {err}", flush=True)
    dist.destroy_process_group()

if __name__ == "__main__":
    import socket
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    mp.spawn(worker, args=(port,), nprocs=3)
"""


def test_a_rank_failing_inside_the_helper_makes_every_rank_raise_not_hang(tmp_path):
    script = tmp_path / "check.py"
    script.write_text(textwrap.dedent(SCRIPT))
    done = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=subprocess_env(), capture_output=True,
                          text=True, timeout=TIMEOUT)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    for r in range(3):
        assert f"RANK {r} RAISED [rank {r} of 3] MLA backend choice check failed on rank 1" in out, out
    assert "AGREED" not in out
    assert "ShapeClass.batch_size: expected an int >= 1, got 'not'" in out  # what rank 1 got wrong
