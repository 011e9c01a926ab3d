"""The benchmarks' reports, each on figures made up here (the table's rows, the ratios, the verdict on both sides of
its goal, the plot), and a few benchmarks run end to end with tiny settings, to show that what they measure is what
their reports read: torchrun jobs through harness/jobs with a worker killed (recovery.py and restarts.py, each its own
way), and workers started by spawned_result (pipeline_bubble.py: the recorder's timings of the stages' passes;
communication.py: CommDebugMode's counts and the ring's sends; context_parallel.py: the attention's counted scores and
its memory), and process_cost.py on the two imports (the CPU time of finished processes, also proven on a command
whose child burns a known amount). The figures themselves are the benchmarks' business, not the tests'."""
import importlib.util
import os
import re
import runpy
from argparse import Namespace

import pytest

from harness.jobs import PYTHON, REPO, run, script


def benchmark(name):
    """A benchmark script as a module: its functions, without running its main()."""
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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


def table_rows(text):
    """The lines of a markdown table's body in `text` (its header and rule left out)."""
    lines = [line for line in text.splitlines() if line.startswith("| ")]
    return lines[1:]


def is_png(path):
    return path.read_bytes().startswith(b"\x89PNG")


def test_scaling_reports_each_world_size_against_one_process_and_the_ceiling(tmp_path, capsys):
    plot = tmp_path / "scaling.png"
    one = dict(procs=1, ddp=1000.0, independent=1200.0, ddp_per_cpu_s=50.0, independent_per_cpu_s=60.0)
    two = dict(procs=2, ddp=1500.0, independent=2000.0, ddp_per_cpu_s=40.0, independent_per_cpu_s=58.0)
    benchmark("scaling").report({"cpu": [one, two]}, plot, "title")
    text = capsys.readouterr().out
    # speed-up 1500/1000, efficiency 1.5/2, ceiling 2000/1200, of ceiling 1.5/1.667, CPU per sample 58/40
    assert table_rows(text) == ["| 1 | 1,000 | 1.00x | 1.00 | 1,200 | 1.00x | 1.00 | 1.20x |",
                                "| 2 | 1,500 | 1.50x | 0.75 | 2,000 | 1.67x | 0.90 | 1.45x |"], text
    assert ("cpu: 2 processes reach 1.50x of one with DDP, 0.90 of the 1.67x that 2 independent processes reach on "
            "this machine; it spends 1.45x their CPU time per sample") in text
    assert is_png(plot)


def test_overhead_rows_and_the_verdict_on_the_worst_ratio():
    overhead = benchmark("overhead")
    assert overhead.row("synthetic", 0.00105, 0.001, 64) == "| synthetic | 64 | 1.000 | 1.050 | 1.050x |"
    assert overhead.verdict([1.08, 1.02]) == "worst ratio 1.080x (goal <= 1.10x): met"
    assert overhead.verdict([1.02, 1.2]) == "worst ratio 1.200x (goal <= 1.10x): NOT met"


def epoch_line(epoch):
    return f"[rank 0/2 | local 0 | cpu] epoch {epoch} | steps 32 | loss 1.000 | 1,024 samples/s"


def saved_line(epoch):
    return f"[rank 0/2 | local 0 | cpu] epoch {epoch} | snapshot saved to snapshot.pt"


@pytest.mark.parametrize("killed, resumed_from, lost", [
    # killed after epoch 5's line, 2.1 s after the snapshot of epoch 3: epochs 4 and 5 are trained again
    (7.2, 4, ["work lost    2 finished epoch(s) since the snapshot of epoch 3 (epochs 4-5) plus the one in progress, "
              "trained again:", "2.10 s of training between that snapshot and the kill"]),
    # killed right after the snapshot of epoch 3: only the epoch in progress is lost
    (5.2, 4, ["work lost    0 finished epoch(s) since the snapshot of epoch 3 plus the one in progress, trained again:",
              "0.10 s of training between that snapshot and the kill"]),
])
def test_recovery_reports_the_restart_against_the_cold_start_and_the_work_lost(capsys, killed, resumed_from, lost):
    timeline = [(2.0, 0, epoch_line(0)), (3.0, 0, epoch_line(1)), (3.1, 0, saved_line(1)), (4.0, 0, epoch_line(2)),
                (5.0, 0, epoch_line(3)), (5.1, 0, saved_line(3)), (6.0, 0, epoch_line(4)), (7.0, 0, epoch_line(5)),
                (9.0, 0, "[rank 0/2 | local 0 | cpu] resuming from epoch 4, restart 1"), (10.0, 0, epoch_line(4))]
    args = Namespace(nproc=2, epochs=10, save_every=2, kill_after=5)
    benchmark("recovery").report(args, timeline, killed, resumed_from, victim_rank=1, victim=4321, cold_step=1.0,
                                 cold_line=2.0, to_resume=1.8, to_step=2.5, to_line=3.3)
    text = capsys.readouterr().out
    assert ("torchrun --standalone --nproc_per_node=2 --max_restarts=1 multigpu_torchrun.py 10 2: rank 1 (pid 4321) "
            "SIGKILLed after epoch 5") in text
    for line in ["cold start   launch -> first training step           1.00 s   (-> first epoch line 2.00 s)",
                 "recovery     kill -> snapshot loaded (resume line)    1.80 s",
                 "             kill -> first resumed training step     2.50 s   (-> first epoch line 3.30 s)",
                 "ratio        recovery / cold start                    2.50", *lost]:
        assert line in text, (line, text)


def test_restarts_rows_and_the_summary_of_the_jobs_that_resumed():
    restarts = benchmark("restarts")
    assert restarts.row(0, 0.5, True, 3.26, [0], 0) == "| 0 | 0.50 s | yes | 3.3 s | [0] | 0 |"
    assert restarts.row(1, 0.25, False, None, [1], 3) == "| 1 | 0.25 s | NO | - | [1] | 3 |"
    jobs = [(0.5, True, 3.0, [0], 0), (0.2, False, None, [1], 2), (0.7, True, 6.0, [0], 0), (0.1, True, 4.0, [0], 0)]
    assert restarts.summary(jobs) == "resumed 3 of 4; kill -> resume median 4.0 s, max 6.0 s"
    assert restarts.summary(jobs[1:2]) == "resumed 0 of 1"


@pytest.mark.parametrize("gpus, label", [(0, "one process"), (2, "DataParallel")])
def test_dataparallel_against_ddp_reports_ddp_over_the_single_process(capsys, gpus, label):
    args = Namespace(workload="wide", batch_size=256, steps=30, warmup=5)
    benchmark("dataparallel_vs_ddp").report(args, gpus, 2, dataparallel=1000.0, ddp=1500.0)
    text = capsys.readouterr().out
    assert text.startswith("wide: global batch 256, 25 timed steps\n"), text
    one = "one process (DataParallel is a no-op without CUDA)" if not gpus else "DataParallel"
    assert re.search(rf"^  {re.escape(one)} +1,000 samples/s$", text, re.M), text
    assert re.search(r"^  DDP, 2 processes +1,500 samples/s$", text, re.M), text
    assert f"  DDP / {label}: 1.50x" in text


