"""The Triton backend against the float64 reference: the one-pass token_stats op on the shared
grid (tests/ops/cases.py: every want, supports by keep and tau, −inf patterns, checks), its
views full_kl / token_logprobs / entropy (dtypes, masks with garbage rows, temperatures,
strides, odd V and V = 1, the split-vocabulary forward, gradients with a non-unit upstream
gradient), torch.compile, the empty batch, the NaN check, dispatch, and a compilation of both
kernels for a CUDA target in every specialisation the library launches.

With a GPU the tensors live on it and the kernels run compiled; without one they run on CPU
tensors in Triton's interpreter (``TRITON_INTERPRET=1``, set by this module's fixture only, for
its own tests). Shapes are small: the interpreter runs each program in numpy.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import klpenalty
from klpenalty.ops import dispatch, streaming
from klpenalty.ops import triton as triton_backend
from klpenalty.ops.contract import Want
from klpenalty.ops.reference import entropy_reference, full_kl_reference
from klpenalty.ops.triton import threshold as th
from klpenalty.ops.triton import token_stats as ts
from tests.helpers import grad_tol, make_logits, temperature_tie_cases, tol, triton_interpreter_env
from tests.helpers import views
from tests.ops.cases import (
    TOKEN_STATS_SCENARIOS,
    check_kl_and_grads,
    check_minus_inf_patterns,
    check_token_logprobs_and_grads,
    check_token_stats,
    token_stats_case,
)

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
NINF = float("-inf")
LOW = [torch.float32, torch.bfloat16, torch.float16]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# tests/conftest.py imported Triton and the kernels under TRITON_INTERPRET=1 where no GPU exists
triton = pytest.importorskip("triton", reason="Triton is not installed: pip install 'klpenalty[triton]'")
tl = triton.language
from klpenalty.ops.triton import _kernels_threshold as kth  # noqa: E402 (imports Triton)

# the interpreter evaluates masked-off lanes too (−inf − −inf): numpy warns, the kernel guards
pytestmark = [
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning"),  # log 0
]


@pytest.fixture(scope="module", autouse=True)
def _interpreter_on_cpu():
    """Without a GPU: TRITON_INTERPRET=1 while this module's tests run (Triton reads it at run
    time too), and a clear failure if Triton was imported without it by someone else."""
    with triton_interpreter_env():
        if not CUDA and not triton_backend.interpreted():
            pytest.fail(
                "Triton was imported before TRITON_INTERPRET=1 was set (tests/conftest.py sets "
                "it for its first import): run the tests through pytest from the repository root"
            )
        yield


@pytest.fixture(params=[None] if CUDA else [None, 64], ids=lambda c: f"chunk{c or ''}")
def window_chunk(request, monkeypatch):
    """The window of keys taken whole, as the interpreter takes it, and (interpreted only) in
    chunks of 64 keys, as compiled code steps it (its answer then possibly in a lower chunk
    than the max's, found from the chunks' masses)."""
    if request.param:
        from klpenalty.ops.triton import _kernels_threshold

        monkeypatch.setattr(_kernels_threshold, "_CHUNK", request.param)
    return request.param


def _on(*tensors):
    out = tuple(t.to(DEVICE) for t in tensors)
    return out if len(out) > 1 else out[0]


def _garbage_row(x, y, leading, vocab):
    """A mask whose last row is False, that row filled with −inf / NaN garbage."""
    mask = torch.ones(leading, dtype=torch.bool, device=DEVICE)
    mask.view(-1)[-1] = False
    x.view(-1, vocab)[-1] = NINF
    if y is not None:
        y.view(-1, vocab)[-1] = float("nan")
    return mask


# --------------------------------------------------------------------------- one-pass token stats
def _run(vocab_chunk):
    def run(x, y, tokens, mask, keep, tau, temperature, want, **kw):
        return views.triton.token_stats(
            _on(x), *(None if t is None else _on(t) for t in (y, tokens, mask, keep, tau)),
            temperature, want=want, vocab_chunk=vocab_chunk, **kw,
        )

    return run


# (dtype, vocab_chunk): every dtype once, float32 both ways (the interpreter is slow: each grid
# run is ~40 forward and ~20 backward launches)
GRID = [
    (torch.float32, 0),
    (torch.float32, 16),
    (torch.bfloat16, 16),
    (torch.float16, 0),
    (torch.float64, 0),
]


@pytest.mark.parametrize("scenario", TOKEN_STATS_SCENARIOS)
@pytest.mark.parametrize("dtype,vocab_chunk", GRID, ids=lambda p: str(p).replace("torch.", ""))
def test_token_stats_shared_grid(dtype, vocab_chunk, scenario):
    """The shared grid (tests/ops/cases.py) on the kernels: one program per row as the split
    heuristic chooses for these few short rows (0), and forced splits of 16 columns (V = 37:
    three partial states merged per row). Float64 runs the streaming op."""
    if vocab_chunk == 0:
        n, vocab = token_stats_case(torch.float32)["x"].reshape(-1, 37).shape
        assert ts.split_columns(n, vocab, DEVICE)[1] >= vocab or CUDA
    check_token_stats(_run(vocab_chunk), dtype, device=DEVICE, scenario=scenario)


def test_public_token_stats_with_a_sampler_support_matches_streaming():
    """klpenalty.token_stats(backend="triton") with top-k/top-p (a tau support) and a compact
    kept set that is not a threshold (a keep mask), on bf16 logits: the streaming backend's
    values and gradients."""
    x, y = _on(*make_logits((2, 3, 45), torch.bfloat16, seed=31))
    tokens = x.float().argmax(-1)  # kept by any sampler
    tokens[0, 1] = -100
    mask = torch.ones(2, 3, dtype=torch.bool, device=DEVICE)
    mask[1, 2] = False
    ids, offsets = [], [0]
    for row in x.reshape(6, 45).float():
        top = row.argsort(descending=True)[:6]
        kept = top[top != top[3]].tolist()  # the 4th largest left out: not a threshold
        ids += kept
        offsets.append(offsets[-1] + len(kept))
    compact = (torch.tensor(ids, device=DEVICE), torch.tensor(offsets, device=DEVICE))
    weights = torch.tensor([1.0, -0.5, 0.75, 2.0], device=DEVICE)

    def run(backend, support):
        xs, ys = x.clone().requires_grad_(), y.clone().requires_grad_()
        s = klpenalty.token_stats(xs, ys, tokens, mask=mask, entropy=True, temperature=0.8,
                                  backend=backend, **support)
        loss = sum(w * f.sum() for w, f in zip(weights, s))
        return (*s, *torch.autograd.grad(loss, (xs, ys)))

    for support in (dict(top_k=7, top_p=0.9), dict(support=compact)):
        got, want = run("triton", support), run("streaming", support)
        for a, b in zip(got[:4], want[:4]):
            torch.testing.assert_close(a, b, **tol(torch.bfloat16))
        for a, b in zip(got[4:], want[4:]):
            torch.testing.assert_close(a, b, **grad_tol(torch.bfloat16))


# --------------------------------------------------------------------------- full KL
# The views full_kl / token_logprobs / entropy: each dtype, V = 1, V below and above a block,
# one program per row and split (the shared grid covers the op itself).
VIEW_CASES = [
    # dtype, leading, vocab, temperature, vocab_chunk
    (torch.float32, (3,), 1, 1.0, 0),
    (torch.bfloat16, (2, 3), 37, 0.7, 16),
    (torch.float16, (4,), 300, 1.3, 0),
    (torch.float32, (4,), 300, 0.7, 64),
]
VIEW_IDS = ["f32-V1", "bf16-V37-split", "f16-V300", "f32-V300-split"]


@pytest.mark.parametrize("dtype,leading,vocab,temperature,vocab_chunk", VIEW_CASES, ids=VIEW_IDS)
def test_full_kl_values_and_gradients(dtype, leading, vocab, temperature, vocab_chunk):
    x, y = _on(*make_logits((*leading, vocab), dtype, seed=vocab))
    mask = _garbage_row(x, y, leading, vocab)
    x.requires_grad_()
    y.requires_grad_()
    kl = views.triton.full_kl(x, y, mask, temperature, check=True, vocab_chunk=vocab_chunk)
    gx, gy, grad_out = check_kl_and_grads(kl, x, y, mask, temperature, dtype)
    # one gradient asked for: the other is not computed, the asked one is the same
    (gx_only,) = torch.autograd.grad(
        views.triton.full_kl(x, y.detach(), mask, temperature, vocab_chunk=vocab_chunk), (x,), grad_out
    )
    assert torch.equal(gx_only, gx)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab_chunk", [0, 32], ids=["one-program", "split"])
def test_minus_inf_patterns(dtype, vocab_chunk):
    kl, gx, gy, xp, yp, grad_out = check_minus_inf_patterns(
        lambda a, b: views.triton.full_kl(a, b, None, 1.0, vocab_chunk=vocab_chunk),
        100, dtype, [2, 7, 40, 99], device=DEVICE,
    )
    # the same results as the streaming backend
    ks = views.streaming.full_kl(xp, yp, None, 1.0)
    torch.testing.assert_close(kl, ks, **tol(dtype))
    sx, sy = torch.autograd.grad(ks, (xp, yp), grad_out)
    torch.testing.assert_close(gx, sx, **grad_tol(dtype))
    torch.testing.assert_close(gy, sy, **grad_tol(dtype))


def test_hand_values_identical_logits_and_rows_without_a_distribution():
    t = lambda rows: torch.tensor(rows, device=DEVICE)  # noqa: E731
    assert views.triton.full_kl(t([[0.0, NINF]]), t([[0.0, 0.0]]), None, 1.0).item() == pytest.approx(
        0.6931471805599453
    )
    assert views.triton.full_kl(t([[0.0, 0.0, NINF]]), t([[0.0, NINF, NINF]]), None, 1.0).item() == float("inf")
    x, _ = make_logits((3, 4, 77), torch.float32, seed=12)
    x = _on(x)
    for chunk in (0, 16):  # exactly 0, bit for bit, also merged across splits
        assert torch.all(views.triton.full_kl(x, x.clone(), None, 0.3, vocab_chunk=chunk) == 0)
    rows = torch.zeros(4, 5, device=DEVICE)
    rows[0] = NINF  # no policy mass
    rows[1, 2] = float("inf")
    rows[2, 3] = float("nan")
    kl = views.triton.full_kl(rows, torch.zeros(4, 5, device=DEVICE), None, 1.0)
    assert torch.isnan(kl[:3]).all() and kl[3].item() == 0.0


@pytest.mark.parametrize("offset_x,offset_y", [(1e4, -1e4), (-1e4, 1e4)])
def test_large_opposite_offsets_keep_float32_accuracy(offset_x, offset_y):
    x, y = make_logits((3, 300), torch.float64, seed=17, scale=2.0)
    xs, ys = _on((x + offset_x).float(), (y + offset_y).float())
    want = full_kl_reference(xs, ys, 0.7)
    for chunk in (0, 64):
        got = views.triton.full_kl(xs, ys, None, 0.7, vocab_chunk=chunk)
        torch.testing.assert_close(got.double(), want, **tol(torch.float32))


def test_stats_match_the_streaming_ops():
    """The (..., 9) stats hold the engine's finalize: the KL's six columns, E_π[u], and the
    token log-probs, as the streaming token_stats op computes them (split programs here)."""
    x, y = _on(*make_logits((5, 300), torch.float32, seed=3))
    x[1, 7] = NINF
    y[2, 9] = NINF  # KL = +inf: flagged in both
    tokens = torch.tensor([0, 5, 299, 17, 100], device=DEVICE)
    out, st = torch.ops.klpenalty.triton_token_stats(
        x, y, tokens, None, None, None, 0.9, -100, 15, False, 0, 16, 0, 1.0, 0.0
    )
    out_s, st_s = torch.ops.klpenalty.streaming_token_stats(
        x, y, tokens, None, None, None, 0.9, -100, 15, False, 0, 0, 0, 1.0, 0.0
    )
    torch.testing.assert_close(out, out_s, **tol(torch.float32))
    torch.testing.assert_close(st[:, :5], st_s[:, :5], atol=2e-6, rtol=1e-5)
    assert st[2, 5].item() == 1.0 and st[0, 5].item() == 0.0
    torch.testing.assert_close(st[:, 6:], st_s[:, 6:], atol=2e-6, rtol=1e-5)


def test_non_contiguous_inputs_give_the_contiguous_results():
    x, y = _on(*make_logits((2, 4, 65), torch.float32, seed=21))
    layouts = [
        (x[:, :-1], y[:, :-1]),  # rows with a gap: copied by reshape
        (x[..., :-1], y[..., :-1]),  # vocabulary slice: row stride V + 1, read in place
        (x.transpose(0, 1), y.transpose(0, 1)),
        (x.transpose(-1, -2).contiguous().transpose(-1, -2), y),  # column stride ≠ 1: copied
    ]
    for a, b in layouts:
        got = views.triton.full_kl(a, b, None, 1.0)
        assert torch.equal(got, views.triton.full_kl(a.contiguous(), b.contiguous(), None, 1.0))
        assert torch.equal(views.triton.entropy(a, None, 1.0), views.triton.entropy(a.contiguous(), None, 1.0))
        tokens = torch.zeros(a.shape[:-1], dtype=torch.long, device=DEVICE)
        assert torch.equal(
            views.triton.token_logprobs(a, tokens, 0.8), views.triton.token_logprobs(a.contiguous(), tokens, 0.8)
        )
    xs = x.clone().requires_grad_()
    view = xs[..., :-1]  # strided rows inside autograd
    (g,) = torch.autograd.grad(views.triton.full_kl(view, y[..., :-1], None, 1.0).sum(), (xs,))
    (g_ref,) = torch.autograd.grad(
        views.triton.full_kl(view.contiguous(), y[..., :-1].contiguous(), None, 1.0).sum(), (xs,)
    )
    assert torch.equal(g, g_ref) and torch.all(g[..., -1] == 0)


def test_mixed_dtypes_float64_and_the_empty_batch():
    x, y = _on(*make_logits((3, 50), torch.float32, seed=2))
    xb = x.bfloat16().requires_grad_()
    y.requires_grad_()
    kl = views.triton.full_kl(xb, y, None, 1.0)
    torch.testing.assert_close(kl.double(), full_kl_reference(xb.detach(), y.detach()), **tol(torch.float32))
    gx, gy = torch.autograd.grad(kl.sum(), (xb, y))
    assert gx.dtype == torch.bfloat16 and gy.dtype == torch.float32
    xd, yd = x.detach().double(), y.detach().double()  # float64: the streaming ops, float64 math
    assert views.triton.full_kl(xd, yd, None, 1.0).dtype == torch.float64
    torch.testing.assert_close(views.triton.full_kl(xd, yd, None, 1.0), full_kl_reference(xd, yd), **tol(torch.float64))
    empty = torch.zeros(0, 7, device=DEVICE, requires_grad=True)
    out = views.triton.full_kl(empty, empty, None, 1.0)
    assert out.shape == (0,)
    (g,) = torch.autograd.grad(out.sum(), empty)
    assert g.shape == (0, 7)
    assert views.triton.entropy(empty, None, 1.0).shape == (0,)
    assert views.triton.token_logprobs(empty, torch.zeros(0, dtype=torch.long, device=DEVICE), 1.0).shape == (0,)


def test_double_backward_matches_the_streaming_backend():
    x, y = _on(*make_logits((3, 20), torch.float32, seed=9))
    mask = torch.tensor([True, False, True], device=DEVICE)

    def second(backend):
        xs, ys = x.clone().requires_grad_(), y.clone().requires_grad_()
        kl = klpenalty.full_kl(xs, ys, mask=mask, temperature=0.7, backend=backend)
        (gx,) = torch.autograd.grad(kl.sum(), xs, create_graph=True)
        return torch.autograd.grad((gx * gx).sum(), (xs, ys))

    for got, want in zip(second("triton"), second("streaming")):
        torch.testing.assert_close(got, want, **grad_tol(torch.float32))


# --------------------------------------------------------------------------- token log-probs
@pytest.mark.parametrize("dtype,leading,vocab,temperature,vocab_chunk", VIEW_CASES, ids=VIEW_IDS)
def test_token_logprobs_values_and_gradients(dtype, leading, vocab, temperature, vocab_chunk):
    x, _ = make_logits((*leading, vocab), dtype, seed=vocab + 1)
    x = _on(x).requires_grad_()
    gen = torch.Generator().manual_seed(vocab)
    tokens = _on(torch.randint(0, vocab, leading, generator=gen))
    tokens.view(-1)[0] = -100  # ignored position
    tokens.view(-1)[-1] = vocab - 1  # the last column, in the last block
    out = views.triton.token_logprobs(
        x, tokens, temperature, ignore_index=-100, check=True, vocab_chunk=vocab_chunk
    )
    gx = check_token_logprobs_and_grads(out, x, tokens, temperature, dtype)
    assert torch.all(gx.view(-1, vocab)[0] == 0)


def test_token_logprobs_with_minus_inf_and_a_row_without_a_distribution():
    x, _ = make_logits((3, 40), torch.float32, seed=4)
    x = _on(x)
    x[0, 5:] = NINF
    x[2] = NINF
    tokens = torch.tensor([1, 2, 0], device=DEVICE)
    got = views.triton.token_logprobs(x, tokens, 1.0)
    want = views.streaming.token_logprobs(x, tokens, 1.0)
    torch.testing.assert_close(got, want, equal_nan=True, **tol(torch.float32))
    assert torch.isnan(got[2])
    xs = x[:2].clone().requires_grad_()
    (g,) = torch.autograd.grad(views.triton.token_logprobs(xs, tokens[:2], 1.0).sum(), xs)
    assert torch.isfinite(g).all() and torch.all(g[0, 5:] == 0)


# --------------------------------------------------------------------------- entropy
@pytest.mark.parametrize("dtype,leading,vocab,temperature,vocab_chunk", VIEW_CASES, ids=VIEW_IDS)
def test_entropy_values_and_gradients(dtype, leading, vocab, temperature, vocab_chunk):
    x, _ = make_logits((*leading, vocab), dtype, seed=vocab)
    x = _on(x)
    mask = _garbage_row(x, None, leading, vocab)
    if vocab > 8:
        x.view(-1, vocab)[0, 3:8] = NINF  # −inf entries in a counted row
    x.requires_grad_()
    h = views.triton.entropy(x, mask, temperature, check=True, vocab_chunk=vocab_chunk)
    assert h.shape == leading and h.dtype == torch.float32
    xr = x.detach().double().requires_grad_()
    keep = mask.unsqueeze(-1)
    # the reference's autograd gives 0·(−inf) = NaN at −inf entries: −1e4 has float64 mass 0
    xr_finite = torch.where(keep, torch.nan_to_num(xr, neginf=-1e4), 0.0)
    want = torch.where(mask, entropy_reference(xr_finite, temperature), 0.0)
    torch.testing.assert_close(h.double(), want.detach(), **tol(dtype))
    assert torch.all(h >= 0)
    grad_out = torch.linspace(-1.5, 2.0, mask.numel(), device=DEVICE).reshape(leading)
    (gx,) = torch.autograd.grad(h, x, grad_out)
    (wx,) = torch.autograd.grad((want * grad_out.double()).sum(), xr)
    assert gx.dtype == dtype and torch.isfinite(gx).all()
    torch.testing.assert_close(gx.double(), wx, **grad_tol(dtype))
    assert torch.all(gx.view(-1, vocab)[-1] == 0)
    if vocab == 1:  # one entry: π = 1, H = 0 and no gradient
        assert torch.all(h == 0) and torch.all(gx == 0)


# --------------------------------------------------------------------------- check, compile
def _message(fn):
    with pytest.raises(ValueError) as info:
        fn()
    return str(info.value)


def test_check_errors_read_exactly_like_the_streaming_ones():
    x, y = _on(*make_logits((2, 6), torch.float32, seed=1))
    bad_x = x.clone()
    bad_x[-1, 2] = float("nan")
    no_mass = y.clone()
    no_mass[-1] = NINF
    tokens = torch.tensor([0, 6], device=DEVICE)
    cases = [
        lambda b: b.full_kl(bad_x, y, None, 1.0, check=True),
        lambda b: b.full_kl(x, no_mass, None, 1.0, check=True),
        lambda b: b.entropy(bad_x, None, 1.0, check=True),
        lambda b: b.token_logprobs(bad_x, torch.zeros(2, dtype=torch.long, device=DEVICE), 1.0, check=True),
        lambda b: b.token_logprobs(x, tokens, 1.0, check=True),
    ]
    for case in cases:
        assert _message(lambda: case(views.triton)) == _message(lambda: case(views.streaming))
    assert torch.isnan(views.triton.full_kl(bad_x, y, None, 1.0, check=False)[-1])
    mask = torch.tensor([True, False], device=DEVICE)
    assert views.triton.full_kl(bad_x, no_mass, mask, 1.0, check=True)[-1].item() == 0.0


@pytest.mark.slow
def test_torch_compile_fullgraph_traces_through_the_ops():
    x, y = _on(*make_logits((2, 3, 40), torch.float32, seed=6))
    mask = torch.tensor([[True, True, False], [True, False, True]], device=DEVICE)
    tokens = torch.tensor([[1, 2, -100], [0, 39, 5]], device=DEVICE)

    def step(a, b):
        kl = klpenalty.full_kl(a, b, mask=mask, temperature=0.8, backend="triton")
        h = klpenalty.entropy(a, mask=mask, backend="triton")
        lp = klpenalty.token_logprobs(a, tokens, backend="triton")
        return (kl * 2 + h - lp).sum()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    xs, ys = x.clone().requires_grad_(), y.clone().requires_grad_()
    xe, ye = x.clone().requires_grad_(), y.clone().requires_grad_()
    got, want = compiled(xs, ys), step(xe, ye)
    torch.testing.assert_close(got, want)
    for a, b in zip(torch.autograd.grad(got, (xs, ys)), torch.autograd.grad(want, (xe, ye))):
        torch.testing.assert_close(a, b)


# --------------------------------------------------------------------------- dispatch
def test_dispatch_forces_triton_and_auto_picks_it_on_cuda():
    assert "triton" in dispatch.available_backends()
    assert dispatch.get_backend("triton", DEVICE).module is triton_backend
    x, y = _on(*make_logits((2, 30), torch.float32, seed=8))
    got = klpenalty.full_kl(x, y, backend="triton")
    torch.testing.assert_close(got.double(), full_kl_reference(x, y), **tol(torch.float32))
    if CUDA:
        assert dispatch.get_backend("auto", DEVICE).module is triton_backend
        assert "triton" in dispatch.device_backends(DEVICE)
    else:
        assert "triton" not in dispatch.device_backends(DEVICE)
        assert dispatch.get_backend("auto", DEVICE) is not triton_backend
    with pytest.raises(ValueError, match="runs on CUDA tensors"):
        dispatch.get_backend("triton", torch.device("meta"))


def test_triton_on_cpu_without_the_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(triton_backend._load._kernels(), "INTERPRETED", False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        dispatch.get_backend("triton", torch.device("cpu"))
    x, y = make_logits((2, 5), torch.float32)
    with pytest.raises(ValueError, match="only in Triton's interpreter"):
        klpenalty.full_kl(x, y, backend="triton")


def test_auto_on_cuda_without_triton_notes_the_fallback_once(monkeypatch):
    monkeypatch.setattr(triton_backend._load, "_error", "ImportError: simulated")
    monkeypatch.setattr(triton_backend, "_warned", False)
    cuda = torch.device("cuda")  # no tensor is made: only the choice is tested
    with pytest.warns(RuntimeWarning, match="simulated") as record:
        assert dispatch.get_backend("auto", cuda).module is streaming
        assert dispatch.get_backend("auto", cuda).module is streaming
    assert len(record) == 1 and "klpenalty[triton]" in str(record[0].message)
    with pytest.raises(ValueError, match="needs Triton"):
        dispatch.get_backend("triton", cuda)


_NO_TRITON_CHILD = """
    import sys
    sys.modules["triton"] = None  # import triton raises ImportError
    import torch, klpenalty
    from klpenalty.ops import dispatch
    from klpenalty.ops import triton as triton_backend
    x = torch.randn(2, 9)
    print("KL", klpenalty.full_kl(x, x.flip(-1)).shape)
    print("AVAILABLE", triton_backend.available())
    try:
        dispatch.get_backend("triton", torch.device("cpu"))
    except ValueError as exc:
        print("ERROR", exc)
