"""The native form of the kept-set check (``native_support_from_ids``) against its torch form
and a float64 construction: thresholds, broken ties, duplicated ids, empty rows, NaN and −inf
logits, every logits dtype, int32/int16 ids, V off the vector width, strided logits; and
``full_kl(support=(ids, offsets))`` against the dense mask and the float64 reference."""

from __future__ import annotations

import math
import os
import shutil

import pytest
import torch

import klpenalty
from klpenalty._validation import compute_dtype
from klpenalty.ops import native
from klpenalty.ops.reference import full_kl_reference
from klpenalty.sampling import sampling_threshold, support_from_ids, threshold_of_ids
from tests.helpers import DTYPES, make_logits, tol

HAS_COMPILER = shutil.which(os.environ.get("CXX", "c++")) is not None
pytestmark = pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler: native cannot build")

INF, NAN = math.inf, math.nan
# V = 1, off the vector width (16 floats, 8 doubles) and a step of the scan (64 floats), a
# multiple of both, and longer than a few steps with a partial last one
VOCABS = [1, 37, 64, 100, 2048 + 37]


def _compact(sets: list[list[int]], index_dtype=torch.long):
    """(ids, offsets) of per-row id lists, in the given order."""
    ids = torch.tensor([i for s in sets for i in s], dtype=index_dtype)
    counts = torch.tensor([len(s) for s in sets], dtype=torch.long)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]).to(index_dtype)
    return ids, offsets


