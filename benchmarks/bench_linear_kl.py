"""Benchmark klpenalty.linear_kl and linear_policy_loss against the unfused LM heads, on CPU.

    .venv/bin/python benchmarks/bench_linear_kl.py                 # N=4096, H=512, V=32000 fp32
    .venv/bin/python benchmarks/bench_linear_kl.py --n 1024 --repeats 3 --chunk-rows 64
    .venv/bin/python benchmarks/bench_linear_kl.py --modes fwdbwd --no-memory \
        --variants unfused fused_loss@64 fused_loss@128 fused_loss@256   # chunk rows, one process

Variants (the policy's hidden states and weight require grad, the reference is frozen, no bias):

- ``unfused``: ``F.linear`` of both models (the (N, V) logits of both) and the one-pass
  ``klpenalty.token_stats`` on them (KL and both log-probs of N sampled tokens), autograd
  through the logits and ``F.linear``;
- ``linear_kl``: ``klpenalty.linear_kl`` on the hidden states and weights, same outputs, its
  backward recomputing both heads' logits chunk by chunk;
- ``fused_loss``: ``klpenalty.linear_policy_loss`` (the loss's gradient formed in the forward,
  no recomputation), in the backward modes only (its forward already holds the gradient).

A variant ``name@R`` runs with ``chunk_rows=R`` (else ``--chunk-rows``, else the default).

Times: all variants in this process, interleaved rounds after a warm-up, medians of
``--repeats`` (≥ 5 by default). Modes: ``fwd`` (forward with grad-requiring inputs, graph
dropped), ``fwdbwd`` (forward + backward of Σ KL: the KL in the loss; ``fused_loss`` with
beta = 1, no advantages, reduction "sum") and ``fwdbwd-logp`` (forward + backward of the PPO
clipped surrogate Σ max(−A·r, −A·clip(r, 0.8, 1.2)) on the log-probs, r = exp(log π − log
π_old), the KL detached: the KL in the reward; ``fused_loss`` with beta = 0 and the same A,
log π_old). Memory: a fresh subprocess per variant runs one
forward+backward under the torch profiler (peak of the live CPU allocations made inside it) and
reports it whole and beyond the returned gradients (hidden (N, H) and weight (V, H)) and the
outputs, against one model's (N, V) float32 logits; the peak growth of the resident set
during another forward+backward (after a warm-up one), sampled every ~1 ms, is reported too
(it includes the gradients, and what the allocator keeps from the warm-up is not counted). Every row records the thread count and the 1-minute
load average. Writes ``benchmarks/results/bench_linear_kl.{csv,md}``.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import threading
import time

import torch
import torch.nn.functional as F

import klpenalty
from klpenalty import bench

HERE = os.path.dirname(os.path.abspath(__file__))
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
VARIANTS = ("unfused", "linear_kl", "fused_loss")


def make_inputs(n: int, hidden: int, vocab: int, dtype: torch.dtype, seed: int = 0):
    """Hidden states and LM heads of two models whose logits are O(3) (KL ~ 0.1)."""
    g = torch.Generator().manual_seed(seed)
    wp = torch.randn(vocab, hidden, generator=g) * (2.0 / hidden**0.5)
    wr = wp + torch.randn(vocab, hidden, generator=g) * (0.3 / hidden**0.5)
    hp = torch.randn(n, hidden, generator=g)
    hr = hp + 0.3 * torch.randn(n, hidden, generator=g)
    return (
        hp.to(dtype).requires_grad_(),
        wp.to(dtype).requires_grad_(),
        hr.to(dtype),
        wr.to(dtype),
    )


def make_tokens(n: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(1))


def make_rollout(inputs, tokens):
    """Advantages A (N,) of both signs and old log-probs log π_old = log π + O(0.1) noise."""
    g = torch.Generator().manual_seed(2)
    hp, wp = inputs[0].detach(), inputs[1].detach()
    with torch.no_grad():
        lp = klpenalty.token_logprobs(F.linear(hp, wp), tokens)
    adv = torch.randn(lp.shape, generator=g)
    return adv, lp + 0.1 * torch.randn(lp.shape, generator=g)


def surrogate(logprobs, old, adv):
    """The PPO clipped surrogate, summed over tokens, in plain torch ops (TRL's form)."""
    ratio = torch.exp(logprobs - old)
    return torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2)).sum()


