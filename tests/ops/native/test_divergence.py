"""The native second walk (``native_divergence`` and its backward, csrc/divergence.cpp) against
the streaming op: every kind × dtype × temperature on rows with −inf entries in x, in y and in
both, rows of −inf in one model, NaN entries and NaN rows (masked and not), V not a multiple of
the vector width; both backends against the float64 streaming op on the same values upcast
(tests/tolerances.py), the non-finite entries exactly where the streaming op has them, exact
zeros for identical inputs and for masked rows and rows without upstream gradient, leading
strides, mixed dtypes, many rows in parallel, and the argument errors."""

from __future__ import annotations

import math
import os
import shutil

import pytest
import torch

import klpenalty
from klpenalty._validation import compute_dtype
from klpenalty.ops import native
from klpenalty.ops.contract import Want, kept_mask
from klpenalty.ops.divergence import Divergence
from tests.helpers import DTYPES, grad_tol, tol

HAS_COMPILER = shutil.which(os.environ.get("CXX", "c++")) is not None
pytestmark = pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler: native cannot build")

OPS = torch.ops.klpenalty
KINDS = list(Divergence)
WIDTHS = [1, 7, 33, 1001]  # one entry, less than a vector, a vector pair and a tail, many
TEMPERATURES = [1.0, 0.7]
PARAM = 0.3
NINF, NAN = -math.inf, math.nan
ROWS = 10
MASKED = 7  # the row the mask drops (it holds NaN)


@pytest.fixture(scope="module", autouse=True)
def _built():
    assert native.available()


def _rows(vocab: int, dtype: torch.dtype, seed: int = 0):
    """(x, y, mask): ROWS rows of x = 2·N(0, 1), y = x + N(0, 1) with the edge patterns."""
    g = torch.Generator().manual_seed(seed + vocab)
    x = torch.randn(ROWS, vocab, generator=g, dtype=torch.float64) * 2
    y = x + torch.randn(ROWS, vocab, generator=g, dtype=torch.float64)
    x[1, ::3] = NINF  # the student without mass there
    y[2, 1::3] = NINF  # the teacher without mass there
    x[3, ::2] = NINF  # both without mass (and the teacher without more)
    y[3, ::2] = NINF
    y[3, 1::4] = NINF
    x[4] = NINF  # no student distribution
    y[5] = NINF  # no teacher distribution
    x[6, vocab // 2] = NAN
    x[MASKED] = NAN  # masked out: anything goes
    y[MASKED, 0] = NAN
    mask = torch.ones(ROWS, dtype=torch.bool)
    mask[MASKED] = False
    return x.to(dtype), y.to(dtype), mask


def _stats(backend, x, y, mask, temperature, keep=None, tau=None):
    """The backend's forward statistics (what klpenalty.divergence hands the second walk)."""
    op = getattr(OPS, f"{backend}_token_stats")
    return op(x, y, None, mask, keep, tau, temperature, -100, int(Want.KL), False, 0, 0, 0,
              1.0, 0.0)[1]


def _walk(backend, x, y, mask, temperature, kind, grad, keep=None, tau=None):
    """(value, ḡ, grad_x) of the backend's second walk on its own statistics (the student on
    the support keep / tau where given)."""
    stats = _stats(backend, x, y, mask, temperature, keep, tau)
    value, gbar = getattr(OPS, f"{backend}_divergence")(x, y, stats, mask, keep, tau,
                                                         temperature, kind, PARAM)
    gx = getattr(OPS, f"{backend}_divergence_backward")(grad.to(value.dtype), x, y, stats, gbar,
                                                        mask, keep, tau, temperature, kind,
                                                        PARAM)
    return value, gbar, gx


@pytest.mark.parametrize("vocab", WIDTHS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name.lower())
def test_both_backends_match_the_float64_op(kind, dtype, vocab):
    """Values and ḡ on every row (the non-finite ones equal), gradients on the rows whose value
    is finite (the others given no upstream gradient: exactly 0), against the float64 op."""
    x, y, mask = _rows(vocab, dtype)
    g = torch.Generator().manual_seed(5)
    for temperature in TEMPERATURES:
        x64, y64 = x.double(), y.double()
        v64, gb64, _ = _walk("streaming", x64, y64, mask, temperature, kind,
                             torch.zeros(ROWS, dtype=torch.float64))
        grad = torch.randn(ROWS, generator=g, dtype=torch.float64)
        grad = torch.where(torch.isfinite(v64), grad, 0.0)
        _, _, gx64 = _walk("streaming", x64, y64, mask, temperature, kind, grad)
        for backend in ("native", "streaming"):
            value, gbar, gx = _walk(backend, x, y, mask, temperature, kind, grad)
            assert value.dtype == gbar.dtype == compute_dtype(x, y)
            assert gx.dtype == dtype and gx.shape == x.shape
            where = f"{backend} {kind.name} {dtype} V={vocab} T={temperature}"
            torch.testing.assert_close(value.double(), v64, equal_nan=True, **tol(dtype),
                                       msg=lambda m: f"{where} value: {m}")
            torch.testing.assert_close(gbar.double(), gb64, equal_nan=True, **tol(dtype),
                                       msg=lambda m: f"{where} gbar: {m}")
            torch.testing.assert_close(gx.double(), gx64, **grad_tol(dtype),
                                       msg=lambda m: f"{where} grad: {m}")
            assert (gx[grad == 0] == 0).all()


def _non_finite(t):
    return torch.stack([t.isnan(), t.isposinf(), t.isneginf()])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name.lower())
