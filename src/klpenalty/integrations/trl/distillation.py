"""TRL's on-policy ``DistillationTrainer`` with its divergence computed by klpenalty.

Needs the optional extra: ``pip install 'klpenalty[trl]'``. Use it where you use
``trl.DistillationTrainer``::

    from klpenalty.integrations.trl import DistillationTrainer   # instead of: from trl import ...
    trainer = DistillationTrainer(model, teacher_model, args=DistillationConfig(beta=0.5, ...),
                                  train_dataset=dataset, processing_class=tokenizer)
    trainer = DistillationTrainer(..., divergence="skew_reverse_kl", skew=0.1)  # any kind

**What is computed.** TRL samples completions from the student and minimises, per completion
token, a divergence between the student's next-token distribution π and the teacher's ν, both
``softmax(logits / temperature)`` (``DistillationConfig.temperature``, the sampling
temperature, no T² factor), summed over the loss mask (completion mask × tool mask) and divided
by the generation batch's token count per process (training; TRL's ``num_items_in_batch``) or
by the micro-batch's own count (evaluation). This trainer keeps that reduction, the batches,
the generation and every other step of TRL's trainer, and computes the divergence with
:func:`klpenalty.hf.causal_lm_divergence`: exact over the whole vocabulary, from both models'
last hidden states and heads, no (N, V) logits of either model.

``divergence`` picks the kind (:data:`klpenalty.DIVERGENCES`). Left ``None`` it is the one
TRL's ``beta`` denotes, so a TRL config means the same here: ``beta=0.0`` the forward
KL(ν‖π) (``"forward_kl"``), ``beta=1.0`` the reverse KL(π‖ν) (``"reverse_kl"``, TRL's default),
0 < β < 1 TRL's generalised JSD β·KL(ν‖M) + (1−β)·KL(π‖M) with M = β·ν + (1−β)·π, which is
klpenalty's ``"jsd"`` with the same ``beta``. Given, it decides, ``DistillationConfig.beta`` is
the β of ``"jsd"`` and ``skew`` the λ of ``"skew_forward_kl"`` / ``"skew_reverse_kl"``
(docs/distillation.md has every formula).

**The gradient in the forward.** In training the loss's gradient with respect to each
token's divergence is 1 / TRL's token count; the trainer announces it to the fused head
(``expected_grads``), which forms the student's gradients on the logits of its forward (4
LM-head GEMMs in all instead of 6) and hands them over when the backward receives that
gradient (TRL's loss is not rescaled for gradient accumulation, so it does); otherwise it
recomputes, correct either way.

**The sampler.** TRL samples with ``top_k`` / ``top_p`` / ``min_p`` (the config's, overridden
by ``generation_kwargs``) but its loss compares the *untruncated* π with ν. With
``sampler_support=True`` (the default) the divergence is meant to score π̃, π renormalised on
the sampler's kept set, as klpenalty's :class:`~klpenalty.integrations.trl.GRPOTrainer` does:
the settings go to :func:`~klpenalty.hf.causal_lm_divergence` (the teacher is never
truncated; KL(teacher‖π̃) is +inf wherever the teacher has mass off the kept set, so train a
truncating sampler on a mixture kind or the reverse KL). ``sampler_support=False`` gives TRL's
full-vocabulary loss.

**Where it runs.** The student is handed to :func:`~klpenalty.hf.causal_lm_divergence` as
accelerate holds it (DistributedDataParallel under ``torchrun`` / ``accelerate launch``, a
DeepSpeed engine under ZeRO-3, a ``PeftModel`` inside either) and runs through its wrapper's
own forward, so the gradient is all-reduced or reduce-scattered as for TRL's own loss; the
teacher as TRL prepared it (a ZeRO-3 engine too), frozen; its hidden size may differ from the
student's (the vocabulary must not). Positions are numbered 0..T−1 as TRL's own hidden-state
pass numbers them.

**What raises** (ValueError, naming the option): ``use_liger_kernel=True``; a vision-language
model (a ``ProcessorMixin`` processing class) or multimodal inputs; no teacher model;
``divergence="jsd"`` with ``beta`` 0 or 1. TRL's own refusals
(a PEFT adapter on the LM head, prompt learning, a teacher of another vocabulary) stay.

**Metrics.** TRL's ``entropy`` (the student's mean entropy) is not logged: the divergence pass
does not compute it.

Shape letters: B completions in a micro-batch, T prompt + completion length, L completion
length.
"""

