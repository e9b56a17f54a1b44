"""The op contract: ``torch.library.opcheck`` (schema, fake, autograd registration, aliasing,
AOT dispatch) on every op of every registered backend, and the registry itself."""

from __future__ import annotations


import pytest
import torch

from klpenalty.ops import contract, dispatch
from klpenalty.ops.contract import Want
from tests.helpers import backend_env, make_logits, op_backend




def _inputs():
    x, y = make_logits((2, 3, 33), torch.float32, seed=5)
    tokens = torch.tensor([[0, 5, -100], [32, 7, 1]])
    mask = torch.tensor([[True, True, True], [True, False, True]])
    keep = torch.ones(2, 3, 33, dtype=torch.bool)
    keep[..., 2::3] = False
    keep[..., 0] = keep[..., 5] = keep[..., 32] = keep[..., 7] = keep[..., 1] = True
    tau = x.amax(-1) - 6.0
    tau = torch.minimum(tau, x.gather(-1, tokens.clamp_min(0).unsqueeze(-1)).squeeze(-1))
    return x, y, tokens, mask, keep, tau


BACKENDS = sorted(dispatch.REGISTRY)


@pytest.mark.parametrize("support", ["none", "keep_and_tau"])
@pytest.mark.parametrize("name", BACKENDS)
def test_opcheck_every_op(name, support):
    backend = op_backend(name)
    x, y, tokens, mask, keep, tau = _inputs()
    if support == "none":
        keep = tau = None
    want = int(Want.KL | Want.LOGP | Want.REF_LOGP | Want.ENTROPY)
    with backend_env(name):
        fwd = (x.requires_grad_(), y.requires_grad_(), tokens, mask, keep, tau, 0.9, -100, want,
               True, 0, 0, 0, 1.0, 0.0)
        torch.library.opcheck(backend.forward_op, fwd)
        _, stats = backend.forward_op(*fwd)
        grad = torch.randn(2, 3, 4)
        owned = torch.tensor([[True, False, True], [True, True, False]])
        for own in (None, owned):
            bwd = (grad, x.detach(), y.detach(), tokens, own, stats.detach(), mask, keep, tau,
                   0.9, -100, want, True, True, 0, 0)
            torch.library.opcheck(backend.backward_op, bwd)
        state = (x.detach(), y.detach(), keep, tau, 0.9, int(Want.KL | Want.ENTROPY), 0, 0)
        torch.library.opcheck(backend.state_op, state)
        if support == "keep_and_tau":
            # the calls below take no keep / tau, or the forward's support through the stats:
            # the "none" case checks them (each opcheck runs its op a few times over)
            _opcheck_divergence(backend, name, x, y, stats, mask, keep, tau)
            return
        # the sampler's settings: the forward computes their threshold itself
        sampled = (x, y, x.detach().argmax(-1), mask, None, None, 0.9, -100, want, True, 0, 0,
                   30, 0.95, 0.0)
        torch.library.opcheck(backend.forward_op, sampled)
        torch.library.opcheck(backend.threshold_op, (x.detach(), 30, 0.95, 0.01, 0.9))
        # the kept-set check of (ids, offsets): rows keep their top-3 ids, one row a
        # non-threshold set
        top = x.detach().reshape(6, 33).topk(3, -1).indices
        ids = top.reshape(-1).clone()
        ids[4] = int(x.detach().reshape(6, 33)[1].argmin())
        offsets = torch.arange(0, 19, 3)
        torch.library.opcheck(backend._op("support_from_ids"), (x.detach(), ids, offsets, 0))
        # the forward given the kept sets (int32 and int64; every row's top 3, threshold sets:
        # a row that is not holds NaN in ST_TAU, which opcheck's comparisons take as a
        # mismatch): their thresholds found by the op, the autograd's tau its ST_TAU (int64
        # too where a call is fast)
        for index in (torch.int32,) if name == "triton" else (torch.int32, torch.int64):
            with_ids = (x, y, x.detach().argmax(-1), mask, None, None, 0.9, -100, want, True,
                        0, 0, 0, 1.0, 0.0, top.reshape(-1).to(index), offsets.to(index))
            torch.library.opcheck(backend.forward_op, with_ids)
        _opcheck_divergence(backend, name, x, y, stats, mask, keep, tau)


