"""klpenalty.integrations.trl.DistillationTrainer against TRL's own DistillationTrainer.

Needs the ``trl`` extra (``make test-integrations``; see tests/integrations/conftest.py).
Nothing is downloaded: a one-layer Qwen2 student (hidden size 16) and a teacher of another
hidden size (24), seeded from configs (``trl_setup.py``), the word-level tokenizer there.

On one hand-made micro-batch (left-padded prompts, a completion ended early, a tool mask),
both trainers' ``compute_loss`` run on copies of the same models and the loss and every
student parameter's gradient are compared: for TRL's kinds (its ``beta`` 0, 1 and in
between) against TRL's own loss, for every kind against the float64 reference
(``klpenalty.ops.reference.divergence_reference``) on the models' own logits, reduced as TRL
reduces; in training the gradient comes from the fused head's forward (the planned
gradient handed over), and a loss rescaled after ``compute_loss`` is recomputed. Tolerances: ``tests/tolerances.py``'s float32 entries (both trainers compute the
divergence in float32 from the same float32 hidden states and heads, each within those bounds
of the exact value; the model's own layers run the same float32 ops in every computation).
The runs under torchrun (DDP, ZeRO-3, a LoRA student) are in ``test_trl_torchrun.py``.
"""

from __future__ import annotations

import copy

import pytest
import torch

from klpenalty import DIVERGENCES
from klpenalty.ops.reference import divergence_reference

from ..tolerances import GRAD_REL_TOL, tol

import datasets
import trl

from klpenalty.integrations.trl import DistillationTrainer, distillation, divergence_of_beta

from .trl_setup import PROMPTS, make_tokenizer, student_and_teacher

# TRL 1.16 calls transformers' gradient_checkpointing_* names, deprecated in transformers 5
pytestmark = pytest.mark.filterwarnings("ignore:`.*gradient_checkpointing.*:FutureWarning")

TEMPERATURE = 0.7
SKEW = 0.2


@pytest.fixture(scope="module")
def models():
    return student_and_teacher(teacher_hidden=24)


def make_config(tmp_path, **overrides) -> trl.DistillationConfig:
    config = dict(
        output_dir=str(tmp_path), per_device_train_batch_size=4, max_completion_length=6,
        max_steps=1, learning_rate=1e-2, logging_steps=1, report_to="none", use_cpu=True,
        save_strategy="no", seed=0, disable_tqdm=True, gradient_checkpointing=False,
        bf16=False, temperature=TEMPERATURE,  # TRL turns bf16 autocast on by default
    )
    return trl.DistillationConfig(**{**config, **overrides})


def make_trainer(cls, models, tmp_path, trainer_kwargs=None, **config):
    student, teacher = models
    return cls(
        copy.deepcopy(student), copy.deepcopy(teacher), args=make_config(tmp_path, **config),
        train_dataset=datasets.Dataset.from_dict({"prompt": PROMPTS}),
        processing_class=make_tokenizer(), **(trainer_kwargs or {}),
    )


def batch(tool_mask: bool = True) -> dict:
    """A micro-batch as TRL's _prepare_inputs hands it to compute_loss: prompts left-padded,
    completions right-padded (one ended early), a tool mask hiding two tokens, and the
    generation batch's token count (here as if the batch were half of it)."""
    g = torch.Generator().manual_seed(1)
    prompt_ids = torch.randint(3, 11, (3, 4), generator=g)
    prompt_mask = torch.ones_like(prompt_ids)
    prompt_ids[0, :2], prompt_mask[0, :2] = 0, 0
    completion_ids = torch.randint(3, 11, (3, 5), generator=g)
    completion_mask = torch.ones_like(completion_ids)
    completion_ids[1, 3:], completion_mask[1, 3:] = 0, 0
    out = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask,
           "completion_ids": completion_ids, "completion_mask": completion_mask}
    loss_mask = completion_mask.clone()
    if tool_mask:
        out["tool_mask"] = torch.ones_like(completion_ids)
        out["tool_mask"][2, 1:3] = 0
        loss_mask = loss_mask * out["tool_mask"]
    out["num_items_in_batch"] = loss_mask.sum() * 2
    return out


def loss_and_grads(trainer, inputs, training: bool = True):
    """compute_loss of ``inputs`` and the student's parameter gradients, as a training step
    (or an evaluation: no token count, the micro-batch's own) computes them."""
    model = trainer.model
    model.train(training)
    model.zero_grad(set_to_none=True)
    loss = trainer.compute_loss(model, dict(inputs))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                           if p.grad is not None}


