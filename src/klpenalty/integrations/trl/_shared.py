"""What the TRL trainers of klpenalty share: the scored positions of TRL's (prompt +
completion) batches and the sampler's truncating settings.

Shape letters: B completions, T prompt + completion length, L completion length.
"""

from __future__ import annotations

import torch


def scoring(input_ids: torch.Tensor, logits_to_keep: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(response mask (B, T): the last L = ``logits_to_keep`` tokens, position ids (B, T):
    0..T-1, as TRL's own log-prob and hidden-state passes number them)."""
    b, t = input_ids.shape
    response = torch.zeros(b, t, dtype=torch.bool, device=input_ids.device)
    response[:, t - logits_to_keep :] = True
    return response, torch.arange(t, device=input_ids.device).expand(b, t)


def sampler_settings(trainer) -> dict:
    """A TRL trainer's generation's truncating settings as ``top_k`` / ``top_p`` / ``min_p``
    keywords (those that cut; empty when none does), read where TRL's generation reads them:
    transformers' ``generation_config`` (the config's values overridden by its
    ``generation_kwargs``), or with vLLM the config's values overridden by
    ``generation_kwargs``."""
    args = trainer.args
    extra = args.generation_kwargs if isinstance(args.generation_kwargs, dict) else {}
    config = getattr(trainer, "generation_config", None)
    if config is not None and not trainer.use_vllm:  # transformers' generate: its config
        k, p, m = config.top_k, config.top_p, config.min_p
    else:
        k, p, m = (extra.get(n, getattr(trainer, n)) for n in ("top_k", "top_p", "min_p"))
    out = {}
    if k is not None and k > 0:
        out["top_k"] = int(k)
    if p is not None and p < 1.0:
        out["top_p"] = float(p)
    if m is not None and m > 0.0:
        out["min_p"] = float(m)
    return out
