"""The native kernel's sampler thresholds (``native_sampling_threshold`` and the forward's
``top_k`` / ``top_p`` / ``min_p``) against the float64 reference kept sets of
tests/test_sampling.py and the Python rule of klpenalty.sampling, and its support walk (keep read
as bytes, tau compared in the vector loads) against the float64 reference."""

from __future__ import annotations

import math
import os
import shutil

import pytest
import torch

from klpenalty.ops.streaming.threshold import LOCAL, threshold_rows
from klpenalty.bench import peaked_logits
from klpenalty.ops import native
from klpenalty.ops.contract import OUT_COLS, ST_TAU, STATS_COLS, Want
from klpenalty.ops.reference import token_stats_reference
from tests.helpers import grad_tol, make_logits, min_p_boundary, tol
from tests.ops.cases import ref_token_stats_grads
from klpenalty.ops.reference import kept_set_reference

HAS_COMPILER = shutil.which(os.environ.get("CXX", "c++")) is not None
pytestmark = pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler: native cannot build")

NINF = float("-inf")
ALL = int(Want.KL | Want.LOGP | Want.REF_LOGP | Want.ENTROPY)


@pytest.fixture(scope="module", autouse=True)
def _loaded():
    assert native.available()


def threshold(x, top_k=0, top_p=1.0, min_p=0.0, temperature=1.0):
    return torch.ops.klpenalty.native_sampling_threshold(x, top_k, top_p, min_p, temperature)


def python_rule(x, top_k=0, top_p=1.0, min_p=0.0, temperature=1.0):
    """klpenalty.sampling's τ on one process (the Python implementation of the rule)."""
    return threshold_rows(
        x, top_k or None, top_p if top_p < 1.0 else None, min_p or None, temperature, None,
        LOCAL,
    )


def kept_by(x, tau):
    return x.to(tau.dtype) >= tau.unsqueeze(-1)


def reference_kept(x, top_k=0, top_p=1.0, min_p=0.0, temperature=1.0):
    rows = x.reshape(-1, x.shape[-1])
    kw = dict(top_k=top_k or None, top_p=top_p, min_p=min_p, temperature=temperature)
    return kept_set_reference(rows, **kw).reshape(x.shape)


# top_k, top_p, min_p, temperature
SETTINGS = [
    (1, 1.0, 0.0, 1.0),
    (5, 1.0, 0.0, 1.0),
    (0, 0.3, 0.0, 1.0),
    (0, 0.9, 0.0, 0.5),
    (0, 0.9, 0.0, 2.0),
    (0, 1.0, 0.05, 1.0),
    (0, 1.0, 0.2, 1.7),
    (8, 0.6, 0.0, 1.0),
    (20, 0.95, 0.1, 0.8),
]


def _rows(kind, n, vocab, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, vocab, generator=g, dtype=torch.float64)
    if kind == "random":
        x = 2.0 * x
    elif kind == "peaked":  # one-hot-like: one logit far above the rest
        x[:, 0] += 30.0
    elif kind == "flat":  # all logits within 1e-6
        x = 1.0 + 1e-6 * torch.rand(n, vocab, generator=g, dtype=torch.float64)
    elif kind == "ties":  # few distinct values: ties at every boundary
        x = torch.randint(0, 4, (n, vocab), generator=g).double()
    elif kind == "minus_inf":
        x = 2.0 * x
        x[:, 1::3] = NINF  # (every row keeps finite logits: an all −inf row is its own case)
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("kind", ["random", "peaked", "flat", "ties", "minus_inf"])
@pytest.mark.parametrize("vocab", [1, 7, 50, 300, 2048 + 37])
def test_thresholds_match_the_reference(dtype, kind, vocab):
    x = _rows(kind, 3, vocab, dtype, seed=vocab)
    for k, p, mp, t in SETTINGS:
        tau = threshold(x, k if k < vocab else 0, p, mp, t)
        assert tau.shape == (3,)
        assert tau.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
        got = kept_by(x, tau)
        assert torch.equal(got, reference_kept(x, k, p, mp, t)), (k, p, mp, t)
        assert torch.equal(got, kept_by(x, python_rule(x, k, p, mp, t))), (k, p, mp, t)
        # τ is one of the row's logits, or −inf where nothing is cut
        is_logit = (x.to(tau.dtype) == tau.unsqueeze(-1)).any(-1)
        assert torch.all(is_logit | (tau == NINF))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_rows_top_p_and_large_top_k(dtype):
    """Rows of 32000 with top-p 0.9 on 2·N(0, 1) keep thousands (the bracket narrowed over
    several levels); top-k = V/2 (the unit-weight narrowing); both together."""
    x = _rows("random", 3, 32000, dtype, seed=7)
    for k, p, mp, t in [(0, 0.9, 0.0, 1.0), (16000, 1.0, 0.0, 1.0), (16000, 0.9, 0.0, 1.0),
                        (50, 0.9, 0.0, 1.0), (0, 0.5, 0.01, 0.7), (3000, 0.99, 0.0, 1.3)]:
        tau = threshold(x, k, p, mp, t)
        got = kept_by(x, tau)
        assert torch.equal(got, kept_by(x, python_rule(x, k, p, mp, t))), (k, p, mp, t)
        if (k, p) == (0, 0.9):
            assert torch.all(got.sum(-1) > 2000)
    assert torch.equal(kept_by(x[:1], threshold(x[:1], 0, 0.9)), reference_kept(x[:1], 0, 0.9))
    assert torch.equal(kept_by(x[:1], threshold(x[:1], 16000)), reference_kept(x[:1], 16000))


