"""nn.DataParallel against DistributedDataParallel: the same model, the same global batch, the same number of steps.

    python benchmarks/dataparallel_vs_ddp.py                      # every GPU; on a CPU-only machine, see below
    python benchmarks/dataparallel_vs_ddp.py --workload wide --steps 50 --batch_size 512

DataParallel is one process: every step it copies the model to each GPU, scatters the batch from GPU 0, runs the
replicas in threads of that one process (which share one Python interpreter, and so its GIL) and gathers the outputs
back on GPU 0, which also does all the loss and optimizer work. DDP is one process per GPU: each keeps its own replica
and only the gradients travel, all-reduced while backward still runs.

Without CUDA, DataParallel does nothing at all: it calls the module as it is, in one process. On a CPU this script
therefore compares one process training the whole batch with DDP's processes (gloo) training a share each; that is
a fair picture of "one process or several", not of DataParallel, and it prints so.
"""
import argparse
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: `utils` without installing anything
from harness.jobs import free_port, spawned_result  # noqa: E402
from utils import (WORKLOADS, configure_cpu_threads, exit_without_teardown, make_workload,  # noqa: E402
                   positive_int)


def batches(workload, batch_size, steps, rank=0, world_size=1):
    """`steps` batches of this rank's share of a global batch, cycling through the training set."""
    inputs, targets = workload.train_set.tensors
    share = batch_size // world_size
    for step in range(steps):
        start = (step * batch_size + rank * share) % (len(inputs) - share + 1)
        yield inputs[start:start + share], targets[start:start + share]


def timed_steps(model, workload, device, data, warmup):
    """Train on `data`; the seconds taken by all but the first `warmup` steps (allocator, threads, NCCL warm-up)."""
    optimizer = type(workload.optimizer)(model.parameters(), **workload.optimizer.defaults)
    start = None
    for step, (source, targets) in enumerate(data):
        if step == warmup:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = workload.loss_fn(model(source.to(device)), targets.to(device))
        loss.backward()
        optimizer.step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def run_dataparallel(args):
    workload = make_workload(args.workload)
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    configure_cpu_threads(1)  # one process: all the cores
    model = nn.DataParallel(workload.model.to(device))  # no CUDA: DataParallel just calls the module
    seconds = timed_steps(model, workload, device, batches(workload, args.batch_size, args.steps), args.warmup)
    return args.batch_size * (args.steps - args.warmup) / seconds


def ddp_worker(rank, world_size, args, result_path):
    if torch.cuda.is_available():
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=120))
    configure_cpu_threads(world_size)
    workload = make_workload(args.workload)
    device = torch.device(f"cuda:{rank}" if torch.cuda.is_available() else "cpu")
    model = DDP(workload.model.to(device), device_ids=[rank] if device.type == "cuda" else None)
    data = batches(workload, args.batch_size, args.steps, rank, world_size)
    seconds = torch.tensor(timed_steps(model, workload, device, data, args.warmup), device=device)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)  # the job is as fast as its slowest process
    if rank == 0:
        Path(result_path).write_text(json.dumps(args.batch_size * (args.steps - args.warmup) / seconds.item()))
    dist.destroy_process_group()
    exit_without_teardown()  # as the step scripts do: a gloo thread may still hold tensors at interpreter exit


def run_ddp(args, world_size):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    return spawned_result(ddp_worker, (world_size, args), world_size, args.timeout, f"DDP with {world_size} processes")


def report(args, gpus, world_size, dataparallel, ddp):
    """The measured samples/s of both ways, and DDP's against DataParallel's (on a CPU: one process's)."""
    label = "DataParallel" if gpus else "one process (DataParallel is a no-op without CUDA)"
    print(f"{args.workload}: global batch {args.batch_size}, {args.steps - args.warmup} timed steps")
    print(f"  {label:<52} {dataparallel:>12,.0f} samples/s")
    print(f"  {f'DDP, {world_size} processes':<52} {ddp:>12,.0f} samples/s")
    print(f"  DDP / {'DataParallel' if gpus else 'one process'}: {ddp / dataparallel:.2f}x")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="wide", choices=WORKLOADS, help="What to train")
    parser.add_argument("--steps", default=30, type=positive_int, help="Training steps, warm-up included")
    parser.add_argument("--warmup", default=5, type=positive_int, help="First steps left out of the timing")
    parser.add_argument("--batch_size", default=256, type=positive_int, help="Global batch, split over devices")
    parser.add_argument("--world_size", type=positive_int, help="DDP processes (default: every GPU, or 2 on CPU)")
    parser.add_argument("--timeout", default=600, type=positive_int, help="Seconds the DDP processes may take")
    args = parser.parse_args()
    gpus = torch.cuda.device_count()
    world_size = args.world_size or gpus or 2
    if args.warmup >= args.steps:
        raise SystemExit(f"error: --warmup {args.warmup} leaves no step to time out of --steps {args.steps}")
    if world_size > gpus > 0:
        raise SystemExit(f"error: --world_size {world_size} > {gpus} GPUs (DDP: one process per GPU)")
    if args.batch_size % world_size:
        raise SystemExit(f"error: --batch_size {args.batch_size} does not split evenly over {world_size} processes")

    if gpus:
        print(f"{torch.cuda.get_device_name(0)} x {gpus}: DataParallel over {gpus} GPU(s) in one process, "
              f"DDP with {world_size} process(es), one per GPU")
    else:
        print("No CUDA device: DataParallel does nothing here (it calls the module as it is, in one process).\n"
              f"So 'DataParallel' below is one CPU process on the whole batch; DDP is {world_size} CPU processes "
              "(gloo), each on its share.")
    dataparallel = run_dataparallel(args)
    ddp = run_ddp(args, world_size)
    report(args, gpus, world_size, dataparallel, ddp)


if __name__ == "__main__":
    main()
