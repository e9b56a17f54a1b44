"""klpenalty.linear_policy_loss against plain float64 autograd of the same loss.

Shape letters: B sequences, T positions, N = B·T rows, H hidden, V vocabulary.

The reference materialises both models' logits and writes the loss with plain torch ops in
float64: the clipped surrogate max(−A·r, −A·clip(r, 1 − ε_low, 1 + ε_high)) on log π of the
sampled tokens, plus beta·w·KL, reduced as TRL / verl do. For float32 and bfloat16 inputs the
reference sees the input-dtype logits' values (``tests/test_linear.reference``, whose module
docstring says how), so the tolerance table's entries apply unchanged.
"""

from __future__ import annotations

import pytest
import torch

import klpenalty
from klpenalty import PolicyLoss, linear_kl, linear_policy_loss
from klpenalty.bench import alloc_profile

from .helpers import tol
from .test_linear import close_grad, make_heads, make_tokens, reference

POLICY = ("hp", "wp", "bp")
LEADING = (3, 5)  # (B, T)


def make_batch(dtype, *, seed=0, bias=True, temperature=0.8):
    """Heads, tokens (some ignored), a mask with an empty sequence, advantages of both signs,
    old log-probs (at ``temperature``) off the current ones by O(0.3), so that both clip
    bounds bind, and KL weights; garbage (NaN) wherever a token does not count."""
    t = make_heads(LEADING, dtype=dtype, seed=seed, bias=bias)
    tokens = make_tokens(LEADING, 37, seed=seed + 1)
    mask = torch.ones(LEADING, dtype=torch.bool)
    mask[1] = False  # an empty sequence
    mask[2, 4] = False
    counted = mask & (tokens != -100)
    g = torch.Generator().manual_seed(seed + 2)
    outs, _ = reference(t, tokens=tokens, mask=counted, temperature=temperature)
    old = outs[1].detach() + 0.3 * torch.randn(LEADING, generator=g, dtype=torch.float64)
    adv = torch.randn(LEADING, generator=g, dtype=torch.float64)
    w = torch.rand(LEADING, generator=g, dtype=torch.float64) + 0.5
    nan = torch.tensor(float("nan"), dtype=torch.float64)
    batch = dict(
        tokens=tokens, mask=mask,
        advantages=torch.where(counted, adv, nan).float(),
        old_logprobs=torch.where(counted, old, nan).float(),
        kl_weights=torch.where(counted, w, nan).float(),
    )
    t["hp"][~mask] = float("nan")  # rows that do not count are never multiplied
    t["hr"][~mask] = float("inf")
    return t, batch


def fused(t, batch, **kw):
    return linear_policy_loss(
        t["hp"], t["wp"], t["hr"], t["wr"], batch["tokens"], policy_bias=t["bp"],
        ref_bias=t["br"], **{k: v for k, v in batch.items() if k != "tokens"}, **kw,
    )


def reference_loss(t, batch, *, beta, reduction="token-mean", epsilon_low=0.2,
                   epsilon_high=None, temperature=1.0, **transforms):
    """(loss, per-token kl, lp, ratio, clipped) in float64 and the float64 leaves."""
    tokens, mask = batch["tokens"], batch["mask"]
    counted = mask & (tokens != -100)
    outs, leaves = reference(t, tokens=tokens, mask=counted, temperature=temperature,
                             **transforms)
    kl, lp = outs[0], outs[1]
    zero = torch.zeros((), dtype=torch.float64)
    get = lambda k: None if batch.get(k) is None else torch.where(counted, batch[k].double(), zero)  # noqa: E731
    adv, old, w = get("advantages"), get("old_logprobs"), get("kl_weights")
    ratio = torch.exp(lp - (lp.detach() if old is None else old))
    eps_high = epsilon_low if epsilon_high is None else epsilon_high
    per = beta * kl * (1.0 if w is None else w)
    clipped = torch.zeros_like(counted)
    if adv is not None:
        per = per + torch.maximum(
            -adv * ratio, -adv * ratio.clamp(1 - epsilon_low, 1 + eps_high)
        )
        clipped = ((adv > 0) & (ratio > 1 + eps_high)) | ((adv < 0) & (ratio < 1 - epsilon_low))
    per = torch.where(counted, per, zero)
    m = counted.double()
    if reduction == "token-mean":
        loss = per.sum() / m.sum().clamp(min=1)
    elif reduction == "sequence-mean":
        n = m.sum(-1)
        seq = per.sum(-1) / n.clamp(min=1)
        loss = seq[n > 0].mean() if bool((n > 0).any()) else per.sum() * 0
    else:
        loss = per.sum()
    return loss, kl, lp, torch.where(counted, ratio.detach(), zero), clipped & counted, leaves


