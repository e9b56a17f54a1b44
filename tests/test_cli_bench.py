"""``klpenalty bench`` at a tiny shape: the table comes out and its figures are sane."""

from __future__ import annotations

import pytest

from klpenalty import bench
from klpenalty.cli import main


def test_cli_bench_tiny_shape(capsys, tmp_path):
    csv_path = tmp_path / "rows.csv"
    code = main(
        [
            "bench", "--shape", "2,3,50", "--repeats", "2", "--threads", "1", "--no-memory",
            "--providers", "seed", "kl_div", "streaming", "--quiet", "--csv", str(csv_path),
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert out.startswith("| shape | dtype | mode | threads | load | provider |")
    lines = [line for line in out.splitlines() if line.startswith("| 2x3x50 ")]
    # floor, exp floor + three providers for fwd; floor + three providers for fwdbwd
    assert len(lines) == 9
    fwd_streaming = next(line for line in lines if "| fwd | 1 | 0 | streaming |" in line)
    err = float(fwd_streaming.split("|")[-3])
    assert 0 <= err < 2e-6
    assert csv_path.read_text().count("\n") == 10  # header + 9 rows


def test_cli_bench_rejects_bad_shape(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--shape", "2,3"])
    assert "B,T,V" in capsys.readouterr().err


def test_seed_and_kl_div_baselines_agree_with_reference():
    from klpenalty.ops.reference import full_kl_reference

    x, y = bench.make_inputs((2, 3, 40), bench.DTYPES["fp32"])
    want = full_kl_reference(x, y)
    for fn in (bench.seed_formula, bench.kl_div_formula):
        assert (fn(x, y).double() - want).abs().max().item() < 2e-6
    with pytest.raises(ValueError, match="unknown provider"):
        bench.providers(["nope"])


def test_cpu_load_runs_busy_processes_and_stops_them():
    with bench.cpu_load(2, seconds=30) as procs:
        assert len(procs) == 2 and all(p.poll() is None for p in procs)  # running
    assert all(p.returncode is not None for p in procs)  # stopped on exit
