"""The tiny GRPO setup the TRL tests share: a word-level tokenizer, a one-layer Llama, a reward.

Nothing is downloaded: the tokenizer is built here, the Llama is randomly initialised (seeded)
from a config, and the reward is a toy (the share of the letter "a" in a completion). Used by
``test_trl.py`` (one process) and ``trl_torchrun_worker.py`` (the runs under torchrun).
"""

from __future__ import annotations

import tokenizers
import torch
import transformers

WORDS = ["<pad>", "<eos>", "<unk>", *"abcdefgh"]
PROMPTS = ["a b", "c d e", "f", "g h a"] * 2


def make_tokenizer():
    """A word-level tokenizer over WORDS, wrapped for transformers; built here, no download."""
    model = tokenizers.models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>")
    tok = tokenizers.Tokenizer(model)
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.decoder = tokenizers.decoders.WordPiece()  # joins the words with spaces
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )


def llama_config():
    return transformers.LlamaConfig(
        vocab_size=len(WORDS), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
        pad_token_id=0, eos_token_id=1, bos_token_id=None,
    )


def share_of_a(completions, **kwargs):
    """The toy reward: the fraction of a completion's words that are "a"."""
    return [c.split().count("a") / max(len(c.split()), 1) for c in completions]


def reference_and_policy(ref_dir, perturb: bool = True):
    """Saves a seeded random Llama to ``ref_dir`` (the reference, which TRL loads itself from
    ``config._name_or_path``) and returns the policy loaded from it; with ``perturb`` its LM
    head is moved away from the reference's (so the KL and its gradient are not 0) and made to
    end some completions early."""
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(llama_config()).save_pretrained(ref_dir)
    policy = transformers.LlamaForCausalLM.from_pretrained(ref_dir)  # _name_or_path = ref_dir
    if perturb:
        with torch.no_grad():
            policy.lm_head.weight.add_(0.5 * torch.randn_like(policy.lm_head.weight))
            policy.lm_head.weight[1] += 0.6 * policy.lm_head.weight[1].abs()  # some early EOS
    return policy


def qwen2_config(hidden_size: int = 16):
    """A one-layer Qwen2 over WORDS (its LM head untied, as the larger Qwen2s have it)."""
    return transformers.Qwen2Config(
        vocab_size=len(WORDS), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        max_position_embeddings=32, tie_word_embeddings=False, pad_token_id=0, eos_token_id=1,
        bos_token_id=None,
    )


def student_and_teacher(teacher_hidden: int = 24):
    """A seeded random one-layer Qwen2 student (hidden size 16) and teacher (``teacher_hidden``),
    the teacher's head scaled up so that the two distributions differ clearly."""
    torch.manual_seed(0)
    student = transformers.Qwen2ForCausalLM(qwen2_config())
    teacher = transformers.Qwen2ForCausalLM(qwen2_config(teacher_hidden))
    with torch.no_grad():
        teacher.lm_head.weight.mul_(3.0)
    return student, teacher
