"""A plugin whose import fails, as one with a missing native library would."""

import mla_test_this_module_does_not_exist  # noqa: F401
