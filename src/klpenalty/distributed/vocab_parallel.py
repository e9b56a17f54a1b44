"""Vocabulary-parallel per-token statistics on the backends' ops.

Every rank holds the same positions and a contiguous slice of the vocabulary; see the package
docstring for the layout and the communication per call. Each rank runs the selected backend's
state op (:mod:`klpenalty.ops.contract`) on its slice; the merge is an all-reduce MAX of the
maxima, then an all-reduce SUM of the states rescaled to them (:func:`.engine.stats_rescale`)
and of the token terms; the finalize is the engine's (:func:`.engine.stats_finalize`). The
backward is the backend's own backward op on the slice, fed the global stats, with the
``owned`` input False where the token lies in another rank's slice. The configuration check
lives in :mod:`._config`.

Shape letters: N rows (positions), V_r this rank's vocabulary slice, V the whole vocabulary.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from .. import _validation as v
from ..distillation import check_kind
from ..functional import TokenStats
from ..linear.chunks import (
    IGNORE,
    NO_SAMPLER,
    ChunkAdapter,
    chunk_backward,
    chunk_row_ids,
    chunk_support,
)
from ..linear._heads import _accumulator
from ..linear.kl import GroupCall, run_linear_kl
from ..ops import contract, engine
from ..ops.dispatch import get_backend as _op_backend  # the op backend (not c10d's)
from ..ops.contract import Want
from ..ops.divergence import Divergence
from ..ops.streaming.threshold import RowReduce, threshold_rows
from ..sampling import _check_compact, check_sampler, ids_of_rows
from ._config import (
    _CHECK_DOC,
    _TOK_MAX,
    _TOK_MIN,
    _VR,
    _check_vocab_start,
    _checksums,
    _config_check,
)
from ._group import _all_reduce, _device_of, _group_info

__all__ = [
    "vocab_parallel_full_kl",
    "vocab_parallel_token_logprobs",
    "vocab_parallel_entropy",
    "vocab_parallel_token_stats",
    "vocab_parallel_linear_kl",
]

# the local ignore value handed to the backend ops (never a column index)
_IGNORED = -1

# the fields of engine.StatsState merged by MAX (every other field is a sum)
_MAXIMA = ("m_x", "m_y")


class _RankReduce(RowReduce):
    """The threshold reductions across the ranks of ``group`` (see :mod:`klpenalty.sampling`)."""

    def __init__(self, group: Any, world: int, vocab: int):
        self.group, self.world, self._vocab = group, world, vocab

    def vocab(self, width: int) -> int:
        return self._vocab

    def amax(self, t):
        m = t.amax(-1, keepdim=True) if t.shape[-1] else t.new_full((t.shape[0], 1), -math.inf)
        _all_reduce(m, dist.ReduceOp.MAX, self.group)
        return m

    def amin(self, t):
        return -self.amax(-t).squeeze(-1)

    def sum64(self, t):
        s = t.sum(-1, keepdim=True, dtype=torch.float64)
        _all_reduce(s, dist.ReduceOp.SUM, self.group)
        return s

    def any(self, t):
        a = t.any(-1).to(torch.float32)
        _all_reduce(a, dist.ReduceOp.MAX, self.group)
        return a > 0

    def topk(self, key, value, k):
        kk = min(k, key.shape[-1])
        keys, idx = key.topk(kk, -1)
        pair = torch.stack([keys, value.gather(-1, idx)], -1)  # (R, kk, 2)
        if kk < k:  # a slice narrower than k: pad with −inf (never among the k largest)
            pad = pair.new_full((pair.shape[0], k - kk, 2), -math.inf)
            pair = torch.cat([pair, pad], 1)
        if pair.numel():
            parts = [torch.empty_like(pair) for _ in range(self.world)]
            dist.all_gather(parts, pair.contiguous(), group=self.group)
            pair = torch.cat(parts, 1)  # (R, W·k, 2)
        top, at = pair[..., 0].topk(k, -1)
        return top, pair[..., 1].gather(-1, at)

    def histogram64(self, bucket, weight, bins):
        h = super().histogram64(bucket, weight, bins)  # (R, bins) of this slice
        _all_reduce(h, dist.ReduceOp.SUM, self.group)
        return h


def _local_keep(support, x: torch.Tensor, vocab_start: int | None, caller: str):
    """The kept set of this slice as a (..., V_r) bool mask, from ``support``: the slice of a
    bool mask as is, or the global ids of a compact ``(ids, offsets)`` that fall in it."""
    if isinstance(support, torch.Tensor):
        if support.dtype != torch.bool or support.shape != x.shape:
            raise ValueError(
                f"{caller}: support must be this rank's slice of the kept set, a bool tensor of "
                f"the shard's shape {tuple(x.shape)}, or a pair (ids, offsets); got "
                f"{v.describe(support)}"
            )
        if support.device != x.device:
            raise ValueError(f"{caller}: support must be on {x.device}, got {support.device}")
        return support
    if isinstance(support, (tuple, list)) and len(support) == 2:
        if vocab_start is None:
            raise ValueError(f"{caller}: support=(ids, offsets) needs vocab_start")
        ids, offsets = support
        _check_compact(ids, offsets, math.prod(x.shape[:-1]), 1 << 62, x.device)
        return _slice_keep(ids, offsets, vocab_start, x.shape)
    raise TypeError(
        f"{caller}: support must be a bool tensor (..., V_r) or a pair (ids, offsets), got "
        f"{type(support).__name__}"
    )


def _slice_keep(ids: torch.Tensor, offsets: torch.Tensor, vocab_start: int, shape) -> torch.Tensor:
    """This slice's (..., V_r) bool kept set (``shape``) of the validated global compact sets
    ``(ids, offsets)`` of its N rows: True at the kept ids that fall in it."""
    n, width = math.prod(shape[:-1]), shape[-1]
    counts = offsets[1:] - offsets[:-1]  # (N,)
    rows = torch.repeat_interleave(torch.arange(n, device=ids.device), counts)  # (K,)
    local = ids.long() - vocab_start
    here = (local >= 0) & (local < width)
    keep = torch.zeros(n, width, dtype=torch.bool, device=ids.device)
    keep[rows[here], local[here]] = True
    return keep.reshape(shape)


def _threshold_chunk(vocab: int) -> int:
    """Rows per chunk of the thresholds across ranks, the same on every rank (~2M logits of
    the whole vocabulary)."""
    return max(1, (1 << 21) // max(vocab, 1))


def _raise_if_nan(out, want: int, sums: dict[str, torch.Tensor], caller: str) -> None:
    """NaN in a wanted (global) column → a ValueError saying why; the same on every rank.

    ``out`` and the all-reduced sums (name → (N,) Σ e^u of that input) are identical on every
    rank, so the decision and the message are too, with no extra communication.
    """
    bad = torch.isnan(out[:, Want(want).columns()]).any(-1)
    if not bool(bad.any()):
        return
    rows = bad.nonzero().flatten()
    what = "the result is NaN"
    for name, s in sums.items():
        if not bool(torch.isfinite(s[rows]).all()):
            what = f"{name} hold NaN or +inf"
            break
        if bool((s[rows] == 0).any()):
            what = f"{name} are -inf over the whole vocabulary (no distribution)"
            break
    raise ValueError(
        f"{caller}: {what} in {rows.numel()} counted position(s) on some rank, "
        f"first flat row index {int(rows[0])}"
    )


def _merged_stats(x, y, tokens, owned, mask, keep, tau, opts):
    """The whole vocabulary's out (N, OUT_COLS) and stats (N, k) from this rank's (N, V_r)
    slices.

    The backend's state op on the slice, an all-reduce MAX of the maxima, an all-reduce SUM of
    the rescaled states' sums and of the owned tokens' logits, the engine's finalize and the
    contract's columns (:func:`.contract.finish_columns`; the module docstring). ``opts`` as
    :class:`_VocabParallelTokenStats`'s. Returns (out, stats, has_y).
    """
    temperature, want, backend, group, check, caller, names = opts
    has_y = y is not None and bool(want & (Want.KL | Want.REF_LOGP))
    state, careful = backend.state(x, y if has_y else None, keep, tau, temperature=temperature,
                                   want=want)  # (N, STATE_COLS), (N,)
    local = engine.state_from_tensor(state, want)
    maxes = state[:, [contract.SX_M_X, contract.SX_M_Y] if has_y else [contract.SX_M_X]]
    _all_reduce(maxes, dist.ReduceOp.MAX, group)  # (N, 1 or 2)
    m_x, m_y = maxes[:, 0], (maxes[:, 1] if has_y else None)
    mine = engine.stats_rescale(local, m_x, m_y, temperature)
    # the sums of the state (every field but the maxima), then the token's logit on its owner
    summed = [k for k, f in mine._asdict().items() if f is not None and k not in _MAXIMA]
    logits_t, ignored = {}, None
    if tokens is not None and want & (Want.LOGP | Want.REF_LOGP):
        tok, ignored = contract.safe_tokens(tokens, _IGNORED)
        if want & Want.LOGP:
            logits_t[Want.LOGP] = contract.token_logits(x, tok, keep, tau, m_x.dtype)
        if want & Want.REF_LOGP:
            logits_t[Want.REF_LOGP] = y.gather(-1, tok.unsqueeze(-1)).squeeze(-1).to(m_x.dtype)
    zero = m_x.new_zeros(())
    sums = torch.stack([getattr(mine, k) for k in summed]
                       + [torch.where(owned, t, zero) for t in logits_t.values()], -1)  # (N, k)
    _all_reduce(sums, dist.ReduceOp.SUM, group)
    parts = sums.unbind(-1)
    merged = mine._replace(**dict(zip(summed, parts)))
    logits_t = dict(zip(logits_t, parts[len(summed):]))
    kl, h, stats = engine.stats_finalize(merged, careful)
    out = contract.finish_columns(merged, kl, h, stats, logits_t, ignored, temperature,
                                  None if tau is None else tau.reshape(-1), mask)
    if check:
        named = {names[0].removesuffix("_shard"): merged.s_x}
        if has_y:
            named[names[1].removesuffix("_shard")] = merged.s_y
        _raise_if_nan(out, want, named, caller)
    return out, stats, has_y


class _VocabParallelTokenStats(torch.autograd.Function):
    """out (N, OUT_COLS) of the whole vocabulary from (N, V_r) slices; see the module
    docstring."""

    @staticmethod
    def forward(ctx, x, y, tokens, owned, mask, keep, tau, opts):
        out, stats, has_y = _merged_stats(x, y, tokens, owned, mask, keep, tau, opts)
        ctx.save_for_backward(x, y if has_y else None, tokens, owned, stats, mask, keep, tau)
        ctx.opts = opts
        ctx.has_y = has_y
        ctx.mark_non_differentiable(stats)
        return out, stats

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out, _grad_stats):  # grad_out: (N, OUT_COLS)
        x, y, tokens, owned, stats, mask, keep, tau = ctx.saved_tensors
        temperature, want, backend, *_ = ctx.opts
        need_x = ctx.needs_input_grad[0]
        need_y = ctx.has_y and ctx.needs_input_grad[1]
        gx, gy = backend.backward(
            grad_out.contiguous(), x, y, tokens, owned, stats, mask, keep, tau,
            temperature=temperature, want=want, need_x=need_x, need_y=need_y,
            ignore_index=_IGNORED,
        )
        return (gx if need_x else None), (gy if need_y else None), *([None] * 6)


class _VocabParallelDivergence(torch.autograd.Function):
    """The second walk across ranks: the merged stats (:func:`_merged_stats`, want KL: both
    normalisers, the student on the support ``keep`` / ``tau``: this rank's slice of the kept
    set, the threshold computed across ranks), each rank's value and ḡ over its slice (the
    backend's divergence op), one all-reduce SUM of both; the backward is local (the backend's
    divergence backward op with the global stats and ḡ). out (N, OUT_COLS) with the value in the KL column."""

    @staticmethod
    def forward(ctx, x, y, mask, keep, tau, opts, kind, param):
        out, stats, _ = _merged_stats(x, y, None, None, mask, keep, tau, opts)
        temperature, _, backend, group, *_ = opts
        value, gbar = backend.divergence(x, y, stats, mask, keep, tau, temperature=temperature,
                                         kind=kind, param=param)
        both = torch.stack([value, gbar], -1)  # (N, 2)
        _all_reduce(both, dist.ReduceOp.SUM, group)
        out[:, contract.OUT_KL] = both[:, 0]
        ctx.save_for_backward(x, y, stats, both[:, 1].contiguous(), mask, keep, tau)
        ctx.args = (temperature, backend, kind, param)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        x, y, stats, gbar, mask, keep, tau = ctx.saved_tensors
        temperature, backend, kind, param = ctx.args
        gx = backend.divergence_backward(grad_out[:, contract.OUT_KL].contiguous(), x, y, stats,
                                         gbar, mask, keep, tau, temperature=temperature,
                                         kind=kind, param=param)
        return gx, *([None] * 7)


def _token_stats(
    caller: str,
    x_shard: torch.Tensor,
    y_shard: torch.Tensor | None,
    tokens: torch.Tensor | None,
    *,
    want: int,
    group: Any,
    temperature: float,
    mask: torch.Tensor | None,
    vocab_start: int | None,
    support: Any,
    top_k: Any,
    top_p: Any,
    min_p: Any,
    ignore_index: int,
    backend: str,
    check: bool,
    divergence: tuple | None = None,
    names: tuple[str, str] | None = None,
) -> torch.Tensor:
    """The one validation, configuration check and call of the public functions:
    (..., OUT_COLS). ``divergence`` (kind, beta, skew) as given to :func:`klpenalty.divergence`:
    the KL column holds that divergence (the second walk; y a constant); ``names``: the two
    logits' argument names."""
    world, _ = _group_info(group, caller)
    if names is None:
        names = ("policy_logits_shard", "ref_logits_shard") if y_shard is not None else (
            "logits_shard", "")
    device = _device_of(x_shard, caller=caller)
    local_error: Exception | None = None
    leading: tuple[int, ...] = ()
    width = 0
    impl = keep = div = None
    parsed: tuple | None = None  # the support as parse_support describes it
    sampler: dict = {}
    try:
        if divergence is not None:
            div = check_kind(*divergence)
        if y_shard is not None:
            v.check_logits_pair(x_shard, y_shard, names)
        else:
            v.check_logits(names[0], x_shard)
        leading = tuple(x_shard.shape[:-1])
        width = x_shard.shape[-1]
        if tokens is not None:
            v.check_tokens(tokens, leading)
            if tokens.device != device:
                raise ValueError(f"tokens must be on {device}, got {tokens.device}")
            ignore_index = v.check_ignore_index(ignore_index)
        temperature = v.check_temperature(temperature)
        if mask is not None:
            mask = v.check_mask(mask, leading, device)
        vocab_start = _check_vocab_start(vocab_start, required=tokens is not None)
        sampler = check_sampler(top_k, top_p, min_p)
        if support is not None and any(val is not None for val in sampler.values()):
            raise ValueError(
                "support and the sampler settings both given: pass either the kept set "
                "(support=) or the sampler settings that build it"
            )
        impl = _op_backend(backend, device)
        if support is not None:
            keep = _local_keep(support, x_shard, vocab_start, caller)
            parsed = ("keep", None) if isinstance(support, torch.Tensor) else ("ids", support)
        elif any(val is not None for val in sampler.values()):
            parsed = ("rule", tuple(sampler.values()))
        else:
            parsed = ("none", None)
    except (TypeError, ValueError) as err:
        local_error = err
    tok_rec = None if tokens is None else tokens.masked_fill(tokens == ignore_index, 0)
    vocab = None
    if check:
        recs = _config_check(
            caller, group, world, device, local_error, names=names,
            settings=_settings(parsed, want, div),
            policy=x_shard, ref=y_shard, leading=leading, vocab_start=vocab_start,
            width=width, temperature=temperature, mask=mask, tokens=tok_rec,
        )  # fmt: skip
        vocab = sum(rec[_VR] for rec in recs)
        if tokens is not None:
            lo, hi = recs[0][_TOK_MIN], recs[0][_TOK_MAX]
            if tokens.numel() and (lo < 0 or hi >= vocab):
                raise ValueError(
                    f"{caller}: tokens must lie in [0, {vocab}) (the whole vocabulary, Σ V_r) "
                    f"or equal ignore_index={ignore_index}, got values in [{lo}, {hi}] "
                    f"({v.describe(tokens)})"
                )
    elif local_error is not None:
        raise local_error
    x = x_shard.reshape(-1, width)  # (N, V_r)
    y = None if y_shard is None else y_shard.reshape(-1, width)
    tau = None
    if keep is not None:
        keep = keep.reshape(x.shape)
    elif any(val is not None for val in sampler.values()):
        if vocab is None:
            total = torch.tensor([width], dtype=torch.float64, device=device)
            _all_reduce(total, dist.ReduceOp.SUM, group)
            vocab = int(total.item())
        tau = threshold_rows(x, sampler["top_k"], sampler["top_p"], sampler["min_p"],
                             temperature, _threshold_chunk(vocab),
                             _RankReduce(group, world, vocab))
        if bool(torch.isneginf(tau).all()):
            tau = None  # nothing cut anywhere: the untruncated policy
    tok = owned = None
    if tokens is not None:
        flat = tokens.reshape(-1).long()
        ignored = flat == ignore_index
        local = flat - vocab_start
        owned = (local >= 0) & (local < width) & ~ignored
        tok = torch.where(owned, local, torch.where(ignored, _IGNORED, 0))
    flat_mask = mask.reshape(-1) if mask is not None else None
    opts = (temperature, int(want), impl, group, check, caller, names)
    if div is not None and div[0] != Divergence.REVERSE_KL:  # the reverse KL: the KL column
        out = _VocabParallelDivergence.apply(x, y, flat_mask, keep, tau, opts, int(div[0]),
                                             div[1])
        return out.reshape(*leading, contract.OUT_COLS)
    out, _ = _VocabParallelTokenStats.apply(x, y, tok, owned, flat_mask, keep, tau, opts)
    if check and want & Want.LOGP and (keep is not None or tau is not None):
        # log π̃(t) = −inf at a counted token: off the support (the same on every rank)
        outside = torch.isneginf(out[:, contract.OUT_LOGP])
        if bool(outside.any()):
            raise contract.outside_support_error(outside.reshape(tokens.shape), tokens)
    return out.reshape(*leading, contract.OUT_COLS)


