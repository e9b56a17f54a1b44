"""benchmarks/gpu_check.sh and benchmarks/bench_gpu.py cannot run here (no GPU), but their paths
can: a dry run with CUDA's timing and memory calls stubbed, the benchmark's device set to CPU
and the Triton kernels in the interpreter, on tiny shapes. It catches a check script that would
crash, record an exception in a row, lose its results or run past its own time budget. The
numbers of a dry run mean nothing.

The end-to-end test runs gpu_check.sh with ``PYTHON`` pointing at :data:`DRY_RUN_PYTHON`, which
runs the script's Python commands with those stubs. Its two pytest steps (the kernel and
distributed tests, minutes of compilation on the GPU) are recorded, not run: the suite runs
those tests itself."""

from __future__ import annotations

import csv
import importlib.util
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
BENCH = ROOT / "benchmarks" / "bench_gpu.py"
TINY = ["--shapes", "1x2x64", "--dtypes", "bf16", "--repeats", "1", "--warmup", "0",
        "--sampler-shapes"]


class _Event:
    def __init__(self, **_):
        self.t = 0.0

    def record(self):
        self.t = time.perf_counter()

    def elapsed_time(self, other):
        return (other.t - self.t) * 1e3


def cuda_stubs() -> dict:
    """torch.cuda attributes -> stand-ins that let the benchmark run on CPU tensors (CUDA
    itself stays unavailable: torch.compile must not look for it)."""
    return dict(
        Event=_Event, synchronize=lambda *a: None, memory_allocated=lambda *a: 0,
        max_memory_allocated=lambda *a: 0, reset_peak_memory_stats=lambda *a: None,
        empty_cache=lambda: None, get_device_name=lambda *a: "dry run",
    )


