"""``klpenalty demo``: pretrain (optionally), run RLHF for several β in parallel, report.

``--compare`` runs the grid of :mod:`.compare` (every KL recipe under a PPO and a GRPO update,
over a β grid) instead, and ``--distill`` the distillation runs of :mod:`.distill` (one per
recipe), with the same workers, progress lines and resumption."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
import traceback
from dataclasses import asdict, replace
from pathlib import Path

__all__ = ["add_arguments", "run_demo", "DEFAULT_BETAS", "SWEEP_BETAS"]

# Pinned together with the shipped reference checkpoint: a `helpful` the reference would not
# write costs about β × 10 nats against +1 reward, so β ≈ 0.1 is break-even.
DEFAULT_BETAS = (0.0, 0.1, 0.3)
SWEEP_BETAS = (0.0, 0.03, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``klpenalty demo`` options."""
    from .compare import COMPARE_BETAS
    from .distill import DISTILL_RECIPES, DistillConfig
    from .rlhf import KL_MODES, UPDATES, RunConfig

    d, dd = RunConfig(), DistillConfig()

    p.add_argument("--beta", type=float, nargs="+", default=None,
                   help="KL coefficients, one run (process) each (default: 0 0.1 0.3; with "
                        f"--compare: {' '.join(f'{b:g}' for b in COMPARE_BETAS)}, plus 0)")
    p.add_argument("--kl", choices=KL_MODES, default="k1", metavar="RECIPE",
                   help="where the KL goes: k1 = k1-reward, β·(log π − log ρ) per sampled "
                        "token in the reward (default); full = exact-split, the exact "
                        "full-vocabulary KL done correctly (the KL of later positions in the "
                        "return, the current one in the loss); exact-loss, exact-reward, "
                        "k3-loss, k3-ratio-loss: see docs/demo.md")
    p.add_argument("--update", choices=UPDATES, default=d.update,
                   help="ppo: reward-to-go with a per-position baseline (default); grpo: "
                        "group-normalised sequence advantages")
    p.add_argument("--group", type=int, default=d.group,
                   help=f"texts per group for --update grpo (default {d.group})")
    p.add_argument("--compare", action="store_true",
                   help="run every KL recipe under PPO and GRPO over a β grid and write "
                        "compare.png, compare.md and compare.json (44 runs, docs/demo.md); "
                        "an interrupted grid resumes from OUT/compare-runs/")
    p.add_argument("--distill", action="store_true",
                   help="on-policy distillation instead of RLHF: the reference (teacher) into a "
                        "smaller student trained from scratch, one run per recipe ("
                        f"{', '.join(DISTILL_RECIPES)}); writes distill.png, distill.md and "
                        "distill.json (docs/demo.md); an interrupted set resumes from "
                        "OUT/distill-runs/")
    p.add_argument("--width", type=int, default=dd.width,
                   help=f"--distill: the student's hidden size (default {dd.width}; the "
                        "teacher's is 64)")
    p.add_argument("--adaptive", type=float, metavar="TARGET", default=None,
                   help="use AdaptiveKLController aiming at TARGET nats for every β > 0 "
                        "(β is then its initial value; β = 0 stays an unpenalised baseline)")
    p.add_argument("--horizon", type=float, default=d.horizon,
                   help=f"adaptive controller horizon in samples (default {d.horizon:g})")
    p.add_argument("--steps", type=int, default=None,
                   help=f"PPO steps (default {d.steps}; with --distill, updates: {dd.steps})")
    p.add_argument("--batch", type=int, default=None,
                   help=f"samples per step (default {d.batch}; with --distill {dd.batch})")
    p.add_argument("--max-new", type=int, default=d.max_new,
                   help=f"generation length limit (default {d.max_new}, at most 32)")
    p.add_argument("--lr", type=float, default=None,
                   help=f"Adam learning rate (default {d.lr:g}; with --distill {dd.lr:g})")
    p.add_argument("--epochs", type=int, default=d.epochs,
                   help=f"PPO epochs per batch (default {d.epochs})")
    p.add_argument("--final-batch", type=int, default=None,
                   help=f"samples for the final evaluation (default {d.final_batch}; with "
                        f"--distill {dd.final_batch})")
    p.add_argument("--reward-scale", type=float, default=d.reward_scale,
                   help="score = scale × count('helpful') (default 1)")
    p.add_argument("--seed", type=int, default=d.seed, help="random seed (default 0)")
    p.add_argument("--out", type=Path, default=Path("klpenalty-demo"),
                   help="report folder (default ./klpenalty-demo)")
    p.add_argument("--jobs", type=int, default=None,
                   help="parallel processes (default: one per run, with --compare and "
                        "--distill one per CPU; 1 = in this process)")
    p.add_argument("--sweep", action="store_true",
                   help=f"also run β in {list(SWEEP_BETAS)} and draw gold vs √KL for all runs")
    p.add_argument("--ref", type=Path, default=None,
                   help="reference checkpoint (default: the one shipped in the package)")
    p.add_argument("--pretrain", action="store_true",
                   help="first rebuild the reference (deterministic, about a minute) into "
                        "OUT/ref.pt and use it")
    p.add_argument("--pretrain-only", action="store_true",
                   help="rebuild the reference into OUT/ref.pt and stop")
    p.add_argument("--pretrain-steps", type=int, default=600,
                   help="pretraining steps (default 600, as the shipped checkpoint)")
    p.add_argument("--no-plots", action="store_true", help="skip the figures")


