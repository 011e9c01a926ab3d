"""Exercise 8 - ZeRO by hand: each rank keeps AdamW's state for its own shard of the parameters only (ZeRO-1), then
holds only its shard's gradient too (ZeRO-2).

Plain data parallelism keeps a whole AdamW on every rank: two moments per parameter, twice the model's bytes, the same
on every rank. ZeRO cuts the parameters, as one flat vector, into world_size equal shards: rank r steps only shard r
(its AdamW holds 1/world_size of the state), then the ranks all-gather the updated shards, so every rank has the whole
model again for the next forward. Work on a copy and follow the TODOs in ShardedAdamW; check it with
    python exercises/check.py 8 my_zero.py
which runs `torchrun --standalone --nproc_per_node=2 my_zero.py --stage 1` and `... --stage 2` and compares the
weights with AdamW in one process on the whole batch, measures the optimizer state and the gradients each rank holds
at its step, and counts the bytes every collective moved.
"""
import argparse
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from utils import configure_cpu_threads, exit_without_teardown, positive_int, replacing

SEED = 0
GLOBAL_BATCH = 16  # samples per step, over all ranks: each rank trains on its own 1/world_size of them
LEARNING_RATE, WEIGHT_DECAY = 1e-2, 0.01
WEIGHTS = "weights.pt"  # rank 0's parameters after the last step, for the checker
# torch 2.14 renames all_gather_into_tensor and reduce_scatter_tensor (deprecating the old names, which 2.6 to 2.13
# have only): the same collectives.
ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def make_model():
    """A tiny MLP of 339 parameters: an odd count, so the flat vector needs padding to cut into two equal shards."""
    torch.manual_seed(SEED)
    return nn.Sequential(nn.Linear(10, 24), nn.Tanh(), nn.Linear(24, 3))


def global_batches(steps):
    """`steps` batches of GLOBAL_BATCH samples, the same on every rank (a seeded generator): inputs and the targets of
    a random linear teacher, with noise."""
    generator = torch.Generator().manual_seed(SEED + 1)
    teacher = torch.randn(10, 3, generator=generator)
    for _ in range(steps):
        inputs = torch.randn(GLOBAL_BATCH, 10, generator=generator)
        yield inputs, inputs @ teacher + 0.1 * torch.randn(GLOBAL_BATCH, 3, generator=generator)


