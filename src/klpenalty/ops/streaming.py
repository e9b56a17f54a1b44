"""Streaming exact-KL engine (any device): one read of each logit per pass, O(N) extra memory.

The (N, V) logits are walked in tiles of ``rows × cols`` elements (a few MiB, cache-sized).
For every row the forward keeps the online state of both models,

    m_x = max x,  s_x = Σ e^{x − m_x},  A = Σ e^{x − m_x}·(x − y),
    m_y = max y,  s_y = Σ e^{y − m_y}

(written here for x, y already divided by the temperature; the code keeps the maxima in logit
units and applies 1/T inside the exponent), and merges the states of successive vocabulary
tiles (the merge is associative: M = max(m, m′), s = s·e^{m−M} + s′·e^{m′−M}, A rescaled with
the same factor as s_x). At the end of a row

    KL = A/s_x + (m_y − m_x) + log(s_y / s_x),

which avoids subtracting two large log-sum-exps. Temporaries are tile-sized buffers that are
reused for every tile: nothing of size (N, V) is allocated in the forward.

Each tile takes one fast path of fused ATen ops (``exp2`` instead of ``exp``: about twice the
throughput on CPU); only when a product comes out non-finite (−inf or NaN logits in the tile)
is the tile's A recomputed with the 0·log 0 = 0 rule, and the rows are flagged so that the
backward uses its careful formula there too.

The backward recomputes each tile from the saved logits and four per-row numbers
(LSE_x, LSE_y, E_p[x − y], a flag) and writes the gradient straight into a buffer of the input's
dtype:  ∂KL/∂x = p·((log p − log q) − KL)/T = p·(d − E_p[d])/T with d = (x − y)/T, and
∂KL/∂y = (q − p)/T.

Numerics (DESIGN.md): math in float32 for float16/bfloat16/float32 inputs, float64 for float64
inputs; 0·log 0 = 0 (entries that are −inf in the policy contribute nothing, also when the
reference is −inf there); +inf where the policy has mass and the reference has none; the
result is clamped at 0 and is exactly 0 for identical logits; a row that defines no
distribution (all −inf, or holding NaN/+inf) gives NaN, which the public functions turn into an
error naming the cause unless the row is masked. Shifts are row maxima in logit units, so
x − m is exact for nearby logits even at ±1e4 (no large log-sum-exp is subtracted).

The tile math comes in two flavours with identical results up to rounding: eager PyTorch ops
on reused buffers (this module, :data:`EAGER_TILES`) and ``torch.compile``-d pure functions
(:mod:`klpenalty.ops.compiled`). The tile loop, the merge and the autograd plumbing are shared.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch.autograd.function import once_differentiable

__all__ = [
    "full_kl",
    "token_logprobs",
    "tile_shape",
    "TileOps",
    "EAGER_TILES",
    "TILE_ELEMENTS",
]

# Elements per tile: 2**18 = 1 MiB of float32 per buffer. Two work buffers live at once, four
# for bfloat16/float16 inputs (their tiles are upcast once into reused buffers); the temperature
# is fused into the first pass. That stays in L2/L3 and is ~1-3% of one input at the sizes this
# library is for. 2**17-2**19 measured within noise of each other; 2**16 pays more per-tile
# overhead.
TILE_ELEMENTS = 1 << 18

_INF = float("inf")
_NINF = float("-inf")

# Devices where a per-tile host-side check (a sync) is free: there the careful 0·log 0 pass
# runs only for tiles that need it. Elsewhere it always runs (no host sync inside the loop).
_HOST_CHECK_DEVICES = {"cpu"}


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
    (values larger than the problem are clipped).
    """
    cols = vocab_chunk if vocab_chunk is not None else min(vocab, tile_elements)
    cols = max(1, min(int(cols), vocab))
    rows = chunk_rows if chunk_rows is not None else tile_elements // cols
    rows = max(1, min(int(rows), max(1, n_rows)))
    return rows, cols


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _finite_or_zero(m: torch.Tensor) -> torch.Tensor:
    """The shift used for a row: its max if finite, else 0 (all −inf rows, NaN rows)."""
    return torch.nan_to_num(m, nan=0.0, posinf=0.0, neginf=0.0)


