"""Triton backend (CUDA tensors; CPU tensors under ``TRITON_INTERPRET=1``): the engine's per-row
state in fused GPU kernels.

The kernels live in :mod:`._triton_jit`, imported at the first call (Triton is an optional
dependency: ``pip install 'klpenalty[triton]'``; this module imports without it).

**Forward.** Program (row, split) walks its columns in ``BLOCK`` chunks, reads each logit once
in its own dtype (bf16/fp16/fp32), keeps the state of both models in float32 — maxima in logit
units, s_x = Σ e^u, s_y = Σ e^w, a = Σ e^u·(u − w) — and rescales it when a block raises a
max (a ← α·(a + (δ_x − δ_y)·s_x)), exactly the engine's merge. It writes its partial state
to an (N, splits, 5) float32 buffer ((N, splits, 3) = (m, s, b) for log-probs and entropy);
the splits of a row are merged with the engine's rescale-and-add in torch, and the (N,) merged
state is finalized by :func:`.engine.kl_finalize` / :func:`.engine.entropy_finalize`, so the
numerics and the stats layouts ((N, 6), (N, 3)) are the engine's. One split per row unless the
rows are too few to fill the GPU (:func:`split_columns`); ``vocab_chunk`` forces the split.
Float64 inputs run the streaming ops (the kernels compute in float32).

**Backward.** A (rows, vocabulary blocks) grid recomputes π (and ρ) from the stats and writes
∂/∂x (and ∂/∂y when needed) once, in the input's dtype; the upstream gradient (0 on masked rows
and ignored tokens) and the 0·log 0 guards are applied in the kernel, so rows with −inf entries
get finite gradients and masked rows exactly 0.

**Strides.** Rows are passed with their row stride: a (..., V) tensor whose leading dimensions
flatten to one stride and whose last dimension is contiguous is read in place; any other
layout is copied once by ``reshape``/``contiguous``.

The careful-arithmetic flag (column 5 of the KL stats) marks the rows without a distribution or
with E_π[u − w] = +inf only: the backward kernel always uses the guarded arithmetic.
"""

from __future__ import annotations

import os
import warnings
from typing import Optional

import torch
from torch import Tensor

from .. import _validation as v
from . import autograd as ag
from . import streaming
from .engine import (
    EntropyState,
    KLState,
    LSEState,
    entropy_finalize,
    entropy_rescale,
    kl_finalize,
    kl_rescale,
)

__all__ = [
    "full_kl",
    "token_logprobs",
    "entropy",
    "token_stats",
    "available",
    "interpreted",
    "check_device",
    "split_columns",
    "MAX_BLOCK",
    "INSTALL_HINT",
]

# Columns per forward/backward block: 4096 bf16 = 8 KiB per row and model per step.
MAX_BLOCK = 4096
# Programs per SM the forward wants before it splits rows across programs.
PROGRAMS_PER_SM = 4

INSTALL_HINT = "install Triton (`pip install 'klpenalty[triton]'`)"

_jit = None  # the kernels module, once imported
_error: str | None = None  # None = not tried, "" = imported, else why not
_warned = False


def _kernels():
    """The kernels module (imports Triton); raises ImportError where Triton is missing."""
    global _jit
    if _jit is None:
        from . import _triton_jit

        _jit = _triton_jit
    return _jit


@torch.compiler.assume_constant_result
def available() -> bool:
    """Whether Triton imports (tried once per process)."""
    global _error
    if _error is None:
        try:
            _kernels()
            _error = ""
        except Exception as exc:  # any failure to import means the portable path
            _error = f"{type(exc).__name__}: {exc}"[:300]
    return not _error


def note_fallback() -> None:
    """One warning per process: CUDA tensors run the streaming backend because Triton is missing."""
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(
            f"klpenalty: Triton is unavailable ({_error}); CUDA tensors use the portable "
            f"'streaming' backend. For the fused GPU kernels, {INSTALL_HINT}",
            RuntimeWarning,
            stacklevel=3,
        )


def interpreted() -> bool:
    """Whether the kernels run in Triton's interpreter (``TRITON_INTERPRET=1`` when they were
    first imported in this process; then they run on CPU tensors)."""
    if _jit is None:
        return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
    return bool(_jit.INTERPRETED)