def _opcheck_divergence(backend, name, x, y, stats, mask, keep, tau):
    """opcheck of the second walk and its backward (the student on the forward's support):
    every kind on the compiled backends; on the interpreted Triton kernel, where each call is
    slow, the first walk's kind, a mixture and the TVD (the kind is a compile-time branch of
    one kernel, the op's schema, fake and autograd the same for all; every kind's values:
    tests/ops/test_triton_divergence.py)."""
    for kind in range(6) if name != "triton" else (0, 2, 5):
        div = (x, y.detach(), stats.detach(), mask, keep, tau, 0.9, kind, 0.3)
        torch.library.opcheck(backend._op("divergence"), div)
        value, gbar = backend._op("divergence")(*div)
        torch.library.opcheck(backend._op("divergence_backward"), (
            torch.randn(2, 3), x.detach(), y.detach(), stats.detach(), gbar.detach(), mask,
            keep, tau, 0.9, kind, 0.3))


@pytest.mark.parametrize("name", BACKENDS)
def test_state_op_is_the_forward_state(name):
    """The state op's (N, 6) state finalizes to the forward op's values (same backend)."""
    from klpenalty.ops import engine

    backend = op_backend(name)
    x, y, _, _, keep, tau = _inputs()
    want = int(Want.KL | Want.ENTROPY)
    with backend_env(name):
        state, careful = backend.state_op(x, y, keep, tau, 0.9, want, 0, 0)
        out, _ = backend.forward_op(x, y, None, None, keep, tau, 0.9, -100, want, False, 0, 0,
                                    0, 1.0, 0.0)
    assert state.shape == (6, contract.STATE_COLS) and careful.shape == (6,)
    kl, h, _ = engine.stats_finalize(engine.state_from_tensor(state, want), careful)
    torch.testing.assert_close(kl, out.reshape(6, 4)[:, contract.OUT_KL])
    torch.testing.assert_close(h, out.reshape(6, 4)[:, contract.OUT_ENTROPY])


SAMPLERS = [(5, 1.0, 0.0), (0, 0.7, 0.0), (0, 1.0, 0.2), (8, 0.9, 0.05), (40, 1.0, 0.0)]


@pytest.mark.parametrize("name", BACKENDS)
def test_sampler_settings_are_their_threshold_as_tau(name):
    """The forward given top_k/top_p/min_p is the forward given their threshold op's τ (the
    same support, so the same numbers), which its stats hold (``ST_TAU``) for the backward;
    a tau given too is intersected with it."""
    backend = op_backend(name)
    x, y = make_logits((2, 3, 40), torch.float32, seed=6, scale=2.0)
    tokens = x.argmax(-1)
    want = int(Want.KL | Want.LOGP | Want.REF_LOGP | Want.ENTROPY)
    args = (0.8, -100, want, True, 0, 0)
    g = torch.randn(2, 3, 4)
    with backend_env(name):
        for sampler in SAMPLERS:
            tau = backend.threshold_op(x, *sampler, 0.8)
            assert tau.shape == (2, 3) and tau.dtype == torch.float32
            xs, xt = x.clone().requires_grad_(), x.clone().requires_grad_()
            out_s, st_s = backend.forward_op(xs, y, tokens, None, None, None, *args, *sampler)
            out_t, st_t = backend.forward_op(xt, y, tokens, None, None, tau, *args, 0, 1.0, 0.0)
            assert torch.equal(out_s, out_t) and torch.equal(st_s, st_t), sampler
            assert torch.equal(st_s[..., contract.ST_TAU], tau), sampler
            (gs,) = torch.autograd.grad((out_s * g).sum(), xs)
            (gt,) = torch.autograd.grad((out_t * g).sum(), xt)
            assert torch.equal(gs, gt), sampler
        # both a tau and a sampler: the larger threshold of the two, row by row
        cut = backend.threshold_op(x, 8, 1.0, 0.0, 0.8)
        given = torch.where(torch.rand(2, 3) < 0.5, cut - 1.0, cut + 0.5)
        out_b, st_b = backend.forward_op(x, y, tokens, None, None, given, *args[:3], False, 0, 0,
                                         8, 1.0, 0.0)
        both = torch.maximum(cut, given)
        out_m, _ = backend.forward_op(x, y, tokens, None, None, both, *args[:3], False, 0, 0, 0,
                                      1.0, 0.0)
        assert torch.equal(out_b, out_m) and torch.equal(st_b[..., contract.ST_TAU], both)
        # nothing cut (k ≥ V, p = 1, min_p = 0): ST_TAU is −inf, as without a support
        _, st_n = backend.forward_op(x, y, tokens, None, None, None, *args, 40, 1.0, 0.0)
        assert torch.isneginf(st_n[..., contract.ST_TAU]).all()


