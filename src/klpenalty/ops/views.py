"""The single-output entry points of a backend, as views of its one-pass ``token_stats``.

Every backend implements one op pair (``<backend>_token_stats``, see :mod:`.autograd`) and an
unchecked entry ``token_stats(x, y, tokens, mask, keep, tau, temperature, *, ignore_index,
want, check, **tiles) -> out (..., 4)``. :func:`backend_views` turns it into the three
single-output entry points every backend module exposes (``full_kl``, ``token_logprobs``,
``entropy``), so that computing one statistic is the one-pass op with one ``want`` bit, not a
second implementation. Shape letters: V vocabulary; (...) the leading dims.
"""

from __future__ import annotations

from typing import Callable

from torch import Tensor

from . import autograd as ag

__all__ = ["backend_views", "column"]


def column(out: Tensor, col: int) -> Tensor:
    """Column ``col`` of a token_stats result (..., 4), contiguous (callers may ``.view`` it)."""
    return out[..., col].contiguous()


def backend_views(token_stats: Callable[..., Tensor]):
    """(full_kl, token_logprobs, entropy) entry points on top of a backend's ``token_stats``.

    Extra keyword arguments (a backend's tile options, e.g. ``chunk_rows``, ``vocab_chunk``)
    pass through to ``token_stats``.
    """

    def full_kl(
        x: Tensor, y: Tensor, mask: Tensor | None, temperature: float, *, check: bool = False,
        **tiles,
    ) -> Tensor:
        """Exact KL(softmax(x/T) ‖ softmax(y/T)) per position (unchecked internal entry point).

        Args:
            x: (..., V) float16/bfloat16/float32/float64 policy logits.
            y: (..., V) same shape, reference logits.
            mask: (...) bool or None; False positions give 0 and zero gradient.
            temperature: > 0, divides both logits.
            check: raise ValueError naming the input when a counted position's KL is NaN.

        Returns:
            (...) float32 (float64 if either input is float64), differentiable (also twice).
        """
        out = token_stats(
            x, y, None, mask, None, None, temperature, want=ag.WANT_KL, check=check, **tiles
        )
        return column(out, ag.OUT_KL)

    def token_logprobs(
        x: Tensor, tokens: Tensor, temperature: float, *, ignore_index: int = -100,
        check: bool = False, **tiles,
    ) -> Tensor:
        """log softmax(x/T)[token] per position (unchecked internal entry point).

        Args:
            x: (..., V) float logits.  tokens: (...) int64 ids in [0, V) or ``ignore_index``.
            temperature: > 0.
            ignore_index: positions holding it give 0 and zero gradient.
            check: also checks the token range.

        Returns:
            (...) float32 (float64 for float64 logits), differentiable with respect to ``x``.
        """
        out = token_stats(
            x, None, tokens, None, None, None, temperature, ignore_index=ignore_index,
            want=ag.WANT_LOGP, check=check, **tiles,
        )
        return column(out, ag.OUT_LOGP)

    def entropy(
        x: Tensor, mask: Tensor | None, temperature: float, *, check: bool = False, **tiles
    ) -> Tensor:
        """Policy entropy H(softmax(x/T)) per position (unchecked internal entry point).

        Args:
            x: (..., V) float logits.
            mask: (...) bool or None; False positions give 0 and zero gradient.
            temperature: > 0.
            check: raise ValueError naming ``logits`` when a counted position's entropy is NaN.

        Returns:
            (...) float32 (float64 for float64 logits), ≥ 0, differentiable (also twice).
        """
        out = token_stats(
            x, None, None, mask, None, None, temperature, want=ag.WANT_ENTROPY, check=check,
            **tiles,
        )
        return column(out, ag.OUT_ENTROPY)

    return full_kl, token_logprobs, entropy