def load_bench():
    """benchmarks/bench_gpu.py as a module, its device set to CPU."""
    spec = importlib.util.spec_from_file_location("bench_gpu_dry_run", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.DEVICE = "cpu"
    return module


# Stands in for gpu_check.sh's python ($PY): "-m pytest ..." is appended to
# the file $DRY_RUN_LOG and not run, "-c CODE" runs as it is, and "bench_gpu.py ARGS" runs on CPU
# with cuda_stubs() and Triton in its interpreter.
DRY_RUN_PYTHON = """#!{python}
import os, sys
argv = sys.argv[1:]
if argv[:2] == ["-m", "pytest"]:
    with open(os.environ["DRY_RUN_LOG"], "a") as f:
        f.write(" ".join(argv[2:]) + "\\n")
    print("dry run: pytest not run")
    sys.exit(0)
if argv[0] == "-c":
    exec(compile(argv[1], "<string>", "exec"), {{"__name__": "__main__"}})
    sys.exit(0)
os.environ["TRITON_INTERPRET"] = "1"  # before Triton's first import
sys.path.insert(0, {root!r})
import torch
from tests.test_bench_gpu import cuda_stubs, load_bench
for name, value in cuda_stubs().items():
    setattr(torch.cuda, name, value)
sys.exit(load_bench().main(argv[1:]))
"""


@pytest.fixture
def bench(monkeypatch):
    """bench_gpu as a module in this process: CUDA stubbed, Triton interpreted."""
    import torch

    from tests.helpers import patch_torch

    for name, value in cuda_stubs().items():
        patch_torch(monkeypatch, torch.cuda, name, value)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # as tests/ops/test_triton.py runs it
    yield load_bench()
    torch._dynamo.reset()  # the compile rows' compilations stay out of later tests


@pytest.fixture(scope="module", autouse=True)
def gpu_check_run(tmp_path_factory):
    """gpu_check.sh's dry run with $OUT set, started with this module so that it runs beside
    the in-process tests (it is mostly the imports of its two Python processes); the end-to-end
    test, the module's last, waits for it and reads what it left."""
    tmp = tmp_path_factory.mktemp("gpu_check")
    xdist = tmp / "site" / "xdist"  # a stand-in: where xdist imports, the kernel step runs -n 4
    xdist.mkdir(parents=True)
    (xdist / "__init__.py").write_text("")
    python = tmp / "python"
    python.write_text(DRY_RUN_PYTHON.format(python=sys.executable, root=str(ROOT)))
    python.chmod(0o755)
    env = dict(
        os.environ, OUT=str(tmp / "out"), PYTHON=str(python), DRY_RUN_LOG=str(tmp / "pytest_calls"),
        PYTHONPATH=str(tmp / "site"),
        BENCH_ARGS=" ".join(TINY + ["--providers", "seed", "streaming", "--one-pass-shapes"]),
        LINEAR_ARGS="--linear-shape 32x16x300 --chunk-rows 8 --repeats 1 --warmup 0",
    )
    with open(tmp / "stdout", "w") as stdout, open(tmp / "stderr", "w") as stderr:
        proc = subprocess.Popen(["bash", str(SCRIPT)], stdout=stdout, stderr=stderr, env=env,
                                cwd=ROOT, start_new_session=True)
    yield tmp, proc
    if proc.poll() is None:  # the end-to-end test did not run (-k): stop the dry run
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _budget() -> int:
    """gpu_check.sh's own BUDGET (seconds)."""
    return int(re.search(r"^BUDGET=(\d+)\b", SCRIPT.read_text(), re.M)[1])


def test_step_limits_fit_the_budget():
    """What gpu_check.sh guarantees about its time: its steps' limits and kill grace sum to at most
    its BUDGET, and each step reserves the limits and grace of the steps after it (its own limit
    is cut to what is left of BUDGET after them), so no step runs past BUDGET."""
    text = SCRIPT.read_text()
    value = {k: int(v) for k, v in re.findall(r"^(\w+)=(\d+)\b", text, re.M)}
    steps = ["T_BENCH", "T_LINEAR", "T_KERNEL", "T_DIST"]
    grace = value["KILL_AFTER"]
    assert sum(value[k] for k in steps) + len(steps) * grace <= value["BUDGET"] == _budget()
    assert text.count("\nstep ") == len(steps)  # no step outside the budget
    reserved = re.findall(r"^step \w+ \S+ (0|\$\(\((.*?)\)\))", text, re.M)
    assert len(reserved) == len(steps)
    for i, (arg, expr) in enumerate(reserved):  # expr: a sum of products of names and ints
        total = sum(math.prod(int(f) if f.strip().isdigit() else value[f.strip()]
                              for f in term.split("*")) for term in expr.split("+") if expr)
        after = sum(value[k] + grace for k in steps[i + 1:])
        assert (total if expr else int(arg)) == after, (steps[i], arg)
    assert re.search(r"^RES=\$\{OUT:-", text, re.M) and not re.search(r"^OUT=", text, re.M)


def test_default_rows_are_written_as_measured(bench, tmp_path):
    """The default providers and the one-pass rows, each row on disk (CSV and markdown) before
    the next one is measured, the compile rows last."""
    on_disk = []
    add = bench.Table.add

    def add_and_read(self, row):
        add(self, row)
        on_disk.append((len(_csv(Path(self.csv_path))),
                        Path(self.md_path).read_text().count("\n| 1x2x64 |")))

    bench.Table.add = add_and_read
    assert bench.main(TINY + ["--one-pass-shapes", "1x2x64", "--sampler-shapes", "1x2x64",
                              "1x2x64:fp32", "--compile-backend", "eager",
                              "--out", str(tmp_path)]) == 0
    rows = _csv(tmp_path / "bench_gpu.csv")
    assert on_disk == [(i, i) for i in range(1, len(rows) + 1)]
    seen = [(r["mode"], r["provider"]) for r in rows]
    sampler = [name for name, _ in bench.SAMPLER_ROWS]
    for name in ["triton", "seed", "kl_div", "compile", "kl+logp+H 3 calls",
                 "kl+logp+H token_stats", *sampler]:
        assert ("fwd", name) in seen and ("fwd+bwd", name) in seen, name
    thresholds = [(r["dtype"], r["provider"]) for r in rows
                  if r["provider"].startswith("threshold")]
    assert thresholds == [(dt, f"threshold top_k=50 top_p=0.9 {name}")
                          for dt in ("bf16", "fp32") for name in ("triton", "portable rule")]
    assert {r["dtype"] for r in rows if r["provider"] == "full_kl top_p=0.9"} == {"bf16", "fp32"}
    assert ("fwd+bwd", "liger") not in seen  # forward only
    assert not any(p == "streaming" for _, p in seen)  # off unless named
    assert [r for r in rows if r["note"]] == []  # a row that recorded an exception
    assert all(r["tol_ok"] == "yes" and float(r["max_err"]) < 1e-5 for r in rows)
    assert all((r["grad_err"] == "") == (r["mode"] == "fwd") for r in rows)
    compiled = [r for r in rows if r["provider"] == "compile"]
    assert compiled == rows[-2:] and all(float(r["compile_s"]) > 0 for r in compiled)


def test_errors_come_from_the_timed_call(bench):
    """The error columns read the outputs handed to them: a wrong value in the last row or a
    wrong gradient of the last row shows; rows between the first and last 16 are not read."""
    import torch

    from klpenalty.ops.reference import full_kl_reference

    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 10, 64, generator=g, dtype=torch.float64).float()
    y = torch.randn(4, 10, 64, generator=g, dtype=torch.float64).float()
    xg = x.double().requires_grad_(True)
    full_kl_reference(xg, y).sum().backward()
    kl, grad = full_kl_reference(x, y).float(), xg.grad.float()

    def reference(xs, ys, rows):
        return (full_kl_reference(xs, ys),)

    def errors(kl, grad):
        return bench.timed_call_errors(torch, x, y, [kl], grad, reference)

    err, grad_err, ok = errors(kl, grad)
    assert err < 1e-6 and grad_err < 1e-6 and ok == "yes"
    assert bench.check_rows(40) == list(range(16)) + list(range(24, 40))
    wrong = kl.clone()
    wrong[-1, -1] += 1e-3
    err, _, ok = errors(wrong, None)
    assert abs(err - 1e-3) < 1e-6 and ok == "no"
    wrong_grad = grad.clone()
    wrong_grad[-1, -1, 5] += 0.5
    _, grad_err, ok = errors(kl, wrong_grad)
    assert grad_err > 0.5 and ok == "no"
    unread = kl.clone()
    unread.view(-1)[20] += 1.0  # row 20 of 40: not among the checked rows
    assert errors(unread, None)[2] == "yes"


