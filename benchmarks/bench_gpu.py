"""GPU benchmark of the exact KL, side by side in one process (needs a CUDA device).

Providers (``--providers``, default ``triton seed kl_div compile liger``): the Triton backend,
the seed formula (two log_softmax, exp, product, sum), ``F.kl_div`` on two log-softmaxes, the
seed formula under ``torch.compile``, and Liger-Kernel's ``LigerKLDIVLoss`` where it imports
(it takes log-probs: its time includes the two log_softmax passes; forward only, since it gives
no gradient to the log-probs of the policy). ``streaming`` (the portable backend) runs only when
named: on CUDA it is launch-bound (tiles of 2^18 elements, ~27 ATen ops each forward: 0.4-0.9 M
launches per call at these shapes, seconds per call).

Modes: forward, and forward+backward (gradient w.r.t. the policy logits). Each row: the median
time (CUDA events), the achieved GB/s (bytes of one read of both inputs; + the gradient write
and a second read for forward+backward), the ratio to the read floor measured in the same run
(one pass reading both inputs: ``x.sum() + y.sum()`` in fp32 accumulation; for
forward+backward, read both, read again and write one tensor the size of the policy), the peak
extra memory (``torch.cuda.max_memory_allocated``, reset per row, above what was allocated
before the row's timed calls), and the errors of the last timed call itself against float64:
``max_err`` over its first and last 16 rows (the last rows lie past 2^31 elements at the large
shapes), ``grad_err`` of the gradient of its last row relative to that row's largest entry,
``tol_ok`` whether both are within the test suite's tolerances (tests/tolerances.py).

One-pass rows: KL + the sampled tokens' log-probs + the entropy of one batch, by three calls
(``full_kl``, ``token_logprobs``, ``entropy``: the policy logits read three times) against one
call of the Triton backend's ``token_stats`` (read once), forward and forward+backward (the
gradient of the sum of the three), at ``--one-pass-shapes`` (default 8x4096x128256 bf16).
Their GB/s and floor ratio count one read of both inputs; their errors cover all three outputs.

Sampler rows (``--sampler-shapes``, default 1x2048x128256 in bf16 and fp32, ``BxTxV:fp32``; fp32
top-p takes the candidate list): ``full_kl`` on the Triton
backend untruncated against the same call with ``top_k=50``, ``top_p=0.9``, ``min_p=0.05`` and
``top_k=50, top_p=0.9`` (the threshold computed in the kernels before the KL), forward and
forward+backward, and the threshold alone (``klpenalty.sampling.sampling_threshold``) by the Triton kernel and by
the portable rule in PyTorch ops (``ops/streaming/threshold.py``, what the streaming backend runs): its
time against the plain KL's is the cost of truncating. Their errors: against float64 on the
support of the portable rule's threshold (``tol_ok`` of the threshold rows: the same τ as it).

The ``compile`` rows run last, after every other row: a fresh ``torch.compile`` (static shapes)
per shape and mode, its first call's seconds in ``compile_s``; all of them share
``--compile-budget`` seconds (an alarm stops a compilation that overruns; later ones are
recorded as not run).

Rows are appended to ``bench_gpu.csv`` and ``bench_gpu.md`` under ``--out`` as they are
measured (flushed), so a run stopped by a timeout keeps what it measured. Memory is released
between shapes (every tensor of a shape is local to its function; ``empty_cache`` after).

``--linear`` runs the linear_kl rows instead: ``klpenalty.linear_kl`` (exact KL straight from
the hidden states and LM heads) and ``klpenalty.linear_policy_loss`` (the same Σ KL as a fused
loss, its gradient formed in the forward) at chunk rows R = ``--chunk-rows`` (default 256 1024
2048; the fused loss also at its default R) against the unfused path (both ``F.linear`` + ``full_kl``, with backward into the policy's
hidden states and weight), and Liger-Kernel's ``LigerFusedLinearJSD`` at β = 1 where it imports
(its scalar loss, the teacher frozen), at (N = 16384, H = 4096, V = 128256) bf16: median time
of fwd and fwd+bwd, its ratio to the unfused row, and the peak extra memory (whole, and beyond
the returned gradients of the hidden states and weight) against one model's (N, V) bf16 logits.
Each kind of row is one function in ``LINEAR_ROW_KINDS``. Writes bench_gpu_linear.{csv,md}.

Written for torch 2.11 / Triton 3.6 / Python 3.12 (no network needed). Usage::

    python benchmarks/bench_gpu.py                       # the four default shapes
    python benchmarks/bench_gpu.py --shapes 2x512x32000 --dtypes bf16 --repeats 5
    python benchmarks/bench_gpu.py --linear --repeats 5  # linear_kl rows
"""

