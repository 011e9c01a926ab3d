"""fsdp.py, the sharded step: FSDP trains exactly as DDP does while each rank holds 1/world_size of the training
state, its sharded snapshot survives a killed worker, its exported model is a plain state_dict, and --verbose prints
every rank's memory in one table."""
import re
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.fsdp import fully_shard
from torch.utils.data import TensorDataset

from tools.jobs import FRESH_STORE, output, run, start, torchrun
from tools.jobs.output import epoch_losses, memory_tables
from tools.jobs import free_port
from utils import evaluate, exit_without_teardown, make_workload

EPOCHS = 2
WIDE = ["--workload", "wide", "--batch_size", 64, "--verbose"]  # large enough for sharding to show


@pytest.fixture(scope="module")
def wide_runs(tmp_path_factory):
    """The wide workload trained on 2 CPU processes, three times on the same data: sharded (FSDP), replicated (DDP),
    and sharded in bf16 with the shards offloaded to CPU memory. FSDP's snapshots go to a folder of their own
    (runs/snapshot), and so must the exported full model. The DDP job is notebooks/05_fsdp.ipynb's too: shared, it
    runs once in a test session (nothing reads its files)."""
    runs = {"ddp": run(torchrun("fsdp.py", EPOCHS, 1, *WIDE, "--strategy", "ddp"), cwd=tmp_path_factory.mktemp("ddp"),
                       timeout=180, shared=True)}
    for name, options in (("fsdp", ["--strategy", "fsdp"]), ("bf16-offload", ["--bf16", "--cpu_offload"])):
        cwd = tmp_path_factory.mktemp(name)
        (cwd / "runs").mkdir()
        runs[name] = run(torchrun("fsdp.py", EPOCHS, 1, *WIDE, *options, "--snapshot_path", "runs/snapshot"),
                         cwd=cwd, timeout=180, record=name == "bf16-offload")
    return runs


def held_out_loss(output):
    return float(re.search(r"held-out \d+ samples \| loss ([\d.]+)", output)[1])


@pytest.mark.slow
def test_fsdp_follows_the_same_loss_trajectory_as_ddp(wide_runs):
    fsdp, ddp = (epoch_losses(wide_runs[s].output) for s in ("fsdp", "ddp"))
    assert sorted(fsdp) == sorted(ddp) == list(range(EPOCHS)), wide_runs["fsdp"].output
    assert fsdp[EPOCHS - 1] < 0.7 * fsdp[0], f"the loss did not fall: {fsdp}"
    for epoch in range(EPOCHS):  # the same averaged gradients, summed in another order: equal to print precision
        assert fsdp[epoch] == pytest.approx(ddp[epoch], abs=2e-4), (fsdp, ddp)
    assert held_out_loss(wide_runs["fsdp"].output) == pytest.approx(held_out_loss(wide_runs["ddp"].output), abs=2e-4)


@pytest.mark.slow
def test_exported_full_model_is_the_gathered_snapshot_and_loads_without_distributed(wide_runs):
    cwd = wide_runs["fsdp"].cwd / "runs"
    assert "[rank 0/2 | local 0 | cpu] full model saved to runs/model_full.pt" in wide_runs["fsdp"].output
    assert not (cwd.parent / "model_full.pt").exists(), "beside the snapshot, not in the working directory"
    assert sorted(path.name for path in cwd.iterdir()) == ["model_full.pt", "snapshot"], "no temporary left behind"
    dcp_to_torch_save(cwd / "snapshot", cwd / "snapshot_gathered.pt")  # the shards of every rank, put together
    snapshot = torch.load(cwd / "snapshot_gathered.pt", weights_only=False)
    exported = torch.load(cwd / "model_full.pt", map_location="cpu", weights_only=True)
    assert snapshot["EPOCHS_RUN"] == EPOCHS
    assert exported.keys() == snapshot["MODEL_STATE"].keys()
    for name, tensor in exported.items():
        assert torch.equal(tensor, snapshot["MODEL_STATE"][name]), name

    model = make_workload("wide").model  # a plain model in this process: no process group anywhere
    model.load_state_dict(exported)
    workload = make_workload("wide")
    metrics = evaluate(model, workload.eval_set, workload.loss_fn, torch.device("cpu"))
    assert metrics["loss"] == pytest.approx(held_out_loss(wide_runs["fsdp"].output), abs=2e-4)


