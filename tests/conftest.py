"""pytest fixtures and the Triton interpreter choice; the helpers tests import live in
``tests/helpers.py`` and the tolerance table in ``tests/tolerances.py``."""

from __future__ import annotations

import importlib
import os

import pytest
import torch

from .triton_env import triton_interpreter_env
from .tolerances import GRAD_REL_TOL, VALUE_TOL

# Triton chooses interpreter or compiler when it is first imported (and when each kernel is
# decorated), and torch._dynamo imports it as soon as klpenalty is imported: so the choice is
# made here, before any test module, for tests/ops/test_triton.py. The variable is set only
# around this import and while that module's tests run, never for the other tests.
with triton_interpreter_env():
    try:
        importlib.import_module("klpenalty.ops.triton._load")._kernels()  # imports the kernel modules
    except ImportError:  # Triton not installed: test_triton.py skips itself
        pass


# Under pytest-xdist (`make test` runs several processes) each process gets its share of the
# cores, so that the processes' torch threads do not oversubscribe the machine.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(
        max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    )


@pytest.fixture(autouse=True)
def _deterministic_seed():
    torch.manual_seed(0)
    yield


@pytest.fixture
def value_tol():
    return VALUE_TOL


@pytest.fixture
def grad_rel_tol():
    return GRAD_REL_TOL
