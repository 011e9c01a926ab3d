"""Passes over a DataLoader: begins.jsonl and samples.jsonl. (A BatchSampler is what every DataLoader with a batch
size iterates over, so patching its __iter__ sees every batch of every step.)

- begins.jsonl: a JSON line as each pass begins (`what`: "pass"; pid, rank, restart, `began`, and its `epoch`), written
  before the work: a pass that a kill cuts short shows. (saves.py writes the lines of saves that begin.)
- samples.jsonl: a JSON line per completed pass: the process, its rank, torchrun's restart count, the sampler's class
  and epoch (its set_epoch value), the pass's number in this process, whether the model was wrapped in DDP, `mesh`
  (this rank's coordinates in the named DeviceMesh init_device_mesh made, e.g. {"dp": 1, "tp": 0}; None without one),
  `node` (torchrun's GROUP_RANK: which node the process runs on), and the sample indices in the order the process
  trained on them; `began` and `ended` (time.time()). Overlapping shards, a shuffle that never changes, a resume that
  repeats an epoch: all show in it.
  Each line also holds what a correct data-parallel run keeps equal, hashed: the model's parameters and the
  optimizer's state at the pass's start and end (`params_before`, `optimizer_before`, `params`, `optimizer`: equal on
  every rank after an epoch, and equal across a restart when the snapshot holds all it must); and what the other
  parts noted during the pass: `ddp`, `bypass` and `mesh` (models.py), `loss` and `losses` (losses.py), `draws`
  (draws.py), `whole_along_tp` and `reduce_scatter_dtypes` (sharded.py), `context` (context.py), `routes` (routes.py).
"""
import json
import os
import time

from torch.utils.data import BatchSampler

from .models import _optimizer_hash, _parameters_hash, _wrapped
from .notes import _append, _rank, _restart
from .passes import _now, _passes
from .sharded import _whole_along_tp_hash


def record_passes():
    """Note each pass over a DataLoader as it begins, and the samples it went over once it is done."""
    batches = BatchSampler.__iter__

    def recording_batches(self):
        epoch, number = getattr(self.sampler, "epoch", None), _passes[0]
        _passes[0] += 1
        restart = _restart()
        # before the kill of faults.py, which runs inside this: the pass a rank is killed in has begun too
        _append("begins.jsonl", json.dumps(dict(what="pass", pid=os.getpid(), rank=_rank(), restart=restart,
                                                epoch=epoch, began=time.time())))
        before = dict(began=time.time(), params_before=_parameters_hash(), optimizer_before=_optimizer_hash())
        _now.update(in_pass=True, loss=0.0, samples=0, bypass=None, draws={}, reduce_scatter_dtypes=set(),
                    scores=0, losses=[], routes=[])
        indices = []
        try:
            for batch in batches(self):
                indices.extend(int(i) for i in batch)
                _now["batch"] = len(batch)
                yield batch
        finally:  # also when the loop over the DataLoader is left early (a pass that is not recorded)
            _now["in_pass"] = False
        # here the last batch's step is done: the DataLoader asks for a batch after it
        _now["rank"] = _rank()
        _append("samples.jsonl", json.dumps(dict(
            pid=os.getpid(), rank=_rank(), restart=restart, sampler=type(self.sampler).__name__, epoch=epoch,
            number=number, ddp=_wrapped[0], mesh=_now["mesh"], node=int(os.environ.get("GROUP_RANK", 0)),
            indices=indices, **before, ended=time.time(), params=_parameters_hash(), optimizer=_optimizer_hash(),
            loss=_now["loss"] / _now["samples"] if _now["samples"] else None, losses=_now["losses"],
            routes=_now["routes"] or None, bypass=_now["bypass"],
            draws={kind: digest.hexdigest()[:16] for kind, digest in _now["draws"].items()},
            whole_along_tp=_whole_along_tp_hash(),
            reduce_scatter_dtypes=sorted(_now["reduce_scatter_dtypes"]),
            context=None if _now.get("positions") is None else dict(positions=_now["positions"],
                                                                     scores=_now["scores"]))))

    BatchSampler.__iter__ = recording_batches
