"""The forward op given an engine's kept sets (``ids``, ``offsets``): values and gradients of
``token_stats(..., support=(ids, offsets))`` against the float64 reference on every backend
(native, streaming, Triton interpreted), int32 and int64 ids; sets that no threshold describes
(the call made again with the dense mask, as before); empty and masked rows; the op's own
answer per row (``ST_TAU``: τ_r, NaN where the set is not {x ≥ τ_r}); its argument checks."""

from __future__ import annotations


import pytest
import torch

import klpenalty
from klpenalty.linear import linear_logprobs
from klpenalty.ops import dispatch
from klpenalty.ops.contract import ST_TAU, Want
from klpenalty.ops.reference import token_stats_reference
from tests.helpers import backend_env, grad_tol, make_logits, op_backend, tol

BACKENDS = sorted(dispatch.REGISTRY)
WANT = int(Want.KL | Want.LOGP | Want.REF_LOGP | Want.ENTROPY)




def _compact(sets, index_dtype):
    """(ids, offsets) of per-row id lists, in the given order."""
    ids = torch.tensor([i for s in sets for i in s], dtype=torch.long)
    counts = torch.tensor([len(s) for s in sets], dtype=torch.long)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])
    return ids.to(index_dtype), offsets.to(index_dtype)


def _dense(sets, shape):
    keep = torch.zeros(len(sets), shape[-1], dtype=torch.bool)
    for r, s in enumerate(sets):
        keep[r, s] = True
    return keep.reshape(shape)


def _case(broken: bool):
    """x, y (2, 3, 70) float32, tokens, mask and per-row id lists (in shuffled order): threshold
    sets (the top of each row, ties none), row 4 masked with an arbitrary set, row 5 an empty set
    (masked too); ``broken``: row 1 drops one id from inside its set (no threshold describes
    it)."""
    x, y = make_logits((2, 3, 70), torch.float32, seed=11, scale=2.0)
    flat = x.reshape(6, 70)
    g = torch.Generator().manual_seed(3)
    sets = []
    for r in range(6):
        top = flat[r].topk(5 + 7 * r).indices
        sets.append(top[torch.randperm(top.numel(), generator=g)].tolist())
    sets[4] = [3, 60, 17]  # arbitrary: masked, so it never decides how the call is made
    sets[5] = []
    if broken:
        sets[1] = [i for i in sets[1] if i != int(flat[1].topk(3).indices[-1])]
    tokens = torch.tensor([s[0] if s else 0 for s in sets]).reshape(2, 3)  # in each set
    tokens[0, 2] = -100  # an ignored token
    mask = torch.tensor([[True, True, True], [True, False, False]])
    return x, y, tokens, mask, sets


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("broken", [False, True])
@pytest.mark.parametrize("name", BACKENDS)
def test_values_and_gradients_against_the_reference(name, broken, index_dtype):
    op_backend(name)
    x, y, tokens, mask, sets = _case(broken)
    ids, offsets = _compact(sets, index_dtype)
    keep = _dense(sets, x.shape)
    xr, yr = x.double().requires_grad_(), y.double().requires_grad_()
    # off the set −1e4 (float64 mass 0): its autograd is 0 there, where −inf would give
    # 0·(−inf) = NaN
    xk = torch.where(keep, xr, -1e4)
    want = token_stats_reference(xk, yr, tokens, mask, None, None, 0.8, -100, WANT)
    w = torch.randn(2, 3, 4, dtype=torch.float64)
    (want * w).sum().backward()
    xg, yg = x.clone().requires_grad_(), y.clone().requires_grad_()
    with backend_env(name):
        got = klpenalty.token_stats(xg, yg, tokens, entropy=True, mask=mask,
                                    support=(ids, offsets), temperature=0.8, backend=name,
                                    check=True)
        out = torch.stack([got.kl, got.logprobs, got.ref_logprobs, got.entropy], -1)
        (out.double() * w).sum().backward()
    torch.testing.assert_close(out.double(), want.detach(), **tol(torch.float32))
    torch.testing.assert_close(xg.grad.double(), xr.grad, **grad_tol(torch.float32))
    torch.testing.assert_close(yg.grad.double(), yr.grad, **grad_tol(torch.float32))


