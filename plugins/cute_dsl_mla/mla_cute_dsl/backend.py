"""The `cute_dsl_mla` backend: our own SM90 CuTe DSL kernels behind the mlacore contract.

On SM100/SM103/SM107 the same backend runs FlashInfer's `cute-dsl-monolithic`
MLA decode instead (`sm100.py`: not verified on hardware); everything below
about schedules and workspaces is the SM90 path, unchanged.

The kernels (`mla_cute_dsl.kernels`) never import mlacore; this adapter does
the rest: availability (no cutlass import, no compile), the shapes the
kernels take as reasons, and a session per decoder that owns the split-KV
schedule buffers, the partial-result workspace and, in CUDA-graph mode, the
length and page-table buffers the captured kernels read.

plan (once per step, host): the split-KV schedule over all SMs, written into
the session's fixed device buffers. run (per layer): the partial kernel and
the combine kernel; no host work.

Option split_kv="balanced" (the default since 0.2.3; the mma.sync kernel or, with
mma=wgmma_t, the transposed WGMMA kernel, bf16/fp16 cache only; see balanced_split): the
balanced split-KV kernel, whose schedule plan picks per step (the hybrid, kernels/schedule.py
choose_form) into the same buffers, so graphs captured at one step replay at any later one.
Option seesaw_split="balanced" (the default since 0.2.13; GPU-verified on an H200 in the seventeenth session)
does the same for the seesaw kernel (>= 33 rows under mma=auto, bf16/fp16 cache): make_schedule(...,
balanced=True) at plan, mla_decode_sm90_wgmma_seesaw_balanced (api.launch_balanced) at run; split_kv does not
reach it; seesaw_split="even" keeps the one-CTA-per-item kernel of 0.2.12.

mma=auto gives the balanced seesaw from 17 packed rows (0.2.23; at 17-32 rows only with seesaw_split=balanced
and ctas_per_sm auto/1: seesaw_few_rows_auto). With seesaw_split=even and a bf16/fp16 cache at 17-32 packed
rows, split_kv=balanced and ctas_per_sm auto/1, it picks per
plan, from the step's host lengths: the transposed WGMMA kernel's balanced mode when the step has at least
WGMMA_T_AUTO_MIN_BLOCKS (640) KV blocks (step_kv_blocks: the sum over requests of ceil(kv_len / 64)), the
mma.sync balanced kernel below (partial_kernel_for). Graph safety: the two kernels read exactly the same
things from plan (one make_schedule(..., balanced=True, ctas_per_sm=1) schedule per s_q: block_m_for(rows),
the same columns, work_info / split_info / cta_ranges in the same format, wide_combine by batch and rows; the
same alloc_workspace partial buffers; the same lse scratch per (batch, s_q); the same launch_balanced
arguments, grid (ceil(rows / block_m), num_cols) and combine kernel), and plan writes the same buffers
whichever it picks. So a CUDA graph captured after one plan replays its captured kernel (the capture-time
plan's choice, not necessarily the newest plan's) correctly after any later plan of its batch size.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Literal, Optional, Sequence, Tuple, Union

from pydantic import Field, field_validator

if TYPE_CHECKING:  # torch is imported where it is used: listing backends and checking a policy stay light
    import torch

from mlacore import (
    Availability,
    Backend,
    BackendInfo,
    BackendOptions,
    Limits,
    Planned,
    Session,
    SessionConfig,
    StepInputs,
    hookimpl,
)
from mlacore.probe import checked_range, library_and_cuda, library_installed
from mlacore.problem import DecodeProblem, DecodeShape, DeviceSpec

from . import sm100

log = logging.getLogger(__name__)

CUTLASS_DIST = "nvidia-cutlass-dsl"
FLASHINFER_DIST = "flashinfer-python"
# the FlashInfer releases the SM100 path's arguments and checks were read from
FLASHINFER_RANGE = ("0.7.2", "0.7.3")
BLOCK_N = 64
# the fp8-register kernel (sm90_decode_fp8) takes an fp8 cache with at most this many packed rows
# (BLOCK_M 16 / 32); measured 1.4-1.5x faster than mma.sync at 16 and 32 rows with two CTAs per SM
# (docs/results/h200_fp8_h16_speed.txt)
FP8REG_MAX_ROWS = 32
# auto picks the seesaw WGMMA kernel (balanced with a 16-bit cache) from this many packed rows (s_q*num_heads),
# right above the mma.sync / wgmma_t / fp8reg kernels' 32, for every cache dtype (mla-cute-dsl 0.2.17; it was 128
# with a 16-bit cache, 33 with fp8 since 0.2.16). Measured on an H200 through `mla bench` (default / mma=seesaw /
# fa3 interleaved, page 64, S 1024 and 4096, batch 1-128):
# * bf16 at 48 rows (H=16 s_q=3, docs/results/gpu22_session/bf16_48_64rows_bench.txt), against the mma.sync kernel
#   (its 64-row tiles keep 23-29 LDL/STL): 0.54-0.74x its time at every cell (B=128 S=4096 156.3 against 287.4 us,
#   fa3 150.4; B=1 S=1024 10.7 against 14.5);
# * bf16 at 64 rows (H=16 s_q=4 and H=64 s_q=1, bf16_h64_bench.txt), against the one-S WGMMA kernel (even split):
#   0.86-0.87x at B=128 S=4096 (H=64: 163.0 against 189.3 us, fa3 154.1), 0.93x at B=64 S=4096, 0.97x at B=128
#   S=1024, 1.00-1.02x at B=16 and B=64 S=1024, 1.05x at B=1 S=1024 (10.8 against 10.3 us): a few tenths of a
#   microsecond lost on the smallest steps against 7-26 us won on the large ones;
# * fp8 (0.2.16, after the fp8 seesaw's WGMMAs stopped being serialized, NOTES.md twenty-first session): at 64 rows
#   (gpu21_session/fp8_64rows_bench.txt) 0.79-0.92x the one-S WGMMA kernel's time from B=16 S=4096 and from B=64,
#   1.05-1.06x at B=1 and B=16 S=1024; at 48 rows (fp8_48rows_bench.txt) 0.54-0.84x the mma.sync kernel's time
#   at every cell (B=128 S=4096 166.7 against 310.5 us, fa3 463.5).
# The one-S WGMMA kernel stays available as mma=wgmma.
SEESAW_MIN_ROWS = FP8REG_MAX_ROWS + 1
# ... and from this many (17-32 rows, every cache) when its balanced split can run (seesaw_split=balanced,
# ctas_per_sm auto or 1; mla-cute-dsl 0.2.23): the 64-row tile is half to three quarters padding there, but its
# producer warpgroup (TMA for a 16-bit cache, the register ring for fp8) streams the KV. Measured on an H200 through
# `mla bench` (default / mma=seesaw,loads=tma / fa3 interleaved, page 64, reference-checked cells;
# docs/results/gpu27_session/seesaw_rows32_*, gpu28_session/seesaw_rows{17_31,32_small,32_small_mtp,24_mtp}_*):
# * bf16 at 20-32 rows (H=20/24/28/32 s_q=1, H=16 s_q=2, H=8 s_q=3; B 1-128, S 700-4096), against mma.sync /
#   wgmma_t: 0.95-0.98x their time from 2048 KV blocks (B=128 S=4096 H=24 147.9 against 151.2 us, fa3 148.2; H=16
#   s_q=2 152.5 against 156.4, fa3 153.8), 0.98-1.02x on smaller steps (worst B=4 S=4096 1.02x, +0.35 us);
# * fp8 at the same rows, against fp8reg: 0.87-0.92x at B=4 S=4096 and B=8, 0.95-0.97x at B=128, 0.99-1.02x at
#   B=32 (S=4096 1.015-1.023x, +0.7-1.0 us), 1.04-1.08x at B=1-4 S=1024 and B=1 S=4096 (+0.4-0.8 us);
# * at 16 rows (H=16 s_q=1) it loses (1.22-1.35x fp8reg's time with fp8, 0.99-1.05x with bf16): not there.
# seesaw_split=even or ctas_per_sm=2 keep 0.2.22's kernels at 17-32 rows (fp8reg, wgmma_t / mma.sync).
SEESAW_FEW_ROWS_MIN = 17
# the transposed WGMMA kernel (sm90_wgmma_t_decode: KV tokens are WGMMA's M, query rows its N) takes at most
# this many packed rows (N = 16 or 32). Its balanced mode (split_kv=balanced, 16-bit cache) walks the same
# hybrid schedule as the mma.sync balanced kernel; GPU-verified on an H200 (docs/results/gpu9_wgmma_t_balanced/).
# Measured there at 17-32 rows with a bf16 cache against the default (docs/results/gpu9_wgmma_t_auto/): the gain
# grows with the step's KV blocks (batch x length), not with batch alone: 7-10% faster at B=64-128 S=4096,
# 1-4% at B=32-128 S=1024, equal at B=16 S=4096, 4-9% slower at B=1-16 S=1024 and B=1-4 S=4096
WGMMA_T_MAX_ROWS = 32
# mma=auto picks the transposed WGMMA kernel (its balanced mode) for a bf16/fp16 cache at 17-32 packed rows
# (split_kv=balanced, ctas_per_sm auto or 1) when the step has at least this many KV blocks of 64 tokens
# (step_kv_blocks: sum over the step's requests of ceil(kv_len / 64), kv_len counting the step's new tokens;
# the blocks the split-KV schedule distributes), else the mma.sync balanced kernel; decided per plan. Measured
# on an H200 (docs/results/gpu10_session/wgmma_t_threshold_bench.{txt,json} and
# wgmma_t_threshold_varlen_bench.json; H=16 s_q=2 bf16, mla bench, CUDA-graph replay; wgmma_t's gain over
# mma_sync): the gain follows the step's blocks, not its batch. Uniform lengths, >= 768 blocks: -0.6..+14%
# (B24 S2048 +1.3, B48 S1024 +5.4, B96 S512 +8.7, B16 S4096 +0.6, B32 S2048 +1.8, B64 S1024 +0.6, B24 S4096
# +5.0, B48 S2048 -0.6, B96 S1024 +14, B32 S4096 +4.5, B64 S2048 +2.8, B48 S4096 +0.9, B64 S4096 +6.8, B96
# S4096 +5.6); 512 blocks: -0.1, -1.1, -2.2, -0.6; <= 384 blocks: -7..+1.3, mostly -4..-7. Lengths spread over
# [0.1 S, S]: ~563 blocks +1.8, +2.7; ~1126 +2.5, +3.5; ~2253 -1.9, -0.3; ~4506 +3.1. 640 lies between the
# measured 512 (a loss) and 768 (a gain). The earlier rule by batch (>= 32) lost 7% at B32 S512 and 2.2% at
# B32 S1024 and missed +5% at B24 S4096. At <= 16 rows the two are within 2%, so auto keeps mma.sync there.
WGMMA_T_AUTO_MIN_BLOCKS = 640
# option pdl=auto launches the combine kernel with programmatic dependent launch up to this many packed rows
# (s_q*H: the mma.sync, wgmma_t and fp8reg kernels). Measured on an H200 (docs/results/gpu10_pdl/, mla bench,
# pdl on vs off, one run, budget 0.05, lengths 1024/4096): H=16 s_q=1/2, 0.0-0.9 us faster at B=1-16 (up to
# 8.6%), within 1% at B=128; H=128 (the WGMMA/seesaw kernels) mixed: s_q=1 B=16 1.4-2.2 us slower at three of
# four cells (-2.5..-7%), B=1 S4096 fp8 0.9 us slower, s_q=2 0-2% faster. With lengths 8192-16384
# (docs/results/gpu11_pdl/, same method) auto lost up to 1.53x at B=1-2 (H=16 s_q=2 B=1: S=8192 1.40x bf16 / 1.14x
# fp8, S=16384 1.36x / 1.53x; s_q=1 fp8 S=16384 1.13-1.22x; s_q=1 bf16 0.97-1.03x), so pdl is off by default.
PDL_AUTO_MAX_ROWS = 32
# option loads=auto gives the even seesaw kernel (seesaw_split=even, ctas_per_sm=2) with a bf16/fp16 cache TMA KV
# loads (one elected thread per warpgroup issues a part's 64x64 boxes) from this many packed rows (s_q*num_heads),
# cp.async below (the balanced seesaw: SEESAW_BALANCED_TMA_MIN_ROWS): the row counts where it was
# measured faster (256-512 rows: H=128 s_q=2 and 4; H=64 s_q>=4 and 193-255 rows, e.g. H=126 s_q=2, not measured). Measured on an H200, H=128 S=4096 bf16: the kernels alone
# (docs/results/gpu16_session/tma_ab_run{1,2}.txt, benchmarks/wgmma_speed.py, fp32 partials, narrow stores, ways
# timed interleaved, two processes) TMA took 0.92-0.96x cp.async's time at s_q=2 (B=32/64/128) and s_q=4
# (B=16/32/64) in both runs, 0.98-1.02x at s_q=1; through the backend's defaults (h128_loads_ab.txt, mla bench,
# loads=auto against loads=cp_async and fa3, interleaved) 0.864-0.890x at s_q=2 and 4 from B=32 (ours against fa3
# 1.16-1.18x -> 1.015-1.037x), 0.953x at s_q=2 B=16 (0.989x fa3); s_q=1 (cp.async under auto) 1.000-1.005x
SEESAW_TMA_MIN_ROWS = 256
# ... and the balanced seesaw (seesaw_split=balanced, the default since 0.2.13) from this many: at every row count
# mma=auto gives it (mla-cute-dsl 0.2.14). Measured on an H200 (docs/results/gpu18_session/h128_loads.txt, mla
# bench, interleaved, H=128 s_q=1 bf16, loads=tma against 0.2.13's cp.async): 0.95-0.97x the time at B=64 and 128
# (S=4096: 148.3 against 153.2 us, 294.5 against 310.6; S=10000: 344.6 / 361.7, 701.5 / 733.4), 0.98-1.00x at
# B=12 and 16. The even seesaw kept cp.async below 256 rows: there the two measured within 2% (gpu16_session).
# Since 0.2.17 mma=auto gives the balanced seesaw from 33 rows, and TMA from there too: at 48 and 64 rows (H=16 s_q=3
# and 4, bf16, docs/results/gpu22_session/bf16_48_64rows_loads_bench.txt, mla bench, loads=tma against cp.async and
# fa3 interleaved) 0.96-0.98x cp.async's time at B=64 S=4096 and B=128 (S=4096: 152.4 against 159.0 us, 154.9
# against 158.9; fa3 150.9 / 155.4), within +-0.4 us at B=1-16 (B=16 S=1024 17.4 against 17.0)
# Since 0.2.23 the balanced seesaw runs from 17 rows under auto, with TMA loads and the TMA producer there too (the
# configuration every 17-32-row measurement above ran)
SEESAW_BALANCED_TMA_MIN_ROWS = SEESAW_FEW_ROWS_MIN

PartialKernel = Literal["wgmma", "seesaw", "mma_sync", "fp8reg", "wgmma_t"]
SplitKV = Literal["even", "balanced"]
SeesawSplit = Literal["even", "balanced"]


# option q_prefetch unset: on up to this many packed rows (H=128 s_q=1 on an H200: 0.96-0.99x the time), off above
# (H=128 s_q=2 S=4096: 1.03x through mla bench; docs/results/gpu23_session/)
QPF_AUTO_MAX_ROWS = 128
# option wg1_other_first unset: on with a bf16/fp16 cache from this many packed rows (H=128 s_q=2 through mla bench
# on an H200: 0.957-0.972x the time at S=4096, 0.99-1.006x at S=1200; at 128 rows, H=128 s_q=1, 1.015-1.026x:
# docs/results/gpu26_session/wg1of_backend_bench.txt; at 256-512 rows, H=64 s_q=4 and H=128 s_q=2/4, 0.923-0.966x at
# S=4096, 0.969-1.020x at S=1200: wg1of_auto_rows_bench.txt), off below; with an fp8 cache on wherever the ring runs
WG1OF_AUTO_MIN_ROWS = 256


class CuteDslOptions(BackendOptions):
    ctas_per_sm: Literal["auto", 1, 2] = Field(
        default="auto", description="split-KV work items per SM in one wave (sm_90). auto: 2 for the fp8reg kernel "
        "(its 94-115 KB of shared memory lets two CTAs share an SM), else 1 (the WGMMA kernel's 224 KiB allows one)")
    rescale: Literal["lazy", "eager"] = Field(
        default="lazy",
        description="the seesaw kernel's online softmax (sm_90; under mma=auto from 33 packed rows). lazy (default since 0.2.16): a row keeps its reference max until a KV tile's "
                    "max exceeds it by more than 2^8 (exp2 units), so both warpgroups skip the rescale of their "
                    "O half (128 multiplies per thread) for a tile whose rows kept their reference, which sits on "
                    "the seesaw's critical path; P stays <= 2^8, the row sum and lse use the same reference (the "
                    "same result up to rounding). On an H200 (docs/results/gpu21_session/*_rescale_ab.txt, mla "
                    "bench, both arms interleaved, H=128 S=4096, 24 cells): 0.92-0.99x eager's time from batch 16 "
                    "(bf16 B=128 s_q=1 294.8 -> 288.9 us, s_q=2 549.5 -> 539.6; fp8 B=128 s_q=1 327.2 -> 324.0), "
                    "equal at batch 1. eager: every tile rescales (0.2.15's kernels). Other kernels ignore it")
    fp8_loader: Literal["inline", "producer", "ring", "ring_staged"] = Field(
        default="ring",
        description="how the seesaw kernel (sm_90; under mma=auto from 33 packed rows with an fp8 cache) turns the "
                    "fp8 e4m3 cache into its fp16 K tiles. ring (default since the twenty-third session): a third "
                    "warpgroup (384 threads, setmaxnreg 208 math / 88 producer) loads and converts the cache on "
                    "full / empty mbarriers with a 7-chunk register ring, each 16-byte chunk's ld.global issued six "
                    "chunks ahead of its conversion; on an H200 (docs/results/gpu23_session/ring_speed.txt, kernels "
                    "alone) 0.96-0.98x producer's time at H=128 B=16/64/128 s_q 1/2 and H=64 B=128, S=4096 (B=128 "
                    "H=128 s_q=1 280.6 against 291.5 us, fa3 932.7), bitwise the same output. producer (0.2.17's "
                    "default): the same warpgroup (216 / 72) with one part (up to 5 blocks) in registers at a time; "
                    "on an H200 0.88-0.90x inline's time (gpu22_session/fp8p_speed.txt). inline (0.2.16's kernel): "
                    "the two math warpgroups ld.global their part of each tile, convert it (cvt e4m3x2 -> f16x2) and "
                    "st.shared it between their WGMMAs. ring_staged: the ring with every third chunk staged through "
                    "8 KB of shared memory by cp.async (GPU-verified; 1.01-1.02x producer's time on the H200: not "
                    "faster). bf16/fp16 caches and other kernels ignore it")
    loads: Literal["auto", "cp_async", "tma"] = Field(
        default="auto",
        description="how the seesaw kernel (sm_90, s_q*num_heads >= 33 under mma=auto) brings KV tiles into shared "
                    "memory with a bf16/fp16 cache: cp_async (each thread of the loading warpgroup issues 16-20 "
                    "16-byte cp.async per part; zero-fills page tails) or tma (one elected thread issues a part's "
                    "64-token x 64-column TMA boxes; the kernel zeroes page tails itself). auto (default): tma for the "
                    f"balanced seesaw from {SEESAW_BALANCED_TMA_MIN_ROWS} packed rows, every row count mma=auto "
                    "gives it (since 0.2.14: "
                    "0.95-0.97x cp_async's time at H=128 s_q=1 B=64/128, 0.98-1.00x at B=12/16, "
                    "docs/results/gpu18_session/), with the even seesaw (seesaw_split=even or ctas_per_sm=2) from "
                    f"{SEESAW_TMA_MIN_ROWS} packed rows, cp_async below. On an H200 (docs/results/gpu16_session/, "
                    "H=128 S=4096 bf16, mla bench, interleaved) auto took 0.86-0.89x loads=cp_async's time at "
                    "s_q=2 and 4 from batch 32 (0.95x at s_q=2 B=16); the kernels alone, 0.92-0.96x there and "
                    "0.98-1.02x at s_q=1. With tma an eager step encodes the cache's tensor map on the host at "
                    "every launch (none under CUDA-graph replay). Other kernels and fp8 caches ignore it")
    q_prefetch: Optional[bool] = Field(
        default=None,
        description="the balanced seesaw kernel (sm_90, seesaw_split=balanced, bf16/fp16 cache): each work item of a "
                    "CTA column issues the next item's Q (a TMA load) and its first two KV tiles during its own last "
                    "pairs, so the next item does not start by waiting for them. Default (unset): on up to "
                    f"{QPF_AUTO_MAX_ROWS} packed rows (s_q * num_heads), off above. On an H200 (H=128, "
                    "docs/results/gpu23_session/): kernels alone 0.96-0.99x the time without it at s_q=1 (B=64-180, "
                    "S=800-4096); at s_q=2 0.97-0.99x up to S=1500 but 1.003-1.017x at S=4096, and through mla "
                    "bench at s_q=2 S=4096 1.03x (B=64 264.0 against 256.4 us, B=128 537.2 against 520.6). "
                    "The even seesaw, fp8 caches and the other kernels ignore it")
    tma_producer: Optional[bool] = Field(
        default=None,
        description="the balanced seesaw kernel with TMA loads (sm_90, seesaw_split=balanced, bf16/fp16 cache; "
                    f"loads=auto gives TMA from {SEESAW_BALANCED_TMA_MIN_ROWS} packed rows): a producer warpgroup "
                    "(384 threads, setmaxnreg 232 math / 40 producer) issues every KV part and each work item's Q "
                    "by TMA on full / empty mbarriers, walking the CTA column's items ahead of the math warpgroups, "
                    "so an item boundary no longer waits for the next item's Q and first tiles. Default (unset): on "
                    "wherever the balanced seesaw loads by TMA; q_prefetch is then ignored (the producer fetches "
                    "ahead itself). On an H200 (kernels alone, docs/results/gpu24_session/tmap_speed.txt, H=128, one "
                    "run): 0.92-0.93x q_prefetch's time at s_q=1 (B=128 S=4096 265.0 against 287.6 us, fa3 279.2; "
                    "B=180 386.8 against 419.1, fa3 411.7), 0.92-0.95x the default's at s_q=2 (B=128 S=4096 519.3 "
                    "against 548.6, fa3 535.2); outputs bitwise equal to the kernel without it. False: 0.2.18's "
                    "kernels. The even seesaw, cp.async loads, fp8 caches and the other kernels ignore it")
    wg1_other_first: Optional[bool] = Field(
        default=None,
        description="the seesaw kernel's QK part order for warpgroup 1 (sm_90): its QK of its own KV tile waits on "
                    "warpgroup 0's part (columns 0-255 and the RoPE block, freed early in the previous pair) before its "
                    "own (columns 256-511, freed only at the end of that pair), and whatever loads the tile (the fp8 "
                    "producer's register ring, the TMA producer warpgroup) fills the parts in that order. Default "
                    "(unset): on with an fp8 cache wherever the producer's register ring runs (fp8_loader=ring / "
                    f"ring_staged), on with a bf16/fp16 cache from {WG1OF_AUTO_MIN_ROWS} packed rows. On an H200 "
                    "through mla bench (docs/results/gpu26_session/wg1of_backend_bench.txt, H=128, batch 64 / 128, S "
                    "1200 / 4096, one run): fp8 0.97-0.99x the time without it at all 8 cells (B=128 s_q=1 S=4096 270.3 "
                    "against 277.5 us, fa3 944.8); bf16 at s_q=2 (256 rows) 0.957-0.972x at S=4096 (B=128 490.1 "
                    "against 504.2), 0.99-1.006x at S=1200, but at s_q=1 (128 rows) 1.015-1.026x, hence off below "
                    f"{WG1OF_AUTO_MIN_ROWS} rows; at 256-512 rows (H=64 s_q=4, H=128 s_q=2 and 4, batch 32-128, "
                    "wg1of_auto_rows_bench.txt) 0.923-0.966x at S=4096, 0.969-1.020x at S=1200; all measured with "
                    "the default balanced TMA-producer kernel (the even or cp.async seesaw at >= 256 rows follows the "
                    "same rule, its speed with it not measured). True: on "
                    "wherever the seesaw runs with a 16-bit cache or the fp8 ring; False: 0.2.20's kernels. The fp8 "
                    "seesaw without the ring (fp8_loader=inline / producer) and the other kernels ignore it")
    mma: Literal["auto", "wgmma", "seesaw", "mma_sync", "fp8reg", "wgmma_t"] = Field(
        default="auto",
        description="sm_90 partial kernel: wgmma (s_q*num_heads > 32; 1.4-1.7x faster than mma_sync at H=64/128 on "
                    "an H200, bf16 or fp8 KV), seesaw (WGMMA, each warpgroup its own KV tile; bf16, fp16 or fp8 KV, "
                    "s_q*num_heads > 32), fp8reg (fp8 KV, s_q*num_heads <= 32: fp8 B fragments converted in "
                    "registers), wgmma_t (s_q*num_heads <= 32, any cache: WGMMA with KV tokens as M and query rows "
                    "as N; with a bf16/fp16 cache it follows split_kv; balanced, at 17-32 rows on an H200: up to "
                    "14% faster than mma_sync balanced on steps of >= 768 KV blocks, mostly 4-7% slower at <= 384), "
                    "mma_sync (every shape). auto: seesaw from "
                    f"{SEESAW_FEW_ROWS_MIN} rows (any cache; on an H200 0.54-0.74x mma_sync's time at 48 rows, "
                    "0.86-1.05x wgmma's at 64 rows, at 17-32 rows 0.95-0.98x the 16/32-row kernels' time on large "
                    "steps and within 0.98-1.08x on small ones: NOTES.md; at 17-32 rows only with "
                    "seesaw_split=balanced and ctas_per_sm auto/1), else fp8reg for fp8 KV up to "
                    f"{FP8REG_MAX_ROWS} rows, and with seesaw_split=even or ctas_per_sm=2 at 17-32 rows 0.2.22's "
                    "rules: fp8reg for fp8 KV, wgmma_t for a bf16/fp16 cache at 17-"
                    f"{WGMMA_T_MAX_ROWS} rows when the step has >= {WGMMA_T_AUTO_MIN_BLOCKS} KV blocks (sum over "
                    "its requests of ceil(kv_len/64); split_kv=balanced, ctas_per_sm auto/1; measured at H=16 "
                    "s_q=2 on 132 SMs; decided per plan: both kernels read the same schedule buffers, so a CUDA "
                    "graph replays correctly after any plan, but it keeps the kernel of the plan it was captured "
                    "after: capture with representative lengths, or force mma per batch size in the policy), "
                    "else mma_sync")
    split_kv: SplitKV = Field(
        default="balanced",
        description="how the mma.sync kernel (and mma=wgmma_t) with a bf16/fp16 cache splits the KV work (sm_90). "
                    "balanced "
                    "(default): the balanced kernel (a fixed grid of CTA columns) with a per-step hybrid plan, "
                    "the balanced split (each column an equal share of all requests' blocks) when predicted >= 10% "
                    "faster, else the even one in the same buffers; on an H200 14-31% faster with variable "
                    "lengths (B100 H16 lengths 1..8192: 179.3 -> 123.7 us) and 0.3-1.9% slower at uniform "
                    "lengths. even: the default kernel of 0.2.2, each request cut into equal items, one CTA per "
                    "item (NOTES.md). Ignored where another kernel runs (WGMMA, seesaw, fp8reg, an fp8 cache); "
                    "mma=wgmma_t takes it as the mma.sync kernel does (its balanced mode: same schedule, one CTA "
                    "per SM). With even and seesaw_split=even, mma=auto runs the mma.sync even kernel at 17-32 "
                    "rows (its KV-block rule for wgmma_t applies to split_kv=balanced only; with seesaw_split="
                    "balanced, the default, auto runs the balanced seesaw there, which split_kv does not reach); "
                    "mma=wgmma_t runs its even entry")
    seesaw_split: SeesawSplit = Field(
        default="balanced",
        description="how the seesaw WGMMA kernel (sm_90; mma=auto from s_q*num_heads >= "
                    f"{SEESAW_MIN_ROWS}, or mma=seesaw) splits the KV work (an fp8 cache too since 0.2.17). balanced "
                    "(default since 0.2.13): the balanced seesaw kernel, a fixed grid of (m-blocks x "
                    "num_sms/m-blocks) CTA columns walking a per-step hybrid plan (the balanced split when "
                    "predicted >= 10% faster, else the even one in the same buffers; CUDA-graph safe), as "
                    "split_kv=balanced does for the mma.sync and wgmma_t kernels; on an H200 at H=128 S=4096 "
                    "0.69-0.89x the even kernel's time where the plan is balanced (B=24/40/48, s_q 1 and 2; 0.77-0.82x "
                    "with lengths 410-4096 at B=48), within 3% where it stays even (B=16/32/128). even: each request "
                    "cut into equal items, one CTA per item, waves of CTAs over the SMs (0.2.12's kernel). A separate "
                    "option and not a split_kv value because the two defaults were measured and flipped "
                    "independently. With an fp8 cache (since 0.2.17, FP8_SEESAW_BALANCED; the producer warpgroup "
                    "walks the same items) on an H200 0.67-0.89x the even kernel's time at batch 24, 40 and 96, "
                    "0.99-1.02x elsewhere (docs/results/gpu22_session/fp8_h128_batches_flags_*.txt). The other "
                    "kernels ignore it")
    num_sms: Union[Literal["auto"], int] = Field(
        default="auto",
        description="SMs the split-KV schedule spreads one step's work over (sm_90). auto: all of the GPU's. Set "
                    "it lower when other kernels hold SMs while attention runs (e.g. communication kernels on a "
                    "side stream): a schedule for all SMs then needs a second wave for the columns or items that "
                    "find no free SM. At most the GPU's SM count (an error when the decoder opens)")
    pdl: Union[Literal["auto"], bool] = Field(
        default=False,
        description="launch the combine kernel with programmatic dependent launch (sm_90): its CTAs are scheduled "
                    "while the partial kernel runs and wait on the GPU (griddepcontrol.wait) until the partial "
                    "grid's writes are visible, so the combine's launch latency hides behind the partial kernel "
                    "(every partial kernel triggers its dependents at its start either way; without a PDL "
                    "combine the trigger does nothing). false (default): the combine follows the partial kernel "
                    f"as an ordinary stream-ordered kernel. auto: on up to {PDL_AUTO_MAX_ROWS} rows (s_q*num_heads; "
                    "the mma.sync, wgmma_t and fp8reg kernels), off from there. true: on for every shape. Off by "
                    "default: on an H200 (docs/results/gpu11_pdl/, auto against off in one run) it changed the time "
                    "by -9..+1.4% at H=16 batches 1-16 with lengths 1024-4096 but cost 1.40x at B=1 H=16 s_q=2 "
                    "S=8192 and 1.13-1.53x at B=1-2 S=16384 (s_q=1 with a bf16 cache excepted; cause unknown)")
    partials: Literal["auto", "fp32", "q"] = Field(
        default="auto",
        description="dtype of the split-KV partial outputs (sm_90): each split's O, normalised, written by the "
                    "partial kernel and read back by the combine kernel (the combine sums in fp32 and the LSE "
                    "partials stay fp32 either way). fp32: 4 bytes per value. q: q's dtype (bf16/fp16), half the "
                    "bytes a split step adds, for one more rounding of each split's O. auto (default): q. On an "
                    "H200 (docs/results/gpu12_stores/, one run, against fp32 partials with narrow stores) q with "
                    "wide stores took 0.86-0.98x the time at H=128 on split steps (B=1-16), 0.70-0.98x with "
                    "fp8reg at H=16, 0.93-1.03x at H=16 with a bf16 cache (mean 0.99 / 0.98 for s_q 1 / 2); "
                    "against fp32 with wide stores it was 1.02-1.05x at H=128 B=64-128 S=4096, steps that write no "
                    "partials (noise or codegen, not repeated); with narrow stores (tenth session) q had been up "
                    "to 32% slower at H=128")
    stores: Literal["auto", "narrow", "wide"] = Field(
        default="auto",
        description="width of the partial kernels' epilogue stores of 16-bit rows (sm_90): the q-dtype output of "
                    "an unsplit request, and 16-bit partials. narrow: each thread stores its accumulator's "
                    "2-column pairs directly, 4 bytes per store (bf16x2). wide: the 4 lanes sharing a row exchange "
                    "their pairs (4 warp shuffles per 16 bytes) and each stores 8 contiguous columns, 16 bytes per "
                    "st.global.v4 (kernels/wide_store.py), in the mma.sync, WGMMA and seesaw kernels (fp8reg "
                    "stores 16 bytes either way; wgmma_t keeps its stores). auto (default): wide. On an H200 "
                    "(docs/results/gpu12_stores/, one run against narrow) wide was up to 14% faster at H=128 on "
                    "unsplit steps (B=64 S=800 s_q=1 46.0 -> 39.5 us) and 0.99-1.02x at H=16 with a bf16 cache "
                    "and fp32 partials")
    combine: Literal["auto", "row", "chunked", "wide", "fused"] = Field(
        default="auto",
        description="the kernel that merges split-KV partials (sm_90). row: one warp per query row walks every "
                    "split; chunked: four warps per row, 128 columns each (4x the warps in flight for steps of few "
                    "requests); wide: one CTA per row and 128-column chunk, its warps sharing out the splits (for "
                    "rows split many ways). auto: by the row kernel's CTA count (batch * ceil(rows/4), rows = "
                    "s_q*num_heads): wide below num_sms/2, chunked below 4*num_sms, row above (kernels/schedule.py "
                    "combine_kind_for, with the H200 numbers; since 0.2.8 at every row count, 0.2.7 kept the chunked "
                    "kernel to 32 rows: 6-14% faster at H=128 on 128-256 row CTAs). Decided by batch size and rows, so a CUDA graph keeps one combine kernel. fused: no "
                    "combine kernel where the mma.sync kernel runs (balanced or even split_kv) with a bf16/fp16 cache at "
                    "s_q*num_heads <= 32: the last CTA to finish one of a request's split items merges them "
                    "(kernels/fused_merge.py; one launch per step). Everywhere else (fp8 caches, wgmma, seesaw, "
                    "fp8reg, the wgmma_t kernel mma=auto picks at 17-32 rows on steps of >= 640 KV blocks, > 32 "
                    "rows) it falls back to auto's combine kernel. Experimental, for A/B only: correct on an H200 (GPU "
                    "tests), and since 0.2.9 (all threads merge, two splits' loads in flight) about as fast as auto "
                    "where requests split 2-4 ways (docs/results/gpu13_session/, one run: B=64 H=16 s_q=1 S=8192 "
                    "149.6 against 148.9 us, 0.98-1.01x at B=64-128 S=4096-16384, 1.01-1.08x at B=32-48) and "
                    "1.08-5.9x slower at B=1-16 (one CTA walks a request's many splits) and at s_q=2 B=16-32 below 640 KV "
                    "blocks)")
    s_accs: Literal["auto", 1, 2, 4] = Field(
        default="auto",
        description="independent S accumulators per warp in the fp8reg kernel (sm_90, fp8 cache up to 32 packed "
                    "rows): the QK k-steps round-robin over them, so each n-block's chain of 36 dependent mma.sync "
                    "becomes 36/s_accs. auto (default): 4 at up to 16 rows (s_q*num_heads), 1 above. On an H200 "
                    "(docs/results/gpu13_session/fp8_saccs_ab.txt, mla bench, one run): at H=16 s_q=1, B=1-128, "
                    "S=1024-8192, 4 took 0.948-0.997x the time of 1 (all 18 cells faster, 1-5% from B=16; B=64 "
                    "S=8192 107.9 -> 104.9 us); at 32 rows (fp8_saccs.txt) 4 was slower (B=128 s_q=2 S=4096 "
                    "147.0 -> 159.5 us) and 2 within 1%. Other kernels ignore it")
    sm100_workspace_mb: int = Field(default=128, ge=1,
                                    description="FlashInfer cute-dsl workspace per session, MiB (sm_100 path)")

    @field_validator("pdl", mode="before")
    @classmethod
    def _auto_or_bool(cls, value: Any) -> Any:
        """One message for both halves of the union (pydantic would print one error per member)."""
        if value == "auto" or isinstance(value, bool):
            return value
        raise ValueError(f"expected auto, true or false, got {value!r}")

    @field_validator("num_sms", mode="before")
    @classmethod
    def _auto_or_positive_count(cls, value: Any) -> Any:
        """One message for both halves of the union (pydantic would print one error per member)."""
        if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            return value
        raise ValueError(f"expected 'auto' or a positive SM count, got {value!r}")


def shape_reasons(shape: DecodeShape) -> List[str]:
    """Every reason the kernels cannot take a shape class (pure host logic): SM100 rules on SM100, else SM90's."""
    dev = shape.device
    if dev.type == "cuda" and sm100.is_sm100(dev.capability):
        return sm100.shape_reasons(shape)
    out: List[str] = []
    if dev.type != "cuda":
        return [f"device={dev}: the CuTe DSL kernels run on CUDA GPUs only"]
    if dev.capability != (9, 0):
        out.append(f"{dev}: these kernels are built for sm_90 (Hopper) only")
    if shape.q_dtype not in ("bf16", "fp16"):
        out.append(f"q_dtype={shape.q_dtype} not in {{bf16, fp16}}")
    if shape.kv_dtype not in (shape.q_dtype, "fp8_e4m3"):
        out.append(f"kv_dtype={shape.kv_dtype} must equal q_dtype={shape.q_dtype} or be fp8_e4m3")
    if shape.output_dtype != shape.q_dtype:
        out.append(f"out_dtype={shape.output_dtype}: the kernels write out in q's dtype ({shape.q_dtype})")
    if (shape.kv_lora_rank, shape.qk_rope_head_dim) != (512, 64):
        out.append(f"kv_lora_rank={shape.kv_lora_rank}, rope dim {shape.qk_rope_head_dim}: the kernels are built "
                   "for 512 + 64")
    if shape.page_size % BLOCK_N:
        out.append(f"page_size={shape.page_size}: the kernels read 64-token tiles inside one page "
                   "(page sizes that are multiples of 64)")
    if shape.num_heads > 128:
        out.append(f"num_heads={shape.num_heads} > 128")
    if shape.seq_len_q > 8:
        out.append(f"seq_len_q={shape.seq_len_q} > 8")
    if shape.seq_len_q > 1 and not shape.causal:
        out.append("non-causal seq_len_q > 1: the kernels mask causally (bottom-right) only")
    if shape.scale_inputs == "tensor":
        out.append("scale_inputs=tensor: the kernels take kv_scale as a launch argument (a host float)")
    return out


