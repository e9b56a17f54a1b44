"""The native CPU kernel against the float64 reference: the shared grid, −inf patterns, strides,
offsets, gradients, the error messages, the fallback path and the build cache.

Also run on the native kernel: the backend-parametrised tests of test_streaming.py, and the
fullgraph torch.compile step of test_engine.py (parametrised over the CPU backend)."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import klpenalty
from klpenalty._validation import compute_dtype
from klpenalty.ops import contract as ag
from klpenalty.ops import native, streaming
from klpenalty.ops.reference import (
    full_kl_reference,
    token_logprobs_reference,
    token_stats_reference,
)
from tests.helpers import DTYPES, grad_tol, make_logits, tol
from tests.helpers import views
from tests.ops.cases import (
    TOKEN_STATS_SCENARIOS,
    check_kl_and_grads,
    check_minus_inf_patterns,
    check_token_logprobs_and_grads,
    check_token_stats,
    ref_token_stats_grads,
)

NINF = float("-inf")
HAS_COMPILER = shutil.which(os.environ.get("CXX", "c++")) is not None
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler: native cannot build")

# rows longer than one chunk of the kernel (2048) and than one vector block; V = 1; odd V
SHAPES = [((3,), 1), ((2, 3), 37), ((4,), 64), ((2, 2), 2048 + 37), ((3,), 9001)]


def _kl(x, y, mask=None, temperature=1.0, check=True):
    return views.native.full_kl(x, y, mask, temperature, check=check)


def test_kernel_builds_where_a_compiler_exists():
    assert native.available()
    assert klpenalty.ops.dispatch.get_backend("auto", torch.device("cpu")).module is native
    assert native.isa() in ("AVX512", "AVX2", "DEFAULT")
    assert native.isa().lower() in native.build_name()
    assert native.status().startswith(f"native ({native.isa()})")


# --------------------------------------------------------------------------- reference grid
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("leading,vocab", SHAPES)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_full_kl_values_and_gradients_match_reference(dtype, leading, vocab, temperature):
    x, y = make_logits((*leading, vocab), dtype, seed=vocab)
    mask = torch.ones(leading, dtype=torch.bool)
    mask.view(-1)[-1] = False  # a masked row holding garbage
    x.view(-1, vocab)[-1] = NINF
    y.view(-1, vocab)[-1] = float("nan")
    x.requires_grad_()
    y.requires_grad_()
    check_kl_and_grads(_kl(x, y, mask, temperature), x, y, mask, temperature, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("leading,vocab", SHAPES)
def test_token_logprobs_values_and_gradients_match_reference(dtype, leading, vocab):
    x, _ = make_logits((*leading, vocab), dtype, seed=vocab + 1)
    x.requires_grad_()
    gen = torch.Generator().manual_seed(vocab)
    tokens = torch.randint(0, vocab, leading, generator=gen)
    tokens.view(-1)[0] = -100  # ignored position
    out = views.native.token_logprobs(x, tokens, 1.3, ignore_index=-100, check=True)
    check_token_logprobs_and_grads(out, x, tokens, 1.3, dtype)


def test_stats_match_the_streaming_op():
    """The KL engine's six stats columns (careful flags included) and the log-prob finish equal
    the streaming op's; the other columns hold 0 where not wanted."""
    assert native.available()  # loads the ops
    x, y = make_logits((5, 3000), torch.float32, seed=3)
    x[1, 7] = NINF  # policy −inf: the 0·log 0 arithmetic
    y[2, 9] = NINF  # reference −inf where the policy has mass: KL = +inf
    ops = torch.ops.klpenalty
    args = (x, y, None, None, None, None, 0.9, -100, ag.Want.KL, False, 0, 0, 0, 1.0, 0.0)
    out_n, st_n = ops.native_token_stats(*args)
    out_s, st_s = ops.streaming_token_stats(*args)
    torch.testing.assert_close(out_n[:, ag.OUT_KL], out_s[:, ag.OUT_KL], **tol(torch.float32))
    torch.testing.assert_close(st_n[:, :6], st_s[:, :6], atol=2e-6, rtol=1e-5)
    assert st_n[:, ag.ST_CAREFUL].tolist() == [0.0, 1.0, 1.0, 0.0, 0.0]
    assert torch.all(out_n[:, 1:] == 0) and torch.all(st_n[:, 6:ag.ST_TAU] == 0)
    assert torch.all(st_n[:, ag.ST_TAU] == NINF)  # no threshold
    tokens = torch.arange(5)
    args = (x, None, tokens, None, None, None, 0.9, -100, ag.Want.LOGP, False, 0, 0, 0, 1.0, 0.0)
    out_n, st_n = ops.native_token_stats(*args)
    out_s, st_s = ops.streaming_token_stats(*args)
    cols = [ag.ST_SHIFT_X, ag.ST_LOG_S_X, ag.ST_LOGP]
    torch.testing.assert_close(st_n[:, cols], st_s[:, cols], **tol(torch.float32))
    torch.testing.assert_close(out_n[:, ag.OUT_LOGP], out_s[:, ag.OUT_LOGP], **tol(torch.float32))