def test_non_finite_entries_are_the_streaming_ops(kind, dtype):
    """NaN, +inf and −inf in the value, ḡ and every gradient entry exactly where the streaming
    op (same dtype, same statistics) has them, upstream gradient on every row but one."""
    for vocab in WIDTHS:
        x, y, mask = _rows(vocab, dtype, seed=1)
        for temperature in TEMPERATURES:
            for m in (None, mask):
                stats = _stats("native", x, y, m, temperature)
                args = (stats, m, None, None, temperature, kind, PARAM)
                vn, gn = OPS.native_divergence(x, y, *args)
                vs, gs = OPS.streaming_divergence(x, y, *args)
                grad = torch.randn(ROWS, generator=torch.Generator().manual_seed(2))
                grad[0] = 0.0
                bn = OPS.native_divergence_backward(grad, x, y, stats, gn, *args[1:])
                bs = OPS.streaming_divergence_backward(grad, x, y, stats, gs, *args[1:])
                for name, a, b in (("value", vn, vs), ("gbar", gn, gs), ("grad", bn, bs)):
                    where = f"V={vocab} T={temperature} mask={m is not None}"
                    assert torch.equal(_non_finite(a), _non_finite(b)), (
                        f"{name} {kind.name} {dtype} {where}")
                # NaN logits give NaN in counted rows; the student's −inf row has no mass
                assert vn[6].isnan() and (m is not None or vn[MASKED].isnan())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name.lower())
def test_masked_rows_and_rows_without_gradient_are_exactly_zero(kind, dtype):
    x, y, mask = _rows(1001, dtype, seed=2)
    stats = _stats("native", x, y, mask, 0.9)
    value, gbar = OPS.native_divergence(x, y, stats, mask, None, None, 0.9, kind, PARAM)
    assert value[MASKED] == 0 and gbar[MASKED] == 0  # NaN logits there
    grad = torch.ones(ROWS)
    grad[6] = 0.0  # NaN logits, no upstream gradient
    gx = OPS.native_divergence_backward(grad, x, y, stats, gbar, mask, None, None, 0.9, kind, PARAM)
    assert (gx[MASKED] == 0).all() and (gx[6] == 0).all()
    assert gx[6].isnan().sum() == 0 and gx[MASKED].isnan().sum() == 0


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name.lower())
def test_identical_models_give_exactly_zero(kind, dtype):
    """x = y (−inf entries included): every value is exactly 0, through the op and through
    klpenalty.divergence."""
    for vocab in (*WIDTHS, 5000):
        g = torch.Generator().manual_seed(vocab)
        x = (torch.randn(4, vocab, generator=g, dtype=torch.float64) * 3).to(dtype)
        if vocab > 1:
            x[1, ::3] = NINF
        for temperature in TEMPERATURES:
            stats = _stats("native", x, x, None, temperature)
            value, _ = OPS.native_divergence(x, x.clone(), stats, None, None, None, temperature,
                                             kind, PARAM)
            assert (value == 0).all(), (kind.name, dtype, vocab, temperature, value)
            public = klpenalty.divergence(x, x.clone(), kind.name.lower(),
                                          temperature=temperature, backend="native")
            assert (public == 0).all(), (kind.name, dtype, vocab, temperature, public)


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name.lower())
def test_strides_mixed_dtypes_and_many_rows(kind):
    """Rows at leading strides (a view dropping the last position), a bf16 student with a
    float32 teacher, and 3·150 rows of 1001 (several blocks of rows in parallel), against the
    float64 op."""
    g = torch.Generator().manual_seed(3)
    base = torch.randn(3, 151, 1001, generator=g) * 2
    x = base[:, :-1]  # leading strides, last dimension contiguous
    y = (base + torch.randn(base.shape, generator=g))[:, 1:]
    assert not x.is_contiguous()
    for xs, ys in ((x, y), (x.bfloat16(), y)):
        mask = torch.rand(xs.shape[:-1], generator=g) > 0.1
        grad = torch.randn(xs.shape[:-1], generator=g, dtype=torch.float64)
        v64, gb64, gx64 = _walk("streaming", xs.double(), ys.double(), mask, 0.8, kind, grad)
        value, gbar, gx = _walk("native", xs, ys, mask, 0.8, kind, grad)
        assert gx.dtype == xs.dtype and gx.is_contiguous()
        torch.testing.assert_close(value.double(), v64, **tol(xs.dtype))
        torch.testing.assert_close(gbar.double(), gb64, **tol(xs.dtype))
        torch.testing.assert_close(gx.double(), gx64, **grad_tol(xs.dtype))


