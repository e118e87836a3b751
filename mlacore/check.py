"""Moved to `mlacore.testing` (kept for one release so old imports keep working)."""

from .testing.compare import *  # noqa: F401,F403
from .testing.compare import check_backend, compare, only_backend_dispatcher, reference_outputs  # noqa: F401
