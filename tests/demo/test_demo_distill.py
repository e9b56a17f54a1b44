"""``klpenalty demo --distill``: every recipe trains the student, deterministically; the
recipes' per-token terms are the ones the demo's docs state; the CLI writes its report and
resumes without redoing finished runs."""

from __future__ import annotations

import json
import math

import pytest
import torch

from klpenalty.cli import main
from klpenalty.demo.distill import (
    DISTILL_RECIPES,
    OPD_RECIPES,
    DistillConfig,
    distill_run_file,
    load_distill_run,
    opd_terms,
    run_distill,
    summarize_distill,
)

TINY = dict(steps=2, batch=8, final_batch=8, max_new=8)
TIMING = ("step_seconds", "cpu_seconds")


def _untimed(run: dict) -> list[dict]:
    return [{k: v for k, v in s.items() if k not in TIMING} for s in run["steps"]]


@pytest.fixture(scope="module")
def tiny_runs():
    torch.set_num_threads(1)
    return {r: run_distill(DistillConfig(recipe=r, **TINY)) for r in DISTILL_RECIPES}


def test_every_recipe_runs(tiny_runs):
    first = _untimed(tiny_runs["vopd"])[0]
    first.pop("grad_norm")
    for recipe, run in tiny_runs.items():
        steps = run["steps"]
        assert len(steps) == TINY["steps"] + 1 and steps[-1]["grad_norm"] is None
        # the same student, the same first batch, whatever the recipe
        assert {k: v for k, v in _untimed(run)[0].items() if k != "grad_norm"} == first
        for s in steps:
            assert s["reverse_kl"] > 0 and s["forward_kl"] > 0 and s["teacher_logprob"] < 0
            assert s["reverse_kl_seq"] == pytest.approx(s["reverse_kl"] * s["length"], rel=1e-5)
            assert 0 <= s["grammatical"] <= 1
        assert all(math.isfinite(s["grad_norm"]) and s["grad_norm"] > 0 for s in steps[:-1])
        cpu = [s["cpu_seconds"] for s in steps]
        assert cpu == sorted(cpu) and cpu[0] > 0 and cpu[-1] == cpu[-2]  # the last only measures
        assert run["student_parameters"] < run["teacher_parameters"] / 3


def test_runs_are_deterministic(tiny_runs):
    for recipe in ("exact_jsd", "sft"):
        again = run_distill(DistillConfig(recipe=recipe, **TINY))
        assert _untimed(again) == _untimed(tiny_runs[recipe])
        assert again["samples"] == tiny_runs[recipe]["samples"]
    other = run_distill(DistillConfig(recipe="sft", **{**TINY, "seed": 1}))
    assert _untimed(other) != _untimed(tiny_runs["sft"])


def test_recipe_terms():
    # the per-token terms the demo relies on (docs/demo.md): two texts, the second padded
    lp = torch.tensor([[-1.0, -2.0, -0.5], [-0.2, -1.5, -9.0]])
    t_lp = torch.tensor([[-1.5, -1.0, -0.5], [-0.7, -1.0, -2.0]])
    div = torch.tensor([[0.3, 0.2, 0.1], [0.4, 0.6, 7.0]], requires_grad=True)
    mask = torch.tensor([[True, True, True], [True, True, False]])
    k1 = torch.tensor([[0.5, -1.0, 0.0], [0.5, -0.5, 0.0]])
    d = torch.tensor([[0.3, 0.2, 0.1], [0.4, 0.6, 0.0]])
    fut_d = torch.tensor([[0.3, 0.1, 0.0], [0.6, 0.0, 0.0]])  # Σ_{u>t} d_u over real tokens
    fut_k1 = torch.tensor([[-1.0, 0.0, 0.0], [-0.5, 0.0, 0.0]])  # Σ_{u>t} k1_u
    expected = {  # advantages, loss
        "sampled_k1": (-k1, torch.zeros(2, 3)),
        "vopd": (-k1 + d, torch.zeros(2, 3)),
        "minillm": (-fut_k1, d),
        "exact_reverse": (-fut_d, d),
        "exact_forward": (torch.zeros(2, 3), d),
        "exact_jsd": (torch.zeros(2, 3), d),
    }
    kinds = {"sampled_k1": None, "vopd": "reverse_kl", "minillm": "reverse_kl",
             "exact_reverse": "reverse_kl", "exact_forward": "forward_kl", "exact_jsd": "jsd"}
    for name, (adv_want, loss_want) in expected.items():
        recipe = OPD_RECIPES[name]
        assert recipe.kind == kinds[name]
        adv, loss = opd_terms(recipe, lp, t_lp, token_divergence=None if recipe.kind is None
                              else div, mask=mask)
        m = mask.float()
        torch.testing.assert_close(adv * m, adv_want * m)
        torch.testing.assert_close(loss * m, loss_want * m)
        assert not adv.requires_grad
        if recipe.kind is not None and name != "vopd":
            (loss * m).sum().backward()
            torch.testing.assert_close(div.grad, m)  # the divergence itself, differentiable
            div.grad = None


