"""Triton backend (CUDA tensors; CPU tensors under ``TRITON_INTERPRET=1``): the ops of
:mod:`..contract`, ``klpenalty::triton_token_stats``, ``_backward``, ``_state``,
``_sampling_threshold``, ``_divergence`` and ``_divergence_backward``, in fused Triton kernels
(the kept-set check, ``_support_from_ids``, runs the streaming backend's op). docs/triton.md
describes them.

One file per op, the host code apart from the kernels:

- :mod:`.token_stats`: the host of the forward, state and backward ops (the split plan, the
  kernels' constexprs, the launches); their kernels are :mod:`._kernels_stats`;
- :mod:`.threshold`: the host of the sampling threshold op (also launched by the forward
  where the sampler settings cut); its kernels are in :mod:`._kernels_threshold`;
- :mod:`.divergence`: the host of the second walk's forward and backward ops (the divergences
  of :mod:`..divergence`); its kernels are :mod:`._kernels_divergence`;
- :mod:`._host`: what the hosts share (the rows as the kernels address them, every launch,
  the inputs the kernels do not take);
- :mod:`._kernels_common`: what the kernel modules share (interpreted or compiled, the
  device functions, the addressing of a row).

Triton is an optional dependency (``pip install 'klpenalty[triton]'``): this package imports
without it, and imports the kernel modules, which import Triton, at the first use
(:mod:`._load`). This module says whether the kernels can run here (:func:`available`,
:func:`interpreted`, :func:`check_device`) and registers the ops.
"""

from __future__ import annotations

import warnings

import torch

from .. import contract
from . import _load
from ._load import available, interpreted

__all__ = [
    "available", "interpreted", "runs_on", "check_device", "note_fallback", "INSTALL_HINT",
]

INSTALL_HINT = "install Triton (`pip install 'klpenalty[triton]'`)"

_warned = False


def note_fallback() -> None:
    """One warning per process: CUDA tensors run the streaming backend because Triton is missing."""
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(
            f"klpenalty: Triton is unavailable ({_load._error}); CUDA tensors use the portable "
            f"'streaming' backend. For the fused GPU kernels, {INSTALL_HINT}",
            RuntimeWarning,
            stacklevel=3,
        )


def runs_on(device: torch.device) -> bool:
    """Whether the kernels run on tensors of ``device`` as a backend of their own: CUDA tensors
    with Triton compiled (the interpreter on CPU tensors is a test mode, not counted)."""
    return device.type == "cuda" and available() and not interpreted()


def check_device(device: torch.device) -> None:
    """Raise ValueError unless the Triton kernels can run on ``device`` in this process."""
    if not available():
        raise ValueError(
            f"backend 'triton' needs Triton, which is unavailable ({_load._error}); {INSTALL_HINT}"
        )
    if device.type == "cuda" and not interpreted():
        return
    if device.type == "cpu" and interpreted():
        return
    if device.type == "cpu":
        raise ValueError(
            "backend 'triton' runs on CUDA tensors; on CPU tensors only in Triton's interpreter "
            "(TRITON_INTERPRET=1 set before the first use), got CPU tensors: use backend='auto', "
            "'native' or 'streaming'"
        )
    raise ValueError(
        f"backend 'triton' runs on CUDA tensors (CPU tensors under TRITON_INTERPRET=1), got "
        f"tensors on {device}"
        + ("; the kernels were imported in interpreter mode" if device.type == "cuda" else "")
    )


# the ops' host code and the ops' registration
from . import divergence, threshold, token_stats  # noqa: E402

contract.define_ops("triton")
contract.implement(
    "triton", "CompositeExplicitAutograd", token_stats=token_stats.token_stats_op,
    token_stats_backward=token_stats.token_stats_backward_op,
    token_stats_state=token_stats.token_stats_state_op,
    sampling_threshold=threshold.sampling_threshold_op,
    divergence=divergence.divergence_op, divergence_backward=divergence.divergence_backward_op,
)
# the kept-set check: the streaming backend's op, on the same tensors
contract.inherit("triton", "CompositeExplicitAutograd", "streaming", "support_from_ids")
