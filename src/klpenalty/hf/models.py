"""The user's model as it is held: the wrappers (DDP, FSDP1, FSDP2, DeepSpeed ZeRO-3, PEFT), its
body and LM head, the head's weight and bias read inside its own forward, and the logit
transform (scale, soft-cap) of each supported architecture.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple, Optional

import torch



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


# ------------------------------------------------------------------------------ the wrappers
def _fsdp1_type():
    """``FullyShardedDataParallel`` (FSDP1), or None where torch.distributed is missing."""
    if not torch.distributed.is_available():
        return None
    from torch.distributed.fsdp import FullyShardedDataParallel

    return FullyShardedDataParallel


def _fsdp2_type():
    """``FSDPModule`` (the class ``fully_shard`` mixes in), or None."""
    if not torch.distributed.is_available():
        return None
    from torch.distributed.fsdp import FSDPModule

    return FSDPModule


def _class_names(module: object) -> set[str]:
    return {c.__name__ for c in type(module).__mro__}


def _is_peft(module: object) -> bool:
    return "PeftModel" in _class_names(module) and callable(getattr(module, "get_base_model", None))


class _Parts(NamedTuple):
    """A causal LM as the user holds it, and what :func:`causal_lm_kl` needs of it."""

    outer: torch.nn.Module  # what the user passed: its forward is the one called
    lm: torch.nn.Module  # the Hugging Face *ForCausalLM inside
    peft: Optional[torch.nn.Module]  # the PeftModel in between, if any
    heads: tuple[torch.nn.Module, ...]  # the head's modules whose forward is replaced
    sharded: bool  # parameters gathered only inside forward (FSDP1, FSDP2, ZeRO-3)
    zero3: bool
    model_type: str
    scale: float
    softcap: Optional[float]
    vocab: Optional[int]  # the head's out_features (None if it does not say)


_WRAPPERS = "DistributedDataParallel, FullyShardedDataParallel (FSDP1), fully_shard (FSDP2), " \
    "a DeepSpeed engine, an accelerate-prepared model, a PeftModel"


def _model_parts(name: str, model: object) -> _Parts:
    """The causal LM inside ``model``'s wrappers, or a clear error naming ``name`` and the
    wrapper. Reads no parameter value (only modules, configs and parameter attributes)."""
    chain: list[str] = []
    m, peft = model, None
    ddp, fsdp1 = torch.nn.parallel.DistributedDataParallel, _fsdp1_type()
    for _ in range(16):  # wrappers nest a few levels at most
        if not isinstance(m, torch.nn.Module):
            raise TypeError(
                f"{name} must be a Hugging Face causal LM (a torch.nn.Module such as "
                f"LlamaForCausalLM, or one in {_WRAPPERS}), got {type(m).__name__}"
                + (f" inside {' > '.join(chain)}" if chain else "")
            )
        names = _class_names(m)
        if isinstance(m, torch.nn.DataParallel):
            raise ValueError(
                f"{name} is a torch.nn.DataParallel, which klpenalty.hf cannot run (it "
                "replicates the model in threads at every call): use DistributedDataParallel"
            )
        if isinstance(m, ddp) or (fsdp1 is not None and isinstance(m, fsdp1)) \
                or "DeepSpeedEngine" in names:
            chain.append(type(m).__name__)
            m = m.module
            continue
        if _is_peft(m):
            chain.append(type(m).__name__)
            peft = m
            m = m.get_base_model()
            continue
        if "OptimizedModule" in names and isinstance(getattr(m, "_orig_mod", None),
                                                     torch.nn.Module):
            raise ValueError(
                f"{name} is a torch.compile'd module (OptimizedModule): pass the module before "
                "torch.compile (klpenalty.hf replaces its LM head's forward for one call)"
            )
        break
    where = f"{name} ({' > '.join([*chain, type(m).__name__])})"
    config = getattr(m, "config", None)
    model_type = getattr(config, "model_type", None)
    get_head = getattr(m, "get_output_embeddings", None)
    if not isinstance(model_type, str) or not callable(get_head):
        inner = getattr(m, "module", None)
        if isinstance(inner, torch.nn.Module):
            raise TypeError(
                f"{where} is a wrapper klpenalty.hf does not know (it holds .module = "
                f"{type(inner).__name__}); supported: {_WRAPPERS}"
            )
        raise TypeError(
            f"{where} has no config.model_type or get_output_embeddings(): pass a Hugging "
            f"Face causal LM such as LlamaForCausalLM (plain or in {_WRAPPERS})"
        )
    if model_type not in _TRANSFORMS:
        raise ValueError(
            f"{where} has config.model_type={model_type!r}, whose LM-head logit transform "
            f"klpenalty.hf does not know; supported: {list(SUPPORTED_ARCHITECTURES)}"
        )
    head = get_head()
    if not isinstance(head, torch.nn.Module):
        raise ValueError(
            f"{where}, model_type {model_type!r}, must be a causal LM with an LM head "
            "(get_output_embeddings()), e.g. LlamaForCausalLM rather than LlamaModel"
        )
    fsdp2 = _fsdp2_type()
    sharded = any(
        (fsdp1 is not None and isinstance(x, fsdp1)) or (fsdp2 is not None and isinstance(x, fsdp2))
        for x in (model, *m.modules())
    )
    zero3 = any(hasattr(p, "ds_id") for p in head.parameters())
    heads = _head_modules(where, head, zero3)
    scale, softcap = _TRANSFORMS[model_type](config)
    vocab = getattr(heads[0], "out_features", None)
    return _Parts(model, m, peft, heads, sharded or zero3, zero3, model_type, scale, softcap,
                  vocab if isinstance(vocab, int) else None)


def _is_lora(module: torch.nn.Module) -> bool:
    return all(hasattr(module, a) for a in ("base_layer", "lora_A", "lora_B", "scaling"))


def _head_modules(where: str, head: torch.nn.Module, zero3: bool) -> tuple[torch.nn.Module, ...]:
    """The modules of the LM head whose forward computes its logits: the head itself (an
    ``nn.Linear`` or a PEFT LoRA layer), the module an FSDP1 unit wraps, or every copy a PEFT
    ``modules_to_save`` wrapper may call."""
    fsdp1 = _fsdp1_type()
    while fsdp1 is not None and isinstance(head, fsdp1):
        head = head.module
    if type(head) is torch.nn.Linear or _is_lora(head):
        if _is_lora(head) and zero3:
            raise ValueError(
                f"{where}'s LM head is a PEFT LoRA layer ({type(head).__name__}) under DeepSpeed "
                "ZeRO-3: its base weight is gathered only inside the base layer's own forward, "
                "which the fused KL does not call; leave lm_head out of target_modules, or "
                "merge the adapter (merge_and_unload)"
            )
        return (head,)
    if "ModulesToSaveWrapper" in _class_names(head):
        linears = tuple(x for x in head.modules() if type(x) is torch.nn.Linear or _is_lora(x))
        if linears and not any(_is_lora(x) for x in linears):
            return linears
    raise ValueError(
        f"{where}'s LM head (get_output_embeddings()) is {type(head).__name__}, not an "
        "nn.Linear, a PEFT LoRA layer or modules_to_save copy of one: klpenalty.hf computes "
        "the head's logits itself and would silently drop what this module's forward adds"
    )


def _head_weight(module: torch.nn.Module) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(weight (V, H), bias (V,) or None) of a head module, read inside its forward: a LoRA
    layer's effective weight W + Σ scaling·B A of its active adapters (a (V, H) temporary),
    or its base weight where adapters are disabled or merged."""
    if not _is_lora(module):
        return module.weight, module.bias
    base = module.base_layer
    weight = base.weight
    if getattr(module, "disable_adapters", False) or getattr(module, "merged", False):
        return weight, base.bias
    for a in module.active_adapters:
        if a not in module.lora_A:
            continue
        if getattr(module, "use_dora", {}).get(a) or getattr(module, "lora_bias", {}).get(a):
            raise ValueError(
                f"the LM head's LoRA adapter {a!r} uses DoRA or a LoRA bias, which "
                "klpenalty.hf does not fold into the head weight: merge it (merge_and_unload)"
            )
        drop = module.lora_dropout[a]
        if isinstance(drop, torch.nn.Dropout) and drop.p > 0 and drop.training:
            raise ValueError(
                f"the LM head's LoRA adapter {a!r} has lora_dropout={drop.p} in training mode: "
                "its output is not a function of one effective weight; use lora_dropout=0"
            )
        delta = module.lora_B[a].weight @ module.lora_A[a].weight  # (V, r) @ (r, H)
        weight = weight + (module.scaling[a] * delta).to(weight.dtype)
    return weight, base.bias


# model_type -> the attributes set for one call so that the model's forward returns the
# head's output as is (klpenalty applies these transforms itself, from _TRANSFORMS):
# (on the config?, attribute, neutral value)
_NEUTRAL = {
    "gemma2": ((True, "final_logit_softcapping", None),),
    "cohere": ((False, "logit_scale", 1.0),),
    "granite": ((True, "logits_scaling", 1.0),),
}


_ABSENT = object()


@contextlib.contextmanager
def _head_forward(parts: _Parts, forward_of):
    """Within: each head module's forward is ``forward_of(module)``, and the model's own
    post-head transforms are neutral; both restored on exit, whatever happens."""
    saved = []
    try:
        for on_config, attr, neutral in _NEUTRAL.get(parts.model_type, ()):
            owner = parts.lm.config if on_config else parts.lm
            saved.append((owner, attr, getattr(owner, attr)))
            setattr(owner, attr, neutral)
        for module in parts.heads:
            saved.append((module, "forward", module.__dict__.get("forward", _ABSENT)))
            module.forward = forward_of(module)
        yield
    finally:
        for owner, attr, old in reversed(saved):
            if old is _ABSENT:
                del owner.__dict__[attr]
            else:
                setattr(owner, attr, old)
