"""What the workshop's build-it-yourself exercises are judged by (JOB_RECORD_COLLECTIVES=1): collectives.jsonl, a JSON
line per event, each with pid, rank, restart, `event` and `step` (the optimizer steps this process had taken):
- "call", per call of a torch.distributed collective or point-to-point op (collective_calls.py);
- "wait", each time the Work of an asynchronous call was waited on (collective_waits.py);
- "backward", each Tensor.backward; "step" as an optimizer step begins, "stepped" as it ends (collective_steps.py).
Here: the line each event writes, and what the three parts share."""
import json
import os

from .notes import _append, _rank, _restart

_optimizer_steps, _in_backward = [0], [0]  # optimizer steps taken; Tensor.backward calls under way
# Two measurements that cost time a benchmark of the same job would see, switched on by the plugin of the exercise
# that needs them (plugins/ddp_by_hand.py): an asynchronous all_reduce run on a copy of its tensor (_NotedWork), and
# the collectives' tensors still alive listed at each step (`held`).
_OPTIONS = dict(copy_in_flight=False, note_held=False)
_given = []  # (weak reference to a tensor given to a collective (its base, for a view), seq, step, op, caller)


def _note(**fields):
    _append("collectives.jsonl", json.dumps(dict(pid=os.getpid(), rank=_rank(), restart=_restart(), **fields)))
