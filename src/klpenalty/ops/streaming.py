"""Portable backend (any device): the engine's tile loop in eager PyTorch ops.

The (N, V) logits are walked in tiles of ``rows × cols`` elements (a few MiB, cache-sized).
Each tile gives the per-row state of :mod:`.engine`, the states of a row's vocabulary tiles are
merged, and the merged state is finalized; the backward recomputes each tile from the saved
logits and the (N, 6) stats and writes the gradient straight into a buffer of the input's dtype.
Temporaries are tile-sized buffers reused for every tile: nothing of size (N, V) is allocated.

On CPU the tile loop runs on one intra-op thread (see :func:`_cpu_threads`); on accelerators it
makes no host synchronisation (the careful 0·log 0 arithmetic always runs there).

The backend is one custom op pair, the one-pass ``torch.ops.klpenalty.streaming_token_stats``
(with its fake implementation and autograd from :mod:`.autograd`), wrapped by
:func:`token_stats` on (..., V) tensors; :func:`full_kl`, :func:`token_logprobs` and
:func:`entropy` are its single-column views (:mod:`.views`). :func:`kl_state`, :func:`kl_grads`,
:func:`lse_state` and :func:`lse_grads` are the tile loops of the vocabulary-parallel path.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch import Tensor

from .. import _validation as v
from .._validation import compute_dtype
from . import autograd as ag
from . import views
from .engine import (
    KLState,
    LSEState,
    Workspace,
    finite_or_zero,
    kl_grad_tile,
    kl_merge,
    kl_partial,
    lse_grad_tile,
    lse_merge,
    lse_partial,
    StatsState,
    stats_finalize,
    stats_grad_tile,
    stats_merge,
    stats_partial,
    stats_token_grads,
)

__all__ = [
    "full_kl",
    "token_logprobs",
    "entropy",
    "token_stats",
    "token_stats_state",
    "token_stats_upstream",
    "tile_shape",
    "kl_state",
    "lse_state",
    "kl_grads",
    "lse_grads",
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



# ------------------------------------------------------------------------------ custom ops
def _rows_and_tiles(x: Tensor, tile_rows: int, tile_cols: int) -> tuple[Tensor, int, int]:
    """(..., V) logits as (N, V) rows, and the (rows, cols) of a tile (0 = the default)."""
    vocab = x.shape[-1]
    xf = x.reshape(-1, vocab)
    return (xf, *tile_shape(xf.shape[0], vocab, TILE_ELEMENTS, tile_rows, tile_cols))



def support_tile(
    xt: Tensor, keep_t: Tensor | None, tau_t: Tensor | None, ws: Workspace
) -> Tensor:
    """The (r, c) tile ``xt`` with −inf off the support, in ``ws.dtype`` (``xt`` itself when
    there is no support): kept(v) = keep[v] and x_v ≥ tau, compared in tau's dtype, exactly
    as :func:`.autograd.kept_logits` does on the whole tensor. Never an (N, V) copy."""
    if keep_t is None and tau_t is None:
        return xt
    r, c = xt.shape
    xk = ws.get("xk", r, c).copy_(xt)
    if tau_t is not None:
        cmp = xk if tau_t.dtype == xk.dtype else xt.to(tau_t.dtype)
        xk.masked_fill_(torch.ge(cmp, tau_t.unsqueeze(-1)).logical_not_(), float("-inf"))
    if keep_t is not None:
        xk.masked_fill_(keep_t.logical_not(), float("-inf"))
    return xk


def _support_rows(keep: Tensor | None, tau: Tensor | None, xf: Tensor):
    """keep as (N, V) rows and tau as (N,), or None."""
    return (
        None if keep is None else keep.reshape(xf.shape),
        None if tau is None else tau.reshape(-1),
    )


def _slice(t: Tensor | None, r0: int, r1: int, c0: int | None = None, c1: int | None = None):
    if t is None:
        return None
    return t[r0:r1] if c0 is None else t[r0:r1, c0:c1]


def token_stats_state(
    xf: Tensor,
    yf: Tensor | None,
    keep: Tensor | None,
    tau: Tensor | None,
    temperature: float,
    dtype: torch.dtype,
    rows: int,
    cols: int,
    *,
    kl: bool,
    entropy: bool,
) -> tuple[StatsState, Tensor | None]:
    """Per-row :class:`.engine.StatsState` of (N, V) logits over the support, and (N,) careful
    flags (or None): one read of every tile of ``xf`` (and ``yf``) for all the sums.

    ``keep`` (N, V) bool or None, ``tau`` (N,) or None: the support, applied per tile.
    """
    n, c = xf.shape
    careful_mode = None if _host_checks(xf.device) else True
    ws = Workspace(rows, cols, dtype, xf.device)
    if n == 0:
        return stats_partial(
            support_tile(xf, keep, tau, ws), yf, temperature, ws, careful_mode,
            kl=kl, entropy=entropy,
        )
    out = flags = None
    for r0, r1, col_ranges in _tiles(n, c, rows, cols):
        state = None
        for c0, c1 in col_ranges:
            xt = support_tile(xf[r0:r1, c0:c1], _slice(keep, r0, r1, c0, c1), _slice(tau, r0, r1), ws)
            part, bad = stats_partial(
                xt, _slice(yf, r0, r1, c0, c1), temperature, ws, careful_mode,
                kl=kl, entropy=entropy,
            )
            state = part if state is None else stats_merge(state, part, temperature)
            if bad is not None:
                if flags is None:
                    flags = torch.zeros(n, dtype=torch.bool, device=xf.device)
                flags[r0:r1] |= bad
        if out is None:
            out = StatsState(
                *(None if f is None else torch.empty(n, dtype=dtype, device=xf.device) for f in state)
            )
        for dst, src in zip(out, state):
            if dst is not None:
                dst[r0:r1] = src
    return out, flags


def _token_logits(
    xf: Tensor, tok: Tensor, keep: Tensor | None, tau: Tensor | None, dtype: torch.dtype
) -> Tensor:
    """(N,) policy logit at each token in ``dtype``, −inf where the token is off the support."""
    x_t = xf.gather(-1, tok.unsqueeze(-1)).squeeze(-1)
    kept = None
    if tau is not None:
        kept = x_t.to(tau.dtype) >= tau
    if keep is not None:
        at = keep.gather(-1, tok.unsqueeze(-1)).squeeze(-1)
        kept = at if kept is None else kept & at
    x_t = x_t.to(dtype)
    return x_t if kept is None else x_t.masked_fill(~kept, float("-inf"))


def _token_logp(logit_t: Tensor, m: Tensor, s: Tensor, temperature: float) -> Tensor:
    """log-prob (N,) of the token: (x_t − m)/T − log s, NaN for a row without mass (s = 0)."""
    out = (logit_t - finite_or_zero(m)) / temperature - torch.log(s)
    return out.masked_fill(s == 0, float("nan"))


def token_stats_upstream(
    grad: Tensor,
    mask: Tensor | None,
    tokens: Tensor | None,
    ignore_index: int,
    want: int,
    dtype: torch.dtype,
) -> Tensor:
    """The upstream gradient (..., 4) as (N, 4) in ``dtype``: 0 in the columns not in ``want``,
    on masked rows, and in the two log-prob columns at ignored tokens."""
    g = grad.reshape(-1, 4).to(dtype)
    cols = torch.tensor(
        [bool(want & bit) for bit in (ag.WANT_KL, ag.WANT_LOGP, ag.WANT_REF_LOGP, ag.WANT_ENTROPY)],
        device=g.device,
    )
    g = g.masked_fill(~cols, 0.0)
    if mask is not None:
        g = g.masked_fill(~mask.reshape(-1, 1), 0.0)
    if tokens is not None:
        ignored = (tokens.reshape(-1) == ignore_index).unsqueeze(-1)
        g = g.masked_fill(ignored & torch.tensor([False, True, True, False], device=g.device), 0.0)
    return g


def outside_support_error(bad: Tensor, tokens: Tensor) -> ValueError:
    """The error for sampled tokens off the support; ``bad`` (...) bool like ``tokens``."""
    flat = bad.reshape(-1).nonzero()
    first = tuple(int(i) for i in torch.unravel_index(flat[0, 0], bad.shape)) if bad.dim() else ()
    return ValueError(
        f"sampled token {int(tokens[first])} at position {first} is outside the support "
        f"(log-prob -inf under the truncated policy; {flat.shape[0]} position(s) in all): the "
        "support must contain the token that was sampled; build it with the sampler's own "
        "top_k/top_p/min_p and temperature, or pass the sampler's kept set"
    )


def _check_token_stats(
    out: Tensor,
    x: Tensor,
    y: Tensor | None,
    tokens: Tensor | None,
    range_bad: Tensor | None,
    outside: Tensor | None,
    want: int,
    ignore_index: int,
) -> None:
    """The checks of ``check=True`` with one host read: token range, NaN in a counted row's
    wanted outputs, sampled tokens off the support (in this order)."""
    wanted = [c for c, bit in enumerate(_WANT_BITS) if want & bit]
    nan_rows = out[:, wanted].isnan().any(-1)  # (N,); masked rows hold 0
    flags = [nan_rows.any()]
    flags += [t.any() for t in (range_bad, outside) if t is not None]
    found = torch.stack(flags).tolist()  # the one host read
    if range_bad is not None and found[1]:
        v.check_token_range(tokens, x.shape[-1], ignore_index)
    if found[0]:
        named = {"logits": x} if y is None else {"policy_logits": x, "ref_logits": y}
        v.raise_if_nan(torch.where(nan_rows, float("nan"), 0.0), named)
    if outside is not None and found[-1]:
        raise outside_support_error(outside.reshape(tokens.shape), tokens)


_WANT_BITS = (ag.WANT_KL, ag.WANT_LOGP, ag.WANT_REF_LOGP, ag.WANT_ENTROPY)


@torch.library.custom_op("klpenalty::streaming_token_stats", mutates_args=())
def _token_stats_op(
    x: Tensor,
    y: Optional[Tensor],
    tokens: Optional[Tensor],
    mask: Optional[Tensor],
    keep: Optional[Tensor],
    tau: Optional[Tensor],
    temperature: float,
    ignore_index: int,
    want: int,
    check: bool,
    tile_rows: int,
    tile_cols: int,
) -> tuple[Tensor, Tensor]:
    """(..., V) logits → out (..., 4): KL(π̃‖ρ), log π̃(t), log ρ(t), H(π̃), and stats (..., 9).

    The op contract of ``ops/autograd.py`` (docs/design.md): one read of each logit for all the
    wanted outputs; the support (``keep``, ``tau``) applied per tile.
    """
    v.check_want(want, y is not None, tokens is not None)
    xf, rows, cols = _rows_and_tiles(x, tile_rows, tile_cols)  # (N, V)
    dtype = compute_dtype(x) if y is None else compute_dtype(x, y)
    use_y = y is not None and bool(want & (ag.WANT_KL | ag.WANT_REF_LOGP))
    yf = y.reshape(xf.shape) if use_y else None  # (N, V)
    keepf, tauf = _support_rows(keep, tau, xf)
    with _cpu_threads(x.device):
        state, careful = token_stats_state(
            xf, yf, keepf, tauf, temperature, dtype, rows, cols,
            kl=bool(want & ag.WANT_KL), entropy=bool(want & ag.WANT_ENTROPY),
        )
        kl, h, stats = stats_finalize(state, careful)
    return token_stats_finish(
        x, y, xf, yf, tokens, mask, keep, tau, keepf, tauf, state, kl, h, stats, temperature,
        ignore_index, want, check,
    )


def token_stats_finish(
    x: Tensor,
    y: Optional[Tensor],
    xf: Tensor,
    yf: Optional[Tensor],
    tokens: Optional[Tensor],
    mask: Optional[Tensor],
    keep: Optional[Tensor],
    tau: Optional[Tensor],
    keep_rows: Optional[Tensor],
    tau_rows: Optional[Tensor],
    state: StatsState,
    kl: Optional[Tensor],
    h: Optional[Tensor],
    stats: Tensor,
    temperature: float,
    ignore_index: int,
    want: int,
    check: bool,
) -> tuple[Tensor, Tensor]:
    """out (..., 4) and stats (..., 9) of the token_stats op from a backend's merged row state:
    the KL and entropy columns, the sampled tokens' log-probs (a gather of N logits), masked
    rows zeroed, and every check with one host read. Shared by the backends whose ops compute
    the state in their own loop.

    Args:
        x, y: the op's (..., V) inputs; xf, yf: their (N, V) rows (yf None when not read).
        tokens, mask, keep, tau: the op's inputs; keep_rows (N, V) bool, tau_rows (N,): the
            support as rows (None where not given).
        state: the merged :class:`StatsState` (N,); kl, h, stats: :func:`stats_finalize`'s.
    """
    leading, vocab = x.shape[:-1], x.shape[-1]
    n = xf.shape[0]
    out = stats.new_zeros(n, 4)
    if kl is not None:
        out[:, ag.OUT_KL] = kl
    if h is not None:
        out[:, ag.OUT_ENTROPY] = h
    range_bad = outside = None
    logp, ref_logp = bool(want & ag.WANT_LOGP), bool(want & ag.WANT_REF_LOGP)
    if tokens is not None and (logp or ref_logp):
        tok, ignored = ag.safe_tokens(tokens.reshape(-1), ignore_index)  # (N,)
        if check:  # gather safely; the range error is raised below, with the other checks
            range_bad = (tok < 0) | (tok >= vocab)
            tok = tok.masked_fill(range_bad, 0)
        if logp:
            x_t = _token_logits(xf, tok, keep_rows, tau_rows, stats.dtype)
            lp = _token_logp(x_t, state.m_x, state.s_x, temperature).masked_fill(ignored, 0.0)
            out[:, ag.OUT_LOGP] = stats[:, ag.ST_LOGP] = lp
        if ref_logp:
            y_t = yf.gather(-1, tok.unsqueeze(-1)).squeeze(-1).to(stats.dtype)
            lq = _token_logp(y_t, state.m_y, state.s_y, temperature).masked_fill(ignored, 0.0)
            out[:, ag.OUT_REF_LOGP] = stats[:, ag.ST_REF_LOGP] = lq
    if mask is not None:
        out.masked_fill_(~mask.reshape(-1, 1), 0.0)
    if check:  # one host read for all the checks
        if (keep is not None or tau is not None) and logp:
            outside = torch.isneginf(out[:, ag.OUT_LOGP])  # counted, non-ignored, off the support
        _check_token_stats(out, x, y, tokens, range_bad, outside, want, ignore_index)
    return out.reshape(*leading, 4), stats.reshape(*leading, ag.STATS_COLS)


@torch.library.custom_op("klpenalty::streaming_token_stats_backward", mutates_args=())
def _token_stats_backward_op(
    grad: Tensor,
    x: Tensor,
    y: Optional[Tensor],
    tokens: Optional[Tensor],
    stats: Tensor,
    mask: Optional[Tensor],
    keep: Optional[Tensor],
    tau: Optional[Tensor],
    temperature: float,
    ignore_index: int,
    want: int,
    need_x: bool,
    need_y: bool,
    tile_rows: int,
    tile_cols: int,
) -> tuple[Tensor, Tensor]:
    """Gradients (..., V) of Σ grad·out w.r.t. x and y (empty when not needed), written once per
    tile for all the wanted outputs; the sampled tokens' entries exact (see the engine)."""
    xf, rows, cols = _rows_and_tiles(x, tile_rows, tile_cols)  # (N, V)
    n, vocab = xf.shape
    st = stats.reshape(-1, ag.STATS_COLS)  # (N, 9)
    dtype = st.dtype
    need_y = need_y and y is not None
    use_y = y is not None and bool(want & (ag.WANT_KL | ag.WANT_REF_LOGP))
    yf = y.reshape(xf.shape) if use_y else None  # (N, V)
    keepf, tauf = _support_rows(keep, tau, xf)
    g = token_stats_upstream(grad, mask, tokens, ignore_index, want, dtype)  # (N, 4)
    gx = torch.empty_like(xf, memory_format=torch.contiguous_format) if need_x else None
    gy = None
    if need_y:
        gy = torch.empty_like(yf) if use_y else torch.zeros_like(y.reshape(xf.shape))
        gy = gy.contiguous()
    if n and (need_x or (need_y and use_y)):
        ws = Workspace(rows, cols, dtype, x.device)
        # Which tiles need the careful arithmetic (zeroing 0·inf): on the host, decided per
        # tile from O(N) row facts instead of a scan of every gradient tile: rows the forward
        # flagged (−inf entries in a moment, KL = +inf), rows with non-finite stats (no
        # distribution), rows without any gradient (masked: they may hold garbage), and every
        # row of a truncated policy. On accelerators: always (no host read).
        suspect = None
        if _host_checks(x.device) and keepf is None and tauf is None:
            suspect = (st[:, ag.ST_CAREFUL] != 0) | (g == 0).all(-1) | ~torch.isfinite(st).all(-1)
        with _cpu_threads(x.device):
            for r0, r1, col_ranges in _tiles(n, vocab, rows, cols):
                careful = True if suspect is None else bool(suspect[r0:r1].any())
                for c0, c1 in col_ranges:
                    xt = support_tile(
                        xf[r0:r1, c0:c1], _slice(keepf, r0, r1, c0, c1), _slice(tauf, r0, r1), ws
                    )
                    stats_grad_tile(
                        xt, _slice(yf, r0, r1, c0, c1), st[r0:r1], g[r0:r1], temperature, want,
                        ws, _slice(gx, r0, r1, c0, c1),
                        _slice(gy if use_y else None, r0, r1, c0, c1), careful,
                    )
    fix_x = need_x and bool(want & ag.WANT_LOGP)
    fix_y = need_y and use_y and bool(want & ag.WANT_REF_LOGP)
    if tokens is not None and n and (fix_x or fix_y):  # the sampled tokens' own entries
        tok, ignored = ag.safe_tokens(tokens.reshape(-1), ignore_index)
        update = ~ignored if mask is None else ~ignored & mask.reshape(-1)
        x_t = _token_logits(xf, tok, keepf, tauf, dtype)
        y_t = None if yf is None else yf.gather(-1, tok.unsqueeze(-1)).squeeze(-1).to(dtype)
        gx_t, gy_t = stats_token_grads(x_t, y_t, st, g, temperature, want)
        for out, new, fix in ((gx, gx_t, fix_x), (gy, gy_t, fix_y)):
            if fix:
                old = out.gather(-1, tok.unsqueeze(-1))
                new = torch.where(update.unsqueeze(-1), new.unsqueeze(-1).to(out.dtype), old)
                out.scatter_(-1, tok.unsqueeze(-1), new)
    return (
        gx.view(x.shape) if need_x else x.new_empty(0),
        gy.view(y.shape) if need_y else x.new_empty(0),
    )


