"""``klpenalty demo --distill``: on-policy distillation of the demo's reference into a smaller
student, one run per recipe.

The teacher ν is the shipped reference (``ref.pt``: 2 layers, width 64); the student π is the
same GPT at a smaller width (default 32, 4 heads, ~30k parameters), initialised from scratch
by the seed. Every step samples ``batch`` texts from the student, runs both models on them and
takes one Adam step on the recipe's objective, per token

    Σ_t (−A_t·log π(y_t) + L_t)·mask_t / (number of generated tokens),

with ``(A, L) = opd_terms(OPD_RECIPES[recipe], log π(y), log ν(y), token_divergence=D,
mask=mask)`` and D = :func:`klpenalty.divergence` (student, teacher, the recipe's kind) at every
generated position. ``sft``, the off-policy baseline, instead samples its batch from the
teacher and minimises the student's cross-entropy on it.

Logged at every step, on the student's own samples (the training batch on-policy; a separate
batch for ``sft``, not counted in its cost): the exact reverse KL(π‖ν) and forward KL(ν‖π)
per generated token, the teacher's mean log-prob per token of the student's texts, the
fraction of grammatical texts, the length, the gradient norm before clipping, and the CPU time
the training itself took so far (sampling the training batch, both forward passes, the
update; not the metrics). The last entry is an evaluation of ``final_batch`` texts after the
last update.

Shape letters: B batch, T generated tokens, V vocabulary.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch

from klpenalty import divergence, token_logprobs

from klpenalty.rlhf.distill import OPD_RECIPES, opd_terms
from .compare import _round, _sd, load_run, save_run
from .grammar import Recognizer, default_grammar
from .model import GPTConfig, TinyGPT, sample, training_batch
from .pretrain import load_checkpoint
from .text import score_text

__all__ = [
    "DISTILL_RECIPES",
    "DistillConfig",
    "run_distill",
    "distill_configs",
    "summarize_distill",
    "distill_table",
    "plot_distill",
    "distill_run_file",
    "write_distill",
    "teacher_point",
    "PROGRESS_FIELDS",
]

# on-policy recipes (klpenalty.rlhf.distill.OPD_RECIPES names), then the off-policy baseline
DISTILL_RECIPES = ("sampled_k1", "vopd", "exact_reverse", "exact_forward", "exact_jsd", "sft")
SERIES = ("reverse_kl", "reverse_kl_seq", "forward_kl", "teacher_logprob", "grammatical",
          "length", "grad_norm", "cpu_seconds")
GRAMMATICAL_TARGET = 0.8  # the summary's "steps to": the trailing mean over SMOOTH steps
SMOOTH = 10
PROGRESS_FIELDS = (("reverse_kl", "KL(π‖ν)/tok", "{:6.3f}"),
                   ("teacher_logprob", "teacher log ν/tok", "{:6.2f}"),
                   ("grammatical", "gram", "{:4.0%}"))


@dataclass
class DistillConfig:
    """Settings of one distillation run (the defaults are ``--distill``'s).

    Attributes:
        recipe: one of :data:`DISTILL_RECIPES`.
        steps: updates, one fresh batch each.
        batch: texts per step.
        max_new: generation length limit in tokens (≤ 32, the models' context).
        lr: Adam learning rate (no schedule).
        width: the student's hidden size (the teacher's is 64); 4 heads, 2 layers.
        final_batch: student texts for the evaluation after the last update.
        seed: seeds the student's initialisation and the sampler.
        label: name in the report (default: the recipe).
    """

    recipe: str = "vopd"
    steps: int = 300
    batch: int = 64
    max_new: int = 32
    lr: float = 3e-3
    width: int = 32
    final_batch: int = 256
    seed: int = 0
    label: str = field(default="")

    def __post_init__(self) -> None:
        if self.recipe not in DISTILL_RECIPES:
            raise ValueError(f"recipe must be one of {DISTILL_RECIPES}, got {self.recipe!r}")
        if self.width < 4 or self.width % 4:
            raise ValueError(f"width must be a positive multiple of 4 (4 heads), got {self.width}")
        if not 1 <= self.max_new <= 32:
            raise ValueError(f"max_new must be in [1, 32] (the models' context), got {self.max_new}")
        if not self.label:
            self.label = self.recipe


def distill_configs(base: DistillConfig) -> list[DistillConfig]:
    """One run per recipe of :data:`DISTILL_RECIPES`, otherwise ``base``'s settings."""
    return [DistillConfig(**{**asdict(base), "recipe": r, "label": r}) for r in DISTILL_RECIPES]


def make_student(teacher: TinyGPT, width: int, seed: int) -> TinyGPT:
    """The teacher's architecture at hidden size ``width``, initialised from ``seed``."""
    torch.manual_seed(seed)
    cfg = GPTConfig(**{**teacher.cfg.to_dict(), "n_embd": width})
    return TinyGPT(cfg)


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over the generated tokens (a 0-dim tensor, differentiable)."""
    return torch.where(mask, x, torch.zeros_like(x)).sum() / mask.sum()


@torch.no_grad()
def _measure(texts, tgt, mask, s_logits, t_logits, recognizer) -> dict:
    """The metrics of a batch of student texts (module docstring)."""
    s_logits = s_logits.detach()
    n = len(texts)
    rev = divergence(s_logits, t_logits, "reverse_kl", mask=mask)  # (B, T), 0 where masked
    return {
        "reverse_kl": float(_masked_mean(rev, mask)),
        "forward_kl": float(_masked_mean(divergence(s_logits, t_logits, "forward_kl", mask=mask),
                                         mask)),
        "reverse_kl_seq": float(rev.sum() / n),
        "teacher_logprob": float(_masked_mean(token_logprobs(t_logits, tgt), mask)),
        "grammatical": sum(score_text(t, recognizer).grammatical for t in texts) / n,
        "length": float(mask.sum()) / n,
        "samples": n,
        "sample": " ".join(texts[0]),
    }


def run_distill(
    cfg: DistillConfig,
    ref_path: str | Path | None = None,
    progress: Callable[[int, dict], None] | None = None,
) -> dict:
    """Distil the reference checkpoint (the teacher) into a fresh student; return the log.

    Args:
        cfg: the run's settings.
        ref_path: the teacher's checkpoint (default: the one shipped in the package).
        progress: called as ``progress(step, metrics)`` after every step.

    Returns:
        ``{"config", "steps": [metrics per step; step 0 = the initial student, the last one
        on final_batch texts after the last update], "samples": [three student texts of the
        final batch], "teacher": the teacher's own metrics on a batch of its texts,
        "student_parameters", "teacher_parameters", "seconds", "cpu_seconds"}``. Metrics (module
        docstring): reverse_kl, forward_kl, teacher_logprob (nats per token), grammatical
        (fraction), length (tokens per text), grad_norm (None on the last step), cpu_seconds
        (training CPU time up to and including this step), step_seconds (wall, None on the
        last step), samples, sample.
    """
    t0, cpu0 = time.perf_counter(), time.process_time()
    clock = time.process_time
    teacher, vocab, _ = load_checkpoint(ref_path)
    student = make_student(teacher, cfg.width, cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)  # the student's texts
    teacher_gen = torch.Generator().manual_seed(cfg.seed + 1)  # sft: the teacher's texts
    recognizer = Recognizer(default_grammar())
    opt = torch.optim.Adam(student.parameters(), lr=cfg.lr)
    recipe = None if cfg.recipe == "sft" else OPD_RECIPES[cfg.recipe]
    log: list[dict] = []
    texts: list[list[str]] = []
    train_cpu = 0.0

    for step in range(cfg.steps + 1):
        t_step = time.perf_counter()
        train = step < cfg.steps
        on_policy = train and recipe is not None
        n = cfg.batch if train else max(cfg.batch, cfg.final_batch)
        cost = 0.0  # this step's training CPU time
        if train and recipe is None:  # sft: the training batch comes from the teacher
            c = clock()
            t_inp, t_tgt, t_mask = training_batch(*sample(teacher, n, cfg.max_new, vocab, teacher_gen),
                                          vocab.eos)
            cost += clock() - c
        c = clock()
        inp, tgt, mask = training_batch(*sample(student, n, cfg.max_new, vocab, gen), vocab.eos)
        with torch.no_grad():
            t_logits = teacher(inp)  # (B, T, V)
        with torch.set_grad_enabled(on_policy):
            s_logits = student(inp)  # (B, T, V)
        if on_policy:  # off-policy, the student's texts only measure
            cost += clock() - c
        texts = [vocab.decode(row[m]) for row, m in zip(tgt, mask)]
        metrics = {"step": step, **_measure(texts, tgt, mask, s_logits, t_logits, recognizer),
                   "grad_norm": None, "step_seconds": None}
        if train:
            c = clock()
            if recipe is None:
                lp = token_logprobs(student(t_inp), t_tgt)  # (B, T) on the teacher's texts
                objective = -_masked_mean(lp, t_mask)
            else:
                lp = token_logprobs(s_logits, tgt)  # (B, T), differentiable
                t_lp = token_logprobs(t_logits, tgt)
                div = None if recipe.kind is None else divergence(
                    s_logits, t_logits, recipe.kind, mask=mask)
                adv, loss = opd_terms(recipe, lp, t_lp, token_divergence=div, mask=mask)
                objective = _masked_mean(-adv.detach() * lp + loss, mask)
            opt.zero_grad(set_to_none=True)
            objective.backward()
            metrics["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0))
            opt.step()
            cost += clock() - c
            metrics["step_seconds"] = time.perf_counter() - t_step
        train_cpu += cost
        metrics["cpu_seconds"] = train_cpu
        log.append(metrics)
        if progress is not None:
            progress(step, metrics)

    return {
        "config": asdict(cfg),
        "steps": log,
        "samples": [" ".join(t) for t in texts[:3]],
        "student_parameters": sum(p.numel() for p in student.parameters()),
        "teacher_parameters": sum(p.numel() for p in teacher.parameters()),
        "seconds": time.perf_counter() - t0,
        "cpu_seconds": time.process_time() - cpu0,
    }


@torch.no_grad()
def teacher_point(ref_path: str | Path | None, n: int, max_new: int, seed: int) -> dict:
    """The teacher's own texts measured as a student's are: reverse and forward KL 0, its
    log-prob per token (minus its entropy rate), the fraction grammatical, the length."""
    teacher, vocab, _ = load_checkpoint(ref_path)
    gen = torch.Generator().manual_seed(seed + 7919)  # not the students' sampler stream
    inp, tgt, mask = training_batch(*sample(teacher, n, max_new, vocab, gen), vocab.eos)
    logits = teacher(inp)
    texts = [vocab.decode(row[m]) for row, m in zip(tgt, mask)]
    point = _measure(texts, tgt, mask, logits, logits, Recognizer(default_grammar()))
    point.pop("sample")
    return point


def _series(run: dict) -> dict[str, list]:
    """The per-step series of a run (from :func:`run_distill`, or as distill.json holds them)."""
    steps = run["steps"]
    if isinstance(steps, dict):
        return steps
    return {k: [_round(s[k]) for s in steps] for k in SERIES}


def _trailing_mean(xs: Sequence[float], k: int) -> list[float]:
    return [statistics.fmean(xs[max(0, i - k + 1): i + 1]) for i in range(len(xs))]


def summarize_distill(run: dict) -> dict:
    """One run's row: the final evaluation, how fast it got there, the spread and the cost.

    ``late_*``: the means of the batches of the last quarter of the training steps (steadier
    than the final batch); ``steps_to_grammatical`` / ``cpu_to_grammatical``: the first step (and the training CPU
    seconds spent by then) where the mean fraction grammatical of the last :data:`SMOOTH`
    batches reaches :data:`GRAMMATICAL_TARGET` (None if never); ``grad_norm``: median of the
    norm before clipping over all training steps, ``grad_norm_sd`` its standard deviation over
    the second half; ``cpu_seconds``: the training CPU time of all steps."""
    cfg, series = run["config"], _series(run)
    n = len(series["reverse_kl"]) - 1  # training steps; the last entry is the final evaluation
    last = {k: v[-1] for k, v in series.items()}
    norms = series["grad_norm"][:n]
    smooth = _trailing_mean(series["grammatical"][:n], SMOOTH)
    hit = next((i for i, g in enumerate(smooth) if g >= GRAMMATICAL_TARGET), None)
    return {
        "recipe": cfg["recipe"],
        "seed": cfg["seed"],
        **{k: last[k] for k in ("reverse_kl", "reverse_kl_seq", "forward_kl", "teacher_logprob",
                                "grammatical", "length")},
        **{f"late_{k}": statistics.fmean(series[k][n - max(1, n // 4): n]) if n else last[k]
           for k in ("reverse_kl", "teacher_logprob", "grammatical")},
        "steps_to_grammatical": hit,
        "cpu_to_grammatical": None if hit is None else series["cpu_seconds"][hit],
        "grad_norm": statistics.median(norms) if norms else 0.0,
        "grad_norm_sd": _sd(norms[n // 2:]),
        "cpu_seconds": last["cpu_seconds"],
    }


def cpu_budget(rows: Sequence[dict]) -> float:
    """The equal training CPU budget the table compares the runs at: half the median of the
    runs' totals (a run that collapses to one-token texts is cheap, so not the minimum)."""
    return 0.5 * statistics.median(r["cpu_seconds"] for r in rows)


def _at_cpu(run: dict, budget: float, key: str) -> float:
    """``key``'s trailing mean over :data:`SMOOTH` steps at the last training step whose
    cumulative training CPU time is within ``budget``."""
    series = run["steps"]
    n = len(series[key]) - 1
    i = max((j for j in range(n) if series["cpu_seconds"][j] <= budget), default=0)
    return _trailing_mean(series[key][:n], SMOOTH)[i]


def _slim(run: dict) -> dict:
    """What distill.json keeps of a run: config, summary, per-step series, samples, cost."""
    slim = {k: run[k] for k in ("config", "samples", "student_parameters", "teacher_parameters",
                                 "seconds", "cpu_seconds")}
    slim["steps"] = _series(run)
    slim["summary"] = summarize_distill(slim)
    return slim


def distill_table(runs: Sequence[dict], teacher: dict) -> str:
    """Markdown: the final evaluation per recipe, then speed (per step and per CPU second) and
    spread; ``runs`` as distill.json holds them."""
    rows = [r["summary"] for r in runs]
    budget = cpu_budget(rows)
    lines = [
        "Final evaluation (fresh student texts after the last update; per generated token unless "
        "said): the teacher's own texts score log ν "
        f"{teacher['teacher_logprob']:.3f} / {teacher['grammatical']:.0%} grammatical / length "
        f"{teacher['length']:.1f}.",
        "",
        "| recipe | KL(π‖ν) | KL(π‖ν) per text | KL(ν‖π) | teacher log ν | grammatical "
        "| length |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['recipe']} | {r['reverse_kl']:.4f} | {r['reverse_kl_seq']:.3f} | "
            f"{r['forward_kl']:.4f} | {r['teacher_logprob']:.3f} | {r['grammatical']:.0%} | "
            f"{r['length']:.1f} |")
    lines += [
        "",
        f"Speed and spread: the first step at which the last {SMOOTH} batches average ≥ "
        f"{GRAMMATICAL_TARGET:.0%} grammatical, and the training CPU seconds spent by then; the "
        f"reverse KL per token and the teacher's log-prob (means of the last {SMOOTH} batches) "
        f"at an equal training CPU budget of {budget:.1f} s (half the runs' median total; a run "
        "that spent less: its last step); the "
        "gradient norm before clipping (median over all steps, standard deviation over the "
        "second half); training CPU seconds in all; the means of the batches of the last "
        "quarter of the steps.",
        "",
        f"| recipe | steps to {GRAMMATICAL_TARGET:.0%} | CPU s to {GRAMMATICAL_TARGET:.0%} "
        f"| KL(π‖ν) at {budget:.1f} CPU s | log ν at {budget:.1f} CPU s | grad norm (median) "
        "| grad norm sd | CPU s | last quarter: KL(π‖ν) / log ν / grammatical |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for run, r in zip(runs, rows):
        reach = "never" if r["steps_to_grammatical"] is None else str(r["steps_to_grammatical"])
        cpu = "—" if r["cpu_to_grammatical"] is None else f"{r['cpu_to_grammatical']:.1f}"
        lines.append(
            f"| {r['recipe']} | {reach} | {cpu} | {_at_cpu(run, budget, 'reverse_kl'):.3f} | "
            f"{_at_cpu(run, budget, 'teacher_logprob'):.3f} | {r['grad_norm']:.3g} | "
            f"{r['grad_norm_sd']:.3g} | {r['cpu_seconds']:.1f} | {r['late_reverse_kl']:.4f} / "
            f"{r['late_teacher_logprob']:.3f} / {r['late_grammatical']:.0%} |")
    return "\n".join(lines)


def plot_distill(runs: Sequence[dict], teacher: dict, path: Path) -> Path:
    """2×3 figure per recipe: the reverse KL per token against the step and against the
    training CPU time, the teacher's log-prob, % grammatical, the forward KL and the gradient
    norm against the step (trailing means over :data:`SMOOTH` steps, except the KLs)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {r: plt.get_cmap("tab10")(i) for i, r in enumerate(DISTILL_RECIPES)}
    fig, axes = plt.subplots(2, 3, figsize=(15, 8.6))
    panels = (
        (axes[0, 0], "reverse_kl", "step", True, False, "exact KL(π‖ν) per token, student texts"),
        (axes[0, 1], "reverse_kl", "cpu", True, False, "exact KL(π‖ν) per token vs training CPU"),
        (axes[0, 2], "teacher_logprob", "step", False, True, "teacher log ν per token of the "
                                                             "student's texts"),
        (axes[1, 0], "grammatical", "step", False, True, "grammatical student texts"),
        (axes[1, 1], "forward_kl", "step", True, False, "exact KL(ν‖π) per token, student texts"),
        (axes[1, 2], "grad_norm", "step", True, True, "gradient norm before clipping"),
    )
    for ax, key, x_axis, log, smooth, title in panels:
        for run in runs:
            recipe = run["config"]["recipe"]
            st = run["steps"]
            n = len(st[key]) - (1 if key == "grad_norm" else 0)
            ys = st[key][:n]
            if smooth:
                ys = _trailing_mean(ys, SMOOTH)
            xs = list(range(n)) if x_axis == "step" else st["cpu_seconds"][:n]
            pts = [(a, b) for a, b in zip(xs, ys) if not log or b > 0]
            ax.plot([a for a, _ in pts], [b for _, b in pts], color=colors[recipe], lw=1.3,
                    ls="--" if recipe == "sft" else "-", label=recipe)
        if key in ("teacher_logprob", "grammatical"):
            ax.axhline(teacher[key], color="black", lw=0.8, ls=":", label="the teacher's texts")
        if log:
            ax.set_yscale("log")
        ax.set_title(title + (f" (mean of {SMOOTH} steps)" if smooth else ""), fontsize=10)
        ax.set_xlabel("training CPU seconds" if x_axis == "cpu" else "step")
        ax.grid(alpha=0.3)
    axes[1, 0].yaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{v:.0%}"))
    axes[0, 0].legend(fontsize=8)
    axes[1, 0].legend(fontsize=8)
    fig.suptitle("On-policy distillation of the demo's reference (width 64) into a width-32 "
                 "student from scratch, one run per recipe")
    fig.tight_layout()
    fig.savefig(path, dpi=60)
    plt.close(fig)
    return path


def distill_run_file(folder: Path, cfg: DistillConfig) -> Path:
    """Where ``--distill`` keeps a finished run: ``folder/<recipe>-s<seed>.json``."""
    return Path(folder) / f"{cfg.recipe}-s{cfg.seed}.json"


def save_distill_run(path: Path, run: dict) -> Path:
    """Write one finished run as distill.json holds it."""
    return save_run(path, run, slim=_slim)


def load_distill_run(path: Path, cfg: DistillConfig) -> dict | None:
    """The run saved at ``path`` if its config is ``cfg``'s, else None."""
    return load_run(path, cfg)


def write_distill(out: Path, runs: Sequence[dict], meta: dict, plots: bool = True) -> dict:
    """Write ``distill.json`` (settings, teacher point, every run's config, summary, per-step
    series and samples), ``distill.md`` (the tables) and ``distill.png``. Returns the paths
    written, by name."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    runs = [_slim(r) for r in runs]
    teacher = meta["teacher"]
    written = {}
    (out / "distill.json").write_text(json.dumps({**meta, "runs": runs}, ensure_ascii=False))
    written["metrics"] = out / "distill.json"
    cfg = meta["config"]
    text = [
        "# klpenalty demo --distill: on-policy distillation, one run per recipe",
        "",
        f"Command: `{meta.get('command')}` — {meta.get('wall_seconds', 0):.0f} s wall, "
        f"{meta.get('cpu_seconds', 0):.0f} s CPU over {len(runs)} runs, {cfg['steps']} steps × "
        f"{cfg['batch']} texts each, student width {cfg['width']} "
        f"({runs[0]['student_parameters']:,} parameters; teacher "
        f"{runs[0]['teacher_parameters']:,}), seed {cfg['seed']}; load average "
        f"{meta.get('load_average')}"
        + (f"; {meta['runs_resumed']} run(s) read back from distill-runs/, not timed here"
           if meta.get("runs_resumed") else "") + ".",
        "",
        distill_table(runs, teacher),
        "",
    ]
    if plots:
        try:
            written["figure"] = plot_distill(runs, teacher, out / "distill.png")
            text += ["![distill](distill.png)", ""]
        except ImportError:
            text += ["(matplotlib is not installed: `pip install klpenalty[demo]` for figures)",
                     ""]
    text += ["## Samples (final evaluation)", ""]
    for r in runs:
        text += [f"**{r['config']['recipe']}**", ""] + [f"- `{s}`" for s in r["samples"]] + [""]
    (out / "distill.md").write_text("\n".join(text))
    written["report"] = out / "distill.md"
    return written
