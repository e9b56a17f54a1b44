"""The klpenalty.distributed package as a whole: public names, no process group, no backend
named in the code, and every worker check reported by some test module of this folder."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from klpenalty import AdaptiveKLController
from klpenalty import distributed as kd

from . import test_config, test_data_parallel, test_vocab_parallel, worker

MODULES = {"__init__.py", "_config.py", "_group.py", "data_parallel.py", "divergence.py",
           "vocab_parallel.py"}  # fmt: skip


def test_public_names():
    """The names klpenalty.distributed exported as one module, now re-exported by the package."""
    assert set(kd.__all__) == {"ControllerUpdate", "global_masked_mean", "global_sequence_mean",
                               "update_controller_globally", "vocab_parallel_full_kl",
                               "vocab_parallel_token_logprobs", "vocab_parallel_entropy",
                               "vocab_parallel_token_stats", "vocab_parallel_linear_kl",
                               "vocab_parallel_divergence",
                               "vocab_parallel_linear_divergence"}  # fmt: skip
    for name in kd.__all__:
        assert getattr(kd, name).__module__.startswith("klpenalty.distributed."), name


def test_every_worker_check_is_reported():
    """Each check of the worker is reported by exactly one test module here."""
    reported = [
        *test_vocab_parallel.VALUE_CHECKS,
        *test_vocab_parallel.EXPECTED_ERRORS,
        *test_vocab_parallel.ONE_RANK_ERRORS,
        *test_config.EXPECTED_ERRORS,
        test_config.SETTINGS_CHECK,
        *test_data_parallel.VALUE_CHECKS,
        *test_data_parallel.EXPECTED_ERRORS,
    ]
    assert sorted(reported) == sorted(worker.CHECKS)


def test_not_initialized_raises_runtime_error():
    # the pytest process never joins a process group: the ranks are subprocesses
    assert not torch.distributed.is_initialized()
    x = torch.zeros(2, 3)
    with pytest.raises(RuntimeError, match="not initialized"):
        kd.vocab_parallel_full_kl(x, x)
    with pytest.raises(RuntimeError, match="not initialized"):
        kd.update_controller_globally(AdaptiveKLController(0.1, 6, 100), 1.0, 1, 1)


def test_source_is_backend_agnostic():
    """Code (docstrings and comments aside) names no backend, moves no collective tensor to a
    fixed device, and uses only standard c10d calls, in every module of the package."""
    paths = sorted(Path(kd.__file__).parent.glob("*.py"))
    assert {p.name for p in paths} == MODULES
    for path in paths:
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
        "all_reduce", "all_gather", "ReduceOp", "ProcessGroup", "is_available",
        "is_initialized", "get_world_size", "get_rank",
    }, (name, used)  # fmt: skip
