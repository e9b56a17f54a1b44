"""Two steps of ``GRPOTrainer(kl_estimator="exact")`` or of klpenalty's
``DistillationTrainer`` in the process group torchrun starts.

Run by ``test_trl_torchrun.py``, once per case and world size::

    torchrun --standalone --nproc_per_node N -m tests.integrations.trl_torchrun_worker CASE OUT S

Under torchrun accelerate wraps the policy as a user's launch does: DistributedDataParallel
(gloo, on CPU) for every world size, or a DeepSpeed ZeRO-3 engine for ``zero3`` (the reference
too). The cases (:data:`CASES`): ``ddp``, ``checkpointing`` (gradient checkpointing), ``peft``
(a LoRA policy with TRL's ``ref_model=None``: the reference is the policy with its adapter
disabled; with gradient checkpointing) and ``zero3``; for the distillation trainer (a
one-layer Qwen2 student and a teacher of another hidden size) ``distill-ddp`` (TRL's beta 0.5:
the JSD), ``distill-peft`` (a LoRA student, the skew reverse KL, gradient checkpointing) and
``distill-zero3`` (the student and the teacher ZeRO-3 engines, TRL's beta 0: the forward KL).
A rank still running after S seconds prints its threads' stacks and exits.

Every loss call is recorded on each rank: its batch and the policy's full weights before the
step (gathered under ZeRO-3). After training each rank writes ``OUT/rank{r}.json`` with

- ``kl``: for each loss call, Σ over the completion tokens of the exact KL computed here
  independently, :func:`klpenalty.full_kl` on float64 copies of the models' own logits
  (``model(...).logits`` of a plain model loaded with the recorded weights; for ``peft`` the
  reference's under ``disable_adapter()``), and the token count;
- ``logged``: the trainer's logged ``kl_exact`` per step;
- for the distillation cases ``losses`` instead of ``kl`` and ``logged``: for each loss call,
  the trainer's loss and the same loss computed here independently (TRL's reduction of the
  float64 reference divergence, ``divergence_reference``, of float64 copies of both models'
  own logits: Σ over the rank's loss tokens / (the generation batch's tokens / world size));
- ``gap``: per parameter, the largest difference between this rank's final weights and rank
  0's (all_gather of the full weights), and ``moved``: per trainable parameter, the largest
  change over the run (a parameter that never got a gradient does not move under AdamW);
- ``batch``: the completion ids of each loss call, to show that the ranks trained on
  different batches (else equal weights would prove nothing about the all-reduce);
- ``partitioned``: whether every parameter is an empty placeholder outside a forward (ZeRO-3);
- ``handed``: per backward of the fused head, whether the gradient it received was the planned
  one (so the gradient formed in the forward was handed over).
"""

from __future__ import annotations

import contextlib
import copy
import faulthandler
import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import accelerate
import datasets
import torch
import torch.distributed as dist
import transformers
import trl

from klpenalty import full_kl
from klpenalty.integrations.trl import DistillationTrainer, GRPOTrainer
from klpenalty.linear import kl as lin
from klpenalty.ops.reference import divergence_reference

from .trl_setup import (PROMPTS, llama_config, make_tokenizer, qwen2_config,
                        reference_and_policy, share_of_a, student_and_teacher)

BETA = 0.1
STEPS = 2
CASES = {
    "ddp": {},
    "checkpointing": {"gradient_checkpointing": True},
    "peft": {"peft": True, "gradient_checkpointing": True},
    "zero3": {"zero3": True},
    # distillation: (DistillationConfig.beta, the trainer's divergence argument)
    "distill-ddp": {"distill": (0.5, None)},
    "distill-peft": {"distill": (1.0, "skew_reverse_kl"), "peft": True,
                     "gradient_checkpointing": True},
    "distill-zero3": {"distill": (0.0, None), "zero3": True},
}
SKEW = 0.2
# ZeRO-3 for the policy and (TRL's prepare_deepspeed) the reference; the optimizer is the
# trainer's torch AdamW, which DeepSpeed accepts only with zero_allow_untested_optimizer
# (every parameter partitioned: by default ZeRO-3 keeps parameters under 1e5 elements whole, all
# of this tiny model's)
ZERO3 = {
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "train_micro_batch_size_per_gpu": "auto",
    "train_batch_size": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "zero_allow_untested_optimizer": True,
    "bf16": {"enabled": False},
    "fp16": {"enabled": False},
}


def lora_config():
    import peft

    # random A and B (init_lora_weights=False), scaled by alpha / r = 8: the policy starts away
    # from its reference (the adapters disabled)
    return peft.LoraConfig(
        r=4, lora_alpha=32, target_modules=["q_proj", "v_proj"], init_lora_weights=False,
        task_type="CAUSAL_LM",
    )


