"""The Triton backend's token statistics (CUDA tensors; CPU tensors under
``TRITON_INTERPRET=1``): the engine's per-row state in fused GPU kernels, those of
:mod:`._kernels_stats`.

The ops ``klpenalty::triton_token_stats``, ``_backward`` and ``_state`` of :mod:`..contract`
compute every per-token statistic — KL(π̃‖ρ), log π̃(token), log ρ(token), H(π̃) — in one read
of the logits.

**Forward.** One kernel (:func:`._kernels_stats.stats_kernel`) specialised by ``tl.constexpr``
flags (the policy's state, the reference's, the KL moment a, the entropy moment b, a support
by keep mask and/or threshold tau, the wanted log-probs, a mask). Program (row, split) walks its
columns in ``BLOCK`` chunks, reads each logit once in its own dtype (bf16/fp16/fp32), keeps the
engine's state in float32 — maxima in logit units, s_x = Σ e^u over the support, s_y = Σ e^w,
a = Σ e^u·(u − w), b = Σ e^u·u — and rescales it when a block raises a max (the engine's
merge). A program that is a whole row finishes it: the engine's finalize, the token's logits
gathered for log π̃(t) and log ρ(t), masked rows zeroed, written straight into out (N, 4) and
stats (N, 10). Split rows write partial states to an (N, splits, 6) float32 buffer that
:func:`._kernels_stats.merge_kernel` merges and finishes, one program per row. The host dispatches
views and the outputs' allocations only, and reads nothing back (``check=True``: one read).
The split plan (:func:`plan_splits`) fills the GPU's waves; ``tile_cols`` forces the split.
Float64 inputs and empty vocabularies run the streaming backend's ops, through the
dispatcher (:func:`._host.portable_op`; the kernels compute in float32).

**The sampler's threshold.** Where top_k / top_p / min_p cut, the forward first launches
the kernels of :mod:`._kernels_threshold` (:func:`.threshold.tau_rows`: a split scan with
top-k's digit histograms, then one program per row for top-p and min-p: radix selects over
order-preserving keys of the logits, float64 masses; docs/triton.md), which write
max(tau, τ_s) into an (N,) buffer that the statistics kernels read as their tau and write
into the stats column ``ST_TAU``; the threshold op runs the same kernel alone.

**Backward.** One kernel (:func:`._kernels_stats.grad_kernel`) over a (rows, vocabulary blocks)
grid recomputes π̃ (and ρ) from the stats and writes ∂/∂x and ∂/∂y of all wanted outputs
together, once, in the inputs' dtypes; the upstream gradient is read through its strides and
masked in the kernel (unwanted columns, masked rows, ignored tokens; 0·log 0 guards), so rows
with −inf entries get finite gradients and masked rows exactly 0.

**Layouts.** Rows r of a (..., T, V) input are read at (r // T)·stride_b + (r % T)·stride_t
(:func:`._host.strides`): in place where the dimensions before −2 collapse to one stride and
the last dimension is contiguous (``logits[:, :-1]``, transposes of (B, T)); other layouts are
copied once. **Device.** Every launch goes through :func:`._host.launch`, which makes the
tensors' CUDA device current (Triton launches on the current device).

The careful-arithmetic flag (stats column 5) marks the rows without a distribution or with
E_π̃[u − w] = +inf only: the backward kernel always uses the guarded arithmetic.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from ... import _validation as v
from .. import contract
from ..contract import Want
from . import _host
from ._load import _kernels
from .threshold import tau_rows

__all__ = [
    "split_columns",
    "plan_splits",
    "forward_constexprs",
    "backward_constexprs",
    "column_constexprs",
    "token_stats_op",
    "token_stats_backward_op",
    "token_stats_state_op",
    "MAX_BLOCK",
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
    whole = (_host.block(vocab, MAX_BLOCK), max(vocab, 1))
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
        block = _host.block(min(vocab_chunk, vocab), MAX_BLOCK)
        return block, -(-vocab_chunk // block) * block
    return plan_splits(n_rows, vocab, _sm_count(device))


# The outputs (Want bits) that read the policy's distribution, the reference's logits and the
# sampled token.
_READS_X = Want.KL | Want.LOGP | Want.ENTROPY
_READS_Y = Want.KL | Want.REF_LOGP
_READS_TOKEN = Want.LOGP | Want.REF_LOGP


@functools.cache
def column_constexprs(kernel: str) -> dict[str, int]:
    """The column layouts of :mod:`..contract` as the ``tl.constexpr`` s of a kernel of
    :mod:`._kernels_stats` (``"stats"``, ``"merge"`` or ``"grad"``): every column constant of
    :data:`..contract.COLUMNS` that the kernel takes, as a parameter of the same name."""
    from . import _kernels_stats  # imported already where a kernel runs (imports Triton)

    return _host.column_constexprs(getattr(_kernels_stats, f"{kernel}_kernel"))


def forward_constexprs(
    want: int, has_keep: bool, has_tau: bool, finish: bool = True, has_mask: bool = False
) -> dict[str, bool]:
    """The ``tl.constexpr`` flags of :func:`._kernels_stats.stats_kernel` for the outputs in
    ``want`` (:class:`..contract.Want` bits) and the support; ``finish``: the kernel writes out
    and stats (one program per row), else partial states."""
    want = Want(want)
    return dict(
        X_STATE=bool(want & _READS_X), Y_STATE=bool(want & _READS_Y),
        MOMENT_A=Want.KL in want, MOMENT_B=Want.ENTROPY in want, HAS_KEEP=has_keep,
        HAS_TAU=has_tau, FINISH=finish, LOGP=Want.LOGP in want and finish,
        REF_LOGP=Want.REF_LOGP in want and finish, HAS_MASK=has_mask and finish,
    )


def backward_constexprs(
    want: int, need_x: bool, need_y: bool, has_keep: bool, has_tau: bool,
    has_mask: bool = False, has_owned: bool = False,
) -> dict[str, bool]:
    """The ``tl.constexpr`` flags of :func:`._kernels_stats.grad_kernel` (as
    :func:`forward_constexprs`; ``need_x``/``need_y``: the gradients written). The kernel's
    flags of the wanted outputs are named as their :class:`..contract.Want` bits (KL, LOGP,
    REF_LOGP, ENTROPY)."""
    want = Want(want)
    kl = Want.KL in want
    return dict(
        **{bit.name: bit in want for bit in Want}, NEED_X=need_x, NEED_Y=need_y,
        NEED_P=(need_x and bool(want & _READS_X)) or (need_y and kl),
        NEED_Q=need_y or (need_x and kl), HAS_TOKEN=bool(want & _READS_TOKEN),
        HAS_KEEP=has_keep, HAS_TAU=has_tau, HAS_MASK=has_mask,
        HAS_OWNED=has_owned and bool(want & _READS_TOKEN),
    )


_MERGED = ("X_STATE",)  # the forward flags merge_kernel does not take


def _forward(x, y, tokens, mask, keep, tau, temperature: float, ignore_index: int, want: int,
             tile_cols: int, finish: bool) -> tuple[Tensor, ...]:
    """The forward kernels on (..., V) logits: ``finish`` → (out (N, 4), stats (N, 10)), else
    the merged state (N, 6). One program per row writes them directly; split rows write
    partial states that :func:`._kernels_stats.merge_kernel` merges (and finishes)."""
    constexprs = forward_constexprs(want, keep is not None, tau is not None, finish,
                                    finish and mask is not None)
    rows = _host.rows(x, y if constexprs["Y_STATE"] else None, keep)
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
    tauf = _host.flat(tau)
    tok = _host.flat(tokens) if constexprs["LOGP"] or constexprs["REF_LOGP"] else None
    maskf = _host.flat(mask, torch.uint8) if finish else None
    out, stats = outs if finish else (outs[0], outs[0])
    any_ptr = outs[0]
    inv_t = 1.0 / temperature
    # an absent y or keep passes x (the kernel's vector width follows the pointers' dtypes)
    pointers = (rows.x, rows.x if rows.y is None else rows.y,
                rows.x if rows.keep is None else rows.keep, any_ptr if tauf is None else tauf,
                any_ptr if tok is None else tok, any_ptr if maskf is None else maskf)
    kernels = _kernels()
    if splits == 1:
        _host.launch(
            kernels.stats_kernel, (n, 1), device, *pointers, out, stats, *rows.args, vocab,
            cols, 1, inv_t, inv_t * 1.4426950408889634, temperature, ignore_index,
            **constexprs, **column_constexprs("stats"), BLOCK=block,
            num_warps=_host.warps(block),
        )
        return outs
    parts = new((n, splits, contract.STATE_COLS))
    _host.launch(
        kernels.stats_kernel, (n, splits), device, *pointers, parts, parts, *rows.args, vocab,
        cols, splits, inv_t, inv_t * 1.4426950408889634, temperature, ignore_index,
        **{**constexprs, "FINISH": False}, **column_constexprs("stats"), BLOCK=block,
        num_warps=_host.warps(block),
    )
    merge_flags = {k: f for k, f in constexprs.items() if k not in _MERGED}
    _host.launch(
        kernels.merge_kernel, (n,), device, parts, *pointers, out, stats, *rows.args, vocab,
        splits, inv_t, temperature, ignore_index, **merge_flags,
        SPLITS=max(2, 1 << (splits - 1).bit_length()), **column_constexprs("merge"),
        num_warps=1,
    )
    return outs


def token_stats_state_op(x, y, keep, tau, temperature, want, tile_rows, tile_cols):
    """The unfinalized state (N, 6) of (..., V) logits over these columns and (N,) careful
    flags (the state op of :mod:`..contract`), from the forward kernels."""
    if _host.portable(x, y):
        return _host.portable_op("token_stats_state")(
            x, y, keep, tau, temperature, want, tile_rows, tile_cols
        )
    (state,) = _forward(x, y, None, None, keep, tau, temperature, -100, want, tile_cols, False)
    return state, torch.zeros(state.shape[0], dtype=torch.bool, device=x.device)


def token_stats_op(  # the schema: contract.SCHEMAS["token_stats"]
    x, y, tokens, mask, keep, tau, temperature, ignore_index, want, check, tile_rows,
    tile_cols, top_k, top_p, min_p, ids=None, offsets=None,
):
    """(..., V) logits → out (..., 4) = (KL(π̃‖ρ), log π̃(t), log ρ(t), H(π̃)) and stats (..., 10)
    (the forward op of :mod:`..contract`), in one read of each logit, written by the kernels;
    ``tile_cols`` > 0 forces the split width (``tile_rows`` is unused: one program per row).
    Where the sampler settings cut, :func:`.threshold.tau_rows` runs first (its τ, max with
    ``tau``, is the support's threshold and the stats column ``ST_TAU``); given kept sets
    ``ids`` / ``offsets``, their thresholds from ``triton_support_from_ids`` first
    (:func:`..contract.tau_of_ids`)."""
    if _host.portable(x, y):
        return _host.portable_op("token_stats")(
            x, y, tokens, mask, keep, tau, temperature, ignore_index, want, check, tile_rows,
            tile_cols, top_k, top_p, min_p, ids, offsets,
        )
    v.check_want(want, y is not None, tokens is not None)
    contract.check_sampler_args(top_k, top_p, min_p, temperature)
    tau, check = contract.tau_of_ids("triton", x, mask, tau, ids, offsets, check)
    if contract.sampler_cuts(x.shape[-1], top_k, top_p, min_p):  # τ = max(tau, τ_s), (N,)
        tau = tau_rows(x, top_k, top_p, min_p, temperature, tau)
    out, stats = _forward(x, y, tokens, mask, keep, tau, temperature, ignore_index, want,
                          tile_cols, True)
    if check:  # one host read for all the checks
        contract.check_finished(out, x, y, tokens, keep, tau, want, ignore_index)
    leading = x.shape[:-1]
    return out.view(*leading, contract.OUT_COLS), stats.view(*leading, contract.STATS_COLS)


def token_stats_backward_op(  # the schema: contract.SCHEMAS["token_stats_backward"]
    grad, x, y, tokens, owned, stats, mask, keep, tau, temperature, ignore_index, want,
    need_x, need_y, tile_rows, tile_cols,
):
    """∂/∂x (..., V) and ∂/∂y (..., V) of Σ grad·out (grad (..., 4)) in one read of the
    logits, in their dtypes (an empty tensor for one that is not needed); the backward op of
    :mod:`..contract` (where ``owned`` is False the token's own entry is not added). The
    upstream gradient's masking (unwanted columns, masked rows, ignored tokens) and the
    token's factors are applied in the kernel."""
    if _host.portable(x, y):
        return _host.portable_op("token_stats_backward")(
            grad, x, y, tokens, owned, stats, mask, keep, tau, temperature, ignore_index, want,
            need_x, need_y, tile_rows, tile_cols,
        )
    need_y = need_y and y is not None
    use_y = bool(want & _READS_Y) and y is not None
    vocab = x.shape[-1]
    n = x.numel() // vocab
    gx = torch.empty((n, vocab), dtype=x.dtype, device=x.device) if need_x else None
    gy = None
    if need_y:  # a reference not in any wanted output gets a zero gradient
        gy = (torch.empty if use_y else torch.zeros)((n, vocab), dtype=y.dtype, device=x.device)
    write_y = need_y and use_y
    if n and (need_x or write_y):
        rows = _host.rows(x, y if use_y else None, keep)
        st = _host.flat(stats).view(n, contract.STATS_COLS)
        g = grad.reshape(n, contract.OUT_COLS)  # (N, 4), read through its strides
        tok = _host.flat(tokens) if want & _READS_TOKEN else None
        maskf, ownedf = _host.flat(mask, torch.uint8), _host.flat(owned, torch.uint8)
        tauf = _host.flat(tau)
        block = _host.block(vocab, 1024)
        inv_t = 1.0 / temperature
        _host.launch(
            _kernels().grad_kernel, (n, -(-vocab // (block * GRAD_TILES))), x.device,
            rows.x, rows.x if rows.y is None else rows.y, rows.x if rows.keep is None else rows.keep,
            st if tauf is None else tauf, gx if need_x else st, gy if write_y else st, st, g,
            st if tok is None else tok, st if maskf is None else maskf,
            st if ownedf is None else ownedf, *rows.args, g.stride(0), g.stride(1), vocab,
            inv_t, inv_t * 1.4426950408889634, ignore_index,
            **backward_constexprs(want, need_x, write_y, keep is not None, tau is not None,
                                  maskf is not None, ownedf is not None),
            **column_constexprs("grad"), BLOCK=block, TILES=GRAD_TILES,
            num_warps=_host.warps(block),
        )
    return (
        gx.view(x.shape) if need_x else x.new_empty(0),
        gy.view(y.shape) if need_y else x.new_empty(0),
    )