def check(t, batch, dtype, upstream=1.0, **kw):
    for k in POLICY:
        if t[k] is not None:
            t[k].requires_grad_()
    got = fused(t, batch, **kw)
    want, kl, lp, ratio, clipped, leaves = reference_loss(t, batch, **kw)
    names = [k for k in POLICY if t[k] is not None]
    got_g = torch.autograd.grad(got.loss * upstream, [t[k] for k in names])
    want_g = torch.autograd.grad(want * upstream, [leaves[k] for k in names])
    torch.testing.assert_close(got.loss.double(), want, **tol(dtype))
    for a, b in ((got.kl, kl), (got.logprobs, lp), (got.ratio, ratio)):
        torch.testing.assert_close(a.double(), b, **tol(dtype))
    assert torch.equal(got.clipped, clipped)
    for k, a, b in zip(names, got_g, want_g):
        close_grad(a, b, dtype, k)
        assert torch.isfinite(a).all()
    return got, dict(zip(names, got_g))


# --------------------------------------------------------------------------- values and grads
@pytest.mark.parametrize("reduction", ["token-mean", "sequence-mean", "sum"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_loss_and_grads_match_float64_autograd(reduction, dtype):
    t, batch = make_batch(dtype)
    got, grads = check(t, batch, dtype, beta=0.3, reduction=reduction, epsilon_low=0.2,
                       epsilon_high=0.28, temperature=0.8, chunk_rows=4)
    counted = batch["mask"] & (batch["tokens"] != -100)
    adv, ratio = batch["advantages"], got.ratio
    assert bool((got.clipped & (adv > 0) & (ratio > 1.28)).any())  # both bounds bind here
    assert bool((got.clipped & (adv < 0) & (ratio < 0.8)).any())
    assert got.clip_fraction == got.clipped[counted].double().mean().to(got.clip_fraction.dtype)
    assert torch.all(grads["hp"][~batch["mask"]] == 0)
    for o in (got.kl, got.logprobs, got.ref_logprobs, got.ratio):
        assert o.shape == LEADING and torch.all(o[~counted] == 0) and not o.requires_grad
    assert got.loss.shape == () and got.loss.requires_grad
    torch.testing.assert_close(got.loss, got.pg_loss + 0.3 * got.kl_loss, **tol(dtype))


@pytest.mark.parametrize("backend", ["streaming", "native"])
def test_logit_transforms_and_backends(backend):
    t, batch = make_batch(torch.float32, seed=5)
    check(t, batch, torch.float32, beta=0.1, reduction="sequence-mean", logit_scale=1.7,
          softcap=4.0, ref_logit_scale=0.9, ref_softcap=2.5, temperature=1.3, chunk_rows=3,
          backend=backend)


def test_kl_only_reported():
    """beta = 0: the KL is a metric, the reference's logits are not read by the gradient."""
    t, batch = make_batch(torch.float32, seed=6)
    got, _ = check(t, batch, torch.float32, beta=0.0, reduction="sum", chunk_rows=5)
    assert got.kl_loss > 0 and torch.equal(got.loss, got.pg_loss)


def test_upstream_scalar_scales_every_gradient():
    t, batch = make_batch(torch.float32, seed=7)
    check(t, batch, torch.float32, upstream=3.7, beta=0.2)
    # accumulation over two losses, as gradient accumulation does
    for k in POLICY:
        t[k].grad = None
    out = fused(t, batch, beta=0.2)
    (out.loss * 3.7).backward()
    once = {k: t[k].grad.clone() for k in POLICY}
    (fused(t, batch, beta=0.2).loss * -1.5).backward()
    for k in POLICY:
        close_grad(t[k].grad, (once[k] * (2.2 / 3.7)).double(), torch.float32, k)


def test_on_policy_and_kl_only_against_linear_kl():
    """old_logprobs None (r = 1, gradient −A·∇log π) and advantages None (the KL alone), against
    linear_kl's per-token outputs with autograd: its recomputing backward with non-uniform
    per-token upstream gradients."""
    t, batch = make_batch(torch.float64, seed=9)
    tokens, mask = batch["tokens"], batch["mask"]
    counted = mask & (tokens != -100)
    for k in POLICY:
        t[k].requires_grad_()
    adv = batch["advantages"].double()
    out = fused(t, {**batch, "old_logprobs": None}, beta=0.5, reduction="sum")
    assert torch.all(out.ratio[counted] == 1) and not out.clipped.any()
    got = torch.autograd.grad(out.loss, [t[k] for k in POLICY])
    s = linear_kl(t["hp"], t["wp"], t["hr"], t["wr"], tokens=tokens, mask=counted,
                  policy_bias=t["bp"], ref_bias=t["br"])
    w = torch.where(counted, batch["kl_weights"].double(), 0.0)
    a = torch.where(counted, -adv, 0.0)
    # on-policy the surrogate's value is −A (r = 1), its gradient −A·∇log π
    want_loss = (a * s.logprobs + 0.5 * w * s.kl).sum()
    want = torch.autograd.grad(want_loss, [t[k] for k in POLICY])
    torch.testing.assert_close(out.loss, (a + 0.5 * w * s.kl).sum().detach(), **tol(torch.float64))
    for k, a, b in zip(POLICY, got, want):
        close_grad(a, b, torch.float64, k)

    kl_only = fused(t, {**batch, "advantages": None, "kl_weights": None}, beta=2.0)
    want_kl = 2.0 * s.kl[counted].mean()
    torch.testing.assert_close(kl_only.loss, want_kl.detach(), **tol(torch.float64))
    assert kl_only.pg_loss == 0


def test_gradient_formed_in_the_forward_no_recompute(monkeypatch):
    """Two LM-head matmuls per chunk in the forward (both models), none in the backward."""
    from klpenalty.linear import policy_loss

    t, batch = make_batch(torch.float32, seed=11)
    for k in POLICY:
        t[k].requires_grad_()
    calls = []
    original = policy_loss._logits
    monkeypatch.setattr(policy_loss, "_logits", lambda h, w, *a: calls.append(w) or original(h, w, *a))
    out = fused(t, batch, beta=0.1, chunk_rows=2)
    counted = int((batch["mask"] & (batch["tokens"] != -100)).sum())
    assert len(calls) == 2 * -(-counted // 2)
    out.loss.backward()
    assert len(calls) == 2 * -(-counted // 2)
    with pytest.raises(RuntimeError, match="backpropagated once"):
        out2 = fused(t, batch, beta=0.1)
        out2.loss.backward(retain_graph=True)
        out2.loss.backward()


def test_no_grad_all_masked_and_empty():
    t, batch = make_batch(torch.float32, seed=13)
    for k in POLICY:
        t[k].requires_grad_()
    with torch.no_grad():
        quiet = fused(t, batch, beta=0.1)
    loud = fused(t, batch, beta=0.1)
    assert torch.equal(quiet.loss, loud.loss.detach()) and not quiet.loss.requires_grad
    for reduction in ("token-mean", "sequence-mean", "sum"):
        none = fused(t, {**batch, "mask": torch.zeros(LEADING, dtype=torch.bool)}, beta=0.1,
                     reduction=reduction)
        assert none.loss == 0 and none.clip_fraction == 0
        none.loss.backward()
        assert all(not t[k].grad.any() for k in POLICY)
    t = make_heads((0, 4), dtype=torch.float32)
    out = linear_policy_loss(t["hp"], t["wp"], t["hr"], t["wr"],
                             torch.zeros(0, 4, dtype=torch.long), beta=0.1)
    assert out.loss == 0 and out.kl.shape == (0, 4)


def test_never_allocates_rows_by_vocab():
    n, h, vocab, chunk = 256, 16, 2048, 16
    t = make_heads((n,), h_p=h, h_r=h, vocab=vocab, dtype=torch.float32, seed=18)
    tokens = make_tokens((n,), vocab, ignored=0.0)
    adv = torch.randn(n)
    for k in POLICY:
        t[k].requires_grad_()

    def step():
        out = linear_policy_loss(t["hp"], t["wp"], t["hr"], t["wr"], tokens, beta=0.1,
                                 advantages=adv, policy_bias=t["bp"], ref_bias=t["br"],
                                 chunk_rows=chunk)
        out.loss.backward()
        for k in POLICY:
            t[k].grad = None

    step()  # warm-up
    peak, largest = alloc_profile(step)
    assert largest <= chunk * vocab * 4  # a chunk's (R, V) buffer, never (N, V)
    # beyond the gradients (held from the forward): three (R, V) buffers (both logits and dz)
    # plus O(N) vectors, not a fourth left over from the previous chunk
    grads = (n * h + vocab * h + vocab) * 4
    assert peak - grads <= 3.5 * chunk * vocab * 4


# --------------------------------------------------------------------------- checks
def test_result_type_and_export():
    assert klpenalty.linear_policy_loss is linear_policy_loss and "linear_policy_loss" in klpenalty.__all__
    t, batch = make_batch(torch.float32, seed=3)
    assert isinstance(fused(t, batch, beta=0.1), PolicyLoss)


def _args(**over):
    t, batch = make_batch(torch.float32, seed=1)
    kw = dict(policy_hidden=t["hp"], policy_weight=t["wp"], ref_hidden=t["hr"],
              ref_weight=t["wr"], tokens=batch["tokens"], beta=0.1,
              advantages=batch["advantages"], mask=batch["mask"])
    kw.update(over)
    return kw


INVALID = [
    (dict(advantages=torch.zeros(3)), ValueError, r"advantages must have shape \(3, 5\)"),
    (dict(old_logprobs=torch.zeros(3, 5, dtype=torch.long)), TypeError, "old_logprobs must be a floating"),
    (dict(kl_weights=torch.zeros(5, 3)), ValueError, "kl_weights must have shape"),
    (dict(beta=-1.0), ValueError, "beta must be finite and >= 0"),
    (dict(epsilon_low=-0.1), ValueError, "epsilon_low must be finite and >= 0"),
    (dict(epsilon_high=float("inf")), ValueError, "epsilon_high must be finite"),
    (dict(reduction="mean"), ValueError, "reduction must be one of"),
    (dict(tokens=None), TypeError, "tokens must be a torch.Tensor"),
    (dict(tokens=torch.zeros(3, 5)), TypeError, "tokens must be an integer tensor"),
    (dict(tokens=torch.full((3, 5), 37)), ValueError, r"tokens must lie in \[0, 37\)"),
    (dict(ref_hidden=torch.randn(3, 5, 9, requires_grad=True)), ValueError,
     "ref_hidden requires grad .* treats the reference as frozen"),
    (dict(advantages=torch.full((3, 5), float("nan"))), ValueError,
     r"advantages contains NaN .* the first at index \(0, 0\)"),
    (dict(chunk_rows=0), ValueError, "chunk_rows must be >= 1"),
]


@pytest.mark.parametrize("over, exc, match", INVALID, ids=[m[:30] for _, _, m in INVALID])
def test_validation_errors(over, exc, match):
    with pytest.raises(exc, match=match):
        linear_policy_loss(**_args(**over))


def test_sequence_mean_needs_a_sequence_dim_and_nan_outside_counts_is_fine():
    t = make_heads((), dtype=torch.float32)
    with pytest.raises(ValueError, match="sequence-mean' needs hidden states"):
        linear_policy_loss(t["hp"], t["wp"], t["hr"], t["wr"], torch.tensor(3), beta=0.1,
                           reduction="sequence-mean")
    out = linear_policy_loss(**_args())  # NaN advantages where not counted: no error
    assert torch.isfinite(out.loss)


def test_rollout_tensors_are_constants():
    """Advantages, old log-probs and KL weights with a graph of their own get no gradient and
    leave their graph alone (they are read detached)."""
    t, batch = make_batch(torch.float32, seed=21)
    t["hp"].requires_grad_()
    src = torch.zeros(LEADING, requires_grad=True)
    rollout = {k: batch[k] + src for k in ("advantages", "old_logprobs", "kl_weights")}
    for _ in range(2):  # the rollout's graph survives both backward passes
        fused(t, {**batch, **rollout}, beta=0.1).loss.backward()
    assert src.grad is None and t["hp"].grad is not None
