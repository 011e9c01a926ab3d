"""Per-rank metrics in one process: off unless TUTORIAL_RUN_DIR is set, then one line per epoch, appended by a
resumed run; the plot tool's one-line error. (Runs of the real steps with metrics on: tests/test_steps.py.)"""
import json

import pytest
import torch

from tools import plot_metrics
from harness.jobs.output import epoch_losses
from utils import make_workload


def test_plot_of_a_directory_without_metrics_stops_with_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr("sys.argv", ["plot_metrics.py", str(tmp_path)])
    with pytest.raises(SystemExit) as stop:
        plot_metrics.main()
    assert str(stop.value).startswith(f"error: no rank*.jsonl metrics in {tmp_path}")


def test_single_gpu_trainer_logs_its_epochs_and_a_resumed_run_appends(tmp_path, monkeypatch, capsys):
    import single_gpu

    workload = make_workload()
    trainer = single_gpu.Trainer(workload.model, single_gpu.prepare_dataloader(workload.train_set, 256),
                                 workload.optimizer, workload.loss_fn, torch.device("cpu"), save_every=1)
    trainer._run_epoch(0)
    assert not list(tmp_path.iterdir())  # metrics are off unless TUTORIAL_RUN_DIR is set
    monkeypatch.setenv("TUTORIAL_RUN_DIR", str(tmp_path / "run"))
    trainer._run_epoch(1)
    trainer._run_epoch(2)
    records = [json.loads(line) for line in (tmp_path / "run" / "rank0.jsonl").read_text().splitlines()]
    assert [(r["rank"], r["world_size"], r["epoch"], r["step"]) for r in records] == [(0, 1, 1, 16), (0, 1, 2, 24)]
    printed = epoch_losses(capsys.readouterr().out)
    assert [round(r["loss"], 4) for r in records] == [printed[1], printed[2]]  # one rank: its own loss is the loss
    # the most the device held so far (here a CPU: the process's resident set at its peak), which never falls
    assert 0 < records[0]["memory_peak"] <= records[1]["memory_peak"], records
