"""GPU test of the persistent kernel cache: a kernel loaded from disk in a
second process computes exactly what the in-process compile computes.

This process compiles the kernels of ``disk_cache_child.CASES`` into a fresh
cache directory and runs them; a child process, with ``cute.compile``
disabled, loads the same kernels from disk, runs the same inputs and saves
its outputs. out and lse must be bit-equal (same cubin, same launch).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import disk_cache_child as child  # noqa: E402

sys.path.remove(str(HERE))


def _is_sm90():
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


needs_sm90 = pytest.mark.skipif(not _is_sm90(), reason="needs an SM90 GPU")


@needs_sm90
def test_kernel_loaded_from_disk_in_another_process_is_bit_equal(cache_dir, tmp_path):
    from mla_cute_dsl.kernels import cache_key, disk_cache, kernel_cache
    from mla_cute_dsl.kernels.schedule import block_m_for

    cache = cache_dir  # private disk cache, empty in-process cache (conftest)

    ref = [child.run_case(c) for c in child.CASES]
    specs = []
    for q, kv, B, s_q, H, S, seed in child.CASES:
        bm = block_m_for(s_q * H)
        assert kernel_cache.origin("partial", (q, kv, bm, None)) == "compiled"
        # the step's schedule picks one of the two combine kernels (MLACombineWide for many splits)
        assert "compiled" in (kernel_cache.origin("combine", (q,)), kernel_cache.origin("combine_wide", (q,)))
        specs.append(["partial", q, kv, bm])
    n_kernels = kernel_cache.stats()["compiled"]
    assert kernel_cache.stats()["disk_writes"] == n_kernels

    out_file = tmp_path / "child_out.pt"
    env = dict(os.environ)
    env[disk_cache.ENV_DIR] = str(cache)
    env["CUTE_DSL_ARCH"] = cache_key.target_arch()  # the arch this process compiled for
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE.parent), env.get("PYTHONPATH", "")) if p)
    r = subprocess.run([sys.executable, str(HERE / "disk_cache_child.py"), "--specs", json.dumps(specs),
                        "--forbid-compile", "--run-gpu", str(out_file)],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    rep = json.loads([ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")][-1][7:])
    assert rep["stats"]["compiled"] == 0 and rep["stats"]["disk_hits"] == n_kernels, rep

    got = torch.load(out_file)
    for case, (o_ref, l_ref), (o, l) in zip(child.CASES, ref, got):
        assert not torch.isnan(o_ref).any() and not torch.isnan(l_ref).any(), case
        assert torch.equal(o, o_ref), f"out differs for {case}"
        assert torch.equal(l, l_ref), f"lse differs for {case}"
