"""Scores of generated texts: proxy and gold reward, grammaticality, diversity."""

from __future__ import annotations

from typing import Sequence

from .grammar import EOS, HELPFUL, Recognizer

__all__ = ["TextScore", "score_text", "distinct_n"]


class TextScore:
    """Exact scores of one generated text (a list of words, ``<eos>`` included if emitted).

    Attributes:
        proxy: number of ``helpful`` tokens anywhere: the hackable reward.
        grammatical: a complete grammatical document, or (if the text was cut off at the length
            limit without ``<eos>``) a grammatical prefix.
        gold: ``helpful`` used inside grammatical text: all of them if the text is grammatical,
            otherwise those in the sentences before the first error.
    """

    __slots__ = ("proxy", "gold", "grammatical", "length")

    def __init__(self, proxy: int, gold: int, grammatical: bool, length: int) -> None:
        self.proxy = proxy
        self.gold = gold
        self.grammatical = grammatical
        self.length = length


def score_text(words: Sequence[str], recognizer: Recognizer) -> TextScore:
    """Score one text; ``words`` ends with ``<eos>`` iff the model emitted it."""
    proxy = sum(w == HELPFUL for w in words)
    ok = len(words) > 0 and recognizer.viable_length(words) == len(words)
    if ok and words[-1] == EOS:
        ok = recognizer.is_complete(words)
    if ok:
        gold = proxy
    else:
        good = words[: recognizer.viable_length(words)]
        cut = max((i + 1 for i, w in enumerate(good) if w == "."), default=0)
        gold = sum(w == HELPFUL for w in good[:cut])
    return TextScore(proxy, gold, ok, len(words))


def distinct_n(texts: Sequence[Sequence[str]], n: int) -> float:
    """Distinct-n of a batch: unique n-grams / all n-grams (0 if there are none)."""
    grams = [tuple(t[i : i + n]) for t in texts for i in range(len(t) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0
