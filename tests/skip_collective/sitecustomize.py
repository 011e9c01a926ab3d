"""Loaded by every Python process of a test job whose PYTHONPATH starts here: one rank skips one all_reduce.

SKIP_ALL_REDUCE="RANK:N" makes the process with that global RANK skip its N-th call of
torch.distributed.all_reduce and then wait elsewhere (here: sleep), never arriving: the classic bug of a
collective inside an `if rank == 0:`, or a rank stuck in I/O. Every other rank waits in that all_reduce.
The step scripts are not changed; nothing else about the job changes.
"""
import os
import time

if os.environ.get("SKIP_ALL_REDUCE"):
    import torch.distributed as dist

    _rank, _call = map(int, os.environ["SKIP_ALL_REDUCE"].split(":"))
    _calls = 0
    _all_reduce = dist.all_reduce

    def _all_reduce_but_skip_one(*args, **kwargs):
        global _calls
        _calls += 1
        if int(os.environ.get("RANK", -1)) == _rank and _calls == _call:
            print(f"[test] rank {_rank} skips its all_reduce number {_call}", flush=True)
            time.sleep(120)  # ended by the launcher once the other ranks have failed; bounded all the same
        return _all_reduce(*args, **kwargs)

    dist.all_reduce = _all_reduce_but_skip_one
