"""Stand-in for ``klpenalty.rlhf.distill`` (``OPD_RECIPES``, ``opd_terms``), used by
:mod:`.distill` only, through one import line there. Delete this file and import the two
names from ``klpenalty.rlhf.distill`` instead once that module exists; the interface is the
same.

Per token (B, T): ``objective = Σ (−advantages·logprobs + loss)·mask``, then the batch's
reduction; ``advantages`` detached, ``loss`` differentiable. With k1_t = log π(y_t) − log ν(y_t)
of the sampled token and D_t the exact per-token divergence of the recipe's ``kind``:

================  ==============  ===================================  ==================
recipe            kind            advantages                           loss
================  ==============  ===================================  ==================
``sampled_k1``    None            −k1_t                                0
``vopd``          reverse_kl      −k1_t + D_t (D_t: a baseline)        0
``minillm``       reverse_kl      −Σ_{u>t} k1_u (sampled future)       D_t
``exact_reverse`` reverse_kl      −Σ_{u>t} D_u (exact future)          D_t
``exact_forward`` forward_kl      0                                    D_t
``exact_jsd``     jsd             0                                    D_t
================  ==============  ===================================  ==================
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from klpenalty.rlhf import next_token_kl

__all__ = ["OPD_RECIPES", "opd_terms"]


@dataclass(frozen=True)
class _Recipe:
    name: str
    kind: str | None


OPD_RECIPES = {
    name: _Recipe(name, kind)
    for name, kind in (
        ("sampled_k1", None),
        ("vopd", "reverse_kl"),
        ("minillm", "reverse_kl"),
        ("exact_reverse", "reverse_kl"),
        ("exact_forward", "forward_kl"),
        ("exact_jsd", "jsd"),
    )
}


def _future(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Σ_{u>t} x_u over the real positions after t (detached)."""
    nxt = next_token_kl(x.detach(), mask)
    return nxt.flip(-1).cumsum(-1).flip(-1) * mask


def opd_terms(recipe, logprobs, teacher_logprobs, *, token_divergence=None, mask=None):
    """``(advantages, loss)``, each (B, T), of ``recipe`` (an entry of :data:`OPD_RECIPES`)."""
    if mask is None:
        mask = torch.ones_like(logprobs, dtype=torch.bool)
    zero = torch.zeros_like(logprobs)
    k1 = torch.where(mask, (logprobs - teacher_logprobs).detach(), zero)
    d = None if recipe.kind is None else torch.where(mask, token_divergence, zero)
    name = recipe.name
    if name == "sampled_k1":
        return -k1, zero
    if name == "vopd":
        return -k1 + d.detach(), zero
    if name == "minillm":
        return -_future(k1, mask), d
    if name == "exact_reverse":
        return -_future(d, mask), d
    return zero, d  # exact_forward, exact_jsd
