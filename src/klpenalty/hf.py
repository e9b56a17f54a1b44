"""Exact KL and token log-probs for Hugging Face causal LMs, without their (B, T, V) logits.

Shape letters: B batch, T sequence, V vocabulary, H hidden (each model its own).

:func:`causal_lm_kl` runs each model's body (the transformer without its LM head), takes the
last hidden states (after the final norm, as the head sees them) and each model's output
embedding, and hands both to :func:`klpenalty.linear.linear_kl`, which computes the logits of
the counted positions chunk by chunk and never holds them all. The logit transform each
architecture's ``forward`` applies after its head (soft-capping, scaling) is looked up by
``config.model_type`` in :data:`SUPPORTED_ARCHITECTURES`; any other architecture raises.

Importing this module does not import ``transformers`` (it reads models by duck typing); the
tests build tiny models with it (``pip install 'klpenalty[hf]'``).
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple, Optional

import torch

from . import _validation as v
from .functional import TokenStats
from .linear import linear_kl
from .ops.dispatch import get_backend

__all__ = ["causal_lm_kl", "scored_positions", "generate_position_ids", "SUPPORTED_ARCHITECTURES"]

IGNORE_INDEX = -100  # Hugging Face's label for "not scored"


class _Head(NamedTuple):
    """What a causal LM's forward does after its body: z = scale·(h Wᵀ + b), cap·tanh(z/cap)."""

    weight: torch.Tensor  # (V, H)
    bias: Optional[torch.Tensor]  # (V,) or None
    scale: float
    softcap: Optional[float]


def _plain(config) -> tuple[float, Optional[float]]:
    return 1.0, None


def _final_softcap(config) -> tuple[float, Optional[float]]:
    # Gemma2ForCausalLM: logits = cap·tanh(lm_head(h)/cap) when final_logit_softcapping is set
    cap = getattr(config, "final_logit_softcapping", None)
    return 1.0, None if cap is None else float(cap)


def _cohere_scale(config) -> tuple[float, Optional[float]]:
    # CohereForCausalLM: logits = lm_head(h) · config.logit_scale
    return float(config.logit_scale), None


def _granite_scale(config) -> tuple[float, Optional[float]]:
    # GraniteForCausalLM: logits = lm_head(h) / config.logits_scaling
    return 1.0 / float(config.logits_scaling), None


# config.model_type -> (scale, softcap) of its *ForCausalLM head. Each entry is tested against
# the model's own forward in tests/test_hf.py; add one only with such a test.
_TRANSFORMS = {
    "llama": _plain,
    "mistral": _plain,
    "qwen2": _plain,
    "qwen3": _plain,
    "gemma": _plain,  # the √H embedding scale is inside the body
    "gpt2": _plain,  # head tied to the token embedding
    "phi": _plain,  # the head has a bias
    "gemma2": _final_softcap,
    "cohere": _cohere_scale,
    "granite": _granite_scale,
}

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(sorted(_TRANSFORMS))
"""The ``config.model_type`` values :func:`causal_lm_kl` accepts."""


