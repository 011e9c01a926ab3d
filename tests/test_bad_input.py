"""Bad input gets one clear line and a non-zero exit: never a bare traceback, never a silent exit 0."""
import os
import runpy
import socket
import subprocess
import sys

import pytest
import torch

from expect import LIBRARY_NOISE, snapshot_of, stopped_as_rank_0
from harness.jobs import free_port, output, python, run, script, torchrun, torchrun_node
from harness.stepdiff import steps

STEPS = steps()
TORCHRUN_STEPS = [step for step in STEPS if step not in ("single_gpu.py", "multigpu.py")]


def assert_one_clear_error(job, *words):
    assert job.returncode not in (0, None), job.output
    assert "Traceback" not in job.output, job.output
    last = job.output.strip().splitlines()[-1]
    assert "error" in last and all(word in last for word in words), job.output


def run_main(monkeypatch, step, *args):
    """Run a step's `__main__` in this process (fast: argument errors stop it before any process starts)."""
    monkeypatch.setattr(sys, "argv", [step, *args])
    with pytest.raises(SystemExit) as stop:
        runpy.run_path(script(step), run_name="__main__")
    return stop.value


@pytest.mark.parametrize("epochs", ["0", "-3", "ten"])
@pytest.mark.parametrize("step", STEPS)
def test_epochs_must_be_a_positive_whole_number(tmp_path, monkeypatch, capsys, step, epochs):
    monkeypatch.chdir(tmp_path)
    assert run_main(monkeypatch, step, epochs, "1").code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    counted = "total_steps" if step == "long_run.py" else "total_epochs"  # the long run counts optimizer steps
    assert error.startswith(f"{step}: error: argument {counted}:"), error
    assert list(tmp_path.iterdir()) == [], "nothing may be written"


@pytest.mark.slow
def test_a_bad_argument_exits_non_zero_for_real(tmp_path):
    job = run(python("multigpu.py", "0", "1"), cwd=tmp_path, check=False)
    assert_one_clear_error(job, "total_epochs", "at least 1")


def test_world_size_must_be_at_least_one(monkeypatch, capsys):
    assert run_main(monkeypatch, "multigpu.py", "2", "1", "--world_size", "0").code == 2
    assert "error: argument --world_size: must be at least 1, got 0" in capsys.readouterr().err


@pytest.mark.parametrize("step", TORCHRUN_STEPS)
def test_a_torchrun_script_started_with_plain_python_says_how_to_launch_it(monkeypatch, step):
    for name in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    message = str(run_main(monkeypatch, step, "50", "10"))
    assert message.startswith("error: start this script with torchrun") and "\n" not in message, message
    # A command that runs as it is pasted, on this one machine (a placeholder host would wait, then fail).
    assert message.endswith(f": torchrun --standalone --nproc_per_node=2 {step} 50 10"), message


def pretend_one_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)


def test_more_spawned_processes_than_gpus_is_refused(monkeypatch):
    """The check runs before any process starts, so a machine without GPUs can test it by pretending to have 1."""
    pretend_one_gpu(monkeypatch)
    stop = run_main(monkeypatch, "multigpu.py", "2", "1", "--world_size", "2")
    assert "2 processes on this machine but 1 GPU(s): one process per GPU (--world_size)" in str(stop)


@pytest.mark.parametrize("step", TORCHRUN_STEPS)
def test_more_torchrun_processes_than_gpus_is_refused_once_on_each_node_with_what_to_do(monkeypatch, capsys, step):
    """Every rank of a machine counts the same GPUs: local rank 0 says it (what it found and what to do), the other
    ranks stop with the same exit code and say nothing (each of them printed the line until it was said once)."""
    import utils.launch

    pretend_one_gpu(monkeypatch)
    monkeypatch.setattr(utils.launch, "SPEAKER_GRACE_S", 0)
    for name, value in {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "RANK": "2", "WORLD_SIZE": "4"}.items():
        monkeypatch.setenv(name, value)
    said = str(run_main(monkeypatch, step, "2", "1"))
    assert said == ("error: 2 processes on this machine but 1 GPU(s): one process per GPU (--nproc_per_node=gpu), so "
                    "start 1 or fewer; or hide the GPUs (CUDA_VISIBLE_DEVICES=) to run 2 on the CPU"), said
    monkeypatch.setenv("LOCAL_RANK", "1")
    capsys.readouterr()
    assert run_main(monkeypatch, step, "2", "1").code == 1
    assert capsys.readouterr() == ("", "")


