"""Exercise 9 - FSDP's choices: which modules become units, and whether each unit reshards after its forward.

FSDP keeps 1/N of every parameter on each of N ranks and gathers a unit's parameters whole (an all-gather) only
while that unit computes. A unit is what fully_shard was given: a module, with the parameters it holds that no unit
inside it took. So the units decide how much of the model a rank holds whole at once; reshard_after_forward decides
whether a unit gives its whole parameters back at the end of its forward (and gathers them again in backward) or keeps
them until its backward is done. Step 5 (fsdp.py) makes each block a unit, then the root.

This script trains a residual MLP of 4 blocks with FSDP2 on 2 CPU ranks (torch 2.9 or newer), 32 steps. It runs as
it is, but its shard(model, mesh) makes the root the only unit: every rank gathers the whole model at once, the memory
FSDP is there to save. Work on a copy and write shard() (the TODO); hints in exercises/09_fsdp_choices/hints.md. Run
and check it with
    torchrun --standalone --nproc_per_node=2 my_fsdp.py        # in the repository root: `from utils import ...`
    python exercises/check.py 9 my_fsdp.py
The checker measures the most bytes of parameters each rank holds whole at once, in forward and in backward, against
the bound the model allows (the root's own parameters and two blocks: the one computing and the next, gathered ahead),
and compares the losses and the final weights with what one process computes on the same samples (as DDP would).
"""
import argparse
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from utils import (SEED, attempt_store, configure_cpu_threads, exit_without_teardown, positive_int,
                   require_torch_for_fsdp, watch_this_worker, writable_path)
from utils.synthetic import teacher_data


class Block(nn.Module):
    """x + down(relu(up(norm(x)))): a transformer's MLP block, the unit a real model is sharded by."""

    def __init__(self, width, hidden):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


class ResidualMLP(nn.Module):
    """In, a stack of blocks, out: the root's own parameters (embed, norm, head) are small beside the blocks'."""

    def __init__(self, features, width=64, hidden=256, blocks=4):
        super().__init__()
        self.embed = nn.Linear(features, width)
        self.blocks = nn.ModuleList(Block(width, hidden) for _ in range(blocks))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build_model(features):
    # The same weights in every process: FSDP shards what each rank built, it does not broadcast rank 0's.
    torch.manual_seed(SEED)
    return ResidualMLP(features)


def make_optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def shard(model, mesh):
    """Make model's modules FSDP units over `mesh`, in place."""
    # TODO: make each block of model.blocks a unit of its own, before the root (fully_shard(block, mesh=mesh, ...)),
    # TODO: and choose its reshard_after_forward. The root alone, below, gathers the whole model at once.
    fully_shard(model, mesh=mesh)


def main(args):
    require_torch_for_fsdp()  # FSDP on CPU processes needs torch 2.9: else one line
    # From here on a hang, a lost torchrun or Ctrl-C stops this worker with one line (utils/launch.py).
    watch_this_worker(args.timeout)
    dist.init_process_group("gloo", store=attempt_store(args.timeout), rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]), timeout=timedelta(seconds=args.timeout))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    configure_cpu_threads(int(os.environ["LOCAL_WORLD_SIZE"]))
    tag = f"[rank {rank}/{world_size} | cpu]"
    train_set, _ = teacher_data(SEED)
    model = build_model(train_set.tensors[0].shape[1])
    shard(model, init_device_mesh("cpu", (world_size,)))
    optimizer = make_optimizer(model)  # after shard: it steps the shards
    loss_fn = nn.MSELoss()
    # Each rank its own 1/world_size of the samples, in batches of batch_size: one step per batch.
    data = DataLoader(train_set, batch_size=args.batch_size, shuffle=False, sampler=DistributedSampler(train_set))
    losses = []
    for source, targets in data:
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(source), targets)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    # Every rank's mean loss of each step, averaged over the ranks: the loss of the step's global batch.
    mean_losses = torch.stack(losses)
    dist.all_reduce(mean_losses)
    mean_losses /= world_size
    # The whole weights, gathered from the shards (every rank takes part), saved by rank 0.
    weights = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        print(f"{tag} {len(losses)} steps | loss {mean_losses[0]:.4f} -> {mean_losses[-1]:.4f}")
        torch.save(weights, args.weights)
        print(f"{tag} whole weights saved to {args.weights}")
    dist.destroy_process_group()
    exit_without_teardown()  # Python's teardown can abort under gloo: see utils


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch_size", default=32, type=positive_int, help="Samples per rank per step")
    parser.add_argument("--weights", default="fsdp_weights.pt", type=writable_path, help="Where to save the weights")
    parser.add_argument("--timeout", default=60, type=positive_int, help="Seconds before a stuck collective fails")
    args = parser.parse_args()

    # CPU processes only (gloo), any number of them: torchrun numbers them, whatever GPUs the machine has.
    if "LOCAL_RANK" not in os.environ:
        raise SystemExit("error: start this script with torchrun, which starts and numbers the processes: "
                         f"torchrun --standalone --nproc_per_node=2 {os.path.basename(sys.argv[0])}")
    main(args)
