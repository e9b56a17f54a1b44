"""Distillation divergences from hidden states on CPU: klpenalty, TRL's chunked kernel and the
materialised PyTorch formula, side by side, forward + backward.

    PYTHONPATH=src .venv/bin/python benchmarks/bench_divergence_trl.py          # the full grid
    PYTHONPATH=src .venv/bin/python benchmarks/bench_divergence_trl.py --quick  # smoke test
    PYTHONPATH=src .venv/bin/python benchmarks/bench_divergence_trl.py --shapes 1024:896:151936 \
        --dtypes bf16 --providers klpenalty trl --no-memory

Per token, the divergence between a student's and a teacher's next-token distributions,
π = softmax(h_s W_sᵀ) and ν = softmax(h_t W_tᵀ), from the hidden states and LM heads, the
gradient flowing to the student's hidden states and head weight (the teacher is a constant).
Providers (``--providers``):

- ``klpenalty``: ``klpenalty.linear_divergence(h_s, W_s, h_t, W_t, kind, beta=β,
  backend="auto")``;
- ``klpenalty_planned``: the same with ``expected_grads=lambda rows, v: torch.ones_like(v)``
  (the loss Σ values announced: the student's gradients formed in the forward, 4 LM-head GEMMs
  in all instead of 6);
- ``trl``: TRL's ``trl.kernels.chunked_divergence.ChunkedDivergenceFunction.apply(h_s, W_s,
  None, h_t, W_t, None, beta, 1.0)`` (its torch path on CPU; the divergence of the returned
  (divergence, entropy)). TRL's ``beta`` picks the divergence: 0.0 is the forward KL(ν‖π),
  1.0 the reverse KL(π‖ν), and 0 < β < 1 the generalised JSD with M = (1−β)·π + β·ν, which is
  klpenalty's ``"jsd"`` with the same ``beta`` (M = β·ν + (1−β)·π, β the teacher's weight);
  the ``Δ vs klpenalty`` column checks the mapping on every row;
- ``torch``: the unfused formula: logits = ``F.linear`` in the input dtype (the teacher's
  without grad), ``log_softmax`` in float32, the divergence written out in PyTorch ops
  (:func:`formula`).

Kinds (``--kinds``): ``forward_kl`` (TRL beta=0.0), ``reverse_kl`` (beta=1.0), ``jsd`` with
β = ``--beta`` (0.5; TRL beta=β). Inputs: ``bench_linear_kl.make_inputs`` (seeded; the
teacher's head and hidden states the student's plus noise, logits O(2)); both hidden sizes H.

For each (shape, dtype, kind), per provider:

- errors against float64: the same hidden states and weights (rounded to the dtype) upcast,
  the float64 formula (:func:`reference`, in row chunks); the max abs error of the values, of
  the gradient of Σ values to the student's hidden states (∂h) and to its head weight (∂W),
  each also over the float64 entry of largest magnitude (``rel``). ``≤2× torch``: "yes" if all
  three max abs errors are at most twice the ``torch`` row's in the same dtype, else the ones
  that are not (the torch row: "ref"; blank without a torch row);
- time: forward + backward of Σ values; the error call is the warm-up, then ``--rounds``
  rounds interleaved across the providers (the order reversed every other round); medians;
- peak memory: in a fresh process per (shape, dtype, kind, provider), forked from a server
  process that has only imported torch, klpenalty and TRL (so each measurement skips TRL's
  import): after a small warm-up call and the inputs allocated, the high-water mark is reset
  (``/proc/self/clear_refs``), and the peak is ``VmHWM`` after one forward + backward minus
  ``VmRSS`` before it (the gradients of h_s and W_s included; ``--no-memory`` skips it).

``× trl`` / ``× torch`` on the klpenalty rows (both): its median time and peak over the other
provider's. Writes ``benchmarks/results/bench_divergence_trl.{csv,md}`` (``--quick``:
``benchmarks/results/tmp/bench_divergence_trl_quick``) with the CPU model, core and thread
counts, the torch and TRL versions and the 1-minute load average before and after.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import klpenalty  # noqa: E402
from bench_linear_kl import make_inputs  # noqa: E402
from bench_trl_step import machine, peak_rss_mib  # noqa: E402

PROVIDERS = ("klpenalty", "klpenalty_planned", "trl", "torch")
KINDS = ("forward_kl", "reverse_kl", "jsd")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
SHAPES = ("4096:512:32000", "4096:512:151936", "4096:896:32000", "4096:896:151936")
QUICK = {"shapes": ["64:64:2000"], "rounds": 1}
COLUMNS = ["shape", "dtype", "kind", "provider", "setting", "median s", "× trl", "× torch",
           "peak MiB", "mem × trl", "mem × torch", "value err (rel)", "∂h err (rel)",
           "∂W err (rel)", "≤2× torch", "Δ vs klpenalty"]


def trl_beta(kind: str, beta: float) -> float:
    """TRL's ``beta`` for klpenalty's ``kind``: 0.0 forward KL, 1.0 reverse KL, β the JSD."""
    return {"forward_kl": 0.0, "reverse_kl": 1.0, "jsd": beta}[kind]


def setting(provider: str, kind: str, beta: float) -> str:
    if provider.startswith("klpenalty"):
        planned = ", expected_grads=1" if provider == "klpenalty_planned" else ""
        return f'kind="{kind}"' + (f", beta={beta}" if kind == "jsd" else "") + planned
    if provider == "trl":
        return f"beta={trl_beta(kind, beta)}"
    return "formula"


def formula(ls: torch.Tensor, lt: torch.Tensor, kind: str, beta: float) -> torch.Tensor:
    """The divergence of the student's log-probs ``ls`` and the teacher's ``lt`` (..., V),
    summed over V, in plain ops: KL(ν‖π), KL(π‖ν), or β·KL(ν‖M) + (1−β)·KL(π‖M) with
    M = β·ν + (1−β)·π."""
    if kind == "forward_kl":
        return (lt.exp() * (lt - ls)).sum(-1)
    if kind == "reverse_kl":
        return (ls.exp() * (ls - lt)).sum(-1)
    log_m = torch.logaddexp(lt + math.log(beta), ls + math.log(1 - beta))
    return (beta * lt.exp() * (lt - log_m) + (1 - beta) * ls.exp() * (ls - log_m)).sum(-1)


def provider_fn(name: str, kind: str, beta: float):
    """values = fn(h_s, W_s, h_t, W_t): the (N,) divergence, differentiable w.r.t. h_s, W_s."""
    if name == "klpenalty":
        def fn(hs, ws, ht, wt):
            return klpenalty.linear_divergence(hs, ws, ht, wt, kind, beta=beta, backend="auto")
    elif name == "klpenalty_planned":
        def fn(hs, ws, ht, wt):
            return klpenalty.linear_divergence(hs, ws, ht, wt, kind, beta=beta, backend="auto",
                                               expected_grads=lambda rows, v: torch.ones_like(v))
    elif name == "trl":
        from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

        b = trl_beta(kind, beta)

        def fn(hs, ws, ht, wt):
            out = ChunkedDivergenceFunction.apply(hs, ws, None, ht, wt, None, b, 1.0)
            return out[0]  # (divergence, entropy)
    elif name == "torch":
        def fn(hs, ws, ht, wt):
            with torch.no_grad():
                lt = F.log_softmax(F.linear(ht, wt).float(), -1)
            return formula(F.log_softmax(F.linear(hs, ws).float(), -1), lt, kind, beta)
    else:
        raise ValueError(name)
    return fn


def step(fn, inputs) -> torch.Tensor:
    """One forward + backward of Σ values; returns the values (detached)."""
    values = fn(*inputs)
    values.sum().backward()
    return values.detach()


def drop_grads(inputs) -> None:
    inputs[0].grad = inputs[1].grad = None


def reference(inputs, kind: str, beta: float):
    """Float64 (values (N,), ∂h (N, H), ∂W (V, H)) of the formula on the inputs upcast, in row
    chunks of about 32 MiB of float64 logits."""
    hs, ws, ht, wt = (t.detach().double() for t in inputs)
    ws.requires_grad_(True)
    n, vocab = hs.shape[0], ws.shape[0]
    rows = max(1, min(n, (1 << 22) // vocab))
    values = torch.empty(n, dtype=torch.float64)
    grad_h = torch.empty_like(hs)
    for s in range(0, n, rows):
        h = hs[s:s + rows].clone().requires_grad_(True)
        with torch.no_grad():
            lt = F.log_softmax(F.linear(ht[s:s + rows], wt), -1)
        v = formula(F.log_softmax(F.linear(h, ws), -1), lt, kind, beta)
        v.sum().backward()
        values[s:s + rows] = v.detach()
        grad_h[s:s + rows] = h.grad
    return values, grad_h, ws.grad


def errors(got, want) -> tuple[float, float]:
    """(max abs error, that over the largest |want|) of ``got`` against float64 ``want``."""
    err = (got.double() - want).abs().max().item()
    scale = want.abs().max().item()
    return err, (err / scale if scale > 0 else err)


def parse_shape(text: str) -> tuple[int, int, int]:
    try:
        n, h, v = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"shape {text!r}: want N:H:V") from None
    return n, h, v


def shape_name(shape) -> str:
    return "N={} H={} V={}".format(*shape)


# ---- peak memory: one forked process per measurement ------------------------------------

def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def measure_peak(req: dict) -> dict:
    """In this (fresh) process: a small warm-up call of the provider (its code loaded), the
    inputs, the high-water mark reset, one forward + backward; its peak above the RSS before."""
    torch.set_num_threads(req["threads"])
    n, h, v = req["shape"]
    fn = provider_fn(req["provider"], req["kind"], req["beta"])
    small = make_inputs(8, h, 256, DTYPES[req["dtype"]], seed=1)
    step(fn, small)
    del small
    inputs = make_inputs(n, h, v, DTYPES[req["dtype"]])
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS
        reset = True
    except OSError:
        reset = False
    base = _status_kib("VmRSS") / 1024
    step(fn, inputs)
    return {"peak_mib": round(peak_rss_mib() - base, 1), "hwm_reset": reset}


def memory_server() -> int:
    """Reads one JSON request a line from stdin; forks a child per request that measures it
    (:func:`measure_peak`) and writes one JSON line. This process only imports."""
    import importlib

    importlib.import_module("trl.kernels.chunked_divergence")  # once, before the forks

    for line in sys.stdin:
        req = json.loads(line)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            try:
                out = measure_peak(req)
            except BaseException as exc:  # report, never return into the server's loop
                out = {"error": f"{type(exc).__name__}: {exc}"}
            os.write(w, json.dumps(out).encode())
            os._exit(0)
        os.close(w)
        chunks = []
        while True:
            data = os.read(r, 65536)
            if not data:
                break
            chunks.append(data)
        os.close(r)
        _, status = os.waitpid(pid, 0)
        text = b"".join(chunks).decode()
        if not text:
            text = json.dumps({"error": f"child ended with status {status} (killed for memory?)"})
        print(text, flush=True)
    return 0


class MemoryServer:
    def __init__(self):
        env = dict(os.environ)
        src = os.path.join(os.path.dirname(HERE), "src")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, env.get("PYTHONPATH")]))
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--memory-server"], env=env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def peak(self, **req) -> float | str:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        out = json.loads(line) if line else {"error": "memory server ended"}
        if "error" in out:
            print(f"  peak memory {req}: {out['error']}", file=sys.stderr, flush=True)
            return "failed"
        return out["peak_mib"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


# ---- the benchmark ----------------------------------------------------------------------

def run_case(args, shape, dname: str, kind: str, server) -> list[dict]:
    """The rows of one (shape, dtype, kind): errors (the warm-up call), timed rounds, peaks."""
    n, h, v = shape
    inputs = make_inputs(n, h, v, DTYPES[dname])
    want = reference(inputs, kind, args.beta)
    fns = {p: provider_fn(p, kind, args.beta) for p in args.providers}
    rows, values = {}, {}
    for p, fn in fns.items():  # the warm-up call, whose outputs give the errors
        got = step(fn, inputs)
        values[p] = got
        errs = [errors(got, want[0]), errors(inputs[0].grad, want[1]),
                errors(inputs[1].grad, want[2])]
        drop_grads(inputs)
        rows[p] = {"shape": shape_name(shape), "n": n, "hidden": h, "vocab": v,
                   "dtype": dname, "kind": kind, "provider": p,
                   "setting": setting(p, kind, args.beta),
                   "value_err": errs[0][0], "value_rel": errs[0][1],
                   "grad_h_err": errs[1][0], "grad_h_rel": errs[1][1],
                   "grad_w_err": errs[2][0], "grad_w_rel": errs[2][1]}
    del want
    times = {p: [] for p in fns}
    order = list(fns)
    for r in range(args.rounds):
        for p in (order if r % 2 == 0 else order[::-1]):
            t0 = time.perf_counter()
            step(fns[p], inputs)
            times[p].append(time.perf_counter() - t0)
            drop_grads(inputs)
    del inputs
    for p in fns:
        row = rows[p]
        row["median_s"] = statistics.median(times[p])
        row["min_s"] = min(times[p])
        row["rounds"] = args.rounds
        row["threads"] = args.threads
        if "klpenalty" in values and p != "klpenalty":
            row["diff_vs_klpenalty"] = (values[p].double() - values["klpenalty"].double()
                                        ).abs().max().item()
        if server is not None:
            row["peak_mib"] = server.peak(shape=list(shape), dtype=dname, kind=kind, provider=p,
                                          beta=args.beta, threads=args.threads)
    ratios(rows)
    rule(rows)
    out = [rows[p] for p in fns]
    for row in out:
        print(" ".join(f"{k}={_fmt(row.get(k, ''))}" for k in
                       ("shape", "dtype", "kind", "provider", "median_s", "peak_mib",
                        "value_err", "grad_h_rel", "grad_w_rel", "rule")), flush=True)
    return out


def ratios(rows: dict) -> None:
    """klpenalty's time and peak over trl's and torch's, on the klpenalty rows."""
    for name in ("klpenalty", "klpenalty_planned"):
        k = rows.get(name)
        if k is None:
            continue
        for other in ("trl", "torch"):
            o = rows.get(other)
            if o is None:
                continue
            k[f"time_x_{other}"] = k["median_s"] / o["median_s"]
            if isinstance(k.get("peak_mib"), float) and isinstance(o.get("peak_mib"), float) \
                    and o["peak_mib"] > 0:
                k[f"mem_x_{other}"] = k["peak_mib"] / o["peak_mib"]


