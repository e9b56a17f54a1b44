"""klpenalty: the exact KL-divergence penalty for RLHF, from logits, without (B, T, V) temporaries.

Shape letters in every docstring: B batch, T sequence, V vocabulary, N rows.
"""

from .controllers import AdaptiveKLController, FixedKLController
from .estimators import ESTIMATORS, sampled_kl
from .functional import full_kl, kl_penalized_reward, token_logprobs
from .shaping import shaped_rewards

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
    # KL coefficient controllers
    "FixedKLController",
    "AdaptiveKLController",
]
