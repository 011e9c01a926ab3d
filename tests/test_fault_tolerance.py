"""Fault tolerance for real: a worker of a torchrun job is SIGKILLed from outside, torchrun restarts the group, the
workers resume from the snapshot, and the job ends bitwise identical to one that was never interrupted. A job that
fails more often than --max_restarts allows stops with a clear message and leaves its last snapshot usable; a snapshot
that cannot be resumed from stops the job with one line and stays where it is."""
import contextlib
import os
import re

import pytest
import torch
from torch import nn

from expect import assert_bitwise_equal
from tools.jobs import output, run, script, start, torchrun
from utils import make_workload

EPOCHS, SAVE_EVERY = 9, 3  # snapshots after epochs 2, 5 and 8
ARGS = (EPOCHS, SAVE_EVERY, "--batch_size", 8)  # small batches: an epoch lasts long enough to kill a worker inside it
NPROC = 2
SNAPSHOT = "snapshot.pt"


def load(path):
    return torch.load(path, map_location="cpu", weights_only=True)


def launched(tmp_path, max_restarts):
    """The tutorial's torchrun command with --max_restarts, as it is (torchrun's shared rendezvous store: the steps
    give each attempt keys of its own), started in the background."""
    return start(torchrun("multigpu_torchrun.py", *ARGS, nproc=NPROC, launcher_args=[f"--max_restarts={max_restarts}"]),
                 cwd=tmp_path)


def resumed_line(restart):
    return rf"\[rank 0/\d+[^\]]*\] resuming from epoch \d+, restart {restart}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The final snapshot of the same job, never interrupted."""
    workdir = tmp_path_factory.mktemp("uninterrupted")
    run(torchrun("multigpu_torchrun.py", *ARGS, nproc=NPROC), cwd=workdir)
    return load(workdir / SNAPSHOT)


# Each job is bounded by its waits (60 s an event, 120 s for the end), not by a test-wide figure: four restarts, each of
# two processes that import torch, took more than 180 s on CI's busy 2 cores. pytest.ini's 600 s is the backstop.
@pytest.mark.slow
def test_a_worker_killed_at_four_points_the_job_still_ends_bitwise_identical(tmp_path, reference):
    """Four SIGKILLs in one job (--max_restarts=4), each after a line that shows where training is. A kill lands a
    moment after its line, usually in the next epoch; wherever it lands, the end result must be the same."""
    with launched(tmp_path, max_restarts=4) as job:
        job.wait_for(r"\] epoch 0 \| steps")  # 1. before any snapshot: the writer (rank 0) dies in epoch 1
        job.kill_worker(rank=0, restart=0)
        killed_before_any_snapshot = not (tmp_path / SNAPSHOT).exists()
        job.wait_for(r"\] epoch 2 \| snapshot saved")  # 2. right after a snapshot (restart 1 started over)
        job.kill_worker(rank=1, restart=1)
        job.wait_for(resumed_line(2))  # 3. mid-interval: two epochs after the resume, neither saved yet
        job.wait_for(output.EPOCH)
        job.wait_for(output.EPOCH)
        job.kill_worker(rank=0, restart=2)
        job.wait_for(resumed_line(3))  # 4. right after the first snapshot since that resume
        job.wait_for(output.SAVED)
        job.kill_worker(rank=1, restart=3)
        [code] = job.wait(timeout=120)
    assert code == 0, job.output
    resumed = job.resumes
    assert killed_before_any_snapshot and 1 not in resumed, f"the first kill came after a snapshot:\n{job.output}"
    assert sorted(resumed) == [2, 3, 4], job.output
    assert resumed[2] >= 3 and resumed[4] >= resumed[3] + SAVE_EVERY, resumed  # typically 3, 3 (work lost), 6
    assert all(epoch % SAVE_EVERY == 0 for epoch in resumed.values()), resumed  # only from a snapshot
    assert_bitwise_equal(load(tmp_path / SNAPSHOT), reference)


