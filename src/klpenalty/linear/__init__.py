"""Exact KL, token log-probs and entropy straight from both models' hidden states.

Shape letters: B batch, T sequence, V vocabulary, N rows (product of the leading dims), R rows of
one chunk, H hidden size (H_p of the policy, H_r of the reference).

:func:`linear_kl` never builds the (N, V) logits of either model. It walks the counted rows in
chunks of R rows: per chunk, z = F.linear(h, W, b) in the input dtype (the matmul accumulates in
float32, as torch does), the logit transforms (scale, soft-cap), then the backend's engine on the
(R, V) chunk of both models through a chunk adapter (:class:`LocalChunks`: the pair
:func:`_chunk_forward`, :func:`_chunk_backward`; a vocabulary slice's adapter lives in
:mod:`klpenalty.distributed.vocab_parallel`). The backward recomputes each chunk's logits, gets
∂/∂z from the engine, chains it through the transforms and into the hidden states, weights and
biases.
"""

from __future__ import annotations

import functools
import math
import os
from numbers import Integral
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from . import _validation as v
from .functional import TokenStats
from .ops import contract
from .ops.contract import Want
from .ops.dispatch import get_backend
from .sampling import parse_support, rows_of_support, support_args

__all__ = ["linear_kl", "linear_logprobs", "linear_policy_loss", "PolicyLoss"]

# Rows R of a chunk (default_chunk_rows). Both paths peak at three (R, V) buffers of the compute
# dtype per chunk (both models' logits and ∂/∂z), and every chunk re-reads each whole (V, H)
# head weight (the BLAS re-packs it) and, in the backward, reads and writes the (V, H) weight
# gradient: O(V·H) traffic per chunk, paid once per R rows. So R is as large as a memory
# budget allows:
#
#     budget = clip(CHUNK_BUDGET_HEADS · V·H·bytes(weight), floor, cap)
#     R      = budget // (3·V·bytes(compute dtype)),   a multiple of 16 (CPU) / 128 (else),
#              clipped to [min rows, max rows], then to N, with ceil(N/R) equal-sized chunks
#
# (H the larger of the two hidden sizes.) The weight and its gradient are resident anyway, so
# chunk buffers of one head's size add at most ~1× the head: R ≈ CHUNK_BUDGET_HEADS·H/3 for
# float32 weights (H/6 for bf16 with float32 buffers), whatever V: 160 rows at H = 512,
# 288 at H = 896, 1360 at H = 4096 on CPU.
# CPU: floor CPU_MIN_CHUNK_BYTES (48 MiB, the former fixed 3·4M float32 elements), cap
# CPU_MAX_MEMORY_FRACTION of the machine's physical memory (os.sysconf: the plan is a function
# of the shapes and the machine, never of the momentary free memory, so runs repeat), at least
# 16 rows. Measured on a 2-core AVX2 machine: benchmarks/README.md (the chunk-plan sweep).
CHUNK_BUDGET_HEADS = 1.0
CPU_MIN_CHUNK_BYTES = 48 << 20
CPU_MAX_MEMORY_FRACTION = 1 / 8
CPU_MIN_CHUNK_ROWS = 16
CPU_CHUNK_MULTIPLE = 16
# Accelerators (reasoned, not measured here: no GPU was available): a chunk's weight-gradient
# GEMM does 2·R·V·H flops against the (V, H) float32 accumulator read and written (8 bytes per
# element), ~R/4 flops per byte for bf16 operands (the forward's GEMMs ~R, reading the bf16
# weight); an H100/H200 needs ~200-300 flops per byte (989 Tflop/s dense bf16 against 3.35-4.8
# TB/s) to be compute-bound, so a chunk is bound by that traffic below ~800-1200 rows (at
# V = 128256, H = 4096: ~4 GB per chunk, ~1 ms, against ~0.34 ms of math at 256 rows). Hence at
# least ACCEL_MIN_CHUNK_ROWS = 1024 rows whatever the budget (the rows floor wins over it);
# past ~2048 rows more rows buy no speed, only memory, so at most ACCEL_MAX_CHUNK_ROWS; device
# memory is scarcer than the host's, so the cap is ACCEL_MAX_MEMORY_FRACTION of the device's
# total memory (CUDA: get_device_properties). bf16 weights: R ≈ H/6 gives the 1024-row floor up
# to H = 6144 (at V = 128256, H = 4096: 3 × 0.5 GiB of float32 buffers), 1280 at H = 8192,
# 2048 from H = 12288.
ACCEL_MIN_CHUNK_ROWS = 1024
ACCEL_MAX_CHUNK_ROWS = 2048
ACCEL_MAX_MEMORY_FRACTION = 1 / 16
ACCEL_CHUNK_MULTIPLE = 128

# Token id the adapter reads as "ignored" (linear_kl maps the caller's ignore_index to it after
# the range check, so the adapter's signature stays free of it).
IGNORE = -100

# out columns of the adapter (and the order of the Function's outputs): the token_stats op's
KL, LOGPROBS, REF_LOGPROBS, ENTROPY = (
    contract.OUT_KL, contract.OUT_LOGP, contract.OUT_REF_LOGP, contract.OUT_ENTROPY
)


# ------------------------------------------------------------------------------ engine adapter
def _host_checks(device: torch.device) -> bool:
    """Whether reading a tensor value on the host is free (CPU: no device synchronisation)."""
    return device.type == "cpu"


def _want(tokens: Optional[Tensor], want_entropy: bool) -> int:
    """The token_stats ``want`` bits: the KL always, the log-probs with tokens, the entropy."""
    want = Want.KL
    if tokens is not None:
        want |= Want.LOGP | Want.REF_LOGP
    if want_entropy:
        want |= Want.ENTROPY
    return want


def _chunk_forward(
    zp: Tensor,
    zr: Tensor,
    tokens: Optional[Tensor],
    mask: Optional[Tensor],
    temperature: float,
    want_entropy: bool,
    impl,
    keep: Optional[Tensor] = None,
    tau: Optional[Tensor] = None,
    sampler: tuple = (0, 1.0, 0.0),
) -> tuple[Tensor, Tensor]:
    """The per-row statistics of one chunk of logits: one ``<backend>_token_stats`` call.

    Args:
        zp, zr: (R, V) policy and reference logits (after scale and soft-cap), any float dtype.
        tokens: (R,) int64 ids in [0, V) or :data:`IGNORE`, or None (no log-probs).
        mask: (R,) bool or None (False rows give 0).
        temperature: > 0.
        want_entropy: compute H(π).
        impl: the :class:`klpenalty.ops.dispatch.Backend` (:func:`~klpenalty.ops.dispatch.get_backend`).
        keep, tau, sampler: the op's support arguments (:func:`klpenalty.sampling.support_args`).

    Returns:
        ``out`` (R, 4) in the compute dtype, columns kl, logprobs, ref_logprobs, entropy (0 where
        not requested), and ``stats`` (R, k): what :func:`_chunk_backward` needs, opaque to the
        caller (the op's (R, 10) statistics, the threshold used in ``ST_TAU``).
    """
    want = _want(tokens, want_entropy)
    return impl.forward_op(
        zp, zr, tokens, mask, keep, tau, temperature, IGNORE, want, False, 0, 0, *sampler
    )


def _chunk_backward(
    grad_out: Tensor,
    zp: Tensor,
    zr: Optional[Tensor],
    tokens: Optional[Tensor],
    mask: Optional[Tensor],
    stats: Tensor,
    temperature: float,
    need_p: bool,
    need_r: bool,
    impl,
    owned: Optional[Tensor] = None,
    ignore: int = IGNORE,
    keep: Optional[Tensor] = None,
    tau: Optional[Tensor] = None,
) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """∂/∂zp and ∂/∂zr of Σ grad_out·out for one chunk: one ``<backend>_token_stats_backward``
    call.

    Args:
        grad_out: (R, 4) upstream gradients of the columns of ``out`` (0 where unused, and in
            the entropy column when it was not requested).
        zp, zr, tokens, mask, temperature, impl: as given to :func:`_chunk_forward`; ``zr``
            None when no gradient needs the reference (then ``need_r`` is False).
        stats: (R, k) from :func:`_chunk_forward`.
        need_p, need_r: which gradients to compute.
        owned, ignore: (R,) bool, the token lies in this slice of the vocabulary (None = the
            whole vocabulary is here), and the ignored id of ``tokens``.

    Returns:
        (dzp, dzr): (R, V) in the logits' dtypes, or None where not needed.
    """
    want = _want(tokens, True)  # an entropy column not requested carries a zero gradient
    if zr is None:  # no gradient needs the reference (see _LinearKL.backward)
        want &= ~(Want.KL | Want.REF_LOGP)
    if _host_checks(zp.device):  # on CPU, drop the terms whose upstream gradient is all zero
        live = grad_out.ne(0).any(0).tolist()
        for col, bit in enumerate(Want):
            if not live[col]:
                want &= ~bit
    if not want:
        return (
            torch.zeros_like(zp) if need_p else None,
            torch.zeros_like(zr) if need_r else None,
        )
    gx, gy = impl.backward_op(
        grad_out, zp, zr, tokens, owned, stats, mask, keep, tau, temperature, ignore, want,
        need_p, need_r, 0, 0,
    )
    return (gx if need_p else None), (gy if need_r else None)


