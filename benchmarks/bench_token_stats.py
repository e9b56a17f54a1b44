"""One pass vs three calls on CPU: the KL, the sampled tokens' log-probs under both models and
the policy entropy of one batch, and what a sampler's support (top-k / top-p) costs.

Side by side in one process, interleaved rounds, medians, for each CPU backend
(``klpenalty.ops.dispatch.device_backends``):

- ``3 calls``: ``full_kl`` + ``token_logprobs`` (policy) + ``token_logprobs`` (reference) +
  ``entropy`` — four calls, the policy logits read three times;
- ``token_stats``: one ``klpenalty.token_stats(..., entropy=True)`` call;
- ``top_k=50`` / ``top_p=0.9``: the same one call on the sampler's truncated policy π̃
  (thresholds built in row chunks, applied per tile).

Forward, and forward+backward of the sum of the four outputs. Writes
``benchmarks/results/bench_token_stats.{md,csv}`` with the 1-minute load average of the run.

    .venv/bin/python benchmarks/bench_token_stats.py [--n 2048] [--vocab 32000] [--repeats 7]
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import time

import torch

import klpenalty
from klpenalty.ops.dispatch import device_backends

HERE = os.path.dirname(os.path.abspath(__file__))
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def variants(backend: str, tokens: torch.Tensor) -> dict:
    """name -> fn(x, y) -> the four (N,) outputs."""

    def three_calls(x, y):
        kw = dict(backend=backend)
        return (
            klpenalty.full_kl(x, y, **kw),
            klpenalty.token_logprobs(x, tokens, **kw),
            klpenalty.token_logprobs(y, tokens, **kw),
            klpenalty.entropy(x, **kw),
        )

    def one_pass(**support):
        def fn(x, y):
            return tuple(klpenalty.token_stats(
                x, y, tokens, entropy=True, backend=backend, check=False, **support
            ))
        return fn

    return {
        "3 calls": three_calls,
        "token_stats": one_pass(),
        "top_k=50": one_pass(top_k=50),
        "top_p=0.9": one_pass(top_p=0.9),
    }


def run(fn, x, y, mode: str) -> None:
    outs = fn(x, y)
    if mode == "fwd+bwd":
        sum(o.sum() for o in outs).backward()
        x.grad = None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=2048, help="rows (positions)")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dtype", choices=list(DTYPES), default="fp32")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--out", default=os.path.join(HERE, "results", "bench_token_stats"))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    # scale 4: a few nats of entropy, like a language model's next-token distribution (top-p
    # keeps tens to hundreds of tokens)
    x = (torch.randn(args.n, args.vocab, generator=g) * 4).to(DTYPES[args.dtype])
    y = (x.float() + 0.3 * torch.randn(args.n, args.vocab, generator=g)).to(x.dtype)
    # sampled from π (top-1 is always inside every support)
    tokens = x.float().argmax(-1)
    rows = []
    for backend in device_backends(x.device):
        table = variants(backend, tokens)
        for mode in ("fwd", "fwd+bwd"):
            xg = x.detach().requires_grad_(mode == "fwd+bwd")
            times = {name: [] for name in table}
            for fn in table.values():  # warm-up (native build, allocator)
                run(fn, xg, y, mode)
            for _ in range(args.repeats):  # interleaved rounds
                for name, fn in table.items():
                    t0 = time.perf_counter()
                    run(fn, xg, y, mode)
                    times[name].append(time.perf_counter() - t0)
            base = statistics.median(times["3 calls"])
            for name, ts in times.items():
                med = statistics.median(ts)
                rows.append({
                    "backend": backend, "mode": mode, "variant": name,
                    "median_ms": round(med * 1e3, 1), "x_3calls": round(med / base, 3),
                    "loadavg": round(os.getloadavg()[0], 2),
                })
                print(rows[-1], flush=True)
    shape = f"({args.n}, {args.vocab}) {args.dtype}, {args.threads} threads, median of {args.repeats}"
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    with open(args.out + ".md", "w") as f:
        f.write(f"# One pass vs three calls, {shape}\n\n")
        f.write("| backend | mode | variant | median ms | × 3 calls | loadavg |\n|---|---|---|---:|---:|---:|\n")
        for r in rows:
            f.write(f"| {r['backend']} | {r['mode']} | {r['variant']} | {r['median_ms']} | "
                    f"{r['x_3calls']} | {r['loadavg']} |\n")
    print(f"wrote {args.out}.md / .csv")


if __name__ == "__main__":
    main()
