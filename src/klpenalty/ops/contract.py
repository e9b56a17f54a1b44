"""The op contract of every backend: the want flags, the output / stats / state columns, the
four op schemas (defined here, once), their fake implementations and autograd, and the finish
and checks that every backend's forward shares.

A backend ``<b>`` implements four ops of ``torch.ops.klpenalty`` with the schemas of
:data:`SCHEMAS` (see docs/design.md):

- ``<b>_token_stats(x, y?, tokens?, mask?, keep?, tau?, temperature, ignore_index, want, check,
  tile_rows, tile_cols, top_k, top_p, min_p, ids?, offsets?) -> (out (..., 4), stats (..., 10))``:
  KL(π̃‖ρ), log π̃(t), log ρ(t), H(π̃), the columns in ``want`` (:class:`Want`), in one read of
  the logits. Where the sampler settings cut (:func:`sampler_cuts`), the op computes their
  threshold τ_s itself, row by row (the ``sampling_threshold`` op's), and the support is
  keep ∧ x ≥ max(tau, τ_s); the τ used is the stats column ``ST_TAU``, which the backward is
  given as its ``tau``. Given an engine's kept sets ``ids`` (K,) / ``offsets`` (N + 1,) (int32
  or int64 each; row r keeps ``ids[offsets[r]:offsets[r + 1]]``), the op finds each counted
  row's τ_r, the smallest kept logit, and whether the set is exactly {x ≥ τ_r} (the
  ``support_from_ids`` op's rule), and τ_r joins the threshold (x ≥ max(tau, τ_r, τ_s)); a row
  whose set is not {x ≥ τ_r} holds NaN in ``ST_TAU`` (its out unspecified) and the checks are
  not made: the caller passes such sets another way (:func:`klpenalty.ops.dispatch.token_stats`
  passes the dense ``keep`` of :func:`keep_of_ids`). The native kernel finds τ_r in its own
  visit of the row, just before the walk; the other backends run their ``support_from_ids`` op
  first (:func:`tau_of_ids`);
- ``<b>_token_stats_backward(grad (..., 4), x, y?, tokens?, owned?, stats, mask?, keep?, tau?,
  temperature, ignore_index, want, need_x, need_y, tile_rows, tile_cols) -> (grad_x or empty,
  grad_y or empty)``; ``owned`` (...) bool or None: where False the token lies outside these
  columns (another rank's vocabulary slice), so its own entry is not added, while the dense
  −π·g/T terms of the log-prob columns are;
- ``<b>_token_stats_state(x, y?, keep?, tau?, temperature, want, tile_rows, tile_cols) ->
  (state (N, 6), careful (N,) bool)``: the engine's per-row state over these columns
  (:data:`STATE_COLS`), unfinalized, for the vocabulary-parallel merge;
- ``<b>_sampling_threshold(x, top_k, top_p, min_p, temperature) -> tau (...)``: the per-row
  threshold of top-k → top-p → min-p sampling (:func:`klpenalty.sampling.sampling_threshold`'s
  rule) in the compute dtype: −inf where nothing is cut, NaN for a row holding NaN.

:func:`define_ops` defines the four schemas for a backend name and registers the fakes (so
``torch.compile`` traces through with ``fullgraph=True``) and the autograd formula of the
forward: the first derivative is the backend's backward op; a second derivative
(``create_graph=True``) recomputes the first with differentiable PyTorch ops on (..., V)
(:func:`_token_stats_grads_differentiable`): exact, not fast.

Shape letters: N rows (positions), V vocabulary (the columns of the call).
"""

from __future__ import annotations

import math
import sys
from enum import IntFlag

import torch
from torch import Tensor

from .. import _validation as v
from .._validation import compute_dtype
from .divergence import divergence_terms

__all__ = [
    "Want",
    "OUT_COLS",
    "WANT_ALL",
    "STATS_COLS",
    "STATE_COLS",
    "SCHEMAS",
    "define_ops",
    "implement",
    "inherit",
    "masked_grad",
    "safe_tokens",
    "kept_mask",
    "kept_logits",
    "token_upstream",
    "finish",
    "finish_columns",
    "check_finished",
    "outside_support_error",
    "sampler_cuts",
    "sampler_keys",
    "combined_tau",
    "keep_of_ids",
    "check_ids_args",
    "check_compact_values",
    "tau_of_ids",
    "constant_result",
]


class Want(IntFlag):
    """Which columns of ``out`` a call computes; bit i is column i (:data:`OUT_COLS` = 4)."""

    KL = 1  # KL(π̃‖ρ), needs y
    LOGP = 2  # log π̃(token), needs tokens
    REF_LOGP = 4  # log ρ(token), needs y and tokens
    ENTROPY = 8  # H(π̃)

    def columns(self) -> list[int]:
        """The out columns of the set bits, in column order."""
        return [c for c, bit in enumerate(Want) if self & bit]


