"""The "call" lines of collectives.jsonl (see collectives.py): per call of a torch.distributed collective or
point-to-point op, `op`, `seq` (its number in the process), `began` and `ended` of the call, `asynchronous`, `bytes` of
each tensor it was given, `dtypes`, `peer`, `group_size`, `in_backward` (called during a Tensor.backward: from a
gradient hook), the split sizes of an all_to_all_single, and `caller` ([file, line, function], the innermost frame
outside the installation). An asynchronous call returns a noted Work (collective_waits.py)."""
import threading
import time
import weakref

import torch
import torch.distributed as dist

from .collective_waits import _NotedWork
from .collectives import _OPTIONS, _given, _in_backward, _note, _optimizer_steps
from .notes import _caller

_sequence = [0]  # collectives this process called
_lock = threading.Lock()
_COLLECTIVES = ("all_reduce", "reduce_scatter_tensor", "reduce_scatter", "all_gather_into_tensor", "all_gather",
                "broadcast", "all_to_all_single", "all_to_all", "isend", "irecv", "send", "recv", "barrier",
                "reduce", "gather", "scatter")


def record_collective_calls():
    """Note each call of a torch.distributed collective or point-to-point op."""
    # One wrapper per op, in both modules: torch's own checks compare with the module's functions (P2POp's op must be
    # distributed_c10d's isend or irecv, and a script passes torch.distributed's).
    for name in _COLLECTIVES:
        if hasattr(dist.distributed_c10d, name):
            wrapper = _noting_collective(name, getattr(dist.distributed_c10d, name))
            for module in (dist, dist.distributed_c10d):
                setattr(module, name, wrapper)


def _tensors_in(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors_in(item)


def _noting_collective(name, collective):
    def noting(*args, **kwargs):
        with _lock:
            _sequence[0] += 1
            sequence = _sequence[0]
        tensors = list(_tensors_in(list(args) + list(kwargs.values())))
        group = kwargs.get("group")
        peers = [kwargs.get(key) for key in ("dst", "src", "group_dst", "group_src")]
        if name in ("isend", "irecv", "send", "recv") and len(args) > 1:
            peers.append(args[1])
        peer = next((peer for peer in peers if peer is not None), None)
        splits = {key: list(kwargs[key]) for key in ("output_split_sizes", "input_split_sizes")
                  if kwargs.get(key) is not None}
        if name == "all_to_all_single" and len(args) > 2:
            splits.update(output_split_sizes=list(args[2] or []), input_split_sizes=list(args[3] or [])
                          if len(args) > 3 else [])
        caller = _caller()
        for tensor in tensors:
            base = tensor if tensor._base is None else tensor._base
            _given.append((weakref.ref(base), sequence, _optimizer_steps[0], name, caller))
        tensor, copy = None, None
        asynchronous = kwargs.get("async_op", len(args) > 3 and name == "all_reduce" and args[3])
        if _OPTIONS["copy_in_flight"] and name == "all_reduce" and asynchronous and tensors:
            tensor = tensors[0]
            copy = tensor.detach().clone()
            args, kwargs = ((copy, *args[1:]), kwargs) if args else ((), dict(kwargs, tensor=copy))
        began = time.time()
        work = collective(*args, **kwargs)
        _note(event="call", seq=sequence, op=name, began=began, ended=time.time(),
              asynchronous=work is not None, bytes=[t.numel() * t.element_size() for t in tensors],
              dtypes=sorted({str(t.dtype).replace("torch.", "") for t in tensors}), peer=peer,
              group_size=dist.get_world_size(group) if dist.is_initialized() else None,
              in_backward=_in_backward[0] > 0, step=_optimizer_steps[0], caller=caller, **splits)
        if work is None:
            return None
        if tensor is not None:
            return _NotedWork(work, sequence, tensor, copy, tensor.detach().clone())
        return _NotedWork(work, sequence)
    noting.__wrapped__ = collective
    return noting
