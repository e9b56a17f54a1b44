"""linear_policy_loss: a PPO/GRPO policy loss with the exact KL penalty from the hidden states,
its gradient formed in the forward (the fused LM head).

Shape letters: N rows (the product of the leading dims), M the counted rows, R rows of one
chunk, V the vocabulary, H_p / H_r the hidden sizes.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from .. import _validation as v
from ..ops.contract import OUT_KL, OUT_LOGP, OUT_REF_LOGP, Want
from ._heads import (
    _accumulator,
    _chain,
    _check_heads,
    _check_nan,
    _flat_rows,
    _head_grads,
    _logits,
    _plan_rows,
    gemm_dtype,
)
from .chunks import LocalChunks, host_checks

__all__ = ["linear_policy_loss", "PolicyLoss", "REDUCTIONS"]

REDUCTIONS = ("token-mean", "sequence-mean", "sum")


class PolicyLoss(NamedTuple):
    """What :func:`linear_policy_loss` returns. Only ``loss`` is differentiable; the rest are
    detached metrics. Per-token fields are (...) (the leading dims of the hidden states), 0 (or
    False) at positions that do not count."""

    loss: Tensor
    """() the loss, pg_loss + beta·kl_loss: call ``loss.backward()``."""
    pg_loss: Tensor
    """() the reduced clipped surrogate (0 without advantages)."""
    kl_loss: Tensor
    """() the reduced (weighted) exact KL, before beta."""
    kl: Tensor
    """(...) KL(π‖ρ) per position."""
    logprobs: Tensor
    """(...) log π(token)."""
    ref_logprobs: Tensor
    """(...) log ρ(token)."""
    ratio: Tensor
    """(...) π/π_old = exp(logprobs − old_logprobs) (1 without old_logprobs)."""
    clipped: Tensor
    """(...) bool, the clip bound is active (the token's surrogate gradient is 0)."""
    clip_fraction: Tensor
    """() the fraction of the counted tokens that are clipped."""


def _clipped_surrogate(lp: Tensor, old: Optional[Tensor], adv: Optional[Tensor],
                       eps_low: float, eps_high: float):
    """Per token (R,): (loss, ∂loss/∂lp, ratio, clipped) of the PPO clipped surrogate
    loss = max(−A·r, −A·clip(r, 1 − ε_low, 1 + ε_high)), r = exp(lp − old) (old None: r = 1,
    on-policy). Its lp-derivative is −A·r except where the clip bound is active (A > 0 and
    r > 1 + ε_high, or A < 0 and r < 1 − ε_low), where it is 0 (autograd's rule: ties split
    evenly between two equal branches, whose derivatives agree). No advantages: all zero."""
    ratio = torch.ones_like(lp) if old is None else torch.exp(lp - old)
    if adv is None:
        zero = torch.zeros_like(lp)
        return zero, zero, ratio, torch.zeros_like(lp, dtype=torch.bool)
    clipped = ((adv > 0) & (ratio > 1.0 + eps_high)) | ((adv < 0) & (ratio < 1.0 - eps_low))
    unclipped = -adv * ratio
    loss = torch.maximum(unclipped, -adv * ratio.clamp(1.0 - eps_low, 1.0 + eps_high))
    return loss, unclipped.masked_fill(clipped, 0.0), ratio, clipped


class _PolicyLoss(torch.autograd.Function):
    """The fused loss: chunked LM heads → engine → the loss's ∂/∂z in the same pass.

    Inputs are validated; hidden states are (N, H) rows, ``rows`` (M,) the counted rows (None =
    all N), ``tokens`` (N,) int64. Per token (N,), 0 where not counted: ``coef`` the reduction's
    weight c, ``kl_coef`` c·w (the KL's weight), ``adv`` and ``old`` (or None). The upstream
    gradient of the scalar loss is known in the forward up to one factor: each chunk's ∂loss/∂z
    (the KL column c·w·beta, the log-prob column c·∂surrogate/∂lp) goes straight through the
    backend's backward op and the chain rule into grad_h rows, grad_W and grad_b, which are
    held until the backward scales them by the upstream gradient. The reference is frozen.
    """

    @staticmethod
    def forward(ctx, hp, wp, bp, hr, wr, br, tokens, rows, coef, kl_coef, adv, old, opts):
        (temperature, scale_p, cap_p, scale_r, cap_r, beta, eps_low, eps_high, chunk, adapter,
         need) = opts
        want = Want.KL | Want.LOGP | Want.REF_LOGP
        n = hp.shape[0]
        dtype = v.compute_dtype(hp, wp, hr, wr)
        kl, lp, rlp, ratio, pg = (hp.new_zeros(n, dtype=dtype) for _ in range(5))
        clipped = torch.zeros(n, dtype=torch.bool, device=hp.device)
        grad_hp = torch.zeros_like(hp) if need[0] else None
        grad_wp = _accumulator(wp) if need[1] else None
        grad_bp = _accumulator(bp) if need[2] else None
        m = n if rows is None else rows.shape[0]
        for r0 in range(0, m, chunk):
            r1 = min(m, r0 + chunk)
            sel = slice(r0, r1) if rows is None else rows[r0:r1]
            hpc, tok = hp[sel], tokens[sel]
            zp = _logits(hpc, wp, bp, scale_p, cap_p)  # (R, V)
            zr = _logits(hr[sel], wr, br, scale_r, cap_r)  # (R, V)
            out, st = adapter.forward(zp, zr, tok, temperature, want)
            parts = _clipped_surrogate(
                out[:, OUT_LOGP], None if old is None else old[sel],
                None if adv is None else adv[sel], eps_low, eps_high,
            )
            for dst, src in zip((kl, lp, rlp, pg, ratio, clipped),
                                (out[:, OUT_KL], out[:, OUT_LOGP], out[:, OUT_REF_LOGP],
                                 *parts[::2], parts[3])):
                dst[sel] = src
            if any(need):
                grad_out = out.new_zeros(out.shape)  # (R, OUT_COLS): ∂loss/∂out
                grad_out[:, OUT_KL] = kl_coef[sel] * beta
                grad_out[:, OUT_LOGP] = coef[sel] * parts[1]
                # ∂KL/∂zp reads log ρ; without the KL in the loss the reference's logits go now
                zr = zr if beta != 0 else None
                dzp, _ = adapter.backward(grad_out, zp, zr, tok, st, temperature, True, False)
                zr = None
                zp = zp if cap_p is not None else None  # read again only by the soft-cap
                dzp = _chain(dzp, zp, scale_p, cap_p, gemm_dtype(wp))  # (R, V), ∂/∂(h Wᵀ + b)
                zp = None
                _head_grads(dzp, hpc, wp, sel, grad_hp, grad_wp, grad_bp)
                dzp = None
            del zp, zr, out, st, parts  # free this chunk's buffers before the next
        acc = torch.float64
        pg_loss = (coef.to(acc) * pg.to(acc)).sum()
        kl_loss = (kl_coef.to(acc) * kl.to(acc)).sum()
        loss = (pg_loss + beta * kl_loss).to(dtype)
        ctx.grads = (grad_hp, grad_wp, grad_bp)
        ctx.dtypes = (hp.dtype, wp.dtype, None if bp is None else bp.dtype)
        metrics = (pg_loss.to(dtype), kl_loss.to(dtype), kl, lp, rlp, ratio, clipped)
        ctx.mark_non_differentiable(*metrics)
        return (loss, *metrics)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss, *_):
        none = (None,) * 10
        if ctx.grads is None:
            raise RuntimeError(
                "linear_policy_loss: the loss can be backpropagated once (its gradient is "
                "formed in the forward and handed over in the first backward); compute the "
                "loss again for a second backward"
            )
        grads, ctx.grads = ctx.grads, None
        out = []
        for g, dtype in zip(grads, ctx.dtypes):
            if g is not None and grad_loss is not None:
                # scale in place (the buffer is handed over); 1 needs nothing (read on CPU only)
                if not (host_checks(g.device) and float(grad_loss) == 1.0):
                    g.mul_(grad_loss.to(g.dtype))
                g = g.to(dtype)
            out.append(None if grad_loss is None else g)
        return (*out, *none)


