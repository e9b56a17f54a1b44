"""Vocabulary-parallel forward on CPU: one rank's local work, per backend, against a reference
tree (another checkout of klpenalty, e.g. the release before the backends served this path);
with ``--fused-head``, the vocabulary-parallel fused head against the single-device one.

Usage::

    python benchmarks/bench_vocab_parallel.py [--old-src PATH] [--rows 512] [--width 32768]
        [--repeats 7] [--rounds 3]
    python benchmarks/bench_vocab_parallel.py --fused-head [--world 2] [--rows 256]
        [--hidden 256] [--width 32768] [--repeats 5]

Each measurement runs in its own process (a process group of one rank, gloo, FileStore): the
function timed is ``klpenalty.distributed.vocab_parallel_full_kl`` (and, where the tree has it,
``vocab_parallel_token_stats`` with tokens and the entropy) on one (rows, width) float32 slice,
``check=False``, forward only, one intra-op thread. ``--old-src`` is the ``src`` directory of
the reference tree, put first on ``PYTHONPATH`` of its processes: two packages named
``klpenalty`` cannot share one process, so the trees are measured in separate processes,
alternating (new, old, new, old, ...) for ``--rounds`` rounds, and the ratio is taken of the
medians over all rounds. Prints one JSON line per process and a table at the end.

``--fused-head``: ``--world`` ranks (gloo, FileStore, one intra-op thread each), each holding
the same (rows, hidden) float32 hidden states of both models and its rows of two (width,
hidden) heads with biases (width = the whole V, split evenly). Per case (the plain head; with
a soft-cap, logit scale and tokens; and top-k sampler settings), forward + backward of
``vocab_parallel_linear_kl`` on every rank, then ``linear_kl`` on the whole heads on rank 0
alone (the other ranks wait at a barrier), alternating for ``--repeats`` rounds in the same
processes; rank 0 prints the medians, their ratio, the peak RSS and the load average.
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


def _fused_worker(args) -> None:
    import resource

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank, world = args.rank, args.world
    dist.init_process_group("gloo", init_method=f"file://{args.store}", rank=rank,
                            world_size=world)
    import klpenalty
    from klpenalty import distributed as kd

    n, h, v = args.rows, args.hidden, args.width
    g = torch.Generator().manual_seed(0)
    hp, hr = torch.randn(n, h, generator=g), torch.randn(n, h, generator=g)
    wp = torch.randn(v, h, generator=g) * (2.0 / h**0.5)
    wr = wp + 0.3 * torch.randn(v, h, generator=g) / h**0.5
    bp, br = torch.randn(v, generator=g) * 0.1, torch.randn(v, generator=g) * 0.1
    tokens = torch.randint(0, v, (n,), generator=g)
    cuts = [v * r // world for r in range(world + 1)]
    lo, hi = cuts[rank], cuts[rank + 1]
    shards = [t[lo:hi].contiguous() for t in (wp, wr, bp, br)]
    zp = 30.0 * torch.tanh(1.5 * torch.nn.functional.linear(hp, wp, bp) / 30.0)
    cases = {
        "plain": {},
        "cap+scale+tokens": dict(softcap=30.0, logit_scale=1.5, tokens=tokens, entropy=True),
        "cap+scale+top_k": dict(softcap=30.0, logit_scale=1.5, tokens=zp.argmax(-1),
                                top_k=50),
    }

    def step(fn):
        leaves = [t.clone().requires_grad_() for t in fn[1]]
        out = fn[0](*leaves)
        sum(f.sum() for f in out if f is not None).backward()

    rows = {}
    for name, kw in cases.items():
        vp = (lambda a, b, c, d, e, f: kd.vocab_parallel_linear_kl(
                  a, b, c, d, vocab_start=lo, policy_bias_shard=e, ref_bias_shard=f,
                  backend=args.backend, check=False, **kw),
              (hp, shards[0], hr, shards[1], shards[2], shards[3]))
        single = (lambda a, b, c, d, e, f: klpenalty.linear_kl(
                      a, b, c, d, policy_bias=e, ref_bias=f, backend=args.backend,
                      check=False, **kw),
                  (hp, wp, hr, wr, bp, br))
        t_vp, t_one = [], []
        for i in range(args.repeats + 1):  # the first round warms up
            dist.barrier()
            t0 = time.perf_counter()
            step(vp)
            dist.barrier()
            t1 = time.perf_counter()
            if rank == 0:
                step(single)
            t2 = time.perf_counter()
            dist.barrier()
            if i:
                t_vp.append(t1 - t0)
                t_one.append(t2 - t1)
        rows[name] = (statistics.median(t_vp), statistics.median(t_one))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # MiB
    dist.destroy_process_group()
    if rank == 0:
        load = os.getloadavg()
        print(f"rows={n} hidden={h} V={v} float32, forward+backward, world {world} (gloo), "
              f"1 thread per rank, backend {args.backend}, median of {args.repeats}; "
              f"loadavg {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; rank 0 peak RSS "
              f"{rss:.0f} MiB")
        print(f"{'case':18} {'vocab-parallel s':>17} {'single-device s':>16} {'speedup':>8}")
        for name, (a, b) in rows.items():
            print(f"{name:18} {a:17.4f} {b:16.4f} {b / a:7.2f}x")


def _fused_head(args) -> None:
    store = Path(tempfile.mkdtemp()) / "store"
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")
    procs = [subprocess.Popen(
        [sys.executable, __file__, "--fused-worker", "--rank", str(r), "--world",
         str(args.world), "--store", str(store), "--rows", str(args.rows), "--hidden",
         str(args.hidden), "--width", str(args.width), "--repeats", str(args.repeats),
         "--backend", args.backend], env=env) for r in range(args.world)]
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"a rank failed: exit codes {codes}")


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
    p.add_argument("--fused-head", action="store_true")
    p.add_argument("--fused-worker", action="store_true")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--store", default="")
    p.add_argument("--hidden", type=int, default=256)
    args = p.parse_args()
    if args.worker:
        _worker(args)
        return
    if args.fused_worker:
        _fused_worker(args)
        return
    if args.fused_head:
        _fused_head(args)
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
