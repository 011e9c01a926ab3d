"""Exercise 10, right, in another style than the solution's: each micro-batch's share of the batch's loss is computed
in loss_fn (its mean squared error divided by M), the two schedules are lists of actions that one loop runs, the
tensors of the micro-batches in flight are kept by number, and a rank receives with blocking recv."""
from collections import deque


def loss_fn(output, targets, microbatches=4):
    """A micro-batch's share of the batch's loss: its mean squared error divided by the number of micro-batches, so
    that the micro-batches' gradients add up to the batch's."""
    return F.mse_loss(output, targets) / microbatches


class Stage:
    def __init__(self, module, rank, microbatches, microbatch_size):
        self.module = module
        self.rank = rank
        self.microbatches = microbatches
        self.is_first = rank == 0
        self.is_last = rank == STAGES - 1
        self.shape = (microbatch_size, HIDDEN)
        self.inputs = self.targets = None
        self.kept = {}  # micro-batch -> (what came in, what went out)
        self.oldest = deque()  # the micro-batches forwarded and not yet backwarded
        self.outgoing = []
        self.losses = []

    def forward(self, number):
        if self.is_first:
            came_in = self.inputs[number]
        else:
            came_in = torch.zeros(self.shape)
            dist.recv(came_in, src=self.rank - 1)
            came_in.requires_grad_(True)
        went_out = self.module(came_in)
        if self.is_last:
            went_out = loss_fn(went_out, self.targets[number], self.microbatches)
            self.losses.append(went_out.detach())
        else:
            self.outgoing.append(dist.isend(went_out.detach(), self.rank + 1))
        self.kept[number] = (came_in, went_out)
        self.oldest.append(number)

    def backward(self):
        came_in, went_out = self.kept.pop(self.oldest.popleft())
        if self.is_last:
            went_out.backward()
        else:
            incoming = torch.zeros_like(went_out)
            dist.recv(incoming, src=self.rank + 1)
            went_out.backward(incoming)
        if not self.is_first:
            self.outgoing.append(dist.isend(came_in.grad, self.rank - 1))

    def finish(self):
        while self.outgoing:
            self.outgoing.pop().wait()


def actions(schedule, rank, microbatches):
    """One step's passes on `rank`, in order: ("F", micro-batch) or ("B", None), the oldest in flight."""
    if schedule == "gpipe":
        return [("F", number) for number in range(microbatches)] + [("B", None)] * microbatches
    warmup = min(STAGES - 1 - rank, microbatches)
    plan = [("F", number) for number in range(warmup)]
    for number in range(warmup, microbatches):
        plan += [("F", number), ("B", None)]
    return plan + [("B", None)] * warmup


def play(stage, plan):
    for kind, number in plan:
        if kind == "F":
            stage.forward(number)
        else:
            stage.backward()


def gpipe(stage, microbatches):
    play(stage, actions("gpipe", stage.rank, microbatches))


def one_f_one_b(stage, microbatches):
    play(stage, actions("1f1b", stage.rank, microbatches))