class ShardedAdamW:
    """AdamW over this rank's shard of the model's parameters (ZeRO-1); with stage 2 the rank keeps only its shard's
    gradient too (ZeRO-2). step() and zero_grad() as an optimizer's."""

    def __init__(self, model, stage, lr, weight_decay):
        self.params = list(model.parameters())
        self.stage = stage
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.sizes = [p.numel() for p in self.params]
        self.numel = sum(self.sizes)
        # TODO 1: this rank's shard: 1/world_size of the flat vector, padded with zeros to divide by world_size
        # The collectives cut a vector into world_size equal shards: the count is rounded up, and the flat vectors
        # get zeros at their end (339 parameters on 2 ranks: 2 shards of 170, one zero of padding).
        self.shard_size = (self.numel + self.world_size - 1) // self.world_size
        self.start = self.rank * self.shard_size
        self.padded_numel = self.shard_size * self.world_size
        # A copy of this rank's slice of the flat parameters, a tensor of its own: the only parameters AdamW updates.
        flat = self.padded(torch.cat([p.detach().reshape(-1) for p in self.params]))
        self.shard = nn.Parameter(flat[self.start:self.start + self.shard_size].clone())
        # Its state, two moments as large as the tensors it steps, is then this rank's share of AdamW's.
        self.optimizer = torch.optim.AdamW([self.shard], lr=lr, weight_decay=weight_decay)

    def padded(self, flat):
        """The flat vector with zeros at its end, padded_numel long: every rank's shard is as long."""
        return F.pad(flat, (0, self.padded_numel - flat.numel()))

    def step(self):
        # This rank's gradients (of its own samples), as one flat vector cut as the parameters are.
        flat_grad = self.padded(torch.cat([p.grad.reshape(-1) for p in self.params]))
        # TODO 2: each rank needs only its shard's gradient, averaged over the ranks
        # A reduce-scatter sums the ranks' vectors and hands rank r shard r of the sum: Psi (N-1)/N bytes sent from
        # each rank, half an all-reduce's 2 Psi (N-1)/N. The sum over the ranks, divided by their number (in place:
        # one shard of gradients, not two), is the gradient of the mean loss over the global batch.
        shard_grad = torch.empty(self.shard_size)
        REDUCE_SCATTER(shard_grad, flat_grad)
        shard_grad /= self.world_size
        self.shard.grad = shard_grad
        # TODO 3: with --stage 2, keep no gradient but the shard's: free the whole model's before the step
        # ZeRO-2: the reduce-scatter has taken what this rank needs from the whole gradient; the rest is freed, so
        # the rank holds 1/world_size of the gradients as it steps. (DeepSpeed and FSDP reduce-scatter bucket by
        # bucket during backward, so the whole gradient never exists at once; here it does, until this point.)
        if self.stage == 2:
            del flat_grad
            for p in self.params:
                p.grad = None
        self.optimizer.step()
        # TODO 4: every rank needs every updated shard for its next forward: all-gather them into one flat vector
        # Rank r's shard lands at r x shard_size: where it came from in the padded flat vector.
        gathered = torch.empty(self.padded_numel)
        ALL_GATHER(gathered, self.shard.detach())
        # The padding's zeros at the end are no parameter's: they are left out.
        with torch.no_grad():
            for p, piece in zip(self.params, gathered[:self.numel].split(self.sizes)):
                p.copy_(piece.view_as(p))

    def zero_grad(self):
        for p in self.params:
            p.grad = None
        self.shard.grad = None


def main(args):
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    configure_cpu_threads(int(os.environ["LOCAL_WORLD_SIZE"]))
    tag = f"[rank {rank}/{world_size} | cpu]"
    if GLOBAL_BATCH % world_size:
        raise SystemExit(f"error: the global batch of {GLOBAL_BATCH} samples does not split into {world_size} ranks")
    # The same seed on every rank: every rank starts from the same parameters.
    model = make_model()
    optimizer = ShardedAdamW(model, args.stage, LEARNING_RATE, WEIGHT_DECAY)
    if rank == 0:
        print(f"{tag} ZeRO-{args.stage}: {optimizer.numel} parameters, {optimizer.shard_size} a shard")
    share = GLOBAL_BATCH // world_size
    for step, (inputs, targets) in enumerate(global_batches(args.steps), start=1):
        # This rank's own slice of the global batch: the mean of the ranks' mean losses is the global batch's.
        mine = slice(rank * share, (rank + 1) * share)
        loss = F.mse_loss(model(inputs[mine]), targets[mine])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 10 == 0 or step == args.steps:
            mean_loss = loss.detach().clone()
            dist.all_reduce(mean_loss)
            if rank == 0:
                print(f"{tag} step {step} | loss {mean_loss.item() / world_size:.4f}")
    if rank == 0:
        # Written to a file of its own, then renamed over the last one: a crash never leaves half a file.
        with replacing(WEIGHTS) as tmp:
            torch.save(model.state_dict(), tmp)
        print(f"{tag} weights saved to {WEIGHTS}")
    dist.destroy_process_group()
    exit_without_teardown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stage", type=int, default=1, choices=(1, 2), help="1: shard the optimizer's state; 2: and "
                        "the gradients")
    parser.add_argument("--steps", type=positive_int, default=40, help="Optimizer steps to take")
    parser.add_argument("--timeout", type=positive_int, default=60, help="Seconds before a stuck collective fails")
    args = parser.parse_args()
    if "LOCAL_RANK" not in os.environ:
        command = " ".join(["torchrun --standalone --nproc_per_node=2", os.path.basename(__file__), *sys.argv[1:]])
        raise SystemExit(f"error: start this script with torchrun, which starts and numbers the processes: {command}")
    main(args)