ag.register_token_stats(_token_stats_op, _token_stats_backward_op)


# ------------------------------------------------------------------------------ entry points

def token_stats(
    x: Tensor,
    y: Tensor | None,
    tokens: Tensor | None,
    mask: Tensor | None,
    keep: Tensor | None,
    tau: Tensor | None,
    temperature: float,
    *,
    ignore_index: int = -100,
    want: int,
    check: bool = False,
    chunk_rows: int | None = None,
    vocab_chunk: int | None = None,
    tile_elements: int = TILE_ELEMENTS,
) -> Tensor:
    """The one-pass per-token statistics, streamed over cache-sized tiles (unchecked inputs).

    Args:
        x: (..., V) float policy logits.  y: (..., V) reference logits or None.
        tokens: (...) int64 ids in [0, V) or ``ignore_index``, or None.
        mask: (...) bool or None; False positions give 0 and zero gradients.
        keep: (..., V) bool support of the policy (True = kept) or None.
        tau: (...) in the compute dtype, kept iff x_v ≥ tau, or None.
        temperature: > 0.
        ignore_index: tokens equal to it give 0 (and zero gradient) in the log-prob columns.
        want: ``WANT_*`` bits of ``ops/autograd.py`` (KL and the ref log-prob need ``y``, the
            log-probs need ``tokens``).
        check: the token range, NaN and outside-the-support checks (one host read).
        chunk_rows, vocab_chunk, tile_elements: as in :func:`full_kl`.

    Returns:
        (..., 4) float32 (float64 for float64 inputs): KL(π̃‖ρ), log π̃(t), log ρ(t), H(π̃),
        0 in the columns not wanted; differentiable w.r.t. x and y (also twice).
    """
    rows, cols = _tile_args(x, tile_elements, chunk_rows, vocab_chunk)
    out, _ = _token_stats_op(
        x, y, tokens, mask, keep, tau, float(temperature), int(ignore_index), int(want),
        bool(check), rows, cols,
    )
    return out


def _tile_args(x: Tensor, tile_elements: int, chunk_rows, vocab_chunk) -> tuple[int, int]:
    """(rows, cols) passed to the ops: 0 = the op's default for that dimension."""
    if tile_elements == TILE_ELEMENTS:
        return int(chunk_rows or 0), int(vocab_chunk or 0)
    vocab = x.shape[-1]
    n = x.numel() // vocab if vocab else 0
    return tile_shape(n, vocab, tile_elements, chunk_rows, vocab_chunk)


full_kl, token_logprobs, entropy = views.backend_views(token_stats)