# --------------------------------------------------------------------------- −inf patterns
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [10, 2048 + 100])
def test_minus_inf_patterns(dtype, vocab):
    check_minus_inf_patterns(
        lambda a, b: _kl(a, b, check=False), vocab, dtype, [2, 7, vocab - 1]
    )


def test_hand_values_and_rows_without_a_distribution():
    t = torch.tensor
    assert _kl(t([[0.0, NINF]]), t([[0.0, 0.0]])).item() == pytest.approx(0.6931471805599453)
    assert _kl(t([[0.0, 0.0, NINF]]), t([[0.0, NINF, NINF]])).item() == float("inf")
    same = t([[1.0, NINF, -2.0, NINF]])
    assert _kl(same, same.clone()).item() == 0.0
    x, y = make_logits((3, 4, 77), torch.float32, seed=12)
    assert torch.all(_kl(x, x.clone(), temperature=0.3) == 0)  # exactly 0, bit for bit
    rows = torch.zeros(4, 5)
    rows[0] = NINF  # no policy mass
    rows[1, 2] = float("inf")
    rows[2, 3] = float("nan")
    kl = _kl(rows, torch.zeros(4, 5), check=False)
    assert torch.isnan(kl[:3]).all() and kl[3].item() == 0.0
    lp = views.native.token_logprobs(rows, torch.zeros(4, dtype=torch.long), 1.0, check=False)
    want = views.streaming.token_logprobs(rows, torch.zeros(4, dtype=torch.long), 1.0, check=False)
    torch.testing.assert_close(lp, want, equal_nan=True)


# --------------------------------------------------------------------------- strides, offsets
def test_non_contiguous_inputs_give_the_contiguous_results():
    x, y = make_logits((2, 6, 301), torch.float32, seed=21)
    layouts = [
        (x[:, :-1], y[:, :-1]),  # rows with a gap: leading strides only
        (x[..., :-1], y[..., :-1]),  # vocabulary slice: row stride V + 1
        (x.transpose(0, 1), y.transpose(0, 1)),
        (x.transpose(-1, -2).contiguous().transpose(-1, -2), y),  # last-dim stride ≠ 1: copied
    ]
    for a, b in layouts:
        want = _kl(a.contiguous(), b.contiguous())
        assert torch.equal(_kl(a, b), want)
        tokens = torch.zeros(a.shape[:-1], dtype=torch.long)
        got_lp = views.native.token_logprobs(a, tokens, 0.8)
        assert torch.equal(got_lp, views.native.token_logprobs(a.contiguous(), tokens, 0.8))
    xs = x[:, :-1].clone().requires_grad_()
    view = xs[:, ::2]  # a strided view inside autograd
    (g,) = torch.autograd.grad(_kl(view, y[:, :3]).sum(), (xs,))
    (g_ref,) = torch.autograd.grad(_kl(view.contiguous(), y[:, :3]).sum(), (xs,))
    assert torch.equal(g, g_ref)


