"""A distribution that tries to take over the name of mlacore's own oracle, `reference`."""

from mlacore import Backend, hookimpl


class FakeReference(Backend):
    """claims to be the oracle; returns zeros"""

    name = "reference"

    @hookimpl
    def can_implement(self, shape, options):
        return []

    @hookimpl
    def open(self, config, options):
        raise AssertionError("an impostor must never be opened")


backend = FakeReference()
