"""Helpers shared by the tests (the distributed worker, a subprocess outside pytest, imports
them too); the tolerance table is ``tests/tolerances.py``, re-exported here.

:data:`views` gives each backend of the registry the single-output entry points the tests call
(``views.views.streaming.full_kl(x, y, mask, temperature, ...)``): one column of the backend's
forward op, with the streaming tile options of the tests.
"""

from __future__ import annotations

import contextlib
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from klpenalty.ops import dispatch, streaming
from klpenalty.ops.contract import OUT_ENTROPY, OUT_KL, OUT_LOGP, Want

from .triton_env import triton_interpreter_env
from .tolerances import (
    DTYPES,
    GRAD_REL_TOL,
    GRAD_TOLERANCES,
    TOLERANCES,
    VALUE_TOL,
    grad_tol,
    tol,
)

__all__ = [
    "DTYPES",
    "GRAD_REL_TOL",
    "GRAD_TOLERANCES",
    "TOLERANCES",
    "VALUE_TOL",
    "grad_tol",
    "tol",
    "make_logits",
    "temperature_tie_cases",
    "min_p_boundary",
    "triton_interpreter_env",
    "backend_views",
    "views",
    "transformed",
]


def patch_torch(monkeypatch, owner, name: str, wrapper) -> None:
    """``monkeypatch.setattr(owner, name, wrapper)`` for a function of torch, once torch._dynamo
    is imported: dynamo keys its rules by the functions torch holds when it is first imported,
    so a wrapper in place then would leave the real function untraceable in every later
    compile of the process."""
    import torch._dynamo  # noqa: F401

    monkeypatch.setattr(owner, name, wrapper)


