"""The models and optimizers a process builds, for samples.jsonl: whether the model was wrapped in
DistributedDataParallel (`ddp`); `bypass`, the first stack (as in saves.jsonl) that called the model inside it
directly during the pass, so no gradient was averaged (None: it never happened); this rank's place in a named device
mesh (`mesh`); and digests of the DDP-wrapped parameters and the optimizers' state (`params_before`,
`optimizer_before`, `params`, `optimizer`), which samples.py takes as each pass begins and ends."""
import hashlib
import weakref

import torch
from torch.nn.parallel import DistributedDataParallel

from .notes import _stack
from .passes import _now

_wrapped = [False]  # did this process build a DistributedDataParallel?
_models, _optimizers = [], []  # weak references: the DDP-wrapped models and the optimizers this process built


def note_models():
    """Note each DistributedDataParallel built (its model, and a hook that sees the model called without it), each
    call of its forward, each optimizer built, and the named device mesh this rank is placed in."""
    ddp_init, ddp_forward = DistributedDataParallel.__init__, DistributedDataParallel.forward
    optimizer_init = torch.optim.Optimizer.__init__

    def noting_ddp_init(self, *args, **kwargs):
        _wrapped[0] = True
        ddp_init(self, *args, **kwargs)
        _models.append(weakref.ref(self.module))
        self.module.register_forward_pre_hook(_noting_bypass)

    def noting_ddp_forward(self, *args, **kwargs):
        _now["in_ddp"] += 1
        try:
            return ddp_forward(self, *args, **kwargs)
        finally:
            _now["in_ddp"] -= 1

    def noting_optimizer_init(self, *args, **kwargs):
        optimizer_init(self, *args, **kwargs)
        _optimizers.append(weakref.ref(self))

    DistributedDataParallel.__init__ = noting_ddp_init
    if torch.distributed.is_available():
        _note_device_mesh()
    DistributedDataParallel.forward = noting_ddp_forward
    torch.optim.Optimizer.__init__ = noting_optimizer_init


def _noting_bypass(module, inputs):
    if _now["in_pass"] and not _now["in_ddp"] and _now["bypass"] is None:
        _now["bypass"] = _stack()


def _note_device_mesh():
    import torch.distributed.device_mesh

    init_device_mesh = torch.distributed.device_mesh.init_device_mesh

    def noting_init_device_mesh(*args, **kwargs):
        """This rank's coordinates in a mesh with named dimensions (FSDP's own unnamed 1-D mesh is left out)."""
        mesh = init_device_mesh(*args, **kwargs)
        if mesh.mesh_dim_names:
            _now["mesh"] = dict(zip(mesh.mesh_dim_names, mesh.get_coordinate()))
        return mesh

    torch.distributed.device_mesh.init_device_mesh = noting_init_device_mesh
    torch.distributed.init_device_mesh = noting_init_device_mesh


def _hash(tensors):
    """A short digest of the tensors' bytes; None when one is not a plain tensor (a DTensor shard of FSDP, whose bytes
    would take a collective to read): only DDP's replicas are compared."""
    digest = hashlib.sha1()
    for tensor in tensors:
        if type(tensor) not in (torch.Tensor, torch.nn.Parameter):
            return None
        digest.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def _parameters_hash():
    models = [model for model in (ref() for ref in _models) if model is not None]
    return _hash(p for model in models for p in model.parameters()) if models else None


def _optimizer_hash():
    """The state of every optimizer alive (Adam's moments and step counts), in a fixed order."""
    states = [opt.state_dict()["state"] for opt in (ref() for ref in _optimizers) if opt is not None]
    return _hash(value if isinstance(value, torch.Tensor) else torch.as_tensor(value) for state in states
                 for key in sorted(state) for _, value in sorted(state[key].items())
                 if isinstance(value, (torch.Tensor, int, float)))