# out columns (..., 4): the column of Want bit i is i
OUT_COLS = 4
OUT_KL, OUT_LOGP, OUT_REF_LOGP, OUT_ENTROPY = range(OUT_COLS)
WANT_ALL = Want((1 << OUT_COLS) - 1)  # every column

# stats columns (..., 10) in the compute dtype: what the backward reads. Columns a call does
# not need hold 0; rows masked out hold anything (never read).
STATS_COLS = 10
(
    ST_SHIFT_X,  # finite max of the policy logits on the support (0 if none)
    ST_LOG_S_X,  # log Σ e^u
    ST_SHIFT_Y,
    ST_LOG_S_Y,
    ST_MEAN_D,  # E_π̃[u − w]
    ST_CAREFUL,  # 1.0 where the row needs the 0·log 0 arithmetic
    ST_MEAN_U,  # E_π̃[u]
    ST_LOGP,  # log π̃(t)
    ST_REF_LOGP,  # log ρ(t)
    ST_TAU,  # the support's threshold: tau, or the sampler's, or their maximum (−inf: none)
) = range(STATS_COLS)

# state columns (N, 6): the engine's unfinalized StatsState (m in logit units; sums against m)
STATE_COLS = 6
SX_M_X, SX_S_X, SX_M_Y, SX_S_Y, SX_A, SX_B = range(STATE_COLS)

# Every column constant above by name: the widths (*_COLS) and the out, stats and state columns
# (OUT_*, ST_*, SX_*), for code that takes the layouts by name (the Triton kernels, as
# constexprs of the same names). A column defined above is in it.
COLUMNS: dict[str, int] = {
    name: value for name, value in list(globals().items())
    if name.endswith("_COLS") or name.startswith(("OUT_", "ST_", "SX_"))
}

# The four schemas, "{b}" the backend's name; the C++ backend only implements them.
SCHEMAS = {
    "token_stats": (
        "{b}_token_stats(Tensor x, Tensor? y, Tensor? tokens, Tensor? mask, Tensor? keep, "
        "Tensor? tau, float temperature, int ignore_index, int want, bool check, int tile_rows, "
        "int tile_cols, int top_k, float top_p, float min_p, Tensor? ids=None, "
        "Tensor? offsets=None) -> (Tensor, Tensor)"
    ),
    "token_stats_backward": (
        "{b}_token_stats_backward(Tensor grad, Tensor x, Tensor? y, Tensor? tokens, "
        "Tensor? owned, Tensor stats, Tensor? mask, Tensor? keep, Tensor? tau, "
        "float temperature, int ignore_index, int want, bool need_x, bool need_y, "
        "int tile_rows, int tile_cols) -> (Tensor, Tensor)"
    ),
    "token_stats_state": (
        "{b}_token_stats_state(Tensor x, Tensor? y, Tensor? keep, Tensor? tau, "
        "float temperature, int want, int tile_rows, int tile_cols) -> (Tensor, Tensor)"
    ),
    "sampling_threshold": (
        "{b}_sampling_threshold(Tensor x, int top_k, float top_p, float min_p, "
        "float temperature) -> Tensor"
    ),
    # the kept-set check of an engine's (ids, offsets): per row, the smallest kept logit τ and
    # whether the set is exactly {x ≥ τ} (klpenalty.sampling.threshold_of_ids)
    "support_from_ids": (
        "{b}_support_from_ids(Tensor x, Tensor ids, Tensor offsets, int chunk_rows) "
        "-> (Tensor, Tensor)"
    ),
    # the second walk: a statistic that needs both normalisers first (ops/divergence.py), the
    # student on the support keep / tau (kept_mask; log π̃ = −inf and π·g = 0 off it)
    "divergence": (
        "{b}_divergence(Tensor x, Tensor y, Tensor stats, Tensor? mask, Tensor? keep, "
        "Tensor? tau, float temperature, int kind, float param) -> (Tensor, Tensor)"
    ),
    "divergence_backward": (
        "{b}_divergence_backward(Tensor grad, Tensor x, Tensor y, Tensor stats, Tensor gbar, "
        "Tensor? mask, Tensor? keep, Tensor? tau, float temperature, int kind, float param) "
        "-> Tensor"
    ),
}

_LIB = torch.library.Library("klpenalty", "FRAGMENT")  # noqa: TOR901 (the schemas live here)
_DEFINED: set[str] = set()


def masked_grad(grad: Tensor, mask: Tensor | None, dtype: torch.dtype) -> Tensor:
    """The upstream gradient in ``dtype``, exactly 0 where ``mask`` is False."""
    g = grad.to(dtype)
    return g if mask is None else g.masked_fill(~mask, 0.0)


