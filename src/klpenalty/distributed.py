"""The exact KL across ranks, on ``torch.distributed``: vocabulary-parallel and data-parallel.

Shape letters: B batch, T sequence, V vocabulary (the whole vocabulary), V_r the slice of it a
rank holds, N rows (product of the leading dims).

**Vocabulary-parallel** (tensor-parallel output layer, Megatron layout): every rank of
``group`` holds the *same positions* but only a contiguous slice of the vocabulary, (..., V_r)
with uneven V_r allowed, rank 0 the first slice, rank 1 the next, and so on.
:func:`vocab_parallel_full_kl` and :func:`vocab_parallel_token_logprobs` return on every rank the
exact full-vocabulary value, equal to :func:`klpenalty.full_kl` / :func:`klpenalty.token_logprobs`
on the gathered logits, by exchanging a few numbers per position (never the logits):

==================================== ============================================== ==========
function                             collectives per call (forward)                 bytes/pos.
==================================== ============================================== ==========
``vocab_parallel_full_kl``           all-reduce MAX of (N, 2), all-reduce SUM (N, 3) 20 (fp32)
``vocab_parallel_token_logprobs``    all-reduce MAX of (N,), all-reduce SUM (N, 2)   12 (fp32)
config check (``check=True``)        one all-gather of 23 int64 per rank             0
==================================== ============================================== ==========

Byte counts are the payload per position handed to each all-reduce (float64 inputs: twice
that); the backward of both is local and communicates nothing.

**Data-parallel**: every rank holds different sequences. :func:`global_masked_mean`,
:func:`global_sequence_mean` and :func:`update_controller_globally` normalise by the *global*
count, so every rank reports the same statistic and every rank's KL controller holds the same β
after every step.

Only the standard c10d collectives ``all_reduce`` (SUM, MAX) and ``all_gather`` are used, on
tensors that live on the device of the inputs, so the same code runs on gloo (CPU) and NCCL
(CUDA). All ranks of ``group`` must call these functions together, with the same ``check``; a
configuration error is raised on every rank, never as a hang.
"""

from __future__ import annotations

import math
import struct
from numbers import Integral
from typing import Any, NamedTuple, Sequence

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from . import _validation as v

__all__ = [
    "vocab_parallel_full_kl",
    "vocab_parallel_token_logprobs",
    "global_masked_mean",
    "global_sequence_mean",
    "update_controller_globally",
    "ControllerUpdate",
]

# Elements per row chunk of the local passes: 2**20 float32 = 4 MiB per temporary.
_CHUNK_ELEMENTS = 1 << 20