def test_gpt_scaling_reports_each_grad_accum_against_the_ceiling_and_the_goal(tmp_path, capsys):
    plot = tmp_path / "gpt_scaling.png"
    one = {1: dict(ddp=1000.0, independent=1200.0), 4: dict(ddp=900.0, independent=1200.0)}
    two = {1: dict(ddp=1500.0, independent=2280.0), 4: dict(ddp=1620.0, independent=2280.0)}
    benchmark("gpt_scaling").report({1: one, 2: two}, plot, "title")
    text = capsys.readouterr().out
    # K=1: 1.5x of the 1.9x ceiling = 0.79 of it; K=4: 1.8x of 1.9x = 0.95
    assert table_rows(text) == ["| 1 | 1 | 1,000 | 1.00x | 1,200 | 1.00x | 1.00 |",
                                "| 1 | 2 | 1,500 | 1.50x | 2,280 | 1.90x | 0.79 |",
                                "| 4 | 1 | 900 | 1.00x | 1,200 | 1.00x | 1.00 |",
                                "| 4 | 2 | 1,620 | 1.80x | 2,280 | 1.90x | 0.95 |"], text
    assert "--grad_accum 1: 2 processes deliver 0.79 of the 1.90x ceiling (goal >= 0.9): NOT met" in text
    assert "--grad_accum 4: 2 processes deliver 0.95 of the 1.90x ceiling (goal >= 0.9): met" in text
    assert is_png(plot)


def collective(kind, group, ranks, backward, mib, sent_mib=None):
    return dict(kind=kind, group=group, ranks=ranks, backward=backward, bytes=mib * 2**20,
                **({} if sent_mib is None else dict(sent=sent_mib * 2**20)))


def test_communication_counts_collectives_by_kind_group_and_pass_and_weighs_what_a_ring_sends():
    """A ring sends 2(n-1)/n of an all-reduce's buffer and (n-1)/n of an all-gather's or a reduce-scatter's, a
    point-to-point send all of its own, an all-to-all what it counted for the other ranks (not its buffer); a group of
    one rank sends nothing and is left out."""
    communication = benchmark("communication")
    results = {
        "DDP": dict(dp=4, tokens_per_s=1234.0, collectives=[collective("all-reduce", "all", 4, True, 4)] * 2),
        "TP": dict(dp=1, tokens_per_s=99.0, collectives=[collective("all-gather", "dp", 1, False, 8)]),
        "2D": dict(dp=2, tokens_per_s=5678.0, collectives=[
            collective("reduce-scatter", "dp", 2, True, 2), collective("all-gather", "dp", 2, False, 1),
            collective("all-reduce", "tp", 2, False, 1), collective("all-gather", "dp", 2, False, 1)]),
        "CP": dict(dp=1, tokens_per_s=4321.0, collectives=[collective("send/recv", "cp", 4, False, 0.5)] * 3 + [
            collective("all-reduce", "all", 4, True, 4)] + [collective("send/recv", "cp", 4, True, 0.5)] * 7),
        "EP": dict(dp=1, tokens_per_s=2345.0, collectives=[
            collective("all-to-all", "ep", 4, False, 1, sent_mib=0.75),
            collective("all-to-all", "ep", 4, False, 2, sent_mib=1.5),
            collective("all-reduce", "all", 4, True, 2), collective("all-reduce", "dp", 1, True, 8),
            collective("all-to-all", "ep", 4, True, 2, sent_mib=1.25)]),
    }
    assert table_rows(communication.table(communication.summary(results, world_size=4))) == [
        "| DDP | dp 4 x tp 1 | 2 all-reduce over all (bwd) | 12.00 (all) | 1,234 |",
        "| TP | dp 1 x tp 4 | none | 0 | 99 |",
        "| 2D | dp 2 x tp 2 | 2 all-gather over dp (fwd), 1 all-reduce over tp (fwd), 1 reduce-scatter over dp (bwd) "
        "| 2.00 (dp) + 1.00 (tp) | 5,678 |",
        # 10 sends of 0.5 MiB, each sent whole
        "| CP | dp 1 x cp 4 | 3 send/recv over cp (fwd), 1 all-reduce over all (bwd), 7 send/recv over cp (bwd) "
        "| 6.00 (all) + 5.00 (cp) | 4,321 |",
        # 0.75 + 1.5 + 1.25 MiB sent by the all-to-alls; the experts' all-reduce over a dp of one rank left out
        "| EP | dp 1 x ep 4 | 2 all-to-all over ep (fwd), 1 all-reduce over all (bwd), 1 all-to-all over ep (bwd) "
        "| 3.00 (all) + 3.50 (ep) | 2,345 |"]


def passes(*spans):
    """A step's events from (stage, 'F' or 'B', micro-batch, began, ended) in hundredths of a second; each forward
    keeps 1 MiB for its backward."""
    return [dict(stage=stage, microbatch=microbatch, began=began / 100, ended=ended / 100, saved=2**20,
                 **{"pass": "forward" if kind == "F" else "backward"})
            for stage, kind, microbatch, began, ended in spans]


def test_pipeline_bubble_reports_the_fastest_step_of_each_schedule_against_the_formula(tmp_path, capsys):
    """GPipe holds all M micro-batches at stage 0, 1F1B at most the 2 stages'; a slower step of a configuration is
    not the one reported."""
    gpipe_1 = passes((0, "F", 0, 0, 1), (1, "F", 0, 1, 2), (1, "B", 0, 2, 3), (0, "B", 0, 3, 4))
    gpipe_2 = passes((0, "F", 0, 0, 1), (0, "F", 1, 1, 2), (1, "F", 0, 1, 2), (1, "F", 1, 2, 3), (1, "B", 0, 3, 4),
                     (1, "B", 1, 4, 5), (0, "B", 0, 4, 5), (0, "B", 1, 5, 6))
    slow_gpipe_2 = [dict(event, began=2 * event["began"], ended=2 * event["ended"]) for event in gpipe_2]
    one_f_one_b_2 = passes((0, "F", 0, 0, 1), (0, "F", 1, 1, 2), (1, "F", 0, 1, 2), (1, "B", 0, 2, 3),
                           (0, "B", 0, 3, 4), (1, "F", 1, 3, 4), (1, "B", 1, 4, 5), (0, "B", 1, 5, 7))
    measured = [("1f1b", 2, {5: one_f_one_b_2}), ("gpipe", 2, {3: slow_gpipe_2, 4: gpipe_2}),
                ("gpipe", 1, {2: gpipe_1})]
    plot = tmp_path / "pipeline_timeline.png"
    benchmark("pipeline_bubble").report(measured, 2, plot)
    text = capsys.readouterr().out
    assert table_rows(text) == [
        "| gpipe | 1 | 40 | 1.00x | 20 | 50% | 50% | 50% | 1 (1.0 MiB) | 1 (1.0 MiB) |",
        "| gpipe | 2 | 60 | 1.50x | 40 | 33% | 33% | 33% | 2 (2.0 MiB) | 2 (2.0 MiB) |",
        "| 1f1b | 2 | 70 | 1.75x | 45 | 29% | 43% | 33% | 2 (2.0 MiB) | 1 (1.0 MiB) |"], text
    assert "gpipe: mean idle M=1 50% (formula 50%), M=2 33% (formula 33%)" in text
    assert "1f1b: mean idle M=2 36% (formula 33%)" in text
    assert is_png(plot)


