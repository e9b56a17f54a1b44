"""Triton backend (CUDA tensors; CPU tensors under ``TRITON_INTERPRET=1``): the engine's per-row
state in fused GPU kernels.

The kernels live in :mod:`._triton_jit`, imported at the first call (Triton is an optional
dependency: ``pip install 'klpenalty[triton]'``; this module imports without it).

The three ops of :mod:`.contract`, ``klpenalty::triton_token_stats``, ``_backward`` and
``_state``, compute every per-token statistic — KL(π̃‖ρ), log π̃(token), log ρ(token), H(π̃) —
in one read of the logits.

**Forward.** One kernel (:func:`._triton_jit.stats_kernel`) specialised by ``tl.constexpr``
flags (the policy's state, the reference's, the KL moment a, the entropy moment b, a support
by keep mask and/or threshold tau). Program (row, split) walks its columns in ``BLOCK``
chunks, reads each logit once in its own dtype (bf16/fp16/fp32), keeps the engine's state in
float32 — maxima in logit units, s_x = Σ e^u over the support, s_y = Σ e^w,
a = Σ e^u·(u − w), b = Σ e^u·u — and rescales it when a block raises a max (the engine's
merge). It writes its partial state to an (N, splits, 6) float32 buffer; the splits of a row
are merged with the engine's rescale-and-add in torch, and the (N,) merged state is finalized
by :func:`.engine.stats_finalize`, so the numerics and the stats columns are the engine's. log π̃(t) and log ρ(t) come from the merged state and the
token's logit (one gather per row). One split per row unless the rows are too few to fill the
GPU (:func:`split_columns`); ``tile_cols`` forces the split. Float64 inputs run the streaming
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
import torch
from torch import Tensor

from .. import _validation as v
from . import contract, streaming
from .contract import Want
from .engine import StatsState, state_to_tensor, stats_finalize, stats_rescale

__all__ = [
    "available",
    "interpreted",
    "check_device",
    "split_columns",
    "forward_constexprs",
    "backward_constexprs",
    "column_constexprs",
    "MAX_BLOCK",
    "INSTALL_HINT",
]

# Columns per forward/backward block: 4096 bf16 = 8 KiB per row and model per step.
MAX_BLOCK = 4096
# Programs per SM the forward wants before it splits rows across programs.
PROGRAMS_PER_SM = 4
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


def _wanted(want: int) -> tuple[bool, bool, bool, bool]:
    """(kl, logp, ref_logp, entropy): the outputs asked for by the ``want`` bits."""
    return tuple(bool(want & bit) for bit in Want)


def column_constexprs(kernel: str) -> dict[str, int]:
    """The column layout of :mod:`.contract` as the ``tl.constexpr`` s of a kernel
    (``"stats"``: the state columns; ``"grad"``: the out and stats columns)."""
    if kernel == "stats":
        names = ("STATE_COLS", "SX_M_X", "SX_S_X", "SX_M_Y", "SX_S_Y", "SX_A", "SX_B")
    else:
        names = ("OUT_COLS", "STATS_COLS", "ST_SHIFT_X", "ST_LOG_S_X", "ST_SHIFT_Y",
                 "ST_LOG_S_Y", "ST_MEAN_D", "ST_MEAN_U")
    return {name: getattr(contract, name) for name in names}


def forward_constexprs(flags, has_keep: bool, has_tau: bool) -> dict[str, bool]:
    """The ``tl.constexpr`` flags of :func:`._triton_jit.stats_kernel` for the wanted outputs
    ``flags`` = (kl, logp, ref_logp, entropy) (:func:`_wanted`) and the support."""
    kl, logp, ref_logp, ent = flags
    return dict(
        X_STATE=kl or logp or ent, Y_STATE=kl or ref_logp, MOMENT_A=kl, MOMENT_B=ent,
        HAS_KEEP=has_keep, HAS_TAU=has_tau,
    )


def backward_constexprs(
    flags, need_x: bool, need_y: bool, has_keep: bool, has_tau: bool
) -> dict[str, bool]:
    """The ``tl.constexpr`` flags of :func:`._triton_jit.grad_kernel` (as
    :func:`forward_constexprs`; ``need_x``/``need_y``: the gradients written)."""
    kl, logp, ref_logp, ent = flags
    return dict(
        KL=kl, LOGP=logp, REF_LOGP=ref_logp, ENTROPY=ent, NEED_X=need_x, NEED_Y=need_y,
        NEED_P=(need_x and (kl or logp or ent)) or (need_y and kl),
        NEED_Q=need_y or (need_x and kl), HAS_TOKEN=logp or ref_logp,
        HAS_KEEP=has_keep, HAS_TAU=has_tau,
    )


def _support_args(keep: Tensor | None, tau: Tensor | None, n: int):
    """(keep rows (N, V) as uint8 or None, their row stride, tau (N,) or None)."""
    keepf = _rows(keep).view(torch.uint8) if keep is not None else None
    tauf = tau.reshape(n).contiguous() if tau is not None else None
    return keepf, (keepf.stride(0) if keepf is not None else 0), tauf


def _forward_state(xf, yf, keepf, stride_keep, tauf, flags, temperature: float, vocab_chunk: int):
    """Run :func:`._triton_jit.stats_kernel` over (N, splits) programs; the merged
    :class:`.engine.StatsState` of whole rows (fields not computed are None)."""
    kl, logp, ref_logp, ent = flags
    n, vocab = xf.shape
    device = xf.device
    block, cols = split_columns(n, vocab, device, vocab_chunk)
    splits = max(1, -(-vocab // cols))
    parts = torch.empty((n, splits, contract.STATE_COLS), dtype=torch.float32, device=device)
    constexprs = forward_constexprs(flags, keepf is not None, tauf is not None)
    if n:
        inv_t = 1.0 / temperature
        _kernels().stats_kernel[(n, splits)](
            xf, xf if yf is None else yf, xf if keepf is None else keepf,
            parts if tauf is None else tauf, parts,
            xf.stride(0), 0 if yf is None else yf.stride(0), stride_keep,
            vocab, cols, splits, inv_t, inv_t * 1.4426950408889634,
            **constexprs, **column_constexprs("stats"), BLOCK=block, num_warps=_warps(block),
        )
    m_x, s_x, m_y, s_y, a, b = parts.unbind(-1)  # (N, splits) each
    has_y = constexprs["Y_STATE"]
    state = StatsState(m_x, s_x, b if ent else None, m_y if has_y else None,
                       s_y if has_y else None, a if kl else None)
    if splits > 1:  # the engine's merge: rescale to the common maxima, then a sum
        big_y = m_y.amax(1, keepdim=True) if has_y else None
        state = stats_rescale(state, m_x.amax(1, keepdim=True), big_y, temperature)
        state = StatsState(*(None if f is None else f.sum(1) for f in state))._replace(
            m_x=state.m_x[:, 0], m_y=None if big_y is None else state.m_y[:, 0]
        )
    else:
        state = StatsState(*(None if f is None else f[:, 0] for f in state))
    return state


contract.define_ops("triton")


def _rows_state(x, y, keep, tau, temperature: float, want: int, tile_cols: int):
    """(xf, yf, keep rows as uint8, tau rows, merged state) of (..., V) logits: the forward
    kernel over (N, splits) programs and the merge of the splits."""
    flags = kl, _, ref_logp, _ = _wanted(want)
    xf = _rows(x)  # (N, V)
    yf = _rows(y) if kl or ref_logp else None  # (N, V)
    keepf, stride_keep, tauf = _support_args(keep, tau, xf.shape[0])
    state = _forward_state(xf, yf, keepf, stride_keep, tauf, flags, temperature, tile_cols)
    return xf, yf, keepf, tauf, state


def _token_stats_state_op(x, y, keep, tau, temperature, want, tile_rows, tile_cols):
    """The unfinalized state (N, 6) of (..., V) logits over these columns and (N,) careful
    flags (the state op of :mod:`.contract`), from the forward kernel."""
    if _portable(x, y):
        return streaming.token_stats_state_op(
            x, y, keep, tau, temperature, want, tile_rows, tile_cols
        )
    xf, _, _, _, state = _rows_state(x, y, keep, tau, temperature, want, tile_cols)
    return state_to_tensor(state), torch.zeros(xf.shape[0], dtype=torch.bool, device=x.device)


def _token_stats_op(  # the schema: contract.SCHEMAS["token_stats"]
    x, y, tokens, mask, keep, tau, temperature, ignore_index, want, check, tile_rows,
    tile_cols,
):
    """(..., V) logits → out (..., 4) = (KL(π̃‖ρ), log π̃(t), log ρ(t), H(π̃)) and stats (..., 9)
    (the forward op of :mod:`.contract`), in one read of each logit; ``tile_cols`` > 0 forces
    the split width (``tile_rows`` is unused: one program per row)."""
    if _portable(x, y):
        return streaming.token_stats_op(
            x, y, tokens, mask, keep, tau, temperature, ignore_index, want, check, tile_rows,
            tile_cols,
        )
    v.check_want(want, y is not None, tokens is not None)
    xf, yf, keepf, tauf, state = _rows_state(x, y, keep, tau, temperature, want, tile_cols)
    kl_val, h, stats = stats_finalize(state, None)  # (N,), (N,), (N, 9)
    keep_rows = None if keepf is None else keepf.view(torch.bool)
    return contract.finish(
        x, y, xf, yf, tokens, mask, keep, tau, keep_rows, tauf, state, kl_val, h, stats,
        temperature, ignore_index, want, check,
    )


def _token_stats_backward_op(  # the schema: contract.SCHEMAS["token_stats_backward"]
    grad, x, y, tokens, owned, stats, mask, keep, tau, temperature, ignore_index, want,
    need_x, need_y, tile_rows, tile_cols,
):
    """∂/∂x (..., V) and ∂/∂y (..., V) of Σ grad·out (grad (..., 4)) in one read of the
    logits, in their dtypes (an empty tensor for one that is not needed); the backward op of
    :mod:`.contract` (where ``owned`` is False the token's own entry is not added)."""
    if _portable(x, y):
        return streaming.token_stats_backward_op(
            grad, x, y, tokens, owned, stats, mask, keep, tau, temperature, ignore_index, want,
            need_x, need_y, tile_rows, tile_cols,
        )
    flags = kl, logp, ref_logp, ent = _wanted(want)
    need_y = need_y and y is not None
    xf = _rows(x)  # (N, V)
    n, vocab = xf.shape
    yf = _rows(y) if (kl or ref_logp) and y is not None else None  # (N, V)
    st = stats.reshape(n, contract.STATS_COLS).contiguous()  # (N, 9)
    g = contract.token_upstream(grad, mask, tokens, ignore_index, want, st.dtype)  # (N, 4)
    tok = None
    at_tok = st.new_zeros(n, 2)
    if logp or ref_logp:
        tok, _ = contract.safe_tokens(tokens.reshape(-1), ignore_index)
        if owned is not None:  # a token in another rank's columns: no entry of its own here
            tok = tok.masked_fill(~owned.reshape(-1), -1)
        lp, lq = st[:, contract.ST_LOGP], st[:, contract.ST_REF_LOGP]
        # at the token: (1 − p_t)·g = −expm1(log p_t)·g, exact for p_t near 1; 0 for a token
        # off the support (its logit, fixed at −inf by keep/tau, does not move log π̃(t))
        at_tok = torch.stack([-torch.expm1(lp) * g[:, 1], -torch.expm1(lq) * g[:, 2]], -1)
        at_tok[:, 0] = at_tok[:, 0].masked_fill(torch.isneginf(lp), 0.0)
        at_tok = torch.where(g[:, 1:3] != 0, at_tok, 0.0)
    gx = torch.empty((n, vocab), dtype=x.dtype, device=x.device) if need_x else None
    gy = None
    if need_y:  # a reference not in any wanted output gets a zero gradient
        gy = (torch.empty if yf is not None else torch.zeros)((n, vocab), dtype=y.dtype,
                                                               device=x.device)
    write_y = need_y and yf is not None
    if n and (need_x or write_y):
        keepf, stride_keep, tauf = _support_args(keep, tau, n)
        block = _block(vocab, 1024)
        inv_t = 1.0 / temperature
        _kernels().grad_kernel[(n, -(-vocab // (block * GRAD_TILES)))](
            xf, xf if yf is None else yf, xf if keepf is None else keepf,
            st if tauf is None else tauf, gx if need_x else st, gy if write_y else st,
            st, g.contiguous(), st if tok is None else tok, at_tok.contiguous(),
            xf.stride(0), 0 if yf is None else yf.stride(0), stride_keep,
            vocab, inv_t, inv_t * 1.4426950408889634,
            **backward_constexprs(flags, need_x, write_y, keepf is not None, tauf is not None),
            **column_constexprs("grad"), BLOCK=block, TILES=GRAD_TILES, num_warps=_warps(block),
        )
    return (
        gx.view(x.shape) if need_x else x.new_empty(0),
        gy.view(y.shape) if need_y else x.new_empty(0),
    )


contract.implement(
    "triton", "CompositeExplicitAutograd", token_stats=_token_stats_op,
    token_stats_backward=_token_stats_backward_op, token_stats_state=_token_stats_state_op,
)
