"""The one engine: per-row partial state → associative merge → finalize.

Every exact-KL path of klpenalty computes the same per-row state over a slice of the vocabulary
(a cache-sized tile of a backend's loop, or one rank's shard in
:mod:`klpenalty.distributed.vocab_parallel`), merges the states of the slices and finalizes the
merged state into the statistics and the per-row numbers their backward needs. The math is
here; the derivations are in docs/numerics.md. This module depends only on the column
constants of :mod:`.contract`.

Shape letters: N rows (positions), C columns of one vocabulary slice, V the whole vocabulary.

**State** of a row over a slice S, temperature T (:class:`StatsState`)::

    m_x = max_S x,   m_y = max_S y                  (logit units; −inf if none)
    u = (x − m_x)/T, w = (y − m_y)/T
    s_x = Σ_S e^u,  s_y = Σ_S e^w,  a = Σ_S e^u·(u − w),  b = Σ_S e^u·u

with 0·log 0 = 0 (an entry whose policy logit is −inf adds nothing to ``a`` or ``b``) and
a = +inf where the policy has mass and the reference has none: a finite x where y = −inf,
decided from the logits, also where e^u underflows to 0 (softmax of a finite logit is > 0).
:func:`stats_partial` computes it for one tile in one read.

**Merge** (associative, commutative; :func:`stats_merge`): rescale both states to the common
maxima M (δ = (m − M)/T ≤ 0, α = e^{δ_x}, β = e^{δ_y}) and add::

    s_x ← α·s_x,   s_y ← β·s_y,   a ← α·(a + (δ_x − δ_y)·s_x),   b ← α·(b + δ_x·s_x)

(a = +inf stays +inf, whatever α).

Across ranks this is an all-reduce MAX of the maxima, :func:`stats_rescale`, and an all-reduce
SUM of the sums.

**Finalize** (:func:`stats_finalize`): KL = a/s_x − log s_x + log s_y, H = log s_x − b/s_x
(both clamped at 0, NaN for a row without a distribution), and the (N, 10) stats of
:mod:`.contract` (``ST_*``). :func:`stats_grad_tile` writes one gradient tile from them;
:func:`stats_token_grads` the entries at the sampled tokens.

Numerics: math in float32 for float16/bfloat16/float32 inputs, float64 for float64 inputs
(:func:`klpenalty._validation.compute_dtype`).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .contract import (
    STATE_COLS,
    ST_CAREFUL,
    ST_LOG_S_X,
    ST_LOG_S_Y,
    ST_LOGP,
    ST_MEAN_D,
    ST_MEAN_U,
    ST_REF_LOGP,
    ST_SHIFT_X,
    ST_SHIFT_Y,
    STATS_COLS,
    Want,
)

__all__ = [
    "KLState",
    "LSEState",
    "Workspace",
    "finite_or_zero",
    "kl_rescale",
    "kl_finalize",
    "lse_rescale",
    "EntropyState",
    "entropy_rescale",
    "entropy_finalize",
    "StatsState",
    "stats_partial",
    "stats_rescale",
    "stats_merge",
    "stats_finalize",
    "stats_grad_tile",
    "stats_token_grads",
    "state_to_tensor",
    "state_from_tensor",
]

_LOG2E = math.log2(math.e)
_INF = float("inf")


class KLState(NamedTuple):
    """Per-row KL state over a vocabulary slice; each field (N,) in the compute dtype."""

    m_x: torch.Tensor  # max policy logit (logit units), −inf if the slice has no policy mass
    s_x: torch.Tensor  # Σ e^u
    m_y: torch.Tensor  # max reference logit
    s_y: torch.Tensor  # Σ e^w
    a: torch.Tensor  # Σ e^u (u − w)


class LSEState(NamedTuple):
    """Per-row log-sum-exp state over a vocabulary slice; each field (N,)."""

    m: torch.Tensor  # max logit (logit units)
    s: torch.Tensor  # Σ e^{(x − m)/T}


class EntropyState(NamedTuple):
    """Per-row entropy state over a vocabulary slice: the log-sum-exp state and Σ e^u·u."""

    m: torch.Tensor  # max logit (logit units)
    s: torch.Tensor  # Σ e^u, u = (x − m)/T
    b: torch.Tensor  # Σ e^u·u, with 0·log 0 = 0


class StatsState(NamedTuple):
    """Per-row state of the one-pass token statistics over a vocabulary slice.

    Each field (N,) in the compute dtype, or None where the call does not need it.
    """

    m_x: torch.Tensor  # max policy logit (on the support), logit units
    s_x: torch.Tensor  # Σ e^u
    b: torch.Tensor | None  # Σ e^u·u (0·log 0 = 0): the entropy's moment, or None
    m_y: torch.Tensor | None  # max reference logit, or None without a reference
    s_y: torch.Tensor | None  # Σ e^w
    a: torch.Tensor | None  # Σ e^u·(u − w): the KL's moment, or None


def finite_or_zero(m: torch.Tensor) -> torch.Tensor:
    """The shift used for a row: its max if finite, else 0 (no mass, +inf or NaN)."""
    return torch.nan_to_num(m, nan=0.0, posinf=0.0, neginf=0.0)


# Row stride of a workspace tile: the columns rounded up to a multiple of this. ATen's CPU
# elementwise loops run vectors over a contiguous range and finish its last (< 2 vectors)
# elements with the scalar function, whose exp2 differs from the vector one in the last bit.
# A contiguous (r, c) tile is one range, so which entries of a row took the scalar path would
# depend on r and on the row's place in the tile (the batch around it). A row stride that is a
# multiple of 64 elements either leaves no remainder (c a multiple of 64: every entry takes
# the vector path) or makes each row its own range (the same remainder in every row).
ROW_STRIDE_MULTIPLE = 64


def _row_stride(cols: int) -> int:
    return -(-cols // ROW_STRIDE_MULTIPLE) * ROW_STRIDE_MULTIPLE


class Workspace:
    """Reusable flat buffers, viewed as (r, c) tiles with a row stride of c rounded up to
    :data:`ROW_STRIDE_MULTIPLE` elements (contiguous when c is a multiple of it), so that a
    row's elementwise results do not depend on the other rows of its tile.

    A tile loop allocates its temporaries once and reuses them for every tile.
    """

    def __init__(self, rows: int, cols: int, dtype: torch.dtype, device: torch.device):
        self.size = rows * _row_stride(cols)
        self.dtype = dtype
        self.device = device
        self._bufs: dict[str, torch.Tensor] = {}

    def get(self, name: str, r: int, c: int) -> torch.Tensor:
        buf = self._bufs.get(name)
        if buf is None:
            buf = torch.empty(self.size, dtype=self.dtype, device=self.device)
            self._bufs[name] = buf
        stride = _row_stride(c)
        return buf[: r * stride].view(r, stride)[:, :c]


def _shifted(out: torch.Tensor, t: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """out ← t − shift (per row), exact for logits near their row max even at ±1e4.

    A low-precision tile is upcast into ``out`` first (a mixed-dtype ATen op would allocate a
    converted copy of the tile).
    """
    if t.dtype != out.dtype:
        return out.copy_(t).sub_(shift.unsqueeze(-1))
    return torch.sub(t, shift.unsqueeze(-1), out=out)


def _exp_tempered(
    out: torch.Tensor, d: torch.Tensor, temperature: float, log_norm: torch.Tensor | None = None
) -> torch.Tensor:
    """out ← exp(d/T − log_norm) for a shifted tile d (r, c); ATen's exp2 is ~2× exp on CPU."""
    if log_norm is None:
        torch.mul(d, _LOG2E / temperature, out=out)
    else:
        torch.add((log_norm * -_LOG2E).unsqueeze(-1), d, alpha=_LOG2E / temperature, out=out)
    return out.exp2_()