def check_device(device: torch.device) -> None:
    """Raise ValueError unless the Triton kernels can run on ``device`` in this process."""
    if not available():
        raise ValueError(f"backend 'triton' needs Triton, which is unavailable ({_error}); {INSTALL_HINT}")
    if device.type == "cuda" and not interpreted():
        return
    if device.type == "cpu" and interpreted():
        return
    if device.type == "cpu":
        raise ValueError(
            "backend 'triton' runs on CUDA tensors; on CPU tensors only in Triton's interpreter "
            "(TRITON_INTERPRET=1 set before the first use), got CPU tensors: use backend='auto', "
            "'native' or 'streaming'"
        )
    raise ValueError(
        f"backend 'triton' runs on CUDA tensors (CPU tensors under TRITON_INTERPRET=1), got "
        f"tensors on {device}"
        + ("; the kernels were imported in interpreter mode" if device.type == "cuda" else "")
    )


# ------------------------------------------------------------------------------ launch helpers
def _rows(x: Tensor) -> Tensor:
    """(..., V) → (N, V) with unit column stride: a view when the layout allows, else a copy."""
    xf = x.reshape(-1, x.shape[-1])
    return xf if xf.stride(-1) == 1 or xf.shape[-1] <= 1 else xf.contiguous()


def _block(vocab: int, cap: int = MAX_BLOCK) -> int:
    return max(16, min(cap, 1 << max(0, vocab - 1).bit_length()))


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


