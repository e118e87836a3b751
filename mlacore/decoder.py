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
import time
import weakref
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch

from .backend import BackendInfo, GraphEnvelope, Planned, Session, SessionConfig, StepInputs
from .dispatch import Decision, Dispatcher, default_dispatcher
from .errors import BackendError, MLAError, MLAInputError, StalePlanError
from .policy import Policy
from .problem import KV_LORA_RANK, QK_ROPE_HEAD_DIM, DecodeProblem, DecodeShape, DeviceSpec, dtype_name
from .validation import (
    aligned_copy,
    check_lengths_and_table,
    check_output,
    check_run_scale,
    explain_cache,
    explain_q,
    expect_contiguous,
    expect_dtype,
    expect_rank,
    expect_tensor,
    misaligned,
)

DEEPSEEK_SM_SCALE = 1.0 / math.sqrt(128 + 64)
_FP8 = torch.float8_e4m3fn
_Q_DTYPES = (torch.bfloat16, torch.float16, torch.float32, _FP8)
_KV_DTYPES = (torch.bfloat16, torch.float16, torch.float32, _FP8)
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
LAYOUTS = ("packed", "split")
SCALE_INPUTS = ("static", "float", "tensor")
_Tensor = torch.Tensor
_F32 = torch.float32
_weakref = weakref.ref


def _NO_REF() -> None:
    """Stands for a dead or absent weak reference (an lse of None, no pair yet)."""
    return None


log = logging.getLogger("mlacore")
_decoder_ids = itertools.count(1)


