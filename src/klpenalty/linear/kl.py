"""linear_kl: exact KL, token log-probs and entropy from both models' hidden states and LM
heads, differentiable, with a recomputing backward (or the plan of its upstream gradients).

Shape letters: N rows (the product of the leading dims), M the counted rows, R rows of one
chunk, V the vocabulary, H_p / H_r the hidden sizes.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from .. import _validation as v
from ..distillation import check_kind
from ..functional import TokenStats
from ..ops import contract
from ..ops.contract import Want
from ..sampling import parse_support
from ._heads import (
    _accumulator,
    _chain,
    _check_flag,
    _check_heads,
    _check_nan,
    _check_on_support,
    _flat_rows,
    _head_grads,
    _logits,
    _plan_rows,
    gemm_dtype,
)
from .chunks import (
    ChunkAdapter,
    DivergenceChunks,
    LocalChunks,
    chunk_row_ids,
    host_checks,
    want_bits,
)

__all__ = ["linear_kl", "run_linear_kl", "GroupCall", "PLAN_RTOL"]

# The largest difference, per output column and relative to the column's largest upstream
# gradient, between the gradients a plan promised and those the backward receives for which the
# gradients formed in the forward are handed over (else the backward recomputes). Both sides are
# the same float32 formula evaluated in another order (a few ulps, ~1e-7); the handed-over
# gradient then differs from the recomputed one by at most this fraction of its scale, below the
# float32 rounding of the head's own GEMMs over H ≥ 64 terms.
PLAN_RTOL = 1e-5


class _Options(NamedTuple):
    """The non-tensor inputs of :class:`_LinearKL`."""

    temperature: float
    scale_p: float
    cap_p: Optional[float]
    scale_r: float
    cap_r: Optional[float]
    want: int  # the token_stats op's columns (chunks.want_bits)
    chunk: int  # rows R of a chunk
    adapter: ChunkAdapter
    support: tuple  # klpenalty.sampling.parse_support's (kind, payload)
    plan: object  # expected_grads, or None


class GroupCall(NamedTuple):
    """A call as :func:`run_linear_kl` hands it to its ``parallel`` callable, which checks
    across the processes that every one made the same call. ``roles``/``suffix`` name the
    arguments (as in :func:`run_linear_kl`); the other fields are None where the local
    validation failed."""

    roles: tuple[str, str]
    suffix: str
    hidden: tuple  # (policy_hidden, ref_hidden), as given
    biases: tuple  # (policy_bias, ref_bias), as given
    checked: object  # _heads._Checked: leading dims, mask, temperature, transforms, ...
    chunk_rows: Optional[int]
    tokens: Optional[Tensor]  # as given (checked)
    want: Optional[int]  # chunks.want_bits
    support: Optional[tuple]  # klpenalty.sampling.parse_support's (kind, payload)
    divergence: Optional[tuple]  # (Divergence, param) or None


def _upstream(grads, n: int, like: Tensor) -> Tensor:
    """(N, OUT_COLS) of the per-column upstream gradients ``grads`` (each (N,), or None = 0),
    in the dtype and on the device of ``like``."""
    g_all = like.new_zeros((n, contract.OUT_COLS))
    for col, g in enumerate(grads):
        if g is not None:
            g_all[:, col] = g
    return g_all


class _LinearKL(torch.autograd.Function):
    """Chunked LM heads of both models → engine → per-row outputs, with a recomputing backward.

    Inputs are already validated; hidden states are (N, H_p) / (N, H_r) rows. ``rows`` (M,)
    int64 are the counted rows (None = all N); ``tokens`` (N,) int64 with ignored positions
    set to :data:`~.chunks.IGNORE`, or None. ``opts`` (:class:`_Options`) holds the chunk
    adapter, the parsed support (:func:`klpenalty.sampling.parse_support`) and the plan of
    upstream gradients (or None): each chunk's thresholds are computed by the op on its rows'
    logits (they are per row) and kept in the saved stats (``ST_TAU``) for the backward; a kept
    set is re-read there.

    With a plan the forward visits the chunks last rows first, asks the plan for each chunk's
    upstream gradients and forms the input gradients at once (the engine's backward and the
    gradient GEMMs on the logits already in hand); the backward hands them over when the
    gradients it receives are those planned (:data:`PLAN_RTOL`), else recomputes as without.
    Outputs: one (N,) tensor per column of the token_stats op (:data:`.contract.OUT_COLS`),
    in the compute dtype (0 in the columns not in ``opts.want``, rows not counted).
    """

    @staticmethod
    def forward(ctx, hp, wp, bp, hr, wr, br, tokens, rows, opts: _Options):
        n = hp.shape[0]
        dtype = v.compute_dtype(hp, wp, hr, wr)
        outs = [hp.new_zeros(n, dtype=dtype) for _ in range(contract.OUT_COLS)]
        m = n if rows is None else rows.shape[0]
        need = ctx.needs_input_grad[:6]
        held = _Held(hp, wp, bp, hr, wr, br, need, n, dtype, opts.adapter) if opts.plan is not None \
            and any(need) else None
        starts = list(range(0, m, opts.chunk))
        stats = None
        for r0 in (reversed(starts) if held is not None else starts):
            r1 = min(m, r0 + opts.chunk)
            sel = slice(r0, r1) if rows is None else rows[r0:r1]
            hpc, hrc = hp[sel], hr[sel]
            zp = _logits(hpc, wp, bp, opts.scale_p, opts.cap_p)  # (R, V)
            zr = _logits(hrc, wr, br, opts.scale_r, opts.cap_r)  # (R, V)
            tok = None if tokens is None else tokens[sel]
            keep, tau, sampler = opts.adapter.support(opts.support, zp, rows, r0, r1,
                                                      opts.temperature)
            out, st = opts.adapter.forward(zp, zr, tok, opts.temperature, opts.want, keep, tau,
                                           sampler)
            if stats is None:
                stats = st.new_empty((m, st.shape[-1]))
            stats[r0:r1] = st
            for col, o in enumerate(outs):
                o[sel] = out[:, col]
            if held is not None:
                flat = chunk_row_ids(rows, r0, r1, hp.device)
                grad_out = opts.plan(flat, out.detach()).to(out.dtype)  # (R, OUT_COLS)
                held.planned[sel] = grad_out
                if opts.support[0] == "rule":
                    keep, tau = None, st[:, contract.ST_TAU]
                _chunk_grads(held.buffers, (wp, wr), grad_out, zp, zr, hpc, hrc, sel, tok, st,
                             opts, keep, tau)
            del zp, zr, keep, out, st
        ctx.save_for_backward(hp, wp, bp, hr, wr, br, tokens, rows, stats)
        ctx.opts = opts
        ctx.held = held
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(*(o for o, bit in zip(outs, Want) if not opts.want & bit))
        return tuple(outs)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        hp, wp, bp, hr, wr, br, tokens, rows, stats = ctx.saved_tensors
        opts = ctx.opts
        need = ctx.needs_input_grad[:6]
        need_p, need_r = any(need[:3]), any(need[3:6])
        n = hp.shape[0]
        m = n if rows is None else rows.shape[0]
        held, ctx.held = ctx.held, None  # handed over once; a second backward recomputes
        if held is not None and held.matches(grads, rows):
            return (*_handed_over(held.buffers, opts.adapter, (hp, wp, bp, hr, wr, br)),
                    None, None, None)
        del held
        buffers = _gradient_buffers(hp, wp, bp, hr, wr, br, need, opts.adapter)
        # the reference's logits are recomputed only when a gradient needs them: its own, or
        # the KL's (∂KL/∂zp holds log ρ). Log-probs/entropy alone (e.g. the KL detached into
        # the reward) cost the policy's matmuls only.
        g_kl = grads[contract.OUT_KL]
        kl_grad = g_kl is not None and (not host_checks(hp.device) or bool(g_kl.ne(0).any()))
        use_ref = need_r or kl_grad
        if m and any(g is not None for g in grads) and (need_p or need_r):
            g_all = _upstream(grads, n, stats)  # 0 for outputs that did not reach the loss
            for r0 in range(0, m, opts.chunk):
                r1 = min(m, r0 + opts.chunk)
                sel = slice(r0, r1) if rows is None else rows[r0:r1]
                hpc, hrc = hp[sel], hr[sel]  # (R, H_p), (R, H_r)
                zp = _logits(hpc, wp, bp, opts.scale_p, opts.cap_p)  # (R, V), recomputed
                zr = _logits(hrc, wr, br, opts.scale_r, opts.cap_r) if use_ref else None
                tok = None if tokens is None else tokens[sel]
                if opts.support[0] == "rule":  # the thresholds the forward's op computed
                    keep, tau = None, stats[r0:r1, contract.ST_TAU]
                else:  # a kept set (or none), re-read for these rows
                    keep, tau, _ = opts.adapter.support(opts.support, zp, rows, r0, r1,
                                                        opts.temperature)
                _chunk_grads(buffers, (wp, wr), g_all[sel], zp, zr, hpc, hrc, sel, tok,
                             stats[r0:r1], opts, keep, tau)
                del zp, zr, keep
        return (*_handed_over(buffers, opts.adapter, (hp, wp, bp, hr, wr, br)),
                None, None, None)


class _Held:
    """What a planned forward keeps for its backward: the input gradients it formed
    (:func:`_gradient_buffers`) and the (N, OUT_COLS) upstream gradients they were formed
    for."""

    def __init__(self, hp, wp, bp, hr, wr, br, need, n: int, dtype: torch.dtype, adapter):
        self.buffers = _gradient_buffers(hp, wp, bp, hr, wr, br, need, adapter)
        self.planned = hp.new_zeros((n, contract.OUT_COLS), dtype=dtype)

    def matches(self, grads, rows: Optional[Tensor]) -> bool:
        """Whether the received upstream gradients (None = 0) are the planned ones on the
        counted rows, column by column within :data:`PLAN_RTOL` of the column's largest
        (one host read)."""
        got = _upstream(grads, self.planned.shape[0], self.planned)
        want = self.planned
        if rows is not None:
            got, want = got[rows], want[rows]
        if not got.numel():
            return True
        gap = (got - want).abs().amax(0)
        return bool((gap <= PLAN_RTOL * got.abs().amax(0)).all())


def _handed_over(buffers, adapter, inputs) -> tuple:
    """The six input gradients from their buffers: the hidden states' through the adapter,
    the accumulators cast to their tensors' dtypes."""
    out = []
    for i, (g, t) in enumerate(zip(buffers, inputs)):
        if g is not None:
            g = (adapter.hidden_grad(g) if i in (0, 3) else g).to(t.dtype)
        out.append(g)
    return tuple(out)