def _rows_per_chunk(width: int) -> int:
    return max(1, _CHUNK_ELEMENTS // max(1, width))


# ---------------------------------------------------------------------------------------------
# Process group
# ---------------------------------------------------------------------------------------------


def _group_info(group: Any, caller: str) -> tuple[int, int]:
    """(world size, rank) of ``group``; a clear error when torch.distributed is not set up."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"{caller}: torch.distributed is not initialized; call "
            "torch.distributed.init_process_group(...) first (or use the single-process "
            "klpenalty functions)"
        )
    return dist.get_world_size(group), dist.get_rank(group)


# ---------------------------------------------------------------------------------------------
# Configuration check: one all_gather of a fixed-length int64 record per rank
# ---------------------------------------------------------------------------------------------

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_MAX_DIMS = 8  # leading dims recorded one by one; more are folded into the last slot
# record layout
_ERR, _PDT, _RDT, _NDIM = 0, 1, 2, 3
_DIMS = slice(4, 4 + _MAX_DIMS)
_VS_GIVEN, _VS, _VR, _TEMP, _HAS_MASK, _MASK_N, _MASK_H, _TOK_S, _TOK_H, _TOK_MIN, _TOK_MAX = (
    range(4 + _MAX_DIMS, 15 + _MAX_DIMS)
)
_RECORD = 15 + _MAX_DIMS  # 23 int64 = 184 bytes per rank


def _dtype_code(t: object) -> int:
    if isinstance(t, torch.Tensor) and t.dtype in _DTYPES:
        return _DTYPES.index(t.dtype)
    return -1


def _float_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", x))[0]


def _bits_float(b: int) -> float:
    return struct.unpack("<d", struct.pack("<q", b))[0]


def _checksums(t: torch.Tensor) -> tuple[int, int]:
    """(Σ t, Σ (i+1)·t_i) over the flattened integer tensor: equal tensors give equal sums."""
    flat = t.reshape(-1).long()  # (N,)
    idx = torch.arange(1, flat.numel() + 1, device=flat.device, dtype=torch.long)
    return int(flat.sum()), int((flat * idx).sum())


def _local_record(
    error: bool,
    policy: object,
    ref: object,
    leading: Sequence[int],
    vocab_start: int | None,
    width: int,
    temperature: float,
    mask: torch.Tensor | None,
    tokens: torch.Tensor | None,
) -> list[int]:
    rec = [0] * _RECORD
    if error:
        rec[_ERR] = 1
        return rec
    rec[_PDT], rec[_RDT] = _dtype_code(policy), _dtype_code(ref)
    dims = list(leading)
    if len(dims) > _MAX_DIMS:
        dims = dims[: _MAX_DIMS - 1] + [math.prod(dims[_MAX_DIMS - 1 :])]
    rec[_NDIM] = len(leading)
    rec[_DIMS] = dims + [-1] * (_MAX_DIMS - len(dims))
    rec[_VS_GIVEN] = int(vocab_start is not None)
    rec[_VS] = vocab_start if vocab_start is not None else 0
    rec[_VR] = width
    rec[_TEMP] = _float_bits(temperature)
    if mask is not None:
        rec[_HAS_MASK] = 1
        rec[_MASK_N], rec[_MASK_H] = _checksums(mask)
    if tokens is not None and tokens.numel():
        rec[_TOK_S], rec[_TOK_H] = _checksums(tokens)
        rec[_TOK_MIN], rec[_TOK_MAX] = int(tokens.min()), int(tokens.max())
    return rec


def _gather_records(
    rec: list[int], device: torch.device, group: Any, world: int
) -> list[list[int]]:
    mine = torch.tensor(rec, dtype=torch.long, device=device)  # (_RECORD,)
    out = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(out, mine, group=group)
    return torch.stack(out).tolist()  # (world, _RECORD), identical on every rank


def _per_rank(values: Sequence[Any]) -> str:
    return ", ".join(f"rank {r}: {val}" for r, val in enumerate(values))


def _leading_of(rec: list[int]) -> tuple[int, ...]:
    n = rec[_NDIM]
    dims = rec[_DIMS][: min(n, _MAX_DIMS)]
    return tuple(dims)


def _check_records(recs: list[list[int]], caller: str, *, names: tuple[str, str]) -> None:
    """Compare the gathered records; raise the same ValueError on every rank on a mismatch.

    ``recs`` is identical on every rank, and the checks run in a fixed order, so the message is
    the same everywhere.
    """
    bad = [r for r, rec in enumerate(recs) if rec[_ERR]]
    if bad:
        raise ValueError(
            f"{caller}: rank(s) {bad} rejected their own arguments (their error says why); "
            "every rank stops here, before any collective on the logits"
        )
    for slot, name in ((_PDT, names[0]), (_RDT, names[1])):
        codes = [rec[slot] for rec in recs]
        if name and len(set(codes)) > 1:
            dts = [str(_DTYPES[c]) if c >= 0 else "?" for c in codes]
            raise ValueError(f"{caller}: {name} dtype differs across ranks ({_per_rank(dts)})")
    shapes = [(rec[_NDIM], tuple(rec[_DIMS])) for rec in recs]
    if len(set(shapes)) > 1:
        raise ValueError(
            f"{caller}: the leading dims (...) of the shards differ across ranks "
            f"({_per_rank([_leading_of(rec) for rec in recs])}); every rank must hold the "
            "same positions, only the vocabulary is split"
        )
    temps = [rec[_TEMP] for rec in recs]
    if len(set(temps)) > 1:
        raise ValueError(
            f"{caller}: temperature differs across ranks "
            f"({_per_rank([_bits_float(t) for t in temps])})"
        )
    masks = [(rec[_HAS_MASK], rec[_MASK_N], rec[_MASK_H]) for rec in recs]
    if len(set(masks)) > 1:
        desc = [f"{m[1]} True" if m[0] else "None" for m in masks]
        raise ValueError(
            f"{caller}: mask differs across ranks ({_per_rank(desc)}; compared by count and "
            "an index-weighted checksum); every rank must pass the same mask"
        )
    toks = [(rec[_TOK_S], rec[_TOK_H]) for rec in recs]
    if len(set(toks)) > 1:
        raise ValueError(
            f"{caller}: tokens differ across ranks (compared by sum and an index-weighted "
            "checksum); every rank must pass the same tokens"
        )
    given = [rec[_VS_GIVEN] for rec in recs]
    if len(set(given)) > 1:
        raise ValueError(
            f"{caller}: vocab_start is given on some ranks and None on others "
            f"({_per_rank(['given' if g else 'None' for g in given])})"
        )
    if given[0]:
        _check_tiling([(rec[_VS], rec[_VS] + rec[_VR]) for rec in recs], caller)


def _check_tiling(spans: list[tuple[int, int]], caller: str) -> None:
    """The slices [start, end) of ranks 0, 1, ... must be back to back from 0, in rank order."""
    expected = 0
    for r, (start, end) in enumerate(spans):
        if start == expected:
            expected = end
            continue
        listing = _per_rank([f"[{a}, {b})" for a, b in spans])
        ordered = sorted(spans)
        if ordered[0][0] == 0 and all(a[1] == b[0] for a, b in zip(ordered, ordered[1:])):
            kind = "they tile it, but not in rank order"
        elif start > expected:
            kind = f"a gap: rank {r} starts at {start} but the slices before it end at {expected}"
        else:
            kind = (
                f"an overlap: rank {r} starts at {start} but the slices before it end at "
                f"{expected}"
            )
        raise ValueError(
            f"{caller}: the vocabulary slices do not tile [0, V) in rank order ({kind}); "
            f"slices: {listing}. Rank r must hold the slice right after rank r-1's."
        )


def _config_check(
    caller: str,
    group: Any,
    world: int,
    device: torch.device,
    local_error: Exception | None,
    *,
    names: tuple[str, str],
    **fields: Any,
) -> list[list[int]]:
    rec = _local_record(local_error is not None, **fields)
    recs = _gather_records(rec, device, group, world)
    if local_error is not None:
        raise local_error
    _check_records(recs, caller, names=names)
    return recs


def _device_of(*candidates: object, caller: str) -> torch.device:
    for t in candidates:
        if isinstance(t, torch.Tensor):
            return t.device
    raise TypeError(
        f"{caller}: the logits must be torch.Tensors, got "
        f"{', '.join(type(t).__name__ for t in candidates)} (raised on this rank only)"
    )


def _check_vocab_start(vocab_start: object, *, required: bool) -> int | None:
    if vocab_start is None and not required:
        return None
    if isinstance(vocab_start, bool) or not isinstance(vocab_start, Integral):
        raise TypeError(f"vocab_start must be an int, got {type(vocab_start).__name__}")
    if vocab_start < 0:
        raise ValueError(f"vocab_start must be >= 0, got {vocab_start}")
    return int(vocab_start)


# ---------------------------------------------------------------------------------------------
# Local per-shard passes. They touch (rows_per_chunk, V_r) float temporaries at most; a
# streaming engine can replace them one for one (same inputs, same (N, k) outputs).
# ---------------------------------------------------------------------------------------------


def _local_max(x: torch.Tensor, temperature: float, dtype: torch.dtype) -> torch.Tensor:
    """max_v x/T per row, (N, V_r) -> (N,) ``dtype``.

    The max is exact in the input dtype, and x ↦ x/T rounds monotonically, so this equals the
    max of the upcast, tempered logits without materialising them. A row that is -inf on this
    shard gives -inf.
    """
    return x.amax(dim=-1).to(dtype) / temperature


def _safe_shift(m: torch.Tensor) -> torch.Tensor:
    """Global max used as the shift: -inf (no mass anywhere in the row) becomes 0."""
    return torch.where(torch.isneginf(m), torch.zeros_like(m), m)


def _local_kl_sums(
    x: torch.Tensor,
    y: torch.Tensor,
    shift_x: torch.Tensor,
    shift_y: torch.Tensor,
    temperature: float,
    dtype: torch.dtype,
) -> torch.Tensor:
    """(s_x, s_y, A) of one shard against the global shifts, (N, 3) ``dtype``.

    With u = x/T − M_x and w = y/T − M_y: s_x = Σ e^u, s_y = Σ e^w, A = Σ_{e^u > 0} e^u (u − w)
    (0·log 0 = 0; +inf where the policy has mass and the reference is -inf).
    """
    n, width = x.shape
    out = torch.empty(n, 3, dtype=dtype, device=x.device)
    rows = _rows_per_chunk(width)
    zero = torch.zeros((), dtype=dtype, device=x.device)
    for s in range(0, n, rows):
        e = min(n, s + rows)
        u = x[s:e].to(dtype) / temperature - shift_x[s:e].unsqueeze(-1)  # (rows, V_r)
        w = y[s:e].to(dtype) / temperature - shift_y[s:e].unsqueeze(-1)  # (rows, V_r)
        eu = u.exp()
        out[s:e, 0] = eu.sum(-1)
        out[s:e, 1] = w.exp().sum(-1)
        out[s:e, 2] = torch.where(eu > 0, eu * (u - w), zero).sum(-1)
    return out


def _local_kl_grads(
    x: torch.Tensor,
    y: torch.Tensor,
    lse_x: torch.Tensor,
    lse_y: torch.Tensor,
    kl: torch.Tensor,
    g: torch.Tensor,
    temperature: float,
    need_x: bool,
    need_y: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Gradients of one shard from the *global* LSEs and KL, with no communication.

    grad_x = p·((log p − log q) − KL)·g and grad_y = (q − p)·g, with g = grad_kl / T per row
    (N,), 0 on rows that must get no gradient. Returned in the inputs' dtypes, (N, V_r).
    """
    n, width = x.shape
    dtype = kl.dtype
    grad_x = torch.empty_like(x) if need_x else None
    grad_y = torch.empty_like(y) if need_y else None
    zero = torch.zeros((), dtype=dtype, device=x.device)
    rows = _rows_per_chunk(width)
    for s in range(0, n, rows):
        e = min(n, s + rows)
        gs = g[s:e].unsqueeze(-1)  # (rows, 1)
        logp = x[s:e].to(dtype) / temperature - lse_x[s:e].unsqueeze(-1)  # (rows, V_r)
        logq = y[s:e].to(dtype) / temperature - lse_y[s:e].unsqueeze(-1)  # (rows, V_r)
        p = logp.exp()
        if need_x:
            d = torch.where(p > 0, p * ((logp - logq) - kl[s:e].unsqueeze(-1)), zero)
            grad_x[s:e] = torch.where(gs != 0, d * gs, zero)
        if need_y:
            grad_y[s:e] = torch.where(gs != 0, (logq.exp() - p) * gs, zero)
    return grad_x, grad_y


def _local_token_sums(
    x: torch.Tensor,
    tokens: torch.Tensor,
    shift: torch.Tensor,
    vocab_start: int,
    temperature: float,
    dtype: torch.dtype,
) -> torch.Tensor:
    """(s, target) of one shard, (N, 2) ``dtype``: s = Σ e^(x/T − M), target = x[token]/T on the
    rank that owns the token and 0 elsewhere (so a SUM over ranks gives the target logit)."""
    n, width = x.shape
    out = torch.empty(n, 2, dtype=dtype, device=x.device)
    rows = _rows_per_chunk(width)
    for s in range(0, n, rows):
        e = min(n, s + rows)
        out[s:e, 0] = (x[s:e].to(dtype) / temperature - shift[s:e].unsqueeze(-1)).exp().sum(-1)
    local = tokens - vocab_start  # (N,)
    owned = (local >= 0) & (local < width)
    picked = x.gather(-1, local.clamp(0, width - 1).unsqueeze(-1)).squeeze(-1)  # (N,)
    zero = torch.zeros((), dtype=dtype, device=x.device)
    out[:, 1] = torch.where(owned, picked.to(dtype) / temperature, zero)
    return out


def _local_token_grads(
    x: torch.Tensor,
    tokens: torch.Tensor,
    lse: torch.Tensor,
    g: torch.Tensor,
    vocab_start: int,
    temperature: float,
) -> torch.Tensor:
    """(onehot(token) − p)·g on this shard, (N, V_r) in x's dtype; g = grad / T per row (N,)."""
    n, width = x.shape
    dtype = lse.dtype
    grad_x = torch.empty_like(x)
    local = tokens - vocab_start  # (N,)
    owned = (local >= 0) & (local < width)
    idx = local.clamp(0, width - 1)
    g_owned = torch.where(owned, g, torch.zeros((), dtype=dtype, device=g.device))
    rows = _rows_per_chunk(width)
    for s in range(0, n, rows):
        e = min(n, s + rows)
        p = (x[s:e].to(dtype) / temperature - lse[s:e].unsqueeze(-1)).exp()  # (rows, V_r)
        grad = -p * g[s:e].unsqueeze(-1)
        grad.scatter_add_(-1, idx[s:e].unsqueeze(-1), g_owned[s:e].unsqueeze(-1))
        grad_x[s:e] = grad
    return grad_x


def _check_token_ids(tokens: object, leading: Sequence[int]) -> None:
    if not isinstance(tokens, torch.Tensor):
        raise TypeError(f"tokens must be a torch.Tensor, got {type(tokens).__name__}")
    if tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
        raise TypeError(f"tokens must be an integer tensor, got {v.describe(tokens)}")
    v.check_per_token("tokens", tokens, leading, floating=False)


def _all_reduce(t: torch.Tensor, op: Any, group: Any) -> None:
    if t.numel():  # every rank has the same N (checked), so every rank skips together
        dist.all_reduce(t, op=op, group=group)


# ---------------------------------------------------------------------------------------------
# Autograd Functions
# ---------------------------------------------------------------------------------------------


def _raise_if_nan_kl(
    kl: torch.Tensor, s_x: torch.Tensor, s_y: torch.Tensor, caller: str
) -> None:
    """NaN in the (global) KL → a ValueError saying why; the same on every rank.

    ``kl``, ``s_x``, ``s_y`` are all-reduced, hence identical on every rank, so the decision and
    the message are too, with no extra communication.
    """
    bad = torch.isnan(kl)
    if not bool(bad.any()):
        return
    rows = bad.nonzero().flatten()
    first = int(rows[0])
    if bool(torch.isnan(s_x[rows]).any()):
        what = "policy_logits hold NaN or +inf"
    elif bool((s_x[rows] == 0).any()):
        what = "policy_logits are -inf over the whole vocabulary (the policy is undefined)"
    elif bool(torch.isnan(s_y[rows]).any()):
        what = "ref_logits hold NaN or +inf"
    elif bool((s_y[rows] == 0).any()):
        what = "ref_logits are -inf over the whole vocabulary (the reference is undefined)"
    else:
        what = "the result is NaN"
    raise ValueError(
        f"{caller}: {what} in {rows.numel()} counted position(s) on some rank, "
        f"first flat row index {first}"
    )


class _VocabParallelFullKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, y, mask, temperature: float, group, caller: str):  # x, y: (N, V_r)
        dtype = v.compute_dtype(x, y)
        maxes = torch.stack(
            [_local_max(x, temperature, dtype), _local_max(y, temperature, dtype)], dim=-1
        )  # (N, 2)
        _all_reduce(maxes, dist.ReduceOp.MAX, group)
        shift = _safe_shift(maxes)  # (N, 2)
        sums = _local_kl_sums(x, y, shift[:, 0], shift[:, 1], temperature, dtype)  # (N, 3)
        _all_reduce(sums, dist.ReduceOp.SUM, group)
        s_x, s_y, a = sums.unbind(-1)
        # KL = E_p[x − y]/T − LSE_x + LSE_y; the shifts cancel: KL = A/s_x − log s_x + log s_y
        kl = (a / s_x - torch.log(s_x) + torch.log(s_y)).clamp_min(0.0)
        zero = torch.zeros((), dtype=dtype, device=kl.device)
        # the policy has no mass anywhere (all -inf): no distribution, reported as NaN and
        # raised below unless masked, as full_kl does
        kl = torch.where(s_x == 0, torch.full_like(kl, float("nan")), kl)
        if mask is not None:
            kl = torch.where(mask, kl, zero)
        _raise_if_nan_kl(kl, s_x, s_y, caller)
        lse_x = shift[:, 0] + torch.log(s_x)
        lse_y = shift[:, 1] + torch.log(s_y)
        live = torch.ones_like(kl, dtype=torch.bool) if mask is None else mask
        ctx.save_for_backward(x, y, lse_x, lse_y, kl, live)
        ctx.temperature = temperature
        return kl

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_kl):  # grad_kl: (N,)
        x, y, lse_x, lse_y, kl, live = ctx.saved_tensors
        need_x, need_y = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        t = ctx.temperature
        zero = torch.zeros((), dtype=kl.dtype, device=kl.device)
        g = torch.where(live, grad_kl.to(kl.dtype) / t, zero)
        grad_x, grad_y = _local_kl_grads(x, y, lse_x, lse_y, kl, g, t, need_x, need_y)
        return grad_x, grad_y, None, None, None, None


