"""The policy entropy H(π) = −Σ π log π on every backend against the float64 reference:
dtypes, −inf entries, masked garbage rows, temperatures, V = 1, V above a tile/chunk, large
offsets, gradients (also second order), torch.compile, the empty batch and the NaN check."""

from __future__ import annotations

import pytest
import torch

import klpenalty
from klpenalty.ops import contract
from klpenalty.ops import dispatch, streaming
from klpenalty.ops.reference import entropy_reference
from tests.helpers import DTYPES, grad_tol, make_logits, tol
from tests.helpers import views

NINF = float("-inf")
BACKENDS = dispatch.device_backends(torch.device("cpu"))  # triton: tests/ops/test_triton.py

# V = 1; odd V; one vector block; V above the native chunk (2048) and with a ragged tail
SHAPES = [((3,), 1), ((2, 3), 37), ((4,), 64), ((2, 2), 2048 + 37), ((3,), 9001)]


def _ref_and_grad(x, mask, temperature, grad_out):
    """(H, ∂Σ grad_out·H/∂x) through the float64 reference; masked rows give 0 and no gradient."""
    xr = x.detach().double().requires_grad_()
    keep = torch.ones(x.shape[:-1], dtype=torch.bool) if mask is None else mask
    h = entropy_reference(torch.where(keep.unsqueeze(-1), xr, 0.0), temperature)
    h = torch.where(keep, h, 0.0)
    (g,) = torch.autograd.grad((h * grad_out.double()).sum(), xr)
    return h.detach(), g


def _out_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


