"""Plugins with bugs: a raising availability, a raising can_implement, a missing hook."""

from mlacore import Availability, hookimpl


class MissingRun:
    """Implements everything but mla_run."""

    @hookimpl
    def mla_availability(self):
        return Availability(True)

    @hookimpl
    def mla_can_implement(self, problem, options):
        return []

    @hookimpl
    def mla_plan(self, problem, options, step):
        return None


class CanImplementRaises(MissingRun):
    @hookimpl
    def mla_can_implement(self, problem, options):
        raise ZeroDivisionError("bad shape math")

    @hookimpl
    def mla_run(self, plan, q, kv_cache, out, lse):
        raise AssertionError("never chosen")


class AvailabilityRaises(CanImplementRaises):
    @hookimpl
    def mla_availability(self):
        raise RuntimeError("driver query exploded")


# entry points name instances: pluggy calls hook implementations on the object
availability_raises = AvailabilityRaises()
can_implement_raises = CanImplementRaises()
missing_run = MissingRun()
