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

from . import contract, native, streaming
from . import triton as triton_backend

__all__ = [
    "Backend",
    "REGISTRY",
    "get_backend",
    "available_backends",
    "device_backends",
    "token_stats",
    "forward_of_ids",
    "support_of_ids",
]


@dataclass(frozen=True)
class Backend:
    """One backend: where it runs, when ``"auto"`` picks it, and its ops.

    Attributes:
        name: the ``backend=`` name, and the prefix of its ops ``klpenalty::<name>_*``.
        devices: the device types it runs on (``"*"``: any).
        module: the module that implements its ops (importing it registers them; a compiled
            kernel may load at the first :meth:`available`). Optional hooks, each looked up on
            the module: ``available()``, ``runs_on(device)`` (whether the ops run on tensors of
            that device in this process; default: its type is in ``devices``),
            ``check_device(device)`` (raise ValueError naming why not) and
            ``note_fallback()`` (tell once that ``"auto"`` passed it over).
        fallback: the backend run instead where :meth:`available` is False (None: raise).
        auto: the device types for which ``"auto"`` picks it (``"*"``: any, after every
            backend naming the type), in :data:`REGISTRY` order.
    """

    name: str
    devices: tuple[str, ...]
    module: ModuleType
    fallback: str | None = None
    auto: tuple[str, ...] = ()

    def _hook(self, name: str):
        return getattr(self.module, name, None)

    def available(self) -> bool:
        """Whether the ops can run in this process (the module's ``available()``, if any)."""
        check = self._hook("available")
        return True if check is None else bool(check())

    def runs_on(self, device: torch.device) -> bool:
        """Whether the ops run on tensors of ``device`` in this process, as a backend of their
        own (a fallback's device does not count)."""
        hook = self._hook("runs_on")
        if hook is not None:
            return bool(hook(device))
        return "*" in self.devices or device.type in self.devices

    def check_device(self, device: torch.device) -> None:
        """Raise ValueError where the ops cannot take tensors of ``device``."""
        hook = self._hook("check_device")
        if hook is not None:
            hook(device)
        elif "*" not in self.devices and device.type not in self.devices:
            raise ValueError(
                f"backend {self.name!r} runs on {'/'.join(d.upper() for d in self.devices)} "
                f"tensors only, got tensors on {device}; use backend='auto' or 'streaming'"
            )

    def _op(self, op: str):
        return getattr(torch.ops.klpenalty, f"{self.name}_{op}").default

    @property
    def forward_op(self):
        """``<name>_token_stats``: out (..., OUT_COLS) and stats (..., STATS_COLS)."""
        return self._op("token_stats")

    @property
    def backward_op(self):
        """``<name>_token_stats_backward``: ∂/∂x and ∂/∂y from the stats."""
        return self._op("token_stats_backward")

    @property
    def state_op(self):
        """``<name>_token_stats_state``: the per-shard state (N, STATE_COLS) and careful flags (N,)."""
        return self._op("token_stats_state")

    @property
    def threshold_op(self):
        """``<name>_sampling_threshold``: the sampler's per-row threshold τ (...)."""
        return self._op("sampling_threshold")

    # The ops with their arguments named (the schemas of :data:`.contract.SCHEMAS`).
    def forward(
        self, x: Tensor, y: Tensor | None = None, tokens: Tensor | None = None,
        mask: Tensor | None = None, keep: Tensor | None = None, tau: Tensor | None = None, *,
        temperature: float, want: int, ignore_index: int = -100, check: bool = False,
        tile_rows: int = 0, tile_cols: int = 0, sampler: tuple[int, float, float] = (0, 1.0, 0.0),
        ids: Tensor | None = None, offsets: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """(out, stats) of the forward op (differentiable through the contract's autograd);
        ``ids`` / ``offsets``: kept sets (int32/int64), a row whose set no threshold describes
        holding NaN in ``ST_TAU`` (:func:`token_stats` passes such sets as a dense ``keep``)."""
        top_k, top_p, min_p = sampler
        return self.forward_op(
            x, y, tokens, mask, keep, tau, float(temperature), int(ignore_index), int(want),
            bool(check), int(tile_rows), int(tile_cols), int(top_k), float(top_p), float(min_p),
            ids, offsets,
        )

    def backward(
        self, grad: Tensor, x: Tensor, y: Tensor | None, tokens: Tensor | None,
        owned: Tensor | None, stats: Tensor, mask: Tensor | None = None,
        keep: Tensor | None = None, tau: Tensor | None = None, *, temperature: float, want: int,
        need_x: bool, need_y: bool, ignore_index: int = -100, tile_rows: int = 0,
        tile_cols: int = 0,
    ) -> tuple[Tensor, Tensor]:
        """(grad_x, grad_y) of the backward op (each empty where not needed)."""
        return self.backward_op(
            grad, x, y, tokens, owned, stats, mask, keep, tau, float(temperature),
            int(ignore_index), int(want), bool(need_x), bool(need_y), int(tile_rows),
            int(tile_cols),
        )

    def state(
        self, x: Tensor, y: Tensor | None = None, keep: Tensor | None = None,
        tau: Tensor | None = None, *, temperature: float, want: int, tile_rows: int = 0,
        tile_cols: int = 0,
    ) -> tuple[Tensor, Tensor]:
        """(state (N, STATE_COLS), careful (N,)) of the state op."""
        return self.state_op(
            x, y, keep, tau, float(temperature), int(want), int(tile_rows), int(tile_cols)
        )

    def threshold(
        self, x: Tensor, *, sampler: tuple[int, float, float], temperature: float
    ) -> Tensor:
        """τ (...) of the threshold op for the sampler's ``(top_k, top_p, min_p)``; a zero τ
        as +0 (the backends meet a tie group's +0 and −0 in their own orders)."""
        top_k, top_p, min_p = sampler
        tau = self.threshold_op(x, int(top_k), float(top_p), float(min_p), float(temperature))
        return tau + 0.0

    def support_from_ids(
        self, x: Tensor, ids: Tensor, offsets: Tensor, *, chunk_rows: int = 0
    ) -> tuple[Tensor, Tensor]:
        """(tau (N,), exact (N,)) of the kept-set check of ``(ids, offsets)`` (int32/int64)."""
        return self._op("support_from_ids")(x, ids, offsets, int(chunk_rows))

    def divergence(
        self, x: Tensor, y: Tensor, stats: Tensor, mask: Tensor | None = None,
        keep: Tensor | None = None, tau: Tensor | None = None, *, temperature: float, kind: int,
        param: float = 0.0,
    ) -> tuple[Tensor, Tensor]:
        """(value, ḡ) (...) of the second walk from the forward op's ``stats``, the student on
        the support ``keep`` / ``tau`` (the forward's: its ``ST_TAU`` where a sampler cut);
        differentiable with respect to ``x`` (:mod:`.divergence`)."""
        return self._op("divergence")(x, y, stats, mask, keep, tau, float(temperature),
                                      int(kind), float(param))

    def divergence_backward(
        self, grad: Tensor, x: Tensor, y: Tensor, stats: Tensor, gbar: Tensor,
        mask: Tensor | None = None, keep: Tensor | None = None, tau: Tensor | None = None, *,
        temperature: float, kind: int, param: float = 0.0,
    ) -> Tensor:
        """∂/∂x (..., V) of Σ grad·value of the second walk."""
        return self._op("divergence_backward")(
            grad, x, y, stats, gbar, mask, keep, tau, float(temperature), int(kind),
            float(param)
        )


# name -> backend; a new backend is one module and one line here
REGISTRY: dict[str, Backend] = {
    b.name: b
    for b in (
        Backend("streaming", ("*",), streaming, auto=("*",)),
        Backend("native", ("cpu",), native, fallback="streaming", auto=("cpu",)),
        Backend("triton", ("cuda",), triton_backend, auto=("cuda",)),
    )
}


def available_backends() -> list[str]:
    """Names accepted by ``backend=`` (besides ``"auto"``)."""
    return list(REGISTRY)


def device_backends(device: torch.device) -> list[str]:
    """The backends that run natively on tensors of ``device`` in this process (the Triton
    interpreter on CPU is a test mode, not listed)."""
    return [b.name for b in REGISTRY.values() if b.runs_on(device)]


def _auto(device: torch.device) -> Backend:
    """The backend ``"auto"`` picks for ``device``: the first in :data:`REGISTRY` whose
    ``auto`` names the device type and that runs on it (or has a fallback), else the first
    whose ``auto`` is ``"*"``; a backend passed over says so once (its ``note_fallback``)."""
    named = [b for b in REGISTRY.values() if device.type in b.auto]
    anywhere = [b for b in REGISTRY.values() if "*" in b.auto]
    for b in named:
        if b.runs_on(device) and (b.fallback is not None or b.available()):
            return get_backend(b.name, device)
        note = b._hook("note_fallback")
        if note is not None:
            note()
    return get_backend(anywhere[0].name, device)


def get_backend(name: str, device: torch.device) -> Backend:
    """Resolve ``name`` (``"auto"`` or one of :func:`available_backends`) for ``device``: the
    :class:`Backend` whose ops run (a backend's fallback where it is unavailable)."""
    if name == "auto":
        return _auto(device)
    if name not in REGISTRY:
        raise ValueError(f"backend must be one of {['auto', *REGISTRY]}, got {name!r}")
    backend = REGISTRY[name]
    backend.check_device(device)
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
    ids: Tensor | None = None,
    offsets: Tensor | None = None,
) -> Tensor:
    """out (..., 4) of ``backend``'s forward op on validated tensors: KL(π̃‖ρ), log π̃(t),
    log ρ(t), H(π̃), 0 in the columns not in ``want``; differentiable (also twice).

    Shapes: x, y, keep (..., V); tokens, mask, tau (...). ``tile_rows``/``tile_cols``: a
    backend's tile (0 = its default; the native kernel ignores both). ``sampler``: the op's
    ``top_k, top_p, min_p`` (unused by default), whose threshold the op computes itself.
    ``ids`` (K,) / ``offsets`` (N + 1,): an engine's kept sets (validated, int32/int64), whose
    thresholds the op finds itself; where a counted row's set is not {x ≥ τ_r} (``ST_TAU``
    NaN: one host read), the call is made again with the sets as a dense ``keep``
    (:func:`.contract.keep_of_ids`), as :func:`klpenalty.sampling.support_from_ids` gives them.
    """
    kw = dict(temperature=temperature, want=want, ignore_index=ignore_index, check=check,
              tile_rows=tile_rows, tile_cols=tile_cols, sampler=sampler)
    out, _ = forward_of_ids(backend, x, y, tokens, mask, keep, tau, ids=ids, offsets=offsets,
                            **kw)
    return out


