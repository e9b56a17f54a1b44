"""The support of the policy that really sampled: top-k / top-p / min-p thresholds and the
kept sets that inference engines return, as the ``keep`` / ``tau`` of the token_stats op.

Shape letters: N rows (positions, the product of the leading dims), V vocabulary, K kept ids.

**The rule of** :func:`sampling_threshold`, the one a sampler applies, in this order:

1. temperature first: the distribution is softmax(x/T);
2. top-k: keep the k largest logits, *and every logit tied with the k-th* (x ≥ x_(k));
3. top-p, on the top-k distribution renormalised: in decreasing order, keep a token when the
   mass of the tokens strictly before it is < p (the smallest prefix whose mass reaches p),
   again with every token tied with the last one kept;
4. min-p: keep tokens with π(v) ≥ min_p·max π (a ratio, so the renormalisation of the steps
   before does not change it).

Each step keeps an upper set of the logits, so the kept set is {v : x_v ≥ τ} with τ (one per
row) the smallest kept logit: the op compares the logits with τ tile by tile, and nothing of
size (N, V) is kept. At least one token is always kept (the largest logit passes every step:
k ≥ 1, the mass before it is 0 < p, and π_max ≥ min_p·π_max).

*Ties are kept.* A sampler that breaks a tie at a boundary by its sort order keeps a set that
is not a function of the logits (it depends on the sort's tie order, i.e. on the
implementation and the device), so the distribution it sampled from cannot be recomputed from
the logits; keeping all tied tokens is the only rule that can be, and it is Hugging Face's
for top-k (``TopKLogitsWarper`` removes only logits < the k-th). When an engine breaks ties
its own way, pass its kept set (``support=(ids, offsets)``): that is exact whatever its rule.

The masses of top-p and min-p are computed from the logits in the compute dtype (float32, or
float64 for float64 logits; top-p: exp(x/T − log Z) in float64 with log Z a float64-accumulated
log-sum-exp, summed in decreasing order over the largest logits only); a sampler working in float32 can decide differently for a token whose mass-before is
within float32 rounding of p (again: its own kept set is then the exact answer).

**Memory and time.** Rows are processed in chunks of about :data:`CHUNK_ELEMENTS` elements:
O(chunk), and no full sort at all (``topk`` of the k-th logit; top-p sorts the largest k' logits
of a row, k' growing fourfold from 64 until the kept prefix ends inside them).
"""

from __future__ import annotations

import math
from numbers import Integral

import torch
from torch import Tensor

from . import _validation as v
from .ops.engine import finite_or_zero

__all__ = [
    "sampling_threshold",
    "support_from_ids",
    "resolve_support",
    "check_sampler",
    "CHUNK_ELEMENTS",
]

# Elements of one row chunk: a float64 copy of 2**21 elements is 16 MiB (+ the top-k values
# and int64 indices), a few of a large vocabulary's rows at a time.
CHUNK_ELEMENTS = 1 << 21


