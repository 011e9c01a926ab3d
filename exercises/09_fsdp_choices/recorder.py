"""Recorder plugin of exercise 9 (FSDP's choices): which parameters FSDP2 (fully_shard) held whole, and when.

Named in JOB_RECORD_PLUGINS (by this file's path), it writes fsdp_choices.jsonl, JSON lines with pid, rank, restart and
`event`:
- "shard", per call of torch.distributed.fsdp.fully_shard, before it runs: `module` (the class of the module given),
  `params` (how many parameters it holds), `sharded_already` (how many of them an earlier call sharded: DTensors
  already), `reshard_after_forward` (as passed; None: not passed), `caller` ([file, line, function], the innermost
  frame outside the installation: the learner's line).
- "step", per optimizer step, as it begins (so it covers the forward and backward passes since the step before):
  `step` (the optimizer steps this process had taken before this one), and
  - `units`: every FSDP unit (the parameter group fully_shard made of a module), in the order they were first
    gathered, each {"module": its name in the model ("" for the root, or for a module that is a root of its own),
    "params": its parameters' names, "bytes": their bytes whole, "gathers": how many times it was gathered whole
    (all-gathered) since the step before, "resharded_in_forward": whether it was sharded again at the end of its
    forward (True), or stayed whole until backward (False; None: it was not gathered in forward)};
  - `peaks`: {"forward": bytes, "backward": bytes}, the most bytes of parameters this rank held whole at once, during
    forward and during backward; `at_peak`: {"forward": [modules], "backward": [modules]}, the units whole then. A
    unit counts as whole from the moment its all-gather is issued (its buffer exists: a unit FSDP gathers ahead, in
    backward, counts from then) until it is resharded;
  - `plain`: the bytes of the parameters the optimizer steps that FSDP does not shard (plain tensors, not DTensors:
    every rank updates its own copy), and `total`: the bytes of all the parameters the optimizer steps, whole.
- "unsupported", once, where this torch's FSDP lacks the internals wrapped here: `why`.

How: FSDPParamGroup (torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py, torch 2.6 and later) issues a unit's
all-gather in unshard(), turns its parameters whole in _to_unsharded() and back into shards in _to_sharded() (or, for
reshard_after_forward=N, _to_sharded_post_forward()); all are wrapped, and a unit's training state (FORWARD,
PRE_BACKWARD, POST_BACKWARD) says which pass a change belongs to. Peaks are measured at each of those moments (a
reshard just before it frees): nothing else changes what is whole.
"""
import functools
import json
import os

import sitecustomize  # noqa: F401  (the recorder: _append, _rank, _restart)
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

_units = {}  # id(param group) -> its record, in the order the units were first gathered
_whole = {}  # id(param group) -> bytes, for the units whole right now
_peaks, _at_peak = {}, {}
_steps = [0]


def _note(**fields):
    sitecustomize._append("fsdp_choices.jsonl", json.dumps(dict(pid=os.getpid(), rank=sitecustomize._rank(),
                                                                restart=sitecustomize._restart(), **fields)))


def _phase(group):
    state = getattr(getattr(group, "_training_state", None), "name", "")
    if state == "FORWARD":
        return "forward"
    if state in ("PRE_BACKWARD", "POST_BACKWARD") or torch._C._current_graph_task_id() != -1:
        return "backward"
    return "forward"


def _unit(group):
    unit = _units.get(id(group))
    if unit is None:
        unit = _units[id(group)] = dict(group=group, gathers=0, resharded_in_forward=None)
    return unit


def _whole_bytes(group):
    total = 0
    for fsdp_param in group.fsdp_params:
        size = fsdp_param._orig_size.numel()
        dtype = getattr(fsdp_param, "param_dtype", None) or fsdp_param.sharded_param.dtype
        total += size * torch.empty((), dtype=dtype).element_size()
    return total


def _measure(group):
    """Note the bytes held whole now against the peak of the pass `group` changes in."""
    phase = _phase(group)
    held = sum(_whole.values())
    if held > _peaks.get(phase, -1):
        _peaks[phase] = held
        _at_peak[phase] = [_name(_units[key]["group"]) for key in _whole]


