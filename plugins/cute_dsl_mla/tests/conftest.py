import os
import shutil
import sys
import tempfile

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Kernels compiled by the tests go to a per-session disk cache: a fresh temp dir
# (removed at the end) so the compile tests really compile and nothing is written
# to the user's ~/.cache; or MLA_CUTE_DSL_TEST_CACHE_DIR, kept, so that a second
# run of the suite gets every kernel from disk (the GPU tests then exercise
# disk-loaded kernels, graph capture included).
_KEEP = os.environ.get("MLA_CUTE_DSL_TEST_CACHE_DIR", "").strip()
_SESSION_CACHE = _KEEP or tempfile.mkdtemp(prefix="mla-cute-dsl-test-cache-")
os.environ["MLA_CUTE_DSL_CACHE_DIR"] = _SESSION_CACHE
os.environ.pop("MLA_CUTE_DSL_DISK_CACHE", None)
# The kernels are sm_90a's; the DSL reads CUTE_DSL_ARCH when cutlass is first imported, which a protocol test's
# import of the kernel modules can do during collection before a compile test's own module-level setdefault runs
# (on a CPU machine the DSL then targets sm_100a and every later compile fails: seen with an explicit file order
# that put the protocol files first). Set it here, before any test module is imported.
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")


def pytest_sessionfinish(session, exitstatus):
    if not _KEEP:
        shutil.rmtree(_SESSION_CACHE, ignore_errors=True)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """A private disk cache and an empty in-process cache, restored afterwards."""
    from mla_cute_dsl.kernels import disk_cache, kernel_cache

    d = tmp_path / "kcache"
    monkeypatch.setenv(disk_cache.ENV_DIR, str(d))
    monkeypatch.delenv(disk_cache.ENV_ENABLE, raising=False)
    monkeypatch.setattr(kernel_cache, "_memory", {})
    monkeypatch.setattr(kernel_cache, "_origin", {})
    monkeypatch.setattr(kernel_cache, "_stats", dict.fromkeys(kernel_cache._stats, 0))
    return d
