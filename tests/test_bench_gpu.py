"""benchmarks/bench_gpu.py cannot run here (no GPU), but its Python paths can: a dry run with
CUDA's timing and memory calls stubbed, the device mapped to CPU and the Triton kernels in the
interpreter, on tiny shapes. It catches a benchmark that would crash (or record an exception in
every row) on the GPU machine, whose time is short. The numbers of a dry run mean nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

DRY_RUN = r'''
import sys, time, types
import torch

src = open(sys.argv[1]).read().replace('torch.device("cuda")', 'torch.device("cpu")')


class Event:
    def __init__(self, **_):
        self.t = 0.0

    def record(self):
        self.t = time.perf_counter()

    def elapsed_time(self, other):
        return (other.t - self.t) * 1e3


class Generator(torch.Generator):
    def __init__(self, device=None):
        super().__init__()


for name, value in dict(
    is_available=lambda: True, Event=Event, synchronize=lambda *a: None,
    memory_allocated=lambda *a: 0, max_memory_allocated=lambda *a: 0,
    reset_peak_memory_stats=lambda *a: None, empty_cache=lambda: None,
    get_device_name=lambda *a: "dry run",
).items():
    setattr(torch.cuda, name, value)
torch.Generator = Generator
module = types.ModuleType("bench_gpu")
module.__dict__.update(__name__="__main__", __file__=sys.argv[1])
sys.argv = sys.argv[1:]
exec(compile(src, "bench_gpu.py", "exec"), module.__dict__)
'''


@pytest.mark.parametrize(
    "args,providers",
    [
        (["--shapes", "2x4x64", "--dtypes", "bf16", "--one-pass-shapes", "2x4x64"],
         ["seed", "kl_div", "streaming", "triton", "3 calls", "token_stats"]),
        (["--linear", "--linear-shape", "64x16x300"], ["unfused", "linear_kl"]),
    ],
)
def test_gpu_benchmark_paths_run(tmp_path, args, providers):
    script = tmp_path / "dry_run.py"
    script.write_text(DRY_RUN)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT / "src"))
    proc = subprocess.run(
        [sys.executable, str(script), str(ROOT / "benchmarks" / "bench_gpu.py"), *args,
         "--repeats", "1", "--warmup", "1", "--out", str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=300, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if "provider=" in line]
    for name in providers:
        assert any(f"provider={name}" in r or name in r.split("provider=")[1] for r in rows), name
    failed = [r for r in rows if not r.rstrip().endswith("note=")]
    assert not failed, "\n".join(failed)  # a row that recorded an exception
    assert list(tmp_path.glob("*.md"))
