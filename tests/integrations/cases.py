"""Inputs shared by the stack tests: per-token log-probs and one small enumerable state."""

from __future__ import annotations

import torch

from ..rlhf.tabular import OneState

__all__ = ["logprob_pairs", "MildState"]


def logprob_pairs(dtype: torch.dtype, seed: int = 0):
    """(log π, log ρ, log π_old), (4, 6) each, log-ratios from ~0 to ±40 (the clamps bind)."""
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(4, 6, generator=g, dtype=torch.float64) * 3
    spread = torch.tensor([0.01, 0.5, 3.0, 40.0], dtype=torch.float64)[:, None]
    ref = (lp + spread * torch.randn(4, 6, generator=g, dtype=torch.float64)).clamp(max=0.0)
    old = (lp + 0.3 * torch.randn(4, 6, generator=g, dtype=torch.float64)).clamp(max=0.0)
    return lp.to(dtype), ref.to(dtype), old.to(dtype)


class MildState(OneState):
    """OneState with logits halved: every |log ρ − log π| < 2.3 (asserted), so no clamp of
    verl's or OpenRLHF's binds (k3 ≤ e^2.3 − 3.3 < 10) and the forms' own gradients show."""

    def __init__(self, seed: int) -> None:
        super().__init__(vocab=4, seed=seed)
        with torch.no_grad():
            self.x.mul_(0.5)
        self.y, self.z = 0.5 * self.y, 0.5 * self.z
        self.p = torch.softmax(self.x.detach(), -1)
        self.q = torch.softmax(self.y, -1)
        self.p_old = torch.softmax(self.z, -1)
        assert float((self.q.log() - self.p.log()).abs().max()) < 2.3
