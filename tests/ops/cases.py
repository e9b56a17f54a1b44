"""Cases shared by the backend test files: float64 reference gradients and the −inf patterns."""

from __future__ import annotations

from typing import Callable

import torch

from klpenalty.ops.reference import full_kl_reference
from tests.conftest import grad_tol, make_logits, tol

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
