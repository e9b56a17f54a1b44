"""The support of the policy that really sampled: top-k / top-p / min-p thresholds and the
kept sets that inference engines return, as the ``keep`` / ``tau`` of the token_stats op.

Shape letters: N rows (positions, the product of the leading dims), V vocabulary, K kept ids.

**The rule of** :func:`sampling_threshold`, the one a sampler applies. Every decision is made
on the token's *key*, its logit divided by the temperature as the sampler divides it:
k_v = x_v / T rounded to the compute dtype (float32: the IEEE quotient of the float32 logit by
float32(T), what ``logits / T`` computes in float32 on CPU and vLLM's division by a temperature
tensor; float64 for float64 logits; T = 1 gives k = x). Distinct logits may share a key (x/T
rounds them together); a *tie group* is the set of tokens with one key. In this order:

1. top-k: keep the tokens whose key is ≥ the k-th largest key (counted with multiplicity): the
   k largest and every token tied with the k-th;
2. top-p, on the top-k distribution renormalised: masses e_v = exp(k_v − log Z) in float64,
   log Z = m + log Σ exp(k_u − m) over the top-k survivors (m their largest key; float64 sums);
   in decreasing key order, a tie group is kept, whole, when the mass of the tokens before it
   (those with larger keys) is < p. The first group is always kept; a group is never split;
3. min-p: keep the tokens with k_v − k_max ≥ log(min_p) (in float64: π_v ≥ min_p·π_max of
   the renormalised distribution, which the renormalisation does not change).

Each step keeps the tokens whose key is at least some key, and x ↦ k(x) is non-decreasing
(a correctly rounded division by T > 0 is), so the kept set is {v : x_v ≥ τ} with τ (one per
row) the smallest kept *logit* — the smallest logit of the last kept tie group, so that the
comparison of the original logits with τ keeps every token whose key ties with a kept one.
The ops compare the logits with τ tile by tile, and nothing of size (N, V) is kept. At least
one token is always kept (the largest key passes every step).

*Ties are kept.* A sampler that breaks a tie at a boundary by its sort order (Hugging Face's
``TopPLogitsWarper`` and vLLM's top-p cut a sorted cumulative sum, and may split a tie group,
by position in their sort) keeps a set that is not a function of the logits (it depends on the
sort's tie order, i.e. on the implementation and the device), so the distribution it sampled
from cannot be recomputed from the logits; keeping each tie group whole is the only rule that
can be, and it is Hugging Face's for top-k (``TopKLogitsWarper`` removes only the scores below
the k-th, after the temperature's division, so ties made by the division are kept). When an
engine breaks ties its own way, pass its kept set (``support=(ids, offsets)``): that is exact
whatever its rule.

The rule is stated exactly, in float64 with the keys' float32 rounding, by
:func:`klpenalty.ops.reference.kept_set_reference`; every backend's τ is that set's smallest
logit, bit for bit, except where p lies within the masses' rounding of a group's cumulative
mass (relative 1e-6: the backends sum Z in different orders, and the native kernel's large
rows sum float32 exponentials in float64; there the order of the sums decides), or where
k_v − k_max is within float64 rounding of log(min_p) (each backend documents its sums).
A sampler that divides differently (Hugging Face's ``scores / T`` on CUDA multiplies by
float32(1/T)) can make or break a tie at one ulp of x/T: its own kept set is then the exact
answer.

**Where it is computed.** By the backend's ``sampling_threshold`` op (:mod:`klpenalty.ops`):
inside the native and Triton kernels' pass over a row (the forward given ``top_k``/``top_p``/
``min_p`` computes it in the same walk as the KL), or by the portable rule of
:mod:`klpenalty.ops.streaming.threshold` in row chunks (no full sort: the k-th logit for top-k, a mass
histogram and one sorted bucket for top-p). Nothing of size (N, V) is kept.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from . import _validation as v
from .ops import dispatch
from .ops.contract import check_compact_values, keep_of_ids

__all__ = [
    "sampling_threshold",
    "support_from_ids",
    "threshold_of_ids",
    "resolve_support",
    "check_sampler",
    "parse_support",
    "rows_of_support",
    "ids_of_rows",
    "support_args",
    "op_support",
    "ids_args",
    "op_sampler",
]

def check_sampler(top_k: object, top_p: object, min_p: object) -> dict:
    """The sampler settings validated (None = not used), as a dict of keyword arguments."""
    return {
        "top_k": None if top_k is None else v.check_top_k(top_k),
        "top_p": None if top_p is None else v.check_top_p(top_p),
        "min_p": None if min_p is None else v.check_min_p(min_p),
    }


@torch.no_grad()
def sampling_threshold(
    logits: Tensor,
    *,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    temperature: float = 1.0,
    backend: str = "auto",
) -> Tensor:
    """Per-position threshold τ of top-k → top-p → min-p sampling: kept(v) iff x_v ≥ τ.

    The rule (decisions on the keys x/T as the sampler rounds them, tie groups of keys kept
    or dropped whole, at least one token kept) is in the module docstring. Not differentiable (the support is a fixed set; gradients flow
    through the truncated softmax, in :func:`klpenalty.token_stats`).

    Args:
        logits: (..., V) float policy logits (those the tokens were sampled from).
        top_k: int ≥ 1 or None (k ≥ V keeps everything).
        top_p: in (0, 1] or None (1 keeps everything).
        min_p: in [0, 1] or None (0 keeps everything).
        temperature: > 0, the sampler's.
        backend: whose ``sampling_threshold`` op computes it (``"auto"``: the device's fastest;
            see :mod:`klpenalty.ops.dispatch`); every backend gives the same τ.

    Returns:
        τ (...) in the compute dtype (float32; float64 for float64 logits): the smallest kept
        logit of each row (of its last kept tie group), exactly one of the logits (a zero as
        +0, whatever the sign of the zero logits; −inf where nothing is cut; NaN for a row
        holding NaN, which then keeps nothing and is reported by the checks).

    Raises:
        TypeError / ValueError: naming the argument (logits not floating, top_k not an int ≥ 1,
            top_p outside (0, 1], min_p outside [0, 1], temperature ≤ 0).
    """
    v.check_logits("logits", logits)
    temperature = v.check_temperature(temperature)
    top_k, top_p, min_p = check_sampler(top_k, top_p, min_p).values()
    impl = dispatch.get_backend(backend, logits.device)
    return impl.threshold(logits, sampler=op_sampler(top_k, top_p, min_p), temperature=temperature)


def op_sampler(top_k: int | None, top_p: float | None, min_p: float | None) -> tuple:
    """Validated sampler settings (None = unused) as the ops' ``top_k, top_p, min_p`` arguments
    (0, 1.0 and 0.0 = unused: :func:`klpenalty.ops.contract.sampler_cuts`)."""
    return (
        0 if top_k is None else int(top_k),
        1.0 if top_p is None else float(top_p),
        0.0 if min_p is None else float(min_p),
    )


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
    set that no threshold describes (built by one write of True at row·V + id). The exactness
    is checked on every row by :func:`threshold_of_ids`: on CPU with the native kernel by its
    native form (one pass over each row's logits and ids, in C++), elsewhere by its torch form
    (the portable statement of the same rule; the two give the same answer). An empty set
    keeps nothing (that row then has no distribution: mask it out).

    Args:
        logits: (..., V) float policy logits.
        ids: (K,) integer token ids in [0, V).
        offsets: (N + 1,) integer, non-decreasing, offsets[0] = 0, offsets[N] = K.
        chunk_rows: rows compared at a time by the torch form of the check.

    Returns:
        (keep (..., V) bool, None) or (None, tau (...) in the compute dtype).

    Raises:
        TypeError / ValueError: naming ``support`` ids/offsets with their shape and dtype.
    """
    v.check_logits("logits", logits)
    vocab = logits.shape[-1]
    n = math.prod(logits.shape[:-1])
    _check_compact(ids, offsets, n, vocab, logits.device)
    return _support_from_ids(logits, ids, offsets, chunk_rows)


