"""shaped_rewards: −β·kl on real tokens, 0 on padding, the score on the last real token."""

from __future__ import annotations

import pytest
import torch

from klpenalty import sampled_kl, shaped_rewards
from klpenalty.rlhf import last_true_index


def test_ziegler_example():
    logp = torch.tensor([[-1.0, -2.0, -3.0]])
    logq = torch.full((1, 3), -1.5)
    k1 = sampled_kl(logp, logq, "k1")
    rewards = shaped_rewards(torch.tensor([2.0]), k1, torch.ones(1, 3, dtype=torch.bool), beta=0.1)
    torch.testing.assert_close(rewards, torch.tensor([[-0.05, 0.05, 2.15]]))


def test_padded_batch():
    # right padding of different lengths, one row with left padding, one with a gap
    kl = torch.arange(1.0, 25.0).reshape(4, 6)
    mask = torch.tensor(
        [
            [1, 1, 1, 1, 1, 1],
            [1, 1, 1, 0, 0, 0],
            [0, 0, 1, 1, 1, 0],
            [1, 0, 1, 0, 0, 0],
        ],
        dtype=torch.bool,
    )
    scores = torch.tensor([10.0, 20.0, 30.0, 40.0])
    out = shaped_rewards(scores, kl, mask, beta=0.5)
    expected = torch.where(mask, -0.5 * kl, torch.zeros(()))
    for row, last in enumerate([5, 2, 4, 2]):
        expected[row, last] += scores[row]
    torch.testing.assert_close(out, expected)
    assert (out[~mask] == 0).all()  # padding gets exactly nothing, not even the score
    # the total reward of each row is its score minus β·(sum of its real-token KL)
    torch.testing.assert_close(out.sum(-1), scores - 0.5 * (kl * mask).sum(-1))


def test_leading_dims_and_dtype():
    kl = torch.rand(2, 3, 5, dtype=torch.float64)
    mask = torch.rand(2, 3, 5) > 0.3
    mask[..., 0] = True
    scores = torch.randn(2, 3)
    out = shaped_rewards(scores, kl, mask, beta=0.2)
    assert out.shape == (2, 3, 5) and out.dtype == torch.float64
    last = last_true_index(mask)
    picked = out.gather(-1, last.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(picked, scores.double() - 0.2 * kl.gather(-1, last.unsqueeze(-1)).squeeze(-1))


def test_row_without_real_token_raises_naming_rows():
    mask = torch.tensor([[True, False], [False, False], [True, True], [False, False]])
    with pytest.raises(ValueError, match=r"row\(s\) \[1, 3\]"):
        shaped_rewards(torch.ones(4), torch.zeros(4, 2), mask, beta=0.1)


def test_beta_zero_and_infinite_kl_on_padding():
    kl = torch.tensor([[0.5, float("inf")]])
    mask = torch.tensor([[True, False]])
    out = shaped_rewards(torch.tensor([1.0]), kl, mask, beta=0.0)
    torch.testing.assert_close(out, torch.tensor([[1.0, 0.0]]))
    out = shaped_rewards(torch.tensor([1.0]), kl, mask, beta=0.1)
    torch.testing.assert_close(out, torch.tensor([[0.95, 0.0]]))


def test_gradient_flows_to_scores_and_kl():
    kl = torch.rand(2, 3, requires_grad=True)
    scores = torch.randn(2, requires_grad=True)
    mask = torch.tensor([[True, True, False], [True, True, True]])
    shaped_rewards(scores, kl, mask, beta=0.3).sum().backward()
    torch.testing.assert_close(scores.grad, torch.ones(2))
    torch.testing.assert_close(kl.grad, -0.3 * mask.float())
