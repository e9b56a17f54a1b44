"""Exact KL, token log-probs and entropy straight from both models' hidden states.

Shape letters: B batch, T sequence, V vocabulary, N rows (product of the leading dims), R rows of
one chunk, H hidden size (H_p of the policy, H_r of the reference).

:func:`linear_kl` never builds the (N, V) logits of either model. It walks the counted rows in
chunks of R rows: per chunk, z = F.linear(h, W, b) in the input dtype (the matmul accumulates in
float32, as torch does; bf16/fp16 on CPU in float32 on upcast blocks of W), the logit transforms (scale, soft-cap), then the backend's engine on the
(R, V) chunk of both models through a chunk adapter (:class:`.chunks.ChunkAdapter`;
:class:`.chunks.LocalChunks` holds the whole vocabulary, a vocabulary slice's adapter lives in
:mod:`klpenalty.distributed.vocab_parallel`). The backward recomputes each chunk's logits, gets
∂/∂z from the engine, chains it through the transforms and into the hidden states, weights and
biases.

The modules, by concern:

- :mod:`.chunks`: the chunk adapter (one chunk's logits -> the token_stats op's columns and
  their ∂/∂z; :class:`.chunks.DivergenceChunks` for a divergence);
- :mod:`._heads`: the chunk plan (:func:`default_chunk_rows`), a chunk's logits and the chain
  rule into the heads, the arguments' checks, the flat rows;
- :mod:`.kl`: :func:`linear_kl` (differentiable, with the plan of its upstream gradients);
- :mod:`.divergence`: :func:`linear_divergence` (the student–teacher divergences, the same
  Function with the divergence adapter);
- :mod:`.logprobs`: :func:`linear_logprobs` (one head, values only);
- :mod:`.policy_loss`: :func:`linear_policy_loss` (the fused PPO/GRPO loss).
"""

from __future__ import annotations

# the public functions, and re-exported for klpenalty.linear.<name>: the chunk plan's constants
# and default_chunk_rows, the adapter protocol, PLAN_RTOL, REDUCTIONS
from ._heads import (
    ACCEL_CHUNK_MULTIPLE,
    ACCEL_MAX_CHUNK_ROWS,
    ACCEL_MAX_MEMORY_FRACTION,
    ACCEL_MIN_CHUNK_ROWS,
    CHUNK_BUDGET_HEADS,
    CPU_CHUNK_MULTIPLE,
    CPU_MAX_MEMORY_FRACTION,
    CPU_MIN_CHUNK_BYTES,
    CPU_MIN_CHUNK_ROWS,
    default_chunk_rows,
)
from .chunks import IGNORE, ChunkAdapter, DivergenceChunks, LocalChunks
from .divergence import linear_divergence
from .kl import PLAN_RTOL, linear_kl
from .logprobs import linear_logprobs
from .policy_loss import REDUCTIONS, PolicyLoss, linear_policy_loss

__all__ = ["linear_kl", "linear_divergence", "linear_logprobs", "linear_policy_loss", "PolicyLoss"]