@pytest.mark.parametrize("offset_x,offset_y", [(1e4, -1e4), (-1e4, 1e4), (3e3, -50.0)])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_large_opposite_offsets_keep_float32_accuracy(offset_x, offset_y, temperature):
    x, y = make_logits((6, 3000), torch.float64, seed=17, scale=2.0)
    xs, ys = (x + offset_x).float(), (y + offset_y).float()
    want = full_kl_reference(xs, ys, temperature)  # on the same float32 values
    torch.testing.assert_close(_kl(xs, ys, temperature=temperature).double(), want, **tol(torch.float32))
    tokens = torch.arange(6)
    lp = views.native.token_logprobs(xs, tokens, temperature)
    torch.testing.assert_close(lp.double(), token_logprobs_reference(xs, tokens, temperature), **tol(torch.float32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_kl_stays_within_2e6_nats(dtype):
    """KL ≈ 12 at T = 0.7: float lanes summing a whole 2048-element chunk lost up to 4.4e-6
    nats (bf16); partial sums widened into double every 4 blocks keep it below 2e-6."""
    x, y = make_logits((16, 32000), torch.float64, seed=5, scale=5.0)
    y = x + 5.0 * (y - x) / 2.5  # noise of scale 5: KL ≈ 12
    x, y = x.to(dtype), y.to(dtype)
    want = full_kl_reference(x, y, 0.7)
    assert want.mean() > 8
    err = (_kl(x, y, temperature=0.7).double() - want).abs().max().item()
    assert err <= 2e-6


CHUNK = native.COMPUTE_FLOOR_TILE  # the kernel's chunk


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_one_pass_walk_where_a_later_chunk_raises_the_maximum(dtype):
    """Every chunk is walked against the row's running maxima (at first those of the row's first
    256 elements): a maximum that rises in the first chunk, a little (merged, then the state rescaled), by more than the bound (the chunk redone
    against its own maxima), far in y only, in the last partial chunk, after an all −inf first
    chunk, and at the last element; the KL, the token log-probs and the stats against the
    float64 reference and the streaming op."""
    v = 3 * CHUNK + 77
    x, y = make_logits((8, v), torch.float64, seed=31, scale=2.0)
    x[0, 1000] += 20.0  # above the maxima of the first 256 elements: the first chunk redone
    x[1, CHUNK + 5] += 1.5  # a small rise: within the bound
    x[2, 2 * CHUNK + 9] += 40.0  # far above: the chunk is redone
    y[3, CHUNK + 700] += 60.0  # in y only
    x[4, 3 * CHUNK + 50] += 25.0  # in the partial last chunk
    y[4, 3 * CHUNK + 51] -= 25.0
    x[5, :CHUNK] = NINF  # no running maximum after the first chunk: two passes again
    y[5, :CHUNK] = NINF
    x[6, -1] += 30.0
    y[6, -1] += 30.0
    x[7] = x[7] * 4.0 + 1e3  # big offsets, wide rows
    y[7] = y[7] * 4.0 - 1e3
    x, y = x.to(dtype), y.to(dtype)
    for temperature in (1.0, 0.7):
        want = full_kl_reference(x, y, temperature)
        torch.testing.assert_close(_kl(x, y, temperature=temperature).double(), want, **tol(dtype))
    tokens = torch.tensor([0, CHUNK + 5, 2 * CHUNK + 9, 3, 3 * CHUNK + 50, CHUNK + 1, v - 1, 9])
    out, stats = torch.ops.klpenalty.native_token_stats(
        x, y, tokens, None, None, None, 1.0, -100, int(ag.Want.KL | ag.Want.LOGP), False, 0, 0,
        0, 1.0, 0.0
    )
    _, stats_s = torch.ops.klpenalty.streaming_token_stats(
        x, y, tokens, None, None, None, 1.0, -100, int(ag.Want.KL | ag.Want.LOGP), False, 0, 0,
        0, 1.0, 0.0
    )
    torch.testing.assert_close(out[:, ag.OUT_LOGP].double(), token_logprobs_reference(x, tokens, 1.0), **tol(dtype))
    torch.testing.assert_close(stats[:, :6], stats_s[:, :6], atol=2e-6, rtol=1e-5)
    assert stats[5, ag.ST_CAREFUL].item() == 1.0  # the −inf first chunk needs 0·log 0 = 0 ...
    xg = x.clone().requires_grad_()
    (gx,) = torch.autograd.grad(_kl(xg, y).sum(), (xg,))
    assert torch.all(gx[5, :CHUNK] == 0) and torch.isfinite(gx).all()  # ... and its gradient 0
    # the log-probs alone keep the fast walk also for the row whose first chunk is −inf
    lp, _ = torch.ops.klpenalty.native_token_stats(
        x, None, tokens, None, None, None, 0.8, -100, int(ag.Want.LOGP), False, 0, 0, 0, 1.0, 0.0
    )
    torch.testing.assert_close(lp[:, ag.OUT_LOGP].double(), token_logprobs_reference(x, tokens, 0.8), **tol(dtype))


def test_one_pass_walk_hands_nan_and_inf_in_later_chunks_to_the_careful_paths():
    """A NaN or +inf logit in a later chunk (which the one-pass maxima do not keep) and a −inf
    reference entry there give what the streaming op gives."""
    x, y = make_logits((4, 2 * CHUNK + 3), torch.float32, seed=32)
    x[0, CHUNK + 3] = float("nan")
    y[1, 2 * CHUNK] = float("nan")
    x[2, CHUNK + 8] = float("inf")
    y[3, CHUNK + 9] = NINF  # KL = +inf
    args = (x, y, None, None, None, None, 1.0, -100, int(ag.Want.KL | ag.Want.ENTROPY), False, 0, 0, 0, 1.0, 0.0)
    out, stats = torch.ops.klpenalty.native_token_stats(*args)
    out_s, stats_s = torch.ops.klpenalty.streaming_token_stats(*args)
    torch.testing.assert_close(out, out_s, equal_nan=True)
    assert torch.isnan(out[:3, ag.OUT_KL]).all() and out[3, ag.OUT_KL].item() == float("inf")
    assert stats[3, ag.ST_CAREFUL].item() == 1.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_compute_floor_computes_the_kernels_sums(dtype):
    """The benchmark op runs the forward's arithmetic: per walk of the tile Σ e^(x − max x),
    Σ e^(y − max y), Σ e^(x − max x)·(x − max x − y + max y) and both maxima, for every count of
    chains, repeated ceil(pairs / n) times."""
    x, y = make_logits((CHUNK + 13,), dtype, seed=33)
    xd, yd = x.double(), y.double()
    dx, dy = xd - xd.max(), yd - yd.max()
    one = (dx.exp().sum() + dy.exp().sum() + (dx.exp() * (dx - dy)).sum() + xd.max() + yd.max())
    for chains in (1, 2, 4, 8):
        got = native.compute_floor(x, y, x.numel(), chains)
        assert got == pytest.approx(one.item(), rel=1e-6)
        assert native.compute_floor(x, y, 2 * x.numel() + 1, chains) == pytest.approx(3 * got, rel=1e-12)
    assert native.compute_floor(x, y, 0, 4) == 0.0
    with pytest.raises(ValueError, match="chains must be 1, 2, 4 or 8, got 3"):
        native.compute_floor(x, y, 10, 3)
    with pytest.raises(TypeError, match="y must have the dtype of x"):
        native.compute_floor(x, y.double(), 10, 4)
    with pytest.raises(ValueError, match=r"x must be a contiguous 1-D CPU tensor.*shape=\(2, 3\)"):
        native.compute_floor(x[:6].view(2, 3), y[:6].view(2, 3), 10, 4)


def test_mixed_dtypes_empty_batch_and_threads():
    x, y = make_logits((3, 4, 500), torch.float32, seed=2)
    xb = x.bfloat16().requires_grad_()
    y.requires_grad_()
    kl = _kl(xb, y)
    torch.testing.assert_close(kl.double(), full_kl_reference(xb.detach(), y.detach()), **tol(torch.float32))
    gx, gy = torch.autograd.grad(kl.sum(), (xb, y))
    assert gx.dtype == torch.bfloat16 and gy.dtype == torch.float32
    empty = torch.zeros(0, 7)
    assert _kl(empty, empty).shape == (0,)
    assert views.native.token_logprobs(empty, torch.zeros(0, dtype=torch.long), 1.0).shape == (0,)
    big_x, big_y = make_logits((64, 4096), torch.float32, seed=4)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _kl(big_x, big_y)
        torch.set_num_threads(2)
        two = _kl(big_x, big_y)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)  # rows are independent: the split cannot change a bit


# --------------------------------------------------------------------------- autograd
def test_gradcheck_in_float64():
    x, y = make_logits((4, 9), torch.float64, seed=9)
    x.requires_grad_()
    y.requires_grad_()
    mask = torch.tensor([True, False, True, True])
    assert torch.autograd.gradcheck(lambda a, b: _kl(a, b, mask, 0.7), (x, y), eps=1e-6, atol=1e-8)
    tokens = torch.tensor([0, 8, -100, 5])
    assert torch.autograd.gradcheck(
        lambda a: views.native.token_logprobs(a, tokens, 1.7), (x,), eps=1e-6, atol=1e-8
    )
    # double backward: the shared differentiable fallback
    assert torch.autograd.gradgradcheck(lambda a, b: _kl(a, b, mask, 0.7), (x, y), eps=1e-6, atol=1e-7)


# --------------------------------------------------------------------------- errors
def _message(fn):
    with pytest.raises(ValueError) as info:
        fn()
    return str(info.value)


@pytest.mark.parametrize("leading", [(), (2,), (2, 3)])
def test_check_errors_read_exactly_like_the_streaming_ones(leading):
    x, y = make_logits((*leading, 6), torch.float32, seed=1)
    bad_x = x.clone()
    bad_x.view(-1, 6)[-1, 2] = float("nan")
    bad_y = y.clone()
    bad_y.view(-1, 6)[-1, 0] = float("nan")
    no_mass = y.clone()
    no_mass.view(-1, 6)[-1] = NINF
    tokens = torch.zeros(leading, dtype=torch.long)
    tokens.view(-1)[-1] = 6
    cases = [
        lambda b: b.full_kl(bad_x, y, None, 1.0, check=True),
        lambda b: b.full_kl(x, bad_y, None, 1.0, check=True),
        lambda b: b.full_kl(x, no_mass, None, 1.0, check=True),
        lambda b: b.token_logprobs(bad_x, torch.zeros(leading, dtype=torch.long), 1.0, check=True),
        lambda b: b.token_logprobs(x, tokens.int(), 1.0, check=True),
    ]
    keep = torch.ones((*leading, 6), dtype=torch.bool)
    keep[..., 0] = False
    zeros = torch.zeros(leading, dtype=torch.long)  # token 0: outside the support everywhere
    cases += [
        lambda b: b.token_stats(x, y, zeros, None, keep, None, 1.0, want=15, check=True),
        lambda b: b.token_stats(bad_x, None, None, None, None, None, 1.0, want=8, check=True),
        lambda b: b.token_stats(x, bad_y, zeros, None, None, None, 1.0, want=4, check=True),
        lambda b: b.token_stats(x, y, tokens, None, keep, None, 1.0, want=2, check=True),
    ]
    for case in cases:
        assert _message(lambda: case(views.native)) == _message(lambda: case(views.streaming))
    # check=False: NaN in the result, no error; masked rows may hold anything
    assert torch.isnan(views.native.full_kl(bad_x, y, None, 1.0, check=False).view(-1)[-1])
    mask = torch.ones(leading, dtype=torch.bool)
    mask.view(-1)[-1] = False
    assert views.native.full_kl(bad_x, no_mass, mask, 1.0, check=True).view(-1)[-1].item() == 0.0


def test_ops_validate_their_arguments_when_called_directly():
    assert native.available()  # loads the ops
    x, y = make_logits((2, 5), torch.float32)
    op = torch.ops.klpenalty.native_token_stats
    tail = (1.0, -100, ag.Want.KL, False, 0, 0, 0, 1.0, 0.0)
    with pytest.raises(TypeError, match="policy_logits must be a floating-point"):
        op(x.long(), y, None, None, None, None, *tail)
    with pytest.raises(ValueError, match="same shape"):
        op(x, y[:, :4], None, None, None, None, *tail)
    with pytest.raises(ValueError, match="temperature must be finite and > 0"):
        op(x, y, None, None, None, None, 0.0, -100, ag.Want.KL, False, 0, 0, 0, 1.0, 0.0)
    with pytest.raises(TypeError, match="mask must be a bool tensor"):
        op(x, y, None, torch.ones(2), None, None, *tail)
    with pytest.raises(TypeError, match="keep must be a bool tensor"):
        op(x, y, None, None, torch.ones(2, 5), None, *tail)
    with pytest.raises(ValueError, match=r"keep must have the shape of the logits \(2, 5\)"):
        op(x, y, None, None, torch.ones(2, 4, dtype=torch.bool), None, *tail)
    with pytest.raises(TypeError, match="tau must be a float32 or float64 tensor"):
        op(x, y, None, None, None, torch.zeros(2, dtype=torch.long), *tail)
    with pytest.raises(ValueError, match=r"tau must have shape \(2,\)"):
        op(x, y, None, None, None, torch.zeros(3), *tail)
    with pytest.raises(ValueError, match="want must be a nonzero sum"):
        op(x, y, None, None, None, None, 1.0, -100, 16, False, 0, 0, 0, 1.0, 0.0)
    with pytest.raises(ValueError, match="but ref_logits is None"):
        op(x, None, torch.zeros(2, dtype=torch.long), None, None, None, *tail)
    with pytest.raises(ValueError, match="but tokens is None"):
        op(x, y, None, None, None, None, 1.0, -100, ag.Want.LOGP, False, 0, 0, 0, 1.0, 0.0)
    lp = (1.0, -100, ag.Want.LOGP, False, 0, 0, 0, 1.0, 0.0)
    with pytest.raises(TypeError, match="tokens must be an integer tensor"):
        op(x, None, torch.zeros(2), None, None, None, *lp)
    with pytest.raises(IndexError, match="out of range"):  # check=False never reads past a row
        op(x, None, torch.tensor([0, 5]), None, None, None, *lp)
    bwd = torch.ops.klpenalty.native_token_stats_backward
    _, stats = op(x, y, None, None, None, None, *tail)
    with pytest.raises(ValueError, match=r"grad must have shape \(2, 4\)"):
        bwd(torch.ones(2), x, y, None, None, stats, None, None, None, 1.0, -100, 1, True, True, 0, 0)
    with pytest.raises(ValueError, match=r"stats must have shape \(2, 10\)"):
        bwd(torch.ones(2, 4), x, y, None, None, stats[:, :6], None, None, None, 1.0, -100, 1, True, True, 0, 0)


# --------------------------------------------------------------------------- fallback, cache
def _run(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **env}
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, full_env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True, text=True, env=full_env, timeout=300, cwd=ROOT,
    )


