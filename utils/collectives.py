"""Plain data gathered from every rank as tensors of bytes: numbers, text and JSON, never a pickle.

torch's object collectives (all_gather_object, broadcast_object_list...) pickle what a rank sends and unpickle what it
receives, and unpickling runs whatever code the bytes name: a process that joined the job's process group (torch
has no authentication: docs/multinode.md's trust boundary) could make every rank run its code. The steps send their
numbers as tensors, and the little else they share (their arguments, the random states a snapshot saves, the
tables of --verbose) as the bytes below, which a rank decodes as JSON or keeps as bytes.

    gathered_bytes(data, group)     every rank's bytes, in rank order
    gathered_json(value, group)     every rank's JSON-able value (numbers, strings, lists, dicts), in rank order
"""
import hashlib
import json

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def _device():
    """Where this process group's collectives take their tensors: the current GPU under NCCL, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def gathered_bytes(data, group=None):
    """Every rank's `data` (bytes), in rank order: the lengths gathered first, then the bytes, padded to the longest.
    A collective: call it on every rank of `group` (None: all of them)."""
    device, ranks = _device(), dist.get_world_size(group)
    length = torch.tensor([len(data)], dtype=torch.int64, device=device)
    lengths = [torch.empty_like(length) for _ in range(ranks)]
    dist.all_gather(lengths, length, group=group)
    longest = max(int(each) for each in lengths)
    mine = torch.zeros(longest, dtype=torch.uint8, device=device)
    if data:
        mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    everyone = [torch.empty_like(mine) for _ in range(ranks)]
    dist.all_gather(everyone, mine, group=group)
    return [bytes(each[:int(size)].cpu().numpy()) for each, size in zip(everyone, lengths)]


def gathered_json(value, group=None):
    """Every rank's `value`, in rank order: what json.dumps takes (tuples come back as lists, infinities as themselves),
    anything else as its str(). A collective: call it on every rank of `group`."""
    text = json.dumps(value, sort_keys=True, default=str)
    return [json.loads(data) for data in gathered_bytes(text.encode(), group)]


def weights_digest(model, device):
    """Eight hex digits that differ when the weights do: every rank hashes the part of each parameter it holds (a
    shard under FSDP), and the group sums the hashes. A collective of the default group: call it on every rank.
    Step 13 prints it at every step, so two replica groups that hold the same weights show the same digits."""
    hashed = hashlib.sha256()
    for parameter in model.parameters():
        local = parameter.to_local() if isinstance(parameter, DTensor) else parameter
        hashed.update(local.detach().float().cpu().numpy().tobytes())
    total = torch.tensor(int(hashed.hexdigest()[:12], 16), dtype=torch.int64, device=device)
    dist.all_reduce(total)
    return f"{int(total) % 16**8:08x}"
