"""Loaded by every Python process of an audited job (it is first on PYTHONPATH): records what the job did.

Each part is switched on by its own environment variable; nothing else about the job changes.
- AUDIT_WRITES_TO: each torch.save appends `pid<TAB>rank<TAB>path`, so a test can tell how many processes wrote
  checkpoints and which rank they were.
- AUDIT_SAMPLES_TO: each pass over a DataLoader appends one JSON line once the pass is complete: the process, its
  rank, torchrun's restart count, the sampler's class and epoch (set_epoch), the pass's number in this process,
  whether the model was wrapped in DDP, and the sample indices in the order the process trained on them. A test or an exercise checker can then see
  overlapping shards, a shuffle that never changes, a resume that repeats an epoch.
- AUDIT_KILL_AT=`RESTART:RANK:EPOCH`: that rank SIGKILLs itself as it begins that epoch in that attempt, a fault
  at a known point (the epoch counts passes over the DataLoader when the sampler has no set_epoch).
"""
import os

if os.environ.get("AUDIT_WRITES_TO"):
    import torch
    import torch.distributed as dist

    _save = torch.save

    def _recording_save(obj, f, *args, **kwargs):
        result = _save(obj, f, *args, **kwargs)
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else "-"
        with open(os.environ["AUDIT_WRITES_TO"], "a") as record:
            record.write(f"{os.getpid()}\t{rank}\t{os.path.abspath(str(f))}\n")
        return result

    torch.save = _recording_save

if os.environ.get("AUDIT_SAMPLES_TO") or os.environ.get("AUDIT_KILL_AT"):
    import json
    import signal

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import BatchSampler

    _passes = [0]  # passes over a DataLoader begun by this process
    _wrapped = [False]  # did this process build a DistributedDataParallel?
    _ddp_init, _batches = DistributedDataParallel.__init__, BatchSampler.__iter__

    def _rank():
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
        return int(os.environ["RANK"]) if "RANK" in os.environ else None

    def _noting_ddp_init(self, *args, **kwargs):
        _wrapped[0] = True
        _ddp_init(self, *args, **kwargs)

    def _recording_batches(self):
        epoch, number = getattr(self.sampler, "epoch", None), _passes[0]
        _passes[0] += 1
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
        if os.environ.get("AUDIT_KILL_AT") == f"{restart}:{_rank()}:{number if epoch is None else epoch}":
            os.kill(os.getpid(), signal.SIGKILL)
        indices = []
        for batch in _batches(self):
            indices.extend(int(i) for i in batch)
            yield batch
        if os.environ.get("AUDIT_SAMPLES_TO"):
            row = dict(pid=os.getpid(), rank=_rank(), restart=restart, sampler=type(self.sampler).__name__,
                       epoch=epoch, number=number, ddp=_wrapped[0], indices=indices)
            with open(os.environ["AUDIT_SAMPLES_TO"], "a") as record:
                record.write(json.dumps(row) + "\n")

    DistributedDataParallel.__init__ = _noting_ddp_init
    BatchSampler.__iter__ = _recording_batches
