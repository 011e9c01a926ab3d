"""Memory per rank, gathered into one table: what `fsdp.py --verbose` prints at the start, after each epoch, at the end;
and, for `tensor_parallel.py --verbose`, the part of every matrix of a block that each rank holds (log_slices).

Two kinds of numbers per rank:
- the memory of its device: on a GPU, what the CUDA allocator holds now and at its peak on the process's own GPU
  (cuda:LOCAL_RANK, so the index is right on every node); on a CPU, the process's resident set now and at its peak;
- the training state it holds: parameters, gradients and optimizer state, summed over the tensors' *local* parts.
  Under FSDP a parameter is a DTensor whose local part is this rank's shard, so these shrink to ~1/world_size.
"""
import os
import resource
import socket
import weakref

import torch
import torch.distributed as dist

from utils.collectives import gathered_json

MiB = 2**20
COLUMNS = ["rank", "local", "host", "device", "now MiB", "peak MiB", "params MiB", "grads MiB", "optim MiB",
           "state MiB"]


def local_bytes(tensor):
    """Bytes this process holds of `tensor`: for a DTensor (a sharded parameter), only its own shard."""
    tensor = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return tensor.numel() * tensor.element_size()


def state_bytes(model, optimizer):
    """{params, grads, optim}: bytes of the training state this rank holds, from the local tensors' shapes."""
    parameters = list(model.parameters())
    optimizer_tensors = [value for state in optimizer.state.values() for value in state.values()
                         if isinstance(value, torch.Tensor)]
    return {"params": sum(local_bytes(p) for p in parameters),
            "grads": sum(local_bytes(p.grad) for p in parameters if p.grad is not None),
            "optim": sum(local_bytes(t) for t in optimizer_tensors)}


class saved_for_backward(torch.autograd.graph.saved_tensors_hooks):
    """Inside it, `.bytes` counts the memory autograd keeps for the backward pass: the activations, each storage once
    (the input that q, k and v all save is one tensor), weights and their views left out; of a DTensor, this rank's
    part. Activation checkpointing keeps a block's input alone (torch saves it through these hooks too) and recomputes
    the rest in backward; sequence parallelism keeps 1/tp of the positions where it splits them. It holds each storage
    it saw by a weak reference, never the storage itself: the backward frees a micro-batch's activations as it would
    unmeasured (holding them would keep every micro-batch's until the step ends, and the measured step would peak
    higher than any other), and a storage freed and made anew at the same address is told apart by its dead reference.
    The recorder of harness/jobs counts each pipeline stage's forward with it (pipeline.jsonl's `saved`)."""

    def __init__(self):
        self.bytes, self.seen = 0, {}
        super().__init__(self._pack, lambda tensor: tensor)

    def __enter__(self):
        super().__enter__()
        return self

    def _pack(self, tensor):
        # A weight, or a view of one (the transposed matrix a linear layer keeps for its input's gradient): not counted.
        if not isinstance(tensor if tensor._base is None else tensor._base, torch.nn.Parameter):
            local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
            local = local.wait() if hasattr(local, "wait") else local  # an all-gather's result, once it arrived
            storage = local.untyped_storage()
            counted = self.seen.get(storage._cdata)
            if (counted is None or counted() is not storage) and local.device.type != "meta":  # meta: a shape
                self.seen[storage._cdata] = weakref.ref(storage)
                self.bytes += storage.nbytes()
        return tensor

    def __exit__(self, *error):
        self.seen.clear()
        return super().__exit__(*error)


