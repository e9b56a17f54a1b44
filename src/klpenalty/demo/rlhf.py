"""PPO-clip RLHF on the tiny GPT, using only klpenalty's public API for the KL penalty.

One run: sample a batch from the policy, score it (proxy reward = number of ``helpful``),
shape per-token rewards with :func:`klpenalty.shaped_rewards` (−β·k1 at every generated token,
the score on the last one), take the reward-to-go with a per-position baseline, and do a few
PPO-clip epochs.

``kl`` picks where the KL goes (the *recipe*; docs/gradients.md gives the expected gradient
of each):

=================  ====================================================  ======================
recipe             reward (detached, −β·x per token)   / loss (β·x)      E[gradient] of the KL
=================  ====================================================  ======================
``k1-reward``      k1 = log π − log ρ of the sampled token / nothing     ∇KL_seq
``exact-split``    :func:`klpenalty.full_kl_reward_and_loss`: the exact  ∇KL_seq
                   KL of the next position / the exact KL of this one
``exact-loss``     nothing / :func:`klpenalty.full_kl`                   pathwise part only
``exact-reward``   ``full_kl(...)`` detached, at its own position /      future part only
                   nothing
``k3-loss``        nothing / :func:`klpenalty.k3_loss` (GRPO)            Σ_t ∇KL_t(ρ‖π)
``k3-ratio-loss``  nothing / :func:`klpenalty.k3_ratio_loss` (TRL)       pathwise part only
=================  ====================================================  ======================

(``"k1"`` and ``"full"`` name the first two.) Loss terms are divided by the scale the
advantages were divided by, so β weighs the KL against the score in reward units whatever the
placement. ``update="grpo"`` replaces the reward-to-go and per-position baseline by
group-normalised sequence advantages: the sequence's total shaped reward, minus its group's
mean, over the batch's standard deviation of those differences, at every token.

Whatever the recipe, the KL that is *reported* is exact: the sum over the sampled path of
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

from klpenalty import (
    full_kl,
    full_kl_reward_and_loss,
    k3_loss,
    k3_ratio_loss,
    kl_report,
    token_logprobs,
)
from klpenalty.rlhf import (
    AdaptiveKLController,
    FixedKLController,
    sampled_kl,
    shaped_rewards,
)

from .grammar import EOS, Recognizer, default_grammar
from .model import sample, training_batch
from .pretrain import load_checkpoint
from .text import distinct_n, score_text

__all__ = [
    "RunConfig",
    "run_rlhf",
    "reward_to_go",
    "kl_reward",
    "kl_loss",
    "KL_RECIPES",
    "KL_MODES",
    "UPDATES",
    "KL_REPORT_TOP",
]

KL_RECIPES = ("k1-reward", "exact-split", "exact-loss", "exact-reward", "k3-loss", "k3-ratio-loss")
KL_ALIASES = {"k1": "k1-reward", "full": "exact-split"}
KL_MODES = (*KL_ALIASES, *KL_RECIPES)  # what ``RunConfig.kl`` accepts
UPDATES = ("ppo", "grpo")
KL_REPORT_TOP = 3  # positions (and vocabulary entries each) the final KL report lists


@dataclass
class RunConfig:
    """Settings of one RLHF run (the defaults are the demo's, pinned to the shipped reference).

    Attributes:
        beta: KL coefficient (the initial one with ``adaptive_target``).
        kl: the KL recipe, one of :data:`KL_RECIPES` (module docstring); ``"k1"`` (default)
            is ``"k1-reward"``, ``"full"`` is ``"exact-split"``.
        update: ``"ppo"`` (default): reward-to-go with a per-position baseline; ``"grpo"``:
            group-normalised sequence advantages (module docstring).
        group: texts per group for ``update="grpo"`` (divides ``batch``).
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
    update: str = "ppo"
    group: int = 16
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
        self.kl = KL_ALIASES.get(self.kl, self.kl)
        if self.update not in UPDATES:
            raise ValueError(f"update must be one of {UPDATES}, got {self.update!r}")
        if self.update == "grpo" and (self.group < 2 or self.batch % self.group):
            raise ValueError(
                f"group must be >= 2 and divide batch ({self.batch}), got {self.group}"
            )
        if not self.label:
            if self.adaptive_target is not None:
                self.label = f"adaptive {self.adaptive_target:g} nats (β₀={self.beta:g})"
            else:
                extra = [] if self.kl == "k1-reward" else [
                    "full KL" if self.kl == "exact-split" else self.kl]
                extra += [] if self.update == "ppo" else [self.update]
                self.label = f"β={self.beta:g}" + (f" ({', '.join(extra)})" if extra else "")


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

    Returns the (B, T) advantages and the (B, 1) scale each row was divided by (one value)."""
    m = mask.to(returns.dtype)
    baseline = (returns * m).sum(0) / m.sum(0).clamp_min(1.0)  # (T,)
    adv = (returns - baseline) * m
    n = m.sum()
    mean = adv.sum() / n
    var = ((adv - mean) * m).square().sum() / n
    scale = var.sqrt() + 1e-8
    return (adv - mean) / scale * m, scale.expand(returns.shape[0], 1)


def _group_advantages(
    rewards: torch.Tensor, mask: torch.Tensor, group: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO: each text's total reward minus its group's mean, over the batch's standard
    deviation of those differences (TRL's ``scale_rewards="batch"``), at each of its tokens.

    One scale for the batch, not one per group: a group whose texts all score the same would
    have a standard deviation of 0, and the loss terms are divided by the same scale.

    Returns the (B, T) advantages and the (B, 1) scale each row was divided by (one value;
    1 if every text's advantage is 0)."""
    total = rewards.sum(-1).view(-1, group)  # (B / group, group)
    centred = (total - total.mean(-1, keepdim=True)).view(-1, 1)  # (B, 1)
    sd = centred.square().mean().sqrt()
    scale = torch.where(sd > 1e-6, sd, torch.ones_like(sd)).expand_as(centred)
    return centred / scale * mask.to(rewards.dtype), scale


def kl_reward(
    recipe: str, k1: torch.Tensor, split: tuple[torch.Tensor, torch.Tensor]
) -> torch.Tensor | None:
    """The recipe's per-token KL for the reward (``shaped_rewards`` subtracts β times it).

    Args:
        recipe: one of :data:`KL_RECIPES`.
        k1: (B, T) float, log π − log ρ of the sampled tokens (0 where masked).
        split: ``(reward_kl, loss_kl) = full_kl_reward_and_loss(policy_logits, ref_logits,
            mask=mask)`` of the batch, each (B, T).

    Returns:
        (B, T) detached, or None for the recipes with nothing in the reward.
    """
    reward_kl, loss_kl = split
    if recipe == "k1-reward":
        return k1.detach()
    if recipe == "exact-split":  # the exact KL of the next position
        return reward_kl
    if recipe == "exact-reward":  # the exact KL at its own position: the future part only
        return loss_kl.detach()
    return None


def kl_loss(
    recipe: str,
    logits: torch.Tensor,
    ref_logits: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    mask: torch.Tensor,
) -> torch.Tensor | None:
    """The recipe's per-token KL term for the loss (added as β times its sum).

    Args:
        recipe: one of :data:`KL_RECIPES`.
        logits: (B, T, V) the policy's logits, differentiable.
        ref_logits: (B, T, V) the reference's.
        logprobs: (B, T) log π of the sampled tokens, differentiable (from ``logits``).
        ref_logprobs: (B, T) log ρ of the same tokens.
        old_logprobs: (B, T) log π_old of the same tokens, the policy that sampled them.
        mask: (B, T) bool, True = generated token.

    Returns:
        (B, T), 0 where masked, or None for the recipes with nothing in the loss.
    """
    if recipe == "exact-split":
        return full_kl_reward_and_loss(logits, ref_logits, mask=mask).loss_kl
    if recipe == "exact-loss":
        return full_kl(logits, ref_logits, mask=mask)
    if recipe == "k3-loss":
        return k3_loss(logprobs, ref_logprobs, mask=mask)
    if recipe == "k3-ratio-loss":
        return k3_ratio_loss(logprobs, ref_logprobs, old_logprobs=old_logprobs, mask=mask)
    return None


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
        progress: called as ``progress(step, metrics)`` after every step (after its update).

    Returns:
        ``{"config", "steps": [metrics per step, step 0 = before any update], "samples":
        [three texts of the final batch], "kl_report": kl_report(...).to_dict() of the final
        batch, "kl_report_text": its table, "kl_report_words": the words of the token ids it
        names, "seconds", "cpu_seconds"}``. Metrics (each step on ``batch`` fresh
        samples, the last on ``final_batch``): proxy, gold, grammatical
        (fractions), kl (exact sequence KL in nats, mean over texts), k1 (its sampled
        estimate), ref_nll (reference NLL per generated token), length, finished (fraction that
        emitted ``<eos>``), distinct1, distinct2, beta, one sample text, grad_norm (the
        gradient norm before clipping, mean over the step's updates) and step_seconds (wall
        time of the step); these two are None on the last, evaluation-only step.
    """
    t0, cpu0 = time.perf_counter(), time.process_time()
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
        t_step = time.perf_counter()
        n = cfg.batch if step < cfg.steps else max(cfg.batch, cfg.final_batch)
        # (B, T) each; padding targets are <eos>, masked out of every sum below
        inp, tgt, mask = training_batch(*sample(policy, n, cfg.max_new, vocab, gen), vocab.eos)
        with torch.no_grad():
            pol_logits = policy(inp)  # (B, T, V)
            ref_logits = ref(inp)  # (B, T, V)
            old_lp = token_logprobs(pol_logits, tgt)  # (B, T)
            ref_lp = token_logprobs(ref_logits, tgt)  # (B, T)
            k1 = torch.where(mask, sampled_kl(old_lp, ref_lp, "k1"), torch.zeros_like(old_lp))
            # (B, T) each: the exact KL of the next position, and of each position (0 where masked)
            split = full_kl_reward_and_loss(pol_logits, ref_logits, mask=mask)
            seq_kl = split.loss_kl.sum(-1)  # (B,) exact sequence KL along the sampled path, nats

        texts = [vocab.decode(row[m]) for row, m in zip(tgt, mask)]
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
            "grad_norm": None,  # mean over the step's updates, before clipping (set below)
            "step_seconds": None,  # wall time of sampling, scoring and the updates
        }
        log.append(metrics)
        if step == cfg.steps:
            if progress is not None:
                progress(step, metrics)
            # the exact KL of the evaluation batch next to the k1/k2/k3 estimates of its tokens
            report = kl_report(pol_logits, ref_logits, tgt, mask, top=KL_REPORT_TOP)
            break

        beta = controller.value
        # −β·(the recipe's KL) at every generated token, the score on the last one
        in_reward = kl_reward(cfg.kl, k1, split)
        if in_reward is None:
            in_reward = torch.zeros_like(k1)
        rewards = shaped_rewards(cfg.reward_scale * proxy, in_reward, mask, beta)
        if cfg.update == "ppo":
            adv, scale = _advantages(reward_to_go(rewards, mask), mask)  # (B, T), (B, 1)
        else:
            adv, scale = _group_advantages(rewards, mask, cfg.group)  # (B, T), (B, 1)
        norms = []
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
                in_loss = None if beta == 0 else kl_loss(
                    cfg.kl, logits, ref_logits[mb], lp, ref_lp[mb], old_lp[mb], m)
                if in_loss is not None:
                    # on the scale of the policy-gradient term: divided by the advantages' scale
                    loss = loss + beta * (in_loss / scale[mb]).sum() / m.sum()
                opt.zero_grad(set_to_none=True)
                loss.backward()
                norms.append(float(torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)))
                opt.step()
        controller.update(float(seq_kl.mean()), cfg.batch)
        metrics["grad_norm"] = sum(norms) / len(norms)
        metrics["step_seconds"] = time.perf_counter() - t_step
        if progress is not None:
            progress(step, metrics)

    return {
        "config": asdict(cfg),
        "steps": log,
        "samples": [" ".join(t) for t in texts[:3]],
        "kl_report": report.to_dict(),
        "kl_report_text": report.format(max_sequences=0),
        "kl_report_words": _report_words(report, vocab.itos),
        "seconds": time.perf_counter() - t0,
        "cpu_seconds": time.process_time() - cpu0,
    }
