"""Exercise 12 - the hang clinic: three short training jobs that hang on CPU ranks. For each, find which rank,
which collective and which line, write them in DIAGNOSIS, then fix the case so that it computes what it should.

The three cases are real patterns: ranks that take different branches around a collective (--case branch), a held-out
set that does not divide evenly over the ranks (--case heldout), and two collectives issued in a different order on
one rank (--case order). Run one on 3 CPU ranks; --timeout bounds every collective, so a hang ends with one line:
    torchrun --standalone --nproc_per_node=3 my_clinic.py --case branch --timeout 10
Turn the Flight Recorder on to see every rank's collectives, each with the line that called it, then read the dumps
with torch's analyzer (docs/flight-recorder.md):
    TORCH_FR_BUFFER_SIZE=2000 TORCH_FR_DUMP_TEMP_FILE=/tmp/clinic/fr_ torchrun ... (mkdir -p /tmp/clinic first)
    torchfrtrace /tmp/clinic -p fr_
Work on a copy in the repository root (so `from utils import ...` works): cp exercises/12_hang_clinic/start.py
my_clinic.py. DIAGNOSIS names lines of start.py as given (the copy's, until you change it). Check it with
    python exercises/check.py 12 my_clinic.py
Rank 0 prints the case's result (logged losses, held-out loss, weights' sums): the same on any number of ranks.
"""
import argparse
import json
import os
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F

from utils import attempt_store, collectives_timeout, configure_cpu_threads, exit_without_teardown, positive_int
from utils.launch import dump_flight_recorder, flight_recorder_on, watch_this_worker

# Your diagnosis of each case, as start.py is given: the rank out of step with the others, the collective that rank
# called where the others called another one, and the line of start.py that called it.
DIAGNOSIS = {
    "branch": {"rank": None, "collective": None, "line": None},  # TODO (case branch)
    "heldout": {"rank": None, "collective": None, "line": None},  # TODO (case heldout)
    "order": {"rank": None, "collective": None, "line": None},  # TODO (case order)
}
CASES = tuple(DIAGNOSIS)
TRAIN_SAMPLES = 48  # 16 per rank on 3 ranks: the ranks' mean gradient is the whole set's
HELD_OUT_SAMPLES = 8  # 3, 3 and 2 on 3 ranks
FEATURES = 4
STEPS = 30
LOG_EVERY = 10
LEARNING_RATE = 0.1
EVAL_BATCH = 2
WARM_UP_SAMPLES = 8
WARM_UP_STEPS = 5


def samples(count, seed):
    """`count` inputs and their targets, the same on every rank: a fixed random linear map, plus a little noise."""
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(count, FEATURES, generator=generator)
    mapping = torch.randn(FEATURES, FEATURES, generator=torch.Generator().manual_seed(0))
    return inputs, torch.tanh(inputs @ mapping) + 0.1 * torch.randn(count, FEATURES, generator=generator)


def make_model():
    # The same seed on every rank: every rank builds the same initial weights.
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, FEATURES, bias=False), torch.nn.Tanh(),
                               torch.nn.Linear(FEATURES, FEATURES, bias=False))


def average_gradients(model, world_size):
    # Every rank sums the same parameters' gradients in the same order, then divides: the mean gradient.
    for param in model.parameters():
        dist.all_reduce(param.grad)
        param.grad /= world_size


def descend(model):
    with torch.no_grad():
        for param in model.parameters():
            param -= LEARNING_RATE * param.grad


def train(model, rank, world_size):
    """STEPS of data-parallel training: each rank's gradients on its share of the samples, averaged over the ranks."""
    inputs, targets = samples(TRAIN_SAMPLES, seed=1)
    mine = slice(rank, None, world_size)  # this rank's share of the samples
    for _ in range(STEPS):
        model.zero_grad()
        F.mse_loss(model(inputs[mine]), targets[mine]).backward()
        average_gradients(model, world_size)
        descend(model)
    return model


def logged_loss(loss, rank, world_size):
    """The mean of the ranks' losses, for rank 0's log (None on the other ranks)."""
    # Only rank 0 logs, so only rank 0 asks for the sum of the losses.
    if rank == 0:
        total = loss.detach().clone()
        dist.reduce(total, dst=0)
        return total.item() / world_size
    return None


