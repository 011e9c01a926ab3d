"""The faults a careless or unlucky user meets, each ending within its time with one line that says what to do, and
nothing the user had lost: a restart on several nodes with torchrun's shared store, a rank that never reaches the
process group, torchrun itself killed, a snapshot folder that cannot be written or a disk that fills up, a finished job
run again, nodes started with different arguments, Ctrl-C to the process that spawned the workers."""
import io
import os
import re
import signal
import subprocess
import time
from contextlib import contextmanager

import pytest
import torch

from tools.jobs import free_port, output, python, run, start, torchrun, torchrun_node
from tools.jobs.processes import child_pids
from utils import make_workload

STARTUP = 60  # generous: starting torchrun and its workers takes 5 s here, 20 s on a loaded 2-core machine
ROOT = os.geteuid() == 0


def alive(pid):
    """True while `pid` runs (a zombie, dead but not yet reaped, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def snapshot_of(epochs_run):
    """A snapshot the torchrun steps resume from, made in this process: the synthetic workload after one step."""
    workload = make_workload()
    source, targets = workload.train_set[:32]
    workload.loss_fn(workload.model(source), targets).backward()
    workload.optimizer.step()
    return dict(MODEL_STATE=workload.model.state_dict(), OPTIMIZER_STATE=workload.optimizer.state_dict(),
                EPOCHS_RUN=epochs_run)


@contextmanager
def small_disk(path, free_bytes):
    """A tmpfs mounted at `path` with about `free_bytes` left (a file fills the rest): a disk that fills up."""
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={free_bytes + (1 << 20)}", "tmpfs", str(path)], check=True)
    try:
        (path / "filler").write_bytes(b"\0" * ((1 << 20) - 4096))
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


# --- restarts and the process group ----------------------------------------------------------------------------------

def test_a_worker_killed_on_one_of_two_nodes_restarts_and_both_resume_with_torchruns_shared_store(tmp_path):
    """The restart of test_fault_tolerance.py on two nodes, where each torchrun counts its own restarts: the ranks
    must still agree on their attempt's keys (utils.attempt_store). No TORCH_DISABLE_SHARE_RDZV_TCP_STORE."""
    node = torchrun_node("multinode.py", 6, 2, "--batch_size", 8, endpoint=f"127.0.0.1:{free_port()}",
                         run_id="restart", launcher_args=["--max_restarts=2"])
    with start(node, node, cwd=tmp_path) as job:
        job.wait_for(output.SAVED, timeout=STARTUP)
        [(rank, pid)] = job.workers(node=1).items()
        os.kill(pid, signal.SIGKILL)
        job.note(f"SIGKILL to rank {rank} on node 1")
        codes = job.wait(timeout=150)
    assert codes == [0, 0], job.output[-4000:]
    resumed = {(match["rank"], match["epoch"]) for match in output.RESUMED.finditer(job.output)}
    assert {rank for rank, _ in resumed} == {"0", "1"} and len({epoch for _, epoch in resumed}) == 1, resumed
    assert torch.load(tmp_path / "snapshot.pt", weights_only=True)["EPOCHS_RUN"] == 6


def test_a_rank_that_never_reaches_the_process_group_stops_the_others_within_the_timeout(tmp_path):
    timeout = 5
    with start(torchrun("multigpu_torchrun.py", 2, 1, "--timeout", timeout), cwd=tmp_path, stall_init=1) as job:
        job.wait_for(r"rank 1 does not reach init_process_group", timeout=STARTUP)
        stalled = time.monotonic()
        [code] = job.wait(timeout=timeout + STARTUP)
        took = time.monotonic() - stalled
    assert code not in (0, None), job.output[-3000:]
    assert took < timeout + 10, f"stopped {took:.1f} s after the stall, with --timeout {timeout}"
    # the line comes from whichever rank's watch fires first: rank 0 waiting in init_process_group, or rank 1 itself
    assert re.search(rf"^error: rank [01]: the process group did not form within --timeout {timeout} s", job.output,
                     re.M), job.output[-3000:]


def test_workers_of_a_torchrun_killed_with_sigkill_stop_at_once_and_write_through_files_of_their_own(tmp_path):
    """torchrun killed with SIGKILL cannot stop its workers: they must notice and stop themselves, instead of training
    on and writing the snapshot a new run of the same command reads."""
    with start(torchrun("multigpu_torchrun.py", 200, 1, "--batch_size", 8), cwd=tmp_path, record=True) as job:
        job.wait_for(output.SAVED, timeout=STARTUP)
        workers = job.workers()
        os.kill(job.procs[0].pid, signal.SIGKILL)  # torchrun itself, not its process group
        killed = time.monotonic()
        while any(map(alive, workers.values())) and time.monotonic() - killed < 30:
            time.sleep(0.1)
        took = time.monotonic() - killed
    text = job.output
    assert not any(map(alive, workers.values())), "the workers trained on without their torchrun"
    assert took < 5, f"the workers stopped {took:.1f} s after torchrun (an epoch here takes about 1 s)"
    assert re.search(r"^error: rank \d: torchrun \(pid \d+\) is gone, so this worker stops; run the same command",
                     text, re.M), text[-3000:]
    assert job.writes and all(path.endswith(f".{pid}.tmp") for pid, _, path in job.writes), job.writes


# --- files ------------------------------------------------------------------------------------------------------------