def test_compile_budget_bounds_the_compilations(bench, tmp_path):
    """An alarm stops a compilation that runs past the shared budget; once it is spent the
    compile rows are recorded as not run."""
    import torch

    from klpenalty.bench import seed_formula

    compiled = bench.CompiledFormula(torch, seed_formula, "eager", budget=0.2)
    t0 = time.perf_counter()
    with pytest.raises(bench.CompileBudgetSpent, match="ran past"):
        compiled.first_call(lambda: time.sleep(5))  # a compilation that takes too long
    assert time.perf_counter() - t0 < 2 and compiled.spent >= 0.2
    with pytest.raises(bench.CompileBudgetSpent, match="not run"):
        compiled.first_call(lambda: None)
    assert bench.main(TINY + ["--providers", "compile", "--compile-budget", "0",
                              "--one-pass-shapes", "--out", str(tmp_path)]) == 0
    rows = _csv(tmp_path / "bench_gpu.csv")
    assert [r["mode"] for r in rows] == ["fwd", "fwd+bwd"]
    assert all("not run: the compile budget" in r["note"] for r in rows)


def test_gpu_check_end_to_end(gpu_check_run):
    """gpu_check.sh with $OUT set (:func:`gpu_check_run`): its files under $OUT, every row
    without an exception, the pytest steps' arguments, the summary last, within its budget."""
    tmp, proc = gpu_check_run
    rc = proc.wait(timeout=120)
    stdout, out = (tmp / "stdout").read_text(), tmp / "out"
    assert rc == 0, stdout[-3000:] + (tmp / "stderr").read_text()[-3000:]

    # the script's files: plain files with plain names, straight under $OUT
    files = sorted(p.name for p in out.iterdir())
    assert files == ["bench_gpu.csv", "bench_gpu.md", "bench_gpu_linear.csv",
                     "bench_gpu_linear.md", "gpu_check.log", "summary.txt"], files
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+", f) and (out / f).is_file() for f in files)

    rows = _csv(out / "bench_gpu.csv")
    assert [(r["mode"], r["provider"]) for r in rows] == [  # streaming runs when named
        (m, p) for m in ("fwd", "fwd+bwd") for p in ("seed", "streaming")]
    assert all(r["tol_ok"] == "yes" and not r["note"] for r in rows)
    assert (out / "bench_gpu.md").read_text().count("\n| 1x2x64 |") == len(rows)
    linear = _csv(out / "bench_gpu_linear.csv")  # every kind of row in LINEAR_ROW_KINDS
    seen = [(r["mode"], r["provider"]) for r in linear]
    assert [(m, "unfused") for m in ("fwd", "fwd+bwd")] == [s for s in seen if s[1] == "unfused"]
    assert seen.index(("fwd+bwd", "unfused")) == len(seen) // 2  # the first row of each mode
    assert ("fwd", "linear_kl R=8") in seen and ("fwd+bwd", "linear_kl R=8") in seen
    assert ("fwd", "fused_loss R=8") in seen and ("fwd+bwd", "fused_loss R=8") in seen
    assert all(float(r["ms"]) > 0 and not r["note"] for r in linear)

    # the two pytest steps, with the arguments the script gives them
    calls = (tmp / "pytest_calls").read_text().splitlines()
    assert len(calls) == 2
    assert "tests/ops/test_triton.py" in calls[0] and calls[0].endswith("-n 4")
    assert "tests/distributed" in calls[1]

    # the summary comes last: the output ends with summary.txt
    summary = (out / "summary.txt").read_text()
    assert stdout.endswith(summary)
    assert "python " in stdout and "triton " in stdout  # the environment line
    status = re.match(r"== status 0, (\d+) s of (\d+) s;", summary.rstrip().splitlines()[-1])
    assert status and int(status[1]) <= int(status[2]) == _budget(), summary
    steps = re.findall(r"^(\w+) +rc=(\S+) +\d+s of +(\d+)s$", summary, re.M)
    assert [(s, rc) for s, rc, _ in steps] == [
        (s, "0") for s in ("bench", "linear", "kernels", "distributed")]
    assert sum(int(limit) for *_, limit in steps) <= _budget()
