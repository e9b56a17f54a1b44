"""TRL's ``GRPOTrainer`` with its KL term chosen by one argument, ``kl_estimator``.

Needs the optional extra: ``pip install 'klpenalty[trl]'`` (a pinned TRL, with transformers,
datasets and accelerate). Use it where you use ``trl.GRPOTrainer``::

    from klpenalty.integrations.trl import GRPOTrainer      # instead of: from trl import ...
    trainer = GRPOTrainer(model, reward_funcs, args=GRPOConfig(beta=0.01, ...),
                          train_dataset=dataset, kl_estimator="exact")

``kl_estimator`` (with ``args.beta`` = β > 0; β = 0 trains without a KL term, as TRL does):

- ``"trl"``: TRL's own term, unchanged: β·k3 per token, k3 = ρ/π − 1 − log(ρ/π), in the loss,
  reduced like the policy loss. With ``use_bias_correction_kl=True`` (TRL 1.16's default) TRL
  multiplies it by its importance ratio π/π_old, which makes its gradient k3_ratio_loss's (the
  per-state reverse-KL gradient, below); with ``False`` (GRPO as published) it is plain k3,
  whose expected gradient at each state is that of the *forward* KL(ρ‖π) (logit gradient
  π − ρ): the gradient of neither sequence KL (:func:`klpenalty.k3_loss`).
- ``"k3_ratio"``: β·:func:`klpenalty.k3_ratio_loss` per token in the same place and with the
  same reduction as TRL's term (the importance weight π/π_old uses TRL's ``old_per_token_logps``).
  Same value as TRL's on-policy; its expected gradient at each state is ∇KL(π(·|s)‖ρ(·|s)):
  the *pathwise* part of ∇KL_seq(π‖ρ) only (the states are held fixed). It equals TRL's
  bias-corrected term except that its weight is per token whatever TRL's
  ``importance_sampling_level``, and its gradient stays finite where k3 overflows.
- ``"exact"`` (default): the exact KL over the whole vocabulary from both models
  (:func:`klpenalty.hf.causal_lm_kl`, which also gives the policy's token log-probs and
  entropies that TRL's loss uses, so the policy runs once), with the gradient of
  β·KL_seq(π‖ρ), KL_seq = E_π[Σ_t KL_t(s_t)] summed over a completion's tokens.

**The exact objective.** With KL_t the exact KL at completion position t, m_t TRL's completion
mask, w_t = exp(log π(a_t|s_t) − log π_old(a_t|s_t)) (1 in value; π_old is the policy that
sampled the batch, TRL's ``old_per_token_logps``) and R_t = Σ_{u>t} m_u·KL_u (detached: the KL
of every later position, the return of :func:`klpenalty.next_token_kl` rewards), the term added
to TRL's policy loss is::

    β · mean over the micro-batch's completions of  Σ_t m_t·KL_t  +  Σ_t m_t·(w_t − sg(w_t))·R_t

(divided by the gradient-accumulation steps, as TRL divides its loss). Its value is β times
the mean exact sequence KL (the second sum is 0 in value). Its gradient is β times the mean of
Σ_t ∇KL_t (the pathwise part, exact: no sampling noise at a given state) plus
Σ_t w_t·R_t·∇log π(a_t|s_t) (the future part: a token answers for the KL of the states it leads
to). On-policy (TRL's default ``num_iterations=1``) its expectation is exactly
β·∇KL_seq(π‖ρ), as :func:`klpenalty.full_kl_reward_and_loss` gives in a PPO loss: the future
part goes straight into the loss as a score-function term instead of through the group-
normalised, clipped advantages, which would rescale it by the group's reward spread. Off-policy
(``num_iterations > 1``) w_t corrects each token to the current policy, not the distribution of
the prefixes, as in PPO. Note the reduction: the exact term is a sum over a completion's tokens
(the sequence KL), not TRL's per-token average, so β here weighs a whole completion; TRL's k3
term under its default ``loss_type="dapo"`` averages over tokens (β_trl ≈ β_exact × the mean
completion length gives a similar pull).

**Metrics** (``kl_estimator != "trl"``; ``"trl"`` logs TRL's own): ``kl``, TRL's per-token
k3 averaged over completion tokens, as TRL logs it; with ``"exact"`` also ``kl_exact``, the
exact KL averaged the same way, ``kl_seq/exact``, the exact KL per completion (Σ_t KL_t,
averaged over completions) and ``kl_seq/k3``, TRL's k3 estimate of the same per-completion KL.

**What "exact" costs.** The reference runs once per generation batch, where TRL runs its
own reference log-prob pass: that pass (:func:`klpenalty.hf.reference_states`) gives TRL its
``ref_per_token_logps`` (and so its logged k3) and leaves the reference's last hidden states
at the completion positions in the batch (``"ref_hidden_states"``, (B, L, H_r), shuffled and
split with the rest), which every loss call of every iteration and step on those rows reuses
with the reference's head: the reference's body never runs in the loss. The policy runs once
per loss call (its log-probs, entropies and the KL come from one fused head). For the loss
types whose per-token gradient is known from the forward's values (``dapo``, ``grpo``,
``bnpo``, ``dr_grpo`` with per-token importance ratios, no two-sided clip ``delta``, no
entropy or off-policy masks, no entropy bonus, no vLLM importance weights) the head forms the
gradient of TRL's loss plus the exact term in its forward (``expected_grads`` of
:func:`klpenalty.linear.linear_kl`: 4 head GEMMs for the policy and 1 for the reference per
loss call) and the backward checks that the gradients it receives are the planned ones
(otherwise, and for the other loss types, it recomputes the logits: correct either way).

**Where "exact" runs.** The trainer hands :func:`klpenalty.hf.causal_lm_kl` the policy as
accelerate holds it (DistributedDataParallel under ``torchrun`` / ``accelerate launch``, even
with one process; a DeepSpeed engine under ZeRO-3) and TRL's reference as TRL prepared it, so
each model runs through its wrapper's own forward and the gradient is all-reduced (DDP) or
reduce-scattered (ZeRO-3) as for TRL's own loss. With a PEFT policy TRL makes no reference model
(``ref_model=None``): the reference is then the policy with its adapters disabled, as TRL's own
reference log-probs are, computed in the same :func:`~klpenalty.hf.causal_lm_kl` call (give
the base model and ``peft_config=``; see the limits).
Gradient checkpointing works (TRL's default for ``use_reentrant``).

**The policy that sampled.** When the generation truncates (``top_k`` / ``top_p`` /
``min_p`` in ``GRPOConfig`` or its ``generation_kwargs``), TRL scores the sampled tokens with
the untruncated π, so its importance ratio to the sampler is the kept mass S < 1 on every cut
position. With ``"exact"`` (β > 0, ``sampler_support=True``, the default) the trainer scores
π̃, π renormalised on the sampler's kept set, everywhere: the old log-probs, the loss's
log-probs and ratios, and the exact KL(π̃‖ρ) (ρ is never truncated). The kept sets are data of
the generation batch, like its tokens: a ``rollout_func`` may return them per completion as
the extra field ``"sampling_mask"`` ((token_ids, offsets) over the completion's tokens, as
vLLM's ``SamplingMask``), else the old log-prob pass builds them with klpenalty's sampler rule
(temperature, then top-k, top-p, min-p, ties kept, as transformers' warpers). They are held in
the batch (``"sampler_support_ids"``, (B, L, K)) and every loss call of every iteration and
step on those rows scores π on the same sets, whatever the weights are then. On-policy without
old log-probs the loss applies the rule to its own logits (the weights that sampled). A
repetition penalty is not replayed by the rule (return the kept sets).
``benchmarks/bench_sampler_ratio.py`` measures the ratio both ways.

**Limits of "exact".** Text-only models of the architectures :func:`klpenalty.hf.causal_lm_kl`
supports, no MoE auxiliary loss, no PEFT adapter named ``"ref"``: TRL's reference when the
model has one, and TRL adds one (a copy of the adapter) when it is given a ``PeftModel`` with
β > 0, so give a PEFT policy as the base model and ``peft_config=``; a ``PeftModel`` or a
``"ref"`` adapter is refused. Positions are numbered 0..T−1 as TRL's own log-prob pass numbers
them. The other two estimators run wherever TRL's trainer runs.

Shape letters: B completions in a micro-batch, T prompt + completion length, L completion
length (TRL's ``logits_to_keep``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from trl import GRPOTrainer as _TRLGRPOTrainer

from ... import _validation as v
from ...hf import ReferenceStates, causal_lm_kl, causal_lm_logprobs, reference_states
from ...rlhf.estimators import sampled_kl
from ...rlhf.gradients import k3_ratio_loss, next_token_kl
from .._common import exact_kl_term
from ._shared import sampler_settings, scoring

__all__ = ["GRPOTrainer", "KL_ESTIMATORS"]

KL_ESTIMATORS = ("exact", "k3_ratio", "trl")

# the keyword arguments of TRL's log-prob pass that only multimodal models use
_MULTIMODAL_ARGS = (
    "pixel_values",
    "image_grid_thw",
    "num_images",
    "pixel_attention_mask",
    "spatial_shapes",
    "num_tiles",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
)


# the generation batch's key holding the reference's last hidden states at the positions that
# score the completion tokens, (B, L, H_r): split and shuffled with the rest of the batch
REF_HIDDEN = "ref_hidden_states"
# a rollout_func's extra field: per completion, the kept sets of the engine's sampler at its
# completion tokens, (token_ids, offsets) in CSR form (vLLM's ``SamplingMask``)
SAMPLING_MASK = "sampling_mask"
# the generation batch's key holding those kept sets, (B, L, K) int64, -1 after a set's end
SUPPORT_IDS = "sampler_support_ids"


@dataclass
class _Capture:
    """What the loss's log-prob pass leaves for the KL term, (B, L) each, and what it is given:
    the reference's cached hidden states (B, L, H_r) of the micro-batch, or None."""

    logprobs: torch.Tensor | None = None
    kl: torch.Tensor | None = None
    ref_hidden: torch.Tensor | None = None
    plan: "_LossPlan | None" = None
    support_ids: torch.Tensor | None = None


