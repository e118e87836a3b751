"""Read-only HBM bandwidth ceiling of the GPU, measured with CuTe DSL kernels.

Why: two H200 targets ask a memory-bound decode kernel to read a 604 MB bf16 KV cache at >= 4150 GB/s. Our
kernel and FlashInfer fa3 both reach ~3960 GB/s; the only ceilings we had were a device copy (read+write) and a
torch ``sum``. This script answers: what pure READ bandwidth does the GPU reach, with the three ways a kernel
can pull bytes from HBM?

  ldg      128-bit ``ld.global.nc.L1::no_allocate.v4`` (or plain ``ld.global.v4``) into registers, several
           loads in flight per thread, grid-stride over the buffer.
  cpasync  16-byte ``cp.async.cg.shared.global`` into a per-thread ring of shared-memory stages (what our
           decode kernels' K/V loads do), each 16 B read back once from shared memory.
  tma      ``cp.async.bulk`` (1D bulk copy, mbarrier completion) of 16-64 KB per copy into a ring of stages,
           one thread issuing, the whole CTA waiting on the stage's mbarrier and reading it back.

Every kernel sums all int32 words it loaded (wrapping add) and writes one int32 per thread; the host checks the
total against torch's sum of the buffer, so a dropped or short load cannot look fast. Bandwidth is bytes of
the buffer read / time (1 GB = 1e9 B), beside the same run's torch baselines: ``dst.copy_(src)`` of 1 GiB
counted as 2 * bytes / time (as ``mla bench`` counts it) and a bf16 ``sum`` of the buffer.

Standalone: imports torch and cutlass.cute only (never mlacore). ``--compile-only`` builds every kernel for
CUTE_DSL_ARCH (sm_90a) with fake tensors, no GPU needed.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass import Int32  # noqa: E402
from cutlass.cute.nvgpu import cpasync  # noqa: E402

try:  # 4.8 moved it; the old name warns
    from cutlass.memory import SmemAllocator  # noqa: E402
except ImportError:  # pragma: no cover
    from cutlass.utils import SmemAllocator  # noqa: E402

DEFAULT_BYTES = 64 * 8192 * 576 * 2  # the B=64 S=8192 bf16 KV cache: 603,979,776 B (576 MiB)
COMPILE_OPTIONS = "--enable-tvm-ffi"
H200_SMS = 132  # the SM count used for --compile-only (no GPU to ask)


# ---------------------------------------------------------------------------------------------- kernels
class LdgRead:
    """Registers: each thread loads `unroll` 16-byte vectors of a chunk (threads * unroll * 16 B, coalesced:
    vector j of thread t is at (j * threads + t) * 16 B), then adds them into its accumulator; CTAs stride over
    chunks. All `unroll` loads of a chunk are issued before the first add, so unroll * 16 B are in flight per
    thread. mode: "nc" = ``ld.global.nc.v4`` (read-only/texture path; the DSL refuses to combine it with an L1
    hint), "na" = ``ld.global.L1::no_allocate.v4``, "plain" = ``ld.global.v4``."""

    kind = "ldg"

    def __init__(self, threads: int, unroll: int, ctas: int, mode: str = "nc"):
        assert mode in ("nc", "na", "plain")
        self.threads, self.unroll, self.ctas, self.mode = threads, unroll, ctas, mode
        self.chunk_bytes = threads * unroll * 16

    def inflight_per_cta(self) -> int:
        return self.chunk_bytes

    def label(self) -> str:
        return f"ldg.{self.mode} t{self.threads} u{self.unroll}"

    @cute.jit
    def __call__(self, buf: cute.Tensor, out: cute.Tensor, stream):
        self.kernel(buf, out).launch(grid=[self.ctas, 1, 1], block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, buf: cute.Tensor, out: cute.Tensor):
        T, U = self.threads, self.unroll
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        if cutlass.const_expr(self.mode == "nc"):
            atom = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), Int32, num_bits_per_copy=128, invariant=True)
        elif cutlass.const_expr(self.mode == "na"):
            atom = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), Int32, num_bits_per_copy=128,
                                       l1c_evict_priority=cute.nvgpu.CacheEvictionPriority.NO_ALLOCATE)
        else:
            atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Int32, num_bits_per_copy=128)
        frag = cute.make_rmem_tensor((4, U), Int32)
        vec_layout = cute.make_layout((4, T, U), stride=(1, 4, 4 * T))
        acc = Int32(0)
        for c in range(bidx, buf.shape[0], self.ctas):
            g = cute.make_tensor(buf[c, None].iterator, vec_layout)
            for j in cutlass.range_constexpr(U):
                cute.copy(atom, g[None, tidx, j], frag[None, j])
            for j in cutlass.range_constexpr(U):
                for i in cutlass.range_constexpr(4):
                    acc = acc + frag[i, j]
        out[bidx * T + tidx] = acc


class CpAsyncRead:
    """Shared memory through cp.async: each thread copies `unroll` 16-byte vectors per stage (same coalesced
    pattern as LdgRead) into its own slots of a `stages`-deep ring, keeps stages - 1 commit groups in flight,
    and after ``cp.async.wait_group`` reads its own 16 B back (ld.shared.v4) and adds them. A thread only reads
    what it copied itself, so no CTA barrier is needed: the loop is loads and waits only."""

    kind = "cpasync"

    def __init__(self, threads: int, unroll: int, stages: int, ctas: int):
        self.threads, self.unroll, self.stages, self.ctas = threads, unroll, stages, ctas
        self.chunk_bytes = threads * unroll * 16

    def smem_bytes(self) -> int:
        return self.chunk_bytes * self.stages

    def inflight_per_cta(self) -> int:
        return self.chunk_bytes * (self.stages - 1)

    def label(self) -> str:
        return f"cp.async t{self.threads} u{self.unroll} st{self.stages}"

    @cute.jit
    def __call__(self, buf: cute.Tensor, out: cute.Tensor, stream):
        self.kernel(buf, out).launch(grid=[self.ctas, 1, 1], block=[self.threads, 1, 1], stream=stream)

    @cute.jit
    def issue(self, buf, s_ring, atom, tidx, chunk, slot):
        T = self.threads
        g = cute.make_tensor(buf[chunk, None].iterator, cute.make_layout((4, T, self.unroll), stride=(1, 4, 4 * T)))
        for j in cutlass.range_constexpr(self.unroll):
            cute.copy(atom, g[None, tidx, j], s_ring[None, tidx, j, slot])

    @cute.kernel
    def kernel(self, buf: cute.Tensor, out: cute.Tensor):
        T, U, S = self.threads, self.unroll, self.stages
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        smem = SmemAllocator()
        s_ring = smem.allocate_tensor(Int32, cute.make_layout((4, T, U, S), stride=(1, 4, 4 * T, 4 * T * U)), 128)
        g2s = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), Int32,
                                  num_bits_per_copy=128)
        s2r = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Int32, num_bits_per_copy=128)
        frag = cute.make_rmem_tensor((4, U), Int32)
        n_iter = (buf.shape[0] - bidx + self.ctas - 1) // self.ctas  # chunks bidx, bidx + ctas, ...
        for s in cutlass.range_constexpr(S - 1):
            if s < n_iter:
                self.issue(buf, s_ring, g2s, tidx, bidx + s * self.ctas, s)
            cute.arch.cp_async_commit_group()
        acc = Int32(0)
        for k in range(n_iter):
            nxt = k + S - 1
            if nxt < n_iter:
                self.issue(buf, s_ring, g2s, tidx, bidx + nxt * self.ctas, nxt % S)
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(S - 1)
            slot = k % S
            for j in cutlass.range_constexpr(U):
                cute.copy(s2r, s_ring[None, tidx, j, slot], frag[None, j])
            for j in cutlass.range_constexpr(U):
                for i in cutlass.range_constexpr(4):
                    acc = acc + frag[i, j]
        cute.arch.cp_async_wait_group(0)
        out[bidx * T + tidx] = acc


class TmaBulkRead:
    """TMA bulk copies: thread 0 issues one 1D ``cp.async.bulk`` of `stage_bytes` per stage (mbarrier
    complete_tx), up to `stages` in flight; every thread waits on the stage's mbarrier, reads its share back
    (16 B at a time) and adds it; after a CTA barrier thread 0 refills the slot with the chunk `stages` ahead.
    That is a TMA producer feeding consumers, with the producer's refill behind the consumers' reads."""

    kind = "tma"

    def __init__(self, stage_bytes: int, stages: int, ctas: int, threads: int = 128):
        assert stage_bytes % (threads * 16) == 0
        self.stage_bytes, self.stages, self.ctas, self.threads = stage_bytes, stages, ctas, threads
        self.chunk_bytes = stage_bytes

    def smem_bytes(self) -> int:
        return self.stage_bytes * self.stages + 8 * self.stages

    def inflight_per_cta(self) -> int:
        return self.stage_bytes * self.stages

    def label(self) -> str:
        return f"tma.bulk {self.stage_bytes // 1024}K st{self.stages}"

    @cute.jit
    def __call__(self, buf: cute.Tensor, out: cute.Tensor, stream):
        self.kernel(buf, out).launch(grid=[self.ctas, 1, 1], block=[self.threads, 1, 1], stream=stream)

    @cute.jit
    def issue(self, buf, s_ring, mbar, atom, chunk, slot):
        cute.arch.mbarrier_arrive_and_expect_tx(mbar + slot, self.stage_bytes)
        cute.copy(atom, buf[chunk, None], s_ring[None, slot], mbar_ptr=mbar + slot)

    @cute.kernel
    def kernel(self, buf: cute.Tensor, out: cute.Tensor):
        T, S, W = self.threads, self.stages, self.stage_bytes // 4
        V = W // (4 * T)  # 16-byte vectors per thread per stage
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        smem = SmemAllocator()
        s_ring = smem.allocate_tensor(Int32, cute.make_layout((W, S), stride=(1, W)), 128)
        mbar = smem.allocate_array(cutlass.Int64, S)
        bulk = cute.make_copy_atom(cpasync.CopyBulkG2SOp(), Int32, num_bits_per_copy=self.stage_bytes * 8)
        s2r = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Int32, num_bits_per_copy=128)
        frag = cute.make_rmem_tensor((4, V), Int32)
        n_iter = (buf.shape[0] - bidx + self.ctas - 1) // self.ctas
        if tidx == 0:
            for s in cutlass.range_constexpr(S):
                cute.arch.mbarrier_init(mbar + s, 1)
            cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()
        if tidx == 0:
            for s in cutlass.range_constexpr(S):
                if s < n_iter:
                    self.issue(buf, s_ring, mbar, bulk, bidx + s * self.ctas, s)
        acc = Int32(0)
        for k in range(n_iter):
            slot = k % S
            cute.arch.mbarrier_wait(mbar + slot, (k // S) % 2)
            mine = cute.make_tensor((s_ring[None, slot]).iterator, cute.make_layout((4, T, V), stride=(1, 4, 4 * T)))
            for j in cutlass.range_constexpr(V):
                cute.copy(s2r, mine[None, tidx, j], frag[None, j])
            for j in cutlass.range_constexpr(V):
                for i in cutlass.range_constexpr(4):
                    acc = acc + frag[i, j]
            cute.arch.sync_threads()  # every thread has read the slot: it may be refilled
            if tidx == 0:
                if k + S < n_iter:
                    self.issue(buf, s_ring, mbar, bulk, bidx + (k + S) * self.ctas, slot)
        out[bidx * T + tidx] = acc


# ---------------------------------------------------------------------------------------------- configs
def configs(sweep: bool, sms: int):
    """(kernel object, CTAs per SM) per config. Without --sweep one guess per kernel; with it a small grid over
    threads / unroll / stages / occupancy (about 30 configs; each compiles in seconds)."""
    out = []
    if not sweep:
        return [LdgRead(256, 8, 8 * sms), CpAsyncRead(256, 4, 4, 3 * sms), TmaBulkRead(32768, 4, 1 * sms)]
    for threads, cps in ((256, 8), (512, 4), (1024, 2), (256, 4)):
        for unroll in (4, 8, 16):
            out.append(LdgRead(threads, unroll, cps * sms))
    for mode in ("na", "plain"):
        out += [LdgRead(256, 8, 8 * sms, mode), LdgRead(512, 8, 4 * sms, mode)]
    for threads, unroll, stages, cps in ((256, 2, 4, 6), (256, 4, 3, 4), (256, 4, 4, 3), (256, 4, 6, 2),
                                         (512, 2, 4, 3), (128, 8, 4, 3), (256, 8, 3, 2)):
        out.append(CpAsyncRead(threads, unroll, stages, cps * sms))
    for stage_kb, stages, cps in ((16, 4, 2), (16, 6, 2), (32, 3, 2), (32, 4, 1), (32, 6, 1), (64, 2, 1),
                                  (64, 3, 1), (16, 8, 1), (8, 8, 2), (48, 4, 1)):
        out.append(TmaBulkRead(stage_kb * 1024, stages, cps * sms))
    return out


def fake_args(k):
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    w = k.chunk_bytes // 4
    return (make_fake_compact_tensor(Int32, (cute.sym_int(), w), stride_order=(1, 0), assumed_align=128),
            make_fake_compact_tensor(Int32, (cute.sym_int(),), assumed_align=16),
            make_fake_stream())


def compile_kernel(k, dump_dir: str | None = None):
    """cute.compile with fake tensors (works without a GPU); dump_dir keeps the PTX there (tests)."""
    opts = COMPILE_OPTIONS + (f" --keep-ptx --dump-dir={dump_dir}" if dump_dir else "")
    return cute.compile(k, *fake_args(k), options=opts)


# ---------------------------------------------------------------------------------------------- timing
def time_ms(fn, reps: int, warmup: int, flush: torch.Tensor | None, graph: int):
    """Median ms of one call: CUDA events around each call (a 256 MB scratch READ before each one, outside the
    events, so the previous pass's tail is not read from L2; a read, because a write would leave dirty lines whose
    write-back would land inside the timed read), or with graph > 0 the median over reps of a
    CUDA graph of `graph` back-to-back calls, divided by `graph`."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    if graph:
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
            with torch.cuda.graph(g, stream=s):
                for _ in range(graph):
                    fn()
        torch.cuda.synchronize()
        g.replay()
        run, per = g.replay, graph
    else:
        run, per = fn, 1
    times = []
    for _ in range(reps):
        if flush is not None and not graph:
            flush.sum()  # also keeps the GPU busy while the host enqueues: no launch gap inside the events
        else:
            torch.cuda._sleep(100_000)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / per)
    return statistics.median(times)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, help="buffer size in MiB (default 576 MiB = 604 MB, the B64 S8192 cache)")
    p.add_argument("--sweep", action="store_true", help="time a grid of configs per kernel")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--graph", type=int, default=0, help="time CUDA graphs of N back-to-back launches")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--compile-only", action="store_true", help="compile every kernel for sm_90a and exit")
    a = p.parse_args(argv)
    nbytes = a.mib * 2**20 if a.mib else DEFAULT_BYTES
    gpu = not a.compile_only
    if gpu and not torch.cuda.is_available():
        sys.exit("no CUDA device: use --compile-only")
    sms = torch.cuda.get_device_properties(0).multi_processor_count if gpu else H200_SMS
    cfgs = configs(a.sweep, sms)

    if a.compile_only:
        for k in cfgs:
            compile_kernel(k)
            print(f"compiled {k.label():28s} ctas={k.ctas}")
        return 0

    dev = torch.device("cuda")
    buf = torch.randint(-2**31, 2**31 - 1, (nbytes // 4,), dtype=torch.int32, device=dev)
    want = int(buf.sum(dtype=torch.int64).item()) & 0xFFFFFFFF
    flush = torch.ones(64 * 2**20, dtype=torch.float32, device=dev)  # 256 MB > the 50 MB L2
    rows = []

    def row(name, ms, nbytes_counted, ok=True, **extra):
        r = dict(name=name, us=ms * 1e3, gbps=nbytes_counted / (ms * 1e-3) / 1e9, ok=ok, **extra)
        rows.append(r)
        return r

    # torch baselines, same run
    cp_src = torch.ones(2**30, dtype=torch.uint8, device=dev)
    cp_dst = torch.empty_like(cp_src)
    # the copy ceiling is timed eagerly in both modes: under CUDA-graph capture a contiguous copy_ becomes a memcpy
    # node, which the driver runs far slower than the eager copy kernel (the twelfth session's graph run: 2767 GB/s
    # against 4289 eager), so it would not be the ceiling `mla bench` reports
    copy = row("torch copy 1GiB (r+w), eager", time_ms(lambda: cp_dst.copy_(cp_src), a.reps, a.warmup, flush, 0),
               2 * 2**30)
    bf = buf.view(torch.bfloat16)
    row("torch bf16 sum", time_ms(lambda: bf.sum(), a.reps, a.warmup, flush, a.graph), nbytes)

    import cuda.bindings.driver as cuda_drv  # tvm-ffi kernels take torch tensors and a CUstream

    def stream():  # the current one, so that a graph capture on a side stream captures the launch
        return cuda_drv.CUstream(torch.cuda.current_stream().cuda_stream)

    for k in cfgs:
        if nbytes % k.chunk_bytes:
            print(f"skip {k.label()}: {nbytes} B is not a multiple of its {k.chunk_bytes} B chunk")
            continue
        cps = k.ctas // sms
        try:
            fn = compile_kernel(k)
            view = buf.view(nbytes // k.chunk_bytes, k.chunk_bytes // 4)
            out = torch.zeros(k.ctas * k.threads, dtype=torch.int32, device=dev)
            fn(view, out, stream())
            torch.cuda.synchronize()
            got = int(out.sum(dtype=torch.int64).item()) & 0xFFFFFFFF
            ms = time_ms(lambda: fn(view, out, stream()), a.reps, a.warmup, flush, a.graph)
        except Exception as e:  # one bad config (e.g. a launch out of resources) must not end the sweep
            print(f"FAILED {k.label()} x{cps}: {type(e).__name__}: {str(e)[:300]}")
            continue
        row(k.label(), ms, nbytes, ok=got == want, kind=k.kind, ctas=k.ctas, ctas_per_sm=cps,
            threads=k.threads, inflight_per_sm=k.inflight_per_cta() * cps)

    print(f"buffer {nbytes} B ({nbytes / 1e6:.0f} MB), {sms} SMs, {torch.cuda.get_device_name()}, "
          f"median of {a.reps}{f', graphs of {a.graph}' if a.graph else ', L2 flushed before each'}")
    # %copy: bytes read per second against the copy's bytes read + written per second (mla bench's ceiling)
    print(f"{'config':30s} {'CTA/SM':>6s} {'KB fl/SM':>8s} {'us':>8s} {'GB/s':>7s} {'%copy':>6s} ok")
    for r in rows:
        fl = f"{r['inflight_per_sm'] / 1024:.0f}" if "inflight_per_sm" in r else ""
        print(f"{r['name']:30s} {r.get('ctas_per_sm', ''):>6} {fl:>8s} {r['us']:8.1f} {r['gbps']:7.0f} "
              f"{100 * r['gbps'] / copy['gbps']:5.1f}% {'ok' if r['ok'] else 'WRONG SUM'}")
    kr = [r for r in rows if "kind" in r and r["ok"]]
    if kr:
        best = max(kr, key=lambda r: r["gbps"])
        print(f"best read: {best['name']} {best['gbps']:.0f} GB/s -> {nbytes / 1e6:.0f} MB in "
              f"{nbytes / best['gbps'] / 1e3:.1f} us; "
              f">= 4150 GB/s reachable: {'YES' if best['gbps'] >= 4150 else 'NO'}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(bytes=nbytes, sms=sms, device=torch.cuda.get_device_name(), reps=a.reps,
                           graph=a.graph, rows=rows), f, indent=1)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
