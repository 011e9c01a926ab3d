"""The "wide" workload: the synthetic regression task with a model big enough for sharding to show.

A stack of wide residual blocks (about 1M parameters, 4 MiB in float32; with Adam's two moments and the gradients,
16 MiB of training state per copy), still a few seconds per epoch on a laptop CPU. Each block is one child of the
top-level nn.Sequential, which is what fsdp.py shards one by one.
"""
import torch
from torch import nn

from utils.workload import WORKLOADS, Workload, synthetic_regression


class ResidualBlock(nn.Module):
    """x + relu(W x + b): deep stacks of these still train, because the identity path carries the signal."""

    def __init__(self, width):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x):
        return x + torch.relu(self.linear(x))


def wide_regression(seed, width=512, blocks=4):
    """Same data as "synthetic" (the same teacher, the same split); a wide residual MLP instead of the small one."""
    task = synthetic_regression(seed)
    torch.manual_seed(seed)  # same initial weights in every process
    n_features = task.train_set.tensors[0].shape[1]
    model = nn.Sequential(nn.Linear(n_features, width), *[ResidualBlock(width) for _ in range(blocks)],
                          nn.Linear(width, 1))
    nn.init.zeros_(model[-1].weight)  # starts as a constant: the residual stack cannot blow the first loss up
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    return Workload(task.train_set, task.eval_set, model, optimizer, task.loss_fn)


WORKLOADS["wide"] = wide_regression