def test_gpt_precision_reports_each_variant_against_fp32(capsys):
    gpt_precision = benchmark("gpt_precision")
    rows = {"fp32": dict(seconds=40.2, first=900.0, best=1000.0, mfu=None),
            "bf16": dict(seconds=80.0, first=400.0, best=500.0, mfu=None)}
    gpt_precision.report(rows, 0, Namespace(batch_size=32, chars=100_000))
    text = capsys.readouterr().out
    assert "CPU, 1 process(es), batch 32, 100,000 characters:" in text
    assert table_rows(text) == ["| fp32 | 40 | 900 | 1,000 | 1.00x | n/a |", "| bf16 | 80 | 400 | 500 | 0.50x | n/a |"]


def gpt_epoch_line(epoch, rate, mfu=None):
    return (f"[rank 0/1 | local 0 | cuda:0] epoch {epoch} | steps 10 | loss 2.000 | {rate} tokens/s"
            + (f" | MFU {mfu}%" if mfu else ""))


@pytest.mark.parametrize("mfu", [None, ("12.5", "20.5", "31.0")])
def test_gpt_precision_sets_epoch_0_apart_and_takes_the_fastest_later_epoch(mfu):
    """What gpt.py prints (its epoch lines, as output.EPOCH reads them): epoch 0 pays for what starts once."""
    mfus = mfu or (None, None, None)
    printed = "\n".join(gpt_epoch_line(epoch, rate, mfus[epoch])
                        for epoch, rate in enumerate(["9,000", "11,000", "10,000"]))
    assert benchmark("gpt_precision").figures(42.0, printed) == dict(seconds=42.0, first=9000.0, best=11000.0,
                                                                     mfu=31.0 if mfu else None)

def test_gpt_precision_without_fp32_compares_with_the_first_variant_and_shows_the_mfu(capsys):
    rows = {"bf16": dict(seconds=30.0, first=1000.0, best=2000.0, mfu=41.23),
            "bf16+compile": dict(seconds=90.0, first=500.0, best=3000.0, mfu=61.0)}
    benchmark("gpt_precision").report(rows, 1, Namespace(batch_size=32, chars=100_000))
    text = capsys.readouterr().out
    assert "GPU, 1 process(es), batch 32, 100,000 characters:" in text
    assert table_rows(text) == ["| bf16 | 30 | 1,000 | 2,000 | 1.00x | 41.2% |",
                                "| bf16+compile | 90 | 500 | 3,000 | 1.50x | 61.0% |"]


def test_process_cost_reports_each_command_and_what_a_rank_and_the_launcher_add(capsys):
    process_cost = benchmark("process_cost")
    process_cost.report({"import_torch": [2.0, 2.2, 1.9], "import_dynamo": [3.5, 3.4, 3.6],
                         "torchrun_1": [5.0, 5.2, 4.8], "torchrun_2": [8.9, 8.4, 8.5]})
    text = capsys.readouterr().out
    assert table_rows(text)[0] == "| import_torch | a process that imports torch and ends | 2.00 | 3 (1.90 - 2.20) |"
    # medians: dynamo 3.5 - 2.0; a rank 8.5 - 5.0; the launcher 5.0 - 3.5
    assert "importing torch._dynamo after torch: 1.50 s" in text
    assert "one more DDP rank (torchrun_2 - torchrun_1): 3.50 s" in text
    assert "the torchrun launcher (torchrun_1 - that rank): 1.50 s" in text


@pytest.mark.slow  # python processes, but no torch: a fraction of a second
def test_process_cost_counts_the_cpu_of_a_command_and_of_the_processes_it_waits_for():
    burn = "import time\nend = time.process_time() + 0.3\nwhile time.process_time() < end: pass"
    parent = f"import subprocess, sys\n{burn}\nsubprocess.run([sys.executable, '-c', {burn!r}], check=True)"
    seconds = benchmark("process_cost").cpu_seconds([PYTHON, "-c", parent])
    assert 0.6 <= seconds < 1.5, seconds  # 0.3 s in the command, 0.3 s in its child, and two interpreter starts


@pytest.mark.parametrize("seconds, held_out, known, met", [
    (80.4, 1.5, 0.5, dict.fromkeys(["time", "held-out loss", "words"], True)),
    (95.0, 2.0, None, dict.fromkeys(["time", "held-out loss", "words"], False)),
    (90.0, 1.8, 0.25, {"time": True, "held-out loss": True, "words": False}),
])
def test_gpt_learns_reports_each_goal_met_or_not(capsys, seconds, held_out, known, met):
    assert benchmark("gpt_learns").report(10, 120, seconds, held_out, 4.2, "the word\nof it\n", known) == met
    text = capsys.readouterr().out
    assert f"held-out loss {held_out:.3f} (untrained: 4.200)" in text
    assert "sample:\n  | the word\n  | of it\n" in text
    known_line = "none written" if known is None else f"{known:.0%}"
    assert f"words of 3+ letters that are words of the text: {known_line}\n" in text
    verdicts = ", ".join(f"{name} {'met' if ok else 'NOT met'}" for name, ok in met.items())
    assert f"goals (within 90 s, held-out <= 1.8, >= a third of the words real): {verdicts}" in text


# End to end: what the benchmarks measure is what their reports read.

def test_gpt_heads_reports_the_last_held_out_loss_of_each_head_count(capsys):
    curves = {6: {50: (2.9, 2.88), 100: (2.7, 2.55)}, 8: {50: (2.8, 2.84), 100: (2.6, 2.50)}}
    assert benchmark("gpt_heads").report(curves) == {6: 2.55, 8: 2.50}
    assert "held-out loss after 100 steps: 6 heads 2.5500, 8 heads 2.5000 (8 minus 6: -0.0500)" in \
        capsys.readouterr().out


@pytest.mark.slow  # no process, but two GPU-size GPTs trained on the CPU: seconds
def test_gpt_heads_trains_both_head_counts_from_the_same_weights_on_the_same_batches(monkeypatch, capsys):
    printed = run_benchmark(monkeypatch, capsys, "gpt_heads.py", "--steps", 1, "--batch_size", 1, "--eval", 1)
    first = dict(re.findall(r"^(\d) heads of \d+: step 1 \| training loss ([\d.]+)", printed, re.M))
    assert set(first) == {"6", "8"} and abs(float(first["6"]) - float(first["8"])) < 0.05, printed
    assert re.search(r"held-out loss after 1 steps: 6 heads [\d.]+, 8 heads [\d.]+ \(8 minus 6: [-+][\d.]+\)",
                     printed), printed


