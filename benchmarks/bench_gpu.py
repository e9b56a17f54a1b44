"""GPU benchmark of the exact KL, side by side in one process (needs a CUDA device).

Providers: the seed formula (two log_softmax, exp, product, sum), ``F.kl_div`` on two
log-softmaxes, the streaming backend, the Triton backend, and Liger-Kernel's ``LigerKLDIVLoss``
where it imports (it takes log-probs: its time includes the two log_softmax passes). Modes:
forward, and forward+backward (gradient w.r.t. the policy logits). For each: the median time
(CUDA events), the achieved GB/s (bytes of one read of both inputs; + the gradient write and a
second read for forward+backward), the ratio to the read floor measured in the same run (one
pass reading both inputs: ``x.sum() + y.sum()`` in fp32 accumulation; for forward+backward,
read both, read again and write one tensor the size of the policy), the peak extra memory from
``torch.cuda.max_memory_allocated`` and the max error vs float64 on a subset of rows.

One-pass rows: KL + the sampled tokens' log-probs + the entropy of one batch, by
three calls (``full_kl``, ``token_logprobs``, ``entropy``: the policy logits read three times)
against one call of the Triton backend's ``token_stats`` (read once), forward and
forward+backward (the gradient of the sum of the three), at ``--one-pass-shapes`` (default
8x4096x128256 bf16). Their GB/s and floor ratio count one read of both inputs.

``--linear`` runs the linear_kl rows instead: ``klpenalty.linear_kl`` (exact KL straight from
the hidden states and LM heads, chunked) against the unfused path (both ``F.linear`` + ``full_kl``,
with backward into the policy's hidden states and weight), and Liger-Kernel's
``LigerFusedLinearJSD`` at β = 1 where it imports (its scalar loss, the teacher frozen), at
(N = 16384, H = 4096, V = 128256) bf16: median time of fwd and fwd+bwd, and the peak extra memory
from ``torch.cuda.max_memory_allocated`` (whole, and beyond the returned gradients of the hidden
states and weight), against one model's (N, V) bf16 logits. Writes bench_gpu_linear.{csv,md}.

Written for torch 2.11 / Triton 3.6 / Python 3.12 (no network needed). Usage::

    python benchmarks/bench_gpu.py                       # the four default shapes
    python benchmarks/bench_gpu.py --shapes 2x512x32000 --dtypes bf16 --repeats 5
    python benchmarks/bench_gpu.py --linear --repeats 5  # linear_kl rows
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
import time

SHAPES = [
    ((8, 4096, 128256), "bf16"),
    ((8, 4096, 128256), "fp32"),
    ((4, 8192, 151936), "bf16"),
    ((16, 2048, 32000), "fp32"),
]
OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "gpu")
ERROR_ROWS = 32
LINEAR_SHAPE = (16384, 4096, 128256)  # (N tokens, H hidden, V vocabulary), bf16


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="*", default=None,
                   help="BxTxV shapes (default: four LLM shapes, each with its dtype)")
    p.add_argument("--dtypes", nargs="*", default=None, choices=["bf16", "fp16", "fp32"],
                   help="dtypes for --shapes (default bf16)")
    p.add_argument("--repeats", type=int, default=10, help="timed calls per provider (median)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--providers", nargs="*", default=None,
                   help="subset of: seed kl_div streaming triton liger")
    p.add_argument("--one-pass-shapes", nargs="*", default=["8x4096x128256"],
                   help="BxTxV shapes (bf16) of the one-pass rows; none to skip them")
    p.add_argument("--out", default=OUT_DIR, help="folder for bench_gpu.csv / bench_gpu.md")
    p.add_argument("--linear", action="store_true",
                   help="the linear_kl rows instead (bench_gpu_linear.{csv,md})")
    p.add_argument("--linear-shape", default="x".join(map(str, LINEAR_SHAPE)),
                   help="NxHxV of the --linear rows")
    return p.parse_args(argv)


def _cases(args):
    if not args.shapes:
        return SHAPES
    dtypes = args.dtypes or ["bf16"]
    return [(tuple(int(n) for n in s.lower().split("x")), d) for s in args.shapes for d in dtypes]


def one_pass_providers(tokens):
    """name -> fn(x, y) returning (KL, log π(token), H) per position: three calls of the
    public functions on the Triton backend, or one call of its one-pass ``token_stats``.
    Runs wherever the Triton backend runs (CPU tensors under TRITON_INTERPRET=1 too)."""
    import klpenalty

    def three_calls(x, y):
        return (klpenalty.full_kl(x, y, backend="triton"),
                klpenalty.token_logprobs(x, tokens, backend="triton"),
                klpenalty.entropy(x, backend="triton"))

    def one_call(x, y):  # (log ρ(token) comes with it: a gather of N entries)
        out = klpenalty.token_stats(x, y, tokens, entropy=True, backend="triton")
        return out.kl, out.logprobs, out.entropy

    return {"kl+logp+H 3 calls": three_calls, "kl+logp+H token_stats": one_call}


def _timed(torch, fn, n):
    """Median milliseconds of n calls of fn (CUDA events, synchronised around each call)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def _write(rows, out_dir, stem, title):
    os.makedirs(out_dir, exist_ok=True)
    fields = list(dict.fromkeys(k for r in rows for k in r))
    with open(os.path.join(out_dir, stem + ".csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)
    with open(os.path.join(out_dir, stem + ".md"), "w") as f:
        f.write(f"{title}, {time.strftime('%Y-%m-%d')}\n\n| " + " | ".join(fields) + " |\n|"
                + "---|" * len(fields) + "\n")
        for r in rows:
            f.write("| " + " | ".join(f"{r[k]:.4g}" if isinstance(r.get(k), float) else
                                      str(r.get(k, "")) for k in fields) + " |\n")
    print(f"wrote {out_dir}/{stem}.csv and {stem}.md")


def linear_main(args) -> int:
    """linear_kl vs the unfused LM heads + full_kl vs Liger's fused linear JSD (β = 1)."""
    import torch
    import torch.nn.functional as F

    import klpenalty

    device = torch.device("cuda")
    n, h, v = (int(x) for x in args.linear_shape.lower().split("x"))
    g = torch.Generator(device=device).manual_seed(0)
    dtype = torch.bfloat16
    wp = (torch.randn(v, h, generator=g, device=device) * h**-0.5 * 2).to(dtype)
    wr = (wp.float() + torch.randn(v, h, generator=g, device=device) * h**-0.5 * 0.3).to(dtype)
    hp = torch.randn(n, h, generator=g, device=device).to(dtype)
    hr = (hp.float() + 0.3 * torch.randn(n, h, generator=g, device=device)).to(dtype)
    del g
    logits_mib = n * v * 2 / 2**20  # one model's (N, V) bf16 logits
    grads_mib = (n + v) * h * 2 / 2**20  # the returned gradients of hidden states and weight
    table = {
        "unfused": lambda a, b: klpenalty.full_kl(F.linear(a, b), F.linear(hr, wr)).sum(),
        "linear_kl": lambda a, b: klpenalty.linear_kl(a, b, hr, wr).kl.sum(),
    }
    try:
        from liger_kernel.transformers import LigerFusedLinearJSD

        jsd = LigerFusedLinearJSD(jsd_beta=1.0)  # β = 1: its KL; a scalar, teacher frozen
        table["liger_jsd_b1"] = lambda a, b: jsd(a, b, hr, wr)
    except Exception as exc:  # not installed / too old for β = 1: reported, not fatal
        print(f"liger LigerFusedLinearJSD: not installed or unusable ({type(exc).__name__}: {exc})")
    print(f"device {torch.cuda.get_device_name(0)}, torch {torch.__version__}, linear_kl rows "
          f"N={n} H={h} V={v} bf16; one model's logits {logits_mib:.0f} MiB")
    rows = []
    for mode in ("fwd", "fwd+bwd"):
        for name, fn in table.items():
            a = hp.detach().requires_grad_(True)
            b = wp.detach().requires_grad_(True)

            def call():
                loss = fn(a, b)
                if mode == "fwd+bwd":
                    loss.backward()
                    a.grad = b.grad = None
                return loss

            try:
                for _ in range(args.warmup):
                    call()
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                ms = _timed(torch, call, args.repeats)
                peak = (torch.cuda.max_memory_allocated() - base) / 2**20
                note = ""
            except Exception as exc:  # e.g. out of memory: recorded, the run goes on
                ms, peak, note = float("nan"), float("nan"), f"{type(exc).__name__}: {exc}"[:120]
                torch.cuda.empty_cache()
            beyond = peak - (grads_mib if mode == "fwd+bwd" else 0.0)
            row = {
                "shape": f"N={n} H={h} V={v}", "dtype": "bf16", "mode": mode, "provider": name,
                "ms": ms, "peak_extra_MiB": peak, "beyond_grads_MiB": beyond,
                "x_one_logits": beyond / logits_mib, "note": note,
            }
            rows.append(row)
            print("  " + "  ".join(f"{k}={row[k]:.4g}" if isinstance(row[k], float) else
                                    f"{k}={row[k]}" for k in row), flush=True)
        base_ms = next(r["ms"] for r in rows if r["mode"] == mode and r["provider"] == "unfused")
        for r in rows:
            if r["mode"] == mode:
                r["x_unfused"] = r["ms"] / base_ms
    _write(rows, args.out, "bench_gpu_linear",
           f"linear_kl GPU benchmark, {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    return 0


def main(argv=None) -> int:
    args = _parse(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench_gpu.py: no CUDA device here; this benchmark runs on a GPU only", file=sys.stderr)
        return 2
    if args.linear:
        return linear_main(args)
    import torch.nn.functional as F

    import klpenalty
    from klpenalty.bench import kl_div_formula, seed_formula
    from klpenalty.ops.reference import full_kl_reference

    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    table = {
        "seed": seed_formula,
        "kl_div": kl_div_formula,
        "streaming": lambda x, y: klpenalty.full_kl(x, y, backend="streaming"),
        "triton": lambda x, y: klpenalty.full_kl(x, y, backend="triton"),
    }
    try:
        from liger_kernel.transformers import LigerKLDIVLoss

        liger = LigerKLDIVLoss(reduction="none", log_target=True)

        def liger_fn(x, y):  # log-probs first: Liger's KL starts from them
            v = x.shape[-1]
            logp = torch.log_softmax(x.float(), -1).reshape(-1, v)
            logq = torch.log_softmax(y.float(), -1).reshape(-1, v)
            return liger(logq, logp).sum(-1).reshape(x.shape[:-1])  # KL(π‖ρ)

        table["liger"] = liger_fn
    except Exception as exc:  # not installed / incompatible: reported, not fatal
        print(f"liger: not available ({type(exc).__name__}: {exc})")
    if args.providers:
        table = {k: v for k, v in table.items() if k in args.providers}

    def timed(fn, n):
        return _timed(torch, fn, n)

    rows = []
    device = torch.device("cuda")

    def prepare(shape, dtype, g):
        """Inputs (x, y) of ``shape``/``dtype`` from generator ``g``, the float64 KL of their
        first rows (error check), the read floors of one fwd / fwd+bwd pass and the bytes each
        moves (both inputs read; for fwd+bwd read twice and one gradient written)."""
        x = (torch.randn(shape, generator=g, device=device) * 2).to(dtype)
        y = (x.float() + 0.3 * torch.randn(shape, generator=g, device=device)).to(dtype)
        v = shape[-1]
        sub = (x.reshape(-1, v)[:ERROR_ROWS], y.reshape(-1, v)[:ERROR_ROWS])
        want = full_kl_reference(*sub)
        in_bytes = 2 * x.numel() * x.element_size()
        floors = {
            "fwd": timed(lambda: (x.sum(dtype=torch.float32), y.sum(dtype=torch.float32)), args.repeats),
            "fwd+bwd": timed(
                lambda: (x.sum(dtype=torch.float32), y.sum(dtype=torch.float32),
                         x.sum(dtype=torch.float32), y.sum(dtype=torch.float32),
                         torch.empty_like(x).fill_(1)),
                args.repeats,
            ),
        }
        moved = {"fwd": in_bytes, "fwd+bwd": 2 * in_bytes + x.numel() * x.element_size()}
        return x, y, sub, want, floors, moved

    def measure(rows, call, kl_of_sub, want, shape, dname, mode, name, floors, moved):
        """Time ``call`` (warm-up, medians), its peak extra CUDA memory and the max error of
        ``kl_of_sub()`` against the float64 ``want``; append and print one row (NaN and the
        exception's name where it failed, e.g. out of memory: the run goes on)."""
        try:
            for _ in range(args.warmup):
                call()
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            ms = timed(call, args.repeats)
            peak = (torch.cuda.max_memory_allocated() - base) / 2**20
            with torch.no_grad():
                err = (kl_of_sub().double() - want).abs().max().item()
            note = ""
        except Exception as exc:  # recorded, the run goes on
            ms, peak, err, note = float("nan"), float("nan"), float("nan"), type(exc).__name__
            torch.cuda.empty_cache()
        row = {
            "shape": "x".join(map(str, shape)), "dtype": dname, "mode": mode,
            "provider": name, "ms": ms, "GB/s": moved[mode] / ms / 1e6,
            "x_floor": ms / floors[mode], "peak_extra_MiB": peak, "max_err": err,
            "note": note,
        }
        rows.append(row)
        print("  " + "  ".join(f"{k}={row[k]:.4g}" if isinstance(row[k], float) else
                                f"{k}={row[k]}" for k in row))

    print(f"device {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    for shape, dname in _cases(args):
        dtype = dtypes[dname]
        g = torch.Generator(device=device).manual_seed(0)
        x, y, sub, want, floors, moved = prepare(shape, dtype, g)
        for mode in ("fwd", "fwd+bwd"):
            print(f"{shape} {dname} {mode}: floor {floors[mode]:.3f} ms")
            for name, fn in table.items():
                xg = x.detach().requires_grad_(mode == "fwd+bwd")

                def call():
                    kl = fn(xg, y)
                    if mode == "fwd+bwd":
                        kl.sum().backward()
                        xg.grad = None
                    return kl

                measure(rows, call, lambda: fn(*sub), want, shape, dname, mode, name,
                        floors, moved)
        del x, y
        torch.cuda.empty_cache()
    for text in args.one_pass_shapes:  # one pass vs three calls
        shape, dname = tuple(int(n) for n in text.lower().split("x")), "bf16"
        g = torch.Generator(device=device).manual_seed(0)
        x, y, sub, want, floors, moved = prepare(shape, torch.bfloat16, g)
        tokens = torch.randint(0, shape[-1], shape[:-1], generator=g, device=device)
        one_pass = one_pass_providers(tokens)
        sub_one_pass = one_pass_providers(tokens.reshape(-1)[:ERROR_ROWS])
        for mode in ("fwd", "fwd+bwd"):
            print(f"{shape} {dname} one pass {mode}: floor {floors[mode]:.3f} ms")
            for name, fn in one_pass.items():
                xg = x.detach().requires_grad_(mode == "fwd+bwd")

                def call():
                    kl, lp, h = fn(xg, y)
                    if mode == "fwd+bwd":
                        (kl + lp + h).sum().backward()
                        xg.grad = None
                    return kl

                measure(rows, call, lambda: sub_one_pass[name](*sub)[0], want, shape, dname,
                        mode, name, floors, moved)
        del x, y
        torch.cuda.empty_cache()
    _write(rows, args.out, "bench_gpu",
           f"GPU benchmark, {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
