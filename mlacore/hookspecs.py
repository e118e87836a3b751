"""The plugin surface: what a backend package implements.

A backend is one pluggy plugin (a module or an object) registered under the
entry-point group ``mlacore.backends``; the entry point's name is the
backend's name. mlacore calls each backend's own implementations (never a
broadcast over all plugins), resolving them once so the hot path makes a
plain function call.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import pluggy

PROJECT = "mlacore"
ENTRY_POINT_GROUP = "mlacore.backends"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@dataclass(frozen=True)
class BackendInfo:
    """Static facts a backend states about itself, shown by `mla backends list`.

    `batch_cuts` / `kv_len_cuts` are the values at which the backend's
    can_implement verdict may change (e.g. a kernel that takes at most 8192
    tokens declares 8193). The dispatcher caches decisions per interval
    between cuts, so a verdict that reads batch or length without declaring
    its cuts could be served a stale answer (MLA_DISPATCH_VERIFY=1 detects it).
    """

    description: str = ""
    notes: Tuple[str, ...] = ()
    batch_cuts: Tuple[int, ...] = ()
    kv_len_cuts: Tuple[int, ...] = ()
    # False for backends whose run launches work per request from Python:
    # capturing them in a CUDA graph is legal but pointless, so benches time them eagerly.
    graph_capturable: bool = True


@dataclass(frozen=True)
class Availability:
    """Whether a backend can run in this process at all, with every reason it cannot."""

    available: bool
    reasons: Tuple[str, ...] = ()
    details: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def from_reasons(cls, reasons: Sequence[str], **details: str) -> "Availability":
        return cls(available=not reasons, reasons=tuple(reasons), details=dict(details))


@dataclass(frozen=True)
class StepInputs:
    """Per-step host-side inputs handed to a backend's plan.

    Device tensors are the ones `run` will see; host copies are given so
    that planning never has to synchronize with the device itself.
    """

    kv_lens: Any  # torch.Tensor [B] int32, on the run device
    page_table: Any  # torch.Tensor [B, max_pages] int32, on the run device
    kv_lens_host: Any  # torch.Tensor [B] int32, on the CPU
    page_table_host: Any  # torch.Tensor [B, max_pages] int32, on the CPU
    sm_scale: float
    kv_scale: float
    # The decoder that plans: backends key per-decoder state (wrappers,
    # buffers) on it, weakly. With cuda_graph the engine will capture run()
    # and replay it after later plans of the same batch size, so buffers a
    # captured kernel reads must keep their addresses.
    owner: Any = None
    cuda_graph: bool = False


class MLABackendSpec:
    """Hook specifications; every backend implements all that are not marked optional."""

    @hookspec(firstresult=True)
    def mla_backend_info(self) -> BackendInfo:
        """Describe the backend (optional): text and the shape cuts its verdicts read."""

    @hookspec(firstresult=True)
    def mla_availability(self) -> Availability:
        """Say whether this process can run the backend at all; called once per process."""

    @hookspec(firstresult=True)
    def mla_option_errors(self, options: Dict[str, Any]) -> List[str]:
        """List what is wrong with the policy's options for this backend (optional)."""

    @hookspec(firstresult=True)
    def mla_can_implement(self, problem: Any, options: Dict[str, Any]) -> List[str]:
        """Return every reason the backend cannot compute `problem`; empty means it can."""

    @hookspec(firstresult=True)
    def mla_plan(self, problem: Any, options: Dict[str, Any], step: StepInputs) -> Any:
        """Prepare per-step metadata on the host; the result is passed to every run of the step."""

    @hookspec(firstresult=True)
    def mla_run(self, plan: Any, q: Any, kv_cache: Any, out: Any, lse: Optional[Any]) -> None:
        """Compute one layer's decode into out (and lse when given); no host work, no sync."""


REQUIRED_HOOKS = ("mla_availability", "mla_can_implement", "mla_plan", "mla_run")
OPTIONAL_HOOKS = ("mla_backend_info", "mla_option_errors")