def safe_tokens(tokens: Tensor, ignore_index: int) -> tuple[Tensor, Tensor]:
    """(ids usable for gather/scatter, ignored flags): ignored positions read id 0."""
    ignored = tokens == ignore_index
    return tokens.masked_fill(ignored, 0).long(), ignored


def kept_mask(x: Tensor, keep: Tensor | None, tau: Tensor | None) -> Tensor | None:
    """The support (..., V) bool of logits ``x``: kept(v) = keep[v] and x_v ≥ tau (either may
    be None; None where both are). The comparison with ``tau`` is made in the dtype of ``tau``
    (the compute dtype), as every backend does; ``x`` may be a tile of rows, ``tau`` its rows'."""
    kept = None if tau is None else x.to(tau.dtype) >= tau.unsqueeze(-1)
    if keep is not None:
        kept = keep if kept is None else kept & keep
    return kept


def kept_logits(x: Tensor, keep: Tensor | None, tau: Tensor | None) -> Tensor:
    """x with −inf outside the support (:func:`kept_mask`). Materialises (..., V) for a whole
    tensor: for the reference path and double backward only (the streaming walks call it on a
    tile)."""
    kept = kept_mask(x, keep, tau)
    return x if kept is None else torch.where(kept, x, float("-inf"))


def token_upstream(
    grad: Tensor,
    mask: Tensor | None,
    tokens: Tensor | None,
    ignore_index: int,
    want: int,
    dtype: torch.dtype,
) -> Tensor:
    """The upstream gradient (..., 4) as (N, 4) in ``dtype``: 0 in the columns not in ``want``,
    on masked rows, and in the two log-prob columns at ignored tokens."""
    g = grad.reshape(-1, OUT_COLS).to(dtype)
    # the column masks from device ops: no host-to-device copy (a stream sync on CUDA)
    bits = 1 << torch.arange(OUT_COLS, device=g.device)  # (4,): the Want bit of each column
    g = g.masked_fill((bits & int(want)) == 0, 0.0)
    if mask is not None:
        g = g.masked_fill(~mask.reshape(-1, 1), 0.0)
    if tokens is not None:
        ignored = (tokens.reshape(-1) == ignore_index).unsqueeze(-1)
        logps = (bits & int(Want.LOGP | Want.REF_LOGP)) != 0
        g = g.masked_fill(ignored & logps, 0.0)
    return g


def token_logits(
    xf: Tensor, tok: Tensor, keep: Tensor | None, tau: Tensor | None, dtype: torch.dtype
) -> Tensor:
    """(N,) policy logit at each token in ``dtype``, −inf where the token is off the support."""
    x_t = xf.gather(-1, tok.unsqueeze(-1)).squeeze(-1)
    kept = None
    if tau is not None:
        kept = x_t.to(tau.dtype) >= tau
    if keep is not None:
        at = keep.gather(-1, tok.unsqueeze(-1)).squeeze(-1)
        kept = at if kept is None else kept & at
    x_t = x_t.to(dtype)
    return x_t if kept is None else x_t.masked_fill(~kept, float("-inf"))


def token_logp(logit_t: Tensor, m: Tensor, s: Tensor, temperature: float) -> Tensor:
    """log-prob (N,) of the token: (x_t − m)/T − log s, NaN for a row without mass (s = 0)."""
    shift = torch.nan_to_num(m, nan=0.0, posinf=0.0, neginf=0.0)
    out = (logit_t - shift) / temperature - torch.log(s)
    return out.masked_fill(s == 0, float("nan"))


def outside_support_error(bad: Tensor, tokens: Tensor) -> ValueError:
    """The error for sampled tokens off the support; ``bad`` (...) bool like ``tokens``."""
    flat = bad.reshape(-1).nonzero()
    first = tuple(int(i) for i in torch.unravel_index(flat[0, 0], bad.shape)) if bad.dim() else ()
    return ValueError(
        f"sampled token {int(tokens[first])} at position {first} is outside the support "
        f"(log-prob -inf under the truncated policy; {flat.shape[0]} position(s) in all): the "
        "support must contain the token that was sampled; build it with the sampler's own "
        "top_k/top_p/min_p and temperature, or pass the sampler's kept set"
    )


def check_out(
    out: Tensor,
    x: Tensor,
    y: Tensor | None,
    tokens: Tensor | None,
    range_bad: Tensor | None,
    outside: Tensor | None,
    want: int,
    ignore_index: int,
) -> None:
    """The checks of ``check=True`` with one host read: token range, NaN in a counted row's
    wanted outputs, sampled tokens off the support (in this order)."""
    nan_rows = out[:, Want(want).columns()].isnan().any(-1)  # (N,); masked rows hold 0
    flags = [nan_rows.any()]
    flags += [t.any() for t in (range_bad, outside) if t is not None]
    found = torch.stack(flags).tolist()  # the one host read
    if range_bad is not None and found[1]:
        v.check_token_range(tokens, x.shape[-1], ignore_index)
    if found[0]:
        named = {"logits": x} if y is None else {"policy_logits": x, "ref_logits": y}
        v.raise_if_nan(torch.where(nan_rows, float("nan"), 0.0), named)
    if outside is not None and found[-1]:
        raise outside_support_error(outside.reshape(tokens.shape), tokens)


