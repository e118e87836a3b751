"""A deterministic fuzz of the policy loader: every mutation is either a valid policy or one PolicyError.

Mutations of a rich policy file: misspelled keys, wrong types, non-UTF-8
encodings, deep nesting, empty and non-positive sets. Whatever the file
holds, loading it (and building a dispatcher from it, which validates the
options) must never raise anything but `PolicyError`, and every error line
must name the file and a key path.
"""

import random
import re

import pytest

from mlacore import Dispatcher, PolicyError, load_policy
from mlacore.registry import BackendRegistry

BASE = """\
# a policy with every kind of key
[mla]
order = ["cute_dsl_mla", "flashinfer_mla", "reference"]
fallback = "reference"

[backend.reference]
enabled = true
[backend.reference.options]
chunk_tokens = 4096

[[backend.reference.allow]]
num_heads = [16, 128]
seq_len_q = [1, 2]
kv_dtype = ["bf16", "fp8_e4m3"]
page_size = [64]
min_batch = 1
max_batch = 64
min_kv_len = 0
max_kv_len = 8192
options = { chunk_tokens = 512 }

[[backend.reference.deny]]
q_dtype = ["fp32"]
"""

KEYS = ["order", "fallback", "enabled", "chunk_tokens", "num_heads", "seq_len_q", "kv_dtype", "page_size",
        "min_batch", "max_batch", "min_kv_len", "max_kv_len", "options", "q_dtype", "allow", "deny", "mla"]
WRONG_VALUES = ['"32"', "32.0", "true", "0", "-16", "[]", "[0]", "[-16]", '["16"]', "[true]", "{}", "1e400",
                '"fp9"', "[1, [2]]", "2147483648"]


def _misspell(rng: random.Random, text: str) -> str:
    key = rng.choice(KEYS)
    if key not in text:
        return text
    i = rng.randrange(len(key) - 1)
    wrong = key[:i] + key[i + 1] + key[i] + key[i + 2:] if rng.random() < 0.5 else key[:i] + key[i + 1:]
    return text.replace(key, wrong, 1)


def _wrong_value(rng: random.Random, text: str) -> str:
    lines = text.splitlines()
    candidates = [i for i, ln in enumerate(lines) if "=" in ln and not ln.startswith("#")]
    i = rng.choice(candidates)
    key = lines[i].split("=", 1)[0]
    lines[i] = f"{key}= {rng.choice(WRONG_VALUES)}"
    return "\n".join(lines) + "\n"


def _nested(rng: random.Random, text: str) -> str:
    depth = rng.choice([50, 500, 5000])
    if rng.random() < 0.5:
        return text + "\n[backend.reference.options]\nx = " + "[" * depth + "]" * depth + "\n"
    return text.replace("chunk_tokens = 4096", "deep = " + "{a = " * depth + "1" + "}" * depth, 1)


def mutations(n: int = 300):
    rng = random.Random(20261130)
    for k in range(n):
        kind = k % 5
        if kind == 0:
            yield "misspell", _misspell(rng, BASE).encode()
        elif kind == 1:
            yield "type", _wrong_value(rng, BASE).encode()
        elif kind == 2:
            yield "nesting", _nested(rng, BASE).encode()
        elif kind == 3:
            enc = rng.choice(["latin-1-comment", "utf-16", "xff", "truncated", "bom", "nul"])
            body = BASE
            if enc == "latin-1-comment":
                yield enc, ("# caf\u00e9 r\u00e9glages\n" + body).encode("latin-1")
            elif enc == "utf-16":
                yield enc, body.encode("utf-16")
            elif enc == "xff":
                yield enc, b"# \xff\n" + body.encode()
            elif enc == "truncated":
                yield enc, body.encode() + "# \u00e9".encode()[:-1]
            elif enc == "bom":
                yield enc, b"\xef\xbb\xbf" + body.encode()
            else:
                yield enc, body.encode().replace(b"reference", b"refer\x00ence", 1)
        else:  # several mutations at once
            text = BASE
            for _ in range(3):
                text = rng.choice([_misspell, _wrong_value])(rng, text)
            yield "combined", text.encode()


LINE = re.compile(r"^(?P<file>[^:]+): (?P<rest>.+)$")


@pytest.fixture(scope="module")
def registry():
    return BackendRegistry(env={}).load()


def test_fuzzed_policies_load_or_fail_with_one_policy_error_naming_the_file(tmp_path, registry):
    outcomes = {"ok": 0, "error": 0}
    for i, (kind, data) in enumerate(mutations()):
        path = tmp_path / f"p{i}.toml"
        path.write_bytes(data)
        try:
            Dispatcher(policy=load_policy(path), registry=registry, env={})
            outcomes["ok"] += 1
        except PolicyError as err:
            outcomes["error"] += 1
            text = str(err)
            assert "Traceback" not in text, (kind, text)
            for line in text.splitlines():
                m = LINE.match(line)
                assert m and m.group("file") == str(path), (kind, line)
        # anything else (UnicodeDecodeError, RecursionError, TypeError...) fails the test by escaping
    assert outcomes["error"] > 200 and outcomes["ok"] > 0, outcomes


def test_known_bad_files_get_clear_messages(tmp_path, registry):
    cases = {
        b"# \xff\n[mla]\norder = []\n": "not UTF-8",
        "[mla]\norder = []\n".encode("utf-16"): "not UTF-8",
        b"[mla]\nx = " + b"[" * 5000 + b"]" * 5000: "nested too deeply",
        b"[mla]\norder = [\"reference\"]\n[backend.reference]\nallow = [{num_heads = []}]\n": "non-empty list",
        b"[mla]\norder = [\"reference\"]\n[backend.reference]\nallow = [{min_batch = \"32\"}]\n": "got '32'",
        b"[mla]\norder = [\"reference\"]\n[backend.reference]\nenabled = 0\n": "valid boolean",
        b"[mla]\norder = [\"reference\"]\n[backend.reference.options]\nchunk_tokns = 64\n":
            "backend.reference.options.chunk_tokns: unknown option",
    }
    for data, needle in cases.items():
        path = tmp_path / "bad.toml"
        path.write_bytes(data)
        with pytest.raises(PolicyError) as err:
            Dispatcher(policy=load_policy(path), registry=registry, env={})
        assert needle in str(err.value) and str(path) in str(err.value), str(err.value)
    bom = tmp_path / "bom.toml"
    bom.write_bytes(b"\xef\xbb\xbf[mla]\norder = [\"reference\"]\n")
    assert load_policy(bom).mla.order == ("reference",)
