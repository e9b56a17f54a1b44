"""The RLHF loop: the KL penalty keeps the policy close and grammatical; the CLI writes a report."""

from __future__ import annotations

import json

import pytest
import torch

from klpenalty.cli import main
from klpenalty.demo.rlhf import RunConfig, reward_to_go, run_rlhf


def test_reward_to_go():
    r = torch.tensor([[1.0, 2.0, 3.0, 0.0], [0.5, 0.0, 0.0, 0.0]])
    m = torch.tensor([[True, True, True, False], [True, False, False, False]])
    torch.testing.assert_close(
        reward_to_go(r, m), torch.tensor([[6.0, 5.0, 3.0, 0.0], [0.5, 0.0, 0.0, 0.0]])
    )


@pytest.fixture(scope="module")
def short_runs():
    torch.set_num_threads(1)
    cfg = dict(steps=12, batch=64, final_batch=256, seed=0)
    return {b: run_rlhf(RunConfig(beta=b, **cfg)) for b in (0.0, 1.0)}


def test_penalty_keeps_kl_low_and_text_grammatical(short_runs):
    free, leashed = short_runs[0.0]["steps"][-1], short_runs[1.0]["steps"][-1]
    start = short_runs[0.0]["steps"][0]
    assert start["kl"] == 0.0 and start["grammatical"] >= 0.85  # policy = reference at step 0
    assert free["proxy"] > 5 * start["proxy"]  # the unpenalised policy hacks the reward ...
    assert leashed["kl"] * 5 <= free["kl"]  # ... the penalised one stays ≥ 5× closer in KL
    # ... and grammatical. One step's batch swings by ±0.1 here (0.73-1.0 over the β = 1 run),
    # and the swings follow the last bits of the kernel's arithmetic (AVX2 and AVX-512 builds
    # part after step 7), so the grammar is judged over the last six steps.
    late = lambda run: sum(s["grammatical"] for s in run["steps"][-6:]) / 6  # noqa: E731
    assert late(short_runs[1.0]) >= 0.85
    assert late(short_runs[1.0]) >= late(short_runs[0.0]) + 0.25


def test_exact_kl_penalty_done_right_also_keeps_the_leash(short_runs):
    # kl="full": exact KL of later positions in the return, current one in the loss. (Used
    # wrongly, as a detached reward at its own position, the exact KL teaches the policy to
    # stop at once; see docs.) Done right it keeps the length and the grammar.
    run = run_rlhf(RunConfig(beta=1.0, kl="full", steps=12, batch=64, final_batch=256, seed=0))
    end = run["steps"][-1]
    assert end["kl"] * 5 <= short_runs[0.0]["steps"][-1]["kl"]
    assert end["grammatical"] >= 0.9
    assert end["length"] >= 0.7 * run["steps"][0]["length"]
    assert run["config"]["kl"] == "exact-split"  # "full" names this recipe


def test_run_config_rejects_unknown_kl_mode():
    with pytest.raises(ValueError, match="kl must be one of"):
        RunConfig(kl="exact")


def test_logged_metrics_are_consistent(short_runs):
    for run in short_runs.values():
        steps = run["steps"]
        assert [s["step"] for s in steps] == list(range(13))
        assert [s["samples"] for s in steps] == [64] * 12 + [256]
        for s in steps:
            assert 0 <= s["gold"] <= s["proxy"]
            assert 0 <= s["grammatical"] <= 1 and 1 <= s["length"] <= 32
            assert s["kl"] >= 0
        assert len(run["samples"]) == 3
        # the KL report of the final batch agrees with the logged exact KL and k1
        rep, last = run["kl_report"], steps[-1]
        assert rep["shape"][0] == 256 and rep["sequences_used"] == 256
        assert rep["exact_per_sequence"] == pytest.approx(last["kl"], rel=1e-5, abs=1e-6)
        assert rep["estimators"]["k1"]["mean_per_sequence"] == pytest.approx(
            last["k1"], rel=1e-5, abs=1e-6
        )
        assert "k1" in run["kl_report_text"] and "top 3 position(s)" in run["kl_report_text"]


def test_cli_demo_writes_report(tmp_path, capsys):
    out = tmp_path / "demo"
    argv = ["demo", "--beta", "0", "0.3", "--steps", "2", "--batch", "8", "--final-batch", "8",
            "--jobs", "1", "--out", str(out)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "| start |" in text and str(out / "report.md") in text
    metrics = json.loads((out / "metrics.json").read_text())
    assert [r["config"]["beta"] for r in metrics["runs"]] == [0.0, 0.3]
    assert all(len(r["steps"]) == 3 for r in metrics["runs"])
    report = (out / "report.md").read_text()
    assert "| 0.3 |" in report and "distinct-2" in report
    assert "## KL report (final evaluation batch)" in report and "**β=0.3**" in report
    assert "Tokens: " in report  # the words of the token ids the report names
    assert metrics["runs"][1]["kl_report"]["counted"] > 0
    assert (out / "demo.png").stat().st_size > 10_000


def test_worker_reports_progress_and_result():
    # the function each parallel process runs, here in-process with a plain queue
    import queue

    from klpenalty.demo.runner import _worker

    q = queue.Queue()
    _worker(3, dict(beta=0.1, steps=1, batch=4, final_batch=4), None, q)
    msgs = [q.get_nowait() for _ in range(q.qsize())]
    assert [m[0] for m in msgs] == ["step", "step", "done"]
    assert all(m[1] == 3 for m in msgs) and msgs[1][2] == 1
    assert set(msgs[0][3]) == {"proxy", "gold", "grammatical", "kl"}
    assert len(msgs[2][2]["steps"]) == 2
    _worker(0, dict(beta=-1.0), None, q)  # a failing run reports its traceback
    kind, index, text = q.get_nowait()
    assert kind == "error" and index == 0 and "beta" in text


def test_cli_adaptive_runs_in_process(tmp_path):
    out = tmp_path / "adaptive"
    argv = ["demo", "--beta", "0.2", "--adaptive", "5", "--horizon", "16", "--steps", "2",
            "--batch", "8", "--final-batch", "8", "--jobs", "1", "--no-plots", "--out", str(out)]
    assert main(argv) == 0
    run = json.loads((out / "metrics.json").read_text())["runs"][0]
    assert run["config"]["adaptive_target"] == 5.0
    betas = [s["beta"] for s in run["steps"]]
    assert betas[0] == 0.2 and betas[1] != 0.2  # the controller moved β
    assert f"→ β={betas[-1]:.3g}" in (out / "report.md").read_text()
