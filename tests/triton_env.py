"""The Triton interpreter switch of the tests (imports nothing of klpenalty: the conftest
enters it before klpenalty, and with it Triton, is first imported)."""

from __future__ import annotations

import contextlib
import os

import torch

__all__ = ["triton_interpreter_env"]


@contextlib.contextmanager
def triton_interpreter_env():
    """``TRITON_INTERPRET=1`` inside the block where no GPU exists (the previous value restored
    after): Triton's kernels then run in its interpreter, on CPU tensors."""
    before = os.environ.get("TRITON_INTERPRET")
    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = before
