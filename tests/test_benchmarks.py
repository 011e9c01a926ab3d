"""The benchmarks run end to end with tiny settings and report what they promise (the figures themselves are the
benchmarks' business, not the tests')."""
import os
import re
import runpy

import pytest

from tools.jobs import PYTHON, REPO, run, script


def run_benchmark(monkeypatch, capsys, name, *args):
    """A benchmark's __main__ in this process (its jobs and workers are real processes: this saves one interpreter
    start); what it printed. The variables it sets for its workers (MASTER_PORT...) are undone afterwards."""
    monkeypatch.setattr("sys.argv", [name, *map(str, args)])
    environment = dict(os.environ)
    try:
        runpy.run_path(str(REPO / "benchmarks" / name), run_name="__main__")
    finally:
        os.environ.clear()
        os.environ.update(environment)
    return capsys.readouterr().out


def assert_verdict_follows(verdict, meets, figure, goal, rounding):
    """A summary's verdict is the one its figure gives against the goal: "met" exactly when `meets`. A figure that
    rounds to within `rounding` of the goal may have been on either side of it before it was rounded."""
    if abs(figure - goal) > rounding:
        assert verdict == ("met" if meets else "NOT met"), (verdict, figure, goal)


@pytest.mark.slow
def test_scaling_prints_a_table_against_the_ceiling_and_draws_it(tmp_path, monkeypatch, capsys):
    plot = tmp_path / "scaling.png"
    text = run_benchmark(monkeypatch, capsys, "scaling.py", "--devices", "cpu", "--max_procs", 2, "--rounds", 1,
                         "--workload", "synthetic", "--plot", plot)
    rows = re.findall(r"^\| (\d) \| [\d,]+ \| ([\d.]+)x \| ([\d.]+) \| [\d,]+ \| ([\d.]+)x \| ([\d.]+) \| [\d.]+x \|$",
                      text, re.M)
    assert [row[0] for row in rows] == ["1", "2"], text
    assert rows[0][1:] == ("1.00", "1.00", "1.00", "1.00")  # one process is the yardstick
    assert re.search(r"cpu: 2 processes reach [\d.]+x of one with DDP, [\d.]+ of the [\d.]+x", text)
    assert plot.read_bytes().startswith(b"\x89PNG")


def test_overhead_compares_the_trainer_with_a_bare_loop(monkeypatch, capsys):
    output = run_benchmark(monkeypatch, capsys, "overhead.py", "--workloads", "synthetic", "--rounds", 2,
                           "--min_seconds", 0)
    ratios = re.findall(r"^\| synthetic \| 64 \| [\d.]+ \| [\d.]+ \| ([\d.]+)x \|$", output, re.M)
    assert len(ratios) == 1, output
    summary = re.search(r"^worst ratio ([\d.]+)x \(goal <= ([\d.]+)x\): (met|NOT met)$", output, re.M)
    assert summary and summary[1] == max(ratios, key=float), output  # the worst row's ratio
    assert_verdict_follows(summary[3], float(summary[1]) <= float(summary[2]), float(summary[1]), float(summary[2]),
                           rounding=0.0005)


@pytest.mark.slow
def test_recovery_times_a_kill_against_a_cold_start(monkeypatch, capsys):
    text = run_benchmark(monkeypatch, capsys, "recovery.py", "--epochs", 6, "--save_every", 2, "--kill_after", 3,
                         "--nproc", 1)  # one worker per attempt is enough to time a restart
    assert re.search(r"rank 0 \(pid \d+\) SIGKILLed after epoch 3", text), text
    for label in ("cold start   launch -> first training step", "recovery     kill -> snapshot loaded",
                  "ratio        recovery / cold start"):
        assert re.search(rf"^{re.escape(label)}.*? [\d.]+", text, re.M), text
    # snapshots after epochs 1, 3, 5: the kill after epoch 3's line lands before or after the one of epoch 3
    lost = re.search(r"work lost    (\d+) finished epoch\(s\) since the snapshot of epoch (\d)( \(epochs (\d)-(\d)\))? "
                     r"plus the one in progress", text)
    assert lost, text
    redone, snapshot = int(lost[1]), int(lost[2])
    assert snapshot in (1, 3), text
    if redone:  # the epochs after that snapshot that finished before the kill: they are trained again
        assert int(lost[4]) == snapshot + 1 and redone == int(lost[5]) - int(lost[4]) + 1, text
    else:
        assert lost[3] is None, text


@pytest.mark.slow
def test_restarts_counts_a_killed_job_that_resumes(monkeypatch, capsys):
    text = run_benchmark(monkeypatch, capsys, "restarts.py", "--kills", 1, "--epochs", 4, "--timeout", 60)
    assert re.search(r"^1 jobs, 1 node\(s\), torchrun's shared store", text, re.M), text
    assert re.search(r"^\| 0 \| [\d.]+ s \| yes \| [\d.]+ s \| \[0\] \| \d+ \|$", text, re.M), text
    assert re.search(r"^resumed 1 of 1; kill -> resume median [\d.]+ s", text, re.M), text


@pytest.mark.slow
@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks what it says on a machine without CUDA")
def test_dataparallel_against_ddp_says_what_it_compares_on_a_cpu(monkeypatch, capsys):
    text = run_benchmark(monkeypatch, capsys, "dataparallel_vs_ddp.py", "--workload", "synthetic", "--steps", 8,
                         "--warmup", 2, "--batch_size", 64)
    assert "No CUDA device: DataParallel does nothing here" in text, text
    assert re.search(r"one process \(DataParallel is a no-op without CUDA\) +[\d,]+ samples/s", text)
    assert re.search(r"DDP, 2 processes +[\d,]+ samples/s", text)
    assert re.search(r"DDP / one process: [\d.]+x", text)


