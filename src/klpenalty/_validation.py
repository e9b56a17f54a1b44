"""Argument checks shared by the public functions.

Every check raises ``TypeError`` (wrong kind of object or dtype) or ``ValueError`` (wrong shape
or value) with the argument's name, shape and dtype in the message. Nothing here uses
``assert``, and nothing broadcasts silently.
"""

from __future__ import annotations

import math
from numbers import Integral, Real
from typing import Sequence

import torch

__all__ = [
    "describe",
    "as_real",
    "check_logits",
    "check_logits_pair",
    "check_float",
    "check_per_token",
    "check_mask",
    "check_tokens",
    "check_ignore_index",
    "check_token_range",
    "check_temperature",
    "check_top_k",
    "check_top_p",
    "check_min_p",
    "check_want",
    "check_beta",
    "check_fraction",
    "check_choice",
    "compute_dtype",
    "raise_if_nan",
    "LOGPROB_SLACK",
    "check_logprob_values",
]


def describe(t: torch.Tensor) -> str:
    """Short ``shape=(...), dtype=...`` text for error messages."""
    return f"shape={tuple(t.shape)}, dtype={t.dtype}"


def _check_tensor(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def check_logits(name: str, t: object) -> torch.Tensor:
    """A floating tensor of rank >= 1 with a non-empty last (vocabulary) dimension."""
    t = _check_tensor(name, t)
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor (..., V), got {describe(t)}")
    if t.dim() < 1 or t.shape[-1] < 1:
        raise ValueError(f"{name} must have shape (..., V) with V >= 1, got {describe(t)}")
    return t


def check_logits_pair(
    policy_logits: object, ref_logits: object, names: tuple[str, str] = ("policy_logits", "ref_logits")
) -> None:
    """Both logits tensors valid, with identical shapes and on the same device (``names``: how
    the messages call them)."""
    a, b = names
    check_logits(a, policy_logits)
    check_logits(b, ref_logits)
    if policy_logits.shape != ref_logits.shape:
        raise ValueError(
            f"{a} and {b} must have the same shape (..., V): "
            f"{a} {describe(policy_logits)}, {b} {describe(ref_logits)}"
        )
    if policy_logits.device != ref_logits.device:
        raise ValueError(
            f"{a} and {b} must be on the same device: "
            f"{policy_logits.device} vs {ref_logits.device}"
        )


def check_float(name: str, t: object) -> torch.Tensor:
    """A floating-point tensor of any shape."""
    t = _check_tensor(name, t)
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {describe(t)}")
    return t


def check_per_token(
    name: str, t: object, leading: Sequence[int], *, floating: bool = True
) -> torch.Tensor:
    """A per-position tensor whose shape is exactly ``leading`` (no broadcasting)."""
    t = _check_tensor(name, t)
    if floating and not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {describe(t)}")
    if tuple(t.shape) != tuple(leading):
        raise ValueError(
            f"{name} must have shape {tuple(leading)} (the leading dims of the logits), "
            f"got {describe(t)}"
        )
    return t


def check_mask(mask: object, leading: Sequence[int], device: torch.device) -> torch.Tensor:
    """A bool mask (True = this position counts) of shape ``leading`` on ``device``."""
    mask = _check_tensor("mask", mask)
    if mask.dtype != torch.bool:
        raise TypeError(f"mask must be a bool tensor (True = position counts), got {describe(mask)}")
    check_per_token("mask", mask, leading, floating=False)
    if mask.device != device:
        raise ValueError(f"mask must be on {device}, got {mask.device}")
    return mask


def check_tokens(tokens: object, leading: Sequence[int]) -> torch.Tensor:
    """Integer token ids of shape ``leading`` (their range is checked by
    :func:`check_token_range`, inside the op: it needs the values)."""
    tokens = _check_tensor("tokens", tokens)
    if tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
        raise TypeError(f"tokens must be an integer tensor, got {describe(tokens)}")
    check_per_token("tokens", tokens, leading, floating=False)
    return tokens


def check_ignore_index(ignore_index: object) -> int:
    """An int (HF labels use -100); it must be negative so that it is never a real token id."""
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, Integral):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    if ignore_index >= 0:
        raise ValueError(
            f"ignore_index must be negative (a token id >= 0 is a real token), got {ignore_index}"
        )
    return int(ignore_index)


