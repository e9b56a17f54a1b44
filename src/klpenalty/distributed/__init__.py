"""The exact KL across ranks, on ``torch.distributed``: vocabulary-parallel and data-parallel.

Shape letters: B batch, T sequence, V vocabulary (the whole vocabulary), V_r the slice of it a
rank holds, N rows (product of the leading dims).

**Vocabulary-parallel** (tensor-parallel output layer, Megatron layout): every rank of
``group`` holds the *same positions* but only a contiguous slice of the vocabulary, (..., V_r)
with uneven V_r allowed, rank 0 the first slice, rank 1 the next, and so on.
:func:`vocab_parallel_full_kl` and :func:`vocab_parallel_token_logprobs` return on every rank the
exact full-vocabulary value, equal to :func:`klpenalty.full_kl` / :func:`klpenalty.token_logprobs`
on the gathered logits, by exchanging a few numbers per position (never the logits):

==================================== ============================================== ==========
function                             collectives per call (forward)                 bytes/pos.
==================================== ============================================== ==========
``vocab_parallel_full_kl``           all-reduce MAX of (N, 2), all-reduce SUM (N, 3) 20 (fp32)
``vocab_parallel_token_logprobs``    all-reduce MAX of (N,), all-reduce SUM (N, 2)   12 (fp32)
config check (``check=True``)        one all-gather of 53 int64 per rank             0
==================================== ============================================== ==========

Byte counts are the payload per position handed to each all-reduce (float64 inputs: twice
that); the backward of both is local and communicates nothing.
:func:`vocab_parallel_linear_kl` takes the hidden states and each rank's rows of both LM heads
instead of logits (the fused head of :func:`klpenalty.linear_kl`, chunk by chunk): the same
merge per chunk of rows, and one all-reduce SUM of each hidden state's gradient (N, H) in the
backward (Megatron's column-parallel convention). :func:`vocab_parallel_divergence` and
:func:`vocab_parallel_linear_divergence` give :func:`klpenalty.divergence` and
:func:`klpenalty.linear_divergence` the same way, with one all-reduce SUM more (N, 2) for
every kind but the reverse KL (the second walk).

**Data-parallel**: every rank holds different sequences. :func:`global_masked_mean`,
:func:`global_sequence_mean` and :func:`update_controller_globally` normalise by the *global*
count, so every rank reports the same statistic and every rank's KL controller holds the same β
after every step.

Only the standard c10d collectives ``all_reduce`` (SUM, MAX) and ``all_gather`` are used, on
tensors that live on the device of the inputs, so the same code runs on gloo (CPU) and NCCL
(CUDA). All ranks of ``group`` must call these functions together, with the same ``check``; a
configuration error is raised on every rank, never as a hang.
"""

from __future__ import annotations

from .data_parallel import (
    ControllerUpdate,
    global_masked_mean,
    global_sequence_mean,
    update_controller_globally,
)
from .divergence import vocab_parallel_divergence, vocab_parallel_linear_divergence
from .vocab_parallel import (
    vocab_parallel_entropy,
    vocab_parallel_full_kl,
    vocab_parallel_linear_kl,
    vocab_parallel_token_logprobs,
    vocab_parallel_token_stats,
)

__all__ = [
    "vocab_parallel_full_kl",
    "vocab_parallel_token_logprobs",
    "vocab_parallel_entropy",
    "vocab_parallel_token_stats",
    "vocab_parallel_linear_kl",
    "vocab_parallel_divergence",
    "vocab_parallel_linear_divergence",
    "global_masked_mean",
    "global_sequence_mean",
    "update_controller_globally",
    "ControllerUpdate",
]
