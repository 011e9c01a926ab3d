"""What exercise 10 (a pipeline schedule by hand) records: the passes each rank ran, the activations autograd held, the
point-to-point operations and their waits, and the first step's gradients. JSON lines in pipeline_by_hand.jsonl, each
with pid, rank, restart, `event` and `step` (the optimizer steps this process had taken):

- "forward": a forward of the stage, the outermost call of a module with parameters (the stage's layers; a loss
  module has none). `microbatch`: its number in the step (forwards since the last optimizer step, from 0); `saved`:
  the bytes autograd kept for its backward (each storage once, the weights not counted, as utils.memory's
  saved_for_backward counts them); `live`: the bytes of every micro-batch's activations still held once it ended.
- "backward": a torch.autograd.backward (Tensor.backward calls it) that went through the stage. `microbatches`: the
  micro-batches whose saved activations it used (autograd hands a backward the tensors of the forward that made its
  graph: which micro-batch a backward ran is measured, not counted); `live`: the bytes still held once it ended
  (autograd frees a micro-batch's activations as its backward uses them, unless retain_graph keeps them).
- "call": each isend, irecv, send and recv: `op`, `seq` (its number in the process), `peer`, `bytes`,
  `asynchronous` (it returned a Work to wait for), `stack` (the calling frames outside the installation, outermost
  first).
- "waiting" as a wait on a point-to-point operation begins (an isend's or irecv's Work.wait(), a blocking send or
  recv), and "waited" as it returns (`error`: what it raised, or None): a wait that began and never ended is where a
  rank hung.
- "step" as an optimizer step begins.

And pipeline_by_hand_grads_rank<R>.pt (R: the rank): the gradients of the parameters the first optimizer step
updates, in the optimizer's order, as that step begins.
"""
import json
import os
import sys
import threading
import traceback
import weakref

import sitecustomize
import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook

RECORD = "pipeline_by_hand.jsonl"
_lock = threading.RLock()
_now = dict(step=0, forwards=0, stage=None, hooks=None, microbatch=None, live=0, calls=0, used=set(), backwards=0)
_held = {}  # (step, micro-batch, storage address) -> how many packed tensors of that micro-batch hold the storage
_sizes = {}  # the same keys -> the storage's bytes, counted once while it is held


def _note(event, **fields):
    sitecustomize._append(RECORD, json.dumps(dict(pid=os.getpid(), rank=sitecustomize._rank(),
                                                  restart=sitecustomize._restart(), event=event, step=_now["step"],
                                                  **fields)))


def _stack():
    """The calling frames outside the Python and torch installation and the recorder (this file too), outermost
    first."""
    installed = (sys.base_prefix, sys.prefix, os.path.dirname(os.__file__), os.path.dirname(sitecustomize.__file__),
                 __file__)
    return [[frame.filename, frame.lineno, frame.name] for frame in traceback.extract_stack()[:-2]
            if not frame.filename.startswith(installed) and "site-packages" not in frame.filename
            and not frame.filename.startswith("<")]


class _Held:
    """A tensor autograd saved in a forward of the stage, tagged with its micro-batch. Autograd drops it when the
    backward has used it (or when the graph goes), and the bytes it held are no longer live."""
    __slots__ = ("tensor", "key", "__weakref__")

    def __init__(self, tensor, key):
        self.tensor, self.key = tensor, key


def _release(key):
    with _lock:
        _held[key] -= 1
        if not _held[key]:
            del _held[key]
            _now["live"] -= _sizes.pop(key)


def _pack(tensor):
    base = tensor if tensor._base is None else tensor._base
    if isinstance(base, torch.nn.Parameter) or tensor.device.type == "meta":
        return tensor  # a weight, or a view of one: the model's memory, not an activation
    key = (_now["step"], _now["microbatch"], tensor.untyped_storage().data_ptr())
    with _lock:
        if key not in _held:
            _held[key], _sizes[key] = 0, tensor.untyped_storage().nbytes()
            _now["live"] += _sizes[key]
            _now["saved"] += _sizes[key]
        _held[key] += 1
    held = _Held(tensor, key)
    weakref.finalize(held, _release, key)
    return held


