"""The engine's numerics: offsets, merges, empty batches, second derivatives, torch.compile and
host synchronisation."""

from __future__ import annotations

import pytest
import torch

import klpenalty
from klpenalty.ops import dispatch, engine, native, streaming
from klpenalty.ops.reference import full_kl_reference, token_logprobs_reference
from tests.helpers import grad_tol, patch_torch, tol
from tests.helpers import views

NINF = float("-inf")


def _pair(shape, seed=0, spread=1.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * spread, torch.randn(shape, generator=g) * spread


# ----------------------------------------------------------------------- offsets
@pytest.mark.parametrize("offset_x,offset_y", [(1e4, -1e4), (-1e4, 1e4), (1e4, 1e4), (3e3, -50.0)])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("vocab_chunk", [None, 5])
def test_opposite_offsets_keep_float32_accuracy(offset_x, offset_y, temperature, vocab_chunk):
    """full_kl(x + 1e4, y − 1e4) was 1.5e-3 nats off: two terms of size |m_y − m_x| cancelled.

    Rows span ≤ 30 nats (randn·5); the float64 KL of the *same* float32 tensors is the truth.
    """
    x, y = _pair((3, 17), seed=1, spread=5.0)
    xs, ys = x + offset_x, y + offset_y
    got = views.streaming.full_kl(xs, ys, None, temperature, vocab_chunk=vocab_chunk)
    torch.testing.assert_close(
        got.double(), full_kl_reference(xs, ys, temperature), **tol(torch.float32)
    )


def test_offset_error_does_not_grow_with_the_offset():
    """KL up to ~10 nats on 64 rows of V = 1000: the same tolerance at every offset."""
    x, y = _pair((64, 1000), seed=2, spread=3.0)
    for off in (0.0, 1e2, 1e3, 1e4):
        xs, ys = x + off, y - off
        got = klpenalty.full_kl(xs, ys).double()
        torch.testing.assert_close(got, full_kl_reference(xs, ys), **tol(torch.float32))


def test_opposite_offset_gradients_match_reference():
    x, y = _pair((4, 40), seed=3, spread=4.0)
    xs = (x + 1e4).requires_grad_()
    ys = (y - 1e4).requires_grad_()
    g = torch.linspace(-1.0, 2.0, 4)
    gx, gy = torch.autograd.grad(views.streaming.full_kl(xs, ys, None, 0.9, vocab_chunk=7), (xs, ys), g)
    xr, yr = xs.detach().double().requires_grad_(), ys.detach().double().requires_grad_()
    wx, wy = torch.autograd.grad((full_kl_reference(xr, yr, 0.9) * g.double()).sum(), (xr, yr))
    torch.testing.assert_close(gx.double(), wx, **grad_tol(torch.float32))
    torch.testing.assert_close(gy.double(), wy, **grad_tol(torch.float32))


# ----------------------------------------------------------------------- the merge
def test_merge_is_associative_and_equals_one_pass():
    """Three slices merged in either grouping give the state of the whole row."""
    x, y = _pair((5, 30), seed=4, spread=3.0)
    x[0, :10] = NINF  # a slice with no policy mass in row 0
    y[1, 20:] = NINF  # a slice with no reference mass in row 1 (policy has mass: KL = inf)
    ws = engine.Workspace(5, 30, torch.float64, x.device)
    t = 0.8

    def part(a, b):
        xs, ys = x[:, a:b].double(), y[:, a:b].double()
        return engine.stats_partial(xs, ys, t, ws, True, kl=True, entropy=True)[0]

    p0, p1, p2 = part(0, 10), part(10, 20), part(20, 30)
    left = engine.stats_merge(engine.stats_merge(p0, p1, t), p2, t)
    right = engine.stats_merge(p0, engine.stats_merge(p1, p2, t), t)
    whole = part(0, 30)
    for a, b, c in zip(left, right, whole):
        torch.testing.assert_close(a, c, **tol(torch.float64))
        torch.testing.assert_close(b, c, **tol(torch.float64))
    kl, _, _ = engine.stats_finalize(left, None)
    torch.testing.assert_close(kl, full_kl_reference(x, y, t), **tol(torch.float64))
    assert kl[1] == float("inf")


# ----------------------------------------------------------------------- empty batch
def test_empty_batch_gives_empty_results_and_gradients():
    x = torch.randn(0, 4, 10, requires_grad=True)
    y = torch.randn(0, 4, 10, requires_grad=True)
    kl = klpenalty.full_kl(x, y, mask=torch.ones(0, 4, dtype=torch.bool))
    assert kl.shape == (0, 4)
    gx, gy = torch.autograd.grad(kl.sum(), (x, y))
    assert gx.shape == x.shape and gy.shape == y.shape
    lp = klpenalty.token_logprobs(x, torch.zeros(0, 4, dtype=torch.long))
    assert lp.shape == (0, 4)
    assert torch.autograd.grad(lp.sum(), x)[0].shape == x.shape
    reward_kl, loss_kl = klpenalty.full_kl_reward_and_loss(x, y)
    assert reward_kl.shape == loss_kl.shape == (0, 4)
    assert klpenalty.kl_penalized_reward(x, y, torch.zeros(0, 4)).shape == (0, 4)


# ----------------------------------------------------------------------- double backward
def test_gradgradcheck_full_kl_and_token_logprobs():
    x, y = _pair((3, 6), seed=5)
    x, y = x.double().requires_grad_(), y.double().requires_grad_()
    mask = torch.tensor([True, False, True])
    torch.autograd.gradgradcheck(
        lambda a, b: klpenalty.full_kl(a, b, mask=mask, temperature=0.7), (x, y)
    )
    tokens = torch.tensor([0, 5, 2])
    torch.autograd.gradgradcheck(
        lambda a: klpenalty.token_logprobs(a, tokens, temperature=1.3), (x,)
    )


def test_hessian_vector_product_matches_reference():
    """A Hessian-vector product (TRPO, natural gradient) through the float32 KL."""
    x, y = _pair((4, 9), seed=6)
    x.requires_grad_()
    vec = torch.randn(4, 9)
    (g,) = torch.autograd.grad(klpenalty.full_kl(x, y).sum(), x, create_graph=True)
    assert g.grad_fn is not None
    (hvp,) = torch.autograd.grad((g * vec).sum(), x)
    xr = x.detach().double().requires_grad_()
    (gr,) = torch.autograd.grad(full_kl_reference(xr, y).sum(), xr, create_graph=True)
    (want,) = torch.autograd.grad((gr * vec.double()).sum(), xr)
    torch.testing.assert_close(hvp.double(), want, **grad_tol(torch.float32))


# ----------------------------------------------------------------------- torch.compile
def _step(policy_logits, ref_logits, tokens, mask):
    kl = klpenalty.full_kl(policy_logits, ref_logits, mask=mask, temperature=0.9)
    lp = klpenalty.token_logprobs(policy_logits, tokens, temperature=0.9)
    ref_lp = klpenalty.token_logprobs(ref_logits, tokens, temperature=0.9)
    reward_kl, loss_kl = klpenalty.full_kl_reward_and_loss(policy_logits, ref_logits, mask=mask)
    k3 = klpenalty.k3_ratio_loss(lp, ref_lp, mask=mask)
    loss = (kl + loss_kl + k3 - lp * reward_kl).sum()
    return loss


def _step_inputs():
    x, y = _pair((2, 5, 33), seed=7, spread=2.0)
    tokens = torch.randint(0, 33, (2, 5), generator=torch.Generator().manual_seed(1))
    tokens[1, 0] = -100  # ignored position
    mask = torch.tensor([[True] * 5, [False, True, True, True, False]])
    return x.requires_grad_(), y, tokens, mask


def test_no_graph_breaks():
    x, y, tokens, mask = _step_inputs()
    explanation = torch._dynamo.explain(_step)(x, y, tokens, mask)
    assert explanation.graph_break_count == 0, explanation.break_reasons


@pytest.mark.parametrize(
    "compiler,cpu_backend",
    [
        ("aot_eager", "native"),  # dynamo + AOT autograd through the fake implementations
        ("aot_eager", "streaming"),
        pytest.param("inductor", "native", marks=pytest.mark.slow),  # the real compiler, ~3-10 s
    ],
)
def test_fullgraph_compile_of_a_training_step_gives_the_same_numbers(
    compiler, cpu_backend, monkeypatch
):
    """Through the backend that backend="auto" picks on CPU (tests/ops/test_native.py asserts
    that the native kernel builds here)."""
    if cpu_backend == "streaming":
        monkeypatch.setattr(native, "available", lambda: False)
    elif not native.available():
        pytest.skip("the native kernel is unavailable (no C++ compiler)")
    assert dispatch.get_backend("auto", torch.device("cpu")).name == cpu_backend
    torch._dynamo.reset()
    x, y, tokens, mask = _step_inputs()
    compiled = torch.compile(_step, fullgraph=True, backend=compiler)
    got = compiled(x, y, tokens, mask)
    (got_grad,) = torch.autograd.grad(got, x)
    want = _step(x, y, tokens, mask)
    (want_grad,) = torch.autograd.grad(want, x)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_grad, want_grad)