def finish(
    x: Tensor,
    y: Tensor | None,
    xf: Tensor,
    yf: Tensor | None,
    tokens: Tensor | None,
    mask: Tensor | None,
    keep: Tensor | None,
    tau: Tensor | None,
    keep_rows: Tensor | None,
    tau_rows: Tensor | None,
    state,
    kl: Tensor | None,
    h: Tensor | None,
    stats: Tensor,
    temperature: float,
    ignore_index: int,
    want: int,
    check: bool,
) -> tuple[Tensor, Tensor]:
    """out (..., 4) and stats (..., 10) of the token_stats op from a backend's merged row state:
    the KL and entropy columns, the sampled tokens' log-probs (a gather of N logits), the
    threshold used (``ST_TAU``), masked rows zeroed, and every check with one host read.

    Args:
        x, y: the op's (..., V) inputs; xf, yf: their (N, V) rows (yf None when not read).
        tokens, mask, keep, tau: the op's inputs; keep_rows (N, V) bool, tau_rows (N,): the
            support as rows (None where not given).
        state: the merged :class:`.engine.StatsState` (N,); kl, h, stats: its finalize.
    """
    leading, vocab = x.shape[:-1], x.shape[-1]
    range_bad = ignored = None
    logits_t = {}
    if tokens is not None and want & (Want.LOGP | Want.REF_LOGP):
        tok, ignored = safe_tokens(tokens.reshape(-1), ignore_index)  # (N,)
        if check:  # gather safely; the range error is raised below, with the other checks
            range_bad = (tok < 0) | (tok >= vocab)
            tok = tok.masked_fill(range_bad, 0)
        if want & Want.LOGP:
            logits_t[Want.LOGP] = token_logits(xf, tok, keep_rows, tau_rows, stats.dtype)
        if want & Want.REF_LOGP:
            y_t = yf.gather(-1, tok.unsqueeze(-1)).squeeze(-1)
            logits_t[Want.REF_LOGP] = y_t.to(stats.dtype)
    out = finish_columns(state, kl, h, stats, logits_t, ignored, temperature, tau_rows, mask)
    if check:  # one host read for all the checks
        check_finished(out, x, y, tokens, keep, tau, want, ignore_index, range_bad)
    return out.reshape(*leading, OUT_COLS), stats.reshape(*leading, STATS_COLS)


def finish_columns(
    state,
    kl: Tensor | None,
    h: Tensor | None,
    stats: Tensor,
    logits_t: dict,
    ignored: Tensor | None,
    temperature: float,
    tau_rows: Tensor | None,
    mask: Tensor | None,
) -> Tensor:
    """out (N, 4) of a merged row state (:class:`.engine.StatsState`) and its finalize
    (``kl``, ``h``, ``stats`` (N, 10)), shared by :func:`finish` and the vocabulary-parallel
    merge: the KL and entropy columns; each token log-prob from the token's logit
    (``logits_t``: Want.LOGP -> x_t (N,), Want.REF_LOGP -> y_t, the columns wanted) against the
    state's shift and sum (:func:`token_logp`), 0 at ``ignored`` tokens, also written into its
    stats column; the threshold used ``tau_rows`` (N,) (None: −inf) into ``ST_TAU``; rows
    where ``mask`` (N,) is False zeroed."""
    out = stats.new_zeros(stats.shape[0], OUT_COLS)
    stats[:, ST_TAU] = -float("inf") if tau_rows is None else tau_rows
    if kl is not None:
        out[:, OUT_KL] = kl
    if h is not None:
        out[:, OUT_ENTROPY] = h
    for bit, col, st_col, m, s in (
        (Want.LOGP, OUT_LOGP, ST_LOGP, state.m_x, state.s_x),
        (Want.REF_LOGP, OUT_REF_LOGP, ST_REF_LOGP, state.m_y, state.s_y),
    ):
        if bit in logits_t:
            lp = token_logp(logits_t[bit], m, s, temperature).masked_fill(ignored, 0.0)
            out[:, col] = stats[:, st_col] = lp
    if mask is not None:
        out.masked_fill_(~mask.reshape(-1, 1), 0.0)
    return out


