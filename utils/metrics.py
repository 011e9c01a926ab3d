"""Per-rank metrics: every rank appends one JSON line per epoch to its own file in a run directory.

    TUTORIAL_RUN_DIR=runs/try1 torchrun --standalone --nproc_per_node=2 multigpu_torchrun.py 10 5
    python tools/plot_metrics.py runs/try1          # -> runs/try1/metrics.png

Unset TUTORIAL_RUN_DIR, nothing is written. Each rank writes its own file (rank0.jsonl, rank1.jsonl...), so no
rank waits for another and a straggler shows up as itself; a run that resumes from a snapshot appends to them.
"""
import json
import os
import time

import torch
import torch.distributed as dist

from utils.memory import device_memory

RUN_DIR_VARIABLE = "TUTORIAL_RUN_DIR"


def run_dir():
    """The run directory, or None when metrics are off."""
    return os.environ.get(RUN_DIR_VARIABLE) or None


def rank_file(directory, rank):
    return os.path.join(directory, f"rank{rank}.jsonl")


def log_rank_metrics(epoch, steps_per_epoch, totals, start, step=None, **more):
    """Append this rank's epoch to <run dir>/rank<R>.jsonl: call it with the rank's own [summed loss, samples]
    totals, before they are all-reduced, and the perf_counter() the epoch started at; `more`: what else a step records
    (expert_parallel.py: the tokens each expert got). Once per epoch: its one host sync (reading `totals`) costs
    nothing next to an epoch, and training steps never wait for it. The long run (step 12) records a window of
    steps instead: no epoch, the `step` it ends at, and tokens for samples (unit="tokens").
    `memory_peak`: the most this rank's device held so far, in bytes (on a GPU the CUDA allocator's peak on the
    process's current GPU, torch.cuda.max_memory_allocated; on a CPU the process's resident set at its peak, torch
    itself included), or None where it is not known."""
    directory = run_dir()
    if directory is None:
        return
    summed_loss, samples = totals.tolist()  # waits for the device: the clock below covers the epoch's work
    seconds = time.perf_counter() - start
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    step = (epoch + 1) * steps_per_epoch if step is None else step  # the optimizer steps taken at its end
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    record = dict(rank=rank, world_size=world_size, epoch=epoch, step=step,
                  loss=summed_loss / max(samples, 1), samples=int(samples), seconds=seconds,
                  samples_per_s=samples / seconds, time=time.time(), memory_peak=device_memory(device)[1], **more)
    os.makedirs(directory, exist_ok=True)
    with open(rank_file(directory, rank), "a") as out:
        out.write(json.dumps(record) + "\n")

