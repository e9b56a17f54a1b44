"""Shared test helpers and the one tolerance table.

Tolerances compare a fast path with the float64 reference in ``ops/reference.py`` evaluated on
*the same input values* (low-precision inputs are upcast exactly), so the only error is the
fast path's own arithmetic, which is float32 for every non-float64 input dtype.
"""

from __future__ import annotations

import pytest
import torch

# input dtype -> (atol, rtol) for KL values / log-probs against the float64 reference.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    # float32 math: each log-softmax entry carries ~eps32·|LSE| ≈ 1.2e-7 × (log V + logit range
    # ≈ 20) ≈ 2.4e-6 of absolute error, and a KL subtracts two of them; 2e-5 leaves a ~4×
    # margin for summation over V ≤ ~1e6 entries. Same bound for bf16/fp16 inputs: they are
    # upcast exactly to float32 before any arithmetic, so their error is float32's.
    torch.float32: (2e-5, 1e-5),
    torch.bfloat16: (2e-5, 1e-5),
    torch.float16: (2e-5, 1e-5),
    # float64 inputs are computed in float64: error ~eps64·20·few ≈ 1e-14; 1e-10 is generous
    # but still ~1e6× tighter than any float32 path could pass.
    torch.float64: (1e-10, 1e-10),
}

# Gradients (with respect to logits, returned in the input dtype): the float32 gradient is
# accurate to ~1e-6 absolute before being rounded to the input dtype; rounding to bf16/fp16
# adds half an ulp relative (2^-8 / 2^-11), hence the larger rtol there.
GRAD_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-5, 1e-4),
    torch.bfloat16: (1e-5, 8e-3),  # 2^-8 = 3.9e-3 relative rounding, ×2 margin
    torch.float16: (1e-5, 1e-3),  # 2^-11 = 4.9e-4 relative rounding, ×2 margin
    torch.float64: (1e-10, 1e-10),
}

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def tol(dtype: torch.dtype) -> dict[str, float]:
    atol, rtol = TOLERANCES[dtype]
    return {"atol": atol, "rtol": rtol}


def grad_tol(dtype: torch.dtype) -> dict[str, float]:
    atol, rtol = GRAD_TOLERANCES[dtype]
    return {"atol": atol, "rtol": rtol}


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
