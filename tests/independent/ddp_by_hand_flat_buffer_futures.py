"""Exercise 7, right, in another style than the solution's: one flat buffer for every gradient, laid out in the order
backward hands them over and cut into buckets planned once; a bucket leaves from the hook of its last gradient, as an
all-reduce whose future divides the sum by the world size; finish() waits for every future at once and points each
.grad at its slice of the averaged buffer."""
import torch.futures


class Bucket:
    """A slice of the flat gradient buffer and the parameters whose gradients it holds."""

    def __init__(self, view, members):
        self.view = view
        self.members = members
        self.waiting_for = len(members)
        self.future = None


class HandDDP:
    def __init__(self, model, bucket_mb):
        self.world_size = dist.get_world_size()
        capacity = bucket_mb * 2**20
        # backward goes from the output to the input: the last layer's gradients are ready first
        arrival = list(model.parameters())[::-1]
        self.flat = torch.zeros(sum(p.numel() for p in arrival))
        self.where = {}
        self.buckets = []
        members, start, filled = [], 0, 0
        offset = 0
        for p in arrival:
            self.where[p] = offset
            offset += p.numel()
            members.append(p)
            filled += p.numel() * p.element_size()
            if filled >= capacity or p is arrival[-1]:
                bucket = Bucket(self.flat[start:offset], members)
                for member in members:
                    self.where[member] = (self.where[member], bucket)
                self.buckets.append(bucket)
                members, start, filled = [], offset, 0
        for p in arrival:
            p.register_post_accumulate_grad_hook(self.on_grad)

    def on_grad(self, p):
        offset, bucket = self.where[p]
        self.flat[offset:offset + p.numel()].copy_(p.grad.view(-1))
        bucket.waiting_for -= 1
        if bucket.waiting_for == 0:
            world_size = self.world_size
            sent = dist.all_reduce(bucket.view, async_op=True).get_future()
            bucket.future = sent.then(lambda done: done.value()[0].div_(world_size))

    def finish(self):
        torch.futures.wait_all([bucket.future for bucket in self.buckets])
        for bucket in self.buckets:
            for p in bucket.members:
                offset, _ = self.where[p]
                p.grad.copy_(self.flat[offset:offset + p.numel()].view_as(p))
            bucket.waiting_for = len(bucket.members)
            bucket.future = None