class _VocabParallelTokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tokens, vocab_start: int, temperature: float, group, caller: str):
        dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        m = _local_max(x, temperature, dtype)  # (N,)
        _all_reduce(m, dist.ReduceOp.MAX, group)
        shift = _safe_shift(m)
        sums = _local_token_sums(x, tokens, shift, vocab_start, temperature, dtype)  # (N, 2)
        _all_reduce(sums, dist.ReduceOp.SUM, group)
        s, target = sums.unbind(-1)
        lse = shift + torch.log(s)
        out = target - lse
        bad = torch.isnan(out)
        if bool(bad.any()):
            rows = bad.nonzero().flatten()
            if bool(torch.isnan(s[rows]).any()):
                what = "logits hold NaN or +inf"
            elif bool((s[rows] == 0).any()):
                what = "logits are -inf over the whole vocabulary"
            else:
                what = "the result is NaN"
            raise ValueError(
                f"{caller}: {what} in {rows.numel()} position(s) on some rank, "
                f"first flat row index {int(rows[0])}"
            )
        ctx.save_for_backward(x, tokens, lse)
        ctx.vocab_start = vocab_start
        ctx.temperature = temperature
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):  # grad_out: (N,)
        x, tokens, lse = ctx.saved_tensors
        g = grad_out.to(lse.dtype) / ctx.temperature
        grad_x = _local_token_grads(x, tokens, lse, g, ctx.vocab_start, ctx.temperature)
        return grad_x, None, None, None, None, None


