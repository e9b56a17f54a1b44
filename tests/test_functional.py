"""full_kl, kl_penalized_reward and token_logprobs against the float64 reference."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from klpenalty import TokenStats, entropy, full_kl, kl_penalized_reward, token_logprobs, token_stats
from klpenalty.sampling import sampling_threshold
from klpenalty.ops.reference import (
    full_kl_reference,
    kl_penalized_reward_reference,
    token_logprobs_reference,
)

from .helpers import DTYPES, grad_tol, make_logits, tol
from klpenalty.ops.reference import kept_set_reference

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
        (dict(top_p=0.0), ["top_p"]),
        (dict(top_k=0), ["top_k"]),
    ],
)
def test_beta_zero_still_validates_every_argument(kwargs, words):
    """beta = 0 still checks mask, temperature and backend before returning the reward."""
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


# ------------------------------------------------------------------ token_stats and support=

def _truncated_reference(x, y, tokens, kept, temperature):
    """KL(π̃‖ρ), log π̃(t), log ρ(t), H(π̃) in float64, written out on the materialised kept
    set: π̃ = softmax over the kept logits (off the support −1e6: float64 mass exactly 0, so
    autograd stays finite and gives no gradient there)."""
    xs = torch.where(kept, x.double(), -1e6) / temperature
    lp = torch.log_softmax(xs, -1)
    lq = torch.log_softmax(y.double() / temperature, -1)
    p = lp.exp()
    kl = torch.where(kept, p * (lp - lq), 0.0).sum(-1)
    h = -torch.where(kept, p * lp, 0.0).sum(-1)
    pick = lambda t: t.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return kl, pick(lp), pick(lq), h


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize(
    "kw",
    [dict(top_k=4), dict(top_p=0.7, temperature=0.8), dict(min_p=0.1, temperature=1.4),
     dict(top_k=10, top_p=0.9, min_p=0.02, temperature=0.7)],
)
def test_token_stats_with_sampler_settings_matches_truncated_reference(dtype, kw):
    x, y = make_logits((2, 3, 41), dtype, seed=11)
    temperature = kw.get("temperature", 1.0)
    kept = kept_set_reference(x, **kw)
    tokens = x.argmax(-1)  # the largest logit is always kept
    tokens[0, 1] = -100
    x.requires_grad_()
    y.requires_grad_()
    s = token_stats(x, y, tokens, entropy=True, **kw)
    assert isinstance(s, TokenStats)
    kl, lp, lq, h = _truncated_reference(x.detach(), y.detach(), tokens.clamp_min(0), kept, temperature)
    ignored = tokens == -100
    for got, want in ((s.kl, kl), (s.logprobs, lp.masked_fill(ignored, 0)),
                      (s.ref_logprobs, lq.masked_fill(ignored, 0)), (s.entropy, h)):
        torch.testing.assert_close(got.double(), want, **tol(dtype))
    # gradients through π̃, non-unit upstream gradients on every field
    g = torch.linspace(-1.0, 2.0, 24).reshape(2, 3, 4).double()
    loss = sum((f * g[..., i].to(f.dtype)).sum() for i, f in enumerate(s))
    gx, gy = torch.autograd.grad(loss, (x, y))
    xr, yr = x.detach().double().requires_grad_(), y.detach().double().requires_grad_()
    ref = _truncated_reference(xr, yr, tokens.clamp_min(0), kept, temperature)
    ref = [r if i in (0, 3) else r.masked_fill(ignored, 0) for i, r in enumerate(ref)]
    wx, wy = torch.autograd.grad(sum((r * g[..., i]).sum() for i, r in enumerate(ref)), (xr, yr))
    torch.testing.assert_close(gx.double(), wx, **grad_tol(dtype))
    torch.testing.assert_close(gy.double(), wy, **grad_tol(dtype))
    assert torch.all(gx[~kept] == 0)


def test_support_forms_agree_and_the_views_are_token_stats():
    x, y = make_logits((3, 4, 29), seed=12)
    tokens = x.argmax(-1)
    tau = sampling_threshold(x, top_k=5, top_p=0.85)
    dense = x >= tau.unsqueeze(-1)
    rows, ids = dense.reshape(12, 29).nonzero(as_tuple=True)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), torch.bincount(rows, minlength=12).cumsum(0)])
    mask = torch.ones(3, 4, dtype=torch.bool)
    mask[2, 3] = False
    forms = [dict(top_k=5, top_p=0.85), dict(support=dense), dict(support=(ids, offsets))]
    outs = [token_stats(x, y, tokens, mask=mask, entropy=True, **f) for f in forms]
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    # a kept set no threshold describes (a sampler broke a tie at the top and kept id 3 only):
    # the dense mask path, the same numbers as the dense form
    x2 = x.clone()
    x2[..., 3] = x2[..., 4] = x2.amax(-1) + 1
    broken = torch.zeros_like(dense)
    broken[..., 3] = True
    r2, i2 = broken.reshape(12, 29).nonzero(as_tuple=True)
    o2 = torch.cat([torch.zeros(1, dtype=torch.long), torch.bincount(r2, minlength=12).cumsum(0)])
    t2 = torch.full((3, 4), 3)
    a = token_stats(x2, y, t2, support=(i2, o2), entropy=True)
    b = token_stats(x2, y, t2, support=broken, entropy=True)
    for u, w in zip(a, b):
        torch.testing.assert_close(u, w)
    assert torch.all(a.logprobs == 0) and torch.all(a.entropy == 0)  # one kept token
    torch.testing.assert_close(a.kl, -a.ref_logprobs)  # KL(δ_t‖ρ) = −log ρ(t)
    # the views: one field of token_stats, the same support arguments
    kw = dict(top_k=5, top_p=0.85, temperature=0.9)
    s = token_stats(x, y, tokens, mask=mask, entropy=True, **kw)
    torch.testing.assert_close(full_kl(x, y, mask=mask, **kw), s.kl)
    torch.testing.assert_close(entropy(x, mask=mask, **kw), s.entropy)
    lp = token_logprobs(x, tokens, **kw)
    torch.testing.assert_close(lp[mask], s.logprobs[mask])
    assert s.logprobs[2, 3].item() == 0.0  # masked


def test_token_stats_fields_backends_and_errors():
    x, y = make_logits((2, 5, 13), seed=13)
    tokens = x.argmax(-1)
    s = token_stats(x, tokens=tokens)
    assert s.kl is None and s.ref_logprobs is None and s.entropy is None
    torch.testing.assert_close(s.logprobs, token_logprobs(x, tokens))
    s = token_stats(x, y)
    assert s.logprobs is None and s.entropy is None
    torch.testing.assert_close(s.kl, full_kl(x, y))
    s = token_stats(x, entropy=True)
    torch.testing.assert_close(s.entropy, entropy(x))
    a = token_stats(x, y, tokens, entropy=True, top_k=3, backend="streaming")
    b = token_stats(x, y, tokens, entropy=True, top_k=3, backend="native")
    for u, w in zip(a, b):
        torch.testing.assert_close(u, w)
    with pytest.raises(ValueError, match="nothing to compute"):
        token_stats(x)
    with pytest.raises(TypeError, match="entropy must be a bool"):
        token_stats(x, entropy=1)
    with pytest.raises(ValueError, match="policy_logits and ref_logits must have the same shape"):
        token_stats(x, y[..., :-1])
    with pytest.raises(TypeError, match="tokens must be an integer tensor"):
        token_stats(x, tokens=tokens.float())
    with pytest.raises(ValueError, match="support and top_p both given"):
        full_kl(x, y, support=torch.ones_like(x, dtype=torch.bool), top_p=0.5)
    with pytest.raises(ValueError, match=r"top_k must be >= 1"):
        token_logprobs(x, tokens, top_k=0)
    # a sampled token outside the support, named by position; with check=False: −inf
    bad = tokens.clone()
    bad[1, 2] = x[1, 2].argmin()
    with pytest.raises(ValueError, match=rf"sampled token {int(bad[1, 2])} at position \(1, 2\) is outside the support"):
        token_stats(x, y, bad, top_k=2)
    with pytest.raises(ValueError, match=r"at position \(1, 2\) is outside the support"):
        token_logprobs(x, bad, min_p=0.5)
    assert token_logprobs(x, bad, top_k=2, check=False)[1, 2].item() == float("-inf")
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[1, 2] = False
    assert token_stats(x, y, bad, mask=mask, top_k=2).logprobs[1, 2].item() == 0.0
    # NaN logits are still reported with a support that would cut them away
    xn = x.clone()
    xn[0, 0, x[0, 0].argmin()] = float("nan")
    with pytest.raises(ValueError, match="policy_logits contains NaN"):
        full_kl(xn, y, top_k=2)


def test_reward_and_loss_forms_take_the_sampling_support():
    """kl_penalized_reward and full_kl_reward_and_loss penalise KL(π̃‖ρ) of the policy that
    sampled, against the float64 reference on the truncated logits; gradients too."""
    from klpenalty import full_kl_reward_and_loss
    from klpenalty.ops.contract import kept_logits
    from klpenalty.ops.reference import full_kl_reference

    x, y = make_logits((2, 6, 40), torch.float32, seed=12, scale=2.0)
    reward = torch.linspace(-1.0, 1.0, 12).reshape(2, 6)
    tau = sampling_threshold(x, top_p=0.8, temperature=0.9)
    want_kl = full_kl_reference(kept_logits(x.double(), None, tau.double()), y, 0.9)
    got = kl_penalized_reward(x, y, reward, 0.2, temperature=0.9, top_p=0.8)
    torch.testing.assert_close(got.double(), reward.double() - 0.2 * want_kl, **tol(torch.float32))
    assert not torch.allclose(want_kl, full_kl_reference(x, y, 0.9))  # the support matters
    xg = x.clone().requires_grad_()
    reward_kl, loss_kl = full_kl_reward_and_loss(xg, y, temperature=0.9, top_p=0.8)
    torch.testing.assert_close(loss_kl.double(), want_kl, **tol(torch.float32))
    torch.testing.assert_close(reward_kl[:, :-1], loss_kl.detach()[:, 1:])
    (g,) = torch.autograd.grad(loss_kl.sum(), xg)
    xr = x.double().requires_grad_()
    kept = torch.isfinite(kept_logits(x.double(), None, tau.double()))
    (gr,) = torch.autograd.grad(
        full_kl_reference(torch.where(kept, xr, -1e6), y, 0.9).sum(), xr
    )
    torch.testing.assert_close(g.double(), gr, **grad_tol(torch.float32))
    assert torch.all(g[~kept] == 0)
