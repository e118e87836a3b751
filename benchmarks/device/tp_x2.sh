#!/usr/bin/env bash
# On nvidia-h200-x2 (devpack set up, env.sh sourced): 2 ranks, NCCL, FlashInfer fa3 with CUDA
# graphs per rank, checked against one process running every head; then a rank given another
# policy must stop both ranks with the mismatch named. NVLink multicast stays off.
PLUGINS="plugins/flashinfer_mla"
source "$(dirname "$0")/project_env.sh"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
printf '[mla]\norder = ["flashinfer_mla"]\nfallback = "error"\n\n[backend.flashinfer_mla.options]\nvariant = "fa3"\n' > /tmp/fa3.toml
sed 's/fa3/fa2/' /tmp/fa3.toml > /tmp/fa2.toml
MLA_POLICY=/tmp/fa3.toml timeout 200 python examples/tp_decode.py --world-size 2 --device cuda --heads 128 \
  --batch 64 --kv-len 4096 --cuda-graph --steps 3 --log "$OUT/h200x2_tp_decode.log"; echo "tp run rc=$?"
MLA_POLICY=/tmp/fa3.toml timeout 90 python examples/tp_decode.py --world-size 2 --device cuda \
  --policy-for-rank 1=/tmp/fa2.toml --log "$OUT/h200x2_tp_mismatch.log"; echo "mismatch run rc=$? (expected non-zero)"
