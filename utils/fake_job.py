"""What the steps' own code needs to run one rank of a big job on fake tensors and torch's fake process group, and no
real job does: each one a stand-in for a thing a fake tensor cannot do (hold a number, be moved in place, carry a
router's choices) or a fake process group cannot (hand a result back). plan_at_scale.py (step 14) uses them; each says
what it changes, and none changes what a step computes or sends.

    NewJobNumbers()                 a Trainer's start checks read 0 from fake tensors: a new job
    already_in_place()              Trainer's model.to(device) skipped; DDP's C++ shape check skipped
    each_bucket_all_reduced         DDP's default all-reduce of a bucket, as a Python hook the fake backend completes
    EvenRouter()                    every expert gets an even share of the tokens (torch.bincount)
    even_routing(layer, ...)        utils.moe.MoE._dispatch with those even counts
    forget_the_meshes()             DTensor's caches emptied between two ranks traced in one process
"""
import contextlib

import torch
import torch.distributed as dist
import torch.nn.parallel.distributed as ddp_module
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from utils.moe import AllToAll


class NewJobNumbers(TorchDispatchMode):
    """A Trainer checks where the job starts by reading numbers its collectives return (is there a snapshot on any
    rank? do all ranks start at the same epoch?). Fake tensors hold no numbers: inside this mode each reads as 0, a
    new job's answer (no snapshot anywhere, epoch 0 everywhere). For building a Trainer; a step reads no number."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            return False if args[0].dtype == torch.bool else 0
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def already_in_place():
    """A Trainer moves its model to its device first (model.to(device)). A planned model is where it would go already:
    its fake tensors are on the CPU, or, for FSDP to shard, on the meta device until it gets fake memory; and torch
    cannot move a fake parameter in place (it swaps it, which fake tensors forbid): the move is skipped. So is DDP's
    check that every rank's weights have the same shapes, which reads their bytes in C++ (fake ones have none): here
    every rank's are the same by construction."""
    move, verify = torch.nn.Module.to, ddp_module._verify_param_shape_across_processes
    torch.nn.Module.to = lambda module, *args, **kwargs: module
    ddp_module._verify_param_shape_across_processes = lambda *args, **kwargs: None
    try:
        yield
    finally:
        torch.nn.Module.to, ddp_module._verify_param_shape_across_processes = move, verify


def each_bucket_all_reduced(group, bucket):
    """DDP's all-reduce of a bucket of gradients (a communication hook: ddp.register_comm_hook(group, this)), as its
    default one does it, divided by the group's size and summed over it: the same collective over the same bytes. The
    fake backend's works complete with no result, which DDP's own hook (C++) expects; this one hands the bucket back."""
    gradients = bucket.buffer().div_(dist.get_world_size(group))
    dist.all_reduce(gradients, group=group)
    done = torch.futures.Future()
    done.set_result(gradients)
    return done


class EvenRouter(TorchDispatchMode):
    """A mixture of experts counts the tokens its router sends to each expert (torch.bincount) and sizes its
    all-to-alls by the counts: fake tensors hold no router's choices. Inside this mode every expert gets an even
    share (each token's top_k choices spread evenly), and even_routing sends them. A real router is uneven: its
    all-to-alls' bytes differ from rank to rank and step to step; their sum over an ep group is this one's."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.bincount.default:
            chosen, experts = args[0], (kwargs or {}).get("minlength", args[2] if len(args) > 2 else 0)
            return torch.full((experts,), chosen.numel() // experts, dtype=torch.long)
        return func(*args, **(kwargs or {}))


def even_routing(layer, routed, counts):
    """utils.moe.MoE._dispatch, line for line, with EvenRouter's counts, which no fake tensor holds as numbers: the same
    collectives in the same order (the counts' all-to-all, the tokens out, their outputs back) and the same regrouping
    by expert, each rank of the ep group getting an even share of the tokens and each of its experts an even share of
    those. Set it on a layer: layer._dispatch = lambda routed, counts: even_routing(layer, routed, counts)."""
    ep = dist.get_world_size(layer.group)
    incoming = torch.empty_like(counts)
    dist.all_to_all_single(incoming, counts, group=layer.group)
    send = receive = [len(routed) // ep] * ep  # _dispatch reads them from the counts
    arrived = AllToAll.apply(routed, receive, send, layer.group)
    per_expert = incoming.view(ep, -1)
    expert_of_row = torch.arange(per_expert.shape[1], device=routed.device).repeat(ep)
    by_expert = expert_of_row.repeat_interleave(incoming, output_size=len(arrived)).argsort(stable=True)
    mine = per_expert.shape[1]  # the experts this rank holds of the layer
    computed = layer.experts(arrived[by_expert], [len(arrived) // mine] * mine)
    outputs = computed.new_empty(computed.shape).index_copy_(0, by_expert, computed)
    return AllToAll.apply(outputs, send, receive, layer.group)


def forget_the_meshes():
    """DTensor remembers what it worked out for the tensors of each mesh, by the mesh's shape and names; the next rank
    traced in this process has a mesh of the same shape and names, but process groups of its own: forget it all."""
    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.propagate_op_sharding.cache_clear()
    type(propagator)._propagate_tensor_meta_cached.cache_clear()
    if hasattr(torch._C, "_clear_DTensor_sharding_propagator_cache"):  # its C++ copy (recent torch)
        torch._C._clear_DTensor_sharding_propagator_cache()