class _Workspace:
    """Reusable flat buffers of ``rows*cols`` elements, viewed as contiguous (r, c) tiles."""

    def __init__(self, rows: int, cols: int, dtype: torch.dtype, device: torch.device):
        self.size = rows * cols
        self.dtype = dtype
        self.device = device
        self._bufs: dict[str, torch.Tensor] = {}

    def get(self, name: str, r: int, c: int) -> torch.Tensor:
        buf = self._bufs.get(name)
        if buf is None:
            buf = torch.empty(self.size, dtype=self.dtype, device=self.device)
            self._bufs[name] = buf
        return buf[: r * c].view(r, c)


_LOG2E = math.log2(math.e)


def _exp_shifted(
    out: torch.Tensor,
    t: torch.Tensor,
    temperature: float,
    shift: torch.Tensor,
    log_norm: torch.Tensor | None = None,
):
    """out ← exp((t − shift)/T − log_norm) for a tile t (r, c), per-row shift and log_norm (r,).

    ``shift`` is in the logits' own units (a row max), so t − shift is exact for nearby values
    even when the logits are large (±1e4). Then one multiply(-add) pass applies 1/T, log2 e and
    the normaliser, and ATen's exp2 (measured about twice as fast as its exp on CPU) finishes.
    """
    torch.sub(t, shift.unsqueeze(-1), out=out)
    if log_norm is None:
        out.mul_(_LOG2E / temperature)
    else:
        torch.add((log_norm * -_LOG2E).unsqueeze(-1), out, alpha=_LOG2E / temperature, out=out)
    return out.exp2_()


def _upcast(t: torch.Tensor, dtype: torch.dtype, ws: _Workspace, name: str) -> torch.Tensor:
    """The tile in the compute dtype: itself, or a copy into a reused workspace buffer.

    (Mixed-dtype ATen ops would allocate a fresh upcast copy of the tile for every op.)
    """
    if t.dtype == dtype:
        return t
    return ws.get(name, *t.shape).copy_(t)


def _row_max(t: torch.Tensor) -> torch.Tensor:
    """Row max of a tile in its compute dtype, as a shift: 0 where not finite (−inf/NaN/+inf)."""
    return _finite_or_zero(t.amax(-1))


# ----------------------------------------------------------------------------- eager tile math
def _fwd_tile_eager(x, y, temperature, dtype, ws):
    """Online state of one raw (r, c) tile.

    Returns (r,) tensors m_x, s_x (shift in logit units and Σ e^{(x − m_x)/T}),
    A = Σ e^{(x − m_x)/T}·(x − y) (not divided by T), m_y, s_y, and ``unclean``: None when
    every product was finite, else an (r,) bool tensor of the rows that needed the careful 0·log 0 path (−inf or NaN logits).
    A = +inf marks policy mass where the reference has none.
    """
    r, c = x.shape
    x = _upcast(x, dtype, ws, "x")
    y = _upcast(y, dtype, ws, "y")
    e = ws.get("e", r, c)
    f = ws.get("f", r, c)
    mx = _row_max(x)
    my = _row_max(y)
    sx = _exp_shifted(e, x, temperature, mx).sum(-1)
    sy = _exp_shifted(f, y, temperature, my).sum(-1)
    torch.sub(x, y, out=f).mul_(e)  # e·(x − y)
    a = f.sum(-1)
    if x.device.type in _HOST_CHECK_DEVICES:
        if math.isfinite(float(a.sum())):  # one O(r) check instead of per-row flags
            return mx, sx, a, my, sy, None
    # (on accelerators the careful pass always runs: it costs less than a host sync per tile)
    unclean = ~torch.isfinite(a)
    # −inf logits somewhere in the tile: 0·(−inf) and 0·NaN are 0·log 0 = 0, while +inf
    # (policy mass where the reference is −inf) stays +inf.
    f.nan_to_num_(nan=0.0, posinf=_INF, neginf=-_INF)
    return mx, sx, f.sum(-1), my, sy, unclean


