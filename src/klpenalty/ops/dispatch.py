"""Backend choice for the exact-KL ops.

A backend is a module-like object with two functions on flattened tensors:

- ``full_kl(x, y, mask, temperature) -> (N,)`` with x, y (N, V), mask (N,) bool or None;
- ``token_logprobs(x, tokens, temperature) -> (N,)`` with x (N, V), tokens (N,) int64.

Both return float32 (float64 for float64 inputs) and are differentiable. ``"auto"`` picks the
best available backend for the tensors' device; it never reads environment variables.
"""

from __future__ import annotations

from types import ModuleType

import torch

from . import eager

__all__ = ["BACKENDS", "get_backend", "available_backends"]

# name -> backend module. Registered in order of preference for "auto".
BACKENDS: dict[str, ModuleType] = {"eager": eager}


def available_backends() -> list[str]:
    """Names accepted by ``backend=`` (besides ``"auto"``)."""
    return list(BACKENDS)


def get_backend(name: str, device: torch.device) -> ModuleType:
    """Resolve ``name`` (``"auto"`` or one of :func:`available_backends`) for ``device``."""
    if name == "auto":
        return BACKENDS["eager"]
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {['auto', *BACKENDS]}, got {name!r}")
    return BACKENDS[name]