@pytest.mark.slow
def test_recovery_times_a_real_kill_against_a_cold_start(monkeypatch, capsys):
    """A torchrun job through harness/jobs, its worker SIGKILLed and resumed by torchrun: the timeline and the moments
    measure() takes are the ones report() reads."""
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
def test_restarts_counts_a_real_killed_job_that_resumes(monkeypatch, capsys):
    """restarts.py kills its own way (a random part of an epoch after the first snapshot, the job's exit codes and
    gloo's errors counted): what one_kill() returns is what row() and summary() read."""
    text = run_benchmark(monkeypatch, capsys, "restarts.py", "--kills", 1, "--epochs", 3, "--nproc", 1,
                         "--timeout", 60)
    assert re.search(r"^1 jobs, 1 node\(s\), torchrun's shared store", text, re.M), text
    assert re.search(r"^\| 0 \| [\d.]+ s \| yes \| [\d.]+ s \| \[0\] \| \d+ \|$", text, re.M), text
    assert re.search(r"^resumed 1 of 1; kill -> resume median [\d.]+ s", text, re.M), text

@pytest.mark.slow
def test_pipeline_bubble_reads_the_recorders_timings_of_the_spawned_stages(tmp_path, monkeypatch, capsys):
    """Workers started by spawned_result, the recorder timing their passes: the step numbers the workers send back
    are the recorder's, so each configuration gets its own steps. Held activations need no timing at all: GPipe holds
    all M micro-batches at stage 0, 1F1B at most the 2 stages'."""
    plot = tmp_path / "pipeline_timeline.png"
    text = run_benchmark(monkeypatch, capsys, "pipeline_bubble.py", "--microbatches", 2, "--batch_size", 4,
                         "--steps", 1, "--rounds", 1, "--chars", 6000, "--draw", 2, "--plot", plot)
    rows = re.findall(r"^\| (gpipe|1f1b) \| (\d) \| \d+ \| [\d.]+x \| \d+ \| \d+% \| \d+% \| (\d+)% \| "
                      r"(\d) \([\d.]+ MiB\) \| (\d) \([\d.]+ MiB\) \|$", text, re.M)
    assert rows == [("gpipe", "2", "33", "2", "2"), ("1f1b", "2", "33", "2", "1")], text
    assert is_png(plot)


@pytest.mark.slow
def test_communication_counts_each_layouts_collectives_per_optimizer_step(tmp_path):
    """4 processes, the CPU-size GPT (2 blocks): TP all-reduces activations twice per block in the forward (after
    attention and after the MLP) and twice in the backward (at their inputs); FSDP gathers each of its 4 units
    (embedding, 2 blocks, head) before the forward and the backward and reduce-scatters them; DDP only all-reduces.
    CP's ring of 4, in each block's attention: 3 sends of a block of keys and values in the forward (each rank's block
    visits the 3 others), 3 again in the backward and 3 of their gradients (a partial sum from the rank after the
    block's owner around to the owner), on top of DDP's all-reduce. A block: K and V of 16 sequences x 4 heads x 16
    positions x 16 dimensions in float32, 0.125 MiB, and its gradients as much (float32); 18 of them are 2.25 MiB.
    EP, the mixture-of-experts GPT (2 MoE layers): in each layer's forward one all-reduce of its tokens per expert over
    all ranks and three all-to-alls over ep (the counts, the tokens, the outputs back), in its backward two (the
    tokens' gradients both ways), whatever the routing; what they send depends on it, but is more than nothing. The
    rest's DDP all-reduces less than the whole MoE GPT's DDP (MoE DDP): the experts are not in it. EP 2D adds each
    layer's experts' all-reduce over dp 2; EP's, over a dp of one rank, sends nothing.
    A job of its own, not run_benchmark: notebooks/07_tensor_parallel.ipynb runs the same one, so in a test session
    it runs once (shared)."""
    text = run([PYTHON, script("benchmarks/communication.py"), "--steps", 1, "--rounds", 1, "--chars", 20000],
               cwd=tmp_path, timeout=300, shared=True).output
    rows = {row[0]: row[1:] for row in re.findall(
        r"^\| (\w+(?: \w+)?) \| (dp \d x (?:tp|cp|ep) \d) \| (.+?) \| (.+?) \| ([\d,]+) \|$", text, re.M)}
    assert list(rows) == ["DDP", "FSDP", "TP", "2D", "CP", "MoE DDP", "EP", "EP 2D"], text
    assert [mesh for mesh, *_ in rows.values()] == ["dp 4 x tp 1", "dp 4 x tp 1", "dp 1 x tp 4", "dp 2 x tp 2",
                                                    "dp 1 x cp 4", "dp 4 x ep 1", "dp 1 x ep 4", "dp 2 x ep 2"]
    assert re.fullmatch(r"\d all-reduce over all \(bwd\)", rows["DDP"][1]), rows["DDP"]
    fsdp = "4 all-gather over dp (fwd), 4 all-gather over dp (bwd), 4 reduce-scatter over dp (bwd)"
    tp = "4 all-reduce over tp (fwd), 4 all-reduce over tp (bwd)"
    assert rows["FSDP"][1] == fsdp and rows["TP"][1] == tp, text
    assert rows["2D"][1] == ("4 all-gather over dp (fwd), 4 all-reduce over tp (fwd), 4 all-gather over dp (bwd), "
                             "4 all-reduce over tp (bwd), 4 reduce-scatter over dp (bwd)"), text
    assert re.fullmatch(r"[\d.]+ \(dp\) \+ [\d.]+ \(tp\)", rows["2D"][2]), rows["2D"]
    assert re.fullmatch(r"6 send/recv over cp \(fwd\), \d all-reduce over all \(bwd\), 12 send/recv over cp \(bwd\)",
                        rows["CP"][1]), rows["CP"]
    assert re.fullmatch(r"[\d.]+ \(all\) \+ 2\.25 \(cp\)", rows["CP"][2]), rows["CP"]
    assert re.fullmatch(r"\d all-reduce over all \(bwd\)", rows["MoE DDP"][1]), rows["MoE DDP"]
    ep = ("2 all-reduce over all (fwd), 6 all-to-all over ep (fwd), 1 all-reduce over all (bwd), {}"
          "4 all-to-all over ep (bwd)")
    assert rows["EP"][1] == ep.format("") and rows["EP 2D"][1] == ep.format("2 all-reduce over dp (bwd), "), text
    whole = float(re.fullmatch(r"([\d.]+) \(all\)", rows["MoE DDP"][2])[1])
    for layout, groups in [("EP", r"\(all\) \+ "), ("EP 2D", r"\(all\) \+ [\d.]+ \(dp\) \+ ")]:
        rest, tokens = map(float, re.fullmatch(rf"([\d.]+) {groups}([\d.]+) \(ep\)", rows[layout][2]).groups())
        assert 0 < rest < whole and tokens > 0, rows[layout]
    assert "depend on the routing (data-dependent)" in text


def attention_rank(scores, ms, saved_mib, kv_mib, peak_mib):
    return dict(scores=scores, cpu=ms / 1e3, saved=saved_mib * 2**20, kv=kv_mib * 2**20, peak=peak_mib * 2**20)


