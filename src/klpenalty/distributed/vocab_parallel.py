"""Vocabulary-parallel exact KL and token log-probs: autograd Functions and public functions.

Every rank holds the same positions and a contiguous slice of the vocabulary; see the package
docstring for the layout and the communication per call. The per-shard math is the
engine's (:mod:`klpenalty.ops.engine`): each rank computes the per-row state of its slice with
the streaming tile loop, and the merge across ranks is an all-reduce MAX of the maxima followed
by an all-reduce SUM of the rescaled sums. The configuration check lives in :mod:`._config`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from .. import _validation as v
from ._config import _CHECK_DOC, _TOK_MAX, _TOK_MIN, _VR, _check_vocab_start, _config_check
from ._group import _all_reduce, _device_of, _group_info
from ..ops import engine, streaming
from ..ops.autograd import masked_grad

__all__ = ["vocab_parallel_full_kl", "vocab_parallel_token_logprobs"]


# ---------------------------------------------------------------------------------------------
# Autograd Functions
# ---------------------------------------------------------------------------------------------


def _tile(n: int, width: int) -> tuple[int, int]:
    return streaming.tile_shape(n, width, streaming.TILE_ELEMENTS)


def _raise_if_nan(
    out: torch.Tensor, sums: dict[str, torch.Tensor], caller: str
) -> None:
    """NaN in the (global) result → a ValueError saying why; the same on every rank.

    ``out`` and the all-reduced sums (name → (N,) Σ e^u of that input) are identical on every
    rank, so the decision and the message are too, with no extra communication.
    """
    bad = torch.isnan(out)
    if not bool(bad.any()):
        return
    rows = bad.nonzero().flatten()
    what = "the result is NaN"
    for name, s in sums.items():
        if not bool(torch.isfinite(s[rows]).all()):
            what = f"{name} hold NaN or +inf"
            break
        if bool((s[rows] == 0).any()):
            what = f"{name} are -inf over the whole vocabulary (no distribution)"
            break
    raise ValueError(
        f"{caller}: {what} in {rows.numel()} counted position(s) on some rank, "
        f"first flat row index {int(rows[0])}"
    )


class _VocabParallelFullKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, y, mask, temperature: float, check: bool, group, caller: str):
        # x, y: (N, V_r) this rank's slice
        rows, cols = _tile(*x.shape)
        local, careful = streaming.kl_state(x, y, temperature, rows, cols)
        maxes = torch.stack([local.m_x, local.m_y], dim=-1)  # (N, 2)
        _all_reduce(maxes, dist.ReduceOp.MAX, group)
        mine = engine.kl_rescale(local, maxes[:, 0], maxes[:, 1], temperature)
        sums = torch.stack([mine.s_x, mine.s_y, mine.a], dim=-1)  # (N, 3)
        _all_reduce(sums, dist.ReduceOp.SUM, group)
        merged = engine.KLState(maxes[:, 0], sums[:, 0], maxes[:, 1], sums[:, 1], sums[:, 2])
        kl, stats = engine.kl_finalize(merged, careful)
        if mask is not None:
            kl = kl.masked_fill(~mask, 0.0)
        if check:
            _raise_if_nan(kl, {"policy_logits": sums[:, 0], "ref_logits": sums[:, 1]}, caller)
        ctx.save_for_backward(x, y, stats, mask)
        ctx.temperature = temperature
        return kl

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_kl):  # grad_kl: (N,)
        x, y, stats, mask = ctx.saved_tensors
        need_x, need_y = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        g = masked_grad(grad_kl, mask, stats.dtype)  # (N,)
        rows, cols = _tile(*x.shape)
        grad_x, grad_y = streaming.kl_grads(
            g, x, y, stats, ctx.temperature, need_x, need_y, rows, cols
        )
        return grad_x, grad_y, None, None, None, None, None


class _VocabParallelTokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tokens, vocab_start: int, temperature: float, check: bool, group, caller):
        n, width = x.shape  # (N, V_r)
        rows, cols = _tile(n, width)
        local = streaming.lse_state(x, temperature, rows, cols)
        m = local.m.clone()  # (N,)
        _all_reduce(m, dist.ReduceOp.MAX, group)
        shift = engine.finite_or_zero(m)
        idx = tokens - vocab_start  # (N,) position in this slice
        owned = (idx >= 0) & (idx < width)
        idx = idx.clamp(0, width - 1)
        picked = x.gather(-1, idx.unsqueeze(-1)).squeeze(-1).to(shift.dtype)  # (N,)
        # (x_t − M)/T on the rank that owns the token, 0 elsewhere: the SUM is the target
        target = torch.where(owned, (picked - shift) / temperature, torch.zeros_like(shift))
        sums = torch.stack([engine.lse_rescale(local, m, temperature).s, target], dim=-1)
        _all_reduce(sums, dist.ReduceOp.SUM, group)  # (N, 2)
        log_s = torch.log(sums[:, 0])
        out = sums[:, 1] - log_s
        out = out.masked_fill(sums[:, 0] == 0, float("nan"))
        if check:
            _raise_if_nan(out, {"logits": sums[:, 0]}, caller)
        ctx.save_for_backward(x, idx, owned, shift, engine.finite_or_zero(log_s))
        ctx.temperature = temperature
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):  # grad_out: (N,)
        x, idx, owned, shift, log_s = ctx.saved_tensors
        t = ctx.temperature
        g = grad_out.to(log_s.dtype)  # (N,)
        grad_x = streaming.lse_grads(g, x, shift, log_s, t, *_tile(*x.shape))  # −π·g/T
        at_token = torch.where(owned, g / t, torch.zeros_like(g)).to(grad_x.dtype)
        grad_x.scatter_add_(-1, idx.unsqueeze(-1), at_token.unsqueeze(-1))
        return grad_x, None, None, None, None, None, None


# ---------------------------------------------------------------------------------------------
# Public functions
# ---------------------------------------------------------------------------------------------


def vocab_parallel_full_kl(
    policy_logits_shard: torch.Tensor,
    ref_logits_shard: torch.Tensor,
    *,
    group: Any = None,
    temperature: float = 1.0,
    mask: torch.Tensor | None = None,
    vocab_start: int | None = None,
    check: bool = True,
) -> torch.Tensor:
    """Exact full-vocabulary KL(π‖ρ) per position when each rank holds a slice of the vocabulary.

    Every rank of ``group`` holds the same positions and a contiguous vocabulary slice (uneven
    widths V_r allowed) of both models' logits; rank 0 holds the first slice. Every rank gets
    the same result, equal to :func:`klpenalty.full_kl` on the logits gathered along the last
    dim in rank order. The local passes run in row chunks (no (N, V_r) float32 temporary).

    Communication per call: an all-reduce MAX of the per-row maxima (N, 2), then an all-reduce
    SUM of (s_x, s_y, A) against the global maxima (N, 3): 20 bytes per position for float32
    math (40 for float64 inputs), never the logits. The backward is local: each rank gets the
    gradient of its own shard, π·((log π − log ρ) − KL)/T, from the global log-sum-exps and KL
    saved in the forward, with no communication.

    Numerics as :func:`klpenalty.full_kl`: float32 math for float16/bfloat16/float32 inputs
    (float64 for float64); 0·log 0 = 0 (a shard may be -inf over a whole row); KL = +inf where
    the policy has mass the reference lacks; clamped at 0; exactly 0 for identical logits.
    Non-finite results are diagnosed from the all-reduced sums, so the same ValueError is raised
    on every rank.

    {check}
    Args:
        policy_logits_shard: (..., V_r) float16/bfloat16/float32/float64, this rank's slice of
            the policy logits. Gradients flow.
        ref_logits_shard: (..., V_r) same shape, any float dtype; gets a gradient (ρ − π)/T only
            if it requires grad.
        group: the process group the vocabulary is split over (e.g. the tensor-parallel group);
            None = the default group.
        temperature: > 0, divides both models' logits before the softmax.
        mask: optional (...) bool, True = counts, the same on every rank. Masked positions return
            0 and get zero gradient; their logits may hold anything.
        vocab_start: optional int, where this rank's slice starts in the vocabulary. Only used
            by the configuration check (the KL does not depend on the vocabulary order).
        check: run the configuration check described above, and raise when a counted
            position's result is NaN (one more host read of an (N,) tensor).

    Returns:
        (...) float32 (float64 if either input is float64), identical on every rank,
        differentiable; gradients come back in the inputs' dtypes.

    Raises:
        RuntimeError: torch.distributed is not initialized.
        TypeError / ValueError: invalid arguments on some rank, ranks that disagree, NaN in a
            counted position (all on every rank, see above).
    """
    caller = "vocab_parallel_full_kl"
    world, _ = _group_info(group, caller)
    device = _device_of(policy_logits_shard, ref_logits_shard, caller=caller)
    local_error: Exception | None = None
    leading: tuple[int, ...] = ()
    width = 0
    try:
        v.check_logits_pair(policy_logits_shard, ref_logits_shard)
        temperature = v.check_temperature(temperature)
        leading = tuple(policy_logits_shard.shape[:-1])
        width = policy_logits_shard.shape[-1]
        if mask is not None:
            mask = v.check_mask(mask, leading, device)
        vocab_start = _check_vocab_start(vocab_start, required=False)
    except (TypeError, ValueError) as err:
        local_error = err
    if check:
        _config_check(
            caller, group, world, device, local_error,
            names=("policy_logits_shard", "ref_logits_shard"),
            policy=policy_logits_shard, ref=ref_logits_shard, leading=leading,
            vocab_start=vocab_start, width=width, temperature=temperature, mask=mask,
            tokens=None,
        )  # fmt: skip
    elif local_error is not None:
        raise local_error
    x = policy_logits_shard.reshape(-1, width)  # (N, V_r)
    y = ref_logits_shard.reshape(-1, width)  # (N, V_r)
    flat_mask = mask.reshape(-1) if mask is not None else None  # (N,)
    kl = _VocabParallelFullKL.apply(x, y, flat_mask, temperature, check, group, caller)  # (N,)
    return kl.reshape(leading)


def vocab_parallel_token_logprobs(
    logits_shard: torch.Tensor,
    tokens: torch.Tensor,
    *,
    vocab_start: int,
    group: Any = None,
    temperature: float = 1.0,
    check: bool = True,
) -> torch.Tensor:
    """log π(token) per position when each rank holds a slice of the vocabulary.

    Equal to :func:`klpenalty.token_logprobs` on the gathered logits, on every rank.
    Communication per call: an all-reduce MAX of the per-row maxima (N,), then one all-reduce
    SUM of (Σ exp, target logit) (N, 2), where only the rank that owns the token contributes
    its logit: 12 bytes per position for float32 math (24 for float64). The backward is local:
    (onehot(token) − π)/T on this rank's slice.

    {check}
    With ``check=True`` the tokens are also checked against the total vocabulary Σ V_r.

    Args:
        logits_shard: (..., V_r) float16/bfloat16/float32/float64, this rank's slice.
        tokens: (...) integer ids in the *whole* vocabulary [0, V), the same on every rank.
        vocab_start: int, where this rank's slice starts: it holds ids
            [vocab_start, vocab_start + V_r). The slices must tile [0, V) in rank order.
        group: the process group the vocabulary is split over; None = the default group.
        temperature: > 0; use the temperature the tokens were sampled with.
        check: run the configuration check described above, and raise when a counted
            position's result is NaN (one more host read of an (N,) tensor).

    Returns:
        (...) float32 (float64 for float64 logits), ≤ 0, identical on every rank,
        differentiable with respect to ``logits_shard``.
    """
    caller = "vocab_parallel_token_logprobs"
    world, _ = _group_info(group, caller)
    device = _device_of(logits_shard, caller=caller)
    local_error: Exception | None = None
    leading: tuple[int, ...] = ()
    width = 0
    try:
        v.check_logits("logits_shard", logits_shard)
        leading = tuple(logits_shard.shape[:-1])
        width = logits_shard.shape[-1]
        # ids are checked against the whole vocabulary after the gather; here dtype and shape
        v.check_tokens(tokens, leading)
        if tokens.device != device:
            raise ValueError(f"tokens must be on {device}, got {tokens.device}")
        temperature = v.check_temperature(temperature)
        vocab_start = _check_vocab_start(vocab_start, required=True)
    except (TypeError, ValueError) as err:
        local_error = err
    if check:
        recs = _config_check(
            caller, group, world, device, local_error,
            names=("logits_shard", ""),
            policy=logits_shard, ref=None, leading=leading, vocab_start=vocab_start,
            width=width, temperature=temperature, mask=None, tokens=tokens,
        )  # fmt: skip
        vocab = sum(rec[_VR] for rec in recs)
        lo, hi = recs[0][_TOK_MIN], recs[0][_TOK_MAX]
        if tokens.numel() and (lo < 0 or hi >= vocab):
            raise ValueError(
                f"{caller}: tokens must lie in [0, {vocab}) (the whole vocabulary, Σ V_r), "
                f"got values in [{lo}, {hi}] ({v.describe(tokens)})"
            )
    elif local_error is not None:
        raise local_error
    x = logits_shard.reshape(-1, width)  # (N, V_r)
    tok = tokens.reshape(-1).long()  # (N,)
    out = _VocabParallelTokenLogprobs.apply(
        x, tok, vocab_start, temperature, check, group, caller
    )
    return out.reshape(leading)


_CHECK_TEXT = _CHECK_DOC.strip() + "\n"  # first line takes the placeholder's indentation
vocab_parallel_full_kl.__doc__ = vocab_parallel_full_kl.__doc__.replace("{check}", _CHECK_TEXT)
vocab_parallel_token_logprobs.__doc__ = vocab_parallel_token_logprobs.__doc__.replace(
    "{check}", _CHECK_TEXT
)
