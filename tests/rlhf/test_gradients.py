"""Which KL gradient does each placement give? Proven by exact enumeration, in float64.

A tiny tabular autoregressive policy π and reference ρ: one free logit row per prefix (state),
vocabulary 3-4, horizon 2-3. Every sequence is enumerated, so an expectation over sampled
sequences is a finite weighted sum and the *expected* gradient of a surrogate loss is

    E_seq[∇ surrogate(seq)] = ∇ Σ_seq stopgrad(P(seq)) · surrogate(seq),

computed by autograd, with no sampling. The surrogates are built from the library's public
functions (token_logprobs, full_kl, sampled_kl, shaped_rewards and the klpenalty.rlhf.gradients
forms); the targets (KL values and their gradients) are computed here with plain
log_softmax, independently of the library.

Tolerances: float64 sums of at most a few hundred terms of size ≤ ~10, so rounding is ~1e-14;
1e-12 (single state) and 1e-10 (sequences) leave a wide margin. A biased
form is shown to differ from the reverse-KL gradient by far more (asserted > 1e-3).

Run ``PYTHONPATH=src python -m tests.rlhf.test_gradients`` to print the exact gradient-variance
table quoted in docs/gradients.md.
"""

from __future__ import annotations

import pytest
import torch

from .tabular import (
    DIFFERS,
    F64,
    TOL_SEQ,
    TOL_STATE,
    TREES,
    OneState,
    Tree,
    assert_differs,
    assert_equal_grad,
    gradient_variance,
    pg_loss,
    token_sum,
)
from klpenalty import (
    full_kl,
    full_kl_reward_and_loss,
    k2_loss,
    k3_loss,
    k3_ratio_loss,
    next_token_kl,
    sampled_kl,
    shaped_rewards,
)

# ---------------------------------------------------------------------------------------------
# One state: the per-token identities (a ~ π, or a ~ π_old off-policy)
# ---------------------------------------------------------------------------------------------


@pytest.fixture(params=[0, 1, 2], ids=lambda s: f"seed{s}")
def state(request) -> OneState:
    return OneState(vocab=4, seed=request.param)


def test_target_gradients_match_closed_forms(state):
    # ∂KL(π‖ρ)/∂x = p((log p − log q) − KL); ∂KL(ρ‖π)/∂x = p − q (kl-theory §3)
    p, q = state.p, state.q
    kl = (p * (p.log() - q.log())).sum()
    assert_equal_grad(state.grad_reverse_kl(), p * ((p.log() - q.log()) - kl), TOL_STATE)
    assert_equal_grad(state.grad_forward_kl(), p - q, TOL_STATE)
    # and the library's full_kl gives the reverse-KL gradient by autograd
    (g,) = torch.autograd.grad(full_kl(state.x, state.y), state.x)
    assert_equal_grad(g, state.grad_reverse_kl(), TOL_STATE)


def test_k1_as_loss_has_zero_expected_gradient(state):
    lp, ref, _ = state.logprobs()
    g = state.expected_grad(sampled_kl(lp, ref, "k1"))
    assert_equal_grad(g, torch.zeros_like(g), TOL_STATE)
    assert_differs(state.grad_reverse_kl(), g)


def test_k1_detached_reward_gives_reverse_kl_gradient(state):
    # REINFORCE: E[stopgrad(k1)·∇log π] = ∇KL(π‖ρ)
    lp, ref, _ = state.logprobs()
    g = state.expected_grad(sampled_kl(lp, ref, "k1").detach() * lp)
    assert_equal_grad(g, state.grad_reverse_kl(), TOL_STATE)


def test_k2_as_loss_gives_reverse_kl_gradient(state):
    lp, ref, _ = state.logprobs()
    target = state.grad_reverse_kl()
    assert_equal_grad(state.expected_grad(k2_loss(lp, ref)), target, TOL_STATE)
    assert_equal_grad(state.expected_grad(sampled_kl(lp, ref, "k2")), target, TOL_STATE)


def test_k3_ratio_loss_gives_reverse_kl_gradient(state):
    lp, ref, _ = state.logprobs()
    g = state.expected_grad(k3_ratio_loss(lp, ref))
    assert_equal_grad(g, state.grad_reverse_kl(), TOL_STATE)


