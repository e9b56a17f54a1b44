"""klpenalty.sampling: top-k / top-p / min-p thresholds and the engines' compact kept sets,
against float64 references of the truncated distributions written here (a materialising
sort per row)."""

from __future__ import annotations

import math

import pytest
import torch

from klpenalty.sampling import resolve_support, sampling_threshold, support_from_ids

import klpenalty as klp
from .helpers import (
    backend_env,
    make_logits,
    min_p_boundary,
    op_backend,
    temperature_tie_cases,
    tol,
)
from klpenalty.bench import alloc_profile
from klpenalty.ops.contract import sampler_keys
from klpenalty.ops.reference import full_kl_reference, kept_set_reference
from klpenalty.ops.streaming.threshold import CHUNK_ELEMENTS, LOCAL, threshold_rows


def _kept_by_tau(x, tau):
    return x.to(tau.dtype) >= tau.unsqueeze(-1)


# ------------------------------------------------------------------ thresholds
SETTINGS = [
    dict(top_k=1),
    dict(top_k=5),
    dict(top_k=60),  # k > V: nothing cut
    dict(top_p=0.3),
    dict(top_p=0.9, temperature=0.5),
    dict(top_p=0.9, temperature=2.0),  # temperature first: a wider kept set
    dict(min_p=0.05),
    dict(min_p=0.2, temperature=1.7),
    dict(top_k=8, top_p=0.6),  # top-p on the renormalised top-k distribution
    dict(top_k=20, top_p=0.95, min_p=0.1, temperature=0.8),
]


CPU_BACKENDS = ["streaming", "native"]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_thresholds_match_the_reference(dtype, backend):
    x, _ = make_logits((3, 4, 50), dtype, seed=1, scale=2.0)
    rows = x.reshape(-1, 50)
    for kw in SETTINGS:
        tau = sampling_threshold(x, **kw, backend=backend)
        assert tau.shape == (3, 4)
        assert tau.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
        got = _kept_by_tau(x, tau).reshape(-1, 50)
        want = kept_set_reference(rows, **kw)
        assert torch.equal(got, want), kw