def _check_clip(name: str, value: object) -> float:
    x = v.as_real(name, value)
    if not math.isfinite(x) or x < 0:
        raise ValueError(f"{name} must be finite and >= 0, got {x}")
    return x


def _policy_loss_args(checked, policy_hidden, per_token: dict, beta, epsilon_low, epsilon_high,
                      reduction) -> tuple[float, float, float, str]:
    """The loss's own arguments: the per-token tensors ``per_token`` (name -> (...) float or
    None) of the heads' leading dims and device, beta, the clip range, the reduction, and a
    frozen reference (no tensor of it requires grad while grad mode is on). Returns (beta,
    eps_low, eps_high, reduction)."""
    leading, device = checked.leading, policy_hidden.device
    for name, t in per_token.items():
        if t is not None:
            v.check_per_token(name, t, leading)
            if t.device != device:
                raise ValueError(f"{name} must be on {device}, got {t.device}")
    beta = v.check_beta(beta, "beta")
    eps_low = _check_clip("epsilon_low", epsilon_low)
    eps_high = eps_low if epsilon_high is None else _check_clip("epsilon_high", epsilon_high)
    reduction = v.check_choice("reduction", reduction, REDUCTIONS)
    if reduction == "sequence-mean" and len(leading) < 1:
        raise ValueError(
            "reduction='sequence-mean' needs hidden states (..., T, H) with a sequence dim T, "
            f"got policy_hidden {v.describe(policy_hidden)}"
        )
    if torch.is_grad_enabled():
        for name in ("ref_hidden", "ref_weight", "ref_bias"):
            t = checked.named[name]
            if t is not None and t.requires_grad:
                raise ValueError(
                    f"{name} requires grad ({v.describe(t)}): linear_policy_loss treats the "
                    f"reference as frozen; pass {name}.detach(), or use linear_kl for "
                    "gradients into the reference"
                )
    return beta, eps_low, eps_high, reduction


