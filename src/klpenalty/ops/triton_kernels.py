"""Triton backend (CUDA tensors; CPU tensors under ``TRITON_INTERPRET=1``): the engine's per-row
state in fused GPU kernels.

The kernels live in :mod:`._triton_jit`, imported at the first call (Triton is an optional
dependency: ``pip install 'klpenalty[triton]'``; this module imports without it).

The four ops of :mod:`.contract`, ``klpenalty::triton_token_stats``, ``_backward``,
``_state`` and ``_sampling_threshold``: the first three compute every per-token statistic —
KL(π̃‖ρ), log π̃(token), log ρ(token), H(π̃) — in one read of the logits.

**Forward.** One kernel (:func:`._triton_jit.stats_kernel`) specialised by ``tl.constexpr``
flags (the policy's state, the reference's, the KL moment a, the entropy moment b, a support
by keep mask and/or threshold tau, the wanted log-probs, a mask). Program (row, split) walks its
columns in ``BLOCK`` chunks, reads each logit once in its own dtype (bf16/fp16/fp32), keeps the
engine's state in float32 — maxima in logit units, s_x = Σ e^u over the support, s_y = Σ e^w,
a = Σ e^u·(u − w), b = Σ e^u·u — and rescales it when a block raises a max (the engine's
merge). A program that is a whole row finishes it: the engine's finalize, the token's logits
gathered for log π̃(t) and log ρ(t), masked rows zeroed, written straight into out (N, 4) and
stats (N, 10). Split rows write partial states to an (N, splits, 6) float32 buffer that
:func:`._triton_jit.merge_kernel` merges and finishes, one program per row. The host dispatches
views and the outputs' allocations only, and reads nothing back (``check=True``: one read).
The split plan (:func:`plan_splits`) fills the GPU's waves; ``tile_cols`` forces the split.
Float64 inputs run the streaming op (the kernels compute in float32).

**The sampler's threshold.** Where top_k / top_p / min_p cut, the forward first launches
:func:`._triton_jit.threshold_kernel` (one program per row: radix selects over order-preserving
keys of the logits, float64 masses; docs/internals.md), which writes max(tau, τ_s) into an (N,)
buffer that the statistics kernels read as their tau and write into the stats column
``ST_TAU``; the threshold op runs the same kernel alone.

**Backward.** One kernel (:func:`._triton_jit.grad_kernel`) over a (rows, vocabulary blocks)
grid recomputes π̃ (and ρ) from the stats and writes ∂/∂x and ∂/∂y of all wanted outputs
together, once, in the inputs' dtypes; the upstream gradient is read through its strides and
masked in the kernel (unwanted columns, masked rows, ignored tokens; 0·log 0 guards), so rows
with −inf entries get finite gradients and masked rows exactly 0.

**Layouts.** Rows r of a (..., T, V) input are read at (r // T)·stride_b + (r % T)·stride_t
(:func:`_strides`): in place where the dimensions before −2 collapse to one stride and the last
dimension is contiguous (``logits[:, :-1]``, transposes of (B, T)); other layouts are copied
once. **Device.** Every launch goes through :func:`_launch`, which makes the tensors' CUDA
device current (Triton launches on the current device).

The careful-arithmetic flag (stats column 5) marks the rows without a distribution or with
E_π̃[u − w] = +inf only: the backward kernel always uses the guarded arithmetic.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import struct
import warnings
from typing import NamedTuple

import torch
from torch import Tensor

from .. import _validation as v
from . import contract, streaming
from .contract import Want

__all__ = [
    "available",
    "interpreted",
    "check_device",
    "split_columns",
    "plan_splits",
    "forward_constexprs",
    "backward_constexprs",
    "column_constexprs",
    "MAX_BLOCK",
    "INSTALL_HINT",
]

# Columns per forward/backward block: 4096 bf16 = 8 KiB per row and model per step.
MAX_BLOCK = 4096
# Programs per SM that run at once (the forward's occupancy): one wave is PROGRAMS_PER_SM·SMs.
PROGRAMS_PER_SM = 4
# The split heuristic (plan_splits): the finest split of a row (columns), the waves of rows from
# which a row is never split, and, in units of one SPLIT_UNIT block per program, the fixed cost
# of a program (its prologue, epilogue and the first loads' latency) and of the merge kernel.
SPLIT_UNIT = 1024
FULL_WAVES = 8
PROGRAM_OVERHEAD = 2
MERGE_COST = 8
# Backward tiles (of up to 1024 columns) per program: the row's scalars are loaded once for all.
GRAD_TILES = 4

INSTALL_HINT = "install Triton (`pip install 'klpenalty[triton]'`)"

_jit = None  # the kernels module, once imported
_error: str | None = None  # None = not tried, "" = imported, else why not
_warned = False


def _kernels():
    """The kernels module (imports Triton); raises ImportError where Triton is missing."""
    global _jit
    if _jit is None:
        from . import _triton_jit

        _jit = _triton_jit
    return _jit


@contract.constant_result
def available() -> bool:
    """Whether Triton imports (tried once per process)."""
    global _error
    if _error is None:
        try:
            _kernels()
            _error = ""
        except Exception as exc:  # any failure to import means the portable path
            _error = f"{type(exc).__name__}: {exc}"[:300]
    return not _error


def note_fallback() -> None:
    """One warning per process: CUDA tensors run the streaming backend because Triton is missing."""
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(
            f"klpenalty: Triton is unavailable ({_error}); CUDA tensors use the portable "
            f"'streaming' backend. For the fused GPU kernels, {INSTALL_HINT}",
            RuntimeWarning,
            stacklevel=3,
        )


def interpreted() -> bool:
    """Whether the kernels run in Triton's interpreter (``TRITON_INTERPRET=1`` when they were
    first imported in this process; then they run on CPU tensors)."""
    if _jit is None:
        return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
    return bool(_jit.INTERPRETED)


def check_device(device: torch.device) -> None:
    """Raise ValueError unless the Triton kernels can run on ``device`` in this process."""
    if not available():
        raise ValueError(f"backend 'triton' needs Triton, which is unavailable ({_error}); {INSTALL_HINT}")
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


# ------------------------------------------------------------------------------ launch helpers
def _on_device(device: torch.device):
    """The context of a launch: the tensors' CUDA device made current (Triton launches on the
    current device, whatever the tensors' device), nothing elsewhere."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _launch(kernel, grid: tuple[int, ...], device: torch.device, *args, **kwargs) -> None:
    """``kernel[grid](*args, **kwargs)`` on ``device`` (every launch of the backend)."""
    with _on_device(device):
        kernel[grid](*args, **kwargs)