def split_columns(n_rows: int, vocab: int, device: torch.device, vocab_chunk: int = 0) -> tuple[int, int]:
    """(BLOCK, columns per program) of the forward for an (n_rows, vocab) problem.

    ``vocab_chunk`` > 0 forces programs of that many columns (rounded up to the block; the
    block shrinks to fit the chunk). Otherwise a row is split only when the rows alone give
    fewer than :data:`PROGRAMS_PER_SM` programs per SM, into at most that many programs, each
    at least 4 blocks long.
    """
    if vocab_chunk > 0:
        block = _block(min(vocab_chunk, vocab))
        return block, -(-vocab_chunk // block) * block
    block = _block(vocab)
    want = PROGRAMS_PER_SM * _sm_count(device)
    if n_rows >= want:
        return block, max(vocab, 1)
    blocks = -(-vocab // block)
    splits = max(1, min(-(-want // max(n_rows, 1)), blocks // 4))
    return block, -(-blocks // splits) * block


def _warps(block: int) -> int:
    return 8 if block >= 2048 else 4


def _states(kernel, tensors, n: int, vocab: int, fields: int, temperature: float, vocab_chunk: int):
    """Run a forward kernel: (n, fields) float32 partial states per split → (n, splits, fields)."""
    device = tensors[0].device
    block, cols = split_columns(n, vocab, device, vocab_chunk)
    splits = max(1, -(-vocab // cols))
    out = torch.empty((n, splits, fields), dtype=torch.float32, device=device)
    if n == 0:
        return out
    inv_t = 1.0 / temperature
    strides = [t.stride(0) for t in tensors]
    kernel[(n, splits)](
        *tensors, out, *strides, vocab, cols, splits, inv_t, inv_t * 1.4426950408889634,
        BLOCK=block, num_warps=_warps(block),
    )
    return out


def _merged(parts: Tensor, cls, rescale, temperature: float, max_fields: tuple[int, ...]):
    """Merge the (n, splits, k) partial states of a row's splits: the engine's rescale to the
    common maxima, then a sum over splits. Returns a ``cls`` of (n,) tensors."""
    state = cls(*parts.unbind(-1))
    if parts.shape[1] == 1:
        return cls(*(f[:, 0] for f in state))
    maxima = [parts[..., i].amax(1, keepdim=True) for i in max_fields]
    scaled = rescale(state, *maxima, temperature)
    return cls(*(f.sum(1) if i not in max_fields else f[:, 0] for i, f in enumerate(scaled)))


def _portable(*tensors: Tensor) -> bool:
    """Float64 inputs (float64 math) and empty vocabularies run the streaming ops."""
    return any(t.dtype == torch.float64 for t in tensors) or tensors[0].shape[-1] == 0


def _kl_state(xf: Tensor, yf: Tensor, temperature: float, vocab_chunk: int) -> KLState:
    n, vocab = xf.shape
    parts = _states(_kernels().kl_state_kernel, (xf, yf), n, vocab, 5, temperature, vocab_chunk)
    return _merged(parts, KLState, kl_rescale, temperature, (0, 2))


def _entropy_state(xf: Tensor, temperature: float, vocab_chunk: int) -> EntropyState:
    n, vocab = xf.shape
    parts = _states(_kernels().entropy_state_kernel, (xf,), n, vocab, 3, temperature, vocab_chunk)
    return _merged(parts, EntropyState, entropy_rescale, temperature, (0,))


def _grads(kind: int, g: Tensor, xf: Tensor, yf: Tensor, stats: Tensor, temperature: float,
           need_x: bool, need_y: bool, tok: Tensor | None = None, at_tok: Tensor | None = None):
    """Launch the backward kernel over (rows, vocabulary blocks); (N, V) contiguous outputs."""
    n, vocab = xf.shape
    gx = torch.empty((n, vocab), dtype=xf.dtype, device=xf.device) if need_x else None
    gy = torch.empty((n, vocab), dtype=yf.dtype, device=yf.device) if need_y else None
    if n and vocab:
        block = _block(vocab, 1024)
        inv_t = 1.0 / temperature
        dummy = g
        _kernels().grad_kernel[(n, -(-vocab // block))](
            xf, yf, gx if need_x else xf, gy if need_y else xf,
            stats.contiguous(), g.contiguous(),
            dummy if tok is None else tok, dummy if at_tok is None else at_tok,
            xf.stride(0), yf.stride(0), vocab, inv_t, inv_t * 1.4426950408889634,
            KIND=kind, NEED_X=need_x, NEED_Y=need_y, BLOCK=block, num_warps=_warps(block),
        )
    return gx, gy


# ------------------------------------------------------------------------------ custom ops
@torch.library.custom_op("klpenalty::triton_full_kl", mutates_args=())
def _full_kl_op(
    x: Tensor,
    y: Tensor,
    mask: Optional[Tensor],
    temperature: float,
    check: bool,
    tile_rows: int,
    tile_cols: int,
) -> tuple[Tensor, Tensor]:
    """(..., V) logits → KL (...) and stats (..., 6); ``tile_cols`` > 0 forces the split width
    (``tile_rows`` is unused: one program per row)."""
    if _portable(x, y):
        return streaming._full_kl_op(x, y, mask, temperature, check, tile_rows, tile_cols)
    xf = _rows(x)
    yf = _rows(y)
    kl, stats = kl_finalize(_kl_state(xf, yf, temperature, tile_cols), None)
    return streaming.masked_checked(kl, stats, mask, check, {"policy_logits": x, "ref_logits": y})


@torch.library.custom_op("klpenalty::triton_full_kl_backward", mutates_args=())
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
    if _portable(x, y):
        return streaming._full_kl_backward_op(
            grad, x, y, stats, mask, temperature, need_x, need_y, tile_rows, tile_cols
        )
    g = ag.masked_grad(grad, mask, stats.dtype).reshape(-1)  # (N,)
    gx, gy = _grads(0, g, _rows(x), _rows(y), stats.reshape(-1, 6), temperature, need_x, need_y)
    return (
        gx.view(x.shape) if need_x else x.new_empty(0),
        gy.view(y.shape) if need_y else y.new_empty(0),
    )


@torch.library.custom_op("klpenalty::triton_token_logprobs", mutates_args=())
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
    if _portable(x):
        return streaming._token_logprobs_op(
            x, tokens, temperature, ignore_index, check, tile_rows, tile_cols
        )
    if check:
        v.check_token_range(tokens, x.shape[-1], ignore_index)
    xf = _rows(x)
    tok, ignored = ag.safe_tokens(tokens.reshape(-1), ignore_index)
    state = _entropy_state(xf, temperature, tile_cols)
    lse = LSEState(state.m, state.s)
    return streaming.lse_finish(x, xf, tok, ignored, lse, temperature, check)


@torch.library.custom_op("klpenalty::triton_token_logprobs_backward", mutates_args=())
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
    if _portable(x):
        return streaming._token_logprobs_backward_op(
            grad, x, tokens, stats, temperature, ignore_index, tile_rows, tile_cols
        )
    tok, ignored = ag.safe_tokens(tokens.reshape(-1), ignore_index)
    st = stats.reshape(-1, 3)  # (N, 3)
    g = grad.reshape(-1).to(st.dtype).masked_fill(ignored, 0.0)  # (N,)
    # at the token: (1 − π_t)·g/T = −expm1(log π_t)·g/T, exact for π_t near 1
    at_token = -torch.expm1(st[:, 2]) * g / temperature
    xf = _rows(x)
    gx, _ = _grads(1, g, xf, xf, st, temperature, True, False, tok, at_token)
    return gx.view(x.shape)


@torch.library.custom_op("klpenalty::triton_entropy", mutates_args=())
def _entropy_op(
    x: Tensor,
    mask: Optional[Tensor],
    temperature: float,
    check: bool,
    tile_rows: int,
    tile_cols: int,
) -> tuple[Tensor, Tensor]:
    """(..., V) logits → H(π) (...) and stats (..., 3)."""
    if _portable(x):
        return streaming._entropy_op(x, mask, temperature, check, tile_rows, tile_cols)
    h, stats = entropy_finalize(_entropy_state(_rows(x), temperature, tile_cols))
    return streaming.masked_checked(h, stats, mask, check, {"logits": x})


@torch.library.custom_op("klpenalty::triton_entropy_backward", mutates_args=())
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
    if _portable(x):
        return streaming._entropy_backward_op(
            grad, x, stats, mask, temperature, tile_rows, tile_cols
        )
    g = ag.masked_grad(grad, mask, stats.dtype).reshape(-1)  # (N,)
    xf = _rows(x)
    gx, _ = _grads(2, g, xf, xf, stats.reshape(-1, 3), temperature, True, False)
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
    vocab_chunk: int | None = None,
) -> Tensor:
    """Exact KL(softmax(x/T) ‖ softmax(y/T)) per position with the Triton kernels.

    The contract of :func:`.streaming.full_kl` (unchecked internal entry point);
    ``vocab_chunk`` > 0 forces the split-vocabulary forward with programs of that many columns.
    Raises ValueError where the kernels cannot run on the tensors' device (:func:`check_device`).
    """
    check_device(x.device)
    kl, _ = _full_kl_op(x, y, mask, float(temperature), bool(check), 0, int(vocab_chunk or 0))
    return kl


def token_logprobs(
    x: Tensor,
    tokens: Tensor,
    temperature: float,
    *,
    ignore_index: int = -100,
    check: bool = False,
    vocab_chunk: int | None = None,
) -> Tensor:
    """log softmax(x/T)[token] per position with the Triton kernels (as
    :func:`.streaming.token_logprobs`; ``vocab_chunk`` as in :func:`full_kl`)."""
    check_device(x.device)
    out, _ = _token_logprobs_op(
        x, tokens, float(temperature), int(ignore_index), bool(check), 0, int(vocab_chunk or 0)
    )
    return out


def entropy(
    x: Tensor,
    mask: Tensor | None,
    temperature: float,
    *,
    check: bool = False,
    vocab_chunk: int | None = None,
) -> Tensor:
    """Policy entropy H(softmax(x/T)) per position with the Triton kernels (as
    :func:`.streaming.entropy`; ``vocab_chunk`` as in :func:`full_kl`)."""
    check_device(x.device)
    h, _ = _entropy_op(x, mask, float(temperature), bool(check), 0, int(vocab_chunk or 0))
    return h


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
    tile_elements: int = streaming.TILE_ELEMENTS,
) -> Tensor:
    """The one-pass token statistics out (..., 4) (the contract of :func:`.streaming.token_stats`).

    For now this runs the streaming op; the Triton kernels implement the same op contract
    (``ops/autograd.py``) and replace this body.
    """
    check_device(x.device)
    return streaming.token_stats(
        x, y, tokens, mask, keep, tau, temperature, ignore_index=ignore_index, want=want,
        check=check, chunk_rows=chunk_rows, vocab_chunk=vocab_chunk, tile_elements=tile_elements,
    )
