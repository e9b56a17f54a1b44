"""The host of the Triton backend's ``klpenalty::triton_sampling_threshold`` op, and of the
sampler's threshold that its forward computes first where the sampler settings cut.

:func:`._kernels_threshold.threshold_kernel` (one program per row: radix selects over
order-preserving keys of the logits, float64 masses; docs/triton.md) writes τ, or max(tau, τ)
where a tau is given, into an (N,) float32 buffer: the threshold op returns it, the forward's
statistics kernels read it as their tau and write it into the stats column ``ST_TAU``. One
launch, nothing read back. Float64 logits and empty vocabularies run the streaming backend's
op (:func:`._host.portable_op`).
"""

from __future__ import annotations

import math
import struct

import torch
from torch import Tensor

from .. import contract
from . import _host
from ._load import _kernels

__all__ = ["tau_rows", "sampling_threshold_op", "THRESHOLD_BUCKETS", "THRESHOLD_BLOCK",
           "THRESHOLD_WARPS"]

# Buckets per read of a threshold search (:func:`._kernels_threshold.threshold_kernel`): 4 bits
# of the 32-bit key per read; a power of two.
THRESHOLD_BUCKETS = 16
# Columns per block of the threshold kernel's pass 0, Z and check reads (vector loads; the
# smallest of its BLOCK partial maxima bounds top-k's search for k ≤ BLOCK).
THRESHOLD_BLOCK = 1024
# Warps of a threshold program (a search reads one column per thread at a time).
THRESHOLD_WARPS = 8
# The low bits of a float32 key that are 0 for logits of the dtype (16-bit keys for 16-bit
# logits: half the reads of a search).
_KEY_SHIFT = {torch.bfloat16: 16, torch.float16: 13, torch.float32: 0}


def _float64_bits(value: float) -> int:
    """The bits of a float64 as an int64 (a kernel's float arguments arrive as float32)."""
    return struct.unpack("<q", struct.pack("<d", value))[0]


def tau_rows(x: Tensor, top_k: int, top_p: float, min_p: float, temperature: float,
             tau: Tensor | None = None) -> Tensor:
    """τ (N,) float32 of the sampler settings on the rows of (..., V) logits (the rule of
    :mod:`klpenalty.sampling`), or max(tau, τ) (NaN where either is) where ``tau`` (...) is
    given: one program per row of :func:`._kernels_threshold.threshold_kernel`, launched on x's
    device, nothing read back. The settings cut (:func:`..contract.sampler_cuts`)."""
    vocab = x.shape[-1]
    n = x.numel() // vocab
    out = torch.empty(n, dtype=torch.float32, device=x.device)
    if n == 0:
        return out
    rows = _host.rows(x, None, None)
    tauf = _host.flat(tau)
    block = _host.block(vocab, THRESHOLD_BLOCK)
    cut_p = top_p < 1.0
    # top-p's search starts where the logits below hold < 1 − p of the mass together
    window = math.log((1.0 - top_p) / vocab) - 2.0 if cut_p else 0.0
    _host.launch(
        _kernels().threshold_kernel, (n,), x.device, rows.x, out if tauf is None else tauf,
        out, *rows.args[:3], vocab, top_k if 0 < top_k < vocab else 0,
        _float64_bits(top_p), _float64_bits(math.log(min_p) if min_p > 0.0 else 0.0),
        _float64_bits(window), temperature, TOP_K=0 < top_k < vocab, TOP_P=cut_p,
        MIN_P=min_p > 0.0, HAS_TAU=tauf is not None, KEY_SHIFT=_KEY_SHIFT[x.dtype],
        BLOCK=block, BT=min(block, 32 * THRESHOLD_WARPS), F=THRESHOLD_BUCKETS,
        num_warps=THRESHOLD_WARPS if block >= 32 * THRESHOLD_WARPS else 1,
    )
    return out


def sampling_threshold_op(x, top_k, top_p, min_p, temperature):  # SCHEMAS["sampling_threshold"]
    """τ (...) float32 of top-k → top-p → min-p sampling on (..., V) logits (the threshold op
    of :mod:`..contract`, :func:`klpenalty.sampling.sampling_threshold`'s rule): −inf where
    nothing is cut, NaN for a row holding NaN; computed by :func:`tau_rows` (float64 logits and
    empty vocabularies: the streaming backend's op)."""
    if _host.portable(x):
        return _host.portable_op("sampling_threshold")(x, top_k, top_p, min_p, temperature)
    contract.check_sampler_args(top_k, top_p, min_p, temperature)
    if not contract.sampler_cuts(x.shape[-1], top_k, top_p, min_p):
        return torch.full(x.shape[:-1], -math.inf, dtype=torch.float32, device=x.device)
    return tau_rows(x, top_k, top_p, min_p, temperature).view(x.shape[:-1])
