"""Shared test helpers; the tolerance table itself lives in ``tests/tolerances.py``.

The names tests import from here (TOLERANCES, GRAD_TOLERANCES, DTYPES, tol, grad_tol,
VALUE_TOL, GRAD_REL_TOL) are re-exported from that plain module, which the distributed worker
(a subprocess outside pytest) imports too, so every test uses the one table.
"""

from __future__ import annotations

import contextlib
import importlib
import os

import pytest
import torch

from .tolerances import (
    DTYPES,
    GRAD_REL_TOL,
    GRAD_TOLERANCES,
    TOLERANCES,
    VALUE_TOL,
    grad_tol,
    tol,
)

__all__ = [
    "DTYPES",
    "GRAD_REL_TOL",
    "GRAD_TOLERANCES",
    "TOLERANCES",
    "VALUE_TOL",
    "grad_tol",
    "tol",
    "make_logits",
    "triton_interpreter_env",
]


@contextlib.contextmanager
def triton_interpreter_env():
    """``TRITON_INTERPRET=1`` inside the block where no GPU exists (the previous value restored
    after): Triton's kernels then run in its interpreter, on CPU tensors."""
    before = os.environ.get("TRITON_INTERPRET")
    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = before


# Triton chooses interpreter or compiler when it is first imported (and when each kernel is
# decorated), and torch._dynamo imports it as soon as klpenalty is imported: so the choice is
# made here, before any test module, for tests/ops/test_triton.py. The variable is set only
# around this import and while that module's tests run, never for the other tests.
with triton_interpreter_env():
    try:
        importlib.import_module("klpenalty.ops._triton_jit")
    except ImportError:  # Triton not installed: test_triton.py skips itself
        pass


def make_logits(
    shape: tuple[int, ...], dtype: torch.dtype = torch.float32, *, seed: int = 0, scale: float = 3.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """A policy/reference logits pair: the reference is the policy plus noise (KL ~ 0.1-2)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64) * scale
    y = x + torch.randn(shape, generator=g, dtype=torch.float64) * (scale / 2)
    return x.to(dtype), y.to(dtype)


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
