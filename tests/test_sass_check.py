"""benchmarks/device/sass_check.py: the counts that tell a serialized-WGMMA kernel (ptxas C7518) from one whose
WGMMAs run asynchronously, on SASS excerpts in the shapes nvdisasm prints, and the cubin found inside a cache
entry's host object."""

import importlib.util
import pathlib
import sys

import pytest

_SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "device" / "sass_check.py"


@pytest.fixture(scope="module")
def sc():
    spec = importlib.util.spec_from_file_location("sass_check", _SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclass looks its module up there
    spec.loader.exec_module(mod)
    return mod


def _hgmma(i: int) -> str:
    return f"        /*{0x9260 + 32 * i:04x}*/                   HGMMA.64x64x16.F32 R152, gdesc[UR24], R152, gsb0 ;\n"


DEPBAR = "        /*92e0*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;\n"
ARRIVE = "        /*92f0*/                   WARPGROUP.ARRIVE ;\n"


def test_a_wait_after_every_wgmma_is_serialized(sc):
    # what ptxas emitted for the fp8 seesaw (88 HGMMA, each followed by DEPBAR): the pattern of C7518
    sass = "".join(ARRIVE + _hgmma(i) + DEPBAR for i in range(88))
    c = sc.count_sass(sass)
    assert (c.hgmma, c.depbar, c.local) == (88, 88, 0)
    assert c.serialized
    assert "serialized WGMMAs (88 WARPGROUP.DEPBAR for 88 HGMMA)" in c.problems()


def test_one_wait_per_commit_group_is_not(sc):
    # the bf16 seesaw: 88 HGMMA in 6 commit groups, one DEPBAR each
    groups = [16, 16, 20, 20, 8, 8]
    sass, i = "", 0
    for n in groups:
        sass += ARRIVE + "".join(_hgmma(i + k) for k in range(n)) + DEPBAR
        i += n
    c = sc.count_sass(sass)
    assert (c.hgmma, c.depbar) == (88, 6)
    assert not c.serialized and c.problems() == []


def test_local_memory_is_counted_and_mma_sync_kernels_are_never_serialized(sc):
    sass = ("        /*0100*/                   STL.64 [R1+0x10], R20 ;\n"
            "        /*0110*/                   LDL R4, [R1+0x8] ;\n"
            "        /*0120*/                   HMMA.16816.F32.BF16 R8, R12, R16, R8 ;\n"
            "        /*0130*/                   LDS.128 R12, [R3] ;\n")
    c = sc.count_sass(sass)
    assert (c.hgmma, c.depbar, c.local) == (0, 0, 2)
    assert not c.serialized
    assert c.problems() == ["2 local-memory loads/stores (LDL/STL)"]


def test_embedded_elfs_innermost_first(sc):
    outer = b"\x7fELF" + b"host object " + b"\x7fELF" + b"cubin"
    elfs = sc.embedded_elfs(outer)
    assert elfs == [b"\x7fELFcubin", outer]
    assert sc.embedded_elfs(b"no elf here") == []


def test_main_without_nvdisasm_checks_nothing_and_says_so(sc, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sc, "find_nvdisasm", lambda explicit=None: None)
    assert sc.main([str(tmp_path)]) == 0
    assert "no nvdisasm found" in capsys.readouterr().err
