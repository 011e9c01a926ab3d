"""What each optimizer step trained on, in a job of step 12 (long_run.py, whose DataLoader reads utils/data.py's
Shares): batches.jsonl, a JSON line per optimizer step of a process: pid, rank, restart, `mesh` (as in samples.jsonl),
`step` (the process's optimizer steps so far, this one included; a step at a learning rate of 0 is not counted) and
`rows` (a digest of each sequence this rank trained on in the step, in order: its inputs' and targets' bytes).
Written just before the optimizer's step, from what the DataLoader handed the training process last: what was trained
on, not what a loader's worker read ahead."""
import hashlib
import json
import os

from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.data import dataloader

from .notes import _append, _rank, _restart, _training_step
from .passes import _now


def record_batches():
    """Note what the DataLoader hands the process, and write it down as each optimizer step begins."""
    taken, read = [0], {}  # optimizer steps this process began; what the DataLoader handed it last
    next_item = dataloader._BaseDataLoaderIter.__next__

    def noting_next_item(self):
        item = next_item(self)
        if type(self._dataset).__name__ == "Shares":
            inputs, targets = item
            read.update(rows=[
                hashlib.sha1(row_in.numpy().tobytes() + row_out.numpy().tobytes()).hexdigest()[:16]
                for row_in, row_out in zip(inputs.cpu(), targets.cpu())])
        return item

    def before_optimizer_step(optimizer, args, kwargs):
        if not _training_step(optimizer):
            return
        taken[0] += 1
        if read:
            _append("batches.jsonl", json.dumps(dict(pid=os.getpid(), rank=_rank(), restart=_restart(),
                                                     mesh=_now["mesh"], step=taken[0], **read)))
            read.clear()

    dataloader._BaseDataLoaderIter.__next__ = noting_next_item
    register_optimizer_step_pre_hook(before_optimizer_step)
