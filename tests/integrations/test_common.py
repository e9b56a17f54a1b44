"""The exact sequence-KL term of the TRL integration (``_common.exact_kl_term``), by enumeration.

On the tabular autoregressive policies of tests/rlhf/test_gradients.py, every sequence
enumerated in float64: the expected gradient of the per-sequence term is exactly ∇KL_seq(π‖ρ)
(on-policy), alone and next to a GRPO-style score term with sequence-level advantages; its
value is the exact KL summed over each sequence; each half alone is not the gradient. The
straight-through helper of the verl/OpenRLHF wrappers is checked on an overflowing surrogate.
"""

from __future__ import annotations

import pytest
import torch

from klpenalty import full_kl, k3_ratio_loss
from klpenalty.integrations._common import _ValueWithGradientOf, exact_kl_term

from ..rlhf.tabular import TOL_SEQ, TREES, Tree, assert_differs, assert_equal_grad
from ..tolerances import tol


def exact_inputs(tree: Tree):
    lp = tree.logprobs(tree.theta)
    kl = full_kl(
        tree.logits(tree.theta), tree.logits(tree.ref), mask=tree.mask,
        temperature=tree.temperature,
    )
    return kl, lp


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("name", list(TREES))
def test_exact_kl_term_is_the_sequence_kl_gradient(name, temperature):
    tree = Tree(**TREES[name], temperature=temperature)
    kl, lp = exact_inputs(tree)
    per_seq = exact_kl_term(kl, lp, lp.detach(), tree.mask)
    g = tree.expected_grad(per_seq)
    assert_equal_grad(g, tree.grad_reverse(), TOL_SEQ)
    assert float(g[tree.n_states].abs().max()) == 0.0  # the padding row: exactly no gradient
    # its value is the exact KL summed over each sequence
    expected = tree.state_kl(tree.theta, tree.ref).sum(-1).detach()
    torch.testing.assert_close(per_seq.detach(), expected, **tol(torch.float64))


@pytest.mark.parametrize("name", list(TREES))
def test_with_a_grpo_style_score_term(name):
    # −A·Σ_t ratio_t (ratio = π/sg π, A = the sequence's score) + β·term: −∇E[score] + β∇KL_seq
    tree, beta = Tree(**TREES[name]), 0.3
    kl, lp = exact_inputs(tree)
    ratio = torch.where(tree.mask, torch.exp(lp - lp.detach()), torch.zeros((), dtype=lp.dtype))
    per_seq = -tree.scores * ratio.sum(-1) + beta * exact_kl_term(kl, lp, lp.detach(), tree.mask)
    grad_score = tree.grad((tree.prob(tree.theta) * tree.scores).sum())
    expected = -grad_score + beta * tree.grad_reverse()
    assert_equal_grad(tree.expected_grad(per_seq), expected, TOL_SEQ)


@pytest.mark.parametrize("name", list(TREES))
def test_each_half_alone_is_not_the_gradient(name):
    tree = Tree(**TREES[name])
    kl, lp = exact_inputs(tree)
    target = tree.grad_reverse()
    pathwise = torch.where(tree.mask, kl, torch.zeros((), dtype=kl.dtype)).sum(-1)
    future = exact_kl_term(kl.detach(), lp, lp.detach(), tree.mask)
    assert_equal_grad(tree.expected_grad(pathwise), tree.grad_pathwise(), TOL_SEQ)
    assert_differs(tree.expected_grad(pathwise), target)
    assert_differs(tree.expected_grad(future), target)


def test_exact_kl_term_rejects_bad_shapes():
    kl = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"kl must have shape \(B, L\)"):
        exact_kl_term(kl[0], kl[0], kl[0], torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"old_logprobs.*shape=\(2, 2\)"):
        exact_kl_term(kl, kl, kl[:, :2], torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(TypeError, match="mask"):
        exact_kl_term(kl, kl, kl, torch.ones(2, 3))


def test_value_with_gradient_of_never_touches_the_surrogate_value():
    # k3_ratio_loss at d = log ρ − log π = 199: value +inf in float32, gradient −d = −199
    lp = torch.tensor([-200.0], requires_grad=True)
    surrogate = k3_ratio_loss(lp, torch.tensor([-1.0]))
    assert torch.isinf(surrogate).all()
    value = torch.tensor([10.0])
    naive = value + surrogate - surrogate.detach()
    assert torch.isnan(naive).all()  # what the usual straight-through would report
    out = _ValueWithGradientOf.apply(value, surrogate)
    assert torch.equal(out, value)
    out.sum().backward()
    assert torch.equal(lp.grad, torch.tensor([-199.0]))
