"""The host of the Triton backend's second walk, ``klpenalty::triton_divergence`` and
``_divergence_backward`` (CUDA tensors; CPU tensors under ``TRITON_INTERPRET=1``): the
divergences of :mod:`..divergence` in the kernels of :mod:`._kernels_divergence`.

**Forward.** :func:`._kernels_divergence.divergence_kernel`, specialised by the kind, reads the
forward's stats (the shifts and log-sums of both models) and sums each row's f and π·g, the
value and ḡ, in float32. The split plan is the statistics kernels' (:func:`.token_stats.
split_columns`): a program per row where rows fill the GPU, else rows split into programs of
k·1024 columns whose (N, splits, 2) partial sums
:func:`._kernels_divergence.divergence_merge_kernel` adds up. Masked rows read nothing and give
exactly 0.

**Backward.** :func:`._kernels_divergence.divergence_grad_kernel` over a (rows, vocabulary
blocks) grid writes grad·(π·g − π·ḡ)/T in x's dtype, the upstream gradient read through its
stride (an expanded ``value.sum()`` gradient is not copied) and masked in the kernel: masked
rows and rows whose gradient is 0 get exactly 0, whatever their logits hold.

Both launch on x's device and read nothing back. Float64 inputs and empty vocabularies run the
streaming backend's ops (:func:`._host.portable_op`; the kernels compute in float32).
"""

from __future__ import annotations

import functools

import torch

from ..divergence import KINDS, Divergence
from . import _host
from ._load import _kernels
from .token_stats import GRAD_TILES, split_columns

__all__ = ["divergence_op", "divergence_backward_op", "MAX_BLOCK"]

# Columns per block of the divergence kernels (a few transcendentals per entry: 1024 columns over
# 4 warps keep the accumulators and the terms in registers).
MAX_BLOCK = 1024


@functools.cache
def _columns(kernel: str) -> dict[str, int]:
    """The stats columns a kernel of :mod:`._kernels_divergence` takes, by name."""
    from . import _kernels_divergence  # imported already where a kernel runs (imports Triton)

    return _host.column_constexprs(getattr(_kernels_divergence, kernel))


def _check_kind(kind: int) -> None:
    if kind not in tuple(Divergence):
        raise ValueError(f"kind must be one of {list(KINDS)}, got {kind!r}")


def _row_args(x, y, keep, tau, stats, mask, temperature: float, param: float):
    """The rows of x, y and keep (uint8), the stats flat (row r's at r·STATS_COLS), the mask as
    uint8 (or None), the support's pointers (keep, tau: x and the stats where absent) and the
    scalars after V: 1/T and the kind's weights w, 1 − w (float64 on the host, float32 in the
    kernel)."""
    rows = _host.rows(x, y, keep)
    st = _host.flat(stats)
    tauf = _host.flat(tau)
    support = (rows.x if rows.keep is None else rows.keep, st if tauf is None else tauf)
    return (rows, st, _host.flat(mask, torch.uint8), support,
            (1.0 / temperature, param, 1.0 - param))


def divergence_op(x, y, stats, mask, keep, tau, temperature, kind, param):
    """(value (...), ḡ (...)) float32 of the kind over the rows of (..., V) x and y, 0 at masked
    rows, the student on the support ``keep`` / ``tau``: one kernel program per row (or per
    split of a row, then the merge kernel) (SCHEMAS["divergence"])."""
    if _host.portable(x, y):
        return _host.portable_op("divergence")(x, y, stats, mask, keep, tau, temperature, kind,
                                               param)
    _check_kind(kind)
    vocab = x.shape[-1]
    n = x.numel() // vocab
    leading = x.shape[:-1]
    value = torch.empty(n, dtype=torch.float32, device=x.device)
    gbar = torch.empty(n, dtype=torch.float32, device=x.device)
    if n == 0:
        return value.view(leading), gbar.view(leading)
    rows, st, maskf, support, scalars = _row_args(x, y, keep, tau, stats, mask, temperature,
                                                  param)
    block, cols = split_columns(n, vocab, x.device)
    block = min(block, MAX_BLOCK)  # divides cols where rows are split
    splits = max(1, -(-vocab // cols))
    kernels = _kernels()
    flags = dict(KIND=int(kind), HAS_MASK=maskf is not None, HAS_KEEP=keep is not None,
                 HAS_TAU=tau is not None, BLOCK=block, **_columns("divergence_kernel"),
                 num_warps=_host.warps(block))
    pointers = (rows.x, rows.y, *support, st, st if maskf is None else maskf)
    if splits == 1:
        _host.launch(kernels.divergence_kernel, (n, 1), x.device, *pointers, value, gbar,
                     *rows.args, vocab, cols, 1, *scalars, FINISH=True, **flags)
    else:
        parts = torch.empty((n, splits, 2), dtype=torch.float32, device=x.device)
        _host.launch(kernels.divergence_kernel, (n, splits), x.device, *pointers, parts, parts,
                     *rows.args, vocab, cols, splits, *scalars, FINISH=False, **flags)
        _host.launch(kernels.divergence_merge_kernel, (n,), x.device, parts, value, gbar, splits,
                     SPLITS=max(2, 1 << (splits - 1).bit_length()), num_warps=1)
    return value.view(leading), gbar.view(leading)


def divergence_backward_op(grad, x, y, stats, gbar, mask, keep, tau, temperature, kind, param):
    """∂/∂x (..., V) of Σ grad·value in x's dtype (SCHEMAS["divergence_backward"]):
    grad·(π·g − π·ḡ)/T, exactly 0 on masked rows, rows whose grad is 0 and off the support."""
    if _host.portable(x, y):
        return _host.portable_op("divergence_backward")(
            grad, x, y, stats, gbar, mask, keep, tau, temperature, kind, param
        )
    _check_kind(kind)
    vocab = x.shape[-1]
    n = x.numel() // vocab
    gx = torch.empty((n, vocab), dtype=x.dtype, device=x.device)
    if n:
        rows, st, maskf, support, scalars = _row_args(x, y, keep, tau, stats, mask,
                                                      temperature, param)
        g = grad.reshape(-1)  # (N,), read through its stride
        block = _host.block(vocab, MAX_BLOCK)
        _host.launch(
            _kernels().divergence_grad_kernel, (n, -(-vocab // (block * GRAD_TILES))), x.device,
            rows.x, rows.y, *support, st, g, _host.flat(gbar), st if maskf is None else maskf,
            gx, *rows.args, g.stride(0), vocab, *scalars, KIND=int(kind),
            HAS_MASK=maskf is not None, HAS_KEEP=keep is not None, HAS_TAU=tau is not None,
            BLOCK=block, TILES=GRAD_TILES,
            **_columns("divergence_grad_kernel"), num_warps=_host.warps(block),
        )
    return gx.view(x.shape)