# TRL's loss types whose gradient with respect to each token's log-prob is a function of that
# token's values: the clipped surrogate, reduced per token, per sequence or by a constant
_PLANNED_LOSSES = ("dapo", "grpo", "bnpo", "dr_grpo")


class _LossPlan:
    """The upstream gradients TRL's loss (its KL term off) plus the exact KL term will give the
    outputs of :func:`klpenalty.hf.causal_lm_kl`, row by row from the forward's values, for
    :func:`klpenalty.linear.linear_kl`'s ``expected_grads``.

    Per completion token (b, j) with mask m, advantage A, ratio r = exp(log π − log π_old) (1
    on-policy) and TRL's reduction weight c (the loss's ∂/∂(per-token loss)):
    ∂/∂log π = −c·A·r where the unclipped branch of −min(r·A, clip(r)·A) is the one taken
    (or r lies inside the clip range), else 0; plus κ·m·r·R_t, R_t = Σ_{u>t} m_u·KL_u the KL
    still to go (the rows after (b, j) are visited first); ∂/∂KL = κ·m, κ = β / (B·accumulation)
    (the exact term's mean over completions). ``rows`` index (B, T - 1) row-major; the
    completion is its last L columns.
    """

    def __init__(self, trainer, inputs, beta: float, accumulation: float, t: int):
        mask = inputs["completion_mask"]
        if "tool_mask" in inputs:
            mask = mask * inputs["tool_mask"]
        self.mask = mask.bool()
        m = mask.to(torch.float32)
        b, self.length = m.shape
        self.width, self.offset = t - 1, t - 1 - self.length
        adv = inputs["advantages"]
        self.adv = (adv.unsqueeze(1) if adv.dim() == 1 else adv).expand(b, self.length)
        self.old = inputs.get("old_per_token_logps")
        kind = trainer.loss_type
        if kind == "dapo":
            tokens = inputs["num_items_in_batch"].clamp(min=1.0) / trainer.accelerator.num_processes
            weight = m / (tokens * accumulation / trainer.args.steps_per_generation)
        elif kind == "grpo":
            weight = m / m.sum(-1, keepdim=True).clamp(min=1.0) / b / accumulation
        elif kind == "bnpo":
            weight = m / m.sum().clamp(min=1.0) / accumulation
        else:  # dr_grpo
            weight = m / (b * trainer.max_completion_length) / accumulation
        self.weight = weight
        self.kl_weight = m * (beta / accumulation / b)
        self.low, self.high = 1 - trainer.epsilon_low, 1 + trainer.epsilon_high
        self.seen = torch.zeros_like(m)  # (B, L): the KL of the rows visited so far

    def __call__(self, rows: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        b, j = rows // self.width, rows % self.width - self.offset
        kl, lp = out[:, 0].to(self.seen.dtype), out[:, 1].to(self.seen.dtype)
        self.seen[b, j] = kl
        mask = self.mask[b, j]
        zero = torch.zeros((), dtype=lp.dtype, device=lp.device)
        ratio = torch.ones_like(lp) if self.old is None else torch.exp(lp - self.old[b, j])
        adv = self.adv[b, j].to(lp.dtype)
        taken = (ratio * adv < ratio.clamp(self.low, self.high) * adv) \
            | ((ratio >= self.low) & (ratio <= self.high))
        policy = torch.where(taken, -adv * ratio, zero) * self.weight[b, j]
        to_go = next_token_kl(self.seen, self.mask).flip(-1).cumsum(-1).flip(-1)[b, j]
        w = torch.exp(torch.where(mask, lp - (lp if self.old is None else self.old[b, j]), zero))
        grads = out.new_zeros(out.shape)
        grads[:, 0] = self.kl_weight[b, j]
        grads[:, 1] = policy + torch.where(mask, self.kl_weight[b, j] * w * to_go, zero)
        return grads


def _adapters_disabled(model: torch.nn.Module) -> bool:
    """Whether a PEFT model's LoRA layers are disabled now (TRL's reference pass of a PEFT
    policy runs inside ``disable_adapter()``)."""
    for m in model.modules():
        if hasattr(m, "lora_A") and hasattr(m, "disable_adapters"):
            return bool(m.disable_adapters)
    return False


def _text_only(compute_aux_loss: bool, multimodal: dict) -> None:
    used = [k for k in _MULTIMODAL_ARGS if multimodal.get(k) is not None]
    if compute_aux_loss or used:
        raise NotImplementedError(
            'kl_estimator="exact" supports text-only models without an MoE auxiliary loss; '
            f"got {used or ['compute_aux_loss=True']}"
        )


def _kept_sets(mask) -> tuple[torch.Tensor, torch.Tensor]:
    """One completion's kept sets as (token_ids, offsets): from a pair, a mapping or an object
    with ``token_ids`` and ``offsets`` (vLLM's ``SamplingMask``)."""
    if isinstance(mask, dict):
        ids, offsets = mask.get("token_ids"), mask.get("offsets")
    elif isinstance(mask, (tuple, list)) and len(mask) == 2:
        ids, offsets = mask
    else:
        ids, offsets = getattr(mask, "token_ids", None), getattr(mask, "offsets", None)
    if ids is None or offsets is None:
        raise TypeError(
            f"a rollout_func's {SAMPLING_MASK!r} must hold, per completion, (token_ids, offsets) "
            f"(a pair, a dict or vLLM's SamplingMask), got {type(mask).__name__}"
        )
    return torch.as_tensor(ids, dtype=torch.long).reshape(-1), \
        torch.as_tensor(offsets, dtype=torch.long).reshape(-1)


def _padded(ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Kept sets in CSR form over n rows as (n, K) int64 padded with -1 (K the largest set)."""
    counts = offsets[1:] - offsets[:-1]
    n, k = counts.numel(), int(counts.max()) if counts.numel() else 0
    out = torch.full((n, max(k, 1)), -1, dtype=torch.long, device=ids.device)
    row = torch.repeat_interleave(torch.arange(n, device=ids.device), counts)
    out[row, torch.arange(ids.numel(), device=ids.device) - offsets[row]] = ids.long()
    return out


def _padded_kept_sets(masks, lengths: list[int], width: int, device) -> torch.Tensor:
    """The engine's kept sets of B completions, (B, L, K) int64 padded with -1 (K the largest
    set): one row per completion token, split and shuffled with the rest of TRL's batch."""
    sets = [_kept_sets(m) for m in masks]
    if len(sets) != len(lengths):
        raise ValueError(
            f"a rollout_func's {SAMPLING_MASK!r} must have one entry per completion: got "
            f"{len(sets)} for {len(lengths)} completions"
        )
    for i, ((ids, offsets), n) in enumerate(zip(sets, lengths)):
        if offsets.numel() < n + 1 or offsets[0] != 0 or offsets[-1] != ids.numel() \
                or bool((offsets[1:] < offsets[:-1]).any()):
            raise ValueError(
                f"{SAMPLING_MASK!r} of completion {i}: offsets (L_i + 1,) must run from 0 to "
                f"len(token_ids) = {ids.numel()}, non-decreasing, over its {n} tokens; got "
                f"{offsets.numel()} offsets"
            )
    # one CSR over the B·L completion positions (empty sets after a completion's end)
    counts = torch.zeros(len(sets), width, dtype=torch.long)
    for i, ((_, offsets), n) in enumerate(zip(sets, lengths)):
        counts[i, :n] = offsets[1 : n + 1] - offsets[:n]
    ids = torch.cat([ids[: offsets[n]] for (ids, offsets), n in zip(sets, lengths)])
    offsets = torch.cat([counts.new_zeros(1), counts.reshape(-1).cumsum(0)])
    return _padded(ids, offsets).reshape(len(sets), width, -1).to(device)


def _support_of(padded: torch.Tensor, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, offsets) over the B·(T − 1) positions of :func:`klpenalty.hf.causal_lm_kl` from
    (B, L, K) padded kept sets at the last L positions (empty sets elsewhere)."""
    b, length, _ = padded.shape
    if length > t - 1:
        raise ValueError(
            f"the kept sets of {length} completion tokens do not fit a batch of {t} tokens"
        )
    valid = padded >= 0
    counts = padded.new_zeros(b, t - 1)
    counts[:, t - 1 - length :] = valid.sum(-1)
    offsets = torch.cat([counts.new_zeros(1), counts.reshape(-1).cumsum(0)])
    return padded[valid], offsets


class GRPOTrainer(_TRLGRPOTrainer):
    """``trl.GRPOTrainer`` whose KL term is ``kl_estimator`` (see the module docstring).

    Args:
        *args, **kwargs: those of ``trl.GRPOTrainer`` (model, reward_funcs, args=GRPOConfig,
            train_dataset, processing_class, ...), unchanged.
        kl_estimator: ``"exact"`` (default), ``"k3_ratio"`` or ``"trl"``.
        sampler_support: with ``"exact"``, score the policy that really sampled: π̃, π
            renormalised on the sampler's kept set (a rollout_func's ``"sampling_mask"``, else
            the config's ``top_k`` / ``top_p`` / ``min_p``), in the old log-probs, the loss's
            log-probs and the KL (default True; False: TRL's untruncated π).

    Raises:
        ValueError: an unknown ``kl_estimator``, or ``"exact"`` with β > 0 and a PEFT policy
            whose reference is an adapter named ``"ref"`` (as TRL makes it for a ``PeftModel``).
    """

    def __init__(self, *args, kl_estimator: str = "exact", sampler_support: bool = True,
                 **kwargs) -> None:
        self.kl_estimator = v.check_choice("kl_estimator", kl_estimator, KL_ESTIMATORS)
        if not isinstance(sampler_support, bool):
            raise TypeError(f"sampler_support must be a bool, got {type(sampler_support).__name__}")
        self.sampler_support = sampler_support
        # the engine's kept sets of the generation batch being scored, (B, L, K), or None
        self._sampling_pending: torch.Tensor | None = None
        self._scoring_batch = False
        self._kl_capture: _Capture | None = None
        # the reference pass of the generation batch being scored: its hidden states (B_i,
        # L, H_r) per scoring chunk, and its head (weight, bias, scale, softcap), reused by
        # every loss call on the batch's rows
        self._ref_pending: list[torch.Tensor] | None = None
        self._ref_head: tuple | None = None
        super().__init__(*args, **kwargs)
        exact = self.kl_estimator == "exact" and self.beta != 0.0
        if exact and self.ref_model is None and "ref" in getattr(self.model, "peft_config", {}):
            # TRL's reference is then that adapter; causal_lm_kl's is the adapters disabled
            raise ValueError(
                'kl_estimator="exact" takes a PEFT policy\'s reference as the policy with its '
                'adapters disabled, but this model has an adapter named "ref", which TRL uses as '
                "the reference (TRL adds it, a copy of the adapter, when it is given a PeftModel "
                "and beta > 0): pass the base model and peft_config=LoraConfig(...) instead, or "
                'use kl_estimator="k3_ratio"'
            )
        if self.ref_model is not None:
            # TRL leaves the reference's parameters requiring grad (it runs it under no_grad);
            # frozen, causal_lm_kl runs it without building a graph
            self.ref_model.requires_grad_(False)

    def _get_per_token_logps_and_entropies(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        **multimodal,
    ):
        """TRL's log-prob pass; inside the loss with ``"exact"``, causal_lm_kl's pass instead.

        Outside :meth:`_compute_loss` (the old and reference log-probs at generation) and for
        the other estimators this is TRL's own pass (the loss's log-probs are kept for the KL
        term). Inside the loss with ``"exact"``, one :func:`klpenalty.hf.causal_lm_kl` call over
        the policy and the reference gives the (B, L) log-probs and entropies TRL's loss uses,
        and keeps the (B, L) exact KL for :meth:`_compute_loss`. ``model`` is the policy as the
        trainer holds it (wrapped by accelerate) and the reference ``self.ref_model`` as TRL
        prepared it, or None for a PEFT policy (its adapters disabled). ``input_ids`` and
        ``attention_mask`` are (B, T); L = ``logits_to_keep``.
        """
        capture = self._kl_capture
        if capture is None and self._ref_pending is not None and self._is_reference(model):
            return self._reference_pass(model, input_ids, attention_mask, logits_to_keep,
                                        batch_size, compute_aux_loss, multimodal)
        if capture is None and self._scoring_batch and self._truncated():
            return self._old_logprobs_pass(model, input_ids, attention_mask, logits_to_keep,
                                           batch_size, compute_entropy, compute_aux_loss,
                                           multimodal)
        if capture is None or self.kl_estimator != "exact":
            out = super()._get_per_token_logps_and_entropies(
                model,
                input_ids,
                attention_mask,
                logits_to_keep,
                batch_size,
                compute_entropy,
                compute_aux_loss,
                **multimodal,
            )
            if capture is not None:
                capture.logprobs = out[0]
            return out
        _text_only(compute_aux_loss, multimodal)
        b, t = input_ids.shape
        response, positions = scoring(input_ids, logits_to_keep)
        reference = self.ref_model  # None: the PEFT policy with its adapters disabled
        if capture.ref_hidden is not None:  # the generation batch's reference pass, cached
            weight, bias, scale, softcap = self._ref_head
            hidden = capture.ref_hidden.new_zeros(b, t, capture.ref_hidden.shape[-1])
            hidden[:, t - 1 - logits_to_keep : t - 1] = capture.ref_hidden
            reference = ReferenceStates(hidden, weight, bias, scale, softcap,
                                        hidden.new_zeros(b, t - 1))
        stats = causal_lm_kl(
            model,  # as wrapped: its own forward runs (DDP's reducer, ZeRO-3's gathers)
            reference,
            input_ids,
            attention_mask,
            response_mask=response,
            temperature=self.temperature,
            entropy=compute_entropy,
            position_ids=positions,
            expected_grads=capture.plan,
            **self._support_args(capture.support_ids, t, logits_to_keep),
        )
        keep = slice(t - 1 - logits_to_keep, t - 1)  # entry j scores token j + 1
        capture.logprobs, capture.kl = stats.logprobs[:, keep], stats.kl[:, keep]
        entropies = stats.entropy[:, keep] if compute_entropy else None
        return capture.logprobs, entropies, None

    def _is_reference(self, model) -> bool:
        """Whether TRL's log-prob pass on ``model`` is its reference pass: the reference model,
        or a PEFT policy with its adapters disabled."""
        if self.ref_model is not None:
            return model is self.ref_model
        return _adapters_disabled(self.accelerator.unwrap_model(model))

    def _sampler(self) -> dict:
        """The generation's truncating settings as ``top_k`` / ``top_p`` / ``min_p`` keywords
        (those that cut; empty when none does), read where TRL's generation reads them."""
        return sampler_settings(self)

    def _truncated(self) -> bool:
        """Whether the policy's log-prob passes score π̃ rather than π."""
        return (self.kl_estimator == "exact" and self.beta != 0.0 and self.sampler_support
                and (self._sampling_pending is not None or bool(self._sampler())))

    def _support_args(self, support_ids: torch.Tensor | None, t: int, length: int) -> dict:
        """causal_lm_kl's / causal_lm_logprobs' support keywords for a (B, T) batch whose last
        ``length`` tokens are the completions: the engine's kept sets where the rollout gave
        them, else the sampler's settings."""
        if self.kl_estimator != "exact" or not self.sampler_support:  # (β is 0 in the loss)
            return {}
        if support_ids is not None:
            if support_ids.shape[1] != length:
                raise ValueError(
                    f"the rollout's kept sets cover {support_ids.shape[1]} completion tokens per "
                    f"row, the batch scores {length}"
                )
            return {"support": _support_of(support_ids, t)}
        return self._sampler()

    def _old_logprobs_pass(self, model, input_ids, attention_mask, logits_to_keep, batch_size,
                           compute_entropy, compute_aux_loss, multimodal):
        """TRL's no-grad log-prob pass of the policy at generation (its old log-probs) with
        ``"exact"`` and a truncating sampler: log π̃, as the loss will score it."""
        _text_only(compute_aux_loss, multimodal)
        batch_size = batch_size or input_ids.size(0)
        keep = slice(input_ids.size(1) - 1 - logits_to_keep, input_ids.size(1) - 1)
        logps, entropies, made = [], [], []
        for start in range(0, input_ids.size(0), batch_size):
            rows = slice(start, start + batch_size)
            ids, mask = input_ids[rows], attention_mask[rows]
            response, positions = scoring(ids, logits_to_keep)
            replayed = self._sampling_pending is not None
            kept = self._sampling_pending[rows] if replayed else None
            stats = causal_lm_logprobs(
                model, ids, mask, response_mask=response, position_ids=positions,
                temperature=self.temperature, entropy=compute_entropy,
                return_support=not replayed,
                **self._support_args(kept, ids.size(1), logits_to_keep),
            )
            if not replayed:  # the sampler's kept sets, held for every later loss call
                stats, sets = stats
                b, t = ids.shape
                made.append(_padded(*sets).reshape(b, t - 1, -1)[:, keep])
            logps.append(stats.logprobs[:, keep])
            if compute_entropy:
                entropies.append(stats.entropy[:, keep])
        if made:  # the rule's kept sets, padded alike
            k = max(m.shape[-1] for m in made)
            self._sampling_pending = torch.cat(
                [torch.nn.functional.pad(m, (0, k - m.shape[-1]), value=-1) for m in made])
        return torch.cat(logps), torch.cat(entropies) if compute_entropy else None, None

    def _reference_pass(self, model, input_ids, attention_mask, logits_to_keep, batch_size,
                        compute_aux_loss, multimodal):
        """TRL's reference log-prob pass with ``"exact"``: one forward of the reference per
        generation batch (as TRL's), whose log-probs TRL keeps as ``ref_per_token_logps`` and
        whose last hidden states and head the loss reuses (:func:`klpenalty.hf.reference_states`)."""
        _text_only(compute_aux_loss, multimodal)
        batch_size = batch_size or input_ids.size(0)
        keep = slice(input_ids.size(1) - 1 - logits_to_keep, input_ids.size(1) - 1)
        logps = []
        for start in range(0, input_ids.size(0), batch_size):
            ids, mask = input_ids[start : start + batch_size], attention_mask[start : start + batch_size]
            response, positions = scoring(ids, logits_to_keep)
            states = reference_states(
                model, ids, mask, response_mask=response, position_ids=positions,
                temperature=self.temperature,
            )
            self._ref_pending.append(states.hidden[:, keep])  # (B_i, L, H_r)
            self._ref_head = (states.weight, states.bias, states.scale, states.softcap)
            logps.append(states.logprobs[:, keep])
        return torch.cat(logps), None, None

    def _generate_and_score_completions(self, inputs):
        """TRL's generation and scoring; with ``"exact"`` (β > 0) the reference pass also
        leaves the reference's last hidden states in the batch (``"ref_hidden_states"``, (B, L,
        H_r)) for the loss calls of every iteration and step on these rows."""
        if self.kl_estimator != "exact" or self.beta == 0.0:
            return super()._generate_and_score_completions(inputs)
        rollout = self.rollout_func
        if rollout is not None and self.sampler_support:
            self.rollout_func = self._replaying(rollout)
        self._ref_pending = []
        self._scoring_batch = True
        try:
            output = super()._generate_and_score_completions(inputs)
            pending, kept = self._ref_pending, self._sampling_pending
        finally:
            self._ref_pending, self._sampling_pending = None, None
            self._scoring_batch, self.rollout_func = False, rollout
        if pending:
            output[REF_HIDDEN] = torch.cat(pending)
        if kept is not None:
            output[SUPPORT_IDS] = kept
        return output

    def _replaying(self, rollout):
        """``rollout`` whose output's ``"sampling_mask"`` (when given) becomes the kept sets of
        the batch being scored, before TRL's old log-prob pass runs."""
        def replayed(prompts, trainer):
            output = rollout(prompts, trainer)
            masks = output.get(SAMPLING_MASK) if isinstance(output, dict) else None
            if masks is not None:
                lengths = [len(c) for c in output["completion_ids"]]
                self._sampling_pending = _padded_kept_sets(
                    masks, lengths, max(lengths, default=0), self.accelerator.device)
            return output

        return replayed

    def _compute_loss(self, model, inputs):
        """TRL's policy loss (its KL term off) plus this trainer's KL term, and the metrics."""
        if self.kl_estimator == "trl" or self.beta == 0.0:
            return super()._compute_loss(model, inputs)
        capture = self._kl_capture = _Capture(ref_hidden=inputs.get(REF_HIDDEN),
                                              plan=self._loss_plan(inputs),
                                              support_ids=inputs.get(SUPPORT_IDS))
        beta, self.beta = self.beta, 0.0  # TRL's policy loss, without its KL term
        try:
            loss = super()._compute_loss(model, inputs)
        finally:
            self.beta, self._kl_capture = beta, None
        mask = inputs["completion_mask"]
        if "tool_mask" in inputs:
            mask = mask * inputs["tool_mask"]
        mask = mask.bool()
        logprobs = capture.logprobs
        old = inputs.get("old_per_token_logps")
        old = logprobs.detach() if old is None else old
        ref = inputs["ref_per_token_logps"]
        mode = "train" if self.model.training else "eval"
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1.0
        if self.kl_estimator == "k3_ratio":
            per_token = k3_ratio_loss(logprobs, ref, old_logprobs=old, mask=mask)
            loss = loss + beta * self._reduce_like_trl(per_token, mask, inputs, accumulation)
        else:
            per_sequence = exact_kl_term(capture.kl, logprobs, old, mask)
            loss = loss + beta * per_sequence.mean() / accumulation
        self._log_kl(mode, capture, logprobs.detach(), ref, mask)
        return loss

    def _loss_plan(self, inputs) -> _LossPlan | None:
        """The plan of the loss's per-token gradients (the fused head forms the gradient in its
        forward), where TRL's loss is one whose per-token gradient the plan knows: the loss
        types of ``_PLANNED_LOSSES``, per-token importance ratios, no two-sided clip, no
        entropy or off-policy masks, no entropy bonus, no vLLM importance weights, no MoE
        auxiliary loss. Elsewhere None: the head recomputes its logits in the backward."""
        if self.kl_estimator != "exact" or not (self.model.training and torch.is_grad_enabled()):
            return None
        args = self.args
        plain = (
            self.loss_type in _PLANNED_LOSSES
            and self.importance_sampling_level == "token"
            and getattr(args, "delta", None) is None
            and self.off_policy_mask_threshold is None
            and self.top_entropy_quantile >= 1.0
            and not getattr(self, "_entropy_bonus_enabled", True)
            and not self.aux_loss_enabled
            and not (self.use_vllm and self.vllm_importance_sampling_correction)
        )
        if not plain:
            return None
        t = inputs["prompt_ids"].shape[1] + inputs["completion_ids"].shape[1]
        return _LossPlan(self, inputs, self.beta, self.current_gradient_accumulation_steps, t)

    def _reduce_like_trl(self, per_token, mask, inputs, accumulation):
        """Σ over tokens normalised as TRL normalises its per-token loss for ``loss_type``."""
        masked = per_token * mask
        lengths = mask.sum(-1).clamp(min=1.0)
        kind = self.loss_type
        if kind in ("grpo", "sapo"):
            return (masked.sum(-1) / lengths).mean() / accumulation
        if kind == "bnpo":
            return masked.sum() / mask.sum().clamp(min=1.0) / accumulation
        if kind == "dr_grpo":
            return masked.sum() / (per_token.size(0) * self.max_completion_length) / accumulation
        if kind in ("cispo", "dapo", "vespo"):
            tokens = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            if self.model.training:
                tokens = tokens * accumulation / self.args.steps_per_generation
            return masked.sum() / tokens
        if kind == "luspo":
            return masked.sum(-1).mean() / accumulation
        raise ValueError(f"kl_estimator={self.kl_estimator!r} does not know loss_type={kind!r}")

    def _log_kl(self, mode, capture, logprobs, ref, mask):
        """TRL's k3 metric ``kl``, and with the exact KL its per-token and per-sequence means."""
        k3 = torch.where(mask, sampled_kl(logprobs, ref, "k3", check=False), 0.0)
        sums = [k3.sum(), mask.sum().float()]
        if capture.kl is not None:
            exact = torch.where(mask, capture.kl.detach(), 0.0)
            sums += [exact.sum(), torch.tensor(float(mask.size(0)), device=mask.device)]
        totals = self.accelerator.reduce(torch.stack(sums), reduction="sum")
        tokens = totals[1].clamp(min=1.0)
        metrics = self._metrics[mode]
        metrics["kl"].append((totals[0] / tokens).item())
        if capture.kl is not None:
            sequences = totals[3].clamp(min=1.0)
            metrics["kl_exact"].append((totals[2] / tokens).item())
            metrics["kl_seq/exact"].append((totals[2] / sequences).item())
            metrics["kl_seq/k3"].append((totals[0] / sequences).item())
