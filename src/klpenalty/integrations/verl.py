"""verl's ``core_algos.kl_penalty`` with the gradient-correct KL gradient.

verl computes its per-token KL through ``verl.trainer.ppo.core_algos.kl_penalty(logprob,
ref_logprob, kl_penalty)``: in the actor loss (``actor.use_kl_loss``, type
``actor.kl_loss_type``, default ``"low_var_kl"``) and in the reward (``algorithm.use_kl_in_reward``,
type ``algorithm.kl_penalty``, default ``"kl"``). :func:`kl_penalty` here takes the same
arguments and type names and returns, per token:

- the **value** verl's type reports, bit for bit up to float32 rounding (``k3`` as ``expm1``):

  ================================ =========================================================
  type                             value (d = log ρ − log π)
  ================================ =========================================================
  ``"kl"``, ``"k1"``               log π − log ρ
  ``"abs"``                        \\|log π − log ρ\\|
  ``"mse"``, ``"k2"``              ½ (log π − log ρ)²
  ``"low_var_kl"``, ``"k3"``       min(eᵈ − 1 − d, 10) (verl clamps d to ±20 first, which
                                   changes nothing once the value is clamped at 10)
  the same with ``"+"``            the same value (verl's "+" changes only the gradient)
  ``"full"``                       raises ``NotImplementedError``, as verl does
  ================================ =========================================================

- the **gradient** of :func:`klpenalty.k3_ratio_loss`: token by token w·(log π − log ρ)·∇log π,
  with w = π/π_old = exp(logprob − old_logprob) (w = 1 without ``old_logprob``).

What that gradient is. *On-policy* (tokens sampled from the policy being differentiated, as in
verl's first PPO mini-batch of a rollout), its expectation at each state s is exactly
∇KL(π(·|s)‖ρ(·|s)), the gradient of the reverse KL that the penalty is meant to be: summed over a
sequence, the pathwise part of ∇KL_seq (see :mod:`klpenalty.rlhf.gradients`; the future part
comes from the reward, e.g. ``use_kl_in_reward`` with type ``"kl"``). *Off-policy* (later PPO
epochs and mini-batches, where the tokens came from π_old, the rollout policy): pass
``old_logprob`` (verl's ``old_log_prob``), and w corrects each token back to ∇KL(π‖ρ) at that
state; the states (prefixes) remain π_old's, as in PPO. Without ``old_logprob`` the off-policy
expectation is E_{a~π_old}[k1·∇log π], which is not ∇KL. The weight w is not clipped.

verl's own forms: ``"k3"``/``"low_var_kl"`` in the loss has the expected gradient of the
*forward* KL(ρ‖π) (logit gradient π − ρ), and is clamped; ``"k1"`` in the loss has expected
gradient 0; ``"k2"`` and every ``"+"`` type have the reverse-KL gradient on-policy, like this
function (verl's "+" has no off-policy weight). ``ref_logprob`` gets no gradient here.

Shape letters: B batch, T response length (any shape works: the function is per token).
"""

from __future__ import annotations

import torch

from .. import _validation as v
from ..rlhf.estimators import sampled_kl
from ._common import check_logprobs, reverse_kl_gradient

__all__ = ["kl_penalty", "KL_PENALTY_TYPES"]

# verl's type names (estimator in klpenalty.sampled_kl, clamp of the value); "full" raises
_TYPES: dict[str, tuple[str, float | None]] = {
    "kl": ("k1", None),
    "k1": ("k1", None),
    "abs": ("abs", None),
    "mse": ("k2", None),
    "k2": ("k2", None),
    "low_var_kl": ("k3", 10.0),
    "k3": ("k3", 10.0),
}
KL_PENALTY_TYPES = (*_TYPES, *(f"{name}+" for name in _TYPES), "full")


def kl_penalty(
    logprob: torch.Tensor,
    ref_logprob: torch.Tensor,
    kl_penalty: str,
    *,
    old_logprob: torch.Tensor | None = None,
    check: bool = True,
) -> torch.Tensor:
    """Per-token KL with verl's value and the gradient of KL(π‖ρ) (module docstring).

    >>> import torch
    >>> lp = torch.tensor([-1.0, -2.0], requires_grad=True)
    >>> ref = torch.tensor([-1.5, -1.0])
    >>> kl = kl_penalty(lp, ref, "low_var_kl")      # verl's value: e^d − 1 − d, d = ref − lp
    >>> kl.detach()
    tensor([0.1065, 0.7183])
    >>> kl.sum().backward()
    >>> lp.grad                                     # log π − log ρ, not 1 − ρ/π
    tensor([ 0.5000, -1.0000])

    Args:
        logprob: (B, T) (any shape) float, log π of the sampled tokens, differentiable.
        ref_logprob: same shape, log ρ of the same tokens (no gradient flows to it).
        kl_penalty: one of verl's types: ``"kl"``/``"k1"``, ``"abs"``, ``"mse"``/``"k2"``,
            ``"low_var_kl"``/``"k3"``, each optionally with ``"+"``; ``"full"`` raises.
        old_logprob: optional, same shape, log π_old of the tokens (the rollout policy):
            importance-weights the gradient for off-policy mini-batches. Keyword only (verl's
            call passes three arguments).
        check: as in :func:`klpenalty.sampled_kl` (NaN, values > 1e-4, both −inf).

    Returns:
        same shape, float32 (float64 if an input is float64).

    Raises:
        NotImplementedError: ``kl_penalty="full"``; the exact KL needs both models' logits.
        ValueError: an unknown type, mismatched shapes, or (with ``check``) bad log-probs.
        TypeError: non-float tensors.
    """
    v.check_choice("kl_penalty", kl_penalty, KL_PENALTY_TYPES)
    check_logprobs(("logprob", "ref_logprob", "old_logprob"), logprob, ref_logprob, old_logprob)
    if kl_penalty == "full":
        raise NotImplementedError(
            'kl_penalty="full" needs both models\' full logits, which this per-token function '
            "does not get: use klpenalty.hf.causal_lm_kl (from the models and input ids) or "
            "klpenalty.full_kl_reward_and_loss (from the logits) for the exact KL"
        )
    estimator, clamp = _TYPES[kl_penalty.removesuffix("+")]
    value = sampled_kl(logprob, ref_logprob, estimator, check=check)
    if clamp is not None:
        value = value.clamp(max=clamp)
    return reverse_kl_gradient(value, logprob, ref_logprob, old_logprob)