def rule(rows: dict) -> None:
    """Each row's errors against twice the torch formula's in the same dtype."""
    base = rows.get("torch")
    for p, row in rows.items():
        if p == "torch":
            row["rule"] = "ref"
        elif base is not None:
            over = [name for name, key in (("value", "value_err"), ("∂h", "grad_h_err"),
                                           ("∂W", "grad_w_err"))
                    if not row[key] <= 2 * base[key]]
            row["rule"] = "yes" if not over else "no: " + ", ".join(over)


def _fmt(x) -> str:
    if isinstance(x, float):
        if x == 0:
            return "0"
        return f"{x:.3g}" if 1e-3 <= abs(x) < 1e4 else f"{x:.1e}"
    return str(x)


def md_row(r: dict) -> str:
    def err(key):
        return f"{_fmt(r[key + '_err'])} ({_fmt(r[key + '_rel'])})"

    cells = [r["shape"], r["dtype"], r["kind"], r["provider"], r["setting"],
             _fmt(r["median_s"]), _fmt(r.get("time_x_trl", "")), _fmt(r.get("time_x_torch", "")),
             _fmt(r.get("peak_mib", "")), _fmt(r.get("mem_x_trl", "")),
             _fmt(r.get("mem_x_torch", "")), err("value"), err("grad_h"), err("grad_w"),
             r.get("rule", ""), _fmt(r.get("diff_vs_klpenalty", ""))]
    return "| " + " | ".join(cells) + " |"