def _gradient_buffers(hp, wp, bp, hr, wr, br, need, adapter) -> list:
    """[grad_hp, grad_wp, grad_bp, grad_hr, grad_wr, grad_br], None where not needed: the
    adapter's buffers for the hidden states (float32 for bf16/fp16 ones where the processes'
    parts are summed), float32 accumulators for bf16/fp16 weights and biases."""
    return [
        None if not need[i] else (adapter.hidden_buffer(t) if i in (0, 3) else _accumulator(t))
        for i, t in enumerate((hp, wp, bp, hr, wr, br))
    ]


def _chunk_grads(buffers, weights, grad_out, zp, zr, hpc, hrc, sel, tok, st, opts: _Options,
                 keep, tau) -> None:
    """One chunk's share of every needed input gradient: the engine's ∂/∂z for the
    (R, OUT_COLS) upstream gradients, chained through the soft-cap and scale, then the gradient
    GEMMs. ``weights`` (wp, wr); ``zr`` may be None when no gradient needs the reference's
    logits."""
    grad_hp, grad_wp, grad_bp, grad_hr, grad_wr, grad_br = buffers
    need_p = any(b is not None for b in buffers[:3])
    need_r = any(b is not None for b in buffers[3:])
    dzp, dzr = opts.adapter.backward(grad_out, zp, zr, tok, st, opts.temperature, need_p,
                                     need_r, keep, tau)
    # the logits are needed again only for the soft-cap's derivative
    zp = zp if opts.cap_p is not None else None
    zr = zr if opts.cap_r is not None else None
    if dzp is not None:
        dzp = _chain(dzp, zp, opts.scale_p, opts.cap_p, gemm_dtype(hpc))  # (R, V), ∂/∂(h Wᵀ + b)
        zp = None
        _head_grads(dzp, hpc, weights[0], sel, grad_hp, grad_wp, grad_bp)
        dzp = None
    if dzr is not None:
        dzr = _chain(dzr, zr, opts.scale_r, opts.cap_r, gemm_dtype(hrc))
        zr = None
        _head_grads(dzr, hrc, weights[1], sel, grad_hr, grad_wr, grad_br)


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
    return run_linear_kl(
        policy_hidden, policy_weight, ref_hidden, ref_weight, tokens=tokens, mask=mask,
        temperature=temperature, policy_bias=policy_bias, ref_bias=ref_bias,
        logit_scale=logit_scale, softcap=softcap, ref_logit_scale=ref_logit_scale,
        ref_softcap=ref_softcap, entropy=entropy, ignore_index=ignore_index,
        chunk_rows=chunk_rows, backend=backend, check=check, support=support, top_k=top_k,
        top_p=top_p, min_p=min_p, expected_grads=expected_grads,
    )


