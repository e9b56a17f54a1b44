"""Exact divergences between a student and a teacher, per token, from their logits.

Shape letters: V vocabulary; ``...`` the leading dims (e.g. B, T).

With π = softmax(student_logits/T) and ν = softmax(teacher_logits/T) (one temperature for
both), :func:`divergence` computes one of (the direction written out, student ‖ teacher or
teacher ‖ student):

=======================  ===============================================================
``kind``                 value per token
=======================  ===============================================================
``"reverse_kl"``         KL(π‖ν) = KL(student‖teacher), mode-seeking
``"forward_kl"``         KL(ν‖π) = KL(teacher‖student), mode-covering
``"jsd"``                β·KL(ν‖M) + (1−β)·KL(π‖M), M = β·ν + (1−β)·π (TRL's and Liger's β)
``"skew_forward_kl"``    KL(ν‖λ·ν + (1−λ)·π), λ = ``skew`` (DistiLLM's SKL)
``"skew_reverse_kl"``    KL(π‖λ·π + (1−λ)·ν), λ = ``skew`` (DistiLLM's SRKL)
``"tvd"``                ½·Σ|π − ν|
=======================  ===============================================================

The reverse KL is the token_stats op's KL column (one read of both logits); every other kind
is a second walk over the logits once both log-normalisers are known (the op contract's
``divergence`` op), so it reads them twice forward and once backward, without any (..., V)
temporary beyond the gradient.

The student that sampled with top-k / top-p / min-p (or an engine's kept set) is π̃, π
renormalised on its support, exactly as :func:`klpenalty.full_kl` truncates the policy
(:mod:`klpenalty.sampling`; the same threshold τ): every kind then compares π̃ with the
teacher, which is never truncated. Off the support π̃ = 0, so KL(ν‖π̃) is +inf wherever the
teacher puts mass there (the mixtures and the TVD stay finite), and no gradient reaches those
logits.
"""

from __future__ import annotations

import torch

from . import _validation as v
from .ops import dispatch
from .ops.contract import OUT_KL, ST_TAU, Want, sampler_cuts
from .ops.divergence import KINDS, Divergence, needs_param
from .ops.dispatch import get_backend
from .sampling import op_support

__all__ = ["divergence", "DIVERGENCES", "check_kind"]

# the kinds of :func:`divergence`, in the order of the op's ``kind`` argument
DIVERGENCES: tuple[str, ...] = tuple(KINDS)


def check_kind(kind: object, beta: object, skew: object) -> tuple[Divergence, float]:
    """The kind and the op's ``param`` (β for ``"jsd"``, λ for the skew KLs, else 0), checked."""
    name = v.check_choice("kind", kind, DIVERGENCES)
    k = KINDS[name]
    beta = v.check_fraction("beta", beta)
    skew = v.check_fraction("skew", skew)
    if not needs_param(k):
        return k, 0.0
    return k, (beta if k == Divergence.JSD else skew)


def divergence(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    kind: str = "reverse_kl",
    *,
    beta: float = 0.5,
    skew: float = 0.1,
    mask: torch.Tensor | None = None,
    temperature: float = 1.0,
    backend: str = "auto",
    check: bool = True,
    support: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
) -> torch.Tensor:
    """The divergence of ``kind`` between student and teacher at every position.

    >>> import torch, klpenalty
    >>> s, t = torch.tensor([[2.0, 0.0, -1.0]]), torch.tensor([[0.0, 1.0, 0.5]])
    >>> [round(klpenalty.divergence(s, t, k).item(), 4) for k in ("reverse_kl", "forward_kl")]
    [1.0208, 1.0842]
    >>> klpenalty.divergence(s, s, "jsd").item()
    0.0

    Args:
        student_logits: (..., V) float16/bfloat16/float32/float64. Gradients flow.
        teacher_logits: (..., V) the same shape, any float dtype: a constant (detached; no
            gradient reaches it).
        kind: one of :data:`DIVERGENCES` (the module docstring writes each out).
        beta: the JSD's weight of the teacher in M, in (0, 1) (``"jsd"`` only).
        skew: λ of the skew KLs, in (0, 1) (``"skew_forward_kl"``, ``"skew_reverse_kl"``).
        mask: optional (...) bool, True = counts; False positions give 0 and zero gradient,
            whatever their logits hold.
        temperature: > 0, divides both models' logits.
        backend: as in :func:`klpenalty.full_kl`.
        check: raise ValueError for NaN in a counted position's logits (one host read per
            call, inside the op); ``check=False`` gives NaN there instead.
        support, top_k, top_p, min_p: the student that sampled, truncated: π̃ in place of π
            in every kind, as :func:`klpenalty.full_kl` truncates the policy (a bool (..., V)
            kept set or an engine's ``(ids, offsets)``, or the sampler's settings with its
            ``temperature``; see :func:`klpenalty.token_stats`). The teacher is never
            truncated.

    Returns:
        (...) float32 (float64 for float64 logits), 0 where masked; +inf where a KL's first
        argument has mass its second lacks (a finite logit against −inf, or with a support a
        teacher's token off it in KL(ν‖π̃)). Differentiable with respect to
        ``student_logits`` (also twice); 0 off the support.

    Raises:
        TypeError / ValueError: invalid arguments (named, with shape and dtype), an unknown
            kind, beta or skew outside (0, 1), an invalid support or sampler setting, and with
            ``check`` NaN logits.
    """
    v.check_logits_pair(student_logits, teacher_logits, ("student_logits", "teacher_logits"))
    k, param = check_kind(kind, beta, skew)
    temperature = v.check_temperature(temperature)
    if mask is not None:
        mask = v.check_mask(mask, student_logits.shape[:-1], student_logits.device)
    impl = get_backend(backend, student_logits.device)
    # (ids, offsets): the forward op finds the sets' thresholds in its pass over the rows
    keep, tau, sampler, ids, offsets = op_support(support, top_k, top_p, min_p, student_logits)
    teacher = teacher_logits.detach()
    if k == Divergence.REVERSE_KL:  # the KL column, in one read of both
        out = dispatch.token_stats(impl, student_logits, teacher, None, mask, keep, tau,
                                   temperature, want=Want.KL, check=check, sampler=sampler,
                                   ids=ids, offsets=offsets)
        return out[..., OUT_KL].contiguous()
    _, stats = dispatch.forward_of_ids(
        impl, student_logits.detach(), teacher, None, mask, keep, tau, ids=ids,
        offsets=offsets, temperature=temperature, want=Want.KL, check=check, sampler=sampler,
    )
    if ids is not None:  # the sets' thresholds the forward found, or their dense mask
        keep, tau = dispatch.support_of_ids(stats, mask, keep, tau, ids, offsets,
                                            student_logits.shape)
    elif sampler_cuts(student_logits.shape[-1], *sampler):  # the threshold the forward computed
        tau = stats[..., ST_TAU]
    value, _ = impl.divergence(student_logits, teacher, stats, mask, keep, tau,
                               temperature=temperature, kind=k, param=param)
    return value