@pytest.mark.slow
def test_more_failures_than_max_restarts_stop_the_job_and_a_rerun_finishes_from_the_last_snapshot(tmp_path, reference):
    with launched(tmp_path, max_restarts=1) as job:
        job.wait_for(r"\] epoch 2 \| snapshot saved")
        job.kill_worker(rank=1, restart=0)
        resumed_from = int(job.wait_for(output.RESUMED)["epoch"])
        last_pid = job.kill_worker(rank=0, restart=1)  # a second failure: no restart left
        [code] = job.wait(timeout=60)
    assert code not in (0, None), job.output
    assert f"Signal 9 (SIGKILL) received by PID {last_pid}" in job.output, job.output  # torchrun's report names it

    snapshot = load(tmp_path / SNAPSHOT)  # the last good snapshot: whole, and the one the last attempt resumed from
    assert snapshot["EPOCHS_RUN"] == resumed_from
    workload = make_workload()
    workload.model.load_state_dict(snapshot["MODEL_STATE"])
    workload.optimizer.load_state_dict(snapshot["OPTIMIZER_STATE"])

    (tmp_path / f"{SNAPSHOT}.tmp").write_bytes(b"half of a snapshot")  # what a crash in the middle of a write leaves
    rerun = run(torchrun("multigpu_torchrun.py", *ARGS, nproc=NPROC), cwd=tmp_path, logs=tmp_path / "rerun")
    assert rerun.resumes == {0: resumed_from}, rerun.output  # the leftover temporary file is ignored
    assert_bitwise_equal(load(tmp_path / SNAPSHOT), reference)


def write_garbage(path):
    path.write_bytes(b"\x00not a snapshot\xff" * 64)


def write_other_models_snapshot(path):
    model = nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters())
    torch.save(dict(MODEL_STATE=model.state_dict(), OPTIMIZER_STATE=optimizer.state_dict(), EPOCHS_RUN=2), path)


def write_single_device_checkpoint(path):
    torch.save(make_workload().model.state_dict(), path)  # single_gpu.py's checkpoint.pt: a bare state dict


def write_empty(path):
    path.write_bytes(b"")  # what a full disk or a crash in the middle of a copy can leave


def write_torchscript(path):
    """A TorchScript archive (a saved program) as the snapshot: torch.load's refusal advises weights_only=False."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.jit is deprecated: a stranger's file may still be one
        torch.jit.save(torch.jit.script(nn.Linear(3, 2)), path)


def test_the_line_for_an_unreadable_snapshot_says_what_is_wrong_not_to_load_it_unsafely(tmp_path):
    """torch.load's own message for a file that is not tensors and plain containers advises weights_only=False; the
    step's line says what the file is instead (the cause the unpickler found)."""
    from utils.errors import reason

    for write, found in ((write_garbage, "Unsupported operand"), (lambda path: torch.save(os.getcwd, path), "GLOBAL")):
        write(tmp_path / "x.pt")
        with pytest.raises(Exception) as error:
            torch.load(tmp_path / "x.pt", weights_only=True)
        line = reason(error.value)
        assert line.startswith("UnpicklingError: not a file of tensors torch.load can read safely (") and found in line
        assert "weights_only" not in line, line


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP notes that it runs in one process
def test_a_sharded_snapshot_of_another_model_is_told_by_what_it_lacks_or_holds_in_another_shape(tmp_path):
    """DCP refuses a load whose keys or shapes the snapshot does not have with its own words ("Missing key in
    checkpoint state_dict", "Size mismatch between saved ..."); the steps' line says what that means. In one process,
    without a process group, as DCP allows."""
    import torch.distributed.checkpoint as dcp

    from utils.errors import reason

    dcp.save({"MODEL_STATE": {"w": torch.zeros(2)}}, checkpoint_id=tmp_path)
    for template, said in (({"v": torch.zeros(2)}, "it has no MODEL_STATE.v"),
                           ({"w": torch.zeros(3)}, "its MODEL_STATE.w has another shape")):
        with pytest.raises(BaseException) as error:  # DCP's CheckpointException is a BaseException
            dcp.load({"MODEL_STATE": template}, checkpoint_id=tmp_path)
        assert reason(error.value).endswith(f"Error: it holds another model than this run's: {said}"), \
            reason(error.value)


@pytest.mark.parametrize("write_snapshot", [write_garbage, write_other_models_snapshot, write_single_device_checkpoint,
                                            write_empty, write_torchscript],
                         ids=["garbage bytes", "another model", "single-device checkpoint", "empty file", "TorchScript"])
