"""``klpenalty demo --compare``: one run per (update, KL recipe, β), their frontiers and costs.

Every run is :func:`klpenalty.demo.rlhf.run_rlhf` with a different ``kl`` (the recipe),
``update`` and ``beta``, from the same reference and seed. β = 0 is one run per update (the
recipe does not matter without a penalty). This module builds the grid, summarises each run,
and writes ``compare.json``, ``compare.md`` and ``compare.png``.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import replace
from pathlib import Path
from typing import Sequence

from .rlhf import KL_RECIPES, RunConfig

__all__ = [
    "COMPARE_BETAS",
    "COMPARE_RECIPES",
    "SEED_BETA",
    "SEED_RECIPES",
    "TRACE_BETA",
    "compare_configs",
    "summarize",
    "compare_tables",
    "plot_compare",
    "run_file",
    "save_run",
    "load_run",
    "write_compare",
]

# with β = 0: five values, 0.1 (the gold peak of the k1-reward sweep) to 3 (a tight leash);
# run in this order, so that an interrupted grid has whole β slices
COMPARE_BETAS = (0.1, 0.3, 1.0, 3.0)
COMPARE_RECIPES = {
    "ppo": KL_RECIPES,
    "grpo": ("k1-reward", "exact-split", "k3-loss", "k3-ratio-loss"),
}
SEED_BETA = 0.1  # where extra seeds are run: the gold peak of the k1-reward sweep
SEED_RECIPES = (("ppo", "k1-reward"), ("ppo", "exact-split"))  # same expected gradient
EXTRA_SEEDS = 1  # seed + 1 at SEED_BETA for SEED_RECIPES
TRACE_BETA = 0.3  # the β of the KL-vs-step panels


def compare_configs(
    base: RunConfig, betas: Sequence[float] = COMPARE_BETAS, extra_seeds: int = EXTRA_SEEDS
) -> list[RunConfig]:
    """The grid: β = 0 once per update, then for each β > 0 in the order given every
    (update, recipe), then the extra seeds at :data:`SEED_BETA` (if it is in ``betas``) for
    :data:`SEED_RECIPES`."""

    def cfg(update: str, kl: str, beta: float, seed: int) -> RunConfig:
        tag = f"{update} {kl}" if beta > 0 else f"{update} no penalty"
        label = f"{tag} β={beta:g}" + (f" seed {seed}" if seed != base.seed else "")
        return replace(base, update=update, kl=kl, beta=beta, seed=seed,
                       adaptive_target=None, label=label)

    positive = [b for b in dict.fromkeys(betas) if b > 0]
    out = [cfg(u, "k1-reward", 0.0, base.seed) for u in COMPARE_RECIPES]
    out += [cfg(u, kl, b, base.seed) for b in positive for u, kls in COMPARE_RECIPES.items()
            for kl in kls]
    if SEED_BETA in positive:
        out += [cfg(u, kl, SEED_BETA, base.seed + k) for u, kl in SEED_RECIPES
                for k in range(1, extra_seeds + 1)]
    return out


def _sd(xs: Sequence[float]) -> float:
    return statistics.pstdev(xs) if len(xs) > 1 else 0.0


def summarize(run: dict) -> dict:
    """One run's row (``run`` as :func:`run_rlhf` or compare.json holds it): the final
    evaluation, and the spread and cost of its training steps.

    ``kl_jitter``: standard deviation of the step-to-step change of the batch's exact KL over
    the second half of training; ``grad_norm``: median of the pre-clipping gradient norm over
    all training steps, ``grad_norm_sd`` its standard deviation over the second half;
    ``step_seconds``: median wall time of a training step; ``cpu_seconds_per_step``: the run's
    CPU time over its steps."""
    cfg, series = run["config"], _series(run)
    n = len(series["kl"]) - 1  # training steps; the last entry is the final evaluation
    last = {k: v[-1] for k, v in series.items()}
    kl = series["kl"][n // 2: n]
    norms = series["grad_norm"][:n]
    return {
        "update": cfg["update"],
        "recipe": cfg["kl"] if cfg["beta"] > 0 else "no penalty",
        "beta": cfg["beta"],
        "seed": cfg["seed"],
        "kl": last["kl"],
        "gold": last["gold"],
        "proxy": last["proxy"],
        "grammatical": last["grammatical"],
        "kl_jitter": _sd([b - a for a, b in zip(kl, kl[1:])]),
        "grad_norm": statistics.median(norms) if norms else 0.0,
        "grad_norm_sd": _sd(norms[n // 2:]),
        "step_seconds": statistics.median(series["step_seconds"][:n]) if n else 0.0,
        "cpu_seconds_per_step": (run.get("cpu_seconds") or 0.0) / (n + 1),
    }


def _round(x: float | None) -> float | None:
    """4 significant digits: what the per-step series in compare.json keep."""
    return None if x is None else float(f"{x:.4g}")


SERIES = ("kl", "gold", "proxy", "grammatical", "grad_norm", "step_seconds")


def _series(run: dict) -> dict[str, list]:
    """The per-step series of a run: from its list of step metrics (:func:`run_rlhf`), or as
    compare.json stores them (a dict of lists)."""
    steps = run["steps"]
    if isinstance(steps, dict):
        return steps
    return {k: [_round(s[k]) for s in steps] for k in SERIES}


def _slim(run: dict) -> dict:
    """What compare.json keeps of a run: its config, summary and per-step series."""
    slim = {
        "config": run["config"],
        "steps": _series(run),
        "seconds": run["seconds"],
        "cpu_seconds": run.get("cpu_seconds"),
    }
    slim["summary"] = summarize(slim)
    return slim


def _main_rows(rows: Sequence[dict], seed: int) -> list[dict]:
    return [r for r in rows if r["seed"] == seed]


def compare_tables(rows: Sequence[dict], start: dict, seed: int) -> str:
    """Markdown: the frontier table (KL / gold / grammatical per recipe and β), the spread and
    cost table (per recipe, at :data:`TRACE_BETA` or the nearest β run), and the seeds."""
    main = _main_rows(rows, seed)
    betas = sorted({r["beta"] for r in main if r["beta"] > 0})
    lines = [
        "Exact KL (nats) / gold / % grammatical at the end, per recipe and β; the reference: "
        f"KL 0 / gold {start['gold']:.2f} / {start['grammatical']:.0%}.",
        "",
        "| update | recipe | " + " | ".join(f"β = {b:g}" for b in betas) + " |",
        "|---|---|" + "---|" * len(betas),
    ]
    for u in dict.fromkeys(r["update"] for r in main):
        zero = [r for r in main if r["update"] == u and r["beta"] == 0]
        if zero:
            z = zero[0]
            lines.append(f"| {u} | β = 0 | {z['kl']:.0f} / {z['gold']:.2f} / "
                         f"{z['grammatical']:.0%} |" + " |" * (len(betas) - 1))
        for kl in dict.fromkeys(r["recipe"] for r in main if r["update"] == u and r["beta"] > 0):
            cells = []
            for b in betas:
                hit = [r for r in main if (r["update"], r["recipe"], r["beta"]) == (u, kl, b)]
                cells.append(f"{hit[0]['kl']:.3g} / {hit[0]['gold']:.2f} / "
                             f"{hit[0]['grammatical']:.0%}" if hit else "")
            lines.append(f"| {u} | {kl} | " + " | ".join(cells) + " |")
    trace = min(betas, key=lambda b: abs(math.log(b / TRACE_BETA))) if betas else 0.0
    lines += [
        "",
        f"Spread and cost at β = {trace:g} (second half of training; seconds: median per step, "
        "wall and CPU):",
        "",
        "| update | recipe | KL (nats) | KL step-to-step sd | grad norm (median) | grad norm sd "
        "| grammatical | s/step | CPU s/step |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in main:
        if r["beta"] == trace:
            lines.append(
                f"| {r['update']} | {r['recipe']} | {r['kl']:.3g} | {r['kl_jitter']:.3g} | "
                f"{r['grad_norm']:.3g} | {r['grad_norm_sd']:.3g} | {r['grammatical']:.0%} | "
                f"{r['step_seconds']:.2f} | {r['cpu_seconds_per_step']:.2f} |"
            )
    seeded = [r for r in rows if r["beta"] == SEED_BETA
              and (r["update"], r["recipe"]) in SEED_RECIPES]
    if len({r["seed"] for r in seeded}) > 1:
        lines += ["", f"Seeds at β = {SEED_BETA:g} (KL / gold / % grammatical):", "",
                  "| update | recipe | " + " | ".join(
                      f"seed {s}" for s in sorted({r["seed"] for r in seeded})) + " |",
                  "|---|---|" + "---|" * len({r["seed"] for r in seeded})]
        for u, kl in SEED_RECIPES:
            mine = sorted((r for r in seeded if (r["update"], r["recipe"]) == (u, kl)),
                          key=lambda r: r["seed"])
            lines.append(f"| {u} | {kl} | " + " | ".join(
                f"{r['kl']:.3g} / {r['gold']:.2f} / {r['grammatical']:.0%}" for r in mine) + " |")
    return "\n".join(lines)


def plot_compare(runs: Sequence[dict], path: Path, seed: int) -> Path:
    """2×3 figure: the gold-vs-KL frontier per recipe (PPO, GRPO), the exact KL reached
    against β, and at one β the KL, gold and gradient norm against the step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [_slim(r) for r in runs if r["config"]["seed"] == seed]
    rows = [r["summary"] for r in runs]
    colors = {kl: plt.get_cmap("tab10")(i) for i, kl in enumerate(KL_RECIPES)}
    style = {"ppo": ("-", "o"), "grpo": ("--", "s")}
    start = {k: v[0] for k, v in runs[0]["steps"].items()}
    fig, axes = plt.subplots(2, 3, figsize=(15, 8.6))
    betas = sorted({r["beta"] for r in rows if r["beta"] > 0})
    trace = min(betas, key=lambda b: abs(math.log(b / TRACE_BETA))) if betas else 0.0
    for col, update in enumerate(("ppo", "grpo")):
        ax = axes[0, col]
        for kl in KL_RECIPES:
            pts = sorted((r["beta"], r["kl"], r["gold"]) for r in rows
                         if (r["update"], r["recipe"]) == (update, kl))
            if not pts:
                continue
            ls, mk = style[update]
            ax.plot([p[1] for p in pts], [p[2] for p in pts], ls=ls, marker=mk, ms=4,
                    color=colors[kl], label=kl)
            if kl == "k1-reward":
                for b, x, y in pts:
                    ax.annotate(f"β={b:g}", (x, y), fontsize=7, xytext=(3, 3),
                                textcoords="offset points", color=colors[kl])
        zero = [r for r in rows if r["update"] == update and r["beta"] == 0]
        for z in zero:
            ax.plot([z["kl"]], [z["gold"]], "x", color="grey", ms=7, label="β = 0")
        ax.plot([0.0], [start["gold"]], "*", color="black", ms=11, label="reference")
        ax.set_xscale("function", functions=(lambda x: x ** 0.5, lambda x: x ** 2))
        ax.set_xlim(left=0)
        ax.set_title(f"{update.upper()} update: gold vs exact KL at the end", fontsize=11)
        ax.set_xlabel("exact sequence KL (nats, √ scale)")
        ax.set_ylabel("gold reward")
        ax.legend(fontsize=8)
    ax = axes[0, 2]
    for update in ("ppo", "grpo"):
        for kl in KL_RECIPES:
            pts = sorted((r["beta"], r["kl"]) for r in rows
                         if (r["update"], r["recipe"]) == (update, kl))
            if pts:
                ls, mk = style[update]
                ax.plot([p[0] for p in pts], [p[1] for p in pts], ls=ls, marker=mk, ms=4,
                        color=colors[kl], label=f"{kl} ({update})")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_title("exact KL reached at each β (solid PPO, dashed GRPO)", fontsize=11)
    ax.set_xlabel("β")
    ax.set_ylabel("exact sequence KL at the end (nats)")
    ax.legend(fontsize=6, ncol=2)
    panels = (("kl", "exact KL of the batch (nats)", True), ("gold", "gold reward", False),
              ("grad_norm", "gradient norm before clipping", True))
    for ax, (key, ylabel, log) in zip(axes[1], panels):
        for r in runs:
            c = r["config"]
            if c["beta"] != trace:
                continue
            ls, _ = style[c["update"]]
            pairs = [(i, v) for i, v in enumerate(r["steps"][key]) if v is not None]
            if log:
                pairs = [(a, b) for a, b in pairs if b > 0]
            ax.plot([a for a, _ in pairs], [b for _, b in pairs], ls=ls, color=colors[c["kl"]],
                    lw=1.2, label=f"{c['kl']} ({c['update']})")
        if log:
            ax.set_yscale("log")
        ax.set_title(f"{ylabel} per step, β = {trace:g}", fontsize=11)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
    axes[1, 0].legend(fontsize=6, ncol=2)
    for ax in axes.flat:
        ax.grid(alpha=0.3)
    fig.suptitle("Where the KL goes: the same reward, seed and β grid, one run per recipe")
    fig.tight_layout()
    fig.savefig(path, dpi=60)
    plt.close(fig)
    return path


