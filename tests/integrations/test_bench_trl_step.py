"""benchmarks/bench_trl_step.py, run once on tiny shapes (``--quick``): the smoke test.

Needs the ``trl`` extra (collected by ``make test-integrations`` only; see conftest.py). Runs
the script's ``main`` with ``--quick`` (vocabulary 64, hidden 16, one layer, one round, and a
peak-RSS subprocess per variant) and reads the CSV and the markdown table it writes: every
variant and column is there, the timings are positive, the forward counts are integers, and
the ``exact`` variant runs the reference once per generation batch and once per completion,
as ``trl`` does.
"""

from __future__ import annotations

import csv
import importlib.util
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_trl_step.py"
COLUMNS = ["variant", "step", "generation", "ref pass", "old logps", "loss fwd", "backward",
           "optim", "ref fwd/gen batch", "ref rows/completion", "policy fwd", "peak RSS (MiB)"]


def load_script():
    spec = importlib.util.spec_from_file_location("bench_trl_step", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quick_run_writes_every_variant_and_column(tmp_path):
    bench = load_script()
    out = tmp_path / "bench_trl_step"
    t0 = time.perf_counter()
    assert bench.main(["--quick", "--out", str(out)]) == 0
    assert time.perf_counter() - t0 < 60

    md = (tmp_path / "bench_trl_step.md").read_text()
    header = next(line for line in md.splitlines() if line.startswith("| variant"))
    assert [c.strip() for c in header.strip("|").split("|")] == COLUMNS
    for variant in bench.VARIANTS:
        assert f"| {variant} |" in md
    assert "loadavg" in md and "threads" in md

    with open(tmp_path / "bench_trl_step.csv", newline="") as f:
        rows = {r["variant"]: r for r in csv.DictReader(f)}
    assert set(rows) == set(bench.VARIANTS)
    for r in rows.values():
        for phase in ("step", "generation", "loss_fwd", "backward", "optim"):
            assert float(r[f"{phase}_s"]) > 0, (r["variant"], phase)
        for count in ("ref_fwd_per_gen", "ref_per_completion", "policy_fwd", "policy_rows"):
            assert r[count].isdigit(), (r["variant"], count, r[count])
        assert float(r["peak_rss_mib"]) > 0
        assert float(r["step_s"]) >= float(r["loss_fwd_s"]) + float(r["backward_s"])
    # β = 0: no reference model; otherwise one reference forward per generation batch
    assert int(rows["beta0"]["ref_fwd_per_gen"]) == 0
    assert int(rows["trl"]["ref_fwd_per_gen"]) == 1
    assert int(rows["exact"]["ref_fwd_per_gen"]) == int(rows["trl"]["ref_fwd_per_gen"])
    assert int(rows["exact"]["ref_per_completion"]) == int(rows["trl"]["ref_per_completion"]) == 1
    assert int(rows["exact"]["policy_fwd"]) == int(rows["trl"]["policy_fwd"]) >= 1
    assert float(rows["trl"]["step_x_trl"]) == 1.0
