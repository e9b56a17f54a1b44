"""Which gradient does each on-policy distillation recipe give? Proven by exact enumeration.

The tabular autoregressive policies of test_gradients.py (tabular.py: every sequence
enumerated, float64, the same tolerances and reasoning), with the frozen table ``tree.ref`` as
the teacher ν. Each recipe's per-sequence objective is built from the library's public
functions only, as a user writes it: ``token_logprobs`` of the student and teacher,
``klpenalty.divergence`` of the recipe's kind, ``opd_terms``, and
Σ_t mask·(−advantages·log π + loss). Its *expected* gradient is compared with targets
computed here with plain log_softmax formulas: ∇KL_seq(π‖ν), the per-state objectives
Σ_t E_{s_t~π}[∇D_t] (states held fixed) and the γ-discounted reverse-KL gradient.

Run ``PYTHONPATH=src python -m tests.rlhf.test_distill_gradients`` to print the exact
gradient-variance table quoted in docs/gradients.md#distillation.
"""

from __future__ import annotations

import pytest
import torch

from .tabular import (
    TOL_SEQ,
    TOL_STATE,
    TREES,
    OneState,
    Tree,
    assert_differs,
    assert_equal_grad,
    gradient_variance,
    jsd_of_logs,
    kl_of_logs,
    pg_loss,
    token_sum,
)
from klpenalty import (
    OPD_RECIPES,
    divergence,
    full_kl_reward_and_loss,
    opd_terms,
    sampled_kl,
    shaped_rewards,
)

REVERSE = ("sampled_k1", "vopd", "minillm", "exact_reverse")  # the reverse-KL recipes


@pytest.fixture(params=list(TREES), ids=list(TREES))
def tree(request) -> Tree:
    return Tree(**TREES[request.param])


def objective(tree: Tree, name: str, discount: float | None = None,
              teacher: torch.Tensor | None = None) -> torch.Tensor:
    """(S,) the recipe's objective per sequence: Σ_t mask·(−advantages·log π + loss).

    The teacher is ``tree.ref`` (independent random logits) unless ``teacher`` is given.
    """
    recipe = OPD_RECIPES[name]
    teacher = tree.ref if teacher is None else teacher
    lp, teacher_lp = tree.logprobs(tree.theta), tree.logprobs(teacher)
    div = None
    if recipe.kind is not None:
        extra = {} if recipe.beta is None else {"beta": recipe.beta}
        div = divergence(tree.logits(tree.theta), tree.logits(teacher), recipe.kind,
                         mask=tree.mask, temperature=tree.temperature, **extra)
    adv, loss = opd_terms(name, lp, teacher_lp, token_divergence=div, mask=tree.mask,
                          discount=discount)
    assert not adv.requires_grad
    return token_sum(-adv * lp + loss, tree.mask)


def test_the_targets(tree):
    # the discounted target interpolates between the per-state and the sequence gradient
    assert_equal_grad(tree.grad_discounted(1.0), tree.grad_reverse(), TOL_SEQ)
    assert_equal_grad(tree.grad_discounted(0.0), tree.grad_pathwise(), TOL_SEQ)
    half = tree.grad_discounted(0.5)
    assert_differs(half, tree.grad_reverse())
    assert_differs(half, tree.grad_pathwise())
    # the JSD's per-state gradient is neither KL's
    jsd = tree.grad_per_state(lambda a, b: jsd_of_logs(a, b, 0.5))
    assert_differs(jsd, tree.grad_pathwise())
    assert_differs(jsd, tree.grad_pathwise_forward())
    # and the library's divergences are these formulas
    logits, teacher = tree.logits(tree.theta), tree.logits(tree.ref)
    for kind, f in (("reverse_kl", kl_of_logs), ("forward_kl", lambda a, b: kl_of_logs(b, a)),
                    ("jsd", lambda a, b: jsd_of_logs(a, b, 0.5))):
        torch.testing.assert_close(divergence(logits, teacher, kind, mask=tree.mask),
                                   tree.state_value(f, tree.theta, tree.ref),
                                   rtol=0.0, atol=TOL_SEQ)


# ---------------------------------------------------------------------------------------------
# The reverse-KL recipes: the sequence gradient at γ = 1, the per-state one at γ = 0
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", REVERSE)
def test_reverse_recipes_at_discount_1_are_the_sequence_kl_gradient(tree, name):
    g = tree.expected_grad(objective(tree, name, discount=1.0))
    assert_equal_grad(g, tree.grad_reverse(), TOL_SEQ)
    assert_differs(g, tree.grad_pathwise())


