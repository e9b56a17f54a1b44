"""A small English-like probabilistic context-free grammar with exact probabilities.

The demo's "language": a few dozen words, noun phrases with an optional adjective and an
optional prepositional phrase (which holds another noun phrase, so phrases nest), transitive,
intransitive and predicative (``is ADJ``) verbs, an optional adverb, and documents of
1 + Geometric sentences that end in ``<eos>``. One adjective is ``helpful``: the word the
demo's hackable reward counts.

Three exact tools come with it, each written independently of the others so the tests can play
them against each other:

- :meth:`Grammar.sample` draws a document and returns the probability of its derivation;
- :meth:`Grammar.inside` and :meth:`Grammar.prefix_probability` compute p_G(x) and
  p_G(x is a prefix) by dynamic programming (inside / Jelinek–Lafferty style);
- :class:`Recognizer` decides grammaticality (complete documents *and* prefixes, since a
  policy can be cut off at the length limit) with a lazily built deterministic automaton.
"""

from __future__ import annotations

import math
import random
from typing import Iterable, Mapping, Sequence

__all__ = ["Grammar", "Recognizer", "DEFAULT_RULES", "default_grammar", "HELPFUL", "EOS"]

EOS = "<eos>"
HELPFUL = "helpful"

DETERMINERS = ("the", "a", "every", "this")
ADJECTIVES = ("big", "small", "tall", "happy", "clever", "quiet", "brave", "kind", "busy", HELPFUL)
NOUNS = ("dog", "cat", "child", "farmer", "doctor", "baker", "bird", "teacher")
PREPOSITIONS = ("near", "with", "behind")
TRANSITIVE = ("sees", "finds", "helps", "likes", "follows")
INTRANSITIVE = ("sleeps", "runs", "smiles", "waits")
ADVERBS = ("today", "again", "often")


def _uniform(words: Sequence[str]) -> list[tuple[tuple[str, ...], float]]:
    return [((w,), 1.0 / len(words)) for w in words]


# Nonterminals are upper-case; everything else is a terminal (a word). No rule is empty and no
# rule is left-recursive, so every symbol derives at least one word.
DEFAULT_RULES: dict[str, list[tuple[tuple[str, ...], float]]] = {
    "DOC": [(("S", ".", "MORE"), 1.0)],
    "MORE": [((EOS,), 0.55), (("S", ".", "MORE"), 0.45)],
    "S": [(("NP", "VP"), 1.0)],
    "NP": [(("DET", "NOM"), 0.8), (("DET", "NOM", "PP"), 0.2)],
    "NOM": [(("N",), 0.6), (("ADJ", "N"), 0.4)],
    "PP": [(("P", "NP"), 1.0)],
    "VP": [(("VC",), 0.85), (("VC", "ADV"), 0.15)],
    "VC": [(("VT", "NP"), 0.5), (("VI",), 0.25), (("is", "ADJ"), 0.25)],
    "DET": _uniform(DETERMINERS),
    "ADJ": _uniform(ADJECTIVES),
    "N": _uniform(NOUNS),
    "P": _uniform(PREPOSITIONS),
    "VT": _uniform(TRANSITIVE),
    "VI": _uniform(INTRANSITIVE),
    "ADV": _uniform(ADVERBS),
}


