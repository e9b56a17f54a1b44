"""The exact, full-vocabulary KL penalty, per-token log-probs and the policy entropy.

Shape letters: B batch, T sequence, V vocabulary, N rows (product of the leading dims).
All functions accept any leading dims: logits (..., V), per-token tensors (...).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from . import _validation as v
from .ops.dispatch import get_backend

__all__ = ["full_kl", "kl_penalized_reward", "token_logprobs", "entropy", "TokenStats"]


class TokenStats(NamedTuple):
    """Per-position statistics of one batch, each (...) or None where not requested.

    Returned by the one-pass functions (the policy logits, or the hidden states and LM heads,
    are read once for all of them).
    """

    kl: Optional[torch.Tensor]
    """Exact KL(π‖ρ) (π̃, the truncated policy, when a support is given)."""
    logprobs: Optional[torch.Tensor]
    """log π(token) of the given tokens (log π̃ with a support)."""
    ref_logprobs: Optional[torch.Tensor]
    """log ρ(token) of the given tokens under the (never truncated) reference."""
    entropy: Optional[torch.Tensor]
    """H(π) (H(π̃) with a support)."""


def full_kl(
    policy_logits: torch.Tensor,
    ref_logits: torch.Tensor,
    *,
    mask: torch.Tensor | None = None,
    temperature: float = 1.0,
    backend: str = "auto",
    check: bool = True,
) -> torch.Tensor:
    """Exact categorical KL(π‖ρ) at every position, from logits.

    KL = Σ_v π(v)·(log π(v) − log ρ(v)) with π = softmax(policy_logits / T) and
    ρ = softmax(ref_logits / T), computed with a stable log-softmax in float32 (float64 for
    float64 inputs). This is the KL itself, not a sampled-token estimate. No (N, V) temporary
    the size of the whole batch is allocated: the logits are streamed in cache-sized tiles.

    Numerics: 0·log 0 = 0 (vocabulary entries that are -inf in the policy contribute nothing);
    a token the policy can emit but the reference gives probability 0 makes KL = +inf; the
    result is clamped at 0 and is exactly 0 for identical logits; adding a constant to a row
    of either model changes nothing.

    Args:
        policy_logits: (..., V) float16/bfloat16/float32/float64, policy π. Gradients flow.
        ref_logits: (..., V) same shape, any float dtype, frozen reference ρ. Gets a gradient
            (ρ − π)/T only if it requires grad.
        mask: optional (...) bool, True = this position counts. Masked positions return 0
            and get zero gradient; their logits may hold anything (even all -inf).
        temperature: > 0; divides both models' logits before the softmax.
        backend: ``"auto"`` (the fastest available for the device) or a name from
            ``klpenalty.ops.dispatch.available_backends()`` (``"streaming"``: the portable
            engine, any device; ``"native"``: the fused C++ CPU kernel, built at its first use,
            which ``"auto"`` picks on CPU). All give the same result up to float32 rounding.
        check: raise ValueError when a counted position's logits hold NaN or define no
            distribution. It reads the (...) result on the host: one device synchronisation
            per call, nothing per tile. ``check=False`` skips it (such positions give NaN).

    Returns:
        (...) float32 (float64 if either input is float64), differentiable (also twice: a
        second derivative recomputes the first with plain PyTorch ops, materialising (..., V)).
        The gradient with respect to the policy logits is π·((log π − log ρ) − KL)/T, in the
        input's dtype. An empty batch gives an empty result.

    Raises:
        TypeError: non-tensor or non-floating logits, non-bool mask.
        ValueError: mismatched shapes, temperature ≤ 0, an unknown backend, NaN in a counted
            position's logits (with ``check``).
    """
    mask, temperature, impl = check_kl_args(policy_logits, ref_logits, mask, temperature, backend)
    return impl.full_kl(policy_logits, ref_logits, mask, temperature, check=check)


def check_kl_args(policy_logits, ref_logits, mask, temperature, backend):
    """Validate the arguments shared by the exact-KL functions; returns (mask, T, backend)."""
    v.check_logits_pair(policy_logits, ref_logits)
    temperature = v.check_temperature(temperature)
    if mask is not None:
        mask = v.check_mask(mask, policy_logits.shape[:-1], policy_logits.device)
    return mask, temperature, get_backend(backend, policy_logits.device)


def kl_penalized_reward(
    policy_logits: torch.Tensor,
    ref_logits: torch.Tensor,
    reward: torch.Tensor,
    beta: float = 0.1,
    *,
    mask: torch.Tensor | None = None,
    temperature: float = 1.0,
    backend: str = "auto",
    check: bool = True,
) -> torch.Tensor:
    """The shaped reward ``reward − beta · KL(π‖ρ)`` with the exact full-vocabulary KL.

    Identical logits leave the reward unchanged (their KL is exactly 0):

    >>> import torch
    >>> from klpenalty import kl_penalized_reward
    >>> logits = torch.tensor([[[2.0, 0.0, 0.0]]])
    >>> reward = torch.tensor([[1.0]])
    >>> kl_penalized_reward(logits, logits, reward, beta=0.1)
    tensor([[1.]])

    Note that the KL at position t does not depend on the token sampled at t: as a *detached*
    per-token reward in a policy-gradient loss it does not give the gradient of the sequence
    KL (it misses the pathwise term), and differentiating it alone misses the future term.
    :func:`klpenalty.full_kl_reward_and_loss` splits the exact KL into both terms.

    Args:
        policy_logits: (..., V) any float dtype.
        ref_logits: (..., V) same shape, any float dtype.
        reward: (...) float, the leading dims of the logits exactly (no broadcasting).
        beta: KL coefficient, finite and ≥ 0 (a float; controllers give ``.value``). With
            beta = 0 the KL is not computed and the reward comes back as is.
        mask: optional (...) bool, True = counts; where False the reward comes back unchanged.
        temperature: > 0; divides both models' logits before the softmax.
        backend, check: as in :func:`full_kl`.

    Returns:
        (...) tensor, the dtype of ``reward`` promoted with float32 (float64 if any input is
        float64). Differentiable with respect to the logits (and reward).
    """
    mask, temperature, impl = check_kl_args(policy_logits, ref_logits, mask, temperature, backend)
    v.check_per_token("reward", reward, policy_logits.shape[:-1])
    beta = v.check_beta(beta)
    if beta == 0.0:  # no penalty; also avoids 0·inf = NaN where the KL is infinite
        dtype = torch.promote_types(reward.dtype, v.compute_dtype(policy_logits, ref_logits))
        return reward.to(dtype).clone()
    kl = impl.full_kl(policy_logits, ref_logits, mask, temperature, check=check)
    return reward - beta * kl


def token_logprobs(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    *,
    temperature: float = 1.0,
    ignore_index: int = -100,
    backend: str = "auto",
    check: bool = True,
) -> torch.Tensor:
    """log π(token) = log softmax(logits / T)[token] at every position.

    Computed from a per-row log-sum-exp and a gather, without building a (..., V)
    log-softmax tensor in memory; the backward recomputes the softmax chunk by chunk.

    Args:
        logits: (..., V) float16/bfloat16/float32/float64.
        tokens: (...) integer token ids in [0, V), or ``ignore_index``.
        temperature: > 0; use the temperature the tokens were sampled with.
        ignore_index: negative int; positions whose token equals it (Hugging Face labels use
            -100 for prompt and padding) give 0 and zero gradient, as in cross-entropy.
        backend: as in :func:`full_kl`.
        check: raise ValueError for tokens out of range and NaN log-probs (one device
            synchronisation per call); ``check=False`` skips it.

    Returns:
        (...) float32 (float64 for float64 logits), ≤ 0, differentiable with respect to logits
        (gradient (onehot(token) − π)/T in the logits' dtype), also twice.

    Raises:
        TypeError: non-floating logits or non-integer tokens.
        ValueError: shape mismatch, temperature ≤ 0, ignore_index ≥ 0, and with ``check``:
            token out of range, NaN in logits.
    """
    v.check_logits("logits", logits)
    v.check_tokens(tokens, logits.shape[:-1])
    temperature = v.check_temperature(temperature)
    ignore_index = v.check_ignore_index(ignore_index)
    impl = get_backend(backend, logits.device)
    return impl.token_logprobs(logits, tokens, temperature, ignore_index=ignore_index, check=check)


def entropy(
    logits: torch.Tensor,
    *,
    mask: torch.Tensor | None = None,
    temperature: float = 1.0,
    backend: str = "auto",
    check: bool = True,
) -> torch.Tensor:
    """The policy entropy H(π) = −Σ_v π(v)·log π(v), π = softmax(logits / T), at every position.

    Computed from a per-row log-sum-exp and Σ e^u·u in float32 (float64 for float64 logits),
    streamed like :func:`full_kl`: no (..., V) temporary. 0·log 0 = 0 (-inf entries contribute
    nothing: a row with one finite entry has H = 0 exactly); clamped at 0; adding a constant to
    a row changes nothing.

    Args:
        logits: (..., V) float16/bfloat16/float32/float64.
        mask: optional (...) bool, True = this position counts. Masked positions return 0 and
            get zero gradient; their logits may hold anything (even all -inf).
        temperature: > 0; divides the logits before the softmax.
        backend: as in :func:`full_kl`.
        check: raise ValueError when a counted position's logits hold NaN or define no
            distribution (one host read per call); ``check=False`` gives NaN there.

    Returns:
        (...) float32 (float64 for float64 logits), ≥ 0, differentiable (also twice); the
        gradient −π·(log π + H)/T in the logits' dtype. An empty batch gives an empty result.

    Raises:
        TypeError: non-tensor or non-floating logits, non-bool mask.
        ValueError: a mask of the wrong shape, temperature ≤ 0, an unknown backend, NaN in a
            counted position's logits (with ``check``).
    """
    v.check_logits("logits", logits)
    temperature = v.check_temperature(temperature)
    if mask is not None:
        mask = v.check_mask(mask, logits.shape[:-1], logits.device)
    impl = get_backend(backend, logits.device)
    return impl.entropy(logits, mask, temperature, check=check)
