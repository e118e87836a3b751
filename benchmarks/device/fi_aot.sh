#!/usr/bin/env bash
# FlashInfer's fa2/fa3 JIT modules take 25-30 s each to build on every fresh device machine.
#   save:    after a run that built them: gzip each built module into $OUT/fiaot/ (comes back here;
#            at most 8 files of 16 MiB). Keep them in ./.fiaot/ (ignored: .git/info/exclude).
#   restore: on a fresh machine (devpack set up, env.sh sourced), with `carry: [".fiaot"]`: install
#            them where FlashInfer looks for ahead-of-time modules (flashinfer/data/aot/<name>/<name>.so),
#            which it loads without building.
set -euo pipefail
cd "$(dirname "$0")/../.."
mode=${1:?usage: fi_aot.sh save|restore}
dirs=$(python -c "import flashinfer.jit.env as e; print(e.FLASHINFER_JIT_DIR, e.FLASHINFER_AOT_DIR)")
jit_dir=${dirs% *}; aot_dir=${dirs#* }
if [ "$mode" = save ]; then
  OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/fiaot"
  for so in "$jit_dir"/*/*.so; do
    [ -f "$so" ] || continue
    gzip -c "$so" > "$OUT/fiaot/$(basename "$so").gz"
    echo "saved $(basename "$so") ($(du -h "$OUT/fiaot/$(basename "$so").gz" | cut -f1))"
  done
elif [ "$mode" = restore ]; then
  for gz in .fiaot/*.so.gz; do
    [ -f "$gz" ] || { echo "no .fiaot/*.so.gz to restore"; exit 0; }
    name=$(basename "$gz" .gz); mod=${name%.so}
    mkdir -p "$aot_dir/$mod"; gunzip -c "$gz" > "$aot_dir/$mod/$name"
    echo "restored $mod"
  done
else
  echo "usage: fi_aot.sh save|restore" >&2; exit 2
fi