@pytest.mark.parametrize("name", REVERSE)
def test_reverse_recipes_at_a_sampling_temperature(name):
    # the log-probs and the divergence at the temperature the student sampled with
    for spec in TREES.values():
        tree = Tree(**spec, temperature=0.7)
        g = tree.expected_grad(objective(tree, name, discount=1.0))
        assert_equal_grad(g, tree.grad_reverse(), TOL_SEQ)


@pytest.mark.parametrize("name", REVERSE)
def test_reverse_recipes_at_discount_0_are_the_per_state_gradient(tree, name):
    # Tinker / slime / vOPD as published (discount 0): each state's KL, not what a token does
    # to the states after it
    g = tree.expected_grad(objective(tree, name, discount=0.0))
    assert_equal_grad(g, tree.grad_pathwise(), TOL_SEQ)
    assert_differs(g, tree.grad_reverse())


@pytest.mark.parametrize("name", REVERSE)
def test_reverse_recipes_share_the_discounted_gradient(tree, name):
    # at any γ the four estimate one thing: the pathwise part plus the γ-discounted future
    g = tree.expected_grad(objective(tree, name, discount=0.5))
    assert_equal_grad(g, tree.grad_discounted(0.5), TOL_SEQ)


def test_default_discounts(tree):
    # sampled_k1 and vopd default to the published 0, minillm and exact_reverse to 1
    for name, target in (("sampled_k1", tree.grad_pathwise()), ("vopd", tree.grad_pathwise()),
                         ("minillm", tree.grad_reverse()),
                         ("exact_reverse", tree.grad_reverse())):
        assert_equal_grad(tree.expected_grad(objective(tree, name)), target, TOL_SEQ)


def test_vopd_baseline_changes_no_expectation(tree):
    for gamma in (0.0, 0.5, 1.0):
        k1 = objective(tree, "sampled_k1", gamma)
        vopd = objective(tree, "vopd", gamma)
        assert_equal_grad(tree.expected_grad(vopd), tree.expected_grad(k1), TOL_SEQ)


def test_sampled_k1_at_discount_1_is_the_k1_reward_sample_by_sample(tree):
    # the same estimate as the RLHF k1-in-the-reward recipe, and exact_reverse the same as
    # full_kl_reward_and_loss with the teacher as ρ, for every sequence
    lp, teacher_lp = tree.logprobs(tree.theta), tree.logprobs(tree.ref)
    zero, mask = torch.zeros_like(tree.scores), tree.mask
    k1 = sampled_kl(lp, teacher_lp, "k1").detach()
    reward_kl, loss_kl = full_kl_reward_and_loss(tree.logits(tree.theta), tree.logits(tree.ref),
                                                 mask=mask)
    pairs = [
        (objective(tree, "sampled_k1", 1.0), pg_loss(lp, shaped_rewards(zero, k1, mask, 1.0), mask)),
        (objective(tree, "exact_reverse", 1.0),
         pg_loss(lp, shaped_rewards(zero, reward_kl, mask, 1.0), mask) + loss_kl.sum(-1)),
    ]
    for ours, rlhf in pairs:
        for i in range(ours.numel()):
            (a,) = torch.autograd.grad(ours[i], tree.theta, retain_graph=True)
            (b,) = torch.autograd.grad(rlhf[i], tree.theta, retain_graph=True)
            assert_equal_grad(a, b, TOL_SEQ)


# ---------------------------------------------------------------------------------------------
# The exact losses on student samples: per-state objectives, not a sequence divergence
# ---------------------------------------------------------------------------------------------


def test_exact_forward_is_the_per_state_forward_kl(tree):
    g = tree.expected_grad(objective(tree, "exact_forward"))
    assert_equal_grad(g, tree.grad_pathwise_forward(), TOL_SEQ)
    assert_differs(g, tree.grad_forward())  # not KL_seq(ν‖π), whose sequences come from ν
    assert_differs(g, tree.grad_reverse())


def test_exact_jsd_is_the_per_state_jsd(tree):
    g = tree.expected_grad(objective(tree, "exact_jsd"))
    assert_equal_grad(g, tree.grad_per_state(lambda a, b: jsd_of_logs(a, b, 0.5)), TOL_SEQ)
    assert_differs(g, tree.grad_reverse())
    assert_differs(g, tree.grad_forward())


# ---------------------------------------------------------------------------------------------
# Exact variance of the one-sequence gradient estimate (trace of the covariance)
# ---------------------------------------------------------------------------------------------