# what a run's progress line shows: (metric, name, format)
RLHF_FIELDS = (("proxy", "proxy", "{:5.2f}"), ("gold", "gold", "{:5.2f}"),
               ("grammatical", "gram", "{:4.0%}"), ("kl", "KL", "{:6.1f}"))


class _Progress:
    """One status line per run; redrawn in place on a terminal, else printed every 10 steps."""

    def __init__(self, labels: list[str], steps: int, stream=None, every: int = 10,
                 redraw: bool = True, fields=RLHF_FIELDS) -> None:
        self.fields = fields
        self.labels = labels
        self.steps = steps
        self.every = every
        self.stream = stream = stream if stream is not None else sys.stdout
        self.tty = redraw and stream.isatty()
        self.done = 0
        self.width = max(len(lab) for lab in labels)
        self.lines = [self._fmt(lab, None, None) for lab in labels]
        self.last_draw = 0.0
        self.drawn = False

    def _fmt(self, label: str, step: int | None, m: dict | None) -> str:
        if m is None:
            return f"{label:>{self.width}}  starting"
        n = 20
        k = round(n * step / max(1, self.steps))
        bar = "#" * k + "-" * (n - k)
        shown = "  ".join(f"{name} {fmt.format(m[key])}" for key, name, fmt in self.fields)
        return f"{label:>{self.width}} [{bar}] {step:>3}/{self.steps}  {shown}"

    def update(self, i: int, step: int, m: dict) -> None:
        self.lines[i] = self._fmt(self.labels[i], step, m)
        if self.tty:
            now = time.monotonic()
            if now - self.last_draw > 0.1 or step == self.steps:
                self.draw()
                self.last_draw = now
        elif step % self.every == 0 or step == self.steps:
            line = self.lines[i]
            if step == self.steps:
                self.done += 1
                line += f"  ({self.done}/{len(self.labels)} runs done)"
            print(line, file=self.stream, flush=True)

    def draw(self) -> None:
        if self.drawn:
            self.stream.write(f"\x1b[{len(self.lines)}F")
        self.stream.write("".join(f"\x1b[2K{line}\n" for line in self.lines))
        self.stream.flush()
        self.drawn = True


def _task(name: str):
    """``(config class, run function, progress fields)`` of a kind of run: "rlhf" or
    "distill"."""
    if name == "distill":
        from .distill import PROGRESS_FIELDS, DistillConfig, run_distill

        return DistillConfig, run_distill, PROGRESS_FIELDS
    from .rlhf import RunConfig, run_rlhf

    return RunConfig, run_rlhf, RLHF_FIELDS