def device_memory(device):
    """(now, peak) bytes: the CUDA allocator's on a GPU; the process's resident set on a CPU (None: not known)."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device), torch.cuda.max_memory_allocated(device)
    try:  # Linux: VmRSS is the resident set now, VmHWM its peak, both in kB
        with open("/proc/self/status") as status:
            fields = dict(line.split(":", 1) for line in status if ":" in line)
        return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024
    except (OSError, KeyError):  # elsewhere only the peak is known (bytes on macOS)
        return None, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def format_table(stage, rows):
    """The table rank 0 prints: a title line, a header, then one row per rank."""
    def mib(value):
        return "n/a" if value is None else f"{value / MiB:.2f}"

    lines = [f"memory {stage} (state: the parameters, gradients and optimizer state each rank holds)",
             "  ".join(f"{name:>10}" for name in COLUMNS)]
    for row in rows:
        state = row["params"] + row["grads"] + row["optim"]
        cells = [row["rank"], row["local_rank"], row["host"], row["device"], mib(row["now"]), mib(row["peak"]),
                 mib(row["params"]), mib(row["grads"]), mib(row["optim"]), mib(state)]
        lines.append("  ".join(f"{cell:>10}" for cell in cells))
    return "\n".join(lines)


def log_memory(stage, model, optimizer, device, verbose=True):
    """Every rank measures itself; rank 0 prints all of them as one table. A collective: call it on every rank."""
    if not verbose:
        return
    now, peak = device_memory(device)
    row = dict(rank=dist.get_rank(), local_rank=int(os.environ.get("LOCAL_RANK", 0)), host=socket.gethostname(),
               device=str(device), now=now, peak=peak, **state_bytes(model, optimizer))
    rows = gathered_json(row)  # numbers and names as JSON in tensors (utils.collectives): no pickle on the wire
    if dist.get_rank() == 0:
        print(format_table(stage, rows), flush=True)



def slice_rows(module):
    """This rank's part of each matrix of `module`: (name, full shape, its slice over the mesh dimension "tp", the
    part it stores, bytes stored). A DTensor's placements say how each dimension of its mesh splits it: Shard(d) over
    n ranks leaves 1/n of tensor dimension d. FSDP then splits the tp slice again, over "dp"."""
    rows = []
    for name, param in module.named_parameters():
        if param.dim() != 2 or not hasattr(param, "placements"):
            continue
        sliced = list(param.shape)
        for size, dim_name, placement in zip(param.device_mesh.shape, param.device_mesh.mesh_dim_names,
                                             param.placements):
            if dim_name == "tp" and placement.is_shard():
                sliced[placement.dim] //= size
        rows.append((name, tuple(param.shape), tuple(sliced), tuple(param.to_local().shape), local_bytes(param)))
    return rows


def log_slices(module, verbose=True):
    """Every rank's part of each matrix of `module` (a block of a tensor-parallel model, whose parameters are DTensors
    on a ("dp", "tp") mesh), printed by rank 0 as one table. A collective: call it on every rank."""
    if not verbose:
        return
    mesh = next(param.device_mesh for param in module.parameters()  # the 2-D mesh of a split matrix
                if "tp" in (getattr(param, "device_mesh", None) and param.device_mesh.mesh_dim_names or ()))
    mine = dict(rank=dist.get_rank(), **dict(zip(mesh.mesh_dim_names, mesh.get_coordinate())), rows=slice_rows(module))
    everyone = gathered_json(mine)  # as JSON in tensors (utils.collectives): no pickle on the wire
    if dist.get_rank() == 0:
        print(format_slices(everyone), flush=True)


def format_slices(everyone):
    def shape(dims):
        return "x".join(map(str, dims))

    lines = ["slices: each rank's part of every matrix of a block (full -> the tp slice it computes with -> what it "
             "stores)",
             f"{'rank':>4} {'dp':>3} {'tp':>3}  {'matrix':<24} {'full':>9} {'tp slice':>9} {'stored':>9} {'KiB':>8}"]
    for row in everyone:
        for name, full, sliced, stored, size in row["rows"]:
            lines.append(f"{row['rank']:>4} {row['dp']:>3} {row['tp']:>3}  {name:<24} {shape(full):>9} "
                         f"{shape(sliced):>9} {shape(stored):>9} {size / 1024:>8.2f}")
    return "\n".join(lines)
