"""The divergences of :func:`klpenalty.divergence` from a student's and a teacher's hidden
states and LM heads, without the (N, V) logits: :func:`linear_kl`'s chunked Function with the
divergence adapter (:class:`.chunks.DivergenceChunks`).

Shape letters: N rows (the product of the leading dims), H_s / H_t the hidden sizes (the
teacher's may differ), V the vocabulary (the same for both), R the rows of one chunk.
"""

from __future__ import annotations

from typing import Callable, Optional

from torch import Tensor

from ..ops import contract
from .kl import run_linear_kl

__all__ = ["linear_divergence"]


def linear_divergence(
    student_hidden: Tensor,
    student_weight: Tensor,
    teacher_hidden: Tensor,
    teacher_weight: Tensor,
    kind: str = "reverse_kl",
    *,
    beta: float = 0.5,
    skew: float = 0.1,
    mask: Optional[Tensor] = None,
    temperature: float = 1.0,
    student_bias: Optional[Tensor] = None,
    teacher_bias: Optional[Tensor] = None,
    logit_scale: float = 1.0,
    softcap: Optional[float] = None,
    teacher_logit_scale: Optional[float] = None,
    teacher_softcap: Optional[float] = None,
    chunk_rows: Optional[int] = None,
    backend: str = "auto",
    check: bool = True,
    expected_grads: Optional[Callable[[Tensor, Tensor], Tensor]] = None,
    support=None,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    min_p: Optional[float] = None,
) -> Tensor:
    """:func:`klpenalty.divergence` of the two models' logits z = scale·(h Wᵀ + b) (soft-capped
    as cap·tanh(z/cap) where a cap is given), never materialising them: the counted rows are
    walked in chunks of R rows, each chunk's logits of both heads computed, reduced and
    dropped (twice for every kind but the reverse KL: the second walk needs both normalisers
    first), and recomputed in the backward.

    Args:
        student_hidden: (..., H_s) float, the student's last hidden states. Gradients flow.
        student_weight: (V, H_s), the student's LM head, the same dtype. Gradients flow.
        teacher_hidden: (..., H_t), the teacher's hidden states (H_t may differ from H_s),
            the same leading dims; a constant (detached).
        teacher_weight: (V, H_t), the teacher's LM head, the dtype of ``teacher_hidden``; a
            constant.
        kind, beta, skew: as in :func:`klpenalty.divergence` (the direction is in the kind's
            name: ``"reverse_kl"`` is KL(student‖teacher)).
        mask: optional (...) bool, True = counts: False rows are never multiplied, give 0 and
            zero gradient.
        temperature: > 0, divides both models' transformed logits.
        student_bias, teacher_bias: optional (V,) LM-head biases.
        logit_scale, softcap: the student's logit transforms (``softcap`` None: none);
        teacher_logit_scale, teacher_softcap: the teacher's (None: the student's).
        chunk_rows: rows per chunk (None: :func:`klpenalty.linear.default_chunk_rows`).
        backend: as in :func:`klpenalty.full_kl` (the engine on each chunk).
        check: raise ValueError for NaN in a counted position (naming the tensors that hold
            it); one host read.
        expected_grads: optional ``f(rows, values) -> grads``, the upstream gradients the
            caller's loss will give the values, as a function of them: ``rows`` (R,) int64 flat
            (row-major) indices into the leading dims, ``values`` (R,) their detached
            divergences, ``grads`` (R,) (e.g. ``lambda rows, values: weight[rows]`` for a loss
            Σ weight·value). As :func:`klpenalty.linear_kl`'s: the forward forms the student's
            gradients on the logits it already has (4 LM-head GEMMs in all instead of 6) and
            the backward hands them over when it receives those gradients, else recomputes.
        support, top_k, top_p, min_p: the student that sampled, truncated, as in
            :func:`klpenalty.divergence` (a bool (..., V) kept set or ``(ids, offsets)``, or
            the sampler's settings, applied to each chunk's student logits; the teacher is
            never truncated).

    Returns:
        (...) float32 (float64 if a hidden state or weight is float64), 0 where masked.
        Differentiable once with respect to the student's hidden states, weight and bias
        (gradients in their dtypes).

    Raises:
        TypeError / ValueError: as :func:`klpenalty.linear_kl`'s (naming ``student_*`` and
            ``teacher_*``), an unknown kind, beta or skew outside (0, 1), an invalid support
            or sampler setting.
    """
    if expected_grads is not None and not callable(expected_grads):
        raise TypeError(
            f"expected_grads must be callable or None, got {type(expected_grads).__name__}"
        )
    const = [None if t is None else t.detach() for t in (teacher_hidden, teacher_weight, teacher_bias)]
    stats = run_linear_kl(
        student_hidden, student_weight, const[0], const[1], tokens=None, mask=mask,
        temperature=temperature, policy_bias=student_bias, ref_bias=const[2],
        logit_scale=logit_scale, softcap=softcap, ref_logit_scale=teacher_logit_scale,
        ref_softcap=teacher_softcap, entropy=False, ignore_index=-100, chunk_rows=chunk_rows,
        backend=backend, check=check, support=support, top_k=top_k, top_p=top_p, min_p=min_p,
        roles=("student", "teacher"), divergence=(kind, beta, skew),
        expected_grads=None if expected_grads is None else _column_plan(expected_grads),
    )
    return stats.kl


def _column_plan(expected_grads: Callable[[Tensor, Tensor], Tensor]):
    """The plan of :func:`run_linear_kl` (the (R, OUT_COLS) upstream gradients of its columns)
    from a plan of the divergence's values alone (the KL column holds them)."""

    def plan(rows: Tensor, out: Tensor) -> Tensor:
        got = expected_grads(rows, out[:, contract.OUT_KL])
        if not isinstance(got, Tensor) or got.shape != rows.shape:
            what = f"shape {tuple(got.shape)}, dtype {got.dtype}" if isinstance(got, Tensor) \
                else type(got).__name__
            raise ValueError(
                f"expected_grads(rows, values) must return a tensor of shape "
                f"{tuple(rows.shape)} (one gradient per row asked about), got {what}"
            )
        grads = out.new_zeros(out.shape)
        grads[:, contract.OUT_KL] = got.to(out.dtype)
        return grads

    return plan