@pytest.mark.skipif(not ROOT, reason="mounts a small tmpfs: needs root")
def test_a_full_disk_stops_the_job_with_one_line_removes_the_partial_file_and_keeps_the_last_snapshot(tmp_path):
    buffer = io.BytesIO()
    torch.save(snapshot_of(1), buffer)
    size = buffer.tell()
    with small_disk(tmp_path / "disk", free_bytes=size + size // 2) as disk:  # room for one snapshot, not two
        job = run(torchrun("multigpu_torchrun.py", 4, 1, "--snapshot_path", disk / "snapshot.pt", nproc=1),
                  cwd=tmp_path, check=False)
        files = sorted(path.name for path in disk.iterdir())
        kept = torch.load(disk / "snapshot.pt", weights_only=True)["EPOCHS_RUN"] if files else None
    assert job.returncode not in (0, None), job.output
    assert re.search(rf"^error: cannot write {re.escape(str(disk))}/snapshot.pt \(no space left on the disk of "
                     rf"{re.escape(str(disk))}\); the last one is kept, as it was$", job.output, re.M), job.output
    assert files == ["filler", "snapshot.pt"], "the partial file is removed"
    assert kept == 1, "the snapshot of epoch 0 stays"


@pytest.mark.skipif(not ROOT, reason="mounts a small tmpfs: needs root")
def test_fsdp_on_a_full_disk_removes_its_partial_snapshot_directory_and_keeps_the_last_one(tmp_path):
    with small_disk(tmp_path / "disk", free_bytes=160 * 1024) as disk:  # the synthetic model's shards: ~70 kB
        job = run(torchrun("fsdp.py", 4, 1, "--snapshot_path", disk / "snapshot", nproc=1), cwd=tmp_path,
                  check=False)
        files = sorted(path.name for path in disk.iterdir())
        saved = sorted(path.name for path in (disk / "snapshot").iterdir()) if "snapshot" in files else []
    assert job.returncode not in (0, None), job.output
    assert re.search(r"^error: cannot write .*/snapshot \(.*\); the last one is kept, as it was$", job.output, re.M), \
        job.output
    assert files == ["filler", "snapshot"], "the partial directory is removed"
    assert saved == [".metadata", "__0_0.distcp"], "a whole earlier snapshot stays"


def test_a_finished_job_run_again_says_so_instead_of_exiting_0_having_done_nothing(tmp_path):
    torch.save(snapshot_of(3), tmp_path / "snapshot.pt")
    before = (tmp_path / "snapshot.pt").read_bytes()
    job = run(torchrun("multigpu_torchrun.py", 3, 1, nproc=1), cwd=tmp_path, check=False)
    assert job.returncode not in (0, None), job.output
    assert "error: snapshot.pt holds 3 epochs already, and TOTAL_EPOCHS is 3: nothing to train. Ask for more " \
           "epochs, or move it away to start anew" in job.errors, job.output
    assert not job.losses and (tmp_path / "snapshot.pt").read_bytes() == before


# --- the command ------------------------------------------------------------------------------------------------------

def test_nodes_started_with_different_arguments_stop_before_training_with_one_line(tmp_path):
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = [torchrun_node("multinode.py", epochs, 1, endpoint=endpoint, run_id="mismatch") for epochs in (4, 6)]
    with start(*nodes, cwd=tmp_path) as job:
        codes = job.wait(timeout=STARTUP + 30)
    assert None not in codes and 0 not in codes, job.output[-3000:]
    lines = [line for line in job.errors if "started with different arguments" in line]
    assert len(lines) == 2 and all(re.fullmatch(r"error: the nodes were started with different arguments: "
                                                r"total_epochs is [46] on rank 0 but [46] on rank 1; start every node "
                                                r"with the same command", line) for line in lines), job.errors
    assert not job.losses and not (tmp_path / "snapshot.pt").exists()


def test_ctrl_c_to_the_process_that_spawned_the_workers_stops_them_at_once_and_keeps_the_checkpoint(tmp_path):
    """`kill -INT` to `python multigpu.py` alone (not its process group): the workers used to train on to the last
    epoch, then the parent printed a traceback."""
    with start(python("multigpu.py", 200, 1, "--batch_size", 8), cwd=tmp_path) as job:
        job.wait_for(r"epoch 1 \| checkpoint saved", timeout=STARTUP)
        workers = [pid for pid in child_pids(job.procs[0].pid)]
        os.kill(job.procs[0].pid, signal.SIGINT)
        interrupted = time.monotonic()
        [code] = job.wait(timeout=60)
        took = time.monotonic() - interrupted
    assert code not in (0, None) and took < 15, (code, took, job.output[-3000:])
    left = time.monotonic() + 5  # the workers, and multiprocessing's resource tracker (it ends when the parent has)
    while any(map(alive, workers)) and time.monotonic() < left:
        time.sleep(0.1)
    assert not any(map(alive, workers)), "a worker outlived the process that spawned it"
    assert job.output.rstrip().endswith("error: stopped by SIGINT, with every worker; the checkpoint on disk is the "
                                        "last one saved"), job.output[-2000:]
    assert max(job.losses) < 150, "the workers stopped at once, not after the last epoch"
    make_workload().model.load_state_dict(torch.load(tmp_path / "checkpoint.pt", weights_only=True))  # whole