@dataclass(frozen=True)
class WarmupEntry:
    """One specialization `MLADecoder.warmup` built, with the seconds its first run took."""

    backend: str
    options: Dict[str, Any]
    batch_size: int
    seq_len_q: int
    kv_len: int
    seconds: float


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
    conversions: Tuple[str, ...] = ()  # what the decoder copies per run for this backend (layouts, strides)


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
        out_dtype: Optional[torch.dtype] = None,
        device: Union[str, torch.device] = "cpu",
        sm_scale: float = DEEPSEEK_SM_SCALE,
        kv_scale: Optional[float] = None,
        q_scale: Optional[float] = None,
        scale_inputs: str = "static",
        q_layout: str = "packed",
        kv_layout: str = "packed",
        causal: bool = True,
        return_lse: bool = True,
        cuda_graph: bool = False,
        max_batch: Optional[int] = None,
        max_kv_len: Optional[int] = None,
        min_kv_len: int = 0,
        kv_lora_rank: int = KV_LORA_RANK,
        qk_rope_head_dim: int = QK_ROPE_HEAD_DIM,
        policy: Union[Policy, str, None] = None,
        dispatcher: Optional[Dispatcher] = None,
    ) -> None:
        _expect_int("num_heads", num_heads, 1)
        _expect_int("page_size", page_size, 1)
        if q_dtype not in _Q_DTYPES:
            raise MLAInputError(f"q_dtype: expected bfloat16, float16, float32 or float8_e4m3fn, got {q_dtype}")
        kv_dtype = (torch.bfloat16 if q_dtype == _FP8 else q_dtype) if kv_dtype is None else kv_dtype
        if kv_dtype not in _KV_DTYPES:
            raise MLAInputError(f"kv_dtype: expected bfloat16, float16, float32 or float8_e4m3fn, got {kv_dtype}")
        if out_dtype is None:
            out_dtype = torch.bfloat16 if q_dtype == _FP8 else q_dtype
        if out_dtype not in _OUT_DTYPES:
            raise MLAInputError(f"out_dtype: expected bfloat16, float16 or float32, got {out_dtype}")
        for name, value, allowed in (("scale_inputs", scale_inputs, SCALE_INPUTS), ("q_layout", q_layout, LAYOUTS),
                                     ("kv_layout", kv_layout, LAYOUTS)):
            if value not in allowed:
                raise MLAInputError(f"{name}: expected one of {', '.join(map(repr, allowed))}, got {value!r}")
        _expect_scale("sm_scale", sm_scale)
        kv_scale = _static_scale("kv_scale", kv_scale, kv_dtype == _FP8, scale_inputs, "cache")
        q_scale = _static_scale("q_scale", q_scale, q_dtype == _FP8, scale_inputs, "query")
        for name, flag in (("causal", causal), ("return_lse", return_lse), ("cuda_graph", cuda_graph)):
            if not isinstance(flag, bool):
                raise MLAInputError(f"{name}: expected True or False, got {flag!r}")
        self.num_heads = num_heads
        self.page_size = page_size
        self.q_dtype = q_dtype
        self.kv_dtype = kv_dtype
        self.out_dtype = out_dtype
        self.device = _resolve_device(device)
        self.device_spec = DeviceSpec.of(self.device)
        self._dev_index = -1 if self.device.type == "cpu" else self.device.index
        self.sm_scale = float(sm_scale)
        self.kv_scale = float(kv_scale)
        self.q_scale = float(q_scale)
        self.scale_inputs = scale_inputs
        self.q_layout = q_layout
        self.kv_layout = kv_layout
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
            _expect_int("min_kv_len", min_kv_len, 0)
            if min_kv_len > max_kv_len:
                raise MLAInputError(f"min_kv_len: {min_kv_len} is larger than max_kv_len={max_kv_len}")
            self.envelope = GraphEnvelope(max_batch=max_batch, max_kv_len=max_kv_len, min_kv_len=min_kv_len)
        elif max_batch is not None or max_kv_len is not None or min_kv_len:
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
        self._fp8_kv = kv_dtype == _FP8
        self._fp8_q = q_dtype == _FP8
        self._sessions: Dict[tuple, Session] = {}
        self._graph_choice: Dict[Tuple[int, int], Decision] = {}
        self._last_choice: Dict[DecodeShape, tuple] = {}
        self._warned_fallback: set = set()
        self._warned_copies: set = set()
        self._generation = 0
        self._id = next(_decoder_ids)  # not id(self): ids are reused after a decoder is freed
        self._closed = False
        self._lock = threading.Lock()
        self._plan: Optional[DecodePlan] = None
        # per-plan run state (the hot path reads plain attributes)
        self._run_fn: Any = None
        self._q_shape: Any = None
        self._qn_shape: Any = None
        self._qp_shape: Any = None
        self._out_shape: Any = None
        self._lse_shape: Any = None
        self._fast: Any = None
        # caches already checked, by id: (weak reference, page count); a cache is checked once, not per call
        self._checked_kv: Dict[int, Tuple[Any, int]] = {}
        # weak references to the (out, lse) pair the last run checked against the current plan: engines pass the
        # same buffers to every layer, so one identity test replaces the checks. Weak: a remembered buffer must
        # not outlive its caller (an engine's op may allocate out inside a CUDA graph pool)
        self._last_buffers: Tuple[Any, Any] = (_NO_REF, _NO_REF)
        self._aligned_strides: Any = None  # the last strided q (q_nope) stride pattern found 16-byte aligned
        self._aligned_strides_pe: Any = None
        self._warned_realign = False

    # -- lifecycle -----------------------------------------------------
    @property
    def handle(self) -> int:
        """This decoder's id, unique in the process (the custom ops name decoders by it)."""
        return self._id

    def current_plan(self) -> DecodePlan:
        """The newest plan (what `mlacore::run` runs)."""
        if self._plan is None:
            raise MLAInputError("plan: this MLADecoder has no current plan; call plan() first"
                                + (" (it is closed)" if self._closed else ""))
        return self._plan

    def warmup(self, batch_sizes: Sequence[int], kv_lens: Sequence[int], seq_lens_q: Sequence[int] = (1,),
               ) -> List[WarmupEntry]:
        """Build every kernel specialization the policy routes this decoder's envelope to, before serving.

        For each (batch size, kv length, seq_len_q) the decision is made as in
        `plan`; each distinct (backend, options, shape class) is planned and run
        once on a tiny synthetic cache (every table slot points at one page),
        so JIT compilation happens here, not in the serving loop. Returns what
        was built and how long each first run took (compilation included).
        """
        entries: List[WarmupEntry] = []
        built: set = set()
        pages = 1
        D, latent = self.head_dim_qk, self.kv_lora_rank
        kv_dtype = self.kv_dtype
        store = torch.float32 if kv_dtype == _FP8 else kv_dtype
        if self.kv_layout == "packed":
            cache: Any = torch.zeros(pages, self.page_size, D, dtype=store, device=self.device).to(kv_dtype)
        else:
            cache = (torch.zeros(pages, self.page_size, latent, dtype=store, device=self.device).to(kv_dtype),
                     torch.zeros(pages, self.page_size, D - latent, dtype=store, device=self.device).to(kv_dtype))
        for s_q in seq_lens_q:
            for B in batch_sizes:
                for L in kv_lens:
                    _expect_int("batch_sizes", B, 1)
                    _expect_int("kv_lens", L, 0)
                    lens = torch.full((B,), L, dtype=torch.int32)
                    table = torch.zeros(B, max(1, -(-L // self.page_size)), dtype=torch.int32)
                    problem = self.problem_for(lens, s_q)
                    decision, _ = self.decide(problem)
                    key = (decision.backend, decision.options, problem.shape, B if self.envelope else None)
                    if key in built:
                        continue
                    built.add(key)
                    start = time.perf_counter()
                    step = self.plan(lens.to(self.device), table.to(self.device), s_q,
                                     kv_lens_host=lens, page_table_host=table, num_pages=pages)
                    q_store = torch.float32 if self.q_dtype == _FP8 else self.q_dtype
                    q: Any = torch.zeros(B, s_q, self.num_heads, D, dtype=q_store, device=self.device)
                    q = q.to(self.q_dtype)
                    if self.q_layout == "split":
                        q = (q[..., :latent], q[..., latent:])
                    scales = {}
                    if self.scale_inputs != "static":
                        one = 1.0 if self.scale_inputs == "float" else torch.ones((), device=self.device)
                        scales = {k: one for k, fp8 in (("kv_scale", self._fp8_kv), ("q_scale", self._fp8_q)) if fp8}
                    self.run(q, cache, step, **scales)
                    if self.device.type == "cuda":
                        torch.cuda.synchronize(self.device)
                    entries.append(WarmupEntry(decision.backend, decision.options_dict(), B, s_q, L,
                                               time.perf_counter() - start))
                    log.info("mlacore: warm-up built %s %s for B=%d s_q=%d kv_len=%d in %.2f s", decision.backend,
                             decision.options_dict(), B, s_q, L, entries[-1].seconds)
        self._plan = None  # warm-up plans are not the engine's
        return entries
    def close(self) -> None:
        """Close every backend session (frees workspaces and graph buffers); plans become unusable."""
        with self._lock:
            sessions, self._sessions = list(self._sessions.values()), {}
            self._closed = True
            self._generation += 1
            self._plan = None
            self._last_buffers = (_NO_REF, _NO_REF)
        for session in sessions:
            try:
                session.close()
            except Exception as exc:  # a plugin's bug must not stop the others from closing
                log.warning("mlacore: closing a session of %s raised %s", type(session).__name__, exc)

    def __enter__(self) -> "MLADecoder":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def session_config(self, q_layout: Optional[str] = None, kv_layout: Optional[str] = None) -> SessionConfig:
        """The static facts a backend session gets (with the layouts its run will receive)."""
        return SessionConfig(
            num_heads=self.num_heads, page_size=self.page_size, q_dtype=dtype_name(self.q_dtype),
            kv_dtype=dtype_name(self.kv_dtype), out_dtype=dtype_name(self.out_dtype),
            kv_lora_rank=self.kv_lora_rank, qk_rope_head_dim=self.qk_rope_head_dim, causal=self.causal,
            return_lse=self.return_lse, sm_scale=self.sm_scale, kv_scale=self.kv_scale, q_scale=self.q_scale,
            scale_inputs=self.scale_inputs, q_layout=q_layout or self.q_layout,
            kv_layout=kv_layout or self.kv_layout, device=self.device_spec,
            device_index=self.device.index or 0, envelope=self.envelope,
        )

    def _layouts_for(self, info: BackendInfo) -> Tuple[str, str, Tuple[str, ...]]:
        """The layouts the backend receives, and what the decoder converts per call to get there."""
        q_layout = self.q_layout if self.q_layout in info.q_layouts else info.q_layouts[0]
        kv_layout = self.kv_layout if self.kv_layout in info.kv_layouts else info.kv_layouts[0]
        conversions = []
        if q_layout != self.q_layout:
            conversions.append(f"q: {self.q_layout} -> {q_layout} (a copy per run)")
        if not info.strided_q:
            conversions.append("q: strided views -> contiguous copies (only when not contiguous)")
        if kv_layout != self.kv_layout:
            conversions.append(f"kv_cache: {self.kv_layout} -> {kv_layout} "
                               + ("(a copy of the whole cache per run)" if kv_layout == "packed" else "(views)"))
        return q_layout, kv_layout, tuple(conversions)

    def _session(self, name: str, options: Any) -> Session:
        key = (name, options)
        session = self._sessions.get(key)
        if session is None:
            q_layout, kv_layout, _ = self._layouts_for(self.dispatcher.backend(name).info())
            session = self.dispatcher.backend(name).open(self.session_config(q_layout, kv_layout), options)
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
            out_dtype=dtype_name(self.out_dtype),
            kv_lora_rank=self.kv_lora_rank,
            qk_rope_head_dim=self.qk_rope_head_dim,
            causal=self.causal,
            return_lse=self.return_lse,
            scale_inputs=self.scale_inputs,
            device=self.device_spec,
        )

    def decide(self, problem: DecodeProblem) -> Tuple[Decision, bool]:
        """The decision for a step's problem, and whether it is fixed by the CUDA-graph envelope.

        In graph mode the decision for (batch size, seq_len_q) is made once,
        on the envelope problem (lengths min_kv_len..max_kv_len), and kept: a captured
        graph must never replay another backend's metadata.
        """
        if self.envelope is None:
            return self.dispatcher.select(problem), False
        key = (problem.batch_size, problem.seq_len_q)
        decision = self._graph_choice.get(key)
        if decision is None:
            envelope_problem = problem.model_copy(update={"min_kv_len": self.envelope.min_kv_len,
                                                          "max_kv_len": self.envelope.max_kv_len})
            decision = self.dispatcher.select(envelope_problem, cuda_graph=True)
            self._graph_choice[key] = decision
            log.info("mlacore: cuda_graph decoder fixes %s (options %s) for batch %d, seq_len_q %d, "
                     "kv_len %d..%d", decision.backend, decision.options_dict(), key[0], key[1],
                     self.envelope.min_kv_len, self.envelope.max_kv_len)
        return decision, True

    def explain(self, batch_size: int, max_kv_len: int, min_kv_len: int = 0, seq_len_q: int = 1) -> str:
        """Every backend's verdict for a step of this decoder, as text (what `plan` would choose)."""
        problem = DecodeProblem(**{**self.problem_for(torch.zeros(1, dtype=torch.int32), seq_len_q)
                                   .model_dump(exclude={"batch_size", "max_kv_len", "min_kv_len"}),
                                   "batch_size": batch_size, "max_kv_len": max_kv_len, "min_kv_len": min_kv_len})
        decision, fixed = self.decide(problem)
        head = f"{problem.describe()} -> {decision.backend} {decision.options_dict()}"
        if decision.backend is not None:
            for conversion in self._layouts_for(self.dispatcher.backend(decision.backend).info())[2]:
                head += f"\n  the decoder converts {conversion}"
        if fixed:
            head += (f"\n  fixed for batch {batch_size}, seq_len_q {seq_len_q} for this decoder's life "
                     f"(cuda_graph envelope: kv_len {self.envelope.min_kv_len}..{self.envelope.max_kv_len})")
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
        lens_dev = _to_device("kv_lens", kv_lens, self.device).contiguous()  # kernels read it as compact [B]
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
            if problem.min_kv_len < env.min_kv_len:
                bad = int(torch.argmin(lens_host))
                raise MLAInputError(f"kv_lens: kv_lens[{bad}] = {problem.min_kv_len} is shorter than the "
                                    f"decoder's cuda_graph envelope min_kv_len={env.min_kv_len}")
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
        info = self.dispatcher.backend(name).info()
        q_layout, kv_layout, conversions = self._layouts_for(info)
        with self._lock:
            self._generation += 1
            generation = self._generation
        B, H = problem.batch_size, self.num_heads
        plan = DecodePlan(problem, decision, name, decision.options, planned, max_page_id,
                          q_shape=(B, seq_len_q, H, self.head_dim_qk),
                          out_shape=(B, seq_len_q, H, self.kv_lora_rank),
                          decoder_id=self._id, generation=generation, graph_fixed=fixed, conversions=conversions)
        # what run reads on every call, fixed here once per plan
        self._run_fn = planned.run
        self._q_shape = tuple(plan.q_shape)
        self._qn_shape = (B, seq_len_q, H, self.kv_lora_rank)
        self._qp_shape = (B, seq_len_q, H, self.qk_rope_head_dim)
        self._out_shape = tuple(plan.out_shape)
        self._lse_shape = tuple(plan.out_shape[:3])
        convert = self._converter(q_layout, kv_layout, info.strided_q, name)
        # a packed q copied inline only where no conversion runs (a conversion makes its own contiguous parts)
        need_contig = not info.strided_q and self.q_layout == "packed" and convert is None
        self._fast = (self._q_shape, self.q_dtype, self._dev_index, self._out_shape, self.out_dtype,
                      self._lse_shape, max_page_id, convert, need_contig, self.scale_inputs != "static",
                      self.q_layout == "packed", self.return_lse)
        self._last_buffers = (_NO_REF, _NO_REF)
        # stride patterns found aligned hold for this plan's shape only (size-1 dimensions are ignored)
        self._aligned_strides = self._aligned_strides_pe = None
        self._plan = plan
        return plan

    def _converter(self, q_layout: str, kv_layout: str, strided_ok: bool, name: str) -> Any:
        """None when the backend takes the engine's inputs as they are; else a function that converts them."""
        conv_q, conv_kv = q_layout != self.q_layout, kv_layout != self.kv_layout
        pack_q, split_q = conv_q and q_layout == "packed", conv_q and q_layout == "split"
        pack_kv, split_kv = conv_kv and kv_layout == "packed", conv_kv and kv_layout == "split"
        latent = self.kv_lora_rank
        if not (conv_q or conv_kv or (not strided_ok and self.q_layout == "split")):
            return None  # a packed q that must be contiguous is handled inline in run
        if pack_kv and name not in self._warned_copies:
            self._warned_copies.add(name)
            log.warning("mlacore: backend '%s' takes a packed cache only; this decoder has kv_layout='split', so "
                        "every run copies the whole cache (build the decoder with kv_layout='packed')", name)

        def convert(q: Any, kv: Any) -> Tuple[Any, Any]:
            if pack_q:
                q = torch.cat(q, dim=-1)
            elif split_q:
                q = (q[..., :latent], q[..., latent:])
            if not strided_ok:
                if isinstance(q, tuple):
                    q = (q[0].contiguous(), q[1].contiguous())
                else:
                    q = q.contiguous()
            if pack_kv:
                kv = torch.cat(kv, dim=-1)
            elif split_kv:
                kv = (kv[..., :latent], kv[..., latent:])
            return q, kv

        return convert

    # -- per layer -----------------------------------------------------
    def run(self, q: Any, kv_cache: Any, plan: DecodePlan, out: Optional[torch.Tensor] = None,
            lse: Optional[torch.Tensor] = None, *, kv_scale: Any = None,
            q_scale: Any = None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """One layer's decode. Checks metadata only; never synchronizes with the device.

        `q`: [B, s_q, H, 576], or (q_nope, q_pe) with q_layout='split'; any
        strides with a contiguous last dimension. `kv_cache`: [P, page, 576],
        or (ckv, kpe) with kv_layout='split'. `kv_scale`/`q_scale`: this
        layer's fp8 scales, with scale_inputs='float' (floats) or 'tensor'
        (0-d device tensors; a captured graph reads their current value).

        The checks are one combined test per tensor on the common path (a
        cache tensor is checked once, then recognised); only a failing input
        pays for the detailed message.
        """
        if plan is not self._plan:
            self._explain_stale(plan)
        # one attribute read for everything the checks compare against (fixed by plan)
        (q_shape, q_dtype, dev, out_shape, out_dtype, lse_shape, max_page_id, convert, need_contig, scaled,
         packed, lse_given) = self._fast
        # dev is get_device()'s answer: -1 on the CPU, the index on CUDA (cheaper than comparing devices)
        if packed:
            if not (isinstance(q, _Tensor) and q.dtype is q_dtype and q.shape == q_shape
                    and q.get_device() == dev and (dev >= 0 or q.is_cpu)):
                self._explain_q(q)
            if q.is_contiguous():
                if q.data_ptr() & 15:  # a contiguous view at an odd offset: kernels load 16-byte vectors
                    q = self._realign(q)
            elif q.stride(-1) != 1:
                self._explain_q(q)
            elif need_contig:  # the backend takes a contiguous q only; engines pass views
                q = q.contiguous()
            elif q.data_ptr() & 15 or (q.stride() != self._aligned_strides and self._strides_misaligned(q)):
                q = self._realign(q)
        else:
            if not (type(q) is tuple and len(q) == 2 and isinstance(q[0], _Tensor) and isinstance(q[1], _Tensor)
                    and q[0].shape == self._qn_shape and q[1].shape == self._qp_shape
                    and q[0].dtype is q_dtype and q[1].dtype is q_dtype and q[0].get_device() == dev
                    and q[1].get_device() == dev and (dev >= 0 or (q[0].is_cpu and q[1].is_cpu))
                    and q[0].stride(-1) == 1 and q[1].stride(-1) == 1):
                self._explain_q(q)
            bad_nope = q[0].data_ptr() & 15 or (q[0].stride() != self._aligned_strides
                                                and self._strides_misaligned(q[0]))
            bad_pe = q[1].data_ptr() & 15 or (q[1].stride() != self._aligned_strides_pe
                                              and self._strides_misaligned(q[1], pe=True))
            if bad_nope or bad_pe:
                q = (self._realign(q[0], "q_nope") if bad_nope else q[0],
                     self._realign(q[1], "q_pe") if bad_pe else q[1])
        seen = self._checked_kv.get(id(kv_cache))
        if seen is None or seen[0]() is not kv_cache:
            pages = self._check_cache(kv_cache)
        else:
            pages = seen[1]
        if max_page_id >= pages:
            raise MLAInputError(f"page_table: page id {max_page_id} is out of range for kv_cache "
                                f"with {pages} pages")
        last_out, last_lse = self._last_buffers
        if last_out() is out and last_lse() is lse and out is not None:
            pass  # the buffers the previous run of this plan checked
        elif (lse_given and isinstance(out, _Tensor) and isinstance(lse, _Tensor) and out.dtype is out_dtype
              and lse.dtype is _F32 and out.shape == out_shape and lse.shape == lse_shape
              and out.get_device() == dev and lse.get_device() == dev and (dev >= 0 or (out.is_cpu and lse.is_cpu))
              and out.is_contiguous() and lse.is_contiguous() and not (out.data_ptr() | lse.data_ptr()) & 15):
            self._last_buffers = (_weakref(out), _weakref(lse))  # a fresh pair (engines slice a buffer per layer)
        else:
            out, lse = self._check_buffers(out, lse, out_shape, out_dtype, lse_shape)
        if scaled or kv_scale is not None or q_scale is not None:
            self._check_scales(kv_scale, q_scale)
        if convert is not None:
            q, kv_cache = convert(q, kv_cache)
        try:
            if kv_scale is None and q_scale is None:
                self._run_fn(q, kv_cache, out, lse)
            else:
                self._run_fn(q, kv_cache, out, lse, kv_scale, q_scale)
        except MLAError:
            raise
        except Exception as exc:
            raise BackendError(f"backend '{plan.backend}' failed to run {plan.problem.describe()}: "
                               f"{type(exc).__name__}: {exc}") from exc
        return out, lse

    def _strides_misaligned(self, t: torch.Tensor, pe: bool = False) -> bool:
        """Stride check of a strided q (split q_nope, or a view of a wider buffer); the last aligned stride
        pattern is remembered, so an engine passing the same kind of view every layer pays one compare."""
        if misaligned(t):
            return True
        if pe:
            self._aligned_strides_pe = t.stride()
        else:
            self._aligned_strides = t.stride()
        return False

    def _realign(self, t: torch.Tensor, name: str = "q") -> torch.Tensor:
        if not self._warned_realign:
            self._warned_realign = True
            log.warning("mlacore: %s is not 16-byte aligned (data pointer offset %d, strides %s of %d-byte "
                        "elements); copying it on every run for the kernels (logged once per decoder)",
                        name, t.data_ptr() % 16, tuple(t.stride()), t.element_size())
        return aligned_copy(t)

    def _check_buffers(self, out: Any, lse: Any, out_shape: tuple, out_dtype: Any, lse_shape: tuple
                       ) -> Tuple[Any, Any]:
        """out/lse: allocated when None, else checked inline (one combined test each: engines often pass a
        fresh slice of a preallocated buffer per layer, so identity alone would not do); only a failing buffer
        pays for the detailed message. A pair the caller gave in full is remembered for the next run's
        identity test (the common engine case: the same two buffers every layer)."""
        dev = self._dev_index
        given_out, given_lse = out is not None, lse is not None
        if out is None:
            out = torch.empty(out_shape, dtype=out_dtype, device=self.device)
        elif not _buffer_ok(out, out_shape, out_dtype, dev):
            check_output("out", out, out_shape, out_dtype, self.device)
        if lse is None:
            if self.return_lse:
                lse = torch.empty(lse_shape, dtype=_F32, device=self.device)
        else:
            if not self.return_lse:
                raise MLAInputError("lse: this decoder was built with return_lse=False; pass lse=None")
            if not _buffer_ok(lse, lse_shape, _F32, dev):
                check_output("lse", lse, lse_shape, _F32, self.device)
        if given_out and (given_lse or not self.return_lse):
            self._last_buffers = (_weakref(out), _NO_REF if lse is None else _weakref(lse))
        return out, lse

    def _check_scales(self, kv_scale: Any, q_scale: Any) -> None:
        mode = self.scale_inputs
        for name, value, fp8, what in (("kv_scale", kv_scale, self._fp8_kv, "cache"),
                                       ("q_scale", q_scale, self._fp8_q, "query")):
            if value is None:
                if mode != "static" and fp8:
                    raise MLAInputError(f"{name}: this decoder has scale_inputs={mode!r} and an fp8 {what}: pass "
                                        "this layer's scale to every run")
                continue
            if not fp8:
                raise MLAInputError(f"{name}: only an fp8 {what} is scaled; this decoder's {what} is not fp8")
            check_run_scale(name, value, mode, self.device)

    def _check_cache(self, kv_cache: Any) -> int:
        """Full check of a cache not seen before; remembers it (weakly) with its page count."""
        explain_cache(kv_cache, self.kv_layout, self.page_size, self.head_dim_qk, self.qk_rope_head_dim,
                      self.kv_dtype, self.device)
        first = kv_cache[0] if isinstance(kv_cache, tuple) else kv_cache
        pages = int(first.shape[0])
        if isinstance(kv_cache, _Tensor):
            if len(self._checked_kv) > 4096:  # engines have one cache per layer; never grow without bound
                self._checked_kv.clear()
            self._checked_kv[id(kv_cache)] = (weakref.ref(kv_cache), pages)
        return pages

    def _explain_stale(self, plan: DecodePlan) -> None:
        if type(plan) is not DecodePlan:
            raise MLAInputError(f"plan: expected a DecodePlan from MLADecoder.plan, got {type(plan).__name__}")
        if plan.decoder_id != self._id:
            raise StalePlanError("plan: this plan was made by another MLADecoder; plan with the decoder "
                                 "that runs it (its scales, page size and buffers are the ones used)")
        if self._closed:
            raise StalePlanError("plan: this MLADecoder is closed")
        raise StalePlanError(f"plan: step {plan.generation} was replaced by a later plan() of this decoder "
                             f"(step {self._generation}); run the newest plan")

    def _explain_q(self, q: object) -> None:
        explain_q(q, self._q_shape, self.q_layout, self.q_dtype, self.device, self.qk_rope_head_dim)
        raise MLAInputError(f"q: not accepted ({type(q).__name__})")  # pragma: no cover - explain_q raised


def _buffer_ok(t: Any, shape: tuple, dtype: torch.dtype, dev: int) -> bool:
    """One combined test of an output buffer (check_output says what is wrong when this fails). run inlines
    the same test for an (out, lse) pair: it is the hot path, where a call costs as much as the test."""
    return (isinstance(t, _Tensor) and t.dtype is dtype and t.shape == shape and t.get_device() == dev
            and (dev >= 0 or t.is_cpu) and t.is_contiguous() and not t.data_ptr() & 15)


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


def _static_scale(name: str, value: Optional[float], fp8: bool, mode: str, what: str) -> float:
    """The decoder's own scale: required for an fp8 tensor in static mode, meaningless otherwise."""
    if value is None:
        if fp8 and mode == "static":
            raise MLAInputError(f"{name}: an fp8 {what} needs its dequantization scale (value = stored * "
                                f"{name}); pass {name}=1.0 if it holds unscaled values, or scale_inputs='float'/"
                                "'tensor' to pass one per run")
        return 1.0
    _expect_scale(name, value)
    if not fp8 and value != 1.0:
        raise MLAInputError(f"{name}: only an fp8 {what} is scaled; got {name}={value!r} for a non-fp8 {what}")
    return float(value)


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
