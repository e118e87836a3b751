"""One error family and the status vocabulary every part of mlacore speaks.

Engines catch `MLAError` to handle anything mlacore raises on purpose; the
subclasses say whose mistake it was (the caller's input, the policy file, no
backend for a shape, or a backend failing), so an engine can decide what to
do without parsing messages. Statuses and verdict outcomes are string enums:
they compare equal to the words `mla backends list` prints and JSON carries.
"""

from __future__ import annotations

from enum import Enum
from typing import Any


class MLAError(Exception):
    """Base of every error mlacore raises on purpose."""


class MLAInputError(MLAError, ValueError):
    """An argument is not what it must be; the message names it (and its index and value)."""


class PolicyError(MLAError, ValueError):
    """A policy file, policy option or environment override is invalid; the message names the key path."""


class NoBackendError(MLAError, RuntimeError):
    """No backend may take the problem and the policy's fallback is 'error'."""

    def __init__(self, decision: Any) -> None:
        self.decision = decision
        super().__init__(
            f"no MLA backend for {decision.problem.describe()}:\n" + decision.format_trace()
        )


class BackendError(MLAError, RuntimeError):
    """A backend's open, plan or run raised; the message names the backend."""


class StalePlanError(MLAInputError):
    """`run` got a plan that is not the newest plan of this decoder, or another decoder's plan."""


class BackendStatus(str, Enum):
    """Where a backend stands in this process, as `mla backends list` shows it."""

    AVAILABLE = "available"
    UNAVAILABLE = "unavailable"
    BROKEN = "broken"
    DISABLED = "disabled"
    REFUSED = "refused"  # a name reserved for another distribution
    NOT_INSTALLED = "not installed"

    def __str__(self) -> str:
        return self.value


class Outcome(str, Enum):
    """A backend's verdict on one problem, in the order the dispatcher applies the stages."""

    CHOSEN = "chosen"
    ACCEPTED = "accepted"  # would take the problem, but an earlier backend was chosen
    NOT_INSTALLED = "not installed"
    UNAVAILABLE = "unavailable"
    CANNOT = "cannot implement"
    LIMIT = "over a limit"
    POLICY = "policy"
    NOT_IN_ORDER = "not in order"

    def __str__(self) -> str:
        return self.value