def full_weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Copies of all of ``module``'s parameters, gathered first where ZeRO-3 partitions them
    (a collective: every rank calls it)."""
    params = dict(module.named_parameters())
    gather = contextlib.nullcontext()
    if any(hasattr(p, "ds_id") for p in params.values()):
        import deepspeed

        gather = deepspeed.zero.GatheredParameters(list(params.values()))
    with gather:
        return {n: p.detach().clone() for n, p in params.items()}


class Recording(GRPOTrainer):
    """Keeps, for every loss call, the batch and the policy's full weights before the step."""

    records: list

    def _compute_loss(self, model, inputs):
        batch = {k: t.detach().clone() for k, t in inputs.items() if torch.is_tensor(t)}
        weights = full_weights(self.accelerator.unwrap_model(model))
        self.records.append({"inputs": batch, "weights": weights})
        return super()._compute_loss(model, inputs)


class DistillRecording(DistillationTrainer):
    """Keeps, for every loss call, the batch, the student's full weights before the step and
    the loss."""

    records: list

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        batch = {k: t.detach().clone() for k, t in inputs.items() if torch.is_tensor(t)}
        weights = full_weights(self.accelerator.unwrap_model(model))
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        self.records.append({"inputs": batch, "weights": weights, "loss": float(loss.detach())})
        return loss