class Grammar:
    """A PCFG over words, without empty or left-recursive rules.

    Args:
        rules: nonterminal -> list of (right-hand side, probability); each nonterminal's
            probabilities sum to 1. Symbols that are not keys of ``rules`` are terminals.
        start: the start symbol.

    Attributes:
        terminals: the words, in first-appearance order (deterministic).
    """

    def __init__(
        self, rules: Mapping[str, Sequence[tuple[Sequence[str], float]]], start: str = "DOC"
    ) -> None:
        self.rules = {a: [(tuple(rhs), float(p)) for rhs, p in alts] for a, alts in rules.items()}
        self.start = start
        if start not in self.rules:
            raise ValueError(f"start symbol {start!r} has no rules")
        terminals: dict[str, None] = {}
        for a, alts in self.rules.items():
            total = sum(p for _, p in alts)
            if not math.isclose(total, 1.0, abs_tol=1e-12):
                raise ValueError(f"rule probabilities of {a!r} sum to {total}, not 1")
            for rhs, p in alts:
                if not rhs or p < 0:
                    raise ValueError(f"bad rule {a} -> {rhs} ({p})")
                for s in rhs:
                    if s not in self.rules:
                        terminals.setdefault(s, None)
        self.terminals: list[str] = list(terminals)

    def is_terminal(self, symbol: str) -> bool:
        return symbol not in self.rules

    # ---------------------------------------------------------------- sampling
    def sample(self, rng: random.Random) -> tuple[list[str], float]:
        """Draw one document (a list of words ending in ``<eos>``) and the log-probability
        of the derivation that produced it."""
        words: list[str] = []
        logp = 0.0
        stack = [self.start]  # top at the end
        while stack:
            sym = stack.pop()
            if sym not in self.rules:
                words.append(sym)
                continue
            alts = self.rules[sym]
            u = rng.random()
            for rhs, p in alts:
                u -= p
                if u < 0:
                    break
            else:  # rounding: fall back to the last rule with p > 0
                rhs, p = next((r, q) for r, q in reversed(alts) if q > 0)
            logp += math.log(p)
            stack.extend(reversed(rhs))
        return words, logp

    # ---------------------------------------------------------------- exact probabilities
    def inside(self, words: Sequence[str], symbol: str | None = None) -> float:
        """p(symbol ⇒* words): the total probability of all derivations of exactly ``words``
        (the inside probability; symbol defaults to the start symbol)."""
        w = list(words)
        n = len(w)
        if n == 0:
            return 0.0  # no symbol derives the empty string
        return _Chart(self, w).sym(symbol or self.start, 0, n)

    def prefix_probability(self, words: Sequence[str], symbol: str | None = None) -> float:
        """p(symbol ⇒* words z for some z): the probability that a document starts with
        ``words`` (1 for the empty prefix). Exact because every derivation terminates with
        probability 1 in this (sub-critical) grammar."""
        w = list(words)
        if not w:
            return 1.0
        return _Chart(self, w).prefix(symbol or self.start, 0)

    def next_word_distribution(self, words: Sequence[str]) -> dict[str, float]:
        """p_G(next word | prefix) for every terminal with non-zero probability."""
        base = self.prefix_probability(words)
        if base == 0.0:
            raise ValueError(f"{' '.join(words)!r} is not a grammatical prefix")
        out = {}
        for t in self.terminals:
            p = self.prefix_probability([*words, t])
            if p > 0:
                out[t] = p / base
        return out


class _Chart:
    """Memoised inside and prefix tables for one word sequence."""

    def __init__(self, grammar: Grammar, words: list[str]) -> None:
        self.g = grammar
        self.w = words
        self.n = len(words)
        self._sym: dict[tuple[str, int, int], float] = {}
        self._pre: dict[tuple[str, int], float] = {}

    def sym(self, x: str, i: int, j: int) -> float:
        """p(x ⇒* w[i:j]), j > i."""
        if x not in self.g.rules:
            return 1.0 if j == i + 1 and self.w[i] == x else 0.0
        key = (x, i, j)
        if key in self._sym:
            return self._sym[key]
        total = 0.0
        for rhs, p in self.g.rules[x]:
            if p > 0 and len(rhs) <= j - i:
                total += p * self.seq(rhs, 0, i, j)
        self._sym[key] = total
        return total

    def seq(self, rhs: tuple[str, ...], k: int, i: int, j: int) -> float:
        """p(rhs[k:] ⇒* w[i:j]); every symbol covers at least one word."""
        rest = len(rhs) - k - 1
        if rest == 0:
            return self.sym(rhs[k], i, j)
        total = 0.0
        for m in range(i + 1, j - rest + 1):
            left = self.sym(rhs[k], i, m)
            if left:
                total += left * self.seq(rhs, k + 1, m, j)
        return total

    def prefix(self, x: str, i: int) -> float:
        """p(x ⇒* w[i:n] z for some z), for a non-empty w[i:n]."""
        if x not in self.g.rules:
            return 1.0 if self.n == i + 1 and self.w[i] == x else 0.0
        key = (x, i)
        if key in self._pre:
            return self._pre[key]
        total = 0.0
        for rhs, p in self.g.rules[x]:
            if p > 0:
                total += p * self.prefix_seq(rhs, 0, i)
        self._pre[key] = total
        return total

    def prefix_seq(self, rhs: tuple[str, ...], k: int, i: int) -> float:
        # Either rhs[k] covers the rest of the prefix (and maybe more; the later symbols then
        # derive anything, probability 1), or it derives w[i:m] exactly with m < n and the
        # later symbols cover the rest.
        total = self.prefix(rhs[k], i)
        if k + 1 < len(rhs):
            for m in range(i + 1, self.n):
                left = self.sym(rhs[k], i, m)
                if left:
                    total += left * self.prefix_seq(rhs, k + 1, m)
        return total