@pytest.mark.parametrize("name", BACKENDS)
def test_the_op_answers_tau_or_nan_per_counted_row(name):
    """ST_TAU holds each counted row's τ_r (the support_from_ids op's) where its set is
    {x ≥ τ_r}, NaN where it is not; masked rows are not looked at."""
    backend = op_backend(name)
    x, y, tokens, mask, sets = _case(True)
    ids, offsets = _compact(sets, torch.int32)
    with backend_env(name):
        _, stats = backend.forward(x, y, tokens, mask, temperature=0.8, want=WANT, ids=ids,
                                   offsets=offsets)
        tau, exact = backend.support_from_ids(x, ids, offsets)
    counted = mask.reshape(-1)
    got = stats.reshape(6, -1)[:, ST_TAU]
    assert exact.tolist()[:4] == [True, False, True, True]
    assert torch.isnan(got[1]) and not torch.isnan(got[counted & exact]).any()
    torch.testing.assert_close(got[counted & exact], tau[counted & exact], rtol=0, atol=0)


@pytest.mark.parametrize("name", BACKENDS)
def test_errors_are_those_of_the_dense_mask(name):
    """A sampled token off the set, and a counted empty set (no distribution), raise what the
    same sets as a dense mask raise; a set that no threshold describes too."""
    op_backend(name)
    x, y, tokens, mask, sets = _case(False)
    for broken in (False, True):
        sets_b = [list(s) for s in sets]
        if broken:
            sets_b[0] = sets_b[0][:-1] + [int(x.reshape(6, 70)[0].argmin())]
        bad_tok = tokens.clone()
        bad_tok[0, 1] = int(x[0, 1].argmin())  # far below the row's threshold set
        for tok, m in ((bad_tok, mask), (tokens, torch.ones_like(mask))):
            ids, offsets = _compact(sets_b, torch.int64)
            errors = []
            for support in ((ids, offsets), _dense(sets_b, x.shape)):
                with backend_env(name), pytest.raises(ValueError) as err:
                    klpenalty.token_stats(x, y, tok, mask=m, support=support, backend=name,
                                          check=True)
                errors.append(str(err.value))
            assert errors[0] == errors[1]
            assert ("outside the support" in errors[0]) == (m is mask)


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_every_set_empty_is_a_support_that_keeps_nothing(name, index_dtype):
    """ids with no entry at all (K = 0): every counted row keeps nothing, as the all-False
    dense mask: the same error with ``check``, NaN without (never the untruncated policy)."""
    op_backend(name)
    x, y = make_logits((3, 10), torch.float32, seed=5)
    ids, offsets = torch.zeros(0, dtype=index_dtype), torch.zeros(4, dtype=index_dtype)
    dense = torch.zeros(3, 10, dtype=torch.bool)
    errors = []
    for support in ((ids, offsets), dense):
        with backend_env(name), pytest.raises(ValueError) as err:
            klpenalty.full_kl(x, y, support=support, backend=name)
        errors.append(str(err.value))
    assert errors[0] == errors[1]
    with backend_env(name):
        kl = klpenalty.full_kl(x, y, support=(ids, offsets), backend=name, check=False)
    assert kl.isnan().all(), kl


@pytest.mark.parametrize("name", ["native", "streaming"])
def test_op_argument_checks(name):
    backend = op_backend(name)
    x, y, _, _, sets = _case(False)
    ids, offsets = _compact(sets, torch.int64)
    with pytest.raises(TypeError, match=r"support ids must be int32 or int64, got .*int16"):
        backend.forward(x, y, temperature=1.0, want=1, ids=ids.to(torch.int16), offsets=offsets)
    with pytest.raises(TypeError, match=r"support offsets must be int32 or int64, got .*float"):
        backend.forward(x, y, temperature=1.0, want=1, ids=ids, offsets=offsets.float())
    with pytest.raises(ValueError, match="given together"):
        backend.forward(x, y, temperature=1.0, want=1, ids=ids)
    # every backend's op checks the values (the public calls leave them to it)
    bad = ids.clone()
    bad[3] = 70
    with backend_env(name):
        with pytest.raises(ValueError, match=r"support ids must lie in \[0, 70\)"):
            backend.forward(x, y, temperature=1.0, want=1, ids=bad, offsets=offsets)
        swapped = offsets.clone()
        swapped[1:3] = offsets[1:3].flip(0)
        with pytest.raises(ValueError, match="non-decreasing"):
            backend.forward(x, y, temperature=1.0, want=1, ids=ids, offsets=swapped)


def test_public_narrow_index_dtypes_still_work():
    """The public call takes any integer ids (int16 / uint8 as int64), as before."""
    x, y, _, mask, sets = _case(False)
    ids, offsets = _compact(sets, torch.int64)
    want = klpenalty.full_kl(x, y, mask=mask, support=_dense(sets, x.shape))
    for narrow in ((ids.to(torch.uint8), offsets.to(torch.int16)), (ids, offsets)):
        got = klpenalty.full_kl(x, y, mask=mask, support=narrow)
        torch.testing.assert_close(got, want, **tol(torch.float32))


