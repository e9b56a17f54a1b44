"""``kl_report``: the exact KL of a batch next to the sampled-token estimators, and where it sits.

On the user's own batch (two models' logits and the sampled tokens) the report puts the exact
full-vocabulary KL of each sequence next to the k1, k2 and k3 estimates from the same tokens,
measures each estimator's bias and spread against the exact value, counts the positions where
the reference gives the sampled token no mass, and names the few positions (and, at each, the
vocabulary entries) that carry most of the KL.

Shape letters: B batch (any leading dims ``...``), T sequence, V vocabulary, N positions.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from numbers import Integral
from typing import Optional

import torch

from . import _validation as v
from .functional import TokenStats, token_stats
from .rlhf.estimators import sampled_kl

__all__ = [
    "kl_report",
    "KLReport",
    "EstimatorSummary",
    "SequenceKL",
    "TokenAt",
    "TopPosition",
    "VocabContribution",
]

REPORT_ESTIMATORS = ("k1", "k2", "k3")
NO_MASS_LISTED = 5  # positions listed where the reference gives the sampled token no mass
_IGNORE = -100  # token id given to masked positions, whose tokens may hold anything


@dataclass(frozen=True)
class EstimatorSummary:
    """One estimator against the exact KL. ``None`` where no position (sequence) qualifies.

    Per token: over the counted positions where the KL and every estimate are finite
    (``KLReport.finite``); per sequence: over the sequences with at least one counted position,
    all of them finite (``KLReport.sequences_used``). Spreads are standard deviations (divided
    by the count, not count − 1).
    """

    mean_per_token: Optional[float]
    """mean of k over the positions."""
    bias_per_token: Optional[float]
    """mean of k − KL_t."""
    spread_per_token: Optional[float]
    """standard deviation of k − KL_t."""
    mean_per_sequence: Optional[float]
    """mean of Σ_t k over the sequences."""
    bias_per_sequence: Optional[float]
    """mean of Σ_t k − Σ_t KL_t."""
    spread_per_sequence: Optional[float]
    """standard deviation of Σ_t k − Σ_t KL_t."""
    negative_share: Optional[float]
    """share of all counted positions where k < 0 (only k1 can be negative)."""


@dataclass(frozen=True)
class SequenceKL:
    """One sequence's sums over its counted positions (+inf where a term is infinite)."""

    index: tuple[int, ...]
    """the sequence's index in the leading dims (``()`` for a single (T, V) sequence)."""
    tokens: int
    """counted positions."""
    exact: float
    k1: float
    k2: float
    k3: float


@dataclass(frozen=True)
class TokenAt:
    """A position (index into the (..., T) dims) and the token sampled there."""

    index: tuple[int, ...]
    token: int


@dataclass(frozen=True)
class VocabContribution:
    """One vocabulary entry's term π(v)·(log π(v) − log ρ(v)) of a position's KL."""

    token: int
    policy_prob: float
    ref_prob: float
    contribution: float
    """π(v)·(log π(v) − log ρ(v)): 0 where π(v) = 0, +inf where π(v) > 0 = ρ(v)."""
    share: Optional[float]
    """contribution / KL_t (None where KL_t is 0 or infinite); the terms of a row sum to 1."""


@dataclass(frozen=True)
class TopPosition:
    """A position among those with the largest exact KL."""

    index: tuple[int, ...]
    token: int
    """the sampled token."""
    kl: float
    """exact KL_t."""
    share: Optional[float]
    """KL_t / the batch's total KL (with an infinite total: 1/count for the infinite
    positions, 0 for the others; None when the total is 0)."""
    logprob: float
    """log π(token)."""
    ref_logprob: float
    """log ρ(token)."""
    entries: tuple[VocabContribution, ...]
    """the vocabulary entries with the largest terms of KL_t, largest first."""