class _Rows(NamedTuple):
    """The (..., V) inputs of a call as rows r = b·T + t read in place: x, y, keep (uint8; y
    and keep None where not read) and (T, stride_b, stride_t) for each of the three."""

    x: Tensor
    y: Tensor | None
    keep: Tensor | None
    args: tuple[int, ...]  # T, x's (stride_b, stride_t), y's, keep's


def _strides(t: Tensor, rows_t: int) -> tuple[Tensor, int, int]:
    """(t, stride_b, stride_t): row r of t's (..., V) starts at element (r // T)·stride_b +
    (r % T)·stride_t, T = ``rows_t`` (t's dimension −2). ``t`` itself when its last dimension
    is contiguous and the dimensions before −2 collapse to one stride (``logits[:, :-1]``,
    transposes of (B, T)); else a contiguous copy."""
    if t.dim() == 1:
        return t, 0, 0
    shape, stride = t.shape, t.stride()
    if shape[-1] <= 1 or stride[-1] == 1:
        outer = [(size, step) for size, step in zip(shape[:-2], stride[:-2]) if size != 1]
        if all(s0 == s1 * n1 for (_, s0), (n1, s1) in zip(outer, outer[1:])):
            return t, (outer[-1][1] if outer else 0), stride[-2]
    t = t.contiguous()
    return t, rows_t * shape[-1], shape[-1]


