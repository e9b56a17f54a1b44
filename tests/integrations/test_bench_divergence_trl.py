"""benchmarks/bench_divergence_trl.py, run once on tiny shapes (``--quick``): the smoke test.

Needs the ``trl`` extra (collected by ``make test-integrations`` only; see conftest.py). Runs
the script with ``--quick`` (N=64, H=64, V=2000, fp32 and bf16, one round, a peak-memory
process per row) in a subprocess with a time limit, and reads the markdown table and the CSV
it writes: a row for every dtype × kind × provider, positive times and peaks, and in float32
klpenalty's and TRL's values within 1e-4 of float64 and of each other (TRL's beta 0.0 / 1.0 /
0.5 are klpenalty's forward KL, reverse KL and JSD with beta 0.5).
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "bench_divergence_trl.py"
PROVIDERS = ("klpenalty", "klpenalty_planned", "trl", "torch")
KINDS = ("forward_kl", "reverse_kl", "jsd")
SETTINGS = {("trl", "forward_kl"): "beta=0.0", ("trl", "reverse_kl"): "beta=1.0",
            ("trl", "jsd"): "beta=0.5"}


def test_quick_run_has_every_row_and_float32_agrees_with_float64(tmp_path):
    out = tmp_path / "bench_divergence_trl"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]

    md = (tmp_path / "bench_divergence_trl.md").read_text()
    assert "loadavg" in md and "threads" in md and "TRL" in md
    lines = [line for line in md.splitlines() if line.startswith("| N=")]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    seen = {(c[1], c[2], c[3]) for c in cells}
    want = {(d, k, p) for d in ("fp32", "bf16") for k in KINDS for p in PROVIDERS}
    assert seen == want and len(cells) == len(want)

    with open(tmp_path / "bench_divergence_trl.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(want)
    for r in rows:
        assert float(r["median_s"]) > 0, r
        assert float(r["peak_mib"]) > 0, r
        if (r["provider"], r["kind"]) in SETTINGS:
            assert r["setting"] == SETTINGS[(r["provider"], r["kind"])]
        if r["dtype"] == "fp32" and r["provider"] in ("klpenalty", "klpenalty_planned", "trl"):
            assert float(r["value_err"]) <= 1e-4, r
            if r["provider"] == "trl":
                assert float(r["diff_vs_klpenalty"]) <= 1e-4, r
        if r["provider"] in ("klpenalty", "klpenalty_planned"):
            assert float(r["time_x_trl"]) > 0 and float(r["time_x_torch"]) > 0