def test_context_parallel_reports_each_ranks_share_and_the_last_ranks_against_the_first_at_the_largest_cp():
    """Per rank its scores and CPU time, max/min over the ranks, the memory of the rank with the most; the imbalance
    line reads the ring's rows of the largest cp only."""
    context_parallel = benchmark("context_parallel")
    rows = [dict(exchange="ring", split="balanced", cp=1, step=0.0504, ranks=[attention_rank(0.75, 50.0, 4, 2, 26)]),
            dict(exchange="ring", split="contiguous", cp=2, step=0.06, ranks=[
                attention_rank(0.25, 20.0, 2, 2, 9), attention_rank(0.5, 50.0, 2.5, 1, 23)]),
            dict(exchange="all-gather", split="balanced", cp=2, step=0.03, ranks=[
                attention_rank(0.5, 20.0, 5, 4, 7), attention_rank(0.5, 21.0, 5, 4, 7)])]
    assert table_rows(context_parallel.table(rows)) == [
        "| ring | balanced | 1 | 75.0% | 50.0 | 1.00 | 50.4 | 4.00 | 2.00 | 26.00 |",
        "| ring | contiguous | 2 | 25.0% / 50.0% | 20.0 / 50.0 | 2.50 | 60.0 | 2.50 | 2.00 | 23.00 |",
        "| all-gather | balanced | 2 | 50.0% / 50.0% | 20.0 / 21.0 | 1.05 | 30.0 | 5.00 | 4.00 | 7.00 |"]
    assert context_parallel.imbalance(rows) == ("contiguous split at cp 2: the last rank computes 2.00x the first's "
                                                "scores in 2.50x its CPU time")


def test_context_parallel_reports_the_rings_sends_per_pass_and_the_error_of_its_gradients():
    """The traffic table: sends and MiB of each pass, the most of any rank, and backward's bytes over forward's; the
    precision table: each gradient's relative error in %, cp 1 sending nothing, the error of one rounding under it."""
    context_parallel = benchmark("context_parallel")
    mib = 2**20
    traffic = [dict(cp=2, dtype="bfloat16",
                    ranks=[dict(block=mib / 2, forward=[mib / 2], backward=[mib / 2, mib])] * 2),
               dict(cp=4, dtype="float32", ranks=[dict(block=mib / 2, forward=[mib / 2] * 3, backward=[mib / 2] * 6),
                                                  dict(block=mib / 2, forward=[mib / 2] * 3, backward=[mib / 2] * 7)])]
    assert table_rows(context_parallel.traffic_table(traffic)) == [
        "| 2 | bfloat16 | 0.500 | 1 | 0.500 | 2 | 1.500 | 3.00 |",
        "| 4 | float32 | 0.500 | 3 | 1.500 | 7 | 3.500 | 2.33 |"]
    precision = [dict(cp=1, transit="float32", ring=[0.0016, 0.0017, 0.0015], rounded=[0.0016, 0.0016, 0.0015]),
                 dict(cp=4, transit="bfloat16", ring=[0.0016, 0.0023, 0.0021], rounded=[0.0016, 0.0016, 0.0015])]
    text = context_parallel.precision_table(precision)
    assert table_rows(text) == ["| 1 | not sent | 0.160% | 0.170% | 0.150% |",
                                "| 4 | bfloat16 | 0.160% | 0.230% | 0.210% |"]
    assert text.splitlines()[-1] == "the exact gradients rounded to bfloat16 once: dQ 0.160%, dK 0.160%, dV 0.150%"