def _rows(x: Tensor, y: Tensor | None, keep: Tensor | None) -> _Rows:
    """The rows of x, y and keep for the kernels' row addressing (y and keep viewed with x's
    leading shape, which they share: the same N rows)."""
    rows_t = x.shape[-2] if x.dim() >= 2 else 1
    like = lambda t: t if t.shape[:-1] == x.shape[:-1] else t.reshape(*x.shape[:-1], -1)  # noqa: E731
    xs, *sx = _strides(x, rows_t)
    ys, *sy = _strides(like(y), rows_t) if y is not None else (None, 0, 0)
    ks, *sk = _strides(like(keep).view(torch.uint8), rows_t) if keep is not None else (None, 0, 0)
    return _Rows(xs, ys, ks, (max(rows_t, 1), *sx, *sy, *sk))


def _flat(t: Tensor | None, dtype: torch.dtype | None = None) -> Tensor | None:
    """A per-row (...) tensor as contiguous (N,) (a view where it is one), viewed as
    ``dtype``."""
    if t is None:
        return None
    t = t.reshape(-1).contiguous()
    return t if dtype is None else t.view(dtype)


def _block(vocab: int, cap: int = MAX_BLOCK) -> int:
    return max(16, min(cap, 1 << max(0, vocab - 1).bit_length()))


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


def _filled(programs: int, wave: int) -> bool:
    """Whether ``programs`` fill their waves: the last one at least 90 % full, or ≥
    :data:`FULL_WAVES` waves (a partial last one then costs at most 1/9 of the time)."""
    waves = programs / wave
    return waves >= FULL_WAVES or waves / math.ceil(waves) >= 0.9


