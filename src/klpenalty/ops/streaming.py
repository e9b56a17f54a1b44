"""Portable backend (any device): the engine's tile loop in eager PyTorch ops.

The (N, V) logits are walked in tiles of ``rows × cols`` elements (a few MiB, cache-sized).
Each tile gives the per-row state of :mod:`.engine`, the states of a row's vocabulary tiles are
merged, and the merged state is finalized; the backward recomputes each tile from the saved
logits and the (N, 6) stats and writes the gradient straight into a buffer of the input's dtype.
Temporaries are tile-sized buffers reused for every tile: nothing of size (N, V) is allocated.

On CPU the tile loop runs on one intra-op thread (see :func:`_cpu_threads`); on accelerators it
makes no host synchronisation (the careful 0·log 0 arithmetic always runs there).

The public entry points are the custom ops ``torch.ops.klpenalty.streaming_full_kl``,
``torch.ops.klpenalty.streaming_token_logprobs`` and ``torch.ops.klpenalty.streaming_entropy``
(with fake implementations and autograd from :mod:`.autograd`), wrapped by :func:`full_kl`,
:func:`token_logprobs` and :func:`entropy` on (..., V) tensors.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch import Tensor

from .. import _validation as v
from .._validation import compute_dtype
from . import autograd as ag
from .engine import (
    EntropyState,
    KLState,
    LSEState,
    Workspace,
    entropy_finalize,
    entropy_grad_tile,
    entropy_merge,
    entropy_partial,
    finite_or_zero,
    kl_finalize,
    kl_grad_tile,
    kl_merge,
    kl_partial,
    lse_grad_tile,
    lse_merge,
    lse_partial,
)

__all__ = [
    "full_kl",
    "token_logprobs",
    "entropy",
    "tile_shape",
    "kl_state",
    "lse_state",
    "entropy_state",
    "TILE_ELEMENTS",
]

# Elements per tile: 2**18 = 1 MiB of float32 per buffer; three buffers live at once. That
# stays in L2/L3 and is ~1-3% of one input at the sizes this library is for. 2**17-2**19
# measured within noise of each other; 2**16 pays more per-tile overhead.
TILE_ELEMENTS = 1 << 18


def tile_shape(
    n_rows: int,
    vocab: int,
    tile_elements: int = TILE_ELEMENTS,
    chunk_rows: int | None = None,
    vocab_chunk: int | None = None,
) -> tuple[int, int]:
    """(rows, cols) of one tile for an (n_rows, vocab) problem.

    By default a tile holds whole rows when a row fits in ``tile_elements``, else one row split
    into vocabulary chunks of ``tile_elements``. ``chunk_rows``/``vocab_chunk`` override either
    (values larger than the problem are clipped; 0 or None = default).
    """
    cols = vocab_chunk if vocab_chunk else min(vocab, tile_elements)
    cols = max(1, min(int(cols), vocab))
    rows = chunk_rows if chunk_rows else tile_elements // cols
    rows = max(1, min(int(rows), max(1, n_rows)))
    return rows, cols


def _tiles(n: int, v: int, rows: int, cols: int):
    for r0 in range(0, n, rows):
        yield r0, min(n, r0 + rows), [(c0, min(v, c0 + cols)) for c0 in range(0, v, cols)]


# Intra-op threads of the CPU tile loop. A tile is ~10 small ATen ops; with several threads each
# op is a parallel region whose barrier waits for the slowest thread, and on a busy machine (the
# normal case) a descheduled thread stalls every op: measured 6.4 s instead of 0.1 s on two
# cores under load (benchmarks/README.md). One thread costs at most 2× on two idle cores.
# 0 = leave torch's setting (the benchmark's "streaming-mt" row).
CPU_TILE_THREADS = 1


@contextlib.contextmanager
def _cpu_threads(device: torch.device):
    """Run a CPU tile loop on :data:`CPU_TILE_THREADS` intra-op threads, then restore."""
    want = CPU_TILE_THREADS
    before = torch.get_num_threads()
    if device.type != "cpu" or not want or before == want:
        yield
        return
    torch.set_num_threads(want)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _host_checks(device: torch.device) -> bool:
    """Whether per-tile host-side decisions are free (no device synchronisation)."""
    return device.type == "cpu"


# ------------------------------------------------------------------------------ tile loops
def kl_state(
    x: Tensor, y: Tensor, temperature: float, rows: int, cols: int
) -> tuple[KLState, Tensor]:
    """Per-row KL state of (N, C) logits over all their columns, and (N,) careful flags."""
    n, c = x.shape
    dtype = compute_dtype(x, y)
    careful_mode = None if _host_checks(x.device) else True
    ws = Workspace(rows, cols, dtype, x.device)
    out = KLState(*(torch.empty(n, dtype=dtype, device=x.device) for _ in range(5)))
    flags = torch.zeros(n, dtype=torch.bool, device=x.device)
    for r0, r1, col_ranges in _tiles(n, c, rows, cols):
        state = None
        for c0, c1 in col_ranges:
            part, bad = kl_partial(x[r0:r1, c0:c1], y[r0:r1, c0:c1], temperature, ws, careful_mode)
            state = part if state is None else kl_merge(state, part, temperature)
            if bad is not None:
                flags[r0:r1] |= bad
        for dst, src in zip(out, state):
            dst[r0:r1] = src
    return out, flags


def kl_grads(
    g: Tensor,
    x: Tensor,
    y: Tensor,
    stats: Tensor,
    temperature: float,
    need_x: bool,
    need_y: bool,
    rows: int,
    cols: int,
) -> tuple[Tensor | None, Tensor | None]:
    """Gradients of Σ g·KL for (N, C) logits from the (N, 6) stats; g (N,) compute dtype."""
    n, c = x.shape
    grad_x = torch.empty_like(x, memory_format=torch.contiguous_format) if need_x else None
    grad_y = torch.empty_like(y, memory_format=torch.contiguous_format) if need_y else None
    ws = Workspace(rows, cols, stats.dtype, x.device)
    careful_rows = stats[:, 5] != 0
    host = _host_checks(x.device)
    any_careful = bool(careful_rows.any()) if host else True
    for r0, r1, col_ranges in _tiles(n, c, rows, cols):
        careful = any_careful and (not host or bool(careful_rows[r0:r1].any()))
        for c0, c1 in col_ranges:
            kl_grad_tile(
                x[r0:r1, c0:c1],
                y[r0:r1, c0:c1],
                stats[r0:r1],
                g[r0:r1],
                temperature,
                ws,
                grad_x[r0:r1, c0:c1] if need_x else None,
                grad_y[r0:r1, c0:c1] if need_y else None,
                careful,
            )
    return grad_x, grad_y


def _row_states(x: Tensor, rows: int, cols: int, cls, partial, merge):
    """Per-row ``cls`` state of (N, C) logits over all their columns: ``partial(tile, ws)`` per
    tile, ``merge(a, b)`` across a row's tiles."""
    n, c = x.shape
    dtype = compute_dtype(x)
    ws = Workspace(rows, cols, dtype, x.device)
    out = cls(*(torch.empty(n, dtype=dtype, device=x.device) for _ in cls._fields))
    for r0, r1, col_ranges in _tiles(n, c, rows, cols):
        state = None
        for c0, c1 in col_ranges:
            part = partial(x[r0:r1, c0:c1], ws)
            state = part if state is None else merge(state, part)
        for dst, src in zip(out, state):
            dst[r0:r1] = src
    return out


