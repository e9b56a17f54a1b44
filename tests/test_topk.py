"""klpenalty.topk: divergences against a teacher given by its top-K log-probs.

Every kind against its formula evaluated in float64 on the same input values (the student's
log-probs there from a full float64 log-softmax), the identities that relate the kinds to the
full teacher's KL, the renormalised kind's independence of the logits outside the K ids,
masking, −inf padding and bad inputs.
"""

from __future__ import annotations

import math

import pytest
import torch

from klpenalty import TopKMass, topk_divergence, topk_mass
from klpenalty.topk import KINDS

from .helpers import DTYPES, grad_tol, patch_torch, tol

FORWARD = ("renormalized_forward_kl", "tail_forward_kl", "unnormalized_forward_kl")


def problem(shape=(3, 5), vocab=64, k=8, dtype=torch.float32, temperature=1.0, seed=0):
    """(x, ids, lt, teacher): student logits in ``dtype``; the teacher's top-``k`` ids and
    log-probs (float32, float64 for a float64 student) of its full float64 log-softmax at
    ``temperature``, given as ``teacher`` (..., V). Distinct random logits: no ties."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randn(*shape, vocab, generator=g, dtype=torch.float64) * 3
    x = y + torch.randn(*shape, vocab, generator=g, dtype=torch.float64) * 2
    teacher = torch.log_softmax(y / temperature, -1)
    lt, ids = teacher.topk(k, -1)
    lt = lt.to(torch.float64 if dtype == torch.float64 else torch.float32)
    return x.to(dtype), ids, lt, teacher


def masses(x64, ids, lt64, temperature=1.0):
    """log π at the ids (π over the full vocabulary), ν, S_ν, S_π, ν̃, π̃, all float64."""
    lp = torch.log_softmax(x64 / temperature, -1).gather(-1, ids)
    nu, pi = lt64.exp(), lp.exp()
    s_nu, s_pi = nu.sum(-1), pi.sum(-1)
    return lp, nu, pi, s_nu, s_pi, nu / s_nu[..., None], pi / s_pi[..., None]


def reference(kind, x64, ids, lt64, temperature=1.0):
    """The kind's formula in float64, from a full log-softmax of the student."""
    lp, nu, pi, s_nu, s_pi, nut, pit = masses(x64, ids, lt64, temperature)
    if kind == "renormalized_forward_kl":
        return (nut * (nut.log() - pit.log())).sum(-1)
    if kind == "renormalized_cross_entropy":
        return -(nut * lp).sum(-1)
    if kind == "tail_forward_kl":
        nu_tail, pi_tail = 1 - s_nu, 1 - s_pi
        tail = torch.special.xlogy(nu_tail, nu_tail) - nu_tail * pi_tail.log()
        return (nu * (lt64 - lp)).sum(-1) + tail
    if kind == "generalized_kl":
        return (pi * (lp - lt64) - pi + nu).sum(-1)
    assert kind == "unnormalized_forward_kl"
    return (nu * (lt64 - lp)).sum(-1)


def kl(p_log, q_log):
    """KL(p‖q) over the last dim from log-probs, float64, 0·log 0 = 0."""
    return torch.where(p_log > -math.inf, p_log.exp() * (p_log - q_log), 0.0).sum(-1)


def renormalized(logp, keep):
    """log of the distribution restricted to ``keep`` (bool, last dim) and renormalised."""
    logp = logp.masked_fill(~keep, -math.inf)
    return logp - torch.logsumexp(logp, -1, keepdim=True)


