"""Scan compiled cute_dsl_mla kernels (a kernel cache directory, e.g. ./.kcache) for two code-generation failures
that no test on this CPU machine sees, because they depend on the toolchain that builds the device's kernels:

* serialized WGMMAs: ptxas warning C7518 ("wgmma.mma_async instructions are serialized due to ..."). ptxas then
  puts a WARPGROUP.DEPBAR (wait for every WGMMA in flight) after each HGMMA. Every fp8 seesaw kernel up to
  mla-cute-dsl 0.2.15 was built so by the devpack's toolchain (the one the H200 runs) and not by the CPU venv's;
  the fp8 seesaw's missing ~100 us at H=128 against the bf16 one was this.
* local memory (LDL/STL: register spills or stack arrays).

Each `.kernel` file of the cache holds the host object with the cubin inside; the cubin is disassembled with
nvdisasm (--nvdisasm, $NVDISASM, PATH, or triton's copy). Prints one line per kernel; exits 1 when a kernel's
WGMMAs are serialized, so that benchmarks/device/prebuild_kcache.sh reports it before a device session (local
memory is listed, not failed: the mma.sync kernels keep a few LDL/STL outside their loops).

    python benchmarks/device/sass_check.py [CACHE_DIR] [--nvdisasm PATH]
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ELF_MAGIC = b"\x7fELF"


@dataclass
class SassCounts:
    """Instruction counts that tell whether a kernel's WGMMAs run asynchronously."""

    hgmma: int
    depbar: int
    local: int

    @property
    def serialized(self) -> bool:
        """A wait after (nearly) every WGMMA: what ptxas emits when it serializes them (C7518). A kernel whose
        WGMMAs run asynchronously waits once per commit group (6-8 in the seesaw kernels, 2-3 in the others)."""
        return self.hgmma > 8 and self.depbar >= self.hgmma

    def problems(self) -> list[str]:
        out = []
        if self.serialized:
            out.append(f"serialized WGMMAs ({self.depbar} WARPGROUP.DEPBAR for {self.hgmma} HGMMA)")
        if self.local:
            out.append(f"{self.local} local-memory loads/stores (LDL/STL)")
        return out


def count_sass(sass: str) -> SassCounts:
    """Counts of one kernel's disassembly (nvdisasm text)."""
    return SassCounts(hgmma=len(re.findall(r"\bHGMMA\.", sass)),
                      depbar=len(re.findall(r"\bWARPGROUP\.DEPBAR\b", sass)),
                      local=len(re.findall(r"\b(?:LDL|STL)(?:\.\w+)*\s", sass)))


def embedded_elfs(blob: bytes) -> list[bytes]:
    """Every ELF image inside `blob`, the innermost (last) first: a cache entry is a host object whose data holds
    the cubin, itself an ELF."""
    starts = [m.start() for m in re.finditer(re.escape(ELF_MAGIC), blob)]
    return [blob[s:] for s in reversed(starts)]


def find_nvdisasm(explicit: str | None = None) -> str | None:
    for cand in (explicit, os.environ.get("NVDISASM"), shutil.which("nvdisasm"),
                 *glob.glob(os.path.join(sys.prefix, "lib", "python3*", "site-packages", "triton", "backends",
                                         "nvidia", "bin", "nvdisasm")),
                 *glob.glob("/tmp/py312/lib/python3*/site-packages/triton/backends/nvidia/bin/nvdisasm")):
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return None


def disassemble(entry: Path, nvdisasm: str) -> str | None:
    """The SASS of the cubin inside one cache entry (None when no embedded ELF disassembles)."""
    blob = entry.read_bytes()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        for elf in embedded_elfs(blob):
            with open(path, "wb") as fh:
                fh.write(elf)
            run = subprocess.run([nvdisasm, "-c", path], capture_output=True, text=True)
            if run.returncode == 0 and re.search(r"\b(?:HGMMA|HMMA|FFMA|LDS)\b", run.stdout):
                return run.stdout
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("cache_dir", nargs="?", default=".kcache")
    ap.add_argument("--nvdisasm", help="nvdisasm binary (default: $NVDISASM, PATH, triton's copy)")
    a = ap.parse_args(argv)
    nvd = find_nvdisasm(a.nvdisasm)
    if nvd is None:
        print("sass_check: no nvdisasm found (--nvdisasm, $NVDISASM, PATH, triton): not checked", file=sys.stderr)
        return 0
    entries = sorted(Path(a.cache_dir).rglob("*.kernel"))
    bad = local = 0
    for entry in entries:
        sass = disassemble(entry, nvd)
        if sass is None:
            print(f"  ?  {entry.name[:90]}: no cubin found")
            continue
        c = count_sass(sass)
        probs = c.problems()
        bad += c.serialized
        local += bool(c.local)
        mark = "BAD" if c.serialized else (" lm" if c.local else " ok")
        print(f"{mark} {entry.name[:90]}: HGMMA {c.hgmma} DEPBAR {c.depbar} LDL/STL {c.local}"
              + (f"  <- {'; '.join(probs)}" if probs else ""))
    print(f"sass_check: {len(entries)} kernels, {bad} with serialized WGMMAs, {local} with local memory")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
