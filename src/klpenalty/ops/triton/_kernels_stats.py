"""The Triton kernels of the token statistics (imported only by the package, lazily: importing
this module imports Triton).

Three kernels serve the forward, state and backward ops (host: :mod:`.token_stats`),
specialised by ``tl.constexpr`` flags so that each call reads and computes only what it needs;
the column layouts of :mod:`..contract` come in as constexprs too
(:func:`.token_stats.column_constexprs`). They share the engine's state math, kept here:

- :func:`stats_kernel` (forward): program (row, split) walks columns
  [split·cols, (split + 1)·cols) in ``BLOCK`` chunks, reading each logit once in its own dtype,
  with the engine's state of both models in float32, one state per thread (merged once after
  the loop), and either finishes the row (one program per row: out and stats,
  :func:`_finish_row`) or writes its partial state (the state columns m_x, s_x, m_y, s_y, a,
  b) to ``out[row, split, :]``;
- :func:`merge_kernel`: one program per row merges its splits' partial states with the engine's
  rescale-and-add and finishes the row (or writes the merged state: the state op);
- :func:`grad_kernel` (backward): TILES (row, block) tiles of ∂/∂x and ∂/∂y of Σ g·out for
  all wanted outputs together, recomputed from the saved per-row stats, written once in the
  inputs' dtypes.

The sampler's threshold, which the forward launches first where its settings cut, is
:mod:`._kernels_threshold`. Rows of the (..., T, V) inputs are addressed through
(T, stride_b, stride_t) (:func:`._kernels_common._row_offset`). Full blocks and tiles are read
(and written) unmasked, each row's last partial one masked. ``benchmarks/triton_sass.py``
counts the machine code these compile to for sm_90 and ``tests/ops/test_triton_compiled.py``
checks it (docs/triton.md).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._kernels_common import _device, _expm1, _load, _row_offset, _split_columns, _store

__all__ = ["stats_kernel", "merge_kernel", "grad_kernel"]


@_device
def _finite_or_zero(m):
    """The shift of a row: its max if finite, else 0 (no mass, +inf or NaN)."""
    return tl.where((m == m) & (tl.abs(m) != float("inf")), m, 0.0)


@_device
def _scales(m_old, m_new, inv_t):
    """(δ, α = e^δ) with δ = (m_old − m_new)/T, exactly 0 where equal (also both −inf)."""
    delta = tl.where(m_old == m_new, 0.0, (m_old - m_new) * inv_t)
    return delta, tl.exp(delta)


@_device
def _rescale_moment(s, a, shift, alpha):
    """α·(a + shift·s): the shift term only where the slice has mass, 0 where α = 0, +inf
    where a is +inf (KL = +inf whatever α: α may underflow to 0)."""
    out = tl.where(alpha > 0, alpha * (a + tl.where(s > 0, shift * s, 0.0)), 0.0)
    return tl.where(a == float("inf"), a, out)


@_device
def _term(valid, t, g):
    """t·g where ``valid`` (a block mask) and the row's scalar g ≠ 0, else exactly 0 (so that
    0·inf and 0·NaN from garbage or −inf entries never reach the gradient)."""
    return tl.where(g != 0, tl.where(valid, t * g, 0.0), 0.0)


@_device
def _gather(row, start, offs, c1, other, R: tl.constexpr, MASKED: tl.constexpr):
    """``row[start + offs]`` for R = 1; for R = 2 or 4 (``offs`` [NT, INNER]), R consecutive
    such pieces joined along new trailing axes ([NT, INNER, 2] or [NT, INNER, 2, 2]): each piece
    is one 16-byte load per thread, and the joined axes stay inside the thread."""
    v = _load(row, start + offs, c1, other, MASKED)
    if R >= 2:
        step: tl.constexpr = offs.shape[0] * offs.shape[1]
        v1 = _load(row, (start + step) + offs, c1, other, MASKED)
        if R == 2:
            v = tl.join(v, v1)
        else:
            v2 = _load(row, (start + 2 * step) + offs, c1, other, MASKED)
            v3 = _load(row, (start + 3 * step) + offs, c1, other, MASKED)
            v = tl.join(tl.join(v, v1), tl.join(v2, v3))
    return v


@_device
def _kept_x(x_row, keep_row, tau, start, offs, c1, HAS_KEEP: tl.constexpr,
            HAS_TAU: tl.constexpr, R: tl.constexpr, MASKED: tl.constexpr):
    """The policy logits of one block (:func:`_gather`) in float32, −inf outside the row and
    outside the support (kept iff keep[v] and x_v ≥ tau, compared in float32: tau's dtype)."""
    x = _gather(x_row, start, offs, c1, float("-inf"), R, MASKED).to(tl.float32)
    if HAS_KEEP:
        kept = _gather(keep_row, start, offs, c1, 0, R, MASKED) != 0
        x = tl.where(kept, x, float("-inf"))
    if HAS_TAU:
        x = tl.where(x >= tau, x, float("-inf"))
    return x


@_device
def _reduce(v, axis: tl.constexpr, MAX: tl.constexpr):
    if MAX:
        r = tl.max(v, axis)
    else:
        r = tl.sum(v, axis)
    return r


@_device
def _thread_reduce(v, R: tl.constexpr, MAX: tl.constexpr):
    """The [NT] maxima (MAX) or sums over the axes after the first, those each thread holds:
    the joined axes of :func:`_gather` (none, one or two), then the INNER columns."""
    if R == 4:
        v = _reduce(v, 3, MAX)
    if R >= 2:
        v = _reduce(v, 2, MAX)
    return _reduce(v, 1, MAX)


@_device
def _spread(s, R: tl.constexpr):
    """[NT] → broadcastable against the block (the inverse of the thread reductions' shape)."""
    if R == 1:
        e = s[:, None]
    elif R == 2:
        e = s[:, None, None]
    else:
        e = s[:, None, None, None]
    return e


@_device
def _stats_block(
    x_row, y_row, keep_row, tau, start, offs, c1, m_x, s_x, m_y, s_y, a, b, inv_t, c2,
    X_STATE: tl.constexpr, Y_STATE: tl.constexpr, MOMENT_A: tl.constexpr,
    MOMENT_B: tl.constexpr, HAS_KEEP: tl.constexpr, HAS_TAU: tl.constexpr, R: tl.constexpr,
    MASKED: tl.constexpr,
):
    """The NT partial states (m_x, s_x, m_y, s_y, a, b) [NT] after one block of R·NT·INNER
    columns from ``start`` (state t gathers the R·INNER columns thread t reads): the block's
    loads first, then the engine's rescale-and-add per state, reduced inside each thread only."""
    if X_STATE:
        x = _kept_x(x_row, keep_row, tau, start, offs, c1, HAS_KEEP, HAS_TAU, R, MASKED)
    if Y_STATE:
        y = _gather(y_row, start, offs, c1, float("-inf"), R, MASKED).to(tl.float32)
    if X_STATE:
        mx_new = tl.maximum(m_x, _thread_reduce(x, R, True))
        dxs, alpha = _scales(m_x, mx_new, inv_t)
    if Y_STATE:
        my_new = tl.maximum(m_y, _thread_reduce(y, R, True))
        dys, beta = _scales(m_y, my_new, inv_t)
        dy = y - _spread(_finite_or_zero(my_new), R)  # logit units
        s_y = beta * s_y + _thread_reduce(tl.exp2(dy * c2), R, False)
        m_y = my_new
    if X_STATE:
        if MOMENT_A:
            a = _rescale_moment(s_x, a, dxs - dys, alpha)
        if MOMENT_B:
            b = _rescale_moment(s_x, b, dxs, alpha)
        dx = x - _spread(_finite_or_zero(mx_new), R)
        eu = tl.exp2(dx * c2)
        s_x = alpha * s_x + _thread_reduce(eu, R, False)
        # 0·log 0 = 0: an entry with e^u = 0 adds nothing, except where x is finite and
        # y = −inf (dx − dy = +inf): e^u > 0 exactly there, the term is +inf
        if MOMENT_A:
            d = dx - dy
            term = tl.where(eu > 0, eu * d, tl.where(d == float("inf"), d, 0.0))
            a += _thread_reduce(term, R, False) * inv_t
        if MOMENT_B:
            b += _thread_reduce(tl.where(eu > 0, eu * dx, 0.0), R, False) * inv_t
        m_x = mx_new
    return m_x, s_x, m_y, s_y, a, b


@_device
def _nan_max(m, s):
    """The max of a model's state, NaN where its sum is NaN (a NaN logit in the support): the
    same max whether ``tl.max`` drops NaN (compiled ``FMNMX``, Triton 3.9's interpreter) or
    propagates it (Triton 3.6's interpreter), and the engine's (torch's max propagates)."""
    return tl.where(s == s, m, float("nan"))



@triton.jit
def stats_kernel(
    x_ptr, y_ptr, keep_ptr, tau_ptr, tok_ptr, mask_ptr, out_ptr, stats_ptr,
    T, stride_xb, stride_xt, stride_yb, stride_yt, stride_kb, stride_kt,
    V, cols, n_splits, inv_t, c2, temperature, ignore_index,
    X_STATE: tl.constexpr, Y_STATE: tl.constexpr, MOMENT_A: tl.constexpr,
    MOMENT_B: tl.constexpr, HAS_KEEP: tl.constexpr, HAS_TAU: tl.constexpr,
    FINISH: tl.constexpr, LOGP: tl.constexpr, REF_LOGP: tl.constexpr, HAS_MASK: tl.constexpr,
    BLOCK: tl.constexpr, STATE_COLS: tl.constexpr, SX_M_X: tl.constexpr, SX_S_X: tl.constexpr,
    SX_M_Y: tl.constexpr, SX_S_Y: tl.constexpr, SX_A: tl.constexpr, SX_B: tl.constexpr,
    OUT_COLS: tl.constexpr, OUT_KL: tl.constexpr, OUT_LOGP: tl.constexpr,
    OUT_REF_LOGP: tl.constexpr, OUT_ENTROPY: tl.constexpr, STATS_COLS: tl.constexpr,
    ST_SHIFT_X: tl.constexpr, ST_LOG_S_X: tl.constexpr, ST_SHIFT_Y: tl.constexpr,
    ST_LOG_S_Y: tl.constexpr, ST_MEAN_D: tl.constexpr, ST_CAREFUL: tl.constexpr,
    ST_MEAN_U: tl.constexpr, ST_LOGP: tl.constexpr, ST_REF_LOGP: tl.constexpr,
    ST_TAU: tl.constexpr,
):
    """The state (m_x, s_x, m_y, s_y, a, b) of a row over the split's columns; c2 = log2(e)/T.

    X_STATE: the policy's log-sum-exp state (m_x, s_x) over its support (KL, log π̃, H);
    Y_STATE: the reference's (m_y, s_y) (KL, log ρ); MOMENT_A: a = Σ e^u·(u − w) (KL, needs
    both); MOMENT_B: b = Σ e^u·u (entropy). HAS_KEEP / HAS_TAU: the support by a (B, T, V) keep
    mask and/or a per-row threshold. MOMENT_A needs X_STATE and Y_STATE, MOMENT_B needs X_STATE
    (set so by the host). Rows are addressed through (T, stride_b, stride_t) (:func:`_row_offset`).

    FINISH (one program per row): the row's out and stats (:func:`_finish_row`). Otherwise
    ``out[row, split, :]`` ← the state (:func:`_store_state`), merged by :func:`merge_kernel`.

    A block is R pieces of [NT, INNER]: INNER columns of 16 bytes (one vector load per thread),
    NT = 256 (the threads of 8 warps, the most the host launches) or fewer for small blocks.
    Each of the NT states gathers the R·INNER columns of its thread, so the loop reduces inside
    threads only (no barrier, no shuffle); the NT states are merged once after the loop, with
    the engine's rescale to the common maxima and a sum. Full blocks are read unmasked, the
    last partial block masked; a program that is a whole row (``n_splits`` = 1) starts at
    column 0 (so its loads are aligned whenever the row stride is).
    """
    XBITS: tl.constexpr = x_ptr.dtype.element_ty.primitive_bitwidth
    YBITS: tl.constexpr = y_ptr.dtype.element_ty.primitive_bitwidth
    INNER: tl.constexpr = 128 // (XBITS if XBITS > YBITS else YBITS)
    NT: tl.constexpr = BLOCK // INNER if BLOCK // INNER < 256 else 256
    R: tl.constexpr = BLOCK // (NT * INNER)
    tl.static_assert(R == 1 or R == 2 or R == 4, "BLOCK: at most 4 loads of 16 bytes per thread")
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    c0, c1 = _split_columns(split, cols, n_splits, V)
    c_main = c0 + (c1 - c0) // BLOCK * BLOCK  # the end of the full blocks
    x_row = x_ptr + _row_offset(row, T, stride_xb, stride_xt)
    y_row = y_ptr + _row_offset(row, T, stride_yb, stride_yt)
    keep_row = keep_ptr + _row_offset(row, T, stride_kb, stride_kt)
    tau = 0.0
    if HAS_TAU:
        tau = tl.load(tau_ptr + row).to(tl.float32)
    offs = tl.arange(0, NT)[:, None] * INNER + tl.arange(0, INNER)[None, :]
    m_x = tl.full([NT], float("-inf"), tl.float32)
    m_y = tl.full([NT], float("-inf"), tl.float32)
    s_x = tl.full([NT], 0.0, tl.float32)
    s_y = tl.full([NT], 0.0, tl.float32)
    a = tl.full([NT], 0.0, tl.float32)
    b = tl.full([NT], 0.0, tl.float32)
    for start in range(c0, c_main, BLOCK):
        m_x, s_x, m_y, s_y, a, b = _stats_block(
            x_row, y_row, keep_row, tau, start, offs, c1, m_x, s_x, m_y, s_y, a, b, inv_t, c2,
            X_STATE, Y_STATE, MOMENT_A, MOMENT_B, HAS_KEEP, HAS_TAU, R, False,
        )
    if c_main < c1:
        m_x, s_x, m_y, s_y, a, b = _stats_block(
            x_row, y_row, keep_row, tau, c_main, offs, c1, m_x, s_x, m_y, s_y, a, b, inv_t, c2,
            X_STATE, Y_STATE, MOMENT_A, MOMENT_B, HAS_KEEP, HAS_TAU, R, True,
        )
    # the NT states → one: rescale each to the common maxima, then sum (the engine's merge);
    # the fields go through one max and one sum, joined (fewer reductions to synchronise)
    big_x, big_y = tl.split(tl.max(tl.join(m_x, m_y), 0))
    dxs, alpha = _scales(m_x, big_x, inv_t)
    dys, beta = _scales(m_y, big_y, inv_t)
    terms = tl.join(tl.join(alpha * s_x, beta * s_y),
                    tl.join(_rescale_moment(s_x, a, dxs - dys, alpha),
                            _rescale_moment(s_x, b, dxs, alpha)))  # [NT, 2, 2]
    sums, moments = tl.split(tl.sum(terms, 0))
    s_x, s_y = tl.split(sums)
    a, b = tl.split(moments)
    m_x = _nan_max(big_x, s_x)
    m_y = _nan_max(big_y, s_y)
    if FINISH:
        _finish_row(
            row, m_x, s_x, m_y, s_y, a, b, x_row, y_row, keep_row, tau, tok_ptr, mask_ptr,
            out_ptr, stats_ptr, V, temperature, ignore_index, Y_STATE, MOMENT_A, MOMENT_B,
            HAS_KEEP, HAS_TAU, LOGP, REF_LOGP, HAS_MASK, OUT_COLS, OUT_KL, OUT_LOGP,
            OUT_REF_LOGP, OUT_ENTROPY, STATS_COLS, ST_SHIFT_X, ST_LOG_S_X, ST_SHIFT_Y,
            ST_LOG_S_Y, ST_MEAN_D, ST_CAREFUL, ST_MEAN_U, ST_LOGP, ST_REF_LOGP, ST_TAU,
        )
    else:
        _store_state(out_ptr + (row * n_splits + split) * STATE_COLS, m_x, s_x, m_y, s_y, a, b,
                     Y_STATE, MOMENT_A, MOMENT_B, SX_M_X, SX_S_X, SX_M_Y, SX_S_Y, SX_A, SX_B)


@_device
def _store_state(out, m_x, s_x, m_y, s_y, a, b, Y_STATE: tl.constexpr, MOMENT_A: tl.constexpr,
                 MOMENT_B: tl.constexpr, SX_M_X: tl.constexpr, SX_S_X: tl.constexpr,
                 SX_M_Y: tl.constexpr, SX_S_Y: tl.constexpr, SX_A: tl.constexpr,
                 SX_B: tl.constexpr):
    """The state columns at ``out``: fields not computed are 0, the policy's (m_x, s_x) always
    (−inf, 0 where not computed), as :func:`.engine.state_to_tensor` writes them."""
    tl.store(out + SX_M_X, m_x)
    tl.store(out + SX_S_X, s_x)
    if not Y_STATE:
        m_y = 0.0
        s_y = 0.0
    if not MOMENT_A:
        a = 0.0
    if not MOMENT_B:
        b = 0.0
    tl.store(out + SX_M_Y, m_y)
    tl.store(out + SX_S_Y, s_y)
    tl.store(out + SX_A, a)
    tl.store(out + SX_B, b)


@_device
def _finite(v):
    """Whether v is finite (not ±inf, not NaN)."""
    return (v == v) & (tl.abs(v) != float("inf"))


@_device
def _nonneg(v):
    """max(v, 0) with NaN kept (compiled tl.maximum drops NaN)."""
    return tl.where(v < 0.0, 0.0, v)


@_device
def _token_logp(logit_t, m, s, temperature):
    """log-prob of a token: (x_t − m)/T − log s, NaN for a row without mass (s = 0); as
    :func:`.contract.token_logp`."""
    lp = (logit_t - _finite_or_zero(m)) / temperature - tl.log(s)
    return tl.where(s == 0.0, float("nan"), lp)


@_device
def _token_at(tok_ptr, row, V, ignore_index):
    """(column to read, inside [0, V), ignored) of the row's token."""
    tok = tl.load(tok_ptr + row).to(tl.int64)
    inside = (tok >= 0) & (tok < V)
    return tl.where(inside, tok, 0), inside, tok == ignore_index


@_device
def _finish_row(
    row, m_x, s_x, m_y, s_y, a, b, x_row, y_row, keep_row, tau, tok_ptr, mask_ptr, out_ptr,
    stats_ptr, V, temperature, ignore_index, Y_STATE: tl.constexpr, MOMENT_A: tl.constexpr,
    MOMENT_B: tl.constexpr, HAS_KEEP: tl.constexpr, HAS_TAU: tl.constexpr, LOGP: tl.constexpr,
    REF_LOGP: tl.constexpr, HAS_MASK: tl.constexpr, OUT_COLS: tl.constexpr,
    OUT_KL: tl.constexpr, OUT_LOGP: tl.constexpr, OUT_REF_LOGP: tl.constexpr,
    OUT_ENTROPY: tl.constexpr, STATS_COLS: tl.constexpr, ST_SHIFT_X: tl.constexpr,
    ST_LOG_S_X: tl.constexpr, ST_SHIFT_Y: tl.constexpr, ST_LOG_S_Y: tl.constexpr,
    ST_MEAN_D: tl.constexpr, ST_CAREFUL: tl.constexpr, ST_MEAN_U: tl.constexpr,
    ST_LOGP: tl.constexpr, ST_REF_LOGP: tl.constexpr, ST_TAU: tl.constexpr,
):
    """out[row] (KL, log π̃(t), log ρ(t), H) and stats[row] (the columns of the contract) from
    the merged state of a whole row: :func:`.engine.stats_finalize` and the token part of
    :func:`.contract.finish` (tests/ops/test_triton_host.py pins the two together).

    The token's logits are gathered here: an ignored token gives 0, a token outside [0, V) NaN
    (``check=True`` raises on it on the host), a token off the support log π̃(t) = −inf. Masked
    rows (HAS_MASK, mask[row] = 0) get out = 0; their stats are written all the same. The
    careful flag marks rows without a distribution (of the policy; of the reference where it
    is read) and, with the KL, rows with E_π̃[u − w] = ±inf.
    """
    log_s_x = tl.log(s_x)
    valid_x = (s_x > 0.0) & (s_x < float("inf"))
    kl = 0.0
    h = 0.0
    mean_d = 0.0
    mean_u = 0.0
    lp = 0.0
    lq = 0.0
    shift_y = 0.0
    log_y = 0.0
    flag = valid_x == 0
    if Y_STATE:
        log_s_y = tl.log(s_y)
        valid_y = (s_y > 0.0) & (s_y < float("inf"))
        shift_y = _finite_or_zero(m_y)
        log_y = _finite_or_zero(log_s_y)
        flag = flag | (valid_y == 0)
    if MOMENT_A:  # the KL: E_π̃[u − w] − log s_x + log s_y ≥ 0, NaN without both distributions
        mean_d = a / s_x
        kl = tl.where(valid_x & valid_y, _nonneg(mean_d - log_s_x + log_s_y), float("nan"))
        flag = flag | (_finite(mean_d) == 0)
    if MOMENT_B:  # the entropy: log s_x − E_π̃[u] ≥ 0
        mean_u = b / s_x
        h = tl.where(valid_x, _nonneg(log_s_x - mean_u), float("nan"))
    if LOGP:
        at, inside, ignored = _token_at(tok_ptr, row, V, ignore_index)
        x_t = tl.load(x_row + at).to(tl.float32)
        kept = inside
        if HAS_KEEP:
            kept = kept & (tl.load(keep_row + at) != 0)
        if HAS_TAU:
            kept = kept & (x_t >= tau)
        x_t = tl.where(kept, x_t, float("-inf"))
        lp = tl.where(inside, _token_logp(x_t, m_x, s_x, temperature), float("nan"))
        lp = tl.where(ignored, 0.0, lp)
    if REF_LOGP:
        at, inside, ignored = _token_at(tok_ptr, row, V, ignore_index)
        y_t = tl.load(y_row + at).to(tl.float32)
        lq = tl.where(inside, _token_logp(y_t, m_y, s_y, temperature), float("nan"))
        lq = tl.where(ignored, 0.0, lq)
    st = stats_ptr + row * STATS_COLS
    tl.store(st + ST_SHIFT_X, _finite_or_zero(m_x))
    tl.store(st + ST_LOG_S_X, _finite_or_zero(log_s_x))
    tl.store(st + ST_SHIFT_Y, shift_y)
    tl.store(st + ST_LOG_S_Y, log_y)
    tl.store(st + ST_MEAN_D, mean_d)
    tl.store(st + ST_CAREFUL, tl.where(flag, 1.0, 0.0))
    tl.store(st + ST_MEAN_U, mean_u)
    tl.store(st + ST_LOGP, lp)
    tl.store(st + ST_REF_LOGP, lq)
    tau_used = float("-inf")  # the threshold of the support (−inf: none)
    if HAS_TAU:
        tau_used = tau
    tl.store(st + ST_TAU, tau_used)
    if HAS_MASK:
        counted = tl.load(mask_ptr + row) != 0
        kl = tl.where(counted, kl, 0.0)
        lp = tl.where(counted, lp, 0.0)
        lq = tl.where(counted, lq, 0.0)
        h = tl.where(counted, h, 0.0)
    out = out_ptr + row * OUT_COLS
    tl.store(out + OUT_KL, kl)
    tl.store(out + OUT_LOGP, lp)
    tl.store(out + OUT_REF_LOGP, lq)
    tl.store(out + OUT_ENTROPY, h)


@triton.jit
def merge_kernel(
    parts_ptr, x_ptr, y_ptr, keep_ptr, tau_ptr, tok_ptr, mask_ptr, out_ptr, stats_ptr,
    T, stride_xb, stride_xt, stride_yb, stride_yt, stride_kb, stride_kt,
    V, n_splits, inv_t, temperature, ignore_index,
    Y_STATE: tl.constexpr, MOMENT_A: tl.constexpr, MOMENT_B: tl.constexpr,
    HAS_KEEP: tl.constexpr, HAS_TAU: tl.constexpr, FINISH: tl.constexpr, LOGP: tl.constexpr,
    REF_LOGP: tl.constexpr, HAS_MASK: tl.constexpr, SPLITS: tl.constexpr,
    STATE_COLS: tl.constexpr, SX_M_X: tl.constexpr, SX_S_X: tl.constexpr,
    SX_M_Y: tl.constexpr, SX_S_Y: tl.constexpr, SX_A: tl.constexpr, SX_B: tl.constexpr,
    OUT_COLS: tl.constexpr, OUT_KL: tl.constexpr, OUT_LOGP: tl.constexpr,
    OUT_REF_LOGP: tl.constexpr, OUT_ENTROPY: tl.constexpr, STATS_COLS: tl.constexpr,
    ST_SHIFT_X: tl.constexpr, ST_LOG_S_X: tl.constexpr, ST_SHIFT_Y: tl.constexpr,
    ST_LOG_S_Y: tl.constexpr, ST_MEAN_D: tl.constexpr, ST_CAREFUL: tl.constexpr,
    ST_MEAN_U: tl.constexpr, ST_LOGP: tl.constexpr, ST_REF_LOGP: tl.constexpr,
    ST_TAU: tl.constexpr,
):
    """One row: the engine's merge of its ``n_splits`` partial states (``parts`` (N, splits,
    6) from :func:`stats_kernel`; SPLITS a power of two ≥ n_splits): rescale to the common
    maxima, then a sum (a = +inf stays +inf). FINISH: the row's out and stats
    (:func:`_finish_row`, the flags as for :func:`stats_kernel`); else the merged state to
    ``out[row, :]`` (the state op)."""
    row = tl.program_id(0).to(tl.int64)
    k = tl.arange(0, SPLITS)
    live = k < n_splits
    part = parts_ptr + (row * n_splits + k) * STATE_COLS
    m_xs = tl.load(part + SX_M_X, mask=live, other=float("-inf"))
    s_xs = tl.load(part + SX_S_X, mask=live, other=0.0)
    m_x = tl.max(m_xs, 0)
    dxs, alpha = _scales(m_xs, m_x, inv_t)
    s_x = tl.sum(alpha * s_xs, 0)
    m_y = float("-inf")
    s_y = 0.0
    a = 0.0
    b = 0.0
    if Y_STATE:
        m_ys = tl.load(part + SX_M_Y, mask=live, other=float("-inf"))
        m_y = tl.max(m_ys, 0)
        dys, beta = _scales(m_ys, m_y, inv_t)
        s_y = tl.sum(beta * tl.load(part + SX_S_Y, mask=live, other=0.0), 0)
        if MOMENT_A:
            a_s = tl.load(part + SX_A, mask=live, other=0.0)
            a = tl.sum(_rescale_moment(s_xs, a_s, dxs - dys, alpha), 0)
    if MOMENT_B:
        b_s = tl.load(part + SX_B, mask=live, other=0.0)
        b = tl.sum(_rescale_moment(s_xs, b_s, dxs, alpha), 0)
    m_x = _nan_max(m_x, s_x)  # NaN whether tl.max drops NaN or not
    m_y = _nan_max(m_y, s_y)
    if FINISH:
        tau = 0.0
        if HAS_TAU:
            tau = tl.load(tau_ptr + row).to(tl.float32)
        _finish_row(
            row, m_x, s_x, m_y, s_y, a, b, x_ptr + _row_offset(row, T, stride_xb, stride_xt),
            y_ptr + _row_offset(row, T, stride_yb, stride_yt),
            keep_ptr + _row_offset(row, T, stride_kb, stride_kt), tau, tok_ptr, mask_ptr,
            out_ptr, stats_ptr, V, temperature, ignore_index, Y_STATE, MOMENT_A, MOMENT_B,
            HAS_KEEP, HAS_TAU, LOGP, REF_LOGP, HAS_MASK, OUT_COLS, OUT_KL, OUT_LOGP,
            OUT_REF_LOGP, OUT_ENTROPY, STATS_COLS, ST_SHIFT_X, ST_LOG_S_X, ST_SHIFT_Y,
            ST_LOG_S_Y, ST_MEAN_D, ST_CAREFUL, ST_MEAN_U, ST_LOGP, ST_REF_LOGP, ST_TAU,
        )
    else:
        _store_state(out_ptr + row * STATE_COLS, m_x, s_x, m_y, s_y, a, b, Y_STATE, MOMENT_A,
                     MOMENT_B, SX_M_X, SX_S_X, SX_M_Y, SX_S_Y, SX_A, SX_B)


@_device
def _grad_tile(
    x_row, y_row, keep_row, gx_row, gy_row, tau, start, offs, c1, tok, at_tok_x, at_tok_y,
    shift_x, log2_s_x, shift_y, log2_s_y, mean_d, mean_u, g_kl, g_lp, g_rl, g_h, inv_t, c2,
    KL: tl.constexpr, LOGP: tl.constexpr, REF_LOGP: tl.constexpr, ENTROPY: tl.constexpr,
    NEED_X: tl.constexpr, NEED_Y: tl.constexpr, NEED_P: tl.constexpr, NEED_Q: tl.constexpr,
    HAS_TOKEN: tl.constexpr, HAS_KEEP: tl.constexpr, HAS_TAU: tl.constexpr, MASKED: tl.constexpr,
):
    """∂/∂x and ∂/∂y of one tile of columns ``start + offs`` of a row, written in the inputs' dtypes
    (masked to the columns before ``c1`` where MASKED: the row's last, partial tile)."""
    col = start + offs
    if HAS_TOKEN:
        is_tok = col == tok
    if NEED_P:  # the policy's probabilities (KL, LOGP or ENTROPY)
        x = _kept_x(x_row, keep_row, tau, start, offs, c1, HAS_KEEP, HAS_TAU, 1, MASKED)
    if NEED_Q:  # the reference's (KL or REF_LOGP)
        y = _load(y_row, col, c1, float("-inf"), MASKED).to(tl.float32)
    if NEED_P:
        dx = x - shift_x  # logit units
        p = tl.exp2(dx * c2 - log2_s_x)
        live = p > 0
    if NEED_Q:
        dy = y - shift_y
        q = tl.exp2(dy * c2 - log2_s_y)
    if NEED_X:
        gx = tl.full(col.shape, 0.0, tl.float32)
        if KL:
            t_kl = p * ((dx - dy) * inv_t - mean_d)
            gx += _term(live, t_kl, g_kl)
        if ENTROPY:
            t_h = p * (dx * inv_t - mean_u)
            gx -= _term(live, t_h, g_h)
        if LOGP:
            gx += tl.where(is_tok, at_tok_x, _term(live, -p, g_lp))
        _store(gx_row, col, c1, (gx * inv_t).to(gx_row.dtype.element_ty), MASKED)
    if NEED_Y:
        gy = tl.full(col.shape, 0.0, tl.float32)
        if KL:
            qp = q - p
            gy += _term(qp == qp, qp, g_kl)  # NaN only where both vanish
        if REF_LOGP:
            gy += tl.where(is_tok, at_tok_y, _term(q > 0, -q, g_rl))
        _store(gy_row, col, c1, (gy * inv_t).to(gy_row.dtype.element_ty), MASKED)


@triton.jit
def grad_kernel(
    x_ptr, y_ptr, keep_ptr, tau_ptr, gx_ptr, gy_ptr, stats_ptr, g_ptr, tok_ptr, mask_ptr,
    owned_ptr, T, stride_xb, stride_xt, stride_yb, stride_yt, stride_kb, stride_kt, stride_gn,
    stride_gc, V, inv_t, c2, ignore_index,
    KL: tl.constexpr, LOGP: tl.constexpr, REF_LOGP: tl.constexpr, ENTROPY: tl.constexpr,
    NEED_X: tl.constexpr, NEED_Y: tl.constexpr, NEED_P: tl.constexpr, NEED_Q: tl.constexpr,
    HAS_TOKEN: tl.constexpr, HAS_KEEP: tl.constexpr, HAS_TAU: tl.constexpr,
    HAS_MASK: tl.constexpr, HAS_OWNED: tl.constexpr, BLOCK: tl.constexpr, TILES: tl.constexpr,
    OUT_COLS: tl.constexpr, OUT_KL: tl.constexpr, OUT_LOGP: tl.constexpr,
    OUT_REF_LOGP: tl.constexpr, OUT_ENTROPY: tl.constexpr, STATS_COLS: tl.constexpr,
    ST_SHIFT_X: tl.constexpr, ST_LOG_S_X: tl.constexpr, ST_SHIFT_Y: tl.constexpr,
    ST_LOG_S_Y: tl.constexpr, ST_MEAN_D: tl.constexpr, ST_MEAN_U: tl.constexpr,
    ST_LOGP: tl.constexpr, ST_REF_LOGP: tl.constexpr,
):
    """TILES (row, block) tiles of ∂/∂x and ∂/∂y of Σ g·out from the (N, 10) stats: program
    (row, j) takes columns [j·TILES·BLOCK, (j + 1)·TILES·BLOCK), loading the row's scalars once.

    With p = π̃, q = ρ, u, w the tempered shifted logits, g = (g_kl, g_lp, g_rl, g_h) the row's
    upstream gradient (``g_ptr`` (N, 4) with strides (stride_gn, stride_gc), any float dtype)::

        gx = [p·(g_kl·((u − w) − E_π̃[u − w]) − g_h·(u − E_π̃[u])) − g_lp·(p − onehot)]/T
        gy = [g_kl·(q − p) − g_rl·(q − onehot)]/T

    g is read in the columns wanted only, 0 on masked rows (HAS_MASK) and, in the log-prob
    columns, at ignored tokens; a token with owned[row] = 0 (HAS_OWNED: another rank's column)
    takes no onehot term. At the token the (1 − p_t)·g_lp and (1 − q_t)·g_rl factors come from
    −expm1 of the saved log-probs (exact for p_t → 1). Each term is dropped where its g is 0 and
    the p-terms where p = 0 (0·log 0, −inf logits, off the support), so masked garbage rows
    give exactly 0 and −inf entries finite gradients. Full tiles are read and written
    unmasked, the row's last partial tile masked. Rows of x, y and keep are addressed through
    (T, stride_b, stride_t) (:func:`_row_offset`); gx, gy are (N, V) contiguous.
    """
    row = tl.program_id(0).to(tl.int64)
    c0 = tl.program_id(1) * (BLOCK * TILES)
    c1 = tl.minimum(c0 + BLOCK * TILES, V)
    c_main = c0 + (c1 - c0) // BLOCK * BLOCK  # the end of the full tiles
    st = stats_ptr + row * STATS_COLS
    gr = g_ptr + row * stride_gn
    counted = True
    if HAS_MASK:
        counted = tl.load(mask_ptr + row) != 0
    g_kl = 0.0
    g_lp = 0.0
    g_rl = 0.0
    g_h = 0.0
    if KL:
        g_kl = tl.where(counted, tl.load(gr + OUT_KL * stride_gc).to(tl.float32), 0.0)
    if ENTROPY:
        g_h = tl.where(counted, tl.load(gr + OUT_ENTROPY * stride_gc).to(tl.float32), 0.0)
    tok = -1
    at_tok_x = 0.0
    at_tok_y = 0.0
    if HAS_TOKEN:  # LOGP or REF_LOGP (the flags combined on the host: plain constexpr tests)
        tok = tl.load(tok_ptr + row).to(tl.int64)
        counted_tok = counted & (tok != ignore_index)
        if HAS_OWNED:  # the token in another rank's columns: no onehot term here
            tok = tl.where(tl.load(owned_ptr + row) != 0, tok, -1)
    if LOGP:
        g_lp = tl.where(counted_tok, tl.load(gr + OUT_LOGP * stride_gc).to(tl.float32), 0.0)
        lp = tl.load(st + ST_LOGP)
        # at the token: (1 − p_t)·g = −expm1(log p_t)·g; 0 for a token off the support (its
        # logit, fixed at −inf by keep/tau, does not move log π̃(t))
        at_tok_x = tl.where((g_lp != 0) & (lp != float("-inf")), -_expm1(lp) * g_lp, 0.0)
    if REF_LOGP:
        g_rl = tl.where(counted_tok, tl.load(gr + OUT_REF_LOGP * stride_gc).to(tl.float32), 0.0)
        at_tok_y = tl.where(g_rl != 0, -_expm1(tl.load(st + ST_REF_LOGP)) * g_rl, 0.0)
    tau = 0.0
    if HAS_TAU:
        tau = tl.load(tau_ptr + row).to(tl.float32)
    shift_x = 0.0
    log2_s_x = 0.0
    mean_d = 0.0
    mean_u = 0.0
    if NEED_P:
        shift_x = tl.load(st + ST_SHIFT_X)
        log2_s_x = tl.load(st + ST_LOG_S_X) * 1.4426950408889634
    if KL:
        mean_d = tl.load(st + ST_MEAN_D)
    if ENTROPY:
        mean_u = tl.load(st + ST_MEAN_U)
    shift_y = 0.0
    log2_s_y = 0.0
    if NEED_Q:
        shift_y = tl.load(st + ST_SHIFT_Y)
        log2_s_y = tl.load(st + ST_LOG_S_Y) * 1.4426950408889634
    x_row = x_ptr + _row_offset(row, T, stride_xb, stride_xt)
    y_row = y_ptr + _row_offset(row, T, stride_yb, stride_yt)
    keep_row = keep_ptr + _row_offset(row, T, stride_kb, stride_kt)
    gx_row = gx_ptr + row * V
    gy_row = gy_ptr + row * V
    offs = tl.arange(0, BLOCK)
    for start in range(c0, c_main, BLOCK):
        _grad_tile(
            x_row, y_row, keep_row, gx_row, gy_row, tau, start, offs, c1, tok, at_tok_x,
            at_tok_y, shift_x, log2_s_x, shift_y, log2_s_y, mean_d, mean_u, g_kl, g_lp, g_rl,
            g_h, inv_t, c2, KL, LOGP, REF_LOGP, ENTROPY, NEED_X, NEED_Y, NEED_P, NEED_Q,
            HAS_TOKEN, HAS_KEEP, HAS_TAU, False,
        )
    if c_main < c1:
        _grad_tile(
            x_row, y_row, keep_row, gx_row, gy_row, tau, c_main, offs, c1, tok, at_tok_x,
            at_tok_y, shift_x, log2_s_x, shift_y, log2_s_y, mean_d, mean_u, g_kl, g_lp, g_rl,
            g_h, inv_t, c2, KL, LOGP, REF_LOGP, ENTROPY, NEED_X, NEED_Y, NEED_P, NEED_Q,
            HAS_TOKEN, HAS_KEEP, HAS_TAU, True,
        )
