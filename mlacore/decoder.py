"""The engine-facing API: plan once per step on the host, run once per layer on the device.

    decoder = MLADecoder(num_heads=16, page_size=64, device="cuda")   # once
    plan = decoder.plan(kv_lens, page_table, seq_len_q=1)              # per step
    out, lse = decoder.run(q, kv_cache, plan)                          # per layer

`plan` builds the `DecodeProblem` from the tensors, asks the dispatcher
(cached) for the backend and lets the backend prepare its metadata.
`run` checks tensor metadata only (no device sync) and calls the chosen
backend's run function, resolved once in `plan`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, Tuple, Union

import torch

from .dispatch import Decision, Dispatcher, default_dispatcher
from .hookspecs import StepInputs
from .policy import Policy
from .problem import KV_LORA_RANK, QK_ROPE_HEAD_DIM, DecodeProblem, DeviceSpec, dtype_name
from .validation import (
    MLAInputError,
    check_lengths_and_table,
    expect_contiguous,
    expect_device,
    expect_dtype,
    expect_rank,
    expect_shape,
    expect_tensor,
)

DEEPSEEK_SM_SCALE = 1.0 / math.sqrt(128 + 64)
_Q_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_KV_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn)


class BackendError(RuntimeError):
    """A backend's plan or run raised; the message names the backend."""


@dataclass(frozen=True)
class DecodePlan:
    """Everything one decode step needs at run time, fixed by `MLADecoder.plan`."""

    problem: DecodeProblem
    decision: Decision
    backend: str
    backend_plan: Any
    run_fn: Callable[..., None]
    max_page_id: int
    q_shape: Tuple[int, int, int, int]
    out_shape: Tuple[int, int, int, int]


