"""Exercise 7, wrong twice over: the hooks only collect the gradients, and the last one to fire sends every bucket (the
right buckets, in the order the gradients arrived, asynchronously, from inside backward), when backward has nothing
left to compute: nothing overlaps. And each bucket is divided by the world size as soon as its all-reduce has started,
while gloo is still summing it."""


class HandDDP:
    def __init__(self, model, bucket_mb):
        self.world_size = dist.get_world_size()
        self.limit = bucket_mb * 2**20
        self.count = len(list(model.parameters()))
        self.arrived = []
        self.sent = []
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(self.arrive)

    def arrive(self, p):
        self.arrived.append(p)
        if len(self.arrived) == self.count:
            self.send_everything()

    def send_everything(self):
        chunk, size = [], 0
        for p in self.arrived:
            chunk.append(p)
            size += p.grad.nbytes
            if size >= self.limit:
                self.send(chunk)
                chunk, size = [], 0
        if chunk:
            self.send(chunk)
        self.arrived = []

    def send(self, chunk):
        flat = torch.cat([p.grad.view(-1) for p in chunk])
        work = dist.all_reduce(flat, async_op=True)
        # average while the sum is on its way
        flat.div_(self.world_size)
        self.sent.append((work, flat, chunk))

    def finish(self):
        for work, flat, chunk in self.sent:
            work.wait()
            position = 0
            for p in chunk:
                p.grad.copy_(flat[position:position + p.numel()].view_as(p))
                position += p.numel()
        self.sent = []
