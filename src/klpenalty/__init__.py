"""klpenalty: the exact KL-divergence penalty for RLHF, from logits, without (B, T, V) temporaries.

Shape letters in every docstring: B batch, T sequence, V vocabulary, N rows.
"""

from .functional import full_kl, kl_penalized_reward, token_logprobs
from .rlhf import (
    ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    KLRewardAndLoss,
    full_kl_reward_and_loss,
    k2_loss,
    k3_loss,
    k3_ratio_loss,
    next_token_kl,
    sampled_kl,
    shaped_rewards,
)

__version__ = "0.1.0"

__all__ = [
    # exact KL from logits
    "full_kl",
    "kl_penalized_reward",
    "token_logprobs",
    # sampled-token estimators
    "sampled_kl",
    "ESTIMATORS",
    # reward shaping
    "shaped_rewards",
    # KL gradients: loss forms and reward placements (see klpenalty.rlhf.gradients)
    "k2_loss",
    "k3_ratio_loss",
    "k3_loss",
    "next_token_kl",
    "full_kl_reward_and_loss",
    "KLRewardAndLoss",
    # KL coefficient controllers
    "FixedKLController",
    "AdaptiveKLController",
]
