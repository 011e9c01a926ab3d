"""Per-rank metrics: with TUTORIAL_RUN_DIR set, every rank appends its own epoch figures (not the all-reduced ones)
to its own JSON-lines file, and tools/plot_metrics.py draws them to a PNG."""
import json

import pytest
import torch

from support import epoch_losses, job_env, run, torchrun
from tools import plot_metrics
from utils import make_workload
from utils.metrics import read_run

EPOCHS = 2
FIELDS = {"rank", "world_size", "epoch", "step", "loss", "samples", "seconds", "samples_per_s", "time"}
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory):
    """A 2-process torchrun job with metrics on: (its output, its run directory)."""
    workdir = tmp_path_factory.mktemp("metrics")
    run_dir = workdir / "runs" / "two"
    proc = run(torchrun("multigpu_torchrun.py", EPOCHS, EPOCHS), cwd=workdir,
               env=job_env({"TUTORIAL_RUN_DIR": str(run_dir)}))
    return proc.output, run_dir


def test_each_rank_writes_its_own_file_one_line_per_epoch(two_rank_run):
    _, run_dir = two_rank_run
    assert sorted(path.name for path in run_dir.iterdir()) == ["rank0.jsonl", "rank1.jsonl"]
    runs = read_run(run_dir)
    steps_per_epoch = 2048 // 2 // 32  # synthetic: 2048 samples, half per rank, batch 32
    for rank, records in runs.items():
        assert [r["epoch"] for r in records] == list(range(EPOCHS))
        for r in records:
            assert set(r) == FIELDS
            assert (r["rank"], r["world_size"], r["samples"]) == (rank, 2, 1024)  # this rank's share, not 2048
            assert r["step"] == (r["epoch"] + 1) * steps_per_epoch
            assert r["samples_per_s"] == pytest.approx(r["samples"] / r["seconds"])
            assert r["seconds"] > 0 and r["loss"] > 0


def test_the_logged_loss_is_each_ranks_own_and_they_average_to_the_printed_one(two_rank_run):
    output, run_dir = two_rank_run
    printed = epoch_losses(output)  # rank 0 prints the all-reduced mean over both ranks
    runs = read_run(run_dir)
    for epoch in range(EPOCHS):
        rank0, rank1 = runs[0][epoch], runs[1][epoch]
        assert rank0["loss"] != rank1["loss"]  # different data, different mean loss: not a shared, reduced number
        mean = (rank0["loss"] * rank0["samples"] + rank1["loss"] * rank1["samples"]) / (2 * 1024)
        assert mean == pytest.approx(printed[epoch], abs=1e-4)  # printed with 4 decimals


def test_plot_draws_the_run_to_a_png(two_rank_run, tmp_path, monkeypatch, capsys):
    _, run_dir = two_rank_run
    out = tmp_path / "plot.png"
    monkeypatch.setattr("sys.argv", ["plot_metrics.py", str(run_dir), "-o", str(out)])
    plot_metrics.main()
    assert "2 ranks, 2 epochs" in capsys.readouterr().out
    assert out.read_bytes().startswith(PNG_SIGNATURE) and out.stat().st_size > 10_000


def test_plot_of_a_directory_without_metrics_stops_with_one_line(tmp_path, monkeypatch, capsys):
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