def test_top_p_rows_needing_different_numbers_of_candidates():
    """top-p looks at the largest k' logits of a row, k' growing for the rows still open: a
    peaked row (a few tokens), flat rows (hundreds to thousands) and a row between, one chunk."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(4, 3000, generator=g, dtype=torch.float64)
    x[0] *= 8.0  # peaked: few tokens reach p
    x[1] *= 0.2  # nearly flat: most of the vocabulary
    x[2] *= 1.5
    for kw in (dict(top_p=0.9), dict(top_p=0.5, temperature=0.7)):
        got = _kept_by_tau(x, sampling_threshold(x, **kw))
        want = kept_set_reference(x, **kw)
        assert torch.equal(got, want), kw
    counts = _kept_by_tau(x, sampling_threshold(x, top_p=0.9)).sum(-1)
    assert counts[0] < 256 < 1024 < counts[1]  # rows that finish in different rounds


def _wide_rows(dtype):
    """Rows whose kept prefix runs past the largest 256 logits (top-p walks a histogram of the
    mass there), and the hard cases of that walk, 3000 logits each."""
    g = torch.Generator().manual_seed(7)
    v = 3000
    n = lambda: torch.randn(v, generator=g, dtype=torch.float64)
    rows = [
        2.0 * n(),  # high entropy: thousands kept
        1.0 + 1e-6 * torch.rand(v, generator=g, dtype=torch.float64),  # within 1e-6: ties in fp32
        1e-6 * n(),  # within 1e-6, distinct
        torch.where(torch.arange(v) == 17, 30.0, 0.1 * n()),  # one-hot-like
        torch.where(torch.arange(v) % 2 == 0, 2.0 * n(), -math.inf),  # half −inf
        torch.round(8.0 * n()) / 4.0,  # a coarse grid: ties at (and across) bucket edges
        torch.where(torch.arange(v) < 1500, 2.0 * n(), -1e9),  # a −1e9 mask
        torch.zeros(v, dtype=torch.float64),  # all equal
        40.0 * n(),  # a range wider than the histogram's
    ]
    return torch.stack(rows).to(dtype)


WIDE_SETTINGS = [
    dict(top_p=0.9),
    dict(top_p=0.5, temperature=2.0),
    dict(top_p=0.999999),  # the last kept token far in the tail
    dict(top_k=1000, top_p=0.95),  # top-k wider than the sorted candidates, then top-p
    dict(top_k=2000, top_p=0.9, min_p=0.001, temperature=0.7),
]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_top_p_on_wide_rows_matches_the_reference(dtype, backend):
    x = _wide_rows(dtype)
    for kw in WIDE_SETTINGS:
        tau = sampling_threshold(x, **kw, backend=backend)
        got = _kept_by_tau(x, tau)
        want = kept_set_reference(x, **kw)
        bad = (got != want).any(-1).nonzero().flatten().tolist()
        assert not bad, (kw, bad, got.sum(-1).tolist(), want.sum(-1).tolist())
    counts = _kept_by_tau(x, sampling_threshold(x, top_p=0.9, backend=backend)).sum(-1)
    assert counts[0] > 2 * 256 and counts[7] == 3000  # past the sorted candidates


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_top_p_on_wide_rows_of_nan_and_minus_inf(backend):
    x = _wide_rows(torch.float32)[:3].clone()
    x[1, 5] = float("nan")
    x[2] = float("-inf")
    for kw in (dict(top_p=0.9), dict(top_k=1000, top_p=0.9)):
        tau = sampling_threshold(x, **kw, backend=backend)
        assert math.isnan(tau[1].item()) and tau[2].item() == float("-inf"), kw
        assert torch.equal(_kept_by_tau(x[0], tau[0]), kept_set_reference(x[0], **kw)), kw


def test_portable_top_p_in_row_chunks():
    """The portable rule's histogram walk, a chunk of rows at a time, and with the rows that the
    sorted candidates settle mixed in (a peaked row)."""
    x = _wide_rows(torch.float32)
    x[3] *= 4.0
    full = threshold_rows(x, None, 0.9, None, 1.0, None, LOCAL)
    for rows in (1, 2, 4):
        assert torch.equal(threshold_rows(x, None, 0.9, None, 1.0, rows, LOCAL), full)
    want = kept_set_reference(x, top_p=0.9)
    assert torch.equal(_kept_by_tau(x, full), want)


def test_temperature_is_applied_first():
    x, _ = make_logits((6, 40), seed=2, scale=2.0)
    cold = _kept_by_tau(x, sampling_threshold(x, top_p=0.8, temperature=0.5)).sum(-1)
    hot = _kept_by_tau(x, sampling_threshold(x, top_p=0.8, temperature=2.0)).sum(-1)
    assert torch.all(cold <= hot) and torch.any(cold < hot)


def test_ties_at_the_kth_logit_are_all_kept():
    x = torch.tensor([[5.0, 3.0, 1.0, 3.0, 3.0, -2.0]])
    tau = sampling_threshold(x, top_k=2)
    assert tau.item() == 3.0
    assert _kept_by_tau(x, tau).tolist() == [[True, True, False, True, True, False]]
    # min_p = 1: only the largest logit, and its ties
    y = torch.tensor([[4.0, 4.0, 1.0]])
    assert _kept_by_tau(y, sampling_threshold(y, min_p=1.0)).tolist() == [[True, True, False]]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_top_p_boundaries(backend):
    """Token j (in decreasing order) is kept iff the mass strictly before it is < p: exactly
    p drops it, the next float above keeps it, the one below drops it and keeps j − 1."""
    x = torch.tensor([[2.0, 0.5, 1.25, -1.0, 0.0, 0.9]], dtype=torch.float64)
    t = 0.8
    # the masses as the CPU threshold op forms them (a boundary this exact depends on the order
    # of the sums): exp(x/T − log Z), log Z = max + log Σ exp(x/T − max), the masses then
    # added in decreasing order. native: Σ in index order with the C library's exp; the
    # portable rule (streaming): the torch ops of ops/streaming/threshold.py on the row
    if backend == "native":
        scaled = [v / t for v in x[0].tolist()]
        m = max(scaled)
        z = 0.0
        for s in scaled:
            z += math.exp(s - m)
        log_z = m + math.log(z)
        before, acc = [], 0.0
        for s in sorted(scaled, reverse=True):
            before.append(acc)
            acc += math.exp(s - log_z)
        before = torch.tensor([before], dtype=torch.float64)
    else:
        scaled = x / t
        m = scaled.amax(-1, keepdim=True)
        log_z = m + torch.exp(scaled - m).sum(-1, keepdim=True, dtype=torch.float64).log()
        mass = torch.exp(scaled.sort(-1, descending=True).values - log_z).cumsum(-1)
        before = torch.cat([torch.zeros_like(mass[:, :1]), mass[:, :-1]], -1)
    j = 3
    p = before[0, j].item()  # the mass before the 4th largest logit
    def kept(top_p):
        tau = sampling_threshold(x, top_p=top_p, temperature=t, backend=backend)
        return int(_kept_by_tau(x, tau).sum())

    assert kept(p) == j
    assert kept(math.nextafter(p, 2.0)) == j + 1
    assert kept(math.nextafter(p, 0.0)) == j
    assert kept(before[0, j - 1].item()) == j - 1
    assert kept(1e-12) == 1  # at least one token
    assert kept(1.0) == 6


@pytest.mark.parametrize("backend", ["streaming", "native", "triton"])
def test_a_zero_threshold_is_plus_zero_on_every_backend(backend):
    """A last kept tie group holding +0 and −0 (in either order), or −0 alone: τ is +0 on every
    backend (each meets the group's zeros in its own order)."""
    op_backend(backend)
    x = torch.tensor([[2.0, 0.0, -0.0, -5.0], [2.0, -0.0, 0.0, -5.0], [-0.0, -0.0, -1.0, -2.0],
                      [-0.0, 0.0, -2.0, -3.0]])
    for kw in (dict(top_k=3), dict(top_k=2), dict(min_p=0.5), dict(top_k=1, top_p=0.5)):
        with backend_env(backend):
            tau = sampling_threshold(x, **kw, backend=backend)
        want = sampling_threshold(x, **kw, backend="streaming")
        assert torch.equal(tau, want) and not torch.signbit(tau[tau == 0]).any(), (kw, tau)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_keys_that_overflow_to_inf_hold_all_the_mass(backend):
    """Finite logits whose x/T overflows float32 (huge logits, a small T): the +inf keys form
    the top tie group and hold all the mass, so top-p keeps that group alone, after a top-k
    whose k-th key is −inf too (the sorted and the bucketed top-p alike)."""
    g = torch.Generator().manual_seed(9)
    x = torch.randn(2, 2049, generator=g) * 3e37
    x[0, :300] = 3e38
    x[1, ::7] = -3e38
    for kw in (dict(top_p=0.999), dict(top_k=2048, top_p=0.999), dict(top_k=100, top_p=0.5),
               dict(top_k=2048)):
        tau = sampling_threshold(x, **kw, temperature=1e-3, backend=backend)
        want = kept_set_reference(x, **kw, temperature=1e-3)
        assert torch.equal(_kept_by_tau(x, tau), want), kw


# ------------------------------------------------------- ties made by the temperature
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_a_tie_made_by_the_temperature_inside_the_top_p_prefix(backend):
    """Two distinct float32 logits whose x/0.7 round equal, the larger first in index order:
    the pair is one tie group, kept whole (the mass before it is 0), so τ is the smaller."""
    x = torch.tensor([[0.9999879598617554, 0.9999880194664001, -5.0]])
    y = torch.tensor([[0.3, -0.2, 0.1]])
    kw = dict(top_p=0.7, temperature=0.7)
    keys = sampler_keys(x, 0.7)
    assert x[0, 0] < x[0, 1] and keys[0, 0] == keys[0, 1]
    tau = sampling_threshold(x, **kw, backend=backend)
    assert tau.item() == x[0, 0].item()
    kept = _kept_by_tau(x, tau)
    assert kept.tolist() == [[True, True, False]]
    assert torch.equal(kept, kept_set_reference(x, **kw))
    want = full_kl_reference(torch.where(kept, x.double(), -math.inf), y, 0.7)  # 0.4709
    got = klp.full_kl(x, y, **kw, backend=backend)
    torch.testing.assert_close(got.double(), want, **tol(torch.float32))
    lp = klp.token_logprobs(x, torch.tensor([0]), **kw, backend=backend)
    torch.testing.assert_close(lp.double(), torch.tensor([math.log(0.5)], dtype=torch.float64),
                               **tol(torch.float32))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("vocab", [8, 50, 300, 4096, 32000])
def test_ties_made_by_the_temperature_are_kept_whole(vocab, backend):
    """Rows holding two adjacent float32 logits whose keys x/T round equal, at the top-p
    boundary, inside the prefix, as top-k's k-th and at the min-p boundary (sorted candidates,
    the histogram walk of wide rows, the native kernel's bracket): the kept set of the float64
    rule with the keys' rounding, τ its smallest logit, the same τ from every CPU backend; the
    KL on it against float64 (rows of at most 300)."""
    for x, kw in temperature_tie_cases(vocab, seed=vocab):
        want = kept_set_reference(x, **kw)
        if not ("top_k" in kw and "top_p" in kw):  # the pair is kept (the last kept group)
            kept_keys = sampler_keys(x[want], kw["temperature"])
            assert kept_keys.unique().numel() < x[want].unique().numel(), kw
        tau = sampling_threshold(x, **kw, backend=backend)
        assert torch.equal(_kept_by_tau(x, tau), want), kw
        assert tau.item() == x[want].min().item(), kw
        assert torch.equal(tau, sampling_threshold(x, **kw, backend="streaming")), kw
        if vocab <= 300:
            y = x + 0.5 * torch.randn(x.shape, generator=torch.Generator().manual_seed(vocab))
            ref = full_kl_reference(torch.where(want, x.double(), -math.inf), y,
                                    kw["temperature"])
            got = klp.full_kl(x, y, **kw, backend=backend)
            torch.testing.assert_close(got.double(), ref, **tol(torch.float32))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_logits_are_left_as_they_are(dtype, backend):
    """At T = 1 the keys are the logits themselves (no copy): no step writes into them."""
    x, _ = make_logits((4, 300), dtype, seed=5)
    before = x.clone()
    for t in (1.0, 0.7):
        for kw in (dict(min_p=0.05), dict(top_p=0.9), dict(top_k=5, top_p=0.8, min_p=0.05)):
            sampling_threshold(x, **kw, temperature=t, backend=backend)
            assert torch.equal(x, before), (t, kw)


def test_the_keys_are_the_float32_quotient():
    """The rule's keys: the IEEE float32 quotient by float32(T) (torch's x / T on CPU), exactly
    the logits at T = 1, float64 for float64 logits, bf16 upcast first."""
    x = torch.randn(1000, generator=torch.Generator().manual_seed(3)) * 4
    for t in (0.7, 1.3, 3.0):
        assert torch.equal(sampler_keys(x, t), x / t)
        assert torch.equal(sampler_keys(x.double(), t), x.double() / t)
        assert torch.equal(sampler_keys(x.bfloat16(), t), x.bfloat16().float() / t)
    assert torch.equal(sampler_keys(x, 1.0), x)


def test_min_p_boundary():
    """Kept iff k_v − k_max ≥ log(min_p) in float64 (π_v ≥ min_p·π_max on the keys)."""
    x = torch.tensor([[3.0, 2.0, 0.5, -4.0]], dtype=torch.float64)
    t = 1.3
    for j, want in ((1, 2), (2, 3)):
        ratio = min_p_boundary(x[0, j].item() / t - 3.0 / t)
        assert int(_kept_by_tau(x, sampling_threshold(x, min_p=ratio, temperature=t)).sum()) == want
        above = math.nextafter(ratio, 2.0)
        assert int(_kept_by_tau(x, sampling_threshold(x, min_p=above, temperature=t)).sum()) == want - 1


def test_nan_rows_keep_nothing_and_minus_inf_rows_are_safe():
    x = torch.randn(3, 9)
    x[1, 4] = float("nan")
    x[2] = float("-inf")
    tau = sampling_threshold(x, top_k=3, top_p=0.5)
    assert math.isnan(tau[1].item()) and tau[2].item() == float("-inf")
    assert torch.isfinite(tau[0])


def test_row_chunks_give_the_same_thresholds_and_o_chunk_memory():
    """The portable rule (the streaming backend's threshold op) walks rows in chunks."""
    x, _ = make_logits((32, 1024), seed=4)

    def portable(chunk_rows):
        return threshold_rows(x, 50, 0.9, 0.01, 1.0, chunk_rows, LOCAL)

    full = sampling_threshold(x, top_k=50, top_p=0.9, min_p=0.01, backend="streaming")
    assert torch.equal(portable(None), full) and torch.equal(portable(3), full)
    peak, largest = alloc_profile(lambda: portable(2))
    one_input = 32 * 1024 * 4
    assert largest <= 2 * 2 * 1024 * 8  # of the order of one float64 buffer of the chunk (sort)
    assert peak < one_input  # never a sort of the whole batch


# ------------------------------------------------------------------ compact kept sets
def _compact(kept: torch.Tensor):
    """(ids, offsets) of a (N, V) bool kept mask, in row order."""
    rows, ids = kept.nonzero(as_tuple=True)
    counts = torch.bincount(rows, minlength=kept.shape[0])
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])
    return ids, offsets


