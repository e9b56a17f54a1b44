"""Distillation losses against a teacher known only by its top-K log-probs.

Shape letters: V vocabulary, K teacher entries per position; every function accepts any
leading dims: student logits (..., V), teacher ids and log-probs (..., K), per-token results
(...).

A server teacher (vLLM or SGLang with ``prompt_logprobs=K``) returns, per position, its own K
most likely token ids and their log-probs under its *full* softmax at the sampling temperature
T, so they sum to S_ν = Σ_K ν ≤ 1 and nothing is known of the other V − K tokens. With
π = softmax(x/T) the student over the whole vocabulary, ν the teacher's full distribution,
ν̃ = ν/S_ν and π̃ = π/S_π the two renormalised on the K ids (S_π = Σ_K π), and
ν_tail = 1 − S_ν, π_tail = 1 − S_π the mass outside them:

============================== ========================================= ==================
kind                           formula                                   full softmax of π
============================== ========================================= ==================
renormalized_forward_kl        KL(ν̃‖π̃) = Σ_K ν̃ log(ν̃/π̃)                  no
renormalized_cross_entropy     −Σ_K ν̃ log π                               yes (its lse)
tail_forward_kl                Σ_K ν log(ν/π) + ν_tail log(ν_tail/π_tail)  yes (its lse)
generalized_kl                 Σ_K [π log(π/ν) − π + ν]                   yes (its lse)
unnormalized_forward_kl        Σ_K ν log(ν/π)  (not a divergence)         yes (its lse)
============================== ========================================= ==================

Against the full-teacher forward KL(ν‖π) (all checked in ``tests/test_topk.py``):

- with K = V, every forward kind is KL(ν‖π), ``renormalized_cross_entropy`` is the cross
  entropy H(ν) + KL(ν‖π) and ``generalized_kl`` is the reverse KL(π‖ν);
- KL(ν‖π) = tail_forward_kl + ν_tail·KL(ν_out‖π_out), with ν_out, π_out the two renormalised
  outside the K ids: so tail_forward_kl ≤ KL(ν‖π), equal when the tails' conditionals match;
- tail_forward_kl = KL(Bernoulli(S_ν)‖Bernoulli(S_π)) + S_ν·renormalized_forward_kl;
- renormalized_cross_entropy = renormalized_forward_kl + H(ν̃) − log S_π;
- unnormalized_forward_kl = S_ν·(renormalized_forward_kl + log S_ν − log S_π), negative where
  the student holds more of its mass on the K ids than the teacher (S_π > S_ν, ν̃ = π̃);
- generalized_kl = S_π·KL(π̃‖ν̃) + [S_π log(S_π/S_ν) − S_π + S_ν] ≤ KL(π‖ν), short by the
  same terms over the V − K ids the teacher did not return;
- −log S_ν = KL(ν̃‖ν): what renormalising the teacher on its top K costs (:func:`topk_mass`).

The last four kinds need log π over the whole vocabulary at the K ids: it comes from the
library's streamed op :func:`klpenalty.token_logprobs` at one of the ids t,
log π_k = (x_k − x_t)/T + log π(t), never from a (..., V) log-softmax in memory; everything
else is O(K) per position. The gradient into low-precision logits is rounded once, as a float32
formula's would be.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from . import _validation as v
from .functional import token_logprobs

__all__ = ["KINDS", "topk_divergence", "topk_mass", "TopKMass"]

KINDS = (
    "renormalized_forward_kl",
    "renormalized_cross_entropy",
    "tail_forward_kl",
    "generalized_kl",
    "unnormalized_forward_kl",
)

_LN2 = math.log(2.0)


class TopKMass(NamedTuple):
    """Per-position masses of the teacher's top K ids, each (...), 0 where masked out."""

    teacher_mass: Tensor
    """S_ν = Σ_K ν, the teacher's mass on its K ids (as given, not clamped at 1)."""
    student_mass: Tensor
    """S_π = Σ_K π, the student's mass on the teacher's K ids; differentiable."""
    neg_log_teacher_mass: Tensor
    """−log S_ν = KL(ν̃‖ν), from the renormalised top-K teacher to the full teacher."""
    neg_log_student_mass: Tensor
    """−log S_π = KL(π̃‖π), from the student renormalised on the K ids to the student."""


