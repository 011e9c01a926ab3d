"""Each step script, run the way a user runs it: it exits 0, the loss falls, exactly one process writes the
checkpoint, and the file loads into a fresh model."""
import pytest
import torch

from support import (PYTHON, epoch_losses, free_port, job_env, recorded_writes, run, script, start, torchrun,
                     torchrun_node)
from utils import make_workload

EPOCHS = 4


def assert_learned(output, epochs=EPOCHS):
    losses = epoch_losses(output)
    assert sorted(losses) == list(range(epochs)), output
    assert losses[epochs - 1] < 0.5 * losses[0], f"the loss did not fall: {losses}"


def assert_one_writer(audit_file, expected_path):
    writes = recorded_writes(audit_file)
    assert writes, "nothing was saved"
    writers = {(pid, rank) for pid, rank, _ in writes}
    assert len(writers) == 1, f"more than one process wrote: {writers}"
    assert {rank for _, rank in writers} <= {0, None}, f"the writer is not rank 0: {writers}"
    assert {path for _, _, path in writes} <= {str(expected_path), f"{expected_path}.tmp"}


def assert_loads_into_fresh_model(path, key=None):
    state = torch.load(path, map_location="cpu", weights_only=True)
    model = make_workload().model
    model.load_state_dict(state[key] if key else state)  # raises on a missing or misshapen tensor


def test_single_gpu_trains_and_saves_a_checkpoint(tmp_path):
    audit = tmp_path / "writes.tsv"
    proc = run([PYTHON, script("single_gpu.py"), EPOCHS, 2], cwd=tmp_path, env=job_env(audit_file=audit))
    assert "Training on cpu (no CUDA device found)" in proc.output or "Training on cuda" in proc.output
    assert_learned(proc.output)
    assert "held-out 512 samples | loss" in proc.output
    assert_one_writer(audit, tmp_path / "checkpoint.pt")
    assert_loads_into_fresh_model(tmp_path / "checkpoint.pt")


def test_multigpu_spawns_two_cpu_processes_with_one_writer(tmp_path):
    audit = tmp_path / "writes.tsv"
    proc = run([PYTHON, script("multigpu.py"), EPOCHS, 2, "--world_size", 2], cwd=tmp_path,
               env=job_env(audit_file=audit))
    assert "2 processes on gloo (no CUDA)" in proc.output or "NCCL" in proc.output
    assert "[rank 0/2 |" in proc.output
    assert_learned(proc.output)
    assert_one_writer(audit, tmp_path / "checkpoint.pt")
    assert_loads_into_fresh_model(tmp_path / "checkpoint.pt")


def test_torchrun_step_trains_and_snapshots_with_one_writer(tmp_path):
    audit = tmp_path / "writes.tsv"
    proc = run(torchrun("multigpu_torchrun.py", EPOCHS, 2), cwd=tmp_path, env=job_env(audit_file=audit))
    assert_learned(proc.output)
    assert_one_writer(audit, tmp_path / "snapshot.pt")
    assert_loads_into_fresh_model(tmp_path / "snapshot.pt", key="MODEL_STATE")
    assert not (tmp_path / "snapshot.pt.tmp").exists()


def test_a_restarted_torchrun_job_resumes_after_the_last_completed_epoch(tmp_path):
    run(torchrun("multigpu_torchrun.py", 2, 1), cwd=tmp_path)
    resumed = run(torchrun("multigpu_torchrun.py", EPOCHS, 1), cwd=tmp_path)
    assert "[rank 0/2 | cpu] resuming from epoch 2, restart 0" in resumed.output
    assert sorted(epoch_losses(resumed.output)) == [2, 3], "epochs 0 and 1 were done already: none is repeated"
    assert torch.load(tmp_path / "snapshot.pt", weights_only=True)["EPOCHS_RUN"] == EPOCHS


def test_multinode_runs_as_two_nodes_on_localhost_with_one_writer(tmp_path):
    audit = tmp_path / "writes.tsv"
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = [start(torchrun_node("multinode.py", EPOCHS, 2, endpoint=endpoint), cwd=tmp_path,
                   env=job_env(audit_file=audit), log=tmp_path / f"node{n}.log") for n in range(2)]
    codes = [node.wait(timeout=120) for node in nodes]
    output = "".join((tmp_path / f"node{n}.log").read_text() for n in range(2))
    assert codes == [0, 0], output
    assert_learned(output)
    assert_one_writer(audit, tmp_path / "snapshot.pt")
    assert_loads_into_fresh_model(tmp_path / "snapshot.pt", key="MODEL_STATE")


def test_nodes_that_see_different_snapshots_refuse_to_train(tmp_path):
    """Each node reads the snapshot path on its own disk. Node 0 finds a snapshot (1 epoch done), node 1 finds
    none: instead of training mismatched replicas, both stop and say the path must be on shared storage."""
    node_dirs = [tmp_path / "node0", tmp_path / "node1"]
    for directory in node_dirs:
        directory.mkdir()
    run(torchrun("multigpu_torchrun.py", 1, 1), cwd=node_dirs[0])
    before = (node_dirs[0] / "snapshot.pt").read_bytes()
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = [start(torchrun_node("multinode.py", EPOCHS, 1, endpoint=endpoint), cwd=directory,
                   log=tmp_path / f"node{n}.log") for n, directory in enumerate(node_dirs)]
    codes = [node.wait(timeout=120) for node in nodes]
    output = "".join((tmp_path / f"node{n}.log").read_text() for n in range(2))
    assert codes[0] != 0 and codes[1] != 0, output
    assert "error: ranks resume from different epochs (0 to 1): put --snapshot_path on storage that every node " \
           "shares" in output
    assert (node_dirs[0] / "snapshot.pt").read_bytes() == before and not (node_dirs[1] / "snapshot.pt").exists()