def check_token_range(tokens: torch.Tensor, vocab_size: int, ignore_index: int) -> None:
    """Token ids in [0, vocab_size) or equal to ``ignore_index`` (reads the values: a sync)."""
    if not tokens.numel():
        return
    bad = ((tokens < 0) | (tokens >= vocab_size)) & (tokens != ignore_index)
    if bool(bad.any()):
        first = tuple(int(i) for i in torch.unravel_index(bad.flatten().nonzero()[0, 0], tokens.shape))
        raise ValueError(
            f"tokens must lie in [0, {vocab_size}) (the vocabulary size) or equal "
            f"ignore_index={ignore_index}; {int(bad.sum())} do not, the first "
            f"{int(tokens[first])} at index {first} ({describe(tokens)})"
        )


def _is_numpy_real(value: object) -> bool:
    """A 0-d numpy value (scalar or 0-d array) of integer or floating dtype, numpy not imported."""
    dtype = getattr(value, "dtype", None)
    return (
        type(value).__module__ == "numpy"
        and getattr(value, "ndim", None) == 0
        and hasattr(value, "__float__")
        and getattr(dtype, "kind", None) in ("i", "u", "f")
    )


def as_real(name: str, value: object) -> float:
    """The Python float of a real number given as a number, a numpy scalar or a 1-element tensor.

    Accepts Python ints and floats, any other ``numbers.Real`` (numpy integer and floating
    scalars such as ``np.float32(3.0)`` register as one), 0-d numpy arrays of integer or
    floating dtype, and tensors with exactly one element (read detached, e.g. a loss of
    shape () or (1,)). Finiteness and range are the caller's to check.

    Args:
        name: the argument's name, for the error message.
        value: the number.

    Returns:
        ``float(value)``.

    Raises:
        TypeError: ``value`` is a bool (also numpy and tensor bools), a complex number, a
            string, a tensor with other than one element, or anything else.
    """
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.dtype == torch.bool or value.is_complex():
            raise TypeError(
                f"{name} must be a real number or a one-element real tensor, "
                f"got a tensor {describe(value)}"
            )
        return float(value.detach().item())
    if isinstance(value, bool) or not (isinstance(value, Real) or _is_numpy_real(value)):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    return float(value)


# The temperatures accepted: the normal float32 range (the kernels and the sampler's rule
# divide in float32; outside it T rounds to 0, a subnormal or inf there).
_TEMPERATURE_RANGE = (torch.finfo(torch.float32).tiny, torch.finfo(torch.float32).max)


def check_temperature(temperature: object) -> float:
    """A finite real number > 0, within float32's normal range."""
    t = as_real("temperature", temperature)
    lo, hi = _TEMPERATURE_RANGE
    if not math.isfinite(t) or t <= 0:
        raise ValueError(f"temperature must be finite and > 0, got {t}")
    if not lo <= t <= hi:
        raise ValueError(
            f"temperature must be finite and > 0 within float32's normal range [{lo:.6g}, "
            f"{hi:.6g}] (the logits are divided by it in float32), got {t}"
        )
    return t


def check_want(want: object, has_ref: bool, has_tokens: bool) -> int:
    """The ``want`` bits of a token_stats op (KL 1, log-prob 2, ref log-prob 4, entropy 8):
    at least one, and the inputs each needs (the KL and the ref log-prob a reference, the
    log-probs tokens)."""
    if isinstance(want, bool) or not isinstance(want, Integral) or not 0 < int(want) < 16:
        raise ValueError(f"want must be an int in [1, 15] (bits KL=1, LOGP=2, REF_LOGP=4, "
                         f"ENTROPY=8), got {want!r}")
    want = int(want)
    if want & 5 and not has_ref:
        raise ValueError(f"want={want} asks for the KL or the reference log-prob without ref_logits")
    if want & 6 and not has_tokens:
        raise ValueError(f"want={want} asks for token log-probs without tokens")
    return want


def check_beta(beta: object, name: str = "beta") -> float:
    """A finite real number >= 0."""
    b = as_real(name, beta)
    if not math.isfinite(b) or b < 0:
        raise ValueError(f"{name} must be finite and >= 0, got {b}")
    return b


def check_fraction(name: str, value: object) -> float:
    """A real number strictly between 0 and 1."""
    f = as_real(name, value)
    if not (0.0 < f < 1.0):  # also rejects NaN
        raise ValueError(f"{name} must lie in (0, 1), got {f}")
    return f


