"""klpenalty's drop-ins for TRL's trainers (the ``trl`` extra: ``pip install 'klpenalty[trl]'``).

- :class:`GRPOTrainer` (:mod:`.grpo`): TRL's GRPO with its KL term chosen by ``kl_estimator``
  (``"exact"``: the exact sequence KL from both models' hidden states).
- :class:`DistillationTrainer` (:mod:`.distillation`): TRL's on-policy distillation with the
  divergence computed by :func:`klpenalty.hf.causal_lm_divergence`, every kind of
  :data:`klpenalty.DIVERGENCES`.

Import them from here, in place of TRL's: ``from klpenalty.integrations.trl import
GRPOTrainer, DistillationTrainer``.
"""

from .distillation import DistillationTrainer, divergence_of_beta
from .grpo import KL_ESTIMATORS, REF_HIDDEN, SAMPLING_MASK, SUPPORT_IDS, GRPOTrainer

__all__ = [
    "DistillationTrainer",
    "GRPOTrainer",
    "KL_ESTIMATORS",
    "REF_HIDDEN",
    "SAMPLING_MASK",
    "SUPPORT_IDS",
    "divergence_of_beta",
]