def check_finished(
    out: Tensor,
    x: Tensor,
    y: Tensor | None,
    tokens: Tensor | None,
    keep: Tensor | None,
    tau: Tensor | None,
    want: int,
    ignore_index: int,
    range_bad: Tensor | None = None,
) -> None:
    """The checks of ``check=True`` on a finished out (N, 4) (masked rows 0), with one host
    read (:func:`check_out`); ``range_bad`` (N,) the tokens outside [0, V) (computed from
    ``tokens`` when None)."""
    logp = bool(want & Want.LOGP)
    if range_bad is None and tokens is not None and (logp or want & Want.REF_LOGP):
        tok, _ = safe_tokens(tokens.reshape(-1), ignore_index)
        range_bad = (tok < 0) | (tok >= x.shape[-1])
    outside = None
    if (keep is not None or tau is not None) and logp:
        outside = torch.isneginf(out[:, OUT_LOGP])  # counted, non-ignored, off the support
    check_out(out, x, y, tokens, range_bad, outside, want, ignore_index)


def _grad_like(x: Tensor) -> Tensor:
    """Fake gradient of ``x``: its shape and dtype, contiguous."""
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _token_stats_grads_differentiable(
    grad: Tensor,
    x: Tensor,
    y: Tensor | None,
    tokens: Tensor | None,
    mask: Tensor | None,
    keep: Tensor | None,
    tau: Tensor | None,
    temperature: float,
    ignore_index: int,
    want: int,
) -> tuple[Tensor, Tensor | None]:
    """∂/∂x and ∂/∂y of Σ grad·out with differentiable ops on (..., V) (double backward).

    With p = π̃, q = ρ (log-probs lp, lq), KL, H and onehot(t):
    ∂/∂x = p·[g_kl·((lp − lq) − KL) − g_lp − g_h·(lp + H)]/T + onehot·g_lp/T,
    ∂/∂y = [g_kl·(q − p) + g_rl·(onehot − q)]/T. ∂/∂x is 0 off the support; for a sampled
    token off the support (``check=False``, log π̃(t) = −inf) the onehot term is dropped: the
    limit x_t → −inf of the untruncated derivative, as the backends' first derivative gives.
    """
    dtype = compute_dtype(x) if y is None else compute_dtype(x, y)
    g = masked_grad(grad, None if mask is None else mask.unsqueeze(-1), dtype)  # (..., 4)
    g_kl, g_lp, g_rl, g_h = (
        g[..., c] if want & bit else torch.zeros_like(g[..., c]) for c, bit in enumerate(Want)
    )
    xs = kept_logits(x.to(dtype), keep, tau) / temperature
    ys = None if y is None else y.to(dtype) / temperature
    if mask is not None:  # masked rows may hold garbage (all −inf): keep it out of the graph
        keep_rows = mask.unsqueeze(-1)
        xs = torch.where(keep_rows, xs, 0.0)
        ys = None if ys is None else torch.where(keep_rows, ys, 0.0)
    lp = torch.log_softmax(xs, -1)
    p = lp.exp()
    live = p > 0  # 0·log 0 = 0, with no NaN in the unused branch's gradient either
    lp0 = torch.where(live, lp, 0.0)
    onehot = onehot_x = torch.zeros_like(p)
    if tokens is not None:
        tok, ignored = safe_tokens(tokens, ignore_index)
        onehot = onehot.scatter(-1, tok.unsqueeze(-1), 1.0)
        g_lp, g_rl = g_lp.masked_fill(ignored, 0.0), g_rl.masked_fill(ignored, 0.0)
        # a token off the support (check=False): log π̃(t) = −inf; its derivative is taken as
        # the limit x_t → −inf of the untruncated one, −π̃·g/T (0 at the token itself), as the
        # backends' first derivative gives it
        off = torch.isneginf(xs.detach().gather(-1, tok.unsqueeze(-1)))
        onehot_x = onehot.masked_fill(off, 0.0)
    inner = -g_lp.unsqueeze(-1) - g_h.unsqueeze(-1) * (lp0 + (-(p * lp0).sum(-1, keepdim=True)))
    grad_y = None
    if ys is not None:
        lq = torch.log_softmax(ys, -1)
        q = lq.exp()
        diff = lp0 - torch.where(live, lq, 0.0)
        kl = (p * diff).sum(-1, keepdim=True)
        inner = inner + g_kl.unsqueeze(-1) * (diff - kl)
        grad_y = (g_kl.unsqueeze(-1) * (q - p) + g_rl.unsqueeze(-1) * (onehot - q)) / temperature
        grad_y = grad_y.to(y.dtype)
    grad_x = (p * inner + onehot_x * g_lp.unsqueeze(-1)) / temperature
    return grad_x.to(x.dtype), grad_y


def constant_result(fn):
    """``torch.compiler.assume_constant_result`` without importing ``torch._dynamo`` (about a
    second of CPU at every ``import klpenalty``) when nothing has imported it yet: the mark is
    the attribute that decorator sets (``tests/ops/test_contract.py`` checks they agree)."""
    if "torch._dynamo" in sys.modules:
        return torch.compiler.assume_constant_result(fn)
    fn._dynamo_marked_constant = True
    return fn


