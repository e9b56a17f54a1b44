"""TEMPORARY stand-in for ``klpenalty.hf.causal_lm_kl`` (issue 12 writes the real one).

It has the real function's signature and returns, but materialises both models' (B, T, V)
logits and calls :func:`klpenalty.full_kl` / :func:`klpenalty.token_logprobs` /
:func:`klpenalty.entropy` on them. It exists only so that ``klpenalty.integrations.trl`` and its
tests run before the merge, which replaces this file; put nothing else here.

Shape letters: B batch, T sequence, V vocabulary.
"""

from __future__ import annotations

import torch

from . import _validation as v
from .functional import TokenStats, full_kl, token_logprobs
from .functional import entropy as entropy_fn  # the parameter ``entropy`` shadows the name

__all__ = ["causal_lm_kl"]


def causal_lm_kl(
    policy_model,
    ref_model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    labels: torch.Tensor | None = None,
    response_mask: torch.Tensor | None = None,
    temperature: float = 1.0,
    entropy: bool = False,
    position_ids: torch.Tensor | None = None,
    chunk_rows: int | None = None,
    backend: str = "auto",
    check: bool = True,
) -> TokenStats:
    """Exact per-position KL(π‖ρ) of two causal LMs on the same input ids (stand-in).

    Entry t of each (B, T − 1) result is the distribution after the prefix ≤ t, scored on the
    token ``input_ids[:, t + 1]``. Counted positions: ``labels[:, 1:] != -100`` and/or
    ``response_mask[:, 1:]``, and ``attention_mask[:, 1:]``; uncounted positions give 0.

    Args:
        policy_model, ref_model: causal LMs returning ``.logits`` (B, T, V); the reference is
            run without gradient.
        input_ids: (B, T) int64.
        attention_mask: optional (B, T), 1/True = real token.
        labels: optional (B, T) int64, -100 = not counted.
        response_mask: optional (B, T), 1/True = counted (e.g. the generated tokens).
        temperature: > 0, divides both models' logits.
        entropy: also return H(π) per position.
        position_ids: optional (B, T), passed to both models.
        chunk_rows: accepted and ignored by this stand-in.
        backend, check: as in :func:`klpenalty.full_kl`.

    Returns:
        ``TokenStats(kl, logprobs, ref_logprobs, entropy)``, each (B, T − 1) float32 (entropy
        None unless requested); ``kl``, ``logprobs`` and ``entropy`` differentiable with
        respect to the policy's parameters.
    """
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError(f"input_ids must be a (B, T) tensor, got {input_ids!r:.80}")
    b, t = input_ids.shape
    counted = torch.ones(b, t - 1, dtype=torch.bool, device=input_ids.device)
    for name, extra in (("attention_mask", attention_mask), ("response_mask", response_mask)):
        if extra is not None:
            v.check_per_token(name, extra, (b, t), floating=False)
            counted &= extra[:, 1:].bool()
    if labels is not None:
        v.check_per_token("labels", labels, (b, t), floating=False)
        counted &= labels[:, 1:] != -100
    kwargs = {"attention_mask": attention_mask}
    if position_ids is not None:
        kwargs["position_ids"] = position_ids
    policy_logits = policy_model(input_ids=input_ids, **kwargs).logits[:, :-1]
    with torch.no_grad():
        ref_logits = ref_model(input_ids=input_ids, **kwargs).logits[:, :-1]
    tokens = input_ids[:, 1:].masked_fill(~counted, -100)
    common = dict(temperature=temperature, backend=backend, check=check)
    return TokenStats(
        kl=full_kl(policy_logits, ref_logits, mask=counted, **common),
        logprobs=token_logprobs(policy_logits, tokens, **common),
        ref_logprobs=token_logprobs(ref_logits, tokens, **common),
        entropy=entropy_fn(policy_logits, mask=counted, **common) if entropy else None,
    )
