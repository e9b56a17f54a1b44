"""Portable backend (any device): the engine's tile loop in eager PyTorch ops.

One module per op of :mod:`..contract`:

- :mod:`.token_stats`: ``streaming_token_stats``, ``_backward`` and ``_state``, the engine's
  tile loop (tiles of a few MiB; nothing of size (N, V) is allocated);
- :mod:`.threshold`: ``streaming_sampling_threshold``, the portable sampler rule in row chunks,
  its row reductions pluggable (:class:`.threshold.RowReduce`; vocabulary parallelism reduces
  across ranks);
- :mod:`.support`: ``streaming_support_from_ids``, the kept-set check of an engine's
  ``(ids, offsets)`` (the portable form);
- :mod:`.divergence`: ``streaming_divergence`` and ``_backward``, the second walk (the
  divergences from the finished row statistics).

On CPU the tile loop runs on one intra-op thread (:data:`.token_stats.CPU_TILE_THREADS`); on
accelerators it makes no host synchronisation.
"""

from __future__ import annotations

from .. import contract
from . import divergence, support, threshold, token_stats

__all__ = ["divergence", "support", "threshold", "token_stats"]

contract.define_ops("streaming")
contract.implement(
    "streaming",
    "CompositeExplicitAutograd",
    token_stats=token_stats.token_stats_op,
    token_stats_backward=token_stats.token_stats_backward_op,
    token_stats_state=token_stats.token_stats_state_op,
    sampling_threshold=threshold.sampling_threshold_op,
    support_from_ids=support.support_from_ids_op,
    divergence=divergence.divergence_op,
    divergence_backward=divergence.divergence_backward_op,
)