def test_config_checks():
    with pytest.raises(ValueError, match="recipe must be one of"):
        DistillConfig(recipe="k3")
    with pytest.raises(ValueError, match="width must be a positive multiple of 4"):
        DistillConfig(width=30)
    with pytest.raises(ValueError, match=r"max_new must be in \[1, 32\]"):
        DistillConfig(max_new=33)


def test_summary_counts_steps_to_grammatical():
    n = 25
    gram = [0.0] * 5 + [1.0] * (n - 5) + [1.0]  # + the final evaluation
    run = {"config": {"recipe": "vopd", "seed": 0},
           "steps": {"reverse_kl": [1.0] * (n + 1), "reverse_kl_seq": [5.0] * (n + 1),
                     "forward_kl": [1.0] * (n + 1), "teacher_logprob": [-2.0] * (n + 1),
                     "grammatical": gram, "length": [5.0] * (n + 1),
                     "grad_norm": [1.0, 3.0] * (n // 2) + [1.0, None],
                     "cpu_seconds": [0.5 * (i + 1) for i in range(n)] + [0.5 * n]}}
    s = summarize_distill(run)
    # trailing mean over 10 batches reaches 0.8 at the 8th all-grammatical step: step 12
    assert s["steps_to_grammatical"] == 12 and s["cpu_to_grammatical"] == 6.5
    assert s["grad_norm"] == 1.0 and s["cpu_seconds"] == 0.5 * n
    run["steps"]["grammatical"] = [0.5] * (n + 1)
    assert summarize_distill(run)["steps_to_grammatical"] is None


def test_cli_distill_writes_and_resumes(tmp_path, capsys):
    out = tmp_path / "distill"
    argv = ["demo", "--distill", "--steps", "2", "--batch", "8", "--final-batch", "8",
            "--max-new", "8", "--jobs", "1", "--out", str(out)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    n = len(DISTILL_RECIPES)
    assert f"({n}/{n} runs done)" in text and "| exact_forward |" in text
    data = json.loads((out / "distill.json").read_text())
    assert [r["config"]["recipe"] for r in data["runs"]] == list(DISTILL_RECIPES)
    for r in data["runs"]:
        assert len(r["steps"]["reverse_kl"]) == 3 and r["summary"]["cpu_seconds"] > 0
    assert data["teacher"]["reverse_kl"] == 0.0 and data["teacher"]["grammatical"] > 0.5
    assert data["runs_resumed"] == 0 and data["cpu_seconds"] > 0
    assert "KL(π‖ν) at" in (out / "distill.md").read_text()
    assert (out / "distill.png").stat().st_size > 10_000
    saved = {p.name: p.read_text() for p in (out / "distill-runs").iterdir()}
    assert len(saved) == n
    # rerun: every run is read back, none redone; a changed setting runs again
    assert main([*argv, "--no-plots"]) == 0
    text = capsys.readouterr().out
    assert f"{n} run(s) already in" in text and "runs done" not in text
    assert json.loads((out / "distill.json").read_text())["runs_resumed"] == n
    assert {p.name: p.read_text() for p in (out / "distill-runs").iterdir()} == saved
    # a run saved with other settings is not read back
    cfg = DistillConfig(recipe="vopd", **TINY)
    assert load_distill_run(distill_run_file(out / "distill-runs", cfg), cfg) is not None
    changed = DistillConfig(recipe="vopd", **{**TINY, "lr": 1e-3})
    assert load_distill_run(distill_run_file(out / "distill-runs", changed), changed) is None


def test_distill_options_are_checked():
    with pytest.raises(SystemExit, match="--distill has no KL coefficient"):
        main(["demo", "--distill", "--beta", "0.1"])
    with pytest.raises(SystemExit, match="--width is the --distill student's"):
        main(["demo", "--width", "16"])
    with pytest.raises(SystemExit, match="--distill and --compare are separate demos"):
        main(["demo", "--distill", "--compare"])
