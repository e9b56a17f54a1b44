"""The Triton kernels as an H100/H200 would run them, read on a machine without a GPU: the
launches the library makes (the statistics, the sampler's threshold, the divergences' second
walk) compiled for sm_90 and their SASS (machine code) counted.

The host code runs for real on small CPU tensors of a real vocabulary (V = 128256, one program
per row, as for a large batch on a GPU) with each kernel launch recorded instead of run; every
recorded launch is then compiled by the kernel's own JIT (``JITFunction.warmup``: the same
binder, so pointer alignment, ``tt.divisibility = 16`` for ints ≡ 0 mod 16 and ints equal to 1
as constexprs come out as on a GPU) for ``GPUTarget("cuda", 90, 32)``, behind a stand-in driver
that names that target. The SASS comes from the ``cuobjdump`` that ships with Triton
(``triton/backends/nvidia/bin``), the register and local-memory use from ``cuobjdump -res-usage``.

For each kernel it reports the column loop (the range of a backward branch, a loop's back-edge,
whose body holds the global loads), the instructions in it, per element pair (x and y entry of a
column) per thread, the vector loads/stores, barriers, shuffles and transcendental (MUFU) ops in
it, the registers and any local memory (spills). Predictions from compiled code, not timings.

    python benchmarks/triton_sass.py            # the table (markdown)
    python benchmarks/triton_sass.py --json     # the same as JSON (tests/ops/test_triton_compiled.py)

Run it without ``TRITON_INTERPRET`` set (the kernels must be compiled, not interpreted).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

VOCAB = 128256
ROWS = 4  # ≥ PROGRAMS_PER_SM × the 1 "SM" of a CPU: one program per row, as at N = 32768 on a GPU
TARGET = ("cuda", 90, 32)
# name, dtype, want bits (KL 1, LOGP 2, REF_LOGP 4, ENTROPY 8), support, the sampler's
# (top_k, top_p, min_p), backward too, the vocabulary and the row stride (a vocabulary slice of wider rows: V = 50257 (GPT-2) in rows
# padded to 50304, a multiple of 16)
CASES = [
    dict(name="kl", dtype="bf16", want=1),
    dict(name="all four", dtype="bf16", want=15),
    dict(name="kl", dtype="fp32", want=1),
    dict(name="all four", dtype="fp32", want=15),
    dict(name="all four, keep+tau", dtype="bf16", want=15, support="keep+tau", backward=False),
    dict(name="kl, V=50257 in rows of 50304", dtype="bf16", want=1, vocab=50257, stride=50304),
    # the sampler's threshold (threshold_kernel) launched before the forward
    dict(name="kl, top-k+top-p+min-p", dtype="bf16", want=1, sampler=(50, 0.9, 0.05),
         backward=False),
    dict(name="kl, top-k+top-p+min-p", dtype="fp32", want=1, sampler=(50, 0.9, 0.05),
         backward=False),
    # top-p alone: Z's mass below the window of keys summed in the window's scan (ZSUM); on
    # fp32 logits from top-p's band of value bins (counted twice, listed, the list decided)
    dict(name="kl, top-p", dtype="bf16", want=1, sampler=(0, 0.9, 0.0), backward=False),
    dict(name="kl, top-p", dtype="fp32", want=1, sampler=(0, 0.9, 0.0), backward=False),
    # the second walk (divergence_kernel, divergence_grad_kernel) instead of the statistics: the
    # JSD (the most terms), the skew forward KL (the mixture's π·g) and the TVD (no logarithm)
    dict(name="jsd", dtype="bf16", want=1, divergence=2),
    dict(name="jsd", dtype="fp32", want=1, divergence=2),
    dict(name="skew forward kl", dtype="bf16", want=1, divergence=3),
    dict(name="tvd", dtype="bf16", want=1, divergence=5),
]
_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+([^;]*?)\s*;")
_BRANCH = re.compile(r"\bBRA(?:\.[A-Z.]+)?\s+(?:`?\(?)(0x[0-9a-f]+)")


def tools() -> dict[str, str | None]:
    """The paths of Triton's bundled ptxas and cuobjdump (None where absent)."""
    import triton

    nvbin = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    found = {}
    for name in ("ptxas", "cuobjdump"):
        path = os.path.join(nvbin, name)
        found[name] = path if os.access(path, os.X_OK) else shutil.which(name)
    return found


