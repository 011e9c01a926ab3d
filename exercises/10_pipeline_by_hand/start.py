"""Exercise 10 - a pipeline schedule by hand: a model cut in two stages on two ranks, each micro-batch's activation
sent forward and its gradient sent back with isend/irecv; first GPipe, then 1F1B.

Step 8 (pipeline_parallel.py) lets torch.distributed.pipelining run the schedule; here you write it. Rank 0 holds the
first half of a small model, rank 1 the second half and the loss. Every optimizer step cuts its batch into M
micro-batches. A forward of micro-batch i on rank 1 needs the activation rank 0 computed for it; a backward of
micro-batch i on rank 0 needs the gradient rank 1 computed for that activation. The schedule says in which order each
rank runs its passes:
- GPipe: every forward (F0 F1 ... F(M-1)), then every backward in the same order (B0 B1 ... B(M-1)).
- 1F1B: rank r of p first runs p-1-r forwards (the warm-up), then alternates one forward and one backward (the
  steady state), then runs the backwards left (the cool-down). Rank 0 of 2 runs F0 F1 B0 F2 B1 F3 B2 B3, rank 1 runs
  F0 B0 F1 B1 F2 B2 F3 B3.
The gradients must be those of one process training the whole model on the same batches.

It runs as it is, and stops at a TODO. Work on a copy (in the repository's root, so `from utils import ...`
works) and follow the TODOs in order: 1-4 make GPipe work (`--schedule gpipe`), 5 adds 1F1B. Check it with
    python exercises/check.py 10 my_pipeline.py
which runs `torchrun --standalone --nproc_per_node=2 my_pipeline.py --schedule gpipe` and `--schedule 1f1b` and
compares the first step's gradients and the final weights with one process's, the order of each rank's passes with
the schedule's, and the activations each rank held at once (autograd's saved tensors, measured).
"""
import argparse
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from utils import configure_cpu_threads, exit_without_teardown, positive_int, require_torchrun

STAGES = 2  # one stage per rank
FEATURES, HIDDEN = 8, 32
LEARNING_RATE = 0.05


def whole_model():
    """The model one process would train. Seeded: every process builds the same weights, and cuts out its stage."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.Tanh(),
                         nn.Linear(HIDDEN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 1))


def cut(model, stage):
    """Stage `stage`'s layers: two of the four linear ones each, so what crosses between the ranks is the output of
    the second linear layer. A slice of a Sequential keeps the whole model's names (4.weight stays 4.weight), so each
    rank's weights can be laid beside one process's."""
    half = len(model) // 2
    return model[:half] if stage == 0 else model[half:]


def batch(step, size):
    """The batch of optimizer step `step`, the same in every process: inputs and their targets."""
    generator = torch.Generator().manual_seed(step)
    inputs = torch.randn(size, FEATURES, generator=generator)
    # A smooth function of every feature, which the small model learns within the 30 steps (its loss falls tenfold).
    return inputs, torch.sin(inputs.sum(dim=1, keepdim=True) / 4)


def loss_fn(output, targets):
    """The loss of a batch, or of a micro-batch: the mean squared error over its samples."""
    return F.mse_loss(output, targets)


class Stage:
    """One rank's part of the pipeline: its layers, and what each micro-batch in flight needs for its backward."""

    def __init__(self, module, rank, microbatches, microbatch_size):
        self.module, self.rank, self.microbatches = module, rank, microbatches
        self.is_first, self.is_last = rank == 0, rank == STAGES - 1
        # What arrives from the stage before: one micro-batch's activation.
        self.activation_shape = (microbatch_size, HIDDEN)
        self.inputs = self.targets = None  # this step's micro-batches: inputs on the first stage, targets on the last
        self.in_flight = []  # (input, output) of each micro-batch forwarded and not yet backwarded, oldest first
        self.sends = []  # the isends not waited for yet
        self.losses = []  # the last stage's losses of this step, each divided by M

    def forward(self, microbatch):
        # TODO 1: run this stage's forward of `microbatch` and hand its result on.
        # - Its input: on the first stage, self.inputs[microbatch]; on the others, a new tensor of
        #   self.activation_shape received from rank self.rank - 1 (dist.irecv(tensor, src=...) returns a
        #   Work: wait() for it), then made a leaf that wants its gradient (requires_grad_()): that gradient goes
        #   back in TODO 2.
        # - The last stage computes the loss, loss_fn(output, self.targets[microbatch]) divided by
        #   self.microbatches (M), and appends it (detached) to self.losses. The others send their output, detached, to
        #   rank self.rank + 1 with dist.isend, and keep its Work in self.sends without waiting (TODO 3 waits).
        # - Append (input, output or loss) to self.in_flight: the backward needs both.
        raise NotImplementedError("TODO 1: Stage.forward: receive the input, run the layers, send the output on")

    def backward(self):
        # TODO 2: run the backward of the oldest micro-batch in flight (self.in_flight.pop(0)).
        # - The last stage calls backward() on its loss. The others receive the gradient of their output from rank
        #   self.rank + 1 (into torch.empty_like(output), irecv, wait), then call
        #   torch.autograd.backward(output, gradient).
        # - Every stage but the first then sends its input's gradient (input.grad) to rank self.rank - 1 with
        #   dist.isend, its Work kept in self.sends.
        raise NotImplementedError("TODO 2: Stage.backward: receive the gradient, run the backward, send the input's")

    def finish(self):
        # TODO 3: wait() for every Work in self.sends, then empty the list: a sent tensor may not be changed or freed
        # before its send completed.
        raise NotImplementedError("TODO 3: Stage.finish: wait for every isend")