class _Entries(NamedTuple):
    """The teacher's entries of a batch, gathered and made safe to compute with."""

    a: Tensor  # (..., K) x[ids]/T in the compute dtype; −inf at entries not in use
    lp: Tensor | None  # (..., K) log π at the ids, π over the vocabulary; −inf likewise
    lt: Tensor  # (..., K) teacher log-probs, detached; −inf at entries not in use
    use: Tensor  # (..., K) bool: present entries, or the placeholder entry 0 of a dead row
    live: Tensor  # (...) bool: counted and with at least one present entry
    flags: list  # the value checks, (name, tensor, bad, what), read once at the end


def topk_divergence(
    student_logits: Tensor,
    teacher_ids: Tensor,
    teacher_logprobs: Tensor,
    kind: str = "renormalized_forward_kl",
    *,
    mask: Tensor | None = None,
    temperature: float = 1.0,
    check: bool = True,
) -> Tensor:
    """Per-position divergence between the student and a teacher given by its top-K log-probs.

    π = softmax(student_logits / T) over the whole vocabulary; ν is the teacher, known on its
    K ids only; ν̃ = ν/S_ν and π̃ = π/S_π are the two renormalised on those ids
    (S = Σ_K), ν_tail = 1 − S_ν and π_tail = 1 − S_π the mass outside them. ``kind``:

    - ``"renormalized_forward_kl"`` (Tinker, NeMo-RL): KL(ν̃‖π̃) = Σ_K ν̃ (log ν̃ − log π̃),
      teacher ‖ student, both renormalised on the K ids. log π̃ = log_softmax over the K ids
      of x[ids]/T: it reads only the gathered logits, never the rest of the vocabulary.
    - ``"renormalized_cross_entropy"`` (Tinker's SDFT): −Σ_K ν̃ log π, the teacher
      renormalised, the student over the full vocabulary. = KL(ν̃‖π̃) + H(ν̃) − log S_π.
    - ``"tail_forward_kl"`` (TRL's server mode with ``loss_add_tail``): KL(teacher‖student)
      over K + 1 outcomes, the K ids and one bucket for the rest:
      Σ_K ν log(ν/π) + ν_tail log(ν_tail/π_tail), 0·log 0 = 0. A lower bound of the full
      KL(ν‖π), short by ν_tail·KL(ν_out‖π_out) (the renormalised tails).
    - ``"generalized_kl"`` (MOPD, arXiv 2606.30406 Eq. 5): Σ_K [π log(π/ν) − π + ν],
      student ‖ teacher on the raw probabilities, each term ≥ 0; the reverse KL(π‖ν) when
      K = V.
    - ``"unnormalized_forward_kl"`` (verl's ``forward_kl_topk``): Σ_K ν (log ν − log π),
      teacher ‖ student, ν not renormalised. Not a divergence: it is negative where the
      student puts more mass than the teacher on the K ids (it equals
      S_ν·(KL(ν̃‖π̃) + log S_ν − log S_π)); offered to show what that code computes.

    The identities and biases are in the module docstring and ``docs/topk.md``.

    Teacher entries whose log-prob is −inf are *absent* (a teacher that returned fewer than K
    entries pads with −inf): their ids are not read (they may hold anything, e.g. −1), and the
    K ids above are the present ones (π̃, S_π, the tail and every sum use those only).

    Args:
        student_logits: (..., V) float16/bfloat16/float32/float64, the student. Gradients flow.
        teacher_ids: (..., K) integer ids in [0, V), distinct within a position (among the
            present entries).
        teacher_logprobs: (..., K) float, the teacher's log-probs of those ids under its full
            softmax, *already at the temperature* (as a server returns them): ``temperature``
            divides the student's logits only. −inf marks an absent entry. Treated as a
            constant: detached, it gets no gradient.
        kind: one of :data:`KINDS` (above).
        mask: optional (...) bool, True = this position counts. Masked positions return 0 and
            get zero gradient; their logits, ids and log-probs may hold anything.
        temperature: > 0; divides the student's logits before the softmax.
        check: raise ValueError, after one host read per call, for a counted position with
            ids out of range or repeated, teacher log-probs that are NaN, > 1e-4, summing (as
            probabilities) above 1 + 1e-4 or all −inf, and a NaN result (NaN or +inf in the
            student's logits). ``check=False`` skips it: out-of-range ids are then read as
            id 0, and a position with no present entry gives 0.

    Returns:
        (...) float32 (float64 if either floating input is float64), differentiable with
        respect to ``student_logits``, gradient in their dtype (once; twice for
        ``"renormalized_forward_kl"``, plain PyTorch on the gathered logits). ≥ 0 for every
        kind but ``"unnormalized_forward_kl"``; +inf where the student gives probability 0
        to an id the teacher gives mass. The tail's 1 − S_π is resolved to the compute
        dtype's epsilon (π_tail is floored there, about 1.2e-7 in float32: a student surer of
        the K ids than that gets no push from the tail term).

    Raises:
        TypeError: non-tensor inputs, non-floating logits or log-probs, non-integer ids,
            a non-bool mask.
        ValueError: shapes that do not match (named, with shape and dtype), an unknown kind,
            temperature ≤ 0, and with ``check`` the value errors above.

    >>> import torch
    >>> from klpenalty import topk_divergence
    >>> x = torch.tensor([[2.0, 1.0, 0.0, -1.0]])          # the student's logits (1, V)
    >>> ids = torch.tensor([[0, 2]])                         # the teacher's top 2 ids
    >>> logp = torch.tensor([[0.5, 0.25]]).log()             # and its log-probs (S_ν = 0.75)
    >>> round(topk_divergence(x, ids, logp).item(), 4)       # KL(ν̃‖π̃) on {0, 2}
    0.1571
    >>> round(topk_divergence(x, ids, logp, "tail_forward_kl").item(), 4)
    0.1187
    """
    v.check_choice("kind", kind, KINDS)
    e = _entries(student_logits, teacher_ids, teacher_logprobs, mask, temperature, check,
                 full=kind != "renormalized_forward_kl")
    if kind == "renormalized_forward_kl":
        lq = torch.log_softmax(e.a, -1)  # log π̃: no softmax over the vocabulary
        lnu = torch.log_softmax(e.lt, -1)  # log ν̃
        out = _sum(e.use, lnu.exp() * (lnu - lq)).clamp_min(0)
    else:
        lp = e.lp  # log π at the ids, π over the vocabulary
        if kind == "renormalized_cross_entropy":
            out = -_sum(e.use, torch.softmax(e.lt, -1) * lp).clamp_max(0)
        elif kind == "tail_forward_kl":
            out = (_sum(e.use, e.lt.exp() * (e.lt - lp)) + _tail_term(e, lp)).clamp_min(0)
        elif kind == "generalized_kl":
            pi = lp.exp()
            d = torch.where(pi > 0, lp - e.lt, 0.0)  # 0·log 0 = 0
            out = _sum(e.use, (pi * d - pi + e.lt.exp()).clamp_min(0))
        else:  # unnormalized_forward_kl
            out = _sum(e.use, e.lt.exp() * (e.lt - lp))
    out = torch.where(e.live, out, 0.0)
    if check:
        _raise_if_bad(e.flags + [_nan_result(student_logits, out, e.live)])
    return out