@dataclass(frozen=True)
class KLReport:
    """What :func:`kl_report` found on one batch. ``to_dict()`` gives plain Python values
    (``from_dict`` reads them back), ``str()`` a fixed-width table (``format(max_sequences=...)``
    sets how many sequence rows).

    Means of the exact KL and of the estimators use the same positions (sequences), so each
    bias is the estimator's mean minus the exact mean.
    """

    shape: tuple[int, ...]
    """the (..., T) dims: sequences × positions."""
    vocab_size: int
    temperature: float
    counted: int
    """positions that count (mask True)."""
    finite: int
    """counted positions where the KL and every estimate are finite: the per-token statistics'."""
    sequences_used: int
    """sequences with a counted position, all finite: the per-sequence statistics'."""
    infinite_kl: int
    """counted positions whose exact KL is +inf (the policy has mass the reference lacks)."""
    exact_total: float
    """Σ KL_t over every counted position."""
    exact_per_token: Optional[float]
    """mean KL_t over the finite positions."""
    exact_per_sequence: Optional[float]
    """mean Σ_t KL_t over the sequences used."""
    estimators: dict[str, EstimatorSummary]
    """``"k1"``, ``"k2"``, ``"k3"``."""
    sequences: tuple[SequenceKL, ...]
    no_mass: int
    """counted positions where log ρ(token) = −inf."""
    no_mass_first: tuple[TokenAt, ...]
    """the first of them (at most 5), in index order."""
    top_positions: tuple[TopPosition, ...]
    top_share: Optional[float]
    """the top positions' shares summed."""

    def to_dict(self) -> dict:
        """Plain Python ints, floats (±inf where a KL is infinite), None, lists and dicts:
        ``json.dumps`` writes it (an infinity as ``Infinity``)."""
        return _plain(asdict(self))

    @classmethod
    def from_dict(cls, d: dict) -> "KLReport":
        """The report back from :meth:`to_dict` (e.g. read from JSON), to print it again."""
        top = tuple(
            TopPosition(
                **{**p, "index": tuple(p["index"]),
                   "entries": tuple(VocabContribution(**e) for e in p["entries"])}
            )
            for p in d["top_positions"]
        )
        return cls(
            **{
                **d,
                "shape": tuple(d["shape"]),
                "estimators": {k: EstimatorSummary(**e) for k, e in d["estimators"].items()},
                "sequences": tuple(
                    SequenceKL(**{**s, "index": tuple(s["index"])}) for s in d["sequences"]
                ),
                "no_mass_first": tuple(
                    TokenAt(tuple(t["index"]), t["token"]) for t in d["no_mass_first"]
                ),
                "top_positions": top,
            }
        )

    def format(self, max_sequences: int = 8) -> str:
        """The fixed-width table, with at most ``max_sequences`` per-sequence rows."""
        return _format(self, max_sequences)

    def __str__(self) -> str:
        return self.format()