def test_top_p_where_the_sample_misleads():
    """top-p on long rows first looks at a sample of the row (every 16th vector, all of whose
    elements lie at positions i % 256 < 16); rows whose mass lies off the sample (and a sorted
    row) make its bracket wrong: the exact check sends them through the full narrowing, with the
    same result."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(3, 8192, generator=g, dtype=torch.float64)
    lanes = torch.arange(8192) % 256
    x[0, lanes >= 16] += 4.0  # the mass off the sampled vectors (float32: 16 per vector)
    x[1, lanes < 16] -= 6.0
    x[2] = torch.linspace(-8.0, 8.0, 8192, dtype=torch.float64)
    for dtype in (torch.float32, torch.bfloat16):
        xs = x.to(dtype)
        for p in (0.9, 0.5, 0.99):
            got = kept_by(xs, threshold(xs, 0, p))
            assert torch.equal(got, kept_by(xs, python_rule(xs, 0, p))), (dtype, p)
    assert torch.equal(kept_by(x[:2].float(), threshold(x[:2].float(), 0, 0.9)),
                       reference_kept(x[:2].float(), 0, 0.9))


def _p_near_a_group(x, p, t, rel=1e-6):
    """Per row: whether p lies within ``rel`` of a tie group's float64 cumulative mass (the
    rule's keys, the float32 quotients x/T): where klpenalty.sampling lets the backends' τ differ
    by that group (their sums' order decides)."""
    keys = (x.float() / torch.tensor(t, dtype=torch.float32)).double()
    near = []
    for k in keys:
        k = k[k > NINF].sort(descending=True).values
        groups, counts = torch.unique_consecutive(k, return_counts=True)
        mass = counts * torch.exp(groups - groups[0])
        before = torch.cumsum(mass, 0) / mass.sum()
        near.append(bool(((before - p).abs() <= rel * before.clamp_min(p)).any()))
    return torch.tensor(near)


def _one_group_apart(x, kept, want, t):
    """The two kept sets of each row are nested and differ in one tie group of the keys."""
    keys = x.float() / torch.tensor(t, dtype=torch.float32)
    for r in range(x.shape[0]):
        diff = kept[r] ^ want[r]
        if diff.any():
            both = kept[r] & want[r]
            nested = bool(torch.equal(both, kept[r]) or torch.equal(both, want[r]))
            assert nested and keys[r][diff].unique().numel() == 1, r


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_top_p_on_peaked_rows_where_the_sample_misses(dtype):
    """Top-p on long rows whose mass sits on few logits (4·N(0, 1), 2·Gumbel, a Zipf law: the
    sample of every 16th vector misses or over-weights their top logits): where the members'
    pass finds the crossing outside the sample's bracket (above it: the logits above its lower
    end become the members, from the masses the pass stored; below it or across: pass 1 reads
    those masses), τ is the Python rule's bit for bit and the kept sets the float64
    reference's, but where p lies within 1e-6 of a group's cumulative mass (there the two kept
    sets differ by at most that group)."""
    for vocab, seed in ((8192, 3), (32000, 4)):
        g = torch.Generator().manual_seed(seed)
        x = torch.cat([peaked_logits(k, 4, vocab, g) for k in ("4n", "gumbel", "zipf")])
        x = x.to(dtype)
        for p, t in ((0.9, 1.0), (0.5, 0.7), (0.99, 1.5), (0.95, 1.0)):
            tau = threshold(x, 0, p, 0.0, t)
            # bit for bit, but where p lies within 1e-6 of a group's cumulative mass (the
            # documented exception: float32 exponentials summed in float64 decide there)
            far = ~_p_near_a_group(x, p, t)
            assert torch.equal(tau[far], python_rule(x, 0, p, 0.0, t)[far]), (vocab, p, t)
            want = reference_kept(x, 0, p, 0.0, t)
            assert torch.equal(kept_by(x, tau)[far], want[far]), (vocab, p, t)
            _one_group_apart(x[~far], kept_by(x, tau)[~far], want[~far], t)
        # with top-k and min-p after it, and in the forward (the walk reads the stored masses)
        tau = threshold(x, 4000, 0.9, 0.01, 1.0)
        assert torch.equal(tau, python_rule(x, 4000, 0.9, 0.01, 1.0))
        y = torch.roll(x, 1, -1)
        tokens = x.float().argmax(-1)
        out, stats = _forward(x, y, None, None, 1.0, ALL, (0, 0.9, 0.0), tokens)
        used = stats[:, ST_TAU]
        assert torch.equal(used, python_rule(x, 0, 0.9))
        ref = token_stats_reference(x, y, tokens, None, None, used, 1.0, -100, ALL)
        torch.testing.assert_close(out.double(), ref, **tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_top_k_survivors_in_one_block_or_the_tail(dtype):
    """A small top-k reads only the 256-logit blocks whose lane maxima reach its lower bound
    (and the logits after the last whole block): the largest logits in one block, in the tail,
    spread over both, and ties across blocks give the reference's kept sets."""
    g = torch.Generator().manual_seed(5)
    vocab = 8 * 256 + 100
    x = torch.randn(4, vocab, generator=g, dtype=torch.float64)
    x[0, 3 * 256:3 * 256 + 40] += 10.0  # one block
    x[1, 8 * 256:] += 10.0  # the tail
    x[2, 8 * 256 + 90:] += 10.0  # ten in the tail, the rest anywhere
    x[2, 5 * 256 + 7] += 12.0
    x[3] = torch.randint(0, 3, (vocab,), generator=g).double()  # ties everywhere
    x[3, 8 * 256 + 5] = 3.0
    x = x.to(dtype)
    for k in (1, 5, 10, 20, 30):
        for p in (1.0, 0.8):
            got = kept_by(x, threshold(x, k, p))
            assert torch.equal(got, reference_kept(x, k, p)), (k, p)
            assert torch.equal(got, kept_by(x, python_rule(x, k, p))), (k, p)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_top_k_alone_from_the_lane_maxima(dtype):
    """top-k alone takes a block's logits >= its lower bound from the block's lane maxima where
    every lane's second largest lies below it, and reads the block again otherwise: a tied
    maximum in one lane (its second equals it), two large logits in one lane, in one block but
    different lanes, and random rows (most blocks not read again) give the reference's sets."""
    g = torch.Generator().manual_seed(11)
    vocab = 125 * 256 + 37
    x = 2.0 * torch.randn(6, vocab, generator=g, dtype=torch.float64)
    # 32 and 64 elements apart: one lane (of 8 or 16 float lanes per vector)
    x[1, 40 * 256 + 3] = x[1, 40 * 256 + 3 + 32] = 12.0  # one lane's tied maximum
    x[2, 7 * 256 + 5] = 11.0
    x[2, 7 * 256 + 5 + 64] = 10.5
    x[3, 9 * 256 : 9 * 256 + 16] += 9.0  # one block, several lanes
    x[4] = (x[4] * 2).round() / 2  # ties at every level
    x[5, -37:] += 10.0  # the tail alone
    x = x.to(dtype)
    for k in (1, 2, 3, 17, 50, 250):
        got = kept_by(x, threshold(x, k))
        assert torch.equal(got, reference_kept(x, k)), k
        assert torch.equal(got, kept_by(x, python_rule(x, k))), k


def test_nothing_cut_nan_inf_and_tiny_rows():
    x = torch.randn(5, 40)
    x[1, 7] = float("nan")
    x[2] = NINF
    x[3, 5] = float("inf")
    x[4, :] = 0.5  # all tied
    for args in [(0, 1.0, 0.0), (40, 1.0, 0.0), (100, 1.0, 0.0)]:  # nothing cut
        assert torch.equal(threshold(x, *args), torch.full((5,), NINF))
    for args in [(3, 1.0, 0.0), (0, 0.5, 0.0), (0, 1.0, 0.1), (3, 0.5, 0.1)]:
        tau = threshold(x, *args)
        assert math.isnan(tau[1].item()) and tau[2].item() == NINF
        assert tau[4].item() == 0.5 and torch.isfinite(tau[0])
        if args[1] < 1.0 or args[2] > 0.0:
            assert tau[3].item() == math.inf  # only the +inf logit
    one = torch.tensor([[1.5]])
    assert threshold(one, 0, 0.3, 0.0).item() == 1.5 and threshold(one, 0, 1.0, 1.0).item() == 1.5
    y = torch.tensor([[4.0, 4.0, 1.0, 4.0]])
    assert kept_by(y, threshold(y, 0, 1.0, 1.0)).tolist() == [[True, True, False, True]]
    assert kept_by(y, threshold(y, 2)).tolist() == [[True, True, False, True]]
    assert threshold(torch.zeros(0, 9), 2).shape == (0,)


def test_min_p_boundary():
    """Kept iff k_v − k_max ≥ log(min_p) (float64 keys x/T of float64 logits): the largest
    min_p whose log is ≤ the keys' difference keeps the token, the next float drops it."""
    x = torch.tensor([[3.0, 2.0, 0.5, -4.0]], dtype=torch.float64)
    t = 1.3
    for j, want in ((1, 2), (2, 3), (3, 4)):
        ratio = min_p_boundary(x[0, j].item() / t - 3.0 / t)
        assert int(kept_by(x, threshold(x, 0, 1.0, ratio, t)).sum()) == want
        above = math.nextafter(ratio, 2.0)
        assert int(kept_by(x, threshold(x, 0, 1.0, above, t)).sum()) == want - 1


def test_threshold_arguments_are_validated():
    x = torch.randn(2, 5)
    for args, err, match in [
        ((-1, 1.0, 0.0, 1.0), ValueError, "top_k must be >= 1"),
        ((0, 0.0, 0.0, 1.0), ValueError, r"top_p must lie in \(0, 1\]"),
        ((0, 1.5, 0.0, 1.0), ValueError, r"top_p must lie in \(0, 1\]"),
        ((0, 1.0, -0.1, 1.0), ValueError, r"min_p must lie in \[0, 1\]"),
        ((0, 1.0, 1.5, 1.0), ValueError, r"min_p must lie in \[0, 1\]"),
        ((1, 1.0, 0.0, 0.0), ValueError, "temperature must be finite and > 0"),
    ]:
        with pytest.raises(err, match=match):
            threshold(x, *args)
    with pytest.raises(TypeError, match=r"logits must be a floating-point tensor .*torch.int64"):
        threshold(torch.ones(2, 5, dtype=torch.long), 1)
    with pytest.raises(ValueError, match="top_p must lie in"):
        _forward(x, x, None, None, 1.0, ALL & ~int(Want.LOGP | Want.REF_LOGP), (0, 2.0, 0.0))


# --------------------------------------------------------------------------- the fused forward
def _forward(x, y, keep, tau, temperature, want, sampler=(0, 1.0, 0.0), tokens=None):
    return torch.ops.klpenalty.native_token_stats(
        x, y, tokens, None, keep, tau, temperature, -100, want, False, 0, 0, *sampler
    )


SAMPLERS = [(50, 1.0, 0.0), (0, 0.9, 0.0), (0, 1.0, 0.05), (50, 0.9, 0.0), (7, 0.8, 0.02)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_fused_forward_equals_the_forward_given_its_threshold(dtype):
    """ST_TAU is the threshold op's τ to the last bit, and out and stats are the forward's given
    that τ: to the last bit where the walk is the same (the sampler's few kept logits, walked
    sparsely either way), within the suite's tolerance for top-p alone on a large row (its walk
    reads the masses that the threshold computed, against the row's max from the start); with a
    keep mask and a tau as well, the support is keep ∧ x ≥ max(tau, τ_s)."""
    x, y = make_logits((2, 3, 2048 + 300), dtype, seed=3, scale=2.0)
    tokens = x.argmax(-1)
    want = ALL
    g = torch.Generator().manual_seed(1)
    keep = torch.rand(x.shape, generator=g) > 0.2
    keep |= x == x.amax(-1, keepdim=True)  # the sampled tokens stay in the support
    for sampler in SAMPLERS:
        tau_s = threshold(x, *sampler, 1.3)
        out, stats = _forward(x, y, None, None, 1.3, want, sampler, tokens)
        out0, stats0 = _forward(x, y, None, tau_s, 1.3, want, tokens=tokens)
        assert stats.shape == (2, 3, STATS_COLS) and out.shape == (2, 3, OUT_COLS)
        if sampler == (0, 0.9, 0.0) and dtype != torch.float64:  # the masses' walk
            torch.testing.assert_close(out, out0, **tol(dtype))
            torch.testing.assert_close(stats, stats0, **tol(dtype))
        else:
            assert torch.equal(out, out0) and torch.equal(stats, stats0)
        assert torch.equal(stats[..., ST_TAU], tau_s)
        # keep and a tau below τ_s in some rows, above in others
        tau = tau_s - torch.tensor([1.0, -0.5, 0.0]).to(tau_s.dtype)
        out, stats = _forward(x, y, keep, tau, 1.3, want, sampler, tokens)
        both = torch.maximum(tau, tau_s)
        out0, _ = _forward(x, y, keep, both, 1.3, want, tokens=tokens)
        assert torch.equal(out, out0) and torch.equal(stats[..., ST_TAU], both)
        ref = token_stats_reference(x, y, tokens, None, keep, both, 1.3, -100, want)
        torch.testing.assert_close(out.double(), ref, **tol(dtype))
    # no sampler: ST_TAU is the tau given, or −inf
    _, stats = _forward(x, y, None, None, 1.0, want, tokens=tokens)
    assert torch.all(stats[..., ST_TAU] == NINF)
    # a sampled token outside the sampler's support is reported with check=True
    bad = x.argmin(-1)
    with pytest.raises(ValueError, match=r"sampled token \d+ at position \(0, 0\) is outside"):
        torch.ops.klpenalty.native_token_stats(
            x, y, bad, None, None, None, 1.0, -100, want, True, 0, 0, 50, 1.0, 0.0
        )
    # a NaN threshold keeps nothing: the checks report it
    xn = x.clone()
    xn[0, 1, 5] = float("nan")
    with pytest.raises(ValueError, match="policy_logits contains NaN"):
        torch.ops.klpenalty.native_token_stats(
            xn, y, tokens, None, None, None, 1.0, -100, want, True, 0, 0, 0, 0.9, 0.0
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fused_forward_gradients(dtype):
    """The autograd of the op hands ST_TAU to the backward: gradients of the sampler-truncated
    policy against the float64 reference with that τ."""
    x, y = make_logits((3, 2048 + 37), dtype, seed=5, scale=2.0)
    tokens = x.argmax(-1)
    for sampler in [(20, 1.0, 0.0), (0, 0.8, 0.0), (10, 0.9, 0.05)]:
        xr, yr = x.clone().requires_grad_(), y.clone().requires_grad_()
        out, stats = _forward(xr, yr, None, None, 0.9, ALL, sampler, tokens)
        tau = stats[..., ST_TAU].detach()
        assert torch.equal(tau, threshold(x, *sampler, 0.9))
        grad = torch.linspace(-1.0, 2.0, out.numel()).reshape(out.shape).to(out.dtype)
        gx, gy = torch.autograd.grad(out, (xr, yr), grad)
        wx, wy = ref_token_stats_grads(x, y, tokens, None, None, tau, 0.9, -100, ALL, grad)
        torch.testing.assert_close(gx.double(), wx, **grad_tol(dtype))
        torch.testing.assert_close(gy.double(), wy, **grad_tol(dtype))


# --------------------------------------------------------------------------- the support walk
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [37, 2048 + 37, 5000])
def test_support_walk_keep_bytes_and_tau_lanes(dtype, vocab):
    """The one-pass walk with the support folded into its loads: a keep mask read as bytes (in
    memory order, also for bf16), a tau compared per lane (a float64 tau for float32 logits
    rounded up to the next float), a keep mask that drops a row's maximum, −inf logits kept
    by the mask (the careful redo): values and gradients against the float64 reference."""
    x, y = make_logits((4, vocab), dtype, seed=vocab, scale=2.0)
    g = torch.Generator().manual_seed(2)
    keep = torch.rand(x.shape, generator=g) > 0.5
    tokens = torch.zeros(4, dtype=torch.long)
    keep[:, 0] = True
    keep[1, x[1].argmax()] = False
    keep[1, 0] = True
    x = x.clone()
    x[2, 3::5] = NINF  # −inf logits, some of them kept
    x[2, 0] = 1.0
    tau64 = torch.tensor([-0.7, 0.1, -1.0, 0.3], dtype=torch.float64)
    tau64 = torch.minimum(tau64, x[:, 0].double())
    for keep_, tau_ in [(keep, None), (None, tau64), (keep, tau64), (None, tau64.float())]:
        xr, yr = x.clone().requires_grad_(), y.clone().requires_grad_()
        out, _ = _forward(xr, yr, keep_, tau_, 1.1, ALL, tokens=tokens)
        ref = token_stats_reference(x, y, tokens, None, keep_, tau_, 1.1, -100, ALL)
        torch.testing.assert_close(out.double(), ref, **tol(dtype))
        grad = torch.linspace(-1.0, 2.0, out.numel()).reshape(out.shape).to(out.dtype)
        gx, gy = torch.autograd.grad(out, (xr, yr), grad)
        wx, wy = ref_token_stats_grads(x, y, tokens, None, keep_, tau_, 1.1, -100, ALL, grad)
        torch.testing.assert_close(gx.double(), wx, **grad_tol(dtype))
        torch.testing.assert_close(gy.double(), wy, **grad_tol(dtype))


def _check_grads(out, xr, yr, x, y, tokens, tau, temperature, want, rows, dtype):
    """The gradients of out (rows `rows` weighted, the others 0) with respect to xr (and yr)
    against the float64 reference with the support x >= tau."""
    grad = torch.linspace(-1.0, 2.0, out.numel()).reshape(out.shape).to(out.dtype)
    grad[~rows] = 0
    got = torch.autograd.grad(out, (xr, yr) if yr is not None else (xr,), grad)
    wx, wy = ref_token_stats_grads(x, y, tokens, None, None, tau, temperature, -100, want, grad)
    torch.testing.assert_close(got[0][rows].double(), wx[rows], **grad_tol(dtype))
    if yr is not None:
        torch.testing.assert_close(got[1][rows].double(), wy[rows], **grad_tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [2048 + 37, 5000])
def test_few_kept_walk(dtype, vocab):
    """A support that keeps at most V/16 logits walks the row sparsely (the kept logits
    compressed, y walked alone, its kept columns gathered); one more kept logit takes the dense
    walk. Against the float64 reference, values and gradients, with y = −inf at a kept column
    (KL +inf) and at an unkept one, a +inf logit in x (NaN, as the reference), and without y
    (log-probs alone); the same sets as a keep mask and as (ids, offsets)."""
    n = 7
    x, y = make_logits((n, vocab), dtype, seed=vocab + 1, scale=2.0)
    x, y = x.clone(), y.clone()
    few = vocab // 16
    kth = [1, None, None, 50, 50, 3, 50]  # rows 1 and 2: below
    order = x.float().argsort(-1, descending=True)
    y[3, order[3, 10]] = NINF  # kept: KL +inf
    y[4, order[4, 200]] = NINF  # not kept
    x[5, order[5, 0]] = float("inf")  # the kept maximum +inf
    tau = torch.stack([x[r, order[r, (k or 1) - 1]].float() for r, k in enumerate(kth)])
    # rows 1 and 2: the smallest logit keeping at most `few` (ties counted), and the next below
    s = x[1].float().sort(descending=True).values
    kept_at = torch.searchsorted(-s, -s, right=True)  # logits >= s[j]
    j = int((kept_at <= few).nonzero().max())
    tau[1], tau[2] = s[j], s[int(kept_at[j])]
    x[2] = x[1]
    kept = x.float() >= tau.unsqueeze(-1)
    assert kept[1].sum() <= few < kept[2].sum()
    tokens = x.float().argmax(-1)  # kept in every row
    for want in (ALL, int(Want.LOGP | Want.ENTROPY)):
        yy = y if want == ALL else None
        xr = x.clone().requires_grad_()
        yr = yy.clone().requires_grad_() if yy is not None else None
        out, _ = _forward(xr, yr, None, tau, 0.8, want, tokens=tokens)
        fin = torch.tensor([r not in (3, 5) for r in range(n)])  # finite rows
        ref = token_stats_reference(x, yy, tokens, None, None, tau, 0.8, -100, want)
        torch.testing.assert_close(out.double(), ref, equal_nan=True, **tol(dtype))
        if want == ALL:
            assert out[3, 0] == float("inf") and torch.isfinite(out[4, 0])
        as_mask, _ = _forward(x, yy, kept, None, 0.8, want, tokens=tokens)
        torch.testing.assert_close(out, as_mask, equal_nan=True, **tol(dtype))
        # the same sets as (ids, offsets): their τ found in the forward's walk over their marks
        ids = kept.nonzero()[:, 1]
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), kept.sum(-1).cumsum(0)])
        by_ids, _ = torch.ops.klpenalty.native_token_stats(
            x, yy, tokens, None, None, None, 0.8, -100, want, False, 0, 0, 0, 1.0, 0.0, ids,
            offsets,
        )
        torch.testing.assert_close(out, by_ids, equal_nan=True, **tol(dtype))
        _check_grads(out, xr, yr, x, yy, tokens, tau, 0.8, want, fin, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [2048 + 37, 5000])
