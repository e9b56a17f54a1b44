"""PPO-clip RLHF on the tiny GPT, using only klpenalty's public API for the KL penalty.

One run: sample a batch from the policy, score it (proxy reward = number of ``helpful``),
shape per-token rewards with :func:`klpenalty.shaped_rewards` (−β·k1 at every generated token,
the score on the last one), take the reward-to-go with a per-position baseline, and do a few
PPO-clip epochs.

With ``kl="full"`` the penalty uses the exact per-position KL instead of k1, correctly: the
KL at position t depends on the prefix only, not on the token sampled at t, so it cannot be a
per-token reward at t. The exact KL of position t + 1 (which the token at t does influence)
goes into the reward at t, so the return carries the KL of later positions, and the
differentiable exact KL of each visited position is added to the loss.

Either way, the KL that is *reported* is exact: the sum over the sampled path of
:func:`klpenalty.full_kl`, the full-vocabulary KL(π‖ρ) of every next-token distribution.

Shape letters: B batch, T generated tokens, V vocabulary.
"""

from __future__ import annotations

import copy
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from klpenalty import full_kl, kl_report, token_logprobs
from klpenalty.rlhf import (
    AdaptiveKLController,
    FixedKLController,
    next_token_kl,
    sampled_kl,
    shaped_rewards,
)

from .grammar import EOS, Recognizer, default_grammar
from .model import sample
from .pretrain import load_checkpoint
from .text import distinct_n, score_text

__all__ = ["RunConfig", "run_rlhf", "reward_to_go", "KL_MODES", "KL_REPORT_TOP"]

KL_MODES = ("k1", "full")
KL_REPORT_TOP = 3  # positions (and vocabulary entries each) the final KL report lists


@dataclass
class RunConfig:
    """Settings of one RLHF run (the defaults are the demo's, pinned to the shipped reference).

    Attributes:
        beta: KL coefficient (the initial one with ``adaptive_target``).
        kl: ``"k1"`` (default) puts −β·(log π − log ρ) of each sampled token in the reward;
            ``"full"`` uses the exact full-vocabulary KL as described in the module docstring.
        adaptive_target: if set, an :class:`klpenalty.AdaptiveKLController` steers the exact
            sequence KL toward this many nats, starting from ``beta`` (> 0).
        horizon: the controller's horizon, in samples.
        steps: PPO iterations (each one new batch).
        batch: texts per batch.
        max_new: generation length limit in tokens.
        lr: Adam learning rate.
        epochs: PPO epochs per batch.
        minibatches: minibatches per epoch.
        clip: PPO clip range ε.
        reward_scale: the sequence score is ``reward_scale × count("helpful")``.
        final_batch: texts sampled for the last logged step (after the last update), larger
            than ``batch`` so the final table is less noisy.
        seed: seeds torch and the sampler; the same for every β, so runs differ only by β.
        label: name in the report (default from β).
    """

    beta: float = 0.1
    kl: str = "k1"
    adaptive_target: float | None = None
    horizon: float = 256.0
    steps: int = 40
    batch: int = 128
    max_new: int = 32
    lr: float = 1e-3
    epochs: int = 4
    minibatches: int = 1
    clip: float = 0.2
    reward_scale: float = 1.0
    final_batch: int = 512
    seed: int = 0
    label: str = field(default="")

    def __post_init__(self) -> None:
        if self.kl not in KL_MODES:
            raise ValueError(f"kl must be one of {KL_MODES}, got {self.kl!r}")
        if not self.label:
            self.label = (
                (f"β={self.beta:g}" if self.kl == "k1" else f"β={self.beta:g} (full KL)")
                if self.adaptive_target is None
                else f"adaptive {self.adaptive_target:g} nats (β₀={self.beta:g})"
            )