def _bwd_tile_eager(x, y, temperature, dtype, ws, st, fx, fy, gx, gy, unclean):
    """Gradient tiles of Σ_rows g·KL.

    gx ← p·((x − y) − u)·fx with fx = g/T², u = E_p[x − y];
    gy ← (q − p)·fy with fy = g/T. ``st`` = (m_x, log s_x, m_y, log s_y, u), each (r,).
    Rows whose factor is 0 (masked) get exactly 0 when ``unclean`` (garbage logits allowed).
    """
    r, c = x.shape
    x = _upcast(x, dtype, ws, "x")
    y = _upcast(y, dtype, ws, "y")
    e = ws.get("e", r, c)
    f = ws.get("f", r, c)
    mx, lsx, my, lsy, u = st
    _exp_shifted(e, x, temperature, mx, lsx)  # p
    if gx is not None:
        torch.sub(x, y, out=f).sub_(u.unsqueeze(-1)).mul_(e)
        f2 = fx.unsqueeze(-1)
        if unclean:
            f.masked_fill_(e == 0, 0.0)  # 0·log 0 = 0: no NaN from −inf entries
            f.mul_(f2).masked_fill_(f2 == 0, 0.0)
            gx.copy_(f)
        else:
            torch.mul(f, f2, out=gx)
    if gy is not None:
        _exp_shifted(f, y, temperature, my, lsy).sub_(e)  # q − p
        f2 = fy.unsqueeze(-1)
        if unclean:
            f.nan_to_num_(nan=0.0)
            f.mul_(f2).masked_fill_(f2 == 0, 0.0)
            gy.copy_(f)
        else:
            torch.mul(f, f2, out=gy)


def _lse_tile_eager(x, temperature, dtype, ws):
    """Online (m, s) of one raw tile: shift m (logit units) and s = Σ e^{(x − m)/T}."""
    x = _upcast(x, dtype, ws, "x")
    e = ws.get("e", *x.shape)
    m = _row_max(x)
    return m, _exp_shifted(e, x, temperature, m).sum(-1)


def _lp_bwd_tile_eager(x, temperature, dtype, ws, m, log_s, fx, gx):
    """gx ← −p·fx for one tile, p = e^{(x − m)/T − log s}, fx = g/T (+fx at the token: caller)."""
    x = _upcast(x, dtype, ws, "x")
    e = ws.get("e", *x.shape)
    _exp_shifted(e, x, temperature, m, log_s)
    torch.mul(e, (-fx).unsqueeze(-1), out=gx)


@dataclass(frozen=True)
class TileOps:
    """The per-tile math of one flavour (eager ops on buffers, or compiled functions).

    Every function receives raw tiles in the input dtype, the temperature (a Python float), the
    compute dtype and a workspace, and returns per-row tensors of the compute dtype.
    """

    name: str
    fwd: Callable
    bwd: Callable
    lse: Callable
    lp_bwd: Callable


EAGER_TILES = TileOps(
    "eager", _fwd_tile_eager, _bwd_tile_eager, _lse_tile_eager, _lp_bwd_tile_eager
)


# ----------------------------------------------------------------------------- merge helpers
def _merge(temperature, m0, s0, m1, s1, *others):
    """Merge two online states (shifts in logit units): M, s, and ``others`` rescaled like s."""
    m = torch.maximum(m0, m1)
    a0 = torch.exp((m0 - m) / temperature)
    a1 = torch.exp((m1 - m) / temperature)
    out = [m, s0 * a0 + s1 * a1]
    for o0, o1 in others:
        out.append(o0 * a0 + o1 * a1)
    return out


def _tiles(n: int, v: int, rows: int, cols: int):
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        yield r0, r1, [(c0, min(v, c0 + cols)) for c0 in range(0, v, cols)]