def run_file(folder: Path, cfg: RunConfig) -> Path:
    """Where ``--compare`` keeps a finished run: ``folder/<update>-<recipe>-b<β>-s<seed>.json``"""
    kl = cfg.kl if cfg.beta > 0 else "none"
    return Path(folder) / f"{cfg.update}-{kl}-b{cfg.beta:g}-s{cfg.seed}.json"


def save_run(path: Path, run: dict, slim=_slim) -> Path:
    """Write one run as compare.json holds it (``slim``: what of it is kept)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(slim(run), ensure_ascii=False))
    return path


def load_run(path: Path, cfg) -> dict | None:
    """The run saved at ``path`` if its config is ``cfg``'s (a dataclass; an interrupted
    ``--compare`` or ``--distill`` resumes from these), else None."""
    from dataclasses import asdict

    path = Path(path)
    if not path.is_file():
        return None
    run = json.loads(path.read_text())
    return run if run.get("config") == json.loads(json.dumps(asdict(cfg))) else None


def write_compare(out: Path, runs: Sequence[dict], meta: dict, plots: bool = True) -> dict:
    """Write ``compare.json`` (config, summary and per-step series of every run),
    ``compare.md`` (the tables) and ``compare.png``. Returns the paths written, by name."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    seed = meta["config"]["seed"]
    runs = [_slim(r) for r in runs]
    rows = [r["summary"] for r in runs]
    start = {k: v[0] for k, v in runs[0]["steps"].items()}
    written = {}
    data = {**meta, "reference_point": {k: start[k] for k in ("kl", "gold", "proxy",
                                                              "grammatical")},
            "runs": runs}
    (out / "compare.json").write_text(json.dumps(data, indent=None, ensure_ascii=False))
    written["metrics"] = out / "compare.json"
    tables = compare_tables(rows, start, seed)
    text = [
        "# klpenalty demo --compare: where the KL goes",
        "",
        f"Command: `{meta.get('command')}` — {meta.get('wall_seconds', 0):.0f} s wall, "
        f"{meta.get('cpu_seconds', 0):.0f} s CPU over {len(runs)} runs, "
        f"{meta['config']['steps']} steps × {meta['config']['batch']} samples each, "
        f"seed {seed}; load average {meta.get('load_average')}"
        + (f"; {meta['runs_resumed']} run(s) read back from compare-runs/, not timed here"
           if meta.get("runs_resumed") else "") + ".",
        "",
        tables,
        "",
    ]
    if plots:
        try:
            written["figure"] = plot_compare(runs, out / "compare.png", seed)
            text += ["![compare](compare.png)", ""]
        except ImportError:
            text += ["(matplotlib is not installed: `pip install klpenalty[demo]` for figures)",
                     ""]
    (out / "compare.md").write_text("\n".join(text))
    written["report"] = out / "compare.md"
    return written