def topk_mass(
    student_logits: Tensor,
    teacher_ids: Tensor,
    teacher_logprobs: Tensor,
    *,
    mask: Tensor | None = None,
    temperature: float = 1.0,
    check: bool = True,
) -> TopKMass:
    """How much of each model's mass the teacher's top K ids hold, per position.

    ``neg_log_teacher_mass`` = −log S_ν is exactly KL(ν̃‖ν), the divergence from the
    renormalised top-K teacher (what the renormalised kinds of :func:`topk_divergence` treat
    as the teacher) to the full teacher: a per-position measure of what K loses.

    Args:
        student_logits, teacher_ids, teacher_logprobs, mask, temperature, check: as in
            :func:`topk_divergence` (absent entries, −inf, count for nothing).

    Returns:
        :class:`TopKMass` (teacher_mass, student_mass, neg_log_teacher_mass,
        neg_log_student_mass), each (...) float32 (float64 if either floating input is
        float64), 0 where masked out (or, with ``check=False``, where no entry is present).
        The student's fields are differentiable with respect to ``student_logits``.

    Raises:
        TypeError, ValueError: as :func:`topk_divergence`.
    """
    e = _entries(student_logits, teacher_ids, teacher_logprobs, mask, temperature, check,
                 full=True)
    log_s_nu = torch.logsumexp(e.lt, -1)
    log_s_pi = torch.logsumexp(e.lp, -1)
    fields = [log_s_nu.exp(), log_s_pi.exp(), -log_s_nu, -log_s_pi]
    out = TopKMass(*(torch.where(e.live, f, 0.0) for f in fields))
    if check:
        _raise_if_bad(e.flags + [_nan_result(student_logits, out.student_mass, e.live)])
    return out


def _sum(use: Tensor, terms: Tensor) -> Tensor:
    """Σ over the K entries in use (the others may be NaN: 0·(−inf) of absent entries)."""
    return torch.where(use, terms, 0.0).sum(-1)


