"""Shared test helpers; the tolerance table itself lives in ``tests/tolerances.py``.

The names tests import from here (TOLERANCES, GRAD_TOLERANCES, DTYPES, tol, grad_tol,
VALUE_TOL, GRAD_REL_TOL) are re-exported from that plain module, which the distributed worker
(a subprocess outside pytest) imports too, so every test uses the one table.
"""

from __future__ import annotations

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
]


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