def test_k3_as_loss_gives_forward_kl_gradient(state):
    # GRPO's k3 in the loss: E[∇k3] = ∇KL(ρ‖π) = p − q in logit space, not ∇KL(π‖ρ)
    lp, ref, _ = state.logprobs()
    for per_token in (k3_loss(lp, ref), sampled_kl(lp, ref, "k3")):
        g = state.expected_grad(per_token)
        assert_equal_grad(g, state.p - state.q, TOL_STATE)
        assert_equal_grad(g, state.grad_forward_kl(), TOL_STATE)
        assert_differs(g, state.grad_reverse_kl())


def test_k3_detached_reward_gives_reverse_minus_forward(state):
    lp, ref, _ = state.logprobs()
    g = state.expected_grad(sampled_kl(lp, ref, "k3").detach() * lp)
    assert_equal_grad(g, state.grad_reverse_kl() - state.grad_forward_kl(), TOL_STATE)
    assert_differs(g, state.grad_reverse_kl())


def test_k2_and_k3_ratio_have_the_same_gradient_sample_by_sample(state):
    # ∇½k1² = ∇((π/sg π)·k3) = k1·∇log π for every token: identical variance on-policy
    lp, ref, _ = state.logprobs()
    k1 = sampled_kl(lp, ref, "k1").detach()
    for a in range(state.tokens.numel()):
        (g2,) = torch.autograd.grad(k2_loss(lp, ref)[a], state.x, retain_graph=True)
        (g3,) = torch.autograd.grad(k3_ratio_loss(lp, ref)[a], state.x, retain_graph=True)
        (gr,) = torch.autograd.grad(k1[a] * lp[a], state.x, retain_graph=True)
        assert_equal_grad(g2, gr, TOL_STATE)
        assert_equal_grad(g3, gr, TOL_STATE)


def test_values_unbiased_or_not(state):
    lp, ref, old = state.logprobs()
    kl = state.kl()
    p = state.p

    def mean(t, w=p):
        return float((w * t.detach()).sum())

    assert abs(mean(sampled_kl(lp, ref, "k1")) - kl) < TOL_STATE
    assert abs(mean(sampled_kl(lp, ref, "k3")) - kl) < TOL_STATE
    assert abs(mean(k3_loss(lp, ref)) - kl) < TOL_STATE
    assert abs(mean(k3_ratio_loss(lp, ref)) - kl) < TOL_STATE
    # off-policy: tokens from π_old, the ratio makes the value unbiased for KL(π‖ρ) again
    assert abs(mean(k3_ratio_loss(lp, ref, old_logprobs=old), state.p_old) - kl) < TOL_STATE
    # k2's mean is another f-divergence, not the KL
    assert abs(mean(k2_loss(lp, ref)) - kl) > DIFFERS
    # on-policy the ratio is exactly 1 in value
    torch.testing.assert_close(k3_ratio_loss(lp, ref), k3_loss(lp, ref), rtol=0.0, atol=0.0)


def test_off_policy_ratio_restores_the_reverse_kl_gradient(state):
    lp, ref, old = state.logprobs()
    g = state.expected_grad(k3_ratio_loss(lp, ref, old_logprobs=old), state.p_old)
    assert_equal_grad(g, state.grad_reverse_kl(), TOL_STATE)
    # without the ratio, k2 on stale samples is biased (verl's "mse" KL loss off-policy)
    assert_differs(state.expected_grad(k2_loss(lp, ref), state.p_old), state.grad_reverse_kl())


def test_clamp_biases_only_when_it_binds():
    state = OneState(vocab=4, seed=3)
    lp, ref, _ = state.logprobs()
    d = (ref - lp).detach().abs()
    loose = float(d.max()) + 1.0  # binds nowhere: unbiased
    tight = float(d.min()) / 2  # binds everywhere: biased
    target = state.grad_reverse_kl()
    for fn in (k2_loss, k3_ratio_loss):
        assert_equal_grad(state.expected_grad(fn(lp, ref, clamp=loose)), target, TOL_STATE)
        assert_differs(state.expected_grad(fn(lp, ref, clamp=tight)), target)
    forward = state.p - state.q
    assert_equal_grad(state.expected_grad(k3_loss(lp, ref, clamp=loose)), forward, TOL_STATE)
    assert_differs(state.expected_grad(k3_loss(lp, ref, clamp=tight)), state.p - state.q)