# ---------------------------------------------------------------------------------------------
# Public vocabulary-parallel functions
# ---------------------------------------------------------------------------------------------

_CHECK_DOC = """
    Configuration check (``check=True``, the default): before touching the logits every rank
    all-gathers one record of 23 int64 (184 bytes per rank) holding: whether its own arguments
    passed the local checks, both dtypes, the leading shape, ``vocab_start`` and V_r, the
    temperature, and checksums (count and index-weighted sum) of the mask or tokens. Every rank
    then runs the same comparisons on the same table, so a rank whose leading dims, dtype,
    temperature, mask or tokens differ, or slices that do not tile [0, V) in rank order
    (gap, overlap or wrong order, when ``vocab_start`` is given), raise the *same* ValueError on
    every rank; a rank whose own arguments are invalid raises its error and the others a
    ValueError naming it. Cost: one small all-gather, one device-to-host copy of the table
    (a synchronisation point on GPU) and O(N) local work for the checksums. ``check=False``
    skips all of it; a mismatch then shows up as a wrong result, a crash or a hang in a
    collective. ``check`` must be the same on every rank. Arguments that are not tensors at all
    raise TypeError at once on the rank that passed them.
"""


def vocab_parallel_full_kl(
    policy_logits_shard: torch.Tensor,
    ref_logits_shard: torch.Tensor,
    *,
    group: Any = None,
    temperature: float = 1.0,
    mask: torch.Tensor | None = None,
    vocab_start: int | None = None,
    check: bool = True,
) -> torch.Tensor:
    """Exact full-vocabulary KL(π‖ρ) per position when each rank holds a slice of the vocabulary.

    Every rank of ``group`` holds the same positions and a contiguous vocabulary slice (uneven
    widths V_r allowed) of both models' logits; rank 0 holds the first slice. Every rank gets
    the same result, equal to :func:`klpenalty.full_kl` on the logits gathered along the last
    dim in rank order. The local passes run in row chunks (no (N, V_r) float32 temporary).

    Communication per call: an all-reduce MAX of the per-row maxima (N, 2), then an all-reduce
    SUM of (s_x, s_y, A) against the global maxima (N, 3): 20 bytes per position for float32
    math (40 for float64 inputs), never the logits. The backward is local: each rank gets the
    gradient of its own shard, π·((log π − log ρ) − KL)/T, from the global log-sum-exps and KL
    saved in the forward, with no communication.

    Numerics as :func:`klpenalty.full_kl`: float32 math for float16/bfloat16/float32 inputs
    (float64 for float64); 0·log 0 = 0 (a shard may be -inf over a whole row); KL = +inf where
    the policy has mass the reference lacks; clamped at 0; exactly 0 for identical logits.
    Non-finite results are diagnosed from the all-reduced sums, so the same ValueError is raised
    on every rank.

    {check}
    Args:
        policy_logits_shard: (..., V_r) float16/bfloat16/float32/float64, this rank's slice of
            the policy logits. Gradients flow.
        ref_logits_shard: (..., V_r) same shape, any float dtype; gets a gradient (ρ − π)/T only
            if it requires grad.
        group: the process group the vocabulary is split over (e.g. the tensor-parallel group);
            None = the default group.
        temperature: > 0, divides both models' logits before the softmax.
        mask: optional (...) bool, True = counts, the same on every rank. Masked positions return
            0 and get zero gradient; their logits may hold anything.
        vocab_start: optional int, where this rank's slice starts in the vocabulary. Only used
            by the configuration check (the KL does not depend on the vocabulary order).
        check: run the configuration check described above.

    Returns:
        (...) float32 (float64 if either input is float64), identical on every rank,
        differentiable; gradients come back in the inputs' dtypes.

    Raises:
        RuntimeError: torch.distributed is not initialized.
        TypeError / ValueError: invalid arguments on some rank, ranks that disagree, NaN in a
            counted position (all on every rank, see above).
    """
    caller = "vocab_parallel_full_kl"
    world, _ = _group_info(group, caller)
    device = _device_of(policy_logits_shard, ref_logits_shard, caller=caller)
    local_error: Exception | None = None
    leading: tuple[int, ...] = ()
    width = 0
    try:
        v.check_logits_pair(policy_logits_shard, ref_logits_shard)
        temperature = v.check_temperature(temperature)
        leading = tuple(policy_logits_shard.shape[:-1])
        width = policy_logits_shard.shape[-1]
        if mask is not None:
            mask = v.check_mask(mask, leading, device)
        vocab_start = _check_vocab_start(vocab_start, required=False)
    except (TypeError, ValueError) as err:
        local_error = err
    if check:
        _config_check(
            caller, group, world, device, local_error,
            names=("policy_logits_shard", "ref_logits_shard"),
            policy=policy_logits_shard, ref=ref_logits_shard, leading=leading,
            vocab_start=vocab_start, width=width, temperature=temperature, mask=mask,
            tokens=None,
        )  # fmt: skip
    elif local_error is not None:
        raise local_error
    x = policy_logits_shard.reshape(-1, width)  # (N, V_r)
    y = ref_logits_shard.reshape(-1, width)  # (N, V_r)
    flat_mask = mask.reshape(-1) if mask is not None else None  # (N,)
    kl = _VocabParallelFullKL.apply(x, y, flat_mask, temperature, group, caller)  # (N,)
    return kl.reshape(leading)