def plain_model(case: dict, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A float64 model of the policy's (student's) kind (LoRA-wrapped for ``peft``) with
    ``weights``."""
    if case.get("distill"):
        model = transformers.Qwen2ForCausalLM(qwen2_config())
    else:
        model = transformers.LlamaForCausalLM(llama_config())
    if case.get("peft"):
        import peft

        model = peft.get_peft_model(model, lora_config())
    names = dict(model.named_parameters())
    if names.keys() != weights.keys():
        raise RuntimeError(f"parameter names differ: {sorted(names.keys() ^ weights.keys())}")
    with torch.no_grad():
        for n, p in names.items():
            p.copy_(weights[n])
    return model.double().eval()


def recorded_batch(inputs: dict) -> tuple[dict, slice]:
    """The model inputs of a recorded micro-batch (prompt and completion joined, positions
    0..T-1 as TRL's own passes number them) and the slice of the logits that predict the
    completion's tokens (the logits at j predict token j + 1)."""
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    b, t = ids.shape
    n = inputs["completion_ids"].shape[1]
    batch = {"input_ids": ids, "attention_mask": attention,
             "position_ids": torch.arange(t).expand(b, t)}
    return batch, slice(t - 1 - n, t - 1)


def independent_kl(case: dict, record: dict, ref_dir: Path) -> tuple[float, int]:
    """(Σ of the exact KL over the completion tokens, their count) from the models' logits."""
    inputs = record["inputs"]
    batch, keep = recorded_batch(inputs)
    policy = plain_model(case, record["weights"])
    with torch.no_grad():
        x = policy(**batch).logits[:, keep]
        if case.get("peft"):
            with policy.disable_adapter():
                y = policy(**batch).logits[:, keep]
        else:
            ref = transformers.LlamaForCausalLM.from_pretrained(ref_dir).double()
            y = ref(**batch).logits[:, keep]
    mask = inputs["completion_mask"].bool()
    kl = full_kl(x, y, mask=mask)  # (B, L) float64
    return float(kl.sum()), int(mask.sum())


def independent_loss(case: dict, record: dict, teacher: torch.nn.Module, world: int) -> float:
    """The rank's distillation loss of the recorded batch and weights, as TRL reduces it, from
    the float64 reference divergence of float64 copies of both models' logits."""
    inputs = record["inputs"]
    batch, keep = recorded_batch(inputs)
    beta, kind = case["distill"]
    kind = kind or {0.0: "forward_kl", 1.0: "reverse_kl"}.get(beta, "jsd")
    with torch.no_grad():
        x = plain_model(case, record["weights"])(**batch).logits[:, keep]
        y = teacher(**batch).logits[:, keep]
    per_token = divergence_reference(x, y, kind, beta=beta, skew=SKEW)
    mask = inputs["completion_mask"].bool()
    tokens = float(inputs["num_items_in_batch"].clamp(min=1.0)) / world
    return float(torch.where(mask, per_token, 0.0).sum()) / tokens


def make_models(case: dict, ref_dir: Path) -> tuple:
    """The models of ``case``, made before any DeepSpeed or process-group setup: (the policy,)
    with its reference saved to ``ref_dir``, or (the student, the teacher, a float64 copy of
    the teacher)."""
    if case.get("distill"):
        student, teacher = student_and_teacher(teacher_hidden=24)
        return student, teacher, copy.deepcopy(teacher).double().eval()
    return (reference_and_policy(ref_dir),)


def make_trainer(case: dict, models: tuple, args_kwargs: dict, out: Path, rank: int):
    """The trainer of ``case`` on ``models`` (:func:`make_models`)."""
    dataset = datasets.Dataset.from_dict({"prompt": PROMPTS})
    peft_config = lora_config() if case.get("peft") else None
    if case.get("distill"):
        beta, divergence = case["distill"]
        args = trl.DistillationConfig(
            output_dir=str(out / f"run{rank}"), per_device_train_batch_size=4,
            max_completion_length=6, max_steps=STEPS, learning_rate=1e-2, beta=beta,
            **{"gradient_checkpointing": False, **args_kwargs},  # TRL's default: True
        )
        return DistillRecording(
            models[0], models[1], args=args, train_dataset=dataset,
            processing_class=make_tokenizer(), peft_config=peft_config,
            divergence=divergence, skew=SKEW,
        )
    args = trl.GRPOConfig(
        output_dir=str(out / f"run{rank}"), per_device_train_batch_size=4, num_generations=4,
        max_completion_length=6, max_steps=STEPS, learning_rate=1e-2, beta=BETA,
        loss_type="dapo", **args_kwargs,
    )
    return Recording(
        models[0], share_of_a, args=args, train_dataset=dataset,
        processing_class=make_tokenizer(), kl_estimator="exact", peft_config=peft_config,
    )


def main(case_name: str, out: Path, hang_s: float) -> None:
    # a rank still running after hang_s prints where each of its threads is, and exits
    faulthandler.dump_traceback_later(hang_s, exit=True)
    case = CASES[case_name]
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    ref_dir = out / f"ref{rank}"  # the same seeded weights on every rank
    # with PEFT the reference is this policy with its adapters disabled (ref_dir goes unused);
    # its perturbed head makes the adapters' change of the hidden states show in the logits
    models = make_models(case, ref_dir)
    teacher = models[2] if case.get("distill") else None
    config = {}
    if case.get("gradient_checkpointing"):
        config["gradient_checkpointing"] = True
    if case.get("zero3"):
        # DeepSpeed on CPU: accelerate's CPU mode excludes DeepSpeed, and its DeepSpeed mode
        # finds no backend without a GPU. A process state made first with gloo (DeepSpeed's
        # comm on its CPU accelerator) stands in for `accelerate launch --use_deepspeed`.
        # DeepSpeed's CPU backend would also JIT-compile an optional shared-memory collective
        # at its first initialize (a C++ build, minutes here): gloo does without it.
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
        accelerate.PartialState(backend="gloo", timeout=timedelta(seconds=120))
        config["deepspeed"] = ZERO3
        config["accelerator_config"] = {"use_configured_state": True}
    config.update(
        use_cpu=not case.get("zero3"),  # ZeRO-3: on DeepSpeed's CPU accelerator (no GPU here)
        logging_steps=1, report_to="none", save_strategy="no", seed=0, disable_tqdm=True,
        bf16=False, ddp_timeout=120,
    )
    trainer = make_trainer(case, models, config, out, rank)
    trainer.records = []
    handed = []  # per backward of the fused head: the planned gradient handed over
    matches = lin._Held.matches
    lin._Held.matches = lambda self, *a: handed.append(matches(self, *a)) or handed[-1]
    trainer.train()

    unwrapped = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    # ZeRO-3: outside a forward every parameter is an empty placeholder (this rank's shard is
    # in the optimizer)
    partitioned = all(p.numel() == 0 for p in unwrapped.parameters())
    final = full_weights(unwrapped)
    trainable = {n for n, p in unwrapped.named_parameters() if p.requires_grad}
    world = dist.get_world_size()
    gap = {}
    for n, p in final.items():
        everyone = [torch.empty_like(p) for _ in range(world)]
        dist.all_gather(everyone, p.contiguous())
        gap[n] = max(float((w - everyone[0]).abs().max()) for w in everyone)
    first = trainer.records[0]["weights"]
    if case.get("zero3"):  # the plain models below are built unpartitioned
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()
    other = trainer.teacher_model if teacher is not None else trainer.ref_model
    result = {
        "world": world,
        "wrapped": type(trainer.model_wrapped).__name__,
        # the reference (GRPO; None: a PEFT policy's adapters disabled) or the teacher
        "ref_model": type(other).__name__ if other is not None else None,
        "partitioned": partitioned,
        "global_step": trainer.state.global_step,
        "handed": handed,
        "gap": gap,
        "moved": {n: float((final[n] - first[n]).abs().max()) for n in sorted(trainable)},
        "frozen_moved": {
            n: float((final[n] - first[n]).abs().max()) for n in sorted(set(final) - trainable)
        },
        "batch": [r["inputs"]["completion_ids"].tolist() for r in trainer.records],
    }
    if teacher is None:
        result["logged"] = [h["kl_exact"] for h in trainer.state.log_history if "kl_exact" in h]
        result["kl"] = [independent_kl(case, r, ref_dir) for r in trainer.records]
    else:
        result["losses"] = [[r["loss"], independent_loss(case, r, teacher, world)]
                            for r in trainer.records]
    (out / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), float(sys.argv[3]))
