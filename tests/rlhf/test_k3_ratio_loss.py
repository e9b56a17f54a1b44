"""k3_ratio_loss numerics: finite gradients where exp overflows, exact values, double backward.

The reference is plain float64 autograd of the literal formula w·((ρ/π − 1) − log(ρ/π)) with
w = exp(log π − stopgrad(log π_old)), on the same input values.
"""

from __future__ import annotations

import pytest
import torch

from klpenalty import k3_ratio_loss

F64 = torch.float64


def literal(lp, ref, old=None, mask=None, clamp=None):
    """The formula as written, in float64, differentiated by autograd (no stabilization)."""
    lp, ref = lp.double(), ref.double()
    old = lp.detach() if old is None else old.double().detach()
    if mask is not None:
        lp, ref, old = (torch.where(mask, t, torch.zeros((), dtype=F64)) for t in (lp, ref, old))
    d = ref - lp
    if clamp is not None:
        d = d.clamp(-clamp, clamp)
    return torch.exp(lp - old) * (torch.exp(d) - 1 - d)


def inputs(dtype, seed=0, n=64):
    """log π, log ρ, log π_old (N,) with |log ρ − log π| up to ~4 and |log π − log π_old| < 1."""
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(n, generator=g, dtype=F64) * 5
    ref = -torch.rand(n, generator=g, dtype=F64) * 5
    old = lp + (torch.rand(n, generator=g, dtype=F64) - 0.5)
    return lp.to(dtype), ref.to(dtype), old.to(dtype)


@pytest.mark.parametrize("off_policy", [False, True])
def test_gradient_is_minus_w_d_where_the_value_overflows(off_policy):
    # d = log ρ − log π = 100 and 300: expm1(d) is inf in float32 (and at 300 the value is inf
    # in any dtype of this test), but ∂(w·k3)/∂log π = −w·d is finite
    lp = torch.tensor([-100.0, -300.0, -1.0], requires_grad=True)
    ref = torch.tensor([0.0, 0.0, -1.0], requires_grad=True)
    old = (lp.detach() - 0.5) if off_policy else None
    w = torch.full((3,), 0.5).exp() if off_policy else torch.ones(3)
    out = k3_ratio_loss(lp, ref, old_logprobs=old)
    assert torch.isinf(out[:2]).all() and (out[:2] > 0).all() and out[2] == 0
    g_lp, g_ref = torch.autograd.grad(out.sum(), (lp, ref))
    d = (ref - lp).detach()
    assert torch.isfinite(g_lp).all()
    torch.testing.assert_close(g_lp, -w * d)
    # ∂/∂log ρ = w·expm1(d): +inf is the truth at d = 100, 300, and 0 at d = 0
    assert torch.isposinf(g_ref[:2]).all() and g_ref[2] == 0


def test_second_derivative_is_finite_where_the_value_overflows():
    # on-policy ∂²(w·k3)/∂(log π)² = w·(1 − d) = −99 at d = 100
    lp = torch.tensor([-100.0], requires_grad=True)
    (g,) = torch.autograd.grad(k3_ratio_loss(lp, torch.zeros(1)).sum(), lp, create_graph=True)
    (h,) = torch.autograd.grad(g.sum(), lp)
    torch.testing.assert_close(g, torch.tensor([-100.0]))
    torch.testing.assert_close(h, torch.tensor([-99.0]))


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("off_policy", [False, True])
@pytest.mark.parametrize("clamp", [None, 1.5])
@pytest.mark.parametrize("masked", [False, True])
def test_value_and_gradients_match_the_literal_formula(dtype, off_policy, clamp, masked):
    lp0, ref0, old0 = inputs(dtype, seed=1)
    if clamp is not None:  # keep every |d| away from the clamp's kink, where both sides differ
        d = (ref0 - lp0).double()
        ref0 = torch.where((d.abs() - clamp).abs() < 1e-3, lp0, ref0)
    old = old0 if off_policy else None
    mask = torch.arange(lp0.numel()) % 3 != 0 if masked else None
    lp, ref = lp0.clone().requires_grad_(True), ref0.clone().requires_grad_(True)
    out = k3_ratio_loss(lp, ref, old_logprobs=old, mask=mask, clamp=clamp)
    g_lp, g_ref = torch.autograd.grad(out.sum(), (lp, ref))

    lp64, ref64 = lp0.double().requires_grad_(True), ref0.double().requires_grad_(True)
    want = literal(lp64, ref64, old, mask, clamp)
    w_lp, w_ref = torch.autograd.grad(want.sum(), (lp64, ref64))

    # float64: both sides round differently only (~1e-15); float32: ~1e-7 relative per op
    # on values and gradients of magnitude up to e^5 ≈ 150
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == F64 else dict(rtol=1e-5, atol=1e-5)
    assert out.dtype == (F64 if dtype == F64 else torch.float32)
    torch.testing.assert_close(out.double(), want.detach(), **tol)
    torch.testing.assert_close(g_lp.double(), w_lp, **tol)
    torch.testing.assert_close(g_ref.double(), w_ref, **tol)
    if masked:
        assert out[~mask].eq(0).all() and g_lp[~mask].eq(0).all() and g_ref[~mask].eq(0).all()
    if clamp is not None:  # the clamp binds somewhere: there log ρ gets no gradient
        bound = (ref0 - lp0).abs() > clamp
        if masked:
            bound &= mask
        assert bound.any() and g_ref[bound].eq(0).all()


def test_small_differences_keep_the_expm1_value():
    # d = 1e-8: k3 = d²/2 + d³/6; (r − 1) − log r written literally would give 0 or ~1e-16
    lp = torch.zeros(4, dtype=F64)
    d = torch.tensor([1e-8, -1e-8, 1e-5, -3e-4], dtype=F64)
    out = k3_ratio_loss(lp, lp + d)
    torch.testing.assert_close(out, d * d / 2 + d**3 / 6, rtol=1e-6, atol=0.0)


@pytest.mark.parametrize("clamp", [None, 1.5])
def test_gradcheck_and_gradgradcheck(clamp):
    # old_logprobs given: on-policy (old = stopgrad(log π)) is not a function that finite
    # differences can see, since perturbing log π moves old with it
    lp0, ref0, old = inputs(F64, seed=2, n=12)
    if clamp is not None:
        d = ref0 - lp0
        ref0 = torch.where((d.abs() - clamp).abs() < 1e-2, lp0, ref0)  # no kink within eps
    mask = torch.arange(12) % 4 != 0
    lp, ref = lp0.requires_grad_(True), ref0.requires_grad_(True)

    def fn(lp, ref):
        return k3_ratio_loss(lp, ref, old_logprobs=old, mask=mask, clamp=clamp)

    assert torch.autograd.gradcheck(fn, (lp, ref))
    assert torch.autograd.gradgradcheck(fn, (lp, ref))
