"""CPU tests of the persistent kernel cache (no GPU).

What a CPU can show: a second process gets its kernels from disk with
``cute.compile`` disabled, links the object file, and the loaded host entry
runs its compiled argument checks (it rejects CPU tensors with
"expected device_type=cuda"). Launching the loaded kernel and comparing its
outputs with an in-process compile needs an SM90 GPU:
``test_disk_cache_gpu.py``.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from mla_cute_dsl.kernels import cache_key, disk_cache, kernel_cache  # noqa: E402

HERE = Path(__file__).resolve().parent
CHILD = HERE / "disk_cache_child.py"
PLUGIN_ROOT = HERE.parent


def _has_cutlass() -> bool:
    try:
        import cutlass  # noqa: F401
    except Exception:
        return False
    return True


needs_cutlass = pytest.mark.skipif(not _has_cutlass(), reason="nvidia-cutlass-dsl not installed")




def _entries(d: Path):
    return sorted(p for p in d.rglob("*.kernel"))


def _child(cache: Path, *args: str):
    env = dict(os.environ)
    env[disk_cache.ENV_DIR] = str(cache)
    env["CUTE_DSL_ARCH"] = "sm_90a"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PLUGIN_ROOT), env.get("PYTHONPATH", "")) if p)
    r = subprocess.run([sys.executable, str(CHILD), *args], env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):]), r.stderr


# ---------------------------------------------------------------- key


def test_key_changes_with_everything_that_changes_the_binary():
    base = dict(source="s1", version="4.8.1", fingerprint="f", arch="sm_90a", settings="x")
    k = cache_key.make_key("partial", ("bf16", "bf16", 16, None), **base)
    assert k == cache_key.make_key("partial", ("bf16", "bf16", 16, None), **base)
    d = cache_key.key_digest(k)
    others = [
        cache_key.make_key("partial", ("bf16", "bf16", 32, None), **base),
        cache_key.make_key("partial", ("bf16", "bf16", 16, (1, 1, 2)), **base),
        cache_key.make_key("combine", ("bf16",), **base),
        cache_key.make_key("partial", ("bf16", "bf16", 16, None), **{**base, "source": "s2"}),
        cache_key.make_key("partial", ("bf16", "bf16", 16, None), **{**base, "version": "4.9.0"}),
        cache_key.make_key("partial", ("bf16", "bf16", 16, None), **{**base, "fingerprint": "g"}),
        cache_key.make_key("partial", ("bf16", "bf16", 16, None), **{**base, "arch": "sm_100a"}),
        cache_key.make_key("partial", ("bf16", "bf16", 16, None), **{**base, "settings": "y"}),
    ]
    digests = {cache_key.key_digest(o) for o in others}
    assert d not in digests and len(digests) == len(others)
    # a key survives the JSON round trip of an entry header (tuples -> lists)
    assert json.loads(json.dumps(k)) == cache_key.make_key("partial", ("bf16", "bf16", 16, None), **base)


def test_source_hash_follows_the_kernel_files(tmp_path, monkeypatch):
    src = Path(cache_key.__file__).parent
    for p in src.glob("*.py"):
        (tmp_path / p.name).write_bytes(p.read_bytes())
    monkeypatch.setattr(cache_key, "_KERNELS_DIR", tmp_path)
    cache_key.source_hash.cache_clear()
    try:
        h1 = cache_key.source_hash()
        with open(tmp_path / "sm90_decode.py", "a") as f:
            f.write("\n# changed\n")
        cache_key.source_hash.cache_clear()
        h2 = cache_key.source_hash()
    finally:
        cache_key.source_hash.cache_clear()
    assert h1 != h2


@needs_cutlass
def test_detected_key_fields():
    k = cache_key.make_key("combine", ("bf16",))
    import cutlass

    assert k["dsl_version"] == cutlass.__version__
    assert k["arch"] == os.environ["CUTE_DSL_ARCH"]
    assert len(k["source_sha256"]) == 64
    assert k["dsl_fingerprint"], "the DSL's own version hash was not readable"
    assert "arch=" in k["dsl_settings"]


# ---------------------------------------------------------------- entry format


def test_entry_round_trip_and_rejections():
    key = cache_key.make_key("combine", ("bf16",), source="s", version="v", fingerprint="f",
                             arch="sm_90a", settings="")
    data = disk_cache.encode_entry(key, "mla_combine_bf16", b"\x7fELF payload", 0.5)
    assert disk_cache.decode_entry(data, key) == ("mla_combine_bf16", b"\x7fELF payload")
    bad = [
        b"garbage",
        data[:-3],                                # truncated payload
        data[:-1] + bytes([data[-1] ^ 1]),        # flipped payload byte
        data[: len(disk_cache.MAGIC) + 5],         # truncated header
        data.replace(b'"size"', b'"sizx"', 1),    # header field missing
    ]
    for b in bad:
        with pytest.raises(disk_cache.CorruptEntry):
            disk_cache.decode_entry(b, key)
    with pytest.raises(disk_cache.CorruptEntry, match="another key"):
        disk_cache.decode_entry(data, {**key, "arch": "sm_100a"})


def test_write_atomic_leaves_no_temp_files(tmp_path):
    p = tmp_path / "a" / "b.kernel"
    disk_cache.write_atomic(p, b"one")
    disk_cache.write_atomic(p, b"two")
    assert p.read_bytes() == b"two"
    assert [x.name for x in p.parent.iterdir()] == ["b.kernel"]


def test_cache_root_env(monkeypatch, tmp_path):
    monkeypatch.delenv(disk_cache.ENV_DIR, raising=False)
    monkeypatch.delenv(disk_cache.ENV_ENABLE, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert disk_cache.cache_root() == tmp_path / "xdg" / "mla-cute-dsl"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert disk_cache.cache_root() == tmp_path / "home" / ".cache" / "mla-cute-dsl"
    monkeypatch.setenv(disk_cache.ENV_DIR, str(tmp_path / "mine"))
    assert disk_cache.cache_root() == tmp_path / "mine"
    for off in ("0", "off", "False", "no"):
        monkeypatch.setenv(disk_cache.ENV_ENABLE, off)
        assert disk_cache.cache_root() is None
    monkeypatch.setenv(disk_cache.ENV_ENABLE, "1")
    assert disk_cache.cache_root() == tmp_path / "mine"


def test_symbols_are_c_identifiers():
    assert kernel_cache.symbol_for("partial", ("bf16", "fp8_e4m3", 32, (1, 2, 2))) == \
        "mla_partial_bf16_fp8_e4m3_32_1x2x2"
    assert kernel_cache.symbol_for("partial", ("bf16", "bf16", 16, None)) == "mla_partial_bf16_bf16_16"
    assert kernel_cache.symbol_for("combine", ("fp16",)).isidentifier()


# ---------------------------------------------------------------- with the DSL


@needs_cutlass
def test_second_process_loads_from_disk_without_compiling(cache_dir):
    from mla_cute_dsl.kernels import api

    api.get_partial_kernel("bf16", "fp8_e4m3", 64)
    api.get_combine_kernel("bf16")
    api.get_combine_kernel("bf16", wide=True)
    assert kernel_cache.stats()["compiled"] == 3 and kernel_cache.stats()["disk_writes"] == 3
    assert kernel_cache.origin("combine", ("bf16",)) == "compiled"
    assert kernel_cache.origin("combine_wide", ("bf16",)) == "compiled"
    assert len(_entries(cache_dir)) == 3

    specs = json.dumps([["partial", "bf16", "fp8_e4m3", 64], ["combine", "bf16"], ["combine_wide", "bf16"]])
    rep, err = _child(cache_dir, "--specs", specs, "--forbid-compile", "--probe-cpu")
    assert rep["stats"]["compiled"] == 0 and rep["stats"]["disk_hits"] == 3, rep
    assert rep["types"] == ["Function"] * 3  # tvm_ffi.Function from the object file
    assert "from the disk cache" in err
    # the loaded host entry ran: it checks its arguments and wants CUDA tensors
    probe = rep["probes"][0]
    assert "expected device_type=cuda" in probe and "float8_e4m3fn" in probe, probe
    # and says the same as the in-process compile
    sys.path.insert(0, str(HERE))
    try:
        from disk_cache_child import cpu_probe
    finally:
        sys.path.remove(str(HERE))
    assert cpu_probe(api.get_partial_kernel("bf16", "fp8_e4m3", 64), "bf16", "fp8_e4m3", 64) == probe


@needs_cutlass
def test_in_process_cache_stays_in_front(cache_dir):
    from mla_cute_dsl.kernels import api

    fn = api.get_combine_kernel("fp16")
    for p in _entries(cache_dir):
        p.unlink()  # the disk is not consulted again in this process
    assert api.get_combine_kernel("fp16") is fn
    assert kernel_cache.stats() == {"compiled": 1, "disk_hits": 0, "disk_writes": 1}


def _corrupt_flip(p: Path):
    b = bytearray(p.read_bytes())
    b[-100] ^= 0xFF
    p.write_bytes(bytes(b))


def _corrupt_truncate(p: Path):
    p.write_bytes(p.read_bytes()[:-1000])


def _corrupt_garbage(p: Path):
    p.write_bytes(os.urandom(4096))


def _corrupt_bad_object(p: Path):
    # a well-formed entry whose object file the linker refuses
    p.write_bytes(disk_cache.encode_entry(_key_of(p), "mla_combine_bf16", b"\x7fELF" + b"\0" * 200, 0.0))


def _key_of(p: Path):
    data = p.read_bytes()
    end = data.index(b"\n", len(disk_cache.MAGIC))
    return json.loads(data[len(disk_cache.MAGIC):end])["key"]


@needs_cutlass
@pytest.mark.parametrize("corrupt", [_corrupt_flip, _corrupt_truncate, _corrupt_garbage,
                                     _corrupt_bad_object])
def test_corrupt_entry_is_recompiled_with_a_warning(cache_dir, caplog, corrupt):
    from mla_cute_dsl.kernels import api

    api.get_combine_kernel("bf16")
    (entry,) = _entries(cache_dir)
    good_key = _key_of(entry)
    corrupt(entry)
    kernel_cache.clear()
    with caplog.at_level(logging.WARNING, logger="mla_cute_dsl"):
        fn = api.get_combine_kernel("bf16")
    assert fn is not None
    assert kernel_cache.stats()["compiled"] == 1 and kernel_cache.stats()["disk_hits"] == 0
    assert any("corrupt entry" in r.getMessage() for r in caplog.records), caplog.text
    # rewritten: the next process gets a good entry
    (entry2,) = _entries(cache_dir)
    assert entry2 == entry
    disk_cache.decode_entry(entry2.read_bytes(), good_key)


@needs_cutlass
def test_unreadable_and_unwritable_entry_never_fails(cache_dir, caplog):
    from mla_cute_dsl.kernels import api

    api.get_combine_kernel("bf16")
    (entry,) = _entries(cache_dir)
    entry.unlink()
    entry.mkdir()  # reading fails (a directory) and so does the rename onto it
    kernel_cache.clear()
    with caplog.at_level(logging.WARNING, logger="mla_cute_dsl"):
        assert api.get_combine_kernel("bf16") is not None
    msgs = " ".join(r.getMessage() for r in caplog.records)
    assert "cannot read" in msgs and "cannot write" in msgs
    assert kernel_cache.stats()["compiled"] == 1 and kernel_cache.stats()["disk_writes"] == 0
    assert [p.name for p in entry.parent.iterdir()] == [entry.name]  # no temp file left behind


@needs_cutlass
@pytest.mark.parametrize("field,value", [("source_hash", "edited-kernels"), ("dsl_version", "4.9.0")])
def test_changed_source_or_dsl_version_recompiles(cache_dir, monkeypatch, field, value):
    from mla_cute_dsl.kernels import api

    api.get_combine_kernel("bf16")
    assert len(_entries(cache_dir)) == 1
    kernel_cache.clear()
    monkeypatch.setattr(cache_key, field, lambda: value)
    api.get_combine_kernel("bf16")
    assert kernel_cache.stats()["compiled"] == 1 and kernel_cache.stats()["disk_hits"] == 0
    assert len(_entries(cache_dir)) == 2
    kernel_cache.clear()
    api.get_combine_kernel("bf16")  # the changed key now hits its own entry
    s = kernel_cache.stats()
    assert s["compiled"] == 0 and s["disk_hits"] == 1


@needs_cutlass
def test_disabled_disk_cache_writes_nothing(cache_dir, monkeypatch):
    from mla_cute_dsl.kernels import api

    monkeypatch.setenv(disk_cache.ENV_ENABLE, "0")
    api.get_combine_kernel("bf16")
    assert kernel_cache.stats()["compiled"] == 1 and kernel_cache.stats()["disk_writes"] == 0
    assert not cache_dir.exists()
