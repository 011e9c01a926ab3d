"""The GPT's feed-forward layer: what a dense block runs after attention, and what each expert of a mixture-of-experts
block is (utils/moe.py)."""
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.proj(F.gelu(self.fc(x))))
