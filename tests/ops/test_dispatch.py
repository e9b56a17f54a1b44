"""The registry as data: ``"auto"`` and the device checks read each Backend's fields and hooks."""

from __future__ import annotations

import types

import pytest
import torch

from klpenalty.ops import dispatch, streaming
from klpenalty.ops.dispatch import REGISTRY, Backend, get_backend

META = torch.device("meta")


def _fake(runs: bool, available: bool = True, fallback=None):
    notes = []
    module = types.SimpleNamespace(
        available=lambda: available,
        runs_on=lambda device: runs,
        note_fallback=lambda: notes.append(1),
    )
    return Backend("fake", ("meta",), module, fallback=fallback, auto=("meta",)), notes


@pytest.fixture
def registry(monkeypatch):
    """Swap in a registry holding a fake backend for meta tensors."""
    def install(backend):
        monkeypatch.setattr(dispatch, "REGISTRY", {**REGISTRY, backend.name: backend})
    return install


def test_auto_picks_the_backend_naming_the_device_type(registry):
    fake, notes = _fake(runs=True)
    registry(fake)
    assert get_backend("auto", META) is fake
    assert dispatch.device_backends(META) == ["streaming", "fake"]
    assert not notes


def test_auto_passes_over_a_backend_that_cannot_run_and_says_so(registry):
    fake, notes = _fake(runs=False)
    registry(fake)
    assert get_backend("auto", META).module is streaming
    assert dispatch.device_backends(META) == ["streaming"]
    assert notes == [1]


def test_an_unavailable_backend_runs_its_fallback(registry):
    fake, _ = _fake(runs=True, available=False, fallback="streaming")
    registry(fake)
    assert get_backend("fake", META).module is streaming
    assert get_backend("auto", META).module is streaming


def test_a_backend_named_off_its_devices_is_a_value_error(registry):
    fake, _ = _fake(runs=True)
    registry(fake)
    with pytest.raises(ValueError, match="backend 'fake' runs on META tensors only"):
        get_backend("fake", torch.device("cpu"))
    with pytest.raises(ValueError, match="backend must be one of"):
        get_backend("fastest", META)


def test_the_registry_says_where_auto_goes():
    assert REGISTRY["native"].auto == ("cpu",) and REGISTRY["triton"].auto == ("cuda",)
    assert REGISTRY["streaming"].auto == ("*",)
    cpu = get_backend("auto", torch.device("cpu"))
    assert cpu.name == ("native" if REGISTRY["native"].available() else "streaming")
