"""klpenalty.linear_divergence against the float64 reference on the logits the fused path sees.

As in tests/test_linear.py: the fast path computes each chunk's logits with ``F.linear`` in the
input dtype; the reference is evaluated on those same logits (upcast exactly) while its
derivatives flow through a float64 graph (the straight-through ``z64 + (z − z64).detach()``), so
the value error is the engine's alone (the tolerance table's entry for the input dtype) and the
gradient error the engine's ∂/∂z rounded to the input dtype plus the chain rule's GEMMs in that
dtype (the table's gradient entry, relative to the largest entry).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import klpenalty
from klpenalty.ops import dispatch
from klpenalty.ops.reference import divergence_reference
from tests.helpers import GRAD_REL_TOL, fused_logits, tol

BACKENDS = dispatch.device_backends(torch.device("cpu"))
LEADING, HS, HT, V = (3, 5), 12, 20, 67  # the teacher wider than the student


def heads(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s, scale=1.0: (torch.randn(*s, generator=g, dtype=torch.float64) * scale).to(dtype)  # noqa: E731
    return dict(hs=r(*LEADING, HS), ws=r(V, HS, scale=0.6), bs=r(V, scale=0.5),
                ht=r(*LEADING, HT), wt=r(V, HT, scale=0.5), bt=r(V, scale=0.5))


def logits(h, w, b, cap, same_dtype):
    """scale 1, soft-capped logits; in float64 with the input-dtype values substituted."""
    z64 = fused_logits(h.double(), w.double(), b.double(), 1.0, cap)
    if same_dtype is not None:
        z64 = z64 + (fused_logits(h.detach(), w.detach(), b.detach(), 1.0, cap).double()
                     - z64).detach()
    return z64


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", klpenalty.DIVERGENCES)
def test_values_and_student_gradients_match_float64(kind, backend, dtype):
    t = heads(dtype)
    mask = torch.ones(LEADING, dtype=torch.bool)
    mask[1, 2] = mask[2, 0] = False
    t["hs"][1, 2] = float("nan")  # masked rows hold garbage, never multiplied
    student = [t[k].clone().requires_grad_(True) for k in ("hs", "ws", "bs")]
    got = klpenalty.linear_divergence(
        student[0], student[1], t["ht"], t["wt"], kind, student_bias=student[2],
        teacher_bias=t["bt"], softcap=6.0, temperature=0.8, mask=mask, chunk_rows=4,
        backend=backend, beta=0.3, skew=0.2,
    )
    assert got.shape == LEADING and torch.all(got[~mask] == 0)
    leaves = [t[k].detach().double().masked_fill(~mask.unsqueeze(-1), 0.0).requires_grad_(True)
              if k == "hs" else t[k].detach().double().requires_grad_(True)
              for k in ("hs", "ws", "bs")]
    same = None if dtype == torch.float64 else dtype
    hs_in = t["hs"].masked_fill(~mask.unsqueeze(-1), 0.0)
    zs = logits(leaves[0], leaves[1], leaves[2], 6.0, same)
    if same is not None:  # the student's input-dtype logits, as the fused path computes them
        z_in = fused_logits(hs_in, t["ws"], t["bs"], 1.0, 6.0)
        zs = zs + (z_in.double() - zs).detach()
    zt = logits(t["ht"], t["wt"], t["bt"], 6.0, same)
    want = torch.where(mask, divergence_reference(zs, zt, kind, 0.3, 0.2, 0.8), 0.0)
    torch.testing.assert_close(got.double(), want.detach(), **tol(dtype))
    w = torch.linspace(-1.0, 2.0, got.numel(), dtype=torch.float64).reshape(LEADING)
    grads = torch.autograd.grad((got.double() * w).sum(), student)
    wants = torch.autograd.grad((want * w).sum(), leaves)
    rel = GRAD_REL_TOL[dtype]
    for g, gw in zip(grads, wants):
        assert g.dtype == dtype and torch.isfinite(g).all()
        scale = gw.abs().max().item()
        torch.testing.assert_close(g.double(), gw, rtol=rel, atol=rel * scale)


def test_the_teacher_gets_no_gradient_and_its_hidden_size_is_free():
    t = heads(torch.float32, seed=1)
    ht, wt = t["ht"].requires_grad_(True), t["wt"].requires_grad_(True)
    hs = t["hs"].requires_grad_(True)
    klpenalty.linear_divergence(hs, t["ws"], ht, wt, "forward_kl").sum().backward()
    assert ht.grad is None and wt.grad is None and hs.grad is not None


def test_errors_name_the_student_and_the_teacher():
    t = heads(torch.float32)
    with pytest.raises(ValueError, match="teacher_weight must have shape"):
        klpenalty.linear_divergence(t["hs"], t["ws"], t["ht"], t["wt"][:, :5])
    with pytest.raises(ValueError, match="student_weight and teacher_weight must have the same vocabulary"):
        klpenalty.linear_divergence(t["hs"], t["ws"], t["ht"], t["wt"][:9])
    with pytest.raises(ValueError, match="kind must be one of"):
        klpenalty.linear_divergence(t["hs"], t["ws"], t["ht"], t["wt"], "kl")


@pytest.mark.parametrize("kind", ["reverse_kl", "jsd", "forward_kl"])
def test_expected_grads_form_the_student_gradients_in_the_forward(monkeypatch, kind):
    """With the plan of the loss's upstream gradients the backward multiplies no head and the
    gradients equal the recomputing path's; a plan that does not arrive is recomputed."""
    from klpenalty.linear import kl as kl_module

    t = heads(torch.float32, seed=4)
    w = torch.linspace(-1.0, 2.0, 15).reshape(LEADING)
    opts = dict(student_bias=None, chunk_rows=4, beta=0.3)
    student = [t[k].clone().requires_grad_(True) for k in ("hs", "ws")]
    plain = klpenalty.linear_divergence(student[0], student[1], t["ht"], t["wt"], kind, **opts)
    want = torch.autograd.grad((plain * w).sum(), student)

    calls = []
    original = kl_module._logits
    monkeypatch.setattr(kl_module, "_logits", lambda h, ww, *a: calls.append(ww) or original(h, ww, *a))
    flat = w.reshape(-1)
    for plan_w, recomputed in ((flat, False), (flat * (1 + 1e-3), True)):
        calls.clear()
        got = klpenalty.linear_divergence(student[0], student[1], t["ht"], t["wt"], kind,
                                          expected_grads=lambda rows, values: plan_w[rows], **opts)
        assert torch.equal(got, plain)
        grads = torch.autograd.grad((got * w).sum(), student)
        assert len(calls) == 2 * 4 * (2 if recomputed else 1)  # 4 chunks of both heads
        for g, gw in zip(grads, want):
            torch.testing.assert_close(g, gw, rtol=GRAD_REL_TOL[torch.float32],
                                       atol=GRAD_REL_TOL[torch.float32] * float(gw.abs().max()))


