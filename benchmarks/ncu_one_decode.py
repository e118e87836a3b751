"""One decode of a cute_dsl_mla partial kernel, for Nsight Compute (counters, not timing).

    ncu --clock-control none -k 'regex:(?i)partial' python benchmarks/ncu_one_decode.py --kernel seesaw

Runs the chosen kernel twice (the first call compiles or loads it) on fresh random inputs with every
request of length S; page 64; contiguous page table.
"""

from __future__ import annotations

import argparse

import torch

SHAPES = {  # kernel: (B, s_q, H, S, kv dtype)
    "seesaw": (128, 1, 128, 4096, torch.bfloat16),
    "wgmma": (128, 1, 128, 4096, torch.bfloat16),
    "wgmma_fp8": (128, 1, 128, 4096, torch.float8_e4m3fn),
    "seesaw_fp8": (128, 1, 128, 4096, torch.float8_e4m3fn),
    # the backend's defaults at H=128: lazy rescale; the fp8 seesaw with its producer warpgroup
    "seesaw_lazy": (128, 1, 128, 4096, torch.bfloat16),
    "seesaw_fp8p": (128, 1, 128, 4096, torch.float8_e4m3fn),
    # fp8_loader=ring (the default since mla-cute-dsl 0.2.18): the producer's 7-chunk register ring
    "seesaw_fp8p_ring": (128, 1, 128, 4096, torch.float8_e4m3fn),
    "fp8reg": (64, 1, 16, 8192, torch.float8_e4m3fn),
    "fp8reg_sq2": (128, 2, 16, 4096, torch.float8_e4m3fn),
    # the mma.sync kernel (even split) with a bf16 cache: at fp8reg's bytes (B32 S8192) and at the s_q=2 target
    "mma_sync": (32, 1, 16, 8192, torch.bfloat16),
    "mma_sync_sq2": (128, 2, 16, 4096, torch.bfloat16),
}


def main() -> None:
    from mla_cute_dsl.kernels import alloc_workspace, make_schedule
    from mla_cute_dsl.kernels.api import mla_decode_sm90
    from mla_cute_dsl.kernels.sm90_decode_fp8 import mla_decode_sm90_fp8
    from mla_cute_dsl.kernels.sm90_wgmma_decode import mla_decode_sm90_wgmma, mla_decode_sm90_wgmma_seesaw

    ap = argparse.ArgumentParser()
    ap.add_argument("--kernel", choices=sorted(SHAPES), required=True)
    a = ap.parse_args()
    B, s_q, H, S, kv_dtype = SHAPES[a.kernel]
    fn = {"seesaw": mla_decode_sm90_wgmma_seesaw, "wgmma": mla_decode_sm90_wgmma,
          "wgmma_fp8": mla_decode_sm90_wgmma, "seesaw_fp8": mla_decode_sm90_wgmma_seesaw,
          "fp8reg": mla_decode_sm90_fp8, "fp8reg_sq2": mla_decode_sm90_fp8, "mma_sync": mla_decode_sm90,
          "mma_sync_sq2": mla_decode_sm90, "seesaw_lazy": mla_decode_sm90_wgmma_seesaw,
          "seesaw_fp8p": mla_decode_sm90_wgmma_seesaw, "seesaw_fp8p_ring": mla_decode_sm90_wgmma_seesaw}[a.kernel]
    kw = {"seesaw_lazy": {"lazy_rescale": True},
          "seesaw_fp8p": {"lazy_rescale": True, "fp8_producer": True},
          "seesaw_fp8p_ring": {"lazy_rescale": True, "fp8_producer": True, "fp8p_ring": 7}}.get(a.kernel, {})
    pages = S // 64
    q = torch.randn(B, s_q, H, 576, device="cuda").to(torch.bfloat16)
    kv = torch.randn(B * pages, 64, 576, device="cuda").to(kv_dtype)
    table = torch.arange(B * pages, dtype=torch.int32, device="cuda").view(B, pages)
    lens_cpu = torch.full((B,), S, dtype=torch.int32)
    sched = make_schedule(lens_cpu, s_q, H, torch.cuda.get_device_properties(0).multi_processor_count,
                          ctas_per_sm=2 if a.kernel.startswith("fp8reg") else 1)
    ws = alloc_workspace(sched)
    out = torch.empty(B, s_q, H, 512, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(B, s_q, H, dtype=torch.float32, device="cuda")
    for _ in range(2):
        fn(q, kv, table, lens_cpu.cuda(), 576 ** -0.5, 1.0, out, lse, sched, ws, **kw)
    torch.cuda.synchronize()
    print(a.kernel, "ok", float(out.float().abs().mean()))


if __name__ == "__main__":
    main()
