"""The divergences of :func:`klpenalty.divergence` when each rank holds a vocabulary slice.

Shape letters: N rows (the product of the leading dims), V_r this rank's slice of the
vocabulary, H_s / H_t the hidden sizes.

The first walk is the KL's merge (an all-reduce MAX of the maxima, a SUM of the sums: both
models' normalisers, identical on every rank); every kind but the reverse KL then takes a
second walk over each rank's slice and one all-reduce SUM of (value, ḡ) per position (16 bytes
in float32). The backward is local. The teacher is a constant.
"""

from __future__ import annotations

from typing import Any

import torch

from ..linear.kl import run_linear_kl
from ..ops import contract
from ..ops.contract import Want
from .vocab_parallel import _BACKEND_DOC, _SUPPORT_DOC, _slice_adapter, _token_stats

__all__ = ["vocab_parallel_divergence", "vocab_parallel_linear_divergence"]


def vocab_parallel_divergence(
    student_logits_shard: torch.Tensor,
    teacher_logits_shard: torch.Tensor,
    kind: str = "reverse_kl",
    *,
    beta: float = 0.5,
    skew: float = 0.1,
    group: Any = None,
    temperature: float = 1.0,
    mask: torch.Tensor | None = None,
    backend: str = "auto",
    check: bool = True,
    vocab_start: int | None = None,
    support: Any = None,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
) -> torch.Tensor:
    """:func:`klpenalty.divergence` of the logits gathered along the last dim in rank order,
    from each rank's (..., V_r) slices (uneven widths allowed), identical on every rank.

    Args:
        student_logits_shard: (..., V_r) float, this rank's slice of the student's logits.
            Gradients flow (each rank its own slice's).
        teacher_logits_shard: (..., V_r) the same shape: a constant.
        kind, beta, skew, temperature, mask: as in :func:`klpenalty.divergence` (the mask the
            same on every rank).
        group: the process group the vocabulary is split over (None: the default group).
        {backend}
        check: the configuration check of :func:`vocab_parallel_full_kl` (one all-gather),
            and NaN in a counted position raises on every rank.
        vocab_start: where this rank's slice starts (only for ``support=(ids, offsets)``).
        {support}

    Returns:
        (...) float32 (float64 for float64 logits), differentiable once.
    """
    caller = "vocab_parallel_divergence"
    out = _token_stats(
        caller, student_logits_shard, teacher_logits_shard.detach(), None, want=Want.KL,
        group=group, temperature=temperature, mask=mask, vocab_start=vocab_start,
        support=support, top_k=top_k, top_p=top_p, min_p=min_p, ignore_index=-100,
        backend=backend, check=check,
        divergence=(kind, beta, skew),
        names=("student_logits_shard", "teacher_logits_shard"),
    )
    return out[..., contract.OUT_KL].contiguous()


def vocab_parallel_linear_divergence(
    student_hidden: torch.Tensor,
    student_weight_shard: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight_shard: torch.Tensor,
    kind: str = "reverse_kl",
    *,
    vocab_start: int,
    beta: float = 0.5,
    skew: float = 0.1,
    mask: torch.Tensor | None = None,
    temperature: float = 1.0,
    student_bias_shard: torch.Tensor | None = None,
    teacher_bias_shard: torch.Tensor | None = None,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    teacher_logit_scale: float | None = None,
    teacher_softcap: float | None = None,
    group: Any = None,
    chunk_rows: int | None = None,
    backend: str = "auto",
    check: bool = True,
) -> torch.Tensor:
    """:func:`klpenalty.linear_divergence` when each rank holds the rows
    W[vocab_start : vocab_start + V_r] of both LM heads (Megatron's column-parallel layout)
    and the same hidden states: the chunked heads of
    :func:`klpenalty.distributed.vocab_parallel_linear_kl` with the divergence of ``kind``.

    Args:
        student_hidden: (..., H_s), the same on every rank. Gradients flow; its gradient is
            all-reduced (SUM) across the group in the backward (do not all-reduce it again).
        student_weight_shard: (V_r, H_s) this rank's rows of the student's head.
        teacher_hidden, teacher_weight_shard: (..., H_t), (V_r, H_t): constants.
        vocab_start: where this rank's rows start in the vocabulary (checked: the slices must
            tile [0, V) in rank order).
        kind, beta, skew, mask, temperature: as in :func:`klpenalty.divergence`.
        student_bias_shard, teacher_bias_shard: optional (V_r,) this rank's entries of the
            LM-head biases (the teacher's a constant).
        logit_scale, softcap, teacher_logit_scale, teacher_softcap: as in
            :func:`klpenalty.linear_divergence`, the same on every rank.
        chunk_rows: rows per chunk, the same on every rank (None: from the whole V).
        {backend}
        check: NaN in a counted position raises on every rank. The configuration check of
            :func:`~klpenalty.distributed.vocab_parallel_linear_kl` runs whatever ``check``
            (the same ValueError on every rank for arguments that differ across ranks; kind,
            beta and skew included).

    Returns:
        (...) float32 (float64 for float64 inputs), identical on every rank.
    """
    const = [None if t is None else t.detach()
             for t in (teacher_hidden, teacher_weight_shard, teacher_bias_shard)]
    stats = run_linear_kl(
        student_hidden, student_weight_shard, const[0], const[1], tokens=None, mask=mask,
        temperature=temperature, policy_bias=student_bias_shard, ref_bias=const[2],
        logit_scale=logit_scale, softcap=softcap, ref_logit_scale=teacher_logit_scale,
        ref_softcap=teacher_softcap, entropy=False, ignore_index=-100, chunk_rows=chunk_rows,
        backend=backend, check=check,
        parallel=_slice_adapter("vocab_parallel_linear_divergence", group, vocab_start,
                                student_hidden),
        suffix="_shard", roles=("student", "teacher"), divergence=(kind, beta, skew),
    )
    return stats.kl


for _fn in (vocab_parallel_divergence, vocab_parallel_linear_divergence):
    _fn.__doc__ = _fn.__doc__.replace("{backend}", _BACKEND_DOC).replace(
        "{support}", _SUPPORT_DOC.replace("policy", "student")
    )