def test_a_bad_argument_is_said_by_local_rank_0_of_each_node_at_torchruns_first_attempt_only(monkeypatch, capsys):
    """argparse's error, through utils.launch.errors_said_once: said on every node (each node's terminal says why its
    torchrun stopped), by its local rank 0, and only at torchrun's first attempt (the same arguments come back at
    every restart); every other worker exits 2 without a word."""
    import utils.launch

    monkeypatch.setattr(utils.launch, "SPEAKER_GRACE_S", 0)
    said = {}
    for local_rank, rank, attempt in [("0", "2", "0"), ("1", "3", "0"), ("0", "0", "1"), ("0", "2", "1")]:
        for name, value in {"LOCAL_RANK": local_rank, "RANK": rank, "TORCHELASTIC_RESTART_COUNT": attempt}.items():
            monkeypatch.setenv(name, value)
        capsys.readouterr()
        assert run_main(monkeypatch, "multinode.py", "2", "1", "--batch_size", "0").code == 2
        said[local_rank, rank, attempt] = capsys.readouterr().err
    assert "multinode.py: error: argument --batch_size: must be at least 1, got 0" in said["0", "2", "0"], said
    assert said["1", "3", "0"] == said["0", "0", "1"] == said["0", "2", "1"] == "", said


@pytest.mark.parametrize("step", TORCHRUN_STEPS)
def test_a_snapshot_path_in_a_missing_folder_is_refused_before_anything_starts(tmp_path, monkeypatch, capsys, step):
    missing = tmp_path / "no" / "such" / "folder"
    assert run_main(monkeypatch, step, "2", "1", "--snapshot_path", str(missing / "snapshot")).code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error == f"{step}: error: argument --snapshot_path: cannot write in {missing} (No such file or directory)"


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a read-only tmpfs: needs root (root ignores file permissions)")
def test_a_snapshot_path_on_a_read_only_disk_is_refused_before_anything_starts(tmp_path, monkeypatch, capsys):
    readonly = tmp_path / "readonly"
    readonly.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro", "tmpfs", str(readonly)], check=True)
    try:
        stop = run_main(monkeypatch, "multigpu_torchrun.py", "2", "1", "--snapshot_path", str(readonly / "snapshot.pt"))
    finally:
        subprocess.run(["umount", "-l", str(readonly)], check=False)
    assert stop.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"multigpu_torchrun.py: error: argument --snapshot_path: cannot write in {readonly} (Read-only file system)")


@pytest.mark.parametrize("port, words", [("abc", "MASTER_PORT=abc is not a port number (1-65535)"),
                                         ("99999", "MASTER_PORT=99999 is not a port number (1-65535)"),
                                         ("busy", "cannot be used (Address already in use)")])
def test_a_bad_or_busy_master_port_stops_multigpu_with_one_line_before_spawning(monkeypatch, port, words):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        monkeypatch.setenv("MASTER_PORT", str(busy.getsockname()[1]) if port == "busy" else port)
        stop = run_main(monkeypatch, "multigpu.py", "2", "1")
    assert str(stop).startswith("error: ") and words in str(stop) and "\n" not in str(stop), stop