class LocalChunks:
    """The chunk adapter of :class:`_LinearKL`: how one chunk's logits become statistics and
    gradients. This one holds the whole vocabulary (:func:`_chunk_forward`,
    :func:`_chunk_backward`); :mod:`klpenalty.distributed.vocab_parallel` has the one for a
    vocabulary slice.

    ``tokens`` are the chunk's (R,) ids in [0, V) or :data:`IGNORE` (or None).
    """

    def __init__(self, impl):
        self.impl = impl

    def forward(self, zp, zr, tokens, temperature, want_entropy, keep=None, tau=None,
                sampler=(0, 1.0, 0.0)):
        """(out (R, 4), stats (R, k)) as :func:`_chunk_forward`."""
        return _chunk_forward(zp, zr, tokens, None, temperature, want_entropy, self.impl,
                              keep, tau, sampler)

    def backward(self, grad_out, zp, zr, tokens, stats, temperature, need_p, need_r,
                 keep=None, tau=None):
        """(dzp, dzr) as :func:`_chunk_backward`."""
        return _chunk_backward(grad_out, zp, zr, tokens, None, stats, temperature, need_p,
                               need_r, self.impl, keep=keep, tau=tau)

    def hidden_grad(self, grad: Tensor) -> Tensor:
        """The returned gradient of a hidden state from this process's (N, H) part."""
        return grad


# ------------------------------------------------------------------------------ chunked matmul
def _physical_memory(device: torch.device) -> Optional[int]:
    """Total memory in bytes of ``device`` (CPU: the machine's physical memory from
    ``os.sysconf``; CUDA: the device's), or None where it cannot be read."""
    try:
        if device.type == "cpu":
            return _host_memory()
        if device.type == "cuda":
            return _cuda_memory(torch.cuda._get_device_index(device, optional=True))
    except (ValueError, OSError, RuntimeError, AssertionError, AttributeError):
        pass
    return None


@functools.lru_cache(maxsize=None)
def _host_memory() -> int:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


@functools.lru_cache(maxsize=None)
def _cuda_memory(index: int) -> int:
    return torch.cuda.get_device_properties(index).total_memory