def test_owned_false_drops_only_the_token_entry():
    """With owned False the token's own column gets the dense −π·g/T term like any other."""
    backend = dispatch.REGISTRY["streaming"]
    x, _ = make_logits((3, 9), torch.float64, seed=2)
    tokens = torch.tensor([4, 0, 8])
    want = int(Want.LOGP)
    _, stats = backend.forward_op(x, None, tokens, None, None, None, 1.0, -100, want, False, 0, 0,
                                  0, 1.0, 0.0)
    grad = torch.zeros(3, 4, dtype=torch.float64)
    grad[:, 1] = 1.0
    args = (grad, x, None, tokens)
    tail = (stats, None, None, None, 1.0, -100, want, True, False, 0, 0)
    full, _ = backend.backward_op(*args, None, *tail)
    part, _ = backend.backward_op(*args, torch.tensor([True, False, True]), *tail)
    dense = -torch.softmax(x, -1)  # ∂ log π(t)/∂x without the onehot
    torch.testing.assert_close(part[1], dense[1])
    torch.testing.assert_close(part[[0, 2]], full[[0, 2]])
    torch.testing.assert_close(full[1, 0], 1.0 + dense[1, 0])


def test_constant_result_is_dynamos_mark():
    """The backends' ``available()`` are constants of a torch.compile trace: the mark set
    without importing torch._dynamo is the one its decorator sets."""
    import torch._dynamo

    marked = torch._dynamo.assume_constant_result(lambda: True)
    assert getattr(marked, "_dynamo_marked_constant", False) is True
    assert contract.constant_result(lambda: True)._dynamo_marked_constant is True
    for b in dispatch.REGISTRY.values():
        check = getattr(b.module, "available", None)
        if check is not None:
            assert check._dynamo_marked_constant is True


def test_registry_lists_every_backend_with_its_ops():
    assert list(dispatch.REGISTRY) == dispatch.available_backends() == ["streaming", "native",
                                                                          "triton"]
    for name, backend in dispatch.REGISTRY.items():
        assert backend.name == name
        for op, schema in contract.SCHEMAS.items():  # every op of the contract, by its name
            assert str(backend._op(op)._schema) == "klpenalty::" + schema.format(b=name)


def test_column_table_holds_each_layout_whole():
    """contract.COLUMNS: each layout's width and its columns 0 .. width − 1, each once."""
    layouts = {"OUT_COLS": "OUT_", "STATS_COLS": "ST_", "STATE_COLS": "SX_"}
    assert {n for n in contract.COLUMNS if n.endswith("_COLS")} == set(layouts)
    for width, prefix in layouts.items():
        cols = [c for n, c in contract.COLUMNS.items() if n.startswith(prefix) and n != width]
        assert sorted(cols) == list(range(getattr(contract, width))), width
    assert all(getattr(contract, n) == c for n, c in contract.COLUMNS.items())
    assert contract.COLUMNS["ST_TAU"] == contract.ST_TAU and "Want" not in contract.COLUMNS
