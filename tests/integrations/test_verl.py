"""klpenalty.integrations.verl.kl_penalty against verl's documented forms, values and gradients.

Values: the same as verl's type (the copy in ``stack_formulas.py``) in float32 and float64,
clamps included. Gradients: ∂/∂log π = w·(log π − log ρ) token by token for every type, and, on
a small categorical enumerated exactly (float64), the *expected* gradient of each form: verl's
k3 has the forward-KL gradient, its k1 none, its k2 and "+" types and every type here the
reverse-KL gradient (off-policy too, with ``old_logprob``).
"""

from __future__ import annotations

import pytest
import torch

from klpenalty import sampled_kl
from klpenalty.integrations.verl import KL_PENALTY_TYPES, kl_penalty

from ..rlhf.tabular import TOL_STATE, OneState, assert_differs, assert_equal_grad
from ..tolerances import tol
from .cases import MildState, logprob_pairs
from .stack_formulas import VERL_TYPES, verl_kl_penalty

ALL_TYPES = [*VERL_TYPES, *(f"{t}+" for t in VERL_TYPES)]


def test_types_are_verls():
    assert set(KL_PENALTY_TYPES) == {*ALL_TYPES, "full"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kind", ALL_TYPES)
def test_value_is_verls(kind, dtype):
    lp, ref, _ = logprob_pairs(dtype)
    ours = kl_penalty(lp, ref, kind)
    torch.testing.assert_close(ours, verl_kl_penalty(lp, ref, kind), **tol(dtype))
    assert ours.dtype == dtype


@pytest.mark.parametrize("kind", ALL_TYPES)
def test_gradient_is_k1_times_score_for_every_type(kind):
    lp, ref, old = logprob_pairs(torch.float64)
    lp.requires_grad_(True)
    (g,) = torch.autograd.grad(kl_penalty(lp, ref, kind).sum(), lp)
    torch.testing.assert_close(g, (lp - ref).detach(), **tol(torch.float64))
    (g_off,) = torch.autograd.grad(kl_penalty(lp, ref, kind, old_logprob=old).sum(), lp)
    w = (lp - old).exp().detach()
    torch.testing.assert_close(g_off, w * (lp - ref).detach(), **tol(torch.float64))


@pytest.mark.parametrize("kind", [f"{t}+" for t in VERL_TYPES] + ["mse", "k2"])
def test_on_policy_gradient_equals_verls_plus_and_k2(kind):
    lp, ref, _ = logprob_pairs(torch.float32)
    lp.requires_grad_(True)
    upstream = torch.randn(lp.shape, generator=torch.Generator().manual_seed(1))
    (ours,) = torch.autograd.grad((kl_penalty(lp, ref, kind) * upstream).sum(), lp)
    (theirs,) = torch.autograd.grad((verl_kl_penalty(lp, ref, kind) * upstream).sum(), lp)
    torch.testing.assert_close(ours, theirs, **tol(torch.float32))


def test_overflowing_k3_keeps_a_finite_value_and_gradient():
    # d = log ρ − log π = 199: e^d overflows float32; verl clamps d at 20, the value at 10
    lp = torch.tensor([-200.0, -1.0], requires_grad=True)
    ref = torch.tensor([-1.0, -200.0])
    kl = kl_penalty(lp, ref, "low_var_kl")
    torch.testing.assert_close(kl.detach(), torch.tensor([10.0, 10.0]), rtol=0.0, atol=0.0)
    kl.sum().backward()
    torch.testing.assert_close(lp.grad, torch.tensor([-199.0, 199.0]), rtol=0.0, atol=0.0)


# ---------------------------------------------------------------------------------------------
# Expected gradients on one state, every token enumerated (tests/rlhf/tabular.OneState)
# ---------------------------------------------------------------------------------------------


@pytest.fixture(params=[0, 1, 2], ids=lambda s: f"seed{s}")
def state(request) -> MildState:
    return MildState(seed=request.param)


def test_verls_own_forms_expected_gradients(state):
    lp, ref, _ = state.logprobs()
    reverse, forward = state.grad_reverse_kl(), state.p - state.q
    # low_var_kl / k3 as a loss (verl's GRPO default): the forward KL(ρ‖π)'s gradient
    for kind in ("low_var_kl", "k3"):
        g = state.expected_grad(verl_kl_penalty(lp, ref, kind))
        assert_equal_grad(g, forward, TOL_STATE)
        assert_equal_grad(g, state.grad_forward_kl(), TOL_STATE)
        assert_differs(g, reverse)
    # k1 as a loss: E[∇log π] = 0
    assert_equal_grad(state.expected_grad(verl_kl_penalty(lp, ref, "kl")), 0 * reverse, TOL_STATE)
    # k2 and every "+" type: the reverse KL's gradient on-policy
    for kind in ("mse", "k2", *(f"{t}+" for t in VERL_TYPES)):
        g = state.expected_grad(verl_kl_penalty(lp, ref, kind))
        assert_equal_grad(g, reverse, TOL_STATE)


@pytest.mark.parametrize("kind", ALL_TYPES)
def test_every_type_here_has_the_reverse_kl_gradient(state, kind):
    lp, ref, old = state.logprobs()
    reverse = state.grad_reverse_kl()
    assert_equal_grad(state.expected_grad(kl_penalty(lp, ref, kind)), reverse, TOL_STATE)
    # off-policy: tokens from π_old, corrected by old_logprob
    g_off = state.expected_grad(kl_penalty(lp, ref, kind, old_logprob=old), state.p_old)
    assert_equal_grad(g_off, reverse, TOL_STATE)


def test_verls_k3_clamp_biases_where_it_binds():
    # seed 0 has a token with k3 > 10: verl clamps the value there, and its gradient is 0
    state = OneState(vocab=4, seed=0)
    lp, ref, _ = state.logprobs()
    assert float((sampled_kl(lp, ref, "k3").detach() > 10).sum()) >= 1
    g = state.expected_grad(verl_kl_penalty(lp, ref, "k3"))
    assert_differs(g, state.p - state.q)
    # this function's gradient does not see the value clamp
    ours = state.expected_grad(kl_penalty(lp, ref, "k3"))
    assert_equal_grad(ours, state.grad_reverse_kl(), TOL_STATE)


def test_off_policy_without_old_logprob_is_biased(state):
    # verl's "+" (and this function without old_logprob) on tokens from π_old: not ∇KL(π‖ρ)
    lp, ref, _ = state.logprobs()
    for per_token in (verl_kl_penalty(lp, ref, "k3+"), kl_penalty(lp, ref, "k3")):
        assert_differs(state.expected_grad(per_token, state.p_old), state.grad_reverse_kl())


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------


def test_full_raises_like_verl_and_points_to_the_exact_kl():
    lp, ref, _ = logprob_pairs(torch.float32)
    with pytest.raises(NotImplementedError, match="causal_lm_kl"):
        kl_penalty(lp, ref, "full")


def test_bad_arguments():
    lp, ref, _ = logprob_pairs(torch.float32)
    with pytest.raises(ValueError, match="kl_penalty must be one of"):
        kl_penalty(lp, ref, "k4")
    with pytest.raises(ValueError, match=r"ref_logprob .*shape=\(4, 5\)"):
        kl_penalty(lp, ref[:, :5], "k1")
    with pytest.raises(ValueError, match=r"old_logprob.*shape=\(4,\)"):
        kl_penalty(lp, ref, "k1", old_logprob=ref[:, 0])
    with pytest.raises(TypeError, match="logprob must be a floating-point"):
        kl_penalty(lp.long(), ref, "k1")
    with pytest.raises(ValueError, match="logprobs"):
        kl_penalty(-lp, ref, "k1")  # positive log-probs: logits passed by mistake