def _model_parts(name: str, model: object) -> tuple[torch.nn.Module, _Head, str]:
    """(body, head, model_type) of a causal LM, or a clear error naming ``name``."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"{name} must be a Hugging Face causal LM (a torch.nn.Module such as "
            f"LlamaForCausalLM), got {type(model).__name__}"
        )
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if not isinstance(model_type, str):
        raise TypeError(
            f"{name} ({type(model).__name__}) has no config.model_type: pass a Hugging Face "
            "causal LM such as LlamaForCausalLM"
        )
    if model_type not in _TRANSFORMS:
        raise ValueError(
            f"{name} has config.model_type={model_type!r} ({type(model).__name__}), whose "
            "LM-head logit transform klpenalty.hf does not know; supported: "
            f"{list(SUPPORTED_ARCHITECTURES)}"
        )
    prefix = getattr(model, "base_model_prefix", None)
    body = getattr(model, prefix, None) if isinstance(prefix, str) and prefix else None
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    weight = getattr(head, "weight", None)
    has_body = isinstance(body, torch.nn.Module) and body is not model
    if not has_body or not isinstance(weight, torch.Tensor):
        raise ValueError(
            f"{name} ({type(model).__name__}, model_type {model_type!r}) must be a causal LM with "
            "a body (getattr(model, model.base_model_prefix)) and an LM head "
            "(get_output_embeddings()), e.g. LlamaForCausalLM rather than LlamaModel"
        )
    if type(head) is not torch.nn.Linear:  # e.g. a PEFT adapter or a quantised layer
        raise ValueError(
            f"{name}'s LM head (get_output_embeddings()) is {type(head).__name__}, not a plain "
            "torch.nn.Linear: klpenalty.hf reads only its weight and bias, which would silently "
            "drop what its forward adds (merge adapters into the weight first)"
        )
    bias = head.bias
    scale, softcap = _TRANSFORMS[model_type](config)
    return body, _Head(weight, bias, scale, softcap), model_type


def _check_ids(name: str, t: object, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """An integer (B, T) tensor of exactly ``shape`` on ``device``."""
    t = v.check_per_token(name, t, shape, floating=False)
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor (B, T), got {v.describe(t)}")
    if t.device != device:
        raise ValueError(f"{name} must be on the device of input_ids ({device}), got {t.device}")
    return t


def _check_bool_or_ids(name: str, t: object, shape, device) -> torch.Tensor:
    """A (B, T) bool or 0/1 integer mask, returned as bool."""
    t = v.check_per_token(name, t, shape, floating=False)
    if t.dtype != torch.bool:
        _check_ids(name, t, shape, device)  # integer 0/1, as tokenizers return it
        return t != 0
    if t.device != device:
        raise ValueError(f"{name} must be on the device of input_ids ({device}), got {t.device}")
    return t


def _check_scored_range(name: str, ids: torch.Tensor, scored: torch.Tensor, vocab: int) -> None:
    """``ids[:, 1:]`` (B, T) in [0, vocab) where ``scored`` (B, T - 1), or ValueError naming
    ``name`` (one host read)."""
    tokens = ids[:, 1:]
    bad = scored & ((tokens < 0) | (tokens >= vocab))
    if bool(bad.any()):
        b, t = (int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"{name} must lie in [0, {vocab}) (the LM heads' vocabulary) at the scored "
            f"positions; {int(bad.sum())} do not, the first {int(tokens[b, t])} at index "
            f"{(b, t + 1)} ({v.describe(ids)})"
        )


def generate_position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids (B, T) from a (B, T) attention mask as ``generate`` makes them: the count of
    real tokens before each position (0 at the first real token, so left padding does not shift
    the positions), and 1 on padding."""
    mask = attention_mask.long()
    return (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)


def _last_hidden(body: torch.nn.Module, input_ids, attention_mask, position_ids) -> torch.Tensor:
    out = body(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=False,
    )
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]  # (B, T, H)


def _scored(input_ids, attention_mask, labels, response_mask):
    """Validate the (B, T) batch arguments; returns (scored (B, T - 1) bool, attention as bool
    or None)."""
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"input_ids must be a torch.Tensor, got {type(input_ids).__name__}")
    if input_ids.dim() != 2 or input_ids.shape[1] < 1:
        raise ValueError(
            f"input_ids must have shape (B, T) with T >= 1, got {v.describe(input_ids)}"
        )
    B, T = input_ids.shape
    device = input_ids.device
    _check_ids("input_ids", input_ids, (B, T), device)
    scored = torch.ones(B, T - 1, dtype=torch.bool, device=device)
    real = None
    if attention_mask is not None:
        real = _check_bool_or_ids("attention_mask", attention_mask, (B, T), device)
        scored &= real[:, 1:] & real[:, :-1]  # the token and the position predicting it
    if labels is not None:
        _check_ids("labels", labels, (B, T), device)
        scored &= labels[:, 1:] != IGNORE_INDEX
    if response_mask is not None:
        response_mask = v.check_per_token("response_mask", response_mask, (B, T), floating=False)
        if response_mask.dtype != torch.bool:
            raise TypeError(
                "response_mask must be a bool tensor (True = scored), "
                f"got {v.describe(response_mask)}"
            )
        if response_mask.device != device:
            raise ValueError(f"response_mask must be on {device}, got {response_mask.device}")
        scored &= response_mask[:, 1:]
    return scored, real


