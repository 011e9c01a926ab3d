"""Recorder plugin of exercise 8 (ZeRO by hand): the gradients a rank holds as it steps, and whether the ranks hold
the same model.

Named in JOB_RECORD_PLUGINS (by this file's path), it writes zero_by_hand.jsonl, a JSON line per optimizer step of
each process, as the step begins: pid, rank, restart, `step` (the optimizer steps this process had taken before this
one), and
  - `held_grads`: the bytes of the gradients the rank holds then, wherever they are held: the .grad of each parameter
    of every nn.Module the process made (the model's) and of each tensor the optimizer steps (a shard of the flat
    parameters); every tensor that was a parameter's .grad when the step's backward ended and is still alive (set to
    None on the parameter, but kept by a list or a variable); and, with JOB_RECORD_COLLECTIVES, every tensor given to
    a reduce-scatter or an all-reduce since that backward began (the flat gradient, its shard of the sum) that is still
    alive (an attribute, a local variable of the function that steps). As the memory they keep alive: a tensor that is
    a view of a larger one (a slice of a whole flat gradient) holds all of its storage; each storage counted once; the
    parameters' own storages and the optimizer's state are not gradients. `holders`: what holds them, the largest
    first, each {"bytes", "what"} ("grad": a .grad; "backward": a gradient of the backward, off its parameter now;
    "collective": given to a collective, with its `op` and `caller`).
  - `stepped_grad_square`: the sum of the squares of the gradients of the tensors the optimizer steps (float64): over
    the ranks, the squared norm of the gradient the ranks stepped with (an average over the ranks, or a sum).
  - `params`: a digest of the model's parameters (every nn.Module's, in the order they were made): equal on every rank
    as long as the ranks hold the same model; and `flat`, those parameters themselves, as one flat list of numbers
    (None for a model of over FLAT_LIMIT parameters): what the ranks trained so far, step by step.
With torch 2.14's names for two collectives, all_gather_single and reduce_scatter_single, called through
torch.distributed, are recorded in collectives.jsonl as their older names are (torch 2.6 to 2.13 have only those; 2.14
keeps them, calling the new ones, which stay unrecorded there so that nothing counts twice).
"""
import hashlib
import json
import os
import weakref

import sitecustomize  # the recorder: _append, _rank, _restart, and the collectives' wrapper
import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

_parameters = []  # weak references to every parameter an nn.Module registered, in order
_steps = [0]
_backward = dict(grads=[], sequence=0)  # the gradients the last backward left (weakly), the collectives before it
FLAT_LIMIT = 10_000
_register_parameter = nn.Module.register_parameter


def _noting_register_parameter(self, name, param):
    _register_parameter(self, name, param)
    if param is not None:
        _parameters.append(weakref.ref(param))


nn.Module.register_parameter = _noting_register_parameter


def _unique(tensors):
    seen = {}
    for tensor in tensors:
        seen.setdefault(id(tensor), tensor)
    return list(seen.values())


_tensor_backward = torch.Tensor.backward


def _noting_backward(self, *args, **kwargs):
    sequence = sitecustomize._sequence[0] if sitecustomize.RECORD_COLLECTIVES else 0
    result = _tensor_backward(self, *args, **kwargs)
    _backward["sequence"] = sequence
    _backward["grads"] = [weakref.ref(p.grad) for p in (ref() for ref in _parameters)
                          if p is not None and p.grad is not None]
    return result


torch.Tensor.backward = _noting_backward


def _storage(tensor):
    return tensor.untyped_storage().data_ptr()


def _held_gradients(model, stepped, optimizer):
    """[{"bytes", "what", ...}] of the storages that hold gradients as this step begins, each once, the largest first
    (see `held_grads` above)."""
    kept = {_storage(p) for p in model + stepped}
    kept |= {_storage(value) for state in optimizer.state.values() for value in state.values()
             if isinstance(value, torch.Tensor)}
    found = [(p.grad, dict(what="grad")) for p in model + stepped if p.grad is not None]
    found += [(grad, dict(what="backward")) for grad in (ref() for ref in _backward["grads"]) if grad is not None]
    if sitecustomize.RECORD_COLLECTIVES:
        found += [(tensor, dict(what="collective", op=op, caller=caller))
                  for tensor, sequence, op, caller in ((ref(), sequence, op, caller)
                                                       for ref, sequence, _, op, caller in sitecustomize._given)
                  if tensor is not None and sequence > _backward["sequence"]
                  and op in ("all_reduce", "reduce_scatter_tensor", "reduce_scatter_single", "reduce_scatter")]
    held = {}
    for tensor, what in found:
        storage = _storage(tensor)
        if storage not in kept and storage not in held:
            held[storage] = dict(bytes=tensor.untyped_storage().nbytes(), **what)
    return sorted(held.values(), key=lambda row: -row["bytes"])


def _noting_step(optimizer, args, kwargs):
    model = _unique(p for p in (ref() for ref in _parameters) if p is not None)
    stepped = _unique(p for group in optimizer.param_groups for p in group["params"])
    holders = _held_gradients(model, stepped, optimizer)
    held = sum(row["bytes"] for row in holders)
    square = sum(float(p.grad.detach().double().pow(2).sum()) for p in stepped if p.grad is not None)
    digest = hashlib.sha1()
    for p in model:
        digest.update(p.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    numel = sum(p.numel() for p in model)
    flat = (torch.cat([p.detach().reshape(-1).double() for p in model]).tolist() if 0 < numel <= FLAT_LIMIT
            else None)
    sitecustomize._append("zero_by_hand.jsonl", json.dumps(dict(
        pid=os.getpid(), rank=sitecustomize._rank(), restart=sitecustomize._restart(), step=_steps[0],
        held_grads=held, holders=holders, stepped_grad_square=square, params=digest.hexdigest()[:16], flat=flat)))
    _steps[0] += 1


register_optimizer_step_pre_hook(_noting_step)

if sitecustomize.RECORD_COLLECTIVES:
    for _name in ("all_gather_single", "reduce_scatter_single"):
        _collective = getattr(dist, _name, None)
        # (torch's own decorators set __wrapped__ too: the recorder's wrapper is told by its name)
        if _collective is not None and not _collective.__qualname__.startswith("_noting_collective"):
            setattr(dist, _name, sitecustomize._noting_collective(_name, _collective))
