"""The CPU figures of benchmarks/README.md's summary table, re-measured in one run on this machine.

    PYTHONPATH=src python benchmarks/bench_limits.py            # ~15 min on a 2-core machine
    PYTHONPATH=src python benchmarks/bench_limits.py --quick    # fewer rounds, S1 only (smoke)

Runs, one after another, with nothing else started in between (each part in a fresh process so
that its thread count and instruction set are its own):

1. the native forward against its floors (``bench_kl.py``: one thread, this thread's CPU time,
   S1 and S2, fp32 and bf16, with ``seed-compiled``, the inductor-compiled formula): once with
   torch's own instruction set and once under ``ATEN_CPU_CAPABILITY=avx2`` (where torch's own is
   AVX-512);
2. the sampler supports (``bench_support.py``: ``full_kl`` with top-k / top-p / min-p and the
   two kept-set forms against the untruncated call, two threads);
3. the fused heads (``bench_linear_kl.py``: ``linear_kl`` and ``linear_policy_loss`` against
   the unfused heads, forward + backward, two threads).

Writes ``benchmarks/results/bench_limits.md`` (the table, the machine, the load average before
and after each part) and keeps each part's own CSV next to it (``bench_limits_*.csv``).
"""

from __future__ import annotations

import argparse
import csv
import os
import platform
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")


def machine() -> str:
    """CPU model, family/model, cores, torch's CPU capability, torch version."""
    name, family, model = platform.processor() or "?", "?", "?"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key, value = key.strip(), value.strip()
                if key == "model name":
                    name = value
                elif key == "cpu family":
                    family = value
                elif key == "model" and model == "?":
                    model = value
    except OSError:
        pass
    return (f"{name} (family {family} model {model}), {os.cpu_count()} logical CPUs, torch "
            f"{torch.__version__}, torch's CPU capability "
            f"{torch.backends.cpu.get_cpu_capability()}")


def run(cmd: list[str], env: dict | None = None) -> tuple[float, float, float]:
    """Run one part; (seconds, load before, load after)."""
    before = os.getloadavg()[0]
    t0 = time.perf_counter()
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env={**os.environ, **(env or {})})
    return time.perf_counter() - t0, before, os.getloadavg()[0]


def rows(path: str) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def floors_table(path: str, isa: str) -> list[str]:
    """One line per (shape, dtype): read floor, compute floor, native, ratios, seed-compiled."""
    by = {}
    for r in rows(path):
        by.setdefault((r["shape"], r["dtype"]), {})[r["provider"]] = r
    out = []
    for (shape, dtype), p in by.items():
        nat = p.get("native")
        if nat is None:
            continue
        compute = min(float(r["median_ms"]) for k, r in p.items() if k.startswith("compute floor"))
        read = float(p["floor"]["median_ms"])
        native = float(nat["median_ms"])
        comp = p.get("seed-compiled")
        compiled = (f"{float(comp['median_ms']):.1f} ms, native {float(comp['median_ms']) / native:.1f}× faster"
                    if comp else "-")
        out.append(
            f"| native forward {shape} {dtype}, 1 thread, {isa} | {native:.1f} ms (read floor "
            f"{read:.1f}, compute floor {compute:.1f}) | **{native / max(read, compute):.2f}×** "
            f"max(floors) | inductor: {compiled} | {nat['loadavg'][:4]} |"
        )
    return out


def support_table(path: str) -> list[str]:
    out = []
    for r in rows(path):
        out.append(f"| full_kl, {r['variant']}, (2048, 32000) fp32, 2 threads | "
                   f"{float(r['median_ms']):.1f} ms | "
                   f"**{float(r['x_plain']):.2f}×** the untruncated call | | {r['loadavg'][:4]} |")
    return out


def linear_table(path: str) -> list[str]:
    out = []
    for r in rows(path):
        if r["variant"] == "unfused":
            continue
        what = "KL in the loss" if r["mode"] == "fwdbwd" else "surrogate, KL detached"
        out.append(f"| {r['variant']} fwd+bwd, {r['shape']} {r['dtype']}, {what} | "
                   f"{float(r['median_s']):.2f} s | **{float(r['x_unfused']):.2f}×** the unfused "
                   f"heads | | {r['loadavg_1m'][:4]} |")
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="S1 only, 3 rounds (a smoke run)")
    p.add_argument("--out", default=os.path.join(RESULTS, "bench_limits"))
    args = p.parse_args()
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    py = sys.executable
    shapes = ["S1"] if args.quick else ["S1", "S2"]
    repeats = "3" if args.quick else "7"
    isas = [("own", {})]
    if torch.backends.cpu.get_cpu_capability() == "AVX512":
        isas.append(("avx2", {"ATEN_CPU_CAPABILITY": "avx2"}))
    log, lines = [], []
    for tag, env in isas:
        stem = f"{args.out}_floors_{tag}"
        secs, l0, l1 = run([py, os.path.join(HERE, "bench_kl.py"), "--threads", "1", "--clock",
                            "thread", "--shapes", *shapes, "--dtypes", "fp32", "bf16", "--modes",
                            "fwd", "--providers", "native", "seed-compiled", "--no-memory",
                            "--repeats", repeats, "--out", stem], env)
        isa = torch.backends.cpu.get_cpu_capability() if tag == "own" else "AVX2 (forced)"
        lines += floors_table(stem + ".csv", isa)
        log.append(f"native floors ({isa}): {secs:.0f} s, load {l0:.2f} → {l1:.2f}")
    stem = f"{args.out}_support"
    secs, l0, l1 = run([py, os.path.join(HERE, "bench_support.py"), "--repeats", repeats,
                        "--out", stem])
    lines += support_table(stem + ".csv")
    log.append(f"supports: {secs:.0f} s, load {l0:.2f} → {l1:.2f}")
    stem = f"{args.out}_linear"
    lin = [py, os.path.join(HERE, "bench_linear_kl.py"), "--modes", "fwdbwd", "fwdbwd-logp",
           "--no-memory", "--repeats", "3" if args.quick else "5", "--out", stem]
    if args.quick:
        lin += ["--n", "1024"]
    secs, l0, l1 = run(lin)
    lines += linear_table(stem + ".csv")
    log.append(f"fused heads: {secs:.0f} s, load {l0:.2f} → {l1:.2f}")
    with open(args.out + ".md", "w") as f:
        f.write(f"# CPU limits, one run ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})\n\n")
        f.write(f"Machine: {machine()}.\n\n")
        f.write("| row | measured | ratio | note | loadavg |\n|---|---:|---:|---|---:|\n")
        f.write("\n".join(lines) + "\n\n")
        f.write("Parts, in order: " + "; ".join(log) + ".\n")
    print(f"wrote {args.out}.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