def kl_report(
    policy_logits: torch.Tensor,
    ref_logits: torch.Tensor,
    tokens: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
    top: int = 5,
    backend: str = "auto",
    check: bool = True,
) -> KLReport:
    """The exact KL of a batch next to the k1, k2, k3 estimates of its sampled tokens.

    Runs under ``torch.no_grad()``. The exact per-position KL comes from :func:`full_kl`, the
    sampled tokens' log-probs from :func:`token_logprobs` and the estimates from
    :func:`sampled_kl` (computed in float64). Only the ``top`` positions with the largest KL
    are read again, in float64, to split their KL into the terms of its vocabulary entries:
    nothing of size (N, V) is allocated.

    >>> import torch, klpenalty
    >>> half = torch.tensor([0.5, 0.25, 0.25]).log()
    >>> rep = klpenalty.kl_report(half.expand(1, 2, 3), half.flip(0).expand(1, 2, 3),
    ...                           torch.tensor([[0, 2]]))
    >>> round(rep.exact_per_sequence, 4), round(rep.estimators["k1"].mean_per_sequence, 4)
    (0.3466, 0.0)

    Args:
        policy_logits: (..., T, V) float logits of the policy that sampled the tokens.
        ref_logits: (..., T, V) the same shape, the reference model's.
        tokens: (..., T) integer ids of the sampled tokens; in [0, V) where ``mask`` is True,
            anything where it is False.
        mask: optional (..., T) bool, True = the position counts (e.g. response tokens);
            masked positions may hold anything, also NaN logits.
        temperature: > 0, the sampling temperature; divides both models' logits.
        top: ≥ 1, how many positions with the largest KL to list, and how many vocabulary
            entries for each.
        backend: as in :func:`full_kl`.
        check: raise ``ValueError`` for NaN logits or a token out of range at a counted
            position, and for a counted token the policy gives probability 0 (it cannot have
            been sampled from it). ``check=False`` skips these value reads: tokens must then
            be in range (as with :func:`token_logprobs`), and a position whose token the policy
            gives probability 0 drops out of the statistics as non-finite.

    Returns:
        A :class:`KLReport`.

    Raises:
        TypeError: non-tensor or non-float logits, non-integer tokens, a non-bool mask, a
            non-int ``top``.
        ValueError: logits without a sequence dim or of different shapes, tokens or mask
            not of shape (..., T), temperature ≤ 0, ``top`` < 1, and the value checks above.
    """
    v.check_logits_pair(policy_logits, ref_logits)
    if policy_logits.dim() < 2:
        raise ValueError(
            "policy_logits must have shape (..., T, V) with a sequence dim T, "
            f"got {v.describe(policy_logits)}"
        )
    V = policy_logits.shape[-1]
    leading = policy_logits.shape[:-1]  # (..., T)
    device = policy_logits.device
    v.check_tokens(tokens, leading)
    if tokens.device != device:
        raise ValueError(f"tokens must be on {device}, got {tokens.device} ({v.describe(tokens)})")
    if mask is None:
        mask = torch.ones(leading, dtype=torch.bool, device=device)
    else:
        mask = v.check_mask(mask, leading, device)
    temperature = v.check_temperature(temperature)
    if isinstance(top, bool) or not isinstance(top, Integral):
        raise TypeError(f"top must be an int, got {type(top).__name__}")
    if top < 1:
        raise ValueError(f"top must be >= 1, got {top}")
    if not isinstance(check, bool):
        raise TypeError(f"check must be a bool, got {type(check).__name__}")

    with torch.no_grad():
        if check:
            _check_counted_tokens(tokens, mask, V)
        ignored = torch.full(leading, _IGNORE, dtype=torch.long, device=device)
        safe_tokens = torch.where(mask, tokens.long(), ignored)
        stats = _token_stats(
            policy_logits, ref_logits, safe_tokens, mask, temperature, backend, check
        )
        if check:
            _check_policy_mass(stats.logprobs, mask, safe_tokens)
        return _summarise(
            stats, safe_tokens, mask, policy_logits, ref_logits, temperature, int(top)
        )


def _token_stats(
    policy_logits: torch.Tensor,
    ref_logits: torch.Tensor,
    tokens: torch.Tensor,
    mask: torch.Tensor,
    temperature: float,
    backend: str,
    check: bool,
) -> TokenStats:
    """The per-position quantities the report reads, (..., T) each, from one pass over both
    models' logits. ``tokens`` hold ``_IGNORE`` where ``mask`` is False."""
    return token_stats(
        policy_logits, ref_logits, tokens, mask=mask, temperature=temperature,
        ignore_index=_IGNORE, backend=backend, check=check,
    )


def _first_index(bad: torch.Tensor) -> tuple[int, ...]:
    """The index of the first True entry of ``bad`` (..., T), as ints."""
    flat = bad.reshape(-1).nonzero()[0, 0]
    return tuple(int(i) for i in torch.unravel_index(flat, bad.shape))


def _check_counted_tokens(tokens: torch.Tensor, mask: torch.Tensor, vocab_size: int) -> None:
    """Token ids in [0, V) at every counted position (masked ones may hold anything)."""
    bad = mask & ((tokens < 0) | (tokens >= vocab_size))
    if bool(bad.any()):
        first = _first_index(bad)
        raise ValueError(
            f"tokens must lie in [0, {vocab_size}) (the vocabulary size) where mask is True; "
            f"{int(bad.sum())} do not, the first {int(tokens[first])} at index {first} "
            f"({v.describe(tokens)})"
        )


