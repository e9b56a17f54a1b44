"""causal_lm_kl on models held as users train them, in two processes (gloo): DDP, FSDP2, FSDP1
(both ``use_orig_params``), DeepSpeed ZeRO-3 (the engine and its ``.module``), sharded
references, PEFT (adapter-disabled reference, gradient checkpointing, LoRA on the head,
``modules_to_save``), tied embeddings, packed rows and top-k/top-p.

Two process groups (``tests/integrations/wrapped_worker.py``: torch's wrappers and PEFT, then
DeepSpeed; one subprocess per rank, a FileStore rendezvous) run all the checks; each check is
reported as its own test.
A hang cannot block CI: collectives time out after 60 s and the ranks are killed after
:data:`RUN_TIMEOUT_S`.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ..ranks import collect_ranks, start_ranks, wait_ranks
from . import wrapped_worker as worker

WORLD = 2
RUN_TIMEOUT_S = 240
CASES = [(group, name) for group, checks in worker.GROUPS.items() for name in checks]


def _run_group(group: str, tmp: Path) -> list[dict]:
    env = dict(DS_ACCELERATOR="cpu", TOKENIZERS_PARALLELISM="false")
    procs, logs = start_ranks("tests.integrations.wrapped_worker", WORLD, tmp,
                              [str(tmp / "store"), str(tmp), group], env)
    wait_ranks(procs, logs, RUN_TIMEOUT_S, group)
    return collect_ranks(group, tmp, procs)


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
