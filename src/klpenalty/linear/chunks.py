"""The chunk adapter: how one chunk of (R, V) logits of both models becomes the token_stats
op's per-row columns, and their upstream gradients ∂/∂z.

:class:`ChunkAdapter` is the protocol the chunked Functions of :mod:`klpenalty.linear` call;
:class:`LocalChunks` holds the whole vocabulary (one ``<backend>_token_stats`` call forward,
one ``<backend>_token_stats_backward`` call backward: :func:`chunk_forward`,
:func:`chunk_backward`); :mod:`klpenalty.distributed.vocab_parallel` has the one for a
vocabulary slice.

Shape letters: R rows of one chunk, V the vocabulary (of this process), H a hidden size.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Protocol

import torch
from torch import Tensor

from ..ops.contract import OUT_KL, ST_TAU, Want
from ..ops.dispatch import forward_of_ids, support_of_ids
from ..ops.divergence import Divergence
from ..sampling import ids_args, ids_of_rows, rows_of_support, support_args

__all__ = [
    "IGNORE",
    "NO_SAMPLER",
    "ChunkAdapter",
    "DivergenceChunks",
    "KeptIds",
    "LocalChunks",
    "chunk_backward",
    "chunk_forward",
    "chunk_support",
    "host_checks",
    "want_bits",
]

# Token id the adapter reads as "ignored" (linear_kl maps the caller's ignore_index to it after
# the range check, so the adapter's signature stays free of it).
IGNORE = -100

# The op's (top_k, top_p, min_p) that cut nothing.
NO_SAMPLER = (0, 1.0, 0.0)


def host_checks(device: torch.device) -> bool:
    """Whether reading a tensor value on the host is free (CPU: no device synchronisation)."""
    return device.type == "cpu"


def want_bits(tokens: Optional[Tensor], want_entropy: bool) -> Want:
    """The token_stats ``want`` bits: the KL always, the log-probs with tokens, the entropy."""
    want = Want.KL
    if tokens is not None:
        want |= Want.LOGP | Want.REF_LOGP
    if want_entropy:
        want |= Want.ENTROPY
    return want


def chunk_support(support: tuple, zp: Tensor, rows: Optional[Tensor], r0: int,
                  r1: int) -> tuple:
    """The op's (keep, tau, sampler) of the chunk of counted rows r0:r1 (``rows`` (M,) the
    counted rows, None = all), from its policy logits ``zp`` (R, V) and the parsed ``support``
    (:func:`klpenalty.sampling.parse_support`'s (kind, payload)): sampler settings stay settings
    (the op computes the thresholds row by row), a kept set is cut to the chunk's rows."""
    kind, payload = support
    if kind in ("none", "rule"):  # nothing per row to select
        return support_args(kind, payload, zp)
    return rows_of_support(kind, payload, zp, chunk_row_ids(rows, r0, r1, zp.device))


class KeptIds(NamedTuple):
    """A chunk's kept sets as the op's ``ids`` (K,) / ``offsets`` (R + 1,) (int32/int64, the
    offsets rebased to the chunk), given where a ``keep`` is: :class:`LocalChunks` passes them
    to the forward op, which finds each row's threshold itself; the backward and the second
    walk take the support from the forward's stats (:func:`chunk_keep_tau`)."""

    ids: Tensor
    offsets: Tensor


def chunk_ids(support: tuple, rows: Optional[Tensor], r0: int, r1: int, device) -> KeptIds:
    """The :class:`KeptIds` of the chunk of counted rows r0:r1 of a parsed compact support
    (kind ``"ids"``)."""
    return KeptIds(*ids_args(*ids_of_rows(*support[1], chunk_row_ids(rows, r0, r1, device))))


def chunk_keep_tau(keep, tau: Optional[Tensor], stats: Tensor,
                   shape) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """The op's (keep, tau) of a chunk of logits of ``shape`` (R, V) from the forward's
    ``stats``: where ``keep`` is a :class:`KeptIds`, the threshold the forward used, or the
    sets' dense mask where a row's set is no threshold set
    (:func:`klpenalty.ops.dispatch.support_of_ids`); otherwise ``(keep, tau)`` as given."""
    if not isinstance(keep, KeptIds):
        return keep, tau
    return support_of_ids(stats, None, None, tau, keep.ids, keep.offsets, shape)


def chunk_row_ids(rows: Optional[Tensor], r0: int, r1: int, device) -> Tensor:
    """(R,) the flat row indices of the chunk of counted rows r0:r1 (``rows`` None = all)."""
    return torch.arange(r0, r1, device=device) if rows is None else rows[r0:r1]


class ChunkAdapter(Protocol):
    """What a chunked Function of :mod:`klpenalty.linear` needs of the vocabulary it sees.

    ``tokens`` are the chunk's (R,) ids in [0, V) or :data:`IGNORE` (or None); ``want`` the
    token_stats op's bits (:func:`want_bits`); ``keep``, ``tau``, ``sampler`` the op's support
    arguments (:func:`klpenalty.sampling.support_args`), from :meth:`support` (``keep`` may be
    a chunk's :class:`KeptIds`, where the adapter passes the kept sets to the op).
    """

    def support(self, support: tuple, zp: Tensor, rows: Optional[Tensor], r0: int, r1: int,
                temperature: float) -> tuple:
        """The op's (keep, tau, sampler) of the chunk of counted rows r0:r1 from its policy
        logits ``zp`` (R, V), as :func:`chunk_support`. Called once per chunk in the forward
        (in the same chunk order on every process) and, for a kept set (kind "keep" / "ids"),
        again in the backward; sampler settings (kind "rule") are re-read from the forward's
        stats (``ST_TAU``) there."""
        ...

    def forward(self, zp: Tensor, zr: Tensor, tokens: Optional[Tensor], temperature: float,
                want: int, keep: Optional[Tensor] = None, tau: Optional[Tensor] = None,
                sampler: tuple = NO_SAMPLER) -> tuple[Tensor, Tensor]:
        """(out (R, OUT_COLS), stats (R, k)) of the chunk's logits, as :func:`chunk_forward`."""
        ...

    def backward(self, grad_out: Tensor, zp: Tensor, zr: Optional[Tensor],
                 tokens: Optional[Tensor], stats: Tensor, temperature: float, need_p: bool,
                 need_r: bool, keep: Optional[Tensor] = None,
                 tau: Optional[Tensor] = None) -> tuple[Optional[Tensor], Optional[Tensor]]:
        """(dzp, dzr) of Σ grad_out·out, as :func:`chunk_backward`."""
        ...

    def hidden_buffer(self, hidden: Tensor) -> Tensor:
        """A zero (N, H) buffer for this process's part of the gradient of ``hidden``."""
        ...

    def hidden_grad(self, grad: Tensor) -> Tensor:
        """The returned gradient of a hidden state from this process's (N, H) part (in the
        buffer's dtype; the caller casts it to the hidden state's)."""
        ...

    def any_process(self, flags: Tensor) -> Tensor:
        """(k,) bool flags, each True where it is True on any process that holds a part of
        the vocabulary (called by every process alike)."""
        ...

    def divergence(self, zp: Tensor, zr: Tensor, stats: Tensor, temperature: float, kind: int,
                   param: float, keep: Optional[Tensor] = None,
                   tau: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
        """(value (R,), ḡ (R,)) of the second walk over the whole vocabulary, from the
        forward's ``stats``, the student on the support ``keep`` / ``tau``."""
        ...

    def divergence_backward(self, grad: Tensor, zp: Tensor, zr: Tensor, stats: Tensor,
                            gbar: Tensor, temperature: float, kind: int, param: float,
                            keep: Optional[Tensor] = None,
                            tau: Optional[Tensor] = None) -> Tensor:
        """∂/∂zp (R, V) of Σ grad·value of the second walk."""
        ...


def chunk_forward(
    zp: Tensor,
    zr: Tensor,
    tokens: Optional[Tensor],
    mask: Optional[Tensor],
    temperature: float,
    want: int,
    impl,
    keep: Optional[Tensor] = None,
    tau: Optional[Tensor] = None,
    sampler: tuple = NO_SAMPLER,
) -> tuple[Tensor, Tensor]:
    """The per-row statistics of one chunk of logits: one ``<backend>_token_stats`` call.

    Args:
        zp, zr: (R, V) policy and reference logits (after scale and soft-cap), any float dtype.
        tokens: (R,) int64 ids in [0, V) or :data:`IGNORE`, or None (no log-probs).
        mask: (R,) bool or None (False rows give 0).
        temperature: > 0.
        want: the columns to compute (:func:`want_bits`).
        impl: the :class:`klpenalty.ops.dispatch.Backend` (:func:`~klpenalty.ops.dispatch.get_backend`).
        keep, tau, sampler: the op's support arguments (:func:`klpenalty.sampling.support_args`);
            ``keep`` a :class:`KeptIds`: the op is given the kept sets
            (:func:`klpenalty.ops.dispatch.forward_of_ids`: made again with their dense mask
            where a row's set is no threshold set).

    Returns:
        ``out`` (R, OUT_COLS) in the compute dtype, the op's columns (0 where not in
        ``want``), and ``stats`` (R, k): what :func:`chunk_backward` needs, opaque to the
        caller (the op's (R, 10) statistics, the threshold used in ``ST_TAU``).
    """
    ids = offsets = None
    if isinstance(keep, KeptIds):
        (ids, offsets), keep = keep, None
    return forward_of_ids(
        impl, zp, zr, tokens, mask, keep, tau, ids=ids, offsets=offsets,
        temperature=temperature, want=want, ignore_index=IGNORE, sampler=sampler,
    )


def chunk_backward(
    grad_out: Tensor,
    zp: Tensor,
    zr: Optional[Tensor],
    tokens: Optional[Tensor],
    mask: Optional[Tensor],
    stats: Tensor,
    temperature: float,
    need_p: bool,
    need_r: bool,
    impl,
    owned: Optional[Tensor] = None,
    ignore: int = IGNORE,
    keep: Optional[Tensor] = None,
    tau: Optional[Tensor] = None,
) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """∂/∂zp and ∂/∂zr of Σ grad_out·out for one chunk: one ``<backend>_token_stats_backward``
    call.

    Args:
        grad_out: (R, OUT_COLS) upstream gradients of the columns of ``out`` (0 where unused,
            and in the columns that were not computed).
        zp, zr, tokens, mask, temperature, impl: as given to :func:`chunk_forward`; ``zr``
            None when no gradient needs the reference (then ``need_r`` is False).
        stats: (R, k) from :func:`chunk_forward`.
        need_p, need_r: which gradients to compute.
        owned, ignore: (R,) bool, the token lies in this slice of the vocabulary (None = the
            whole vocabulary is here), and the ignored id of ``tokens``.
        keep, tau: as given to :func:`chunk_forward` (a :class:`KeptIds` read against
            ``stats``: :func:`chunk_keep_tau`).

    Returns:
        (dzp, dzr): (R, V) in the logits' dtypes, or None where not needed.
    """
    want = want_bits(tokens, True)  # a column not computed carries a zero gradient
    if zr is None:  # no gradient needs the reference (see linear.kl._LinearKL.backward)
        want &= ~(Want.KL | Want.REF_LOGP)
    if host_checks(zp.device):  # on CPU, drop the terms whose upstream gradient is all zero
        live = grad_out.ne(0).any(0).tolist()
        for col, bit in enumerate(Want):
            if not live[col]:
                want &= ~bit
    if not want:
        return (
            torch.zeros_like(zp) if need_p else None,
            torch.zeros_like(zr) if need_r else None,
        )
    keep, tau = chunk_keep_tau(keep, tau, stats, zp.shape)
    gx, gy = impl.backward(
        grad_out, zp, zr, tokens, owned, stats, mask, keep, tau, temperature=temperature,
        want=want, need_x=need_p, need_y=need_r, ignore_index=ignore,
    )
    return (gx if need_p else None), (gy if need_r else None)


class LocalChunks(ChunkAdapter):
    """The :class:`ChunkAdapter` of the whole vocabulary: :func:`chunk_forward`,
    :func:`chunk_backward` on the backend ``impl``; a compact kept set goes to the op as each
    chunk's :class:`KeptIds`."""

    def __init__(self, impl):
        self.impl = impl

    def support(self, support, zp, rows, r0, r1, temperature):
        if support[0] == "ids":
            return chunk_ids(support, rows, r0, r1, zp.device), None, NO_SAMPLER
        return chunk_support(support, zp, rows, r0, r1)

    def forward(self, zp, zr, tokens, temperature, want, keep=None, tau=None,
                sampler=NO_SAMPLER):
        return chunk_forward(zp, zr, tokens, None, temperature, want, self.impl, keep, tau,
                             sampler)

    def backward(self, grad_out, zp, zr, tokens, stats, temperature, need_p, need_r,
                 keep=None, tau=None):
        return chunk_backward(grad_out, zp, zr, tokens, None, stats, temperature, need_p,
                              need_r, self.impl, keep=keep, tau=tau)

    def hidden_buffer(self, hidden: Tensor) -> Tensor:
        return torch.zeros_like(hidden)  # each row written once: no sum to keep in float32

    def hidden_grad(self, grad: Tensor) -> Tensor:
        return grad

    def any_process(self, flags: Tensor) -> Tensor:
        return flags

    def divergence(self, zp, zr, stats, temperature, kind, param, keep=None, tau=None):
        keep, tau = chunk_keep_tau(keep, tau, stats, zp.shape)
        return self.impl.divergence(zp, zr, stats, None, keep, tau, temperature=temperature,
                                    kind=kind, param=param)

    def divergence_backward(self, grad, zp, zr, stats, gbar, temperature, kind, param,
                            keep=None, tau=None):
        keep, tau = chunk_keep_tau(keep, tau, stats, zp.shape)
        return self.impl.divergence_backward(grad, zp, zr, stats, gbar, None, keep, tau,
                                             temperature=temperature, kind=kind, param=param)


class DivergenceChunks(ChunkAdapter):
    """The adapter of a divergence between the two models (:mod:`klpenalty.ops.divergence`),
    over another adapter (the whole vocabulary or a slice): the forward op's statistics (the
    KL column, both normalisers), then, for every kind but the reverse KL (the KL column
    itself), the second walk, its value in the KL column and ḡ appended to the stats. The
    second model is a constant: only ∂/∂zp comes back."""

    def __init__(self, inner: ChunkAdapter, kind: int, param: float):
        self.inner, self.kind, self.param = inner, int(kind), float(param)
        self.walk = self.kind != Divergence.REVERSE_KL

    def support(self, support, zp, rows, r0, r1, temperature):
        return self.inner.support(support, zp, rows, r0, r1, temperature)

    def forward(self, zp, zr, tokens, temperature, want, keep=None, tau=None,
                sampler=NO_SAMPLER):
        out, stats = self.inner.forward(zp, zr, None, temperature, Want.KL, keep, tau, sampler)
        if not self.walk:
            return out, stats
        if tuple(sampler) != NO_SAMPLER:  # the threshold the forward computed (global V)
            tau = stats[:, ST_TAU]
        value, gbar = self.inner.divergence(zp, zr, stats, temperature, self.kind, self.param,
                                            keep, tau)
        out[:, OUT_KL] = value
        return out, torch.cat([stats, gbar.unsqueeze(-1)], -1)

    def backward(self, grad_out, zp, zr, tokens, stats, temperature, need_p, need_r,
                 keep=None, tau=None):
        if not self.walk:
            return self.inner.backward(grad_out, zp, zr, None, stats, temperature, need_p,
                                       False, keep, tau)
        if not need_p:
            return None, None
        grad = grad_out[:, OUT_KL].contiguous()
        return self.inner.divergence_backward(grad, zp, zr, stats[:, :-1], stats[:, -1],
                                              temperature, self.kind, self.param, keep,
                                              tau), None

    def hidden_buffer(self, hidden: Tensor) -> Tensor:
        return self.inner.hidden_buffer(hidden)

    def hidden_grad(self, grad: Tensor) -> Tensor:
        return self.inner.hidden_grad(grad)

    def any_process(self, flags: Tensor) -> Tensor:
        return self.inner.any_process(flags)