COLUMNS = {  # table column -> (recipe, discount)
    "sampled_k1 γ=0": ("sampled_k1", 0.0),
    "vopd γ=0": ("vopd", 0.0),
    "exact_reverse γ=0": ("exact_reverse", 0.0),
    "sampled_k1 γ=1": ("sampled_k1", 1.0),
    "vopd γ=1": ("vopd", 1.0),
    "minillm γ=1": ("minillm", 1.0),
    "exact_reverse γ=1": ("exact_reverse", 1.0),
    "exact_forward": ("exact_forward", None),
    "exact_jsd": ("exact_jsd", None),
}
TEACHERS = {  # the teacher's logit table: the tree's independent one, or the student's + noise
    "independent": lambda tree: tree.ref,
    "close": lambda tree: tree.old,  # θ + N(0, 0.5²) per logit
}


def variances(tree: Tree, teacher: torch.Tensor) -> dict[str, float]:
    return {col: gradient_variance(tree, objective(tree, name, gamma, teacher))
            for col, (name, gamma) in COLUMNS.items()}


@pytest.mark.parametrize("teacher", TEACHERS)
def test_variance_ordering(tree, teacher):
    var = variances(tree, TEACHERS[teacher](tree))
    # γ = 0, the per-state gradient: the exact KL as the loss has no token noise at all
    assert var["exact_reverse γ=0"] < min(var["vopd γ=0"], var["sampled_k1 γ=0"]), var
    # γ = 1, the sequence gradient: each exact piece lowers it, the present (minillm), then
    # the future too (exact_reverse); the sampled future alone (vopd) does not reach minillm
    assert var["exact_reverse γ=1"] < var["minillm γ=1"], var
    assert var["minillm γ=1"] < min(var["sampled_k1 γ=1"], var["vopd γ=1"]), var


def test_vopd_baseline_lowers_the_variance_only_under_a_condition():
    # One state, tokens a ~ π, g_a = ∇log π(a): the per-token estimates k1·g_a and
    # (k1 − KL)·g_a have the same mean, and their variances differ by
    # KL²·E‖g‖² − 2·KL·E[k1·‖g‖²] (the baseline is the mean of k1, not the variance-minimising
    # E[k1‖g‖²]/E‖g‖²). Both signs occur: the baseline helps at some states and hurts at others.
    signs = set()
    for seed in range(12):
        state = OneState(vocab=4, seed=seed)
        lp, teacher_lp, _ = state.logprobs()
        lp, teacher_lp = lp[:, None], teacher_lp[:, None]  # V one-token sequences
        kl = divergence(state.x.expand(4, 1, 4), state.y.expand(4, 1, 4))
        var = {}
        for name in ("sampled_k1", "vopd"):
            div = None if name == "sampled_k1" else kl
            adv, _ = opd_terms(name, lp, teacher_lp, token_divergence=div)
            grads = torch.stack([torch.autograd.grad(-adv[a, 0] * lp[a, 0], state.x,
                                                     retain_graph=True)[0] for a in range(4)])
            mean = (state.p[:, None] * grads).sum(0)
            var[name] = float((state.p * (grads - mean).square().sum(-1)).sum())
        g = torch.stack([torch.autograd.grad(lp[a, 0], state.x, retain_graph=True)[0]
                         for a in range(4)]).square().sum(-1)  # ‖g_a‖²
        k1, p, kl0 = (lp - teacher_lp)[:, 0].detach(), state.p, state.kl()
        gap = kl0**2 * float((p * g).sum()) - 2 * kl0 * float((p * k1 * g).sum())
        assert abs((var["vopd"] - var["sampled_k1"]) - gap) < TOL_STATE
        signs.add(gap < 0)
    assert signs == {True, False}


def print_variance_table() -> None:
    """The exact gradient variances quoted in docs/gradients.md#distillation."""
    for teacher, table in TEACHERS.items():
        print(f"\nteacher: {teacher}")
        print("| policy | ‖∇KL_seq‖ | ‖per-state‖ | " + " | ".join(COLUMNS) + " |")
        for name, spec in TREES.items():
            tree = Tree(**spec)
            tree.ref = table(tree)  # the targets' ν
            norms = [float(g[: tree.n_states].norm())
                     for g in (tree.grad_reverse(), tree.grad_pathwise())]
            cells = [f"{x:.3f}" for x in [*norms, *variances(tree, tree.ref).values()]]
            print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    print_variance_table()
