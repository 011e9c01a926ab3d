"""The benchmarks run end to end with tiny settings and report what they promise (the figures themselves are the
benchmarks' business, not the tests')."""
import re
import runpy

from support import PYTHON, REPO, run, script


def test_scaling_prints_a_table_against_the_ceiling_and_draws_it(tmp_path):
    plot = tmp_path / "scaling.png"
    proc = run([PYTHON, script("benchmarks/scaling.py"), "--devices", "cpu", "--max_procs", 2, "--rounds", 1,
                "--workload", "synthetic", "--plot", plot], cwd=tmp_path, timeout=180)
    rows = re.findall(r"^\| (\d) \| [\d,]+ \| ([\d.]+)x \| ([\d.]+) \| [\d,]+ \| ([\d.]+)x \| ([\d.]+) \| [\d.]+x \|$",
                      proc.output, re.M)
    assert [row[0] for row in rows] == ["1", "2"], proc.output
    assert rows[0][1:] == ("1.00", "1.00", "1.00", "1.00")  # one process is the yardstick
    assert re.search(r"cpu: 2 processes reach [\d.]+x of one with DDP, [\d.]+ of the [\d.]+x", proc.output)
    assert plot.read_bytes().startswith(b"\x89PNG")


def test_overhead_compares_the_trainer_with_a_bare_loop(monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["overhead.py", "--workloads", "synthetic", "--rounds", "2",
                                     "--min_seconds", "0"])
    runpy.run_path(str(REPO / "benchmarks" / "overhead.py"), run_name="__main__")
    output = capsys.readouterr().out
    assert re.search(r"^\| synthetic \| 64 \| [\d.]+ \| [\d.]+ \| [\d.]+x \|$", output, re.M), output
    assert re.search(r"worst ratio [\d.]+x \(goal <= 1.10x\): (met|NOT met)", output)
