"""One rank of the real process groups (gloo, or NCCL on GPUs) that tests/distributed/conftest.py
spawns.

Run from the repository root as ``python -m tests.distributed.worker RANK WORLD STORE_FILE
OUT_DIR [BACKEND]`` (as a module, so that it imports the one tolerance table,
``tests/tolerances.py``). The rank joins a group of BACKEND (``gloo``, the default, on CPU
tensors; ``nccl``: one GPU per rank, ``cuda:RANK``, made the default device so that every tensor
of the checks lives on it) through a FileStore (no ports), runs every check in ``CHECKS`` in
order and writes ``OUT_DIR/rank{RANK}.json``: for each check ``{"ok": bool, "data": ...,
"error": traceback}``. Checks do their collectives first and their assertions last, so a failing
assertion on one rank does not leave the others waiting in a collective; the process group has a
short timeout so a hang turns into an error instead of blocking CI.

Every rank builds the *whole* tensors from the same seed and keeps its vocabulary slice, so it
can compare with the single-process functions on the gathered tensors without gathering
(one check also gathers for real, to pin the rank-order layout).
"""

from __future__ import annotations

import contextlib
import math
import json
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

import klpenalty
from klpenalty import AdaptiveKLController, FixedKLController, full_kl, token_logprobs
from klpenalty import distributed as kd
from klpenalty.ops import native, streaming
from klpenalty.ops.reference import full_kl_reference, token_logprobs_reference

from ..tolerances import grad_tol, tol

VOCAB = 1001
# uneven vocabulary splits of 1001 (the 4-way one has a slice of width 1)
SPLITS = {1: [1001], 2: [400, 601], 3: [1, 500, 500], 4: [1, 300, 250, 450]}
PG_TIMEOUT_S = 20

# Tolerances: the one table of tests/tolerances.py, keyed by the input dtype. Every comparison
# here is the vocabulary-parallel computation against the single-process one (or the float64
# reference), both in the same precision (float32 math for float32/bfloat16 inputs, float64 for
# float64), so the table's entry for that precision applies as it stands:
# - values (KL, log-probs, means): tol(dtype) = TOLERANCES. The vocab-parallel forward groups
#   the same float32 sums differently (per shard, then across ranks) and uses
#   A/s_x − log s_x + log s_y: a few float32 ulps of terms of size ~1, well inside 2e-6 + 1e-5·|x|.
# - gradients of the logits: grad_tol(dtype) = GRAD_TOLERANCES. They are elementwise from LSEs
#   that agree to a few ulps; bfloat16 gradients are rounded from float32 numbers that differ in
#   the last float32 bits, so they may land one bf16 ulp apart, inside rtol 8e-3 (> 2^-7).
def assert_close(actual: torch.Tensor, expected: torch.Tensor, *, rtol: float, atol: float):
    """torch.testing.assert_close's rule (same dtype and shape, |a − e| ≤ atol + rtol·|e|,
    infinities equal, NaN never close), without its first-call import of DTensor and sympy
    (about 2 s of CPU per rank, the largest cost of these tests)."""
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    a, e = actual.detach().double(), expected.detach().double()
    with torch.no_grad():
        ok = (a == e) | ((a - e).abs() <= atol + rtol * e.abs())
    if not bool(ok.all()):
        bad = (~ok).nonzero()
        i = tuple(bad[0].tolist())
        raise AssertionError(
            f"{bad.shape[0]} / {a.numel()} elements not close (rtol={rtol}, atol={atol}); "
            f"first at {i}: {a[i].item()} vs {e[i].item()}; "
            f"max |diff| {(a - e).abs().nan_to_num(float('inf')).max().item()}"
        )


def checked(backend: str) -> str:
    """``backend``, asserting first that ``"native"`` runs the native kernel here: asked for by name
    where it cannot be built, it would silently run ``"streaming"``, and the checks would compare
    streaming with itself."""
    if backend == "native" and torch.get_default_device().type == "cpu":
        assert native.available(), f"the native CPU kernel did not load: {native.status()}"
    return backend


class Ctx:
    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        widths = SPLITS[world]
        self.starts = [sum(widths[:r]) for r in range(world)]
        self.start = self.starts[rank]
        self.end = self.start + widths[rank]

    def shard(self, t: torch.Tensor, requires_grad: bool = False) -> torch.Tensor:
        s = t[..., self.start : self.end].detach().clone()
        return s.requires_grad_(requires_grad)


def gather_equal(t: torch.Tensor) -> bool:
    """True iff ``t`` is bitwise the same on every rank (NaN included)."""
    t = t.detach().reshape(-1).contiguous()  # (K,)
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return all(torch.equal(o.view(torch.uint8), t.view(torch.uint8)) for o in out)


@contextlib.contextmanager
def small_chunks(elements: int = 150):
    """Make the local tile loop use tiles of 150 elements: several rows per tile on narrow
    slices, several vocabulary tiles per row on wide ones (merges within a rank)."""
    old = streaming.token_stats.TILE_ELEMENTS
    streaming.token_stats.TILE_ELEMENTS = elements
    try:
        yield
    finally:
        streaming.token_stats.TILE_ELEMENTS = old


def _generator(seed: int) -> torch.Generator:
    """A generator on the default device (CPU with gloo, the rank's GPU with NCCL): every rank
    draws the same numbers from the same seed, the ranks being on the same kind of device."""
    return torch.Generator(device=torch.get_default_device()).manual_seed(seed)


def _pair(seed: int, shape, dtype=torch.float32, spread: float = 1.0):
    g = _generator(seed)
    x = torch.randn(*shape, VOCAB, generator=g) * 3
    y = x + torch.randn(*shape, VOCAB, generator=g) * spread
    return x.to(dtype), y.to(dtype), g


def _kl_vs_full(ctx: Ctx, dtype: torch.dtype, seed: int) -> dict:
    x, y, g = _pair(seed, (3, 5), dtype)
    mask = torch.rand(3, 5, generator=g) > 0.2
    mask[0, 0] = False
    x[0, 0, 7] = float("nan")  # a masked position may hold anything
    w = torch.randn(3, 5, generator=g)  # grad_output other than ones
    t = 0.7
    xs, ys = ctx.shard(x, True), ctx.shard(y, True)
    kl = kd.vocab_parallel_full_kl(xs, ys, mask=mask, temperature=t, vocab_start=ctx.start)
    (kl * w).sum().backward()
    same = gather_equal(kl)
    xf, yf = x.clone().requires_grad_(), y.clone().requires_grad_()
    ref = full_kl(xf, yf, mask=mask, temperature=t)
    (ref * w).sum().backward()
    assert same, "the KL differs across ranks"
    assert kl.dtype == torch.float32 and kl.shape == (3, 5)
    assert xs.grad.dtype == dtype and ys.grad.dtype == dtype
    assert_close(kl, ref, **tol(dtype))
    assert_close(xs.grad, xf.grad[..., ctx.start : ctx.end], **grad_tol(dtype))
    assert_close(ys.grad, yf.grad[..., ctx.start : ctx.end], **grad_tol(dtype))
    assert not torch.isnan(xs.grad).any()
    assert torch.all(xs.grad[0, 0] == 0) and torch.all(ys.grad[0, 0] == 0)  # masked row
    # error against the float64 truth no worse than single-process full_kl's (+ slack)
    truth = torch.where(mask, full_kl_reference(x.nan_to_num(), y, t), 0.0)
    err = (kl.double() - truth).abs().max().item()
    err_single = (ref.double() - truth).abs().max().item()
    assert err <= 2 * err_single + 1e-6, (err, err_single)
    return {"max_abs_err_vs_f64": err, "single_process_err_vs_f64": err_single}


