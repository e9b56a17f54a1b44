"""The Triton kernels of the ``"triton"`` backend (imported only by :mod:`.triton_kernels`, lazily:
importing this module imports Triton).

Two kernels serve the three ops of the backend, specialised by ``tl.constexpr`` flags so that
each call reads and computes only what it needs; the column layouts of :mod:`.contract` come in
as constexprs too (:func:`.triton_kernels.column_constexprs`):

- :func:`stats_kernel` (forward): program (row, split) walks columns
  [split·cols, (split + 1)·cols) in ``BLOCK`` chunks, reading each logit once in its own dtype,
  with the engine's state of both models in float32 scalars, and writes its partial state
  (the state columns m_x, s_x, m_y, s_y, a, b) to ``out[row, split, :]``. The states of a row's splits are merged
  by the engine's merge in torch (:mod:`.triton_kernels`).
- :func:`grad_kernel` (backward): one (row, block) tile of ∂/∂x and ∂/∂y of Σ g·out for all
  wanted outputs together, recomputed from the saved per-row stats, written once in the
  inputs' dtypes.

Whether the kernels run compiled or interpreted (``TRITON_INTERPRET=1``, CPU tensors) is decided
by Triton when this module is imported. Only Triton APIs present in Triton 3.6 are used.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["stats_kernel", "grad_kernel", "INTERPRETED"]

_LOG2E = 1.4426950408889634


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
    """α·(a + shift·s): the shift term only where the slice has mass, 0 where α = 0, +inf
    where a is +inf (KL = +inf whatever α: α may underflow to 0)."""
    out = tl.where(alpha > 0, alpha * (a + tl.where(s > 0, shift * s, 0.0)), 0.0)
    return tl.where(a == float("inf"), a, out)


@triton.jit
def _term(valid, t, g):
    """t·g where ``valid`` (a block mask) and the row's scalar g ≠ 0, else exactly 0 (so that
    0·inf and 0·NaN from garbage or −inf entries never reach the gradient)."""
    return tl.where(g != 0, tl.where(valid, t * g, 0.0), 0.0)


@triton.jit
def _kept_x(x_row, keep_row, tau, col, inside, HAS_KEEP: tl.constexpr, HAS_TAU: tl.constexpr):
    """The policy logits of one block in float32, −inf outside the row and outside the support
    (kept iff keep[v] and x_v ≥ tau, compared in float32: tau's dtype)."""
    x = tl.load(x_row + col, mask=inside, other=float("-inf")).to(tl.float32)
    if HAS_KEEP:
        kept = tl.load(keep_row + col, mask=inside, other=0) != 0
        x = tl.where(kept, x, float("-inf"))
    if HAS_TAU:
        x = tl.where(x >= tau, x, float("-inf"))
    return x


@triton.jit
def stats_kernel(
    x_ptr, y_ptr, keep_ptr, tau_ptr, out_ptr,
    stride_x, stride_y, stride_keep, V, cols, n_splits, inv_t, c2,
    X_STATE: tl.constexpr, Y_STATE: tl.constexpr, MOMENT_A: tl.constexpr,
    MOMENT_B: tl.constexpr, HAS_KEEP: tl.constexpr, HAS_TAU: tl.constexpr,
    BLOCK: tl.constexpr, STATE_COLS: tl.constexpr, SX_M_X: tl.constexpr, SX_S_X: tl.constexpr,
    SX_M_Y: tl.constexpr, SX_S_Y: tl.constexpr, SX_A: tl.constexpr, SX_B: tl.constexpr,
):
    """out[row, split] ← (m_x, s_x, m_y, s_y, a, b) over the split's columns; c2 = log2(e)/T.

    X_STATE: the policy's log-sum-exp state (m_x, s_x) over its support (KL, log π̃, H);
    Y_STATE: the reference's (m_y, s_y) (KL, log ρ); MOMENT_A: a = Σ e^u·(u − w) (KL, needs
    both); MOMENT_B: b = Σ e^u·u (entropy). HAS_KEEP / HAS_TAU: the support by a (N, V) keep
    mask and/or a per-row threshold. Fields not computed are written as (−inf, 0) / 0.
    MOMENT_A needs X_STATE and Y_STATE, MOMENT_B needs X_STATE (set so by the host).
    """
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    c0 = split * cols
    c1 = tl.minimum(c0 + cols, V)
    x_row = x_ptr + row * stride_x
    y_row = y_ptr + row * stride_y
    keep_row = keep_ptr + row * stride_keep
    tau = 0.0
    if HAS_TAU:
        tau = tl.load(tau_ptr + row).to(tl.float32)
    offs = tl.arange(0, BLOCK)
    m_x = float("-inf")
    m_y = float("-inf")
    s_x = 0.0
    s_y = 0.0
    a = 0.0
    b = 0.0
    for start in range(c0, c1, BLOCK):
        col = start + offs
        inside = col < c1
        if X_STATE:
            x = _kept_x(x_row, keep_row, tau, col, inside, HAS_KEEP, HAS_TAU)
            mx_new = tl.maximum(m_x, tl.max(x, 0))
            dxs, alpha = _scales(m_x, mx_new, inv_t)
        if Y_STATE:
            y = tl.load(y_row + col, mask=inside, other=float("-inf")).to(tl.float32)
            my_new = tl.maximum(m_y, tl.max(y, 0))
            dys, beta = _scales(m_y, my_new, inv_t)
            s_y = beta * s_y
            dy = y - _finite_or_zero(my_new)  # logit units
            s_y += tl.sum(tl.exp2(dy * c2), 0)
            m_y = my_new
        if X_STATE:
            if MOMENT_A:
                a = _rescale_moment(s_x, a, dxs - dys, alpha)
            if MOMENT_B:
                b = _rescale_moment(s_x, b, dxs, alpha)
            s_x = alpha * s_x
            dx = x - _finite_or_zero(mx_new)
            eu = tl.exp2(dx * c2)
            s_x += tl.sum(eu, 0)
            # 0·log 0 = 0: an entry with e^u = 0 adds nothing, except where x is finite and
            # y = −inf (dx − dy = +inf): e^u > 0 exactly there, the term is +inf
            if MOMENT_A:
                d = dx - dy
                a += tl.sum(tl.where(eu > 0, eu * d, tl.where(d == float("inf"), d, 0.0)), 0) * inv_t
            if MOMENT_B:
                b += tl.sum(tl.where(eu > 0, eu * dx, 0.0), 0) * inv_t
            m_x = mx_new
    out = out_ptr + (row * n_splits + split) * STATE_COLS
    tl.store(out + SX_M_X, m_x)
    tl.store(out + SX_S_X, s_x)
    tl.store(out + SX_M_Y, m_y)
    tl.store(out + SX_S_Y, s_y)
    tl.store(out + SX_A, a)
    tl.store(out + SX_B, b)


@triton.jit
def grad_kernel(
    x_ptr, y_ptr, keep_ptr, tau_ptr, gx_ptr, gy_ptr, stats_ptr, g_ptr, tok_ptr, at_tok_ptr,
    stride_x, stride_y, stride_keep, V, inv_t, c2,
    KL: tl.constexpr, LOGP: tl.constexpr, REF_LOGP: tl.constexpr, ENTROPY: tl.constexpr,
    NEED_X: tl.constexpr, NEED_Y: tl.constexpr, NEED_P: tl.constexpr, NEED_Q: tl.constexpr,
    HAS_TOKEN: tl.constexpr, HAS_KEEP: tl.constexpr, HAS_TAU: tl.constexpr, BLOCK: tl.constexpr,
    OUT_COLS: tl.constexpr, STATS_COLS: tl.constexpr, ST_SHIFT_X: tl.constexpr,
    ST_LOG_S_X: tl.constexpr, ST_SHIFT_Y: tl.constexpr, ST_LOG_S_Y: tl.constexpr,
    ST_MEAN_D: tl.constexpr, ST_MEAN_U: tl.constexpr,
):
    """One (row, block) tile of ∂/∂x and ∂/∂y of Σ g·out from the (N, 9) stats.

    With p = π̃, q = ρ, u, w the tempered shifted logits, g = (g_kl, g_lp, g_rl, g_h) the row's
    upstream gradient (N, 4) (0 on masked rows, the log-prob columns 0 at ignored tokens)::

        gx = [p·(g_kl·((u − w) − E_π̃[u − w]) − g_h·(u − E_π̃[u])) − g_lp·(p − onehot)]/T
        gy = [g_kl·(q − p) − g_rl·(q − onehot)]/T

    At the token the (1 − p_t)·g_lp and (1 − q_t)·g_rl factors come precomputed in
    ``at_tok`` (N, 2) (from −expm1 of the log-probs: exact for p_t → 1). Each term is dropped
    where its g is 0 and the p-terms where p = 0 (0·log 0, −inf logits, off the support), so
    masked garbage rows give exactly 0 and −inf entries finite gradients.
    """
    row = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = col < V
    st = stats_ptr + row * STATS_COLS
    gr = g_ptr + row * OUT_COLS
    g_kl = tl.load(gr)
    g_lp = tl.load(gr + 1)
    g_rl = tl.load(gr + 2)
    g_h = tl.load(gr + 3)
    if HAS_TOKEN:  # LOGP or REF_LOGP (the flags combined on the host: plain constexpr tests)
        is_tok = col == tl.load(tok_ptr + row)
    if NEED_P:  # the policy's probabilities (KL, LOGP or ENTROPY)
        tau = 0.0
        if HAS_TAU:
            tau = tl.load(tau_ptr + row).to(tl.float32)
        x = _kept_x(x_ptr + row * stride_x, keep_ptr + row * stride_keep, tau, col, inside,
                    HAS_KEEP, HAS_TAU)
        dx = x - tl.load(st + ST_SHIFT_X)  # logit units
        p = tl.exp2(dx * c2 - tl.load(st + ST_LOG_S_X) * 1.4426950408889634)
        live = p > 0
    if NEED_Q:  # the reference's (KL or REF_LOGP)
        y = tl.load(y_ptr + row * stride_y + col, mask=inside, other=float("-inf")).to(tl.float32)
        dy = y - tl.load(st + ST_SHIFT_Y)
        q = tl.exp2(dy * c2 - tl.load(st + ST_LOG_S_Y) * 1.4426950408889634)
    if NEED_X:
        gx = tl.zeros([BLOCK], dtype=tl.float32)
        if KL:
            t_kl = p * ((dx - dy) * inv_t - tl.load(st + ST_MEAN_D))
            gx += _term(live, t_kl, g_kl)
        if ENTROPY:
            t_h = p * (dx * inv_t - tl.load(st + ST_MEAN_U))
            gx -= _term(live, t_h, g_h)
        if LOGP:
            gx += tl.where(is_tok, tl.load(at_tok_ptr + row * 2), _term(live, -p, g_lp))
        tl.store(gx_ptr + row * V + col, (gx * inv_t).to(gx_ptr.dtype.element_ty), mask=inside)
    if NEED_Y:
        gy = tl.zeros([BLOCK], dtype=tl.float32)
        if KL:
            qp = q - p
            gy += _term(qp == qp, qp, g_kl)  # NaN only where both vanish
        if REF_LOGP:
            gy += tl.where(is_tok, tl.load(at_tok_ptr + row * 2 + 1), _term(q > 0, -q, g_rl))
        tl.store(gy_ptr + row * V + col, (gy * inv_t).to(gy_ptr.dtype.element_ty), mask=inside)


# Triton decides at decoration time whether a kernel is interpreted (TRITON_INTERPRET=1).
INTERPRETED = type(grad_kernel).__name__ == "InterpretedFunction"
