"""On-policy distillation (OPD): the student samples, a frozen teacher scores every token.

On-policy distillation is the KL penalty with the teacher ν in place of the reference and no
other reward: the student π generates sequences, and training lowers a divergence between π
and ν at the states the student visits. Each recipe below turns, per token, the log-probs of
the sampled tokens (log π(y_t), log ν(y_t)) and, where it needs one, the exact per-token
divergence (:func:`klpenalty.divergence`) into two (..., T) tensors: detached
``advantages`` and a differentiable ``loss``. The caller's objective, per sequence, is

    Σ_t mask_t · (−advantages_t · log π(y_t) + loss_t),

then a mean over sequences (the same reduction for both terms, as for the KL in
docs/gradients.md). With k1_t = log π(y_t) − log ν(y_t), KL_t = KL(π(·|s_t)‖ν(·|s_t)) and
γ the discount (a state u real positions later weighs γ^u, in every recipe; the last column
is the recipe's default):

================== ============================================ ===================== =======
recipe             advantage_t / loss_t                         E[gradient]           γ
================== ============================================ ===================== =======
``sampled_k1``     −Σ_{u≥t} γ^{u−t} k1_u / 0 (Tinker, slime,    γ = 0: Σ_t E[∇KL_t]   0
                   prime-rl, NeMo-RL MOPD, verl PG mode)        (per state); γ = 1:
                                                                ∇KL_seq(π‖ν)
``vopd``           the same + sg(KL_t) / 0 (vOPD, arXiv         the same as           0
                   2605.07865: the exact KL as a baseline)      ``sampled_k1``
``minillm``        −Σ_{u>t} γ^{u−t} k1_u / KL_t (MiniLLM's      the same              1
                   single-step decomposition)
``exact_reverse``  −Σ_{u>t} γ^{u−t} KL_u / KL_t (the split of   the same              1
                   :func:`~klpenalty.full_kl_reward_and_loss`)
``exact_forward``  0 / KL_t(ν‖π) (GKD-style, on student         Σ_t E[∇KL_t(ν‖π)]     —
                   samples)                                     (per state)
``exact_jsd``      0 / JSD_t, β = 0.5                           Σ_t E[∇JSD_t]         —
================== ============================================ ===================== =======

At one discount the four reverse-KL recipes have the *same* expected gradient: the pathwise
part Σ_t E_{s_t~π}[∇KL_t] plus the γ-discounted future part. At γ = 1 that is the gradient of
the sequence-level reverse KL KL_seq(π‖ν) = E_π[Σ_t KL_t]; at γ = 0 (the field's default) it
is the per-state objective alone, which ignores how a token changes the states after it. They
differ in variance: the exact KL as the loss and in the future (``exact_reverse``) had the
least on every test policy; vOPD's exact baseline is unbiased but lowered the variance only on
some of them (it is the mean of k1, not the variance-minimising baseline). The forward KL and the JSD on student samples
optimise a divergence at each visited state with the states held fixed; that is the gradient
of no sequence-level divergence. ``tests/rlhf/test_distill_gradients.py`` proves every claim
by exact enumeration; docs/gradients.md#distillation has the table and the variances.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .. import _validation as v
from ..distillation import DIVERGENCES
from .gradients import _masked_inputs, _next_token_kl

__all__ = ["OPD_RECIPES", "OPDRecipe", "OPDTerms", "opd_terms"]

# what a recipe puts in the advantage (the sampled or exact part of the return)
_ADVANTAGES = (None, "k1", "future_k1", "future_divergence")


def _check_discount(discount: object) -> float:
    g = v.as_real("discount", discount)
    if not 0.0 <= g <= 1.0:  # also rejects NaN
        raise ValueError(f"discount must lie in [0, 1], got {g}")
    return g


@dataclass(frozen=True)
class OPDRecipe:
    """How one on-policy distillation recipe forms its per-token advantage and loss."""

    name: str
    kind: str | None
    """The per-token divergence it needs (a kind of :func:`klpenalty.divergence`), or None."""
    advantage: str | None
    """The return in the advantage: ``"k1"`` −Σ_{u≥t} γ^{u−t} k1_u; ``"future_k1"``
    −Σ_{u>t} γ^{u−t} k1_u; ``"future_divergence"`` the same of the divergence; None: 0."""
    baseline: bool
    """Add the detached divergence to the advantage (vOPD's baseline −KL_t, subtracted)."""
    loss: bool
    """The divergence itself is the per-token loss (differentiable)."""
    discount: float
    """The discount γ that :func:`opd_terms` uses by default."""
    beta: float | None = None
    """The ``beta`` to compute the divergence with (``"jsd"``), None where it takes none."""
    expected_gradient: str = ""
    """E[gradient of the objective], in words."""

    def __post_init__(self) -> None:
        if self.kind is not None:
            v.check_choice("kind", self.kind, DIVERGENCES)
        if self.advantage not in _ADVANTAGES:
            raise ValueError(f"advantage must be one of {list(_ADVANTAGES)}, got {self.advantage!r}")
        if (self.baseline or self.loss or self.advantage == "future_divergence") and not self.kind:
            raise ValueError(f"recipe {self.name!r} uses a divergence but names no kind")
        if self.kind and not (self.baseline or self.loss or self.advantage == "future_divergence"):
            raise ValueError(f"recipe {self.name!r} names kind={self.kind!r} but never uses it")
        _check_discount(self.discount)


OPD_RECIPES: dict[str, OPDRecipe] = {
    r.name: r
    for r in (
        OPDRecipe(
            "sampled_k1", None, "k1", baseline=False, loss=False, discount=0.0,
            expected_gradient="γ = 0: Σ_t E[∇KL_t(π‖ν)] (per state); γ = 1: ∇KL_seq(π‖ν)",
        ),
        OPDRecipe(
            "vopd", "reverse_kl", "k1", baseline=True, loss=False, discount=0.0,
            expected_gradient="that of sampled_k1 at the same γ (the baseline has mean 0)",
        ),
        OPDRecipe(
            "minillm", "reverse_kl", "future_k1", baseline=False, loss=True, discount=1.0,
            expected_gradient="that of sampled_k1 at the same γ; γ = 1: ∇KL_seq(π‖ν)",
        ),
        OPDRecipe(
            "exact_reverse", "reverse_kl", "future_divergence", baseline=False, loss=True,
            discount=1.0,
            expected_gradient="that of sampled_k1 at the same γ; γ = 1: ∇KL_seq(π‖ν)",
        ),
        OPDRecipe(
            "exact_forward", "forward_kl", None, baseline=False, loss=True, discount=0.0,
            expected_gradient="Σ_t E_{s_t~π}[∇KL_t(ν‖π)] (per state, forward)",
        ),
        OPDRecipe(
            "exact_jsd", "jsd", None, baseline=False, loss=True, discount=0.0, beta=0.5,
            expected_gradient="Σ_t E_{s_t~π}[∇JSD_t] (per state)",
        ),
    )
}
"""The recipes of :func:`opd_terms`, by name (the module docstring has the table)."""


class OPDTerms(NamedTuple):
    """The per-token terms of an on-policy distillation objective (see :func:`opd_terms`)."""

    advantages: torch.Tensor
    """(..., T), detached: multiplies log π(y_t) in the policy-gradient term."""
    loss: torch.Tensor
    """(..., T), differentiable where the recipe has a loss term, else zeros."""


def _check_recipe(recipe: object) -> OPDRecipe:
    if isinstance(recipe, OPDRecipe):
        return recipe
    return OPD_RECIPES[v.check_choice("recipe", recipe, tuple(OPD_RECIPES))]


def _discounted_returns(
    rewards: torch.Tensor, mask: torch.Tensor | None, discount: float
) -> torch.Tensor:
    """G_t = Σ_{u≥t} γ^{n(t,u)}·r_u, n(t, u) the number of real positions in (t, u].

    ``rewards`` (..., T) is 0 on padding, which the discount skips (packed or padded rows
    discount by real tokens). Values at padded positions are meaningless (the caller masks).
    For 0 < γ < 1 the sums run in log space, in float64: γ^{n} is never formed on its own,
    so a long row neither overflows γ^{−n} nor underflows γ^{n}.
    """
    if discount == 0.0:
        return rewards
    if discount == 1.0:
        return rewards.flip(-1).cumsum(-1).flip(-1)
    real = torch.ones_like(rewards, dtype=torch.bool) if mask is None else mask
    e = real.cumsum(-1, dtype=torch.float64) * math.log(discount)  # log γ^{n(0, t)}
    r = rewards.to(torch.float64)

    def tail(x: torch.Tensor) -> torch.Tensor:  # Σ_{u≥t} γ^{n(t,u)}·x_u for x ≥ 0
        return ((e + x.log()).flip(-1).logcumsumexp(-1).flip(-1) - e).exp()

    return (tail(r.clamp_min(0.0)) - tail((-r).clamp_min(0.0))).to(rewards.dtype)


def opd_terms(
    recipe: str | OPDRecipe,
    logprobs: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    *,
    token_divergence: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    discount: float | None = None,
    check: bool = True,
) -> OPDTerms:
    """Per-token advantages and loss of an on-policy distillation recipe.

    The objective to minimise, with the returned ``(advantages, loss)``, is per sequence
    Σ_t mask_t·(−advantages_t·log π(y_t) + loss_t), then a mean over sequences::

        adv, loss = opd_terms("vopd", logprobs, teacher_logprobs, token_divergence=kl, mask=mask)
        objective = ((-adv * logprobs + loss) * mask).sum(-1).mean()

    Its expected gradient (on-policy sampling) is the recipe's (:data:`OPD_RECIPES`, the module
    docstring); dividing the batch by a constant changes nothing, dividing each sequence by its
    own length changes the objective. To mix in a task reward, add its advantages to
    ``advantages`` (scaled as you weigh the two); in a PPO-style clipped loss ``advantages``
    takes the place of the usual ones and ``loss`` is added as is.

    >>> import torch
    >>> lp, teacher_lp = torch.tensor([[-1.0, -2.0, -0.5]]), torch.tensor([[-1.5, -1.0, -0.25]])
    >>> opd_terms("sampled_k1", lp, teacher_lp).advantages  # −k1 (Tinker: discount 0)
    tensor([[-0.5000,  1.0000,  0.2500]])
    >>> opd_terms("sampled_k1", lp, teacher_lp, discount=1.0).advantages  # −Σ_{u≥t} k1_u
    tensor([[0.7500, 1.2500, 0.2500]])

    Args:
        recipe: a name of :data:`OPD_RECIPES` (``"sampled_k1"``, ``"vopd"``, ``"minillm"``,
            ``"exact_reverse"``, ``"exact_forward"``, ``"exact_jsd"``) or an :class:`OPDRecipe`.
        logprobs: (..., T) float, log π(y_t) of the sampled tokens (e.g.
            :func:`klpenalty.token_logprobs` of the student's logits; at the sampling
            temperature). Read detached: the caller multiplies it by ``advantages``.
        teacher_logprobs: (..., T) float, log ν(y_t) of the same tokens (detached).
        token_divergence: (..., T) float, the recipe's ``kind`` per token:
            ``klpenalty.divergence(student_logits, teacher_logits, recipe.kind, mask=mask)``
            (with ``beta=recipe.beta`` for the JSD, the same temperature as the log-probs).
            Differentiable where the recipe puts it in the loss; None for ``"sampled_k1"``.
        mask: optional (..., T) bool, True = real (generated) token; False positions get 0 in
            both outputs whatever the inputs hold there, and the discount skips them.
        discount: γ in [0, 1], or None for the recipe's (``OPD_RECIPES[name].discount``: 0 for
            ``sampled_k1`` and ``vopd`` as published, 1 for ``minillm`` and
            ``exact_reverse``). γ = 1 gives the sequence-level reverse-KL gradient.
        check: if True (default), raise ``ValueError`` for NaN or positive log-probs at real
            tokens, a token −inf under both, and, where the advantage holds k1, a token −inf
            under the teacher (k1 = +inf: the teacher gives it no mass); one host sync.
            False skips it.

    Returns:
        ``OPDTerms(advantages, loss)``, (..., T) each, float32 (float64 if any input is
        float64); ``advantages`` detached, ``loss`` carries the gradient of
        ``token_divergence`` (zeros, no gradient, where the recipe has no loss term).

    Raises:
        TypeError / ValueError: an unknown recipe; non-float or mismatched inputs (named, with
            shape and dtype); ``token_divergence`` missing for a recipe that needs it (the
            message names the kind to compute), given to one that takes none, or detached while
            ``logprobs`` carries a gradient and the recipe puts it in the loss; a discount
            outside [0, 1]; with ``check``, the log-prob values above.
    """
    r = _check_recipe(recipe)
    v.check_float("logprobs", logprobs)
    if logprobs.dim() < 1 or logprobs.shape[-1] == 0:
        raise ValueError(
            f"logprobs must have shape (..., T) with T >= 1, got {v.describe(logprobs)}"
        )
    gamma = r.discount if discount is None else _check_discount(discount)
    if not isinstance(check, bool):
        raise TypeError(f"check must be a bool, got {type(check).__name__}")
    v.check_per_token("teacher_logprobs", teacher_logprobs, logprobs.shape)
    if token_divergence is not None:
        v.check_per_token("token_divergence", token_divergence, logprobs.shape)
    if r.kind is None and token_divergence is not None:
        raise ValueError(f"recipe {r.name!r} takes no token_divergence (it uses the sampled "
                         f"tokens' log-probs only); pass None")
    if r.kind is not None and token_divergence is None:
        beta = "" if r.beta is None else f", beta={r.beta}"
        raise ValueError(
            f"recipe {r.name!r} needs token_divergence, the per-token {r.kind!r}: "
            f"klpenalty.divergence(student_logits, teacher_logits, {r.kind!r}{beta}, mask=mask)"
        )
    if (r.loss and torch.is_grad_enabled() and logprobs.requires_grad
            and not token_divergence.requires_grad):
        raise ValueError(
            f"recipe {r.name!r} puts token_divergence in the loss, but it carries no gradient "
            f"while logprobs does ({v.describe(token_divergence)}): compute it from the "
            f"student's logits with gradients enabled"
        )
    if mask is not None:
        mask = v.check_mask(mask, logprobs.shape, logprobs.device)
    lp, tlp, others = _masked_inputs(
        logprobs, teacher_logprobs, mask, {"token_divergence": token_divergence},
        names=("logprobs", "teacher_logprobs"),
    )
    lp, tlp = lp.detach(), tlp.detach()
    if check:
        v.check_logprob_values(lp, tlp, names=("logprobs", "teacher_logprobs"),
                               finite_ref=r.advantage in ("k1", "future_k1"))
    div = others["token_divergence"]  # 0 where masked, differentiable
    zero = torch.zeros((), dtype=lp.dtype, device=lp.device)
    k1 = lp - tlp

    if r.advantage is None or (gamma == 0.0 and r.advantage != "k1"):
        advantages = torch.zeros_like(lp)  # no return, or a future weighed 0
    elif r.advantage == "k1":
        advantages = -_discounted_returns(k1, mask, gamma)
    else:  # the future only: γ·(the return of the next real position's value)
        present = k1 if r.advantage == "future_k1" else div.detach()
        advantages = -gamma * _discounted_returns(_next_token_kl(present, mask), mask, gamma)
    if r.baseline:
        advantages = advantages + div.detach()
    loss = div if r.loss else torch.zeros_like(lp)
    if mask is not None:
        advantages = torch.where(mask, advantages, zero)
    return OPDTerms(advantages.detach(), loss)