def test_compact_threshold_sets_become_tau():
    x, _ = make_logits((2, 3, 30), seed=5, scale=2.0)
    tau = sampling_threshold(x, top_k=6, top_p=0.8)
    ids, offsets = _compact(_kept_by_tau(x, tau).reshape(6, 30))
    keep, tau2 = support_from_ids(x, ids, offsets, chunk_rows=4)
    assert keep is None and torch.equal(tau2, tau)


def test_compact_sets_without_a_threshold_become_a_dense_mask():
    x = torch.tensor([[5.0, 3.0, 1.0, 3.0], [0.0, 1.0, 2.0, 3.0]])
    # row 0: a sampler broke the tie at 3.0 and kept only id 1; row 1: a non-threshold set
    ids, offsets = torch.tensor([0, 1, 3, 1]), torch.tensor([0, 2, 4])
    keep, tau = support_from_ids(x, ids, offsets)
    assert tau is None
    assert keep.tolist() == [[True, True, False, False], [False, True, False, True]]
    # an empty set keeps nothing (the row must be masked out)
    keep, tau = support_from_ids(x, torch.tensor([0]), torch.tensor([0, 1, 1]))
    assert keep is None and tau[1].item() == float("inf")


# ------------------------------------------------------------------ validation
def test_sampler_settings_are_validated():
    x = torch.randn(2, 5)
    for kw, err, match in (
        (dict(top_k=0), ValueError, "top_k must be >= 1"),
        (dict(top_k=2.0), TypeError, "top_k must be an int"),
        (dict(top_k=True), TypeError, "top_k must be an int"),
        (dict(top_p=0.0), ValueError, r"top_p must lie in \(0, 1\]"),
        (dict(top_p=1.5), ValueError, r"top_p must lie in \(0, 1\]"),
        (dict(top_p=float("nan")), ValueError, r"top_p must lie in \(0, 1\]"),
        (dict(top_p="0.9"), TypeError, "top_p must be a real number"),
        (dict(min_p=-0.1), ValueError, r"min_p must lie in \[0, 1\]"),
        (dict(min_p=2), ValueError, r"min_p must lie in \[0, 1\]"),
        (dict(temperature=0.0), ValueError, "temperature must be finite and > 0"),
    ):
        with pytest.raises(err, match=match):
            sampling_threshold(x, **kw)
    with pytest.raises(TypeError, match="logits must be a floating-point tensor"):
        sampling_threshold(torch.ones(2, 5, dtype=torch.long), top_k=1)


