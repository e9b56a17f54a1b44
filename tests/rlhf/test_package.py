"""klpenalty.rlhf groups the RLHF modules; the top-level names stay, the old paths are gone."""

from __future__ import annotations

import importlib

import pytest

import klpenalty
import klpenalty.rlhf

# the RLHF names that `from klpenalty import ...` offered before the move
TOP_LEVEL = [
    "sampled_kl",
    "ESTIMATORS",
    "shaped_rewards",
    "k2_loss",
    "k3_ratio_loss",
    "k3_loss",
    "next_token_kl",
    "full_kl_reward_and_loss",
    "KLRewardAndLoss",
    "FixedKLController",
    "AdaptiveKLController",
    "OPD_RECIPES",
    "OPDRecipe",
    "OPDTerms",
    "opd_terms",
]


@pytest.mark.parametrize("name", TOP_LEVEL)
def test_top_level_names_are_the_rlhf_objects(name):
    assert name in klpenalty.__all__ and name in klpenalty.rlhf.__all__
    assert getattr(klpenalty, name) is getattr(klpenalty.rlhf, name)


def test_every_exported_name_exists_once():
    for module in (klpenalty, klpenalty.rlhf):
        assert len(set(module.__all__)) == len(module.__all__)
        assert all(hasattr(module, name) for name in module.__all__)


@pytest.mark.parametrize("module", ["estimators", "shaping", "controllers", "gradients", "distill"])
def test_modules_live_in_rlhf_only(module):
    moved = importlib.import_module(f"klpenalty.rlhf.{module}")
    assert set(moved.__all__) <= set(klpenalty.rlhf.__all__)
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(f"klpenalty.{module}")