def check_kl_float32(ctx: Ctx):
    return _kl_vs_full(ctx, torch.float32, 1)


def check_kl_bfloat16(ctx: Ctx):
    with small_chunks():
        return _kl_vs_full(ctx, torch.bfloat16, 2)


def check_kl_float64_vs_reference(ctx: Ctx):
    x, y, g = _pair(3, (4,), torch.float64, spread=2.0)
    w = torch.randn(4, generator=g, dtype=torch.float64)
    xs, ys = ctx.shard(x, True), ctx.shard(y, True)
    kl = kd.vocab_parallel_full_kl(xs, ys, temperature=1.3)
    (kl * w).sum().backward()
    xf, yf = x.clone().requires_grad_(), y.clone().requires_grad_()
    ref = full_kl_reference(xf, yf, 1.3)  # float64 autograd through the reference
    (ref * w).sum().backward()
    assert kl.dtype == torch.float64
    assert_close(kl, ref, **tol(torch.float64))
    assert_close(xs.grad, xf.grad[..., ctx.start : ctx.end], **grad_tol(torch.float64))
    assert_close(ys.grad, yf.grad[..., ctx.start : ctx.end], **grad_tol(torch.float64))


def check_kl_gathered_for_real(ctx: Ctx):
    """Gather the shards with all_gather (rank order) and compare with full_kl on them."""
    g = _generator(100 + ctx.rank)  # different data on every rank
    widths = SPLITS[ctx.world]
    xs = torch.randn(2, 3, widths[ctx.rank], generator=g)
    ys = torch.randn(2, 3, widths[ctx.rank], generator=g)
    kl = kd.vocab_parallel_full_kl(xs, ys)
    pad = max(widths)
    both = torch.zeros(2, 2, 3, pad)  # gloo's all_gather wants equal sizes: pad, then cut
    both[0, ..., : widths[ctx.rank]], both[1, ..., : widths[ctx.rank]] = xs, ys
    parts = [torch.empty_like(both) for _ in widths]
    dist.all_gather(parts, both)
    x = torch.cat([p[0, ..., :w] for p, w in zip(parts, widths)], -1)  # (2, 3, V)
    y = torch.cat([p[1, ..., :w] for p, w in zip(parts, widths)], -1)  # (2, 3, V)
    assert_close(kl, full_kl(x, y), **tol(torch.float32))


def check_kl_edge_cases(ctx: Ctx):
    inf = float("inf")
    x, y, g = _pair(4, (7,))
    x[0, :600] = -inf  # some ranks hold only -inf in this row: local max -inf
    x[1, ::3] = -inf
    y[1, ::3] = -inf  # entries both models mask: 0·log 0 = 0, no NaN
    y[2, 5] = -inf  # the policy has mass where the reference has none: +inf
    y[3] = x[3]  # identical rows: exactly 0, zero gradient
    x[4] = -inf
    y[4] = float("nan")  # masked row with garbage
    x[5] = -inf  # the policy has no mass at all: undefined, so masked here (else it raises)
    x[6] = x[6] * 1e3  # huge logits: no overflow
    mask = torch.ones(7, dtype=torch.bool)
    mask[4] = False
    mask[5] = False
    w = torch.randn(7, generator=g)
    w[2] = 0.0  # the +inf row gets no upstream gradient (its gradient is not finite)
    xs, ys = ctx.shard(x, True), ctx.shard(y, True)
    kl = kd.vocab_parallel_full_kl(xs, ys, mask=mask)
    (kl * w).sum().backward()
    xf, yf = x.clone().requires_grad_(), y.clone().requires_grad_()
    ref = full_kl(xf, yf, mask=mask)
    (ref * w).sum().backward()
    assert kl[2] == inf, kl
    assert kl[3] == 0 and kl[4] == 0 and kl[5] == 0, kl
    assert torch.isfinite(kl[[0, 1, 6]]).all(), kl
    assert_close(kl, ref, **tol(torch.float32))
    for grad, full in ((xs.grad, xf.grad), (ys.grad, yf.grad)):
        assert not torch.isnan(grad).any()
        assert torch.all(grad[[2, 3, 4, 5]] == 0)
        assert_close(grad, full[..., ctx.start : ctx.end], **grad_tol(torch.float32))


def check_kl_inf_rule_across_ranks(ctx: Ctx):
    """A finite policy logit where the reference is −inf makes the global KL +inf, whichever rank
    holds it, also where that rank's whole slice lies 800 nats below the row's maximum (its
    rescale factor underflows to 0 in the merge, in float32 and in float64), on every backend."""
    for backend, dtype in [(b, d) for b in ("streaming", "native", "triton")
                           for d in (torch.float32, torch.float64)]:
        x, y, g = _pair(21, (2 * ctx.world,), dtype)
        for k, (s0, w) in enumerate(zip(ctx.starts, SPLITS[ctx.world])):
            x[2 * k, s0 : s0 + w] -= 800.0  # rank k's slice far below the row's maximum
            x[2 * k + 1, s0 : s0 + w] -= 800.0
            y[2 * k, s0 + w - 1] = float("-inf")  # row 2k: +inf; row 2k + 1: finite control
        xs, ys = ctx.shard(x, True), ctx.shard(y, True)
        kl = kd.vocab_parallel_full_kl(xs, ys, vocab_start=ctx.start, backend=checked(backend))
        w = torch.randn(2 * ctx.world, generator=g, dtype=dtype)
        w[0::2] = 0.0  # no upstream gradient on the +inf rows
        (kl * w).sum().backward()
        same = gather_equal(kl)
        ref = full_kl(x, y)
        assert same, f"{backend}: the KL differs across ranks"
        assert torch.isposinf(kl[0::2]).all() and torch.isposinf(ref[0::2]).all(), (backend, kl)
        assert_close(kl[1::2], ref[1::2], **tol(dtype))
        for grad in (xs.grad, ys.grad):
            assert torch.isfinite(grad).all() and torch.all(grad[0::2] == 0)


def check_empty_and_one_dim(ctx: Ctx):
    """No positions at all (N = 0), and a single leading dim."""
    x = torch.zeros(0, 3, ctx.end - ctx.start, requires_grad=True)
    kl = kd.vocab_parallel_full_kl(x, x.detach())
    kl.sum().backward()
    lp = kd.vocab_parallel_token_logprobs(
        x, torch.zeros(0, 3, dtype=torch.long), vocab_start=ctx.start
    )
    xf, yf, _ = _pair(11, (5,))
    kl1 = kd.vocab_parallel_full_kl(ctx.shard(xf), ctx.shard(yf), vocab_start=ctx.start)
    assert kl.shape == (0, 3) and lp.shape == (0, 3) and x.grad.shape == x.shape
    assert_close(kl1, full_kl(xf, yf), **tol(torch.float32))


def check_thresholds_on_wide_rows(ctx: Ctx):
    """top-p over rows whose kept prefix runs past the sorted candidates (the histogram of the
    mass summed across ranks, the crossing bucket's logits gathered): the same τ on every rank,
    the single-process kept sets, the float64 reference's."""
    from klpenalty.distributed.vocab_parallel import _RankReduce
    from klpenalty.ops.streaming.threshold import LOCAL, threshold_rows

    from klpenalty.ops.reference import kept_set_reference

    g = _generator(41)
    x = torch.randn(5, VOCAB, generator=g) * 0.7  # ~700 of 1001 kept at p = 0.9
    x[1] = 1.0 + 1e-6 * torch.rand(VOCAB, generator=g)  # within 1e-6
    x[2] = torch.round(x[2] * 16.0) / 8.0  # ties
    x[3, ::2] = -math.inf
    x[4, 7] = math.nan
    settings = [dict(top_p=0.9), dict(top_k=400, top_p=0.95, temperature=0.8)]
    reduce = _RankReduce(None, ctx.world, VOCAB)
    taus = [threshold_rows(ctx.shard(x), kw.get("top_k"), kw["top_p"], None,
                           kw.get("temperature", 1.0), 2, reduce) for kw in settings]
    same = all(gather_equal(t) for t in taus)
    assert same
    for kw, tau in zip(settings, taus):
        full = threshold_rows(x, kw.get("top_k"), kw["top_p"], None, kw.get("temperature", 1.0),
                              None, LOCAL)
        assert math.isnan(tau[4].item()) and math.isnan(full[4].item()), kw
        got, one = (x[:4] >= t[:4].unsqueeze(-1) for t in (tau, full))
        want = kept_set_reference(x[:4].cpu(), **kw).to(got.device)
        assert torch.equal(got, one) and torch.equal(got, want), kw
        assert int(got.sum(-1).min()) > 256, kw  # past the sorted candidates



