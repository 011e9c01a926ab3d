"""Faults injected at known points, each switched on by its own environment variable (with or without JOB_RECORD_DIR).
They write no record (a rank that skips an all_reduce or stalls says so, in a line that starts with "[job]"). A slow
disk, JOB_SLOW_SAVE, is saves.py's.

- JOB_KILL_AT=`RESTART:RANK:EPOCH`: that rank SIGKILLs itself as it begins that epoch in that attempt: a crash at a
  known point (the epoch counts passes over the DataLoader when the sampler has no set_epoch).
- JOB_KILL_AT_STEP=`RESTART:RANK:STEP`: that rank SIGKILLs itself just before its optimizer step number STEP (from 1)
  in that attempt: after the step's forwards and backwards, before any weight changes. (A step at a learning rate of
  0 is not counted, here or in batches.jsonl: torch.distributed.checkpoint takes one to give an optimizer its state
  before it loads a snapshot's.)
- JOB_SKIP_ALL_REDUCE=`RANK:N`: the process of that global rank skips its N-th torch.distributed.all_reduce and
  sleeps instead, never arriving: the classic bug of a collective inside `if rank == 0:`, or a rank stuck in I/O.
- JOB_STALL_INIT=`RANK`: the process of that global rank never reaches init_process_group (it sleeps instead): a
  rank stuck before the process group forms, or one whose address cannot be reached. `RANK:SECONDS`: it reaches it
  that many seconds late, as a rank started last on a busy machine does.
- JOB_HOLD=`FOLDER`: each process that constructs a torchft Manager (a replica group of step 13) first writes
  FOLDER/held-PID, then waits (at most 600 s) until FOLDER/go exists, and goes on: the groups of a job start to train
  at once however far apart their starts were (harness/jobs' Job.release() writes it once they all wait). Once it
  exists, a process restarted later goes on at once.
"""
import os
import signal
import time

from .notes import _rank, _restart, _training_step, patch_on_import


def kill_at_pass(at):
    """SIGKILL this process as it begins the pass over a DataLoader that `at` (RESTART:RANK:EPOCH) names."""
    from torch.utils.data import BatchSampler

    batches = BatchSampler.__iter__
    passes = [0]  # passes over a DataLoader begun by this process

    def killing_batches(self):
        epoch, number = getattr(self.sampler, "epoch", None), passes[0]
        passes[0] += 1
        if at == f"{_restart()}:{_rank()}:{number if epoch is None else epoch}":
            os.kill(os.getpid(), signal.SIGKILL)
        yield from batches(self)

    BatchSampler.__iter__ = killing_batches


def kill_at_step(at):
    """SIGKILL this process just before the optimizer step that `at` (RESTART:RANK:STEP) names."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    taken = [0]  # training steps this process began

    def killing_before_step(optimizer, args, kwargs):
        if not _training_step(optimizer):
            return
        taken[0] += 1
        if at == f"{_restart()}:{_rank()}:{taken[0]}":
            os.kill(os.getpid(), signal.SIGKILL)

    register_optimizer_step_pre_hook(killing_before_step)


def skip_all_reduce(which):
    """The process of the global rank that `which` (RANK:N) names sleeps instead of its N-th all_reduce."""
    import torch.distributed as dist

    skip_rank, skip_call = map(int, which.split(":"))
    calls = [0]
    all_reduce = dist.all_reduce

    def all_reduce_but_skip_one(*args, **kwargs):
        calls[0] += 1
        if int(os.environ.get("RANK", -1)) == skip_rank and calls[0] == skip_call:
            print(f"[job] rank {skip_rank} skips its all_reduce number {skip_call}", flush=True)
            time.sleep(120)  # ended by the launcher once the other ranks have failed; bounded all the same
        return all_reduce(*args, **kwargs)

    dist.all_reduce = all_reduce_but_skip_one


def stall_init(which):
    """The process of the global rank that `which` (RANK, or RANK:SECONDS) names reaches init_process_group never (it
    sleeps), or that many seconds late."""
    import torch.distributed as dist

    init_process_group = dist.init_process_group

    def stalling_init_process_group(*args, **kwargs):
        stalled, _, late = which.partition(":")
        if os.environ.get("RANK") == stalled and late:
            print(f"[job] rank {stalled} reaches init_process_group {late} s late", flush=True)
            time.sleep(float(late))
            print(f"[job] rank {stalled} calls init_process_group", flush=True)
        elif os.environ.get("RANK") == stalled:
            print(f"[job] rank {stalled} does not reach init_process_group", flush=True)
            time.sleep(120)  # ended by the launcher once the other ranks have failed; bounded all the same
        return init_process_group(*args, **kwargs)

    dist.init_process_group = stalling_init_process_group


def hold_managers(folder):
    """Hold each torchft Manager's construction until `folder`/go exists (patched in if the job imports torchft)."""

    def hold(manager_module):
        """Hold each Manager's construction until the job's go: before it, the group neither heartbeats nor asks the
        lighthouse for a quorum, so no group trains before the others are there."""
        manager_init = manager_module.Manager.__init__

        def held_init(self, *args, **kwargs):
            open(os.path.join(folder, f"held-{os.getpid()}"), "w").close()
            deadline = time.monotonic() + 600  # bounded all the same
            while not os.path.exists(os.path.join(folder, "go")) and time.monotonic() < deadline:
                time.sleep(0.02)
            manager_init(self, *args, **kwargs)

        manager_module.Manager.__init__ = held_init

    patch_on_import("torchft.manager", hold)
