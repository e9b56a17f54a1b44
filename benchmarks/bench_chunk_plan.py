"""Sweep the chunk rows R of klpenalty.linear_kl and linear_policy_loss on CPU: time per row.

    .venv/bin/python benchmarks/bench_chunk_plan.py                       # the default grid
    .venv/bin/python benchmarks/bench_chunk_plan.py --shapes 32000:512:512 --rows 16 64 256
    .venv/bin/python benchmarks/bench_chunk_plan.py --fns linear_kl --repeats 5

Each shape ``V:H:N`` (vocabulary, hidden size of both models, rows) gets float32 hidden states
and heads (the policy's requiring grad, the reference frozen, no bias, tokens given) and is
timed, forward + backward, at every R of ``--rows`` that is ≤ N, at the default plan
(``chunk_rows=None``: :func:`klpenalty.linear.default_chunk_rows`) and at the former fixed
plan (R = 4M elements / V rows, a multiple of 16, at least 16: ``old_rows``):

- ``linear_kl``: Σ KL backpropagated (6 head GEMMs per chunk: the backward recomputes both
  models' logits);
- ``policy_loss``: ``linear_policy_loss`` with beta = 1, no advantages, reduction "sum" (the
  same Σ KL; 4 head GEMMs per chunk, the gradient formed in the forward).

A plan whose R equals a swept R is timed once. Rounds are interleaved (every R once per
round, ``--repeats`` rounds after one warm-up call per shape); medians. Reported per shape and
function: ms per row at each R, the default's R and the ratio of its median to the best R's
and to the former plan's. Every row records the thread count and the 1-minute load average.
Writes ``benchmarks/results/bench_chunk_plan.{csv,md}``.
"""

from __future__ import annotations

import argparse
import csv
import os
import platform
import statistics
import sys
import time

import torch

import klpenalty
from klpenalty.linear import default_chunk_rows

HERE = os.path.dirname(os.path.abspath(__file__))
FNS = ("linear_kl", "policy_loss")
ROWS = (16, 32, 64, 128, 256, 512, 1024)
# V:H:N. N is the largest swept R that the shape runs (the per-row cost grows with V·H; the
# largest heads run fewer rows): every swept R ≤ N gets whole chunks.
# A fourth field names the one function a shape runs (both by default).
SHAPES = ("32000:512:512", "32000:4096:128:linear_kl", "151936:896:256:linear_kl",
          "262144:512:128:linear_kl", "151936:2048:64:linear_kl")
OLD_CHUNK_ELEMENTS = 4 << 20  # the former fixed plan: R = 4M elements / V