def _unpack(packed):
    if isinstance(packed, _Held):
        _now["used"].add(packed.key[1])
        return packed.tensor
    return packed


def _has_parameters(module):
    return next(module.parameters(), None) is not None


def _before_forward(module, args):
    if _now["stage"] is not None or not _has_parameters(module):
        return
    _now.update(stage=module, microbatch=_now["forwards"], saved=0)
    _now["forwards"] += 1
    _now["hooks"] = torch.autograd.graph.saved_tensors_hooks(_pack, _unpack)
    _now["hooks"].__enter__()


def _after_forward(module, args, output):
    if module is not _now["stage"]:
        return
    _now["hooks"].__exit__(None, None, None)
    _note("forward", microbatch=_now["microbatch"], saved=_now["saved"], live=_now["live"])
    _now.update(stage=None, hooks=None, microbatch=None)


torch.nn.modules.module.register_module_forward_pre_hook(_before_forward)
torch.nn.modules.module.register_module_forward_hook(_after_forward)

_backward = torch.autograd.backward


def _noting_backward(*args, **kwargs):
    outermost = not _now["backwards"]
    if outermost:
        _now["used"] = set()
    _now["backwards"] += 1
    try:
        return _backward(*args, **kwargs)
    finally:
        _now["backwards"] -= 1
        if outermost and _now["used"]:
            _note("backward", microbatches=sorted(_now["used"]), live=_now["live"])


torch.autograd.backward = _noting_backward


class _NotedWork:
    """The Work of an isend or irecv, its wait noted as it begins and as it ends."""

    def __init__(self, work, sequence):
        self._work, self._sequence = work, sequence

    def wait(self, *args, **kwargs):
        return _waiting(self._sequence, lambda: self._work.wait(*args, **kwargs))

    def __getattr__(self, name):
        return getattr(self._work, name)


def _waiting(sequence, wait):
    _note("waiting", seq=sequence)
    try:
        result = wait()
    except BaseException as error:
        _note("waited", seq=sequence, error=f"{type(error).__name__}: {error}"[:300])
        raise
    _note("waited", seq=sequence, error=None)
    return result


def _noting_p2p(name, operation):
    def noting(tensor, *args, **kwargs):
        with _lock:
            _now["calls"] += 1
            sequence = _now["calls"]
        peer = next((kwargs[key] for key in ("dst", "src", "group_dst", "group_src") if kwargs.get(key) is not None),
                    args[0] if args else None)
        fields = dict(op=name, seq=sequence, peer=peer, bytes=tensor.numel() * tensor.element_size(), stack=_stack())
        if name in ("send", "recv"):
            _note("call", asynchronous=False, **fields)
            return _waiting(sequence, lambda: operation(tensor, *args, **kwargs))
        work = operation(tensor, *args, **kwargs)
        _note("call", asynchronous=work is not None, **fields)
        return _NotedWork(work, sequence) if work is not None else None
    noting.__wrapped__ = operation
    return noting


# One wrapper per op, in both modules: P2POp accepts only distributed_c10d's own isend and irecv, which a script
# reaches through torch.distributed.
for _name in ("isend", "irecv", "send", "recv"):
    _wrapper = _noting_p2p(_name, getattr(dist.distributed_c10d, _name))
    for _module in (dist, dist.distributed_c10d):
        setattr(_module, _name, _wrapper)


def _before_step(optimizer, args, kwargs):
    _note("step")
    if _now["step"] == 0:
        grads = [None if p.grad is None else p.grad.detach().clone() for group in optimizer.param_groups
                 for p in group["params"]]
        sitecustomize._save(grads, os.path.join(sitecustomize.RECORD_DIR,
                                                f"pipeline_by_hand_grads_rank{sitecustomize._rank()}.pt"))
    _now["step"] += 1
    _now["forwards"] = 0


register_optimizer_step_pre_hook(_before_step)
