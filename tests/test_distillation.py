"""klpenalty.divergence: every kind, on every CPU backend and dtype, against the float64
reference (ops/reference.divergence_reference), with the tolerance table of tests/tolerances.py;
the directions pinned by a bimodal teacher; masks, −inf entries, the teacher as a constant,
double backward, torch.compile and the argument errors."""

from __future__ import annotations

import math

import pytest
import torch

import klpenalty
from klpenalty.ops import dispatch
from klpenalty.ops.reference import divergence_reference, kept_set_reference
from tests.helpers import grad_tol, make_logits, tol

KINDS = klpenalty.DIVERGENCES
BACKENDS = dispatch.device_backends(torch.device("cpu"))
DTYPES = [torch.float32, torch.bfloat16, torch.float64]
PARAMS = dict(beta=0.3, skew=0.2)


def _pair(dtype, seed=3, shape=(2, 5, 61)):
    x, y = make_logits(shape, dtype, seed=seed)
    x, y = x.clone(), y.clone()
    x[0, 1, 7] = -math.inf  # a student token without mass
    y[1, 2, 9] = -math.inf  # a teacher token without mass
    x[1, 3, :5] = -math.inf
    y[1, 3, :5] = -math.inf  # neither has mass there
    return x, y


def _reference(x, y, kind, temperature):
    return divergence_reference(x, y, kind, PARAMS["beta"], PARAMS["skew"], temperature)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
