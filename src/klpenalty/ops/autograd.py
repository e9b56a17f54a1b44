"""Autograd and fake (meta) registration of every backend's one custom op pair.

A backend provides one pair of ``torch.library.custom_op`` s (or C++ ``TORCH_LIBRARY`` ops) with
fixed signatures, the one-pass per-token statistics:

- ``token_stats(x, y?, tokens?, mask?, keep?, tau?, temperature, ignore_index, want, check,
  tile_rows, tile_cols) -> (out (..., 4), stats (..., 9))``: KL(π̃‖ρ), log π̃(token),
  log ρ(token), H(π̃), the columns in ``want`` (bits :data:`WANT_KL` ...);
- ``token_stats_backward(grad (..., 4), x, y?, tokens?, stats, mask?, keep?, tau?, temperature,
  ignore_index, want, need_x, need_y, tile_rows, tile_cols) -> (grad_x or empty, grad_y or
  empty)``.

:func:`register_token_stats` gives them a fake implementation (so ``torch.compile`` traces
through them with ``fullgraph=True``) and an autograd formula: the first derivative calls the
backend's backward op; a second derivative (``create_graph=True``: Hessian-vector products,
gradient penalties) recomputes the first derivative with differentiable PyTorch ops on the whole
(..., V) tensor (:func:`_token_stats_grads_differentiable`), so autograd differentiates it again.
That path materialises (..., V) temporaries; it is exact, not fast. The single-output entry
points of every backend are views of this op (:mod:`.views`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._validation import compute_dtype

__all__ = [
    "masked_grad",
    "safe_tokens",
    "register_token_stats",
    "kept_logits",
    "WANT_KL",
    "WANT_LOGP",
    "WANT_REF_LOGP",
    "WANT_ENTROPY",
    "STATS_COLS",
]


def masked_grad(grad: Tensor, mask: Tensor | None, dtype: torch.dtype) -> Tensor:
    """The upstream gradient in ``dtype``, exactly 0 where ``mask`` is False."""
    g = grad.to(dtype)
    return g if mask is None else g.masked_fill(~mask, 0.0)


def safe_tokens(tokens: Tensor, ignore_index: int) -> tuple[Tensor, Tensor]:
    """(ids usable for gather/scatter, ignored flags): ignored positions read id 0."""
    ignored = tokens == ignore_index
    return tokens.masked_fill(ignored, 0).long(), ignored



def _grad_like(x: Tensor) -> Tensor:
    """Fake gradient of ``x``: its shape and dtype, contiguous."""
    return torch.empty_like(x, memory_format=torch.contiguous_format)


# ------------------------------------------------------------------ the one-pass token stats
# ``want`` bits of the token_stats ops: which columns of ``out`` (..., 4) a call computes.
WANT_KL, WANT_LOGP, WANT_REF_LOGP, WANT_ENTROPY = 1, 2, 4, 8
# out columns: KL(π̃‖ρ), log π̃(token), log ρ(token), H(π̃)
OUT_KL, OUT_LOGP, OUT_REF_LOGP, OUT_ENTROPY = 0, 1, 2, 3
# stats columns (..., 9): the KL engine's six (kl_finalize), then E_π̃[u], log π̃(t), log ρ(t).
# Columns a call does not need hold 0; rows masked out hold anything (never read).
STATS_COLS = 9
(
    ST_SHIFT_X,
    ST_LOG_S_X,
    ST_SHIFT_Y,
    ST_LOG_S_Y,
    ST_MEAN_D,  # E_π̃[u − w]
    ST_CAREFUL,  # 1.0 where the row needed the 0·log 0 arithmetic
    ST_MEAN_U,  # E_π̃[u]
    ST_LOGP,
    ST_REF_LOGP,
) = range(STATS_COLS)


def kept_logits(x: Tensor, keep: Tensor | None, tau: Tensor | None) -> Tensor:
    """x with −inf outside the support: kept(v) = keep[v] and x_v ≥ tau (either may be None).

    The comparison with ``tau`` is made in the dtype of ``tau`` (the compute dtype), as every
    backend does. Materialises (..., V): for the reference path and double backward only.
    """
    if tau is not None:
        x = torch.where(x.to(tau.dtype) >= tau.unsqueeze(-1), x, float("-inf"))
    if keep is not None:
        x = x.masked_fill(~keep, float("-inf"))
    return x


def _token_stats_grads_differentiable(
    grad: Tensor,
    x: Tensor,
    y: Tensor | None,
    tokens: Tensor | None,
    mask: Tensor | None,
    keep: Tensor | None,
    tau: Tensor | None,
    temperature: float,
    ignore_index: int,
    want: int,
) -> tuple[Tensor, Tensor | None]:
    """∂/∂x and ∂/∂y of Σ grad·out with differentiable ops on (..., V) (double backward).

    With p = π̃, q = ρ (log-probs lp, lq), KL, H and onehot(t):
    ∂/∂x = p·[g_kl·((lp − lq) − KL) − g_lp − g_h·(lp + H)]/T + onehot·g_lp/T,
    ∂/∂y = [g_kl·(q − p) + g_rl·(onehot − q)]/T. ∂/∂x is 0 off the support; for a sampled
    token off the support (``check=False``, log π̃(t) = −inf) the onehot term is dropped: the
    limit x_t → −inf of the untruncated derivative, as the backends' first derivative gives.
    """
    dtype = compute_dtype(x) if y is None else compute_dtype(x, y)
    g = masked_grad(grad, None if mask is None else mask.unsqueeze(-1), dtype)  # (..., 4)
    g_kl, g_lp, g_rl, g_h = (
        g[..., c] if want & bit else torch.zeros_like(g[..., c])
        for c, bit in enumerate((WANT_KL, WANT_LOGP, WANT_REF_LOGP, WANT_ENTROPY))
    )
    xs = kept_logits(x.to(dtype), keep, tau) / temperature
    ys = None if y is None else y.to(dtype) / temperature
    if mask is not None:  # masked rows may hold garbage (all −inf): keep it out of the graph
        keep_rows = mask.unsqueeze(-1)
        xs = torch.where(keep_rows, xs, 0.0)
        ys = None if ys is None else torch.where(keep_rows, ys, 0.0)
    lp = torch.log_softmax(xs, -1)
    p = lp.exp()
    live = p > 0  # 0·log 0 = 0, with no NaN in the unused branch's gradient either
    lp0 = torch.where(live, lp, 0.0)
    onehot = onehot_x = torch.zeros_like(p)
    if tokens is not None:
        tok, ignored = safe_tokens(tokens, ignore_index)
        onehot = onehot.scatter(-1, tok.unsqueeze(-1), 1.0)
        g_lp, g_rl = g_lp.masked_fill(ignored, 0.0), g_rl.masked_fill(ignored, 0.0)
        # a token off the support (check=False): log π̃(t) = −inf; its derivative is taken as
        # the limit x_t → −inf of the untruncated one, −π̃·g/T (0 at the token itself), as the
        # backends' first derivative gives it
        off = torch.isneginf(xs.detach().gather(-1, tok.unsqueeze(-1)))
        onehot_x = onehot.masked_fill(off, 0.0)
    inner = -g_lp.unsqueeze(-1) - g_h.unsqueeze(-1) * (lp0 + (-(p * lp0).sum(-1, keepdim=True)))
    grad_y = None
    if ys is not None:
        lq = torch.log_softmax(ys, -1)
        q = lq.exp()
        diff = lp0 - torch.where(live, lq, 0.0)
        kl = (p * diff).sum(-1, keepdim=True)
        inner = inner + g_kl.unsqueeze(-1) * (diff - kl)
        grad_y = (g_kl.unsqueeze(-1) * (q - p) + g_rl.unsqueeze(-1) * (onehot - q)) / temperature
        grad_y = grad_y.to(y.dtype)
    grad_x = (p * inner + onehot_x * g_lp.unsqueeze(-1)) / temperature
    return grad_x.to(x.dtype), grad_y


def register_token_stats(fwd_op, bwd_op) -> None:
    """Fake implementations and autograd for a backend's one-pass token_stats op pair.

    ``fwd_op(x, y, tokens, mask, keep, tau, temperature, ignore_index, want, check, tile_rows,
    tile_cols) -> (out (..., 4), stats (..., 9))`` and ``bwd_op(grad (..., 4), x, y, tokens,
    stats, mask, keep, tau, temperature, ignore_index, want, need_x, need_y, tile_rows,
    tile_cols) -> (grad_x (..., V) or empty, grad_y (..., V) or empty)``; see docs/design.md.
    """

    @torch.library.register_fake(fwd_op)
    def _(x, y, tokens, mask, keep, tau, temperature, ignore_index, want, check, tr, tc):
        dtype = compute_dtype(x) if y is None else compute_dtype(x, y)
        leading = x.shape[:-1]
        return (
            x.new_empty((*leading, 4), dtype=dtype),
            x.new_empty((*leading, STATS_COLS), dtype=dtype),
        )

    @torch.library.register_fake(bwd_op)
    def _(grad, x, y, tokens, stats, mask, keep, tau, temperature, ii, want, need_x, need_y,
          tr, tc):
        gx = _grad_like(x) if need_x else x.new_empty(0)
        gy = _grad_like(y) if (need_y and y is not None) else x.new_empty(0)
        return gx, gy

    def setup_context(ctx, inputs, output):
        x, y, tokens, mask, keep, tau, temperature, ignore_index, want, _, tr, tc = inputs
        ctx.save_for_backward(x, y, tokens, mask, keep, tau, output[1])
        ctx.args = (temperature, ignore_index, want, tr, tc)

    def backward(ctx, grad_out, _grad_stats):
        x, y, tokens, mask, keep, tau, stats = ctx.saved_tensors
        temperature, ignore_index, want, tr, tc = ctx.args
        need_x = ctx.needs_input_grad[0]
        need_y = y is not None and ctx.needs_input_grad[1]
        if torch.is_grad_enabled():  # create_graph=True: a differentiable first derivative
            gx, gy = _token_stats_grads_differentiable(
                grad_out, x, y, tokens, mask, keep, tau, temperature, ignore_index, want
            )
        else:
            gx, gy = bwd_op(
                grad_out, x, y, tokens, stats, mask, keep, tau, temperature, ignore_index,
                want, need_x, need_y, tr, tc,
            )
        return (
            gx if need_x else None,
            gy if need_y else None,
            *([None] * 10),
        )

    torch.library.register_autograd(fwd_op, backward, setup_context=setup_context)