def vocab_parallel_token_logprobs(
    logits_shard: torch.Tensor,
    tokens: torch.Tensor,
    *,
    vocab_start: int,
    group: Any = None,
    temperature: float = 1.0,
    check: bool = True,
) -> torch.Tensor:
    """log π(token) per position when each rank holds a slice of the vocabulary.

    Equal to :func:`klpenalty.token_logprobs` on the gathered logits, on every rank.
    Communication per call: an all-reduce MAX of the per-row maxima (N,), then one all-reduce
    SUM of (Σ exp, target logit) (N, 2), where only the rank that owns the token contributes
    its logit: 12 bytes per position for float32 math (24 for float64). The backward is local:
    (onehot(token) − π)/T on this rank's slice.

    {check}
    With ``check=True`` the tokens are also checked against the total vocabulary Σ V_r.

    Args:
        logits_shard: (..., V_r) float16/bfloat16/float32/float64, this rank's slice.
        tokens: (...) integer ids in the *whole* vocabulary [0, V), the same on every rank.
        vocab_start: int, where this rank's slice starts: it holds ids
            [vocab_start, vocab_start + V_r). The slices must tile [0, V) in rank order.
        group: the process group the vocabulary is split over; None = the default group.
        temperature: > 0; use the temperature the tokens were sampled with.
        check: run the configuration check described above.

    Returns:
        (...) float32 (float64 for float64 logits), ≤ 0, identical on every rank,
        differentiable with respect to ``logits_shard``.
    """
    caller = "vocab_parallel_token_logprobs"
    world, _ = _group_info(group, caller)
    device = _device_of(logits_shard, caller=caller)
    local_error: Exception | None = None
    leading: tuple[int, ...] = ()
    width = 0
    try:
        v.check_logits("logits_shard", logits_shard)
        leading = tuple(logits_shard.shape[:-1])
        width = logits_shard.shape[-1]
        # ids are checked against the whole vocabulary after the gather; here dtype and shape
        _check_token_ids(tokens, leading)
        if tokens.device != device:
            raise ValueError(f"tokens must be on {device}, got {tokens.device}")
        temperature = v.check_temperature(temperature)
        vocab_start = _check_vocab_start(vocab_start, required=True)
    except (TypeError, ValueError) as err:
        local_error = err
    if check:
        recs = _config_check(
            caller, group, world, device, local_error,
            names=("logits_shard", ""),
            policy=logits_shard, ref=None, leading=leading, vocab_start=vocab_start,
            width=width, temperature=temperature, mask=None, tokens=tokens,
        )  # fmt: skip
        vocab = sum(rec[_VR] for rec in recs)
        lo, hi = recs[0][_TOK_MIN], recs[0][_TOK_MAX]
        if tokens.numel() and (lo < 0 or hi >= vocab):
            raise ValueError(
                f"{caller}: tokens must lie in [0, {vocab}) (the whole vocabulary, Σ V_r), "
                f"got values in [{lo}, {hi}] ({v.describe(tokens)})"
            )
    elif local_error is not None:
        raise local_error
    x = logits_shard.reshape(-1, width)  # (N, V_r)
    tok = tokens.reshape(-1).long()  # (N,)
    out = _VocabParallelTokenLogprobs.apply(x, tok, vocab_start, temperature, group, caller)
    return out.reshape(leading)


