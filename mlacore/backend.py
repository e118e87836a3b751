"""The plugin contract (v2): what a backend package implements, as typed objects.

A backend is an object (a subclass of `Backend`) registered with pluggy under
its `name`. Its lifecycle has an owner at every step::

    backend.availability()                 once per process, every reason
    backend.availability_for(device)       optional: the same, judged for a simulated device
    backend.can_implement(shape, options)  every reason; sees only the shape class
    backend.limits(shape, options)         batch / kv-length limits, as data
    session = backend.open(config, options)  once per MLADecoder: owns buffers
    planned = session.plan(problem, step)  once per step, host side
    planned.run(q, kv_cache, out, lse)     per layer, device side, no sync

Why these seams:

* `can_implement` sees a `DecodeShape` (no batch size, no lengths), and the
  batch and length limits come back as `Limits` that the core evaluates. The
  dispatcher caches verdicts on the shape alone, so a cached verdict can
  never be stale for another batch size: exact by construction.
* Options are a pydantic model per backend (`extra="forbid"`, frozen): a
  policy's options are validated when the dispatcher is built and reach the
  backend typed; a typo is a `PolicyError` naming the key path.
* Per-decoder state (workspaces, CUDA-graph buffers, wrappers) lives in the
  `Session` the decoder owns and closes; a backend module holds no state.
* `Planned.run` is the hot path: the decoder calls it directly, with no
  iteration over plugins and no re-validation.

Every value a backend hands back is checked at this boundary (the registry
does it); a wrong type marks the backend broken with the reason, and nothing
else notices.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, ClassVar, Dict, List, Optional, Sequence, Tuple, Type

import pluggy
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr
from pydantic.dataclasses import dataclass as checked_dataclass

from .problem import DecodeProblem, DecodeShape, DeviceSpec

PROJECT = "mlacore"
ENTRY_POINT_GROUP = "mlacore.backends"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

_STRICT = ConfigDict(strict=True, extra="forbid")


@checked_dataclass(frozen=True, config=_STRICT)
class Availability:
    """Whether a backend can run in this process at all, with every reason it cannot."""

    available: StrictBool
    reasons: Tuple[StrictStr, ...] = ()
    details: Dict[StrictStr, StrictStr] = field(default_factory=dict)

    @classmethod
    def from_reasons(cls, reasons: Sequence[str], **details: str) -> "Availability":
        return cls(available=not reasons, reasons=tuple(reasons), details=dict(details))


@checked_dataclass(frozen=True, config=_STRICT)
class BackendInfo:
    """Static facts a backend states about itself, shown by `mla backends list`.

    `verified` lists what was checked on real hardware; anything else a
    backend can run says "not verified on hardware" in `notes`.
    """

    description: StrictStr = ""
    notes: Tuple[StrictStr, ...] = ()
    # False for backends whose run does host work per call: capturing them in
    # a CUDA graph would freeze that work, so graph-mode decoders pass them over.
    graph_capturable: StrictBool = True
    # Input layouts `Planned.run` takes without a copy: "packed" (one 576-wide
    # tensor) and/or "split" ((q_nope, q_pe) / (ckv, kpe)). For any other, the
    # decoder converts (a copy per call) and `explain` says so.
    q_layouts: Tuple[StrictStr, ...] = ("packed",)
    kv_layouts: Tuple[StrictStr, ...] = ("packed",)
    # True: q tensors may have any strides but a contiguous last dimension
    # (the views engines produce); False: the decoder hands over contiguous copies.
    strided_q: StrictBool = False


@checked_dataclass(frozen=True, config=_STRICT)
class Limits:
    """Batch and kv-length limits of a backend for one shape class, as data the core evaluates.

    `why` says where a limit comes from ("FlashInfer's scheduler takes at most
    16384 work items, 2 per request here"); the core puts it in the verdict.
    `min_kv_len=1` refuses zero-length requests.
    """

    max_batch: Optional[StrictInt] = None
    max_kv_len: Optional[StrictInt] = None
    min_kv_len: StrictInt = 0
    why: StrictStr = ""

    def reasons(self, problem: DecodeProblem) -> List[str]:
        """Why `problem` is outside these limits (empty: inside)."""
        out: List[str] = []
        why = f" ({self.why})" if self.why else ""
        if self.max_batch is not None and problem.batch_size > self.max_batch:
            out.append(f"batch={problem.batch_size} > max_batch={self.max_batch}{why}")
        if self.max_kv_len is not None and problem.max_kv_len > self.max_kv_len:
            out.append(f"max_kv_len={problem.max_kv_len} > the backend's max_kv_len={self.max_kv_len}{why}")
        if problem.min_kv_len < self.min_kv_len:
            out.append(f"min_kv_len={problem.min_kv_len} < the backend's min_kv_len={self.min_kv_len}{why}")
        return out


NO_LIMITS = Limits()


class BackendOptions(BaseModel):
    """Base of every backend's options: strict, frozen, unknown keys are errors.

    A backend declares `class Options(mlacore.BackendOptions): variant: Literal[...] = "auto"`
    and sets it as the `Options` class attribute. Instances are hashable, so
    verdicts can be cached per (shape, options).
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class NoOptions(BackendOptions):
    """A backend that takes no options."""


class GraphEnvelope(BaseModel):
    """The largest step a CUDA-graph decoder will plan; buffers are sized from it, once."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    max_batch: int = Field(ge=1)
    max_kv_len: int = Field(ge=1)
    # the shortest length any request will have: 0 (the default) when the engine pads
    # batches with empty requests; 1 or more lets backends that refuse empty requests take part
    min_kv_len: int = Field(default=0, ge=0)

    def max_pages(self, page_size: int) -> int:
        return -(-self.max_kv_len // page_size)


class SessionConfig(BaseModel):
    """The static facts of one `MLADecoder`, handed to `Backend.open`."""

    model_config = ConfigDict(extra="forbid", frozen=True, arbitrary_types_allowed=True)

    num_heads: int
    page_size: int
    q_dtype: str
    kv_dtype: str
    out_dtype: str
    kv_lora_rank: int
    qk_rope_head_dim: int
    causal: bool
    return_lse: bool
    sm_scale: float
    kv_scale: float  # fp8 caches: value = stored * kv_scale (the default when run gets none)
    q_scale: float  # fp8 queries: value = stored * q_scale
    scale_inputs: str = "static"
    q_layout: str = "packed"  # what Planned.run receives (after any conversion by the decoder)
    kv_layout: str = "packed"
    device: DeviceSpec
    device_index: int = 0
    envelope: Optional[GraphEnvelope] = None  # set: CUDA-graph mode

    @property
    def cuda_graph(self) -> bool:
        return self.envelope is not None


@dataclass(frozen=True)
class StepInputs:
    """Per-step inputs handed to `Session.plan`.

    Device tensors are the engine's; host copies are given so that planning
    never synchronizes with the device. In CUDA-graph mode a session must
    copy what a captured kernel reads into buffers it owns (sized from the
    envelope), because replays read those addresses after later plans.
    """

    kv_lens: Any  # torch.Tensor [B] int32, on the run device
    page_table: Any  # torch.Tensor [B, max_pages] int32, on the run device
    kv_lens_host: Any  # torch.Tensor [B] int32, on the CPU
    page_table_host: Any  # torch.Tensor [B, max_pages] int32, on the CPU


class Planned(abc.ABC):
    """One step's plan of one backend: runs itself once per layer.

    `q` is a tensor [B, s_q, H, 576] or a pair (q_nope [.., 512], q_pe [.., 64])
    and `kv_cache` a tensor [P, page, 576] or a pair (ckv, kpe), as the
    session's config says (`q_layout`, `kv_layout`). `kv_scale`/`q_scale` are
    None (use the config's) or, with `scale_inputs` "float"/"tensor", this
    layer's scale as a float or a 0-d device tensor (never read on the host).
    """

    @abc.abstractmethod
    def run(self, q: Any, kv_cache: Any, out: Any, lse: Optional[Any],
            kv_scale: Any = None, q_scale: Any = None) -> None:
        """Compute one layer's decode into out (and lse when given); no host work, no sync."""


class Session(abc.ABC):
    """A backend's state for one decoder: workspaces, wrappers, CUDA-graph buffers."""

    @abc.abstractmethod
    def plan(self, problem: DecodeProblem, step: StepInputs) -> Planned:
        """Host-side work for one step, shared by every layer."""

    def close(self) -> None:
        """Free what the session holds (the decoder calls it once, when it is closed)."""


class BackendSpec:
    """pluggy hook specifications: the methods of a backend object, plus plugin registration."""

    @hookspec(historic=True)
    def mla_register_backends(self, register: Any) -> None:
        """Register this plugin's backends: call `register(backend)` once per Backend object."""

    @hookspec(firstresult=True)
    def availability(self) -> Availability:
        """Whether this process can run the backend at all; asked once per process."""

    @hookspec(firstresult=True)
    def availability_for(self, device: DeviceSpec) -> Availability:
        """Whether the backend would be available on `device` with the installed packages; no GPU probe."""

    @hookspec(firstresult=True)
    def info(self) -> BackendInfo:
        """Describe the backend for `mla backends list`."""

    @hookspec(firstresult=True)
    def can_implement(self, shape: DecodeShape, options: BackendOptions) -> List[str]:
        """Every reason the backend cannot compute this shape class; empty means it can."""

    @hookspec(firstresult=True)
    def limits(self, shape: DecodeShape, options: BackendOptions) -> Limits:
        """Batch and kv-length limits for this shape class, as data."""

    @hookspec(firstresult=True)
    def open(self, config: SessionConfig, options: BackendOptions) -> Session:
        """A session for one decoder; it owns every buffer the backend needs."""


HOOK_NAMES = ("availability", "availability_for", "info", "can_implement", "limits", "open")


class Backend:
    """Base class of every backend object. Subclasses set `name` and override the hooks.

    `can_implement` and `open` must be implemented; `availability` (always
    available), `availability_for`, `info` and `limits` (none) have defaults. The methods are pluggy hook implementations (the
    markers are inherited), registered under the backend's name.
    """

    name: ClassVar[str] = ""
    Options: ClassVar[Type[BackendOptions]] = NoOptions

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Mark overridden hook methods as hook implementations, so the marker is truly inherited.

        Without this, `def can_implement(...)` without `@hookimpl` in a subclass
        would be invisible to pluggy and the backend would silently say yes.
        """
        super().__init_subclass__(**kwargs)
        for hook in HOOK_NAMES:
            fn = cls.__dict__.get(hook)
            if callable(fn) and not hasattr(fn, f"{PROJECT}_impl"):
                setattr(cls, hook, hookimpl(fn))

    @hookimpl
    def availability(self) -> Availability:
        return Availability(True)

    @hookimpl
    def availability_for(self, device: DeviceSpec) -> Availability:
        """Availability on a device this process does not have (`mla backends explain --capability`).

        Why a separate hook: `availability()` probes the GPU that is here, so a
        laptop could never review what a B200 would pick. A GPU backend
        overrides this with its library-installed checks and its rules for
        `device.capability`, and never touches a GPU. The default answers only
        what it can know: a backend that keeps the default `availability()`
        (always available) is available anywhere; any other cannot be judged.
        """
        if type(self).availability is Backend.availability:
            return Availability(True)
        return Availability(False, (f"backend '{self.name}' does not implement availability_for(device): its "
                                    f"availability on {device} cannot be judged without that GPU",))

    @hookimpl
    def info(self) -> BackendInfo:
        return BackendInfo(description=(type(self).__doc__ or "").strip().splitlines()[0]
                           if type(self).__doc__ else "")

    @hookimpl
    def can_implement(self, shape: DecodeShape, options: BackendOptions) -> List[str]:
        raise NotImplementedError(f"{type(self).__name__} does not implement can_implement")

    @hookimpl
    def limits(self, shape: DecodeShape, options: BackendOptions) -> Limits:
        return NO_LIMITS

    @hookimpl
    def open(self, config: SessionConfig, options: BackendOptions) -> Session:
        raise NotImplementedError(f"{type(self).__name__} does not implement open")
