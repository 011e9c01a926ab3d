"""Snapshots: where a long run keeps them (step-<steps> in its folder), the loading that stops in one line when a
snapshot cannot be used, and the checks before one is resumed (written by this step, epochs left)."""
import contextlib
import glob
import os
import warnings

from utils.errors import reason
from utils.files import remove, writable_path


def step_snapshot(folder, steps):
    """The path of a long run's snapshot after `steps` optimizer steps, in its --snapshot_path `folder`."""
    return os.path.join(folder, f"step-{steps:08d}")


def whole_snapshots(folder):
    """The paths of the whole snapshots of a long run's folder (`step-<steps>`, renamed so once whole), oldest first."""
    names = os.listdir(folder) if os.path.isdir(folder) else ()
    return [os.path.join(folder, name) for name in sorted(names) if name.startswith("step-") and "." not in name]


def latest_snapshot(folder):
    """The last whole snapshot of a long run's folder (the one of the most steps), or a path that does not exist."""
    return (whole_snapshots(folder) or [os.path.join(folder, "none")])[-1]


def snapshot_folder(path):
    """argparse type for a long run's --snapshot_path, a folder of snapshots (`step-<steps>`): where writable_path
    allows a snapshot, with what saves cut short left in it removed (`step-<steps>.<run id>.tmp`)."""
    writable_path(path)
    for leftover in glob.glob(os.path.join(glob.escape(path), "*.tmp")):
        remove(leftover)
    return path


@contextlib.contextmanager
def stop_if_unloadable(snapshot_path):
    """Around the loading of a snapshot: whatever goes wrong (garbage bytes, a file cut short, another model's
    snapshot, a missing key) stops this rank with one line that names the cause, and the file stays where it is.

        with stop_if_unloadable("snapshot.pt"):
            snapshot = torch.load("snapshot.pt", weights_only=True)
            model.load_state_dict(snapshot["MODEL_STATE"])
    """
    try:
        with warnings.catch_warnings():
            # torch.load warns that it met a TorchScript archive before it refuses it: the line below says what it is.
            warnings.filterwarnings("ignore", message="'torch.load' received a zip file that looks like a TorchScript")
            yield
    except BaseException as error:
        # Ctrl-C and SystemExit go on as they are; DCP's CheckpointException is a BaseException, and is caught.
        if not isinstance(error, Exception) and type(error).__name__ != "CheckpointException":
            raise
        raise SystemExit(f"error: cannot resume from {snapshot_path} ({reason(error)}); it is left in place: move it "
                         "away to start anew") from None


def require_written_by(step, path, snapshot):
    """Stop with one line, before a snapshot is resumed, unless `step` (a script's name) saved it: a snapshot of
    another step goes on with another loop, even where the model is the same (step 5 trains the GPT with no schedule,
    step 7 splits it, step 9 resumes step 6's file as its own). The line says what the snapshot holds and what to do;
    the snapshot is left as it is. Every step names itself in its snapshots (STEP); one without the name is from
    before they did.

    `snapshot`: a single-file snapshot, already loaded (a dict), whose STEP is read there, on this rank alone; or the
    SnapshotReader of a sharded one (a folder: utils.snapshot_reader), through which its STEP and EPOCHS_RUN are read
    with torch.distributed.checkpoint: a collective, call it on every rank."""
    if not isinstance(snapshot, dict):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

        reader, snapshot = snapshot, dict(STEP="", EPOCHS_RUN=0, STEPS_RUN=-1)
        dcp.load(snapshot, storage_reader=reader, planner=DefaultLoadPlanner(allow_partial_load=True))  # missing: kept
    saved, epochs_run = snapshot.get("STEP", ""), snapshot.get("EPOCHS_RUN", 0)
    if saved != step:
        # The long run (step 12) counts optimizer steps; every other step, epochs.
        done, unit = (snapshot["STEPS_RUN"], "step") if snapshot.get("STEPS_RUN", -1) >= 0 else (epochs_run, "epoch")
        epochs = f"{done} {unit}" + "s" * (done != 1)
        holds = f"{saved}'s snapshot" if saved else "a snapshot that names no step (an older one)"
        raise SystemExit(f"error: {path} holds {holds} after {epochs}, not {step}'s: give this run its own "
                         f"--snapshot_path, or move {path} away to start anew; it is left in place")


def require_epochs_left(epochs_run, total_epochs, snapshot_path, unit="epochs"):
    """Stop with one line when a snapshot already holds all the epochs asked for: a finished job run again (the long
    run counts optimizer steps: unit="steps")."""
    if epochs_run >= total_epochs:
        raise SystemExit(f"error: {snapshot_path} holds {epochs_run} {unit} already, and TOTAL_{unit.upper()} is "
                         f"{total_epochs}: nothing to train. Ask for more {unit}, or move it away to start anew")
