"""The Triton kernels of the ``"triton"`` backend (imported only by :mod:`.triton_kernels`, lazily:
importing this module imports Triton).

Forward kernels compute the per-row state of :mod:`.engine` over a range of columns: program
(row, split) walks columns [split·cols, (split + 1)·cols) in ``BLOCK`` chunks, reading each
logit once in its own dtype, with the state of both models in float32 scalars, and writes its
partial state to ``out[row, split, :]``. The states of a row's splits are merged by the engine's
merge in torch (:mod:`.triton_kernels`). Backward kernels recompute one (row, block) tile of
the gradient from the saved per-row stats and write it once in the input's dtype.

Whether the kernels run compiled or interpreted (``TRITON_INTERPRET=1``, CPU tensors) is decided
by Triton when this module is imported.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["kl_state_kernel", "entropy_state_kernel", "grad_kernel", "INTERPRETED"]

# backward kinds (grad_kernel's KIND)
KL, LSE, ENTROPY = 0, 1, 2


@triton.jit
def _finite_or_zero(m):
    """The shift of a row: its max if finite, else 0 (no mass, +inf or NaN)."""
    return tl.where((m == m) & (tl.abs(m) != float("inf")), m, 0.0)


@triton.jit
def _scales(m_old, m_new, inv_t):
    """(δ, α = e^δ) with δ = (m_old − m_new)/T, exactly 0 where equal (also both −inf)."""
    delta = tl.where(m_old == m_new, 0.0, (m_old - m_new) * inv_t)
    return delta, tl.exp(delta)


@triton.jit
def _rescale_moment(s, a, shift, alpha):
    """α·(a + shift·s): the shift term only where the slice has mass, 0 where α = 0."""
    return tl.where(alpha > 0, alpha * (a + tl.where(s > 0, shift * s, 0.0)), 0.0)


@triton.jit
def kl_state_kernel(
    x_ptr, y_ptr, out_ptr, stride_x, stride_y, V, cols, n_splits, inv_t, c2,
    BLOCK: tl.constexpr,
):
    """out[row, split] ← (m_x, s_x, m_y, s_y, a) over the split's columns; c2 = log2(e)/T."""
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    c0 = split * cols
    c1 = tl.minimum(c0 + cols, V)
    x_row = x_ptr + row * stride_x
    y_row = y_ptr + row * stride_y
    offs = tl.arange(0, BLOCK)
    m_x = float("-inf")
    m_y = float("-inf")
    s_x = 0.0
    s_y = 0.0
    a = 0.0
    for start in range(c0, c1, BLOCK):
        col = start + offs
        inside = col < c1
        x = tl.load(x_row + col, mask=inside, other=float("-inf")).to(tl.float32)
        y = tl.load(y_row + col, mask=inside, other=float("-inf")).to(tl.float32)
        mx_new = tl.maximum(m_x, tl.max(x, 0))
        my_new = tl.maximum(m_y, tl.max(y, 0))
        dxs, alpha = _scales(m_x, mx_new, inv_t)
        dys, beta = _scales(m_y, my_new, inv_t)
        a = _rescale_moment(s_x, a, dxs - dys, alpha)
        s_x = alpha * s_x
        s_y = beta * s_y
        dx = x - _finite_or_zero(mx_new)  # logit units
        dy = y - _finite_or_zero(my_new)
        eu = tl.exp2(dx * c2)
        ew = tl.exp2(dy * c2)
        s_x += tl.sum(eu, 0)
        s_y += tl.sum(ew, 0)
        # 0·log 0 = 0: an entry with e^u = 0 adds nothing; +inf where y = −inf under mass
        a += tl.sum(tl.where(eu > 0, eu * (dx - dy), 0.0), 0) * inv_t
        m_x = mx_new
        m_y = my_new
    out = out_ptr + (row * n_splits + split) * 5
    tl.store(out, m_x)
    tl.store(out + 1, s_x)
    tl.store(out + 2, m_y)
    tl.store(out + 3, s_y)
    tl.store(out + 4, a)


