"""The one-pass token_stats op of the streaming backend: the shared grid (tests/ops/cases.py),
tile invariance, agreement with the single-output ops, double backward, torch.compile, host
syncs and memory."""

from __future__ import annotations

import pytest
import torch

from klpenalty.ops import contract
from klpenalty.ops.contract import WANT_ALL
from klpenalty.ops import engine, streaming
from klpenalty.ops.reference import token_stats_reference
from tests.helpers import DTYPES, make_logits, tol
from tests.helpers import views
from tests.ops.cases import TOKEN_STATS_SCENARIOS, check_token_stats, token_stats_case
from tests.ops.test_engine import _CountSyncs
from klpenalty.bench import alloc_profile


def _run(**tiles):
    def run(x, y, tokens, mask, keep, tau, temperature, want, **kw):
        return views.streaming.token_stats(
            x, y, tokens, mask, keep, tau, temperature, want=want, **tiles, **kw
        )

    return run


@pytest.mark.parametrize("scenario", TOKEN_STATS_SCENARIOS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_shared_grid(dtype, scenario):
    """Vocabulary tiles of 8 columns and 4 rows: every row is merged over 5 tiles."""
    check_token_stats(_run(vocab_chunk=8, chunk_rows=4), dtype, scenario=scenario)


def test_tile_invariance_of_values_and_gradients():
    c = token_stats_case(torch.float32)
    x, y = c["x"].requires_grad_(), c["y"].requires_grad_()
    g = torch.linspace(-1.0, 1.5, 24).reshape(2, 3, 4)

    def run(**tiles):
        out = views.streaming.token_stats(
            x, y, c["tokens"], c["mask"], c["keep"], c["tau"], 0.9, want=WANT_ALL, **tiles
        )
        return (out, *torch.autograd.grad(out, (x, y), g))

    base = run()
    for tiles in ({"vocab_chunk": 1}, {"vocab_chunk": 5, "chunk_rows": 1}, {"vocab_chunk": 36},
                  {"chunk_rows": 2}, {"tile_elements": 16}):
        for a, b in zip(run(**tiles), base):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_without_support_it_is_the_single_output_ops(dtype):
    """π̃ = π without keep/tau: the columns equal full_kl, token_logprobs (of x and of y) and
    entropy of the same backend, and so do their gradients."""
    x, y = make_logits((3, 4, 29), dtype, seed=3)
    x.requires_grad_()
    y.requires_grad_()
    tokens = torch.randint(0, 29, (3, 4), generator=torch.Generator().manual_seed(2))
    tokens[0, 1] = -100
    mask = torch.ones(3, 4, dtype=torch.bool)
    mask[2, 3] = False
    out = views.streaming.token_stats(x, y, tokens, mask, None, None, 0.8, want=WANT_ALL, check=True)
    cols = (
        views.streaming.full_kl(x, y, mask, 0.8),
        views.streaming.token_logprobs(x, tokens, 0.8).masked_fill(~mask, 0.0),
        views.streaming.token_logprobs(y, tokens, 0.8).masked_fill(~mask, 0.0),
        views.streaming.entropy(x, mask, 0.8),
    )
    rt = 1e-6 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(out, torch.stack(cols, -1), rtol=rt, atol=rt)
    g = torch.randn(3, 4, 4, dtype=out.dtype)
    got = torch.autograd.grad(out, (x, y), g)
    want = torch.autograd.grad(sum((c * g[..., i]).sum() for i, c in enumerate(cols)), (x, y))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=10 * rt, atol=10 * rt)


def test_stats_hold_the_contract_columns():
    c = token_stats_case(torch.float64)
    args = (c["x"], c["y"], c["tokens"], c["mask"], c["keep"], c["tau"], 0.7, -100, 15, True, 0, 0,
            0, 1.0, 0.0)
    out, stats = torch.ops.klpenalty.streaming_token_stats(*args)
    assert stats.shape == (2, 3, contract.STATS_COLS) and stats.dtype == torch.float64
    counted = c["mask"] & (c["tokens"] != -100)
    torch.testing.assert_close(stats[..., contract.ST_LOGP][counted], out[..., contract.OUT_LOGP][counted])
    torch.testing.assert_close(stats[..., contract.ST_REF_LOGP][counted], out[..., contract.OUT_REF_LOGP][counted])
    # KL = E_π̃[u − w] − log s_x + log s_y and H = log s_x − E_π̃[u] on the counted rows
    m = c["mask"]
    kl = stats[..., contract.ST_MEAN_D] - stats[..., contract.ST_LOG_S_X] + stats[..., contract.ST_LOG_S_Y]
    torch.testing.assert_close(kl[m], out[..., contract.OUT_KL][m])
    h = stats[..., contract.ST_LOG_S_X] - stats[..., contract.ST_MEAN_U]
    torch.testing.assert_close(h[m].clamp_min(0), out[..., contract.OUT_ENTROPY][m])