def _reduction_weights(counted: Tensor, reduction: str, dtype: torch.dtype) -> Tensor:
    """The reduction's weights c_t (...) in ``dtype`` of the ``counted`` (...) bool tokens, 0
    elsewhere: 1/M (``"token-mean"``), 1/(M_b·S) (``"sequence-mean"``: M_b the counted tokens
    of the token's sequence, the last dim; S the sequences with one at least), 1 (``"sum"``)."""
    coef = counted.to(dtype)
    if reduction == "token-mean":
        coef = coef / counted.sum().clamp(min=1)
    elif reduction == "sequence-mean":
        per_seq = counted.sum(-1, keepdim=True)  # (..., 1)
        seqs = (per_seq > 0).sum().clamp(min=1)
        coef = coef / (per_seq.clamp(min=1) * seqs)
    return coef


def _constants(per_token: dict, counted: Tensor, dtype: torch.dtype, check: bool) -> dict:
    """Each per-token tensor (...) as detached (N,) ``dtype`` constants, 0 where not counted;
    with ``check`` NaN at a counted position raises, naming the tensor and the first index."""
    zero = torch.zeros((), dtype=dtype, device=counted.device)
    flat = {
        name: None if t is None else torch.where(counted, t.detach().to(dtype), zero).reshape(-1)
        for name, t in per_token.items()
    }
    if check:
        leading = counted.shape
        for name, t in flat.items():
            bad = None if t is None else t.isnan()  # (N,), counted positions only
            if bad is not None and bool(bad.any()):
                at = bad.nonzero()[0, 0]
                first = tuple(int(i) for i in torch.unravel_index(at, leading)) if leading else ()
                raise ValueError(
                    f"{name} contains NaN ({v.describe(per_token[name])}) at "
                    f"{int(bad.sum())} counted position(s), the first at index {first}"
                )
    return flat


