"""OpenRLHF's ``compute_approx_kl`` with the gradient-correct KL gradient.

OpenRLHF computes its per-token KL through ``openrlhf.models.utils.compute_approx_kl``: in the
reward when ``--algo.kl.use_loss`` is off (``experience_maker.py``, detached, estimator
``--algo.kl.estimator``, default ``"k1"``) and in the actor loss when it is on
(``trainer/ray/ppo_actor.py``). :func:`compute_approx_kl` here has the signature of OpenRLHF
0.11 and returns, per token (with r = log π − log ρ):

- the **value** OpenRLHF reports: ``"k1"``: r; ``"k2"``: r²/2; ``"k3"``: e⁻ʳ − 1 + r; each
  clamped to [−10, 10] (OpenRLHF bounds r ≥ −10 inside k3 only for its gradient: the value is
  unchanged by it once clamped at 10).
- the **gradient** of :func:`klpenalty.k3_ratio_loss`: token by token w·r·∇log π with
  w = π/π_old = exp(log_probs − log_probs_old) (w = 1 without ``log_probs_old``), for every
  estimator and whatever ``unbiased_gradient`` says.

On-policy its expectation at each state is exactly ∇KL(π‖ρ), the reverse-KL gradient (the
pathwise part of ∇KL_seq; see :mod:`klpenalty.rlhf.gradients`). Off-policy (PPO epochs after
the first, tokens from π_old), ``log_probs_old`` makes each token's expectation ∇KL(π‖ρ) again
at the states π_old visited. OpenRLHF's own ``unbiased_gradient=True`` gives the same gradient
except that it clips w at 10; this function does not clip w. OpenRLHF's default
(``unbiased_gradient=False``): ``"k1"`` in the loss has expected gradient 0, ``"k2"`` the
reverse-KL gradient on-policy, ``"k3"`` the *forward*-KL gradient (logit gradient π − ρ).

Shape letters: B batch, T response length (any shape works: the function is per token).
"""

from __future__ import annotations

import torch

from .. import _validation as v
from ..rlhf.estimators import sampled_kl
from ._common import check_logprobs, reverse_kl_gradient

__all__ = ["compute_approx_kl", "KL_ESTIMATORS"]

KL_ESTIMATORS = ("k1", "k2", "k3")
_VALUE_CLAMP = 10.0  # OpenRLHF clamps every estimator's value to [-10, 10]


def compute_approx_kl(
    log_probs: torch.Tensor,
    log_probs_base: torch.Tensor,
    log_probs_old: torch.Tensor | None = None,
    kl_estimator: str = "k1",
    unbiased_gradient: bool = False,
    *,
    check: bool = True,
) -> torch.Tensor:
    """Per-token KL with OpenRLHF's value and the gradient of KL(π‖ρ) (module docstring).

    >>> import torch
    >>> lp = torch.tensor([-1.0, -2.0], requires_grad=True)
    >>> base = torch.tensor([-1.5, -1.0])
    >>> kl = compute_approx_kl(lp, base, kl_estimator="k3")
    >>> kl.detach()
    tensor([0.1065, 0.7183])
    >>> kl.sum().backward()
    >>> lp.grad                                     # log π − log ρ, not 1 − ρ/π
    tensor([ 0.5000, -1.0000])

    Args:
        log_probs: (B, T) (any shape) float, log π of the sampled tokens, differentiable.
        log_probs_base: same shape, log ρ of the same tokens (no gradient flows to it).
        log_probs_old: optional, same shape, log π_old of the tokens (the rollout policy):
            importance-weights the gradient for off-policy mini-batches (detached).
        kl_estimator: ``"k1"`` (OpenRLHF's default), ``"k2"`` or ``"k3"``: selects the value.
        unbiased_gradient: accepted for call compatibility with OpenRLHF (its actor passes
            it); must be a bool. The gradient here is always the reverse-KL one.
        check: as in :func:`klpenalty.sampled_kl` (NaN, values > 1e-4, both −inf).

    Returns:
        same shape, float32 (float64 if an input is float64).

    Raises:
        ValueError: an unknown estimator, mismatched shapes, or (with ``check``) bad log-probs.
        TypeError: non-float tensors, ``unbiased_gradient`` not a bool, or a string as the
            third argument (the estimator's place before OpenRLHF 0.11).
    """
    names = ("log_probs", "log_probs_base", "log_probs_old")
    check_logprobs(names, log_probs, log_probs_base, log_probs_old)
    v.check_choice("kl_estimator", kl_estimator, KL_ESTIMATORS)
    if not isinstance(unbiased_gradient, bool):
        raise TypeError(f"unbiased_gradient must be a bool, got {type(unbiased_gradient).__name__}")
    value = sampled_kl(log_probs, log_probs_base, kl_estimator, check=check)
    value = value.clamp(-_VALUE_CLAMP, _VALUE_CLAMP)
    return reverse_kl_gradient(value, log_probs, log_probs_base, log_probs_old)
