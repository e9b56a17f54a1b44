"""The RLHF side of the KL penalty: sampled estimators, reward shaping, loss forms, controllers,
on-policy distillation.

Groups (one module each):

- :mod:`~klpenalty.rlhf.estimators`: one-sample KL estimates from the sampled tokens' log-probs.
- :mod:`~klpenalty.rlhf.shaping`: per-token rewards, −β·KL on real tokens plus the score.
- :mod:`~klpenalty.rlhf.gradients`: KL loss forms and reward placements with the right gradient.
- :mod:`~klpenalty.rlhf.controllers`: the KL coefficient β, fixed or adaptive.
- :mod:`~klpenalty.rlhf.distill`: on-policy distillation recipes (the teacher in place of the
  reference): per-token advantages and loss, each recipe's expected gradient proven.

Shape letters: B batch, T sequence, V vocabulary, N rows.
"""

from . import controllers, distill, estimators, gradients, shaping
from .controllers import *  # noqa: F403  (each module's __all__, listed below)
from .distill import *  # noqa: F403
from .estimators import *  # noqa: F403
from .gradients import *  # noqa: F403
from .shaping import *  # noqa: F403

__all__ = [
    # estimators: per-token sampled estimates of KL(π‖ρ): sampled_kl, ESTIMATORS
    *estimators.__all__,
    # shaping: per-token rewards −β·kl plus the score on the last real token: shaped_rewards, ...
    *shaping.__all__,
    # gradients: KL loss forms and reward placements whose gradient is the reverse-KL gradient
    *gradients.__all__,
    # controllers: the KL coefficient β, constant or steered toward a target KL
    *controllers.__all__,
    # distill: on-policy distillation recipes, per-token advantages and loss: opd_terms, ...
    *distill.__all__,
]
