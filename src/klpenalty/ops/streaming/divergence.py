"""The streaming backend's second walk: ``klpenalty::streaming_divergence`` and its backward.

Given the finished row statistics of the forward op (the shifts and log-sums of both models,
``ST_SHIFT_X`` .. ``ST_LOG_S_Y``), each tile's log-probabilities are formed exactly
(lp = (x − shift)/T − log s) and the kind's terms (:func:`..divergence.divergence_terms`)
summed per row: the value and ḡ = Σ π·g. The backward writes each tile of
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


def _walk(x: Tensor, y: Tensor, stats: Tensor, temperature: float):
    """(N, V) rows of x and y, (N, STATS_COLS) stats, the compute dtype and the tiles."""
    vocab = x.shape[-1]
    xf, yf = x.reshape(-1, vocab), y.reshape(-1, vocab)
    st = stats.reshape(-1, contract.STATS_COLS)
    dtype = compute_dtype(x, y)
    rows, cols = tile_shape(xf.shape[0], vocab, TILE_ELEMENTS)
    return xf, yf, st, dtype, _tiles(xf.shape[0], vocab, rows, cols)


def _tile_log_probs(xf, yf, st, r0, r1, c0, c1, temperature, dtype):
    lp = _log_probs(xf[r0:r1, c0:c1], st[r0:r1, contract.ST_SHIFT_X],
                    st[r0:r1, contract.ST_LOG_S_X], temperature, dtype)
    lq = _log_probs(yf[r0:r1, c0:c1], st[r0:r1, contract.ST_SHIFT_Y],
                    st[r0:r1, contract.ST_LOG_S_Y], temperature, dtype)
    return lp, lq


def divergence_op(x, y, stats, mask, temperature, kind, param):  # SCHEMAS["divergence"]
    """(value (...), ḡ (...)) of the kind over these columns, 0 at masked rows."""
    xf, yf, st, dtype, tiles = _walk(x, y, stats, temperature)
    n = xf.shape[0]
    value = torch.zeros(n, dtype=dtype, device=x.device)
    gbar = torch.zeros(n, dtype=dtype, device=x.device)
    with _cpu_threads(x.device):
        for r0, r1, col_ranges in tiles:
            for c0, c1 in col_ranges:
                lp, lq = _tile_log_probs(xf, yf, st, r0, r1, c0, c1, temperature, dtype)
                f, pg = divergence_terms(lp, lq, kind, param)
                value[r0:r1] += f.sum(-1)
                gbar[r0:r1] += pg.sum(-1)
    if mask is not None:
        keep = mask.reshape(-1)
        value, gbar = torch.where(keep, value, 0.0), torch.where(keep, gbar, 0.0)
    leading = x.shape[:-1]
    return value.reshape(leading), gbar.reshape(leading)


def divergence_backward_op(grad, x, y, stats, gbar, mask, temperature, kind, param):
    """∂/∂x (..., V) of Σ grad·value: grad·(π·g − π·ḡ)/T per tile, 0 at masked rows."""
    xf, yf, st, dtype, tiles = _walk(x, y, stats, temperature)
    g = contract.masked_grad(grad.reshape(-1), None if mask is None else mask.reshape(-1), dtype)
    gb = gbar.reshape(-1).to(dtype)
    gx = torch.empty(xf.shape, dtype=x.dtype, device=x.device)
    with _cpu_threads(x.device):
        for r0, r1, col_ranges in tiles:
            live = g[r0:r1].unsqueeze(-1)
            for c0, c1 in col_ranges:
                lp, lq = _tile_log_probs(xf, yf, st, r0, r1, c0, c1, temperature, dtype)
                _, pg = divergence_terms(lp, lq, kind, param)
                d = (pg - lp.exp() * gb[r0:r1].unsqueeze(-1)) * (live / temperature)
                gx[r0:r1, c0:c1] = torch.where(live != 0, d, 0.0)
    return gx.view(x.shape)
