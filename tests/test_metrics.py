"""Per-rank metrics: with TUTORIAL_RUN_DIR set, every rank appends its own epoch figures (not the all-reduced ones)
to its own JSON-lines file, a resumed run appends to them, and tools/plot_metrics.py draws them to a PNG."""
import json

import pytest
import torch

from tools import plot_metrics
from tools.jobs.output import epoch_losses
from utils import make_workload

EPOCHS = 4  # the shared torchrun runs: 2 epochs, then a rerun that resumes and trains 2 more
FIELDS = {"rank", "world_size", "epoch", "step", "loss", "samples", "seconds", "samples_per_s", "time"}
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def run_dir(torchrun_jobs):
    return torchrun_jobs["workdir"] / "runs"


def test_each_rank_writes_its_own_file_one_line_per_epoch_and_a_resumed_run_appends(run_dir):
    assert sorted(path.name for path in run_dir.iterdir()) == ["rank0.jsonl", "rank1.jsonl"]
    runs = plot_metrics.read_run(run_dir)
    steps_per_epoch = 2048 // 2 // 32  # synthetic: 2048 samples, half per rank, batch 32
    for rank, records in runs.items():
        assert [r["epoch"] for r in records] == list(range(EPOCHS)), "epochs 2 and 3 appended by the rerun"
        for r in records:
            assert set(r) == FIELDS
            assert (r["rank"], r["world_size"], r["samples"]) == (rank, 2, 1024)  # this rank's share, not 2048
            assert r["step"] == (r["epoch"] + 1) * steps_per_epoch
            assert r["samples_per_s"] == pytest.approx(r["samples"] / r["seconds"])
            assert r["seconds"] > 0 and r["loss"] > 0


def test_the_logged_loss_is_each_ranks_own_and_they_average_to_the_printed_one(torchrun_jobs, run_dir):
    printed = epoch_losses(torchrun_jobs["first"].output + torchrun_jobs["resumed"].output)  # the all-reduced mean
    runs = plot_metrics.read_run(run_dir)
    for epoch in range(EPOCHS):
        rank0, rank1 = runs[0][epoch], runs[1][epoch]
        assert rank0["loss"] != rank1["loss"]  # different data, different mean loss: not a shared, reduced number
        mean = (rank0["loss"] * rank0["samples"] + rank1["loss"] * rank1["samples"]) / (2 * 1024)
        assert mean == pytest.approx(printed[epoch], abs=1e-4)  # printed with 4 decimals


def test_plot_draws_the_run_to_a_png(run_dir, tmp_path, monkeypatch, capsys):
    out = tmp_path / "plot.png"
    monkeypatch.setattr("sys.argv", ["plot_metrics.py", str(run_dir), "-o", str(out)])
    plot_metrics.main()
    assert f"2 ranks, {EPOCHS} epochs" in capsys.readouterr().out
    assert out.read_bytes().startswith(PNG_SIGNATURE) and out.stat().st_size > 10_000


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