def reward_to_go(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """G_t = Σ_{s≥t} r_s along each row (undiscounted), 0 where ``mask`` is False.

    Args:
        rewards: (B, T) float per-token rewards (0 on padding).
        mask: (B, T) bool, True = generated token.

    Returns:
        (B, T) float, the dtype of ``rewards``.
    """
    g = rewards.flip(-1).cumsum(-1).flip(-1)
    return torch.where(mask, g, torch.zeros_like(g))


def _advantages(returns: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position batch-mean baseline, then whitening over the real tokens.

    Returns the (B, T) advantages and the scale they were divided by (a scalar tensor)."""
    m = mask.to(returns.dtype)
    baseline = (returns * m).sum(0) / m.sum(0).clamp_min(1.0)  # (T,)
    adv = (returns - baseline) * m
    n = m.sum()
    mean = adv.sum() / n
    var = ((adv - mean) * m).square().sum() / n
    scale = var.sqrt() + 1e-8
    return (adv - mean) / scale * m, scale


def _report_words(report, words: list[str]) -> dict[str, str]:
    """The words of the token ids a KL report names (id as a string -> word), for its legend."""
    ids = {t.token for t in report.no_mass_first}
    for p in report.top_positions:
        ids |= {p.token, *(e.token for e in p.entries)}
    return {str(i): words[i] for i in sorted(ids)}


def run_rlhf(
    cfg: RunConfig,
    ref_path: str | Path | None = None,
    progress: Callable[[int, dict], None] | None = None,
) -> dict:
    """Run PPO-clip RLHF from the reference checkpoint and return its log.

    Args:
        cfg: the run's settings.
        ref_path: reference checkpoint (default: the one shipped in the package).
        progress: called as ``progress(step, metrics)`` after every logged step.

    Returns:
        ``{"config", "steps": [metrics per step, step 0 = before any update], "samples":
        [three texts of the final batch], "kl_report": kl_report(...).to_dict() of the final
        batch, "kl_report_text": its table, "kl_report_words": the words of the token ids it
        names, "seconds"}``. Metrics (each step on ``batch`` fresh
        samples, the last on ``final_batch``): proxy, gold, grammatical
        (fractions), kl (exact sequence KL in nats, mean over texts), k1 (its sampled
        estimate), ref_nll (reference NLL per generated token), length, finished (fraction that
        emitted ``<eos>``), distinct1, distinct2, beta, and one sample text.
    """
    t0 = time.perf_counter()
    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    ref, vocab, _ = load_checkpoint(ref_path)
    policy = copy.deepcopy(ref).requires_grad_(True)
    recognizer = Recognizer(default_grammar())
    if cfg.adaptive_target is None:
        controller = FixedKLController(cfg.beta)
    else:
        controller = AdaptiveKLController(cfg.beta, cfg.adaptive_target, cfg.horizon)
    opt = torch.optim.Adam(policy.parameters(), lr=cfg.lr)
    log: list[dict] = []
    texts: list[list[str]] = []

    for step in range(cfg.steps + 1):
        n = cfg.batch if step < cfg.steps else max(cfg.batch, cfg.final_batch)
        tokens, mask = sample(policy, n, cfg.max_new, vocab, gen)
        length = int(mask.sum(1).max())
        tokens, mask = tokens[:, : length + 1], mask[:, :length]  # (B, 1+T), (B, T)
        inp = tokens[:, :-1]  # (B, T)
        # padding targets are replaced by <eos> so every log-prob is finite (<pad> has
        # probability 0); those positions are masked out of every sum below
        tgt = torch.where(mask, tokens[:, 1:], torch.full_like(tokens[:, 1:], vocab.eos))
        with torch.no_grad():
            pol_logits = policy(inp)  # (B, T, V)
            ref_logits = ref(inp)  # (B, T, V)
            old_lp = token_logprobs(pol_logits, tgt)  # (B, T)
            ref_lp = token_logprobs(ref_logits, tgt)  # (B, T)
            k1 = torch.where(mask, sampled_kl(old_lp, ref_lp, "k1"), torch.zeros_like(old_lp))
            exact = full_kl(pol_logits, ref_logits, mask=mask)  # (B, T), 0 where masked
            seq_kl = exact.sum(-1)  # (B,) exact sequence KL along the sampled path, nats

        texts = [vocab.decode(row[1:]) for row in tokens]
        scores = [score_text(t, recognizer) for t in texts]
        proxy = torch.tensor([s.proxy for s in scores], dtype=torch.float32)  # (B,)
        n_tok = mask.sum()
        metrics = {
            "step": step,
            "proxy": float(proxy.mean()),
            "gold": sum(s.gold for s in scores) / n,
            "grammatical": sum(s.grammatical for s in scores) / n,
            "kl": float(seq_kl.mean()),
            "k1": float(k1.sum(-1).mean()),
            "ref_nll": float(-torch.where(mask, ref_lp, torch.zeros_like(ref_lp)).sum() / n_tok),
            "length": float(n_tok) / n,
            "finished": sum(bool(t) and t[-1] == EOS for t in texts) / n,
            # distinct-n depends on how many texts it is taken over: always cfg.batch of them
            "distinct1": distinct_n(texts[: cfg.batch], 1),
            "distinct2": distinct_n(texts[: cfg.batch], 2),
            "beta": controller.value,
            "samples": n,
            "sample": " ".join(texts[0]),
        }
        log.append(metrics)
        if progress is not None:
            progress(step, metrics)
        if step == cfg.steps:
            # the exact KL of the evaluation batch next to the k1/k2/k3 estimates of its tokens
            report = kl_report(pol_logits, ref_logits, tgt, mask, top=KL_REPORT_TOP)
            break

        beta = controller.value
        if cfg.kl == "k1":  # −β·k1 on every generated token, the score on the last one
            kl_reward = k1
        else:  # the exact KL of position t + 1 is the penalty for the token sampled at t
            kl_reward = next_token_kl(exact, mask)
        rewards = shaped_rewards(cfg.reward_scale * proxy, kl_reward, mask, beta)
        adv, scale = _advantages(reward_to_go(rewards, mask), mask)  # (B, T), ()
        order = torch.arange(cfg.batch)
        for _ in range(cfg.epochs):
            if cfg.minibatches > 1:
                order = torch.randperm(cfg.batch)
            for mb in order.chunk(cfg.minibatches):
                logits = policy(inp[mb])  # (b, T, V)
                lp = token_logprobs(logits, tgt[mb])  # (b, T)
                ratio = torch.exp(lp - old_lp[mb])
                a = adv[mb]
                surrogate = torch.minimum(ratio * a, ratio.clamp(1 - cfg.clip, 1 + cfg.clip) * a)
                m = mask[mb]
                loss = -torch.where(m, surrogate, torch.zeros_like(surrogate)).sum() / m.sum()
                if cfg.kl == "full" and beta > 0:
                    # the direct gradient of Σ_t KL_t, on the same scale as the whitened
                    # policy-gradient term (both divided by the advantages' scale)
                    kl_now = full_kl(logits, ref_logits[mb], mask=m)  # (b, T)
                    loss = loss + beta * kl_now.sum() / (scale * m.sum())
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
                opt.step()
        controller.update(float(seq_kl.mean()), cfg.batch)

    return {
        "config": asdict(cfg),
        "steps": log,
        "samples": [" ".join(t) for t in texts[:3]],
        "kl_report": report.to_dict(),
        "kl_report_text": report.format(max_sequences=0),
        "kl_report_words": _report_words(report, vocab.itos),
        "seconds": time.perf_counter() - t0,
    }