def check_thresholds_with_ties_made_by_the_temperature(ctx: Ctx):
    """Rows holding two adjacent float32 logits whose keys x/T round equal (tests/helpers.py's
    cases at V = 1001: the top-p boundary, inside the prefix, top-k's k-th, min-p): the
    threshold across the ranks (the portable rule's reductions, the vocabulary-parallel path's)
    is the same on every rank and bit for bit the single-process τ of every backend that runs
    here, its kept set the float64 rule's; the vocabulary-parallel KL on it against float64."""
    from klpenalty.distributed.vocab_parallel import _RankReduce
    from klpenalty.ops.reference import kept_set_reference
    from klpenalty.ops.streaming.threshold import threshold_rows
    from klpenalty.sampling import sampling_threshold

    from ..helpers import temperature_tie_cases

    device = torch.get_default_device()
    cases = [(x.to(device), kw) for x, kw in temperature_tie_cases(VOCAB, seed=5)]
    reduce = _RankReduce(None, ctx.world, VOCAB)
    g = _generator(43)
    taus, kls = [], []
    for x, kw in cases:
        taus.append(threshold_rows(ctx.shard(x), kw.get("top_k"), kw.get("top_p"),
                                   kw.get("min_p"), kw["temperature"], None, reduce))
        y = x + torch.randn(x.shape, generator=g)
        kl = kd.vocab_parallel_full_kl(ctx.shard(x), ctx.shard(y), vocab_start=ctx.start, **kw)
        kls.append((kl, y))
    same = all(gather_equal(t) for t in taus)
    assert same
    backends = ["streaming", "triton"] if device.type == "cuda" else ["streaming",
                                                                       checked("native"), "triton"]
    for (x, kw), tau, (kl, y) in zip(cases, taus, kls):
        for backend in backends:
            one = sampling_threshold(x, **kw, backend=backend)
            assert torch.equal(tau, one), (backend, kw, tau.item(), one.item())
        want = kept_set_reference(x.cpu(), **kw).to(device)
        assert torch.equal(x >= tau.unsqueeze(-1), want), kw
        ref = full_kl_reference(torch.where(want, x.double(), -math.inf), y, kw["temperature"])
        assert_close(kl.double(), ref, **tol(torch.float32))
    return len(cases)


def _count_collectives():
    calls = []
    originals = {name: getattr(dist, name) for name in ("all_reduce", "all_gather")}

    def wrap(name):
        def inner(*args, **kwargs):
            t = args[0] if name == "all_reduce" else args[1]
            op = kwargs.get("op", dist.ReduceOp.SUM)
            calls.append((name, str(op).split(".")[-1], t.numel(), t.element_size(), str(t.device)))
            return originals[name](*args, **kwargs)

        return inner

    for name in originals:
        setattr(dist, name, wrap(name))

    def restore():
        for name, fn in originals.items():
            setattr(dist, name, fn)

    return calls, restore


def check_communication_volume(ctx: Ctx):
    """Count the collectives: 2 all-reduces forward, none backward, 1 tiny all-gather check."""
    n = 6
    x, y, _ = _pair(5, (2, 3))
    xs, ys = ctx.shard(x, True), ctx.shard(y, True)
    tok = torch.arange(n).reshape(2, 3) * 150
    calls, restore = _count_collectives()
    try:
        kl = kd.vocab_parallel_full_kl(xs, ys, temperature=1.1)
        fwd = list(calls)
        kl.sum().backward()
        bwd = calls[len(fwd) :]
        start = len(calls)
        kd.vocab_parallel_full_kl(xs.detach(), ys.detach(), check=False)
        unchecked = calls[start:]
        start = len(calls)
        lp = kd.vocab_parallel_token_logprobs(xs, tok, vocab_start=ctx.start)
        tok_fwd = calls[start:]
        start = len(calls)
        lp.sum().backward()
        tok_bwd = calls[start:]
    finally:
        restore()
    dev = str(xs.device)  # collectives run on the inputs' device
    assert fwd == [
        ("all_gather", "SUM", 53, 8, dev),  # the config check record (op unused)
        ("all_reduce", "MAX", 2 * n, 4, dev),
        ("all_reduce", "SUM", 3 * n, 4, dev),
    ], fwd
    assert bwd == [] and tok_bwd == [], (bwd, tok_bwd)
    assert [c[0] for c in unchecked] == ["all_reduce", "all_reduce"], unchecked
    assert tok_fwd == [
        ("all_gather", "SUM", 53, 8, dev),
        ("all_reduce", "MAX", n, 4, dev),
        ("all_reduce", "SUM", 2 * n, 4, dev),
    ], tok_fwd
    per_pos = lambda cs: sum(c[2] * c[3] for c in cs if c[0] == "all_reduce") / n  # noqa: E731
    return {
        "full_kl_bytes_per_position": per_pos(fwd),
        "token_bytes_per_position": per_pos(tok_fwd),
    }


def _tokens_vs_full(ctx: Ctx, dtype: torch.dtype, seed: int):
    x, _, g = _pair(seed, (3, 4), dtype)
    tokens = torch.randint(0, VOCAB, (3, 4), generator=g)
    tokens[0, 0], tokens[0, 1], tokens[0, 2] = 0, VOCAB - 1, 1  # first/last ids, slice edges
    w = torch.randn(3, 4, generator=g)
    xs = ctx.shard(x, True)
    lp = kd.vocab_parallel_token_logprobs(xs, tokens, vocab_start=ctx.start, temperature=0.9)
    (lp * w).sum().backward()
    same = gather_equal(lp)
    xf = x.clone().requires_grad_()
    ref = token_logprobs(xf, tokens, temperature=0.9)
    (ref * w).sum().backward()
    assert same
    assert_close(lp, ref, **tol(dtype))
    assert_close(lp.double(), token_logprobs_reference(x, tokens, 0.9), **tol(dtype))
    assert_close(xs.grad, xf.grad[..., ctx.start : ctx.end], **grad_tol(dtype))


def check_token_logprobs_float32(ctx: Ctx):
    _tokens_vs_full(ctx, torch.float32, 6)


def check_token_logprobs_bfloat16(ctx: Ctx):
    with small_chunks():
        _tokens_vs_full(ctx, torch.bfloat16, 7)


