"""Shared test settings: the tolerance table (one place, with the reason for each entry)."""

from __future__ import annotations

import pytest
import torch

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