# ---------------------------------------------------------------------------------------------
# Sequences: a tabular autoregressive policy, every sequence enumerated
# ---------------------------------------------------------------------------------------------


@pytest.fixture(params=list(TREES), ids=list(TREES))
def tree(request) -> Tree:
    return Tree(**TREES[request.param])


def no_score(tree: Tree) -> torch.Tensor:
    return torch.zeros_like(tree.scores)


def test_enumeration_is_complete(tree):
    torch.testing.assert_close(tree.prob(tree.theta).sum(), torch.tensor(1.0, dtype=F64))
    torch.testing.assert_close(tree.prob(tree.ref).sum(), torch.tensor(1.0, dtype=F64))
    # E_π[Σ_t k1_t] = E_π[Σ_t KL_t]: the two definitions of the sequence KL agree
    seq = tree.seq_kl(tree.theta, tree.theta, tree.ref)
    via_states = (tree.prob(tree.theta) * tree.state_kl(tree.theta, tree.ref).sum(-1)).sum()
    torch.testing.assert_close(seq, via_states, rtol=0.0, atol=TOL_SEQ)


def test_the_three_gradients_differ(tree):
    # the biased forms below are told apart from the truth only if these differ
    reverse, pathwise = tree.grad_reverse(), tree.grad_pathwise()
    assert_differs(reverse, pathwise)
    assert_differs(reverse, tree.grad_forward())
    assert_differs(reverse, tree.grad_pathwise_forward())
    assert_differs(tree.grad_forward(), tree.grad_pathwise_forward())


def test_k1_in_reward_is_the_sequence_kl_gradient(tree):
    lp, ref = tree.logprobs(tree.theta), tree.logprobs(tree.ref)
    rewards = shaped_rewards(no_score(tree), sampled_kl(lp, ref, "k1").detach(), tree.mask, 1.0)
    g = tree.expected_grad(pg_loss(lp, rewards, tree.mask))
    assert_equal_grad(g, tree.grad_reverse(), TOL_SEQ)


def test_k1_in_reward_with_score_and_beta(tree):
    beta = 0.3
    lp, ref = tree.logprobs(tree.theta), tree.logprobs(tree.ref)
    rewards = shaped_rewards(tree.scores, sampled_kl(lp, ref, "k1").detach(), tree.mask, beta)
    g = tree.expected_grad(pg_loss(lp, rewards, tree.mask))
    grad_score = tree.grad((tree.prob(tree.theta) * tree.scores).sum())
    assert_equal_grad(g, -grad_score + beta * tree.grad_reverse(), TOL_SEQ)


def test_k1_as_loss_over_a_sequence_has_zero_expected_gradient(tree):
    lp, ref = tree.logprobs(tree.theta), tree.logprobs(tree.ref)
    g = tree.expected_grad(token_sum(sampled_kl(lp, ref, "k1"), tree.mask))
    assert_equal_grad(g, torch.zeros_like(g), TOL_SEQ)


@pytest.mark.parametrize("loss_fn", [k2_loss, k3_ratio_loss], ids=["k2", "k3_ratio"])
def test_per_token_loss_alone_is_the_pathwise_part_only(tree, loss_fn):
    lp, ref = tree.logprobs(tree.theta), tree.logprobs(tree.ref)
    g = tree.expected_grad(loss_fn(lp, ref, mask=tree.mask).sum(-1))
    assert_equal_grad(g, tree.grad_pathwise(), TOL_SEQ)
    assert_differs(g, tree.grad_reverse())


@pytest.mark.parametrize("loss_fn", [k2_loss, k3_ratio_loss], ids=["k2", "k3_ratio"])
def test_per_token_loss_plus_next_token_k1_reward_is_exact(tree, loss_fn):
    lp, ref = tree.logprobs(tree.theta), tree.logprobs(tree.ref)
    k1 = sampled_kl(lp, ref, "k1")
    rewards = shaped_rewards(no_score(tree), next_token_kl(k1, tree.mask), tree.mask, 1.0)
    per_seq = pg_loss(lp, rewards, tree.mask) + loss_fn(lp, ref, mask=tree.mask).sum(-1)
    assert_equal_grad(tree.expected_grad(per_seq), tree.grad_reverse(), TOL_SEQ)


