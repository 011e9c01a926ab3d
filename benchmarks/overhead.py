"""What does the tutorial's training loop cost on top of the bare minimum? Per-step time of single_gpu.py's Trainer
against a hand-written loop, on the same model, data and device, in one process.

    python benchmarks/overhead.py                               # synthetic and fakedata, one CPU thread
    python benchmarks/overhead.py --workloads fakedata --rounds 20

The bare loop is zero_grad / forward / loss / backward / step over the same DataLoader and nothing else. The
Trainer adds what the tutorial teaches and shows: the per-epoch [summed loss, samples] tensor (updated on the
device every step, read once per epoch), the epoch line, and the per-rank metrics call. The two take turns
(ABBA order, so a drifting machine favours neither), each turn a whole number of epochs of at least
--min_seconds. On a CPU they are timed in this process's CPU time, so other programs on the machine do not
count; on a GPU in wall-clock time. The figure is the ratio of the best turns (whatever else happens only ever
slows a turn down). Goal: at most 1.10x.
"""
import argparse
import contextlib
import math
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as `python benchmarks/overhead.py` from anywhere

from harness.jobs import machine_summary  # noqa: E402
from utils import WORKLOADS, positive_int  # noqa: E402

GOAL = 1.10


def bare_epoch(model, loader, optimizer, loss_fn, device):
    """The least a training epoch can be."""
    for source, targets in loader:
        source, targets = source.to(device), targets.to(device)
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(source), targets)
        loss.backward()
        optimizer.step()


def compare(workload_name, args, device):
    """(trainer seconds per step, bare seconds per step), the best turn of each, steps per epoch, epochs per turn."""
    import torch

    import single_gpu
    from utils import make_workload

    mine, bare = make_workload(workload_name), make_workload(workload_name)  # same data, same initial weights
    trainer = single_gpu.Trainer(mine.model, single_gpu.prepare_dataloader(mine.train_set, args.batch_size),
                                 mine.optimizer, mine.loss_fn, device, save_every=1)
    bare_model, bare_loader = bare.model.to(device), single_gpu.prepare_dataloader(bare.train_set, args.batch_size)
    steps = len(bare_loader)
    epoch = 0

    def trainer_turn(epochs):
        nonlocal epoch
        with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
            for _ in range(epochs):
                trainer._run_epoch(epoch)  # ends with .item(): the device is done when it returns
                epoch += 1

    def bare_turn(epochs):
        for _ in range(epochs):
            bare_epoch(bare_model, bare_loader, bare.optimizer, bare.loss_fn, device)
        if device.type == "cuda":
            torch.cuda.synchronize()  # the bare loop never waits for the device on its own

    # On a CPU, count this process's CPU time: the loops run in this one thread, and time spent waiting while
    # other programs use the cores is not the loop's cost. A GPU works while the CPU waits: wall-clock time.
    clock = time.perf_counter if device.type == "cuda" else time.process_time

    def seconds_per_step(turn, epochs):
        start = clock()
        turn(epochs)
        return (clock() - start) / (epochs * steps)

    seconds_per_step(bare_turn, 1)  # warm-up for both: allocator, caches
    epochs = max(1, math.ceil(args.min_seconds / (seconds_per_step(trainer_turn, 1) * steps)))
    times = {"trainer": [], "bare": []}
    for round_ in range(args.rounds):
        order = [("trainer", trainer_turn), ("bare", bare_turn)]
        for name, turn in order if round_ % 2 == 0 else order[::-1]:
            times[name].append(seconds_per_step(turn, epochs))
    return min(times["trainer"]), min(times["bare"]), steps, epochs


def row(name, trainer, bare, steps):
    """A workload's row of the table, from its seconds per step with the Trainer and with the bare loop."""
    return f"| {name} | {steps} | {bare * 1e3:.3f} | {trainer * 1e3:.3f} | {trainer / bare:.3f}x |"


def verdict(ratios):
    """The worst of the workloads' Trainer / bare ratios against the goal."""
    worst = max(ratios)
    return f"worst ratio {worst:.3f}x (goal <= {GOAL:.2f}x): {'met' if worst <= GOAL else 'NOT met'}"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=["synthetic", "fakedata"], choices=WORKLOADS,
                        help="which workloads (default: synthetic, the smallest steps, and fakedata)")
    parser.add_argument("--rounds", type=positive_int, default=6, help="turns of each loop (default 6)")
    parser.add_argument("--min_seconds", type=float, default=0.5, help="shortest turn, in whole epochs (0.5)")
    parser.add_argument("--batch_size", type=positive_int, default=32, help="batch size")
    parser.add_argument("--threads", type=positive_int, default=1, help="CPU threads (default 1)")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    os.environ.pop("TUTORIAL_RUN_DIR", None)  # the metrics call stays in the loop, as a no-op: no file I/O timed
    print(f"single_gpu.py Trainer vs a bare loop on {device}, {args.threads} CPU thread(s), batch {args.batch_size}, "
          f"{args.rounds} rounds; {machine_summary()}", flush=True)
    print("| workload | steps/epoch | bare ms/step | Trainer ms/step | ratio |\n|---|---:|---:|---:|---:|")
    ratios = []
    for name in args.workloads:
        trainer, bare, steps, _ = compare(name, args, device)
        ratios.append(trainer / bare)
        print(row(name, trainer, bare, steps), flush=True)
    print(f"\n{verdict(ratios)}\nat the end: {machine_summary()}")


if __name__ == "__main__":
    main()
