"""Recorder plugin of step 14 (plan_at_scale.py): what each rank of a real job holds, keeps and sends, step by step, to
hold the planner's counts against.

JOB_RECORD_PLUGINS=traffic writes traffic.jsonl, a JSON line per optimizer step of each process, as the step ends:
pid, rank, restart, `step` (the optimizer steps this process has taken, this one included), and, since the step before
ended:
  - `collectives`: every collective the process called, as torch's dispatcher saw it: [kind, the global ranks of its
    group, bytes], in order, weighed by utils/traffic.py's counting_collectives (torch's CommDebugMode), the counter
    the planner counts with, entered here for the process's whole life;
  - `activations`: the bytes autograd kept for backward (utils/memory.saved_for_backward). A step that measures them
    itself (one_mesh.py's first step of an epoch) hides them from this count, which then shows 0;
and as the step ends: `params`, `grads`, `optim`, the bytes of the training state the rank holds (utils/memory's
state_bytes, over the parameters the optimizer steps).
"""
import json
import os

import sitecustomize  # the recorder: _append, _rank, _restart
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from utils.memory import local_bytes, saved_for_backward
from utils.traffic import counting_collectives

_counting = counting_collectives({})  # no labels: each group by its ranks
_counting.__enter__()
_saved = [saved_for_backward().__enter__()]
_steps = [0]


def _noting_step(optimizer, args, kwargs):
    _steps[0] += 1
    _saved[0].__exit__(None, None, None)
    parameters = [p for group in optimizer.param_groups for p in group["params"]]
    state = [value for values in optimizer.state.values() for value in values.values()
             if isinstance(value, torch.Tensor)]
    sitecustomize._append("traffic.jsonl", json.dumps(dict(
        pid=os.getpid(), rank=sitecustomize._rank(), restart=sitecustomize._restart(), step=_steps[0],
        collectives=[[c["kind"], c["members"], c["bytes"]] for c in _counting.collectives],
        activations=_saved[0].bytes, params=sum(local_bytes(p) for p in parameters),
        grads=sum(local_bytes(p.grad) for p in parameters if p.grad is not None),
        optim=sum(local_bytes(t) for t in state))))
    _counting.collectives.clear()
    _saved[0] = saved_for_backward().__enter__()


register_optimizer_step_post_hook(_noting_step)
