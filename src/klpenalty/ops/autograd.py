"""Autograd and fake (meta) registration shared by every backend's custom ops.

A backend provides two pairs of ``torch.library.custom_op`` s with fixed signatures:

- ``full_kl(x, y, mask, temperature, check, tile_rows, tile_cols) -> (kl (...), stats (..., 6))``
  and ``full_kl_backward(grad, x, y, stats, mask, temperature, need_x, need_y, tile_rows,
  tile_cols) -> (grad_x (..., V) or empty, grad_y (..., V) or empty)``;
- ``token_logprobs(x, tokens, temperature, ignore_index, check, tile_rows, tile_cols) ->
  (logp (...), stats (..., 3))`` and ``token_logprobs_backward(grad, x, tokens, stats,
  temperature, ignore_index, tile_rows, tile_cols) -> grad_x (..., V)``;
- ``entropy(x, mask, temperature, check, tile_rows, tile_cols) -> (H (...), stats (..., 3))``
  and ``entropy_backward(grad, x, stats, mask, temperature, tile_rows, tile_cols) -> grad_x
  (..., V)``.

:func:`register_full_kl` / :func:`register_token_logprobs` / :func:`register_entropy` give them
fake implementations (so
``torch.compile`` traces through them with ``fullgraph=True``) and an autograd formula:
the first derivative calls the backend's backward op; a second derivative (``create_graph=True``:
Hessian-vector products, gradient penalties) recomputes the first derivative with differentiable
PyTorch ops on the whole (..., V) tensor, so autograd differentiates it again. That path
materialises (..., V) temporaries; it is exact, not fast.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._validation import compute_dtype

__all__ = [
    "register_full_kl",
    "register_token_logprobs",
    "register_entropy",
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


# ------------------------------------------------------------------- differentiable formulas
def _full_kl_grads_differentiable(
    grad: Tensor, x: Tensor, y: Tensor, mask: Tensor | None, temperature: float
) -> tuple[Tensor, Tensor]:
    """π·((log π − log ρ) − KL)·g/T and (ρ − π)·g/T with differentiable ops, (..., V)."""
    dtype = compute_dtype(x, y)
    xs, ys = x.to(dtype) / temperature, y.to(dtype) / temperature
    g = masked_grad(grad, mask, dtype)
    if mask is not None:  # masked rows may hold garbage (all −inf): keep it out of the graph
        keep = mask.unsqueeze(-1)
        xs, ys = torch.where(keep, xs, 0.0), torch.where(keep, ys, 0.0)
    logp, logq = torch.log_softmax(xs, -1), torch.log_softmax(ys, -1)
    p = logp.exp()
    live = p > 0  # 0·log 0 = 0, with no NaN in the unused branch's gradient either
    diff = torch.where(live, logp, 0.0) - torch.where(live, logq, 0.0)
    kl = (p * diff).sum(-1, keepdim=True)
    scale = (g / temperature).unsqueeze(-1)
    grad_x = (p * (diff - kl) * scale).to(x.dtype)
    grad_y = ((logq.exp() - p) * scale).to(y.dtype)
    return grad_x, grad_y


def _token_logprobs_grad_differentiable(
    grad: Tensor, x: Tensor, tokens: Tensor, temperature: float, ignore_index: int
) -> Tensor:
    """(onehot(token) − π)·g/T with differentiable ops, (..., V)."""
    dtype = compute_dtype(x)
    tok, ignored = safe_tokens(tokens, ignore_index)
    g = grad.to(dtype).masked_fill(ignored, 0.0)
    p = torch.softmax(x.to(dtype) / temperature, -1)
    onehot = torch.zeros_like(p).scatter(-1, tok.unsqueeze(-1), 1.0)
    return ((onehot - p) * (g / temperature).unsqueeze(-1)).to(x.dtype)


def _entropy_grad_differentiable(
    grad: Tensor, x: Tensor, mask: Tensor | None, temperature: float
) -> Tensor:
    """−π·(log π + H)·g/T with differentiable ops, (..., V); 0 where π = 0 or masked."""
    dtype = compute_dtype(x)
    xs = x.to(dtype) / temperature
    g = masked_grad(grad, mask, dtype)
    if mask is not None:  # masked rows may hold garbage (all −inf): keep it out of the graph
        xs = torch.where(mask.unsqueeze(-1), xs, 0.0)
    logp = torch.log_softmax(xs, -1)
    p = logp.exp()
    logp = torch.where(p > 0, logp, 0.0)  # 0·log 0 = 0, no NaN in the unused branch either
    h = -(p * logp).sum(-1, keepdim=True)
    return (-p * (logp + h) * (g / temperature).unsqueeze(-1)).to(x.dtype)


# ------------------------------------------------------------------------------ registration
def _forward_outputs(x: Tensor, dtype: torch.dtype, stats_cols: int) -> tuple[Tensor, Tensor]:
    """Fake forward outputs: the result (...) and the stats (..., stats_cols) in ``dtype``."""
    leading = x.shape[:-1]
    return x.new_empty(leading, dtype=dtype), x.new_empty((*leading, stats_cols), dtype=dtype)


def _grad_like(x: Tensor) -> Tensor:
    """Fake gradient of ``x``: its shape and dtype, contiguous."""
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def register_full_kl(fwd_op, bwd_op) -> None:
    """Fake implementations and autograd for a backend's full_kl op pair.

    ``fwd_op``/``bwd_op``: Python ``custom_op`` objects, or the ``OpOverload`` s of ops defined
    in C++ with ``TORCH_LIBRARY`` (e.g. ``torch.ops.klpenalty.<name>.default``).
    """

    @torch.library.register_fake(fwd_op)
    def _(x, y, mask, temperature, check, tile_rows, tile_cols):
        return _forward_outputs(x, compute_dtype(x, y), 6)

    @torch.library.register_fake(bwd_op)
    def _(grad, x, y, stats, mask, temperature, need_x, need_y, tile_rows, tile_cols):
        gx = _grad_like(x) if need_x else x.new_empty(0)
        gy = _grad_like(y) if need_y else y.new_empty(0)
        return gx, gy

    def setup_context(ctx, inputs, output):
        x, y, mask, temperature, _, tile_rows, tile_cols = inputs
        ctx.save_for_backward(x, y, mask, output[1])
        ctx.args = (temperature, tile_rows, tile_cols)

    def backward(ctx, grad_kl, _grad_stats):
        x, y, mask, stats = ctx.saved_tensors
        need_x, need_y = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        temperature, tile_rows, tile_cols = ctx.args
        if torch.is_grad_enabled():  # create_graph=True: a differentiable first derivative
            gx, gy = _full_kl_grads_differentiable(grad_kl, x, y, mask, temperature)
        else:
            gx, gy = bwd_op(
                grad_kl, x, y, stats, mask, temperature, need_x, need_y, tile_rows, tile_cols
            )
        return (gx if need_x else None), (gy if need_y else None), None, None, None, None, None

    torch.library.register_autograd(fwd_op, backward, setup_context=setup_context)


def register_token_logprobs(fwd_op, bwd_op) -> None:
    """Fake implementations and autograd for a backend's token_logprobs op pair."""

    @torch.library.register_fake(fwd_op)
    def _(x, tokens, temperature, ignore_index, check, tile_rows, tile_cols):
        return _forward_outputs(x, compute_dtype(x), 3)

    @torch.library.register_fake(bwd_op)
    def _(grad, x, tokens, stats, temperature, ignore_index, tile_rows, tile_cols):
        return _grad_like(x)

    def setup_context(ctx, inputs, output):
        x, tokens, temperature, ignore_index, _, tile_rows, tile_cols = inputs
        ctx.save_for_backward(x, tokens, output[1])
        ctx.args = (temperature, ignore_index, tile_rows, tile_cols)

    def backward(ctx, grad_out, _grad_stats):
        x, tokens, stats = ctx.saved_tensors
        temperature, ignore_index, tile_rows, tile_cols = ctx.args
        if torch.is_grad_enabled():
            gx = _token_logprobs_grad_differentiable(grad_out, x, tokens, temperature, ignore_index)
        else:
            gx = bwd_op(grad_out, x, tokens, stats, temperature, ignore_index, tile_rows, tile_cols)
        return gx, None, None, None, None, None, None

    torch.library.register_autograd(fwd_op, backward, setup_context=setup_context)


def register_entropy(fwd_op, bwd_op) -> None:
    """Fake implementations and autograd for a backend's entropy op pair."""

    @torch.library.register_fake(fwd_op)
    def _(x, mask, temperature, check, tile_rows, tile_cols):
        return _forward_outputs(x, compute_dtype(x), 3)

    @torch.library.register_fake(bwd_op)
    def _(grad, x, stats, mask, temperature, tile_rows, tile_cols):
        return _grad_like(x)

    def setup_context(ctx, inputs, output):
        x, mask, temperature, _, tile_rows, tile_cols = inputs
        ctx.save_for_backward(x, mask, output[1])
        ctx.args = (temperature, tile_rows, tile_cols)

    def backward(ctx, grad_h, _grad_stats):
        x, mask, stats = ctx.saved_tensors
        temperature, tile_rows, tile_cols = ctx.args
        if torch.is_grad_enabled():  # create_graph=True: a differentiable first derivative
            gx = _entropy_grad_differentiable(grad_h, x, mask, temperature)
        else:
            gx = bwd_op(grad_h, x, stats, mask, temperature, tile_rows, tile_cols)
        return gx, None, None, None, None, None

    torch.library.register_autograd(fwd_op, backward, setup_context=setup_context)


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
