"""Recorder plugin of exercise 11 (the experts' dispatch): every all-to-all of rows, as it was asked for.

Named in JOB_RECORD_PLUGINS (by this file's path), it writes expert_dispatch.jsonl, a JSON line per call of
torch.distributed.all_to_all_single, written before the call runs, so that a call whose split sizes make it fail
(torch refuses them, or gloo aborts the process when a rank sends more rows than the other made room for) is there
too: pid, rank, restart, and
  - `round`: the Tensor.backward calls this process had finished before the call (the script's rounds of forward and
    backward are numbered so), and `in_backward`: called during one (autograd sending gradients back);
  - `dtype` and `dims` of the input (1: numbers, such as counts; 2: rows of features), `rows_in` (the input's first
    dimension: the rows this rank sends), `rows_out` (the output's: the rows it makes room for), `row_bytes` (the
    bytes of one row of the input);
  - `input_split_sizes` and `output_split_sizes` as given (None, or an empty list: the rows split evenly over the
    ranks, recorded as None);
  - `stack`: the calling frames outside the Python and torch installation ([file, line, function], outermost first).
"""
import inspect
import json
import math
import os

import sitecustomize  # the recorder: _append, _rank, _restart, _stack
import torch
import torch.distributed as dist

_all_to_all_single = dist.all_to_all_single  # the collectives' recorder's wrapper, when it is on
_signature = inspect.signature(dist.distributed_c10d.all_to_all_single)
_backwards = dict(finished=0, running=0)


def _sizes(splits):
    """Split sizes as a list of numbers (a script may give a tensor, or a list of 0-d tensors); None, or none given
    (torch's even split), as None."""
    return None if splits is None or len(splits) == 0 else [int(size) for size in splits]


def _noting_all_to_all_single(*args, **kwargs):
    try:
        call = _signature.bind(*args, **kwargs).arguments
    except TypeError:
        call = None  # arguments all_to_all_single refuses: its own error says so
    if call is not None:
        rows_in, rows_out = call["input"], call["output"]
        sitecustomize._append("expert_dispatch.jsonl", json.dumps(dict(
            pid=os.getpid(), rank=sitecustomize._rank(), restart=sitecustomize._restart(),
            round=_backwards["finished"], in_backward=_backwards["running"] > 0,
            dtype=str(rows_in.dtype).replace("torch.", ""), dims=rows_in.dim(),
            rows_in=rows_in.shape[0] if rows_in.dim() else 1, rows_out=rows_out.shape[0] if rows_out.dim() else 1,
            row_bytes=math.prod(rows_in.shape[1:]) * rows_in.element_size(),
            input_split_sizes=_sizes(call.get("input_split_sizes")),
            output_split_sizes=_sizes(call.get("output_split_sizes")), stack=sitecustomize._stack())))
    return _all_to_all_single(*args, **kwargs)


_noting_all_to_all_single.__wrapped__ = _all_to_all_single
for _module in (dist, dist.distributed_c10d):
    _module.all_to_all_single = _noting_all_to_all_single

_backward = torch.Tensor.backward


def _counting_backward(self, *args, **kwargs):
    _backwards["running"] += 1
    try:
        return _backward(self, *args, **kwargs)
    finally:
        _backwards["running"] -= 1
        _backwards["finished"] += 1


torch.Tensor.backward = _counting_backward
