"""The one tolerance table of the test suite, with the reason for each entry.

A plain module (no pytest import): ``tests/conftest.py`` re-exports it for the pytest tests, and
the distributed worker (``tests/distributed/worker.py``, run in subprocesses outside pytest)
imports it directly.

What the entries bound: a fast path against the float64 reference in ``ops/reference.py``
evaluated on *the same input values* (low-precision inputs are upcast exactly), so the only
error is the fast path's own arithmetic, which is float32 for every non-float64 input dtype.
The same entries bound two such fast paths against each other (e.g. the vocabulary-parallel
float32 KL against the single-process float32 one): each carries the same few float32 ulps of
error per term, far inside the entry, so no separate, looser entry is needed.

Tables are keyed by the *input* dtype.
"""

from __future__ import annotations

import torch

__all__ = [
    "DTYPES",
    "TOLERANCES",
    "GRAD_TOLERANCES",
    "VALUE_TOL",
    "GRAD_REL_TOL",
    "tol",
    "grad_tol",
]

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]

# input dtype -> (atol, rtol) for KL values / log-probs (and other values computed in the
# same precision, such as means).
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    # float32 math. Every backend avoids subtracting two large log-sum-exps (max-shifted
    # log-softmax, or A/s_x + (m_y − m_x) + log(s_y/s_x)), so each term carries ~1e-7 relative
    # error and the KL ~1e-7 absolute for KL ~ 1; the bound is 2e-6 nats for fp32 inputs,
    # so 2e-6 absolute plus 1e-5 relative (for large KL and log-probs of large magnitude).
    # Same bound for bf16/fp16 inputs: they are upcast exactly to float32 before any arithmetic.
    torch.float32: (2e-6, 1e-5),
    torch.bfloat16: (2e-6, 1e-5),
    torch.float16: (2e-6, 1e-5),
    # float64 inputs are computed in float64: only the summation order differs (~1e-15 relative).
    torch.float64: (1e-12, 1e-10),
}

# input dtype -> (atol, rtol) for gradients with respect to the logits, returned in the input
# dtype: the float32 gradient is accurate to ~1e-6 absolute before being rounded to the input
# dtype; rounding to bf16/fp16 adds half an ulp relative (2^-8 / 2^-11), hence the larger rtol.
GRAD_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-5, 1e-4),
    torch.bfloat16: (1e-5, 8e-3),  # 2^-8 = 3.9e-3 relative rounding, ×2 margin
    torch.float16: (1e-5, 1e-3),  # 2^-11 = 4.9e-4 relative rounding, ×2 margin
    # float64 math: summation order only, the gradient entries are O(1)
    torch.float64: (1e-10, 1e-10),
}

# The value table in keyword form (``assert_close(a, b, **VALUE_TOL[dtype])``), as the
# ``value_tol`` fixture hands it to tests/ops/test_streaming.py: the same numbers as TOLERANCES.
VALUE_TOL: dict[torch.dtype, dict[str, float]] = {
    dtype: dict(atol=atol, rtol=rtol) for dtype, (atol, rtol) in TOLERANCES.items()
}

# Gradients relative to the largest gradient entry (the ``grad_rel_tol`` fixture; the caller
# uses it as rtol and, times max |grad|, as atol). Gradients come back in the input's dtype, so
# they carry that dtype's rounding: half an ulp relative (2^-8 for bf16, 2^-11 for fp16, 2^-24
# for fp32) of each entry, plus a little float32 error in the recomputed softmax.
GRAD_REL_TOL: dict[torch.dtype, float] = {
    torch.float64: 1e-10,
    torch.float32: 2e-6,
    torch.bfloat16: 2**-7,
    torch.float16: 2**-10,
}


def tol(dtype: torch.dtype) -> dict[str, float]:
    """``{"atol", "rtol"}`` for values of inputs of ``dtype`` (TOLERANCES)."""
    atol, rtol = TOLERANCES[dtype]
    return {"atol": atol, "rtol": rtol}


def grad_tol(dtype: torch.dtype) -> dict[str, float]:
    """``{"atol", "rtol"}`` for gradients of inputs of ``dtype`` (GRAD_TOLERANCES)."""
    atol, rtol = GRAD_TOLERANCES[dtype]
    return {"atol": atol, "rtol": rtol}
