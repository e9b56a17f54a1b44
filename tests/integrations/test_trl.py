"""klpenalty.integrations.trl.GRPOTrainer, run for a few steps on CPU with TRL itself.

Needs the ``trl`` extra: ``make test-integrations`` installs it and runs this file (``make
test`` does not collect it; see tests/integrations/conftest.py). Nothing is downloaded: the
setup of ``trl_setup.py`` (a word-level tokenizer, a randomly initialised one-layer Llama, a toy
reward, eight prompts), in one process (``test_trl_torchrun.py`` runs it under torchrun).

The policy starts away from the reference (its LM head perturbed; the reference is the saved
initial checkpoint, which TRL loads itself from ``config._name_or_path``), so the KL and its
gradient are not 0. Each loss call is recorded (the prepared inputs and the weights before the
step, and the gradient after the backward), and checked against an independent computation
with plain PyTorch on the same weights and batch: the logged exact KL per completion equals
``full_kl`` of the two models' logits, TRL's k3 per completion equals k3 from log_softmax, and
the step's gradient equals the gradient of the documented objective (TRL's policy loss for
``loss_type="dapo"`` on-policy, plus β·mean over completions of Σ_t KL_t + Σ_t (w_t − sg w_t)·R_t).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from klpenalty import full_kl

from ..tolerances import GRAD_REL_TOL, tol

import datasets
import transformers
import trl

from klpenalty.integrations.trl import SUPPORT_IDS, GRPOTrainer

from .trl_setup import PROMPTS, llama_config, make_tokenizer, reference_and_policy, share_of_a

# TRL 1.16 calls transformers' gradient_checkpointing_* names, deprecated in transformers 5
pytestmark = pytest.mark.filterwarnings("ignore:`.*gradient_checkpointing.*:FutureWarning")

BETA = 0.1
STEPS = 3


class Recording(GRPOTrainer):
    """Keeps, for every loss call, the inputs, the weights before the step and the gradient."""

    records: list

    def _compute_loss(self, model, inputs):
        self.records.append(
            {
                "inputs": {k: (t.detach().clone() if torch.is_tensor(t) else t)
                           for k, t in inputs.items()},
                "weights": copy.deepcopy(model.state_dict()),
            }
        )
        return super()._compute_loss(model, inputs)

    def training_step(self, model, inputs, num_items_in_batch):
        # this micro-batch's own gradient, also when gradient accumulation sums several
        before = {n: p.grad.detach().clone() for n, p in model.named_parameters()
                  if p.grad is not None}
        out = super().training_step(model, inputs, num_items_in_batch)
        self.records[-1]["grads"] = {
            n: p.grad.detach() - before.get(n, 0.0)
            for n, p in model.named_parameters() if p.grad is not None
        }
        return out


def train(tmp_path, kl_estimator: str, steps: int = STEPS, before=None, **config) -> Recording:
    config = {"loss_type": "dapo", **config}
    policy = reference_and_policy(tmp_path / "ref")
    dataset = datasets.Dataset.from_dict({"prompt": PROMPTS})
    args = trl.GRPOConfig(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=4,
        max_completion_length=6, max_steps=steps, learning_rate=1e-2, beta=BETA,
        logging_steps=1, report_to="none", use_cpu=True, save_strategy="no", seed=0,
        disable_tqdm=True, bf16=False,  # TRL turns bf16 autocast on by default
        **config,
    )
    trainer = Recording(
        policy, share_of_a, args=args, train_dataset=dataset, processing_class=make_tokenizer(),
        kl_estimator=kl_estimator,
    )
    trainer.records = []
    if before is not None:
        before(trainer)
    trainer.train()
    return trainer


_RUNS: dict[str, Recording] = {}
# run name -> (kl_estimator, GRPOConfig overrides); "trl" is TRL's default, which multiplies its
# k3 by the importance ratio (use_bias_correction_kl=True); "trl-plain" is GRPO's original k3
RUN_SPECS = {
    "exact": ("exact", {}),
    "k3_ratio": ("k3_ratio", {}),
    "trl": ("trl", {}),
    "trl-plain": ("trl", {"use_bias_correction_kl": False}),
    "exact-accumulate2": ("exact", {"gradient_accumulation_steps": 2}),
    # two optimizer steps per generation batch, each taken twice: off-policy ratios, the
    # reference's states cached at generation and reused by four loss calls
    "exact-iterations2": ("exact", {"num_iterations": 2, "steps_per_generation": 2}),
    # sampled with top-k and top-p: the old log-probs, the loss's log-probs and the KL are
    # those of π̃ (π renormalised on the sampler's kept set)
    "exact-top-k-top-p": ("exact", {"top_k": 5, "top_p": 0.9, "num_iterations": 2,
                                    "steps_per_generation": 2}),
}


def run_of(name: str, tmp_path_factory) -> Recording:
    """One training run per RUN_SPECS entry, shared by the tests of this module."""
    if name not in _RUNS:
        kl_estimator, config = RUN_SPECS[name]
        _RUNS[name] = train(tmp_path_factory.mktemp(name), kl_estimator, **config)
    return _RUNS[name]


@pytest.fixture(scope="module")
def exact_run(tmp_path_factory):
    return run_of("exact", tmp_path_factory)


def independent(record, ref_dir, args=None, sampled_by=None):
    """Plain-PyTorch per-completion quantities on the recorded batch and weights; with the
    trainer's ``args`` sampling with top-k / top-p, the policy's are those of π̃: π
    renormalised on the kept sets that transformers' own warpers (what generate sampled from)
    give at the weights that sampled the batch (the record ``sampled_by``, else this one)."""
    inputs = record["inputs"]
    policy = transformers.LlamaForCausalLM(llama_config())
    policy.load_state_dict(record["weights"])
    ref = transformers.LlamaForCausalLM.from_pretrained(ref_dir)
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    b, t = ids.shape
    n = inputs["completion_ids"].shape[1]
    positions = torch.arange(t).expand(b, t)  # as TRL's own log-prob pass numbers them
    keep = slice(t - 1 - n, t - 1)  # logits at j predict token j + 1: the completion's
    x = policy(input_ids=ids, attention_mask=attention, position_ids=positions).logits[:, keep]
    with torch.no_grad():
        y = ref(input_ids=ids, attention_mask=attention, position_ids=positions).logits[:, keep]
    mask = inputs["completion_mask"].bool()
    tokens = inputs["completion_ids"].unsqueeze(-1)
    kept = torch.ones_like(x, dtype=torch.bool)
    if args is not None and (args.top_k or args.top_p < 1.0):
        sampler = policy
        if sampled_by is not None:
            sampler = transformers.LlamaForCausalLM(llama_config())
            sampler.load_state_dict(sampled_by["weights"])
        with torch.no_grad():
            z = sampler(input_ids=ids, attention_mask=attention, position_ids=positions).logits
        scores = z[:, keep].reshape(-1, x.shape[-1])
        if args.top_k:
            scores = transformers.TopKLogitsWarper(args.top_k)(None, scores)
        if args.top_p < 1.0:
            scores = transformers.TopPLogitsWarper(args.top_p)(None, scores)
        kept = torch.isfinite(scores).reshape(x.shape)
    pa = torch.log_softmax(x.masked_fill(~kept, float("-inf")), -1)
    qa = torch.log_softmax(y, -1)
    lp = pa.gather(-1, tokens).squeeze(-1)
    ref_lp = qa.gather(-1, tokens).squeeze(-1)
    safe = torch.where(kept, pa, torch.zeros(()))  # off the kept set: no NaN in the backward
    kl = torch.where(kept, safe.exp() * (safe - qa), torch.zeros(())).sum(-1)
    return policy, x, y, lp, ref_lp, kl, mask


def logged(trainer, key):
    return [h[key] for h in trainer.state.log_history if key in h]


def test_run_completes_and_logs_both_kls(exact_run):
    assert exact_run.state.global_step == STEPS
    assert len(exact_run.records) == STEPS and all("grads" in r for r in exact_run.records)
    for key in ("kl", "kl_exact", "kl_seq/exact", "kl_seq/k3", "loss"):
        assert len(logged(exact_run, key)) == STEPS, key
    assert all(v > 0 for v in logged(exact_run, "kl_seq/exact"))
    # padding is exercised: some completion ended early
    assert any(bool((~r["inputs"]["completion_mask"].bool()).any()) for r in exact_run.records)


def test_logged_exact_kl_equals_full_kl_on_the_same_batch(exact_run, tmp_path_factory):
    ref_dir = exact_run.model.config._name_or_path
    for record, kl_seq, k3_seq in zip(
        exact_run.records, logged(exact_run, "kl_seq/exact"), logged(exact_run, "kl_seq/k3")
    ):
        _, x, y, lp, ref_lp, _, mask = independent(record, ref_dir)
        kl = full_kl(x.detach(), y, mask=mask)
        expected = float(kl.sum(-1).mean())
        assert kl_seq == pytest.approx(expected, **_approx())
        d = ref_lp - lp.detach()
        k3 = torch.where(mask, torch.exp(d) - 1 - d, torch.zeros(()))
        assert k3_seq == pytest.approx(float(k3.sum(-1).mean()), **_approx())
        # and the exact KL differs from TRL's estimate on this batch
        assert abs(kl_seq - k3_seq) > 1e-3


def _approx():
    atol, rtol = tol(torch.float32)["atol"], tol(torch.float32)["rtol"]
    return {"abs": atol, "rel": rtol}


def kl_objective(name, lp, ref_lp, kl, mask, ratio, tokens, accumulation):
    """The documented KL term of each run, in plain PyTorch (before β)."""
    zero = torch.zeros(())
    if name.startswith("exact"):
        # mean over completions of Σ_t KL_t + Σ_t (w_t − sg w_t)·R_t, R_t = Σ_{u>t} KL_u,
        # divided by the accumulation steps as TRL divides its loss
        kl_m = torch.where(mask, kl, zero)
        to_go = (kl_m.sum(-1, keepdim=True) - kl_m.cumsum(-1)).detach()
        per_seq = (kl_m + torch.where(mask, (ratio - ratio.detach()) * to_go, zero)).sum(-1)
        return per_seq.mean() / accumulation
    d = ref_lp - lp
    per_token = torch.exp(d) - 1 - d  # TRL's k3 as GRPO has it ("trl-plain")
    if name in ("k3_ratio", "trl"):
        # w·k3, w = π/sg π: gradient w·k1·∇log π (TRL's default multiplies by its ratio too)
        per_token = ratio * per_token
    return torch.where(mask, per_token, zero).sum() / tokens


@pytest.mark.parametrize("name", list(RUN_SPECS))
def test_step_gradient_is_the_documented_objectives(name, tmp_path_factory):
    trainer = run_of(name, tmp_path_factory)
    ref_dir = trainer.model.config._name_or_path
    every = trainer.args.steps_per_generation * trainer.num_iterations  # loss calls per batch
    for i, record in enumerate(trainer.records):
        inputs = record["inputs"]
        policy, _, _, lp, ref_lp, kl, mask = independent(
            record, ref_dir, trainer.args, sampled_by=trainer.records[i - i % every])
        # TRL's GRPO policy loss, loss_type="dapo", one process: the clipped surrogate
        # −min(A·ratio, A·clip(ratio, 0.8, 1.2)) summed over completion tokens / the generation
        # batch's token count × accumulation steps / steps per generation; on-policy the ratio
        # is π/sg(π) (1 in value), off-policy π/π_old
        old = inputs.get("old_per_token_logps")
        ratio = torch.exp(lp - (lp.detach() if old is None else old))
        advantages = inputs["advantages"].reshape(-1, 1)
        accumulation = trainer.args.gradient_accumulation_steps
        tokens = inputs["num_items_in_batch"].clamp(min=1.0) * accumulation
        tokens = tokens / trainer.args.steps_per_generation
        surrogate = torch.min(advantages * ratio, advantages * ratio.clamp(0.8, 1.2))
        policy_loss = -torch.where(mask, surrogate, torch.zeros(())).sum() / tokens
        kl_term = kl_objective(name, lp, ref_lp, kl, mask, ratio, tokens, accumulation)
        (policy_loss + BETA * kl_term).backward()
        expected = {n: p.grad for n, p in policy.named_parameters() if p.grad is not None}
        assert expected.keys() == record["grads"].keys()
        scale = max(float(g.abs().max()) for g in expected.values())
        rel = GRAD_REL_TOL[torch.float32]
        for param, g in expected.items():
            torch.testing.assert_close(record["grads"][param], g, rtol=rel, atol=rel * scale)


def test_which_runs_share_a_gradient(tmp_path_factory):
    # the same seed and data: the first step's batch and weights agree in every run
    names = ["exact", "k3_ratio", "trl", "trl-plain"]
    first = {name: run_of(name, tmp_path_factory).records[0] for name in names}
    ids = {n: torch.cat([r["inputs"]["prompt_ids"], r["inputs"]["completion_ids"]], 1)
           for n, r in first.items()}
    assert all(torch.equal(ids["exact"], other) for other in ids.values())
    head = {n: r["grads"]["lm_head.weight"] for n, r in first.items()}
    scale = float(head["exact"].abs().max())

    def gap(a, b):
        return float((head[a] - head[b]).abs().max()) / scale

    # TRL's default k3 term (ratio-weighted) has k3_ratio_loss's gradient on-policy
    assert gap("k3_ratio", "trl") < GRAD_REL_TOL[torch.float32]
    # the exact sequence KL, per-state reverse KL and GRPO's plain k3 all differ
    assert gap("exact", "k3_ratio") > 1e-3
    assert gap("exact", "trl-plain") > 1e-3
    assert gap("k3_ratio", "trl-plain") > 1e-3


@pytest.mark.parametrize(
    "config",
    [
        {"loss_type": "grpo"},
        {"loss_type": "bnpo"},
        {"loss_type": "dr_grpo"},
        {"loss_type": "luspo"},
        {"loss_type": "dapo", "gradient_accumulation_steps": 2},
    ],
    ids=["grpo", "bnpo", "dr_grpo", "luspo", "dapo-accumulate2"],
)
def test_k3_ratio_is_reduced_like_trls_term(tmp_path, config):
    # TRL's default term has k3_ratio_loss's value and gradient on-policy, so a first step
    # with either estimator has the same gradient only if k3_ratio is reduced as TRL reduces
    # its own term for that loss_type (and gradient accumulation)
    ours = train(tmp_path / "ours", "k3_ratio", steps=1, **config).records[0]["grads"]
    theirs = train(tmp_path / "theirs", "trl", steps=1, **config).records[0]["grads"]
    scale = max(float(g.abs().max()) for g in theirs.values())
    rel = GRAD_REL_TOL[torch.float32]
    for param, g in theirs.items():
        torch.testing.assert_close(ours[param], g, rtol=rel, atol=rel * scale)


@pytest.mark.parametrize("name", ["k3_ratio", "trl"])
def test_other_estimators_log_trls_kl_only(name, tmp_path_factory):
    trainer = run_of(name, tmp_path_factory)
    assert trainer.state.global_step == STEPS
    assert len(logged(trainer, "kl")) == STEPS
    assert not logged(trainer, "kl_seq/exact")


def test_unknown_estimator_is_refused():
    with pytest.raises(ValueError, match="kl_estimator must be one of"):
        GRPOTrainer("unused", share_of_a, kl_estimator="k3")


def test_a_peft_reference_adapter_is_refused(tmp_path):
    # given a PeftModel and beta > 0, TRL adds an adapter "ref" (a copy of the model's) and uses
    # it as the reference; the exact KL's is the policy with its adapters disabled, so the
    # trainer refuses rather than differ
    import peft

    lora = peft.LoraConfig(r=2, target_modules=["q_proj"], task_type="CAUSAL_LM")
    model = peft.get_peft_model(reference_and_policy(tmp_path / "ref", perturb=False), lora)
    args = trl.GRPOConfig(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=4,
        beta=BETA, report_to="none", use_cpu=True, bf16=False,
    )
    dataset = datasets.Dataset.from_dict({"prompt": PROMPTS})
    with pytest.raises(ValueError, match='adapter named "ref"'):
        GRPOTrainer(model, share_of_a, args=args, train_dataset=dataset,
                    processing_class=make_tokenizer(), kl_estimator="exact")  # fmt: skip


def count_reference_rows(trainer) -> list:
    """Counts the rows every forward of the reference runs on (a list, appended per call)."""
    rows: list[int] = []

    def hook(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        rows.append(int(ids.shape[0]))

    trainer.ref_model.register_forward_pre_hook(hook, with_kwargs=True)
    return rows


@pytest.mark.parametrize("config", [{}, {"num_iterations": 2, "steps_per_generation": 2}],
                         ids=["default", "iterations2"])
def test_the_reference_runs_once_per_completion(tmp_path, config):
    # TRL runs its reference once per generation batch (its log-probs reused by every
    # iteration and step on those rows); "exact" runs it there and only there: its last
    # hidden states are kept with the batch, so the reference forwards as often as TRL's own
    counts, generated = {}, {}
    for name in ("trl", "exact"):
        seen = {}

        def before(trainer, seen=seen):
            seen["rows"] = count_reference_rows(trainer)
            seen["generated"] = []
            score = trainer._generate_and_score_completions

            def counted(inputs):
                out = score(inputs)
                seen["generated"].append(int(out["completion_ids"].shape[0]))
                if name == "exact":
                    assert out["ref_hidden_states"].shape[:2] == out["completion_ids"].shape
                return out

            trainer._generate_and_score_completions = counted

        trainer = train(tmp_path / name, name, steps=4, before=before, **config)
        counts[name], generated[name] = sum(seen["rows"]), sum(seen["generated"])
        assert len(trainer.records) == 4 * trainer.args.gradient_accumulation_steps
    assert generated["exact"] == generated["trl"] > 0
    assert counts["exact"] == counts["trl"] == generated["trl"]


@pytest.mark.parametrize(
    "config",
    [
        {"loss_type": "dapo", "num_iterations": 2, "steps_per_generation": 2},
        {"loss_type": "grpo"},
        {"loss_type": "bnpo", "gradient_accumulation_steps": 2},
        {"loss_type": "dr_grpo"},
    ],
    ids=["dapo-iterations2", "grpo", "bnpo-accumulate2", "dr_grpo"],
)
def test_gradient_formed_in_the_forward_is_the_recomputed_one(tmp_path, monkeypatch, config):
    # for these loss types the trainer hands the fused head the plan of TRL's per-token
    # gradients: the head forms the gradient in its forward, and every backward finds the
    # gradients it receives equal to the plan (so it hands over rather than recomputes); the
    # steps' gradients equal those of the recomputing path (the plan switched off)
    from klpenalty.linear import kl as lin

    handed = []
    matches = lin._Held.matches
    monkeypatch.setattr(lin._Held, "matches",
                        lambda self, *a: handed.append(matches(self, *a)) or handed[-1])
    fused = train(tmp_path / "fused", "exact", steps=2, **config).records
    assert handed and all(handed) and len(handed) == len(fused)
    monkeypatch.setattr(GRPOTrainer, "_loss_plan", lambda self, inputs: None)
    recomputed = train(tmp_path / "recomputed", "exact", steps=2, **config).records
    assert len(handed) == len(fused)  # no plan, no handover
    rel = GRAD_REL_TOL[torch.float32]
    for a, b in zip(fused, recomputed):
        scale = max(float(g.abs().max()) for g in b["grads"].values())
        assert a["grads"].keys() == b["grads"].keys()
        for param, g in b["grads"].items():
            torch.testing.assert_close(a["grads"][param], g, rtol=rel, atol=rel * scale)


def test_loss_types_the_plan_does_not_know_recompute(tmp_path, monkeypatch):
    from klpenalty.linear import kl as lin

    handed = []
    monkeypatch.setattr(lin._Held, "matches", lambda self, *a: handed.append(a) or True)
    trainer = train(tmp_path / "luspo", "exact", steps=1, loss_type="luspo")
    assert trainer.records and not handed


def test_old_logprobs_are_those_of_the_truncated_policy(tmp_path_factory):
    # the first loss call of each generation batch runs on the weights that sampled it: the
    # old log-probs TRL keeps then equal log π̃ of the sampled tokens, not log π
    # the sampler's kept sets are held in the batch: every later loss call on its rows scores
    # π on those sets, whatever the weights are then (the ratio to π_old stays finite)
    trainer = run_of("exact-top-k-top-p", tmp_path_factory)
    ref_dir = trainer.model.config._name_or_path
    args = trainer.args
    for record in trainer.records[::4]:  # 2 steps per generation × 2 iterations
        inputs = record["inputs"]
        old = inputs["old_per_token_logps"]
        _, x, _, lp, _, _, mask = independent(record, ref_dir, args)
        torch.testing.assert_close(old[mask], lp.detach()[mask], **tol(torch.float32))
        full = torch.log_softmax(x.detach(), -1).gather(
            -1, inputs["completion_ids"].unsqueeze(-1)).squeeze(-1)
        assert bool((old[mask] > full[mask] + 1e-3).any())  # the sampler cut some mass
        scores = transformers.TopKLogitsWarper(args.top_k)(None, x.detach().reshape(-1, x.shape[-1]))
        scores = transformers.TopPLogitsWarper(args.top_p)(None, scores).reshape(x.shape)
        sets = inputs[SUPPORT_IDS]  # (B, L, K), -1 after a set's end: column V, dropped
        v = x.shape[-1]
        held = torch.zeros(*x.shape[:-1], v + 1, dtype=torch.bool)
        held.scatter_(-1, torch.where(sets >= 0, sets, v), True)
        assert torch.equal(held[..., :v][mask], torch.isfinite(scores)[mask])



def _bench_sampler_ratio():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[2] / "benchmarks" / "bench_sampler_ratio.py"
    spec = importlib.util.spec_from_file_location("bench_sampler_ratio", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.filterwarnings("ignore:You are using 'rollout_func'")
def test_importance_ratio_to_the_sampler_is_one_with_its_kept_sets(tmp_path):
    # a rollout that samples with top-k and top-p and returns its log-probs and kept sets:
    # TRL's old log-probs (over the whole vocabulary) give the ratio S < 1 on every cut
    # position; the kept sets replayed, or rebuilt from the config's settings, give 1
    bench = _bench_sampler_ratio()
    runs = {variant: bench.measure(500, 4.0, 20, 0.9, variant, 4, 8, str(tmp_path))
            for variant in bench.VARIANTS}
    # two float32 log-probs of one token (the sampler's log_softmax, the trainer's), each
    # within the table's bound; |log π̃| ≤ log 20 on a kept set of at most 20 tokens
    bound = tol(torch.float32)
    close = 2 * (bound["atol"] + bound["rtol"] * math.log(20))
    for variant in ("replayed", "rule"):
        assert runs[variant]["ratio_min"] == pytest.approx(1.0, abs=close), variant
        assert runs[variant]["ratio_max"] == pytest.approx(1.0, abs=close), variant
    assert runs["untruncated"]["ratio_max"] < 1.0 - 1e-3
    assert all(r["tokens"] == 4 * 8 for r in runs.values())
