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

import math
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

__all__ = ["linear_kl", "linear_policy_loss", "PolicyLoss"]

# Rows R of a chunk (default_chunk_rows). Both paths peak at three (R, V) buffers of the compute
# dtype per chunk: both models' logits and ∂/∂z.
# CPU: R = CPU_CHUNK_ELEMENTS / V rows, a multiple of 16 (GEMM-friendly), so the peak is at most
# 3·CPU_CHUNK_ELEMENTS elements (48 MiB of float32): ≤ 10% of one model's (N, V) float32 logits
# from N ≥ 30·R on. Larger chunks make the GEMMs more efficient (the weight-gradient GEMM has
# K = R and reads and writes the (V, H) accumulator once per chunk); R = 128 at V = 32000
# (benchmarks/README.md, the chunk-rows sweep).
CPU_CHUNK_ELEMENTS = 4 << 20
CPU_MIN_CHUNK_ROWS = 16
# Accelerators: every chunk reads the whole (V, H) weight and, for bf16/fp16 weights, reads and
# writes the (V, H) float32 weight-gradient accumulator: a chunk is compute-bound from ~750 rows
# at H = 4096 (an H100/H200 does ~200 flop per byte read). R = ACCEL_CHUNK_ELEMENTS / V clipped
# to [1024, 2048] rows, a multiple of 128: 1024 at V = 128256 (256 MiB of bf16 logits per
# model and chunk), 2048 at V ≤ 65536.
ACCEL_CHUNK_ELEMENTS = 1 << 27
ACCEL_MIN_CHUNK_ROWS = 1024
ACCEL_MAX_CHUNK_ROWS = 2048

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
def default_chunk_rows(n_rows: int, vocab: int, device: torch.device) -> int:
    """Rows R of one chunk for an (N, V) problem on ``device`` (clipped to [1, N]).

    CPU: ``CPU_CHUNK_ELEMENTS // V`` rounded down to a multiple of 16, at least 16 rows;
    accelerators: ``ACCEL_CHUNK_ELEMENTS // V`` clipped to [1024, 2048], a multiple of 128.
    The peak extra memory of :func:`linear_kl` and :func:`linear_policy_loss` is three (R, V)
    buffers of the compute dtype plus O(N).
    """
    vocab = max(vocab, 1)
    if device.type == "cpu":
        rows = max(CPU_MIN_CHUNK_ROWS, CPU_CHUNK_ELEMENTS // vocab // 16 * 16)
    else:
        rows = min(ACCEL_MAX_CHUNK_ROWS, max(ACCEL_MIN_CHUNK_ROWS, ACCEL_CHUNK_ELEMENTS // vocab))
        rows = rows // 128 * 128
    return max(1, min(rows, n_rows))


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


class _LinearKL(torch.autograd.Function):
    """Chunked LM heads of both models → engine → per-row outputs, with a recomputing backward.

    Inputs are already validated; hidden states are (N, H_p) / (N, H_r) rows. ``rows`` (M,)
    int64 are the counted rows (None = all N); ``tokens`` (N,) int64 with ignored positions
    set to :data:`IGNORE`, or None. ``opts`` ends with the chunk adapter and the parsed support
    (:func:`klpenalty.sampling.parse_support`): each chunk's thresholds are computed by the op on
    its rows' logits (they are per row) and kept in the saved stats (``ST_TAU``) for the
    backward; a kept set is re-read there.
    Outputs: kl, logprobs, ref_logprobs, entropy, each (N,) in the compute dtype (0 for
    outputs not requested, rows not counted).
    """

    @staticmethod
    def forward(ctx, hp, wp, bp, hr, wr, br, tokens, rows, opts):
        temperature, scale_p, cap_p, scale_r, cap_r, want_entropy, chunk, adapter, support = opts
        n = hp.shape[0]
        dtype = v.compute_dtype(hp, wp, hr, wr)
        outs = [hp.new_zeros(n, dtype=dtype) for _ in range(4)]
        m = n if rows is None else rows.shape[0]
        stats = None
        for r0 in range(0, m, chunk):
            r1 = min(m, r0 + chunk)
            sel = slice(r0, r1) if rows is None else rows[r0:r1]
            zp = _logits(hp[sel], wp, bp, scale_p, cap_p)  # (R, V)
            zr = _logits(hr[sel], wr, br, scale_r, cap_r)  # (R, V)
            tok = None if tokens is None else tokens[sel]
            keep, tau, sampler = _chunk_support(support, zp, rows, r0, r1)
            out, st = adapter.forward(zp, zr, tok, temperature, want_entropy, keep, tau, sampler)
            del zp, zr, keep
            if stats is None:
                stats = st.new_empty((m, st.shape[-1]))
            stats[r0:r1] = st
            for k in range(4):
                outs[k][sel] = out[:, k]
            del out, st
        ctx.save_for_backward(hp, wp, bp, hr, wr, br, tokens, rows, stats)
        ctx.opts = opts
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
        temperature, scale_p, cap_p, scale_r, cap_r, _, chunk, adapter, support = ctx.opts
        need = ctx.needs_input_grad[:6]
        need_p, need_r = any(need[:3]), any(need[3:6])
        n = hp.shape[0]
        m = n if rows is None else rows.shape[0]
        grad_hp = torch.zeros_like(hp) if need[0] else None
        grad_wp = _accumulator(wp) if need[1] else None
        grad_bp = _accumulator(bp) if need[2] else None
        grad_hr = torch.zeros_like(hr) if need[3] else None
        grad_wr = _accumulator(wr) if need[4] else None
        grad_br = _accumulator(br) if need[5] else None
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
                dzp, dzr = adapter.backward(
                    g_all[sel].to(dtype), zp, zr, tok, stats[r0:r1], temperature, need_p,
                    need_r, keep, tau,
                )
                del keep
                # the logits are needed again only for the soft-cap's derivative: free them now
                zp = zp if cap_p is not None else None
                zr = zr if cap_r is not None else None
                if dzp is not None:
                    dzp = _chain(dzp, zp, scale_p, cap_p, wp.dtype)  # (R, V), ∂/∂(h Wᵀ + b)
                    zp = None
                    _head_grads(dzp, hpc, wp, sel, grad_hp, grad_wp, grad_bp)
                    dzp = None
                if dzr is not None:
                    dzr = _chain(dzr, zr, scale_r, cap_r, wr.dtype)
                    zr = None
                    _head_grads(dzr, hrc, wr, sel, grad_hr, grad_wr, grad_br)
                # free this chunk's buffers before the next chunk allocates its own
                del zp, zr, dzp, dzr
        grad_hp = None if grad_hp is None else adapter.hidden_grad(grad_hp)
        grad_hr = None if grad_hr is None else adapter.hidden_grad(grad_hr)
        cast = lambda acc, t: None if acc is None else acc.to(t.dtype)  # noqa: E731
        return (
            grad_hp, cast(grad_wp, wp), cast(grad_bp, bp),
            grad_hr, cast(grad_wr, wr), cast(grad_br, br),
            None, None, None,
        )


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
    hname, wname, bname = f"{side}_hidden", f"{side}_weight{suffix}", f"{side}_bias{suffix}"
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
    if chunk_rows is not None:
        if isinstance(chunk_rows, bool) or not isinstance(chunk_rows, Integral):
            raise TypeError(f"chunk_rows must be an int or None, got {type(chunk_rows).__name__}")
        if chunk_rows < 1:
            raise ValueError(f"chunk_rows must be >= 1 or None, got {chunk_rows}")
    impl = get_backend(backend, device)
    return _Checked(vocab, leading, named, mask, temperature, (scale_p, cap_p, scale_r, cap_r),
                    ignore_index, impl)


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
        chunk_rows: ≥ 1 rows per chunk; None: :func:`default_chunk_rows` (≈16 MiB of
            float32 logits per model on CPU; 1024-2048 rows on accelerators, where smaller
            GEMMs are bound by reading the weight and the weight-gradient accumulator).
        backend: as in :func:`klpenalty.full_kl` (the engine run on each chunk).
        check: raise ValueError for token ids out of range and for NaN in a counted position's
            outputs (naming the hidden states or the weight that hold NaN). One host read of
            the tokens and one of the (N,) outputs per call; ``check=False`` skips both. (A
            ``mask`` costs one more: the indices of the counted rows.) With a support, a
            sampled token outside it raises too, naming its position (``check=False``: its
            log-prob is −inf).

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
        top_p=top_p, min_p=min_p,
    )


def _linear_kl(
    policy_hidden, policy_weight, ref_hidden, ref_weight, *, tokens, mask, temperature,
    policy_bias, ref_bias, logit_scale, softcap, ref_logit_scale, ref_softcap, entropy,
    ignore_index, chunk_rows, backend, check, parallel=None, suffix: str = "",
    support=None, top_k=None, top_p=None, min_p=None,
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
             else default_chunk_rows(m, vocab, policy_hidden.device))
    scale_p, cap_p, scale_r, cap_r = checked.transforms
    opts = (temperature, scale_p, cap_p, scale_r, cap_r, entropy, chunk, adapter, support)
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
             else default_chunk_rows(m, checked.vocab, device))
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