@pytest.mark.parametrize("which", ["keep", "tau", "both"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name.lower())
def test_the_student_on_a_support_matches_the_float64_op(kind, dtype, which):
    """keep (not a threshold set: the largest logit of some rows dropped), the threshold of the
    12 largest (in the compute dtype), or both, on the edge rows (−inf entries in either model)
    at every width (the vectors' tail included): values and ḡ as the float64 op's (the
    non-finite ones equal), gradients too, exactly 0 off the support; rows without a kept
    entry or holding NaN give the float64 op's NaN."""
    for vocab in WIDTHS:
        x, y, mask = _rows(vocab, dtype, seed=4)
        g = torch.Generator().manual_seed(vocab)
        keep = tau = None
        if which != "tau":
            keep = torch.rand(x.shape, generator=g) < 0.6
            keep[:, -1] = True
        if which != "keep":
            xc = x.to(compute_dtype(x))
            tau = xc.nan_to_num(NINF).topk(min(12, vocab), -1).values[:, -1].contiguous()
        x64, y64 = x.double(), y.double()
        tau64 = None if tau is None else tau.double()  # the same values, compared as x.to(τ)
        v64, gb64, _ = _walk("streaming", x64, y64, mask, 0.7, kind, torch.zeros(ROWS), keep,
                             tau64)
        grad = torch.where(torch.isfinite(v64) | (kind == Divergence.FORWARD_KL),
                           torch.randn(ROWS, generator=g, dtype=torch.float64), 0.0)
        grad[6] = 0.0  # the NaN row
        _, _, gx64 = _walk("streaming", x64, y64, mask, 0.7, kind, grad, keep, tau64)
        value, gbar, gx = _walk("native", x, y, mask, 0.7, kind, grad, keep, tau)
        where = f"{kind.name} {dtype} V={vocab} {which}"
        torch.testing.assert_close(value.double(), v64, equal_nan=True, **tol(dtype),
                                   msg=lambda m: f"{where} value: {m}")
        torch.testing.assert_close(gbar.double(), gb64, equal_nan=True, **tol(dtype),
                                   msg=lambda m: f"{where} gbar: {m}")
        torch.testing.assert_close(gx.double(), gx64, equal_nan=True, **grad_tol(dtype),
                                   msg=lambda m: f"{where} grad: {m}")
        off = ~kept_mask(x, keep, tau)
        assert torch.all(gx[off] == 0), where


def test_argument_errors():
    x, y, mask = _rows(7, torch.float32)
    stats = _stats("native", x, y, mask, 1.0)
    with pytest.raises(ValueError, match="kind must be one of"):
        OPS.native_divergence(x, y, stats, mask, None, None, 1.0, 6, PARAM)
    with pytest.raises(ValueError, match="stats must have shape"):
        OPS.native_divergence(x, y, stats[:, :4], mask, None, None, 1.0, 1, PARAM)
    with pytest.raises(ValueError, match="same shape"):
        OPS.native_divergence(x, y[:, :5], stats, mask, None, None, 1.0, 1, PARAM)
    with pytest.raises(ValueError, match="temperature"):
        OPS.native_divergence(x, y, stats, mask, None, None, 0.0, 1, PARAM)
    with pytest.raises(ValueError, match="keep must have the shape"):
        OPS.native_divergence(x, y, stats, mask, torch.ones(10, 6, dtype=torch.bool), None, 1.0,
                              1, PARAM)
    with pytest.raises(TypeError, match="tau must be a float32"):
        OPS.native_divergence(x, y, stats, mask, None, torch.zeros(10, dtype=torch.long), 1.0,
                              1, PARAM)
    value, gbar = OPS.native_divergence(x, y, stats, mask, None, None, 1.0, 1, PARAM)
    with pytest.raises(ValueError, match="grad must have shape"):
        OPS.native_divergence_backward(value[:3], x, y, stats, gbar, mask, None, None, 1.0, 1,
                                       PARAM)
