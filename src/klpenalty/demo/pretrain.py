"""Pretraining of the demo's reference model on grammar samples, and its checkpoint."""

from __future__ import annotations

import math
import random
import time
from importlib import resources
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from .grammar import Grammar, Recognizer, default_grammar
from .model import GPTConfig, TinyGPT, Vocab, sample
from .text import score_text

__all__ = [
    "pretrain",
    "encode_docs",
    "grammatical_rate",
    "save_checkpoint",
    "load_checkpoint",
    "SHIPPED_CHECKPOINT",
]

SHIPPED_CHECKPOINT = "ref.pt"
FORMAT = "klpenalty-demo-ref/1"


def encode_docs(docs: list[list[str]], vocab: Vocab, block_size: int) -> torch.Tensor:
    """(B, block_size + 1) int64: ``<bos>`` + the words, cut to length, ``<pad>`` after."""
    out = torch.full((len(docs), block_size + 1), vocab.pad, dtype=torch.long)
    for i, d in enumerate(docs):
        ids = [vocab.bos, *vocab.encode(d)][: block_size + 1]
        out[i, : len(ids)] = torch.tensor(ids)
    return out


@torch.no_grad()
def grammatical_rate(
    model: TinyGPT, vocab: Vocab, recognizer: Recognizer, n: int = 512, seed: int = 1
) -> float:
    """Fraction of ``n`` samples (temperature 1, up to block_size tokens) that are grammatical."""
    gen = torch.Generator().manual_seed(seed)
    tokens, _ = sample(model, n, model.cfg.block_size, vocab, gen)
    return sum(score_text(vocab.decode(t[1:]), recognizer).grammatical for t in tokens) / n


def pretrain(
    steps: int = 600,
    batch: int = 128,
    lr: float = 3e-3,
    seed: int = 0,
    grammar: Grammar | None = None,
    progress: Callable[[int, int, float], None] | None = None,
    eval_docs: int = 1000,
    eval_samples: int = 512,
) -> tuple[TinyGPT, Vocab, dict]:
    """Train the reference model on fresh grammar samples (deterministic for a seed).

    AdamW with a short warm-up and a cosine decay; one new batch of ``batch`` documents per
    step from a seeded ``random.Random``; the loss is the next-word cross entropy on real
    tokens (``<eos>`` included).

    Args:
        steps, batch, lr, seed: the optimisation (the shipped checkpoint: the defaults).
        grammar: the grammar to learn (default: the demo grammar).
        progress: called as ``progress(step, steps, loss)`` after every step.
        eval_docs, eval_samples: held-out documents and model samples for ``info``.

    Returns:
        ``(model, vocab, info)``; ``info`` has the settings, the held-out NLL per token, the
        grammar's own NLL per token on the same documents, and the grammatical-sample rate.
    """
    t0 = time.perf_counter()
    grammar = grammar or default_grammar()
    vocab = Vocab(grammar.terminals)
    torch.manual_seed(seed)
    rng = random.Random(seed)
    model = TinyGPT(GPTConfig(vocab_size=len(vocab)))
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    other = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.01}, {"params": other, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.98),
    )
    warmup = max(1, steps // 20)
    block = model.cfg.block_size
    model.train()
    for step in range(steps):
        scale = (step + 1) / warmup if step < warmup else 0.5 * (
            1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup))
        )
        for group in opt.param_groups:
            group["lr"] = lr * scale
        x = encode_docs([grammar.sample(rng)[0] for _ in range(batch)], vocab, block)
        logits = model(x[:, :-1])  # (B, T, V)
        loss = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), ignore_index=vocab.pad
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if progress is not None:
            progress(step + 1, steps, float(loss.detach()))
    model.eval()
    # held-out documents: model NLL per token vs the grammar's own (its entropy rate)
    val_rng = random.Random(seed + 12345)
    docs = [grammar.sample(val_rng) for _ in range(eval_docs)]
    x = encode_docs([d for d, _ in docs], vocab, block)
    with torch.no_grad():
        logits = model(x[:, :-1])
        nll = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), ignore_index=vocab.pad,
            reduction="sum",
        )
    n_tok = int((x[:, 1:] != vocab.pad).sum())
    short = [(d, lp) for d, lp in docs if len(d) <= block]
    info = {
        "steps": steps,
        "batch": batch,
        "lr": lr,
        "seed": seed,
        "val_nll_per_token": float(nll) / n_tok,
        "grammar_nll_per_token": -sum(lp for _, lp in short) / sum(len(d) for d, _ in short),
        "grammatical": grammatical_rate(model, vocab, Recognizer(grammar), n=eval_samples),
        "train_seconds": time.perf_counter() - t0,
        "torch": str(torch.__version__),
    }
    return model, vocab, info


def save_checkpoint(model: TinyGPT, vocab: Vocab, info: dict, path: str | Path) -> Path:
    """Save weights, sizes, vocabulary and training info (loadable with weights_only=True)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    torch.save(
        {
            "format": FORMAT,
            "config": model.cfg.to_dict(),
            "vocab": list(vocab.itos[2:]),
            "state_dict": state,
            "info": {k: v for k, v in info.items() if k != "train_seconds"},
        },
        path,
    )
    return path


def load_checkpoint(path: str | Path | None = None) -> tuple[TinyGPT, Vocab, dict]:
    """Load a reference checkpoint (default: the one shipped in the package).

    Returns:
        ``(model, vocab, info)`` with the model in eval mode, parameters frozen.
    """
    if path is None:
        with resources.as_file(resources.files(__package__) / SHIPPED_CHECKPOINT) as p:
            ckpt = torch.load(p, map_location="cpu", weights_only=True)
    else:
        ckpt = torch.load(Path(path), map_location="cpu", weights_only=True)
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise ValueError(f"{path or SHIPPED_CHECKPOINT} is not a {FORMAT} checkpoint")
    vocab = Vocab(ckpt["vocab"])
    model = TinyGPT(GPTConfig(**ckpt["config"]))
    model.load_state_dict(ckpt["state_dict"])
    model.eval().requires_grad_(False)
    return model, vocab, dict(ckpt["info"])
