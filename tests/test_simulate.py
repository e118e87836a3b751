"""Dispatcher(simulate=DeviceSpec): availability judged for a device this machine does not have.

Only availability is simulated (each backend's `availability_for`); the
capability is an injected input, can_implement and the policy see the
problem as they would on that GPU, and nothing runs.
"""

from typing import List

import pytest

from mlacore import Availability, Backend, BackendRegistry, Dispatcher, parse_policy
from mlacore.backend import hookimpl
from mlacore.problem import DecodeProblem, DeviceSpec

B200 = DeviceSpec(type="cuda", capability=(10, 0))
H200 = DeviceSpec(type="cuda", capability=(9, 0))
CORE_ONLY = {"MLA_DISABLE_PLUGIN_AUTOLOAD": "1"}


class _Base(Backend):
    def can_implement(self, shape, options) -> List[str]:
        return [] if shape.device.capability == (10, 0) else [f"{shape.device}: sm_100 only"]

    def open(self, config, options):
        raise NotImplementedError("never opened: simulation runs nothing")


class Blackwellish(_Base):
    """Here: no GPU. For a simulated device: available on sm_100 only."""

    name = "blackwellish"

    def availability(self) -> Availability:
        return Availability(False, ("no CUDA device visible",))

    def availability_for(self, device) -> Availability:
        if device.capability == (10, 0):
            return Availability(True, details={"simulated": str(device)})
        return Availability(False, (f"{device}: needs sm_100",))


class Silent(_Base):
    """Probes the real GPU but says nothing about simulated ones: cannot be judged."""

    name = "silent"

    def availability(self) -> Availability:
        return Availability(False, ("no CUDA device visible",))


class Anywhere(_Base):
    """Keeps the default availability (always available): available on any simulated device too."""

    name = "anywhere"


class Breaks(_Base):
    name = "breaks"

    def availability_for(self, device) -> Availability:
        raise RuntimeError("boom")


def registry(*backends):
    reg = BackendRegistry(env=dict(CORE_ONLY)).load()
    for b in backends:
        reg.register(b)
    return reg


def problem(device=B200):
    return DecodeProblem(num_heads=16, batch_size=2, max_kv_len=100, min_kv_len=1, page_size=64, device=device)


def dispatcher(reg, order, simulate=None):
    return Dispatcher(policy=parse_policy({"mla": {"order": order}}), registry=reg, env={}, simulate=simulate)


def test_without_simulation_the_real_availability_decides():
    reg = registry(Blackwellish())
    dec = dispatcher(reg, ["blackwellish", "reference"]).explain(problem())
    assert dec.backend == "reference"
    assert dec.verdict("blackwellish").reasons == ("unavailable", "no CUDA device visible")


def test_simulated_sm100_uses_availability_for_and_still_asks_can_implement():
    reg = registry(Blackwellish())
    dec = dispatcher(reg, ["blackwellish", "reference"], simulate=B200).explain(problem())
    assert dec.backend == "blackwellish"
    hopper = dispatcher(reg, ["blackwellish", "reference"], simulate=H200).explain(problem(H200))
    v = hopper.verdict("blackwellish")
    assert v.outcome == "unavailable"
    assert v.reasons == ("unavailable on cuda:sm_90 (simulated)", "cuda:sm_90: needs sm_100")
    assert hopper.backend == "reference"  # the oracle answers for any simulated device


def test_default_availability_for():
    reg = registry(Silent(), Anywhere())
    dec = dispatcher(reg, ["silent", "anywhere", "reference"], simulate=B200).explain(problem())
    assert dec.verdict("silent").outcome == "unavailable"
    assert ("backend 'silent' does not implement availability_for(device): its availability on cuda:sm_100 "
            "cannot be judged without that GPU") in dec.verdict("silent").reasons
    assert dec.backend == "anywhere"


def test_a_raising_availability_for_marks_the_backend_broken_not_the_dispatcher():
    reg = registry(Breaks())
    dec = dispatcher(reg, ["breaks", "reference"], simulate=B200).explain(problem())
    v = dec.verdict("breaks")
    assert v.outcome == "unavailable" and v.reasons[0] == "broken on cuda:sm_100 (simulated)"
    assert "availability_for() raised RuntimeError: boom" in v.reasons[1]
    assert dec.backend == "reference"


def test_simulate_takes_a_device_spec():
    with pytest.raises(TypeError, match="simulate: expected a mlacore.DeviceSpec, got tuple"):
        Dispatcher(policy=parse_policy({"mla": {"order": ["reference"]}}), registry=registry(), env={},
                   simulate=(10, 0))


def test_answers_are_kept_per_device():
    calls = []

    class Counting(Blackwellish):
        name = "counting"

        def availability_for(self, device):
            calls.append(device)
            return super().availability_for(device)

    reg = registry(Counting())
    handle = reg.get("counting")
    for _ in range(3):
        handle.availability_for(B200)
        handle.availability_for(H200)
    assert calls == [B200, H200]
