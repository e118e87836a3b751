"""Moved to `mlacore.testing.inputs` (kept for one release so old imports keep working)."""

from .testing.inputs import *  # noqa: F401,F403
from .testing.inputs import FP8_MAX, DecodeInputs, make_inputs  # noqa: F401
