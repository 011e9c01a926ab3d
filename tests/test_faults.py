"""The faults a careless or unlucky user meets, each ending within its time with one line that says what to do, and
nothing the user had lost: a restart on several nodes with torchrun's shared store, a rank that never reaches the
process group, torchrun itself killed, a snapshot folder that cannot be written or a disk that fills up, a crash in the
middle of a snapshot folder's swap, nodes started with different arguments, Ctrl-C to the process that spawned the
workers and to torchrun (a finished job run again: tests/test_bad_input.py, with the other mistakes said once). Some of them run in a copy of this process made by fork (it has
torch loaded already), killed or left to end as a worker would be."""
import io
import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from expect import small_disk, snapshot_of
from harness.jobs import REPO, free_port, output, python, run, start, torchrun, torchrun_node
from harness.jobs.processes import child_pids
from utils import make_workload, replacing, watch_this_worker, writable_path

STARTUP = 60  # generous: starting torchrun and its workers takes 5 s here, 20 s on a loaded 2-core machine
ROOT = os.geteuid() == 0


def alive(pid):
    """True while `pid` runs (a zombie, dead but not yet reaped, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def in_a_fork(work, *args):
    """Run work(*args) in a copy of this process made by fork: (its exit code, minus the signal that ended it, and
    what it wrote to stderr). The copy never returns into pytest."""
    with tempfile.TemporaryFile() as errors:
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.dup2(errors.fileno(), 2)
                work(*args)
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        errors.seek(0)
        return os.waitstatus_to_exitcode(status), errors.read().decode(errors="replace")


# --- restarts and the process group ----------------------------------------------------------------------------------

@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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


def worker_that_works_on_after_its_group(output_fd, go_fd, timeout_s):
    """A torchrun worker, in a forked copy: it forms a process group (one rank, gloo) under watch_this_worker's watch,
    destroys it, and works on past --timeout, as a learner's script that evaluates or plots after the teardown does;
    then it tells its launcher (its parent) to exit, and waits to be stopped."""
    try:
        os.dup2(output_fd, 2)
        sys.stderr = sys.__stderr__  # file descriptor 2, not pytest's capture
        os.write(2, f"worker {os.getpid()}\n".encode())
        os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
        os.environ["RANK"] = "0"
        watch_this_worker(timeout_s)
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        dist.all_reduce(torch.ones(1))
        time.sleep(0.5)  # training: the watch, which looks every 50 ms until the group has formed, sees it
        dist.destroy_process_group()
        time.sleep(timeout_s + 1.5)
        os.write(2, b"still working after --timeout\n")
        os.write(go_fd, b"go")
        time.sleep(30)
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(0)


def test_the_watch_lets_a_worker_work_on_after_its_group_and_still_stops_it_when_its_torchrun_is_gone():
    """After destroy_process_group() the group is no longer initialized: the watch must not take that for a group that
    never formed once --timeout has passed (it stopped the worker with "the process group did not form"); its other
    duty, stopping a worker whose torchrun is gone, lasts the worker's whole life."""
    output_read, output_write = os.pipe()
    go_read, go_write = os.pipe()
    launcher = os.fork()
    if launcher == 0:  # the copy that plays torchrun: it starts the worker, and exits when the worker says so
        try:
            os.close(output_read)
            if os.fork() == 0:
                worker_that_works_on_after_its_group(output_write, go_write, timeout_s=1)
            os.close(output_write)
            os.close(go_write)
            os.read(go_read, 2)  # "go", or nothing once the worker is gone
        finally:
            os._exit(0)
    for fd in (output_write, go_write, go_read):
        os.close(fd)
    os.waitpid(launcher, 0)  # the launcher is gone: from here the worker's watch has a second to notice
    gone, printed = time.monotonic(), b""
    while time.monotonic() - gone < 10 and select.select([output_read], [], [], 10 - (time.monotonic() - gone))[0]:
        chunk = os.read(output_read, 4096)
        if not chunk:  # every writer closed: the worker has ended
            break
        printed += chunk
    took, text = time.monotonic() - gone, printed.decode()
    os.close(output_read)
    worker = re.search(r"worker (\d+)", text)
    if worker and alive(int(worker[1])):
        os.kill(int(worker[1]), signal.SIGKILL)
    assert "still working after --timeout" in text and "did not form" not in text, text
    assert re.search(rf"error: rank 0: torchrun \(pid {launcher}\) is gone, so this worker stops", text), text
    assert took < 5, f"the worker stopped {took:.1f} s after its torchrun"


# --- files ------------------------------------------------------------------------------------------------------------

def write_version(folder, version):
    """A snapshot folder of two files that must agree, as DCP's .metadata and its shards must."""
    os.mkdir(folder)
    for name in (".metadata", "__0_0.distcp"):
        (Path(folder) / name).write_text(version)