_FALLBACK_CHILD = """
    import warnings
    import torch, klpenalty
    from klpenalty.ops import native
    from klpenalty.ops.reference import full_kl_reference
    from tests.helpers import make_logits, tol
    x, y = make_logits((3, 50), torch.float32, seed=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kl = klpenalty.full_kl(x, y)
        kl2 = klpenalty.full_kl(x, y, backend="native")
        lp = klpenalty.token_logprobs(x, torch.zeros(3, dtype=torch.long), backend="native")
    torch.testing.assert_close(kl.double(), full_kl_reference(x, y), **tol(torch.float32))
    assert torch.equal(kl, kl2) and lp.shape == (3,)
    mine = [w for w in caught if "native CPU kernel" in str(w.message)]
    assert len(mine) == 1 and mine[0].category is RuntimeWarning, [str(w.message) for w in caught]
    print("WARNING:", mine[0].message)
    print("STATUS:", native.status())
"""


# answers version queries like the real compiler, fails every compilation
_FAILING_CXX = """#!/bin/sh
case "$1" in --version|-v|-dumpversion|-dumpfullversion) exec c++ "$@";; esac
echo "token_stats.cpp:1:1: error: simulated compiler failure" >&2
exit 1
"""


@pytest.mark.parametrize("missing", [True, False], ids=["no-compiler", "failed-build"])
def test_fallback_without_a_working_compiler_warns_once_and_matches(tmp_path, missing):
    if missing:
        cxx, reasons = "/nonexistent/c++", ["no C++ compiler: '/nonexistent/c++' not found"]
    else:
        cxx = str(tmp_path / "failing-c++")
        with open(cxx, "w") as f:
            f.write(_FAILING_CXX)
        os.chmod(cxx, 0o755)
        reasons = ["the build failed: token_stats.cpp:1:1: error: simulated compiler failure"]
        reasons.append(f"full log in {tmp_path / 'ext'}")
    done = _run(_FALLBACK_CHILD, {"CXX": cxx, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")})
    assert done.returncode == 0, done.stderr
    assert all(reason in done.stdout for reason in reasons), done.stdout
    assert "pip install ninja" in done.stdout
    assert "STATUS: streaming (native unavailable" in done.stdout


def test_fallback_in_process_when_the_loader_fails(monkeypatch):
    def broken():
        raise RuntimeError("simulated build failure")

    monkeypatch.setattr(native, "_load", broken)
    monkeypatch.setattr(native, "_error", None)
    monkeypatch.setattr(native, "_warned", False)
    x, y = make_logits((2, 40), torch.float32, seed=3)
    with pytest.warns(RuntimeWarning, match="simulated build failure") as record:
        kl = views.native.full_kl(x, y, None, 1.0)
        lp = views.native.token_logprobs(x, torch.tensor([1, 2]), 1.0)
        out = views.native.token_stats(x, y, torch.tensor([1, 2]), None, None, None, 1.0, want=15)
    assert len(record) == 1
    want = views.streaming.token_stats(x, y, torch.tensor([1, 2]), None, None, None, 1.0, want=15)
    assert torch.equal(out, want)
    assert torch.equal(kl, views.streaming.full_kl(x, y, None, 1.0))
    assert torch.equal(lp, views.streaming.token_logprobs(x, torch.tensor([1, 2]), 1.0))
    assert klpenalty.ops.dispatch.get_backend("auto", torch.device("cpu")).module is streaming


_LOAD_CHILD = """
    import time, torch
    import klpenalty
    from klpenalty.ops import native
    t0 = time.perf_counter()
    ok = native.available()
    print("LOAD", ok, time.perf_counter() - t0)
    x = torch.randn(2, 3000, generator=torch.Generator().manual_seed(0))
    print("KL", klpenalty.full_kl(x, 0.5 * x, backend="native").tolist())
"""


@pytest.mark.build
def test_cold_build_then_a_second_process_loads_from_the_cache(tmp_path, monkeypatch):
    """A fresh cache (with a stale lock left by a killed build): one process compiles, printing
    one line; the next loads the cached library in well under a second, without compiling."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    directory = native.build_dir()
    directory.mkdir(parents=True)
    lock = directory / "lock"
    lock.touch()
    old = time.time() - 2 * native.STALE_LOCK_SECONDS
    os.utime(lock, (old, old))
    env = {"TORCH_EXTENSIONS_DIR": str(tmp_path)}
    cold = _run(_LOAD_CHILD, env)
    assert cold.returncode == 0, cold.stderr
    assert cold.stderr.count("klpenalty: compiling the native CPU kernel") == 1
    assert "LOAD True" in cold.stdout
    warm = _run(_LOAD_CHILD, env)
    assert warm.returncode == 0, warm.stderr
    assert "compiling" not in warm.stderr
    load_s = float(warm.stdout.split("LOAD True ")[1].split()[0])
    assert load_s < 1.0
    assert warm.stdout.split("KL")[1] == cold.stdout.split("KL")[1]


# --------------------------------------------------------------------------- token_stats
ALL = ag.Want.KL | ag.Want.LOGP | ag.Want.REF_LOGP | ag.Want.ENTROPY


def _check_stats(x, y, tokens, mask, keep, tau, temperature, want, dtype, check=True):
    """views.native.token_stats against float64: values (wanted columns, 0 elsewhere), and the
    gradients of a non-unit upstream gradient, through the float64 reference.
    Returns (out, gx, gy)."""
    out = views.native.token_stats(
        x, y, tokens, mask, keep, tau, temperature, ignore_index=-100, want=want, check=check
    )
    assert out.shape == (*x.shape[:-1], 4)
    assert out.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    want_out = token_stats_reference(x, y, tokens, mask, keep, tau, temperature, -100, want)
    torch.testing.assert_close(out.double(), want_out, **tol(dtype))
    g = torch.linspace(-1.5, 2.0, out.numel()).reshape(out.shape)
    inputs = (x, y) if y is not None else (x,)
    grads = torch.autograd.grad(out, inputs, g)
    wx, wy = ref_token_stats_grads(x, y, tokens, mask, keep, tau, temperature, -100, want, g)
    torch.testing.assert_close(grads[0].double(), wx, **grad_tol(dtype))
    if y is not None:
        torch.testing.assert_close(grads[1].double(), wy, **grad_tol(dtype))
    return out, *grads


@pytest.mark.parametrize("scenario", TOKEN_STATS_SCENARIOS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_token_stats_shared_grid(dtype, scenario):
    def run(x, y, tokens, mask, keep, tau, temperature, want, **kw):
        return views.native.token_stats(x, y, tokens, mask, keep, tau, temperature, want=want,
                                        **kw)

    assert native.available()
    check_token_stats(run, dtype, scenario=scenario)


def _top_k(x, k):
    """bool (..., V): the k largest logits of each row (ties at the k-th kept)."""
    kth = x.float().topk(k, -1).values[..., -1:]
    return x.float() >= kth


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("leading,vocab", [((2, 3), 37), ((3,), 2 * 2048 + 37)])
@pytest.mark.parametrize("support", ["none", "keep", "tau", "both"])
def test_token_stats_match_the_reference(dtype, leading, vocab, support):
    """All four columns and their gradients, with a masked garbage row, an ignored token, and
    the support as a mask, a threshold or both."""
    x, y = make_logits((*leading, vocab), dtype, seed=vocab)
    gen = torch.Generator().manual_seed(vocab)
    tokens = torch.randint(0, vocab, leading, generator=gen)
    keep = tau = None
    if support in ("keep", "both"):
        keep = _top_k(x, max(1, vocab // 3))
    if support in ("tau", "both"):
        tau = x.to(compute_dtype(x)).amax(-1) - 4.0  # min-p style: within 4 of the max
    kept = ag.kept_logits(x, keep, tau) > float("-inf")
    tokens = torch.where(kept.gather(-1, tokens.unsqueeze(-1)).squeeze(-1), tokens, x.argmax(-1))
    tokens.view(-1)[0] = -100
    mask = torch.ones(leading, dtype=torch.bool)
    mask.view(-1)[-1] = False  # a masked row holding garbage
    x.view(-1, vocab)[-1] = NINF
    y.view(-1, vocab)[-1] = float("nan")
    x.requires_grad_()
    y.requires_grad_()
    _, gx, gy = _check_stats(x, y, tokens, mask, keep, tau, 0.7, ALL, dtype)
    assert torch.all(gx.view(-1, vocab)[-1] == 0) and torch.all(gy.view(-1, vocab)[-1] == 0)
    if keep is not None or tau is not None:  # no gradient off the support
        assert torch.all(gx.detach()[~kept & mask.unsqueeze(-1)] == 0)


@pytest.mark.parametrize("want", [ag.Want.KL, ag.Want.LOGP, ag.Want.REF_LOGP, ag.Want.ENTROPY,
                                  ag.Want.KL | ag.Want.ENTROPY, ag.Want.LOGP | ag.Want.REF_LOGP,
                                  ag.Want.REF_LOGP | ag.Want.ENTROPY])
def test_token_stats_each_instance_of_the_walker(want):
    """Every specialisation of the row walker (KL with/without entropy, entropy only, log-sum-exp
    only, y alone) and of the gradient row, with and without a support."""
    x, y = make_logits((4, 2048 + 100), torch.float32, seed=want)
    tokens = torch.tensor([3, -100, 2000, 2100])
    x.requires_grad_()
    y.requires_grad_()
    _check_stats(x, y, tokens, None, None, None, 1.3, want, torch.float32)
    keep = torch.ones_like(x, dtype=torch.bool)
    keep[:, 1000:1500] = False
    _check_stats(x, y, tokens, None, keep, None, 1.3, want, torch.float32)


def test_token_stats_fast_and_careful_paths_agree():
    """A support that keeps everything (the support walk's lane masks) gives the fast path's
    results and stats (nothing lies off it: not flagged careful), a support that drops an
    element is flagged careful, and a row whose −inf entries force the careful redo gives the
    results of the truncation that removes them."""
    x, y = make_logits((6, 2 * 2048 + 300), torch.float32, seed=8)
    tokens = torch.arange(6) * 500
    fast = views.native.token_stats(x, y, tokens, None, None, None, 0.8, want=ALL)
    everything = torch.ones_like(x, dtype=torch.bool)
    low = torch.full((6,), -1e30)
    for keep, tau in [(everything, None), (None, low), (everything, low)]:
        careful = views.native.token_stats(x, y, tokens, None, keep, tau, 0.8, want=ALL)
        torch.testing.assert_close(careful, fast, **tol(torch.float32))
    _, st_fast = torch.ops.klpenalty.native_token_stats(x, y, tokens, None, None, None, 0.8, -100, ALL, False, 0, 0, 0, 1.0, 0.0)
    _, st_care = torch.ops.klpenalty.native_token_stats(x, y, tokens, None, everything, None, 0.8, -100, ALL, False, 0, 0, 0, 1.0, 0.0)
    assert torch.all(st_fast[:, ag.ST_CAREFUL] == 0) and torch.all(st_care[:, ag.ST_CAREFUL] == 0)
    torch.testing.assert_close(st_care[:, :ag.ST_TAU], st_fast[:, :ag.ST_TAU], atol=2e-6, rtol=1e-5)
    one_off = everything.clone()
    one_off[:, 7] = False
    _, st_off = torch.ops.klpenalty.native_token_stats(x, y, tokens, None, one_off, None, 0.8, -100, ALL, False, 0, 0, 0, 1.0, 0.0)
    assert torch.all(st_off[:, ag.ST_CAREFUL] == 1)
    # a −inf logit forces the careful redo: the same values as the truncation that removes it
    xi = x.clone()
    xi[:, 5] = NINF
    cut = torch.ones_like(x, dtype=torch.bool)
    cut[:, 5] = False
    a = views.native.token_stats(xi, y, tokens, None, None, None, 0.8, want=ALL)
    b = views.native.token_stats(x, y, tokens, None, cut, None, 0.8, want=ALL)
    torch.testing.assert_close(a, b, **tol(torch.float32))


def test_token_stats_support_crossing_chunks_and_top_k_ties():
    """V > 2 chunks, not a multiple of 2048: kept runs straddling the chunk borders, a chunk
    without any kept entry, and ties at the k-th logit (all kept)."""
    vocab = 3 * 2048 + 51
    x, y = make_logits((3, vocab), torch.float32, seed=31)
    keep = torch.zeros(3, vocab, dtype=torch.bool)
    keep[0, 2000:2100] = True  # across the first border
    keep[0, 4090:4100] = True  # across the second
    keep[1, 6100:] = True  # only in the last, partial chunk
    x[2, [10, 3000, 6150]] = 30.0  # a three-way tie at the top: top-2 keeps all three
    keep[2] = _top_k(x[2], 2)
    assert keep[2].sum() == 3
    tokens = torch.tensor([2050, 6143, 3000])
    x.requires_grad_()
    y.requires_grad_()
    out, gx, _ = _check_stats(x, y, tokens, None, keep, None, 1.0, ALL, torch.float32)
    assert torch.all(gx[~keep] == 0)
    assert out[2, ag.OUT_LOGP].item() == pytest.approx(-math.log(3), abs=1e-6)


def test_token_stats_threshold_above_every_logit():
    """tau above the row's maximum: an empty support. Masked: 0 and zero gradients, no error
    with check=True; counted: NaN (check=False) or the no-distribution ValueError."""
    x, y = make_logits((3, 300), torch.float32, seed=2)
    tau = x.amax(-1) - 1.0
    tau[1] = x[1].max() + 1.0
    mask = torch.tensor([True, False, True])
    tokens = x.argmax(-1)
    x.requires_grad_()
    y.requires_grad_()
    out, gx, gy = _check_stats(x, y, tokens, mask, None, tau, 1.0, ALL, torch.float32)
    assert torch.all(out[1] == 0) and torch.all(gx[1] == 0) and torch.all(gy[1] == 0)
    counted = views.native.token_stats(x, y, tokens, None, None, tau, 1.0, want=ALL, check=False)
    assert torch.isnan(counted[1, [ag.OUT_KL, ag.OUT_LOGP, ag.OUT_ENTROPY]]).all()
    with pytest.raises(ValueError, match="the result is NaN in 1 counted position"):
        views.native.token_stats(x, y, tokens, None, None, tau, 1.0, want=ALL, check=True)


def test_token_stats_token_outside_the_support_raises():
    x, y = make_logits((2, 3, 50), torch.float32, seed=4)
    keep = _top_k(x, 5)
    tokens = x.argmax(-1)
    tokens[1, 2] = (~keep[1, 2]).nonzero()[0, 0]  # a token the sampler could not have drawn
    kw = dict(want=ag.Want.KL | ag.Want.LOGP)
    with pytest.raises(ValueError, match=r"sampled token \d+ at position \(1, 2\) is outside the support"):
        views.native.token_stats(x, y, tokens, None, keep, None, 1.0, check=True, **kw)
    out = views.native.token_stats(x, y, tokens, None, keep, None, 1.0, check=False, **kw)
    assert out[1, 2, ag.OUT_LOGP].item() == float("-inf")
    mask = torch.ones(2, 3, dtype=torch.bool)
    mask[1, 2] = False  # masked, or ignored: no error
    views.native.token_stats(x, y, tokens, mask, keep, None, 1.0, check=True, **kw)
    tokens[1, 2] = -100
    views.native.token_stats(x, y, tokens, None, keep, None, 1.0, check=True, **kw)


def test_token_stats_threads_give_identical_bits():
    x, y = make_logits((64, 4096 + 7), torch.float32, seed=4)
    keep = _top_k(x, 900)
    tokens = x.argmax(-1)
    g = torch.linspace(-1.0, 1.0, 64 * 4).reshape(64, 4)

    def run():
        a, b = x.clone().requires_grad_(), y.clone().requires_grad_()
        out = views.native.token_stats(a, b, tokens, None, keep, None, 0.9, want=ALL)
        return (out, *torch.autograd.grad(out, (a, b), g))

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run()
        torch.set_num_threads(2)
        two = run()
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(p, q) for p, q in zip(one, two))  # rows are independent


def test_token_stats_fullgraph_compile():
    x, y = make_logits((2, 3, 300), torch.float32, seed=6)
    keep = _top_k(x, 40)
    tokens = x.argmax(-1)

    def step(a, b):
        out = views.native.token_stats(a, b, tokens, None, keep, None, 0.9, want=ALL)
        return (out * torch.tensor([1.0, -0.5, 0.25, 0.1])).sum()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    a, b = x.clone().requires_grad_(), y.clone().requires_grad_()
    loss = compiled(a, b)
    gc = torch.autograd.grad(loss, (a, b))
    a2, b2 = x.clone().requires_grad_(), y.clone().requires_grad_()
    ge = torch.autograd.grad(step(a2, b2), (a2, b2))
    torch.testing.assert_close(loss, step(x, y))
    assert all(torch.equal(p, q) for p, q in zip(gc, ge))


def test_token_stats_gradcheck_in_float64():
    x, y = make_logits((4, 9), torch.float64, seed=9)
    keep = torch.ones(4, 9, dtype=torch.bool)
    keep[:, 2] = False
    keep[0, 6:] = False
    tau = torch.tensor([-50.0, x[1].min().item() + 1e-3, -50.0, -50.0], dtype=torch.float64)
    tokens = torch.tensor([0, -100, 5, x[3].argmax().item()])
    mask = torch.tensor([True, True, False, True])
    x.requires_grad_()
    y.requires_grad_()

    def fn(a, b):
        return views.native.token_stats(a, b, tokens, mask, keep, tau, 0.7, want=ALL)

    assert torch.autograd.gradcheck(fn, (x, y), eps=1e-6, atol=1e-8)
