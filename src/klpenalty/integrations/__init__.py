"""Drop-in KL terms for the RLHF stacks people already use: verl, OpenRLHF and TRL.

Each module mirrors one stack's own function or trainer, with the same signature and names, and
returns what that stack reports as the *value* while its *gradient* is the gradient-correct one
from :mod:`klpenalty.rlhf.gradients`. docs/integrations.md says, per stack, where the KL is
computed, what its default optimises and the one-line change.

- :mod:`~klpenalty.integrations.verl`: ``kl_penalty(logprob, ref_logprob, kl_penalty)``.
- :mod:`~klpenalty.integrations.openrlhf`: ``compute_approx_kl(log_probs, log_probs_base, ...)``.
- :mod:`~klpenalty.integrations.trl`: ``GRPOTrainer`` with ``kl_estimator="exact"`` and
  ``DistillationTrainer`` with klpenalty's divergences; needs the optional extra (``pip install
  'klpenalty[trl]'``) and is imported only on request.

Shape letters: B batch, T sequence, V vocabulary.
"""

from . import openrlhf, verl

__all__ = ["openrlhf", "verl"]
