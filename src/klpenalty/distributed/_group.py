"""Process-group plumbing shared by the vocabulary-parallel and data-parallel functions.

Only the standard c10d calls are used here and everywhere in the package (``is_available``,
``is_initialized``, ``get_world_size``, ``get_rank``, ``all_reduce``, ``all_gather``, and the
``ProcessGroup`` type a ``group`` argument is checked against), so the same code runs on every
backend.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist


def _group_info(group: Any, caller: str) -> tuple[int, int]:
    """(world size, rank) of ``group``; a clear error when torch.distributed is not set up."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"{caller}: torch.distributed is not initialized; call "
            "torch.distributed.init_process_group(...) first (or use the single-process "
            "klpenalty functions)"
        )
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"{caller}: group must be a torch.distributed ProcessGroup or None (the default "
            f"group), got {type(group).__name__}"
        )
    return dist.get_world_size(group), dist.get_rank(group)


def _all_reduce(t: torch.Tensor, op: Any, group: Any) -> None:
    if t.numel():  # every rank has the same N (checked), so every rank skips together
        dist.all_reduce(t, op=op, group=group)


def _per_rank(values: Sequence[Any]) -> str:
    return ", ".join(f"rank {r}: {val}" for r, val in enumerate(values))


def _device_of(*candidates: object, caller: str) -> torch.device:
    for t in candidates:
        if isinstance(t, torch.Tensor):
            return t.device
    raise TypeError(
        f"{caller}: the logits must be torch.Tensors, got "
        f"{', '.join(type(t).__name__ for t in candidates)} (raised on this rank only)"
    )