def _kl_forward(x, y, temperature, rows, cols, ops: TileOps):
    """Per-row KL and the state the backward needs. x, y: (N, V). Returns (N,) tensors."""
    n, v = x.shape
    dtype = _compute_dtype(x, y)
    ws = _Workspace(rows, cols, dtype, x.device)
    parts: list[list[torch.Tensor]] = [[] for _ in range(6)]  # m_x, s_x, A, m_y, s_y, unclean
    for r0, r1, col_ranges in _tiles(n, v, rows, cols):
        state = None
        for c0, c1 in col_ranges:
            mx, sx, a, my, sy, bad = ops.fwd(
                x[r0:r1, c0:c1], y[r0:r1, c0:c1], temperature, dtype, ws
            )
            if state is None:
                state = [mx, sx, a, my, sy, bad]
                continue
            # merge with the previous vocabulary chunks; +inf is carried separately
            pinf = torch.isposinf(state[2]) | torch.isposinf(a)
            a0 = state[2].masked_fill(pinf, 0.0)
            a1 = a.masked_fill(pinf, 0.0)
            m_x, s_x, a_acc = _merge(temperature, state[0], state[1], mx, sx, (a0, a1))
            m_y, s_y = _merge(temperature, state[3], state[4], my, sy)
            bad = bad if state[5] is None else state[5] if bad is None else state[5] | bad
            state = [m_x, s_x, a_acc.masked_fill_(pinf, _INF), m_y, s_y, bad]
        for i in range(6):
            parts[i].append(state[i])
    mx, sx, a, my, sy = (torch.cat(p) for p in parts[:5])
    unclean = torch.zeros(n, dtype=torch.bool, device=x.device)
    if any(b is not None for b in parts[5]):
        unclean = torch.cat(
            [
                torch.zeros_like(m, dtype=torch.bool) if b is None else b
                for m, b in zip(parts[0], parts[5])
            ]
        )
    pinf = torch.isposinf(a)
    mean_d = (a / sx).masked_fill_(pinf, _INF)  # E_p[x − y] (not divided by T)
    # KL = E_p[d]/T + LSE_y − LSE_x with LSE = m/T + log s; the difference of maxima is exact
    kl = mean_d / temperature + (my - mx) / temperature + torch.log(sy / sx)
    kl = kl.clamp_min_(0.0)  # exact KL ≥ 0; NaN stays NaN
    # a row of all −inf (no mass), or holding +inf or NaN, defines no distribution: NaN, which
    # the public functions report as an error naming the input (masked rows become 0 later)
    valid = (sx > 0) & torch.isfinite(sx) & (sy > 0) & torch.isfinite(sy)
    kl = kl.masked_fill_(~valid, float("nan"))
    lsx = torch.log(sx).nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
    lsy = torch.log(sy).nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
    unclean = unclean | pinf | ~torch.isfinite(mean_d) | ~valid
    return kl, (mx, lsx, my, lsy, mean_d), valid, unclean, dtype


class _StreamingFullKL(torch.autograd.Function):
    """KL(softmax(x/T) ‖ softmax(y/T)) per row with an analytic, tile-recomputing backward."""

    @staticmethod
    def forward(ctx, x, y, mask, temperature: float, rows: int, cols: int, ops: TileOps):
        kl, st, valid, unclean, dtype = _kl_forward(x, y, temperature, rows, cols, ops)
        if mask is not None:
            kl = kl.masked_fill_(~mask, 0.0)
        ctx.save_for_backward(x, y, *st, valid, unclean, mask)
        ctx.temperature = temperature
        ctx.tile = (rows, cols)
        ctx.ops = ops
        return kl

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_kl):  # grad_kl: (N,)
        x, y, mx, lsx, my, lsy, mean_d, valid, unclean, mask = ctx.saved_tensors
        need_x, need_y = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        t = ctx.temperature
        rows, cols = ctx.tile
        n, v = x.shape
        dtype = mx.dtype
        g = grad_kl.to(dtype)  # (N,)
        if mask is not None:
            g = g.masked_fill(~mask, 0.0)
        g = g.masked_fill(~valid, 0.0)  # rows without a distribution (necessarily masked)
        fx = g / (t * t)  # ∂KL/∂x = p·((x − y) − E_p[x − y])/T²
        fy = g / t  # ∂KL/∂y = (q − p)/T
        grad_x = torch.empty(x.shape, dtype=x.dtype, device=x.device) if need_x else None
        grad_y = torch.empty(y.shape, dtype=y.dtype, device=y.device) if need_y else None
        ws = _Workspace(rows, cols, dtype, x.device)
        any_unclean = bool(unclean.any())
        for r0, r1, col_ranges in _tiles(n, v, rows, cols):
            bad = any_unclean and bool(unclean[r0:r1].any())
            for c0, c1 in col_ranges:
                ctx.ops.bwd(
                    x[r0:r1, c0:c1],
                    y[r0:r1, c0:c1],
                    t,
                    dtype,
                    ws,
                    (mx[r0:r1], lsx[r0:r1], my[r0:r1], lsy[r0:r1], mean_d[r0:r1]),
                    fx[r0:r1],
                    fy[r0:r1],
                    grad_x[r0:r1, c0:c1] if need_x else None,
                    grad_y[r0:r1, c0:c1] if need_y else None,
                    bad,
                )
        return grad_x, grad_y, None, None, None, None, None


