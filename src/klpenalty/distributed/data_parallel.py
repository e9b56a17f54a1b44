"""Data-parallel statistics: every rank holds different sequences.

The means are normalised by the *global* count, so every rank reports the same statistic, and
:func:`update_controller_globally` gives every rank's KL controller the same β after each step.
"""

from __future__ import annotations

import math
from numbers import Integral
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from .. import _validation as v
from ._group import _group_info, _per_rank

__all__ = [
    "global_masked_mean",
    "global_sequence_mean",
    "update_controller_globally",
    "ControllerUpdate",
]


def _global_mean(
    values: torch.Tensor,
    valid: torch.Tensor | None,
    local_error: Exception | None,
    group: Any,
    caller: str,
) -> torch.Tensor:
    """Σ_ranks Σ valid·values / Σ_ranks Σ valid, 0-dim; one all-reduce SUM of 3 float64."""
    device = values.device
    acc = torch.float64
    if local_error is None:
        vals = values.to(acc).reshape(-1)  # (K,)
        if valid is not None:
            flat = valid.reshape(-1)  # (K,)
            # NaN/inf in positions that do not count must not leak into the sum
            vals = torch.where(flat, vals, torch.zeros((), dtype=acc, device=device))
            count = flat.sum().to(acc)
        else:
            count = torch.tensor(float(vals.numel()), dtype=acc, device=device)
        local_sum = vals.sum()
        flag = torch.zeros((), dtype=acc, device=device)
    else:
        local_sum = torch.zeros((), dtype=acc, device=device)
        count = torch.zeros((), dtype=acc, device=device)
        flag = torch.ones((), dtype=acc, device=device)
    buf = torch.stack([local_sum.detach(), count, flag])  # (3,)
    dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group)
    total_count, errors = buf[1].item(), buf[2].item()
    if local_error is not None:
        raise local_error
    if errors:
        raise ValueError(
            f"{caller}: {int(errors)} rank(s) rejected their own arguments (their error says why)"
        )
    if total_count == 0:
        raise ValueError(f"{caller}: no position counts on any rank (the global count is 0)")
    # value: the global mean, bitwise the same on every rank; gradient: ∂mean/∂(local values)
    # = valid / global count (the other ranks' sums are constants here)
    mean = buf[0] / buf[1] + (local_sum - local_sum.detach()) / buf[1]
    out_dtype = torch.promote_types(values.dtype, torch.float32)
    return mean.to(out_dtype)


def global_masked_mean(
    values: torch.Tensor, mask: torch.Tensor | None = None, *, group: Any = None
) -> torch.Tensor:
    """Mean of ``values`` over the counted positions of *all* ranks (data parallelism).

    Σ_ranks Σ mask·values / Σ_ranks Σ mask: normalised by the global count of counted
    positions, so ranks with more padding do not weigh more, and the value is the same on
    every rank. Communication: one all-reduce SUM of 3 float64 (sum, count, error flag).

    The result is differentiable; the gradient with respect to this rank's ``values`` is
    mask / (global count), the exact partial derivative of the global mean. DDP *averages*
    gradients over its W ranks, so to get the gradient of the global mean under DDP
    differentiate ``W · global_masked_mean(...)``.

    Args:
        values: (...) float tensor, e.g. the per-token KL (B, T).
        mask: optional (...) bool, True = counts; None = everything counts.
        group: the data-parallel process group; None = the default group.

    Returns:
        0-dim tensor, the dtype of ``values`` promoted with float32 (the sums are float64).

    Raises:
        ValueError: no position counts on any rank; invalid arguments on some rank (raised on
            every rank: the rank at fault its own error, the others a ValueError).
    """
    caller = "global_masked_mean"
    _group_info(group, caller)
    if not isinstance(values, torch.Tensor):
        raise TypeError(f"values must be a torch.Tensor, got {type(values).__name__}")
    local_error: Exception | None = None
    try:
        v.check_float("values", values)
        if mask is not None:
            mask = v.check_mask(mask, values.shape, values.device)
    except (TypeError, ValueError) as err:
        local_error = err
    return _global_mean(values, mask, local_error, group, caller)


def global_sequence_mean(
    values: torch.Tensor, mask: torch.Tensor | None = None, *, group: Any = None
) -> torch.Tensor:
    """Mean over the sequences of *all* ranks of each sequence's sum over its counted positions.

    For per-token KL (B, T) this is the KL per sequence, the unit the adaptive controller's
    target is usually stated in. Sequences with no counted position do not count. The value is
    the same on every rank; one all-reduce SUM of 3 float64.

    Args:
        values: (..., T) float tensor.
        mask: optional (..., T) bool, True = counts.
        group: the data-parallel process group; None = the default group.

    Returns:
        0-dim tensor, the dtype of ``values`` promoted with float32, differentiable as in
        :func:`global_masked_mean`.
    """
    caller = "global_sequence_mean"
    _group_info(group, caller)
    if not isinstance(values, torch.Tensor):
        raise TypeError(f"values must be a torch.Tensor, got {type(values).__name__}")
    local_error: Exception | None = None
    seq = values
    valid = None
    try:
        v.check_float("values", values)
        if values.dim() < 1:
            raise ValueError(f"values must have shape (..., T), got {v.describe(values)}")
        if mask is not None:
            mask = v.check_mask(mask, values.shape, values.device)
            zero = torch.zeros((), dtype=values.dtype, device=values.device)
            seq = torch.where(mask, values, zero).sum(-1)  # (...)
            valid = mask.any(-1)  # (...)
        else:
            seq = values.sum(-1)  # (...)
    except (TypeError, ValueError) as err:
        local_error = err
    return _global_mean(seq, valid, local_error, group, caller)