# ------------------------------------------------------------------ token_stats on every backend
def _support_cases(ctx: Ctx, x: torch.Tensor):
    """(name, vocab-parallel kwargs, single-process kwargs) of the truncations compared."""
    n = x.shape[0] * x.shape[1]
    g = _generator(31)
    keep = torch.rand(x.shape, generator=g) > 0.3
    keep.scatter_(-1, x.argmax(-1, keepdim=True), True)  # the sampled token (the argmax)
    ids, offsets = [], [0]
    for row in keep.reshape(n, -1):
        kept = row.nonzero().flatten()
        ids.append(kept)
        offsets.append(offsets[-1] + kept.numel())
    pair = (torch.cat(ids), torch.tensor(offsets))
    return [
        ("untruncated", {}, {}),
        ("top_k", {"top_k": 40}, {"top_k": 40}),
        ("top_p", {"top_p": 0.8}, {"top_p": 0.8}),
        ("top_k_top_p_min_p", {"top_k": 300, "top_p": 0.9, "min_p": 0.01},
         {"top_k": 300, "top_p": 0.9, "min_p": 0.01}),
        ("support_mask", {"support": ctx.shard(keep)}, {"support": keep}),
        ("support_ids", {"support": pair}, {"support": pair}),
    ]


def _token_stats_vs_full(ctx: Ctx, backend: str) -> dict:
    x, y, g = _pair(21, (2, 3))
    tokens = torch.randint(0, VOCAB, (2, 3), generator=g)
    tokens[0, 1] = -100  # ignored
    mask = torch.ones(2, 3, dtype=torch.bool)
    mask[1, 2] = False
    w = torch.randn(4, 2, 3, generator=g)
    done = []
    for name, vp_kw, kw in _support_cases(ctx, x):
        toks = tokens
        if vp_kw:  # a sampled token must lie in the support: the row's argmax does
            top = x.argmax(-1)
            toks = torch.where(tokens == -100, tokens, top)
        xs, ys = ctx.shard(x, True), ctx.shard(y, True)
        got = kd.vocab_parallel_token_stats(
            xs, ys, toks, vocab_start=ctx.start, entropy=True, mask=mask, temperature=0.8,
            backend=checked(backend), **vp_kw,
        )
        sum((f * wi).sum() for f, wi in zip(got, w)).backward()
        same = all(gather_equal(f) for f in got)
        xf, yf = x.clone().requires_grad_(), y.clone().requires_grad_()
        ref = klpenalty.token_stats(xf, yf, toks, entropy=True, mask=mask, temperature=0.8,
                                    backend="streaming", **kw)
        sum((f * wi).sum() for f, wi in zip(ref, w)).backward()
        assert same, name
        for field, a, b in zip(ref._fields, got, ref):
            try:
                assert_close(a, b, **tol(torch.float32))
            except AssertionError as err:
                raise AssertionError(f"{name} {field}: {err}") from None
        for what, grad, full in (("x", xs.grad, xf.grad), ("y", ys.grad, yf.grad)):
            try:
                assert_close(grad, full[..., ctx.start : ctx.end], **grad_tol(torch.float32))
            except AssertionError as err:
                raise AssertionError(f"{name} grad {what}: {err}") from None
        done.append(name)
    return done


def check_token_stats_streaming(ctx: Ctx):
    with small_chunks():
        return _token_stats_vs_full(ctx, "streaming")


def check_token_stats_native(ctx: Ctx):
    return _token_stats_vs_full(ctx, "native")


def check_token_stats_triton(ctx: Ctx):
    return _token_stats_vs_full(ctx, "triton")


def _linear_kl_vs_whole_head(ctx: Ctx, dtype: torch.dtype, backend: str) -> dict:
    """vocab_parallel_linear_kl with each rank's rows of both heads against linear_kl with the
    whole heads in one process: values, and the gradients of both hidden states (all-reduced)
    and of each rank's weight slices (the matching rows of the whole head's gradient)."""
    g = _generator(31)
    hidden_p, hidden_r = 8, 6
    hp = torch.randn(3, 5, hidden_p, generator=g).to(dtype)
    hr = torch.randn(3, 5, hidden_r, generator=g).to(dtype)
    wp = (torch.randn(VOCAB, hidden_p, generator=g) * 0.7).to(dtype)
    wr = (wp[:, :hidden_r] + 0.3 * torch.randn(VOCAB, hidden_r, generator=g)).to(dtype)
    tokens = torch.randint(0, VOCAB, (3, 5), generator=g)
    tokens[0, 2] = -100  # ignored
    tokens[1, 1] = ctx.starts[-1]  # the first id of the last rank's slice
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[2, 3] = False
    hp[2, 3] = float("nan")  # a masked row is never multiplied
    w = torch.randn(4, 3, 5, generator=g, dtype=dtype)  # grad_output other than ones
    done = []
    for name, kw in (
        ("tokens+mask+entropy", dict(tokens=tokens, mask=mask, entropy=True)),
        ("kl only", dict(mask=mask)),
    ):
        leaves = [t.detach().clone().requires_grad_() for t in (hp, hr)]
        shards = [t[ctx.start : ctx.end].detach().clone().requires_grad_() for t in (wp, wr)]
        got = kd.vocab_parallel_linear_kl(
            leaves[0], shards[0], leaves[1], shards[1], vocab_start=ctx.start,
            temperature=0.8, chunk_rows=4, backend=checked(backend), **kw,
        )
        sum((f * wi).sum() for f, wi in zip(got, w) if f is not None).backward()
        same = all(gather_equal(f) for f in got if f is not None)
        full = [t.detach().clone().requires_grad_() for t in (hp, wp, hr, wr)]
        ref = klpenalty.linear_kl(*full, temperature=0.8, backend="streaming", **kw)
        sum((f * wi).sum() for f, wi in zip(ref, w) if f is not None).backward()
        assert same, f"{name}: the results differ across ranks"
        for field, a, b in zip(ref._fields, got, ref):
            assert (a is None) == (b is None), f"{name} {field}"
            if a is not None:
                assert a.dtype == b.dtype, f"{name} {field}: {a.dtype} vs {b.dtype}"
                try:
                    assert_close(a, b, **tol(dtype))
                except AssertionError as err:
                    raise AssertionError(f"{name} {field}: {err}") from None
        pairs = (
            ("policy_hidden", leaves[0].grad, full[0].grad),
            ("ref_hidden", leaves[1].grad, full[2].grad),
            ("policy_weight_shard", shards[0].grad, full[1].grad[ctx.start : ctx.end]),
            ("ref_weight_shard", shards[1].grad, full[3].grad[ctx.start : ctx.end]),
        )
        for what, grad, expected in pairs:
            assert grad is not None, f"{name}: no gradient for {what}"
            assert grad.dtype == dtype, f"{name} {what}: {grad.dtype}"
            assert not torch.isnan(grad).any(), f"{name} {what}: NaN"
            try:
                assert_close(grad, expected, **grad_tol(dtype))
            except AssertionError as err:
                raise AssertionError(f"{name} grad {what}: {err}") from None
        assert torch.all(leaves[0].grad[2, 3] == 0)  # the masked row
        assert gather_equal(leaves[0].grad) and gather_equal(leaves[1].grad)
        done.append(name)
    return done


def check_linear_kl_float32_streaming(ctx: Ctx):
    with small_chunks():
        return _linear_kl_vs_whole_head(ctx, torch.float32, "streaming")


def check_linear_kl_float32_native(ctx: Ctx):
    return _linear_kl_vs_whole_head(ctx, torch.float32, "native")


def check_linear_kl_float64_streaming(ctx: Ctx):
    return _linear_kl_vs_whole_head(ctx, torch.float64, "streaming")


def check_linear_kl_float64_native(ctx: Ctx):
    return _linear_kl_vs_whole_head(ctx, torch.float64, "native")