@pytest.mark.slow
def test_verbose_prints_one_memory_table_per_stage_with_a_row_per_rank(wide_runs):
    for strategy, proc in wide_runs.items():
        tables = memory_tables(proc.output)
        assert list(tables) == ["start", *(f"after epoch {e}" for e in range(EPOCHS)), "end"], proc.output
        for stage, rows in tables.items():
            assert [row["rank"] for row in rows] == [0, 1], (strategy, stage, rows)
            assert [row["local"] for row in rows] == [0, 1]  # one node: local rank == rank
            for row in rows:
                assert row["device"] in ("cpu", f"cuda:{row['local']}")
                assert 50 < row["now MiB"] <= row["peak MiB"] < 16_000, row  # a Python process with torch loaded
                assert row["state MiB"] == pytest.approx(row["params MiB"] + row["grads MiB"] + row["optim MiB"],
                                                         abs=0.02)
        for row in tables["start"]:  # before the first step: no gradients, Adam's moments not yet created
            assert row["grads MiB"] == 0 and row["optim MiB"] == 0, row
        for row in tables["end"]:  # Adam keeps two moments per parameter
            assert row["optim MiB"] == pytest.approx(2 * row["params MiB"], rel=0.02), row


@pytest.mark.slow
def test_fsdp_holds_a_world_size_share_of_the_training_state_that_ddp_copies(wide_runs):
    fsdp, ddp = (memory_tables(wide_runs[s].output)["end"] for s in ("fsdp", "ddp"))
    full = make_workload("wide").model
    full_mib = sum(p.numel() * p.element_size() for p in full.parameters()) / 2**20
    for row in ddp:  # every DDP rank holds everything: parameters, gradients, Adam's two moments
        assert row["params MiB"] == pytest.approx(full_mib, rel=0.01)
        assert row["state MiB"] == pytest.approx(4 * full_mib, rel=0.01)
    for fsdp_row, ddp_row in zip(fsdp, ddp):  # each FSDP rank: its shard, 1/world_size of it
        assert fsdp_row["params MiB"] == pytest.approx(ddp_row["params MiB"] / 2, rel=0.02), (fsdp_row, ddp_row)
        assert fsdp_row["state MiB"] == pytest.approx(ddp_row["state MiB"] / 2, rel=0.02), (fsdp_row, ddp_row)
    assert sum(row["params MiB"] for row in fsdp) == pytest.approx(full_mib, rel=0.01)  # one copy, split


@pytest.mark.slow
def test_a_killed_worker_resumes_from_the_sharded_snapshot_after_the_restart(tmp_path):
    epochs = 6
    with start(torchrun("fsdp.py", epochs, 2, launcher_args=["--max-restarts=1"]), cwd=tmp_path,
               env=FRESH_STORE) as job:  # torchrun's other path: a fresh store per attempt (no keys of the last one)
        job.wait_for(output.SAVED, timeout=90)  # the first snapshot (after epoch 1) is in place
        job.kill_worker(rank=1)  # no handler, no cleanup: a crash
        assert job.wait(timeout=150) == [0], job.output
    text = job.output
    resumed = re.findall(r"\[rank (\d)/2[^\]]*\] resuming from epoch (\d+), restart 1", text)
    assert sorted(rank for rank, _ in resumed) == ["0", "1"], text
    resumed_at = int(resumed[0][1])
    assert resumed_at in range(2, epochs, 2), text  # a whole number of saves (every 2 epochs), not epoch 0
    after_restart = epoch_losses(text[text.index("resuming from epoch"):])
    assert sorted(after_restart) == list(range(resumed_at, epochs)), text
    first_run = epoch_losses(text[:text.index("resuming from epoch")])
    assert after_restart[resumed_at] < 0.5 * first_run[0], "the restart did not start from the trained weights"


@pytest.mark.slow
def test_a_snapshot_set_aside_by_a_cut_short_swap_is_put_back_and_a_corrupt_one_stops_every_rank_with_one_line(
        tmp_path):
    """A kill between the two renames of a snapshot folder's swap leaves only the old snapshot, set aside as
    snapshot.previous/: the next start puts it back (one line, from the one rank whose rename wins) and resumes from
    it; this one is corrupt, so every rank then stops, and one line, said once, says in words what is wrong with it."""
    (tmp_path / "snapshot.previous").mkdir()
    (tmp_path / "snapshot.previous" / ".metadata").write_bytes(b"not a checkpoint")
    job = run(torchrun("fsdp.py", 2, 1), cwd=tmp_path, timeout=120, check=False)
    assert job.returncode not in (0, None)
    assert job.output.count("snapshot: a save was cut short in the middle of its swap; the snapshot before it, set "
                            "aside as snapshot.previous, is put back") == 1, job.output
    # one line for both ranks, which meet the same snapshot (local rank 0 says it)
    errors = re.findall(r"error: cannot resume from snapshot \((.*?)\); it is left in place", job.output)
    assert len(errors) == 1, job.output
    for cause in errors:  # what is wrong, not DCP's "CheckpointException ranks:dict_keys([0, 1])" nor its tracebacks
        assert cause == "its .metadata is not a pickle (at position 0, opcode b'n' unknown)", cause
    assert job.output.count("Traceback (most recent call last)") == 1, "torchrun's own report's, and no other"
    assert (tmp_path / "snapshot" / ".metadata").read_bytes() == b"not a checkpoint"  # put back, left in place
    assert not (tmp_path / "snapshot.previous").exists()


