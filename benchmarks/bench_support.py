"""What a sampler's support costs the KL on CPU: ``klpenalty.full_kl(x, y, **kw)`` with the
sampler settings (the threshold computed inside the kernel's row pass) and with a precomputed
kept set, against the untruncated KL.

Rows, side by side in one process, interleaved rounds, medians, the ratio to ``plain`` (of the
medians, and the median of each round's ratio to the same round's plain):

- ``plain``: no support;
- ``top_k=50``, ``top_p=0.9``, ``min_p=0.05``, ``top_k=50, top_p=0.9``: the sampler settings;
- ``support=bool mask``: a dense (N, V) bool kept set (that of top_p=0.9);
- ``support=(ids, offsets)``: the same kept set as compact int64 ids, in row order (each row's
  set is a threshold set: the forward finds its tau in its visit of the row);
- ``support=(ids, offsets) int32``: the same with int32 ids and offsets;
- ``floor: ...``: what the kept sets cannot go below, in the same rounds: reading x and y
  (``x.sum(); y.sum()``), with the int64 or int32 ids (their ``amax()``), and reading x and the
  int32 ids alone;
- ``marks: ...``: the native kept-set op alone (``native_support_from_ids``: each row's ids
  marked in a byte map, one scan of its logits against the marks), int32 ids: against
  ``floor: read x, int32 ids``, what marking the ids costs.

x = 2·N(0, 1) (top-p 0.9 keeps thousands of tokens per row; ``--rows``: 4·N(0, 1), 2·Gumbel
or a Zipf law over shuffled ranks, peaked rows whose mass sits on few tokens), y = x + 0.3·N(0,
1). Writes ``benchmarks/results/bench_support.{md,csv}`` (``bench_support_<rows>`` for other
rows) with the 1-minute load average and the CPU model.

    .venv/bin/python benchmarks/bench_support.py [--n 2048] [--vocab 32000] [--threads 2]
        [--repeats 21] [--clock wall|cpu] [--temperature 1.0] [--rows 2n|4n|gumbel|zipf]
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import time

import torch

import klpenalty
from klpenalty.bench import LOGIT_ROWS, floor_fn, peaked_logits
from klpenalty.sampling import sampling_threshold

HERE = os.path.dirname(os.path.abspath(__file__))


def cpu_model() -> str:
    """lscpu's model name (or platform's processor string)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    import platform

    return platform.processor() or "unknown"


def compact(kept: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, offsets) of a (N, V) bool kept set, in row order."""
    rows, ids = kept.nonzero(as_tuple=True)
    counts = torch.bincount(rows, minlength=kept.shape[0])
    return ids, torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=2048, help="rows (positions)")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=21)
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                   help="wall: perf_counter; cpu: the process's CPU time (all its threads), "
                        "steadier on a loaded machine, in the kernel's ticks (4 ms on some VMs)")
    p.add_argument("--temperature", type=float, default=1.0,
                   help="the sampler's temperature (every variant, the kept sets' too)")
    p.add_argument("--rows", choices=list(LOGIT_ROWS), default="2n",
                   help="the policy's logits: "
                        + "; ".join(f"{k}: {v}" for k, v in LOGIT_ROWS.items()))
    p.add_argument("--out", default=None,
                   help="path of the .md / .csv results without the suffix ('' : print only; "
                        "default benchmarks/results/bench_support[_<rows>])")
    args = p.parse_args()
    if args.out is None:
        name = "bench_support" + ("" if args.rows == "2n" else f"_{args.rows}")
        args.out = os.path.join(HERE, "results", name)
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    x = peaked_logits(args.rows, args.n, args.vocab, g)
    y = x + 0.3 * torch.randn(args.n, args.vocab, generator=g)
    T = args.temperature
    kept = x >= sampling_threshold(x, top_p=0.9, temperature=T).unsqueeze(-1)
    ids, offsets = compact(kept)
    ids32, offsets32 = ids.int(), offsets.int()
    cases = {
        "plain": dict(temperature=T),
        "top_k=50": dict(top_k=50, temperature=T),
        "top_p=0.9": dict(top_p=0.9, temperature=T),
        "min_p=0.05": dict(min_p=0.05, temperature=T),
        "top_k=50, top_p=0.9": dict(top_k=50, top_p=0.9, temperature=T),
        "support=bool mask": dict(support=kept, temperature=T),
        "support=(ids, offsets)": dict(support=(ids, offsets), temperature=T),
        "support=(ids, offsets) int32": dict(support=(ids32, offsets32), temperature=T),
    }
    calls = {name: (lambda kw=kw: klpenalty.full_kl(x, y, **kw)) for name, kw in cases.items()}
    read_xy = floor_fn("fwd", x, y)
    calls["floor: read x, y"] = read_xy
    calls["floor: read x, y, int64 ids"] = lambda: (read_xy(), ids.amax())
    calls["floor: read x, y, int32 ids"] = lambda: (read_xy(), ids32.amax())
    calls["floor: read x, int32 ids"] = lambda: (x.sum(), ids32.amax())
    if klpenalty.ops.native.available():
        marks = torch.ops.klpenalty.native_support_from_ids.default
        calls["marks: support_from_ids, int32 ids"] = lambda: marks(x, ids32, offsets32, 0)
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    times = {name: [] for name in calls}
    for call in calls.values():  # warm-up (native build, allocator)
        call()
    for _ in range(args.repeats):  # interleaved rounds
        for name, call in calls.items():
            t0 = clock()
            call()
            times[name].append(clock() - t0)
    load = os.getloadavg()[0]
    model = cpu_model()
    base = statistics.median(times["plain"])
    rows = []
    for name, ts in times.items():
        med = statistics.median(ts)
        # each round's time against the same round's plain, the median of those ratios: a
        # slow stretch of the machine moves both sides of a ratio
        paired = statistics.median(t / b for t, b in zip(ts, times["plain"]))
        rows.append({"variant": name, "clock": args.clock, "median_ms": round(med * 1e3, 1),
                     "x_plain": round(med / base, 2), "x_plain_paired": round(paired, 2),
                     "loadavg": round(load, 2)})
        print(rows[-1], flush=True)
    shape = (f"({args.n}, {args.vocab}) fp32, T = {T}, {args.threads} threads, median of "
             f"{args.repeats} interleaved rounds, {args.clock} clock")
    if not args.out:
        return
    if os.path.dirname(args.out):
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    with open(args.out + ".md", "w") as f:
        f.write(f"# full_kl with a sampler's support, {shape}\n\n")
        f.write(f"CPU: {model}; backend: {klpenalty.ops.native.status()}; "
                f"1-minute load average {load:.2f}.\n\n")
        f.write(f"x = {LOGIT_ROWS[args.rows]}, y = x + 0.3·N(0, 1); the mask and ids are "
                "top_p=0.9's kept set.\n\n")
        f.write("| variant | median ms | × plain (medians) | × plain (paired rounds) |\n"
                "|---|---:|---:|---:|\n")
        for r in rows:
            f.write(f"| {r['variant']} | {r['median_ms']} | {r['x_plain']} | "
                    f"{r['x_plain_paired']} |\n")
    print(f"wrote {args.out}.md / .csv")


if __name__ == "__main__":
    main()
