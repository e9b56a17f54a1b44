"""The host code that the ops of the Triton backend share (:mod:`.token_stats`,
:mod:`.threshold`, :mod:`.divergence`): every launch, on the tensors' device; the rows of the
(..., V) inputs as the kernels address them; the block width and its warps; the contract's
column layouts as a kernel's constexprs; which inputs the kernels do not take, and the ops that
take them instead.

**Layouts.** Rows r of a (..., T, V) input are read at (r // T)·stride_b + (r % T)·stride_t
(:func:`strides`): in place where the dimensions before −2 collapse to one stride and the last
dimension is contiguous (``logits[:, :-1]``, transposes of (B, T)); other layouts are copied
once. **Device.** Every launch goes through :func:`launch`, which makes the tensors' CUDA
device current (Triton launches on the current device).
"""

from __future__ import annotations

import contextlib
import inspect
from typing import NamedTuple

import torch
from torch import Tensor

from .. import contract

__all__ = ["launch", "Rows", "strides", "rows", "flat", "block", "warps", "column_constexprs",
           "portable", "portable_op", "PORTABLE"]

# The backend whose ops run the inputs the kernels do not take (:func:`portable`).
PORTABLE = "streaming"


def _on_device(device: torch.device):
    """The context of a launch: the tensors' CUDA device made current (Triton launches on the
    current device, whatever the tensors' device), nothing elsewhere."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def launch(kernel, grid: tuple[int, ...], device: torch.device, *args, **kwargs) -> None:
    """``kernel[grid](*args, **kwargs)`` on ``device`` (every launch of the backend)."""
    with _on_device(device):
        kernel[grid](*args, **kwargs)


class Rows(NamedTuple):
    """The (..., V) inputs of a call as rows r = b·T + t read in place: x, y, keep (uint8; y
    and keep None where not read) and (T, stride_b, stride_t) for each of the three."""

    x: Tensor
    y: Tensor | None
    keep: Tensor | None
    args: tuple[int, ...]  # T, x's (stride_b, stride_t), y's, keep's


def strides(t: Tensor, rows_t: int) -> tuple[Tensor, int, int]:
    """(t, stride_b, stride_t): row r of t's (..., V) starts at element (r // T)·stride_b +
    (r % T)·stride_t, T = ``rows_t`` (t's dimension −2). ``t`` itself when its last dimension
    is contiguous and the dimensions before −2 collapse to one stride (``logits[:, :-1]``,
    transposes of (B, T)); else a contiguous copy."""
    if t.dim() == 1:
        return t, 0, 0
    shape, stride = t.shape, t.stride()
    if shape[-1] <= 1 or stride[-1] == 1:
        outer = [(size, step) for size, step in zip(shape[:-2], stride[:-2]) if size != 1]
        if all(s0 == s1 * n1 for (_, s0), (n1, s1) in zip(outer, outer[1:])):
            return t, (outer[-1][1] if outer else 0), stride[-2]
    t = t.contiguous()
    return t, rows_t * shape[-1], shape[-1]


def rows(x: Tensor, y: Tensor | None, keep: Tensor | None) -> Rows:
    """The rows of x, y and keep for the kernels' row addressing (y and keep viewed with x's
    leading shape, which they share: the same N rows)."""
    rows_t = x.shape[-2] if x.dim() >= 2 else 1
    like = lambda t: t if t.shape[:-1] == x.shape[:-1] else t.reshape(*x.shape[:-1], -1)  # noqa: E731
    xs, *sx = strides(x, rows_t)
    ys, *sy = strides(like(y), rows_t) if y is not None else (None, 0, 0)
    ks, *sk = strides(like(keep).view(torch.uint8), rows_t) if keep is not None else (None, 0, 0)
    return Rows(xs, ys, ks, (max(rows_t, 1), *sx, *sy, *sk))


def flat(t: Tensor | None, dtype: torch.dtype | None = None) -> Tensor | None:
    """A per-row (...) tensor as contiguous (N,) (a view where it is one), viewed as
    ``dtype``."""
    if t is None:
        return None
    t = t.reshape(-1).contiguous()
    return t if dtype is None else t.view(dtype)


def block(vocab: int, cap: int) -> int:
    """The columns of a kernel's block for rows of ``vocab``: a power of two from 16, at most
    ``cap``."""
    return max(16, min(cap, 1 << max(0, vocab - 1).bit_length()))


def warps(block: int) -> int:
    """The warps of a program that walks a row in blocks of ``block`` columns."""
    return 8 if block >= 2048 else 4


def column_constexprs(kernel) -> dict[str, int]:
    """The column layouts of :mod:`..contract` as the ``tl.constexpr`` s of ``kernel`` (a
    ``@triton.jit`` function): every column constant of :data:`..contract.COLUMNS` that it
    takes, as a parameter of the same name."""
    params = inspect.signature(kernel.fn).parameters
    return {name: column for name, column in contract.COLUMNS.items() if name in params}


def portable(*tensors: Tensor | None) -> bool:
    """Whether the inputs go to the :data:`PORTABLE` backend's ops instead of the kernels:
    float64 inputs (float64 math) and empty vocabularies."""
    given = [t for t in tensors if t is not None]
    return any(t.dtype == torch.float64 for t in given) or given[0].shape[-1] == 0


def portable_op(op: str):
    """The :data:`PORTABLE` backend's op ``op`` (a key of :data:`..contract.SCHEMAS`), called
    through the dispatcher: that backend registers it (klpenalty imports every backend), and
    this package imports nothing of it."""
    namespace, name = contract.op_name(PORTABLE, op).split("::")
    return getattr(getattr(torch.ops, namespace), name).default
