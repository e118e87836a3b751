"""`mla backends explain --capability 10.0` on a machine without that GPU: what a B200 would pick, and why.

The capability is an input (each backend's availability_for judges it from
the installed packages); no kernel runs and nothing is faked. Needs the
first-party plugins installed (`make test` installs them).
"""

import json

import pytest
import torch

from mlacore.tools.cli import main

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available() and torch.cuda.get_device_capability() == (10, 0),
    reason="on a B200 explain judges the real GPU, not a simulated one")

pytest.importorskip("mla_cutlass")
pytest.importorskip("mla_flashinfer")
pytest.importorskip("mla_cute_dsl")

BLACKWELL = "examples/policies/blackwell_mla.toml"


def explain(capsys, *argv):
    code = main(["backends", "explain", *argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def verdicts(data):
    return {v["backend"]: v for v in data["verdicts"]}


def test_default_policy_on_a_b200_picks_trtllm_gen_and_says_it_is_unverified(capsys):
    code, data = explain(capsys, "--num-heads", "128", "--capability", "10.0")
    assert code == 0
    assert data["simulated"].startswith("simulated cuda:sm_100: no such GPU here")
    assert data["chosen"] == "flashinfer_mla"
    assert "trtllm-gen: not verified on hardware" in " ".join(data["notes"])
    v = verdicts(data)
    assert v["cutlass_mla"]["outcome"] == "cannot implement"
    assert v["cutlass_mla"]["reasons"] == ["return_lse: the CUTLASS MLA kernel writes no LSE"]
    assert v["cute_dsl_mla"]["outcome"] == "policy"


def test_blackwell_policy_routes_each_shape(capsys):
    code, data = explain(capsys, "--policy", BLACKWELL, "--num-heads", "16", "--seq-len-q", "2", "--batch", "64",
                         "--capability", "10.0")
    assert code == 0 and data["chosen"] == "cute_dsl_mla"
    assert any("sm_100/103/107 path" in n and "not verified on hardware" in n for n in data["notes"])
    code, data = explain(capsys, "--policy", BLACKWELL, "--num-heads", "32", "--no-lse", "--capability", "10.0")
    assert data["chosen"] == "cutlass_mla"
    assert any("not verified on hardware" in n for n in data["notes"])
    assert verdicts(data)["cute_dsl_mla"]["outcome"] == "policy"
    code, data = explain(capsys, "--policy", BLACKWELL, "--num-heads", "96", "--capability", "10.0")
    v = verdicts(data)
    assert data["chosen"] == "reference"  # H=96 with LSE: trtllm-gen refuses 64 < H < 128, cutlass writes no LSE
    assert "num_heads=96: trtllm-gen takes 1..64 or 128 (FlashInfer refuses 64 < H < 128)" in v["flashinfer_mla"][
        "reasons"]


def test_hopper_answer_is_unchanged_in_kind(capsys):
    code, data = explain(capsys, "--policy", BLACKWELL, "--num-heads", "32", "--no-lse", "--capability", "9.0")
    v = verdicts(data)
    assert v["cutlass_mla"]["outcome"] == "unavailable"
    assert "sm_90: CUTLASS MLA kernels need SM100" in v["cutlass_mla"]["reasons"]
    assert data["chosen"] == "flashinfer_mla"


def test_text_output_names_the_simulated_device_and_the_notes(capsys):
    code = main(["backends", "explain", "--policy", BLACKWELL, "--num-heads", "16", "--no-lse", "--capability",
                 "10.0"])
    out = capsys.readouterr().out
    assert code == 0
    assert "device:  simulated cuda:sm_100" in out
    assert "chosen: cutlass_mla" in out
    assert "not verified on hardware" in out
