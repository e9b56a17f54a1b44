"""The divergences of :func:`klpenalty.divergence` between a student and a frozen teacher,
both Hugging Face causal LMs, from their last hidden states and heads (no (B, T, V) logits).

Shape letters: B batch, T sequence.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..distillation import check_kind
from ..functional import TokenStats
from ..linear import linear_divergence
from .kl import _batch, _check_pair, _policy_head, _reference_head, _RefHead
from .models import _model_parts

__all__ = ["causal_lm_divergence"]


def causal_lm_divergence(
    student_model: torch.nn.Module,
    teacher_model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: Optional[torch.Tensor] = None,
    kind: str = "reverse_kl",
    *,
    beta: float = 0.5,
    skew: float = 0.1,
    labels: Optional[torch.Tensor] = None,
    response_mask: Optional[torch.Tensor] = None,
    position_ids: Optional[torch.Tensor] = None,
    temperature: float = 1.0,
    support=None,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    min_p: Optional[float] = None,
    chunk_rows: Optional[int] = None,
    backend: str = "auto",
    check: bool = True,
    expected_grads=None,
) -> torch.Tensor:
    """Per-token divergence of ``kind`` (as :func:`klpenalty.divergence`: ``"reverse_kl"`` is
    KL(student‖teacher)) between two causal LMs on one batch, without either model's logits.

    The student is held as :func:`klpenalty.hf.causal_lm_kl` holds the policy (plain, DDP,
    FSDP1, FSDP2, a DeepSpeed engine, a ``PeftModel``; packed rows): it runs through its own
    wrapper's forward with its LM head replaced for the call by
    :func:`klpenalty.linear_divergence` on what the head receives and the teacher's captured
    head. The teacher runs first, without gradients (a constant), and may have another hidden
    size and architecture (the same vocabulary). Alignment and the counted positions
    (``attention_mask``, ``labels`` = -100, ``response_mask``, packed ``position_ids``) as in
    :func:`~klpenalty.hf.causal_lm_kl`. ``expected_grads``: the plan of the upstream gradients
    of the values, as in :func:`klpenalty.linear_divergence`; its ``rows`` index the (B, T - 1)
    values row-major (``b·(T - 1) + t``). ``support``, ``top_k``, ``top_p``, ``min_p``: the
    student that sampled, truncated, as in :func:`~klpenalty.hf.causal_lm_kl` (a bool
    (B, T - 1, V) kept set or ``(ids, offsets)`` over the B·(T - 1) positions, or the sampler's
    settings with its ``temperature``): every kind compares π̃ with the teacher, which is never
    truncated (:func:`klpenalty.divergence`).

    Returns:
        (B, T - 1) float32 (float64 for float64 models), 0 where not counted; differentiable
        with respect to the student's parameters.

    Raises:
        TypeError / ValueError: as :func:`~klpenalty.hf.causal_lm_kl` (the student in place of
            the policy, the teacher of the reference), an unknown kind, beta or skew outside
            (0, 1), an invalid support or sampler setting.
    """
    check_kind(kind, beta, skew)  # before any model runs
    student = _model_parts("student_model", student_model)
    if teacher_model is None:
        raise TypeError("teacher_model must be a causal LM, got None")
    names = ("student_model", "teacher_model")
    teacher, _ = _check_pair(student, teacher_model, input_ids, names)
    batch = _batch(input_ids, attention_mask, labels, response_mask, position_ids, temperature,
                   False, backend, student.vocab, support, top_k, top_p, min_p, check)
    refh = _reference_head(teacher, "teacher_model", batch.kwargs, tuple(input_ids.shape), False)
    refh = _RefHead(*(None if t is None else t.detach() for t in refh))

    def head(hidden, weight, t_hidden, t_weight, *, mask, temperature, policy_bias, ref_bias,
             logit_scale, softcap, ref_logit_scale, ref_softcap, chunk_rows, backend, check,
             support, top_k, top_p, min_p, **_tokens):
        value = linear_divergence(
            hidden, weight, t_hidden, t_weight, kind, beta=beta, skew=skew, mask=mask,
            temperature=temperature, student_bias=policy_bias, teacher_bias=ref_bias,
            logit_scale=logit_scale, softcap=softcap, teacher_logit_scale=ref_logit_scale,
            teacher_softcap=ref_softcap, chunk_rows=chunk_rows, backend=backend, check=check,
            support=support, top_k=top_k, top_p=top_p, min_p=min_p,
            expected_grads=expected_grads,
        )
        return TokenStats(value, None, None, None)

    stats = _policy_head(student, teacher, refh, batch, head=head, names=names,
                         chunk_rows=chunk_rows, backend=backend, check=check, support=support,
                         top_k=top_k, top_p=top_p, min_p=min_p)
    return stats.kl
