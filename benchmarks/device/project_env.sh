# Sourced by the device scripts (after the devpack's env.sh): go to the repository root,
# make $OUT, install the core and the plugins named in $PLUGINS into /tmp/projsite (first on
# PYTHONPATH) and record the GPU in $OUT/gpu.txt.
set -o pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
pip install -q --no-deps --no-build-isolation --target /tmp/projsite . ${PLUGINS:-plugins/flashinfer_mla plugins/cute_dsl_mla} 2>&1 \
  | grep -v WARNING | tail -2
export PYTHONPATH=/tmp/projsite:$PYTHONPATH
nvidia-smi --query-gpu=index,name,driver_version,clocks.sm --format=csv,noheader | tee "$OUT/gpu.txt"
