"""Child process for the disk-cache tests (run as a script, not collected).

Resolves the kernels of the given specializations in a fresh interpreter and
prints one JSON line with the cache counters, so the parent test can tell a
disk hit from a compile. Options:

  --forbid-compile  replace ``cute.compile`` by a function that raises, so any
                    compile is an error (proof that the kernels came from disk)
  --probe-cpu       call each partial kernel with CPU tensors: the host entry
                    of a loaded object must run its argument checks and reject
                    them (device_type=cuda); reports the message
  --run-gpu PATH    run ``mla_decode_sm90`` on the deterministic cases of
                    ``CASES`` and ``torch.save`` the outputs to PATH

The parent sets ``MLA_CUTE_DSL_CACHE_DIR``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Dict, List, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

#: (q dtype, kv dtype, B, s_q, H, max length, seed): one case per partial
#: specialization family; lengths include 0 and long rows (split + combine).
CASES: List[Tuple[str, str, int, int, int, int, int]] = [
    ("bf16", "bf16", 4, 1, 16, 3000, 1),        # BLOCK_M 16
    ("fp16", "fp16", 3, 1, 32, 700, 2),         # BLOCK_M 32
    ("bf16", "fp8_e4m3", 3, 2, 32, 2100, 3),    # BLOCK_M 64, fp8 cache
]

_DT = {"bf16": "bfloat16", "fp16": "float16", "fp8_e4m3": "float8_e4m3fn"}


def make_inputs(case, device: str = "cuda") -> Dict[str, object]:
    """Deterministic inputs of one case (built on the CPU, then moved)."""
    import torch

    q_name, kv_name, B, s_q, H, S, seed = case
    g = torch.Generator(device="cpu").manual_seed(seed)
    page = 64
    lens = [S, 0, max(1, S // 3), 17][:B]
    max_pages = -(-S // page) + 1
    P = B * max_pages + 2
    page_table = torch.randperm(P, generator=g)[: B * max_pages].view(B, max_pages).to(torch.int32)
    kv = torch.randn(P, page, 576, generator=g)
    kv_scale = 1.0
    if kv_name == "fp8_e4m3":
        kv = (kv * 2.0).to(torch.float8_e4m3fn)
        kv_scale = 0.37
    else:
        kv = kv.to(getattr(torch, _DT[kv_name]))
    q = torch.randn(B, s_q, H, 576, generator=g).to(getattr(torch, _DT[q_name]))
    return {
        "q": q.to(device), "kv": kv.to(device), "page_table": page_table.to(device),
        "lens_cpu": torch.tensor(lens, dtype=torch.int32),
        "lens": torch.tensor(lens, dtype=torch.int32, device=device),
        "sm_scale": 1.0 / 192 ** 0.5, "kv_scale": kv_scale,
    }


def run_case(case) -> Tuple[object, object]:
    """(out, lse) of one case on the GPU, with the kernels the process resolves."""
    import torch

    from mla_cute_dsl.kernels import alloc_workspace, make_schedule, mla_decode_sm90

    x = make_inputs(case)
    q = x["q"]
    B, s_q, H, _ = q.shape
    n_sm = torch.cuda.get_device_properties(0).multi_processor_count
    sched = make_schedule(x["lens_cpu"], s_q, H, n_sm)
    ws = alloc_workspace(sched)
    out = torch.full((B, s_q, H, 512), float("nan"), dtype=q.dtype, device="cuda")
    lse = torch.full((B, s_q, H), float("nan"), dtype=torch.float32, device="cuda")
    mla_decode_sm90(q, x["kv"], x["page_table"], x["lens"], x["sm_scale"], x["kv_scale"],
                    out, lse, sched, ws)
    torch.cuda.synchronize()
    return out.cpu(), lse.cpu()


def cpu_probe(fn, q_name: str, kv_name: str, rows: int) -> str:
    """Call a partial kernel with CPU tensors; return the error it raises."""
    import torch

    q_t, kv_t = getattr(torch, _DT[q_name]), getattr(torch, _DT[kv_name])
    args = (torch.zeros(1, rows, 576, dtype=q_t), torch.zeros(2, 64, 576, dtype=kv_t),
            torch.zeros(1, 2, dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
            torch.zeros(1, rows, 512, dtype=q_t), torch.zeros(1, rows),
            torch.zeros(4, 4, dtype=torch.int32), torch.zeros(2, rows, 512), torch.zeros(2, rows),
            1.0, 1.0, 1.0, 1, rows, 0)
    try:
        fn(*args)
    except Exception as e:  # the compiled argument check
        return f"{type(e).__name__}: {e}"
    return "no error"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--specs", default="[]", help='JSON list of ["partial", q, kv, bm] / ["combine", q] / ["combine_wide", q]')
    ap.add_argument("--forbid-compile", action="store_true")
    ap.add_argument("--probe-cpu", action="store_true")
    ap.add_argument("--run-gpu", default="")
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)  # the cache logs where kernels came from

    if a.forbid_compile:
        import cutlass.cute as cute

        def _no_compile(*args, **kwargs):
            raise AssertionError("cute.compile called although the kernel is on disk")

        cute.compile = _no_compile

    from mla_cute_dsl.kernels import api, kernel_cache

    report: Dict[str, object] = {"types": [], "probes": []}
    for spec in json.loads(a.specs):
        if spec[0] == "partial":
            fn = api.get_partial_kernel(spec[1], spec[2], spec[3])
            if a.probe_cpu:
                report["probes"].append(cpu_probe(fn, spec[1], spec[2], spec[3]))
        else:
            fn = api.get_combine_kernel(spec[1], wide=spec[0] == "combine_wide")
        report["types"].append(type(fn).__name__)
    if a.run_gpu:
        import torch

        torch.save([run_case(c) for c in CASES], a.run_gpu)
    report["stats"] = kernel_cache.stats()
    print("RESULT " + json.dumps(report))


if __name__ == "__main__":
    main()