def parse_sass(sass: str) -> list[tuple[int, str]]:
    """(address, instruction text without predicate spacing) of each SASS instruction."""
    return [(int(addr, 16), " ".join(text.split())) for addr, text in _INSTR.findall(sass)]


def loops(instrs: list[tuple[int, str]]) -> list[tuple[int, int]]:
    """(first, last) instruction indices of each loop: a branch to an earlier address (its
    back-edge) delimits [target, branch]; a branch to itself (the trap after EXIT) is none."""
    index = {addr: i for i, (addr, _) in enumerate(instrs)}
    found = []
    for i, (addr, text) in enumerate(instrs):
        m = _BRANCH.search(text)
        if m and int(m.group(1), 16) < addr and int(m.group(1), 16) in index:
            found.append((index[int(m.group(1), 16)], i))
    return found


def _op(text: str) -> str:
    """The opcode with its modifiers, without a predicate (``@!P0 LDG.E.128`` → ``LDG.E.128``)."""
    parts = text.split()
    return parts[1] if parts[0].startswith("@") and len(parts) > 1 else parts[0]


_LOAD_BYTES = {".128": 16, ".64": 8, ".U16": 2, ".S16": 2, ".U8": 1, ".S8": 1}


def _load_bytes(op: str) -> int:
    """Bytes one thread reads with a global load (``LDG.E.64``: 8; no width suffix: 4)."""
    return next((n for suffix, n in _LOAD_BYTES.items() if op.endswith(suffix)), 4)


