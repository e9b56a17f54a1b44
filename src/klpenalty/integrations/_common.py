"""What the stack wrappers share: a stack's value with the gradient of a klpenalty loss form."""

from __future__ import annotations

import torch

from .. import _validation as v
from ..rlhf.gradients import k3_ratio_loss


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