@triton.jit
def entropy_state_kernel(x_ptr, out_ptr, stride_x, V, cols, n_splits, inv_t, c2, BLOCK: tl.constexpr):
    """out[row, split] ← (m, s, b) over the split's columns (the log-sum-exp state and Σ e^u·u)."""
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    c0 = split * cols
    c1 = tl.minimum(c0 + cols, V)
    x_row = x_ptr + row * stride_x
    offs = tl.arange(0, BLOCK)
    m = float("-inf")
    s = 0.0
    b = 0.0
    for start in range(c0, c1, BLOCK):
        col = start + offs
        x = tl.load(x_row + col, mask=col < c1, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, 0))
        delta, alpha = _scales(m, m_new, inv_t)
        b = _rescale_moment(s, b, delta, alpha)
        s = alpha * s
        d = x - _finite_or_zero(m_new)
        e = tl.exp2(d * c2)
        s += tl.sum(e, 0)
        b += tl.sum(tl.where(e > 0, e * d, 0.0), 0) * inv_t
        m = m_new
    out = out_ptr + (row * n_splits + split) * 3
    tl.store(out, m)
    tl.store(out + 1, s)
    tl.store(out + 2, b)


@triton.jit
def grad_kernel(
    x_ptr, y_ptr, gx_ptr, gy_ptr, stats_ptr, g_ptr, tok_ptr, at_tok_ptr,
    stride_x, stride_y, V, inv_t, c2,
    KIND: tl.constexpr, NEED_X: tl.constexpr, NEED_Y: tl.constexpr, BLOCK: tl.constexpr,
):
    """One (row, block) tile of the gradient of Σ g·f, f = KL, log π(token) or H, from the stats.

    KL (stats (N, 6)): gx = π·((u − w) − E_π[u − w])·g/T, gy = (ρ − π)·g/T.
    LSE (stats (N, 3)): gx = −π·g/T, and at the token ``at_tok`` = (1 − π_t)·g/T.
    ENTROPY (stats (N, 3)): gx = −π·(u − E_π[u])·g/T.
    0 where π = 0 (0·log 0) and on rows with g = 0 (masked rows may hold garbage).
    """
    row = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = col < V
    g = tl.load(g_ptr + row)
    live = g != 0
    n_stats: tl.constexpr = 6 if KIND == 0 else 3
    st = stats_ptr + row * n_stats
    shift_x = tl.load(st)
    log_s_x = tl.load(st + 1)
    x = tl.load(x_ptr + row * stride_x + col, mask=inside, other=float("-inf")).to(tl.float32)
    dx = x - shift_x
    p = tl.exp2(dx * c2 - log_s_x * 1.4426950408889634)  # π
    if KIND == 0:
        shift_y = tl.load(st + 2)
        log_s_y = tl.load(st + 3)
        mean_d = tl.load(st + 4)
        y = tl.load(y_ptr + row * stride_y + col, mask=inside, other=float("-inf")).to(tl.float32)
        dy = y - shift_y
        if NEED_X:
            gx = tl.where(p > 0, p * ((dx - dy) * inv_t - mean_d), 0.0) * (g * inv_t)
            gx = tl.where(live, gx, 0.0)
            tl.store(gx_ptr + row * V + col, gx.to(gx_ptr.dtype.element_ty), mask=inside)
        if NEED_Y:
            q = tl.exp2(dy * c2 - log_s_y * 1.4426950408889634) - p  # ρ − π
            gy = tl.where(q == q, q, 0.0) * (g * inv_t)
            gy = tl.where(live, gy, 0.0)
            tl.store(gy_ptr + row * V + col, gy.to(gy_ptr.dtype.element_ty), mask=inside)
    elif KIND == 1:
        tok = tl.load(tok_ptr + row)
        at_tok = tl.load(at_tok_ptr + row)
        gx = tl.where(p > 0, -p, 0.0) * (g * inv_t)
        gx = tl.where(col == tok, at_tok, gx)
        gx = tl.where(live, gx, 0.0)
        tl.store(gx_ptr + row * V + col, gx.to(gx_ptr.dtype.element_ty), mask=inside)
    else:
        mean_u = tl.load(st + 2)
        gx = tl.where(p > 0, p * (dx * inv_t - mean_u), 0.0) * (-g * inv_t)
        gx = tl.where(live, gx, 0.0)
        tl.store(gx_ptr + row * V + col, gx.to(gx_ptr.dtype.element_ty), mask=inside)


# Triton decides at decoration time whether a kernel is interpreted (TRITON_INTERPRET=1).
INTERPRETED = type(grad_kernel).__name__ == "InterpretedFunction"