def inner_loops(instrs: list[tuple[int, str]], elem_bytes: int) -> list[dict]:
    """The innermost loops that load (no other loop inside them), in order: their
    instructions, the elements one thread reads an iteration (from the loads' widths), the
    instructions per element, barriers, shuffles, MUFU and float64 (D*) instructions."""
    ops = [_op(t) for _, t in instrs]
    found = loops(instrs)
    out = []
    for first, last in found:
        if any(first <= a and b <= last and (a, b) != (first, last) for a, b in found):
            continue
        body = ops[first:last + 1]
        loaded = sum(_load_bytes(o) for o in body if o.startswith("LDG"))
        if not loaded:
            continue
        elems = max(1, loaded // elem_bytes)
        out.append({
            "instructions": len(body), "elems_per_thread": elems,
            "per_elem": len(body) / elems,
            "bar": sum(o.startswith(("BAR", "WARPSYNC", "MEMBAR")) for o in body),
            "shfl": sum(o.startswith("SHFL") for o in body),
            "mufu": sum(o.startswith("MUFU") for o in body),
            "fp64": sum(o.startswith(("DADD", "DMUL", "DFMA", "DSETP")) for o in body),
        })
    return out


def analyse(sass: str, elems_per_thread: int) -> dict:
    """Counts of the whole kernel and of its column loop (the loop holding the most global
    loads; None if there is none). ``elems_per_thread``: columns one thread takes per
    iteration (BLOCK / threads)."""
    instrs = parse_sass(sass)
    ops = [_op(t) for _, t in instrs]
    out = {
        "instructions": len(ops),
        "per_pair_no_loop": len(ops) / elems_per_thread,
        "local": sum(o.startswith(("LDL", "STL")) for o in ops),
        "loops": len(loops(instrs)),
        "loop_sizes": [last - first + 1 for first, last in loops(instrs)],
        "loop": None,
    }
    body = None
    for first, last in loops(instrs):
        ldg = sum(o.startswith("LDG") for o in ops[first:last + 1])
        if ldg and (body is None or ldg > body[2]):
            body = (first, last, ldg)
    if body is None:
        return out
    lops = ops[body[0]:body[1] + 1]
    bars = [i for i, o in enumerate(lops) if o.startswith(("BAR", "WARPSYNC", "MEMBAR"))]
    out["loop"] = {
        "instructions": len(lops),
        "per_pair": len(lops) / elems_per_thread,
        "elems_per_thread": elems_per_thread,
        "ldg": sum(o.startswith("LDG") for o in lops),
        "ldg128": sum(o.startswith("LDG") and o.endswith(".128") for o in lops),
        "stg": sum(o.startswith("STG") for o in lops),
        "stg128": sum(o.startswith("STG") and o.endswith(".128") for o in lops),
        "bar": len(bars),
        "ldg_after_bar": sum(o.startswith("LDG") for o in lops[bars[0]:]) if bars else 0,
        "shfl": sum(o.startswith("SHFL") for o in lops),
        "mufu": sum(o.startswith("MUFU") for o in lops),
        "atoms": sum(o.startswith("ATOMS") for o in lops),
        "nop": sum(o == "NOP" for o in lops),
    }
    return out


def _cuobjdump(cuobjdump: str, flag: str, cubin: bytes) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        return subprocess.run([cuobjdump, flag, f.name], capture_output=True, text=True,
                              check=True).stdout
    finally:
        os.unlink(f.name)


def res_usage(cuobjdump: str, cubin: bytes) -> dict[str, int]:
    """REG, STACK, SHARED, LOCAL of the kernel from ``cuobjdump -res-usage``."""
    text = _cuobjdump(cuobjdump, "-res-usage", cubin)
    return {k: int(v) for k, v in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", text)}


def sass_of(cuobjdump: str, cubin: bytes) -> str:
    """``cuobjdump -sass`` of a cubin, kept beside Triton's cache (keyed by the cubin's hash):
    the disassembly costs more than a compile that Triton's cache answers."""
    from triton import knobs

    path = os.path.join(knobs.cache.dir, "klpenalty-sass", hashlib.sha256(cubin).hexdigest())
    if os.path.exists(path):
        with open(path) as f:
            return f.read()
    sass = _cuobjdump(cuobjdump, "-sass", cubin)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        f.write(sass)
    os.replace(path + ".tmp", path)
    return sass


class _Recorder:
    """Stands in for the kernels: ``kernel[grid](*args, **kwargs)`` records the launch."""

    def __init__(self, module, log):
        self._module, self._log = module, log

    def __getattr__(self, name):
        real = getattr(self._module, name)
        if not hasattr(real, "warmup"):
            return real
        log = self._log

        class _Launch:
            def __getitem__(self, grid):
                return lambda *args, **kwargs: log.append((name, real, grid, args, kwargs))

        return _Launch()


def record(case: dict) -> list[tuple]:
    """The kernel launches the host code makes for one case (forward, then backward)."""
    import torch
    from klpenalty.ops import triton as triton_backend

    dt = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}[case["dtype"]]
    vocab = case.get("vocab", VOCAB)
    stride = case.get("stride", vocab)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(ROWS, stride, generator=gen).to(dt)[:, :vocab]
    y = torch.randn(ROWS, stride, generator=gen).to(dt)[:, :vocab]
    tokens = torch.randint(0, vocab, (ROWS,), generator=gen)
    keep = tau = None
    if case.get("support"):
        keep = torch.ones(ROWS, vocab, dtype=torch.bool)
        tau = torch.full((ROWS,), -1.0)
    log: list[tuple] = []
    saved = triton_backend._load._kernels()
    triton_backend._load._jit = _Recorder(saved, log)
    try:
        ops = torch.ops.klpenalty
        if "divergence" in case:  # the second walk alone, on stats of the right shape
            from klpenalty.ops import contract

            stats = torch.zeros(ROWS, contract.STATS_COLS)
            kind = case["divergence"]
            _, gbar = ops.triton_divergence(x, y, stats, None, None, None, 1.0, kind, 0.5)
            ops.triton_divergence_backward(torch.ones(ROWS), x, y, stats, gbar, None, None, None,
                                           1.0, kind, 0.5)
            return log
        want = case["want"]
        top_k, top_p, min_p = case.get("sampler", (0, 1.0, 0.0))
        _, stats = ops.triton_token_stats(x, y, tokens, None, keep, tau, 1.0, -100, want, False,
                                          0, 0, top_k, top_p, min_p)
        if case.get("backward", True):
            grad = torch.ones(ROWS, 4)
            ops.triton_token_stats_backward(grad, x, y, tokens, None, stats, None, keep, tau,
                                            1.0, -100, want, True, True, 0, 0)
    finally:
        triton_backend._load._jit = saved
    return log


class _Driver:
    """The few calls ``JITFunction.warmup`` makes of the active driver, answered for sm_90."""

    def __init__(self):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget(*TARGET)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        import torch

        return torch.device("cpu")


def compile_cases(cases=CASES) -> list[dict]:
    """Compile each recorded launch of each case; one dict per launch with its counts."""
    import triton
    from triton.runtime.driver import driver

    paths = tools()
    if not paths["ptxas"] or not paths["cuobjdump"]:
        raise RuntimeError(f"Triton's ptxas / cuobjdump not found: {paths}")
    previous = driver._active  # None until a driver was asked for (none exists without a GPU)
    driver.set_active(_Driver())
    results = []
    try:
        for case in cases:
            for name, kernel, grid, args, kwargs in record(case):
                compiled = kernel.warmup(*args, grid=grid, **kwargs)
                cubin = compiled.asm["cubin"]
                sass = sass_of(paths["cuobjdump"], cubin)
                warps = compiled.metadata.num_warps
                block = kwargs.get("BLOCK")
                threads = 32 * warps
                signature = {k: v for k, v in compiled.src.signature.items() if v != "constexpr"}
                results.append({
                    "case": case["name"], "sampler": case.get("sampler"), "dtype": case["dtype"], "want": case["want"],
                    "support": case.get("support"), "vocab": case.get("vocab", VOCAB),
                    "stride": case.get("stride", case.get("vocab", VOCAB)), "kernel": name, "grid": list(grid), "block": block, "warps": warps,
                    "signature": signature,
                    "attrs": {str(k): str(v) for k, v in compiled.src.attrs.items()},
                    "constexprs": {k: v for k, v in kwargs.items()
                                   if isinstance(v, (bool, int)) and k != "num_warps"},
                    "resources": res_usage(paths["cuobjdump"], cubin),
                    **analyse(sass, max(1, (block or threads) // threads)),
                    "inner_loops": inner_loops(parse_sass(sass), {"bf16": 2, "fp16": 2,
                                                                  "fp32": 4}[case["dtype"]]),
                })
    finally:
        driver._active = previous
    results.append({"triton": triton.__version__})
    return results


def _row(cells) -> str:
    """A markdown table row of ``cells``."""
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _header(names: list[str], align: str) -> list[str]:
    """A markdown table's header and rule: ``align`` one letter per column, l or r."""
    return [_row(names), "|" + "".join("---|" if a == "l" else "---:|" for a in align)]


def table(results: list[dict]) -> str:
    rows = _header(["kernel", "case", "dtype", "regs", "instr outside the loop", "loop instr",
                    "per pair", "LDG (.128)", "STG (.128)", "BAR", "SHFL", "MUFU", "local"],
                   "lllrrrrllrrrr")
    for r in results:
        if "kernel" not in r:
            continue
        lp = r["loop"]
        if lp is None:  # one tile per program: the whole kernel, per element pair of the tile
            rows.append(_row([r["kernel"], r["case"], r["dtype"], r["resources"].get("REG"),
                              "(no loop)", r["instructions"], f"{r['per_pair_no_loop']:.1f}",
                              "", "", "", "", "", r["local"]]))
            continue
        rows.append(_row([
            r["kernel"], r["case"], r["dtype"], r["resources"].get("REG"),
            r["instructions"] - lp["instructions"], lp.get("instructions"),
            f"{lp.get('per_pair', 0):.1f}", f"{lp.get('ldg')} ({lp.get('ldg128')})",
            f"{lp.get('stg')} ({lp.get('stg128')})", lp.get("bar"), lp.get("shfl"),
            lp.get("mufu"), r["local"],
        ]))
    threshold = [r for r in results if r.get("kernel") == "threshold_kernel"]
    if threshold:  # its searches: the innermost loops, in the kernel's order
        names = ["top-k tie group", "Z read", "top-p float32", "float64 check",
                 "top-p float64", "top-p tie group"]
        rows += ["", "threshold_kernel's column loops: instructions per element", "",
                 *_header(["case", "dtype", *names], "ll" + "r" * len(names))]
        for r in threshold:  # (each cell named by its loop where the flags leave some out)
            got = _row_loops(r["constexprs"], True)
            plain = got == ["group", "z", "mass32", "check", "mass64", "group"]
            cells = [f"{lp['per_elem']:.1f}" if plain else f"{name} {lp['per_elem']:.1f}"
                     for name, lp in zip(got, r["inner_loops"])]
            rows.append(_row([r["case"], r["dtype"], *cells]))
    scans = [r for r in results if r.get("kernel") == "threshold_scan_kernel"]
    if scans:  # the split scan's passes: one read of the row each
        rows += ["", "threshold_scan_kernel's passes: instructions per element, registers", "",
                 *_header(["case", "dtype", "pass", "per element", "BAR", "ATOMS", "regs"],
                          "llrrrrr")]
        for r in scans:
            (lp,) = r["inner_loops"]
            c = r["constexprs"]
            what = " (window, Z)" if c.get("ZSUM") else " (window)" if c.get("WINDOW") else ""
            rows.append(_row([r["case"], r["dtype"], f"{c['PASS']}{what}",
                              f"{lp['per_elem']:.1f}", r["loop"]["bar"], r["loop"]["atoms"],
                              r["resources"].get("REG")]))
    return "\n".join(rows)


# --threshold-cost: the sampler's threshold predicted from its machine code and the bytes it
# moves, against the untruncated KL forward, on the model GPU of benchmarks/README.md (an H200:
# 132 SMs at 1.98 GHz, 128 thread-instructions per SM-clock, 4.3 TB/s measured copy rate).
GPU = dict(sms=132, clock=1.98e9, issue=128, bandwidth=4.3e12)
COST_SHAPES = [(2048, 32000), (64, 151936)]
COST_SAMPLERS = [(50, 1.0, 0.0), (0, 0.9, 0.0), (0, 1.0, 0.05), (50, 0.9, 0.05)]
COST_DTYPES = ("bf16", "fp16", "fp32")
_COUNTING = r"""
import json, sys, torch
import klpenalty
from klpenalty.ops.triton import _kernels_threshold as k
counts = {"count": 0, "mass32": 0, "mass64": 0, "check": 0, "z": 0, "refine": 0,
          "bisect": 0}
names = {0: "count", 1: "mass32", 2: "mass64"}
bucket_sums, mass_at = k._bucket_sums, k._mass_at
def counted_sums(*args):
    counts[names[args[7]]] += 1
    return bucket_sums(*args)
def counted_at(*args):
    counts["check"] += 1
    return mass_at(*args)
k._bucket_sums, k._mass_at = counted_sums, counted_at
z_read = getattr(k, "_z_read", None)  # (the kernel before it read Z unconditionally)
def counted_z(*args):
    counts["z"] += 1
    return z_read(*args)
if z_read is not None:
    k._z_read = counted_z
refining = getattr(k, "_second_count", None)  # top-p's second band count, a call a block
def counted_refine(*args):
    counts["refine"] += 1
    return refining(*args)
if refining is not None:
    k._second_count = counted_refine
mass_above = getattr(k, "_mass_above", None)  # a step of the candidate list's bisection
def counted_bisect(*args):
    counts["bisect"] += 1
    return mass_above(*args)
if mass_above is not None:
    k._mass_above = counted_bisect
out = {}
for vocab, dtype, top_k, top_p, min_p in json.loads(sys.argv[1]):
    for c in counts:
        counts[c] = 0
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    gen = torch.Generator().manual_seed(vocab)
    x = (torch.randn(2, vocab, generator=gen) * 2).to(dt)
    torch.ops.klpenalty.triton_sampling_threshold(x, top_k, top_p, min_p, 1.0)
    out[repr((vocab, dtype, top_k, top_p, min_p))] = {c: n / 2 for c, n in counts.items()}
    if refining is not None:  # the second count's blocks over the row's blocks
        from klpenalty.ops.triton import _host, threshold
        from klpenalty.ops.triton.token_stats import split_columns
        _, cols = split_columns(2, vocab, x.device)
        block = _host.block(vocab, threshold.THRESHOLD_SCAN_BLOCK)
        blocks = sum(-(-min(cols, vocab - c) // block) for c in range(0, vocab, cols))
        out[repr((vocab, dtype, top_k, top_p, min_p))]["refine"] /= blocks
    if z_read is None:
        out[repr((vocab, dtype, top_k, top_p, min_p))]["z"] = 1
print(json.dumps(out))
"""


def search_reads(keys: list[tuple]) -> dict:
    """The reads of the row program per row — top-k's count reads (the kernel before the
    split scan), the Z read (made where the window of keys does not hold Z and τ_m), top-p's
    float32 and float64 mass reads and its float64 check —
    counted in Triton's interpreter on 2 rows of N(0, 2²) logits at T = 1 (where a tie group
    made by the division takes no read), for each (vocab, dtype, top_k, top_p, min_p)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", _COUNTING, json.dumps(keys)],
                          capture_output=True, text=True, env=env, check=True)
    return {eval(k): v for k, v in json.loads(done.stdout.strip().splitlines()[-1]).items()}


def read_time(elems: int, per_elem: float, elem_bytes: float, programs: int) -> float:
    """Seconds of one pass over ``elems`` elements of ``elem_bytes`` each by ``programs``
    programs: the larger of its issue time (``per_elem`` instructions an element on the SMs
    its programs occupy, at most one SM a program) and its memory time (the copy rate, in
    proportion to the SMs occupied)."""
    sms = min(GPU["sms"], programs)
    issue = elems * per_elem / (sms * GPU["issue"] * GPU["clock"])
    memory = elems * elem_bytes / (GPU["bandwidth"] * sms / GPU["sms"])
    return max(issue, memory)


def straight_time(programs: int, instructions: int, threads: int) -> float:
    """Seconds of ``programs`` programs of ``threads`` threads each issuing ``instructions``
    instructions once (code outside the column loops, e.g. a sort of a candidate list), on the
    SMs they occupy."""
    sms = min(GPU["sms"], programs)
    return programs * instructions * threads / (sms * GPU["issue"] * GPU["clock"])


def _row_loops(flags: dict, split_scan: bool) -> list[str]:
    """The names of threshold_kernel's column loops, in its order, for its flags: this tree's
    (``split_scan``: pass 0 and top-k's histograms run before it, its top-k is the last digit
    and the tie group) or the one-program-per-row kernel before it (pass 0 and top-k's radix
    select in the row's program), for the comparison."""
    window = flags.get("WINDOW", False)  # the loops over the window of keys: no row read
    names = [] if split_scan else ["pass0"]
    if flags["TOP_K"]:
        names += ["group"] if split_scan else ["count", "group"]
    if flags["TOP_P"] or flags["MIN_P"]:
        names += ["window"] if window else []
        # the Z read (with ZSUM, Z from the window's scan: the read for min-p's τ_m alone;
        # none compiled where top-p's band read gives Z and τ_m, CAND 2)
        if flags.get("CAND", 0) != 2:
            names += ["z"] if flags["MIN_P"] or not flags.get("ZSUM", False) else []
    if flags["TOP_P"]:
        # (the window's answer reads one chunk of its keys again: no loop)
        names += ["mass32", "check", "mass64", "group"]
    return names


def threshold_cost() -> list[dict]:
    """The predicted time of the threshold (all its launches) against the KL forward's, per
    shape of COST_SHAPES, dtype and sampler of COST_SAMPLERS. Each launch the host makes
    (recorded, compiled for sm_90) costs per loop :func:`read_time` of its instructions per
    element times its reads: pass 0, the Z read and a scan's pass one each, the searches'
    counted by :func:`search_reads`, a tie group's none (T = 1); the splits are the host's plan
    for the model's SMs (``plan_splits``), whose scratch histograms (a digit's bins in int32, a
    program and pass, written by the scan, read by the select) add their bytes, as do the
    window's counts on 16-bit logits (written by the scan; the row program's loop over the
    window's keys reads them, each key's float64 mass computed, and top-p's answer one chunk
    of them again). Launch latencies (a few µs each) are not counted: the launches are
    listed."""
    from klpenalty.ops.triton import _load
    from klpenalty.ops.triton.token_stats import plan_splits

    window_keys = _load._kernels().WINDOW_KEYS

    # compiled at each shape's vocabulary (the candidate list's length follows it)
    cases = [dict(name=f"cost {smp} {vocab}", vocab=vocab, dtype=dt, want=1, sampler=smp,
                  backward=False)
             for _, vocab in COST_SHAPES for dt in COST_DTYPES for smp in COST_SAMPLERS]
    results = compile_cases(cases)
    reads = search_reads([(v, dt, *smp) for _, v in COST_SHAPES for dt in COST_DTYPES
                          for smp in COST_SAMPLERS])
    out = []
    for n, vocab in COST_SHAPES:
        _, cols = plan_splits(n, vocab, GPU["sms"])
        splits = max(1, -(-vocab // cols))
        elems = n * vocab
        for case in [c for c in cases if c["vocab"] == vocab]:
            dtype, smp = case["dtype"], case["sampler"]
            b = {"bf16": 2, "fp16": 2, "fp32": 4}[dtype]
            launches = [r for r in results if r.get("case") == case["name"]
                        and r["dtype"] == dtype]
            kl = next(r for r in launches if r["kernel"] == "stats_kernel")
            t_kl = read_time(elems, kl["loop"]["per_pair"], 2 * b, n * splits)
            got = reads[(vocab, dtype, *smp)]
            t = 0.0
            nreads = 0.0
            names = []
            for r in launches:
                flags = r["constexprs"]
                if r["kernel"] == "threshold_scan_kernel":
                    (loop,) = r["inner_loops"]
                    t += read_time(elems, loop["per_elem"], b, n * splits)
                    if flags["HIST"]:  # its histograms' bins written
                        nb = 1 << (flags["DIGIT_HI"] - flags["DIGIT_LO"])
                        t += n * splits * nb * 4 / GPU["bandwidth"]
                    if flags["WINDOW"]:  # the window's counts written
                        t += n * splits * window_keys * 4 / GPU["bandwidth"]
                    nreads += 1
                elif r["kernel"] == "threshold_select_kernel":
                    t += n * splits * flags["NB"] * 4 / (GPU["bandwidth"] * min(n, GPU["sms"]) /
                                                         GPU["sms"])
                elif r["kernel"] == "threshold_cand_kernel":  # a split read of the row (the
                    # second band count: of the rows whose band holds too many, as counted)
                    (loop,) = r["inner_loops"]
                    k = got["refine"] if flags["MODE"] == 4 else 1
                    t += k * read_time(elems, loop["per_elem"], b, n * splits)
                    if flags["MODE"] in (1, 4):  # the band counts' histograms written
                        t += k * n * splits * flags["NBINS"] * 4 / GPU["bandwidth"]
                    nreads += k
                elif r["kernel"] == "threshold_list_kernel":  # a row's list: its code once,
                    # its bisection's loop (no load) its steps as counted, every thread
                    (size,) = r["loop_sizes"]
                    t += straight_time(n, r["instructions"] + max(0, got["bisect"] - 1) * size,
                                       32 * r["warps"])
                elif r["kernel"] == "threshold_band_kernel":  # the histograms read, the band
                    k = got["refine"] if flags["LEVEL"] else 1  # (LEVEL 1: the rows counted)
                    t += k * n * splits * flags["NBINS"] * 4 / (
                        GPU["bandwidth"] * min(n, GPU["sms"]) / GPU["sms"])
                    t += k * straight_time(n, r["instructions"], 32 * r["warps"])
                elif r["kernel"] == "threshold_kernel":
                    split_scan = "part_ptr" in r["signature"]
                    loops = r["inner_loops"]  # (one split per row here: no loop merges splits)
                    want = _row_loops(flags, split_scan)
                    assert len(loops) == len(want), (want, loops)
                    for name, lp in zip(want, loops):
                        if name == "window":  # no read of the row: the window's keys (their
                            # counts, an int32 a key and split, and float64 masses)
                            per_key = lp["instructions"] / (lp["elems_per_thread"] * b / 4)
                            t += read_time(n * window_keys, per_key, 4 * splits, n)
                            if flags["TOP_P"]:  # top-p's answer reads one chunk again
                                # (straight code, counted as a step of this loop)
                                t += straight_time(n, lp["instructions"], 32 * r["warps"])
                            continue
                        k = {"pass0": 1, "z": got["z"], "group": 0}.get(name, got.get(name, 0))
                        t += k * read_time(elems, lp["per_elem"], b, n)
                        nreads += k

                else:
                    continue
                names.append(r["kernel"])
            out.append(dict(n=n, vocab=vocab, dtype=dtype, sampler=list(smp), splits=splits,
                            reads=nreads, launches=len(names), threshold_us=t * 1e6,
                            kl_us=t_kl * 1e6, ratio=t / t_kl))
    return out


def cost_table(rows: list[dict]) -> str:
    lines = _header(["N × V", "dtype", "top_k, top_p, min_p", "splits", "reads of the row",
                     "launches", "threshold (µs)", "KL forward (µs)", "ratio"], "lllrrrrrr")
    for r in rows:
        lines.append(_row([f"{r['n']} × {r['vocab']}", r["dtype"], r["sampler"], r["splits"],
                           f"{r['reads']:g}", r["launches"], f"{r['threshold_us']:.0f}",
                           f"{r['kl_us']:.0f}", f"{r['ratio']:.1f}"]))
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--threshold-cost", action="store_true",
                        help="the sampler's threshold predicted against the KL forward")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: the kernels must be compiled", file=sys.stderr)
        return 2
    if args.threshold_cost:
        rows = threshold_cost()
        print(json.dumps(rows) if args.json else cost_table(rows))
        return 0
    results = compile_cases()
    if args.json:
        print(json.dumps(results))
    else:
        print(f"Triton {results[-1]['triton']}, target sm_90, V = {VOCAB}, one program per row\n")
        print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
