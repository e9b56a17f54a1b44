"""The streaming backend's kept-set check of an engine's ``(ids, offsets)``:
``klpenalty::streaming_support_from_ids`` (the portable statement of the rule of
:func:`klpenalty.sampling.threshold_of_ids`; any device).

Per row r with kept ids ``ids[offsets[r]:offsets[r+1]]``: τ_r, the smallest kept logit (a
scatter-min; +inf for an empty set, NaN where a kept logit is NaN), and whether the set is
exactly {v : x_v ≥ τ_r}: a chunk of rows at a time, a (chunk, V) bool of the ids compared with
x ≥ τ.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..._validation import compute_dtype
from .threshold import _chunks

__all__ = ["support_from_ids_op"]


def support_from_ids_op(x: Tensor, ids: Tensor, offsets: Tensor, chunk_rows: int):
    """(tau (N,), exact (N,) bool) of validated (ids, offsets) over the rows of x (..., V);
    ``chunk_rows``: rows compared at a time (0: from the vocabulary's width)."""
    vocab = x.shape[-1]
    n = offsets.shape[0] - 1
    cd = compute_dtype(x)
    counts = (offsets[1:] - offsets[:-1]).long()  # (N,); repeat_interleave takes int32/64
    rows = torch.repeat_interleave(
        torch.arange(n, device=ids.device), counts, output_size=ids.shape[0]
    )  # (K,)
    xf = x.detach().reshape(n, vocab)
    at = xf[rows, ids.long()].to(cd)  # (K,)
    tau = torch.full((n,), math.inf, dtype=cd, device=x.device)
    tau = tau.scatter_reduce(0, rows, at, reduce="amin", include_self=True)  # NaN propagates
    exact = torch.empty(n, dtype=torch.bool, device=x.device)
    for r0, r1 in _chunks(n, vocab, chunk_rows or None):
        lo, hi = int(offsets[r0]), int(offsets[r1])
        marked = torch.zeros(r1 - r0, vocab, dtype=torch.bool, device=x.device)
        marked[rows[lo:hi] - r0, ids[lo:hi].long()] = True
        exact[r0:r1] = (marked == (xf[r0:r1].to(cd) >= tau[r0:r1].unsqueeze(-1))).all(-1)
    return tau, exact