_CHECK_TEXT = _CHECK_DOC.strip() + "\n"  # first line takes the placeholder's indentation
vocab_parallel_full_kl.__doc__ = vocab_parallel_full_kl.__doc__.replace("{check}", _CHECK_TEXT)
vocab_parallel_token_logprobs.__doc__ = vocab_parallel_token_logprobs.__doc__.replace(
    "{check}", _CHECK_TEXT
)


# ---------------------------------------------------------------------------------------------
# Data-parallel statistics
# ---------------------------------------------------------------------------------------------


def _global_mean(
    values: torch.Tensor,
    valid: torch.Tensor | None,
    local_error: Exception | None,
    group: Any,
    caller: str,
) -> torch.Tensor:
    """Σ_ranks Σ valid·values / Σ_ranks Σ valid, 0-dim; one all-reduce SUM of 3 float64."""
    device = values.device
    acc = torch.float64
    if local_error is None:
        vals = values.to(acc).reshape(-1)  # (K,)
        if valid is not None:
            flat = valid.reshape(-1)  # (K,)
            # NaN/inf in positions that do not count must not leak into the sum
            vals = torch.where(flat, vals, torch.zeros((), dtype=acc, device=device))
            count = flat.sum().to(acc)
        else:
            count = torch.tensor(float(vals.numel()), dtype=acc, device=device)
        local_sum = vals.sum()
        flag = torch.zeros((), dtype=acc, device=device)
    else:
        local_sum = torch.zeros((), dtype=acc, device=device)
        count = torch.zeros((), dtype=acc, device=device)
        flag = torch.ones((), dtype=acc, device=device)
    buf = torch.stack([local_sum.detach(), count, flag])  # (3,)
    dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group)
    total_count, errors = buf[1].item(), buf[2].item()
    if local_error is not None:
        raise local_error
    if errors:
        raise ValueError(
            f"{caller}: {int(errors)} rank(s) rejected their own arguments (their error says why)"
        )
    if total_count == 0:
        raise ValueError(f"{caller}: no position counts on any rank (the global count is 0)")
    # value: the global mean, bitwise the same on every rank; gradient: ∂mean/∂(local values)
    # = valid / global count (the other ranks' sums are constants here)
    mean = buf[0] / buf[1] + (local_sum - local_sum.detach()) / buf[1]
    out_dtype = torch.promote_types(values.dtype, torch.float32)
    return mean.to(out_dtype)


