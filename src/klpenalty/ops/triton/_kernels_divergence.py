"""The Triton kernels of the second walk, the divergences of :mod:`..divergence` (imported only
by the package, lazily: importing this module imports Triton).

Each kind's term f and π·∂f/∂π per vocabulary entry (:func:`_terms`, the formulas of
:func:`..divergence.divergence_terms` in float32) from the exact log-probabilities
lp = (x − shift_x)/T − log s_x and lq = (y − shift_y)/T − log s_y, the shifts and log-sums read
from the forward's stats. The host is :mod:`.divergence`.

- :func:`divergence_kernel` (forward): program (row, split) walks columns
  [split·cols, (split + 1)·cols) in ``BLOCK`` chunks and sums f and π·g into [BLOCK]
  accumulators (no reduction inside the loop: one sum of each after it); a program that is a
  whole row writes value and ḡ, the others an (N, splits, 2) buffer of partial sums that
  :func:`divergence_merge_kernel` adds up, one program per row. A masked row reads nothing and
  sums to exactly 0.
- :func:`divergence_grad_kernel` (backward): TILES (row, block) tiles of
  grad·(π·g − π·ḡ)/T, written once in x's dtype, exactly 0 where the row's upstream gradient is
  0 (masked rows included, whatever their logits hold).

With a support (HAS_KEEP: a (rows, V) uint8 keep read through its strides; HAS_TAU: a per-row
threshold τ, x ≥ τ compared in float32, the compute dtype) the student is π̃: lp = −inf off the
support and π·g = 0 there (:func:`_support_log_probs`), so ḡ sums the kept entries and the
gradient is exactly 0 off it; the teacher is never truncated.

The kind is a ``tl.constexpr`` (one specialisation per kind, only its own terms compiled), as
are whether the kernel reads a mask, a keep or a threshold, and the stats columns
(:func:`._host.column_constexprs`).
β or λ comes as ``w`` and ``1 − w`` (``wc``), rounded from float64 on the host. Full blocks are
read (and written) unmasked, each row's last partial one masked; columns past the row read
x = y = −inf, whose terms are exactly 0.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..divergence import Divergence
from ._kernels_common import (
    _device, _expm1_near, _load, _row_offset, _split_columns, _store,
)

__all__ = ["divergence_kernel", "divergence_merge_kernel", "divergence_grad_kernel"]

# the kinds, as the kernels' constexprs (globals a jit function may read)
_REVERSE_KL = tl.constexpr(int(Divergence.REVERSE_KL))
_FORWARD_KL = tl.constexpr(int(Divergence.FORWARD_KL))
_JSD = tl.constexpr(int(Divergence.JSD))
_SKEW_FORWARD_KL = tl.constexpr(int(Divergence.SKEW_FORWARD_KL))
_SKEW_REVERSE_KL = tl.constexpr(int(Divergence.SKEW_REVERSE_KL))
_TVD = tl.constexpr(int(Divergence.TVD))


@_device
def _times(p, d, lp):
    """p·d, exactly 0 where the log-prob ``lp`` is −inf (0·log 0 = 0), +inf where d is +inf and
    lp finite (mass against none, even where p underflows to 0)."""
    term = tl.where(d == float("inf"), d, p * d)
    return tl.where(lp == float("-inf"), 0.0, term)


@_device
def _minus_log_mix(la, lb, wa, wb):
    """la − log(wa·e^la + wb·e^lb) (wa + wb = 1), with δ = lb − la: where δ ≤ 1,
    −log1p(wb·expm1(δ)) (exactly 0 at δ = 0, −log wa at δ = −inf; log1p(z) as log(u)·z/(u − 1)
    with u = 1 + z rounded, whose rounding cancels to first order, z where u = 1); where δ > 1,
    −δ − log(wb + wa·e^−δ) (no overflow of e^δ: −inf at δ = +inf). One exponential and one
    logarithm an entry, their arguments selected first; NaN where δ is NaN (selects only: a
    compiled ``tl.minimum`` drops NaN)."""
    d = lb - la
    above = d > 1.0
    e = tl.exp(tl.where(above, -d, d))  # e^δ, or e^−δ above
    z = wb * tl.where(tl.abs(d) < 0.5, _expm1_near(d), e - 1.0)  # wb·expm1(δ)
    u = 1.0 + z
    log_u = tl.log(tl.where(above, wb + wa * e, u))
    near = -tl.where(u == 1.0, z, log_u * (z / (u - 1.0)))
    return tl.where(above, -d - log_u, near)


@_device
def _terms(lp, lq, w, wc, KIND: tl.constexpr):
    """(f, π·∂f/∂π) of the kind per entry, from the log-probs ``lp`` (student) and ``lq``
    (teacher): :func:`..divergence.divergence_terms` in float32; w = β (JSD) or λ (skews),
    wc = 1 − w."""
    p = tl.exp(lp)
    q = tl.exp(lq)
    if KIND == _REVERSE_KL:
        f = _times(p, lp - lq, lp)
        pg = f
    elif KIND == _FORWARD_KL:
        f = _times(q, lq - lp, lq)
        pg = -q
    elif KIND == _JSD:  # M = β·ν + (1−β)·π
        fp = _times(p, _minus_log_mix(lp, lq, wc, w), lp)
        f = w * _times(q, _minus_log_mix(lq, lp, w, wc), lq) + wc * fp
        pg = wc * fp
    elif KIND == _SKEW_FORWARD_KL:  # M = λ·ν + (1−λ)·π
        dp = _minus_log_mix(lp, lq, wc, w)
        f = _times(q, _minus_log_mix(lq, lp, w, wc), lq)
        pg = -wc * tl.where(lq == float("-inf"), 0.0, q * tl.exp(dp))  # −(1−λ)·π·ν/M
    elif KIND == _SKEW_REVERSE_KL:  # M = λ·π + (1−λ)·ν
        dp = _minus_log_mix(lp, lq, w, wc)
        f = _times(p, dp, lp)
        pg = f - w * tl.where(lp == float("-inf"), 0.0, p * tl.exp(dp))  # − λ·π²/M
    else:  # TVD
        diff = p - q
        f = 0.5 * tl.abs(diff)
        pg = 0.5 * tl.where(diff > 0, p, tl.where(diff < 0, -p, diff * p))  # ½·π·sign(π − ν)
    return f, pg


@_device
def _row_stats(st, ST_SHIFT_X: tl.constexpr, ST_LOG_S_X: tl.constexpr, ST_SHIFT_Y: tl.constexpr,
               ST_LOG_S_Y: tl.constexpr):
    """(shift_x, log s_x, shift_y, log s_y) of a row from its stats at ``st``, in float32."""
    return (tl.load(st + ST_SHIFT_X).to(tl.float32), tl.load(st + ST_LOG_S_X).to(tl.float32),
            tl.load(st + ST_SHIFT_Y).to(tl.float32), tl.load(st + ST_LOG_S_Y).to(tl.float32))


@_device
def _support_log_probs(x_row, y_row, keep_row, tau, col, c1, shift_x, log_s_x, shift_y,
                       log_s_y, inv_t, HAS_KEEP: tl.constexpr, HAS_TAU: tl.constexpr,
                       MASKED: tl.constexpr):
    """(lp, lq, kept) of the columns ``col`` of a row in float32 (−inf past ``c1`` where
    MASKED): lp = −inf off the support, kept(v) = keep[v] and x_v ≥ τ (all True without one)."""
    x = _load(x_row, col, c1, float("-inf"), MASKED).to(tl.float32)
    y = _load(y_row, col, c1, float("-inf"), MASKED).to(tl.float32)
    kept = col >= 0
    if HAS_KEEP:
        kept = kept & (_load(keep_row, col, c1, 0, MASKED) != 0)
    if HAS_TAU:
        kept = kept & (x >= tau)
    lp = (x - shift_x) * inv_t - log_s_x
    if HAS_KEEP or HAS_TAU:
        lp = tl.where(kept, lp, float("-inf"))
    return lp, (y - shift_y) * inv_t - log_s_y, kept


@_device
def _support_terms(x_row, y_row, keep_row, tau, col, c1, shift_x, log_s_x, shift_y, log_s_y,
                   inv_t, w, wc, KIND: tl.constexpr, HAS_KEEP: tl.constexpr,
                   HAS_TAU: tl.constexpr, MASKED: tl.constexpr):
    """(lp, f, π·g) of the columns ``col`` (:func:`_terms` of :func:`_support_log_probs`), π·g
    exactly 0 off the support (π̃ is 0 there whatever x is)."""
    lp, lq, kept = _support_log_probs(x_row, y_row, keep_row, tau, col, c1, shift_x, log_s_x,
                                      shift_y, log_s_y, inv_t, HAS_KEEP, HAS_TAU, MASKED)
    f, pg = _terms(lp, lq, w, wc, KIND)
    if HAS_KEEP or HAS_TAU:
        pg = tl.where(kept, pg, 0.0)
    return lp, f, pg


@_device
def _row_support(keep_ptr, tau_ptr, row, T, stride_kb, stride_kt, HAS_TAU: tl.constexpr):
    """The row's keep pointer and threshold τ (float32; 0.0 where unused)."""
    keep_row = keep_ptr + _row_offset(row, T, stride_kb, stride_kt)
    tau = 0.0
    if HAS_TAU:
        tau = tl.load(tau_ptr + row).to(tl.float32)
    return keep_row, tau


