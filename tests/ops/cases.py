"""Cases shared by the backend test files: float64 reference gradients and the −inf patterns."""

from __future__ import annotations

from typing import Callable

import torch

from klpenalty.ops.contract import WANT_ALL, Want
from klpenalty.ops.reference import full_kl_reference
from tests.helpers import grad_tol, make_logits, tol

NINF = float("-inf")


def ref_kl_grads(x, y, mask, temperature, grad_out, need_y=True):
    """Gradients of Σ grad_out·KL through the float64 reference (masked rows excluded)."""
    xr = x.detach().double().requires_grad_()
    yr = y.detach().double().requires_grad_(need_y)
    if mask is None:
        kl = full_kl_reference(xr, yr, temperature)
    else:  # masked rows may hold garbage (−inf): keep it out of the reference's autograd
        m = mask.unsqueeze(-1)
        kl = full_kl_reference(torch.where(m, xr, 0.0), torch.where(m, yr, 0.0), temperature)
        kl = torch.where(mask, kl, torch.zeros_like(kl))
    inputs = (xr, yr) if need_y else (xr,)
    return torch.autograd.grad((kl * grad_out.double()).sum(), inputs)


def check_minus_inf_patterns(
    kl_fn: Callable, vocab: int, dtype: torch.dtype, pad_ids: list[int], device=None
):
    """A backend's KL and gradients on 4 rows with −inf patterns, against float64.

    Row 0: shared −inf padding only; row 1: also a policy −inf alone (contributes nothing);
    row 2: a reference −inf where the policy has mass (KL = +inf, no gradient asked); row 3: the
    policy −inf over the second half of the vocabulary (a tile or split without mass).
    Returns (kl, gx, gy, xp, yp, grad_out) for further comparisons.
    """
    x, y = make_logits((4, vocab), torch.float32, seed=5)
    pad = torch.zeros(vocab, dtype=torch.bool)
    pad[pad_ids] = True
    xp, yp = x.masked_fill(pad, NINF), y.masked_fill(pad, NINF)  # shared −inf padding
    xp[1, 3] = NINF
    yp[2, 4] = NINF
    xp[3, vocab // 2 :] = NINF
    xp, yp = (t.to(dtype).to(device).requires_grad_() for t in (xp, yp))
    kl = kl_fn(xp, yp)
    want = full_kl_reference(xp.detach(), yp.detach())
    assert kl[2].item() == float("inf") and want[2].item() == float("inf")
    keep = [0, 1, 3]
    torch.testing.assert_close(kl[keep].double(), want[keep], **tol(dtype))
    grad_out = torch.tensor([1.5, -0.5, 0.0, 2.0], device=device)  # no gradient for the +inf row
    gx, gy = torch.autograd.grad(kl, (xp, yp), grad_out)
    assert torch.isfinite(gx).all() and torch.isfinite(gy).all()
    assert torch.all(gx[:, pad.to(gx.device)] == 0) and torch.all(gy[:, pad.to(gy.device)] == 0)
    # the reference's autograd gives 0·(−inf) = NaN at −inf entries: −1e4 has float64 mass 0
    finite = [torch.nan_to_num(t.detach()[keep].double(), neginf=-1e4) for t in (xp, yp)]
    wx, wy = ref_kl_grads(*finite, None, 1.0, grad_out[keep])
    torch.testing.assert_close(gx[keep].double(), wx, **grad_tol(dtype))
    torch.testing.assert_close(gy[keep].double(), wy, **grad_tol(dtype))
    return kl, gx, gy, xp, yp, grad_out


def check_kl_and_grads(kl, x, y, mask, temperature, dtype):
    """A backend's KL of (x, y) (..., V), with ``mask``'s False rows holding garbage, against
    float64: values, gradients with a non-unit upstream gradient, exact zeros on masked rows.
    Returns (gx, gy, grad_out)."""
    leading, vocab = x.shape[:-1], x.shape[-1]
    assert kl.shape == leading
    assert kl.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    want = torch.where(mask, full_kl_reference(x.detach(), y.detach(), temperature), 0.0)
    torch.testing.assert_close(kl.double(), want, **tol(dtype))
    grad_out = torch.linspace(-1.5, 2.0, mask.numel(), device=x.device).reshape(leading)
    gx, gy = torch.autograd.grad(kl, (x, y), grad_out)
    assert gx.dtype == dtype and gy.dtype == dtype
    wx, wy = ref_kl_grads(x, y, mask, temperature, grad_out)
    torch.testing.assert_close(gx.double(), wx, **grad_tol(dtype))
    torch.testing.assert_close(gy.double(), wy, **grad_tol(dtype))
    assert torch.all(gx.view(-1, vocab)[~mask.view(-1)] == 0)
    assert torch.all(gy.view(-1, vocab)[~mask.view(-1)] == 0)
    return gx, gy, grad_out


def check_token_logprobs_and_grads(out, x, tokens, temperature, dtype):
    """A backend's log π(token) of x (..., V) against float64, tokens holding -100 (ignored):
    values, zeros at ignored positions, gradients with a non-unit upstream gradient. Returns gx."""
    from klpenalty.ops.reference import token_logprobs_reference

    ignored = tokens == -100
    assert torch.all(out[ignored] == 0)
    want = token_logprobs_reference(x.detach(), tokens.clamp_min(0), temperature)
    torch.testing.assert_close(out[~ignored].double(), want[~ignored], **tol(dtype))
    grad_out = torch.linspace(-2.0, 1.0, tokens.numel(), device=x.device).reshape(tokens.shape)
    (gx,) = torch.autograd.grad(out, (x,), grad_out)
    assert gx.dtype == dtype
    xr = x.detach().double().requires_grad_()
    ref = token_logprobs_reference(xr, tokens.clamp_min(0), temperature)
    (wx,) = torch.autograd.grad((torch.where(ignored, 0.0, ref) * grad_out.double()).sum(), (xr,))
    torch.testing.assert_close(gx.double(), wx, **grad_tol(dtype))
    return gx


# ------------------------------------------------------------------ the one-pass token stats
# Every valid ``want`` of the token_stats ops (a non-empty set of Want bits) with a reference and
# tokens given, and those valid without a reference / without tokens.
ALL_WANTS = [Want(w) for w in range(1, WANT_ALL + 1)]
WANTS_WITHOUT_REF = [w for w in ALL_WANTS if not w & (Want.KL | Want.REF_LOGP)]
WANTS_WITHOUT_TOKENS = [w for w in ALL_WANTS if not w & (Want.LOGP | Want.REF_LOGP)]


def token_stats_case(dtype: torch.dtype, *, device=None, seed: int = 14):
    """x, y (2, 3, 37) with non-contiguous leading dims, tokens, mask, keep, tau, one row each:

    row 0: masked, garbage (x all −inf, y NaN), empty support;
    row 1: tau support with three logits tied at tau, the token one of the ties;
    row 2: a support of one token (the sampled one);
    row 3: no truncation, a −inf policy logit shared with the reference;
    row 4: top-5 by tau, the reference −inf off the support (finite KL), token kept;
    row 5: a keep pattern, the token ignored (-100).
    tau is in the compute dtype (float64 for float64 inputs, else float32).
    """
    vocab = 37
    cd = torch.float64 if dtype == torch.float64 else torch.float32
    g = torch.Generator().manual_seed(seed)
    base = torch.randn((2, 5, vocab), generator=g, dtype=torch.float64) * 2.5
    ref = base + torch.randn((2, 5, vocab), generator=g, dtype=torch.float64) * 1.2
    xb, yb = base.to(dtype), ref.to(dtype)
    x, y = xb[:, 1:4], yb[:, 1:4]  # (2, 3, V), strides (5V, V, 1): not one row stride
    xf, yf = x.reshape(6, vocab), y.reshape(6, vocab)  # copies, edited below, copied back
    keep = torch.ones(6, vocab, dtype=torch.bool)
    tau = torch.full((6,), NINF, dtype=torch.float64)
    tokens = torch.zeros(6, dtype=torch.long)
    mask = torch.ones(6, dtype=torch.bool)
    # row 0: masked garbage, empty support
    xf[0], yf[0] = NINF, float("nan")
    keep[0] = False
    tokens[0], mask[0] = 3, False
    # row 1: ties at tau
    order = xf[1].double().argsort(descending=True)
    xf[1, order[3:6]] = xf[1, order[3]].clone()
    tau[1] = xf[1, order[3]].double()
    tokens[1] = order[4]
    # row 2: one token kept
    keep[2] = False
    keep[2, 11] = True
    tokens[2] = 11
    # row 3: a shared −inf, nothing truncated
    xf[3, 7], yf[3, 7] = NINF, NINF
    tokens[3] = 8
    # row 4: top-5, the reference −inf off the support
    order = xf[4].double().argsort(descending=True)
    tau[4] = xf[4, order[4]].double()
    yf[4, order[10]] = NINF
    tokens[4] = order[1]
    # row 5: a keep pattern, ignored token
    keep[5] = torch.rand(vocab, generator=g) < 0.6
    keep[5, xf[5].double().argmax()] = True
    tokens[5] = -100
    x, y = xb.clone()[:, 1:4], yb.clone()[:, 1:4]
    x.copy_(xf.view(2, 3, vocab))
    y.copy_(yf.view(2, 3, vocab))
    to = dict(device=device)
    return dict(
        x=x.to(**to),
        y=y.to(**to),
        tokens=tokens.view(2, 3).to(**to),
        mask=mask.view(2, 3).to(**to),
        keep=keep.view(2, 3, vocab).to(**to),
        tau=tau.view(2, 3).to(dtype=cd, **to),
    )


def ref_token_stats_grads(x, y, tokens, mask, keep, tau, temperature, ignore_index, want, grad_out):
    """Gradients of Σ grad_out·out through the float64 reference, (gx, gy or zeros).

    Entries off the support (and −inf logits) become −1e6, whose float64 mass is exactly 0,
    so the reference's autograd stays finite there (0·(−inf) would give NaN) and gives them no
    gradient; the values are unchanged.
    """
    from klpenalty.ops.contract import kept_logits
    from klpenalty.ops.reference import token_stats_reference

    kept = torch.isfinite(kept_logits(x.detach().double(), keep, tau))
    xr = x.detach().double().requires_grad_()
    yr = None if y is None else y.detach().double().requires_grad_()
    xs = torch.where(kept, xr, -1e6)
    ys = None if yr is None else torch.where(torch.isfinite(yr.detach()), yr, -1e6)
    out = token_stats_reference(xs, ys, tokens, mask, None, None, temperature, ignore_index, want)
    inputs = (xr,) if yr is None else (xr, yr)
    grads = torch.autograd.grad((out * grad_out.double()).sum(), inputs, allow_unused=True)
    grads = [torch.zeros_like(t) if gr is None else gr for t, gr in zip(inputs, grads)]
    return grads[0], (grads[1] if yr is not None else None)


def _out_close(out, want_out, dtype):
    """Values against float64, the infinities and NaNs in the same places."""
    torch.testing.assert_close(out.double(), want_out, equal_nan=True, **tol(dtype))


class _Case:
    """The shared inputs of the grid's scenarios (:func:`token_stats_case`) and the reference."""

    def __init__(self, dtype: torch.dtype, device) -> None:
        c = token_stats_case(dtype, device=device)
        self.x, self.y, self.tokens, self.mask, self.keep, self.tau = (
            c[k] for k in ("x", "y", "tokens", "mask", "keep", "tau")
        )
        self.cdt = torch.float64 if dtype == torch.float64 else torch.float32
        self.t = 0.7
        # a non-unit upstream gradient in all four columns
        self.grad_out = torch.linspace(-1.5, 2.0, 24, device=device).reshape(2, 3, 4)

    @staticmethod
    def ref(x_, y_, tok_, mask_, keep_, tau_, temp, want, ii=-100):
        from klpenalty.ops.reference import token_stats_reference

        return token_stats_reference(x_, y_, tok_, mask_, keep_, tau_, temp, ii, want)


def _scenario_every_want(run, dtype, device, c: _Case) -> None:
    from klpenalty.ops.contract import kept_logits  # noqa: F401 (used by some scenarios)

    x, y, tokens, mask, keep, tau, t, cdt, ref = (
        c.x, c.y, c.tokens, c.mask, c.keep, c.tau, c.t, c.cdt, c.ref
    )
    grad_out = c.grad_out
    # every valid want: values, zeros where not wanted and on the masked row, the dtype
    for want in ALL_WANTS:
        out = run(x, y, tokens, mask, keep, tau, t, want, ignore_index=-100, check=True)
        assert out.shape == (2, 3, 4) and out.dtype == cdt
        _out_close(out, ref(x, y, tokens, mask, keep, tau, t, want), dtype)
    for want in WANTS_WITHOUT_REF:
        out = run(x, None, tokens, mask, keep, tau, t, want, ignore_index=-100, check=True)
        _out_close(out, ref(x, None, tokens, mask, keep, tau, t, want), dtype)
    for want in WANTS_WITHOUT_TOKENS:
        out = run(x, y, None, mask, keep, tau, t, want, ignore_index=-100, check=True)
        _out_close(out, ref(x, y, None, mask, keep, tau, t, want), dtype)
    full = run(x, y, tokens, mask, keep, tau, t, 15, ignore_index=-100, check=True)
    flat = full.reshape(6, 4)
    assert torch.all(flat[0] == 0) and torch.all(flat[5, 1:3] == 0)  # masked; ignored token
    assert flat[2, 1].item() == 0.0 and flat[2, 3].item() == 0.0  # one token kept: log 1, H = 0


def _scenario_gradients(run, dtype, device, c: _Case) -> None:
    from klpenalty.ops.contract import kept_logits  # noqa: F401 (used by some scenarios)

    x, y, tokens, mask, keep, tau, t, cdt, ref = (
        c.x, c.y, c.tokens, c.mask, c.keep, c.tau, c.t, c.cdt, c.ref
    )
    grad_out = c.grad_out
    # gradients for x and y, non-unit upstream gradient in all four columns (the columns not
    # wanted must be ignored), exact zeros on the masked row
    for want in (15, 9, 2, 4):
        xg, yg = x.detach().requires_grad_(), y.detach().requires_grad_()
        out = run(xg, yg, tokens, mask, keep, tau, t, want, ignore_index=-100, check=True)
        gx, gy = torch.autograd.grad(out, (xg, yg), grad_out)
        assert gx.dtype == dtype and gy.dtype == dtype and gx.shape == x.shape
        wx, wy = ref_token_stats_grads(x, y, tokens, mask, keep, tau, t, -100, want, grad_out)
        torch.testing.assert_close(gx.double(), wx, **grad_tol(dtype))
        torch.testing.assert_close(gy.double(), wy, **grad_tol(dtype))
        assert torch.all(gx.reshape(6, -1)[0] == 0) and torch.all(gy.reshape(6, -1)[0] == 0)
        off = ~torch.isfinite(kept_logits(x.double(), keep, tau))
        assert torch.all(gx.double()[off] == 0)  # no gradient off the support
    xg = x.detach().requires_grad_()  # without a reference
    out = run(xg, None, tokens, mask, keep, tau, t, 10, ignore_index=-100, check=True)
    (gx,) = torch.autograd.grad(out, (xg,), grad_out)
    wx, _ = ref_token_stats_grads(x, None, tokens, mask, keep, tau, t, -100, 10, grad_out)
    torch.testing.assert_close(gx.double(), wx, **grad_tol(dtype))


def _scenario_supports_and_temperatures(run, dtype, device, c: _Case) -> None:
    from klpenalty.ops.contract import kept_logits  # noqa: F401 (used by some scenarios)

    x, y, tokens, mask, keep, tau, t, cdt, ref = (
        c.x, c.y, c.tokens, c.mask, c.keep, c.tau, c.t, c.cdt, c.ref
    )
    grad_out = c.grad_out
    # keep alone, tau alone, no support (temperatures 1.3 and 1), the same tokens (kept in all).
    # Without tau, row 4 keeps the entry where the reference is −inf: KL = +inf there, its
    # KL column gets no upstream gradient, and the other three columns' gradients stay finite.
    grad_fin = grad_out.clone()
    grad_fin[1, 1, 0] = 0.0
    for keep_, tau_, temp in ((keep, None, 1.3), (None, tau, 1.3), (None, None, 1.0)):
        xg, yg = x.detach().requires_grad_(), y.detach().requires_grad_()
        out = run(xg, yg, tokens, mask, keep_, tau_, temp, 15, ignore_index=-100, check=True)
        _out_close(out, ref(x, y, tokens, mask, keep_, tau_, temp, 15), dtype)
        assert (out[1, 1, 0].item() == float("inf")) == (tau_ is None)
        gx, gy = torch.autograd.grad(out, (xg, yg), grad_fin)
        assert torch.isfinite(gx).all() and torch.isfinite(gy).all()
        wx, wy = ref_token_stats_grads(x, y, tokens, mask, keep_, tau_, temp, -100, 15, grad_fin)
        torch.testing.assert_close(gx.double(), wx, **grad_tol(dtype))
        torch.testing.assert_close(gy.double(), wy, **grad_tol(dtype))


def _scenario_ignore_index(run, dtype, device, c: _Case) -> None:
    from klpenalty.ops.contract import kept_logits  # noqa: F401 (used by some scenarios)

    x, y, tokens, mask, keep, tau, t, cdt, ref = (
        c.x, c.y, c.tokens, c.mask, c.keep, c.tau, c.t, c.cdt, c.ref
    )
    grad_out = c.grad_out
    # ignore_index = -1
    tokens_1 = torch.where(tokens == -100, -1, tokens)
    out = run(x, y, tokens_1, mask, None, None, t, 15, ignore_index=-1, check=True)
    _out_close(out, ref(x, y, tokens_1, mask, None, None, t, 15, ii=-1), dtype)
    assert torch.all(out.reshape(6, 4)[5, 1:3] == 0)


def _scenario_reference_minus_inf(run, dtype, device, c: _Case) -> None:
    from klpenalty.ops.contract import kept_logits  # noqa: F401 (used by some scenarios)

    x, y, tokens, mask, keep, tau, t, cdt, ref = (
        c.x, c.y, c.tokens, c.mask, c.keep, c.tau, c.t, c.cdt, c.ref
    )
    grad_out = c.grad_out
    # −inf: the reference lacks mass the truncated policy has → KL = +inf (no NaN, no raise)
    y_inf = y.clone()
    y_inf[1, 0, int(x[1, 0].double().argmax())] = NINF  # row 3: kept, now without ref mass
    out = run(x, y_inf, tokens, mask, keep, tau, t, 15, ignore_index=-100, check=True)
    assert out[1, 0, 0].item() == float("inf")
    _out_close(out, ref(x, y_inf, tokens, mask, keep, tau, t, 15), dtype)


def _scenario_identical_logits_and_one_entry(run, dtype, device, c: _Case) -> None:
    from klpenalty.ops.contract import kept_logits  # noqa: F401 (used by some scenarios)

    x, y, tokens, mask, keep, tau, t, cdt, ref = (
        c.x, c.y, c.tokens, c.mask, c.keep, c.tau, c.t, c.cdt, c.ref
    )
    grad_out = c.grad_out
    # identical logits without a support: KL exactly 0; V = 1: everything 0, zero gradients
    out = run(x[:, 1:], x[:, 1:], tokens[:, 1:], None, None, None, t, 1, ignore_index=-100,
              check=True)
    assert torch.all(out[..., 0] == 0)
    x1 = torch.randn(3, 1, device=device).to(dtype).requires_grad_()
    y1 = torch.randn(3, 1, device=device).to(dtype).requires_grad_()
    tok1 = torch.zeros(3, dtype=torch.long, device=device)
    out = run(x1, y1, tok1, None, None, None, 1.0, 15, ignore_index=-100, check=True)
    assert torch.all(out == 0)
    gx, gy = torch.autograd.grad(out, (x1, y1), torch.ones(3, 4, device=device))
    assert torch.all(gx == 0) and torch.all(gy == 0)


def _scenario_checks(run, dtype, device, c: _Case) -> None:
    check_token_stats_checks(run, dtype, device)


# name -> scenario of the shared grid; every backend's test runs each one as its own test
TOKEN_STATS_SCENARIOS = {
    name[len("_scenario_"):]: fn for name, fn in dict(globals()).items()
    if name.startswith("_scenario_")
}


def check_token_stats(
    run: Callable, dtype: torch.dtype, device=None, scenario: str | None = None
) -> None:
    """A backend's token_stats op against the float64 reference, on the shared grid.

    ``run(x, y, tokens, mask, keep, tau, T, want, **kw) -> out (..., 4)`` calls the backend
    (its entry function with its own tile arguments); ``kw`` holds ``ignore_index`` and
    ``check``. ``scenario``: one name of :data:`TOKEN_STATS_SCENARIOS` (None: all): every valid
    ``want``, gradients for x and y with a non-unit (..., 4) upstream gradient, keep or tau
    alone and no support at other temperatures, ignore_index, −inf in the reference, identical
    logits and V = 1, the checks and ``check=False``.
    """
    c = _Case(dtype, device)
    names = list(TOKEN_STATS_SCENARIOS) if scenario is None else [scenario]
    for name in names:
        TOKEN_STATS_SCENARIOS[name](run, dtype, device, c)


def check_token_stats_checks(run: Callable, dtype: torch.dtype, device=None) -> None:
    """``check=True`` errors (token range, NaN, empty support, a sampled token outside the
    support, naming its position) and ``check=False`` behaviour (NaN, −inf, no raise)."""
    import pytest

    from klpenalty.ops.reference import token_stats_reference

    c = token_stats_case(dtype, device=device)
    x, y, tokens, mask, keep, tau = (c[k] for k in ("x", "y", "tokens", "mask", "keep", "tau"))
    t = 0.7
    # a sampled token outside the support: row 4 (index (1, 1)), token off the top-5
    off = int(x[1, 1].double().argsort(descending=True)[20])
    bad = tokens.clone()
    bad[1, 1] = off
    with pytest.raises(ValueError, match=rf"sampled token {off} at position \(1, 1\) is outside the support"):
        run(x, y, bad, mask, keep, tau, t, 15, ignore_index=-100, check=True)
    with pytest.raises(ValueError, match="outside the support"):
        run(x, None, bad, mask, keep, tau, t, 2, ignore_index=-100, check=True)
    # the same token not asked for (no log-prob), masked, or ignored: no error
    run(x, y, bad, mask, keep, tau, t, 13, ignore_index=-100, check=True)
    masked = mask.clone()
    masked[1, 1] = False
    run(x, y, bad, masked, keep, tau, t, 15, ignore_index=-100, check=True)
    # check=False: log π̃(t) = −inf, the rest exact; that −inf does not move with the logits:
    # no gradient at the token (as float64 autograd through the reference gives)
    xg, yg = x.detach().requires_grad_(), y.detach().requires_grad_()
    out = run(xg, yg, bad, mask, keep, tau, t, 15, ignore_index=-100, check=False)
    assert out[1, 1, 1].item() == float("-inf")
    want_out = token_stats_reference(x, y, bad, mask, keep, tau, t, -100, 15)
    _out_close(out, want_out, dtype)
    g = torch.zeros(2, 3, 4, device=device)
    g[..., 0], g[..., 1], g[..., 3] = 1.0, 0.5, -0.25
    gx, gy = torch.autograd.grad(out, (xg, yg), g)
    wx, wy = ref_token_stats_grads(x, y, bad, mask, keep, tau, t, -100, 15, g)
    torch.testing.assert_close(gx.double(), wx, **grad_tol(dtype))
    torch.testing.assert_close(gy.double(), wy, **grad_tol(dtype))
    assert gx[1, 1, off].item() == 0.0

    # an empty support on a counted row: NaN (check=False) or an error
    empty = keep.clone()
    empty[0, 1] = False
    tok_e = tokens.clone()
    tok_e[0, 1] = -100
    out = run(x, y, tok_e, mask, empty, tau, t, 15, ignore_index=-100, check=False)
    assert torch.isnan(out[0, 1, 0]) and torch.isnan(out[0, 1, 3])
    with pytest.raises(ValueError, match="the result is NaN in 1 counted position"):
        run(x, y, tok_e, mask, empty, tau, t, 9, ignore_index=-100, check=True)
    # NaN logits in a counted row, named; a token out of range
    xn = x.clone()
    xn[0, 2, 5] = float("nan")
    with pytest.raises(ValueError, match="policy_logits contains NaN"):
        run(xn, y, tokens, mask, None, None, t, 15, ignore_index=-100, check=True)
    with pytest.raises(ValueError, match="logits contains NaN"):
        run(xn, None, None, mask, None, None, t, 8, ignore_index=-100, check=True)
    far = tokens.clone()
    far[0, 2] = 37
    with pytest.raises(ValueError, match=r"tokens must lie in \[0, 37\)"):
        run(x, y, far, mask, keep, tau, t, 15, ignore_index=-100, check=True)
