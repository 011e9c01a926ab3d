"""Each step script, run the way a user runs it: it exits 0, the loss falls, exactly one process writes the
checkpoint, the file loads into a fresh model, and a rerun resumes where the last one stopped."""
import shutil

import torch

from expect import assert_learned, assert_loads_into_fresh_model, assert_one_writer
from tools.jobs import output, python, run, start, torchrun_node
from utils import free_port

EPOCHS = 4


def test_single_gpu_trains_on_the_cpu_and_saves_a_checkpoint(tmp_path):
    job = run(python("single_gpu.py", EPOCHS, 2), cwd=tmp_path, record=True)
    assert job.output.startswith("Training on cpu (no CUDA device found)\n"), job.output
    assert_learned(job.output, EPOCHS)
    assert output.held_out(job.output)["samples"] == 512
    assert_one_writer(job.writes, tmp_path / "checkpoint.pt")
    assert_loads_into_fresh_model(tmp_path / "checkpoint.pt")


def test_multigpu_spawns_two_gloo_processes_with_one_writer(tmp_path):
    job = run(python("multigpu.py", EPOCHS, 2, "--world_size", 2), cwd=tmp_path, record=True)
    assert job.output.startswith("2 processes on gloo (no CUDA)\n"), job.output
    assert {match["rank"] for match in output.EPOCH.finditer(job.output)} == {"0"}, "only rank 0 reports"
    assert "[rank 0/2 | cpu] epoch 0 |" in job.output
    assert_learned(job.output, EPOCHS)
    assert sorted({row["rank"] for row in job.samples}) == [0, 1], "two ranks trained"
    assert_one_writer(job.writes, tmp_path / "checkpoint.pt")
    assert_loads_into_fresh_model(tmp_path / "checkpoint.pt")


def test_torchrun_step_trains_and_snapshots_with_one_writer(torchrun_jobs):
    first, workdir = torchrun_jobs["first"], torchrun_jobs["workdir"]
    assert_learned(first.output, 2)
    assert "[rank 0/2 | cpu] epoch 1 | snapshot saved to snapshot.pt" in first.output
    assert_one_writer(first.writes, workdir / "snapshot.pt")
    assert not (workdir / "snapshot.pt.tmp").exists()
    assert_loads_into_fresh_model(workdir / "snapshot.pt", key="MODEL_STATE")


def test_a_rerun_resumes_after_the_last_completed_epoch(torchrun_jobs):
    first, resumed = torchrun_jobs["first"], torchrun_jobs["resumed"]
    assert output.resumes(resumed.output) == {0: 2}, resumed.output  # restart 0: a new job, not a torchrun restart
    assert "[rank 1/2 | cpu] resuming from epoch 2, restart 0" in resumed.output  # every rank loads it
    assert sorted(resumed.losses) == [2, 3], "epochs 0 and 1 were done already: none is repeated"
    assert resumed.losses[3] < first.losses[1], "it goes on from the trained weights"
    snapshot = torch.load(torchrun_jobs["workdir"] / "snapshot.pt", weights_only=True)
    assert snapshot["EPOCHS_RUN"] == 4


def test_multinode_runs_as_two_nodes_on_localhost_with_one_writer(tmp_path):
    node = torchrun_node("multinode.py", EPOCHS, 2, endpoint=f"127.0.0.1:{free_port()}")
    job = run(node, node, cwd=tmp_path, record=True)
    assert_learned(job.output, EPOCHS)
    reporting = [n for n in range(2) if "epoch 0 |" in job.node_output(n)]
    assert len(reporting) == 1, "only global rank 0, on one of the nodes, reports"
    assert "[rank 0/2 | local 0 | cpu] epoch 0 |" in job.output
    assert sorted({row["rank"] for row in job.samples}) == [0, 1]
    assert_one_writer(job.writes, tmp_path / "snapshot.pt")
    assert_loads_into_fresh_model(tmp_path / "snapshot.pt", key="MODEL_STATE")


def test_nodes_that_see_different_snapshots_refuse_to_train(tmp_path, torchrun_jobs):
    """Each node reads the snapshot path on its own disk. Node 0 finds a snapshot (4 epochs done), node 1 finds
    none: instead of training mismatched replicas, both stop and say the path must be on shared storage."""
    disks = [tmp_path / "node0", tmp_path / "node1"]
    for disk in disks:
        disk.mkdir()
    shutil.copy(torchrun_jobs["workdir"] / "snapshot.pt", disks[0])
    before = (disks[0] / "snapshot.pt").read_bytes()
    node = torchrun_node("multinode.py", EPOCHS + 2, 1, endpoint=f"127.0.0.1:{free_port()}")
    with start(node, node, cwd=disks, logs=tmp_path, record=True) as job:
        codes = job.wait(timeout=120)
    assert None not in codes and codes[0] != 0 and codes[1] != 0, job.output
    assert "error: ranks resume from different epochs (0 to 4): put --snapshot_path on storage that every node " \
           "shares" in job.errors, job.output
    assert not job.samples, "no rank trained"
    assert (disks[0] / "snapshot.pt").read_bytes() == before and not (disks[1] / "snapshot.pt").exists()
