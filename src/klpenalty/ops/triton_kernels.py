"""Triton backend (CUDA tensors; CPU tensors under ``TRITON_INTERPRET=1``): the engine's per-row
state in fused GPU kernels.

The kernels live in :mod:`._triton_jit`, imported at the first call (Triton is an optional
dependency: ``pip install 'klpenalty[triton]'``; this module imports without it).

One op pair, ``klpenalty::triton_token_stats[_backward]`` (the contract of
:func:`.autograd.register_token_stats`), computes every per-token statistic — KL(π̃‖ρ),
log π̃(token), log ρ(token), H(π̃) — in one read of the logits; :func:`full_kl`,
:func:`token_logprobs` and :func:`entropy` are views of it (one column of ``want``).

**Forward.** One kernel (:func:`._triton_jit.stats_kernel`) specialised by ``tl.constexpr``
flags (the policy's state, the reference's, the KL moment a, the entropy moment b, a support
by keep mask and/or threshold tau). Program (row, split) walks its columns in ``BLOCK``
chunks, reads each logit once in its own dtype (bf16/fp16/fp32), keeps the engine's state in
float32 — maxima in logit units, s_x = Σ e^u over the support, s_y = Σ e^w,
a = Σ e^u·(u − w), b = Σ e^u·u — and rescales it when a block raises a max (the engine's
merge). It writes its partial state to an (N, splits, 6) float32 buffer; the splits of a row
are merged with the engine's rescale-and-add in torch, and the (N,) merged state is finalized
by :func:`.engine.kl_finalize` / :func:`.engine.entropy_finalize`, so the numerics and the
stats columns are the engine's. log π̃(t) and log ρ(t) come from the merged state and the
token's logit (one gather per row). One split per row unless the rows are too few to fill the
GPU (:func:`split_columns`); ``vocab_chunk`` forces the split. Float64 inputs run the streaming
op (the kernels compute in float32).

**Backward.** One kernel (:func:`._triton_jit.grad_kernel`) over a (rows, vocabulary blocks)
grid recomputes π̃ (and ρ) from the stats and writes ∂/∂x and ∂/∂y of all wanted outputs
together, once, in the inputs' dtypes; the upstream gradient (0 on masked rows, the log-prob
columns 0 at ignored tokens) and the 0·log 0 guards are applied in the kernel, so rows with
−inf entries get finite gradients and masked rows exactly 0.

**Strides.** Rows are passed with their row stride: a (..., V) tensor whose leading dimensions
flatten to one stride and whose last dimension is contiguous is read in place; any other
layout is copied once by ``reshape``/``contiguous``.

The careful-arithmetic flag (stats column 5) marks the rows without a distribution or with
E_π̃[u − w] = +inf only: the backward kernel always uses the guarded arithmetic.
"""

from __future__ import annotations

import os
import warnings
from typing import Optional

import torch
from torch import Tensor

from .. import _validation as v
from . import autograd as ag
from . import streaming
from .engine import (
    EntropyState,
    KLState,
    entropy_finalize,
    entropy_rescale,
    finite_or_zero,
    kl_finalize,
    kl_rescale,
)

__all__ = [
    "token_stats",
    "full_kl",
    "token_logprobs",
    "entropy",
    "available",
    "interpreted",
    "check_device",
    "split_columns",
    "forward_constexprs",
    "backward_constexprs",
    "MAX_BLOCK",
    "INSTALL_HINT",
]

# Columns per forward/backward block: 4096 bf16 = 8 KiB per row and model per step.
MAX_BLOCK = 4096
# Programs per SM the forward wants before it splits rows across programs.
PROGRAMS_PER_SM = 4

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


@torch.compiler.assume_constant_result
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
def _rows(x: Tensor) -> Tensor:
    """(..., V) → (N, V) with unit column stride: a view when the layout allows, else a copy."""
    xf = x.reshape(-1, x.shape[-1])
    return xf if xf.stride(-1) == 1 or xf.shape[-1] <= 1 else xf.contiguous()


