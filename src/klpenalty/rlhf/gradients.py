"""KL penalties whose gradient is the gradient you meant: loss forms and reward placements.

A KL(π‖ρ) penalty enters RL training in one of two places, and the gradient differs:

- **in the reward**: a per-token value, *detached*, that reaches the policy only through the
  policy-gradient return, Σ_t ∇log π(a_t|s_t)·G_t (see :func:`klpenalty.shaped_rewards`);
- **in the loss**: a per-token term that autograd differentiates, added as ``beta ·`` loss.

For one state s (a single position, tokens a ~ π(·|s)), writing k1 = log π(a) − log ρ(a):

=========================== ============== ======================================= =========
placement                   value unbiased E_a[gradient]                           right?
=========================== ============== ======================================= =========
k1 as a loss                yes            0                                       no
k1 detached, as a reward    yes            ∇KL(π‖ρ)                                yes
:func:`k2_loss`             no             ∇KL(π‖ρ)                                yes
:func:`k3_ratio_loss`       yes            ∇KL(π‖ρ)                                yes
:func:`k3_loss` (GRPO)      yes            ∇KL(ρ‖π) (logit gradient π − ρ)         no
k3 detached, as a reward    yes            ∇KL(π‖ρ) − ∇KL(ρ‖π)                     no
full KL as a loss           exact          ∇KL(π‖ρ), no sampling noise             yes
=========================== ============== ======================================= =========

:func:`k2_loss` and :func:`k3_ratio_loss` have the *same* gradient sample by sample,
k1·∇log π(a); they differ only in the value they report.

**Sequences.** Over a generated sequence the state s_t (the prefix) depends on the earlier
tokens, and the sequence KL is KL_seq(π‖ρ) = E_π[Σ_t k1_t] = E_π[Σ_t KL_t(s_t)]. Its gradient
has two parts:

    ∇KL_seq = E_π[Σ_t ∇KL_t(s_t)]                              (pathwise: states held fixed)
            + E_π[Σ_t ∇log π(a_t|s_t) · Σ_{u>t} KL_u(s_u)]      (future: a token is responsible
                                                                 for the KL of the states after it)

A per-token *loss* (k2, k3 with ratio, the exact full KL) gives only the pathwise part. The
future part must come through the return: a reward at t equal to the KL of the *next* real
position (:func:`next_token_kl`), so that the return-to-go at t is Σ_{u>t} KL_u. The three
correct recipes (undiscounted Monte Carlo returns, on-policy):

1. ``shaped_rewards(scores, sampled_kl(lp, ref_lp, "k1").detach(), mask, beta)`` and nothing
   in the loss: the k1 return Σ_{u≥t} k1_u carries both parts.
2. ``shaped_rewards(scores, next_token_kl(sampled_kl(lp, ref_lp, "k1"), mask), mask, beta)``
   plus ``beta ·`` :func:`k3_ratio_loss` (or :func:`k2_loss`) summed over real tokens.
3. :func:`full_kl_reward_and_loss`: ``shaped_rewards(scores, reward_kl, mask, beta)`` plus
   ``beta · loss_kl`` summed over tokens. Exact KL, lowest variance.

Putting the *unshifted* k1 in the reward **and** a per-token loss counts the pathwise part
twice. The exact full KL as a detached per-token reward alone misses the pathwise part.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .. import _validation as v
from ..functional import check_kl_args, full_kl

__all__ = [
    "k2_loss",
    "k3_ratio_loss",
    "k3_loss",
    "next_token_kl",
    "full_kl_reward_and_loss",
    "KLRewardAndLoss",
]


def _check_clamp(clamp: object) -> float | None:
    if clamp is None:
        return None
    c = v.check_beta(clamp, "clamp")
    if c == 0.0:
        raise ValueError("clamp must be None (no clamping) or > 0, got 0.0")
    return c


def _masked_inputs(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor | None,
    others: dict[str, torch.Tensor | None] | None = None,
    names: tuple[str, str] = ("logprobs", "ref_logprobs"),
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor | None]]:
    """Validated (log π, log ρ, others), each (...) in the compute dtype, 0 where masked.

    Masked entries are replaced by 0 *before* any arithmetic, so whatever the padding holds
    (huge values, ±inf) gives a 0 value and a 0 gradient there, never inf or NaN. ``names``:
    how the caller's messages call the first two.
    """
    v.check_float(names[0], logprobs)
    v.check_per_token(names[1], ref_logprobs, logprobs.shape)
    named = dict(others or {})
    for name, t in named.items():
        if t is not None:
            v.check_per_token(name, t, logprobs.shape)
    tensors = [logprobs, ref_logprobs, *(t for t in named.values() if t is not None)]
    dtype = v.compute_dtype(*tensors)
    lp = logprobs.to(dtype)
    ref = ref_logprobs.to(dtype)
    out = {k: (None if t is None else t.to(dtype)) for k, t in named.items()}
    if mask is not None:
        mask = v.check_mask(mask, logprobs.shape, logprobs.device)
        zero = torch.zeros((), dtype=dtype, device=logprobs.device)
        lp = torch.where(mask, lp, zero)
        ref = torch.where(mask, ref, zero)
        out = {k: (None if t is None else torch.where(mask, t, zero)) for k, t in out.items()}
    return lp, ref, out


def _log_ratio(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor | None,
    clamp: float | None,
) -> torch.Tensor:
    """d = log ρ − log π (...), validated, 0 where masked, clamped to [−clamp, clamp]."""
    lp, ref, _ = _masked_inputs(logprobs, ref_logprobs, mask)
    d = ref - lp
    return d if clamp is None else d.clamp(-clamp, clamp)


class _K3Ratio(torch.autograd.Function):
    """w·k3 with w = exp(log π − log π_old), k3 = expm1(d) − d, d = clamp(log ρ − log π).

    Inputs (log π, log ρ, log π_old) are (...) tensors of one dtype; log π_old is a constant.
    Plain autograd forms the log π gradient as the sum of w·k3 (through w) and −w·expm1(d)
    (through d): inf − inf = NaN once expm1(d) overflows (d ≳ 88 in float32), although the
    sum is −w·d. The backward here forms −w·d directly, in differentiable torch ops, so it is
    finite wherever the true gradient is, and double backward works.
    """

    @staticmethod
    def forward(ctx, lp, ref, old, clamp):  # type: ignore[override]
        ctx.clamp = clamp
        ctx.save_for_backward(lp, ref, old)
        w, d, _ = _K3Ratio.parts(lp, ref, old, clamp)
        return w * (torch.expm1(d) - d)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        lp, ref, old = ctx.saved_tensors
        w, d, free = _K3Ratio.parts(lp, ref, old, ctx.clamp)
        gw = grad * w
        # where d is free: ∂(w·k3)/∂log π = w·k3 − w·expm1(d) = −w·d, ∂(w·k3)/∂log ρ = w·expm1(d)
        grad_lp = -gw * d
        grad_ref = gw * torch.expm1(d) if ctx.needs_input_grad[1] else None
        if free is not None:
            # where the clamp binds, d is a constant ±c and only w depends on log π; d_bound is
            # 0 where free so that the unused branch never holds inf (0·inf in double backward)
            d_bound = torch.where(free, torch.zeros_like(d), d)
            grad_lp = torch.where(free, grad_lp, gw * (torch.expm1(d_bound) - d_bound))
            if grad_ref is not None:
                grad_ref = torch.where(free, grad_ref, torch.zeros_like(grad_ref))
        return grad_lp, grad_ref, None, None

    @staticmethod
    def parts(
        lp: torch.Tensor, ref: torch.Tensor, old: torch.Tensor, clamp: float | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(w, d, free): free is True where the clamp passes the gradient (None: no clamp)."""
        w = torch.exp(lp - old)  # π/π_old; exactly 1 in value on-policy
        d = ref - lp  # log r = log ρ − log π
        if clamp is None:
            return w, d, None
        free = (d >= -clamp) & (d <= clamp)  # torch.clamp's own gradient rule, ends included
        return w, d.clamp(-clamp, clamp), free


