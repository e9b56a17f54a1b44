"""The scored positions of a causal LM batch (labels, response masks, packed rows) and the checks of
the ids and hidden states that reach the heads.

Shape letters: B batch, T sequence.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import _validation as v

IGNORE_INDEX = -100  # Hugging Face's label for "not scored"

def _check_ids(name: str, t: object, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """An integer (B, T) tensor of exactly ``shape`` on ``device``."""
    t = v.check_per_token(name, t, shape, floating=False)
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor (B, T), got {v.describe(t)}")
    if t.device != device:
        raise ValueError(f"{name} must be on the device of input_ids ({device}), got {t.device}")
    return t


def _check_bool_or_ids(name: str, t: object, shape, device) -> torch.Tensor:
    """A (B, T) bool or 0/1 integer mask, returned as bool."""
    t = v.check_per_token(name, t, shape, floating=False)
    if t.dtype != torch.bool:
        _check_ids(name, t, shape, device)  # integer 0/1, as tokenizers return it
        return t != 0
    if t.device != device:
        raise ValueError(f"{name} must be on the device of input_ids ({device}), got {t.device}")
    return t


def _check_scored_range(name: str, ids: torch.Tensor, scored: torch.Tensor, vocab: int) -> None:
    """``ids[:, 1:]`` (B, T) in [0, vocab) where ``scored`` (B, T - 1), or ValueError naming
    ``name`` (one host read)."""
    tokens = ids[:, 1:]
    bad = scored & ((tokens < 0) | (tokens >= vocab))
    if bool(bad.any()):
        b, t = (int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"{name} must lie in [0, {vocab}) (the LM heads' vocabulary) at the scored "
            f"positions; {int(bad.sum())} do not, the first {int(tokens[b, t])} at index "
            f"{(b, t + 1)} ({v.describe(ids)})"
        )


def generate_position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids (B, T) from a (B, T) attention mask as ``generate`` makes them: the count of
    real tokens before each position (0 at the first real token, so left padding does not shift
    the positions), and 1 on padding."""
    mask = attention_mask.long()
    return (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)


def _scored(input_ids, attention_mask, labels, response_mask, position_ids=None):
    """Validate the (B, T) batch arguments; returns (scored (B, T - 1) bool, attention as bool
    or None)."""
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"input_ids must be a torch.Tensor, got {type(input_ids).__name__}")
    if input_ids.dim() != 2 or input_ids.shape[1] < 1:
        raise ValueError(
            f"input_ids must have shape (B, T) with T >= 1, got {v.describe(input_ids)}"
        )
    B, T = input_ids.shape
    device = input_ids.device
    _check_ids("input_ids", input_ids, (B, T), device)
    scored = torch.ones(B, T - 1, dtype=torch.bool, device=device)
    real = None
    if attention_mask is not None:
        real = _check_bool_or_ids("attention_mask", attention_mask, (B, T), device)
        scored &= real[:, 1:] & real[:, :-1]  # the token and the position predicting it
    if labels is not None:
        _check_ids("labels", labels, (B, T), device)
        scored &= labels[:, 1:] != IGNORE_INDEX
    if response_mask is not None:
        response_mask = v.check_per_token("response_mask", response_mask, (B, T), floating=False)
        if response_mask.dtype != torch.bool:
            raise TypeError(
                "response_mask must be a bool tensor (True = scored), "
                f"got {v.describe(response_mask)}"
            )
        if response_mask.device != device:
            raise ValueError(f"response_mask must be on {device}, got {response_mask.device}")
        scored &= response_mask[:, 1:]
    if position_ids is not None:
        _check_ids("position_ids", position_ids, (B, T), device)
        # a new sequence starts at t + 1 (packed rows): position t would predict another
        # sequence's first token, so it is never scored
        starts = position_ids[:, 1:] != position_ids[:, :-1] + 1  # (B, T - 1)
        if real is not None:
            across = starts & real[:, 1:] & real[:, :-1]
            if bool(across.any()):
                b, t = (int(i) for i in across.nonzero()[0])
                raise ValueError(
                    "position_ids restart between two real tokens of attention_mask (packed "
                    f"rows): at index {(b, t + 1)} they go from {int(position_ids[b, t])} to "
                    f"{int(position_ids[b, t + 1])}, and a model given an attention_mask "
                    "attends across the packed sequences; pass packed rows without "
                    f"attention_mask ({v.describe(position_ids)})"
                )
        scored &= ~starts
    return scored, real


def scored_positions(
    input_ids: torch.Tensor,
    attention_mask: Optional[torch.Tensor] = None,
    *,
    labels: Optional[torch.Tensor] = None,
    response_mask: Optional[torch.Tensor] = None,
    position_ids: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The (B, T - 1) bool mask of the positions :func:`causal_lm_kl` counts, for the losses and
    rewards built from its outputs (e.g. ``shaped_rewards``, ``next_token_kl``).

    Entry ``[b, t]`` is True where ``attention_mask[b, t]`` and ``attention_mask[b, t + 1]``,
    ``labels[b, t + 1] != -100``, ``response_mask[b, t + 1]`` and
    ``position_ids[b, t + 1] == position_ids[b, t] + 1`` (no new packed sequence starts at
    ``t + 1``) all hold (each where given). Arguments (B, T) as in :func:`causal_lm_kl`; the
    same errors.

    >>> import torch
    >>> scored_positions(torch.tensor([[0, 5, 6, 7, 8]]), torch.tensor([[0, 1, 1, 1, 1]]),
    ...                  response_mask=torch.tensor([[False, False, False, True, True]]))
    tensor([[False, False,  True,  True]])
    >>> scored_positions(torch.tensor([[4, 5, 6, 7, 8]]),
    ...                  position_ids=torch.tensor([[0, 1, 2, 0, 1]]))  # two packed sequences
    tensor([[ True,  True, False,  True]])
    """
    return _scored(input_ids, attention_mask, labels, response_mask, position_ids)[0]


def _check_head_input(where: str, hidden: object, batch: tuple[int, int],
                      weight: torch.Tensor) -> None:
    """What the LM head received: hidden states (B, T, H) with H its in_features, on the
    device of its weight."""
    if not isinstance(hidden, torch.Tensor) or not hidden.is_floating_point() \
            or hidden.dim() != 3 or tuple(hidden.shape[:2]) != batch \
            or hidden.shape[-1] != weight.shape[-1]:
        got = v.describe(hidden) if isinstance(hidden, torch.Tensor) else type(hidden).__name__
        raise ValueError(
            f"{where}'s LM head received {got}, not hidden states (B, T, H) = "
            f"({batch[0]}, {batch[1]}, {weight.shape[-1]}) matching its weight "
            f"{v.describe(weight)}: the model's forward does not call its head on the last "
            "hidden states of every position"
        )
    if weight.device != hidden.device:
        raise ValueError(
            f"{where}'s LM head is on {weight.device} and the hidden states it receives on "
            f"{hidden.device}: a head must be on its model's device"
        )