def _log1mexp(s: Tensor) -> Tensor:
    """log(1 − e^s) for s ≤ 0, accurate near 0 and far below it (expm1 or log1p branch)."""
    return torch.where(s > -_LN2, torch.log(-torch.expm1(s)), torch.log1p(-torch.exp(s)))


def _tail_term(e: _Entries, lp: Tensor) -> Tensor:
    """ν_tail log(ν_tail/π_tail), 0 where ν_tail = 0; π_tail floored at the dtype's epsilon."""
    log_nu_tail = _log1mexp(torch.logsumexp(e.lt, -1).clamp_max(0))
    eps = torch.finfo(lp.dtype).eps
    log_pi_tail = _log1mexp(torch.logsumexp(lp, -1).clamp_max(math.log1p(-eps)))
    nu_tail = log_nu_tail.exp()
    return torch.where(nu_tail > 0, nu_tail * (log_nu_tail - log_pi_tail), 0.0)


def _entries(student_logits, teacher_ids, teacher_logprobs, mask, temperature, check, *,
             full) -> _Entries:
    """Validate the arguments' types and shapes, gather the student's logits at the teacher's
    ids (and log π there, π over V, if ``full``) and list the value checks (not yet read:
    :func:`_raise_if_bad` reads them once)."""
    x = v.check_logits("student_logits", student_logits)
    ids = _check_ids(teacher_ids, x)
    given = v.check_float("teacher_logprobs", teacher_logprobs)
    if given.shape != ids.shape or given.device != ids.device:
        raise ValueError(
            "teacher_logprobs must have the shape (..., K) and device of teacher_ids: "
            f"teacher_logprobs {_describe_at(given)}, teacher_ids {_describe_at(ids)}"
        )
    temperature = v.check_temperature(temperature)
    leading, vocab, k = x.shape[:-1], x.shape[-1], ids.shape[-1]
    counted = torch.ones(leading, dtype=torch.bool, device=x.device)
    if mask is not None:
        counted = v.check_mask(mask, leading, x.device)

    c = v.compute_dtype(x, given)
    lt = given.detach().to(c)
    present = ~torch.isneginf(lt) & counted.unsqueeze(-1)
    live = present.any(-1)
    in_range = (ids >= 0) & (ids < vocab)
    safe_ids = torch.where(present & in_range, ids, 0).long()
    # the first entry of each distinct present id (absent entries get distinct negative keys)
    key, order = torch.where(present, ids.long(), -1 - torch.arange(k, device=x.device)).sort(-1)
    first = torch.ones_like(present)
    first[..., 1:] = key[..., 1:] != key[..., :-1]
    first = torch.empty_like(first).scatter_(-1, order, first) & present

    flags = []
    if check:
        log_sum = torch.logsumexp(torch.where(present, lt, -math.inf), -1)
        slack = v.LOGPROB_SLACK
        flags = [
            ("teacher_ids", ids, present & ~in_range, f"ids outside [0, {vocab})"),
            ("teacher_ids", ids, (present & ~first).any(-1), "an id repeated within a position"),
            ("teacher_logprobs", given, torch.isnan(lt) & counted.unsqueeze(-1), "NaN"),
            ("teacher_logprobs", given, (lt > slack) & counted.unsqueeze(-1),
             f"values > {slack} (log-probs are <= 0: logits?)"),
            ("teacher_logprobs", given, log_sum > slack,
             f"probabilities summing above 1 + {slack} (not one distribution's log-probs?)"),
            ("teacher_logprobs", given, counted & ~live,
             "no present entry (all -inf) at a counted position: mask it out"),
        ]

    placeholder = ~live.unsqueeze(-1) & (torch.arange(k, device=x.device) == 0)
    fill = torch.where(placeholder, 0.0, -math.inf).to(c)
    a = torch.where(present, x.gather(-1, safe_ids).to(c) / temperature, fill)
    lp = None
    if full:
        # t: the id with the student's largest logit among the present ones, so that log π(t)
        # is finite where any is (all −inf there: every log π is −inf)
        ref = a.detach().masked_fill(~present, -math.inf).argmax(-1, keepdim=True)
        ref_id = safe_ids.gather(-1, ref)
        ok = live & ~torch.isneginf(a.detach().gather(-1, ref).squeeze(-1))
        tokens = torch.where(ok, ref_id.squeeze(-1), -100)
        targets = torch.where(present, safe_ids, ref_id)  # absent entries: t, no gradient
        lp = torch.where(present, _LogProbs.apply(x, targets, tokens, ref, first, temperature, c),
                         fill)
    return _Entries(a=a, lp=lp, lt=torch.where(present, lt, fill), use=present | placeholder,
                    live=live, flags=flags)


