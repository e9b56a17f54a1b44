"""Eager ATen ops the Triton backend's host code dispatches per op call, around its kernels.

Each op a GPU call dispatches costs a few µs of CPU (and a launch where it computes): this
counts them with a TorchDispatchMode, per forward and backward call of the ``triton`` ops, for
the KL alone, all four statistics (tokens and a mask), and split rows (``vocab_chunk=16``). The
kernels' own launches are run outside the counter (under ``TRITON_INTERPRET=1`` they are
numpy, with copies of their arguments that are not the op's work).

Runs on CPU tensors in Triton's interpreter (or compiled on CUDA), with the package of any tree
on ``PYTHONPATH`` (it only needs ``klpenalty.ops.triton._load``'s ``_kernels``/``_jit`` and the
forward and backward ops of ``klpenalty.ops.triton.token_stats``), so the same script measures a
tree before and after a change::

    TRITON_INTERPRET=1 PYTHONPATH=src python benchmarks/triton_host_ops.py
"""

from __future__ import annotations

import collections
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "0" if "--cuda" in sys.argv else "1")

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes  # noqa: E402

from klpenalty.ops import triton as backend  # noqa: E402
from klpenalty.ops.triton.token_stats import token_stats_backward_op as backward_op  # noqa: E402
from klpenalty.ops.triton.token_stats import token_stats_op as forward_op  # noqa: E402


class _Kernel:
    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            with _disable_current_modes():
                return self.kernel[grid](*args, **kwargs)

        return launch


class _Kernels:
    """The kernels with every launch outside the dispatch modes."""

    def __init__(self, module):
        self.module = module

    def __getattr__(self, name):
        value = getattr(self.module, name)
        return _Kernel(value) if hasattr(value, "__getitem__") and hasattr(value, "fn") else value


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _count(fn, *args):
    fn(*args)  # warm: compiles / imports outside the count
    with _CountOps() as mode:
        result = fn(*args)
    return result, mode.ops


def main() -> None:
    device = torch.device("cuda" if "--cuda" in sys.argv else "cpu")
    backend._load._jit = _Kernels(backend._load._kernels())
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 40, generator=gen).to(device)
    y = (x + torch.randn(2, 3, 40, generator=gen).to(device))
    tokens = torch.randint(0, 40, (2, 3), generator=gen).to(device)
    tokens[0, 1] = -100
    mask = torch.ones(2, 3, dtype=torch.bool, device=device)
    mask[1, 2] = False
    rows = []
    for name, want, tok, msk, chunk in (
        ("KL", 1, None, None, 0),
        ("all four, tokens + mask", 15, tokens, mask, 0),
        ("KL, split rows", 1, None, None, 16),
    ):
        (_, stats), fwd = _count(forward_op, x, y, tok, msk, None, None, 0.9, -100, want,
                                 False, 0, chunk, 0, 1.0, 0.0)
        grad = torch.linspace(-1, 1, 24, device=device).reshape(2, 3, 4)
        _, bwd = _count(backward_op, grad, x, y, tok, None, stats, msk, None,
                        None, 0.9, -100, want, True, True, 0, chunk)
        rows.append((name, len(fwd), len(bwd), fwd, bwd))
    print(f"device {device}, triton interpreted: {backend.interpreted()}")
    print("| call | forward ops | backward ops |\n|---|---:|---:|")
    for name, nf, nb, _, _ in rows:
        print(f"| {name} | {nf} | {nb} |")
    if "-v" in sys.argv:
        for name, _, _, fwd, bwd in rows:
            print(name, "forward:", dict(collections.Counter(fwd)))
            print(name, "backward:", dict(collections.Counter(bwd)))


if __name__ == "__main__":
    main()