def old_rows(n: int, vocab: int) -> int:
    """The former fixed CPU plan: 4M elements / V rows, a multiple of 16, ≥ 16, clipped to N."""
    return max(1, min(n, max(16, OLD_CHUNK_ELEMENTS // vocab // 16 * 16)))


def machine() -> str:
    """The CPU's model name (from /proc/cpuinfo where readable)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def make_inputs(n: int, hidden: int, vocab: int, seed: int = 0):
    """float32 hidden states and heads of two models whose logits are O(3), and tokens."""
    g = torch.Generator().manual_seed(seed)
    wp = torch.randn(vocab, hidden, generator=g).mul_(2.0 / hidden**0.5)
    wr = wp + torch.randn(vocab, hidden, generator=g).mul_(0.3 / hidden**0.5)
    hp = torch.randn(n, hidden, generator=g)
    hr = hp + 0.3 * torch.randn(n, hidden, generator=g)
    tokens = torch.randint(0, vocab, (n,), generator=g)
    return hp.requires_grad_(), wp.requires_grad_(), hr, wr, tokens


def step(fn: str, inputs, rows) -> None:
    """One forward + backward of ``fn`` at ``chunk_rows=rows``, gradients dropped after it."""
    hp, wp, hr, wr, tokens = inputs
    if fn == "linear_kl":
        klpenalty.linear_kl(hp, wp, hr, wr, tokens=tokens, chunk_rows=rows).kl.sum().backward()
    elif fn == "policy_loss":
        klpenalty.linear_policy_loss(hp, wp, hr, wr, tokens, beta=1.0, reduction="sum",
                                     chunk_rows=rows).loss.backward()
    else:
        raise ValueError(fn)
    hp.grad = wp.grad = None


def parse_shape(text: str) -> tuple[int, int, int, tuple]:
    """"V:H:N" or "V:H:N:fn" -> (V, H, N, the functions it runs (None = --fns))."""
    parts = text.split(":")
    try:
        vocab, hidden, n = (int(x) for x in parts[:3])
    except ValueError:
        raise SystemExit(f"--shapes takes V:H:N or V:H:N:fn, got {text!r}") from None
    if len(parts) > 4 or (len(parts) == 4 and parts[3] not in FNS):
        raise SystemExit(f"--shapes takes V:H:N or V:H:N:fn (fn of {FNS}), got {text!r}")
    return vocab, hidden, n, (parts[3],) if len(parts) == 4 else None


def sweep(args, vocab: int, hidden: int, n: int, fns) -> list[dict]:
    inputs = make_inputs(n, hidden, vocab)
    rule = default_chunk_rows(n, vocab, torch.device("cpu"), hidden, torch.float32)
    old = old_rows(n, vocab)
    plans = {r: r for r in args.rows if r <= n}  # label -> chunk_rows
    plans.setdefault(old, old)
    if rule not in plans:
        plans["default"] = None
    rows_of = {label: (rule if rows is None else rows) for label, rows in plans.items()}
    out = []
    for fn in fns or args.fns:
        step(fn, inputs, min(n, 16))  # warm-up: kernels loaded, allocator
        times: dict = {label: [] for label in plans}
        for _ in range(args.repeats):  # interleaved rounds
            for label, rows in plans.items():
                t0 = time.perf_counter()
                step(fn, inputs, rows)
                times[label].append(time.perf_counter() - t0)
        load = os.getloadavg()[0]
        med = {label: statistics.median(ts) for label, ts in times.items()}
        best = min(med, key=med.get)
        rule_label = "default" if "default" in plans else rule
        for label in sorted(plans, key=lambda k: rows_of[k]):
            row = {
                "V": vocab, "H": hidden, "N": n, "fn": fn, "R": rows_of[label],
                "plan": ("default" if rows_of[label] == rule else "")
                + (" old" if rows_of[label] == old else ""),
                "median_s": round(med[label], 4), "min_s": round(min(times[label]), 4),
                "ms_per_row": round(1e3 * med[label] / n, 3),
                "x_best": round(med[label] / med[best], 3), "repeats": args.repeats,
                "threads": args.threads, "loadavg_1m": round(load, 2),
            }
            row["plan"] = row["plan"].strip()
            row["default_R_large_N"] = default_chunk_rows(1 << 20, vocab, torch.device("cpu"),
                                                          hidden, torch.float32)
            out.append(row)
            print("  ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    return out


def summarise(rows: list[dict]) -> list[dict]:
    """Per shape and function: the default's R and its median over the best R's and over the
    former plan's (from the rows of every R)."""
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["V"], r["H"], r["N"], r["fn"]), []).append(r)
    out = []
    for (vocab, hidden, n, fn), rs in groups.items():
        med = lambda r: float(r["median_s"])  # noqa: E731
        rule = next(r for r in rs if "default" in r["plan"])
        old = next(r for r in rs if "old" in r["plan"])
        best = min(rs, key=med)
        out.append({
            "V": vocab, "H": hidden, "N": n, "fn": fn, "default_R": rule["R"],
            "default_R_large_N": rule["default_R_large_N"], "best_R": best["R"],
            "old_R": old["R"], "default_ms_per_row": rule["ms_per_row"],
            "best_ms_per_row": best["ms_per_row"], "old_ms_per_row": old["ms_per_row"],
            "default_x_best": round(med(rule) / med(best), 3),
            "default_x_old": round(med(rule) / med(old), 3), "loadavg_1m": rule["loadavg_1m"],
        })
    return out


def table(rows: list[dict]) -> str:
    fields = list(dict.fromkeys(k for r in rows for k in r))
    lines = ["| " + " | ".join(fields) + " |", "|" + "---|" * len(fields)]
    lines += ["| " + " | ".join(str(r.get(k, "")) for k in fields) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), help="V:H:N each")
    p.add_argument("--rows", nargs="+", type=int, default=list(ROWS), help="swept chunk rows R")
    p.add_argument("--fns", nargs="+", default=list(FNS), choices=list(FNS))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--out", default=os.path.join(HERE, "results", "bench_chunk_plan"))
    p.add_argument("--append", action="store_true",
                   help="keep the rows of --out's CSV (a rerun shape and function replaces its)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    rows = []
    for shape in args.shapes:
        rows += sweep(args, *parse_shape(shape))
    wall = time.perf_counter() - t0
    if args.append and os.path.exists(args.out + ".csv"):
        new = {(r["V"], r["H"], r["N"], r["fn"]) for r in rows}
        with open(args.out + ".csv", newline="") as f:
            kept = [r for r in csv.DictReader(f)
                    if (int(r["V"]), int(r["H"]), int(r["N"]), r["fn"]) not in new]
        rows = kept + rows
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
        w.writeheader()
        w.writerows(rows)
    with open(args.out + ".md", "w") as f:
        f.write(
            f"linear_kl / linear_policy_loss forward+backward against the chunk rows R, float32, "
            f"{time.strftime('%Y-%m-%d')}, {machine()}, {os.cpu_count()} cores, torch "
            f"{torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
            f"{args.threads} threads, loadavg (1 min) {load0:.2f} at the start, "
            f"{os.getloadavg()[0]:.2f} at the end, {wall:.0f} s ("
            f"{'the rows of this run; earlier rows kept: each carries its load' if args.append else 'in all'}); medians of "
            f"{args.repeats} interleaved rounds. `default`: the plan of "
            f"default_chunk_rows; `old`: the former fixed plan (4M elements / V rows).\n\n"
            "Per shape and function: the default's R at this N (and at large N), the best swept "
            "R, the former plan's R, ms per row, and the default's median over the best's "
            "and the former plan's.\n\n"
        )
        f.write(table(summarise(rows)))
        f.write("\nEvery R:\n\n")
        f.write(table(rows))
    print(f"wrote {args.out}.csv and {args.out}.md ({wall:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
