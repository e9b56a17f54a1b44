"""The fused LM heads are as accurate as the plain PyTorch path of the same dtype.

flash-attention's rule: a fused path's error against float64 is at most twice the error of
the plain path in the same dtype. The plain path is what a training loop writes:
``F.linear(h, W, b)`` in the input dtype, the GEMM's output upcast to float32, then the scale,
the soft-cap (Gemma 2's ``final_logit_softcapping``), the temperature and ``log_softmax`` in
float32 (:func:`tests.helpers.transformed`). Both are measured against float64 on the same
input values (bf16 inputs upcast exactly), over a seeded random search of shapes, logit
scales, soft-caps, temperatures and dtypes: values and the gradients to every hidden state,
weight and bias.

A bf16 head rounds its logits once (the GEMM's output); a second rounding after the scale or
the tanh (a transform run in bf16) doubles the logits' error, which this search catches.
"""

from __future__ import annotations

import math

import pytest
import torch

import klpenalty
from klpenalty.linear import linear_kl, linear_policy_loss

from .helpers import GRAD_REL_TOL, TOLERANCES, transformed

# The absolute floor under 2 × the plain path's error: the float32 engine's own error bound
# (the tolerance table's float32 entries), which the plain path may undercut by luck on a
# small case (a few float32 ulps summed in another order).
VALUE_FLOOR = TOLERANCES[torch.float32][0]
GRAD_FLOOR = GRAD_REL_TOL[torch.float32]

TRIALS = 6  # per dtype and function


def _cases(seed: int):
    """Seeded random (N, H, V, scale, cap, T) tuples: odd V (partial tiles), caps from tight
    (most logits near ±cap) to loose, scales around 1."""
    g = torch.Generator().manual_seed(seed)
    pick = lambda seq: seq[int(torch.randint(len(seq), (1,), generator=g))]  # noqa: E731
    for _ in range(TRIALS):
        yield (
            pick([5, 17, 40, 64]), pick([8, 16, 24]), pick([37, 257, 515]),
            pick([1.0, 0.7, 2.0]), pick([None, 5.0, 30.0]), pick([1.0, 0.7, 1.3]),
        )