# ------------------------------------------------------------------------------------ KL
def _moment_sum(
    d: torch.Tensor, e: torch.Tensor, temperature: float, careful: bool | None, out: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(Σ_row e·d/T, careful flags) with 0·log 0 = 0; the products go to ``out`` (r, c).

    ``d`` holds T·f(u) for the tile's entries, ``e`` their e^u. Where e^u = 0 a term
    0·(−inf) or 0·NaN is dropped (0·log 0 = 0); a term with f = +inf (a finite policy logit
    where ρ is −inf) is +inf whether or not e^u underflowed: e^u of a finite u is > 0.
    ``out`` may be ``d`` itself where f is never +inf on a row with a distribution (the
    entropy's u). ``careful`` as in :func:`stats_partial`; the flags mark the rows that needed
    the dropping (None if none).
    """
    torch.mul(d, e, out=out)
    if careful is None:
        total = out.sum(-1)
        if math.isfinite(float(total.sum())):
            return total / temperature, None
        flags = ~torch.isfinite(total)
    else:
        flags = torch.ones(d.shape[0], dtype=torch.bool, device=d.device)
    out.masked_fill_(e == 0, 0.0)
    total = out.sum(-1)
    if out is not d:  # rows with a term f = +inf: the moment is +inf
        total.masked_fill_(d.isposinf().any(-1), _INF)
    return total / temperature, flags


def _scales(m: torch.Tensor, big: torch.Tensor, temperature: float):
    """(δ, α) for rescaling a state with max ``m`` to the max ``big``: δ = (m − M)/T, α = e^δ.

    δ is exactly 0 where m == M (also both −inf); δ = −inf and α = 0 where the slice had no mass.
    """
    delta = torch.where(m == big, torch.zeros_like(m), (m - big) / temperature)
    return delta, torch.exp(delta)


def kl_rescale(state: KLState, m_x: torch.Tensor, m_y: torch.Tensor, temperature: float) -> KLState:
    """The same state expressed against the (larger or equal) maxima ``m_x``, ``m_y`` (N,)."""
    dx, alpha = _scales(state.m_x, m_x, temperature)
    dy, beta = _scales(state.m_y, m_y, temperature)
    a = _rescale_moment(state.s_x, state.a, dx - dy, alpha)
    return KLState(m_x, alpha * state.s_x, m_y, beta * state.s_y, a)


def _rescale_moment(
    s: torch.Tensor, a: torch.Tensor, shift: torch.Tensor, alpha: torch.Tensor
) -> torch.Tensor:
    """α·(a + shift·s): a sum Σ e^u·f(u) after u ← u + δ with f shifting by ``shift``.

    The KL's ``a`` (shift δ_x − δ_y) and the entropy's ``b`` (shift δ_x). The shift term counts
    only where the slice has mass (else 0·inf); the result is 0 where α = 0 (no mass), and
    +inf where ``a`` is +inf: a slice whose policy has mass where ρ has none keeps KL = +inf
    however far below the common maximum its own maximum lies (α may underflow to 0).
    """
    shift_term = torch.where(s > 0, shift * s, torch.zeros_like(s))
    out = torch.where(alpha > 0, alpha * (a + shift_term), torch.zeros_like(a))
    return torch.where(torch.isposinf(a), a, out)


def kl_finalize(
    state: KLState, careful: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(KL (N,), stats (N, 6)) from the merged state of whole rows.

    ``careful``: (N,) bool rows that needed the 0·log 0 arithmetic in the forward (or None);
    rows with KL = +inf or without a distribution are flagged too.
    """
    s_x, s_y, a = state.s_x, state.s_y, state.a
    mean_d = a / s_x  # E_π[u − w]; +inf where π has mass ρ lacks
    log_s_x, log_s_y = torch.log(s_x), torch.log(s_y)
    kl = (mean_d - log_s_x + log_s_y).clamp_min(0.0)  # exact KL ≥ 0; NaN stays NaN
    valid = (s_x > 0) & torch.isfinite(s_x) & (s_y > 0) & torch.isfinite(s_y)
    kl = torch.where(valid, kl, torch.full_like(kl, float("nan")))
    flag = ~valid | ~torch.isfinite(mean_d)
    if careful is not None:
        flag = flag | careful
    stats = torch.stack(
        [
            finite_or_zero(state.m_x),
            finite_or_zero(log_s_x),
            finite_or_zero(state.m_y),
            finite_or_zero(log_s_y),
            mean_d,
            flag.to(kl.dtype),
        ],
        dim=-1,
    )  # (N, 6)
    return kl, stats


# ------------------------------------------------------------------------------------ LSE
def lse_rescale(state: LSEState, m: torch.Tensor, temperature: float) -> LSEState:
    """The same state against the (larger or equal) max ``m`` (N,)."""
    _, alpha = _scales(state.m, m, temperature)
    return LSEState(m, alpha * state.s)


# ------------------------------------------------------------------------------------ entropy

def entropy_rescale(state: EntropyState, m: torch.Tensor, temperature: float) -> EntropyState:
    """The same state against the (larger or equal) max ``m`` (N,)."""
    delta, alpha = _scales(state.m, m, temperature)
    return EntropyState(m, alpha * state.s, _rescale_moment(state.s, state.b, delta, alpha))


def entropy_finalize(state: EntropyState) -> tuple[torch.Tensor, torch.Tensor]:
    """(H (N,), stats (N, 3): shift, log s, E_π[u]) from the merged state of whole rows.

    H = log s − b/s, clamped at 0 (exactly 0 for a row with one finite entry); NaN where the
    row has no distribution (all −inf, or +inf/NaN).
    """
    s = state.s
    mean_u = state.b / s  # E_π[u]
    log_s = torch.log(s)
    h = (log_s - mean_u).clamp_min(0.0)  # NaN stays NaN
    valid = (s > 0) & torch.isfinite(s)
    h = torch.where(valid, h, torch.full_like(h, float("nan")))
    stats = torch.stack([finite_or_zero(state.m), finite_or_zero(log_s), mean_u], dim=-1)
    return h, stats



# ------------------------------------------------------------------------------ token stats
def stats_partial(
    x: torch.Tensor,
    y: torch.Tensor | None,
    temperature: float,
    ws: Workspace,
    careful: bool | None,
    *,
    kl: bool,
    entropy: bool,
) -> tuple[StatsState, torch.Tensor | None]:
    """:class:`StatsState` of one (r, c) tile of raw logits, from one read of the tile.

    Args:
        x: (r, c) policy logits (−inf off the support).  y: (r, c) reference logits or None.
        temperature: > 0.
        ws: workspace of the compute dtype, at least r·c elements.
        careful: True = always use the 0·log 0 arithmetic; None = check on the host whether
            the tile needs it (free on CPU, a sync on accelerators).
        kl: compute a = Σ e^u·(u − w) (needs ``y``).  entropy: compute b = Σ e^u·u.

    Returns:
        (state, flags): fields not asked for are None; flags (r,) bool marks the rows that
        needed the 0·log 0 arithmetic in either moment (None if none did).
    """
    r, c = x.shape
    m_x = x.amax(-1).to(ws.dtype)  # (r,)
    d = _shifted(ws.get("d", r, c), x, finite_or_zero(m_x))  # T·u
    e = _exp_tempered(ws.get("e", r, c), d, temperature)  # e^u
    s_x = e.sum(-1)
    b = flags = None
    if entropy:  # Σ e^u·u, in place unless the KL still needs d
        b, flags = _moment_sum(d, e, temperature, careful, ws.get("h", r, c) if kl else d)
    if y is None:
        return StatsState(m_x, s_x, b, None, None, None), flags
    m_y = y.amax(-1).to(ws.dtype)  # (r,)
    w = _shifted(ws.get("w", r, c), y, finite_or_zero(m_y))  # T·w
    if kl:
        d.sub_(w)  # T·(u − w)
    s_y = _exp_tempered(w, w, temperature).sum(-1)  # e^w (in place)
    a = None
    if kl:
        a, kl_flags = _moment_sum(d, e, temperature, careful, w)  # Σ e^u·(u − w); w is free
        if kl_flags is not None:
            flags = kl_flags if flags is None else flags | kl_flags
    return StatsState(m_x, s_x, b, m_y, s_y, a), flags


def stats_rescale(
    state: StatsState, m_x: torch.Tensor, m_y: torch.Tensor | None, temperature: float
) -> StatsState:
    """The same state against the (larger or equal) maxima ``m_x``, ``m_y`` (N,): the KL's,
    the entropy's and the log-sum-exp's rescale on the fields present."""
    s_x, b = lse_rescale(LSEState(state.m_x, state.s_x), m_x, temperature).s, None
    if state.b is not None:
        b = entropy_rescale(EntropyState(state.m_x, state.s_x, state.b), m_x, temperature).b
    if state.m_y is None:
        return StatsState(m_x, s_x, b, None, None, None)
    s_y, a = lse_rescale(LSEState(state.m_y, state.s_y), m_y, temperature).s, None
    if state.a is not None:
        kl = KLState(state.m_x, state.s_x, state.m_y, state.s_y, state.a)
        a = kl_rescale(kl, m_x, m_y, temperature).a
    return StatsState(m_x, s_x, b, m_y, s_y, a)


def stats_merge(s0: StatsState, s1: StatsState, temperature: float) -> StatsState:
    """Merge the token-stats states of two disjoint vocabulary slices of the same rows."""
    m_x = torch.maximum(s0.m_x, s1.m_x)
    m_y = None if s0.m_y is None else torch.maximum(s0.m_y, s1.m_y)
    r0 = stats_rescale(s0, m_x, m_y, temperature)
    r1 = stats_rescale(s1, m_x, m_y, temperature)
    return StatsState(*(None if f0 is None else f0 + f1 for f0, f1 in zip(r0, r1)))._replace(
        m_x=m_x, m_y=m_y
    )


def stats_finalize(
    state: StatsState, careful: torch.Tensor | None
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """(KL (N,) or None, H (N,) or None, stats (N, 10)) from the merged state of whole rows.

    The stats columns are those of :mod:`.contract` (``ST_*``): the KL's six
    (:func:`kl_finalize`; without the KL the shifts and log-sums alone, the careful flag for
    rows without a distribution or with ``careful``), E_π[u] (:func:`entropy_finalize`) when
    the entropy is wanted; the token log-probs (columns 7, 8) are the caller's; 0 elsewhere.
    """
    stats = state.s_x.new_zeros(state.s_x.shape[0], STATS_COLS)
    kl = h = None
    if state.a is not None:
        kl, stats[:, :6] = kl_finalize(
            KLState(state.m_x, state.s_x, state.m_y, state.s_y, state.a), careful
        )
    else:
        flag = torch.zeros_like(state.s_x, dtype=torch.bool) if careful is None else careful
        for m, s, shift_col, log_col in (
            (state.m_x, state.s_x, ST_SHIFT_X, ST_LOG_S_X),
            (state.m_y, state.s_y, ST_SHIFT_Y, ST_LOG_S_Y),
        ):
            if m is not None:
                stats[:, shift_col] = finite_or_zero(m)
                stats[:, log_col] = finite_or_zero(torch.log(s))
                flag = flag | ~((s > 0) & torch.isfinite(s))
        stats[:, ST_CAREFUL] = flag.to(stats.dtype)
    if state.b is not None:
        h, ent = entropy_finalize(EntropyState(state.m_x, state.s_x, state.b))
        stats[:, ST_MEAN_U] = ent[:, 2]
    return kl, h, stats


def stats_grad_tile(
    x: torch.Tensor,
    y: torch.Tensor | None,
    stats: torch.Tensor,
    g: torch.Tensor,
    temperature: float,
    want: int,
    ws: Workspace,
    gx: torch.Tensor | None,
    gy: torch.Tensor | None,
    careful: bool | None,
) -> None:
    """Write the gradient tiles of Σ_rows g·(KL, log π(t), log ρ(t), H), the token terms aside.

    Args:
        x: (r, c) policy logits, −inf off the support.  y: (r, c) reference logits or None.
        stats: (r, 10) from :func:`stats_finalize`.
        g: (r, 4) upstream gradient in the compute dtype, 0 where a column gets no gradient
            (masked rows, ignored tokens, columns not in ``want``).
        want: the :class:`.contract.Want` bits: the KL and entropy terms are computed only when wanted.
        gx, gy: (r, c) outputs in the inputs' dtypes, or None when not needed (``gy`` needs y).
        careful: True = zero the entries where π = 0 (−inf logits, off the support), the
            rows with g = 0 (masked rows may hold garbage) and the KL term of rows with
            g_kl = 0 (a row with KL = +inf); None = only if the tile came out non-finite (a
            host read: free on CPU).

    gx ← π·[g_kl·((u − w) − E_π[u − w]) − g_h·(u − E_π[u]) − g_lp]/T,
    gy ← [(g_kl − g_rl)·ρ − g_kl·π]/T (the token's own terms: :func:`stats_token_grads`).
    """
    r, c = x.shape
    t = temperature
    g_kl, g_lp, g_rl, g_h = (col.unsqueeze(-1) for col in g.unbind(-1))  # (r, 1) each
    d = _shifted(ws.get("d", r, c), x, stats[:, ST_SHIFT_X])  # T·u
    p = _exp_tempered(ws.get("e", r, c), d, t, stats[:, ST_LOG_S_X])  # π
    w = None if y is None else _shifted(ws.get("w", r, c), y, stats[:, ST_SHIFT_Y])  # T·w
    zero_rows = None
    if gx is not None:
        acc = ws.get("acc", r, c)
        const = -t * g_lp  # (r, 1): the row constant of T·[...]
        if w is not None and want & Want.KL:  # g_kl·T·((u − w) − E_π[u − w])
            torch.sub(d, w, out=acc).sub_(stats[:, ST_MEAN_D : ST_MEAN_D + 1] * t).mul_(g_kl)
            if careful is not False:  # a row with KL = +inf and g_kl = 0: no NaN from 0·inf
                acc.masked_fill_(g_kl == 0, 0.0)
        else:
            acc.zero_()
        if want & Want.ENTROPY:  # − g_h·T·(u − E_π[u])
            acc.addcmul_(d, -g_h)
            const = const + t * g_h * stats[:, ST_MEAN_U : ST_MEAN_U + 1]
        acc.add_(const).mul_(p).mul_(1.0 / (t * t))
        if careful or (careful is None and not bool(torch.isfinite(acc).all())):
            zero_rows = (g == 0).all(-1, keepdim=True)
            acc.masked_fill_(p == 0, 0.0).masked_fill_(zero_rows, 0.0)
        gx.copy_(acc)
    if gy is not None:
        q = _exp_tempered(w, w, t, stats[:, ST_LOG_S_Y])  # ρ, in place
        q.mul_(g_kl - g_rl).addcmul_(p, -g_kl).mul_(1.0 / t)
        if careful or (careful is None and not bool(torch.isfinite(q).all())):
            zero_rows = (g == 0).all(-1, keepdim=True) if zero_rows is None else zero_rows
            q.nan_to_num_(nan=0.0).masked_fill_(zero_rows, 0.0)
        gy.copy_(q)


def stats_token_grads(
    x_t: torch.Tensor,
    y_t: torch.Tensor | None,
    stats: torch.Tensor,
    g: torch.Tensor,
    temperature: float,
    want: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gradient entries at the sampled token (N,), which replace the tile's there.

    Args:
        x_t: (N,) policy logit at the token in the compute dtype (−inf off the support).
        y_t: (N,) reference logit at the token, or None.
        stats: (N, 10) with the log-probs of the token (columns 7, 8).
        g: (N, 4) as in :func:`stats_grad_tile`.

    Returns:
        (∂/∂x_t, ∂/∂y_t or None): π_t·[g_kl·((u_t − w_t) − E_π[u − w]) − g_h·(u_t − E_π[u])]/T
        + g_lp·(1 − π_t)/T and [g_kl·(ρ_t − π_t) + g_rl·(1 − ρ_t)]/T, with 1 − π_t =
        −expm1(log π_t) exact for π_t → 1; 0 for a token off the support (x_t = −inf).
    """
    t = temperature
    g_kl, g_lp, g_rl, g_h = g.unbind(-1)
    lp = stats[:, ST_LOGP]
    p_t = torch.exp(lp)
    u_t = (x_t - stats[:, ST_SHIFT_X]) / t
    inner = torch.zeros_like(u_t)
    if y_t is not None and want & Want.KL:
        w_t = (y_t - stats[:, ST_SHIFT_Y]) / t
        inner = torch.where(g_kl == 0, 0.0, g_kl * ((u_t - w_t) - stats[:, ST_MEAN_D]))
    if want & Want.ENTROPY:
        inner = inner - torch.where(g_h == 0, 0.0, g_h * (u_t - stats[:, ST_MEAN_U]))
    on_token = torch.where(p_t > 0, p_t * inner, torch.zeros_like(inner))
    # no gradient into a log-prob of −inf: a token off the support (or of logit −inf) is not
    # moved by the logits (they decide the support only through the fixed tau/keep)
    g_lp = torch.where(torch.isneginf(x_t), 0.0, g_lp)
    gx_t = (on_token - torch.expm1(lp) * g_lp) / t
    gy_t = None
    if y_t is not None:
        lq = stats[:, ST_REF_LOGP]
        gy_t = (g_kl * (torch.exp(lq) - p_t) - g_rl * torch.expm1(lq)) / t
    return gx_t, gy_t


def state_to_tensor(state: StatsState) -> torch.Tensor:
    """The (N, 6) state columns of :mod:`.contract` (``SX_*``); fields that are None give 0."""
    n = state.s_x.shape[0]
    out = state.s_x.new_zeros(n, STATE_COLS)
    for col, f in enumerate((state.m_x, state.s_x, state.m_y, state.s_y, state.a, state.b)):
        if f is not None:
            out[:, col] = f
    return out


def state_from_tensor(t: torch.Tensor, want: int) -> StatsState:
    """:class:`StatsState` of the (N, 6) state columns, with the fields ``want`` needs."""
    m_x, s_x, m_y, s_y, a, b = t.unbind(-1)
    has_y = bool(want & (Want.KL | Want.REF_LOGP))
    return StatsState(
        m_x, s_x, b if want & Want.ENTROPY else None, m_y if has_y else None,
        s_y if has_y else None, a if want & Want.KL else None,
    )
