"""nn.Module wrappers: the same numbers as the functions, settings validated up front."""

from __future__ import annotations

import pytest
import torch

import klpenalty
from klpenalty import AdaptiveKLController, FullKL, KLPenalty
from tests.helpers import make_logits


def test_full_kl_module_equals_the_function_and_has_no_parameters():
    x, y = make_logits((2, 3, 17))
    mask = torch.tensor([[True, False, True], [True, True, True]])
    module = FullKL(temperature=0.8)
    assert list(module.parameters()) == []
    torch.testing.assert_close(
        module(x, y, mask), klpenalty.full_kl(x, y, mask=mask, temperature=0.8), rtol=0, atol=0
    )
    assert "temperature=0.8" in repr(module)


def test_kl_penalty_reads_the_controller_at_every_call():
    x, y = make_logits((2, 5, 11), seed=1)
    reward = torch.randn(2, 5)
    ctl = AdaptiveKLController(init_beta=0.1, target=1.0, horizon=10)
    penalty = KLPenalty(ctl)
    first = penalty(x, y, reward)
    torch.testing.assert_close(first, klpenalty.kl_penalized_reward(x, y, reward, 0.1))
    ctl.update(3.0, 5)  # KL above target: beta grows
    assert penalty.beta == ctl.value > 0.1
    torch.testing.assert_close(
        penalty(x, y, reward), klpenalty.kl_penalized_reward(x, y, reward, ctl.value)
    )
    assert KLPenalty(0.0)(x, y, reward).equal(reward)


@pytest.mark.parametrize(
    "make,exc,words",
    [
        (lambda: FullKL(temperature=0.0), ValueError, ["temperature"]),
        (lambda: FullKL(backend="fast"), ValueError, ["backend", "'streaming'"]),
        (lambda: KLPenalty(beta=-1.0), ValueError, ["beta"]),
        (lambda: KLPenalty(beta="0.1"), TypeError, ["beta"]),
        (lambda: FullKL(top_k=0), ValueError, ["top_k"]),
        (lambda: KLPenalty(top_p=1.5), ValueError, ["top_p"]),
        (lambda: FullKL(min_p=-0.1), ValueError, ["min_p"]),
    ],
)
def test_bad_settings_raise_at_construction(make, exc, words):
    with pytest.raises(exc) as info:
        make()
    for w in words:
        assert w in str(info.value)


def test_sampler_settings_truncate_the_policy():
    x, y = make_logits((2, 5, 30), torch.float32, seed=7, scale=2.0)
    reward = torch.randn(2, 5, generator=torch.Generator().manual_seed(1))
    module = FullKL(temperature=0.8, top_p=0.7)
    assert "top_p=0.7" in repr(module)
    torch.testing.assert_close(module(x, y), klpenalty.full_kl(x, y, temperature=0.8, top_p=0.7))
    assert not torch.allclose(module(x, y), klpenalty.full_kl(x, y, temperature=0.8))
    keep = torch.rand(x.shape, generator=torch.Generator().manual_seed(2)) < 0.5
    keep[..., 0] = True
    torch.testing.assert_close(FullKL()(x, y, support=keep), klpenalty.full_kl(x, y, support=keep))
    penalty = KLPenalty(0.3, top_k=4)
    torch.testing.assert_close(
        penalty(x, y, reward), klpenalty.kl_penalized_reward(x, y, reward, 0.3, top_k=4)
    )
