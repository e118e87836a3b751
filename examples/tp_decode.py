"""Tensor-parallel MLA decode in N processes, checked against one process running every head.

Engines shard MLA attention by heads: rank r of N holds heads
[r*H/N, (r+1)*H/N) of every layer (their slices of W_q, W_UK, W_UV and the
rows of W_o), a full replica of the paged latent cache, and its own
`MLADecoder`, in its own process, from its own copy of the policy. This
example runs a DeepSeek-V3-shaped decode (random weights: 512 latent | 64
rope per cached token, 128 nope / 64 rope query dims, 128 value dims,
weights absorbed so attention runs on the latent cache) that way:

* before the first step every rank publishes a fingerprint of its backend
  choice (`mlacore.distributed.check_same_choice`); if any rank would choose
  differently, every rank stops with an error naming the ranks and the
  difference (try `--policy-for-rank 1=some.toml`);
* per layer: q = h @ W_q (own heads), the step's latents written into the
  cache, q_latent = q_nope @ W_UK, `decoder.run`, v = out @ W_UV, a partial
  o_proj summed over ranks with all_reduce (row-parallel, as engines do);
* the attention outputs of every layer and step are all-gathered and rank 0
  compares them, and the final hidden state, with one decoder running all
  H heads in one process (max abs diff printed; fp32 on CPU agrees to ~1e-6).

CPU: gloo, any small N (the reference backend). CUDA: NCCL when every rank
has its own GPU, gloo when ranks share one (NCCL refuses two ranks on one
GPU). `--cuda-graph` builds the decoders with a capture envelope and
replays one captured `torch.cuda.CUDAGraph` per layer, re-planning between
steps. NVLink multicast stays off (NCCL_NVLS_ENABLE=0).

Run:  python examples/tp_decode.py --world-size 2
      python examples/tp_decode.py --world-size 2 --device cuda --heads 128 --batch 64 --kv-len 4096 --cuda-graph
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mlacore import MLADecoder, MLAError
from mlacore.distributed import RankMismatchError, ShapeClass, check_same_choice, default_shape_classes

LATENT, ROPE, NOPE, V = 512, 64, 128, 128
SM_SCALE = 1.0 / math.sqrt(NOPE + ROPE)
# Never let NCCL or torch use NVLink multicast here: shared hosts' GPUs can be taken out of service by it.
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


# -- the model: random, DeepSeek-V3-shaped, deterministic from a seed -------------------------------


@dataclass
class Layer:
    w_q: torch.Tensor    # [hidden, H_r, 192]  (128 nope | 64 rope)
    w_dkv: torch.Tensor  # [hidden, 576]       latent | rope key (replicated on every rank)
    w_uk: torch.Tensor   # [H_r, 128, 512]     q_nope -> latent query
    w_uv: torch.Tensor   # [H_r, 128, 512]     latent output -> value head
    w_o: torch.Tensor    # [H_r, 128, hidden]  this rank's rows of o_proj


def build_layers(num_layers: int, heads: int, hidden: int, seed: int) -> List[Layer]:
    """All H heads' weights, generated on the CPU so every process builds exactly the same ones."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int, fan_in: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) / math.sqrt(fan_in)

    return [Layer(w_q=rand(hidden, heads, NOPE + ROPE, fan_in=hidden), w_dkv=rand(hidden, LATENT + ROPE, fan_in=hidden),
                  w_uk=rand(heads, NOPE, LATENT, fan_in=NOPE), w_uv=rand(heads, V, LATENT, fan_in=LATENT),
                  w_o=rand(heads, V, hidden, fan_in=heads * V))
            for _ in range(num_layers)]


def shard(layers: List[Layer], lo: int, hi: int, device: torch.device) -> List[Layer]:
    """Heads [lo, hi) of every layer (the latent projection is replicated), on `device`."""
    return [Layer(w_q=l.w_q[:, lo:hi].contiguous().to(device), w_dkv=l.w_dkv.to(device),
                  w_uk=l.w_uk[lo:hi].contiguous().to(device), w_uv=l.w_uv[lo:hi].contiguous().to(device),
                  w_o=l.w_o[lo:hi].contiguous().to(device)) for l in layers]