def sampler_cuts(vocab: int, top_k: int, top_p: float, min_p: float) -> bool:
    """Whether the op arguments ``top_k`` / ``top_p`` / ``min_p`` cut anything at ``vocab``
    columns: 1 ≤ top_k < V, top_p < 1, min_p > 0 (top_k = 0, top_p = 1, min_p = 0: unused)."""
    return 0 < top_k < vocab or top_p < 1.0 or min_p > 0.0


def sampler_keys(x: Tensor, temperature: float) -> Tensor:
    """The sampler's keys of logits ``x`` (...): x/T as the sampler rule of
    :mod:`klpenalty.sampling` rounds it, the IEEE quotient of x in the compute dtype by T in
    that dtype (float32(T) for float32, bf16 and fp16 logits). The divisor is a 0-dim tensor on
    x's device: a true division on every device (torch multiplies by a rounded reciprocal for a
    Python-number divisor on CUDA, which differs at one ulp)."""
    xc = x.to(compute_dtype(x))
    if temperature == 1.0:
        return xc
    return xc / torch.full((), temperature, dtype=xc.dtype, device=xc.device)


def check_sampler_args(top_k: int, top_p: float, min_p: float, temperature: float) -> None:
    """The op arguments of the sampler, checked by every backend's forward and threshold ops:
    top_k ≥ 0 (0: unused), top_p in (0, 1], min_p in [0, 1], temperature > 0 (ValueError /
    TypeError naming the argument)."""
    if top_k:
        v.check_top_k(top_k)
    elif top_k != 0:
        raise ValueError(f"top_k must be 0 (unused) or an int >= 1, got {top_k}")
    v.check_top_p(top_p)
    v.check_min_p(min_p)
    v.check_temperature(temperature)


def keep_of_ids(shape, ids: Tensor, offsets: Tensor) -> Tensor:
    """The dense bool kept set (..., V) of ``shape`` of compact kept sets (validated; row r
    keeps ``ids[offsets[r]:offsets[r + 1]]``): one write of True at the flat positions
    row·V + id. N·V bytes: the price of sets that no threshold describes."""
    n, vocab = math.prod(shape[:-1]), shape[-1]
    counts = (offsets[1:] - offsets[:-1]).long()  # (N,); repeat_interleave takes int32/64
    rows = torch.repeat_interleave(
        torch.arange(n, device=ids.device), counts, output_size=ids.shape[0]
    )  # (K,)
    keep = torch.zeros(n * vocab, dtype=torch.bool, device=ids.device)
    keep[rows * vocab + ids.long()] = True
    return keep.reshape(shape)


def check_ids_args(ids: Tensor | None, offsets: Tensor | None) -> None:
    """The op arguments ``ids`` / ``offsets``: both or neither, int32 or int64 each (TypeError
    naming the argument and its dtype); their values are the support_from_ids op's to check."""
    if (ids is None) != (offsets is None):
        raise ValueError(
            "support ids and offsets must be given together (or neither), got "
            + ("ids alone" if offsets is None else "offsets alone")
        )
    for name, t in (("ids", ids), ("offsets", offsets)):
        if t is not None and t.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"support {name} must be int32 or int64, got {v.describe(t)}")


def check_compact_values(ids: Tensor, offsets: Tensor, vocab: int) -> None:
    """The values of a compact support of the right shapes: offsets from 0 to len(ids),
    non-decreasing, ids in [0, vocab) (one sync). The native forward makes the same checks,
    with the same messages, on int32/int64 sets (csrc/ids.h); the other backends' forward
    through :func:`tau_of_ids`."""
    n = offsets.shape[0] - 1
    k = ids.shape[0]
    first, last = (int(t) for t in offsets[[0, -1]].tolist())
    if first != 0 or last != k:
        raise ValueError(
            f"support offsets must start at 0 and end at len(ids) = {k}, got {first} and "
            f"{last} ({v.describe(offsets)})"
        )
    if n and bool((offsets[1:] < offsets[:-1]).any()):
        raise ValueError(f"support offsets must be non-decreasing ({v.describe(offsets)})")
    if k:
        lo, hi = (int(t) for t in torch.aminmax(ids))  # one read of the ids
        if lo < 0 or hi >= vocab:
            raise ValueError(f"support ids must lie in [0, {vocab}) ({v.describe(ids)})")