def _linear_kl_options_vs_whole_head(ctx: Ctx, backend: str, only=None, chunk_rows=4) -> list:
    """vocab_parallel_linear_kl with biases, logit scales, soft-caps and every kind of support
    (``only``: the named cases) against linear_kl with the whole heads: values, and the
    gradients of both hidden states, of each rank's weight slices and of its bias slices."""
    g = _generator(41)
    hidden_p, hidden_r, lead = 8, 6, (3, 5)
    hp = torch.randn(*lead, hidden_p, generator=g)
    hr = torch.randn(*lead, hidden_r, generator=g)
    wp = torch.randn(VOCAB, hidden_p, generator=g) * 1.2
    wr = wp[:, :hidden_r] + 0.4 * torch.randn(VOCAB, hidden_r, generator=g)
    bp, br = torch.randn(VOCAB, generator=g) * 0.5, torch.randn(VOCAB, generator=g) * 0.5
    mask = torch.ones(lead, dtype=torch.bool)
    mask[2, 3] = False
    w = torch.randn(4, *lead, generator=g)
    transform = dict(logit_scale=1.3, softcap=6.0, ref_logit_scale=0.9, ref_softcap=8.0)
    zp = 6.0 * torch.tanh(1.3 * torch.nn.functional.linear(hp, wp, bp) / 6.0)  # (3, 5, V)
    tokens = zp.argmax(-1)  # the argmax: kept by every support
    tokens[0, 2] = -100  # ignored
    keep = torch.rand(zp.shape, generator=g) > 0.4
    keep.scatter_(-1, tokens.clamp_min(0).unsqueeze(-1), True)
    ids, offsets = [], [0]
    for row in keep.reshape(-1, VOCAB):
        kept = row.nonzero().flatten()
        ids.append(kept)
        offsets.append(offsets[-1] + kept.numel())
    pair = (torch.cat(ids), torch.tensor(offsets))
    cases = [
        ("transforms", {}, {}),
        ("top_k", {"top_k": 40}, {"top_k": 40}),
        ("top_p_min_p", {"top_p": 0.8, "min_p": 0.02}, {"top_p": 0.8, "min_p": 0.02}),
        ("support_mask", {"support": ctx.shard(keep)}, {"support": keep}),
        ("support_ids", {"support": pair}, {"support": pair}),
    ]
    done = []
    for name, vp_kw, kw in cases:
        if only is not None and name not in only:
            continue
        leaves = [t.detach().clone().requires_grad_() for t in (hp, hr)]
        shards = [t[ctx.start : ctx.end].detach().clone().requires_grad_()
                  for t in (wp, wr, bp, br)]
        got = kd.vocab_parallel_linear_kl(
            leaves[0], shards[0], leaves[1], shards[1], vocab_start=ctx.start,
            policy_bias_shard=shards[2], ref_bias_shard=shards[3], tokens=tokens, mask=mask,
            entropy=True, temperature=0.8, chunk_rows=chunk_rows, backend=checked(backend),
            **transform, **vp_kw,
        )
        sum((f * wi).sum() for f, wi in zip(got, w)).backward()
        same = all(gather_equal(f) for f in got)
        full = [t.detach().clone().requires_grad_() for t in (hp, wp, hr, wr, bp, br)]
        ref = klpenalty.linear_kl(
            *full[:4], policy_bias=full[4], ref_bias=full[5], tokens=tokens, mask=mask,
            entropy=True, temperature=0.8, backend="streaming", **transform, **kw,
        )
        sum((f * wi).sum() for f, wi in zip(ref, w)).backward()
        assert same, f"{name}: the results differ across ranks"
        for field, a, b in zip(ref._fields, got, ref):
            try:
                assert_close(a, b, **tol(torch.float32))
            except AssertionError as err:
                raise AssertionError(f"{name} {field}: {err}") from None
        rows = slice(ctx.start, ctx.end)
        pairs = (
            ("policy_hidden", leaves[0].grad, full[0].grad),
            ("ref_hidden", leaves[1].grad, full[2].grad),
            ("policy_weight_shard", shards[0].grad, full[1].grad[rows]),
            ("ref_weight_shard", shards[1].grad, full[3].grad[rows]),
            ("policy_bias_shard", shards[2].grad, full[4].grad[rows]),
            ("ref_bias_shard", shards[3].grad, full[5].grad[rows]),
        )
        for what, grad, expected in pairs:
            assert grad is not None, f"{name}: no gradient for {what}"
            try:
                assert_close(grad, expected, **grad_tol(torch.float32))
            except AssertionError as err:
                raise AssertionError(f"{name} grad {what}: {err}") from None
        done.append(name)
    return done


def check_linear_kl_options_streaming(ctx: Ctx):
    return _linear_kl_options_vs_whole_head(ctx, "streaming")


def check_linear_kl_options_native(ctx: Ctx):
    return _linear_kl_options_vs_whole_head(ctx, "native")


def check_linear_kl_bfloat16_softcap(ctx: Ctx):
    """bf16 heads with a soft-cap, a logit scale and a temperature (Gemma 2's head as it is
    trained): vocab_parallel_linear_kl equals linear_kl on the whole heads (the same float32
    math on every chunk), and its KL's error against float64 is within twice the plain bf16
    path's (``F.linear`` in bf16, then the transform and log_softmax in float32)."""
    g = _generator(43)
    n, hid, scale, cap, temp = 24, 8, 2.0, 30.0, 0.7
    rnd = lambda *s, a=1.0: (torch.randn(*s, generator=g) * a).bfloat16()  # noqa: E731
    hp, hr = rnd(n, hid, a=3.0), rnd(n, hid, a=3.0)
    wp, wr = rnd(VOCAB, hid, a=3.0 / math.sqrt(hid)), rnd(VOCAB, hid, a=3.0 / math.sqrt(hid))
    w = torch.randn(n, generator=g)
    kw = dict(logit_scale=scale, softcap=cap, temperature=temp, backend="native")
    leaves = [t.detach().clone().requires_grad_() for t in (hp, hr)]
    shards = [t[ctx.start : ctx.end].detach().clone().requires_grad_() for t in (wp, wr)]
    got = kd.vocab_parallel_linear_kl(leaves[0], shards[0], leaves[1], shards[1],
                                      vocab_start=ctx.start, chunk_rows=8, **kw).kl
    (got * w).sum().backward()
    full = [t.detach().clone().requires_grad_() for t in (hp, wp, hr, wr)]
    ref = klpenalty.linear_kl(*full, chunk_rows=8, **kw).kl
    (ref * w).sum().backward()
    assert gather_equal(got), "the KL differs across ranks"
    assert_close(got, ref, **tol(torch.float32))
    rows = slice(ctx.start, ctx.end)
    for what, a, b in (("policy_hidden", leaves[0].grad, full[0].grad),
                       ("ref_hidden", leaves[1].grad, full[2].grad),
                       ("policy_weight_shard", shards[0].grad, full[1].grad[rows]),
                       ("ref_weight_shard", shards[1].grad, full[3].grad[rows])):
        assert a is not None and a.dtype == torch.bfloat16, what
        assert_close(a, b, **grad_tol(torch.bfloat16))

    def kl_of(zp, zr):
        lp, lr = torch.log_softmax(zp / temp, -1), torch.log_softmax(zr / temp, -1)
        return (lp.exp() * (lp - lr)).sum(-1)

    def logits(h, wt, dtype):
        z = torch.nn.functional.linear(h, wt).to(dtype) * scale
        return torch.tanh(z / cap) * cap

    truth = kl_of(*(logits(h.double(), wt.double(), torch.float64) for h, wt in ((hp, wp), (hr, wr))))
    plain = kl_of(*(logits(h, wt, torch.float32) for h, wt in ((hp, wp), (hr, wr))))
    err = (got.double() - truth).abs().max().item()
    err_plain = (plain.double() - truth).abs().max().item()
    assert err <= 2 * err_plain + tol(torch.float32)["atol"], (err, err_plain)
    return {"max_abs_err_vs_f64": err, "plain_bf16_err_vs_f64": err_plain}


