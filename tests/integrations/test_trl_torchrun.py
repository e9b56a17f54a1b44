"""``GRPOTrainer(kl_estimator="exact")`` under torchrun: DDP (1 and 2 processes), gradient
checkpointing, a LoRA policy with ``ref_model=None``, DeepSpeed ZeRO-3; klpenalty's
``DistillationTrainer`` (a teacher of another hidden size): DDP, a LoRA student, ZeRO-3.

Each (case, world size) starts ``torchrun`` once (gloo on CPU; ``trl_torchrun_worker.py`` has
the cases and what each rank records) for two training steps; the tests below read what the
ranks wrote. A hang cannot block the suite: collectives time out (``ddp_timeout``) and the
process group is killed after :data:`RUN_TIMEOUT_S` (30 s before, each rank prints its threads'
stacks and exits).

Checked: training completes with the model as accelerate wraps it; after the steps every
parameter is equal on all ranks although the ranks trained on different batches (the gradient
was all-reduced), every trainable parameter moved and no frozen one did; the logged
``kl_exact`` of each step equals the exact KL of that step's batch over all ranks, computed
independently with :func:`klpenalty.full_kl` on float64 copies of the models' own logits;
the distillation loss of every loss call on every rank equals TRL's reduction of the float64
reference divergence of that rank's batch (``divergence_reference`` on float64 copies of both
models' logits), as a single process computes it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import torch

from ..tolerances import tol

ROOT = Path(__file__).resolve().parents[2]  # holds the ``tests`` package
RUN_TIMEOUT_S = 240
# (case, world size): DDP with one process too (accelerate wraps the model whenever torchrun
# sets up a process group), there with gradient checkpointing
GRPO_RUNS = [("checkpointing", 1), ("ddp", 2), ("peft", 2), ("zero3", 2)]
# klpenalty's DistillationTrainer: a teacher of another hidden size, two processes
DISTILL_RUNS = [("distill-ddp", 2), ("distill-peft", 2), ("distill-zero3", 2)]
RUNS = GRPO_RUNS + DISTILL_RUNS
WRAPPER = {"zero3": "DeepSpeedEngine", "distill-zero3": "DeepSpeedEngine"}  # else DDP
_RESULTS: dict[tuple[str, int], list[dict]] = {}


def launch(case: str, world: int, out: Path) -> list[dict] | str:
    """torchrun with ``world`` processes on the worker: each rank's JSON, or what failed."""
    env = dict(os.environ)
    src = str(Path(__import__("klpenalty").__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([src, str(ROOT), env.get("PYTHONPATH", "")])
    env.update(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={world}", "-m", "tests.integrations.trl_torchrun_worker",
           case, str(out), str(RUN_TIMEOUT_S - 30)]  # fmt: skip
    log_path = out / "torchrun.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
        try:
            code = proc.wait(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            code = f"killed after {RUN_TIMEOUT_S} s"
        finally:  # also when the test run itself is interrupted
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    if code != 0:  # the ranks' own tracebacks, not torchrun's
        lines = log_path.read_text().splitlines()
        ranks = [line for line in lines if line.startswith("[rank")] or lines
        return f"{case}, {world} processes: torchrun exited with {code}:\n" + "\n".join(
            ranks[-60:]
        )
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def results(case: str, world: int, tmp_path_factory) -> list[dict]:
    """Each rank's results of the (case, world) run; the run starts once, and a failed run
    fails every test that reads it (with the ranks' tracebacks)."""
    key = (case, world)
    if key not in _RESULTS:
        _RESULTS[key] = launch(case, world, tmp_path_factory.mktemp(f"{case}-{world}"))
    if isinstance(_RESULTS[key], str):
        pytest.fail(_RESULTS[key])
    return _RESULTS[key]


@pytest.mark.parametrize("case, world", RUNS, ids=[f"{c}-{w}" for c, w in RUNS])
def test_trains_and_the_ranks_weights_stay_equal(case, world, tmp_path_factory):
    ranks = results(case, world, tmp_path_factory)
    for r in ranks:
        assert r["world"] == world and r["global_step"] == 2
        assert r["wrapped"] == WRAPPER.get(case, "DistributedDataParallel")
        assert r["partitioned"] == case.endswith("zero3")  # ZeRO-3 shards every parameter
        # TRL's reference: none with a PEFT policy (the adapter disabled), else a separate
        # model; the distillation's teacher: always a separate model
        assert (r["ref_model"] is None) == (case == "peft")
        assert r["gap"] and all(g == 0.0 for g in r["gap"].values()), r["gap"]
        assert r["moved"] and all(m > 0.0 for m in r["moved"].values()), r["moved"]
        assert all(m == 0.0 for m in r["frozen_moved"].values()), r["frozen_moved"]
    if case.endswith("peft"):  # only the adapter trains
        assert all("lora_" in n for n in ranks[0]["moved"]) and ranks[0]["frozen_moved"]
    if world > 1:  # equal weights after different batches: the gradients were all-reduced
        assert ranks[0]["batch"] != ranks[1]["batch"]


@pytest.mark.parametrize("case, world", GRPO_RUNS, ids=[f"{c}-{w}" for c, w in GRPO_RUNS])
def test_logged_kl_exact_is_the_batchs_kl(case, world, tmp_path_factory):
    ranks = results(case, world, tmp_path_factory)
    logged = ranks[0]["logged"]
    assert len(logged) == 2 and all(r["logged"] == logged for r in ranks)
    atol, rtol = tol(torch.float32)["atol"], tol(torch.float32)["rtol"]  # float32 fast path
    for step, value in enumerate(logged):
        total = sum(r["kl"][step][0] for r in ranks)
        tokens = sum(r["kl"][step][1] for r in ranks)
        expected = total / tokens  # kl_exact: per completion token, over every rank's batch
        assert expected > 1e-3  # a KL to get right
        assert value == pytest.approx(expected, abs=atol, rel=rtol)


@pytest.mark.parametrize("case, world", DISTILL_RUNS,
                         ids=[f"{c}-{w}" for c, w in DISTILL_RUNS])
def test_distillation_loss_is_the_batchs_divergence(case, world, tmp_path_factory):
    ranks = results(case, world, tmp_path_factory)
    atol, rtol = tol(torch.float32)["atol"], tol(torch.float32)["rtol"]  # float32 fast path
    for r in ranks:
        assert len(r["losses"]) == 2  # one loss call per step
        # the loss's gradient planned and formed in the forward, received as planned through
        # the wrapper's backward (DDP's all-reduce, ZeRO-3's reduce-scatter come after)
        assert r["handed"] == [True, True]
        for loss, expected in r["losses"]:
            assert expected > 1e-3  # a divergence to get right
            assert loss == pytest.approx(expected, abs=atol, rel=rtol)
