"""klpenalty: the exact KL-divergence penalty for RLHF, from logits, without (B, T, V) temporaries.

Shape letters in every docstring: B batch, T sequence, V vocabulary, N rows, H hidden.
"""

from . import rlhf, sampling
from .distillation import DIVERGENCES, divergence
from .functional import (
    TokenStats,
    entropy,
    full_kl,
    kl_penalized_reward,
    token_logprobs,
    token_stats,
)
from .linear import PolicyLoss, linear_divergence, linear_kl, linear_policy_loss
from .modules import FullKL, KLPenalty
from .report import KLReport, kl_report
from .topk import TopKMass, topk_divergence, topk_mass
from .rlhf import *  # noqa: F403  (the names in klpenalty.rlhf.__all__)

__version__ = "0.1.0"

__all__ = [
    # exact KL from logits (klpenalty.functional)
    "full_kl",
    "kl_penalized_reward",
    "token_logprobs",
    "entropy",
    "token_stats",
    "TokenStats",
    # exact divergences between a student and a teacher (klpenalty.distillation)
    "divergence",
    "DIVERGENCES",
    # the same straight from hidden states and LM heads, no (N, V) logits (klpenalty.linear)
    "linear_kl",
    "linear_divergence",
    # a PPO/GRPO loss with the exact KL from hidden states, gradient formed in the forward
    "linear_policy_loss",
    "PolicyLoss",
    # the support of the policy that sampled (top-k / top-p / min-p, engines' kept sets)
    "sampling",
    # the same as nn.Modules
    "FullKL",
    "KLPenalty",
    # the exact KL of a batch next to the sampled estimators (klpenalty.report)
    "kl_report",
    "KLReport",
    # distillation against a teacher given by its top-K log-probs (klpenalty.topk)
    "topk_divergence",
    "topk_mass",
    "TopKMass",
    # the RLHF side (klpenalty.rlhf): sampled estimators, reward shaping, KL loss forms and
    # reward placements, KL coefficient controllers, on-policy distillation recipes
    *rlhf.__all__,
]
