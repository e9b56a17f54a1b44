"""opd_terms: the values of each recipe, the discount, masks, dtypes and argument checks (the
expected gradients are proven in test_distill_gradients.py)."""

from __future__ import annotations

import math

import pytest
import torch

import klpenalty
from klpenalty import (
    DIVERGENCES,
    OPD_RECIPES,
    OPDRecipe,
    divergence,
    full_kl_reward_and_loss,
    opd_terms,
    token_logprobs,
)

F64 = torch.float64


def loop_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """Σ_{u≥t} γ^{(real positions in (t, u])}·r_u over real u, one position at a time."""
    out = torch.zeros_like(rewards, dtype=F64)
    for row in range(rewards.shape[0]):
        g = 0.0
        for t in reversed(range(rewards.shape[1])):
            if mask[row, t]:
                g = float(rewards[row, t]) + gamma * g
                out[row, t] = g
    return out


def problem(b: int = 3, t: int = 6, v: int = 5, seed: int = 0, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    student = torch.randn(b, t, v, generator=g, dtype=dtype).requires_grad_(True)
    teacher = torch.randn(b, t, v, generator=g, dtype=dtype)
    tokens = torch.randint(v, (b, t), generator=g)
    mask = torch.ones(b, t, dtype=torch.bool)
    mask[0, 4:] = False  # right padding
    mask[1, 2] = False  # a hole inside a packed row
    mask[2, 0] = False  # a prompt token first
    return student, teacher, tokens, mask


def inputs(student, teacher, tokens, mask, kind):
    lp = token_logprobs(student, tokens)
    tlp = token_logprobs(teacher, tokens)
    div = None if kind is None else divergence(student, teacher, kind, mask=mask)
    return lp, tlp, div


def test_the_recipes():
    assert set(OPD_RECIPES) >= {"sampled_k1", "vopd", "minillm", "exact_reverse",
                                "exact_forward", "exact_jsd"}
    kinds = {name: r.kind for name, r in OPD_RECIPES.items()}
    assert kinds["sampled_k1"] is None
    assert {kinds[n] for n in ("vopd", "minillm", "exact_reverse")} == {"reverse_kl"}
    assert kinds["exact_forward"] == "forward_kl" and kinds["exact_jsd"] == "jsd"
    assert OPD_RECIPES["exact_jsd"].beta == 0.5
    for name, r in OPD_RECIPES.items():
        assert r.name == name and (r.kind is None or r.kind in DIVERGENCES)
        with pytest.raises(Exception):
            r.discount = 0.5  # frozen
    assert klpenalty.OPD_RECIPES is klpenalty.rlhf.distill.OPD_RECIPES


@pytest.mark.parametrize("gamma", [0.0, 0.3, 0.9, 1.0])
def test_values_of_each_recipe(gamma):
    student, teacher, tokens, mask = problem()
    lp, tlp, _ = inputs(student, teacher, tokens, mask, None)
    k1 = torch.where(mask, (lp - tlp).detach(), torch.zeros((), dtype=F64))
    kl = divergence(student, teacher, "reverse_kl", mask=mask)
    zero = torch.zeros((), dtype=F64)

    adv, loss = opd_terms("sampled_k1", lp, tlp, mask=mask, discount=gamma)
    torch.testing.assert_close(adv, torch.where(mask, -loop_returns(k1, mask, gamma), zero))
    assert loss.eq(0).all() and not loss.requires_grad

    adv_v, loss_v = opd_terms("vopd", lp, tlp, token_divergence=kl, mask=mask, discount=gamma)
    torch.testing.assert_close(adv_v, adv + torch.where(mask, kl.detach(), zero))
    assert loss_v.eq(0).all()

    # the future only: the return from t minus the present term
    adv_m, loss_m = opd_terms("minillm", lp, tlp, token_divergence=kl, mask=mask, discount=gamma)
    future_k1 = loop_returns(k1, mask, gamma) - k1
    torch.testing.assert_close(adv_m, torch.where(mask, -future_k1, zero))
    assert loss_m.requires_grad and torch.equal(loss_m.detach(), kl.detach())

    adv_e, loss_e = opd_terms("exact_reverse", lp, tlp, token_divergence=kl, mask=mask,
                              discount=gamma)
    kl0 = kl.detach()
    torch.testing.assert_close(adv_e, torch.where(mask, -(loop_returns(kl0, mask, gamma) - kl0), zero))
    assert torch.equal(loss_e.detach(), kl0)
    if gamma == 1.0:  # the split of full_kl_reward_and_loss, with the teacher as ρ
        reward_kl, loss_kl = full_kl_reward_and_loss(student, teacher, mask=mask)
        returns = reward_kl.flip(-1).cumsum(-1).flip(-1)
        torch.testing.assert_close(adv_e, torch.where(mask, -returns, zero))
        torch.testing.assert_close(loss_e, loss_kl)

    for name, kind in (("exact_forward", "forward_kl"), ("exact_jsd", "jsd")):
        div = divergence(student, teacher, kind, mask=mask)
        adv_x, loss_x = opd_terms(name, lp, tlp, token_divergence=div, mask=mask, discount=gamma)
        assert adv_x.eq(0).all() and torch.equal(loss_x, div) and loss_x.requires_grad


def test_default_discounts():
    student, teacher, tokens, mask = problem()
    lp, tlp, _ = inputs(student, teacher, tokens, mask, None)
    kl = divergence(student, teacher, mask=mask)
    for name in ("sampled_k1", "vopd", "minillm", "exact_reverse"):
        div = None if name == "sampled_k1" else kl
        default = opd_terms(name, lp, tlp, token_divergence=div, mask=mask)
        explicit = opd_terms(name, lp, tlp, token_divergence=div, mask=mask,
                             discount=OPD_RECIPES[name].discount)
        torch.testing.assert_close(default.advantages, explicit.advantages)
    assert OPD_RECIPES["sampled_k1"].discount == 0.0 and OPD_RECIPES["vopd"].discount == 0.0
    assert OPD_RECIPES["minillm"].discount == 1.0 and OPD_RECIPES["exact_reverse"].discount == 1.0


def test_long_rows_discount_without_overflow():
    # γ^{±n} leaves float64's range past n ≈ 6.7e3 at γ = 0.9 (and float32's past n ≈ 840);
    # the log-space sums never form it
    t, gamma = 8000, 0.9
    g = torch.Generator().manual_seed(1)
    lp = -torch.rand(2, t, generator=g) * 3
    tlp = -torch.rand(2, t, generator=g) * 3
    mask = torch.rand(2, t, generator=g) > 0.1
    adv, _ = opd_terms("sampled_k1", lp, tlp, mask=mask, discount=gamma)
    assert adv.dtype == torch.float32 and torch.isfinite(adv).all()
    k1 = torch.where(mask, lp - tlp, torch.zeros(()))
    # a closed-form check away from the loop: the last real position's return is its k1, and
    # G_t = k1_t + γ·G_{next real}
    idx = mask[0].nonzero().flatten()
    g0 = -adv[0, idx].double()
    torch.testing.assert_close(g0[-1], k1[0, idx[-1]].double(), rtol=0, atol=1e-6)
    torch.testing.assert_close(g0[:-1], k1[0, idx[:-1]].double() + gamma * g0[1:],
                               rtol=1e-5, atol=1e-5)
    assert adv[~mask].eq(0).all()


def test_masked_positions_hold_anything():
    student, teacher, tokens, mask = problem()
    lp, tlp, _ = inputs(student, teacher, tokens, mask, None)
    bad = ~mask
    garbage = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e30], dtype=F64)
    fill = garbage.repeat(int(bad.sum()) // 4 + 1)[: int(bad.sum())]
    lp_bad = lp.clone()
    lp_bad[bad] = fill
    tlp_bad = tlp.clone()
    tlp_bad[bad] = fill.flip(0)
    for name, r in OPD_RECIPES.items():
        div = None
        if r.kind is not None:
            div = divergence(student, teacher, r.kind, mask=mask).clone()
            div[bad] = fill
        for gamma in (0.0, 0.5, 1.0):
            adv, loss = opd_terms(name, lp_bad, tlp_bad, token_divergence=div, mask=mask,
                                  discount=gamma)
            clean = opd_terms(name, lp, tlp, token_divergence=None if div is None else
                              divergence(student, teacher, r.kind, mask=mask), mask=mask,
                              discount=gamma)
            torch.testing.assert_close(adv, clean.advantages)
            assert adv[bad].eq(0).all() and loss[bad].eq(0).all(), name
            zero = torch.zeros((), dtype=F64)
            objective = torch.where(mask, -adv * lp_bad + loss, zero).sum()
            if objective.requires_grad:
                (grad,) = torch.autograd.grad(objective, student, retain_graph=True)
                assert torch.isfinite(grad).all(), name


def test_gradient_reaches_the_student_only_through_the_caller():
    student, teacher, tokens, mask = problem()
    lp, tlp, kl = inputs(student, teacher, tokens, mask, "reverse_kl")
    adv, loss = opd_terms("exact_reverse", lp, tlp, token_divergence=kl, mask=mask)
    assert not adv.requires_grad and loss.requires_grad
    ((-adv * lp + loss) * mask).sum().backward()
    assert student.grad is not None and torch.isfinite(student.grad).all()
    assert student.grad[~mask].eq(0).all()  # nothing from the masked positions


def test_dtypes():
    lp = torch.tensor([[-1.0, -2.0]], dtype=torch.bfloat16)
    tlp = torch.tensor([[-1.5, -0.5]], dtype=torch.bfloat16)
    assert opd_terms("sampled_k1", lp, tlp).advantages.dtype == torch.float32
    assert opd_terms("sampled_k1", lp, tlp.double()).advantages.dtype == F64
    kl = torch.tensor([[0.1, 0.2]], dtype=F64)
    adv, loss = opd_terms("vopd", lp, tlp, token_divergence=kl)
    assert adv.dtype == F64 and loss.dtype == F64
    # without a mask every position is real: γ = 1 sums all later ones
    adv, _ = opd_terms("sampled_k1", lp.float(), tlp.float(), discount=1.0)
    torch.testing.assert_close(adv, torch.tensor([[-(0.5 - 1.5), 1.5]]))


def test_argument_checks():
    lp, tlp = torch.full((2, 3), -1.0), torch.full((2, 3), -2.0)
    kl = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="recipe must be one of"):
        opd_terms("tinker", lp, tlp)
    with pytest.raises(ValueError, match=r"needs token_divergence.*'reverse_kl'"):
        opd_terms("vopd", lp, tlp)
    with pytest.raises(ValueError, match=r"'jsd', beta=0.5"):
        opd_terms("exact_jsd", lp, tlp)
    with pytest.raises(ValueError, match="takes no token_divergence"):
        opd_terms("sampled_k1", lp, tlp, token_divergence=kl)
    with pytest.raises(ValueError, match=r"teacher_logprobs.*\(2, 3\)"):
        opd_terms("sampled_k1", lp, torch.zeros(3, 2))
    with pytest.raises(ValueError, match=r"token_divergence.*\(2, 3\)"):
        opd_terms("vopd", lp, tlp, token_divergence=torch.zeros(2, 4))
    with pytest.raises(TypeError, match="logprobs"):
        opd_terms("sampled_k1", lp.long(), tlp)
    with pytest.raises(TypeError, match="teacher_logprobs must be a torch.Tensor"):
        opd_terms("sampled_k1", lp, [[-1.0] * 3] * 2)
    with pytest.raises(TypeError, match="token_divergence must be a torch.Tensor"):
        opd_terms("minillm", lp.requires_grad_(), tlp, token_divergence=0.1)
    lp = lp.detach()
    with pytest.raises(TypeError, match="mask"):
        opd_terms("sampled_k1", lp, tlp, mask=torch.ones(2, 3))
    with pytest.raises(ValueError, match="logprobs.*T >= 1"):
        opd_terms("sampled_k1", torch.zeros(2, 0), torch.zeros(2, 0))
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="discount"):
            opd_terms("sampled_k1", lp, tlp, discount=bad)
    with pytest.raises(TypeError, match="discount"):
        opd_terms("sampled_k1", lp, tlp, discount="1")
    with pytest.raises(TypeError, match="check"):
        opd_terms("sampled_k1", lp, tlp, check=1)
    # values: positive log-probs (logits passed by mistake), NaN at a real token
    with pytest.raises(ValueError, match="teacher_logprobs.*> 0.0001"):
        opd_terms("sampled_k1", lp, -tlp)
    with pytest.raises(ValueError, match="logprobs.*NaN"):
        opd_terms("sampled_k1", torch.tensor([[float("nan"), -1.0]]), torch.full((1, 2), -1.0))
    opd_terms("sampled_k1", lp, -tlp, check=False)  # skipped on request
    # a sampled token without mass under the teacher: k1 = +inf, where a recipe reads k1
    no_mass = torch.tensor([[-1.0, float("-inf")]])
    for name in ("sampled_k1", "vopd", "minillm"):
        div = None if name == "sampled_k1" else torch.zeros(1, 2)
        with pytest.raises(ValueError, match=r"teacher_logprobs.*-inf.*index \(0, 1\)"):
            opd_terms(name, torch.full((1, 2), -1.0), no_mass, token_divergence=div)
    opd_terms("exact_forward", torch.full((1, 2), -1.0), no_mass, token_divergence=kl[:1, :2])
    # a loss term that carries no gradient while log π does: the pathwise part would be lost
    lp_grad = lp.clone().requires_grad_(True)
    with pytest.raises(ValueError, match="carries no gradient"):
        opd_terms("minillm", lp_grad, tlp, token_divergence=kl)
    with torch.no_grad():
        opd_terms("minillm", lp_grad, tlp, token_divergence=kl)  # values only: fine
    opd_terms("vopd", lp_grad, tlp, token_divergence=kl)  # a baseline is detached anyway


def test_custom_recipes_are_checked():
    custom = OPDRecipe("k1_future_only", None, "future_k1", baseline=False, loss=False,
                       discount=1.0)
    lp, tlp = torch.full((1, 3), -1.0), torch.full((1, 3), -2.0)
    adv, _ = opd_terms(custom, lp, tlp)
    torch.testing.assert_close(adv, torch.tensor([[-2.0, -1.0, 0.0]]))
    with pytest.raises(ValueError, match="kind must be one of"):
        OPDRecipe("x", "kl", "k1", baseline=True, loss=False, discount=0.0)
    with pytest.raises(ValueError, match="names no kind"):
        OPDRecipe("x", None, "k1", baseline=True, loss=False, discount=0.0)
    with pytest.raises(ValueError, match="never uses it"):
        OPDRecipe("x", "jsd", "k1", baseline=False, loss=False, discount=0.0)
    with pytest.raises(ValueError, match="advantage must be one of"):
        OPDRecipe("x", None, "returns", baseline=False, loss=False, discount=0.0)
    with pytest.raises(ValueError, match="discount"):
        OPDRecipe("x", None, "k1", baseline=False, loss=False, discount=2.0)
    assert math.isclose(OPD_RECIPES["vopd"].discount, 0.0)
