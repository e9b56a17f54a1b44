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


# a worker check of many cases, each asserted below
SETTINGS_CHECK = "check_err_settings_differ"

# its cases -> the text every rank's message holds (None: the rank at
# fault raises its own error, the others name it)
SETTINGS_DIFFER = {
    "mask": "mask differs across ranks",
    "temperature": "temperature differs across ranks",
    "logit_scale": "logit_scale differs across ranks (rank 0: 1.0",
    "softcap": "softcap differs across ranks (rank 0: 30.0",
    "ref_softcap": "ref_softcap differs across ranks (rank 0: 30.0",
    "chunk_rows": "chunk_rows differs across ranks (rank 0: 3",
    "entropy": "entropy differs across ranks (rank 0: 0",
    "tokens_given": "whether tokens are given differs across ranks",
    "tokens": "tokens differ across ranks",
    "top_k_one_rank": "the support differs across ranks (rank 0: 'None'",
    "top_p": "top_p differs across ranks (rank 0: 0.9",
    "support_ids": "support ids (an index-weighted checksum) differs across ranks",
    "bias_one_rank": "whether policy_bias_shard is given differs across ranks",
    "dtype": "policy_hidden dtype differs across ranks",
    "hidden_size": "the hidden size of policy_hidden differs across ranks (rank 0: 4",
    "hidden_grad": "whether policy_hidden takes a gradient differs across ranks",
    "divergence_kind": "kind differs across ranks (rank 0: 'forward_kl'",
    "divergence_beta": "the divergence's beta or skew differs across ranks (rank 0: 0.5",
    "divergence_kind_invalid": None,
    "logits_top_p": "vocab_parallel_full_kl: top_p differs across ranks",
    "logits_top_k_one_rank": "vocab_parallel_full_kl: the support differs across ranks",
    "logits_divergence_kind": "vocab_parallel_divergence: kind differs across ranks",
    "logits_entropy": "vocab_parallel_token_stats: entropy differs across ranks",
}


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("case", sorted(SETTINGS_DIFFER))
def test_settings_that_differ_raise_on_every_rank(groups, world, case):
    """An argument of the fused heads or a setting of any function that differs on one rank:
    the same ValueError on every rank, naming it and each rank's value, and the group in step
    (never a hang, a crash in a collective, or a wrong result)."""
    check = SETTINGS_CHECK
    needs_peers(world, check)
    per_rank = [r["data"][case] for r in results(groups, world, check)]
    text = SETTINGS_DIFFER[case]
    if text is None:
        assert {d["type"] for d in per_rank} == {"ValueError"}, per_rank
        assert "kind must be one of" in per_rank[-1]["msg"], per_rank
        assert all(f"rank(s) [{world - 1}] rejected their own arguments" in d["msg"]
                   for d in per_rank[:-1]), per_rank
        return
    assert {d["type"] for d in per_rank} == {"ValueError"}, per_rank
    assert len({d["msg"] for d in per_rank}) == 1, per_rank
    assert text in per_rank[0]["msg"], per_rank
