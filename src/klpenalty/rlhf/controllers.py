"""KL coefficient controllers: a fixed β and the adaptive controller of Ziegler et al. (2019).

Both expose ``.value`` (the β to use now), ``.update(current_kl, n_steps)`` (call once per
batch with the measured KL), and ``state_dict()`` / ``load_state_dict()`` so β survives a
checkpoint.
"""

from __future__ import annotations

import math
from numbers import Integral
from typing import Any, Mapping

from .. import _validation as v

__all__ = ["FixedKLController", "AdaptiveKLController"]


def _check_kl(current_kl: object) -> float:
    kl = v.as_real("current_kl", current_kl)
    if not math.isfinite(kl):
        raise ValueError(f"current_kl must be finite, got {kl}")
    return kl


def _check_n_steps(n_steps: object) -> int:
    if isinstance(n_steps, bool) or not isinstance(n_steps, Integral):
        raise TypeError(f"n_steps must be an int, got {type(n_steps).__name__}")
    if n_steps <= 0:
        raise ValueError(f"n_steps must be > 0, got {n_steps}")
    return int(n_steps)


def _positive(name: str, value: object) -> float:
    x = v.as_real(name, value)
    if not math.isfinite(x) or x <= 0:
        raise ValueError(f"{name} must be finite and > 0, got {x}")
    return x


def _load(state: Mapping[str, Any], keys: tuple[str, ...], owner: str) -> dict[str, Any]:
    if not isinstance(state, Mapping):
        raise TypeError(f"state_dict must be a mapping, got {type(state).__name__}")
    missing = [k for k in keys if k not in state]
    unexpected = [k for k in state if k not in keys]
    if missing or unexpected:
        raise ValueError(
            f"{owner}.load_state_dict: missing keys {missing}, unexpected keys {unexpected}"
        )
    return dict(state)


class FixedKLController:
    """A constant KL coefficient.

    Args:
        beta: the coefficient, finite and ≥ 0.
    """

    def __init__(self, beta: float) -> None:
        self.value = v.check_beta(beta)

    def update(self, current_kl: float, n_steps: int) -> float:
        """Validate the arguments and keep β unchanged. Returns ``value``."""
        _check_kl(current_kl)
        _check_n_steps(n_steps)
        return self.value

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        state = _load(state_dict, ("value",), type(self).__name__)
        self.value = v.check_beta(state["value"], "value")

    def __repr__(self) -> str:
        return f"FixedKLController(beta={self.value})"


class AdaptiveKLController:
    """Proportional controller that steers the measured KL toward ``target`` (Ziegler et al.).

    On each ``update(current_kl, n_steps)``::

        e = clip(current_kl / target − 1, −0.2, 0.2)
        value *= 1 + e · n_steps / horizon

    so β grows while the KL is above target and shrinks while below, by at most 20% of
    ``n_steps / horizon`` per update. The paper used init_beta=0.15, target=6 nats,
    horizon=10,000 episodes with n_steps = the batch size.

    Args:
        init_beta: initial β, finite and > 0 (a multiplicative controller cannot leave 0).
            Like ``target`` and ``horizon``, a Python or numpy real number or a one-element
            tensor.
        target: target KL in nats per sequence (or whatever unit you pass to ``update``), > 0.
        horizon: > 0, the number of steps over which β can change by about e.
    """

    def __init__(self, init_beta: float, target: float, horizon: float) -> None:
        self.value = _positive("init_beta", init_beta)
        self.target = _positive("target", target)
        self.horizon = _positive("horizon", horizon)

    def update(self, current_kl: float, n_steps: int) -> float:
        """Update β from the measured KL of the last ``n_steps`` samples. Returns the new β.

        Args:
            current_kl: the measured KL, finite: a Python or numpy real number or a
                one-element tensor (read detached). In data-parallel training pass the
                *global* mean so every rank keeps the same β.
            n_steps: positive int (Python or numpy), e.g. the number of sequences the KL was
                measured on.
        """
        kl = _check_kl(current_kl)
        n = _check_n_steps(n_steps)
        error = min(max(kl / self.target - 1.0, -0.2), 0.2)
        factor = 1.0 + error * n / self.horizon
        if factor <= 0:
            raise ValueError(
                f"n_steps / horizon = {n}/{self.horizon} is so large that beta would become "
                f"<= 0 (factor {factor}); use a horizon much larger than n_steps"
            )
        self.value *= factor
        return self.value

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        state = _load(state_dict, ("value", "target", "horizon"), type(self).__name__)
        self.value = _positive("value", state["value"])
        self.target = _positive("target", state["target"])
        self.horizon = _positive("horizon", state["horizon"])

    def __repr__(self) -> str:
        return (
            f"AdaptiveKLController(value={self.value}, target={self.target}, "
            f"horizon={self.horizon})"
        )