"""


def test_the_library_works_without_triton():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_NO_TRITON_CHILD)],
        capture_output=True, text=True, env=env, timeout=300, cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    assert "KL torch.Size([2])" in done.stdout and "AVAILABLE False" in done.stdout
    assert "ERROR backend 'triton' needs Triton" in done.stdout and "klpenalty[triton]" in done.stdout


_LAZY_CHILD = """
    import sys
    import klpenalty
    from klpenalty.ops import triton as triton_backend
    from klpenalty.ops.triton import _host, threshold, token_stats
    print("IMPORTED", sorted(m for m in sys.modules if m == "triton" or "_kernels_" in m))
    print("AVAILABLE", triton_backend.available(), "triton" in sys.modules)
"""


def test_importing_the_backend_imports_no_triton():
    """klpenalty and the backend's host modules import neither Triton nor the kernel modules;
    the first availability check imports both."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_LAZY_CHILD)],
        capture_output=True, text=True, env=env, timeout=300, cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    assert "IMPORTED []" in done.stdout and "AVAILABLE True True" in done.stdout, done.stdout


def test_split_heuristic():
    cpu = torch.device("cpu")
    assert ts.split_columns(64, 1000, cpu) == (1024, 1000)  # enough rows: one program a row
    block, cols = ts.split_columns(1, 128256, cpu)  # one row: split into up to 4 programs
    assert block == ts.MAX_BLOCK and -(-128256 // cols) == 4
    assert ts.split_columns(1, 5000, cpu, vocab_chunk=100) == (128, 128)  # forced


# --------------------------------------------------------------------------- GPU compilation
# The specialisations the library launches: the three views, the PPO/GRPO call with and without
# the entropy, each support form, and the reference's log-prob alone.
_ALL = Want.KL | Want.LOGP | Want.REF_LOGP | Want.ENTROPY
_LOWERED = [
    # (want, keep, tau, need_x, need_y)
    (Want.KL, False, False, True, True),  # full_kl, both gradients
    (Want.LOGP, False, False, True, False),  # token_logprobs
    (Want.ENTROPY, False, False, True, False),  # entropy
    (_ALL, False, False, True, True),  # every statistic, no support
    (_ALL, True, False, True, False),  # support by keep mask
    (_ALL & ~Want.ENTROPY, False, True, True, True),  # support by threshold
    (_ALL & ~Want.REF_LOGP, True, True, True, False),  # both support forms
    (Want.REF_LOGP, False, False, False, True),  # log ρ(token) alone
]


@pytest.mark.slow
def test_kernels_compile_for_a_cuda_target():
    """Both kernels lower to PTX for sm_90 (no GPU needed), in every constexpr specialisation the
    library launches (ts.forward_constexprs / backward_constexprs): what the interpreter cannot
    catch."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    specs = [
        (ts.forward_constexprs(want, keep, tau, has_mask=keep),
         ts.backward_constexprs(want, nx, ny, keep, tau, has_mask=tau, has_owned=keep))
        for want, keep, tau, nx, ny in _LOWERED
    ]
    for name in ("X_STATE", "Y_STATE", "MOMENT_A", "MOMENT_B", "HAS_KEEP", "HAS_TAU", "LOGP",
                 "REF_LOGP", "HAS_MASK"):
        assert {f[name] for f, _ in specs} == {True, False}, name
    for name in ("KL", "LOGP", "REF_LOGP", "ENTROPY", "NEED_X", "NEED_Y", "NEED_P", "NEED_Q",
                 "HAS_TOKEN", "HAS_MASK", "HAS_OWNED"):
        assert {b[name] for _, b in specs} == {True, False}, name
    code = f"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from klpenalty.ops.triton import _kernels_stats as k
t = GPUTarget("cuda", 90, 32)
rows = {{"T": "i32", **{{f"stride_{{a}}{{d}}": "i64" for a in "xyk" for d in "bt"}}}}
ptrs = {{"x_ptr": "*bf16", "y_ptr": "*fp32", "keep_ptr": "*u8", "tau_ptr": "*fp32", "tok_ptr": "*i64",
        "mask_ptr": "*u8"}}
fwd = {{**ptrs, "out_ptr": "*fp32", "stats_ptr": "*fp32", **rows, "V": "i32", "cols": "i32",
       "n_splits": "i32", "inv_t": "fp32", "c2": "fp32", "temperature": "fp32", "ignore_index": "i32"}}
merge = {{"parts_ptr": "*fp32", **ptrs, "out_ptr": "*fp32", "stats_ptr": "*fp32", **rows, "V": "i32",
         "n_splits": "i32", "inv_t": "fp32", "temperature": "fp32", "ignore_index": "i32"}}
bwd = {{"x_ptr": "*bf16", "y_ptr": "*fp32", "keep_ptr": "*u8", "tau_ptr": "*fp32", "gx_ptr": "*bf16",
       "gy_ptr": "*fp32", "stats_ptr": "*fp32", "g_ptr": "*fp32", "tok_ptr": "*i64", "mask_ptr": "*u8",
       "owned_ptr": "*u8", **rows, "stride_gn": "i64", "stride_gc": "i64", "V": "i32", "inv_t": "fp32",
       "c2": "fp32", "ignore_index": "i32"}}
cols_f, cols_m = {ts.column_constexprs("stats")!r}, {ts.column_constexprs("merge")!r}
cols_b = {ts.column_constexprs("grad")!r}
for f, b in {specs!r}:
    m = {{name: on for name, on in f.items() if name != "X_STATE"}}
    for fn, sig, c in [(k.stats_kernel, fwd, {{**f, **cols_f, "BLOCK": 4096}}),
                       (k.stats_kernel, fwd, {{**f, "FINISH": False, **cols_f, "BLOCK": 4096}}),
                       (k.merge_kernel, merge, {{**m, **cols_m, "SPLITS": 8}}),
                       (k.grad_kernel, bwd, {{**b, **cols_b, "BLOCK": 1024, "TILES": {ts.GRAD_TILES}}})]:
        s = {{**sig, **{{name: "constexpr" for name in c}}}}
        assert ".entry" in triton.compile(ASTSource(fn=fn, signature=s, constexprs=c), target=t).asm["ptx"]
print("OK", len({specs!r}))
"""
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=300, cwd=ROOT)
    assert done.returncode == 0 and "OK" in done.stdout, done.stderr[-3000:]