class ControllerUpdate(NamedTuple):
    """What :func:`update_controller_globally` did, identical on every rank."""

    beta: float
    """The controller's new ``value``."""
    kl: float
    """The global KL the update used: Σ_ranks local_kl_sum / Σ_ranks local_count."""
    n_steps: int
    """Σ_ranks local_n_steps, passed to ``controller.update``."""


def update_controller_globally(
    controller: Any,
    local_kl_sum: float | torch.Tensor,
    local_count: float | torch.Tensor,
    local_n_steps: int,
    *,
    group: Any = None,
    device: torch.device | str | None = None,
) -> ControllerUpdate:
    """Update a KL controller from the global KL so that every rank holds the same β.

    Every rank passes the sum of its KL values and how many there are (tokens or sequences,
    your unit), and how many samples it contributed. One all-gather of 5 float64 per rank
    (error flag, kl_sum, count, n_steps, β), summed in rank order, so every rank computes the
    same global KL = Σ kl_sum / Σ count and n_steps = Σ local_n_steps, bit for bit, and calls
    ``controller.update(kl, n_steps)`` with them. It also checks that every rank's controller
    held the same β before the update (a rank that loaded another checkpoint raises on all).

    Example on each rank, with per-token KL ``kl`` (B, T) and ``mask`` (B, T)::

        seq_kl = (kl * mask).sum(-1)                        # (B,) KL per sequence
        update_controller_globally(ctl, seq_kl.sum(), seq_kl.numel(), seq_kl.numel())

    Args:
        controller: an object with ``.value`` and ``.update(current_kl, n_steps)``, e.g.
            :class:`klpenalty.AdaptiveKLController` or :class:`klpenalty.FixedKLController`.
        local_kl_sum: this rank's sum of KL values, a number or one-element tensor.
        local_count: this rank's number of KL values (≥ 0; may be 0 on some ranks).
        local_n_steps: int ≥ 0, this rank's number of samples (e.g. its local batch size).
        group: the data-parallel process group; None = the default group.
        device: where the gathered buffer lives: the device your backend communicates on
            (CUDA for NCCL). Default: the device of ``local_kl_sum`` if it is a tensor, else
            of ``local_count`` if it is, else CPU.

    Returns:
        :class:`ControllerUpdate` (beta, kl, n_steps), identical on every rank.

    Raises:
        ValueError: the global count is 0, the controllers' β differ across ranks, invalid
            arguments on some rank, or the controller rejects the update (all on every rank).
    """
    caller = "update_controller_globally"
    world, _ = _group_info(group, caller)
    if device is None:
        tensors = [t for t in (local_kl_sum, local_count) if isinstance(t, torch.Tensor)]
        device = tensors[0].device if tensors else torch.device("cpu")
    local_error: Exception | None = None
    row = [0.0] * 5
    try:
        kl_sum = v.as_real("local_kl_sum", local_kl_sum)
        count = v.as_real("local_count", local_count)
        if not math.isfinite(count) or count < 0:
            raise ValueError(f"local_count must be finite and >= 0, got {count}")
        if isinstance(local_n_steps, bool) or not isinstance(local_n_steps, Integral):
            raise TypeError(f"local_n_steps must be an int, got {type(local_n_steps).__name__}")
        if local_n_steps < 0:
            raise ValueError(f"local_n_steps must be >= 0, got {local_n_steps}")
        if not callable(getattr(controller, "update", None)) or not hasattr(controller, "value"):
            raise TypeError(
                "controller must have .value and .update(current_kl, n_steps), got "
                f"{type(controller).__name__}"
            )
        row = [0.0, kl_sum, count, float(local_n_steps), float(controller.value)]
    except (TypeError, ValueError) as err:
        local_error = err
        row = [1.0, 0.0, 0.0, 0.0, 0.0]
    mine = torch.tensor(row, dtype=torch.float64, device=device)  # (5,)
    out = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(out, mine, group=group)
    table = torch.stack(out).tolist()  # (world, 5), identical on every rank
    if local_error is not None:
        raise local_error
    bad = [r for r, t in enumerate(table) if t[0]]
    if bad:
        raise ValueError(
            f"{caller}: rank(s) {bad} rejected their own arguments (their error says why)"
        )
    betas = [t[4] for t in table]
    if len(set(betas)) > 1:
        raise ValueError(
            f"{caller}: the controllers' beta differ across ranks before the update "
            f"({_per_rank(betas)}); load the same state_dict on every rank"
        )
    total_kl = 0.0
    total_count = 0.0
    total_n = 0.0
    for t in table:  # rank order: the same float sums on every rank
        total_kl += t[1]
        total_count += t[2]
        total_n += t[3]
    if total_count == 0:
        raise ValueError(f"{caller}: the global count is 0 (no KL value on any rank)")
    kl = total_kl / total_count
    n_steps = int(total_n)
    controller.update(kl, n_steps)
    return ControllerUpdate(float(controller.value), kl, n_steps)
