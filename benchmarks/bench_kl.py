"""Benchmark the exact KL at LLM-sized shapes (Llama-2, Llama-3, Qwen2 vocabularies); writes benchmarks/results/bench_kl.{csv,md}.

    PYTHONPATH=src python benchmarks/bench_kl.py --threads 1            # everything (long)
    PYTHONPATH=src python benchmarks/bench_kl.py --quick                # S1 fp32 only
    PYTHONPATH=src python benchmarks/bench_kl.py --shapes S3 --dtypes bf16 \
        --providers seed streaming

Each (shape, dtype) is timed in this process, providers side by side with interleaved rounds;
peak memory is measured in a fresh subprocess per provider (see klpenalty/bench.py). The big
shapes need several GiB for the seed formula: run them one at a time on a shared machine.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from klpenalty import bench

HERE = os.path.dirname(os.path.abspath(__file__))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--shapes", nargs="+", default=list(bench.SHAPES), choices=list(bench.SHAPES))
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=list(bench.DTYPES))
    p.add_argument("--modes", nargs="+", default=["fwd", "fwdbwd"], choices=["fwd", "fwdbwd"])
    p.add_argument("--providers", nargs="+", default=None)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--load", type=int, default=0, help="busy processes running meanwhile")
    p.add_argument("--no-memory", action="store_true")
    p.add_argument(
        "--clock", choices=list(bench.CLOCKS), default="wall",
        help="thread: this thread's CPU time (one thread, a machine shared with other jobs)",
    )
    p.add_argument("--quick", action="store_true", help="S1 fp32 only, 3 rounds")
    p.add_argument("--out", default=os.path.join(HERE, "results", "bench_kl"), help="path stem")
    p.add_argument(
        "--remeasure-memory",
        action="store_true",
        help="only redo the memory probes of the CSV's rows for --shapes/--dtypes, then re-render",
    )
    args = p.parse_args(argv)
    if args.remeasure_memory:
        return _remeasure(args)
    if args.quick:
        args.shapes, args.dtypes, args.repeats = ["S1"], ["fp32"], 3
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    for name in args.shapes:
        for dtype in args.dtypes:
            t0 = time.time()
            rows = bench.run_benchmark(
                bench.SHAPES[name],
                dtype,
                modes=tuple(args.modes),
                names=args.providers,
                repeats=args.repeats,
                memory=not args.no_memory,
                threads=args.threads,
                load=args.load,
                clock=args.clock,
                shape_name=f"{name} {bench.SHAPES[name]}",
                log=lambda s: print(s, file=sys.stderr, flush=True),
            )
            print(bench.format_table(rows), f"({time.time() - t0:.0f} s)", flush=True)
            bench.write_csv(rows, args.out + ".csv")
            _render(args.out)
    return 0


def _render(stem: str) -> None:
    """Rewrite <stem>.md from <stem>.csv (a rerun of a row replaces its earlier result)."""
    rows = bench.read_csv(stem + ".csv")
    def key(r):
        return (r.shape, r.dtype, r.mode, r.provider, r.threads, r.load)

    latest = {key(r): i for i, r in enumerate(rows)}
    rows = [r for i, r in enumerate(rows) if latest[key(r)] == i]
    with open(stem + ".md", "w") as f:
        f.write(bench.format_table(rows))


def _remeasure(args) -> int:
    rows = bench.read_csv(args.out + ".csv")
    for r in rows:
        name = r.shape.split(" ")[0]
        if bench.is_floor(r.provider):
            continue
        if name not in args.shapes or r.dtype not in args.dtypes:
            continue
        shape = bench.SHAPES[name]
        r.mem_x_input = bench._peak_memory(shape, r.dtype, r.mode, r.provider, r.threads)
        print(f"{r.shape} {r.dtype} {r.mode} {r.provider}: {r.mem_x_input}", file=sys.stderr)
    os.replace(args.out + ".csv", args.out + ".csv.bak")
    bench.write_csv(rows, args.out + ".csv")
    os.remove(args.out + ".csv.bak")
    _render(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