def tau_of_ids(
    backend: str, x: Tensor, mask: Tensor | None, tau: Tensor | None, ids: Tensor | None,
    offsets: Tensor | None, check: bool,
) -> tuple[Tensor | None, bool]:
    """The forward's threshold and ``check`` given the kept sets ``ids`` / ``offsets`` (None:
    ``(tau, check)`` as given), for a backend without a fused form: its ``support_from_ids``
    op first, then max(tau, τ_r) with NaN in the rows whose set is not {x ≥ τ_r} (their
    support is empty, their ``ST_TAU`` NaN), and ``check`` False where such a row counts (the
    checks are not made: the caller passes those sets another way). One host read when
    ``check`` is True."""
    check_ids_args(ids, offsets)
    if ids is None:
        return tau, check
    check_compact_values(ids, offsets, x.shape[-1])
    op = getattr(torch.ops.klpenalty, f"{backend}_support_from_ids").default
    tau_ids, exact = op(x.detach(), ids, offsets, 0)  # (N,) each
    leading = x.shape[:-1]
    tau_ids, exact = tau_ids.reshape(leading), exact.reshape(leading)
    if check:
        check = bool((exact if mask is None else exact | ~mask).all())
    tau_ids = tau_ids.masked_fill(~exact, float("nan"))
    return (tau_ids if tau is None else torch.maximum(tau.to(tau_ids.dtype), tau_ids)), check


def combined_tau(tau: Tensor | None, tau_s: Tensor | None) -> Tensor | None:
    """The threshold of both supports x ≥ tau and x ≥ tau_s (either may be None): their
    maximum, NaN where either is NaN."""
    if tau is None or tau_s is None:
        return tau_s if tau is None else tau
    return torch.maximum(tau.reshape(tau_s.shape).to(tau_s.dtype), tau_s)


def op_name(backend: str, op: str) -> str:
    """The qualified name ``klpenalty::<backend>_<op>`` of one of a backend's ops."""
    return f"klpenalty::{backend}_{op}"


def define_ops(backend: str) -> None:
    """Define the four ops of ``backend`` from :data:`SCHEMAS` (once per process), with their
    fakes and the forward's autograd. The backend registers its implementations after."""
    if backend in _DEFINED:
        return
    _DEFINED.add(backend)
    for schema in SCHEMAS.values():
        _LIB.define(schema.format(b=backend))
    fwd, bwd, state, threshold, support, div, div_bwd = (op_name(backend, op) for op in SCHEMAS)

    @torch.library.register_fake(fwd)
    def _(x, y, tokens, mask, keep, tau, temperature, ignore_index, want, check, tr, tc, top_k,
          top_p, min_p, ids=None, offsets=None):
        dtype = compute_dtype(x) if y is None else compute_dtype(x, y)
        leading = x.shape[:-1]
        return (
            x.new_empty((*leading, OUT_COLS), dtype=dtype),
            x.new_empty((*leading, STATS_COLS), dtype=dtype),
        )

    @torch.library.register_fake(bwd)
    def _(grad, x, y, tokens, owned, stats, mask, keep, tau, temperature, ii, want, need_x,
          need_y, tr, tc):
        gx = _grad_like(x) if need_x else x.new_empty(0)
        gy = _grad_like(y) if (need_y and y is not None) else x.new_empty(0)
        return gx, gy

    @torch.library.register_fake(state)
    def _(x, y, keep, tau, temperature, want, tr, tc):
        dtype = compute_dtype(x) if y is None else compute_dtype(x, y)
        n = x.numel() // x.shape[-1] if x.shape[-1] else 0
        return x.new_empty((n, STATE_COLS), dtype=dtype), x.new_empty(n, dtype=torch.bool)

    @torch.library.register_fake(threshold)
    def _(x, top_k, top_p, min_p, temperature):
        return x.new_empty(x.shape[:-1], dtype=compute_dtype(x))

    @torch.library.register_fake(support)
    def _(x, ids, offsets, chunk_rows):
        n = offsets.shape[0] - 1
        return x.new_empty(n, dtype=compute_dtype(x)), x.new_empty(n, dtype=torch.bool)

    def setup_context(ctx, inputs, output):
        x, y, tokens, mask, keep, tau, temperature, ignore_index, want, _, tr, tc = inputs[:12]
        ids = inputs[15] if len(inputs) > 15 else None
        if ids is not None or sampler_cuts(x.shape[-1], *inputs[12:15]):
            tau = output[1][..., ST_TAU]  # the backward's support: the τ used
        ctx.save_for_backward(x, y, tokens, mask, keep, tau, output[1])
        ctx.args = (temperature, ignore_index, want, tr, tc)

    bwd_op = None

    def backward(ctx, grad_out, _grad_stats):
        nonlocal bwd_op
        x, y, tokens, mask, keep, tau, stats = ctx.saved_tensors
        temperature, ignore_index, want, tr, tc = ctx.args
        need_x = ctx.needs_input_grad[0]
        need_y = y is not None and ctx.needs_input_grad[1]
        if torch.is_grad_enabled():  # create_graph=True: a differentiable first derivative
            gx, gy = _token_stats_grads_differentiable(
                grad_out, x, y, tokens, mask, keep, tau, temperature, ignore_index, want
            )
        else:
            if bwd_op is None:
                bwd_op = getattr(torch.ops.klpenalty, f"{backend}_token_stats_backward").default
            gx, gy = bwd_op(
                grad_out, x, y, tokens, None, stats, mask, keep, tau, temperature,
                ignore_index, want, need_x, need_y, tr, tc,
            )
        return (gx if need_x else None, gy if need_y else None, *([None] * 15))

    torch.library.register_autograd(fwd, backward, setup_context=setup_context)
    _define_divergence(backend, div, div_bwd)


