"""What a step trains: the `Workload` every builder returns, and the held-out evaluation every step ends with."""
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset

SEED = 0


@dataclass
class Workload:
    train_set: Dataset
    eval_set: Dataset
    model: nn.Module
    make_optimizer: Callable[[nn.Module], torch.optim.Optimizer]  # the optimizer of a model, with its settings
    loss_fn: Callable
    classification: bool = False  # evaluate() also reports accuracy when True
    optimizer: torch.optim.Optimizer = field(init=False)  # make_optimizer(model); fsdp.py makes its own after sharding

    def __post_init__(self):
        self.optimizer = self.make_optimizer(self.model)


class Metrics(dict):
    """Named results that print as `loss 0.0712 | accuracy 0.9120`."""

    def __str__(self):
        return " | ".join(f"{name} {value:.4f}" for name, value in self.items())


@torch.no_grad()
def evaluate(model, dataset, loss_fn, device, classification=False, batch_size=256, group=None):
    """Mean loss (and accuracy) over the whole held-out set; with a process group, shared by all ranks.

    Each rank scores every world_size-th sample, without DistributedSampler's padding, so no sample is
    counted twice; the sums are then all-reduced. Call it on every rank.

    Every rank runs the same number of forward passes (a rank with fewer samples ends on an empty batch):
    an FSDP model all-gathers its parameters inside forward, which needs every rank to take part.

    `group`: the ranks that split the samples, when not all of them do: under tensor parallelism the ranks of a tp
    group compute one forward together, on the same samples, so the samples are split over the dp group.
    """
    model = getattr(model, "module", model)  # the plain model: DDP's forward may sync buffers between ranks
    rank, world_size = (dist.get_rank(group), dist.get_world_size(group)) if dist.is_initialized() else (0, 1)
    for buffer in model.buffers() if world_size > 1 else ():  # BatchNorm statistics drift apart in the last step:
        dist.broadcast(buffer, src=0)  # every rank scores rank 0's model, the one the checkpoint holds
    indices = range(rank, len(dataset), world_size)
    most_indices = len(range(0, len(dataset), world_size))  # rank 0's share, the largest
    totals = torch.zeros(3, device=device)  # [summed loss, correct predictions, samples]
    was_training = model.training
    model.eval()
    for start in range(0, most_indices, batch_size):
        source, targets = dataset[list(indices[start:start + batch_size])]
        source, targets = source.to(device), targets.to(device)
        output = model(source)
        if len(source) == 0:  # this rank is out of samples; it ran the model only to keep in step with the others
            continue
        totals[0] += loss_fn(output, targets) * len(source)
        if classification:
            totals[1] += (output.argmax(dim=1) == targets).sum()
        totals[2] += len(source)
    model.train(was_training)
    if dist.is_initialized():
        dist.all_reduce(totals, group=group)
    metrics = Metrics(loss=(totals[0] / totals[2]).item())
    if classification:
        metrics["accuracy"] = (totals[1] / totals[2]).item()
    return metrics