# --------------------------------------------------------------------------- the sampler's threshold
def _sampler_rows(dtype, vocab, seed):
    """(8, vocab) rows of every kind a threshold must get right: random, one-hot-like,
    near-uniform, ties at every boundary, −inf entries, one finite entry, all −inf, a NaN."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8, vocab, generator=g, dtype=torch.float64) * 2.0
    x[1] = -30.0
    x[1, 3] = 10.0  # one-hot-like
    x[2] *= 1e-3  # near-uniform
    x[3] = torch.randint(0, 4, (vocab,), generator=g).double()  # 4 values, many ties each
    x[4, ::3] = NINF
    x[5] = NINF
    x[5, vocab // 2] = 1.5  # one finite logit
    x[6] = NINF
    x[7, 1] = float("nan")
    return x.to(dtype)


# (top_k, top_p, min_p, temperature): the op's convention (0 / 1.0 / 0.0: unused)
SAMPLER_SETTINGS = [
    (1, 1.0, 0.0, 1.0),
    (7, 1.0, 0.0, 1.0),
    (0, 0.3, 0.0, 1.0),
    (0, 0.9, 0.0, 0.6),
    (0, 1.0, 0.05, 1.0),
    (0, 1.0, 1.0, 1.7),  # min_p = 1: the largest logit and its ties
    (5, 0.8, 0.0, 1.3),  # top-p on the renormalised top-k distribution
    (20, 0.95, 0.1, 0.8),
    (10_000, 1.0, 0.0, 1.0),  # top_k ≥ V: nothing cut
]


def _threshold_rule(x, top_k, top_p, min_p, temperature):
    """The portable rule on the op's arguments (0 / 1 / 0 = unused)."""
    from klpenalty.ops.streaming.threshold import LOCAL, threshold_rows

    return threshold_rows(x, top_k or None, top_p if top_p < 1.0 else None,
                          min_p if min_p > 0.0 else None, temperature, None, LOCAL)


