"""The workload every step trains: dataset, held-out split, model, optimizer and loss, from one call.

`make_workload(name)` is the only thing a step script asks for, so new workloads can be added here
(in WORKLOADS) without touching the step scripts or their diffs.
"""
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from utils import vision

SEED = 0


@dataclass
class Workload:
    train_set: Dataset
    eval_set: Dataset
    model: nn.Module
    optimizer: torch.optim.Optimizer
    loss_fn: Callable
    classification: bool = False  # evaluate() also reports accuracy when True


def make_workload(name="synthetic", seed=SEED):
    """Build the named workload. Same name and seed: the same data and initial weights, in any process."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)}")
    return WORKLOADS[name](seed)


def synthetic_regression(seed, n_train=2048, n_eval=512, n_features=20, noise=0.1):
    """Targets from a fixed random 'teacher' network plus noise: learnable, and the best loss is known.

    The teacher's output is scaled to unit variance, so an untrained model starts near loss 1.0 and a
    model that learned the teacher approaches noise**2 = 0.01. Built in milliseconds from `seed` alone,
    so every rank builds exactly the same tensors without sharing any file.
    """
    gen = torch.Generator().manual_seed(seed)
    inputs = torch.randn(n_train + n_eval, n_features, generator=gen)
    w1 = torch.randn(n_features, 32, generator=gen) / n_features**0.5
    w2 = torch.randn(32, 1, generator=gen)
    clean = torch.tanh(inputs @ w1) @ w2
    targets = clean / clean.std() + noise * torch.randn(n_train + n_eval, 1, generator=gen)
    train_set = TensorDataset(inputs[:n_train], targets[:n_train])
    eval_set = TensorDataset(inputs[n_train:], targets[n_train:])

    torch.manual_seed(seed)  # same initial weights in every process (DDP would broadcast rank 0's anyway)
    model = nn.Sequential(nn.Linear(n_features, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    return Workload(train_set, eval_set, model, optimizer, nn.MSELoss())


WORKLOADS = {
    "synthetic": synthetic_regression,
    "mnist": vision.mnist,  # small CNN; data in $TUTORIAL_DATA_DIR (default ./data), downloaded when online
    "cifar10": vision.cifar10,  # resnet18 from scratch
    "fakedata": vision.fakedata,  # random images, no files: offline benchmarks
}


class Metrics(dict):
    """Named results that print as `loss 0.0712 | accuracy 0.9120`."""

    def __str__(self):
        return " | ".join(f"{name} {value:.4f}" for name, value in self.items())


@torch.no_grad()
def evaluate(model, dataset, loss_fn, device, classification=False, batch_size=256):
    """Mean loss (and accuracy) over the whole held-out set; with a process group, shared by all ranks.

    Each rank scores every world_size-th sample, without DistributedSampler's padding, so no sample is
    counted twice; the sums are then all-reduced. Call it on every rank.

    Every rank runs the same number of forward passes (a rank with fewer samples ends on an empty batch):
    an FSDP model all-gathers its parameters inside forward, which needs every rank to take part.
    """
    model = getattr(model, "module", model)  # the plain model: DDP's forward may sync buffers between ranks
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
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
        dist.all_reduce(totals)
    metrics = Metrics(loss=(totals[0] / totals[2]).item())
    if classification:
        metrics["accuracy"] = (totals[1] / totals[2]).item()
    return metrics