def test_unshifted_k1_reward_plus_loss_counts_the_present_twice(tree):
    lp, ref = tree.logprobs(tree.theta), tree.logprobs(tree.ref)
    rewards = shaped_rewards(no_score(tree), sampled_kl(lp, ref, "k1").detach(), tree.mask, 1.0)
    per_seq = pg_loss(lp, rewards, tree.mask) + k3_ratio_loss(lp, ref, mask=tree.mask).sum(-1)
    g = tree.expected_grad(per_seq)
    assert_equal_grad(g, tree.grad_reverse() + tree.grad_pathwise(), TOL_SEQ)
    assert_differs(g, tree.grad_reverse())


def test_k3_as_loss_is_per_state_forward_kl(tree):
    lp, ref = tree.logprobs(tree.theta), tree.logprobs(tree.ref)
    g = tree.expected_grad(k3_loss(lp, ref, mask=tree.mask).sum(-1))
    assert_equal_grad(g, tree.grad_pathwise_forward(), TOL_SEQ)
    assert_differs(g, tree.grad_reverse())
    assert_differs(g, tree.grad_forward())  # nor the sequence-level forward KL


def test_k3_in_reward_is_biased(tree):
    lp, ref = tree.logprobs(tree.theta), tree.logprobs(tree.ref)
    rewards = shaped_rewards(no_score(tree), sampled_kl(lp, ref, "k3").detach(), tree.mask, 1.0)
    g = tree.expected_grad(pg_loss(lp, rewards, tree.mask))
    assert_equal_grad(g, tree.grad_reverse() - tree.grad_pathwise_forward(), TOL_SEQ)
    assert_differs(g, tree.grad_reverse())


def test_k3_ratio_off_policy_uses_the_old_state_distribution(tree):
    # the per-token ratio corrects the token; the prefixes stay those of π_old
    lp, ref, old = (tree.logprobs(t) for t in (tree.theta, tree.ref, tree.old))
    per_seq = k3_ratio_loss(lp, ref, old_logprobs=old, mask=tree.mask).sum(-1)
    g = tree.expected_grad(per_seq, sample=tree.old)
    assert_equal_grad(g, tree.grad_pathwise(states_from=tree.old), TOL_SEQ)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_full_kl_reward_and_loss_is_the_sequence_kl_gradient(temperature):
    for spec in TREES.values():
        tree = Tree(**spec, temperature=temperature)
        beta = 0.25
        lp = tree.logprobs(tree.theta)
        reward_kl, loss_kl = full_kl_reward_and_loss(
            tree.logits(tree.theta), tree.logits(tree.ref), mask=tree.mask, temperature=temperature
        )
        assert not reward_kl.requires_grad and loss_kl.requires_grad
        rewards = shaped_rewards(tree.scores, reward_kl, tree.mask, beta)
        per_seq = pg_loss(lp, rewards, tree.mask) + beta * loss_kl.sum(-1)
        grad_score = tree.grad((tree.prob(tree.theta) * tree.scores).sum())
        expected = -grad_score + beta * tree.grad_reverse()
        assert_equal_grad(tree.expected_grad(per_seq), expected, TOL_SEQ)
        # the padding row (all ±500) gets exactly no gradient
        assert float(tree.expected_grad(per_seq)[tree.n_states].abs().max()) == 0.0


def test_full_kl_as_detached_reward_misses_the_pathwise_part(tree):
    # the "obvious" wrong use: full_kl(...).detach() as the per-token reward
    kl = full_kl(tree.logits(tree.theta), tree.logits(tree.ref), mask=tree.mask)
    lp = tree.logprobs(tree.theta)
    rewards = shaped_rewards(no_score(tree), kl.detach(), tree.mask, 1.0)
    g = tree.expected_grad(pg_loss(lp, rewards, tree.mask))
    assert_equal_grad(g, tree.grad_reverse() - tree.grad_pathwise(), TOL_SEQ)  # future part
    assert_differs(g, tree.grad_reverse())


