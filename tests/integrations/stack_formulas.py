"""The stacks' own KL forms, written here from their documented behaviour (not their code).

verl (``core_algos.kl_penalty``, docs of ``actor.kl_loss_type`` / ``algorithm.kl_penalty``) and
OpenRLHF (``models.utils.compute_approx_kl``, the help of ``--algo.kl.estimator`` and
``--algo.kl.unbiased_gradient``), version by version as documented for verl 0.9 and OpenRLHF
0.11. ``tests/integrations/test_stack_sources.py`` checks these copies against the stacks'
installed source where ``make test-integrations`` installs it.
"""

from __future__ import annotations

import torch

VERL_TYPES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
OPENRLHF_ESTIMATORS = ("k1", "k2", "k3")
OPENRLHF_IS_WEIGHT_CLIP = 10.0


def verl_kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kind: str) -> torch.Tensor:
    """verl: value by type; a "+" type keeps the value and takes ½(log π − log ρ)²'s gradient."""
    base = kind[:-1] if kind.endswith("+") else kind
    diff = logprob - ref_logprob
    if base in ("kl", "k1"):
        value = diff
    elif base == "abs":
        value = diff.abs()
    elif base in ("mse", "k2"):
        value = 0.5 * diff.square()
    elif base in ("low_var_kl", "k3"):
        d = (ref_logprob - logprob).clamp(-20.0, 20.0)
        value = (torch.exp(d) - d - 1).clamp(-10.0, 10.0)
    else:
        raise NotImplementedError(kind)
    if not kind.endswith("+") or base in ("mse", "k2"):
        return value
    k2 = 0.5 * diff.square()
    return k2 - k2.detach() + value.detach()


def openrlhf_compute_approx_kl(
    log_probs: torch.Tensor,
    log_probs_base: torch.Tensor,
    log_probs_old: torch.Tensor | None = None,
    kl_estimator: str = "k1",
    unbiased_gradient: bool = False,
) -> torch.Tensor:
    """OpenRLHF: value by estimator, clamped to ±10; optionally the clipped-IS k2 gradient.

    OpenRLHF computes in float32; float64 inputs stay float64 here, so that the enumeration
    tests can check its gradients in float64.
    """
    dtype = torch.promote_types(log_probs.dtype, torch.float32)
    r = log_probs.to(dtype) - log_probs_base.to(dtype)
    if kl_estimator == "k1":
        value = r
    elif kl_estimator == "k2":
        value = r.square() / 2
    elif kl_estimator == "k3":
        rc = r.clamp(min=-10.0)
        value = torch.exp(-rc) - 1 + rc
    else:
        raise ValueError(kl_estimator)
    value = value.clamp(-10.0, 10.0)
    if not unbiased_gradient:
        return value
    if log_probs_old is None:
        w = 1.0
    else:
        w = (log_probs.to(dtype) - log_probs_old.to(dtype)).exp().clamp(max=OPENRLHF_IS_WEIGHT_CLIP)
        w = w.detach()
    k2 = w * r.square() / 2
    return value.detach() + k2 - k2.detach()