def test_expected_grads_must_return_one_gradient_per_row():
    t = heads(torch.float32)
    hs = t["hs"].clone().requires_grad_(True)
    with pytest.raises(TypeError, match="expected_grads must be callable"):
        klpenalty.linear_divergence(hs, t["ws"], t["ht"], t["wt"], expected_grads=1.0)
    with pytest.raises(ValueError, match=r"expected_grads\(rows, values\) must return .* shape \(4,\)"):
        klpenalty.linear_divergence(hs, t["ws"], t["ht"], t["wt"], chunk_rows=4,
                                    expected_grads=lambda rows, values: torch.ones(3))


LINEAR_SUPPORTS = ["top_k", "top_p_min_p", "mask", "ids"]


@pytest.mark.parametrize("support", LINEAR_SUPPORTS)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", klpenalty.DIVERGENCES)
def test_the_student_on_a_support_is_divergence_on_the_logits(kind, backend, support):
    """The sampler's settings or a kept set (a bool mask, an engine's (ids, offsets)) applied
    to the student chunk by chunk: klpenalty.divergence on the materialised logits, values and
    every student gradient, in float64 (the same support whatever the GEMM's blocking)."""
    t = heads(torch.float64, seed=2)
    mask = torch.ones(LEADING, dtype=torch.bool)
    mask[0, 3] = False
    zs0 = F.linear(t["hs"], t["ws"], t["bs"])
    kwargs = dict(top_k=9) if support == "top_k" else dict(top_p=0.9, min_p=0.02)
    if support in ("mask", "ids"):
        g = torch.Generator().manual_seed(4)
        kept = torch.rand(zs0.shape, generator=g) < 0.5
        kept[..., 3] = True
        if support == "mask":
            kwargs = dict(support=kept)
        else:
            counts = kept.sum(-1).reshape(-1)
            offsets = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])
            kwargs = dict(support=(kept.reshape(-1, V).nonzero()[:, 1], offsets))
    student = [t[k].clone().requires_grad_(True) for k in ("hs", "ws", "bs")]
    got = klpenalty.linear_divergence(
        student[0], student[1], t["ht"], t["wt"], kind, student_bias=student[2],
        teacher_bias=t["bt"], temperature=0.8, mask=mask, chunk_rows=4, backend=backend,
        beta=0.3, skew=0.2, **kwargs,
    )
    leaves = [t[k].clone().requires_grad_(True) for k in ("hs", "ws", "bs")]
    zs = F.linear(*leaves)
    zt = F.linear(t["ht"], t["wt"], t["bt"])
    want = klpenalty.divergence(zs, zt, kind, mask=mask, temperature=0.8, beta=0.3, skew=0.2,
                                backend=backend, **kwargs)
    torch.testing.assert_close(got, want.detach(), **tol(torch.float64))
    w = torch.linspace(-1.0, 2.0, got.numel(), dtype=torch.float64).reshape(LEADING)
    grads = torch.autograd.grad((got * w).sum(), student)
    wants = torch.autograd.grad((want * w).sum(), leaves)
    for g, gw in zip(grads, wants):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g, gw, **tol(torch.float64))
    if kind == "forward_kl":  # the teacher has mass off the support
        assert torch.isposinf(got[mask]).all()