@pytest.mark.slow
def test_gpt_scaling_compares_ddp_with_the_ceiling_for_each_grad_accum(tmp_path, monkeypatch, capsys):
    plot = tmp_path / "gpt_scaling.png"
    text = run_benchmark(monkeypatch, capsys, "gpt_scaling.py", "--rounds", 1, "--grad_accum", 1, 2, "--chars", 3000,
                         "--batch_size", 4, "--plot", plot)
    rows = re.findall(r"^\| (\d) \| (\d) \| [\d,]+ \| ([\d.]+)x \| [\d,]+ \| ([\d.]+)x \| ([\d.]+) \|$", text, re.M)
    assert [row[:2] for row in rows] == [("1", "1"), ("1", "2"), ("2", "1"), ("2", "2")], text
    assert rows[0][2:] == rows[2][2:] == ("1.00", "1.00", "1.00")  # one process is the yardstick for each K
    summary = re.search(r"^--grad_accum 2: 2 processes deliver ([\d.]+) of the ([\d.]+)x ceiling \(goal >= ([\d.]+)\): "
                        r"(met|NOT met)$", text, re.M)
    assert summary and (summary[1], summary[2]) == (rows[3][4], rows[3][3]), text  # the table's K=2, 2 processes
    assert_verdict_follows(summary[4], float(summary[1]) >= float(summary[3]), float(summary[1]), float(summary[3]),
                           rounding=0.005)
    assert plot.read_bytes().startswith(b"\x89PNG")


@pytest.mark.slow
def test_communication_counts_each_layouts_collectives_per_optimizer_step(tmp_path):
    """4 processes, the CPU-size GPT (2 blocks): TP all-reduces activations twice per block in the forward (after
    attention and after the MLP) and twice in the backward (at their inputs); FSDP gathers each of its 4 units
    (embedding, 2 blocks, head) before the forward and the backward and reduce-scatters them; DDP only all-reduces.
    A job of its own, not run_benchmark: notebooks/07_tensor_parallel.ipynb runs the same one, so in a test session
    it runs once (shared)."""
    text = run([PYTHON, script("benchmarks/communication.py"), "--steps", 1, "--rounds", 1, "--chars", 20000],
               cwd=tmp_path, timeout=300, shared=True).output
    rows = {row[0]: row[1:] for row in re.findall(r"^\| (\w+) \| (dp \d x tp \d) \| (.+?) \| (.+?) \| ([\d,]+) \|$",
                                                   text, re.M)}
    assert list(rows) == ["DDP", "FSDP", "TP", "2D"], text
    assert [mesh for mesh, *_ in rows.values()] == ["dp 4 x tp 1", "dp 4 x tp 1", "dp 1 x tp 4", "dp 2 x tp 2"]
    assert re.fullmatch(r"\d all-reduce over all \(bwd\)", rows["DDP"][1]), rows["DDP"]
    fsdp = "4 all-gather over dp (fwd), 4 all-gather over dp (bwd), 4 reduce-scatter over dp (bwd)"
    tp = "4 all-reduce over tp (fwd), 4 all-reduce over tp (bwd)"
    assert rows["FSDP"][1] == fsdp and rows["TP"][1] == tp
    assert rows["2D"][1] == ("4 all-gather over dp (fwd), 4 all-reduce over tp (fwd), 4 all-gather over dp (bwd), "
                             "4 all-reduce over tp (bwd), 4 reduce-scatter over dp (bwd)")
    assert re.fullmatch(r"[\d.]+ \(dp\) \+ [\d.]+ \(tp\)", rows["2D"][2]), rows["2D"]


@pytest.mark.slow
def test_pipeline_bubble_measures_each_schedule_against_the_formula_and_draws_a_step(tmp_path, monkeypatch, capsys):
    """The recorder's timings of the stages' passes become the table; the held activations need no timing at all:
    GPipe holds all M micro-batches at stage 0, 1F1B at most the 2 stages'."""
    plot = tmp_path / "pipeline_timeline.png"
    text = run_benchmark(monkeypatch, capsys, "pipeline_bubble.py", "--microbatches", 1, 2, "--batch_size", 8,
                         "--steps", 1, "--rounds", 1, "--chars", 6000, "--draw", 2, "--plot", plot)
    rows = re.findall(r"^\| (gpipe|1f1b) \| (\d) \| \d+ \| [\d.]+x \| \d+ \| \d+% \| \d+% \| (\d+)% \| "
                      r"(\d) \([\d.]+ MiB\) \| (\d) \([\d.]+ MiB\) \|$", text, re.M)
    assert rows == [("gpipe", "1", "50", "1", "1"), ("gpipe", "2", "33", "2", "2"), ("1f1b", "2", "33", "2", "1")], text
    assert plot.read_bytes().startswith(b"\x89PNG")


@pytest.mark.slow
def test_gpt_precision_compares_each_variant_with_fp32_from_real_runs(monkeypatch, capsys):
    """Two real runs of gpt.py (fp32, bf16) on a short text: a row each, and each ratio is its tokens/s over fp32's."""
    text = run_benchmark(monkeypatch, capsys, "gpt_precision.py", "--variants", "fp32", "bf16", "--epochs", 2,
                         "--chars", 6000, "--batch_size", 8)
    rows = {name: (float(rate.replace(",", "")), float(ratio)) for name, rate, ratio in
            re.findall(r"^\| (\S+) \| \d+ \| [\d,]+ \| ([\d,]+) \| ([\d.]+)x \| n/a \|$", text, re.M)}
    assert list(rows) == ["fp32", "bf16"], text
    assert rows["fp32"][1] == 1.0 and rows["bf16"][1] == pytest.approx(rows["bf16"][0] / rows["fp32"][0], abs=0.006)