def _one_pass(policy_logits, ref_logits, tokens, mask, keep):
    s = klpenalty.token_stats(policy_logits, ref_logits, tokens, mask=mask, entropy=True,
                              support=keep, temperature=0.9)
    return (s.kl + s.logprobs + s.ref_logprobs + s.entropy).sum()


def test_fullgraph_compile_of_the_one_pass_call_with_a_support_mask():
    """token_stats with the entropy and a bool kept set (the README's claim): one graph, the
    eager numbers and gradients."""
    torch._dynamo.reset()
    x, y, tokens, mask = _step_inputs()
    keep = torch.rand(x.shape, generator=torch.Generator().manual_seed(3)) > 0.3
    keep.scatter_(-1, tokens.clamp_min(0).unsqueeze(-1), True)
    compiled = torch.compile(_one_pass, fullgraph=True, backend="aot_eager")
    got = compiled(x, y, tokens, mask, keep)
    (got_grad,) = torch.autograd.grad(got, x)
    want = _one_pass(x, y, tokens, mask, keep)
    (want_grad,) = torch.autograd.grad(want, x)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_grad, want_grad)


# ----------------------------------------------------------------------- host syncs
class _CountSyncs:
    """Counts host synchronisations on an accelerator, also inside the custom ops: reads of
    tensor values by the host (bool(), .item(), int(), float(), .tolist()) and tensors built
    from host data (torch.tensor, torch.as_tensor, Tensor.new_tensor: a blocking pageable
    host-to-device copy on CUDA), counted together in ``syncs``."""

    READS = ("__bool__", "item", "__int__", "__float__", "__index__", "tolist")
    UPLOADS = ((torch, "tensor"), (torch, "as_tensor"), (torch.Tensor, "new_tensor"))

    def __init__(self, monkeypatch):
        self.syncs = 0
        for name in self.READS:
            original = getattr(torch.Tensor, name)
            patch_torch(monkeypatch, torch.Tensor, name, self._counting(original))
        for owner, name in self.UPLOADS:
            patch_torch(monkeypatch, owner, name, self._counting(getattr(owner, name)))

    def _counting(self, original):
        def read(*args, **kwargs):
            self.syncs += 1
            return original(*args, **kwargs)

        return read