def lse_state(x: Tensor, temperature: float, rows: int, cols: int) -> LSEState:
    """Per-row log-sum-exp state of (N, C) logits over all their columns."""
    return _row_states(
        x,
        rows,
        cols,
        LSEState,
        lambda tile, ws: lse_partial(tile, temperature, ws),
        lambda a, b: lse_merge(a, b, temperature),
    )


def entropy_state(x: Tensor, temperature: float, rows: int, cols: int) -> EntropyState:
    """Per-row entropy state of (N, C) logits over all their columns."""
    careful = None if _host_checks(x.device) else True
    return _row_states(
        x,
        rows,
        cols,
        EntropyState,
        lambda tile, ws: entropy_partial(tile, temperature, ws, careful),
        lambda a, b: entropy_merge(a, b, temperature),
    )


def _grad_tiles(x: Tensor, dtype: torch.dtype, rows: int, cols: int, tile_grad) -> Tensor:
    """A gradient buffer like (N, C) ``x``, filled by ``tile_grad(r0, r1, c0, c1, ws, out)``."""
    n, c = x.shape
    grad_x = torch.empty_like(x, memory_format=torch.contiguous_format)
    ws = Workspace(rows, cols, dtype, x.device)
    for r0, r1, col_ranges in _tiles(n, c, rows, cols):
        for c0, c1 in col_ranges:
            tile_grad(r0, r1, c0, c1, ws, grad_x[r0:r1, c0:c1])
    return grad_x


