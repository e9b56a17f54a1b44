"""``nn.Module`` wrappers of the exact KL, for models and trainers that compose modules.

They hold the settings (temperature, backend, check; β or a controller) and call
:func:`klpenalty.full_kl` / :func:`klpenalty.kl_penalized_reward`; they have no parameters.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from . import _validation as v
from .functional import full_kl, kl_penalized_reward
from .ops.dispatch import available_backends
from .sampling import check_sampler

__all__ = ["FullKL", "KLPenalty"]


def _check_settings(temperature: object, backend: object) -> float:
    v.check_choice("backend", backend, ["auto", *available_backends()])
    return v.check_temperature(temperature)


def _sampler_repr(sampler: dict[str, Any]) -> str:
    return "".join(f", {k}={val}" for k, val in sampler.items() if val is not None)


class FullKL(nn.Module):
    """Exact per-token KL(π‖ρ) from logits, as a module.

    Args:
        temperature: > 0, divides both models' logits (use the sampling temperature).
        backend: as in :func:`klpenalty.full_kl`.
        check: as in :func:`klpenalty.full_kl`.
        top_k, top_p, min_p: the sampler's truncation (as in :func:`klpenalty.full_kl`): the KL
            is then that of the truncated policy π̃; ``forward(..., support=)`` passes a kept
            set per call instead.

    Shapes: ``forward(policy_logits (..., V), ref_logits (..., V), mask (...) or None)`` →
    (...) float32 (float64 for float64 inputs).
    """

    def __init__(
        self,
        temperature: float = 1.0,
        backend: str = "auto",
        check: bool = True,
        *,
        top_k: int | None = None,
        top_p: float | None = None,
        min_p: float | None = None,
    ):
        super().__init__()
        self.temperature = _check_settings(temperature, backend)
        self.backend = backend
        self.check = bool(check)
        self.sampler = check_sampler(top_k, top_p, min_p)

    def forward(
        self,
        policy_logits: torch.Tensor,
        ref_logits: torch.Tensor,
        mask: torch.Tensor | None = None,
        *,
        support: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        return full_kl(
            policy_logits,
            ref_logits,
            mask=mask,
            temperature=self.temperature,
            backend=self.backend,
            check=self.check,
            support=support,
            **self.sampler,
        )

    def extra_repr(self) -> str:
        return (
            f"temperature={self.temperature}, backend={self.backend!r}, check={self.check}"
            + _sampler_repr(self.sampler)
        )


class KLPenalty(nn.Module):
    """The shaped reward ``reward − β·KL(π‖ρ)`` with the exact KL, as a module.

    Args:
        beta: a number ≥ 0, or a KL controller (anything with ``.value``, e.g.
            :class:`klpenalty.AdaptiveKLController`), read at every call so that
            ``controller.update(...)`` takes effect at the next batch.
        temperature, backend, check: as in :func:`klpenalty.kl_penalized_reward`.
        top_k, top_p, min_p: the sampler's truncation, as in :class:`FullKL`.

    Shapes: ``forward(policy_logits (..., V), ref_logits (..., V), reward (...), mask (...) or
    None)`` → (...), the dtype of ``reward`` promoted with float32.
    """

    def __init__(
        self,
        beta: Any = 0.1,
        temperature: float = 1.0,
        backend: str = "auto",
        check: bool = True,
        *,
        top_k: int | None = None,
        top_p: float | None = None,
        min_p: float | None = None,
    ):
        super().__init__()
        if hasattr(beta, "value"):
            v.check_beta(beta.value, "beta.value")
            self.controller = beta
        else:
            self.controller = None
            self._beta = v.check_beta(beta)
        self.temperature = _check_settings(temperature, backend)
        self.backend = backend
        self.check = bool(check)
        self.sampler = check_sampler(top_k, top_p, min_p)

    @property
    def beta(self) -> float:
        """The KL coefficient used by the next call."""
        return self.controller.value if self.controller is not None else self._beta

    def forward(
        self,
        policy_logits: torch.Tensor,
        ref_logits: torch.Tensor,
        reward: torch.Tensor,
        mask: torch.Tensor | None = None,
        *,
        support: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        return kl_penalized_reward(
            policy_logits,
            ref_logits,
            reward,
            self.beta,
            mask=mask,
            temperature=self.temperature,
            backend=self.backend,
            check=self.check,
            support=support,
            **self.sampler,
        )

    def extra_repr(self) -> str:
        beta = repr(self.controller) if self.controller is not None else self._beta
        return (
            f"beta={beta}, temperature={self.temperature}, backend={self.backend!r}"
            + _sampler_repr(self.sampler)
        )