def test_fsdp_options_given_to_ddp_stop_with_one_line_before_the_process_group(monkeypatch):
    for name, value in {"LOCAL_RANK": "0", "RANK": "0", "LOCAL_WORLD_SIZE": "1", "WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(name, value)  # as torchrun starts it: the check in main() runs before init_process_group
    for option in ("--bf16", "--cpu_offload"):
        stop = run_main(monkeypatch, "fsdp.py", "2", "1", "--strategy", "ddp", option)
        assert str(stop) == "error: --bf16 and --cpu_offload are options of --strategy fsdp"


@pytest.mark.gpu
def test_on_a_gpu_machine_world_size_above_the_gpu_count_is_refused(tmp_path):
    too_many = torch.cuda.device_count() + 1
    job = run(python("multigpu.py", "1", "1", "--world_size", too_many), cwd=tmp_path, check=False, gpu=True)
    assert_one_clear_error(job, "--world_size")


# The steps that train the GPT on a text (--text), with the world size their default layout needs.
GPT_STEPS = {"gpt.py": 2, "pipeline_parallel.py": 2, "context_parallel.py": 2, "expert_parallel.py": 2,
             "one_mesh.py": 4}


@pytest.mark.parametrize("step", GPT_STEPS)
def test_a_text_the_gpt_cannot_read_stops_every_gpt_step_before_the_process_group(tmp_path, monkeypatch, step):
    """A binary file given as --text: one line, from the checks that come before init_process_group (this test's
    process never reaches it). Read after the group had formed, the text stopped the step with the right line, and
    then, at times, with gloo's abort in Python's teardown ("terminate called without an active exception")."""
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"\x00\xff\xfe binary" * 100)
    stop = stopped_as_rank_0(monkeypatch, step, GPT_STEPS[step], "--text", binary)
    assert str(stop) == (f"error: --text {binary} is not UTF-8 text (byte 1: invalid start byte); save it as UTF-8 or "
                         "leave it out to train on Python's help pages")


def test_a_context_longer_than_the_help_pages_can_hold_stops_with_one_line_before_the_process_group(monkeypatch):
    """Step 9's --context of 48,000 tokens on the default text (the help pages): its held-out tenth holds no block of
    that length. The text of a --text file was checked; the help pages were not, and every rank crashed in the GPT's
    data (`RuntimeError: maximum size for tensor at dimension 0 is ...`) after the process group had formed."""
    from utils.gpt import help_pages

    stop = stopped_as_rank_0(monkeypatch, "context_parallel.py", 2, "--context", 48000)
    assert str(stop) == (f"error: Python's help pages have {len(help_pages()):,} characters, and a context of 48,000 "
                         "tokens needs at least 1,920,040 (its held-out tenth must hold 4 blocks of it): lower "
                         "--context, or give a longer --text")


# A mistake that every rank meets alike, in the README's commands on 2 ranks: each case the step, its arguments, and
# the one line it must print (a bad argument is said by local rank 0, through utils.launch.errors_said_once; a check
# before the process group forms, and a snapshot's resume after it, by local rank 0, through said_once_per_node).
NOT_A_SNAPSHOT = b"\x00not a snapshot\xff" * 64
DAMAGED = ("error: cannot resume from snapshot.pt (UnpicklingError: not a file of tensors torch.load can read safely "
           "(Unsupported operand 0)); it is left in place: move it away to start anew")