def check_linear_kl_options_triton(ctx: Ctx):  # interpreted: the two ways a support reaches the op
    return _linear_kl_options_vs_whole_head(ctx, "triton", ("top_p_min_p", "support_ids"), 8)


def check_entropy_and_token_logprobs_every_backend(ctx: Ctx):
    x, _, g = _pair(22, (4,))
    tokens = torch.randint(0, VOCAB, (4,), generator=g)
    for backend in ("streaming", "native", "triton"):
        xs = ctx.shard(x, True)
        h = kd.vocab_parallel_entropy(xs, backend=checked(backend), top_p=0.9)
        lp = kd.vocab_parallel_token_logprobs(xs, tokens, vocab_start=ctx.start, backend=backend)
        (h.sum() + lp.sum()).backward()
        xf = x.clone().requires_grad_()
        ref_h = klpenalty.entropy(xf, top_p=0.9)
        ref_lp = token_logprobs(xf, tokens)
        (ref_h.sum() + ref_lp.sum()).backward()
        assert_close(h, ref_h, **tol(torch.float32))
        assert_close(lp, ref_lp, **tol(torch.float32))
        assert_close(xs.grad, xf.grad[..., ctx.start : ctx.end], **grad_tol(torch.float32))


def check_token_stats_communication(ctx: Ctx):
    """The one-pass call: MAX of (N, 2), SUM of (s_x, s_y, a, b, x_t, y_t) (N, 6)."""
    x, y, _ = _pair(23, (2, 3))
    tok = torch.arange(6).reshape(2, 3) * 150
    calls, restore = _count_collectives()
    try:
        kd.vocab_parallel_token_stats(ctx.shard(x), ctx.shard(y), tok, vocab_start=ctx.start,
                                      entropy=True, check=False)
    finally:
        restore()
    assert calls == [("all_reduce", "MAX", 12, 4, "cpu"), ("all_reduce", "SUM", 36, 4, "cpu")] \
        or x.device.type != "cpu", calls
    return {"token_stats_bytes_per_position": sum(c[2] * c[3] for c in calls) / 6}


def _dp_data(ctx: Ctx):
    """Every rank's (values, mask) with a different batch size per rank, from one seed."""
    g = _generator(8)
    data = []
    for r in range(ctx.world):
        b = 1 + 2 * r  # uneven local batch sizes
        values = torch.rand(b, 6, generator=g) * 3
        mask = torch.rand(b, 6, generator=g) > 0.4
        values[~mask] = float("nan")  # padding may hold garbage
        data.append((values, mask))
    return data


def check_global_masked_mean(ctx: Ctx):
    data = _dp_data(ctx)
    values, mask = data[ctx.rank]
    values = values.clone().requires_grad_()
    mean = kd.global_masked_mean(values, mask)
    seq = kd.global_sequence_mean(values, mask)
    same = gather_equal(mean) and gather_equal(seq)
    (mean + 10 * seq).backward()
    all_v = torch.cat([d[0] for d in data])
    all_m = torch.cat([d[1] for d in data])
    count = all_m.sum()
    expect = all_v[all_m].double().mean()
    per_seq = torch.where(all_m, all_v, 0.0).double().sum(-1)[all_m.any(-1)]
    assert same
    assert_close(mean.double(), expect, **tol(torch.float32))
    assert_close(seq.double(), per_seq.mean(), **tol(torch.float32))
    # d mean / d values = mask / global count; d seq / d values = mask / global #sequences
    n_seq = all_m.any(-1).sum()
    expect_grad = mask.float() / count + 10 * mask.float() / n_seq
    # the gradient is mask / (global count) in float64, rounded once to float32: a value, so the
    # value entry (tighter than the gradient one, which allows for a recomputed softmax) holds
    assert_close(values.grad, expect_grad, **tol(torch.float32))
    return {"mean": mean.item()}


def check_controller_identical(ctx: Ctx):
    ctl = AdaptiveKLController(0.1, target=6.0, horizon=100)
    fixed = FixedKLController(0.05)
    single = AdaptiveKLController(0.1, target=6.0, horizon=100)
    g = _generator(9)
    betas, same = [], []
    for step in range(5):
        # per-rank sums and counts differ (rank r has r+1 sequences with a KL around 4..10)
        sums = [float(torch.rand(1, generator=g) * 6 + 4) * (r + 1) for r in range(ctx.world)]
        counts = [r + 1 for r in range(ctx.world)]
        upd = kd.update_controller_globally(
            ctl, torch.tensor(sums[ctx.rank], dtype=torch.float64), counts[ctx.rank],
            counts[ctx.rank],
        )
        kd.update_controller_globally(fixed, sums[ctx.rank], counts[ctx.rank], counts[ctx.rank])
        same.append(gather_equal(torch.tensor([ctl.value], dtype=torch.float64)))
        total = 0.0
        for s_ in sums:  # rank order, as the library sums
            total += s_
        single.update(total / sum(counts), sum(counts))
        betas.append(upd.beta)
        assert upd.beta == ctl.value and upd.n_steps == sum(counts)
    assert all(same), same
    assert ctl.value == single.value, (ctl.value, single.value)  # bit for bit
    assert fixed.value == 0.05
    assert betas[0] != 0.1  # the controller moved
    return {"betas": betas}


# ---- error paths: each returns {"type", "msg"}; the parent compares them across ranks --------


def _expect_error(fn):
    try:
        fn()
    except (ValueError, TypeError) as err:
        # the group must still be in step: one more collective must go through on every rank
        t = torch.ones(1)
        dist.all_reduce(t)
        assert t.item() == dist.get_world_size()
        return {"type": type(err).__name__, "msg": str(err)}
    raise AssertionError("no error raised")


def _shards(ctx: Ctx, shape=(2, 3)):
    x, y, _ = _pair(10, shape)
    return ctx.shard(x), ctx.shard(y)


def check_err_leading_dims(ctx: Ctx):
    shape = (2, 3) if ctx.rank != ctx.world - 1 else (2, 4)
    xs, ys = _shards(ctx, shape)
    return _expect_error(lambda: kd.vocab_parallel_full_kl(xs, ys))


def check_err_vocab_gap(ctx: Ctx):
    xs, ys = _shards(ctx)
    start = ctx.start + (1 if ctx.rank == ctx.world - 1 else 0)
    return _expect_error(lambda: kd.vocab_parallel_full_kl(xs, ys, vocab_start=start))


def check_err_vocab_overlap(ctx: Ctx):
    xs, ys = _shards(ctx)
    tok = torch.zeros(2, 3, dtype=torch.long)
    start = ctx.start - (1 if ctx.rank == 1 else 0)
    return _expect_error(lambda: kd.vocab_parallel_token_logprobs(xs, tok, vocab_start=start))


def check_err_vocab_order(ctx: Ctx):
    """Slices that tile [0, V) but not in rank order (rank r holds slice r+1 mod world)."""
    widths = SPLITS[ctx.world]
    k = (ctx.rank + 1) % ctx.world
    x = torch.randn(2, 3, widths[k])
    tok = torch.zeros(2, 3, dtype=torch.long)
    start = ctx.starts[k]
    return _expect_error(lambda: kd.vocab_parallel_token_logprobs(x, tok, vocab_start=start))


def check_err_dtype(ctx: Ctx):
    xs, ys = _shards(ctx)
    if ctx.rank == 0:
        xs = xs.bfloat16()
    return _expect_error(lambda: kd.vocab_parallel_full_kl(xs, ys))


def check_err_mask(ctx: Ctx):
    xs, ys = _shards(ctx)
    mask = torch.ones(2, 3, dtype=torch.bool)
    mask[0, ctx.rank % 3] = False  # a different position on every rank
    return _expect_error(lambda: kd.vocab_parallel_full_kl(xs, ys, mask=mask))