class _StreamingTokenLogprobs(torch.autograd.Function):
    """log softmax(x/T)[token] per row: streaming log-sum-exp + gather; recomputing backward."""

    @staticmethod
    def forward(ctx, x, tokens, temperature: float, rows: int, cols: int, ops: TileOps):
        n, v = x.shape
        dtype = _compute_dtype(x)
        ws = _Workspace(rows, cols, dtype, x.device)
        ms, ss = [], []
        for r0, r1, col_ranges in _tiles(n, v, rows, cols):
            state = None
            for c0, c1 in col_ranges:
                m, s = ops.lse(x[r0:r1, c0:c1], temperature, dtype, ws)
                state = (m, s) if state is None else _merge(temperature, state[0], state[1], m, s)
            ms.append(state[0])
            ss.append(state[1])
        m, log_s = torch.cat(ms), torch.log(torch.cat(ss))  # (N,)
        picked = x.gather(-1, tokens.unsqueeze(-1)).squeeze(-1).to(dtype)  # (N,)
        # (x_t − m)/T − log s: the shifted difference is exact for nearby logits, even at ±1e4.
        # An all −inf row (s = 0) gives NaN, reported by the public function.
        out = (picked - m) / temperature - log_s
        out = out.masked_fill_(log_s == _NINF, float("nan"))
        ctx.save_for_backward(x, tokens, m, log_s.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0), out)
        ctx.temperature = temperature
        ctx.tile = (rows, cols)
        ctx.ops = ops
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):  # grad_out: (N,)
        x, tokens, m, log_s, out = ctx.saved_tensors
        t = ctx.temperature
        rows, cols = ctx.tile
        n, v = x.shape
        dtype = m.dtype
        fx = grad_out.to(dtype) / t  # (N,)
        grad_x = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        ws = _Workspace(rows, cols, dtype, x.device)
        for r0, r1, col_ranges in _tiles(n, v, rows, cols):
            for c0, c1 in col_ranges:
                ctx.ops.lp_bwd(
                    x[r0:r1, c0:c1],
                    t,
                    dtype,
                    ws,
                    m[r0:r1],
                    log_s[r0:r1],
                    fx[r0:r1],
                    grad_x[r0:r1, c0:c1],
                )
        # at the sampled token: (1 − p_token)·g/T = −expm1(log p_token)·g/T, in `dtype`
        at_token = (-torch.expm1(out)) * fx
        grad_x.scatter_(-1, tokens.unsqueeze(-1), at_token.unsqueeze(-1).to(x.dtype))
        return grad_x, None, None, None, None, None


def full_kl(
    x: torch.Tensor,
    y: torch.Tensor,
    mask: torch.Tensor | None,
    temperature: float,
    *,
    chunk_rows: int | None = None,
    vocab_chunk: int | None = None,
    tile_elements: int = TILE_ELEMENTS,
    ops: TileOps = EAGER_TILES,
) -> torch.Tensor:
    """Exact KL(softmax(x/T) ‖ softmax(y/T)) per row, streamed over cache-sized tiles.

    Args:
        x: (N, V) float16/bfloat16/float32/float64 policy logits.
        y: (N, V) float16/bfloat16/float32/float64 reference logits.
        mask: (N,) bool or None; False rows give 0 and zero gradient whatever their logits.
        temperature: > 0, divides both logits.
        chunk_rows: rows per tile (default: as many as fit ``tile_elements``).
        vocab_chunk: vocabulary entries per tile (default: min(V, ``tile_elements``)).
        tile_elements: target elements per tile.
        ops: the tile math (eager by default).

    Returns:
        (N,) float32 (float64 if either input is float64), differentiable; gradients come back
        in each input's dtype.
    """
    n, v = x.shape
    rows, cols = tile_shape(n, v, tile_elements, chunk_rows, vocab_chunk)
    return _StreamingFullKL.apply(x, y, mask, float(temperature), rows, cols, ops)


def token_logprobs(
    x: torch.Tensor,
    tokens: torch.Tensor,
    temperature: float,
    *,
    chunk_rows: int | None = None,
    vocab_chunk: int | None = None,
    tile_elements: int = TILE_ELEMENTS,
    ops: TileOps = EAGER_TILES,
) -> torch.Tensor:
    """log softmax(x/T)[token] per row, streamed over cache-sized tiles.

    Args:
        x: (N, V) float16/bfloat16/float32/float64 logits.
        tokens: (N,) int64 ids in [0, V).
        temperature: > 0.
        chunk_rows, vocab_chunk, tile_elements, ops: as in :func:`full_kl`.

    Returns:
        (N,) float32 (float64 for float64 logits), differentiable with respect to ``x``
        (gradient (onehot(token) − p)/T in x's dtype).
    """
    n, v = x.shape
    rows, cols = tile_shape(n, v, tile_elements, chunk_rows, vocab_chunk)
    return _StreamingTokenLogprobs.apply(x, tokens, float(temperature), rows, cols, ops)
