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

import itertools
import logging
import math
import os
import threading
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple, Union

import torch

from .backend import GraphEnvelope, Planned, Session, SessionConfig, StepInputs
from .dispatch import Decision, Dispatcher, default_dispatcher
from .errors import BackendError, MLAError, MLAInputError, StalePlanError
from .policy import Policy
from .problem import KV_LORA_RANK, QK_ROPE_HEAD_DIM, DecodeProblem, DecodeShape, DeviceSpec, dtype_name
from .validation import (
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

log = logging.getLogger("mlacore")
_decoder_ids = itertools.count(1)


@dataclass(frozen=True)
class DecodePlan:
    """Everything one decode step needs at run time, fixed by `MLADecoder.plan`.

    A plan knows its decoder and its step number: `run` refuses another
    decoder's plan and any plan older than the decoder's newest.
    """

    problem: DecodeProblem
    decision: Decision
    backend: str
    options: Any
    planned: Planned
    max_page_id: int
    q_shape: Tuple[int, int, int, int]
    out_shape: Tuple[int, int, int, int]
    decoder_id: int
    generation: int
    graph_fixed: bool = False  # the backend was fixed for this batch size by the CUDA-graph envelope


class MLADecoder:
    """Decode attention over a paged MLA latent cache, on the backend the policy picks.

    Static facts (heads per rank, page size, dtypes, device, scales) are fixed
    here; per-step facts (lengths, table, seq_len_q) come to `plan`. The
    decoder owns one backend session per (backend, options) it uses, with
    their workspaces and buffers; `close()` (or a `with` block) frees them.

    With `cuda_graph=True` the capture envelope (`max_batch`, `max_kv_len`)
    is fixed here: buffers are sized from it once, and the backend for each
    (batch size, seq_len_q) is chosen once, for the whole envelope of
    lengths, and kept for the decoder's life. So a graph captured around
    `run` replays correctly after any later plan of that batch size.
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
        kv_scale: Optional[float] = None,
        causal: bool = True,
        return_lse: bool = True,
        cuda_graph: bool = False,
        max_batch: Optional[int] = None,
        max_kv_len: Optional[int] = None,
        kv_lora_rank: int = KV_LORA_RANK,
        qk_rope_head_dim: int = QK_ROPE_HEAD_DIM,
        policy: Union[Policy, str, None] = None,
        dispatcher: Optional[Dispatcher] = None,
    ) -> None:
        _expect_int("num_heads", num_heads, 1)
        _expect_int("page_size", page_size, 1)
        kv_dtype = q_dtype if kv_dtype is None else kv_dtype
        if q_dtype not in _Q_DTYPES:
            raise MLAInputError(f"q_dtype: expected bfloat16, float16 or float32, got {q_dtype}")
        if kv_dtype not in _KV_DTYPES:
            raise MLAInputError(f"kv_dtype: expected bfloat16, float16, float32 or float8_e4m3fn, got {kv_dtype}")
        _expect_scale("sm_scale", sm_scale)
        if kv_scale is None:
            if kv_dtype == torch.float8_e4m3fn:
                raise MLAInputError("kv_scale: an float8_e4m3fn cache needs its dequantization scale "
                                    "(value = stored * kv_scale); pass kv_scale=1.0 if it holds unscaled values")
            kv_scale = 1.0
        _expect_scale("kv_scale", kv_scale)
        for name, flag in (("causal", causal), ("return_lse", return_lse), ("cuda_graph", cuda_graph)):
            if not isinstance(flag, bool):
                raise MLAInputError(f"{name}: expected True or False, got {flag!r}")
        self.num_heads = num_heads
        self.page_size = page_size
        self.q_dtype = q_dtype
        self.kv_dtype = kv_dtype
        self.device = _resolve_device(device)
        self.device_spec = DeviceSpec.of(self.device)
        self.sm_scale = float(sm_scale)
        self.kv_scale = float(kv_scale)
        self.causal = causal
        self.return_lse = return_lse
        self.cuda_graph = cuda_graph
        self.envelope: Optional[GraphEnvelope] = None
        if cuda_graph:
            if max_batch is None or max_kv_len is None:
                raise MLAInputError("cuda_graph=True needs the capture envelope: max_batch and max_kv_len "
                                    "(the largest batch and kv length any plan will have)")
            _expect_int("max_batch", max_batch, 1)
            _expect_int("max_kv_len", max_kv_len, 1)
            self.envelope = GraphEnvelope(max_batch=max_batch, max_kv_len=max_kv_len)
        elif max_batch is not None or max_kv_len is not None:
            raise MLAInputError("max_batch/max_kv_len: the capture envelope is for cuda_graph=True only")
        self.kv_lora_rank = kv_lora_rank
        self.head_dim_qk = kv_lora_rank + qk_rope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        if dispatcher is None:
            if isinstance(policy, (str, os.PathLike)):
                from .policy import load_policy

                policy = load_policy(policy)
            dispatcher = Dispatcher(policy=policy) if policy is not None else default_dispatcher()
        self.dispatcher = dispatcher
        self.session_config = SessionConfig(
            num_heads=num_heads, page_size=page_size, q_dtype=dtype_name(q_dtype),
            kv_dtype=dtype_name(kv_dtype), kv_lora_rank=kv_lora_rank, qk_rope_head_dim=qk_rope_head_dim,
            causal=causal, return_lse=return_lse, sm_scale=self.sm_scale, kv_scale=self.kv_scale,
            device=self.device_spec, device_index=self.device.index or 0, envelope=self.envelope,
        )
        self._sessions: Dict[tuple, Session] = {}
        self._graph_choice: Dict[Tuple[int, int], Decision] = {}
        self._last_choice: Dict[DecodeShape, tuple] = {}
        self._warned_fallback: set = set()
        self._generation = 0
        self._id = next(_decoder_ids)  # not id(self): ids are reused after a decoder is freed
        self._closed = False
        self._lock = threading.Lock()

    # -- lifecycle -----------------------------------------------------
    def close(self) -> None:
        """Close every backend session (frees workspaces and graph buffers); plans become unusable."""
        with self._lock:
            sessions, self._sessions = list(self._sessions.values()), {}
            self._closed = True
            self._generation += 1
        for session in sessions:
            try:
                session.close()
            except Exception as exc:  # a plugin's bug must not stop the others from closing
                log.warning("mlacore: closing a session of %s raised %s", type(session).__name__, exc)

    def __enter__(self) -> "MLADecoder":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _session(self, name: str, options: Any) -> Session:
        key = (name, options)
        session = self._sessions.get(key)
        if session is None:
            session = self.dispatcher.backend(name).open(self.session_config, options)
            self._sessions[key] = session
        return session

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

    def decide(self, problem: DecodeProblem) -> Tuple[Decision, bool]:
        """The decision for a step's problem, and whether it is fixed by the CUDA-graph envelope.

        In graph mode the decision for (batch size, seq_len_q) is made once,
        on the envelope problem (lengths 0..max_kv_len), and kept: a captured
        graph must never replay another backend's metadata.
        """
        if self.envelope is None:
            return self.dispatcher.select(problem), False
        key = (problem.batch_size, problem.seq_len_q)
        decision = self._graph_choice.get(key)
        if decision is None:
            envelope_problem = problem.model_copy(update={"min_kv_len": 0, "max_kv_len": self.envelope.max_kv_len})
            decision = self.dispatcher.select(envelope_problem, cuda_graph=True)
            self._graph_choice[key] = decision
            log.info("mlacore: cuda_graph decoder fixes %s (options %s) for batch %d, seq_len_q %d, "
                     "kv_len 0..%d", decision.backend, decision.options_dict(), key[0], key[1],
                     self.envelope.max_kv_len)
        return decision, True

    def explain(self, batch_size: int, max_kv_len: int, min_kv_len: int = 0, seq_len_q: int = 1) -> str:
        """Every backend's verdict for a step of this decoder, as text (what `plan` would choose)."""
        problem = DecodeProblem(**{**self.problem_for(torch.zeros(1, dtype=torch.int32), seq_len_q)
                                   .model_dump(exclude={"batch_size", "max_kv_len", "min_kv_len"}),
                                   "batch_size": batch_size, "max_kv_len": max_kv_len, "min_kv_len": min_kv_len})
        decision, fixed = self.decide(problem)
        head = f"{problem.describe()} -> {decision.backend} {decision.options_dict()}"
        if fixed:
            head += (f"\n  fixed for batch {batch_size}, seq_len_q {seq_len_q} for this decoder's life "
                     f"(cuda_graph envelope: kv_len 0..{self.envelope.max_kv_len})")
        return head + "\n" + decision.format_trace()

    def _note_choice(self, problem: DecodeProblem, decision: Decision) -> None:
        shape = problem.shape
        choice = (decision.backend, decision.options)
        previous = self._last_choice.get(shape)
        if previous == choice:
            return
        self._last_choice[shape] = choice
        if previous is not None:
            log.info("mlacore: %s now runs on %s %s (was %s %s)", shape.describe(), decision.backend,
                     decision.options_dict(), previous[0],
                     {} if previous[1] is None else previous[1].model_dump(mode="json"))
        if (decision.backend == "reference" and self.device.type == "cuda"
                and shape not in self._warned_fallback):
            self._warned_fallback.add(shape)
            log.warning("mlacore: %s falls back to the pure-torch reference backend on %s (slow); "
                        "`mla backends explain` says why no kernel takes it:\n%s",
                        problem.describe(), self.device, decision.format_trace())

    def plan(self, kv_lens: torch.Tensor, page_table: torch.Tensor, seq_len_q: int = 1,
             *, kv_lens_host: Optional[torch.Tensor] = None,
             page_table_host: Optional[torch.Tensor] = None,
             num_pages: Optional[int] = None) -> DecodePlan:
        """Host-side work for one step, shared by every layer.

        Pass host copies (`kv_lens_host`, `page_table_host`) when the engine
        has them, and planning never waits for the device. A new plan
        replaces the previous one: `run` accepts only the newest.
        """
        if self._closed:
            raise MLAInputError("decoder: this MLADecoder is closed")
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
        if type(seq_len_q) is not int or seq_len_q < 1:
            raise MLAInputError(f"seq_len_q: expected an int >= 1, got {seq_len_q!r}")
        if num_pages is not None and (type(num_pages) is not int or num_pages < 1):
            raise MLAInputError(f"num_pages: expected a positive int (the cache's page count), got {num_pages!r}")
        lens_dev = _to_device("kv_lens", kv_lens, self.device)
        table_dev = _to_device("page_table", page_table, self.device)
        expect_contiguous("page_table", table_dev)
        lens_host = _host(kv_lens if kv_lens_host is None else kv_lens_host, "kv_lens_host", kv_lens)
        table_host = _host(page_table if page_table_host is None else page_table_host,
                           "page_table_host", page_table)
        max_page_id = check_lengths_and_table(lens_host, table_host, self.page_size, num_pages)

        problem = self.problem_for(lens_host, seq_len_q)
        if self.envelope is not None:
            env = self.envelope
            if problem.batch_size > env.max_batch:
                raise MLAInputError(f"kv_lens: batch {problem.batch_size} is larger than the decoder's "
                                    f"cuda_graph envelope max_batch={env.max_batch}")
            if problem.max_kv_len > env.max_kv_len:
                bad = int(torch.argmax(lens_host))
                raise MLAInputError(f"kv_lens: kv_lens[{bad}] = {problem.max_kv_len} is larger than the "
                                    f"decoder's cuda_graph envelope max_kv_len={env.max_kv_len}")
        decision, fixed = self.decide(problem)
        name = decision.backend
        self._note_choice(problem, decision)
        session = self._session(name, decision.options)
        step = StepInputs(kv_lens=lens_dev, page_table=table_dev, kv_lens_host=lens_host,
                          page_table_host=table_host)
        try:
            planned = session.plan(problem, step)
        except MLAError:
            raise
        except Exception as exc:
            raise BackendError(f"backend '{name}' failed to plan {problem.describe()}: "
                               f"{type(exc).__name__}: {exc}") from exc
        if not isinstance(planned, Planned):
            raise BackendError(f"backend '{name}': plan() returned {type(planned).__name__}, expected a "
                               "mlacore.backend.Planned")
        with self._lock:
            self._generation += 1
            generation = self._generation
        B, H = problem.batch_size, self.num_heads
        return DecodePlan(problem, decision, name, decision.options, planned, max_page_id,
                          q_shape=(B, seq_len_q, H, self.head_dim_qk),
                          out_shape=(B, seq_len_q, H, self.kv_lora_rank),
                          decoder_id=self._id, generation=generation, graph_fixed=fixed)

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
        if plan.generation != self._generation or plan.decoder_id != self._id:
            self._explain_stale(plan)
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
            plan.planned.run(q, kv_cache, out, lse)
        except MLAError:
            raise
        except Exception as exc:
            raise BackendError(f"backend '{plan.backend}' failed to run {plan.problem.describe()}: "
                               f"{type(exc).__name__}: {exc}") from exc
        return out, lse

    def _explain_stale(self, plan: DecodePlan) -> None:
        if plan.decoder_id != self._id:
            raise StalePlanError("plan: this plan was made by another MLADecoder; plan with the decoder "
                                 "that runs it (its scales, page size and buffers are the ones used)")
        if self._closed:
            raise StalePlanError("plan: this MLADecoder is closed")
        raise StalePlanError(f"plan: step {plan.generation} was replaced by a later plan() of this decoder "
                             f"(step {self._generation}); run the newest plan")

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
    expect_dtype(name, t, (torch.int32,))
    return t if t.device.type == "cpu" else t.cpu()


def _to_device(name: str, t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if t.device == device:
        return t
    if t.device.type not in ("cpu", "cuda"):
        raise MLAInputError(f"{name}: expected a tensor on cpu or {device}, got one on {t.device}")
    return t.to(device)


def _expect_int(name: str, value: object, minimum: int) -> None:
    if type(value) is not int or value < minimum:
        raise MLAInputError(f"{name}: expected an int >= {minimum}, got {value!r}")


def _expect_scale(name: str, value: object) -> None:
    if type(value) not in (int, float) or not (value > 0 and math.isfinite(value)):
        raise MLAInputError(f"{name}: expected a positive finite float, got {value!r}")


def _resolve_device(device: Union[str, torch.device]) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise MLAInputError(f"device: expected 'cpu', 'cuda' or 'cuda:N', got {device!r} ({err})") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise MLAInputError(f"device: {device!r} was asked for, but torch {torch.__version__} sees no CUDA "
                                "device here")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        elif dev.index >= torch.cuda.device_count():
            raise MLAInputError(f"device: {device!r} does not exist ({torch.cuda.device_count()} CUDA devices)")
    elif dev.type != "cpu":
        raise MLAInputError(f"device: expected cpu or cuda, got {dev.type}")
    return dev


def _check_output(name: str, t: torch.Tensor, shape: Tuple[int, ...], dtype: torch.dtype,
                  device: torch.device) -> None:
    expect_tensor(name, t)
    expect_shape(name, t, shape, "")
    expect_dtype(name, t, (dtype,))
    expect_device(name, t, device)
    expect_contiguous(name, t)
