"""For a model of DTensors (FSDP, tensor parallelism), in samples.jsonl: `whole_along_tp`, a digest of the local parts
of the parameters this rank holds whole along the mesh dimension "tp" (every parameter not split over tp, FSDP's
shards over dp included), at the pass's end: the ranks of a tp group hold the same ones, and must keep them equal. And
`reduce_scatter_dtypes`, the dtypes of the gradients reduce-scattered during the pass (FSDP's), sorted."""
import sys

import torch

from .models import _hash, _optimizers
from .passes import _now


def note_reduce_scatter_dtypes():
    """Note the dtype of each tensor torch.distributed reduce-scatters during a pass."""

    def noting_reduce_scatter(reduce_scatter):
        def noting(*args, **kwargs):
            if _now["in_pass"]:
                tensor = kwargs.get("input", args[1] if len(args) > 1 else None)
                _now["reduce_scatter_dtypes"].add(str(getattr(tensor, "dtype", None)).replace("torch.", ""))
            return reduce_scatter(*args, **kwargs)
        return noting

    for name in ("reduce_scatter_tensor", "reduce_scatter_single"):  # FSDP's, in torch 2.6 and 2.14
        if hasattr(torch.distributed, name):
            setattr(torch.distributed, name, noting_reduce_scatter(getattr(torch.distributed, name)))


def _whole_along_tp_hash():
    """The local parts of the DTensor parameters of every optimizer alive that are not split over a mesh dimension
    named "tp", hashed in a fixed order; None when there are none (a job that never imported DTensor has none: it is
    not imported for it)."""
    if "torch.distributed.tensor" not in sys.modules:
        return None
    from torch.distributed.tensor import DTensor

    whole = []
    for optimizer in (ref() for ref in _optimizers):
        for param in (p for group in (optimizer.param_groups if optimizer else []) for p in group["params"]):
            if not isinstance(param, DTensor):
                continue
            names = param.device_mesh.mesh_dim_names or ()
            if "tp" not in names or not param.placements[names.index("tp")].is_shard():
                whole.append(param.to_local())
    return _hash(whole) if whole else None
