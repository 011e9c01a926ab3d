"""What a rank sends: every collective of a step as torch's own comm-counting mode (CommDebugMode) sees it, weighed,
named by the mesh dimension of its process group, and what a ring algorithm sends for it. The step of the planner
(plan_at_scale.py), the benchmarks (communication.py, one_mesh.py) and the recorder of harness/jobs count with it.

    groups = named_groups({"dp": mesh["dp"].get_group(), "tp": mesh["tp"].get_group()})
    with counting_collectives(groups) as counting:
        step()
    counting.collectives               [{kind, group, ranks, members, bytes, backward (, sent)}], in the order called
    sent_per_rank(collective)          the bytes one rank sends for one of them

CommDebugMode is a dispatch mode: it sees every collective a rank calls, c10d's (DDP's all-reduces, FSDP's all-gathers
and reduce-scatters, an all-to-all) and DTensor's functional ones (tensor parallelism's), on real tensors and on fake
ones alike. It counts no point-to-point op; a pipeline's sends pass the same dispatcher as c10d's `send`, and each is
noted here as one "send/recv" (the receive is its peer's send, counted there). Each collective's buffer is weighed
whole: an all-gather's output, a reduce-scatter's input, an all-reduce's tensor, a send's block. "Sent per rank" is
what a ring algorithm sends for that buffer: 2(n-1)/n of it for an all-reduce, (n-1)/n for an all-gather or a
reduce-scatter over n ranks, all of it for a send; a group of one rank sends nothing. An all-to-all's is what this
rank sends to the other ranks (its input less its own split).
"""
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.debug._comm_mode import c10d_collective_ops
from torch.utils._pytree import tree_leaves

# The dispatcher's names of the collectives (c10d's in-place ops, DTensor's functional ones), by what they do.
KINDS = {"allreduce_": "all-reduce", "all_reduce": "all-reduce", "_allgather_base_": "all-gather",
         "allgather_into_tensor_coalesced_": "all-gather", "all_gather_into_tensor": "all-gather",
         "all_gather_into_tensor_coalesced": "all-gather", "_reduce_scatter_base_": "reduce-scatter",
         "reduce_scatter_tensor_coalesced_": "reduce-scatter", "reduce_scatter_tensor": "reduce-scatter",
         "reduce_scatter_tensor_coalesced": "reduce-scatter", "broadcast_": "broadcast", "broadcast": "broadcast",
         "alltoall_base_": "all-to-all", "send": "send/recv"}


def named_groups(groups):
    """{process group name: (label, ranks)} for `groups` ({label: ProcessGroup}, e.g. a mesh's dimensions), and for
    every other process group of this process over the same ranks: the groups a mesh dimension's DTensors and FSDP
    use need not be the objects mesh[dim].get_group() hands out, and torch keeps no public list of them. A label
    given first wins where two span the same ranks (the default group is dp's when dp spans all ranks)."""
    ranks_of = {label: dist.get_process_group_ranks(group) for label, group in groups.items()}
    named = {}
    for group, name in dist.distributed_c10d._world.pg_names.items():
        ranks = dist.get_process_group_ranks(group)
        label = next((label for label, theirs in ranks_of.items() if theirs == ranks), None)
        if label is not None:
            named[name] = (label, ranks)
    return named


def group_name(arg):
    """The name of the process group a collective's argument stands for, else None. c10d's collectives take the group
    itself (a ScriptObject inside the dispatcher), DTensor's functional ones its name."""
    if isinstance(arg, torch.ScriptObject):
        try:
            return dist.ProcessGroup.unbox(arg).group_name
        except RuntimeError:  # another ScriptObject: the ReduceOp
            return None
    return arg if isinstance(arg, str) else None


def ranks_of(name):
    """The global ranks of the process group of that name, None when no group has it."""
    try:
        return dist.get_process_group_ranks(dist.distributed_c10d._resolve_process_group(name))
    except (RuntimeError, ValueError):
        return None


def sent_to_others(args):
    """The bytes an all_to_all_single (c10d's alltoall_base_: output, input, group, output splits, input splits) sends
    to the other ranks of its group: its input less the rows it keeps, its own split (even ones when none are given)."""
    source, group, splits = args[1], dist.ProcessGroup.unbox(args[2]), args[4]
    rows = splits or [len(source) // group.size()] * group.size()
    return (len(source) - rows[group.rank()]) * source[0].numel() * source.element_size() if len(source) else 0


class counting_collectives(CommDebugMode):
    """CommDebugMode that also notes, per collective and per point-to-point send, its kind, its group's label and size
    (`groups`: named_groups()'s {name: (label, ranks)}; a group not in it is labelled by its size, "group of N"), its
    buffer's bytes (an all-to-all's input, and what it sends to other ranks) and whether backward ran it."""

    def __init__(self, groups):
        super().__init__()
        self.groups, self.collectives = groups, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # CommDebugMode notes every operation, collective or not, with its inputs' shapes and placements for its
        # tracing table, which is never printed here; on a step of fake tensors that note costs more than the rest of
        # the mode (it asks of every operation whether its tensors are fake). An operation that is not a collective
        # by CommDebugMode's own lists, nor a send, runs as CommDebugMode runs it, unnoted: a DTensor's is handed back
        # to DTensor (NotImplemented), which runs it as the local operations and collectives the mode then sees.
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **(kwargs or {}))
        packet = func._overloadpacket
        if packet not in self.comm_registry and packet not in c10d_collective_ops and packet is not torch.ops.c10d.send:
            if any(t == DTensor for t in types):
                return NotImplemented
            return func(*args, **(kwargs or {}))
        before = sum(self.comm_counts.values())
        out = super().__torch_dispatch__(func, types, args, kwargs)
        # CommDebugMode counted a collective, or a point-to-point send went by, which it leaves uncounted.
        if sum(self.comm_counts.values()) > before or func._overloadpacket is torch.ops.c10d.send:
            self.collectives.append(self.weighed(func, args, out))
        return out

    def weighed(self, func, args, out):
        # The collective's group: the first argument that names one (a functional collective also takes the name of
        # its reduction, "sum").
        names = [name for name in map(group_name, tree_leaves(args)) if name is not None]
        name = next(name for name in names if name in self.groups or ranks_of(name) is not None)
        ranks = self.groups[name][1] if name in self.groups else ranks_of(name)
        label = self.groups[name][0] if name in self.groups else f"group of {len(ranks)}"
        kind = KINDS.get(func._overloadpacket.__name__, func._overloadpacket.__name__)
        tensors = [leaf for leaf in tree_leaves((args, out)) if isinstance(leaf, torch.Tensor)]
        weight = (args[1].numel() * args[1].element_size() if kind == "all-to-all"
                  else max(t.numel() * t.element_size() for t in tensors))
        return dict(kind=kind, group=label, ranks=len(ranks), members=list(ranks), bytes=weight,
                    backward=self.advanced_module_tracker.is_bw,
                    **(dict(sent=sent_to_others(args)) if kind == "all-to-all" else {}))


def sent_per_rank(collective):
    """Bytes one rank sends for a collective with a ring algorithm (what NCCL and gloo use for large buffers); a
    point-to-point send sends its whole buffer, an all-to-all what it counted for the other ranks."""
    n = collective["ranks"]
    if collective["kind"] == "all-to-all":
        return collective["sent"]
    if collective["kind"] == "send/recv":
        return collective["bytes"] if n > 1 else 0.0
    share = (n - 1) / n if n > 1 else 0.0
    return collective["bytes"] * share * (2 if collective["kind"] == "all-reduce" else 1)