def _heads(n, h, vocab, dtype, seed):
    """Two models' (hidden, weight, bias) with logits of O(10) before the transform."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s, a=1.0: (torch.randn(*s, generator=g, dtype=torch.float64) * a).to(dtype)  # noqa: E731
    return [rnd(n, h, a=3.0), rnd(vocab, h, a=3.0 / math.sqrt(h)), rnd(vocab, a=0.5),
            rnd(n, h, a=3.0), rnd(vocab, h, a=3.0 / math.sqrt(h)), rnd(vocab, a=0.5)]


def _plain(t, scale, cap, temperature, tokens, math_dtype=None):
    """The plain path's (kl, log π(t), log ρ(t), H(π)) from the heads ``t``: torch ops on the
    materialised logits, in float32 (``math_dtype`` float64: ``t`` already upcast, the
    reference)."""
    zp = transformed(t[0], t[1], t[2], scale, cap)
    zr = transformed(t[3], t[4], t[5], scale, cap)
    if math_dtype is None:
        zp, zr = zp.float(), zr.float()
    lp = torch.log_softmax(zp / temperature, -1)
    lr = torch.log_softmax(zr / temperature, -1)
    p = lp.exp()
    kl = (p * (lp - lr)).sum(-1)
    return (kl, lp.gather(-1, tokens[:, None])[:, 0], lr.gather(-1, tokens[:, None])[:, 0],
            -(p * lp).sum(-1))


def _run(fn, t):
    """(values, gradients) of ``fn`` (leaves -> (outputs, upstream weights)) on fresh leaves
    of ``t``: the outputs and the gradients of Σ weight·output, in float64 (None where a leaf
    gets none)."""
    leaves = [x.detach().clone().requires_grad_() for x in t]
    outs, weights = fn(leaves)
    loss = sum((o.double() * w).sum() for o, w in zip(outs, weights))
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    return [o.detach().double() for o in outs], [None if g is None else g.double() for g in grads]


def _compare(fused, plain, exact, label):
    """Assert every fused error ≤ 2 × the plain error + the floor (values, then gradients)."""
    (fv, fg), (pv, pg), (ev, eg) = fused, plain, exact
    for i, (a, b, e) in enumerate(zip(fv, pv, ev)):
        err_f, err_p = (a - e).abs().max().item(), (b - e).abs().max().item()
        floor = VALUE_FLOOR * max(1.0, e.abs().max().item())
        assert err_f <= 2 * err_p + floor, f"{label}: value {i}: fused {err_f:.3g}, plain {err_p:.3g}"
    for i, (a, b, e) in enumerate(zip(fg, pg, eg)):
        if e is None:
            continue
        assert a is not None, f"{label}: gradient {i} missing"
        err_f, err_p = (a - e).abs().max().item(), (b - e).abs().max().item()
        floor = GRAD_FLOOR * e.abs().max().item()
        assert err_f <= 2 * err_p + floor, f"{label}: grad {i}: fused {err_f:.3g}, plain {err_p:.3g}"


def _search(seed, dtype, fused_fn, plain_fn):
    for trial, (n, h, vocab, scale, cap, temp) in enumerate(_cases(seed)):
        t = _heads(n, h, vocab, dtype, seed * 100 + trial)
        g = torch.Generator().manual_seed(trial)
        tokens = torch.randint(0, vocab, (n,), generator=g)
        weights = [torch.randn(n, generator=g, dtype=torch.float64) for _ in range(4)]
        args = (scale, cap, temp, tokens, weights)
        label = f"{dtype} N={n} H={h} V={vocab} scale={scale} cap={cap} T={temp}"
        _compare(
            _run(lambda x: fused_fn(x, *args), t),
            _run(lambda x: plain_fn(x, *args, None), t),
            _run(lambda x: plain_fn(x, *args, torch.float64), t),
            label,
        )


@pytest.mark.parametrize("backend", ["streaming", "native"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_linear_kl_within_twice_the_plain_error(dtype, backend):
    def fused(x, scale, cap, temp, tokens, weights):
        out = linear_kl(x[0], x[1], x[3], x[4], policy_bias=x[2], ref_bias=x[5], tokens=tokens,
                        entropy=True, logit_scale=scale, softcap=cap, temperature=temp,
                        backend=backend, chunk_rows=16)
        return tuple(out), weights

    def plain(x, scale, cap, temp, tokens, weights, math_dtype):
        if math_dtype is not None:
            x = [y.to(math_dtype) for y in x]
        return _plain(x, scale, cap, temp, tokens, math_dtype), weights

    _search(1, dtype, fused, plain)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_linear_policy_loss_within_twice_the_plain_error(dtype):
    beta = 0.3

    def fused(x, scale, cap, temp, tokens, weights):
        adv = weights[0].to(torch.float32)
        out = linear_policy_loss(x[0], x[1], x[3].detach(), x[4].detach(), tokens, beta=beta,
                                 advantages=adv, policy_bias=x[2], ref_bias=x[5].detach(),
                                 reduction="sum", logit_scale=scale, softcap=cap,
                                 temperature=temp, chunk_rows=16)
        return (out.loss.reshape(1), out.kl, out.logprobs), (1.0, 0.0, 0.0)

    def plain(x, scale, cap, temp, tokens, weights, math_dtype):
        if math_dtype is not None:
            x = [y.to(math_dtype) for y in x]
        ref = [y.detach() for y in x[3:]]
        kl, lp, _, _ = _plain([*x[:3], *ref], scale, cap, temp, tokens, math_dtype)
        adv = weights[0].to(lp.dtype)
        ratio = torch.exp(lp - lp.detach())  # on-policy: 1, its gradient that of lp
        loss = (-adv * ratio).sum() + beta * kl.sum()
        return (loss.reshape(1), kl, lp), (1.0, 0.0, 0.0)

    _search(2, dtype, fused, plain)


@pytest.mark.parametrize("kind", ["reverse_kl", "forward_kl"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_linear_divergence_within_twice_the_plain_error(dtype, kind):
    def fused(x, scale, cap, temp, tokens, weights):
        out = klpenalty.linear_divergence(x[0], x[1], x[3].detach(), x[4].detach(), kind,
                                          student_bias=x[2], teacher_bias=x[5].detach(),
                                          logit_scale=scale, softcap=cap, temperature=temp,
                                          chunk_rows=16)
        return (out,), weights[:1]

    def plain(x, scale, cap, temp, tokens, weights, math_dtype):
        if math_dtype is not None:
            x = [y.to(math_dtype) for y in x]
        zs = transformed(x[0], x[1], x[2], scale, cap)
        zt = transformed(*(y.detach() for y in x[3:]), scale, cap)
        if math_dtype is None:
            zs, zt = zs.float(), zt.float()
        ls, lt = torch.log_softmax(zs / temp, -1), torch.log_softmax(zt / temp, -1)
        out = ((ls.exp() * (ls - lt)) if kind == "reverse_kl" else (lt.exp() * (lt - ls))).sum(-1)
        return (out,), weights[:1]

    _search(3, dtype, fused, plain)