def version_of(folder):
    """The version a snapshot folder holds; "missing", or "damaged: ..." when its files are not one whole version."""
    if not os.path.isdir(folder):
        return "missing"
    contents = {path.name: path.read_text() for path in Path(folder).iterdir()}
    if sorted(contents) != [".metadata", "__0_0.distcp"] or len(set(contents.values())) != 1:
        return f"damaged: {contents}"
    return contents[".metadata"]


def save_new_version_killed_at(path, change):
    """As fsdp.py saves (every rank writes into the job's temporary folder, then replacing() swaps it in for the last
    snapshot), with SIGKILL just before the swap's `change`-th change of the file system (a rename, a removal)."""
    count = [0]

    def counted(real):
        def change_now(*args, **kwargs):
            count[0] += 1
            if count[0] == change:
                os.kill(os.getpid(), signal.SIGKILL)
            return real(*args, **kwargs)
        return change_now

    with replacing(str(path), f"{path}.job.tmp") as tmp:
        write_version(tmp, "new")
        for name in ("rename", "replace", "unlink", "remove", "rmdir"):  # this copy's own os module
            setattr(os, name, counted(getattr(os, name)))


def test_a_kill_at_any_moment_of_a_snapshot_folders_swap_leaves_one_whole_snapshot_that_the_next_start_finds(tmp_path):
    """fsdp.py's snapshot is a folder, which no single rename replaces. The writer is killed just before each change
    the swap makes to the file system, one after the other; each time the next start (--snapshot_path's check,
    writable_path) finds the old snapshot or the new one, whole, and the save after it works and leaves nothing set
    aside. (Removing the old folder before renaming the new one in left no snapshot at all after a kill between the
    two: the job started over from epoch 0 without a word.)"""
    found = []
    for change in range(1, 20):
        folder = tmp_path / str(change)
        folder.mkdir()
        path = folder / "snapshot"
        write_version(path, "old")
        code, errors = in_a_fork(save_new_version_killed_at, path, change)
        assert code in (0, -signal.SIGKILL), errors
        writable_path(str(path))  # what the next start does first
        found.append(version_of(path))
        assert found[-1] in ("old", "new"), (change, found[-1], sorted(os.listdir(folder)))
        with replacing(str(path), f"{path}.job2.tmp") as tmp:
            write_version(tmp, "newer")
        assert version_of(path) == "newer" and not (folder / "snapshot.previous").exists(), os.listdir(folder)
        if code == 0:  # the swap made fewer changes than `change`: it ran to its end
            break
    assert found[0] == "old" and found[-1] == "new" and len(found) >= 4, found


def test_a_write_interrupted_by_ctrl_c_removes_its_temporary_and_keeps_the_last_version(tmp_path):
    """Step 1 and mp.spawn's workers meet Ctrl-C as a KeyboardInterrupt, which may come in the middle of a save."""
    path = tmp_path / "checkpoint.pt"
    path.write_bytes(b"the last one")
    with pytest.raises(KeyboardInterrupt):
        with replacing(str(path)) as tmp:
            Path(tmp).write_bytes(b"half of the ne")
            raise KeyboardInterrupt
    assert os.listdir(tmp_path) == ["checkpoint.pt"] and path.read_bytes() == b"the last one"


@pytest.mark.skipif(not (REPO / ".git").exists(), reason="not a git checkout")
def test_git_ignores_what_a_save_leaves_when_it_is_cut_short():
    names = ["snapshot.pt.1234.tmp", "runs/a/gpt_snapshot.pt.99.tmp", "snapshot.job.tmp/.metadata",
             "runs/snapshot.previous/__0_0.distcp"]
    ignored = subprocess.run(["git", "check-ignore", *names], cwd=REPO, capture_output=True, text=True).stdout
    assert ignored.split() == names


@pytest.mark.slow
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


@pytest.mark.slow
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


# --- the command ------------------------------------------------------------------------------------------------------

@pytest.mark.slow
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


@pytest.mark.slow
def test_ctrl_c_to_the_one_device_step_stops_it_with_one_line_and_keeps_the_checkpoint(tmp_path):
    """Step 1 has no launcher and no workers: Ctrl-C (SIGINT to its process group, as a terminal sends it) used to
    print Python's KeyboardInterrupt traceback."""
    with start(python("single_gpu.py", 200, 1, "--batch_size", 8), cwd=tmp_path) as job:
        job.wait_for(r"epoch 1 \| checkpoint saved", timeout=STARTUP)
        os.killpg(job.procs[0].pid, signal.SIGINT)
        [code] = job.wait(timeout=30)
    assert code == 1, (code, job.output[-3000:])
    after = job.output.split("checkpoint saved to checkpoint.pt\n")[-1].splitlines()
    assert after[-1] == "error: stopped by SIGINT; the checkpoint on disk is the last one saved", job.output[-2000:]
    assert "Traceback" not in job.output and all(line.startswith("[cpu] epoch ") for line in after[:-1]), after
    assert not list(tmp_path.glob("*.tmp")), "the save under way, if any, is undone"
    make_workload().model.load_state_dict(torch.load(tmp_path / "checkpoint.pt", weights_only=True))  # whole