def check_err_temperature(ctx: Ctx):
    xs, ys = _shards(ctx)
    return _expect_error(lambda: kd.vocab_parallel_full_kl(xs, ys, temperature=1.0 + ctx.rank))


def check_err_tokens_differ(ctx: Ctx):
    xs, _ = _shards(ctx)
    tok = torch.zeros(2, 3, dtype=torch.long)
    tok[1, 1] = ctx.rank
    return _expect_error(lambda: kd.vocab_parallel_token_logprobs(xs, tok, vocab_start=ctx.start))


def check_err_token_range(ctx: Ctx):
    xs, _ = _shards(ctx)
    tok = torch.full((2, 3), VOCAB)  # one past the end of the whole vocabulary
    return _expect_error(lambda: kd.vocab_parallel_token_logprobs(xs, tok, vocab_start=ctx.start))


def check_err_local_shape(ctx: Ctx):
    xs, ys = _shards(ctx)
    if ctx.rank == 1:
        ys = ys[:, :2]  # policy and reference disagree on this rank only
    return _expect_error(lambda: kd.vocab_parallel_full_kl(xs, ys))


def check_err_nan(ctx: Ctx):
    xs, ys = _shards(ctx)
    if ctx.rank == ctx.world - 1:
        xs[1, 2, 0] = float("nan")  # NaN at a counted position on one rank's slice
    return _expect_error(lambda: kd.vocab_parallel_full_kl(xs, ys))


def check_err_ref_all_neginf(ctx: Ctx):
    xs, ys = _shards(ctx)
    ys[1, 1] = -float("inf")  # the reference has no mass at all at a counted position
    return _expect_error(lambda: kd.vocab_parallel_full_kl(xs, ys))


def check_err_policy_all_neginf(ctx: Ctx):
    xs, ys = _shards(ctx)
    xs[0, 2] = -float("inf")  # the policy has no mass at all at a counted position
    return _expect_error(lambda: kd.vocab_parallel_full_kl(xs, ys))


def check_err_controller_beta(ctx: Ctx):
    ctl = AdaptiveKLController(0.1 if ctx.rank else 0.2, target=6.0, horizon=100)
    return _expect_error(lambda: kd.update_controller_globally(ctl, 5.0, 1, 1))


def check_err_global_mean_empty(ctx: Ctx):
    mask = torch.zeros(2, 3, dtype=torch.bool)
    return _expect_error(lambda: kd.global_masked_mean(torch.ones(2, 3), mask))


def check_err_global_mean_local(ctx: Ctx):
    mask = torch.ones(2, 3 if ctx.rank else 4, dtype=torch.bool)  # wrong shape on rank 0
    return _expect_error(lambda: kd.global_masked_mean(torch.ones(2, 3), mask))


def _linear_heads(ctx: Ctx):
    """(hidden (2, 3, 4), this rank's rows (V_r, 4) of a head) for the error checks."""
    g = _generator(12)
    h, w = torch.randn(2, 3, 4, generator=g), torch.randn(VOCAB, 4, generator=g)
    return h, w[ctx.start : ctx.end]


def check_err_linear_support_ids(ctx: Ctx):
    h, w = _linear_heads(ctx)
    ids = torch.tensor([0, VOCAB] * 6)  # an id past the whole vocabulary (on every rank)
    offsets = torch.arange(0, 13, 2)
    return _expect_error(lambda: kd.vocab_parallel_linear_kl(
        h, w, h, w, vocab_start=ctx.start, support=(ids, offsets)))


def check_err_linear_bias_shard(ctx: Ctx):
    h, w = _linear_heads(ctx)
    width = w.shape[0] + (ctx.rank == ctx.world - 1)  # the last rank's bias is one too wide
    return _expect_error(lambda: kd.vocab_parallel_linear_kl(
        h, w, h, w, vocab_start=ctx.start, policy_bias_shard=torch.zeros(width), softcap=30.0))


def check_err_linear_nan_in_one_slice(ctx: Ctx):
    """NaN in the last rank's rows of the policy's head: every position's outputs are NaN on
    every rank, and every rank names the weight."""
    h, w = _linear_heads(ctx)
    if ctx.rank == ctx.world - 1:
        w = w.clone()
        w[-1, 0] = float("nan")
    return _expect_error(lambda: kd.vocab_parallel_linear_kl(h, w, h, w.nan_to_num(),
                                                             vocab_start=ctx.start))


def check_err_settings_differ(ctx: Ctx) -> dict:
    """One argument that differs on the last rank, per case: every rank raises (the group
    still in step afterwards); {case: {"type", "msg"}}."""
    h, w = _linear_heads(ctx)
    xs, ys = _shards(ctx)
    last = ctx.rank == ctx.world - 1
    head = dict(vocab_start=ctx.start)
    mask = torch.ones(2, 3, dtype=torch.bool)
    mask[0, 2 if last else 0] = False  # the same count, another position
    tokens = torch.zeros(2, 3, dtype=torch.long)
    ids = torch.tensor([0, 3 if last else 4] * 6)
    offsets = torch.arange(0, 13, 2)
    linear = lambda **kw: kd.vocab_parallel_linear_kl(h, w, h, w, **head, **kw)  # noqa: E731
    cases = {
        "mask": lambda: linear(mask=mask),
        "temperature": lambda: linear(temperature=0.5 if last else 0.7),
        "logit_scale": lambda: linear(logit_scale=1.5 if last else 1.0),
        "softcap": lambda: linear(softcap=20.0 if last else 30.0),
        "ref_softcap": lambda: linear(softcap=30.0, ref_softcap=20.0 if last else None),
        "chunk_rows": lambda: linear(chunk_rows=2 if last else 3),
        "entropy": lambda: linear(entropy=last),
        "tokens_given": lambda: linear(tokens=tokens if last else None),
        "tokens": lambda: linear(tokens=tokens + int(last)),
        "top_k_one_rank": lambda: linear(top_k=5 if last else None),
        "top_p": lambda: linear(top_p=0.8 if last else 0.9),
        "support_ids": lambda: linear(support=(ids, offsets)),
        "bias_one_rank": lambda: linear(policy_bias_shard=torch.zeros(w.shape[0]) if last
                                        else None),
        "dtype": lambda: kd.vocab_parallel_linear_kl(
            h.double() if last else h, w.double() if last else w, h, w, **head),
        "hidden_size": lambda: kd.vocab_parallel_linear_kl(
            h[..., :3] if last else h, w[:, :3] if last else w, h, w, **head),
        "hidden_grad": lambda: kd.vocab_parallel_linear_kl(
            h.clone().requires_grad_(last), w, h, w, **head),
        "divergence_kind": lambda: kd.vocab_parallel_linear_divergence(
            h, w, h, w, "jsd" if last else "forward_kl", **head),
        "divergence_beta": lambda: kd.vocab_parallel_linear_divergence(
            h, w, h, w, "jsd", beta=0.3 if last else 0.5, **head),
        "divergence_kind_invalid": lambda: kd.vocab_parallel_linear_divergence(
            h, w, h, w, "kl" if last else "jsd", **head),
        "logits_top_p": lambda: kd.vocab_parallel_full_kl(xs, ys, top_p=0.8 if last else 0.9),
        "logits_top_k_one_rank": lambda: kd.vocab_parallel_full_kl(
            xs, ys, top_k=5 if last else None),
        "logits_divergence_kind": lambda: kd.vocab_parallel_divergence(
            xs, ys, "tvd" if last else "reverse_kl"),
        "logits_entropy": lambda: kd.vocab_parallel_token_stats(
            xs, ys, tokens, vocab_start=ctx.start, entropy=last),
    }
    return {case: _expect_error(fn) for case, fn in cases.items()}