def k2_loss(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    *,
    mask: torch.Tensor | None = None,
    clamp: float | None = None,
) -> torch.Tensor:
    """Per-token loss ½(log π − log ρ)²: on-policy, an unbiased gradient of KL(π‖ρ).

    Gradient, sample by sample: (log π(a) − log ρ(a))·∇log π(a) = k1·∇log π(a). With a ~ π(·|s)
    (on-policy) its expectation is exactly ∇KL(π(·|s)‖ρ(·|s)) at that state. The *value* is a
    biased estimate of the KL (it is Schulman's k2). Summed over a sequence, the expected
    gradient is the pathwise part Σ_t ∇KL_t with the states held fixed; add the future part
    through the reward with :func:`next_token_kl` (see the module docstring).

    Off-policy (tokens drawn from an older policy) the expectation is no longer ∇KL; use
    :func:`k3_ratio_loss` with ``old_logprobs`` there. The per-sample gradient is identical
    to that of :func:`k3_ratio_loss` on-policy.

    Args:
        logprobs: (...) float, log π of the sampled tokens, differentiable (e.g. from
            :func:`klpenalty.token_logprobs`).
        ref_logprobs: (...) float, same shape, log ρ of the same tokens (normally detached;
            if it carries a gradient, that gradient flows too).
        mask: optional (...) bool, True = real token. Masked positions give exactly 0 and a 0
            gradient whatever their log-probs hold.
        clamp: None (default) or c > 0: clamp log ρ − log π to [−c, c] first. Clamping
            **biases** the gradient: a clamped token contributes ±c·∇log π instead of
            k1·∇log π.

    Returns:
        (...) float32 (float64 if any input is float64), ≥ 0. Reduce it like your
        policy-gradient loss (e.g. sum over real tokens, mean over sequences), times beta.
    """
    clamp = _check_clamp(clamp)
    d = _log_ratio(logprobs, ref_logprobs, mask, clamp)
    return 0.5 * d.square()