def _define_divergence(backend: str, div: str, div_bwd: str) -> None:
    """The fakes and autograd of the second walk (``<b>_divergence``): value and ḡ (...) in the
    compute dtype; the gradient reaches x only (the teacher y and the stats are constants: the
    backward's formula holds the normalisers' derivative), and ``gbar`` is not differentiable."""

    @torch.library.register_fake(div)
    def _(x, y, stats, mask, keep, tau, temperature, kind, param):
        leading = x.shape[:-1]
        dtype = compute_dtype(x, y)
        return x.new_empty(leading, dtype=dtype), x.new_empty(leading, dtype=dtype)

    @torch.library.register_fake(div_bwd)
    def _(grad, x, y, stats, gbar, mask, keep, tau, temperature, kind, param):
        return _grad_like(x)

    def setup_context(ctx, inputs, output):
        x, y, stats, mask, keep, tau, temperature, kind, param = inputs
        ctx.save_for_backward(x, y, stats, output[1], mask, keep, tau)
        ctx.args = (temperature, kind, param)

    bwd_op = None

    def backward(ctx, grad_value, _grad_gbar):
        nonlocal bwd_op
        x, y, stats, gbar, mask, keep, tau = ctx.saved_tensors
        temperature, kind, param = ctx.args
        if not ctx.needs_input_grad[0] or grad_value is None:
            return (None,) * 9
        if torch.is_grad_enabled():  # create_graph=True: a differentiable first derivative
            gx = _divergence_grad_differentiable(grad_value, x, y, mask, keep, tau, temperature,
                                                 kind, param)
        else:
            if bwd_op is None:
                bwd_op = getattr(torch.ops.klpenalty, f"{backend}_divergence_backward").default
            gx = bwd_op(grad_value, x, y, stats, gbar, mask, keep, tau, temperature, kind, param)
        return (gx, *([None] * 8))

    torch.library.register_autograd(div, backward, setup_context=setup_context)


def _divergence_grad_differentiable(grad, x, y, mask, keep, tau, temperature, kind,
                                    param) -> Tensor:
    """∂/∂x of Σ grad·divergence with differentiable ops on (..., V) (double backward): the
    autograd of the kind's terms (:func:`.divergence.divergence_terms`) on log_softmax of the
    student on its support (:func:`kept_logits`); the entries off it are constants (−inf), so
    nothing flows through them."""
    dtype = compute_dtype(x, y)
    with torch.enable_grad():
        kept = kept_mask(x.detach(), keep, tau)
        xs = x.to(dtype) / temperature
        if kept is not None:
            xs = torch.where(kept, xs, float("-inf"))
        ys = y.detach().to(dtype) / temperature
        if mask is not None:  # masked rows may hold garbage: keep it out of the graph
            xs = torch.where(mask.unsqueeze(-1), xs, 0.0)
            ys = torch.where(mask.unsqueeze(-1), ys, 0.0)
        lp = torch.log_softmax(xs, -1)
        if kept is not None:  # off the support lp = −inf, a constant (no 0·inf in the graph)
            lp = torch.where(kept, lp, lp.detach())
        f, _ = divergence_terms(lp, torch.log_softmax(ys, -1), kind, param)
        g = masked_grad(grad, mask, dtype)
        (gx,) = torch.autograd.grad((f.sum(-1) * g).sum(), x, create_graph=True)
    return gx


def inherit(backend: str, key: str, source: str, *ops: str) -> None:
    """Register, for ``backend`` and the dispatch ``key``, the implementations of ``source``
    (another backend's) for ``ops``: a backend without a kernel of its own for an op runs that
    backend's (looked up at the call, so the source may register after)."""
    for op in ops:
        def run(*args, _op=op):
            return getattr(torch.ops.klpenalty, f"{source}_{_op}").default(*args)

        _LIB.impl(op_name(backend, op).split("::")[1], run, key)


def implement(backend: str, key: str, **impls) -> None:
    """Register ``backend``'s implementations of its ops for the dispatch ``key`` (a device
    type such as ``"CPU"``/``"CUDA"``, or ``"CompositeExplicitAutograd"`` for any device):
    ``token_stats=``, ``token_stats_backward=``, ``token_stats_state=``,
    ``sampling_threshold=`` (plain functions with the schemas' arguments)."""
    for op, fn in impls.items():
        _LIB.impl(op_name(backend, op).split("::")[1], fn, key)
