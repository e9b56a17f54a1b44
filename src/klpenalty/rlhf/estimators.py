"""Sampled-token KL estimators, computed from the log-probs of the sampled tokens.

With tokens sampled from the policy π, ``logprobs`` = log π(token) and ``ref_logprobs`` =
log ρ(token) (e.g. from :func:`klpenalty.token_logprobs`), and r = ρ/π at the token:

====== ========================= ============================ ==================== ==========
name   formula                   E_π[value]                   sign                 variance
====== ========================= ============================ ==================== ==========
k1     log π − log ρ = −log r    KL(π‖ρ): unbiased            negative on ~half    high
k2     ½ (log r)²                not KL: biased (2nd-order    ≥ 0                  low
                                 match, bias grows with KL)
k3     (r − 1) − log r           KL(π‖ρ): unbiased            ≥ 0                  low near π≈ρ
abs    |log r|                   ≥ KL: biased upward          ≥ 0                  low
====== ========================= ============================ ==================== ==========

Each value is a one-sample *estimate* of KL(π‖ρ) at that position, not the KL; the exact
per-position KL is :func:`klpenalty.full_kl`. "Unbiased" refers to the value under on-policy
sampling. The *gradient* of an estimate is a different question: for example the autograd
gradient of k1 has expectation 0 and that of k3 is the gradient of the forward KL(ρ‖π). Use k1
as a detached reward (see :func:`klpenalty.shaped_rewards`) for the reverse-KL policy gradient;
:mod:`klpenalty.rlhf.gradients` has the loss forms (``k2_loss``, ``k3_ratio_loss``, ``k3_loss``)
with the gradient each one gives.
"""

from __future__ import annotations

import torch

from .. import _validation as v

__all__ = ["ESTIMATORS", "sampled_kl"]

ESTIMATORS = ("k1", "k2", "k3", "abs")


def sampled_kl(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    estimator: str = "k1",
    *,
    check: bool = True,
) -> torch.Tensor:
    """Per-token sampled estimate of KL(π‖ρ) from the log-probs of the sampled tokens.

    - ``"k1"``: log π − log ρ. Unbiased estimate of KL(π‖ρ); high variance, often negative.
    - ``"k2"``: ½(log π − log ρ)². Biased: its mean is an f-divergence that matches the KL only
      to second order (for two unit Gaussians, relative bias μ²/4); low variance, ≥ 0.
    - ``"k3"``: (ρ/π − 1) − log(ρ/π), computed as expm1(d) − d with d = log ρ − log π so small
      values do not cancel. Unbiased estimate of KL(π‖ρ), always ≥ 0.
    - ``"abs"``: |log π − log ρ|. Biased upward (its mean is ≥ the KL), ≥ 0.

    All four are estimates from one sampled token, not the KL itself; gradients flow through
    them by plain autograd, and what those gradients mean differs per estimator (see the
    module docstring).

    Infinite log-probs give the limit: where exactly one of log π, log ρ is −inf, k2, k3 and
    abs are +inf, and k1 is −inf (log π = −inf) or +inf (log ρ = −inf). Where both are −inf
    no estimate exists; see ``check``.

    Args:
        logprobs: (...) float, log π of the sampled tokens.
        ref_logprobs: (...) float, same shape, log ρ of the same tokens.
        estimator: one of ``"k1"``, ``"k2"``, ``"k3"``, ``"abs"``.
        check: if True (default), raise ``ValueError`` when either input holds NaN or a value
            above 1e-4 (log-probs are ≤ 0; the 1e-4 lets through the rounding of a float32
            log-softmax for a token of probability ≈ 1, while logits passed by mistake are
            caught), or when both are −inf at the same position (the sampled token has
            probability 0 under the policy). The message names the argument, its shape and
            dtype, the count and the first index. The check costs a device-to-host sync;
            ``check=False`` skips it, and such positions then give NaN (or a meaningless
            value, for logits).

    Returns:
        (...) float32 (float64 if either input is float64).

    Raises:
        TypeError: non-float inputs, or ``check`` not a bool.
        ValueError: mismatched shapes, an unknown ``estimator``, or (with ``check``) the
            values above.
    """
    v.check_float("logprobs", logprobs)
    v.check_per_token("ref_logprobs", ref_logprobs, logprobs.shape)
    v.check_choice("estimator", estimator, ESTIMATORS)
    if not isinstance(check, bool):
        raise TypeError(f"check must be a bool, got {type(check).__name__}")
    if check:
        v.check_logprob_values(logprobs, ref_logprobs)
    dtype = v.compute_dtype(logprobs, ref_logprobs)
    d = ref_logprobs.to(dtype) - logprobs.to(dtype)  # log r = log ρ − log π
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d.square()
    if estimator == "k3":
        # at d = +inf (log π = −inf) expm1(d) − d is inf − inf; subtracting d capped at the
        # largest finite value gives +inf there and changes nothing (value or gradient) else
        return (torch.expm1(d) - d.clamp(max=torch.finfo(dtype).max)).clamp_min(0.0)
    return d.abs()
