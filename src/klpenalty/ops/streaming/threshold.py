"""The portable form of the sampler threshold (top-k → top-p → min-p) in PyTorch ops, with the
row reductions pluggable: the streaming backend's ``sampling_threshold`` op and the
vocabulary-parallel thresholds (:mod:`klpenalty.distributed.vocab_parallel`, whose reductions
run across ranks). The rule itself (decisions on the keys x/T of
:func:`..contract.sampler_keys`, tie groups kept whole, τ the smallest logit of the last kept
group) is stated in :mod:`klpenalty.sampling`; the native and Triton backends compute the same
τ in their kernels. Here each step finds a kept token at its boundary and τ is then the
smallest logit whose key is at least that token's (:func:`_group_floor`, one more row
reduction). The sums: Z of float64 exponentials of the keys (``torch.sum`` in float64, across
ranks the ranks' sums added), the masses before a token a float64 cumulative sum.

Shape letters: N rows (positions), C the columns held here (V, or one rank's slice of it).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..._validation import compute_dtype
from .. import contract
from ..engine import finite_or_zero

__all__ = ["RowReduce", "LOCAL", "threshold_rows", "CHUNK_ELEMENTS", "sampling_threshold_op"]

# Elements of one row chunk: a float64 copy of 2**21 elements is 16 MiB (+ the top-k values
# and int64 indices), a few of a large vocabulary's rows at a time.
CHUNK_ELEMENTS = 1 << 21

# top-p sorts the largest SORTED_CANDIDATES logits of a row (all of a row this narrow); a row
# whose kept prefix goes past them is walked through a histogram of its mass over
# _buckets(vocab) buckets of its logit range, the lowest of which holds everything more than
# BUCKET_RANGE below the row's maximum (in units of x/T)
SORTED_CANDIDATES = 256
BUCKET_RANGE = 64.0


def _buckets(vocab: int) -> int:
    """The histogram's width for rows of ``vocab`` logits (the same on every rank)."""
    return max(64, min(4096, vocab // 8))


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

    def histogram64(self, bucket: Tensor, weight: Tensor, bins: int) -> Tensor:
        """(R, bins) float64 sums of ``weight`` (R, C) float64 by ``bucket`` (R, C) int64."""
        out = weight.new_zeros((weight.shape[0], bins))
        return out.scatter_add_(-1, bucket, weight)


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

    No full sort: top-k reads the k-th largest logit (``topk``; the keys are non-decreasing in
    the logits, so its key is the k-th largest key); top-p weighs the keys by their masses
    exp(k − log Z) in float64 (log Z: the max plus the log of the float64 sum of the float64
    exp(k − max) over the live keys), sorting only the largest 256 (rows whose kept prefix ends
    inside them) and otherwise the keys of one bucket of a histogram of the mass
    (:func:`_bucketed_top_p`); min-p is an elementwise test of the keys against the largest.
    Each step's boundary token is lowered to its tie group's smallest logit
    (:func:`_group_floor`).
    """
    xc = x.to(compute_dtype(x))  # (R, C), no copy for float32/float64 logits
    keys = contract.sampler_keys(xc, temperature)  # (R, C): x/T as the sampler rounds it
    r = xc.shape[0]
    tau = torch.full((r,), -math.inf, dtype=xc.dtype, device=x.device)
    if top_k is not None:
        kth = reduce.topk(xc, xc, top_k)[0][:, -1]  # the k-th largest logit
        tau = _group_floor(xc, keys, kth, temperature, reduce)
    if top_p is not None:
        scaled = keys
        if top_k is not None:
            scaled = keys.masked_fill(xc < tau.unsqueeze(-1), -math.inf)
        top_key = reduce.amax(scaled)  # (R, 1)
        m = finite_or_zero(top_key)
        log_z = m.double() + reduce.sum64(torch.exp(scaled.double() - m.double())).log()
        tau_p = torch.empty(r, dtype=xc.dtype, device=x.device)
        k = min(vocab, SORTED_CANDIDATES if top_k is None else top_k)
        if k <= SORTED_CANDIDATES:  # a few candidates: one sorted walk settles most rows
            vals, at = reduce.topk(scaled, xc, k)  # (R, k), decreasing
            done, last = _walk(vals, torch.zeros_like(log_z), log_z, top_p)
            if k == vocab:
                done = torch.ones_like(done)
            tau_p[done] = at[done].gather(-1, last[done]).squeeze(-1)
            rest = (~done).nonzero().squeeze(-1)
        else:
            rest = torch.arange(r, device=x.device)
        if rest.numel() == r:
            tau_p = _bucketed_top_p(scaled, xc, m, log_z, top_p, vocab, reduce)
        elif rest.numel():
            tau_p[rest] = _bucketed_top_p(scaled[rest], xc[rest], m[rest], log_z[rest], top_p,
                                          vocab, reduce)
        inf_top = top_key.squeeze(-1) == math.inf  # (R,); the same on every rank (all-reduced)
        if bool(inf_top.any()):
            # keys of +inf (+inf logits, or M/T overflowing float32) hold all the mass: τ_p is
            # in M's tie group (the masses' exp(inf − inf) are NaN)
            tau_p = torch.where(inf_top, reduce.amax(xc).squeeze(-1).to(tau_p.dtype), tau_p)
        tau = torch.maximum(tau, _group_floor(xc, keys, tau_p, temperature, reduce))
    if min_p is not None:
        # π_v ≥ min_p·π_max ⟺ k_v − k_max ≥ log(min_p), in float64
        top = reduce.amax(xc)  # (R, 1)
        key_top = contract.sampler_keys(top, temperature).double()
        kept_min = keys.double() - key_top >= math.log(min_p)  # (keys may be the logits)
        smallest = reduce.amin(torch.where(kept_min, xc, math.inf))  # (R,); +inf if none kept
        tau = torch.maximum(tau, torch.minimum(smallest, top.squeeze(-1)))
    # a row holding NaN keeps nothing, so that the NaN is reported, never silently cut away
    return tau.double().masked_fill(reduce.any(torch.isnan(xc)), math.nan)


def _group_floor(xc: Tensor, keys: Tensor, at: Tensor, temperature: float,
                 reduce: RowReduce) -> Tensor:
    """(R,) the smallest logit of ``xc`` (R, C) whose key (``keys``) is at least that of the
    logit ``at`` (R,) (one of the row's, or −inf): the smallest logit of ``at``'s tie group, so
    that x ≥ it keeps the group whole. −inf and NaN stay."""
    key = contract.sampler_keys(at, temperature).unsqueeze(-1)  # (R, 1)
    low = reduce.amin(torch.where(keys >= key, xc, math.inf))  # (R,)
    return torch.where(at > -math.inf, low, at)


def _walk(vals: Tensor, above: Tensor, log_z: Tensor, top_p: float) -> tuple[Tensor, Tensor]:
    """The top-p walk over decreasing candidates ``vals`` (R, k) of x/T, after a mass ``above``
    (R, 1) float64 of the logits before them: (R,) whether the kept prefix ends inside them,
    and (R, 1) the position of its last token (at least the first)."""
    mass = torch.exp(vals.double() - log_z).cumsum(-1)  # (R, k)
    # the mass strictly before each position (an exclusive cumulative sum)
    before = torch.cat([torch.zeros_like(mass[:, :1]), mass[:, :-1]], -1) + above
    kept = (before < top_p) & (vals > -math.inf)  # a prefix of each row
    return ~kept[:, -1], kept.sum(-1, keepdim=True).clamp_min(1) - 1


def _bucketed_top_p(
    scaled: Tensor, xc: Tensor, m: Tensor, log_z: Tensor, top_p: float, vocab: int,
    reduce: RowReduce,
) -> Tensor:
    """The top-p threshold (R,) in the dtype of ``xc`` (R, C) of rows whose kept prefix is long,
    from x/T ``scaled`` (R, C), its finite-or-zero maximum ``m`` (R, 1) and ``log_z`` (R, 1).

    A bucket index, non-increasing in x/T (ties share a bucket, so each bucket is a run of the
    sorted row), splits [m − D, m] (D: the finite range of the row, at most BUCKET_RANGE) into
    B equal buckets, x/T = −inf and everything lower in the last; the masses summed by bucket
    (float64, one all-reduce across ranks) give the bucket c holding the last kept token: the
    first whose inclusive cumulative mass reaches p, so that the mass before it is < p and its
    first token is kept. Only the logits of bucket c are sorted and walked, from that mass. A
    row whose total (as summed) stays < p keeps every live logit.
    """
    bins = _buckets(vocab)
    # the smallest live x/T (−inf and NaN read as +inf; +inf if none)
    low = reduce.amin(scaled.nan_to_num(nan=math.inf, neginf=math.inf)).unsqueeze(-1)  # (R, 1)
    span = (m - low).clamp(max=BUCKET_RANGE)  # NaN / −inf rows: no finite span
    scale = torch.where(span > 0, bins / span, 0.0).clamp(max=1e30)  # (R, 1)
    t = torch.sub(m, scaled).mul_(scale).clamp_min_(0.0)  # (R, C), non-decreasing as x/T falls
    t = t.nan_to_num_(nan=bins - 1, posinf=bins - 1).clamp_max_(bins - 1)  # NaN, +inf: the last
    bucket = t.to(torch.int64)
    del t
    weight = scaled.to(torch.float64, copy=True).sub_(log_z).exp_()  # (R, C) float64 masses
    hist = reduce.histogram64(bucket, weight, bins)  # (R, B)
    del weight
    upto = hist.cumsum(-1)  # mass of the buckets 0..b
    reached = upto[:, -1] >= top_p  # False for NaN sums too
    c = (upto < top_p).sum(-1, keepdim=True).clamp(max=bins - 1)  # (R, 1)
    above = torch.where(c > 0, upto.gather(-1, (c - 1).clamp_min(0)), 0.0)  # (R, 1)
    inside = (bucket == c) & reached.unsqueeze(-1)  # (R, C)
    del bucket
    k = max(1, int(reduce.sum64(inside.sum(-1, keepdim=True)).max()))  # the largest bucket c
    key = scaled.masked_fill(~inside, -math.inf)
    vals, at = reduce.topk(key, xc, k)  # (R, k), decreasing
    _, last = _walk(vals, above, log_z, top_p)
    tau = at.gather(-1, last).squeeze(-1)  # (R,)
    if bool(reached.all()):  # the same on every rank (all-reduced sums)
        return tau
    # rows whose total mass stays below p (or is NaN): every live logit (−inf if none)
    smallest = reduce.amin(torch.where(scaled > -math.inf, xc, math.inf))
    everything = torch.where(smallest < math.inf, smallest, -math.inf).to(xc.dtype)
    return torch.where(reached, tau, everything)


def sampling_threshold_op(x, top_k, top_p, min_p, temperature):
    """τ (...) of the sampler settings (the threshold op of :mod:`.contract`): the portable
    rule of :func:`threshold_rows`, in row chunks."""
    contract.check_sampler_args(top_k, top_p, min_p, temperature)
    return threshold_rows(
        x, top_k if top_k > 0 else None, top_p if top_p < 1.0 else None,
        min_p if min_p > 0.0 else None, temperature, None, LOCAL,
    )