def _check_policy_mass(logprobs: torch.Tensor, mask: torch.Tensor, tokens: torch.Tensor) -> None:
    """No counted token has probability 0 under the policy: it cannot have been sampled."""
    bad = mask & torch.isneginf(logprobs)
    if bool(bad.any()):
        first = _first_index(bad)
        raise ValueError(
            f"tokens ({v.describe(tokens)}) hold a token of probability 0 under the policy "
            f"(policy_logits -inf there) at {int(bad.sum())} counted position(s), the first "
            f"{int(tokens[first])} at index {first}: it cannot have been sampled from the "
            "policy (pass the logits and temperature that sampled it, or mask it out)"
        )


def _mean(x: torch.Tensor) -> Optional[float]:
    return float(x.mean()) if x.numel() else None


def _std(x: torch.Tensor) -> Optional[float]:
    return float(x.std(correction=0)) if x.numel() else None


def _summarise(
    stats: TokenStats,
    tokens: torch.Tensor,
    mask: torch.Tensor,
    policy_logits: torch.Tensor,
    ref_logits: torch.Tensor,
    temperature: float,
    top: int,
) -> KLReport:
    """Every figure of the report from the (..., T) statistics, in float64 on the CPU."""
    leading = tuple(mask.shape)  # (..., T)
    T, V = leading[-1], policy_logits.shape[-1]
    seq_shape = leading[:-1]
    S = math.prod(seq_shape)
    counted = mask.reshape(S, T).cpu()  # (S, T)
    zero = torch.zeros((), dtype=torch.float64)
    kl = torch.where(counted, stats.kl.reshape(S, T).cpu().double(), zero)
    lp = stats.logprobs.reshape(S, T).cpu().double()
    ref_lp = stats.ref_logprobs.reshape(S, T).cpu().double()
    est = {
        name: torch.where(counted, sampled_kl(lp, ref_lp, name, check=False), zero)
        for name in REPORT_ESTIMATORS
    }
    finite = counted & torch.isfinite(kl)
    for k in est.values():
        finite &= torch.isfinite(k)
    seq_used = (counted.sum(-1) > 0) & ((counted & ~finite).sum(-1) == 0)  # (S,)
    seq_kl = kl.sum(-1)  # (S,)
    seq_est = {name: k.sum(-1) for name, k in est.items()}

    summaries = {}
    for name, k in est.items():
        n_counted = int(counted.sum())
        summaries[name] = EstimatorSummary(
            mean_per_token=_mean(k[finite]),
            bias_per_token=_mean((k - kl)[finite]),
            spread_per_token=_std((k - kl)[finite]),
            mean_per_sequence=_mean(seq_est[name][seq_used]),
            bias_per_sequence=_mean((seq_est[name] - seq_kl)[seq_used]),
            spread_per_sequence=_std((seq_est[name] - seq_kl)[seq_used]),
            negative_share=float((k < 0).sum()) / n_counted if n_counted else None,
        )

    def index(flat: int) -> tuple[int, ...]:
        return tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), leading))

    # per-sequence rows as Python lists at once (S may be thousands)
    seq_index = list(zip(*(i.tolist() for i in torch.unravel_index(torch.arange(S), seq_shape))))
    if not seq_shape:  # one (T, V) sequence
        seq_index = [()]
    seq_tokens = counted.sum(-1).tolist()
    seq_values = {"exact": seq_kl.tolist(), **{n: k.tolist() for n, k in seq_est.items()}}
    flat_tokens = tokens.reshape(-1).cpu()
    no_mass = (counted & torch.isneginf(ref_lp)).reshape(-1)
    no_mass_at = no_mass.nonzero().flatten()[:NO_MASS_LISTED].tolist()

    total = float(kl.sum())
    positions = _top_positions(
        kl.reshape(-1), counted.reshape(-1), total, top, policy_logits, ref_logits,
        temperature, leading,
    )
    top_rows = []
    for flat, share in positions:
        at = index(flat)
        top_rows.append(
            TopPosition(
                index=at,
                token=int(flat_tokens[flat]),
                kl=float(kl.reshape(-1)[flat]),
                share=share,
                logprob=float(lp.reshape(-1)[flat]),
                ref_logprob=float(ref_lp.reshape(-1)[flat]),
                entries=_vocab_terms(policy_logits[at], ref_logits[at], temperature, top),
            )
        )
    shares = [p.share for p in top_rows]
    return KLReport(
        shape=leading,
        vocab_size=V,
        temperature=temperature,
        counted=int(counted.sum()),
        finite=int(finite.sum()),
        sequences_used=int(seq_used.sum()),
        infinite_kl=int((counted & torch.isinf(kl)).sum()),
        exact_total=total,
        exact_per_token=_mean(kl[finite]),
        exact_per_sequence=_mean(seq_kl[seq_used]),
        estimators=summaries,
        sequences=tuple(
            SequenceKL(
                index=seq_index[s],
                tokens=seq_tokens[s],
                **{name: values[s] for name, values in seq_values.items()},
            )
            for s in range(S)
        ),
        no_mass=int(no_mass.sum()),
        no_mass_first=tuple(TokenAt(index(f), int(flat_tokens[f])) for f in no_mass_at),
        top_positions=tuple(top_rows),
        top_share=sum(shares) if top_rows and None not in shares else None,
    )


