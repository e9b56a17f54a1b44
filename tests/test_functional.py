"""full_kl, kl_penalized_reward and token_logprobs against the float64 reference."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from klpenalty import full_kl, kl_penalized_reward, token_logprobs
from klpenalty.ops.reference import (
    full_kl_reference,
    kl_penalized_reward_reference,
    token_logprobs_reference,
)

from .conftest import DTYPES, grad_tol, make_logits, tol

# Leading dims of rank 1 to 3, a single row; V = 1, V not a power of two, V above the row
# streaming tile (2**18 elements), so a row is split into vocabulary tiles and merged.
SHAPES = [(1, 7), (5, 1), (6, 1000), (2, 3, 257), (2, 2, 3, 33), (2, (1 << 20) + 3)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_full_kl_matches_reference(shape, dtype):
    x, y = make_logits(shape, dtype)
    kl = full_kl(x, y)
    expected = full_kl_reference(x, y)
    assert kl.shape == shape[:-1]
    assert kl.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    torch.testing.assert_close(kl.double(), expected, **tol(dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_low_precision_error_no_worse_than_twice_plain_pytorch(dtype):
    # DESIGN.md: against float64 on the exact input values, our error must be at most twice
    # that of the plain PyTorch formula evaluated in the input dtype.
    x, y = make_logits((64, 3001), dtype, seed=3)
    exact = full_kl_reference(x, y)
    lp, lq = torch.log_softmax(x, -1), torch.log_softmax(y, -1)
    plain = (lp.exp() * (lp - lq)).sum(-1)
    err_plain = (plain.double() - exact).abs().max().item()
    err_ours = (full_kl(x, y).double() - exact).abs().max().item()
    assert err_ours <= 2 * err_plain
    if dtype != torch.float32:  # upcasting must beat low-precision arithmetic by a wide margin
        assert err_ours < err_plain / 100


def test_hand_values():
    p = torch.tensor([0.5, 0.5]).log()
    q = torch.tensor([0.9, 0.1]).log()
    torch.testing.assert_close(full_kl(p, q).double(), torch.tensor(0.5108256237659907, dtype=torch.float64), atol=1e-6, rtol=0)
    torch.testing.assert_close(full_kl(q, p).double(), torch.tensor(0.3680642071684971, dtype=torch.float64), atol=1e-6, rtol=0)


def test_seed_example():
    logits = torch.tensor([[[2.0, 0.0, 0.0]]])
    reward = torch.tensor([[1.0]])
    out = kl_penalized_reward(logits, logits, reward, beta=0.1)
    assert out.shape == reward.shape
    assert torch.equal(out, torch.tensor([[1.0]]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_identical_logits_give_exactly_zero(dtype):
    x, _ = make_logits((4, 5, 129), dtype)
    x[0, 0, :10] = float("-inf")
    kl = full_kl(x, x.clone())
    assert torch.equal(kl, torch.zeros_like(kl))


def test_minus_inf_support_cases():
    inf = float("inf")
    # policy puts no mass on the second token: KL(δ-ish) = log 2
    kl = full_kl(torch.tensor([0.0, -inf]), torch.tensor([0.0, 0.0]))
    torch.testing.assert_close(kl, torch.tensor(math.log(2)))
    # policy can emit a token the reference cannot: +inf, not NaN
    kl = full_kl(torch.tensor([0.0, 0.0, -inf]), torch.tensor([0.0, -inf, -inf]))
    assert kl.item() == inf
    # both models mask the same vocabulary entries: finite, no NaN, exact value
    x = torch.tensor([[1.0, -inf, 2.0, -inf], [0.5, -inf, -1.0, -inf]], requires_grad=True)
    y = torch.tensor([[0.0, -inf, 0.0, -inf], [0.5, -inf, -1.0, -inf]], requires_grad=True)
    kl = full_kl(x, y)
    torch.testing.assert_close(kl.double(), full_kl_reference(x.detach(), y.detach()), **tol(torch.float32))
    assert kl[1].item() == 0.0
    kl.sum().backward()
    assert torch.isfinite(x.grad).all() and torch.isfinite(y.grad).all()
    assert (x.grad[:, [1, 3]] == 0).all() and (y.grad[:, [1, 3]] == 0).all()


def test_huge_logits_do_not_overflow():
    x = torch.tensor([[1e4, -1e4, 0.0, 1e4 - 1.0], [-1e4, -1e4, -1e4 + 2.0, -1e4]])
    y = torch.tensor([[1e4 - 3.0, 1e4, 0.0, 1e4], [-1e4, 0.0, -1e4, -1e4]])
    kl = full_kl(x, y)
    assert torch.isfinite(kl).all()
    torch.testing.assert_close(kl.double(), full_kl_reference(x, y), **tol(torch.float32))


@pytest.mark.parametrize("dtype", DTYPES)
def test_mask_zeroes_positions_even_with_garbage_logits(dtype):
    x, y = make_logits((3, 4, 50), dtype)
    x[1] = float("-inf")  # a fully masked row of all -inf logits
    y[1] = float("nan")
    x[2, 3] = float("nan")
    mask = torch.ones(3, 4, dtype=torch.bool)
    mask[1] = False
    mask[2, 3] = False
    xg = x.clone().requires_grad_(True)
    yg = y.clone().requires_grad_(True)
    kl = full_kl(xg, yg, mask=mask)
    assert (kl[~mask] == 0).all()
    torch.testing.assert_close(kl[mask].double(), full_kl_reference(x[mask], y[mask]), **tol(dtype))
    (kl * torch.arange(12.0).reshape(3, 4)).sum().backward()
    assert (xg.grad[~mask] == 0).all() and (yg.grad[~mask] == 0).all()
    assert torch.isfinite(xg.grad).all() and torch.isfinite(yg.grad).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_gradients_match_reference_autograd(dtype, temperature):
    # a backward with grad_output other than ones, both models requiring grad
    x, y = make_logits((2, 3, 301), dtype, seed=1)
    g = torch.randn(2, 3, dtype=torch.float64)
    mask = torch.tensor([[True, False, True], [True, True, True]])
    xg, yg = x.clone().requires_grad_(True), y.clone().requires_grad_(True)
    (full_kl(xg, yg, mask=mask, temperature=temperature) * g.to(torch.float32 if dtype != torch.float64 else dtype)).sum().backward()
    xr = x.double().requires_grad_(True)
    yr = y.double().requires_grad_(True)
    ref = torch.where(mask, full_kl_reference(xr, yr, temperature), 0.0)
    (ref * g).sum().backward()
    assert xg.grad.dtype == dtype and yg.grad.dtype == dtype
    torch.testing.assert_close(xg.grad.double(), xr.grad, **grad_tol(dtype))
    torch.testing.assert_close(yg.grad.double(), yr.grad, **grad_tol(dtype))
    # policy gradient rows sum to 0 (softmax is shift invariant), up to the rounding of each
    # entry to the input dtype (half an ulp, relative) plus float32 noise
    row_sums = xg.grad.double().sum(-1)
    bound = xg.grad.double().abs().sum(-1) * torch.finfo(dtype).eps + 1e-6
    assert (row_sums.abs() <= bound).all(), (row_sums, bound)


def test_reference_gets_no_gradient_when_detached():
    x, y = make_logits((4, 17))
    x.requires_grad_(True)
    full_kl(x, y).sum().backward()
    assert x.grad is not None and y.grad is None


def test_gradcheck_full_kl_and_token_logprobs():
    x, y = make_logits((2, 3, 11), torch.float64, seed=2)
    x.requires_grad_(True)
    y.requires_grad_(True)
    mask = torch.tensor([[True, True, False], [True, False, True]])
    assert torch.autograd.gradcheck(lambda a, b: full_kl(a, b, mask=mask, temperature=1.3), (x, y))
    tokens = torch.randint(0, 11, (2, 3))
    assert torch.autograd.gradcheck(lambda a: token_logprobs(a, tokens, temperature=0.8), (x,))


@settings(max_examples=30, deadline=None)
@given(
    rows=st.integers(1, 4),
    vocab=st.integers(1, 40),
    scale=st.floats(0.01, 30.0),
    shift=st.floats(-1e3, 1e3),
    temperature=st.floats(0.1, 10.0),
    seed=st.integers(0, 2**16),
)
def test_properties(rows, vocab, scale, shift, temperature, seed):
    x, y = make_logits((rows, vocab), seed=seed, scale=scale)
    kl = full_kl(x, y, temperature=temperature)
    assert (kl >= 0).all()
    assert torch.equal(full_kl(x, x, temperature=temperature), torch.zeros(rows))
    # invariance to adding a constant to a row's logits (up to float32 rounding of the shift)
    shifted = full_kl(x + shift, y - shift, temperature=temperature)
    torch.testing.assert_close(shifted, kl, atol=1e-4 + 1e-6 * abs(shift) / temperature, rtol=1e-4)
    # temperature divides both models' logits
    torch.testing.assert_close(kl, full_kl(x / temperature, y / temperature), atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(kl.double(), full_kl_reference(x, y, temperature), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", DTYPES)
def test_kl_penalized_reward_matches_reference(dtype):
    x, y = make_logits((3, 6, 97), dtype)
    reward = torch.randn(3, 6)
    mask = torch.rand(3, 6) > 0.3
    out = kl_penalized_reward(x, y, reward, beta=0.25, mask=mask, temperature=1.5)
    expected = kl_penalized_reward_reference(x, y, reward, 0.25, mask, 1.5)
    assert out.shape == reward.shape
    torch.testing.assert_close(out.double(), expected, **tol(dtype))
    # where the mask is False the reward comes back unchanged, bit for bit
    assert torch.equal(out[~mask], reward[~mask])


def test_kl_penalized_reward_gradients_flow_like_the_plain_formula():
    x, y = make_logits((2, 4, 23), torch.float64)
    reward = torch.randn(2, 4, dtype=torch.float64)
    xg, yg = x.clone().requires_grad_(True), y.clone().requires_grad_(True)
    kl_penalized_reward(xg, yg, reward, beta=0.3).sum().backward()
    xr, yr = x.clone().requires_grad_(True), y.clone().requires_grad_(True)
    kl_penalized_reward_reference(xr, yr, reward, 0.3).sum().backward()
    torch.testing.assert_close(xg.grad, xr.grad, **grad_tol(torch.float64))
    torch.testing.assert_close(yg.grad, yr.grad, **grad_tol(torch.float64))


def test_kl_penalized_reward_dtypes_and_beta_zero():
    x, y = make_logits((2, 5, 9), torch.bfloat16)
    reward = torch.randn(2, 5, dtype=torch.bfloat16)
    out = kl_penalized_reward(x, y, reward, beta=0.1)
    assert out.dtype == torch.float32
    # beta = 0 returns the reward even where the KL is infinite (no 0·inf = NaN)
    inf_ref = torch.full((2, 5, 9), float("-inf"))
    inf_ref[..., 0] = 0.0
    out0 = kl_penalized_reward(x, inf_ref, reward, beta=0.0)
    assert torch.equal(out0, reward.float())


@pytest.mark.parametrize(
    "kwargs,words",
    [
        (dict(mask=torch.ones(3, dtype=torch.bool)), ["mask", "(2, 5)"]),
        (dict(temperature=-1.0), ["temperature"]),
        (dict(backend="fastest"), ["backend", "'streaming'"]),
    ],
)
def test_beta_zero_still_validates_every_argument(kwargs, words):
    """beta = 0 used to return the reward before looking at mask, temperature and backend."""
    x, y = make_logits((2, 5, 9))
    with pytest.raises(ValueError) as info:
        kl_penalized_reward(x, y, torch.zeros(2, 5), beta=0.0, **kwargs)
    for w in words:
        assert w in str(info.value)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_token_logprobs_matches_reference(shape, dtype):
    x, _ = make_logits(shape, dtype)
    tokens = torch.randint(0, shape[-1], shape[:-1])
    lp = token_logprobs(x, tokens, temperature=0.9)
    assert lp.shape == shape[:-1]
    torch.testing.assert_close(lp.double(), token_logprobs_reference(x, tokens, 0.9), **tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_token_logprobs_gradient(dtype):
    x, _ = make_logits((3, 4, 61), dtype)
    tokens = torch.randint(0, 61, (3, 4))
    g = torch.randn(3, 4)
    xg = x.clone().requires_grad_(True)
    (token_logprobs(xg, tokens, temperature=2.0) * g.to(torch.float64 if dtype == torch.float64 else torch.float32)).sum().backward()
    xr = x.double().requires_grad_(True)
    (token_logprobs_reference(xr, tokens, 2.0) * g.double()).sum().backward()
    assert xg.grad.dtype == dtype
    torch.testing.assert_close(xg.grad.double(), xr.grad, **grad_tol(dtype))