from __future__ import annotations

import argparse
import csv
import gc
import os
import signal
import sys
import time
from types import SimpleNamespace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = [
    ((8, 4096, 128256), "bf16"),
    ((8, 4096, 128256), "fp32"),
    ((4, 8192, 151936), "bf16"),
    ((16, 2048, 32000), "fp32"),
]
OUT_DIR = os.path.join(ROOT, "benchmarks", "results", "gpu")
DEVICE = "cuda"  # the dry run of tests/test_bench_gpu.py sets "cpu"
CHECK_ROWS = 16  # the timed call's first and last rows compared with float64
PROVIDERS = ["triton", "seed", "kl_div", "compile", "liger", "streaming"]
DEFAULT_PROVIDERS = PROVIDERS[:-1]  # streaming only when named (launch-bound on CUDA)
FORWARD_ONLY = {"liger": "forward only: no gradient to the policy's log-probs"}
LINEAR_SHAPE = (16384, 4096, 128256)  # (N tokens, H hidden, V vocabulary), bf16
CHUNK_ROWS = (256, 1024, 2048)
FIELDS = ["shape", "dtype", "mode", "provider", "ms", "GB/s", "x_floor", "peak_extra_MiB",
          "max_err", "grad_err", "tol_ok", "compile_s", "note"]
LINEAR_FIELDS = ["shape", "dtype", "mode", "provider", "chunk_rows", "ms", "x_unfused",
                 "peak_extra_MiB", "beyond_grads_MiB", "x_one_logits", "note"]
MODES = ("fwd", "fwd+bwd")


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="*", default=None,
                   help="BxTxV shapes (default: four LLM shapes, each with its dtype)")
    p.add_argument("--dtypes", nargs="*", default=None, choices=["bf16", "fp16", "fp32"],
                   help="dtypes for --shapes (default bf16)")
    p.add_argument("--repeats", type=int, default=10, help="timed calls per provider (median)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--providers", nargs="*", default=DEFAULT_PROVIDERS, choices=PROVIDERS,
                   help="subset of the providers (default: all but streaming)")
    p.add_argument("--compile-budget", type=float, default=90.0,
                   help="seconds all torch.compile compilations may take together")
    p.add_argument("--compile-backend", default="inductor",
                   help="torch.compile backend of the compile rows")
    p.add_argument("--one-pass-shapes", nargs="*", default=["8x4096x128256"],
                   help="BxTxV shapes (bf16) of the one-pass rows; none to skip them")
    p.add_argument("--sampler-shapes", nargs="*",
                   default=["1x2048x128256", "1x2048x128256:fp32"],
                   help="BxTxV shapes of the sampler rows, bf16 or BxTxV:fp32; none to skip "
                        "them")
    p.add_argument("--out", default=OUT_DIR, help="folder for bench_gpu.csv / bench_gpu.md")
    p.add_argument("--linear", action="store_true",
                   help="the linear_kl rows instead (bench_gpu_linear.{csv,md})")
    p.add_argument("--linear-shape", default="x".join(map(str, LINEAR_SHAPE)),
                   help="NxHxV of the --linear rows")
    p.add_argument("--chunk-rows", nargs="*", type=int, default=list(CHUNK_ROWS),
                   help="linear_kl chunk rows R of the --linear rows")
    return p.parse_args(argv)


def _cases(args):
    if not args.shapes:
        return SHAPES
    dtypes = args.dtypes or ["bf16"]
    return [(tuple(int(n) for n in s.lower().split("x")), d) for s in args.shapes for d in dtypes]