def wgmma_reasons(shape: DecodeShape, options: CuteDslOptions) -> List[str]:
    """Why a WGMMA kernel (options.mma wgmma or seesaw: 64-row tiles) cannot take a shape the mma.sync kernels
    take (empty: it can). mma=seesaw takes 1-32 rows too when forced (0.2.22): it pads its 64-row tile inside (as
    it does for the last m-block of H=63 or H=126; auto gives it from 17 rows since 0.2.23), only in its balanced
    split, the mode run on a GPU at these rows; mma=wgmma, the one-S kernel, keeps its floor of 33 rows."""
    rows = shape.seq_len_q * shape.num_heads
    if rows > 32:
        return []
    if options.mma == "wgmma":
        return [f"mma=wgmma: s_q*num_heads={rows} <= 32 (its tile is 64 query rows, at least half of them padding "
                "here; the mma.sync kernels' 16/32-row tiles fit)"]
    if not balanced_split(shape, options):
        return [f"mma=seesaw: s_q*num_heads={rows} <= 32 runs only the balanced split (seesaw_split=balanced, "
                f"ctas_per_sm auto or 1), the mode verified on a GPU at these rows; got seesaw_split="
                f"{options.seesaw_split}, ctas_per_sm={options.ctas_per_sm}"]
    return []


