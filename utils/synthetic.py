"""The default workload, and a wider model on the same data for step 5 (FSDP): learnable, built in milliseconds
from the seed alone, so every rank builds exactly the same tensors without sharing any file."""
import torch
from torch import nn
from torch.utils.data import TensorDataset

from utils.workload import Workload


def teacher_data(seed, n_train=2048, n_eval=512, n_features=20, noise=0.1):
    """(train, held-out) TensorDatasets whose targets come from a fixed random 'teacher' network plus noise.

    The teacher's output is scaled to unit variance, so an untrained model starts near loss 1.0 and a
    model that learned the teacher approaches noise**2 = 0.01.
    """
    gen = torch.Generator().manual_seed(seed)
    inputs = torch.randn(n_train + n_eval, n_features, generator=gen)
    w1 = torch.randn(n_features, 32, generator=gen) / n_features**0.5
    w2 = torch.randn(32, 1, generator=gen)
    clean = torch.tanh(inputs @ w1) @ w2
    targets = clean / clean.std() + noise * torch.randn(n_train + n_eval, 1, generator=gen)
    return TensorDataset(inputs[:n_train], targets[:n_train]), TensorDataset(inputs[n_train:], targets[n_train:])


def synthetic(seed):
    """The teacher's data on a small MLP, trained with Adam on the mean squared error."""
    train_set, eval_set = teacher_data(seed)
    torch.manual_seed(seed)  # same initial weights in every process (DDP would broadcast rank 0's anyway)
    n_features = train_set.tensors[0].shape[1]
    model = nn.Sequential(nn.Linear(n_features, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
    return Workload(train_set, eval_set, model, lambda model: torch.optim.Adam(model.parameters(), lr=3e-3),
                    nn.MSELoss())


class ResidualBlock(nn.Module):
    """x + relu(W x + b): deep stacks of these still train, because the identity path carries the signal."""

    def __init__(self, width):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x):
        return x + torch.relu(self.linear(x))


def wide(seed, width=512, blocks=4):
    """The same data on a model big enough for sharding to show: about 1M parameters, 4 MiB in float32 (with Adam's
    two moments and the gradients, 16 MiB of training state per copy), still a few seconds per epoch on a laptop
    CPU. Each block is one child of the top-level nn.Sequential, which is what fsdp.py shards one by one."""
    train_set, eval_set = teacher_data(seed)
    torch.manual_seed(seed)
    n_features = train_set.tensors[0].shape[1]
    model = nn.Sequential(nn.Linear(n_features, width), *[ResidualBlock(width) for _ in range(blocks)],
                          nn.Linear(width, 1))
    nn.init.zeros_(model[-1].weight)  # starts as a constant: the residual stack cannot blow the first loss up
    return Workload(train_set, eval_set, model, lambda model: torch.optim.Adam(model.parameters(), lr=1e-3),
                    nn.MSELoss())
