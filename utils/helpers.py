"""Small helpers used by every step: argument checks, CPU threads, files replaced safely, errors in one line, a
clean exit."""
import argparse
import contextlib
import errno
import glob
import hashlib
import os
import re
import shutil
import sys
import tempfile
import warnings

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.torch_version import TorchVersion

from utils.collectives import gathered_json
from utils.gpt import size_of


def _whole_number(text, least, says):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"{says}, got {value}")
    return value


def positive_int(text):
    """argparse type: a whole number >= 1 (epochs, save interval, batch size, processes)."""
    return _whole_number(text, 1, "must be at least 1")


def non_negative_int(text):
    """argparse type: a whole number >= 0, where 0 turns a thing off (loader processes that read ahead)."""
    return _whole_number(text, 0, "must be 0 or more")


def _number(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if value != value:
        raise argparse.ArgumentTypeError("expected a number, got nan")
    return value


def positive_number(text):
    """argparse type: a number > 0; `inf` is one (e.g. a gradient-norm limit that never clips)."""
    value = _number(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be more than 0, got {text}")
    return value


def non_negative_number(text):
    """argparse type: a finite number >= 0, where 0 turns a thing off (a loss's weight, a capacity factor)."""
    value = _number(text)
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be 0 or more, and finite, got {text}")
    return value


def probability(text):
    """argparse type: a probability of dropping, from 0 (never: exact comparisons) up to, not including, 1."""
    value = _number(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be from 0 up to (not including) 1, got {text}")
    return value


def configure_cpu_threads(processes_on_this_machine):
    """Give each CPU process its share of the cores, so N processes do not fight over them.

    PyTorch starts one compute thread per core in *every* process; two processes on a 2-core laptop
    would then run 4 busy threads on 2 cores and both slow down. An OMP_NUM_THREADS set by the user
    (torchrun sets it to 1 when it starts several processes) wins.
    """
    threads = int(os.environ.get("OMP_NUM_THREADS") or 0)
    if threads < 1:
        threads = max(1, (os.cpu_count() or 1) // processes_on_this_machine)
    torch.set_num_threads(threads)
    return threads


def require_torchrun(example="torchrun --standalone --nproc_per_node=2"):
    """Stop with one clear line when a torchrun script is started wrongly.

    Started with plain `python`, the variables torchrun sets (RANK, LOCAL_RANK, WORLD_SIZE...) are missing;
    started with more processes per machine than it has GPUs, two processes would share one GPU.
    """
    script = " ".join([os.path.basename(sys.argv[0])] + (sys.argv[1:] or ["50", "10"]))
    if "LOCAL_RANK" not in os.environ:
        raise SystemExit(f"error: start this script with torchrun, which starts and numbers the processes: "
                         f"{example} {script}")
    require_a_gpu_each(int(os.environ["LOCAL_WORLD_SIZE"]), "--nproc_per_node=gpu")


def require_a_gpu_each(processes, hint):
    """`processes`, after checking this machine has a GPU for each (DDP and FSDP run one process per GPU; two on one
    GPU would fight over it): else one clear line and exit 1, where the official tutorial silently exits 0.
    Without CUDA, any number of CPU processes."""
    if torch.cuda.is_available() and processes > torch.cuda.device_count():
        raise SystemExit(f"error: {processes} processes on this machine but {torch.cuda.device_count()} GPU(s): "
                         f"one process per GPU ({hint})")
    return processes


def exit_without_teardown():
    """End this process at once, skipping Python's interpreter teardown; call it after destroy_process_group().

    With gloo, a thread of the process group can still be releasing the last collective's tensors when Python
    shuts down. It then needs the interpreter lock that the shutdown holds, and the process aborts with
    "terminate called without an active exception" (SIGABRT) although the job finished well: with torch 2.14 in
    about 1 run in 10 on a busy 2-core machine. Nothing is lost by skipping the teardown: output is flushed here
    and the scripts' files are closed by then.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)



def reason(error):
    """An error in one line, for the one line a step stops with: `Type: first line of its message` (the type alone when
    there is no message; for a distributed checkpoint's failure, the first failing rank's own error)."""
    if isinstance(error, UnusableSnapshot):
        return str(error)
    failures = getattr(error, "failures", None)  # torch.distributed.checkpoint.CheckpointException: {rank: (error, tb)}
    if failures:
        rank, (cause, _) = next(iter(sorted(failures.items())))
        # What makes a snapshot unusable is the same for every rank that reads it: said once, without a rank.
        return reason(cause) if isinstance(cause, UnusableSnapshot) else f"rank {rank}: {reason(cause)}"
    lines = str(error).strip().splitlines() or [""]
    message = lines[0]
    if message.startswith("Cannot use ``weights_only=True`` with TorchScript archives"):
        # torch advises loading it with weights_only=False, which runs the program it holds: not a snapshot's load.
        message = ("not a file of tensors torch.load can read safely (a TorchScript archive: a saved program, not a "
                   "snapshot)")
    elif message.startswith("Weights only load failed"):
        # torch.load's long advice to load with weights_only=False is wrong here: a snapshot is tensors and plain
        # containers, and a file that names code must not be loaded. What it found is the part to show.
        said = re.search(r"WeightsUnpickler error: ([^\n]+)", str(error))
        found = [said[1]] if said else [line.strip() for line in lines[1:]
                                         if line.strip() and not re.match(r"\s*(?:Please|Check|\(\d\))", line)]
        found = [part.split(" was not an allowed global")[0].split(". Please use")[0] for part in found]
        message = "not a file of tensors torch.load can read safely" + (f" ({found[0]})" if found else "")
    elif message.startswith("Error(s) in loading state_dict for") and len(lines) > 1:
        message = f"it holds another model than this {message.split()[-1].rstrip(':')}: " + _state_dict_mismatch(lines[1:])
    elif message.startswith("Missing key in checkpoint state_dict: "):  # a sharded snapshot (DCP) lacks one
        message = f"it holds another model than this run's: it has no {message.split(': ', 1)[1].rstrip('.')}"
    elif message.startswith("Size mismatch between saved"):
        message = f"it holds another model than this run's: its {message.rsplit(' for ', 1)[-1]} has another shape"
    if isinstance(error, OSError) and error.strerror:
        message = error.strerror + (f": {error.filename}" if error.filename else "")
    if not message and isinstance(error, EOFError):
        message = "the file ends too early (empty, or cut short)"
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


def _state_dict_mismatch(lines, most=3):
    """load_state_dict's complaints, shortened: `missing a, b, c (+9 more); unexpected d (+2 more); ...`."""
    parts = []
    for line in lines:
        kind, _, rest = line.strip().partition(":")
        keys = re.findall(r'"([^"]+)"', rest)
        if keys:
            more = f" (+{len(keys) - most} more)" if len(keys) > most else ""
            parts.append(f"{kind.split()[0].lower()} {', '.join(keys[:most])}{more}")
        elif kind.startswith("size mismatch"):
            parts.append(f"{kind}: another shape")
    return "; ".join(parts[:3]) or lines[0].strip()


def writable_path(path):
    """argparse type for --snapshot_path: a file or directory path whose folder exists and takes new files (a snapshot
    that cannot be written would otherwise be found out only at the first save, SAVE_EVERY epochs in). A snapshot
    folder that replacing() had set aside when a crash cut its swap short is put back first, so the start resumes
    from it instead of starting over; what saves cut short left of themselves is removed (remove_cut_short)."""
    folder = os.path.dirname(os.path.abspath(path))
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as error:
        raise argparse.ArgumentTypeError(f"cannot write in {folder} ({error.strerror})") from None
    recover_set_aside(path)
    remove_cut_short(path)
    return path


def remove_cut_short(path):
    """Remove the temporaries that saves of `path` left when they were cut short (`PATH.<pid or run id>.tmp`, and a
    sharded one's folder `PATH.<run id>.<epoch>.tmp`): a kill, a crash or a power cut in the middle of a save, which no
    handler of the process could undo. A temporary is never a whole snapshot (a save renames it only once whole), so
    nothing a run could resume from is lost. Called at the start of a job, when none of its saves is under way: each
    rank may call it at once."""
    for leftover in glob.glob(glob.escape(path) + ".*.tmp"):
        remove(leftover)


def dcp_folder(path):
    """argparse type for a folder that must hold a torch.distributed.checkpoint (its .metadata, written last): refused
    before any work when it does not, with what to do."""
    if not os.path.isfile(os.path.join(path, ".metadata")):
        raise argparse.ArgumentTypeError(f"{path} holds no checkpoint: write one first, e.g. `python "
                                         f"tools/seed_checkpoint.py {path}` with the step's --workload and --text")
    return path


def set_aside_name(path):
    """Where replacing() keeps the last version of a directory while it renames the new one in."""
    return f"{path}.previous"


def recover_set_aside(path):
    """Finish what a crash in the middle of replacing()'s swap of a directory left: if `path` is missing and its
    set-aside copy is there (the crash came between the two renames), rename the copy back and say so; if both are
    there (it came after), remove the outdated copy. True when this process put one back. Every rank of a job may
    call it at once: one rename wins."""
    aside = set_aside_name(path)
    if not os.path.isdir(aside):
        return False
    if os.path.exists(path):
        remove(aside)
        return False
    try:
        os.rename(aside, path)
    except OSError:
        if os.path.exists(path):  # another process of the job put it back first
            return False
        raise
    print(f"{path}: a save was cut short in the middle of its swap; the snapshot before it, set aside as {aside}, "
          "is put back", flush=True)
    return True


# The temporaries being written at this moment (by replacing(), or in the background: being_written()): a worker
# stopped by Ctrl-C removes them (utils.launch).
UNFINISHED = set()


def being_written(tmp):
    """`tmp`, a temporary that a save writes in the background (an asynchronous save's thread) before replacing()
    puts it in place: from now on a worker stopped by Ctrl-C removes it, as it removes what replacing() writes."""
    UNFINISHED.add(tmp)
    return tmp


@contextlib.contextmanager
def replacing(path, tmp=None, rename=True):
    """Write a new version of `path` to a temporary file (or directory), then put it in place of `path`: a crash at
    any moment leaves either the old version or the new one, whole. The temporary name is this process's own (its
    pid), so two writers never share one; pass `tmp` when several processes write parts of it.

        with replacing("snapshot.pt") as tmp:
            torch.save(snapshot, tmp)

    A file is renamed over the old one in one atomic step. A directory cannot be (os.replace refuses one that is not
    empty), so the old one is first renamed aside (set_aside_name), the new one renamed in, and the old one removed:
    a crash between the two renames leaves only the set-aside copy, which the next start puts back (writable_path).

    A failed write (a full disk, say) removes the partial file and stops with one line that names the cause; the
    last version stays. Ctrl-C (KeyboardInterrupt) and SystemExit remove it too, and go on as they are.
    `rename=False`: this process wrote its part only; another one renames.
    """
    tmp = tmp or f"{path}.{os.getpid()}.tmp"
    UNFINISHED.add(tmp)
    try:
        yield tmp
    except BaseException as error:
        folder = os.path.dirname(os.path.abspath(path))
        # Another rank of a sharded save may have removed the temporary already, giving the space back: the error says
        # it too (torch.save says only "unexpected pos ..." on a full disk).
        full = shutil.disk_usage(folder).free < 1 << 20 or _out_of_space(error)
        remove(tmp)
        if not isinstance(error, Exception) and type(error).__name__ != "CheckpointException":  # (DCP's is a
            raise  # BaseException); Ctrl-C and SystemExit go on as they are
        cause = f"no space left on the disk of {folder}" if full else reason(error)
        raise SystemExit(f"error: cannot write {path} ({cause}); the last one is kept, as it was") from None
    finally:
        UNFINISHED.discard(tmp)
    if rename and os.path.isdir(path):
        aside = set_aside_name(path)
        remove(aside)  # what a crash after the swap left: `path` is whole
        os.replace(path, aside)
        os.replace(tmp, path)
        remove(aside)
    elif rename:
        os.replace(tmp, path)


def _out_of_space(error):
    """True when `error`, or what it was raised from, or any rank's error of a distributed checkpoint's save, says the
    disk had no room: ENOSPC or EDQUOT, or torch.save's "unexpected pos", all it says when a write stops short."""
    failures = getattr(error, "failures", None)  # DCP's CheckpointException: {rank: (error, traceback)}
    for cause in [cause for cause, _ in failures.values()] if failures else [error]:
        while cause is not None:
            if isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT) or \
                    "unexpected pos" in str(cause):
                return True
            cause = cause.__cause__ or cause.__context__
    return False


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


def remove(path):
    """Remove a file or a directory tree, if it is there."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.remove(path)


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


def exists_on_any_rank(path, device):
    """True on every rank when any rank finds `path`. A collective: call it on every rank. For a snapshot whose
    loading is itself a collective (DCP's), so that either all ranks load it or none does: a rank that saw no
    snapshot on its disk then fails to load instead of waiting for the others in a different collective."""
    found = torch.tensor(os.path.exists(path), device=device)
    dist.all_reduce(found, op=dist.ReduceOp.MAX)
    return bool(found)


def require_same_start(epochs_run, device, unit="epochs"):
    """Stop every rank with one line unless all of them resume from the same epoch (or step: unit="steps"). Each node
    reads the snapshot from its own disk: if the nodes do not share that storage, one resumes while another starts
    over, and their collectives stop matching. A collective: call it on every rank once the snapshot is loaded (or not)."""
    seen = torch.tensor([epochs_run, -epochs_run], device=device)
    dist.all_reduce(seen, op=dist.ReduceOp.MAX)
    if seen[0] != -seen[1]:
        raise SystemExit(f"error: ranks resume from different {unit} ({-int(seen[1])} to {int(seen[0])}): put "
                         "--snapshot_path on storage that every node shares")


def require_dense_gpt(args):
    """Stop with one line, before any process group forms, when a GPT step that does not add the load-balancing loss
    (all but expert_parallel.py, which has --aux_weight) is given the mixture-of-experts GPT."""
    if "moe" in args.workload and not hasattr(args, "aux_weight"):
        raise SystemExit(f"error: --workload {args.workload} is the mixture-of-experts GPT: expert_parallel.py (step "
                         "10) trains it, with the load-balancing loss its routers need")


def require_tp_fits(args, world_size):
    """Stop with one line, before any process group forms, when tensor_parallel.py's `--tp` cannot split the job: the
    processes must form whole tp groups, and each block's attention heads must split evenly over a group (a rank
    computes heads/tp of them). The heads are those of the GPT size that `--workload` trains here."""
    require_dense_gpt(args)  # its plan splits one MLP per block, not experts
    tp, heads = args.tp, size_of(args.workload).n_head
    if world_size % tp or heads % tp:
        raise SystemExit(f"error: --tp {tp} must divide the number of processes ({world_size}) and of attention heads "
                         f"({heads}): the processes form groups of {tp}, and each group splits every block's heads "
                         "evenly")


def require_torch_for_fsdp(sharded=True):
    """Stop with one line, before any process group forms, where this torch's FSDP (fully_shard) does not train CPU
    processes right: 2.6's runs on CUDA streams only (its first forward fails), and 2.7's and 2.8's reduce-scatter
    the gradients with ReduceOp.AVG, which their gloo takes for a sum: the gradients come out N times the mean over N
    ranks, silently (measured with 2.7.1 and 2.8.0, against one process; right from 2.9.1 on). On GPUs (NCCL) they
    are right. `sharded`: whether the job shards at all (fsdp.py's --strategy ddp does not)."""
    if sharded and not torch.cuda.is_available() and TorchVersion(torch.__version__) < (2, 9):
        wrong = ("runs on CUDA streams only" if TorchVersion(torch.__version__) < (2, 7) else
                 "sums the gradients over the ranks instead of averaging them (gloo has no average)")
        raise SystemExit(f"error: FSDP of torch {torch.__version__} {wrong} on CPU processes: use torch 2.9 or newer "
                         "there (on GPUs it is right from 2.6)")


class UnusableSnapshot(Exception):
    """What makes a snapshot unusable, in words (reason() shows the message alone, with no type)."""


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


def require_same_arguments(args, ignore=("snapshot_path",)):
    """Stop every rank with one line, before any training, when the nodes were started with different arguments
    (TOTAL_EPOCHS, SAVE_EVERY, the batch size, the workload...): their collectives would not match, and the job would
    crash with a gloo abort or wait out --timeout. A collective: call it on every rank, right after the process group
    forms. The snapshot path may differ (nodes can mount shared storage at different places)."""
    # As JSON in tensors, not pickled objects: a process that joined the group could make a pickle run its code.
    everyone = gathered_json({name: value for name, value in vars(args).items() if name not in ignore})
    for rank, theirs in enumerate(everyone[1:], start=1):  # every rank compares the same pairs: all say the same
        different = [name for name in everyone[0] if theirs.get(name) != everyone[0][name]]
        if different:
            name = different[0]
            raise SystemExit(f"error: the nodes were started with different arguments: {name} is {everyone[0][name]} "
                             f"on rank 0 but {theirs[name]} on rank {rank}; start every node with the same command")


def weights_digest(model, device):
    """Eight hex digits that differ when the weights do: every rank hashes the part of each parameter it holds (a
    shard under FSDP), and the group sums the hashes. A collective of the default group: call it on every rank.
    Step 13 prints it at every step, so two replica groups that hold the same weights show the same digits."""
    hashed = hashlib.sha256()
    for parameter in model.parameters():
        local = parameter.to_local() if isinstance(parameter, DTensor) else parameter
        hashed.update(local.detach().float().cpu().numpy().tobytes())
    total = torch.tensor(int(hashed.hexdigest()[:12], 16), dtype=torch.int64, device=device)
    dist.all_reduce(total)
    return f"{int(total) % 16**8:08x}"


def quiet_torchft():
    """Silence what torchft makes torch and Python print that a learner cannot act on, each at its cause: torchft's
    gloo group calls a method of torch's that is now a no-op and warns in C++ (replaced here by a silent no-op),
    torch warns once that a checkpoint received from a peer sits in a read-only buffer (torchft loads it and copies
    nothing back), the checkpoint server (Python's http.server) logs every request a healing group makes, and torchft's
    Python side logs every failed step with a traceback (the step prints one line). torchft's Rust side logs as RUST_LOG
    says (step 13 sets it before torchft loads)."""
    import http.server
    import logging
    import warnings

    backend = dist.ProcessGroupGloo
    if hasattr(backend, "_set_sequence_number_for_group"):
        backend._set_sequence_number_for_group = lambda self: None
    warnings.filterwarnings("ignore", message="The given buffer is not writable")
    http.server.BaseHTTPRequestHandler.log_message = lambda self, *args: None
    # torchft's Python side logs a failed collective with its traceback, and goes on: the step says it in one line.
    logging.getLogger("torchft").setLevel(logging.CRITICAL)
