"""GRPO with the exact KL penalty: TRL's GRPOTrainer with one import and one argument changed.

    pip install 'klpenalty[trl]'
    python examples/trl_grpo_exact_kl.py --model Qwen/Qwen2.5-0.5B-Instruct  # a causal LM id/path
    python examples/trl_grpo_exact_kl.py --tiny   # offline: a random one-layer Llama, on CPU
    torchrun --nproc_per_node 2 examples/trl_grpo_exact_kl.py --tiny   # DDP, 2 processes
    python examples/trl_grpo_exact_kl.py --tiny --lora   # a LoRA policy (pip install peft)

Launch it as any TRL script (``torchrun``, ``accelerate launch``, a DeepSpeed ZeRO-3 config):
the trainer computes the exact KL through the model as accelerate wraps it. With ``--lora``
TRL keeps no reference model: the reference is the policy with its adapters disabled.

The KL term is β·KL_seq(π‖ρ), the exact KL over the whole vocabulary summed over each
completion, with the gradient of that objective (see klpenalty/integrations/trl/grpo.py);
TRL's own k3 estimate is logged next to it ("kl_seq/k3" against "kl_seq/exact"). Compare with
``--kl-estimator trl`` (TRL's term) or ``k3_ratio``. The reward here is a toy (short
completions that contain the letter "a"): put yours in ``reward``.
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from datasets import Dataset
from trl import GRPOConfig

from klpenalty.integrations.trl import GRPOTrainer  # instead of: from trl import GRPOTrainer


def reward(completions, **kwargs):
    """A toy reward: 1 for a completion that contains "a", minus 0.01 per character."""
    return [float("a" in c) - 0.01 * len(c) for c in completions]


def tiny_model_and_tokenizer(folder: str):
    """A random one-layer Llama and a character-level tokenizer, built here (no download)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    words = ["<pad>", "<eos>", "<unk>", *"abcdefgh"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.WhitespaceSplit(), decoders.WordPiece()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(words), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, pad_token_id=0, eos_token_id=1,
        bos_token_id=None,
    )
    LlamaForCausalLM(config).save_pretrained(folder)  # TRL loads the reference from here
    return folder, tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a causal LM id or path (supported by klpenalty.hf)")
    parser.add_argument("--tiny", action="store_true", help="a random tiny Llama, offline")
    parser.add_argument("--kl-estimator", default="exact", choices=["exact", "k3_ratio", "trl"])
    parser.add_argument("--beta", type=float, default=0.01, help="β per completion (exact)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--lora", action="store_true", help="train a LoRA adapter (peft)")
    cli = parser.parse_args()
    if cli.tiny == bool(cli.model):
        parser.error("give --model or --tiny")

    out = tempfile.mkdtemp()
    if cli.tiny:
        model, tokenizer = tiny_model_and_tokenizer(out + "/tiny")
        prompts = ["a b", "c d e", "f", "g h a"] * 4
    else:
        model, tokenizer = cli.model, None  # TRL loads the tokenizer that goes with the model
        prompts = ["Write a word with the letter a:", "Name a fruit:"] * 8
    args = GRPOConfig(
        output_dir=out, beta=cli.beta, max_steps=cli.steps, per_device_train_batch_size=4,
        num_generations=4, max_completion_length=16, logging_steps=1, report_to="none",
        learning_rate=1e-2 if cli.tiny else 1e-6,  # the tiny model must move to show a KL
        save_strategy="no", use_cpu=not torch.cuda.is_available(), bf16=torch.cuda.is_available(),
    )
    peft_config = None
    if cli.lora:  # TRL wraps the model; its reference is then the adapters disabled
        from peft import LoraConfig

        peft_config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                 task_type="CAUSAL_LM")  # fmt: skip
    trainer = GRPOTrainer(
        model, reward, args=args, train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=tokenizer, kl_estimator=cli.kl_estimator, peft_config=peft_config,
    )
    trainer.train()
    if not trainer.is_world_process_zero():  # under torchrun: one report
        return
    for row in trainer.state.log_history:
        if "kl" in row:
            exact = row.get("kl_seq/exact")
            shown = "" if exact is None else f"  exact KL/completion {exact:.4g}"
            k3_seq = row.get("kl_seq/k3")
            shown += "" if k3_seq is None else f"  TRL k3/completion {k3_seq:.4g}"
            print(f"step {row['step']}: reward {row['reward']:.3f}  TRL k3/token {row['kl']:.4g}"
                  + shown)


if __name__ == "__main__":
    main()
