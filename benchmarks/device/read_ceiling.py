"""How fast can an H200 only read? A streaming-read ceiling for the decode targets (issue 11).

The bf16 H=16 targets ask for >= 4150 GB/s over the KV cache's bytes (B=64 S=8192 or B=128 S=4096: 604 MB read,
almost nothing written), and `mla bench`'s ceiling is a device-to-device copy (read + write, ~4250 GB/s). Whether a
pure read reaches 4150 GB/s was never measured (a torch sum over the same bytes took 3871 GB/s, tenth session).
This script times, on one buffer of the targets' size, CUDA-graph replays of:

* Triton kernels that load the buffer as int32 words and fold them with xor into one word per program (so the loads
  cannot be dropped and the arithmetic is one op per word): one program per tile (tile 4-64 KiB, 4-16 warps) and a
  persistent grid-stride form (1-8 programs per SM);
* torch's sum of the bf16 buffer in fp32, and torch's copy of 1 GiB (the `mla bench` ceiling) for reference.

Medians of REPS timed replays of a graph of LAUNCHES launches (CUDA events), GB/s = bytes read / time. Run on the
device: `python benchmarks/device/read_ceiling.py [--mb 604] [--reps 30]`. Needs torch and triton (the device
image has both); nothing from the project.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import triton
import triton.language as tl


@triton.jit
def _read_tiles(x_ptr, out_ptr, n_words, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)  # int32: the buffer holds < 2^31 words
    v = tl.load(x_ptr + offs, mask=offs < n_words, other=0)
    tl.store(out_ptr + pid, tl.reduce(v, 0, _xor))


@triton.jit
def _xor(a, b):
    return a ^ b


@triton.jit
def _read_persistent(x_ptr, out_ptr, n_words, n_tiles, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for t in range(pid, n_tiles, nprog):
        offs = t * BLOCK + tl.arange(0, BLOCK)
        acc ^= tl.load(x_ptr + offs, mask=offs < n_words, other=0)
    tl.store(out_ptr + pid, tl.reduce(acc, 0, _xor))


def time_graph(fn, launches: int, reps: int) -> float:
    """Median microseconds per launch over `reps` replays of a graph holding `launches` calls of fn. Its own timer
    (bench_kernel.py's is the same loop) because this script runs on the device image's python without the
    project or the devpack."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / launches)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=float, default=128 * 4096 * 576 * 2 / 1e6,
                    help="bytes to read, in MB (default: the bf16 KV cache of B=128 S=4096, 604 MB)")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--launches", type=int, default=10)
    args = ap.parse_args()
    n_words = int(args.mb * 1e6) // 4
    nbytes = n_words * 4
    x = torch.randint(-2**31, 2**31 - 1, (n_words,), dtype=torch.int32, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = torch.empty(max(sms * 8, triton.cdiv(n_words, 1024)), dtype=torch.int32, device="cuda")
    rows = []

    def record(name: str, us: float, moved: int) -> None:
        rows.append((name, us, moved / us / 1e3))
        print(f"{name:<44} {us:9.1f} us {moved / us / 1e3:8.0f} GB/s", flush=True)

    print(f"{torch.cuda.get_device_name(0)}, {sms} SMs, {nbytes / 1e6:.1f} MB read per launch, "
          f"median of {args.reps} replays of {args.launches} launches")
    def copy_ceiling(when: str) -> None:
        # mla bench's ceiling: a 1 GiB device-to-device copy, bytes read + written (there timed eagerly)
        src = torch.randint(0, 255, (2**30,), dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        record(f"torch copy 1 GiB, read + write ({when})", time_graph(lambda: dst.copy_(src), args.launches,
                                                                     args.reps), 2 * 2**30)

    copy_ceiling("first")
    xb = x.view(torch.bfloat16)
    record("torch sum bf16 -> fp32", time_graph(lambda: xb.sum(dtype=torch.float32), args.launches, args.reps),
           nbytes)
    for block in (1024, 2048, 4096, 8192, 16384):
        for warps in (4, 8, 16):
            grid = (triton.cdiv(n_words, block),)
            fn = lambda b=block, w=warps, g=grid: _read_tiles[g](x, out, n_words, BLOCK=b, num_warps=w)
            record(f"triton tiles {block * 4 // 1024} KiB, {warps} warps",
                   time_graph(fn, args.launches, args.reps), nbytes)
    for block in (2048, 4096, 8192):
        n_tiles = triton.cdiv(n_words, block)
        for per_sm in (1, 2, 4, 8):
            for warps in (4, 8):
                grid = (sms * per_sm,)
                fn = (lambda b=block, w=warps, g=grid, nt=n_tiles:
                      _read_persistent[g](x, out, n_words, nt, BLOCK=b, num_warps=w))
                record(f"triton persistent {block * 4 // 1024} KiB, {per_sm}/SM, {warps} warps",
                       time_graph(fn, args.launches, args.reps), nbytes)
    copy_ceiling("last")
    best = max((r for r in rows if not r[0].startswith("torch copy")), key=lambda r: r[2])
    print(f"best read: {best[0]}: {best[1]:.1f} us, {best[2]:.0f} GB/s")


if __name__ == "__main__":
    main()
