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


# --- Streaming engine (tests/ops/test_streaming.py): the issue-3 accuracy target -------------
# These are tighter than TOLERANCES above because the streaming engine's form
# (A/s_x + (m_y − m_x) + log(s_y/s_x), no large log-sum-exp subtracted) is more accurate, and
# issue 3 sets 2e-6 nats as its target for float32 inputs.
# Absolute / relative tolerance of a fast path's per-row KL or log-prob against the float64
# reference computed from the *same* (already rounded) input values.
#   float64: same math in float64, only the summation order differs: ~1e-15 relative.
#   float32 (also bf16/fp16 inputs, which are upcast before any exp/log): the streaming form
#     A/s_x + (m_y − m_x) + log(s_y/s_x) loses ~1e-7 relative per term; the target is
#     2e-6 nats on KL for fp32 inputs, so 2e-6 absolute plus 1e-5 relative (for large KL).
VALUE_TOL = {
    torch.float64: dict(atol=1e-12, rtol=1e-10),
    torch.float32: dict(atol=2e-6, rtol=1e-5),
    torch.bfloat16: dict(atol=2e-6, rtol=1e-5),
    torch.float16: dict(atol=2e-6, rtol=1e-5),
}

# Gradients come back in the input's dtype, so they carry that dtype's rounding: half an ulp
# relative (2^-8 for bf16, 2^-11 for fp16, 2^-24 for fp32) of each entry, plus a little float32
# error in the recomputed softmax; expressed relative to the largest gradient entry.
GRAD_REL_TOL = {
    torch.float64: 1e-10,
    torch.float32: 2e-6,
    torch.bfloat16: 2**-7,
    torch.float16: 2**-10,
}


@pytest.fixture
def value_tol():
    return VALUE_TOL


@pytest.fixture
def grad_rel_tol():
    return GRAD_REL_TOL