def _name(group):
    return getattr(group, "_module_fqn", None) or ""


def _install():
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    except ImportError as error:
        return f"torch {torch.__version__} has no torch.distributed.fsdp._fully_shard ({error})"
    missing = [name for name in ("unshard", "_to_unsharded", "_to_sharded", "_to_sharded_post_forward")
               if not hasattr(FSDPParamGroup, name)]
    if missing:
        return f"torch {torch.__version__}'s FSDPParamGroup has no {', '.join(missing)}"
    unshard, to_unsharded = FSDPParamGroup.unshard, FSDPParamGroup._to_unsharded
    to_sharded, to_sharded_post_forward = FSDPParamGroup._to_sharded, FSDPParamGroup._to_sharded_post_forward

    def _gathered(self):
        """`self` holds its parameters whole from now on: from its all-gather (its buffer exists) to its reshard."""
        if id(self) in _whole:
            return
        unit = _unit(self)
        unit["gathers"] += 1
        if _phase(self) == "forward":
            unit["resharded_in_forward"] = False  # until its forward ends with a reshard
        _whole[id(self)] = _whole_bytes(self)
        _measure(self)

    def _noting_unshard(self, *args, **kwargs):
        result = unshard(self, *args, **kwargs)
        if getattr(self, "_all_gather_result", None) is not None:
            _gathered(self)  # the all-gather was issued: gathered ahead of its use (prefetched), or for it
        return result

    def _noting_unsharded(self):
        result = to_unsharded(self)
        _gathered(self)
        return result

    def _resharding(original):
        def resharding(self):
            if id(self) in _whole:
                _measure(self)  # the moment before it is freed: all that is whole now was whole together
                if _phase(self) == "forward":
                    _unit(self)["resharded_in_forward"] = True
                del _whole[id(self)]
            return original(self)
        return resharding

    import torch.distributed.fsdp as fsdp

    fully_shard = fsdp.fully_shard

    @functools.wraps(fully_shard)
    def _noting_fully_shard(module, *args, **kwargs):
        from torch.distributed.tensor import DTensor

        modules = list(module) if isinstance(module, (list, tuple)) else [module]
        params = [param for each in modules for param in each.parameters()]
        stack = sitecustomize._stack()
        _note(event="shard", module=", ".join(type(each).__name__ for each in modules), params=len(params),
              sharded_already=sum(isinstance(param, DTensor) for param in params),
              reshard_after_forward=kwargs.get("reshard_after_forward"), caller=stack[-1] if stack else None)
        return fully_shard(module, *args, **kwargs)

    fsdp.fully_shard = _noting_fully_shard
    FSDPParamGroup.unshard = _noting_unshard
    FSDPParamGroup._to_unsharded = _noting_unsharded
    FSDPParamGroup._to_sharded = _resharding(to_sharded)
    FSDPParamGroup._to_sharded_post_forward = _resharding(to_sharded_post_forward)
    return None


def _is_sharded(param):
    from torch.distributed.tensor import DTensor

    return isinstance(param, DTensor)


def _noting_step(optimizer, args, kwargs):
    params = [param for group in optimizer.param_groups for param in group["params"]]
    units = []
    for unit in _units.values():
        group = unit["group"]
        units.append(dict(module=_name(group), params=[fsdp_param._param_fqn for fsdp_param in group.fsdp_params],
                          bytes=_whole_bytes(group), gathers=unit["gathers"],
                          resharded_in_forward=unit["resharded_in_forward"]))
    _note(event="step", step=_steps[0], units=units, peaks=dict(_peaks), at_peak=dict(_at_peak),
          plain=sum(param.numel() * param.element_size() for param in params if not _is_sharded(param)),
          total=sum(param.numel() * param.element_size() for param in params))
    _steps[0] += 1
    for unit in _units.values():
        unit.update(gathers=0, resharded_in_forward=None)
    _peaks.clear()
    _at_peak.clear()


_unsupported = _install()
if _unsupported:
    _note(event="unsupported", why=_unsupported)
else:
    register_optimizer_step_pre_hook(_noting_step)