# The vocabulary width the arguments of a vocabulary slice's head are parsed against where they
# refer to the whole vocabulary (compact support ids, sampler settings): larger than any V.
_WHOLE = 1 << 62


def _check_ids_below(ids: Tensor, vocab: int) -> None:
    """Compact support ids (K,) in [0, vocab) (one host read)."""
    if ids.numel() and int(ids.max()) >= vocab:
        raise ValueError(
            f"support ids must lie in [0, {vocab}) (the whole vocabulary), got a maximum of "
            f"{int(ids.max())} ({v.describe(ids)})"
        )


def run_linear_kl(
    policy_hidden, policy_weight, ref_hidden, ref_weight, *, tokens, mask, temperature,
    policy_bias, ref_bias, logit_scale, softcap, ref_logit_scale, ref_softcap, entropy,
    ignore_index, chunk_rows, backend, check, parallel=None, suffix: str = "",
    support=None, top_k=None, top_p=None, min_p=None, expected_grads=None,
    roles: tuple[str, str] = ("policy", "ref"), divergence: Optional[tuple] = None,
) -> TokenStats:
    """:func:`linear_kl`'s validation and run, with the chunk adapter of ``parallel``.

    ``parallel`` None: the whole vocabulary is here (:class:`~.chunks.LocalChunks`).
    Otherwise a callable ``parallel(impl, vocab, error, call) -> (adapter, vocab)`` called on
    every process after the local validation (``error`` its TypeError/ValueError or None,
    ``call`` the :class:`GroupCall`; it raises on every process when any process of the group
    failed or made another call), returning the :class:`~.chunks.ChunkAdapter` and the
    whole vocabulary V (a bool ``support`` is then this process's slice (..., V_r), compact
    ids and sampler settings refer to the whole V, and the adapter's ``support`` method turns
    them into each chunk's op arguments); ``suffix`` ends the weights' and biases' argument
    names in messages, ``roles``
    names the two models in them. ``divergence`` (kind, beta, skew) as given to
    :func:`klpenalty.divergence`: the KL column holds that divergence instead
    (:class:`~.chunks.DivergenceChunks`; the caller detaches the second model, a constant).
    """
    error = None
    vocab = impl = checked = want = None
    try:
        if divergence is not None:
            divergence = check_kind(*divergence)
        checked = _check_heads(
            policy_hidden, policy_weight, ref_hidden, ref_weight, tokens=tokens, mask=mask,
            temperature=temperature, policy_bias=policy_bias, ref_bias=ref_bias,
            logit_scale=logit_scale, softcap=softcap, ref_logit_scale=ref_logit_scale,
            ref_softcap=ref_softcap, ignore_index=ignore_index, chunk_rows=chunk_rows,
            backend=backend, suffix=suffix, roles=roles,
        )
        vocab, impl, leading = checked.vocab, checked.impl, checked.leading
        want = want_bits(tokens, _check_flag("entropy", entropy))
        # a vocabulary slice: a bool support is this slice's (..., V_r), compact ids and the
        # sampler settings refer to the whole V (known after the group's check, below)
        width = vocab if parallel is None or isinstance(support, Tensor) else _WHOLE
        support = parse_support(
            support, top_k, top_p, min_p, (*leading, width), policy_hidden.device
        )
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
        validated = (checked, chunk_rows, tokens, want, support, divergence)
        call = GroupCall(roles, suffix, (policy_hidden, ref_hidden), (policy_bias, ref_bias),
                         *(validated if error is None else [None] * len(validated)))
        adapter, vocab = parallel(impl, vocab, error, call)
        if support[0] == "ids":  # the global ids against the whole V (the same on every rank)
            _check_ids_below(support[1][0], vocab)
    if divergence is not None:
        adapter = DivergenceChunks(adapter, *divergence)

    (hp, hr), rows, tok = _flat_rows(
        (policy_hidden, ref_hidden), tokens, checked.mask, vocab, checked.ignore_index, check
    )
    m = hp.shape[0] if rows is None else rows.shape[0]
    chunk = _plan_rows(chunk_rows, m, vocab, policy_weight, ref_weight)
    opts = _Options(checked.temperature, *checked.transforms, want, chunk, adapter, support,
                    expected_grads)
    outs = _LinearKL.apply(
        hp, policy_weight, policy_bias, hr, ref_weight, ref_bias, tok, rows, opts
    )
    if check:
        _check_nan([o for o, bit in zip(outs, Want) if want & bit], checked.named,
                   adapter.any_process)
        if support[0] != "none" and tok is not None:
            _check_on_support(outs[contract.OUT_LOGP], tok, tokens)
    return TokenStats(*(o.reshape(leading) if want & bit else None for o, bit in zip(outs, Want)))