_SUPPORT_DOC = """support, top_k, top_p, min_p: the policy that sampled, truncated (as in
            :func:`klpenalty.token_stats`): ``support`` is this rank's slice (..., V_r) of the
            kept set as a bool tensor, or the global ``(ids, offsets)`` (needs
            ``vocab_start``); top-k/top-p/min-p thresholds are computed across the ranks, the
            same on every rank (top-k, top-p: an all-gather of each rank's largest k logits
            per position, k growing as in :func:`klpenalty.sampling.sampling_threshold`)."""

_BACKEND_DOC = """backend: the backend of each rank's local work (``"auto"``, ``"streaming"``,
            ``"native"``, ``"triton"``; :mod:`klpenalty.ops.dispatch`)."""


def vocab_parallel_full_kl(
    policy_logits_shard: torch.Tensor,
    ref_logits_shard: torch.Tensor,
    *,
    group: Any = None,
    temperature: float = 1.0,
    mask: torch.Tensor | None = None,
    vocab_start: int | None = None,
    backend: str = "auto",
    check: bool = True,
    support: Any = None,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
) -> torch.Tensor:
    """Exact full-vocabulary KL(π‖ρ) per position when each rank holds a slice of the vocabulary.

    Every rank of ``group`` holds the same positions and a contiguous vocabulary slice (uneven
    widths V_r allowed) of both models' logits; rank 0 holds the first slice. Every rank gets
    the same result, equal to :func:`klpenalty.full_kl` on the logits gathered along the last
    dim in rank order.

    Communication per call: an all-reduce MAX of the per-row maxima (N, 2), then an all-reduce
    SUM of (s_x, s_y, a) against the global maxima (N, 3): 20 bytes per position for float32
    math (40 for float64 inputs), never the logits. The backward is local: each rank gets the
    gradient of its own shard from the global stats saved in the forward.

    Numerics as :func:`klpenalty.full_kl`. Non-finite results are diagnosed from the
    all-reduced sums, so the same ValueError is raised on every rank.

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
        vocab_start: optional int, where this rank's slice starts in the vocabulary (checked by
            the configuration check; needed by ``support=(ids, offsets)``).
        {backend}
        check: run the configuration check described above, and raise when a counted
            position's result is NaN (one more host read of an (N,) tensor).
        {support}

    Returns:
        (...) float32 (float64 if either input is float64), identical on every rank,
        differentiable once; gradients come back in the inputs' dtypes.

    Raises:
        RuntimeError: torch.distributed is not initialized.
        TypeError / ValueError: invalid arguments on some rank, ranks that disagree, NaN in a
            counted position (all on every rank, see above).
    """
    out = _token_stats(
        "vocab_parallel_full_kl", policy_logits_shard, ref_logits_shard, None, want=Want.KL,
        group=group, temperature=temperature, mask=mask, vocab_start=vocab_start,
        support=support, top_k=top_k, top_p=top_p, min_p=min_p, ignore_index=-100,
        backend=backend, check=check,
    )
    return out[..., contract.OUT_KL].contiguous()


