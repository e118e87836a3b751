#!/usr/bin/env bash
# Here, on the CPU, before a device session: compile the cute_dsl_mla kernels into ./.kcache (git-ignored), to be
# carried to the GPU machine (`carry: [".kcache"]`, ~14 MB for the 165 kernels of prebuild_kernels.py);
# project_env.sh copies it into the kernel cache there, so that a fresh machine loads the kernels instead of
# compiling them.
#
# The cache key (mla_cute_dsl/kernels/cache_key.py) must come out as on the device, so this runs the devpack's
# own packages (Python 3.12, nvidia-cutlass-dsl 4.8.1 with its cu12 runtime, tvm-ffi) from the device's path,
# /tmp/mla-devenv/site (the DSL's settings string names its runtime library by absolute path), with
# CUTE_DSL_ARCH=sm_90a (project_env.sh sets the same on the device).
#   needs: ../shared/device/pack run once (its staged site in ~/.cache/mla-devpack), a Python 3.12 with torch
#          (PY312, default /tmp/py312/bin/python; e.g. `python3.12 -m venv /tmp/py312 && /tmp/py312/bin/pip install
#          torch==2.13.0`).
#   JOBS=1 builds in one process (default: two on a machine with >= 2 cores).
#   ONLY=substring builds a subset (labels of prebuild_kernels.py; "a|b": labels containing a or b).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY312=${PY312:-/tmp/py312/bin/python}
STAGE=$(ls -d "${MLA_DEVPACK_CACHE:-$HOME/.cache/mla-devpack}"/*/stage/site | head -1)
[ -d "$STAGE" ] || { echo "no staged devpack site: run ../shared/device/pack first" >&2; exit 1; }
if [ ! -d /tmp/mla-devenv/site ]; then
  mkdir -p /tmp/mla-devenv && cp -al "$STAGE" /tmp/mla-devenv/site 2>/dev/null || cp -a "$STAGE" /tmp/mla-devenv/site
fi
EXCLUDE="$(git rev-parse --git-common-dir)/info/exclude"  # also from a git worktree (.git is a file there)
grep -qxF "/.kcache/" "$EXCLUDE" 2>/dev/null || echo "/.kcache/" >> "$EXCLUDE"
export PYTHONPATH=/tmp/mla-devenv/site:/tmp/mla-devenv/site/nvidia_cutlass_dsl/dsl_packages:plugins/cute_dsl_mla:. \
  CUTE_DSL_ARCH=sm_90a MLA_CUTE_DSL_CACHE_DIR="$PWD/.kcache"
# JOBS=2 (the default on >= 2 cores): a second process builds the list from its end into the same cache (the
# cache's writes are atomic renames; a kernel the other process stored is loaded, not built again): the full list
# in ~15 min instead of ~45 on this 2-core machine (twenty-fifth session: 254 kernels in 892 s)
JOBS=${JOBS:-$(( $(nproc) >= 2 ? 2 : 1 ))}
REVLOG="${TMPDIR:-/tmp}/prebuild_kcache_reverse.$$.log"
if [ "$JOBS" -ge 2 ]; then
  "$PY312" benchmarks/device/prebuild_kernels.py --only "${ONLY:-}" --reverse > "$REVLOG" 2>&1 &
  REVERSE=$!
fi
"$PY312" benchmarks/device/prebuild_kernels.py --only "${ONLY:-}"
if [ "$JOBS" -ge 2 ]; then
  wait "$REVERSE" || { echo "the reverse prebuild failed: $REVLOG" >&2; tail -5 "$REVLOG" >&2; exit 1; }
  tail -1 "$REVLOG"; rm -f "$REVLOG"
fi
# keep one entry per kernel, the newest: a kernels/ edit changes every key's hash, and the stale entries would make
# the carried folder grow past the device's 64 MiB transfer limit (tree + carries) after two prebuilds
"$PY312" - .kcache <<'PRUNE'
import pathlib, sys
seen, stale = set(), 0
for f in sorted(pathlib.Path(sys.argv[1]).rglob("*.kernel"), key=lambda f: f.stat().st_mtime, reverse=True):
    kernel = (f.parent, f.name.rsplit("-", 1)[0])  # <kind>_<spec>-<key hash>.kernel: newest first, keep one
    if kernel in seen:
        f.unlink()
        stale += 1
    seen.add(kernel)
print(f"pruned {stale} stale kernel-cache entries")
PRUNE
du -sh .kcache
# the device's toolchain can serialize WGMMAs where the CPU venv's does not (every fp8 seesaw kernel up to 0.2.15):
# scan what was built (needs an nvdisasm, e.g. the py312 venv's triton copy); a serialized kernel is reported, not
# fatal here
"$PY312" benchmarks/device/sass_check.py .kcache | grep -v "^ ok" | tail -n 20 || echo "sass_check: serialized WGMMAs above"