class _LogProbs(torch.autograd.Function):
    """log π(ids) in the compute dtype, π = softmax(x/T) over V; differentiable once.

    From the streamed op :func:`klpenalty.token_logprobs` at one id per position, ``tokens``
    (``ignore_index`` -100 where no log-prob is needed), ``ref`` the index of that id t among
    the ids: log π_k = (x_k − x_t)/T + log π(t), each term of the size of a log-prob (no
    log-sum-exp of the size of the logits is formed). −inf at positions without ``tokens``.

    The gradient is rounded into x's dtype once, as a float32 formula's would be: the op's
    backward gives −G·π/T over the vocabulary (G = Σ_k g_k), and at the ids that is replaced
    by the sum of both parts, (g_k − G·π_k)/T, formed in the compute dtype (the π part once per
    distinct id: ``first``).
    """

    @staticmethod
    def forward(ctx, x, ids, tokens, ref, first, temperature, dtype):
        ctx.inner = None
        if ctx.needs_input_grad[0]:  # keep the op's graph for the backward
            with torch.enable_grad():
                inner_x = x.detach().requires_grad_()
                lp_ref = token_logprobs(inner_x, tokens, temperature=temperature, check=False)
            ctx.inner = (inner_x, lp_ref)
        else:
            lp_ref = token_logprobs(x, tokens, temperature=temperature, check=False)
        a = x.gather(-1, ids).to(dtype) / temperature
        shift = a - a.gather(-1, ref)
        lp = torch.where((tokens >= 0).unsqueeze(-1), shift + lp_ref.to(dtype).unsqueeze(-1),
                         -math.inf)
        ctx.save_for_backward(ids, lp, first)
        ctx.temperature = temperature
        return lp

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_lp):
        ids, lp, first = ctx.saved_tensors
        inner_x, lp_ref = ctx.inner
        total = grad_lp.sum(-1)
        (grad,) = torch.autograd.grad(lp_ref, inner_x, total.to(lp_ref.dtype),
                                      retain_graph=True)  # G·(onehot(t) − π)/T
        pi_part = total.unsqueeze(-1) * lp.exp()
        at_ids = (grad_lp - torch.where(first, pi_part, 0.0)) / ctx.temperature
        grad.scatter_(-1, ids, 0).scatter_add_(-1, ids, at_ids.to(grad.dtype))
        return grad, None, None, None, None, None, None


def _describe_at(t: Tensor) -> str:
    """:func:`klpenalty._validation.describe` with the device."""
    return f"{v.describe(t)}, device={t.device}"


def _check_ids(teacher_ids: object, x: Tensor) -> Tensor:
    """Integer (..., K) ids, K ≥ 1, with the logits' leading dims and device."""
    if not isinstance(teacher_ids, Tensor):
        raise TypeError(f"teacher_ids must be a torch.Tensor, got {type(teacher_ids).__name__}")
    ids = teacher_ids
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise TypeError(f"teacher_ids must be an integer tensor (..., K), got {v.describe(ids)}")
    if ids.dim() != x.dim() or ids.shape[:-1] != x.shape[:-1] or ids.shape[-1] < 1:
        raise ValueError(
            f"teacher_ids must have shape {(*x.shape[:-1], 'K')} with K >= 1 (the leading "
            f"dims of student_logits {v.describe(x)}), got {v.describe(ids)}"
        )
    if ids.device != x.device:
        raise ValueError(f"teacher_ids must be on {x.device} (student_logits'), got {ids.device}")
    return ids


def _nan_result(x: Tensor, out: Tensor, live: Tensor) -> tuple:
    """The flag of a NaN result at a counted position (the teacher's checks come first)."""
    return ("student_logits", x, torch.isnan(out) & live,
            "NaN or +inf in the logits the result reads, or -inf at all the teacher's ids "
            "(the result is NaN)")


def _raise_if_bad(flags: list) -> None:
    """Raise ValueError for the first flag set, naming the argument, where and how often;
    one host read for all of them."""
    if not flags:
        return
    found = torch.stack([bad.any() for _, _, bad, _ in flags]).tolist()
    for (name, t, bad, what), hit in zip(flags, found):
        if hit:
            flat = bad.reshape(-1).nonzero()[0, 0]
            first = tuple(int(i) for i in torch.unravel_index(flat, bad.shape)) if bad.dim() else ()
            raise ValueError(
                f"{name} ({v.describe(t)}) hold {what} at {int(bad.sum())} "
                f"{'entries' if bad.dim() == t.dim() else 'position(s)'}, the first at index "
                f"{first}"
            )