from __future__ import annotations


import torch
from trl import DistillationTrainer as _TRLDistillationTrainer

from ... import _validation as v
from ...distillation import DIVERGENCES, check_kind
from ...hf import causal_lm_divergence
from ._shared import sampler_settings, scoring

__all__ = ["DistillationTrainer", "divergence_of_beta"]

# the keys of TRL's micro-batches that only multimodal models have
_MULTIMODAL_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "pixel_attention_mask",
    "spatial_shapes",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
)


def divergence_of_beta(beta: float) -> str:
    """The klpenalty kind that TRL's ``DistillationConfig.beta`` denotes: 0.0 ``"forward_kl"``
    (KL(teacher‖student)), 1.0 ``"reverse_kl"`` (KL(student‖teacher)), else ``"jsd"`` with the
    same β (the teacher's weight in the mixture)."""
    if not isinstance(beta, (int, float)) or isinstance(beta, bool) or not 0.0 <= beta <= 1.0:
        raise ValueError(f"DistillationConfig.beta must be a number in [0, 1], got {beta!r}")
    if beta == 0.0:
        return "forward_kl"
    if beta == 1.0:
        return "reverse_kl"
    return "jsd"


class DistillationTrainer(_TRLDistillationTrainer):
    """``trl.DistillationTrainer`` whose per-token divergence is klpenalty's (see the module
    docstring).

    Args:
        *args, **kwargs: those of ``trl.DistillationTrainer`` (model, teacher_model,
            args=DistillationConfig, train_dataset, processing_class, peft_config, ...).
        divergence: a kind of :data:`klpenalty.DIVERGENCES`, or None (default): the kind
            ``args.beta`` denotes in TRL (:func:`divergence_of_beta`).
        skew: λ in (0, 1) of ``"skew_forward_kl"`` / ``"skew_reverse_kl"`` (default 0.1).
        sampler_support: score the student on its sampler's kept set where the generation
            truncates (default True; raises where :func:`klpenalty.hf.causal_lm_divergence`
            has no sampler settings); False: the whole vocabulary, as TRL's loss.

    Raises:
        ValueError / TypeError: an unknown ``divergence``, ``skew`` or ``beta`` outside the
            kind's range, and the options listed in the module docstring.
    """

    def __init__(self, *args, divergence: str | None = None, skew: float = 0.1,
                 sampler_support: bool = True, **kwargs) -> None:
        if divergence is not None:
            v.check_choice("divergence", divergence, DIVERGENCES)
        v.check_fraction("skew", skew)
        if not isinstance(sampler_support, bool):
            raise TypeError(f"sampler_support must be a bool, got {type(sampler_support).__name__}")
        self.sampler_support = sampler_support
        config = kwargs.get("args", args[2] if len(args) > 2 else None)
        if getattr(config, "use_liger_kernel", False):  # before TRL's init applies Liger
            raise ValueError(
                "use_liger_kernel=True: klpenalty's DistillationTrainer computes the divergence "
                "itself, from the models' hidden states; set use_liger_kernel=False"
            )
        super().__init__(*args, **kwargs)
        args = self.args
        if self._is_vlm:
            raise ValueError(
                "klpenalty's DistillationTrainer takes text-only models; got a processing_class "
                f"of type {type(self.processing_class).__name__} (a vision-language processor)"
            )
        if self.teacher_model is None:
            raise ValueError("klpenalty's DistillationTrainer needs teacher_model (a causal LM)")
        self.divergence = divergence_of_beta(args.beta) if divergence is None else divergence
        if self.divergence == "jsd" and not 0.0 < args.beta < 1.0:
            raise ValueError(
                f'divergence="jsd" takes its β from DistillationConfig.beta, which must lie in '
                f"(0, 1); got beta={args.beta!r}"
            )
        # the β and λ of causal_lm_divergence (β is used by "jsd" only, λ by the skew KLs)
        self._mixture = {"beta": args.beta if self.divergence == "jsd" else 0.5, "skew": skew}
        check_kind(self.divergence, **self._mixture)
        # TRL leaves the teacher's parameters requiring grad (it runs it under no_grad);
        # frozen, causal_lm_divergence runs it without building a graph
        self.teacher_model.requires_grad_(False)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """TRL's loss on the micro-batch ``inputs`` with klpenalty's divergence: ``model`` (the
        student as the trainer holds it) runs through its own wrapper's forward, so no forward
        redirection is needed."""
        # as TRL: the generated completions' token count, divided by the process count (the
        # per-process loss compensates for DDP's gradient averaging)
        if self.model.training and inputs.get("num_items_in_batch") is not None:
            num_items_in_batch = (inputs["num_items_in_batch"].clamp(min=1.0)
                                  / self.accelerator.num_processes)
        loss = self._divergence_loss(model, inputs, num_items_in_batch)
        return (loss, None) if return_outputs else loss

    def divergence_per_token(self, model, inputs, weight: torch.Tensor | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the divergence at each completion token (B, L) float32, 0 off the loss mask; the
        loss mask (B, L) bool: completion mask × tool mask) of a TRL micro-batch ``inputs``,
        for the student ``model`` as the trainer holds it. ``weight``: the loss's gradient
        with respect to every completion token's divergence (a scalar tensor) where the loss
        is their sum times it: the fused head then forms the student's gradient in its forward
        (``expected_grads`` of :func:`klpenalty.hf.causal_lm_divergence`), and recomputes in
        the backward if the gradients it receives are not those."""
        used = [k for k in _MULTIMODAL_KEYS if inputs.get(k) is not None]
        if used:
            raise ValueError(f"klpenalty's DistillationTrainer takes text-only inputs; got {used}")
        input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        loss_mask = inputs["completion_mask"]
        if "tool_mask" in inputs:
            loss_mask = loss_mask * inputs["tool_mask"]
        loss_mask = loss_mask.bool()
        t, length = input_ids.size(1), loss_mask.size(1)
        response, positions = scoring(input_ids, length)
        response[:, t - length :] = loss_mask  # only the loss's tokens are scored
        extra = sampler_settings(self) if self.sampler_support else {}
        if weight is not None:  # the plan of the values' upstream gradients, (B, T - 1) rows
            planned = torch.zeros(input_ids.size(0), t - 1, dtype=weight.dtype,
                                  device=input_ids.device)
            planned[:, t - 1 - length :] = weight
            planned = planned.reshape(-1)
            extra["expected_grads"] = lambda rows, values: planned[rows]
        self.teacher_model.eval()
        per_token = causal_lm_divergence(
            model,  # as wrapped: its own forward runs (DDP's reducer, ZeRO-3's gathers)
            self.teacher_model,
            input_ids,
            attention_mask,
            self.divergence,
            **self._mixture,
            response_mask=response,
            position_ids=positions,
            temperature=self.temperature,
            **extra,
        )
        return per_token[:, t - 1 - length : t - 1], loss_mask  # entry j scores token j + 1

    def _divergence_loss(self, model, inputs, num_items_in_batch) -> torch.Tensor:
        """Σ of the divergence over the loss mask, divided as TRL divides it: by
        ``num_items_in_batch`` where given, else by the micro-batch's count (at least 1)."""
        weight = None
        if isinstance(num_items_in_batch, torch.Tensor):
            num_items_in_batch = num_items_in_batch.to(inputs["completion_ids"].device)
            if self.model.training and torch.is_grad_enabled():
                # autograd's gradient of Σ / n with respect to each summand: 1 / n
                weight = torch.ones((), dtype=torch.float32,
                                    device=num_items_in_batch.device) / num_items_in_batch
        per_token, mask = self.divergence_per_token(model, inputs, weight)
        total = per_token.sum()
        if num_items_in_batch is None:
            return total / mask.sum().clamp(min=1)
        return total / num_items_in_batch
