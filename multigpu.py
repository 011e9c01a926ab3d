"""Step 2 - DistributedDataParallel with mp.spawn: one process per GPU, or N CPU processes on gloo.

    python multigpu.py 50 10            # TOTAL_EPOCHS SAVE_EVERY; --world_size N for N CPU processes
"""
import argparse
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from utils import (WORKLOADS, configure_cpu_threads, evaluate, exit_without_teardown, log_rank_metrics, make_workload,
                   positive_int, rendezvous_port, replacing, require_a_gpu_each, stop_on_signals)


def ddp_setup(rank, world_size, timeout_s):
    if torch.cuda.is_available():
        # Before the process group forms: each process its own GPU.
        torch.cuda.set_device(rank)
    # Every process meets the others at MASTER_ADDR:MASTER_PORT; a collective stuck past the timeout fails.
    dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=timeout_s))


class Trainer:
    def __init__(self, model, train_data, optimizer, loss_fn, device, save_every):
        self.rank = dist.get_rank()
        self.device = device
        self.model = model.to(device)
        self.train_data = train_data
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.save_every = save_every
        self.tag = f"[rank {self.rank}/{dist.get_world_size()} | {device}]"
        # DDP broadcasts rank 0's weights, then all-reduces (averages) the gradients inside backward().
        self.model = DDP(self.model, device_ids=[device.index] if device.type == "cuda" else None)

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.loss_fn(self.model(source), targets)
        loss.backward()
        self.optimizer.step()
        return loss.detach()

    def _run_epoch(self, epoch):
        start = time.perf_counter()
        # A new shuffle each epoch, the same on every rank.
        self.train_data.sampler.set_epoch(epoch)
        # [summed loss, samples], kept on the device.
        totals = torch.zeros(2, device=self.device)
        for source, targets in self.train_data:
            source, targets = source.to(self.device), targets.to(self.device)
            totals[0] += self._run_batch(source, targets) * len(source)
            totals[1] += len(source)
        log_rank_metrics(epoch, len(self.train_data), totals, start)
        # Summed over the ranks: the loss below is their mean.
        dist.all_reduce(totals)
        # Waits for the device: the clock below is honest.
        mean_loss = (totals[0] / totals[1]).item()
        samples_per_s = totals[1].item() / (time.perf_counter() - start)
        if self.rank == 0:
            print(f"{self.tag} epoch {epoch} | steps {len(self.train_data)} | loss {mean_loss:.4f} | "
                  f"{samples_per_s:,.0f} samples/s")

    def _save_checkpoint(self, epoch):
        # Written to a file of its own, then renamed over the last one: a crash never leaves half a file.
        with replacing("checkpoint.pt") as tmp:
            torch.save(self.model.module.state_dict(), tmp)  # .module: the model inside DDP
        print(f"{self.tag} epoch {epoch} | checkpoint saved to checkpoint.pt")

    def train(self, max_epochs):
        for epoch in range(max_epochs):
            self._run_epoch(epoch)
            if (epoch + 1) % self.save_every == 0 or epoch + 1 == max_epochs:
                # The replicas are identical: one writer.
                if self.rank == 0:
                    self._save_checkpoint(epoch)


def load_train_objs(args):
    # Data, model, optimizer and loss, as in every step.
    return make_workload(args.workload)


def prepare_dataloader(dataset: Dataset, batch_size: int):
    return DataLoader(dataset, batch_size=batch_size, pin_memory=torch.cuda.is_available(),
                      shuffle=False, sampler=DistributedSampler(dataset))  # each rank its own 1/world_size


def main(rank, world_size, args):
    ddp_setup(rank, world_size, args.timeout)
    device = torch.device(f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu")
    # The job's processes share this machine's cores.
    configure_cpu_threads(dist.get_world_size())
    workload = load_train_objs(args)
    train_data = prepare_dataloader(workload.train_set, args.batch_size)
    trainer = Trainer(workload.model, train_data, workload.optimizer, workload.loss_fn, device,
                      args.save_every)
    trainer.train(args.total_epochs)
    metrics = evaluate(trainer.model, workload.eval_set, workload.loss_fn, device, workload.classification)
    if trainer.rank == 0:
        print(f"{trainer.tag} held-out {len(workload.eval_set)} samples | {metrics}")
    dist.destroy_process_group()
    # Python's teardown can abort under gloo: see utils.
    exit_without_teardown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("total_epochs", type=positive_int, help="Total epochs to train the model")
    parser.add_argument("save_every", type=positive_int, help="How often to save (in epochs)")
    parser.add_argument("--batch_size", default=32, type=positive_int, help="Input batch size per process")
    parser.add_argument("--workload", default="synthetic", choices=WORKLOADS, help="What to train")
    parser.add_argument("--timeout", default=60, type=positive_int, help="Seconds before a stuck collective fails")
    parser.add_argument("--world_size", type=positive_int, help="Processes (default: every GPU, or 2 on CPU)")
    args = parser.parse_args()

    world_size = require_a_gpu_each(args.world_size or torch.cuda.device_count() or 2, "--world_size")
    print(f"{world_size} processes " + ("on NCCL, one per GPU" if torch.cuda.is_available() else "on gloo (no CUDA)"))
    os.environ.update(MASTER_ADDR="localhost", MASTER_PORT=rendezvous_port())  # rank 0 listens there
    # Ctrl-C: one line, and the last checkpoint whole.
    stop_on_signals()
    mp.spawn(main, args=(world_size, args), nprocs=world_size)
