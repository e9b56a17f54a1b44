"""Float64 ground truth. Materialises everything, obviously correct, slow.

Tests and benchmarks import their baselines from here; nothing else re-implements this math.
Every function upcasts its inputs to float64 and returns float64.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "full_kl_reference",
    "token_logprobs_reference",
    "entropy_reference",
    "kl_penalized_reward_reference",
    "sampled_kl_reference",
    "token_stats_reference",
    "kept_set_reference",
    "divergence_reference",
]


def full_kl_reference(
    policy_logits: torch.Tensor, ref_logits: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """KL(softmax(x/T) || softmax(y/T)) per position, in float64.

    Args:
        policy_logits: (..., V), any float dtype.
        ref_logits: (..., V), any float dtype.
        temperature: > 0, divides both models' logits.

    Returns:
        (...) float64. 0·log 0 = 0 (an entry whose policy logit is −inf adds nothing); +inf
        where the policy has mass the reference lacks: a finite policy logit where the
        reference's is −inf (π > 0 there even where e^{x/T} underflows in float64).
    """
    logp = torch.log_softmax(policy_logits.double() / temperature, dim=-1)
    logq = torch.log_softmax(ref_logits.double() / temperature, dim=-1)
    p = logp.exp()
    terms = torch.where(logp == float("-inf"), 0.0, p * (logp - logq))
    terms = torch.where((logp > float("-inf")) & (logq == float("-inf")), float("inf"), terms)
    return terms.sum(-1).clamp_min(0.0)


def token_logprobs_reference(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """log softmax(logits/T)[token] per position, in float64. logits (..., V), tokens (...)."""
    logp = torch.log_softmax(logits.double() / temperature, dim=-1)
    return logp.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)


def entropy_reference(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """H(softmax(logits/T)) = −Σ π log π per position, in float64; 0·log 0 = 0.

    Args:
        logits: (..., V), any float dtype.
        temperature: > 0.

    Returns:
        (...) float64, ≥ 0 (NaN for a row without a distribution).
    """
    logp = torch.log_softmax(logits.double() / temperature, dim=-1)
    p = logp.exp()
    # 0·log 0 = 0, with the guard inside the product so that its gradient is finite too
    terms = p * torch.where(p > 0, logp, torch.zeros_like(logp))
    return (-terms.sum(-1)).clamp_min(0.0)


def kl_penalized_reward_reference(
    policy_logits: torch.Tensor,
    ref_logits: torch.Tensor,
    reward: torch.Tensor,
    beta: float,
    mask: torch.Tensor | None = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """reward − beta·KL in float64; positions where ``mask`` is False keep their reward."""
    kl = full_kl_reference(policy_logits, ref_logits, temperature)
    if mask is not None:
        kl = torch.where(mask, kl, torch.zeros_like(kl))
    return reward.double() - beta * kl


def sampled_kl_reference(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str
) -> torch.Tensor:
    """The sampled-token estimators written literally in float64 (r = ρ/π at the token)."""
    logr = ref_logprobs.double() - logprobs.double()
    r = logr.exp()
    if estimator == "k1":
        return -logr
    if estimator == "k2":
        return 0.5 * logr**2
    if estimator == "k3":
        return (r - 1) - logr
    if estimator == "abs":
        return logr.abs()
    raise ValueError(f"unknown estimator {estimator!r}")


def token_stats_reference(
    x: torch.Tensor,
    y: torch.Tensor | None,
    tokens: torch.Tensor | None,
    mask: torch.Tensor | None,
    keep: torch.Tensor | None,
    tau: torch.Tensor | None,
    temperature: float,
    ignore_index: int,
    want: int,
) -> torch.Tensor:
    """The token_stats op's out (..., 4) in float64: KL(π̃‖ρ), log π̃(t), log ρ(t), H(π̃).

    π̃ is softmax(x/T) on the support (``ops.contract.kept_logits``: keep and x ≥ tau, compared
    in tau's dtype), ρ = softmax(y/T). Columns not in ``want`` (bits KL 1, LOGP 2, REF_LOGP 4,
    ENTROPY 8), masked positions (``mask`` False) and the log-prob columns at ignored tokens
    are 0. Masked rows are replaced by zeros before any arithmetic, so float64 autograd
    through this function gives exact zeros there.
    """
    from .contract import kept_logits, safe_tokens  # the contract's support rule, one copy

    xs = kept_logits(x.double(), keep, tau)
    ys = None if y is None else y.double()
    if mask is not None:  # masked rows may hold garbage: keep it out of the values and autograd
        rows = mask.unsqueeze(-1)
        xs = torch.where(rows, xs, 0.0)
        ys = None if ys is None else torch.where(rows, ys, 0.0)
    zero = torch.zeros(x.shape[:-1], dtype=torch.float64, device=x.device)
    cols = [zero] * 4
    if want & 1:
        cols[0] = full_kl_reference(xs, ys, temperature)
    if want & 8:
        cols[3] = entropy_reference(xs, temperature)
    if want & 6:
        tok, ignored = safe_tokens(tokens, ignore_index)
        if want & 2:
            cols[1] = torch.where(ignored, 0.0, token_logprobs_reference(xs, tok, temperature))
        if want & 4:
            cols[2] = torch.where(ignored, 0.0, token_logprobs_reference(ys, tok, temperature))
    out = torch.stack(cols, dim=-1)
    return out if mask is None else torch.where(mask.unsqueeze(-1), out, 0.0)


def kept_set_reference(
    logits: torch.Tensor, top_k: int | None = None, top_p: float | None = None,
    min_p: float | None = None, temperature: float = 1.0,
) -> torch.Tensor:
    """The kept set of top-k → top-p → min-p sampling, (..., V) bool: the rule of
    :mod:`klpenalty.sampling` stated literally, step by step, sorted, in float64 but for the
    keys.

    - the key of a token is x/T rounded to the compute dtype
      (:func:`klpenalty.ops.contract.sampler_keys`: float32 for float32, bf16 and fp16 logits,
      float64 for float64 ones); a tie group is the tokens of one key;
    - top-k keeps the keys ≥ the k-th largest key;
    - top-p: the masses exp(k − log Z) of the top-k survivors in float64 (log Z = m +
      log Σ exp(k − m), m their largest key), sorted by decreasing key, the mass before each token
      their exclusive cumulative sum; a group is kept whole when the mass before its first
      token is < p (the first group always; −inf keys only where no other is live);
    - min-p keeps the keys with k − k_max ≥ log(min_p) in float64 (k_max the row's largest).

    Args:
        logits: (..., V), any float dtype; each row on its own (a Python loop: small rows).
        top_k, top_p, min_p: the sampler's settings (None: not used).
        temperature: > 0, the sampler's.
    """
    from .contract import sampler_keys  # the rule's keys, one copy

    keys = sampler_keys(logits.detach(), temperature).double().reshape(-1, logits.shape[-1])
    kept = torch.stack([_kept_row(k, top_k, top_p, min_p) for k in keys])
    return kept.reshape(logits.shape)


def _kept_row(k: torch.Tensor, top_k, top_p, min_p) -> torch.Tensor:
    """The kept set (V,) of one row of keys ``k`` (V,) float64 (:func:`kept_set_reference`)."""
    kept = torch.ones_like(k, dtype=torch.bool)
    if top_k is not None and top_k < k.numel():
        kept &= k >= k.sort(descending=True).values[top_k - 1]
    if top_p is not None and top_p < 1.0:
        live = torch.where(kept, k, -math.inf)
        m = live.max()
        if m > -math.inf:
            mass = torch.exp(live - (m + torch.log(torch.exp(live - m).sum())))
            order = torch.argsort(live, descending=True, stable=True)
            key, mass = live[order], mass[order]
            before = torch.cat([mass.new_zeros(1), mass.cumsum(0)[:-1]])
            first = torch.cat([key.new_ones(1, dtype=torch.bool), key[1:] != key[:-1]])
            starts = first & (before < top_p) & (key > -math.inf)
            starts[0] = True
            kept &= k >= key[starts].min()
    if min_p is not None and min_p > 0.0:
        kept &= (k - k.max()) >= math.log(min_p)
    return kept


def _kl_reference(lp: torch.Tensor, lq: torch.Tensor) -> torch.Tensor:
    """Σ p (log p − log q) over the last dim, float64 log-probs; 0·log 0 = 0, +inf where p has
    mass q lacks."""
    p = lp.exp()
    terms = torch.where(lp == float("-inf"), 0.0, p * (lp - lq))
    terms = torch.where((lp > float("-inf")) & (lq == float("-inf")), float("inf"), terms)
    return terms.sum(-1)


def divergence_reference(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, kind: str, beta: float = 0.5,
    skew: float = 0.1, temperature: float = 1.0, support: torch.Tensor | None = None,
) -> torch.Tensor:
    """The divergences of :func:`klpenalty.divergence` per position, in float64, from the
    materialised distributions π = softmax(student/T), ν = softmax(teacher/T): ``"reverse_kl"``
    KL(π‖ν), ``"forward_kl"`` KL(ν‖π), ``"jsd"`` β·KL(ν‖M) + (1−β)·KL(π‖M) with
    M = β·ν + (1−β)·π, ``"skew_forward_kl"`` KL(ν‖λν + (1−λ)π), ``"skew_reverse_kl"``
    KL(π‖λπ + (1−λ)ν) with λ = ``skew``, ``"tvd"`` ½·Σ|π − ν|.

    ``support``: the student's kept set (..., V) bool (e.g. :func:`kept_set_reference` of a
    sampler's settings); π is then π̃, softmax(student/T) renormalised on it (log π̃ = −inf off
    it, a constant there: float64 autograd gives 0 off the support). The teacher is never
    truncated."""
    xs = student_logits.double()
    if support is not None:
        xs = torch.where(support, xs, -math.inf)
    lp = torch.log_softmax(xs / temperature, dim=-1)
    if support is not None:  # −inf off the support, a constant: no 0·(−inf) in autograd
        lp = torch.where(support, lp, lp.detach())
    lq = torch.log_softmax(teacher_logits.double() / temperature, dim=-1)
    p, q = lp.exp(), lq.exp()
    if kind == "reverse_kl":
        return _kl_reference(lp, lq)
    if kind == "forward_kl":
        return _kl_reference(lq, lp)
    if kind == "jsd":
        lm = torch.log(beta * q + (1.0 - beta) * p)
        return beta * _kl_reference(lq, lm) + (1.0 - beta) * _kl_reference(lp, lm)
    if kind == "skew_forward_kl":
        return _kl_reference(lq, torch.log(skew * q + (1.0 - skew) * p))
    if kind == "skew_reverse_kl":
        return _kl_reference(lp, torch.log(skew * p + (1.0 - skew) * q))
    if kind == "tvd":
        return 0.5 * (p - q).abs().sum(-1)
    raise ValueError(f"unknown kind {kind!r}")