def lse_grads(
    g: Tensor, x: Tensor, shift: Tensor, log_s: Tensor, temperature: float, rows: int, cols: int
) -> Tensor:
    """−π·g/T for (N, C) logits, without the token term; g, shift, log_s (N,)."""

    def tile_grad(r0, r1, c0, c1, ws, out):
        lse_grad_tile(
            x[r0:r1, c0:c1], shift[r0:r1], log_s[r0:r1], g[r0:r1], temperature, ws, out
        )

    return _grad_tiles(x, g.dtype, rows, cols, tile_grad)


def entropy_grads(
    g: Tensor, x: Tensor, stats: Tensor, temperature: float, rows: int, cols: int
) -> Tensor:
    """−π·(u − E_π[u])·g/T for (N, C) logits from the (N, 3) stats; g (N,) compute dtype."""
    careful = None if _host_checks(x.device) else True

    def tile_grad(r0, r1, c0, c1, ws, out):
        entropy_grad_tile(
            x[r0:r1, c0:c1], stats[r0:r1], g[r0:r1], temperature, ws, out, careful
        )

    return _grad_tiles(x, g.dtype, rows, cols, tile_grad)


# ------------------------------------------------------------------------------ custom ops
def _rows_and_tiles(x: Tensor, tile_rows: int, tile_cols: int) -> tuple[Tensor, int, int]:
    """(..., V) logits as (N, V) rows, and the (rows, cols) of a tile (0 = the default)."""
    vocab = x.shape[-1]
    xf = x.reshape(-1, vocab)
    return (xf, *tile_shape(xf.shape[0], vocab, TILE_ELEMENTS, tile_rows, tile_cols))


def masked_checked(
    out: Tensor, stats: Tensor, mask: Tensor | None, check: bool, named: dict[str, Tensor]
) -> tuple[Tensor, Tensor]:
    """(N,) result and (N, k) stats → 0 at masked positions, the NaN check, (...) shapes."""
    if mask is not None:
        out = out.masked_fill(~mask.reshape(-1), 0.0)
    if check:
        v.raise_if_nan(out, named)
    leading = next(iter(named.values())).shape[:-1]
    return out.reshape(leading), stats.reshape(*leading, stats.shape[-1])


@torch.library.custom_op("klpenalty::streaming_full_kl", mutates_args=())
def _full_kl_op(
    x: Tensor,
    y: Tensor,
    mask: Optional[Tensor],
    temperature: float,
    check: bool,
    tile_rows: int,
    tile_cols: int,
) -> tuple[Tensor, Tensor]:
    """(..., V) logits → KL (...) and backward stats (..., 6). See :mod:`.engine`."""
    xf, rows, cols = _rows_and_tiles(x, tile_rows, tile_cols)  # (N, V)
    yf = y.reshape(xf.shape)  # (N, V)
    with _cpu_threads(x.device):
        state, careful = kl_state(xf, yf, temperature, rows, cols)
        kl, stats = kl_finalize(state, careful)
    return masked_checked(kl, stats, mask, check, {"policy_logits": x, "ref_logits": y})


@torch.library.custom_op("klpenalty::streaming_full_kl_backward", mutates_args=())
def _full_kl_backward_op(
    grad: Tensor,
    x: Tensor,
    y: Tensor,
    stats: Tensor,
    mask: Optional[Tensor],
    temperature: float,
    need_x: bool,
    need_y: bool,
    tile_rows: int,
    tile_cols: int,
) -> tuple[Tensor, Tensor]:
    """Gradients (..., V) w.r.t. x and y (an empty tensor for one that is not needed)."""
    xf, rows, cols = _rows_and_tiles(x, tile_rows, tile_cols)  # (N, V)
    yf = y.reshape(xf.shape)  # (N, V)
    g = ag.masked_grad(grad, mask, stats.dtype).reshape(-1)  # (N,)
    with _cpu_threads(x.device):
        gx, gy = kl_grads(g, xf, yf, stats.reshape(-1, 6), temperature, need_x, need_y, rows, cols)
    return (
        gx.view(x.shape) if need_x else x.new_empty(0),
        gy.view(y.shape) if need_y else y.new_empty(0),
    )