def fp8reg_reasons(shape: DecodeShape) -> List[str]:
    """Why the fp8-register kernel cannot take a shape the mma.sync kernels take (empty: it can)."""
    out = []
    if shape.kv_dtype != "fp8_e4m3":
        out.append(f"mma=fp8reg: kv_dtype={shape.kv_dtype}: this kernel reads an fp8_e4m3 cache only")
    if shape.seq_len_q * shape.num_heads > FP8REG_MAX_ROWS:
        out.append(f"mma=fp8reg: s_q*num_heads={shape.seq_len_q * shape.num_heads} > {FP8REG_MAX_ROWS} "
                   "(its tiles are 16 or 32 query rows)")
    return out


def wgmma_t_reasons(shape: DecodeShape) -> List[str]:
    """Why the transposed WGMMA kernel cannot take a shape the mma.sync kernels take (empty: it can)."""
    rows = shape.seq_len_q * shape.num_heads
    if rows > WGMMA_T_MAX_ROWS:
        return [f"mma=wgmma_t: s_q*num_heads={rows} > {WGMMA_T_MAX_ROWS} (query rows are its WGMMA N: 16 or 32)"]
    return []


def seesaw_runs_balanced(shape: DecodeShape, options: CuteDslOptions) -> bool:
    """Whether the seesaw kernel, where it runs this shape class, runs its balanced mode: seesaw_split=balanced and
    ctas_per_sm auto or 1 (one seesaw CTA fills an SM, 222 KB of shared memory: the balanced grid's columns must
    all run at once, which the hybrid's cost model assumes, so ctas_per_sm=2 keeps the even kernel), and for an
    fp8 cache FP8_SEESAW_BALANCED (read at call time)."""
    if shape.kv_dtype == "fp8_e4m3" and not FP8_SEESAW_BALANCED:
        return False
    return options.seesaw_split == "balanced" and options.ctas_per_sm in ("auto", 1)