@pytest.mark.slow
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


@pytest.mark.slow
def test_ctrl_c_to_torchrun_stops_every_worker_with_one_line_undoes_the_save_under_way_and_keeps_the_last(tmp_path):
    """Ctrl-C as a terminal sends it: SIGINT to torchrun's process group, which holds torchrun alone (it starts each
    worker in a session of its own), while rank 0 writes a snapshot (every save made slow: a slow disk). torchrun
    sends SIGINT on to the workers, and they used to print a KeyboardInterrupt traceback each (70 to 150 lines), and
    leave the half-written snapshot.pt.PID.tmp behind. Now the workers print one line; what remains is torchrun's own
    report, which no worker can silence: one log line, one per worker it signals, and its SignalException traceback."""
    nproc = 2
    with start(torchrun("multigpu_torchrun.py", 200, 1, "--batch_size", 8, nproc=nproc), cwd=tmp_path,
               slow_save=3) as job:
        job.wait_for(output.SAVED, timeout=STARTUP)  # epoch 0's snapshot is in place
        deadline = time.monotonic() + 60
        while not list(tmp_path.glob("snapshot.pt.*.tmp")) and time.monotonic() < deadline:
            time.sleep(0.02)  # epoch 1's is being written: its temporary is there, not yet renamed
        writing = list(tmp_path.glob("snapshot.pt.*.tmp"))
        before = len(job.output)
        os.killpg(job.procs[0].pid, signal.SIGINT)
        interrupted = time.monotonic()
        [code] = job.wait(timeout=60)
        took = time.monotonic() - interrupted
    assert writing, "the interrupt came while no snapshot was being written"
    assert code not in (0, None) and took < 15, (code, took, job.output[-3000:])
    lines = job.output[before:].splitlines()
    ours = [line for line in lines if line.startswith("error:")]
    assert ours == ["error: stopped by SIGINT (Ctrl-C), with every worker of this node; the last snapshot saved is "
                    "kept, and the same command resumes from it"], job.output[before:]
    log = [line for line in lines if re.match(r"[WEI]\d{4} ", line)]
    assert len(log) == 1 + nproc and "Received 2 death signal" in log[0], log
    report = [line for line in lines if line not in ours + log]
    assert report[0] == "Traceback (most recent call last):" and re.fullmatch(
        rf"\S+SignalException: Process {job.procs[0].pid} got signal: 2", report[-1]), job.output[before:]
    assert not [line for line in report if "[rank" in line or "multigpu_torchrun.py" in line], job.output[before:]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["node0.log", "snapshot.pt"], "the temporary is removed"
    assert torch.load(tmp_path / "snapshot.pt", weights_only=True)["EPOCHS_RUN"] == 1  # epoch 0's, whole


def test_what_saves_cut_short_left_is_removed_when_a_job_starts_and_nothing_else(tmp_path):
    """A kill or a crash in the middle of a save leaves its temporary (a file named by the writer's pid, a sharded
    save's folder named by the run and the epoch); no handler of the process can remove it, and each such run left one
    more. The next start of a job on the same --snapshot_path removes them (writable_path, every step's argument type);
    the last snapshot and every other file stay."""
    (tmp_path / "mesh_snapshot").mkdir()
    (tmp_path / "mesh_snapshot" / ".metadata").write_bytes(b"the last whole snapshot")
    for leftover in ("mesh_snapshot.3f2a.4.tmp", "mesh_snapshot.91bc.7.tmp"):
        (tmp_path / leftover).mkdir()
        (tmp_path / leftover / "__0_0.distcp").write_bytes(b"half a shard")
    (tmp_path / "snapshot.pt.1234.tmp").write_bytes(b"half a file")
    others = ["mesh_snapshot.notes", "mesh_snapshot_tmp", "snapshot.pt", "other.1.tmp"]
    for name in others:
        (tmp_path / name).write_bytes(b"kept")
    writable_path(str(tmp_path / "mesh_snapshot"))
    writable_path(str(tmp_path / "snapshot.pt"))
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted(["mesh_snapshot", *others])
    assert (tmp_path / "mesh_snapshot" / ".metadata").read_bytes() == b"the last whole snapshot"
