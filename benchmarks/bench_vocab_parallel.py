"""Vocabulary-parallel forward on CPU: one rank's local work, per backend, against a reference
tree (another checkout of klpenalty, e.g. the release before the backends served this path).

Usage::

    python benchmarks/bench_vocab_parallel.py [--old-src PATH] [--rows 512] [--width 32768]
        [--repeats 7] [--rounds 3]

Each measurement runs in its own process (a process group of one rank, gloo, FileStore): the
function timed is ``klpenalty.distributed.vocab_parallel_full_kl`` (and, where the tree has it,
``vocab_parallel_token_stats`` with tokens and the entropy) on one (rows, width) float32 slice,
``check=False``, forward only, one intra-op thread. ``--old-src`` is the ``src`` directory of
the reference tree, put first on ``PYTHONPATH`` of its processes: two packages named
``klpenalty`` cannot share one process, so the trees are measured in separate processes,
alternating (new, old, new, old, ...) for ``--rounds`` rounds, and the ratio is taken of the
medians over all rounds. Prints one JSON line per process and a table at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _worker(args) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = Path(tempfile.mkdtemp()) / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    from klpenalty import distributed as kd

    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.rows, args.width, generator=g) * 3
    y = x + torch.randn(args.rows, args.width, generator=g)
    tokens = torch.randint(0, args.width, (args.rows,), generator=g)
    kw = {} if args.backend == "tree-default" else {"backend": args.backend}
    calls = {"full_kl": lambda: kd.vocab_parallel_full_kl(x, y, check=False, **kw)}
    if hasattr(kd, "vocab_parallel_token_stats"):
        calls["token_stats"] = lambda: kd.vocab_parallel_token_stats(
            x, y, tokens, vocab_start=0, entropy=True, check=False, **kw
        )
    out = {"tree": args.label, "backend": args.backend}
    with torch.no_grad():
        for name, fn in calls.items():
            fn()  # warm-up (builds/loads a kernel)
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            out[name] = statistics.median(times)
    dist.destroy_process_group()
    print(json.dumps(out), flush=True)


def _spawn(args, label: str, src: Path, backend: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(src), OMP_NUM_THREADS="1")
    cmd = [sys.executable, __file__, "--worker", "--label", label, "--backend", backend,
           "--rows", str(args.rows), "--width", str(args.width), "--repeats", str(args.repeats)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    line = done.stdout.strip().splitlines()[-1]
    print(line, flush=True)
    return json.loads(line)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--old-src", type=Path, default=None)
    p.add_argument("--rows", type=int, default=512)
    p.add_argument("--width", type=int, default=32768)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--worker", action="store_true")
    p.add_argument("--label", default="new")
    p.add_argument("--backend", default="native")
    args = p.parse_args()
    if args.worker:
        _worker(args)
        return
    runs = [("new", ROOT / "src", "native"), ("new", ROOT / "src", "streaming")]
    if args.old_src is not None:
        runs.append(("old", args.old_src, "tree-default"))
    results: dict[tuple[str, str], list[dict]] = {}
    for _ in range(args.rounds):
        for label, src, backend in runs:
            results.setdefault((label, backend), []).append(_spawn(args, label, src, backend))
    load = os.getloadavg()
    print(f"\nrows={args.rows} width={args.width} float32, forward, 1 thread; "
          f"loadavg {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    base = results.get(("old", "tree-default"))
    base_kl = statistics.median(r["full_kl"] for r in base) if base else None
    print(f"{'tree':5} {'backend':13} {'full_kl s':>10} {'vs old':>7} {'token_stats s':>14}")
    for (label, backend), rs in results.items():
        kl = statistics.median(r["full_kl"] for r in rs)
        ts = [r["token_stats"] for r in rs if "token_stats" in r]
        ratio = f"{base_kl / kl:6.2f}x" if base_kl else "-"
        ts_txt = f"{statistics.median(ts):14.4f}" if ts else f"{'-':>14}"
        print(f"{label:5} {backend:13} {kl:10.4f} {ratio:>7} {ts_txt}")


if __name__ == "__main__":
    main()