def test_top_p_walk_reads_the_threshold_masses(dtype, vocab):
    """Top-p on a large row stores every mass exp((x − M)/T) in its threshold pass (pass 1, or
    the sample's pass on rows of ≥ 4096 logits) and the forward's walk reads them instead of
    computing e^u: values and gradients against the float64 reference with the op's τ, with
    top-k's bound below (masses 0 under it), min-p above, a tau of the caller's above τ_s, y =
    −inf at a kept column (KL +inf: the careful redo) and without y (log-probs alone)."""
    n = 5
    x, y = make_logits((n, vocab), dtype, seed=vocab + 2, scale=2.0)
    y = y.clone()
    order = x.float().argsort(-1, descending=True)
    y[3, order[3, 5]] = NINF
    tokens = order[:, 0].clone()
    for sampler, T in [((0, 0.9, 0.0), 0.7), ((400, 0.95, 0.0), 1.0), ((0, 0.8, 0.01), 1.3)]:
        tau_s = threshold(x, *sampler, T)
        caller = tau_s.clone()
        caller[1] = x[1, order[1, 30]].float()  # above τ_s: keeps 31
        for tau in (None, caller):
            for want in (ALL, int(Want.LOGP | Want.ENTROPY)):
                yy = y if want == ALL else None
                xr = x.clone().requires_grad_()
                yr = yy.clone().requires_grad_() if yy is not None else None
                out, stats = _forward(xr, yr, None, tau, T, want, sampler, tokens)
                used = stats[..., ST_TAU].detach()
                want_tau = tau_s if tau is None else torch.maximum(tau_s, tau)
                assert torch.equal(used, want_tau)
                ref = token_stats_reference(x, yy, tokens, None, None, used, T, -100, want)
                torch.testing.assert_close(out.double(), ref, **tol(dtype))
                if want == ALL:
                    assert out[3, 0] == float("inf")
                fin = torch.tensor([r != 3 for r in range(n)])
                _check_grads(out, xr, yr, x, yy, tokens, used, T, want, fin, dtype)