def test_fullgraph_compile_of_the_op_with_ids():
    """torch.compile(fullgraph=True) traces the native op given ids / offsets (its fake) and
    gives the eager numbers and gradient."""
    backend = op_backend("native")
    x, y, tokens, mask, sets = _case(False)
    ids, offsets = _compact(sets, torch.int32)

    def step(x, y, tokens, mask, ids, offsets):
        out, _ = backend.forward(x, y, tokens, mask, temperature=0.8, want=WANT, ids=ids,
                                 offsets=offsets)
        return (out * torch.tensor([1.0, -0.5, 0.25, 0.1])).sum()

    xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
    want = step(xe, y, tokens, mask, ids, offsets)
    want.backward()
    torch._dynamo.reset()
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(xc, y, tokens, mask, ids,
                                                                    offsets)
    got.backward()
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(xc.grad, xe.grad, rtol=0, atol=0)


@pytest.mark.parametrize("name", BACKENDS)
def test_invalid_sets_raise_the_messages_of_before(name):
    """Bad offsets or an id out of range (also in a masked row, which the native forward does
    not walk) raise sampling's messages on every backend, the native op checking int32/int64
    sets itself."""
    op_backend(name)
    x, y, _, mask, sets = _case(False)
    for index in (torch.int32, torch.int64, torch.int16):
        ids, offsets = _compact(sets, index)
        bad_ids = ids.clone()
        bad_ids[int(offsets[4])] = 70  # row 4: masked
        swapped = offsets.clone()
        swapped[1:3] = offsets[1:3].flip(0)
        for support, match in (
            ((bad_ids, offsets), r"support ids must lie in \[0, 70\) \(shape=\(\d+,\), dtype="),
            ((ids, swapped), r"support offsets must be non-decreasing \(shape=\(7,\)"),
            ((ids, offsets[:-1].contiguous()), r"support offsets must have N \+ 1 = 7"),
        ):
            with backend_env(name), pytest.raises(ValueError, match=match):
                klpenalty.full_kl(x, y, mask=mask, support=support, backend=name)


# ------------------------------------------------- the callers that pass the sets to the op
def _heads_case(broken: bool, index_dtype):
    """Hidden states (2, 3, 16) and weights (70, 16) of two heads, the policy logits' kept sets
    (the top of each row, shuffled; ``broken``: row 1 drops one id from inside its set, so no
    threshold describes it), sampled tokens inside them, row 5 masked with an arbitrary set."""
    g = torch.Generator().manual_seed(5)
    hp, hr = (torch.randn(2, 3, 16, generator=g) for _ in range(2))
    wp, wr = (torch.randn(70, 16, generator=g) * 0.6 for _ in range(2))
    z = (hp @ wp.T).reshape(6, 70)
    sets = []
    for r in range(6):
        top = z[r].topk(4 + 6 * r).indices
        sets.append(top[torch.randperm(top.numel(), generator=g)].tolist())
    sets[5] = [3, 60, 17]  # masked
    if broken:
        sets[1] = [i for i in sets[1] if i != int(z[1].topk(3).indices[-1])]
    tokens = torch.tensor([s[0] for s in sets]).reshape(2, 3)
    mask = torch.tensor([[True, True, True], [True, True, False]])
    return (hp, wp, hr, wr), tokens, mask, _compact(sets, index_dtype), _dense(sets, (2, 3, 70))


def _spy_ids(monkeypatch):
    """The forward op calls that were given kept sets, counted (the sets reach the op)."""
    calls = []
    forward = dispatch.Backend.forward

    def spy(self, *args, **kw):
        calls.append(kw.get("ids") is not None)
        return forward(self, *args, **kw)

    monkeypatch.setattr(dispatch.Backend, "forward", spy)
    return calls