def _chunks(n: int, vocab: int, chunk_rows: int | None):
    rows = chunk_rows if chunk_rows else max(1, CHUNK_ELEMENTS // max(vocab, 1))
    for r0 in range(0, n, rows):
        yield r0, min(n, r0 + rows)


def check_top_k(top_k: object) -> int:
    """An int ≥ 1."""
    if isinstance(top_k, bool) or not isinstance(top_k, Integral):
        raise TypeError(f"top_k must be an int >= 1, got {type(top_k).__name__}")
    if top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    return int(top_k)


def check_top_p(top_p: object) -> float:
    """A real number in (0, 1]."""
    p = v.as_real("top_p", top_p)
    if not (0.0 < p <= 1.0):  # also rejects NaN
        raise ValueError(f"top_p must lie in (0, 1], got {p}")
    return p


def check_min_p(min_p: object) -> float:
    """A real number in [0, 1]."""
    p = v.as_real("min_p", min_p)
    if not (0.0 <= p <= 1.0):
        raise ValueError(f"min_p must lie in [0, 1], got {p}")
    return p


def check_sampler(top_k: object, top_p: object, min_p: object) -> dict:
    """The sampler settings validated (None = not used), as a dict of keyword arguments."""
    return {
        "top_k": None if top_k is None else check_top_k(top_k),
        "top_p": None if top_p is None else check_top_p(top_p),
        "min_p": None if min_p is None else check_min_p(min_p),
    }


@torch.no_grad()
def sampling_threshold(
    logits: Tensor,
    *,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    temperature: float = 1.0,
    chunk_rows: int | None = None,
) -> Tensor:
    """Per-position threshold τ of top-k → top-p → min-p sampling: kept(v) iff x_v ≥ τ.

    The rule (temperature first, ties at a boundary all kept, at least one token kept) is in
    the module docstring. Not differentiable (the support is a fixed set; gradients flow
    through the truncated softmax, in :func:`klpenalty.token_stats`).

    Args:
        logits: (..., V) float policy logits (those the tokens were sampled from).
        top_k: int ≥ 1 or None (k ≥ V keeps everything).
        top_p: in (0, 1] or None (1 keeps everything).
        min_p: in [0, 1] or None (0 keeps everything).
        temperature: > 0, the sampler's.
        chunk_rows: rows sorted at a time (default: about :data:`CHUNK_ELEMENTS` elements).

    Returns:
        τ (...) in the compute dtype (float32; float64 for float64 logits): the smallest kept
        logit of each row, exactly one of the logits (−inf where nothing is cut; NaN for a
        row holding NaN, which then keeps nothing and is reported by the checks).

    Raises:
        TypeError / ValueError: naming the argument (logits not floating, top_k not an int ≥ 1,
            top_p outside (0, 1], min_p outside [0, 1], temperature ≤ 0).
    """
    v.check_logits("logits", logits)
    temperature = v.check_temperature(temperature)
    top_k, top_p, min_p = check_sampler(top_k, top_p, min_p).values()
    return threshold_rows(logits, top_k, top_p, min_p, temperature, chunk_rows, LOCAL)


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
    return tau.to(v.compute_dtype(logits)).reshape(logits.shape[:-1])


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
    xc = x.to(v.compute_dtype(x))  # (R, C), no copy for float32/float64 logits
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


@torch.no_grad()
def support_from_ids(
    logits: Tensor, ids: Tensor, offsets: Tensor, *, chunk_rows: int | None = None
) -> tuple[Tensor | None, Tensor | None]:
    """The compact kept sets of an inference engine as the op's ``(keep, tau)``.

    Row r (of the N = prod(leading dims) positions, in row-major order) keeps
    ``ids[offsets[r]:offsets[r + 1]]``. When every row's set is exactly {v : x_v ≥ τ_r} with
    τ_r its smallest kept logit (the case of top-k/top-p/min-p samplers that keep ties), the
    result is ``(None, tau)`` and nothing of size (N, V) is built; otherwise (a sampler that
    broke a tie, a non-threshold rule, duplicated ids) it is ``(keep, None)``, a dense bool
    (..., V) mask: N·V bytes (e.g. 4 GiB for 32k positions × 128k vocabulary), the price of a
    set that no threshold describes. The exactness is checked on every row, a chunk of rows at
    a time. An empty set keeps nothing (that row then has no distribution: mask it out).

    Args:
        logits: (..., V) float policy logits.
        ids: (K,) integer token ids in [0, V).
        offsets: (N + 1,) integer, non-decreasing, offsets[0] = 0, offsets[N] = K.
        chunk_rows: rows compared at a time.

    Returns:
        (keep (..., V) bool, None) or (None, tau (...) in the compute dtype).

    Raises:
        TypeError / ValueError: naming ``support`` ids/offsets with their shape and dtype.
    """
    v.check_logits("logits", logits)
    vocab = logits.shape[-1]
    leading = logits.shape[:-1]
    n = math.prod(leading)
    _check_compact(ids, offsets, n, vocab, logits.device)
    cd = v.compute_dtype(logits)
    counts = offsets[1:] - offsets[:-1]  # (N,)
    rows = torch.repeat_interleave(torch.arange(n, device=ids.device), counts)  # (K,)
    xf = logits.detach().reshape(n, vocab)
    at = xf[rows, ids.long()].to(cd)  # (K,)
    tau = torch.full((n,), math.inf, dtype=cd, device=logits.device)
    tau = tau.scatter_reduce(0, rows, at, reduce="amin", include_self=True)  # NaN propagates
    exact = True
    for r0, r1 in _chunks(n, vocab, chunk_rows):
        lo, hi = int(offsets[r0]), int(offsets[r1])
        marked = torch.zeros(r1 - r0, vocab, dtype=torch.bool, device=logits.device)
        marked[rows[lo:hi] - r0, ids[lo:hi].long()] = True
        if not bool(torch.equal(marked, xf[r0:r1].to(cd) >= tau[r0:r1].unsqueeze(-1))):
            exact = False
            break
    if exact:
        return None, tau.reshape(leading)
    keep = torch.zeros(n, vocab, dtype=torch.bool, device=logits.device)
    keep[rows, ids.long()] = True
    return keep.reshape(logits.shape), None


def _check_compact(ids: object, offsets: object, n: int, vocab: int, device) -> None:
    """Shapes, dtypes, device and values of a compact support (reads the values: one sync)."""
    for name, t in (("ids", ids), ("offsets", offsets)):
        if not isinstance(t, Tensor):
            raise TypeError(f"support {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise TypeError(f"support {name} must be an integer tensor, got {v.describe(t)}")
        if t.dim() != 1:
            raise ValueError(f"support {name} must be 1-D, got {v.describe(t)}")
        if t.device != device:
            raise ValueError(f"support {name} must be on {device}, got {t.device}")
    if offsets.shape[0] != n + 1:
        raise ValueError(
            f"support offsets must have N + 1 = {n + 1} entries (N = {n} positions), "
            f"got {v.describe(offsets)}"
        )
    k = ids.shape[0]
    first, last = (int(t) for t in offsets[[0, -1]].tolist())
    if first != 0 or last != k:
        raise ValueError(
            f"support offsets must start at 0 and end at len(ids) = {k}, got {first} and "
            f"{last} ({v.describe(offsets)})"
        )
    if n and bool((offsets[1:] < offsets[:-1]).any()):
        raise ValueError(f"support offsets must be non-decreasing ({v.describe(offsets)})")
    if k and bool(((ids < 0) | (ids >= vocab)).any()):
        raise ValueError(f"support ids must lie in [0, {vocab}) ({v.describe(ids)})")


def resolve_support(
    logits: Tensor,
    support: object,
    top_k: object,
    top_p: object,
    min_p: object,
    temperature: float,
) -> tuple[Tensor | None, Tensor | None]:
    """The ``(keep, tau)`` of the public functions' ``support=`` / ``top_k=`` / ``top_p=`` /
    ``min_p=`` arguments (validated here), or (None, None) for the untruncated policy.

    ``support``: a bool (..., V) tensor (used as ``keep``) or a pair ``(ids, offsets)``
    (:func:`support_from_ids`); it excludes the three sampler settings.
    """
    samplers = {"top_k": top_k, "top_p": top_p, "min_p": min_p}
    given = [name for name, val in samplers.items() if val is not None]
    if support is not None:
        if given:
            raise ValueError(
                f"support and {', '.join(given)} both given: pass either the kept set "
                "(support=) or the sampler settings that build it"
            )
        if isinstance(support, Tensor):
            if support.dtype != torch.bool:
                raise TypeError(
                    f"support must be a bool tensor (..., V) (True = kept) or a pair "
                    f"(ids, offsets), got {v.describe(support)}"
                )
            if support.shape != logits.shape:
                raise ValueError(
                    f"support must have the shape of the policy logits {tuple(logits.shape)}, "
                    f"got {v.describe(support)}"
                )
            if support.device != logits.device:
                raise ValueError(f"support must be on {logits.device}, got {support.device}")
            return support, None
        if isinstance(support, (tuple, list)) and len(support) == 2:
            return support_from_ids(logits, support[0], support[1])
        raise TypeError(
            "support must be a bool tensor (..., V) or a pair (ids, offsets) of integer "
            f"tensors, got {type(support).__name__}"
        )
    if not given:
        return None, None
    vocab = logits.shape[-1]
    top_k, top_p, min_p = check_sampler(top_k, top_p, min_p).values()
    cuts = (
        top_k is not None and top_k < vocab,
        top_p is not None and top_p < 1.0,
        min_p is not None and min_p > 0.0,
    )
    if not any(cuts):  # nothing cut: the untruncated policy (NaN logits still reported)
        return None, None
    tau = sampling_threshold(
        logits, top_k=top_k, top_p=top_p, min_p=min_p, temperature=temperature
    )
    return None, tau