def k3_ratio_loss(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    *,
    old_logprobs: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    clamp: float | None = None,
) -> torch.Tensor:
    """Per-token loss (π/π_old)·k3: unbiased value *and* unbiased gradient of KL(π‖ρ).

    With w = exp(log π − stopgrad(log π_old)) and k3 = (ρ/π − 1) − log(ρ/π), returns w·k3.
    ``old_logprobs=None`` means on-policy: π_old = stopgrad(π), so w = 1 in value and the
    loss value equals k3, an unbiased estimate of KL(π‖ρ).

    Gradient, sample by sample: ∇(w·k3) = w·(log π(a) − log ρ(a))·∇log π(a) = w·k1·∇log π(a).
    With a ~ π_old(·|s) its expectation is exactly ∇KL(π(·|s)‖ρ(·|s)) at that state (on-policy
    the same per-sample gradient as :func:`k2_loss`). This is the importance weight that k3
    as a loss (GRPO) lacks. Summed over a sequence the expected gradient is the pathwise part
    Σ_t ∇KL_t at the states that were sampled; add the future part through the reward with
    :func:`next_token_kl`. The per-token weight corrects the token, not the distribution of
    the states (prefixes), which off-policy remain those of π_old, as in PPO.

    Numerics: the value is w·(expm1(d) − d) with d = log ρ − log π (no cancellation for small
    d; +inf once expm1 overflows, d ≳ 88 in float32). The gradients are formed directly as
    ∂/∂log π = −w·d and ∂/∂log ρ = w·expm1(d), so the log π gradient stays finite where the
    value overflows (differentiating the formula term by term would give inf − inf = NaN);
    they are differentiable again (double backward works).

    Args:
        logprobs: (...) float, log π of the sampled tokens, differentiable.
        ref_logprobs: (...) float, same shape, log ρ of the same tokens.
        old_logprobs: optional (...) float, same shape, log π_old of the same tokens, the
            policy that sampled them; treated as a constant (detached).
        mask: optional (...) bool, True = real token; masked positions give 0 and a 0
            gradient whatever their log-probs hold.
        clamp: None (default) or c > 0: clamp log ρ − log π to [−c, c] inside k3. Clamping
            **biases** the gradient (a clamped token's k3 no longer depends on log π the
            same way). The importance weight w is never clipped here.

    Returns:
        (...) float32 (float64 if any input is float64), ≥ 0 up to rounding.
    """
    clamp = _check_clamp(clamp)
    lp, ref, others = _masked_inputs(logprobs, ref_logprobs, mask, {"old_logprobs": old_logprobs})
    old = others["old_logprobs"]
    old = lp.detach() if old is None else old.detach()
    return _K3Ratio.apply(lp, ref, old, clamp)


