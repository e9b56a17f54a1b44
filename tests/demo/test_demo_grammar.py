"""The demo grammar: sampler, inside / prefix probabilities and the recogniser agree exactly."""

from __future__ import annotations

import math
import random

import pytest

from klpenalty.demo.grammar import EOS, Grammar, Recognizer, default_grammar
from klpenalty.demo.text import distinct_n, score_text

# Probabilities are products/sums of at most a few hundred float64 factors: relative rounding
# error ≲ 1e-13; 1e-9 is loose for that but far below any real disagreement (≥ 1e-3).
REL = 1e-9


@pytest.fixture(scope="module")
def grammar() -> Grammar:
    return default_grammar()


@pytest.fixture(scope="module")
def recognizer(grammar) -> Recognizer:
    return Recognizer(grammar)


@pytest.fixture(scope="module")
def docs(grammar):
    rng = random.Random(7)
    return [grammar.sample(rng) for _ in range(200)]


def test_known_probability(grammar):
    # DOC -> S . MORE; NP -> DET NOM (.8), NOM -> N (.6), DET 1/4, N 1/8;
    # VP -> VC (.85), VC -> VI (.25), VI 1/4; MORE -> <eos> (.55)
    p = (0.8 * 0.6 * 0.25 / 8) * (0.85 * 0.25 * 0.25) * 0.55
    assert math.isclose(grammar.inside("the dog sleeps . <eos>".split()), p, rel_tol=REL)
    assert grammar.inside("the dog sleeps .".split()) == 0.0
    assert grammar.inside("dog the sleeps . <eos>".split()) == 0.0


def test_documents_end_with_eos_and_have_expected_size(docs):
    assert all(d[-1] == EOS and d.count(EOS) == 1 for d, _ in docs)
    mean_len = sum(len(d) for d, _ in docs) / len(docs)
    assert 10 < mean_len < 20  # analytic mean ≈ 14.2 words


def test_inside_equals_derivation_probability(grammar, recognizer, docs):
    # the grammar is unambiguous: a document's inside probability is the probability of the
    # one derivation the sampler took; nothing can follow <eos>, so prefix prob = inside
    for words, logp in docs[:60]:
        p = grammar.inside(words)
        assert math.isclose(p, math.exp(logp), rel_tol=REL), words
        assert math.isclose(grammar.prefix_probability(words), p, rel_tol=REL)
        assert recognizer.is_complete(words)
        assert all(recognizer.is_prefix(words[:k]) for k in range(len(words) + 1))
        assert not recognizer.is_complete(words[:-1])


def test_prefix_probability_conserves_mass(grammar, docs):
    # p(x is a prefix) = p(document == x) + Σ_v p(x v is a prefix)
    words = docs[3][0]
    for k in range(0, min(len(words), 9)):
        x = words[:k]
        total = grammar.inside(x) + sum(
            grammar.prefix_probability([*x, t]) for t in grammar.terminals
        )
        assert math.isclose(total, grammar.prefix_probability(x), rel_tol=REL)
    dist = grammar.next_word_distribution(["the"])
    assert math.isclose(sum(dist.values()), 1.0, rel_tol=REL)
    assert dist["helpful"] == pytest.approx(0.4 * 0.1)


def test_recognizer_exhaustive_short_strings(grammar, recognizer):
    # every string of length ≤ 3 whose proper prefixes are viable (all others are rejected by
    # both sides once a prefix is): the recogniser's verdicts equal "probability > 0"
    frontier = [[]]
    checked = 0
    for _ in range(3):
        nxt = []
        for x in frontier:
            for t in grammar.terminals:
                y = [*x, t]
                viable = grammar.prefix_probability(y) > 0
                assert recognizer.is_prefix(y) == viable, y
                assert recognizer.is_complete(y) == (grammar.inside(y) > 0), y
                checked += 1
                if viable:
                    nxt.append(y)
        frontier = nxt
    assert checked > 2000
    assert not recognizer.is_prefix(["helpful"])


def test_recognizer_on_mutated_documents(grammar, recognizer, docs):
    # single-word substitutions, deletions, insertions and swaps of real documents, plus their
    # prefixes: accepted as document / as prefix iff the exact probability is > 0
    rng = random.Random(3)
    words_all = grammar.terminals
    n_bad = 0
    for words, _ in docs[:80]:
        for _ in range(4):
            w = list(words)
            i = rng.randrange(len(w))
            kind = rng.randrange(4)
            if kind == 0:
                w[i] = rng.choice(words_all)
            elif kind == 1:
                del w[i]
            elif kind == 2:
                w.insert(i, rng.choice(words_all))
            else:
                j = rng.randrange(len(w))
                w[i], w[j] = w[j], w[i]
            complete = grammar.inside(w) > 0
            n_bad += not complete
            assert recognizer.is_complete(w) == complete, w
            cut = w[: rng.randrange(1, len(w) + 1)]
            assert recognizer.is_prefix(cut) == (grammar.prefix_probability(cut) > 0), cut
    assert n_bad > 100  # the mutations did produce ungrammatical strings


def test_score_text(recognizer):
    s = score_text("helpful helpful helpful".split(), recognizer)
    assert (s.proxy, s.gold, s.grammatical) == (3, 0, False)
    # cut off at the length limit inside a grammatical sentence: still grammatical
    s = score_text("the helpful dog sleeps . the helpful".split(), recognizer)
    assert (s.proxy, s.gold, s.grammatical) == (2, 2, True)
    # <eos> too early: only the complete grammatical sentence counts for gold
    s = score_text("the helpful dog sleeps . the helpful <eos>".split(), recognizer)
    assert (s.proxy, s.gold, s.grammatical) == (2, 1, False)
    s = score_text("the dog is helpful . <eos>".split(), recognizer)
    assert (s.proxy, s.gold, s.grammatical) == (1, 1, True)
    assert not score_text([], recognizer).grammatical


def test_distinct_n():
    assert distinct_n([["a", "b", "a", "b"]], 2) == pytest.approx(2 / 3)
    assert distinct_n([["a"]], 2) == 0.0