def check_choice(name: str, value: object, valid: Sequence[str]) -> str:
    """One of a fixed list of strings; the error lists the valid ones."""
    if not isinstance(value, str) or value not in valid:
        raise ValueError(f"{name} must be one of {list(valid)}, got {value!r}")
    return value


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float64 if any input is float64, else float32 (bf16/fp16 are upcast)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def raise_if_nan(result: torch.Tensor, named_inputs: dict[str, torch.Tensor]) -> None:
    """Raise ``ValueError`` if ``result`` (N,) holds NaN, naming the input with NaN in those rows.

    ``named_inputs`` maps argument names to the caller's (..., V) tensors. A NaN logit makes its
    row's result NaN, so checking the (N,) result costs O(N) instead of another pass over the
    (N, V) logits.
    """
    bad = torch.isnan(result)
    if not bool(bad.any()):
        return
    rows = bad.nonzero().flatten()
    leading = next(iter(named_inputs.values())).shape[:-1]
    first = tuple(int(i) for i in torch.unravel_index(rows[0], leading)) if leading else ()
    for name, t in named_inputs.items():
        if bool(torch.isnan(t.reshape(-1, t.shape[-1])[rows]).any()):
            raise ValueError(
                f"{name} contains NaN ({describe(t)}) in {rows.numel()} counted position(s), "
                f"the first at index {first}"
            )
    raise ValueError(
        f"the result is NaN in {rows.numel()} counted position(s), the first at index {first}, "
        "although the inputs hold no NaN there: a row whose logits are all -inf (or hold "
        "+inf) defines no distribution; mask such positions out"
    )


# Log-probs are <= 0, but a log-softmax rounds: for a token of probability ~1, x − logsumexp(x)
# can come out a few ulps of |x| above 0 (float32 logits of magnitude ~100: ~1e-5). 1e-4 lets
# that rounding through and still catches logits passed by mistake, which are O(1) and positive
# on about half the entries.
LOGPROB_SLACK = 1e-4


def check_logprob_values(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    names: tuple[str, str] = ("logprobs", "ref_logprobs"),
    *,
    finite_ref: bool = False,
) -> None:
    """Raise ``ValueError`` unless two (...) log-prob tensors can give a sampled KL estimate.

    Rejects NaN, values > :data:`LOGPROB_SLACK`, and positions where both are −inf (the token
    has probability 0 under both models, so log ρ − log π is undefined); with ``finite_ref``
    also −inf in the second (log π − log ρ would be +inf). The message names the argument
    (``names``: how the caller calls them), its shape and dtype, the number of bad positions
    and the first one. The tensors are read on their device with one host sync.
    """
    both = f"{names[0]} and {names[1]}"
    checks = [
        (name, t, bad, what)
        for name, t in ((names[0], logprobs), (names[1], ref_logprobs))
        for bad, what in (
            (torch.isnan(t), "NaN"),
            (t > LOGPROB_SLACK, f"values > {LOGPROB_SLACK} (log-probs are <= 0: logits?)"),
        )
    ]
    checks.append(
        (
            both,
            logprobs,
            torch.isneginf(logprobs) & torch.isneginf(ref_logprobs),
            "-inf in both (the sampled token has probability 0 under the policy: no estimate "
            "exists)",
        )
    )
    if finite_ref:
        checks.append(
            (
                names[1],
                ref_logprobs,
                torch.isneginf(ref_logprobs),
                "-inf (a sampled token without mass under it: log π − log ρ is +inf there)",
            )
        )
    found = torch.stack([bad.any() for _, _, bad, _ in checks]).tolist()  # the one host sync
    for (name, t, bad, what), hit in zip(checks, found):
        if hit:
            flat = bad.reshape(-1).nonzero()
            first = tuple(int(i) for i in torch.unravel_index(flat[0, 0], t.shape)) if t.dim() else ()
            raise ValueError(
                f"{name} ({describe(t)}) hold{'' if name == both else 's'} {what} at "
                f"{flat.shape[0]} position(s), the first at index {first}"
            )


def check_top_k(top_k: object) -> int:
    """An int ≥ 1."""
    if isinstance(top_k, bool) or not isinstance(top_k, Integral):
        raise TypeError(f"top_k must be an int >= 1, got {type(top_k).__name__}")
    if top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    return int(top_k)


def check_top_p(top_p: object) -> float:
    """A real number in (0, 1]."""
    p = as_real("top_p", top_p)
    if not (0.0 < p <= 1.0):  # also rejects NaN
        raise ValueError(f"top_p must lie in (0, 1], got {p}")
    return p


def check_min_p(min_p: object) -> float:
    """A real number in [0, 1]."""
    p = as_real("min_p", min_p)
    if not (0.0 <= p <= 1.0):
        raise ValueError(f"min_p must lie in [0, 1], got {p}")
    return p
