"""The streaming engine with its per-tile math compiled by ``torch.compile`` (opt-in).

Same tile loop, merge and autograd Function as :mod:`klpenalty.ops.streaming`; only the math
inside one tile is a compiled pure function (inductor fuses the shifts, exps, products and row
reductions into a few loops over the tile, with a faster vectorised exp than eager ATen).
Compiled functions use dynamic shapes and take the temperature as a 0-d tensor, so a new batch
size, vocabulary chunk or temperature does not trigger a recompilation.

Cost: the first call in a fresh process pays inductor's start-up and code generation (about
10–20 s on a small CPU with a cold cache, well under a second with a warm cache). That is why
``backend="auto"`` does not pick this path; ask for it with ``backend="compiled"``.

If compiling fails (no C++ compiler, unsupported platform, an inductor error), a one-time
:class:`RuntimeWarning` says why and every later call runs the eager streaming path, which gives
the same results up to rounding.
"""

from __future__ import annotations

import threading
import warnings

import torch

from . import streaming
from .streaming import _LOG2E, EAGER_TILES, TileOps

__all__ = ["full_kl", "token_logprobs", "is_available", "compile_failed"]

_lock = threading.RLock()
_state: dict[str, object] = {"tiles": None, "failed": None}


def _t(temperature: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.tensor(temperature, dtype=dtype, device=device)


# Pure tile functions (no out= buffers, no data-dependent Python branches) for inductor. They
# always apply the careful 0·log 0 handling with `where`, which inductor fuses at no extra pass.
# Semantics are those of the eager tile functions in streaming.py.
def _fwd_math(x, y, t):  # x, y: (r, c) raw tiles; t: 0-d compute-dtype tensor (temperature)
    xf = x.to(t.dtype)
    yf = y.to(t.dtype)
    zero = torch.zeros((), dtype=t.dtype, device=t.device)
    mx = xf.amax(-1)
    my = yf.amax(-1)
    mx = torch.where(torch.isfinite(mx), mx, zero)  # shifts in logit units, as in streaming.py
    my = torch.where(torch.isfinite(my), my, zero)
    # exp((v − m)/T) as exp2((v − m)·log2e/T): vectorised exp2 is the cheaper instruction mix
    e = torch.exp2((xf - mx.unsqueeze(-1)) * (_LOG2E / t))
    sx = e.sum(-1)
    sy = torch.exp2((yf - my.unsqueeze(-1)) * (_LOG2E / t)).sum(-1)
    a = torch.where(e > 0, e * (xf - yf), zero).sum(-1)  # 0·log 0 = 0; +inf where q = 0 < p
    # rows holding non-finite logits: the eager backward needs the flag if it ever takes over
    bad = (~torch.isfinite(xf) | ~torch.isfinite(yf)).any(-1)
    return mx, sx, a, my, sy, bad


def _p(v, t, m, log_s):  # e^{(v − m)/T − log s} for a tile v in compute dtype
    return torch.exp2(((v - m.unsqueeze(-1)) / t - log_s.unsqueeze(-1)) * _LOG2E)


def _bwd_x_math(x, y, t, mx, lsx, u, fx):  # -> (r, c) gradient tile in x's dtype
    xf = x.to(t.dtype)
    yf = y.to(t.dtype)
    zero = torch.zeros((), dtype=t.dtype, device=t.device)
    p = _p(xf, t, mx, lsx)
    gx = torch.where(p > 0, p * ((xf - yf) - u.unsqueeze(-1)), zero) * fx.unsqueeze(-1)
    return torch.where(fx.unsqueeze(-1) != 0, gx, zero).to(x.dtype)


def _bwd_y_math(x, y, t, mx, lsx, my, lsy, fy):  # -> (r, c) gradient tile in y's dtype
    zero = torch.zeros((), dtype=t.dtype, device=t.device)
    d = _p(y.to(t.dtype), t, my, lsy) - _p(x.to(t.dtype), t, mx, lsx)  # q − p
    gy = torch.nan_to_num(d, nan=0.0) * fy.unsqueeze(-1)
    return torch.where(fy.unsqueeze(-1) != 0, gy, zero).to(y.dtype)


def _lse_math(x, t):
    xf = x.to(t.dtype)
    m = xf.amax(-1)
    m = torch.where(torch.isfinite(m), m, torch.zeros((), dtype=t.dtype, device=t.device))
    return m, torch.exp2((xf - m.unsqueeze(-1)) * (_LOG2E / t)).sum(-1)


def _lp_bwd_math(x, t, m, log_s, fx):
    return (-(_p(x.to(t.dtype), t, m, log_s) * fx.unsqueeze(-1))).to(x.dtype)


def _guarded(compiled_fn, eager_fn):
    """Call ``compiled_fn``; on a compile failure warn once and use ``eager_fn`` from then on."""

    def call(*args):
        if _state["failed"] is None:
            try:
                return compiled_fn(*args)
            except Exception as err:
                if not _is_compile_error(err):
                    raise
                _fall_back(err)
        return eager_fn(*args)

    return call


def _make_tiles() -> TileOps:
    kw = {"dynamic": True, "fullgraph": True}
    fwd_c = torch.compile(_fwd_math, **kw)
    bwd_x_c = torch.compile(_bwd_x_math, **kw)
    bwd_y_c = torch.compile(_bwd_y_math, **kw)
    lse_c = torch.compile(_lse_math, **kw)
    lp_bwd_c = torch.compile(_lp_bwd_math, **kw)

    def fwd(x, y, temperature, dtype, ws):
        return fwd_c(x, y, _t(temperature, dtype, x.device))

    def bwd(x, y, temperature, dtype, ws, st, fx, fy, gx, gy, unclean):
        t = _t(temperature, dtype, x.device)
        mx, lsx, my, lsy, u = st
        if gx is not None:
            gx.copy_(bwd_x_c(x, y, t, mx, lsx, u, fx))
        if gy is not None:
            gy.copy_(bwd_y_c(x, y, t, mx, lsx, my, lsy, fy))

    def lse(x, temperature, dtype, ws):
        return lse_c(x, _t(temperature, dtype, x.device))

    def lp_bwd(x, temperature, dtype, ws, m, log_s, fx, gx):
        gx.copy_(lp_bwd_c(x, _t(temperature, dtype, x.device), m, log_s, fx))

    e = EAGER_TILES
    return TileOps(
        "compiled",
        _guarded(fwd, e.fwd),
        _guarded(bwd, e.bwd),
        _guarded(lse, e.lse),
        _guarded(lp_bwd, e.lp_bwd),
    )


def compile_failed() -> str | None:
    """Why compiling failed in this process (None if it has not failed)."""
    return _state["failed"]  # type: ignore[return-value]


def is_available() -> bool:
    """True if ``torch.compile`` exists and has not failed in this process."""
    return hasattr(torch, "compile") and _state["failed"] is None


def _fall_back(err: BaseException) -> None:
    with _lock:
        if _state["failed"] is None:
            _state["failed"] = f"{type(err).__name__}: {err}".splitlines()[0][:300]
            warnings.warn(
                "klpenalty: torch.compile is unavailable or failed "
                f"({_state['failed']}); the 'compiled' backend falls back to the eager "
                "streaming path for the rest of this process (same results up to rounding).",
                RuntimeWarning,
                stacklevel=4,
            )


def _tiles() -> TileOps:
    if _state["failed"] is not None:
        return EAGER_TILES
    with _lock:
        if _state["tiles"] is None:
            try:
                _state["tiles"] = _make_tiles()
            except Exception as err:  # torch.compile missing or refusing this platform
                _fall_back(err)
                return EAGER_TILES
    return _state["tiles"]  # type: ignore[return-value]


# Larger tiles than eager: the compiled tile math keeps no tile-sized temporaries in the forward.
_TILE_ELEMENTS = 1 << 20


def _run(fn, *args, **kwargs):
    return fn(*args, ops=_tiles(), **kwargs)


def _is_compile_error(err: BaseException) -> bool:
    mod = type(err).__module__ or ""
    return mod.startswith("torch._dynamo") or mod.startswith("torch._inductor") or isinstance(
        err, (OSError, RuntimeError, ImportError, NotImplementedError)
    )


def full_kl(x, y, mask, temperature, **kwargs):
    """As :func:`klpenalty.ops.streaming.full_kl`, with compiled tile math (x, y: (N, V))."""
    kwargs.setdefault("tile_elements", _TILE_ELEMENTS)
    return _run(streaming.full_kl, x, y, mask, temperature, **kwargs)


def token_logprobs(x, tokens, temperature, **kwargs):
    """As :func:`klpenalty.ops.streaming.token_logprobs`, with compiled tile math."""
    kwargs.setdefault("tile_elements", _TILE_ELEMENTS)
    return _run(streaming.token_logprobs, x, tokens, temperature, **kwargs)
