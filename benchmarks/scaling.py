"""How well does DDP scale here? Samples/s for 1..N processes, against this machine's own ceiling, in one run.

    python benchmarks/scaling.py                            # CPU, world sizes 1..cores (and GPUs, if any)
    python benchmarks/scaling.py --rounds 8 --max_procs 4   # longer, steadier, wider
    python benchmarks/scaling.py --devices gpu              # GPUs only (NCCL)

For each world size N, N processes start (one CPU thread each, OMP_NUM_THREADS=1 and gloo; or one GPU each and
NCCL) and take turns, round after round, between two ways of training on the same data:
  DDP:         N epochs of multigpu.py's Trainer: DDP model, DistributedSampler, gradients all-reduced each step
  independent: one epoch of single_gpu.py's Trainer in every process: the same compute, no communication at all
so every process works through the whole dataset once per turn either way. A barrier starts each turn on every
process at once; a turn's throughput is all the processes' samples over the slowest one's time. Taking turns (in
ABBA order) means a busy neighbour on the machine slows both alike; each figure is the best of the rounds (the
first round is warm-up and does not count): other work only ever slows a turn down. Still, DDP's ranks wait for
each other at every step, so on a machine that other programs keep busy DDP loses more than independent
processes do: the header and the last line print the load average, to judge the figures by.

- efficiency = DDP(N) / (N x DDP(1)): how close to N times faster.
- ceiling = independent(N) / independent(1): what N processes reach here with nothing to share. Cores share
  caches, memory bandwidth and clock budgets, so on a laptop the ceiling is often well below N.
- of ceiling = (DDP(N) / DDP(1)) / ceiling: the part of the reachable speed-up DDP delivers; the rest is what
  communication and waiting for the slowest rank cost.
- DDP CPU time per sample, as a multiple of the independent processes': what DDP's own work (all-reduces, gloo's
  threads, the sampler) adds per sample. Time the core spent on other programs is not in it, so unlike the
  speed-ups it holds on a busy machine; it cannot see time lost waiting for a slower rank.
The default workload is compute-bound (fakedata: a small CNN on 32x32 images, ~30k weights, so tens of
milliseconds of arithmetic per gradient all-reduce), so the numbers are about training, not about Python.
"""
import argparse
import contextlib
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as `python benchmarks/scaling.py` from anywhere; the step scripts import too

from harness.jobs import free_port, machine_summary, spawned_result  # noqa: E402
from tools.plot_metrics import plot_speedups  # noqa: E402
from utils import WORKLOADS, exit_without_teardown, positive_int  # noqa: E402


def timed_turn(trainer, epochs):
    """(wall-clock, CPU) seconds `epochs` epochs of `trainer` take on this process, started on every process at once.

    CPU time counts every thread of this process (gloo's too) and not the time other programs held the core.
    """
    import torch.distributed as dist

    dist.barrier()
    start, start_cpu = time.perf_counter(), time.process_time()
    with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
        for epoch in epochs:
            trainer._run_epoch(epoch)  # ends with .item(): the device's work is done when it returns
    return time.perf_counter() - start, time.process_time() - start_cpu


def worker(rank, world_size, device_kind, args, result_path):
    import torch
    import torch.distributed as dist

    import multigpu
    import single_gpu
    from utils import make_workload

    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if device_kind == "gpu" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=args.timeout))
    alone, shared = make_workload(args.workload), make_workload(args.workload)  # same data, same initial weights
    trainers = {
        "independent": single_gpu.Trainer(alone.model, single_gpu.prepare_dataloader(alone.train_set, args.batch_size),
                                          alone.optimizer, alone.loss_fn, device, save_every=1),
        "ddp": multigpu.Trainer(shared.model, multigpu.prepare_dataloader(shared.train_set, args.batch_size),
                                shared.optimizer, shared.loss_fn, device, save_every=1),
    }
    # A DDP epoch gives each rank 1/N of the data: N of them per turn give every process the same work as
    # one independent epoch, so both kinds of turn last about as long.
    epochs_per_turn = {"independent": 1, "ddp": world_size}
    samples = {kind: world_size * len(trainer.train_data.sampler) * epochs_per_turn[kind]
               for kind, trainer in trainers.items()}
    rates = {kind: [] for kind in trainers}
    per_cpu_second = {kind: [] for kind in trainers}
    for round_ in range(args.rounds + 1):
        for kind, trainer in list(trainers.items())[::1 if round_ % 2 else -1]:  # ABBA: drift favours neither
            turn = range(round_ * epochs_per_turn[kind], (round_ + 1) * epochs_per_turn[kind])
            wall, cpu = timed_turn(trainer, turn)
            slowest = torch.tensor([wall], device=device)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # the slowest process sets the pace
            cpu_total = torch.tensor([cpu], device=device)
            dist.all_reduce(cpu_total)
            if round_ > 0:  # round 0 warms up: allocator, caches, first all-reduce
                rates[kind].append(samples[kind] / slowest.item())
                per_cpu_second[kind].append(samples[kind] / cpu_total.item())
    if rank == 0:
        best = {kind: max(r) for kind, r in rates.items()}
        best.update({f"{kind}_per_cpu_s": max(r) for kind, r in per_cpu_second.items()})
        Path(result_path).write_text(json.dumps(best))
    dist.destroy_process_group()
    exit_without_teardown()  # as the step scripts do: a gloo thread may still hold tensors at interpreter exit