def table(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |",
             "|" + "---|" * 5 + "---:|" * 6 + "---:|" * 3 + "---|---:|"]
    return "\n".join(lines + [md_row(r) for r in rows]) + "\n"


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), metavar="N:H:V",
                   help="rows, hidden size (student and teacher), vocabulary")
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
    p.add_argument("--providers", nargs="+", default=list(PROVIDERS), choices=list(PROVIDERS))
    p.add_argument("--beta", type=float, default=0.5, help="the JSD's teacher weight in M")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds after the warm-up")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory processes")
    p.add_argument("--quick", action="store_true",
                   help="N=64, H=64, V=2000, one round: a smoke test")
    p.add_argument("--out", default=None, help="output path without extension (default "
                   "benchmarks/results/bench_divergence_trl; with --quick "
                   "benchmarks/results/tmp/bench_divergence_trl_quick)")
    p.add_argument("--memory-server", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        given = {a.split("=")[0].lstrip("-").replace("-", "_")
                 for a in (sys.argv[1:] if argv is None else argv) if a.startswith("--")}
        for k, v in QUICK.items():
            if k not in given:
                setattr(args, k, v)
    args.shapes = [parse_shape(s) for s in args.shapes]
    args.providers = list(dict.fromkeys(args.providers))
    if not 0 < args.beta < 1:
        p.error("--beta must lie in (0, 1)")
    if args.out is None:
        args.out = (os.path.join(HERE, "results", "tmp", "bench_divergence_trl_quick")
                    if args.quick else os.path.join(HERE, "results", "bench_divergence_trl"))
    return args


def main(argv=None) -> int:
    args = parse(argv)
    if args.memory_server:
        return memory_server()
    import trl

    torch.set_num_threads(args.threads)
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    server = None if args.no_memory else MemoryServer()
    rows = []
    try:
        for shape in args.shapes:
            for dname in args.dtypes:
                for kind in args.kinds:
                    rows += run_case(args, shape, dname, kind, server)
    finally:
        if server is not None:
            server.close()
    load1 = os.getloadavg()[0]
    wall = time.perf_counter() - t0
    cpu = machine()
    meta = {"date": time.strftime("%Y-%m-%d"), "machine": cpu["name"], "simd": cpu["simd"],
            "cores": os.cpu_count(), "torch": torch.__version__, "trl": trl.__version__,
            "klpenalty_backend": klpenalty.ops.native.status().split(",")[0],
            "beta": args.beta, "loadavg_1m_before": round(load0, 2),
            "loadavg_1m_after": round(load1, 2), "wall_s": round(wall, 1)}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    full = [{**r, **meta} for r in rows]
    with open(args.out + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in full for k in r)))
        w.writeheader()
        w.writerows(full)
    with open(args.out + ".md", "w") as f:
        f.write(
            f"Distillation divergences from hidden states, forward + backward (∂ to the "
            f"student's hidden states and head weight), {meta['date']}, {cpu['name']} "
            f"({cpu['simd']}), {os.cpu_count()} cores, {args.threads} threads, torch "
            f"{torch.__version__}, TRL {trl.__version__}, klpenalty backend "
            f"{meta['klpenalty_backend']}. Median s of {args.rounds} interleaved round(s) after "
            f"1 warm-up; × trl / × torch: klpenalty's over the other's. Peak MiB: one fresh "
            f"process per row, VmHWM above the RSS with the inputs allocated "
            f"({'not measured' if args.no_memory else 'gradients included'}). Errors: max abs "
            f"against float64 (relative to the largest float64 entry). ≤2× torch: every "
            f"error at most twice the torch formula's. Δ vs klpenalty: max |value − "
            f"klpenalty's|. JSD β = {args.beta} (teacher's weight in M; TRL's beta = β). "
            f"1-minute loadavg {load0:.2f} before, {load1:.2f} after; {wall:.0f} s.\n\n")
        f.write(table(rows))
    print(table(rows))
    print(f"wrote {args.out}.csv and {args.out}.md ({wall:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