def test_values_and_gradients_match_float64(kind, backend, dtype):
    x, y = _pair(dtype)
    xs = x.clone().requires_grad_(True)
    got = klpenalty.divergence(xs, y, kind, temperature=0.8, backend=backend, **PARAMS)
    assert got.shape == x.shape[:-1]
    assert got.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    want = _reference(x, y, kind, 0.8)
    torch.testing.assert_close(got.double(), want, **tol(dtype))
    # gradients where the value is finite (a KL of +inf has no gradient to compare), by
    # autograd of the reference on −inf replaced by −500: e^(−500/T) ~ 1e-272 is a mass far
    # below float64's resolution of the other terms, yet positive, so autograd meets no
    # 0·(−inf) (which would make the whole row's gradient NaN)
    w = torch.randn(got.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    w = torch.where(torch.isfinite(want), w, 0.0)
    xr = x.double().clamp_min(-500.0).requires_grad_(True)
    (g,) = torch.autograd.grad((got.double() * w).sum(), xs)
    (g_ref,) = torch.autograd.grad((_reference(xr, y.double().clamp_min(-500.0), kind, 0.8) * w).sum(), xr)
    assert g.dtype == dtype
    torch.testing.assert_close(g.double(), g_ref.nan_to_num(0.0), **grad_tol(dtype))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
def test_logits_far_below_the_other_models(kind, backend):
    # a student logit 95 and 300 nats below the teacher's (and the reverse): in float32 e^δ of
    # the mixtures' log-ratio overflows there; the second row holds a −inf, which sends a kernel
    # to its careful path
    x = torch.tensor([[0.0, -95.0, -200.0, 3.0], [0.0, -300.0, 5.0, -math.inf]])
    y = torch.tensor([[0.0, 0.0, 0.0, -120.0], [0.0, 0.0, -1.0, 0.0]])
    xs = x.clone().requires_grad_(True)
    got = klpenalty.divergence(xs, y, kind, backend=backend, **PARAMS)
    want = _reference(x.double(), y.double(), kind, 1.0)
    torch.testing.assert_close(got.double(), want, **tol(torch.float32))
    (g,) = torch.autograd.grad(got.sum(), xs)
    xr = x.double().clamp_min(-500.0).requires_grad_(True)
    (g_ref,) = torch.autograd.grad(_reference(xr, y.double(), kind, 1.0).sum(), xr)
    torch.testing.assert_close(g.double(), g_ref, **grad_tol(torch.float32))


def test_the_infinite_kls_are_where_mass_meets_none():
    x, y = _pair(torch.float64)
    rev = klpenalty.divergence(x, y, "reverse_kl")
    fwd = klpenalty.divergence(x, y, "forward_kl")
    assert torch.isposinf(rev[1, 2]) and torch.isfinite(rev[0, 1])  # π > 0 where ν = 0
    assert torch.isposinf(fwd[0, 1]) and torch.isfinite(fwd[1, 2])  # ν > 0 where π = 0
    for kind in ("jsd", "skew_forward_kl", "skew_reverse_kl", "tvd"):
        assert torch.isfinite(klpenalty.divergence(x, y, kind)).all(), kind


def _fit_gaussian(kind: str, teacher: torch.Tensor, grid: torch.Tensor, mu0: float):
    """A unimodal student, logits −(g − μ)²/(2σ²) on the grid, fitted to the teacher by
    gradient descent through klpenalty.divergence: (μ, σ², the student's probabilities)."""
    mu = torch.tensor(mu0, dtype=torch.float64, requires_grad=True)
    log_var = torch.tensor(0.0, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.Adam([mu, log_var], lr=0.05)
    for _ in range(1500):
        opt.zero_grad()
        student = -0.5 * (grid - mu) ** 2 / log_var.exp()
        klpenalty.divergence(student, teacher, kind).backward()
        opt.step()
    student = torch.softmax(-0.5 * (grid - mu) ** 2 / log_var.exp(), -1).detach()
    return mu.item(), log_var.exp().item(), student


def test_the_directions_by_effect_on_a_bimodal_teacher():
    # ν: modes at ±4 of variance 1 (mean 0, variance 17). Fitting a Gaussian student: the
    # forward KL (teacher‖student) matches the moments and covers both modes; the reverse KL
    # (student‖teacher) picks the mode it starts nearer to. On the grid the student's family is
    # exponential with statistics (g, g²), so the forward KL's optimum matches the teacher's
    # first two moments on the grid.
    grid = torch.linspace(-10, 10, 401, dtype=torch.float64)
    teacher = torch.logaddexp(-0.5 * (grid + 4) ** 2, -0.5 * (grid - 4) ** 2)
    nu = torch.softmax(teacher, -1)
    mu, _, pi = _fit_gaussian("forward_kl", teacher, grid, mu0=1.0)
    for k in (1, 2):  # E[g], E[g²] (16.9 here)
        assert abs((pi * grid**k).sum() - (nu * grid**k).sum()) < 0.05, (k, mu)
    mu, var, _ = _fit_gaussian("reverse_kl", teacher, grid, mu0=1.0)
    assert abs(mu - 4.0) < 0.05 and abs(var - 1.0) < 0.05, (mu, var)


def test_identities_between_kinds():
    x, y = make_logits((4, 50), torch.float64, seed=5)
    jsd = klpenalty.divergence(x, y, "jsd", beta=0.5)
    torch.testing.assert_close(jsd, klpenalty.divergence(y, x, "jsd", beta=0.5))  # symmetric
    assert (jsd <= math.log(2) + 1e-12).all() and (jsd >= 0).all()
    tvd = klpenalty.divergence(x, y, "tvd")
    assert (tvd <= 1).all() and (tvd >= 0).all()
    # the skew KLs tend to the plain KLs as λ → 0, and both JSD limits to a weighted KL
    for skew_kind, kl_kind in (("skew_forward_kl", "forward_kl"), ("skew_reverse_kl", "reverse_kl")):
        small = klpenalty.divergence(x, y, skew_kind, skew=1e-9)
        torch.testing.assert_close(small, klpenalty.divergence(x, y, kl_kind), atol=1e-6, rtol=1e-6)
    # the forward KL is the reverse KL with the arguments swapped, and full_kl(teacher, student)
    torch.testing.assert_close(klpenalty.divergence(x, y, "forward_kl"),
                               klpenalty.divergence(y, x, "reverse_kl"))
    torch.testing.assert_close(klpenalty.divergence(x, y, "forward_kl"), klpenalty.full_kl(y, x))
    # identical logits: every kind is exactly 0
    for kind in KINDS:
        assert torch.equal(klpenalty.divergence(x, x, kind), torch.zeros(4, dtype=torch.float64))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
def test_masked_positions_are_zero_with_zero_gradient(kind, backend):
    x, y = make_logits((3, 4, 29), torch.float32, seed=2)
    mask = torch.tensor([[True, False, True, True]] * 3)
    x, y = x.clone(), y.clone()
    x[:, 1] = float("nan")  # a masked position may hold anything
    y[:, 1] = -math.inf
    xs = x.requires_grad_(True)
    got = klpenalty.divergence(xs, y, kind, mask=mask, backend=backend)
    assert torch.equal(got[:, 1], torch.zeros(3))
    got.sum().backward()
    assert torch.equal(xs.grad[:, 1], torch.zeros(3, 29))
    assert torch.isfinite(xs.grad).all()


def test_the_jsd_gradient_is_the_reverse_kl_form_with_the_mixture_held():
    # ∂JSD_β/∂x = (1−β)·∂KL(π‖M)/∂x with M a constant: the same gradient as (1−β)·reverse KL
    # against the fixed mixture's logits
    x, y = make_logits((3, 40), torch.float64, seed=9)
    beta = 0.3
    xs = x.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(klpenalty.divergence(xs, y, "jsd", beta=beta).sum(), xs)
    mix = torch.log(beta * torch.softmax(y, -1) + (1 - beta) * torch.softmax(x, -1))
    xr = x.clone().requires_grad_(True)
    (g_rev,) = torch.autograd.grad(klpenalty.divergence(xr, mix, "reverse_kl").sum(), xr)
    torch.testing.assert_close(g, (1 - beta) * g_rev, **grad_tol(torch.float64))


@pytest.mark.parametrize("kind", KINDS)
def test_the_teacher_is_a_constant(kind):
    x, y = make_logits((3, 17), torch.float32, seed=4)
    xs, ys = x.requires_grad_(True), y.requires_grad_(True)
    klpenalty.divergence(xs, ys, kind).sum().backward()
    assert ys.grad is None and xs.grad is not None


@pytest.mark.parametrize("kind", KINDS)
def test_twice_differentiable(kind):
    x, y = make_logits((2, 7), torch.float64, seed=6)
    xs = x.requires_grad_(True)
    fn = lambda t: klpenalty.divergence(t, y, kind, temperature=1.3, **PARAMS)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (xs,))
    assert torch.autograd.gradgradcheck(fn, (xs,))


def test_fullgraph_traceable():
    x, y = make_logits((2, 3, 33), torch.float32, seed=7)
    fn = torch.compile(
        lambda a, b: klpenalty.divergence(a, b, "jsd", backend="streaming"), fullgraph=True
    )
    torch.testing.assert_close(fn(x, y), klpenalty.divergence(x, y, "jsd", backend="streaming"))


def test_nan_logits_raise_with_check():
    x, y = make_logits((2, 9), torch.float32, seed=8)
    y = y.clone()
    y[1, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        klpenalty.divergence(x, y, "forward_kl")
    assert torch.isnan(klpenalty.divergence(x, y, "forward_kl", check=False)[1])


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(kind="kl"), ValueError, "kind must be one of"),
        (dict(kind="jsd", beta=1.0), ValueError, "beta must lie in"),
        (dict(kind="skew_forward_kl", skew=0.0), ValueError, "skew must lie in"),
        (dict(temperature=0.0), ValueError, "temperature"),
        (dict(mask=torch.ones(3, dtype=torch.bool)), ValueError, "mask"),
    ],
)
def test_bad_arguments_name_themselves(kwargs, error, match):
    x, y = make_logits((2, 9), torch.float32)
    with pytest.raises(error, match=match):
        klpenalty.divergence(x, y, **kwargs)


