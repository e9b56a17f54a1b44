"""The importance ratio π_trainer / π_sampler of a GRPO batch sampled with top-k / top-p.

    .venv/bin/python benchmarks/bench_sampler_ratio.py
    .venv/bin/python benchmarks/bench_sampler_ratio.py --vocab 151936 --samplers 50:1.0 0:0.8

A sampler that truncates (top-k, top-p, min-p) draws from π̃, π renormalised on its kept set;
a trainer that scores the tokens with the untruncated π sees the ratio
π(a)/π̃(a) = S, the kept mass, on every token, instead of 1. This runs klpenalty's
``GRPOTrainer`` (``kl_estimator="exact"``) for one generation batch with a ``rollout_func``
(:func:`sampling_rollout`) that samples with transformers' ``generate`` and returns the
sampler's log-probs (TRL's ``sampling_per_token_logps``) and its kept sets (the
``"sampling_mask"`` extra field); ``steps_per_generation=2`` makes TRL compute its old
log-probs, and the ratio is exp(old − sampling) over the completion tokens, for:

- ``untruncated``: ``sampler_support=False`` (TRL's log-probs, over the whole vocabulary);
- ``replayed``: the rollout's kept sets replayed in the trainer;
- ``rule``: no kept sets returned; the trainer rebuilds them from ``GRPOConfig``'s
  ``top_k`` / ``top_p`` (klpenalty's sampler rule on the trainer's logits).

The model: a randomly initialised one-layer Llama (hidden 64) over a word-level vocabulary of
``--vocab`` words, its LM head scaled so the logits' spread is ``--logit-std`` (a trained
model's next-token distributions are peaked; a fresh one's are nearly uniform). Reported per
sampler setting and variant: the ratio's mean, min and max, and the mean kept mass S.
Writes ``benchmarks/results/bench_sampler_ratio.{csv,md}``.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import statistics
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_chunk_plan import machine  # noqa: E402  (the benchmarks' machine name)
from bench_trl_step import make_tokenizer  # noqa: E402  (a word per id, built here)
VARIANTS = ("untruncated", "replayed", "rule")
SAMPLERS = ("50:1.0", "0:0.8", "1024:0.8")  # top_k:top_p (0: no top-k)


def sampling_rollout(top_k: int = 0, top_p: float = 1.0, min_p: float | None = None,
                     kept_sets: bool = True):
    """A TRL ``rollout_func`` that samples with transformers' ``generate`` on the trainer's
    policy (temperature from the trainer, the given top-k / top-p / min-p) and returns, per
    completion, its token ids, the sampler's log-probs log π̃(a) and (with ``kept_sets``) its
    kept sets as ``"sampling_mask"``: (token_ids, offsets) over the completion's tokens."""

    def rollout(prompts, trainer):
        model = trainer.accelerator.unwrap_model(trainer.model)
        tok = trainer.processing_class
        enc = tok(prompts, return_tensors="pt", padding=True, padding_side="left",
                  add_special_tokens=False).to(model.device)
        with torch.no_grad():
            out = model.generate(
                **enc, do_sample=True, temperature=trainer.temperature, top_k=top_k,
                top_p=top_p, min_p=min_p, max_new_tokens=trainer.max_completion_length,
                output_scores=True, return_dict_in_generate=True,
                pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
            )
        scores = torch.stack(out.scores, 1)  # (B, L, V): the sampler's processed logits
        completion = out.sequences[:, enc["input_ids"].shape[1]:]
        logps = torch.log_softmax(scores.float(), -1).gather(-1, completion.unsqueeze(-1))[..., 0]
        result = {"prompt_ids": [], "completion_ids": [], "logprobs": [], "sampling_mask": []}
        for i in range(completion.shape[0]):
            ids = completion[i].tolist()
            n = ids.index(tok.eos_token_id) + 1 if tok.eos_token_id in ids else len(ids)
            result["prompt_ids"].append(enc["input_ids"][i][enc["attention_mask"][i].bool()].tolist())
            result["completion_ids"].append(ids[:n])
            result["logprobs"].append(logps[i, :n].tolist())
            kept = torch.isfinite(scores[i, :n])  # (n, V)
            offsets = torch.cat([kept.new_zeros(1, dtype=torch.long), kept.sum(-1).cumsum(0)])
            result["sampling_mask"].append((kept.nonzero()[:, 1], offsets))
        if not kept_sets:
            del result["sampling_mask"]
        return result

    return rollout


