"""One decode step of a backend through MLADecoder, inside an NVTX range, for Nsight Compute: which kernels a
step launches and what each costs (counters, not timing; ncu runs them one by one).

    ncu --nvtx --nvtx-include "step/" --section SpeedOfLight --section LaunchStats \
        python benchmarks/ncu_step.py --backend flashinfer_mla:variant=fa3 -B 16 -S 2048 -H 16 --s-q 2

Eager (no CUDA graph), fresh random inputs, every request of length S, page 64, q bf16. Three untimed steps
first (compiles, FlashInfer's JIT, the plan's buffers), then one step inside the range "step".
"""

from __future__ import annotations

import argparse

import torch

from mlacore.decoder import MLADecoder
from mlacore.problem import DecodeProblem, DeviceSpec, torch_dtype
from mlacore.testing.compare import only_backend_dispatcher
from mlacore.testing.inputs import make_inputs
from mlacore.tools.bench import BackendSpec


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", required=True, help="NAME[:key=value,...] as in mla bench")
    ap.add_argument("-B", "--batch", type=int, required=True)
    ap.add_argument("-S", "--kv-len", type=int, required=True)
    ap.add_argument("-H", "--heads", type=int, required=True)
    ap.add_argument("--s-q", type=int, default=1)
    ap.add_argument("--kv-dtype", default="bf16", choices=["bf16", "fp8_e4m3"])
    a = ap.parse_args()
    problem = DecodeProblem(num_heads=a.heads, seq_len_q=a.s_q, batch_size=a.batch, max_kv_len=a.kv_len,
                            min_kv_len=a.kv_len, page_size=64, q_dtype="bf16", kv_dtype=a.kv_dtype,
                            device=DeviceSpec.of("cuda"))
    spec = BackendSpec.parse(a.backend)
    inputs = make_inputs(problem, device="cuda", seed=0)
    dispatcher = only_backend_dispatcher(spec.name, None, dict(spec.options))
    decoder = MLADecoder(a.heads, 64, q_dtype=torch_dtype("bf16"), kv_dtype=torch_dtype(a.kv_dtype), device="cuda",
                         sm_scale=inputs.sm_scale, kv_scale=inputs.kv_scale, dispatcher=dispatcher)
    plan = decoder.plan(inputs.kv_lens, inputs.page_table, a.s_q)
    out = torch.empty((*inputs.q.shape[:3], 512), dtype=inputs.q.dtype, device="cuda")
    lse = torch.empty(inputs.q.shape[:3], dtype=torch.float32, device="cuda")
    for _ in range(3):
        decoder.run(inputs.q, inputs.kv_cache, plan, out=out, lse=lse)
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push("step")
    decoder.run(inputs.q, inputs.kv_cache, plan, out=out, lse=lse)
    torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()
    print(f"{spec.label} B={a.batch} S={a.kv_len} H={a.heads} s_q={a.s_q} {a.kv_dtype}: step ran")


if __name__ == "__main__":
    main()
