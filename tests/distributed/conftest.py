"""Spawns the real process groups once per session and hands their results to the tests.

One process group per world size (vocab 1001) runs ``tests/distributed/worker.py`` (one
subprocess per rank, rendezvous through a FileStore in a tmp dir: no ports); it runs every
check once, and the test modules of this folder report each check as its own test.

Backend (:data:`BACKEND`): ``gloo`` on CPU tensors, world sizes 2 and 3 (Triton's kernels
interpreted); where CUDA and NCCL are
available, ``nccl`` with one rank per GPU: world sizes 2 and 4 as far as there are GPUs, or a
single rank on one GPU. ``KLPENALTY_TEST_DIST=gloo|nccl`` forces the backend and
``KLPENALTY_TEST_WORLDS=1,2`` the world sizes (e.g. the single-rank run on CPU). A hang
cannot block CI: the process group times out collectives after 20 s and the ranks are killed
after ``RUN_TIMEOUT_S``.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from filelock import FileLock

from ..ranks import collect_ranks, start_ranks, wait_ranks

RUN_TIMEOUT_S = 300


def _backend() -> str:
    forced = os.environ.get("KLPENALTY_TEST_DIST", "")
    if forced:
        return forced
    usable = torch.cuda.is_available() and torch.distributed.is_available()
    return "nccl" if usable and torch.distributed.is_nccl_available() else "gloo"


def _world_sizes(backend: str) -> tuple[int, ...]:
    forced = os.environ.get("KLPENALTY_TEST_WORLDS", "")
    if forced:
        return tuple(int(w) for w in forced.split(","))
    if backend != "nccl":
        return (2, 3)
    gpus = torch.cuda.device_count()  # NCCL wants a GPU of its own per rank
    return tuple(w for w in (2, 4) if w <= gpus) or (1,)


BACKEND = _backend()
WORLD_SIZES = _world_sizes(BACKEND)


def _start(world: int, tmp: Path) -> tuple[list[subprocess.Popen], list]:
    # the Triton backend's kernels run in its interpreter on CPU
    env = {"TRITON_INTERPRET": "1"} if BACKEND == "gloo" else None
    return start_ranks("tests.distributed.worker", world, tmp,
                       [str(tmp / "store"), str(tmp), BACKEND], env)


def _collect(world: int, tmp: Path, procs: list[subprocess.Popen]) -> list[dict]:
    return collect_ranks(f"world {world}", tmp, procs)


def _run_groups(root: Path) -> dict[int, list[dict]]:
    if not torch.distributed.is_available() or not torch.distributed.is_backend_available(BACKEND):
        pytest.fail(f"this torch build has no torch.distributed / {BACKEND}: cannot run the ranks")
    runs = {}
    for world in WORLD_SIZES:
        tmp = root / f"world{world}"
        tmp.mkdir()
        runs[world] = (tmp, *_start(world, tmp))
    procs = [p for _, ps, _ in runs.values() for p in ps]
    logs = [log for _, _, ls in runs.values() for log in ls]
    wait_ranks(procs, logs, RUN_TIMEOUT_S, "the process groups")
    return {world: _collect(world, tmp, ps) for world, (tmp, ps, _) in runs.items()}


@pytest.fixture(scope="session")
def groups(tmp_path_factory) -> dict[int, list[dict]]:
    """Run every check once per world size, both groups at once; {world: [per-rank results]}.
    Under pytest-xdist the first worker to ask runs them and leaves the results (or its
    failure) in the workers' shared temporary folder; the others wait on its lock and read
    them (or fail with the same message, without a run of their own)."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return _run_groups(tmp_path_factory.mktemp("groups"))
    shared = tmp_path_factory.getbasetemp().parent
    with FileLock(str(shared / "groups.lock")):
        done = shared / "groups.json"
        if done.is_file():
            saved = json.loads(done.read_text())
            if "error" in saved:
                pytest.fail(f"the process groups failed in another worker:\n{saved['error']}")
            return {int(w): r for w, r in saved["groups"].items()}
        try:
            out = _run_groups(tmp_path_factory.mktemp("groups"))
        except (Exception, pytest.fail.Exception) as err:
            done.write_text(json.dumps({"error": f"{type(err).__name__}: {err}"}))
            raise
        done.write_text(json.dumps({"groups": out}))
        return out


def needs_peers(world: int, check: str) -> None:
    """Skip a check that compares ranks (arguments that differ across ranks, a rank at fault
    and the others) in a single-rank group, where it has nothing to compare."""
    if world == 1 and check in PEER_CHECKS:
        pytest.skip(f"{check} compares ranks: a single-rank group has none to compare")


# the worker checks that need at least two ranks
PEER_CHECKS = frozenset(
    [
        "check_err_leading_dims", "check_err_vocab_overlap", "check_err_vocab_order",
        "check_err_dtype", "check_err_mask", "check_err_temperature", "check_err_tokens_differ",
        "check_err_local_shape", "check_err_controller_beta", "check_err_global_mean_local",
        "check_err_linear_bias_shard", "check_err_settings_differ",
    ]
)  # fmt: skip


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
