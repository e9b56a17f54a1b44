"""klpenalty.distributed on real gloo process groups (CPU), world sizes 2 and 4, vocab 1001.

One process group per world size is spawned (``tests/distributed_worker.py``, one subprocess
per rank, rendezvous through a FileStore in a tmp dir: no ports), and it runs every check;
each check is reported here as its own test. A hang cannot block CI: the process group times
out collectives after 20 s and the ranks are killed after ``RUN_TIMEOUT_S``.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import klpenalty
from klpenalty import AdaptiveKLController
from klpenalty import distributed as kd

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import distributed_worker as worker  # noqa: E402

WORLD_SIZES = (2, 4)
RUN_TIMEOUT_S = 150

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="this torch build has no torch.distributed / gloo",
)


def _start(world: int, tmp: Path) -> tuple[list[subprocess.Popen], list]:
    src = str(Path(klpenalty.__file__).resolve().parents[1])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([src, env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    procs, logs = [], []
    for rank in range(world):
        log = open(tmp / f"rank{rank}.log", "w")
        logs.append(log)
        cmd = [sys.executable, str(HERE / "distributed_worker.py"), str(rank), str(world),
               str(tmp / "store"), str(tmp)]  # fmt: skip
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
    return procs, logs


def _collect(world: int, tmp: Path, procs: list[subprocess.Popen]) -> list[dict]:
    out = []
    for rank, p in enumerate(procs):
        path = tmp / f"rank{rank}.json"
        if p.returncode != 0 or not path.exists():
            text = (tmp / f"rank{rank}.log").read_text()[-4000:]
            pytest.fail(f"world {world} rank {rank} exited with {p.returncode}:\n{text}")
        out.append(json.loads(path.read_text())["results"])
    return out


@pytest.fixture(scope="module")
def groups(tmp_path_factory) -> dict[int, list[dict]]:
    """Run every check once per world size, both groups at once; {world: [per-rank results]}."""
    runs = {}
    for world in WORLD_SIZES:
        tmp = tmp_path_factory.mktemp(f"world{world}")
        runs[world] = (tmp, *_start(world, tmp))
    procs = [p for _, ps, _ in runs.values() for p in ps]
    deadline = time.monotonic() + RUN_TIMEOUT_S
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        for p in procs:  # only the processes this fixture started
            p.kill()
            p.wait()
        pytest.fail(f"the ranks did not finish within {RUN_TIMEOUT_S} s")
    finally:
        for _, _, logs in runs.values():
            for log in logs:
                log.close()
    return {world: _collect(world, tmp, ps) for world, (tmp, ps, _) in runs.items()}


def _results(groups, world: int, check: str) -> list[dict]:
    per_rank = [r[check] for r in groups[world]]
    failed = [f"rank {i}:\n{r['error']}" for i, r in enumerate(per_rank) if not r["ok"]]
    assert not failed, "\n".join(failed)
    return per_rank


VALUE_CHECKS = [c for c in worker.CHECKS if not c.startswith("check_err_")]
ERROR_CHECKS = [c for c in worker.CHECKS if c.startswith("check_err_")]


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("check", VALUE_CHECKS)
def test_values_and_gradients(groups, world, check):
    """Forward values, gradients, statistics: each rank asserted against single-process."""
    _results(groups, world, check)


def test_communication_cost_per_position(groups):
    """The documented figures: 20 bytes/position for full KL, 12 for token log-probs (fp32)."""
    for world in WORLD_SIZES:
        for r in _results(groups, world, "check_communication_volume"):
            assert r["data"] == {
                "full_kl_bytes_per_position": 20.0,
                "token_bytes_per_position": 12.0,
            }


# What the message must say, per error check. "same" = identical text on every rank.
EXPECTED_ERRORS = {
    "check_err_leading_dims": ("ValueError", "leading dims", True),
    "check_err_vocab_gap": ("ValueError", "(a gap: ", True),
    "check_err_vocab_overlap": ("ValueError", "(an overlap: ", True),
    "check_err_vocab_order": ("ValueError", "they tile it, but not in rank order", True),
    "check_err_dtype": ("ValueError", "dtype differs across ranks", True),
    "check_err_mask": ("ValueError", "mask differs across ranks", True),
    "check_err_temperature": ("ValueError", "temperature differs across ranks", True),
    "check_err_tokens_differ": ("ValueError", "tokens differ across ranks", True),
    "check_err_token_range": ("ValueError", "[0, 1001)", True),
    "check_err_nan": ("ValueError", "policy_logits hold NaN", True),
    "check_err_ref_all_neginf": ("ValueError", "ref_logits are -inf over the whole", True),
    "check_err_policy_all_neginf": ("ValueError", "policy_logits are -inf over the whole", True),
    "check_err_controller_beta": ("ValueError", "beta differ across ranks", True),
    "check_err_global_mean_empty": ("ValueError", "no position counts", True),
    # a rank whose own arguments are bad raises its own error; the others say which rank
    "check_err_local_shape": ("ValueError", "", False),
    "check_err_global_mean_local": (None, "", False),
}


def test_every_error_check_has_an_expectation():
    assert sorted(EXPECTED_ERRORS) == sorted(ERROR_CHECKS)


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("check", ERROR_CHECKS)
def test_error_raised_on_every_rank(groups, world, check):
    """Every rank raised (no hang: the group was still in step afterwards), same message."""
    per_rank = [r["data"] for r in _results(groups, world, check)]
    kind, text, same = EXPECTED_ERRORS[check]
    if kind is not None:
        assert {d["type"] for d in per_rank} == {kind}, per_rank
    assert all(text in d["msg"] for d in per_rank), per_rank
    if same:
        assert len({d["msg"] for d in per_rank}) == 1, per_rank
    else:
        assert len({d["msg"] for d in per_rank}) == 2, per_rank
        assert any("rejected their own arguments" in d["msg"] for d in per_rank), per_rank


def test_errors_name_the_ranks(groups):
    msg = _results(groups, 4, "check_err_leading_dims")[0]["data"]["msg"]
    assert "rank 3: (2, 4)" in msg and "rank 0: (2, 3)" in msg, msg
    msg = _results(groups, 4, "check_err_vocab_gap")[0]["data"]["msg"]
    assert "rank 3 starts at 552" in msg and "rank 3: [552, 1002)" in msg, msg


def test_not_initialized_raises_runtime_error():
    if torch.distributed.is_initialized():
        pytest.skip("a process group is initialized in this process")
    x = torch.zeros(2, 3)
    with pytest.raises(RuntimeError, match="not initialized"):
        kd.vocab_parallel_full_kl(x, x)
    with pytest.raises(RuntimeError, match="not initialized"):
        kd.update_controller_globally(AdaptiveKLController(0.1, 6, 100), 1.0, 1, 1)


def test_source_is_backend_agnostic():
    """Code (docstrings and comments aside) names no backend, moves no collective tensor to a
    fixed device, and uses only standard c10d calls."""
    for path in sorted(Path(kd.__file__).parent.glob("*.py")):
        _assert_backend_agnostic(ast.parse(path.read_text()), path.name)


def _assert_backend_agnostic(tree: ast.Module, name: str) -> None:
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef))
        and node.body and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }  # fmt: skip
    words = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            words.append(node.id)
        elif isinstance(node, ast.Attribute):
            words.append(node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if id(node) not in docstrings:
                words.append(node.value)
    text = " ".join(words).lower()
    for word in ("gloo", "nccl", "mpi", "ucc", "cuda", "get_backend", "_get_default_group"):
        assert word not in text, (name, word)
    attrs = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    assert "cpu" not in attrs, name  # no .cpu(): collective tensors stay on the inputs' device
    used = {
        n.attr for n in ast.walk(tree)
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "dist"
    }  # fmt: skip
    assert used <= {
        "all_reduce", "all_gather", "ReduceOp", "is_available", "is_initialized",
        "get_world_size", "get_rank",
    }, (name, used)  # fmt: skip