def assert_same(got, expected):
    (loss, grads), (loss_e, grads_e) = got, expected
    assert float(loss_e) > 1e-3  # a divergence to get right
    torch.testing.assert_close(loss, loss_e.to(loss.dtype), **tol(torch.float32))
    assert grads.keys() == grads_e.keys() and grads
    scale = max(float(g.abs().max()) for g in grads_e.values())
    assert scale > 0.0
    rel = GRAD_REL_TOL[torch.float32]
    for name, g in grads_e.items():
        torch.testing.assert_close(grads[name], g.to(grads[name].dtype), rtol=rel,
                                   atol=rel * scale, msg=name)


@pytest.fixture
def handovers(monkeypatch):
    """Whether each backward of the fused head found the gradients it received equal to the
    plan (and handed over the gradient formed in the forward), in order."""
    from klpenalty.linear import kl as lin

    handed = []
    matches = lin._Held.matches
    monkeypatch.setattr(lin._Held, "matches",
                        lambda self, *a: handed.append(matches(self, *a)) or handed[-1])
    return handed


@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_loss_and_gradients_equal_trls(models, tmp_path, beta, training, handovers):
    inputs = batch()
    ours = make_trainer(DistillationTrainer, models, tmp_path / "ours", beta=beta)
    theirs = make_trainer(trl.DistillationTrainer, models, tmp_path / "trl", beta=beta)
    assert ours.divergence == divergence_of_beta(beta)
    assert_same(loss_and_grads(ours, inputs, training), loss_and_grads(theirs, inputs, training))
    # training: the loss's gradient planned, formed in the forward and handed over; evaluation
    # (no token count of the generation batch): no plan, recomputed
    assert handovers == ([True] if training else [])


def test_a_gradient_other_than_the_plan_is_recomputed(models, tmp_path, handovers):
    inputs = batch()
    ours = make_trainer(DistillationTrainer, models, tmp_path / "ours", beta=0.3)
    theirs = make_trainer(trl.DistillationTrainer, models, tmp_path / "trl", beta=0.3)
    results = []
    for trainer in (ours, theirs):
        trainer.model.train()
        loss = trainer.compute_loss(trainer.model, dict(inputs))
        (2.0 * loss).backward()  # as a loss scaled after compute_loss
        results.append((2.0 * loss.detach(), {n: p.grad.clone() for n, p in
                                              trainer.model.named_parameters()}))
    assert handovers == [False]
    assert_same(*results)


def reference_loss_and_grads(models, inputs, kind: str, beta: float, training: bool = True):
    """TRL's reduction of the float64 reference divergence of the models' own logits (the
    student's in float32 with gradients, its head included), and the gradients."""
    student, teacher = (copy.deepcopy(m) for m in models)
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    b, t = ids.shape
    n = inputs["completion_ids"].shape[1]
    keep = slice(t - 1 - n, t - 1)  # logits at j predict token j + 1: the completion's
    positions = torch.arange(t).expand(b, t)
    x = student(input_ids=ids, attention_mask=attention, position_ids=positions).logits[:, keep]
    with torch.no_grad():
        y = teacher(input_ids=ids, attention_mask=attention, position_ids=positions).logits[:, keep]
    mask = (inputs["completion_mask"] * inputs.get("tool_mask", 1)).bool()
    per_token = divergence_reference(x, y, kind, beta=beta, skew=SKEW, temperature=TEMPERATURE)
    total = torch.where(mask, per_token, torch.zeros((), dtype=per_token.dtype)).sum()
    count = inputs["num_items_in_batch"] if training else mask.sum()
    loss = total / count  # one process: TRL divides the token count by 1
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in student.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind", DIVERGENCES)
def test_every_kind_equals_the_float64_reference(models, tmp_path, kind):
    inputs = batch()
    beta = 0.3 if kind == "jsd" else 1.0  # TRL's default beta: the kind given decides
    trainer = make_trainer(DistillationTrainer, models, tmp_path, beta=beta,
                           trainer_kwargs={"divergence": kind, "skew": SKEW})
    assert trainer.divergence == kind
    assert_same(loss_and_grads(trainer, inputs),
                reference_loss_and_grads(models, inputs, kind, beta))


