"""The streaming backend's second walk: ``klpenalty::streaming_divergence`` and its backward.

Given the finished row statistics of the forward op (the shifts and log-sums of both models,
``ST_SHIFT_X`` .. ``ST_LOG_S_Y``), each tile's log-probabilities are formed exactly
(lp = (x − shift)/T − log s) and the kind's terms (:func:`..divergence.divergence_terms`)
summed per row: the value and ḡ = Σ π·g. With a support (``keep`` / ``tau``, the rule of
:func:`..contract.kept_mask`, tile by tile) the student is π̃: lp = −inf off the support and
π·g = 0 there (π̃ is 0 there whatever x is), so ḡ sums the kept entries and the gradient is 0
off the support; the teacher is never truncated. The backward writes each tile of
grad·(π·g − π·ḡ)/T. Tiles as the token_stats ops' (:func:`.token_stats.tile_shape`); nothing of
size (N, V) is allocated beyond the gradient itself.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..._validation import compute_dtype
from .. import contract
from ..divergence import divergence_terms
from .token_stats import TILE_ELEMENTS, _cpu_threads, _tiles, tile_shape

__all__ = ["divergence_op", "divergence_backward_op"]


def _log_probs(t: Tensor, shift: Tensor, log_s: Tensor, temperature: float, dtype) -> Tensor:
    """(r, c) log-probabilities of a tile from its row's shift and log Σ e^u."""
    return (t.to(dtype) - shift.unsqueeze(-1)) / temperature - log_s.unsqueeze(-1)


def _walk(x: Tensor, y: Tensor, stats: Tensor, keep: Tensor | None, tau: Tensor | None):
    """(N, V) rows of x, y and keep, (N,) tau, (N, STATS_COLS) stats, the compute dtype and
    the tiles."""
    vocab = x.shape[-1]
    xf, yf = x.reshape(-1, vocab), y.reshape(-1, vocab)
    keep = None if keep is None else keep.reshape(-1, vocab)
    tau = None if tau is None else tau.reshape(-1)
    st = stats.reshape(-1, contract.STATS_COLS)
    dtype = compute_dtype(x, y)
    rows, cols = tile_shape(xf.shape[0], vocab, TILE_ELEMENTS)
    return xf, yf, keep, tau, st, dtype, _tiles(xf.shape[0], vocab, rows, cols)


def _tile_terms(xf, yf, keep, tau, st, r0, r1, c0, c1, temperature, dtype, kind, param):
    """(lp, f, pg) of a tile: the student's log-probs on its support (−inf off it), the kind's
    terms, π·g exactly 0 off the support."""
    xt = xf[r0:r1, c0:c1]
    kept = contract.kept_mask(xt, None if keep is None else keep[r0:r1, c0:c1],
                              None if tau is None else tau[r0:r1])
    lp = _log_probs(xt, st[r0:r1, contract.ST_SHIFT_X], st[r0:r1, contract.ST_LOG_S_X],
                    temperature, dtype)
    lq = _log_probs(yf[r0:r1, c0:c1], st[r0:r1, contract.ST_SHIFT_Y],
                    st[r0:r1, contract.ST_LOG_S_Y], temperature, dtype)
    if kept is not None:
        lp = lp.masked_fill(~kept, float("-inf"))
    f, pg = divergence_terms(lp, lq, kind, param)
    if kept is not None:  # π̃ is 0 off the support whatever x is: no gradient there
        pg = pg.masked_fill(~kept, 0.0)
    return lp, f, pg


def divergence_op(x, y, stats, mask, keep, tau, temperature, kind, param):
    """(value (...), ḡ (...)) of the kind over these columns, 0 at masked rows
    (SCHEMAS["divergence"])."""
    xf, yf, keep, tau, st, dtype, tiles = _walk(x, y, stats, keep, tau)
    n = xf.shape[0]
    value = torch.zeros(n, dtype=dtype, device=x.device)
    gbar = torch.zeros(n, dtype=dtype, device=x.device)
    with _cpu_threads(x.device):
        for r0, r1, col_ranges in tiles:
            for c0, c1 in col_ranges:
                _, f, pg = _tile_terms(xf, yf, keep, tau, st, r0, r1, c0, c1, temperature,
                                       dtype, kind, param)
                value[r0:r1] += f.sum(-1)
                gbar[r0:r1] += pg.sum(-1)
    if mask is not None:
        keep = mask.reshape(-1)
        value, gbar = torch.where(keep, value, 0.0), torch.where(keep, gbar, 0.0)
    leading = x.shape[:-1]
    return value.reshape(leading), gbar.reshape(leading)


def divergence_backward_op(grad, x, y, stats, gbar, mask, keep, tau, temperature, kind, param):
    """∂/∂x (..., V) of Σ grad·value: grad·(π·g − π·ḡ)/T per tile, 0 at masked rows and off
    the support (SCHEMAS["divergence_backward"])."""
    xf, yf, keep, tau, st, dtype, tiles = _walk(x, y, stats, keep, tau)
    g = contract.masked_grad(grad.reshape(-1), None if mask is None else mask.reshape(-1), dtype)
    gb = gbar.reshape(-1).to(dtype)
    gx = torch.empty(xf.shape, dtype=x.dtype, device=x.device)
    with _cpu_threads(x.device):
        for r0, r1, col_ranges in tiles:
            live = g[r0:r1].unsqueeze(-1)
            for c0, c1 in col_ranges:
                lp, _, pg = _tile_terms(xf, yf, keep, tau, st, r0, r1, c0, c1, temperature,
                                        dtype, kind, param)
                d = (pg - lp.exp() * gb[r0:r1].unsqueeze(-1)) * (live / temperature)
                gx[r0:r1, c0:c1] = torch.where(live != 0, d, 0.0)
    return gx.view(x.shape)
