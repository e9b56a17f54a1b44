"""Backend choice for the exact-KL ops.

A backend is a module with three functions on (..., V) tensors, already validated:

- ``full_kl(x, y, mask, temperature, *, check) -> (...)``;
- ``token_logprobs(x, tokens, temperature, *, ignore_index, check) -> (...)``;
- ``entropy(x, mask, temperature, *, check) -> (...)``.

All return float32 (float64 for float64 inputs), are differentiable (twice), and are built
on the per-row state of :mod:`.engine` through ``torch.library`` custom ops.

Backends:

- ``"streaming"``: the engine's tile loop in eager PyTorch (:mod:`.streaming`). Any device, no
  compilation, no warm-up.
- ``"native"``: the fused C++ CPU kernel (:mod:`.native`), built at its first use and cached.
  CPU tensors only. Where it cannot be built it warns once and runs ``"streaming"``, also when
  asked for by name, so code written for one machine runs on another.

``"auto"`` picks the fastest backend available for the device: ``"native"`` for CPU tensors when
it builds, else ``"streaming"``. It never reads environment variables.
"""

from __future__ import annotations

from types import ModuleType

import torch

from . import native, streaming

__all__ = ["BACKENDS", "get_backend", "available_backends"]

# name -> backend module (native builds its kernel lazily, at its first call)
BACKENDS: dict[str, ModuleType] = {"streaming": streaming, "native": native}


def available_backends() -> list[str]:
    """Names accepted by ``backend=`` (besides ``"auto"``)."""
    return list(BACKENDS)


def get_backend(name: str, device: torch.device) -> ModuleType:
    """Resolve ``name`` (``"auto"`` or one of :func:`available_backends`) for ``device``."""
    if name == "auto":
        return native if device.type == "cpu" and native.available() else streaming
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {['auto', *BACKENDS]}, got {name!r}")
    if name == "native" and device.type != "cpu":
        raise ValueError(
            f"backend 'native' runs on CPU tensors only, got tensors on {device}; "
            "use backend='auto' or 'streaming'"
        )
    return BACKENDS[name]