def _worker(index: int, cfg: dict, ref_path, queue, task: str = "rlhf") -> None:
    import torch

    torch.set_num_threads(1)
    config, run, fields = _task(task)
    try:
        slim = [key for key, _, _ in fields]
        result = run(
            config(**cfg), ref_path,
            progress=lambda s, m: queue.put(("step", index, s, {k: m[k] for k in slim})),
        )
        queue.put(("done", index, result))
    except BaseException:  # report to the parent, which raises
        queue.put(("error", index, traceback.format_exc()))


def _run_all(configs: list, ref_path, jobs: int, progress: _Progress,
             on_done=None, task: str = "rlhf") -> list[dict]:
    """Every run of ``task`` ("rlhf" or "distill"), ``jobs`` at a time in spawned processes
    (in this one if ``jobs <= 1``); ``on_done(index, result)`` is called as each one
    finishes."""
    _, run, _ = _task(task)
    if jobs <= 1:
        results = []
        for i, cfg in enumerate(configs):
            slim = lambda s, m, i=i: progress.update(i, s, m)  # noqa: E731
            results.append(run(cfg, ref_path, progress=slim))
            if on_done is not None:
                on_done(i, results[-1])
        return results
    import multiprocessing as mp

    ctx = mp.get_context("spawn")  # fork is unsafe once torch has started its thread pools
    queue = ctx.Queue()
    pending = list(enumerate(configs))
    running: dict[int, object] = {}
    results: dict[int, dict] = {}
    try:
        while pending or running:
            while pending and len(running) < jobs:
                i, cfg = pending.pop(0)
                proc = ctx.Process(target=_worker,
                                   args=(i, asdict(cfg), ref_path, queue, task))
                proc.start()
                running[i] = proc
            msg = queue.get()
            if msg[0] == "step":
                progress.update(msg[1], msg[2], msg[3])
            elif msg[0] == "done":
                results[msg[1]] = msg[2]
                running.pop(msg[1]).join()
                if on_done is not None:
                    on_done(msg[1], msg[2])
            else:
                raise RuntimeError(f"run {configs[msg[1]].label} failed:\n{msg[2]}")
    finally:
        for proc in running.values():
            proc.terminate()
            proc.join()
    return [results[i] for i in range(len(configs))]


def _pretrain(out: Path, steps: int, seed: int) -> Path:
    import torch

    from .pretrain import pretrain, save_checkpoint

    torch.set_num_threads(1)
    tty = sys.stdout.isatty()

    def show(step: int, total: int, loss: float) -> None:
        if (tty and step % 10 == 0) or step == total or (not tty and step % 100 == 0):
            k = round(30 * step / total)
            end = "\n" if step == total or not tty else "\r"
            print(f"pretraining [{'#' * k}{'-' * (30 - k)}] {step}/{total} loss {loss:.3f}",
                  end=end, flush=True)

    t0 = time.perf_counter()
    model, vocab, info = pretrain(steps=steps, seed=seed, progress=show)
    path = save_checkpoint(model, vocab, info, out / "ref.pt")
    print(
        f"reference: {path} ({path.stat().st_size / 1e3:.0f} kB) in {time.perf_counter() - t0:.0f} s; "
        f"held-out NLL {info['val_nll_per_token']:.3f} nats/token (grammar "
        f"≈ {info['grammar_nll_per_token']:.3f}), {info['grammatical']:.1%} grammatical samples"
    )
    return path


