"""The tiny GPT, its sampler, and the reference checkpoint shipped in the package."""

from __future__ import annotations

from importlib import resources

import pytest
import torch

from klpenalty.demo.grammar import Recognizer, default_grammar
from klpenalty.demo.model import GPTConfig, TinyGPT, sample
from klpenalty.demo.pretrain import grammatical_rate, load_checkpoint, pretrain


@pytest.fixture(scope="module")
def shipped():
    torch.set_num_threads(1)
    return load_checkpoint()


def test_shipped_checkpoint_is_small_and_loads_weights_only():
    ref = resources.files("klpenalty.demo") / "ref.pt"
    with resources.as_file(ref) as path:
        assert path.stat().st_size < 1_000_000
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    assert ckpt["format"] == "klpenalty-demo-ref/1"
    assert ckpt["config"] == {"vocab_size": 42, "block_size": 32, "n_layer": 2, "n_head": 4,
                              "n_embd": 64}
    assert ckpt["info"]["grammatical"] >= 0.95  # measured on 512 samples when it was built


def test_shipped_checkpoint_is_mostly_grammatical(shipped):
    model, vocab, info = shipped
    assert 90_000 < sum(p.numel() for p in model.parameters()) < 120_000
    assert vocab.itos[2:] == default_grammar().terminals
    # built at ≥ 95% (512 samples); on 128 fresh samples a true rate of 95% falls below 88%
    # with probability < 1e-3 (binomial), so this fails only if the checkpoint is wrong
    assert grammatical_rate(model, vocab, Recognizer(default_grammar()), n=128, seed=5) >= 0.88


def test_incremental_decoding_matches_full_forward(shipped):
    model, vocab, _ = shipped
    gen = torch.Generator().manual_seed(0)
    tokens, mask = sample(model, 8, 32, vocab, gen)
    full = model(tokens[:, :-1])  # (B, T, V)
    caches = [[] for _ in model.blocks]
    steps = [model(tokens[:, t : t + 1], caches=caches, start=t) for t in range(tokens.shape[1] - 1)]
    inc = torch.cat(steps, dim=1)
    finite = torch.isfinite(full)
    assert torch.equal(finite, torch.isfinite(inc))
    # float32 with different reduction orders (one query vs all): agreement to ~1e-6
    torch.testing.assert_close(inc[finite], full[finite], atol=1e-4, rtol=1e-4)


def test_sample_layout(shipped):
    model, vocab, _ = shipped
    gen = torch.Generator().manual_seed(1)
    tokens, mask = sample(model, 64, 32, vocab, gen)
    assert tokens.shape == (64, 33) and mask.shape == (64, 32)
    assert (tokens[:, 0] == vocab.bos).all()
    gen_tokens = tokens[:, 1:]
    assert not (gen_tokens == vocab.bos).any()  # <bos> is never predicted
    assert mask.sum(1).min() >= 1
    for row, m in zip(gen_tokens, mask):
        n = int(m.sum())
        assert m[:n].all() and not m[n:].any()  # real tokens first, then padding
        assert (row[n:] == vocab.pad).all()
        assert (row[: n - 1] != vocab.eos).all()  # <eos> only as the last real token
        assert n == 32 or row[n - 1] == vocab.eos


def test_pretraining_is_deterministic():
    torch.set_num_threads(1)
    a, _, _ = pretrain(steps=3, batch=8, eval_docs=4, eval_samples=4)
    b, _, _ = pretrain(steps=3, batch=8, eval_docs=4, eval_samples=4)
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), name
    c, _, _ = pretrain(steps=3, batch=8, seed=1, eval_docs=4, eval_samples=4)
    assert not torch.equal(a.head.weight, c.head.weight)


def test_model_rejects_too_long_input():
    model = TinyGPT(GPTConfig(vocab_size=10, block_size=4))
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, 5, dtype=torch.long))
