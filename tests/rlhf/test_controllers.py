"""KL coefficient controllers: values computed by hand, checkpointing, bad arguments."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from klpenalty import AdaptiveKLController, FixedKLController


def test_fixed_controller():
    c = FixedKLController(0.05)
    assert c.value == 0.05
    assert c.update(123.0, 64) == 0.05 and c.value == 0.05
    state = c.state_dict()
    d = FixedKLController(1.0)
    d.load_state_dict(state)
    assert d.value == 0.05


# β = 0.1, target 6 nats, K_β = n_steps / horizon = 0.1 (Ziegler et al.'s paper form)
@pytest.mark.parametrize(
    "kl, expected",
    [(12.0, 0.102), (6.0, 0.1), (0.0, 0.098), (6.6, 0.101), (1e6, 0.102), (5.4, 0.099)],
)
def test_adaptive_paper_values(kl, expected):
    c = AdaptiveKLController(0.1, target=6.0, horizon=10)
    assert c.update(kl, n_steps=1) == pytest.approx(expected, rel=1e-12)
    assert c.value == pytest.approx(expected, rel=1e-12)


def test_adaptive_code_form_with_horizon_and_batch():
    # released code: horizon = 10,000 episodes, n_steps = batch size 512, β0 = 0.15, target 6
    c = AdaptiveKLController(0.15, target=6.0, horizon=10_000)
    c.update(7.5, n_steps=512)  # e = 7.5/6 − 1 = 0.25 -> clipped to 0.2
    assert c.value == pytest.approx(0.15 * (1 + 0.2 * 512 / 10_000), rel=1e-12)
    c.update(torch.tensor(5.7), n_steps=512)  # e = −0.05
    assert c.value == pytest.approx(0.15 * (1 + 0.2 * 0.0512) * (1 - 0.05 * 0.0512), rel=1e-6)


def test_adaptive_converges_to_target_when_kl_is_inverse_in_beta():
    # toy: the policy settles where KL = 0.6 / β, so the target 6 is reached at β = 0.1
    c = AdaptiveKLController(0.5, target=6.0, horizon=100)
    for _ in range(3000):
        c.update(0.6 / c.value, n_steps=10)
    assert 0.6 / c.value == pytest.approx(6.0, rel=1e-3)


def test_state_dict_roundtrip_survives_a_checkpoint(tmp_path):
    c = AdaptiveKLController(0.2, target=4.0, horizon=1000)
    for kl in (10.0, 1.0, 3.0):
        c.update(kl, n_steps=32)
    torch.save(c.state_dict(), tmp_path / "ctl.pt")
    d = AdaptiveKLController(1.0, target=1.0, horizon=1.0)
    d.load_state_dict(torch.load(tmp_path / "ctl.pt", weights_only=True))
    assert d.state_dict() == c.state_dict()
    assert d.update(5.0, 32) == c.update(5.0, 32)


@pytest.mark.parametrize(
    "make, exc, word",
    [
        (lambda: AdaptiveKLController(0.1, target=0.0, horizon=10), ValueError, "target"),
        (lambda: AdaptiveKLController(0.1, target=-1.0, horizon=10), ValueError, "target"),
        (lambda: AdaptiveKLController(0.1, target=6.0, horizon=0), ValueError, "horizon"),
        (lambda: AdaptiveKLController(-0.1, target=6.0, horizon=10), ValueError, "init_beta"),
        (lambda: AdaptiveKLController("0.1", target=6.0, horizon=10), TypeError, "init_beta"),
        (lambda: FixedKLController(-1.0), ValueError, "beta"),
        (lambda: FixedKLController(float("nan")), ValueError, "beta"),
        (lambda: AdaptiveKLController(0.1, 6.0, 10).update(float("nan"), 1), ValueError, "current_kl"),
        (lambda: AdaptiveKLController(0.1, 6.0, 10).update(float("inf"), 1), ValueError, "current_kl"),
        (lambda: AdaptiveKLController(0.1, 6.0, 10).update(torch.ones(2), 1), TypeError, "current_kl"),
        (lambda: AdaptiveKLController(0.1, 6.0, 10).update(1.0, 0), ValueError, "n_steps"),
        (lambda: AdaptiveKLController(0.1, 6.0, 10).update(1.0, 2.5), TypeError, "n_steps"),
        (lambda: AdaptiveKLController(0.1, 6.0, 10).update(0.0, 100), ValueError, "horizon"),
        (lambda: FixedKLController(0.1).update(float("nan"), 1), ValueError, "current_kl"),
        (lambda: FixedKLController(0.1).load_state_dict({"beta": 1.0}), ValueError, "missing keys ['value']"),
        (lambda: AdaptiveKLController(0.1, 6.0, 10).load_state_dict({"value": 1.0}), ValueError, "target"),
    ],
)
def test_invalid_arguments_raise(make, exc, word):
    with pytest.raises(exc, match=word.replace("[", r"\[").replace("]", r"\]")):
        make()


@pytest.mark.parametrize("to_number", [np.float32, np.float64, np.int64, np.array, torch.tensor])
def test_numpy_scalars_and_tensors_are_accepted_everywhere(to_number):
    # the same numbers as test_adaptive_code_form_with_horizon_and_batch: e = 0.25 -> 0.2
    c = AdaptiveKLController(to_number(3), target=to_number(6), horizon=to_number(10_000))
    assert (c.value, c.target, c.horizon) == (3.0, 6.0, 10_000.0)
    assert all(type(x) is float for x in c.state_dict().values())
    new = c.update(to_number(9), np.int64(512))
    assert type(new) is float and new == pytest.approx(3.0 * (1 + 0.2 * 512 / 10_000), rel=1e-12)
    f = FixedKLController(to_number(2))
    assert f.update(to_number(9), np.int64(1)) == 2.0 and type(f.value) is float


@pytest.mark.parametrize(
    "bad", [True, np.bool_(True), "1.0", 1 + 0j, np.complex64(1.0), None, [1.0], np.ones(2)]
)
def test_non_real_current_kl_is_a_type_error(bad):
    with pytest.raises(TypeError, match="current_kl"):
        AdaptiveKLController(0.1, 6.0, 10).update(bad, 1)
    with pytest.raises(TypeError, match="init_beta"):
        AdaptiveKLController(bad, 6.0, 10)
