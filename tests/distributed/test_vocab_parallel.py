"""klpenalty.distributed.vocab_parallel on real process groups (gloo, or NCCL on GPUs): values,
gradients, communication, and the errors diagnosed from the all-reduced sums (NaN, a
distribution with no mass)."""

from __future__ import annotations

import pytest

from .conftest import WORLD_SIZES, assert_raised_on_every_rank, needs_peers, results

# worker checks asserting values and gradients against the single-process functions
VALUE_CHECKS = [
    "check_kl_float32",
    "check_kl_bfloat16",
    "check_kl_float64_vs_reference",
    "check_kl_gathered_for_real",
    "check_kl_edge_cases",
    "check_kl_inf_rule_across_ranks",
    "check_empty_and_one_dim",
    "check_communication_volume",
    "check_token_logprobs_float32",
    "check_token_logprobs_bfloat16",
    "check_token_stats_streaming",
    "check_token_stats_native",
    "check_token_stats_triton",
    "check_entropy_and_token_logprobs_every_backend",
    "check_token_stats_communication",
    "check_thresholds_on_wide_rows",
    "check_thresholds_with_ties_made_by_the_temperature",
    "check_linear_kl_float32_streaming",
    "check_linear_kl_float32_native",
    "check_linear_kl_float64_streaming",
    "check_linear_kl_float64_native",
    "check_linear_kl_options_streaming",
    "check_linear_kl_options_native",
    "check_linear_kl_options_triton",
    "check_linear_kl_bfloat16_softcap",
    "check_divergences_float32_streaming",
    "check_divergences_float32_native",
    "check_divergences_float64_native",
    "check_divergences_on_the_student_support",
]

# worker error check -> (type, text every message holds, identical on every rank)
EXPECTED_ERRORS = {
    "check_err_nan": ("ValueError", "policy_logits hold NaN", True),
    "check_err_ref_all_neginf": ("ValueError", "ref_logits are -inf over the whole", True),
    "check_err_policy_all_neginf": ("ValueError", "policy_logits are -inf over the whole", True),
    "check_err_linear_support_ids": ("ValueError", "support ids must lie in [0, 1001)", True),
}

# a worker error check with an assertion of its own (below)
ONE_RANK_ERRORS = ["check_err_linear_bias_shard", "check_err_linear_nan_in_one_slice"]


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("check", VALUE_CHECKS)
def test_values_and_gradients(groups, world, check):
    """Forward values and gradients: each rank asserted against single-process."""
    results(groups, world, check)


def test_communication_cost_per_position(groups):
    """The documented figures (fp32): 20 bytes/position for full KL, 12 for token log-probs,
    32 for the one-pass KL + log-probs + entropy."""
    for world in WORLD_SIZES:
        for r in results(groups, world, "check_communication_volume"):
            assert r["data"] == {
                "full_kl_bytes_per_position": 20.0,
                "token_bytes_per_position": 12.0,
            }
        for r in results(groups, world, "check_token_stats_communication"):
            assert r["data"] == {"token_stats_bytes_per_position": 32.0}


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_fused_head_argument_error_on_one_rank(groups, world):
    """A bias slice of the wrong width on the last rank: that rank names the argument, the
    others name the rank, and the group stays in step."""
    check = "check_err_linear_bias_shard"
    needs_peers(world, check)
    per_rank = [r["data"] for r in results(groups, world, check)]
    assert {d["type"] for d in per_rank} == {"ValueError"}, per_rank
    assert "policy_bias_shard must have shape" in per_rank[-1]["msg"], per_rank
    assert all(f"rank(s) [{world - 1}] rejected their own arguments" in d["msg"]
               for d in per_rank[:-1]), per_rank


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("check", sorted(EXPECTED_ERRORS))
def test_error_raised_on_every_rank(groups, world, check):
    needs_peers(world, check)
    assert_raised_on_every_rank(groups, world, check, EXPECTED_ERRORS[check])


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_fused_head_nan_in_one_rank_slice(groups, world):
    """NaN in one rank's rows of a head: every rank names that weight (its shape where it is
    held, "another process's slice" elsewhere), not the hidden states."""
    per_rank = [r["data"] for r in results(groups, world, "check_err_linear_nan_in_one_slice")]
    assert {d["type"] for d in per_rank} == {"ValueError"}, per_rank
    assert all("policy_weight_shard contains NaN" in d["msg"] for d in per_rank), per_rank
    assert "another process's slice" not in per_rank[-1]["msg"], per_rank
    assert all("another process's slice" in d["msg"] for d in per_rank[:-1]), per_rank