def _top_positions(
    kl: torch.Tensor,
    counted: torch.Tensor,
    total: float,
    top: int,
    policy_logits: torch.Tensor,
    ref_logits: torch.Tensor,
    temperature: float,
    leading: tuple[int, ...],
) -> list[tuple[int, Optional[float]]]:
    """(flat index, share of the total) of the ``top`` counted positions with the largest KL,
    largest first, ties in index order. ``kl`` and ``counted`` are (N,)."""
    key = torch.where(counted & ~torch.isnan(kl), kl, torch.full_like(kl, -1.0))
    order = torch.sort(key, descending=True, stable=True).indices
    chosen = order[: min(top, int(counted.sum()))].tolist()
    n_inf = int((counted & torch.isinf(kl)).sum())
    out = []
    for flat in chosen:
        k = float(kl[flat])
        if math.isinf(total) and n_inf:  # the limit of the shares: the infinite ones split it
            share: Optional[float] = (1.0 / n_inf) if math.isinf(k) else 0.0
        elif total > 0 and math.isfinite(total):
            share = k / total
        else:
            share = None
        out.append((flat, share))
    return out


def _vocab_terms(
    x: torch.Tensor, y: torch.Tensor, temperature: float, top: int
) -> tuple[VocabContribution, ...]:
    """The ``top`` largest terms π(v)·(log π(v) − log ρ(v)) of one position's KL, in float64.

    x, y: (V,) the position's policy and reference logits.
    """
    logp = torch.log_softmax(x.detach().double() / temperature, dim=-1)  # (V,)
    logq = torch.log_softmax(y.detach().double() / temperature, dim=-1)
    p = logp.exp()
    terms = torch.where(p > 0, p * (logp - logq), torch.zeros_like(p)).cpu()  # 0·log 0 = 0
    kl = float(terms.sum().clamp_min(0.0))
    order = torch.sort(terms, descending=True, stable=True).indices[:top].tolist()
    p, q = p.cpu(), logq.exp().cpu()
    return tuple(
        VocabContribution(
            token=int(t),
            policy_prob=float(p[t]),
            ref_prob=float(q[t]),
            contribution=float(terms[t]),
            share=float(terms[t]) / kl if kl > 0 and math.isfinite(kl) else None,
        )
        for t in order
    )


def _plain(obj):
    """Tuples to lists, recursively (dicts, ints, floats, None and str are kept)."""
    if isinstance(obj, dict):
        return {k: _plain(x) for k, x in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(x) for x in obj]
    return obj


W = 11  # the width of a number column: 4 significant digits take at most 10 (-1.234e-05)