def default_chunk_rows(
    n_rows: int,
    vocab: int,
    device: torch.device,
    hidden: Optional[int] = None,
    dtype: torch.dtype = torch.float32,
    budget: Optional[int] = None,
) -> int:
    """Rows R of one chunk for N rows of a (V, H) head of ``dtype`` on ``device``.

    The peak extra memory of :func:`linear_kl` and :func:`linear_policy_loss` is three (R, V)
    buffers of the compute dtype (float64 for float64 weights, else float32) plus O(N), and each
    chunk reads the whole (V, H) weight(s) and, backward, reads and writes the (V, H) weight
    gradient. So R is the most rows whose three buffers fit ``budget`` bytes::

        budget = clip(CHUNK_BUDGET_HEADS · V·H·bytes(dtype), floor, cap)   (``budget`` None)
        R      = budget // (3·V·bytes(compute dtype))

    CPU: floor :data:`CPU_MIN_CHUNK_BYTES`, cap :data:`CPU_MAX_MEMORY_FRACTION` of the
    physical memory, R a multiple of 16, at least 16. Accelerators: no floor, cap
    :data:`ACCEL_MAX_MEMORY_FRACTION` of the device's memory, R a multiple of 128 clipped to
    [:data:`ACCEL_MIN_CHUNK_ROWS`, :data:`ACCEL_MAX_CHUNK_ROWS`] (the rows floor wins over the
    budget: smaller GEMMs are bound by the weight traffic). Then the N rows are split into
    ceil(N/R) chunks of equal size (rounded up to the multiple, never above R, and clipped to
    [1, N]): no small last chunk.

    Args:
        n_rows: N, the counted rows (≥ 0).
        vocab: V (the whole vocabulary, also for a vocabulary slice: the same R on every rank).
        device: where the chunks are computed.
        hidden: H, the larger hidden size of the two heads; None: the head's size is unknown
            and the budget is the floor (CPU) / the rows floor (accelerators).
        dtype: the heads' dtype (float64 if either is).
        budget: bytes for the three (R, V) buffers, replacing the rule's (no floor, no cap;
            the rows floor still applies).

    Raises:
        TypeError / ValueError: arguments that are not ints ≥ 0 (``budget`` > 0), a ``dtype``
            that is not a floating torch.dtype.
    """
    for name, x, low in (("n_rows", n_rows, 0), ("vocab", vocab, 0), ("hidden", hidden, 1),
                         ("budget", budget, 1)):
        if x is None and name in ("hidden", "budget"):
            continue
        if isinstance(x, bool) or not isinstance(x, Integral):
            raise TypeError(f"{name} must be an int, got {type(x).__name__}")
        if x < low:
            raise ValueError(f"{name} must be >= {low}, got {x}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    device = torch.device(device)
    vocab = max(int(vocab), 1)
    cpu = device.type == "cpu"
    buffer_bytes = 8 if dtype == torch.float64 else 4  # the compute dtype's
    if budget is None:
        head = 0 if hidden is None else int(CHUNK_BUDGET_HEADS * vocab * hidden * dtype.itemsize)
        budget = max(head, CPU_MIN_CHUNK_BYTES) if cpu else head
        memory = _physical_memory(device)
        fraction = CPU_MAX_MEMORY_FRACTION if cpu else ACCEL_MAX_MEMORY_FRACTION
        if memory is not None:
            budget = min(budget, int(memory * fraction))
    rows = budget // (3 * vocab * buffer_bytes)
    if cpu:
        multiple = CPU_CHUNK_MULTIPLE
        rows = max(CPU_MIN_CHUNK_ROWS, rows // multiple * multiple)
    else:
        multiple = ACCEL_CHUNK_MULTIPLE
        rows = min(ACCEL_MAX_CHUNK_ROWS, max(ACCEL_MIN_CHUNK_ROWS, rows // multiple * multiple))
    if n_rows > rows:  # balanced: ceil(N/R) chunks of about N/chunks rows each
        chunks = -(-n_rows // rows)
        rows = min(rows, -(-(-(-n_rows // chunks)) // multiple) * multiple)
    return max(1, min(rows, n_rows))


def _plan_rows(n_rows: int, vocab: int, policy_weight: Tensor, ref_weight: Tensor) -> int:
    """:func:`default_chunk_rows` for two heads (V_r, H_p) and (V_r, H_r) (a vocabulary slice's
    rows or the whole head; ``vocab`` the whole V): H the larger hidden size, the dtype float64
    if either weight is, else the wider of the two."""
    dtypes = (policy_weight.dtype, ref_weight.dtype)
    dtype = (torch.float64 if torch.float64 in dtypes
             else max(dtypes, key=lambda d: d.itemsize))
    hidden = max(policy_weight.shape[1], ref_weight.shape[1])
    return default_chunk_rows(n_rows, vocab, policy_weight.device, hidden, dtype)


def _logits(h: Tensor, weight: Tensor, bias: Optional[Tensor], scale: float, softcap) -> Tensor:
    """(R, V) logits scale·(h Wᵀ + b), soft-capped as cap·tanh(z/cap), in the input dtype.

    h (R, H), weight (V, H), bias (V,) or None. The matmul accumulates in float32 (torch's
    GEMM); the transforms run in place on the chunk.
    """
    z = F.linear(h, weight, bias)
    if scale != 1.0:
        z.mul_(scale)
    if softcap is not None:
        z.div_(softcap).tanh_().mul_(softcap)
    return z


def _chain(dz: Tensor, z: Optional[Tensor], scale: float, softcap, dtype: torch.dtype) -> Tensor:
    """∂/∂(h Wᵀ + b) from ∂/∂z of the transformed logits z (R, V), returned in ``dtype``.

    Soft-cap: z = cap·tanh(s/cap) gives ∂z/∂s = 1 − (z/cap)²; scale: ∂s/∂(hWᵀ + b) = scale.
    The chain is computed in float32 (float64 for float64 gradients), in place on ``dz`` when
    it already is in that dtype (the engine's fresh buffer); ``z`` is read only with a soft-cap.
    """
    if softcap is None and scale == 1.0:
        return dz.to(dtype)
    dz = dz.to(v.compute_dtype(dz))
    if softcap is not None:
        t = z.to(dz.dtype).div_(softcap)
        dz = dz.mul_(t.mul_(t).neg_().add_(1.0))
        del t
    if scale != 1.0:
        dz = dz.mul_(scale)
    return dz.to(dtype)


# Whether torch.addmm(..., out_dtype=float32, out=acc) works here (CUDA, bf16/fp16 operands):
# None = not tried yet.
_addmm_out_dtype_ok: Optional[bool] = None


def _add_matmul(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """acc += a @ b, where ``acc`` may be float32 for bf16/fp16 a, b.

    Same dtypes: one in-place ``addmm_``. Float32 accumulator: on CUDA the GEMM writes straight
    into it (``addmm`` with ``out_dtype=float32``, float32 accumulation, no rounding of the
    product); elsewhere (or where that overload is missing) the product is rounded once to the
    operands' dtype (float32 accumulation inside the GEMM) and added in float32.
    """
    global _addmm_out_dtype_ok
    if acc.dtype == a.dtype:
        acc.addmm_(a, b)
        return
    if acc.device.type == "cuda" and _addmm_out_dtype_ok is not False:
        try:
            torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
            _addmm_out_dtype_ok = True
            return
        except (RuntimeError, TypeError, NotImplementedError):
            if _addmm_out_dtype_ok:  # it worked before: a real error
                raise
            _addmm_out_dtype_ok = False
    acc.add_(torch.mm(a, b))


def _accumulator(t: Tensor) -> Tensor:
    """A zero gradient accumulator for ``t``: float32 for bf16/fp16, else ``t``'s dtype."""
    dtype = torch.float32 if t.dtype in (torch.bfloat16, torch.float16) else t.dtype
    return torch.zeros(t.shape, dtype=dtype, device=t.device)


def _head_grads(dz: Tensor, h: Tensor, weight: Tensor, sel, grad_h, grad_w, grad_b) -> None:
    """Chain ∂/∂(h Wᵀ + b) (R, V) of one chunk into the gradient buffers (None = not needed):
    grad_h[sel] = dz W (R, H), grad_w += dzᵀ h (V, H), grad_b += Σ_rows dz (V,)."""
    if grad_h is not None:
        grad_h[sel] = dz @ weight
    if grad_w is not None:
        _add_matmul(grad_w, dz.t(), h)
    if grad_b is not None:
        grad_b.add_(dz.sum(0, dtype=grad_b.dtype))


# The largest difference, per output column and relative to the column's largest upstream
# gradient, between the gradients a plan promised and those the backward receives for which the
# gradients formed in the forward are handed over (else the backward recomputes). Both sides are
# the same float32 formula evaluated in another order (a few ulps, ~1e-7); the handed-over
# gradient then differs from the recomputed one by at most this fraction of its scale, below the
# float32 rounding of the head's own GEMMs over H ≥ 64 terms.
PLAN_RTOL = 1e-5


class _LinearKL(torch.autograd.Function):
    """Chunked LM heads of both models → engine → per-row outputs, with a recomputing backward.

    Inputs are already validated; hidden states are (N, H_p) / (N, H_r) rows. ``rows`` (M,)
    int64 are the counted rows (None = all N); ``tokens`` (N,) int64 with ignored positions
    set to :data:`IGNORE`, or None. ``opts`` ends with the chunk adapter, the parsed support
    (:func:`klpenalty.sampling.parse_support`) and the plan of upstream gradients (or None):
    each chunk's thresholds are computed by the op on its rows' logits (they are per row) and
    kept in the saved stats (``ST_TAU``) for the backward; a kept set is re-read there.

    With a plan the forward visits the chunks last rows first, asks the plan for each chunk's
    upstream gradients and forms the input gradients at once (the engine's backward and the
    gradient GEMMs on the logits already in hand); the backward hands them over when the
    gradients it receives are those planned (:data:`PLAN_RTOL`), else recomputes as without.
    Outputs: kl, logprobs, ref_logprobs, entropy, each (N,) in the compute dtype (0 for
    outputs not requested, rows not counted).
    """

    @staticmethod
    def forward(ctx, hp, wp, bp, hr, wr, br, tokens, rows, opts):
        (temperature, scale_p, cap_p, scale_r, cap_r, want_entropy, chunk, adapter, support,
         plan) = opts
        n = hp.shape[0]
        dtype = v.compute_dtype(hp, wp, hr, wr)
        outs = [hp.new_zeros(n, dtype=dtype) for _ in range(4)]
        m = n if rows is None else rows.shape[0]
        need = ctx.needs_input_grad[:6]
        held = _Held(hp, wp, bp, hr, wr, br, need, n, dtype) if plan is not None \
            and any(need) else None
        starts = list(range(0, m, chunk))
        stats = None
        for r0 in (reversed(starts) if held is not None else starts):
            r1 = min(m, r0 + chunk)
            sel = slice(r0, r1) if rows is None else rows[r0:r1]
            hpc, hrc = hp[sel], hr[sel]
            zp = _logits(hpc, wp, bp, scale_p, cap_p)  # (R, V)
            zr = _logits(hrc, wr, br, scale_r, cap_r)  # (R, V)
            tok = None if tokens is None else tokens[sel]
            keep, tau, sampler = _chunk_support(support, zp, rows, r0, r1)
            out, st = adapter.forward(zp, zr, tok, temperature, want_entropy, keep, tau, sampler)
            if stats is None:
                stats = st.new_empty((m, st.shape[-1]))
            stats[r0:r1] = st
            for k in range(4):
                outs[k][sel] = out[:, k]
            if held is not None:
                flat = torch.arange(r0, r1, device=hp.device) if rows is None else sel
                grad_out = plan(flat, out.detach()).to(out.dtype)  # (R, 4)
                held.planned[sel] = grad_out
                if support[0] == "rule":
                    keep, tau = None, st[:, contract.ST_TAU]
                _chunk_grads(held.buffers, (wp, wr), grad_out, zp, zr, hpc, hrc, sel, tok, st,
                             opts, keep, tau)
            del zp, zr, keep, out, st
        ctx.save_for_backward(hp, wp, bp, hr, wr, br, tokens, rows, stats)
        ctx.opts = opts
        ctx.held = held
        ctx.set_materialize_grads(False)
        unused = [outs[k] for k, on in ((LOGPROBS, tokens is not None),
                                         (REF_LOGPROBS, tokens is not None),
                                         (ENTROPY, want_entropy)) if not on]
        ctx.mark_non_differentiable(*unused)
        return tuple(outs)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        hp, wp, bp, hr, wr, br, tokens, rows, stats = ctx.saved_tensors
        temperature, scale_p, cap_p, scale_r, cap_r, _, chunk, adapter, support, _ = ctx.opts
        need = ctx.needs_input_grad[:6]
        need_p, need_r = any(need[:3]), any(need[3:6])
        n = hp.shape[0]
        m = n if rows is None else rows.shape[0]
        held, ctx.held = ctx.held, None  # handed over once; a second backward recomputes
        if held is not None and held.matches(grads, rows):
            return (*_handed_over(held.buffers, adapter, (hp, wp, bp, hr, wr, br)),
                    None, None, None)
        del held
        buffers = _gradient_buffers(hp, wp, bp, hr, wr, br, need)
        live = [g is not None for g in grads]
        # the reference's logits are recomputed only when a gradient needs them: its own, or
        # the KL's (∂KL/∂zp holds log ρ). Log-probs/entropy alone (e.g. the KL detached into
        # the reward) cost the policy's matmuls only.
        kl_grad = grads[0] is not None and (
            not _host_checks(hp.device) or bool(grads[0].ne(0).any())
        )
        use_ref = need_r or kl_grad
        if m and any(live) and (need_p or need_r):
            dtype = stats.dtype
            # (N, 4) upstream gradients, 0 for outputs that did not reach the loss
            g_all = stats.new_zeros((n, 4))
            for k, g in enumerate(grads):
                if g is not None:
                    g_all[:, k] = g
            for r0 in range(0, m, chunk):
                r1 = min(m, r0 + chunk)
                sel = slice(r0, r1) if rows is None else rows[r0:r1]
                hpc, hrc = hp[sel], hr[sel]  # (R, H_p), (R, H_r)
                zp = _logits(hpc, wp, bp, scale_p, cap_p)  # (R, V), recomputed
                zr = _logits(hrc, wr, br, scale_r, cap_r) if use_ref else None  # (R, V)
                tok = None if tokens is None else tokens[sel]
                if support[0] == "rule":  # the thresholds the forward's op computed
                    keep, tau = None, stats[r0:r1, contract.ST_TAU]
                else:  # a kept set (or none), re-read for these rows
                    keep, tau, _ = _chunk_support(support, zp, rows, r0, r1)
                _chunk_grads(buffers, (wp, wr), g_all[sel].to(dtype), zp, zr, hpc, hrc, sel,
                             tok, stats[r0:r1], ctx.opts, keep, tau)
                del zp, zr, keep
        return (*_handed_over(buffers, adapter, (hp, wp, bp, hr, wr, br)), None, None, None)


class _Held:
    """What a planned forward keeps for its backward: the input gradients it formed
    (:func:`_gradient_buffers`) and the (N, 4) upstream gradients they were formed for."""

    def __init__(self, hp, wp, bp, hr, wr, br, need, n: int, dtype: torch.dtype):
        self.buffers = _gradient_buffers(hp, wp, bp, hr, wr, br, need)
        self.planned = hp.new_zeros((n, 4), dtype=dtype)

    def matches(self, grads, rows: Optional[Tensor]) -> bool:
        """Whether the received upstream gradients (None = 0) are the planned ones on the
        counted rows, column by column within :data:`PLAN_RTOL` of the column's largest
        (one host read)."""
        got = torch.zeros_like(self.planned)
        for k, g in enumerate(grads):
            if g is not None:
                got[:, k] = g
        want = self.planned
        if rows is not None:
            got, want = got[rows], want[rows]
        gap = (got - want).abs().amax(0) if got.numel() else got.new_zeros(4)
        scale = got.abs().amax(0) if got.numel() else got.new_zeros(4)
        return bool((gap <= PLAN_RTOL * scale).all())


def _handed_over(buffers, adapter, inputs) -> tuple:
    """The six input gradients from their buffers: the hidden states' through the adapter,
    the accumulators cast to their tensors' dtypes."""
    out = []
    for i, (g, t) in enumerate(zip(buffers, inputs)):
        if g is not None:
            g = adapter.hidden_grad(g) if i in (0, 3) else g.to(t.dtype)
        out.append(g)
    return tuple(out)


def _gradient_buffers(hp, wp, bp, hr, wr, br, need) -> list:
    """[grad_hp, grad_wp, grad_bp, grad_hr, grad_wr, grad_br], None where not needed: zeros
    of the hidden states' shapes, float32 accumulators for bf16/fp16 weights and biases."""
    return [
        None if not need[i] else (torch.zeros_like(t) if i in (0, 3) else _accumulator(t))
        for i, t in enumerate((hp, wp, bp, hr, wr, br))
    ]


def _chunk_grads(buffers, weights, grad_out, zp, zr, hpc, hrc, sel, tok, st, opts, keep,
                 tau) -> None:
    """One chunk's share of every needed input gradient: the engine's ∂/∂z for the (R, 4)
    upstream gradients, chained through the soft-cap and scale, then the gradient GEMMs.
    ``weights`` (wp, wr); ``zr`` may be None when no gradient needs the reference's logits."""
    temperature, scale_p, cap_p, scale_r, cap_r, _, _, adapter, _, _ = opts
    grad_hp, grad_wp, grad_bp, grad_hr, grad_wr, grad_br = buffers
    need_p = any(b is not None for b in buffers[:3])
    need_r = any(b is not None for b in buffers[3:])
    dzp, dzr = adapter.backward(grad_out, zp, zr, tok, st, temperature, need_p, need_r,
                                keep, tau)
    # the logits are needed again only for the soft-cap's derivative
    zp = zp if cap_p is not None else None
    zr = zr if cap_r is not None else None
    if dzp is not None:
        dzp = _chain(dzp, zp, scale_p, cap_p, hpc.dtype)  # (R, V), ∂/∂(h Wᵀ + b)
        zp = None
        _head_grads(dzp, hpc, weights[0], sel, grad_hp, grad_wp, grad_bp)
        dzp = None
    if dzr is not None:
        dzr = _chain(dzr, zr, scale_r, cap_r, hrc.dtype)
        zr = None
        _head_grads(dzr, hrc, weights[1], sel, grad_hr, grad_wr, grad_br)


def _chunk_support(support, zp: Tensor, rows: Optional[Tensor], r0: int, r1: int) -> tuple:
    """The op's (keep, tau, sampler) of the chunk of counted rows r0:r1 (``rows`` None = all),
    from its policy logits ``zp`` (R, V) and the parsed ``support`` (kind, payload)."""
    kind, payload = support
    if kind in ("none", "rule"):  # nothing per row to select
        return support_args(kind, payload, zp)
    flat = torch.arange(r0, r1, device=zp.device) if rows is None else rows[r0:r1]
    return rows_of_support(kind, payload, zp, flat)


# ------------------------------------------------------------------------------ validation
def _check_positive(name: str, value: object) -> float:
    x = v.as_real(name, value)
    if not math.isfinite(x) or x <= 0:
        raise ValueError(f"{name} must be finite and > 0, got {x}")
    return x


def _check_head(side: str, hidden: object, weight: object, bias: object, suffix: str = "") -> None:
    """One model's hidden states (..., H), weight (V, H) and bias (V,) or None (``suffix``
    ends the weight's and the bias's argument names)."""
    pre = f"{side}_" if side else ""
    hname, wname, bname = f"{pre}hidden", f"{pre}weight{suffix}", f"{pre}bias{suffix}"
    v.check_float(hname, hidden)
    v.check_float(wname, weight)
    if hidden.dim() < 1:
        raise ValueError(f"{hname} must have shape (..., H), got {v.describe(hidden)}")
    if weight.dim() != 2 or weight.shape[0] < 1:
        raise ValueError(f"{wname} must have shape (V, H) with V >= 1, got {v.describe(weight)}")
    if weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"{wname} must have shape (V, {hidden.shape[-1]}) (H = the last dim of {hname}), "
            f"got {wname} {v.describe(weight)}, {hname} {v.describe(hidden)}"
        )
    if weight.dtype != hidden.dtype:
        raise TypeError(
            f"{hname} and {wname} must have the same dtype (the LM head's matmul runs in it), "
            f"got {hname} {v.describe(hidden)}, {wname} {v.describe(weight)}"
        )
    if bias is not None:
        v.check_float(bname, bias)
        if tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(
                f"{bname} must have shape ({weight.shape[0]},) (V of {wname}), got {v.describe(bias)}"
            )
        if bias.dtype != weight.dtype:
            raise TypeError(
                f"{bname} must have the dtype of {wname} ({weight.dtype}), got {v.describe(bias)}"
            )


class _Checked(NamedTuple):
    """What :func:`_check_heads` validated and normalised."""

    vocab: int
    leading: torch.Size
    named: dict  # argument name -> the six hidden-state / weight / bias tensors (or None)
    mask: Optional[Tensor]
    temperature: float
    transforms: tuple  # (scale_p, cap_p, scale_r, cap_r)
    ignore_index: int
    impl: object  # the ops.dispatch.Backend entry


def _check_heads(
    policy_hidden, policy_weight, ref_hidden, ref_weight, *, tokens, mask, temperature,
    policy_bias, ref_bias, logit_scale, softcap, ref_logit_scale, ref_softcap, ignore_index,
    chunk_rows, backend, suffix: str = "",
) -> _Checked:
    """The arguments that :func:`linear_kl` and :func:`linear_policy_loss` share: both heads
    (shapes, dtypes, devices), tokens, mask, temperature, the logit transforms, ignore_index,
    chunk_rows and the backend. Raises TypeError / ValueError naming the argument."""
    _check_head("policy", policy_hidden, policy_weight, policy_bias, suffix)
    _check_head("ref", ref_hidden, ref_weight, ref_bias, suffix)
    vocab = policy_weight.shape[0]
    if ref_weight.shape[0] != vocab:
        raise ValueError(
            f"policy_weight{suffix} and ref_weight{suffix} must have the same vocabulary "
            f"size V (dim 0): policy_weight{suffix} {v.describe(policy_weight)}, "
            f"ref_weight{suffix} {v.describe(ref_weight)}"
        )
    leading = policy_hidden.shape[:-1]
    if ref_hidden.shape[:-1] != leading:
        raise ValueError(
            "policy_hidden and ref_hidden must have the same leading dims (...): "
            f"policy_hidden {v.describe(policy_hidden)}, ref_hidden {v.describe(ref_hidden)}"
        )
    device = policy_hidden.device
    named = {
        "policy_hidden": policy_hidden, f"policy_weight{suffix}": policy_weight,
        f"policy_bias{suffix}": policy_bias, "ref_hidden": ref_hidden,
        f"ref_weight{suffix}": ref_weight, f"ref_bias{suffix}": ref_bias,
    }
    for name, t in named.items():
        if t is not None and t.device != device:
            raise ValueError(
                f"{name} must be on the device of policy_hidden ({device}), got {t.device}"
            )
    if tokens is not None:
        v.check_tokens(tokens, leading)
        if tokens.device != device:
            raise ValueError(f"tokens must be on {device}, got {tokens.device}")
    if mask is not None:
        mask = v.check_mask(mask, leading, device)
    temperature = v.check_temperature(temperature)
    scale_p = _check_positive("logit_scale", logit_scale)
    scale_r = scale_p if ref_logit_scale is None else _check_positive(
        "ref_logit_scale", ref_logit_scale
    )
    cap_p = None if softcap is None else _check_positive("softcap", softcap)
    cap_r = cap_p if ref_softcap is None else _check_positive("ref_softcap", ref_softcap)
    ignore_index = v.check_ignore_index(ignore_index)
    _check_chunk_rows(chunk_rows)
    impl = get_backend(backend, device)
    return _Checked(vocab, leading, named, mask, temperature, (scale_p, cap_p, scale_r, cap_r),
                    ignore_index, impl)


def _check_chunk_rows(chunk_rows: object) -> None:
    if chunk_rows is not None:
        if isinstance(chunk_rows, bool) or not isinstance(chunk_rows, Integral):
            raise TypeError(f"chunk_rows must be an int or None, got {type(chunk_rows).__name__}")
        if chunk_rows < 1:
            raise ValueError(f"chunk_rows must be >= 1 or None, got {chunk_rows}")


def _flat_rows(policy_hidden: Tensor, ref_hidden: Tensor, tokens: Optional[Tensor],
               mask: Optional[Tensor], vocab: int, ignore_index: int, check: bool):
    """(hp (N, H_p), hr (N, H_r), rows (M,) int64 counted rows or None = all, tokens (N,)
    int64 with :data:`IGNORE` at ignored and masked positions, or None). With ``check`` the
    counted tokens' range is checked (one host read)."""
    leading = policy_hidden.shape[:-1]
    n = math.prod(leading)
    hp = policy_hidden.reshape(n, policy_hidden.shape[-1])  # (N, H_p)
    hr = ref_hidden.reshape(n, ref_hidden.shape[-1])  # (N, H_r)
    rows = None if mask is None else mask.reshape(-1).nonzero().squeeze(1)  # (M,) counted rows
    tok = None
    if tokens is not None:
        tok = tokens.reshape(-1).long()  # (N,)
        if mask is not None:  # masked rows are never read: their tokens may hold anything
            tok = tok.masked_fill(~mask.reshape(-1), ignore_index)
        if check:
            v.check_token_range(tok.reshape(leading), vocab, ignore_index)
        if ignore_index != IGNORE:
            tok = tok.masked_fill(tok == ignore_index, IGNORE)
    return hp, hr, rows, tok


def _check_nan(
    outs: list[Tensor], named_hidden: dict[str, Tensor], named_params: dict[str, Tensor]
) -> None:
    """Raise ValueError when a counted position's outputs hold NaN, naming the cause."""
    nan = torch.stack([o.isnan() for o in outs]).any(0)  # (N,)
    if not bool(nan.any()):
        return
    for name, t in named_params.items():
        if bool(t.isnan().any()):
            raise ValueError(f"{name} contains NaN ({v.describe(t)})")
    # the hidden rows with NaN, else "no distribution" (e.g. logits overflowing to ±inf)
    v.raise_if_nan(torch.where(nan, float("nan"), 0.0), named_hidden)


# ------------------------------------------------------------------------------ public
def linear_kl(
    policy_hidden: Tensor,
    policy_weight: Tensor,
    ref_hidden: Tensor,
    ref_weight: Tensor,
    *,
    tokens: Optional[Tensor] = None,
    mask: Optional[Tensor] = None,
    temperature: float = 1.0,
    policy_bias: Optional[Tensor] = None,
    ref_bias: Optional[Tensor] = None,
    logit_scale: float = 1.0,
    softcap: Optional[float] = None,
    ref_logit_scale: Optional[float] = None,
    ref_softcap: Optional[float] = None,
    entropy: bool = False,
    support=None,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    min_p: Optional[float] = None,
    ignore_index: int = -100,
    chunk_rows: Optional[int] = None,
    backend: str = "auto",
    check: bool = True,
    expected_grads=None,
) -> TokenStats:
    """Exact KL(π‖ρ), token log-probs and entropy from both models' hidden states and LM heads.

    Shapes: ... leading dims (e.g. B, T), N their product, H_p / H_r the hidden sizes, V the
    vocabulary, R the rows of one chunk.

    Each model's logits are z = scale·(h Wᵀ + b), soft-capped as z ← cap·tanh(z/cap) when a cap
    is given (Gemma 2), and π = softmax(z_p/T), ρ = softmax(z_r/T). The results equal
    materialising both (..., V) logits and calling :func:`klpenalty.full_kl`,
    :func:`klpenalty.token_logprobs` and :func:`klpenalty.entropy` on them, but no (N, V)
    tensor is ever allocated: the counted rows are walked in chunks of R rows, each chunk's
    logits of both models are computed (``F.linear`` in the input dtype, float32 accumulation),
    reduced by the backend's engine and dropped; the backward recomputes them chunk by chunk.
    Peak extra memory is a few (R, V) buffers plus O(N) statistics.

    With ``support`` or ``top_k``/``top_p``/``min_p``, π is replaced by π̃, the policy that
    really sampled, exactly as in :func:`klpenalty.token_stats` (temperature first, top-k →
    top-p → min-p, ties at a boundary kept; π̃ renormalised on the kept set, ρ never
    truncated): each chunk's per-row thresholds are computed from that chunk's policy logits
    (:mod:`klpenalty.sampling`), so the kept sets equal those of the materialised logits.

    Args:
        policy_hidden: (..., H_p) float, the policy's last hidden states. Gradients flow.
        policy_weight: (V, H_p), the policy's LM head (output embedding), same dtype.
        ref_hidden: (..., H_r), the reference's hidden states, the same leading dims (H_r may
            differ from H_p).
        ref_weight: (V, H_r), the reference's LM head, same dtype as ``ref_hidden``. The
            reference side gets gradients only for the tensors that require grad.
        tokens: optional (...) integer ids in [0, V) or ``ignore_index``: adds log π(token) and
            log ρ(token).
        mask: optional (...) bool, True = counts. False rows are never multiplied (their hidden
            states may hold anything, even NaN), give 0 in every output and zero gradient.
        temperature: > 0, divides both models' (transformed) logits.
        policy_bias, ref_bias: optional (V,) LM-head biases, the dtype of the weight.
        logit_scale: > 0, multiplies the policy's logits (h Wᵀ + b).
        softcap: > 0 or None, the policy's final-logit soft-cap.
        ref_logit_scale, ref_softcap: the reference's; None = the policy's values.
        entropy: also return H(π) (H(π̃) with a support).
        support: the policy's kept set per position, as in :func:`klpenalty.token_stats`: a
            bool (..., V) tensor, or a pair ``(ids, offsets)`` (flat kept ids, N + 1 offsets,
            rows in row-major order of the leading dims). Excludes the three settings below.
        top_k, top_p, min_p: the sampler's settings (int ≥ 1; (0, 1]; [0, 1]), applied to
            the policy's transformed logits at ``temperature``.
        ignore_index: negative int; positions whose token equals it give log-probs 0 (and zero
            gradient through them); their KL and entropy still count unless masked.
        chunk_rows: ≥ 1 rows per chunk; None: :func:`default_chunk_rows`, from the heads'
            size: three (R, V) float32 buffers about the bytes of one head (R ≈ H/3 for
            float32 weights on CPU, at least 48 MiB of buffers; 1024-2048 rows on
            accelerators, where smaller GEMMs are bound by reading the weight and the
            weight-gradient accumulator), in equal chunks.
        backend: as in :func:`klpenalty.full_kl` (the engine run on each chunk).
        check: raise ValueError for token ids out of range and for NaN in a counted position's
            outputs (naming the hidden states or the weight that hold NaN). One host read of
            the tokens and one of the (N,) outputs per call; ``check=False`` skips both. (A
            ``mask`` costs one more: the indices of the counted rows.) With a support, a
            sampled token outside it raises too, naming its position (``check=False``: its
            log-prob is −inf).
        expected_grads: optional ``f(rows, out) -> grads``, the upstream gradients the caller's
            loss will give the outputs, as a function of the forward's values: ``rows`` (R,)
            int64 flat (row-major) indices into the leading dims, ``out`` (R, 4) their
            detached kl, logprobs, ref_logprobs, entropy (0 where not computed); ``grads``
            (R, 4) for the same columns. The counted rows are visited in chunks from the last
            to the first, so a row's gradient may depend on the values of every row after it
            (e.g. a sequence's KL still to go). With it the forward forms the input gradients
            on the logits it already has: 4 LM-head GEMMs in all instead of 6, and the input
            gradients' buffers are held from the forward to the backward. The backward checks
            the gradients it receives against the planned ones (one host read): where they
            agree within :data:`PLAN_RTOL` of each column's largest it hands the held
            gradients over, otherwise it recomputes as without a plan, so the result is always
            the gradient of the loss actually backpropagated.

    Returns:
        :class:`klpenalty.TokenStats` ``(kl, logprobs, ref_logprobs, entropy)``, each (...)
        float32 (float64 if any hidden state or weight is float64) or None: ``kl`` always,
        ``logprobs``/``ref_logprobs`` when ``tokens`` is given, ``entropy`` when asked.
        Differentiable once with respect to the hidden states, weights and biases, from any
        combination of the outputs (the backward recomputes each chunk's logits, takes ∂/∂z from
        the engine and chains it through soft-cap and scale: grad_h = dz W, grad_W = dzᵀ h,
        grad_b = Σ dz; a frozen reference's logits are recomputed only when the KL's gradient
        is needed). Gradients come back in each tensor's dtype; for bf16/fp16 weights and
        biases they are accumulated over chunks in float32 and cast once at the end. A second
        derivative (``create_graph=True``) raises.

    Raises:
        TypeError: non-tensor or non-floating hidden states / weights / biases, a hidden state
            and its weight (or bias) of different dtypes, non-integer tokens, non-bool mask.
        ValueError: ranks or shapes that do not match (hidden sizes vs weights, V of the two
            weights, bias shapes, leading dims, tokens, mask), tensors on different devices,
            temperature / scales ≤ 0, a soft-cap ≤ 0, chunk_rows < 1, ignore_index ≥ 0, an
            unknown backend, a support of another shape (or with sampler settings), sampler
            settings out of range; with ``check``: token ids out of range, NaN in a counted
            position, a sampled token outside the support.
    """
    return _linear_kl(
        policy_hidden, policy_weight, ref_hidden, ref_weight, tokens=tokens, mask=mask,
        temperature=temperature, policy_bias=policy_bias, ref_bias=ref_bias,
        logit_scale=logit_scale, softcap=softcap, ref_logit_scale=ref_logit_scale,
        ref_softcap=ref_softcap, entropy=entropy, ignore_index=ignore_index,
        chunk_rows=chunk_rows, backend=backend, check=check, support=support, top_k=top_k,
        top_p=top_p, min_p=min_p, expected_grads=expected_grads,
    )


def _linear_kl(
    policy_hidden, policy_weight, ref_hidden, ref_weight, *, tokens, mask, temperature,
    policy_bias, ref_bias, logit_scale, softcap, ref_logit_scale, ref_softcap, entropy,
    ignore_index, chunk_rows, backend, check, parallel=None, suffix: str = "",
    support=None, top_k=None, top_p=None, min_p=None, expected_grads=None,
) -> TokenStats:
    """:func:`linear_kl`'s validation and run, with the chunk adapter of ``parallel``.

    ``parallel`` None: the whole vocabulary is here (:class:`LocalChunks`). Otherwise a
    callable ``parallel(impl, vocab, error) -> (adapter, vocab)`` called on every process after
    the local validation (``error`` its TypeError/ValueError or None; it raises when any process
    of the group failed), returning the adapter and the whole vocabulary V; ``suffix`` ends the
    weights' argument names in messages.
    """
    error = None
    vocab = impl = None
    try:
        checked = _check_heads(
            policy_hidden, policy_weight, ref_hidden, ref_weight, tokens=tokens, mask=mask,
            temperature=temperature, policy_bias=policy_bias, ref_bias=ref_bias,
            logit_scale=logit_scale, softcap=softcap, ref_logit_scale=ref_logit_scale,
            ref_softcap=ref_softcap, ignore_index=ignore_index, chunk_rows=chunk_rows,
            backend=backend, suffix=suffix,
        )
        vocab, impl, leading, mask = checked.vocab, checked.impl, checked.leading, checked.mask
        temperature, ignore_index = checked.temperature, checked.ignore_index
        if not isinstance(entropy, bool):
            raise TypeError(f"entropy must be a bool, got {type(entropy).__name__}")
        support = parse_support(
            support, top_k, top_p, min_p, (*leading, vocab), policy_hidden.device
        )
        if parallel is not None and support[0] != "none":
            raise ValueError("the vocabulary-parallel fused head takes no support or sampler "
                             "settings")
        if expected_grads is not None and not callable(expected_grads):
            raise TypeError(
                f"expected_grads must be callable or None, got {type(expected_grads).__name__}"
            )
    except (TypeError, ValueError) as err:
        if parallel is None:
            raise
        error = err
    if parallel is None:
        adapter = LocalChunks(impl)
    else:
        adapter, vocab = parallel(impl, vocab, error)

    hp, hr, rows, tok = _flat_rows(
        policy_hidden, ref_hidden, tokens, mask, vocab, ignore_index, check
    )
    m = hp.shape[0] if rows is None else rows.shape[0]
    chunk = (int(chunk_rows) if chunk_rows is not None
             else _plan_rows(m, vocab, policy_weight, ref_weight))
    scale_p, cap_p, scale_r, cap_r = checked.transforms
    opts = (temperature, scale_p, cap_p, scale_r, cap_r, entropy, chunk, adapter, support,
            expected_grads)
    outs = _LinearKL.apply(
        hp, policy_weight, policy_bias, hr, ref_weight, ref_bias, tok, rows, opts
    )
    if check:
        _check_nan(
            [outs[k] for k, on in ((KL, True), (LOGPROBS, tok is not None),
                                   (ENTROPY, entropy)) if on],
            {"policy_hidden": policy_hidden, "ref_hidden": ref_hidden},
            {k: t for k, t in checked.named.items() if "hidden" not in k and t is not None},
        )
        if support[0] != "none" and tok is not None:
            outside = torch.isneginf(outs[LOGPROBS]) & (tok != IGNORE)  # (N,)
            if bool(outside.any()):
                raise contract.outside_support_error(outside.reshape(leading), tokens)
    kl, lp, rlp, ent = (o.reshape(leading) for o in outs)
    return TokenStats(
        kl,
        lp if tok is not None else None,
        rlp if tok is not None else None,
        ent if entropy else None,
    )


def linear_logprobs(
    hidden: Tensor,
    weight: Tensor,
    tokens: Tensor,
    *,
    bias: Optional[Tensor] = None,
    logit_scale: float = 1.0,
    softcap: Optional[float] = None,
    mask: Optional[Tensor] = None,
    temperature: float = 1.0,
    entropy: bool = False,
    support=None,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    min_p: Optional[float] = None,
    ignore_index: int = -100,
    chunk_rows: Optional[int] = None,
    backend: str = "auto",
    check: bool = True,
    return_support: bool = False,
):
    """log π(token) (and H(π)) of one LM head from its hidden states, as values: the no-grad
    pass of a frozen model (a reference's log-probs, the log-probs of the policy that sampled).

    Shapes: ... leading dims, N their product, H the hidden size, V the vocabulary. The logits
    z = scale·(h Wᵀ + b) (soft-capped) are computed chunk by chunk, one GEMM per chunk, as in
    :func:`linear_kl`, and never held as (N, V); π = softmax(z/T), or π̃ on a sampler's support
    (``support`` / ``top_k`` / ``top_p`` / ``min_p`` as in :func:`linear_kl`). The values equal
    :func:`klpenalty.token_logprobs` and :func:`klpenalty.entropy` of the materialised logits.

    Args:
        hidden: (..., H) float; weight: (V, H), same dtype; bias: optional (V,).
        tokens: (...) integer ids in [0, V) or ``ignore_index``.
        mask: optional (...) bool, True = counts (False rows are never multiplied and give 0).
        logit_scale, softcap, temperature, entropy, support, top_k, top_p, min_p,
            ignore_index, chunk_rows, backend, check: as in :func:`linear_kl`.
        return_support: also return the kept sets of the support at these logits, as
            ``(ids, offsets)`` over the N rows (empty where a row does not count; every token
            without a support): the sets to replay as ``support=`` in later passes on the same
            rows, whatever the weights are then.

    Returns:
        :class:`klpenalty.TokenStats` with ``logprobs`` (and ``entropy`` when asked), (...)
        float32 (float64 for float64 inputs), 0 where not counted; ``kl`` and ``ref_logprobs``
        None. Not differentiable (computed under ``torch.no_grad()``): for gradients use
        :func:`linear_kl` or :func:`linear_policy_loss`. With ``return_support``, the pair
        ``(stats, (ids, offsets))``, int64 ids.

    Raises:
        TypeError / ValueError: as :func:`linear_kl` for the one head.
    """
    _check_head("", hidden, weight, bias)
    leading, device, vocab = hidden.shape[:-1], hidden.device, weight.shape[0]
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.device != device:
            raise ValueError(f"{name} must be on the device of hidden ({device}), got {t.device}")
    v.check_tokens(tokens, leading)
    if tokens.device != device:
        raise ValueError(f"tokens must be on {device}, got {tokens.device}")
    if mask is not None:
        mask = v.check_mask(mask, leading, device)
    if not isinstance(entropy, bool):
        raise TypeError(f"entropy must be a bool, got {type(entropy).__name__}")
    temperature = v.check_temperature(temperature)
    scale = _check_positive("logit_scale", logit_scale)
    cap = None if softcap is None else _check_positive("softcap", softcap)
    ignore_index = v.check_ignore_index(ignore_index)
    _check_chunk_rows(chunk_rows)
    if not isinstance(return_support, bool):
        raise TypeError(f"return_support must be a bool, got {type(return_support).__name__}")
    impl = get_backend(backend, device)
    support = parse_support(support, top_k, top_p, min_p, (*leading, vocab), device)
    n = math.prod(leading)
    h = hidden.reshape(n, hidden.shape[-1])
    rows = None if mask is None else mask.reshape(-1).nonzero().squeeze(1)  # (M,) counted
    tok = tokens.reshape(-1).long()
    if mask is not None:
        tok = tok.masked_fill(~mask.reshape(-1), ignore_index)
    if check:
        v.check_token_range(tok.reshape(leading), vocab, ignore_index)
    tok = tok.masked_fill(tok == ignore_index, IGNORE)
    m = n if rows is None else rows.shape[0]
    chunk = (int(chunk_rows) if chunk_rows is not None
             else default_chunk_rows(m, vocab, device, weight.shape[1], weight.dtype))
    dtype = v.compute_dtype(hidden, weight)
    lp, ent = hidden.new_zeros(n, dtype=dtype), hidden.new_zeros(n, dtype=dtype)
    want = Want.LOGP | (Want.ENTROPY if entropy else 0)
    counts, kept_ids = hidden.new_zeros(n, dtype=torch.long), []
    with torch.no_grad():
        for r0 in range(0, m, chunk):
            r1 = min(m, r0 + chunk)
            sel = slice(r0, r1) if rows is None else rows[r0:r1]
            z = _logits(h[sel], weight, bias, scale, cap)  # (R, V)
            keep, tau, sampler = _chunk_support(support, z, rows, r0, r1)
            out, st = impl.forward_op(z, None, tok[sel], None, keep, tau, temperature, IGNORE,
                                      want, False, 0, 0, *sampler)
            lp[sel], ent[sel] = out[:, LOGPROBS], out[:, ENTROPY]
            if return_support:  # the op's support: keep ∧ z ≥ its threshold (ST_TAU)
                tau_used = st[:, contract.ST_TAU].unsqueeze(1)  # float32 (float64)
                kept = (z if z.dtype == tau_used.dtype else z.to(tau_used.dtype)) >= tau_used
                if keep is not None:
                    kept &= keep
                counts[sel] = kept.sum(1)
                kept_ids.append(kept.nonzero()[:, 1])
            del z, keep, out, st
    if check:
        _check_nan([lp, ent] if entropy else [lp], {"hidden": hidden},
                   {k: t for k, t in (("weight", weight), ("bias", bias)) if t is not None})
        if support[0] != "none":
            outside = torch.isneginf(lp) & (tok != IGNORE)
            if bool(outside.any()):
                raise contract.outside_support_error(outside.reshape(leading), tokens)
    stats = TokenStats(None, lp.reshape(leading), None, ent.reshape(leading) if entropy else None)
    if not return_support:
        return stats
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    ids = torch.cat(kept_ids) if kept_ids else counts.new_zeros(0)
    return stats, (ids, offsets)


# ------------------------------------------------------------------------------ fused loss
REDUCTIONS = ("token-mean", "sequence-mean", "sum")


class PolicyLoss(NamedTuple):
    """What :func:`linear_policy_loss` returns. Only ``loss`` is differentiable; the rest are
    detached metrics. Per-token fields are (...) (the leading dims of the hidden states), 0 (or
    False) at positions that do not count."""

    loss: Tensor
    """() the loss, pg_loss + beta·kl_loss: call ``loss.backward()``."""
    pg_loss: Tensor
    """() the reduced clipped surrogate (0 without advantages)."""
    kl_loss: Tensor
    """() the reduced (weighted) exact KL, before beta."""
    kl: Tensor
    """(...) KL(π‖ρ) per position."""
    logprobs: Tensor
    """(...) log π(token)."""
    ref_logprobs: Tensor
    """(...) log ρ(token)."""
    ratio: Tensor
    """(...) π/π_old = exp(logprobs − old_logprobs) (1 without old_logprobs)."""
    clipped: Tensor
    """(...) bool, the clip bound is active (the token's surrogate gradient is 0)."""
    clip_fraction: Tensor
    """() the fraction of the counted tokens that are clipped."""


def _clipped_surrogate(lp: Tensor, old: Optional[Tensor], adv: Optional[Tensor],
                       eps_low: float, eps_high: float):
    """Per token (R,): (loss, ∂loss/∂lp, ratio, clipped) of the PPO clipped surrogate
    loss = max(−A·r, −A·clip(r, 1 − ε_low, 1 + ε_high)), r = exp(lp − old) (old None: r = 1,
    on-policy). Its lp-derivative is −A·r except where the clip bound is active (A > 0 and
    r > 1 + ε_high, or A < 0 and r < 1 − ε_low), where it is 0 (autograd's rule: ties split
    evenly between two equal branches, whose derivatives agree). No advantages: all zero."""
    ratio = torch.ones_like(lp) if old is None else torch.exp(lp - old)
    if adv is None:
        zero = torch.zeros_like(lp)
        return zero, zero, ratio, torch.zeros_like(lp, dtype=torch.bool)
    clipped = ((adv > 0) & (ratio > 1.0 + eps_high)) | ((adv < 0) & (ratio < 1.0 - eps_low))
    unclipped = -adv * ratio
    loss = torch.maximum(unclipped, -adv * ratio.clamp(1.0 - eps_low, 1.0 + eps_high))
    return loss, unclipped.masked_fill(clipped, 0.0), ratio, clipped


class _PolicyLoss(torch.autograd.Function):
    """The fused loss: chunked LM heads → engine → the loss's ∂/∂z in the same pass.

    Inputs are validated; hidden states are (N, H) rows, ``rows`` (M,) the counted rows (None =
    all N), ``tokens`` (N,) int64. Per token (N,), 0 where not counted: ``coef`` the reduction's
    weight c, ``kl_coef`` c·w (the KL's weight), ``adv`` and ``old`` (or None). The upstream
    gradient of the scalar loss is known in the forward up to one factor: each chunk's ∂loss/∂z
    (the KL column c·w·beta, the log-prob column c·∂surrogate/∂lp) goes straight through the
    backend's backward op and the chain rule into grad_h rows, grad_W and grad_b, which are
    held until the backward scales them by the upstream gradient. The reference is frozen.
    """

    @staticmethod
    def forward(ctx, hp, wp, bp, hr, wr, br, tokens, rows, coef, kl_coef, adv, old, opts):
        (temperature, scale_p, cap_p, scale_r, cap_r, beta, eps_low, eps_high, chunk, adapter,
         need) = opts
        n = hp.shape[0]
        dtype = v.compute_dtype(hp, wp, hr, wr)
        kl, lp, rlp, ratio, pg = (hp.new_zeros(n, dtype=dtype) for _ in range(5))
        clipped = torch.zeros(n, dtype=torch.bool, device=hp.device)
        grad_hp = torch.zeros_like(hp) if need[0] else None
        grad_wp = _accumulator(wp) if need[1] else None
        grad_bp = _accumulator(bp) if need[2] else None
        m = n if rows is None else rows.shape[0]
        for r0 in range(0, m, chunk):
            r1 = min(m, r0 + chunk)
            sel = slice(r0, r1) if rows is None else rows[r0:r1]
            hpc, tok = hp[sel], tokens[sel]
            zp = _logits(hpc, wp, bp, scale_p, cap_p)  # (R, V)
            zr = _logits(hr[sel], wr, br, scale_r, cap_r)  # (R, V)
            out, st = adapter.forward(zp, zr, tok, temperature, False)
            parts = _clipped_surrogate(
                out[:, LOGPROBS], None if old is None else old[sel],
                None if adv is None else adv[sel], eps_low, eps_high,
            )
            for dst, src in zip((kl, lp, rlp, pg, ratio, clipped),
                                (out[:, KL], out[:, LOGPROBS], out[:, REF_LOGPROBS], *parts[::2],
                                 parts[3])):
                dst[sel] = src
            if any(need):
                grad_out = out.new_zeros(out.shape)  # (R, 4): ∂loss/∂(kl, logp, ref_logp, ent)
                grad_out[:, KL] = kl_coef[sel] * beta
                grad_out[:, LOGPROBS] = coef[sel] * parts[1]
                # ∂KL/∂zp reads log ρ; without the KL in the loss the reference's logits go now
                zr = zr if beta != 0 else None
                dzp, _ = adapter.backward(grad_out, zp, zr, tok, st, temperature, True, False)
                zr = None
                zp = zp if cap_p is not None else None  # read again only by the soft-cap
                dzp = _chain(dzp, zp, scale_p, cap_p, wp.dtype)  # (R, V), ∂/∂(h Wᵀ + b)
                zp = None
                _head_grads(dzp, hpc, wp, sel, grad_hp, grad_wp, grad_bp)
                dzp = None
            del zp, zr, out, st, parts  # free this chunk's buffers before the next
        acc = torch.float64
        pg_loss = (coef.to(acc) * pg.to(acc)).sum()
        kl_loss = (kl_coef.to(acc) * kl.to(acc)).sum()
        loss = (pg_loss + beta * kl_loss).to(dtype)
        ctx.grads = (grad_hp, grad_wp, grad_bp)
        ctx.dtypes = (hp.dtype, wp.dtype, None if bp is None else bp.dtype)
        metrics = (pg_loss.to(dtype), kl_loss.to(dtype), kl, lp, rlp, ratio, clipped)
        ctx.mark_non_differentiable(*metrics)
        return (loss, *metrics)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss, *_):
        none = (None,) * 10
        if ctx.grads is None:
            raise RuntimeError(
                "linear_policy_loss: the loss can be backpropagated once (its gradient is "
                "formed in the forward and handed over in the first backward); compute the "
                "loss again for a second backward"
            )
        grads, ctx.grads = ctx.grads, None
        out = []
        for g, dtype in zip(grads, ctx.dtypes):
            if g is not None and grad_loss is not None:
                # scale in place (the buffer is handed over); 1 needs nothing (read on CPU only)
                if not (_host_checks(g.device) and float(grad_loss) == 1.0):
                    g.mul_(grad_loss.to(g.dtype))
                g = g.to(dtype)
            out.append(None if grad_loss is None else g)
        return (*out, *none)


def _check_clip(name: str, value: object) -> float:
    x = v.as_real(name, value)
    if not math.isfinite(x) or x < 0:
        raise ValueError(f"{name} must be finite and >= 0, got {x}")
    return x


def linear_policy_loss(
    policy_hidden: Tensor,
    policy_weight: Tensor,
    ref_hidden: Tensor,
    ref_weight: Tensor,
    tokens: Tensor,
    *,
    beta: float,
    advantages: Optional[Tensor] = None,
    old_logprobs: Optional[Tensor] = None,
    mask: Optional[Tensor] = None,
    kl_weights: Optional[Tensor] = None,
    epsilon_low: float = 0.2,
    epsilon_high: Optional[float] = None,
    reduction: str = "token-mean",
    temperature: float = 1.0,
    policy_bias: Optional[Tensor] = None,
    ref_bias: Optional[Tensor] = None,
    logit_scale: float = 1.0,
    softcap: Optional[float] = None,
    ref_logit_scale: Optional[float] = None,
    ref_softcap: Optional[float] = None,
    ignore_index: int = -100,
    chunk_rows: Optional[int] = None,
    backend: str = "auto",
    check: bool = True,
) -> PolicyLoss:
    """A PPO/GRPO policy loss with the exact KL penalty, straight from the hidden states: the
    fused LM head whose forward+backward costs what the unfused one does.

    Shapes: ... the leading dims of the hidden states, e.g. (B, T) (B sequences, T positions:
    sequences run along the last leading dim), N their product, H_p / H_r the hidden sizes, V
    the vocabulary. The logits z = scale·(h Wᵀ + b) (soft-capped) are never held as (N, V).

    Per counted token t, with π = softmax(z_p/T), ρ = softmax(z_r/T), r_t = π(a_t)/π_old(a_t)
    and A_t its advantage::

        pg_t   = max(−A_t·r_t, −A_t·clip(r_t, 1 − ε_low, 1 + ε_high))   (clipped surrogate)
        loss_t = pg_t + beta·w_t·KL(π_t‖ρ_t)                             (exact KL, in the loss)

    and ``loss = Σ_t c_t·loss_t`` with the reduction's weights c_t (0 where not counted):

    - ``"token-mean"``: 1/M, M the batch's counted tokens (TRL's ``bnpo``/DAPO, verl's
      ``token-mean``);
    - ``"sequence-mean"``: 1/(M_b·S), M_b the counted tokens of the token's sequence, S the
      sequences with at least one (GRPO, verl's ``seq-mean-token-mean``; empty sequences are
      left out of the mean);
    - ``"sum"``: 1 (divide by your own constant, e.g. Dr. GRPO's B·T_max or a global token
      count across data-parallel ranks).

    A token counts where ``mask`` is True and ``tokens`` is not ``ignore_index``; elsewhere
    nothing is read (hidden states, advantages, old log-probs, weights may hold anything).

    How: each chunk of R counted rows computes both models' logits (2 GEMMs), the engine's
    statistics, and, since the loss is a known function of them, its gradient with respect to
    the policy's logits at once; that goes through the two gradient GEMMs (grad_h = dz W,
    grad_W += dzᵀ h) in the forward: 4 LM-head GEMMs overall, as the unfused path, and no
    recomputation. The backward only scales the held gradients by the upstream scalar. Peak
    extra memory: three (R, V) buffers (both logits and dz) plus O(N); see
    :func:`default_chunk_rows`. Per-token losses with their own upstream gradients are
    :func:`linear_kl`'s job (it recomputes in the backward).

    Args:
        policy_hidden: (..., H_p) float, the policy's last hidden states. Gradients flow.
        policy_weight: (V, H_p), the policy's LM head, same dtype. Gradients flow.
        ref_hidden: (..., H_r), the frozen reference's hidden states (no gradient: a
            reference tensor that requires grad raises while grad mode is on).
        ref_weight: (V, H_r), the reference's LM head, the dtype of ``ref_hidden``.
        tokens: (...) integer ids in [0, V) or ``ignore_index``, the sampled tokens a_t.
        beta: ≥ 0, the KL coefficient (0: the KL is only reported).
        advantages: optional (...) float, A_t (e.g. GRPO's sequence advantage repeated over its
            tokens); None: no surrogate term (the loss is beta times the reduced KL).
            Treated as a constant.
        old_logprobs: optional (...) float, log π_old(a_t) of the policy that sampled; None:
            on-policy (r_t = 1 in value, gradient −A_t·∇log π). Treated as a constant.
        mask: optional (...) bool, True = the token counts (e.g. the completion mask).
        kl_weights: optional (...) float, w_t multiplying each token's KL (default 1).
        epsilon_low, epsilon_high: ≥ 0, the clip range [1 − ε_low, 1 + ε_high] of the ratio;
            ``epsilon_high`` None = ``epsilon_low`` (DAPO's clip-higher: e.g. 0.2 / 0.28).
        reduction: ``"token-mean"``, ``"sequence-mean"`` or ``"sum"`` (above).
        temperature: > 0, divides both models' logits (the sampling temperature).
        policy_bias, ref_bias, logit_scale, softcap, ref_logit_scale, ref_softcap,
            ignore_index, backend: as in :func:`linear_kl`.
        chunk_rows: ≥ 1 rows per chunk; None: :func:`default_chunk_rows`.
        check: raise ValueError for token ids out of range, NaN in a counted position's
            statistics (naming the tensor that holds it), NaN in the advantages or old
            log-probs of a counted token. A few host reads per call.

    Returns:
        :class:`PolicyLoss`: ``loss`` () differentiable once with respect to the policy's
        hidden states, weight and bias (gradients in their dtypes; bf16/fp16 weight gradients
        accumulated in float32), and detached metrics: ``pg_loss``, ``kl_loss`` (), per token
        ``kl``, ``logprobs``, ``ref_logprobs``, ``ratio`` (...) float32 (float64 for float64
        inputs), ``clipped`` (...) bool, ``clip_fraction`` (). ``loss`` can be backpropagated
        once (a second backward raises); scaling it (``(loss * 3.7).backward()``, gradient
        accumulation) scales every gradient. Each call holds its gradient buffers (grad_h,
        grad_W, grad_b) from its forward to its backward: for gradient accumulation call
        ``backward()`` per micro-batch rather than summing the losses of many calls first.

    Raises:
        TypeError / ValueError: as :func:`linear_kl`, and for advantages / old_logprobs /
            kl_weights of another shape, device or a non-float dtype, beta < 0, ε < 0, an
            unknown reduction, ``"sequence-mean"`` without a sequence dim, a reference tensor
            that requires grad.
    """
    if tokens is None:
        raise TypeError("tokens must be a torch.Tensor (the sampled tokens), got None")
    checked = _check_heads(
        policy_hidden, policy_weight, ref_hidden, ref_weight, tokens=tokens, mask=mask,
        temperature=temperature, policy_bias=policy_bias, ref_bias=ref_bias,
        logit_scale=logit_scale, softcap=softcap, ref_logit_scale=ref_logit_scale,
        ref_softcap=ref_softcap, ignore_index=ignore_index, chunk_rows=chunk_rows,
        backend=backend,
    )
    leading, device, named = checked.leading, policy_hidden.device, checked.named
    per_token = {"advantages": advantages, "old_logprobs": old_logprobs, "kl_weights": kl_weights}
    for name, t in per_token.items():
        if t is not None:
            v.check_per_token(name, t, leading)
            if t.device != device:
                raise ValueError(f"{name} must be on {device}, got {t.device}")
    beta = v.check_beta(beta, "beta")
    eps_low = _check_clip("epsilon_low", epsilon_low)
    eps_high = eps_low if epsilon_high is None else _check_clip("epsilon_high", epsilon_high)
    reduction = v.check_choice("reduction", reduction, REDUCTIONS)
    if reduction == "sequence-mean" and len(leading) < 1:
        raise ValueError(
            "reduction='sequence-mean' needs hidden states (..., T, H) with a sequence dim T, "
            f"got policy_hidden {v.describe(policy_hidden)}"
        )
    if torch.is_grad_enabled():
        for name in ("ref_hidden", "ref_weight", "ref_bias"):
            t = named[name]
            if t is not None and t.requires_grad:
                raise ValueError(
                    f"{name} requires grad ({v.describe(t)}): linear_policy_loss treats the "
                    f"reference as frozen; pass {name}.detach(), or use linear_kl for "
                    "gradients into the reference"
                )

    counted = tokens != checked.ignore_index  # (...)
    if checked.mask is not None:
        counted &= checked.mask
    dtype = v.compute_dtype(policy_hidden, policy_weight, ref_hidden, ref_weight)
    coef = counted.to(dtype)  # (...) the reduction's weights c_t
    if reduction == "token-mean":
        coef = coef / counted.sum().clamp(min=1)
    elif reduction == "sequence-mean":
        per_seq = counted.sum(-1, keepdim=True)  # (..., 1)
        seqs = (per_seq > 0).sum().clamp(min=1)
        coef = coef / (per_seq.clamp(min=1) * seqs)
    zero = torch.zeros((), dtype=dtype, device=device)
    flat = {  # constants (detached), 0 where not counted
        name: None if t is None else torch.where(counted, t.detach().to(dtype), zero).reshape(-1)
        for name, t in per_token.items()
    }
    if check:
        for name, t in flat.items():
            bad = None if t is None else t.isnan()  # (N,), counted positions only
            if bad is not None and bool(bad.any()):
                at = bad.nonzero()[0, 0]
                first = tuple(int(i) for i in torch.unravel_index(at, leading)) if leading else ()
                raise ValueError(
                    f"{name} contains NaN ({v.describe(per_token[name])}) at "
                    f"{int(bad.sum())} counted position(s), the first at index {first}"
                )
    coef = coef.reshape(-1)
    kl_coef = coef if flat["kl_weights"] is None else coef * flat["kl_weights"]

    every = bool(counted.all())  # then the chunks are slices (no row gathers)
    hp, hr, rows, tok = _flat_rows(
        policy_hidden, ref_hidden, tokens, None if every else counted, checked.vocab,
        checked.ignore_index, check,
    )
    m = hp.shape[0] if rows is None else rows.shape[0]
    chunk = (int(chunk_rows) if chunk_rows is not None
             else _plan_rows(m, checked.vocab, policy_weight, ref_weight))
    grad_on = torch.is_grad_enabled()
    need = tuple(grad_on and t is not None and t.requires_grad
                 for t in (policy_hidden, policy_weight, policy_bias))
    opts = (checked.temperature, *checked.transforms, beta, eps_low, eps_high, chunk,
            LocalChunks(checked.impl), need)
    loss, pg_loss, kl_loss, kl, lp, rlp, ratio, clipped = _PolicyLoss.apply(
        hp, policy_weight, policy_bias, hr, ref_weight, ref_bias, tok, rows, coef, kl_coef,
        flat["advantages"], flat["old_logprobs"], opts,
    )
    if check:
        _check_nan(
            [kl, lp], {"policy_hidden": policy_hidden, "ref_hidden": ref_hidden},
            {k: t for k, t in named.items() if "hidden" not in k and t is not None},
        )
    n_counted = counted.sum()
    clip_fraction = (clipped.sum() / n_counted.clamp(min=1)).to(dtype)
    kl, lp, rlp, ratio, clipped = (o.reshape(leading) for o in (kl, lp, rlp, ratio, clipped))
    return PolicyLoss(loss, pg_loss, kl_loss, kl, lp, rlp, ratio, clipped, clip_fraction)