@triton.jit
def divergence_kernel(
    x_ptr, y_ptr, keep_ptr, tau_ptr, stats_ptr, mask_ptr, value_ptr, gbar_ptr,
    T, stride_xb, stride_xt, stride_yb, stride_yt, stride_kb, stride_kt, V, cols, n_splits,
    inv_t, w, wc,
    KIND: tl.constexpr, HAS_MASK: tl.constexpr, HAS_KEEP: tl.constexpr, HAS_TAU: tl.constexpr,
    FINISH: tl.constexpr, BLOCK: tl.constexpr,
    STATS_COLS: tl.constexpr, ST_SHIFT_X: tl.constexpr, ST_LOG_S_X: tl.constexpr,
    ST_SHIFT_Y: tl.constexpr, ST_LOG_S_Y: tl.constexpr,
):
    """Σ f and ḡ = Σ π·g of a row over the split's columns (:func:`_terms`).

    FINISH (one program per row, ``n_splits`` = 1): value[row] and gbar[row]; otherwise
    ``value_ptr[(row·n_splits + split)·2 + (0, 1)]`` (the (N, splits, 2) partial sums, merged by
    :func:`divergence_merge_kernel`). HAS_MASK: a row with mask[row] = 0 reads nothing (its
    sums are exactly 0). Rows of x and y are addressed through (T, stride_b, stride_t)
    (:func:`._kernels_common._row_offset`); a whole-row program starts at column 0 (aligned
    loads wherever the row stride is).
    """
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    c0, c1 = _split_columns(split, cols, n_splits, V)
    if HAS_MASK:  # a masked row: an empty range
        c1 = tl.where(tl.load(mask_ptr + row) != 0, c1, c0)
    c_main = c0 + (c1 - c0) // BLOCK * BLOCK  # the end of the full blocks
    shift_x, log_s_x, shift_y, log_s_y = _row_stats(stats_ptr + row * STATS_COLS, ST_SHIFT_X,
                                                    ST_LOG_S_X, ST_SHIFT_Y, ST_LOG_S_Y)
    x_row = x_ptr + _row_offset(row, T, stride_xb, stride_xt)
    y_row = y_ptr + _row_offset(row, T, stride_yb, stride_yt)
    keep_row, tau = _row_support(keep_ptr, tau_ptr, row, T, stride_kb, stride_kt, HAS_TAU)
    offs = tl.arange(0, BLOCK)
    acc_f = tl.zeros([BLOCK], tl.float32)
    acc_g = tl.zeros([BLOCK], tl.float32)
    for start in range(c0, c_main, BLOCK):
        _, f, pg = _support_terms(x_row, y_row, keep_row, tau, start + offs, c1, shift_x,
                                  log_s_x, shift_y, log_s_y, inv_t, w, wc, KIND, HAS_KEEP,
                                  HAS_TAU, False)
        acc_f += f
        acc_g += pg
    if c_main < c1:
        _, f, pg = _support_terms(x_row, y_row, keep_row, tau, c_main + offs, c1, shift_x,
                                  log_s_x, shift_y, log_s_y, inv_t, w, wc, KIND, HAS_KEEP,
                                  HAS_TAU, True)
        acc_f += f
        acc_g += pg
    value = tl.sum(acc_f, 0)
    gbar = tl.sum(acc_g, 0)
    if FINISH:
        tl.store(value_ptr + row, value)
        tl.store(gbar_ptr + row, gbar)
    else:
        part = value_ptr + (row * n_splits + split) * 2
        tl.store(part, value)
        tl.store(part + 1, gbar)


