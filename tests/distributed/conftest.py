"""Spawns the real gloo process groups once per session and hands their results to the tests.

One process group per world size (2 and 4, vocab 1001) runs ``tests/distributed/worker.py``
(one subprocess per rank, rendezvous through a FileStore in a tmp dir: no ports); it runs every
check once, and the test modules of this folder report each check as its own test. A hang
cannot block CI: the process group times out collectives after 20 s and the ranks are killed
after ``RUN_TIMEOUT_S``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import klpenalty

ROOT = Path(__file__).resolve().parents[2]  # holds the ``tests`` package
WORLD_SIZES = (2, 4)
RUN_TIMEOUT_S = 150


def _start(world: int, tmp: Path) -> tuple[list[subprocess.Popen], list]:
    src = str(Path(klpenalty.__file__).resolve().parents[1])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([src, str(ROOT), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    procs, logs = [], []
    for rank in range(world):
        log = open(tmp / f"rank{rank}.log", "w")
        logs.append(log)
        cmd = [sys.executable, "-m", "tests.distributed.worker", str(rank), str(world),
               str(tmp / "store"), str(tmp)]  # fmt: skip
        procs.append(
            subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        )
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


@pytest.fixture(scope="session")
def groups(tmp_path_factory) -> dict[int, list[dict]]:
    """Run every check once per world size, both groups at once; {world: [per-rank results]}."""
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.fail("this torch build has no torch.distributed / gloo: cannot run the ranks")
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


def results(groups: dict[int, list[dict]], world: int, check: str) -> list[dict]:
    """Every rank's result of ``check``; fails with the ranks' tracebacks if any rank failed."""
    per_rank = [r[check] for r in groups[world]]
    failed = [f"rank {i}:\n{r['error']}" for i, r in enumerate(per_rank) if not r["ok"]]
    assert not failed, "\n".join(failed)
    return per_rank


def assert_raised_on_every_rank(
    groups: dict[int, list[dict]], world: int, check: str, expected: tuple
) -> None:
    """Every rank raised (no hang: the group was still in step afterwards) as ``expected`` says.

    ``expected`` is (exception type name or None, text every message holds, same): with
    ``same`` the message is identical on every rank; otherwise the rank at fault raises its own
    error and the others one saying which rank rejected its arguments.
    """
    per_rank = [r["data"] for r in results(groups, world, check)]
    kind, text, same = expected
    if kind is not None:
        assert {d["type"] for d in per_rank} == {kind}, per_rank
    assert all(text in d["msg"] for d in per_rank), per_rank
    if same:
        assert len({d["msg"] for d in per_rank}) == 1, per_rank
    else:
        assert len({d["msg"] for d in per_rank}) == 2, per_rank
        assert any("rejected their own arguments" in d["msg"] for d in per_rank), per_rank