# ---- 1. each kind equals its float64 formula: values and gradients ---------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_matches_float64_formula(kind, dtype):
    temperature = 0.7
    x, ids, lt, _ = problem(dtype=dtype, temperature=temperature)
    x.requires_grad_()
    out = topk_divergence(x, ids, lt, kind, temperature=temperature)
    assert out.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    x64 = x.detach().double().requires_grad_()
    ref = reference(kind, x64, ids, lt.double(), temperature)
    torch.testing.assert_close(out.double(), ref.detach(), **tol(dtype))

    w = torch.rand(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    (out * w.to(out.dtype)).sum().backward()
    (ref * w).sum().backward()
    assert x.grad.dtype == dtype
    torch.testing.assert_close(x.grad.double(), x64.grad, **grad_tol(dtype))


@pytest.mark.parametrize("kind", KINDS)
def test_float32_error_within_twice_plain_pytorch(kind):
    """Against the float64 formula, the error is at most twice that of the same formula in
    plain float32 PyTorch (a float32 log-softmax over the vocabulary)."""
    x, ids, lt, _ = problem(shape=(16, 8), vocab=100, k=12, seed=3)
    ref = reference(kind, x.double(), ids, lt.double())
    plain = reference(kind, x, ids, lt)  # the same formula, float32 throughout
    ours = topk_divergence(x, ids, lt, kind)
    err, err_plain = (ours.double() - ref).abs().max(), (plain.double() - ref).abs().max()
    assert err <= 2 * err_plain + 1e-7, (err, err_plain)


def test_topk_mass_matches_float64():
    x, ids, lt, _ = problem(temperature=1.3, seed=4)
    x.requires_grad_()
    m = topk_mass(x, ids, lt, temperature=1.3)
    assert isinstance(m, TopKMass)
    lp, nu, pi, s_nu, s_pi, _, _ = masses(x.detach().double(), ids, lt.double(), 1.3)
    for got, want in zip(m, (s_nu, s_pi, -s_nu.log(), -s_pi.log())):
        torch.testing.assert_close(got.double(), want, **tol(torch.float32))
    m.student_mass.sum().backward()
    assert x.grad is not None and bool(x.grad.abs().sum() > 0)


# ---- 2. the biases and identities against the full teacher, float64 --------------------------


def full_problem(k, vocab=60, seed=5):
    x, ids, lt, teacher = problem(vocab=vocab, k=k, dtype=torch.float64, seed=seed)
    student = torch.log_softmax(x, -1)
    keep = torch.zeros_like(x, dtype=torch.bool).scatter_(-1, ids, True)
    return x, ids, lt, teacher, student, keep


def divergences(x, ids, lt):
    return {kind: topk_divergence(x, ids, lt, kind) for kind in KINDS}


def test_all_of_the_vocabulary_gives_the_full_divergences():
    x, ids, lt, teacher, student, _ = full_problem(k=60)
    d = divergences(x, ids, lt)
    for kind in FORWARD:
        torch.testing.assert_close(d[kind], kl(teacher, student), **tol(torch.float64))
    entropy = -(teacher.exp() * teacher).sum(-1)
    torch.testing.assert_close(d["renormalized_cross_entropy"], entropy + kl(teacher, student),
                               **tol(torch.float64))
    torch.testing.assert_close(d["generalized_kl"], kl(student, teacher), **tol(torch.float64))
    torch.testing.assert_close(topk_mass(x, ids, lt).teacher_mass, torch.ones(3, 5),
                               **tol(torch.float64), check_dtype=False)


@pytest.mark.parametrize("k", [1, 7, 30])
def test_identities_against_the_full_teacher(k):
    x, ids, lt, teacher, student, keep = full_problem(k=k)
    d = divergences(x, ids, lt)
    m = topk_mass(x, ids, lt)
    s_nu, s_pi = m.teacher_mass, m.student_mass
    nu_tail, pi_tail = 1 - s_nu, 1 - s_pi
    close = dict(**tol(torch.float64))

    # chain rule: KL(ν‖π) = tail + ν_tail·KL(ν_out‖π_out), so tail ≤ KL(ν‖π)
    out_kl = kl(renormalized(teacher, ~keep), renormalized(student, ~keep))
    torch.testing.assert_close(kl(teacher, student), d["tail_forward_kl"] + nu_tail * out_kl,
                               **close)
    assert bool((d["tail_forward_kl"] <= kl(teacher, student)).all())

    # tail = Bernoulli KL of the masses + S_ν·KL(ν̃‖π̃)
    bucket = s_nu * (s_nu / s_pi).log() + nu_tail * (nu_tail / pi_tail).log()
    torch.testing.assert_close(d["tail_forward_kl"],
                               bucket + s_nu * d["renormalized_forward_kl"], **close)
    # KL(ν̃‖π̃) from the full distributions renormalised on the K ids
    torch.testing.assert_close(d["renormalized_forward_kl"],
                               kl(renormalized(teacher, keep), renormalized(student, keep)),
                               **close)
    # cross-entropy = KL(ν̃‖π̃) + H(ν̃) − log S_π
    nut = renormalized(teacher, keep)
    h_nut = -(nut.exp() * nut.nan_to_num(neginf=0.0)).sum(-1)
    torch.testing.assert_close(d["renormalized_cross_entropy"],
                               d["renormalized_forward_kl"] + h_nut - s_pi.log(), **close)
    # unnormalised = S_ν·(KL(ν̃‖π̃) + log S_ν − log S_π)
    torch.testing.assert_close(
        d["unnormalized_forward_kl"],
        s_nu * (d["renormalized_forward_kl"] + s_nu.log() - s_pi.log()), **close)
    # generalized = S_π·KL(π̃‖ν̃) + generalized KL of the masses, and
    # = KL(π‖ν) − the generalized terms outside K (each ≥ 0), so ≤ KL(π‖ν)
    pit = renormalized(student, keep)
    mass_term = s_pi * (s_pi / s_nu).log() - s_pi + s_nu
    torch.testing.assert_close(d["generalized_kl"],
                               s_pi * kl(pit, renormalized(teacher, keep)) + mass_term, **close)
    pi, nu = student.exp(), teacher.exp()
    outside = torch.where(~keep, pi * (student - teacher) - pi + nu, 0.0).sum(-1)
    torch.testing.assert_close(d["generalized_kl"], kl(student, teacher) - outside, **close)
    assert bool((d["generalized_kl"] <= kl(student, teacher)).all())
    # −log S_ν = KL(ν̃‖ν), −log S_π = KL(π̃‖π)
    torch.testing.assert_close(m.neg_log_teacher_mass, kl(nut, teacher), **close)
    torch.testing.assert_close(m.neg_log_student_mass, kl(pit, student), **close)
    if k == 1:  # one id: both renormalise to the same point mass
        assert bool((d["renormalized_forward_kl"] == 0).all())


def test_tail_kl_is_the_full_kl_when_the_tails_conditionals_match():
    x, ids, lt, teacher, student, keep = full_problem(k=10)
    # the student's logits outside K: the teacher's plus a per-row constant
    y = teacher + torch.randn(3, 5, 1, dtype=torch.float64)
    x = torch.where(keep, x, y)
    full = kl(teacher, torch.log_softmax(x, -1))
    torch.testing.assert_close(topk_divergence(x, ids, lt, "tail_forward_kl"), full,
                               **tol(torch.float64))
    assert bool((full > topk_divergence(x, ids, lt, "renormalized_forward_kl") * 0.5).all())


def test_unnormalized_forward_kl_is_negative_for_a_student_more_sure_of_the_ids():
    """π̃ = ν̃ and S_π > S_ν: the value is S_ν·log(S_ν/S_π) < 0 (it is not a divergence)."""
    x, ids, lt, teacher, _, keep = full_problem(k=5)
    x = torch.where(keep, teacher + 2.0, teacher)
    s = topk_mass(x, ids, lt)
    got = topk_divergence(x, ids, lt, "unnormalized_forward_kl")
    torch.testing.assert_close(got, s.teacher_mass * (s.teacher_mass / s.student_mass).log(),
                               **tol(torch.float64))
    assert bool((got < 0).all())
    assert bool((topk_divergence(x, ids, lt) < 1e-12).all())  # the renormalised ones agree


# ---- 3. the renormalised kind reads no logit outside the K ids -------------------------------


def test_renormalized_reads_only_the_gathered_logits():
    x, ids, lt, _ = problem(vocab=100, k=10, temperature=0.8)
    keep = torch.zeros_like(x, dtype=torch.bool).scatter_(-1, ids, True)
    x.requires_grad_()
    out = topk_divergence(x, ids, lt, temperature=0.8)
    out.sum().backward()
    assert bool((x.grad[~keep] == 0).all())
    for fill in (1e4, -1e4, math.inf, math.nan):
        other = torch.where(keep, x.detach(), torch.tensor(fill))
        assert torch.equal(topk_divergence(other, ids, lt, temperature=0.8), out.detach())
    # bit-identical to the plain formulation: log_softmax over K of x[K]/T
    lq = torch.log_softmax(x.detach().gather(-1, ids).float() / 0.8, -1)
    lnu = torch.log_softmax(lt, -1)
    assert torch.equal(out.detach(), (lnu.exp() * (lnu - lq)).sum(-1))


def test_full_vocabulary_kinds_use_the_streamed_log_sum_exp(monkeypatch):
    """The student's lse over V comes from token_logprobs (once a call), never a (..., V)
    log-softmax: torch.log_softmax is called on (..., K) tensors only."""
    import klpenalty.topk as topk

    x, ids, lt, _ = problem(vocab=100, k=6)
    calls, shapes = [], []
    real_token_logprobs, real_log_softmax = topk.token_logprobs, torch.log_softmax
    monkeypatch.setattr(topk, "token_logprobs",
                        lambda *a, **kw: calls.append(1) or real_token_logprobs(*a, **kw))
    patch_torch(monkeypatch, torch, "log_softmax",
                lambda t, *a, **kw: shapes.append(t.shape) or real_log_softmax(t, *a, **kw))
    for kind in KINDS:
        topk_divergence(x, ids, lt, kind)
    assert len(calls) == len(KINDS) - 1
    assert all(s[-1] == 6 for s in shapes)


# ---- 4. masking, −inf padding, bad inputs -----------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_masked_positions_give_zero_and_no_gradient(kind):
    x, ids, lt, _ = problem(seed=6)
    mask = torch.rand(3, 5, generator=torch.Generator().manual_seed(2)) > 0.4
    x, ids, lt = x.clone(), ids.clone(), lt.clone()
    clean = topk_divergence(x, ids, lt, kind)
    x[~mask] = math.nan  # masked positions may hold anything
    ids[~mask] = 10**6
    lt[~mask] = math.nan
    x.requires_grad_()
    out = topk_divergence(x, ids, lt, kind, mask=mask)
    assert bool((out[~mask] == 0).all())
    torch.testing.assert_close(out[mask], clean[mask], **tol(torch.float32))
    out.sum().backward()
    assert bool((x.grad[~mask] == 0).all()) and not bool(x.grad.isnan().any())
    m = topk_mass(x, ids, lt, mask=mask)
    assert all(bool((f[~mask] == 0).all()) for f in m)


@pytest.mark.parametrize("kind", KINDS)
def test_minus_inf_entries_are_absent(kind):
    """A teacher that returns fewer than K entries pads with −inf log-probs: those entries
    count for nothing (their ids are not read), as if the row had only the present ones."""
    x, ids, lt, _ = problem(shape=(2,), k=5, seed=7)
    x.requires_grad_()
    short = topk_divergence(x, ids, lt, kind)
    (g_short,) = torch.autograd.grad(short.sum(), x)
    # row 0: three padded entries at the end, ids garbage, repeated and out of range;
    # row 1: one padded entry in the middle
    pad_ids = torch.full((2, 8), -1)
    pad_lt = torch.full((2, 8), -math.inf)
    pad_ids[0, :5], pad_lt[0, :5] = ids[0], lt[0]
    pad_ids[0, 5:] = torch.tensor([ids[0, 0], 10**6, -1])
    pad_ids[1] = torch.cat([ids[1, :2], ids[1, :1], ids[1, 2:], ids[1, :2]])
    pad_lt[1, :2], pad_lt[1, 3:6] = lt[1, :2], lt[1, 2:]
    padded = topk_divergence(x, pad_ids, pad_lt, kind)
    (g_padded,) = torch.autograd.grad(padded.sum(), x)
    torch.testing.assert_close(padded, short, **tol(torch.float32))
    torch.testing.assert_close(g_padded, g_short, **grad_tol(torch.float32))
    for a, b in zip(topk_mass(x, pad_ids, pad_lt), topk_mass(x, ids, lt)):
        torch.testing.assert_close(a, b, **tol(torch.float32))


def test_a_counted_position_without_entries():
    x, ids, lt, _ = problem(shape=(2,))
    lt = lt.clone()
    lt[1] = -math.inf
    with pytest.raises(ValueError, match=r"teacher_logprobs .*no present entry.*index \(1,\)"):
        topk_divergence(x, ids, lt)
    for kind in KINDS:  # unchecked, or masked out: 0
        assert topk_divergence(x, ids, lt, kind, check=False)[1] == 0
        assert topk_divergence(x, ids, lt, kind, mask=torch.tensor([True, False]))[1] == 0


def test_no_leading_dims_and_empty_batches():
    x, ids, lt, _ = problem(shape=())
    for kind in KINDS:
        assert topk_divergence(x, ids, lt, kind).shape == ()
    x, ids, lt, _ = problem(shape=(0, 3))
    for kind in KINDS:
        assert topk_divergence(x, ids, lt, kind).shape == (0, 3)
    assert topk_mass(x, ids, lt).teacher_mass.shape == (0, 3)


def bad_inputs():
    x, ids, lt, _ = problem()
    dup, far, neg = ids.clone(), ids.clone(), ids.clone()
    dup[1, 2, 3] = dup[1, 2, 0]
    far[0, 1, 2], neg[2, 4, 0] = 64, -1
    big, pos = lt.clone(), lt.clone()
    big[..., 0] = -0.01
    pos[0, 0, 0] = 0.5
    nan = lt.clone()
    nan[0, 3, 1] = math.nan
    xnan = x.clone()
    xnan[2, 2].scatter_(-1, ids[2, 2, :1], math.nan)
    return [
        ((x, ids.float(), lt), {}, TypeError, "teacher_ids must be an integer"),
        ((x, ids, lt.long()), {}, TypeError, "teacher_logprobs must be a floating"),
        ((x.long(), ids, lt), {}, TypeError, "student_logits"),
        ((x, [0], lt), {}, TypeError, "teacher_ids must be a torch.Tensor"),
        ((x, ids[:2], lt[:2]), {}, ValueError, r"teacher_ids must have shape \(3, 5, 'K'\)"),
        ((x, ids[..., :0], lt[..., :0]), {}, ValueError, "K >= 1"),
        ((x, ids, lt[..., :7]), {}, ValueError, r"teacher_logprobs .*shape=\(3, 5, 7\)"),
        ((x, far, lt), {}, ValueError, r"teacher_ids .*outside \[0, 64\).*index \(0, 1, 2\)"),
        ((x, neg, lt), {}, ValueError, r"teacher_ids .*outside \[0, 64\).*index \(2, 4, 0\)"),
        ((x, dup, lt), {}, ValueError, r"teacher_ids .*repeated.*index \(1, 2\)"),
        ((x, ids, nan), {}, ValueError, r"teacher_logprobs .*NaN.*index \(0, 3, 1\)"),
        ((x, ids, pos), {}, ValueError, r"teacher_logprobs .*values > 0.0001"),
        ((x, ids, big), {}, ValueError, "teacher_logprobs .*summing above 1"),
        ((xnan, ids, lt), {}, ValueError, r"student_logits .*NaN.*index \(2, 2\)"),
        ((x, ids, lt), {"mask": torch.ones(3, 5)}, TypeError, "mask must be a bool"),
        ((x, ids, lt), {"mask": torch.ones(3, dtype=torch.bool)}, ValueError, "mask must have"),
        ((x, ids, lt), {"temperature": 0.0}, ValueError, "temperature"),
        ((x, ids, lt, "reverse_kl"), {}, ValueError, "kind must be one of"),
    ]


@pytest.mark.parametrize("case", range(len(bad_inputs())))
def test_bad_inputs_raise_naming_the_argument(case):
    args, kwargs, error, match = bad_inputs()[case]
    with pytest.raises(error, match=match):
        topk_divergence(*args, **kwargs)


def test_check_false_skips_the_value_checks():
    x, ids, lt, _ = problem()
    dup = ids.clone()
    dup[0, 0, 1] = dup[0, 0, 0]
    for kind in KINDS:
        assert bool(topk_divergence(x, dup, lt, kind, check=False).isfinite().all())
    with pytest.raises(ValueError, match="repeated"):
        topk_mass(x, dup, lt)


def test_repeated_ids_unchecked_count_each_entry():
    """With check=False a repeated id counts once per entry, in the value and the gradient."""
    x, ids, lt, _ = problem(k=6, dtype=torch.float64, seed=8)
    ids, lt = ids.clone(), lt.clone()
    ids[0, 1, 5], ids[2, 3, 4], ids[2, 3, 5] = ids[0, 1, 0], ids[2, 3, 1], ids[2, 3, 1]
    for kind in KINDS:
        x1 = x.clone().requires_grad_()
        out = topk_divergence(x1, ids, lt, kind, check=False)
        out.sum().backward()
        x2 = x.clone().requires_grad_()
        ref = reference(kind, x2, ids, lt)
        ref.sum().backward()
        torch.testing.assert_close(out, ref, **tol(torch.float64))
        torch.testing.assert_close(x1.grad, x2.grad, **grad_tol(torch.float64))


@pytest.mark.parametrize("kind", KINDS)
def test_gradcheck_with_mask_and_absent_entries(kind):
    x, ids, lt, _ = problem(shape=(2, 3), vocab=12, k=4, dtype=torch.float64, seed=9)
    lt = lt.clone()
    lt[0, 1, 2:] = -math.inf
    mask = torch.tensor([[True, True, False], [True, True, True]])
    x = x.clone().requires_grad_()
    assert torch.autograd.gradcheck(
        lambda x: topk_divergence(x, ids, lt, kind, mask=mask, temperature=0.9), (x,))
    out = topk_divergence(x, ids, lt, kind, mask=mask)
    (g1,) = torch.autograd.grad(out.sum(), x, retain_graph=True)
    (g2,) = torch.autograd.grad(out.sum(), x)  # the graph can be walked twice
    assert torch.equal(g1, g2)


def test_minus_inf_student_logits():
    x, ids, lt, _ = problem(k=6, dtype=torch.float64, seed=10)
    keep = torch.zeros_like(x, dtype=torch.bool).scatter_(-1, ids, True)
    outside = torch.rand(x.shape, generator=torch.Generator().manual_seed(3)) < 0.3
    x = x.masked_fill(outside & ~keep, -math.inf).requires_grad_()  # vocabulary padding
    for kind in KINDS:
        out = topk_divergence(x, ids, lt, kind)
        torch.testing.assert_close(out, reference(kind, x.detach(), ids, lt), **tol(torch.float64))
        (g,) = torch.autograd.grad(out.sum(), x)
        assert bool(g.isfinite().all())
    # probability 0 for an id the teacher gives mass: the forward kinds are +inf
    x0 = x.detach().clone()
    x0[0, 0, ids[0, 0, 1]] = -math.inf
    for kind in KINDS:
        got = topk_divergence(x0, ids, lt, kind)[0, 0]
        assert got == math.inf if kind != "generalized_kl" else math.isfinite(got)