def global_masked_mean(
    values: torch.Tensor, mask: torch.Tensor | None = None, *, group: Any = None
) -> torch.Tensor:
    """Mean of ``values`` over the counted positions of *all* ranks (data parallelism).

    Σ_ranks Σ mask·values / Σ_ranks Σ mask: normalised by the global count of counted
    positions, so ranks with more padding do not weigh more, and the value is the same on
    every rank. Communication: one all-reduce SUM of 3 float64 (sum, count, error flag).

    The result is differentiable; the gradient with respect to this rank's ``values`` is
    mask / (global count), the exact partial derivative of the global mean. DDP *averages*
    gradients over its W ranks, so to get the gradient of the global mean under DDP
    differentiate ``W · global_masked_mean(...)``.

    Args:
        values: (...) float tensor, e.g. the per-token KL (B, T).
        mask: optional (...) bool, True = counts; None = everything counts.
        group: the data-parallel process group; None = the default group.

    Returns:
        0-dim tensor, the dtype of ``values`` promoted with float32 (the sums are float64).

    Raises:
        ValueError: no position counts on any rank; invalid arguments on some rank (raised on
            every rank: the rank at fault its own error, the others a ValueError).
    """
    caller = "global_masked_mean"
    _group_info(group, caller)
    if not isinstance(values, torch.Tensor):
        raise TypeError(f"values must be a torch.Tensor, got {type(values).__name__}")
    local_error: Exception | None = None
    try:
        v.check_float("values", values)
        if mask is not None:
            mask = v.check_mask(mask, values.shape, values.device)
    except (TypeError, ValueError) as err:
        local_error = err
    return _global_mean(values, mask, local_error, group, caller)


def global_sequence_mean(
    values: torch.Tensor, mask: torch.Tensor | None = None, *, group: Any = None
) -> torch.Tensor:
    """Mean over the sequences of *all* ranks of each sequence's sum over its counted positions.

    For per-token KL (B, T) this is the KL per sequence, the unit the adaptive controller's
    target is usually stated in. Sequences with no counted position do not count. The value is
    the same on every rank; one all-reduce SUM of 3 float64.

    Args:
        values: (..., T) float tensor.
        mask: optional (..., T) bool, True = counts.
        group: the data-parallel process group; None = the default group.

    Returns:
        0-dim tensor, the dtype of ``values`` promoted with float32, differentiable as in
        :func:`global_masked_mean`.
    """
    caller = "global_sequence_mean"
    _group_info(group, caller)
    if not isinstance(values, torch.Tensor):
        raise TypeError(f"values must be a torch.Tensor, got {type(values).__name__}")
    local_error: Exception | None = None
    seq = values
    valid = None
    try:
        v.check_float("values", values)
        if values.dim() < 1:
            raise ValueError(f"values must have shape (..., T), got {v.describe(values)}")
        if mask is not None:
            mask = v.check_mask(mask, values.shape, values.device)
            zero = torch.zeros((), dtype=values.dtype, device=values.device)
            seq = torch.where(mask, values, zero).sum(-1)  # (...)
            valid = mask.any(-1)  # (...)
        else:
            seq = values.sum(-1)  # (...)
    except (TypeError, ValueError) as err:
        local_error = err
    return _global_mean(seq, valid, local_error, group, caller)