@contextlib.contextmanager
def gpus_hidden(hide):
    """The processes started inside see no GPU when `hide`: the CPU figures stay CPU figures on a GPU machine."""
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    if hide:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before


def measure(device_kind, procs, args):
    """{"ddp": samples/s, "independent": samples/s} for `procs` processes."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1")
    with gpus_hidden(device_kind == "cpu"):
        return spawned_result(worker, (procs, device_kind, args), procs, args.timeout,
                              f"{procs} processes on {device_kind}")


def scale(device_kind, max_procs, args):
    """The measured rows of 1..max_procs processes: procs, and measure()'s figures."""
    rows = []
    for procs in range(1, max_procs + 1):
        rows.append(dict(procs=procs, **measure(device_kind, procs, args)))
        print(f"  {device_kind} N={procs}: DDP {rows[-1]['ddp']:,.0f} samples/s, "
              f"independent {rows[-1]['independent']:,.0f} samples/s", flush=True)
    return rows


def with_ratios(rows):
    """Each measured row with its ratios to one process (the first row), as the module's docstring defines them."""
    one, ratioed = rows[0], []
    for row in rows:
        speedup, ceiling = row["ddp"] / one["ddp"], row["independent"] / one["independent"]
        cpu_ratio = row["independent_per_cpu_s"] / row["ddp_per_cpu_s"]
        ratioed.append(dict(row, speedup=speedup, efficiency=speedup / row["procs"], ceiling=ceiling,
                            of_ceiling=speedup / ceiling, cpu_ratio=cpu_ratio))
    return ratioed


def table(device_kind, rows):
    lines = [f"| {device_kind} processes | DDP samples/s | speed-up | efficiency | independent samples/s "
             "| ceiling | DDP of ceiling | DDP CPU time per sample |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['procs']} | {r['ddp']:,.0f} | {r['speedup']:.2f}x | {r['efficiency']:.2f} | "
              f"{r['independent']:,.0f} | {r['ceiling']:.2f}x | {r['of_ceiling']:.2f} | {r['cpu_ratio']:.2f}x |"
              for r in rows]
    return "\n".join(lines)


def plot(results, out_path, title):
    curves = []
    for device_kind, rows in results.items():
        procs = [r["procs"] for r in rows]
        curves += [(f"{device_kind}: ceiling (independent processes)", procs, [r["ceiling"] for r in rows], "s--", {}),
                   (f"{device_kind}: DDP", procs, [r["speedup"] for r in rows], "o-", {})]
    plot_speedups(curves, "speed-up over one process", out_path, title, ideal=True)


def report(measured, plot_path, title):
    """From the measured rows of each device kind ({kind: scale()'s rows}): its table, what its widest world size
    reaches, and the plot of them all."""
    results = {device_kind: with_ratios(rows) for device_kind, rows in measured.items()}
    for device_kind, rows in results.items():
        widest = rows[-1]
        print(f"\n{table(device_kind, rows)}\n\n{device_kind}: {widest['procs']} processes reach "
              f"{widest['speedup']:.2f}x of one with DDP, {widest['of_ceiling']:.2f} of the {widest['ceiling']:.2f}x "
              f"that {widest['procs']} independent processes reach on this machine; it spends "
              f"{widest['cpu_ratio']:.2f}x their CPU time per sample")
    Path(plot_path).parent.mkdir(parents=True, exist_ok=True)
    plot(results, plot_path, title)
    print(f"plot: {plot_path}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", choices=["all", "cpu", "gpu"], default="all",
                        help="cpu (gloo), gpu (nccl), or all this machine has (default)")
    parser.add_argument("--max_procs", type=positive_int, help="largest world size (default: CPU cores / GPUs)")
    parser.add_argument("--rounds", type=positive_int, default=3, help="measured epochs of each kind (default 3)")
    parser.add_argument("--workload", default="fakedata", choices=WORKLOADS, help="what to train (default fakedata)")
    parser.add_argument("--batch_size", type=positive_int, default=32, help="batch size per process")
    parser.add_argument("--timeout", type=positive_int, default=300, help="seconds one world size may take")
    parser.add_argument("--plot", default=str(REPO / "benchmarks" / "results" / "scaling.png"),
                        help="PNG to write (default benchmarks/results/scaling.png)")
    args = parser.parse_args()

    import torch  # here, so that --help and bad flags answer at once

    gpus = torch.cuda.device_count()
    devices = {"all": ["cpu"] + (["gpu"] if gpus else []), "cpu": ["cpu"], "gpu": ["gpu"]}[args.devices]
    if "gpu" in devices and not gpus:
        sys.exit("error: --devices gpu, but this machine has no CUDA device")
    print(f"scaling of {args.workload}, batch {args.batch_size} per process, {args.rounds} rounds, on "
          f"{machine_summary()}", flush=True)
    os.environ.pop("TUTORIAL_RUN_DIR", None)  # the trainers' per-rank metrics files are not wanted here
    measured = {}
    for device_kind in devices:
        measured[device_kind] = scale(device_kind, args.max_procs or (gpus if device_kind == "gpu" else os.cpu_count()),
                                      args)
    report(measured, args.plot, f"DDP scaling: {args.workload}, batch {args.batch_size} per process")
    print(f"at the end: {machine_summary()}")


if __name__ == "__main__":
    main()