def seesaw_few_rows_auto(shape: DecodeShape, options: CuteDslOptions) -> bool:
    """Whether mma=auto gives this shape class the balanced seesaw below SEESAW_MIN_ROWS (0.2.23): 17-32 packed
    rows, any cache, where the seesaw runs balanced (seesaw_runs_balanced: the only mode it runs at <= 32 rows,
    wgmma_reasons). Shape class and options only, so a session's graphs keep one kernel."""
    rows = shape.seq_len_q * shape.num_heads
    return (options.mma == "auto" and SEESAW_FEW_ROWS_MIN <= rows < SEESAW_MIN_ROWS
            and seesaw_runs_balanced(shape, options))


def _wgmma_t_auto(shape: DecodeShape, options: CuteDslOptions) -> bool:
    """Whether mma=auto's KV-block rule applies to this shape class and options: a bf16/fp16 cache, 17-32 packed
    rows, split_kv=balanced (with split_kv=even auto keeps the mma.sync even kernel: the measurements are of
    the balanced modes) and ctas_per_sm auto or 1 (the transposed kernel's shared memory holds one CTA per SM,
    and one CTA per SM keeps the schedule identical for both kernels), and auto not giving the seesaw there
    (since 0.2.23 it does unless seesaw_split=even: seesaw_few_rows_auto). Shape class and options only."""
    rows = shape.seq_len_q * shape.num_heads
    return (options.mma == "auto" and shape.kv_dtype != "fp8_e4m3" and 16 < rows <= WGMMA_T_MAX_ROWS
            and options.split_kv == "balanced" and options.ctas_per_sm in ("auto", 1)
            and not seesaw_few_rows_auto(shape, options))


