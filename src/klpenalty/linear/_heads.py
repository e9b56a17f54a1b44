"""The LM-head math the chunked functions of :mod:`klpenalty.linear` share: the chunk plan
(:func:`default_chunk_rows`), one chunk's logits and the chain rule back through them into the
hidden states, weights and biases, the arguments' checks, and the flat rows of a batch.

Shape letters: N rows (the product of the leading dims), M the counted rows, R rows of one
chunk, V the vocabulary, H a hidden size (H_p of the policy, H_r of the reference).
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

from .. import _validation as v
from ..ops import contract
from ..ops.dispatch import get_backend
from .chunks import IGNORE


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
# CPU: floor CPU_MIN_CHUNK_BYTES (48 MiB: 3·4M float32 elements), cap
# CPU_MAX_MEMORY_FRACTION of the machine's physical memory (os.sysconf: the plan is a function
# of the shapes and the machine, never of the momentary free memory, so runs repeat), at least
# 16 rows. Measured on a 2-core AVX2 machine: benchmarks/README.md (the chunk-plan sweep).
CHUNK_BUDGET_HEADS = 1.0
CPU_MIN_CHUNK_BYTES = 48 << 20
CPU_MAX_MEMORY_FRACTION = 1 / 8
CPU_MIN_CHUNK_ROWS = 16
CPU_CHUNK_MULTIPLE = 16
# Accelerators (reasoned, not measured on a GPU): a chunk's weight-gradient
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


# ------------------------------------------------------------------------------ chunk plan
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


def _plan_rows(chunk_rows: Optional[int], n_rows: int, vocab: int, *weights: Tensor) -> int:
    """Rows R of one chunk: ``chunk_rows`` where given, else :func:`default_chunk_rows` for the
    heads ``weights`` (V_r, H_i) (a vocabulary slice's rows or the whole head; ``vocab`` the
    whole V): H the largest hidden size, the dtype float64 if any weight is, else the widest."""
    if chunk_rows is not None:
        return int(chunk_rows)
    dtypes = tuple(w.dtype for w in weights)
    dtype = (torch.float64 if torch.float64 in dtypes
             else max(dtypes, key=lambda d: d.itemsize))
    hidden = max(w.shape[1] for w in weights)
    return default_chunk_rows(n_rows, vocab, weights[0].device, hidden, dtype)


# bf16/fp16 heads on CPU: the GEMMs run in float32 on the upcast operands (most CPUs have no
# fast half-precision GEMM: on a 2-core AVX2 machine torch's bf16 GEMM is several times slower
# than float32, benchmarks/README.md), the weight upcast one block of rows at a time so that no
# (V, H) float32 copy exists: a block holds GEMM_BLOCK_ELEMENTS elements (16 MiB in float32).
# The logits come out in float32, unrounded (more exact than the plain bf16 ``F.linear``).
GEMM_BLOCK_ELEMENTS = 4 << 20
# torch's float32 GEMM (MKL) gives a row the same result whatever the number of rows M only
# from about 12 rows on (tests/test_batch_invariance.py); the upcast path pads a chunk of fewer
# rows with zero rows to GEMM_MIN_ROWS, so a row's logits and hidden-state gradient do not
# depend on the chunk that holds it (as with oneDNN's half GEMM, invariant for any M).
GEMM_MIN_ROWS = 16


def gemm_dtype(t: Tensor) -> torch.dtype:
    """The dtype of the LM-head GEMMs and of their ∂/∂(h Wᵀ + b) for an operand ``t``: float32
    for a bf16/fp16 operand on CPU, else ``t``'s dtype (an accelerator multiplies half
    operands with float32 accumulation itself)."""
    if t.dtype in (torch.bfloat16, torch.float16) and t.device.type == "cpu":
        return torch.float32
    return t.dtype


def _vocab_blocks(weight: Tensor, upcast: bool = True):
    """(start, end, weight[start:end] in float32, or None without ``upcast``) over the rows of
    a (V, H) half weight."""
    rows = max(1, GEMM_BLOCK_ELEMENTS // max(1, weight.shape[1]))
    for start in range(0, weight.shape[0], rows):
        end = min(weight.shape[0], start + rows)
        yield start, end, weight[start:end].float() if upcast else None


def _linear(h: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    """(R, V) h Wᵀ + b in :func:`gemm_dtype`: ``F.linear``, or for half operands on CPU float32
    GEMMs on the upcast h and blocks of W written into the columns of one float32 output."""
    if gemm_dtype(h) == h.dtype:
        return F.linear(h, weight, bias)
    h32 = _padded(h.float())
    z = torch.empty((h32.shape[0], weight.shape[0]), dtype=torch.float32, device=h.device)
    for start, end, w32 in _vocab_blocks(weight):
        if bias is None:
            torch.mm(h32, w32.t(), out=z[:, start:end])
        else:
            torch.addmm(bias[start:end].float(), h32, w32.t(), out=z[:, start:end])
    return z[: h.shape[0]]


def _padded(a: Tensor) -> Tensor:
    """(max(R, GEMM_MIN_ROWS), K): ``a`` (R, K) followed by zero rows."""
    if a.shape[0] >= GEMM_MIN_ROWS:
        return a
    return torch.cat([a, a.new_zeros((GEMM_MIN_ROWS - a.shape[0], a.shape[1]))])


def _logits(h: Tensor, weight: Tensor, bias: Optional[Tensor], scale: float, softcap) -> Tensor:
    """(R, V) logits scale·(h Wᵀ + b), soft-capped as cap·tanh(z/cap).

    h (R, H), weight (V, H), bias (V,) or None. The matmul runs in :func:`gemm_dtype` with
    float32 accumulation (torch's GEMM): on an accelerator in the input dtype, the logits
    rounded once to it (what ``F.linear`` returns); for bf16/fp16 on CPU in float32, the
    logits exact to float32. With a scale or a cap the GEMM's output is upcast to the compute
    dtype (float32; float64 for float64 inputs) *before* the transform, which then runs in
    place in that dtype: never a rounding to half precision after the scale or the tanh
    (docs/numerics.md, "the logit transform").
    """
    z = _linear(h, weight, bias)
    if scale == 1.0 and softcap is None:
        return z
    z = z.to(v.compute_dtype(z))  # no copy for float32/float64
    if scale != 1.0:
        z.mul_(scale)
    if softcap is not None:
        z.div_(softcap).tanh_().mul_(softcap)
    return z


def _chain(dz: Tensor, z: Optional[Tensor], scale: float, softcap, dtype: torch.dtype) -> Tensor:
    """∂/∂(h Wᵀ + b) from ∂/∂z of the transformed logits z (R, V), returned in ``dtype`` (the
    :func:`gemm_dtype` of the hidden states).

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
    grad_h[sel] = dz W (R, H), grad_w += dzᵀ h (V, H), grad_b += Σ_rows dz (V,). ``dz`` in
    :func:`gemm_dtype` of h: float32 against half operands on CPU, whose GEMMs then run in
    float32 on the upcast h and blocks of W (``grad_w`` is then a float32 accumulator)."""
    if dz.dtype == weight.dtype:
        if grad_h is not None:
            grad_h[sel] = dz @ weight
        if grad_w is not None:
            _add_matmul(grad_w, dz.t(), h)
    elif grad_h is not None or grad_w is not None:
        h32 = h.float() if grad_w is not None else None
        dzp = None if grad_h is None else _padded(dz)
        acc = None if grad_h is None else dz.new_zeros((dzp.shape[0], weight.shape[1]))
        for start, end, w32 in _vocab_blocks(weight, upcast=acc is not None):
            if acc is not None:
                acc.addmm_(dzp[:, start:end], w32)
            if grad_w is not None:
                grad_w[start:end].addmm_(dz[:, start:end].t(), h32)
        if acc is not None:
            grad_h[sel] = acc[: dz.shape[0]].to(grad_h.dtype)
    if grad_b is not None:
        grad_b.add_(dz.sum(0, dtype=grad_b.dtype))


# ------------------------------------------------------------------------------ validation
def _check_positive(name: str, value: object) -> float:
    x = v.as_real(name, value)
    if not math.isfinite(x) or x <= 0:
        raise ValueError(f"{name} must be finite and > 0, got {x}")
    return x


def _check_transform(logit_scale: object, softcap: object) -> tuple[float, Optional[float]]:
    """(scale, cap) of one head's logit transform: ``logit_scale`` > 0, ``softcap`` > 0 or
    None."""
    scale = _check_positive("logit_scale", logit_scale)
    return scale, None if softcap is None else _check_positive("softcap", softcap)


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


def _check_devices(named: dict) -> None:
    """Every tensor of ``named`` (name -> tensor or None) on the device of the first."""
    (first, t0), *rest = named.items()
    for name, t in rest:
        if t is not None and t.device != t0.device:
            raise ValueError(
                f"{name} must be on the device of {first} ({t0.device}), got {t.device}"
            )


def _check_run(leading, device, *, tokens, mask, temperature, ignore_index, chunk_rows,
               backend) -> tuple:
    """The arguments of a chunked run besides the heads: ``tokens`` (...) integer on
    ``device`` or None, ``mask``, ``temperature``, ``ignore_index``, ``chunk_rows`` and the
    backend. Returns (mask, temperature, ignore_index, impl)."""
    if tokens is not None:
        v.check_tokens(tokens, leading)
        if tokens.device != device:
            raise ValueError(f"tokens must be on {device}, got {tokens.device}")
    if mask is not None:
        mask = v.check_mask(mask, leading, device)
    temperature = v.check_temperature(temperature)
    ignore_index = v.check_ignore_index(ignore_index)
    if chunk_rows is not None:
        if isinstance(chunk_rows, bool) or not isinstance(chunk_rows, Integral):
            raise TypeError(f"chunk_rows must be an int or None, got {type(chunk_rows).__name__}")
        if chunk_rows < 1:
            raise ValueError(f"chunk_rows must be >= 1 or None, got {chunk_rows}")
    return mask, temperature, ignore_index, get_backend(backend, device)


def _check_flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


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
    chunk_rows, backend, suffix: str = "", roles: tuple[str, str] = ("policy", "ref"),
) -> _Checked:
    """The arguments that :func:`~klpenalty.linear.linear_kl` and
    :func:`~klpenalty.linear.linear_policy_loss` share: both heads (shapes, dtypes, devices),
    tokens, mask, temperature, the logit transforms, ignore_index, chunk_rows and the backend.
    Raises TypeError / ValueError naming the argument (``<role>_hidden`` etc., ``roles`` the
    caller's names of the two models)."""
    a, b = roles
    _check_head(a, policy_hidden, policy_weight, policy_bias, suffix)
    _check_head(b, ref_hidden, ref_weight, ref_bias, suffix)
    vocab = policy_weight.shape[0]
    if ref_weight.shape[0] != vocab:
        raise ValueError(
            f"{a}_weight{suffix} and {b}_weight{suffix} must have the same vocabulary "
            f"size V (dim 0): {a}_weight{suffix} {v.describe(policy_weight)}, "
            f"{b}_weight{suffix} {v.describe(ref_weight)}"
        )
    leading = policy_hidden.shape[:-1]
    if ref_hidden.shape[:-1] != leading:
        raise ValueError(
            f"{a}_hidden and {b}_hidden must have the same leading dims (...): "
            f"{a}_hidden {v.describe(policy_hidden)}, {b}_hidden {v.describe(ref_hidden)}"
        )
    named = {
        f"{a}_hidden": policy_hidden, f"{a}_weight{suffix}": policy_weight,
        f"{a}_bias{suffix}": policy_bias, f"{b}_hidden": ref_hidden,
        f"{b}_weight{suffix}": ref_weight, f"{b}_bias{suffix}": ref_bias,
    }
    _check_devices(named)
    mask, temperature, ignore_index, impl = _check_run(
        leading, policy_hidden.device, tokens=tokens, mask=mask, temperature=temperature,
        ignore_index=ignore_index, chunk_rows=chunk_rows, backend=backend,
    )
    scale_p, cap_p = _check_transform(logit_scale, softcap)
    scale_r = scale_p if ref_logit_scale is None else _check_positive(
        f"{b}_logit_scale", ref_logit_scale
    )
    cap_r = cap_p if ref_softcap is None else _check_positive(f"{b}_softcap", ref_softcap)
    return _Checked(vocab, leading, named, mask, temperature, (scale_p, cap_p, scale_r, cap_r),
                    ignore_index, impl)


# ------------------------------------------------------------------------------ rows
def _flat_rows(hidden: tuple[Tensor, ...], tokens: Optional[Tensor], mask: Optional[Tensor],
               vocab: int, ignore_index: int, check: bool):
    """((N, H) rows of each hidden state (...,  H), rows (M,) int64 counted rows or None =
    all, tokens (N,) int64 with :data:`~.chunks.IGNORE` at ignored and masked positions, or
    None). With ``check`` the counted tokens' range is checked (one host read)."""
    leading = hidden[0].shape[:-1]
    n = math.prod(leading)
    flat = tuple(h.reshape(n, h.shape[-1]) for h in hidden)
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
    return flat, rows, tok


def _check_nan(outs: list[Tensor], named: dict[str, Optional[Tensor]],
               any_process=None) -> None:
    """Raise ValueError when a counted position's outputs (N,) hold NaN, naming the cause:
    a weight or bias of ``named`` (name -> tensor or None) that holds NaN, else the hidden
    states' rows (the names holding "hidden"). ``any_process``: the chunk adapter's, where
    each process holds a slice of the weights (the outputs are the same on every process, so
    every one of them asks)."""
    nan = torch.stack([o.isnan() for o in outs]).any(0)  # (N,)
    if not bool(nan.any()):
        return
    weights = {name: t for name, t in named.items() if "hidden" not in name}
    has_nan = torch.tensor([t is not None and bool(t.isnan().any()) for t in weights.values()],
                           device=nan.device)  # (k,)
    mine = has_nan.tolist()
    if any_process is not None:
        has_nan = any_process(has_nan)
    for (name, t), anywhere, here in zip(weights.items(), has_nan.tolist(), mine):
        if anywhere:
            where = v.describe(t) if here else "in another process's slice"
            raise ValueError(f"{name} contains NaN ({where})")
    # the hidden rows with NaN, else "no distribution" (e.g. logits overflowing to ±inf)
    hidden = {name: t for name, t in named.items() if "hidden" in name}
    v.raise_if_nan(torch.where(nan, float("nan"), 0.0), hidden)


def _check_on_support(logprobs: Tensor, tok: Tensor, tokens: Tensor) -> None:
    """Raise ValueError for a counted token off the support: log π̃(t) = −inf in ``logprobs``
    (N,) where ``tok`` (N,) is not ignored; ``tokens`` (...) the caller's (one host read)."""
    outside = torch.isneginf(logprobs) & (tok != IGNORE)  # (N,)
    if bool(outside.any()):
        raise contract.outside_support_error(outside.reshape(tokens.shape), tokens)
