"""causal_lm_kl on models held as users train them, in two processes (gloo): DDP, FSDP2, FSDP1
(both ``use_orig_params``), DeepSpeed ZeRO-3 (the engine and its ``.module``), sharded
references, PEFT (adapter-disabled reference, gradient checkpointing, LoRA on the head,
``modules_to_save``), tied embeddings, packed rows and top-k/top-p.

One process group per wrapper (``tests/integrations/wrapped_worker.py``, one subprocess per
rank, a FileStore rendezvous) runs all of its checks; each check is reported as its own test.
A hang cannot block CI: collectives time out after 60 s and the ranks are killed after
:data:`RUN_TIMEOUT_S`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import klpenalty

from . import wrapped_worker as worker

ROOT = Path(__file__).resolve().parents[2]  # holds the ``tests`` package
WORLD = 2
RUN_TIMEOUT_S = 240
CASES = [(group, name) for group, checks in worker.GROUPS.items() for name in checks]


def _run_group(group: str, tmp: Path) -> list[dict]:
    src = str(Path(klpenalty.__file__).resolve().parents[1])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([src, str(ROOT), env.get("PYTHONPATH", "")])
    env.update(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", TOKENIZERS_PARALLELISM="false")
    procs, logs = [], []
    for rank in range(WORLD):
        log = open(tmp / f"rank{rank}.log", "w")
        logs.append(log)
        cmd = [sys.executable, "-m", "tests.integrations.wrapped_worker", str(rank), str(WORLD),
               str(tmp / "store"), str(tmp), group]  # fmt: skip
        procs.append(subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log,
                                      stderr=subprocess.STDOUT))
    try:
        for p in procs:
            p.wait(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()
    finally:
        for log in logs:
            log.close()
    out = []
    for rank, p in enumerate(procs):
        path = tmp / f"rank{rank}.json"
        if p.returncode != 0 or not path.exists():
            text = (tmp / f"rank{rank}.log").read_text()[-4000:]
            pytest.fail(f"{group}: rank {rank} exited with {p.returncode}:\n{text}")
        out.append(json.loads(path.read_text()))
    return out


@pytest.fixture(scope="module")
def group_results(tmp_path_factory):
    cache: dict[str, list[dict]] = {}

    def get(group: str) -> list[dict]:
        if group not in cache:
            cache[group] = _run_group(group, tmp_path_factory.mktemp(group))
        return cache[group]

    return get


@pytest.mark.parametrize("group, name", CASES, ids=[name for _, name in CASES])
def test_wrapped(group_results, group, name):
    for rank, results in enumerate(group_results(group)):
        result = results[name]
        assert result["ok"], f"rank {rank}:\n{result['error']}"