def scored_positions(
    input_ids: torch.Tensor,
    attention_mask: Optional[torch.Tensor] = None,
    *,
    labels: Optional[torch.Tensor] = None,
    response_mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The (B, T - 1) bool mask of the positions :func:`causal_lm_kl` counts, for the losses and
    rewards built from its outputs (e.g. ``shaped_rewards``, ``next_token_kl``).

    Entry ``[b, t]`` is True where ``attention_mask[b, t]`` and ``attention_mask[b, t + 1]``,
    ``labels[b, t + 1] != -100`` and ``response_mask[b, t + 1]`` all hold (each where given).
    Arguments (B, T) as in :func:`causal_lm_kl`; the same errors.

    >>> import torch
    >>> scored_positions(torch.tensor([[0, 5, 6, 7, 8]]), torch.tensor([[0, 1, 1, 1, 1]]),
    ...                  response_mask=torch.tensor([[False, False, False, True, True]]))
    tensor([[False, False,  True,  True]])
    """
    return _scored(input_ids, attention_mask, labels, response_mask)[0]


def causal_lm_kl(
    policy_model: torch.nn.Module,
    ref_model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: Optional[torch.Tensor] = None,
    *,
    labels: Optional[torch.Tensor] = None,
    response_mask: Optional[torch.Tensor] = None,
    temperature: float = 1.0,
    entropy: bool = False,
    position_ids: Optional[torch.Tensor] = None,
    chunk_rows: Optional[int] = None,
    backend: str = "auto",
    check: bool = True,
) -> TokenStats:
    """Exact per-token KL(π‖ρ), log π(token), log ρ(token) (and H(π)) of two Hugging Face
    causal LMs on one batch, without computing either model's (B, T, V) logits.

    Runs each model's body, takes its last hidden states (final norm applied) and its output
    embedding (weight, bias; a tied embedding is the same tensor), applies the architecture's
    logit transform (Gemma 2's final soft-cap, Cohere's and Granite's scales) and the next-token
    shift, and calls :func:`klpenalty.linear.linear_kl`. Only counted positions go through the
    LM heads; the heads' modules are never called. The reference runs under ``torch.no_grad()``
    unless one of its parameters requires grad (freeze it with ``ref_model.requires_grad_(False)``).

    Alignment: output entry ``[b, t]`` is the distribution after the prefix
    ``input_ids[b, :t + 1]``, scored on the next token ``input_ids[b, t + 1]`` (or
    ``labels[b, t + 1]``): as ``model(...).logits[:, :-1]`` against ``input_ids[:, 1:]``. It
    counts where the token it predicts and its own position are both real
    (``attention_mask[b, t + 1]`` and ``attention_mask[b, t]``), the label is not -100
    (``labels[b, t + 1] != -100``) and ``response_mask[b, t + 1]`` holds, for each argument
    given (:func:`scored_positions` returns this (B, T - 1) mask); elsewhere every output is 0
    (with zero gradient). Example, one left-padded row::

        input_ids       pad   p0    p1    r0    r1        (T = 5)
        attention_mask  0     1     1     1     1
        labels          -100  -100  -100  r0    r1        (or response_mask 0 0 0 1 1)
        output t        0     1     2     3               (T - 1 = 4)
        scores          p0    p1    r0    r1
        counted         no    no    yes   yes

    Position ids: when ``position_ids`` is None and ``attention_mask`` is given they are made
    as ``generate`` makes them (the count of real tokens before each position, 1 on padding),
    so a left-padded row gets the positions it had when it was sampled; a right-padded row gets
    0, 1, 2, ... as without a mask. Pass ``position_ids`` to choose others (e.g. packed rows).

    Args:
        policy_model: a causal LM of a supported architecture (:data:`SUPPORTED_ARCHITECTURES`),
            e.g. ``LlamaForCausalLM``. Gradients flow to its body and head.
        ref_model: the reference, same vocabulary size V (its hidden size and architecture may
            differ).
        input_ids: (B, T) integer tokens, prompt and response.
        attention_mask: optional (B, T) bool or 0/1 integer, 1 = real token (either padding side).
        labels: optional (B, T) integer, Hugging Face style (unshifted; -100 = not scored). The
            tokens scored are ``labels[:, 1:]`` instead of ``input_ids[:, 1:]``.
        response_mask: optional (B, T) bool, True = this token is scored (unshifted, like
            ``input_ids``). May be combined with ``labels``: both must allow a position.
        temperature: > 0; divides both models' (transformed) logits, as in ``full_kl``.
        entropy: also return H(π) per position.
        position_ids: optional (B, T) integer, passed to both bodies as is.
        chunk_rows, backend, check: as in :func:`klpenalty.linear.linear_kl`.

    Returns:
        :class:`klpenalty.TokenStats` ``(kl, logprobs, ref_logprobs, entropy)``, each (B, T - 1)
        float32 (float64 for float64 models), 0 where not counted: ``kl``, ``logprobs`` and
        ``ref_logprobs`` always, ``entropy`` when asked (else None). Differentiable with respect
        to the policy's parameters (and the reference's where they require grad).

    Raises:
        TypeError: a model that is not a Hugging Face causal LM, non-integer ``input_ids`` /
            ``labels`` / ``position_ids``, a float ``attention_mask``, a non-bool
            ``response_mask``, a non-bool ``entropy``.
        ValueError: an architecture not in :data:`SUPPORTED_ARCHITECTURES` (the message names
            its ``config.model_type``), a model without a body or an LM head, vocabulary sizes
            that differ, a policy with a soft-cap and a reference without one, (B, T) arguments
            of another shape or device, an LM head that is not a plain ``nn.Linear`` or not on
            the device of ``input_ids``, temperature ≤ 0, an unknown backend; with ``check``:
            scored labels (or input_ids) outside [0, V), and (from ``linear_kl``) NaN in a
            counted position.
    """
    policy_body, policy_head, policy_type = _model_parts("policy_model", policy_model)
    ref_body, ref_head, ref_type = _model_parts("ref_model", ref_model)
    vocab, ref_vocab = policy_head.weight.shape[0], ref_head.weight.shape[0]
    if vocab != ref_vocab:
        raise ValueError(
            "policy_model and ref_model must have the same vocabulary size V: policy_model "
            f"({policy_type}) LM head {v.describe(policy_head.weight)}, ref_model ({ref_type}) "
            f"LM head {v.describe(ref_head.weight)}"
        )
    if policy_head.softcap is not None and ref_head.softcap is None:
        raise ValueError(
            f"policy_model ({policy_type}) soft-caps its logits and ref_model ({ref_type}) does "
            "not: linear_kl cannot yet leave the reference uncapped while capping the policy"
        )

    counted, real = _scored(input_ids, attention_mask, labels, response_mask)  # (B, T - 1)
    B, T = input_ids.shape
    for name, head in (("policy_model", policy_head), ("ref_model", ref_head)):
        if head.weight.device != input_ids.device:
            raise ValueError(
                f"{name}'s LM head is on {head.weight.device} and input_ids on "
                f"{input_ids.device}: both models' heads must be on the batch's device"
            )
    if position_ids is not None:
        _check_ids("position_ids", position_ids, (B, T), input_ids.device)
    elif real is not None:
        position_ids = generate_position_ids(real)
    temperature = v.check_temperature(temperature)
    if not isinstance(entropy, bool):
        raise TypeError(f"entropy must be a bool, got {type(entropy).__name__}")
    get_backend(backend, input_ids.device)  # an unknown backend fails before the models run
    tokens = (input_ids if labels is None else labels)[:, 1:]  # (B, T - 1)
    if check:  # names the caller's argument (linear_kl's check would say "tokens")
        name, ids = ("input_ids", input_ids) if labels is None else ("labels", labels)
        _check_scored_range(name, ids, counted, vocab)

    policy_hidden = _last_hidden(policy_body, input_ids, attention_mask, position_ids)
    ref_grad = any(p.requires_grad for p in ref_model.parameters())
    with contextlib.nullcontext() if ref_grad else torch.no_grad():
        ref_hidden = _last_hidden(ref_body, input_ids, attention_mask, position_ids)

    return linear_kl(
        policy_hidden[:, :-1],  # (B, T - 1, H_p): position t predicts token t + 1
        policy_head.weight,
        ref_hidden[:, :-1],  # (B, T - 1, H_r)
        ref_head.weight,
        tokens=tokens,
        mask=counted,  # rows not counted never reach the heads
        temperature=temperature,
        policy_bias=policy_head.bias,
        ref_bias=ref_head.bias,
        logit_scale=policy_head.scale,
        softcap=policy_head.softcap,
        ref_logit_scale=ref_head.scale,
        ref_softcap=ref_head.softcap,
        entropy=entropy,
        ignore_index=IGNORE_INDEX,
        chunk_rows=chunk_rows,
        backend=backend,
        check=check,
    )
