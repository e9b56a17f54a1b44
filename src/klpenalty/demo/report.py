"""The demo's report: final table, ``metrics.json``, ``report.md`` and the figures.

matplotlib (the ``demo`` extra) is imported only when a figure is drawn.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Sequence

__all__ = ["final_table", "kl_report_section", "write_report", "plot_demo", "plot_sweep"]

COLUMNS = (
    ("proxy", "proxy", "{:.2f}"),
    ("gold", "gold", "{:.2f}"),
    ("grammatical", "grammatical", "{:.0%}"),
    ("kl", "KL (nats)", "{:.1f}"),
    ("distinct2", "distinct-2", "{:.3f}"),
    ("ref_nll", "ref NLL/token", "{:.2f}"),
    ("length", "length", "{:.1f}"),
)


def final_table(runs: Sequence[dict]) -> str:
    """Markdown table: a ``start`` row (the reference's own samples) and each run's last step."""
    head = "| β | " + " | ".join(name for _, name, _ in COLUMNS) + " |"
    rule = "|---" * (len(COLUMNS) + 1) + "|"
    rows = [head, rule]

    def row(label: str, m: dict) -> str:
        cells = [fmt.format(m[key]) for key, _, fmt in COLUMNS]
        return f"| {label} | " + " | ".join(cells) + " |"

    if runs:
        rows.append(row("start", runs[0]["steps"][0]))
    for r in runs:
        label = r["config"]["label"].replace("β=", "")
        if r["config"]["adaptive_target"] is not None:
            label += f" → β={r['steps'][-1]['beta']:.3g}"
        rows.append(row(label, r["steps"][-1]))
    return "\n".join(rows)


def kl_report_section(runs: Sequence[dict]) -> list[str]:
    """Markdown lines: each run's ``klpenalty.kl_report`` of its final evaluation batch."""
    lines = [
        "## KL report (final evaluation batch)",
        "",
        "`klpenalty.kl_report(policy_logits, ref_logits, tokens, mask)` on the final samples: "
        "the exact KL next to the k1, k2, k3 estimates of the sampled tokens (the reward uses "
        "k1), each estimator's bias and spread against the exact KL, and the positions and "
        "tokens that carry most of it.",
        "",
    ]
    for r in runs:
        if "kl_report_text" in r:
            words = ", ".join(f"{i} `{w}`" for i, w in r.get("kl_report_words", {}).items())
            lines += [f"**{r['config']['label']}**", "", "```", r["kl_report_text"].rstrip(),
                      "```", ""]
            if words:
                lines += [f"Tokens: {words}.", ""]
    return lines


def _sqrt_kl(steps: Sequence[dict]) -> list[float]:
    return [math.sqrt(max(s["kl"], 0.0)) for s in steps]


def plot_demo(runs: Sequence[dict], path: Path) -> Path:
    """2×3 figure: proxy, KL (log), % grammatical, gold & proxy vs √KL, distinct-2, ref NLL."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(13, 8.4))
    colors = plt.get_cmap("viridis")
    for i, r in enumerate(runs):
        c = colors(0.85 * i / max(1, len(runs) - 1))
        st = r["steps"]
        x = [s["step"] for s in st]
        lab = r["config"]["label"]
        axes[0, 0].plot(x, [s["proxy"] for s in st], color=c, label=lab)
        kl = [(s["step"], s["kl"]) for s in st if s["kl"] > 1e-3]
        axes[0, 1].plot([a for a, _ in kl], [b for _, b in kl], color=c, label=lab)
        axes[0, 2].plot(x, [100 * s["grammatical"] for s in st], color=c, label=lab)
        sk = _sqrt_kl(st)
        axes[1, 0].plot(sk, [s["gold"] for s in st], color=c, label=f"{lab} gold")
        axes[1, 0].plot(sk, [s["proxy"] for s in st], color=c, ls="--", alpha=0.6)
        axes[1, 1].plot(x, [s["distinct2"] for s in st], color=c, label=lab)
        axes[1, 2].plot(x, [s["ref_nll"] for s in st], color=c, label=lab)
    titles = [
        ("proxy reward: count of 'helpful'", "PPO step", "proxy"),
        ("exact KL(π‖ρ) per text", "PPO step", "nats (log scale)"),
        ("grammatical samples", "PPO step", "%"),
        ("gold (solid) and proxy (dashed) vs √KL", "√KL (√nats)", "reward"),
        ("diversity: distinct-2", "PPO step", "distinct-2"),
        ("reference NLL per token", "PPO step", "nats/token"),
    ]
    for ax, (t, xl, yl) in zip(axes.flat, titles):
        ax.set_title(t, fontsize=11)
        ax.set_xlabel(xl)
        ax.set_ylabel(yl)
        ax.grid(alpha=0.3)
    axes[0, 1].set_yscale("log")
    axes[0, 2].set_ylim(-3, 103)
    axes[0, 0].legend(fontsize=9)
    fig.suptitle("RLHF on a tiny GPT: reward = count('helpful'), with and without the KL penalty")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def plot_sweep(runs: Sequence[dict], path: Path) -> Path:
    """Gold against √KL for every run (Gao et al. 2022), and final gold/proxy against β."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fixed = sorted(
        (r for r in runs if r["config"]["adaptive_target"] is None), key=lambda r: r["config"]["beta"]
    )
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.8))
    cmap = plt.get_cmap("plasma")
    for i, r in enumerate(fixed):
        c = cmap(0.85 * i / max(1, len(fixed) - 1))
        st = r["steps"]
        ax.plot(_sqrt_kl(st), [s["gold"] for s in st], color=c, marker=".", ms=3,
                label=r["config"]["label"])
    ax.set_xlabel("√KL (√nats)")
    ax.set_ylabel("gold reward")
    ax.set_title("gold vs √KL, every step of every run")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    betas = [r["config"]["beta"] for r in fixed]
    pos = [max(b, 1e-2) for b in betas]  # β = 0 drawn at the left edge of the log axis
    bx.plot(pos, [r["steps"][-1]["gold"] for r in fixed], "o-", label="gold")
    bx.plot(pos, [r["steps"][-1]["proxy"] for r in fixed], "s--", label="proxy")
    bx.set_xscale("log")
    bx.set_xlabel("β (β = 0 drawn at 0.01)")
    bx.set_ylabel("reward at the last step")
    bx.set_title("choosing β")
    bx.legend()
    bx.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def write_report(
    out: Path,
    runs: Sequence[dict],
    meta: dict,
    sweep_runs: Sequence[dict] = (),
    plots: bool = True,
) -> dict[str, Path]:
    """Write ``metrics.json``, ``report.md`` and (with matplotlib) ``demo.png`` /
    ``sweep.png`` into ``out``. Returns the paths written, by name."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written: dict[str, Path] = {}
    metrics = {**meta, "runs": list(runs), "sweep_runs": list(sweep_runs)}
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1, ensure_ascii=False))
    written["metrics"] = out / "metrics.json"
    figure_note = ""
    if plots:
        try:
            written["figure"] = plot_demo(runs, out / "demo.png")
            if sweep_runs:
                written["sweep"] = plot_sweep([*runs, *sweep_runs], out / "sweep.png")
        except ImportError:
            figure_note = "(matplotlib is not installed: `pip install klpenalty[demo]` for figures)"
    start = runs[0]["steps"][0] if runs else None
    lines = [
        "# klpenalty demo: RLHF with and without the KL penalty",
        "",
        f"Command: `{meta.get('command', 'klpenalty demo')}` — {meta.get('wall_seconds', 0):.0f} s "
        f"wall time, {meta.get('config', {}).get('steps')} PPO steps × "
        f"{meta.get('config', {}).get('batch')} samples per β, seed {meta.get('config', {}).get('seed')}.",
        "",
        "A tiny GPT pretrained on a synthetic English grammar is tuned with PPO to maximise a "
        "hackable *proxy* reward, the number of times it writes `helpful`. The *gold* reward "
        "counts `helpful` only inside grammatical text: on the reference model's own samples the "
        "two agree. The KL is exact: the sum of the full-vocabulary KL(π‖ρ) over the sampled "
        "text, not an estimate. The per-token penalty in the reward is β × k1 = β·(log π − log ρ).",
        "",
        "## Final step",
        "",
        final_table(runs),
        "",
        f"`start`: the reference's own samples (step 0, {start['samples'] if start else 0} texts); "
        f"other rows: {runs[-1]['steps'][-1]['samples'] if runs else 0} fresh samples from the "
        "final policy. `grammatical`: a complete document, or a grammatical prefix cut off at "
        "the length limit. `gold`: the `helpful`s of grammatical text (all of them if the text "
        "is grammatical, else those in the sentences before the first error).",
        "",
    ]
    if sweep_runs:
        lines += ["## β sweep", "", final_table(sorted(
            [*runs, *sweep_runs], key=lambda r: (r["config"]["adaptive_target"] is not None,
                                                  r["config"]["beta"]))), ""]
    if "figure" in written:
        lines += ["![demo](demo.png)", ""]
    if "sweep" in written:
        lines += ["![sweep](sweep.png)", ""]
    if figure_note:
        lines += [figure_note, ""]
    lines += kl_report_section(runs)
    lines += ["## Samples (final step)", ""]
    for r in runs:
        lines.append(f"**{r['config']['label']}**")
        lines.append("")
        lines += [f"- `{s}`" for s in r["samples"]]
        lines.append("")
    if start is not None and runs:
        leashed = [r for r in runs if r["config"]["beta"] > 0 or r["config"]["adaptive_target"]]
        if leashed:
            d2 = ", ".join(
                f"{r['steps'][-1]['distinct2']:.3f} ({r['config']['label']})" for r in leashed
            )
            lines += [
                "## What the leash does not prevent",
                "",
                f"Diversity drops even under the KL penalty: distinct-2 falls from "
                f"{start['distinct2']:.3f} on the reference's samples to {d2}. The penalty "
                "bounds how far the policy moves from the reference in KL, and the cheapest "
                "way to gain reward within that budget is to say the rewarded thing more often "
                "in fewer ways: the text stays grammatical but gets repetitive "
                "(`the helpful X is helpful .`). Length also grows first: the policy learns to "
                "postpone `<eos>` to make room for more `helpful`.",
                "",
            ]
    (out / "report.md").write_text("\n".join(lines))
    written["report"] = out / "report.md"
    return written