def test_mismatched_logits_name_both():
    x, _ = make_logits((2, 9), torch.float32)
    with pytest.raises(ValueError, match="student_logits and teacher_logits must have the same"):
        klpenalty.divergence(x, x[:, :8])
    with pytest.raises(TypeError, match="teacher_logits must be a floating-point"):
        klpenalty.divergence(x, torch.zeros(2, 9, dtype=torch.long))


# ---------------------------------------------------------------- the student's sampler support
SAMPLERS = {
    "top_k": dict(top_k=7),
    "top_p": dict(top_p=0.8),
    "min_p": dict(min_p=0.05),
    "top_k_top_p": dict(top_k=20, top_p=0.9),
    "support": None,  # a bool kept set (not a threshold set: a few of the largest dropped)
}


def _support_case(name, x, temperature):
    """(the public arguments, the kept set (..., V) bool) of a sampler case for student x."""
    if SAMPLERS[name] is not None:
        kwargs = SAMPLERS[name]
        return kwargs, kept_set_reference(x, temperature=temperature, **kwargs)
    g = torch.Generator().manual_seed(11)
    kept = torch.rand(x.shape, generator=g) < 0.4
    kept[..., 0] = True  # every row keeps something
    return dict(support=kept), kept


@pytest.mark.parametrize("sampler", list(SAMPLERS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
def test_truncated_student_matches_float64(kind, backend, dtype, sampler):
    x, y = make_logits((2, 3, 61), dtype, seed=12)
    temperature = 0.8
    kwargs, kept = _support_case(sampler, x, temperature)
    xs = x.clone().requires_grad_(True)
    got = klpenalty.divergence(xs, y, kind, temperature=temperature, backend=backend, **PARAMS,
                               **kwargs)
    want = divergence_reference(x, y, kind, PARAMS["beta"], PARAMS["skew"], temperature,
                                support=kept)
    torch.testing.assert_close(got.double(), want, **tol(dtype))
    # the gradient of the finite part (KL(ν‖π̃) is +inf where the teacher has mass off the
    # support; its gradient is that of the kept terms), 0 off the support
    w = torch.randn(got.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    xr = x.double().requires_grad_(True)
    (g,) = torch.autograd.grad((got.double() * w).sum(), xs)
    ref = divergence_reference(xr, y, kind, PARAMS["beta"], PARAMS["skew"], temperature,
                               support=kept)
    (g_ref,) = torch.autograd.grad((ref * w).sum(), xr)
    assert torch.isfinite(g).all() and torch.equal(g[~kept], torch.zeros_like(g[~kept]))
    torch.testing.assert_close(g.double(), g_ref, **grad_tol(dtype))


@pytest.mark.parametrize("backend", BACKENDS)
def test_truncated_edges(backend):
    x, y = make_logits((3, 61), torch.float32, seed=13)
    rev = klpenalty.divergence(x, y, "reverse_kl", top_k=5, backend=backend)
    # the reverse KL is the KL column of the truncated policy, the same τ as full_kl's
    torch.testing.assert_close(rev, klpenalty.full_kl(x, y, top_k=5, backend=backend))
    # the teacher has mass off the support: KL(ν‖π̃) = +inf; the mixtures and the TVD finite
    assert torch.isposinf(klpenalty.divergence(x, y, "forward_kl", top_k=5, backend=backend)).all()
    for kind in ("jsd", "skew_forward_kl", "skew_reverse_kl", "tvd"):
        assert torch.isfinite(klpenalty.divergence(x, y, kind, top_k=5, backend=backend)).all()
    # a support that cuts nothing is the untruncated student; a teacher without mass off the
    # support gives a finite forward KL
    for kind in KINDS:
        torch.testing.assert_close(
            klpenalty.divergence(x, y, kind, top_k=61, top_p=1.0, backend=backend),
            klpenalty.divergence(x, y, kind, backend=backend),
        )
    kept = kept_set_reference(x, top_k=5)
    y_on = torch.where(kept, y, -math.inf)
    fwd = klpenalty.divergence(x, y_on, "forward_kl", top_k=5, backend=backend)
    torch.testing.assert_close(
        fwd.double(), divergence_reference(x, y_on, "forward_kl", support=kept),
        **tol(torch.float32),
    )


@pytest.mark.parametrize("kind", KINDS)
def test_truncated_engine_ids_and_double_backward(kind):
    # an engine's kept set (ids, offsets) is the threshold set of top_k: the same values;
    # the double backward recomputes on the support
    x, y = make_logits((2, 13), torch.float64, seed=14)
    kept = kept_set_reference(x, top_k=4)
    ids = kept.nonzero()[:, 1]
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), kept.sum(-1).cumsum(0)])
    by_ids = klpenalty.divergence(x, y, kind, support=(ids, offsets), **PARAMS)
    torch.testing.assert_close(by_ids, klpenalty.divergence(x, y, kind, top_k=4, **PARAMS))
    xs = x.clone().requires_grad_(True)
    got = klpenalty.divergence(xs, y, kind, temperature=1.3, support=kept, **PARAMS)
    (g,) = torch.autograd.grad(got.sum(), xs, create_graph=True)
    (g_ref,) = torch.autograd.grad(
        divergence_reference(xs, y, kind, PARAMS["beta"], PARAMS["skew"], 1.3, support=kept).sum(),
        xs, create_graph=True,
    )
    torch.testing.assert_close(g, g_ref, **grad_tol(torch.float64))
    v = torch.randn(x.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    (h,) = torch.autograd.grad((g * v).sum(), xs)
    (h_ref,) = torch.autograd.grad((g_ref * v).sum(), xs)
    torch.testing.assert_close(h, h_ref, **grad_tol(torch.float64))


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(top_k=0), ValueError, "top_k"),
        (dict(top_p=0.0), ValueError, "top_p"),
        (dict(min_p=1.5), ValueError, "min_p"),
        (dict(top_k=3, support=torch.ones(2, 9, dtype=torch.bool)), ValueError, "both given"),
        (dict(support=torch.ones(2, 8, dtype=torch.bool)), ValueError, "support must have"),
    ],
)
def test_bad_sampler_arguments_name_themselves(kwargs, error, match):
    x, y = make_logits((2, 9), torch.float32)
    with pytest.raises(error, match=match):
        klpenalty.divergence(x, y, "jsd", **kwargs)
