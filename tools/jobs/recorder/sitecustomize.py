"""Loaded by every Python process of a job whose PYTHONPATH starts here (tools/jobs does that): it records what the
job does and injects faults, each part switched on by its own environment variable. The step scripts are not
changed; without the variables nothing happens.

- JOB_RECORD_DIR: what the job did, in files of that folder.
  - writes.tsv: a line `pid<TAB>rank<TAB>path` per torch.save to a file, so a reader can tell how many processes
    wrote files and which ranks they were ("-": no process group).
  - samples.jsonl: a JSON line per completed pass over a DataLoader: the process, its rank, torchrun's restart
    count, the sampler's class and epoch (its set_epoch value), the pass's number in this process, whether the model
    was wrapped in DDP, and the sample indices in the order the process trained on them. Overlapping shards, a
    shuffle that never changes, a resume that repeats an epoch: all show in it. (A BatchSampler is what every
    DataLoader with a batch size iterates over, so patching its __iter__ sees every batch of every step.)
- JOB_RECORD_STEPS=1 (with JOB_RECORD_DIR): steps.jsonl, a JSON line per optimizer step: the process, its rank,
  torchrun's restart count, the step's number in this process, the learning rate it used (the first param group's),
  and the gradient all-reduces since the step before: `rounds` (DDP all-reduces its buckets once per backward that
  syncs: one round), `buckets`, and `grad_norms` (each round's all-reduced gradient norm, over all its buckets). A
  DDP communication hook counts them: it wraps DDP's default all-reduce (divide by the world size, sum), so the
  numbers are those of the job without it. Gradient accumulation with no_sync() shows as one round per step.
- JOB_KILL_AT=`RESTART:RANK:EPOCH`: that rank SIGKILLs itself as it begins that epoch in that attempt: a crash at a
  known point (the epoch counts passes over the DataLoader when the sampler has no set_epoch).
- JOB_SKIP_ALL_REDUCE=`RANK:N`: the process of that global rank skips its N-th torch.distributed.all_reduce and
  sleeps instead, never arriving: the classic bug of a collective inside `if rank == 0:`, or a rank stuck in I/O.
- JOB_STALL_INIT=`RANK`: the process of that global rank never reaches init_process_group (it sleeps instead): a
  rank stuck before the process group forms, or one whose address cannot be reached.
"""
import os

RECORD_DIR = os.environ.get("JOB_RECORD_DIR")
RECORD_STEPS = RECORD_DIR and os.environ.get("JOB_RECORD_STEPS")
KILL_AT = os.environ.get("JOB_KILL_AT")
SKIP_ALL_REDUCE = os.environ.get("JOB_SKIP_ALL_REDUCE")
STALL_INIT = os.environ.get("JOB_STALL_INIT")


def _rank():
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ["RANK"]) if "RANK" in os.environ else None


def _append(name, line):
    with open(os.path.join(RECORD_DIR, name), "a") as record:
        record.write(line + "\n")


if RECORD_DIR:
    import torch

    _save = torch.save

    def _recording_save(obj, f, *args, **kwargs):
        result = _save(obj, f, *args, **kwargs)
        if isinstance(f, (str, os.PathLike)):  # a file; not a stream (DCP saves its shards' items to streams)
            rank = _rank()
            _append("writes.tsv", f"{os.getpid()}\t{'-' if rank is None else rank}\t{os.path.abspath(f)}")
        return result

    torch.save = _recording_save

if RECORD_DIR or KILL_AT:
    import json
    import signal

    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import BatchSampler

    _passes = [0]  # passes over a DataLoader begun by this process
    _wrapped = [False]  # did this process build a DistributedDataParallel?
    _ddp_init, _batches = DistributedDataParallel.__init__, BatchSampler.__iter__

    def _noting_ddp_init(self, *args, **kwargs):
        _wrapped[0] = True
        _ddp_init(self, *args, **kwargs)
        if RECORD_STEPS:
            self.register_comm_hook(None, _counting_all_reduce)

    def _recording_batches(self):
        epoch, number = getattr(self.sampler, "epoch", None), _passes[0]
        _passes[0] += 1
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
        if KILL_AT == f"{restart}:{_rank()}:{number if epoch is None else epoch}":
            os.kill(os.getpid(), signal.SIGKILL)
        indices = []
        for batch in _batches(self):
            indices.extend(int(i) for i in batch)
            yield batch
        if RECORD_DIR:
            _append("samples.jsonl", json.dumps(dict(
                pid=os.getpid(), rank=_rank(), restart=restart, sampler=type(self.sampler).__name__, epoch=epoch,
                number=number, ddp=_wrapped[0], indices=indices)))

    DistributedDataParallel.__init__ = _noting_ddp_init
    BatchSampler.__iter__ = _recording_batches

if RECORD_STEPS:
    import math

    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    _steps, _buckets, _rounds = [0], [0], []  # optimizer steps taken; since the last one: buckets, rounds' squares
    # (a list per round of its buckets' summed squares: appended, never added in place, because the buckets'
    # all-reduces complete on gloo's threads, possibly at once, and `+=` from two threads can lose one)

    def _counting_all_reduce(state, bucket):
        """DDP's own all-reduce of one bucket of gradients (the default hook), counted. DDP hands a backward's
        buckets over in order, from bucket 0; their all-reduces may complete in any order."""
        if bucket.index() == 0:
            _rounds.append([])  # a new round
        squares = _rounds[-1]
        _buckets[0] += 1

        def note(future):
            averaged = future.value()
            squares.append(float(averaged.double().pow(2).sum()))
            return averaged

        return allreduce_hook(None, bucket).then(note)

    def _recording_step(optimizer, args, kwargs):
        _append("steps.jsonl", json.dumps(dict(
            pid=os.getpid(), rank=_rank(), restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
            step=_steps[0], lr=optimizer.param_groups[0]["lr"], rounds=len(_rounds), buckets=_buckets[0],
            grad_norms=[math.sqrt(math.fsum(squares)) for squares in _rounds])))
        _steps[0] += 1
        _buckets[0] = 0
        _rounds.clear()

    register_optimizer_step_pre_hook(_recording_step)

if SKIP_ALL_REDUCE:
    import time

    import torch.distributed as dist

    _skip_rank, _skip_call = map(int, SKIP_ALL_REDUCE.split(":"))
    _calls = [0]
    _all_reduce = dist.all_reduce

    def _all_reduce_but_skip_one(*args, **kwargs):
        _calls[0] += 1
        if int(os.environ.get("RANK", -1)) == _skip_rank and _calls[0] == _skip_call:
            print(f"[job] rank {_skip_rank} skips its all_reduce number {_skip_call}", flush=True)
            time.sleep(120)  # ended by the launcher once the other ranks have failed; bounded all the same
        return _all_reduce(*args, **kwargs)

    dist.all_reduce = _all_reduce_but_skip_one

if STALL_INIT:
    import time

    import torch.distributed as dist

    _init_process_group = dist.init_process_group

    def _stalling_init_process_group(*args, **kwargs):
        if os.environ.get("RANK") == STALL_INIT:
            print(f"[job] rank {STALL_INIT} does not reach init_process_group", flush=True)
            time.sleep(120)  # ended by the launcher once the other ranks have failed; bounded all the same
        return _init_process_group(*args, **kwargs)

    dist.init_process_group = _stalling_init_process_group
