"""First call on a fresh GPU machine: versions, one check per FlashInfer variant, with timings (JIT included)."""

import time

import torch

import mlacore
from mlacore.testing import check_backend
from mlacore.problem import DecodeProblem, DeviceSpec

print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(), torch.cuda.get_device_capability())
import flashinfer  # noqa: E402

print("flashinfer", flashinfer.__version__, "mlacore", mlacore.__version__)
dev = DeviceSpec.of("cuda")
for variant in ("fa3", "fa2"):
    for kv in ("bf16", "fp8_e4m3"):
        p = DecodeProblem(num_heads=16, seq_len_q=2, batch_size=3, min_kv_len=2, max_kv_len=1000, page_size=64,
                          kv_dtype=kv, device=dev)
        t0 = time.time()
        try:
            r = check_backend("flashinfer_mla", p, device="cuda", options={"variant": variant})
            print(f"{variant} {kv}: passed={r.passed} rel={r.out_rel_err:.2e} lse={r.lse_max_err:.2e} "
                  f"{r.messages} ({time.time() - t0:.1f}s)", flush=True)
        except Exception as e:
            print(f"{variant} {kv}: {type(e).__name__}: {e} ({time.time() - t0:.1f}s)", flush=True)
