"""The RLHF side of the KL penalty: sampled estimators, reward shaping, loss forms, controllers.

Groups (one module each):

- :mod:`~klpenalty.rlhf.estimators`: one-sample KL estimates from the sampled tokens' log-probs.
- :mod:`~klpenalty.rlhf.shaping`: per-token rewards, −β·KL on real tokens plus the score.
- :mod:`~klpenalty.rlhf.gradients`: KL loss forms and reward placements with the right gradient.
- :mod:`~klpenalty.rlhf.controllers`: the KL coefficient β, fixed or adaptive.

Shape letters: B batch, T sequence, V vocabulary, N rows.
"""

from .controllers import AdaptiveKLController, FixedKLController
from .estimators import ESTIMATORS, sampled_kl
from .gradients import (
    KLRewardAndLoss,
    full_kl_reward_and_loss,
    k2_loss,
    k3_loss,
    k3_ratio_loss,
    next_token_kl,
)
from .shaping import last_true_index, shaped_rewards

__all__ = [
    # estimators: per-token sampled estimates of KL(π‖ρ) (k1, k2, k3, abs)
    "sampled_kl",
    "ESTIMATORS",
    # shaping: per-token rewards −β·kl plus the sequence score on the last real token
    "shaped_rewards",
    "last_true_index",
    # gradients: loss forms and reward placements whose gradient is the reverse-KL gradient
    "k2_loss",
    "k3_ratio_loss",
    "k3_loss",
    "next_token_kl",
    "full_kl_reward_and_loss",
    "KLRewardAndLoss",
    # controllers: the KL coefficient β, constant or steered toward a target KL
    "FixedKLController",
    "AdaptiveKLController",
]
