"""Object collectives: objects.jsonl, a JSON line per call of an object collective (all_gather_object,
broadcast_object_list...), whose pickles a process that joined the group could make run code: pid, rank, restart,
`collective`, and `caller`, the file and line that called it (the steps' own code, or torch's: DCP exchanges its plans
so)."""
import json
import os
import traceback

import torch

from .notes import _append, _rank, _restart


def record_object_collectives():
    """Note each call of torch.distributed's object collectives, with the line that called it."""

    def noting_object_collective(name, collective):
        def noting(*args, **kwargs):
            caller = traceback.extract_stack()[-2]
            _append("objects.jsonl", json.dumps(dict(pid=os.getpid(), rank=_rank(), restart=_restart(),
                                                     collective=name, caller=[caller.filename, caller.lineno])))
            return collective(*args, **kwargs)
        return noting

    for name in ("all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
                 "send_object_list", "recv_object_list"):
        setattr(torch.distributed, name, noting_object_collective(name, getattr(torch.distributed, name)))