def k3_loss(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    *,
    mask: torch.Tensor | None = None,
    clamp: float | None = None,
) -> torch.Tensor:
    """Per-token k3 = (ρ/π − 1) − log(ρ/π) as a loss, as in GRPO: the **forward**-KL gradient.

    The value is an unbiased estimate of KL(π‖ρ), but its gradient is not the gradient of it.
    Sample by sample ∇k3 = (1 − ρ(a)/π(a))·∇log π(a); with a ~ π(·|s) its expectation is
    ∇KL(ρ(·|s)‖π(·|s)), the gradient of the *forward* KL (with respect to the policy logits:
    π − ρ), which agrees with ∇KL(π‖ρ) only to first order around π = ρ. Summed over a
    sequence: Σ_t ∇KL_t(ρ‖π) at the states the policy visits, held fixed; that is the
    gradient of neither sequence-level KL. Use it to reproduce GRPO (DeepSeekMath, β = 0.04);
    for the reverse KL use :func:`k3_ratio_loss`.

    Args:
        logprobs: (...) float, log π of the sampled tokens, differentiable.
        ref_logprobs: (...) float, same shape, log ρ of the same tokens.
        mask: optional (...) bool, True = real token; masked positions give 0 and a 0
            gradient whatever their log-probs hold.
        clamp: None (default) or c > 0: clamp log ρ − log π to [−c, c] first (biasing,
            like verl's ``low_var_kl`` clamp of ±20).

    Returns:
        (...) float32 (float64 if any input is float64), ≥ 0 up to rounding.
    """
    clamp = _check_clamp(clamp)
    d = _log_ratio(logprobs, ref_logprobs, mask, clamp)
    return torch.expm1(d) - d