@triton.jit
def divergence_merge_kernel(parts_ptr, value_ptr, gbar_ptr, n_splits, SPLITS: tl.constexpr):
    """One row: value and ḡ, the sums of its ``n_splits`` partial sums (``parts`` (N, splits,
    2) from :func:`divergence_kernel`; SPLITS a power of two ≥ n_splits)."""
    row = tl.program_id(0).to(tl.int64)
    k = tl.arange(0, SPLITS)
    live = k < n_splits
    part = parts_ptr + (row * n_splits + k) * 2
    tl.store(value_ptr + row, tl.sum(tl.load(part, mask=live, other=0.0), 0))
    tl.store(gbar_ptr + row, tl.sum(tl.load(part + 1, mask=live, other=0.0), 0))


@_device
def _grad_tile(x_row, y_row, keep_row, tau, gx_row, start, offs, c1, shift_x, log_s_x, shift_y,
               log_s_y, gbar, scale, inv_t, w, wc, KIND: tl.constexpr, HAS_KEEP: tl.constexpr,
               HAS_TAU: tl.constexpr, MASKED: tl.constexpr):
    """One tile of grad·(π·g − π·ḡ)/T (``scale`` = grad/T), exactly 0 where grad is 0 and off
    the support (π̃ = π·g = 0 there), written in gx's dtype."""
    col = start + offs
    lp, _, pg = _support_terms(x_row, y_row, keep_row, tau, col, c1, shift_x, log_s_x, shift_y,
                               log_s_y, inv_t, w, wc, KIND, HAS_KEEP, HAS_TAU, MASKED)
    d = tl.where(scale != 0, (pg - tl.exp(lp) * gbar) * scale, 0.0)
    _store(gx_row, col, c1, d.to(gx_row.dtype.element_ty), MASKED)