SAID_ONCE = {
    "a finished job run again (step 3)": (
        ("multigpu_torchrun.py", 3, 1),
        "error: snapshot.pt holds 3 epochs already, and TOTAL_EPOCHS is 3: nothing to train. Ask for more epochs, or "
        "move it away to start anew"),
    "an option of another strategy (step 5)": (
        ("fsdp.py", 50, 10, "--strategy", "ddp", "--bf16"),
        "error: --bf16 and --cpu_offload are options of --strategy fsdp"),
    "a tp group that does not divide the ranks (step 7)": (
        ("tensor_parallel.py", 2, 1, "--tp", 3),
        "error: --tp 3 must divide the number of processes (2) and of attention heads (4): the processes form groups "
        "of 3, and each group splits every block's heads evenly"),
    "a schedule argparse does not know (step 8)": (
        ("pipeline_parallel.py", 1, 1, "--schedule", "zb"),
        "pipeline_parallel.py: error: argument --schedule: invalid choice: 'zb' (choose from 'gpipe', '1f1b')"),
    "a mesh that does not divide the ranks (step 11)": (
        ("one_mesh.py", 1, 1, "--tp", 3),
        "error: --pp 2 x --tp 3 = 6 does not divide the 2 processes: they form grids of pp x tp, dp of them"),
}
# The cases torchrun starts again after each failure (--max_restarts=1, as the fault pages start a job): no restart can
# fix them, and each attempt meets the mistake again; it is said at the first one (an argument by errors_said_once; a
# check and a resume by said_once_per_node, which counts the lines said in torchrun's store).
RESTARTED = {"a finished job run again (step 3)", "an option of another strategy (step 5)",
             "a schedule argparse does not know (step 8)"}


def workers_lines(said):
    """What a torchrun job's workers printed: its output up to torchrun's own report of the failure (its traceback)."""
    return said.split("Traceback (most recent call last):")[0]


def assert_said_once(case, said, code, line):
    workers = workers_lines(said)
    assert code not in (0, None), (case, said[-3000:])
    errors = [said_line for said_line in output.own_lines(workers) if "error:" in said_line]
    assert errors == [line], (case, said[-3000:])
    assert workers.count("usage: ") == ("error: argument" in errors[0]), (case, said[-3000:])
    assert not LIBRARY_NOISE.search(workers) and not output.epoch_losses(said), (case, said[-3000:])


@pytest.mark.slow
def test_a_mistake_every_rank_meets_is_said_once_and_the_job_exits_non_zero(tmp_path):
    """The cases above, each a job of 2 ranks, all at once (each stops within seconds): every job exits non-zero, and
    its workers print the one line once (every rank printed it, a usage line with each argparse error, until the
    steps said it once), no traceback or library line of theirs, and no epoch line; each snapshot is left as it was.
    Those torchrun starts again say it at its first attempt only (each attempt said it again). And a damaged snapshot
    on both nodes of a two-node job (step 4, one rank a node, each its own disk, --max_restarts=1): each node's
    terminal says it once. (A finished job run again used to exit 0 having done nothing, as the official tutorial
    does.)"""
    folders = [tmp_path / str(case) for case in range(len(SAID_ONCE) + 2)]
    for folder in folders:
        folder.mkdir()
    torch.save(snapshot_of(3), folders[0] / "snapshot.pt")
    for node_folder in folders[-2:]:
        (node_folder / "snapshot.pt").write_bytes(NOT_A_SNAPSHOT)
    snapshots = {path: path.read_bytes() for path in tmp_path.glob("*/snapshot.pt")}
    restarts = ["--max_restarts=1"]
    commands = [torchrun(*command, nproc=2, launcher_args=restarts if case in RESTARTED else ())
                for case, (command, _) in SAID_ONCE.items()]
    endpoint = f"127.0.0.1:{free_port()}"
    commands += [torchrun_node("multinode.py", 50, 10, endpoint=endpoint, launcher_args=restarts) for _ in range(2)]
    job = run(*commands, cwd=folders, timeout=300, check=False)
    for node, (case, (_, line)) in enumerate(SAID_ONCE.items()):
        said = job.node_output(node)
        assert_said_once(case, said, job.codes[node], line)
        # torchrun's line for each attempt that failed: it did start them again.
        assert said.count("failed (exitcode: ") == (2 if case in RESTARTED else 1), (case, said[-3000:])
    for node in (len(SAID_ONCE), len(SAID_ONCE) + 1):
        assert_said_once(f"a damaged snapshot (step 4, node {node - len(SAID_ONCE)})", job.node_output(node),
                         job.codes[node], DAMAGED)
    assert {path: path.read_bytes() for path in tmp_path.glob("*/snapshot.pt")} == snapshots
