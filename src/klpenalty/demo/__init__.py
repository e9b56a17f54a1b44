"""``klpenalty demo``: RLHF on a tiny language model with and without the KL penalty.

- :mod:`.grammar`: a small English-like PCFG with a sampler, exact inside / prefix
  probabilities and an exact recogniser of documents and prefixes;
- :mod:`.model`: a 2-layer, 4-head, width-64 GPT (~107k parameters) and its sampler;
- :mod:`.pretrain`: the deterministic pretraining of the reference (``ref.pt`` ships here);
- :mod:`.rlhf`: PPO-clip with per-token KL shaping, built on klpenalty's public API only;
- :mod:`.compare`: ``--compare``, every KL recipe under PPO and GRPO over a β grid;
- :mod:`.distill`: ``--distill``, on-policy distillation of the reference into a smaller
  student, one run per recipe;
- :mod:`.report` and :mod:`.runner`: the parallel runs, the figures and the report.
"""

from .grammar import Grammar, Recognizer, default_grammar
from .model import GPTConfig, TinyGPT, Vocab
from .pretrain import load_checkpoint, pretrain, save_checkpoint
from .rlhf import RunConfig, run_rlhf

__all__ = [
    "Grammar",
    "Recognizer",
    "default_grammar",
    "GPTConfig",
    "TinyGPT",
    "Vocab",
    "load_checkpoint",
    "pretrain",
    "save_checkpoint",
    "RunConfig",
    "run_rlhf",
]