def _support_from_ids(
    logits: Tensor, ids: Tensor, offsets: Tensor, chunk_rows: int | None = None
) -> tuple[Tensor | None, Tensor | None]:
    """:func:`support_from_ids` of validated arguments."""
    tau, exact = _threshold_of_ids(logits, ids, offsets, chunk_rows, None)
    if bool(exact.all()):
        return None, tau
    return keep_of_ids(logits.shape, ids, offsets), None


@torch.no_grad()
def threshold_of_ids(
    logits: Tensor, ids: Tensor, offsets: Tensor, *, chunk_rows: int | None = None,
    native: bool | None = None,
) -> tuple[Tensor, Tensor]:
    """Per row of compact kept sets (as in :func:`support_from_ids`): τ_r, the smallest kept
    logit, and whether the set is exactly {v : x_v ≥ τ_r}.

    The rule has two forms that give the same answer, row by row. The torch form is its
    portable statement (any device, and CPU tensors without the native kernel): τ by a
    scatter-min of the logits at the ids, then, a chunk of rows at a time, a (chunk, V) bool of
    the ids compared with x ≥ τ. The native form is its fast form (CPU tensors when
    :func:`klpenalty.ops.native.available`; the op ``native_support_from_ids``): per row, in
    parallel over rows, the ids mark a byte map of V bools (a duplicate marks once, so a set
    {a, a} is never taken for {a, b}), then one vectorised pass over the row takes τ,
    the minimum of the marked logits, and the maximum of the unmarked ones; the kept ids all
    pass x ≥ τ, so the set is {x ≥ τ} iff that maximum is < τ. Nothing of size (N, V) is
    built: it reads the logits once more and the ids once (K·8 bytes for int64 ids).

    τ is in the compute dtype (float32; float64 for float64 logits): +inf for an empty set
    (exact iff no logit is +inf), NaN when a kept logit is NaN (never exact).

    Args:
        logits: (..., V) float policy logits.
        ids, offsets: the kept sets, as in :func:`support_from_ids`.
        chunk_rows: rows compared at a time by the torch form.
        native: True / False forces the native / torch form; None (default) picks the native
            form for CPU tensors when it is available.

    Returns:
        (tau (...), exact (...) bool).

    Raises:
        TypeError / ValueError: naming ``support`` ids/offsets with their shape and dtype, or
            ``native=True`` for tensors off the CPU;
        RuntimeError: ``native=True`` while the native kernel is unavailable.
    """
    v.check_logits("logits", logits)
    _check_compact(ids, offsets, math.prod(logits.shape[:-1]), logits.shape[-1], logits.device)
    return _threshold_of_ids(logits, ids, offsets, chunk_rows, native)


