"""Exercise 8, right, in another style than the solution's: the padded flat vectors cut with chunk(), the gradient
reduce-scattered from a list of chunks and the parameters all-gathered into a list (torch.distributed's list forms),
the shard's gradient made in a method of its own (so nothing else of the step's outlives it), and the model's
gradients dropped with zero_grad before AdamW steps in ZeRO-2."""


class ShardedAdamW:
    def __init__(self, model, stage, lr, weight_decay):
        self.params = list(model.parameters())
        self.stage = stage
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.sizes = [p.numel() for p in self.params]
        self.numel = sum(self.sizes)
        self.shard_size = -(-self.numel // self.world_size)
        self.padded_numel = self.shard_size * self.world_size
        self.start = self.rank * self.shard_size
        mine = self.flat([p.detach() for p in self.params]).chunk(self.world_size)[self.rank]
        self.shard = nn.Parameter(mine.clone())
        self.optimizer = torch.optim.AdamW([self.shard], lr=lr, weight_decay=weight_decay)

    def flat(self, tensors):
        """The tensors as one vector, zeros at its end up to padded_numel."""
        vector = torch.zeros(self.padded_numel)
        vector[:self.numel] = torch.cat([tensor.reshape(-1) for tensor in tensors])
        return vector

    def my_gradient(self):
        """This rank's shard of the gradient averaged over the ranks."""
        pieces = list(self.flat([p.grad for p in self.params]).chunk(self.world_size))
        summed = torch.empty(self.shard_size)
        dist.reduce_scatter(summed, pieces)
        return summed.div_(self.world_size)

    def step(self):
        self.shard.grad = self.my_gradient()
        if self.stage == 2:
            for p in self.params:
                p.grad = None
        self.optimizer.step()
        shards = [torch.empty(self.shard_size) for _ in range(self.world_size)]
        dist.all_gather(shards, self.shard.detach())
        with torch.no_grad():
            values = torch.cat(shards)[:self.numel].split(self.sizes)
            for p, value in zip(self.params, values):
                p.copy_(value.view_as(p))

    def zero_grad(self):
        for p in self.params:
            p.grad = None
        self.shard.grad = None
