"""What the kernel modules (:mod:`._kernels_stats`, :mod:`._kernels_threshold`,
:mod:`._kernels_divergence`) share: whether they run interpreted, how a device function is
declared, the addressing of a row and of a program's columns, the loads and stores of a block,
and e^z − 1 accurate near 0 (Triton's interpreter runs no libdevice: it is written with plain
``triton.language``).

Importing this module imports Triton (the package imports it lazily, at the first use). Whether
the kernels run compiled or in Triton's interpreter (``TRITON_INTERPRET=1``, CPU tensors) is
decided by Triton when they are decorated, at the import of the kernel modules. Only Triton APIs
present in Triton 3.6 are used.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["INTERPRETED"]


@triton.jit
def _probe():
    pass


# Triton decides at decoration time whether a kernel is interpreted (TRITON_INTERPRET=1).
INTERPRETED = type(_probe).__name__ == "InterpretedFunction"


def _device(fn):
    """A device function of the kernels: compiled with them; in the interpreter a plain Python
    function running under the kernel's patched ``triton.language`` (the same code: the
    interpreter re-patches the whole language at every call of a jit function, ~1 ms)."""
    return fn if INTERPRETED else triton.jit(fn)


@_device
def _row_offset(row, T, stride_b, stride_t):
    """Element offset of row ``row`` (int64) of a (B, T, V) layout: (row // T)·stride_b +
    (row % T)·stride_t (a (N, V) layout is B = 1; the usual ``logits[:, :-1]`` is read in
    place)."""
    b = row // T
    return b * stride_b + (row - b * T) * stride_t


@_device
def _split_columns(split, cols, n_splits, V):
    """(c0, c1): the columns [split·cols, min((split + 1)·cols, V)) of a row's program
    ``split`` of ``n_splits``; [0, V) for a whole row, with c0 = 0 a constant where the JIT
    specialises ``n_splits`` = 1 (a constexpr: the loads from column 0 are aligned wherever
    the row stride is)."""
    if n_splits == 1:
        c0 = 0
        c1 = V
    else:
        c0 = split * cols
        c1 = tl.minimum(c0 + cols, V)
    return c0, c1


@_device
def _load(row, col, c1, other, MASKED: tl.constexpr):
    """``row[col]``: masked to the columns before ``c1`` (``other`` after) or, for a block known
    to lie before ``c1``, unmasked (no per-element select: the loads keep their vector width)."""
    if MASKED:
        v = tl.load(row + col, mask=col < c1, other=other)
    else:
        v = tl.load(row + col)
    return v


@_device
def _store(row, col, c1, v, MASKED: tl.constexpr):
    """``row[col] = v`` (masked as :func:`_load`)."""
    if MASKED:
        tl.store(row + col, v, mask=col < c1)
    else:
        tl.store(row + col, v)


@_device
def _expm1_near(z):
    """e^z − 1 for |z| < 0.5 in float32: a degree-8 Taylor polynomial, relative error < 2e-8
    there."""
    t = 1.0 + z * (0.5 + z * (0.16666666666666666 + z * (0.041666666666666664 + z * (
        0.008333333333333333 + z * (0.001388888888888889 + z * (0.0001984126984126984 + z * (
            2.48015873015873e-05)))))))
    return z * t


@_device
def _expm1(z):
    """e^z − 1 in float32, accurate near 0 (:func:`_expm1_near` for |z| < 0.5, e^z − 1
    elsewhere): Triton's interpreter runs no libdevice."""
    return tl.where(tl.abs(z) < 0.5, _expm1_near(z), tl.exp(z) - 1.0)
