"""Per-token RLHF rewards: the KL penalty at every real token, the sequence score on the last."""

from __future__ import annotations

import torch

from .. import _validation as v

__all__ = ["shaped_rewards", "last_true_index"]


def last_true_index(mask: torch.Tensor) -> torch.Tensor:
    """Index of the last True entry along the last dim of ``mask`` (..., T).

    Raises ``ValueError`` naming the rows that have no True entry.

    Returns:
        (...) int64.
    """
    t = mask.shape[-1]
    if t == 0:
        raise ValueError(f"mask must have a non-empty last (sequence) dim, got {v.describe(mask)}")
    empty = ~mask.any(-1)
    if bool(empty.any()):
        rows = [tuple(r) if len(r) > 1 else int(r[0]) for r in empty.nonzero().tolist()]
        raise ValueError(
            f"mask has no True position in row(s) {rows[:20]}{' ...' if len(rows) > 20 else ''} "
            f"({v.describe(mask)}): their sequence score would be lost"
        )
    positions = torch.arange(t, device=mask.device)
    # the largest position index among True entries; False entries count as -1
    return torch.where(mask, positions, torch.full_like(positions, -1)).amax(-1)


def shaped_rewards(
    scores: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, beta: float
) -> torch.Tensor:
    """Per-token rewards ``−beta·kl`` on real tokens plus the sequence score on the last one.

    The usual RLHF shaping (Ziegler et al. 2019): every position where ``mask`` is True gets
    ``−beta · kl[..., t]``; padding gets exactly 0; and ``scores[...]`` is added at the **last**
    True position of each row (not on the padding after it). With ``kl`` the sampled-token k1
    estimate (:func:`klpenalty.sampled_kl`) used as a detached reward, the policy-gradient of
    the return is an unbiased gradient of the sequence KL(π‖ρ). For the exact KL pass the
    ``reward_kl`` of :func:`klpenalty.full_kl_reward_and_loss` (the KL of the next position),
    not the KL itself, and put its ``loss_kl`` in the loss.

    Example (3 real tokens, k1 = [0.5, −0.5, −1.5], β = 0.1, score 2.0):

    >>> import torch
    >>> shaped_rewards(torch.tensor([2.0]), torch.tensor([[0.5, -0.5, -1.5, 0.0]]),
    ...                torch.tensor([[True, True, True, False]]), beta=0.1)
    tensor([[-0.0500,  0.0500,  2.1500,  0.0000]])

    Args:
        scores: (...) float, one score per sequence (e.g. (B,)).
        kl: (..., T) float, per-token KL estimate or value (e.g. (B, T)).
        mask: (..., T) bool, True = real token.
        beta: KL coefficient, finite and ≥ 0.

    Returns:
        (..., T), the dtype of ``kl`` promoted with ``scores``.

    Raises:
        ValueError: a row with no True position (its score would be silently lost), or
            mismatched shapes.
    """
    v.check_float("kl", kl)
    if kl.dim() < 1:
        raise ValueError(f"kl must have shape (..., T), got {v.describe(kl)}")
    v.check_per_token("scores", scores, kl.shape[:-1])
    mask = v.check_mask(mask, kl.shape, kl.device)
    beta = v.check_beta(beta)
    last = last_true_index(mask)  # (...)
    dtype = torch.promote_types(kl.dtype, scores.dtype)
    zero = torch.zeros((), dtype=dtype, device=kl.device)
    penalty = -beta * kl.to(dtype) if beta != 0.0 else torch.zeros_like(kl, dtype=dtype)
    rewards = torch.where(mask, penalty, zero)
    score_at = torch.zeros_like(rewards).scatter(-1, last.unsqueeze(-1), scores.to(dtype).unsqueeze(-1))
    return rewards + score_at
