"""klpenalty.distributed.data_parallel on real process groups (gloo, or NCCL on GPUs): global
means and the controller."""

from __future__ import annotations

import pytest

from .conftest import WORLD_SIZES, assert_raised_on_every_rank, needs_peers, results

# worker checks asserting the statistics against the single-process computation
VALUE_CHECKS = ["check_global_masked_mean", "check_controller_identical"]

# worker error check -> (type or None, text every message holds, identical on every rank)
EXPECTED_ERRORS = {
    "check_err_controller_beta": ("ValueError", "beta differ across ranks", True),
    "check_err_global_mean_empty": ("ValueError", "no position counts", True),
    # a rank whose own arguments are bad raises its own error; the others say which rank
    "check_err_global_mean_local": (None, "", False),
}


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("check", VALUE_CHECKS)
def test_statistics(groups, world, check):
    """Global means, their gradients, the controller's β: the same on every rank, as expected."""
    results(groups, world, check)


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("check", sorted(EXPECTED_ERRORS))
def test_error_raised_on_every_rank(groups, world, check):
    needs_peers(world, check)
    assert_raised_on_every_rank(groups, world, check, EXPECTED_ERRORS[check])