def test_full_kl_as_loss_alone_is_the_pathwise_part(tree):
    logits, ref_logits = tree.logits(tree.theta), tree.logits(tree.ref)
    _, loss_kl = full_kl_reward_and_loss(logits, ref_logits, mask=tree.mask)
    g = tree.expected_grad(loss_kl.sum(-1))
    assert_equal_grad(g, tree.grad_pathwise(), TOL_SEQ)
    assert_differs(g, tree.grad_reverse())


def test_unshifted_full_kl_reward_plus_loss_is_unbiased(tree):
    # KL_t depends on the state only, so E[∇log π(a_t|s_t)·KL_t] = 0: unbiased, but it adds a
    # zero-mean term (more variance than the shifted reward)
    kl = full_kl(tree.logits(tree.theta), tree.logits(tree.ref), mask=tree.mask)
    lp = tree.logprobs(tree.theta)
    rewards = shaped_rewards(no_score(tree), kl.detach(), tree.mask, 1.0)
    per_seq = pg_loss(lp, rewards, tree.mask) + kl.sum(-1)
    assert_equal_grad(tree.expected_grad(per_seq), tree.grad_reverse(), TOL_SEQ)


# ---------------------------------------------------------------------------------------------
# Exact variance of the one-sequence gradient estimate (trace of the covariance)
# ---------------------------------------------------------------------------------------------


def correct_forms(tree: Tree) -> dict[str, torch.Tensor]:
    """Per-sequence surrogate losses (β = 1, no score) whose expected gradient is ∇KL_seq."""
    lp, ref = tree.logprobs(tree.theta), tree.logprobs(tree.ref)
    mask, zero = tree.mask, no_score(tree)
    k1 = sampled_kl(lp, ref, "k1")
    logits, ref_logits = tree.logits(tree.theta), tree.logits(tree.ref)
    kl = full_kl(logits, ref_logits, mask=mask)
    reward_kl, loss_kl = full_kl_reward_and_loss(logits, ref_logits, mask=mask)
    return {
        "k1 detached in the reward": pg_loss(
            lp, shaped_rewards(zero, k1.detach(), mask, 1.0), mask
        ),
        "k3_ratio_loss + next_token_kl(k1) reward": pg_loss(
            lp, shaped_rewards(zero, next_token_kl(k1, mask), mask, 1.0), mask
        ) + k3_ratio_loss(lp, ref, mask=mask).sum(-1),
        "full_kl_reward_and_loss": pg_loss(lp, shaped_rewards(zero, reward_kl, mask, 1.0), mask)
        + loss_kl.sum(-1),
        "full KL unshifted reward + loss": pg_loss(
            lp, shaped_rewards(zero, kl.detach(), mask, 1.0), mask
        ) + kl.sum(-1),
    }


def test_variance_of_the_correct_forms(tree):
    forms = correct_forms(tree)
    for per_seq in forms.values():  # all unbiased ...
        assert_equal_grad(tree.expected_grad(per_seq), tree.grad_reverse(), TOL_SEQ)
    var = {name: gradient_variance(tree, per_seq) for name, per_seq in forms.items()}
    # ... and on these instances the exact KL split has the least variance of them
    best = var.pop("full_kl_reward_and_loss")
    assert best < min(var.values()), (best, var)


def test_k1_reward_and_k3_ratio_split_are_the_same_estimate(tree):
    # With Monte Carlo returns, k1·∇log π_t from the loss plus Σ_{u>t} k1_u·∇log π_t from the
    # shifted reward is, sequence by sequence, the k1-in-the-reward gradient.
    forms = correct_forms(tree)
    a = forms["k1 detached in the reward"]
    b = forms["k3_ratio_loss + next_token_kl(k1) reward"]
    for i in range(a.numel()):
        (ga,) = torch.autograd.grad(a[i], tree.theta, retain_graph=True)
        (gb,) = torch.autograd.grad(b[i], tree.theta, retain_graph=True)
        assert_equal_grad(ga, gb, TOL_SEQ)


# ---------------------------------------------------------------------------------------------
# next_token_kl, masks and argument checks
# ---------------------------------------------------------------------------------------------


