"""What the kernels of :mod:`._kernels_stats` and :mod:`._kernels_threshold` share: whether
they run interpreted, how a device function is declared, and the addressing of a row.

Importing this module imports Triton (the package imports it lazily, at the first use). Whether
the kernels run compiled or in Triton's interpreter (``TRITON_INTERPRET=1``, CPU tensors) is
decided by Triton when they are decorated, at the import of the kernel modules. Only Triton APIs
present in Triton 3.6 are used.
"""

from __future__ import annotations

import triton

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