def _num(x: Optional[float], width: int = W) -> str:
    """A number right-aligned in ``width`` characters, 4 significant digits; '-' for None."""
    text = "-" if x is None else f"{x:.4g}"
    return f"{text:>{width}}"


def _pct(x: Optional[float], width: int = 8) -> str:
    text = "-" if x is None else f"{x:.1%}"
    return f"{text:>{width}}"


def _idx(index: tuple[int, ...]) -> str:
    return "(" + ", ".join(str(i) for i in index) + ("," if len(index) == 1 else "") + ")"


def _format(r: KLReport, max_sequences: int) -> str:
    """The fixed-width text of a report (see :meth:`KLReport.format`)."""
    *seq_dims, T = r.shape
    n_seq = math.prod(seq_dims)
    lines = [
        f"KL report: {n_seq} sequence(s) × {T} position(s), V = {r.vocab_size}, "
        f"temperature {r.temperature:g}",
        f"positions: {r.counted} counted, {r.finite} finite; sequences: {r.sequences_used} "
        "used (all counted positions finite)",
        "",
        f"{'':<9}{'mean/tok':>{W}}{'bias/tok':>{W}}{'spread/tok':>{W}}"
        f"{'mean/seq':>{W}}{'bias/seq':>{W}}{'spread/seq':>{W}}{'k < 0':>8}",
        f"{'exact KL':<9}{_num(r.exact_per_token)}{'':>{2 * W}}{_num(r.exact_per_sequence)}",
    ]
    for name, s in r.estimators.items():
        lines.append(
            f"{name:<9}{_num(s.mean_per_token)}{_num(s.bias_per_token)}"
            f"{_num(s.spread_per_token)}{_num(s.mean_per_sequence)}"
            f"{_num(s.bias_per_sequence)}{_num(s.spread_per_sequence)}"
            f"{_pct(s.negative_share)}"
        )
    lines.append("")
    if r.no_mass:
        listed = ", ".join(f"{_idx(t.index)} token {t.token}" for t in r.no_mass_first)
        more = f" (first {len(r.no_mass_first)})" if r.no_mass > len(r.no_mass_first) else ""
        lines.append(
            f"reference gives the sampled token no mass at {r.no_mass} position(s){more}: {listed}"
        )
    else:
        lines.append("reference gives every sampled token some mass")
    if r.infinite_kl:
        lines.append(f"exact KL is +inf at {r.infinite_kl} position(s)")
    if r.top_positions:
        lines += [
            "",
            f"top {len(r.top_positions)} position(s) by KL: {_pct(r.top_share, 0)} of the "
            f"total {r.exact_total:.4g} nats",
            f"  {'index':<14}{'token':>7}{'KL':>{W}}{'share':>8}{'log π(tok)':>12}"
            f"{'log ρ(tok)':>12}",
        ]
        for p in r.top_positions:
            lines.append(
                f"  {_idx(p.index):<14}{p.token:>7}{_num(p.kl)}{_pct(p.share)}"
                f"{_num(p.logprob, 12)}{_num(p.ref_logprob, 12)}"
            )
            lines.append(
                f"  {'':<14}{'token':>7}{'π':>{W}}{'ρ':>{W}}{'π·log(π/ρ)':>12}{'of KL_t':>9}"
            )
            for e in p.entries:
                lines.append(
                    f"  {'':<14}{e.token:>7}{_num(e.policy_prob)}{_num(e.ref_prob)}"
                    f"{_num(e.contribution, 12)}{_pct(e.share, 9)}"
                )
    shown = r.sequences[: max(0, max_sequences)]
    if shown:
        lines += [
            "",
            f"sequences ({len(shown)} of {len(r.sequences)}): sums over counted positions",
            f"  {'index':<14}{'tokens':>7}{'exact KL':>{W}}{'k1':>{W}}{'k2':>{W}}{'k3':>{W}}",
        ]
        for s in shown:
            lines.append(
                f"  {_idx(s.index):<14}{s.tokens:>7}{_num(s.exact)}{_num(s.k1)}{_num(s.k2)}"
                f"{_num(s.k3)}"
            )
    return "\n".join(lines) + "\n"
