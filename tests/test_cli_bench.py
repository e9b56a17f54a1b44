"""``klpenalty bench`` at a tiny shape: the table comes out and its figures are sane."""

from __future__ import annotations

from dataclasses import asdict

import pytest

from klpenalty import bench
from klpenalty.cli import main
from klpenalty.ops import native


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
    assert out.startswith("| shape | dtype | mode | threads | load | clock | provider |")
    lines = [line for line in out.splitlines() if line.startswith("| 2x3x50 ")]
    # fwd: floor, exp floor, the four compute floors (the native kernel builds here) and three
    # providers; fwdbwd: floor and three providers
    assert native.available()
    assert len(lines) == 13
    compute = [line for line in lines if "*compute floor x" in line]
    assert [line.split("|")[7].strip() for line in compute] == [
        f"*compute floor x{u}*" for u in bench.COMPUTE_CHAINS
    ]
    fwd_streaming = next(line for line in lines if "| fwd | 1 | 0 | wall | streaming |" in line)
    cells = [c.strip() for c in fwd_streaming.split("|")]
    err = float(cells[-3])
    assert 0 <= err < 2e-6
    # × floor, × compute floor, × max(floors): the last is the smaller of the other two
    vs_floor, vs_compute, vs_max = float(cells[12]), float(cells[13]), float(cells[14])
    assert vs_floor > 0 and vs_compute > 0 and vs_max == pytest.approx(
        min(vs_floor, vs_compute), abs=0.011
    )
    assert csv_path.read_text().count("\n") == 14  # header + 13 rows
    rows = bench.read_csv(str(csv_path))
    assert [r.provider for r in rows if r.vs_compute is not None and r.mode == "fwd"] == [
        "seed", "kl_div", "streaming"
    ]
    assert {r.clock for r in rows} == {"wall"}


def test_thread_clock_times_cpu_time_of_one_thread():
    rows = bench.run_benchmark((2, 3, 50), modes=("fwd",), names=["streaming"], repeats=2,
                               memory=False, error=False, threads=1, log=None, clock="thread")
    assert {r.clock for r in rows} == {"thread"} and all(r.median_ms > 0 for r in rows)
    with pytest.raises(ValueError, match="clock must be one of"):
        bench.run_benchmark((2, 3, 50), clock="cycles")


def test_csv_of_an_older_version_is_rewritten_with_the_new_columns(tmp_path):
    path = tmp_path / "rows.csv"
    old = bench.Row("S", "fp32", "fwd", "seed", 2.0, 1.0, 0.1, None, 3.0, None, 1e-7, 1, 0, 0.5)
    fields = [f for f in asdict(old) if f not in ("vs_compute", "vs_max", "clock")]
    path.write_text(",".join(fields) + "\n" + ",".join(str(asdict(old)[f]) for f in fields) + "\n")
    new = bench.Row("S", "fp32", "fwd", "native", 1.0, 1.0, 0.1, 2.0, 1.5, None, 1e-8, 1, 0, 0.5,
                    vs_compute=1.2, vs_max=1.2)
    bench.write_csv([new], str(path))
    rows = bench.read_csv(str(path))
    assert [(r.provider, r.vs_floor, r.vs_compute) for r in rows] == [
        ("seed", 3.0, None), ("native", 1.5, 1.2)
    ]


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
