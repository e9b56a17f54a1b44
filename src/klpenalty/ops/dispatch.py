"""Backend choice for the exact-KL ops.

A backend is a module with three functions on (..., V) tensors, already validated:

- ``full_kl(x, y, mask, temperature, *, check) -> (...)``;
- ``token_logprobs(x, tokens, temperature, *, ignore_index, check) -> (...)``;
- ``entropy(x, mask, temperature, *, check) -> (...)``;
- ``token_stats(x, y, tokens, mask, keep, tau, temperature, *, ignore_index, want, check, ...)
  -> (..., 4)``: the one-pass KL(π̃‖ρ), log π̃(t), log ρ(t), H(π̃) (the op contract of
  :mod:`.autograd`).

All return float32 (float64 for float64 inputs), are differentiable (twice), and are built
on the per-row state of :mod:`.engine` through ``torch.library`` custom ops.

Backends:

- ``"streaming"``: the engine's tile loop in eager PyTorch (:mod:`.streaming`). Any device, no
  compilation, no warm-up.
- ``"native"``: the fused C++ CPU kernel (:mod:`.native`), built at its first use and cached.
  CPU tensors only. Where it cannot be built it warns once and runs ``"streaming"``, also when
  asked for by name, so code written for one machine runs on another.
- ``"triton"``: fused Triton kernels (:mod:`.triton_kernels`; Triton is imported at the first
  use). CUDA tensors; CPU tensors only in Triton's interpreter (``TRITON_INTERPRET=1``, how the
  kernels are tested without a GPU). Asked for by name where it cannot run: ValueError.

``"auto"`` picks the fastest backend available for the device: ``"native"`` for CPU tensors when
it builds, ``"triton"`` for CUDA tensors when Triton imports (else ``"streaming"``, with one
warning per process), else ``"streaming"``. It never reads environment variables.
"""

from __future__ import annotations

from types import ModuleType

import torch

from . import native, streaming, triton_kernels

__all__ = ["BACKENDS", "get_backend", "available_backends", "device_backends"]

# name -> backend module (native builds its kernel lazily, at its first call; triton_kernels
# imports Triton at its first call)
BACKENDS: dict[str, ModuleType] = {
    "streaming": streaming,
    "native": native,
    "triton": triton_kernels,
}


def available_backends() -> list[str]:
    """Names accepted by ``backend=`` (besides ``"auto"``)."""
    return list(BACKENDS)


def device_backends(device: torch.device) -> list[str]:
    """The backends that run natively on tensors of ``device`` in this process: ``"streaming"``
    everywhere, ``"native"`` on CPU, ``"triton"`` on CUDA where Triton imports (the interpreter
    on CPU is a test mode, not listed)."""
    names = ["streaming"]
    if device.type == "cpu":
        names.append("native")
    elif device.type == "cuda" and triton_kernels.available() and not triton_kernels.interpreted():
        names.append("triton")
    return names


def get_backend(name: str, device: torch.device) -> ModuleType:
    """Resolve ``name`` (``"auto"`` or one of :func:`available_backends`) for ``device``."""
    if name == "auto":
        if device.type == "cpu":
            return native if native.available() else streaming
        if device.type == "cuda":
            if triton_kernels.available() and not triton_kernels.interpreted():
                return triton_kernels
            triton_kernels.note_fallback()
        return streaming
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {['auto', *BACKENDS]}, got {name!r}")
    if name == "native" and device.type != "cpu":
        raise ValueError(
            f"backend 'native' runs on CPU tensors only, got tensors on {device}; "
            "use backend='auto' or 'streaming'"
        )
    if name == "triton":
        triton_kernels.check_device(device)
    return BACKENDS[name]