def step_kv_blocks(kv_lens: Union["torch.Tensor", Sequence[int]]) -> int:
    """The step's KV blocks: the sum over its requests of ceil(kv_len / 64) (kv_len <= 0 counts 0), kv_len
    being the request's whole KV length including this step's new tokens (the host lengths plan receives: a
    CPU tensor or ints; a CUDA tensor would synchronise in .tolist()).
    The same count as the split-KV schedule's blocks (kernels/schedule.py _nblocks); mma=auto's wgmma_t rule
    compares it with WGMMA_T_AUTO_MIN_BLOCKS. A host tensor or a sequence of ints."""
    if hasattr(kv_lens, "tolist"):
        kv_lens = kv_lens.tolist()
    return sum((n + BLOCK_N - 1) // BLOCK_N for n in kv_lens if n > 0)


def partial_kernel(shape: DecodeShape, options: CuteDslOptions,
                   kv_blocks: Optional[int] = None) -> PartialKernel:
    """Which sm_90 partial kernel runs this shape (forced values the shape refuses are refused in can_implement).

    mma=auto depends on the step in one case only (a bf16/fp16 cache at 17-32 rows with seesaw_split=even,
    split_kv=balanced, ctas_per_sm auto/1): wgmma_t when the step has `kv_blocks` >= WGMMA_T_AUTO_MIN_BLOCKS
    (step_kv_blocks), mma.sync below. Without `kv_blocks` (a caller with a shape class or a problem and no lengths) the answer is
    the one below the threshold: mma_sync there. Plans use partial_kernel_for, which counts the step's blocks."""
    if options.mma != "auto":
        return options.mma
    rows = shape.seq_len_q * shape.num_heads
    if rows >= SEESAW_MIN_ROWS or seesaw_few_rows_auto(shape, options):
        return "seesaw"
    if shape.kv_dtype == "fp8_e4m3" and rows <= FP8REG_MAX_ROWS:
        return "fp8reg"
    if kv_blocks is not None and kv_blocks >= WGMMA_T_AUTO_MIN_BLOCKS and _wgmma_t_auto(shape, options):
        return "wgmma_t"
    return "mma_sync"


def partial_kernel_for(problem: DecodeShape, options: CuteDslOptions,
                       kv_lens: Union["torch.Tensor", Sequence[int]]) -> PartialKernel:
    """The partial kernel a plan with these host lengths runs: partial_kernel with step_kv_blocks(kv_lens)
    (counted only where mma=auto's rule applies). It may differ between two plans of one batch size; that is
    graph-safe because the two kernels it chooses between (mma.sync and wgmma_t, both balanced) read exactly
    the same schedule, workspace and scratch from plan (module docstring; CuteDslSession._schedule)."""
    return partial_kernel(problem, options, rule_kv_blocks(problem, options, kv_lens))


def rule_kv_blocks(shape: DecodeShape, options: CuteDslOptions,
                   kv_lens: Union["torch.Tensor", Sequence[int]]) -> Optional[int]:
    """step_kv_blocks(kv_lens) where mma=auto's KV-block rule applies to this shape class and options, else None
    (the lengths are then not read): what partial_kernel and kernel_summary take as `kv_blocks`."""
    return step_kv_blocks(kv_lens) if _wgmma_t_auto(shape, options) else None


# partial kernels with a balanced mode (a column loop over the hybrid schedule) under split_kv, 16-bit caches only
BALANCED_KERNELS = ("mma_sync", "wgmma_t")
# the seesaw's balanced mode follows its own option, seesaw_split (default balanced)
SEESAW_BALANCED_KERNEL = "seesaw"
# whether an fp8 cache runs the balanced seesaw too (seesaw_split=balanced; on since 0.2.17), and whether that
# kernel takes the producer warpgroup with fp8_loader=producer (the default). Both GPU-verified on an H200 in the
# twenty-second session (docs/results/gpu22_session/: the balanced fp8 seesaw 46 GPU tests, with the producer 44;
# the backend's auto, forced-seesaw and engine-interface classes with both on: 31 passed). `mla bench` with both on
# against both off (the even producer kernel; fp8_h128_batches_flags_{on,off}.txt, fa3 in each run, H=64/128, s_q
# 1/2, S=4096): 0.67-0.89x the time at batch 24, 40 and 96 where the even split leaves SMs idle (H=128 s_q=2 B=40
# 187.5 against 280.8 us, fa3 880.7), 0.99-1.00x at 64 and 128, 1.00-1.02x at batch 8 (+0.3-0.4 us). The hybrid
# plan's cost model (schedule.item_cost, its 10% margin) was measured with 16-bit caches and is used unchanged.
# Read at call time by balanced_split and seesaw_fp8_producer (so kernel_summary, the session's schedule and plan
# follow them); False restores 0.2.16's even fp8 seesaw / the inline balanced one
FP8_SEESAW_BALANCED = True
FP8_BALANCED_PRODUCER = True


def balanced_split(shape: DecodeShape, options: CuteDslOptions) -> bool:
    """Whether this shape runs a balanced split-KV kernel: split_kv=balanced, the mma.sync kernel or the
    transposed WGMMA kernel (mma=wgmma_t), and a 16-bit cache. Both balanced kernels are their item body in
    a column loop; fp8 caches have none: the hybrid plan's cost model (item_cost, the 10% margin) was
    measured with a 16-bit cache, the mma.sync fp8 kernel has no column loop, and the wgmma_t fp8
    producer pairs its register sets with ring stages at compile time. The other WGMMA kernels have none
    either. Shape class and options only, so the session's buffers and its CUDA graphs never change kind
    between steps: mma=auto's KV-block rule swaps mma_sync for wgmma_t, both balanced kernels, never changing
    this answer. The seesaw kernel (a bf16/fp16 cache; an fp8 cache too with FP8_SEESAW_BALANCED, off by
    default) runs its balanced mode with seesaw_split=balanced (the default since 0.2.13; split_kv does not
    reach it)."""
    kernel = partial_kernel(shape, options)
    if kernel == SEESAW_BALANCED_KERNEL:
        return seesaw_runs_balanced(shape, options)
    return shape.kv_dtype != "fp8_e4m3" and options.split_kv == "balanced" and kernel in BALANCED_KERNELS


def seesaw_fp8_producer(shape: DecodeShape, options: CuteDslOptions) -> bool:
    """Whether the fp8 seesaw runs with its producer warpgroup: option fp8_loader=producer (the default since
    0.2.17) or ring, an fp8 cache, the seesaw kernel, and its even mode, or its balanced mode (FP8_SEESAW_BALANCED)
    only with FP8_BALANCED_PRODUCER (on since 0.2.17; off: the balanced seesaw converts inline)."""
    return (shape.kv_dtype == "fp8_e4m3" and options.fp8_loader in ("producer", "ring", "ring_staged")
            and partial_kernel(shape, options) == "seesaw"
            and (FP8_BALANCED_PRODUCER or not balanced_split(shape, options)))


def seesaw_q_prefetch(shape: DecodeShape, options: CuteDslOptions) -> bool:
    """Whether the balanced seesaw runs with its q_prefetch option (the next item's Q and KV tiles 0/1 issued during
    the current item): option q_prefetch, a bf16/fp16 cache and the seesaw kernel in its balanced mode, where the
    TMA producer warpgroup does not run (seesaw_tma_producer: it fetches ahead itself). A function of the shape class
    and options only (one session's graphs keep one kernel)."""
    wanted = (shape.seq_len_q * shape.num_heads <= QPF_AUTO_MAX_ROWS if options.q_prefetch is None
              else options.q_prefetch)
    return (wanted and shape.kv_dtype != "fp8_e4m3"
            and partial_kernel(shape, options) == SEESAW_BALANCED_KERNEL and balanced_split(shape, options)
            and not seesaw_tma_producer(shape, options))


def seesaw_tma_producer(shape: DecodeShape, options: CuteDslOptions) -> bool:
    """Whether the balanced seesaw runs with its TMA producer warpgroup (kernel option tma_producer): option
    tma_producer (unset: on) wherever the seesaw kernel runs balanced with TMA loads and a bf16/fp16 cache. A function
    of the shape class and options only (one session's graphs keep one kernel)."""
    return (options.tma_producer is not False and shape.kv_dtype != "fp8_e4m3"
            and partial_kernel(shape, options) == SEESAW_BALANCED_KERNEL and balanced_split(shape, options)
            and seesaw_tma(shape, options))


def seesaw_wg1_other_first(shape: DecodeShape, options: CuteDslOptions) -> bool:
    """Whether the seesaw kernel runs with warpgroup 1's other part first (kernel option wg1_other_first): option
    wg1_other_first (unset: on with an fp8 cache where the producer's register ring runs, seesaw_fp8p_ring; with a
    bf16/fp16 cache from WG1OF_AUTO_MIN_ROWS packed rows), for the seesaw kernel (either split) with a 16-bit cache or the fp8 ring; the kernels that
    cannot take it (the inline fp8 seesaw, the one-part producer, every other kernel) ignore it. A function of the
    shape class and options only (one session's graphs keep one kernel)."""
    if partial_kernel(shape, options) != "seesaw" or options.wg1_other_first is False:
        return False
    if shape.kv_dtype == "fp8_e4m3":
        return bool(seesaw_fp8p_ring(shape, options))
    return options.wg1_other_first is True or shape.seq_len_q * shape.num_heads >= WG1OF_AUTO_MIN_ROWS


def seesaw_fp8p_ring(shape: DecodeShape, options: CuteDslOptions) -> int:
    """The producer's register ring size (kernel option fp8p_ring) for this shape: fp8p_ring.RING_DEFAULT with
    fp8_loader=ring wherever the producer warpgroup runs (seesaw_fp8_producer), else 0 (the one-part producer or
    none)."""
    if options.fp8_loader not in ("ring", "ring_staged") or not seesaw_fp8_producer(shape, options):
        return 0
    from .kernels.fp8p_ring import RING_DEFAULT

    return RING_DEFAULT


def seesaw_fp8p_stage(shape: DecodeShape, options: CuteDslOptions) -> int:
    """The ring's shared-memory staging slots (kernel option fp8p_stage): fp8p_ring.STAGE_SLOTS with
    fp8_loader=ring_staged wherever the ring runs (seesaw_fp8p_ring), else 0."""
    if options.fp8_loader != "ring_staged" or not seesaw_fp8p_ring(shape, options):
        return 0
    from .kernels.fp8p_ring import STAGE_SLOTS

    return STAGE_SLOTS


def kernel_summary(shape: DecodeShape, options: CuteDslOptions, kv_blocks: Optional[int] = None) -> str:
    """Which sm_90 kernel runs a shape and how its KV is split, and why a split_kv the kernel cannot take
    is ignored (logged at plan; the answer to "which kernel runs" for a given option set). `kv_blocks` (the
    step's step_kv_blocks; none for a shape class or a problem without lengths) decides mma=auto's one
    per-step rule, which the text then names with the threshold and why; without it the text names both
    sides."""
    kernel = partial_kernel(shape, options, kv_blocks)
    if balanced_split(shape, options) and kernel == SEESAW_BALANCED_KERNEL:
        text = ("seesaw kernel, balanced split-KV (seesaw_split=balanced: per step the balanced or the even plan, "
                "whichever is predicted >= 10% faster)")
        if shape.kv_dtype == "fp8_e4m3":
            text += " with an fp8 cache (FP8_SEESAW_BALANCED; the plan's cost model was measured with 16-bit caches)"
    elif balanced_split(shape, options):
        text = (f"{kernel} kernel, balanced split-KV (split_kv=balanced: per step the balanced or the even plan, "
                "whichever is predicted >= 10% faster)")
    else:
        text = f"{kernel} kernel, even split-KV"
        if options.split_kv == "balanced":
            why = ("has an fp8 cache" if kernel in BALANCED_KERNELS else f"runs the {kernel} kernel")
            text += (f" (split_kv=balanced ignored: it applies to the mma.sync and wgmma_t kernels with a bf16/fp16 "
                     f"cache, this shape {why})")
        if kernel == SEESAW_BALANCED_KERNEL and options.seesaw_split == "balanced":
            why = ("takes an fp8 cache only with backend.FP8_SEESAW_BALANCED (set off here)"
                   if shape.kv_dtype == "fp8_e4m3" and not FP8_SEESAW_BALANCED
                   else "runs one CTA per SM, ctas_per_sm=2 asks for two")
            text += f" (seesaw_split=balanced ignored: the balanced seesaw {why})"
    if kernel == "seesaw":
        text += f", {options.rescale} softmax rescale (rescale={options.rescale})"
    if kernel == "seesaw" and shape.kv_dtype == "fp8_e4m3":
        if seesaw_fp8_producer(shape, options) and seesaw_fp8p_ring(shape, options):
            staged = " and shared-memory staging" if seesaw_fp8p_stage(shape, options) else ""
            text += (f", a producer warpgroup with a {seesaw_fp8p_ring(shape, options)}-chunk register ring{staged} "
                     f"converts the fp8 cache (fp8_loader={options.fp8_loader})")
        elif seesaw_fp8_producer(shape, options):
            text += ", a producer warpgroup converts the fp8 cache (fp8_loader=producer)"
        elif options.fp8_loader in ("producer", "ring", "ring_staged"):
            text += (f", the math warpgroups convert the fp8 cache (fp8_loader={options.fp8_loader} ignored: the "
                     "balanced seesaw takes the producer warpgroup only with backend.FP8_BALANCED_PRODUCER, set off "
                     "here)")
        else:
            text += ", the math warpgroups convert the fp8 cache (fp8_loader=inline)"
    if kernel == "seesaw" and shape.kv_dtype != "fp8_e4m3":
        text += f", {'TMA' if seesaw_tma(shape, options) else 'cp.async'} KV loads (loads={options.loads}"
        if options.loads == "auto":
            text += f": TMA from {seesaw_tma_min_rows(shape, options)} rows"
        text += ")"
        if seesaw_tma_producer(shape, options):
            text += (", a producer warpgroup issues the KV tiles and each item's Q by TMA ahead of the math warpgroups "
                     "(tma_producer)")
            if options.q_prefetch:
                text += " (q_prefetch=true ignored: the producer fetches ahead itself; tma_producer=false runs it)"
        if seesaw_q_prefetch(shape, options):
            text += ", the next work item's Q and KV tiles 0/1 issued during the current one (q_prefetch)"
    if seesaw_wg1_other_first(shape, options):
        text += ", warpgroup 1's QK waits the other warpgroup's part of its tile first (wg1_other_first)"
    elif kernel == "seesaw" and options.wg1_other_first:
        why = ("fp8_loader=ring / ring_staged" if options.fp8_loader not in ("ring", "ring_staged")
               else "which the balanced seesaw runs only with backend.FP8_BALANCED_PRODUCER, set off here")
        text += (f" (wg1_other_first=true ignored: the fp8 seesaw takes it only with the producer's register ring, "
                 f"{why})")
    if _wgmma_t_auto(shape, options):
        rows = shape.seq_len_q * shape.num_heads
        least = WGMMA_T_AUTO_MIN_BLOCKS
        if kv_blocks is None:
            text += (f"; mma=auto at {rows} rows with a 16-bit cache, per step: this kernel below {least} KV blocks "
                     f"(sum of ceil(kv_len/64) over the step's requests), the wgmma_t kernel from {least} (the "
                     "same schedule buffers: graph-safe)")
        elif kernel == "wgmma_t":
            text += (f"; mma=auto: {kv_blocks} KV blocks >= {least} at {rows} rows with a 16-bit cache (wgmma_t "
                     "measured -0.6..+14% against mma.sync from 768 blocks on an H200)")
        else:
            text += (f"; mma=auto: {kv_blocks} KV blocks < {least} at {rows} rows with a 16-bit cache (wgmma_t "
                     f"measured mostly 4-7% slower than mma.sync at <= 384 blocks, 0-2% at 512 on an H200; it runs "
                     f"from {least} blocks)")
    return text


def pdl_combine(shape: DecodeShape, options: CuteDslOptions) -> bool:
    """Whether this shape class's combine kernel is launched with programmatic dependent launch (option pdl;
    auto: up to PDL_AUTO_MAX_ROWS packed rows). Shape class and options only, so one session's schedule keeps
    one answer and its graphs one combine kernel."""
    if options.pdl != "auto":
        return bool(options.pdl)
    return shape.seq_len_q * shape.num_heads <= PDL_AUTO_MAX_ROWS


def seesaw_tma_min_rows(shape: DecodeShape, options: CuteDslOptions) -> int:
    """The packed rows from which loads=auto gives the seesaw TMA loads: SEESAW_BALANCED_TMA_MIN_ROWS when the
    seesaw runs balanced (balanced_split), else SEESAW_TMA_MIN_ROWS (the even seesaw, e.g. ctas_per_sm=2)."""
    return SEESAW_BALANCED_TMA_MIN_ROWS if balanced_split(shape, options) else SEESAW_TMA_MIN_ROWS


def seesaw_tma(shape: DecodeShape, options: CuteDslOptions) -> bool:
    """Whether the seesaw kernel, where it runs this shape class, loads KV by TMA (option loads; auto: from
    seesaw_tma_min_rows packed rows). False for an fp8 cache (its loads convert in registers). A function of the
    shape class and options only: one session's graphs keep one kernel."""
    if shape.kv_dtype == "fp8_e4m3" or options.loads == "cp_async":
        return False
    return options.loads == "tma" or shape.seq_len_q * shape.num_heads >= seesaw_tma_min_rows(shape, options)


# option s_accs=auto: 4 independent S accumulators in the fp8reg kernel up to this many packed rows (BLOCK_M 16),
# 1 above (measured on an H200, the option's description)
FP8REG_S_ACCS_AUTO_MAX_ROWS = 16


def fp8reg_s_accs(shape: DecodeShape, options: CuteDslOptions) -> int:
    """The fp8reg kernel's S accumulators per warp for this shape class: option s_accs, or auto's choice."""
    if options.s_accs != "auto":
        return options.s_accs
    return 4 if shape.seq_len_q * shape.num_heads <= FP8REG_S_ACCS_AUTO_MAX_ROWS else 1


def ctas_per_sm(kernel: PartialKernel, options: CuteDslOptions) -> int:
    """Split-KV work items per SM for the schedule: the option, or auto's choice for the kernel."""
    if options.ctas_per_sm != "auto":
        return options.ctas_per_sm
    return 2 if kernel == "fp8reg" else 1


class CuteDslBackend(Backend):
    """Our SM90 MLA decode kernels in CuTe DSL: bf16/fp16 q, same-dtype or fp8 KV, split-KV."""

    name = "cute_dsl_mla"
    Options = CuteDslOptions

    @hookimpl
    def info(self) -> BackendInfo:
        return BackendInfo(
            description="our CuTe DSL MLA decode kernels for sm_90: bf16/fp16 q, bf16/fp16/fp8 KV, split-KV",
            # short: `mla backends list` prints every note; what each option does is in its description
            # (`mla backends options cute_dsl_mla`), what a shape runs in `mla backends explain`
            notes=(f"sm_90 kernels checked on an H200: the seesaw WGMMA kernel from s_q*H >= {SEESAW_FEW_ROWS_MIN} "
                   "(bf16, fp16 or fp8 KV), below it fp8reg (fp8 KV) or mma.sync; "
                   "`mla backends explain` names the kernel of a shape, `mla backends options "
                   "cute_dsl_mla` what each option does",
                   f"{sm100.UNVERIFIED}; checked against {FLASHINFER_DIST}>={FLASHINFER_RANGE[0]},"
                   f"<{FLASHINFER_RANGE[1]}",
                   "fp8 KV runs its MMAs in fp16 on sm_90: |q| must stay below 65504",
                   f"with seesaw_split=even and a bf16/fp16 cache at 17-{WGMMA_T_MAX_ROWS} rows a CUDA graph keeps "
                   "the kernel of the plan it was captured after (wgmma_t or mma.sync, chosen per step by its KV "
                   "blocks): capture with representative lengths (option mma)"),
            q_layouts=("packed",), kv_layouts=("packed",), strided_q=False,
        )

    @staticmethod
    def _judge(cap: Optional[Tuple[int, int]], reasons: List[str], details: Dict[str, str]) -> None:
        """Capability rules shared by the real and the simulated availability: sm_90 ours, sm_100/103/107 FlashInfer's."""
        if cap is None:
            return
        if sm100.is_sm100(cap):
            more, lib = library_installed("flashinfer", FLASHINFER_DIST, f"pip install '{FLASHINFER_DIST}"
                                          f">={FLASHINFER_RANGE[0]},<{FLASHINFER_RANGE[1]}'", key="flashinfer")
            reasons.extend(more)
            details.update(lib)
            version = checked_range(FLASHINFER_DIST, lib.get("flashinfer"), *FLASHINFER_RANGE)
            if version:
                reasons.append(version)
            details["path"] = sm100.UNVERIFIED
        elif cap != (9, 0):
            reasons.append(f"sm_{cap[0]}{cap[1]}: the CuTe DSL kernels run on sm_90 (ours) and sm_100/103/107 "
                           "(FlashInfer's cute-dsl-monolithic) only")

    @hookimpl
    def availability(self) -> Availability:
        reasons, details, cap = library_and_cuda("cutlass", CUTLASS_DIST, f"pip install '{CUTLASS_DIST}>=4.8.1,<4.9'",
                                                 key="cutlass-dsl")
        self._judge(cap, reasons, details)
        return Availability.from_reasons(reasons, **details)

    @hookimpl
    def availability_for(self, device: DeviceSpec) -> Availability:
        reasons, details = library_installed("cutlass", CUTLASS_DIST, f"pip install '{CUTLASS_DIST}>=4.8.1,<4.9'",
                                             key="cutlass-dsl")
        if device.type != "cuda" or device.capability is None:
            reasons.append(f"device={device}: the CuTe DSL kernels run on CUDA GPUs only")
        self._judge(device.capability, reasons, details)
        details["simulated"] = f"{device} (installed packages only, no GPU probed)"
        return Availability.from_reasons(reasons, **details)

    @hookimpl
    def can_implement(self, shape: DecodeShape, options: CuteDslOptions) -> List[str]:
        reasons = shape_reasons(shape)
        if not (shape.device.type == "cuda" and sm100.is_sm100(shape.device.capability)):
            if options.mma in ("wgmma", "seesaw"):
                reasons += wgmma_reasons(shape, options)
            elif options.mma == "fp8reg":
                reasons += fp8reg_reasons(shape)
            elif options.mma == "wgmma_t":
                reasons += wgmma_t_reasons(shape)
        return reasons

    @hookimpl
    def limits(self, shape: DecodeShape, options: CuteDslOptions) -> Limits:
        if shape.device.type == "cuda" and sm100.is_sm100(shape.device.capability):
            return sm100.limits(shape)
        return Limits()

    @hookimpl
    def open(self, config: SessionConfig, options: CuteDslOptions) -> Session:
        if config.device.type == "cuda" and sm100.is_sm100(config.device.capability):
            return sm100.Sm100Session(config, options.sm100_workspace_mb)
        return CuteDslSession(config, options)


def combine_variants(shape: DecodeShape, options: CuteDslOptions) -> List[Tuple[bool, int]]:
    """The (wide, cols) combine kernels steps of this shape class may run under option combine: a session builds
    them all at its first plan (auto picks by batch, which may change between eager steps)."""
    from .kernels.schedule import combine_params

    if options.combine == "fused" and fused_merges(shape, options):
        return []  # every step merges in its partial kernel: no combine kernel to build
    kinds = ("wide", "row", "chunked") if options.combine in ("auto", "fused") else (options.combine,)
    return [combine_params(k) for k in kinds]


def fused_merges(shape: DecodeShape, options: CuteDslOptions) -> bool:
    """Whether every step of this shape class merges its splits in the partial kernel under combine=fused: the
    mma.sync kernel (balanced or even entry) runs at every step (not mma=auto's per-step wgmma_t rule) with a
    bf16/fp16 cache at <= 32 packed rows (api.fused_supported decides per launch; this answers for the shape
    class)."""
    return (options.combine == "fused" and partial_kernel(shape, options) == "mma_sync"
            and not _wgmma_t_auto(shape, options) and shape.kv_dtype != "fp8_e4m3"
            and shape.seq_len_q * shape.num_heads <= 32)


def partial_dtype_name(shape: DecodeShape, options: CuteDslOptions) -> str:
    """The partial-O buffer's dtype name for option partials: "fp32", or q's dtype ("bf16"/"fp16"; auto). A
    function of the shape class and options only (the session's workspace, and a CUDA graph's buffers, never
    change dtype between steps; mma=auto's per-step rule only swaps mma_sync and wgmma_t, which write the same
    partial dtype)."""
    return "fp32" if options.partials == "fp32" else shape.q_dtype


def wide_stores(shape: DecodeShape, options: CuteDslOptions) -> bool:
    """Whether the partial kernels of this shape class store 16-bit epilogue rows 16 bytes at a time (option
    stores; auto: wide). A function of the shape class and options only, as the partials dtype: a session's
    schedules carry it (Schedule.wide_store) and a CUDA graph keeps one kernel."""
    return options.stores != "narrow"


def session_sms(device_sms: int, options: CuteDslOptions) -> int:
    """The SM count a session's schedules are made for: option num_sms, or every SM of the GPU (auto)."""
    if options.num_sms == "auto":
        return device_sms
    if options.num_sms > device_sms:
        raise ValueError(f"cute_dsl_mla option num_sms={options.num_sms}: expected at most this GPU's "
                         f"{device_sms} SMs (or 'auto')")
    return options.num_sms


def run_function(kernel: PartialKernel, balanced: bool = False) -> Callable[..., Any]:
    """The host entry (partial kernel + combine, same arguments for all) that runs `kernel`; `balanced`: the
    balanced split-KV entry (mma_sync and wgmma_t under split_kv, the seesaw under seesaw_split; balanced_split
    says when)."""
    if balanced:
        if kernel not in BALANCED_KERNELS + (SEESAW_BALANCED_KERNEL,):
            raise ValueError(f"balanced split-KV is built for the mma_sync and wgmma_t kernels only (split_kv) and "
                             f"the seesaw (seesaw_split), not {kernel}")
        if kernel == SEESAW_BALANCED_KERNEL:
            from .kernels.sm90_wgmma_decode import mla_decode_sm90_wgmma_seesaw_balanced as run_fn
        elif kernel == "wgmma_t":
            from .kernels.sm90_wgmma_t_decode import mla_decode_sm90_wgmma_t_balanced as run_fn
        else:
            from .kernels.api import mla_decode_sm90_balanced as run_fn
    elif kernel == "wgmma":
        from .kernels.sm90_wgmma_decode import mla_decode_sm90_wgmma as run_fn
    elif kernel == "seesaw":
        from .kernels.sm90_wgmma_decode import mla_decode_sm90_wgmma_seesaw as run_fn
    elif kernel == "fp8reg":
        from .kernels.sm90_decode_fp8 import mla_decode_sm90_fp8 as run_fn
    elif kernel == "wgmma_t":
        from .kernels.sm90_wgmma_t_decode import mla_decode_sm90_wgmma_t as run_fn
    else:
        from .kernels.api import mla_decode_sm90 as run_fn
    return run_fn


class CuteDslPlanned(Planned):
    """One step's plan: the buffers its kernels read, the partial kernel it runs (`kernel`, `balanced`) and the
    host entry for them (`run_fn`). A CUDA graph captured around run keeps the kernel of the plan it was
    captured after; a later plan's `kernel` names what an eager run of that plan would launch."""

    __slots__ = ("kv_lens", "page_table", "schedule", "workspace", "lse_scratch", "sm_scale", "kv_scale", "run_fn",
                 "kernel", "balanced")

    def __init__(self, kv_lens: torch.Tensor, page_table: torch.Tensor, schedule: Any, workspace: Any,
                 lse_scratch: Optional[torch.Tensor], sm_scale: float, kv_scale: float,
                 kernel: PartialKernel = "mma_sync", balanced: bool = False, s_accs: int = 1,
                 tma: bool = False, lazy_rescale: bool = False, fp8_producer: bool = False,
                 fp8p_ring: int = 0, fp8p_stage: int = 0, q_prefetch: bool = False,
                 tma_producer: bool = False, wg1_other_first: bool = False) -> None:
        run_fn = run_function(kernel, balanced)
        keywords: dict = {}
        if kernel == "fp8reg" and s_accs != 1:  # fp8reg_s_accs; the entry's default is 0.2.8's 1
            keywords["s_accs"] = s_accs
        if kernel == "seesaw" and tma:  # seesaw_tma; the entry's default is cp.async loads
            keywords["tma"] = True
        if kernel == "seesaw" and lazy_rescale:  # option rescale; the entries' default is eager
            keywords["lazy_rescale"] = True
        if kernel == "seesaw" and fp8_producer:  # option fp8_loader=producer (fp8 cache, the backend's default
            # since 0.2.17); the kernel entry's own default stays inline
            keywords["fp8_producer"] = True
            if fp8p_ring:  # option fp8_loader=ring / ring_staged: the producer's register ring (seesaw_fp8p_ring)
                keywords["fp8p_ring"] = fp8p_ring
            if fp8p_stage:  # fp8_loader=ring_staged: its shared-memory staging (seesaw_fp8p_stage)
                keywords["fp8p_stage"] = fp8p_stage
        if kernel == "seesaw" and balanced and q_prefetch:  # option q_prefetch (balanced seesaw, 16-bit cache)
            keywords["q_prefetch"] = True
        if kernel == "seesaw" and balanced and tma_producer:  # option tma_producer (balanced TMA seesaw, 16-bit)
            keywords["tma_producer"] = True
        if kernel == "seesaw" and wg1_other_first:  # option wg1_other_first (16-bit cache or the fp8 ring)
            keywords["wg1_other_first"] = True
        if keywords:
            run_fn = functools.update_wrapper(functools.partial(run_fn, **keywords), run_fn)
        self.kv_lens, self.page_table, self.schedule, self.workspace = kv_lens, page_table, schedule, workspace
        self.lse_scratch, self.sm_scale, self.kv_scale = lse_scratch, sm_scale, kv_scale
        self.run_fn, self.kernel, self.balanced = run_fn, kernel, balanced

    def run(self, q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor, lse: Optional[torch.Tensor],
            kv_scale: Any = None, q_scale: Any = None) -> None:
        self.run_fn(q, kv_cache, self.page_table, self.kv_lens, self.sm_scale,
                    self.kv_scale if kv_scale is None else kv_scale, out,
                    self.lse_scratch if lse is None else lse, self.schedule, self.workspace, check=False)


class CuteDslSession(Session):
    """One decoder's schedule buffers and workspace per seq_len_q (and, in graph mode, its length/table buffers)."""

    def __init__(self, config: SessionConfig, options: CuteDslOptions) -> None:
        import torch

        self.config, self.options = config, options
        self.device = torch.device("cuda", config.device_index)
        self.num_sms = session_sms(torch.cuda.get_device_properties(self.device).multi_processor_count, options)
        self._schedules: Dict[int, Tuple[Any, Any]] = {}  # s_q -> (schedule, workspace)
        self._lse: Dict[Tuple[int, int], torch.Tensor] = {}
        self._combines: set = set()  # (q dtype, pdl, partial dtype, combine_variants) whose kernels are built
        # (q, kv dtype, block_m, partial dtype) whose two balanced partials (auto's KV-block rule) are built
        self._both_partials: set = set()
        self._described: set = set()  # (shape class, kernel) pairs whose kernel was logged
        env = config.envelope
        self._lens_buf = self._table_buf = None
        if env is not None:
            self._lens_buf = torch.zeros(env.max_batch, dtype=torch.int32, device=self.device)
            self._table_buf = torch.zeros(env.max_batch, env.max_pages(config.page_size), dtype=torch.int32,
                                          device=self.device)

    def _schedule(self, problem: DecodeProblem, lens_host: torch.Tensor) -> Tuple[Any, Any]:
        from .kernels.schedule import alloc_workspace, make_schedule

        s_q, B = problem.seq_len_q, problem.batch_size
        # Everything here is a function of the shape class and the options, never of the step's kernel choice:
        # where mma=auto picks wgmma_t or mma.sync per step (partial_kernel_for, by KV blocks) the schedule is made
        # for the lengths-free answer (mma_sync); both kernels need one CTA per SM (ctas_per_sm: the rule needs
        # ctas_per_sm auto or 1), block_m_for(rows) (32 at 17-32 rows), the balanced format (balanced_split is
        # true for both) and alloc_workspace's buffers, so either kernel runs any schedule plan writes here
        ctas = ctas_per_sm(partial_kernel(problem, self.options), self.options)
        # split_kv=balanced: the hybrid plan (make_schedule picks the form per step into the same buffers)
        balanced = balanced_split(problem, self.options)
        found = self._schedules.get(s_q)
        env = self.config.envelope
        if found is not None and found[0].split_info.shape[0] >= B:
            make_schedule(lens_host, s_q, problem.num_heads, self.num_sms, ctas_per_sm=ctas,
                          device=self.device, out=found[0], balanced=balanced,
                          combine=self.options.combine)  # keeps pdl_combine
            return found
        max_batch = env.max_batch if env is not None else B
        schedule = make_schedule(lens_host, s_q, problem.num_heads, self.num_sms, max_batch=max_batch,
                                 ctas_per_sm=ctas, device=self.device, balanced=balanced,
                                 combine=self.options.combine)
        schedule.pdl_combine = pdl_combine(problem, self.options)
        schedule.wide_store = wide_stores(problem, self.options)
        from .kernels.api import PARTIAL_DTYPES

        partial = PARTIAL_DTYPES[partial_dtype_name(problem, self.options)]
        found = (schedule, alloc_workspace(schedule, device=self.device, partial_dtype=partial))
        self._schedules[s_q] = found
        return found

    def _build_both_partials(self, problem: DecodeProblem) -> None:
        """Both balanced partial kernels of a shape class where mma=auto's KV-block rule applies (wgmma_t from
        WGMMA_T_AUTO_MIN_BLOCKS blocks, mma.sync below), at its first plan: MLADecoder.warmup plans one length
        per shape class (or per batch size in graph mode), so building only the kernel of that step would leave
        the other to compile at the first serving step on the other side of the threshold (the combine kernels
        are built the same way)."""
        from .kernels.schedule import block_m_for

        rows = problem.seq_len_q * problem.num_heads
        key = (problem.q_dtype, problem.kv_dtype, block_m_for(rows), partial_dtype_name(problem, self.options))
        if key in self._both_partials:
            return
        from .kernels.api import get_partial_kernel
        from .kernels.sm90_wgmma_t_decode import get_partial_kernel_wgmma_t_balanced

        # combine=fused: the mma.sync side is the kernel that merges its splits (keyword only when on)
        fused = {"fused": True} if self.options.combine == "fused" else {}
        get_partial_kernel(key[0], key[1], key[2], None, balanced=True, partial=key[3],
                           wide_store=wide_stores(problem, self.options), **fused)
        get_partial_kernel_wgmma_t_balanced(key[0], key[1], key[2], partial=key[3])
        self._both_partials.add(key)

    def plan(self, problem: DecodeProblem, step: StepInputs) -> CuteDslPlanned:
        import torch

        B = problem.batch_size
        pdl = pdl_combine(problem, self.options)
        partial = partial_dtype_name(problem, self.options)
        variants = combine_variants(problem, self.options)
        if (problem.q_dtype, pdl, partial, tuple(variants)) not in self._combines:
            # every combine kernel a step of this shape class may pick (by its batch) now, so that warmup builds
            # them and no step compiles
            from .kernels.api import get_combine_kernel

            for wide, cols in variants:
                get_combine_kernel(problem.q_dtype, wide=wide, pdl=pdl, partial=partial, cols=cols)
            self._combines.add((problem.q_dtype, pdl, partial, tuple(variants)))
        if _wgmma_t_auto(problem, self.options):
            self._build_both_partials(problem)
        schedule, workspace = self._schedule(problem, step.kv_lens_host)
        lens, table = step.kv_lens, step.page_table
        if self._lens_buf is not None:
            width = min(table.shape[1], self._table_buf.shape[1])
            self._lens_buf[:B].copy_(lens, non_blocking=True)
            self._table_buf[:B, :width].copy_(table[:, :width], non_blocking=True)
            lens, table = self._lens_buf[:B], self._table_buf[:B]
        scratch = None
        if not problem.return_lse:  # the kernels always write lse
            key = (B, problem.seq_len_q)
            scratch = self._lse.get(key)
            if scratch is None:
                scratch = self._lse[key] = torch.empty(B, problem.seq_len_q, problem.num_heads,
                                                       dtype=torch.float32, device=self.device)
        # mma=auto's rule may pick another kernel than the previous plan of this batch size did: graph-safe, the
        # schedule, workspace and scratch above are the same whichever runs (see the module docstring)
        blocks = rule_kv_blocks(problem, self.options, step.kv_lens_host)  # counted once per plan
        kernel = partial_kernel(problem, self.options, blocks)  # = partial_kernel_for(problem, options, lengths)
        if (problem.shape, kernel) not in self._described:  # once per shape class and kernel: which, how it splits
            self._described.add((problem.shape, kernel))
            log.debug("cute_dsl_mla: %s runs the %s", problem.describe(),
                      kernel_summary(problem, self.options, blocks))
        return CuteDslPlanned(lens, table, schedule, workspace, scratch, self.config.sm_scale,
                              self.config.kv_scale, kernel=kernel, balanced=balanced_split(problem, self.options),
                              s_accs=fp8reg_s_accs(problem, self.options), tma=seesaw_tma(problem, self.options),
                              lazy_rescale=self.options.rescale == "lazy",
                              fp8_producer=seesaw_fp8_producer(problem, self.options),
                              fp8p_ring=seesaw_fp8p_ring(problem, self.options),
                              fp8p_stage=seesaw_fp8p_stage(problem, self.options),
                              q_prefetch=seesaw_q_prefetch(problem, self.options),
                              tma_producer=seesaw_tma_producer(problem, self.options),
                              wg1_other_first=seesaw_wg1_other_first(problem, self.options))

    def close(self) -> None:
        self._schedules.clear()
        self._lse.clear()
        self._both_partials.clear()
        self._lens_buf = self._table_buf = None


backend = CuteDslBackend()