@triton.jit
def divergence_grad_kernel(
    x_ptr, y_ptr, keep_ptr, tau_ptr, stats_ptr, g_ptr, gbar_ptr, mask_ptr, gx_ptr,
    T, stride_xb, stride_xt, stride_yb, stride_yt, stride_kb, stride_kt, stride_g, V, inv_t, w,
    wc, KIND: tl.constexpr, HAS_MASK: tl.constexpr, HAS_KEEP: tl.constexpr,
    HAS_TAU: tl.constexpr, BLOCK: tl.constexpr, TILES: tl.constexpr,
    STATS_COLS: tl.constexpr, ST_SHIFT_X: tl.constexpr, ST_LOG_S_X: tl.constexpr,
    ST_SHIFT_Y: tl.constexpr, ST_LOG_S_Y: tl.constexpr,
):
    """TILES (row, block) tiles of ∂/∂x of Σ grad·value: program (row, j) takes columns
    [j·TILES·BLOCK, (j + 1)·TILES·BLOCK) and loads the row's scalars once: the upstream gradient
    (``g_ptr`` (N,) with stride ``stride_g``, any float dtype; 0 on masked rows), ḡ and the
    shifts and log-sums (and τ, HAS_TAU). gx is (N, V) contiguous."""
    row = tl.program_id(0).to(tl.int64)
    c0 = tl.program_id(1) * (BLOCK * TILES)
    c1 = tl.minimum(c0 + BLOCK * TILES, V)
    c_main = c0 + (c1 - c0) // BLOCK * BLOCK  # the end of the full tiles
    g = tl.load(g_ptr + row * stride_g).to(tl.float32)
    if HAS_MASK:
        g = tl.where(tl.load(mask_ptr + row) != 0, g, 0.0)
    scale = g * inv_t
    gbar = tl.load(gbar_ptr + row).to(tl.float32)
    shift_x, log_s_x, shift_y, log_s_y = _row_stats(stats_ptr + row * STATS_COLS, ST_SHIFT_X,
                                                    ST_LOG_S_X, ST_SHIFT_Y, ST_LOG_S_Y)
    x_row = x_ptr + _row_offset(row, T, stride_xb, stride_xt)
    y_row = y_ptr + _row_offset(row, T, stride_yb, stride_yt)
    keep_row, tau = _row_support(keep_ptr, tau_ptr, row, T, stride_kb, stride_kt, HAS_TAU)
    gx_row = gx_ptr + row * V
    offs = tl.arange(0, BLOCK)
    for start in range(c0, c_main, BLOCK):
        _grad_tile(x_row, y_row, keep_row, tau, gx_row, start, offs, c1, shift_x, log_s_x,
                   shift_y, log_s_y, gbar, scale, inv_t, w, wc, KIND, HAS_KEEP, HAS_TAU, False)
    if c_main < c1:
        _grad_tile(x_row, y_row, keep_row, tau, gx_row, c_main, offs, c1, shift_x, log_s_x,
                   shift_y, log_s_y, gbar, scale, inv_t, w, wc, KIND, HAS_KEEP, HAS_TAU, True)