def _fmt(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


class Table:
    """One result table, written as it grows: ``<stem>.csv`` and ``<stem>.md`` under ``out``,
    each row appended and flushed when it is measured (a run stopped by a timeout keeps its
    rows), and printed."""

    def __init__(self, out: str, stem: str, title: str, fields: list[str]):
        os.makedirs(out, exist_ok=True)
        self.fields, self.rows = fields, []
        self.csv_path = os.path.join(out, stem + ".csv")
        self.md_path = os.path.join(out, stem + ".md")
        self._csv = open(self.csv_path, "w", newline="")
        self._writer = csv.DictWriter(self._csv, fieldnames=fields)
        self._writer.writeheader()
        self._csv.flush()
        self._md = open(self.md_path, "w")
        self._md.write(f"{title}, {time.strftime('%Y-%m-%d')}\n\n| " + " | ".join(fields)
                       + " |\n|" + "---|" * len(fields) + "\n")
        self._md.flush()

    def add(self, row: dict) -> None:
        unknown = set(row) - set(self.fields)
        if unknown:
            raise ValueError(f"row keys {sorted(unknown)} are not columns of {self.csv_path}")
        row = {k: row.get(k, "") for k in self.fields}
        self.rows.append(row)
        self._writer.writerow(row)
        self._csv.flush()
        self._md.write("| " + " | ".join(_fmt(row[k]).replace("|", "/") for k in self.fields)
                       + " |\n")
        self._md.flush()
        print("  " + "  ".join(f"{k}={_fmt(v)}" for k, v in row.items() if v != ""), flush=True)

    def close(self) -> None:
        self._csv.close()
        self._md.close()
        print(f"wrote {self.csv_path} and {os.path.basename(self.md_path)}", flush=True)


def _note(exc: BaseException) -> str:
    """An exception as one short line (a table cell)."""
    return " ".join(f"{type(exc).__name__}: {exc}".split())[:160]


def _timed(torch, fn, n):
    """(median milliseconds, the last call's result) of n calls of fn (CUDA events,
    synchronised around each call). The previous call's result is dropped before each call,
    so that one result at most is alive."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times, out = [], None
    for _ in range(n):
        out = None
        torch.cuda.synchronize()
        start.record()
        out = fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2], out


def _make_call(fn, leaves, backward: bool):
    """(call, reset) for timing ``fn(*leaves)``, which returns a tuple of tensors. ``call()``
    drops the leaves' gradients, runs fn and, for forward+backward, backpropagates the sum of
    its outputs; it returns (the outputs, detached; the leaves' gradients or None), which are
    what the error columns read. ``reset()`` drops the gradients (before a memory baseline)."""

    def reset():
        for t in leaves:
            t.grad = None

    def call():
        reset()
        outs = fn(*leaves)
        if not backward:
            return list(outs), None
        sum(o.sum() for o in outs).backward()
        return [o.detach() for o in outs], [t.grad for t in leaves]

    return call, reset


def _warm_and_time(torch, call, reset, warmup: int, repeats: int):
    """(median ms, the last call's result, peak extra MiB) of ``call`` after ``warmup`` calls:
    the peak of ``torch.cuda.max_memory_allocated`` over the timed calls (reset first) above
    what was allocated before them, the warm-up's results dropped (``reset``)."""
    for _ in range(warmup):
        call()
    reset()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    ms, result = _timed(torch, call, repeats)
    return ms, result, (torch.cuda.max_memory_allocated() - base) / 2**20


def _release(torch) -> None:
    """Give the caching allocator's free blocks back (after a shape's tensors are gone)."""
    gc.collect()
    torch.cuda.empty_cache()


def _tolerances():
    """The test suite's one tolerance table (tests/tolerances.py): (TOLERANCES, GRAD_REL_TOL)."""
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    from tests.tolerances import GRAD_REL_TOL, TOLERANCES

    return TOLERANCES, GRAD_REL_TOL


def check_rows(n_rows: int, k: int = CHECK_ROWS) -> list[int]:
    """The first and last ``k`` of ``n_rows`` rows, each once, in order."""
    return sorted(set(range(min(k, n_rows))) | set(range(max(0, n_rows - k), n_rows)))


def timed_call_errors(torch, x, y, outs, grad, reference):
    """(max_err, grad_err, tol_ok) of one timed call's own outputs against float64.

    x, y: the (..., V) inputs of the call; outs: its per-position outputs (each (...)); grad: its
    gradient w.r.t. x (or None: forward only); reference(xs, ys, rows) -> the float64 outputs,
    in the order of ``outs``, of rows ``rows`` (xs, ys their (k, V) logits), differentiable.
    ``max_err``: max abs error over the first and last CHECK_ROWS rows; ``grad_err``: max abs
    error of the gradient of the last row over that row's largest entry; ``tol_ok``: "yes" if
    both are within tests/tolerances.py for x's dtype, else "no"."""
    tolerances, grad_rel = _tolerances()
    atol, rtol = tolerances[x.dtype]
    v = x.shape[-1]
    xf, yf = x.reshape(-1, v), y.reshape(-1, v)
    rows = torch.tensor(check_rows(xf.shape[0]), device=x.device)
    with torch.no_grad():
        want = reference(xf[rows], yf[rows], rows)
        gaps = [(o.reshape(-1)[rows].double() - w).abs() for o, w in zip(outs, want)]
        err = torch.cat(gaps).max().item()  # NaN if any output is NaN
        ok = all(bool((g <= atol + rtol * w.abs()).all()) for g, w in zip(gaps, want))
    grad_err = ""
    if grad is not None:
        last = xf.shape[0] - 1
        xr = xf[last:].double().requires_grad_(True)
        with torch.enable_grad():
            sum(t.sum() for t in reference(xr, yf[last:], rows[-1:])).backward()
        want_grad = xr.grad[0]
        scale, rel = want_grad.abs().max(), grad_rel[x.dtype]
        gap = (grad.reshape(-1, v)[last].double() - want_grad).abs()
        grad_err = (gap.max() / scale).item()
        # GRAD_REL_TOL as the suite applies it (tests/ops/test_streaming.py)
        ok = ok and bool((gap <= rel * scale + rel * want_grad.abs()).all())  # False for NaN
    return err, grad_err, "yes" if ok else "no"


class CompileBudgetSpent(RuntimeError):
    """The compile rows' shared budget is spent (or a compilation ran past it)."""


class CompiledFormula:
    """The seed formula (log_softmax difference times softmax, summed) under ``torch.compile``:
    a fresh compilation (dynamo reset, static shapes) per row, whose first call is timed
    separately; all compilations together get ``budget`` seconds, enforced by an alarm."""

    def __init__(self, torch, formula, backend: str, budget: float):
        self.torch, self.formula, self.backend = torch, formula, backend
        self.budget, self.spent, self.fn = budget, 0.0, None

    def __call__(self, x, y):
        return (self.fn(x, y),)

    def first_call(self, call) -> float:
        """Compile afresh and run ``call`` once; its wall seconds (compilation included)."""
        left = self.budget - self.spent
        if left <= 0:
            raise CompileBudgetSpent(f"not run: the compile budget ({self.budget:g} s) is spent")

        def alarm(*_):
            raise CompileBudgetSpent(f"compilation ran past the budget ({self.budget:g} s)")

        torch = self.torch
        torch._dynamo.reset()
        self.fn = torch.compile(self.formula, dynamic=False, backend=self.backend)
        before = signal.signal(signal.SIGALRM, alarm)
        signal.setitimer(signal.ITIMER_REAL, left)
        t0 = time.perf_counter()
        try:
            call()
            torch.cuda.synchronize()
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, before)
            seconds = time.perf_counter() - t0
            self.spent += seconds
        return seconds


def kl_providers(args, torch):
    """name -> fn(x, y) returning (KL per position,), for the names in ``args.providers``."""
    import klpenalty
    from klpenalty.bench import kl_div_formula, seed_formula

    table = {
        "triton": lambda x, y: (klpenalty.full_kl(x, y, backend="triton"),),
        "seed": lambda x, y: (seed_formula(x, y),),
        "kl_div": lambda x, y: (kl_div_formula(x, y),),
        "compile": CompiledFormula(torch, seed_formula, args.compile_backend, args.compile_budget),
        "streaming": lambda x, y: (klpenalty.full_kl(x, y, backend="streaming"),),
    }
    if "liger" in args.providers:
        try:
            from liger_kernel.transformers import LigerKLDIVLoss

            liger = LigerKLDIVLoss(reduction="none", log_target=True)

            def liger_fn(x, y):  # log-probs first: Liger's KL starts from them
                v = x.shape[-1]
                logp = torch.log_softmax(x.float(), -1).reshape(-1, v)
                logq = torch.log_softmax(y.float(), -1).reshape(-1, v)
                return (liger(logq, logp).sum(-1).reshape(x.shape[:-1]),)  # KL(π‖ρ)

            table["liger"] = liger_fn
        except Exception as exc:  # not installed / incompatible: reported, not fatal
            print(f"liger: not available ({type(exc).__name__}: {exc})")
    return {k: table[k] for k in args.providers if k in table}


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


def _inputs(torch, shape, dtype):
    """(x, y) of ``shape``/``dtype`` (seed 0), y a perturbation of x, and the generator."""
    g = torch.Generator(device=DEVICE).manual_seed(0)
    x = (torch.randn(shape, generator=g, device=DEVICE) * 2).to(dtype)
    y = (x.float() + 0.3 * torch.randn(shape, generator=g, device=DEVICE)).to(dtype)
    return x, y, g


def _floors(torch, x, y, repeats):
    """The read floors of one fwd / fwd+bwd pass (ms) and the bytes each moves (both inputs
    read; for fwd+bwd read twice and one gradient written); prints a copy ceiling too."""
    f32 = torch.float32
    floors = {
        "fwd": _timed(torch, lambda: (x.sum(dtype=f32), y.sum(dtype=f32)), repeats)[0],
        "fwd+bwd": _timed(
            torch, lambda: (x.sum(dtype=f32), y.sum(dtype=f32), x.sum(dtype=f32),
                            y.sum(dtype=f32), torch.empty_like(x).fill_(1)), repeats)[0],
    }
    nbytes = x.numel() * x.element_size()
    dst = torch.empty_like(x)
    copy_ms = _timed(torch, lambda: dst.copy_(x), repeats)[0]
    print(f"  copy ceiling {2 * nbytes / copy_ms / 1e6:.0f} GB/s (read + write of x)")
    return floors, {"fwd": 2 * nbytes, "fwd+bwd": 5 * nbytes}


def measure(ctx, table, row, fn, x, y, mode, reference, floors, moved):
    """Time ``fn(x, y)`` in ``mode`` (warm-up, median of ``--repeats``), its peak extra CUDA
    memory and the errors of its last timed call (:func:`timed_call_errors`); append ``row``
    with the results to ``table`` (NaN and the exception where it failed, e.g. out of memory:
    the run goes on)."""
    torch, args = ctx.torch, ctx.args
    xg = x.detach().requires_grad_(mode == "fwd+bwd")
    call, reset = _make_call(lambda a: fn(a, y), [xg], mode == "fwd+bwd")
    failed = False
    try:
        if isinstance(fn, CompiledFormula):
            row["compile_s"] = fn.first_call(call)
        ms, (outs, grads), peak = _warm_and_time(torch, call, reset, args.warmup, args.repeats)
        err, grad_err, ok = timed_call_errors(torch, x, y, outs, grads and grads[0], reference)
        row.update({"ms": ms, "GB/s": moved[mode] / ms / 1e6, "x_floor": ms / floors[mode],
                    "peak_extra_MiB": peak, "max_err": err, "grad_err": grad_err,
                    "tol_ok": ok})
        outs = grads = None
    except Exception as exc:  # recorded, the run goes on
        row.update({"ms": float("nan"), "note": _note(exc)})
        failed = True
    xg.grad = None
    if failed:  # outside the except block: its traceback no longer pins the temporaries
        torch.cuda.empty_cache()
    table.add(row)


def run_kl_case(ctx, table, shape, dname, providers):
    """The rows of ``providers`` at one shape and dtype, both modes. Every tensor of the shape
    is local here: it is freed when this returns."""
    from klpenalty.ops.reference import full_kl_reference

    torch = ctx.torch
    x, y, _ = _inputs(torch, shape, ctx.dtypes[dname])
    floors, moved = _floors(torch, x, y, ctx.args.repeats)

    def reference(xs, ys, rows):
        return (full_kl_reference(xs, ys),)

    for mode in MODES:
        print(f"{shape} {dname} {mode}: floor {floors[mode]:.3f} ms", flush=True)
        for name, fn in providers.items():
            if mode == "fwd+bwd" and name in FORWARD_ONLY:
                print(f"  {name}: {FORWARD_ONLY[name]}")
                continue
            row = {"shape": "x".join(map(str, shape)), "dtype": dname, "mode": mode,
                   "provider": name}
            measure(ctx, table, row, fn, x, y, mode, reference, floors, moved)


def run_one_pass_case(ctx, table, shape):
    """The one-pass rows (three calls vs one token_stats call) at one bf16 shape, both modes."""
    from klpenalty.ops.reference import (entropy_reference, full_kl_reference,
                                         token_logprobs_reference)

    torch = ctx.torch
    x, y, g = _inputs(torch, shape, torch.bfloat16)
    floors, moved = _floors(torch, x, y, ctx.args.repeats)
    tokens = torch.randint(0, shape[-1], shape[:-1], generator=g, device=DEVICE)
    flat_tokens = tokens.reshape(-1)

    def reference(xs, ys, rows):
        return (full_kl_reference(xs, ys), token_logprobs_reference(xs, flat_tokens[rows]),
                entropy_reference(xs))

    for mode in MODES:
        print(f"{shape} bf16 one pass {mode}: floor {floors[mode]:.3f} ms", flush=True)
        for name, fn in one_pass_providers(tokens).items():
            row = {"shape": "x".join(map(str, shape)), "dtype": "bf16", "mode": mode,
                   "provider": name}
            measure(ctx, table, row, fn, x, y, mode, reference, floors, moved)


# (provider, full_kl's sampler keywords) of the sampler rows; the first is the plain KL
SAMPLER_ROWS = [
    ("full_kl", {}),
    ("full_kl top_k=50", {"top_k": 50}),
    ("full_kl top_p=0.9", {"top_p": 0.9}),
    ("full_kl min_p=0.05", {"min_p": 0.05}),
    ("full_kl top_k=50 top_p=0.9", {"top_k": 50, "top_p": 0.9}),
]
THRESHOLD_ROW = {"top_k": 50, "top_p": 0.9}  # the threshold-alone rows' settings


def run_sampler_case(ctx, table, shape, dname="bf16"):
    """The sampler rows at one shape (bf16 or fp32 logits: fp32 top-p takes the candidate
    list): full_kl with each setting of SAMPLER_ROWS (both modes), then the threshold alone
    (forward) by the Triton kernel and by the portable rule."""
    import klpenalty
    from klpenalty import sampling
    from klpenalty.ops import contract
    from klpenalty.ops.streaming import threshold as thresholds
    from klpenalty.ops.reference import full_kl_reference

    torch = ctx.torch
    x, y, _ = _inputs(torch, shape, {"bf16": torch.bfloat16, "fp32": torch.float32}[dname])
    floors, moved = _floors(torch, x, y, ctx.args.repeats)

    def rule(xs, kw):  # the portable rule's τ of rows xs (k, V)
        return thresholds.threshold_rows(xs, kw.get("top_k"), kw.get("top_p"), kw.get("min_p"),
                                         1.0, None, thresholds.LOCAL)

    def reference_for(kw):
        def reference(xs, ys, rows):
            tau = rule(xs.detach(), kw) if kw else None
            # −1e30 off the support: e^u = 0 there as with −inf, and float64 autograd stays
            # finite (0·(−inf) would give NaN gradients)
            kept = contract.kept_logits(xs.double(), None, tau).clamp_min(-1e30)
            return (full_kl_reference(kept, ys),)

        return reference

    for mode in MODES:
        print(f"{shape} {dname} sampler {mode}: floor {floors[mode]:.3f} ms", flush=True)
        for name, kw in SAMPLER_ROWS:
            def fn(a, b, kw=kw):
                return (klpenalty.full_kl(a, b, backend="triton", **kw),)

            row = {"shape": "x".join(map(str, shape)), "dtype": dname, "mode": mode,
                   "provider": name}
            measure(ctx, table, row, fn, x, y, mode, reference_for(kw), floors, moved)

    def same_tau(xs, ys, rows):  # the threshold rows' "reference": the portable rule's τ
        return (rule(xs, THRESHOLD_ROW).double(),)

    label = " ".join(f"{k}={v}" for k, v in THRESHOLD_ROW.items())
    for name, backend in (("triton", "triton"), ("portable rule", "streaming")):
        def fn(a, b, backend=backend):
            return (sampling.sampling_threshold(a, backend=backend, **THRESHOLD_ROW),)

        row = {"shape": "x".join(map(str, shape)), "dtype": dname, "mode": "fwd",
               "provider": f"threshold {label} {name}"}
        measure(ctx, table, row, fn, x, y, "fwd", same_tau, floors, moved)


# --------------------------------------------------------------------------- the --linear rows
# Each kind of row is one function of the context (torch, F, klpenalty, the frozen reference
# hr, wr, sampled tokens, n, h, v, chunk_rows) returning [(provider, chunk_rows or "",
# loss(hp, wp) -> scalar)]; the unfused kind comes first (the other rows' ratios refer to it).
def linear_unfused_rows(ctx):
    """Both models' (N, V) logits by F.linear, then full_kl: the baseline of the other rows."""
    def loss(hp, wp):
        return ctx.klpenalty.full_kl(ctx.F.linear(hp, wp), ctx.F.linear(ctx.hr, ctx.wr)).sum()

    return [("unfused", "", loss)]


def linear_kl_rows(ctx):
    """klpenalty.linear_kl at each of ``ctx.chunk_rows``."""
    def loss_at(rows):
        return lambda hp, wp: ctx.klpenalty.linear_kl(hp, wp, ctx.hr, ctx.wr,
                                                      chunk_rows=rows).kl.sum()

    return [(f"linear_kl R={r}", r, loss_at(r)) for r in ctx.chunk_rows]


def linear_policy_loss_rows(ctx):
    """klpenalty.linear_policy_loss at each of ``ctx.chunk_rows`` and at its default chunk
    rows: the same loss as the other rows (beta = 1, no advantages, reduction "sum": Σ KL), its
    gradient formed in the forward (fwd without gradients: the two heads' GEMMs only)."""
    def loss_at(rows):
        return lambda hp, wp: ctx.klpenalty.linear_policy_loss(
            hp, wp, ctx.hr, ctx.wr, ctx.tokens, beta=1.0, reduction="sum", chunk_rows=rows
        ).loss

    default = ctx.klpenalty.linear.default_chunk_rows(
        ctx.n, ctx.v, ctx.hr.device, ctx.wr.shape[1], ctx.wr.dtype
    )
    rows = list(dict.fromkeys([*ctx.chunk_rows, default]))
    return [(f"fused_loss R={r}", r, loss_at(r)) for r in rows]


def liger_jsd_rows(ctx):
    """Liger-Kernel's fused linear JSD at β = 1 (its KL; a scalar, teacher frozen), if usable."""
    try:
        from liger_kernel.transformers import LigerFusedLinearJSD

        jsd = LigerFusedLinearJSD(jsd_beta=1.0)
    except Exception as exc:  # not installed / too old for β = 1: reported, not fatal
        print(f"liger LigerFusedLinearJSD: not installed or unusable ({type(exc).__name__}: {exc})")
        return []
    return [("liger_jsd_b1", "", lambda hp, wp: jsd(hp, wp, ctx.hr, ctx.wr))]


LINEAR_ROW_KINDS = [linear_unfused_rows, linear_kl_rows, linear_policy_loss_rows,
                    liger_jsd_rows]


def linear_main(args) -> int:
    """The --linear rows: LINEAR_ROW_KINDS at one (N, H, V) bf16 shape, both modes."""
    import torch
    import torch.nn.functional as F

    import klpenalty

    n, h, v = (int(x) for x in args.linear_shape.lower().split("x"))
    g = torch.Generator(device=DEVICE).manual_seed(0)
    dtype = torch.bfloat16
    wp = (torch.randn(v, h, generator=g, device=DEVICE) * h**-0.5 * 2).to(dtype)
    wr = (wp.float() + torch.randn(v, h, generator=g, device=DEVICE) * h**-0.5 * 0.3).to(dtype)
    hp = torch.randn(n, h, generator=g, device=DEVICE).to(dtype)
    hr = (hp.float() + 0.3 * torch.randn(n, h, generator=g, device=DEVICE)).to(dtype)
    tokens = torch.randint(0, v, (n,), generator=g, device=DEVICE)
    _release(torch)
    logits_mib = n * v * 2 / 2**20  # one model's (N, V) bf16 logits
    grads_mib = (n + v) * h * 2 / 2**20  # the returned gradients of hidden states and weight
    ctx = SimpleNamespace(torch=torch, F=F, klpenalty=klpenalty, hr=hr, wr=wr, tokens=tokens,
                          n=n, h=h, v=v, chunk_rows=args.chunk_rows)
    title = f"linear_kl GPU benchmark, {torch.cuda.get_device_name(0)}, torch {torch.__version__}"
    table = Table(args.out, "bench_gpu_linear", title, LINEAR_FIELDS)
    print(f"linear rows N={n} H={h} V={v} bf16; one model's logits {logits_mib:.0f} MiB",
          flush=True)
    rows = [r for kind in LINEAR_ROW_KINDS for r in kind(ctx)]
    for mode in MODES:
        base_ms = float("nan")
        for name, chunk, loss in rows:
            a = hp.detach().requires_grad_(mode == "fwd+bwd")
            b = wp.detach().requires_grad_(mode == "fwd+bwd")
            call, reset = _make_call(lambda a, b: (loss(a, b),), [a, b], mode == "fwd+bwd")
            failed = False
            try:
                timed = _warm_and_time(torch, call, reset, args.warmup, args.repeats)
                ms, peak, note = timed[0], timed[2], ""
                del timed  # the last call's gradients go before the next row
            except Exception as exc:  # e.g. out of memory: recorded, the run goes on
                ms, peak, note = float("nan"), float("nan"), _note(exc)
                failed = True
            reset()
            if failed:  # outside the except block: its traceback no longer pins the temporaries
                torch.cuda.empty_cache()
            if name == "unfused":
                base_ms = ms
            beyond = peak - (grads_mib if mode == "fwd+bwd" else 0.0)
            table.add({
                "shape": f"N={n} H={h} V={v}", "dtype": "bf16", "mode": mode, "provider": name,
                "chunk_rows": chunk, "ms": ms, "x_unfused": ms / base_ms, "peak_extra_MiB": peak,
                "beyond_grads_MiB": beyond, "x_one_logits": beyond / logits_mib, "note": note,
            })
    table.close()
    return 0


def _environment(torch) -> str:
    """One line: Python, torch, Triton and the device."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError as exc:
        triton_version = f"not importable ({exc})"
    return (f"python {sys.version.split()[0]}, torch {torch.__version__}, triton "
            f"{triton_version}, device {torch.cuda.get_device_name(0)}")


def main(argv=None) -> int:
    args = _parse(argv)
    import torch

    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("bench_gpu.py: no CUDA device here; this benchmark runs on a GPU only", file=sys.stderr)
        return 2
    print(_environment(torch), flush=True)
    if args.linear:
        return linear_main(args)
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    ctx = SimpleNamespace(torch=torch, args=args, dtypes=dtypes)
    providers = kl_providers(args, torch)
    name = torch.cuda.get_device_name(0)
    table = Table(args.out, "bench_gpu", f"GPU benchmark, {name}, torch {torch.__version__}",
                  FIELDS)
    print(f"providers {', '.join(providers)}", flush=True)
    first = {k: fn for k, fn in providers.items() if k != "compile"}
    cases = _cases(args)
    for shape, dname in cases:
        if first:
            run_kl_case(ctx, table, shape, dname, first)
            _release(torch)
    for text in args.one_pass_shapes:  # one pass vs three calls
        run_one_pass_case(ctx, table, tuple(int(n) for n in text.lower().split("x")))
        _release(torch)
    for text in args.sampler_shapes:  # truncated KL vs the plain one
        dims, _, dname = text.lower().partition(":")
        run_sampler_case(ctx, table, tuple(int(n) for n in dims.split("x")), dname or "bf16")
        _release(torch)
    if "compile" in providers:  # last: the compilations take the longest
        for shape, dname in cases:
            run_kl_case(ctx, table, shape, dname, {"compile": providers["compile"]})
            _release(torch)
        print(f"compile rows: {providers['compile'].spent:.1f} s of compilation "
              f"(budget {args.compile_budget:g} s)")
    table.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
