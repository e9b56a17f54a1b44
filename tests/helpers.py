"""Helpers shared by the tests (the distributed worker, a subprocess outside pytest, imports
them too); the tolerance table is ``tests/tolerances.py``, re-exported here.

:data:`views` gives each backend of the registry the single-output entry points the tests call
(``views.views.streaming.full_kl(x, y, mask, temperature, ...)``): one column of the backend's
forward op, with the streaming tile options of the tests.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import Tensor

from klpenalty.ops import dispatch, streaming
from klpenalty.ops.contract import OUT_ENTROPY, OUT_KL, OUT_LOGP, Want

from .triton_env import triton_interpreter_env
from .tolerances import (
    DTYPES,
    GRAD_REL_TOL,
    GRAD_TOLERANCES,
    TOLERANCES,
    VALUE_TOL,
    grad_tol,
    tol,
)

__all__ = [
    "DTYPES",
    "GRAD_REL_TOL",
    "GRAD_TOLERANCES",
    "TOLERANCES",
    "VALUE_TOL",
    "grad_tol",
    "tol",
    "make_logits",
    "triton_interpreter_env",
    "backend_views",
    "views",
    "transformed",
]


def make_logits(
    shape: tuple[int, ...], dtype: torch.dtype = torch.float32, *, seed: int = 0, scale: float = 3.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """A policy/reference logits pair: the reference is the policy plus noise (KL ~ 0.1-2)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64) * scale
    y = x + torch.randn(shape, generator=g, dtype=torch.float64) * (scale / 2)
    return x.to(dtype), y.to(dtype)



def _tiles(x: Tensor, chunk_rows, vocab_chunk, tile_elements) -> tuple[int, int]:
    """(tile_rows, tile_cols) of the ops from the streaming tile options (0 = default)."""
    if tile_elements is None:
        return int(chunk_rows or 0), int(vocab_chunk or 0)
    vocab = x.shape[-1]
    n = x.numel() // vocab if vocab else 0
    return streaming.token_stats.tile_shape(n, vocab, tile_elements, chunk_rows, vocab_chunk)


def backend_views(name: str) -> SimpleNamespace:
    """``token_stats``, ``full_kl``, ``token_logprobs`` and ``entropy`` of backend ``name`` on
    (..., V) tensors (unchecked inputs), through :func:`klpenalty.ops.dispatch.token_stats`.

    The backend is resolved for the tensors' device at each call (the native kernel falls back
    to streaming where it cannot be built; Triton raises where it cannot run).
    """

    def token_stats(x, y, tokens, mask, keep, tau, temperature, *, ignore_index=-100, want,
                    check=False, chunk_rows=None, vocab_chunk=None, tile_elements=None):
        rows, cols = _tiles(x, chunk_rows, vocab_chunk, tile_elements)
        backend = dispatch.get_backend(name, x.device)
        return dispatch.token_stats(
            backend, x, y, tokens, mask, keep, tau, temperature, ignore_index=ignore_index,
            want=want, check=check, tile_rows=rows, tile_cols=cols,
        )

    def full_kl(x, y, mask, temperature, *, check=False, **tiles):
        out = token_stats(x, y, None, mask, None, None, temperature, want=Want.KL, check=check,
                          **tiles)
        return out[..., OUT_KL].contiguous()

    def token_logprobs(x, tokens, temperature, *, ignore_index=-100, check=False, **tiles):
        out = token_stats(x, None, tokens, None, None, None, temperature,
                          ignore_index=ignore_index, want=Want.LOGP, check=check, **tiles)
        return out[..., OUT_LOGP].contiguous()

    def entropy(x, mask, temperature, *, check=False, **tiles):
        out = token_stats(x, None, None, mask, None, None, temperature, want=Want.ENTROPY,
                          check=check, **tiles)
        return out[..., OUT_ENTROPY].contiguous()

    return SimpleNamespace(
        token_stats=token_stats, full_kl=full_kl, token_logprobs=token_logprobs, entropy=entropy
    )


views = SimpleNamespace(**{name: backend_views(name) for name in dispatch.REGISTRY})


def transformed(h: Tensor, w: Tensor, b: Tensor | None, scale: float, cap) -> Tensor:
    """The plain path's LM-head logits, with differentiable torch ops: ``F.linear`` in h's
    dtype, then, with a scale or a soft-cap, the GEMM's output upcast to float32 (float64 for
    float64 inputs) and scale·z, cap·tanh(z/cap) in that dtype (docs/numerics.md, "the logit
    transform")."""
    z = F.linear(h, w, b)
    if scale == 1.0 and cap is None:
        return z
    z = z.to(torch.float64 if z.dtype == torch.float64 else torch.float32)
    if scale != 1.0:
        z = z * scale
    if cap is not None:
        z = torch.tanh(z / cap) * cap
    return z
