"""The demo's KL recipes have the expected gradients docs/gradients.md states, and
``klpenalty demo --compare`` writes its report.

The gradients are checked by exact enumeration over the tabular policies of
tests/rlhf/test_gradients.py (its trees, targets and tolerances, imported): the recipe's reward
part and loss part come from the demo's own :func:`kl_reward` and :func:`kl_loss`, at β = 1 and
no score, with the two return shapes the demo uses (PPO: reward-to-go; GRPO: the text's total
reward at every token).
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from klpenalty import full_kl_reward_and_loss, sampled_kl, shaped_rewards
from klpenalty.cli import main
from klpenalty.demo.compare import COMPARE_RECIPES, compare_configs
from klpenalty.demo.rlhf import (
    KL_RECIPES,
    RunConfig,
    _group_advantages,
    kl_loss,
    kl_reward,
    run_rlhf,
)

from ..rlhf.tabular import (
    TOL_SEQ,
    TREES,
    Tree,
    assert_differs,
    assert_equal_grad,
    pg_loss,
)

# what docs/gradients.md states each placement's expected gradient is
EXPECTED = {
    "k1-reward": lambda t: t.grad_reverse(),  # ∇KL_seq
    "exact-split": lambda t: t.grad_reverse(),  # ∇KL_seq
    "exact-loss": lambda t: t.grad_pathwise(),  # the pathwise part only
    "exact-reward": lambda t: t.grad_reverse() - t.grad_pathwise(),  # the future part only
    "k3-loss": lambda t: t.grad_pathwise_forward(),  # Σ_t ∇KL_t(ρ‖π) at the visited states
    "k3-ratio-loss": lambda t: t.grad_pathwise(),  # the pathwise part only
}


def sequence_pg_loss(logprobs: torch.Tensor, rewards: torch.Tensor, mask: torch.Tensor):
    """(S,) −Σ_t log π(a_t)·stopgrad(Σ_u r_u): the GRPO-style return, one for every token."""
    total = rewards.sum(-1, keepdim=True).detach()
    return -torch.where(mask, logprobs * total, torch.zeros((), dtype=logprobs.dtype)).sum(-1)


def test_every_recipe_has_a_stated_gradient():
    assert set(EXPECTED) == set(KL_RECIPES)
    assert set(COMPARE_RECIPES["ppo"]) == set(KL_RECIPES)
    assert {"k1-reward", "exact-split", "k3-loss", "k3-ratio-loss"} <= set(COMPARE_RECIPES["grpo"])


@pytest.mark.parametrize("returns", ["reward-to-go", "sequence"])
@pytest.mark.parametrize("recipe", KL_RECIPES)
@pytest.mark.parametrize("name", list(TREES))
def test_recipe_expected_gradient(name, recipe, returns):
    tree = Tree(**TREES[name])
    logits, ref_logits = tree.logits(tree.theta), tree.logits(tree.ref)
    lp, ref_lp, mask = tree.logprobs(tree.theta), tree.logprobs(tree.ref), tree.mask
    zero = torch.zeros((), dtype=lp.dtype)
    # as the demo's loop computes them at sampling time (the policy that sampled = θ)
    k1 = torch.where(mask, sampled_kl(lp, ref_lp, "k1"), zero).detach()
    split = full_kl_reward_and_loss(logits.detach(), ref_logits, mask=mask)
    in_reward = kl_reward(recipe, k1, split)
    if in_reward is None:
        in_reward = torch.zeros_like(k1)
    rewards = shaped_rewards(torch.zeros_like(tree.scores), in_reward, mask, 1.0)
    pg = pg_loss if returns == "reward-to-go" else sequence_pg_loss
    per_seq = pg(lp, rewards, mask)
    in_loss = kl_loss(recipe, logits, ref_logits, lp, ref_lp, lp.detach(), mask)
    if in_loss is not None:
        per_seq = per_seq + in_loss.sum(-1)
    g = tree.expected_grad(per_seq)
    assert_equal_grad(g, EXPECTED[recipe](tree), TOL_SEQ)
    if recipe not in ("k1-reward", "exact-split"):
        assert_differs(g, tree.grad_reverse())


def test_group_advantages():
    # two groups of three texts; the advantage is the text's total minus its group's mean,
    # over one standard deviation for the batch, at each of its tokens
    rewards = torch.tensor([[1.0, 0.0], [2.0, 0.0], [3.0, 3.0], [0.0, 0.0], [1.0, 0.0],
                            [5.0, 0.0]])
    mask = torch.tensor([[True, False], [True, False], [True, True], [True, False],
                         [True, False], [True, False]])
    adv, scale = _group_advantages(rewards, mask, 3)
    centred = torch.tensor([-2.0, -1.0, 3.0, -2.0, -1.0, 3.0])
    sd = centred.square().mean().sqrt()
    torch.testing.assert_close(scale, sd.expand(6, 1))
    torch.testing.assert_close(adv, (centred / sd)[:, None] * mask)
    # every text of every group scores the same: advantages 0, scale 1 (never a division by 0)
    adv, scale = _group_advantages(torch.ones(4, 2), torch.ones(4, 2, dtype=torch.bool), 2)
    assert adv.eq(0).all() and scale.eq(1).all()


def test_run_config_checks_update_and_group():
    assert RunConfig(kl="full").kl == "exact-split" and RunConfig(kl="k1").kl == "k1-reward"
    with pytest.raises(ValueError, match="update must be one of"):
        RunConfig(update="dpo")
    with pytest.raises(ValueError, match=r"group must be >= 2 and divide batch \(128\), got 5"):
        RunConfig(update="grpo", group=5)


def test_runs_are_deterministic():
    cfg = RunConfig(beta=0.3, kl="k3-ratio-loss", update="grpo", group=4, steps=1, batch=8,
                    final_batch=8, max_new=8)
    a, b = run_rlhf(cfg), run_rlhf(cfg)
    timing = ("step_seconds",)
    for sa, sb in zip(a["steps"], b["steps"]):
        assert {k: v for k, v in sa.items() if k not in timing} == {
            k: v for k, v in sb.items() if k not in timing}


def test_compare_grid():
    configs = compare_configs(RunConfig(), (0.0, 0.1, 1.0), extra_seeds=1)
    keys = [(c.update, c.kl, c.beta, c.seed) for c in configs]
    assert len(keys) == len(set(keys))
    assert keys[:2] == [("ppo", "k1-reward", 0.0, 0), ("grpo", "k1-reward", 0.0, 0)]
    n = sum(len(k) for k in COMPARE_RECIPES.values())
    assert len(configs) == 2 + 2 * n + 2  # β = 0 per update, two β > 0, one extra seed each
    assert {c.seed for c in configs} == {0, 1}


def test_cli_compare_smoke(tmp_path, capsys):
    out = tmp_path / "compare"
    argv = ["demo", "--compare", "--beta", "0.3", "--steps", "2", "--batch", "8", "--group",
            "4", "--final-batch", "8", "--max-new", "8", "--jobs", "1", "--out", str(out)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    n_runs = 2 + sum(len(k) for k in COMPARE_RECIPES.values())
    assert f"({n_runs}/{n_runs} runs done)" in text and "| ppo | exact-split |" in text
    data = json.loads((out / "compare.json").read_text())
    runs = data["runs"]
    assert len(runs) == n_runs
    assert {(r["config"]["update"], r["config"]["kl"]) for r in runs if r["config"]["beta"]} == {
        (u, k) for u, kls in COMPARE_RECIPES.items() for k in kls}
    for r in runs:
        s = r["summary"]
        assert len(r["steps"]["kl"]) == 3 and r["steps"]["grad_norm"][-1] is None
        assert s["kl"] == r["steps"]["kl"][-1] >= 0 and 0 <= s["grammatical"] <= 1
        assert all(math.isfinite(s[k]) and s[k] >= 0 for k in (
            "kl_jitter", "grad_norm", "grad_norm_sd", "step_seconds", "cpu_seconds_per_step"))
        assert s["grad_norm"] > 0
    assert data["reference_point"]["kl"] == 0.0 and data["cpu_seconds"] > 0
    report = (out / "compare.md").read_text()
    assert "| grpo | k3-ratio-loss |" in report and "KL step-to-step sd" in report
    assert (out / "compare.png").stat().st_size > 10_000