def test_a_snapshot_that_cannot_be_resumed_stops_with_one_line_that_names_it_and_its_cause(tmp_path, write_snapshot):
    """multigpu_torchrun.py's _load_snapshot, in this process, on each kind of file that is no snapshot of this model:
    one line naming the file and the cause, never torch's advice to load it with weights_only=False, and no warning
    beside it (the test below runs a real job on one of them)."""
    import warnings

    import multigpu_torchrun

    path = tmp_path / SNAPSHOT
    write_snapshot(path)
    workload = make_workload()
    trainer = multigpu_torchrun.Trainer.__new__(multigpu_torchrun.Trainer)  # no __init__: it needs a process group
    trainer.model, trainer.optimizer, trainer.device = workload.model, workload.optimizer, torch.device("cpu")
    trainer.snapshot_path, trainer.tag = str(path), "[rank 0/1 | cpu]"
    with pytest.raises(SystemExit) as stop, warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        trainer._load_snapshot()
    assert re.fullmatch(rf"error: cannot resume from \S*{SNAPSHOT} \(\w+: [^\n]*\); it is left in place: move it away "
                        r"to start anew", str(stop.value)), stop.value
    assert "weights_only" not in str(stop.value) and not warned, (stop.value, [str(w.message) for w in warned])
    if write_snapshot is write_empty:
        assert "(EOFError: the file ends too early (empty, or cut short))" in str(stop.value)
    if write_snapshot is write_torchscript:
        assert "(RuntimeError: not a file of tensors torch.load can read safely (a TorchScript archive: a saved " \
               "program, not a snapshot))" in str(stop.value)


@pytest.mark.slow
def test_a_job_that_finds_an_unusable_snapshot_stops_with_one_line_and_leaves_it_in_place(tmp_path):
    """The real job on garbage bytes: a non-zero exit, the one line (no traceback through the script), no epoch
    trained, and the file as it was."""
    path = tmp_path / SNAPSHOT
    write_garbage(path)
    before = path.read_bytes()
    job = run(torchrun("multigpu_torchrun.py", *ARGS, nproc=1), cwd=tmp_path, check=False)  # one rank is enough
    assert job.returncode not in (0, None), job.output
    assert re.search(rf"^error: cannot resume from {SNAPSHOT} \(\w+: [^\n]*\); it is left in place: "
                     r"move it away to start anew$", job.output, re.M), job.output
    assert f'File "{script("multigpu_torchrun.py")}", line' not in job.output  # no traceback through the script
    assert not job.losses, "it trained anyway"
    assert path.read_bytes() == before


# The steps that save their snapshot in one file, and the workload each trains by default here.
SINGLE_FILE_STEPS = {"multigpu_torchrun.py": "synthetic", "multinode.py": "synthetic", "gpt.py": "gpt-cpu",
                     "context_parallel.py": "gpt-cpu"}


def loading_trainer(step, path, text):
    """`step`'s Trainer, in this process, with what its _load_snapshot uses (no __init__: it needs a process group),
    on the step's workload (the GPT's on the help pages' excerpt); its snapshot at `path`."""
    import argparse
    import importlib

    from torch.optim.lr_scheduler import LambdaLR

    from utils.loop import WarmupCosine

    module = importlib.import_module(step.removesuffix(".py"))
    name = SINGLE_FILE_STEPS[step]
    workload = make_workload(name, **({"text": str(text)} if "gpt" in name else {}))
    trainer = module.Trainer.__new__(module.Trainer)
    trainer.model, trainer.optimizer, trainer.device = workload.model, workload.optimizer, torch.device("cpu")
    trainer.snapshot_path, trainer.tag, trainer.rank, trainer.global_rank = str(path), "[rank 0/1 | cpu]", 0, 0
    trainer.schedule = WarmupCosine(10)
    trainer.scheduler = LambdaLR(workload.optimizer, trainer.schedule)
    trainer.scaler = torch.amp.GradScaler("cpu", enabled=False)
    trainer.args, trainer.steps_per_epoch = argparse.Namespace(total_epochs=3), 1
    return trainer


