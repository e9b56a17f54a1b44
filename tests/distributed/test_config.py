"""The configuration check of the vocabulary-parallel functions on real process groups (gloo,
or NCCL on GPUs): ranks that disagree, slices that do not tile the vocabulary, a rank with bad
arguments of its own."""

from __future__ import annotations

import pytest

from .conftest import WORLD_SIZES, assert_raised_on_every_rank, needs_peers, results

# worker error check -> (type, text every message holds, identical on every rank)
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
    # a rank whose own arguments are bad raises its own error; the others say which rank
    "check_err_local_shape": ("ValueError", "", False),
}


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("check", sorted(EXPECTED_ERRORS))
def test_error_raised_on_every_rank(groups, world, check):
    needs_peers(world, check)
    assert_raised_on_every_rank(groups, world, check, EXPECTED_ERRORS[check])


def test_errors_name_the_ranks(groups):
    """The messages name the rank at fault and its numbers (the largest group of the run)."""
    from .worker import SPLITS

    world = max(WORLD_SIZES)
    needs_peers(world, "check_err_leading_dims")
    last = world - 1
    msg = results(groups, world, "check_err_leading_dims")[0]["data"]["msg"]
    assert f"rank {last}: (2, 4)" in msg and "rank 0: (2, 3)" in msg, msg
    start = sum(SPLITS[world][:last]) + 1  # the last slice starts one past its place
    msg = results(groups, world, "check_err_vocab_gap")[0]["data"]["msg"]
    assert f"rank {last} starts at {start}" in msg and f"rank {last}: [{start}, 1002)" in msg, msg
