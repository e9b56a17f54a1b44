"""The backends as data: a registry of :class:`Backend` entries and the choice for a device.

A backend is a module implementing the four ops of :mod:`.contract` (``<name>_token_stats``,
``_backward``, ``_state`` and ``<name>_sampling_threshold``) plus one :class:`Backend` line in :data:`REGISTRY`; the public
functions, ``linear_kl`` and the vocabulary-parallel path all call the ops through
:func:`get_backend` and :func:`token_stats`. The ops take validated (..., V) tensors and return
float32 (float64 for float64 inputs).

Backends:

- ``"streaming"``: the engine's tile loop in eager PyTorch (:mod:`.streaming`). Any device, no
  compilation, no warm-up.
- ``"native"``: the fused C++ CPU kernel (:mod:`.native`), built at its first use and cached.
  CPU tensors only. Where it cannot be built it warns once and runs ``"streaming"``, also when
  asked for by name, so code written for one machine runs on another.
- ``"triton"``: fused Triton kernels (:mod:`.triton`; Triton is imported at the first
  use). CUDA tensors; CPU tensors only in Triton's interpreter (``TRITON_INTERPRET=1``, how the
  kernels are tested without a GPU). Asked for by name where it cannot run: ValueError.

``"auto"`` picks the fastest backend available for the device: ``"native"`` for CPU tensors when
it builds, ``"triton"`` for CUDA tensors when Triton imports (else ``"streaming"``, with one
warning per process), else ``"streaming"``. It never reads environment variables.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch
from torch import Tensor

from . import native, streaming
from . import triton as triton_backend

__all__ = [
    "Backend",
    "REGISTRY",
    "get_backend",
    "available_backends",
    "device_backends",
    "token_stats",
]


@dataclass(frozen=True)
class Backend:
    """One backend: where it runs and its four ops.

    Attributes:
        name: the ``backend=`` name, and the prefix of its ops ``klpenalty::<name>_*``.
        devices: the device types it runs on (``"*"``: any).
        module: the module that implements its ops (importing it registers them; a compiled
            kernel may load at the first :meth:`available`).
        fallback: the backend run instead where :meth:`available` is False (None: raise).
    """

    name: str
    devices: tuple[str, ...]
    module: ModuleType
    fallback: str | None = None

    def available(self) -> bool:
        """Whether the ops can run in this process (the module's ``available()``, if any)."""
        check = getattr(self.module, "available", None)
        return True if check is None else bool(check())

    def _op(self, op: str):
        return getattr(torch.ops.klpenalty, f"{self.name}_{op}").default

    @property
    def forward_op(self):
        """``<name>_token_stats``: out (..., 4) and stats (..., 10)."""
        return self._op("token_stats")

    @property
    def backward_op(self):
        """``<name>_token_stats_backward``: ∂/∂x and ∂/∂y from the stats."""
        return self._op("token_stats_backward")

    @property
    def state_op(self):
        """``<name>_token_stats_state``: the per-shard state (N, 6) and careful flags (N,)."""
        return self._op("token_stats_state")

    @property
    def threshold_op(self):
        """``<name>_sampling_threshold``: the sampler's per-row threshold τ (...)."""
        return self._op("sampling_threshold")


# name -> backend; a new backend is one module and one line here
REGISTRY: dict[str, Backend] = {
    b.name: b
    for b in (
        Backend("streaming", ("*",), streaming),
        Backend("native", ("cpu",), native, fallback="streaming"),
        Backend("triton", ("cuda",), triton_backend),
    )
}


def available_backends() -> list[str]:
    """Names accepted by ``backend=`` (besides ``"auto"``)."""
    return list(REGISTRY)


def device_backends(device: torch.device) -> list[str]:
    """The backends that run natively on tensors of ``device`` in this process (the Triton
    interpreter on CPU is a test mode, not listed)."""
    names = []
    for b in REGISTRY.values():
        if "*" in b.devices or device.type in b.devices:
            if b.name == "triton" and not (triton_backend.available() and not triton_backend.interpreted()):
                continue
            names.append(b.name)
    return names


def get_backend(name: str, device: torch.device) -> Backend:
    """Resolve ``name`` (``"auto"`` or one of :func:`available_backends`) for ``device``: the
    :class:`Backend` whose ops run (a backend's fallback where it is unavailable)."""
    if name == "auto":
        if device.type == "cpu":
            return get_backend("native", device)
        if device.type == "cuda":
            if triton_backend.available() and not triton_backend.interpreted():
                return REGISTRY["triton"]
            triton_backend.note_fallback()
        return REGISTRY["streaming"]
    if name not in REGISTRY:
        raise ValueError(f"backend must be one of {['auto', *REGISTRY]}, got {name!r}")
    backend = REGISTRY[name]
    if name == "triton":
        triton_backend.check_device(device)
        return backend
    if "*" not in backend.devices and device.type not in backend.devices:
        raise ValueError(
            f"backend {name!r} runs on {'/'.join(d.upper() for d in backend.devices)} tensors "
            f"only, got "
            f"tensors on {device}; use backend='auto' or 'streaming'"
        )
    if backend.fallback is not None and not backend.available():
        return get_backend(backend.fallback, device)
    return backend


def token_stats(
    backend: Backend,
    x: Tensor,
    y: Tensor | None,
    tokens: Tensor | None,
    mask: Tensor | None,
    keep: Tensor | None,
    tau: Tensor | None,
    temperature: float,
    *,
    ignore_index: int = -100,
    want: int,
    check: bool = False,
    tile_rows: int = 0,
    tile_cols: int = 0,
    sampler: tuple[int, float, float] = (0, 1.0, 0.0),
) -> Tensor:
    """out (..., 4) of ``backend``'s forward op on validated tensors: KL(π̃‖ρ), log π̃(t),
    log ρ(t), H(π̃), 0 in the columns not in ``want``; differentiable (also twice).

    Shapes: x, y, keep (..., V); tokens, mask, tau (...). ``tile_rows``/``tile_cols``: a
    backend's tile (0 = its default; the native kernel ignores both). ``sampler``: the op's
    ``top_k, top_p, min_p`` (unused by default), whose threshold the op computes itself.
    """
    top_k, top_p, min_p = sampler
    out, _ = backend.forward_op(
        x, y, tokens, mask, keep, tau, float(temperature), int(ignore_index), int(want),
        bool(check), int(tile_rows), int(tile_cols), int(top_k), float(top_p), float(min_p),
    )
    return out
