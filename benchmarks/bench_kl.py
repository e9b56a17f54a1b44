"""Benchmark the exact KL at the issue's shapes; writes benchmarks/results/bench_kl.{csv,md}.

    PYTHONPATH=src python benchmarks/bench_kl.py --threads 1            # everything (long)
    PYTHONPATH=src python benchmarks/bench_kl.py --quick                # S1 fp32 only
    PYTHONPATH=src python benchmarks/bench_kl.py --shapes S3 --dtypes bf16 --providers seed streaming

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
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=list(bench.SHAPES), choices=list(bench.SHAPES))
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=list(bench.DTYPES))
    p.add_argument("--modes", nargs="+", default=["fwd", "fwdbwd"], choices=["fwd", "fwdbwd"])
    p.add_argument("--providers", nargs="+", default=None)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--no-memory", action="store_true")
    p.add_argument("--quick", action="store_true", help="S1 fp32 only, 3 rounds")
    p.add_argument("--out", default=os.path.join(HERE, "results", "bench_kl"), help="path stem")
    args = p.parse_args(argv)
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
                shape_name=f"{name} {bench.SHAPES[name]}",
                log=lambda s: print(s, file=sys.stderr, flush=True),
            )
            table = bench.format_table(rows)
            print(table, flush=True)
            bench.write_csv(rows, args.out + ".csv")
            with open(args.out + ".md", "a") as f:
                f.write(f"\n{name} {dtype} ({time.time() - t0:.0f} s, {rows[0].threads} threads)\n\n" + table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
