"""mlacore: run MLA decode on the fastest correct backend for each shape, chosen by policy.

The core imports no GPU library; backends come from installed plugins
(entry-point group ``mlacore.backends``). See `MLADecoder` for the engine API.
"""

from .decoder import DEEPSEEK_SM_SCALE, BackendError, DecodePlan, MLADecoder
from .dispatch import Decision, Dispatcher, NoBackendError, Verdict, default_dispatcher
from .hookspecs import Availability, BackendInfo, StepInputs, hookimpl
from .plugins import BackendRegistry, get_registry
from .policy import Policy, PolicyError, load_policy, parse_policy, parse_policy_text
from .problem import DecodeProblem, DeviceSpec
from .validation import MLAInputError

__version__ = "0.1.0"

__all__ = [
    "Availability", "BackendError", "BackendInfo", "BackendRegistry", "DEEPSEEK_SM_SCALE", "Decision",
    "DecodePlan", "DecodeProblem", "DeviceSpec", "Dispatcher", "MLADecoder", "MLAInputError",
    "NoBackendError", "Policy", "PolicyError", "StepInputs", "Verdict", "default_dispatcher",
    "get_registry", "hookimpl", "load_policy", "parse_policy", "parse_policy_text",
]