def written_by(step, trainer):
    """The snapshot `step` saves after one epoch (its keys, as its _save_snapshot writes them), of `trainer`'s state."""
    from utils.loop import rng_state

    snapshot = dict(MODEL_STATE=trainer.model.state_dict(), OPTIMIZER_STATE=trainer.optimizer.state_dict(),
                    EPOCHS_RUN=1, STEP=step)
    if "gpt" in SINGLE_FILE_STEPS[step]:
        snapshot.update(SCHEDULER_STATE=trainer.scheduler.state_dict(), SCALER_STATE=trainer.scaler.state_dict(),
                        RNG_STATES=[rng_state()])
    return snapshot


# Every pair of steps whose snapshots hold the same model: the one that reads, and the one that wrote.
SAME_MODEL = [(reader, writer) for reader, model in SINGLE_FILE_STEPS.items() for writer, theirs in
              SINGLE_FILE_STEPS.items() if model == theirs]


@pytest.mark.parametrize("reader, writer", SAME_MODEL)
def test_a_single_file_snapshot_resumes_in_the_step_that_wrote_it_and_no_other(tmp_path, monkeypatch, text, reader,
                                                                               writer):
    """Each step's snapshot names the step; a step that finds another's of the same model (step 3's and step 4's,
    step 6's and step 9's, which load into each other without a complaint; another model's is refused by its keys,
    above) stops with one line that says whose it is, leaving it as it was. Step 9 used to resume step 6's file as its
    own, and overwrite it at its next save."""
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    path = tmp_path / "snapshot.pt"
    torch.save(written_by(writer, loading_trainer(writer, path, text)), path)
    before = path.read_bytes()
    trainer = loading_trainer(reader, path, text)
    if reader == writer:
        assert trainer._load_snapshot() == 1
        return
    with pytest.raises(SystemExit) as stop:
        trainer._load_snapshot()
    assert str(stop.value) == (f"error: {path} holds {writer}'s snapshot after 1 epoch, not {reader}'s: give this run "
                               f"its own --snapshot_path, or move {path} away to start anew; it is left in place")
    assert path.read_bytes() == before


def write_empty_folder(path):
    path.mkdir()


def write_garbled_metadata(path):
    import torch.distributed.checkpoint as dcp

    dcp.save({"MODEL_STATE": {"w": torch.zeros(2)}, "STEP": "expert_parallel.py"}, checkpoint_id=path)
    (path / ".metadata").write_bytes(b"\x00garbage\xff" * 8)


def write_step_9s_file(path):
    torch.save(dict(MODEL_STATE={}, EPOCHS_RUN=1, STEP="context_parallel.py"), path)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP notes that it runs in one process
@pytest.mark.parametrize("write, said", [
    (write_empty_folder, "the folder holds no .metadata, the file a sharded save writes last: it is not a snapshot, "
                         "or its save was cut short"),
    (write_garbled_metadata, "its .metadata is not a pickle (at position 0, opcode b'\\x00' unknown)"),
    (write_step_9s_file, "it is a file, not the folder of a sharded snapshot (context_parallel.py's snapshot)"),
], ids=["empty folder", "garbled .metadata", "step 9's file"])
def test_an_unreadable_sharded_snapshot_stops_with_one_line_that_says_what_is_wrong_and_nothing_else(tmp_path, capfd,
                                                                                                    write, said):
    """What a sharded step (5, 7, 8, 10, 11) meets first when it finds its --snapshot_path: the check of the folder
    before DCP reads it, in this process. DCP itself met these with a traceback per rank and attempt ("Global metadata
    is not found..."), then `AssertionError: metadata is None`; now one line says in words what is wrong, DCP prints
    nothing, and the files stay as they were."""
    from utils import require_written_by, stop_if_unloadable
    from utils.snapshot_reader import SnapshotReader

    path = tmp_path / "ep_snapshot"
    write(path)
    before = sorted((file.name, file.read_bytes()) for file in ([path] if path.is_file() else path.iterdir()))
    capfd.readouterr()
    with pytest.raises(SystemExit) as stop, stop_if_unloadable(str(path)):
        require_written_by("expert_parallel.py", str(path), SnapshotReader(path))
    assert str(stop.value) == (f"error: cannot resume from {path} ({said}); it is left in place: move it away to start "
                               "anew")
    assert capfd.readouterr() == ("", "")
    assert sorted((file.name, file.read_bytes()) for file in ([path] if path.is_file() else path.iterdir())) == before