def run_demo(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    """Run the demo from parsed ``klpenalty demo`` options; returns the exit code."""
    import torch

    from .distill import DistillConfig
    from .pretrain import load_checkpoint
    from .report import final_table, write_report
    from .rlhf import RunConfig

    t0, cpu0 = time.perf_counter(), time.process_time()
    torch.set_num_threads(1)
    if args.max_new > 32 or args.max_new < 1:
        raise SystemExit("--max-new must be in [1, 32] (the model's context)")
    if args.distill:
        if args.compare:
            raise SystemExit("--distill and --compare are separate demos: pick one")
        if args.adaptive is not None or args.beta is not None or args.sweep:
            raise SystemExit("--distill has no KL coefficient: drop --beta / --adaptive / --sweep")
    elif args.width != DistillConfig().width:
        raise SystemExit("--width is the --distill student's: add --distill")
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    ref_path = args.ref
    if args.pretrain or args.pretrain_only:
        ref_path = _pretrain(out, args.pretrain_steps, args.seed)
        if args.pretrain_only:
            return 0
    _, _, ref_info = load_checkpoint(ref_path)
    if args.distill:
        return _run_distill(args, argv, ref_path, ref_info, t0, cpu0)

    d = RunConfig()
    base = RunConfig(
        horizon=args.horizon, steps=_or(args.steps, d.steps), batch=_or(args.batch, d.batch),
        max_new=args.max_new, lr=_or(args.lr, d.lr), epochs=args.epochs,
        reward_scale=args.reward_scale, seed=args.seed,
        final_batch=_or(args.final_batch, d.final_batch), kl=args.kl, update=args.update,
        group=args.group,
    )
    if args.compare:
        return _run_compare(args, argv, base, ref_path, ref_info, t0, cpu0)
    betas = args.beta if args.beta is not None else DEFAULT_BETAS

    def make(beta: float) -> RunConfig:
        if beta < 0:
            raise SystemExit(f"--beta values must be >= 0, got {beta}")
        target = args.adaptive if (args.adaptive is not None and beta > 0) else None
        return replace(base, beta=beta, adaptive_target=target, label="")

    configs = [make(b) for b in dict.fromkeys(betas)]
    sweep_configs = []
    if args.sweep:
        sweep_configs = [
            replace(base, beta=b, adaptive_target=None, label="") for b in SWEEP_BETAS
            if not any(c.beta == b and c.adaptive_target is None for c in configs)
        ]
    everything = configs + sweep_configs
    jobs = args.jobs if args.jobs is not None else len(everything)
    print(
        f"RLHF: {len(everything)} run(s) × {base.steps} PPO steps × {base.batch} samples, "
        f"{min(jobs, len(everything))} process(es), 1 torch thread each, seed {base.seed}"
    )
    progress = _Progress([c.label for c in everything], base.steps)
    results = _run_all(everything, str(ref_path) if ref_path else None, jobs, progress)
    runs, sweep_runs = results[: len(configs)], results[len(configs):]

    wall = time.perf_counter() - t0
    meta = _meta(argv, wall, base, ref_path, ref_info)
    written = write_report(out, runs, meta, sweep_runs, plots=not args.no_plots)
    print()
    print(final_table(runs))
    if sweep_runs:
        print("\nβ sweep:")
        print(final_table(sweep_runs))
    print(f"\nreport: {written['report']}  ({', '.join(p.name for p in written.values())}) "
          f"in {out}; {wall:.0f} s")
    return 0


def _meta(argv, wall: float, base, ref_path, ref_info: dict) -> dict:
    """The run description both reports start with."""
    import torch

    command = "klpenalty " + (" ".join(shlex.quote(a) for a in argv) if argv else "demo")
    return {
        "command": command,
        "wall_seconds": wall,
        "config": {k: v for k, v in asdict(base).items() if k not in ("beta", "label")},
        "reference": {"path": str(ref_path) if ref_path else "shipped", **ref_info},
        "torch": str(torch.__version__),
        "cpus": os.cpu_count(),
    }


def _run_compare(args, argv, base, ref_path, ref_info: dict, t0: float, cpu0: float) -> int:
    """``--compare``: the grid of :func:`.compare.compare_configs`, one line per finished run."""
    from .compare import (
        COMPARE_BETAS,
        compare_configs,
        load_run,
        run_file,
        save_run,
        write_compare,
    )

    betas = args.beta if args.beta is not None else COMPARE_BETAS
    if any(b < 0 for b in betas):
        raise SystemExit(f"--beta values must be >= 0, got {betas}")
    if args.adaptive is not None:
        raise SystemExit("--compare runs fixed β only: drop --adaptive")
    configs = compare_configs(base, betas)
    runs, meta = _run_resumable(
        "compare", configs, args.out / "compare-runs", run_file, load_run, save_run, args, argv,
        base, ref_path, ref_info, t0, cpu0)
    meta["config"] = {k: v for k, v in meta["config"].items() if k not in ("kl", "update")}
    written = write_compare(out=args.out, runs=runs, meta=meta, plots=not args.no_plots)
    return _finish(written, args.out, meta)


def _run_distill(args, argv, ref_path, ref_info: dict, t0: float, cpu0: float) -> int:
    """``--distill``: one distillation run per recipe (:func:`.distill.distill_configs`)."""
    from .distill import (
        DistillConfig,
        PROGRESS_FIELDS,
        distill_configs,
        distill_run_file,
        load_distill_run,
        save_distill_run,
        teacher_point,
        write_distill,
    )

    d = DistillConfig()
    base = DistillConfig(
        steps=_or(args.steps, d.steps), batch=_or(args.batch, d.batch), max_new=args.max_new,
        lr=_or(args.lr, d.lr), width=args.width, final_batch=_or(args.final_batch, d.final_batch),
        seed=args.seed,
    )
    configs = distill_configs(base)
    runs, meta = _run_resumable(
        "distill", configs, args.out / "distill-runs", distill_run_file, load_distill_run,
        save_distill_run, args, argv, base, ref_path, ref_info, t0, cpu0, task="distill",
        fields=PROGRESS_FIELDS)
    meta["config"] = {k: v for k, v in meta["config"].items() if k != "recipe"}
    meta["teacher"] = teacher_point(ref_path, base.final_batch, base.max_new, base.seed)
    written = write_distill(out=args.out, runs=runs, meta=meta, plots=not args.no_plots)
    return _finish(written, args.out, meta)


def _or(value, default):
    return default if value is None else value


def _run_resumable(name: str, configs: list, runs_dir: Path, run_file, load_run, save_run,
                   args, argv, base, ref_path, ref_info: dict, t0: float, cpu0: float,
                   task: str = "rlhf", fields=RLHF_FIELDS) -> tuple[list[dict], dict]:
    """Every run of ``configs`` not already finished in ``runs_dir`` (each one is written
    there as it finishes, so an interrupted grid resumes), one line per finished run; returns
    the runs in order and the report's description: settings, wall and CPU seconds, load
    average, runs read back."""
    done = {i: r for i, c in enumerate(configs)
            if (r := load_run(run_file(runs_dir, c), c)) is not None}
    todo = [i for i in range(len(configs)) if i not in done]
    children0 = _children_cpu()
    jobs = args.jobs if args.jobs is not None else (os.cpu_count() or 1)
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    print(
        f"{name}: {len(configs)} run(s) × {base.steps} steps × {base.batch} samples, "
        f"{min(jobs, max(1, len(todo)))} process(es), 1 torch thread each, seed {base.seed}"
        + (f"; {len(done)} run(s) already in {runs_dir}" if done else "")
        + (f"; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}" if load else "")
    )
    pending = [configs[i] for i in todo]
    progress = _Progress([c.label for c in pending], base.steps, every=max(1, base.steps),
                         redraw=False, fields=fields) if pending else None
    fresh = _run_all(pending, str(ref_path) if ref_path else None, jobs, progress,
                     on_done=lambda i, r: save_run(run_file(runs_dir, pending[i]), r), task=task)
    resumed = len(done)
    done.update(zip(todo, fresh))
    runs = [done[i] for i in range(len(configs))]
    meta = _meta(argv, time.perf_counter() - t0, base, ref_path, ref_info)
    end = os.getloadavg() if hasattr(os, "getloadavg") else None
    meta["load_average"] = " → ".join(
        " ".join(f"{x:.2f}" for x in la) for la in (load, end) if la is not None)
    # CPU time of this process and of the workers it waited for, so the wall time on an idle
    # machine can be estimated on a busy one (CPU seconds / cores)
    meta["cpu_seconds"] = time.process_time() - cpu0 + _children_cpu() - children0
    meta["runs_resumed"] = resumed  # read back from runs_dir, not timed here
    return runs, meta


def _finish(written: dict, out: Path, meta: dict) -> int:
    print()
    print(written["report"].read_text())
    print(f"\nreport: {written['report']}  ({', '.join(p.name for p in written.values())}) "
          f"in {out}; {meta['wall_seconds']:.0f} s")
    return 0


def _children_cpu() -> float:
    """User + system CPU seconds of the finished child processes (0 where unknown)."""
    try:
        import resource
    except ImportError:  # not on POSIX
        return 0.0
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime
