"""Sampled-token estimators against closed forms (Schulman 2020, two unit Gaussians)."""

from __future__ import annotations

import math

import pytest
import torch

from klpenalty import ESTIMATORS, sampled_kl
from klpenalty.ops.reference import sampled_kl_reference


def test_hand_values():
    logp = torch.tensor([-1.0, -2.0, -3.0])
    logq = torch.full((3,), -1.5)
    torch.testing.assert_close(sampled_kl(logp, logq, "k1"), torch.tensor([0.5, -0.5, -1.5]))
    torch.testing.assert_close(sampled_kl(logp, logq, "k2"), torch.tensor([0.125, 0.125, 1.125]))
    torch.testing.assert_close(sampled_kl(logp, logq, "abs"), torch.tensor([0.5, 0.5, 1.5]))
    d = torch.tensor([-0.5, 0.5, 1.5], dtype=torch.float64)
    torch.testing.assert_close(sampled_kl(logp, logq, "k3"), (d.exp() - 1 - d).float())


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3", "abs"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_matches_reference_formula(estimator, dtype):
    logp = (-torch.rand(4, 7, dtype=torch.float64) * 5).to(dtype)
    logq = (-torch.rand(4, 7, dtype=torch.float64) * 5).to(dtype)
    out = sampled_kl(logp, logq, estimator)
    assert out.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    # float32 math on inputs of magnitude <= 5 and ratios up to e^5: ~1e-6 relative
    rtol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(out.double(), sampled_kl_reference(logp, logq, estimator), rtol=rtol, atol=rtol)


def test_k3_has_no_cancellation_and_is_never_negative():
    # d = log ρ − log π = 1e-8: k3 = d²/2 + O(d³) = 5e-17; (r − 1) − log r written literally
    # gives 0 or garbage of order 1e-16 in float64.
    logp = torch.zeros(1, dtype=torch.float64)
    for d in (1e-8, -1e-8, 1e-5, -3e-4):
        val = sampled_kl(logp, logp + d, "k3").item()
        assert val == pytest.approx(d * d / 2 + d**3 / 6, rel=1e-6)
    # float32 inputs: tiny differences still give values >= 0
    lp = -torch.rand(10000)
    lq = lp + torch.randn(10000) * 1e-6
    assert (sampled_kl(lp, lq, "k3") >= 0).all()


@pytest.mark.parametrize("estimator", ["k2", "k3", "abs"])
def test_nonnegative_and_zero_when_equal(estimator):
    lp = -torch.rand(1000) * 10
    lq = -torch.rand(1000) * 10
    assert (sampled_kl(lp, lq, estimator) >= 0).all()
    assert torch.equal(sampled_kl(lp, lp, estimator), torch.zeros(1000))


# Closed forms for π = N(0, 1) (the sampling distribution), ρ = N(μ, 1): log r = μx − μ²/2,
# KL(π‖ρ) = μ²/2. mean/KL and std/KL of each estimator:
#   k1: mean 1,             std 2/μ
#   k2: mean 1 + μ²/4,      std √(2 + μ²)
#   k3: mean 1,             std √(e^{μ²} − 1 − μ²) / (μ²/2)
def _closed_form(estimator: str, mu: float) -> tuple[float, float]:
    kl = mu * mu / 2
    if estimator == "k1":
        return 1.0, 2 / mu
    if estimator == "k2":
        return 1 + mu * mu / 4, math.sqrt(2 + mu * mu)
    return 1.0, math.sqrt(math.exp(mu * mu) - 1 - mu * mu) / kl


@pytest.mark.parametrize("mu", [0.1, 1.0])
@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_gaussian_bias_and_spread(estimator, mu):
    n = 2_000_000
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(n, generator=g, dtype=torch.float64)  # samples from π = N(0, 1)
    logp = -0.5 * x**2  # log-densities up to a common constant, which cancels
    logq = -0.5 * (x - mu) ** 2
    kl = mu * mu / 2
    est = sampled_kl(logp, logq, estimator) / kl  # in units of the true KL
    mean_expected, std_expected = _closed_form(estimator, mu)
    se = std_expected / math.sqrt(n)
    # unbiased (k1, k3) or the known bias μ²/4 (k2), within 4 standard errors
    assert abs(est.mean().item() - mean_expected) < 4 * se
    # the spread matches the closed form within 2% (the sampling error of a std at n = 2e6
    # is < 0.3% here, even for k3's lognormal tail at μ = 1)
    assert est.std().item() == pytest.approx(std_expected, rel=0.02)


def test_gradients_flow_through_estimators():
    logp = torch.tensor([-1.0, -2.0], requires_grad=True)
    logq = torch.tensor([-1.5, -1.5])
    sampled_kl(logp, logq, "k2").sum().backward()
    # d/dlogp ½(logp − logq)² = logp − logq
    torch.testing.assert_close(logp.grad, torch.tensor([0.5, -0.5]))


NINF = float("-inf")
INF = float("inf")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize(
    "estimator, policy_zero, ref_zero",
    # the limits: log π = −inf gives d = log ρ − log π = +inf; log ρ = −inf gives d = −inf
    [("k1", NINF, INF), ("k2", INF, INF), ("k3", INF, INF), ("abs", INF, INF)],
)
def test_one_side_minus_inf_gives_the_infinite_limit(estimator, policy_zero, ref_zero, dtype):
    lp = torch.tensor([NINF, -1.0, -2.0], dtype=dtype)
    ref = torch.tensor([-1.0, NINF, -2.0], dtype=dtype)
    out = sampled_kl(lp, ref, estimator)
    assert out[0].item() == policy_zero and out[1].item() == ref_zero and out[2].item() == 0


def test_k3_gradient_at_minus_inf_policy_logprob_is_not_nan():
    # ∂k3/∂log π = −expm1(d) = −inf at d = +inf; at the finite position it is the usual value
    lp = torch.tensor([NINF, -1.0], requires_grad=True)
    ref = torch.tensor([-1.0, -0.5])
    sampled_kl(lp, ref, "k3").sum().backward()
    assert lp.grad[0].item() == NINF
    torch.testing.assert_close(lp.grad[1], -torch.expm1(torch.tensor(0.5)))


def _bad(at, value, shape=(2, 3)):
    t = torch.full(shape, -1.0)
    t[at] = value
    return t


GOOD = torch.full((2, 3), -1.0)


@pytest.mark.parametrize(
    "lp, ref, words",
    [
        (_bad((1, 2), float("nan")), GOOD, ["logprobs (shape=(2, 3), dtype=torch.float32)", "NaN", "1 position", "(1, 2)"]),
        (GOOD, _bad((0, 1), float("nan")), ["ref_logprobs (shape=(2, 3)", "NaN", "(0, 1)"]),
        # logits passed by mistake: positive entries
        (torch.tensor([[-0.3, 2.1, 0.7], [-1.2, 0.2, 1.5]]), GOOD, ["logprobs (", "> 0.0001", "4 position", "(0, 1)"]),
        (GOOD, _bad((1, 0), 1e-3), ["ref_logprobs (", "> 0.0001", "(1, 0)"]),
        (GOOD, _bad((1, 0), INF), ["ref_logprobs (", "> 0.0001", "(1, 0)"]),
        (_bad((1, 1), NINF), _bad((1, 1), NINF), ["logprobs and ref_logprobs", "both", "probability 0", "(1, 1)"]),
    ],
)
def test_check_rejects_nan_positive_and_double_minus_inf(lp, ref, words):
    for estimator in ESTIMATORS:
        with pytest.raises(ValueError) as info:
            sampled_kl(lp, ref, estimator)
        for word in words:
            assert word in str(info.value), f"{word!r} not in {str(info.value)!r}"
    # check=False skips the (device-syncing) check and computes anyway
    assert sampled_kl(lp, ref, "k1", check=False).shape == (2, 3)


def test_check_allows_rounding_just_above_zero():
    lp = torch.tensor([5e-5, 0.0, -3.0])
    ref = torch.tensor([0.0, 1e-4, -2.0])
    torch.testing.assert_close(sampled_kl(lp, ref, "k1"), torch.tensor([5e-5, -1e-4, -1.0]))


def test_check_must_be_a_bool():
    with pytest.raises(TypeError, match="check"):
        sampled_kl(GOOD, GOOD, "k1", check=1)
