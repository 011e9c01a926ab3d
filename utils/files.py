"""Files written safely: a new version replaces the old one only once whole (replacing), what a save cut short
left is removed and a swap cut short is undone at the next start (writable_path), and the temporaries being written
now are known, so a worker stopped by Ctrl-C removes them (UNFINISHED)."""
import argparse
import contextlib
import errno
import glob
import os
import shutil
import tempfile

from utils.errors import reason


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


def remove(path):
    """Remove a file or a directory tree, if it is there."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.remove(path)