@torch.library.custom_op("klpenalty::streaming_token_logprobs", mutates_args=())
def _token_logprobs_op(
    x: Tensor,
    tokens: Tensor,
    temperature: float,
    ignore_index: int,
    check: bool,
    tile_rows: int,
    tile_cols: int,
) -> tuple[Tensor, Tensor]:
    """(..., V) logits, (...) tokens → log π(token) (...) and stats (..., 3)."""
    vocab = x.shape[-1]
    if check:
        v.check_token_range(tokens, vocab, ignore_index)
    xf = x.reshape(-1, vocab)  # (N, V)
    tok, ignored = ag.safe_tokens(tokens.reshape(-1), ignore_index)  # (N,), (N,)
    rows, cols = tile_shape(xf.shape[0], vocab, TILE_ELEMENTS, tile_rows, tile_cols)
    with _cpu_threads(x.device):
        state = lse_state(xf, temperature, rows, cols)
    return lse_finish(x, xf, tok, ignored, state, temperature, check)


def lse_finish(
    x: Tensor,
    xf: Tensor,
    tok: Tensor,
    ignored: Tensor,
    state: LSEState,
    temperature: float,
    check: bool,
) -> tuple[Tensor, Tensor]:
    """(log π(token) (...), stats (..., 3)) from the merged log-sum-exp state (N,) of the rows
    ``xf`` (N, V) of ``x`` (..., V); ``tok``, ``ignored`` (N,) from :func:`.autograd.safe_tokens`.
    Shared by the backends whose ops compute the state in their own loop."""
    leading = x.shape[:-1]
    shift, log_s = finite_or_zero(state.m), torch.log(state.s)
    picked = xf.gather(-1, tok.unsqueeze(-1)).squeeze(-1).to(log_s.dtype)  # (N,)
    # (x_t − m)/T − log s: the shifted difference is exact for nearby logits, even at ±1e4.
    # An all −inf row (s = 0) defines no distribution: NaN.
    out = (picked - shift) / temperature - log_s
    out = out.masked_fill(state.s == 0, float("nan")).masked_fill(ignored, 0.0)
    if check:
        v.raise_if_nan(out, {"logits": x})
    stats = torch.stack([shift, finite_or_zero(log_s), out], dim=-1)  # (N, 3)
    return out.reshape(leading), stats.reshape(*leading, 3)


@torch.library.custom_op("klpenalty::streaming_token_logprobs_backward", mutates_args=())
def _token_logprobs_backward_op(
    grad: Tensor,
    x: Tensor,
    tokens: Tensor,
    stats: Tensor,
    temperature: float,
    ignore_index: int,
    tile_rows: int,
    tile_cols: int,
) -> Tensor:
    """Gradient (..., V) of Σ grad·log π(token): (onehot(token) − π)·grad/T."""
    vocab = x.shape[-1]
    xf = x.reshape(-1, vocab)  # (N, V)
    tok, ignored = ag.safe_tokens(tokens.reshape(-1), ignore_index)
    st = stats.reshape(-1, 3)  # (N, 3)
    g = grad.reshape(-1).to(st.dtype).masked_fill(ignored, 0.0)  # (N,)
    rows, cols = tile_shape(xf.shape[0], vocab, TILE_ELEMENTS, tile_rows, tile_cols)
    with _cpu_threads(x.device):
        gx = lse_grads(g, xf, st[:, 0], st[:, 1], temperature, rows, cols)
    # at the token: (1 − π_t)·g/T = −expm1(log π_t)·g/T, exact for π_t near 1
    at_token = -torch.expm1(st[:, 2]) * g / temperature
    gx.scatter_(-1, tok.unsqueeze(-1), at_token.unsqueeze(-1).to(gx.dtype))
    return gx.view(x.shape)


@torch.library.custom_op("klpenalty::streaming_entropy", mutates_args=())
def _entropy_op(
    x: Tensor,
    mask: Optional[Tensor],
    temperature: float,
    check: bool,
    tile_rows: int,
    tile_cols: int,
) -> tuple[Tensor, Tensor]:
    """(..., V) logits → H(π) (...) and backward stats (..., 3). See :mod:`.engine`."""
    xf, rows, cols = _rows_and_tiles(x, tile_rows, tile_cols)  # (N, V)
    with _cpu_threads(x.device):
        h, stats = entropy_finalize(entropy_state(xf, temperature, rows, cols))
    return masked_checked(h, stats, mask, check, {"logits": x})


@torch.library.custom_op("klpenalty::streaming_entropy_backward", mutates_args=())
def _entropy_backward_op(
    grad: Tensor,
    x: Tensor,
    stats: Tensor,
    mask: Optional[Tensor],
    temperature: float,
    tile_rows: int,
    tile_cols: int,
) -> Tensor:
    """Gradient (..., V) of Σ grad·H(π): −π·(u − E_π[u])·grad/T, 0 where π = 0 or masked."""
    xf, rows, cols = _rows_and_tiles(x, tile_rows, tile_cols)  # (N, V)
    g = ag.masked_grad(grad, mask, stats.dtype).reshape(-1)  # (N,)
    with _cpu_threads(x.device):
        gx = entropy_grads(g, xf, stats.reshape(-1, 3), temperature, rows, cols)
    return gx.view(x.shape)