@pytest.mark.slow
def test_bf16_with_cpu_offload_trains_on_cpu_ranks_as_fp32_does(wide_runs):
    """FSDP's mixed-precision and offload policies run on gloo too: bf16 compute, the gradients reduce-scattered in
    fp32 (recorded at the collective, every epoch on every rank: a bf16 sum over many ranks would lose the gradients'
    low bits), the outputs back in fp32 for the loss, the shards kept in (unpinned) CPU memory. Each epoch's loss
    within 2% of fp32's."""
    bf16, fp32 = wide_runs["bf16-offload"].losses, wide_runs["fsdp"].losses
    assert bf16[EPOCHS - 1] < bf16[0], bf16
    for epoch in fp32:
        assert bf16[epoch] == pytest.approx(fp32[epoch], rel=0.02), (bf16, fp32)
    reduced = [(row["rank"], row["epoch"], row["reduce_scatter_dtypes"]) for row in wide_runs["bf16-offload"].samples]
    assert reduced == [(rank, epoch, ["float32"]) for rank, epoch, _ in reduced] and len(reduced) == 2 * EPOCHS


@pytest.mark.gpu
def test_bf16_with_cpu_offload_trains_on_gpus(tmp_path):
    nproc = min(2, torch.cuda.device_count())
    job = run(torchrun("fsdp.py", EPOCHS, 1, *WIDE, "--bf16", "--cpu_offload", nproc=nproc), cwd=tmp_path,
              gpu=True, timeout=180)
    losses = job.losses
    assert losses[EPOCHS - 1] < losses[0], losses
    for row in memory_tables(job.output)["end"]:
        assert row["device"] == f"cuda:{row['local']}", row


def evaluate_sharded(rank, port, dataset, result_file):
    """Worker: evaluate an FSDP-sharded copy of a small model, with batches that leave rank 1 one batch short."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=20))  # a rank left waiting for an all-gather fails fast
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    for module in [*model.children(), model]:
        fully_shard(module)
    metrics = evaluate(model, dataset, torch.nn.functional.cross_entropy, torch.device("cpu"), True, batch_size=2)
    if rank == 0:
        torch.save(dict(metrics), result_file)
    dist.destroy_process_group()
    exit_without_teardown()  # as the step scripts do (utils.exit_without_teardown says why)


@pytest.mark.slow
def test_evaluate_runs_the_same_forward_passes_on_every_rank_and_scores_each_sample_once(tmp_path):
    inputs = torch.randn(5, 3, generator=torch.Generator().manual_seed(1))
    dataset = TensorDataset(inputs, torch.tensor([0, 1, 1, 0, 1]))  # rank 0: 3 samples (2 batches), rank 1: 2
    mp.spawn(evaluate_sharded, args=(free_port(), dataset, tmp_path / "metrics.pt"), nprocs=2, join=True)
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    expected = evaluate(plain, dataset, torch.nn.functional.cross_entropy, torch.device("cpu"), True)
    sharded = torch.load(tmp_path / "metrics.pt")
    assert sharded["loss"] == pytest.approx(expected["loss"], rel=1e-5)
    assert sharded["accuracy"] == pytest.approx(expected["accuracy"])


@pytest.mark.parametrize("version, wrong", [("2.6.0+cu124", "runs on CUDA streams only"),
                                            ("2.7.1", "sums the gradients over the ranks instead of averaging them "
                                                      "(gloo has no average)"),
                                            ("2.8.0+cpu", "sums the gradients over the ranks instead of averaging them "
                                                          "(gloo has no average)")])
def test_fsdp_on_cpu_processes_is_refused_with_one_line_where_torch_trains_them_wrong(monkeypatch, tmp_path, version,
                                                                                      wrong):
    """Run with each release on 2 CPU processes against one process: 2.6's FSDP fails at its first forward, 2.7.1's
    and 2.8.0's gradients are exactly twice one process's (gloo takes their ReduceOp.AVG for a sum), 2.9.1's on are
    right. fsdp.py stops on those before the process group forms, with one line; --strategy ddp, which does not shard,
    and a newer torch are let through."""
    import runpy
    import sys

    from tools.jobs import script
    from utils import require_torch_for_fsdp

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(torch, "__version__", version)
    monkeypatch.setattr(sys, "argv", ["fsdp.py", "2", "1"])
    for name, value in dict(LOCAL_RANK=0, RANK=0, LOCAL_WORLD_SIZE=2, WORLD_SIZE=2).items():
        monkeypatch.setenv(name, str(value))
    with pytest.raises(SystemExit) as stop:
        runpy.run_path(script("fsdp.py"), run_name="__main__")
    assert str(stop.value) == (f"error: FSDP of torch {version} {wrong} on CPU processes: use torch 2.9 or newer "
                               "there (on GPUs it is right from 2.6)")
    assert list(tmp_path.iterdir()) == []
    require_torch_for_fsdp(sharded=False)  # DDP
    monkeypatch.setattr(torch, "__version__", "2.9.1")
    require_torch_for_fsdp()