class Recognizer:
    """Exact grammaticality of documents and of document *prefixes*, in O(1) per word.

    A nondeterministic top-down parser whose configurations are stacks of symbols still to
    derive; a state is the set of configurations reachable after the words read so far (after
    expanding every nonterminal on top). States are built lazily and cached, so after warm-up
    this is a deterministic automaton: one dictionary look-up per word. A prefix is grammatical
    iff its state is non-empty; a complete document iff its state holds the empty stack.

    Args:
        grammar: the grammar; it must have no left recursion (checked: stacks are bounded).
    """

    MAX_STACK = 64

    def __init__(self, grammar: Grammar) -> None:
        self.g = grammar
        self._ids: dict[frozenset, int] = {}
        self._states: list[frozenset] = []
        self._delta: dict[tuple[int, str], int] = {}
        self.dead = self._intern(frozenset())
        self.start = self._intern(self._closure({(grammar.start,)}))

    def _intern(self, state: frozenset) -> int:
        if state not in self._ids:
            self._ids[state] = len(self._states)
            self._states.append(state)
        return self._ids[state]

    def _closure(self, stacks: Iterable[tuple[str, ...]]) -> frozenset:
        done: set[tuple[str, ...]] = set()
        todo = list(stacks)
        seen: set[tuple[str, ...]] = set()
        while todo:
            st = todo.pop()
            if st in seen:
                continue
            seen.add(st)
            if len(st) > self.MAX_STACK:
                raise ValueError("grammar stack grew without bound (left recursion?)")
            if not st or self.g.is_terminal(st[-1]):
                done.add(st)
                continue
            for rhs, p in self.g.rules[st[-1]]:
                if p > 0:
                    todo.append(st[:-1] + tuple(reversed(rhs)))
        return frozenset(done)

    def step(self, state: int, word: str) -> int:
        """The state after reading ``word`` in ``state`` (``self.dead`` if impossible)."""
        key = (state, word)
        nxt = self._delta.get(key)
        if nxt is None:
            moved = {st[:-1] for st in self._states[state] if st and st[-1] == word}
            nxt = self._intern(self._closure(moved)) if moved else self.dead
            self._delta[key] = nxt
        return nxt

    def run(self, words: Iterable[str]) -> int:
        """The state after reading all ``words`` from the start."""
        s = self.start
        for w in words:
            s = self.step(s, w)
            if s == self.dead:
                break
        return s

    def is_prefix(self, words: Iterable[str]) -> bool:
        """True iff some grammatical document starts with ``words`` (a document is a prefix of
        itself)."""
        return self.run(words) != self.dead

    def is_complete(self, words: Iterable[str]) -> bool:
        """True iff ``words`` is a whole grammatical document (ending in ``<eos>``)."""
        return () in self._states[self.run(words)]

    def viable_length(self, words: Sequence[str]) -> int:
        """Length of the longest grammatical prefix of ``words``."""
        s = self.start
        for k, w in enumerate(words):
            s = self.step(s, w)
            if s == self.dead:
                return k
        return len(words)


def default_grammar() -> Grammar:
    """The demo grammar (:data:`DEFAULT_RULES`)."""
    return Grammar(DEFAULT_RULES)
