"""Start the ranks of a real process group as subprocesses, and read back their results.

Used by ``tests/distributed/conftest.py`` and ``tests/integrations/test_wrapped.py``. Each rank
runs ``python -m MODULE RANK WORLD ARGS...`` from the repository root with this checkout's
``src`` first on the path and one thread, logs to ``TMP/rank{RANK}.log`` and writes its results
to ``TMP/rank{RANK}.json`` (``{"results": {...}}``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import klpenalty

ROOT = Path(__file__).resolve().parents[1]  # holds the ``tests`` package


def start_ranks(module: str, world: int, tmp: Path, args: list[str],
                env: dict[str, str] | None = None) -> tuple[list[subprocess.Popen], list]:
    """The ``world`` rank processes (started, not awaited) and their open log files."""
    src = str(Path(klpenalty.__file__).resolve().parents[1])
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = os.pathsep.join([src, str(ROOT), full_env.get("PYTHONPATH", "")])
    full_env["OMP_NUM_THREADS"] = "1"
    full_env.update(env or {})
    procs, logs = [], []
    for rank in range(world):
        log = open(tmp / f"rank{rank}.log", "w")
        logs.append(log)
        cmd = [sys.executable, "-m", module, str(rank), str(world), *args]
        procs.append(subprocess.Popen(cmd, env=full_env, cwd=ROOT, stdout=log,
                                      stderr=subprocess.STDOUT))
    return procs, logs


def collect_ranks(label: str, tmp: Path, procs: list[subprocess.Popen]) -> list[dict]:
    """Every rank's results; fails with the log's tail of a rank that did not write them."""
    out = []
    for rank, p in enumerate(procs):
        path = tmp / f"rank{rank}.json"
        if p.returncode != 0 or not path.exists():
            text = (tmp / f"rank{rank}.log").read_text()[-4000:]
            pytest.fail(f"{label} rank {rank} exited with {p.returncode}:\n{text}")
        out.append(json.loads(path.read_text())["results"])
    return out


def wait_ranks(procs: list[subprocess.Popen], logs: list, timeout_s: float, label: str) -> None:
    """Wait for every process, at most ``timeout_s`` in all: past that, kill them (only these)
    and fail, so that a hang cannot block CI. Closes the logs."""
    deadline = time.monotonic() + timeout_s
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
            p.wait()
        pytest.fail(f"{label}: the ranks did not finish within {timeout_s} s")
    finally:
        for log in logs:
            log.close()