def parse_variant(name: str, chunk_rows):
    """("fused_loss@128", None) -> ("fused_loss", 128): the variant and its chunk rows."""
    base, _, rows = name.partition("@")
    if base not in VARIANTS:
        raise SystemExit(f"unknown variant {name!r}: one of {VARIANTS}, optionally @<rows>")
    return base, int(rows) if rows else chunk_rows


def variant(name: str, chunk_rows, tokens: torch.Tensor, rollout):
    """step(inputs, mode): one forward (and backward) of variant ``name``. The unfused path
    materialises both models' logits and takes the one-pass ``token_stats``."""
    adv, old = rollout
    name, chunk_rows = parse_variant(name, chunk_rows)

    def step(inputs, mode):
        hp, wp, hr, wr = inputs
        if name == "fused_loss":
            kl_in_loss = mode == "fwdbwd"
            klpenalty.linear_policy_loss(
                hp, wp, hr, wr, tokens, beta=1.0 if kl_in_loss else 0.0,
                advantages=None if kl_in_loss else adv, old_logprobs=None if kl_in_loss else old,
                epsilon_low=0.2, reduction="sum", chunk_rows=chunk_rows,
            ).loss.backward()
            return
        if name == "unfused":
            out = klpenalty.token_stats(F.linear(hp, wp), F.linear(hr, wr), tokens)
        elif name == "linear_kl":
            out = klpenalty.linear_kl(hp, wp, hr, wr, tokens=tokens, chunk_rows=chunk_rows)
        else:
            raise ValueError(name)
        if mode == "fwdbwd":
            out.kl.sum().backward()
        elif mode == "fwdbwd-logp":
            surrogate(out.logprobs, old, adv).backward()

    return step


def runs(name: str, mode: str) -> bool:
    """Whether variant ``name`` has a row in ``mode`` (the fused loss has no forward alone)."""
    return not (name.startswith("fused_loss") and mode == "fwd")


def run_once(fn, inputs, mode: str) -> None:
    """One step of ``fn`` in ``mode``, the gradients dropped after it."""
    fn(inputs, mode)
    inputs[0].grad = inputs[1].grad = None


def timings(args) -> dict[tuple[str, str], list[float]]:
    inputs = make_inputs(args.n, args.hidden, args.vocab, DTYPES[args.dtype])
    tokens = make_tokens(args.n, args.vocab)
    rollout = make_rollout(inputs, tokens)
    fns = {name: variant(name, args.chunk_rows, tokens, rollout) for name in args.variants}
    times: dict[tuple[str, str], list[float]] = {}
    for mode in args.modes:
        live = {name: fn for name, fn in fns.items() if runs(name, mode)}
        for fn in live.values():  # warm-up (native kernel load, first-touch of the allocator)
            run_once(fn, inputs, mode)
        for _ in range(args.repeats):  # interleaved rounds
            for name, fn in live.items():
                t0 = time.perf_counter()
                run_once(fn, inputs, mode)
                times.setdefault((name, mode), []).append(time.perf_counter() - t0)
    return times


def _rss_peak_growth(fn) -> int:
    """Peak growth of the resident set during fn, sampled from /proc/self/statm every ~1 ms."""
    page = os.sysconf("SC_PAGE_SIZE")

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * page

    base, peak, done = rss(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], rss())
            time.sleep(0.001)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        fn()
    finally:
        done.set()
        thread.join()
    return max(peak[0], rss()) - base


def memory_child(args) -> dict:
    """In a fresh process: RSS growth of a forward+backward (after a warm-up one), then the
    profiler's peak of another."""
    inputs = make_inputs(args.n, args.hidden, args.vocab, DTYPES[args.dtype])
    tokens = make_tokens(args.n, args.vocab)
    fn = variant(args.variants[0], args.chunk_rows, tokens, make_rollout(inputs, tokens))
    run_once(fn, inputs, "fwdbwd")  # warm-up: native kernel load, allocator
    rss = _rss_peak_growth(lambda: run_once(fn, inputs, "fwdbwd"))
    peak, _ = bench.alloc_profile(lambda: run_once(fn, inputs, "fwdbwd"))
    return {"rss_growth": rss, "profiler_peak": peak}


