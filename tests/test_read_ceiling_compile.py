"""benchmarks/read_ceiling.py compiles for sm_90a on the CPU, and each kernel's PTX has the load it is meant to
measure (a kernel that silently fell back to another load path would measure the wrong ceiling)."""

import importlib.util
import os
import pathlib

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # before the DSL is imported: no GPU to ask
pytest.importorskip("cutlass.cute", reason="nvidia-cutlass-dsl is not installed")

_SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "read_ceiling.py"


@pytest.fixture(scope="module")
def rc():
    spec = importlib.util.spec_from_file_location("read_ceiling", _SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _ptx(rc, kernel, tmp_path) -> str:
    rc.compile_kernel(kernel, str(tmp_path))
    return "".join(p.read_text() for p in tmp_path.glob("*.ptx"))


# smallest configs: one warp, one CTA, shortest rings
@pytest.mark.parametrize("make, want, unwanted", [
    (lambda rc: rc.LdgRead(32, 2, 1, "nc"), "ld.global.nc.v4.b32", None),
    (lambda rc: rc.LdgRead(32, 2, 1, "na"), "ld.global.L1::no_allocate.v4.b32", "ld.global.nc"),
    (lambda rc: rc.LdgRead(32, 2, 1, "plain"), "ld.global.v4.b32", "ld.global.nc"),
    (lambda rc: rc.CpAsyncRead(32, 1, 2, 1), "cp.async.cg.shared.global", None),
    (lambda rc: rc.TmaBulkRead(4096, 2, 1, threads=32),
     "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes", None),
], ids=["ldg.nc", "ldg.na", "ldg.plain", "cp.async", "tma.bulk"])
def test_kernel_ptx_has_its_load(rc, tmp_path, make, want, unwanted):
    ptx = _ptx(rc, make(rc), tmp_path)
    assert want in ptx
    if unwanted:
        assert unwanted not in ptx
    # the data is consumed: the sum reaches the one int32 store per thread
    assert "st.global" in ptx


def test_sweep_fits_the_h200(rc):
    """Every sweep config's shared memory fits 227 KB per SM at its CTAs per SM, and its chunk divides the
    default 604 MB buffer (else the device run would skip it)."""
    for k in rc.configs(True, rc.H200_SMS):
        assert rc.DEFAULT_BYTES % k.chunk_bytes == 0, k.label()
        if hasattr(k, "smem_bytes"):
            assert k.smem_bytes() * (k.ctas // rc.H200_SMS) <= 227 * 1024, k.label()
