"""TEMPORARY stand-in for ``klpenalty.linear_kl`` (issue 12, part 1), so that ``klpenalty.hf``
and its tests run before the fused implementation lands. It MATERIALISES both models' logits of
the counted rows and calls the public logits functions; the real module replaces this file whole.

Shape letters: N rows (the product of the leading dims), M counted rows, H hidden, V vocabulary.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .functional import TokenStats, entropy as _entropy, full_kl, token_logprobs

__all__ = ["linear_kl"]


def linear_kl(
    policy_hidden: torch.Tensor,
    policy_weight: torch.Tensor,
    ref_hidden: torch.Tensor,
    ref_weight: torch.Tensor,
    *,
    tokens: Optional[torch.Tensor] = None,
    mask: Optional[torch.Tensor] = None,
    temperature: float = 1.0,
    policy_bias: Optional[torch.Tensor] = None,
    ref_bias: Optional[torch.Tensor] = None,
    logit_scale: float = 1.0,
    softcap: Optional[float] = None,
    ref_logit_scale: Optional[float] = None,
    ref_softcap: Optional[float] = None,
    entropy: bool = False,
    ignore_index: int = -100,
    chunk_rows: Optional[int] = None,
    backend: str = "auto",
    check: bool = True,
) -> TokenStats:
    """Exact KL(π‖ρ), token log-probs and entropy from hidden states (..., H) and heads (V, H).

    Logits z = scale·(h Wᵀ + b), then cap·tanh(z/cap) when a cap is given, π = softmax(z_p/T),
    ρ = softmax(z_r/T); ``ref_logit_scale`` / ``ref_softcap`` None = the policy's values.
    Rows where ``mask`` is False are never multiplied and give 0. This stand-in builds the
    (M, V) logits of the M counted rows; ``chunk_rows`` is accepted and ignored.

    Returns:
        TokenStats(kl, logprobs, ref_logprobs, entropy), each (...) or None.
    """
    del chunk_rows
    leading = policy_hidden.shape[:-1]
    n = policy_hidden[..., 0].numel()
    rows = None if mask is None else mask.reshape(-1).nonzero().squeeze(1)  # (M,)

    def logits(h, w, b, scale, cap):  # (M, V)
        h = h.reshape(n, h.shape[-1])
        if rows is not None:
            h = h.index_select(0, rows)
        z = F.linear(h, w, b) * scale
        return z if cap is None else cap * torch.tanh(z / cap)

    scale_r = logit_scale if ref_logit_scale is None else ref_logit_scale
    cap_r = softcap if ref_softcap is None else ref_softcap
    zp = logits(policy_hidden, policy_weight, policy_bias, logit_scale, softcap)
    zr = logits(ref_hidden, ref_weight, ref_bias, scale_r, cap_r)

    def spread(x):  # (M,) -> (...), 0 on rows that are not counted
        if rows is not None:
            x = x.new_zeros(n).index_copy(0, rows, x)
        return x.reshape(leading)

    opts = dict(temperature=temperature, backend=backend, check=check)
    kl = spread(full_kl(zp, zr, **opts))
    logprobs = ref_logprobs = None
    if tokens is not None:
        tok = tokens.reshape(-1)
        if rows is not None:
            tok = tok.index_select(0, rows)
        lp = dict(opts, ignore_index=ignore_index)
        logprobs = spread(token_logprobs(zp, tok, **lp))
        ref_logprobs = spread(token_logprobs(zr, tok, **lp))
    ent = spread(_entropy(zp, **opts)) if entropy else None
    return TokenStats(kl, logprobs, ref_logprobs, ent)