class MLADecoder:
    """Decode attention over a paged MLA latent cache, on the backend the policy picks.

    Static facts (heads per rank, page size, dtypes, device, scales) are fixed
    here; per-step facts (lengths, table, seq_len_q) come to `plan`. With
    `cuda_graph=True` backends keep per-batch-size device buffers so that a
    graph captured around `run` stays valid after later plans of the same
    batch size (see docs/engine-guide.md).
    """

    def __init__(
        self,
        num_heads: int,
        page_size: int,
        *,
        q_dtype: torch.dtype = torch.bfloat16,
        kv_dtype: Optional[torch.dtype] = None,
        device: Union[str, torch.device] = "cpu",
        sm_scale: float = DEEPSEEK_SM_SCALE,
        kv_scale: float = 1.0,
        causal: bool = True,
        return_lse: bool = True,
        cuda_graph: bool = False,
        kv_lora_rank: int = KV_LORA_RANK,
        qk_rope_head_dim: int = QK_ROPE_HEAD_DIM,
        policy: Union[Policy, str, None] = None,
        dispatcher: Optional[Dispatcher] = None,
    ) -> None:
        if not isinstance(num_heads, int) or num_heads < 1:
            raise MLAInputError(f"num_heads: expected a positive int, got {num_heads!r}")
        if not isinstance(page_size, int) or page_size < 1:
            raise MLAInputError(f"page_size: expected a positive int, got {page_size!r}")
        kv_dtype = q_dtype if kv_dtype is None else kv_dtype
        if q_dtype not in _Q_DTYPES:
            raise MLAInputError(f"q_dtype: expected bfloat16, float16 or float32, got {q_dtype}")
        if kv_dtype not in _KV_DTYPES:
            raise MLAInputError(f"kv_dtype: expected bfloat16, float16, float32 or float8_e4m3fn, got {kv_dtype}")
        if not (isinstance(sm_scale, (int, float)) and sm_scale > 0 and math.isfinite(sm_scale)):
            raise MLAInputError(f"sm_scale: expected a positive finite float, got {sm_scale!r}")
        if not (isinstance(kv_scale, (int, float)) and kv_scale > 0 and math.isfinite(kv_scale)):
            raise MLAInputError(f"kv_scale: expected a positive finite float, got {kv_scale!r}")
        self.num_heads = num_heads
        self.page_size = page_size
        self.q_dtype = q_dtype
        self.kv_dtype = kv_dtype
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.device_spec = DeviceSpec.of(self.device)
        self.sm_scale = float(sm_scale)
        self.kv_scale = float(kv_scale)
        self.causal = causal
        self.return_lse = return_lse
        self.cuda_graph = cuda_graph
        self.kv_lora_rank = kv_lora_rank
        self.qk_rope_head_dim = qk_rope_head_dim
        self.head_dim_qk = kv_lora_rank + qk_rope_head_dim
        if dispatcher is None:
            if isinstance(policy, str):
                from .policy import load_policy

                policy = load_policy(policy)
            dispatcher = Dispatcher(policy=policy) if policy is not None else default_dispatcher()
        self.dispatcher = dispatcher

    # -- per step ------------------------------------------------------
    def problem_for(self, kv_lens_host: torch.Tensor, seq_len_q: int) -> DecodeProblem:
        batch = int(kv_lens_host.shape[0])
        return DecodeProblem(
            num_heads=self.num_heads,
            seq_len_q=seq_len_q,
            batch_size=batch,
            max_kv_len=int(kv_lens_host.max()) if batch else 0,
            min_kv_len=int(kv_lens_host.min()) if batch else 0,
            page_size=self.page_size,
            q_dtype=dtype_name(self.q_dtype),
            kv_dtype=dtype_name(self.kv_dtype),
            kv_lora_rank=self.kv_lora_rank,
            qk_rope_head_dim=self.qk_rope_head_dim,
            causal=self.causal,
            return_lse=self.return_lse,
            device=self.device_spec,
        )

    def plan(self, kv_lens: torch.Tensor, page_table: torch.Tensor, seq_len_q: int = 1,
             *, kv_lens_host: Optional[torch.Tensor] = None,
             page_table_host: Optional[torch.Tensor] = None,
             num_pages: Optional[int] = None) -> DecodePlan:
        """Host-side work for one step, shared by every layer.

        Pass host copies (`kv_lens_host`, `page_table_host`) when the engine
        has them, and planning never waits for the device.
        """
        expect_tensor("kv_lens", kv_lens)
        expect_tensor("page_table", page_table)
        expect_rank("kv_lens", kv_lens, 1, "[batch]")
        expect_rank("page_table", page_table, 2, "[batch, max_pages]")
        expect_dtype("kv_lens", kv_lens, (torch.int32,))
        expect_dtype("page_table", page_table, (torch.int32,))
        if kv_lens.shape[0] < 1:
            raise MLAInputError("kv_lens: expected at least one request, got an empty batch")
        if page_table.shape[0] != kv_lens.shape[0]:
            raise MLAInputError(
                f"page_table: expected {kv_lens.shape[0]} rows (one per request in kv_lens), "
                f"got shape {tuple(page_table.shape)}"
            )
        if not isinstance(seq_len_q, int) or seq_len_q < 1:
            raise MLAInputError(f"seq_len_q: expected an int >= 1, got {seq_len_q!r}")
        lens_dev = kv_lens if kv_lens.device == self.device else kv_lens.to(self.device)
        table_dev = page_table if page_table.device == self.device else page_table.to(self.device)
        expect_contiguous("page_table", table_dev)
        lens_host = _host(kv_lens if kv_lens_host is None else kv_lens_host, "kv_lens_host", kv_lens)
        table_host = _host(page_table if page_table_host is None else page_table_host,
                           "page_table_host", page_table)
        max_page_id = check_lengths_and_table(lens_host, table_host, self.page_size, num_pages)

        problem = self.problem_for(lens_host, seq_len_q)
        decision = self.dispatcher.select(problem)
        name = decision.backend
        backend = self.dispatcher.backend(name)
        step = StepInputs(kv_lens=lens_dev, page_table=table_dev, kv_lens_host=lens_host,
                          page_table_host=table_host, sm_scale=self.sm_scale, kv_scale=self.kv_scale,
                          owner=self, cuda_graph=self.cuda_graph)
        try:
            backend_plan = backend.hooks["mla_plan"](
                problem=problem, options=decision.options, step=step)
        except MLAInputError:
            raise
        except Exception as exc:
            raise BackendError(f"backend '{name}' failed to plan {problem.describe()}: "
                               f"{type(exc).__name__}: {exc}") from exc
        B, H = problem.batch_size, self.num_heads
        return DecodePlan(problem, decision, name, backend_plan, backend.hooks["mla_run"], max_page_id,
                          q_shape=(B, seq_len_q, H, self.head_dim_qk),
                          out_shape=(B, seq_len_q, H, self.kv_lora_rank))

    # -- per layer -----------------------------------------------------
    def run(self, q: torch.Tensor, kv_cache: torch.Tensor, plan: DecodePlan,
            out: Optional[torch.Tensor] = None,
            lse: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """One layer's decode. Checks metadata only; never synchronizes with the device.

        The checks are one combined test per tensor on the common path; only a
        failing tensor pays for the detailed message.
        """
        if type(plan) is not DecodePlan:
            raise MLAInputError(f"plan: expected a DecodePlan from MLADecoder.plan, got {type(plan).__name__}")
        dev = self.device
        if not (isinstance(q, torch.Tensor) and q.shape == plan.q_shape and q.dtype is self.q_dtype
                and q.device == dev and q.is_contiguous()):
            self._explain_q(q, plan)
        if not (isinstance(kv_cache, torch.Tensor) and kv_cache.dim() == 3
                and kv_cache.shape[1] == self.page_size and kv_cache.shape[2] == self.head_dim_qk
                and kv_cache.dtype is self.kv_dtype and kv_cache.device == dev and kv_cache.is_contiguous()):
            self._explain_cache(kv_cache)
        if plan.max_page_id >= kv_cache.shape[0]:
            raise MLAInputError(f"page_table: page id {plan.max_page_id} is out of range for kv_cache "
                                f"with {kv_cache.shape[0]} pages")
        if out is None:
            out = torch.empty(plan.out_shape, dtype=self.q_dtype, device=dev)
        elif not (isinstance(out, torch.Tensor) and out.shape == plan.out_shape and out.dtype is self.q_dtype
                  and out.device == dev and out.is_contiguous()):
            _check_output("out", out, plan.out_shape, self.q_dtype, dev)
        if lse is None:
            if self.return_lse:
                lse = torch.empty(plan.out_shape[:3], dtype=torch.float32, device=dev)
        elif not self.return_lse:
            raise MLAInputError("lse: this decoder was built with return_lse=False; pass lse=None")
        elif not (isinstance(lse, torch.Tensor) and lse.shape == plan.out_shape[:3]
                  and lse.dtype is torch.float32 and lse.device == dev and lse.is_contiguous()):
            _check_output("lse", lse, plan.out_shape[:3], torch.float32, dev)
        try:
            plan.run_fn(plan.backend_plan, q, kv_cache, out, lse)
        except MLAInputError:
            raise
        except Exception as exc:
            raise BackendError(f"backend '{plan.backend}' failed to run {plan.problem.describe()}: "
                               f"{type(exc).__name__}: {exc}") from exc
        return out, lse

    def _explain_q(self, q: object, plan: DecodePlan) -> None:
        layout = "[batch, seq_len_q, num_heads, 576]"
        q = expect_tensor("q", q)
        expect_rank("q", q, 4, layout)
        if q.shape[1] != plan.problem.seq_len_q:
            raise MLAInputError(f"q: seq_len_q={q.shape[1]} does not match the plan's "
                                f"seq_len_q={plan.problem.seq_len_q}")
        expect_shape("q", q, plan.q_shape, layout)
        expect_dtype("q", q, (self.q_dtype,))
        expect_device("q", q, self.device)
        expect_contiguous("q", q)

    def _explain_cache(self, kv_cache: object) -> None:
        kv_cache = expect_tensor("kv_cache", kv_cache)
        if kv_cache.dim() != 3 or kv_cache.shape[1] != self.page_size or kv_cache.shape[2] != self.head_dim_qk:
            raise MLAInputError(f"kv_cache: expected shape (num_pages, {self.page_size}, {self.head_dim_qk}) "
                                f"[num_pages, page_size, 576], got {tuple(kv_cache.shape)}")
        expect_dtype("kv_cache", kv_cache, (self.kv_dtype,))
        expect_device("kv_cache", kv_cache, self.device)
        expect_contiguous("kv_cache", kv_cache)


def _host(t: torch.Tensor, name: str, like: torch.Tensor) -> torch.Tensor:
    expect_tensor(name, t)
    if t.shape != like.shape:
        raise MLAInputError(f"{name}: expected shape {tuple(like.shape)} (same as the device copy), "
                            f"got {tuple(t.shape)}")
    return t if t.device.type == "cpu" else t.cpu()


def _check_output(name: str, t: torch.Tensor, shape: Tuple[int, ...], dtype: torch.dtype,
                  device: torch.device) -> None:
    expect_tensor(name, t)
    expect_shape(name, t, shape, "")
    expect_dtype(name, t, (dtype,))
    expect_device(name, t, device)
    expect_contiguous(name, t)