def test_next_token_kl_values_and_masks():
    kl = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]], requires_grad=True)
    expected = torch.tensor([[2.0, 3.0, 4.0, 0.0], [6.0, 7.0, 8.0, 0.0]])
    torch.testing.assert_close(next_token_kl(kl), expected)
    mask = torch.tensor([[True, False, True, False], [False, False, False, True]])
    out = next_token_kl(kl, mask)
    torch.testing.assert_close(out, torch.tensor([[3.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]))
    assert not out.requires_grad
    # leading dims of rank 2, float64 in -> float64 out, garbage at masked positions never read
    kl3 = torch.tensor([[[0.5, float("nan"), float("inf"), 0.25]]], dtype=F64)
    mask3 = torch.tensor([[[True, False, False, True]]])
    out3 = next_token_kl(kl3, mask3)
    assert out3.dtype == F64
    torch.testing.assert_close(out3, torch.tensor([[[0.25, 0.0, 0.0, 0.0]]], dtype=F64))
    # a single position has no future
    torch.testing.assert_close(next_token_kl(torch.tensor([3.0])), torch.tensor([0.0]))


def test_loss_forms_ignore_garbage_at_masked_positions():
    lp = torch.tensor([-1.0, -1e4, float("-inf"), -0.5], dtype=F64, requires_grad=True)
    ref = torch.tensor([-2.0, 0.0, 0.0, float("nan")], dtype=F64)
    mask = torch.tensor([True, False, False, False])
    for fn in (k2_loss, k3_ratio_loss, k3_loss):
        out = fn(lp, ref, mask=mask)
        (g,) = torch.autograd.grad(out.sum(), lp)
        assert torch.isfinite(out).all() and torch.isfinite(g).all(), fn.__name__
        assert out[1:].eq(0).all() and g[1:].eq(0).all(), fn.__name__
    # k2 at the real token: ½·1² = 0.5, gradient k1 = 1
    torch.testing.assert_close(k2_loss(lp, ref, mask=mask)[0], torch.tensor(0.5, dtype=F64))


def test_output_dtypes():
    lp = torch.tensor([-1.0, -2.0], dtype=torch.bfloat16)
    ref = torch.tensor([-1.5, -1.5], dtype=torch.bfloat16)
    for fn in (k2_loss, k3_ratio_loss, k3_loss):
        assert fn(lp, ref).dtype == torch.float32
        assert fn(lp.double(), ref).dtype == F64


def test_argument_checks():
    lp, ref = torch.zeros(2, 3), torch.zeros(2, 3)
    for bad in (0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="clamp"):
            k2_loss(lp, ref, clamp=bad)
    with pytest.raises(TypeError, match="clamp"):
        k3_loss(lp, ref, clamp="20")
    with pytest.raises(ValueError, match=r"old_logprobs.*\(2, 3\)"):
        k3_ratio_loss(lp, ref, old_logprobs=torch.zeros(3, 2))
    with pytest.raises(ValueError, match="ref_logprobs"):
        k2_loss(lp, torch.zeros(2, 4))
    with pytest.raises(TypeError, match="mask"):
        k3_loss(lp, ref, mask=torch.ones(2, 3))
    with pytest.raises(TypeError, match="logprobs"):
        k2_loss(torch.zeros(2, 3, dtype=torch.long), ref)
    with pytest.raises(ValueError, match="mask"):
        next_token_kl(torch.zeros(2, 3), torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match="kl"):
        next_token_kl(torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="kl"):
        next_token_kl(torch.zeros(2, 0))
    with pytest.raises(ValueError, match="sequence dim"):
        full_kl_reward_and_loss(torch.zeros(5), torch.zeros(5))


def print_variance_table() -> None:
    """The exact gradient variances quoted in docs/gradients.md."""
    for name, spec in TREES.items():
        tree = Tree(**spec)
        print(f"\n{name}: ‖∇KL_seq‖ = {float(tree.grad_reverse()[: tree.n_states].norm()):.4f}")
        for form, per_seq in correct_forms(tree).items():
            print(f"  {form:45s} trace Var = {gradient_variance(tree, per_seq):.4f}")


if __name__ == "__main__":
    print_variance_table()
