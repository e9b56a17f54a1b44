"""klpenalty.integrations.openrlhf.compute_approx_kl against OpenRLHF's documented forms.

Values: the same as OpenRLHF's estimator (the copy in ``stack_formulas.py``), clamps included.
Gradients: ∂/∂log π = w·(log π − log ρ) for every estimator, and on a small categorical
enumerated exactly (float64) the expected gradient of each form: OpenRLHF's default k1 loss has
none, its k3 the forward KL's, its k2 and ``unbiased_gradient=True`` the reverse KL's; every
estimator here the reverse KL's, off-policy too, without OpenRLHF's clip of the weight at 10.
"""

from __future__ import annotations

import pytest
import torch

from klpenalty.integrations.openrlhf import KL_ESTIMATORS, compute_approx_kl

from ..rlhf.tabular import TOL_STATE, assert_differs, assert_equal_grad
from ..tolerances import tol
from .cases import MildState, logprob_pairs
from .stack_formulas import OPENRLHF_ESTIMATORS, openrlhf_compute_approx_kl


def test_estimators_are_openrlhfs():
    assert KL_ESTIMATORS == OPENRLHF_ESTIMATORS


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("estimator", OPENRLHF_ESTIMATORS)
def test_value_is_openrlhfs(estimator, dtype):
    lp, ref, old = logprob_pairs(dtype)
    expected = openrlhf_compute_approx_kl(lp, ref, kl_estimator=estimator)
    for ours in (
        compute_approx_kl(lp, ref, kl_estimator=estimator),
        compute_approx_kl(lp, ref, old, estimator, True),  # OpenRLHF's actor passes all five
    ):
        # OpenRLHF computes in float32 whatever the input: compare at float32's tolerance
        torch.testing.assert_close(ours, expected.to(dtype), **tol(torch.float32))
        assert ours.dtype == dtype  # float64 inputs stay float64 here


def test_default_estimator_is_k1():
    lp, ref, _ = logprob_pairs(torch.float32)
    torch.testing.assert_close(compute_approx_kl(lp, ref), (lp - ref).clamp(-10, 10))


@pytest.mark.parametrize("estimator", OPENRLHF_ESTIMATORS)
def test_gradient_is_k1_times_score_for_every_estimator(estimator):
    lp, ref, old = logprob_pairs(torch.float64)
    lp.requires_grad_(True)
    (g,) = torch.autograd.grad(compute_approx_kl(lp, ref, kl_estimator=estimator).sum(), lp)
    torch.testing.assert_close(g, (lp - ref).detach(), **tol(torch.float64))
    off = compute_approx_kl(lp, ref, log_probs_old=old, kl_estimator=estimator)
    (g_off,) = torch.autograd.grad(off.sum(), lp)
    w = (lp - old).exp().detach()
    torch.testing.assert_close(g_off, w * (lp - ref).detach(), **tol(torch.float64))


@pytest.mark.parametrize("estimator", OPENRLHF_ESTIMATORS)
def test_gradient_equals_openrlhfs_unbiased_gradient_where_its_clip_does_not_bind(estimator):
    lp, ref, old = logprob_pairs(torch.float32)
    lp.requires_grad_(True)
    upstream = torch.randn(lp.shape, generator=torch.Generator().manual_seed(1))
    for old_lp in (None, old):  # w = π/π_old ≤ e^1.5 < 10 on these inputs
        ours = compute_approx_kl(lp, ref, old_lp, estimator)
        theirs = openrlhf_compute_approx_kl(lp, ref, old_lp, estimator, unbiased_gradient=True)
        (g_ours,) = torch.autograd.grad((ours * upstream).sum(), lp)
        (g_theirs,) = torch.autograd.grad((theirs * upstream).sum(), lp)
        torch.testing.assert_close(g_ours, g_theirs, **tol(torch.float32))


def test_importance_weight_is_not_clipped():
    lp = torch.tensor([-0.1], dtype=torch.float64, requires_grad=True)
    ref, old = torch.tensor([-2.0], dtype=torch.float64), torch.tensor([-5.0], dtype=torch.float64)
    (g,) = torch.autograd.grad(compute_approx_kl(lp, ref, old, "k3").sum(), lp)
    theirs = openrlhf_compute_approx_kl(lp, ref, old, "k3", unbiased_gradient=True)
    (g_theirs,) = torch.autograd.grad(theirs.sum(), lp)
    w = torch.exp(torch.tensor([4.9], dtype=torch.float64))  # π/π_old = e^4.9 ≈ 134
    torch.testing.assert_close(g, w * 1.9, **tol(torch.float64))
    torch.testing.assert_close(g_theirs, torch.tensor([10.0 * 1.9], dtype=torch.float64))


@pytest.fixture(params=[0, 1, 2], ids=lambda s: f"seed{s}")
def state(request) -> MildState:
    return MildState(seed=request.param)


def test_openrlhfs_own_forms_expected_gradients(state):
    lp, ref, old = state.logprobs()
    reverse = state.grad_reverse_kl()

    def form(*args, **kwargs):
        return openrlhf_compute_approx_kl(lp, ref, *args, **kwargs)

    # the default k1 in the loss: zero expected gradient
    assert_equal_grad(state.expected_grad(form(kl_estimator="k1")), 0 * reverse, TOL_STATE)
    # k3 (GRPO-style): the forward KL(ρ‖π)'s gradient
    g3 = state.expected_grad(form(kl_estimator="k3"))
    assert_equal_grad(g3, state.grad_forward_kl(), TOL_STATE)
    assert_differs(g3, reverse)
    # k2, and every estimator with unbiased_gradient=True: the reverse KL's gradient
    assert_equal_grad(state.expected_grad(form(kl_estimator="k2")), reverse, TOL_STATE)
    for est in OPENRLHF_ESTIMATORS:
        g = state.expected_grad(form(kl_estimator=est, unbiased_gradient=True))
        assert_equal_grad(g, reverse, TOL_STATE)
        g_off = state.expected_grad(form(old, est, unbiased_gradient=True), state.p_old)
        assert_equal_grad(g_off, reverse, TOL_STATE)


@pytest.mark.parametrize("estimator", OPENRLHF_ESTIMATORS)
def test_every_estimator_here_has_the_reverse_kl_gradient(state, estimator):
    lp, ref, old = state.logprobs()
    reverse = state.grad_reverse_kl()
    g = state.expected_grad(compute_approx_kl(lp, ref, kl_estimator=estimator))
    assert_equal_grad(g, reverse, TOL_STATE)
    g_off = state.expected_grad(compute_approx_kl(lp, ref, old, estimator), state.p_old)
    assert_equal_grad(g_off, reverse, TOL_STATE)


def test_bad_arguments():
    lp, ref, _ = logprob_pairs(torch.float32)
    with pytest.raises(ValueError, match="kl_estimator must be one of"):
        compute_approx_kl(lp, ref, kl_estimator="k4")
    with pytest.raises(TypeError, match="log_probs_old must be a tensor or None, got the string"):
        compute_approx_kl(lp, ref, "k3")  # the pre-0.11 positional estimator: now log_probs_old
    with pytest.raises(TypeError, match="unbiased_gradient must be a bool"):
        compute_approx_kl(lp, ref, unbiased_gradient=1)
    with pytest.raises(ValueError, match=r"log_probs_base.*shape=\(4, 5\)"):
        compute_approx_kl(lp, ref[:, :5])
    with pytest.raises(TypeError, match="log_probs must be a floating-point"):
        compute_approx_kl(lp.long(), ref)