def make_logits(
    shape: tuple[int, ...], dtype: torch.dtype = torch.float32, *, seed: int = 0, scale: float = 3.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """A policy/reference logits pair: the reference is the policy plus noise (KL ~ 0.1-2)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64) * scale
    y = x + torch.randn(shape, generator=g, dtype=torch.float64) * (scale / 2)
    return x.to(dtype), y.to(dtype)



def _key(v: float, temperature: float) -> float:
    """The sampler rule's key of one float32 logit (ops.contract.sampler_keys)."""
    return (torch.tensor(v, dtype=torch.float32) / torch.tensor(temperature)).item()


def temperature_tie_cases(vocab: int, seed: int) -> list[tuple[Tensor, dict]]:
    """Rows (1, vocab) float32 holding two distinct adjacent float32 logits b > lo whose keys
    x/T round equal (a tie made by the temperature), each with the sampler setting that puts the
    pair where a rule that splits it would go wrong: at the top-p boundary (p halfway through
    b's mass: the mass before the pair is < p, the mass before lo counted from b is > p),
    inside the kept prefix, as the k-th largest for top-k (alone and before top-p), and at the
    min-p boundary. x = 2·N(0, 1) with lo written over the row's smallest logit; T from
    0.7, 1.3, 3.0 (each merges some neighbours, x/2 merges none)."""
    g = torch.Generator().manual_seed(seed)
    cases = []
    for temperature in (0.7, 1.3, 3.0):
        for _ in range(50):
            x = torch.randn(vocab, generator=g) * 2.0
            order = x.argsort(descending=True)
            rank = int(torch.randint(1, max(2, min(vocab - 1, vocab // 3)), (1,), generator=g))
            b = x[order[rank]].item()
            lo = torch.nextafter(x[order[rank]], torch.tensor(-math.inf)).item()  # in float32
            if _key(lo, temperature) != _key(b, temperature):
                continue
            x[order[-1]] = lo  # the row's smallest logit becomes b's neighbour
            break
        else:
            raise AssertionError("no tie made by the temperature found")  # (not reached)
        keys = (x / torch.tensor(temperature)).double()
        key_b = _key(b, temperature)
        mass = torch.softmax(keys, -1)
        before = mass[keys > key_b].sum().item()  # the tokens before the pair
        pair = mass[keys == key_b].sum().item()
        row = x.unsqueeze(0)
        cases.append((row, dict(top_p=before + 0.25 * pair, temperature=temperature)))
        if before + pair + 0.05 < 1.0:
            cases.append((row, dict(top_p=before + pair + 0.05, temperature=temperature)))
        k = int((keys > key_b).sum()) + 1  # b is the k-th largest, lo the (k+1)-th
        cases.append((row, dict(top_k=k, temperature=temperature)))
        cases.append((row, dict(top_k=k + 3, top_p=0.95, temperature=temperature)))
        ratio = math.exp(key_b - keys.max().item())
        cases.append((row, dict(min_p=ratio * (1.0 - 1e-9), temperature=temperature)))
    return cases


def min_p_boundary(d: float) -> float:
    """The largest float64 min_p with log(min_p) ≤ d (the keys' difference k_v − k_max)."""
    ratio = math.exp(d)
    while math.log(ratio) > d:
        ratio = math.nextafter(ratio, 0.0)
    while math.log(math.nextafter(ratio, 2.0)) <= d:
        ratio = math.nextafter(ratio, 2.0)
    return ratio


def _tiles(x: Tensor, chunk_rows, vocab_chunk, tile_elements) -> tuple[int, int]:
    """(tile_rows, tile_cols) of the ops from the streaming tile options (0 = default)."""
    if tile_elements is None:
        return int(chunk_rows or 0), int(vocab_chunk or 0)
    vocab = x.shape[-1]
    n = x.numel() // vocab if vocab else 0
    return streaming.token_stats.tile_shape(n, vocab, tile_elements, chunk_rows, vocab_chunk)


def backend_views(name: str) -> SimpleNamespace:
    """``token_stats``, ``full_kl``, ``token_logprobs`` and ``entropy`` of backend ``name`` on
    (..., V) tensors (unchecked inputs), through :func:`klpenalty.ops.dispatch.token_stats`.

    The backend is resolved for the tensors' device at each call (the native kernel falls back
    to streaming where it cannot be built; Triton raises where it cannot run).
    """

    def token_stats(x, y, tokens, mask, keep, tau, temperature, *, ignore_index=-100, want,
                    check=False, chunk_rows=None, vocab_chunk=None, tile_elements=None):
        rows, cols = _tiles(x, chunk_rows, vocab_chunk, tile_elements)
        backend = dispatch.get_backend(name, x.device)
        return dispatch.token_stats(
            backend, x, y, tokens, mask, keep, tau, temperature, ignore_index=ignore_index,
            want=want, check=check, tile_rows=rows, tile_cols=cols,
        )

    def full_kl(x, y, mask, temperature, *, check=False, **tiles):
        out = token_stats(x, y, None, mask, None, None, temperature, want=Want.KL, check=check,
                          **tiles)
        return out[..., OUT_KL].contiguous()

    def token_logprobs(x, tokens, temperature, *, ignore_index=-100, check=False, **tiles):
        out = token_stats(x, None, tokens, None, None, None, temperature,
                          ignore_index=ignore_index, want=Want.LOGP, check=check, **tiles)
        return out[..., OUT_LOGP].contiguous()

    def entropy(x, mask, temperature, *, check=False, **tiles):
        out = token_stats(x, None, None, mask, None, None, temperature, want=Want.ENTROPY,
                          check=check, **tiles)
        return out[..., OUT_ENTROPY].contiguous()

    return SimpleNamespace(
        token_stats=token_stats, full_kl=full_kl, token_logprobs=token_logprobs, entropy=entropy
    )


views = SimpleNamespace(**{name: backend_views(name) for name in dispatch.REGISTRY})


def transformed(h: Tensor, w: Tensor, b: Tensor | None, scale: float, cap, *,
                fused: bool = False) -> Tensor:
    """LM-head logits with differentiable torch ops: ``F.linear`` in h's dtype (the plain path a
    training loop writes; with ``fused`` the GEMM as the fused heads run it,
    ``klpenalty.linear._heads.gemm_dtype``: bf16/fp16 on CPU in float32 on the upcast
    operands), then, with a scale or a soft-cap, the GEMM's output upcast to float32 (float64
    for float64 inputs) and scale·z, cap·tanh(z/cap) in that dtype (docs/numerics.md, "the
    logit transform")."""
    if fused and h.dtype in (torch.bfloat16, torch.float16) and h.device.type == "cpu":
        h, w, b = (None if t is None else t.float() for t in (h, w, b))
    z = F.linear(h, w, b)
    if scale == 1.0 and cap is None:
        return z
    z = z.to(torch.float64 if z.dtype == torch.float64 else torch.float32)
    if scale != 1.0:
        z = z * scale
    if cap is not None:
        z = torch.tanh(z / cap) * cap
    return z


def fused_logits(h: Tensor, w: Tensor, b: Tensor | None, scale: float, cap) -> Tensor:
    """The logits the fused heads see (:func:`transformed` with ``fused=True``)."""
    return transformed(h, w, b, scale, cap, fused=True)


def op_backend(name: str):
    """The op backend's registry entry, skipping where its ops cannot run on CPU tensors in
    this process (no native build; Triton absent or compiled for a GPU)."""
    if name == "native" and not dispatch.REGISTRY["native"].available():
        pytest.skip("the native kernel cannot be built here (tests/ops/test_native.py says why)")
    if name == "triton":
        tk = dispatch.REGISTRY["triton"].module
        if not (tk.available() and tk.interpreted()):
            pytest.skip("Triton is not installed, or its kernels are compiled (a GPU run)")
    return dispatch.REGISTRY[name]


def backend_env(name: str):
    """The context a backend's ops run in here: Triton's interpreter for ``triton``."""
    return triton_interpreter_env() if name == "triton" else contextlib.nullcontext()
