"""linear_logprobs: token log-probs (and entropy) of one LM head from its hidden states, as
values (a frozen model's no-grad pass), with the kept sets of a sampler's support.

Shape letters: N rows (the product of the leading dims), M the counted rows, R rows of one
chunk, V the vocabulary, H the hidden size.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .. import _validation as v
from ..functional import TokenStats
from ..ops import contract
from ..ops.contract import Want
from ..sampling import parse_support
from ._heads import (
    _check_devices,
    _check_flag,
    _check_head,
    _check_nan,
    _check_on_support,
    _check_run,
    _check_transform,
    _flat_rows,
    _logits,
    _plan_rows,
)
from .chunks import KeptIds, LocalChunks, chunk_keep_tau, want_bits

__all__ = ["linear_logprobs"]


def linear_logprobs(
    hidden: Tensor,
    weight: Tensor,
    tokens: Tensor,
    *,
    bias: Optional[Tensor] = None,
    logit_scale: float = 1.0,
    softcap: Optional[float] = None,
    mask: Optional[Tensor] = None,
    temperature: float = 1.0,
    entropy: bool = False,
    support=None,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    min_p: Optional[float] = None,
    ignore_index: int = -100,
    chunk_rows: Optional[int] = None,
    backend: str = "auto",
    check: bool = True,
    return_support: bool = False,
):
    """log π(token) (and H(π)) of one LM head from its hidden states, as values: the no-grad
    pass of a frozen model (a reference's log-probs, the log-probs of the policy that sampled).

    Shapes: ... leading dims, N their product, H the hidden size, V the vocabulary. The logits
    z = scale·(h Wᵀ + b) (soft-capped) are computed chunk by chunk, one GEMM per chunk, as in
    :func:`linear_kl`, and never held as (N, V); π = softmax(z/T), or π̃ on a sampler's support
    (``support`` / ``top_k`` / ``top_p`` / ``min_p`` as in :func:`linear_kl`). The values equal
    :func:`klpenalty.token_logprobs` and :func:`klpenalty.entropy` of the materialised logits.

    Args:
        hidden: (..., H) float; weight: (V, H), same dtype; bias: optional (V,).
        tokens: (...) integer ids in [0, V) or ``ignore_index``.
        mask: optional (...) bool, True = counts (False rows are never multiplied and give 0).
        logit_scale, softcap, temperature, entropy, support, top_k, top_p, min_p,
            ignore_index, chunk_rows, backend, check: as in :func:`linear_kl`.
        return_support: also return the kept sets of the support at these logits, as
            ``(ids, offsets)`` over the N rows (empty where a row does not count; every token
            without a support): the sets to replay as ``support=`` in later passes on the same
            rows, whatever the weights are then.

    Returns:
        :class:`klpenalty.TokenStats` with ``logprobs`` (and ``entropy`` when asked), (...)
        float32 (float64 for float64 inputs), 0 where not counted; ``kl`` and ``ref_logprobs``
        None. Not differentiable (computed under ``torch.no_grad()``): for gradients use
        :func:`linear_kl` or :func:`linear_policy_loss`. With ``return_support``, the pair
        ``(stats, (ids, offsets))``, int64 ids.

    Raises:
        TypeError / ValueError: as :func:`linear_kl` for the one head.
    """
    _check_head("", hidden, weight, bias)
    leading, device, vocab = hidden.shape[:-1], hidden.device, weight.shape[0]
    named = {"hidden": hidden, "weight": weight, "bias": bias}
    _check_devices(named)
    v.check_tokens(tokens, leading)  # required here
    mask, temperature, ignore_index, impl = _check_run(
        leading, device, tokens=tokens, mask=mask, temperature=temperature,
        ignore_index=ignore_index, chunk_rows=chunk_rows, backend=backend,
    )
    want = want_bits(tokens, _check_flag("entropy", entropy)) & ~(Want.KL | Want.REF_LOGP)
    scale, cap = _check_transform(logit_scale, softcap)
    _check_flag("return_support", return_support)
    support = parse_support(support, top_k, top_p, min_p, (*leading, vocab), device)
    (h,), rows, tok = _flat_rows((hidden,), tokens, mask, vocab, ignore_index, check)
    n = h.shape[0]
    m = n if rows is None else rows.shape[0]
    chunk = _plan_rows(chunk_rows, m, vocab, weight)
    dtype = v.compute_dtype(hidden, weight)
    outs = [hidden.new_zeros(n, dtype=dtype) for _ in range(contract.OUT_COLS)]
    counts, kept_ids = hidden.new_zeros(n, dtype=torch.long), []
    chunks = LocalChunks(impl)  # a compact kept set: each chunk's goes to the op
    with torch.no_grad():
        for r0 in range(0, m, chunk):
            r1 = min(m, r0 + chunk)
            sel = slice(r0, r1) if rows is None else rows[r0:r1]
            z = _logits(h[sel], weight, bias, scale, cap)  # (R, V)
            keep, tau, sampler = chunks.support(support, z, rows, r0, r1, temperature)
            out, st = chunks.forward(z, None, tok[sel], temperature, want, keep, tau, sampler)
            for col, o in enumerate(outs):
                o[sel] = out[:, col]
            if return_support:  # the op's support: keep ∧ z ≥ its threshold (ST_TAU)
                tau_used = st[:, contract.ST_TAU]
                if isinstance(keep, KeptIds):  # the thresholds found, or the sets' dense mask
                    keep, tau_used = chunk_keep_tau(keep, None, st, z.shape)
                if tau_used is None:
                    kept = keep.clone()
                else:
                    tau_used = tau_used.unsqueeze(1)  # float32 (float64)
                    kept = (z if z.dtype == tau_used.dtype else z.to(tau_used.dtype)) >= tau_used
                    if keep is not None:
                        kept &= keep
                counts[sel] = kept.sum(1)
                kept_ids.append(kept.nonzero()[:, 1])
            del z, keep, out, st
    if check:
        _check_nan([o for o, bit in zip(outs, Want) if want & bit], named)
        if support[0] != "none":
            _check_on_support(outs[contract.OUT_LOGP], tok, tokens)
    stats = TokenStats(*(o.reshape(leading) if want & bit else None for o, bit in zip(outs, Want)))
    if not return_support:
        return stats
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    ids = torch.cat(kept_ids) if kept_ids else counts.new_zeros(0)
    return stats, (ids, offsets)
