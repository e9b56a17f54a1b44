"""Side-by-side benchmark of the exact KL: baselines, every klpenalty backend, and the floors.

Used by ``klpenalty bench`` and ``benchmarks/bench_kl.py``. For one (B, T, V) shape and dtype it
times, in one process with warm-up and interleaved rounds (median and min of the rounds):

- ``seed``: the formula klpenalty replaces, log_softmax twice (in float32), exp, subtract,
  multiply, sum: it materialises several (B, T, V) float32 tensors;
- ``kl_div``: ``F.kl_div`` on two float32 ``log_softmax`` es (``log_target=True``);
- every CPU backend of :func:`klpenalty.ops.dispatch.device_backends`;
- ``seed-compiled`` (only when named): the seed formula through ``torch.compile`` (inductor);
- the floors: ``floor`` = reading both inputs once (``x.sum(); y.sum()``); for forward+backward
  ``floor`` = that plus reading both again and writing one new tensor of the input's size
  (``torch.add(x, y)``), the least a backward that returns a fresh gradient can do; for the
  forward also ``exp floor`` (ATen's exp2 of both inputs) and, where the native kernel builds,
  ``compute floor xU``: the native forward's own inner loop over an L1-resident tile for as
  many element pairs as the inputs hold, U = 1, 2, 4, 8 float vectors per input in flight
  (:func:`klpenalty.ops.native.compute_floor`): its arithmetic without its memory traffic.

It reports time ratios to the seed formula and to the floor (forward: also to the fastest compute
floor and to the larger of the read floor and that compute floor), the peak extra memory as a multiple
of one input tensor (peak RSS growth during one call, measured in a fresh subprocess per
provider on Linux), and the max abs error of the per-position KL against the float64 reference
(computed in row chunks).
"""

from __future__ import annotations

import contextlib
import csv
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from .ops.dispatch import device_backends
from .ops.reference import full_kl_reference

__all__ = [
    "SHAPES",
    "alloc_profile",
    "Row",
    "seed_formula",
    "kl_div_formula",
    "make_inputs",
    "providers",
    "run_benchmark",
    "format_table",
    "write_csv",
    "read_csv",
]

# Default shapes: (B, T, V) of Llama-2 (32000), Llama-3 (128256), Qwen2 (151936).
SHAPES = {"S1": (4, 512, 32000), "S2": (2, 1024, 128256), "S3": (1, 256, 151936)}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def alloc_profile(fn: Callable[[], object]) -> tuple[int, int]:
    """(peak live bytes, largest single allocation) of the CPU allocations made inside ``fn``.

    Walks the profiler's allocation events in time order, each allocation and each free at
    its own timestamp (an op's aggregated "self" memory would apply the frees made inside a
    backward node at the node's start, hiding the buffers of a chunked backward). Measured,
    not estimated; reads torch's private profiler event tree (torch ≥ 2.4).
    """
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()

    def walk(nodes):
        for node in nodes:
            yield node
            yield from walk(node.children)

    tree = prof.profiler.kineto_results.experimental_event_tree()
    sizes = sorted(
        (n.start_time_ns, n.extra_fields.alloc_size)
        for n in walk(tree) if n.tag == _EventType.Allocation
    )
    live = peak = largest = 0
    for _, size in sizes:
        live += size
        peak = max(peak, live)
        largest = max(largest, size)
    return peak, largest


def seed_formula(policy_logits: torch.Tensor, ref_logits: torch.Tensor) -> torch.Tensor:
    """The naive exact KL: (..., V) logits of any float dtype -> (...) float32.

    log_softmax of both (upcast to float32), exp, subtract, multiply, sum: four to five
    (..., V) float32 temporaries.
    """
    logp = torch.log_softmax(policy_logits.float(), dim=-1)
    logq = torch.log_softmax(ref_logits.float(), dim=-1)
    return (logp.exp() * (logp - logq)).sum(-1)


def kl_div_formula(policy_logits: torch.Tensor, ref_logits: torch.Tensor) -> torch.Tensor:
    """``F.kl_div`` on two float32 log-softmaxes: (..., V) -> (...) float32, KL(π‖ρ)."""
    logp = torch.log_softmax(policy_logits.float(), dim=-1)
    logq = torch.log_softmax(ref_logits.float(), dim=-1)
    return F.kl_div(logq, logp, log_target=True, reduction="none").sum(-1)