def test_want_must_match_the_inputs():
    x, y = make_logits((2, 5))
    tokens = torch.zeros(2, dtype=torch.long)
    for want, args, match in (
        (0, (y, tokens), r"want must be an int in \[1, 15\]"),
        (16, (y, tokens), r"want must be an int in \[1, 15\]"),
        (1, (None, tokens), "without ref_logits"),
        (4, (None, tokens), "without ref_logits"),
        (2, (y, None), "without tokens"),
    ):
        with pytest.raises(ValueError, match=match):
            views.streaming.token_stats(x, *args, None, None, None, 1.0, want=want)


def test_hessian_vector_product_with_a_support():
    """create_graph=True recomputes the first derivative with the differentiable formula of
    ops/contract.py: a Hessian-vector product of Σ g·out (all four columns, keep and tau)
    against float64 autograd through the reference (off-support entries at −1e6, mass 0)."""
    c = token_stats_case(torch.float64)
    x, y, tokens, mask, keep, tau = (c[k] for k in ("x", "y", "tokens", "mask", "keep", "tau"))
    g = torch.linspace(-1.0, 1.5, 24, dtype=torch.float64).reshape(2, 3, 4)
    vec = torch.randn(x.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    xg = x.detach().requires_grad_()
    out = views.streaming.token_stats(xg, y, tokens, mask, keep, tau, 0.8, want=WANT_ALL)
    (gx,) = torch.autograd.grad(out, xg, g, create_graph=True)
    (hvp,) = torch.autograd.grad((gx * vec).sum(), xg)
    kept = torch.isfinite(contract.kept_logits(x, keep, tau))
    xr = x.detach().requires_grad_()
    yr = torch.where(torch.isfinite(y), y, -1e6)
    ref = token_stats_reference(torch.where(kept, xr, -1e6), yr, tokens, mask, None, None, 0.8,
                                -100, 15)
    (gr,) = torch.autograd.grad((ref * g).sum(), xr, create_graph=True)
    (want,) = torch.autograd.grad((gr * vec).sum(), xr)
    torch.testing.assert_close(gx.detach(), gr.detach(), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(hvp, want, rtol=1e-9, atol=1e-9)


def test_token_off_the_support_first_derivative_equals_the_differentiable_one():
    """check=False with a sampled token off the support: log π̃(t) = −inf; the backend's first
    derivative and the create_graph=True one agree (−π̃·g/T on the row, 0 at the token), and
    the reference's log ρ(t) keeps its onehot term."""
    x, y = make_logits((3, 11), torch.float64, seed=9)
    tokens = torch.tensor([2, 7, 0])
    keep = torch.ones(3, 11, dtype=torch.bool)
    keep[1, 7] = False  # row 1's token is off the support
    g = torch.linspace(-1.0, 1.5, 12, dtype=torch.float64).reshape(3, 4)
    xg, yg = x.detach().requires_grad_(), y.detach().requires_grad_()
    out = views.streaming.token_stats(xg, yg, tokens, None, keep, None, 0.9, want=WANT_ALL, check=False)
    assert torch.isneginf(out[1, 1])
    first = torch.autograd.grad(out, (xg, yg), g)
    out = views.streaming.token_stats(xg, yg, tokens, None, keep, None, 0.9, want=WANT_ALL, check=False)
    second = torch.autograd.grad(out, (xg, yg), g, create_graph=True)
    for a, b in zip(first, second):
        torch.testing.assert_close(a, b.detach(), rtol=1e-10, atol=1e-12)
    assert first[0][1, 7] == 0 and first[1][1, 7] != 0


def test_fullgraph_compile_gives_the_same_numbers():
    c = token_stats_case(torch.float32)
    x = c["x"].contiguous().requires_grad_()
    y = c["y"].contiguous()

    def step(x, y, tokens, mask, keep, tau):
        out = views.streaming.token_stats(x, y, tokens, mask, keep, tau, 0.9, want=WANT_ALL, check=True)
        return (out * torch.tensor([1.0, -0.5, 0.25, 0.1])).sum()

    args = (x, y, c["tokens"], c["mask"], c["keep"], c["tau"])
    torch._dynamo.reset()
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(*args)
    want = step(*args)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(torch.autograd.grad(got, x)[0], torch.autograd.grad(want, x)[0])


@pytest.mark.parametrize("check,expected", [(False, 0), (True, 1)])
def test_accelerator_path_syncs_only_once(monkeypatch, check, expected):
    """Without free host checks: one host read for all of check=True's checks, none in the tile
    loops, none in the backward (no host-to-device copy either)."""
    monkeypatch.setattr(streaming.token_stats, "_host_checks", lambda device: False)
    c = token_stats_case(torch.float32)
    x = c["x"].requires_grad_()
    with monkeypatch.context() as patch:
        counter = _CountSyncs(patch)
        out = views.streaming.token_stats(
            x, c["y"], c["tokens"], c["mask"], c["keep"], c["tau"], 0.7, want=WANT_ALL, check=check,
            vocab_chunk=8,
        )
        assert counter.syncs == expected
        counter.syncs = 0
        out.sum().backward()
        assert counter.syncs == 0
    want = token_stats_reference(
        c["x"].detach(), c["y"], c["tokens"], c["mask"], c["keep"], c["tau"], 0.7, -100, 15
    )
    torch.testing.assert_close(out.detach().double(), want, **tol(torch.float32))


def test_accelerator_linear_kl_chunks_never_sync_without_checks(monkeypatch):
    """linear_kl without host checks, check=False and no mask: no host sync in the forward or
    the backward, whatever the number of chunks (three here, each a forward and a backward op
    call: no tensor built from host data per chunk)."""
    from klpenalty import linear
    from klpenalty.linear import chunks, kl

    monkeypatch.setattr(streaming.token_stats, "_host_checks", lambda device: False)
    monkeypatch.setattr(chunks, "host_checks", lambda device: False)
    monkeypatch.setattr(kl, "host_checks", lambda device: False)
    gen = torch.Generator().manual_seed(5)
    hp, hr = torch.randn(6, 8, generator=gen), torch.randn(6, 8, generator=gen)
    wp, wr = torch.randn(40, 8, generator=gen), torch.randn(40, 8, generator=gen)
    hp.requires_grad_()
    tokens = torch.randint(0, 40, (6,), generator=gen)
    tokens[1] = -100
    with monkeypatch.context() as patch:
        counter = _CountSyncs(patch)
        s = linear.linear_kl(hp, wp, hr, wr, tokens=tokens, entropy=True, chunk_rows=2,
                             backend="streaming", check=False)
        assert counter.syncs == 0
        (s.kl - 0.5 * s.logprobs + 0.25 * s.entropy).sum().backward()
        assert counter.syncs == 0
    x, y = (hp.detach() @ wp.t()), (hr @ wr.t())
    want = token_stats_reference(x, y, tokens, None, None, None, 1.0, -100, 15)
    got = torch.stack([s.kl, s.logprobs, s.ref_logprobs, s.entropy], -1).detach()
    torch.testing.assert_close(got.double(), want, **tol(torch.float32))
    assert hp.grad is not None and torch.isfinite(hp.grad).all()


def test_forward_with_a_support_allocates_nothing_of_size_rows_by_vocab():
    n, v = 64, 4096  # one float32 input = 1 MiB; the keep mask alone is 256 KiB
    x, y = make_logits((n, v), torch.float32, seed=16)
    keep = torch.rand(n, v, generator=torch.Generator().manual_seed(0)) < 0.5
    tau = x.kthvalue(v - 100, -1).values
    tokens = x.argmax(-1)
    tile = 1 << 12  # 16 KiB of float32 per buffer
    with torch.no_grad():
        peak, largest = alloc_profile(
            lambda: views.streaming.token_stats(
                x, y, tokens, None, keep, tau, 0.7, want=WANT_ALL, tile_elements=tile
            )
        )
    # a handful of tile buffers (d, e, w, h, the kept tile, bool tiles) + O(N) statistics
    assert largest <= tile * 4
    assert peak <= 8 * tile * 4 + 64 * n * 16
    assert peak < n * v / 2  # below half of the smallest (N, V) tensor there is, a bool mask