def _shuffled(kept: torch.Tensor, seed: int) -> list[list[int]]:
    """The ids of each row of a (N, V) bool mask in a random order (engines list the kept ids
    in order of probability, not of id)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for row in kept:
        ids = row.nonzero().flatten()
        out.append(ids[torch.randperm(ids.numel(), generator=g)].tolist())
    return out


def _expected(x: torch.Tensor, sets: list[list[int]]):
    """(tau, exact) of the rule in float64, from its definition: tau_r the smallest logit at
    the row's ids (+inf if none, NaN if one is NaN), exact_r iff the row's set (duplicates
    counted once) is {v : x_v ≥ tau_r}."""
    xf = x.detach().reshape(len(sets), x.shape[-1]).double()
    taus, exact = [], []
    for row, s in zip(xf, sets):
        vals = row[torch.tensor(s, dtype=torch.long)]
        tau = INF if not s else (NAN if bool(vals.isnan().any()) else float(vals.min()))
        taus.append(tau)
        passing = set((row >= tau).nonzero().flatten().tolist()) if tau == tau else None
        exact.append(passing is not None and passing == set(s))
    cd = compute_dtype(x)
    shape = x.shape[:-1]
    return (torch.tensor(taus, dtype=torch.float64).to(cd).reshape(shape),
            torch.tensor(exact).reshape(shape))


def _case(name: str, vocab: int, dtype: torch.dtype):
    """(x (2, 3, V), per-row id lists) of one kind of kept sets."""
    x, _ = make_logits((2, 3, vocab), torch.float64, seed=vocab + len(name), scale=2.0)
    g = torch.Generator().manual_seed(vocab)
    if name in ("ties_kept", "tie_broken"):
        x = torch.randint(-3, 4, (2, 3, vocab), generator=g).double()  # many ties
    x = x.to(dtype)
    flat = x.reshape(6, vocab)
    if name == "top_p":
        kept = flat.to(compute_dtype(x)) >= sampling_threshold(flat, top_p=0.8).unsqueeze(-1)
        return x, _shuffled(kept, vocab)
    if name == "ties_kept":  # top-k keeping every logit tied with the k-th: a threshold
        k = min(5, vocab)
        kept = flat >= flat.topk(k, -1).values[:, -1:]
        return x, _shuffled(kept, vocab)
    if name == "tie_broken":  # exactly k ids by sort order: rows with a tie at the k-th are not
        k = min(5, vocab)
        return x, [row.topk(k).indices.tolist() for row in flat]
    if name == "random":  # arbitrary subsets, the last row a threshold set
        sets = [torch.randperm(vocab, generator=g)[: 1 + r * vocab // 7].tolist() for r in range(5)]
        return x, sets + _shuffled(flat[-1:] >= flat[-1].median(), vocab)
    if name == "duplicates":
        top = flat.argmax(-1).tolist()
        sets = [[top[0], top[0]], [], [], [], [], []]  # {argmax, argmax}: exact
        if vocab > 1:
            a, b = flat[1].topk(2).indices.tolist()  # {b, b} while {x ≥ x_b} = {a, b}: not
            sets[1] = [b, b]
            a, b = flat[2].topk(2).indices.tolist()
            sets[2] = [a, b, a]  # the two largest, one twice: exact (no tie in random logits)
        sets[3] = _shuffled(flat[3:4] >= flat[3].median(), 0)[0] * 2  # a threshold set twice
        sets[4] = [top[4]] * 3
        sets[5] = list(range(vocab)) + [vocab - 1]  # everything, one id twice: exact
        return x, sets
    if name == "empty":  # empty sets: exact unless the row holds +inf
        sets = [[] for _ in range(6)]
        flat[1, vocab // 2] = INF
        sets[2] = [int(flat[2].argmax())]
        return x, sets
    if name == "nan":
        flat[0, 0] = NAN  # kept: tau NaN, not exact
        flat[1, -1] = NAN  # outside a threshold set: still exact
        flat[2] = NAN  # a whole NaN row, an empty set: exact (no logit ≥ +inf)
        flat[3, 0] = NAN  # outside the kept argmax
        sets = [[0] + ([1] if vocab > 1 else []), [int(flat[1, :-1].argmax())] if vocab > 1 else [],
                [], [int(flat[3, 1:].argmax()) + 1] if vocab > 1 else [0], [int(flat[4].argmax())],
                list(range(vocab))]
        return x, sets
    if name == "minus_inf":  # a kept −inf: tau = −inf, which every logit but NaN passes
        flat[:, ::2] = -INF
        everything = list(range(vocab))
        sets = [everything[::-1], everything[:-1], [0], everything, everything, [vocab - 1]]
        if vocab > 2:
            flat[3, 1] = NAN
            sets[3] = [v for v in everything if v != 1]  # all but the NaN: exact
            flat[4, 1] = NAN  # NaN kept: not exact
        return x, sets
    raise AssertionError(name)


CASES = ["top_p", "ties_kept", "tie_broken", "random", "duplicates", "empty", "nan", "minus_inf"]


def _assert_same(got, want):
    tau, exact = got
    torch.testing.assert_close(tau, want[0], rtol=0, atol=0, equal_nan=True)
    assert torch.equal(exact, want[1]), (exact, want[1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("name", CASES)
def test_native_and_torch_forms_match_the_definition(name, vocab, dtype):
    x, sets = _case(name, vocab, dtype)
    want = _expected(x, sets)
    ids, offsets = _compact(sets)
    _assert_same(threshold_of_ids(x, ids, offsets, native=True), want)
    _assert_same(threshold_of_ids(x, ids, offsets, native=False, chunk_rows=4), want)
    assert threshold_of_ids(x, ids, offsets)[0].dtype == compute_dtype(x)


def test_the_cases_reach_both_answers():
    """Each kind of set gives the answer it is built for (so the grid above tests both)."""
    answers = {}
    for name in CASES:
        x, sets = _case(name, 37, torch.float32)
        answers[name] = _expected(x, sets)[1].flatten().tolist()
    assert all(answers["top_p"]) and all(answers["ties_kept"])
    assert not all(answers["tie_broken"]) and not all(answers["random"])
    assert answers["duplicates"] == [True, False, True, True, True, True]
    assert answers["empty"] == [True, False, True, True, True, True]
    assert answers["nan"][:4] == [False, True, True, True]
    assert answers["minus_inf"] == [True, False, False, True, False, False]


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int16, torch.uint8])
def test_index_dtypes(index_dtype):
    x, sets = _case("random", 100, torch.float32)
    want = _expected(x, sets)
    ids, offsets = _compact(sets, torch.long)
    ids = ids.to(index_dtype)
    offsets = offsets.to(torch.int32 if index_dtype == torch.uint8 else index_dtype)
    _assert_same(threshold_of_ids(x, ids, offsets, native=True), want)
    _assert_same(threshold_of_ids(x, ids, offsets, native=False), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_strided_logits(dtype):
    base, _ = make_logits((4, 6, 200), dtype, seed=3)
    for x in (base[:, ::2, :150], base[1:3].transpose(0, 1), base.transpose(-1, -2)[..., :5]):
        flat = x.reshape(-1, x.shape[-1])
        kept = flat.to(compute_dtype(x)) >= sampling_threshold(flat, top_k=4).unsqueeze(-1)
        sets = _shuffled(kept, 1)
        sets[-1] = sets[-1][:-1] if len(sets[-1]) > 1 else []  # one row that is not a threshold
        want = _expected(x, sets)
        ids, offsets = _compact(sets)
        _assert_same(threshold_of_ids(x, ids, offsets, native=True), want)
        _assert_same(threshold_of_ids(x, ids, offsets, native=False), want)


def test_support_from_ids_gives_tau_or_the_dense_mask():
    x, sets = _case("top_p", 100, torch.float32)
    ids, offsets = _compact(sets)
    keep, tau = support_from_ids(x, ids, offsets)
    assert keep is None
    torch.testing.assert_close(tau, _expected(x, sets)[0], rtol=0, atol=0)
    sets[4] = sets[4][1:]  # drop one kept id: no threshold describes the set any more
    ids, offsets = _compact(sets)
    keep, tau = support_from_ids(x, ids, offsets)
    assert tau is None and keep.shape == x.shape and keep.dtype == torch.bool
    want = torch.zeros(6, 100, dtype=torch.bool)
    for r, s in enumerate(sets):
        want[r, s] = True
    assert torch.equal(keep, want.reshape(x.shape))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["top_p", "ties_kept", "tie_broken", "random", "duplicates"])
def test_full_kl_with_compact_sets_is_the_dense_mask_and_the_reference(name, dtype):
    x, sets = _case(name, 2048 + 37, dtype)
    _, y = make_logits(x.shape, dtype, seed=9)
    ids, offsets = _compact(sets)
    dense = torch.zeros(6, x.shape[-1], dtype=torch.bool)
    for r, s in enumerate(sets):
        dense[r, s] = True
    dense = dense.reshape(x.shape)
    got = klpenalty.full_kl(x, y, support=(ids, offsets))
    # the same support as a threshold or as a mask: the kernel's two support walks, equal up to
    # the float32 rounding of their sums
    torch.testing.assert_close(got, klpenalty.full_kl(x, y, support=dense), **tol(torch.float32))
    want = full_kl_reference(torch.where(dense, x.double(), -INF), y)
    torch.testing.assert_close(got.double(), want, **tol(dtype))


def test_the_op_never_reads_out_of_range():
    x = torch.randn(3, 10)
    op = torch.ops.klpenalty.native_support_from_ids
    assert native.available()
    good_offsets = torch.tensor([0, 1, 2, 3])
    for ids, offsets, err, match in (
        (torch.tensor([0, 10, 1]), good_offsets, ValueError, r"support ids must lie in \[0, 10\)"),
        (torch.tensor([0, -1, 1]), good_offsets, ValueError, r"support ids must lie in \[0, 10\)"),
        (torch.tensor([0, 1, 2]), torch.tensor([0, 2, 1, 3]), ValueError, "non-decreasing"),
        (torch.tensor([0, 1, 2]), torch.tensor([0, 1, 2, 4]), ValueError, "end at len"),
        (torch.tensor([0, 1, 2]), torch.tensor([0, 1, 2]), ValueError, "N \\+ 1 = 4 entries"),
        (torch.tensor([0, 1, 2], dtype=torch.int16), good_offsets, TypeError, "int32 or int64"),
    ):
        with pytest.raises(err, match=match):
            op(x, ids, offsets, 0)
    with pytest.raises(ValueError, match=r"support ids must lie in \[0, 10\)"):
        threshold_of_ids(x, torch.tensor([0, 10, 1]), good_offsets, native=True)


def test_chunks_of_compact_sets_with_narrow_index_dtypes():
    """rows_of_support (linear_kl's chunks) cuts the same sets from int16 offsets as from int64."""
    from klpenalty.sampling import rows_of_support

    x, sets = _case("random", 100, torch.float32)
    flat = x.reshape(6, 100)
    rows = torch.tensor([4, 1, 5])
    wide = _compact(sets)
    narrow = _compact(sets, torch.int16)
    for kind_payload in (wide, narrow):
        keep, tau, _ = rows_of_support("ids", kind_payload, flat[rows], rows)
        want = _expected(flat[rows], [sets[r] for r in rows.tolist()])
        dense = torch.zeros(3, 100, dtype=torch.bool)
        for i, r in enumerate(rows.tolist()):
            dense[i, sets[r]] = True
        if bool(want[1].all()):
            assert keep is None
            torch.testing.assert_close(tau, want[0], rtol=0, atol=0)
        else:
            assert tau is None and torch.equal(keep, dense)