def _backend_fn(name: str) -> Callable:
    from .functional import full_kl

    return lambda x, y: full_kl(x, y, backend=name)


def _streaming_all_threads(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The streaming backend with its CPU tile loop on all of torch's threads (not one)."""
    from .functional import full_kl
    from .ops.streaming import token_stats as streaming

    saved = streaming.CPU_TILE_THREADS
    streaming.CPU_TILE_THREADS = 0
    try:
        return full_kl(x, y, backend="streaming")
    finally:
        streaming.CPU_TILE_THREADS = saved


@contextlib.contextmanager
def cpu_load(processes: int, seconds: float = 3600.0):
    """Run ``processes`` busy-looping Python processes (a concurrent CPU load) while inside.

    Each stops by itself after ``seconds`` and is killed on exit. Yields the processes.
    """
    code = f"import time\nend = time.time() + {seconds}\nwhile time.time() < end: pass\n"
    procs = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(processes)]
    try:
        time.sleep(0.5 if processes else 0.0)  # let the load start
        yield procs
    finally:
        for p in procs:
            p.kill()
            p.wait()


def _seed_compiled() -> Callable:
    """The seed formula through ``torch.compile`` (inductor), compiled at its first call."""
    compiled = None

    def run(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        nonlocal compiled
        if compiled is None:
            compiled = torch.compile(seed_formula, dynamic=False)
        return compiled(x, y)

    return run


# Providers run only when named (a compile costs seconds to a minute).
OPTIONAL = ("seed-compiled",)


def providers(names: list[str] | None = None) -> dict[str, Callable]:
    """Name -> ``fn(policy_logits, ref_logits) -> (...) KL`` for the baselines and backends
    (default: all but :data:`OPTIONAL`)."""
    table: dict[str, Callable] = {"seed": seed_formula, "kl_div": kl_div_formula}
    for b in device_backends(torch.device("cpu")):
        table[b] = _backend_fn(b)
    table["streaming-mt"] = _streaming_all_threads
    if names is None:
        return table
    table["seed-compiled"] = _seed_compiled()
    unknown = [n for n in names if n not in table]
    if unknown:
        raise ValueError(f"unknown provider(s) {unknown}; valid: {list(table)}")
    return {n: table[n] for n in names}


def make_inputs(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0):
    """Policy logits x ~ 2·N(0, 1) and reference y = x + 0.3·N(0, 1) (mean KL ≈ 0.045 nats).

    Generated one leading slice at a time so that no float32 temporary of the full size exists.
    """
    g = torch.Generator().manual_seed(seed)
    x = torch.empty(shape, dtype=dtype)
    y = torch.empty(shape, dtype=dtype)
    xf = x.view(-1, shape[-1])
    yf = y.view(-1, shape[-1])
    step = max(1, (1 << 22) // shape[-1])
    for i in range(0, xf.shape[0], step):
        a = torch.randn(xf[i : i + step].shape, generator=g) * 2.0
        xf[i : i + step] = a
        yf[i : i + step] = a + 0.3 * torch.randn(a.shape, generator=g)
    return x, y


def floor_fn(mode: str, x: torch.Tensor, y: torch.Tensor) -> Callable:
    """The floor of ``mode``: reading both inputs once (``"fwd"``), and for forward+backward
    that plus reading both again and writing one new tensor of the input's size."""
    if mode == "fwd":
        return lambda: (x.sum(), y.sum())
    return lambda: (x.sum(), y.sum(), torch.add(x, y))


# Policy logits by how their mass is spread (peaked_logits): 2·N(0, 1) (make_inputs'; top-p 0.9
# keeps thousands of a row's tokens) and rows whose mass sits on few tokens, as a trained
# model's.
LOGIT_ROWS = {
    "2n": "2·N(0, 1)",
    "4n": "4·N(0, 1)",
    "gumbel": "2·Gumbel",
    "zipf": "−1.1·log(rank) + 0.1·N(0, 1), ranks shuffled",
}


def peaked_logits(rows: str, n: int, vocab: int, g: torch.Generator) -> torch.Tensor:
    """(n, vocab) float32 logits of the kind ``rows`` (:data:`LOGIT_ROWS`)."""
    if rows in ("2n", "4n"):
        return torch.randn(n, vocab, generator=g) * (2.0 if rows == "2n" else 4.0)
    if rows == "gumbel":
        u = torch.rand(n, vocab, generator=g).clamp_min(1e-30)
        return -2.0 * torch.log(-torch.log(u))
    if rows == "zipf":
        ranks = torch.argsort(torch.rand(n, vocab, generator=g), dim=-1).float() + 1.0
        return -1.1 * torch.log(ranks) + 0.1 * torch.randn(n, vocab, generator=g)
    raise ValueError(f"rows must be one of {sorted(LOGIT_ROWS)}, got {rows!r}")


def _exp_floor_fn(x: torch.Tensor, y: torch.Tensor, tile: int = 1 << 18) -> Callable:
    """ATen's exp2 of every element of both inputs, a cache-sized tile at a time, into a reused
    float32 buffer: the arithmetic any eager-PyTorch exact KL pays (two exps per pair)."""
    xf, yf = x.reshape(-1), y.reshape(-1)
    buf = torch.empty(min(tile, xf.numel()), dtype=torch.float32)

    def run():
        for t in (xf, yf):
            for i in range(0, t.numel(), tile):
                part = t[i : i + tile]
                b = buf[: part.numel()]
                if part.dtype != b.dtype:
                    part = b.copy_(part)
                torch.exp2(part, out=b)

    return run


COMPUTE_CHAINS = (1, 2, 4, 8)


def _compute_floor_fns(x: torch.Tensor, y: torch.Tensor) -> dict[str, Callable]:
    """``compute floor xU`` for U in :data:`COMPUTE_CHAINS`: the native forward's inner loop
    over a tile of the inputs (in their dtype) for ``x.numel()`` element pairs; none where the
    native kernel is unavailable or the dtype is float64."""
    from .ops import native

    if x.dtype == torch.float64 or not native.available():
        return {}
    n = min(native.COMPUTE_FLOOR_TILE, x.numel())
    xt, yt = x.reshape(-1)[:n].clone(), y.reshape(-1)[:n].clone()
    pairs = x.numel()
    return {
        f"compute floor x{u}": (lambda u=u: native.compute_floor(xt, yt, pairs, u))
        for u in COMPUTE_CHAINS
    }


def is_floor(name: str) -> bool:
    """Whether a row's provider is one of the floors (no error, memory or seed ratio)."""
    return name in ("floor", "exp floor") or name.startswith("compute floor")


def _call(fn: Callable, mode: str, x: torch.Tensor, y: torch.Tensor) -> Callable:
    if mode == "fwd":

        def run():
            with torch.no_grad():
                return fn(x, y)

        return run
    xg = x.detach().requires_grad_()

    def run_bwd():
        fn(xg, y).sum().backward()
        xg.grad = None

    return run_bwd


def _max_error(kl: torch.Tensor, x: torch.Tensor, y: torch.Tensor, rows: int = 64) -> float:
    """max |kl − KL_float64| over positions, the reference computed ``rows`` rows at a time."""
    v = x.shape[-1]
    xf, yf, kf = x.reshape(-1, v), y.reshape(-1, v), kl.reshape(-1)
    err = 0.0
    for i in range(0, xf.shape[0], rows):
        ref = full_kl_reference(xf[i : i + rows], yf[i : i + rows])
        err = max(err, (kf[i : i + rows].double() - ref).abs().max().item())
    return err


@dataclass
class Row:
    """One line of the result table (times in ms; ratios are provider/floor and seed/provider;
    forward: vs_compute = provider / fastest compute floor, vs_max = provider / the larger of the
    read floor and that compute floor)."""

    shape: str
    dtype: str
    mode: str
    provider: str
    median_ms: float
    min_ms: float
    first_call_s: float
    vs_seed: float | None = None
    vs_floor: float | None = None
    mem_x_input: float | None = None
    max_err: float | None = None
    threads: int = field(default_factory=torch.get_num_threads)
    load: int = 0  # busy processes running concurrently (cpu_load)
    loadavg: float = field(default_factory=lambda: os.getloadavg()[0])  # 1-min, at the end
    vs_compute: float | None = None
    vs_max: float | None = None
    clock: str = "wall"  # CLOCKS: wall time or the thread's CPU time


# --------------------------------------------------------------------------- memory probe
_PROBE = r"""
import gc, json, sys, torch
from klpenalty import bench
shape, dtype, mode, name, threads = json.loads(sys.argv[1])
torch.set_num_threads(threads)
x, y = bench.make_inputs(tuple(shape), bench.DTYPES[dtype])
run = bench._call(bench.providers([name])[name], mode, x, y)
run()  # warm-up (thread pools, compilation)
gc.collect()
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
peaks = []
for _ in range(2):  # two measured calls; the larger growth is reported
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak-RSS high-water mark to the current RSS
    base = status("VmRSS:")
    run()
    peaks.append(status("VmHWM:") - base)
    gc.collect()
print(json.dumps(max(peaks) / x.nbytes))
"""


def _peak_memory(shape, dtype: str, mode: str, name: str, threads: int) -> float | None:
    """Peak RSS growth during one call, in units of one input, from a fresh subprocess."""
    if not os.path.exists("/proc/self/clear_refs"):
        return None
    args = json.dumps([list(shape), dtype, mode, name, threads])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, args], capture_output=True, text=True, env=env, timeout=3600
    )
    if proc.returncode != 0:
        print(f"  memory probe for {name} failed: {proc.stderr.strip()[-300:]}", file=sys.stderr)
        return None
    return float(proc.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------- the benchmark
def run_benchmark(
    shape: tuple[int, int, int],
    dtype: str = "fp32",
    modes: tuple[str, ...] = ("fwd", "fwdbwd"),
    names: list[str] | None = None,
    repeats: int = 5,
    warmup: int = 1,
    memory: bool = True,
    error: bool = True,
    threads: int | None = None,
    shape_name: str | None = None,
    log: Callable[[str], None] | None = print,
    load: int = 0,
    clock: str = "wall",
) -> list[Row]:
    """Benchmark every provider at one shape and dtype; returns one :class:`Row` per result.

    Args:
        shape: (B, T, V).
        dtype: "fp32", "bf16" or "fp16" (the inputs' dtype).
        modes: subset of ("fwd", "fwdbwd"); fwdbwd differentiates with respect to the policy.
        names: providers to run (default: all of :func:`providers`).
        repeats: timed interleaved rounds (medians reported) after ``warmup`` untimed calls.
        memory: measure peak extra memory in a fresh subprocess per provider and mode.
        error: max abs error of the forward KL against the float64 reference.
        threads: torch threads (default: leave as is).
        load: busy processes to run concurrently while timing (:func:`cpu_load`).
        clock: "wall" (``time.perf_counter``) or "thread": the calling thread's CPU time
            (``time.thread_time``), for one thread on a machine shared with other jobs (time
            spent descheduled is not counted; waits on memory are).
    """
    if clock not in CLOCKS:
        raise ValueError(f"clock must be one of {list(CLOCKS)}, got {clock!r}")
    if threads:
        torch.set_num_threads(threads)
    threads = torch.get_num_threads()
    if clock == "thread" and threads != 1:
        raise ValueError(f"clock='thread' times one thread: threads must be 1, got {threads}")
    say = log or (lambda s: None)
    label = shape_name or "x".join(map(str, shape))
    table = providers(names)
    x, y = make_inputs(tuple(shape), DTYPES[dtype])
    rows: list[Row] = []
    with cpu_load(load):
        for mode in modes:
            rows += _time_mode(
                table, mode, x, y, repeats, warmup, label, dtype, threads, say, CLOCKS[clock]
            )
    for row in rows:
        row.load = load
        row.clock = clock
    if error:
        for row in rows:
            if row.mode == "fwd" and not is_floor(row.provider):
                with torch.no_grad():
                    row.max_err = _max_error(table[row.provider](x, y), x, y)
    del x, y
    gc.collect()
    if memory:
        for row in rows:
            if not is_floor(row.provider):
                say(f"  {label} {dtype} {row.mode}: memory of {row.provider}")
                row.mem_x_input = _peak_memory(shape, dtype, row.mode, row.provider, threads)
    return rows


CLOCKS = {"wall": time.perf_counter, "thread": time.thread_time}


def _time_mode(table, mode, x, y, repeats, warmup, label, dtype, threads, say, now) -> list[Row]:
    fns = {n: _call(f, mode, x, y) for n, f in table.items()}
    floors = {"floor": floor_fn(mode, x, y)}
    if mode == "fwd":
        floors["exp floor"] = _exp_floor_fn(x, y)
        floors.update(_compute_floor_fns(x, y))
    fns = {**floors, **fns}
    first: dict[str, float] = {}
    for n, fn in fns.items():
        t0 = now()
        fn()
        first[n] = now() - t0
        for _ in range(max(0, warmup - 1)):
            fn()
        gc.collect()
    times: dict[str, list[float]] = {n: [] for n in fns}
    for r in range(repeats):
        for n, fn in fns.items():
            t0 = now()
            fn()
            times[n].append(now() - t0)
        gc.collect()
        say(f"  {label} {dtype} {mode}: round {r + 1}/{repeats}")
    med = {n: statistics.median(t) * 1e3 for n, t in times.items()}
    compute = [med[n] for n in floors if n.startswith("compute floor")]
    best = min(compute) if compute else None
    return [
        Row(
            label,
            dtype,
            mode,
            n,
            med[n],
            min(times[n]) * 1e3,
            first[n],
            vs_seed=(med["seed"] / med[n]) if "seed" in med and n not in floors else None,
            vs_floor=med[n] / med["floor"],
            threads=threads,
            vs_compute=med[n] / best if best and n not in floors else None,
            vs_max=med[n] / max(best, med["floor"]) if best and n not in floors else None,
        )
        for n in fns
    ]


def _fmt(v, spec):
    return "-" if v is None else format(v, spec)


def format_table(rows: list[Row]) -> str:
    """A markdown table of the rows."""
    head = (
        "| shape | dtype | mode | threads | load | clock | provider | median ms | min ms "
        "| first call s "
        "| × faster than seed | × floor | × compute floor | × max(floors) "
        "| peak extra mem (× input) | max err vs fp64 | loadavg |\n"
        "|---|---|---|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    )
    lines = []
    for r in rows:
        name = f"*{r.provider}*" if is_floor(r.provider) else r.provider
        lines.append(
            f"| {r.shape} | {r.dtype} | {r.mode} | {r.threads} | {r.load} | {r.clock} | {name} "
            f"| {r.median_ms:.1f} | {r.min_ms:.1f} "
            f"| {r.first_call_s:.2f} | {_fmt(r.vs_seed, '.1f')} | {_fmt(r.vs_floor, '.2f')} "
            f"| {_fmt(r.vs_compute, '.2f')} | {_fmt(r.vs_max, '.2f')} "
            f"| {_fmt(r.mem_x_input, '.3f')} | {_fmt(r.max_err, '.1e')} | {r.loadavg:.2f} |"
        )
    return head + "\n".join(lines) + "\n"


def read_csv(path: str) -> list[Row]:
    """Rows written by :func:`write_csv` (to re-render a table)."""

    def num(v: str):
        return None if v in ("", "None") else float(v)

    out = []
    with open(path, newline="") as f:
        for d in csv.DictReader(f):
            out.append(
                Row(
                    d["shape"], d["dtype"], d["mode"], d["provider"],
                    float(d["median_ms"]), float(d["min_ms"]), float(d["first_call_s"]),
                    num(d["vs_seed"]), num(d["vs_floor"]), num(d["mem_x_input"]),
                    num(d["max_err"]), int(d["threads"]),
                    int(d.get("load") or 0), float(d.get("loadavg") or "nan"),
                    num(d.get("vs_compute", "")), num(d.get("vs_max", "")),
                    d.get("clock") or "wall",
                )
            )
    return out


def write_csv(rows: list[Row], path: str) -> None:
    """Write (or append to) a CSV file with one line per row; a file written with fewer columns
    (an older version) is rewritten with the current ones first."""
    fields = list(asdict(rows[0]))
    new = not os.path.exists(path)
    if not new:
        with open(path, newline="") as f:
            header = next(csv.reader(f), [])
        if header != fields:
            rows = read_csv(path) + list(rows)
            new = True
            os.remove(path)
    with open(path, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        if new:
            w.writeheader()
        for r in rows:
            w.writerow(asdict(r))
