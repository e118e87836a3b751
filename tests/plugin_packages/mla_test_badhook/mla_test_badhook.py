"""Backends with bugs, one per way a plugin can get the contract wrong.

Entry points name Backend objects and Backend classes (both are accepted).
"""

from mlacore import Availability, Backend, hookimpl


class _Base(Backend):
    """Implements the contract correctly; each subclass breaks one thing."""

    @hookimpl
    def can_implement(self, shape, options):
        return []

    @hookimpl
    def open(self, config, options):
        raise AssertionError("never chosen")


class AvailabilityRaises(_Base):
    name = "raises_in_availability"

    @hookimpl
    def availability(self):
        raise RuntimeError("driver query exploded")


class CanImplementRaises(_Base):
    name = "raises_in_can_implement"

    @hookimpl
    def can_implement(self, shape, options):
        raise ZeroDivisionError("bad shape math")


class MissingOpen(Backend):
    """Implements everything but open."""

    name = "missing_open"

    @hookimpl
    def can_implement(self, shape, options):
        return []


class CanImplementReturnsFalse(_Base):
    """Answers a yes/no question instead of giving reasons."""

    name = "can_implement_false"

    @hookimpl
    def can_implement(self, shape, options):
        return False


class AvailabilityBuiltWrongly(_Base):
    """Passes a string where the reasons tuple goes: the Availability constructor raises."""

    name = "bad_availability"

    @hookimpl
    def availability(self):
        return Availability(False, "no GPU here")


# entry points name objects and classes: the registry takes both
availability_raises = AvailabilityRaises()
can_implement_raises = CanImplementRaises()
missing_open = MissingOpen()