def test_the_sampler_settings_score_the_student_on_its_kept_set(models, tmp_path):
    """A truncating sampler (the config's top_k / top_p, or generation_kwargs overriding them):
    the loss of π̃ on the kept set, finite for a mixture kind and unlike the full vocabulary's;
    sampler_support=False is TRL's full-vocabulary loss."""
    inputs = batch(tool_mask=False)
    jsd = {"divergence": "jsd"}
    kept = loss_and_grads(make_trainer(DistillationTrainer, models, tmp_path / "kept", top_p=0.9,
                                       top_k=4, beta=0.5, trainer_kwargs=jsd), inputs)
    overridden = loss_and_grads(make_trainer(DistillationTrainer, models, tmp_path / "gen",
                                             top_p=0.9, beta=0.5, trainer_kwargs=jsd,
                                             generation_kwargs={"top_k": 4}), inputs)
    assert_same(overridden, kept)
    whole = loss_and_grads(make_trainer(DistillationTrainer, models, tmp_path / "whole",
                                        top_p=0.9, top_k=4, beta=0.5,
                                        trainer_kwargs={**jsd, "sampler_support": False}), inputs)
    assert torch.isfinite(kept[0]) and abs(float(kept[0]) - float(whole[0])) > 1e-4
    assert all(torch.isfinite(g).all() for g in kept[1].values())
    # the whole vocabulary, as TRL's loss: equal to TRL's on the same batch
    ours = make_trainer(DistillationTrainer, models, tmp_path / "ours", top_p=0.9, top_k=4,
                        trainer_kwargs={"sampler_support": False})
    theirs = make_trainer(trl.DistillationTrainer, models, tmp_path / "trl", top_p=0.9, top_k=4)
    assert_same(loss_and_grads(ours, inputs), loss_and_grads(theirs, inputs))


@pytest.mark.parametrize("config, kwargs, match", [
    ({}, {"divergence": "kl"}, "divergence must be one of"),
    ({"beta": 1.0}, {"divergence": "jsd"}, r"DistillationConfig\.beta.*\(0, 1\)"),
    ({}, {"divergence": "skew_forward_kl", "skew": 1.5}, "skew"),
    ({"use_liger_kernel": True}, {}, "use_liger_kernel"),
], ids=["unknown-kind", "jsd-beta-1", "skew", "liger"])
def test_options_it_cannot_honour_raise(models, tmp_path, config, kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_trainer(DistillationTrainer, models, tmp_path, trainer_kwargs=kwargs, **config)


def test_multimodal_inputs_raise(models, tmp_path):
    trainer = make_trainer(DistillationTrainer, models, tmp_path)
    with pytest.raises(ValueError, match="pixel_values"):
        trainer.compute_loss(trainer.model, {**batch(), "pixel_values": torch.zeros(1, 3, 2, 2)})


def test_trains_with_a_teacher_of_another_hidden_size(models, tmp_path, handovers):
    trainer = make_trainer(DistillationTrainer, models, tmp_path, max_steps=2,
                           gradient_accumulation_steps=2, trainer_kwargs={"divergence": "tvd"})
    before = copy.deepcopy(trainer.model.state_dict())
    trainer.train()
    assert trainer.state.global_step == 2
    # TRL's loss is normalised by the generation batch's tokens (transformers does not divide
    # it by the accumulation steps): every loss call's planned gradient is the one received
    assert handovers == [True] * 4
    assert trainer.teacher_model.config.hidden_size != trainer.model.config.hidden_size
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 2 and all(0.0 < x < 1.0 for x in losses)  # a TVD lies in [0, 1]
    moved = {n: float((p - before[n]).abs().max()) for n, p in trainer.model.state_dict().items()}
    assert all(m > 0.0 for m in moved.values()), moved


def test_the_sampler_settings_pass_through_where_the_divergence_takes_them(
        models, tmp_path, monkeypatch):
    # a causal_lm_divergence that takes the sampler's settings: the trainer hands them over
    handed = []
    real = distillation.causal_lm_divergence

    def with_sampler(*args, top_k=None, top_p=None, min_p=None, **kwargs):
        handed.append({"top_k": top_k, "top_p": top_p, "min_p": min_p})
        return real(*args, **kwargs)

    monkeypatch.setattr(distillation, "causal_lm_divergence", with_sampler)
    trainer = make_trainer(DistillationTrainer, models, tmp_path, top_p=0.9,
                           generation_kwargs={"top_k": 4})
    loss_and_grads(trainer, batch())
    assert handed == [{"top_k": 4, "top_p": 0.9, "min_p": None}]
