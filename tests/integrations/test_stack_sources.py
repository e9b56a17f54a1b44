"""verl's and OpenRLHF's own KL functions, read from their installed source, against ours.

``make test-integrations`` installs verl and OpenRLHF with ``--no-deps`` (their source only:
importing either package needs Ray, DeepSpeed and more). This file reads the functions'
definitions out of the installed files with ``ast`` and runs them with torch, without importing
the packages. Checked: the stacks' functions agree with the formula copies in
``stack_formulas.py`` (which the tests that ``make test`` runs use), on values and gradients;
and klpenalty's wrappers report the stacks' values and have the gradients of the stacks'
gradient-correct options (verl's "+" types, OpenRLHF's ``unbiased_gradient=True``) on-policy.
"""

from __future__ import annotations

import ast
import importlib.metadata
import typing

import pytest
import torch

from klpenalty.integrations.openrlhf import compute_approx_kl
from klpenalty.integrations.verl import kl_penalty

from ..tolerances import tol
from .cases import logprob_pairs
from .stack_formulas import (
    OPENRLHF_ESTIMATORS,
    VERL_TYPES,
    openrlhf_compute_approx_kl,
    verl_kl_penalty,
)


def stack_functions(dist: str, path: str, names: set[str]) -> dict:
    """The top-level functions and constants ``names`` of an installed file, without importing
    its package: parsed, kept, compiled and run with torch and typing in scope."""
    file = importlib.metadata.distribution(dist).locate_file(path)
    tree = ast.parse(file.read_text(), str(file))
    kept = [
        node for node in tree.body
        if (isinstance(node, ast.FunctionDef) and node.name in names)
        or (isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id in names for t in node.targets))
    ]
    found = {getattr(n, "name", None) or n.targets[0].id for n in kept}
    assert found == names, f"{dist} {path}: found {sorted(found)} of {sorted(names)}"
    scope = {"torch": torch, **{k: getattr(typing, k) for k in ("Optional", "Tuple", "Union")}}
    exec(compile(ast.Module(body=kept, type_ignores=[]), str(file), "exec"), scope)
    return scope


@pytest.fixture(scope="module")
def verl():
    return stack_functions(
        "verl", "verl/trainer/ppo/core_algos.py", {"kl_penalty", "kl_penalty_forward"}
    )["kl_penalty"]


@pytest.fixture(scope="module")
def openrlhf():
    return stack_functions(
        "openrlhf", "openrlhf/models/utils.py", {"compute_approx_kl", "KL_IS_WEIGHT_CLIP"}
    )["compute_approx_kl"]


def grad(value: torch.Tensor, lp: torch.Tensor) -> torch.Tensor:
    upstream = torch.randn(value.shape, generator=torch.Generator().manual_seed(1))
    (g,) = torch.autograd.grad((value * upstream).sum(), lp)
    return g


@pytest.mark.parametrize("kind", [*VERL_TYPES, *(f"{t}+" for t in VERL_TYPES)])
def test_verl_source(verl, kind):
    lp, ref, _ = logprob_pairs(torch.float32)
    lp.requires_grad_(True)
    theirs = verl(lp, ref, kind)
    f32 = tol(torch.float32)
    # the formula copy used by the tests that make test runs is verl's function
    copy = verl_kl_penalty(lp, ref, kind)
    torch.testing.assert_close(copy, theirs, **f32)
    torch.testing.assert_close(grad(copy, lp), grad(theirs, lp), **f32)
    # klpenalty: verl's value; on-policy, the gradient of verl's gradient-correct "+" form
    ours = kl_penalty(lp, ref, kind)
    torch.testing.assert_close(ours, theirs, **f32)
    base = kind.removesuffix("+")
    torch.testing.assert_close(grad(ours, lp), grad(verl(lp, ref, base + "+"), lp), **f32)
    with pytest.raises(NotImplementedError):
        verl(lp, ref, "full")


@pytest.mark.parametrize("unbiased", [False, True])
@pytest.mark.parametrize("estimator", OPENRLHF_ESTIMATORS)
def test_openrlhf_source(openrlhf, estimator, unbiased):
    lp, ref, old = logprob_pairs(torch.float32)
    lp.requires_grad_(True)
    f32 = tol(torch.float32)
    for old_lp in (None, old):  # π/π_old < 10 here: OpenRLHF's clip of the weight is idle
        theirs = openrlhf(lp, ref, old_lp, estimator, unbiased)
        copy = openrlhf_compute_approx_kl(lp, ref, old_lp, estimator, unbiased)
        torch.testing.assert_close(copy, theirs, **f32)
        torch.testing.assert_close(grad(copy, lp), grad(theirs, lp), **f32)
        ours = compute_approx_kl(lp, ref, old_lp, estimator, unbiased)
        torch.testing.assert_close(ours, theirs, **f32)
        correct = openrlhf(lp, ref, old_lp, estimator, True)
        torch.testing.assert_close(grad(ours, lp), grad(correct, lp), **f32)
