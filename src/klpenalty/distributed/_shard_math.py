"""Local shard math: the per-shard passes of the vocabulary-parallel functions.

Everything here is local to one rank (no communication) and works on flattened shards
(N, V_r). The passes run in row chunks, so they touch (rows_per_chunk, V_r) float temporaries
at most. A streaming engine can replace these functions one for one: same arguments, same
(N,) / (N, k) / (N, V_r) outputs. Nothing else in the package computes on the logits.
"""

from __future__ import annotations

import torch

# Elements per row chunk of the local passes: 2**20 float32 = 4 MiB per temporary.
_CHUNK_ELEMENTS = 1 << 20


def _rows_per_chunk(width: int) -> int:
    return max(1, _CHUNK_ELEMENTS // max(1, width))


def _local_max(x: torch.Tensor, temperature: float, dtype: torch.dtype) -> torch.Tensor:
    """max_v x/T per row, (N, V_r) -> (N,) ``dtype``.

    The max is exact in the input dtype, and x ↦ x/T rounds monotonically, so this equals the
    max of the upcast, tempered logits without materialising them. A row that is -inf on this
    shard gives -inf.
    """
    return x.amax(dim=-1).to(dtype) / temperature


def _safe_shift(m: torch.Tensor) -> torch.Tensor:
    """Global max used as the shift: -inf (no mass anywhere in the row) becomes 0."""
    return torch.where(torch.isneginf(m), torch.zeros_like(m), m)


def _local_kl_sums(
    x: torch.Tensor,
    y: torch.Tensor,
    shift_x: torch.Tensor,
    shift_y: torch.Tensor,
    temperature: float,
    dtype: torch.dtype,
) -> torch.Tensor:
    """(s_x, s_y, A) of one shard against the global shifts, (N, 3) ``dtype``.

    With u = x/T − M_x and w = y/T − M_y: s_x = Σ e^u, s_y = Σ e^w, A = Σ_{e^u > 0} e^u (u − w)
    (0·log 0 = 0; +inf where the policy has mass and the reference is -inf).
    """
    n, width = x.shape
    out = torch.empty(n, 3, dtype=dtype, device=x.device)
    rows = _rows_per_chunk(width)
    zero = torch.zeros((), dtype=dtype, device=x.device)
    for s in range(0, n, rows):
        e = min(n, s + rows)
        u = x[s:e].to(dtype) / temperature - shift_x[s:e].unsqueeze(-1)  # (rows, V_r)
        w = y[s:e].to(dtype) / temperature - shift_y[s:e].unsqueeze(-1)  # (rows, V_r)
        eu = u.exp()
        out[s:e, 0] = eu.sum(-1)
        out[s:e, 1] = w.exp().sum(-1)
        out[s:e, 2] = torch.where(eu > 0, eu * (u - w), zero).sum(-1)
    return out


def _local_kl_grads(
    x: torch.Tensor,
    y: torch.Tensor,
    lse_x: torch.Tensor,
    lse_y: torch.Tensor,
    kl: torch.Tensor,
    g: torch.Tensor,
    temperature: float,
    need_x: bool,
    need_y: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Gradients of one shard from the *global* LSEs and KL, with no communication.

    grad_x = p·((log p − log q) − KL)·g and grad_y = (q − p)·g, with g = grad_kl / T per row
    (N,), 0 on rows that must get no gradient. Returned in the inputs' dtypes, (N, V_r).
    """
    n, width = x.shape
    dtype = kl.dtype
    grad_x = torch.empty_like(x) if need_x else None
    grad_y = torch.empty_like(y) if need_y else None
    zero = torch.zeros((), dtype=dtype, device=x.device)
    rows = _rows_per_chunk(width)
    for s in range(0, n, rows):
        e = min(n, s + rows)
        gs = g[s:e].unsqueeze(-1)  # (rows, 1)
        logp = x[s:e].to(dtype) / temperature - lse_x[s:e].unsqueeze(-1)  # (rows, V_r)
        logq = y[s:e].to(dtype) / temperature - lse_y[s:e].unsqueeze(-1)  # (rows, V_r)
        p = logp.exp()
        if need_x:
            d = torch.where(p > 0, p * ((logp - logq) - kl[s:e].unsqueeze(-1)), zero)
            grad_x[s:e] = torch.where(gs != 0, d * gs, zero)
        if need_y:
            grad_y[s:e] = torch.where(gs != 0, (logq.exp() - p) * gs, zero)
    return grad_x, grad_y


def _local_token_sums(
    x: torch.Tensor,
    tokens: torch.Tensor,
    shift: torch.Tensor,
    vocab_start: int,
    temperature: float,
    dtype: torch.dtype,
) -> torch.Tensor:
    """(s, target) of one shard, (N, 2) ``dtype``: s = Σ e^(x/T − M), target = x[token]/T on the
    rank that owns the token and 0 elsewhere (so a SUM over ranks gives the target logit)."""
    n, width = x.shape
    out = torch.empty(n, 2, dtype=dtype, device=x.device)
    rows = _rows_per_chunk(width)
    for s in range(0, n, rows):
        e = min(n, s + rows)
        out[s:e, 0] = (x[s:e].to(dtype) / temperature - shift[s:e].unsqueeze(-1)).exp().sum(-1)
    local = tokens - vocab_start  # (N,)
    owned = (local >= 0) & (local < width)
    picked = x.gather(-1, local.clamp(0, width - 1).unsqueeze(-1)).squeeze(-1)  # (N,)
    zero = torch.zeros((), dtype=dtype, device=x.device)
    out[:, 1] = torch.where(owned, picked.to(dtype) / temperature, zero)
    return out


def _local_token_grads(
    x: torch.Tensor,
    tokens: torch.Tensor,
    lse: torch.Tensor,
    g: torch.Tensor,
    vocab_start: int,
    temperature: float,
) -> torch.Tensor:
    """(onehot(token) − p)·g on this shard, (N, V_r) in x's dtype; g = grad / T per row (N,)."""
    n, width = x.shape
    dtype = lse.dtype
    grad_x = torch.empty_like(x)
    local = tokens - vocab_start  # (N,)
    owned = (local >= 0) & (local < width)
    idx = local.clamp(0, width - 1)
    g_owned = torch.where(owned, g, torch.zeros((), dtype=dtype, device=g.device))
    rows = _rows_per_chunk(width)
    for s in range(0, n, rows):
        e = min(n, s + rows)
        p = (x[s:e].to(dtype) / temperature - lse[s:e].unsqueeze(-1)).exp()  # (rows, V_r)
        grad = -p * g[s:e].unsqueeze(-1)
        grad.scatter_add_(-1, idx[s:e].unsqueeze(-1), g_owned[s:e].unsqueeze(-1))
        grad_x[s:e] = grad
    return grad_x
