"""In-process test backends: the reference math behind a configurable verdict."""

from mlacore import Availability, BackendInfo, hookimpl
from mlacore.reference import mla_plan as ref_plan, mla_run as ref_run


class Picky:
    """An in-process backend that refuses problems for which `refuse(problem)` is true."""

    def __init__(self, refuse=lambda p: False, available=True, info=None):
        self.refuse = refuse
        self.available = available
        self.info = info or BackendInfo()
        self.calls = 0

    @hookimpl
    def mla_backend_info(self):
        return self.info

    @hookimpl
    def mla_availability(self):
        return Availability.from_reasons([] if self.available else ["no GPU here"])

    @hookimpl
    def mla_can_implement(self, problem, options):
        self.calls += 1
        return ["refused by predicate"] if self.refuse(problem) else []

    @hookimpl
    def mla_plan(self, problem, options, step):
        return ref_plan(problem=problem, options=options, step=step)

    @hookimpl
    def mla_run(self, plan, q, kv_cache, out, lse):
        ref_run(plan=plan, q=q, kv_cache=kv_cache, out=out, lse=lse)


def register_named_backends(registry, refusals):
    """Register one Picky per name; `refusals[name]` is its refuse predicate (None: takes everything)."""
    for name, refuse in refusals.items():
        registry.register(Picky(refuse=refuse or (lambda p: False)), name)
    return registry
