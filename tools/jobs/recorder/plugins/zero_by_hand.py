"""Recorder plugin of exercise 8 (ZeRO by hand): the gradients a rank holds as it steps, and whether the ranks hold
the same model.

JOB_RECORD_PLUGINS=zero_by_hand writes zero_by_hand.jsonl, a JSON line per optimizer step of each process, as the step
begins: pid, rank, restart, `step` (the optimizer steps this process had taken before this one), and
  - `held_grads`: the bytes of the gradients the rank holds then: the .grad of each parameter of every nn.Module the
    process made (the model's) and of each tensor the optimizer steps (a shard of the flat parameters), as the memory
    they keep alive: a .grad that is a view of a larger tensor (a slice of a whole flat gradient) holds all of its
    storage. Each storage counted once. A flat gradient kept in a variable of the script's, on no tensor's .grad, is
    not seen.
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


def _noting_step(optimizer, args, kwargs):
    model = _unique(p for p in (ref() for ref in _parameters) if p is not None)
    stepped = _unique(p for group in optimizer.param_groups for p in group["params"])
    storages = {p.grad.untyped_storage().data_ptr(): p.grad.untyped_storage().nbytes()
                for p in _unique(model + stepped) if p.grad is not None}
    held = sum(storages.values())
    square = sum(float(p.grad.detach().double().pow(2).sum()) for p in stepped if p.grad is not None)
    digest = hashlib.sha1()
    for p in model:
        digest.update(p.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    numel = sum(p.numel() for p in model)
    flat = (torch.cat([p.detach().reshape(-1).double() for p in model]).tolist() if 0 < numel <= FLAT_LIMIT
            else None)
    sitecustomize._append("zero_by_hand.jsonl", json.dumps(dict(
        pid=os.getpid(), rank=sitecustomize._rank(), restart=sitecustomize._restart(), step=_steps[0],
        held_grads=held, stepped_grad_square=square, params=digest.hexdigest()[:16], flat=flat)))
    _steps[0] += 1


register_optimizer_step_pre_hook(_noting_step)

if sitecustomize.RECORD_COLLECTIVES:
    for _name in ("all_gather_single", "reduce_scatter_single"):
        _collective = getattr(dist, _name, None)
        # (torch's own decorators set __wrapped__ too: the recorder's wrapper is told by its name)
        if _collective is not None and not _collective.__qualname__.startswith("_noting_collective"):
            setattr(dist, _name, sitecustomize._noting_collective(_name, _collective))