def test_support_is_validated():
    x = torch.randn(2, 3, 5)
    ids, offsets = torch.tensor([0, 1, 2, 3, 4, 0]), torch.tensor([0, 1, 2, 3, 4, 5, 6])
    keep, tau = resolve_support(x, (ids, offsets), None, None, None, 1.0)
    assert (keep is None) != (tau is None)
    bad = [
        (((ids, offsets), 3, None), ValueError, "support and top_k both given"),
        ((torch.ones(2, 3, 5), None, None), TypeError, r"support must be a bool tensor .* dtype=torch.float32"),
        ((torch.ones(2, 5, dtype=torch.bool), None, None), ValueError, r"shape of the policy logits \(2, 3, 5\), got shape=\(2, 5\)"),
        (((ids, offsets, ids), None, None), TypeError, "support must be a bool tensor .* or a pair"),
        (((ids.float(), offsets), None, None), TypeError, "support ids must be an integer tensor"),
        (((ids, offsets.view(1, -1)), None, None), ValueError, "support offsets must be 1-D"),
        (((ids, offsets[:-1]), None, None), ValueError, r"N \+ 1 = 7 entries \(N = 6 positions\)"),
        (((ids, offsets + 1), None, None), ValueError, "must start at 0 and end at len"),
        (((ids, torch.tensor([0, 2, 1, 3, 4, 5, 6])), None, None), ValueError, "non-decreasing"),
        (((ids + 1, offsets), None, None), ValueError, r"support ids must lie in \[0, 5\)"),
        (((list(ids), offsets), None, None), TypeError, "support ids must be a torch.Tensor"),
    ]
    for (support, top_k, top_p), err, match in bad:
        with pytest.raises(err, match=match):
            resolve_support(x, support, top_k, top_p, None, 1.0)
    # nothing cut: no support at all (NaN logits are still reported by the op)
    assert resolve_support(x, None, 5, 1.0, 0.0, 1.0) == (None, None)
    assert CHUNK_ELEMENTS >= 1 << 16