class Planted:
    """What someone else's snapshot may hold instead of data: unpickled, it calls builtins.exec, which creates the file
    `marker` (any other code would run the same way)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').close()",)


def plant_in_metadata(path, marker):
    """A sharded snapshot whose .metadata is a pickle that runs code as it is read."""
    import pickle

    import torch.distributed.checkpoint as dcp

    dcp.save({"MODEL_STATE": {"w": torch.zeros(2)}, "STEP": "expert_parallel.py"}, checkpoint_id=path)
    (path / ".metadata").write_bytes(pickle.dumps(Planted(marker)))


def plant_in_a_value(path, marker):
    """A sharded snapshot whose STEP, a value DCP keeps as a pickle, runs code as it is read."""
    import torch.distributed.checkpoint as dcp

    dcp.save({"MODEL_STATE": {"w": torch.zeros(2)}, "STEP": Planted(marker)}, checkpoint_id=path)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP notes that it runs in one process
@pytest.mark.parametrize("plant, where, called", [(plant_in_metadata, ".metadata", "builtins.exec"),
                                                  (plant_in_a_value, "STEP", "exec")],
                         ids=["in .metadata", "in a value"])
def test_code_planted_in_a_sharded_snapshot_runs_in_torch_and_the_steps_refuse_it_before(tmp_path, plant, where,
                                                                                         called):
    """torch 2.14.1's DCP reads a snapshot's .metadata with pickle and its values that are no tensors with
    torch.load(weights_only=False): a folder from someone else runs its code in every rank that loads it (the first
    half, which shows it). The steps check the folder before DCP reads it (require_written_by, in this process):
    one line that names what it would call, the code never run, the folder left as it was."""
    import torch.distributed.checkpoint as dcp

    from utils import require_written_by, stop_if_unloadable
    from utils.snapshot_reader import SnapshotReader

    path, marker = tmp_path / "ep_snapshot", tmp_path / "the planted code ran"
    plant(path, marker)
    with contextlib.suppress(BaseException):  # DCP's own error, once the code has run (a CheckpointException)
        dcp.load({"MODEL_STATE": {"w": torch.zeros(2)}, "STEP": ""}, checkpoint_id=path)
    assert marker.exists(), "torch reads the planted code and runs it"
    marker.unlink()
    before = sorted((file.name, file.read_bytes()) for file in path.iterdir())
    with pytest.raises(SystemExit) as stop, stop_if_unloadable(str(path)):
        require_written_by("expert_parallel.py", str(path), SnapshotReader(path))
    assert str(stop.value) == (f"error: cannot resume from {path} (its {where} would call {called} as it is read: "
                               "a snapshot holds tensors, numbers and text, and this one holds code); it is left in "
                               "place: move it away to start anew")
    assert not marker.exists(), "the steps never ran it"
    assert sorted((file.name, file.read_bytes()) for file in path.iterdir()) == before


@pytest.mark.parametrize("step", SINGLE_FILE_STEPS)
def test_code_planted_in_a_single_file_snapshot_is_refused_with_one_line_and_never_runs(tmp_path, monkeypatch, text,
                                                                                      step):
    """Every single-file step reads its snapshot with torch.load(weights_only=True): a pickle that names code (here in
    place of the model's state) stops the step with one line that says so, and the code never runs."""
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    path, marker = tmp_path / "snapshot.pt", tmp_path / "the planted code ran"
    trainer = loading_trainer(step, path, text)
    torch.save(dict(written_by(step, trainer), MODEL_STATE=Planted(marker)), path)
    with pytest.raises(SystemExit) as stop:
        trainer._load_snapshot()
    assert str(stop.value) == (f"error: cannot resume from {path} (UnpicklingError: not a file of tensors torch.load "
                               "can read safely (Unsupported global: GLOBAL exec)); it is left in place: move it away "
                               "to start anew"), stop.value
    assert not marker.exists(), "the planted code ran"