def linear_policy_loss(
    policy_hidden: Tensor,
    policy_weight: Tensor,
    ref_hidden: Tensor,
    ref_weight: Tensor,
    tokens: Tensor,
    *,
    beta: float,
    advantages: Optional[Tensor] = None,
    old_logprobs: Optional[Tensor] = None,
    mask: Optional[Tensor] = None,
    kl_weights: Optional[Tensor] = None,
    epsilon_low: float = 0.2,
    epsilon_high: Optional[float] = None,
    reduction: str = "token-mean",
    temperature: float = 1.0,
    policy_bias: Optional[Tensor] = None,
    ref_bias: Optional[Tensor] = None,
    logit_scale: float = 1.0,
    softcap: Optional[float] = None,
    ref_logit_scale: Optional[float] = None,
    ref_softcap: Optional[float] = None,
    ignore_index: int = -100,
    chunk_rows: Optional[int] = None,
    backend: str = "auto",
    check: bool = True,
) -> PolicyLoss:
    """A PPO/GRPO policy loss with the exact KL penalty, straight from the hidden states: the
    fused LM head whose forward+backward costs what the unfused one does.

    Shapes: ... the leading dims of the hidden states, e.g. (B, T) (B sequences, T positions:
    sequences run along the last leading dim), N their product, H_p / H_r the hidden sizes, V
    the vocabulary. The logits z = scale·(h Wᵀ + b) (soft-capped) are never held as (N, V).

    Per counted token t, with π = softmax(z_p/T), ρ = softmax(z_r/T), r_t = π(a_t)/π_old(a_t)
    and A_t its advantage::

        pg_t   = max(−A_t·r_t, −A_t·clip(r_t, 1 − ε_low, 1 + ε_high))   (clipped surrogate)
        loss_t = pg_t + beta·w_t·KL(π_t‖ρ_t)                             (exact KL, in the loss)

    and ``loss = Σ_t c_t·loss_t`` with the reduction's weights c_t (0 where not counted):

    - ``"token-mean"``: 1/M, M the batch's counted tokens (TRL's ``bnpo``/DAPO, verl's
      ``token-mean``);
    - ``"sequence-mean"``: 1/(M_b·S), M_b the counted tokens of the token's sequence, S the
      sequences with at least one (GRPO, verl's ``seq-mean-token-mean``; empty sequences are
      left out of the mean);
    - ``"sum"``: 1 (divide by your own constant, e.g. Dr. GRPO's B·T_max or a global token
      count across data-parallel ranks).

    A token counts where ``mask`` is True and ``tokens`` is not ``ignore_index``; elsewhere
    nothing is read (hidden states, advantages, old log-probs, weights may hold anything).

    How: each chunk of R counted rows computes both models' logits (2 GEMMs), the engine's
    statistics, and, since the loss is a known function of them, its gradient with respect to
    the policy's logits at once; that goes through the two gradient GEMMs (grad_h = dz W,
    grad_W += dzᵀ h) in the forward: 4 LM-head GEMMs overall, as the unfused path, and no
    recomputation. The backward only scales the held gradients by the upstream scalar. Peak
    extra memory: three (R, V) buffers (both logits and dz) plus O(N); see
    :func:`default_chunk_rows`. Per-token losses with their own upstream gradients are
    :func:`linear_kl`'s job (it recomputes in the backward).

    Args:
        policy_hidden: (..., H_p) float, the policy's last hidden states. Gradients flow.
        policy_weight: (V, H_p), the policy's LM head, same dtype. Gradients flow.
        ref_hidden: (..., H_r), the frozen reference's hidden states (no gradient: a
            reference tensor that requires grad raises while grad mode is on).
        ref_weight: (V, H_r), the reference's LM head, the dtype of ``ref_hidden``.
        tokens: (...) integer ids in [0, V) or ``ignore_index``, the sampled tokens a_t.
        beta: ≥ 0, the KL coefficient (0: the KL is only reported).
        advantages: optional (...) float, A_t (e.g. GRPO's sequence advantage repeated over its
            tokens); None: no surrogate term (the loss is beta times the reduced KL).
            Treated as a constant.
        old_logprobs: optional (...) float, log π_old(a_t) of the policy that sampled; None:
            on-policy (r_t = 1 in value, gradient −A_t·∇log π). Treated as a constant.
        mask: optional (...) bool, True = the token counts (e.g. the completion mask).
        kl_weights: optional (...) float, w_t multiplying each token's KL (default 1).
        epsilon_low, epsilon_high: ≥ 0, the clip range [1 − ε_low, 1 + ε_high] of the ratio;
            ``epsilon_high`` None = ``epsilon_low`` (DAPO's clip-higher: e.g. 0.2 / 0.28).
        reduction: ``"token-mean"``, ``"sequence-mean"`` or ``"sum"`` (above).
        temperature: > 0, divides both models' logits (the sampling temperature).
        policy_bias, ref_bias, logit_scale, softcap, ref_logit_scale, ref_softcap,
            ignore_index, backend: as in :func:`linear_kl`.
        chunk_rows: ≥ 1 rows per chunk; None: :func:`default_chunk_rows`.
        check: raise ValueError for token ids out of range, NaN in a counted position's
            statistics (naming the tensor that holds it), NaN in the advantages or old
            log-probs of a counted token. A few host reads per call.

    Returns:
        :class:`PolicyLoss`: ``loss`` () differentiable once with respect to the policy's
        hidden states, weight and bias (gradients in their dtypes; bf16/fp16 weight gradients
        accumulated in float32), and detached metrics: ``pg_loss``, ``kl_loss`` (), per token
        ``kl``, ``logprobs``, ``ref_logprobs``, ``ratio`` (...) float32 (float64 for float64
        inputs), ``clipped`` (...) bool, ``clip_fraction`` (). ``loss`` can be backpropagated
        once (a second backward raises); scaling it (``(loss * 3.7).backward()``, gradient
        accumulation) scales every gradient. Each call holds its gradient buffers (grad_h,
        grad_W, grad_b) from its forward to its backward: for gradient accumulation call
        ``backward()`` per micro-batch rather than summing the losses of many calls first.

    Raises:
        TypeError / ValueError: as :func:`linear_kl`, and for advantages / old_logprobs /
            kl_weights of another shape, device or a non-float dtype, beta < 0, ε < 0, an
            unknown reduction, ``"sequence-mean"`` without a sequence dim, a reference tensor
            that requires grad.
    """
    if tokens is None:
        raise TypeError("tokens must be a torch.Tensor (the sampled tokens), got None")
    checked = _check_heads(
        policy_hidden, policy_weight, ref_hidden, ref_weight, tokens=tokens, mask=mask,
        temperature=temperature, policy_bias=policy_bias, ref_bias=ref_bias,
        logit_scale=logit_scale, softcap=softcap, ref_logit_scale=ref_logit_scale,
        ref_softcap=ref_softcap, ignore_index=ignore_index, chunk_rows=chunk_rows,
        backend=backend,
    )
    per_token = {"advantages": advantages, "old_logprobs": old_logprobs, "kl_weights": kl_weights}
    beta, eps_low, eps_high, reduction = _policy_loss_args(
        checked, policy_hidden, per_token, beta, epsilon_low, epsilon_high, reduction
    )
    counted = tokens != checked.ignore_index  # (...)
    if checked.mask is not None:
        counted &= checked.mask
    dtype = v.compute_dtype(policy_hidden, policy_weight, ref_hidden, ref_weight)
    coef = _reduction_weights(counted, reduction, dtype).reshape(-1)  # (N,)
    flat = _constants(per_token, counted, dtype, check)
    kl_coef = coef if flat["kl_weights"] is None else coef * flat["kl_weights"]

    every = bool(counted.all())  # then the chunks are slices (no row gathers)
    (hp, hr), rows, tok = _flat_rows(
        (policy_hidden, ref_hidden), tokens, None if every else counted, checked.vocab,
        checked.ignore_index, check,
    )
    m = hp.shape[0] if rows is None else rows.shape[0]
    chunk = _plan_rows(chunk_rows, m, checked.vocab, policy_weight, ref_weight)
    grad_on = torch.is_grad_enabled()
    need = tuple(grad_on and t is not None and t.requires_grad
                 for t in (policy_hidden, policy_weight, policy_bias))
    opts = (checked.temperature, *checked.transforms, beta, eps_low, eps_high, chunk,
            LocalChunks(checked.impl), need)
    loss, pg_loss, kl_loss, kl, lp, rlp, ratio, clipped = _PolicyLoss.apply(
        hp, policy_weight, policy_bias, hr, ref_weight, ref_bias, tok, rows, coef, kl_coef,
        flat["advantages"], flat["old_logprobs"], opts,
    )
    if check:
        _check_nan([kl, lp], checked.named)
    clip_fraction = (clipped.sum() / counted.sum().clamp(min=1)).to(dtype)
    kl, lp, rlp, ratio, clipped = (o.reshape(counted.shape) for o in (kl, lp, rlp, ratio, clipped))
    return PolicyLoss(loss, pg_loss, kl_loss, kl, lp, rlp, ratio, clipped, clip_fraction)