def _grads(fn, inputs, weights):
    leaves = [t.clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    outs = out if isinstance(out, tuple) else (out,)
    sum((o.double() * w).sum() for o, w in zip(outs, weights)).backward()
    return [o.detach() for o in outs], [t.grad for t in leaves]


def _assert_same(got, want):
    (out_g, grad_g), (out_w, grad_w) = got, want
    for a, b in zip(out_g, out_w):
        torch.testing.assert_close(a, b, **tol(torch.float32))
    for a, b in zip(grad_g, grad_w):
        torch.testing.assert_close(a, b, **grad_tol(torch.float32))


@pytest.mark.parametrize("name, broken, index_dtype", [
    ("native", True, torch.int32), ("native", False, torch.int64),
    ("streaming", True, torch.int64), ("streaming", False, torch.int32),
])
def test_linear_heads_given_ids_equal_the_dense_mask(name, broken, index_dtype, monkeypatch):
    """linear_kl (with and without a gradient plan) and linear_divergence given (ids, offsets)
    give the values and gradients of the same sets as a bool mask, chunk by chunk (chunks of
    2 rows: the chunk holding a set no threshold describes runs on its dense mask, the others
    on the thresholds the op found), and every chunk's forward op is given the sets."""
    op_backend(name)
    heads, tokens, mask, ids_offsets, keep = _heads_case(broken, index_dtype)
    w = torch.randn(4, 2, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(9))

    def kl(support, plan=None):
        def fn(hp, wp, hr, wr):
            s = klpenalty.linear_kl(hp, wp, hr, wr, tokens=tokens, mask=mask, entropy=True,
                                    temperature=0.8, chunk_rows=2, backend=name,
                                    support=support, expected_grads=plan)
            return s.kl, s.logprobs, s.ref_logprobs, s.entropy
        return _grads(fn, heads, w)

    plan = (lambda rows, out: w.reshape(4, 6).T[rows].to(out.dtype))
    calls = _spy_ids(monkeypatch)
    for p in (None, plan):
        _assert_same(kl(ids_offsets, p), kl(keep, p))
    for kind in ("reverse_kl", "forward_kl", "jsd"):
        def div(support, kind=kind):
            return _grads(lambda hp, wp, hr, wr: klpenalty.linear_divergence(
                hp, wp, hr, wr, kind, mask=mask, temperature=0.8, chunk_rows=2, backend=name,
                support=support), heads, w[:1])
        _assert_same(div(ids_offsets), div(keep))
    assert calls.count(True) == 5 * 3  # 5 calls given the sets, 3 chunks each
    assert calls.count(False) == 5 * 3 + (5 * 1 if broken else 0)  # + a chunk's dense redo


@pytest.mark.parametrize("name", ["native", "streaming"])
def test_divergence_given_ids_equals_the_dense_mask(name, monkeypatch):
    """klpenalty.divergence given (ids, offsets) (int32; row 1 a set no threshold describes,
    then every set a threshold set, row 4 masked with an arbitrary set) gives the values and
    gradients of the same sets as a bool mask, for the KL column and the second walk."""
    op_backend(name)
    x, y, _, mask, sets = _case(True)
    calls = _spy_ids(monkeypatch)
    for broken in (True, False):
        if not broken:
            x, y, _, mask, sets = _case(False)
        ids, offsets = _compact(sets, torch.int32)
        keep = _dense(sets, x.shape)
        w = torch.randn(2, 3, dtype=torch.float64)
        for kind in ("reverse_kl", "forward_kl"):
            def div(support, kind=kind):
                return _grads(lambda s: klpenalty.divergence(s, y, kind, mask=mask,
                                                             temperature=0.8, backend=name,
                                                             support=support), (x,), (w,))
            with backend_env(name):
                _assert_same(div((ids, offsets)), div(keep))
    assert calls.count(True) == 4


@pytest.mark.parametrize("name, broken", [("native", True), ("streaming", False)])
def test_linear_logprobs_given_ids_equals_the_dense_mask(name, broken, monkeypatch):
    """linear_logprobs given (ids, offsets) gives the log-probs, entropies and kept sets
    (return_support) of the same sets as a bool mask, every chunk's op given the sets (the
    chunk holding a set no threshold describes then redone on its dense mask)."""
    op_backend(name)
    (hp, wp, _, _), tokens, mask, ids_offsets, keep = _heads_case(broken, torch.int32)
    calls = _spy_ids(monkeypatch)
    got, want = (linear_logprobs(hp, wp, tokens, mask=mask, entropy=True, temperature=0.8,
                                 chunk_rows=2, backend=name, support=s, return_support=True)
                 for s in (ids_offsets, keep))
    assert calls.count(True) == 3
    for a, b in zip(got[0][:2], want[0][:2]):
        torch.testing.assert_close(a, b, **tol(torch.float32))
    for a, b in zip(got[1], want[1]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_linear_kl_given_ids_raises_the_dense_masks_errors():
    """A sampled token off its kept set raises what the bool mask raises, given the sets as
    (ids, offsets)."""
    heads, tokens, mask, ids_offsets, keep = _heads_case(True, torch.int32)
    bad = tokens.clone()
    bad[0, 2] = int((heads[0] @ heads[1].T)[0, 2].argmin())
    errors = []
    for support in (ids_offsets, keep):
        with pytest.raises(ValueError) as err:
            klpenalty.linear_kl(*heads, tokens=bad, mask=mask, chunk_rows=2, support=support)
        errors.append(str(err.value))
    assert errors[0] == errors[1] and "support" in errors[0]


def _edge_rows(dtype):
    """x, y (12, 4099) of ``dtype`` and per-row id lists (shuffled) probing how the forward
    decides a set while it walks the row: V not a multiple of the vector width, several
    chunks, maxima rising along a row (chunks redone), sets that are threshold sets and sets
    that are not (the offending logit in a later chunk, in the last partial vector, tied with
    τ), NaN off and in a set, −inf and +inf in a set, an empty set, duplicated ids, the whole
    row."""
    V = 4099
    x, y = make_logits((12, V), dtype, seed=5, scale=2.0)
    x[1] = (x[1].float() + torch.linspace(0, 40, V)).to(dtype)
    g = torch.Generator().manual_seed(9)
    sets = []
    for r in range(12):  # {x >= the (40 + 97 r)-th largest logit}
        row = x[r].float()
        s = (row >= row.topk(40 + 97 * r).values[-1]).nonzero().squeeze(-1)
        sets.append(s[torch.randperm(s.numel(), generator=g)].tolist())
    tau2 = x[2].float()[sets[2]].min()
    sets[2] = [j for j in sets[2] if x[2, j].float() != tau2]  # the smallest dropped: a set
    sets[3].append(int(x[3].float()[V - 3:].argmin()) + V - 3)  # one far below, in the tail
    off4 = [j for j in range(V) if j not in set(sets[4])]
    x[4, off4[-1]] = float("nan")  # NaN off the set: skipped
    x[5, sets[5][7]] = float("nan")  # NaN in the set: no threshold describes it
    x[6, sets[6][3]] = float("-inf")  # tau = -inf
    x[7, sets[7][2]] = float("inf")
    sets[8] = []
    sets[9] = sets[9] + sets[9][:50]  # duplicated ids
    sets[10] = torch.randperm(V, generator=g).tolist()  # the whole row, −inf in it
    x[10, 5] = float("-inf")
    # a tie at tau: the set's smallest logit copied onto an element outside the set
    t11 = x[11].float()[sets[11]].min()
    out11 = [j for j in range(V) if j not in set(sets[11])]
    x[11, out11[len(out11) // 2]] = t11.to(dtype)
    return x, y, sets


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_native_walk_decides_the_set_as_it_goes(dtype):
    """The native forward finds each set's τ_r and whether it is {x ≥ τ_r} while it walks the
    row (a NaN, ±inf or non-finite row: by a scan first): ST_TAU is bit for bit the
    support_from_ids op's τ_r where the set is a threshold set, NaN where it is not, and the
    values are bit for bit those of the same set given as a dense mask."""
    backend = op_backend("native")
    want_cols = int(Want.KL | Want.ENTROPY)
    x, y, sets = _edge_rows(dtype)
    ids, offsets = _compact(sets, torch.int32)
    keep = _dense(sets, x.shape)
    out, stats = backend.forward(x, y, temperature=0.8, want=want_cols, ids=ids, offsets=offsets)
    tau, exact = backend.support_from_ids(x, ids, offsets)
    assert exact.tolist() == [True, True, True, False, True, False, False, True, True, True,
                              True, False]
    got = stats[:, ST_TAU]
    assert torch.isnan(got[~exact]).all()
    torch.testing.assert_close(got[exact], tau[exact], rtol=0, atol=0)
    out_k, stats_k = backend.forward(x, y, keep=keep, temperature=0.8, want=want_cols)
    other = [c for c in range(stats.shape[-1]) if c != ST_TAU]
    torch.testing.assert_close(out[exact], out_k[exact], rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(stats[exact][:, other], stats_k[exact][:, other], rtol=0, atol=0,
                               equal_nan=True)
    # and against float64 where the rows define a distribution
    finite = torch.tensor([r not in (5, 6, 7, 8) for r in range(12)]) & exact
    xr = torch.where(keep, x.double(), -1e4)
    want = token_stats_reference(xr, y.double(), None, None, None, None, 0.8, -100, want_cols)
    torch.testing.assert_close(out[finite].double(), want[finite], **tol(dtype))