def _divergences_vs_single(ctx: Ctx, dtype: torch.dtype, backend: str) -> list:
    """vocab_parallel_divergence (logits) and vocab_parallel_linear_divergence (heads) of every
    kind against klpenalty.divergence / linear_divergence on the whole vocabulary."""
    x, y, g = _pair(31, (3, 4), dtype, spread=2.0)
    mask = torch.rand(3, 4, generator=g) > 0.2
    mask[1, 2] = False
    x[1, 2] = float("nan")  # a masked position may hold anything
    w = torch.randn(3, 4, generator=g, dtype=torch.float64)
    hs = torch.randn(3, 4, 8, generator=g, dtype=torch.float64).to(dtype)
    ws = (torch.randn(VOCAB, 8, generator=g, dtype=torch.float64) * 0.7).to(dtype)
    ht = torch.randn(3, 4, 12, generator=g, dtype=torch.float64).to(dtype)
    wt = (torch.randn(VOCAB, 12, generator=g, dtype=torch.float64) * 0.7).to(dtype)
    bs = (torch.randn(VOCAB, generator=g, dtype=torch.float64) * 0.5).to(dtype)
    bt = (torch.randn(VOCAB, generator=g, dtype=torch.float64) * 0.5).to(dtype)
    heads_kw = dict(logit_scale=1.2, softcap=5.0, teacher_logit_scale=0.8)
    done = []
    for kind in klpenalty.DIVERGENCES:
        kw = dict(mask=mask, temperature=0.8, beta=0.3, skew=0.2)
        xs = ctx.shard(x, True)
        got = kd.vocab_parallel_divergence(xs, ctx.shard(y), kind, backend=backend, **kw)
        (got.double() * w).sum().backward()
        xf = x.clone().requires_grad_()
        ref = klpenalty.divergence(xf, y, kind, backend="streaming", **kw)
        (ref.double() * w).sum().backward()
        assert gather_equal(got), f"{kind}: the values differ across ranks"
        assert_close(got, ref, **tol(dtype))
        assert_close(xs.grad, xf.grad[..., ctx.start : ctx.end], **grad_tol(dtype))
        assert torch.all(xs.grad[1, 2] == 0), kind  # the masked row
        # the heads: each rank its rows of both
        # (with biases, logit scales and a soft-cap)
        hl = hs.clone().requires_grad_()
        wl, bl = (t[ctx.start : ctx.end].clone().requires_grad_() for t in (ws, bs))
        got = kd.vocab_parallel_linear_divergence(
            hl, wl, ht, wt[ctx.start : ctx.end], kind, vocab_start=ctx.start, chunk_rows=5,
            student_bias_shard=bl, teacher_bias_shard=bt[ctx.start : ctx.end],
            backend=backend, **heads_kw, **kw)
        (got.double() * w).sum().backward()
        hf_, wf, bf = (t.clone().requires_grad_() for t in (hs, ws, bs))
        ref = klpenalty.linear_divergence(hf_, wf, ht, wt, kind, student_bias=bf,
                                          teacher_bias=bt, backend="streaming", **heads_kw,
                                          **kw)
        (ref.double() * w).sum().backward()
        assert gather_equal(got) and gather_equal(hl.grad), f"{kind}: differs across ranks"
        assert_close(got, ref, **tol(dtype))
        assert_close(hl.grad, hf_.grad, **grad_tol(dtype))
        assert_close(wl.grad, wf.grad[ctx.start : ctx.end], **grad_tol(dtype))
        assert_close(bl.grad, bf.grad[ctx.start : ctx.end], **grad_tol(dtype))
        done.append(kind)
    return done


def check_divergences_float32_streaming(ctx: Ctx):
    with small_chunks():
        return _divergences_vs_single(ctx, torch.float32, "streaming")


def check_divergences_float32_native(ctx: Ctx):  # the kernel's float32 walk on global stats
    return _divergences_vs_single(ctx, torch.float32, "native")


def check_divergences_float64_native(ctx: Ctx):
    return _divergences_vs_single(ctx, torch.float64, "native")


def check_divergences_on_the_student_support(ctx: Ctx):
    """vocab_parallel_divergence with the student's support, every kind, streaming and native:
    the sampler's settings (the threshold across ranks), this rank's slice of a bool kept set
    and an engine's global (ids, offsets), against klpenalty.divergence on the whole
    vocabulary with the same support; the gradient 0 off it."""
    x, y, g = _pair(33, (3, 4), torch.float32, spread=2.0)
    mask = torch.ones(3, 4, dtype=torch.bool)
    mask[2, 1] = False
    kept = torch.rand(x.shape, generator=g) < 0.3
    kept[..., 5] = True
    ids = kept.reshape(-1, VOCAB).nonzero()[:, 1]
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), kept.sum(-1).reshape(-1).cumsum(0)])
    w = torch.randn(3, 4, generator=g, dtype=torch.float64)
    cases = {
        "top_k": (dict(top_k=40), dict(top_k=40)),
        "top_p_min_p": (dict(top_p=0.8, min_p=0.01), dict(top_p=0.8, min_p=0.01)),
        "keep": (dict(support=ctx.shard(kept)), dict(support=kept)),
        "ids": (dict(support=(ids, offsets), vocab_start=ctx.start), dict(support=(ids, offsets))),
    }
    done = []
    for backend in ("streaming", "native"):
        for name, (local, whole) in cases.items():
            for kind in klpenalty.DIVERGENCES:
                kw = dict(mask=mask, temperature=0.8, beta=0.3, skew=0.2)
                xs = ctx.shard(x, True)
                got = kd.vocab_parallel_divergence(xs, ctx.shard(y), kind,
                                                   backend=checked(backend), **kw, **local)
                (got.double() * w).sum().backward()
                xf = x.clone().requires_grad_()
                ref = klpenalty.divergence(xf, y, kind, backend="streaming", **kw, **whole)
                (ref.double() * w).sum().backward()
                where = f"{backend} {name} {kind}"
                assert gather_equal(got), f"{where}: the values differ across ranks"
                assert_close(got, ref, **tol(torch.float32))
                assert_close(xs.grad, xf.grad[..., ctx.start : ctx.end],
                             **grad_tol(torch.float32))
                assert torch.isfinite(xs.grad).all(), where
                assert (xs.grad == 0).sum() > xs.grad.numel() // 2, where  # 0 off the support
                if kind == "forward_kl":  # the teacher's mass off the support
                    assert torch.isposinf(got[mask]).all(), where
                done.append(where)
    return done


CHECKS = [name for name in dict(globals()) if name.startswith("check_")]


def main(argv: list[str]) -> int:
    rank, world, store, out_dir = int(argv[1]), int(argv[2]), argv[3], argv[4]
    backend = argv[5] if len(argv) > 5 else "gloo"
    torch.set_num_threads(1)
    t_init = time.perf_counter()
    if backend == "nccl":  # one GPU per rank; the checks' tensors are made on it
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        torch.set_default_device(device)
    dist.init_process_group(
        backend,
        init_method=f"file://{store}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=PG_TIMEOUT_S),
    )
    ctx = Ctx(rank, world)
    results = {}
    init_s = time.perf_counter() - t_init
    for name in CHECKS:
        t0 = time.perf_counter()
        try:
            data = globals()[name](ctx)
            results[name] = {"ok": True, "data": data}
        except Exception:  # noqa: BLE001 - reported to the parent, which fails the test
            results[name] = {"ok": False, "error": traceback.format_exc()}
        results[name]["seconds"] = time.perf_counter() - t0
    dist.destroy_process_group()
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump({"klpenalty": klpenalty.__file__, "backend": backend, "init_s": init_s,
                   "results": results}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
