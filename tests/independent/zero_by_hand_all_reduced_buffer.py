"""Exercise 8, wrong twice over, as ZeRO-1 is often first written: the whole flat gradient is all-reduced (3 Psi a
step with the all-gather, where a reduce-scatter makes it 2 Psi), into a buffer the optimizer keeps for the next step
(self.flat_grad, filled in place each step). ZeRO-2 then frees every parameter's .grad and gives the shard a gradient
of its own, but the buffer still holds the whole gradient as each rank steps. The weights and the optimizer state are
right."""


class ShardedAdamW:
    def __init__(self, model, stage, lr, weight_decay):
        self.params = list(model.parameters())
        self.stage = stage
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.sizes = [p.numel() for p in self.params]
        self.numel = sum(self.sizes)
        self.shard_size = (self.numel + self.world_size - 1) // self.world_size
        self.start = self.rank * self.shard_size
        self.padded_numel = self.world_size * self.shard_size
        # one buffer for the flat gradient, made once and reused every step
        self.flat_grad = torch.zeros(self.padded_numel)
        flat = self.padded(torch.cat([p.detach().reshape(-1) for p in self.params]))
        self.shard = nn.Parameter(flat[self.start:self.start + self.shard_size].clone())
        self.optimizer = torch.optim.AdamW([self.shard], lr=lr, weight_decay=weight_decay)

    def padded(self, flat):
        return F.pad(flat, (0, self.padded_numel - flat.numel()))

    def step(self):
        torch.cat([p.grad.reshape(-1) for p in self.params], out=self.flat_grad[:self.numel])
        dist.all_reduce(self.flat_grad)
        self.shard.grad = self.flat_grad[self.start:self.start + self.shard_size] / self.world_size
        if self.stage == 2:
            for p in self.params:
                p.grad = None
        self.optimizer.step()
        everything = torch.empty(self.padded_numel)
        ALL_GATHER(everything, self.shard.detach())
        with torch.no_grad():
            for p, piece in zip(self.params, everything[:self.numel].split(self.sizes)):
                p.copy_(piece.view_as(p))

    def zero_grad(self):
        for p in self.params:
            p.grad = None
        self.shard.grad = None