@dataclass
class Workload:
    """The requests of the run: initial lengths, shuffled page tables, the cache's initial contents, inputs."""

    lens0: torch.Tensor        # [B] int32, cached tokens before step 0
    table: torch.Tensor        # [B, pages_per_req] int32 page ids (shuffled)
    num_pages: int
    cache0: torch.Tensor       # [layers, num_pages, page, 576] fp32
    inputs: List[torch.Tensor]  # per step [B, s_q, hidden] fp32
    seq_len_q: int

    def lens(self, step: int) -> torch.Tensor:
        """kv lengths of `step`, counting the s_q tokens it appends."""
        return self.lens0 + (step + 1) * self.seq_len_q

    def slots(self, step: int, page: int) -> torch.Tensor:
        """Flat cache slots [B * s_q] the step's new tokens are written to."""
        pos = self.lens0[:, None].long() + step * self.seq_len_q + torch.arange(self.seq_len_q)[None, :]
        pages = torch.gather(self.table.long(), 1, pos // page)
        return (pages * page + pos % page).reshape(-1)


def build_workload(args: argparse.Namespace) -> Workload:
    g = torch.Generator().manual_seed(args.seed + 1)
    B, s_q, page = args.batch, args.seq_len_q, args.page_size
    low = max(1, args.kv_len // 2)
    lens0 = torch.randint(low, args.kv_len + 1, (B,), generator=g, dtype=torch.int32)
    lens0[0] = args.kv_len  # the longest request is exactly --kv-len
    final = args.kv_len + args.steps * s_q
    per_req = -(-final // page)
    num_pages = B * per_req + 3  # a few pages nobody owns
    table = torch.randperm(num_pages, generator=g)[:B * per_req].reshape(B, per_req).to(torch.int32)
    cache0 = torch.randn(args.layers, num_pages, page, LATENT + ROPE, generator=g)
    inputs = [torch.randn(B, s_q, args.hidden, generator=g) for _ in range(args.steps)]
    return Workload(lens0, table, num_pages, cache0, inputs, s_q)


# -- one rank's (or the whole model's) decode ---------------------------------------------------------


class Attention:
    """A decoder plus the per-layer way to run it: eagerly, or by replaying a graph captured per layer."""

    def __init__(self, decoder: MLADecoder, layers: int, batch: int, s_q: int, heads: int, cuda_graph: bool):
        self.decoder = decoder
        self.graphs: Optional[List[torch.cuda.CUDAGraph]] = None
        self.cuda_graph = cuda_graph
        dev, dt = decoder.device, decoder.q_dtype
        if cuda_graph:  # buffers the graphs read and write, fixed for their life
            self.q = [torch.zeros(batch, s_q, heads, LATENT + ROPE, dtype=dt, device=dev) for _ in range(layers)]
            self.out = [torch.zeros(batch, s_q, heads, LATENT, dtype=dt, device=dev) for _ in range(layers)]
            self.lse = [torch.zeros(batch, s_q, heads, dtype=torch.float32, device=dev) for _ in range(layers)]

    def plan(self, lens: torch.Tensor, table: torch.Tensor, s_q: int, caches: List[torch.Tensor]):
        dev = self.decoder.device
        plan = self.decoder.plan(lens.to(dev), table.to(dev), s_q, kv_lens_host=lens, page_table_host=table)
        if self.cuda_graph and self.graphs is None:
            self._capture(plan, caches)
        return plan

    def _capture(self, plan, caches: List[torch.Tensor]) -> None:
        self.graphs = []
        for li, cache in enumerate(caches):
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # warm-up outside the capture (JIT, workspace first touch)
                self.decoder.run(self.q[li], cache, plan, out=self.out[li], lse=self.lse[li])
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            # thread_local: NCCL's watchdog thread may query events while this thread captures
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                self.decoder.run(self.q[li], cache, plan, out=self.out[li], lse=self.lse[li])
            self.graphs.append(graph)

    def run(self, li: int, q: torch.Tensor, cache: torch.Tensor, plan) -> torch.Tensor:
        if self.graphs is None:
            return self.decoder.run(q, cache, plan)[0]
        self.q[li].copy_(q)
        self.graphs[li].replay()
        return self.out[li].clone()


def decode(layers: List[Layer], work: Workload, attn: Attention, caches: List[torch.Tensor],
           all_reduce: Callable[[torch.Tensor], torch.Tensor],
           on_step: Optional[Callable[[int, object], None]] = None) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    """Every step over every layer; returns the last step's hidden state and each (step, layer)'s attention output."""
    dev = attn.decoder.device
    dt = attn.decoder.q_dtype
    page = attn.decoder.page_size
    outs: List[torch.Tensor] = []
    h = None
    for step, x in enumerate(work.inputs):
        B, s_q, _ = x.shape
        plan = attn.plan(work.lens(step), work.table, s_q, caches)  # once per step, shared by the layers
        if on_step is not None:
            on_step(step, plan)
        slots = work.slots(step, page).to(dev)
        h = x.to(dev)
        for li, (w, cache) in enumerate(zip(layers, caches)):
            q = torch.einsum("bsk,khd->bshd", h, w.w_q)
            q_nope, q_rope = q.split([NOPE, ROPE], dim=-1)
            ckv = h @ w.w_dkv
            latent, k_rope = ckv.split([LATENT, ROPE], dim=-1)
            latent = torch.nn.functional.layer_norm(latent, (LATENT,))  # kv_a_layernorm, unit weights
            cache.view(-1, LATENT + ROPE)[slots] = torch.cat([latent, k_rope], -1).reshape(-1, LATENT + ROPE).to(dt)
            q_mla = torch.cat([torch.einsum("bshd,hdc->bshc", q_nope, w.w_uk), q_rope], -1).to(dt).contiguous()
            out = attn.run(li, q_mla, cache, plan)
            outs.append(out)
            v = torch.einsum("bshc,hdc->bshd", out.float(), w.w_uv)
            h = h + all_reduce(torch.einsum("bshd,hdk->bsk", v, w.w_o))
    return h, outs


# -- the processes ----------------------------------------------------------------------------------


class Say:
    """Lines prefixed with the rank, to stdout (or stderr) and appended to --log."""

    def __init__(self, rank: int, world: int, log: Optional[str]):
        self.prefix, self.log = f"[rank {rank}/{world}]", log

    def __call__(self, text: str, err: bool = False) -> None:
        lines = "".join(f"{self.prefix} {line}\n" for line in text.splitlines())
        stream = sys.stderr if err else sys.stdout
        stream.write(lines)
        stream.flush()
        if self.log:
            with open(self.log, "a") as f:
                f.write(lines)


def rank_device(args: argparse.Namespace, rank: int) -> torch.device:
    if args.device == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", rank % torch.cuda.device_count())


def policy_for(args: argparse.Namespace, rank: int) -> Optional[str]:
    return dict(args.policy_for_rank).get(rank)


def make_decoder(args: argparse.Namespace, heads: int, device: torch.device, policy: Optional[str]) -> MLADecoder:
    dt = torch.float32 if device.type == "cpu" else torch.bfloat16
    graph = dict(cuda_graph=True, max_batch=args.batch, max_kv_len=args.kv_len + args.steps * args.seq_len_q) \
        if args.cuda_graph else {}
    return MLADecoder(heads, args.page_size, q_dtype=dt, kv_dtype=dt, device=device, sm_scale=SM_SCALE,
                      policy=policy, **graph)


def worker(rank: int, args: argparse.Namespace, port: int, results) -> None:
    world = args.world_size
    say = Say(rank, world, args.log)
    torch.set_num_threads(args.threads)
    device = rank_device(args, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(args.dist_backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=args.timeout))
    try:
        status, text = run_rank(rank, args, device, say)
        # short: the launcher reads the queue only after every rank has exited, and a pipe holds ~64 KiB
        results.put((rank, status, text[:500]))
    finally:
        dist.destroy_process_group()


def run_rank(rank: int, args: argparse.Namespace, device: torch.device, say: Say) -> Tuple[str, str]:
    world, H = args.world_size, args.heads
    per = H // world
    lo, hi = rank * per, (rank + 1) * per
    policy = policy_for(args, rank)
    work = build_workload(args)
    decoder = make_decoder(args, per, device, policy)
    max_kv = args.kv_len + args.steps * args.seq_len_q
    step_class = ShapeClass(args.batch, args.seq_len_q, max_kv, int(work.lens(0).min()))
    # before the first step: the same choice on every rank, or a clear error on every rank
    try:
        fp = check_same_choice(decoder, default_shape_classes(decoder) + [step_class])
    except RankMismatchError as err:
        say(f"ERROR: {err}", err=True)
        return "mismatch", str(err)
    except MLAError as err:
        say(f"ERROR: {type(err).__name__}: {err}", err=True)
        return "error", str(err)
    mine = fp["choices"][step_class.label]
    say(f"heads [{lo}, {hi}) on {device} ({dist.get_backend()}); policy {fp['info']['policy_source']}; "
        f"choice fingerprint {fp['digest']} agreed by all {world} ranks over {len(fp['choices'])} shape classes; "
        f"this step ({step_class.label}) runs on {mine['backend']} {mine['options']}")

    collective_cpu = dist.get_backend() == "gloo" and device.type == "cuda"

    def all_reduce(t: torch.Tensor) -> torch.Tensor:
        buf = t.cpu() if collective_cpu else t.contiguous()
        dist.all_reduce(buf)
        return buf.to(device)

    def gather(t: torch.Tensor) -> List[torch.Tensor]:
        buf = t.cpu() if collective_cpu else t.contiguous()
        parts = [torch.empty_like(buf) for _ in range(world)]
        dist.all_gather(parts, buf)
        return parts

    layers = shard(build_layers(args.layers, H, args.hidden, args.seed), lo, hi, device)
    caches = [c.to(device=device, dtype=decoder.kv_dtype).contiguous() for c in work.cache0]
    attn = Attention(decoder, args.layers, args.batch, args.seq_len_q, per, args.cuda_graph)
    backends: List[str] = []
    t0 = time.perf_counter()
    h, outs = decode(layers, work, attn, caches, all_reduce, lambda step, plan: backends.append(plan.backend))
    if device.type == "cuda":
        torch.cuda.synchronize()
    took = time.perf_counter() - t0
    say(f"ran {args.steps} steps x {args.layers} layers on {sorted(set(backends))}"
        f"{' (CUDA graph replay per layer)' if args.cuda_graph else ''} in {took * 1e3:.1f} ms")
    gathered = [torch.cat(gather(o), dim=2) for o in outs]  # [B, s_q, H, 512] per (step, layer)
    verdict = ("ok", "")
    if rank == 0:
        verdict = compare_with_one_process(args, work, gathered, h, device, policy, say)
    decoder.close()
    return verdict


def compare_with_one_process(args: argparse.Namespace, work: Workload, gathered: List[torch.Tensor],
                             h_tp: torch.Tensor, device: torch.device, policy: Optional[str],
                             say: Say) -> Tuple[str, str]:
    """Rank 0 runs all H heads through one decoder (eager) and compares."""
    layers = shard(build_layers(args.layers, args.heads, args.hidden, args.seed), 0, args.heads, device)
    full = make_decoder(argparse.Namespace(**{**vars(args), "cuda_graph": False}), args.heads, device, policy)
    caches = [c.to(device=device, dtype=full.kv_dtype).contiguous() for c in work.cache0]
    h_full, outs = decode(layers, work, Attention(full, args.layers, args.batch, args.seq_len_q, args.heads, False),
                          caches, lambda t: t)
    full.close()
    attn_diff = max(float((a.float().cpu() - b.float().cpu()).abs().max()) for a, b in zip(gathered, outs))
    attn_scale = max(float(b.float().abs().max()) for b in outs)
    h_diff = float((h_tp.float().cpu() - h_full.float().cpu()).abs().max())
    h_scale = float(h_full.float().abs().max())
    # fp32 on CPU: rounding only (the all_reduce sums in another order); bf16 on GPU: a few bf16 ulps
    tol = 1e-5 if full.q_dtype == torch.float32 else 2e-2
    ok = attn_diff <= tol * attn_scale and h_diff <= tol * h_scale
    line = (f"{args.world_size} ranks x {args.heads // args.world_size} heads vs 1 process x {args.heads} heads, "
            f"{args.steps} steps x {args.layers} layers: attention out max abs diff {attn_diff:.3e} "
            f"(max |out| {attn_scale:.2f}); final hidden max abs diff {h_diff:.3e} (max |h| {h_scale:.2f}); "
            f"tolerance {tol:g} x max -> {'OK' if ok else 'MISMATCH'}")
    say(line, err=not ok)
    return ("ok" if ok else "numerics", line)


# -- the launcher -----------------------------------------------------------------------------------


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-size", type=int, default=2, help="tensor-parallel ranks (processes)")
    ap.add_argument("--heads", type=int, default=16, help="total query heads H (DeepSeek-V3: 128)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--kv-len", type=int, default=300, help="the longest request's cached tokens at step 0")
    ap.add_argument("--seq-len-q", type=int, default=1, help="tokens per request per step (MTP: 2)")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--dist-backend", choices=("auto", "gloo", "nccl"), default="auto",
                    help="auto: nccl when every rank has its own GPU, else gloo")
    ap.add_argument("--cuda-graph", action="store_true",
                    help="decoders with a capture envelope; one CUDA graph per layer, replayed every step")
    ap.add_argument("--policy-for-rank", action="append", default=[], metavar="R=PATH",
                    help="rank R builds its decoder from this policy file (to see a mismatch stop the run)")
    ap.add_argument("--log", help="append every rank's lines to this file (truncated first)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--timeout", type=int, default=120, help="seconds a collective may wait")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    pairs = []
    for item in args.policy_for_rank:
        rank, sep, path = item.partition("=")
        if not sep or not rank.strip().isdigit() or not path:
            ap.error(f"--policy-for-rank: expected R=PATH, got {item!r}")
        if int(rank) >= args.world_size:
            ap.error(f"--policy-for-rank {item}: rank {rank} does not exist (--world-size {args.world_size})")
        if not os.path.isfile(path):
            ap.error(f"--policy-for-rank {item}: no such file {path!r}")
        pairs.append((int(rank), os.path.abspath(path)))
    args.policy_for_rank = pairs
    for name in ("world_size", "heads", "batch", "kv_len", "seq_len_q", "steps", "layers", "hidden", "page_size",
                 "threads"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}: expected an int >= 1, got {getattr(args, name)}")
    if args.heads % args.world_size:
        ap.error(f"--heads {args.heads} is not divisible by --world-size {args.world_size}")
    if args.device == "cuda":
        if not torch.cuda.is_available():
            ap.error(f"--device cuda: torch {torch.__version__} sees no CUDA device")
        gpus = torch.cuda.device_count()
        shared = gpus < args.world_size
        if args.dist_backend == "auto":
            args.dist_backend = "gloo" if shared else "nccl"
        elif args.dist_backend == "nccl" and shared:
            ap.error(f"--dist-backend nccl: {args.world_size} ranks on {gpus} GPU(s) would share a GPU, which "
                     "NCCL refuses; use gloo (the default then)")
    else:
        if args.cuda_graph:
            ap.error("--cuda-graph needs --device cuda")
        if args.dist_backend == "nccl":
            ap.error("--dist-backend nccl needs --device cuda")
        args.dist_backend = "gloo"
    return args


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    os.environ.update(NO_MULTICAST)  # inherited by every rank
    if args.log:
        open(args.log, "w").close()
    say = Say(-1, args.world_size, args.log)
    say.prefix = "[launcher]"
    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    say(f"{args.world_size} ranks ({args.dist_backend}, {args.device}"
        f"{f', {gpus} GPU(s)' if gpus else ''}), H={args.heads}, B={args.batch}, kv_len<={args.kv_len}, "
        f"s_q={args.seq_len_q}, page {args.page_size}, {args.layers} layers, {args.steps} steps"
        f"{', cuda_graph' if args.cuda_graph else ''}; torch {torch.__version__}")
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    t0 = time.perf_counter()
    try:
        mp.spawn(worker, args=(args, free_port(), results), nprocs=args.world_size, join=True)
    except Exception as exc:  # a rank raised something unexpected; spawn has stopped the others
        say(f"FAILED: a rank raised {type(exc).__name__}: {exc}", err=True)
        return 1
    got: Dict[int, Tuple[str, str]] = {}
    while not results.empty():
        rank, status, text = results.get()
        got[rank] = (status, text)
    bad = {r: s for r, (s, _) in sorted(got.items()) if s != "ok"}
    missing = [r for r in range(args.world_size) if r not in got]
    took = time.perf_counter() - t0
    if bad or missing:
        say(f"FAILED in {took:.1f} s: " + ", ".join(f"rank {r}: {s}" for r, s in bad.items())
            + (f"; no result from ranks {missing}" if missing else ""), err=True)
        return 1
    say(f"OK in {took:.1f} s")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # pragma: no cover
        traceback.print_exc()
        sys.exit(130)
