"""A tiny GPT (2 layers, 4 heads, width 64, ~107k parameters) and its word vocabulary.

Shape letters: B batch, T sequence, V vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["GPTConfig", "TinyGPT", "Vocab", "sample", "training_batch"]

PAD = "<pad>"
BOS = "<bos>"


class Vocab:
    """Word <-> id map: ``<pad>`` = 0, ``<bos>`` = 1, then the grammar's words.

    Args:
        words: the grammar's terminals (including ``<eos>``), in a fixed order.
    """

    def __init__(self, words: Sequence[str]) -> None:
        self.itos: list[str] = [PAD, BOS, *words]
        if len(set(self.itos)) != len(self.itos):
            raise ValueError("duplicate words in the vocabulary")
        self.stoi = {w: i for i, w in enumerate(self.itos)}
        self.pad = 0
        self.bos = 1
        self.eos = self.stoi["<eos>"]

    def __len__(self) -> int:
        return len(self.itos)

    def encode(self, words: Sequence[str]) -> list[int]:
        return [self.stoi[w] for w in words]

    def decode(self, ids: Sequence[int]) -> list[str]:
        """Words for ``ids``, stopping before padding (``<bos>`` is dropped)."""
        out = []
        for i in ids:
            i = int(i)
            if i == self.pad:
                break
            if i != self.bos:
                out.append(self.itos[i])
        return out


@dataclass
class GPTConfig:
    vocab_size: int
    block_size: int = 32
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


class _Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.out = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x, cache=None):  # x: (B, T, C)
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=-1)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        if cache is not None:  # incremental decoding: append to the cached keys / values
            if cache:
                k = torch.cat([cache[0], k], dim=2)
                v = torch.cat([cache[1], v], dim=2)
            cache[:] = [k, v]
            causal = t > 1
        else:
            causal = True
        y = F.scaled_dot_product_attention(q, k, v, is_causal=causal)  # (B, H, T, C/H)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    """Decoder-only transformer with learned positions and pre-LayerNorm blocks.

    Args:
        cfg: sizes; the demo's reference uses 2 layers, 4 heads, width 64, 32 positions.
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        # <pad> (id 0) and <bos> (id 1) are never a next token: their logits are -inf in both
        # the policy and the reference, which the exact KL handles as 0·log 0 = 0
        never = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        never[:2] = True
        self.register_buffer("never", never, persistent=False)
        self.apply(self._init)
        for block in self.blocks:  # GPT-2 style scaled init of residual projections
            for lin in (block.proj, block.out):
                nn.init.normal_(lin.weight, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor, caches=None, start: int = 0) -> torch.Tensor:
        """Next-token logits.

        Args:
            idx: (B, T) int64 token ids, T ≤ block_size − start.
            caches: optional list (one per layer) of key/value lists for incremental decoding.
            start: position of ``idx[:, 0]`` (with ``caches``).

        Returns:
            (B, T, V) float32 logits; position t predicts token t + 1. The logits of
            ``<pad>`` and ``<bos>`` are -inf.
        """
        t = idx.shape[1]
        if start + t > self.cfg.block_size:
            raise ValueError(f"sequence of {start + t} tokens exceeds block_size {self.cfg.block_size}")
        pos = torch.arange(start, start + t, device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for i, block in enumerate(self.blocks):
            x = block(x, None if caches is None else caches[i])
        return self.head(self.ln_f(x)).masked_fill(self.never, float("-inf"))


@torch.no_grad()
def sample(
    model: TinyGPT,
    batch: int,
    max_new: int,
    vocab: Vocab,
    generator: torch.Generator,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample ``batch`` texts with a key/value cache, each stopping after ``<eos>``.

    Args:
        model: the policy, in any mode (sampling runs without gradients).
        batch: number of texts B.
        max_new: at most this many tokens per text (≤ block_size).
        vocab: gives the ``<bos>``, ``<eos>`` and ``<pad>`` ids.
        generator: torch RNG, for reproducible samples.
        temperature: > 0.

    Returns:
        ``(tokens, mask)``: tokens (B, 1 + max_new) int64 starting with ``<bos>``, padded with
        ``<pad>`` after ``<eos>``; mask (B, max_new) bool, True for the generated tokens
        (``<eos>`` included), i.e. the positions whose log-probs count.
    """
    if max_new > model.cfg.block_size:
        raise ValueError(f"max_new={max_new} exceeds block_size {model.cfg.block_size}")
    tokens = torch.full((batch, 1 + max_new), vocab.pad, dtype=torch.long)
    tokens[:, 0] = vocab.bos
    alive = torch.ones(batch, dtype=torch.bool)
    caches = [[] for _ in model.blocks]
    cur = tokens[:, :1]
    for t in range(max_new):
        logits = model(cur, caches=caches, start=t)[:, -1].float()  # (B, V)
        probs = torch.softmax(logits / temperature, dim=-1)
        nxt = torch.multinomial(probs, 1, generator=generator).squeeze(1)  # (B,)
        nxt = torch.where(alive, nxt, torch.full_like(nxt, vocab.pad))
        tokens[:, t + 1] = nxt
        alive &= nxt != vocab.eos
        if not bool(alive.any()):
            break
        cur = nxt.unsqueeze(1)
    mask = tokens[:, 1:] != vocab.pad
    return tokens, mask


def training_batch(
    tokens: torch.Tensor, mask: torch.Tensor, eos: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inputs, targets and mask of :func:`sample`'s texts, cut to the longest one.

    Args:
        tokens, mask: as :func:`sample` returns them, (B, 1 + max_new) and (B, max_new).
        eos: the ``<eos>`` id, the target put at padded positions so that every log-prob is
            finite (``<pad>`` has probability 0); those positions are masked out of every sum.

    Returns:
        ``(inp, tgt, mask)``, each (B, T) with T the longest text's length: the model reads
        ``inp`` and position t predicts ``tgt[:, t]``.
    """
    length = int(mask.sum(1).max())
    tokens, mask = tokens[:, : length + 1], mask[:, :length]
    tgt = torch.where(mask, tokens[:, 1:], torch.full_like(tokens[:, 1:], eos))
    return tokens[:, :-1], tgt, mask