def _threshold_of_ids(
    logits: Tensor, ids: Tensor, offsets: Tensor, chunk_rows: int | None, native: bool | None
) -> tuple[Tensor, Tensor]:
    """:func:`threshold_of_ids` of validated arguments: the ``support_from_ids`` op of the
    backend (native for CPU tensors when it builds, else streaming; ``native`` forces one)."""
    on_cpu = logits.device.type == "cpu"
    if native and not on_cpu:
        raise ValueError(f"native=True needs CPU tensors, got logits on {logits.device}")
    if native and not dispatch.REGISTRY["native"].available():
        status = dispatch.REGISTRY["native"].module.status()
        raise RuntimeError(f"native=True needs the native kernel: {status}")
    name = "auto" if native is None else ("native" if native else "streaming")
    impl = dispatch.get_backend(name, logits.device)
    tau, exact = impl.support_from_ids(logits.detach(), *ids_args(ids, offsets),
                                       chunk_rows=chunk_rows or 0)
    leading = logits.shape[:-1]
    return tau.reshape(leading), exact.reshape(leading)


def ids_args(ids: Tensor, offsets: Tensor) -> tuple[Tensor, Tensor]:
    """Validated compact kept sets as the ops' ``ids`` / ``offsets``: int32 and int64 as they
    are, other integer dtypes as int64 (the ops read int32 / int64)."""
    return tuple(t if t.dtype in (torch.int32, torch.int64) else t.long() for t in (ids, offsets))


def _check_compact(ids: object, offsets: object, n: int, vocab: int, device,
                   values: bool = True) -> None:
    """Shapes, dtypes, device and (``values``) values of a compact support (reads the values:
    one sync; :func:`check_compact_values`)."""
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
    if values:
        check_compact_values(ids, offsets, vocab)


def parse_support(
    support: object, top_k: object, top_p: object, min_p: object, shape, device,
    values: bool = True,
) -> tuple[str, object]:
    """The ``support=`` / ``top_k=`` / ``top_p=`` / ``min_p=`` arguments of a public function,
    validated against policy logits of ``shape`` (..., V) on ``device`` (the logits need not
    exist: :func:`klpenalty.linear_kl` builds them a chunk at a time).

    Returns ``(kind, payload)``: ``("none", None)`` (the untruncated policy), ``("keep", mask)``
    a bool (..., V) tensor, ``("ids", (ids, offsets))`` a compact kept set (checked), or
    ``("rule", (top_k, top_p, min_p))`` sampler settings of which at least one cuts.
    ``values``: False leaves the values of a compact kept set unread (the caller checks them,
    :func:`check_compact_values`, or has its op check them).
    """
    samplers = {"top_k": top_k, "top_p": top_p, "min_p": min_p}
    given = [name for name, val in samplers.items() if val is not None]
    shape = tuple(shape)
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
            if tuple(support.shape) != shape:
                raise ValueError(
                    f"support must have the shape of the policy logits {shape}, "
                    f"got {v.describe(support)}"
                )
            if support.device != device:
                raise ValueError(f"support must be on {device}, got {support.device}")
            return "keep", support
        if isinstance(support, (tuple, list)) and len(support) == 2:
            _check_compact(support[0], support[1], math.prod(shape[:-1]), shape[-1], device,
                           values)
            return "ids", (support[0], support[1])
        raise TypeError(
            "support must be a bool tensor (..., V) or a pair (ids, offsets) of integer "
            f"tensors, got {type(support).__name__}"
        )
    if not given:
        return "none", None
    vocab = shape[-1]
    top_k, top_p, min_p = check_sampler(top_k, top_p, min_p).values()
    cuts = (
        top_k is not None and top_k < vocab,
        top_p is not None and top_p < 1.0,
        min_p is not None and min_p > 0.0,
    )
    if not any(cuts):  # nothing cut: the untruncated policy (NaN logits still reported)
        return "none", None
    return "rule", (top_k, top_p, min_p)