def next_token_kl(kl: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Detached per-token KL reward for the future part: the KL of the *next* real position.

    Position t of the result holds ``kl`` at the first real position after t (0 if there is
    none, so the last real token gets 0; padding gets 0). Fed as a reward, its undiscounted
    return-to-go at t is Σ_{u>t} kl_u: the KL of every state that the token at t leads to,
    which is exactly what its log-prob's score-function gradient must carry. Pass it as the
    ``kl`` of :func:`klpenalty.shaped_rewards` and put the KL of position t itself in the loss
    (:func:`full_kl_reward_and_loss` does both for the exact KL).

    Example (the third position is padding, skipped):

    >>> import torch
    >>> next_token_kl(torch.tensor([[0.1, 0.2, 9.0, 0.4]]),
    ...               torch.tensor([[True, True, False, True]]))
    tensor([[0.2000, 0.4000, 0.0000, 0.0000]])

    Args:
        kl: (..., T) float, a per-token KL value or estimate (values at masked positions are
            never read, they may hold anything).
        mask: optional (..., T) bool, True = real token; None = every position is real.

    Returns:
        (..., T), the dtype of ``kl``, detached (it is a reward).
    """
    v.check_float("kl", kl)
    if kl.dim() < 1 or kl.shape[-1] == 0:
        raise ValueError(f"kl must have shape (..., T) with T >= 1, got {v.describe(kl)}")
    if mask is not None:
        mask = v.check_mask(mask, kl.shape, kl.device)
    return _next_token_kl(kl, mask)


def _next_token_kl(kl: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """:func:`next_token_kl` on validated arguments."""
    kl = kl.detach()
    t = kl.shape[-1]
    positions = torch.arange(t, device=kl.device)
    if mask is None:
        mask = torch.ones(kl.shape, dtype=torch.bool, device=kl.device)
    real_at = torch.where(mask, positions, torch.full_like(positions, t))  # (..., T), T = none
    # first real position at or after t: suffix minimum; strictly after t: shift by one
    first_from = real_at.flip(-1).cummin(-1).values.flip(-1)  # (..., T)
    first_after = torch.cat([first_from[..., 1:], torch.full_like(first_from[..., :1], t)], -1)
    has_next = mask & (first_after < t)
    gathered = kl.gather(-1, first_after.clamp(max=t - 1))  # (..., T)
    return torch.where(has_next, gathered, torch.zeros((), dtype=kl.dtype, device=kl.device))


class KLRewardAndLoss(NamedTuple):
    """The two terms of the exact sequence-KL gradient (see :func:`full_kl_reward_and_loss`)."""

    reward_kl: torch.Tensor
    """(..., T), detached: the KL of the next real position, for the reward (future part)."""
    loss_kl: torch.Tensor
    """(..., T), differentiable: the exact KL at each position, for the loss (pathwise part)."""


def full_kl_reward_and_loss(
    policy_logits: torch.Tensor,
    ref_logits: torch.Tensor,
    *,
    mask: torch.Tensor | None = None,
    temperature: float = 1.0,
    backend: str = "auto",
    check: bool = True,
    support: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
) -> KLRewardAndLoss:
    """The exact full-vocabulary KL split so that its RL gradient is the sequence-KL gradient.

    With KL_t = KL(π(·|s_t)‖ρ(·|s_t)) the exact KL at position t (:func:`klpenalty.full_kl`),
    the sequence KL is KL_seq = E_π[Σ_t KL_t] and

        ∇KL_seq = E_π[Σ_t ∇KL_t]  +  E_π[Σ_t ∇log π(a_t|s_t) · Σ_{u>t} KL_u].

    ``loss_kl`` (differentiable) gives the first term by autograd; ``reward_kl`` (detached,
    :func:`next_token_kl` of the same KL) gives the second through an undiscounted return.
    Use both, with the same beta and the same reduction as your policy-gradient loss::

        reward_kl, loss_kl = full_kl_reward_and_loss(policy_logits, ref_logits, mask=mask)
        rewards = shaped_rewards(scores, reward_kl, mask, beta)   # -> returns / advantages
        loss = pg_loss(logprobs, advantages) + beta * loss_kl.sum(-1).mean()

    Then the expected gradient of ``loss`` is −∇E[score] + beta·∇KL_seq(π‖ρ) exactly
    (on-policy, Monte Carlo returns with γ = 1; a critic or GAE adds its usual bias to the
    KL part as it does to the score). Passing ``full_kl(...).detach()`` as the reward instead
    misses the pathwise term; ``loss_kl`` alone misses the future term.

    >>> import torch
    >>> policy = torch.tensor([[[1.0, 0.0], [0.0, 0.0], [0.0, 2.0]]], requires_grad=True)
    >>> ref = torch.zeros(1, 3, 2)
    >>> reward_kl, loss_kl = full_kl_reward_and_loss(policy, ref)
    >>> loss_kl.detach()  # KL at positions 0, 1, 2
    tensor([[0.1109, 0.0000, 0.3278]])
    >>> reward_kl  # the KL of the next position; the last gets nothing
    tensor([[0.0000, 0.3278, 0.0000]])
    >>> loss_kl.requires_grad, reward_kl.requires_grad
    (True, False)

    Args:
        policy_logits: (..., T, V) float, the policy's logits at every position (rank >= 2;
            T is the sequence dim), differentiable.
        ref_logits: (..., T, V) same shape, the frozen reference's logits.
        mask: optional (..., T) bool, True = real (generated) token. Masked positions get 0 in
            both outputs and their logits may hold anything; the last real token of a row gets
            reward 0 (no state follows it).
        temperature: > 0, divides both models' logits (use the sampling temperature).
        backend, check: as in :func:`klpenalty.full_kl`.
        support, top_k, top_p, min_p: the policy that sampled (:func:`klpenalty.full_kl`):
            both terms are then those of KL_seq(π̃‖ρ), the truncated policy's.

    Returns:
        ``KLRewardAndLoss(reward_kl, loss_kl)``, both (..., T) float32 (float64 for float64
        inputs); ``reward_kl`` detached, ``loss_kl`` differentiable with respect to the logits.
    """
    mask, temperature, _ = check_kl_args(policy_logits, ref_logits, mask, temperature, backend)
    if policy_logits.dim() < 2:
        raise ValueError(
            f"policy_logits must have shape (..., T, V) with a sequence dim, "
            f"got {v.describe(policy_logits)}"
        )
    kl = full_kl(
        policy_logits, ref_logits, mask=mask, temperature=temperature, backend=backend,
        check=check, support=support, top_k=top_k, top_p=top_p, min_p=min_p,
    )
    return KLRewardAndLoss(_next_token_kl(kl, mask), kl)