@pytest.mark.slow
def test_context_parallel_counts_each_ranks_scores_and_the_memory_of_either_exchange(monkeypatch, capsys):
    """4 spawned workers, 512 tokens, 4 heads of 64. By construction: the ring's chunk pairs (the balanced split gives
    every rank 2cp+1 chunk pairs of (T/2cp)^2 scores, the contiguous one rank r r+1 pairs of (T/cp)^2), the all-gather's
    (T/cp) x T rectangle; the ring saves T/cp of q, k, v and output, whatever the split; the all-gather saves the whole
    K and V (1 MiB here) and holds them twice at once (gathered and reordered), where the ring holds a few blocks of
    T/cp. Timing only loosely: the contiguous split's last rank, with 4x the first's scores, spends more CPU time.
    The ring's sends, counted: cp - 1 blocks forward; backward cp - 1 blocks and cp - 1 of their gradients in float32.
    Its gradients with bfloat16 inputs: those of keys and values no further off sent in float32 than in bfloat16."""
    text = run_benchmark(monkeypatch, capsys, "context_parallel.py", "--context", 512, "--rounds", 3)
    number = r"([\d.]+)"
    rows = {(exchange, split, int(cp)): dict(scores=scores, cpu=[float(ms) for ms in times.split(" / ")],
                                             **dict(zip(["ratio", "step", "saved", "kv", "peak"], map(float, rest))))
            for exchange, split, cp, scores, times, *rest in re.findall(
                rf"^\| (ring|all-gather) \| (balanced|contiguous) \| (\d) \| ([\d.%/ ]+) \| ([\d./ ]+) \| "
                rf"{number} \| {number} \| {number} \| {number} \| {number} \|$", text, re.M)}
    assert list(rows) == [(exchange, split, cp) for cp in (1, 2, 4) for exchange, split in
                          [("ring", "balanced"), ("ring", "contiguous"), ("all-gather", "balanced")]], text
    assert {key: row["scores"] for key, row in rows.items()} == {
        ("ring", "balanced", 1): "75.0%", ("ring", "contiguous", 1): "100.0%", ("all-gather", "balanced", 1): "100.0%",
        ("ring", "balanced", 2): "31.2% / 31.2%", ("ring", "contiguous", 2): "25.0% / 50.0%",
        ("all-gather", "balanced", 2): "50.0% / 50.0%", ("ring", "balanced", 4): " / ".join(["14.1%"] * 4),
        ("ring", "contiguous", 4): "6.2% / 12.5% / 18.8% / 25.0%", ("all-gather", "balanced", 4): " / ".join(
            ["25.0%"] * 4)}, text
    times = rows["ring", "contiguous", 4]["cpu"]
    assert len(times) == 4 and times[-1] > times[0], text
    for cp in (1, 2, 4):  # saved MiB: the ring's 4 x 0.5 / cp (and a log-sum-exp per query), the all-gather's more
        ring, contiguous, gathered = (rows[exchange, split, cp]["saved"] for exchange, split in [
            ("ring", "balanced"), ("ring", "contiguous"), ("all-gather", "balanced")])
        assert ring == contiguous and ring == pytest.approx(2 / cp, abs=0.01) and gathered > 1.0, text
    ring_kv, gathered_kv = rows["ring", "balanced", 4]["kv"], rows["all-gather", "balanced", 4]["kv"]
    assert gathered_kv >= 2.0 and ring_kv <= 4 * 0.25 < gathered_kv, text  # the ring's blocks: 0.25 MiB each
    assert re.search(r"^balanced split at cp 4: the last rank computes 1\.00x the first's scores in [\d.]+x its CPU "
                     r"time; contiguous split at cp 4: the last rank computes 4\.00x the first's scores in [\d.]+x its "
                     r"CPU time$", text, re.M), text
    # The ring's sends: a block is 2 x 4 heads x 512/cp x 64 numbers; forward sends cp - 1 of them, backward cp - 1
    # again and cp - 1 of their gradients, in float32.
    traffic = {(int(cp), dtype): tuple(map(float, rest)) for cp, dtype, *rest in re.findall(
        r"^\| (\d) \| (float32|bfloat16) \| ([\d.]+) \| (\d+) \| ([\d.]+) \| (\d+) \| ([\d.]+) \| ([\d.]+) \|$",
        text, re.M)}
    assert list(traffic) == [(cp, dtype) for cp in (2, 4) for dtype in ("float32", "bfloat16")], text
    for (cp, dtype), (block, sends, forward, backward_sends, backward, ratio) in traffic.items():
        size = {"float32": 4, "bfloat16": 2}[dtype]
        assert block == pytest.approx(2 * 4 * 512 // cp * 64 * size / 2**20, abs=1e-3), text
        assert (sends, backward_sends) == (cp - 1, 2 * (cp - 1)), text
        assert forward == pytest.approx((cp - 1) * block, abs=2e-3), text
        assert backward == pytest.approx((cp - 1) * block * (1 + 4 / size), abs=2e-3), text
        assert ratio == pytest.approx(1 + 4 / size, abs=0.01), text
    # The gradients: dQ never travels, so its error is the same whatever dK and dV travel in; sent in float32, dK and
    # dV are no further off than sent in bfloat16 (seeded inputs: the same numbers on every run).
    errors = {(int(cp), transit): [float(error) for error in rest] for cp, transit, *rest in re.findall(
        r"^\| (\d) \| (not sent|float32|bfloat16) \| ([\d.]+)% \| ([\d.]+)% \| ([\d.]+)% \|$", text, re.M)}
    assert list(errors) == [(1, "not sent"), (2, "float32"), (2, "bfloat16"), (4, "float32"), (4, "bfloat16")], text
    for cp in (2, 4):
        assert errors[cp, "float32"][0] == errors[cp, "bfloat16"][0], text
        assert all(f32 <= bf16 for f32, bf16 in zip(errors[cp, "float32"][1:], errors[cp, "bfloat16"][1:])), text
    assert re.search(r"^the exact gradients rounded to bfloat16 once: dQ [\d.]+%, dK [\d.]+%, dV [\d.]+%$", text,
                     re.M), text


def test_overhead_times_the_trainer_and_the_bare_loop_in_this_process(monkeypatch, capsys):
    """single_gpu.py's Trainer as the step runs it, against the bare loop: the table's row and the verdict on it."""
    text = run_benchmark(monkeypatch, capsys, "overhead.py", "--workloads", "synthetic", "--rounds", 1,
                         "--min_seconds", 0)
    ratios = re.findall(r"^\| synthetic \| 64 \| [\d.]+ \| [\d.]+ \| ([\d.]+)x \|$", text, re.M)
    assert len(ratios) == 1, text
    assert re.search(rf"^worst ratio {re.escape(ratios[0])}x \(goal <= 1.10x\): (met|NOT met)$", text, re.M), text


@pytest.mark.slow
def test_gpt_scaling_trains_gpt_pys_trainer_in_spawned_workers(tmp_path, monkeypatch, capsys):
    """One spawned worker training gpt.py's Trainer (its options as gpt.py's parser gives them) and the loop without
    DDP, for each K: the rows and the verdict come from what the worker measured."""
    plot = tmp_path / "gpt_scaling.png"
    text = run_benchmark(monkeypatch, capsys, "gpt_scaling.py", "--max_procs", 1, "--rounds", 1, "--grad_accum", 1, 2,
                         "--chars", 3000, "--batch_size", 4, "--plot", plot)
    rows = re.findall(r"^\| (\d) \| (\d) \| [\d,]+ \| 1.00x \| [\d,]+ \| 1.00x \| 1.00 \|$", text, re.M)
    assert rows == [("1", "1"), ("2", "1")], text
    assert "--grad_accum 2: 1 processes deliver 1.00 of the 1.00x ceiling (goal >= 0.9): met" in text
    assert is_png(plot)


@pytest.mark.slow
def test_scaling_trains_the_steps_trainers_in_a_spawned_worker(tmp_path, monkeypatch, capsys):
    """multigpu.py's and single_gpu.py's Trainers in one spawned worker: its figures are the row report() reads."""
    plot = tmp_path / "scaling.png"
    text = run_benchmark(monkeypatch, capsys, "scaling.py", "--devices", "cpu", "--max_procs", 1, "--rounds", 1,
                         "--workload", "synthetic", "--plot", plot)
    assert re.search(r"^\| 1 \| [\d,]+ \| 1.00x \| 1.00 \| [\d,]+ \| 1.00x \| 1.00 \| [\d.]+x \|$", text, re.M), text
    assert is_png(plot)


@pytest.mark.slow
def test_dataparallel_against_ddp_measures_both_for_real_on_a_cpu(monkeypatch, capsys):
    """The measuring glue against the current steps and torch: one process, then DDP's spawned pair."""
    text = run_benchmark(monkeypatch, capsys, "dataparallel_vs_ddp.py", "--workload", "synthetic", "--steps", 3,
                         "--warmup", 1, "--batch_size", 64)
    assert "No CUDA device: DataParallel does nothing here" in text, text
    assert re.search(r"DDP, 2 processes +[\d,]+ samples/s", text) and re.search(r"DDP / one process: [\d.]+x", text)


@pytest.mark.slow
def test_gpt_precision_reads_a_real_run_of_gpt_py(monkeypatch, capsys):
    """One real torchrun job of gpt.py (fp32, 2 epochs on a short text): its epoch lines become the row."""
    text = run_benchmark(monkeypatch, capsys, "gpt_precision.py", "--variants", "fp32", "--epochs", 2,
                         "--chars", 6000, "--batch_size", 8)
    assert re.search(r"^\| fp32 \| \d+ \| [\d,]+ \| [\d,]+ \| 1\.00x \| n/a \|$", text, re.M), text


@pytest.mark.slow
def test_process_cost_measures_the_imports_for_real(monkeypatch, capsys):
    text = run_benchmark(monkeypatch, capsys, "process_cost.py", "--repeats", 1, "--only", "import_torch",
                         "import_dynamo")
    rows = {row.split(" | ")[0][2:]: float(row.split(" | ")[2]) for row in table_rows(text)}
    assert rows.keys() == {"import_torch", "import_dynamo"}, text
    assert 0.3 < rows["import_torch"] < rows["import_dynamo"], text  # torch._dynamo comes on top of torch
    assert re.search(r"^importing torch\._dynamo after torch: [\d.]+ s$", text, re.M), text


def test_init_weights_times_what_a_rank_draws_and_rates_it_per_weight_of_the_whole_model(monkeypatch, capsys):
    """The CPU and GPU sizes, one round each (the 1B width's draws take seconds): each row counts the whole model's
    weights (a rank draws them all, whatever it holds) and the 8b line extrapolates the last rate."""
    import torch

    from tools.memory_plan import config_of
    from utils.gpt import GPT

    printed = run_benchmark(monkeypatch, capsys, "init_weights.py", "--sizes", "cpu", "gpu", "--rounds", 1)
    with torch.device("meta"):
        whole = {size: sum(param.numel() for param in GPT(config_of(size), "").parameters())
                 for size in ("cpu", "gpu", "8b")}
    rows = dict(re.findall(r"^ +(cpu|gpu) +([\d,]+) +[\d.]+ +[\d.]+$", printed, re.M))
    assert rows == {size: f"{whole[size]:,}" for size in ("cpu", "gpu")}, printed
    assert re.search(rf"^at [\d.]+ ns a weight \(gpu's rate\), the 8b width's {whole['8b']:,} weights take \d+ s on "
                     r"every rank; a seed checkpoint draws none$", printed, re.M), printed


def figure(text):
    """A printed figure as a float (its thousands' commas left out)."""
    return float(text.replace(",", ""))


@pytest.mark.slow
def test_long_run_reads_its_jobs_windows_its_rounds_and_each_files_memory(monkeypatch, capsys):
    """Five torchrun jobs of long_run.py (a line every 2 of 6 steps: the window of steps 2-4 alone is measured), the
    reads of part 1 and of the dp ranks' shares in this process, and a spawned reader per token file: every row of the
    tables is what those printed (a job's fastest window, the fastest read round) or follows from it, the jobs wrote
    the snapshots their command asks for, each of 4 dp ranks read its 2 rows of a global batch of 8 and no more, and no
    page of a file stays in the reading process after its reads."""
    text = run_benchmark(monkeypatch, capsys, "long_run.py", "--source", "help", "--base_chars", 60000, "--multiples",
                         1, 2, "--global_batch", 8, "--steps", 6, "--log_every", 2, "--job_rounds", 1,
                         "--read_batches", 4, "--rounds", 2, "--memory_steps", 3, "--dp", 4)
    jobs = {}
    for workers, every, mode, seconds, saved, size, measured in re.findall(
            r"^job: --workers (\d), a snapshot every (\d+) steps, (sync|async) \(round 0\)\n  \$ .*\n  ([\d.]+) s; "
            r"(\d+) snapshots written, the last ([\d.]+) MiB; windows \(steps: ms/step, tokens/s\): (.*)$", text, re.M):
        windows = re.findall(r"(\d+)-(\d+): ([\d.]+), ([\d,]+)", measured)
        jobs[int(workers), int(every), mode] = dict(seconds=seconds, saved=int(saved), size=size, windows=windows)
    assert set(jobs) == {(0, 1000, "sync"), (2, 1000, "sync"), (0, 1, "sync"), (0, 1000, "async"), (0, 1, "async")}
    for (_, every, _), job in jobs.items():
        assert [window[:2] for window in job["windows"]] == [("2", "4")], (job, text)
        assert job["saved"] == (6 if every == 1 else 1), (job, text)
    # A job's one window: its ms/step and its tokens/s, as printed.
    step = {key: job["windows"][0][2:] for key, job in jobs.items()}
    base_ms, base_rate = step[0, 1000, "sync"]

    # Part 1: the fastest read round of each source against the --workers 0 job's step.
    rounds = re.search(r"^read rounds, ms per global batch: memory-mapped ([\d., ]+); in memory ([\d., ]+)$", text,
                       re.M)
    mapped, in_memory = ([float(ms) for ms in group.split(", ")] for group in rounds.groups())
    assert len(mapped) == len(in_memory) == 2, text
    reads = {name: (float(ms), float(share)) for name, ms, share in re.findall(
        r"^\| Shares over the (memory-mapped TokenFile|same rows in memory) \| ([\d.]+) \| ([\d.]+)% \|$", text, re.M)}
    assert reads.keys() == {"memory-mapped TokenFile", "same rows in memory"}, text
    assert (reads["memory-mapped TokenFile"][0], reads["same rows in memory"][0]) == (min(mapped), min(in_memory))
    assert f"| a training step (job: --workers 0, a snapshot every 1000 steps, sync) | {base_ms} | 100.00% |" in text
    for ms, share in reads.values():
        assert share == pytest.approx(100 * ms / float(base_ms), abs=0.006), text
    rates = {int(workers): (rate, float(ratio)) for workers, rate, ratio in re.findall(
        r"^\| --workers (\d), memory-mapped file \| ([\d,]+) \| ([\d.]+)x \|$", text, re.M)}
    assert rates.keys() == {0, 2}, text
    for workers, (rate, ratio) in rates.items():
        assert rate == step[workers, 1000, "sync"][1], text
        assert ratio == pytest.approx(figure(rate) / figure(base_rate), abs=0.006), text
    estimate = re.search(r"^\| --workers 0, rows in memory \(estimated: .*\) \| ([\d,]+) \| [\d.]+x \|$", text, re.M)
    expected = figure(base_rate) * float(base_ms) / (float(base_ms) - min(mapped) + min(in_memory))
    assert figure(estimate[1]) == pytest.approx(expected, rel=1e-3, abs=1), text

    # The shares: a rank reads global_batch / dp rows of each global batch (130 bytes each: 65 uint16 ids), and the
    # job each row once.
    table = re.findall(r"^\| (\d+) \| ([\d,]+) \| ([\d,]+) \| ([\d,]+) \| ([\d.]+) \|$", text, re.M)
    assert {int(dp): (figure(rows), figure(size), figure(job)) for dp, rows, size, job, _ in table} == {
        1: (8, 8 * 130, 8), 4: (2, 2 * 130, 8)}, text
    # The draw alone was timed, and the ratio printed is that of the table's times.
    ms = {int(dp): float(ms) for dp, *_, ms in table}
    drawn, ratio = re.search(r"^the global batch's order drawn alone .*: ([\d.]+) ms per global batch; "
                             r"a rank's read at dp 4 / at dp 1: ([\d.]+)x$", text, re.M).groups()
    assert float(drawn) > 0 and float(ratio) == pytest.approx(ms[4] / ms[1], abs=0.006), text

    # Part 2: each save mode's snapshot every step against every 1000 steps (on a busy machine a job's one measured
    # window may be slower with fewer snapshots: what a snapshot adds is then printed below 0, as measured).
    rows = {(mode, int(every)): row for mode, every, *row in re.findall(
        r"^\| (sync|async) \| (\d+) \| ([\d.]+) \| (-?[\d.]+|-) \| (-?[\d.]+|-) \| (\d+) \| ([\d.]+) \| ([\d.]+) \|$",
        text, re.M)}
    assert set(rows) == {(mode, every) for mode in ("sync", "async") for every in (1000, 1)}, text
    for (mode, every), (ms, added, steps, saved, size, seconds) in rows.items():
        job = jobs[0, every, mode]
        assert (ms, int(saved), size, seconds) == (step[0, every, mode][0], job["saved"], job["size"], job["seconds"])
        if every == 1:
            base = float(rows[mode, 1000][0])
            assert float(added) == pytest.approx(float(ms) - base, abs=0.011), text
            assert float(steps) == pytest.approx(float(added) / base, abs=0.006), text
            assert f"{mode}: {added} ms, {steps} steps of training" in text, text
        else:
            assert added == steps == "-", text

    # Part 3: a row per file, its rows and pages; none of the file's pages left in the process after the reads (each
    # read's mapping is gone with it).
    memory = {int(multiple): [figure(number) for number in numbers] for multiple, *numbers in re.findall(
        r"^\| x(\d+) \| ([\d.]+) \| ([\d,]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| (-?[\d.]+) \| "
        r"(-?[\d.]+) \| (-?[\d.]+) \|$", text, re.M)}
    assert set(memory) == {1, 2}, text
    for multiple, (size, rows_read, pages, resident, *_) in memory.items():
        assert size == pytest.approx(multiple * memory[1][0], abs=0.011), text
        assert rows_read == 3 * 8 and 0 < pages <= size + 0.01 and resident == 0, text
    summary = re.search(r"^x1 -> x2: the file 2\.0x, its resident pages ([-+][\d.]+) MiB, the peak RSS's growth "
                        r"([-+][\d.]+) MiB$", text, re.M)
    assert float(summary[1]) == pytest.approx(memory[2][3] - memory[1][3], abs=0.011), text
    assert float(summary[2]) == pytest.approx(memory[2][6] - memory[1][6], abs=0.011), text


def test_fault_tolerance_at_scale_reports_both_strategies_side_by_side(capsys):
    args = Namespace(kill_at=100, epochs=8, save_every=2, workload="synthetic")
    benchmark("fault_tolerance_at_scale").report(
        args, dict(reached=99, redone=35, ranks=2, stall=2.5, back=2.75),
        dict(stall=2.1, redone=1, alone=30, killed=100, healed=131, equal_after=True))
    rows = table_rows(capsys.readouterr().out)
    assert rows == [
        "| restart the world (step 3) | 35 x 2 ranks (since the snapshot) | 2.50 s (every rank) | 2.75 s after the kill "
        "| 0 |",
        "| replica groups (step 13) | 1 | 2.10 s (the survivor's longest wait) | never stopped (group 1 killed after "
        "step 100, back at step 131) | 960 (30 steps of group 1's share) |"], rows


def test_fault_tolerance_at_scale_reports_what_the_survivor_waits_for_fault_by_fault(capsys):
    """--waits: a row per fault and repetition, the longest wait and every wait over 1 s, and the line the survivor
    ended with when it ended."""
    args = Namespace(group_timeout=20)
    benchmark("fault_tolerance_at_scale").report_waits(args, [
        ("kill", [2.54, 2.91]), ("return", []), ("stop", [20.2]),
        ("rank", [20.1, "error: rank 0: no quorum within --timeout 20 s: ..."])])
    rows = table_rows(capsys.readouterr().out)
    assert rows == [
        "| its worker SIGKILLed: the kernel closes its connections | 2.9 s | 2.5 s, 2.9 s |",
        "| it comes back (restarted by its torchrun) and heals | 0.0 s | none |",
        "| its worker SIGSTOPped for good: a machine that hangs, or vanishes with its connections open | 20.2 s | "
        "20.2 s |",
        "| groups of two ranks: its rank 1 SIGSTOPped for good (its rank 0 heartbeats on) | 20.1 s | 20.1 s, error: "
        "rank 0: no quorum within --timeout 20 s: ... |"], rows


@pytest.mark.slow
def test_fault_tolerance_at_scale_measures_a_real_kill_under_each_strategy(monkeypatch, capsys):
    """Both jobs for real, with a kill before step 70 and a snapshot every epoch: restarting the world redoes the steps
    since the snapshot of step 64 on both ranks; the replica groups redo at most the step in flight, their survivor's
    longest wait is under the job's timeout, and the groups are equal after the heal."""
    text = run_benchmark(monkeypatch, capsys, "fault_tolerance_at_scale.py", "--save_every", 1, "--kill_at", 70)
    world, groups = table_rows(text)
    redone = re.search(r"\| (\d+) x 2 ranks \(since the snapshot\) \| ([\d.]+) s \(every rank\)", world)
    assert redone and int(redone[1]) in (5, 6), world  # rank 0 stops at step 69 or 70; the snapshot is of step 64
    assert re.search(r"^\| replica groups \(step 13\) \| [01] \| ([\d.]+) s", groups), groups
    assert float(re.search(r"\| ([\d.]+) s \(the survivor", groups)[1]) < 10, groups
    assert "the groups equal after the heal: True" in text, text


def test_bucket_size_reports_the_fastest_step_of_each_size_and_the_fitted_cost_of_an_all_reduce(capsys):
    """Made-up records of 2 ranks, steps beginning at 0, 10 and 25 ms (the fastest: step 1, the median 12.5 ms):
    backward 4 ms, two buckets (300 and 100 bytes), 1.5 ms in wait() among the 3 ms between backward and the step;
    synchronous all-reduces of 1,000 bytes (the fastest 2 ms) and 3,000 bytes (4 ms): alpha 1 ms, beta 1 MB/s, so
    the two buckets cost 2 x 1 + 0.4 ms."""
    bucket_size = benchmark("bucket_size")
    records = []
    for rank in range(2):
        pid = 10 + rank
        for step, t in enumerate((1.0, 1.010, 1.025)):
            backward = 0.004 if step == 1 else 0.008  # a slower step's parts are not the fastest's
            records += [
                dict(pid=pid, rank=rank, event="call", op="all_reduce", seq=2 * step, bytes=[300], began=t + 0.001,
                     ended=t + 0.0012, step=step),
                dict(pid=pid, rank=rank, event="backward", began=t, ended=t + backward, step=step),
                dict(pid=pid, rank=rank, event="call", op="all_reduce", seq=2 * step + 1, bytes=[100],
                     began=t + 0.0045, ended=t + 0.0046, step=step),
                dict(pid=pid, rank=rank, event="wait", seq=2 * step, began=t + 0.005, ended=t + 0.006, step=step),
                dict(pid=pid, rank=rank, event="wait", seq=2 * step + 1, began=t + 0.006, ended=t + 0.0065,
                     step=step),
                dict(pid=pid, rank=rank, event="step", began=t + 0.007, step=step)]
        for size, milliseconds in ((1000, [3.0, 2.0, 4.0] if rank == 0 else [2.5, 5.0, 6.0]), (3000, [4.0] * 3)):
            records += [dict(pid=pid, rank=rank, event="call", op="all_reduce", seq=100, bytes=[size], began=2.0,
                             ended=2.0 + duration / 1e3, step=3) for duration in milliseconds]
    points = bucket_size.calibration(records, after=3)
    assert points == [(1000, pytest.approx(0.002)), (3000, pytest.approx(0.004))]
    bucket_size.report([bucket_size.summary(0.1, [0, 1, 2], records)], points)
    text = capsys.readouterr().out
    assert table_rows(text.split("\n\n")[0]) == [
        "| 0.1 | 2 | 300, 100 | 10.00 | 4.00 | 3.00 | 1.50 | 0.30 | 2.40 | 12.50 |"]
    assert table_rows(text.split("\n\n")[1]) == ["| 1,000 | 2.000 | 2.000 |", "| 3,000 | 4.000 | 4.000 |"]
    assert "fit: alpha = 1,000 us per all-reduce, beta = 1 MB/s" in text
