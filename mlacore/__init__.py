"""mlacore: run MLA decode on the fastest correct backend for each shape, chosen by policy.

The core imports no GPU library; backends come from installed plugins
(entry-point group ``mlacore.backends``). See `MLADecoder` for the engine API
and `mlacore.backend` for the plugin contract.
"""

from .backend import (
    Availability,
    Backend,
    BackendInfo,
    BackendOptions,
    GraphEnvelope,
    Limits,
    NoOptions,
    Planned,
    Session,
    SessionConfig,
    StepInputs,
    hookimpl,
)
from .decoder import DEEPSEEK_SM_SCALE, DecodePlan, MLADecoder
from .dispatch import Decision, Dispatcher, Verdict, default_dispatcher
from .errors import (
    BackendError,
    BackendStatus,
    MLAError,
    MLAInputError,
    NoBackendError,
    Outcome,
    PolicyError,
    StalePlanError,
)
from .policy import Policy, load_policy, parse_policy, parse_policy_text
from .problem import DecodeProblem, DecodeShape, DeviceSpec
from .registry import BackendRegistry, get_registry

__version__ = "0.2.0"

__all__ = [
    "Availability", "Backend", "BackendError", "BackendInfo", "BackendOptions", "BackendRegistry",
    "BackendStatus", "DEEPSEEK_SM_SCALE", "Decision", "DecodePlan", "DecodeProblem", "DecodeShape",
    "DeviceSpec", "Dispatcher", "GraphEnvelope", "Limits", "MLADecoder", "MLAError", "MLAInputError",
    "NoBackendError", "NoOptions", "Outcome", "Planned", "PolicyError", "Policy", "Session",
    "SessionConfig", "StalePlanError", "StepInputs", "Verdict", "default_dispatcher", "get_registry",
    "hookimpl", "load_policy", "parse_policy", "parse_policy_text",
]
