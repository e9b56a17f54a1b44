"""The divergences of klpenalty.divergence on CPU: every kind against the reverse KL, per backend.

The reverse KL is the forward op's KL column (one read of both logits); every other kind is
that forward (for both normalisers) plus the second walk (``<backend>_divergence``: a second
read of both logits), and its backward one more read of both and the gradient's write. Side by
side in one process for each CPU backend (``klpenalty.ops.dispatch.device_backends``): every
kind, forward and forward+backward of the sum of the values, interleaved rounds (each round
calls every kind once, in turn), medians; ``× reverse_kl`` is the kind's median over the
reverse KL's of the same backend and mode. ``check=False`` (no host read for the NaN check).
Writes ``benchmarks/results/bench_divergence.{md,csv}`` with the machine and the 1-minute load
average at the start and the end of each mode.

    .venv/bin/python benchmarks/bench_divergence.py [--n 2048] [--vocab 32000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import time

import torch

import klpenalty
from klpenalty.ops.dispatch import device_backends

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_chunk_plan import machine  # noqa: E402  (the benchmarks' machine name)

PARAMS = dict(beta=0.5, skew=0.1)  # the defaults of klpenalty.divergence


def run(x: torch.Tensor, y: torch.Tensor, kind: str, backend: str, mode: str) -> None:
    out = klpenalty.divergence(x, y, kind, backend=backend, check=False, **PARAMS)
    if mode == "fwd+bwd":
        out.sum().backward()
        x.grad = None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=2048, help="rows (positions)")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--backends", nargs="*", default=None, help="default: every CPU backend")
    p.add_argument("--out", default=os.path.join(HERE, "results", "bench_divergence"))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.n, args.vocab, generator=g) * 2
    y = x + torch.randn(args.n, args.vocab, generator=g)
    backends = args.backends or device_backends(x.device)
    kinds = list(klpenalty.DIVERGENCES)
    rows, loads = [], {}
    for mode in ("fwd", "fwd+bwd"):
        xg = x.detach().requires_grad_(mode == "fwd+bwd")
        cases = [(b, k) for b in backends for k in kinds]
        times: dict[tuple[str, str], list[float]] = {c: [] for c in cases}
        start = os.getloadavg()[0]
        for backend, kind in cases:  # warm-up (native build, allocator)
            run(xg, y, kind, backend, mode)
        for _ in range(args.repeats):  # interleaved rounds
            for backend, kind in cases:
                t0 = time.perf_counter()
                run(xg, y, kind, backend, mode)
                times[(backend, kind)].append(time.perf_counter() - t0)
        loads[mode] = (start, os.getloadavg()[0])
        for backend in backends:
            base = statistics.median(times[(backend, "reverse_kl")])
            for kind in kinds:
                med = statistics.median(times[(backend, kind)])
                rows.append({
                    "backend": backend, "mode": mode, "kind": kind,
                    "median_ms": round(med * 1e3, 1), "x_reverse_kl": round(med / base, 2),
                    "loadavg": round(loads[mode][1], 2),
                })
                print(rows[-1], flush=True)
    shape = (f"({args.n}, {args.vocab}) float32, x = 2·N(0, 1), y = x + N(0, 1), "
             f"{args.threads} threads, median of {args.repeats}")
    load_text = ", ".join(f"{mode} {a:.2f} → {b:.2f}" for mode, (a, b) in loads.items())
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    with open(args.out + ".md", "w") as f:
        f.write(f"# klpenalty.divergence per kind, {shape}\n\n")
        f.write(f"Machine: {machine()}, torch {torch.__version__} "
                f"({torch.backends.cpu.get_cpu_capability()}). 1-minute load average (start → end): "
                f"{load_text}. Run of {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.\n\n")
        f.write("| backend | mode | kind | median ms | × reverse_kl |\n|---|---|---|---:|---:|\n")
        for r in rows:
            f.write(f"| {r['backend']} | {r['mode']} | {r['kind']} | {r['median_ms']} | "
                    f"{r['x_reverse_kl']} |\n")
    print(f"wrote {args.out}.md / .csv")


if __name__ == "__main__":
    main()