def forward_of_ids(
    backend: Backend, x: Tensor, y: Tensor | None, tokens: Tensor | None, mask: Tensor | None,
    keep: Tensor | None, tau: Tensor | None, *, ids: Tensor | None, offsets: Tensor | None,
    **kw,
) -> tuple[Tensor, Tensor]:
    """(out, stats) of ``backend``'s forward op (``kw``: its keyword arguments) given kept sets
    ``ids`` / ``offsets`` (None: one plain call): where a counted row's set is not {x ≥ τ_r}
    (:func:`support_of_ids`, one host read), the call is made again with the sets as a dense
    ``keep``; its stats then hold the first call's ``ST_TAU`` (NaN on those rows), so that
    :func:`support_of_ids` of them gives the support of the backward (and of the second walk)."""
    out, stats = backend.forward(x, y, tokens, mask, keep, tau, ids=ids, offsets=offsets, **kw)
    if ids is None:
        return out, stats
    keep_used, _ = support_of_ids(stats, mask, keep, tau, ids, offsets, x.shape)
    if keep_used is not keep:
        taus = stats[..., contract.ST_TAU]
        out, stats = backend.forward(x, y, tokens, mask, keep_used, tau, **kw)
        stats = stats.detach().clone()  # the op's output is saved for its backward
        stats[..., contract.ST_TAU] = taus
    return out, stats


def support_of_ids(
    stats: Tensor, mask: Tensor | None, keep: Tensor | None, tau: Tensor | None, ids: Tensor,
    offsets: Tensor, shape,
) -> tuple[Tensor | None, Tensor | None]:
    """The support ``(keep, tau)`` of the forward given ``keep`` / ``tau`` and the kept sets
    ``ids`` / ``offsets`` for logits of ``shape`` (..., V), from its ``stats``
    (:func:`forward_of_ids`'s): the threshold it used (``ST_TAU``) where every counted row's
    set is {x ≥ τ_r}, else ``keep`` and the sets' dense mask (:func:`.contract.keep_of_ids`)
    with ``tau`` (one host read)."""
    taus = stats[..., contract.ST_TAU]
    inexact = taus.isnan()
    if bool((inexact if mask is None else inexact & mask).any()):
        keep_ids = contract.keep_of_ids(shape, ids, offsets)
        return (keep_ids if keep is None else keep & keep_ids), tau
    return keep, taus
