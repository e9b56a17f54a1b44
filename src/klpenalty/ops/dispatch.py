"""Backend choice for the exact-KL ops.

A backend is a module-like object with two functions on flattened tensors:

- ``full_kl(x, y, mask, temperature) -> (N,)`` with x, y (N, V), mask (N,) bool or None;
- ``token_logprobs(x, tokens, temperature) -> (N,)`` with x (N, V), tokens (N,) int64.

Both return float32 (float64 for float64 inputs) and are differentiable.

Backends:

- ``"streaming"``: the single-pass tiled engine in eager PyTorch (:mod:`.streaming`). Any
  device, no compilation, no warm-up. This is what ``"auto"`` picks.
- ``"compiled"``: the same engine with its per-tile math compiled by ``torch.compile``
  (:mod:`.compiled`). Opt-in: its first call in a fresh process compiles for tens of seconds on
  a small CPU, and on the CPUs measured it was not faster than ``"streaming"`` (see
  benchmarks/README.md). Falls back to ``"streaming"`` with a one-time warning if compiling fails.
- ``"eager"``: the older row-chunked log-softmax implementation (:mod:`.eager`), kept as a
  simple second opinion.

``"auto"`` never reads environment variables.
"""

from __future__ import annotations

from types import ModuleType

import torch

from . import compiled, eager, streaming

__all__ = ["BACKENDS", "get_backend", "available_backends"]

# name -> backend module. "auto" resolves to the first entry.
BACKENDS: dict[str, ModuleType] = {"streaming": streaming, "compiled": compiled, "eager": eager}


def available_backends() -> list[str]:
    """Names accepted by ``backend=`` (besides ``"auto"``)."""
    return list(BACKENDS)


def get_backend(name: str, device: torch.device) -> ModuleType:
    """Resolve ``name`` (``"auto"`` or one of :func:`available_backends`) for ``device``.

    ``"auto"`` is the eager streaming engine on every device: it needs no compiler, starts
    instantly, and measured as fast as the compiled tiles on CPU (a GPU kernel is future work).
    """
    if name == "auto":
        return BACKENDS["streaming"]
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {['auto', *BACKENDS]}, got {name!r}")
    return BACKENDS[name]
