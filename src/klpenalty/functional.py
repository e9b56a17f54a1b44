"""The exact, full-vocabulary KL penalty, per-token log-probs and the policy entropy.

Shape letters: B batch, T sequence, V vocabulary, N rows (product of the leading dims).
All functions accept any leading dims: logits (..., V), per-token tensors (...).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from . import _validation as v
from .ops import dispatch
from .ops.contract import Want
from .ops.dispatch import get_backend
from .sampling import check_sampler, op_support

__all__ = [
    "full_kl",
    "kl_penalized_reward",
    "token_logprobs",
    "entropy",
    "token_stats",
    "TokenStats",
]


class TokenStats(NamedTuple):
    """Per-position statistics of one batch, each (...) or None where not requested.

    Returned by the one-pass functions (:func:`token_stats`: the policy logits, or the hidden
    states and LM heads, are read once for all of them).
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
    support: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
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
            which ``"auto"`` picks on CPU; ``"triton"``: the Triton kernels, which ``"auto"``
            picks on CUDA). All give the same result up to float32 rounding.
        check: raise ValueError when a counted position's logits hold NaN or define no
            distribution. It reads the (...) result on the host: one device synchronisation
            per call, nothing per tile. ``check=False`` skips it (such positions give NaN).
        support, top_k, top_p, min_p: the policy that sampled, truncated: KL(π̃‖ρ) with π̃
            the renormalised policy on the kept set (the reference is never truncated); as
            in :func:`token_stats`.

    Returns:
        (...) float32 (float64 if either input is float64), differentiable (also twice: a
        second derivative recomputes the first with plain PyTorch ops, materialising (..., V)).
        The gradient with respect to the policy logits is π·((log π − log ρ) − KL)/T, in the
        input's dtype. An empty batch gives an empty result.

    Raises:
        TypeError: non-tensor or non-floating logits, non-bool mask.
        ValueError: mismatched shapes, temperature ≤ 0, an unknown backend, NaN in a counted
            position's logits (with ``check``), an invalid support.
    """
    return _token_stats(
        policy_logits, ref_logits, None, x_name="policy_logits", kl=True, logp=False,
        ref_logp=False, entropy=False, mask=mask, support=support, top_k=top_k, top_p=top_p,
        min_p=min_p, temperature=temperature, ignore_index=-100, backend=backend, check=check,
    ).kl


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
    support: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
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
        support, top_k, top_p, min_p: the policy that sampled, as in :func:`full_kl`: the
            penalty is then KL(π̃‖ρ) of the truncated policy.

    Returns:
        (...) tensor, the dtype of ``reward`` promoted with float32 (float64 if any input is
        float64). Differentiable with respect to the logits (and reward).
    """
    check_kl_args(policy_logits, ref_logits, mask, temperature, backend)
    v.check_per_token("reward", reward, policy_logits.shape[:-1])
    beta = v.check_beta(beta)
    if beta == 0.0:  # no penalty; also avoids 0·inf = NaN where the KL is infinite
        check_sampler(top_k, top_p, min_p)  # the support itself is not built
        dtype = torch.promote_types(reward.dtype, v.compute_dtype(policy_logits, ref_logits))
        return reward.to(dtype).clone()
    kl = full_kl(
        policy_logits, ref_logits, mask=mask, temperature=temperature, backend=backend,
        check=check, support=support, top_k=top_k, top_p=top_p, min_p=min_p,
    )
    return reward - beta * kl