def memory(args, name: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--memory-child", "--variants", name,
           "--n", str(args.n), "--hidden", str(args.hidden), "--vocab", str(args.vocab),
           "--dtype", args.dtype, "--threads", str(args.threads)]
    if args.chunk_rows:
        cmd += ["--chunk-rows", str(args.chunk_rows)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=4096, help="tokens N (rows)")
    p.add_argument("--hidden", type=int, default=512, help="hidden size H of both models")
    p.add_argument("--vocab", type=int, default=32000, help="vocabulary V")
    p.add_argument("--dtype", default="fp32", choices=list(DTYPES))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--chunk-rows", type=int, default=None, help="linear_kl's chunk_rows")
    p.add_argument("--modes", nargs="+", default=["fwd", "fwdbwd", "fwdbwd-logp"],
                   choices=["fwd", "fwdbwd", "fwdbwd-logp"])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS),
                   help=f"of {VARIANTS}, each optionally @<chunk rows>")
    p.add_argument("--no-memory", action="store_true")
    p.add_argument("--out", default=os.path.join(HERE, "results", "bench_linear_kl"))
    p.add_argument("--memory-child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.memory_child:
        print(json.dumps(memory_child(args)))
        return 0

    times = timings(args)
    load = os.getloadavg()[0]
    logits_mib = args.n * args.vocab * 4 / 2**20  # one model's (N, V) float32 logits
    elem = torch.finfo(DTYPES[args.dtype]).bits // 8
    grads_mib = (args.n + args.vocab) * args.hidden * elem / 2**20  # grad of hidden and weight
    outputs_mib = args.n * 4 / 2**20
    mem = {} if args.no_memory else {name: memory(args, name) for name in args.variants}
    rows = []
    for mode in args.modes:
        base = statistics.median(times[("unfused", mode)]) if "unfused" in args.variants else None
        for name in args.variants:
            if not runs(name, mode):
                continue
            med = statistics.median(times[(name, mode)])
            row = {
                "shape": f"N={args.n} H={args.hidden} V={args.vocab}", "dtype": args.dtype,
                "mode": mode, "variant": name, "median_s": round(med, 4),
                "min_s": round(min(times[(name, mode)]), 4), "repeats": args.repeats,
                "x_unfused": round(med / base, 3) if base else "",
                "threads": args.threads, "loadavg_1m": round(load, 2),
                "chunk_rows": (parse_variant(name, args.chunk_rows)[1] or "default")
                if name != "unfused" else "",
            }
            if name in mem and mode == "fwdbwd":
                peak = mem[name]["profiler_peak"] / 2**20
                beyond = peak - grads_mib - outputs_mib
                row.update({
                    "peak_MiB": round(peak, 1),
                    "peak_beyond_grads_MiB": round(beyond, 1),
                    "x_one_logits": round(beyond / logits_mib, 3),
                    "rss_growth_MiB": round(mem[name]["rss_growth"] / 2**20, 1),
                })
            rows.append(row)
            print("  ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    fields = list(dict.fromkeys(k for r in rows for k in r))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)
    with open(args.out + ".md", "w") as f:
        f.write(
            f"linear_kl and linear_policy_loss vs unfused (F.linear ×2 + token_stats), {time.strftime('%Y-%m-%d')}, "
            f"torch {torch.__version__}, CPU capability "
            f"{torch.backends.cpu.get_cpu_capability()}, {os.cpu_count()} cores; one model's "
            f"(N, V) fp32 logits = {logits_mib:.0f} MiB; gradients of hidden + weight = "
            f"{grads_mib:.1f} MiB\n\n| " + " | ".join(fields) + " |\n|" + "---|" * len(fields)
            + "\n"
        )
        for r in rows:
            f.write("| " + " | ".join(str(r.get(k, "")) for k in fields) + " |\n")
    print(f"wrote {args.out}.csv and {args.out}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