ag.register_full_kl(_full_kl_op, _full_kl_backward_op)
ag.register_token_logprobs(_token_logprobs_op, _token_logprobs_backward_op)
ag.register_entropy(_entropy_op, _entropy_backward_op)


# ------------------------------------------------------------------------------ entry points
def full_kl(
    x: Tensor,
    y: Tensor,
    mask: Tensor | None,
    temperature: float,
    *,
    check: bool = False,
    chunk_rows: int | None = None,
    vocab_chunk: int | None = None,
    tile_elements: int = TILE_ELEMENTS,
) -> Tensor:
    """Exact KL(softmax(x/T) ‖ softmax(y/T)) per position, streamed over cache-sized tiles.

    Unchecked internal entry point (the public :func:`klpenalty.full_kl` validates first).

    Args:
        x: (..., V) float16/bfloat16/float32/float64 policy logits.
        y: (..., V) same shape, reference logits.
        mask: (...) bool or None; False positions give 0 and zero gradient whatever they hold.
        temperature: > 0, divides both logits.
        check: raise ValueError naming the input when a counted position's KL is NaN.
        chunk_rows, vocab_chunk: override the tile's rows / columns.
        tile_elements: target elements per tile (used when the overrides are not given).

    Returns:
        (...) float32 (float64 if either input is float64), differentiable (also twice).
    """
    rows, cols = _tile_args(x, tile_elements, chunk_rows, vocab_chunk)
    kl, _ = _full_kl_op(x, y, mask, float(temperature), bool(check), rows, cols)
    return kl


def token_logprobs(
    x: Tensor,
    tokens: Tensor,
    temperature: float,
    *,
    ignore_index: int = -100,
    check: bool = False,
    chunk_rows: int | None = None,
    vocab_chunk: int | None = None,
    tile_elements: int = TILE_ELEMENTS,
) -> Tensor:
    """log softmax(x/T)[token] per position, streamed over cache-sized tiles (unchecked).

    Args:
        x: (..., V) float logits.  tokens: (...) int64 ids in [0, V) or ``ignore_index``.
        temperature: > 0.
        ignore_index: positions holding it give 0 and zero gradient.
        check, chunk_rows, vocab_chunk, tile_elements: as in :func:`full_kl` (``check`` also
            checks the token range).

    Returns:
        (...) float32 (float64 for float64 logits), differentiable with respect to ``x``.
    """
    rows, cols = _tile_args(x, tile_elements, chunk_rows, vocab_chunk)
    out, _ = _token_logprobs_op(
        x, tokens, float(temperature), int(ignore_index), bool(check), rows, cols
    )
    return out


def entropy(
    x: Tensor,
    mask: Tensor | None,
    temperature: float,
    *,
    check: bool = False,
    chunk_rows: int | None = None,
    vocab_chunk: int | None = None,
    tile_elements: int = TILE_ELEMENTS,
) -> Tensor:
    """Policy entropy H(softmax(x/T)) per position, streamed over cache-sized tiles (unchecked).

    Args:
        x: (..., V) float logits.
        mask: (...) bool or None; False positions give 0 and zero gradient whatever they hold.
        temperature: > 0.
        check: raise ValueError naming ``logits`` when a counted position's entropy is NaN.
        chunk_rows, vocab_chunk, tile_elements: as in :func:`full_kl`.

    Returns:
        (...) float32 (float64 for float64 logits), ≥ 0, differentiable (also twice).
    """
    rows, cols = _tile_args(x, tile_elements, chunk_rows, vocab_chunk)
    h, _ = _entropy_op(x, mask, float(temperature), bool(check), rows, cols)
    return h


def _tile_args(x: Tensor, tile_elements: int, chunk_rows, vocab_chunk) -> tuple[int, int]:
    """(rows, cols) passed to the ops: 0 = the op's default for that dimension."""
    if tile_elements == TILE_ELEMENTS:
        return int(chunk_rows or 0), int(vocab_chunk or 0)
    vocab = x.shape[-1]
    n = x.numel() // vocab if vocab else 0
    return tile_shape(n, vocab, tile_elements, chunk_rows, vocab_chunk)