def _same(a, b):
    return torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(a.nan_to_num(0.0),
                                                                        b.nan_to_num(0.0))


@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("vocab", [37, 300])
def test_sampling_threshold_kernel_matches_the_rule_and_the_float64_kept_sets(dtype, vocab):
    """The threshold kernel against sampling.py's rule (the same τ, a logit of the row) and the
    float64 kept sets of tests/test_sampling.py (sort, cut, renormalise), on rows of every
    kind; V = 300: more than one block and not a multiple of one."""
    from klpenalty.ops.reference import kept_set_reference

    x = _sampler_rows(dtype, vocab, seed=vocab)
    op = torch.ops.klpenalty.triton_sampling_threshold
    for top_k, top_p, min_p, temperature in SAMPLER_SETTINGS:
        tau = op(_on(x), top_k, top_p, min_p, temperature).cpu()
        assert tau.dtype == torch.float32 and tau.shape == (8,)
        want = _threshold_rule(x, top_k, top_p, min_p, temperature)
        assert _same(tau, want), (top_k, top_p, min_p, temperature, tau, want)
        cut = top_k < vocab or top_p < 1.0 or min_p > 0.0
        assert torch.isnan(tau[7]) == cut  # a NaN row keeps nothing where something is cut
        kw = dict(top_k=top_k or None, top_p=top_p, min_p=min_p, temperature=temperature)
        for r in range(6):  # the float64 kept sets (of the rows with a distribution)
            assert torch.equal(x[r].float() >= tau[r], kept_set_reference(x[r], **kw)), (r, kw)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_threshold_where_the_kth_logit_is_zero(temperature):
    """Top-k with top-p or min-p where the k-th largest logit is +0 or −0: the rule's τ (the
    tie group below it is looked for from the float just below zero, a negative subnormal,
    not −0 again)."""
    op = torch.ops.klpenalty.triton_sampling_threshold
    x = torch.tensor([[0.0, -1.0, -2.0, -3.0], [-0.0, -1.0, -2.0, -3.0],
                      [1.0, -0.0, 0.0, -2.0], [2.0, 1e-45, -1e-45, -0.0]])
    for top_k, top_p, min_p in [(1, 0.5, 0.0), (1, 1.0, 0.5), (2, 0.9, 0.0), (3, 1.0, 1e-12)]:
        tau = op(_on(x), top_k, top_p, min_p, temperature).cpu()
        want = _threshold_rule(x, top_k, top_p, min_p, temperature)
        assert _same(tau, want), (top_k, top_p, min_p, tau, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_threshold_where_the_keys_overflow(dtype):
    """Finite logits whose x/T overflows to ±inf (huge logits, a small T): the keys equal to
    the max's (+inf) hold all the mass, those at −inf none; the rule's τ, where top-k's tie
    group at ±inf is found without stepping float by float."""
    op = torch.ops.klpenalty.triton_sampling_threshold
    g = torch.Generator().manual_seed(9)
    wide = torch.randn(2, 2049, generator=g) * 3e37
    wide[0, :300] = 3e38
    wide[1, ::7] = -3e38
    rows = [wide, torch.tensor([[3e38, 2e38, 1.0, -3e38], [3e38, -3e38, 0.0, 1.0]])]
    settings = [(0, 0.5, 0.0), (0, 0.999, 0.0), (2, 0.9, 0.0), (1, 0.5, 0.0), (0, 1.0, 0.5),
                (3, 1.0, 0.0), (2048, 0.999, 0.0), (2048, 1.0, 0.5), (5, 0.9, 0.0)]
    for x in rows:
        x = x.to(dtype)
        for top_k, top_p, min_p in settings:
            if top_k >= x.shape[-1]:
                continue
            tau = op(_on(x), top_k, top_p, min_p, 1e-3).cpu()
            want = _threshold_rule(x, top_k, top_p, min_p, 1e-3)
            assert _same(tau, want), (x.shape, top_k, top_p, min_p, tau, want)


def test_sampling_threshold_kernel_on_strided_rows_and_boundaries(monkeypatch):
    """(B, T, V) rows read in place (logits[:, :-1]) give the contiguous rows' τ; top-p
    boundaries 1e-9 apart, where the float32 search's answer fails its float64 check and the
    float64 search decides; the empty batch; bad settings."""
    op = torch.ops.klpenalty.triton_sampling_threshold
    x = make_logits((2, 5, 70), torch.bfloat16, seed=3)[0]
    view = x[:, :-1]
    for setting in [(5, 0.9, 0.05, 1.0), (0, 0.7, 0.0, 0.5)]:
        tau = op(_on(view), *setting).cpu()
        assert tau.shape == (2, 4)
        assert torch.equal(tau, op(_on(view.contiguous()), *setting).cpu())
        assert torch.equal(tau, _threshold_rule(view, *setting))
    # top-p decided in float64: p just above (kept) and just below (dropped) the mass before a
    # token, 1e-9 apart in relative terms (float32 exponentials or sums would blur this)
    g = torch.Generator().manual_seed(5)
    row = torch.randn(1, 40, generator=g) * 1.5
    vals = row[0].double().sort(descending=True).values
    scaled = row[0] / 0.8
    m = scaled.max()
    log_z = m.double() + torch.exp(scaled.double() - m.double()).sum().log()  # all float64
    before = torch.cumsum(torch.exp(scaled.double().sort(descending=True).values - log_z), 0)
    searches = []  # interpreted: the float64 search runs where the float32 one's check fails
    if not CUDA:
        from klpenalty.ops.triton import _kernels_threshold

        bucket_sums = _kernels_threshold._bucket_sums

        def counted(*args):
            searches.append(args[7])  # MASS: 1 float32, 2 float64
            return bucket_sums(*args)

        monkeypatch.setattr(_kernels_threshold, "_bucket_sums", counted)
    # float32 rows: the candidate list decides (float64 masses, no search); without the list
    # (as where it cannot hold the candidates), the searches
    for listed in (True, False):
        if not listed:
            monkeypatch.setattr(th, "cand_cap", lambda vocab, top_k, bins: 0)
        for j in (1, 5, 20):
            p = before[j - 1].item()  # the mass before the (j + 1)-th largest
            assert op(_on(row), 0, p * (1 + 1e-9), 0.0, 0.8).item() == vals[j].item()
            assert op(_on(row), 0, p * (1 - 1e-9), 0.0, 0.8).item() == vals[j - 1].item()
        assert CUDA or (not searches) == listed
    assert CUDA or (1 in searches and 2 in searches)
    monkeypatch.undo()
    assert op(_on(torch.empty(0, 3, 9)), 3, 0.5, 0.0, 1.0).shape == (0, 3)
    with pytest.raises(ValueError, match="top_p"):
        op(_on(row), 0, 1.5, 0.0, 1.0)
    with pytest.raises(ValueError, match="top_k"):
        op(_on(row), -2, 1.0, 0.0, 1.0)


def test_top_p_on_16_bit_logits_from_the_window_of_keys(window_chunk, monkeypatch):
    """bf16 rows: top-p decided by the counts of the window's keys up to the max (one value a
    key) without a search where the answer lies there — boundaries 1e-9 apart (float64
    masses), after top-k too, where Z and min-p's τ come from the window (from top-k's listed
    set under Triton before 3.9) with no read of the row — and by the search below the
    window, the window's mass carried, where it does not (a deep p: the answer a negative
    logit under a positive max). The window whole and in chunks (``window_chunk``)."""
    g = torch.Generator().manual_seed(8)
    row = (torch.randn(1, 300, generator=g) * 1.5).to(torch.bfloat16)
    op = torch.ops.klpenalty.triton_sampling_threshold
    searches = []
    if not CUDA:
        from klpenalty.ops.triton import _kernels_threshold

        bucket_sums = _kernels_threshold._bucket_sums

        def counted(*args):
            searches.append(args[7])
            return bucket_sums(*args)

        monkeypatch.setattr(_kernels_threshold, "_bucket_sums", counted)
    scaled = row[0].float() / 0.8
    vals = row[0].float().sort(descending=True).values
    log_z = scaled.max().double() + torch.exp(scaled.double() - scaled.max().double()).sum().log()
    before = torch.cumsum(torch.exp(scaled.double().sort(descending=True).values - log_z), 0)
    for j in (1, 5, 20):
        p = before[j - 1].item()  # the mass before the (j + 1)-th largest
        if vals[j] == vals[j - 1]:
            continue
        assert op(_on(row), 0, p * (1 + 1e-9), 0.0, 0.8).item() == vals[j].item()
        assert op(_on(row), 0, p * (1 - 1e-9), 0.0, 0.8).item() == vals[j - 1].item()
        after_k = op(_on(row), 40, p, 0.0, 0.8).cpu()  # top-p of the top-40 distribution
        assert torch.equal(after_k, _threshold_rule(row, 40, p, 0.0, 0.8))
    assert CUDA or searches == []  # all from the window
    if not CUDA:  # after top-k (its set inside the window) Z and min-p's τ come from it too
        z_reads = []
        z_read = _kernels_threshold._z_read
        monkeypatch.setattr(_kernels_threshold, "_z_read",
                            lambda *args: z_reads.append(1) or z_read(*args))
    # the reads of Z: none after top-k, one for min-p without top-p (no window), none for top-p
    # alone (the candidates below the window summed by the window's scan)
    for top_k, top_p, min_p, reads in [(40, 0.7, 0.05, 0), (40, 1.0, 0.05, 1), (0, 0.7, 0.0, 0)]:
        before = 0 if CUDA else len(z_reads)
        tau = op(_on(row), top_k, top_p, min_p, 0.8).cpu()
        assert torch.equal(tau, _threshold_rule(row, top_k, top_p, min_p, 0.8))
        assert CUDA or len(z_reads) - before == reads, (top_k, top_p, min_p)
    for top_k, top_p in [(0, 0.999), (250, 0.999)]:
        tau = op(_on(row), top_k, top_p, 0.0, 0.8).cpu()
        assert tau.item() < 0 < vals[0].item()
        assert torch.equal(tau, _threshold_rule(row, top_k, top_p, 0.0, 0.8))
    assert CUDA or 1 in searches  # below the window: the search


@pytest.mark.parametrize("per_warp", [True, False])
def test_top_p_after_a_top_k_too_large_to_list_takes_the_window(per_warp, monkeypatch):
    """bf16 rows, top-p after a top-k whose set passes the candidate list (k > CAND_MAX / 2):
    the window of keys decides where it holds the answer, with no search — under per-warp
    histograms too, where the host lists top-k's set when it can — and τ is the rule's."""
    from klpenalty.ops.triton import _load, threshold as th

    monkeypatch.setattr(_load._kernels(), "PER_WARP_HISTOGRAM", per_warp)
    top_k = th.CAND_MAX // 2 + 1
    assert th.cand_cap(9000, top_k) == 0
    g = torch.Generator().manual_seed(12)
    rows = torch.randn(2, 9000, generator=g).to(torch.bfloat16)
    op = torch.ops.klpenalty.triton_sampling_threshold
    counts = _counting_reads(monkeypatch)
    for top_p, temperature in [(0.5, 1.0), (0.8, 0.7)]:
        counts["search"] = 0
        tau = op(_on(rows), top_k, top_p, 0.0, temperature).cpu()
        assert torch.equal(tau, _threshold_rule(rows, top_k, top_p, 0.0, temperature))
        assert CUDA or counts["search"] == 0, (top_p, counts)


def test_the_float64_exponential_of_the_window_scan():
    """``_exp64`` (the window scan's float64 exponentials, below the window) within an ulp of
    exp on [−708, 0] (the range its caller keeps): random points, small ones, the ends and
    the edges of its reduction (±ln 2 / 2)."""
    g = torch.Generator().manual_seed(4)
    d = torch.cat([-torch.rand(4096, generator=g, dtype=torch.float64) * 708.0,
                   -torch.rand(4096, generator=g, dtype=torch.float64) * 2.0,
                   torch.tensor([0.0, -0.0, -708.0, -1e-300, -math.log(2) / 2,
                                 -math.log(2) * 1.5, -math.log(2) * 1021.5])])
    d = torch.cat([d, torch.zeros(16384 - d.numel(), dtype=torch.float64)])

    @triton.jit  # (here: the interpreter, where no GPU exists, is set for this module's tests)
    def exp64_probe(d_ptr, out_ptr, N: tl.constexpr):
        offs = tl.arange(0, N)
        terms = kth._exp_terms(tl.where(N > 0, 1.0, 2.0).to(tl.float64))
        tl.store(out_ptr + offs, kth._exp64(tl.load(d_ptr + offs), terms))

    out = _on(torch.empty_like(d))
    exp64_probe[(1,)](_on(d), out, N=d.numel())
    want = torch.exp(d)
    ulp = torch.nextafter(want, torch.full_like(want, math.inf)) - want
    assert torch.all((out.cpu() - want).abs() <= ulp)
    assert torch.all(out.cpu()[d == 0.0] == 1.0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_top_p_alone_takes_z_from_the_window_scans_partial_sums(dtype, monkeypatch):
    """16-bit rows of V = 2500 split across programs, much of their mass below the window of
    keys (negative logits under a positive max). bf16: top-p alone adds Z's mass below the
    window from the window scan's per-program float64 sums, with no read of the row for Z;
    min-p with it reads the row for τ_m alone. fp16 (the band of value bins): Z and τ_m from
    the band's per-program sums, no Z read. p 1e-9 apart around the mass before a token,
    positive and negative (in bf16's window, below it: the search), so a sum missing, doubled
    or in float32 would move τ."""
    from klpenalty.ops.triton import token_stats as ts

    vocab, temperature = 2500, 0.9
    assert ts.split_columns(2, vocab, torch.device("cpu"))[1] < vocab
    g = torch.Generator().manual_seed(12)
    x = torch.randn(2, vocab, generator=g) * 0.6
    x[0, 2400] = 2.0  # the max in the second program
    x[1, :1200] -= 1.0  # the first program's logits lower
    x = x.to(dtype)
    op = torch.ops.klpenalty.triton_sampling_threshold
    z_reads = []
    if not CUDA:
        from klpenalty.ops.triton import _kernels_threshold

        z_read = _kernels_threshold._z_read
        monkeypatch.setattr(_kernels_threshold, "_z_read",
                            lambda *args: z_reads.append(args[-2]) or z_read(*args))
    for r in range(2):
        scaled = x[r].float() / temperature  # the rule's float32 quotient
        vals = x[r].float().sort(descending=True).values
        m = scaled.max().double()
        log_z = m + torch.exp(scaled.double() - m).sum().log()
        before = torch.cumsum(torch.exp(scaled.double().sort(descending=True).values - log_z), 0)
        below = (x[r].float() <= 0).double() * torch.exp(scaled.double() - log_z)
        assert below.sum() > 0.15  # the mass below the window: Z's sum decides
        picked = [j for j in range(3, vocab - 1) if vals[j] != vals[j - 1]]
        # a positive logit (in bf16's window) and a negative one (below it: the search)
        for j in (next(j for j in picked if before[j - 1] > 0.3),
                  next(j for j in picked if vals[j] < -0.5)):
            p = before[j - 1].item()
            row = x[r:r + 1]
            assert op(_on(row), 0, p * (1 + 1e-9), 0.0, temperature).item() == vals[j].item()
            assert op(_on(row), 0, p * (1 - 1e-9), 0.0, temperature).item() == vals[j - 1].item()
            # both rows at once (the partials of each row's programs)
            tau = op(_on(x), 0, p * (1 + 1e-9), 0.0, temperature).cpu()
            assert tau[r].item() == vals[j].item()
            assert torch.equal(tau, _threshold_rule(x, 0, p * (1 + 1e-9), 0.0, temperature))
    assert CUDA or z_reads == []
    # min-p's τ below the window: its read, without Z (TOP_P off)
    tau = op(_on(x), 0, 0.8, 0.01, temperature).cpu()
    assert torch.equal(tau, _threshold_rule(x, 0, 0.8, 0.01, temperature))
    assert tau.max() < 0
    if dtype == torch.bfloat16:
        assert CUDA or (z_reads and not any(z_reads))
    else:
        assert CUDA or z_reads == []


def _counting_reads(monkeypatch):
    """Counts, interpreted, the row program's reads of the row (top-p's searches, the Z read)
    and the blocks of top-p's second band count (compiled kernels call none of these: 0)."""
    from klpenalty.ops.triton import _kernels_threshold

    counts = {"search": 0, "z": 0, "refine": 0}
    for name, key in (("_bucket_sums", "search"), ("_z_read", "z"), ("_second_count", "refine")):
        real = getattr(_kernels_threshold, name)

        def counted(*args, _real=real, _key=key):
            counts[_key] += 1
            return _real(*args)

        monkeypatch.setattr(_kernels_threshold, name, counted)
    return counts


def test_top_p_on_32_bit_logits_from_a_candidate_list(monkeypatch):
    """float32 rows: top-p decided on a list of candidates (float64 masses, the exact mass
    above them) — top-p's band of value bins (a second count where the band holds too many:
    p up to 0.999), top-k's set after top-k (its k-th's tie group made by the temperature
    included) — with no search and no Z read, the rule's τ; where the list cannot decide (a
    tie group larger than the list), the searches give it. (The paths are counted
    interpreted; compiled, the τ and kept sets alone.)"""
    from klpenalty.ops.reference import kept_set_reference

    op = torch.ops.klpenalty.triton_sampling_threshold
    counts = _counting_reads(monkeypatch)
    g = torch.Generator().manual_seed(21)
    x = torch.randn(3, 3000, generator=g) * torch.tensor([[0.5], [2.0], [4.0]])
    settings = [(0, 0.5, 0.0, 1.0), (0, 0.9, 0.0, 0.7), (0, 0.99, 0.0, 1.0),
                (0, 0.999, 0.05, 1.3), (50, 0.9, 0.0, 1.0), (40, 0.95, 0.02, 0.8),
                (7, 1.0, 0.1, 1.0)]
    for top_k, top_p, min_p, temperature in settings:
        for c in counts:
            counts[c] = 0
        tau = op(_on(x), top_k, top_p, min_p, temperature).cpu()
        assert torch.equal(tau, _threshold_rule(x, top_k, top_p, min_p, temperature))
        assert CUDA or counts["search"] == counts["z"] == 0, (top_k, top_p, counts)
        kw = dict(top_k=top_k or None, top_p=top_p, min_p=min_p, temperature=temperature)
        for r in range(3):
            assert torch.equal(x[r] >= tau[r], kept_set_reference(x[r], **kw)), (r, kw)
    # p = 0.999 on the N(0, 2²) row: its band of bins holds > 1024 logits, the second count's
    for c in counts:
        counts[c] = 0
    op(_on(x[1:2]), 0, 0.999, 0.0, 1.0)
    assert CUDA or (counts["refine"] > 0 and counts["search"] == 0)
    # top-k's k-th in a tie group made by the temperature, with top-p or min-p: the list
    for row, kw in temperature_tie_cases(300, seed=4):
        if set(kw) != {"top_k", "temperature"}:
            continue
        for extra in (dict(top_p=0.999), dict(min_p=1e-6)):
            args = (kw["top_k"], extra.get("top_p", 1.0), extra.get("min_p", 0.0),
                    kw["temperature"])
            counts["search"] = counts["z"] = 0
            tau = op(_on(row), *args).cpu()
            assert torch.equal(tau, _threshold_rule(row, *args)), (kw, extra)
            assert CUDA or counts["search"] == counts["z"] == 0
    # the list cannot decide: 4 values (top-p's answer a tie group of ~750), a one-hot row at
    # T = 50 (top-k's set the −30 group); a top-k whose set could pass CAND_MAX takes no list
    assert th.cand_cap(200_000, th.CAND_MAX // 2 + 1) == 0 < th.cand_cap(200_000, 50)
    ties = torch.randint(0, 4, (1, 3000), generator=g).float()
    onehot = torch.full((1, 3000), -30.0)
    onehot[0, 5] = 10.0
    for row, setting in [(ties, (0, 0.9, 0.0, 1.0)), (onehot, (10, 0.9, 0.05, 50.0))]:
        counts["search"] = 0
        tau = op(_on(row), *setting).cpu()
        assert torch.equal(tau, _threshold_rule(row, *setting)), setting
        assert CUDA or counts["search"] > 0, setting


def _sampler_search(make_rows, trials: int, seed: int):
    """Random sampler settings (top-k, top-p up to 0.999, min-p, temperatures 0.3 to 3) on
    the rows ``make_rows(trial, pick, g)`` gives (2 a trial): the kernels' τ is the rule's bit
    for bit and keeps the float64 kept set."""
    from klpenalty.ops.reference import kept_set_reference

    op = torch.ops.klpenalty.triton_sampling_threshold
    g = torch.Generator().manual_seed(seed)

    def pick(options):
        return options[int(torch.randint(0, len(options), (1,), generator=g))]

    for trial in range(trials):
        x = make_rows(trial, pick, g)
        vocab = x.shape[-1]
        if trial % 4 == 2:
            x[0, torch.randint(0, vocab, (vocab // 10,), generator=g)] = NINF
            x[1, : vocab // 3] = x[1, vocab // 3: 2 * (vocab // 3)]  # every value twice
        setting = (pick([0, 0, 3, 40]), pick([1.0, 0.5, 0.9, 0.99, 0.999]),
                   pick([0.0, 0.0, 0.01, 0.1]), pick([0.3, 0.7, 1.0, 1.3, 3.0]))
        if setting[:3] == (0, 1.0, 0.0):
            setting = (0, 0.95) + setting[2:]
        tau = op(_on(x), *setting).cpu()
        assert torch.equal(tau, _threshold_rule(x, *setting)), (trial, setting)
        kw = dict(top_k=setting[0] or None, top_p=setting[1], min_p=setting[2],
                  temperature=setting[3])
        for r in range(2):
            assert torch.equal(x[r].float() >= tau[r], kept_set_reference(x[r], **kw)), (
                trial, r, kw)


def test_fp32_and_fp16_sampler_thresholds_in_a_random_search():
    """A random search over float32 and float16 rows, which take the same candidate lists
    (scales 0.05 to 8, offsets, values of a bf16 grid, a few −inf, repeated values) and
    sampler settings (:func:`_sampler_search`), whichever of the candidate list, the second
    count or the searches decides."""

    def rows(trial, pick, g):
        vocab = pick([257, 3000])
        x = torch.randn(2, vocab, generator=g) * pick([0.05, 0.5, 2.0, 8.0]) + pick([0.0, 30.0])
        if trial % 3 == 1:
            x = x.bfloat16().float()  # a bf16 model's logits upcast: many equal values
        if trial % 3 == 2:
            x = x.half()
        return x

    _sampler_search(rows, 40, seed=33)


def test_bf16_sampler_thresholds_in_a_random_search(window_chunk):
    """A random search over bf16 rows (scales 0.05 to 8, offsets −30 to 30: the answer in the
    window of keys, in a chunk of it below the max's, or below the window; a few −inf, every
    value twice) and sampler settings (:func:`_sampler_search`), the window whole and in
    chunks (``window_chunk``)."""

    def rows(trial, pick, g):
        x = torch.randn(2, pick([257, 3000]), generator=g) * pick([0.05, 0.5, 2.0, 8.0])
        return (x + pick([0.0, 0.0, 3.0, 30.0, -30.0])).bfloat16()

    _sampler_search(rows, 24, seed=34)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_sampling_threshold_kernel_on_rows_split_across_programs(dtype):
    """Two rows of V = 2500 split into programs (the plan for few rows): the programs' maxima,
    NaN flags and top-k's digit histograms merged per row give the rule's τ — the k-th's tie
    group spread over both programs, the row's max in the second, a NaN in one program only,
    an +inf logit; 32-bit keys take three digits, 16-bit ones two (five and three with the
    7-bit digits of Triton before 3.9)."""
    from klpenalty.ops.triton import token_stats as ts

    vocab = 2500
    assert ts.split_columns(2, vocab, torch.device("cpu"))[1] < vocab
    g = torch.Generator().manual_seed(11)
    x = (torch.randn(2, vocab, generator=g) * 2.0).to(dtype)
    x[0, 2300] = 12.0  # the row's max, in the second program
    kth = x[0].float().sort(descending=True).values[20]
    x[0, [100, 1900, 2100, 2400]] = kth.to(dtype)  # a tie group in both programs
    k = int((x[0].float() > kth).sum()) + 2  # the k-th inside that group
    y = x.clone()
    y[0, 2200] = float("nan")  # a NaN in the second program only
    y[1, 30] = float("inf")
    op = torch.ops.klpenalty.triton_sampling_threshold
    for top_k, top_p, min_p, temperature in [(k, 1.0, 0.0, 1.0), (24, 0.9, 0.05, 1.0),
                                             (3, 1.0, 0.0, 0.7), (0, 0.8, 0.0, 1.0)]:
        for rows in (x, y):
            tau = op(_on(rows), top_k, top_p, min_p, temperature).cpu()
            want = _threshold_rule(rows, top_k, top_p, min_p, temperature)
            assert _same(tau, want), (top_k, top_p, min_p, temperature, tau, want)
        assert torch.isnan(tau[0])  # (y: the NaN row)
    assert op(_on(x), k, 1.0, 0.0, 1.0)[0].item() == kth.item()


@pytest.mark.parametrize("vocab", [8, 300, 4096])
def test_sampling_threshold_kernel_keeps_ties_made_by_the_temperature(vocab):
    """Rows holding two adjacent float32 logits whose keys x/T (``div_rn``) round equal, at the
    top-p boundary, inside the prefix, as top-k's k-th and at the min-p boundary: the portable
    rule's τ bit for bit (tests/test_sampling.py holds the native kernel to it) and the float64
    rule's kept set."""
    from klpenalty.ops.reference import kept_set_reference

    op = torch.ops.klpenalty.triton_sampling_threshold
    cases = temperature_tie_cases(vocab, seed=vocab)
    if vocab > 300:  # the interpreter's seconds: the wide rows' top-p cases (the mass search)
        cases = [(x, kw) for x, kw in cases if "top_k" not in kw and "top_p" in kw]
    for x, kw in cases:
        args = (kw.get("top_k", 0), kw.get("top_p", 1.0), kw.get("min_p", 0.0), kw["temperature"])
        tau = op(_on(x), *args).cpu()
        assert torch.equal(tau, _threshold_rule(x, *args)), kw
        assert torch.equal(x >= tau.unsqueeze(-1), kept_set_reference(x, **kw)), kw


def test_a_tie_made_by_the_temperature_in_the_forward():
    """The forward's own threshold keeps the pair whose x/0.7 round equal (the larger logit
    first): the KL and log-prob of the float64 rule's kept set."""
    x = torch.tensor([[0.9999879598617554, 0.9999880194664001, -5.0]])
    y = torch.tensor([[0.3, -0.2, 0.1]])
    kw = dict(top_p=0.7, temperature=0.7, backend="triton")
    kept = torch.tensor([[True, True, False]])
    want = full_kl_reference(torch.where(kept, x.double(), NINF), y, 0.7)
    torch.testing.assert_close(klpenalty.full_kl(_on(x), _on(y), **kw).cpu().double(), want,
                               **tol(torch.float32))
    lp = klpenalty.token_logprobs(_on(x), _on(torch.tensor([0])), **kw).cpu().double()
    torch.testing.assert_close(lp, torch.tensor([math.log(0.5)], dtype=torch.float64),
                               **tol(torch.float32))


@pytest.mark.parametrize("dtype,vocab_chunk", [(torch.float32, 0), (torch.bfloat16, 16)],
                         ids=["fp32", "bf16-split"])
def test_forward_with_the_sampler_settings(dtype, vocab_chunk):
    """The forward given top_k / top_p / min_p computes τ_s in the kernels: the out and stats
    of the forward given that τ (identical; ST_TAU = the τ used, max(tau, τ_s) with a tau given
    too) and the float64 reference on that support; gradients through ST_TAU."""
    from klpenalty.ops import contract
    from klpenalty.ops.reference import token_stats_reference

    x, y = make_logits((2, 3, 41), dtype, seed=7)
    x.view(-1, 41)[4, ::5] = NINF
    tokens = x.float().argmax(-1)
    tokens[1, 2] = 5
    op = torch.ops.klpenalty.triton_token_stats
    fixed = torch.full((2, 3), -1.0)
    fixed[0, 0] = 2.5  # above the sampler's τ on that row
    for top_k, top_p, min_p, temperature in [(6, 1.0, 0.0, 1.0), (0, 0.85, 0.0, 0.7),
                                             (9, 0.9, 0.04, 1.2)]:
        for tau in (None, fixed):
            args = [_on(x), _on(y), _on(tokens), None, None, None if tau is None else _on(tau),
                    temperature, -100, 15, False, 0, vocab_chunk]
            out, stats = op(*args, top_k, top_p, min_p)
            tau_s = torch.ops.klpenalty.triton_sampling_threshold(
                _on(x), top_k, top_p, min_p, temperature)
            used = tau_s if tau is None else torch.maximum(tau_s, _on(tau))
            args[5] = used
            out2, stats2 = op(*args, 0, 1.0, 0.0)
            assert torch.equal(out.nan_to_num(), out2.nan_to_num())
            assert torch.equal(stats.nan_to_num(), stats2.nan_to_num())
            assert torch.equal(stats[..., contract.ST_TAU], used)
            want = token_stats_reference(x, y, tokens, None, None, used.cpu(), temperature,
                                         -100, 15)
            torch.testing.assert_close(out.cpu().double(), want, **tol(dtype))
    # no support at all: ST_TAU is −inf
    _, stats = op(_on(x), _on(y), None, None, None, None, 1.0, -100, 1, False, 0, 0, 0, 1.0, 0.0)
    assert torch.all(stats[..., contract.ST_TAU] == NINF)
    # the gradient of the fused forward: that of the forward given the τ it used
    xs = _on(x).clone().requires_grad_()
    out, stats = op(xs, _on(y), _on(tokens), None, None, None, 0.9, -100, 15, False, 0,
                    vocab_chunk, 8, 0.9, 0.0)
    (gx,) = torch.autograd.grad(out.nan_to_num().sum(), xs)
    xs2 = _on(x).clone().requires_grad_()
    out2, _ = op(xs2, _on(y), _on(tokens), None, None, stats[..., contract.ST_TAU].detach(),
                 0.9, -100, 15, False, 0, vocab_chunk, 0, 1.0, 0.0)
    (gx2,) = torch.autograd.grad(out2.nan_to_num().sum(), xs2)
    assert torch.equal(gx, gx2)


@pytest.mark.slow
def test_threshold_kernel_compiles_for_a_cuda_target():
    """The threshold kernels (the row's, and the split scan's passes) lower to PTX for sm_90 in
    each combination of the settings the host launches (top-k, top-p, min-p, a tau given) and
    each key width (bf16, fp16, fp32)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = textwrap.dedent(f"""
        import itertools, triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from klpenalty.ops.triton import _kernels_threshold as k
        t = GPUTarget("cuda", 90, 32)
        n = 0
        for (dt, shift), (top_k, top_p, min_p, has_tau) in itertools.product(
                [("*bf16", 16), ("*fp16", 13), ("*fp32", 0)],
                [(1, 0, 0, 0), (0, 1, 0, 1), (0, 0, 1, 0), (1, 1, 1, 1)]):
            sig = {{"x_ptr": dt, "part_ptr": "*fp32", "hist_ptr": "*i32", "zpart_ptr": "*fp64",
                   "list_ptr": "*fp64",
                   "tau_in_ptr": "*fp32", "tau_ptr": "*fp32", "T": "i32", "stride_xb": "i64",
                   "stride_xt": "i64",
                   "V": "i32", "n_splits": "i32", "hist_stride": "i32", "top_k": "i32",
                   "top_p_bits": "i64", "log_min_p_bits": "i64", "window_bits": "i64",
                   "temperature": "fp32"}}
            # top-p from the window of keys as the host picks it (threshold.tau_rows), else
            # from a candidate list (2: top-p's band, 3: top-k's set), as fp32's top-k with
            # min-p alone
            bf16 = shift == 16
            window = bool(top_p) and shift > 0 and (
                bf16 and not top_k if k.PER_WARP_HISTOGRAM else bf16 or bool(top_k))
            listed = not window and (not shift or top_p)
            cand = (3 if top_k and (top_p or min_p) else (2 if top_p else 0)) if listed else 0
            c = dict(TOP_K=bool(top_k), TOP_P=bool(top_p), MIN_P=bool(min_p),
                     HAS_TAU=bool(has_tau), KEY_SHIFT=shift, NB_LAST=32,
                     WINDOW=window, ZSUM=window and not top_k, CAND=cand, SPLITS=4,
                     BLOCK={th.THRESHOLD_BLOCK}, BT={32 * th.THRESHOLD_WARPS},
                     F={th.THRESHOLD_BUCKETS})
            s = {{**sig, **{{name: "constexpr" for name in c}}}}
            src = ASTSource(fn=k.threshold_kernel, signature=s, constexprs=c)
            assert ".entry" in triton.compile(src, target=t).asm["ptx"]
            n += 1
            if cand:  # the candidate list's passes (the band's count, its read; top-k's set)
                sig = {{"x_ptr": dt, "part_ptr": "*fp32", "hist_ptr": "*i32",
                       "zpart_ptr": "*fp64", "cstate_ptr": "*i32", "cand_ptr": "*fp32",
                       "T": "i32", "stride_xb": "i64", "stride_xt": "i64", "V": "i32",
                       "cols": "i32", "n_splits": "i32", "hist_stride": "i32", "scale": "fp32",
                       "log_min_p_bits": "i64", "temperature": "fp32"}}
                for mode in ((1, 4, 2) if cand == 2 else (3,)):
                    c = dict(MODE=mode, MIN_P=bool(min_p), CAP=256, NBINS=2048,
                             KEY_SHIFT=shift, SPLITS=4, BLOCK=2048)
                    s = {{**sig, **{{name: "constexpr" for name in c}}}}
                    src = ASTSource(fn=k.threshold_cand_kernel, signature=s, constexprs=c)
                    assert ".entry" in triton.compile(src, target=t).asm["ptx"]
                    n += 1
                sig = {{"part_ptr": "*fp32", "zpart_ptr": "*fp64", "cstate_ptr": "*i32",
                       "cand_ptr": "*fp32", "list_ptr": "*fp64", "n_splits": "i32",
                       "top_p_bits": "i64", "log_min_p_bits": "i64", "temperature": "fp32"}}
                c = dict(MODE=cand, CAP=1024, SPLITS=4)
                s = {{**sig, **{{name: "constexpr" for name in c}}}}
                src = ASTSource(fn=k.threshold_list_kernel, signature=s, constexprs=c)
                assert ".entry" in triton.compile(src, target=t).asm["ptx"]
                n += 1
            if not top_p:  # the scan's passes once a key width: all flags on, top-p alone
                continue
            for pass_, (high, low) in enumerate([(32 - shift, 24 - shift),
                                                     (24 - shift, max(16 - shift, 0))]):
                if not top_k and (pass_ or not window):  # top-p alone: its window's scan
                    continue
                sig = {{"x_ptr": dt, "part_ptr": "*fp32", "hist_ptr": "*i32",
                       "zpart_ptr": "*fp64", "T": "i32", "stride_xb": "i64",
                       "stride_xt": "i64", "V": "i32", "cols": "i32", "n_splits": "i32",
                       "hist_stride": "i32", "temperature": "fp32"}}
                c = dict(SCAN=pass_ == 0 and bool(top_k), HIST=bool(top_k), PASS=pass_,
                         WINDOW=(pass_ == 1 or not top_k) and window,
                         ZSUM=not top_k, KEY_SHIFT=shift, DIGIT_HI=high, DIGIT_LO=low,
                         SPLITS=4, BLOCK=1024)
                s = {{**sig, **{{name: "constexpr" for name in c}}}}
                src = ASTSource(fn=k.threshold_scan_kernel, signature=s, constexprs=c)
                assert ".entry" in triton.compile(src, target=t).asm["ptx"]
        sig = {{"hist_ptr": "*i32", "n_splits": "i32", "hist_stride": "i32", "top_k": "i32",
               "PASS": "constexpr", "NB": "constexpr"}}
        src = ASTSource(fn=k.threshold_select_kernel, signature=sig,
                        constexprs=dict(PASS=1, NB=256))
        assert ".entry" in triton.compile(src, target=t).asm["ptx"]
        sig = {{"zpart_ptr": "*fp64", "hist_ptr": "*i32", "cstate_ptr": "*i32", "n_splits": "i32",
               "hist_stride": "i32", "top_p_bits": "i64", "scale": "fp32", "LEVEL": "constexpr",
               "CAP": "constexpr", "NBINS": "constexpr", "SPLITS": "constexpr"}}
        for level in (0, 1):
            src = ASTSource(fn=k.threshold_band_kernel, signature=sig,
                            constexprs=dict(LEVEL=level, CAP=1024, NBINS=2048, SPLITS=4))
            assert ".entry" in triton.compile(src, target=t).asm["ptx"]
        print("OK", n)
    """)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=600, cwd=ROOT)
    assert done.returncode == 0 and "OK" in done.stdout, done.stderr[-3000:]
    # the row's kernel in its 12 settings, fp32's band (3 passes and the list) and top-k's set
    # (a pass and the list), and 16-bit lists by the Triton version
    assert int(done.stdout.split()[-1]) >= 18