class ControllerUpdate(NamedTuple):
    """What :func:`update_controller_globally` did, identical on every rank."""

    beta: float
    """The controller's new ``value``."""
    kl: float
    """The global KL the update used: Σ_ranks local_kl_sum / Σ_ranks local_count."""
    n_steps: int
    """Σ_ranks local_n_steps, passed to ``controller.update``."""


def _real(name: str, value: object) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise TypeError(
                f"{name} must be a number or a one-element tensor, got {v.describe(value)}"
            )
        value = value.detach().item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    return float(value)


def update_controller_globally(
    controller: Any,
    local_kl_sum: float | torch.Tensor,
    local_count: float | torch.Tensor,
    local_n_steps: int,
    *,
    group: Any = None,
    device: torch.device | str | None = None,
) -> ControllerUpdate:
    """Update a KL controller from the global KL so that every rank holds the same β.

    Every rank passes the sum of its KL values and how many there are (tokens or sequences,
    your unit), and how many samples it contributed. One all-gather of 5 float64 per rank
    (error flag, kl_sum, count, n_steps, β), summed in rank order, so every rank computes the
    same global KL = Σ kl_sum / Σ count and n_steps = Σ local_n_steps, bit for bit, and calls
    ``controller.update(kl, n_steps)`` with them. It also checks that every rank's controller
    held the same β before the update (a rank that loaded another checkpoint raises on all).

    Example on each rank, with per-token KL ``kl`` (B, T) and ``mask`` (B, T)::

        seq_kl = (kl * mask).sum(-1)                        # (B,) KL per sequence
        update_controller_globally(ctl, seq_kl.sum(), seq_kl.numel(), seq_kl.numel())

    Args:
        controller: an object with ``.value`` and ``.update(current_kl, n_steps)``, e.g.
            :class:`klpenalty.AdaptiveKLController` or :class:`klpenalty.FixedKLController`.
        local_kl_sum: this rank's sum of KL values, a number or one-element tensor.
        local_count: this rank's number of KL values (≥ 0; may be 0 on some ranks).
        local_n_steps: int ≥ 0, this rank's number of samples (e.g. its local batch size).
        group: the data-parallel process group; None = the default group.
        device: where the gathered buffer lives: the device your backend communicates on
            (CUDA for NCCL). Default: the device of ``local_kl_sum`` if it is a tensor, else
            of ``local_count`` if it is, else CPU.

    Returns:
        :class:`ControllerUpdate` (beta, kl, n_steps), identical on every rank.

    Raises:
        ValueError: the global count is 0, the controllers' β differ across ranks, invalid
            arguments on some rank, or the controller rejects the update (all on every rank).
    """
    caller = "update_controller_globally"
    world, _ = _group_info(group, caller)
    if device is None:
        tensors = [t for t in (local_kl_sum, local_count) if isinstance(t, torch.Tensor)]
        device = tensors[0].device if tensors else torch.device("cpu")
    local_error: Exception | None = None
    row = [0.0] * 5
    try:
        kl_sum = _real("local_kl_sum", local_kl_sum)
        count = _real("local_count", local_count)
        if not math.isfinite(count) or count < 0:
            raise ValueError(f"local_count must be finite and >= 0, got {count}")
        if isinstance(local_n_steps, bool) or not isinstance(local_n_steps, Integral):
            raise TypeError(f"local_n_steps must be an int, got {type(local_n_steps).__name__}")
        if local_n_steps < 0:
            raise ValueError(f"local_n_steps must be >= 0, got {local_n_steps}")
        if not callable(getattr(controller, "update", None)) or not hasattr(controller, "value"):
            raise TypeError(
                "controller must have .value and .update(current_kl, n_steps), got "
                f"{type(controller).__name__}"
            )
        row = [0.0, kl_sum, count, float(local_n_steps), float(controller.value)]
    except (TypeError, ValueError) as err:
        local_error = err
        row = [1.0, 0.0, 0.0, 0.0, 0.0]
    mine = torch.tensor(row, dtype=torch.float64, device=device)  # (5,)
    out = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(out, mine, group=group)
    table = torch.stack(out).tolist()  # (world, 5), identical on every rank
    if local_error is not None:
        raise local_error
    bad = [r for r, t in enumerate(table) if t[0]]
    if bad:
        raise ValueError(
            f"{caller}: rank(s) {bad} rejected their own arguments (their error says why)"
        )
    betas = [t[4] for t in table]
    if len(set(betas)) > 1:
        raise ValueError(
            f"{caller}: the controllers' beta differ across ranks before the update "
            f"({_per_rank(betas)}); load the same state_dict on every rank"
        )
    total_kl = 0.0
    total_count = 0.0
    total_n = 0.0
    for t in table:  # rank order: the same float sums on every rank
        total_kl += t[1]
        total_count += t[2]
        total_n += t[3]
    if total_count == 0:
        raise ValueError(f"{caller}: the global count is 0 (no KL value on any rank)")
    kl = total_kl / total_count
    n_steps = int(total_n)
    controller.update(kl, n_steps)
    return ControllerUpdate(float(controller.value), kl, n_steps)
