"""Clean exits: exits.jsonl, a JSON line per process that trained (began a pass over a DataLoader) and exits without
an error (at its end, or by os._exit(0)): pid, its last rank, restart, and `open`: its default process group was
still initialized (never destroyed)."""
import atexit
import json
import os
import sys

from .notes import _append, _restart
from .passes import _now, _passes


def record_exits():
    """Note the process's exit, at its end (atexit) or by os._exit."""
    exit_now = os._exit

    def exiting_now(code):
        _noting_exit(code)
        exit_now(code)

    os._exit = exiting_now
    atexit.register(_noting_exit)


def _noting_exit(code=0):
    crashed = code != 0 or hasattr(sys, "last_value")  # an uncaught exception sets it before atexit runs
    if _passes[0] and not crashed:
        import torch.distributed as dist

        _append("exits.jsonl", json.dumps(dict(pid=os.getpid(), rank=_now["rank"], restart=_restart(),
                                               open=dist.is_available() and dist.is_initialized())))