@functools.lru_cache(maxsize=4096)
def plan_splits(n_rows: int, vocab: int, sms: int) -> tuple[int, int]:
    """(BLOCK, columns per program) of the forward for an (n_rows, vocab) problem on a GPU with
    ``sms`` multiprocessors, whose wave is :data:`PROGRAMS_PER_SM`·sms programs.

    A row is split into programs of k·:data:`SPLIT_UNIT` columns (k from the whole row down to
    one unit). The predicted time of a plan is ⌈programs / wave⌉·(k + :data:`PROGRAM_OVERHEAD`)
    (+ :data:`MERGE_COST` for the merge kernel), in units of one SPLIT_UNIT block per program: a
    partial last wave costs a whole one. The plan is the fastest of those that fill their waves
    (:func:`_filled`), else the fastest: near-integral waves where some split gives them, short
    splits for few rows. From FULL_WAVES waves of rows on a row is never split. Ties take
    fewer splits.
    """
    wave = PROGRAMS_PER_SM * max(1, sms)
    units = max(1, -(-vocab // SPLIT_UNIT))
    whole = (_block(vocab), max(vocab, 1))
    if n_rows <= 0 or n_rows >= FULL_WAVES * wave or units == 1:
        return whole
    best, best_key = None, None
    for splits in sorted({-(-units // k) for k in range(1, units + 1)}):  # those k can give
        k = -(-units // splits)  # the shortest programs of that count
        cost = -(-(n_rows * splits) // wave) * (k + PROGRAM_OVERHEAD)
        cost += MERGE_COST if splits > 1 else 0
        key = (not _filled(n_rows * splits, wave), cost)
        if best_key is None or key < best_key:
            block = SPLIT_UNIT * min(MAX_BLOCK // SPLIT_UNIT, k & -k)  # divides k·SPLIT_UNIT
            best, best_key = (whole if splits == 1 else (block, k * SPLIT_UNIT)), key
    return best


def split_columns(n_rows: int, vocab: int, device: torch.device, vocab_chunk: int = 0) -> tuple[int, int]:
    """(BLOCK, columns per program) of the forward for an (n_rows, vocab) problem on
    ``device``: :func:`plan_splits` with the device's SM count (1 on CPU: the interpreter).

    ``vocab_chunk`` > 0 forces programs of that many columns (rounded up to the block; the
    block shrinks to fit the chunk).
    """
    if vocab_chunk > 0:
        block = _block(min(vocab_chunk, vocab))
        return block, -(-vocab_chunk // block) * block
    return plan_splits(n_rows, vocab, _sm_count(device))


def _warps(block: int) -> int:
    return 8 if block >= 2048 else 4


def _portable(*tensors: Tensor | None) -> bool:
    """Float64 inputs (float64 math) and empty vocabularies run the streaming ops."""
    given = [t for t in tensors if t is not None]
    return any(t.dtype == torch.float64 for t in given) or given[0].shape[-1] == 0


def _wanted(want: int) -> tuple[bool, bool, bool, bool]:
    """(kl, logp, ref_logp, entropy): the outputs asked for by the ``want`` bits."""
    return tuple(bool(want & bit) for bit in Want)


_STATE_NAMES = ("STATE_COLS", "SX_M_X", "SX_S_X", "SX_M_Y", "SX_S_Y", "SX_A", "SX_B")
_OUT_NAMES = ("OUT_COLS", "OUT_KL", "OUT_LOGP", "OUT_REF_LOGP", "OUT_ENTROPY")
_STATS_NAMES = ("STATS_COLS", "ST_SHIFT_X", "ST_LOG_S_X", "ST_SHIFT_Y", "ST_LOG_S_Y",
                "ST_MEAN_D", "ST_MEAN_U", "ST_LOGP", "ST_REF_LOGP")


def column_constexprs(kernel: str) -> dict[str, int]:
    """The column layout of :mod:`.contract` as the ``tl.constexpr`` s of a kernel
    (``"stats"``: :func:`._triton_jit.stats_kernel` and ``merge_kernel``, the state, out and
    stats columns; ``"grad"``: the out and stats columns of ``grad_kernel``)."""
    if kernel == "stats":
        names = _STATE_NAMES + _OUT_NAMES + _STATS_NAMES + ("ST_CAREFUL", "ST_TAU")
    else:
        names = _OUT_NAMES + _STATS_NAMES
    return {name: getattr(contract, name) for name in names}


def forward_constexprs(
    flags, has_keep: bool, has_tau: bool, finish: bool = True, has_mask: bool = False
) -> dict[str, bool]:
    """The ``tl.constexpr`` flags of :func:`._triton_jit.stats_kernel` for the wanted outputs
    ``flags`` = (kl, logp, ref_logp, entropy) (:func:`_wanted`) and the support; ``finish``:
    the kernel writes out and stats (one program per row), else partial states."""
    kl, logp, ref_logp, ent = flags
    return dict(
        X_STATE=kl or logp or ent, Y_STATE=kl or ref_logp, MOMENT_A=kl, MOMENT_B=ent,
        HAS_KEEP=has_keep, HAS_TAU=has_tau, FINISH=finish, LOGP=logp and finish,
        REF_LOGP=ref_logp and finish, HAS_MASK=has_mask and finish,
    )


def backward_constexprs(
    flags, need_x: bool, need_y: bool, has_keep: bool, has_tau: bool, has_mask: bool = False,
    has_owned: bool = False,
) -> dict[str, bool]:
    """The ``tl.constexpr`` flags of :func:`._triton_jit.grad_kernel` (as
    :func:`forward_constexprs`; ``need_x``/``need_y``: the gradients written)."""
    kl, logp, ref_logp, ent = flags
    return dict(
        KL=kl, LOGP=logp, REF_LOGP=ref_logp, ENTROPY=ent, NEED_X=need_x, NEED_Y=need_y,
        NEED_P=(need_x and (kl or logp or ent)) or (need_y and kl),
        NEED_Q=need_y or (need_x and kl), HAS_TOKEN=logp or ref_logp,
        HAS_KEEP=has_keep, HAS_TAU=has_tau, HAS_MASK=has_mask,
        HAS_OWNED=has_owned and (logp or ref_logp),
    )


_MERGED = ("X_STATE",)  # the forward flags merge_kernel does not take


def _forward(x, y, tokens, mask, keep, tau, temperature: float, ignore_index: int, want: int,
             tile_cols: int, finish: bool) -> tuple[Tensor, ...]:
    """The forward kernels on (..., V) logits: ``finish`` → (out (N, 4), stats (N, 10)), else
    the merged state (N, 6). One program per row writes them directly; split rows write
    partial states that :func:`._triton_jit.merge_kernel` merges (and finishes)."""
    flags = kl, logp, ref_logp, _ = _wanted(want)
    rows = _rows(x, y if kl or ref_logp else None, keep)
    vocab = x.shape[-1]
    n = x.numel() // vocab
    device = x.device
    new = functools.partial(torch.empty, dtype=torch.float32, device=device)
    outs = (new((n, contract.OUT_COLS)), new((n, contract.STATS_COLS))) if finish else (
        new((n, contract.STATE_COLS)),)
    if n == 0:
        return outs
    block, cols = split_columns(n, vocab, device, tile_cols)
    splits = max(1, -(-vocab // cols))
    tauf = _flat(tau)
    tok = _flat(tokens) if finish and (logp or ref_logp) else None
    maskf = _flat(mask, torch.uint8) if finish else None
    constexprs = forward_constexprs(flags, keep is not None, tau is not None, finish,
                                    maskf is not None)
    out, stats = outs if finish else (outs[0], outs[0])
    any_ptr = outs[0]
    inv_t = 1.0 / temperature
    # an absent y or keep passes x (the kernel's vector width follows the pointers' dtypes)
    pointers = (rows.x, rows.x if rows.y is None else rows.y,
                rows.x if rows.keep is None else rows.keep, any_ptr if tauf is None else tauf,
                any_ptr if tok is None else tok, any_ptr if maskf is None else maskf)
    kernels = _kernels()
    if splits == 1:
        _launch(
            kernels.stats_kernel, (n, 1), device, *pointers, out, stats, *rows.args, vocab,
            cols, 1, inv_t, inv_t * 1.4426950408889634, temperature, ignore_index,
            **constexprs, **column_constexprs("stats"), BLOCK=block, num_warps=_warps(block),
        )
        return outs
    parts = new((n, splits, contract.STATE_COLS))
    _launch(
        kernels.stats_kernel, (n, splits), device, *pointers, parts, parts, *rows.args, vocab,
        cols, splits, inv_t, inv_t * 1.4426950408889634, temperature, ignore_index,
        **{**constexprs, "FINISH": False}, **column_constexprs("stats"), BLOCK=block,
        num_warps=_warps(block),
    )
    merge_flags = {k: f for k, f in constexprs.items() if k not in _MERGED}
    _launch(
        kernels.merge_kernel, (n,), device, parts, *pointers, out, stats, *rows.args, vocab,
        splits, inv_t, temperature, ignore_index, **merge_flags,
        SPLITS=max(2, 1 << (splits - 1).bit_length()), **column_constexprs("stats"),
        num_warps=1,
    )
    return outs


# Buckets per read of a threshold search (:func:`._triton_jit.threshold_kernel`): 4 bits of
# the 32-bit key per read; a power of two.
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


def _threshold(x: Tensor, top_k: int, top_p: float, min_p: float, temperature: float,
               tau: Tensor | None = None) -> Tensor:
    """τ (N,) float32 of the sampler settings on the rows of (..., V) logits (the rule of
    :mod:`klpenalty.sampling`), or max(tau, τ) (NaN where either is) where ``tau`` (...) is
    given: one program per row of :func:`._triton_jit.threshold_kernel`, launched on x's device,
    nothing read back. The settings cut (:func:`.contract.sampler_cuts`)."""
    vocab = x.shape[-1]
    n = x.numel() // vocab
    out = torch.empty(n, dtype=torch.float32, device=x.device)
    if n == 0:
        return out
    rows = _rows(x, None, None)
    tauf = _flat(tau)
    block = _block(vocab, THRESHOLD_BLOCK)
    cut_p = top_p < 1.0
    # top-p's search starts where the logits below hold < 1 − p of the mass together
    window = math.log((1.0 - top_p) / vocab) - 2.0 if cut_p else 0.0
    _launch(
        _kernels().threshold_kernel, (n,), x.device, rows.x, out if tauf is None else tauf,
        out, *rows.args[:3], vocab, top_k if 0 < top_k < vocab else 0,
        _float64_bits(top_p), _float64_bits(math.log(min_p) if min_p > 0.0 else 0.0),
        _float64_bits(window), temperature, TOP_K=0 < top_k < vocab, TOP_P=cut_p,
        MIN_P=min_p > 0.0, HAS_TAU=tauf is not None, KEY_SHIFT=_KEY_SHIFT[x.dtype],
        BLOCK=block, BT=min(block, 32 * THRESHOLD_WARPS), F=THRESHOLD_BUCKETS,
        num_warps=THRESHOLD_WARPS if block >= 32 * THRESHOLD_WARPS else 1,
    )
    return out


contract.define_ops("triton")


def _token_stats_state_op(x, y, keep, tau, temperature, want, tile_rows, tile_cols):
    """The unfinalized state (N, 6) of (..., V) logits over these columns and (N,) careful
    flags (the state op of :mod:`.contract`), from the forward kernels."""
    if _portable(x, y):
        return streaming.token_stats_state_op(
            x, y, keep, tau, temperature, want, tile_rows, tile_cols
        )
    (state,) = _forward(x, y, None, None, keep, tau, temperature, -100, want, tile_cols, False)
    return state, torch.zeros(state.shape[0], dtype=torch.bool, device=x.device)


def _token_stats_op(  # the schema: contract.SCHEMAS["token_stats"]
    x, y, tokens, mask, keep, tau, temperature, ignore_index, want, check, tile_rows,
    tile_cols, top_k, top_p, min_p,
):
    """(..., V) logits → out (..., 4) = (KL(π̃‖ρ), log π̃(t), log ρ(t), H(π̃)) and stats (..., 10)
    (the forward op of :mod:`.contract`), in one read of each logit, written by the kernels;
    ``tile_cols`` > 0 forces the split width (``tile_rows`` is unused: one program per row).
    Where the sampler settings cut, :func:`_threshold` runs first (its τ, max with ``tau``, is
    the support's threshold and the stats column ``ST_TAU``)."""
    if _portable(x, y):
        return streaming.token_stats_op(
            x, y, tokens, mask, keep, tau, temperature, ignore_index, want, check, tile_rows,
            tile_cols, top_k, top_p, min_p,
        )
    v.check_want(want, y is not None, tokens is not None)
    contract.check_sampler_args(top_k, top_p, min_p, temperature)
    if contract.sampler_cuts(x.shape[-1], top_k, top_p, min_p):  # τ = max(tau, τ_s), (N,)
        tau = _threshold(x, top_k, top_p, min_p, temperature, tau)
    out, stats = _forward(x, y, tokens, mask, keep, tau, temperature, ignore_index, want,
                          tile_cols, True)
    if check:  # one host read for all the checks
        contract.check_finished(out, x, y, tokens, keep, tau, want, ignore_index)
    leading = x.shape[:-1]
    return out.view(*leading, contract.OUT_COLS), stats.view(*leading, contract.STATS_COLS)


def _token_stats_backward_op(  # the schema: contract.SCHEMAS["token_stats_backward"]
    grad, x, y, tokens, owned, stats, mask, keep, tau, temperature, ignore_index, want,
    need_x, need_y, tile_rows, tile_cols,
):
    """∂/∂x (..., V) and ∂/∂y (..., V) of Σ grad·out (grad (..., 4)) in one read of the
    logits, in their dtypes (an empty tensor for one that is not needed); the backward op of
    :mod:`.contract` (where ``owned`` is False the token's own entry is not added). The
    upstream gradient's masking (unwanted columns, masked rows, ignored tokens) and the
    token's factors are applied in the kernel."""
    if _portable(x, y):
        return streaming.token_stats_backward_op(
            grad, x, y, tokens, owned, stats, mask, keep, tau, temperature, ignore_index, want,
            need_x, need_y, tile_rows, tile_cols,
        )
    flags = kl, logp, ref_logp, _ = _wanted(want)
    need_y = need_y and y is not None
    use_y = (kl or ref_logp) and y is not None
    vocab = x.shape[-1]
    n = x.numel() // vocab
    gx = torch.empty((n, vocab), dtype=x.dtype, device=x.device) if need_x else None
    gy = None
    if need_y:  # a reference not in any wanted output gets a zero gradient
        gy = (torch.empty if use_y else torch.zeros)((n, vocab), dtype=y.dtype, device=x.device)
    write_y = need_y and use_y
    if n and (need_x or write_y):
        rows = _rows(x, y if use_y else None, keep)
        st = _flat(stats).view(n, contract.STATS_COLS)
        g = grad.reshape(n, contract.OUT_COLS)  # (N, 4), read through its strides
        tok = _flat(tokens) if logp or ref_logp else None
        maskf, ownedf, tauf = _flat(mask, torch.uint8), _flat(owned, torch.uint8), _flat(tau)
        block = _block(vocab, 1024)
        inv_t = 1.0 / temperature
        _launch(
            _kernels().grad_kernel, (n, -(-vocab // (block * GRAD_TILES))), x.device,
            rows.x, rows.x if rows.y is None else rows.y, rows.x if rows.keep is None else rows.keep,
            st if tauf is None else tauf, gx if need_x else st, gy if write_y else st, st, g,
            st if tok is None else tok, st if maskf is None else maskf,
            st if ownedf is None else ownedf, *rows.args, g.stride(0), g.stride(1), vocab,
            inv_t, inv_t * 1.4426950408889634, ignore_index,
            **backward_constexprs(flags, need_x, write_y, keep is not None, tau is not None,
                                  maskf is not None, ownedf is not None),
            **column_constexprs("grad"), BLOCK=block, TILES=GRAD_TILES,
            num_warps=_warps(block),
        )
    return (
        gx.view(x.shape) if need_x else x.new_empty(0),
        gy.view(y.shape) if need_y else x.new_empty(0),
    )


def _sampling_threshold_op(x, top_k, top_p, min_p, temperature):  # SCHEMAS["sampling_threshold"]
    """τ (...) float32 of top-k → top-p → min-p sampling on (..., V) logits (the threshold op
    of :mod:`.contract`, :func:`klpenalty.sampling.sampling_threshold`'s rule): −inf where
    nothing is cut, NaN for a row holding NaN; computed by :func:`._triton_jit.threshold_kernel`
    (float64 logits and empty vocabularies: the streaming op)."""
    if _portable(x):
        return streaming.sampling_threshold_op(x, top_k, top_p, min_p, temperature)
    contract.check_sampler_args(top_k, top_p, min_p, temperature)
    if not contract.sampler_cuts(x.shape[-1], top_k, top_p, min_p):
        return torch.full(x.shape[:-1], -math.inf, dtype=torch.float32, device=x.device)
    return _threshold(x, top_k, top_p, min_p, temperature).view(x.shape[:-1])


contract.implement(
    "triton", "CompositeExplicitAutograd", token_stats=_token_stats_op,
    token_stats_backward=_token_stats_backward_op, token_stats_state=_token_stats_state_op,
    sampling_threshold=_sampling_threshold_op,
)