def train_branch(rank, world_size):
    model = make_model()
    inputs, targets = samples(TRAIN_SAMPLES, seed=1)
    mine = slice(rank, None, world_size)
    history = []
    for step in range(STEPS):
        model.zero_grad()
        loss = F.mse_loss(model(inputs[mine]), targets[mine])
        loss.backward()
        average_gradients(model, world_size)
        descend(model)
        if step % LOG_EVERY == 0:
            history.append(logged_loss(loss, rank, world_size))
    return model, {"history": history}


def warm_up(model):
    """A few steps on the first WARM_UP_SAMPLES samples, in one process."""
    inputs, targets = samples(TRAIN_SAMPLES, seed=1)
    for _ in range(WARM_UP_STEPS):
        model.zero_grad()
        F.mse_loss(model(inputs[:WARM_UP_SAMPLES]), targets[:WARM_UP_SAMPLES]).backward()
        descend(model)


def broadcast_weights(model):
    for param in model.parameters():
        dist.broadcast(param.data, src=0)


def warm_start(model, rank):
    """Every rank starts from rank 0's weights, once rank 0 has warmed them up."""
    if rank == 0:
        warm_up(model)
        # Rank 0 sends its weights as soon as they are ready, then lets the others go on.
        broadcast_weights(model)
        dist.barrier()
    else:
        # The others wait until rank 0 is ready, then receive its weights.
        dist.barrier()
        broadcast_weights(model)


def train_order(rank, world_size):
    model = make_model()
    warm_start(model, rank)
    return train(model, rank, world_size), {}


def held_out_loss(model, rank, world_size):
    """The mean squared error over every held-out sample, each counted once."""
    inputs, targets = samples(HELD_OUT_SAMPLES, seed=2)
    mine = list(range(rank, HELD_OUT_SAMPLES, world_size))  # this rank's share: 3, 3 and 2 samples on 3 ranks
    totals = torch.zeros(2)  # [summed squared errors, values]
    with torch.no_grad():
        for first in range(0, len(mine), EVAL_BATCH):
            batch = mine[first:first + EVAL_BATCH]
            errors = (model(inputs[batch]) - targets[batch]) ** 2
            batch_totals = torch.tensor([errors.sum().item(), errors.numel()])
            # Summed over the ranks batch by batch: every rank holds the running totals.
            dist.all_reduce(batch_totals)
            totals += batch_totals
    return (totals[0] / totals[1]).item()


def train_heldout(rank, world_size):
    model = train(make_model(), rank, world_size)
    return model, {"held_out": held_out_loss(model, rank, world_size)}


TRAIN = {"branch": train_branch, "heldout": train_heldout, "order": train_order}


def run_case(case, rank, world_size):
    """Train (and evaluate) one case in this process; what rank 0 reports: the case's numbers and the weights' sums."""
    model, result = TRAIN[case](rank, world_size)
    result["weights"] = [round(param.sum().item(), 6) for param in model.parameters()]
    return result


def main(args):
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # From here on a hang, a lost torchrun or Ctrl-C stops this worker with one line (utils/launch.py).
    watch_this_worker(args.timeout, args.rendezvous_timeout)
    dist.init_process_group("gloo", store=attempt_store(args.timeout, args.rendezvous_timeout), rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=args.rendezvous_timeout))
    collectives_timeout(args.timeout)  # the group waits for every rank to start; a collective, only --timeout
    configure_cpu_threads(world_size)
    result = run_case(args.case, rank, world_size)
    # Every rank has finished before rank 0 reports.
    dist.barrier()
    if rank == 0:
        print(f"[rank 0/{world_size} | cpu] case {args.case} | result {json.dumps(result)}")
    if flight_recorder_on():
        # Written at the end too: a job that finishes, with a wrong result, is diagnosed from its collectives as well.
        print(f"[rank {rank}/{world_size} | cpu] Flight Recorder: {dump_flight_recorder()}")
    dist.destroy_process_group()
    exit_without_teardown()  # Python's teardown can abort under gloo: see utils


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", required=True, choices=CASES, help="Which case of the clinic to run")
    parser.add_argument("--timeout", default=10, type=positive_int, help="Seconds before a stuck collective fails")
    parser.add_argument("--rendezvous_timeout", default=120, type=positive_int,
                        help="Seconds for every rank to start and join the process group (a busy machine is slow)")
    main(parser.parse_args())
