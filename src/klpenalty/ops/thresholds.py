"""The portable form of the sampler threshold (top-k → top-p → min-p) in PyTorch ops, with the
row reductions pluggable: the streaming backend's ``sampling_threshold`` op and the
vocabulary-parallel thresholds (:mod:`klpenalty.distributed.vocab_parallel`, whose reductions
run across ranks). The rule itself is stated in :mod:`klpenalty.sampling`; the native and
Triton backends compute the same one in their kernels.

Shape letters: N rows (positions), C the columns held here (V, or one rank's slice of it).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .._validation import compute_dtype
from .engine import finite_or_zero

__all__ = ["RowReduce", "LOCAL", "threshold_rows", "CHUNK_ELEMENTS"]

# Elements of one row chunk: a float64 copy of 2**21 elements is 16 MiB (+ the top-k values
# and int64 indices), a few of a large vocabulary's rows at a time.
CHUNK_ELEMENTS = 1 << 21


def _chunks(n: int, vocab: int, chunk_rows: int | None):
    rows = chunk_rows if chunk_rows else max(1, CHUNK_ELEMENTS // max(vocab, 1))
    for r0 in range(0, n, rows):
        yield r0, min(n, r0 + rows)


class RowReduce:
    """The reductions over a row's vocabulary that the thresholds need, on one process.

    :mod:`klpenalty.distributed.vocab_parallel` subclasses it to reduce over the ranks that hold
    the row's vocabulary slices (the same calls, in the same order, on every rank).
    """

    def vocab(self, width: int) -> int:
        """The whole vocabulary of rows of ``width`` local columns."""
        return width

    def amax(self, t: Tensor) -> Tensor:
        """(R, 1) row maxima of (R, C)."""
        return t.amax(-1, keepdim=True)

    def amin(self, t: Tensor) -> Tensor:
        """(R,) row minima of (R, C)."""
        return t.amin(-1)

    def sum64(self, t: Tensor) -> Tensor:
        """(R, 1) float64 row sums of (R, C)."""
        return t.sum(-1, keepdim=True, dtype=torch.float64)

    def any(self, t: Tensor) -> Tensor:
        """(R,) row-wise any of (R, C) bool."""
        return t.any(-1)

    def topk(self, key: Tensor, value: Tensor, k: int) -> tuple[Tensor, Tensor]:
        """The k largest ``key`` of each row (R, k), decreasing, and ``value`` at them."""
        keys, idx = key.topk(k, -1)
        return keys, value.gather(-1, idx)


LOCAL = RowReduce()


def threshold_rows(
    logits: Tensor,
    top_k: int | None,
    top_p: float | None,
    min_p: float | None,
    temperature: float,
    chunk_rows: int | None,
    reduce: RowReduce,
) -> Tensor:
    """τ (...) of :func:`sampling_threshold` for validated arguments, with the row reductions
    of ``reduce`` (``logits`` may be one slice of the vocabulary)."""
    vocab = reduce.vocab(logits.shape[-1])
    xf = logits.detach().reshape(-1, logits.shape[-1])  # (N, C)
    n = xf.shape[0]
    tau = torch.full((n,), -math.inf, dtype=torch.float64, device=logits.device)
    cut_k = top_k is not None and top_k < vocab
    cut_p = top_p is not None and top_p < 1.0
    cut_min = min_p is not None and min_p > 0.0
    if cut_k or cut_p or cut_min:
        for r0, r1 in _chunks(n, vocab, chunk_rows):
            tau[r0:r1] = _chunk_threshold(xf[r0:r1], top_k if cut_k else None,
                                          top_p if cut_p else None,
                                          min_p if cut_min else None, temperature, vocab, reduce)
    return tau.to(compute_dtype(logits)).reshape(logits.shape[:-1])


def _chunk_threshold(
    x: Tensor, top_k: int | None, top_p: float | None, min_p: float | None, temperature: float,
    vocab: int, reduce: RowReduce,
) -> Tensor:
    """τ (R,) float64 of a chunk of rows x (R, C): the smallest logit kept by the three steps.

    No full sort, and passes over the whole chunk only in the compute dtype (float32; float64
    for float64 logits): top-k reads the k-th largest logit (``topk``); top-p takes the largest
    k' logits of each row, k' growing until every row's kept prefix ends inside them, with the
    masses exp(x/T − log Z) in float64 (log Z: the max plus the log of a float64-accumulated sum
    of exp over the live logits); min-p is an elementwise test against the row's maximum.
    """
    xc = x.to(compute_dtype(x))  # (R, C), no copy for float32/float64 logits
    r = xc.shape[0]
    tau = torch.full((r,), -math.inf, dtype=torch.float64, device=x.device)
    if top_k is not None:
        tau = reduce.topk(xc, xc, top_k)[0][:, -1].double()  # ties with the k-th kept: x ≥ τ
    if top_p is not None:
        scaled = xc / temperature  # (R, C)
        if top_k is not None:
            scaled = scaled.masked_fill_(xc < tau.to(xc.dtype).unsqueeze(-1), -math.inf)
        m = finite_or_zero(reduce.amax(scaled))  # (R, 1)
        log_z = m.double() + reduce.sum64(torch.exp(scaled - m)).log()
        k = min(vocab, 256 if top_k is None else top_k)
        tau_p = torch.empty(r, dtype=xc.dtype, device=x.device)
        active = torch.arange(r, device=x.device)  # rows whose kept prefix is not found yet
        while active.numel():
            vals, at = reduce.topk(scaled[active], xc[active], k)  # (A, k), decreasing
            mass = torch.exp(vals.double() - log_z[active]).cumsum(-1)  # (A, k)
            # the mass strictly before each position (an exclusive cumulative sum)
            before = torch.cat([torch.zeros_like(mass[:, :1]), mass[:, :-1]], -1)
            kept = (before < top_p) & (vals > -math.inf)  # a prefix of each row
            done = ~kept[:, -1] if k < vocab else torch.ones_like(kept[:, -1])
            last = kept[done].sum(-1, keepdim=True).clamp_min(1) - 1  # at least the first
            rows = active[done]
            tau_p[rows] = at[done].gather(-1, last).squeeze(-1)
            active = active[~done]
            k = 4 * k if 16 * k <= vocab else vocab  # past a quarter of V: one full sort
        tau = torch.maximum(tau, tau_p.double())
    if min_p is not None:
        # π_v ≥ min_p·π_max ⟺ exp((x_v − x_max)/T) ≥ min_p
        top = reduce.amax(xc)  # (R, 1)
        kept_min = torch.exp((xc - top) / temperature) >= min_p
        smallest = reduce.amin(torch.where(kept_min, xc, math.inf))  # (R,); +inf if none kept
        tau = torch.maximum(tau, torch.minimum(smallest, top.squeeze(-1)).double())
    # a row holding NaN keeps nothing, so that the NaN is reported, never silently cut away
    return tau.masked_fill(reduce.any(torch.isnan(xc)), math.nan)