def vocab_parallel_token_logprobs(
    logits_shard: torch.Tensor,
    tokens: torch.Tensor,
    *,
    vocab_start: int,
    group: Any = None,
    temperature: float = 1.0,
    ignore_index: int = -100,
    backend: str = "auto",
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
        ignore_index: positions holding it give 0 and zero gradient.
        {backend}
        check: run the configuration check described above, and raise when a counted
            position's result is NaN (one more host read of an (N,) tensor).

    Returns:
        (...) float32 (float64 for float64 logits), ≤ 0, identical on every rank,
        differentiable once with respect to ``logits_shard``.
    """
    out = _token_stats(
        "vocab_parallel_token_logprobs", logits_shard, None, tokens, want=Want.LOGP,
        group=group, temperature=temperature, mask=None, vocab_start=vocab_start, support=None,
        top_k=None, top_p=None, min_p=None, ignore_index=ignore_index, backend=backend,
        check=check,
    )
    return out[..., contract.OUT_LOGP].contiguous()


def vocab_parallel_entropy(
    logits_shard: torch.Tensor,
    *,
    group: Any = None,
    temperature: float = 1.0,
    mask: torch.Tensor | None = None,
    vocab_start: int | None = None,
    backend: str = "auto",
    check: bool = True,
    support: Any = None,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
) -> torch.Tensor:
    """Policy entropy H(π) per position when each rank holds a slice of the vocabulary.

    Equal to :func:`klpenalty.entropy` on the gathered logits, on every rank. Communication per
    call: an all-reduce MAX (N,), then an all-reduce SUM of (s_x, b) (N, 2): 12 bytes per
    position for float32 math. Arguments as :func:`vocab_parallel_full_kl`.

    Returns:
        (...) float32 (float64 for float64 logits), ≥ 0, identical on every rank,
        differentiable once.
    """
    out = _token_stats(
        "vocab_parallel_entropy", logits_shard, None, None, want=Want.ENTROPY, group=group,
        temperature=temperature, mask=mask, vocab_start=vocab_start, support=support,
        top_k=top_k, top_p=top_p, min_p=min_p, ignore_index=-100, backend=backend, check=check,
    )
    return out[..., contract.OUT_ENTROPY].contiguous()


def vocab_parallel_token_stats(
    policy_logits_shard: torch.Tensor,
    ref_logits_shard: torch.Tensor | None = None,
    tokens: torch.Tensor | None = None,
    *,
    vocab_start: int | None = None,
    group: Any = None,
    entropy: bool = False,
    temperature: float = 1.0,
    mask: torch.Tensor | None = None,
    ignore_index: int = -100,
    backend: str = "auto",
    check: bool = True,
    support: Any = None,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
) -> TokenStats:
    """KL(π̃‖ρ), log π̃(token), log ρ(token) and H(π̃) in one pass over each rank's slice.

    Equal to :func:`klpenalty.token_stats` on the gathered logits, on every rank: the KL with
    ``ref_logits_shard``, the log-probs with ``tokens`` (the reference's with both), the
    entropy with ``entropy=True``. Communication per call: an all-reduce MAX of the maxima
    (N, 1 or 2), then one all-reduce SUM of (s_x[, b][, s_y][, a][, x_t][, y_t]) (N, k): 20
    bytes per position for the KL, 4 more for each of the entropy, the log-prob and the
    reference log-prob (float32 math). Arguments as :func:`vocab_parallel_full_kl` and
    :func:`vocab_parallel_token_logprobs` (``vocab_start`` is required with tokens).

    Returns:
        :class:`klpenalty.TokenStats`, fields (...) or None where not requested, identical on
        every rank, differentiable once.
    """
    if ref_logits_shard is None and tokens is None and not entropy:
        raise ValueError(
            "vocab_parallel_token_stats has nothing to compute: give ref_logits_shard (KL), "
            "tokens (log-probs) or entropy=True"
        )
    if not isinstance(entropy, bool):
        raise TypeError(f"entropy must be a bool, got {type(entropy).__name__}")
    want = (
        Want.KL * (ref_logits_shard is not None) | Want.LOGP * (tokens is not None)
        | Want.REF_LOGP * (ref_logits_shard is not None and tokens is not None)
        | Want.ENTROPY * entropy
    )
    out = _token_stats(
        "vocab_parallel_token_stats", policy_logits_shard, ref_logits_shard, tokens, want=want,
        group=group, temperature=temperature, mask=mask, vocab_start=vocab_start,
        support=support, top_k=top_k, top_p=top_p, min_p=min_p, ignore_index=ignore_index,
        backend=backend, check=check,
    )
    return TokenStats(
        *(out[..., col].contiguous() if want & bit else None for col, bit in enumerate(Want))
    )


_CHECK_TEXT = _CHECK_DOC.strip() + "\n"  # first line takes the placeholder's indentation
for _fn in (vocab_parallel_full_kl, vocab_parallel_token_logprobs):
    _fn.__doc__ = (
        _fn.__doc__.replace("{check}", _CHECK_TEXT).replace("{support}", _SUPPORT_DOC)
        .replace("{backend}", _BACKEND_DOC)
    )


class _VocabParallelChunks(ChunkAdapter):
    """The :class:`klpenalty.linear.chunks.ChunkAdapter` of a vocabulary slice, for
    :func:`klpenalty.linear.linear_kl`'s chunked Function: the chunk's (R, V_r) logits go
    through :func:`_merged_stats` (state op, all-reduce merge, finalize), the backward through
    the backend's backward op with the global stats and ``owned``; the hidden states' gradient
    is all-reduced (SUM). Supports: a bool kept set is this slice's (..., V_r); compact ids are
    global (this slice's share of each chunk's sets); sampler settings become the chunk's
    thresholds across the ranks (:func:`~klpenalty.ops.streaming.threshold.threshold_rows` with
    :class:`_RankReduce`, the same τ on every rank), handed to the state op."""

    def __init__(self, impl, group, world: int, vocab_start: int, width: int, vocab: int):
        self.impl, self.group, self.vocab_start, self.width = impl, group, vocab_start, width
        self.reduce = _RankReduce(group, world, vocab)
        self.threshold_chunk = _threshold_chunk(vocab)

    def support(self, support, zp, rows, r0, r1, temperature):
        kind, payload = support
        if kind == "rule":  # collectives: every rank walks the same chunks in the same order
            tau = threshold_rows(zp, *payload, temperature, self.threshold_chunk, self.reduce)
            return None, tau, NO_SAMPLER
        if kind == "ids":
            ids, offsets = ids_of_rows(*payload, chunk_row_ids(rows, r0, r1, zp.device))
            return _slice_keep(ids, offsets, self.vocab_start, zp.shape), None, NO_SAMPLER
        return chunk_support(support, zp, rows, r0, r1)  # none, or this slice's bool mask

    def _local(self, tokens):
        """Global ids (R,) (or ``IGNORE``) → (local ids with :data:`_IGNORED`, owned (R,))."""
        if tokens is None:
            return None, None
        ignored = tokens == IGNORE
        local = tokens - self.vocab_start
        owned = (local >= 0) & (local < self.width) & ~ignored
        return torch.where(owned, local, torch.where(ignored, _IGNORED, 0)), owned

    def forward(self, zp, zr, tokens, temperature, want, keep=None, tau=None,
                sampler=NO_SAMPLER):
        # sampler: always NO_SAMPLER (self.support turns sampler settings into tau)
        tok, owned = self._local(tokens)
        opts = (temperature, int(want), self.impl, self.group, False, "", ())
        out, stats, _ = _merged_stats(zp, zr, tok, owned, None, keep, tau, opts)
        return out, stats

    def backward(self, grad_out, zp, zr, tokens, stats, temperature, need_p, need_r,
                 keep=None, tau=None):
        tok, owned = self._local(tokens)
        return chunk_backward(grad_out, zp, zr, tok, None, stats, temperature, need_p, need_r,
                              self.impl, owned=owned, ignore=_IGNORED, keep=keep, tau=tau)

    def hidden_buffer(self, hidden):
        return _accumulator(hidden)  # the ranks' parts summed in float32, rounded once

    def hidden_grad(self, grad):
        _all_reduce(grad, dist.ReduceOp.SUM, self.group)
        return grad

    def any_process(self, flags):
        out = flags.to(torch.int32)  # (k,)
        _all_reduce(out, dist.ReduceOp.MAX, self.group)
        return out.bool()

    def divergence(self, zp, zr, stats, temperature, kind, param, keep=None, tau=None):
        # keep, tau: always unused (vocab_parallel_linear_divergence takes no support)
        value, gbar = self.impl.divergence(zp, zr, stats, temperature=temperature, kind=kind,
                                           param=param)
        both = torch.stack([value, gbar], -1)  # (R, 2): sums over this slice
        _all_reduce(both, dist.ReduceOp.SUM, self.group)
        return both[:, 0], both[:, 1]

    def divergence_backward(self, grad, zp, zr, stats, gbar, temperature, kind, param,
                            keep=None, tau=None):
        return self.impl.divergence_backward(grad, zp, zr, stats, gbar, temperature=temperature,
                                             kind=kind, param=param)


def vocab_parallel_linear_kl(
    policy_hidden: torch.Tensor,
    policy_weight_shard: torch.Tensor,
    ref_hidden: torch.Tensor,
    ref_weight_shard: torch.Tensor,
    *,
    vocab_start: int,
    tokens: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    temperature: float = 1.0,
    policy_bias_shard: torch.Tensor | None = None,
    ref_bias_shard: torch.Tensor | None = None,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    ref_logit_scale: float | None = None,
    ref_softcap: float | None = None,
    entropy: bool = False,
    support: Any = None,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    group: Any = None,
    ignore_index: int = -100,
    chunk_rows: int | None = None,
    backend: str = "auto",
    check: bool = True,
) -> TokenStats:
    """:func:`klpenalty.linear_kl` when each rank holds a vocabulary slice of both LM heads.

    Megatron's column-parallel layout: every rank of ``group`` holds the same hidden states
    (..., H) and the rows W[vocab_start : vocab_start + V_r] of each model's head; the slices
    tile [0, V) in rank order (uneven V_r allowed). No rank ever holds (N, V) or (N, V_r)
    logits: the counted rows are walked in chunks of R rows (the same R on every rank), each
    chunk's (R, V_r) logits are reduced by the backend's state op and merged across the ranks
    as in :func:`vocab_parallel_token_stats` (per chunk an all-reduce MAX (R, 2) and an
    all-reduce SUM (R, k)); the backward recomputes them and runs the backend's backward op
    with the global statistics. Every rank gets the same results, equal to
    :func:`klpenalty.linear_kl` with the whole heads.

    The logit transforms are :func:`klpenalty.linear_kl`'s (z = scale·(h Wᵀ + b), soft-capped
    as cap·tanh(z/cap), in float32 on the GEMM's output: docs/numerics.md); they act entrywise,
    so each rank transforms its own (R, V_r) slice. A support (the policy that sampled, as in
    :func:`klpenalty.linear_kl`): ``support`` this rank's slice (..., V_r) of the kept set as a
    bool tensor, or the global ``(ids, offsets)`` (ids in the whole vocabulary, the same on
    every rank); ``top_k``/``top_p``/``min_p``: each chunk's thresholds are computed across the
    ranks (:func:`vocab_parallel_token_stats`'s rule: an all-gather of each rank's largest
    logits for top-k/top-p, float64 sums and histograms all-reduced), the same on every rank.

    Gradients: each weight slice and bias slice gets its own (local) gradient, the rows of the
    whole head's gradient. The hidden states' gradient is all-reduced (SUM) across ``group`` in the
    backward, Megatron's column-parallel convention: every rank gets the whole ∂/∂h, as if it
    had run the whole head (do not all-reduce it again).

    Args:
        policy_hidden: (..., H_p) float, the same on every rank. Gradients flow.
        policy_weight_shard: (V_r, H_p), this rank's rows of the policy's LM head, same dtype.
        ref_hidden: (..., H_r), the reference's hidden states, the same leading dims.
        ref_weight_shard: (V_r, H_r), this rank's rows of the reference's head (the same V_r).
        vocab_start: int, the first vocabulary id of this rank's rows.
        tokens: optional (...) integer ids in the whole vocabulary [0, V) or ``ignore_index``,
            the same on every rank: adds log π(token) and log ρ(token).
        mask: optional (...) bool, True = counts, the same on every rank (as in linear_kl).
        temperature: > 0.
        policy_bias_shard, ref_bias_shard: optional (V_r,) this rank's entries of the LM-head
            biases, the dtype of the weight shards.
        logit_scale, softcap, ref_logit_scale, ref_softcap: as in linear_kl, the same on
            every rank.
        entropy: also return H(π) (H(π̃) with a support).
        support, top_k, top_p, min_p: the policy that sampled (above; sampler settings the
            same on every rank).
        group: the process group the vocabulary is split over; None = the default group.
        ignore_index: negative int (as in linear_kl).
        chunk_rows: ≥ 1 rows per chunk, the same on every rank; None:
            :func:`klpenalty.linear.default_chunk_rows` of the whole V and the hidden sizes
            (the same R on every rank).
        {backend}
        check: raise for token ids outside [0, V) and for NaN in a counted position (as in
            linear_kl). Whatever ``check``, every call runs the configuration check of
            :func:`vocab_parallel_full_kl` (one all-gather of 86 int64 per rank): invalid
            arguments on any rank, slices that do not tile [0, V) in rank order, and leading
            dims, dtypes, mask, tokens, temperature, hidden sizes, which hidden states take a
            gradient, biases given, logit transforms, chunk_rows or sampler settings that
            differ across ranks raise the same ValueError on every rank.

    Returns:
        :class:`klpenalty.TokenStats` as :func:`klpenalty.linear_kl`, identical on every rank.

    Raises:
        RuntimeError: torch.distributed is not initialized.
        TypeError / ValueError: as :func:`klpenalty.linear_kl`; slices that do not tile the
            vocabulary, ranks that hold different numbers of positions.
    """
    return run_linear_kl(
        policy_hidden, policy_weight_shard, ref_hidden, ref_weight_shard, tokens=tokens,
        mask=mask, temperature=temperature, policy_bias=policy_bias_shard,
        ref_bias=ref_bias_shard, logit_scale=logit_scale, softcap=softcap,
        ref_logit_scale=ref_logit_scale, ref_softcap=ref_softcap, entropy=entropy,
        ignore_index=ignore_index, chunk_rows=chunk_rows, backend=backend, check=check,
        parallel=_slice_adapter("vocab_parallel_linear_kl", group, vocab_start, policy_hidden),
        suffix="_shard", support=support, top_k=top_k, top_p=top_p, min_p=min_p,
    )


def _slice_adapter(caller: str, group: Any, vocab_start: object, hidden: object):
    """The ``parallel`` argument of :func:`klpenalty.linear.kl.run_linear_kl` for this rank's
    rows of the heads: the configuration check across the group (:mod:`._config`: one
    all-gather; the slices' tiling, the call's arguments and settings), then
    :class:`_VocabParallelChunks` and the whole V."""
    world, _ = _group_info(group, caller)
    device = _device_of(hidden, caller=caller)

    def parallel(impl, width, error, call: GroupCall):
        start = None
        try:
            start = _check_vocab_start(vocab_start, required=True)
        except (TypeError, ValueError) as err:
            error = error or err
        ok = error is None
        a, b = call.roles
        checked = call.checked
        tokens = None
        if ok and call.tokens is not None:  # ignored and masked positions may hold anything
            skip = call.tokens == checked.ignore_index
            if checked.mask is not None:
                skip |= ~checked.mask
            tokens = call.tokens.masked_fill(skip, 0)
        recs = _config_check(
            caller, group, world, device, error, names=(f"{a}_hidden", f"{b}_hidden"),
            settings=_head_settings(call, ok) + _settings(call.support, call.want,
                                                          call.divergence),
            policy=call.hidden[0], ref=call.hidden[1],
            leading=tuple(checked.leading) if ok else (), vocab_start=start,
            width=width or 0, temperature=checked.temperature if ok else 1.0,
            mask=checked.mask if ok else None, tokens=tokens,
        )  # fmt: skip
        vocab = sum(rec[_VR] for rec in recs)
        return _VocabParallelChunks(impl, group, world, start, width, vocab), vocab

    return parallel


def _head_settings(call: GroupCall, ok: bool) -> list[tuple[str, object]]:
    """The fused heads' settings that every rank must pass alike (:mod:`._config`): the
    hidden sizes, which hidden states take a gradient (the backward all-reduces theirs), the
    biases given, the logit transforms and chunk_rows. Values None where the local validation
    failed (``ok`` False)."""
    a, b = call.roles
    bias = [f"{role}_bias{call.suffix}" for role in call.roles]
    names = [f"the hidden size of {a}_hidden", f"the hidden size of {b}_hidden",
             f"whether {a}_hidden takes a gradient", f"whether {b}_hidden takes a gradient",
             f"whether {bias[0]} is given", f"whether {bias[1]} is given",
             "logit_scale", "softcap", f"{b}_logit_scale", f"{b}_softcap", "chunk_rows"]
    if not ok:
        return [(name, None) for name in names]
    grad = torch.is_grad_enabled()
    values = [h.shape[-1] for h in call.hidden] + [grad and h.requires_grad for h in call.hidden]
    values += [t is not None for t in call.biases]
    values += [None if t is None else float(t) for t in call.checked.transforms]
    values.append(None if call.chunk_rows is None else int(call.chunk_rows))
    return list(zip(names, values))


_SUPPORT_KINDS = {"none": "None", "keep": "a bool slice", "ids": "(ids, offsets)",
                  "rule": "sampler settings"}


def _settings(support: tuple | None, want: int | None,
              divergence: tuple | None) -> list[tuple[str, object]]:
    """The settings that every rank must pass alike (:mod:`._config`) in every
    vocabulary-parallel function: the outputs asked for, the support (its kind, the sampler
    settings, checksums of global ids) and the divergence's kind and parameter.
    ``support``: :func:`klpenalty.sampling.parse_support`'s (kind, payload), None where the
    local validation failed (every value None); ``divergence``: (Divergence, param) or None."""
    names = ["whether tokens are given", "entropy", "the support", "top_k", "top_p", "min_p",
             "support ids (an index-weighted checksum)",
             "support offsets (an index-weighted checksum)", "kind",
             "the divergence's beta or skew"]
    if support is None:
        return [(name, None) for name in names]
    kind, payload = support
    rule = payload if kind == "rule" else (None, None, None)
    sums = [_checksums(t)[1] for t in payload] if kind == "ids" else [None, None]
    div = (None, None) if divergence is None else (divergence[0].name.lower(),
                                                   float(divergence[1]))
    values = [bool(want & Want.LOGP), bool(want & Want.ENTROPY), _SUPPORT_KINDS[kind], *rule,
              *sums, *div]
    return list(zip(names, values))


vocab_parallel_linear_kl.__doc__ = vocab_parallel_linear_kl.__doc__.replace(
    "{backend}", _BACKEND_DOC
)