def resolve_support(
    logits: Tensor,
    support: object,
    top_k: object,
    top_p: object,
    min_p: object,
    temperature: float,
    backend: str = "auto",
) -> tuple[Tensor | None, Tensor | None]:
    """The ``(keep, tau)`` of the public functions' ``support=`` / ``top_k=`` / ``top_p=`` /
    ``min_p=`` arguments (validated by :func:`parse_support`), or (None, None) for the
    untruncated policy; sampler settings become their threshold (:func:`sampling_threshold`).

    ``support``: a bool (..., V) tensor (used as ``keep``) or a pair ``(ids, offsets)``
    (:func:`support_from_ids`); it excludes the three sampler settings.
    """
    kind, payload = parse_support(support, top_k, top_p, min_p, logits.shape, logits.device)
    keep, tau, sampler = support_args(kind, payload, logits)
    if kind == "rule":
        impl = dispatch.get_backend(backend, logits.device)
        tau = impl.threshold(logits, sampler=sampler, temperature=temperature)
    return keep, tau


def support_args(kind: str, payload: object, logits: Tensor) -> tuple:
    """The op arguments ``(keep, tau, (top_k, top_p, min_p))`` of a parsed support
    (:func:`parse_support`) for policy logits (..., V): sampler settings stay settings (the
    op computes their threshold row by row, in the same read of the logits as the KL)."""
    if kind == "keep":
        return payload, None, op_sampler(None, None, None)
    if kind == "ids":
        return (*_support_from_ids(logits, *payload), op_sampler(None, None, None))
    if kind == "rule":
        return None, None, op_sampler(*payload)
    return None, None, op_sampler(None, None, None)


def op_support(support: object, top_k: object, top_p: object, min_p: object,
               logits: Tensor) -> tuple:
    """The forward op's support arguments ``(keep, tau, sampler, ids, offsets)`` of a public
    function's ``support=`` / ``top_k=`` / ``top_p=`` / ``min_p=`` (validated by
    :func:`parse_support`) for policy logits (..., V): a compact kept
    set goes to the op as its ``ids`` / ``offsets`` (int32/int64, :func:`ids_args`; the op
    finds the sets' thresholds in its pass over the rows and checks their values,
    :func:`klpenalty.ops.contract.check_compact_values`); anything else as
    :func:`support_args`."""
    kind, payload = parse_support(support, top_k, top_p, min_p, logits.shape, logits.device,
                                  values=False)
    ids = offsets = None
    if kind == "ids":
        ids, offsets = ids_args(*payload)
        kind, payload = "none", None
    return (*support_args(kind, payload, logits), ids, offsets)


def rows_of_support(kind: str, payload: object, logits: Tensor, rows: Tensor) -> tuple:
    """:func:`support_args` of the rows ``rows`` (R,) (flat indices into the N positions of the
    parsed support) for their policy logits ``logits`` (R, V): the support of a chunk of rows.

    The thresholds are per row, so a chunk's are those of the whole computed on its rows.
    """
    if kind == "keep":
        return support_args(kind, payload.reshape(-1, payload.shape[-1])[rows], logits)
    if kind == "ids":
        return support_args(kind, ids_of_rows(*payload, rows), logits)
    return support_args(kind, payload, logits)


def ids_of_rows(ids: Tensor, offsets: Tensor, rows: Tensor) -> tuple[Tensor, Tensor]:
    """The compact kept sets ``(ids, offsets)`` (validated) of the rows ``rows`` (R,) alone:
    (their kept ids, (R + 1,) int64 offsets)."""
    starts = offsets[rows].long()  # (R,)
    counts = offsets[rows + 1].long() - starts
    new_offsets = torch.zeros(rows.shape[0] + 1, dtype=torch.long, device=offsets.device)
    new_offsets[1:] = counts.cumsum(0)
    # the position of each kept id of the chunk in ``ids``: its row's start + its rank
    rank = torch.arange(int(new_offsets[-1]), device=ids.device) - torch.repeat_interleave(
        new_offsets[:-1], counts
    )
    return ids[torch.repeat_interleave(starts, counts) + rank], new_offsets
