"""Backends that hand values of the wrong type back to mlacore, one per way (issue 9).

Each answers every other hook correctly; the registry must mark exactly that
backend broken with a reason naming the hook, and nothing else may notice.
`Availability`, `BackendInfo` and `Limits` are strict pydantic dataclasses, so
building one wrongly raises inside the plugin's hook.

Also two impostors: `reference` (mlacore's oracle; its run writes 42s) and
`cutlass_mla` (a first-party name reserved to the mla-cutlass distribution).
"""

import sys
from typing import Literal

from pydantic import ConfigDict, field_validator

from mlacore import (Availability, Backend, BackendInfo, BackendOptions, Limits, Planned, Session,
                     hookimpl)


class FortyTwo(Planned):
    def run(self, q, kv_cache, out, lse):
        out.fill_(42.0)
        if lse is not None:
            lse.fill_(42.0)


class FortyTwoSession(Session):
    def plan(self, problem, step):
        return FortyTwo()


class _Base(Backend):
    """Correct in every hook (the reference math); each subclass gets one wrong."""

    @hookimpl
    def can_implement(self, shape, options):
        return []

    @hookimpl
    def open(self, config, options):
        from mlacore.reference import ReferenceOptions, backend

        return backend.open(config, ReferenceOptions())


class _Impostor(_Base):
    @hookimpl
    def open(self, config, options):
        return FortyTwoSession()


# -- can_implement -------------------------------------------------------------------------


class CanImplementFalse(_Base):
    name = "wt_can_implement_false"

    @hookimpl
    def can_implement(self, shape, options):
        return False


class CanImplementStr(_Base):
    name = "wt_can_implement_str"

    @hookimpl
    def can_implement(self, shape, options):
        return "needs a GPU"


class CanImplementMixed(_Base):
    name = "wt_can_implement_mixed"

    @hookimpl
    def can_implement(self, shape, options):
        return ["page_size too small", 3]


class CanImplementNone(_Base):
    name = "wt_can_implement_none"

    @hookimpl
    def can_implement(self, shape, options):
        return None


# -- availability --------------------------------------------------------------------------


class AvailabilityReasonsStr(_Base):
    name = "wt_availability_str"

    @hookimpl
    def availability(self):
        return Availability(False, "no GPU here")


class AvailabilityReasonsNone(_Base):
    name = "wt_availability_none"

    @hookimpl
    def availability(self):
        return Availability(False, None)


class AvailabilityFalse(_Base):
    name = "wt_availability_false"

    @hookimpl
    def availability(self):
        return False


class AvailabilityTampered(_Base):
    """Builds a valid Availability, then writes a str into its frozen reasons behind pydantic's back."""

    name = "wt_availability_tampered"

    @hookimpl
    def availability(self):
        got = Availability(False, ("x",))
        object.__setattr__(got, "reasons", "no GPU here")
        return got


# -- info ------------------------------------------------------------------------------------


class InfoNotesNone(_Base):
    name = "wt_info_notes_none"

    @hookimpl
    def info(self):
        return BackendInfo(notes=None)


class InfoKvLenCuts(_Base):
    """Uses a field of the first contract's BackendInfo."""

    name = "wt_info_kv_len_cuts"

    @hookimpl
    def info(self):
        return BackendInfo(kv_len_cuts=None)


class InfoBatchCuts(_Base):
    name = "wt_info_batch_cuts"

    @hookimpl
    def info(self):
        return BackendInfo(batch_cuts=("64",))


class InfoReturnsStr(_Base):
    name = "wt_info_str"

    @hookimpl
    def info(self):
        return "a fast kernel"


# -- limits ----------------------------------------------------------------------------------


class LimitsStr(_Base):
    name = "wt_limits_str"

    @hookimpl
    def limits(self, shape, options):
        return "64"


class LimitsBuiltWrongly(_Base):
    name = "wt_limits_bad"

    @hookimpl
    def limits(self, shape, options):
        return Limits(max_batch="64")


# -- Options ---------------------------------------------------------------------------------


class OptionsNotAModel(_Base):
    name = "wt_options_str"
    Options = "variant"


class RequiredOptions(BackendOptions):
    variant: Literal["a", "b"]  # no default: a policy that does not name it could not be built


class OptionsRequired(_Base):
    name = "wt_options_required"
    Options = RequiredOptions


class MutableOptions(BackendOptions):
    """Mutable and unhashable: verdicts are cached per options, so this cannot work."""

    model_config = ConfigDict(frozen=False)
    __hash__ = None
    variant: str = "a"


class OptionsUnhashable(_Base):
    name = "wt_options_unhashable"
    Options = MutableOptions


class ChattyOptions(BackendOptions):
    variant: str = "a"

    @field_validator("variant")
    @classmethod
    def _known(cls, value):
        if value == "boom":
            raise TypeError("the validator itself has a bug")  # pydantic lets TypeError through
        if value not in ("a", "b"):
            raise ValueError("unknown variant\nknown variants:\n  a\n  b")
        return value


class OptionsMultiline(_Base):
    """A correct backend whose option errors span several lines."""

    name = "wt_options_multiline"
    Options = ChattyOptions


# -- a hook that exits the process ---------------------------------------------------------------


class Exits(_Base):
    name = "wt_exits"

    @hookimpl
    def can_implement(self, shape, options):
        sys.exit(3)


exits = Exits()


# -- impostors ---------------------------------------------------------------------------------


class EvilReference(_Impostor):
    """claims to be mlacore's oracle; its run writes 42s"""

    name = "reference"


class EvilCutlass(_Impostor):
    """claims a first-party name; its run writes 42s"""

    name = "cutlass_mla"


evil_reference = EvilReference()

REGISTERED = (CanImplementFalse, CanImplementStr, CanImplementMixed, CanImplementNone,
              AvailabilityReasonsStr, AvailabilityReasonsNone, AvailabilityFalse, AvailabilityTampered,
              InfoNotesNone, InfoKvLenCuts, InfoBatchCuts, LimitsStr, LimitsBuiltWrongly,
              OptionsNotAModel, OptionsRequired, OptionsUnhashable, OptionsMultiline)


@hookimpl
def mla_register_backends(register):
    for cls in REGISTERED:
        register(cls())
