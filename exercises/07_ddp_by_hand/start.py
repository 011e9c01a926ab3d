"""Exercise 7 - DDP by hand: average the gradients over the ranks without DistributedDataParallel, the way it does.

Three stages, each closer to what DDP does inside backward():
  1. after loss.backward(), one all-reduce per parameter's gradient, divided by the world size;
  2. a hook on every parameter that starts an asynchronous all-reduce as soon as its gradient is ready (while
     backward still computes the gradients of the layers before it), all of them waited on before the step;
  3. buckets: gradients packed, in the order they arrive, into flat buffers of --bucket_mb MiB, one all-reduce per
     bucket (--bucket_mb 0: a bucket per parameter).

Work on a copy (cp exercises/07_ddp_by_hand/start.py my_ddp_by_hand.py) and follow the TODOs in HandDDP; run it
and check it with
    torchrun --standalone --nproc_per_node=2 my_ddp_by_hand.py --bucket_mb 0.1
    python exercises/check.py 7 my_ddp_by_hand.py
Rank 0 saves the final weights (a plain state_dict) to --save: the checker compares them with what torch's DDP
trains on the same samples, and reads the all-reduces each rank started, when, and when it waited for them.
"""
import argparse
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from utils import SEED, configure_cpu_threads, exit_without_teardown, non_negative_number, positive_int

FEATURES, CLASSES, SAMPLES = 64, 10, 640
LEARNING_RATE, MOMENTUM = 0.1, 0.9


def make_dataset(seed=SEED):
    """Random inputs labelled by a random teacher network: the same samples in every process."""
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(SAMPLES, FEATURES, generator=generator)
    teacher = torch.randn(FEATURES, CLASSES, generator=generator)
    return TensorDataset(inputs, (inputs @ teacher).argmax(dim=1))


def make_model(seed=SEED):
    """An MLP of layers of different sizes (so that buckets of a fixed size hold different numbers of gradients), the
    same initial weights in every process."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(FEATURES, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 128),
                         nn.ReLU(), nn.Linear(128, CLASSES))


def make_optimizer(model):
    # Plain SGD: the step is proportional to the gradient, so a gradient averaged by the wrong count shows in the
    # weights (Adam divides the scale away).
    return torch.optim.SGD(model.parameters(), lr=LEARNING_RATE, momentum=MOMENTUM)


class HandDDP:
    """Averages the gradients of `model` over the ranks of the process group, as DDP does: call finish() after
    loss.backward() and before optimizer.step()."""

    def __init__(self, model, bucket_mb):
        self.world_size = dist.get_world_size()
        self.bucket_bytes = bucket_mb * 2**20
        # The parameters whose gradients are ready but not sent yet: the bucket being filled.
        self.bucket = []
        # The buckets sent and not yet waited for: (the all-reduce's Work, its flat buffer, its parameters).
        self.in_flight = []
        # TODO 2: instead, register a hook on every parameter that backward calls as soon as its gradient is ready:
        # parameter.register_post_accumulate_grad_hook(self._gradient_ready) (the list below serves stage 1 only)
        self.parameters = list(model.parameters())

    def _gradient_ready(self, parameter):
        # TODO 2: send this parameter's gradient now (a bucket of one: self.bucket = [parameter]; self._send_bucket())
        # TODO 3: put it in self.bucket instead, and send the bucket once it holds self.bucket_bytes of gradients
        raise NotImplementedError("HandDDP._gradient_ready: see TODO 2 and 3")

    def _send_bucket(self):
        # TODO 2: take the parameters out of self.bucket (and empty it), concatenate their gradients into one flat
        # buffer, start dist.all_reduce(flat, async_op=True), and keep (work, flat, parameters) in self.in_flight
        raise NotImplementedError("HandDDP._send_bucket: see TODO 2")

    def finish(self):
        """After backward: send the bucket it left partly filled, wait for every bucket, and put the averages back
        in the gradients the optimizer reads."""
        # TODO 1: all-reduce every gradient (dist.all_reduce(parameter.grad) for each of self.parameters) and
        # divide it by the world size: all_reduce sums, and DDP's gradient is the mean over the ranks
        # TODO 2: then, instead, send the bucket left partly filled, wait() for each Work in self.in_flight, divide
        # its flat buffer by the world size and copy each slice back into its parameter's .grad; empty the list


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=positive_int, default=5, help="Passes over the data (20 steps each)")
    parser.add_argument("--batch_size", type=positive_int, default=16, help="Samples per rank and step")
    parser.add_argument("--bucket_mb", type=non_negative_number, default=0.1,
                        help="MiB of gradients per all-reduce (0: one bucket per parameter)")
    parser.add_argument("--save", default="hand_ddp.pt", help="Where rank 0 saves the final weights")
    parser.add_argument("--timeout", type=positive_int, default=60, help="Seconds a collective may wait for a rank")
    args = parser.parse_args()
    if "RANK" not in os.environ:
        raise SystemExit("error: start it with torchrun --standalone --nproc_per_node=2 ...")

    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    configure_cpu_threads(world_size)
    tag = f"[rank {rank}/{world_size} | cpu]"

    dataset = make_dataset()
    sampler = DistributedSampler(dataset, seed=SEED)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    model = make_model()
    optimizer = make_optimizer(model)
    loss_fn = nn.CrossEntropyLoss()
    hand_ddp = HandDDP(model, args.bucket_mb)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        total = torch.zeros(2)  # [summed loss, batches] of this rank
        for source, targets in loader:
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(source), targets)
            loss.backward()
            hand_ddp.finish()
            optimizer.step()
            total += torch.tensor([loss.item(), 1.0])
        # Every rank's losses, so that rank 0 prints the mean over the global batch.
        dist.all_reduce(total)
        if rank == 0:
            print(f"{tag} epoch {epoch} | steps {len(loader)} | loss {(total[0] / total[1]).item():.4f}")

    if rank == 0:
        torch.save(model.state_dict(), args.save)
        print(f"{tag} final weights saved to {args.save}")
    dist.destroy_process_group()
    exit_without_teardown()


if __name__ == "__main__":
    main()
