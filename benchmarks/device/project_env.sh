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
if [ -d .kcache ]; then
  mkdir -p "${KCACHE:-/tmp/mla_kcache}" && cp -rn .kcache/. "${KCACHE:-/tmp/mla_kcache}/"
  echo "kernel cache seeded from .kcache ($(find .kcache -name '*.kernel' | wc -l) kernels)"
fi
nvidia-smi --query-gpu=index,name,driver_version,clocks.sm --format=csv,noheader | tee "$OUT/gpu.txt"
