# Sourced by the device scripts (after the devpack's env.sh): go to the repository root,
# make $OUT, install the core and the plugins named in $PLUGINS into /tmp/projsite (first on
# PYTHONPATH), seed the kernel cache from a carried .kcache (prebuild_kcache.sh) and record the GPU in
# $OUT/gpu.txt.
set -o pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
pip install -q --no-deps --no-build-isolation --target /tmp/projsite . ${PLUGINS:-plugins/flashinfer_mla plugins/cute_dsl_mla} 2>&1 \
  | grep -v WARNING | tail -2
export PYTHONPATH=/tmp/projsite:$PYTHONPATH
# the arch the kernels are compiled for, set as benchmarks/device/prebuild_kcache.sh sets it on the CPU, so that the
# kernel cache keys of kernels prebuilt there match; a carried .kcache seeds the kernel cache (existing files kept)
export CUTE_DSL_ARCH=sm_90a
# every script reads and fills the same kernel cache (before, only some scripts exported it, so the others compiled
# into the default ~/.cache/mla-cute-dsl and missed the seeded kernels)
export MLA_CUTE_DSL_CACHE_DIR=${MLA_CUTE_DSL_CACHE_DIR:-${KCACHE:-/tmp/mla_kcache}}
export MLA_CUTE_DSL_TEST_CACHE_DIR=${MLA_CUTE_DSL_TEST_CACHE_DIR:-$MLA_CUTE_DSL_CACHE_DIR}
if [ -d .kcache ]; then
  mkdir -p "$MLA_CUTE_DSL_CACHE_DIR" && cp -rn .kcache/. "$MLA_CUTE_DSL_CACHE_DIR/"
  echo "kernel cache seeded from .kcache ($(find .kcache -name '*.kernel' | wc -l) kernels)"
fi
nvidia-smi --query-gpu=index,name,driver_version,clocks.sm --format=csv,noheader | tee "$OUT/gpu.txt"
