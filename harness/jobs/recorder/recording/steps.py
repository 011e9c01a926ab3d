"""Optimizer steps (JOB_RECORD_STEPS=1): steps.jsonl, a JSON line per optimizer step: the process, its rank,
torchrun's restart count, the step's number in this process, `at` (time.time() as the step begins, its gradients
ready), the learning rate it used (the first param group's), and the gradient all-reduces since the step before:
`rounds` (DDP all-reduces its buckets once per backward that syncs: one round), `buckets`, and `grad_norms` (each
round's all-reduced gradient norm, over all its buckets). A DDP communication hook counts them: it wraps DDP's default
all-reduce (divide by the world size, sum), so the numbers are those of the job without it. Gradient accumulation with
no_sync() shows as one round per step. A process without DDP has rounds 0."""
import json
import math
import os
import time

from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .notes import _append, _rank, _restart

_steps, _buckets, _rounds = [0], [0], []  # optimizer steps taken; since the last one: buckets, rounds' squares
# (a list per round of its buckets' summed squares: appended, never added in place, because the buckets'
# all-reduces complete on gloo's threads, possibly at once, and `+=` from two threads can lose one)


def record_steps():
    """Count the gradient all-reduces of each DistributedDataParallel built from now on (over its own group: the
    world, or less), and note each optimizer step as it begins."""
    ddp_init = DistributedDataParallel.__init__

    def counting_ddp_init(self, *args, **kwargs):
        ddp_init(self, *args, **kwargs)
        self.register_comm_hook(self.process_group, _counting_all_reduce)

    DistributedDataParallel.__init__ = counting_ddp_init
    register_optimizer_step_pre_hook(_recording_step)


def _counting_all_reduce(state, bucket):
    """DDP's own all-reduce of one bucket of gradients (the default hook), counted. DDP hands a backward's buckets over
    in order, from bucket 0; their all-reduces may complete in any order."""
    if bucket.index() == 0:
        _rounds.append([])  # a new round
    squares = _rounds[-1]
    _buckets[0] += 1

    def note(future):
        averaged = future.value()
        squares.append(float(averaged.double().pow(2).sum()))
        return averaged

    return allreduce_hook(state, bucket).then(note)


def _recording_step(optimizer, args, kwargs):
    _append("steps.jsonl", json.dumps(dict(
        pid=os.getpid(), rank=_rank(), restart=_restart(), step=_steps[0], at=time.time(),
        lr=optimizer.param_groups[0]["lr"], rounds=len(_rounds), buckets=_buckets[0],
        grad_norms=[math.sqrt(math.fsum(squares)) for squares in _rounds])))
    _steps[0] += 1
    _buckets[0] = 0
    _rounds.clear()