@pytest.mark.parametrize("check,expected", [(False, 0), (True, 1)])
def test_accelerator_path_syncs_only_for_the_one_check(monkeypatch, check, expected):
    """On accelerators (no free host checks) a call syncs once with check=True, never without,
    whatever the number of tiles; forward and backward (which builds no tensor from host data:
    its column masks come from device ops)."""
    monkeypatch.setattr(streaming.token_stats, "_host_checks", lambda device: False)
    x, y = _pair((6, 40), seed=8)
    x[0, 3] = NINF
    x.requires_grad_()
    with monkeypatch.context() as patch:
        counter = _CountSyncs(patch)
        kl = views.streaming.full_kl(x, y, None, 1.0, check=check, tile_elements=16)
        assert counter.syncs == expected
        counter.syncs = 0
        kl.sum().backward()
        assert counter.syncs == 0
    torch.testing.assert_close(kl.detach().double(), full_kl_reference(x.detach(), y), **tol(torch.float32))


def test_check_false_returns_nan_instead_of_raising():
    x, y = _pair((2, 5))
    x[1, 2] = float("nan")
    with pytest.raises(ValueError, match="policy_logits contains NaN"):
        klpenalty.full_kl(x, y)
    kl = klpenalty.full_kl(x, y, check=False)
    assert torch.isnan(kl[1]) and torch.isfinite(kl[0])


# ----------------------------------------------------------------------- threads
def test_cpu_tile_loop_runs_on_one_thread_and_restores_the_setting(monkeypatch):
    seen = []
    original = engine.stats_partial

    def spy(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return original(*args, **kwargs)

    monkeypatch.setattr(streaming.token_stats, "stats_partial", spy)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        x, y = _pair((4, 50))
        klpenalty.full_kl(x, y, backend="streaming")
        assert seen and set(seen) == {1}
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


# ----------------------------------------------------------------------- ignore_index
def test_token_logprobs_ignore_index():
    x, _ = _pair((2, 3, 11), seed=9)
    x.requires_grad_()
    tokens = torch.tensor([[1, -100, 4], [-100, 10, 0]])
    out = klpenalty.token_logprobs(x, tokens)
    ignored = tokens == -100
    assert torch.all(out[ignored] == 0)
    keep = tokens.clamp_min(0)
    want = token_logprobs_reference(x.detach(), keep)
    torch.testing.assert_close(out[~ignored].double(), want[~ignored], **tol(torch.float32))
    (gx,) = torch.autograd.grad(out.sum(), x)
    assert torch.all(gx[ignored] == 0)
    with pytest.raises(ValueError, match="ignore_index=-1"):
        klpenalty.token_logprobs(x, tokens, ignore_index=-1)
    with pytest.raises(ValueError, match="ignore_index must be negative"):
        klpenalty.token_logprobs(x, tokens, ignore_index=3)