def _block(vocab: int, cap: int = MAX_BLOCK) -> int:
    return max(16, min(cap, 1 << max(0, vocab - 1).bit_length()))


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


def split_columns(n_rows: int, vocab: int, device: torch.device, vocab_chunk: int = 0) -> tuple[int, int]:
    """(BLOCK, columns per program) of the forward for an (n_rows, vocab) problem.

    ``vocab_chunk`` > 0 forces programs of that many columns (rounded up to the block; the
    block shrinks to fit the chunk). Otherwise a row is split only when the rows alone give
    fewer than :data:`PROGRAMS_PER_SM` programs per SM, into at most that many programs, each
    at least 4 blocks long.
    """
    if vocab_chunk > 0:
        block = _block(min(vocab_chunk, vocab))
        return block, -(-vocab_chunk // block) * block
    block = _block(vocab)
    want = PROGRAMS_PER_SM * _sm_count(device)
    if n_rows >= want:
        return block, max(vocab, 1)
    blocks = -(-vocab // block)
    splits = max(1, min(-(-want // max(n_rows, 1)), blocks // 4))
    return block, -(-blocks // splits) * block


def _warps(block: int) -> int:
    return 8 if block >= 2048 else 4


def _portable(*tensors: Tensor | None) -> bool:
    """Float64 inputs (float64 math) and empty vocabularies run the streaming ops."""
    given = [t for t in tensors if t is not None]
    return any(t.dtype == torch.float64 for t in given) or given[0].shape[-1] == 0


def _flags(want: int, tokens: Tensor | None, y: Tensor | None) -> tuple[bool, bool, bool, bool]:
    """(kl, logp, ref_logp, entropy) asked for by ``want``; ValueError for one whose input is
    missing (log-probs without ``tokens``, the KL or the reference's log-prob without ``y``)."""
    kl, logp = bool(want & ag.WANT_KL), bool(want & ag.WANT_LOGP)
    ref_logp, ent = bool(want & ag.WANT_REF_LOGP), bool(want & ag.WANT_ENTROPY)
    if (logp or ref_logp) and tokens is None:
        raise ValueError(f"want={want} asks for token log-probs, but tokens is None")
    if (kl or ref_logp) and y is None:
        raise ValueError(f"want={want} asks for the KL or the reference's log-probs, but y is None")
    return kl, logp, ref_logp, ent


def _support_args(x: Tensor, keep: Tensor | None, tau: Tensor | None, n: int):
    """(keep rows (N, V) as uint8 or a dummy, its row stride, tau (N,) or a dummy)."""
    keepf = _rows(keep).view(torch.uint8) if keep is not None else None
    tauf = tau.reshape(n).contiguous() if tau is not None else None
    return keepf, (keepf.stride(0) if keepf is not None else 0), tauf


def forward_constexprs(flags, has_keep: bool, has_tau: bool) -> dict[str, bool]:
    """The ``tl.constexpr`` flags of :func:`._triton_jit.stats_kernel` for the wanted outputs
    ``flags`` = (kl, logp, ref_logp, entropy) (from :func:`_flags`) and the support."""
    kl, logp, ref_logp, ent = flags
    return dict(
        X_STATE=kl or logp or ent, Y_STATE=kl or ref_logp, MOMENT_A=kl, MOMENT_B=ent,
        HAS_KEEP=has_keep, HAS_TAU=has_tau,
    )


def backward_constexprs(flags, need_x: bool, need_y: bool, has_keep: bool, has_tau: bool) -> dict[str, bool]:
    """The ``tl.constexpr`` flags of :func:`._triton_jit.grad_kernel` (as
    :func:`forward_constexprs`; ``need_x``/``need_y``: the gradients written)."""
    kl, logp, ref_logp, ent = flags
    return dict(
        KL=kl, LOGP=logp, REF_LOGP=ref_logp, ENTROPY=ent, NEED_X=need_x, NEED_Y=need_y,
        NEED_P=(need_x and (kl or logp or ent)) or (need_y and kl),
        NEED_Q=need_y or (need_x and kl), HAS_TOKEN=logp or ref_logp,
        HAS_KEEP=has_keep, HAS_TAU=has_tau,
    )


def _merged_state(parts: Tensor, temperature: float) -> tuple[KLState, Tensor]:
    """Merge the (N, splits, 6) partial states (m_x, s_x, m_y, s_y, a, b) of a row's splits:
    the engine's rescale to the common maxima, then a sum. Returns (KLState, b) of (N,) tensors."""
    if parts.shape[1] == 1:
        m_x, s_x, m_y, s_y, a, b = parts[:, 0].unbind(-1)
        return KLState(m_x, s_x, m_y, s_y, a), b
    m_x, s_x, m_y, s_y, a, b = parts.unbind(-1)
    big_x, big_y = m_x.amax(1, keepdim=True), m_y.amax(1, keepdim=True)
    kl = kl_rescale(KLState(m_x, s_x, m_y, s_y, a), big_x, big_y, temperature)
    ent = entropy_rescale(EntropyState(m_x, s_x, b), big_x, temperature)
    state = KLState(big_x[:, 0], kl.s_x.sum(1), big_y[:, 0], kl.s_y.sum(1), kl.a.sum(1))
    return state, ent.b.sum(1)


def _forward_state(xf, yf, keepf, stride_keep, tauf, flags, temperature: float, vocab_chunk: int):
    """Run :func:`._triton_jit.stats_kernel` over (N, splits) programs and merge the splits."""
    kl, logp, ref_logp, ent = flags
    n, vocab = xf.shape
    device = xf.device
    block, cols = split_columns(n, vocab, device, vocab_chunk)
    splits = max(1, -(-vocab // cols))
    parts = torch.empty((n, splits, _kernels().STATE_FIELDS), dtype=torch.float32, device=device)
    if n:
        inv_t = 1.0 / temperature
        _kernels().stats_kernel[(n, splits)](
            xf, xf if yf is None else yf, xf if keepf is None else keepf,
            parts if tauf is None else tauf, parts,
            xf.stride(0), 0 if yf is None else yf.stride(0), stride_keep,
            vocab, cols, splits, inv_t, inv_t * 1.4426950408889634,
            **forward_constexprs(flags, keepf is not None, tauf is not None),
            BLOCK=block, num_warps=_warps(block),
        )
    return _merged_state(parts, temperature)


def _token_logprob(
    rows: Tensor, tok: Tensor, ignored: Tensor, m: Tensor, s: Tensor, temperature: float,
    off_support: Tensor | None,
) -> Tensor:
    """log p(token) (N,) = (x_t − m)/T − log s from the merged log-sum-exp state (N,) of the
    rows (N, V): −inf off the support, NaN without a distribution (s = 0), 0 where ignored."""
    picked = rows.gather(-1, tok.unsqueeze(-1)).squeeze(-1).to(s.dtype)  # (N,)
    # the shifted difference is exact for nearby logits, even at ±1e4
    out = (picked - finite_or_zero(m)) / temperature - torch.log(s)
    if off_support is not None:
        out = out.masked_fill(off_support, float("-inf"))
    return out.masked_fill(s == 0, float("nan")).masked_fill(ignored, 0.0)


def _off_support(xf: Tensor, keepf: Tensor | None, tauf: Tensor | None, tok: Tensor) -> Tensor | None:
    """(N,) True where the token is outside the policy's support (None without a support)."""
    if keepf is None and tauf is None:
        return None
    kept = torch.ones(tok.shape, dtype=torch.bool, device=tok.device)
    if keepf is not None:
        kept &= keepf.gather(-1, tok.unsqueeze(-1)).squeeze(-1) != 0
    if tauf is not None:
        kept &= xf.gather(-1, tok.unsqueeze(-1)).squeeze(-1).to(tauf.dtype) >= tauf
    return ~kept


def _check_outputs(out: Tensor, counted: Tensor, named: dict[str, Tensor], off: Tensor | None,
                   tokens: Tensor | None) -> None:
    """The op's ``check``: NaN in a counted row's wanted outputs, a sampled token off the
    support. One host read in total (the flags are combined before the first ``bool``)."""
    nan_rows = torch.isnan(out).any(-1) & counted  # (N,)
    bad_token = None if off is None else off & counted
    flags = nan_rows.any() if bad_token is None else torch.stack([nan_rows.any(), bad_token.any()])
    flags = flags.tolist() if bad_token is not None else [bool(flags), False]
    if flags[0]:
        v.raise_if_nan(torch.where(nan_rows, float("nan"), 0.0), named)
    if flags[1]:
        leading = next(iter(named.values())).shape[:-1]
        first = int(bad_token.nonzero()[0, 0])
        where = tuple(int(i) for i in torch.unravel_index(torch.tensor(first), leading)) if leading else ()
        token = int(tokens.reshape(-1)[first])
        raise ValueError(
            f"sampled token {token} at position {where} is outside the support of the policy "
            f"(keep/tau): log π̃(token) = -inf; {int(bad_token.sum())} such position(s)"
        )


@torch.library.custom_op("klpenalty::triton_token_stats", mutates_args=())
def _token_stats_op(
    x: Tensor,
    y: Optional[Tensor],
    tokens: Optional[Tensor],
    mask: Optional[Tensor],
    keep: Optional[Tensor],
    tau: Optional[Tensor],
    temperature: float,
    ignore_index: int,
    want: int,
    check: bool,
    tile_rows: int,
    tile_cols: int,
) -> tuple[Tensor, Tensor]:
    """(..., V) logits → out (..., 4) = (KL(π̃‖ρ), log π̃(t), log ρ(t), H(π̃)) and stats (..., 9)
    (the layout of :mod:`.autograd`), in one read of each logit; ``tile_cols`` > 0 forces the
    split width (``tile_rows`` is unused: one program per row)."""
    if _portable(x, y):
        return streaming._token_stats_op(
            x, y, tokens, mask, keep, tau, temperature, ignore_index, want, check, tile_rows,
            tile_cols,
        )
    flags = kl, logp, ref_logp, ent = _flags(want, tokens, y)
    leading, vocab = x.shape[:-1], x.shape[-1]
    if check and tokens is not None:
        v.check_token_range(tokens, vocab, ignore_index)
    xf = _rows(x)  # (N, V)
    yf = None if y is None else _rows(y)
    n = xf.shape[0]
    keepf, stride_keep, tauf = _support_args(x, keep, tau, n)
    state, b = _forward_state(xf, yf, keepf, stride_keep, tauf, flags, temperature, tile_cols)
    out = torch.zeros((n, 4), dtype=torch.float32, device=x.device)
    stats = torch.zeros((n, ag.STATS_COLS), dtype=torch.float32, device=x.device)
    if kl:
        out[:, ag.OUT_KL], stats[:, : ag.ST_MEAN_U] = kl_finalize(state, None)
    else:
        stats[:, ag.ST_SHIFT_X] = finite_or_zero(state.m_x)
        stats[:, ag.ST_LOG_S_X] = finite_or_zero(torch.log(state.s_x))
        stats[:, ag.ST_SHIFT_Y] = finite_or_zero(state.m_y)
        stats[:, ag.ST_LOG_S_Y] = finite_or_zero(torch.log(state.s_y))
    if ent:
        h, st = entropy_finalize(EntropyState(state.m_x, state.s_x, b))
        out[:, ag.OUT_ENTROPY], stats[:, ag.ST_MEAN_U] = h, st[:, 2]
    off = None
    if tokens is not None:
        tok, ignored = ag.safe_tokens(tokens.reshape(-1), ignore_index)  # (N,), (N,)
        if logp:
            off = _off_support(xf, keepf, tauf, tok)
            lp = _token_logprob(xf, tok, ignored, state.m_x, state.s_x, temperature, off)
            out[:, ag.OUT_LOGP] = stats[:, ag.ST_LOGP] = lp
            off = None if off is None else off & ~ignored
        if ref_logp:
            lq = _token_logprob(yf, tok, ignored, state.m_y, state.s_y, temperature, None)
            out[:, ag.OUT_REF_LOGP] = stats[:, ag.ST_REF_LOGP] = lq
    counted = torch.ones(n, dtype=torch.bool, device=x.device)
    if mask is not None:
        counted = mask.reshape(-1)
        out = out.masked_fill(~counted.unsqueeze(-1), 0.0)
    if check:
        named = {"logits": x} if y is None else {"policy_logits": x, "ref_logits": y}
        _check_outputs(out, counted, named, off, tokens)
    return out.reshape(*leading, 4), stats.reshape(*leading, ag.STATS_COLS)


@torch.library.custom_op("klpenalty::triton_token_stats_backward", mutates_args=())
def _token_stats_backward_op(
    grad: Tensor,
    x: Tensor,
    y: Optional[Tensor],
    tokens: Optional[Tensor],
    stats: Tensor,
    mask: Optional[Tensor],
    keep: Optional[Tensor],
    tau: Optional[Tensor],
    temperature: float,
    ignore_index: int,
    want: int,
    need_x: bool,
    need_y: bool,
    tile_rows: int,
    tile_cols: int,
) -> tuple[Tensor, Tensor]:
    """∂/∂x (..., V) and ∂/∂y (..., V) of Σ grad·out (grad (..., 4)) in one read of the
    logits, in their dtypes (an empty tensor for one that is not needed)."""
    if _portable(x, y):
        return streaming._token_stats_backward_op(
            grad, x, y, tokens, stats, mask, keep, tau, temperature, ignore_index, want,
            need_x, need_y, tile_rows, tile_cols,
        )
    kl, logp, ref_logp, ent = _flags(want, tokens, y)
    need_y = need_y and y is not None
    xf = _rows(x)  # (N, V)
    n, vocab = xf.shape
    yf = None if y is None else _rows(y)
    st = stats.reshape(n, ag.STATS_COLS).to(torch.float32).contiguous()
    g = ag.masked_grad(grad.reshape(n, 4), None if mask is None else mask.reshape(n, 1),
                       torch.float32)  # (N, 4)
    g = g * torch.tensor([kl, logp, ref_logp, ent], dtype=g.dtype, device=g.device)
    tok = None
    at_tok = torch.zeros((n, 2), dtype=torch.float32, device=x.device)
    if tokens is not None:
        tok, ignored = ag.safe_tokens(tokens.reshape(-1), ignore_index)
        g[:, 1:3] = g[:, 1:3].masked_fill(ignored.unsqueeze(-1), 0.0)
        # at the token: (1 − p_t)·g = −expm1(log p_t)·g, exact for p_t near 1
        at_tok = torch.where(g[:, 1:3] != 0, -torch.expm1(st[:, ag.ST_LOGP:]) * g[:, 1:3], 0.0)
    gx = torch.empty((n, vocab), dtype=x.dtype, device=x.device) if need_x else None
    gy = torch.empty((n, vocab), dtype=y.dtype, device=x.device) if need_y else None
    if n and (need_x or need_y):
        keepf, stride_keep, tauf = _support_args(x, keep, tau, n)
        block = _block(vocab, 1024)
        inv_t = 1.0 / temperature
        _kernels().grad_kernel[(n, -(-vocab // block))](
            xf, xf if yf is None else yf, xf if keepf is None else keepf,
            st if tauf is None else tauf, gx if need_x else st, gy if need_y else st,
            st, g.contiguous(), st if tok is None else tok, at_tok.contiguous(),
            xf.stride(0), 0 if yf is None else yf.stride(0), stride_keep,
            vocab, inv_t, inv_t * 1.4426950408889634,
            **backward_constexprs(
                (kl, logp, ref_logp, ent), need_x, need_y, keepf is not None, tauf is not None
            ),
            BLOCK=block, num_warps=_warps(block),
        )
    return (
        gx.view(x.shape) if need_x else x.new_empty(0),
        gy.view(y.shape) if need_y else x.new_empty(0),
    )


ag.register_token_stats(_token_stats_op, _token_stats_backward_op)


# ------------------------------------------------------------------------------ entry points
def token_stats(
    x: Tensor,
    y: Tensor | None,
    tokens: Tensor | None,
    mask: Tensor | None,
    temperature: float,
    *,
    want: int,
    keep: Tensor | None = None,
    tau: Tensor | None = None,
    ignore_index: int = -100,
    check: bool = False,
    vocab_chunk: int | None = None,
) -> Tensor:
    """KL(π̃‖ρ), log π̃(token), log ρ(token), H(π̃) per position, (..., 4), in one pass of the
    Triton kernels (columns not in ``want`` hold 0; see :mod:`.autograd` for the contract).

    Shapes: x, y, keep (..., V); tokens, mask, tau (...). ``vocab_chunk`` > 0 forces the
    split-vocabulary forward with programs of that many columns. Raises ValueError where the
    kernels cannot run on the tensors' device (:func:`check_device`).
    """
    check_device(x.device)
    out, _ = _token_stats_op(
        x, y, tokens, mask, keep, tau, float(temperature), int(ignore_index), int(want),
        bool(check), 0, int(vocab_chunk or 0),
    )
    return out


def full_kl(
    x: Tensor,
    y: Tensor,
    mask: Tensor | None,
    temperature: float,
    *,
    check: bool = False,
    vocab_chunk: int | None = None,
) -> Tensor:
    """Exact KL(softmax(x/T) ‖ softmax(y/T)) per position: the KL column of :func:`token_stats`.

    The contract of :func:`.streaming.full_kl` (unchecked internal entry point);
    ``vocab_chunk`` > 0 forces the split-vocabulary forward with programs of that many columns.
    """
    return token_stats(
        x, y, None, mask, temperature, want=ag.WANT_KL, check=check, vocab_chunk=vocab_chunk
    )[..., ag.OUT_KL]


def token_logprobs(
    x: Tensor,
    tokens: Tensor,
    temperature: float,
    *,
    ignore_index: int = -100,
    check: bool = False,
    vocab_chunk: int | None = None,
) -> Tensor:
    """log softmax(x/T)[token] per position: the log-prob column of :func:`token_stats` (as
    :func:`.streaming.token_logprobs`; ``vocab_chunk`` as in :func:`full_kl`)."""
    return token_stats(
        x, None, tokens, None, temperature, want=ag.WANT_LOGP, ignore_index=ignore_index,
        check=check, vocab_chunk=vocab_chunk,
    )[..., ag.OUT_LOGP]


def entropy(
    x: Tensor,
    mask: Tensor | None,
    temperature: float,
    *,
    check: bool = False,
    vocab_chunk: int | None = None,
) -> Tensor:
    """Policy entropy H(softmax(x/T)) per position: the entropy column of :func:`token_stats`
    (as :func:`.streaming.entropy`; ``vocab_chunk`` as in :func:`full_kl`)."""
    return token_stats(
        x, None, None, mask, temperature, want=ag.WANT_ENTROPY, check=check,
        vocab_chunk=vocab_chunk,
    )[..., ag.OUT_ENTROPY]
