"""The divergences of the second walk: each kind as one elementwise formula of the two models'
log-probabilities, shared by the streaming backend, the differentiable recompute (double
backward) and the kernels' tests.

With π = softmax(x/T) the student, ν = softmax(y/T) the teacher and M a mixture of the two,
every kind is a sum over the vocabulary of a term f(π_v, ν_v) (numerics.md, "Divergences"):

====================  ==========================================================
kind                   value per row
====================  ==========================================================
``REVERSE_KL``         KL(π‖ν) = Σ π (log π − log ν)
``FORWARD_KL``         KL(ν‖π) = Σ ν (log ν − log π)
``JSD``                β·KL(ν‖M) + (1−β)·KL(π‖M),  M = β·ν + (1−β)·π
``SKEW_FORWARD_KL``    KL(ν‖M),  M = λ·ν + (1−λ)·π
``SKEW_REVERSE_KL``    KL(π‖M),  M = λ·π + (1−λ)·ν
``TVD``                ½·Σ |π − ν|
====================  ==========================================================

β and λ are the op's ``param``, in (0, 1). The gradient with respect to the student's logits
is that of a softmax: ∂/∂x_j = (π_j·g_j − π_j·Σ_k π_k·g_k)/T with g = ∂f/∂π. The walk sums
``pg`` = π·g (written so that it is finite where π or ν is 0) next to f, so the backward needs
one number more per row, ḡ = Σ π·g. The teacher is a constant: no gradient reaches y.

Edge rules, as the KL's (numerics.md): 0·log 0 = 0; KL(π‖ν) is +inf where π has mass on a
token ν gives none (a finite x where y = −inf), KL(ν‖π) where ν has mass π lacks; the mixtures
are finite wherever either model has mass.
"""

from __future__ import annotations

from enum import IntEnum

import torch
from torch import Tensor

__all__ = ["Divergence", "KINDS", "divergence_terms", "needs_param"]

_INF = float("inf")


class Divergence(IntEnum):
    """The ``kind`` of the second walk (the op's int argument)."""

    REVERSE_KL = 0  # KL(student‖teacher)
    FORWARD_KL = 1  # KL(teacher‖student)
    JSD = 2  # β·KL(teacher‖M) + (1−β)·KL(student‖M), M = β·teacher + (1−β)·student
    SKEW_FORWARD_KL = 3  # KL(teacher‖λ·teacher + (1−λ)·student)
    SKEW_REVERSE_KL = 4  # KL(student‖λ·student + (1−λ)·teacher)
    TVD = 5  # ½·Σ|student − teacher|


# the public names of the kinds (``kind=`` of klpenalty.divergence)
KINDS: dict[str, Divergence] = {k.name.lower(): k for k in Divergence}


def needs_param(kind: int) -> bool:
    """Whether the kind reads ``param`` (β for the JSD, λ for the skew KLs)."""
    return kind in (Divergence.JSD, Divergence.SKEW_FORWARD_KL, Divergence.SKEW_REVERSE_KL)


def _times(p: Tensor, d: Tensor, lp: Tensor) -> Tensor:
    """p·d with 0·(anything) = 0 where the log-prob ``lp`` is −inf, and +inf where d is +inf
    and the log-prob is finite (mass against none, even where p underflows to 0)."""
    term = torch.where(torch.isposinf(d), _INF, p * d)
    return torch.where(torch.isneginf(lp), 0.0, term)


def _minus_log_mix(la: Tensor, lb: Tensor, weight: float) -> Tensor:
    """la − log(w·e^la + (1 − w)·e^lb) with δ = lb − la: where δ ≤ 1, −log1p((1 − w)·expm1(δ))
    (exactly 0 where la = lb, so identical models give exactly 0; −log w where lb = −inf < la);
    where δ > 1, −δ − log((1 − w) + w·e^−δ), which does not overflow where e^δ would (a student
    logit 90 nats below the teacher's in float32) and is −inf where la = −inf < lb. Each branch
    reads δ clamped to its side, so the other's overflow reaches neither value nor gradient."""
    d = lb - la
    above = d > 1.0
    near = -torch.log1p((1.0 - weight) * torch.expm1(torch.clamp(d, max=1.0)))
    d_far = torch.clamp(d, min=1.0)
    far = -d_far - torch.log((1.0 - weight) + weight * torch.exp(-d_far))
    return torch.where(above, far, near)


def divergence_terms(lp: Tensor, lq: Tensor, kind: int, param: float) -> tuple[Tensor, Tensor]:
    """(f, pg): the kind's term of each vocabulary entry and π·∂f/∂π, from the student's and the
    teacher's log-probabilities ``lp``, ``lq`` (any shape, the same dtype)."""
    p, q = lp.exp(), lq.exp()
    if kind == Divergence.REVERSE_KL:
        f = _times(p, lp - lq, lp)
        return f, f
    if kind == Divergence.FORWARD_KL:
        return _times(q, lq - lp, lq), -q
    if kind == Divergence.JSD:  # M = β·ν + (1−β)·π
        beta = param
        dp, dq = _minus_log_mix(lp, lq, 1.0 - beta), _minus_log_mix(lq, lp, beta)
        fp = _times(p, dp, lp)
        return beta * _times(q, dq, lq) + (1.0 - beta) * fp, (1.0 - beta) * fp
    if kind == Divergence.SKEW_FORWARD_KL:  # M = λ·ν + (1−λ)·π
        lam = param
        dp, dq = _minus_log_mix(lp, lq, 1.0 - lam), _minus_log_mix(lq, lp, lam)
        pg = -(1.0 - lam) * torch.where(torch.isneginf(lq), 0.0, q * dp.exp())  # −(1−λ)·π·ν/M
        return _times(q, dq, lq), pg
    if kind == Divergence.SKEW_REVERSE_KL:  # M = λ·π + (1−λ)·ν
        lam = param
        dp = _minus_log_mix(lp, lq, lam)
        f = _times(p, dp, lp)
        return f, f - lam * torch.where(torch.isneginf(lp), 0.0, p * dp.exp())  # − λ·π²/M
    if kind == Divergence.TVD:
        diff = p - q
        return 0.5 * diff.abs(), 0.5 * p * torch.sign(diff)
    raise ValueError(f"kind must be one of {list(KINDS)}, got {kind!r}")
