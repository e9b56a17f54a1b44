"""The streaming backend's forward, backward and state ops: the engine's tile loop in ATen ops.

The (N, V) logits are walked in tiles of ``rows × cols`` elements (a few MiB, cache-sized).
Each tile gives the per-row state of :mod:`.engine`, the states of a row's vocabulary tiles are
merged, and the merged state is finalized; the backward recomputes each tile from the saved
logits and the (N, 10) stats and writes the gradient straight into a buffer of the input's dtype.
Temporaries are tile-sized buffers reused for every tile: nothing of size (N, V) is allocated.

On CPU the tile loop runs on one intra-op thread (see :func:`_cpu_threads`); on accelerators it
makes no host synchronisation (the careful 0·log 0 arithmetic always runs there).

The ops are ``klpenalty::streaming_token_stats``, ``_backward`` and ``_state`` of
:mod:`..contract`; the forward computes the sampler's threshold with :mod:`.threshold`.
"""

from __future__ import annotations

import contextlib
import torch
from torch import Tensor

from ... import _validation as v
from ..._validation import compute_dtype
from .. import contract
from ..contract import Want
from ..engine import (
    Workspace,
    StatsState,
    state_to_tensor,
    stats_finalize,
    stats_grad_tile,
    stats_merge,
    stats_partial,
    stats_token_grads,
)
from . import threshold

__all__ = ["token_stats_state", "support_tile", "tile_shape", "TILE_ELEMENTS"]

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
    as :func:`.contract.kept_logits` does on the whole tensor. Never an (N, V) copy."""
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



def _wants_y(y: Tensor | None, want: int) -> bool:
    """Whether the reference logits are read: the KL or the reference log-probs."""
    return y is not None and bool(want & (Want.KL | Want.REF_LOGP))


def _rows_state(x, y, keep, tau, temperature, want, tile_rows, tile_cols):
    """(xf, yf, keepf, tauf, state, careful flags or None) of (..., V) logits: the rows, the
    support as rows and the merged per-row state, in one read of each tile."""
    xf, rows, cols = _rows_and_tiles(x, tile_rows, tile_cols)  # (N, V)
    dtype = compute_dtype(x) if y is None else compute_dtype(x, y)
    yf = y.reshape(xf.shape) if _wants_y(y, want) else None  # (N, V)
    keepf, tauf = _support_rows(keep, tau, xf)
    with _cpu_threads(x.device):
        state, careful = token_stats_state(
            xf, yf, keepf, tauf, temperature, dtype, rows, cols,
            kl=bool(want & Want.KL), entropy=bool(want & Want.ENTROPY),
        )
    return xf, yf, keepf, tauf, state, careful


def token_stats_state_op(x, y, keep, tau, temperature, want, tile_rows, tile_cols):
    """(..., V) logits → the unfinalized state (N, 6) over these columns and (N,) careful flags
    (the state op of :mod:`.contract`)."""
    xf, _, _, _, state, careful = _rows_state(x, y, keep, tau, temperature, want, tile_rows,
                                              tile_cols)
    if careful is None:
        careful = torch.zeros(xf.shape[0], dtype=torch.bool, device=x.device)
    return state_to_tensor(state), careful


def token_stats_op(  # the schema: contract.SCHEMAS["token_stats"]
    x, y, tokens, mask, keep, tau, temperature, ignore_index, want, check, tile_rows,
    tile_cols, top_k, top_p, min_p, ids=None, offsets=None,
):
    """(..., V) logits → out (..., 4): KL(π̃‖ρ), log π̃(t), log ρ(t), H(π̃), and stats (..., 10)
    (the forward op of :mod:`.contract`): one read of each logit for all the wanted outputs;
    the support (``keep``, ``tau``, the kept sets' and the sampler's thresholds) applied per
    tile; the kept sets' thresholds from ``streaming_support_from_ids`` first."""
    v.check_want(want, y is not None, tokens is not None)
    contract.check_sampler_args(top_k, top_p, min_p, temperature)
    tau, check = contract.tau_of_ids("streaming", x, mask, tau, ids, offsets, check)
    if contract.sampler_cuts(x.shape[-1], top_k, top_p, min_p):
        tau = contract.combined_tau(
            tau, threshold.sampling_threshold_op(x, top_k, top_p, min_p, temperature)
        )
    xf, yf, keepf, tauf, state, careful = _rows_state(x, y, keep, tau, temperature, want,
                                                      tile_rows, tile_cols)
    kl, h, stats = stats_finalize(state, careful)
    return contract.finish(
        x, y, xf, yf, tokens, mask, keep, tau, keepf, tauf, state, kl, h, stats, temperature,
        ignore_index, want, check,
    )


def token_stats_backward_op(  # the schema: contract.SCHEMAS["token_stats_backward"]
    grad, x, y, tokens, owned, stats, mask, keep, tau, temperature, ignore_index, want,
    need_x, need_y, tile_rows, tile_cols,
):
    """Gradients (..., V) of Σ grad·out w.r.t. x and y (empty when not needed), written once per
    tile for all the wanted outputs; the sampled tokens' entries exact (see the engine), where
    ``owned`` (if given) is True (the backward op of :mod:`.contract`)."""
    xf, rows, cols = _rows_and_tiles(x, tile_rows, tile_cols)  # (N, V)
    n, vocab = xf.shape
    st = stats.reshape(-1, contract.STATS_COLS)  # (N, 10)
    dtype = st.dtype
    need_y = need_y and y is not None
    use_y = _wants_y(y, want)
    yf = y.reshape(xf.shape) if use_y else None  # (N, V)
    keepf, tauf = _support_rows(keep, tau, xf)
    g = contract.token_upstream(grad, mask, tokens, ignore_index, want, dtype)  # (N, 4)
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
            suspect = (st[:, contract.ST_CAREFUL] != 0) | (g == 0).all(-1) | ~torch.isfinite(st).all(-1)
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
    fix_x = need_x and bool(want & Want.LOGP)
    fix_y = need_y and use_y and bool(want & Want.REF_LOGP)
    if tokens is not None and n and (fix_x or fix_y):  # the sampled tokens' own entries
        tok, ignored = contract.safe_tokens(tokens.reshape(-1), ignore_index)
        update = ~ignored if mask is None else ~ignored & mask.reshape(-1)
        if owned is not None:
            update = update & owned.reshape(-1)
        x_t = contract.token_logits(xf, tok, keepf, tauf, dtype)
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
