"""Exact KL and token log-probs for Hugging Face causal LMs, without their (B, T, V) logits.

Shape letters: B batch, T sequence, V vocabulary, H hidden (each model its own).

:func:`causal_lm_kl` takes both models as the user holds them (plain, DDP, FSDP1, FSDP2, a
DeepSpeed engine, a ``PeftModel``) and runs each through its outermost wrapper's own forward,
with its LM head module's forward replaced for that one call: the reference's head captures the
last hidden states it receives (after the final norm) and its weight and bias; the policy's
head hands its own and the reference's to :func:`klpenalty.linear.linear_kl`, which computes
the logits of the counted positions chunk by chunk and never holds them all, and returns the
per-token results as the head's output, so that the wrapper's hooks (DDP's reducer, FSDP's and
ZeRO-3's gathers) see them. The logit transform each architecture's ``forward`` applies after
its head (soft-capping, scaling) is looked up by ``config.model_type`` in
:data:`SUPPORTED_ARCHITECTURES` (and switched off in the model for the call); any other
architecture raises.

Importing this package does not import ``transformers`` (it reads models by duck typing); the
tests build tiny models with it (``pip install 'klpenalty[hf]'``).
"""

from __future__ import annotations

from .divergence import causal_lm_divergence
from .kl import causal_lm_kl, causal_lm_logprobs, reference_states, ReferenceStates
from .models import SUPPORTED_ARCHITECTURES
from .positions import generate_position_ids, scored_positions

__all__ = [
    "causal_lm_kl",
    "causal_lm_divergence",
    "reference_states",
    "ReferenceStates",
    "causal_lm_logprobs",
    "scored_positions",
    "generate_position_ids",
    "SUPPORTED_ARCHITECTURES",
]