def measure(vocab: int, logit_std: float, top_k: int, top_p: float, variant: str,
            completions: int, tokens: int, workdir: str, seed: int = 0) -> dict:
    """One generation batch of ``variant``: the ratio exp(old − sampling) and the kept mass."""
    import datasets
    import transformers
    import trl

    from klpenalty.integrations.trl import GRPOTrainer

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
        pad_token_id=0, eos_token_id=1, bos_token_id=None)
    ref_dir = os.path.join(workdir, f"ref-{vocab}-{logit_std}")
    if not os.path.isdir(ref_dir):
        model = transformers.LlamaForCausalLM(config)
        with torch.no_grad():  # logits of spread logit_std (the final norm gives unit states)
            w = model.lm_head.weight
            w.mul_(logit_std / (w.norm(dim=1).mean() + 1e-12))
            w[1] -= 2 * logit_std * w[1] / w[1].norm()  # EOS rare: full-length completions
        model.save_pretrained(ref_dir)
    policy = transformers.LlamaForCausalLM.from_pretrained(ref_dir)
    tok = make_tokenizer(vocab)
    prompts = [" ".join(f"w{3 + (7 * i + j) % (vocab - 3)}" for j in range(4))
               for i in range(completions // 2)]
    seen = {}

    class Recording(GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            seen.setdefault("batch", out)
            return out

    args = trl.GRPOConfig(
        output_dir=os.path.join(workdir, "out"), per_device_train_batch_size=completions // 2,
        num_generations=2, steps_per_generation=2, max_completion_length=tokens, max_steps=1,
        beta=0.04, learning_rate=0.0, report_to="none", use_cpu=True, save_strategy="no",
        seed=seed, disable_tqdm=True, bf16=False, logging_steps=1,
        top_k=top_k if variant == "rule" else 0, top_p=top_p if variant == "rule" else 1.0,
    )
    trainer = Recording(
        policy, lambda completions, **kw: [0.0] * len(completions), args=args,
        train_dataset=datasets.Dataset.from_dict({"prompt": prompts * 2}),
        processing_class=tok, kl_estimator="exact", sampler_support=variant != "untruncated",
        rollout_func=sampling_rollout(top_k, top_p, kept_sets=variant == "replayed"),
    )
    trainer.train()
    batch = seen["batch"]
    mask = batch["completion_mask"].bool()
    log_ratio = (batch["old_per_token_logps"] - batch["sampling_per_token_logps"])[mask]
    ratio = log_ratio.double().exp()
    return {"ratio_mean": ratio.mean().item(), "ratio_min": ratio.min().item(),
            "ratio_max": ratio.max().item(), "tokens": int(mask.sum())}


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--logit-std", type=float, default=4.0)
    parser.add_argument("--samplers", nargs="+", default=list(SAMPLERS),
                        help="top_k:top_p pairs (top_k 0: none)")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--completions", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "bench_sampler_ratio"),
                        help="path prefix of the .csv and .md written ('' writes none)")
    args = parser.parse_args(argv)
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    torch.set_num_threads(os.cpu_count() or 1)
    rows = []
    start = time.time()
    with tempfile.TemporaryDirectory() as workdir:
        for spec in args.samplers:
            k, p = spec.split(":")
            for variant in args.variants:
                r = measure(args.vocab, args.logit_std, int(k), float(p), variant,
                            args.completions, args.tokens, workdir)
                row = {"vocab": args.vocab, "logit_std": args.logit_std, "top_k": int(k),
                       "top_p": float(p), "variant": variant,
                       **{n: (round(x, 4) if isinstance(x, float) else x) for n, x in r.items()}}
                rows.append(row)
                print(row, flush=True)
    # the kept mass S: the untruncated trainer's ratio is π/π̃ = S on every token
    for row in rows:
        base = [r for r in rows if r["variant"] == "untruncated"
                and (r["top_k"], r["top_p"]) == (row["top_k"], row["top_p"])]
        row["log_S_mean"] = round(math.log(base[0]["ratio_mean"]), 4) if base else ""
    if args.out:
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out + ".csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
        head = (f"The importance ratio exp(old − sampling) of one GRPO generation batch, "
                f"{time.strftime('%Y-%m-%d')}, {machine()}, torch {torch.__version__}, "
                f"{args.completions} completions × up to {args.tokens} tokens, "
                f"{time.time() - start:.0f} s, loadavg (1 min) {os.getloadavg()[0]:.2f}.")
        cols = list(rows[0])
        lines = [head, "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        lines += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows]
        with open(args.out + ".md", "w") as f:
            f.write("\n".join(lines) + "\n")
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
