"""Row-chunked eager PyTorch backend (any device).

Rows are processed a chunk at a time, so temporaries are (rows_per_chunk, V) rather than
(N, V). The autograd Functions save only the inputs (no copies) and per-row float statistics
(O(N)); backward recomputes the softmax of each chunk and writes the gradient straight into a
buffer of the input's dtype.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

__all__ = ["full_kl", "token_logprobs", "rows_per_chunk"]

# Elements per chunk: 2**20 floats = 4 MiB of float32, which keeps a chunk in cache-sized pieces.
_CHUNK_ELEMENTS = 1 << 20


def rows_per_chunk(vocab_size: int, chunk_elements: int = _CHUNK_ELEMENTS) -> int:
    """How many rows of width ``vocab_size`` fit in one chunk (at least 1)."""
    return max(1, chunk_elements // max(1, vocab_size))


def _chunk_kl(
    x: torch.Tensor, y: torch.Tensor, temperature: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """KL, LSE_x, LSE_y of one (rows, V) chunk, math in ``dtype``."""
    xs = x.to(dtype) / temperature  # (rows, V)
    ys = y.to(dtype) / temperature  # (rows, V)
    lse_x = torch.logsumexp(xs, dim=-1)
    lse_y = torch.logsumexp(ys, dim=-1)
    logp = xs - lse_x.unsqueeze(-1)
    logq = ys - lse_y.unsqueeze(-1)
    p = logp.exp()
    # 0·log 0 = 0: entries with p == 0 contribute nothing (and never make NaN from -inf - -inf).
    terms = torch.where(p > 0, p * (logp - logq), torch.zeros((), dtype=dtype, device=p.device))
    kl = terms.sum(-1).clamp_min(0.0)  # exact KL is never negative: clamp rounding noise
    return kl, lse_x, lse_y


class _EagerFullKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, y, mask, temperature: float, chunk_rows: int):  # x, y: (N, V)
        dtype = torch.float64 if torch.float64 in (x.dtype, y.dtype) else torch.float32
        n = x.shape[0]
        kl = torch.empty(n, dtype=dtype, device=x.device)
        lse_x = torch.empty_like(kl)
        lse_y = torch.empty_like(kl)
        for s in range(0, n, chunk_rows):
            e = min(n, s + chunk_rows)
            kl[s:e], lse_x[s:e], lse_y[s:e] = _chunk_kl(x[s:e], y[s:e], temperature, dtype)
        if mask is not None:
            kl = torch.where(mask, kl, torch.zeros((), dtype=dtype, device=kl.device))
        ctx.save_for_backward(x, y, lse_x, lse_y, kl)
        ctx.temperature = temperature
        ctx.chunk_rows = chunk_rows
        ctx.has_mask = mask is not None
        if mask is not None:
            ctx.mask = mask
        return kl

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_kl):  # grad_kl: (N,)
        x, y, lse_x, lse_y, kl = ctx.saved_tensors
        t = ctx.temperature
        need_x, need_y = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if ctx.has_mask:
            grad_kl = torch.where(ctx.mask, grad_kl, torch.zeros_like(grad_kl))
        grad_x = torch.empty_like(x) if need_x else None
        grad_y = torch.empty_like(y) if need_y else None
        dtype = kl.dtype
        zero = torch.zeros((), dtype=dtype, device=kl.device)
        for s in range(0, x.shape[0], ctx.chunk_rows):
            e = min(x.shape[0], s + ctx.chunk_rows)
            g = (grad_kl[s:e].to(dtype) / t).unsqueeze(-1)  # (rows, 1)
            logp = x[s:e].to(dtype) / t - lse_x[s:e].unsqueeze(-1)
            p = logp.exp()
            if need_x:
                logq = y[s:e].to(dtype) / t - lse_y[s:e].unsqueeze(-1)
                d = torch.where(p > 0, p * ((logp - logq) - kl[s:e].unsqueeze(-1)), zero)
                # rows with zero upstream gradient (masked) stay exactly 0, even if KL is inf
                grad_x[s:e] = torch.where(g != 0, d * g, zero)
            if need_y:
                q = (y[s:e].to(dtype) / t - lse_y[s:e].unsqueeze(-1)).exp()
                grad_y[s:e] = torch.where(g != 0, (q - p) * g, zero)
        return grad_x, grad_y, None, None, None


class _EagerTokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tokens, temperature: float, chunk_rows: int):  # x: (N, V), tokens: (N,)
        dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        n = x.shape[0]
        lse = torch.empty(n, dtype=dtype, device=x.device)
        for s in range(0, n, chunk_rows):
            e = min(n, s + chunk_rows)
            lse[s:e] = torch.logsumexp(x[s:e].to(dtype) / temperature, dim=-1)
        picked = x.gather(-1, tokens.unsqueeze(-1)).squeeze(-1).to(dtype) / temperature
        ctx.save_for_backward(x, tokens, lse)
        ctx.temperature = temperature
        ctx.chunk_rows = chunk_rows
        return picked - lse

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):  # grad_out: (N,)
        x, tokens, lse = ctx.saved_tensors
        t = ctx.temperature
        grad_x = torch.empty_like(x)
        dtype = lse.dtype
        for s in range(0, x.shape[0], ctx.chunk_rows):
            e = min(x.shape[0], s + ctx.chunk_rows)
            g = (grad_out[s:e].to(dtype) / t).unsqueeze(-1)  # (rows, 1)
            p = (x[s:e].to(dtype) / t - lse[s:e].unsqueeze(-1)).exp()
            grad = -p * g
            grad.scatter_add_(-1, tokens[s:e].unsqueeze(-1), g)
            grad_x[s:e] = grad
        return grad_x, None, None, None


def full_kl(
    x: torch.Tensor,
    y: torch.Tensor,
    mask: torch.Tensor | None,
    temperature: float,
    chunk_rows: int | None = None,
) -> torch.Tensor:
    """Exact KL per row. x, y: (N, V); mask: (N,) bool or None. Returns (N,) float32/float64."""
    chunk_rows = chunk_rows or rows_per_chunk(x.shape[-1])
    return _EagerFullKL.apply(x, y, mask, temperature, chunk_rows)


def token_logprobs(
    x: torch.Tensor, tokens: torch.Tensor, temperature: float, chunk_rows: int | None = None
) -> torch.Tensor:
    """log softmax(x/T)[token] per row. x: (N, V); tokens: (N,) int64. Returns (N,)."""
    chunk_rows = chunk_rows or rows_per_chunk(x.shape[-1])
    return _EagerTokenLogprobs.apply(x, tokens, temperature, chunk_rows)
