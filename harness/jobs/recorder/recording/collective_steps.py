"""The "backward", "step" and "stepped" lines of collectives.jsonl (see collectives.py):
- "backward": each Tensor.backward's `began` and `ended`, and `ready`, [time, bytes] of each gradient it accumulated
  into a parameter (a hook of the recorder's on every parameter a module registered, run before the program's own);
- "step" as an optimizer step begins: `params` and `grads`, the bytes of the parameters it updates and of their
  gradients, and `held`, with the plugin ddp_by_hand: the tensors given to collectives still alive then, each storage
  once, the model's parameters and the optimizer's state left out, as {"seq", "step", "op", "caller", "bytes"} of the
  first call each was given to (None without it);
- "stepped" as it ends: `state`, the bytes of its state tensors (AdamW's moments)."""
import time
import weakref

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from .collectives import _OPTIONS, _given, _in_backward, _note, _optimizer_steps

_ready = []  # [time, bytes] of each gradient the backward under way has accumulated, in order
_parameters = []  # weak references to every parameter a module registered: their memory is the model's


def record_backwards_and_steps():
    """Note when each parameter's gradient is ready, each Tensor.backward, and each optimizer step's start and end."""
    register_parameter, backward = nn.Module.register_parameter, torch.Tensor.backward

    def noting_register_parameter(self, name, param):
        """Every parameter a module registers: noted (weakly), and a hook of its own, registered before any of the
        program's, that notes when backward has accumulated its gradient."""
        register_parameter(self, name, param)
        if param is not None and param.requires_grad and not any(ref() is param for ref in _parameters[-64:]):
            _parameters.append(weakref.ref(param))
            param.register_post_accumulate_grad_hook(_noting_ready)

    def noting_backward_times(self, *args, **kwargs):
        began = time.time()
        outermost = not _in_backward[0]
        if outermost:
            _ready.clear()
        _in_backward[0] += 1
        try:
            return backward(self, *args, **kwargs)
        finally:
            _in_backward[0] -= 1
            _note(event="backward", began=began, ended=time.time(), step=_optimizer_steps[0],
                  ready=list(_ready) if outermost else [])

    nn.Module.register_parameter = noting_register_parameter
    torch.Tensor.backward = noting_backward_times
    register_optimizer_step_pre_hook(_noting_step_began)
    register_optimizer_step_post_hook(_noting_step_ended)


def _noting_ready(parameter):
    _ready.append([time.time(), parameter.grad.numel() * parameter.grad.element_size()])


def _state_bytes(optimizer):
    return sum(value.numel() * value.element_size() for state in optimizer.state.values()
               for value in state.values() if isinstance(value, torch.Tensor) and value.dim() > 0)


def _storage(tensor):
    return tensor.untyped_storage().data_ptr()


def _held(optimizer):
    """The tensors given to collectives that are still alive as this step begins, each storage once (the model's
    parameters and the optimizer's state left out: they are held anyway), as {"seq", "step", "op", "caller", "bytes"}
    of the first call each was given to; those of this step's calls first."""
    models = {_storage(p) for p in (ref() for ref in _parameters) if p is not None}
    models |= {_storage(p) for group in optimizer.param_groups for p in group["params"]}
    models |= {_storage(value) for state in optimizer.state.values() for value in state.values()
               if isinstance(value, torch.Tensor)}
    alive = [(ref(), sequence, step, op, caller) for ref, sequence, step, op, caller in _given]
    _given[:] = [entry for entry, (tensor, *_) in zip(_given, alive) if tensor is not None]
    held, seen = [], set()
    for tensor, sequence, step, op, caller in sorted((entry for entry in alive if entry[0] is not None),
                                                     key=lambda entry: (entry[2] != _optimizer_steps[0], entry[1])):
        storage = _storage(tensor)
        if storage in models or storage in seen:
            continue
        seen.add(storage)
        held.append(dict(seq=sequence, step=step, op=op, caller=caller, bytes=tensor.untyped_storage().nbytes()))
    return held


def _noting_step_began(optimizer, args, kwargs):
    _note(event="step", step=_optimizer_steps[0], began=time.time(),
          params=sum(p.numel() * p.element_size() for group in optimizer.param_groups for p in group["params"]),
          grads=sum(p.grad.numel() * p.grad.element_size() for group in optimizer.param_groups
                    for p in group["params"] if p.grad is not None),
          held=_held(optimizer) if _OPTIONS["note_held"] else None)


def _noting_step_ended(optimizer, args, kwargs):
    _note(event="stepped", step=_optimizer_steps[0], ended=time.time(), state=_state_bytes(optimizer))
    _optimizer_steps[0] += 1