def token_logprobs(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    *,
    temperature: float = 1.0,
    ignore_index: int = -100,
    backend: str = "auto",
    check: bool = True,
    support: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
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
        check: raise ValueError for tokens out of range, NaN log-probs and (with a support)
            tokens outside the support (one device synchronisation per call); ``check=False``
            skips it.
        support, top_k, top_p, min_p: log π̃(token) under the truncated policy that sampled
            (see :func:`token_stats`).

    Returns:
        (...) float32 (float64 for float64 logits), ≤ 0, differentiable with respect to logits
        (gradient (onehot(token) − π)/T in the logits' dtype), also twice.

    Raises:
        TypeError: non-floating logits or non-integer tokens.
        ValueError: shape mismatch, temperature ≤ 0, ignore_index ≥ 0, an invalid support,
            and with ``check``: token out of range, NaN in logits, a token off the support.
    """
    return _token_stats(
        logits, None, tokens, x_name="logits", kl=False, logp=True, ref_logp=False,
        entropy=False, mask=None, support=support, top_k=top_k, top_p=top_p, min_p=min_p,
        temperature=temperature, ignore_index=ignore_index, backend=backend, check=check,
    ).logprobs


def entropy(
    logits: torch.Tensor,
    *,
    mask: torch.Tensor | None = None,
    temperature: float = 1.0,
    backend: str = "auto",
    check: bool = True,
    support: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
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
        support, top_k, top_p, min_p: H(π̃) of the truncated policy (see :func:`token_stats`).

    Returns:
        (...) float32 (float64 for float64 logits), ≥ 0, differentiable (also twice); the
        gradient −π·(log π + H)/T in the logits' dtype. An empty batch gives an empty result.

    Raises:
        TypeError: non-tensor or non-floating logits, non-bool mask.
        ValueError: a mask of the wrong shape, temperature ≤ 0, an unknown backend, NaN in a
            counted position's logits (with ``check``), an invalid support.
    """
    return _token_stats(
        logits, None, None, x_name="logits", kl=False, logp=False, ref_logp=False, entropy=True,
        mask=mask, support=support, top_k=top_k, top_p=top_p, min_p=min_p,
        temperature=temperature, ignore_index=-100, backend=backend, check=check,
    ).entropy


def token_stats(
    policy_logits: torch.Tensor,
    ref_logits: torch.Tensor | None = None,
    tokens: torch.Tensor | None = None,
    *,
    mask: torch.Tensor | None = None,
    entropy: bool = False,
    support: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    temperature: float = 1.0,
    ignore_index: int = -100,
    backend: str = "auto",
    check: bool = True,
) -> TokenStats:
    """Every per-token statistic of a PPO/GRPO step from one read of the logits.

    Returns the exact KL(π̃‖ρ) when ``ref_logits`` is given, log π̃(token) when ``tokens`` is,
    log ρ(token) when both are, and H(π̃) with ``entropy=True``, from one backend call that
    reads each logit once (and once more in the backward, for all the gradients together).
    :func:`full_kl`, :func:`token_logprobs` and :func:`entropy` are one-field calls of it.

    π̃ is the policy that really sampled: softmax(policy_logits / T) renormalised on the kept
    set of each position, given as ``support`` or built from ``top_k``/``top_p``/``min_p``
    exactly as a sampler does (:mod:`klpenalty.sampling`: temperature first, top-k → top-p →
    min-p, ties at a boundary kept, at least one token kept); without them π̃ = π. The
    reference ρ = softmax(ref_logits / T) is never truncated, so KL(π̃‖ρ) is finite even where
    ρ gives no mass outside the support.

    >>> import torch, klpenalty
    >>> x = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    >>> s = klpenalty.token_stats(x, x, torch.tensor([0]), top_k=2, entropy=True)
    >>> round(s.logprobs.item(), 4), round(s.kl.item(), 4)  # π̃ = softmax of (2, 1) only
    (-0.3133, 0.1269)

    Args:
        policy_logits: (..., V) float16/bfloat16/float32/float64, the policy π. Gradients flow.
        ref_logits: (..., V) same shape, or None (then no KL and no ref log-probs).
        tokens: (...) integer ids in [0, V) or ``ignore_index``, or None.
        mask: optional (...) bool, True = counts; False positions give 0 in every field and
            zero gradients, whatever their logits hold.
        entropy: also return H(π̃).
        support: the kept set per position: a bool tensor (..., V) (True = kept), or the
            compact form of inference engines, a pair ``(ids, offsets)``: flat kept ids (K,)
            and offsets (N + 1,), row r keeping ``ids[offsets[r]:offsets[r+1]]`` (rows in
            row-major order of the leading dims), any integer dtype (int32 and int64 read as
            they are). It becomes a per-row threshold when each set is exactly
            {v : x_v ≥ τ} (checked by the kernel in its pass over each row), else a dense mask
            (N·V bytes).
            Excludes ``top_k``/``top_p``/``min_p``.
        top_k: int ≥ 1; top_p: in (0, 1]; min_p: in [0, 1]: the sampler's settings (with its
            ``temperature``).
        temperature: > 0, divides both models' logits (the sampler's temperature).
        ignore_index: negative int; tokens equal to it give 0 and zero gradient in the two
            log-prob fields.
        backend: as in :func:`full_kl`.
        check: raise ValueError for tokens out of range, NaN in a counted position, and a
            sampled token outside the support (naming its position); one host read per call.
            ``check=False`` gives NaN / −inf there instead.

    Returns:
        :class:`TokenStats` (kl, logprobs, ref_logprobs, entropy), each (...) float32 (float64
        for float64 inputs) or None where not requested; differentiable with respect to both
        logits (also twice). Gradients flow through π̃ (the support itself is a fixed set):
        0 off the support.

    Raises:
        TypeError / ValueError: invalid arguments (named, with shape and dtype), nothing
            requested, and with ``check`` the errors above.
    """
    if not isinstance(entropy, bool):
        raise TypeError(f"entropy must be a bool, got {type(entropy).__name__}")
    if ref_logits is None and tokens is None and not entropy:
        raise ValueError(
            "token_stats has nothing to compute: give ref_logits (KL), tokens (log-probs) "
            "or entropy=True"
        )
    return _token_stats(
        policy_logits, ref_logits, tokens, x_name="policy_logits", kl=ref_logits is not None,
        logp=tokens is not None, ref_logp=ref_logits is not None and tokens is not None,
        entropy=entropy, mask=mask, support=support, top_k=top_k, top_p=top_p, min_p=min_p,
        temperature=temperature, ignore_index=ignore_index, backend=backend, check=check,
    )


def _token_stats(
    x, y, tokens, *, x_name, kl, logp, ref_logp, entropy, mask, support, top_k, top_p, min_p,
    temperature, ignore_index, backend, check,
) -> TokenStats:
    """The one validation and dispatch of the public functions; ``kl``/``logp``/``ref_logp``/
    ``entropy`` say which fields are wanted (the view functions ask for one)."""
    if kl or ref_logp:
        v.check_logits_pair(x, y)
    else:
        v.check_logits(x_name, x)
        y = None
    leading = x.shape[:-1]
    if logp or ref_logp:
        v.check_tokens(tokens, leading)
    else:
        tokens = None
    temperature = v.check_temperature(temperature)
    if tokens is not None:
        ignore_index = v.check_ignore_index(ignore_index)
    if mask is not None:
        mask = v.check_mask(mask, leading, x.device)
    impl = get_backend(backend, x.device)
    # (ids, offsets): the op finds the sets' thresholds in its pass over the rows
    keep, tau, sampler, ids, offsets = op_support(support, top_k, top_p, min_p, x)
    want = Want.KL * kl | Want.LOGP * logp | Want.REF_LOGP * ref_logp | Want.ENTROPY * entropy
    out = dispatch.token_stats(
        impl, x, y, tokens, mask, keep, tau, temperature, ignore_index=ignore_index, want=want,
        check=check, sampler=sampler, ids=ids, offsets=offsets,
    )
    return TokenStats(  # (...) contiguous fields: callers may .view() them
        *(out[..., col].contiguous() if want & bit else None for col, bit in enumerate(Want))
    )