# --------------------------------------------------------------------------- reference grid
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("leading,vocab", SHAPES)
@pytest.mark.parametrize("temperature", [1.0, 0.7, 2.5])
def test_values_and_gradients_match_reference(backend, dtype, leading, vocab, temperature):
    x, _ = make_logits((*leading, vocab), dtype, seed=vocab)
    mask = torch.ones(leading, dtype=torch.bool)
    mask.view(-1)[-1] = False  # a masked row holding garbage
    x.view(-1, vocab)[-1] = NINF
    x.requires_grad_()
    h = klpenalty.entropy(x, mask=mask, temperature=temperature, backend=backend)
    assert h.shape == leading and h.dtype == _out_dtype(dtype)
    grad_out = torch.linspace(-1.5, 2.0, mask.numel()).reshape(leading)
    want, want_grad = _ref_and_grad(x, mask, temperature, grad_out)
    torch.testing.assert_close(h.double(), want, **tol(dtype))
    assert torch.all(h >= 0) and h.view(-1)[-1].item() == 0.0
    (gx,) = torch.autograd.grad(h, x, grad_out)
    assert gx.dtype == dtype and gx.shape == x.shape
    torch.testing.assert_close(gx.double(), want_grad, **grad_tol(dtype))
    assert torch.all(gx.view(-1, vocab)[-1] == 0)
    if vocab == 1:  # one entry: π = 1, H = 0 and no gradient
        assert torch.all(h == 0) and torch.all(gx == 0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("vocab", [10, 2048 + 100])
def test_minus_inf_entries_contribute_nothing(backend, dtype, vocab):
    x, _ = make_logits((4, vocab), torch.float32, seed=5)
    pad = torch.zeros(vocab, dtype=torch.bool)
    pad[[2, 7, vocab - 1]] = True
    x = x.masked_fill(pad, NINF)  # shared −inf padding
    x[1, 3] = NINF
    x[2] = NINF  # one-hot by −inf: H = 0 exactly
    x[2, 5] = 4.0
    x = x.to(dtype).requires_grad_()
    h = klpenalty.entropy(x, temperature=0.8, backend=backend)
    assert h[2].item() == 0.0
    grad_out = torch.tensor([1.5, -0.5, 3.0, 2.0])
    want, want_grad = _ref_and_grad(x, None, 0.8, grad_out)
    torch.testing.assert_close(h.double(), want, **tol(dtype))
    (gx,) = torch.autograd.grad(h, x, grad_out)
    assert torch.isfinite(gx).all()
    assert torch.all(gx[:, pad] == 0) and gx[1, 3] == 0 and torch.all(gx[2] == 0)
    torch.testing.assert_close(gx.double(), want_grad, **grad_tol(dtype))


@pytest.mark.parametrize("backend", BACKENDS)
def test_hand_values(backend):
    x = torch.tensor([[0.0, 0.0, 0.0, 0.0], [5.0, NINF, NINF, NINF], [1.0, 1.0, NINF, NINF]])
    h = klpenalty.entropy(x, backend=backend)
    torch.testing.assert_close(h.double(), torch.tensor([4.0, 1.0, 2.0], dtype=torch.float64).log(), **tol(torch.float32))
    assert h[1].item() == 0.0
    # x/T with T = 0.5 is 2x; adding a constant to a row changes nothing
    torch.testing.assert_close(
        klpenalty.entropy(x + 3.0, temperature=0.5, backend=backend),
        klpenalty.entropy(x * 2.0, backend=backend),
        **tol(torch.float32),
    )


@pytest.mark.parametrize("vocab_chunk", [1, 7, 64, 300])
def test_streaming_tiles_smaller_than_a_row_match_reference(vocab_chunk):
    """Rows split into vocabulary tiles: the entropy states are merged across tiles."""
    x, _ = make_logits((3, 5, 301), torch.float32, seed=11, scale=4.0)
    x[0, 0, :150] = NINF  # whole tiles without mass, then mass
    x[1, 1, 200:] = NINF
    x.requires_grad_()
    h = views.streaming.entropy(x, None, 0.9, check=True, vocab_chunk=vocab_chunk, chunk_rows=4)
    grad_out = torch.linspace(-1.0, 2.0, 15).reshape(3, 5)
    want, want_grad = _ref_and_grad(x, None, 0.9, grad_out)
    torch.testing.assert_close(h.double(), want, **tol(torch.float32))
    (gx,) = torch.autograd.grad(h, x, grad_out)
    torch.testing.assert_close(gx.double(), want_grad, **grad_tol(torch.float32))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("offset", [1e4, -1e4])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_large_offsets_keep_float32_accuracy(backend, offset, temperature):
    """x + 1e4: the terms of H are of the size of the row's spread, not of its offset. The
    float64 entropy of the same float32 values is the truth."""
    base, _ = make_logits((4, 3000), torch.float32, seed=2, scale=5.0)
    x = (base + offset).requires_grad_()
    h = klpenalty.entropy(x, temperature=temperature, backend=backend, check=True)
    grad_out = torch.tensor([1.0, -2.0, 0.5, 3.0])
    want, want_grad = _ref_and_grad(x, None, temperature, grad_out)
    torch.testing.assert_close(h.double(), want, **tol(torch.float32))
    (gx,) = torch.autograd.grad(h, x, grad_out)
    torch.testing.assert_close(gx.double(), want_grad, **grad_tol(torch.float32))


@pytest.mark.parametrize("backend", BACKENDS)
def test_stats_match_across_backends(backend):
    """Every backend's token_stats op gives the streaming op's entropy and its stats columns
    shift, log s, E_π[u] (H = log s − E_π[u])."""
    x, _ = make_logits((5, 3000), torch.float32, seed=3)
    x[1, 7] = NINF
    if backend == "native" and not klpenalty.ops.native.available():
        pytest.skip("the native kernel is unavailable")
    args = (x, None, None, None, None, None, 0.9, -100, contract.Want.ENTROPY, False, 0, 0, 0, 1.0,
            0.0)
    cols = [contract.ST_SHIFT_X, contract.ST_LOG_S_X, contract.ST_MEAN_U]
    out, st = getattr(torch.ops.klpenalty, f"{backend}_token_stats")(*args)
    out_s, st_s = torch.ops.klpenalty.streaming_token_stats(*args)
    h, st, h_s, st_s = out[:, contract.OUT_ENTROPY], st[:, cols], out_s[:, contract.OUT_ENTROPY], st_s[:, cols]
    torch.testing.assert_close(h, h_s, **tol(torch.float32))
    torch.testing.assert_close(st, st_s, **tol(torch.float32))
    torch.testing.assert_close(st[:, 1] - st[:, 2], h, **tol(torch.float32))  # H = log s − E[u]


# --------------------------------------------------------------------------- derivatives
@pytest.mark.parametrize("backend", BACKENDS)
def test_gradcheck_and_gradgradcheck_in_float64(backend):
    x, _ = make_logits((3, 2, 9), torch.float64, seed=4)
    x[0, 1, 3] = NINF
    x.requires_grad_()
    mask = torch.tensor([[True, False], [True, True], [False, True]])

    def fn(a):
        return klpenalty.entropy(a, mask=mask, temperature=0.7, backend=backend)

    # −inf entries are not differentiable points for finite differences: check the others
    finite = x.detach().clone()
    finite[0, 1, 3] = -30.0
    finite.requires_grad_()
    torch.autograd.gradcheck(fn, (finite,))
    torch.autograd.gradgradcheck(fn, (finite,))
    (g,) = torch.autograd.grad(fn(x).sum(), x, create_graph=True)  # −inf entry: the where-guards
    assert torch.isfinite(g).all() and g[0, 1, 3] == 0 and g.grad_fn is not None


@pytest.mark.parametrize("backend", BACKENDS)
def test_hessian_vector_product_matches_reference(backend):
    x, _ = make_logits((4, 9), torch.float32, seed=6)
    x.requires_grad_()
    vec = torch.randn(4, 9, generator=torch.Generator().manual_seed(6))
    (g,) = torch.autograd.grad(
        klpenalty.entropy(x, temperature=1.3, backend=backend).sum(), x, create_graph=True
    )
    (hvp,) = torch.autograd.grad((g * vec).sum(), x)
    xr = x.detach().double().requires_grad_()
    (gr,) = torch.autograd.grad(entropy_reference(xr, 1.3).sum(), xr, create_graph=True)
    (want,) = torch.autograd.grad((gr * vec.double()).sum(), xr)
    torch.testing.assert_close(hvp.double(), want, **grad_tol(torch.float32))


# --------------------------------------------------------------------------- compile, edge cases
def _entropy_loss(logits, mask, backend):
    h = klpenalty.entropy(logits, mask=mask, temperature=0.9, backend=backend)
    return (h * torch.arange(1.0, h.numel() + 1).reshape(h.shape)).sum()


@pytest.mark.parametrize("backend", BACKENDS)
def test_fullgraph_compile_gives_the_same_numbers(backend):
    torch._dynamo.reset()
    x, _ = make_logits((2, 5, 33), torch.float32, seed=7)
    x[0, 1, :4] = NINF
    x.requires_grad_()
    mask = torch.tensor([[True] * 5, [False, True, True, True, False]])
    compiled = torch.compile(_entropy_loss, fullgraph=True, backend="aot_eager")
    got = compiled(x, mask, backend)
    (got_grad,) = torch.autograd.grad(got, x)
    want = _entropy_loss(x, mask, backend)
    (want_grad,) = torch.autograd.grad(want, x)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_grad, want_grad)
    ref_value, _ = _ref_and_grad(x, mask, 0.9, torch.zeros(2, 5))
    weights = torch.arange(1.0, 11.0, dtype=torch.float64).reshape(2, 5)
    torch.testing.assert_close(got.double(), (ref_value * weights).sum(), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_batch_gives_empty_result_and_gradient(backend):
    x = torch.randn(0, 4, 10, requires_grad=True)
    h = klpenalty.entropy(x, mask=torch.ones(0, 4, dtype=torch.bool), backend=backend)
    assert h.shape == (0, 4) and h.dtype == torch.float32
    (gx,) = torch.autograd.grad(h.sum(), x)
    assert gx.shape == x.shape


@pytest.mark.parametrize("backend", BACKENDS)
def test_check_raises_on_nan_and_check_false_returns_nan(backend):
    x, _ = make_logits((2, 3, 5), torch.float32, seed=8)
    x[1, 2, 4] = float("nan")
    with pytest.raises(ValueError, match=r"logits contains NaN .* the first at index \(1, 2\)"):
        klpenalty.entropy(x, backend=backend)
    h = klpenalty.entropy(x, backend=backend, check=False)
    assert torch.isnan(h[1, 2]) and torch.isfinite(h[0]).all() and torch.isfinite(h[1, :2]).all()
    mask = torch.ones(2, 3, dtype=torch.bool)
    mask[1, 2] = False  # masked NaN: 0, no error
    assert klpenalty.entropy(x, mask=mask, backend=backend)[1, 2].item() == 0.0
    x[1, 2] = NINF  # no distribution in a counted row
    with pytest.raises(ValueError, match="defines no distribution"):
        klpenalty.entropy(x, backend=backend)


def test_public_function_validates_its_arguments():
    x = torch.randn(2, 3, 5)
    with pytest.raises(TypeError, match="logits must be a floating-point tensor"):
        klpenalty.entropy(torch.zeros(2, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature"):
        klpenalty.entropy(x, temperature=0.0)
    with pytest.raises(ValueError, match="mask"):
        klpenalty.entropy(x, mask=torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="backend must be one of"):
        klpenalty.entropy(x, backend="triton-please")
    assert "entropy" in klpenalty.__all__