def gpipe(stage, microbatches):
    # TODO 4: GPipe: stage.forward(i) for every micro-batch i, then stage.backward() once per micro-batch.
    raise NotImplementedError("TODO 4: the GPipe schedule: every forward, then every backward")


def one_f_one_b(stage, microbatches):
    # TODO 5: 1F1B: p-1-r forwards first (p: STAGES, r: stage.rank; at most M), then one forward and one backward
    # until every micro-batch ran its forward, then the backwards left. Rank 0 of 2: F0 F1 B0 F2 B1 F3 B2 B3.
    raise NotImplementedError("TODO 5: the 1F1B schedule: warm-up, one forward one backward, cool-down")


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b}


def main(args):
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if world_size != STAGES:
        raise SystemExit(f"error: this pipeline has {STAGES} stages, one per rank: start {STAGES} processes, "
                         f"not {world_size}")
    configure_cpu_threads(world_size)
    tag = f"[rank {rank}/{world_size} | cpu]"
    module = cut(whole_model(), rank)
    optimizer = torch.optim.SGD(module.parameters(), lr=LEARNING_RATE)
    stage = Stage(module, rank, args.microbatches, args.batch_size // args.microbatches)
    schedule = SCHEDULES[args.schedule]
    for step in range(args.steps):
        inputs, targets = batch(step, args.batch_size)
        stage.inputs, stage.targets = inputs.chunk(args.microbatches), targets.chunk(args.microbatches)
        schedule(stage, args.microbatches)
        stage.finish()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        # Only the last stage has the losses: it prints them.
        if stage.is_last and (step == 0 or (step + 1) % 10 == 0):
            print(f"{tag} step {step + 1} | {args.schedule} | loss {sum(stage.losses).item():.4f}", flush=True)
        stage.losses.clear()
    # Each rank saves its stage's weights, under the whole model's names.
    torch.save(module.state_dict(), f"stage{rank}.pt")
    dist.destroy_process_group()
    exit_without_teardown()  # Python's teardown can abort under gloo: see utils


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schedule", default="gpipe", choices=sorted(SCHEDULES), help="The order of the passes")
    parser.add_argument("--microbatches", default=4, type=positive_int, help="Micro-batches per batch (M)")
    parser.add_argument("--batch_size", default=16, type=positive_int, help="Samples per optimizer step")
    parser.add_argument("--steps", default=30, type=positive_int, help="Optimizer steps")
    parser.add_argument("--timeout", default=60, type=positive_int, help="Seconds before a stuck send or recv fails")
    args = parser.parse_args()
    if args.batch_size % args.microbatches:
        parser.error(f"--batch_size {args.batch_size} does not split into {args.microbatches} equal micro-batches")
    require_torchrun("torchrun --standalone --nproc_per_node=2")
    main(args)
