"""mlacore: run MLA decode on the fastest correct backend for each shape, chosen by policy.

The core imports no GPU library; backends come from installed plugins
(entry-point group ``mlacore.backends``). See `MLADecoder` for the engine API
and `mlacore.backend` for the plugin contract.

Names are imported lazily (PEP 562): `import mlacore.backend` (the plugin
SDK: contract, problem, errors) needs neither torch nor the decoder, and the
`mla` command answers `--help` without importing torch.
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any

# a library logs, the application decides where it goes (engines configure "mlacore")
logging.getLogger("mlacore").addHandler(logging.NullHandler())


_EXPORTS = {
    "mlacore.backend": ("Availability", "Backend", "BackendInfo", "BackendOptions", "GraphEnvelope", "Limits",
                        "NoOptions", "Planned", "Session", "SessionConfig", "StepInputs", "hookimpl"),
    "mlacore.decoder": ("DEEPSEEK_SM_SCALE", "DecodePlan", "MLADecoder"),
    "mlacore.dispatch": ("Decision", "Dispatcher", "Verdict", "default_dispatcher"),
    "mlacore.errors": ("BackendError", "BackendStatus", "MLAError", "MLAInputError", "NoBackendError", "Outcome",
                       "PolicyError", "StalePlanError"),
    "mlacore.policy": ("Policy", "load_policy", "parse_policy", "parse_policy_text"),
    "mlacore.problem": ("DecodeProblem", "DecodeShape", "DeviceSpec"),
    "mlacore.registry": ("BackendRegistry", "get_registry"),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name == "__version__":  # one source: the installed distribution's metadata
        from .versions import distribution_version

        return distribution_version("mlacore")
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'mlacore' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list:
    return sorted(list(globals()) + __all__)


if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs
    from .backend import (Availability, Backend, BackendInfo, BackendOptions, GraphEnvelope, Limits,  # noqa: F401
                          NoOptions, Planned, Session, SessionConfig, StepInputs, hookimpl)
    from .decoder import DEEPSEEK_SM_SCALE, DecodePlan, MLADecoder  # noqa: F401
    from .dispatch import Decision, Dispatcher, Verdict, default_dispatcher  # noqa: F401
    from .errors import (BackendError, BackendStatus, MLAError, MLAInputError, NoBackendError,  # noqa: F401
                         Outcome, PolicyError, StalePlanError)
    from .policy import Policy, load_policy, parse_policy, parse_policy_text  # noqa: F401
    from .problem import DecodeProblem, DecodeShape, DeviceSpec  # noqa: F401
    from .registry import BackendRegistry, get_registry  # noqa: F401
