"""The KL and log-probs of causal LMs from their last hidden states and heads:
:func:`causal_lm_kl`, :func:`reference_states` (a reference captured once) and
:func:`causal_lm_logprobs` (a no-grad log-prob pass).

Shape letters: B batch, T sequence, V vocabulary, H hidden (each model its own).
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple, Optional

import torch

from .. import _validation as v
from ..functional import TokenStats
from ..linear import linear_kl, linear_logprobs
from ..ops.dispatch import get_backend
from ..sampling import parse_support
from .models import _head_forward, _head_weight, _model_parts, _Parts
from .positions import (
    IGNORE_INDEX,
    _check_head_input,
    _check_scored_range,
    _scored,
    generate_position_ids,
)

class _RefHead(NamedTuple):
    hidden: torch.Tensor  # (B, T, H_r)
    weight: torch.Tensor  # (V, H_r)
    bias: Optional[torch.Tensor]  # (V,)


def _reference_head(ref: _Parts, name: str, kwargs: dict, batch, disabled: bool,
                    frozen: bool = False) -> _RefHead:
    """Run the reference through its own (wrapped) forward with its LM head replaced by a
    capture of what the head receives and of its weight and bias, taken inside the head's
    forward. Under no_grad (unless it has trainable parameters and is neither ``frozen`` nor
    sharded); a sharded weight (FSDP, ZeRO-3) is gathered only there, so it is copied: a
    (V, H_r) tensor."""
    trainable = not (disabled or frozen) and any(p.requires_grad for p in ref.outer.parameters())
    if trainable and ref.sharded:
        raise ValueError(
            f"{name} is sharded ({type(ref.outer).__name__}) and has parameters that require "
            "grad: klpenalty.hf runs a sharded reference frozen; call "
            f"{name}.requires_grad_(False)"
        )
    captured: list[_RefHead] = []

    def forward_of(module):
        def capture(hidden, *args, **kw):
            weight, bias = _head_weight(module)
            _check_head_input(name, hidden, batch, weight)
            if not trainable:
                hidden, weight = hidden.detach(), weight.detach()
                bias = None if bias is None else bias.detach()
                if ref.sharded:  # the gathered storage is freed after this forward
                    weight = weight.clone()
                    bias = None if bias is None else bias.clone()
            captured.append(_RefHead(hidden, weight, bias))
            return hidden[..., :0]

        return capture

    adapters_off = ref.peft.disable_adapter() if disabled else contextlib.nullcontext()
    grad = contextlib.nullcontext() if trainable else torch.no_grad()
    with adapters_off, grad, _head_forward(ref, forward_of):
        ref.outer(**kwargs)
    if len(captured) != 1:
        raise RuntimeError(
            f"{name}'s forward called its LM head {len(captured)} times, not once"
        )
    return captured[0]


class ReferenceStates(NamedTuple):
    """A frozen reference's part of :func:`causal_lm_kl`, captured by one forward of it
    (:func:`reference_states`) and reusable for every later call on the same batch rows.

    ``hidden`` (B, T, H_r) its last hidden states (after the final norm), ``weight`` (V, H_r)
    and ``bias`` (V,) or None its LM head (the module's own tensors, detached; a copy where
    the model is sharded), ``scale`` / ``softcap`` the logit transform of its architecture,
    ``logprobs`` (B, T - 1) log ρ(token) at the scored positions (0 elsewhere), aligned as
    :func:`causal_lm_kl`'s outputs. A subset of the rows is
    ``states._replace(hidden=states.hidden[i], logprobs=states.logprobs[i])``.
    """

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: Optional[torch.Tensor]
    scale: float
    softcap: Optional[float]
    logprobs: torch.Tensor


def reference_states(
    ref_model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: Optional[torch.Tensor] = None,
    *,
    labels: Optional[torch.Tensor] = None,
    response_mask: Optional[torch.Tensor] = None,
    position_ids: Optional[torch.Tensor] = None,
    temperature: float = 1.0,
    disable_adapters: bool = False,
    chunk_rows: Optional[int] = None,
    backend: str = "auto",
    check: bool = True,
) -> ReferenceStates:
    """One no-grad forward of a frozen reference: its last hidden states and LM head for
    :func:`causal_lm_kl`, and its token log-probs log ρ(token), without its (B, T, V) logits.

    Pass the result as ``ref_model`` of :func:`causal_lm_kl` (any number of times: PPO epochs,
    GRPO iterations, gradient-accumulation splits of the same rows) and the reference's body
    never runs again; its head's logits are recomputed chunk by chunk in each call, as they
    are with a model. The model is held and run as in :func:`causal_lm_kl` (plain, DDP, FSDP1,
    FSDP2, ZeRO-3, PEFT); ``disable_adapters=True`` runs a ``PeftModel`` with its adapters
    disabled (the base model as the reference). Kept: (B, T, H_r) hidden states and, for a
    sharded model, a (V, H_r) copy of the head (a plain model's head is used in place).

    Args:
        ref_model: a causal LM of a supported architecture, plain or wrapped.
        input_ids, attention_mask, labels, response_mask, position_ids, temperature,
            chunk_rows, backend, check: as in :func:`causal_lm_kl` (they decide which positions
            are scored and the position ids; give the same ones to the later calls).
        disable_adapters: run a ``PeftModel`` with its adapters disabled.

    Returns:
        :class:`ReferenceStates`; ``logprobs`` (B, T - 1) float32 (float64 for a float64 model).

    Raises:
        TypeError / ValueError: as :func:`causal_lm_kl`, and ``disable_adapters`` with a model
            that is not a ``PeftModel``.
    """
    ref, refh, stats = _no_grad_pass(
        "ref_model", ref_model, input_ids, attention_mask, labels, response_mask, position_ids,
        temperature, disable_adapters, chunk_rows, backend, check,
    )
    return ReferenceStates(refh.hidden, refh.weight, refh.bias, ref.scale, ref.softcap,
                           stats.logprobs)


def causal_lm_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: Optional[torch.Tensor] = None,
    *,
    labels: Optional[torch.Tensor] = None,
    response_mask: Optional[torch.Tensor] = None,
    position_ids: Optional[torch.Tensor] = None,
    temperature: float = 1.0,
    entropy: bool = False,
    support=None,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    min_p: Optional[float] = None,
    disable_adapters: bool = False,
    chunk_rows: Optional[int] = None,
    backend: str = "auto",
    check: bool = True,
    return_support: bool = False,
):
    """One no-grad forward of a causal LM: its token log-probs log π(token) (and H(π)), of the
    policy that really sampled when given its support, without its (B, T, V) logits.

    The values a trainer records at generation (the old log-probs of PPO and GRPO's
    importance ratios), aligned, counted and held as :func:`causal_lm_kl`'s, which gives the
    same values with gradients. The model runs as in :func:`causal_lm_kl` (plain, DDP, FSDP1,
    FSDP2, ZeRO-3, PEFT; ``disable_adapters=True``: a ``PeftModel``'s base model).

    Args:
        model: a causal LM of a supported architecture, plain or wrapped.
        input_ids, attention_mask, labels, response_mask, position_ids, temperature, entropy,
            support, top_k, top_p, min_p, chunk_rows, backend, check: as in
            :func:`causal_lm_kl` (π renormalised on the support).
        disable_adapters: run a ``PeftModel`` with its adapters disabled.
        return_support: also return the kept sets at this forward's logits as ``(ids,
            offsets)`` over the B·(T - 1) positions (empty where not counted): the support
            of the policy that sampled, to replay as ``support=`` in every later pass on
            these rows (a PPO epoch, a GRPO iteration), whatever the weights are then.

    Returns:
        :class:`klpenalty.TokenStats` with ``logprobs`` (B, T - 1) (and ``entropy`` when asked),
        float32 (float64 for a float64 model), 0 where not counted; ``kl`` and
        ``ref_logprobs`` None. Not differentiable. With ``return_support``, the pair
        ``(stats, (ids, offsets))``.

    Raises:
        TypeError / ValueError: as :func:`causal_lm_kl`, and ``disable_adapters`` with a model
            that is not a ``PeftModel``.
    """
    return _no_grad_pass(
        "model", model, input_ids, attention_mask, labels, response_mask, position_ids,
        temperature, disable_adapters, chunk_rows, backend, check, entropy,
        support, top_k, top_p, min_p, return_support,
    )[2]


class _Batch(NamedTuple):
    """A validated (B, T) batch (:func:`_batch`)."""

    counted: torch.Tensor  # (B, T - 1) bool, the scored positions
    tokens: torch.Tensor  # (B, T - 1), the tokens scored (input_ids or labels, shifted)
    kwargs: dict  # the models' forward arguments
    temperature: float


def _batch(input_ids, attention_mask, labels, response_mask, position_ids, temperature, entropy,
           backend, vocab, support, top_k, top_p, min_p, check) -> _Batch:
    """The batch arguments of :func:`causal_lm_kl` and the no-grad passes, checked before any
    model runs: the (B, T) tensors (:func:`_scored`), the position ids (``generate``'s from the
    attention mask where not given), temperature, ``entropy``, the backend, and with the LM
    head's vocabulary ``vocab`` (None: unknown) the support and the scored tokens' range."""
    counted, real = _scored(input_ids, attention_mask, labels, response_mask, position_ids)
    B, T = input_ids.shape
    if position_ids is None and real is not None:
        position_ids = generate_position_ids(real)
    temperature = v.check_temperature(temperature)
    if not isinstance(entropy, bool):
        raise TypeError(f"entropy must be a bool, got {type(entropy).__name__}")
    get_backend(backend, input_ids.device)  # an unknown backend fails before the models run
    tokens = (input_ids if labels is None else labels)[:, 1:]  # (B, T - 1)
    if vocab is not None:
        parse_support(support, top_k, top_p, min_p, (B, T - 1, vocab), input_ids.device)
        if check:  # names the caller's argument (linear_kl's check would say "tokens")
            name, ids = ("input_ids", input_ids) if labels is None else ("labels", labels)
            _check_scored_range(name, ids, counted, vocab)
    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                  use_cache=False)
    return _Batch(counted, tokens, kwargs, temperature)


def _no_grad_pass(name, model, input_ids, attention_mask, labels, response_mask, position_ids,
                  temperature, disable_adapters, chunk_rows, backend, check, entropy=False,
                  support=None, top_k=None, top_p=None, min_p=None, return_support=False):
    """The model run once under no_grad with its head captured (:func:`_reference_head`), and
    its head's token log-probs (and entropy) on the scored positions: (parts, head, stats)."""
    parts = _model_parts(name, model)
    if not isinstance(disable_adapters, bool):
        raise TypeError(f"disable_adapters must be a bool, got {type(disable_adapters).__name__}")
    if disable_adapters and parts.peft is None:
        raise ValueError(
            "disable_adapters=True needs a PeftModel, got "
            f"{type(model).__name__} ({type(parts.lm).__name__} inside)"
        )
    batch = _batch(input_ids, attention_mask, labels, response_mask, position_ids, temperature,
                   entropy, backend, parts.vocab, support, top_k, top_p, min_p, check)
    head = _reference_head(parts, name, batch.kwargs, tuple(input_ids.shape), disable_adapters,
                           frozen=True)
    stats = linear_logprobs(
        head.hidden[:, :-1], head.weight, batch.tokens.masked_fill(~batch.counted, IGNORE_INDEX),
        bias=head.bias, logit_scale=parts.scale, softcap=parts.softcap, mask=batch.counted,
        temperature=batch.temperature, entropy=entropy, support=support, top_k=top_k, top_p=top_p,
        min_p=min_p, chunk_rows=chunk_rows, backend=backend, check=check,
        return_support=return_support,
    )
    return parts, head, stats


def _check_states(states: ReferenceStates, batch: tuple[int, int], device) -> None:
    """A :class:`ReferenceStates` that fits a (B, T) batch on ``device``."""
    h, w = states.hidden, states.weight
    if not (isinstance(h, torch.Tensor) and isinstance(w, torch.Tensor)):
        raise TypeError("ref_model ReferenceStates must hold tensors hidden and weight")
    if h.dim() != 3 or tuple(h.shape[:2]) != batch or w.dim() != 2 \
            or w.shape[1] != h.shape[2]:
        raise ValueError(
            f"ref_model ReferenceStates must hold hidden (B, T, H_r) = ({batch[0]}, "
            f"{batch[1]}, H_r) and weight (V, H_r): got hidden {v.describe(h)}, weight "
            f"{v.describe(w)}"
        )
    if h.device != device or w.device != device:
        raise ValueError(
            f"ref_model ReferenceStates must be on {device}: hidden on {h.device}, weight on "
            f"{w.device}"
        )


def causal_lm_kl(
    policy_model: torch.nn.Module,
    ref_model,
    input_ids: torch.Tensor,
    attention_mask: Optional[torch.Tensor] = None,
    *,
    labels: Optional[torch.Tensor] = None,
    response_mask: Optional[torch.Tensor] = None,
    position_ids: Optional[torch.Tensor] = None,
    temperature: float = 1.0,
    entropy: bool = False,
    support=None,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    min_p: Optional[float] = None,
    chunk_rows: Optional[int] = None,
    backend: str = "auto",
    check: bool = True,
    expected_grads=None,
) -> TokenStats:
    """Exact per-token KL(π‖ρ), log π(token), log ρ(token) (and H(π)) of two Hugging Face
    causal LMs on one batch, without computing either model's (B, T, V) logits.

    Both models are taken as the user holds them: plain, in ``DistributedDataParallel``,
    FSDP1 (``FullyShardedDataParallel``, either ``use_orig_params``), FSDP2 (``fully_shard``),
    a DeepSpeed engine (or its ``.module``, ZeRO-3 included), prepared by accelerate, or a
    ``PeftModel``. Each runs through its outermost wrapper's own forward, with its LM head's
    forward replaced for that one call (and restored after) by what the head receives: the
    reference's head captures its last hidden states and its weight and bias, then the
    policy's head runs :func:`klpenalty.linear.linear_kl` on its own hidden states and weight
    and the reference's. The per-token outputs come out of the policy model's forward as the
    head's output, so the wrapper's hooks see them: DDP's reducer is armed, FSDP and ZeRO-3
    gather the head for the forward and again for the backward, and every parameter gets
    its gradient. No (B, T, V) logits tensor is built.

    Cost of a sharded reference (FSDP, ZeRO-3): its head weight is gathered only inside its
    forward, so a detached copy of it (V × H_r elements, plus the bias) lives until the
    policy's backward is done. A plain or DDP reference's head is used in place. A LoRA
    adapter on the policy's head is folded into one effective weight W + Σ scaling·B A: a
    (V, H_p) temporary kept for the backward.

    The logit transform each architecture's ``forward`` applies after its head (Gemma 2's
    final soft-cap, Cohere's and Granite's scales) is applied by klpenalty (looked up by
    ``config.model_type``), and switched off in the model for the call.

    Alignment: output entry ``[b, t]`` is the distribution after the prefix
    ``input_ids[b, :t + 1]``, scored on the next token ``input_ids[b, t + 1]`` (or
    ``labels[b, t + 1]``): as ``model(...).logits[:, :-1]`` against ``input_ids[:, 1:]``. It
    counts where the token it predicts and its own position are both real
    (``attention_mask[b, t + 1]`` and ``attention_mask[b, t]``), the label is not -100
    (``labels[b, t + 1] != -100``), ``response_mask[b, t + 1]`` holds and no packed sequence
    starts at ``t + 1``, for each argument given (:func:`scored_positions` returns this
    (B, T - 1) mask); elsewhere every output is 0 (with zero gradient). Example, one
    left-padded row::

        input_ids       pad   p0    p1    r0    r1        (T = 5)
        attention_mask  0     1     1     1     1
        labels          -100  -100  -100  r0    r1        (or response_mask 0 0 0 1 1)
        output t        0     1     2     3               (T - 1 = 4)
        scores          p0    p1    r0    r1
        counted         no    no    yes   yes

    Position ids: when ``position_ids`` is None and ``attention_mask`` is given they are made
    as ``generate`` makes them (the count of real tokens before each position, 1 on padding),
    so a left-padded row gets the positions it had when it was sampled; a right-padded row gets
    0, 1, 2, ... as without a mask. Packed (padding-free) rows: pass ``position_ids`` that
    restart at each sequence and no ``attention_mask`` (the model then keeps the sequences
    apart); a position followed by a restart is not scored. Restarts between two real tokens
    of an ``attention_mask`` raise: the model would attend across the sequences.

    Args:
        policy_model: a causal LM of a supported architecture (:data:`SUPPORTED_ARCHITECTURES`),
            e.g. ``LlamaForCausalLM``, plain or in one of the wrappers above. Gradients flow
            to its parameters (its adapters' only, for a ``PeftModel``).
        ref_model: the reference, same vocabulary size V (its hidden size and architecture may
            differ), plain or wrapped (it may be sharded like the policy); or None for a
            ``PeftModel`` policy: the same model with its adapters disabled
            (``disable_adapter()``), run under no_grad; or the :class:`ReferenceStates` of an
            earlier :func:`reference_states` call on the same batch (the reference does not
            run again; it gets no gradient).
        input_ids: (B, T) integer tokens, prompt and response.
        attention_mask: optional (B, T) bool or 0/1 integer, 1 = real token (either padding side).
        labels: optional (B, T) integer, Hugging Face style (unshifted; -100 = not scored). The
            tokens scored are ``labels[:, 1:]`` instead of ``input_ids[:, 1:]``.
        response_mask: optional (B, T) bool, True = this token is scored (unshifted, like
            ``input_ids``). May be combined with ``labels``: both must allow a position.
        position_ids: optional (B, T) integer, passed to both models as is.
        temperature: > 0; divides both models' (transformed) logits, as in ``full_kl``.
        entropy: also return H(π) (H(π̃) with a support).
        support, top_k, top_p, min_p: the policy's sampled support, as in
            :func:`klpenalty.token_stats` (a bool (B, T - 1, V) mask, or ``(ids, offsets)``
            over the B·(T - 1) positions; or the sampler's settings): π is renormalised on it,
            ρ is not truncated.
        chunk_rows, backend, check: as in :func:`klpenalty.linear.linear_kl`.
        expected_grads: the plan of the upstream gradients of the outputs, as in
            :func:`klpenalty.linear.linear_kl`; its ``rows`` index the (B, T - 1) outputs
            row-major (``b·(T - 1) + t``).

    Returns:
        :class:`klpenalty.TokenStats` ``(kl, logprobs, ref_logprobs, entropy)``, each (B, T - 1)
        float32 (float64 for float64 models), 0 where not counted: ``kl``, ``logprobs`` and
        ``ref_logprobs`` always, ``entropy`` when asked (else None). Differentiable with respect
        to the policy's parameters (and a plain reference's where they require grad).

    Raises:
        TypeError: a model that is not a Hugging Face causal LM (or a wrapper klpenalty does
            not know: the message names it), non-integer ``input_ids`` / ``labels`` /
            ``position_ids``, a float ``attention_mask``, a non-bool ``response_mask``, a
            non-bool ``entropy``.
        ValueError: an architecture not in :data:`SUPPORTED_ARCHITECTURES` (the message names
            its ``config.model_type``), a model without an LM head, an LM head that is not an
            ``nn.Linear`` (or a PEFT LoRA / ``modules_to_save`` one), ``DataParallel`` or a
            ``torch.compile``'d module, ``ref_model=None`` with a policy that is not a
            ``PeftModel``, vocabulary sizes that differ, a policy with a soft-cap and a
            reference without one, (B, T) arguments of another shape or device, packed
            ``position_ids`` with an ``attention_mask``, a head that receives anything but
            (B, T, H) hidden states, temperature ≤ 0, an unknown backend, an invalid support;
            with ``check``: scored labels (or input_ids) outside [0, V), NaN in a counted
            position, a sampled token outside the support.
    """
    policy = _model_parts("policy_model", policy_model)
    ref, states = _check_pair(policy, ref_model, input_ids)
    batch = _batch(input_ids, attention_mask, labels, response_mask, position_ids, temperature,
                   entropy, backend, policy.vocab, support, top_k, top_p, min_p, check)
    if states is not None:
        refh = _RefHead(states.hidden, states.weight, states.bias)
    else:
        name = "ref_model" if ref_model is not None else "policy_model (adapters disabled)"
        refh = _reference_head(ref, name, batch.kwargs, tuple(input_ids.shape),
                               ref_model is None)
    return _policy_head(
        policy, ref, refh, batch, entropy=entropy, support=support, top_k=top_k, top_p=top_p,
        min_p=min_p, chunk_rows=chunk_rows, backend=backend, check=check,
        expected_grads=expected_grads,
    )


def _check_pair(policy: _Parts, ref_model, input_ids,
                names: tuple[str, str] = ("policy_model", "ref_model"),
                ) -> tuple[_Parts, Optional[ReferenceStates]]:
    """The reference's parts for :func:`causal_lm_kl` (``ref_model``: a model, None = the
    policy with its adapters disabled, or :class:`ReferenceStates` of the batch ``input_ids``,
    returned too), checked against the policy's: the same vocabulary, no soft-cap on the
    policy alone. ``names``: the caller's names of the two models, for the messages."""
    a, b = names
    states = ref_model if isinstance(ref_model, ReferenceStates) else None
    if states is not None:
        _check_states(states, tuple(input_ids.shape), input_ids.device)
        ref = policy._replace(vocab=states.weight.shape[0], scale=states.scale,
                              softcap=states.softcap, model_type="ReferenceStates")
    elif ref_model is None:
        if policy.peft is None:
            raise ValueError(
                f"{b}=None means the policy with its adapters disabled, which needs a "
                f"PeftModel policy; {a} is {type(policy.outer).__name__}"
                f" ({type(policy.lm).__name__} inside): pass the reference model"
            )
        ref = policy
    else:
        ref = _model_parts(b, ref_model)
    if policy.vocab is not None and ref.vocab is not None and policy.vocab != ref.vocab:
        raise ValueError(
            f"{a} and {b} must have the same vocabulary size V: {a} "
            f"({policy.model_type}) LM head out_features={policy.vocab}, {b} "
            f"({ref.model_type}) LM head out_features={ref.vocab}"
        )
    if policy.softcap is not None and ref.softcap is None:
        raise ValueError(
            f"{a} ({policy.model_type}) soft-caps its logits and {b} "
            f"({ref.model_type}) does not: linear_kl cannot yet leave the reference uncapped "
            "while capping the policy"
        )
    return ref, states


def _policy_head(policy: _Parts, ref: _Parts, refh: _RefHead, batch: _Batch, head=None,
                 names: tuple[str, str] = ("policy_model", "ref_model"),
                 **options) -> TokenStats:
    """Run the policy through its own (wrapped) forward with its LM head replaced by
    :func:`klpenalty.linear.linear_kl` on what the head receives and the reference's captured
    head ``refh``, its per-token columns (B, T - 1, OUT_COLS) returned as the head's output
    (so the wrappers' hooks see them); ``options`` are linear_kl's (entropy, support, ...,
    expected_grads). ``head``: the function run in place of linear_kl, with its arguments,
    returning a TokenStats (None: linear_kl). Mirrors :func:`_reference_head`."""
    head = linear_kl if head is None else head
    a, b = names
    shape = tuple(batch.kwargs["input_ids"].shape)  # (B, T)
    if refh.weight.shape[0] != policy.vocab and policy.vocab is not None:
        raise ValueError(
            f"{a} and {b} must have the same vocabulary size V: {a} "
            f"LM head out_features={policy.vocab}, {b} LM head {v.describe(refh.weight)}"
        )
    made: list[torch.Tensor] = []
    computed: list[bool] = []  # per column: computed (else None in the result)

    def forward_of(module):
        def fused(hidden, *args, **kw):
            if made:
                raise RuntimeError(f"{a}'s forward called its LM head more than once")
            weight, bias = _head_weight(module)
            _check_head_input(a, hidden, shape, weight)
            stats = head(
                hidden[:, :-1],  # (B, T - 1, H_p): position t predicts token t + 1
                weight,
                refh.hidden[:, :-1],  # (B, T - 1, H_r)
                refh.weight,
                tokens=batch.tokens,
                mask=batch.counted,  # rows not counted never reach the heads
                temperature=batch.temperature,
                policy_bias=bias,
                ref_bias=refh.bias,
                logit_scale=policy.scale,
                softcap=policy.softcap,
                ref_logit_scale=ref.scale,
                ref_softcap=ref.softcap,
                ignore_index=IGNORE_INDEX,
                **options,
            )
            computed.extend(f is not None for f in stats)
            zero = torch.zeros_like(stats.kl)
            made.append(torch.stack([zero if f is None else f for f in stats], -1))
            return made[0]  # (B, T - 1, OUT_COLS): the head's output, through the model's forward

        return fused

    with _head_forward(policy, forward_of):
        out = policy.outer(**batch.kwargs)
    if not made:
        raise RuntimeError(f"{a}'s forward did not call its LM head")
    packed = out.logits if hasattr(out, "logits") else out[0]
    if not (isinstance(packed, torch.Tensor) and packed.shape == made[0].shape
            and torch.equal(packed.detach(), made[0].detach())):
        raise RuntimeError(
            f"{a}'s forward ({type(policy.outer).__name__}) changed its LM head's "
            "output before returning it (a logit transform klpenalty.hf does not switch off "
            f"for model_type {policy.model_type!r})"
        )
    return TokenStats(*(packed[..., col].contiguous() if on else None
                        for col, on in enumerate(computed)))
