"""What the stack integrations share: a stack's value with the gradient of a klpenalty loss
form (verl, OpenRLHF), and the exact sequence-KL term of a policy loss (TRL).

Shape letters: B sequences, L completion length.
"""

from __future__ import annotations

import torch

from .. import _validation as v
from ..rlhf.gradients import k3_ratio_loss, next_token_kl


class _ValueWithGradientOf(torch.autograd.Function):
    """Forward: ``value``; backward: the upstream gradient goes to ``surrogate`` only.

    Unlike ``value.detach() + surrogate - surrogate.detach()`` no arithmetic touches the
    surrogate's value, so a surrogate that overflows to +inf cannot turn the value into NaN.
    """

    @staticmethod
    def forward(ctx, value, surrogate):  # type: ignore[override]
        return value.clone()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return None, grad


def check_logprobs(names: tuple[str, str, str], logprobs, ref_logprobs, old_logprobs) -> None:
    """Validate the three per-token tensors under the stack's own argument names.

    ``old_logprobs`` may be None; a string there is the pre-0.11 OpenRLHF call (estimator third).
    """
    lp_name, ref_name, old_name = names
    v.check_float(lp_name, logprobs)
    v.check_per_token(ref_name, ref_logprobs, logprobs.shape)
    if isinstance(old_logprobs, str):
        raise TypeError(
            f"{old_name} must be a tensor or None, got the string {old_logprobs!r}: pass the "
            f"estimator by keyword"
        )
    if old_logprobs is not None:
        v.check_per_token(old_name, old_logprobs, logprobs.shape)


def reverse_kl_gradient(
    value: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor | None,
) -> torch.Tensor:
    """``value`` (detached) carrying the gradient of :func:`klpenalty.k3_ratio_loss`.

    The result's value is ``value``; its gradient with respect to ``logprobs`` is, token by
    token, w·(log π − log ρ) with w = exp(log π − log π_old) (w = 1 when ``old_logprobs`` is
    None). ``ref_logprobs`` and ``old_logprobs`` are treated as constants.

    The arguments are validated already (:func:`check_logprobs`).

    Args:
        value: (...) float, what the stack reports (any estimator, clamped as the stack does).
        logprobs: (...) float, log π of the sampled tokens, differentiable.
        ref_logprobs: (...) float, log ρ of the same tokens.
        old_logprobs: optional (...) float, log π_old of the tokens (the sampling policy).

    Returns:
        (...) tensor, the dtype of ``value``.
    """
    if old_logprobs is not None:
        old_logprobs = old_logprobs.detach()
    surrogate = k3_ratio_loss(logprobs, ref_logprobs.detach(), old_logprobs=old_logprobs)
    return _ValueWithGradientOf.apply(value.detach().to(surrogate.dtype), surrogate)


def exact_kl_term(
    kl: torch.Tensor,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    mask: torch.Tensor,
) -> torch.Tensor:
    """Per completion, Σ_t m_t·KL_t + Σ_t m_t·(w_t − sg w_t)·R_t: value KL_seq, gradient ∇KL_seq.

    The surrogate of the exact objective in the module docstring, before β and the mean over
    completions: the value is the exact sequence KL; the gradient is the pathwise part (through
    ``kl``) plus the future part, w_t·R_t·∇log π(a_t) with R_t = Σ_{u>t} m_u·KL_u detached (the
    return of :func:`klpenalty.next_token_kl`'s rewards) and w_t = exp(log π − log π_old).

    Args:
        kl: (B, L) float, the exact KL at each completion position, differentiable.
        logprobs: (B, L) float, log π of the completion tokens, differentiable.
        old_logprobs: (B, L) float, log π_old of the same tokens (detached here).
        mask: (B, L) bool, True = a completion token that counts.

    Returns:
        (B,) float32 (float64 for float64 inputs).
    """
    v.check_float("kl", kl)
    if kl.dim() != 2:
        raise ValueError(f"kl must have shape (B, L), got {v.describe(kl)}")
    v.check_per_token("logprobs", logprobs, kl.shape)
    v.check_per_token("old_logprobs", old_logprobs, kl.shape)
    mask = v.check_mask(mask, kl.shape, kl.device)
    zero = torch.zeros((), dtype=kl.dtype, device=kl.device)
    present = torch.where(mask, kl, zero).sum(-1)
    kl_to_go = next_token_kl(kl, mask).flip(-1).cumsum(-1).flip(-1)  # R_t = Σ_{u>t} m_u·KL_u
    w = torch.exp(torch.where(mask, logprobs - old_logprobs.detach(), zero))
    future = torch.where(mask, (w - w.detach()) * kl_to_go, zero).sum(-1)
    return present + future
